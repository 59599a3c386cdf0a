"""scripts/bench_experiments.py: a run's row holds its layout, length, times and losses,
and a rerun of some experiments keeps the other rows on the page."""

import os

import harness
import pytest

from triax import config

EXPERIMENTS = os.path.join(os.path.dirname(__file__), '..', 'experiments')


def _cells(row: str) -> list[str]:
  return [c.strip() for c in row.strip('|').split('|')]


@pytest.mark.fast
def test_the_page_keeps_the_rows_a_rerun_does_not_redo(tmp_path, monkeypatch):
  bench = harness.load_script('bench_experiments')
  monkeypatch.setattr(bench, 'DOC', str(tmp_path / 'bench_experiments.md'))
  rows = {'b': '| b | data 8 | 300 | 1.0 |', 'a': '| a | data 8 | 300 | 2.0 |'}
  bench._write(rows)
  assert bench._stored() == rows
  c = config.from_file(os.path.join(EXPERIMENTS, 'deepseek_tiny.py'))
  assert bench._layout(c) == (
    'data 2 x tensor 2 x pipe 2, experts over 2, dualpipe_v fused v=2 m=4'
  )


def test_a_run_gives_its_row(monkeypatch):
  """qwen3_tiny's smoke length in place of its own: the row's cells from the run."""
  bench = harness.load_script('bench_experiments')
  run, load = bench.run_python, bench.config.from_file
  smoke = lambda args, **k: run(
    [a + ':smoke' if a.startswith('--config=') else a for a in args], **k
  )  # noqa: E731
  monkeypatch.setattr(bench, 'run_python', smoke)
  monkeypatch.setattr(bench.config, 'from_file', lambda path, arg=None: load(path, 'smoke'))
  cells = _cells(bench._run('qwen3_tiny'))
  assert cells[0] == 'qwen3_tiny' and cells[2] == str(
    load(os.path.join(EXPERIMENTS, 'qwen3_tiny.py'), 'smoke').train.steps
  )
  first, last = (float(x) for x in cells[7].split(' -> '))
  assert last < first  # the smoke run's loss falls
  assert cells[8].startswith('5.') and '(0)' in cells[8]
  assert 0 < float(cells[9]) <= 1.0  # the CPU share


@pytest.mark.fast
def test_an_unknown_experiment_is_one_line_and_exit_2_before_any_run():
  done = harness.run_script('bench_experiments.py', '--experiments=gemma3_tiny,no_such')
  assert done.returncode == 2
  assert done.stderr.strip().splitlines() == [
    'error: --experiments: no experiments/no_such.py; name one that exists'
  ]
