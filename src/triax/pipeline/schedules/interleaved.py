"""Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21), with torch's
relaxed micro-batch counts.

The rounds rule here is shared with `interleaved_zb`, which runs the same
forward/backward sequence with the backward split.
"""

import dataclasses

from triax.errors import ConfigError
from triax.pipeline.ir import BACKWARD, FORWARD, Action, Schedule
from triax.pipeline.schedules.common import check_sizes, schedule
from triax.pipeline.schedules.one_f_one_b import one_f_one_b


def interleaved_1f1b(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """Device d holds chunks d, d+p, ... (v chunks); one fused B per F.

  Micro-batches run in rounds of r of them (see `round_size`; r = p when
  p divides m, Megatron's case). Device d's k-th forward is local chunk
  (k // r) % v of micro-batch (k // (r*v))*r + k % r, its k-th backward the
  same micro-batch in local chunk v-1-((k // r) % v). It warms up with
  (v-1)*r + 2(p-d-1) forwards (capped at m*v), alternates F and B, then
  drains the remaining backwards. These are the per-rank orders of torch's
  `ScheduleInterleaved1F1B` (its stage index is our chunk, its rank our
  stage), which for r = p are Megatron's.

  With v = 1 Megatron's warm-up formula would give 2(p-d-1) forwards, which
  is bubble-optimal too but stashes more; we use PipeDream-Flush's p-d-1
  instead, so v = 1 is exactly 1f1b.

  Raises:
    ConfigError: if v > 1 and m does not split into equal rounds (see
      `round_size`).
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  if v == 1:
    return dataclasses.replace(one_f_one_b(p, m), name='interleaved_1f1b')
  r = round_size('interleaved_1f1b', p, m)
  orders = []
  for d in range(p):
    forwards, backwards = chunk_sequences(p, m, v, r, d)
    warmup = min((v - 1) * r + 2 * (p - d - 1), m * v)
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
      order += [f, b]
    order += backwards[m * v - warmup :]
    orders.append(order)
  return schedule('interleaved_1f1b', p, m, v, orders)


def round_size(name: str, stages: int, microbatches: int) -> int:
  """Micro-batches per round of an interleaved schedule (torch's rule).

  A device runs r micro-batches through one of its chunks before moving to
  the next, so r >= p keeps the ring busy: with m // p rounds (at least 1)
  of r = m / rounds micro-batches each, r is m itself when m < p and
  between p and 2p-1 otherwise. Megatron's r = p is the case p | m.

  Raises:
    ConfigError: if m is not a multiple of its number of rounds (e.g. for
      p = 4: 9, 11, 13 and 14 are refused, 1-8, 10, 12 and 15 are fine).
  """
  rounds = max(1, microbatches // stages)
  if microbatches % rounds:
    ok = [n for n in range(1, 4 * microbatches) if n % max(1, n // stages) == 0]
    below = max(n for n in ok if n < microbatches)
    above = min(n for n in ok if n > microbatches)
    raise ConfigError(
      'pipeline.microbatches',
      f'{name} with virtual stages runs micro-batches in equal rounds of '
      f'mesh.pipe (={stages}) to {2 * stages - 1}: m must be below {stages} or a '
      f'multiple of m // {stages}; got {microbatches} (nearest that work: '
      f'{below} and {above})',
    )
  return microbatches // rounds


def chunk_sequences(
  stages: int, microbatches: int, virtual_stages: int, per_round: int, stage: int
) -> tuple[list[Action], list[Action]]:
  """Stage `stage`'s forwards and backwards in the order it runs each kind.

  Forwards sweep the local chunks upwards and backwards downwards, one
  round of `per_round` micro-batches per chunk at a time (depth first: a
  micro-batch goes on to the next chunk before a later round starts).
  """
  p, v, r = stages, virtual_stages, per_round
  total = microbatches * v

  def microbatch(k: int) -> int:
    return (k // (r * v)) * r + k % r

  forwards = [Action(FORWARD, microbatch(k), ((k // r) % v) * p + stage) for k in range(total)]
  backwards = [
    Action(BACKWARD, microbatch(k), (v - 1 - (k // r) % v) * p + stage) for k in range(total)
  ]
  return forwards, backwards
