"""scripts/gpu_bench.sh --smoke on CPU, the shape of the real benchmark's config, and
scripts/bench_gpu.sh's refusals off a GPU."""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

import harness
import jax
import pytest

from triax import config
from triax.model import registry

SCRIPT = os.path.join(harness.ROOT, 'scripts', 'gpu_bench.sh')


def _bench(*args, script=SCRIPT):
  env = harness.subprocess_env()  # --cpu_devices decides the device count
  # This venv is set up already: skip scripts/env.sh (its pip install) and use this python.
  env['TRIAX_SKIP_ENV'] = '1'
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  return subprocess.run(
    ['bash', script, *args], cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=300
  )


@pytest.mark.parametrize('name', ['gpt_1b', 'llama_1b'])
def test_smoke_benchmark_prints_tokens_per_second_and_mfu_line(tmp_path, name):
  result = _bench('--smoke', f'--config={name}', f'--workdir={tmp_path / "bench"}')
  assert result.returncode == 0, result.stderr[-3000:]
  tokens = re.search(r'^tokens/s:\s+([\d,]+)', result.stdout, re.M)
  assert tokens and int(tokens.group(1).replace(',', '')) > 0, result.stdout
  assert re.search(r'^MFU:\s+n/a', result.stdout, re.M), result.stdout  # no peak known for CPU
  assert re.search(r'^hardware FLOPs:', result.stdout, re.M)
  assert re.search(r'^peak memory:', result.stdout, re.M)


def test_existing_workdir_is_refused(tmp_path):
  result = _bench('--smoke', f'--workdir={tmp_path}')
  assert result.returncode == 2
  assert result.stderr.startswith('error: --workdir:')


def test_full_config_is_a_valid_one_device_1b_model():
  spec = importlib.util.spec_from_file_location(
    'gpt_1b', os.path.join(harness.ROOT, 'experiments', 'gpt_1b.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = config.validate(module.get_config(), 1)
  assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipe) == (1, 1, 1)
  assert (cfg.model.dtype, cfg.model.param_dtype, cfg.model.attention) == (
    'bfloat16',
    'float32',
    'cudnn',
  )
  # Shapes only (cuDNN attention cannot be traced on CPU: count with the XLA kernel).
  model = registry.build(dataclasses.replace(registry.spec_from_config(cfg.model), attention='xla'))
  count = sum(leaf.size for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
  assert 0.95e9 < count < 1.1e9


def test_unknown_benchmark_is_refused(tmp_path):
  result = _bench('--smoke', '--config=gpt_7b', f'--workdir={tmp_path / "bench"}')
  assert result.returncode == 2
  assert result.stderr.startswith('error: --config:')


def test_llama_1b_is_llama_3_2_1b_shaped():
  cfg = config.validate(
    config.from_file(os.path.join(harness.ROOT, 'experiments', 'llama_1b.py')), 1
  )
  spec = dataclasses.replace(registry.spec_from_config(cfg.model), attention='xla')
  shapes = jax.eval_shape(registry.build(spec).init, jax.random.key(0))
  assert 'out' not in shapes['head']  # tied, as Llama 3.2 1B
  assert shapes['layers']['wk'].shape == (16, 2048, 8, 64)  # 8 K/V heads of 64
  count = sum(leaf.size for leaf in jax.tree.leaves(shapes))
  assert 1.23e9 < count < 1.24e9  # 1,235,814,400 in the Hugging Face checkpoint


def test_the_gpu_report_refuses_a_machine_without_one_and_writes_nothing(tmp_path):
  script = os.path.join(harness.ROOT, 'scripts', 'bench_gpu.sh')
  out, runs = tmp_path / 'docs', tmp_path / 'runs'
  result = _bench(f'--out_dir={out}', f'--runs={runs}', script=script)
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith('error: scripts/bench_gpu.sh: jax sees no GPU (backend cpu)')
  assert not out.exists() and not runs.exists()
  result = _bench('--steps=3', script=script)
  assert result.returncode == 2 and result.stderr.startswith('error: --steps=3: unknown flag')


def test_the_gpu_report_measures_fp8_beside_bf16_right_after_it():
  """Section 3 reruns section 2's llama_1b with FP8 weight matmuls, so the
  first GPU lent measures both; the line after it gives their ratio."""
  with open(os.path.join(harness.ROOT, 'scripts', 'bench_gpu.sh')) as f:
    text = f.read()
  sections = re.findall(r'^section "([^"]+)"', text, re.M)
  assert sections[1:3] == [
    'llama_1b: tokens/s and MFU',
    'llama_1b with FP8 weight matmuls (model.fp8=tensorwise): tokens/s and MFU',
  ]
  fp8 = text[text.index(f'section "{sections[2]}"') : text.index(f'section "{sections[3]}"')]
  assert '--config=llama_1b' in fp8 and '--config.model.fp8=tensorwise' in fp8
  assert 'fp8_against_bf16' in fp8
