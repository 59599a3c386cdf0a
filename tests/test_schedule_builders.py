"""Interleaved 1F1B, interleaved zero bubble and ZB-V: their orders, lowering,
memory and time against the asynchronous model.

Pure Python: nothing here imports JAX.
"""

import collections

import pytest
from actions import B, F, W

from triax.errors import ConfigError
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action
from triax.pipeline.simulate import Costs, simulate_async

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast


def cases():
  """(name, p, m, v) for the three builders over the sizes the brief names."""
  for p in (2, 4, 8):
    for m in (p, 2 * p, 4 * p):
      for v in (2, 4):
        yield 'interleaved_1f1b', p, m, v
        yield 'interleaved_zb', p, m, v
      yield 'zb_v', p, m, 2
  # Micro-batch counts torch's interleaved schedules accept that are not
  # multiples of p (rounds of r = m // (m // p) micro-batches).
  for m in (3, 5, 6, 7, 10):
    for name in ('interleaved_1f1b', 'interleaved_zb'):
      yield name, 4, m, 2
    yield 'zb_v', 4, m, 2


CASES = list(cases())


def unit_async(schedule):
  """The asynchronous model with every compute action of a chunk costing 1.

  Costs are per stage and a chunk action takes t / v, so t = v per kind.
  The lockstep program runs fused backwards split (B, then W, see
  `ir.with_split_backward`), so this times the schedule as the lockstep
  runs it: the like-with-like comparison for program.ticks.
  """
  v = schedule.virtual_stages
  return simulate_async(sched.with_split_backward(schedule), Costs(v, v, v))


@pytest.mark.parametrize('name, p, m, v', CASES)
def test_every_action_appears_once_on_its_stage(name, p, m, v):
  s = sched.build(name, p, m, v)
  kinds = ('F', 'B', 'W') if name != 'interleaved_1f1b' else ('F', 'B')
  seen = collections.Counter(a for order in s.orders for a in order)
  want = {Action(k, j, c) for k in kinds for j in range(m) for c in range(p * v)}
  assert set(seen) == want and set(seen.values()) == {1}
  for stage, order in enumerate(s.orders):
    assert {s.stage_of(a.chunk) for a in order} == {stage}


@pytest.mark.parametrize('name, p, m, v', CASES)
def test_lowering_matches_the_asynchronous_model(name, p, m, v):
  s = sched.build(name, p, m, v)
  program = sched.lower(s)  # raises ScheduleDeadlock if an order waits on itself
  split = unit_async(s)
  # Each tick runs at most one unit action per stage, each in the first tick
  # after its inputs: the as-soon-as-possible timing of the same orders at
  # unit cost, so the two agree exactly (the brief's 5% is a fortiori).
  assert program.ticks == split.total_time
  # The lockstep runs each stage's order in sequence, so the residual sets
  # it holds at any tick are those of walking the order (F stashes, the
  # freeing B or W frees): the asynchronous model's peak.
  assert program.peaks['stash'] == split.peak_inflight
  if name == 'interleaved_1f1b':
    # The papers' fused backward costs 2 and sends its gradient only when
    # both halves are done; the lockstep sends it after the input-gradient
    # half, so a gradient climbing the p-1 stage boundaries saves one unit
    # at each: exactly p-1 ticks once m >= p keeps every stage busy (fewer
    # micro-batches leave more climbs on the critical path), within 5% once
    # m = 4p.
    fused = simulate_async(s, Costs(v, 2 * v))
    assert fused.peak_inflight == split.peak_inflight
    assert fused.total_time > program.ticks
    if m >= p:
      assert fused.total_time - program.ticks == p - 1
    if m == 4 * p:
      assert program.ticks >= 0.95 * fused.total_time


# ----------------------------------------------------------- interleaved 1F1B


def megatron_orders(p, m, v):
  """The pre-torch-rule builder, verbatim in effect: Megatron's formula for
  p | m (k-th forward: local chunk (k // p) % v of micro-batch
  (k // (p*v))*p + k % p; warm-up 2(p-d-1) + (v-1)p)."""
  orders = []
  for d in range(p):
    mb = [(k // (p * v)) * p + k % p for k in range(m * v)]
    fwd = [F(mb[k], ((k // p) % v) * p + d) for k in range(m * v)]
    bwd = [B(mb[k], (v - 1 - (k // p) % v) * p + d) for k in range(m * v)]
    warmup = min(2 * (p - d - 1) + (v - 1) * p, m * v)
    order = fwd[:warmup]
    for i in range(m * v - warmup):
      order += [fwd[warmup + i], bwd[i]]
    orders.append(tuple(order + bwd[m * v - warmup :]))
  return tuple(orders)


@pytest.mark.parametrize(
  'p, m, v', [(p, k * p, v) for p in (2, 3, 4, 8) for k in (1, 2, 3, 4) for v in (2, 3, 4)]
)
def test_interleaved_keeps_megatron_order_when_p_divides_m(p, m, v):
  assert sched.build('interleaved_1f1b', p, m, v).orders == megatron_orders(p, m, v)


def test_interleaved_small_megatron_case():
  s = sched.build('interleaved_1f1b', 2, 2, 2)
  # Stage 0 warms up with 2(p-1) + (v-1)p = 4 forwards: all of them.
  assert s.orders[0] == (F(0, 0), F(1, 0), F(0, 2), F(1, 2), B(0, 2), B(1, 2), B(0, 0), B(1, 0))
  assert s.orders[1] == (F(0, 1), F(1, 1), F(0, 3), B(0, 3), F(1, 3), B(1, 3), B(0, 1), B(1, 1))


def test_interleaved_rounds_when_p_does_not_divide_m():
  # p=2, m=3: one round of r=3 micro-batches per chunk; stage 0 warms up
  # with (v-1)r + 2(p-1) = 5 forwards, stage 1 with 3 (torch's orders).
  s = sched.build('interleaved_1f1b', 2, 3, 2)
  assert s.orders[0] == (
    F(0, 0),
    F(1, 0),
    F(2, 0),
    F(0, 2),
    F(1, 2),
    F(2, 2),
    B(0, 2),
    B(1, 2),
    B(2, 2),
    B(0, 0),
    B(1, 0),
    B(2, 0),
  )
  assert s.orders[1] == (
    F(0, 1),
    F(1, 1),
    F(2, 1),
    F(0, 3),
    B(0, 3),
    F(1, 3),
    B(1, 3),
    F(2, 3),
    B(2, 3),
    B(0, 1),
    B(1, 1),
    B(2, 1),
  )


@pytest.mark.parametrize('name', ['interleaved_1f1b', 'interleaved_zb'])
def test_interleaved_accepts_the_micro_batch_counts_torch_does(name):
  # torch: rounds = max(1, m // p) must divide m.
  ok = []
  for m in range(1, 17):
    try:
      sched.build(name, 4, m, 2)
      ok.append(m)
    except ConfigError:
      pass
  assert ok == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 16]
  with pytest.raises(ConfigError) as e:
    sched.build(name, 4, 9, 2)
  assert e.value.key == 'pipeline.microbatches'
  assert 'got 9 (nearest that work: 8 and 10)' in e.value.message
  # One chunk per stage has no rounds: every m works.
  sched.build(name, 4, 9, 1)


# ----------------------------------------------------- interleaved zero bubble


@pytest.mark.parametrize('p, m', [(2, 2), (4, 3), (4, 8), (8, 16)])
def test_interleaved_zb_with_one_chunk_is_zb_h1(p, m):
  assert sched.build('interleaved_zb', p, m).orders == sched.build('zb_h1', p, m).orders


def test_interleaved_zb_small_case():
  s = sched.build('interleaved_zb', 2, 2, 2)
  # Warm-up (v-1)r + (p-d-1): 3 on stage 0, 2 on stage 1; W trails its B by
  # d backwards.
  assert s.orders[0] == (
    F(0, 0),
    F(1, 0),
    F(0, 2),
    F(1, 2),
    B(0, 2),
    W(0, 2),
    B(1, 2),
    W(1, 2),
    B(0, 0),
    W(0, 0),
    B(1, 0),
    W(1, 0),
  )
  assert s.orders[1] == (
    F(0, 1),
    F(1, 1),
    F(0, 3),
    B(0, 3),
    F(1, 3),
    B(1, 3),
    W(0, 3),
    B(0, 1),
    W(1, 3),
    B(1, 1),
    W(0, 1),
    W(1, 1),
  )


@pytest.mark.parametrize(
  'p, m, v',
  [(p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p) for v in (2, 4)]
  + [(4, m, 2) for m in (3, 5, 6, 7, 10)],
)
def test_interleaved_zb_bubble_is_below_interleaved_1f1b(p, m, v):
  # Same 3mv unit actions per stage in both lockstep programs, so fewer
  # ticks is a smaller bubble.
  zb = sched.lower(sched.build('interleaved_zb', p, m, v))
  fused = sched.lower(sched.build('interleaved_1f1b', p, m, v))
  assert zb.ticks < fused.ticks


# ----------------------------------------------------------------------- ZB-V


def test_zb_v_places_chunks_in_a_v():
  s = sched.build('zb_v', 4, 8, 2)
  assert s.placement == (0, 1, 2, 3, 3, 2, 1, 0)
  assert [s.chunks_of(d) for d in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.parametrize('v', [1, 3, 4])
def test_zb_v_needs_two_chunks_per_stage(v):
  with pytest.raises(ConfigError) as e:
    sched.build('zb_v', 4, 8, v)
  assert e.value.key == 'pipeline.virtual_stages'
  assert f'exactly 2 model chunks per stage (a V); got {v}' in e.value.message


def test_zb_v_small_case():
  # p=2, m=3 = 2p-1, the fewest micro-batches that fill the V (torch's orders).
  s = sched.build('zb_v', 2, 3, 2)
  assert s.orders[0] == (
    F(0, 0),
    F(1, 0),
    F(2, 0),
    F(0, 3),
    B(0, 3),
    W(0, 3),
    F(1, 3),
    B(1, 3),
    W(1, 3),
    B(0, 0),
    W(0, 0),
    F(2, 3),
    B(2, 3),
    W(2, 3),
    B(1, 0),
    W(1, 0),
    B(2, 0),
    W(2, 0),
  )
  assert s.orders[1] == (
    F(0, 1),
    F(0, 2),
    F(1, 1),
    F(1, 2),
    B(0, 2),
    W(0, 2),
    F(2, 1),
    B(0, 1),
    W(0, 1),
    F(2, 2),
    B(1, 2),
    W(1, 2),
    B(1, 1),
    B(2, 2),
    B(2, 1),
    W(1, 1),
    W(2, 2),
    W(2, 1),
  )


@pytest.mark.parametrize(
  'p, m', [(p, m) for p in (1, 2, 4, 8) for m in (1, 2, p, 2 * p - 1, 2 * p, 4 * p, 4 * p + 1)]
)
def test_zb_v_memory_is_p_micro_batches(p, m):
  # The paper (table 4) and torch: ZB-V holds p micro-batches of a whole
  # stage's activations, 1F1B's largest stage; a chunk's set is half of
  # one, so at most 2p sets, reached by every stage once m >= 2p-1 fills
  # the V.
  peaks = sched.lower(sched.build('zb_v', p, m, 2)).peaks['stash']
  assert max(peaks) <= 2 * p
  if m >= 2 * p - 1:
    assert set(peaks) == {2 * p}


@pytest.mark.parametrize('p', [1, 2, 3, 4, 8])
def test_zb_v_bubble_is_the_pipeline_fill_only(p):
  # With F = B = W = 1 each stage has 6m actions and the last stage cannot
  # start before chunks 0..p-2 have run, p-1 ticks: 6m + p - 1 is the least
  # any schedule can take, and ZB-V takes it once m >= (3p-1)/2. Fewer
  # micro-batches leave the V's two halves waiting on each other.
  for m in range(1, 4 * p + 2):
    ticks = sched.lower(sched.build('zb_v', p, m, 2)).ticks
    assert ticks == max(6 * m + p - 1, 4 * m + 4 * p - 2), m
    if 2 * m >= 3 * p - 1:
      assert ticks == 6 * m + p - 1


def test_registry_names_the_new_builders():
  for name in ('interleaved_zb', 'zb_v'):
    assert name in sched.SCHEDULES
    assert sched.build(name, 2, 4, 2).name == name
  assert sched.SCHEDULES['zb_v'] is sched.zb_v
  assert sched.SCHEDULES['interleaved_zb'] is sched.interleaved_zb
