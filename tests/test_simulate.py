"""Time and memory models, and the Chrome trace and Gantt renderings.

Pure Python: nothing here imports JAX.
"""

import json
import math

import pytest

from triax.errors import ConfigError
from triax.pipeline import render
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Schedule
from triax.pipeline.simulate import Costs, per_stage, simulate_async, simulate_lockstep, ticks
from triax.pipeline.validate import validate

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

GRID = [(p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p) for v in (1, 2, 4)]


def bubble(p, m, v=1):
  return (p - 1) / (v * m + p - 1)


# ---------------------------------------------------------------- async


@pytest.mark.parametrize('p, m, v', GRID)
def test_async_bubbles_with_unit_costs(p, m, v):
  if v == 1:
    for name in ('gpipe', '1f1b'):
      result = simulate_async(sched.build(name, p, m))
      assert math.isclose(result.bubble_fraction, bubble(p, m)), name
      assert math.isclose(result.total_time, 2 * (m + p - 1)), name
  result = simulate_async(sched.build('interleaved_1f1b', p, m, v))
  assert math.isclose(result.bubble_fraction, bubble(p, m, v))
  # Circular GPipe fills the pipe just as well when m >= p.
  result = simulate_async(sched.build('gpipe', p, m, v))
  assert math.isclose(result.bubble_fraction, bubble(p, m, v))


@pytest.mark.parametrize('p, m', [(p, m) for p, m, v in GRID if v == 1] + [(4, 2), (4, 3)])
def test_async_peak_inflight(p, m):
  assert simulate_async(sched.build('1f1b', p, m)).peak_inflight == tuple(
    min(p - s, m) for s in range(p)
  )
  assert simulate_async(sched.build('gpipe', p, m)).peak_inflight == (m,) * p


def test_async_timeline_by_hand_with_slow_stage_and_transfers():
  s = sched.build('1f1b', 2, 2)
  costs = [Costs(1, 1), Costs(2, 2)]
  result = simulate_async(s, costs)
  spans = {(x.stage, str(x.action)): (x.start, x.end) for x in result.timeline}
  assert spans == {
    (0, 'F0.0'): (0, 1),
    (0, 'F1.0'): (1, 2),
    (1, 'F0.1'): (1, 3),
    (1, 'B0.1'): (3, 5),
    (1, 'F1.1'): (5, 7),
    (1, 'B1.1'): (7, 9),
    (0, 'B0.0'): (5, 6),
    (0, 'B1.0'): (9, 10),
  }
  assert result.total_time == 10
  assert result.busy == (4, 8)
  assert math.isclose(result.bubble_fraction, 1 - 12 / 20)
  assert result.ticks is None
  # A transfer delays each cross-stage input; same-stage inputs are free.
  result = simulate_async(sched.build('1f1b', 2, 1), Costs(t_transfer=0.5))
  assert [(str(x.action), x.start) for x in result.timeline] == [
    ('F0.0', 0),
    ('B0.0', 4),
    ('F0.1', 1.5),
    ('B0.1', 2.5),
  ]
  assert result.total_time == 5


def test_async_chunk_actions_cost_a_fraction_of_the_stage():
  result = simulate_async(
    sched.build('interleaved_1f1b', 2, 2, 2), Costs(t_forward=1.0, t_backward=3.0)
  )
  for span in result.timeline:
    want = 0.5 if span.action.kind == 'F' else 1.5
    assert math.isclose(span.end - span.start, want)
  assert len(result.timeline) == 2 * 2 * 4


def test_async_deadlock_raises():
  s = Schedule(
    'broken',
    2,
    1,
    1,
    ((Action('B', 0, 0), Action('F', 0, 0)), (Action('F', 0, 1), Action('B', 0, 1))),
  )
  with pytest.raises(RuntimeError, match='stage 0 waits at B0.0'):
    simulate_async(s)


def test_async_zero_bubble_weight_actions_hold_the_stash():
  # One stage: F, then B (input gradient), then W (weight gradient).
  a = [Action(k, j, 0) for j in range(2) for k in 'FBW']
  s = Schedule('zb', 1, 2, 1, (tuple(a[:3] + a[3:]),))
  result = simulate_async(s, Costs(t_weight=0.5))
  assert result.total_time == 5
  assert result.peak_inflight == (1,)


# ---------------------------------------------------------------- lockstep


def lockstep_bubble(p, m, v=1):
  """Fused t_B = 2 t_F run as B = W = t_F: 3mv busy ticks of 3mv + 2(p-1)."""
  return 2 * (p - 1) / (3 * m * v + 2 * (p - 1))


@pytest.mark.parametrize('p, m, v', GRID)
def test_lockstep_models(p, m, v):
  costs = Costs(1, 2)  # every lockstep action then costs one tick of 1 / v
  if v == 1:
    program = sched.lower(sched.build('1f1b', p, m))
    result = simulate_lockstep(program, costs)
    assert result.ticks == 3 * m + 2 * (p - 1)
    assert math.isclose(result.total_time, result.ticks)
    assert result.peak_inflight == tuple(min(p - s, m) for s in range(p))
    assert math.isclose(result.bubble_fraction, lockstep_bubble(p, m))
    # Smaller than the papers' (p-1)/(m+p-1): the B chain moves a stage a
    # tick, half a fused backward.
    assert result.bubble_fraction < bubble(p, m)

    result = simulate_lockstep(sched.lower(sched.build('gpipe', p, m)), costs)
    assert result.ticks == 3 * m + 2 * (p - 1)
    assert math.isclose(result.bubble_fraction, lockstep_bubble(p, m))
    assert result.peak_inflight == (m,) * p
  program = sched.lower(sched.build('interleaved_1f1b', p, m, v))
  result = simulate_lockstep(program, costs)
  assert result.ticks == 3 * m * v + 2 * (p - 1)
  assert math.isclose(result.total_time, result.ticks / v)
  assert math.isclose(result.bubble_fraction, lockstep_bubble(p, m, v))
  assert result.peak_inflight == program.peak_stash


def test_lockstep_ticks_last_as_long_as_the_slowest_stage():
  program = sched.lower(sched.build('1f1b', 2, 2))
  # s0: F0 F1 . B0 W0 . B1 W1; s1: . F0 B0 W0 F1 B1 W1 . (t_B = 1 runs as
  # B = W = 0.5 on stage 0, t_B = 2 as B = W = 1 on stage 1).
  result = simulate_lockstep(program, [Costs(1, 1), Costs(2, 2)])
  assert result.total_time == 1 + 2 + 1 + 1 + 2 + 1 + 1 + 0.5
  assert result.busy == (4, 8)
  # Transfers: t0 sends F0.0's output, t1 F1.0's (F0.1 is the last chunk:
  # its loss gradient stays), t2 B0.1's, t5 B1.1's; B0.0 and B1.0 (chunk 0)
  # and W's send nothing.
  result = simulate_lockstep(program, Costs(t_transfer=0.25))
  assert result.total_time == 1.25 + 1.25 + 0.75 + 0.5 + 1 + 0.75 + 0.5 + 0.5


def test_lockstep_with_one_stage_has_no_transfers():
  program = sched.lower(sched.build('interleaved_1f1b', 1, 2, 2))
  result = simulate_lockstep(program, Costs(t_transfer=5.0))
  assert math.isclose(result.total_time, 4.0)
  assert result.bubble_fraction == 0


def test_fused_backward_costs_in_the_lockstep_program():
  assert (Costs(1, 2).lockstep('B', 1, True), Costs(1, 2).lockstep('W', 1, True)) == (1, 1)
  # A measured W share of the fused backward is used as it is ...
  assert Costs(1, 2, t_weight=0.5).lockstep('B', 1, True) == 1.5
  assert Costs(1, 2, t_weight=0.5).lockstep('W', 2, True) == 0.25
  # ... unless it is no share of it: then half.
  assert Costs(1, 2, t_weight=3).lockstep('W', 1, True) == 1
  # A split schedule's B and W cost what they say.
  assert (
    Costs(1, 2, t_weight=3).lockstep('B', 1, False),
    Costs(1, 2, t_weight=3).lockstep('W', 1, False),
  ) == (2, 3)
  program = sched.lower(sched.build('1f1b', 2, 2))
  spans = {
    str(x.action): x.end - x.start
    for x in simulate_lockstep(program, Costs(1, 2, t_weight=0.5)).timeline
  }
  assert (spans['F0.0'], spans['B0.0'], spans['W0.0']) == (1, 1.5, 0.5)


def test_lockstep_and_async_agree_on_the_work():
  """The lowering splits a fused B without changing the work: per stage the
  lockstep busy time is the asynchronous model's."""
  for name, v in (('gpipe', 2), ('1f1b', 1), ('interleaved_1f1b', 2), ('bpipe', 1)):
    s = sched.build(name, 4, 8, v)
    costs = Costs(1.0, 2.5, t_weight=0.75)
    assert simulate_lockstep(sched.lower(s), costs).busy == pytest.approx(
      simulate_async(s, costs).busy
    )


def builds():
  """(name, p, m, v) for every builder, p in 2, 4, 8 and m in p, 2p, 4p; v = 2
  for builders that need chunks, and none of the sizes a builder rejects."""
  for name in sched.SCHEDULES:
    for p in (2, 4, 8):
      for m in (p, 2 * p, 4 * p):
        for v in (1, 2):
          try:
            sched.build(name, p, m, v)
          except ConfigError:
            continue
          yield name, p, m, v
          break


@pytest.mark.parametrize('name, p, m, v', list(builds()))
def test_lowered_programs_keep_the_papers_memory_and_time(name, p, m, v):
  """Our issue's acceptance facts, for every builder.

  Costs t_F = 1 and a fused t_B = 2 (the lowering runs it as B = W = 1), or
  F = B = W = 1 for a schedule built split: the lockstep program stashes no
  more than the asynchronous schedule, takes at most 5% longer, and is
  valid."""
  s = sched.build(name, p, m, v)
  program = sched.lower(s)
  assert validate(s, program) == []
  costs = Costs(1, 1, t_weight=1) if s.split_backward else Costs(1, 2)
  lock, asy = simulate_lockstep(program, costs), simulate_async(s, costs)
  assert all(x <= y for x, y in zip(program.peaks['stash'], asy.peak_inflight)), (
    program.peaks['stash'],
    asy.peak_inflight,
  )
  assert lock.peak_inflight == program.peaks['stash']
  assert lock.total_time <= 1.05 * asy.total_time
  if (name, p, m) == ('1f1b', 4, 8):
    assert program.peaks['stash'] == (4, 3, 2, 1) == asy.peak_inflight
    assert (lock.total_time, asy.total_time) == (30, 33)
  if (name, p, m) == ('zb_h1', 4, 8):
    assert program.peaks['stash'] == (4, 4, 4, 4) == asy.peak_inflight
    assert lock.total_time == asy.total_time == 27


def test_builds_cover_every_builder():
  assert {name for name, *_ in builds()} == set(sched.SCHEDULES)


class Stretched:
  """A TickCosts whose ticks with two busy stages take 50% longer (two
  devices sharing cores) and whose every tick pays a 0.1 ppermute."""

  def duration(self, stage, action):
    return {'F': 1.0, 'B': 1.0, 'W': 1.0}[action.kind]

  def tick_time(self, tick, work):
    busy = sum(1 for a in tick.compute if a is not None)
    return max(work) * (1.5 if busy > 1 else 1.0)

  def transfer(self, tick):
    return 0.1

  def move(self, tick):
    return 0.0

  def copy(self, stage, action):
    return 0.0


def test_lockstep_takes_any_tick_cost_model():
  program = sched.lower(sched.build('1f1b', 2, 2))
  result = simulate_lockstep(program, Stretched())
  both = sum(all(a is not None for a in t.compute) for t in ticks(program))
  assert both == 4  # ticks 1, 3, 4 and 6
  assert math.isclose(result.total_time, program.ticks * 1.1 + 0.5 * both)
  # A stretched tick stretches every stage's action alike.
  spans = {str(x.action): x.end - x.start for x in result.timeline}
  assert spans['F1.0'] == spans['F0.1'] == 1.5 and spans['F0.0'] == 1.0
  assert result.busy == (6 + 0.5 * both, 6 + 0.5 * both)


def test_ticks_list_what_crosses_stages():
  program = sched.lower(sched.build('1f1b', 2, 2))
  got = [(t.compute, t.messages, t.copies, t.movers) for t in ticks(program)[:3]]
  assert got == [
    ((Action('F', 0, 0), None), ((0, 1),), (), ()),
    ((Action('F', 1, 0), Action('F', 0, 1)), ((0, 1),), (), ()),
    ((None, Action('B', 0, 1)), ((1, 0),), (), ()),
  ]
  # Under BPipe the executor's residual ppermute runs, on every paired stage,
  # in the ticks where some stage moves a set, and only there.
  for p, m, paired in ((4, 8, (0, 1, 2, 3)), (5, 10, (0, 1, 3, 4))):
    for t in ticks(sched.lower(sched.build('bpipe', p, m))):
      assert t.movers == (paired if t.copies else ()), t
  assert sum(len(t.copies) for t in ticks(sched.lower(sched.build('bpipe', 4, 8)))) == 4


def test_costs_are_checked():
  with pytest.raises(ValueError, match='t_forward'):
    Costs(t_forward=-1.0)
  with pytest.raises(ValueError, match='sequence of 2 Costs'):
    per_stage([Costs()], 2)
  assert per_stage(Costs(2.0), 3) == (Costs(2.0),) * 3


# ---------------------------------------------------------------- render


def test_chrome_trace():
  s = sched.build('interleaved_1f1b', 2, 4, 2)
  result = simulate_async(s, Costs(t_forward=1.0, t_backward=2.0))
  trace = json.loads(json.dumps(render.chrome_trace(result, time_scale=1.0)))
  events = [e for e in trace['traceEvents'] if e['ph'] == 'X']
  threads = [e for e in trace['traceEvents'] if e['name'] == 'thread_name']
  assert len(events) == 2 * 4 * 4
  assert sorted(e['tid'] for e in threads) == [0, 1]
  assert {e['tid'] for e in events} == {0, 1}
  first = min(events, key=lambda e: (e['tid'], e['ts']))
  assert (first['name'], first['ts'], first['dur']) == ('F0.0', 0, 0.5)
  assert max(e['ts'] + e['dur'] for e in events) == result.total_time


def test_gantt_png(tmp_path):
  s = sched.build('1f1b', 4, 8)
  path = tmp_path / 'g.png'
  render.gantt_png(s, sched.lower(s), Costs(t_backward=2.0), str(path))
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
