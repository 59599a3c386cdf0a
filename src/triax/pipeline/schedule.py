"""The schedule IR's public face: one import for the IR, builders and lowering.

The pieces live in small modules: `ir` (actions, schedules, placement,
dependencies), `schedules/` (one builder per file and the registry),
`lower` (the lockstep program and its buffer slots), `grid` (the text
grid), `files` (schedules read from and written to files).
"""

from triax.pipeline.grid import format_grid
from triax.pipeline.ir import (
  BACKWARD,
  COMPUTE_KINDS,
  COPY_KINDS,
  EVICT,
  FORWARD,
  KINDS,
  LOAD,
  WEIGHT,
  Action,
  Schedule,
  ScheduleDeadlock,
  copy_issue_points,
  dependencies,
  interleaved_placement,
  v_placement,
  with_split_backward,
)
from triax.pipeline.lower import Program, check_fusable, lower, transfers_per_step
from triax.pipeline.schedules import (
  SCHEDULES,
  bpipe,
  bpipe_stash_cap,
  bpipe_zb,
  build,
  from_config,
  gpipe,
  interleaved_1f1b,
  interleaved_zb,
  one_f_one_b,
  zb_h1,
  zb_v,
)

__all__ = [
  'BACKWARD',
  'COMPUTE_KINDS',
  'COPY_KINDS',
  'EVICT',
  'FORWARD',
  'KINDS',
  'LOAD',
  'WEIGHT',
  'Action',
  'Program',
  'SCHEDULES',
  'Schedule',
  'ScheduleDeadlock',
  'bpipe',
  'bpipe_stash_cap',
  'bpipe_zb',
  'build',
  'check_fusable',
  'copy_issue_points',
  'from_config',
  'dependencies',
  'format_grid',
  'gpipe',
  'interleaved_1f1b',
  'interleaved_placement',
  'interleaved_zb',
  'lower',
  'one_f_one_b',
  'transfers_per_step',
  'v_placement',
  'with_split_backward',
  'zb_h1',
  'zb_v',
]
