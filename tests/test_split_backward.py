"""The B/W split of a chunk's backward: same gradients, the fused backward's FLOPs.

B (input gradient) and W (weight gradients) are cut out of one traced
backward program (triax/pipeline/split_backward.py). Splitting by calling
the vjp twice would make W re-run the input-gradient chain through every
layer of the chunk; this checks that every equation runs once, in B or W,
under every remat policy and through the uneven split's `cond`.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.pipeline.split_backward import SplitBackward


def _flops(fn, *args) -> float:
  return float(jax.jit(fn).lower(*args).compile().cost_analysis().get('flops', 0.0))


def _chunk_backward(remat, active):
  model = harness.model_of(
    num_layers=2, d_model=32, num_heads=4, d_ff=64, vocab_size=256, seq_len=16, remat=remat
  )
  params = model.init(jax.random.key(0))['layers']
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  run = (
    (lambda p, h: model.layers(p, h))
    if active is None
    else (lambda p, h: model.layers(p, h, jnp.int32(active)))
  )
  bwd, residuals, y = _vjp_parts(run, params, x)
  return bwd, residuals, jax.random.normal(jax.random.key(2), y.shape)


def _vjp_parts(run, params, x):
  """(bwd(residuals, g), residuals, y) of run(params, x)'s vjp."""
  y, vjp_fn = jax.vjp(run, params, x)
  residuals, treedef = jax.tree.flatten(vjp_fn)
  return (lambda res, g: jax.tree.unflatten(treedef, res)(g)), residuals, y


@pytest.mark.parametrize(
  'remat, active',
  # The fast tier takes two (the others are 2-3 s each on jax 0.12).
  [
    pytest.param('none', None, marks=pytest.mark.fast),
    ('none', 1),
    pytest.param('attention', None, marks=pytest.mark.fast),
    ('dots', 1),
    ('full', None),
  ],
)
def test_split_matches_fused_backward(remat, active):
  bwd, residuals, g = _chunk_backward(remat, active)
  split = SplitBackward(bwd, residuals, g)
  d_params, dx = bwd(residuals, g)
  dx_split, cut = split.b(residuals, g)
  d_params_split = split.w(residuals, cut)
  np.testing.assert_array_equal(dx, dx_split)
  for a, b in zip(jax.tree.leaves(d_params), jax.tree.leaves(d_params_split)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  fused = _flops(bwd, residuals, g)
  b_flops = _flops(split.b, residuals, g)
  w_flops = _flops(split.w, residuals, cut)
  # Every equation once: B + W is the fused backward's work, within 2%. (With
  # the padded layer's cond, XLA's count for the split programs comes out
  # 2.3% *below* the fused one: it prices a conditional by its branches, and
  # the split moves work between them; nothing is computed twice.)
  assert 0.95 * fused <= b_flops + w_flops <= 1.02 * fused, (b_flops, w_flops, fused)
  # And the work is really divided: W holds the weight-gradient matmuls, about
  # a third to a half of the backward, not a second copy of it.
  assert 0.25 * fused <= w_flops <= 0.5 * fused, (w_flops, fused)


@pytest.mark.fast
def test_cut_is_smaller_than_the_residuals_without_remat():
  """What B hands to W: the matmul outputs' cotangents, not the whole stash."""
  bwd, residuals, g = _chunk_backward('none', None)
  split = SplitBackward(bwd, residuals, g)
  size = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))
  assert 0 < size(split.cut_shapes) < 0.5 * size(residuals)


@pytest.mark.fast
def test_the_planner_times_the_executors_halves():
  """The profiler's split_b and split_w are the executor's B and W
  (SplitBackward of the layer stack's vjp, each on its own), not the vjp
  asked for one gradient: B returns the input gradient, W from B's cut the
  weight gradients, both equal to the fused vjp's."""
  from triax.plan.cost import profiler

  cfg = harness.tiny_config(**{'model.num_layers': 2})
  prof = profiler._Profiler(profiler._model_key(cfg.model))
  split = prof.split_functions(1, 2, 2)
  (b_fn, b_args), (w_fn, w_args) = split['split_b'], split['split_w']
  fwd, (stack, x) = prof.functions(1, 2, 2)['layer_fwd']
  stack, x = jax.device_put(prof._host_values((stack, x)))
  y, vjp_fn = fwd(stack, x)
  g = jnp.cos(y)
  leaves = jax.tree.leaves(vjp_fn)
  assert [a.shape for a in leaves] == [a.shape for a in b_args[0]]
  dx, cut = b_fn(leaves, g)
  assert jax.tree.structure(cut) == jax.tree.structure(w_args[1])  # W is timed on B's cut
  grads = w_fn(leaves, cut)
  want_grads, want_dx = vjp_fn(g)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.fast
def test_the_cut_holds_the_weight_matmuls_operands_only():
  """A Llama layer's cut is each weight matmul's input and the cotangent at
  its output, nothing W could make from less: B makes the RMSNorm scales'
  [d] gradients (not handing W two [tokens, d] tensors per norm) and
  SwiGLU's product (not its gate and up)."""
  d, ff, heads, kv_heads, layers = 32, 64, 4, 2, 2
  model = harness.model_of(
    family='llama',
    num_layers=layers,
    d_model=d,
    num_heads=heads,
    num_kv_heads=kv_heads,
    d_ff=ff,
    vocab_size=256,
    seq_len=16,
    remat='full',
  )
  params = model.init(jax.random.key(0))['layers']
  x = jax.random.normal(jax.random.key(1), (2, 16, d))
  split = SplitBackward(*_vjp_parts(model.layers, params, x))
  tokens = 2 * 16
  leaves = jax.tree.leaves(split.cut_shapes)
  kv = kv_heads * d // heads
  # Inputs: both norms' outputs, the attention's output, the MLP's product;
  # cotangents: Q, K, V, the attention's and the MLP's outputs, gate and up.
  per_token = 3 * d + ff + (d + 2 * kv + 2 * d + 2 * ff)
  assert sum(a.size for a in leaves if a.ndim > 2) == layers * tokens * per_token
  # Beside them, per layer: the two scales' gradients and a scalar.
  assert sum(a.size for a in leaves if a.ndim <= 2) == layers * (2 * d + 1)


@pytest.mark.fast
def test_only_elementwise_and_reductions_move_into_b():
  """What `_promote_cheap` may move: no matmul, no inner program that may
  hold one (a cond's branches), no collective."""
  from jax.sharding import PartitionSpec as P

  from triax.pipeline import split_backward

  def f(w, x):
    y = jax.lax.cond(x.sum() > 0, lambda: x @ w, lambda: x)
    return jnp.tanh(y) @ w

  eqns = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((4, 4))).jaxpr.eqns
  cheap = {e.primitive.name: split_backward._cheap(e) for e in eqns}
  assert cheap == {
    'reduce_sum': True,
    'gt': True,
    'convert_element_type': True,
    'cond': False,
    'tanh': True,
    'dot_general': False,
  }
  mesh = jax.make_mesh((1,), ('d',))
  summed = jax.shard_map(lambda x: jax.lax.psum(x, 'd'), mesh=mesh, in_specs=P(), out_specs=P())
  inner = jax.make_jaxpr(summed)(jnp.ones(4)).jaxpr.eqns[0].params['jaxpr']
  assert [split_backward._cheap(e) for e in inner.eqns if 'psum' in e.primitive.name] == [False]
