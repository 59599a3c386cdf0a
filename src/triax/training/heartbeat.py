"""A trainer's heartbeat: a file each process touches after every step it fetches.

`triax supervise` (training/elastic.py) gives each process its own path in
TRIAX_HEARTBEAT and watches the files' ages: a job whose every process has
beaten and then gone silent is stuck (a hung device or link leaves the
others waiting in a collective, where no exit status will ever come).
Without the variable, beating does nothing. No JAX here: the supervisor
imports it too.
"""

from __future__ import annotations

import os
import time

VAR = 'TRIAX_HEARTBEAT'


def beat() -> None:
  """Touches this process's heartbeat file, if a supervisor asked for one."""
  path = os.environ.get(VAR)
  if path:
    with open(path, 'a'):
      os.utime(path)


def silent_for(paths: list[str]) -> float | None:
  """Seconds since the newest beat of any of `paths`; None until every one has beaten."""
  try:
    newest = max(os.path.getmtime(p) for p in paths)
  except (OSError, ValueError):
    return None  # some process has not finished its first step yet
  return time.time() - newest
