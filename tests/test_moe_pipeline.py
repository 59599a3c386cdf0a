"""A mixture of experts under the pipeline executor (model.router_aux_loss_scope=
microbatch, Megatron's: each MoE layer balances its load over each
micro-batch). Loss, router figures and gradients equal one device's
objective averaged over the same micro-batches (fp32), with and without
expert parallelism, for 1f1b and DualPipeV; the batch-wide scope is refused
under the executor in one line (tests/test_bad_input.py)."""

import functools

import harness
import jax
import numpy as np
import pytest

SCOPE = {'model.router_aux_loss_scope': 'microbatch', 'model.router_aux_loss_coef': 0.1}


def _config(**overrides):
  # coefficients large enough that the router losses' gradients are not lost in rounding
  return harness.tiny_mixtral_config(
    **{'model.num_layers': 4, 'model.router_z_loss_coef': 0.05, **SCOPE, **overrides}
  )


@functools.cache
def _reference(m: int, dispatch: str, shape: tuple = ()):
  """One device's objective over the same micro-batches, its gradient, the
  figures; `shape`: (model key, value) pairs of the model compared."""
  cfg = _config(**{'model.moe_dispatch': dispatch, 'model.capacity_factor': 0.5, **dict(shape)})
  loss, grads, means = harness.microbatch_reference(cfg, m)
  return loss, grads, {k: means[k] for k in ('router_aux_loss', 'router_z_loss')}


def _check(data, tensor, pipe, expert, m, schedule='1f1b', dispatch='dropless', **extra):
  shape = tuple(sorted((k, v) for k, v in extra.items() if k.startswith('model.')))
  ref_loss, ref_grads, ref_figures = _reference(m, dispatch, shape)
  cfg = _config(
    **{'mesh.data': data, 'mesh.tensor': tensor, 'mesh.pipe': pipe, 'mesh.expert': expert},
    **{'pipeline.microbatches': m, 'pipeline.schedule': schedule},
    **{'model.moe_dispatch': dispatch, 'model.capacity_factor': 0.5, **extra},
  )
  trainer = harness.make_trainer(cfg)
  params = harness.initial_params(trainer, cfg.train.seed)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    loss, grads, metrics = trainer.loss_and_grad(params, batch)
  grads = trainer.layout.tree_to_model_order(jax.device_get(grads))
  assert abs(float(loss) - ref_loss) <= 1e-5 * abs(ref_loss), (float(loss), ref_loss)
  for k, want in ref_figures.items():
    np.testing.assert_allclose(float(metrics[k]), want, rtol=1e-5, err_msg=k)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.parametrize(
  'data,tensor,pipe,expert,m,schedule',
  [
    (2, 1, 2, 1, 4, '1f1b'),  # data manual in the executor: the counts summed over it
    (1, 2, 2, 1, 2, '1f1b'),  # each expert's columns over tensor, inside a stage
    (2, 1, 2, 2, 2, '1f1b'),
    (2, 1, 2, 2, 4, 'dualpipe_v'),
  ],
)
def test_dropless_pipeline_matches_one_device(data, tensor, pipe, expert, m, schedule):
  # DualPipeV's case also makes the edges' gradients after the tick loop
  # (pipeline.edge_grads; 'auto' keeps them in it at this size).
  v = {'pipeline.virtual_stages': 2, 'pipeline.edge_grads': 'after'}
  _check(data, tensor, pipe, expert, m, schedule, **(v if schedule == 'dualpipe_v' else {}))


@pytest.mark.parametrize('scan_layers', [True, False], ids=['scanned', 'unrolled'])
def test_fused_dualpipe_v_matches_one_device(scan_layers):
  # Each overlapped pair in one tick: one micro-batch's B and W, then
  # another's F, their all-to-alls in one computation (loop-free with the
  # layers unrolled, where XLA may run one's under the other's compute).
  fused = {'pipeline.virtual_stages': 2, 'pipeline.fuse_overlaps': True}
  _check(2, 1, 2, 2, 4, 'dualpipe_v', **fused, **{'model.scan_layers': scan_layers})


def test_capacity_pipeline_drops_what_one_device_drops():
  _check(2, 1, 2, 1, 2, dispatch='capacity')


def test_moe_every_other_block_in_uneven_chunks_matches_one_device():
  # Groups of a dense block and a MoE block, 2 groups on stage 0 and 1 on
  # stage 1 (a padded entry skipped there), the experts split too.
  shape = {'model.num_layers': 6, 'model.moe_every': 2, 'pipeline.layers_per_stage': (4, 2)}
  _check(2, 1, 2, 2, 2, **shape)


def test_a_grouped_pipelined_mixtral_converts_to_the_checkpoint_layout():
  """A save's relayout runs one program per leaf, each with collectives of every
  device; on XLA:CPU, run at once, they waited for each other (a mixtral with
  moe_every=2 at data 4 x pipe 2 aborted its first save: 7 of 8 devices in one
  program's collective-permute). Converted three times, it gives model order."""
  cfg = _config(
    **{'mesh.data': 4, 'mesh.pipe': 2, 'mesh.expert': 1, 'model.moe_every': 2},
    **{'pipeline.microbatches': 2},
  )
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    state = trainer.init_state(jax.random.key(cfg.train.seed))
    for _ in range(3):
      canonical = jax.block_until_ready(trainer.to_canonical(state))
  want = trainer.layout.tree_to_model_order(jax.device_get(state.params))
  assert harness.max_rel_err(want, jax.device_get(canonical.params)) == 0
