"""Metrics of a run: one JSON line per logged step, mirrored to TensorBoard.

Lines are strict JSON (a NaN or Inf is written as null), so any JSON reader
takes them; nothing is pickled. A resumed run cuts both back to the step it
resumes from, so each step is recorded once however often the run stopped.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
import sys

from triax.training import atomic
from triax.training import workdir as workdir_lib

# tensorboardX is imported where events are written or read, not here, and
# through `_tensorboardx`: its package imports torch whenever torch is
# installed (the test extra installs it, and many users' environments hold
# it), a cost in CPU time and memory at every start, for torch tensors triax
# never passes it.


def _tensorboardx():
  """The tensorboardX package, imported without importing torch for it.

  tensorboardX tries `import torch` and carries on without it; a None in
  sys.modules makes that try fail at once. The entry is removed again, so a
  later `import torch` in this process imports it as usual; a process that
  has torch already keeps it and tensorboardX uses it."""
  blocked = 'torch' not in sys.modules
  if blocked:
    sys.modules['torch'] = None
  try:
    import tensorboardX
    import tensorboardX.proto.event_pb2
  finally:
    if blocked:
      del sys.modules['torch']
  return tensorboardX


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


def _event_records(path: str):
  """(raw record, event) for each whole TFRecord of a TensorBoard event file, in order.

  A record is its length (8 bytes, little-endian), a checksum of the length
  (4), the serialized `Event` and a checksum of it (4). Reading stops at the
  first record that is cut short or does not parse (a crash while writing):
  everything after it is suspect.
  """
  event_pb2 = _tensorboardx().proto.event_pb2

  with open(path, 'rb') as f:
    data = f.read()
  offset = 0
  while offset + 12 <= len(data):
    (length,) = struct.unpack_from('<Q', data, offset)
    end = offset + 12 + length + 4
    if end > len(data):
      return
    try:
      event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
    except Exception:  # pylint: disable=broad-except  # protobuf's DecodeError, among others
      return
    yield data[offset:end], event
    offset = end


def _event_files(tb_dir: str) -> list[str]:
  if not os.path.isdir(tb_dir):
    return []
  return [
    os.path.join(tb_dir, name)
    for name in sorted(os.listdir(tb_dir))
    if 'tfevents' in name
    and not name.endswith('.tmp')
    and os.path.isfile(os.path.join(tb_dir, name))
  ]


def cut_events(tb_dir: str, last_step: int) -> None:
  """Drops the events of steps after `last_step` from the event files in `tb_dir`.

  Records kept are copied byte for byte (checksums and all); a file is
  rewritten (to a temporary file, then renamed) only if it loses records.
  """
  for path in _event_files(tb_dir):
    records = list(_event_records(path))
    kept = [raw for raw, event in records if event.step <= last_step]
    if len(kept) == len(records) and sum(map(len, kept)) == os.path.getsize(path):
      continue
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
      f.writelines(kept)
    os.replace(tmp, path)


def _scalars(record: dict) -> dict[str, float]:
  """The record's finite numbers, 'step' aside: what the scalar writers take."""
  return {
    key: value
    for key, value in record.items()
    if key != 'step'
    and isinstance(value, (int, float))
    and not isinstance(value, bool)
    and math.isfinite(value)
  }


class WandbWriter:
  """Mirrors the records to a Weights & Biases run (the optional `wandb` package).

  The run's id is kept in DIR/wandb_run_id, so a resumed run continues the
  same W&B run. W&B's history only moves forward: it ignores a step at or
  below the last one it holds, so after a crash the steps recomputed between
  the checkpoint and the crash keep their first values (resume is exact, so
  they are the same numbers; only timings differ). Offline runs are written
  under DIR/wandb for `wandb sync`.
  """

  def __init__(self, workdir: str, project: str, mode: str, config: dict):
    import wandb  # optional: config validation checked it is installed

    id_path = workdir_lib.path(workdir, workdir_lib.WANDB_RUN_ID)
    if os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip()
    else:
      run_id = secrets.token_hex(6)  # W&B ids are lower-case letters and digits
      atomic.write_text(id_path, run_id + '\n')
    self.run_id = run_id
    self._run = wandb.init(
      project=project,
      id=run_id,
      resume='allow',
      mode=mode,
      dir=workdir,
      name=os.path.basename(os.path.abspath(workdir)),
      config=config,
    )

  def write(self, record: dict) -> None:
    self._run.log(_scalars(record), step=record['step'])

  def close(self) -> None:
    self._run.finish()


class MetricsWriter:
  """Appends to DIR/metrics.jsonl and writes TensorBoard scalars to DIR/tb
  (and to Weights & Biases when a project is given).

  A resumed run (start_step > 0) first cuts both back to start_step: the
  crashed run's later steps will be recomputed. A TensorBoard already
  watching DIR/tb has read those events; `purge_step` tells it to drop them.
  """

  def __init__(
    self,
    workdir: str,
    start_step: int,
    enabled: bool = True,
    *,
    wandb_project: str = '',
    wandb_mode: str = 'online',
    config: dict | None = None,
  ):
    self.enabled = enabled
    self.path = workdir_lib.path(workdir, workdir_lib.METRICS)
    self.tb_dir = workdir_lib.path(workdir, workdir_lib.TENSORBOARD)
    self._lines = JsonLines(self.path, start_step, enabled)
    self._tb = None
    self._wandb = None
    if enabled and wandb_project:
      self._wandb = WandbWriter(workdir, wandb_project, wandb_mode, config or {})
    if enabled:
      cut_events(self.tb_dir, start_step)
      # A file is named for the second it was opened: number them, so a run
      # resumed within that second does not overwrite the last one's file.
      opened = len(_event_files(self.tb_dir))
      self._tb = _tensorboardx().SummaryWriter(
        self.tb_dir,
        purge_step=start_step + 1 if start_step else None,
        filename_suffix=f'.{opened}',
      )

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._lines.write(record)
    step = record['step']
    for key, value in _scalars(record).items():
      self._tb.add_scalar(key, value, step)
    if self._wandb is not None:
      self._wandb.write(record)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()


def read_metrics(workdir: str) -> list[dict]:
  """All records of a workdir's metrics.jsonl (empty if there is none)."""
  path = workdir_lib.path(workdir, workdir_lib.METRICS)
  return _read_lines(path) if os.path.exists(path) else []


def read_scalars(tb_dir: str) -> dict[str, list[tuple[int, float]]]:
  """Every scalar in the event files of `tb_dir`, by tag: (step, value) in the order written."""
  scalars: dict[str, list[tuple[int, float]]] = {}
  for path in _event_files(tb_dir):
    for _, event in _event_records(path):
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars
