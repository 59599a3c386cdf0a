"""Activation memory is bounded by the schedule, not by the micro-batch count.

From XLA's compiled memory analysis (deterministic): with the micro-batch
size fixed, 1f1b and interleaved_1f1b per-device temp bytes grow by at most
10% from m = 4p to m = 16p, while gpipe's grow with m.
"""

import jax
import pytest

import harness
from triax.training.loop import compile_stats

P = 4


def _temp_bytes(schedule, v, m):
  cfg = harness.tiny_config(**{
      'mesh.data': 1, 'mesh.tensor': 2, 'mesh.pipe': P, 'pipeline.schedule': schedule,
      'pipeline.virtual_stages': v, 'pipeline.microbatches': m,
      'train.global_batch_size': 2 * m, 'model.seq_len': 64, 'model.d_model': 64,
      'model.d_ff': 256})
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    return compile_stats(trainer)[1]['temp_bytes']


@pytest.mark.parametrize('schedule,v', [('1f1b', 1), ('interleaved_1f1b', 2)])
def test_one_f_one_b_memory_is_flat_in_microbatches(schedule, v):
  small, large = _temp_bytes(schedule, v, 4 * P), _temp_bytes(schedule, v, 16 * P)
  assert large <= 1.10 * small, (small, large)


def test_gpipe_memory_grows_with_microbatches():
  small, large = _temp_bytes('gpipe', 1, 4 * P), _temp_bytes('gpipe', 1, 16 * P)
  assert large >= 2.0 * small, (small, large)


def _stats(schedule, m, **overrides):
  cfg = harness.tiny_config(**{
      'mesh.data': 1, 'mesh.tensor': 1, 'mesh.pipe': P, 'pipeline.schedule': schedule,
      'pipeline.microbatches': m, 'train.global_batch_size': 4 * m, 'model.seq_len': 128,
      'model.d_model': 64, 'model.d_ff': 256, 'model.num_heads': 4, **overrides})
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    return compile_stats(trainer)[1]


def test_bpipe_cuts_peak_temp_bytes_when_activations_dominate():
  """Activation-dominated: 128 tokens x 4 sequences per micro-batch through a
  64-wide model, so one stash slot (~12.8 MB) dwarfs the weights (~0.1 MB).
  1f1b compiles 7 slots on every device (stage 0's lockstep peak); bpipe's
  shared own+guest pool needs 4, plus a send and a landing buffer of one
  slot each (its ppermute runs every tick, outside any branch). The largest
  per-device temp must drop >= 20% (measured: 114.4 -> 87.5 MB).
  """
  one_f_one_b, bpipe = _stats('1f1b', 16), _stats('bpipe', 16)
  assert bpipe['schedule']['stash_slots'] < one_f_one_b['schedule']['stash_slots']
  assert bpipe['temp_bytes'] <= 0.80 * one_f_one_b['temp_bytes'], (
      one_f_one_b['temp_bytes'], bpipe['temp_bytes'])
  assert bpipe['schedule']['residual_bytes_moved_per_step'] > 0
  assert one_f_one_b['schedule']['residual_bytes_moved_per_step'] == 0
