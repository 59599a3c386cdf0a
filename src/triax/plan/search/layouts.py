"""The layouts a search may try: degrees and schedule sizes the config validator accepts.

A `Layout` (triax/layout.py) is data x context x tensor x pipe (their
product the device count), sequence parallelism and the context attention
kind, micro-batches m, virtual stages v, the schedule and a MoE model's
expert degree (carved from data): everything of a plan but its devices,
layer split, remat and state sharding. A family whose spec refuses the pipeline executor
(`executor_refusal`: the MoE family's, today) gets pipe = m = 1 layouts
only. Which degrees suit the model is decided by config.py's own checks
(`check_tensor_split`, `check_sequence`, `check_batch_split`, the family's
validate for its K/V heads and its experts), called for every degree
tried, never re-derived here; what is the planner's own is
said where it is (`MIN_CONTEXT_POSITIONS`, `MAX_MICROBATCHES`, ...). A
model whose stack entry holds several blocks (a MoE family's groups of
model.moe_every) has its layers split in whole entries (`entry_layers`,
the figure config.py's layer-split check counts in).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import ml_collections

from triax import config as config_lib
from triax.errors import ConfigError
from triax.layout import Layout
from triax.model import registry
from triax.pipeline import schedule as sched
from triax.plan.cluster import Cluster
from triax.training import checks as train_checks

# Largest micro-batch count tried: beyond it, ticks cost more than bubbles save.
MAX_MICROBATCHES = 64
MAX_VIRTUAL_STAGES = 4
# Fewest positions a context rank is given: below it a ring pass outlasts the
# block's attention it hides behind and the rank's matmuls thin, while data
# or tensor parallelism would split the work as well (Llama 3 gives each of
# 16 ranks 8k of 128k). It keeps CP off short sequences, where the search
# would only multiply its candidates.
MIN_CONTEXT_POSITIONS = 1024


def entry_layers(cfg) -> int:
  """Layers one entry of the model's stack holds (the family's
  ModelSpec.layers_per_entry, what config.py's layer-split check cuts
  chunks by): every chunk's layer count is a multiple of it."""
  return registry.spec_from_config(cfg.model).layers_per_entry


def stack_layers(cfg) -> int:
  """Layers of the model's stack, what pipeline stages split
  (ModelSpec.stacked_layers): all of them, but the blocks a family's
  embedding runs itself (DeepSeek's first dense ones, the first stage's)."""
  return registry.spec_from_config(cfg.model).stacked_layers


def no_layout(cfg, cluster: Cluster) -> ConfigError:
  """The error for a cluster none of whose layouts suits the model."""
  return ConfigError(
    '--cluster',
    f'{cluster.path}: no data x tensor x pipe layout of {cluster.num_devices} devices suits '
    f'this model (heads {cfg.model.num_heads}, layers {cfg.model.num_layers}, batch '
    f'{cfg.train.global_batch_size}); use --gpus to size the cluster, or another batch',
  )


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def _accepted(cfg, family_defaults, c: int, t: int, sp: bool) -> bool:
  """Whether config.py's checks accept context c, tensor t and SP for the model."""
  mesh = ml_collections.ConfigDict(cfg.mesh.to_dict())
  # The expert degree is tried apart (`_expert_degrees`): the config's own is not the plan's.
  mesh.update(data=1, context=c, tensor=t, pipe=1, sequence_parallel=sp, expert=1)
  try:
    config_lib.check_tensor_split(cfg.model, t)
    config_lib.check_sequence(mesh, cfg.model)
    # The family's own rules for the tensor degree (llama's K/V heads).
    registry.validate(cfg.model, family_defaults, mesh, cfg.sharding.logical_axis_rules)
  except ConfigError:
    return False
  return True


def _batch_splits(cfg, d: int) -> bool:
  """Whether config.py's check accepts the global batch over d replicas."""
  try:
    train_checks.check_batch_split(cfg.train, d, 1)
  except ConfigError:
    return False
  return True


def _degrees(cfg, num_devices: int) -> Iterator[tuple[int, int, int, int, bool, str]]:
  """(d, c, t, p, sequence_parallel, context_attention) the model allows.

  The context attention kind is the config's (model.context_attention):
  trying both would double every context-parallel candidate, and the
  simulator prices either (`simulator.context_seconds`)."""
  model = cfg.model
  family_defaults = config_lib.defaults().model
  accepted = functools.cache(lambda c, t, sp: _accepted(cfg, family_defaults, c, t, sp))
  entry, stacked = entry_layers(cfg), stack_layers(cfg)
  for d in _divisors(num_devices):
    if not _batch_splits(cfg, d):
      continue
    for c in _divisors(num_devices // d):
      if c > 1 and model.seq_len < c * MIN_CONTEXT_POSITIONS:
        continue
      for t in _divisors(num_devices // (d * c)):
        p = num_devices // (d * c * t)
        if p * entry > stacked:  # a stage holds at least one entry
          continue
        for sp in (False, True) if t > 1 else (False,):
          if accepted(c, t, sp):
            yield d, c, t, p, sp, model.context_attention


def _expert_degrees(cfg, data: int) -> list[int]:
  """mesh.expert degrees for `data` data-parallel devices: 1, and for a
  family with experts each divisor of data its validate accepts (it splits
  model.num_experts)."""
  if 'num_experts' not in type(registry.spec_from_config(cfg.model)).config_fields():
    return [1]
  family_defaults = config_lib.defaults().model
  out = []
  for e in _divisors(data):
    mesh = ml_collections.ConfigDict(cfg.mesh.to_dict())
    mesh.update(data=data, context=1, tensor=1, pipe=1, expert=e)
    try:
      registry.validate(cfg.model, family_defaults, mesh, cfg.sharding.logical_axis_rules)
    except ConfigError:
      continue
    out.append(e)
  return out


def layouts(cfg, num_devices: int) -> Iterator[Layout]:
  """Every (d, c, t, p, SP, context attention, schedule, m, v, expert) the
  config validator accepts."""
  model = cfg.model
  batch = cfg.train.global_batch_size
  # The family's own word on the pipeline executor (pipe or m > 1).
  unpipelined = bool(registry.spec_from_config(model).executor_refusal())
  experts = functools.cache(lambda d: _expert_degrees(cfg, d))
  entry, stacked = entry_layers(cfg), stack_layers(cfg)
  for d, c, t, p, sp, kind in _degrees(cfg, num_devices):
    for m in _divisors(batch // d):
      if m > MAX_MICROBATCHES or (p == 1 and m > 1 and m not in (2, 4, 8)):
        continue
      if unpipelined and (p > 1 or m > 1):
        continue
      # One micro-batch or one stage: every schedule runs the same ticks.
      names = ('1f1b',) if p == 1 or m == 1 else tuple(sched.SCHEDULES)
      for name in names:
        for v in (1, 2, 4, 8):
          # Every chunk holds at least one entry.
          if v > MAX_VIRTUAL_STAGES or p * v * entry > stacked or (p == 1 and v > 1):
            continue
          if name == 'interleaved_1f1b' and v == 1:
            continue  # the builder returns 1f1b itself
          if name == 'interleaved_zb' and v == 1:
            continue  # the same orders as zb_h1: one plan shown twice
          if _buildable(name, p, m, v):
            for e in experts(d):
              yield Layout(
                data=d,
                context=c,
                tensor=t,
                pipe=p,
                schedule=name,
                microbatches=m,
                virtual_stages=v,
                sequence_parallel=sp,
                context_attention=kind,
                expert=e,
              )


def profile_sizes(cfg, candidates: Sequence[Layout]) -> tuple[list[int], list[int]]:
  """The tensor degrees and per-replica micro-batch sizes a search over
  `candidates` needs profiled (what the search asks `profile.measure` for)."""
  batch = cfg.train.global_batch_size
  tensors = sorted({l.tensor for l in candidates})
  sizes = sorted({batch // (l.data * l.microbatches) for l in candidates})
  return tensors, sizes


@functools.cache
def _buildable(name: str, p: int, m: int, v: int) -> bool:
  try:
    sched.lower(sched.build(name, p, m, v))
    return True
  except (ConfigError, NotImplementedError, sched.ScheduleDeadlock, ValueError):
    return False
