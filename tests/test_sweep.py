"""triax sweep end to end (parallel points, a failing one, a rerun, README blocks) and its parts."""

import csv
import importlib.util
import json
import os
import textwrap

import harness
import pytest

from triax.errors import ConfigError
from triax.sweeps import results, runner

# Two points that train (one process each, 2 CPU devices, 3 steps) and one whose
# config the trainer rejects: it must be recorded, not stop the others.
SWEEP_FILE = textwrap.dedent("""
    import importlib.util
    spec = importlib.util.spec_from_file_location('gpt_tiny', {gpt_tiny!r})
    gpt_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt_tiny)


    def get_config(arg=None):
      c = gpt_tiny.get_config('smoke')
      c.mesh.data, c.mesh.tensor, c.mesh.pipe = 2, 1, 1
      c.pipeline.schedule, c.pipeline.microbatches, c.pipeline.virtual_stages = '1f1b', 1, 1
      c.train.steps = 3
      return c


    def sweep(add, arg=None):
      add(**{{'train.seed': 0}})
      add(**{{'model.num_heads': 3}})
      add(**{{'train.seed': 1, 'model.remat': 'full'}})
    """)
NAMES = ['seed=0', 'num_heads=3', 'seed=1,remat=full']
README = (
  'intro\n<!-- results:tiny_sweep:begin -->\nold table\n<!-- results:tiny_sweep:end -->\nrest\n'
)


def _write_sweep(directory, text=None):
  path = directory / 'tiny_sweep.py'
  path.write_text(
    text or SWEEP_FILE.format(gpt_tiny=os.path.join(harness.ROOT, 'experiments', 'gpt_tiny.py'))
  )
  return path


def _sweep(config, workdir, *flags):
  return harness.run_cli(
    'triax.cli.sweep',
    f'--config={config}',
    f'--workdir={workdir}',
    '--cpu_devices=2',
    '--progress=false',
    *flags,
  )


@pytest.fixture(scope='module')
def swept(tmp_path_factory):
  directory = tmp_path_factory.mktemp('sweep')
  config = _write_sweep(directory)
  readme = directory / 'README.md'
  readme.write_text(README)
  workdir = directory / 'run'
  first = _sweep(config, workdir, '--parallel=2', f'--readme={readme}')
  return config, workdir, readme, first


def test_sweep_runs_points_and_records_a_failure(swept):
  _, workdir, readme, first = swept
  assert first.returncode == 1, first.stderr[-2000:]  # 1: some point failed
  assert 'FAILED  num_heads=3 (exit 2): error: model.num_heads' in first.stdout
  with open(workdir / 'results.csv') as f:
    rows = {r['point']: r for r in csv.DictReader(f)}
  assert list(rows) == NAMES
  for name in ('seed=0', 'seed=1,remat=full'):
    row = rows[name]
    assert row['status'] == 'ok'
    for key in ('final_loss', 'final_eval_loss', 'tokens_per_sec', 'step_time_s', 'peak_bytes'):
      assert float(row[key]) > 0, (name, key)
  failed = rows['num_heads=3']
  assert failed['status'] == 'failed' and failed['returncode'] == '2'
  assert failed['error'].startswith('error: model.num_heads:')
  assert rows['seed=1,remat=full']['model.remat'] == 'full'
  for png in ('loss.png', 'throughput.png', 'memory.png'):
    assert (workdir / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', png

  table = (workdir / 'results.md').read_text()
  assert table.startswith('| seed | num_heads | remat | train loss |')
  text = readme.read_text()
  assert text.startswith('intro\n<!-- results:tiny_sweep:begin -->\n| seed |')
  assert text.endswith('<!-- results:tiny_sweep:end -->\nrest\n') and 'old table' not in text
  assert table.strip() in text


def test_rerun_skips_complete_points_and_retries_failed_ones(swept):
  config, workdir, _, _ = swept
  metrics = workdir / 'seed=0' / 'metrics.jsonl'
  before = metrics.stat().st_mtime_ns
  status_before = json.loads((workdir / 'num_heads=3' / 'sweep_status.json').read_text())
  again = _sweep(config, workdir, '--parallel=2')
  assert again.returncode == 1, again.stderr[-2000:]
  assert 'skipping 2 complete point(s)' in again.stdout
  assert '3 points: 2 ok (2 already complete), 1 failed' in again.stdout
  assert metrics.stat().st_mtime_ns == before
  status_after = json.loads((workdir / 'num_heads=3' / 'sweep_status.json').read_text())
  assert status_after['returncode'] == 2 and status_after['command'] == status_before['command']


def test_readme_without_markers_exits_2_before_running(tmp_path):
  config = _write_sweep(tmp_path)
  readme = tmp_path / 'README.md'
  readme.write_text('no markers here\n')
  result = _sweep(config, tmp_path / 'run', f'--readme={readme}')
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines()[-1].startswith('error: --readme:')
  assert 'results:tiny_sweep:begin' in result.stderr
  assert not (tmp_path / 'run').exists()


BAD_SWEEPS = [
  ('no-sweep-function', 'def get_config(arg=None):\n  return None\n', '--config'),
  (
    'undotted-key',
    'from triax import config\n'
    'def get_config(arg=None):\n  return config.defaults()\n'
    'def sweep(add, arg=None):\n  add(learning_rate=1e-3)\n',
    'learning_rate',
  ),
  (
    'unknown-key',
    'from triax import config\n'
    'def get_config(arg=None):\n  return config.defaults()\n'
    "def sweep(add, arg=None):\n  add(**{'mesh.dat': 2})\n",
    'mesh.dat',
  ),
  (
    'no-points',
    'from triax import config\n'
    'def get_config(arg=None):\n  return config.defaults()\n'
    'def sweep(add, arg=None):\n  pass\n',
    '--config',
  ),
]


@pytest.mark.parametrize('text,key', [b[1:] for b in BAD_SWEEPS], ids=[b[0] for b in BAD_SWEEPS])
def test_bad_sweep_file_raises_config_error_naming_the_key(tmp_path, text, key):
  config = _write_sweep(tmp_path, text)
  with pytest.raises(ConfigError) as e:
    runner.load_sweep(str(config))
  assert e.value.key == key


def test_bad_flags_exit_2_with_one_line(tmp_path):
  config = _write_sweep(tmp_path)
  result = _sweep(config, tmp_path / 'run', '--parallel=0')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == ['error: --parallel: must be >= 1, got 0']
  result = _sweep(os.path.join(harness.ROOT, 'experiments', 'gpt_tiny.py'), tmp_path / 'run')
  assert result.returncode == 2
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith('error: --config:') and 'sweep(add, arg=None)' in line
  assert not (tmp_path / 'run').exists()


def test_shipped_sweeps_load_with_valid_distinct_points():
  from triax import config as config_lib

  mesh = runner.load_sweep(os.path.join(harness.ROOT, 'experiments', 'mesh_sweep.py'))
  shapes = {
    tuple(dict(p.overrides)[f'mesh.{a}'] for a in ('data', 'tensor', 'pipe')) for p in mesh.points
  }
  assert len(shapes) == len(mesh.points) == 10 and all(d * t * p == 8 for d, t, p in shapes)
  schedules = runner.load_sweep(os.path.join(harness.ROOT, 'experiments', 'schedule_sweep.py'))
  assert len(schedules.points) == 15
  for sweep in (mesh, schedules):
    spec = importlib.util.spec_from_file_location(sweep.name, sweep.path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for point in sweep.points:  # every point passes the trainer's validation
      cfg = module.get_config()
      for key, value in point.overrides:
        group, name = key.split('.')
        cfg[group][name] = value
      config_lib.validate(cfg, 8)


def test_point_names_are_stable_safe_and_short():
  assert runner.point_name((('mesh.data', 2), ('mesh.tensor', 4))) == 'data=2,tensor=4'
  assert runner.point_name(()) == 'base'
  assert (
    runner.point_name(
      (('model.dtype', 'bfloat16'), ('train.learning_rate', 1e-05), ('data.path', '/a b/c'))
    )
    == 'dtype=bfloat16,learning_rate=1e-05,path=-a-b-c'
  )
  # Two keys with one last component keep their full path.
  assert (
    runner.point_name((('mesh.data', 2), ('mesh.dcn_data', 1), ('x.data', True)))
    == 'mesh.data=2,dcn_data=1,x.data=true'
  )
  long = runner.point_name((('data.path', 'x' * 300),))
  assert len(long) <= 120 and long != runner.point_name((('data.path', 'x' * 299),))


def test_markdown_table_and_readme_block(tmp_path):
  ok = results.Row(
    'data=2',
    {'mesh.data': 2},
    'ok',
    0,
    None,
    results.RunSummary(
      final_loss=2.5,
      final_eval_loss=2.6,
      tokens_per_sec=12345.6,
      step_time_s=0.0123,
      peak_bytes=3 * 2**20,
    ),
  )
  bad = results.Row(
    'data=3', {'mesh.data': 3}, 'failed', 2, 'error: mesh: a | b', results.RunSummary()
  )
  table = results.markdown([ok, bad])
  assert table.splitlines() == [
    '| data | train loss | eval loss | tokens/s | step (ms) | peak MiB/device | status |',
    '|---|---:|---:|---:|---:|---:|---|',
    '| 2 | 2.500 | 2.600 | 12,346 | 12.3 | 3.00 | ok |',
    '| 3 |  |  |  |  |  | failed (exit 2): error: mesh: a \\| b |',
  ]
  readme = tmp_path / 'README.md'
  readme.write_text('a\n<!-- results:s:begin -->\nx\n<!-- results:s:end -->\nb\n')
  results.replace_readme_block(str(readme), 's', table)
  results.replace_readme_block(str(readme), 's', table)  # idempotent
  assert readme.read_text() == f'a\n<!-- results:s:begin -->\n{table}<!-- results:s:end -->\nb\n'
  with pytest.raises(ConfigError, match='results:other:begin'):
    results.check_readme_block(str(readme), 'other')
