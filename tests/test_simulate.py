"""Time and memory models, and the Chrome trace and Gantt renderings.

Pure Python: nothing here imports JAX.
"""

import json
import math

import pytest

from triax.pipeline import render
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Schedule
from triax.pipeline.simulate import Costs, per_stage, simulate_async
from triax.pipeline.simulate import simulate_lockstep

GRID = [(p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)
        for v in (1, 2, 4)]


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


@pytest.mark.parametrize('p, m', [(p, m) for p, m, v in GRID if v == 1] +
                         [(4, 2), (4, 3)])
def test_async_peak_inflight(p, m):
  assert simulate_async(sched.build('1f1b', p, m)).peak_inflight == tuple(
      min(p - s, m) for s in range(p))
  assert simulate_async(sched.build('gpipe', p, m)).peak_inflight == (m,) * p


def test_async_timeline_by_hand_with_slow_stage_and_transfers():
  s = sched.build('1f1b', 2, 2)
  costs = [Costs(1, 1), Costs(2, 2)]
  result = simulate_async(s, costs)
  spans = {(x.stage, str(x.action)): (x.start, x.end) for x in result.timeline}
  assert spans == {(0, 'F0.0'): (0, 1), (0, 'F1.0'): (1, 2),
                   (1, 'F0.1'): (1, 3), (1, 'B0.1'): (3, 5),
                   (1, 'F1.1'): (5, 7), (1, 'B1.1'): (7, 9),
                   (0, 'B0.0'): (5, 6), (0, 'B1.0'): (9, 10)}
  assert result.total_time == 10
  assert result.busy == (4, 8)
  assert math.isclose(result.bubble_fraction, 1 - 12 / 20)
  assert result.ticks is None
  # A transfer delays each cross-stage input; same-stage inputs are free.
  result = simulate_async(sched.build('1f1b', 2, 1), Costs(t_transfer=0.5))
  assert [(str(x.action), x.start) for x in result.timeline] == [
      ('F0.0', 0), ('B0.0', 4), ('F0.1', 1.5), ('B0.1', 2.5)]
  assert result.total_time == 5


def test_async_chunk_actions_cost_a_fraction_of_the_stage():
  result = simulate_async(sched.build('interleaved_1f1b', 2, 2, 2),
                          Costs(t_forward=1.0, t_backward=3.0))
  for span in result.timeline:
    want = 0.5 if span.action.kind == 'F' else 1.5
    assert math.isclose(span.end - span.start, want)
  assert len(result.timeline) == 2 * 2 * 4


def test_async_deadlock_raises():
  s = Schedule('broken', 2, 1, 1, ((Action('B', 0, 0), Action('F', 0, 0)),
                                   (Action('F', 0, 1), Action('B', 0, 1))))
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


@pytest.mark.parametrize('p, m, v', GRID)
def test_lockstep_models(p, m, v):
  if v == 1:
    program = sched.lower(sched.build('1f1b', p, m))
    result = simulate_lockstep(program)
    assert result.ticks == m + 2 * (p - 1)
    assert result.peak_inflight == tuple(min(2 * (p - 1 - s) + 1, m)
                                         for s in range(p))
    assert math.isclose(result.bubble_fraction, bubble(p, m))

    result = simulate_lockstep(sched.lower(sched.build('gpipe', p, m)))
    # One tick runs the last stage's last forward and first backward.
    assert result.ticks == 2 * (m + p - 1) - 1
    assert math.isclose(result.total_time, 2 * (m + p - 1))
    assert math.isclose(result.bubble_fraction, bubble(p, m))
    assert result.peak_inflight == (m,) * p
  # Our lowering keeps interleaving's bubble: forwards stream every tick.
  program = sched.lower(sched.build('interleaved_1f1b', p, m, v))
  result = simulate_lockstep(program)
  assert math.isclose(result.bubble_fraction, bubble(p, m, v))
  assert result.ticks == m * v + p * v + p - 2
  assert result.peak_inflight == program.peak_stash


def test_lockstep_ticks_last_as_long_as_the_slowest_stage():
  program = sched.lower(sched.build('1f1b', 2, 2))
  # t0: s0 F | t1: s0 F, s1 F+B | t2: s0 B, s1 F+B | t3: s0 B.
  result = simulate_lockstep(program, [Costs(1, 1), Costs(2, 2)])
  assert result.total_time == 1 + 4 + 4 + 1
  assert result.busy == (4, 8)
  # t0 sends F0.0's output, t1 F1.0's and B0.1's, t2 B1.1's; t3 runs only
  # B1.0, whose chunk 0 has no predecessor to send to.
  result = simulate_lockstep(program, Costs(t_transfer=0.25))
  assert result.total_time == 1.25 + 2.25 + 2.25 + 1


def test_lockstep_with_one_stage_has_no_transfers():
  program = sched.lower(sched.build('interleaved_1f1b', 1, 2, 2))
  result = simulate_lockstep(program, Costs(t_transfer=5.0))
  assert math.isclose(result.total_time, 4.0)
  assert result.bubble_fraction == 0


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
