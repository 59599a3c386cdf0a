"""Memory per device of a plan, as the executor allocates it: the training
state (`state`: parameters, their gradient accumulator and Adam's two
moments, each the parameter's size: 16 B/param in fp32, split over `data`
as the plan's state_sharding says), the stashed residuals
(the executor allocates `slots['stash']` slots of the largest chunk on
every stage; uneven splits store padded stacks), the cuts B hands its W
(`slots['cut']`, each estimated as one unrematerialised stash set: the
profile does not measure them) and the message pool of activations and
gradients, plus one layer's backward workspace and the head's logits.

Beside the train step, the run saves and restores checkpoints and
evaluates on the same resident state (`state_programs`, what
training/loop.py's state_program_stats compiles and triax budget counts):
a save or restore converts the state to or from the checkpoint's layout
(about one more copy of the state's share), and the evaluation runs the
model forward on the step's rows of one replica (global batch / data, all
at once, unpipelined) with no stash. The peak is the largest of the four.

Activations per device (`layer_stash`, `token_share`, `residual_share`):
the profile's figures are per sequence on one tensor shard; context
parallelism splits every sequence c ways for the whole layer (all of them
fall by c; the all-gather kind also keeps the other ranks' gathered K/V
for the backward), and sequence parallelism splits the part every tensor
rank held whole (profile.SEQUENCE_STASH: norms, residual stream) over
tensor too. That is Korthikanti et al.'s (2022) per-layer count, s b h e
(4 + 12/t + a s/(h t)) with tensor parallelism alone and s b h e (16/t +
a s/(h t)) with SP (their 10 + 24/t + 5as/(ht) and 34/t + 5as/(ht) at
e = 2, less dropout's masks, which triax does not have); selective remat
drops the a s / (h t) term, full keeps the layer input, s b h e (1/t
with SP).

A MoE model with its experts split (Plan.expert > 1): the experts' share of
the state over the expert degree (`state`'s `experts`), and dropless's
exchanged rows in each layer's residuals (experts.dispatch_stash).
"""

from __future__ import annotations

from triax.pipeline import schedule as sched
from triax.plan.candidate import Options, Plan
from triax.plan.cluster import Cluster
from triax.plan.cost import experts as experts_lib
from triax.plan.cost.profile import Profile, Shard

# Parameter, gradient accumulator, Adam mu and nu, each the parameter's size
# (param_dtype: triax keeps no separate master copy; fp32 parameters are it).
STATE_COPIES = 4
MOMENTS = 2


def copies(kind: str, data: int, per_layer: bool = False) -> dict[str, float]:
  """Copies of a stage's parameter bytes each part of the training state
  takes per device, by state sharding (see `state`); per_layer: FSDP without
  the executor, whose gathered weights are one layer's, not a copy of all."""
  d = data
  if kind == 'replicated':
    return {'params': 1.0, 'grads': 1.0, 'moments': MOMENTS, 'gathered': 0.0}
  if kind == 'zero1':
    return {'params': 1.0, 'grads': 1.0, 'moments': MOMENTS / d, 'gathered': 0.0}
  if per_layer:
    return {'params': 1 / d, 'grads': 1 / d, 'moments': MOMENTS / d, 'gathered': 0.0}
  return {'params': 1 / d, 'grads': 1.0, 'moments': MOMENTS / d, 'gathered': 1.0}


def state(plan: Plan, profile: Profile, params: float, experts: float = 0.0) -> dict[str, float]:
  """The train step's state bytes per device for a stage holding `params`
  bytes of parameters (its layers and the edges, the experts whole), by the
  plan's state_sharding (of them, `experts` bytes are routed experts', split
  over plan.expert, and the sharding then splits their part over the
  data / expert replicas holding the same experts; ZeRO-1's moments come
  out at 1/data either way):

  - replicated: parameters, gradient accumulator, moments, all whole;
  - zero1: the moments / data (the gradient accumulator stays whole: the
    executor sums it over `data` once per step, then each replica updates
    its share and the parameters are all-gathered);
  - fsdp with the executor (pipe > 1 or m > 1): parameters and moments /
    data at rest, but the stage's weights are gathered once per step
    before the tick loop and that copy, like the whole gradient
    accumulator, is live through it ('gathered');
  - fsdp without it (pipe = m = 1): everything / data, plus one layer's
    gathered weights and their gradient before its reduce-scatter (the
    layer scan gathers one layer at a time; the larger of a layer and the
    embedding + head).
  """
  kind, per_layer, e = plan.state_sharding, plan.fsdp_per_layer, plan.expert
  split = copies(kind, plan.data // e, per_layer)
  out = {
    k: x * (params - experts) + split[k] / e * experts
    for k, x in copies(kind, plan.data, per_layer).items()
  }
  if plan.fsdp_per_layer:
    shard = profile.shards[plan.tensor]
    out['gathered'] = 2 * max(shard.layer_param_bytes, shard.edge_param_bytes)
  return out


def resident(plan: Plan, profile: Profile, params: float, experts: float = 0.0) -> float:
  """Bytes of the state kept between steps (parameters and moments; the
  gradients are the step's): what a save or an evaluation sits beside."""
  x = state(plan, profile, params, experts)
  return x['params'] + x['moments']


def state_programs(
  plan: Plan, profile: Profile, params: float, experts: float = 0.0
) -> dict[str, float]:
  """Peak bytes per device of a checkpoint save, a restore and an
  evaluation, each beside the resident state.

  Save / restore: the state plus its converted copy (the checkpoint layout
  splits the same bytes over the same devices: about one more share).
  Evaluation: the state, with pipe > 1 the parameters resharded once more
  (the step splits eval's weights over `pipe` along d_model), and the
  forward of global_batch / data rows through one layer at a time without
  stash, bounded by one layer's unrematerialised residuals and its input
  and output, and the rows' fp32 logits.
  """
  shard = profile.shards[plan.tensor]
  rest = resident(plan, profile, params, experts)
  rows = plan.global_batch // plan.data
  copy = state(plan, profile, params, experts)['params'] if plan.pipe > 1 else 0.0
  forward = rows * (
    layer_stash(plan, shard, 'none')
    + 2 * shard.act_per_seq * residual_share(plan)
    + shard.logits_per_seq * token_share(plan)
  )
  gathered = shard.layer_param_bytes if plan.state_sharding == 'fsdp' else 0.0
  return {'save': 2 * rest, 'restore': 2 * rest, 'eval': rest + copy + gathered + forward}


def token_share(plan: Plan) -> float:
  """Share of each sequence's positions one device computes and holds: 1/context."""
  return 1.0 / plan.context


def residual_share(plan: Plan) -> float:
  """Share of a sequence's residual stream [s, d] (a pipeline message, a
  stage's input) one device holds: 1/context, and 1/tensor more with SP."""
  return token_share(plan) / (plan.tensor if plan.sequence_parallel else 1)


def gathers_kv(plan: Plan) -> bool:
  """Whether attention all-gathers K/V over context (model.context_attention=allgather)."""
  return plan.context > 1 and plan.context_attention == 'allgather'


def layer_stash(plan: Plan, shard: Shard, remat: str | None = None) -> float:
  """Residual bytes per layer per sequence one device keeps, under `remat`
  (default the plan's): the shard's, its SEQUENCE_STASH part split over
  tensor by SP, all of it over context by CP; without remat the all-gather
  kind keeps the K/V it gathered from the other context ranks (a policy
  that recomputes gathers them again). `plan`: a Plan or a search Layout."""
  remat = remat or plan.remat
  held = shard.stash_per_seq[remat]
  if plan.sequence_parallel:
    held -= shard.sequence_stash(remat) * (1 - 1 / plan.tensor)
  own = held * token_share(plan)
  if gathers_kv(plan) and remat == 'none':
    own += shard.kv_per_seq * (1 - token_share(plan))
  return own + experts_lib.dispatch_stash(plan, shard, remat)


def chunk_stash(plan: Plan, profile: Profile, layers: int) -> float:
  """Bytes of one stashed micro-batch of a chunk of `layers` layers: their
  residuals and the chunk's input (the residual stream)."""
  shard = profile.shards[plan.tensor]
  fixed = shard.stash_fixed_per_seq * residual_share(plan)
  return plan.microbatch_size * (layers * layer_stash(plan, shard) + fixed)


def chunk_cut(plan: Plan, profile: Profile, layers: int) -> float:
  """Bytes of one cut (what a B hands its W: the cotangents at the weight
  matmuls' outputs), estimated as the residuals those matmuls keep without
  remat, which remat does not shrink: B recomputes what it needs."""
  return plan.microbatch_size * layers * layer_stash(plan, profile.shards[plan.tensor], 'none')


def pools(
  plan: Plan, profile: Profile, options: Options, program_: sched.Program, stage: int, layers: int
) -> dict[str, float]:
  """Bytes of stage `stage`'s executor pools for chunks of `layers` layers:
  'stash' and 'cut' (all slots if padded, else the stage's own peak) and
  'msg' (the message pool, its spare slot, and the two activations a tick
  has in flight)."""

  def slots(buf: str) -> int:
    return program_.slots[buf] if options.padded else program_.peaks[buf][stage]

  act = profile.shards[plan.tensor].act_per_seq * residual_share(plan) * plan.microbatch_size
  return {
    'stash': slots('stash') * chunk_stash(plan, profile, layers),
    'cut': slots('cut') * chunk_cut(plan, profile, layers),
    'msg': (program_.slots['msg'] + 1 + 2) * act,
  }


def memory(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options, program_: sched.Program | None
) -> tuple[tuple[float, ...], ...]:
  """Per stage: peak bytes per device (the train step's, or with
  options.state_programs a save, restore or evaluation if larger), the
  usable bytes of its smallest device, the temporary part of the step's
  peak (all but the training state), the train step's peak and the state
  programs' peak."""
  shard = profile.shards[plan.tensor]
  b, v = plan.microbatch_size, plan.virtual_stages
  widest = max(plan.chunk_layers)
  # The head's logits, their softmax and gradient live at once in its backward.
  logits = 3 * b * shard.logits_per_seq * token_share(plan)
  out, cap, temp, step, progs = [], [], [], [], []
  for s in range(plan.pipe):
    own = plan.layers[s] // v
    held = widest if options.padded else own
    params = shard.layer_param_bytes * held * v + shard.edge_param_bytes
    experts = experts_lib.expert_param_bytes(shard) * held * v
    if program_ is None:  # no pipeline: one value_and_grad over the whole model
      stash = chunk_stash(plan, profile, plan.num_layers)
      buffers = 0.0
    else:
      pool = pools(plan, profile, options, program_, s, held)
      stash, buffers = pool['stash'], pool['cut'] + pool['msg']
    workspace = 2 * b * layer_stash(plan, shard, 'none') + logits
    peak = sum(state(plan, profile, params, experts).values()) + stash + buffers + workspace
    programs = max(state_programs(plan, profile, params, experts).values())
    step.append(peak)
    progs.append(programs)
    out.append(max(peak, programs) if options.state_programs else peak)
    temp.append(stash + buffers + workspace)
    cap.append(
      min(cluster.groups[cluster.devices[d].group].memory for d in plan.stages[s])
      * options.memory_fraction
    )
  return tuple(out), tuple(cap), tuple(temp), tuple(step), tuple(progs)
