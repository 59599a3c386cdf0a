"""Train state, optimizer and the jitted SPMD train / eval steps.

With mesh.pipe == 1 and one micro-batch the gradient comes from one
`value_and_grad` of the model; otherwise from the pipeline executor running
the configured schedule. Either way the optimizer sees the same global
gradient, so clipping and AdamW behave as on one device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from triax import sharding
from triax.errors import ConfigError
from triax.model import context as context_lib
from triax.model import fp8_delayed, fp8_metrics, registry
from triax.model.common import DecoderModel
from triax.pipeline import executor, rounds
from triax.pipeline import layout as layout_lib
from triax.pipeline import schedule as sched
from triax.training import checks as train_checks
from triax.training import optimizer as optimizer_lib
from triax.training import relayout


@dataclasses.dataclass(frozen=True)
class TrainState:
  """The state a step takes and returns, and a checkpoint holds.

  `fp8`: model.fp8=delayed's amax histories ({'layers': {site: [p, v,
  Lmax, 3, H]}}, model/fp8_delayed.py), laid out as the layers' params, or
  None. No optimizer sees them: each step replaces them (`_train_step`).
  As a pytree a None `fp8` is no child at all, so the state of a run
  without delayed has the tree (and checkpoints the items) it had before
  the field."""

  step: jax.Array
  params: Any
  opt_state: Any
  fp8: Any = None

  def replace(self, **changes) -> TrainState:
    return dataclasses.replace(self, **changes)


def _state_children(state: TrainState):
  names = ('step', 'params', 'opt_state') + (() if state.fp8 is None else ('fp8',))
  return [(jax.tree_util.GetAttrKey(n), getattr(state, n)) for n in names], names


jax.tree_util.register_pytree_with_keys(
  TrainState,
  _state_children,
  lambda names, children: TrainState(**dict(zip(names, children))),
)


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  """The learning rate of update k = 0 .. steps-1 (metrics log it at step k+1).

  Every schedule warms up linearly from 0 over train.warmup_steps, then:
  cosine decays to min_lr_ratio * peak (optax's, unchanged, so existing runs
  resume identically; it reaches the end value at k = steps, one past the
  last update); linear and wsd reach min_lr_ratio * peak exactly at the last
  update, linear from the end of warmup, wsd (warmup-stable-decay) after
  holding the peak until its final train.decay_fraction of the steps;
  constant holds the peak.
  """
  peak = train_cfg.learning_rate
  end = peak * train_cfg.min_lr_ratio
  warmup, steps, kind = train_cfg.warmup_steps, train_cfg.steps, train_cfg.lr_schedule
  if kind == 'cosine':
    return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=peak,
      warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1),
      end_value=end,
    )
  ramp = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if kind == 'constant':
    return optax.join_schedules([ramp, optax.constant_schedule(peak)], [warmup])
  if kind == 'linear':
    # A warmup as long as the run leaves nothing to decay: optax's linear
    # schedule with no transition steps stays at its start (the peak).
    decay = optax.linear_schedule(peak, end, steps - 1 - warmup)
    return optax.join_schedules([ramp, decay], [warmup])
  if kind == 'wsd':
    # join_schedules restarts the count at each boundary: the decay's count 0
    # is the stable phase's last update, its count n the run's last update.
    n = train_checks.wsd_decay_steps(train_cfg)
    decay = optax.linear_schedule(peak, end, n)
    return optax.join_schedules(
      [ramp, optax.constant_schedule(peak), decay], [warmup, steps - 1 - n]
    )
  raise ValueError(f'unknown train.lr_schedule {kind!r}')  # validate() names the choices


def split_over(
  named: NamedSharding, shape: tuple[int, ...], axis: str, prefer: int | None = None
) -> NamedSharding:
  """`named` with one more of its unsplit dimensions split over mesh `axis`:
  `prefer` if that one divides by the axis size, else the largest that does;
  as it is when it already uses `axis` or no dimension divides."""
  mesh, spec = named.mesh, tuple(named.spec) + (None,) * (len(shape) - len(named.spec))
  n = mesh.shape[axis]
  used = {a for e in spec for a in ((e,) if isinstance(e, str) else e or ())}
  if n == 1 or axis in used:
    return named
  free = [i for i, e in enumerate(spec) if e is None and shape[i] % n == 0]
  if not free:
    return named  # a small leaf (a norm scale of odd width) stays replicated
  dim = prefer if prefer in free else max(free, key=lambda i: shape[i])
  return NamedSharding(mesh, P(*(spec[:dim] + (axis,) + spec[dim + 1 :])))


def fit_shape(named: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
  """`named` with the splits of the dimensions `shape` does not divide
  dropped (replicated if the ranks differ); itself when every split fits."""
  mesh, spec = named.mesh, tuple(named.spec)
  if len(spec) > len(shape):
    return NamedSharding(mesh, P(), memory_kind=named.memory_kind)
  ways = lambda e: math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ()))
  fitted = tuple(e if n % ways(e) == 0 else None for e, n in zip(spec, shape))
  return named if fitted == spec else NamedSharding(mesh, P(*fitted), memory_kind=named.memory_kind)


def shapes_from_key(init: Callable[[jax.Array], Any]) -> Any:
  """The output shapes of init(key), the key made inside the trace too: an
  eager key lands on the current mesh's devices, and a TPU topology's
  abstract devices (a compile on a CPU host) can hold no array."""
  return jax.eval_shape(lambda: init(jax.random.key(0)))


def pipeline_axes(model_axes: Any) -> Any:
  """Logical axes of parameters in pipeline layout ([stage, virtual, layers, ...])."""
  return {
    **model_axes,
    layout_lib.LAYERS_KEY: jax.tree.map(
      lambda axes: ('stage', 'virtual') + axes,
      model_axes[layout_lib.LAYERS_KEY],
      is_leaf=lambda a: isinstance(a, tuple),
    ),
  }


def _transfer_spec(cfg, mesh: Mesh, act_spec: P) -> P | None:
  """Megatron's scatter/gather split of pipeline transfers, where it applies.

  An activation between layers is replicated over `tensor`; sent whole, each
  of the t tensor ranks would send the same bytes to the next stage. Split
  along the hidden dimension, each sends 1/t and the receiver gathers over
  its fast tensor links (PTD-P, section 4.1).
  """
  t = mesh.shape['tensor']
  used = {a for entry in act_spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
  if not cfg.pipeline.scatter_gather or t == 1 or 'tensor' in used or cfg.model.d_model % t:
    return None
  spec = tuple(act_spec) + (None,) * (3 - len(act_spec))
  return P(spec[0], spec[1], 'tensor')


@dataclasses.dataclass
class Trainer:
  """Everything compiled for one run: shardings, init, train and eval steps."""

  cfg: Any
  mesh: Mesh
  model: DecoderModel
  optimizer: optax.GradientTransformation
  program: sched.Program | None
  layout: layout_lib.StackLayout  # how layers are cut into chunks and stored
  pipeline: executor.PipelineStep | None  # the traced executor (residual sizes)
  state_shardings: Any
  batch_sharding: NamedSharding
  init_state: Callable[[jax.Array], TrainState]
  train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]
  # () -> model.fp8=delayed's histories before the first step (None without delayed)
  init_fp8: Callable[[], Any]
  eval_loss: Callable[[Any, dict], jax.Array]
  # state -> the parameters eval_loss takes (schedule-free's average; else state.params)
  eval_params: Callable[[TrainState], Any]
  # (loss, grads, logged figures) without an update: for parity checks
  loss_and_grad: Callable[[Any, dict], tuple[jax.Array, Any, dict]]
  optimizer_schedule: optax.Schedule
  canonical_shardings: Any  # the state in model layer order (what checkpoints hold)
  to_canonical: relayout.Relayout  # TrainState -> the checkpoint's layout
  from_canonical: relayout.Relayout  # and back

  def abstract_state(self) -> TrainState:
    shapes = shapes_from_key(self.init_state)
    return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      shapes,
      self.state_shardings,
    )

  def abstract_canonical_state(self) -> TrainState:
    shapes = jax.eval_shape(self.to_canonical, self.abstract_state())
    return jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      shapes,
      self.canonical_shardings,
    )


def _ring_transport(cfg, mesh: Mesh) -> str:
  """How ring attention moves its blocks on these devices (context.TRANSPORTS).

  Pipeline stages run a tick's work under a cond each takes on its own
  ticks, and XLA:CPU's collective-permute waits for every device of the
  program, also those of stages on the other branch: there the blocks are
  gathered instead. GPU and TPU pair only the ring's own devices.
  """
  on_cpu = mesh.devices.flat[0].platform == 'cpu'
  return 'allgather' if on_cpu and cfg.mesh.pipe > 1 else 'ppermute'


def build_trainer(cfg, mesh: Mesh) -> Trainer:
  """Builds the model, optimizer, schedule program and jitted steps for `cfg` (validated)."""
  # The sequence split over mesh.context: its slots hold load-balanced positions.
  spec = dataclasses.replace(
    registry.spec_from_config(cfg.model),
    context=cfg.mesh.context,
    ring_transport=_ring_transport(cfg, mesh),
  )
  model = registry.build(spec)
  if cfg.pipeline.offload_stash:
    check_host_memory(mesh.devices.flat[0], 'pipeline.offload_stash')
  rules = sharding.resolve_rules(cfg)
  program, layout = _program_and_layout(cfg, spec)
  axes = pipeline_axes(model.logical_axes())
  optimizer = optimizer_lib.make_optimizer(
    cfg.train, cfg.model, learning_rate_schedule(cfg.train), axes
  )
  param_shardings = sharding.tree_shardings(axes, mesh, rules)

  def init_params(rng):
    return layout.tree_to_pipeline(model.init(rng))

  sites = _fp8_sites(model)

  def init_fp8():
    if sites is None:
      return None
    return layout.tree_to_pipeline(fp8_delayed.init(sites, spec.stack_depth, spec.fp8_amax_history))

  def init_state(rng):
    params = init_params(rng)
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=optimizer.init(params),
      fp8=init_fp8(),
    )

  state_shardings, canonical_shardings = _state_and_canonical_shardings(
    cfg, model, mesh, optimizer, param_shardings, shapes_from_key(init_params), sites
  )
  if program is None:
    raw_loss_and_grad, run = _loss_and_grad_unpipelined(model, layout), None
  else:
    raw_loss_and_grad, run = _loss_and_grad_pipelined(cfg, mesh, model, spec, layout, program)

  def loss_and_grad(params, inputs, targets, segments=None, fp8=None):
    with sharding.axis_rules(rules):
      return raw_loss_and_grad(params, inputs, targets, segments, fp8)

  batch_args = _batch_args(bool(cfg.data.mask_documents), spec.context)
  train_step = _train_step(cfg, optimizer, loss_and_grad, batch_args, state_shardings.opt_state)
  eval_loss = _eval_loss(cfg, mesh, model, spec, layout, batch_args)
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P('data', None))
  with jax.set_mesh(mesh):
    jit_init = jax.jit(init_state, out_shardings=state_shardings)
    jit_train = jax.jit(
      train_step,
      in_shardings=(state_shardings, batch_sharding),
      out_shardings=(state_shardings, replicated),
      donate_argnums=0,
    )
    jit_eval = jax.jit(
      eval_loss, in_shardings=(param_shardings, batch_sharding), out_shardings=replicated
    )
    jit_init_fp8 = jax.jit(init_fp8, out_shardings=state_shardings.fp8)
    # Under delayed, from the histories before the first step (current scaling).
    jit_grad = jax.jit(
      lambda params, batch: loss_and_grad(params, *batch_args(batch), init_fp8())[:3],
      in_shardings=(param_shardings, batch_sharding),
      out_shardings=(replicated, param_shardings, replicated),
    )
  return Trainer(
    cfg=cfg,
    mesh=mesh,
    model=model,
    optimizer=optimizer,
    program=program,
    layout=layout,
    pipeline=run,
    state_shardings=state_shardings,
    batch_sharding=batch_sharding,
    init_state=jit_init,
    train_step=jit_train,
    init_fp8=jit_init_fp8,
    eval_loss=jit_eval,
    eval_params=_eval_params(cfg, state_shardings, param_shardings),
    loss_and_grad=jit_grad,
    optimizer_schedule=learning_rate_schedule(cfg.train),
    canonical_shardings=canonical_shardings,
    # Saves and restores convert leaf by leaf (relayout.py: what bounds their memory).
    to_canonical=relayout.Relayout(layout, state_shardings, canonical_shardings, to_model=True),
    from_canonical=relayout.Relayout(layout, canonical_shardings, state_shardings, to_model=False),
  )


def program_of(cfg) -> sched.Program | None:
  """The lowered schedule the train step of `cfg` (validated) runs; None
  without a pipeline or micro-batches."""
  p, v, m = cfg.mesh.pipe, cfg.pipeline.virtual_stages, cfg.pipeline.microbatches
  if p == 1 and m == 1:
    return None
  schedule = sched.from_config(cfg.pipeline, p, m, v)
  units = rounds.units_for(cfg.model.remat, cfg.pipeline.tick_packing)
  return sched.lower(schedule, cfg.pipeline.fuse_overlaps, units)


def _program_and_layout(cfg, spec):
  """The lowered schedule (None without a pipeline or micro-batches) and
  where each stack entry's weights sit in the stage-major stacks."""
  p, v = cfg.mesh.pipe, cfg.pipeline.virtual_stages
  program = program_of(cfg)
  placement = None if program is None else program.source.placement
  layout = layout_lib.StackLayout.build(
    spec.stacked_layers, p, v, cfg.pipeline.layers_per_stage, placement, spec.layers_per_entry
  )
  return program, layout


def _batch_args(documents: bool, context: int):
  """batch -> (inputs, targets, document ids or None), in the slot order the
  model expects (load-balanced over `context` ranks). Packed rows carry their
  document ids (batch['segment_ids']) with data.mask_documents; attention
  then stays inside each."""

  def batch_args(batch: dict) -> tuple:
    args = (batch['inputs'], batch['targets'], batch['segment_ids'] if documents else None)
    return tuple(None if a is None else context_lib.permute(a, context) for a in args)

  return batch_args


def _fp8_sites(model) -> tuple[str, ...] | None:
  """model.fp8=delayed's sites in a layer (fp8_delayed.sites); None without delayed."""
  spec = model.spec
  if spec.fp8 != 'delayed':
    return None
  tokens = jax.ShapeDtypeStruct((1, spec.seq_len), jnp.int32)
  return fp8_delayed.sites(model.loss, shapes_from_key(model.init), tokens)


def _state_and_canonical_shardings(
  cfg, model, mesh, optimizer, param_shardings, param_shapes, sites
):
  """The train state's shardings and the checkpoint's (relayout.py converts
  between them). model.fp8=delayed's histories (`sites`) are laid out as the
  layers' weights: over the layer axis, in the pipeline's layout, whole otherwise."""
  zero1 = cfg.train.optimizer_sharding == 'data'
  offload = cfg.train.offload_optimizer
  if offload:
    check_host_memory(mesh.devices.flat[0])
  rules = sharding.resolve_rules(cfg)
  fp8_axes = None if sites is None else fp8_delayed.logical_axes(sites)
  state = _state_shardings(optimizer, param_shardings, param_shapes, zero1, mesh, offload)
  if fp8_axes is not None:
    state = state.replace(fp8=sharding.tree_shardings(pipeline_axes(fp8_axes), mesh, rules))
  return state, _canonical_shardings(model, mesh, rules, optimizer, zero1, sites)


def _state_shardings(
  optimizer, param_shardings, param_shapes, zero1: bool, mesh: Mesh, offload: bool = False
):
  """The train state's shardings for parameters laid out as `param_shardings`;
  `offload`: the optimizer state's in host memory (train.offload_optimizer)."""
  replicated = NamedSharding(mesh, P())
  opt_shapes = jax.eval_shape(optimizer.init, param_shapes)

  # Each moment is laid out like its parameter, and with ZeRO-1 also split
  # over `data`: XLA then reduces the gradient into the shard each replica
  # updates and all-gathers the updated parameters. A leaf of another shape
  # (Adafactor's factored moments) keeps the splits its shape divides; a
  # part of the tree an optimizer does not hold (optax's MaskedNode) stays so.
  def moment(a, s):
    if isinstance(a, optax.MaskedNode):
      return a
    s = fit_shape(s, a.shape)
    return split_over(s, a.shape, 'data') if zero1 else s

  opt_shardings = optax.tree_map_params(
    optimizer,
    moment,
    opt_shapes,
    param_shardings,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: isinstance(x, optax.MaskedNode),
  )
  if offload:
    opt_shardings = _in_memory(opt_shardings, HOST)
  return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)


def _canonical_shardings(model, mesh: Mesh, rules, optimizer, zero1: bool, sites=None):
  """The checkpoint's layout (model layer order), split over `pipe` as well,
  in host memory where the devices have it (HOST); model.fp8=delayed's
  histories (`sites`, or None) as the layers' weights.

  The layer axis first: what every stage writes and reads is its share, not
  the whole state (replicated, pipe=8 made each device hold 7x the train
  state to save it). With an even split and v = 1 the shares are the
  stages' own layers, so converting moves nothing. In host memory, a save's
  copy leaves the device leaf by leaf as it is made, and a restore's comes
  to it leaf by leaf (relayout.py): beside the train state a device holds
  one leaf's conversion, not the state a second time. (Orbax copies a save
  to the host before writing it, and reads a restore there, either way.)
  """

  def over_pipe(axes, shapes):
    return jax.tree.map(
      lambda s, a: split_over(s, a.shape, 'pipe', prefer=0),
      sharding.tree_shardings(axes, mesh, rules),
      shapes,
    )

  shapes = shapes_from_key(model.init)
  shardings = _state_shardings(
    optimizer, over_pipe(model.logical_axes(), shapes), shapes, zero1, mesh
  )
  if sites is not None:
    spec = model.spec
    histories = jax.eval_shape(
      lambda: fp8_delayed.init(sites, spec.stack_depth, spec.fp8_amax_history)
    )
    shardings = shardings.replace(fp8=over_pipe(fp8_delayed.logical_axes(sites), histories))
  return _in_memory(shardings, HOST) if has_host_memory(mesh.devices.flat[0]) else shardings


def _loss_and_grad_unpipelined(model, layout):
  """f(params, inputs, targets, segments, fp8) -> (loss, grads, metrics, fp8
  updated), one program. `fp8`: model.fp8=delayed's histories, or None."""

  def raw_loss_and_grad(params, inputs, targets, segments=None, fp8=None):
    flat = layout.tree_to_model_order(params)
    # The objective: the loss, plus a MoE's router losses (its metrics beside it).
    objective = model.objective
    if fp8 is not None:
      # Differentiated beside the params: the histories' gradient is what each site saw.
      objective = fp8_delayed.with_state(objective)
      flat = (flat, layout.tree_to_model_order(fp8))
    if model.spec.fp8_metrics:
      grad = fp8_metrics.value_and_grad(objective)
    else:
      grad = jax.value_and_grad(objective, has_aux=True)
    (loss, metrics), grads = grad(flat, inputs, targets, segments)
    if fp8 is not None:
      grads, observed = grads
      fp8 = fp8_delayed.updated(fp8, layout.tree_to_pipeline(observed))
    return loss, layout.tree_to_pipeline(grads), metrics, fp8

  return raw_loss_and_grad


def _loss_and_grad_pipelined(cfg, mesh: Mesh, model, spec, layout, program):
  """The same function run by the pipeline executor, and the executor's step."""
  rules = sharding.resolve_rules(cfg)
  global_batch, seq, m = cfg.train.global_batch_size, spec.seq_len, cfg.pipeline.microbatches
  # The batch's mesh axis turns manual inside the executor, so that weight
  # gradients are reduced over it once per step; inside, the model sees
  # one replica's rows and its constraints must not name that axis.
  data_axis = dict(rules).get('batch')
  data_axis = data_axis if data_axis == 'data' else None
  inner_rules = tuple((name, None if axis == data_axis else axis) for name, axis in rules)

  def inside(fn):
    def call(*args, **kwargs):
      with sharding.axis_rules(inner_rules):
        return fn(*args, **kwargs)

    return call

  chunk = model.stage_chunk(m, (data_axis,) if data_axis else ())
  delayed = spec.fp8 == 'delayed'
  fns = executor.StageFns(
    embed=inside(
      lambda edges, tokens, segments: model.embed(model.edge_params(edges)[0], tokens, segments)
    ),
    # Under delayed scaling a chunk's params come with its layers' amax histories.
    chunk=inside(fp8_delayed.staged(chunk) if delayed else chunk),
    head_loss_and_grad=inside(model.head_loss_and_grad),
    loss_terms=model.head_loss_terms,
  )
  mb = global_batch // m
  act_spec = sharding.logical_to_spec(('batch', 'residual_seq', 'embed'), inner_rules)
  run = executor.pipeline_loss_and_grad(
    fns,
    program,
    mesh,
    act_shape=(mb, seq, spec.d_model),
    act_dtype=jnp.dtype(spec.dtype),
    loss_scale=1.0 / (global_batch * seq),
    act_spec=act_spec,
    chunk_layers=None if layout.even else layout.counts,
    data_axis=data_axis,
    transfer_spec=_transfer_spec(cfg, mesh, act_spec),
    segments=bool(cfg.data.mask_documents),
    edge_specs={
      k: sharding.tree_specs(model.logical_axes()[k], inner_rules) for k in ('embed', 'head')
    },
    edge_grads=cfg.pipeline.edge_grads,
    offload_stash=cfg.pipeline.offload_stash,
    chunk_first=_chunk_first(spec, layout),
    observations=delayed,
  )

  def raw_loss_and_grad(params, inputs, targets, segments=None, fp8=None):
    # Micro-batch j takes rows j, j+m, ...: each micro-batch spans every data shard.
    split = lambda a: jnp.swapaxes(a.reshape((mb, m) + a.shape[1:]), 0, 1)  # noqa: E731
    # The first and last stages' params in one tree: a weight both use (tied
    # embeddings) has one gradient, both ends' contributions added into it.
    edges = {'embed': params['embed'], 'head': params['head']}
    docs = () if segments is None else (split(segments),)
    stage = params['layers'] if fp8 is None else (params['layers'], fp8['layers'])
    (lm, figures), (g_layers, g_edges) = run(stage, edges, split(inputs), split(targets), *docs)
    if fp8 is not None:
      # What every micro-batch and replica observed, its max (the executor's observations).
      g_layers, observed = g_layers
      fp8 = fp8_delayed.updated(fp8, {'layers': observed})
    loss, metrics = model.stage_objective(lm, *figures)
    return loss, {**g_edges, 'layers': g_layers}, metrics, fp8

  return raw_loss_and_grad, run


def _chunk_first(spec, layout) -> tuple[int, ...] | None:
  """The stack entry each model chunk starts at, for a model whose layers
  differ by where they sit (local and global ones mixed); None otherwise."""
  local = spec.local_layers()
  if local is None or len(set(local)) == 1:
    return None
  return tuple(sum(layout.counts[:c]) for c in range(len(layout.counts)))


# The memory kind train.offload_optimizer keeps the optimizer state in between steps, and
# the checkpoint's layout its copy of the state in (_canonical_shardings).
HOST = 'pinned_host'


def _in_memory(shardings, kind: str):
  return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def has_host_memory(device) -> bool:
  """Whether `device` has the HOST memory offloading and checkpoints use."""
  return HOST in {m.kind for m in device.addressable_memories()}


def check_host_memory(device, key: str = 'train.offload_optimizer') -> None:
  """Raises ConfigError (on `key`) unless `device` has the HOST memory offloading uses."""
  if not has_host_memory(device):
    kinds = {m.kind for m in device.addressable_memories()}
    raise ConfigError(
      key,
      f'{device.platform} devices have no {HOST} memory (only {", ".join(sorted(kinds))}); '
      'set it to false',
    )


def _eval_params(cfg, state_shardings, param_shardings):
  """state -> the parameters to evaluate: schedule-free's average x, made
  from the state's interpolation y and z (optimizer.eval_params, one
  parameter-sized copy while it evaluates); state.params otherwise."""
  if cfg.train.optimizer != 'schedule_free_adamw':
    return lambda state: state.params
  on_device = _in_memory(state_shardings.opt_state, 'device')

  def average(state):
    opt_state = state.opt_state
    if cfg.train.offload_optimizer:
      opt_state = jax.device_put(opt_state, on_device)
    return optimizer_lib.eval_params(opt_state, state.params)

  return jax.jit(average, in_shardings=(state_shardings,), out_shardings=param_shardings)


def _train_step(cfg, optimizer, loss_and_grad, batch_args, opt_shardings):
  """state, batch -> (state, metrics): one optimizer update. With the
  optimizer state in host memory (`opt_shardings`, train.offload_optimizer)
  it is brought to the device for the update, after the backward, and back."""
  moved = None
  if cfg.train.offload_optimizer:
    moved = (_in_memory(opt_shardings, 'device'), opt_shardings)

  def train_step(state: TrainState, batch: dict):
    loss, grads, metrics, fp8 = loss_and_grad(state.params, *batch_args(batch), state.fp8)
    grad_norm = optimizer_lib.gradient_norm(grads)
    old = state.opt_state if moved is None else jax.device_put(state.opt_state, moved[0])
    updates, opt_state = optimizer.update(grads, old, state.params)
    params = optax.apply_updates(state.params, updates)
    if cfg.train.skip_nonfinite_steps:
      # A NaN/Inf step leaves parameters and optimizer state (so Adam's count)
      # as they were; the state is donated, so only the step can keep the old
      # values. `step` still advances, as the batch position does.
      ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      keep = lambda new, old: jnp.where(ok, new, old)
      params = jax.tree.map(keep, params, state.params)
      opt_state = jax.tree.map(keep, opt_state, old)
      fp8 = jax.tree.map(keep, fp8, state.fp8)
    if moved is not None:
      opt_state = jax.device_put(opt_state, moved[1])
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8)
    return new_state, {'loss': loss, 'grad_norm': grad_norm, **metrics}

  return train_step


def _eval_loss(cfg, mesh: Mesh, model, spec, layout, batch_args):
  """params, batch -> the mean loss, the model run unpipelined in layer order.

  The batch goes through in micro-batches, one after another in one program
  (`train_checks.eval_split`: the train step's micro-batch size per device by
  default), and each micro-batch's rows are split over the batch's mesh axes
  and `pipe`, so no two devices compute the same rows (each pipe rank ran
  the replica's whole batch before). With pipe > 1 the layers' weights are
  split over `pipe` along d_model instead of by stage (FSDP's split, with
  pipe as its axis), so the layer scan gathers one layer at a time: per
  device, the model is never whole. The embedding and head stay as the
  train step holds them (whole over `pipe`).
  """
  rules = sharding.resolve_rules(cfg)
  spread, count = train_checks.eval_split(
    cfg.train.global_batch_size,
    cfg.mesh.data,
    cfg.mesh.pipe,
    cfg.pipeline.microbatches,
    cfg.train.eval_microbatches,
  )
  weight_rules = _eval_weight_rules(rules, mesh, spec.d_model)
  layers = sharding.tree_shardings(model.logical_axes()['layers'], mesh, weight_rules)
  act_rules = _with_axis(rules, 'batch', 'pipe') if spread > 1 else rules
  micro = _micro_batches(act_rules, mesh, count)

  def eval_loss(params, batch):
    flat = relayout.tree_to_model_order(layout, mesh, params)
    flat = {**flat, 'layers': jax.lax.with_sharding_constraint(flat['layers'], layers)}

    def one(total, args):
      args = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), args)
      with sharding.axis_rules(act_rules):
        return total + model.loss(flat, *args), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), jax.tree.map(micro, batch_args(batch)))
    return total / count  # micro-batches of equal size: the mean of their means

  return eval_loss


def _micro_batches(act_rules, mesh: Mesh, count: int):
  """batch array [B, ...] -> [count, groups, rows, ...]: `count` micro-batches,
  each split into one group of rows per device of the batch's mesh axes
  (`act_rules`' 'batch', `data` first): a device's groups lie in its own
  shard of the batch, so splitting them moves nothing."""
  row_axes = sharding.logical_to_spec(('batch',), act_rules)[0]
  names = row_axes if isinstance(row_axes, tuple) else (row_axes,)
  groups = math.prod(mesh.shape[a] for a in names if a is not None)

  def micro(a):
    a = a.reshape((groups, count, -1) + a.shape[1:])
    a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(row_axes)))
    return jnp.swapaxes(a, 0, 1)

  return micro


def _with_axis(rules, logical: str, mesh_axis: str) -> tuple:
  """`rules` with `mesh_axis` added after the mesh axes `logical` maps to."""
  axes = dict(rules).get(logical)
  axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
  axes = tuple(a for a in axes if a is not None) + (mesh_axis,)
  return tuple(r for r in rules if r[0] != logical) + ((logical, axes),)


def _eval_weight_rules(rules, mesh: Mesh, d_model: int) -> tuple:
  """The evaluation's weights: as trained, but for d_model (FSDP's 'embed'),
  also split over `pipe` (pipe > 1) where it divides, instead of each
  stage's own layers."""
  if mesh.shape['pipe'] == 1:
    return rules
  split = _with_axis(rules, 'embed', 'pipe')
  ways = math.prod(mesh.shape[a] for a in dict(split)['embed'])
  return split if d_model % ways == 0 else rules
