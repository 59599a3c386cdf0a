"""What a layer's pieces keep for the backward, in a bf16 run: Korthikanti et
al.'s count (the norm's input and its reciprocal rms, the attention
probabilities once in bf16, an MLP nonlinearity's inputs), not what autodiff
of the fp32 arithmetic kept beside them (fp32 copies, softmax's fp32 output,
tanh / sigmoid internals), and no bf16 copy of a layer's weights without
remat; under remat=attention (Megatron's selective recomputation) the
same less the probabilities. Read from JAX's own list of saved residuals;
each piece's gradient is autodiff's to fp32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from triax.model import common, context, gpt

B, S, D, F, N, H = 2, 8, 16, 32, 4, 8


def _kept(fn, *args):
  """(dtype, shape) of every residual that is not an argument of `fn`."""
  loss = lambda *a: fn(*a).astype(jnp.float32).sum()  # noqa: E731
  return sorted(
    (str(aval.dtype), aval.shape)
    for aval, why in saved_residuals(loss, *args)
    if 'from the argument' not in why and aval.shape
  )


def _x(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape).astype(jnp.bfloat16)


@pytest.mark.fast
def test_a_bf16_layer_keeps_the_papers_residuals():
  scale = jnp.ones((D,), jnp.float32)
  assert _kept(lambda x, w: common.rms_norm(x, w, 1e-6), _x((B, S, D)), scale) == [
    ('float32', (B, S, 1))
  ]
  q = _x((B, S, N, H))
  attention = lambda q, k, v: context.masked_attention(q, k, v, jnp.arange(S))  # noqa: E731
  assert _kept(attention, q, _x((B, S, N, H), 1), _x((B, S, N, H), 2)) == [
    ('bfloat16', (B, N, S, S))
  ]
  assert _kept(common.swiglu, _x((B, S, F)), _x((B, S, F), 1)) == []
  assert _kept(gpt.gelu, _x((B, S, F))) == []


@pytest.mark.fast
@pytest.mark.parametrize(
  'ours, autodiff',
  [
    (lambda x: common._rms_norm(x[..., :D], x[0, 0, D:], 1e-6), None),
    (
      lambda x: common.swiglu(x[..., :D], x[..., D:]),
      lambda x: jax.nn.silu(x[..., :D]) * x[..., D:],
    ),
    (gpt.gelu, jax.nn.gelu),
  ],
)
def test_each_backward_is_autodiffs(ours, autodiff):
  x = 3 * jax.random.normal(jax.random.key(0), (B, S, 2 * D))
  if autodiff is None:  # rms_norm: x / rms(x) * scale, written out

    def autodiff(x):
      y, w = x[..., :D], x[0, 0, D:]
      return y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6) * w

  grad = lambda f: jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)  # noqa: E731
  np.testing.assert_allclose(grad(ours), grad(autodiff), rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_attention_backward_is_autodiffs_of_xlas_attention():
  q, k, v = (jax.random.normal(jax.random.key(i), (B, S, N, H)) for i in range(3))
  pos = jnp.arange(S)

  def reference(q, k, v):
    bias = context.bias(pos, pos, None, None)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation='xla')

  grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(q, k, v)  # noqa: E731
  ours = grad(lambda q, k, v: context.masked_attention(q, k, v, pos))
  for a, b in zip(ours, grad(reference)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.fast
def test_a_weights_matmul_keeps_no_cast_of_it_without_remat():
  x, w = _x((B, S, D)), jax.random.normal(jax.random.key(3), (D, F))  # an fp32 weight

  def ours(x, w):
    return common.matmul('bsd,df->bsf', x, w, jnp.bfloat16, 'none')

  def autodiff(x, w):
    return jnp.einsum('bsd,df->bsf', x, w.astype(jnp.bfloat16))

  # Autodiff keeps the weight's bf16 cast; ours keeps its arguments only.
  assert _kept(autodiff, x, w) == [('bfloat16', (D, F))]
  assert _kept(ours, x, w) == []
  grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))), (0, 1))(x, w)  # noqa: E731
  for a, b in zip(grad(ours), grad(autodiff), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


# Llama's in the fast tier (GPT's is 2.5 s on jax 0.12).
@pytest.mark.parametrize('family', ['gpt', pytest.param('llama', marks=pytest.mark.fast)])
def test_a_bf16_layer_stack_keeps_no_copy_of_its_weights(family):
  import harness

  model = harness.model_of(
    family=family, dtype='bfloat16', remat='none', num_layers=2, d_model=32, d_ff=64
  )
  params = model.init(jax.random.key(0))
  stack, x = params['layers'], _x((B, model.spec.seq_len, 32))
  weights = {(a.shape, 'bfloat16') for a in jax.tree.leaves(stack)}
  kept = _kept(lambda x, p: model.layers(p, x), x, stack)
  assert kept and not [k for k in kept if (k[1], k[0]) in weights]


@pytest.mark.fast
@pytest.mark.parametrize('dispatch', ['dropless', 'capacity'])
def test_experts_keep_no_cast_of_their_weights(dispatch):
  from triax.model import moe

  experts = 4
  h = _x((B, S, D))
  ws = [
    jax.random.normal(jax.random.key(i), shape)
    for i, shape in enumerate([(experts, D, F), (experts, D, F), (experts, F, D)])
  ]
  router = jax.random.normal(jax.random.key(9), (D, experts))

  def layer(h, *ws):
    routing = moe.route(h, router, 2)
    if dispatch == 'capacity':
      return moe.capacity(h, routing, *ws, 2.0)[0]
    return moe.dropless(h, routing, *ws)

  kept = _kept(layer, h, *ws)
  assert kept and not [k for k in kept if k[1] in {w.shape for w in ws}]


def _layer_stack(family: str, remat: str, dtype: str = 'bfloat16'):
  import harness

  return harness.model_of(
    family=family, dtype=dtype, remat=remat, num_layers=2, d_model=32, d_ff=64, num_heads=4
  )


@pytest.mark.fast
@pytest.mark.parametrize('family', ['gpt', 'llama'])
def test_attention_remat_keeps_all_but_the_attention_cores_scores(family):
  """model.remat=attention is Megatron's selective recomputation: a layer
  keeps what it keeps without remat (Q, K, V, the attention's output, the
  norms' inputs, the MLP's) less the one [b, n, s, s] value, its
  probabilities, which the backward recomputes from Q and K (and the [s]
  positions its causal bias is made from); `dots` keeps no score square
  either, but recomputes all that is not a weight's matmul."""
  none = _layer_stack(family, 'none')
  stack = jax.eval_shape(none.init, jax.random.key(0))['layers']
  x = jax.ShapeDtypeStruct((B, none.spec.seq_len, 32), jnp.bfloat16)
  kept = {}
  for remat in ('none', 'attention', 'dots'):
    model = _layer_stack(family, remat)
    kept[remat] = _kept(lambda x, p, model=model: model.layers(p, x), x, stack)
  s, n = none.spec.seq_len, none.spec.num_heads
  scores = ('bfloat16', (2, B, n, s, s))  # the stacked layers' probabilities
  assert kept['none'].count(scores) == 1
  without = list(kept['none'])
  without.remove(scores)
  assert kept['attention'] == sorted(without + [('int32', (s,))])
  assert [k for k in kept['dots'] if k[1][-2:] == (s, s)] == []
  assert len(kept['dots']) < len(kept['attention'])


# GPT's in the fast tier (each is 2 s on jax 0.12).
@pytest.mark.parametrize('family', [pytest.param('gpt', marks=pytest.mark.fast), 'llama'])
def test_attention_remat_gives_remat_nones_gradient(family):
  """A policy changes what is kept, not what is computed: fp32 loss and
  gradients of a layer stack equal remat=none's."""
  models = {r: _layer_stack(family, r, 'float32') for r in ('none', 'attention')}
  params = jax.jit(models['none'].init)(jax.random.key(0))['layers']
  x = jax.random.normal(jax.random.key(1), (B, models['none'].spec.seq_len, 32))

  def grads(model):
    loss = lambda p, x: jnp.sum(jnp.sin(model.layers(p, x)))  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)

  got, want = grads(models['attention']), grads(models['none'])
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.fast
def test_gemmas_post_norms_keep_their_inputs_and_nothing_else_of_size():
  """A Gemma 3 layer keeps what a llama layer with q/k norms keeps, plus its
  post-norms' [b, s, d] inputs and reciprocal rms (under dots, the down
  projection's output only: attention's output is kept anyway), besides
  norm-scale-sized vectors (the fp32 1 + w): what the planner prices
  (tests/test_plan_analytic.py)."""
  import collections

  import harness

  s, d = 128, 32
  more = {}
  for remat in ('none', 'attention', 'dots', 'full'):
    kept = {}
    for family, extra in (('llama', {'qk_norm': True}), ('gemma3', {})):
      model = harness.model_of(
        family=family,
        dtype='bfloat16',
        remat=remat,
        num_layers=2,
        d_model=d,
        d_ff=64,
        num_heads=4,
        sliding_window=8,
        **extra,
      )
      stack = jax.eval_shape(model.init, jax.random.key(0))['layers']
      x = jax.ShapeDtypeStruct((B, s, d), jnp.bfloat16)
      kept[family] = collections.Counter(
        _kept(lambda x, p, model=model: model.layers(p, x), x, stack)
      )
    assert not kept['llama'] - kept['gemma3']
    # The stacked layers' fp32 1 + w scales: [2, d] and [2, head_dim].
    scales = {('float32', (2, d)), ('float32', (2, d // 4))}
    more[remat] = {k: n for k, n in (kept['gemma3'] - kept['llama']).items() if k not in scales}
  stream, rms = ('bfloat16', (2, B, s, d)), ('float32', (2, B, s, 1))
  assert more['none'] == more['attention'] == {stream: 2, rms: 2}
  assert more['dots'] == {stream: 1} and more['full'] == {}
