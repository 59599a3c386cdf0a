"""Several processes, one mesh: scripts/launch_local.sh on loopback against one process.

2 processes x 4 CPU devices must train exactly as 1 process x 8 devices; a
checkpoint they write restores in one process (and on another mesh over two
processes), and across processes and resumes each window of the text is used
once per epoch. A run SIGKILLed and resumed on another layout and process
count, twice (1 x 8 -> 2 x 4 -> 1 x 4), gives the uninterrupted run's losses.
"""

import collections
import os
import shutil
import signal
import socket
import subprocess
import time

import harness
import pytest
from test_reliability import (
  assert_each_window_once_per_epoch,
  assert_same_losses,
  cli_env,
  kill_when,
  losses,
  read_jsonl,
  sample_ids,
  start_train,
)

LAUNCH = os.path.join(harness.ROOT, 'scripts', 'launch_local.sh')


def _train_pids(port):
  """Pids of the `triax train` processes of the launch on coordinator `port`, by process id."""
  found = {}
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        cmdline = f.read().split(b'\0')
      with open(f'/proc/{pid}/environ', 'rb') as f:
        env = dict(kv.split(b'=', 1) for kv in f.read().split(b'\0') if b'=' in kv)
    except OSError:
      continue
    if (
      b'triax.cli.train' in cmdline
      and env.get(b'TRIAX_COORDINATOR') == f'127.0.0.1:{port}'.encode()
    ):
      found[int(env[b'TRIAX_PROCESS_ID'])] = int(pid)
  return found


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _listening(port):
  """Local addresses of TCP sockets listening on `port` (from /proc/net/tcp, tcp6)."""
  found = []
  for table, width in (('/proc/net/tcp', 8), ('/proc/net/tcp6', 32)):
    if not os.path.exists(table):
      continue
    with open(table) as f:
      for line in f.readlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(':')
        if state == '0A' and int(hex_port, 16) == port:
          raw = bytes.fromhex(address)
          if width == 8:
            found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
          else:
            words = b''.join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
            found.append(socket.inet_ntop(socket.AF_INET6, words))
  return found


def _launch(workdir, flags, env_extra, port=None):
  env = cli_env(env_extra)
  env['TRIAX_PORT'] = str(port or _free_port())
  return subprocess.Popen(
    [
      LAUNCH,
      '2',
      '--config=experiments/gpt_tiny.py:smoke',
      f'--workdir={workdir}',
      '--progress=false',
      *flags,
    ],
    cwd=harness.ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _finish(proc, timeout=600):
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-4000:]
  return out


def _copy_until(source, target, last_step):
  """A copy of workdir `source` whose newest checkpoint is `last_step`."""
  shutil.copytree(source, target)
  directory = os.path.join(target, 'checkpoints')
  for name in os.listdir(directory):
    if int(name) > last_step:
      shutil.rmtree(os.path.join(directory, name))


@pytest.fixture(scope='module')
def runs(tmp_path_factory, smoke_text_run):
  root = tmp_path_factory.mktemp('mp')
  compile_cache = smoke_text_run['env']
  # One process x 8 devices: conftest.py's uninterrupted run; the same flags here,
  # every checkpoint kept (the tests resume from several).
  flags = smoke_text_run['flags'] + ['--config.checkpoint.keep=10']
  single = smoke_text_run['workdir']

  port = _free_port()
  two = str(root / 'two')
  proc = _launch(two, flags, compile_cache, port)
  addresses = []
  while proc.poll() is None and not addresses:
    addresses = _listening(port)
    time.sleep(0.05)
  out = _finish(proc)
  return dict(
    root=root,
    flags=flags,
    single=single,
    two=two,
    two_output=out,
    env=compile_cache,
    coordinator_addresses=addresses,
    windows=smoke_text_run['windows'],
  )


def test_two_processes_train_exactly_as_one(runs):
  worst = assert_same_losses(losses(runs['two']), losses(runs['single']))
  print(
    f'2 processes x 4 devices vs 1 x 8 (mesh 2x2x2, interleaved): max |loss diff| = {worst:.3g}'
  )
  assert sample_ids(runs['two']) == sample_ids(runs['single'])
  out = runs['two_output']
  assert '[0] metrics:' in out and '[1] metrics:' not in out  # process 0 speaks
  # One writer: as many metric lines as the one-process run, no duplicates.
  assert len(read_jsonl(os.path.join(runs['two'], 'metrics.jsonl'))) == len(
    read_jsonl(os.path.join(runs['single'], 'metrics.jsonl'))
  )
  assert os.path.exists(os.path.join(runs['two'], 'config.json'))
  # The coordinator listened on loopback only.
  assert runs['coordinator_addresses'], 'never saw the coordinator listening'
  assert all(a in ('127.0.0.1', '::ffff:127.0.0.1') for a in runs['coordinator_addresses']), runs[
    'coordinator_addresses'
  ]


def test_checkpoint_of_two_processes_restores_in_one(runs):
  workdir = str(runs['root'] / 'two_then_one')
  _copy_until(runs['two'], workdir, 16)
  proc = start_train(workdir, runs['flags'], workdir, runs['env'])
  assert proc.wait(timeout=600) == 0, open(workdir + '.err').read()[-3000:]
  assert 'resumed at step 16)' in open(workdir + '.out').read()
  assert_same_losses(losses(workdir), losses(runs['single']))


def test_two_processes_without_data_parallelism_resume_on_another_mesh(runs):
  # mesh.data=1: both processes need every row of the batch (each computes it,
  # and every device takes its block). The pipe axis crosses processes
  # (mesh.dcn_pipe=2: the slow network). Resumed from step 16 of the 2x2x2 run:
  # its last 8 steps cross the epoch's end (step 22) and hold a save and an
  # eval; each step over processes costs ~0.4 s here, so no earlier.
  workdir = str(runs['root'] / 'tensor_pipe')
  _copy_until(runs['two'], workdir, 16)
  out = _finish(
    _launch(
      workdir,
      runs['flags']
      + [
        '--config.mesh.data=1',
        '--config.mesh.tensor=4',
        '--config.mesh.pipe=2',
        '--config.mesh.dcn_pipe=2',
      ],
      runs['env'],
    )
  )
  assert 'resumed at step 16)' in out
  worst = assert_same_losses(losses(workdir), losses(runs['single']), tol=1e-5)
  print(
    f'2 processes, mesh 1x4x2 (pipe over processes) resumed from 2x2x2 at 16: '
    f'max |loss diff| = {worst:.3g}'
  )
  ids = sample_ids(workdir)
  assert ids == sample_ids(runs['single'])
  assert_each_window_once_per_epoch(ids, runs['windows'])


def _logged(workdir, step):
  """Whether metrics.jsonl holds the loss of `step` or a later one."""
  try:
    records = read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  except (OSError, ValueError):
    return False  # absent, or a line being written
  return any(r.get('step', 0) >= step and 'loss' in r for r in records)


def test_sigkill_and_resume_on_other_layouts_and_process_counts(runs):
  # 1 process x 8 devices (2x2x2 interleaved 1F1B, v=2) -> SIGKILL -> 2 processes x 4
  # devices (2x2x2 1F1B, v=1) -> SIGKILL of process 0 -> 1 process x 4 devices (2x1x2).
  workdir, flags, env = str(runs['root'] / 'invariance'), runs['flags'], runs['env']
  kill_when(start_train(workdir, flags, workdir + '-1x8', env), lambda: _logged(workdir, 10))

  port = _free_port()
  one_f_one_b = ['--config.pipeline.schedule=1f1b', '--config.pipeline.virtual_stages=1']
  launch = _launch(workdir, flags + one_f_one_b, env, port)
  deadline = time.monotonic() + 600
  while not _logged(workdir, 18) and launch.poll() is None and time.monotonic() < deadline:
    time.sleep(0.01)
  assert launch.poll() is None, launch.communicate()[0][-4000:]
  os.kill(_train_pids(port)[0], signal.SIGKILL)  # the launcher stops the other one
  out, _ = launch.communicate(timeout=120)
  assert launch.returncode != 0 and 'resuming from checkpoint' in out, out[-4000:]

  layout = ['--cpu_devices=4', '--config.mesh.tensor=1', *one_f_one_b]
  proc = start_train(workdir, flags + layout, workdir + '-1x4', env)
  assert proc.wait(timeout=600) == 0, open(workdir + '-1x4.err').read()[-3000:]
  assert 'resumed at step' in open(workdir + '-1x4.out').read()
  worst = assert_same_losses(losses(workdir), losses(runs['single']))
  print(f'1x8 -> kill -> 2x4 -> kill -> 1x4 vs uninterrupted 1x8: max |loss diff| = {worst:.3g}')
  assert sample_ids(workdir) == sample_ids(runs['single'])
  assert_each_window_once_per_epoch(sample_ids(workdir), runs['windows'])


def test_dcn_factor_keeps_each_block_of_an_axis_inside_one_host():
  from triax import mesh as mesh_lib
  from triax.errors import ConfigError

  # 8 fake devices, 2 per process; 2 hosts: processes 0-1 and 2-3.
  Device = collections.namedtuple('Device', 'id process_index slice_index device_kind platform')
  devices = [Device(i, i // 2, 0, 'cpu', 'cpu') for i in range(8)]
  grid = mesh_lib._hybrid_grid((2, 2, 2), (1, 1, 2), devices)  # pylint: disable=protected-access
  assert grid.shape == (2, 2, 2)
  assert {d.process_index for d in grid[:, :, 0].flat} == {0, 1}  # pipe stage 0: host 0
  assert {d.process_index for d in grid[:, :, 1].flat} == {2, 3}
  with pytest.raises(ConfigError):  # 3 processes do not split into 2 hosts
    mesh_lib._hybrid_grid((2, 3, 1), (2, 1, 1), devices[:6])  # pylint: disable=protected-access


def test_launcher_prefixes_output_and_stops_the_others_when_one_fails(tmp_path):
  # A stand-in for python: process 1 fails at once, process 0 would wait ten
  # minutes, past the 60 s timeout below: returning at all means it was stopped.
  fake = tmp_path / 'python'
  fake.write_text(f"""#!/usr/bin/env bash
echo "coordinator $TRIAX_COORDINATOR of $TRIAX_NUM_PROCESSES, args $*"
if [ "$TRIAX_PROCESS_ID" = 1 ]; then echo "error: boom" >&2; exit 3; fi
sleep 600 &
echo $! > {tmp_path}/sleeper.pid
wait
""")
  fake.chmod(0o755)
  result = subprocess.run(
    [LAUNCH, '2', '--config=x.py', '--workdir=w'],
    cwd=harness.ROOT,
    env=cli_env({'PYTHON': str(fake), 'TRIAX_PORT': str(_free_port())}),
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 3, (result.stdout, result.stderr)
  assert '[1] error: boom' in result.stderr.splitlines()
  lines = [l for l in result.stdout.splitlines() if 'coordinator' in l]
  assert sorted(l[:4] for l in lines) == ['[0] ', '[1] ']
  assert all(
    'coordinator 127.0.0.1:' in l and 'of 2,' in l and '--cpu_devices=4' in l for l in lines
  ), lines
  with open(tmp_path / 'sleeper.pid') as f:
    sleeper = int(f.read())
  assert _gone(sleeper), 'process 0 was left running'


def _gone(pid, wait=10):
  deadline = time.monotonic() + wait
  while time.monotonic() < deadline:
    try:
      with open(f'/proc/{pid}/stat') as f:
        if f.read().rsplit(')', 1)[1].split()[0] in 'ZX':  # a zombie has stopped running
          return True
    except FileNotFoundError:
      return True
    time.sleep(0.1)
  return False
