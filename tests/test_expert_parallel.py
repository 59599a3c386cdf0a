"""Expert parallelism (mesh.expert, carved from the data-parallel devices):
the experts of every MoE layer split over the `expert` mesh axis, tokens
sent to them and back by all-to-all. Loss and gradients at (data, tensor) x
expert are one device's (fp32), dropless and capacity (per-row buffers: the
same assignments drop); a few training steps too; the compiled step holds
the all-to-alls; the weights and Adam's moments are split over `expert`."""

import functools
import re

import harness
import jax
import numpy as np
import pytest

from triax import config as config_lib
from triax import sharding
from triax.compiled import stats as stats_lib
from triax.errors import ConfigError


def _config(**overrides):
  return harness.tiny_mixtral_config(**overrides)


@functools.cache
def _reference(dispatch):
  cfg = _config(**{'mesh.data': 1, 'model.moe_dispatch': dispatch, 'model.capacity_factor': 0.5})
  steps = harness.train_losses(cfg, 3) if dispatch == 'dropless' else None
  return harness.loss_and_grads(cfg), steps


# capacity_factor 0.5: buffers of half the even share, so every row drops assignments.
def _check(dispatch, data, tensor, expert, steps=False, **extra):
  """Loss and gradients as one device's; with `steps`, 3 training steps' losses too."""
  (ref_loss, ref_grads), ref_losses = _reference(dispatch)
  cfg = _config(
    **{'mesh.data': data, 'mesh.tensor': tensor, 'mesh.expert': expert},
    **{'model.moe_dispatch': dispatch, 'model.capacity_factor': 0.5, **extra},
  )
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5
  # Every expert learns: none of them is left out of the exchange.
  assert (np.abs(grads['layers']['w_down']).max(axis=(0, 2, 3)) > 0).all()
  if steps:
    np.testing.assert_allclose(harness.train_losses(cfg, 3), ref_losses, rtol=1e-5)


@pytest.mark.parametrize('data,tensor,expert', [(2, 1, 2), (4, 1, 4), (2, 2, 2), (4, 2, 2)])
def test_dropless_matches_one_device(data, tensor, expert):
  _check('dropless', data, tensor, expert)


def test_dropless_with_fsdp_and_zero1_matches_one_device():
  # Adam's moments split over expert and data: three steps of the optimizer too.
  extra = {'mesh.fsdp': True, 'train.optimizer_sharding': 'data'}
  _check('dropless', 8, 1, 2, steps=True, **extra)


@pytest.mark.parametrize('data,tensor,expert', [(2, 1, 2), (4, 1, 4), (2, 2, 2)])
def test_capacity_drops_what_one_device_drops(data, tensor, expert):
  _check('capacity', data, tensor, expert)


def _all_to_alls(cfg) -> int:
  compiled, _ = stats_lib.compile_stats(harness.make_trainer(cfg))
  return sum(harness.collectives_by_computation(compiled.as_text(), 'all-to-all').values())


@pytest.mark.parametrize('dispatch,count', [('dropless', 5), ('capacity', 4)])
def test_compiled_step_meets_the_experts_by_all_to_all(dispatch, count):
  # dropless, in the scanned layer: the rows and their experts' ids out, the
  # results back; backward, the two float ones transposed. capacity: the
  # buffers out and back, and their transposes.
  base = {'mesh.data': 4, 'mesh.tensor': 2, 'model.moe_dispatch': dispatch}
  assert _all_to_alls(_config(**base, **{'mesh.expert': 2})) == count
  assert _all_to_alls(_config(**base)) == 0


def test_experts_and_their_adam_moments_are_split_over_expert():
  cfg = _config(
    **{'mesh.data': 8, 'mesh.expert': 4, 'mesh.fsdp': True, 'train.optimizer_sharding': 'data'}
  )
  trainer = harness.make_trainer(cfg)
  assert dict(trainer.mesh.shape) == {
    'data': 2,
    'expert': 4,
    'context': 1,
    'tensor': 1,
    'pipe': 1,
  }
  params = trainer.state_shardings.params['layers']
  # Adam's moments: the first state of the chain with them (clipping's comes before).
  adam = next(
    x
    for x in jax.tree.leaves(trainer.state_shardings.opt_state, is_leaf=lambda x: hasattr(x, 'mu'))
    if hasattr(x, 'mu')
  )
  for name in ('w_gate', 'w_up', 'w_down'):
    for tree in (params, adam.mu['layers'], adam.nu['layers']):
      assert 'expert' in tree[name].spec, (name, tree[name].spec)
  # Each device holds one of the 4 experts, its d_model half (FSDP over the outer data).
  shape = trainer.abstract_state().params['layers']['w_gate'].shape
  assert params['w_gate'].shard_shape(shape)[-3:] == (1, 16, 32)
  # The rest of the model is data-parallel over all 8 devices: the batch over data x expert.
  rules = dict(sharding.resolve_rules(trainer.cfg))
  assert rules['batch'] == ('data', 'expert') and rules['experts'] == 'expert'


@pytest.mark.fast
@pytest.mark.parametrize('fsdp', [False, True])
def test_a_validated_config_validates_again_under_any_expert_degree(fsdp):
  # A workdir's config.json is the validated config: a resume validates it
  # again, an elastic re-plan with another expert degree too.
  given = _config(**{'mesh.data': 4, 'mesh.expert': 2, 'mesh.fsdp': fsdp})
  validated = config_lib.validate(given, 4)
  assert validated.sharding.logical_axis_rules == given.sharding.logical_axis_rules
  assert config_lib.validate(validated, 4).to_dict() == validated.to_dict()
  for expert in (1, 4):
    validated.mesh.expert = given.mesh.expert = expert
    assert sharding.resolve_rules(config_lib.validate(validated, 4)) == sharding.resolve_rules(
      config_lib.validate(given, 4)
    )


@pytest.mark.parametrize(
  'overrides,key',
  [
    ({'mesh.expert': 0}, 'mesh.expert'),
    ({'mesh.expert': 3}, 'mesh.expert'),  # does not divide mesh.data=8
    ({'mesh.expert': 8}, 'mesh.expert'),  # 4 experts cannot be split 8 ways
    ({'mesh.expert': 4, 'mesh.dcn_data': 4}, 'mesh.expert'),  # 2 devices per slice
    ({'mesh.expert': 2, 'model.family': 'llama'}, 'mesh.expert'),
    ({'model.experts_per_token': 5}, 'model.experts_per_token'),
    ({'model.capacity_factor': -1.0}, 'model.capacity_factor'),
    ({'model.family': 'llama'}, 'model.num_experts'),  # a MoE key on a dense family
  ],
)
def test_bad_expert_settings_are_refused_naming_the_key(overrides, key):
  cfg = _config(**{'mesh.data': 8, **overrides})
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert e.value.key == key


def test_cli_refuses_an_expert_degree_in_one_line(tmp_path):
  result = harness.run_cli(
    'triax',
    'train',
    f'--config={harness.ROOT}/experiments/mixtral_tiny.py:smoke',
    f'--workdir={tmp_path}/w',
    '--cpu_devices=8',
    '--config.mesh.expert=3',
  )
  assert result.returncode == 2, result.stderr[-2000:]
  assert re.fullmatch(r'error: mesh\.expert: [^\n]+\n', result.stderr), result.stderr
  assert not (tmp_path / 'w').exists()
