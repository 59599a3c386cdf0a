"""DeepSeek's parts one at a time: the latent cache decodes as the uncached
model does and is smaller than multi-head attention's, the bias update
moves towards balance and nothing else, group-limited routing keeps to its
groups, and its keys are checked (one ConfigError naming the key each)."""

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from triax import config as config_lib
from triax.errors import ConfigError
from triax.model import generation, moe, registry


def _model(**overrides):
  cfg = config_lib.validate(harness.tiny_deepseek_config(**overrides), 1)
  return registry.build(registry.spec_from_config(cfg.model))


@pytest.mark.parametrize('q_lora_rank', [16, 0], ids=['q-latent', 'q-direct'])
def test_latent_cache_decodes_the_uncached_models_greedy_tokens(q_lora_rank):
  model = _model(**{'model.q_lora_rank': q_lora_rank, 'model.seq_len': 32})
  params = model.init(jax.random.key(0))
  prompt = [3, 17, 99, 5, 42]
  sampling = generation.Sampling(max_new_tokens=20, temperature=0.0)
  cached = generation.generate(model, params, prompt, sampling, cache=True)
  uncached = generation.generate(model, params, prompt, sampling, cache=False)
  np.testing.assert_array_equal(cached, uncached)
  # The prefill's logits through the absorbed path are the training path's.
  tokens = jnp.asarray([prompt + [7] * 27])
  logits, _ = model.decode(params, tokens, model.init_cache(1), 0, jnp.zeros((1,), jnp.int32))
  np.testing.assert_allclose(logits, model.logits(params, tokens), atol=1e-5)


def test_latent_cache_holds_the_latent_and_rope_key_per_token_and_layer():
  model = _model()
  s = model.spec
  latent, rope = model.init_cache(2)
  assert latent.shape == (s.num_layers, 2, s.seq_len, s.kv_lora_rank)
  assert rope.shape == (s.num_layers, 2, s.seq_len, s.qk_rope_head_dim)
  # Multi-head attention of the same heads would cache k and v for each: 4 x (12 + 6) here.
  mha = s.num_heads * (s.head_dim + s.v_head_dim)
  assert s.kv_lora_rank + s.qk_rope_head_dim == 16 < mha == 72


def test_bias_update_moves_each_layers_biases_towards_the_mean_load_only():
  inner = optax.adamw(1e-2, weight_decay=0.5)
  opt = moe.with_bias_update(inner, 0.25)
  params = {'w': jnp.ones((2, 3)), moe.BIAS: jnp.zeros((2, 4))}
  load = jnp.array([[5.0, 1.0, 3.0, 3.0], [0.0, 0.0, 8.0, 0.0]])  # means 3 and 2
  grads = {'w': jnp.full((2, 3), 0.5), moe.BIAS: -load}
  updates, _ = opt.update(grads, opt.init(params), params)
  np.testing.assert_array_equal(updates[moe.BIAS], [[-0.25, 0.25, 0, 0], [0.25, 0.25, -0.25, 0.25]])
  # The rest is the inner optimizer's, the biases' gradients hidden from it.
  want, _ = inner.update({'w': grads['w'], moe.BIAS: jnp.zeros((2, 4))}, inner.init(params), params)
  np.testing.assert_array_equal(updates['w'], want['w'])


def test_group_limited_routing_chooses_only_from_the_best_groups():
  k, groups, kept = 2, 4, 1
  h = jax.random.normal(jax.random.key(1), (2, 64, 8))
  router = jax.random.normal(jax.random.key(2), (8, 16))
  bias = jnp.zeros((16,)).at[12:].set(5.0)  # group 3 always best
  routing = moe.route_biased(h, router, bias, k, groups, kept, True, 2.5)
  assert int(jnp.min(routing.experts)) >= 12
  np.testing.assert_allclose(jnp.sum(routing.weights, -1), 2.5, rtol=1e-6)
  # The weights are the unbiased sigmoid affinities of the chosen, renormalised.
  scores = jax.nn.sigmoid(routing.logits)
  chosen = jnp.take_along_axis(scores, routing.experts, -1)
  np.testing.assert_allclose(
    routing.weights, 2.5 * chosen / jnp.sum(chosen, -1, keepdims=True), rtol=1e-6
  )


@pytest.mark.parametrize(
  'overrides,key',
  [
    ({'model.topk_group': 5}, 'model.topk_group'),
    ({'model.n_group': 3}, 'model.n_group'),
    ({'model.n_group': 8, 'model.topk_group': 1}, 'model.n_group'),
    ({'model.topk_group': 1, 'model.experts_per_token': 3}, 'model.topk_group'),
    ({'model.bias_update_rate': -0.001}, 'model.bias_update_rate'),
    ({'model.first_k_dense': 3}, 'model.first_k_dense'),
    ({'model.qk_rope_head_dim': 5}, 'model.qk_rope_head_dim'),
    ({'model.num_kv_heads': 2}, 'model.num_kv_heads'),
    ({'model.moe_every': 2}, 'model.moe_every'),
    ({'mesh.context': 2, 'mesh.data': 1}, 'model.mtp_depth'),
    (
      {'data.source': 'tokens', 'data.path': 'unused', 'data.mask_documents': True},
      'model.mtp_depth',
    ),
  ],
)
def test_bad_deepseek_keys_name_the_key(overrides, key):
  _refused(harness.tiny_deepseek_config(**overrides), key)


def test_deepseeks_keys_on_other_families_name_the_key():
  # MLA on a Llama, MTP on a dense family, groups on a Mixtral: keys they do not read.
  _refused(
    harness.tiny_config(**{'model.family': 'llama', 'model.kv_lora_rank': 64}), 'model.kv_lora_rank'
  )
  _refused(
    harness.tiny_config(**{'model.family': 'llama', 'model.mtp_depth': 1}), 'model.mtp_depth'
  )
  _refused(harness.tiny_mixtral_config(**{'model.n_group': 2}), 'model.n_group')


def _refused(cfg, key: str) -> None:
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 2)
  assert e.value.key == key, str(e.value)


def test_splash_attention_gives_xlas_logits_with_mlas_head_widths():
  # Pallas's interpreter on CPU; v padded to the q/k width for the kernel.
  xla = _model(**{'model.seq_len': 128})
  splash = _model(
    **{'model.seq_len': 128, 'model.attention': 'splash', 'model.splash_interpret': True}
  )
  params = xla.init(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, 256)
  np.testing.assert_allclose(splash.logits(params, tokens), xla.logits(params, tokens), atol=1e-5)


def test_greedy_sampling_on_a_mesh_with_split_experts_gives_one_devices_tokens():
  # One prompt is whole on every expert rank: each exchanges the same tokens.
  cfg = config_lib.validate(
    harness.tiny_deepseek_config(**{'model.seq_len': 32, 'mesh.data': 2, 'mesh.expert': 2}), 2
  )
  model = generation.sampling_model(cfg)
  params = model.init(jax.random.key(0))
  sampling = generation.Sampling(max_new_tokens=12, temperature=0.0)
  prompt = [3, 17, 99, 5, 42]
  alone = generation.generate(model, params, prompt, sampling)
  placement = generation.Placement.build(cfg, (2, 2, 2))
  with jax.set_mesh(placement.mesh):
    placed = jax.device_put(params, placement.shardings(model))
  np.testing.assert_array_equal(
    generation.generate(model, placed, prompt, sampling, placement), alone
  )


# Not in the fast tier: two DeepSeek gradients with MTP (13 s on jax 0.12).
def test_mtp_losses_made_a_loss_chunk_at_a_time_equal_them_made_at_once():
  """Two MTP depths (their last 1 and 2 positions count for nothing) with
  model.loss_chunk=4 of 16 positions: the same objective, figures and gradients."""
  whole = harness.tiny_deepseek_config(**{'model.mtp_depth': 2})
  chunked = harness.tiny_deepseek_config(**{'model.mtp_depth': 2, 'model.loss_chunk': 4})
  loss, grads, figures = harness.microbatch_reference(whole, 1)
  loss_c, grads_c, figures_c = harness.microbatch_reference(chunked, 1)
  np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
  np.testing.assert_allclose(figures_c['mtp_loss'], figures['mtp_loss'], rtol=1e-6)
  assert harness.max_rel_err(grads_c, grads) < 1e-5


@pytest.mark.fast
def test_a_bad_layer_split_counts_the_stack_without_the_dense_blocks():
  """model.num_layers=3 with one first_k_dense block: the stack the pipeline
  cuts holds 2, and the refusal says why it is not 3."""
  cfg = harness.tiny_deepseek_config(
    **{'mesh.pipe': 2, 'pipeline.microbatches': 2, 'pipeline.layers_per_stage': [2, 1]}
  )
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 2)
  assert e.value.key == 'pipeline.layers_per_stage'
  assert 'the stack holds 2 (model.num_layers less its 1 model.first_k_dense blocks)' in str(
    e.value
  )
