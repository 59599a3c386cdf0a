"""Memory per device of a plan, as the executor allocates it: `memory` and its `parts`.

Per stage, the train step's peak is the training state (`state`: parameters, gradient
accumulator and Adam's two moments, split over `data` as the plan's state sharding says),
the stashed residuals (`slots['stash']` slots of the largest chunk; uneven splits store
padded stacks), the cuts B hands its W (`slots['cut']`, `chunk_cut`), the message pool, one
layer's backward workspace and the head's logits and cast weight (`head_cast`). A save,
restore or evaluation on the same resident state (`state_programs`) may peak higher; the
peak is the largest of the four.

Activations follow the profile's per-sequence figures on one tensor shard, divided by
context parallelism and, for the part every tensor rank holds whole (profile.
SEQUENCE_STASH), by sequence parallelism (`layer_stash`, `token_share`, `residual_share`).
A grouped entry (model.moe_every = n) holds one entry at a time where one layer is held; a
split MoE's experts divide their state over the expert degree (experts.py).

docs/bench_tpu_compile.md holds this model against XLA:TPU's compiled peak, and
tests/test_plan_tpu_memory.py pins it there. The counts and their sources:
docs/design/planner_costs.md."""

from __future__ import annotations

import numpy as np

from triax.pipeline import schedule as sched
from triax.pipeline.executor import edge_grads_after_loop, edge_pool_bytes
from triax.plan.candidate import Options, Plan
from triax.plan.cluster import Cluster
from triax.plan.cost import experts as experts_lib
from triax.plan.cost.profile import LAYER_CHECKPOINTED, Profile, Shard
from triax.training import checks as train_checks

# Parameter, gradient accumulator, Adam mu and nu, each the parameter's size
# (param_dtype: triax keeps no separate master copy; fp32 parameters are it).
STATE_COPIES = 4
# AdamW's (the default's) state per parameter byte; another train.optimizer's
# comes in Options.optimizer_state (training/optimizer.state_per_param).
MOMENTS = 2
# Bytes of a parameter: model.param_dtype's default, float32 (what STATE_COPIES
# prices too); the compute-dtype copies below are counted at dtype / this.
PARAM_BYTES = 4


def copies(
  kind: str, data: int, per_layer: bool = False, moments: float = MOMENTS
) -> dict[str, float]:
  """Copies of a stage's parameter bytes each part of the training state
  takes per device, by state sharding (see `state`); per_layer: FSDP without
  the executor, whose gathered weights are one layer's, not a copy of all;
  `moments`: the optimizer's state per parameter byte."""
  d = data
  if kind == 'replicated':
    return {'params': 1.0, 'grads': 1.0, 'moments': moments, 'gathered': 0.0}
  if kind == 'zero1':
    return {'params': 1.0, 'grads': 1.0, 'moments': moments / d, 'gathered': 0.0}
  if per_layer:
    return {'params': 1 / d, 'grads': 1 / d, 'moments': moments / d, 'gathered': 0.0}
  return {'params': 1 / d, 'grads': 1.0, 'moments': moments / d, 'gathered': 1.0}


def stage_moments(plan: Plan, profile: Profile, options: Options, layers: int) -> float:
  """The optimizer's state per parameter byte of a stage whose chunks hold
  `layers` layers each: options.optimizer_state's figures for the layers and
  for the edges (embedding and head), weighted by their bytes."""
  shard = profile.shards[plan.tensor]
  per_layer, per_edge = options.optimizer_state
  layer_bytes = shard.layer_param_bytes * layers * plan.virtual_stages
  edges = shard.edge_param_bytes
  return (per_layer * layer_bytes + per_edge * edges) / max(layer_bytes + edges, 1e-30)


def state(
  plan: Plan, profile: Profile, params: float, experts: float = 0.0, moments: float = MOMENTS
) -> dict[str, float]:
  """The train step's state bytes per device for a stage holding `params`
  bytes of parameters (its layers and the edges, the experts whole), by the
  plan's state_sharding (of them, `experts` bytes are routed experts', split
  over plan.expert, and the sharding then splits their part over the
  data / expert replicas holding the same experts):

  - replicated: parameters, gradient accumulator, moments, all whole;
  - zero1: the moments over the mesh's `data` axis (the gradient
    accumulator stays whole: the executor sums it over `data` once per
    step, then each replica updates its share and the parameters are
    all-gathered). The expert axis is carved from data (mesh.py), so that
    axis is data / expert devices: the routed experts' moments come out at
    1/data, the rest's at expert/data (XLA:TPU's compiled step of
    deepseek_v3:lite at data 8 = expert 8 holds the dense moments whole);
  - fsdp with the executor (pipe > 1 or m > 1): parameters and moments /
    data at rest, but the stage's weights are gathered once per step
    before the tick loop and that copy, like the whole gradient
    accumulator, is live through it ('gathered');
  - fsdp without it (pipe = m = 1): everything / data; the weights a layer
    or the head gathers as it runs are the work's (`_workspace`).

  `moments`: the optimizer's state per parameter byte (`stage_moments`).
  """
  kind, per_layer, e = plan.state_sharding, plan.fsdp_per_layer, plan.expert
  split = copies(kind, plan.data // e, per_layer, moments)
  # FSDP's rule splits 'embed' over data and expert both (mixtral._expert_rules).
  dense = split if kind == 'zero1' else copies(kind, plan.data, per_layer, moments)
  return {k: x * (params - experts) + split[k] / e * experts for k, x in dense.items()}


def head_weight(shard: Shard) -> float:
  """Bytes of the head's weight (the parameters' dtype): the embedding
  table's shape, tied or not (Shard.table_bytes); where a profile has no
  such figure, what its embedding work reads (its fixed bytes), else half
  the edges."""
  if shard.table_bytes:
    return shard.table_bytes
  embed = shard.work.get('embed')
  return embed.bytes_fixed if embed is not None else shard.edge_param_bytes / 2


def compute_share(profile: Profile) -> float:
  """Bytes of a parameter's compute-dtype copy per byte of the parameter."""
  return min(np.dtype(profile.dtype).itemsize / PARAM_BYTES, 1.0)


def head_cast(profile: Profile, shard: Shard) -> float:
  """Bytes of the head's weight cast to the compute dtype, live while the
  head runs: bf16[128256,2048] (a multiply_convert_fusion) inside the
  executor's tick loop at the 1B shape, bf16[32064,2048] in the TP 4 step."""
  share = compute_share(profile)
  if share >= 1.0:
    return 0.0  # computing in the parameters' dtype: the head reads them as they are
  return head_weight(shard) * share


def resident(
  plan: Plan,
  profile: Profile,
  params: float,
  experts: float = 0.0,
  offloaded: bool = False,
  moments: float = MOMENTS,
) -> float:
  """Bytes of the device's state kept between steps (parameters and moments,
  the moments not when `offloaded` to host memory; the gradients are the
  step's): what a save or an evaluation sits beside."""
  x = state(plan, profile, params, experts, moments)
  return x['params'] + (0.0 if offloaded else x['moments'])


def state_programs(
  plan: Plan,
  profile: Profile,
  params: float,
  experts: float = 0.0,
  offloaded: bool = False,
  moments: float = MOMENTS,
) -> dict[str, float]:
  """Peak bytes per device of a checkpoint save, a restore and an
  evaluation, each beside the resident state.

  Save / restore: the state and one leaf's conversion (training/relayout.py
  converts leaf by leaf, the checkpoint's copy in host memory: XLA:TPU's
  conversions hold the leaf's converted copy, or its device copy and the
  output it gathers, at most the leaf in the train state's layout),
  `largest_leaves`. With the moments `offloaded` the device's state is the
  parameters, and a moment leaf comes to the device as any leaf does.
  Evaluation: the state; with pipe > 1 the layers' parameters resharded
  once more (the step splits eval's weights over `pipe` along d_model) and
  one layer gathered, as FSDP's is; and the forward of one evaluation
  micro-batch (training.checks.eval_split: its rows over the data and pipe ranks, no
  more per device than the train step's micro-batch per replica) through
  one layer at a time without stash, bounded by one layer's
  unrematerialised residuals and its input and output, the rows' fp32
  logits, and the head's weight cast to the compute dtype (`head_cast`).
  """
  shard = profile.shards[plan.tensor]
  rest = resident(plan, profile, params, experts, offloaded, moments)
  spread, count = train_checks.eval_split(
    plan.global_batch, plan.data, plan.pipe, plan.microbatches
  )
  rows = plan.global_batch // (plan.data * spread * count)

  def share(part: float, part_experts: float = 0.0) -> float:  # of `part` bytes, a device's
    return state(plan, profile, part, part_experts)['params']

  layers = params - shard.edge_param_bytes
  copy = share(layers, experts) if plan.pipe > 1 else 0.0
  entry = profile.layers_per_entry  # the layers one step of the scan runs
  forward = rows * (
    layer_stash(plan, shard, 'none') * entry
    + 2 * shard.act_per_seq * residual_share(plan)
    + shard.logits_per_seq * token_share(plan)
  )
  split = plan.state_sharding == 'fsdp' or plan.pipe > 1
  gathered = shard.layer_param_bytes * entry if split else 0.0
  evaluate = rest + copy + gathered + forward + head_cast(profile, shard)
  convert = max(share(*leaf) for leaf in largest_leaves(shard, params, experts))
  return {'save': rest + convert, 'restore': rest + convert, 'eval': evaluate}


# A layer's largest weight as a share of its parameters: an MLP matrix (GPT's
# 4h^2 of 12h^2; each of SwiGLU's three about a quarter of a Llama layer).
LARGEST_WEIGHT = 1 / 3


def largest_leaves(shard: Shard, params: float, experts: float = 0.0) -> list[tuple[float, float]]:
  """(bytes, of them routed experts') of the leaves that may be the largest
  of a stage holding `params` bytes of parameters (its layers and the
  edges; `experts` of them routed experts'), whole over `data`: one dense
  weight stacked over the stage's layers, one of a routed expert's three
  (split over `expert` as all its experts are), or the embedding table."""
  layers = params - shard.edge_param_bytes
  routed = max(experts - shard.edge_expert_param_bytes, 0.0)
  one = routed / 3  # w_gate, w_up and w_down alike
  return [(LARGEST_WEIGHT * (layers - routed), 0.0), (one, one), (head_weight(shard), 0.0)]


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


def _gathering_layers(plan: Plan, shard: Shard) -> float:
  """The share of the layers whose all-gather kind keeps the gathered K/V: all,
  but with a window that skips blocks its local layers, which fetch theirs
  under their own backward (context._near_attention) and keep none."""
  window = shard.window
  if window is None or window.steps(plan.context) == plan.context:
    return 1.0
  return 1.0 - window.local_share


def layer_stash(plan: Plan, shard: Shard, remat: str | None = None) -> float:
  """Residual bytes per layer per sequence one device keeps, under `remat`
  (default the plan's): the shard's, its SEQUENCE_STASH part split over
  tensor by SP, all of it over context by CP; the all-gather kind keeps the
  K/V it gathered from the other context ranks, but under a policy that
  checkpoints the layer, which gathers them again (with remat=attention
  they are the attention core's inputs). `plan`: a Plan or a search Layout."""
  remat = remat or plan.remat
  held = shard.stash_per_seq[remat]
  if plan.sequence_parallel:
    held -= shard.sequence_stash(remat) * (1 - 1 / plan.tensor)
  own = held * token_share(plan)
  if gathers_kv(plan) and remat not in LAYER_CHECKPOINTED:
    own += shard.kv_per_seq * (1 - token_share(plan)) * _gathering_layers(plan, shard)
  return own + experts_lib.dispatch_stash(plan, shard, remat)


def chunk_stash(plan: Plan, profile: Profile, layers: int, pooled: bool = True) -> float:
  """Bytes of one stashed micro-batch of a chunk of `layers` layers: their
  residuals and the chunk's input (the residual stream).

  In the executor's pool (`pooled`) the part every tensor rank computes
  whole (the layer inputs a full remat keeps, profile.SEQUENCE_STASH) is
  split over tensor, as sequence parallelism would: the executor does not
  pin the pool, and GSPMD lays it out as [slots, layers, mb, s, d / t]
  (XLA:TPU's bf16[2,8,1,2048,1024] at 1B with t = 2, bf16[2,16,1,2048,1024]
  at 8B with t = 4, bf16[4,20,1,2048,1024] at 70B with t = 8; seen with
  full remat). The layer scan's residuals without a pipeline stay whole on
  every tensor rank (bf16[16, 8, 2048, 2048] at 1B with t = 4).
  """
  shard = profile.shards[plan.tensor]
  fixed = shard.stash_fixed_per_seq * residual_share(plan)
  held = layer_stash(plan, shard)
  if pooled and not plan.sequence_parallel:
    held -= shard.sequence_stash(plan.remat) * token_share(plan) * (1 - 1 / plan.tensor)
  return plan.microbatch_size * (layers * held + fixed)


# The [s, d] values a cut holds whole on every tensor rank: the two norms'
# outputs (the attention's and the MLP's input) and the cotangents at the
# attention's and the MLP's outputs.
CUT_WHOLE = 4


def chunk_cut(plan: Plan, profile: Profile, layers: int) -> float:
  """Bytes of one cut (what a B hands its W): every weight matmul's input
  and the cotangent at its output, which remat does not shrink (B
  recomputes what it needs), and nothing W could make from less
  (split_backward's `_promote_cheap`: B makes the norms' scale gradients).

  Per layer and position (the analytic profile's cut_per_seq): the two
  normed streams, the attention's output and the MLP's hidden product; the
  cotangents at Q, K, V, the attention's output, gate and up (or fc1), and
  the MLP's output. XLA:TPU's cut pool at Llama 3.1 8B's shape with t = 4:
  four bf16 [s, d], three [s, d_ff / t], two [s, heads / t, head_dim] and
  two [s, kv_heads / t, head_dim]. With data > 1 (the executor manual over
  `data` too) GSPMD splits the four [s, d] over tensor as well, as
  sequence parallelism would: bf16[4,20,1,2048,1024] at 70B with data = 2,
  t = 8 (zb_h1, 4 slots). A measured profile (no cut_per_seq) takes the
  dots stash (the weight matmuls' outputs, about their inputs) as the
  inputs and as much again, less the whole four, for the cotangents.
  """
  shard = profile.shards[plan.tensor]
  whole = CUT_WHOLE * shard.act_per_seq
  dots = shard.stash_per_seq['dots']
  cut = shard.cut_per_seq or 2 * dots - min(dots, whole)
  whole = min(cut, whole)
  split = plan.sequence_parallel or plan.data > 1
  held = cut - (whole * (1 - 1 / plan.tensor) if split else 0.0)
  inputs = held * token_share(plan) + experts_lib.dispatch_stash(plan, shard, 'dots')
  return plan.microbatch_size * layers * inputs


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
  # Offloaded, the pool is in host memory and one set at a time is on the device.
  stash_slots = min(1, slots('stash')) if options.offload_stash else slots('stash')
  return {
    'stash': stash_slots * chunk_stash(plan, profile, layers),
    'cut': slots('cut') * chunk_cut(plan, profile, layers),
    'msg': (program_.slots['msg'] + 1 + 2) * act,
  }


def edge_grads_after(plan: Plan, profile: Profile, options: Options) -> tuple[float, float]:
  """(bytes the tick loop sheds, bytes it adds) when the executor makes the
  edges' weight gradients after it (options.edge_grads, its pipeline.edge_grads):
  the edges' gradient accumulator, and the two activation pools that
  replace it (`executor.edge_grads_after_loop`, which this asks); (0, 0)
  when it keeps them in the loop."""
  shard = profile.shards[plan.tensor]
  act = shard.act_per_seq * residual_share(plan) * plan.microbatch_size
  if options.scatter_gather and not plan.sequence_parallel:
    act /= plan.tensor  # the pools wait split over tensor, as messages do
  grads = shard.edge_param_bytes * copies(plan.state_sharding, plan.data)['grads']
  if not edge_grads_after_loop(options.edge_grads, plan.microbatches, plan.pipe, act, grads):
    return 0.0, 0.0
  return grads, edge_pool_bytes(plan.microbatches, plan.pipe, act)


def _workspace(
  plan: Plan, profile: Profile, shard: Shard, logits: float, pipelined: bool, dense: bool
) -> float:
  """Bytes the step's work holds beside its state and stash: the head's
  (its logits; its weight's compute-dtype copy, FSDP's two gathered ones)
  and one layer's backward (its activations, twice; FSDP's two gathered
  copies of its weights). One value_and_grad holds the larger: the head's
  gradient is made in the forward (common._head_loss_differentiated_forward),
  before the layers' backward; XLA:TPU's FSDP and TP steps at 1B and 8B
  allocate close to that where the sum overshot (docs/bench_tpu_compile.md). The executor's tick loop holds both: its
  buffers live across the ticks. A layer is a stack entry here (remat and
  FSDP's gathers take a group of blocks at once). The head's part holds the
  edges' own blocks' residuals (Shard.edge_work_per_seq) too. `dense`: the
  layer's grouped matmuls are dense products (experts.runs_dense), whose
  buffers its backward holds beside."""
  entry = profile.layers_per_entry
  layer = 2 * plan.microbatch_size * layer_stash(plan, shard, 'none') * entry
  if dense:
    layer += plan.microbatch_size * experts_lib.dense_buffers(plan, shard)
  # The edges' own blocks (DeepSeek's dense ones, its MTP modules) run forward
  # and backward inside the embedding's or the head's work.
  logits += edge_work(plan, shard)
  if plan.fsdp_per_layer:
    # Two gathered copies, in the compute dtype: XLA converts the shard before
    # the all-gather, and gathers the weight for the forward and again for
    # the backward (the embedding looks its rows up in the shard). The FSDP
    # steps' largest buffers: two bf16[128256,2048] at 1B, two
    # bf16[4096,128256] at 8B; the gradients are reduce-scattered as they
    # come (f32[32,512,14336]).
    share = compute_share(profile)
    head = logits + 2 * head_weight(shard) * share
    layer += 2 * shard.layer_param_bytes * entry * share
  else:
    head = logits + head_cast(profile, shard)
  return head + layer if pipelined else max(head, layer)


def edge_work(plan: Plan, shard: Shard) -> float:
  """Bytes a micro-batch's edge blocks (DeepSeek's first dense ones, its MTP
  modules) hold while the embedding's or the head's backward runs."""
  held = shard.edge_work_per_seq.get(plan.remat, 0.0)
  return plan.microbatch_size * held * token_share(plan)


def stage_layers(plan: Plan, options: Options, stage: int) -> int:
  """Layers of each chunk a stage allocates: the widest chunk's when padded
  (the executor's stacks), else its own."""
  return max(plan.chunk_layers) if options.padded else plan.layers[stage] // plan.virtual_stages


def stage_params(plan: Plan, profile: Profile, layers: int) -> tuple[float, float]:
  """(parameter bytes, of them the routed experts') of a stage whose chunks
  hold `layers` layers each: its layers and the edges (whose blocks'
  routed experts, an MTP module's, split over `expert` as the layers' do)."""
  shard = profile.shards[plan.tensor]
  v = plan.virtual_stages
  params = shard.layer_param_bytes * layers * v + shard.edge_param_bytes
  experts = experts_lib.expert_param_bytes(shard) * layers * v + shard.edge_expert_param_bytes
  return params, experts


# The parts of a stage's train-step peak per device, as `parts` names them:
# the training state (`state`), the executor's pools (`pools`: stash, cuts,
# messages; without the executor the layer scan's stash) and the work beside
# them (`_workspace`).
STEP_PARTS = ('params', 'grads', 'moments', 'gathered', 'stash', 'cut', 'msg', 'workspace')


def parts(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options, program_: sched.Program | None
) -> tuple[dict[str, float], ...]:
  """Per stage, its peak bytes per device by part: STEP_PARTS, 'step' (the
  train step's peak: their sum, or with options.offload_optimizer the larger
  of the forward and backward without the moments and the update with
  them), the state programs' 'save', 'restore' and 'eval' (`state_programs`)
  and 'capacity' (the usable bytes of the stage's smallest device).
  program_: the plan's lowered schedule, None without the executor."""
  shard = profile.shards[plan.tensor]
  b = plan.microbatch_size
  # The head's logits, in the compute dtype, once: XLA fuses the softmax and
  # its gradient into the loss chunk's matmuls, and holds one bf16[b, chunk,
  # V/t] (bf16[2,256,128256] in the 1B FSDP step, bf16[8,256,32064] at TP 4,
  # bf16[256,128256] in the executor's tick loop), not three fp32 ones.
  # (logits_per_seq counts them in fp32.)
  logits = b * shard.logits_per_seq * token_share(plan) * np.dtype(profile.dtype).itemsize / 4
  out = []
  shed, pooled = edge_grads_after(plan, profile, options)
  for s in range(plan.pipe):
    held = stage_layers(plan, options, s)
    params, experts = stage_params(plan, profile, held)
    if program_ is None:  # no pipeline: one value_and_grad over the whole model
      stash = chunk_stash(plan, profile, plan.num_layers, pooled=False)
      pool = {'stash': stash, 'cut': 0.0, 'msg': 0.0}
    else:
      pool = pools(plan, profile, options, program_, s, held)
    buffers = pool['cut'] + pool['msg']
    dense = experts_lib.runs_dense(plan, shard, cluster, s)
    workspace = _workspace(plan, profile, shard, logits, program_ is not None, dense)
    if program_ is not None and shed:
      # With the edges' gradients made after the tick loop, the loop holds
      # two pools instead of their accumulator, and after it the step holds
      # the whole state and the head's work only.
      after = logits + edge_work(plan, shard) + head_cast(profile, shard)
      workspace = max(workspace + pooled - shed, after - pool['stash'] - buffers)
    moments = stage_moments(plan, profile, options, held)
    kept = state(plan, profile, params, experts, moments)
    part = {**kept, **pool, 'workspace': workspace}
    peak = sum(kept.values()) + pool['stash'] + buffers + workspace
    offloaded = options.offload_optimizer
    if offloaded:
      # The moments wait in host memory through the forward and backward and
      # come back whole for the update, beside the parameters and gradients:
      # the step's peak is the larger of the two phases, as XLA:TPU's
      # compiled steps show (docs/bench_tpu_compile.md).
      update = kept['params'] + kept['grads'] + kept['moments']
      peak = max(peak - kept['moments'], update)
    part['step'] = peak
    part.update(state_programs(plan, profile, params, experts, offloaded, moments))
    part['capacity'] = (
      min(cluster.groups[cluster.devices[d].group].memory for d in plan.stages[s])
      * options.memory_fraction
    )
    out.append(part)
  return tuple(out)


def memory(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options, program_: sched.Program | None
) -> tuple[tuple, ...]:
  """Per stage: peak bytes per device (the train step's, or with
  options.state_programs a save, restore or evaluation if larger), the
  usable bytes of its smallest device, the temporary part of the step's
  peak (all but the training state), the train step's peak, the state
  programs' peak, and its `parts`."""
  out, cap, temp, step, progs = [], [], [], [], []
  stages = parts(plan, profile, cluster, options, program_)
  for part in stages:
    programs = max(part[k] for k in ('save', 'restore', 'eval'))
    kept = sum(part[k] for k in ('params', 'grads', 'moments', 'gathered'))
    step.append(part['step'])
    progs.append(programs)
    out.append(max(part['step'], programs) if options.state_programs else part['step'])
    temp.append(part['step'] - kept + (part['moments'] if options.offload_optimizer else 0.0))
    cap.append(part['capacity'])
  return tuple(out), tuple(cap), tuple(temp), tuple(step), tuple(progs), stages
