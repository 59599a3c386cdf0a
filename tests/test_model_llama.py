"""The Llama block's conventions, which Hugging Face checkpoints rely on:
rotate_half RoPE (dimension i pairs with i + hd/2), Llama 3 frequency
scaling, K/V head j serving query heads j*g .. j*g+g-1, tied output layer."""

import math

import harness
import jax
import jax.numpy as jnp
import numpy as np

from triax.model import llama

_FIELDS = dict(family='llama', num_layers=2, d_model=32, num_heads=4, d_ff=48, seq_len=16)


def _hf_llama3_inv_freq(hd, theta, factor, low, high, ctx):
  """transformers' _compute_llama3_parameters, transcribed to numpy."""
  inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
  low_wavelen, high_wavelen = ctx / low, ctx / high
  wavelen = 2 * math.pi / inv_freq
  out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = (ctx / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * out / factor + smooth * out
  medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, out)


def test_llama3_scaled_frequencies_match_transformers():
  spec = harness.model_of(
    **{**_FIELDS, 'd_model': 4 * 128, 'rope_theta': 500000.0},
    rope_scaling=dict(
      factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
  ).spec
  got = np.asarray(llama.rope_frequencies(spec))
  want = _hf_llama3_inv_freq(128, 500000.0, 32.0, 1.0, 4.0, 8192)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # All three bands occur at head_dim 128: kept, interpolated and divided by the factor.
  plain = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
  ratio = got / plain
  assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / 32).any()
  assert ((ratio < 0.99) & (ratio > 1 / 32 + 1e-3)).any()


def test_rope_is_rotate_half_and_depends_on_relative_position_only():
  spec = harness.model_of(**_FIELDS).spec
  cos, sin = llama.rope_tables(spec, jnp.arange(16))
  hd = spec.head_dim
  # A unit vector on dimension 1 turns towards dimension 1 + hd/2 (not 2, as interleaved would).
  e = jnp.zeros((1, 16, 1, hd)).at[..., 1].set(1.0)
  turned = llama.apply_rope(e, cos, sin)[0, 3, 0]
  assert set(np.flatnonzero(np.abs(np.asarray(turned)) > 1e-6)) == {1, 1 + hd // 2}
  q, k = jax.random.normal(jax.random.key(0), (2, hd))
  rq = llama.apply_rope(jnp.broadcast_to(q, (1, 16, 1, hd)), cos, sin)[0, :, 0]
  rk = llama.apply_rope(jnp.broadcast_to(k, (1, 16, 1, hd)), cos, sin)[0, :, 0]
  # <R_m q, R_n k> depends on m - n only.
  np.testing.assert_allclose(rq[5] @ rk[2], rq[13] @ rk[10], rtol=1e-5)


def test_grouped_kv_heads_equal_full_attention_with_each_kv_head_repeated_per_group():
  gqa = harness.model_of(**_FIELDS, num_kv_heads=2)
  mha = harness.model_of(**_FIELDS)
  params = jax.jit(gqa.init)(jax.random.key(1))
  layers = dict(params['layers'])
  for name in ('wk', 'wv'):  # [L, d, kv, hd] -> [L, d, n, hd]: head j*g+i reads kv head j
    layers[name] = jnp.repeat(layers[name], 2, axis=2)
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256)
  np.testing.assert_allclose(
    jax.jit(gqa.logits)(params, tokens),
    jax.jit(mha.logits)({**params, 'layers': layers}, tokens),
    rtol=1e-5,
    atol=1e-6,
  )


def test_tied_head_is_the_embedding_table_and_gets_both_gradients():
  tied = harness.model_of(**_FIELDS, tie_embeddings=True)
  untied = harness.model_of(**_FIELDS)
  params = jax.jit(tied.init)(jax.random.key(3))
  assert 'out' not in params['head']
  as_untied = {**params, 'head': {**params['head'], 'out': params['embed']['tokens'].T}}
  tokens = jax.random.randint(jax.random.key(4), (2, 17), 0, 256)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  loss, grads = jax.jit(jax.value_and_grad(tied.loss))(params, inputs, targets)
  ref_loss, ref = jax.jit(jax.value_and_grad(untied.loss))(as_untied, inputs, targets)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(
    grads['embed']['tokens'], ref['embed']['tokens'] + ref['head']['out'].T, rtol=1e-5, atol=1e-7
  )
