"""data.mask_documents: attention stays inside each document of a packed row.

A Llama's rotary positions are relative, so a document's logits in a packed
row, masked, are its logits alone; and a masked step gives one device's loss
and gradients on pipelined and tensor-parallel layouts.
"""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_a_packed_document_sees_only_itself():
  model = harness.model_of(
    family='llama', num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, seq_len=16
  )
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  first, second = rng.integers(0, 256, 10), rng.integers(0, 256, 6)
  row = jnp.asarray(np.concatenate([first, second])[None], jnp.int32)
  segments = jnp.asarray([[0] * 10 + [1] * 6], jnp.int32)
  packed = model.logits(params, row, segments)
  alone = [model.logits(params, jnp.asarray(doc[None], jnp.int32)) for doc in (first, second)]
  np.testing.assert_allclose(packed[:, :10], alone[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed[:, 10:], alone[1], rtol=1e-5, atol=1e-5)
  # Without the mask the second document attends to the first: other logits.
  assert float(jnp.max(jnp.abs(model.logits(params, row)[:, 10:] - alone[1]))) > 1e-3


def _masked(layout, extra=()):
  data, tensor, pipe = layout
  cfg = harness.tiny_config(
    **{
      'mesh.data': data,
      'mesh.tensor': tensor,
      'mesh.pipe': pipe,
      # Validation reads no files; these tests feed batches themselves.
      'data.source': 'tokens',
      'data.path': 'unused',
      'data.mask_documents': True,
      **dict(extra),
    }
  )
  trainer = harness.make_trainer(cfg)
  batch = harness.random_batch(cfg)
  rng = np.random.default_rng(1)
  starts = rng.random(batch['inputs'].shape) < 0.2  # a new document at about 1 in 5 tokens
  batch['segment_ids'] = np.cumsum(starts, axis=1).astype(np.int32)
  params = harness.initial_params(trainer, cfg.train.seed)
  with jax.set_mesh(trainer.mesh):
    placed = jax.device_put(batch, trainer.batch_sharding)
    loss, grads, _ = trainer.loss_and_grad(params, placed)
  return float(loss), trainer.layout.tree_to_model_order(jax.device_get(grads)), batch


@pytest.mark.parametrize(
  'layout, extra',
  [
    ((2, 2, 2), {'pipeline.schedule': 'zb_h1', 'pipeline.microbatches': 2}),
    (
      (1, 1, 4),
      {
        'pipeline.schedule': 'interleaved_1f1b',
        'pipeline.microbatches': 4,
        'pipeline.virtual_stages': 2,
      },
    ),
  ],
  ids=['2x2x2-zb_h1', '1x1x4-interleaved'],
)
def test_masked_training_matches_one_device(layout, extra):
  ref_loss, ref_grads, batch = _masked((1, 1, 1))
  loss, grads, _ = _masked(layout, extra.items())
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5
  # The mask changes the numbers (documents are short here): it is not a no-op.
  unmasked, _ = harness.loss_and_grads(harness.tiny_config(**{'mesh.data': 1}))
  assert abs(unmasked - ref_loss) > 1e-4 * abs(ref_loss)
  assert batch['segment_ids'].max() > 1
