"""train.optimizer: which leaves decay and which Muon trains, read from logical
axes (per family), the default's AdamW unchanged, and each optimizer's state
through a ZeRO-1 layout and a checkpoint's relayout."""

import harness
import jax
import numpy as np
import optax
import pytest

from triax import config
from triax.errors import ConfigError
from triax.training import optimizer as optimizer_lib
from triax.training import step as step_lib

# Per family: (model fields, leaves that decay, leaves Muon trains); the rest neither.
FAMILIES = {
  'gpt': (
    {'family': 'gpt'},
    {'tokens', 'out', 'w1', 'w2', 'wq', 'wk', 'wv', 'wo'},
    {'w1', 'w2', 'wq', 'wk', 'wv', 'wo'},
  ),
  'llama-bias-qknorm': (
    {'family': 'llama', 'num_kv_heads': 2, 'qkv_bias': True, 'qk_norm': True},
    {'tokens', 'out', 'w_gate', 'w_up', 'w_down', 'wq', 'wk', 'wv', 'wo'},
    {'w_gate', 'w_up', 'w_down', 'wq', 'wk', 'wv', 'wo'},
  ),
  'llama-tied': (
    {'family': 'llama', 'tie_embeddings': True},
    {'tokens', 'w_gate', 'w_up', 'w_down', 'wq', 'wk', 'wv', 'wo'},
    {'w_gate', 'w_up', 'w_down', 'wq', 'wk', 'wv', 'wo'},
  ),
  'mixtral-shared': (
    {'family': 'mixtral', 'num_experts': 4, 'experts_per_token': 2, 'shared_experts': 1},
    {'tokens', 'out', 'router', 'w_gate', 'w_up', 'w_down', 'wq', 'wk', 'wv', 'wo'}
    | {'shared_gate', 'shared_up', 'shared_down'},
    {'router', 'w_gate', 'w_up', 'w_down', 'wq', 'wk', 'wv', 'wo'}
    | {'shared_gate', 'shared_up', 'shared_down'},
  ),
  # MLA's projections, a dense first block (in the embedding), MTP's (in the head);
  # the balancing bias and the latents' and MTP's norms neither.
  'deepseek-mla-mtp': (
    {'family': 'deepseek', 'num_layers': 3, 'first_k_dense': 1, 'num_experts': 4}
    | {'experts_per_token': 2, 'shared_experts': 1, 'q_lora_rank': 16, 'kv_lora_rank': 8}
    | {'qk_nope_head_dim': 8, 'qk_rope_head_dim': 4, 'v_head_dim': 8, 'mtp_depth': 1},
    {'tokens', 'out', 'router', 'w_gate', 'w_up', 'w_down', 'wo', 'proj'}
    | {'wq_a', 'wq_b', 'wkv_a', 'wk_rope', 'wk_b', 'wv_b', 'shared_gate', 'shared_up'}
    | {'shared_down'},
    {'router', 'w_gate', 'w_up', 'w_down', 'wo', 'proj', 'wq_a', 'wq_b', 'wkv_a', 'wk_rope'}
    | {'wk_b', 'wv_b', 'shared_gate', 'shared_up', 'shared_down'},
  ),
}


def _model_leaves(fields):
  model = harness.model_of(**fields)
  axes = step_lib.pipeline_axes(model.logical_axes())
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return optimizer_lib.Leaves(axes), shapes


def _named(tree, keep) -> set:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path[-1].key for path, value in flat if keep(value)}


@pytest.mark.parametrize('family', list(FAMILIES))
def test_decay_and_muon_follow_the_axes_rule(family):
  fields, decays, muon = FAMILIES[family]
  leaves, shapes = _model_leaves(fields)
  names = _named(shapes, lambda _: True)
  assert _named(leaves.decay_mask(shapes), bool) == decays, names
  labels = leaves.muon_labels(())(shapes)
  assert _named(labels, lambda label: label == 'muon') == muon
  # Biases, norms (q/k's too) and positions are neither.
  neither = {'bq', 'bk', 'bv', 'q_norm', 'k_norm', 'attn_norm', 'positions', 'router_bias'}
  assert not (neither | {'q_a_norm', 'kv_a_norm', 'enorm', 'hnorm'}) & (decays | muon)


def test_a_matrix_is_two_features_past_the_stacked_axes():
  features = optimizer_lib.features
  assert features(('stage', 'virtual', 'layers', 'embed', 'heads', 'kv')) == ((-3,), (-2, -1))
  assert features(('layers', 'heads', 'kv')) == ((-2, -1),)  # a q bias: one feature
  assert optimizer_lib.is_matrix(('layers', 'experts', 'embed', 'mlp'))
  assert not optimizer_lib.is_matrix(('positions', 'embed'))
  dims = optimizer_lib.muon_dims(('layers', 'heads', 'kv', 'embed'))
  assert (dims.reduction_axis, dims.output_axis) == ((-3, -2), (-1,))


def _old_adamw(t, schedule):
  """The optimizer as it was built before train.optimizer (names, not axes)."""
  keep = ('attn_norm', 'mlp_norm', 'norm', 'positions')
  mask = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, _: path[-1].key not in keep, params
  )
  return optax.chain(
    optax.clip_by_global_norm(t.grad_clip_norm),
    optax.adamw(schedule, b1=t.adam_b1, b2=t.adam_b2, weight_decay=t.weight_decay, mask=mask),
  )


@pytest.mark.parametrize('family', ['gpt', 'llama-tied', 'mixtral-shared'])
def test_default_adamw_is_the_old_one_bit_for_bit(family):
  fields = FAMILIES[family][0]
  leaves, shapes = _model_leaves(fields)
  t = config.defaults().train
  schedule = step_lib.learning_rate_schedule(t)
  model_cfg = config.defaults().model
  model_cfg.update(fields)
  new = optimizer_lib.make_optimizer(t, model_cfg, schedule, _axes(fields))
  old = _old_adamw(t, schedule)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)
  grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
  state_new, state_old = new.init(params), old.init(params)
  assert jax.tree.structure(state_new) == jax.tree.structure(state_old)
  for _ in range(2):
    up_new, state_new = new.update(grads, state_new, params)
    up_old, state_old = old.update(grads, state_old, params)
  jax.tree.map(np.testing.assert_array_equal, up_new, up_old)
  del leaves


def _axes(fields):
  return step_lib.pipeline_axes(harness.model_of(**fields).logical_axes())


def test_muon_needs_a_matrix():
  fields = FAMILIES['gpt'][0]
  t = config.defaults().train
  t.optimizer = 'muon'
  t.muon_exclude = ('w1', 'w2', 'wq', 'wk', 'wv', 'wo')
  model_cfg = config.defaults().model
  with pytest.raises(ConfigError, match='train.muon_exclude.*no matrix'):
    optimizer_lib.make_optimizer(t, model_cfg, optax.constant_schedule(1e-3), _axes(fields))


@pytest.mark.parametrize(
  'overrides, key',
  [
    ({'train.optimizer': 'sgd'}, 'train.optimizer'),
    ({'train.muon_ns_steps': 3}, 'train.muon_ns_steps'),
    ({'train.optimizer': 'lion', 'train.adam_b1': 0.8}, 'train.adam_b1'),
    ({'train.optimizer': 'muon', 'train.muon_ns_steps': 0}, 'train.muon_ns_steps'),
    ({'train.optimizer': 'lion', 'train.lion_b2': 1.0}, 'train.lion_b2'),
    (
      {'train.optimizer': 'schedule_free_adamw', 'train.schedule_free_b1': 0.0},
      'train.schedule_free_b1',
    ),
  ],
)
def test_optimizer_keys_are_checked(overrides, key):
  with pytest.raises(ConfigError) as error:
    config.validate(harness.tiny_config(**{'mesh.data': 1, **overrides}), 1)
  assert error.value.key == key


OPTIMIZERS = ['muon', 'lion', 'adafactor', 'schedule_free_adamw']


@pytest.mark.parametrize('name', OPTIMIZERS)
def test_state_splits_under_zero1_and_survives_the_checkpoint_relayout(name):
  cfg = harness.tiny_config(
    **{
      'train.optimizer': name,
      'train.optimizer_sharding': 'data',
      'mesh.data': 2,
      'mesh.pipe': 2,
      'mesh.tensor': 2,
      'pipeline.schedule': 'interleaved_1f1b',
      'pipeline.virtual_stages': 2,
      'pipeline.microbatches': 2,
      'model.d_model': 256,  # Adafactor factors dimensions of 128 or more
      'model.d_ff': 512,
      'model.num_layers': 8,
    }
  )
  trainer = harness.make_trainer(cfg)
  rng = np.random.default_rng(0)
  noise = lambda x: jax.device_put(  # every leaf its own values: a misplaced one shows
    rng.normal(size=x.shape).astype(x.dtype) if x.dtype == np.float32 else x, x.sharding
  )
  state = jax.tree.map(noise, harness.initial_state(trainer, 0))
  with jax.set_mesh(trainer.mesh):
    back = trainer.from_canonical(trainer.to_canonical(state))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(back), jax.device_get(state))
  opt = trainer.abstract_state().opt_state
  split = jax.tree.leaves(
    jax.tree.map(lambda a, s: 'data' in str(s.spec), opt, trainer.state_shardings.opt_state)
  )
  assert sum(split) >= len(split) // 2  # the moments split over data (ZeRO-1); counts stay whole
