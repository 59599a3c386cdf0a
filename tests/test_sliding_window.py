"""Sliding-window attention (model.sliding_window) with local and global layers
mixed (model.sliding_window_pattern): the layer stack stays one scan whose
layers each see their own window; splash's local mask and the ring's windowed
blocks equal XLA's attention; a pipeline whose chunks start mid-pattern and
a split sequence give one device's loss and gradients; cached greedy tokens
equal uncached ones; bad keys are refused naming the key. Mistral (every
layer local) against transformers: tests/test_hf_mistral.py."""

import dataclasses
import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax import config as config_lib
from triax.errors import ConfigError
from triax.model import context, generation, registry, window
from triax.model.common import causal_attention

# 8 layers, every 3rd global (layers 2 and 5): the pattern does not divide
# the stack, and a 4-token window is a quarter of the 16-token sequence.
WINDOWED = {
  'model.family': 'llama',
  'model.num_kv_heads': 4,
  'model.sliding_window': 4,
  'model.sliding_window_pattern': 3,
}


def _model(**fields):
  cfg = config_lib.validate(harness.tiny_config(**{**WINDOWED, **fields}), 1)
  spec = registry.spec_from_config(cfg.model)
  return registry.build(spec), spec


# Not in the fast tier: a Gemma 3 stack compiled twice (2.5 s).
def test_a_mixed_stack_is_one_scan_and_each_layer_sees_its_window():
  model, spec = _model()
  assert spec.local_layers() == (True, True, False, True, True, False, True, True)
  params = jax.jit(model.init)(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, spec.seq_len), 0, 256)
  scanned = jax.jit(model.logits)(params, tokens)
  x = model.embed(params['embed'], tokens)
  for i, local in enumerate(spec.local_layers()):  # each layer alone, its kind a constant
    x = model.layer(jax.tree.map(lambda a, i=i: a[i], params['layers']), x, None, local)
  np.testing.assert_allclose(scanned, model.head_logits(params['head'], x), rtol=0, atol=1e-5)
  assert jax.make_jaxpr(model.logits)(params, tokens).pretty_print().count('scan[') == 1
  whole = registry.build(dataclasses.replace(spec, sliding_window=0, sliding_window_pattern=0))
  assert float(jnp.max(jnp.abs(whole.logits(params, tokens) - scanned))) > 1e-3


# Not in the fast tier: two decodes past the window (3 s).
def test_cached_greedy_tokens_past_the_window_equal_uncached_ones():
  model, spec = _model()
  params = jax.jit(model.init)(jax.random.key(0))
  sampling = generation.Sampling(max_new_tokens=10, temperature=0.0)
  prompt = [3, 1, 4, 1, 5]
  cached = generation.generate(model, params, prompt, sampling)
  uncached = generation.generate(model, params, prompt, sampling, cache=False)
  assert cached.tolist() == uncached.tolist()
  # Local layers' caches hold the window's 4 slots; the 2 global layers' all 16.
  shapes = [c.shape for c in model.init_cache(2)]
  assert shapes == [(6, 2, 4, 4, 4)] * 2 + [(2, 2, 16, 4, 4)] * 2
  # Left-padded rows of a batch: each row's tokens as it alone gives them.
  batch = generation.generate(model, params, [prompt, [9, 2]], sampling)
  assert batch.tolist() == [
    cached.tolist(),
    generation.generate(model, params, [9, 2], sampling).tolist(),
  ]


def test_rolling_caches_on_a_mesh_give_one_devices_tokens():
  """The prefill split over 2 context ranks (the prompt left-padded), the
  weights over 2 tensor ranks: one device's greedy tokens past the window."""
  cfg = config_lib.validate(harness.tiny_config(**WINDOWED), 1)
  model = generation.sampling_model(cfg)
  params = jax.device_get(jax.jit(model.init)(jax.random.key(0)))
  sampling = generation.Sampling(max_new_tokens=10, temperature=0.0)
  prompt = [3, 1, 4, 1, 5]
  alone = generation.generate(model, params, prompt, sampling)
  placement = generation.Placement.build(cfg, (1, 2, 2, 1))
  placed = jax.device_put(params, placement.shardings(model))
  assert generation.generate(model, placed, prompt, sampling, placement).tolist() == alone.tolist()


def _qkv(b, t, n, hd):
  return tuple(jax.random.normal(jax.random.key(i), (b, t, n, hd), jnp.float32) for i in range(3))


def test_splash_local_mask_equals_xla_and_its_gradients():
  q, k, v = _qkv(1, 256, 2, 32)

  def loss(impl, local):
    def f(q, k, v):
      out = causal_attention(q, k, v, impl, interpret=True, window=100, local=local)
      return jnp.sum(out * jnp.cos(out))

    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

  for local in (True, jnp.asarray(True)):  # a constant kind, and a scanned one (cond)
    (ref, ref_grads), (got, got_grads) = loss('xla', local), loss('splash', local)
    assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref))
    assert harness.max_rel_err(ref_grads, got_grads) <= 1e-5


@pytest.mark.fast
def test_cudnns_window_arguments_are_the_window():
  """The cuDNN path's call (local_window_size=(W - 1, 0) beside is_causal),
  run by jax's XLA implementation of the same arguments (cuDNN needs a GPU),
  equals XLA's masked attention with the window."""
  from triax.model import common

  q, k, v = _qkv(2, 32, 2, 8)
  pos = jnp.arange(32)
  got = common._kernel_attention(q, k, v, 'xla', None, False, 5)
  np.testing.assert_allclose(got, context.masked_attention(q, k, v, pos, window=5), atol=1e-5)
  assert float(jnp.max(jnp.abs(got - context.masked_attention(q, k, v, pos)))) > 1e-2


def _split_attention(kind, transport, window, steps, s=64, ranks=4):
  """(value and q, k, v gradients of a loss of `kind`'s attention (context._ring
  or context._near_attention) over `ranks` context ranks of load-balanced
  slots, the jitted function's compiled HLO)."""
  from jax.sharding import PartitionSpec as P

  b, n, hd = 2, 2, 8
  q, k, v = _qkv(b, s, n, hd)
  pos = context.positions(s, ranks)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ranks]), ('context',))
  seq, row = P(None, 'context'), P('context')
  local = functools.partial(
    kind, axis='context', transport=transport, tile=16, window=window, steps=steps
  )
  split = jax.shard_map(
    local, mesh=mesh, in_specs=(seq, seq, seq, row), out_specs=seq, check_vma=False
  )
  cotangent = jax.random.normal(jax.random.key(3), (b, s, n, hd))
  run = jax.jit(
    jax.value_and_grad(lambda q, k, v: jnp.sum(split(q, k, v, pos) * cotangent), argnums=(0, 1, 2))
  )
  reference = jax.value_and_grad(
    lambda q, k, v: jnp.sum(context.masked_attention(q, k, v, pos, window=window) * cotangent),
    argnums=(0, 1, 2),
  )(q, k, v)
  return run(q, k, v), reference, run.lower(q, k, v).compile().as_text()


@pytest.mark.fast
@pytest.mark.parametrize('transport', context.TRANSPORTS)
@pytest.mark.parametrize('kind', ('ring', 'allgather'))
def test_a_window_skips_the_ranks_out_of_reach(kind, transport):
  """4 ranks of 16 load-balanced positions (chunks of 8), a 5-position window:
  rank r meets ranks r-1 and r+1 only (step 2 is out of every query's reach),
  and gives one device's masked attention and gradients."""
  from triax.compiled import hlo_work

  steps = window.ring_steps(4, 16, 5)
  assert steps == (0, 1, 3) and window.ring_steps(4, 16, 12) == (0, 1, 2, 3)
  fn = context._ring if kind == 'ring' else context._near_attention
  (value, grads), (ref, ref_grads), hlo = _split_attention(fn, transport, 5, steps)
  assert abs(float(value) - float(ref)) <= 1e-5 * abs(float(ref))
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5
  if kind == 'ring' and transport == 'ppermute':
    # The whole ring's 3 moves against the window's 2: fewer K/V transfers, at
    # most 3/4 of the matmuls (3 blocks scored of 4).
    _, _, whole = _split_attention(fn, transport, 5, (0, 1, 2, 3))
    windowed, full = hlo_work.work(hlo), hlo_work.work(whole)
    moved = lambda w: w.collective_counts['collective-permute']  # noqa: E731
    assert moved(windowed) < moved(full), (moved(windowed), moved(full))
    assert windowed.flops <= 0.75 * full.flops, (windowed.flops, full.flops)


@functools.cache
def _reference():
  return harness.loss_and_grads(harness.tiny_config(**WINDOWED, **{'mesh.data': 1}))


@pytest.mark.parametrize(
  'overrides',
  [
    # Chunks start at layers 0, 3, 5 and 7: each at another place in the pattern.
    {
      'mesh.data': 2,
      'mesh.pipe': 4,
      'pipeline.microbatches': 4,
      'pipeline.layers_per_stage': (3, 2, 2, 1),
    },
    {
      'mesh.data': 1,
      'mesh.tensor': 2,
      'mesh.pipe': 4,
      'pipeline.schedule': 'interleaved_1f1b',
      'pipeline.virtual_stages': 2,
      'pipeline.microbatches': 4,
    },
    {'mesh.data': 1, 'mesh.context': 2, 'model.context_attention': 'ring'},
    {'mesh.data': 2, 'mesh.context': 4, 'model.context_attention': 'allgather'},
  ],
  ids=['1f1b-uneven', 'interleaved-1x2x4', 'ring-2', 'allgather-4'],
)
def test_layouts_give_one_devices_loss_and_gradients(overrides):
  ref_loss, ref_grads = _reference()
  loss, grads = harness.loss_and_grads(harness.tiny_config(**WINDOWED, **overrides))
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.parametrize('kind', ('ring', 'allgather'))
def test_documents_and_a_skipping_window_give_one_devices_numbers(kind):
  """Packed documents within the window, the sequence (32) over 4 context
  ranks: chunks of 4, a 4-position window, so each rank skips one rank's block."""
  import test_context_parallel

  assert window.ring_steps(4, 8, 4) == (0, 1, 3)
  run = functools.partial(test_context_parallel._masked_run, 'llama', extra=WINDOWED.items())
  ref_loss, ref_grads = run((1, 1, 1, 1))
  loss, grads = run((2, 4, 1, 1), kind)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.fast
@pytest.mark.parametrize(
  'fields,key,message',
  [
    ({'model.sliding_window': 16}, 'model.sliding_window', 'global'),
    ({'model.sliding_window': -1}, 'model.sliding_window', 'integer >= 0'),
    ({'model.sliding_window_pattern': 1}, 'model.sliding_window_pattern', 'no layer local'),
    ({'model.sliding_window_pattern': 9}, 'model.sliding_window_pattern', 'no layer global'),
    (
      {'model.sliding_window': 0, 'model.sliding_window_pattern': 2},
      'model.sliding_window_pattern',
      'set model.sliding_window',
    ),
    ({'model.family': 'mixtral'}, 'model.sliding_window', 'no local layers'),
    ({'model.family': 'gpt', 'model.num_kv_heads': 0}, 'model.sliding_window', 'does not use'),
  ],
  ids=['whole', 'negative', 'all-global', 'all-local', 'no-window', 'mixtral', 'gpt'],
)
def test_bad_windows_are_refused_naming_the_key(fields, key, message):
  cfg = harness.tiny_config(**{**WINDOWED, **fields})
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.validate(cfg, 8)
  assert e.value.key == key
