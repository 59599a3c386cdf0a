"""The planner end to end: profiling a tiny model here, the CLI, its errors."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from triax import config
from triax.errors import ConfigError
from triax.plan import report
from triax.plan.cost import profile
from triax.plan.search import baselines
from triax.plan.search import layouts as layouts_lib

ROOT = os.path.join(os.path.dirname(__file__), '..')
CPU = os.path.join(ROOT, 'experiments', 'clusters', 'cpu_forced_8.yaml')
H100 = os.path.join(ROOT, 'experiments', 'clusters', 'h100_8x_nvlink.yaml')
BASE = """from triax import config


def get_config(arg=None):
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.num_heads = 4, 32, 2
  c.model.d_ff, c.model.seq_len = 64, 16
  c.train.global_batch_size = 2
  return c
"""


def _load(path, name):
  spec = importlib.util.spec_from_file_location(name, str(path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def tiny():
  cfg = config.defaults()
  cfg.model.num_layers, cfg.model.d_model, cfg.model.num_heads = 4, 32, 2
  cfg.model.d_ff, cfg.model.seq_len = 64, 16
  cfg.train.global_batch_size = 2
  return cfg


def test_profile_of_a_tiny_model():
  cfg = tiny()
  # The degrees and sizes the CLI test's search asks for (the same model and
  # batch on 8 devices): one profile, cached in memory, serves both tests.
  # Two heads and two sequences keep it to 2 degrees x 2 sizes: profiling
  # compiles over a hundred programs, the suite's longest test. (A degree
  # measured at fewer sizes than the smallest, and interpolation between
  # sizes, are test_plan_simulator's, on synthetic points.)
  tensors, sizes = layouts_lib.profile_sizes(cfg, list(layouts_lib.layouts(cfg, 8)))
  assert (tensors, sizes) == ([1, 2], [1, 2])
  prof = profile.measure(cfg.model, tensors, sizes)
  assert prof is profile.measure(cfg.model, tensors[::-1], sizes[::-1])
  assert prof.machine.num_devices == 8
  assert 0 < prof.machine.effective_cores <= 8
  assert prof.machine.p2p.bandwidth > 0 and prof.machine.allreduce.bandwidth > 0
  d, f, s = 32, 64, 16
  layer_params = (4 * d * d + 2 * d * f + 2 * d) * 4
  assert prof.shards[1].layer_param_bytes == layer_params
  assert prof.shards[2].layer_param_bytes == (4 * d * d + 2 * d * f) * 4 / 2 + 2 * d * 4
  matmul = 2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d
  assert prof.shards[1].work['layer_fwd'].flops(1) == pytest.approx(matmul, rel=0.2)
  assert prof.shards[2].work['layer_fwd'].flops(4) < prof.shards[1].work['layer_fwd'].flops(4)
  stash = prof.shards[1].stash_per_seq
  # The executor's residuals of a chunk, measured per policy: attention keeps
  # all but the score square, dots the weight matmuls' outputs.
  assert stash['none'] > stash['attention'] > stash['dots'] > 0 and stash['full'] >= 0
  assert stash['full'] <= stash['dots']
  for point in prof.points:
    # Every function is timed alone and again with all 8 devices running it
    # at once (which is slower on 2 cores, but a wall-clock order is not
    # asserted: the other test worker shares them).
    assert point.seconds > 0 and point.fitted > 0 and point.concurrent > 0
  assert all(fit.k > 0 and fit.c0 >= 0 for fit in prof.fits.values())
  # Layer costs are measured under every remat policy, with their sharing
  # (the profiler clamps a measured sharing to [1, 8]; none is its absence).
  for remat in profile.REMATS:
    for function in profile.LAYER_FUNCTIONS:
      assert prof.fits[profile.variant(function, remat)].cores is not None
  # Every size asked for is measured at the smallest degree, the ends at the
  # others; interpolation reproduces the measured points and extrapolates
  # along the nearest two elsewhere. (Which size is faster is wall-clock, not
  # asserted: at these widths a layer takes under a millisecond and the other
  # test worker shares the cores.)
  measured = {(pt.microbatch, pt.tensor) for pt in prof.points if pt.function == 'layer_fwd'}
  assert measured == {(b, 1) for b in sizes} | {(1, 2), (2, 2)}
  for point in prof.points:
    assert prof.local_seconds(point.function, point.microbatch, point.tensor) == pytest.approx(
      point.seconds
    )
  at = {
    pt.microbatch: pt.seconds for pt in prof.points if pt.function == 'layer_fwd' and pt.tensor == 1
  }
  assert prof.local_seconds('layer_fwd', 3, 1) == pytest.approx(
    max(2 * at[2] - at[1], 0.1 * min(at.values()))
  )
  # The executor's variants of a layer, as ratios to its plain pair: a split
  # backward's halves, a layer under cond and a skipped (padding) one.
  # The split and chunk-length ones again under each remat policy.
  per_policy = {k for k in profile.EXECUTOR_RATIOS if not k.startswith('cond_')}
  assert set(prof.ratios) == set(profile.EXECUTOR_RATIOS) | {
    f'{k}/{remat}' for k in per_policy for remat in ('attention', 'dots', 'full')
  }
  for alone, together in prof.ratios.values():
    assert alone > 0 and together > 0


def test_cli_plans_writes_a_runnable_plan_and_a_trace(tmp_path, capsys):
  base = tmp_path / 'tiny.py'
  base.write_text(BASE)
  out, trace = tmp_path / 'plan.py', tmp_path / 'trace.json'
  cache = str(tmp_path / 'profiles.json')
  module = _load(base, 'tiny_base')
  request = report.Request(
    cfg=module.get_config(),
    config_path=str(base),
    config_overrides={'train.steps': 3},
    cluster=CPU,
    top=3,
    out=str(out),
    trace=str(trace),
    profile_cache=cache,
  )
  summary = report.run(request, as_json=True)
  captured = capsys.readouterr()
  printed = json.loads(captured.out)
  # Header and progress on stderr, stdout stays one JSON object.
  assert captured.err.startswith('plan: 4 layers') and f'saved to {cache}' in captured.err
  assert printed['top'][0]['plan'] == summary['top'][0]['plan']
  assert printed['simulated'] is True and printed['devices'] == 8
  assert set(printed['speedups']) == set(baselines.BASELINES)
  best = printed['top'][0]
  assert best['data'] * best['tensor'] * best['pipe'] == 8 and sum(best['layers']) == 4
  events = json.loads(trace.read_text())['traceEvents']
  assert any(e['ph'] == 'X' for e in events)
  cfg = _load(out, 'the_plan').get_config()
  assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipe) == (
    best['data'],
    best['tensor'],
    best['pipe'],
  )
  assert cfg.train.steps == 3
  config.validate(cfg, 8)
  # Its command, as printed, names the forced CPU devices the plan needs.
  assert f'python -m triax train --config={out} --workdir=DIR --cpu_devices=8' in out.read_text()
  # The same model on another cluster: the roofline derives H100 times,
  # from the profile the cache file kept.
  text_request = report.Request(
    cfg=module.get_config(),
    config_path=str(base),
    config_overrides={},
    cluster=H100,
    top=2,
    profile_cache=cache,
  )
  report.run(text_request)
  captured = capsys.readouterr()
  text = captured.out
  assert 'baselines' in text and 'Roofline assumption' in text and 'SIMULATED' in text
  assert f'profile: from {cache}' in captured.err
  assert '  measured layer_fwd' not in text  # the measurements: behind --verbose


def test_bad_flags_are_config_errors(tmp_path):
  request = report.Request(cfg=tiny(), config_path='x.py', config_overrides={}, cluster=CPU, top=0)
  with pytest.raises(ConfigError, match='--top'):
    report.run(request)
  with pytest.raises(ConfigError, match='--out'):
    report.run(
      report.Request(
        cfg=tiny(),
        config_path='x.py',
        config_overrides={},
        cluster=CPU,
        out=str(tmp_path / 'plan.txt'),
      )
    )
  assert (
    report.main(
      report.Request(
        cfg=tiny(), config_path='x.py', config_overrides={}, cluster=str(tmp_path / 'none.yaml')
      )
    )
    == 2
  )


def test_cli_exit_code_2_on_a_missing_cluster_file(tmp_path):
  base = tmp_path / 'tiny.py'
  base.write_text(BASE)
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, 'src'))
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'triax.cli.plan',
      f'--config={base}',
      f'--cluster={tmp_path / "missing.yaml"}',
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=120,
  )
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith('error: --cluster: ') and 'missing.yaml' in lines[-1]
  assert 'Traceback' not in proc.stderr
