"""Metrics of a run: one JSON line per logged step, mirrored to TensorBoard."""

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


class MetricsWriter:
  """Appends to DIR/metrics.jsonl and writes TensorBoard scalars to DIR/tb.

  A resumed run first drops the lines of steps after the one it resumes
  from (they were computed by the crashed run and will be recomputed), so
  the file always reads as one uninterrupted run.
  """

  def __init__(self, workdir: str, start_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.tb_dir = os.path.join(workdir, 'tb')
    self._tb = None
    if not enabled:
      return
    if os.path.exists(self.path):
      kept = [r for r in _read_lines(self.path) if r.get('step', 0) <= start_step]
      tmp = self.path + '.tmp'
      with open(tmp, 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in kept)
      os.replace(tmp, self.path)
    self._tb = SummaryWriter(self.tb_dir)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    with open(self.path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    step = record['step']
    for key, value in record.items():
      if key != 'step' and isinstance(value, (int, float)) and math.isfinite(value):
        self._tb.add_scalar(key, value, step)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """All records of a workdir's metrics.jsonl (empty if there is none)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  return _read_lines(path) if os.path.exists(path) else []
