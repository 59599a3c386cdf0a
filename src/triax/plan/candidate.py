"""What the planner chooses and what it predicts: `Plan`, `Options`, `Estimate`.

A `Plan` is a parallel layout (`triax.layout.Layout`: the degrees, sequence
parallelism, the context attention kind, the schedule, micro-batches and
virtual stages) placed: remat, which cluster devices form each pipeline
stage and how many layers each stage holds, and how the training state is
split over `data` (`STATE_SHARDINGS`); plan/cost/simulator.py turns it into an
`Estimate` under `Options`. `program` is a plan's lowered schedule (cached:
the search asks for the same ones often).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

from triax import layout as layout_lib
from triax.config import EDGE_GRADS
from triax.layout import Layout
from triax.model import registry
from triax.pipeline import rounds, simulate
from triax.pipeline import schedule as sched

MODELS = ('lockstep', 'async')
DP_ALLREDUCE = ('per_microbatch', 'per_step')
# How the training state is split over `data` (README, "Sharding the training
# state"): 'replicated' (every replica holds it whole); 'zero1' (Adam's moments
# split, train.optimizer_sharding=data); 'fsdp' (parameters and moments split
# along d_model, mesh.fsdp: ZeRO-3).
STATE_SHARDINGS = ('replicated', 'zero1', 'fsdp')


@dataclasses.dataclass(frozen=True)
class Plan:
  """One candidate parallel layout, placed.

  A plan reads as its layout too: plan.tensor is plan.layout.tensor (each
  field of Layout), so the cost functions take a Plan or a bare Layout alike.

  Attributes:
    layout: the degrees (data x context x tensor x pipe is the device
      count), sequence parallelism, context attention, expert degree, and
      the schedule with m micro-batches and v virtual stages; its schedule
      may be a name `given_schedule` gave a schedule no builder makes (a
      synthesised one).
    remat: 'none', 'attention', 'dots' or 'full' (config.REMAT_POLICIES).
    layers: layers per pipeline stage (p entries, each a multiple of v:
      a stage's chunks are equal).
    stages: per pipeline stage, the cluster device indices of its
      data x context x tensor devices, row-major as the mesh orders them:
      data replica i, context rank k, tensor rank j at devices[(i*c + k)*t + j]
      (so each tensor group is t consecutive devices).
    global_batch: sequences per step.
    state_sharding: a key of STATE_SHARDINGS; not 'replicated' needs data > 1.
      Like remat, a choice the searches make per layout, not a degree.
    tick_packing: pipeline.tick_packing, how the executor's lockstep
      program packs ticks under remat (rounds.py).
  """

  layout: Layout
  remat: str
  layers: tuple[int, ...]
  stages: tuple[tuple[int, ...], ...]
  global_batch: int
  state_sharding: str = 'replicated'
  tick_packing: str = 'auto'

  def __getattr__(self, name: str):
    # Only the layout's fields: any other name (pickle's probes before
    # `layout` is set, a typo) stays an AttributeError.
    if name in layout_lib.FIELDS:
      return getattr(self.layout, name)
    raise AttributeError(f'{type(self).__name__!r} object has no attribute {name!r}')

  def __post_init__(self):
    p, v = self.pipe, self.virtual_stages
    if len(self.layers) != p or len(self.stages) != p:
      raise ValueError(
        f'want {p} layer counts and {p} stage device lists, got '
        f'{self.layers} and {len(self.stages)}'
      )
    if any(n < v or n % v for n in self.layers):
      raise ValueError(f'each stage needs a positive multiple of v={v} layers: {self.layers}')
    size = self.data * self.context * self.tensor
    if any(len(s) != size for s in self.stages):
      raise ValueError(f'each stage needs data*context*tensor={size} devices')
    if self.global_batch % (self.data * self.microbatches):
      raise ValueError(
        f'global batch {self.global_batch} does not split into '
        f'data*microbatches = {self.data}*{self.microbatches}'
      )
    if self.state_sharding not in STATE_SHARDINGS:
      raise ValueError(f'state_sharding must be one of {STATE_SHARDINGS}: {self.state_sharding!r}')
    if self.state_sharding != 'replicated' and self.data == 1:
      raise ValueError(f'state_sharding={self.state_sharding} splits over data, which is 1')

  @property
  def microbatch_size(self) -> int:
    """Sequences per micro-batch per data replica (a device computes 1/context
    of each one's positions)."""
    return self.global_batch // (self.data * self.microbatches)

  @property
  def compute_batch(self) -> float:
    """Sequences' worth of work one device does per micro-batch: the
    micro-batch over the context degree. A context rank holds s/c positions
    of each sequence, and its attention (s/c queries over all s keys) is 1/c
    of the sequence's too, so it computes what data parallelism's device of
    b/c whole sequences would (fractional where c > b)."""
    return self.microbatch_size / self.context

  def tensor_groups(self, stage: int) -> list[tuple[int, ...]]:
    """The stage's tensor-parallel groups: t consecutive devices each."""
    devs, t = self.stages[stage], self.tensor
    return [devs[g * t : (g + 1) * t] for g in range(len(devs) // t)]

  def gradient_groups(self, stage: int) -> list[tuple[int, ...]]:
    """Per tensor rank, the stage's devices that hold the same weights and
    reduce their gradients together: data x context (context ranks see other
    positions of the same sequences, as data replicas see other sequences)."""
    devs, t = self.stages[stage], self.tensor
    return [devs[j::t] for j in range(t)]

  def data_groups(self, stage: int) -> list[tuple[int, ...]]:
    """Per (context rank, tensor rank), the stage's data replicas: what a
    ZeRO / FSDP state is split over (mesh.fsdp's rule names `data` only)."""
    devs, ct = self.stages[stage], self.context * self.tensor
    return [devs[r::ct] for r in range(ct)]

  def expert_groups(self, stage: int) -> list[tuple[int, ...]]:
    """Per (outer data index, context rank, tensor rank), the `expert`
    consecutive data replicas one MoE all-to-all runs over (mesh.build_mesh
    carves the expert axis from the inner part of data)."""
    devs, ct, e = self.stages[stage], self.context * self.tensor, self.expert
    return [
      devs[g * e * ct + r : (g + 1) * e * ct : ct] for g in range(self.data // e) for r in range(ct)
    ]

  def context_groups(self, stage: int) -> list[tuple[int, ...]]:
    """Per (data replica, tensor rank), the c devices of one context ring, in rank order."""
    devs, t, ct = self.stages[stage], self.tensor, self.context * self.tensor
    return [devs[i * ct + j : (i + 1) * ct : t] for i in range(self.data) for j in range(t)]

  @property
  def num_layers(self) -> int:
    return sum(self.layers)

  @property
  def placement(self) -> tuple[int, ...]:
    """placement[c]: the stage holding chunk c, as the schedule places it."""
    return program(
      self.schedule, self.pipe, self.microbatches, self.virtual_stages
    ).schedule.placement

  @property
  def lowered(self) -> sched.Program:
    """The lockstep program the executor runs for this plan."""
    units = rounds.units_for(self.remat, self.tick_packing)
    return program(self.schedule, self.pipe, self.microbatches, self.virtual_stages, units)

  @property
  def chunk_layers(self) -> tuple[int, ...]:
    """Layers of each model chunk in chunk order (a stage's chunks are equal)."""
    return tuple(self.layers[s] // self.virtual_stages for s in self.placement)

  @property
  def even(self) -> bool:
    return len(set(self.layers)) == 1

  @property
  def uses_executor(self) -> bool:
    """Whether the step runs the pipeline executor (else one value_and_grad)."""
    return self.pipe > 1 or self.microbatches > 1

  @property
  def fsdp_per_layer(self) -> bool:
    """FSDP gathering each layer where the layer scan uses it (no executor);
    the executor gathers a stage's weights once, before its tick loop."""
    return self.state_sharding == 'fsdp' and not self.uses_executor

  @property
  def devices(self) -> tuple[int, ...]:
    return tuple(d for stage in self.stages for d in stage)

  def describe(self) -> str:
    split = '' if self.even else ' layers=' + '/'.join(map(str, self.layers))
    state = '' if self.state_sharding == 'replicated' else f' {self.state_sharding}'
    # Context and SP are named only when used: plans without them read as before.
    context = f' c{self.context}' if self.context > 1 else ''
    kind = f' {self.context_attention}' if self.context > 1 else ''
    sp = ' sp' if self.sequence_parallel else ''
    expert = f' e{self.expert}' if self.expert > 1 else ''
    return (
      f'd{self.data}{expert}{context} t{self.tensor}{sp} p{self.pipe} {self.schedule} m={self.microbatches}'
      f' v={self.virtual_stages} mb={self.microbatch_size} remat={self.remat}{split}{state}{kind}'
    )


@dataclasses.dataclass(frozen=True)
class Estimate:
  """What the simulator predicts for one plan (seconds, bytes).

  Attributes:
    plan: the plan.
    step_time: the predicted step time under `model`.
    model: 'lockstep' or 'async'.
    lockstep_time, async_time: step time under each model.
    pipeline_time: the schedule's part of step_time (under `model`).
    bubble_fraction: of the lockstep (or async) pipeline.
    tail_time: after the pipeline: edge-gradient psum over pipe, per-step
      data-parallel all-reduce (if so modelled) and the optimizer.
    dp_allreduce_time: data-parallel all-reduce per step, wherever charged.
    memory: per stage, peak bytes per device: the train step's, or (with
      Options.state_programs) a checkpoint save / restore or evaluation
      beside the resident state, whichever is larger.
    capacity: per stage, the usable bytes of its smallest device.
    oom: True if any stage's memory exceeds its capacity.
    result: the timeline of `model` (a simulate.Result) for traces.
    step_memory: per stage, the train step's peak alone.
    state_memory: per stage, the largest of save / restore / evaluation
      beside the resident state (memory.state_programs).
    memory_parts: per stage, what its memory is made of (memory.parts:
      the training state, pools and work of the step, each state program).
  """

  plan: Plan
  step_time: float
  model: str
  lockstep_time: float
  async_time: float
  pipeline_time: float
  bubble_fraction: float
  tail_time: float
  dp_allreduce_time: float
  memory: tuple[float, ...]
  capacity: tuple[float, ...]
  oom: bool
  result: simulate.Result
  step_memory: tuple[float, ...] = ()
  state_memory: tuple[float, ...] = ()
  memory_parts: tuple[dict[str, float], ...] = ()

  @property
  def peak_memory(self) -> float:
    return max(self.memory)


@dataclasses.dataclass(frozen=True)
class Options:
  """Simulator choices.

  Attributes:
    model: which time model step_time reports ('lockstep' for triax plans).
    dp_allreduce: 'per_step' (accumulate locally, reduce once: triax's
      executor, and the papers' assumption) or 'per_microbatch'.
    memory_fraction: share of a device's memory a plan may use (runtime,
      fragmentation and XLA's own buffers take the rest).
    padded: True = memory as the executor stores uneven splits (every stage
      holds the largest chunk's stack and stash slots); False = each stage
      only its own.
    scatter_gather: pipeline transfers split over the tensor group and
      all-gathered (the executor's pipeline.scatter_gather); False: each
      tensor rank sends the whole activation.
    edge_grads: where the executor makes the embedding's and head's weight
      gradients (its pipeline.edge_grads: auto, loop or after the tick
      loop); 'loop' is Megatron's, for the papers' tables.
    offload_stash: the executor's stash in host memory (its
      pipeline.offload_stash): the device holds one residual set of it, the
      one an F has made or a B or W reads, not the pool.
    offload_optimizer: Adam's moments in host memory between steps (the
      trainer's train.offload_optimizer): the device holds them only for
      the update, after the backward (see memory.memory).
    optimizer_state: bytes of optimizer state per parameter byte, (the
      layers', the embedding's and head's): AdamW's two moments by default;
      train.optimizer's from training/optimizer.state_per_param (Muon's
      momentum, Lion's one moment, Adafactor's factored ones).
    state_programs: memory counts a checkpoint save / restore and the
      evaluation beside the resident state (what triax budget measures), not
      only the train step: a plan that trains must also save and evaluate.
    fsdp_overlap: FSDP's per-layer all-gathers and reduce-scatters (pipe =
      m = 1) run beside the layer computations, as ZeRO-3 prefetches the
      next layer: a layer takes about the longer of its compute and its
      collectives. False (the default): they add, as triax's layer scan
      runs them (each layer's gather inside its own iteration, which
      XLA's default flags do not move into the previous one).
    moe_imbalance: a MoE model's expert load, the busiest expert's tokens
      over the mean (metrics' moe_load_max; 1 = balanced): with the experts
      split (mesh.expert > 1) the device holding the busiest one computes
      longer and every other waits for it (plan/cost/experts.py).
  """

  model: str = 'lockstep'
  dp_allreduce: str = 'per_step'
  memory_fraction: float = 0.9
  padded: bool = True
  scatter_gather: bool = True
  edge_grads: str = 'auto'
  offload_stash: bool = False
  offload_optimizer: bool = False
  optimizer_state: tuple[float, float] = (2.0, 2.0)
  state_programs: bool = True
  fsdp_overlap: bool = False
  moe_imbalance: float = 1.0

  def __post_init__(self):
    if self.model not in MODELS:
      raise ValueError(f'model must be one of {MODELS}, got {self.model!r}')
    if self.edge_grads not in EDGE_GRADS:
      raise ValueError(f'edge_grads must be one of {EDGE_GRADS}, got {self.edge_grads!r}')
    if not self.moe_imbalance >= 1.0:
      raise ValueError(f'moe_imbalance must be >= 1 (1 = balanced), got {self.moe_imbalance!r}')
    if self.dp_allreduce not in DP_ALLREDUCE:
      raise ValueError(f'dp_allreduce must be one of {DP_ALLREDUCE}')


def from_config(cfg) -> Plan:
  """The plan a validated config runs, on devices numbered in mesh order
  (or where its mesh.device_order places them): what the planner predicts
  for a layout it did not choose (`triax plan --evaluate`; scripts compare
  it with what XLA compiles)."""
  m, pipe = cfg.mesh, cfg.pipeline
  layout = Layout.from_config(cfg)
  p, v = layout.pipe, layout.virtual_stages
  if pipe.get('schedule_file'):  # the file's schedule, not the unread name
    schedule = sched.from_config(pipe, p, layout.microbatches, v)
    layout = dataclasses.replace(layout, schedule=given_schedule(schedule))
  if pipe.layers_per_stage:
    chunks = tuple(pipe.layers_per_stage)
    placement = program(layout.schedule, p, layout.microbatches, v).schedule.placement
    layers = tuple(sum(n for n, s in zip(chunks, placement) if s == stage) for stage in range(p))
  else:
    layers = (registry.spec_from_config(cfg.model).stacked_layers // p,) * p
  per_stage = layout.data * layout.context * layout.tensor
  if m.get('device_order'):
    # A plan's placement (search/emit.device_order): mesh position r * p + s,
    # row-major over (data, context, tensor, pipe), is stage s's r-th device.
    order = tuple(m.device_order)
    stages = tuple(tuple(order[r * p + s] for r in range(per_stage)) for s in range(p))
  else:
    stages = tuple(tuple(range(s * per_stage, (s + 1) * per_stage)) for s in range(p))
  if m.fsdp:
    state = 'fsdp'
  else:
    state = 'zero1' if cfg.train.optimizer_sharding == 'data' else 'replicated'
  return Plan(
    layout=layout,
    remat=cfg.model.remat,
    layers=layers,
    stages=stages,
    global_batch=cfg.train.global_batch_size,
    state_sharding=state,
    tick_packing=pipe.tick_packing,
  )


# Schedules no builder makes (a synthesised one, a schedule file's), by the
# name `given_schedule` gave them: a Plan keeps naming its schedule with a
# string, and `program` finds these as it builds the named ones.
_GIVEN: dict[str, sched.Schedule] = {}


def given_schedule(schedule: sched.Schedule) -> str:
  """A name for a schedule no builder makes, for `Plan.schedule`: its own
  name and a digest of its orders, so two different schedules never share one."""
  text = repr(
    (schedule.placement, schedule.stash_cap, [list(map(str, o)) for o in schedule.orders])
  )
  name = f'{schedule.name}-{hashlib.sha1(text.encode()).hexdigest()[:8]}'
  _GIVEN[name] = schedule
  return name


def given(name: str) -> sched.Schedule | None:
  """The schedule `given_schedule` named `name`; None for a builder's name."""
  return _GIVEN.get(name)


@functools.lru_cache(maxsize=4096)
def program(
  name: str, p: int, m: int, v: int, units: rounds.TickUnits | None = None
) -> sched.Program:
  """The lowered schedule, packed by `units` (rounds.py; None: one action a
  tick), cached: the search asks for the same ones often."""
  schedule = _GIVEN.get(name)
  if schedule is None:
    return sched.lower(sched.build(name, p, m, v), units=units)
  if (schedule.stages, schedule.microbatches, schedule.virtual_stages) != (p, m, v):
    raise ValueError(
      f'{name} runs p, m, v = {schedule.stages}, {schedule.microbatches}, '
      f'{schedule.virtual_stages}, not {p}, {m}, {v}'
    )
  return sched.lower(schedule, units=units)
