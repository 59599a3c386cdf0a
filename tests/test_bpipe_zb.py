"""bpipe_zb, BPipe's evictions inside zero-bubble: memory and ticks against
zb_h1 and bpipe, validity, the time models, bad input, the CLI and, at
p = 8, the compiled temp bytes.

The loss and gradients against one device are test_pipeline_parity.py's:
its grid runs every registered schedule on (data, tensor, pipe) = (1,1,4),
(2,1,4), (1,2,4), (1,1,8).
"""

import json
import os
import subprocess
import sys

import harness
import pytest

from triax.errors import ConfigError
from triax.pipeline import files
from triax.pipeline import schedule as sched
from triax.pipeline.schedules.bpipe import evict_to_partners
from triax.pipeline.simulate import Costs, simulate_async, simulate_lockstep
from triax.pipeline.validate import validate

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'src')
PM = [(p, m) for p in (4, 8, 16) for m in (p, 2 * p, 4 * p)]
UNIT = Costs(t_forward=1, t_backward=1, t_weight=1)


def lowered(name, p, m):
  return sched.lower(sched.build(name, p, m))


@pytest.mark.fast
@pytest.mark.parametrize('p, m', PM)
def test_bpipes_memory_in_fewer_ticks(p, m):
  s = sched.build('bpipe_zb', p, m)
  program = sched.lower(s)
  assert validate(s, program) == []
  zb, bp = lowered('zb_h1', p, m), lowered('bpipe', p, m)
  # BPipe's cap on every stage, against zb_h1's p.
  assert s.stash_cap == sched.bpipe_stash_cap(p, m)
  assert max(program.peak_stash) == s.stash_cap < max(zb.peak_stash) == p
  # Some of zb_h1's bubble removed: one tick for each of the q stages that
  # lag their last q+1 W's (q+1 cuts held), between bpipe and zb_h1.
  q = max(program.peaks['cut']) - 1
  assert program.ticks == 3 * m + 2 * p - 2 - q
  assert zb.ticks < program.ticks < bp.ticks
  assert sched.transfers_per_step(program)['total'] > 0


@pytest.mark.fast
def test_p8_m32_figures():
  """The benchmark's point: q = 3 (stages 5-7 put off their last 4 W's)."""
  s = sched.build('bpipe_zb', 8, 32)
  program = sched.lower(s)
  assert program.ticks == 107  # zb_h1 103, bpipe 110
  assert program.peak_stash == (5, 5, 5, 5, 4, 5, 5, 4)
  assert program.peaks['cut'] == (1, 1, 1, 1, 1, 4, 4, 4)
  for stage, order in enumerate(s.orders):
    compute = [a for a in order if a.kind in sched.COMPUTE_KINDS]
    last_b = max(i for i, a in enumerate(compute) if a.kind == sched.BACKWARD)
    # Stages 5-7 close the step with the W's of their last 4 B's; every
    # other W runs right behind its B.
    closing = compute[last_b + 1 :]
    assert [a.kind for a in closing] == [sched.WEIGHT] * (4 if stage >= 5 else 1)
    for i, a in enumerate(compute[: last_b + 1]):
      if a.kind == sched.WEIGHT:
        assert compute[i - 1] == sched.Action(sched.BACKWARD, a.microbatch, a.chunk)


@pytest.mark.fast
def test_only_sets_waiting_for_their_backward_move():
  s = sched.build('bpipe_zb', 8, 32)
  tick = {a: t for t, row in enumerate(sched.lower(s).grid) for cell in row for a in cell}
  for j, c in s.evicted:
    assert tick[sched.Action(sched.FORWARD, j, c)] < tick[sched.Action(sched.EVICT, j, c)]
    assert tick[sched.Action(sched.LOAD, j, c)] <= tick[sched.Action(sched.BACKWARD, j, c)]
  # The middle stage of an odd pipeline is its own partner and moves nothing.
  odd = sched.build('bpipe_zb', 5, 20)
  assert odd.partner[2] == 2 and not any(c == 2 for _, c in odd.evicted)


@pytest.mark.fast
def test_time_models_price_the_moves():
  program = lowered('bpipe_zb', 8, 32)
  moving = int((program.table['move_send'] >= 0).any(axis=1).sum())
  free = simulate_lockstep(program, UNIT).total_time
  priced = simulate_lockstep(program, Costs(1, 1, t_weight=1, t_evict=0.25)).total_time
  assert free == program.ticks
  assert priced == pytest.approx(free + 0.25 * moving)
  # The papers' asynchronous model hides the copies on their own stream.
  assert simulate_async(program.source, UNIT).total_time == program.ticks


@pytest.mark.fast
def test_interleaved_zero_bubble_has_nothing_to_balance():
  """Why there is no interleaved bpipe_zb: every stage of interleaved_zb
  peaks alike, and BPipe's planner finds no evictions that take even one
  set off the peak (it fails before it would touch the orders)."""
  for p, m in ((4, 16), (8, 32)):
    s = sched.build('interleaved_zb', p, m, 2)
    peaks = sched.lower(s).peak_stash
    assert len(set(peaks)) == 1
    with pytest.raises(sched.ScheduleDeadlock, match='has room'):
      evict_to_partners(s, 'interleaved_zb', peaks[0] - 1)


@pytest.mark.fast
def test_bad_sizes():
  # Below the least m, BPipe's cap is zb_h1's own min(m, p): nothing would move.
  for p, m, least in ((4, 3, 4), (8, 5, 6), (8, 2, 6), (16, 9, 10)):
    with pytest.raises(ConfigError, match=f'at least {least} micro-batches; got {m}') as e:
      sched.build('bpipe_zb', p, m)
    assert e.value.key == 'pipeline.microbatches'
    assert sched.bpipe_stash_cap(p, least) < least
    assert sched.build('bpipe_zb', p, least).evicted
  with pytest.raises(ConfigError, match='at least 3 pipeline stages') as e:
    sched.build('bpipe_zb', 2, 8)
  assert e.value.key == 'mesh.pipe'
  with pytest.raises(ConfigError, match='one model chunk per stage') as e:
    sched.build('bpipe_zb', 4, 8, 2)
  assert e.value.key == 'pipeline.virtual_stages'


def run_cli(*args):
  env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run(
    [sys.executable, '-m', 'triax', 'schedule', '--schedule=bpipe_zb', '--stages=4', *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )


@pytest.mark.fast
def test_cli(tmp_path):
  r = run_cli('--microbatches=8', '--json')
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert out['valid'] and out['partner'] == [3, 2, 1, 0]
  assert out['peak_inflight'] == [3, 3, 3, 3] and out['ticks'] == 28
  assert out['transfers_per_step']['total'] == out['residual_sets_moved'] > 0
  for args, flag in (
    (['--microbatches=3'], '--microbatches'),
    (['--microbatches=8', f'--write_csv={tmp_path / "s.csv"}'], '--write_csv'),
  ):
    r = run_cli(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f'error: {flag}:'), lines
  assert not (tmp_path / 's.csv').exists()
  r = run_cli('--microbatches=8', f'--write_json={tmp_path / "s.json"}')
  assert r.returncode == 0, r.stderr
  loaded = files.load(str(tmp_path / 's.json'), 4, 8, 1)
  assert loaded.orders == sched.build('bpipe_zb', 4, 8).orders


def test_compiled_temp_against_zb_h1():
  """At p = 8, m = 32 on the schedule benchmark's activation-dominated
  config: the worst device's compiled temp at most 0.65x zb_h1's (5
  residual sets and 4 cuts a device against 8 and 8), as XLA:TPU and
  XLA:GPU lay the steps out (without cpu_dots' CPU-only copies)."""
  import jax

  from triax import config as config_lib
  from triax.compiled.stats import compile_stats

  bench = harness.load_script('bench_schedules')
  temp = {}
  for name in ('zb_h1', 'bpipe_zb'):
    cfg = bench.bench_config(config_lib, 32, name, 1, p=8, data=1, layers=16)
    with harness.cpu_dots(False):
      trainer = harness.make_trainer(cfg)
      with jax.set_mesh(trainer.mesh):
        temp[name] = compile_stats(trainer)[1]['temp_bytes']
  assert temp['bpipe_zb'] <= 0.65 * temp['zb_h1'], temp
