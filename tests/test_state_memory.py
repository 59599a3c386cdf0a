"""Saving, restoring and evaluating hold no more than the train step (memory_analysis).

The conversion between the pipeline layout and the checkpoint's (model layer
order, split over `pipe`, in host memory) holds per device the train state
and one leaf's conversion, never the state twice; evaluation splits each
micro-batch's rows over `data` and `pipe`, keeps the weights split and
gathers one layer at a time, and gives the losses of one device.
"""

import re

import harness
import jax
import numpy as np
import pytest

from triax import sharding
from triax.compiled import stats as stats_lib

SHAPE = {'model.num_layers': 16, 'model.d_model': 64, 'model.d_ff': 256}


@pytest.mark.parametrize(
  'layout, extra, bound',
  [
    # Even split, v = 1: each stage's share is its own layers, nothing moves.
    ((1, 1, 8), {'pipeline.microbatches': 8}, 1.0),
    ((2, 2, 2), {'pipeline.microbatches': 2, 'pipeline.schedule': 'zb_h1'}, 1.0),
    # Interleaved: chunks move between stages by ppermutes of whole chunks, the
    # leaf's received chunks and the slots they fill: twice the leaf.
    (
      (1, 2, 4),
      {
        'pipeline.microbatches': 4,
        'pipeline.schedule': 'interleaved_1f1b',
        'pipeline.virtual_stages': 2,
      },
      2.0,
    ),
    # ZB-V's V: every chunk moves (the index gather was an all-gather, 1.76x the state).
    (
      (1, 1, 4),
      {'pipeline.microbatches': 4, 'pipeline.schedule': 'zb_v', 'pipeline.virtual_stages': 2},
      2.0,
    ),
    # Uneven: model order does not split into whole chunks; the index permutation
    # gathers the leaf's padded stack from the 4 stages.
    (
      (1, 1, 4),
      {
        'pipeline.microbatches': 4,
        'model.num_layers': 14,
        'pipeline.layers_per_stage': (5, 4, 3, 2),
      },
      6.0,
    ),
    # Data parallel: the checkpoint's layout is the train state's; on the device it
    # was a second copy of the state, 2x, above the step's peak.
    ((8, 1, 1), {}, 1.0),
  ],
  ids=['1x1x8', '2x2x2', '1x2x4-v2', '1x1x4-zbv', '1x1x4-uneven', '8x1x1'],
)
def test_save_and_restore_hold_the_state_and_one_leaf(layout, extra, bound):
  data, tensor, pipe = layout
  cfg = harness.tiny_config(
    **{'mesh.data': data, 'mesh.tensor': tensor, 'mesh.pipe': pipe, **SHAPE, **extra}
  )
  trainer = harness.make_trainer(cfg)
  state = trainer.abstract_state()
  state_bytes = sharding.per_device_bytes(state, trainer.state_shardings)
  leaf = max(
    sharding.per_device_bytes(a, s)
    for a, s in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings))
  )
  canonical = trainer.abstract_canonical_state()
  # The checkpoint's share per device is 1/pipe of the model (everything splits
  # here), in host memory: no device holds it beside the train state.
  whole = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(canonical))
  shards = sharding.per_device_bytes(canonical, trainer.canonical_shardings)
  assert shards * pipe * tensor <= whole * 1.01
  assert {s.memory_kind for s in jax.tree.leaves(trainer.canonical_shardings)} == {'pinned_host'}
  with jax.set_mesh(trainer.mesh):
    save = trainer.to_canonical.peak_bytes(state)
    restore = trainer.from_canonical.peak_bytes(canonical)
  # Converting to it and back holds the train state and one leaf's conversion
  # at a time, not the state twice.
  assert state_bytes <= save <= state_bytes + bound * leaf, (save, state_bytes, leaf)
  assert state_bytes <= restore <= state_bytes + bound * leaf, (restore, state_bytes, leaf)
  # And the values are the layout's own permutation, both ways (host numpy).
  real = harness.initial_state(trainer, 0)
  canonical = jax.device_get(trainer.to_canonical(real))
  host = jax.device_get(real)
  want = jax.tree.map(np.asarray, trainer.layout.tree_to_model_order(host))
  jax.tree.map(np.testing.assert_array_equal, canonical, want)
  back = jax.device_get(trainer.from_canonical(trainer.to_canonical(real)))
  jax.tree.map(np.testing.assert_array_equal, back, host)


def test_data_parallel_runs_peak_is_its_train_steps():
  """Where a save held a second copy of the state beside it, the run's peak was
  the save's, not the step's (docs/bench_tpu_compile.md: every TPU row)."""
  cfg = harness.tiny_config(**{'mesh.data': 8, 'mesh.tensor': 1, 'mesh.pipe': 1, **SHAPE})
  _, _, stats = stats_lib.all_compile_stats(harness.make_trainer(cfg))
  assert stats_lib.run_peak_bytes(stats) == stats_lib.step_peak_bytes(stats), stats


def _eval(cfg, batch):
  trainer = harness.make_trainer(cfg)
  params = harness.initial_params(trainer, 0)
  with jax.set_mesh(trainer.mesh):
    placed = jax.device_put(batch, trainer.batch_sharding)
    loss = float(trainer.eval_loss(params, placed))
    compiled = trainer.eval_loss.lower(trainer.abstract_state().params, placed).compile()
  return trainer, loss, compiled


def _embedded_rows(compiled, seq: int) -> set[int]:
  """Rows per device of the token ids [rows, seq] the compiled evaluation embeds."""
  shape = re.compile(rf'\s*%\S+ = s32\[(\d+),{seq}\]')
  lines = compiled.as_text().splitlines()
  return {int(m.group(1)) for line in lines if '/Embed/' in line and (m := shape.match(line))}


# Weights that outweigh a small batch's activations, so the test can tell.
EVAL_SHAPE = {**SHAPE, 'model.d_model': 128, 'model.d_ff': 512, 'train.global_batch_size': 16}


def test_eval_on_the_pipeline_mesh_splits_rows_and_weights_and_matches_one_device():
  batch = harness.random_batch(harness.tiny_config(**EVAL_SHAPE))
  one = harness.tiny_config(**{'mesh.data': 1, **EVAL_SHAPE})
  _, ref, _ = _eval(one, batch)
  params = sum(
    a.size * a.dtype.itemsize
    for a in jax.tree.leaves(harness.make_trainer(one).abstract_state().params)
  )
  # 16 rows over 8 pipe ranks: 2 each, in one micro-batch as the step's (16 / 8
  # micro-batches), or in two; every rank embeds its own rows only.
  for asked, rows in ((0, 2), (2, 1)):
    cfg = harness.tiny_config(**{'mesh.data': 1, 'mesh.tensor': 1, 'mesh.pipe': 8, **EVAL_SHAPE})
    cfg.pipeline.microbatches = 8
    cfg.train.eval_microbatches = asked
    trainer, loss, compiled = _eval(cfg, batch)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    assert _embedded_rows(compiled, cfg.model.seq_len) == {rows}, asked
    # Gathered in layer order (as evaluation did once), the whole model sat in
    # every device's temporaries; split, a device holds far less than half of it.
    evaluate = compiled.memory_analysis()
    held = evaluate.argument_size_in_bytes + evaluate.temp_size_in_bytes
    assert held < params / 2, (held, params)
  # The run's peak is the train step's: a save, a restore or an evaluation
  # beside the resident state holds less.
  _, _, stats = stats_lib.all_compile_stats(trainer)
  assert stats_lib.run_peak_bytes(stats) == stats_lib.step_peak_bytes(stats), stats
