"""The mixtral family's MoE layer against references written out per token:
dropless dispatch is every token through its k chosen experts; capacity
dispatch drops exactly the assignments past an expert's buffer (slot 0 of
every token before any slot 1) and counts them; the router's losses are
transformers' load_balancing_loss_func and Switch's z-loss; one train
step's loss and gradients under data x tensor layouts are one device's."""

import functools
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax import config as config_lib
from triax import sharding
from triax.compiled import stats as stats_lib
from triax.errors import ConfigError
from triax.model import moe

E, K, D, F = 4, 2, 16, 24


def _weights(seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return (
    0.5 * jax.random.normal(keys[0], (D, E)),
    0.2 * jax.random.normal(keys[1], (E, D, F)),
    0.2 * jax.random.normal(keys[2], (E, D, F)),
    0.2 * jax.random.normal(keys[3], (E, F, D)),
  )


def _expert(h, w_gate, w_up, w_down, e):
  """Expert e's SwiGLU of one token h [d] (numpy)."""
  gate, up = h @ w_gate[e], h @ w_up[e]
  return (gate / (1 + np.exp(-gate)) * up) @ w_down[e]


def _per_token(h, router, w_gate, w_up, w_down, keep=None):
  """Each token through its top-k experts, Mixtral's renormalised weights;
  keep[b, s, j] False drops slot j's contribution."""
  h, router, w_gate, w_up, w_down = map(np.asarray, (h, router, w_gate, w_up, w_down))
  out = np.zeros_like(h)
  for b, s in np.ndindex(*h.shape[:2]):
    logits = h[b, s] @ router
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    chosen = np.argsort(-probs)[:K]
    weights = probs[chosen] / probs[chosen].sum()
    for j, (e, w) in enumerate(zip(chosen, weights)):
      if keep is None or keep[b, s, j]:
        out[b, s] += w * _expert(h[b, s], w_gate, w_up, w_down, e)
  return out


def test_dropless_is_every_token_through_its_chosen_experts():
  router, *experts = _weights()
  h = jax.random.normal(jax.random.key(1), (3, 10, D))
  routing = moe.route(h, router, K)
  got = jax.jit(moe.dropless)(h, routing, *experts)
  np.testing.assert_allclose(got, _per_token(h, router, *experts), rtol=1e-5, atol=1e-6)
  # The renormalised weights sum to one; the chosen experts are distinct.
  np.testing.assert_allclose(jnp.sum(routing.weights, -1), 1.0, rtol=1e-6)
  assert (routing.experts[..., 0] != routing.experts[..., 1]).all()


def _kept(experts, capacity):
  """GShard's priority: per row, slot 0 of tokens 0..s-1, then slot 1; an
  expert keeps its first `capacity` assignments."""
  keep = np.zeros(experts.shape, bool)
  for b in range(experts.shape[0]):
    taken = np.zeros(E, int)
    for j in range(K):
      for s in range(experts.shape[1]):
        e = experts[b, s, j]
        keep[b, s, j] = taken[e] < capacity
        taken[e] += 1
  return keep


@pytest.mark.parametrize('factor', [0.5, 1.0])
def test_capacity_drops_the_assignments_past_each_buffer_and_counts_them(factor):
  router, *experts = _weights(2)
  # Tokens alike, so that most choose the same two experts: buffers overflow.
  h = jax.random.normal(jax.random.key(3), (2, 1, D)) + 0.3 * jax.random.normal(
    jax.random.key(4), (2, 12, D)
  )
  routing = moe.route(h, router, K)
  got, dropped = jax.jit(functools.partial(moe.capacity, factor=factor))(h, routing, *experts)
  c = moe.capacity_of(12, K, E, factor)
  keep = _kept(np.asarray(routing.experts), c)
  assert int(dropped) == int((~keep).sum()) > 0
  want = _per_token(h, router, *experts, keep=keep)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_capacity_with_room_for_every_assignment_is_dropless():
  router, *experts = _weights(5)
  h = jax.random.normal(jax.random.key(6), (2, 8, D))
  routing = moe.route(h, router, K)
  # factor E/k: each expert can take every token of a row.
  got, dropped = moe.capacity(h, routing, *experts, factor=E / K)
  assert int(dropped) == 0
  np.testing.assert_allclose(got, moe.dropless(h, routing, *experts), rtol=1e-5, atol=1e-6)


def test_router_losses_are_transformers_and_switch_definitions():
  torch = pytest.importorskip('torch')
  mixtral = pytest.importorskip('transformers.models.mixtral.modeling_mixtral')
  switch = pytest.importorskip(
    'transformers.models.switch_transformers.modeling_switch_transformers'
  )
  layers = [3.0 * jax.random.normal(jax.random.key(i), (2, 9, E)) for i in range(3)]
  stats = []
  for logits in layers:
    probabilities = jax.nn.softmax(logits)
    top, chosen = jax.lax.top_k(probabilities, K)
    stats.append(moe.layer_stats(moe.Routing(logits, chosen, top, probabilities), dropped=0))
  got = moe.losses(jax.tree.map(lambda *a: jnp.stack(a), *stats))
  as_torch = tuple(torch.from_numpy(np.array(x).reshape(-1, E)) for x in layers)
  want = mixtral.load_balancing_loss_func(as_torch, E, K)
  np.testing.assert_allclose(got['router_aux_loss'], want.item(), rtol=1e-6)
  # Switch's z-loss is per layer ([groups, tokens, E]); over equal layers the mean is ours.
  z = np.mean([switch.router_z_loss_func(torch.from_numpy(np.array(x))).item() for x in layers])
  np.testing.assert_allclose(got['router_z_loss'], z, rtol=1e-6)
  load = max(np.max(np.asarray(s.assigned)) / np.mean(np.asarray(s.assigned)) for s in stats)
  np.testing.assert_allclose(got['moe_load_max'], load, rtol=1e-6)
  # model.router_aux_loss_scope=microbatch: Megatron's, each layer's own loss, averaged.
  per_layer = moe.losses(jax.tree.map(lambda *a: jnp.stack(a), *stats), per_layer=True)
  each = [mixtral.load_balancing_loss_func((t,), E, K).item() for t in as_torch]
  np.testing.assert_allclose(per_layer['router_aux_loss'], np.mean(each), rtol=1e-6)
  assert abs(np.mean(each) - want.item()) > 1e-3  # the two scopes differ here


def _config(**overrides):
  return harness.tiny_mixtral_config(**overrides)


# What the pipeline executor needs of a mixtral (each layer balanced per micro-batch).
PIPELINED = {
  'model.router_aux_loss_scope': 'microbatch',
  'pipeline.microbatches': 2,
  'mesh.data': 4,
}


@functools.cache
def _reference(dispatch):
  return harness.loss_and_grads(_config(**{'mesh.data': 1, 'model.moe_dispatch': dispatch}))


@pytest.mark.parametrize(
  'dispatch,data,tensor,remat',
  [
    ('dropless', 8, 1, 'none'),
    ('dropless', 2, 4, 'none'),
    ('dropless', 4, 2, 'full'),
    ('capacity', 2, 4, 'dots'),
  ],
)
def test_train_step_loss_and_gradients_match_one_device(dispatch, data, tensor, remat):
  ref_loss, ref_grads = _reference(dispatch)
  cfg = _config(
    **{
      'mesh.data': data,
      'mesh.tensor': tensor,
      'model.moe_dispatch': dispatch,
      'model.remat': remat,
    }
  )
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5
  # The router and every expert learn (no expert's gradient is identically zero).
  assert (np.abs(grads['layers']['w_down']).max(axis=(0, 2, 3)) > 0).all()
  assert np.abs(grads['layers']['router']).max() > 0


def test_objective_adds_the_router_losses_and_training_logs_them():
  cfg = _config(**{'mesh.data': 4, 'mesh.tensor': 2, 'model.router_z_loss_coef': 0.5})
  trainer = harness.make_trainer(cfg)
  state = harness.initial_state(trainer, cfg.train.seed)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    eval_loss = float(trainer.eval_loss(state.params, batch))
    _, out = trainer.train_step(state, batch)  # donates the state
  out = jax.device_get(out)
  m = cfg.model
  want = out['lm_loss'] + m.router_aux_loss_coef * out['router_aux_loss']
  want += 0.5 * out['router_z_loss']
  np.testing.assert_allclose(out['loss'], want, rtol=1e-6)
  np.testing.assert_allclose(eval_loss, out['lm_loss'], rtol=1e-6)  # eval: the LM loss alone
  assert 0 < out['router_aux_loss'] <= E  # E: one expert takes every token, all the probability
  assert 1 <= out['moe_load_max'] <= E / K and out['moe_dropped_fraction'] == 0


@pytest.mark.parametrize('every', [1, 3])
def test_flops_count_the_active_parameters_and_the_total_is_beside(every):
  model = harness.model_of(
    family='mixtral',
    num_layers=3,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    d_ff=24,
    seq_len=16,
    num_experts=8,
    experts_per_token=2,
    shared_experts=1,
    moe_every=every,
  )
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))
  active = model.active_parameters(total)
  s = model.spec
  # Six of eight routed experts sit out each MoE layer: 3 matrices of d x f each.
  assert total - active == s.num_layers // every * 6 * 3 * s.d_model * s.d_ff
  # The layers' matmul FLOPs are 2 per active weight per token (norm scales aside),
  # dense blocks' and MoE blocks' alike.
  norms = s.num_layers * 2 * s.d_model
  layer_weights = active - norms - 2 * s.vocab_size * s.d_model - s.d_model
  fwd = model.forward_flops()
  assert s.num_layers * fwd['layer_matmul'] == 2.0 * s.seq_len * layer_weights


def test_moe_every_nth_block_the_others_llamas_decoding_too():
  from triax.model import llama, mixtral

  model = harness.model_of(
    family='mixtral',
    num_layers=4,
    d_model=32,
    num_heads=4,
    d_ff=32,
    vocab_size=64,
    seq_len=16,
    num_experts=4,
    moe_every=2,
  )
  params = model.init(jax.random.key(0))
  assert set(params['layers']) == {'dense_0', 'moe'}  # one stack entry: blocks 2i and 2i+1
  assert params['layers']['moe']['w_gate'].shape == (2, 4, 32, 32)
  assert params['layers']['dense_0']['w_gate'].shape == (2, 32, 32)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  x = model.embed(params['embed'], tokens)
  for i in range(2):
    entry = jax.tree.map(lambda a, i=i: a[i], params['layers'])
    x = llama.Block(model.spec).apply({'params': entry['dense_0']}, x)
    x = mixtral.Block(model.spec).apply({'params': entry['moe']}, x)
  logits = model.logits(params, tokens)
  np.testing.assert_allclose(logits, model.head_logits(params['head'], x), atol=1e-5)
  # The K/V cache stays one per block: 4 layers, whatever the stack's grouping.
  decoded, cache = model.decode(params, tokens, model.init_cache(2), 0, jnp.zeros(2, jnp.int32))
  assert cache[0].shape[0] == 4
  np.testing.assert_allclose(decoded, logits, atol=1e-5)
  _, figures = model.objective(params, tokens, tokens)
  assert 0 < figures['router_aux_loss'] and 1 <= figures['moe_load_max']


@pytest.mark.parametrize(
  'overrides,key',
  [
    ({'model.num_experts': 0}, 'model.num_experts'),
    ({'model.moe_every': 3}, 'model.moe_every'),  # not a divisor of 2 layers
    ({'model.moe_every': 2, 'mesh.pipe': 2, **PIPELINED}, 'model.num_layers'),
    (
      {
        'model.num_layers': 6,
        'model.moe_every': 2,
        'mesh.pipe': 2,
        **PIPELINED,
        'pipeline.layers_per_stage': (3, 3),
      },
      'pipeline.layers_per_stage',
    ),
    ({'model.moe_dispatch': 'sinkhorn'}, 'model.moe_dispatch'),
    ({'model.capacity_factor': 0.0}, 'model.capacity_factor'),
    ({'model.router_z_loss_coef': -1.0}, 'model.router_z_loss_coef'),
    ({'pipeline.microbatches': 2}, 'pipeline.microbatches'),
    ({'sharding.logical_axis_rules': (('experts', 'data'),)}, 'sharding.logical_axis_rules'),
  ],
)
def test_bad_moe_settings_are_refused_naming_the_key(overrides, key):
  cfg = _config(**{'mesh.data': 8, **overrides})
  if 'sharding.logical_axis_rules' in overrides:
    default = tuple(
      r for r in config_lib.defaults().sharding.logical_axis_rules if r[0] != 'experts'
    )
    cfg.sharding.logical_axis_rules = default + overrides['sharding.logical_axis_rules']
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert e.value.key == key


def test_qwen3_moe_tiny_is_mixtral_tinys_run_with_qwen3s_attention():
  for arg in (None, 'smoke'):
    cfg = config_lib.validate(
      config_lib.from_file(f'{harness.ROOT}/experiments/qwen3_moe_tiny.py', arg), 8
    )
    m = cfg.model
    assert (m.family, m.qk_norm, m.norm_topk_prob, m.shared_experts) == ('mixtral', True, True, 0)
    assert m.head_dim * m.num_heads == 2 * m.d_model and cfg.mesh.expert == 2


def test_mixtral_tiny_is_a_valid_run_on_8_devices_with_the_experts_split():
  for arg in (None, 'smoke'):
    cfg = config_lib.validate(
      config_lib.from_file(f'{harness.ROOT}/experiments/mixtral_tiny.py', arg), 8
    )
    assert cfg.model.family == 'mixtral' and cfg.mesh.tensor == 2 and cfg.mesh.expert == 2
    assert dict(sharding.resolve_rules(cfg))['experts'] == 'expert'


def test_dropless_dispatch_keeps_each_data_shards_tokens_on_its_device():
  # A sort over a batch split over `data`, left to GSPMD, would gather every
  # token to every device; under the shard_map each device sorts its own.

  cfg = _config(**{'mesh.data': 8})
  compiled, _ = stats_lib.compile_stats(harness.make_trainer(cfg))
  gathered = re.findall(r'= f32\[([\d,]+)\]\S* all-gather(?:-start)?\(', compiled.as_text())
  # Only the router's logits [b, s, E] are gathered (for the load statistics), never a token's d.
  assert gathered and all(int(shape.split(',')[-1]) == cfg.model.num_experts for shape in gathered)


@pytest.mark.parametrize(
  'overrides,says',
  [
    ({'model.shared_experts': 1}, 'shared_experts=1'),
    ({'model.shared_experts': 0, 'model.moe_every': 2}, 'moe_every=2'),
  ],
)
def test_export_refuses_what_a_mixtral_checkpoint_cannot_hold(overrides, says):
  from triax.convert import hf_llama

  with pytest.raises(ConfigError, match=says) as e:
    hf_llama.hf_config(_config(**overrides).model)
  assert e.value.key == '--workdir'
