"""Metrics of a run: one JSON line per logged step, mirrored to TensorBoard.

Lines are strict JSON (a NaN or Inf is written as null), so any JSON reader
takes them; nothing is pickled.
"""

from __future__ import annotations

import json
import math
import os

from tensorboardX import SummaryWriter


def _read_lines(path: str) -> list[dict]:
  records = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break  # a line cut short by a crash: everything after it is suspect
  return records


def _finite(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite(v) for v in value]
  return value


class JsonLines:
  """An append-only DIR/NAME.jsonl of records with a 'step'.

  A resumed run first drops the lines of steps after the one it resumes
  from (they were computed by the crashed run and will be recomputed), so
  the file always reads as one uninterrupted run.
  """

  def __init__(self, path: str, start_step: int, enabled: bool = True):
    self.path = path
    self.enabled = enabled
    if enabled and os.path.exists(path):
      kept = [r for r in _read_lines(path) if r.get('step', 0) <= start_step]
      tmp = path + '.tmp'
      with open(tmp, 'w') as f:
        f.writelines(json.dumps(r, allow_nan=False) + '\n' for r in kept)
      os.replace(tmp, path)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    line = json.dumps(_finite(record), allow_nan=False) + '\n'
    with open(self.path, 'a') as f:
      f.write(line)  # one write per line: a crash leaves at most one partial last line


class MetricsWriter:
  """Appends to DIR/metrics.jsonl and writes TensorBoard scalars to DIR/tb."""

  def __init__(self, workdir: str, start_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.tb_dir = os.path.join(workdir, 'tb')
    self._lines = JsonLines(self.path, start_step, enabled)
    self._tb = SummaryWriter(self.tb_dir) if enabled else None

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._lines.write(record)
    step = record['step']
    for key, value in record.items():
      if (
        key != 'step'
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
      ):
        self._tb.add_scalar(key, value, step)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """All records of a workdir's metrics.jsonl (empty if there is none)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  return _read_lines(path) if os.path.exists(path) else []
