"""Saving, restoring and evaluating never gather the model (memory_analysis).

The conversion between the pipeline layout and the checkpoint's (model layer
order, split over `pipe`) adds per device about one train state, not the
whole model; evaluation keeps the weights split over `pipe` and gathers one
layer at a time, and gives the losses of one device.
"""

import harness
import jax
import numpy as np
import pytest

from triax import sharding

SHAPE = {'model.num_layers': 16, 'model.d_model': 64, 'model.d_ff': 256}


@pytest.mark.parametrize(
  'layout, extra, bound',
  [
    # Even split, v = 1: each stage's share is its own layers, nothing moves.
    ((1, 1, 8), {'pipeline.microbatches': 8}, 1.25),
    ((2, 2, 2), {'pipeline.microbatches': 2, 'pipeline.schedule': 'zb_h1'}, 1.25),
    # Interleaved: chunks move between stages by an all-to-all of about twice
    # the leaf; converted leaf by leaf, only the largest leaf's is added (in one
    # program XLA held 0.66x the state of them).
    (
      (1, 2, 4),
      {
        'pipeline.microbatches': 4,
        'pipeline.schedule': 'interleaved_1f1b',
        'pipeline.virtual_stages': 2,
      },
      1.25,
    ),
    # ZB-V's V: every chunk moves (the index gather was an all-gather, 1.76x).
    (
      (1, 1, 4),
      {'pipeline.microbatches': 4, 'pipeline.schedule': 'zb_v', 'pipeline.virtual_stages': 2},
      1.25,
    ),
    # Uneven: model order does not split into whole chunks; the index permutation.
    (
      (1, 1, 4),
      {
        'pipeline.microbatches': 4,
        'model.num_layers': 14,
        'pipeline.layers_per_stage': (5, 4, 3, 2),
      },
      1.25,
    ),
  ],
  ids=['1x1x8', '2x2x2', '1x2x4-v2', '1x1x4-zbv', '1x1x4-uneven'],
)
def test_save_and_restore_hold_about_one_train_state(layout, extra, bound):
  data, tensor, pipe = layout
  cfg = harness.tiny_config(
    **{'mesh.data': data, 'mesh.tensor': tensor, 'mesh.pipe': pipe, **SHAPE, **extra}
  )
  trainer = harness.make_trainer(cfg)
  state = trainer.abstract_state()
  state_bytes = sharding.per_device_bytes(state, trainer.state_shardings)
  canonical = trainer.abstract_canonical_state()
  # The checkpoint's share per device is 1/pipe of the model (everything splits here) ...
  whole = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(canonical))
  shards = sharding.per_device_bytes(canonical, trainer.canonical_shardings)
  assert shards * pipe * tensor <= whole * 1.01
  with jax.set_mesh(trainer.mesh):
    save = trainer.to_canonical.added_bytes(state)
    restore = trainer.from_canonical.added_bytes(canonical)
  # ... so converting to it and back adds about one train state, not pipe of them.
  assert save <= bound * state_bytes, (save, state_bytes)
  assert restore <= bound * state_bytes, (restore, state_bytes)
  # And the values are the layout's own permutation, both ways (host numpy).
  real = harness.initial_state(trainer, 0)
  canonical = jax.device_get(trainer.to_canonical(real))
  host = jax.device_get(real)
  want = jax.tree.map(np.asarray, trainer.layout.tree_to_model_order(host))
  jax.tree.map(np.testing.assert_array_equal, canonical, want)
  back = jax.device_get(trainer.from_canonical(trainer.to_canonical(real)))
  jax.tree.map(np.testing.assert_array_equal, back, host)


def _eval(cfg, batch):
  trainer = harness.make_trainer(cfg)
  params = harness.initial_params(trainer, 0)
  with jax.set_mesh(trainer.mesh):
    placed = jax.device_put(batch, trainer.batch_sharding)
    loss = float(trainer.eval_loss(params, placed))
    abstract = trainer.abstract_state()
    train = trainer.train_step.lower(abstract, placed).compile().memory_analysis()
    evaluate = trainer.eval_loss.lower(abstract.params, placed).compile().memory_analysis()
  return loss, train, evaluate


# Weights that outweigh a small batch's activations, so the test can tell.
EVAL_SHAPE = {**SHAPE, 'model.d_model': 128, 'model.d_ff': 512, 'train.global_batch_size': 8}


def test_eval_on_the_pipeline_mesh_keeps_weights_split_and_matches_one_device():
  cfg = harness.tiny_config(**{'mesh.data': 1, 'mesh.tensor': 1, 'mesh.pipe': 8, **EVAL_SHAPE})
  cfg.pipeline.microbatches = 8
  batch = harness.random_batch(cfg)
  loss, train, evaluate = _eval(cfg, batch)
  one = harness.tiny_config(**{'mesh.data': 1, **EVAL_SHAPE})
  ref, _, _ = _eval(one, batch)
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  # Gathered in layer order (as evaluation did before), the whole model sat in
  # every device's temporaries; split, a device holds far less than half of it.
  params = sum(
    a.size * a.dtype.itemsize
    for a in jax.tree.leaves(harness.make_trainer(one).abstract_state().params)
  )
  assert evaluate.argument_size_in_bytes + evaluate.temp_size_in_bytes < params / 2, (
    evaluate.argument_size_in_bytes,
    evaluate.temp_size_in_bytes,
    params,
  )
  assert evaluate.temp_size_in_bytes < train.temp_size_in_bytes
