"""Reads what an offline Weights & Biases run wrote (for tests of the W&B writer).

wandb 0.31 has no Python reader of its run files, so this follows their
format: a 7-byte file header (':W&B', a 2-byte magic, a version byte), then
LevelDB-log records in 32 KiB blocks, each a 7-byte header (checksum, 2-byte
little-endian length, type: full, first, middle, last) and its data; a
block's tail under 7 bytes is padding. Each whole record is a serialized
`wandb_internal_pb2.Record`.
"""

import glob
import json
import os
import struct

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path):
  with open(path, 'rb') as f:
    data = f.read()
  assert data[:4] == b':W&B', path
  offset, pending = _HEADER, b''
  while offset + _HEADER <= len(data):
    left = _BLOCK - offset % _BLOCK
    if left < _HEADER:
      offset += left
      continue
    length, kind = struct.unpack_from('<HB', data, offset + 4)
    chunk = data[offset + _HEADER : offset + _HEADER + length]
    offset += _HEADER + length
    if kind == _FULL:
      yield chunk
    elif kind == _FIRST:
      pending = chunk
    elif kind == _MIDDLE:
      pending += chunk
    elif kind == _LAST:
      yield pending + chunk
    else:
      return  # zeros past the last record


def history(workdir):
  """(run id, step, {key: value}) of every history row under DIR/wandb, runs in start order."""
  from wandb.proto import wandb_internal_pb2

  rows = []
  for path in sorted(glob.glob(os.path.join(workdir, 'wandb', '*-run-*', 'run-*.wandb'))):
    run_id = os.path.basename(path)[len('run-') : -len('.wandb')]
    for raw in _records(path):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(raw)
      if record.WhichOneof('record_type') != 'history':
        continue
      values = {
        item.key or '/'.join(item.nested_key): json.loads(item.value_json)
        for item in record.history.item
      }
      rows.append((run_id, record.history.step.num, values))
  return rows
