"""The schedule builders, one file each, and the registry that names them.

Adding a schedule: write `schedules/NAME.py` with a function
`(stages, microbatches, virtual_stages) -> ir.Schedule` and add it to
`SCHEDULES` below; the lowering, executor, validator, simulators, planner
and CLI take it from there.
"""

from __future__ import annotations

from collections.abc import Callable

from triax.errors import ConfigError
from triax.pipeline.ir import Schedule
from triax.pipeline.schedules.bpipe import bpipe, bpipe_stash_cap
from triax.pipeline.schedules.bpipe_zb import bpipe_zb
from triax.pipeline.schedules.dualpipe_v import dualpipe_v
from triax.pipeline.schedules.gpipe import gpipe
from triax.pipeline.schedules.interleaved import interleaved_1f1b
from triax.pipeline.schedules.interleaved_zb import interleaved_zb
from triax.pipeline.schedules.one_f_one_b import one_f_one_b
from triax.pipeline.schedules.v_family import v_half, v_min, v_zb
from triax.pipeline.schedules.zb_h1 import zb_h1
from triax.pipeline.schedules.zb_v import zb_v

SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
  'gpipe': gpipe,
  '1f1b': one_f_one_b,
  'interleaved_1f1b': interleaved_1f1b,
  'bpipe': bpipe,
  'zb_h1': zb_h1,
  'interleaved_zb': interleaved_zb,
  'zb_v': zb_v,
  'v_min': v_min,
  'v_half': v_half,
  'v_zb': v_zb,
  'dualpipe_v': dualpipe_v,
  'bpipe_zb': bpipe_zb,
}


def build(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """Builds the named schedule.

  Raises:
    ConfigError: for an unknown name or sizes the schedule cannot run.
  """
  if name not in SCHEDULES:
    raise ConfigError(
      'pipeline.schedule', f'unknown schedule {name}; choose one of {", ".join(SCHEDULES)}'
    )
  return SCHEDULES[name](stages, microbatches, virtual_stages)


def from_config(pipeline_cfg, stages: int, microbatches: int, virtual_stages: int) -> Schedule:
  """The schedule a config asks for: `pipeline.schedule_file` if set, else by name."""
  path = pipeline_cfg.get('schedule_file', '') if hasattr(pipeline_cfg, 'get') else ''
  if path:
    from triax.pipeline import files  # only configs that name a file need the parsers

    return files.load(path, stages, microbatches, virtual_stages)
  return build(pipeline_cfg.schedule, stages, microbatches, virtual_stages)


__all__ = [
  'from_config',
  'SCHEDULES',
  'build',
  'bpipe',
  'bpipe_stash_cap',
  'bpipe_zb',
  'dualpipe_v',
  'gpipe',
  'interleaved_1f1b',
  'interleaved_zb',
  'one_f_one_b',
  'v_half',
  'v_min',
  'v_zb',
  'zb_h1',
  'zb_v',
]
