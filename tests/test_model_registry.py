"""The registry's validation: a family's logical axis rules resolved for the mesh
(Megatron's GQA rule), the config stored as given, and keys no family knows."""

import os
import subprocess
import sys

import harness
import jax
import pytest

from triax import config, sharding
from triax.errors import ConfigError
from triax.model import registry


def _validated(**overrides):
  return config.validate(harness.tiny_config(**overrides), 8)


@pytest.mark.fast
@pytest.mark.parametrize('kv,axis', [(8, 'tensor'), (2, 'tensor'), (1, None)])
def test_kv_heads_split_over_tensor_when_enough_else_replicated(kv, axis):
  cfg = _validated(
    **{'model.family': 'llama', 'model.num_kv_heads': kv, 'mesh.data': 4, 'mesh.tensor': 2}
  )
  rules = sharding.resolve_rules(cfg)
  assert dict(rules)['kv_heads'] == axis
  model = registry.build(registry.spec_from_config(cfg.model))
  wk = model.logical_axes()['layers']['wk']  # [L, d, kv, hd]
  assert sharding.logical_to_spec(wk, rules)[2] == axis


@pytest.mark.fast
def test_a_validated_config_holds_its_rules_as_given_and_resolves_on_any_mesh():
  # config.json is the validated config: an elastic re-plan onto a narrower
  # tensor axis must split the K/V heads that a wider one replicated.
  overrides = {'model.family': 'llama', 'model.num_kv_heads': 2, 'mesh.fsdp': True}
  wide = _validated(**overrides, **{'mesh.data': 2, 'mesh.tensor': 4})
  assert wide.sharding.logical_axis_rules == config.defaults().sharding.logical_axis_rules
  assert dict(sharding.resolve_rules(wide))['kv_heads'] is None
  wide.mesh.update(data=4, tensor=2)
  narrow = config.validate(wide, 8)
  assert narrow.to_dict() == _validated(**overrides, **{'mesh.data': 4, 'mesh.tensor': 2}).to_dict()
  rules = dict(sharding.resolve_rules(narrow))
  assert rules['kv_heads'] == 'tensor' and rules['embed'] == 'data'


@pytest.mark.fast
def test_importing_the_config_loads_no_jax():
  code = 'import sys, triax.config; print(sorted(m for m in ("jax", "flax") if m in sys.modules))'
  env = dict(os.environ, PYTHONPATH=f'{harness.ROOT}/src')
  out = subprocess.run([sys.executable, '-c', code], env=env, check=True, capture_output=True)
  assert out.stdout.decode().strip() == '[]'


@pytest.mark.fast
def test_kv_heads_that_do_not_divide_over_tensor_are_refused():
  with pytest.raises(ConfigError) as e:
    _validated(
      **{
        'model.family': 'llama',
        'model.num_heads': 12,
        'model.d_model': 48,
        'model.num_kv_heads': 6,
        'mesh.data': 2,
        'mesh.tensor': 4,
      }
    )
  assert e.value.key == 'model.num_kv_heads'


@pytest.mark.fast
def test_a_model_key_no_family_knows_is_refused():
  cfg = harness.tiny_config()
  cfg.model.num_expertz = 4  # a config file can add keys (flags cannot)
  with pytest.raises(ConfigError) as e:
    config.validate(cfg, 8)
  assert e.value.key == 'model.num_expertz'


@pytest.mark.fast
def test_qwen3_tiny_is_a_valid_qk_norm_pipeline_run_on_8_devices():
  path = f'{harness.ROOT}/experiments/qwen3_tiny.py'
  for arg in (None, 'smoke'):
    cfg = config.validate(config.from_file(path, arg), 8)
    m = cfg.model
    assert (m.family, m.qk_norm, m.tie_embeddings) == ('llama', True, True)
    assert m.head_dim * m.num_heads == 2 * m.d_model and 0 < m.num_kv_heads < m.num_heads
    assert cfg.mesh.pipe > 1 and cfg.pipeline.schedule == 'interleaved_1f1b'


@pytest.mark.fast
def test_gemma3_tiny_is_a_valid_local_global_pipeline_run_on_8_devices():
  """Gemma 3's 5:1 pattern, one layer a chunk: chunks start all over the pattern."""
  path = f'{harness.ROOT}/experiments/gemma3_tiny.py'
  for arg in (None, 'smoke'):
    cfg = config.validate(config.from_file(path, arg), 8)
    spec = registry.spec_from_config(cfg.model)
    assert spec.family == 'gemma3' and spec.tie_embeddings and spec.qk_norm
    assert spec.local_layers() == (True,) * 5 + (False,)
    assert 0 < spec.sliding_window < spec.seq_len and spec.rope_local_theta < spec.rope_theta
    chunks = cfg.mesh.pipe * cfg.pipeline.virtual_stages
    assert chunks == spec.num_layers and cfg.pipeline.schedule == 'interleaved_1f1b'


@pytest.mark.fast
def test_llama_tiny_is_a_valid_gqa_pipeline_run_on_8_devices():
  path = f'{harness.ROOT}/experiments/llama_tiny.py'
  for arg in (None, 'smoke'):
    cfg = config.validate(config.from_file(path, arg), 8)
    m = cfg.model
    assert m.family == 'llama' and 0 < m.num_kv_heads < m.num_heads
    assert cfg.mesh.pipe > 1 and cfg.pipeline.schedule == 'interleaved_1f1b'


# Mixtral's case not in the fast tier (6 s of compiling).
@pytest.mark.parametrize('family', [pytest.param('llama', marks=pytest.mark.fast), 'mixtral'])
def test_unscanned_layers_are_loop_free_and_compute_the_same(family):
  """model.scan_layers=false unrolls the layer stack: no while loop left in
  the objective's gradient, and the same loss and gradients (fp32). Two
  layers (a loop of two, or two copies): each unrolled layer is compiled anew."""
  make = harness.tiny_mixtral_config if family == 'mixtral' else harness.tiny_config

  def run(scan: bool):
    overrides = {'model.scan_layers': scan, 'model.family': family, 'model.num_layers': 2}
    cfg = config.validate(make(**overrides), 1)
    model = registry.build(registry.spec_from_config(cfg.model))
    params = jax.jit(model.init)(jax.random.key(0))
    batch = harness.random_batch(cfg)
    loss = lambda p: model.objective(p, batch['inputs'], batch['targets'])[0]  # noqa: E731
    grad = jax.jit(jax.value_and_grad(loss))
    return (grad.lower(params).as_text().count('stablehlo.while'), *grad(params))

  (loops, loss, grads), (loops_unrolled, loss_unrolled, grads_unrolled) = run(True), run(False)
  assert loops >= 2 and loops_unrolled == 0  # the forward's loop and its transpose
  assert abs(float(loss) - float(loss_unrolled)) <= 1e-6 * abs(float(loss))
  assert harness.max_rel_err(jax.device_get(grads), jax.device_get(grads_unrolled)) <= 1e-5
