"""FLOPs per step, pinned against hand-derived formulas (model/flops.py's conventions).

Two derivations, each independent of the code under test: the closed forms
(Megatron's eq. 3 for GPT with d_ff = 4h), and "6 FLOPs per weight-matrix
element per token plus 12 s^2 h per layer per sequence for attention",
with the weight matrices counted from the model's own parameter shapes.
"""

import math

import harness
import jax
import pytest

from triax.model.flops import step_flops

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

# Parameters that are matmul weights (a token embedding is a gather, norms
# and positions are elementwise), per family; a tied table is the head's matmul.
_MATMULS = {
  'gpt': {'wq', 'wk', 'wv', 'wo', 'w1', 'w2', 'out'},
  'llama': {'wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down', 'out'},
}


def _matmul_params(model) -> int:
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  names = _MATMULS[model.spec.family]
  count = sum(
    math.prod(leaf.shape)
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]
    if path[-1].key in names
  )
  if getattr(model.spec, 'tie_embeddings', False):
    count += math.prod(shapes['embed']['tokens'].shape)
  return count


def _by_parameters(model, batch) -> float:
  s = model.spec
  tokens = batch * s.seq_len
  return 6.0 * tokens * _matmul_params(model) + 12.0 * batch * s.seq_len**2 * s.num_layers * (
    s.num_heads * s.head_dim
  )


def test_gpt_with_4h_mlp_is_megatrons_formula_without_and_with_recompute():
  b, s, l, h, v = 32, 128, 4, 128, 256
  fields = dict(num_layers=l, d_model=h, num_heads=4, d_ff=4 * h, vocab_size=v, seq_len=s)
  none = step_flops(harness.model_of(**fields), b)
  full = step_flops(harness.model_of(remat='full', **fields), b)
  no_recompute = 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
  megatron = 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
  assert none['model'] == pytest.approx(no_recompute, rel=1e-12)
  assert none['hardware'] == none['model']
  # Full recomputation is Megatron's count exactly; MFU still uses the model's.
  assert full['model'] == none['model']
  assert full['hardware'] == pytest.approx(megatron, rel=1e-12)
  assert megatron / no_recompute == pytest.approx(4 / 3, rel=0.01)


def test_gpt_reads_d_ff_from_its_shape():
  b, s, l, h, f = 8, 1024, 20, 2048, 6144
  model = harness.model_of(
    num_layers=l, d_model=h, num_heads=16, d_ff=f, vocab_size=50304, seq_len=s, remat='dots'
  )
  got = step_flops(model, b)
  assert got['model'] == pytest.approx(_by_parameters(model, b), rel=1e-12)
  layer = 2 * s * (4 * h * h + 2 * h * f)
  assert got['model'] == pytest.approx(3 * b * (l * (layer + 4 * s * s * h) + 2 * s * h * 50304))
  # dots recomputes the attention core's two matmuls, attention its scores' one.
  assert got['hardware'] - got['model'] == pytest.approx(b * l * 4 * s * s * h, rel=1e-12)
  fields = dict(num_layers=l, d_model=h, num_heads=16, d_ff=f, vocab_size=50304, seq_len=s)
  attention = step_flops(harness.model_of(remat='attention', **fields), b)
  assert attention['hardware'] - attention['model'] == pytest.approx(b * l * 2 * s * s * h)


def test_llama_1b_shape_counts_swiglu_and_gqa():
  # Llama 3.2 1B: h 2048, 16 layers, 32 query heads, 8 K/V heads, SwiGLU 8192, tied 128256.
  b, s, l, h, n, kv, f, v = 4, 2048, 16, 2048, 32, 8, 8192, 128256
  model = harness.model_of(
    family='llama',
    num_layers=l,
    d_model=h,
    num_heads=n,
    num_kv_heads=kv,
    d_ff=f,
    vocab_size=v,
    seq_len=s,
    tie_embeddings=True,
    remat='full',
  )
  got = step_flops(model, b)
  hd = h // n
  layer = 2 * s * (2 * h * h + 2 * h * kv * hd + 3 * h * f) + 4 * s * s * h
  assert got['model'] == pytest.approx(3 * b * (l * layer + 2 * s * h * v), rel=1e-12)
  assert got['model'] == pytest.approx(_by_parameters(model, b), rel=1e-12)
  assert got['hardware'] - got['model'] == pytest.approx(b * l * layer, rel=1e-12)


def test_llama_with_full_attention_and_untied_head():
  b, s, l, h, f = 8, 32, 4, 64, 172
  model = harness.model_of(
    family='llama', num_layers=l, d_model=h, num_heads=4, d_ff=f, vocab_size=256, seq_len=s
  )
  got = step_flops(model, b)
  layer = 2 * s * (4 * h * h + 3 * h * f) + 4 * s * s * h
  assert got['model'] == pytest.approx(3 * b * (l * layer + 2 * s * h * 256), rel=1e-12)
  assert got['model'] == pytest.approx(_by_parameters(model, b), rel=1e-12)
  assert got['hardware'] == got['model']
