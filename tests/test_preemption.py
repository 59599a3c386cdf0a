"""SIGTERM and Ctrl-C stop a run after a complete checkpoint of the step in flight.

Real `python -m triax train` processes (one, and two under
scripts/launch_local.sh) are signalled mid-run; the same command then
resumes them to the losses of a run never interrupted. The signal handling
itself, time-based saves, milestones and TensorBoard's cut-back on resume
are checked in-process.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import harness
import pytest
import tensorboardX
from test_multiprocess import _free_port, _launch, _train_pids
from test_reliability import (
  assert_same_losses,
  losses,
  read_jsonl,
  start_train,
)
from tqdm import tqdm

from triax import config
from triax.training import metrics as metrics_lib
from triax.training import preemption
from triax.training.checkpoint import Checkpointer
from triax.training.workdir import LOCK as LOCK_NAME

# Long enough to be signalled mid-run (~25 ms a step here); saves only at the
# end or on a signal, so the checkpoint a stopped run leaves is the one the signal made.
FLAGS = [
  '--config.train.steps=60',
  '--config.checkpoint.every_steps=0',
  '--config.train.eval_every=1000',
]
STOPPED = re.compile(
  r'stopped by (SIGTERM|SIGINT) after step (\d+); checkpoint \2 is complete; '
  r'rerun the same command to resume'
)


def _logged_steps(workdir):
  try:
    return [r['step'] for r in read_jsonl(os.path.join(workdir, 'metrics.jsonl')) if 'loss' in r]
  except (OSError, ValueError):
    return []  # absent, or a line being written


def _wait_for_steps(proc, workdir, count, timeout=300):
  deadline = time.monotonic() + timeout
  while len(_logged_steps(workdir)) < count:
    assert proc.poll() is None, f'exited ({proc.returncode}) before step {count}'
    assert time.monotonic() < deadline, f'step {count} never logged'
    time.sleep(0.01)


def _checkpoints(workdir):
  """Intact checkpoint steps (the manifest rules of training/checkpoint.py)."""
  ckpt = Checkpointer(workdir, config.defaults())
  return [s for s in ckpt.steps() if ckpt.verify(s) is None]


def _dead_pid():
  child = subprocess.Popen([sys.executable, '-c', 'pass'])
  child.wait()
  return child.pid


@pytest.fixture(scope='module')
def reference(tmp_path_factory, compile_cache):
  """The losses of the run never interrupted."""
  workdir = str(tmp_path_factory.mktemp('reference') / 'run')
  proc = start_train(workdir, FLAGS, workdir, compile_cache)
  assert proc.wait(timeout=600) == 0, open(workdir + '.err').read()[-3000:]
  return losses(workdir)


def test_sigterm_saves_the_step_in_flight_and_the_same_command_resumes(
  tmp_path,
  reference,
  compile_cache,
):
  workdir, log = str(tmp_path / 'run'), str(tmp_path / 'run')
  proc = start_train(workdir, FLAGS, log, compile_cache)
  _wait_for_steps(proc, workdir, 3)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == 0, open(log + '.err').read()[-3000:]
  out, err = open(log + '.out').read(), open(log + '.err').read()
  stopped = [m for line in out.splitlines() if (m := STOPPED.fullmatch(line))]
  assert len(stopped) == 1 and stopped[0][1] == 'SIGTERM', out
  step = int(stopped[0][2])
  assert 3 <= step < 60 and 'Traceback' not in err, err[-3000:]
  assert _checkpoints(workdir) == [step]  # the signal's save, complete
  assert _logged_steps(workdir) == list(range(1, step + 1))
  assert not os.path.exists(os.path.join(workdir, LOCK_NAME))  # released

  # What a run killed later would have left: TensorBoard events past the
  # checkpoint, and its lock (a dead pid on this host).
  with tensorboardX.SummaryWriter(os.path.join(workdir, 'tb')) as writer:
    for s in range(step + 1, step + 4):
      writer.add_scalar('loss', 9.0, s)
  with open(os.path.join(workdir, LOCK_NAME), 'w') as f:
    json.dump({'pid': _dead_pid(), 'host': os.uname().nodename, 'started': 'earlier'}, f)

  proc = start_train(workdir, FLAGS, log + '2', compile_cache)
  assert proc.wait(timeout=600) == 0, open(log + '2.err').read()[-3000:]
  out, err = open(log + '2.out').read(), open(log + '2.err').read()
  assert f'resuming from checkpoint {step} of 60' in out, out
  taken = [l for l in err.splitlines() if 'taking over the lock' in l]
  assert len(taken) == 1 and 'no longer running' in taken[0], err[-3000:]
  worst = assert_same_losses(losses(workdir), reference)
  loss_steps = [s for s, _ in metrics_lib.read_scalars(os.path.join(workdir, 'tb'))['loss']]
  assert loss_steps == list(range(1, 61))  # each step once, in order
  print(f'SIGTERM after step {step}; resumed: max |loss - uninterrupted| = {worst:.3g}')


def test_sigterm_to_one_of_two_processes_stops_both_after_the_same_step(
  tmp_path,
  reference,
  compile_cache,
):
  workdir = str(tmp_path / 'run')
  port = _free_port()
  # Process 0's clock decides time-based saves for both (never, here): through the coordinator.
  launch = _launch(
    workdir, FLAGS + ['--config.checkpoint.every_seconds=86400'], compile_cache, port
  )
  try:
    _wait_for_steps(launch, workdir, 1)
    pids = _train_pids(port)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGTERM)  # process 1 only: process 0 learns it from the coordinator
    out, _ = launch.communicate(timeout=300)
  finally:
    if launch.poll() is None:
      launch.kill()
  assert launch.returncode == 0, out[-4000:]
  stopped = [m for line in out.splitlines() if (m := STOPPED.fullmatch(line.removeprefix('[0] ')))]
  assert len(stopped) == 1 and stopped[0][1] == 'SIGTERM', out[-4000:]  # process 0 speaks
  step = int(stopped[0][2])
  assert 1 <= step < 60 and 'Traceback' not in out, out[-4000:]
  assert _checkpoints(workdir) == [step]
  assert _logged_steps(workdir) == list(range(1, step + 1))
  # Trained as the one-process run did (2 x 4 devices train exactly as 1 x 8, and a
  # checkpoint of two processes resumes in one: test_multiprocess.py; resuming
  # from a signal's checkpoint: the test above).
  want = {k: v for k, v in reference.items() if k[0] <= step}
  worst = assert_same_losses(losses(workdir), want)
  print(f'2 processes, SIGTERM to process 1: both stopped after step {step}; {worst=:.3g}')


def test_second_ctrl_c_exits_130_at_once_and_saves_by_the_clock_keep_milestones(
  tmp_path,
  compile_cache,
):
  # Saved at every step by the clock (every_steps is 0); retention keeps the 2
  # newest and the milestones (even steps).
  flags = FLAGS + [
    '--config.checkpoint.every_seconds=1e-9',
    '--config.checkpoint.keep=2',
    '--config.checkpoint.keep_every_steps=2',
  ]
  workdir, log = str(tmp_path / 'run'), str(tmp_path / 'run')
  proc = start_train(workdir, flags, log, compile_cache)
  # Step 6 is logged after the save of 5 started, which found 2, 3, 4 complete.
  _wait_for_steps(proc, workdir, 6)
  proc.send_signal(signal.SIGINT)
  # Two signals sent at once reach Python's handler as one: send the second
  # once the first is acknowledged (the stop's save takes longer than that).
  deadline = time.monotonic() + 60
  while 'SIGINT: stopping after the step in flight' not in open(log + '.err').read():
    assert proc.poll() is None and time.monotonic() < deadline, 'first Ctrl-C not acknowledged'
    time.sleep(0.001)
  proc.send_signal(signal.SIGINT)
  assert proc.wait(timeout=120) == 130, open(log + '.err').read()[-3000:]
  err = open(log + '.err').read()
  lines = [l for l in err.splitlines() if l.startswith('interrupted at step')]
  assert len(lines) == 1 and 'Traceback' not in err, err[-3000:]
  match = re.fullmatch(
    r'interrupted at step (\d+); last complete checkpoint (\d+); rerun the same command to resume',
    lines[0],
  )
  assert match, lines[0]
  step, last = int(match[1]), int(match[2])
  intact = _checkpoints(workdir)
  # No wait for the save in flight (a save that completed in the instant
  # before the exit may follow `last`).
  assert last in intact and max(intact) <= last + 1 <= step + 1, (intact, last, step)
  assert 1 not in intact and 2 in intact, intact  # 1 deleted by retention; 2 a milestone
  assert any(s % 2 for s in intact), intact  # odd steps: saved by the clock alone
  assert not os.path.exists(os.path.join(workdir, LOCK_NAME))


# ---------------------------------------------------------------- in-process


def test_first_signal_asks_to_stop_and_a_second_one_leaves():
  seconds = []
  previous = signal.getsignal(signal.SIGINT)
  with preemption.StopSignals(on_second=seconds.append) as signals:
    assert signals.decide(1, save_due=True) == (False, True)
    signal.raise_signal(signal.SIGINT)
    assert signals.decide(2, save_due=False) == (True, False)
    assert signals.name == 'SIGINT' and seconds == []
    signal.raise_signal(signal.SIGTERM)
    assert seconds == [signal.SIGTERM]
  assert signal.getsignal(signal.SIGINT) is previous  # handlers restored


def test_signal_notices_end_the_progress_bar_line_first(capfd):
  with preemption.StopSignals(on_second=lambda signum: None) as signals:
    signals.bar = tqdm(total=10, desc='train')
    signals.bar.update(3)
    signal.raise_signal(signal.SIGINT)
    signals.bar.refresh()  # the bar draws itself again after the notice
    preemption.say('interrupted at step 3', signals.bar)  # the second signal's line
    signals.bar.close()
    preemption.say('after the bar', signals.bar)
  err = capfd.readouterr().err
  lines = err.split('\n')
  assert lines[0].startswith('\rtrain:')  # the bar's line, left open by the bar
  notices = [l for l in lines if 'SIGINT: stopping' in l or 'interrupted at step' in l]
  assert len(notices) == 2 and all(not l.startswith('\r') for l in notices), err
  assert notices[0].startswith('SIGINT: stopping') and notices[1] == 'interrupted at step 3'
  assert err.endswith('\nafter the bar\n') and '\n\nafter' not in err  # a closed bar: no blank line


def test_tensorboard_resumed_from_step_2_of_4_holds_each_step_once(tmp_path):
  workdir = str(tmp_path)
  first = metrics_lib.MetricsWriter(workdir, 0)
  for step in range(1, 5):
    first.write({'step': step, 'loss': float(step)})
  first.close()
  # Killed after step 4 with checkpoint 2: the resumed run writes 3 and 4 again.
  again = metrics_lib.MetricsWriter(workdir, 2)
  for step in (3, 4):
    again.write({'step': step, 'loss': 10.0 + step})
  again.close()
  scalars = metrics_lib.read_scalars(os.path.join(workdir, 'tb'))
  assert scalars['loss'] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
  assert [r['step'] for r in metrics_lib.read_metrics(workdir)] == [1, 2, 3, 4]


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
  """tensorboardX imports torch when it is installed (0.85 s of every run's
  start here); triax's writer keeps it out, and torch imports later as usual."""
  if importlib.util.find_spec('torch') is None:
    pytest.skip('torch is not installed: nothing to keep out')
  script = (
    'import sys\n'
    'from triax.training import metrics\n'
    f'writer = metrics.MetricsWriter({str(tmp_path)!r}, 0)\n'
    "writer.write({'step': 1, 'loss': 2.0})\n"
    'writer.close()\n'
    "assert 'torch' not in sys.modules, 'torch was imported'\n"
    f"assert metrics.read_scalars({str(tmp_path / 'tb')!r})['loss'] == [(1, 2.0)]\n"
    'import torch\n'
    'print(torch.zeros(2).sum().item())\n'
  )
  result = subprocess.run(
    [sys.executable, '-c', script], env=harness.subprocess_env(), capture_output=True, text=True
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == '0.0'
