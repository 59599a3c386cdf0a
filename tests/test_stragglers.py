"""Stragglers on loopback: 2 processes x 4 CPU devices, process 1's host slowed after every
step by a heartbeat file that is a FIFO read slowly (as a slow shared filesystem would),
and process 0 names it, and only it (training/stragglers.py)."""

import os
import subprocess
import sys
import threading
import time

import pytest
from harness import ROOT, SMOKE, cli_env
from test_multiprocess import _free_port

from triax.training import metrics as metrics_lib
from triax.training import stragglers

DELAY_S = 0.8  # process 1's host is held this long after each step it fetches


class _SlowReader(threading.Thread):
  """Opens the FIFO for reading once every DELAY_S: the writer's open() waits for it (opened
  and closed at once, so that a writer's next open finds no reader until the next one)."""

  def __init__(self, path):
    super().__init__(daemon=True)
    self.path, self.stop, self.beats = path, False, 0

  def run(self):
    while not self.stop:
      time.sleep(DELAY_S)
      os.close(os.open(self.path, os.O_RDONLY))
      self.beats += 1


def test_a_slowed_process_is_named_and_the_others_are_not(tmp_path):
  workdir, fifo = str(tmp_path / 'run'), str(tmp_path / 'beat1')
  os.mkfifo(fifo)
  reader = _SlowReader(fifo)
  reader.start()
  port = _free_port()
  procs = []
  for i in range(2):
    env = cli_env(
      {
        'TRIAX_COORDINATOR': f'127.0.0.1:{port}',
        'TRIAX_NUM_PROCESSES': '2',
        'TRIAX_PROCESS_ID': str(i),
        **({'TRIAX_HEARTBEAT': fifo} if i == 1 else {}),
      }
    )
    with open(tmp_path / f'{i}.err', 'w') as err:
      procs.append(
        subprocess.Popen(
          [sys.executable, '-m', 'triax', 'train', f'--config={SMOKE}', f'--workdir={workdir}']
          + ['--cpu_devices=4', '--progress=false', '--config.train.steps=14']
          + ['--config.mesh.data=8', '--config.mesh.tensor=1', '--config.mesh.pipe=1']
          + ['--config.pipeline.microbatches=1', '--config.pipeline.virtual_stages=1']
          + ['--config.train.straggler_steps=4', '--config.train.eval_every=100']
          + ['--config.checkpoint.every_steps=0'],
          cwd=ROOT,
          env=env,
          stdout=subprocess.DEVNULL,
          stderr=err,
        )
      )
  try:
    codes = [p.wait(timeout=300) for p in procs]
  finally:
    reader.stop = True
    for p in procs:
      p.kill()
    try:  # wake the reader if it waits for a writer that has gone
      os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
      pass
  errors = [open(tmp_path / f'{i}.err').read() for i in range(2)]
  assert codes == [0, 0], errors
  assert reader.beats >= 10
  named = [line for line in errors[0].splitlines() if line.startswith('straggler:')]
  assert len(named) == 1 and named[0].startswith('straggler: process 1:'), errors[0][-3000:]
  assert 'over its last 4 steps' in named[0] and 'train.straggler_ratio=1.2' in named[0]
  assert 'straggler' not in errors[1]
  logged = [r for r in metrics_lib.read_metrics(workdir) if 'loss' in r]
  waits = [r['process_wait_s'] for r in logged[4:]]
  # Process 0 waits for process 1 far longer than process 1 waits for it.
  assert all(len(w) == 2 for w in waits) and sum(w[0] for w in waits) > 3 * sum(w[1] for w in waits)


@pytest.mark.fast
def test_judge_names_a_process_slow_over_its_window_once_until_it_catches_up():
  said = []
  judge = stragglers.Stragglers(1.25, 3, 0, 3, None, said.append)
  fast, slow = (1.0, 0.8), (1.0, 0.2)  # (step s, waits s): the slow one waits least
  for step in range(1, 3):
    assert judge.judge({0: (step, *fast), 1: (step, *fast), 2: (step, *slow)}) == []
  # The same sample again (process 2 has not finished another step) adds nothing.
  assert judge.judge({0: (3, *fast), 1: (3, *fast), 2: (2, *slow)}) == []
  assert judge.judge({0: (4, *fast), 1: (4, *fast), 2: (3, *slow)}) == [2]
  assert len(said) == 1 and said[0].startswith('straggler: process 2: its own step time 1.600 s')
  assert judge.judge({0: (5, *fast), 1: (5, *fast), 2: (4, *slow)}) == []  # named already
  for step in range(5, 8):  # caught up over a whole window
    judge.judge({0: (step + 1, *fast), 1: (step + 1, *fast), 2: (step, *fast)})
  assert judge.judge({0: (9, *fast), 1: (9, *fast), 2: (8, *slow)}) == []  # 1 slow of 3
  assert judge.judge({0: (10, *fast), 1: (10, *fast), 2: (9, *slow)}) == [2]
  assert len(said) == 2
  assert judge.metrics() == {'process_step_s': [1.0, 1.0, 1.0], 'process_wait_s': [0.8, 0.8, 0.2]}
