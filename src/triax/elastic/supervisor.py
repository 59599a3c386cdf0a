"""Elastic restart with re-planning: a train command run as N processes, and
relaunched on the devices left when one of them fails.

`supervise` starts the command as N loopback processes (as
scripts/launch_local.sh does: one coordinator, a process id each, a CPU
device count each) and watches them. When one dies (by a signal, or a
non-zero status other than bad input's 2) it stops the others (SIGTERM,
SIGKILL after a grace period: with a dead peer they wait in a collective
forever), counts the devices left (the other processes' devices), picks a
layout for them (`replan`) and reruns the command on the same workdir with
that layout's `--config.*` overrides: train restores the newest checkpoint
into the new mesh (checkpoints are layout-free) and goes on. Each restart is
one log line and one record in WORKDIR/elastic.jsonl.

Under SLURM (`launcher='srun'`, inside an allocation: sbatch or salloc) each attempt is
one srun job step of N tasks (`--kill-on-bad-exit`: a task that dies ends the step), and
the devices left are those of the allocation's nodes that SLURM still reports up: a
task killed on a healthy node is relaunched on the same layout, a node lost takes its
tasks' devices with it. The heartbeat files are then under WORKDIR/heartbeats (every
node sees the workdir), one per task (`%t`, srun's task id).

The global batch never changes, so neither does the order of the tokens:
where the data degree shrinks, the micro-batches grow in number (the
executor accumulates gradients over them), and the run goes on as one
started on the new layout from that checkpoint would.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from triax import layout as layout_lib
from triax.elastic import heartbeat
from triax.elastic import replan as replan_lib
from triax.errors import ConfigError
from triax.training import workdir as workdir_lib

# Bad input's status (cli.EXIT_BAD_INPUT): the same command would fail the same way again.
BAD_INPUT = 2
# The train command's flag each process gets from the supervisor.
CPU_DEVICES_FLAG = '--cpu_devices'
# What makes a process one of a jax.distributed job (mesh.maybe_initialize_distributed).
_DISTRIBUTED = ('TRIAX_COORDINATOR', 'TRIAX_NUM_PROCESSES', 'TRIAX_PROCESS_ID')


@dataclasses.dataclass(frozen=True)
class TrainCommand:
  """The command line of one `triax train` process, as the user gave it."""

  argv: tuple[str, ...]
  workdir: str

  def with_flags(self, flags: Sequence[str]) -> list[str]:
    """argv with `flags` (--name=value) appended, earlier flags of those names removed."""
    names = {flag.split('=', 1)[0] for flag in flags}
    kept = [word for word in self.argv if word.split('=', 1)[0] not in names]
    return kept + list(flags)


def parse_command(words: Sequence[str]) -> TrainCommand:
  """The train command after `supervise --`.

  Raises:
    ConfigError('command', ...): not a triax train command with a --workdir=DIR,
      or one that sets what the supervisor sets per process.
  """
  example = 'e.g. -- python -m triax train --config=experiments/gpt_tiny.py --workdir=runs/x'
  if not words:
    raise ConfigError('command', f'give the train command after --, {example}')
  if not _is_train(words):
    raise ConfigError(
      'command', f'{" ".join(words[:4])} ... is not a triax train command; {example}'
    )
  workdirs = [w.split('=', 1)[1] for w in words if w.startswith('--workdir=')]
  if len(workdirs) != 1 or not workdirs[0] or '--workdir' in words:
    raise ConfigError('command', f'give train one --workdir=DIR (in that form), {example}')
  if any(w.split('=', 1)[0] == CPU_DEVICES_FLAG for w in words):
    raise ConfigError(
      'command',
      f'{CPU_DEVICES_FLAG} is set per process by supervise (its own {CPU_DEVICES_FLAG}); '
      'remove it from the train command',
    )
  return TrainCommand(tuple(words), workdirs[0])


def _is_train(words: Sequence[str]) -> bool:
  # `python -m triax train`, `python -m triax.cli.train` or the `triax train` console script.
  for i, word in enumerate(words[:-1]):
    if word == '-m' and (
      words[i + 1] == 'triax.cli.train' or list(words[i + 1 : i + 3]) == ['triax', 'train']
    ):
      return True
  script = os.path.basename(words[0])
  return script == 'triax-train' or (script == 'triax' and len(words) > 1 and words[1] == 'train')


# ---------------------------------------------------------------- processes


@dataclasses.dataclass
class Job:
  """One launch of the train command: a process each, with its output pumps."""

  procs: list[subprocess.Popen]
  pumps: list[threading.Thread]
  beats: list[str]  # each process's heartbeat file (elastic/heartbeat.py)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def launch_srun(
  command: TrainCommand, extra: Sequence[str], processes: int, cpu_devices: int
) -> Job:
  """Starts the command as one srun job step of `processes` tasks in this SLURM allocation,
  each one process of a jax.distributed job (TRIAX_DISTRIBUTED=auto reads srun's variables),
  `cpu_devices` CPU devices each; a task that dies ends the step (--kill-on-bad-exit).
  Output lines keep srun's task labels (`0: `)."""
  argv = command.with_flags([*extra, f'{CPU_DEVICES_FLAG}={cpu_devices}'])
  beats = workdir_lib.path(command.workdir, workdir_lib.HEARTBEATS)
  shutil.rmtree(beats, ignore_errors=True)
  os.makedirs(beats)
  env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED}
  srun = [
    'srun',
    f'--ntasks={processes}',
    '--kill-on-bad-exit=1',
    '--label',
    'env',
    'TRIAX_DISTRIBUTED=auto',
    f'{heartbeat.VAR}={os.path.join(beats, heartbeat.TASK)}',
  ]
  proc = subprocess.Popen(
    srun + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
  )
  job = Job([proc], [], [os.path.join(beats, str(i)) for i in range(processes)])
  for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
    pump = threading.Thread(target=_pump, args=(source, sink, ''), daemon=True)
    pump.start()
    job.pumps.append(pump)
  return job


def slurm_nodes_up(nodelist: str) -> tuple[list[str], list[str]]:
  """(the allocation's nodes, those SLURM reports up: not down, drained, failed or not
  responding) for SLURM_JOB_NODELIST `nodelist`, by scontrol and sinfo.

  Raises:
    GiveUp: scontrol or sinfo failed (no controller answers).
  """
  names = _slurm(['scontrol', 'show', 'hostnames', nodelist]).split()
  up = []
  for line in _slurm(['sinfo', '-h', '-N', '-n', ','.join(names), '-o', '%N %T']).splitlines():
    node, state = line.split()
    bad = ('down', 'drain', 'fail', 'unknown', 'not_responding', 'power')
    if not state.endswith('*') and not state.startswith(bad) and node not in up:
      up.append(node)
  return names, up


def _slurm(command: list[str]) -> str:
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise GiveUp(f'{command[0]} failed: {e}') from None
  if done.returncode != 0:
    raise GiveUp(f'{" ".join(command)}: {done.stderr.strip() or done.returncode}')
  return done.stdout


def launch(command: TrainCommand, extra: Sequence[str], processes: int, cpu_devices: int) -> Job:
  """Starts `processes` processes of the command, each with `cpu_devices` devices,
  one jax.distributed job over loopback (mesh.maybe_initialize_distributed reads
  the TRIAX_* variables); each in its own session, so stopping it stops its children."""
  argv = command.with_flags([*extra, f'{CPU_DEVICES_FLAG}={cpu_devices}'])
  coordinator = f'127.0.0.1:{_free_port()}'
  job = Job([], [], [])
  beats = tempfile.mkdtemp(prefix='triax-heartbeat-')
  for i in range(processes):
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED}  # not inherited
    job.beats.append(os.path.join(beats, str(i)))
    env[heartbeat.VAR] = job.beats[-1]
    env[heartbeat.SUPERVISOR] = str(os.getpid())  # its death stops the trainers
    if processes > 1:
      env.update(
        TRIAX_COORDINATOR=coordinator, TRIAX_NUM_PROCESSES=str(processes), TRIAX_PROCESS_ID=str(i)
      )
    proc = subprocess.Popen(
      argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    job.procs.append(proc)
    for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
      pump = threading.Thread(target=_pump, args=(source, sink, f'[{i}] '), daemon=True)
      pump.start()
      job.pumps.append(pump)
  return job


_OUTPUT = threading.Lock()  # one line at a time, whichever process it comes from


def _pump(source, sink, prefix: str) -> None:
  # Lines prefixed with the process id, as launch_local.sh writes them.
  for line in iter(source.readline, b''):
    with _OUTPUT:
      if hasattr(sink, 'buffer'):
        sink.buffer.write(prefix.encode() + line)
      else:  # a text stream alone (a test's capture)
        sink.write(prefix + line.decode(errors='replace'))
      sink.flush()
  source.close()


def watch(job: Job, heartbeat_s: float = 0.0, poll_s: float = 0.05) -> list[int] | None:
  """Waits until every process has exited 0 (returns []), some have failed
  (returns their indices: those found failed at the same poll), or, with
  `heartbeat_s` > 0, the job is stuck (returns None): every process has
  finished a step and none has finished another for `heartbeat_s` seconds.
  Collectives tie the processes' steps together, so a hung one stalls all:
  silence says the job is stuck, not which device is at fault."""
  while True:
    codes = [p.poll() for p in job.procs]
    failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
    if failed or all(code == 0 for code in codes):
      return failed
    silent = heartbeat.silent_for(job.beats) if heartbeat_s > 0 else None
    if silent is not None and silent > heartbeat_s and all(code is None for code in codes):
      return None
    time.sleep(poll_s)


def stop(job: Job, grace_s: float) -> None:
  """SIGTERM to the processes still running (train saves and exits), SIGKILL
  to those left after `grace_s` (waiting on a dead peer, they cannot)."""
  _signal_all(job, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  while any(p.poll() is None for p in job.procs) and time.monotonic() < deadline:
    time.sleep(0.05)
  _signal_all(job, signal.SIGKILL)
  for proc in job.procs:
    proc.wait()
  for pump in job.pumps:
    pump.join()
  if job.beats:
    shutil.rmtree(os.path.dirname(job.beats[0]), ignore_errors=True)


def _signal_all(job: Job, signum: int) -> None:
  for proc in job.procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signum)
      except ProcessLookupError:
        pass


def lost(job: Job, failed: Sequence[int]) -> list[int]:
  """The processes whose devices are gone: of those that failed together,
  the ones a signal killed (the others likely failed on losing them), else all."""
  killed = [i for i in failed if job.procs[i].returncode < 0]
  return killed or list(failed)


def status_text(code: int) -> str:
  if code < 0:
    return f'killed by {signal.Signals(-code).name}'
  return f'exited with status {code}'


# ---------------------------------------------------------------- the record


def last_step(workdir: str) -> int:
  """The newest step in metrics.jsonl (0 if none): how far the run got."""
  newest = 0
  try:
    with open(workdir_lib.path(workdir, workdir_lib.METRICS)) as f:
      for line in f:
        try:
          newest = max(newest, int(json.loads(line)['step']))
        except (ValueError, KeyError, TypeError):
          continue  # a line cut short by the kill
  except OSError:
    pass
  return newest


def checkpoint_step(workdir: str, cfg) -> int:
  """The step train will restore: its newest intact checkpoint (0: none, a fresh start)."""
  from triax.training.checkpoint import Checkpointer

  step = Checkpointer(workdir, cfg).latest_step()
  return 0 if step is None else step


def append_record(workdir: str, record: dict) -> None:
  with open(workdir_lib.path(workdir, workdir_lib.ELASTIC), 'a') as f:
    f.write(json.dumps(record) + '\n')
    f.flush()
    os.fsync(f.fileno())


# ---------------------------------------------------------------- the supervisor


@dataclasses.dataclass
class Options:
  """How the supervisor runs the command and what it tolerates."""

  processes: int
  cpu_devices: int
  max_restarts: int = 3
  grace_s: float = 10.0
  heartbeat_s: float = 0.0  # a job silent this long after its first step is stuck (0: off)
  cluster: Any = None  # a plan.cluster.Cluster the re-planning prices layouts on
  search_s: float = 30.0
  launcher: str = 'local'  # local: loopback processes; srun: job steps in a SLURM allocation


class GiveUp(RuntimeError):
  """A failure the supervisor cannot restart from (the message says why)."""


def supervise(command: TrainCommand, options: Options, say=None) -> int:
  """Runs the command under supervision; returns the exit status for the shell.

  0 when the run finishes (after any restarts); bad input's 2 when train
  refused its input (the same command would again); 1 when a failure
  cannot be restarted from, said in one `error:` line.
  """
  say = say or (lambda line: print(f'supervise: {line}', file=sys.stderr, flush=True))
  stopping, current = [], []  # signals received; the job running

  def on_signal(signum, frame):  # pylint: disable=unused-argument
    stopping.append(signum)  # the trainers save and exit; no restart follows
    if current:
      _signal_all(current[-1], signal.SIGTERM)

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    processes, extra, restarts = options.processes, [], 0
    while True:
      start = launch_srun if options.launcher == 'srun' else launch
      job = start(command, extra, processes, options.cpu_devices)
      current.append(job)
      failed = watch(job, options.heartbeat_s)
      stop(job, options.grace_s)
      codes = [p.returncode for p in job.procs]
      if failed is None and not stopping:
        # Stuck: no device is known lost, so the same layout resumes.
        if restarts == options.max_restarts:
          print(
            f'error: supervise: {_stuck_text(options)}; {restarts} restarts made (--max_restarts)',
            file=sys.stderr,
            flush=True,
          )
          return 1
        _record_stuck(command, options, processes, restarts + 1, say)
        restarts += 1
        continue
      if failed is None:  # stuck while stopping: the trainers did not save
        return 1
      if not failed:
        return 0
      if stopping or any(codes[i] == BAD_INPUT for i in failed):
        return codes[failed[0]] if codes[failed[0]] > 0 else 1
      try:
        if restarts == options.max_restarts:
          raise GiveUp(f'{restarts} restarts made (--max_restarts); not restarting again')
        extra, processes = _restart(command, options, job, failed, processes, restarts + 1, say)
      except GiveUp as e:
        print(f'error: supervise: {e}', file=sys.stderr, flush=True)
        return 1
      restarts += 1
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def _stuck_text(options: Options) -> str:
  return f'no process finished a step for {options.heartbeat_s:g} s (--heartbeat_s)'


def _record_stuck(command, options, processes, number, say) -> None:
  """Records a restart of a stuck job on the same processes and layout."""
  has_config = os.path.isfile(workdir_lib.path(command.workdir, workdir_lib.CONFIG))
  cfg = workdir_lib.load_config(command.workdir) if has_config else None
  devices = processes * options.cpu_devices
  record = _append_record(
    command,
    cfg,
    number,
    (processes, processes),
    (devices, devices),
    stuck=_stuck_text(options),
    how='stuck: the same layout again',
  )
  say(
    f'restart {number}: {record["stuck"]}; all {processes} processes stopped and started '
    f'again on the same layout; resuming from step {record["restored_step"]}, '
    f'{record["steps_lost"]} steps lost'
  )


def _restart(command, options, job, failed, processes, number, say) -> tuple[list[str], int]:
  """Re-plans for the devices left, records it, and returns the next launch's flags and size."""
  if options.launcher == 'srun':
    what = f'srun of {processes} tasks {status_text(job.procs[0].returncode)}'
    left = _tasks_left(processes, what)
  else:
    what = ', '.join(f'process {i} {status_text(job.procs[i].returncode)}' for i in failed)
    left = processes - len(lost(job, failed))
  if left < 1:
    raise GiveUp(f'{what}: no process is left to go on with')
  if not os.path.isfile(workdir_lib.path(command.workdir, workdir_lib.CONFIG)):
    raise GiveUp(f'{what} before the run wrote its {workdir_lib.CONFIG}: nothing to re-plan')
  cfg = workdir_lib.load_config(command.workdir)
  before, after = processes * options.cpu_devices, left * options.cpu_devices
  chosen = replan_lib.replan(cfg, after, options.cluster, options.search_s)
  if chosen is None:
    raise GiveUp(f'{what}: no layout of {after} devices suits this model and batch')
  layout, how = chosen
  was = layout_lib.Layout.from_config(cfg)
  record = _append_record(
    command,
    cfg,
    number,
    (processes, left),
    (before, after),
    failed=[{'process': i, 'status': status_text(job.procs[i].returncode)} for i in failed],
    layout_before=dataclasses.asdict(was),
    layout_after=dataclasses.asdict(layout),
    how=how,
  )
  old, new = replan_lib.describe(was), replan_lib.describe(layout)
  say(
    f'restart {number}: {what}; {before} -> {after} devices; {old} -> {new} ({how}); '
    f'resuming from step {record["restored_step"]}, {record["steps_lost"]} steps lost'
  )
  return layout_lib.flags(replan_lib.overrides(cfg, layout)), left


# Seconds a node SLURM does not report up gets to come back before a restart
# goes on without it: a slurmd too busy to answer the controller's ping shows
# as not responding for a moment (seen with the test suite beside a job on 2
# cores); a lost node stays down, and the restart waits this long for it.
NODE_SETTLE_S = 30


def _tasks_left(processes: int, what: str) -> int:
  """The tasks the allocation's nodes still up can run, `processes` spread evenly over them."""
  nodes, up = slurm_nodes_up(os.environ['SLURM_JOB_NODELIST'])
  settled = time.monotonic() + NODE_SETTLE_S
  while len(up) < len(nodes) and time.monotonic() < settled:
    time.sleep(2)
    nodes, up = slurm_nodes_up(os.environ['SLURM_JOB_NODELIST'])
  if processes % len(nodes):
    raise GiveUp(f'{what}: {processes} tasks do not spread evenly over {len(nodes)} nodes')
  return processes // len(nodes) * len(up)


def _append_record(command, cfg, number, processes, devices, **fields) -> dict:
  """Appends restart `number`'s record to DIR/elastic.jsonl and returns it: when, the
  processes and devices (before, after), `fields`, and how far the run had got
  against the step it resumes from (0 without a config: nothing was saved yet)."""
  reached = last_step(command.workdir)
  restored = 0 if cfg is None else checkpoint_step(command.workdir, cfg)
  record = {
    'time': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'restart': number,
    **fields,
    'processes_before': processes[0],
    'processes_after': processes[1],
    'devices_before': devices[0],
    'devices_after': devices[1],
    'last_step': reached,
    'restored_step': restored,
    'steps_lost': max(0, reached - restored),
  }
  append_record(command.workdir, record)
  return record
