"""The splash kernel (model.attention=splash) against XLA's attention, through
Pallas's interpreter on the CPU (model.splash_interpret): the same numbers
on one device, under every kind of sharding the kernel's shard_map takes,
and inside the pipeline executor's (a nested shard_map with its own
backward)."""

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.model import splash
from triax.model.common import causal_attention


def _qkv(b=2, t=256, n=4, kv=2, hd=32):
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, n, hd), jnp.float32)
  k, v = (jax.random.normal(key, (b, t, kv, hd), jnp.float32) for key in keys[1:])
  return q, k, v


@pytest.mark.parametrize('documents', [False, True])
def test_splash_equals_xla_attention_and_its_gradients(documents):
  q, k, v = _qkv()
  t = q.shape[1]
  segments = jnp.asarray(np.repeat(np.arange(4), t // 4)[None].repeat(2, 0)) if documents else None

  def loss(impl):
    def f(q, k, v):
      out = causal_attention(q, k, v, impl, segments=segments, interpret=True)
      return jnp.sum(out * jnp.cos(out))

    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

  (ref, ref_grads), (got, got_grads) = loss('xla'), loss('splash')
  assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref))
  assert harness.max_rel_err(ref_grads, got_grads) <= 1e-5


def test_the_tile_divides_the_sequence():
  assert [splash.block_size(t) for t in (2048, 768, 384, 128)] == [512, 256, 128, 128]


def _family(family):
  """The model of the layout tests: `family` at 128 positions, full remat."""
  overrides = {'model.family': family, 'model.seq_len': 128, 'model.remat': 'full'}
  if family == 'llama':
    overrides['model.num_kv_heads'] = 4
  return overrides


@functools.cache
def _one_device_with_xla(family):
  """The reference of every layout of `family` (one model, one batch): run once."""
  return harness.loss_and_grads(harness.tiny_config(**_family(family), **{'mesh.data': 1}))


@pytest.mark.parametrize(
  'mesh',
  [(2, 2, 1), (1, 2, 2), (2, 1, 4)],
  ids=['data-tensor', 'tensor-pipe', 'data-pipe'],
)
@pytest.mark.parametrize('family', ['gpt', 'llama'])
def test_splash_layouts_equal_one_device_with_xla(family, mesh):
  """A layout with splash (interpreted) gives one device's XLA-attention loss and gradients."""
  overrides = _family(family)
  ref = _one_device_with_xla(family)
  data, tensor, pipe = mesh
  cfg = harness.tiny_config(
    **overrides,
    **{
      'mesh.data': data,
      'mesh.tensor': tensor,
      'mesh.pipe': pipe,
      'pipeline.microbatches': 2 * pipe if pipe > 1 else 1,
      'model.attention': 'splash',
      'model.splash_interpret': True,
    },
  )
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref[0]) <= 1e-5 * abs(ref[0]), (loss, ref[0])
  assert harness.max_rel_err(ref[1], grads) <= 1e-5
