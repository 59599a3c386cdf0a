"""Goodput: a run's wall time split into what it was spent on, across restarts.

Each process of a run keeps a `Clock` from the moment its process started: the time goes
to exactly one bucket at a time (`BUCKETS`: startup, compile, steps, data, checkpoint,
eval, restart), so the buckets always add up to the time since the process started.
Process 0 appends a record of them to DIR/goodput.jsonl when it starts (the step it
restored), after every step and after a rollback (the step it went back to):

  {"attempt": ID, "process_start": T0, "time": T, "step": S, "kind": start|step|rollback,
   "parts": {BUCKET: seconds since T0, ...}}

The file is never cut back: it is the history of every attempt, killed ones included.
A `Ledger` reads the records in order and splits the whole wall time, from the first
attempt's process start to the last record, into `PARTS`:

- a step record's time (from the record before it) is `productive` (the steps bucket),
  `data`, `checkpoint` or `eval`, unless a later record goes back to an earlier step (a
  resume from a checkpoint, a rollback): then the time of every record past that step
  is `lost` and its steps are counted in `lost_steps`;
- `compile` never becomes lost; `startup` is the first attempt's time before its first
  record (imports, data, restore); the later attempts' startups, the gaps between one
  attempt's last record and the next one's process start (a kill's detection, a
  relaunch, the step in flight at a SIGKILL), and a rollback's restore are `restart`.

The parts add up to the wall time by construction. No JAX here.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

from triax.errors import ConfigError
from triax.training import workdir as workdir_lib

# What the clock's time goes to inside one process.
BUCKETS = ('startup', 'compile', 'steps', 'data', 'checkpoint', 'eval', 'restart')
# Buckets whose time is lost when the steps they served are computed again.
_LOSABLE = ('steps', 'data', 'checkpoint', 'eval')
# What the wall time of a run is split into (the table's rows, in order).
PARTS = ('productive', 'compile', 'data', 'checkpoint', 'eval', 'lost', 'restart', 'startup')
_PART_OF = {'steps': 'productive'}  # bucket -> part where the names differ


def process_start() -> float:
  """This process's start as a Unix time (Linux's /proc), else the first call's time."""
  try:
    with open('/proc/self/stat') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # field 22, starttime
    with open('/proc/stat') as f:
      boot = next(int(line.split()[1]) for line in f if line.startswith('btime'))
    return boot + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, StopIteration):
    return _IMPORTED


_IMPORTED = time.time()


class Clock:
  """Wall time since `start`, each moment in one bucket; `parts()` always sums to now - start."""

  def __init__(self, start: float, bucket: str = 'startup'):
    self.start, self.bucket, self._since = start, bucket, start
    self._parts = dict.fromkeys(BUCKETS, 0.0)

  def switch(self, bucket: str) -> str:
    """From now on the time goes to `bucket`; returns the bucket it went to until now."""
    now = time.time()
    self._parts[self.bucket] += now - self._since
    self._since, previous, self.bucket = now, self.bucket, bucket
    return previous

  @contextlib.contextmanager
  def phase(self, bucket: str) -> Iterator[None]:
    """The block's time goes to `bucket`, then the clock returns to the bucket it was in."""
    previous = self.switch(bucket)
    try:
      yield
    finally:
      self.switch(previous)

  def read(self) -> tuple[float, dict[str, float]]:
    """(now, each bucket's seconds up to now)."""
    self.switch(self.bucket)
    return self._since, dict(self._parts)


class Ledger:
  """The parts of a run's wall time, from its goodput records fed in order (`add`)."""

  def __init__(self):
    self.totals = dict.fromkeys(PARTS, 0.0)
    self.lost_steps = 0
    self.attempts = 0
    self.first_start: float | None = None
    self._last: dict | None = None
    self._kept: list[tuple[int, bool, dict[str, float]]] = []  # (step, a step?, losable parts)

  def add(self, record: dict) -> None:
    last, parts = self._last, record['parts']
    if last is None or record['attempt'] != last['attempt']:
      if last is None:
        self.first_start = record['process_start']
      else:
        self.totals['restart'] += record['process_start'] - last['time']
      self.attempts += 1
      before = dict.fromkeys(BUCKETS, 0.0)
    else:
      before = last['parts']
    delta = {b: parts.get(b, 0.0) - before.get(b, 0.0) for b in BUCKETS}
    if self.attempts > 1:  # a later attempt's start-up is a restart's cost
      delta['restart'] += delta.pop('startup')
    while self._kept and self._kept[-1][0] > record['step']:
      _, was_step, gone = self._kept.pop()
      self.lost_steps += was_step
      for bucket, seconds in gone.items():
        self.totals[_PART_OF.get(bucket, bucket)] -= seconds
        self.totals['lost'] += seconds
    losable = {b: delta[b] for b in _LOSABLE}
    self._kept.append((record['step'], record.get('kind') == 'step', losable))
    for bucket, seconds in delta.items():
      self.totals[_PART_OF.get(bucket, bucket)] += seconds
    self._last = record

  @property
  def wall(self) -> float:
    """Seconds from the first attempt's process start to the last record."""
    return 0.0 if self._last is None else self._last['time'] - self.first_start

  def metrics(self) -> dict[str, float]:
    """The split as metrics.jsonl keys: goodput (productive / wall), goodput_PART_s, lost steps."""
    record = {'goodput': self.totals['productive'] / self.wall if self.wall > 0 else 0.0}
    record.update({f'goodput_{part}_s': self.totals[part] for part in PARTS})
    record['goodput_wall_s'] = self.wall
    record['goodput_lost_steps'] = self.lost_steps
    return record


def read(workdir: str) -> list[dict]:
  """The workdir's goodput records (a line cut short by a kill ends them); [] if none."""
  path = workdir_lib.path(workdir, workdir_lib.GOODPUT)
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return records


def ledger(workdir: str) -> Ledger:
  """The ledger of every record DIR/goodput.jsonl holds.

  Raises:
    ConfigError('--workdir', ...): DIR is not a workdir, or no run has recorded time there.
  """
  if not os.path.isdir(workdir):
    raise ConfigError('--workdir', f'{workdir} is not a directory; give a train --workdir')
  records = read(workdir)
  if not records:
    found = os.path.isfile(workdir_lib.path(workdir, workdir_lib.CONFIG))
    why = 'no run has recorded its time there yet' if found else 'it is not a triax workdir'
    raise ConfigError(
      '--workdir', f'{workdir} has no {workdir_lib.GOODPUT}: {why} (train writes it)'
    )
  result = Ledger()
  for record in records:
    result.add(record)
  return result


class Timeline:
  """The running process's clock, its records (process 0 writes them) and the run's ledger.

  Built once the run knows the step it starts from; `record` after the start, every step
  and a rollback. Every process keeps a clock (stragglers read it); only `enabled` writes.
  """

  def __init__(self, workdir: str, enabled: bool):
    self.path = workdir_lib.path(workdir, workdir_lib.GOODPUT)
    self.enabled = enabled
    self.clock = Clock(process_start())
    self.attempt = f'{os.uname().nodename}:{os.getpid()}:{self.clock.start:.3f}'
    self.ledger = ledger(workdir) if enabled and read(workdir) else Ledger()

  def phase(self, bucket: str):
    return self.clock.phase(bucket)

  def record(self, step: int, kind: str) -> None:
    """Appends the clock's reading at `step` (`kind`: start, step or rollback)."""
    if not self.enabled:
      return
    now, parts = self.clock.read()
    record = {
      'attempt': self.attempt,
      'process_start': self.clock.start,
      'time': now,
      'step': step,
      'kind': kind,
      'parts': parts,
    }
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')  # one write: a kill leaves at most a partial last line
    self.ledger.add(record)
