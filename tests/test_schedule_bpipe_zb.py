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

from triax.errors import ConfigError
from triax.pipeline import render
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Schedule
from triax.pipeline.simulate import Costs, simulate_async, simulate_lockstep
from triax.pipeline.validate import validate

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'src')
PM = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def F(j, c):
  return Action('F', j, c)


def B(j, c):
  return Action('B', j, c)


def W(j, c):
  return Action('W', j, c)


def ticks_of(program):
  return {a: t for t, row in enumerate(program.grid) for cell in row
          for a in cell}


def replace_tables(program, changes):
  """A copy of program with table entries {(table, index): value} changed."""
  names = ('fwd', 'bwd', 'wgt', 'recv', 'evict', 'load')
  tables = {k: getattr(program, k).copy() for k in names}
  for (name, index), value in changes.items():
    tables[name][index] = value
  return dataclasses.replace(program, **tables)


# ---------------------------------------------------------------- zb_h1


def test_zb_h1_orders_lag_weight_gradients_by_the_stage_index():
  s = sched.build('zb_h1', 4, 6)
  # Stage 0: 1F1B with each W right behind its B.
  assert s.orders[0] == (F(0, 0), F(1, 0), F(2, 0), F(3, 0),
                         B(0, 0), W(0, 0), F(4, 0), B(1, 0), W(1, 0),
                         F(5, 0), B(2, 0), W(2, 0),
                         B(3, 0), W(3, 0), B(4, 0), W(4, 0), B(5, 0), W(5, 0))
  # Stage 3: W(k) follows B(k+3); the last three W's close the step.
  assert s.orders[3] == (F(0, 3), B(0, 3), F(1, 3), B(1, 3), F(2, 3), B(2, 3),
                         F(3, 3), B(3, 3), W(0, 3), F(4, 3), B(4, 3), W(1, 3),
                         F(5, 3), B(5, 3), W(2, 3), W(3, 3), W(4, 3), W(5, 3))
  # Without the W's the order is 1F1B's.
  for stage, order in enumerate(s.orders):
    assert tuple(a for a in order if a.kind != 'W') == (
        sched.build('1f1b', 4, 6).orders[stage])


@pytest.mark.parametrize('p', [1, 2, 3, 4, 8])
@pytest.mark.parametrize('m', [1, 3, 8, 32])
def test_zb_h1_is_valid_and_lowers_to_1f1b_ticks(p, m):
  s = sched.build('zb_h1', p, m)
  program = sched.lower(s)
  assert validate(s, program) == []
  assert program.split_backward and program.partner is None
  one = sched.lower(sched.build('1f1b', p, m))
  assert program.ticks == one.ticks == m + 2 * (p - 1)
  tick = ticks_of(program)
  for a, t in ticks_of(one).items():
    assert tick[a] == t  # W never moves an F or a B
  for j in range(m):
    for c in range(p):
      assert tick[W(j, c)] >= tick[B(j, c)]
  # Deferring W never raises the largest stash: every device compiles the
  # same pool, so that is the memory that counts.
  assert program.num_stash_slots == one.num_stash_slots
  assert (program.evict == -1).all() and (program.load == -1).all()


def test_zb_h1_wgt_table_matches_the_grid():
  program = sched.lower(sched.build('zb_h1', 4, 8))
  tick = ticks_of(program)
  for a, t in tick.items():
    if a.kind != 'W':
      continue
    row = program.wgt[t, a.chunk]
    assert (row[sched.W_VALID], row[sched.W_MB], row[sched.W_CHUNK]) == (
        1, a.microbatch, a.chunk)
    b = program.bwd[tick[B(a.microbatch, a.chunk)], a.chunk]
    assert row[sched.W_STASH] == b[sched.B_STASH]
    assert row[sched.W_GRAD] == b[sched.B_GRAD]
  assert program.wgt[..., sched.W_VALID].sum() == 4 * 8


def test_schedules_without_w_or_copies_have_idle_new_tables():
  for name in ('gpipe', '1f1b', 'interleaved_1f1b'):
    program = sched.lower(sched.build(name, 4, 8))
    assert not program.split_backward and program.partner is None
    assert (program.wgt[..., sched.W_VALID] == 0).all()
    assert (program.wgt[..., 1:] == -1).all()
    assert program.wgt.shape == (program.ticks, 4, 5)
    assert program.evict.shape == program.load.shape == (program.ticks, 4, 2)
    assert (program.evict == -1).all() and (program.load == -1).all()


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
  """Unit costs as above. Asynchronous: 3m + (p-1). Lockstep (the
  executor), which keeps 1F1B's ticks: 3m + 2(p-1), against 3(m+p-1)."""
  s = sched.build('zb_h1', p, m)
  zb = simulate_async(s, Costs(1, 1, t_weight=1))
  assert zb.total_time == 3 * m + (p - 1)
  lock = simulate_lockstep(sched.lower(s), Costs(1, 1, t_weight=1))
  one = simulate_lockstep(sched.lower(sched.build('1f1b', p, m)), Costs(1, 2))
  assert one.total_time == 3 * (m + p - 1)
  assert lock.total_time == 3 * m + 2 * (p - 1)
  assert lock.peak_inflight == sched.lower(s).peak_stash


def test_zb_h1_lockstep_peaks_and_grad_slots():
  program = sched.lower(sched.build('zb_h1', 4, 16))
  assert program.peak_stash == (7, 5, 4, 3)
  assert program.num_grad_slots == 3  # gradients wait for their W


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
      'stage 0: W1.0 runs 0 times (want exactly 1)']
  orders = list(s.orders)
  orders[1] = (W(0, 1),) + tuple(a for a in orders[1] if a != W(0, 1))
  assert ('stage 1 position 0: W0.1 runs before its B0.1 (position 2)' in
          validate(dataclasses.replace(s, orders=tuple(orders))))


def test_validator_rejects_a_weight_action_before_its_backward_tick():
  s = sched.build('zb_h1', 2, 2)
  program = sched.lower(s)
  tick = ticks_of(program)
  t, tb = tick[W(0, 0)], tick[B(0, 0)]
  assert t == tb == 2
  grid = [list(map(list, row)) for row in program.grid]
  grid[t][0].remove(W(0, 0))
  grid[t - 1][0].append(W(0, 0))
  broken = replace_tables(program, {('wgt', (t - 1, 0)): program.wgt[t, 0],
                                    ('wgt', (t, 0)): [0, -1, -1, -1, -1]})
  broken = dataclasses.replace(
      broken, grid=tuple(tuple(map(tuple, row)) for row in grid))
  assert 'tick 1 stage 0: W0.0 runs before its input from B0.0 (tick 2)' in (
      validate(s, broken))


def test_validator_sees_that_split_backwards_keep_their_slots():
  s = sched.build('zb_h1', 2, 4)
  program = sched.lower(s)
  # Point a W at a slot nothing was stashed in.
  t = next(t for t in range(program.ticks) if program.wgt[t, 1, 0])
  spare = program.num_stash_slots
  broken = dataclasses.replace(
      replace_tables(program, {('wgt', (t, 1, sched.W_STASH)): spare}),
      num_stash_slots=spare + 1)
  assert any(f'stash slot {spare} is empty' in x for x in validate(s, broken))


# ---------------------------------------------------------------- bpipe


def own_peaks_1f1b(p, m):
  """Per tick and stage, the sets 1F1B lockstep holds at phase 0."""
  one = sched.lower(sched.build('1f1b', p, m))
  tick = ticks_of(one)
  held = np.zeros((one.ticks, p), int)
  for j in range(m):
    for s in range(p):
      held[tick[F(j, s)]:tick[B(j, s)] + 1, s] += 1
  return held


@pytest.mark.parametrize('p, m', PM)
def test_bpipe_properties(p, m):
  s = sched.build('bpipe', p, m)
  program = sched.lower(s)
  assert validate(s, program) == []
  cap = s.stash_cap
  assert cap == sched.bpipe_stash_cap(p, m) == min(p, m)
  assert max(program.peak_stash) <= cap
  assert program.num_stash_slots == cap
  # About half of 1F1B's steady-state stage-0 peak (2p-1), plus one.
  assert cap <= math.ceil((2 * p - 1) / 2) + 1
  one = sched.lower(sched.build('1f1b', p, m))
  if m >= 2 * p - 1:
    assert cap <= math.ceil(one.peak_stash[0] / 2) + 1
  # And no pairing can do with less under 1F1B's ticks: a pair holds
  # held[s] + held[p-1-s] sets at once and each side has cap slots.
  held = own_peaks_1f1b(p, m)
  least = max(math.ceil((held[t, q] + held[t, p - 1 - q]) / 2)
              if q != p - 1 - q else held[t, q]
              for t in range(held.shape[0]) for q in range(p))
  assert cap == least
  # Same ticks, same F/B placement as 1F1B lockstep.
  assert program.ticks == m + 2 * (p - 1)
  tick = ticks_of(program)
  for a, t in ticks_of(one).items():
    assert tick[a] == t
  # Every evicted set leaves at its F's tick and is back before its B.
  for j, c in s.evicted:
    evict, load = tick[Action('EVICT', j, c)], tick[Action('LOAD', j, c)]
    assert tick[F(j, c)] == evict < load == tick[B(j, c)] - 1
  assert s.partner == tuple(p - 1 - q for q in range(p))
  # The program names the pairing only when something moves, so the
  # executor can leave out the evict/load ppermutes otherwise.
  assert program.partner == (s.partner if s.evicted else None)


def test_bpipe_evicts_from_heavy_to_light_only():
  for p, m in PM + [(3, 9), (5, 20)]:
    s = sched.build('bpipe', p, m)
    program = sched.lower(s)
    for j, c in s.evicted:
      assert c < p - 1 - c  # the heavy stage of its pair
    heavy = [q for q in range(p) if q < p - 1 - q]
    light = [q for q in range(p) if q > p - 1 - q]
    assert (program.evict[:, light, sched.X_SEND] == -1).all()
    assert (program.evict[:, heavy, sched.X_RECV] == -1).all()
    assert (program.load[:, heavy, sched.X_SEND] == -1).all()
    assert (program.load[:, light, sched.X_RECV] == -1).all()
    if p % 2:
      middle = p // 2
      assert (program.evict[:, middle] == -1).all()
      assert (program.load[:, middle] == -1).all()
    # Each send has its receive on the partner in the same tick.
    for table in (program.evict, program.load):
      for t, q in zip(*(table[..., sched.X_SEND] >= 0).nonzero()):
        assert table[t, p - 1 - q, sched.X_RECV] >= 0
      assert ((table[..., sched.X_SEND] >= 0).sum() ==
              (table[..., sched.X_RECV] >= 0).sum())


def test_bpipe_transfers_per_step():
  program = sched.lower(sched.build('bpipe', 4, 16))
  moved = sched.transfers_per_step(program)
  assert moved == {'evictions': (8, 4, 0, 0), 'loads': (0, 0, 4, 8),
                   'total': 24}
  assert sched.transfers_per_step(sched.lower(sched.build('1f1b', 4, 16))) == {
      'evictions': (0,) * 4, 'loads': (0,) * 4, 'total': 0}


def test_bpipe_reuses_a_slot_sent_from_in_the_same_tick():
  # The transfer phase reads every send slot before it writes any receive
  # slot; the lowering relies on that to keep the light stage within cap.
  program = sched.lower(sched.build('bpipe', 2, 8))
  light = 1
  same = [t for t in range(program.ticks)
          if program.load[t, light, sched.X_SEND] >= 0 and
          program.load[t, light, sched.X_SEND] ==
          program.evict[t, light, sched.X_RECV]]
  assert same


def test_bpipe_needs_one_chunk_per_stage():
  with pytest.raises(ConfigError) as e:
    sched.build('bpipe', 4, 8, 2)
  assert e.value.key == 'pipeline.virtual_stages'


def test_validator_rejects_an_eviction_without_its_load():
  s = sched.build('bpipe', 2, 4)
  loads = [a for a in s.orders[1] if a.kind == 'LOAD']
  orders = (s.orders[0], tuple(a for a in s.orders[1] if a != loads[0]))
  problems = validate(dataclasses.replace(s, orders=orders))
  a = loads[0]
  assert problems == [f'{a.microbatch}.{a.chunk} is evicted 1 times but '
                      'loaded 0 times']


def test_validator_rejects_bad_partners():
  s = sched.build('bpipe', 4, 8)
  assert validate(dataclasses.replace(s, partner=(1, 2, 3, 0))) == [
      'partner of stage 0 is 1, whose partner is 2 (partners must pair up)',
      'partner of stage 1 is 2, whose partner is 3 (partners must pair up)',
      'partner of stage 2 is 3, whose partner is 0 (partners must pair up)',
      'partner of stage 3 is 0, whose partner is 1 (partners must pair up)']
  assert any('no partner pairing' in x
             for x in validate(dataclasses.replace(s, partner=None)))
  # A stage paired with itself has nowhere to evict to.
  selfish = dataclasses.replace(s, partner=(0, 1, 2, 3))
  assert any('is its own partner' in x for x in validate(selfish))


def test_validator_rejects_a_load_in_the_tick_of_its_backward():
  s = sched.build('bpipe', 2, 4)
  program = sched.lower(s)
  tick = ticks_of(program)
  j, c = sorted(s.evicted)[0]
  t = tick[Action('LOAD', j, c)]
  grid = [list(map(list, row)) for row in program.grid]
  grid[t][1].remove(Action('LOAD', j, c))
  grid[t + 1][1].append(Action('LOAD', j, c))
  broken = replace_tables(program, {
      ('load', (t, 1)): [-1, -1], ('load', (t, 0)): [-1, -1],
      ('load', (t + 1, 1)): program.load[t, 1],
      ('load', (t + 1, 0)): program.load[t, 0]})
  broken = dataclasses.replace(
      broken, grid=tuple(tuple(map(tuple, row)) for row in grid))
  problems = validate(s, broken)
  assert (f'tick {t + 1} stage 0: B{j}.{c} runs before its input from '
          f'LOAD{j}.{c} (tick {t + 1})') in problems


def test_validator_replays_evictions():
  s = sched.build('bpipe', 2, 4)
  program = sched.lower(s)
  t = next(t for t in range(program.ticks)
           if program.evict[t, 0, sched.X_SEND] >= 0)
  dropped = replace_tables(program, {('evict', (t, 1, sched.X_RECV)): -1})
  assert any(f'tick {t} stage 1: EVICT: drops stash' in x
             for x in validate(s, dropped))
  phantom = replace_tables(program, {('evict', (t, 1, sched.X_SEND)): 0})
  assert any('grid has no EVICT but the evict table sends' in x
             for x in validate(s, phantom))


def test_validator_holds_programs_to_the_stash_cap():
  s = sched.build('bpipe', 4, 8)
  program = sched.lower(s)
  tight = dataclasses.replace(s, stash_cap=3)
  problems = validate(tight, dataclasses.replace(program, schedule=tight))
  assert any("more than the schedule's cap of 3" in x for x in problems)
  # 1F1B's program, which keeps every set at home, does not fit either.
  plain = sched.lower(dataclasses.replace(sched.build('1f1b', 4, 8),
                                          stash_cap=4))
  assert any('stash pools need 7 slots' in x
             for x in validate(plain.schedule, plain))


def test_lowering_rejects_copies_the_table_cannot_hold():
  # The last stage runs F and B of a micro-batch in one tick: nothing can
  # be away in between.
  one = sched.build('1f1b', 2, 2)
  orders = (one.orders[0],
            (F(0, 1), Action('EVICT', 0, 1), B(0, 1), F(1, 1), B(1, 1)))
  s = dataclasses.replace(one, orders=orders, partner=(1, 0))
  orders = (one.orders[0] + (Action('LOAD', 0, 1),), orders[1])
  s = dataclasses.replace(s, orders=orders)
  with pytest.raises(ValueError, match='cannot evict 0.1'):
    sched.lower(s)


# ---------------------------------------------------------------- time models


@pytest.mark.parametrize('p, m', PM)
def test_bpipe_costs_only_transfer_time(p, m):
  s = sched.build('bpipe', p, m)
  program = sched.lower(s)
  one = sched.build('1f1b', p, m)
  costs = Costs(1, 2)
  # Free copies: exactly 1F1B in both models.
  assert simulate_async(s, costs).total_time == (
      simulate_async(one, costs).total_time)
  lock = simulate_lockstep(program, costs)
  assert lock.total_time == simulate_lockstep(sched.lower(one),
                                              costs).total_time
  assert lock.peak_inflight == program.peak_stash
  # Lockstep: each tick with a copy grows by t_evict (no neighbour transfer
  # cost here, so the copy sets the transfer phase).
  with_copies = sum(any(a.kind in ('EVICT', 'LOAD') for cell in row
                        for a in cell) for row in program.grid)
  slow = simulate_lockstep(program, Costs(1, 2, t_evict=0.5))
  assert math.isclose(slow.total_time, lock.total_time + 0.5 * with_copies)
  # Copies are not compute: busy time is 1F1B's.
  assert slow.busy == lock.busy


def test_async_copies_run_on_the_copy_stream():
  s = sched.build('bpipe', 2, 4)
  result = simulate_async(s, Costs(1, 2, t_evict=0.5))
  spans = {str(x.action): x for x in result.timeline}
  evict = spans['EVICT1.0']
  assert evict.stage == 0 and evict.end - evict.start == 0.5
  load = spans['LOAD1.0']
  assert load.stage == 1 and load.start >= spans['B1.1'].end
  # Stage 1 keeps computing while its copy stream loads.
  assert spans['F2.1'].start < load.end and spans['F2.1'].end > load.start
  assert spans['B1.0'].start >= load.end
  assert result.busy == simulate_async(sched.build('1f1b', 2, 4),
                                       Costs(1, 2)).busy


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
  lines = render.text_grid(sched.lower(sched.build('bpipe', 2, 4))).splitlines()
  assert len(lines) == 2 + 3 * 2  # title, ticks, F/B/X per stage
  assert lines[4].split()[0] == 'X'
  heavy_x, light_x = lines[4], lines[7]
  assert 'E1.0' in heavy_x and 'l1.0' in heavy_x
  assert 'e1.0' in light_x and 'L1.0' in light_x
  assert len({len(x) for x in lines[1:]}) == 1


def test_gantt_and_trace_show_new_kinds(tmp_path):
  for name in ('bpipe', 'zb_h1'):
    s = sched.build(name, 4, 8)
    path = tmp_path / f'{name}.png'
    render.gantt_png(s, sched.lower(s), Costs(1, 1, 1, t_evict=0.25),
                     str(path))
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  trace = render.chrome_trace(simulate_async(
      sched.build('bpipe', 2, 4), Costs(t_evict=0.5)), time_scale=1.0)
  names = {e['args']['name'] for e in trace['traceEvents']
           if e['name'] == 'thread_name'}
  assert 'stage 0 copy' in names
  copies = [e for e in trace['traceEvents'] if e.get('cat') == 'EVICT']
  assert copies and all(e['tid'] == 2 for e in copies)


def run_cli(*args):
  env = dict(os.environ, PYTHONPATH=SRC + os.pathsep +
             os.environ.get('PYTHONPATH', ''))
  return subprocess.run([sys.executable, '-m', 'triax.schedule', *args],
                        env=env, capture_output=True, text=True, timeout=60)


def test_cli_bpipe_json():
  out = run_cli('--schedule=bpipe', '--stages=4', '--microbatches=16',
                '--json')
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert report['valid'] is True
  assert report['ticks'] == 22
  assert report['stash_slots'] == report['stash_cap'] == 4
  assert report['peak_inflight'] == [4, 4, 4, 4]
  assert report['evictions_per_step'] == 12
  assert report['transfers_per_step'] == {
      'evictions': [8, 4, 0, 0], 'loads': [0, 0, 4, 8], 'total': 24}
  assert report['partner'] == [3, 2, 1, 0]


def test_cli_zb_h1_json():
  out = run_cli('--schedule=zb_h1', '--stages=4', '--microbatches=8',
                '--json')
  assert out.returncode == 0, out.stderr
  report = json.loads(out.stdout)
  assert report['valid'] is True and report['split_backward'] is True
  assert report['stash_slots'] == 7
  assert 'evictions_per_step' not in report
  # CLI defaults are ZB-H1's t_F = t_B = t_W = 1.
  assert report['models']['async']['total_time'] == 3 * 8 + 3
