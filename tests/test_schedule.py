"""Schedule IR, builders, lockstep lowering, validator, text grid and CLI.

Pure Python: nothing here imports JAX.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from actions import B, F, W

from triax.errors import ConfigError
from triax.pipeline import lower as lower_lib
from triax.pipeline import render, report, simulate
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Schedule
from triax.pipeline.validate import check, validate

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'src')


def sizes():
  """(name, p, m, v) for every builder over a spread of sizes it accepts."""
  for name in sched.SCHEDULES:
    for p in (1, 2, 4, 8):
      for m in sorted({1, 3, p, 2 * p, 4 * p}):
        for v in (1, 2, 4):
          try:
            sched.build(name, p, m, v)
          except ConfigError:
            continue
          yield name, p, m, v


def env():
  return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get('PYTHONPATH', ''))


def test_plain_python_modules_do_not_import_jax_or_matplotlib():
  code = (
    'import sys; import triax.pipeline.schedule, triax.pipeline.validate,'
    ' triax.pipeline.simulate, triax.pipeline.render, '
    'triax.pipeline.report; '
    'print(sorted(m for m in ("jax", "matplotlib") if m in sys.modules))'
  )
  out = subprocess.run(
    [sys.executable, '-c', code], env=env(), check=True, capture_output=True, text=True
  ).stdout
  assert out.strip() == '[]'


# ---------------------------------------------------------------- builders


def test_1f1b_orders():
  s = sched.build('1f1b', 4, 8)
  assert s.orders[0] == (
    F(0, 0),
    F(1, 0),
    F(2, 0),
    F(3, 0),
    B(0, 0),
    F(4, 0),
    B(1, 0),
    F(5, 0),
    B(2, 0),
    F(6, 0),
    B(3, 0),
    F(7, 0),
    B(4, 0),
    B(5, 0),
    B(6, 0),
    B(7, 0),
  )
  assert s.orders[3] == tuple(x for j in range(8) for x in (F(j, 3), B(j, 3)))
  # Fewer micro-batches than warm-up slots: warm-up is capped at m.
  assert sched.build('1f1b', 4, 2).orders[0] == (F(0, 0), F(1, 0), B(0, 0), B(1, 0))


def test_gpipe_orders():
  s = sched.build('gpipe', 2, 3)
  assert s.orders[1] == (F(0, 1), F(1, 1), F(2, 1), B(0, 1), B(1, 1), B(2, 1))
  # Circular: chunk-major forwards, backwards in reverse chunk order.
  s = sched.build('gpipe', 2, 2, 2)
  assert s.orders[0] == (F(0, 0), F(1, 0), F(0, 2), F(1, 2), B(0, 2), B(1, 2), B(0, 0), B(1, 0))


def test_interleaved_orders_follow_megatron():
  s = sched.build('interleaved_1f1b', 2, 4, 2)
  # Device 0 warms up with (p-0-1)*2 + (v-1)*p = 4 forwards.
  assert s.orders[0] == (
    F(0, 0),
    F(1, 0),
    F(0, 2),
    F(1, 2),
    F(2, 0),
    B(0, 2),
    F(3, 0),
    B(1, 2),
    F(2, 2),
    B(0, 0),
    F(3, 2),
    B(1, 0),
    B(2, 2),
    B(3, 2),
    B(2, 0),
    B(3, 0),
  )
  assert s.orders[1] == (
    F(0, 1),
    F(1, 1),
    F(0, 3),
    B(0, 3),
    F(1, 3),
    B(1, 3),
    F(2, 1),
    B(0, 1),
    F(3, 1),
    B(1, 1),
    F(2, 3),
    B(2, 3),
    F(3, 3),
    B(3, 3),
    B(2, 1),
    B(3, 1),
  )


@pytest.mark.parametrize('p', [1, 2, 4, 8])
@pytest.mark.parametrize('m', [1, 3, 8, 16])
def test_interleaved_with_one_chunk_is_1f1b(p, m):
  assert sched.build('interleaved_1f1b', p, m).orders == sched.build('1f1b', p, m).orders


def test_every_builder_gives_a_valid_schedule():
  for name, p, m, v in sizes():
    s = sched.build(name, p, m, v)
    assert (s.name, s.stages, s.microbatches, s.virtual_stages) == (name, p, m, v)
    assert validate(s) == [], (name, p, m, v)


def test_every_schedule_is_exported_and_named_where_the_config_lists_them():
  for name, builder in sched.SCHEDULES.items():
    assert getattr(sched, builder.__name__) is builder, name  # the facade's one import
  text = open(os.path.join(SRC, 'triax', 'config.py')).read()
  listed = text.split('# Pipeline schedule: ')[1].split('(pipeline/schedules/')[0]
  assert [n.strip(' ,\n#') for n in listed.split(',')] == list(sched.SCHEDULES)


@pytest.mark.parametrize(
  'args, key, words',
  [
    (
      ('pipedream', 4, 8),
      'pipeline.schedule',
      'unknown schedule pipedream; choose one of gpipe, 1f1b, interleaved_1f1b, bpipe, zb_h1',
    ),  # a prefix: more may be listed
    (('1f1b', 0, 8), 'mesh.pipe', 'at least 1'),
    (('gpipe', 4, 0), 'pipeline.microbatches', 'at least 1'),
    (('gpipe', 4, 8, 0), 'pipeline.virtual_stages', 'at least 1'),
    (('gpipe', 2.0, 8), 'mesh.pipe', 'integer'),
    (('1f1b', 4, 8, 2), 'pipeline.virtual_stages', 'interleaved_1f1b'),
    (
      ('interleaved_1f1b', 4, 9, 2),
      'pipeline.microbatches',
      'interleaved_1f1b with virtual stages runs micro-batches in equal rounds',
    ),
  ],
)
def test_bad_arguments_name_the_key(args, key, words):
  with pytest.raises(ConfigError) as e:
    sched.build(*args)
  assert e.value.key == key
  assert words in e.value.message


# ---------------------------------------------------------------- lowering


def ticks_of(program):
  return {a: t for t, row in enumerate(program.grid) for cell in row for a in cell}


@pytest.mark.parametrize('p', [1, 2, 4, 8])
@pytest.mark.parametrize('m', [1, 3, 8, 32])
def test_1f1b_lockstep_ticks(p, m):
  """One compute action a stage a tick, the fused B run as B then W: the
  steady state is F, B, W every three ticks, and the backward chain moves a
  stage a tick (B takes one tick, not a fused backward's two)."""
  program = sched.lower(sched.build('1f1b', p, m))
  tick = ticks_of(program)
  for s in range(p):
    for j in range(m):
      warm = j < p - s
      assert tick[F(j, s)] == (j + s if warm else 3 * j - p + 2 * s + 1)
      assert tick[B(j, s)] == 3 * j + 2 * p - 1 - s
      assert tick[W(j, s)] == tick[B(j, s)] + 1
  assert program.ticks == 3 * m + 2 * (p - 1)
  # Stage s holds p - s residual sets: 1F1B's, as in the papers.
  assert program.peak_stash == tuple(min(p - s, m) for s in range(p))
  assert program.slots['stash'] == max(program.peak_stash)
  # Each B's cut is consumed by its W in the next tick.
  assert program.peaks['cut'] == (1,) * p


@pytest.mark.parametrize('p, m', [(1, 1), (2, 4), (4, 8), (8, 16)])
def test_gpipe_lockstep_is_fill_drain(p, m):
  program = sched.lower(sched.build('gpipe', p, m))
  tick = ticks_of(program)
  assert program.ticks == 3 * m + 2 * (p - 1)
  for s in range(p):
    assert max(tick[F(j, s)] for j in range(m)) < min(tick[B(j, s)] for j in range(m))
  assert program.peak_stash == (m,) * p


def test_every_fused_backward_runs_as_b_then_w():
  s = sched.build('1f1b', 4, 8)
  program = sched.lower(s)
  assert program.source is s and not program.split_backward
  assert program.schedule == sched.with_split_backward(s)
  for order in program.schedule.orders:
    for a, b in zip(order, order[1:]):
      if a.kind == 'B':
        assert b == W(a.microbatch, a.chunk)
  # A schedule built split runs as built.
  zb = sched.build('zb_h1', 4, 8)
  assert sched.lower(zb).schedule == zb and sched.lower(zb).split_backward


def test_1f1b_tables_by_hand():
  program = sched.lower(sched.build('1f1b', 2, 2))
  t = {name: x.T.tolist() for name, x in program.table.items()}  # [stage][tick]
  assert t['kind'] == [[1, 1, 0, 2, 3, 0, 2, 3], [0, 1, 2, 3, 1, 2, 3, 0]]
  assert t['mb'] == [[0, 1, -1, 0, 0, -1, 1, 1], [-1, 0, 0, 0, 1, 1, 1, -1]]
  assert t['chunk'] == [[0, 0, -1, 0, 0, -1, 0, 0], [-1, 1, 1, 1, 1, 1, 1, -1]]
  assert t['local'] == [[0, 0, -1, 0, 0, -1, 0, 0], [-1, 0, 0, 0, 0, 0, 0, -1]]
  # Chunk 0 embeds (no src); stage 1's F reads its activation, B its loss
  # gradient, which the same F wrote (loss) after reading its input.
  assert t['src'] == [[-1, -1, -1, 0, -1, -1, 0, -1], [-1, 0, 0, -1, 1, 0, -1, -1]]
  assert t['loss'] == [[-1] * 8, [-1, 0, -1, -1, 0, -1, -1, -1]]
  assert t['stash'] == [[0, 1, -1, 0, 0, -1, 1, 1], [-1, 0, 0, 0, 0, 0, 0, -1]]
  assert t['cut'] == [[-1, -1, -1, 0, 0, -1, 0, 0], [-1, -1, 0, 0, -1, 0, 0, -1]]
  assert t['move_send'] == t['move_recv'] == [[-1] * 8] * 2
  # Both neighbours are offset 1 at p = 2 (+1 = -1 mod 2).
  assert {o: x.T.tolist() for o, x in program.recv.items()} == {
    1: [[-1, -1, 0, -1, -1, 0, -1, -1], [0, 1, -1, -1, -1, -1, -1, -1]]
  }
  assert all(x.dtype == np.int32 for x in program.table.values())
  assert program.slots == {'msg': 2, 'stash': 2, 'cut': 1}
  assert program.peaks == {'msg': (1, 2), 'stash': (2, 1), 'cut': (1, 1)}
  assert program.partner is None


def test_tables_are_named_arrays_of_ticks_by_stages():
  program = sched.lower(sched.build('interleaved_1f1b', 4, 8, 2))
  assert set(program.table) == set(lower_lib.TABLES)
  for x in list(program.table.values()) + list(program.recv.values()):
    assert x.shape == (program.ticks, 4) and x.dtype == np.int32
  # Megatron's placement: a forward chain goes +1, a backward one -1 (= 3).
  assert program.offsets == (1, 3)


def max_overlap(intervals):
  points = sorted({x for w, r in intervals for x in (w, r)})
  return max([sum(w <= x <= r for w, r in intervals) for x in points] or [0])


def buffer_intervals(program):
  """[write, read] times per (stage, buffer), from the grid alone.

  A tick's phases are land 0, compute 1, send 2, receive 3; no residuals
  move here. The last chunk's loss gradient is written just after its F
  reads its input.
  """
  s, tick = program.schedule, ticks_of(program)
  last, out = s.num_chunks - 1, {}
  for a, t in tick.items():
    if a.kind != 'F':
      continue
    j, c = a.microbatch, a.chunk
    st, tb, tw = s.stage_of(c), tick[B(j, c)], tick[W(j, c)]
    out.setdefault((st, 'stash'), []).append((4 * t + 1, 4 * tw + 1))
    out.setdefault((st, 'cut'), []).append((4 * tb + 1, 4 * tw + 1))
    if c > 0:
      out.setdefault((st, 'msg'), []).append((4 * tick[F(j, c - 1)] + 3, 4 * t + 1))
    grad_write = 4 * t + 1.5 if c == last else 4 * tick[B(j, c + 1)] + 3
    out.setdefault((st, 'msg'), []).append((grad_write, 4 * tb + 1))
  return out


def test_lowered_programs_are_valid_and_use_the_fewest_slots():
  for name, p, m, v in sizes():
    s = sched.build(name, p, m, v)
    program = sched.lower(s)
    assert validate(s, program) == [], (name, p, m, v)
    if s.evicted:
      continue  # moving sets: the validator's replay checks those peaks
    need = {buf: 1 for buf in ('msg', 'stash', 'cut')}
    for (stage, buf), xs in buffer_intervals(program).items():
      need[buf] = max(need[buf], max_overlap(xs))
      assert program.peaks[buf][stage] == max_overlap(xs), (name, p, m, v, buf)
    assert program.slots == need, (name, p, m, v)


def test_lockstep_is_the_split_schedule_run_asynchronously_at_unit_cost():
  """lower.py's promise: an action runs in the first tick after its inputs
  arrived, so each action's tick is its start time in the asynchronous
  model of the split schedule with every action costing one tick."""
  for name, p, m, v in sizes():
    s = sched.build(name, p, m, v)
    if s.evicted:
      continue  # copies ride the copy stream there, not the ticks
    program = sched.lower(s)
    unit = simulate.Costs(t_forward=v, t_backward=v, t_weight=v)
    result = simulate.simulate_async(program.schedule, unit)
    assert {x.action: x.start for x in result.timeline} == ticks_of(program), (name, p, m, v)


def test_lockstep_keeps_each_stage_in_its_order():
  # Stage 0 of 1f1b p=2 m=3 runs F0 F1 B0 W0 F2 ...: B0.0 is not ready at
  # tick 2, and F2.0, which is, waits behind it (one action a tick, in order).
  program = sched.lower(sched.build('1f1b', 2, 3))
  tick = ticks_of(program)
  assert program.grid[2][0] == ()
  assert (tick[B(0, 0)], tick[W(0, 0)], tick[F(2, 0)]) == (3, 4, 5)


def test_lowering_reports_a_deadlock_with_the_grid():
  # Stage 0 wants chunk 2 of micro-batch 0 before chunk 0 feeds it.
  s = Schedule(
    'broken', 2, 1, 2, ((F(0, 2), F(0, 0), B(0, 2), B(0, 0)), (F(0, 1), F(0, 3), B(0, 3), B(0, 1)))
  )
  with pytest.raises(RuntimeError, match='no progress at tick 0'):
    sched.lower(s)
  assert any('deadlock' in x for x in validate(s))


def test_lowering_runs_a_weight_action_the_tick_after_its_backward():
  s = Schedule('zb', 1, 1, 1, ((F(0, 0), B(0, 0), W(0, 0)),))
  program = sched.lower(s)
  assert validate(s, program) == []
  assert program.grid == (((F(0, 0),),), ((B(0, 0),),), ((W(0, 0),),))
  assert program.split_backward
  assert program.table['kind'][:, 0].tolist() == [1, 2, 3]
  # B and W read the same residual slot; W reads the cut B wrote.
  assert program.table['stash'][1, 0] == program.table['stash'][2, 0]
  assert program.table['cut'][1, 0] == program.table['cut'][2, 0] == 0


def v_shaped(m=2):
  """GPipe over a V: chunks 0, 1 on stages 0, 1 and chunks 2, 3 back on 1, 0."""
  p, placement = 2, sched.v_placement(2)
  orders = []
  for s in range(p):
    mine = [c for c in range(4) if placement[c] == s]
    orders.append(
      [F(j, c) for c in mine for j in range(m)]
      + [B(j, c) for c in reversed(mine) for j in range(m)]
    )
  return Schedule('v', p, m, 2, tuple(map(tuple, orders)), placement=placement)


def test_a_v_placement_lowers_and_validates():
  s = v_shaped()
  assert s.placement == (0, 1, 1, 0)
  assert validate(s) == []
  program = sched.lower(s)
  assert validate(s, program) == []
  # Chunk 1 -> 2 stays on stage 1 (offset 0): the only neighbour messages
  # cross 0 <-> 1.
  assert set(program.offsets) == {0, 1}
  tick = ticks_of(program)
  assert program.recv[0][tick[F(0, 1)], 1] >= 0  # kept on stage 1
  assert program.recv[1][tick[F(0, 2)], 0] >= 0  # sent on to stage 0
  assert program.table['local'][tick[F(0, 3)], 0] == 1


# ---------------------------------------------------------------- validator


def replace_order(s, stage, order):
  orders = list(s.orders)
  orders[stage] = tuple(order)
  return dataclasses.replace(s, orders=tuple(orders))


def test_validator_rejects_backward_before_forward():
  s = sched.build('1f1b', 2, 2)
  broken = replace_order(s, 1, (B(0, 1), F(0, 1), F(1, 1), B(1, 1)))
  problems = validate(broken)
  assert 'stage 1 position 0: B0.1 runs before its F0.1 (position 1)' in (problems)
  with pytest.raises(ValueError, match='B0.1 runs before'):
    check(broken)


def test_validator_rejects_a_missing_backward():
  s = sched.build('1f1b', 2, 2)
  broken = replace_order(s, 0, [a for a in s.orders[0] if a != B(1, 0)])
  assert validate(broken) == ['stage 0: B1.0 runs 0 times (want exactly 1)']


def test_validator_rejects_a_duplicated_forward():
  s = sched.build('gpipe', 2, 2)
  broken = replace_order(s, 0, (F(0, 0),) + s.orders[0])
  assert validate(broken) == ['stage 0: F0.0 runs 2 times (want exactly 1)']


def test_validator_rejects_misplaced_and_out_of_range_actions():
  s = sched.build('gpipe', 2, 2)
  assert any(
    'lives on stage 1' in x for x in validate(replace_order(s, 0, s.orders[0] + (F(0, 1),)))
  )
  assert any(
    'micro-batch outside' in x for x in validate(replace_order(s, 0, s.orders[0] + (F(5, 0),)))
  )
  # Under a V, chunk 3 lives on stage 0, not on stage 3 mod 2 = 1.
  v = v_shaped()
  assert any(
    'chunk 3 lives on stage 0' in x for x in validate(replace_order(v, 1, v.orders[1] + (F(0, 3),)))
  )


def test_validator_checks_the_placement():
  s = v_shaped()
  assert validate(dataclasses.replace(s, placement=(0, 1, 1))) == [
    'placement (0, 1, 1) has 3 entries for p*v = 4 chunks'
  ]
  assert validate(dataclasses.replace(s, placement=(0, 1, 1, 1))) == [
    'placement puts 1 chunks on stage 0 ([0]); every stage holds v = 2',
    'placement puts 3 chunks on stage 1 ([1, 2, 3]); every stage holds v = 2',
  ]
  assert validate(dataclasses.replace(s, placement=(0, 1, 2, 0))) == [
    'placement puts chunk 2 on stage 2, outside 0..1'
  ]


def with_tables(program, changes, grid=None):
  """A copy of program with entries {(table, index): value} changed.

  `table` is a name of program.table, or ('recv', offset).
  """
  table = {k: x.copy() for k, x in program.table.items()}
  recv = {o: x.copy() for o, x in program.recv.items()}
  for (name, index), value in changes.items():
    target = recv[name[1]] if isinstance(name, tuple) else table[name]
    target[index] = value
  extra = {} if grid is None else {'grid': tuple(tuple(map(tuple, row)) for row in grid)}
  return dataclasses.replace(program, table=table, recv=recv, **extra)


def test_validator_rejects_an_overwritten_live_stash_slot():
  s = sched.build('1f1b', 2, 4)
  program = sched.lower(s)
  # F1.0 (tick 1) stashes into F0.0's slot while F0.0 still waits for B0.0.
  first, second = program.table['stash'][0, 0], program.table['stash'][1, 0]
  assert first != second
  broken = with_tables(program, {('stash', (1, 0)): first})
  problems = validate(s, broken)
  assert problems[0] == (
    f'tick 1 stage 0: F1.0: stash slot {first} still holds set 0.0 (overwritten by set 1.0)'
  )


def test_validator_rejects_an_overwritten_live_message():
  s = sched.build('1f1b', 2, 2)
  program = sched.lower(s)
  # Stage 1 receives act 1.1 at tick 1 into slot 1 while slot 0 holds the
  # loss gradient F0.1 just wrote; pointing the arrival at slot 0 clobbers it.
  assert program.recv[1][1, 1] == 1 and program.table['loss'][1, 1] == 0
  broken = with_tables(program, {(('recv', 1), (1, 1)): 0})
  assert validate(s, broken)[0] == (
    'tick 1 stage 1: receiving act 1.1 from stage 0: msg slot 0 still holds '
    'grad 0.1 (overwritten by act 1.1)'
  )


def test_validator_rejects_a_read_from_the_wrong_slot():
  s = sched.build('1f1b', 2, 2)
  program = sched.lower(s)
  # B0.1 (tick 2) reads its gradient from slot 0; slot 1 holds act 1.1.
  assert program.table['src'][2, 1] == 0
  broken = with_tables(program, {('src', (2, 1)): 1})
  assert validate(s, broken)[0] == ('tick 2 stage 1: B0.1: msg slot 1 holds act 1.1, not grad 0.1')


def test_validator_rejects_a_dropped_message_and_a_phantom_receive():
  s = sched.build('1f1b', 2, 2)
  program = sched.lower(s)
  dropped = with_tables(program, {(('recv', 1), (0, 1)): -1})
  assert 'tick 0 stage 1: drops act 0.1 from stage 0 (no consumer slot)' in validate(s, dropped)
  phantom = with_tables(program, {(('recv', 1), (7, 1)): 0})
  assert any(
    'tick 7 stage 1: stores into msg slot 0 from offset 1, but stage 0 '
    'sends nothing there (no producer)' == x
    for x in validate(s, phantom)
  )


def test_validator_rejects_slots_beyond_the_count():
  s = sched.build('1f1b', 2, 2)
  program = sched.lower(s)
  program = dataclasses.replace(program, slots=dict(program.slots, stash=1))
  assert 'tick 1 stage 0: stash names stash slot 1, outside 0..0' in validate(s, program)


def test_validator_rejects_a_dependency_moved_into_its_tick():
  s = sched.build('1f1b', 2, 1)
  program = sched.lower(s)  # F0.0 @0; F0.1 @1, B0.1 @2, ...
  assert program.grid[0][1] == () and program.grid[1][1] == (F(0, 1),)
  grid = [list(row) for row in program.grid]
  grid[0][1], grid[1][1] = grid[1][1], ()
  changes = {}
  for name, x in program.table.items():
    changes[(name, (0, 1))] = x[1, 1]
    changes[(name, (1, 1))] = 0 if name == 'kind' else -1
  broken = with_tables(program, changes, grid)
  assert 'tick 0 stage 1: F0.1 runs before its input from F0.0 (tick 0)' in (validate(s, broken))


def test_validator_rejects_two_compute_actions_in_a_tick():
  s = sched.build('1f1b', 2, 1)
  program = sched.lower(s)
  grid = [list(row) for row in program.grid]
  grid[1][1] = (F(0, 1), B(0, 1))
  grid[2][1] = ()
  problems = validate(s, with_tables(program, {}, grid))
  assert (
    'tick 1 stage 1: runs 2 compute actions (F0.1, B0.1); a tick runs one, '
    'or an overlapped pair with its W'
  ) in problems


def test_validator_rejects_a_stage_out_of_its_order():
  s = sched.build('gpipe', 1, 2)
  program = sched.lower(s)  # F0 F1 B0 W0 B1 W1
  order = [a for row in program.grid for cell in row for a in cell]
  assert order == [F(0, 0), F(1, 0), B(0, 0), W(0, 0), B(1, 0), W(1, 0)]
  swapped = [2, 4, 3, 5]  # B0 B1 W0 W1: each input still comes first
  grid = [list(row) for row in program.grid]
  changes = {}
  for t, u in zip([2, 3, 4, 5], swapped):
    grid[t][0] = program.grid[u][0]
    for name, x in program.table.items():
      changes[(name, (t, 0))] = x[u, 0]
  problems = validate(s, with_tables(program, changes, grid))
  assert problems == ['stage 0: its compute action 3 is B1.0 in the program but W0.0 in its order']


def test_validator_rejects_grid_and_tables_that_disagree():
  s = sched.build('1f1b', 2, 2)
  program = sched.lower(s)
  broken = with_tables(program, {('mb', (0, 0)): 1})
  assert "tick 0 stage 0: grid says ['F0.0'] but the tables say ['F1.0']" in (validate(s, broken))
  broken = with_tables(program, {('local', (0, 0)): 1})
  assert 'tick 0 stage 0: F0.0 names local chunk 1; chunk 0 is local 0' in validate(s, broken)


def test_validator_checks_the_peaks_the_program_claims():
  s = sched.build('1f1b', 4, 8)
  program = sched.lower(s)
  lying = dataclasses.replace(program, peaks=dict(program.peaks, stash=(3, 3, 2, 1)))
  assert validate(s, lying) == [
    "program.peaks['stash'] is (3, 3, 2, 1) but the tables hold at most (4, 3, 2, 1)"
  ]


def test_validator_rejects_a_program_of_another_schedule():
  s = sched.build('1f1b', 2, 2)
  other = sched.lower(sched.build('gpipe', 2, 2))
  assert validate(s, other) == [
    'program.schedule (gpipe) is not the schedule validated with every '
    'fused B split into B then W (1f1b)'
  ]


# ---------------------------------------------------------------- render, CLI


def test_text_grid_is_readable():
  program = sched.lower(sched.build('interleaved_1f1b', 4, 8, 2))
  lines = render.text_grid(program).splitlines()
  # Title, tick header, F, B and W per stage (the fused B runs as B then W).
  assert len(lines) == 2 + 3 * 4
  assert lines[2].split()[:3] == ['s0', 'F', 'F0.0']
  assert [x.split()[0] for x in lines[3:5]] == ['B', 'W']
  assert len({len(x) for x in lines[1:]}) == 1  # aligned columns
  assert 'B7.0' in lines[3] and 'W7.0' in lines[4]


def run_cli(*args):
  return subprocess.run(
    [sys.executable, '-m', 'triax.cli.schedule', *args],
    env=env(),
    capture_output=True,
    text=True,
    timeout=60,
  )


def test_cli_json():
  out = run_cli(
    '--schedule=interleaved_1f1b', '--stages=4', '--microbatches=8', '--virtual_stages=2', '--json'
  )
  assert out.returncode == 0, out.stderr
  report_ = json.loads(out.stdout)
  assert report_['schedule'] == 'interleaved_1f1b'
  assert (report_['stages'], report_['microbatches'], report_['virtual_stages']) == (4, 8, 2)
  assert report_['valid'] is True
  assert report_['ticks'] == 3 * 8 * 2 + 2 * 3
  assert report_['peak_inflight'] == [11, 9, 7, 5]
  assert report_['slots']['stash'] == 11
  # CLI defaults t_F = 1 and a fused t_B = 2: chunk F 1/2, its B split into
  # B and W of 1/2 each, so every one of the 54 ticks lasts 1/2.
  assert report_['models']['lockstep']['total_time'] == pytest.approx(27.0)
  assert report_['bubble_fraction'] == pytest.approx(3 / 27)
  assert set(report_['models']) == {'lockstep', 'async'}
  for model in report_['models'].values():
    assert set(model) >= {'total_time', 'bubble_fraction', 'peak_inflight'}


def test_cli_rejects_bad_input_with_exit_code_2():
  out = run_cli('--stages=0')
  assert out.returncode == 2
  assert out.stdout == ''
  assert out.stderr.strip().splitlines() == [
    'error: --stages: pipeline stages must be at least 1; got 0'
  ]
  out = run_cli('--stages=two')
  assert out.returncode == 2
  assert out.stderr.strip().startswith('error: flags:')


def test_cli_zb_v_defaults_to_its_v_and_still_rejects_a_wrong_one():
  out = run_cli('--schedule=zb_v', '--stages=2', '--microbatches=4', '--json')
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout)['virtual_stages'] == 2
  out = run_cli('--schedule=zb_v', '--stages=2', '--microbatches=4', '--virtual_stages=1')
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith('error: --virtual_stages: zb_v runs')
  out = run_cli('--schedule=1f1b', '--stages=2', '--microbatches=4', '--json')
  assert json.loads(out.stdout)['virtual_stages'] == 1


def test_report_text_and_plot(tmp_path, capsys):
  path = str(tmp_path / 'gantt.png')
  summary = report.run(report.Request('gpipe', 2, 4, t_backward=2.0, plot=path))
  text = capsys.readouterr().out
  assert 'lockstep (the executor): 14 ticks' in text and 'valid' in text
  assert summary['plot'] == path
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  # The picture replaces the grid (a column per tick); without --plot the grid is printed.
  assert text.splitlines()[0].startswith('lockstep')
  report.run(report.Request('gpipe', 2, 4))
  assert capsys.readouterr().out.startswith('gpipe: stages=2')


def test_plot_legend_names_each_kind_drawn_and_each_local_chunk_shade():
  from matplotlib.patches import Patch

  one = render._legend({sched.FORWARD, sched.BACKWARD}, 1, Patch)
  assert [p.get_label() for p in one] == ['F', 'B']
  two = render._legend({sched.FORWARD, sched.BACKWARD, sched.WEIGHT}, 2, Patch)
  assert [p.get_label() for p in two] == [
    f'{k}, local chunk {c}' for k in ('F', 'B', 'W') for c in (0, 1)
  ]
  assert two[0].get_facecolor() != two[1].get_facecolor()  # the later chunk is darker


@pytest.mark.parametrize(
  'request_, key',
  [
    (report.Request(plot='x.svg'), '--plot'),
    (report.Request(t_transfer=-1.0), '--t_transfer'),
    (report.Request(virtual_stages=2), '--virtual_stages'),
    (report.Request(schedule='pipedream'), '--schedule'),
    (report.Request(schedule='zb_h1', virtual_stages=2), '--virtual_stages'),
    (report.Request(t_evict=-1.0), '--t_evict'),
  ],
)
def test_report_names_the_flag(request_, key, capsys):
  assert report.main(request_) == 2
  assert capsys.readouterr().err.startswith(f'error: {key}: ')
