"""A one-node SLURM cluster on this machine, for tests/test_slurm.py: Debian's slurm-wlm
(slurmctld, slurmd) and munge, installed with apt-get when missing (root), each daemon
with its own state directory, ports and munge socket under a temporary directory, and
stopped (by the process ids they wrote) at the end.

What the sandbox cannot give is configured around: no cgroups (ProctrackType=
proctrack/linuxproc: processes tracked by their parent ids; TaskPlugin=task/none: no CPU
binding), the daemons and jobs run as root (SlurmUser=root), no accounting database
(AccountingStorageType=accounting_storage/none, so no sacct), and the node offers 8 CPUs
whatever the machine has (SlurmdParameters=config_overrides) so that 2 or 3 tasks of 4
forced CPU devices each can be placed; they share the real cores.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ('munged', 'slurmctld', 'slurmd')
PACKAGES = ('slurm-wlm', 'munge')


class SetupError(RuntimeError):
  """The cluster could not be set up; the message says what is missing and why."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def install() -> float:
  """Installs slurm-wlm and munge with apt-get unless their daemons are on PATH; the
  seconds it took. Raises SetupError (not root, no apt-get, apt-get failed)."""
  began = time.monotonic()
  if all(shutil.which(d) for d in DAEMONS + ('srun', 'sbatch', 'scancel', 'scontrol')):
    return time.monotonic() - began
  if os.geteuid() != 0:
    raise SetupError(
      f'slurm-wlm and munge are not installed and this user (uid {os.geteuid()}) is not root: '
      f'run `apt-get install -y {" ".join(PACKAGES)}` as root first'
    )
  if shutil.which('apt-get') is None:
    raise SetupError(
      f'no apt-get here to install {" ".join(PACKAGES)} (a Debian system is assumed)'
    )
  env = {**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'}
  command = ['apt-get', 'install', '-y', '--no-install-recommends', *PACKAGES]
  done = subprocess.run(command, env=env, capture_output=True, text=True)
  if done.returncode != 0:  # a stale package list: update it once, then again
    subprocess.run(['apt-get', 'update'], env=env, capture_output=True, text=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
  if done.returncode != 0:
    raise SetupError(f'`{" ".join(command)}` failed: {done.stderr.strip()[-1500:]}')
  missing = [d for d in DAEMONS if shutil.which(d) is None]
  if missing:
    raise SetupError(f'{", ".join(missing)} not on PATH after installing {" ".join(PACKAGES)}')
  return time.monotonic() - began


@dataclasses.dataclass
class Cluster:
  """A running one-node cluster: `env` is what its clients need (SLURM_CONF)."""

  root: str
  node: str
  env: dict
  install_s: float = 0.0
  start_s: float = 0.0

  def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """A SLURM client command (sinfo, sbatch, scontrol, ...) against this cluster; `env`
    adds to this process's environment."""
    env = {**os.environ, **kwargs.pop('env', {}), **self.env}
    done = subprocess.run(list(command), env=env, capture_output=True, text=True, **kwargs)
    if check and done.returncode != 0:
      raise AssertionError(f'{" ".join(command)}: exit {done.returncode}: {done.stderr}')
    return done

  def stop(self) -> None:
    """Cancels every job left, then stops slurmd, slurmctld and munged by their pid files."""
    self.run('scancel', '--full', '--user=root', check=False, timeout=30)
    for name in ('slurmd', 'slurmctld', 'munged'):
      path = os.path.join(self.root, f'{name}.pid')
      try:
        with open(path) as f:
          pid = int(f.read().strip())
      except (OSError, ValueError):
        continue
      try:
        os.kill(pid, signal.SIGTERM)
      except ProcessLookupError:
        continue
      deadline = time.monotonic() + 20
      while time.monotonic() < deadline and os.path.exists(f'/proc/{pid}'):
        time.sleep(0.1)
      if os.path.exists(f'/proc/{pid}'):
        os.kill(pid, signal.SIGKILL)


_CONF = """\
ClusterName=triaxtest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=60
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def start(root: str) -> Cluster:
  """Installs what is missing and starts munged, slurmctld and slurmd under `root`; waits
  until the node is idle. Raises SetupError with the reason when any of it fails."""
  install_s = install()
  began = time.monotonic()
  node = socket.gethostname()
  os.makedirs(os.path.join(root, 'state'))
  os.makedirs(os.path.join(root, 'spool'))
  os.chmod(root, 0o711)  # munged: the socket's directory must be traversable, not writable
  key = os.path.join(root, 'munge.key')
  with open(key, 'wb') as f:
    f.write(os.urandom(128))
  os.chmod(key, 0o400)
  conf = os.path.join(root, 'slurm.conf')
  with open(conf, 'w') as f:
    f.write(_CONF.format(node=node, root=root, ctld_port=_free_port(), d_port=_free_port()))
  cluster = Cluster(root, node, {'SLURM_CONF': conf}, install_s)
  munged = [
    'munged',
    '--force',  # as root
    f'--socket={root}/munge.sock',
    f'--key-file={key}',
    f'--log-file={root}/munged.log',
    f'--pid-file={root}/munged.pid',
    f'--seed-file={root}/munged.seed',
  ]
  try:
    for command in (munged, ['slurmctld', '-f', conf], ['slurmd', '-f', conf, '-N', node]):
      done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **cluster.env}
      )
      if done.returncode != 0:
        raise SetupError(f'{command[0]} did not start: {done.stderr.strip()[-1000:]}')
    deadline = time.monotonic() + 60
    while cluster.run('sinfo', '-h', '-o', '%T', check=False).stdout.strip() != 'idle':
      if time.monotonic() > deadline:
        logs = ''.join(_tail(os.path.join(root, f'{d}.log')) for d in ('slurmctld', 'slurmd'))
        raise SetupError(f'the node never became idle; the logs end:\n{logs}')
      time.sleep(0.2)
  except BaseException:
    cluster.stop()
    raise
  cluster.start_s = time.monotonic() - began
  return cluster


def _tail(path: str, lines: int = 15) -> str:
  try:
    with open(path) as f:
      return ''.join(f.readlines()[-lines:])
  except OSError:
    return f'({path} missing)\n'
