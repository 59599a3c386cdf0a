"""Goodput: a run's wall time split by what it went to, across a kill and a resume
(training/goodput.py, `triax goodput`)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from harness import ROOT, SMOKE, cli_env, run_cli

from triax.training import goodput
from triax.training import metrics as metrics_lib

# A data-parallel smoke run (no pipeline: the quickest compile), saved every 3 steps.
FLAGS = (
  f'--config={SMOKE}',
  '--cpu_devices=8',
  '--progress=false',
  '--config.train.steps=10',
  '--config.mesh.data=8',
  '--config.mesh.tensor=1',
  '--config.mesh.pipe=1',
  '--config.pipeline.microbatches=1',
  '--config.pipeline.virtual_stages=1',
  '--config.checkpoint.every_steps=3',
)


def _record(attempt, start, at, step, kind, **parts):
  full = dict.fromkeys(goodput.BUCKETS, 0.0)
  full.update(parts)
  return {
    'attempt': attempt,
    'process_start': start,
    'time': at,
    'step': step,
    'kind': kind,
    'parts': full,
  }


@pytest.mark.fast
def test_ledger_counts_a_kill_and_a_rollback_as_lost_and_adds_up():
  records = [
    # attempt a: 2 s start-up, 3 s compile, steps 1..4 of 1 s each (a save at 2), killed.
    _record('a', 100.0, 102.0, 0, 'start', startup=2.0),
    _record('a', 100.0, 106.0, 1, 'step', startup=2.0, compile=3.0, steps=1.0),
    _record('a', 100.0, 107.5, 2, 'step', startup=2.0, compile=3.0, steps=2.0, checkpoint=0.5),
    _record('a', 100.0, 108.5, 3, 'step', startup=2.0, compile=3.0, steps=3.0, checkpoint=0.5),
    _record('a', 100.0, 109.5, 4, 'step', startup=2.0, compile=3.0, steps=4.0, checkpoint=0.5),
    # attempt b starts 0.5 s after a's last record and resumes checkpoint 2.
    _record('b', 110.0, 111.0, 2, 'start', startup=1.0),
    _record('b', 110.0, 114.0, 3, 'step', startup=1.0, compile=2.0, steps=1.0),
    _record('b', 110.0, 115.0, 4, 'step', startup=1.0, compile=2.0, steps=2.0),
    # step 4 spiked: rolled back to 3 (0.25 s restore), then step 4 again and the end.
    _record('b', 110.0, 115.25, 3, 'rollback', startup=1.0, compile=2.0, steps=2.0, restart=0.25),
    _record('b', 110.0, 116.25, 4, 'step', startup=1.0, compile=2.0, steps=3.0, restart=0.25),
  ]
  ledger = goodput.Ledger()
  for record in records:
    ledger.add(record)
  assert ledger.wall == pytest.approx(16.25)
  assert sum(ledger.totals.values()) == pytest.approx(ledger.wall)
  assert ledger.lost_steps == 3  # a's 3 and 4, b's first 4
  want = {
    'productive': 2.0 + 1.0 + 1.0,  # steps 1, 2 (a), 3 (b), 4 (b, again)
    'compile': 5.0,
    'checkpoint': 0.5,
    'lost': 2.0 + 1.0,
    'restart': 0.5 + 1.0 + 0.25,  # the gap, b's start-up, the rollback's restore
    'startup': 2.0,
    'data': 0.0,
    'eval': 0.0,
  }
  assert ledger.totals == pytest.approx(want)
  assert ledger.attempts == 2
  assert ledger.metrics()['goodput'] == pytest.approx(4.0 / 16.25)


@pytest.mark.fast
def test_goodput_of_a_directory_that_is_not_a_workdir_is_one_error_line(tmp_path):
  result = run_cli('triax', 'goodput', f'--workdir={tmp_path}')
  assert result.returncode == 2, result.stderr
  assert result.stderr.strip().splitlines() == [
    f'error: --workdir: {tmp_path} has no goodput.jsonl: it is not a triax workdir '
    '(train writes it)'
  ]
  missing = tmp_path / 'absent'
  result = run_cli('triax', 'goodput', f'--workdir={missing}')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
    f'error: --workdir: {missing} is not a directory; give a train --workdir'
  ]


def _start(workdir, log):
  with open(f'{log}.out', 'w') as out, open(f'{log}.err', 'w') as err:
    return subprocess.Popen(
      [sys.executable, '-m', 'triax', 'train', f'--workdir={workdir}', *FLAGS],
      cwd=ROOT,
      env=cli_env(),
      stdout=out,
      stderr=err,
    )


def _steps_recorded(workdir):
  try:
    return [r['step'] for r in goodput.read(workdir) if r['kind'] == 'step']
  except OSError:
    return []


def test_a_killed_and_resumed_run_adds_up_to_its_wall_time_and_counts_the_lost_steps(tmp_path):
  workdir = str(tmp_path / 'run')
  proc = _start(workdir, tmp_path / 'first')
  began = time.time()
  deadline = time.monotonic() + 300
  while max(_steps_recorded(workdir), default=0) < 7:
    assert proc.poll() is None, open(tmp_path / 'first.err').read()[-2000:]
    assert time.monotonic() < deadline, 'step 7 never recorded'
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  reached = max(_steps_recorded(workdir))
  proc = _start(workdir, tmp_path / 'second')
  assert proc.wait(timeout=300) == 0, open(tmp_path / 'second.err').read()[-2000:]
  ended = time.time()

  records = goodput.read(workdir)
  starts = [r for r in records if r['kind'] == 'start']
  assert [r['step'] for r in starts][0] == 0 and len(starts) == 2
  restored = starts[1]['step']
  assert restored in (3, 6)  # a checkpoint (the save of 6 may not have committed)
  ledger = goodput.ledger(workdir)
  assert ledger.attempts == 2
  assert ledger.lost_steps == reached - restored
  assert sum(ledger.totals.values()) == pytest.approx(ledger.wall, abs=1e-6)
  # The wall time runs from the first process's start to the last record.
  assert records[0]['process_start'] <= began and ledger.wall <= ended - records[0]['process_start']
  for part in ('productive', 'compile', 'lost', 'restart', 'startup', 'checkpoint', 'eval'):
    assert ledger.totals[part] > 0, part

  result = run_cli('triax', 'goodput', f'--workdir={workdir}', f'--plot={tmp_path / "g.png"}')
  assert result.returncode == 0, result.stderr
  assert f'{reached - restored} steps lost; 2 attempt(s)' in result.stdout
  assert f'| **wall** | {ledger.wall:.2f} |' in result.stdout
  with open(tmp_path / 'g.png', 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'

  # Every logged step carries the split so far, in metrics.jsonl and TensorBoard.
  logged = [r for r in metrics_lib.read_metrics(workdir) if 'loss' in r]
  assert [r['step'] for r in logged] == list(range(1, 11))
  last = logged[-1]
  assert last['goodput_lost_steps'] == reached - restored
  parts = sum(last[f'goodput_{p}_s'] for p in goodput.PARTS)
  assert parts == pytest.approx(last['goodput_wall_s'], abs=1e-6)
  scalars = metrics_lib.read_scalars(os.path.join(workdir, 'tb'))
  assert scalars['goodput'][-1][0] == 10
  assert json.loads(json.dumps(last))  # strict JSON
