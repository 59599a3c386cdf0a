"""Every train.optimizer gives the numbers of one device across layouts (fp32):
data 2 x tensor 2 x pipe 2 with ZeRO-1, and FSDP over 8. The losses hold to
1e-5 relative, as every parity test's do; the parameters after the last
update to 1e-5 in each leaf's norm (||a - b|| / ||a||), but for
schedule-free AdamW and Muon's AdamW part.

Why a norm, and why schedule-free's is looser: an optimizer that divides
each element by its own RMS (Adam's first updates are g / (|g| + eps))
turns the rounding of a gradient element near cancellation, which the
layouts sum in different orders, into a visible share of that element's
update. AdamW itself (the default, whose parity tests compare losses) is
1.4e-5 (FSDP) to 4.8e-5 (d2 t2 p2) by that norm here, 7e-3 element-wise;
schedule-free AdamW, with no momentum to average it, 2.3e-5 to 1.2e-4.
Muon's orthogonalised matrices hold 1e-5 (4.2e-6 here, 5e-6 element-wise);
its embedding, head and norms, updated by its AdamW part, round as AdamW's
(1.3e-5 at d2 t2 p2 with the 2026-12-07 install: numpy 2.4.6, optax
0.2.8; 3.7e-6 with an earlier one), held at 5e-5. Adafactor (1.2e-7;
factored moments) and Lion (identical: the signs agree) hold 1e-5. One
reference per optimizer, three steps each (the first at warmup's learning
rate 0)."""

import functools

import harness
import jax
import numpy as np
import pytest

STEPS = 3
LAYOUTS = {
  'd2t2p2-zero1': {
    'mesh.data': 2,
    'mesh.tensor': 2,
    'mesh.pipe': 2,
    'pipeline.schedule': 'zb_h1',
    'pipeline.microbatches': 2,
    'train.optimizer_sharding': 'data',
  },
  'fsdp8': {'mesh.data': 8, 'mesh.fsdp': True},
}
# Each at a learning rate of its usual size (tiny_config's 1e-2 is AdamW's).
OPTIMIZERS = {
  'muon': {'train.learning_rate': 1e-2},
  'lion': {'train.learning_rate': 1e-3},
  'adafactor': {'train.learning_rate': 1e-2},
  'schedule_free_adamw': {'train.learning_rate': 1e-2},
}


# The parameters' norm-wise error allowed where 1e-5 is not (see the docstring): Muon's
# AdamW part (embedding, head, norms) as AdamW's, its layers' matrices held at 1e-5 apart.
PARAM_TOLERANCE = {'schedule_free_adamw': 3e-4, 'muon': 5e-5}


def _norm_err(a, b) -> float:
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def _config(name, **layout):
  # d_model and d_ff of 128: Adafactor factors its matrices' moments.
  return harness.tiny_config(
    **{
      'train.optimizer': name,
      'model.d_model': 128,
      'model.d_ff': 128,
      **OPTIMIZERS[name],
      **layout,
    }
  )


def _run(cfg):
  """Losses of STEPS updates on one batch, and the parameters after them (model order)."""
  trainer = harness.make_trainer(cfg)
  state = harness.initial_state(trainer, cfg.train.seed)
  losses = []
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    for _ in range(STEPS):
      state, out = trainer.train_step(state, batch)
      losses.append(float(out['loss']))
  return losses, trainer.layout.tree_to_model_order(jax.device_get(state.params))


@functools.cache
def _reference(name):
  return _run(_config(name, **{'mesh.data': 1}))


@pytest.mark.parametrize('layout', list(LAYOUTS))
@pytest.mark.parametrize('name', list(OPTIMIZERS))
def test_optimizer_matches_one_device(name, layout):
  ref_losses, ref_params = _reference(name)
  losses, params = _run(_config(name, **LAYOUTS[layout]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  errs = jax.tree.map(_norm_err, ref_params, params)
  err = max(jax.tree.leaves(errs))
  assert err <= PARAM_TOLERANCE.get(name, 1e-5), err
  if name == 'muon':  # the stacked matrices it orthogonalises
    matrices = [
      e
      for e, p in zip(jax.tree.leaves(errs['layers']), jax.tree.leaves(params['layers']))
      if p.ndim >= 3
    ]
    assert matrices and max(matrices) <= 1e-5, max(matrices)
  assert losses[-1] < losses[0]
