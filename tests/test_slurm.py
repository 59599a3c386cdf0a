"""SLURM as it is: a real one-node slurmctld and slurmd on this machine
(tests/slurm_cluster.py installs Debian's slurm-wlm and munge with apt-get when missing and
fails, not skips, when it cannot), README's SLURM block run as written from a fresh clone
(scripts/readme_commands.py --slurm), scancel and a requeue of a batch job, and the bad
input of a task count the mesh cannot use and of train started without srun."""

import json
import os
import subprocess
import sys
import time

import pytest
import slurm_cluster
from harness import ROOT
from test_reliability import assert_same_losses, losses

from triax.training import goodput

FLAGS = (
  '--config=experiments/gpt_tiny.py:smoke',
  '--cpu_devices=4',
  '--config.train.steps=16',
  '--config.checkpoint.every_steps=100',
)


@pytest.fixture(scope='module')
def cluster(tmp_path_factory, compile_cache):
  root = str(tmp_path_factory.mktemp('slurm'))
  try:
    running = slurm_cluster.start(root)
  except slurm_cluster.SetupError as e:
    pytest.fail(f'no SLURM cluster for this test: {e}', pytrace=False)
  print(
    f'\nslurm set-up: install {running.install_s:.2f} s, daemons to an idle node '
    f'{running.start_s:.2f} s'
  )
  # Every job trains the same program: its tasks load what the first one compiled.
  running.env.update(compile_cache)
  yield running
  running.stop()


@pytest.fixture(scope='module')
def readme_run(cluster, tmp_path_factory):
  """README's slurm block, run as written in a fresh clone; (the clone, the runner's output)."""
  clone = str(tmp_path_factory.mktemp('readme') / 'clone')
  done = subprocess.run(
    [sys.executable, 'scripts/readme_commands.py', '--slurm', f'--clone_dir={clone}', '--keep'],
    cwd=ROOT,
    env={**os.environ, **cluster.env},
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  return clone, done.stdout


def _job_env(cluster, clone):
  """What a user's shell in the clone has: the venv's python first, the clone's triax."""
  path = os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH']
  return {**os.environ, **cluster.env, 'PATH': path, 'PYTHONPATH': os.path.join(clone, 'src')}


def _sbatch(cluster, clone, workdir, *extra):
  done = cluster.run(
    'sbatch',
    '--parsable',
    *extra,
    'scripts/slurm_train.sbatch',
    *FLAGS,
    f'--workdir={workdir}',
    cwd=clone,
    env=_job_env(cluster, clone),
  )
  return done.stdout.strip().split(';')[0]


def _state(cluster, job):
  """The job's state while squeue lists it (PENDING, RUNNING, COMPLETING), else ''."""
  return cluster.run('squeue', '-h', '-j', job, '-o', '%T', check=False).stdout.strip()


def _wait(condition, what, timeout=600):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, f'timed out waiting for {what}'
    time.sleep(0.2)


def _logged_step(workdir):
  try:
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      steps = [json.loads(line)['step'] for line in f if '"loss"' in line]
  except (OSError, ValueError):
    return 0  # absent, or a line being written
  return max(steps, default=0)


def test_readme_srun_and_sbatch_run_as_written_with_the_same_losses(readme_run):
  clone, output = readme_run
  srun, batch = (os.path.join(clone, 'runs', name) for name in ('slurm', 'slurm_batch'))
  assert_same_losses(losses(batch), losses(srun))
  assert max(step for step, _ in losses(srun)) == 16
  [log] = [n for n in os.listdir(clone) if n.startswith('slurm-triax-') and n.endswith('.out')]
  text = open(os.path.join(clone, log), errors='replace').read()
  assert 'run 1 on' in text and ': 2 tasks' in text
  assert '0: triax:' in text and '8 devices (cpu) in 2 processes' in text
  assert '| **wall** |' in output and '0 steps lost; 1 attempt(s)' in output


def test_scancel_saves_the_step_in_flight_and_a_requeue_resumes_to_the_same_losses(
  cluster, readme_run
):
  clone, _ = readme_run
  workdir = os.path.join(clone, 'runs', 'cancelled')
  out = lambda job: open(os.path.join(clone, f'slurm-triax-{job}.out'), errors='replace').read()  # noqa: E731

  # 1. scancel: every task gets SIGTERM, both stop after the same step, which is saved.
  first = _sbatch(cluster, clone, workdir)
  _wait(lambda: _logged_step(workdir) >= 3, 'step 3 of the first job')
  cluster.run('scancel', first)
  _wait(lambda: not _state(cluster, first), 'the cancelled job to end')
  text = out(first)
  for task in (0, 1):
    assert f'{task}: SIGTERM: stopping after the step in flight' in text, text[-3000:]
  [stopped] = [l for l in text.splitlines() if 'stopped by SIGTERM after step' in l]
  step = int(stopped.split('after step ')[1].split(';')[0])
  assert stopped.startswith('0: ') and f'checkpoint {step} is complete' in stopped
  assert os.path.isfile(os.path.join(workdir, 'checkpoints', str(step), 'triax_manifest.json'))

  # 2. The same sbatch resumes there; `scontrol requeue` stops it the same way and queues
  #    it again (held ~2 minutes by SLURM: released at once here), and the rerun finishes.
  second = _sbatch(cluster, clone, workdir)
  _wait(lambda: _logged_step(workdir) >= step + 3, f'step {step + 3} of the second job')
  cluster.run('scontrol', 'requeue', second)
  _wait(lambda: _state(cluster, second) == 'PENDING', 'the requeued job to be pending')
  cluster.run('scontrol', 'update', f'JobId={second}', 'StartTime=now')
  _wait(lambda: 'run 2 on' in out(second) and not _state(cluster, second), 'the rerun to end')
  text = out(second)
  assert f'resuming from checkpoint {step} of 16' in text
  [again] = [l for l in text.splitlines() if 'stopped by SIGTERM after step' in l]
  resumed = int(again.split('after step ')[1].split(';')[0])
  assert f'resuming from checkpoint {resumed} of 16' in text.split('run 2 on')[1]

  reference = os.path.join(clone, 'runs', 'slurm')
  assert_same_losses(losses(workdir), losses(reference))
  ledger = goodput.ledger(workdir)
  assert ledger.attempts == 3 and ledger.lost_steps == 0  # SIGTERM saves: nothing recomputed
  assert ledger.totals['restart'] > 0


def test_a_task_count_the_mesh_cannot_use_is_one_error_line(cluster, readme_run):
  clone, _ = readme_run
  done = cluster.run(
    'srun',
    '--ntasks=3',
    'env',
    'TRIAX_DISTRIBUTED=auto',
    'python',
    '-m',
    'triax',
    'train',
    *FLAGS,
    '--workdir=runs/three',
    check=False,
    cwd=clone,
    env=_job_env(cluster, clone),
    timeout=600,
  )
  assert done.returncode == 2, done.stderr[-3000:]
  errors = [l for l in done.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and '12' in errors[0], done.stderr[-3000:]
  assert not os.path.exists(os.path.join(clone, 'runs', 'three', 'checkpoints'))


def test_train_started_in_the_batch_script_without_srun_is_one_error_line(cluster, readme_run):
  clone, _ = readme_run
  wrap = f'env TRIAX_DISTRIBUTED=auto python -m triax train {" ".join(FLAGS)} --workdir=runs/b'
  done = cluster.run(
    'sbatch',
    '--wait',
    '--ntasks=2',
    '--output=nosrun-%j.out',
    f'--wrap={wrap}',
    check=False,
    cwd=clone,
    env=_job_env(cluster, clone),
    timeout=600,
  )
  assert done.returncode == 2, done.stdout + done.stderr
  job = done.stdout.split()[-1]
  text = open(os.path.join(clone, f'nosrun-{job}.out')).read()
  errors = [l for l in text.splitlines() if l.startswith('error:')]
  assert errors == [
    f'error: TRIAX_DISTRIBUTED: auto in SLURM job {job} without SLURM_STEP_NODELIST (srun sets '
    'them for each task): start train with srun (one task per process), e.g. `srun '
    '--ntasks=2 env TRIAX_DISTRIBUTED=auto python -m triax train ...`, not from the batch '
    'script itself'
  ], text[-3000:]


def _task_pid(job, task):
  """The pid of the train process that is task `task` of job `job`'s step 0 (from /proc)."""
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        cmdline = f.read().split(b'\0')
      with open(f'/proc/{pid}/environ', 'rb') as f:
        env = dict(kv.split(b'=', 1) for kv in f.read().split(b'\0') if b'=' in kv)
    except OSError:
      continue
    if (
      b'train' in cmdline
      and env.get(b'SLURM_JOB_ID') == job.encode()
      and env.get(b'SLURM_PROCID') == str(task).encode()
      and b'SLURM_STEP_ID' in env
      and cmdline[0].endswith(b'python')
    ):
      return int(pid)
  return None


def test_supervise_in_an_allocation_relaunches_the_step_when_a_task_is_killed(cluster, readme_run):
  clone, _ = readme_run
  workdir = os.path.join(clone, 'runs', 'supervised')
  train = [f for f in FLAGS if 'cpu_devices' not in f and 'every_steps' not in f]
  wrap = (
    'python -m triax supervise --launcher=srun --processes=2 --cpu_devices=4 -- python -m '
    f'triax train {" ".join(train)} --config.checkpoint.every_steps=4 --workdir={workdir}'
  )
  done = cluster.run(
    'sbatch',
    '--parsable',
    '--ntasks=2',
    '--output=supervised-%j.out',
    f'--wrap={wrap}',
    cwd=clone,
    env=_job_env(cluster, clone),
  )
  job = done.stdout.strip().split(';')[0]
  _wait(lambda: _logged_step(workdir) >= 6, 'step 6 under supervise')
  os.kill(_task_pid(job, 1), 9)
  _wait(lambda: not _state(cluster, job), 'the supervised job to end')
  text = open(os.path.join(clone, f'supervised-{job}.out'), errors='replace').read()
  [restart] = [l for l in text.splitlines() if l.startswith('supervise: restart 1:')]
  assert 'srun of 2 tasks' in restart and '8 -> 8 devices' in restart, restart
  with open(os.path.join(workdir, 'elastic.jsonl')) as f:
    [record] = [json.loads(line) for line in f]
  assert (record['processes_before'], record['processes_after']) == (2, 2)
  assert record['restored_step'] in (4, 8) and record['steps_lost'] >= 0
  assert 'ExitCode=0:0' in cluster.run('scontrol', 'show', 'job', job).stdout
  assert_same_losses(losses(workdir), losses(os.path.join(clone, 'runs', 'slurm')))
  ledger = goodput.ledger(workdir)
  # goodput counts the steps it recorded (dispatched, then evaluated and saved where due);
  # elastic.jsonl counts metrics.jsonl's, which logs a step's loss once it is fetched: at the
  # next step's dispatch (one fewer than goodput's if the kill came before it), or at once
  # for an evaluated step (one more if the kill came in its evaluation, whose time is then
  # in the restart's gap). Which of the three the kill meets is the machine's timing.
  assert ledger.attempts == 2
  assert abs(ledger.lost_steps - record['steps_lost']) <= 1, (ledger.lost_steps, record)
