"""Re-planning for an elastic restart: a layout of the run for the devices left.

`replan` keeps context x tensor x pipe and shrinks the data degree, with
d/d' times the micro-batches so the global batch and the token order stay
(`shrunk`); where that does not divide, the valid layout nearest the old one,
or with a cluster spec the planner's cheapest (`searched`). `overrides` gives
the keys that run the config on a layout (triax.layout.flags makes them the
train command's `--config.*` flags). Plain Python over config and the
planner's layout search: no processes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from triax import config as config_lib
from triax.errors import ConfigError
from triax.layout import Layout
from triax.plan.search import layouts as layouts_lib


def describe(layout: Layout) -> str:
  parts = [f'data {layout.data}', f'tensor {layout.tensor}', f'pipe {layout.pipe}']
  if layout.context > 1:
    parts.insert(1, f'context {layout.context}')
  if layout.expert > 1:
    parts[0] += f' (expert {layout.expert})'
  return (
    ' x '.join(parts) + f' ({layout.schedule}, m={layout.microbatches}, v={layout.virtual_stages})'
  )


def overrides(cfg, layout: Layout) -> dict[str, Any]:
  """The config keys that run `cfg` on `layout`: its sizes and what it changes
  (`Layout.overrides`), and the placement keys of the old device count reset
  (device order, DCN factors, an uneven layer split: each was written for the
  mesh that is gone)."""
  out = layout.overrides(cfg)
  if tuple(cfg.mesh.device_order):
    out['mesh.device_order'] = ()
  for axis in config_lib.MESH_AXES:
    if cfg.mesh[f'dcn_{axis}'] != 1:
      out[f'mesh.dcn_{axis}'] = 1
  if tuple(cfg.pipeline.layers_per_stage):
    out['pipeline.layers_per_stage'] = ()
  return out


def fits(cfg, layout: Layout, devices: int) -> bool:
  """Whether the config validator accepts `cfg` on `layout` over `devices` devices."""
  import ml_collections

  new = ml_collections.ConfigDict(cfg.to_dict())
  for key, value in overrides(cfg, layout).items():
    group, name = key.split('.')
    new[group][name] = value
  try:
    config_lib.validate(new, devices)
  except (ConfigError, ValueError):
    return False
  return True


def shrunk(cfg, devices: int) -> Layout | None:
  """The same context x tensor x pipe with the data degree `devices` leave, and
  as many more micro-batches as keep each one's rows: None if that does not
  divide or validate (a MoE model's expert degree kept: it must divide the new
  data degree)."""
  old = Layout.from_config(cfg)
  rest = old.context * old.tensor * old.pipe
  if devices % rest:
    return None
  data = devices // rest
  if (old.data * old.microbatches) % data or data % old.expert:
    return None
  layout = dataclasses.replace(old, data=data, microbatches=old.data * old.microbatches // data)
  return layout if fits(cfg, layout, devices) else None


def nearness(old: Layout, new: Layout) -> tuple:
  """Sort key: the layout that changes least first: fewest axes of context, tensor and
  pipe moved, and by the smallest factors; then schedule, v, the expert degree and
  micro-batch rows kept."""
  axes = ('context', 'tensor', 'pipe')
  moved = sum(getattr(old, a) != getattr(new, a) for a in axes)
  factors = sum(abs(math.log(getattr(new, a) / getattr(old, a))) for a in axes)
  rows = abs(math.log((old.data * old.microbatches) / (new.data * new.microbatches)))
  return (
    moved,
    round(factors, 9),
    new.schedule != old.schedule,
    new.virtual_stages != old.virtual_stages,
    round(abs(math.log(new.expert / old.expert)), 9),  # the expert degree nearest the old
    round(rows, 9),
    -new.data,
  )


def searched(cfg, devices: int, cluster=None, budget_s: float = 30.0) -> tuple[Layout, str] | None:
  """The planner's choice among the layouts of `devices` devices: the fastest it
  prices (analytic profile) on `cluster` resized to them, within `budget_s`
  seconds; without a cluster, the nearest to the old layout. Candidates are
  tried nearest first, so a search cut short has priced the likeliest."""
  old = Layout.from_config(cfg)
  candidates = sorted(layouts_lib.layouts(cfg, devices), key=lambda l: nearness(old, l))
  if cluster is not None:
    best = _fastest(cfg, devices, cluster, candidates, budget_s)
    if best is not None and fits(cfg, best, devices):
      return best, 'planner search'
  nearest = next((l for l in candidates if fits(cfg, l, devices)), None)
  return None if nearest is None else (nearest, 'nearest valid layout')


def _fastest(cfg, devices, cluster, candidates, budget_s) -> Layout | None:
  from triax.plan import cluster as cluster_lib
  from triax.plan.candidate import Options as SimulatorOptions
  from triax.plan.cost import analytic
  from triax.plan.search import evaluate

  try:
    sized = cluster_lib.resize(cluster, devices)
  except ConfigError:
    return None  # its nodes cannot make this count: the nearest layout instead
  profile = analytic.build(cfg.model, sorted({l.tensor for l in candidates}))
  deadline = time.monotonic() + budget_s
  found = []
  for layout in candidates:
    found += evaluate.evaluate(cfg, sized, profile, SimulatorOptions(), [layout])
    if time.monotonic() > deadline:
      break
  top = evaluate.top_plans(cfg, found, 1, devices)
  return top[0].plan.layout if top else None


def replan(cfg, devices: int, cluster=None, budget_s: float = 30.0) -> tuple[Layout, str] | None:
  """A layout of `devices` devices for the run of `cfg`, and how it was chosen."""
  layout = shrunk(cfg, devices)
  if layout is not None:
    return layout, 'same tensor x pipe, smaller data degree'
  return searched(cfg, devices, cluster, budget_s)
