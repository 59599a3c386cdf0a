"""triax supervise: a run of 2 processes x 4 CPU devices loses one process to
SIGKILL and finishes on the 4 devices left, re-planned, as a run started on
that layout from the same checkpoint would; and the layout choices and bad
input of elastic/supervisor.py alone.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import harness
import pytest
from test_reliability import (
  SMOKE,
  assert_each_window_once_per_epoch,
  assert_same_losses,
  cli_env,
  losses,
  read_jsonl,
  sample_ids,
)

from triax import config as config_lib
from triax import layout as layout_lib
from triax.elastic import replan
from triax.elastic import supervisor as supervisor_lib
from triax.errors import ConfigError
from triax.training import workdir as workdir_lib

# The layout the 4 devices left get: gpt_tiny's smoke run is data 2 x tensor 2 x pipe 2
# with 4 micro-batches; tensor x pipe stays, data halves, micro-batches double.
AFTER = {
  'mesh.data': 1,
  'mesh.context': 1,
  'mesh.tensor': 2,
  'mesh.pipe': 2,
  'pipeline.microbatches': 8,
}


def _process_pid(parent, process_id):
  """The pid of the child of `parent` started as TRIAX_PROCESS_ID=`process_id` (None: not yet)."""
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/stat') as f:
        ppid = int(f.read().rsplit(')', 1)[1].split()[1])
      if ppid != parent:
        continue
      with open(f'/proc/{name}/environ', 'rb') as f:
        if f'TRIAX_PROCESS_ID={process_id}'.encode() in f.read().split(b'\0'):
          return int(name)
    except (OSError, IndexError, ValueError):
      continue
  return None


def _has_checkpoint(workdir, step):
  return os.path.exists(os.path.join(workdir, 'checkpoints', str(step), workdir_lib.MANIFEST))


def _kill_process_after(supervisor, workdir, process_id, checkpoint, step, timeout=300):
  """SIGKILLs the supervisor's process `process_id` once checkpoint `checkpoint` is
  complete and metrics.jsonl has reached `step` (the steps between are lost)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert supervisor.poll() is None, f'supervise ended ({supervisor.returncode}) before the kill'
    if _has_checkpoint(workdir, checkpoint) and supervisor_lib.last_step(workdir) >= step:
      pid = _process_pid(supervisor.pid, process_id)
      assert pid is not None, f'no process {process_id} among the supervisor children'
      os.kill(pid, signal.SIGKILL)
      return
    time.sleep(0.002)
  supervisor.kill()
  raise AssertionError(f'step {step} never reached')


@pytest.fixture(scope='module')
def elastic_run(tmp_path_factory, smoke_text_run):
  root = tmp_path_factory.mktemp('elastic')
  compile_cache = smoke_text_run['env']
  # The uninterrupted run's text and flags, every checkpoint kept.
  flags = smoke_text_run['flags'] + ['--config.checkpoint.keep=10']
  train = [sys.executable, '-m', 'triax', 'train', f'--config={SMOKE}', '--progress=false']
  workdir = str(root / 'supervised')
  log = root / 'supervised.log'
  with open(log, 'w') as out:
    supervisor = subprocess.Popen(
      [
        sys.executable,
        '-m',
        'triax',
        'supervise',
        '--processes=2',
        '--cpu_devices=4',
        '--grace_s=2',
        '--',
        *train,
        f'--workdir={workdir}',
        *flags,
      ],
      cwd=harness.ROOT,
      env=cli_env(compile_cache),
      stdout=out,
      stderr=subprocess.STDOUT,
    )
    _kill_process_after(supervisor, workdir, 1, 4, 6)
    status = supervisor.wait(timeout=600)
  output = log.read_text()
  assert status == 0, output[-4000:]
  records = read_jsonl(workdir_lib.path(workdir, workdir_lib.ELASTIC))

  # The same checkpoint, resumed by plain train on the new layout in one process.
  restored = records[0]['restored_step']
  reference = str(root / 'reference')
  shutil.copytree(workdir, reference)
  for name in os.listdir(os.path.join(reference, 'checkpoints')):
    if int(name) > restored:
      shutil.rmtree(os.path.join(reference, 'checkpoints', name))
  plain = subprocess.run(
    [
      *train,
      f'--workdir={reference}',
      '--cpu_devices=4',
      *flags,
      *layout_lib.flags(AFTER),
    ],
    cwd=harness.ROOT,
    env=cli_env(compile_cache),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert plain.returncode == 0, plain.stderr[-4000:]
  assert f'resumed at step {restored})' in plain.stdout, plain.stdout
  return dict(
    workdir=workdir,
    output=output,
    records=records,
    reference=reference,
    windows=smoke_text_run['windows'],
    uninterrupted=smoke_text_run['workdir'],
  )


def test_lost_process_restarts_on_the_devices_left_with_another_layout(elastic_run):
  records = elastic_run['records']
  assert len(records) == 1, records
  record = records[0]
  assert record['failed'] == [{'process': 1, 'status': 'killed by SIGKILL'}]
  assert (record['processes_before'], record['processes_after']) == (2, 1)
  assert (record['devices_before'], record['devices_after']) == (8, 4)
  before, after = record['layout_before'], record['layout_after']
  assert (before['data'], before['tensor'], before['pipe'], before['microbatches']) == (2, 2, 2, 4)
  assert (after['data'], after['tensor'], after['pipe'], after['microbatches']) == (1, 2, 2, 8)
  assert after['schedule'] == before['schedule'] == 'interleaved_1f1b'
  assert record['how'] == 'same tensor x pipe, smaller data degree'
  # Killed at step 6 or just after it; checkpoint 8 needs step 8, which needs both processes.
  assert record['restored_step'] == 4
  assert 6 <= record['last_step'] < 8
  assert record['steps_lost'] == record['last_step'] - 4
  restarts = [l for l in elastic_run['output'].splitlines() if l.startswith('supervise: restart')]
  assert len(restarts) == 1 and '8 -> 4 devices' in restarts[0], restarts
  # The run finished on the new layout: its config.json is the relaunched one's.
  with open(workdir_lib.path(elastic_run['workdir'], workdir_lib.CONFIG)) as f:
    mesh = json.load(f)['mesh']
  assert (mesh['data'], mesh['tensor'], mesh['pipe']) == (1, 2, 2)
  assert max(step for step, _ in losses(elastic_run['workdir'])) == 24


def test_losses_after_the_restart_equal_a_run_started_there_on_the_new_layout(elastic_run):
  got, want = losses(elastic_run['workdir']), losses(elastic_run['reference'])
  restored = elastic_run['records'][0]['restored_step']
  assert any(step > restored for step, _ in want)
  worst = assert_same_losses(got, want, tol=1e-6)
  print(
    f'supervised restart vs plain resume on data 1 x tensor 2 x pipe 2: max |diff| = {worst:.3g}'
  )
  # The token order is the run's own: each window once per epoch across the restart.
  ids = sample_ids(elastic_run['workdir'])
  assert ids == sample_ids(elastic_run['reference'])
  assert_each_window_once_per_epoch(ids, elastic_run['windows'])


def test_the_restarted_run_follows_the_uninterrupted_one(elastic_run):
  # The same data, batch by batch: one process x 8 devices on the first layout, never
  # killed (conftest.py's smoke_text_run, the same flags). Only the sums differ (8
  # micro-batches of one replica, not 4 of two), hence 1e-5.
  workdir = elastic_run['uninterrupted']
  worst = assert_same_losses(losses(elastic_run['workdir']), losses(workdir), tol=1e-5)
  print(f'supervised restart vs uninterrupted 2 x 2 x 2: max |loss diff| = {worst:.3g}')
  assert sample_ids(elastic_run['workdir']) == sample_ids(workdir)


# ---------------------------------------------------------------- the choices alone


def _smoke(experiment='gpt_tiny.py', **overrides):
  """An experiment's smoke config on 8 devices, validated (gpt_tiny's: data 2 x
  tensor 2 x pipe 2, m=4)."""
  cfg = config_lib.from_file(os.path.join(harness.ROOT, 'experiments', experiment), 'smoke')
  for key, value in overrides.items():
    group, name = key.split('.')
    cfg[group][name] = value
  return config_lib.validate(cfg, 8)


@pytest.mark.fast
def test_shrinking_keeps_tensor_x_pipe_and_the_rows_of_a_micro_batch():
  cfg = _smoke()
  layout = replan.shrunk(cfg, 4)
  assert (layout.data, layout.tensor, layout.pipe, layout.microbatches) == (1, 2, 2, 8)
  assert replan.overrides(cfg, layout) == AFTER
  assert replan.replan(cfg, 4) == (layout, 'same tensor x pipe, smaller data degree')
  assert replan.shrunk(cfg, 2) is None  # tensor x pipe alone needs 4


@pytest.mark.fast
def test_when_tensor_x_pipe_no_longer_fits_the_nearest_valid_layout_is_taken():
  cfg = _smoke(**{'mesh.data': 1, 'mesh.tensor': 4, 'mesh.pipe': 2, 'pipeline.microbatches': 4})
  assert replan.shrunk(cfg, 4) is None
  layout, how = replan.replan(cfg, 4)
  assert how == 'nearest valid layout'
  assert layout.data * layout.context * layout.tensor * layout.pipe == 4
  assert replan.fits(cfg, layout, 4)
  # Nearest: one axis moved (tensor 4 -> 2: heads split 2 ways), pipe and schedule kept.
  assert (layout.tensor, layout.pipe, layout.schedule) == (2, 2, cfg.pipeline.schedule)


@pytest.mark.fast
def test_with_a_cluster_the_planner_prices_the_layouts():
  from triax.plan import cluster as cluster_lib

  cfg = _smoke(**{'mesh.data': 1, 'mesh.tensor': 4, 'mesh.pipe': 2, 'pipeline.microbatches': 4})
  cluster = cluster_lib.load(os.path.join(harness.ROOT, 'experiments/clusters/h100_8x_nvlink.yaml'))
  layout, how = replan.replan(cfg, 4, cluster, budget_s=20)
  assert how == 'planner search'
  assert replan.fits(cfg, layout, 4)
  assert layout.data * layout.context * layout.tensor * layout.pipe == 4


def _moe(**overrides):
  """mixtral_tiny's (data 4 x tensor 2, experts over 2 of data), its router loss
  per micro-batch: a shrunk data degree accumulates micro-batches."""
  return _smoke('mixtral_tiny.py', **{'model.router_aux_loss_scope': 'microbatch', **overrides})


@pytest.mark.fast
def test_a_moe_model_keeps_its_expert_degree_or_the_new_one_is_in_the_flags():
  from triax.plan import cluster as cluster_lib

  cfg = _moe()
  layout = replan.shrunk(cfg, 4)  # data 4 -> 2: expert 2 still divides it
  assert (layout.data, layout.tensor, layout.expert) == (2, 2, 2)
  assert 'mesh.expert' not in replan.overrides(cfg, layout)
  cfg = _moe(**{'mesh.expert': 4})  # data 2 cannot hold 4 expert groups
  assert replan.shrunk(cfg, 4) is None
  cluster = cluster_lib.load(os.path.join(harness.ROOT, 'experiments/clusters/h100_8x_nvlink.yaml'))
  layout, how = replan.replan(cfg, 4)
  assert how == 'nearest valid layout'  # tensor 2 kept: data 2 and fewer expert groups
  assert (layout.data, layout.tensor, layout.expert) == (2, 2, 2)
  assert replan.overrides(cfg, layout)['mesh.expert'] == 2
  layout, how = replan.replan(cfg, 4, cluster, budget_s=20)
  assert how == 'planner search' and replan.fits(cfg, layout, 4)
  assert replan.overrides(cfg, layout).get('mesh.expert', 4) == layout.expert


@pytest.mark.fast
def test_restart_flags_replace_the_command_own():
  command = supervisor_lib.parse_command(
    [
      'python',
      '-m',
      'triax',
      'train',
      '--workdir=w',
      '--config.mesh.data=2',
      '--config.train.steps=9',
    ]
  )
  argv = command.with_flags(
    layout_lib.flags({'mesh.data': 1, 'mesh.device_order': ()}) + ['--cpu_devices=4']
  )
  assert argv == [
    'python', '-m', 'triax', 'train', '--workdir=w', '--config.train.steps=9',
    '--config.mesh.data=1', '--config.mesh.device_order=()', '--cpu_devices=4',
  ]  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize(
  'words, says',
  [
    ([], 'give the train command after --'),
    (['python', 'train.py', '--workdir=w'], 'is not a triax train command'),
    (['python', '-m', 'triax', 'sample', '--workdir=w'], 'is not a triax train command'),
    (['python', '-m', 'triax', 'train', '--config=x.py'], 'one --workdir=DIR'),
    (['python', '-m', 'triax.cli.train', '--workdir', 'w'], 'one --workdir=DIR'),
    (['triax', 'train', '--workdir=w', '--cpu_devices=2'], '--cpu_devices is set per process'),
  ],
)
def test_malformed_commands_are_refused(words, says):
  with pytest.raises(ConfigError, match=says) as caught:
    supervisor_lib.parse_command(words)
  assert caught.value.key == 'command'


@pytest.mark.fast
@pytest.mark.parametrize(
  'args, line',
  [
    (
      ['--processes=1', '--', 'python', '-m', 'triax', 'train', '--workdir={w}'],
      'error: --processes: 1 process leaves no devices to re-plan onto when it fails',
    ),
    (['--', 'python', 'train.py', '--workdir={w}'], 'error: command: python train.py --workdir='),
    (['--processes=2', 'python', '-m', 'triax', 'train', '--workdir={w}'], 'error: command: give'),
  ],
)
def test_bad_input_is_one_error_line_and_status_2(args, line, tmp_path):
  workdir = tmp_path / 'run'
  args = [a.format(w=workdir) for a in args]
  result = harness.run_cli('triax', 'supervise', *args, timeout=120)
  assert result.returncode == 2, result.stderr
  assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr
  assert result.stderr.startswith(line), result.stderr
  assert not workdir.exists()  # nothing started, nothing written


# ---------------------------------------------------------------- the supervisor, with a stand-in trainer

# A stand-in for python: every launch logs its process id and arguments; a
# relaunch as one process finishes at once. In the first launch, process 1
# does what $ONE says and process 0 what $ZERO says.
FAKE = """#!/usr/bin/env bash
echo "${TRIAX_PROCESS_ID:-alone} $*" >> "$LOG"
[ -z "$TRIAX_PROCESS_ID" ] && exit 0
if [ "$TRIAX_PROCESS_ID" = 1 ]; then eval "$ONE"; else eval "$ZERO"; fi
"""
# Waits in the background so that a signal reaches the shell's trap at once.
WAIT = 'sleep 600 & echo $! > "$DIR/sleeper.$TRIAX_PROCESS_ID"; wait'


def _supervise_fake(tmp_path, zero, one, *, started=None, grace_s=1, flags=()):
  """Runs supervise over the stand-in (2 x 4 devices) on a workdir holding
  gpt_tiny's smoke config.json; `started(proc)` runs once both processes logged."""
  fake = tmp_path / 'python'
  fake.write_text(FAKE)
  fake.chmod(0o755)
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / workdir_lib.CONFIG).write_text(_smoke().to_json())
  log = tmp_path / 'launches.log'
  env = cli_env({'LOG': str(log), 'DIR': str(tmp_path), 'ZERO': zero, 'ONE': one})
  proc = subprocess.Popen(
    [sys.executable, '-m', 'triax', 'supervise', '--processes=2', '--cpu_devices=4']
    + [
      f'--grace_s={grace_s}',
      *flags,
      '--',
      str(fake),
      '-m',
      'triax',
      'train',
      f'--workdir={workdir}',
    ],
    cwd=harness.ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  if started is not None:
    deadline = time.monotonic() + 60
    while not (log.exists() and len(log.read_text().splitlines()) >= 2):
      assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
      time.sleep(0.01)
    time.sleep(0.2)  # both shells reach their trap
    started(proc)
  out, err = proc.communicate(timeout=120)
  launches = [l.split(' ', 1) for l in log.read_text().splitlines()] if log.exists() else []
  return proc.returncode, out, err, launches, workdir


def _gone(pid_file, wait=10):
  pid = int(pid_file.read_text())
  deadline = time.monotonic() + wait
  while time.monotonic() < deadline:
    try:
      with open(f'/proc/{pid}/stat') as f:
        if f.read().rsplit(')', 1)[1].split()[0] in 'ZX':
          return True
    except FileNotFoundError:
      return True
    time.sleep(0.05)
  return False


# Not in the fast tier: 2.5 s of waiting for a grace period.
def test_a_survivor_that_ignores_sigterm_is_killed_and_the_job_relaunched(tmp_path):
  status, _, err, launches, workdir = _supervise_fake(
    tmp_path, zero=f"trap '' TERM; {WAIT}", one='sleep 0.3; kill -9 $$'
  )
  assert status == 0, err
  assert sorted(who for who, _ in launches) == ['0', '1', 'alone']
  relaunch = next(args for who, args in launches if who == 'alone').split()
  assert relaunch[-6:] == layout_lib.flags(AFTER) + ['--cpu_devices=4']
  assert _gone(tmp_path / 'sleeper.0'), 'process 0 was left running'
  (record,) = read_jsonl(workdir / workdir_lib.ELASTIC)
  assert record['failed'] == [{'process': 1, 'status': 'killed by SIGKILL'}]
  assert (record['restored_step'], record['steps_lost']) == (0, 0)  # no checkpoint, no metrics
  assert [l for l in err.splitlines() if l.startswith('supervise:')] == [
    'supervise: restart 1: process 1 killed by SIGKILL; 8 -> 4 devices; data 2 x tensor 2 x '
    'pipe 2 (interleaved_1f1b, m=4, v=2) -> data 1 x tensor 2 x pipe 2 (interleaved_1f1b, m=8, '
    'v=2) (same tensor x pipe, smaller data degree); resuming from step 0, 0 steps lost'
  ]


@pytest.mark.fast
def test_bad_input_of_train_is_passed_on_without_a_restart(tmp_path):
  status, _, err, launches, workdir = _supervise_fake(
    tmp_path, zero=WAIT, one='echo "error: train.steps: must be positive" >&2; exit 2'
  )
  assert status == 2, err
  assert '[1] error: train.steps: must be positive' in err.splitlines()
  assert sorted(who for who, _ in launches) == ['0', '1']  # no relaunch
  assert not (workdir / workdir_lib.ELASTIC).exists()


@pytest.mark.fast
def test_sigterm_to_the_supervisor_stops_the_trainers_without_a_restart(tmp_path):
  saves = 'trap \'echo "saved $TRIAX_PROCESS_ID"; exit 0\' TERM; ' + WAIT
  status, out, err, launches, workdir = _supervise_fake(
    tmp_path, zero=saves, one=saves, started=lambda proc: proc.send_signal(signal.SIGTERM)
  )
  assert status == 0, err
  assert sorted(l for l in out.splitlines() if 'saved' in l) == ['[0] saved 0', '[1] saved 1']
  assert sorted(who for who, _ in launches) == ['0', '1']
  assert not (workdir / workdir_lib.ELASTIC).exists()


# A trainer's end of it (elastic/heartbeat.py): its SIGTERM handler (a save,
# here a file), then follow_supervisor, as the train loop does.
FOLLOWER = (
  'import os, signal, time\n'
  'from triax.elastic import heartbeat\n'
  'def saved(*_):\n'
  '  open(os.path.join(os.environ["DIR"], "saved." + os.environ["TRIAX_PROCESS_ID"]), "w")\n'
  '  os._exit(0)\n'
  'signal.signal(signal.SIGTERM, saved)\n'
  'heartbeat.follow_supervisor()\n'
  'time.sleep(600)\n'
)


@pytest.mark.fast
def test_a_killed_supervisor_stops_its_trainers_as_a_preemption_would(tmp_path):
  # SIGKILL leaves the supervisor no time to stop anyone: each trainer gets
  # SIGTERM from the kernel instead (its save), not an orphan's life.
  follow = f'exec "$PYTHON" -c {shlex.quote(FOLLOWER)}'
  status, _, _, launches, _ = _supervise_fake(
    tmp_path, zero=follow, one=follow, started=lambda proc: proc.send_signal(signal.SIGKILL)
  )
  assert status == -signal.SIGKILL and sorted(who for who, _ in launches) == ['0', '1']
  deadline = time.monotonic() + 30
  while not all((tmp_path / f'saved.{i}').exists() for i in (0, 1)):
    assert time.monotonic() < deadline, 'the trainers outlived their supervisor'
    time.sleep(0.05)


@pytest.mark.fast
def test_a_stuck_job_is_stopped_and_started_again_on_the_same_layout(tmp_path):
  # Both processes finish a step (a beat), then hang; started again, they finish.
  stuck = (
    '[ -e "$DIR/again.$TRIAX_PROCESS_ID" ] && exit 0; touch "$DIR/again.$TRIAX_PROCESS_ID"; '
    'touch "$TRIAX_HEARTBEAT"; ' + WAIT
  )
  status, _, err, launches, workdir = _supervise_fake(
    tmp_path, zero=stuck, one=stuck, flags=['--heartbeat_s=1']
  )
  assert status == 0, err
  assert sorted(who for who, _ in launches) == ['0', '0', '1', '1']  # the same 2 processes
  assert len({args for _, args in launches}) == 1  # and the same flags: the same layout
  assert _gone(tmp_path / 'sleeper.0') and _gone(tmp_path / 'sleeper.1')
  (record,) = read_jsonl(workdir / workdir_lib.ELASTIC)
  assert record['stuck'] == 'no process finished a step for 1 s (--heartbeat_s)'
  assert (record['devices_before'], record['devices_after']) == (8, 8)
  assert [l for l in err.splitlines() if l.startswith('supervise:')] == [
    'supervise: restart 1: no process finished a step for 1 s (--heartbeat_s); all 2 processes '
    'stopped and started again on the same layout; resuming from step 0, 0 steps lost'
  ]


# Not in the fast tier: 3 s of waiting on a heartbeat.
def test_a_job_that_has_not_finished_a_step_is_never_stuck(tmp_path):
  # No beat yet (compiling, say): 3 s of silence is not a hang at --heartbeat_s=1.
  status, _, err, launches, workdir = _supervise_fake(
    tmp_path, zero='sleep 3', one='sleep 3', flags=['--heartbeat_s=1']
  )
  assert status == 0, err
  assert not (workdir / workdir_lib.ELASTIC).exists(), err
  assert sorted(who for who, _ in launches) == ['0', '1']
