"""Data x tensor parallelism gives the numbers of one device (fp32, <= 1e-5 relative)."""

import functools

import harness
import pytest


@functools.cache
def _reference():
  cfg = harness.tiny_config(**{'mesh.data': 1})
  return harness.loss_and_grads(cfg), harness.train_losses(cfg, 5)


@pytest.mark.parametrize('data,tensor', [(8, 1), (1, 8), (2, 4), (4, 2)])
def test_gradients_and_losses_match_one_device(data, tensor):
  (ref_loss, ref_grads), ref_losses = _reference()
  cfg = harness.tiny_config(**{'mesh.data': data, 'mesh.tensor': tensor})
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5
  losses = harness.train_losses(cfg, 5)
  for a, b in zip(ref_losses, losses):
    assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
  # The run learns (it fits the one batch), so parity is not that of two frozen models.
  assert losses[-1] < losses[0]
