"""DeepSeek (MLA, DeepSeekMoE with loss-free balancing, a dense first block,
MTP) on every axis against one device, fp32 and dropless: the loss, the
router and MTP figures, every gradient, and the balancing bias's gradient
(minus the experts' load, which the bias update reads) equal the objective
averaged over the same micro-batches on one program."""

import functools

import harness
import jax
import numpy as np
import pytest

# Router losses weighted so that their gradients are not lost in rounding.
LOSSES = {
  'model.router_aux_loss_coef': 0.1,
  'model.router_z_loss_coef': 0.05,
  'model.router_seq_aux_loss_coef': 0.1,
}


def _config(**overrides):
  return harness.tiny_deepseek_config(**{**LOSSES, **overrides})


@functools.cache
def _reference(m: int, shape: tuple = ()):
  loss, grads, means = harness.microbatch_reference(_config(**dict(shape)), m)
  return loss, grads, {k: means[k] for k in FIGURES if k in means}


FIGURES = ('router_aux_loss', 'router_z_loss', 'router_seq_aux_loss', 'mtp_loss')


def _check(data, tensor, pipe, expert, m=1, **extra):
  shape = tuple(sorted((k, v) for k, v in extra.items() if k.startswith('model.')))
  ref_loss, ref_grads, ref_figures = _reference(m, shape)
  cfg = _config(
    **{'mesh.data': data, 'mesh.tensor': tensor, 'mesh.pipe': pipe, 'mesh.expert': expert},
    **{'pipeline.microbatches': m},
    **extra,
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
  # The bias's "gradient" is minus the load: counts, equal to the token.
  np.testing.assert_array_equal(grads['layers']['router_bias'], ref_grads['layers']['router_bias'])
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.parametrize(
  'data,tensor,expert',
  [(2, 1, 2), (2, 2, 2)],
  ids=['data2xexpert2', 'data2xtensor2xexpert2'],
)
def test_unpipelined_layouts_match_one_device(data, tensor, expert):
  _check(data, tensor, 1, expert)


def test_1f1b_with_experts_matches_one_device():
  _check(2, 1, 2, 2, m=4, **{'pipeline.schedule': '1f1b'})


def test_fused_dualpipe_v_with_experts_matches_one_device():
  # 4 MoE blocks in 4 chunks (2 stages x 2 virtual), beside the dense first.
  fused = {'pipeline.virtual_stages': 2, 'pipeline.fuse_overlaps': True, 'model.num_layers': 5}
  _check(2, 1, 2, 2, m=4, **{'pipeline.schedule': 'dualpipe_v', **fused})


def test_zb_v_over_tensor_and_four_stages_matches_one_device():
  # 8 MoE blocks in 8 chunks of one (4 stages x 2 virtual), beside the dense first;
  # the edges' gradients (the dense block's, MTP's) made after the tick loop.
  layers = {'model.num_layers': 9, 'pipeline.virtual_stages': 2, 'pipeline.edge_grads': 'after'}
  _check(1, 2, 4, 1, m=8, **{'pipeline.schedule': 'zb_v', **layers})


@pytest.mark.parametrize('kind', ['allgather', 'ring'])
def test_context_parallel_attention_matches_one_device(kind):
  # MLA's v heads are narrower than q/k's: padded to their width for both kinds.
  # MTP shifts rows by positions the context ranks split: refused, so off here.
  context = {'mesh.context': 2, 'model.context_attention': kind, 'model.mtp_depth': 0}
  _check(2, 1, 1, 2, **context)
