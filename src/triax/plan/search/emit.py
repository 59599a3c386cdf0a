"""Writes a plan as a config file that `python -m triax train` runs.

The file holds data only; its `get_config` calls plan/plan_file.py, which
imports the base experiment by path (importlib), so the file follows later
edits of the base, then applies the keys the planner was given on the
command line (`--config.*`) and the plan's own:

  its layout's (`Layout.overrides`: mesh degrees, pipeline.schedule /
  microbatches / virtual_stages, ...), but the keys of the axes plans
  learnt later (`SPARSE_KEYS`: context, SP, the context attention kind,
  the expert degree) only where the plan uses them or the config it
  applies to says otherwise, so a plan without them writes what it wrote
  before they existed; then pipeline.layers_per_stage, model.remat,
  train.global_batch_size, train.optimizer_sharding and mesh.fsdp (the
  plan's state_sharding: replicated, zero1 = optimizer_sharding 'data',
  fsdp = mesh.fsdp)

`pipeline.layers_per_stage` lists the layers of each model chunk in chunk
order (chunk c runs on the stage the schedule's placement names: c % pipe
for Megatron's interleaving, a V for zb_v); an even split writes ().

A plan whose schedule no builder makes (a synthesised one,
plan/search/synthesized.py) holds the schedule itself, as triax's JSON, in
the plan file: `get_config` has it written beside the file (PLAN.schedule.json,
rewritten only when it differs) and sets `pipeline.schedule_file` to it,
the key training reads schedule files from, so the plan reruns exactly
without synthesising again (`pipeline.schedule` is then not read). A
named plan clears a `pipeline.schedule_file` its config had.
"""

from __future__ import annotations

import atexit
import datetime
import os
import shutil
import tempfile
from typing import Any

from triax import config as config_lib
from triax.layout import Layout
from triax.pipeline import files
from triax.plan.candidate import Estimate, Plan, given

LAYERS_KEY = 'pipeline.layers_per_stage'
SCHEDULE_FILE_KEY = 'pipeline.schedule_file'
# Plan.state_sharding -> (train.optimizer_sharding, mesh.fsdp).
STATE_KEYS = {
  'replicated': ('replicated', False),
  'zero1': ('data', False),
  'fsdp': ('replicated', True),
}


def device_order(plan: Plan) -> tuple[int, ...]:
  """The plan's placement as `mesh.device_order`: mesh position (i, k, j, s)
  (data replica i, context rank k, tensor rank j, pipeline stage s;
  row-major over config.MESH_AXES) holds the cluster's device
  stages[s][(i * context + k) * tensor + j], which is Plan.stages' own
  order. Cluster device k is jax.devices()[k] on the run (the cluster spec
  lists devices in that order)."""
  per_stage = plan.data * plan.context * plan.tensor
  return tuple(plan.stages[s][r] for r in range(per_stage) for s in range(plan.pipe))


# Context and sequence parallelism's keys; with the expert degree's, the keys
# a plan writes only where needed (`_layout_keys`).
SEQUENCE_KEYS = ('mesh.context', 'mesh.sequence_parallel', 'model.context_attention')
SPARSE_KEYS = (*SEQUENCE_KEYS, 'mesh.expert')
SCHEDULE_KEY = 'pipeline.schedule'


def _layout_keys(layout: Layout, cfg=None) -> dict[str, Any]:
  """The layout's keys; of SPARSE_KEYS only those whose value differs from
  the default or from cfg's (the config the plan is applied to), and
  model.context_attention only with context > 1 (it says nothing without)."""
  bases = [config_lib.defaults()] + ([] if cfg is None else [cfg])
  out = {}
  for key, value in layout.overrides().items():
    if key == 'model.context_attention' and layout.context == 1:
      continue
    if key in SPARSE_KEYS and all(_dotted(c, key) == value for c in bases):
      continue
    out[key] = value
  return out


def _dotted(cfg, key: str):
  for part in key.split('.'):
    cfg = cfg[part]
  return cfg


def device_ranges(devices) -> str:
  """Device indices as ranges, '0-7,16-23': a stage of a large cluster in one line."""
  out, start, prev = [], None, None
  for d in devices:
    if start is not None and d == prev + 1:
      prev = d
      continue
    if start is not None:
      out.append(f'{start}-{prev}' if prev > start else f'{start}')
    start = prev = d
  if start is not None:
    out.append(f'{start}-{prev}' if prev > start else f'{start}')
  return ','.join(out)


def overrides(plan: Plan, heterogeneous: bool = False, cfg=None) -> dict[str, Any]:
  """The dotted config keys a plan sets, with their values. On a cluster
  of mixed device types the placement matters, so it is written as
  mesh.device_order; otherwise the mesh keeps its own topology-aware order.
  cfg: the config the keys will be applied to (see `_layout_keys`)."""
  layout = _layout_keys(plan.layout, cfg)
  sparse = {key: layout.pop(key) for key in SPARSE_KEYS if key in layout}
  values = {}
  for key, value in layout.items():
    values.update(_schedule_keys(plan, cfg) if key == SCHEDULE_KEY else {key: value})
  values.update(
    {
      LAYERS_KEY: () if plan.even else tuple(plan.chunk_layers),
      'model.remat': plan.remat,
      'train.global_batch_size': plan.global_batch,
      'train.optimizer_sharding': STATE_KEYS[plan.state_sharding][0],
      'mesh.fsdp': STATE_KEYS[plan.state_sharding][1],
      **sparse,  # last, where plans have always written them
    }
  )
  if heterogeneous:
    values['mesh.device_order'] = device_order(plan)
  return values


def _schedule_keys(plan: Plan, cfg=None) -> dict[str, Any]:
  """pipeline.schedule, or for a schedule no builder makes pipeline.schedule_file
  (`scratch_file`'s); a named plan clears a schedule file cfg names."""
  path = scratch_file(plan)
  if path is not None:
    return {SCHEDULE_FILE_KEY: path}
  if cfg is not None and cfg.pipeline.get('schedule_file'):
    return {SCHEDULE_KEY: plan.schedule, SCHEDULE_FILE_KEY: ''}
  return {SCHEDULE_KEY: plan.schedule}


_SCRATCH: list[str] = []


def scratch_file(plan: Plan) -> str | None:
  """For a plan whose schedule no builder makes, that schedule as triax's
  JSON in this process's scratch folder (what the config validator reads
  while the search checks the plan); None for a named schedule."""
  schedule = given(plan.schedule)
  if schedule is None:
    return None
  if not _SCRATCH:
    _SCRATCH.append(tempfile.mkdtemp(prefix='triax-plan-'))
    atexit.register(shutil.rmtree, _SCRATCH[0], ignore_errors=True)
  path = os.path.join(_SCRATCH[0], f'{plan.schedule}.json')
  if not os.path.exists(path):
    files.write_json(schedule, path)
  return path


def apply(cfg, values: dict[str, Any]):
  """Sets dotted keys on a ConfigDict in place and returns it."""
  for key, value in values.items():
    config_lib.set_dotted(cfg, key, value)
  return cfg


def write(
  path: str,
  estimate: Estimate,
  base_path: str,
  base_arg: str | None,
  base_overrides: dict[str, Any],
  cluster_name: str,
  command: str = '',
  heterogeneous: bool = False,
  run: str = '',
  base_cfg=None,
) -> str:
  """Writes the plan file; returns its text.

  Args:
    path: the .py file to write.
    estimate: the chosen plan and its prediction.
    base_path: the experiment file the planner loaded (FILE of FILE[:ARG]).
    base_arg: its ARG, or None.
    base_overrides: dotted keys the planner's config had beyond the base
      file's (the --config.* flags), written into the plan.
    cluster_name: for the docstring.
    command: the planner command line, for the docstring.
    heterogeneous: the cluster mixes device types: write mesh.device_order.
    run: the command that trains the plan (default: triax train on it).
    base_cfg: the planner's config (BASE with base_overrides): a
      context / sequence-parallel key it sets otherwise is written too.
  """
  plan = estimate.plan
  folder = os.path.dirname(os.path.abspath(path))
  base_abs = os.path.abspath(base_path)
  base_rel = os.path.relpath(base_abs, folder)
  run = run or f'python -m triax train --config={path} --workdir=DIR'
  gb = estimate.peak_memory / 2**30
  stages = '\n'.join(
    f'  stage {s}: devices {device_ranges(devs)}, {plan.layers[s]} layers'
    for s, devs in enumerate(plan.stages)
  )
  plan_values = overrides(plan, heterogeneous, base_cfg)
  schedule = _beside(plan, path)
  if schedule:  # get_config points pipeline.schedule_file at the copy beside it
    plan_values.pop(SCHEDULE_FILE_KEY)
  origin = f' ({command})' if command else ''
  placement = (
    "placed by PLAN's mesh.device_order"
    if heterogeneous
    else 'one device type: the mesh keeps its own order'
  )
  schedule_args = ', SCHEDULE_FILE, SCHEDULE' if schedule else ''
  text = f'''"""Plan for cluster {cluster_name}: {plan.describe()}.

Written by `python -m triax plan` on {datetime.date.today().isoformat()}{origin}.
Predicted by the simulator ({estimate.model} model; a prediction, not a
measurement): step {estimate.step_time * 1e3:.2f} ms, peak {gb:.2f} GiB per device.
Run it:

  {run}

Pipeline stages and the cluster devices the prediction assumes for them
(cluster device k is jax.devices()[k]; {placement}):
{stages}
"""

from triax.plan import plan_file

# The base experiment, relative to this file (used while both stay put) and
# absolute (used when this file was moved without it), and its config argument.
BASE = {base_rel!r}
BASE_ABSOLUTE = {base_abs!r}
BASE_ARG = {base_arg!r}
# Keys the planner's config set beyond BASE (its --config.* flags).
BASE_OVERRIDES = {_literal(base_overrides)}
# The plan.
PLAN = {_literal(plan_values)}{_schedule_text(schedule, path)}


def get_config(arg=None):
  return plan_file.config(
    __file__, BASE, BASE_ABSOLUTE, BASE_ARG, BASE_OVERRIDES, PLAN, arg{schedule_args}
  )
'''
  with open(path, 'w') as f:
    f.write(text)
  return text


def _beside(plan: Plan, path: str) -> str:
  """For a schedule no builder makes: writes it beside the plan file as
  triax's JSON and returns that text (what the plan file holds); else ''."""
  schedule = given(plan.schedule)
  if schedule is None:
    return ''
  beside = _schedule_path(path)
  files.write_json(schedule, beside)
  with open(beside, encoding='utf-8') as f:
    return f.read()


def _schedule_path(path: str) -> str:
  return os.path.splitext(os.path.abspath(path))[0] + '.schedule.json'


def _schedule_text(schedule: str, path: str) -> str:
  """The plan file's SCHEDULE (triax's JSON of a synthesised schedule); '' if none."""
  if not schedule:
    return ''
  assert "'''" not in schedule and '\\' not in schedule  # JSON of action names only
  return (
    "\n\n# The plan's schedule, synthesised (no builder makes it), as triax's JSON: get_config\n"
    f'# writes it to SCHEDULE_FILE beside this file and trains it from there.\n'
    f'SCHEDULE_FILE = {os.path.basename(_schedule_path(path))!r}\n'
    f"SCHEDULE = r'''{schedule}'''"
  )


def _literal(values: dict[str, Any]) -> str:
  if not values:
    return '{}'
  lines = ''.join(f'\n    {k!r}: {v!r},' for k, v in values.items())
  return '{' + lines + '\n}'
