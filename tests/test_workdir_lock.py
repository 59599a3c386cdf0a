"""One run per workdir: DIR/triax.lock names the holder; a second run exits 2; stale locks go.

The command-line case runs `python -m triax train` against a lock this test
holds (it fails in the early checks, before the data is read or anything is
compiled); the rest drives training/lock.py in-process.
"""

import json
import os
import socket
import subprocess
import sys

import harness
import pytest
from test_bad_input import snapshot

from triax.errors import ConfigError
from triax.training import lock as lock_lib
from triax.training.lock import WorkdirLock

SMOKE = 'experiments/gpt_tiny.py:smoke'


def _holder(workdir):
  with open(lock_lib.lock_path(workdir)) as f:
    return json.load(f)


def _write_lock(workdir, **record):
  os.makedirs(workdir, exist_ok=True)
  with open(lock_lib.lock_path(workdir), 'w') as f:
    json.dump(record, f)


def _dead_pid():
  child = subprocess.Popen([sys.executable, '-c', 'pass'])
  child.wait()
  return child.pid


def test_a_second_run_on_a_held_workdir_exits_2_naming_the_holder(tmp_path):
  workdir = str(tmp_path / 'w')
  with WorkdirLock(workdir):
    holder = _holder(workdir)
    before = snapshot(str(tmp_path))
    result = harness.run_cli(
      'triax.cli.train', f'--config={SMOKE}', f'--workdir={workdir}', '--cpu_devices=8'
    )
    assert snapshot(str(tmp_path)) == before  # not even the lock file changed
  assert result.returncode == 2, result.stderr[-3000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert errors == [
    f'error: workdir: {workdir} is in use by pid {os.getpid()} on {socket.gethostname()} '
    f'since {holder["started"]}; stop it or use another --workdir'
  ], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert not os.path.exists(lock_lib.lock_path(workdir))  # released by its holder


def test_the_lock_names_its_holder_and_goes_on_release(tmp_path):
  workdir = str(tmp_path / 'new' / 'w')  # created by the lock
  lock = WorkdirLock(workdir)
  lock.acquire()
  holder = _holder(workdir)
  assert holder['pid'] == os.getpid() and holder['host'] == socket.gethostname()
  assert holder['started'] and holder['command']
  with pytest.raises(ConfigError) as error:  # another holder, even in this process
    WorkdirLock(workdir).acquire()
  assert error.value.key == 'workdir' and f'pid {os.getpid()}' in error.value.message
  with pytest.raises(ConfigError):
    lock_lib.check_free(workdir)
  lock.release()
  lock.release()  # twice is harmless (a signal handler may have released it)
  assert os.listdir(workdir) == []
  lock_lib.check_free(workdir)


def test_a_stale_lock_is_taken_over_with_one_warning(tmp_path, caplog):
  workdir = str(tmp_path)
  dead = _dead_pid()
  _write_lock(workdir, pid=dead, host=socket.gethostname(), started='yesterday')
  before = snapshot(workdir)
  lock_lib.check_free(workdir)  # a stale lock does not stop a run, and checking reads only
  assert snapshot(workdir) == before
  with WorkdirLock(workdir):
    assert _holder(workdir)['pid'] == os.getpid()
  warnings = [r.getMessage() for r in caplog.records if 'taking over the lock' in r.getMessage()]
  assert len(warnings) == 1 and f'pid {dead}' in warnings[0] and '\n' not in warnings[0]


def test_a_reused_pid_does_not_hold_the_lock(tmp_path):
  # The parent of this process is alive, but it is not the process that
  # started at the recorded time: the holder is gone and its pid reused.
  workdir = str(tmp_path)
  _write_lock(workdir, pid=os.getppid(), host=socket.gethostname(), started='x', process_start='-1')
  with WorkdirLock(workdir):
    assert _holder(workdir)['pid'] == os.getpid()


def test_a_live_holder_without_flock_still_holds_it(tmp_path):
  # A holder found by its record alone (a file system without flock): the
  # parent of this process, recorded with its real start time.
  workdir = str(tmp_path)
  _write_lock(
    workdir,
    pid=os.getppid(),
    host=socket.gethostname(),
    started='x',
    process_start=lock_lib._process_start(os.getppid()),  # pylint: disable=protected-access
  )
  with pytest.raises(ConfigError) as error:
    WorkdirLock(workdir).acquire()
  assert f'pid {os.getppid()} on {socket.gethostname()} since x' in error.value.message


def test_a_lock_of_another_host_counts_as_held(tmp_path):
  workdir = str(tmp_path)
  _write_lock(workdir, pid=_dead_pid(), host='another-host', started='x')
  with pytest.raises(ConfigError) as error:
    WorkdirLock(workdir).acquire()
  message = error.value.message
  assert 'on another-host since x' in message and lock_lib.lock_path(workdir) in message
