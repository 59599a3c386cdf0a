"""Interleaved zero bubble (Qi et al., ICLR'24; torch's
`ScheduleInterleavedZeroBubble`, the paper's ZB-1P with v chunks per stage)."""

from triax.pipeline.ir import WEIGHT, Action, Schedule
from triax.pipeline.schedules.common import check_sizes, schedule
from triax.pipeline.schedules.interleaved import chunk_sequences, round_size


def interleaved_zb(stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
  """Interleaved 1F1B's F/B sequence with the backward split and W's lagged.

  Device d holds chunks d, d+p, ... and runs forwards and backwards in
  interleaved_1f1b's chunk and micro-batch sequence (rounds of r, see
  `interleaved.round_size`), but warms up with only (v-1)*r + (p-d-1)
  forwards: B is the input gradient alone, so a gradient climbs back one
  stage per action instead of two. Each W then trails its B by d
  backwards, as in ZB-H1: the first d backwards run without their W, and
  the last d W's close the step, filling the cool-down bubble. With v = 1
  this is exactly zb_h1.

  Raises:
    ConfigError: if v > 1 and m does not split into equal rounds.
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  # v = 1 has one round of everything: r only matters through (v-1)*r.
  r = round_size('interleaved_zb', p, m) if v > 1 else m
  orders = []
  for d in range(p):
    forwards, backwards = chunk_sequences(p, m, v, r, d)
    warmup = min((v - 1) * r + (p - d - 1), m * v)
    order, pending = forwards[:warmup], []
    for f, b in zip(forwards[warmup:], backwards):
      order.append(f)
      _backward(order, pending, b, lag=d)
    for b in backwards[m * v - warmup :]:
      _backward(order, pending, b, lag=d)
    orders.append(order + pending)
  return schedule('interleaved_zb', p, m, v, orders)


def _backward(order: list[Action], pending: list[Action], b: Action, lag: int) -> None:
  """Appends B, and the W that has waited `lag` backwards (stage d lags d)."""
  order.append(b)
  pending.append(Action(WEIGHT, b.microbatch, b.chunk))
  if len(pending) > lag:
    order.append(pending.pop(0))
