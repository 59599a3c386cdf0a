"""BPipe (activation eviction) and ZB-H1 (split backward): builders, lowering,
validator, time models, pictures and CLI.

Pure Python: nothing here imports JAX.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from actions import B, F, W

from triax.errors import ConfigError
from triax.pipeline import lower as lower_lib
from triax.pipeline import render
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action
from triax.pipeline.simulate import Costs, simulate_async, simulate_lockstep
from triax.pipeline.validate import validate

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'src')
PM = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def ticks_of(program):
  return {a: t for t, row in enumerate(program.grid) for cell in row for a in cell}


def replace_tables(program, changes, grid=None):
  """A copy of program with entries {(table, index): value} changed."""
  table = {k: x.copy() for k, x in program.table.items()}
  for (name, index), value in changes.items():
    table[name][index] = value
  extra = {} if grid is None else {'grid': tuple(tuple(map(tuple, row)) for row in grid)}
  return dataclasses.replace(program, table=table, **extra)


def moves_grid(program, action, to):
  """program.grid with `action` moved from its tick to tick `to`."""
  grid = [list(map(list, row)) for row in program.grid]
  ((t, stage),) = [
    (t, q) for t, row in enumerate(grid) for q, cell in enumerate(row) if action in cell
  ]
  grid[t][stage].remove(action)
  grid[to][stage].append(action)
  return grid


# ---------------------------------------------------------------- zb_h1


def test_zb_h1_orders_lag_weight_gradients_by_the_stage_index():
  s = sched.build('zb_h1', 4, 6)
  # Stage 0: 1F1B with each W right behind its B.
  assert s.orders[0] == (
    F(0, 0),
    F(1, 0),
    F(2, 0),
    F(3, 0),
    B(0, 0),
    W(0, 0),
    F(4, 0),
    B(1, 0),
    W(1, 0),
    F(5, 0),
    B(2, 0),
    W(2, 0),
    B(3, 0),
    W(3, 0),
    B(4, 0),
    W(4, 0),
    B(5, 0),
    W(5, 0),
  )
  # Stage 3: W(k) follows B(k+3); the last three W's close the step.
  assert s.orders[3] == (
    F(0, 3),
    B(0, 3),
    F(1, 3),
    B(1, 3),
    F(2, 3),
    B(2, 3),
    F(3, 3),
    B(3, 3),
    W(0, 3),
    F(4, 3),
    B(4, 3),
    W(1, 3),
    F(5, 3),
    B(5, 3),
    W(2, 3),
    W(3, 3),
    W(4, 3),
    W(5, 3),
  )
  # Without the W's the order is 1F1B's.
  for stage, order in enumerate(s.orders):
    assert tuple(a for a in order if a.kind != 'W') == (sched.build('1f1b', 4, 6).orders[stage])


@pytest.mark.parametrize('p', [1, 2, 3, 4, 8])
@pytest.mark.parametrize('m', [1, 3, 8, 32])
def test_zb_h1_is_valid_and_lowers_to_its_papers_ticks(p, m):
  s = sched.build('zb_h1', p, m)
  program = sched.lower(s)
  assert validate(s, program) == []
  assert program.split_backward and program.partner is None
  assert program.schedule == s  # already split: run as built
  one = sched.lower(sched.build('1f1b', p, m))
  if m >= p:
    # The paper's 3m + p - 1 (t_F = t_B = t_W = 1 tick) against 1F1B's
    # lockstep 3m + 2(p-1): the W's fill the cool-down.
    assert program.ticks == 3 * m + p - 1
  assert program.ticks <= one.ticks == 3 * m + 2 * (p - 1)
  tick = ticks_of(program)
  for j in range(m):
    for c in range(p):
      assert tick[B(j, c)] < tick[W(j, c)]
  # Deferring W never raises the largest stash: every device compiles the
  # same pool, so that is the memory that counts.
  assert program.slots['stash'] == one.slots['stash']
  assert (program.table['move_send'] == -1).all()
  assert (program.table['move_recv'] == -1).all()


def test_zb_h1_weight_rows_match_the_grid():
  program = sched.lower(sched.build('zb_h1', 4, 8))
  tick, table = ticks_of(program), program.table
  for a, t in tick.items():
    if a.kind != 'W':
      continue
    c = a.chunk
    assert (table['kind'][t, c], table['mb'][t, c], table['chunk'][t, c]) == (
      lower_lib.RUN_W,
      a.microbatch,
      c,
    )
    tb = tick[B(a.microbatch, c)]
    assert table['stash'][t, c] == table['stash'][tb, c]
    assert table['cut'][t, c] == table['cut'][tb, c]
    assert table['src'][t, c] == table['loss'][t, c] == -1
  assert (table['kind'] == lower_lib.RUN_W).sum() == 4 * 8


def test_fused_schedules_run_w_and_move_nothing():
  for name in ('gpipe', '1f1b', 'interleaved_1f1b'):
    program = sched.lower(sched.build(name, 4, 8))
    assert not program.split_backward and program.partner is None
    # The lowering runs each fused B as B then W.
    assert (program.table['kind'] == lower_lib.RUN_W).sum() == 4 * 8
    assert (program.table['move_send'] == -1).all()
    assert (program.table['move_recv'] == -1).all()


def test_zb_h1_async_bubble_is_at_most_half_of_1f1b():
  """Like with like, asynchronous model, no transfer cost: zb_h1 with
  t_F = t_B = t_W = 1 against 1f1b with t_F = 1 and its fused backward
  t_B = 2 = B + W, so both do the same work per micro-batch (3 units).
  ZB-H1's bubble is (p-1) per stage against 1F1B's 3(p-1): a third of the
  time, and at most half of 1F1B's bubble fraction."""
  p, m = 4, 8
  zb = simulate_async(sched.build('zb_h1', p, m), Costs(1, 1, t_weight=1))
  one = simulate_async(sched.build('1f1b', p, m), Costs(1, 2))
  assert zb.busy == one.busy
  assert one.total_time == 3 * m + 3 * (p - 1)
  assert zb.total_time == 3 * m + (p - 1)
  assert zb.bubble_fraction <= one.bubble_fraction / 2
  # Same peak memory as 1F1B: every stage holds at most stage 0's p.
  assert zb.peak_inflight == (p,) * p
  assert max(one.peak_inflight) == p


@pytest.mark.parametrize('p, m', PM)
def test_zb_h1_bubbles_in_both_models(p, m):
  """Unit costs as above. ZB-H1 takes 3m + (p-1) in both models: the
  lockstep program is its asynchronous run at unit cost. 1F1B (fused t_B =
  2, run as B = W = 1 in the lockstep program) takes 3(m+p-1)
  asynchronously but 3m + 2(p-1) in lockstep, where its B chain moves a
  stage a tick: ZB-H1's bubble is half of 1F1B's lockstep one, a third of
  its asynchronous one."""
  s = sched.build('zb_h1', p, m)
  program = sched.lower(s)
  zb = simulate_async(s, Costs(1, 1, t_weight=1))
  assert zb.total_time == 3 * m + (p - 1)
  lock = simulate_lockstep(program, Costs(1, 1, t_weight=1))
  assert lock.total_time == 3 * m + (p - 1)
  one_program = sched.lower(sched.build('1f1b', p, m))
  one = simulate_lockstep(one_program, Costs(1, 2))
  assert one.total_time == 3 * m + 2 * (p - 1)
  assert simulate_async(one_program.source, Costs(1, 2)).total_time == 3 * (m + p - 1)
  assert lock.busy == one.busy == (3 * m,) * p
  assert lock.peak_inflight == program.peak_stash == (p,) * p


def test_zb_h1_lockstep_peaks_and_cut_slots():
  program = sched.lower(sched.build('zb_h1', 4, 16))
  assert program.peak_stash == (4, 4, 4, 4)
  # Stage s's W lags its B by s backwards, so it holds s + 1 cuts.
  assert program.peaks['cut'] == (1, 2, 3, 4)
  assert program.slots == {'msg': 2, 'stash': 4, 'cut': 4}


def test_zb_h1_needs_one_chunk_per_stage():
  with pytest.raises(ConfigError) as e:
    sched.build('zb_h1', 4, 8, 2)
  assert e.value.key == 'pipeline.virtual_stages'
  assert 'zb_h1 runs one model chunk per stage' in e.value.message


def test_validator_wants_one_weight_action_per_backward_when_split():
  s = sched.build('zb_h1', 2, 2)
  orders = list(s.orders)
  orders[0] = tuple(a for a in orders[0] if a != W(1, 0))
  assert validate(dataclasses.replace(s, orders=tuple(orders))) == [
    'stage 0: W1.0 runs 0 times (want exactly 1)'
  ]
  orders = list(s.orders)
  orders[1] = (W(0, 1),) + tuple(a for a in orders[1] if a != W(0, 1))
  assert 'stage 1 position 0: W0.1 runs before its B0.1 (position 2)' in validate(
    dataclasses.replace(s, orders=tuple(orders))
  )


def test_validator_rejects_a_weight_action_before_its_backward_tick():
  s = sched.build('zb_h1', 2, 2)
  program = sched.lower(s)
  tick = ticks_of(program)
  tw, tb = tick[W(0, 0)], tick[B(0, 0)]
  assert (tb, tw) == (3, 4) and program.grid[2][0] == ()
  changes = {(name, (2, 0)): x[tw, 0] for name, x in program.table.items()}
  changes.update(
    {(name, (tw, 0)): lower_lib.IDLE if name == 'kind' else -1 for name in program.table}
  )
  broken = replace_tables(program, changes, moves_grid(program, W(0, 0), 2))
  problems = validate(s, broken)
  assert 'tick 2 stage 0: W0.0 runs before its input from B0.0 (tick 3)' in problems
  assert ('stage 0: its compute action 2 is W0.0 in the program but B0.0 in its order') in problems


def test_validator_sees_that_split_backwards_keep_their_slots():
  s = sched.build('zb_h1', 2, 4)
  program = sched.lower(s)
  # Point a W at a slot nothing was stashed in.
  t = next(t for t in range(program.ticks) if program.table['kind'][t, 1] == lower_lib.RUN_W)
  spare = program.slots['stash']
  broken = dataclasses.replace(
    replace_tables(program, {('stash', (t, 1)): spare}), slots=dict(program.slots, stash=spare + 1)
  )
  assert any(f'stash slot {spare} is empty' in x for x in validate(s, broken))
  # And a W at a cut its B did not write.
  broken = dataclasses.replace(
    replace_tables(program, {('cut', (t, 1)): program.slots['cut']}),
    slots=dict(program.slots, cut=program.slots['cut'] + 1),
  )
  assert any(f'cut slot {program.slots["cut"]} is empty' in x for x in validate(s, broken))


# ---------------------------------------------------------------- bpipe


def own_peaks_1f1b(p, m):
  """Per tick and stage, the sets 1F1B lockstep holds in the compute phase
  (from each F's tick to its W's)."""
  one = sched.lower(sched.build('1f1b', p, m))
  tick = ticks_of(one)
  held = np.zeros((one.ticks, p), int)
  for j in range(m):
    for s in range(p):
      held[tick[F(j, s)] : tick[W(j, s)] + 1, s] += 1
  return held


@pytest.mark.parametrize('p, m', PM)
def test_bpipe_properties(p, m):
  s = sched.build('bpipe', p, m)
  program = sched.lower(s)
  assert validate(s, program) == []
  cap = s.stash_cap
  assert cap == sched.bpipe_stash_cap(p, m)
  assert max(program.peak_stash) <= cap
  assert program.slots['stash'] == cap
  # 1F1B's stage s holds p - s sets, a pair p + 1: each side about half.
  assert cap == math.ceil((p + 1) / 2)
  # And no pairing can do with less under 1F1B's ticks: a pair holds
  # held[s] + held[p-1-s] sets at once and each side has cap slots.
  held = own_peaks_1f1b(p, m)
  least = max(
    math.ceil((held[t, q] + held[t, p - 1 - q]) / 2) if q != p - 1 - q else held[t, q]
    for t in range(held.shape[0])
    for q in range(p)
  )
  assert cap == least
  # Same ticks, same F/B/W placement as 1F1B lockstep.
  one = sched.lower(sched.build('1f1b', p, m))
  assert program.ticks == one.ticks == 3 * m + 2 * (p - 1)
  tick = ticks_of(program)
  for a, t in ticks_of(one).items():
    assert tick[a] == t
  # Every evicted set leaves at the start of the tick after its F and is
  # back at the start of its B's tick (the partner ppermute opens a tick).
  for j, c in s.evicted:
    evict, load = tick[Action('EVICT', j, c)], tick[Action('LOAD', j, c)]
    assert tick[F(j, c)] + 1 == evict < load == tick[B(j, c)]
  assert s.partner == tuple(p - 1 - q for q in range(p))
  # The program names the pairing only when something moves, so the
  # executor can leave out the residual ppermute otherwise.
  assert program.partner == (s.partner if s.evicted else None)
  assert bool(s.evicted) == (p > 2)  # at p = 2 the pair (2, 1) fits in 2


def test_bpipe_evicts_from_heavy_to_light_only():
  for p, m in PM + [(3, 9), (5, 20)]:
    s = sched.build('bpipe', p, m)
    program = sched.lower(s)
    for _, c in s.evicted:
      assert c < p - 1 - c  # the heavy stage of its pair
    send, recv = program.table['move_send'], program.table['move_recv']
    for t, row in enumerate(program.grid):
      for q, cell in enumerate(row):
        kinds = {a.kind for a in cell} & {'EVICT', 'LOAD'}
        heavy, light = q < p - 1 - q, q > p - 1 - q
        assert kinds <= ({'EVICT'} if heavy else {'LOAD'} if light else set())
        # Each send has its receive on the partner in the same tick.
        assert (send[t, q] >= 0) == bool(kinds) == (recv[t, p - 1 - q] >= 0)
    if p % 2:
      assert (send[:, p // 2] == -1).all() and (recv[:, p // 2] == -1).all()


def test_bpipe_transfers_per_step():
  program = sched.lower(sched.build('bpipe', 4, 16))
  moved = sched.transfers_per_step(program)
  # Stage 1 (3 sets) and 2 (2) already fit the cap of 3; stage 0 (4) does not.
  assert moved == {'evictions': (5, 0, 0, 0), 'loads': (0, 0, 0, 5), 'total': 10}
  assert sched.transfers_per_step(sched.lower(sched.build('1f1b', 4, 16))) == {
    'evictions': (0,) * 4,
    'loads': (0,) * 4,
    'total': 0,
  }


def test_bpipe_lands_into_a_slot_sent_from_in_the_same_tick():
  # A set arriving lands after every send slot of the tick was read: the
  # lowering relies on that to keep stage 0 (EVICT5.0 out, LOAD2.0 in at
  # the start of tick 13, B2.0 reading it in that tick) within its cap.
  program = sched.lower(sched.build('bpipe', 4, 8))
  send, recv = program.table['move_send'], program.table['move_recv']
  assert program.grid[13][0] == (B(2, 0), Action('EVICT', 5, 0))
  assert send[13, 0] == recv[13, 0] == program.table['stash'][13, 0] >= 0
  assert validate(program.source, program) == []


def test_bpipe_needs_one_chunk_per_stage():
  with pytest.raises(ConfigError) as e:
    sched.build('bpipe', 4, 8, 2)
  assert e.value.key == 'pipeline.virtual_stages'


def test_validator_rejects_an_eviction_without_its_load():
  s = sched.build('bpipe', 4, 8)
  loads = [a for a in s.orders[3] if a.kind == 'LOAD']
  orders = s.orders[:3] + (tuple(a for a in s.orders[3] if a != loads[0]),)
  problems = validate(dataclasses.replace(s, orders=orders))
  a = loads[0]
  assert problems == [f'{a.microbatch}.{a.chunk} is evicted 1 times but loaded 0 times']


def test_validator_rejects_bad_partners():
  s = sched.build('bpipe', 4, 8)
  assert validate(dataclasses.replace(s, partner=(1, 2, 3, 0))) == [
    'partner of stage 0 is 1, whose partner is 2 (partners must pair up)',
    'partner of stage 1 is 2, whose partner is 3 (partners must pair up)',
    'partner of stage 2 is 3, whose partner is 0 (partners must pair up)',
    'partner of stage 3 is 0, whose partner is 1 (partners must pair up)',
  ]
  assert any('no partner pairing' in x for x in validate(dataclasses.replace(s, partner=None)))
  # A stage paired with itself has nowhere to evict to.
  selfish = dataclasses.replace(s, partner=(0, 1, 2, 3))
  assert any('is its own partner' in x for x in validate(selfish))


def test_validator_rejects_a_load_after_its_backward():
  s = sched.build('bpipe', 4, 8)
  program = sched.lower(s)
  tick = ticks_of(program)
  load = Action('LOAD', 2, 0)
  t = tick[load]
  assert t == tick[B(2, 0)] == 13
  send, recv = program.table['move_send'], program.table['move_recv']
  broken = replace_tables(
    program,
    {
      ('move_send', (t, 3)): -1,
      ('move_recv', (t, 0)): -1,
      ('move_send', (t + 1, 3)): send[t, 3],
      ('move_recv', (t + 1, 0)): recv[t, 0],
    },
    moves_grid(program, load, t + 1),
  )
  problems = validate(s, broken)
  assert f'tick {t} stage 0: B2.0 runs before its input from LOAD2.0 (tick {t + 1})' in problems


def test_validator_replays_evictions():
  s = sched.build('bpipe', 4, 8)
  program = sched.lower(s)
  t = next(t for t in range(program.ticks) if program.table['move_send'][t, 0] >= 0)
  assert program.grid[t][0] == (F(3, 0), Action('EVICT', 2, 0))
  dropped = replace_tables(program, {('move_recv', (t, 3)): -1})
  assert (
    f'tick {t} stage 3: drops set 2.0 from stage 0 (move_recv is -1: no consumer slot)'
  ) in validate(s, dropped)
  phantom = replace_tables(program, {('move_send', (t, 1)): 0})
  assert f'tick {t} stage 1: grid has no residual move but move_send is 0' in validate(s, phantom)
  # Landing on a live set: EVICT5.0 lands on stage 3 at the start of tick
  # 13, while set 3.3 (F at 12, W at 14) is held there.
  assert tick_of(program, Action('EVICT', 5, 0)) == tick_of(program, F(3, 3)) + 1 == 13
  live = program.table['stash'][12, 3]
  clobber = replace_tables(program, {('move_recv', (13, 3)): live})
  assert validate(s, clobber)[0] == (
    f'tick 13 stage 3: landing set 5.0: stash slot {live} still holds set 3.3 '
    '(overwritten by set 5.0)'
  )


def tick_of(program, action):
  return ticks_of(program)[action]


def test_validator_holds_programs_to_the_stash_cap():
  s = sched.build('bpipe', 4, 8)
  program = sched.lower(s)
  tight = dataclasses.replace(s, stash_cap=2)
  problems = validate(tight, program)
  assert (
    "stash pools need 3 slots (per stage (3, 3, 2, 2)), more than the schedule's "
    'cap of 2' in problems
  )
  # 1F1B's program, which keeps every set at home, does not fit a cap of 3.
  one = dataclasses.replace(sched.build('1f1b', 4, 8), stash_cap=3)
  assert any('stash pools need 4 slots' in x for x in validate(one, sched.lower(one)))


def test_lowering_waits_for_an_evicted_set_to_come_back():
  """An idle tick is not a deadlock when a B only waits for its evicted set."""
  # The last stage evicts the set of F0.1 (tick 1) to stage 0. B0.1 cannot
  # run at tick 2 (the set leaves at its start) and nothing else can run
  # then either; at tick 3 it can: EVICT at 2, LOAD at 3, each before the
  # tick's compute.
  one = sched.build('1f1b', 2, 2)
  orders = (
    one.orders[0][:2] + (Action('LOAD', 0, 1),) + one.orders[0][2:],
    (F(0, 1), Action('EVICT', 0, 1), B(0, 1), F(1, 1), B(1, 1)),
  )
  s = dataclasses.replace(one, orders=orders, partner=(1, 0))
  assert validate(s) == []
  program = sched.lower(s)
  tick = ticks_of(program)
  assert (tick[Action('EVICT', 0, 1)], tick[Action('LOAD', 0, 1)], tick[B(0, 1)]) == (2, 3, 3)
  assert validate(s, program) == []


# ---------------------------------------------------------------- time models


@pytest.mark.parametrize('p, m', PM)
def test_bpipe_costs_only_transfer_time(p, m):
  s = sched.build('bpipe', p, m)
  program = sched.lower(s)
  one = sched.build('1f1b', p, m)
  costs = Costs(1, 2)
  # Free copies: exactly 1F1B in both models.
  assert simulate_async(s, costs).total_time == (simulate_async(one, costs).total_time)
  lock = simulate_lockstep(program, costs)
  assert lock.total_time == simulate_lockstep(sched.lower(one), costs).total_time
  assert lock.peak_inflight == program.peak_stash
  # Lockstep: the executor's residual ppermute opens the ticks where some
  # stage moves a set, so each of those grows by t_evict.
  slow = simulate_lockstep(program, Costs(1, 2, t_evict=0.5))
  moving = sum(
    any(a.kind in sched.COPY_KINDS for cell in row for a in cell) for row in program.grid
  )
  assert (moving > 0) == (p > 2)  # at p = 2 nothing needs to move
  assert math.isclose(slow.total_time, lock.total_time + 0.5 * moving)
  # It runs before the tick's compute, not beside the neighbour ppermutes
  # that end the tick: a transfer cost hides none of it.
  sends = simulate_lockstep(program, Costs(1, 2, t_transfer=0.3)).total_time
  both = simulate_lockstep(program, Costs(1, 2, t_transfer=0.3, t_evict=0.5)).total_time
  assert math.isclose(both, sends + 0.5 * moving)
  # Copies are not compute: busy time is 1F1B's.
  assert slow.busy == lock.busy


def test_async_copies_run_on_the_copy_stream():
  s = sched.build('bpipe', 4, 8)
  result = simulate_async(s, Costs(1, 2, t_evict=0.5))
  spans = {str(x.action): x for x in result.timeline}
  evict = spans['EVICT2.0']
  assert evict.stage == 0 and evict.end - evict.start == 0.5
  load = spans['LOAD2.0']
  # Issued after the light stage's own B of the micro-batch.
  assert load.stage == 3 and load.start >= spans['B2.3'].end
  # The light stage keeps computing while its copy stream loads.
  assert any(
    x.stage == 3 and x.action.kind in 'FBW' and x.start < load.end and x.end > load.start
    for x in result.timeline
  )
  assert spans['B2.0'].start >= load.end
  assert result.busy == simulate_async(sched.build('1f1b', 4, 8), Costs(1, 2)).busy


def test_costs_time_copies():
  costs = Costs(t_evict=0.5)
  assert costs.of('EVICT', 1) == costs.of('LOAD', 1) == 0.5
  assert costs.of('LOAD', 2) == 0.25
  with pytest.raises(ValueError, match='t_evict'):
    Costs(t_evict=-1.0)


# ---------------------------------------------------------------- pictures, CLI


def test_text_grid_shows_w_and_copies():
  lines = render.text_grid(sched.lower(sched.build('zb_h1', 2, 2))).splitlines()
  assert [x.split()[0] for x in lines[2:5]] == ['s0', 'B', 'W']
  lines = render.text_grid(sched.lower(sched.build('bpipe', 4, 8))).splitlines()
  assert len(lines) == 2 + 4 * 4  # title, ticks, F/B/W/X per stage
  assert lines[5].split()[0] == 'X'
  heavy_x, light_x = lines[5], lines[17]
  assert 'E2.0' in heavy_x and 'l2.0' in heavy_x
  assert 'e2.0' in light_x and 'L2.0' in light_x
  assert len({len(x) for x in lines[1:]}) == 1


def test_gantt_and_trace_show_new_kinds(tmp_path):
  for name in ('bpipe', 'zb_h1'):
    s = sched.build(name, 4, 8)
    path = tmp_path / f'{name}.png'
    render.gantt_png(s, sched.lower(s), Costs(1, 1, 1, t_evict=0.25), str(path))
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  trace = render.chrome_trace(
    simulate_async(sched.build('bpipe', 4, 8), Costs(t_evict=0.5)), time_scale=1.0
  )
  names = {e['args']['name'] for e in trace['traceEvents'] if e['name'] == 'thread_name'}
  assert 'stage 0 copy' in names
  copies = [e for e in trace['traceEvents'] if e.get('cat') == 'EVICT']
  assert copies and all(e['tid'] == 4 for e in copies)  # stage 0's copy thread


def run_cli(*args):
  env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run(
    [sys.executable, '-m', 'triax.cli.schedule', *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )


def test_cli_bpipe_json():
  out = run_cli('--schedule=bpipe', '--stages=4', '--microbatches=16', '--json')
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert report['valid'] is True
  assert report['ticks'] == 3 * 16 + 2 * 3
  assert report['slots']['stash'] == report['stash_cap'] == 3
  assert report['peak_inflight'] == report['peaks']['stash'] == [3, 3, 2, 2]
  assert report['residual_sets_moved'] == 10
  assert report['transfers_per_step'] == {
    'evictions': [5, 0, 0, 0],
    'loads': [0, 0, 0, 5],
    'total': 10,
  }
  assert report['partner'] == [3, 2, 1, 0]


def test_cli_zb_h1_json():
  out = run_cli('--schedule=zb_h1', '--stages=4', '--microbatches=8', '--json')
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert report['valid'] is True and report['split_backward'] is True
  assert report['slots'] == {'msg': 2, 'stash': 4, 'cut': 4}
  assert report['residual_sets_moved'] == 0 and 'partner' not in report
  # CLI defaults are ZB-H1's t_F = t_B = t_W = 1: 3m + p - 1 in both models.
  assert report['models']['async']['total_time'] == 3 * 8 + 3
  assert report['models']['lockstep']['total_time'] == 3 * 8 + 3
