"""model.fp8=tensorwise and rowwise: FP8 weight matmuls (model/fp8.py), their
numerics on this CPU and, compiled by XLA:GPU for H100s, FP8 GEMMs in the
optimised program."""

import functools
import glob
import os
import sys

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triax import config, topology
from triax import layout as layout_lib
from triax.compiled import gemms, hlo_work
from triax.model import flops, fp8, moe, registry
from triax.training import metrics as metrics_lib

PLUGIN = os.path.join(sys.prefix, 'xla-cuda', 'jax_plugins', 'xla_cuda12', 'xla_cuda_plugin.so')
# A 2-layer Llama whose matmul widths are multiples of 16 (FP8 GEMMs' rule), unrolled
# so that the optimised program holds each layer's GEMMs once each. d_ff is a multiple
# of 128 too: XLA:GPU pads an FP8 GEMM's contracting width to one (measured: d_ff 192
# ran the down projection and gate and up's dx at K = 256, 8% more FLOPs).
SMALL_LLAMA_CONFIG = 'experiments/llama_1b.py:smoke,attention=xla'
SMALL_LLAMA_KEYS = {
  'model.d_ff': 256,
  'model.scan_layers': False,
  'mesh.data': 8,
  'train.global_batch_size': 8,
}
# Its weight matmuls: per layer q, k, v, o, gate, up and down, in 2 layers.
WEIGHT_MATMULS = 7 * 2
# FP8 products XLA:GPU merges away, per recipe. Rowwise quantizes a forward's x
# along d only, so q, k and v (and gate and up) read the same FP8 x, and XLA's
# dot merger makes each group one wider GEMM: 3 fewer forward GEMMs a layer.
# Tensorwise's are left apart (measured; jax 0.10's XLA), and so are delayed's
# (one scale per tensor too, from its site's history).
MERGED = {'tensorwise': 0, 'rowwise': 3 * 2, 'delayed': 0}
# The small Llama as a Mixtral of 4 experts (d_ff 64), top-2, capacity's buffers
# of C = 32 rows (capacity_factor 1: 64 tokens x 2 / 4), the
# experts split over 2 of the 8 data-parallel devices (the all-to-alls and
# the per-device einsums of mixtral_tiny's layout).
SMALL_MIXTRAL = (
  f'--config={SMALL_LLAMA_CONFIG}',
  *layout_lib.flags(
    {
      **SMALL_LLAMA_KEYS,
      'model.family': 'mixtral',
      'model.num_experts': 4,
      'model.experts_per_token': 2,
      'model.d_ff': 64,
      'model.capacity_factor': 1.0,
      'mesh.expert': 2,
    }
  ),
)
# Per layer q, k, v, o and the experts' gate, up and down (the router stays
# bf16: its logits pick the experts), in 2 layers.
MIXTRAL_WEIGHT_MATMULS = 7 * 2
# The experts' gate and up matmuls read the same FP8 rows, in both recipes
# and dispatches: XLA merges their forward GEMMs and their weight gradients'
# (one fewer each a layer); rowwise merges q, k and v too, as the small Llama's.
MIXTRAL_MERGED = {'tensorwise': 2 * 2, 'rowwise': 2 * 2 + 2 * 2}
# An FP8 product's relative error: each E4M3 operand is within 2^-4 of its value.
E4M3_PRODUCT = 2 * 2.0**-4


@pytest.mark.fast
def test_a_quantized_tensor_keeps_e4m3s_precision_and_a_power_of_two_scale():
  t = jax.random.normal(jax.random.key(0), (64, 48)) * 3.0
  q, scale = fp8.quantize(t, fp8.FORWARD)
  assert q.dtype == jnp.float8_e4m3fn
  assert float(jnp.log2(scale)) == int(jnp.log2(scale))
  assert float(jnp.max(jnp.abs(t))) / float(scale) <= 448
  back = q.astype(jnp.float32) * scale
  assert float(jnp.max(jnp.abs(back - t) / (jnp.abs(t) + scale * 2.0**-6))) <= 2.0**-4
  zeros, one = fp8.quantize(jnp.zeros((4,)), fp8.BACKWARD)
  assert float(one) == 1 and not np.any(np.asarray(zeros.astype(jnp.float32)))


@pytest.mark.fast
def test_a_rowwise_quantized_tensor_has_a_power_of_two_scale_per_row():
  # Rows (the leading axis) a thousandfold apart: each gets its own scale.
  t = jax.random.normal(jax.random.key(2), (8, 48)) * 10.0 ** jnp.arange(-4, 4)[:, None]
  q, scale = fp8.quantize(t, fp8.FORWARD, axes=(1,))
  assert scale.shape == (8, 1)
  assert np.all(np.log2(scale) == np.round(np.log2(scale)))
  # The smallest power of two that fits: each row's amax lands in (224, 448].
  amax = np.max(np.abs(np.asarray(t)), axis=1, keepdims=True) / np.asarray(scale)
  assert np.all((amax > 224) & (amax <= 448)), amax
  back = q.astype(jnp.float32) * scale
  assert float(jnp.max(jnp.abs(back - t) / (jnp.abs(t) + scale * 2.0**-6))) <= 2.0**-4


def _against_exact(equation: str, x, w, g, recipe: str):
  """(exact einsum, fp8.einsum's, exact (dx, dw), fp8's (dx, dw)) of x and w, cotangent g."""
  exact, pull = jax.vjp(lambda x, w: jnp.einsum(equation, x, w), x, w)
  out, pull8 = jax.vjp(lambda x, w: fp8.einsum(equation, x, w, jnp.float32, recipe), x, w)
  return exact, out, pull(g), pull8(g)


@pytest.mark.fast
@pytest.mark.parametrize('recipe', ['tensorwise', 'rowwise'])
def test_the_fp8_einsum_and_its_two_backward_gemms_follow_the_exact_ones(recipe):
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (2, 8, 32))
  w = jax.random.normal(kw, (32, 4, 16)) * 0.02
  g = jax.random.normal(kg, (2, 8, 4, 16))
  equation = 'bsd,dnk->bsnk'
  assert fp8.transposed(equation) == ('bsnk,dnk->bsd', 'bsd,bsnk->dnk')
  exact, out, (dx, dw), (dx8, dw8) = _against_exact(equation, x, w, g, recipe)
  # Sums of many products: errors partly cancel, so well inside the one-product bound.
  assert harness.max_rel_err(exact, out) <= E4M3_PRODUCT
  assert (dx8.dtype, dw8.dtype) == (x.dtype, w.dtype)
  # The cotangent's E5M2 has 2 mantissa bits (2^-3 relative), the other operand E4M3.
  assert harness.max_rel_err(dx, dx8) <= 2.0**-3 + 2.0**-4
  assert harness.max_rel_err(dw, dw8) <= 2.0**-3 + 2.0**-4
  with pytest.raises(ValueError, match="'n' must be in exactly two"):
    fp8.transposed('bsd,dn->bs')


@pytest.mark.fast
@pytest.mark.parametrize('recipe', ['tensorwise', 'rowwise'])
def test_the_experts_einsum_with_the_expert_axis_as_a_batch_label(recipe):
  """capacity's 'becd,edf->becf': 'e' in all three terms, one GEMM per
  expert; both backward GEMMs keep it (rowwise: a scale per expert and row)."""
  kx, kw, kg = jax.random.split(jax.random.key(4), 3)
  x = jax.random.normal(kx, (2, 4, 8, 32))
  # Experts a hundredfold apart: rowwise scales each expert's columns apart.
  w = jax.random.normal(kw, (4, 32, 16)) * 0.02 * 10.0 ** jnp.arange(-1, 3)[:, None, None]
  g = jax.random.normal(kg, (2, 4, 8, 16))
  equation = 'becd,edf->becf'
  assert fp8.transposed(equation) == ('becf,edf->becd', 'becd,becf->edf')
  exact, out, (dx, dw), (dx8, dw8) = _against_exact(equation, x, w, g, recipe)
  assert harness.max_rel_err(exact, out) <= E4M3_PRODUCT
  assert harness.max_rel_err(dx, dx8) <= 2.0**-3 + 2.0**-4
  for e in range(4):  # each expert's weight gradient, relative to its own
    assert harness.max_rel_err(dw[e], dw8[e]) <= 2.0**-3 + 2.0**-4


@pytest.mark.fast
@pytest.mark.parametrize('recipe', ['tensorwise', 'rowwise'])
def test_the_fp8_ragged_dot_and_its_two_backward_gemms_follow_the_exact_ones(recipe):
  """dropless's grouped matmul: groups of 10, 0, 17 and 9 rows of 40 (the
  last 4 rows in no group: output 0, no gradient), experts' weights a
  hundredfold apart; forward, dx = ragged_dot(g, w^T) and each expert's
  dw = x^T g (ragged_dot_general) within the einsum's bounds."""
  kx, kw, kg = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(kx, (40, 32))
  w = jax.random.normal(kw, (4, 32, 16)) * 0.02 * 10.0 ** jnp.arange(-1, 3)[:, None, None]
  g = jax.random.normal(kg, (40, 16))
  sizes = jnp.array([10, 0, 17, 9], jnp.int32)
  exact, pull = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
  out, pull8 = jax.vjp(lambda x, w: fp8.ragged_dot(x, w, sizes, jnp.float32, recipe), x, w)
  assert not np.any(np.asarray(out[36:]))
  for rows in (slice(0, 10), slice(10, 27), slice(27, 36)):  # each group, relative to its own
    assert harness.max_rel_err(exact[rows], out[rows]) <= E4M3_PRODUCT
  (dx, dw), (dx8, dw8) = pull(g), pull8(g)
  assert (dx8.dtype, dw8.dtype) == (x.dtype, w.dtype)
  for rows in (slice(0, 10), slice(10, 27), slice(27, 36)):
    assert harness.max_rel_err(dx[rows], dx8[rows]) <= 2.0**-3 + 2.0**-4
  assert not np.any(np.asarray(dx8[36:])) and not np.any(np.asarray(dw8[1]))
  for e in (0, 2, 3):
    assert harness.max_rel_err(dw[e], dw8[e]) <= 2.0**-3 + 2.0**-4


@pytest.mark.fast
@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
def test_the_routed_experts_run_their_matmuls_in_fp8(dispatch):
  """moe.capacity and moe.dropless under fp8: not the exact output, within an FP8 product's error."""
  keys = jax.random.split(jax.random.key(6), 5)
  h = jax.random.normal(keys[0], (2, 16, 32))
  router = jax.random.normal(keys[1], (32, 4)) * 0.1
  w_gate, w_up = (jax.random.normal(k, (4, 32, 48)) * 0.2 for k in keys[2:4])
  w_down = jax.random.normal(keys[4], (4, 48, 32)) * 0.2
  routing = moe.route(h, router, 2)

  def run(recipe):
    if dispatch == 'capacity':
      return moe.capacity(h, routing, w_gate, w_up, w_down, 2.0, fp8.Recipe(recipe))[0]
    return moe.dropless(h, routing, w_gate, w_up, w_down, fp8.Recipe(recipe))

  exact = run('none')
  for recipe in ('tensorwise', 'rowwise'):
    out = run(recipe)
    err = harness.max_rel_err(exact, out)
    # Two FP8 products in a row (gate and up, then down).
    assert 0 < err <= 2 * E4M3_PRODUCT, (recipe, err)


def _cotangent_casts(fn, *args) -> set[str]:
  """The FP8 formats fn's gradient (with respect to its arguments) casts to, by jaxpr name."""
  text = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)), range(len(args))))(*args))
  return {name for name in ('f8_e5m2', 'f8_e4m3fn') if name in text}


@pytest.mark.fast
@pytest.mark.parametrize('recipe', ['tensorwise', 'rowwise'])
def test_e4m3_cotangents_keep_three_mantissa_bits_in_both_backward_gemms(recipe):
  """model.fp8_grad=e4m3: the cotangent is E4M3 in dx's and dw's GEMMs (no E5M2
  cast anywhere), so each is within two E4M3 roundings of the exact one, and
  closer than E5M2's (2 mantissa bits) on the same operands."""
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(kx, (2, 8, 32))
  w = jax.random.normal(kw, (32, 4, 16)) * 0.02
  g = jax.random.normal(kg, (2, 8, 4, 16))
  equation = 'bsd,dnk->bsnk'
  exact = jax.vjp(lambda x, w: jnp.einsum(equation, x, w), x, w)[1](g)
  errors = {}
  for grad in fp8.GRAD_FORMATS:
    fn = functools.partial(fp8.einsum, equation, dtype=jnp.float32, recipe=recipe, grad=grad)
    assert _cotangent_casts(fn, x, w) == {'f8_e4m3fn', 'f8_e5m2'} - (
      {'f8_e5m2'} if grad == 'e4m3' else set()
    )
    got = jax.vjp(fn, x, w)[1](g)
    errors[grad] = [harness.max_rel_err(e, f) for e, f in zip(exact, got)]
  assert max(errors['e4m3']) <= E4M3_PRODUCT, errors
  assert all(a < b for a, b in zip(errors['e4m3'], errors['e5m2'])), errors
  with pytest.raises(ValueError, match="fp8 gradient format 'e3m4'"):
    fp8.einsum(equation, x, w, jnp.float32, recipe, grad='e3m4')
  # config.py keeps its own list (it imports no JAX): the same names, the default first.
  assert config.FP8_GRADS == tuple(fp8.GRAD_FORMATS)


@pytest.mark.fast
@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
def test_the_routed_experts_take_model_fp8_grad_too(dispatch):
  """moe.capacity's einsums and dropless's grouped matmuls cast their
  cotangents to the recipe's grad format: E4M3 only under e4m3."""
  keys = jax.random.split(jax.random.key(6), 5)
  h = jax.random.normal(keys[0], (2, 16, 32))
  routing = moe.route(h, jax.random.normal(keys[1], (32, 4)) * 0.1, 2)
  w_gate, w_up = (jax.random.normal(k, (4, 32, 48)) * 0.2 for k in keys[2:4])
  w_down = jax.random.normal(keys[4], (4, 48, 32)) * 0.2

  def experts(h, w_gate, w_up, w_down, recipe):
    if dispatch == 'capacity':
      return moe.capacity(h, routing, w_gate, w_up, w_down, 2.0, recipe)[0]
    return moe.dropless(h, routing, w_gate, w_up, w_down, recipe)

  for grad, casts in (('e5m2', {'f8_e4m3fn', 'f8_e5m2'}), ('e4m3', {'f8_e4m3fn'})):
    fn = functools.partial(experts, recipe=fp8.Recipe('tensorwise', grad))
    assert _cotangent_casts(fn, h, w_gate, w_up, w_down) == casts, grad


@pytest.mark.fast
def test_rowwise_keeps_the_small_rows_that_an_outlier_row_flushes_under_tensorwise():
  """Why rowwise exists: x's rows span 10^-3 to 10^3. Tensorwise scales all
  of x by the largest row's amax, so the small rows fall below E4M3's
  smallest subnormal (2^-9 of the scale) and their products vanish; rowwise
  scales each row by its own amax and every row keeps E4M3's precision."""
  kx, kw = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (16, 64)) * 10.0 ** jnp.linspace(-3, 3, 16)[:, None]
  w = jax.random.normal(kw, (64, 32)) * 0.02
  exact = x @ w

  def worst_row(recipe):
    """The largest error in a row of the product, relative to that row's largest value."""
    out = fp8.einsum('td,df->tf', x, w, jnp.float32, recipe)
    rows = jnp.max(jnp.abs(out - exact), axis=1) / jnp.max(jnp.abs(exact), axis=1)
    return float(jnp.max(rows))

  tensorwise, rowwise = worst_row('tensorwise'), worst_row('rowwise')
  print('worst row: tensorwise', tensorwise, 'rowwise', rowwise)
  assert rowwise <= E4M3_PRODUCT
  assert tensorwise >= 0.5 and rowwise <= tensorwise / 10


def _llama(**overrides):
  """llama_tiny's shape (8 heads, 2 K/V heads, SwiGLU) at a test's size, in fp32."""
  return harness.tiny_config(
    **{
      'model.family': 'llama',
      'model.num_layers': 4,
      'model.d_model': 64,
      'model.num_kv_heads': 2,
      'model.d_ff': 128,
      'model.seq_len': 32,
      'train.global_batch_size': 16,
      'mesh.data': 1,
      **overrides,
    }
  )


# FP8 against fp32 matmuls, same seed and batches: the casts' error, within 2%.
# (measured after 5 steps at learning rate 1e-2: tensorwise 1.4%, rowwise 1.5%; 0.2% after 4).
FP8_VS_EXACT = 0.02
# FP8 on data 2 x tensor 2 against one device. The scales are the same in
# every layout (an amax spans the same elements however they are split --
# the whole tensor under tensorwise, a row's contracting axes under rowwise,
# d_ff across the tensor shards in the down projection -- and the scale is a
# power of two), so the quantized operands differ only where the layouts'
# fp32 sums (1e-6 relative apart) straddle an E4M3 rounding boundary: rare,
# so fp32 parity's 1e-5 holds (measured over 5 steps: tensorwise 3e-7, rowwise 5e-7).
FP8_LAYOUTS = 1e-5


@pytest.mark.parametrize('recipe', ['tensorwise', 'rowwise'])
def test_fp8_trains_as_fp32_does_and_alike_on_every_layout(recipe):
  steps = 5
  exact = harness.train_losses(_llama(), steps)
  one = harness.train_losses(_llama(**{'model.fp8': recipe}), steps)
  split = harness.train_losses(
    _llama(**{'model.fp8': recipe, 'mesh.data': 2, 'mesh.tensor': 2}), steps
  )
  print('fp32', exact, recipe, one, f'{recipe} data 2 x tensor 2', split)
  assert one[-1] < one[0]
  for a, b, c in zip(exact, one, split):
    assert abs(b - a) <= FP8_VS_EXACT * abs(a), (exact, one)
    assert abs(c - b) <= FP8_LAYOUTS * abs(b), (one, split)


def _h100_hlo(tmp_path, flags: tuple) -> str:
  """The optimised HLO text of the train step of `flags` compiled for h100:8."""
  if not os.path.isfile(PLUGIN):
    pytest.skip('jax CUDA plugin absent (scripts/env.sh test installs it)')
  dump = tmp_path / 'dump'
  result = harness.run_cli(
    'triax.cli.train',
    *flags,
    f'--workdir={tmp_path / "w"}',
    '--compile_only',
    '--topology=h100:8',
    env_extra={topology.CUDA_PLUGIN_VAR: PLUGIN, 'TRIAX_XLA_DUMP': str(dump)},
  )
  assert result.returncode == 0, result.stderr
  (path,) = glob.glob(str(dump / '*gpu_after_optimizations.txt'))
  with open(path) as f:
    return f.read()


@pytest.mark.parametrize('recipe', ['tensorwise', 'rowwise', 'delayed'])
def test_every_weight_matmul_is_three_fp8_gemms_on_h100(tmp_path, recipe):
  """Forward, dx and dw of each of the 14 weight matmuls, FP8 x FP8 in XLA:GPU's
  optimised train step for h100:8 (less the forward GEMMs merged, MERGED);
  the head and the attention core are not. Rowwise's per-row scales stay
  outside the GEMM (a multiply by the scales' outer product after it) and do
  not turn its product back into bf16; nor do delayed's scales, read from
  the train state's histories. The matmul FLOPs on FP8 operands, as
  executed, are the weight matmuls' (model/flops.py) and no others: the
  measure docs/bench_gpu_compile.md's FP8 rows give for the 1B and 8B shapes."""
  keys = {**SMALL_LLAMA_KEYS, 'model.fp8': recipe}
  hlo = _h100_hlo(tmp_path, (f'--config={SMALL_LLAMA_CONFIG}', *layout_lib.flags(keys)))
  found = gemms.fp8_gemms(hlo)
  print(recipe, found)
  assert sum(found.values()) == 3 * WEIGHT_MATMULS - MERGED[recipe], found
  path, arg = SMALL_LLAMA_CONFIG.split(':')
  cfg = config.from_file(os.path.join(harness.ROOT, path), arg)
  for key, value in keys.items():
    config.set_dotted(cfg, key, value)
  model = registry.build(registry.spec_from_config(config.validate(cfg, 8).model))
  weights = flops.weight_matmul_flops(model, cfg.train.global_batch_size) / 8
  fp8_flops = hlo_work.work(hlo).fp8_flops
  assert fp8_flops == pytest.approx(weights, rel=1e-9), (fp8_flops, weights)


@pytest.mark.parametrize(
  'dispatch,recipe',
  # Each dispatch once (an XLA:GPU compile is about a minute of this machine's CPU):
  # capacity with rowwise, which merges more, dropless with tensorwise.
  [('capacity', 'rowwise'), ('dropless', 'tensorwise')],
)
def test_every_expert_matmul_is_three_fp8_gemms_on_h100_too(tmp_path, dispatch, recipe):
  """SMALL_MIXTRAL's routed experts: each expert matmul runs forward, dx
  and dw FP8 x FP8, as the attention's projections do, inside the
  shard_map that exchanges the tokens. capacity: einsums whose expert axis
  is a batch dimension (one GEMM per local expert); dropless: ragged_dots,
  which XLA:GPU expands into dense dots over the local experts and keeps on
  FP8 operands. The router, capacity's dispatch and combine einsums and the
  head stay bf16."""
  flags = (f'--config.model.fp8={recipe}', f'--config.model.moe_dispatch={dispatch}')
  found = gemms.fp8_gemms(_h100_hlo(tmp_path, SMALL_MIXTRAL + flags))
  print(recipe, found)
  assert sum(found.values()) == 3 * MIXTRAL_WEIGHT_MATMULS - MIXTRAL_MERGED[recipe], found


# A Mixtral under FP8 against fp32 and split against one device, as
# FP8_VS_EXACT and FP8_LAYOUTS for Llama: capacity_factor 0.5 drops
# assignments in every row, as tests/test_expert_parallel.py's.
def _mixtral(**overrides):
  return harness.tiny_mixtral_config(**{'mesh.data': 1, 'model.capacity_factor': 0.5, **overrides})


# data 4 x tensor 2 with the experts over 2 of the 4: each expert's buffer
# rows split over data, its hidden units over tensor, the experts over
# expert, and every amax spanning them a max over their shards (the
# ExpertGemms' axes). Measured over 4 steps: at most 6e-7 (losses).
MOE_LAYOUT = {'mesh.data': 4, 'mesh.tensor': 2, 'mesh.expert': 2}


# Each dispatch with the recipe whose scales it takes most apart: capacity's
# rowwise ones per expert and row (its down projection's over the hidden
# units split over tensor), dropless's tensorwise ones over rows that the
# exchange spreads over data and expert. The other pairs: the metrics' and
# the pipeline's tests below.
@pytest.mark.parametrize('dispatch,recipe', [('capacity', 'rowwise'), ('dropless', 'tensorwise')])
def test_a_mixtral_trains_in_fp8_as_in_fp32_and_alike_with_the_experts_split(dispatch, recipe):
  steps = 4
  base = {'model.moe_dispatch': dispatch}
  exact = harness.train_losses(_mixtral(**base), steps)
  one = harness.train_losses(_mixtral(**base, **{'model.fp8': recipe}), steps)
  split = harness.train_losses(_mixtral(**base, **{'model.fp8': recipe}, **MOE_LAYOUT), steps)
  print('fp32', exact, recipe, one, 'data 4 x tensor 2, expert 2', split)
  assert one[-1] < one[0]
  for a, b, c in zip(exact, one, split):
    assert abs(b - a) <= FP8_VS_EXACT * abs(a), (exact, one)
    assert abs(c - b) <= FP8_LAYOUTS * abs(b), (one, split)


@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
def test_a_pipelined_mixtral_runs_its_experts_in_fp8_as_accumulation_does(dispatch):
  """pipe 2 x tensor 2, 4 micro-batches, against the same 4 accumulated on
  one device: the experts' FP8 matmuls inside the executor's stages (the
  dropless ones per device, model/per_device.py), their amaxes per
  micro-batch either way (measured 5e-7 apart: fp32 parity's 1e-5 holds)."""
  base = {
    'model.fp8': 'tensorwise',
    'model.moe_dispatch': dispatch,
    'model.router_aux_loss_scope': 'microbatch',
    'pipeline.microbatches': 4,
  }
  loss, grads = harness.loss_and_grads(_mixtral(**base))
  loss_p, grads_p = harness.loss_and_grads(_mixtral(**base, **{'mesh.pipe': 2, 'mesh.tensor': 2}))
  assert abs(loss_p - loss) <= 1e-5 * abs(loss)
  assert harness.max_rel_err(grads, grads_p) <= 1e-5


@pytest.mark.parametrize(
  'make',
  [harness.tiny_config, harness.tiny_mixtral_config, harness.tiny_deepseek_config],
  ids=['gpt', 'mixtral', 'deepseek'],
)
def test_every_family_runs_its_weight_matmuls_in_fp8(make):
  """The loss and gradients at initialisation, FP8 against fp32 (mixtral's
  and deepseek's routed and shared experts FP8 too; their routers not)."""
  loss, grads = harness.loss_and_grads(make(**{'mesh.data': 1}))
  loss8, grads8 = harness.loss_and_grads(make(**{'mesh.data': 1, 'model.fp8': 'tensorwise'}))
  assert loss8 != loss and abs(loss8 - loss) <= FP8_VS_EXACT * abs(loss)
  # Over the whole tree: a leaf whose gradient is near zero at initialisation
  # (a router's, a norm's) is all rounding noise, relative to itself.
  diff = optax.global_norm(jax.tree.map(lambda a, b: a - b, grads, grads8))
  assert diff <= 0.1 * optax.global_norm(grads), diff / optax.global_norm(grads)


@pytest.mark.fast
def test_the_overflow_counts_see_only_what_current_scaling_cannot_fit():
  """0 for finite tensors (each scale comes from the tensor itself). An inf's
  scale falls back to 1: the inf counts, and so do the finite values over
  the max that share its scale (tensorwise: the whole tensor; rowwise: its
  row only). Forward and backward alike."""
  x = jnp.ones((4, 8)).at[0, 0].set(1e4)
  w = jnp.ones((8, 16))
  probe = jnp.zeros(2)
  for recipe, with_inf in (('tensorwise', 2), ('rowwise', 1)):
    axes = fp8.scaled_axes('td', 'tf', recipe)
    scale = fp8.scale_of(fp8.amax(x, axes), fp8.FORWARD)
    assert float(fp8.overflow(x, scale, fp8.FORWARD)) == 0
    inf = x.at[1, 1].set(jnp.inf)
    scale = fp8.scale_of(fp8.amax(inf, axes), fp8.FORWARD)
    assert float(fp8.overflow(inf, scale, fp8.FORWARD)) == with_inf

    def loss(x, w, probe, g, r=recipe):
      return jnp.sum(fp8.einsum('td,df->tf', x, w, jnp.float32, r, probe) * g)

    g = jnp.ones((4, 16))
    counts = jax.grad(loss, argnums=2)(x, w, probe, g)
    # g is cast for dx and again for dw: 2 x 64 elements, none over.
    assert counts.tolist() == [0, 128]
    counts = jax.grad(loss, argnums=2)(x, w, probe, g.at[2, 3].set(jnp.inf))
    assert counts.tolist() == [2, 128]


@pytest.mark.parametrize(
  'layout',
  [{}, {'mesh.data': 2, 'mesh.tensor': 2, 'mesh.sequence_parallel': True, 'model.remat': 'full'}],
  ids=['one-device', 'sp-full-remat'],
)
def test_fp8_metrics_report_each_kinds_amax_and_scales(layout):
  """model.fp8_metrics: per weight-matmul kind, x's and w's amax and largest
  scales (a power of two: the amax / scale within (E4M3 max / 2, E4M3 max]),
  alike on every layout, the overflow fractions 0 (finite tensors), and the
  loss and gradients those of the run without them."""
  base = {'model.fp8': 'rowwise', **layout}
  loss, grads = harness.loss_and_grads(_llama(**base))
  trainer = harness.make_trainer(_llama(**base, **{'model.fp8_metrics': True}))
  params = harness.initial_params(trainer, 0)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(trainer.cfg), trainer.batch_sharding)
    loss_m, grads_m, metrics = trainer.loss_and_grad(params, batch)
  assert float(loss_m) == loss
  assert harness.max_rel_err(grads, jax.tree.map(np.asarray, grads_m)) == 0
  metrics = {k: float(v) for k, v in metrics.items()}
  assert metrics['fp8_overflow'] == 0 and metrics['fp8_grad_overflow'] == 0
  kinds = ('attn_in', 'attn_out', 'mlp_in', 'mlp_out')
  for kind in kinds:
    for t in 'xw':
      ratio = metrics[f'fp8_{kind}_{t}_amax'] / metrics[f'fp8_{kind}_{t}_scale']
      assert 224 < ratio <= 448, (kind, t, ratio)
  # The down projection's w amax, straight from the parameters (every layer's).
  paths = jax.tree_util.tree_leaves_with_path(params)
  (w_down,) = [v for p, v in paths if 'w_down' in jax.tree_util.keystr(p)]
  assert metrics['fp8_mlp_out_w_amax'] == float(jnp.max(jnp.abs(w_down)))


@pytest.mark.parametrize('dispatch', ['capacity', 'dropless'])
def test_fp8_metrics_report_the_routed_experts_alike_with_the_experts_split(dispatch):
  """The experts' kinds (expert_in, expert_out: fp8_metrics.KINDS), recorded
  inside the shard_maps that exchange the tokens and returned whole: the
  same figures on one device and on data 4 x tensor 2, expert 2; the split
  run's loss and gradients those of the split run without them (where the
  shard_maps are that the figures leave)."""
  base = {'model.fp8': 'rowwise', 'model.moe_dispatch': dispatch}
  figures = []
  for layout in ({}, MOE_LAYOUT):
    trainer = harness.make_trainer(_mixtral(**base, **layout, **{'model.fp8_metrics': True}))
    params = harness.initial_params(trainer, 0)
    with jax.set_mesh(trainer.mesh):
      batch = jax.device_put(harness.random_batch(trainer.cfg), trainer.batch_sharding)
      loss_m, grads_m, metrics = trainer.loss_and_grad(params, batch)
    # Three compiles, not four: the split program is the one whose figures cross
    # devices, and one device's are held to its figures below.
    if layout:
      loss, grads = harness.loss_and_grads(_mixtral(**base, **layout))
      assert float(loss_m) == loss
      model_order = trainer.layout.tree_to_model_order(jax.device_get(grads_m))
      assert harness.max_rel_err(grads, jax.tree.map(np.asarray, model_order)) == 0
    metrics = {k: float(v) for k, v in metrics.items() if k.startswith('fp8_')}
    assert metrics['fp8_overflow'] == 0 and metrics['fp8_grad_overflow'] == 0
    for kind in ('expert_in', 'expert_out'):
      for t in 'xw':
        ratio = metrics[f'fp8_{kind}_{t}_amax'] / metrics[f'fp8_{kind}_{t}_scale']
        assert 224 < ratio <= 448, (kind, t, ratio)
    paths = jax.tree_util.tree_leaves_with_path(params)
    (w_down,) = [v for p, v in paths if "['w_down']" in jax.tree_util.keystr(p)]
    assert metrics['fp8_expert_out_w_amax'] == float(jnp.max(jnp.abs(w_down)))
    figures.append(metrics)
  one, split = figures
  assert one.keys() == split.keys()
  for key in one:  # the activations' amax from sums of fp32 products: 1e-5 apart at most
    assert abs(one[key] - split[key]) <= 1e-5 * abs(one[key]), (key, one[key], split[key])


def test_fp8_metrics_reach_metrics_jsonl(tmp_path):
  """The figures ride the step's metrics into every training record, as a MoE's router figures do."""
  workdir = tmp_path / 'w'
  result = harness.run_cli(
    'triax.cli.train',
    '--config=experiments/gpt_tiny.py:smoke',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    '--config.train.steps=2',
    # Without the pipeline, which does not carry them: data 4 x tensor 2.
    '--config.mesh.data=4',
    '--config.mesh.pipe=1',
    '--config.pipeline.microbatches=1',
    '--config.pipeline.virtual_stages=1',
    '--config.model.fp8=rowwise',
    '--config.model.fp8_metrics=true',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  records = [r for r in metrics_lib.read_metrics(str(workdir)) if 'loss' in r]
  assert records, 'no training records'
  for record in records:
    assert record['fp8_overflow'] == 0 and record['fp8_grad_overflow'] == 0
    assert record['fp8_mlp_out_x_amax'] > 0 and record['fp8_attn_in_w_scale'] > 0


def test_model_fp8_grad_reaches_every_weight_matmuls_backward():
  """--config.model.fp8_grad=e4m3 on a Mixtral (attention's projections and
  the routed experts): the trainer's lowered gradient program casts to
  E4M3 only, where e5m2's casts its cotangents to E5M2."""
  found = {}
  for grad in config.FP8_GRADS:
    cfg = _mixtral(**{'model.fp8': 'tensorwise', 'model.fp8_grad': grad})
    trainer = harness.make_trainer(cfg)
    params = harness.initial_params(trainer, cfg.train.seed)
    with jax.set_mesh(trainer.mesh):
      batch = jax.device_put(harness.random_batch(cfg, 0), trainer.batch_sharding)
      text = trainer.loss_and_grad.lower(params, batch).as_text()
    found[grad] = {t for t in ('f8E4M3FN', 'f8E5M2') if t in text}
  assert found == {'e5m2': {'f8E4M3FN', 'f8E5M2'}, 'e4m3': {'f8E4M3FN'}}, found
