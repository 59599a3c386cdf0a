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

from triax.errors import ConfigError
from triax.pipeline import report
from triax.pipeline import render
from triax.pipeline import schedule as sched
from triax.pipeline.schedule import Action, Schedule
from triax.pipeline.validate import check, validate

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'src')


def F(j, c):
  return Action('F', j, c)


def B(j, c):
  return Action('B', j, c)


def sizes():
  """(name, p, m, v) for every builder over a spread of sizes."""
  for p in (1, 2, 4, 8):
    for m in sorted({1, 3, p, 2 * p, 4 * p}):
      yield 'gpipe', p, m, 1
      yield '1f1b', p, m, 1
      yield 'interleaved_1f1b', p, m, 1
      for v in (2, 4):
        yield 'gpipe', p, m, v
        if m % p == 0:
          yield 'interleaved_1f1b', p, m, v


def env():
  return dict(os.environ, PYTHONPATH=SRC + os.pathsep +
              os.environ.get('PYTHONPATH', ''))


def test_plain_python_modules_do_not_import_jax_or_matplotlib():
  code = ('import sys; import triax.pipeline.schedule, triax.pipeline.validate,'
          ' triax.pipeline.simulate, triax.pipeline.render, '
          'triax.pipeline.report; '
          'print(sorted(m for m in ("jax", "matplotlib") if m in sys.modules))')
  out = subprocess.run([sys.executable, '-c', code], env=env(), check=True,
                       capture_output=True, text=True).stdout
  assert out.strip() == '[]'


# ---------------------------------------------------------------- builders


def test_1f1b_orders():
  s = sched.build('1f1b', 4, 8)
  assert s.orders[0] == (F(0, 0), F(1, 0), F(2, 0), F(3, 0), B(0, 0),
                         F(4, 0), B(1, 0), F(5, 0), B(2, 0), F(6, 0), B(3, 0),
                         F(7, 0), B(4, 0), B(5, 0), B(6, 0), B(7, 0))
  assert s.orders[3] == tuple(x for j in range(8) for x in (F(j, 3), B(j, 3)))
  # Fewer micro-batches than warm-up slots: warm-up is capped at m.
  assert sched.build('1f1b', 4, 2).orders[0] == (F(0, 0), F(1, 0), B(0, 0),
                                                 B(1, 0))


def test_gpipe_orders():
  s = sched.build('gpipe', 2, 3)
  assert s.orders[1] == (F(0, 1), F(1, 1), F(2, 1), B(0, 1), B(1, 1), B(2, 1))
  # Circular: chunk-major forwards, backwards in reverse chunk order.
  s = sched.build('gpipe', 2, 2, 2)
  assert s.orders[0] == (F(0, 0), F(1, 0), F(0, 2), F(1, 2),
                         B(0, 2), B(1, 2), B(0, 0), B(1, 0))


def test_interleaved_orders_follow_megatron():
  s = sched.build('interleaved_1f1b', 2, 4, 2)
  # Device 0 warms up with (p-0-1)*2 + (v-1)*p = 4 forwards.
  assert s.orders[0] == (
      F(0, 0), F(1, 0), F(0, 2), F(1, 2),
      F(2, 0), B(0, 2), F(3, 0), B(1, 2), F(2, 2), B(0, 0), F(3, 2), B(1, 0),
      B(2, 2), B(3, 2), B(2, 0), B(3, 0))
  assert s.orders[1] == (
      F(0, 1), F(1, 1),
      F(0, 3), B(0, 3), F(1, 3), B(1, 3), F(2, 1), B(0, 1), F(3, 1), B(1, 1),
      F(2, 3), B(2, 3), F(3, 3), B(3, 3),
      B(2, 1), B(3, 1))


@pytest.mark.parametrize('p', [1, 2, 4, 8])
@pytest.mark.parametrize('m', [1, 3, 8, 16])
def test_interleaved_with_one_chunk_is_1f1b(p, m):
  assert (sched.build('interleaved_1f1b', p, m).orders ==
          sched.build('1f1b', p, m).orders)


def test_every_builder_gives_a_valid_schedule():
  for name, p, m, v in sizes():
    s = sched.build(name, p, m, v)
    assert (s.name, s.stages, s.microbatches, s.virtual_stages) == (name, p,
                                                                     m, v)
    assert validate(s) == [], (name, p, m, v)


def test_registry_lists_the_builders():
  assert list(sched.SCHEDULES) == ['gpipe', '1f1b', 'interleaved_1f1b',
                                   'bpipe', 'zb_h1']


@pytest.mark.parametrize('args, key, words', [
    (('pipedream', 4, 8), 'pipeline.schedule',
     'unknown schedule pipedream; choose one of gpipe, 1f1b, '
     'interleaved_1f1b, bpipe, zb_h1'),
    (('1f1b', 0, 8), 'mesh.pipe', 'at least 1'),
    (('gpipe', 4, 0), 'pipeline.microbatches', 'at least 1'),
    (('gpipe', 4, 8, 0), 'pipeline.virtual_stages', 'at least 1'),
    (('gpipe', 2.0, 8), 'mesh.pipe', 'integer'),
    (('1f1b', 4, 8, 2), 'pipeline.virtual_stages', 'interleaved_1f1b'),
    (('interleaved_1f1b', 4, 6, 2), 'pipeline.microbatches',
     'interleaved_1f1b needs a multiple of mesh.pipe (=4) micro-batches; '
     'got 6'),
])
def test_bad_arguments_name_the_key(args, key, words):
  with pytest.raises(ConfigError) as e:
    sched.build(*args)
  assert e.value.key == key
  assert words in e.value.message


# ---------------------------------------------------------------- lowering


def ticks_of(program):
  return {a: t for t, row in enumerate(program.grid) for cell in row
          for a in cell}


@pytest.mark.parametrize('p', [1, 2, 4, 8])
@pytest.mark.parametrize('m', [1, 3, 8, 32])
def test_1f1b_lockstep_ticks(p, m):
  program = sched.lower(sched.build('1f1b', p, m))
  tick = ticks_of(program)
  for s in range(p):
    for j in range(m):
      assert tick[F(j, s)] == j + s
      assert tick[B(j, s)] == j + 2 * (p - 1) - s
  assert program.ticks == m + 2 * (p - 1)
  assert program.peak_stash == tuple(min(2 * (p - 1 - s) + 1, m)
                                     for s in range(p))
  assert program.num_stash_slots == max(program.peak_stash)


@pytest.mark.parametrize('p, m', [(1, 1), (2, 4), (4, 8), (8, 16)])
def test_gpipe_lockstep_is_fill_drain(p, m):
  program = sched.lower(sched.build('gpipe', p, m))
  tick = ticks_of(program)
  # The last stage's first backward shares the tick of its last forward
  # (phase 1 follows phase 0), hence one tick fewer than 2(m+p-1).
  assert program.ticks == 2 * (m + p - 1) - 1
  for s in range(p):
    last_forward = max(tick[F(j, s)] for j in range(m))
    first_backward = min(tick[B(j, s)] for j in range(m))
    assert last_forward < first_backward or (
        s == p - 1 and last_forward == first_backward)
  assert program.peak_stash == (m,) * p


def test_1f1b_tables_by_hand():
  program = sched.lower(sched.build('1f1b', 2, 2))
  idle_f, idle_b = [0, -1, -1, -1, -1, -1], [0, -1, -1, -1, -1]
  np.testing.assert_array_equal(program.fwd, [
      [[1, 0, 0, -1, 0, -1], idle_f],
      [[1, 1, 0, -1, 1, -1], [1, 0, 1, 0, 0, 0]],
      [idle_f, [1, 1, 1, 0, 0, 0]],
      [idle_f, idle_f]])
  np.testing.assert_array_equal(program.bwd, [
      [idle_b, idle_b],
      [idle_b, [1, 0, 1, 0, 0]],
      [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]],
      [[1, 1, 0, 1, 0], idle_b]])
  np.testing.assert_array_equal(program.recv, [
      [[-1, -1], [0, -1]],
      [[-1, 0], [0, -1]],
      [[-1, 0], [-1, -1]],
      [[-1, -1], [-1, -1]]])
  assert program.fwd.dtype == np.int32
  assert (program.num_act_slots, program.num_grad_slots,
          program.num_stash_slots, program.peak_stash) == (1, 1, 2, (2, 1))


def test_column_constants():
  assert (sched.F_VALID, sched.F_MB, sched.F_CHUNK, sched.F_ACT, sched.F_STASH,
          sched.F_GRAD) == tuple(range(6))
  assert (sched.B_VALID, sched.B_MB, sched.B_CHUNK, sched.B_STASH,
          sched.B_GRAD) == tuple(range(5))
  assert (sched.R_ACT, sched.R_GRAD) == (0, 1)


def max_overlap(intervals):
  points = sorted({x for w, r in intervals for x in (w, r)})
  return max([sum(w <= x <= r for w, r in intervals) for x in points] or [0])


def buffer_intervals(program):
  """[write, read] phase-times per (stage, buffer), from the grid alone."""
  s, tick = program.schedule, ticks_of(program)
  last, out = s.num_chunks - 1, {}
  for a, t in tick.items():
    if a.kind != 'F':
      continue
    j, c = a.microbatch, a.chunk
    st, tb = s.stage_of(c), tick[B(j, c)]
    out.setdefault((st, 'stash'), []).append((3 * t, 3 * tb + 1))
    if c > 0:
      out.setdefault((st, 'act'), []).append((3 * tick[F(j, c - 1)] + 2, 3 * t))
    grad_write = 3 * t if c == last else 3 * tick[B(j, c + 1)] + 2
    out.setdefault((st, 'grad'), []).append((grad_write, 3 * tb + 1))
  return out


def test_lowered_programs_are_valid_and_use_the_fewest_slots():
  for name, p, m, v in sizes():
    s = sched.build(name, p, m, v)
    program = sched.lower(s)
    assert validate(s, program) == [], (name, p, m, v)
    need = {buf: 1 for buf in ('act', 'grad', 'stash')}
    for (stage, buf), xs in buffer_intervals(program).items():
      need[buf] = max(need[buf], max_overlap(xs))
      if buf == 'stash':
        assert program.peak_stash[stage] == max_overlap(xs)
    assert (program.num_act_slots, program.num_grad_slots,
            program.num_stash_slots) == (need['act'], need['grad'],
                                         need['stash']), (name, p, m, v)


def test_lockstep_forward_overtakes_an_unready_backward():
  # Stage 0 of 1f1b p=2 m=3 wants F0 F1 B0 F2 B1 B2: B0 is not ready at
  # tick 1, F2 still runs at tick 2, before B0 has finished its wait.
  program = sched.lower(sched.build('1f1b', 2, 3))
  tick = ticks_of(program)
  assert (tick[F(2, 0)], tick[B(0, 0)]) == (2, 2)


def test_lowering_reports_a_deadlock_with_the_grid():
  # Stage 0 wants chunk 2 of micro-batch 0 before chunk 0 feeds it.
  s = Schedule('broken', 2, 1, 2, (
      (F(0, 2), F(0, 0), B(0, 2), B(0, 0)),
      (F(0, 1), F(0, 3), B(0, 3), B(0, 1))))
  with pytest.raises(RuntimeError, match='no progress at tick 0'):
    sched.lower(s)
  assert any('deadlock' in x for x in validate(s))


def test_lowering_runs_a_weight_action_in_the_tick_of_its_backward():
  s = Schedule('zb', 1, 1, 1, ((F(0, 0), B(0, 0), Action('W', 0, 0)),))
  program = sched.lower(s)
  assert validate(s, program) == []
  assert program.grid == (((F(0, 0), B(0, 0), Action('W', 0, 0)),),)
  assert program.split_backward
  np.testing.assert_array_equal(program.wgt, [[[1, 0, 0, 0, 0]]])
  # B reads the slots W frees, so both point at the same entries.
  assert program.bwd[0, 0, sched.B_STASH] == program.wgt[0, 0, sched.W_STASH]
  assert program.bwd[0, 0, sched.B_GRAD] == program.wgt[0, 0, sched.W_GRAD]


# ---------------------------------------------------------------- validator


def replace_order(s, stage, order):
  orders = list(s.orders)
  orders[stage] = tuple(order)
  return dataclasses.replace(s, orders=tuple(orders))


def test_validator_rejects_backward_before_forward():
  s = sched.build('1f1b', 2, 2)
  broken = replace_order(s, 1, (B(0, 1), F(0, 1), F(1, 1), B(1, 1)))
  problems = validate(broken)
  assert 'stage 1 position 0: B0.1 runs before its F0.1 (position 1)' in (
      problems)
  with pytest.raises(ValueError, match='B0.1 runs before'):
    check(broken)


def test_validator_rejects_a_missing_backward():
  s = sched.build('1f1b', 2, 2)
  broken = replace_order(s, 0, [a for a in s.orders[0] if a != B(1, 0)])
  assert validate(broken) == [
      'stage 0: B1.0 runs 0 times (want exactly 1)']


def test_validator_rejects_a_duplicated_forward():
  s = sched.build('gpipe', 2, 2)
  broken = replace_order(s, 0, (F(0, 0),) + s.orders[0])
  assert validate(broken) == [
      'stage 0: F0.0 runs 2 times (want exactly 1)']


def test_validator_rejects_misplaced_and_out_of_range_actions():
  s = sched.build('gpipe', 2, 2)
  assert any('lives on stage 1' in x for x in validate(
      replace_order(s, 0, s.orders[0] + (F(0, 1),))))
  assert any('micro-batch outside' in x for x in validate(
      replace_order(s, 0, s.orders[0] + (F(5, 0),))))


def with_tables(program, changes):
  """A copy of program with table entries {(table, index): value} changed."""
  tables = {k: getattr(program, k).copy() for k in ('fwd', 'bwd', 'recv')}
  for (name, index), value in changes.items():
    tables[name][index] = value
  return dataclasses.replace(program, **tables)


def test_validator_rejects_a_slot_conflict():
  s = sched.build('1f1b', 2, 4)
  program = sched.lower(s)
  # F1.0 (tick 1) stashes into F0.0's slot while F0.0 still waits for B0.0.
  assert program.fwd[0, 0, sched.F_STASH] != program.fwd[1, 0, sched.F_STASH]
  broken = with_tables(program, {
      ('fwd', (1, 0, sched.F_STASH)): program.fwd[0, 0, sched.F_STASH]})
  problems = validate(s, broken)
  assert problems[0] == ('tick 1 stage 0: F1.0: stash slot 0 still holds '
                         '0.0 (slot conflict)')


def test_validator_rejects_a_dropped_message_and_a_phantom_receive():
  s = sched.build('1f1b', 2, 2)
  program = sched.lower(s)
  dropped = with_tables(program, {('recv', (0, 1, sched.R_ACT)): -1})
  assert any('tick 0 stage 1: drops act 0.1 from stage 0 (no consumer slot)'
             == x
             for x in validate(s, dropped))
  phantom = with_tables(program, {('recv', (3, 1, sched.R_ACT)): 0})
  assert any('stage 0 sends nothing (no producer)' in x
             for x in validate(s, phantom))


def test_validator_rejects_slots_beyond_the_count():
  s = sched.build('1f1b', 2, 2)
  program = dataclasses.replace(sched.lower(s), num_stash_slots=1)
  assert any('stash slot 1 outside 0..0' in x for x in validate(s, program))


def test_validator_rejects_broken_lockstep_dependencies():
  s = sched.build('1f1b', 2, 1)
  program = sched.lower(s)  # F0.0 @0; F0.1, B0.1 @1; B0.0 @2.
  grid = [list(row) for row in program.grid]
  grid[0][1], grid[1][1] = grid[1][1], ()
  broken = with_tables(program, {
      ('fwd', (0, 1)): program.fwd[1, 1], ('fwd', (1, 1)): program.fwd[2, 1],
      ('bwd', (0, 1)): program.bwd[1, 1], ('bwd', (1, 1)): program.bwd[2, 1]})
  broken = dataclasses.replace(broken,
                               grid=tuple(tuple(r) for r in grid))
  assert 'tick 0 stage 1: F0.1 runs before its input from F0.0 (tick 0)' in (
      validate(s, broken))


def test_validator_rejects_grid_and_tables_that_disagree():
  s = sched.build('1f1b', 2, 2)
  program = sched.lower(s)
  broken = with_tables(program, {('fwd', (0, 0, sched.F_MB)): 1})
  assert any('grid says' in x for x in validate(s, broken))


# ---------------------------------------------------------------- render, CLI


def test_text_grid_is_readable():
  program = sched.lower(sched.build('interleaved_1f1b', 4, 8, 2))
  lines = render.text_grid(program).splitlines()
  assert len(lines) == 2 + 2 * 4  # title, tick header, F and B per stage
  assert lines[2].split()[:3] == ['s0', 'F', 'F0.0']
  assert lines[3].split()[0] == 'B'
  assert len({len(x) for x in lines[1:]}) == 1  # aligned columns
  assert 'B7.0' in lines[3]


def run_cli(*args):
  return subprocess.run([sys.executable, '-m', 'triax.schedule', *args],
                        env=env(), capture_output=True, text=True, timeout=60)


def test_cli_json():
  out = run_cli('--schedule=interleaved_1f1b', '--stages=4',
                '--microbatches=8', '--virtual_stages=2', '--json')
  assert out.returncode == 0, out.stderr
  report_ = json.loads(out.stdout)
  assert report_['schedule'] == 'interleaved_1f1b'
  assert (report_['stages'], report_['microbatches'],
          report_['virtual_stages']) == (4, 8, 2)
  assert report_['valid'] is True
  assert report_['ticks'] == 26
  assert report_['peak_inflight'] == [11, 9, 7, 5]
  assert report_['stash_slots'] == 11
  assert report_['bubble_fraction'] == pytest.approx(3 / 19)
  assert set(report_['models']) == {'lockstep', 'async'}
  for model in report_['models'].values():
    assert set(model) >= {'total_time', 'bubble_fraction', 'peak_inflight'}


def test_cli_rejects_bad_input_with_exit_code_2():
  out = run_cli('--stages=0')
  assert out.returncode == 2
  assert out.stdout == ''
  assert out.stderr.strip().splitlines() == [
      'error: --stages: pipeline stages must be at least 1; got 0']
  out = run_cli('--stages=two')
  assert out.returncode == 2
  assert out.stderr.strip().startswith('error: flags:')


def test_report_text_and_plot(tmp_path, capsys):
  path = str(tmp_path / 'gantt.png')
  summary = report.run(report.Request('gpipe', 2, 4, t_backward=2.0,
                                      plot=path))
  text = capsys.readouterr().out
  assert 'lockstep (the executor): 9 ticks' in text and 'valid' in text
  assert summary['plot'] == path
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('request_, key', [
    (report.Request(plot='x.svg'), '--plot'),
    (report.Request(t_transfer=-1.0), '--t_transfer'),
    (report.Request(virtual_stages=2), '--virtual_stages'),
    (report.Request(schedule='pipedream'), '--schedule'),
    (report.Request(schedule='zb_h1', virtual_stages=2), '--virtual_stages'),
    (report.Request(t_evict=-1.0), '--t_evict'),
])
def test_report_names_the_flag(request_, key, capsys):
  assert report.main(request_) == 2
  assert capsys.readouterr().err.startswith(f'error: {key}: ')
