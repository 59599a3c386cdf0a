"""Packed lockstep programs (pipeline/rounds.py): where B reruns the forward.

Pure Python: lowering, validator and time model of the rounds, no JAX.
"""

import dataclasses

import numpy as np
import pytest
from actions import B, F, W
from test_schedule import sizes

from triax.pipeline import rounds, simulate
from triax.pipeline import schedule as sched
from triax.pipeline.validate import validate

pytestmark = pytest.mark.fast

FULL = rounds.FULL_RECOMPUTE


def design(schedule, transfer=0.0):
  """Full recomputation's costs: F 1, B 2 (its forward again, then the input
  gradient), W 1; a schedule built fused has them as one backward of 3."""
  costs = simulate.Costs.design_point(schedule.split_backward, FULL)
  return dataclasses.replace(costs, t_transfer=transfer)


def test_units_pack_only_a_backward_that_recomputes_the_forward():
  assert rounds.units_for('full') == FULL and FULL.of('B') == 2 * FULL.of('F')
  assert rounds.units_for('full', 'off') is None
  assert rounds.units_for('none') is None and rounds.units_for('dots') is None


@pytest.mark.parametrize('name,p,m,v', list(sizes()))
def test_every_schedule_packs_into_a_valid_program_no_larger(name, p, m, v):
  schedule = sched.build(name, p, m, v)
  packed, plain = sched.lower(schedule, units=FULL), sched.lower(schedule)
  assert validate(schedule, packed) == []
  if schedule.evicted:  # BPipe's moving sets run one action a tick
    assert not packed.packed and packed.ticks == plain.ticks
    return
  assert packed.packed
  for buf in ('stash', 'cut'):
    assert max(packed.peaks[buf]) <= max(plain.peaks[buf]), buf


def test_equal_units_and_fused_pairs_lower_as_the_papers():
  schedule = sched.build('interleaved_1f1b', 4, 8, 2)
  plain = sched.lower(schedule)
  same = sched.lower(schedule, units=rounds.TickUnits(2, 2, 2))
  assert not same.packed and same.grid == plain.grid
  for name, table in plain.table.items():
    np.testing.assert_array_equal(same.table[name], table)
  dual = sched.build('dualpipe_v', 4, 8, 2)
  assert not sched.lower(dual, fuse_overlaps=True, units=FULL).packed


def test_a_round_waits_for_its_longest_action_and_sends_once():
  """1F1B, p = 2, m = 2, by hand: a round lasts its busiest stage's run of
  actions, and the messages its actions make go in one send after it."""
  schedule = sched.build('1f1b', 2, 2)
  program = sched.lower(schedule, units=FULL)
  assert program.grid == (
    ((F(0, 0),), ()),
    ((F(1, 0),), (F(0, 1),)),
    ((), (B(0, 1),)),
    ((B(0, 0),), (W(0, 1),)),
    ((), (F(1, 1),)),
    ((W(0, 0),), (B(1, 1),)),
    ((B(1, 0),), (W(1, 1),)),
    ((W(1, 0),), ()),
  )
  assert program.rounds == (0, 1, 2, 3, 5, 6, 7)
  assert sorted(program.sends) == [0, 1, 2, 5]
  # F0.0 1 + send; F 1 + send; B 2 + send; B | W F 2; W | B 2 + send; B | W 2; W 1.
  got = simulate.simulate_lockstep(program, design(schedule, transfer=0.25))
  assert got.total_time == pytest.approx(12.0)
  # The papers' lowering: each tick lasts its slowest stage, B or not.
  plain = simulate.simulate_lockstep(sched.lower(schedule), design(schedule, 0.25))
  assert plain.total_time == pytest.approx(13.0)


@pytest.mark.parametrize(
  'name,p,m,v',
  [
    ('1f1b', 4, 16, 1),
    ('interleaved_1f1b', 4, 16, 2),
    ('interleaved_1f1b', 8, 32, 2),
    ('interleaved_1f1b', 8, 64, 4),
    ('gpipe', 4, 16, 1),
    ('zb_h1', 4, 16, 1),
    ('zb_v', 4, 16, 2),
    ('interleaved_zb', 4, 16, 2),
  ],
)
def test_packed_lockstep_keeps_up_with_the_asynchronous_schedule(name, p, m, v):
  """At full recomputation's costs the papers' lowering is 1.16-1.46x the
  asynchronous schedule; packed, within 6%."""
  schedule = sched.build(name, p, m, v)
  costs = design(schedule)
  asynchronous = simulate.simulate_async(schedule, costs).total_time
  plain = simulate.simulate_lockstep(sched.lower(schedule), costs).total_time
  packed = simulate.simulate_lockstep(sched.lower(schedule, units=FULL), costs).total_time
  assert plain >= 1.15 * asynchronous
  assert packed <= 1.06 * asynchronous, packed / asynchronous


def _corrupt(program, **changes):
  table = {k: x.copy() for k, x in program.table.items()}
  outbox = {o: x.copy() for o, x in program.outbox.items()}
  for (name, index), value in changes.get('cells', {}).items():
    (outbox[name[1]] if isinstance(name, tuple) else table[name])[index] = value
  extra = {k: v for k, v in changes.items() if k != 'cells'}
  return dataclasses.replace(program, table=table, outbox=outbox, **extra)


def test_validator_replays_the_sends_of_a_packed_program():
  schedule = sched.build('1f1b', 2, 2)
  program = sched.lower(schedule, units=FULL)
  # F0.0 (tick 0) waits in stage 0's slot 0; the send after tick 0 carries it.
  assert program.table['pend'][0, 0] == 0 and program.outbox[1][0, 0] == 0
  no_send = _corrupt(program, sends=program.sends - {0})
  assert validate(schedule, no_send)[:2] == [
    'tick 0 stage 1: stores into msg slot 0 from offset 1, but stage 0 sends nothing there '
    '(no producer)',
    'tick 1 stage 1: F0.1: msg slot 0 is empty (no producer for act 0.1)',
  ]
  wrong = _corrupt(program, cells={(('outbox', 1), (0, 0)): 1})
  assert validate(schedule, wrong)[0] == (
    'tick 0 stage 0: sending over offset 1: msg slot 1 is empty (nothing waits there)'
  )
  unkept = _corrupt(program, cells={('pend', (0, 0)): -1})
  assert validate(schedule, unkept)[0] == (
    'tick 0 stage 0: F0.0 keeps act 0.1 to send: no msg slot to write act 0.1 to'
  )
