"""Memory per device of a plan, as the executor allocates it: parameters, their gradient accumulator and Adam's two
moments (4x the parameter bytes: 16 B/param in fp32), the stashed residuals
(the executor allocates `slots['stash']` slots of the largest chunk on
every stage; uneven splits store padded stacks), the cuts B hands its W
(`slots['cut']`, each estimated as one unrematerialised stash set: the
profile does not measure them) and the message pool of activations and
gradients, plus one layer's backward workspace and the head's logits.
"""

from __future__ import annotations

from triax.pipeline import schedule as sched
from triax.plan.candidate import Options, Plan
from triax.plan.cluster import Cluster
from triax.plan.profile import Profile

# Parameter, gradient accumulator, Adam mu and nu, each the parameter's size.
STATE_COPIES = 4


def chunk_stash(plan: Plan, profile: Profile, layers: int) -> float:
  shard = profile.shards[plan.tensor]
  return plan.microbatch_size * (
    layers * shard.stash_per_seq[plan.remat] + shard.stash_fixed_per_seq
  )


def chunk_cut(plan: Plan, profile: Profile, layers: int) -> float:
  """Bytes of one cut (what a B hands its W: the cotangents at the weight
  matmuls' outputs), estimated as the residuals those matmuls keep without
  remat, which remat does not shrink: B recomputes what it needs."""
  return plan.microbatch_size * layers * profile.shards[plan.tensor].stash_per_seq['none']


def pools(
  plan: Plan, profile: Profile, options: Options, program_: sched.Program, stage: int, layers: int
) -> dict[str, float]:
  """Bytes of stage `stage`'s executor pools for chunks of `layers` layers:
  'stash' and 'cut' (all slots if padded, else the stage's own peak) and
  'msg' (the message pool, its spare slot, and the two activations a tick
  has in flight)."""

  def slots(buf: str) -> int:
    return program_.slots[buf] if options.padded else program_.peaks[buf][stage]

  act = profile.shards[plan.tensor].act_per_seq * plan.microbatch_size
  return {
    'stash': slots('stash') * chunk_stash(plan, profile, layers),
    'cut': slots('cut') * chunk_cut(plan, profile, layers),
    'msg': (program_.slots['msg'] + 1 + 2) * act,
  }


def memory(
  plan: Plan, profile: Profile, cluster: Cluster, options: Options, program_: sched.Program | None
) -> tuple[tuple[float, ...], ...]:
  """Per stage: peak bytes per device, the usable bytes of its smallest
  device, and the temporary part of the peak (all but parameters and
  optimizer state)."""
  shard = profile.shards[plan.tensor]
  b, v = plan.microbatch_size, plan.virtual_stages
  widest = max(plan.chunk_layers)
  # The head's logits, their softmax and gradient live at once in its backward.
  logits = 3 * b * shard.logits_per_seq
  out, cap, temp = [], [], []
  for s in range(plan.pipe):
    own = plan.layers[s] // v
    held = widest if options.padded else own
    params = shard.layer_param_bytes * held * v + shard.edge_param_bytes
    if program_ is None:  # no pipeline: one value_and_grad over the whole model
      stash = chunk_stash(plan, profile, plan.num_layers)
      buffers = 0.0
    else:
      pool = pools(plan, profile, options, program_, s, held)
      stash, buffers = pool['stash'], pool['cut'] + pool['msg']
    workspace = 2 * b * shard.stash_per_seq['none'] + logits
    out.append(STATE_COPIES * params + stash + buffers + workspace)
    temp.append(stash + buffers + workspace)
    cap.append(
      min(cluster.groups[cluster.devices[d].group].memory for d in plan.stages[s])
      * options.memory_fraction
    )
  return tuple(out), tuple(cap), tuple(temp)
