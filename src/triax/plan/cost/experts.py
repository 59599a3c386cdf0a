"""Mixture of experts in a plan's costs: the all-to-alls, the busiest expert's device, the state split.

A MoE layer's routed experts (a Shard's `Experts`) are split over `Plan.expert` devices,
carved from the inner part of `data`, as model/moe.py runs them:

- `exchange_bytes` / `seconds`: the token all-to-alls over each expert group, forward and
  backward (dropless: fixed buffers with room for every assignment plus their expert ids;
  capacity: each row's [E, C, d] buffers), rerun where a remat policy recomputes them;
- `compute_scale`: dropless compute waits for the device of the busiest expert,
  (imbalance + g - 1) / g of a balanced share with g = E / expert experts per device;
- `layer_params`: the experts' parameters, gradients and moments split over `expert`;
- `dispatch_stash`: the exchanged rows the grouped matmuls keep for the backward;
- `runs_dense`, `dense_buffers`: dropless on a device whose compiler runs a grouped
  matmul as one dense product over every local expert (cluster.Group.ragged_dot
  'dense', XLA:GPU's): every expert computes every row the device holds, E x the
  routed experts' FLOPs (`compute_scale`), in [local experts, rows, width] buffers.

With model.moe_every = n the all-to-alls and rows are 1/n of a MoE block's per layer
(`Experts.every`). Plain arithmetic, no JAX (moe.py imports it): `capacity` repeats
moe.capacity_of's one line, and a test holds them equal. The reasoning: docs/design/moe.md."""

from __future__ import annotations

import math

from triax.plan.cost import profile as profile_lib
from triax.plan.cost.profile import Experts, Shard

# Bytes of one routed assignment's expert id in dropless's exchange (int32).
ID_BYTES = 4
# Per exchanged row the grouped matmuls keep for their backward: its input
# row (d) and, hidden wide, the gate and up projections, silu(gate) and
# their product (the down projection's input).
HIDDEN_RESIDUALS = 4
# The [local experts, rows, width] buffers a MoE layer's dense grouped matmuls
# hold at once in its backward (`dense_buffers`): two d_model wide and three
# hidden wide, the count that matches XLA:GPU's compiled DeepSeek step at data 8
# x expert 8 (tests/test_plan_deepseek.py), whose largest buffers are the masked
# rows, d_model and hidden wide, and their transposes. Other layouts hold about
# a d_model-wide buffer more (tensor 2) or less (expert 2): not modelled.
DENSE_D_MODEL, DENSE_HIDDEN = 2, 3


def capacity(experts: Experts) -> int:
  """Assignments one expert takes from one batch row (moe.capacity_of)."""
  e = experts
  return max(1, math.ceil(e.capacity_factor * e.seq_len * e.per_token / e.num_experts))


def split(plan, shard: Shard) -> bool:
  """Whether the plan splits a MoE layer's experts (else nothing here applies)."""
  return shard.experts is not None and plan.expert > 1


def exchange_bytes(plan, experts: Experts) -> float:
  """One token all-to-all's buffer per device per micro-batch (what each
  device sends, its own share included)."""
  token = experts.d_model * experts.dtype_bytes
  rows = plan.microbatch_size
  if experts.dispatch == 'capacity':
    # [b, E, C, d]: the rows are whole over context (moe.BUFFERS).
    return rows * experts.num_experts * capacity(experts) * token
  assignments = rows * experts.seq_len / plan.context * experts.per_token
  return plan.expert * assignments * token


def seconds(plan, shard: Shard, comm, stage: int, remat: str | None = None) -> tuple[float, float]:
  """Seconds the all-to-alls add to one layer's forward and backward on
  `stage` (0, 0 unless the experts are split): a MoE layer's, over
  Experts.every, its backward rerunning the forward's under a `remat`
  policy (default the plan's) that checkpoints the layer."""
  if not split(plan, shard):
    return 0.0, 0.0
  experts = shard.experts
  groups = plan.expert_groups(stage)
  nbytes = exchange_bytes(plan, experts)
  one = max(comm.alltoall(g, nbytes) for g in groups)
  forward = 2 * one
  if experts.dispatch == 'dropless':
    ids = nbytes / (experts.d_model * experts.dtype_bytes) * ID_BYTES
    forward += max(comm.alltoall(g, ids) for g in groups)
  rerun = (plan.remat if remat is None else remat) in profile_lib.LAYER_CHECKPOINTED
  backward = 2 * one + (forward if rerun else 0.0)
  return forward / experts.every, backward / experts.every


def block_seconds(plan, shard: Shard, comm, stage: int) -> float:
  """Seconds of one whole MoE block's all-to-alls, forward and backward,
  outside the layer stack's remat (an MTP module's, inside the head)."""
  if not split(plan, shard):
    return 0.0
  return sum(seconds(plan, shard, comm, stage, remat='none')) * shard.experts.every


def busiest_load(plan, experts: Experts, imbalance: float) -> float:
  """The busiest device's expert work over a balanced device's (see the
  module docstring)."""
  if plan.expert == 1:
    return 1.0
  if experts.num_experts % plan.expert:
    raise ValueError(f'expert={plan.expert} does not divide num_experts={experts.num_experts}')
  local = experts.num_experts // plan.expert
  return (imbalance + local - 1) / local


def compute_scale(plan, shard: Shard, imbalance: float, dense: bool = False) -> float:
  """What a layer's compute on the busiest device is over a balanced one:
  its experts' share of the FLOPs slowed by `busiest_load`. Capacity
  dispatch's experts run their fixed [C] buffers however the tokens fall
  (the busiest one's excess is dropped, not computed). `dense` (`runs_dense`):
  each of the E / expert local experts computes all expert x the device's
  own assignments (the exchange's buffer), E x a balanced share whatever
  the load."""
  if dense:
    return 1.0 + shard.experts.fraction * (shard.experts.num_experts - 1)
  if not split(plan, shard) or shard.experts.dispatch == 'capacity':
    return 1.0
  experts = shard.experts
  return 1.0 + experts.fraction * (busiest_load(plan, experts, imbalance) - 1.0)


def runs_dense(plan, shard: Shard, cluster, stage: int) -> bool:
  """Whether `stage`'s grouped matmuls are dense products over every local
  expert: dropless dispatch on a device whose ragged_dot is 'dense'."""
  if shard.experts is None or shard.experts.dispatch != 'dropless':
    return False
  groups = {cluster.devices[d].group for d in plan.stages[stage]}
  return any(cluster.groups[g].ragged_dot == 'dense' for g in groups)


def dense_buffers(plan, shard: Shard) -> float:
  """Bytes per sequence of one MoE layer's dense grouped-matmul buffers
  (`runs_dense`) alive at once in its backward, in the compute dtype: [E /
  expert, expert x a device's assignments, width], E x the assignments'
  rows whatever the expert degree; DENSE_D_MODEL and DENSE_HIDDEN widths."""
  e = shard.experts
  assignments = e.seq_len / plan.context * e.per_token
  width = DENSE_D_MODEL * e.d_model + DENSE_HIDDEN * e.hidden
  return e.num_experts * assignments * width * e.dtype_bytes


def expert_param_bytes(shard: Shard) -> float:
  """One layer shard's routed experts' parameter bytes (0 for a dense layer)."""
  return shard.experts.param_bytes if shard.experts is not None else 0.0


def layer_params(plan, shard: Shard) -> float:
  """One layer's parameter bytes on a device: the experts' over plan.expert."""
  return shard.layer_param_bytes - expert_param_bytes(shard) * (1 - 1 / plan.expert)


def dispatch_stash(plan, shard: Shard, remat: str) -> float:
  """Residual bytes per layer per sequence dropless's exchange adds to what
  one device's own assignments keep (the profile's, at expert 1): with the
  experts split each device's grouped matmuls run expert x as many rows
  (room for every sender's assignments) and keep them, unless a remat
  policy recomputes the layer's experts (those that checkpoint the layer
  do: no dot is saved); over Experts.every, as a MoE layer's share of the
  average one."""
  recomputed = remat in profile_lib.LAYER_CHECKPOINTED
  if not split(plan, shard) or recomputed or shard.experts.dispatch != 'dropless':
    return 0.0
  e = shard.experts
  assignments = e.seq_len / plan.context * e.per_token
  row = (e.d_model + HIDDEN_RESIDUALS * e.hidden) * e.dtype_bytes
  return (plan.expert - 1) * assignments * row / e.every
