"""A trainer's heartbeat: a file each process touches after every step it fetches.

`triax supervise` (elastic/supervisor.py) gives each process its own path in
TRIAX_HEARTBEAT and watches the files' ages: a job whose every process has
beaten and then gone silent is stuck (a hung device or link leaves the
others waiting in a collective, where no exit status will ever come).
Without the variable, beating does nothing. The supervisor also names
itself (TRIAX_SUPERVISOR), so that its death stops the trainers
(`follow_supervisor`). No JAX here: the supervisor imports it too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from triax.training import lock

VAR = 'TRIAX_HEARTBEAT'
# In the path, this process's task id under srun (SLURM_PROCID; srun's own notation).
TASK = '%t'
SUPERVISOR = 'TRIAX_SUPERVISOR'
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def beat() -> None:
  """Touches this process's heartbeat file, if a supervisor asked for one."""
  path = os.environ.get(VAR)
  if path:
    path = path.replace(TASK, os.environ.get('SLURM_PROCID', '0'))
    with open(path, 'a'):
      os.utime(path)


def silent_for(paths: list[str]) -> float | None:
  """Seconds since the newest beat of any of `paths`; None until every one has beaten."""
  try:
    newest = max(os.path.getmtime(p) for p in paths)
  except (OSError, ValueError):
    return None  # some process has not finished its first step yet
  return time.time() - newest


def follow_supervisor() -> None:
  """Under `triax supervise`: a SIGTERM to this process when the supervisor
  dies, so that a supervisor killed with SIGKILL leaves no trainer holding
  the workdir and the devices: each saves and exits as on a preemption.
  Linux's PR_SET_PDEATHSIG delivers SIGHUP at the death (`_orphaned` turns
  it into that SIGTERM). Call it once the SIGTERM handler is in place.
  Started through a wrapper (the parent is not the supervisor) the parent's
  death says nothing; only a supervisor already gone does."""
  named = os.environ.get(SUPERVISOR)
  if not named or not sys.platform.startswith('linux'):
    return
  supervisor = int(named)
  signal.signal(signal.SIGHUP, _orphaned)
  if os.getppid() == supervisor:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGHUP)
  if os.getppid() != supervisor and not lock.pid_exists(supervisor):  # gone before prctl took
    _orphaned(signal.SIGHUP, None)


def _orphaned(signum, frame) -> None:
  """The supervisor is gone, and with it the pipes this process's output
  went to: writing there would fail the save (EPIPE), so the output goes
  to /dev/null (the checkpoint and metrics.jsonl say what happened); then
  SIGTERM, the preemption path."""
  del signum, frame
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 1)
  os.dup2(null, 2)
  os.close(null)
  os.kill(os.getpid(), signal.SIGTERM)
