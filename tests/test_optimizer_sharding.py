"""ZeRO-1 (train.optimizer_sharding=data): Adam's moments split over `data`,
the numbers of one device, and per-device optimizer bytes divided by the data degree."""

import functools

import harness
import jax
import numpy as np
import pytest

from triax.training import step as step_lib


@functools.cache
def _reference():
  return harness.train_losses(harness.tiny_config(**{'mesh.data': 1}), 4)


LAYOUTS = {
  (8, 1, 1): {},
  (4, 2, 1): {},
  (2, 1, 4): {'pipeline.schedule': '1f1b', 'pipeline.microbatches': 4},
  (2, 2, 2): {'pipeline.schedule': 'zb_h1', 'pipeline.microbatches': 2},
}


def _config(layout, sharding):
  data, tensor, pipe = layout
  return harness.tiny_config(
    **{
      'mesh.data': data,
      'mesh.tensor': tensor,
      'mesh.pipe': pipe,
      'train.optimizer_sharding': sharding,
      **LAYOUTS[layout],
    }
  )


def _sizes(trainer):
  state = trainer.abstract_state()
  shardings = trainer.state_shardings
  return (
    step_lib.per_device_bytes(state.opt_state, shardings.opt_state),
    step_lib.per_device_bytes(state.params, shardings.params),
  )


@pytest.mark.parametrize('layout', list(LAYOUTS), ids=lambda l: 'x'.join(map(str, l)))
def test_zero1_matches_one_device_and_divides_the_optimizer_state(layout):
  cfg = _config(layout, 'data')
  trainer = harness.make_trainer(cfg)
  losses = []
  with jax.set_mesh(trainer.mesh):
    state = trainer.init_state(jax.random.key(cfg.train.seed))
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    for _ in range(4):
      state, out = trainer.train_step(state, batch)
      losses.append(float(out['loss']))
    mem = trainer.train_step.lower(trainer.abstract_state(), batch).compile().memory_analysis()
  np.testing.assert_allclose(losses, _reference(), rtol=1e-5)
  assert losses[-1] < losses[0]

  data = layout[0]
  opt_z, params_z = _sizes(trainer)
  opt_r, params_r = _sizes(harness.make_trainer(_config(layout, 'replicated')))
  assert params_z == params_r  # ZeRO-1 leaves the parameters as they were
  # Every moment of this model has a dimension the data degree divides, so all
  # of it splits; only Adam's step counts (8 bytes) stay whole on each device.
  assert opt_z * data == opt_r + 8 * (data - 1)
  # What the compiled step takes per device is that state (and the step, and its batch rows).
  rows = sum(a.addressable_shards[0].data.nbytes for a in batch.values())
  assert mem.argument_size_in_bytes == params_z + opt_z + 4 + rows
