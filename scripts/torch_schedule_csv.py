"""Writes torch.distributed.pipelining's own schedules as torch's compute-only CSV.

The fixtures tests/data/torch_*.csv were made with this script and
torch 2.13.0+cpu (git cf30153c4c131c8164ee7798e5022d810682e2cb), installed
into a throwaway venv outside the repository (triax never imports torch):

  python3.11 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch
  /tmp/torchenv/bin/python scripts/torch_schedule_csv.py tests/data

They let tests/test_schedule_files.py check `triax.pipeline.files.load`
against files another tool wrote, not only against our own writer.

No process group is started: as torch's own schedule tests do, each
schedule is given stand-in stages that carry only the sizes (stage count,
ranks, rank 0), which is all that building `pipeline_order` reads; every
rank's order is computed on each rank. Multi-stage schedules are written by
their own `_dump_csv(path, 'compute_only')`. Single-stage ones (GPipe, 1F1B)
have no `_dump_csv`, so the multi-stage class's writer is called on them:
it reads nothing but `pipeline_order`. Their orders keep what torch puts in
them (a REDUCE_GRAD after each rank's last backward, no idle cells), so the
fixtures test how the loader treats those too.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase


class _SizesOnlyStage(_PipelineStageBase):
  """A stage with the sizes a schedule reads and no module or process group."""

  def __init__(self, num_stages: int, group_size: int):  # pylint: disable=super-init-not-called
    # The base constructor wants a module and a process group; building the
    # order needs neither.
    self.submod = None
    self.num_stages = num_stages
    self.group_size = group_size
    self.group_rank = 0
    self.group = None

  def _create_grad_recv_info(self, *args, **kwargs):
    return None

  def _prepare_forward_infra(self, n_microbatches):
    pass

  def _prepare_backward_infra(self, n_microbatches):
    pass


# file stem -> (torch schedule class name, ranks p, stages per rank v, micro-batches m)
FIXTURES = {
  'torch_gpipe_p4_m8': ('ScheduleGPipe', 4, 1, 8),
  'torch_1f1b_p4_m8': ('Schedule1F1B', 4, 1, 8),
  'torch_interleaved_1f1b_p4_v2_m8': ('ScheduleInterleaved1F1B', 4, 2, 8),
  'torch_interleaved_1f1b_p4_v2_m6': ('ScheduleInterleaved1F1B', 4, 2, 6),
  'torch_interleaved_zb_p4_v2_m8': ('ScheduleInterleavedZeroBubble', 4, 2, 8),
  'torch_zbv_p4_v2_m8': ('ScheduleZBVZeroBubble', 4, 2, 8),
  'torch_dualpipev_p4_v2_m8': ('ScheduleDualPipeV', 4, 2, 8),
}


def write(stem: str, folder: str) -> str | None:
  """Builds one schedule and writes it; returns the path, or None if this
  torch has no such schedule class."""
  class_name, p, v, m = FIXTURES[stem]
  cls = getattr(schedules, class_name, None)
  if cls is None:
    return None
  path = os.path.join(folder, f'{stem}.csv')
  if issubclass(cls, schedules.PipelineScheduleSingle):
    schedule = cls(_SizesOnlyStage(p, p), m)
    schedules.PipelineScheduleMulti._dump_csv(schedule, path)  # pylint: disable=protected-access
  else:
    schedule = cls([_SizesOnlyStage(p * v, p) for _ in range(v)], m)
    schedule._dump_csv(path, 'compute_only')  # pylint: disable=protected-access
  return path


def main(argv: list[str]) -> int:
  folder = argv[1] if len(argv) > 1 else os.path.join('tests', 'data')
  os.makedirs(folder, exist_ok=True)
  for stem in FIXTURES:
    path = write(stem, folder)
    print(f'wrote {path}' if path else f'skipped {stem}: this torch has no {FIXTURES[stem][0]}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
