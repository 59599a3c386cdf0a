"""ZeRO-1 (train.optimizer_sharding=data: Adam's moments split over `data`) and
FSDP (mesh.fsdp: parameters too): the numbers of one device, and per-device
bytes divided by the data degree where each option says."""

import functools

import harness
import jax
import numpy as np
import pytest

from triax import sharding


@functools.cache
def _reference():
  return harness.train_losses(harness.tiny_config(**{'mesh.data': 1}), 4)


LAYOUTS = {
  (8, 1, 1): {},
  (4, 2, 1): {},
  (2, 1, 4): {'pipeline.schedule': '1f1b', 'pipeline.microbatches': 4},
  (2, 2, 2): {'pipeline.schedule': 'zb_h1', 'pipeline.microbatches': 2},
}


OPTIONS = {
  'replicated': {},
  'zero1': {'train.optimizer_sharding': 'data'},
  'fsdp': {'mesh.fsdp': True},
}


def _config(layout, option):
  data, tensor, pipe = layout
  return harness.tiny_config(
    **{
      'mesh.data': data,
      'mesh.tensor': tensor,
      'mesh.pipe': pipe,
      **OPTIONS[option],
      **LAYOUTS[layout],
    }
  )


def _sizes(trainer):
  state = trainer.abstract_state()
  shardings = trainer.state_shardings
  return (
    sharding.per_device_bytes(state.opt_state, shardings.opt_state),
    sharding.per_device_bytes(state.params, shardings.params),
  )


@pytest.mark.parametrize('option', ['zero1', 'fsdp'])
@pytest.mark.parametrize('layout', list(LAYOUTS), ids=lambda l: 'x'.join(map(str, l)))
def test_sharded_state_matches_one_device_and_divides_its_bytes(layout, option):
  cfg = _config(layout, option)
  trainer = harness.make_trainer(cfg)
  losses = []
  state = harness.initial_state(trainer, cfg.train.seed)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    # One compile, both run and measured.
    compiled = trainer.train_step.lower(trainer.abstract_state(), batch).compile()
    for _ in range(4):
      state, out = compiled(state, batch)
      losses.append(float(out['loss']))
  mem = compiled.memory_analysis()
  np.testing.assert_allclose(losses, _reference(), rtol=1e-5)
  assert losses[-1] < losses[0]

  data = layout[0]
  opt, params = _sizes(trainer)
  opt_r, params_r = _sizes(harness.make_trainer(_config(layout, 'replicated')))
  # Every moment (and, with FSDP, every parameter: each has a d_model
  # dimension) of this model splits; only Adam's step counts (8 bytes) stay
  # whole on each device.
  assert opt * data == opt_r + 8 * (data - 1)
  assert params * (data if option == 'fsdp' else 1) == params_r
  # What the compiled step takes per device is that state (and the step, and its batch rows).
  rows = sum(a.addressable_shards[0].data.nbytes for a in batch.values())
  assert mem.argument_size_in_bytes == params + opt + 4 + rows
  if option == 'fsdp' and layout[2] > 1 and layout[1] == 1:
    # Pipelined, the parameters are gathered once per step, before the tick
    # loop, not once per micro-batch in it: no all-gather outside the entry.
    # (With tensor > 1 the loop gathers each transfer over `tensor`: Megatron's
    # scatter/gather, test_pipeline_collectives.py.)
    gathers = harness.collectives_by_computation(compiled.as_text(), 'all-gather')
    assert any(name.startswith('ENTRY') for name in gathers)
    assert all(name.startswith('ENTRY') for name in gathers), gathers
