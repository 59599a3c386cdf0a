"""V-Min, V-Half and V-ZB (controllable-memory V-schedules): memory against
the paper's figures, validity, bubbles, bad input and the CLI.

Pure Python: nothing here imports JAX.
"""

import json
import os
import subprocess
import sys

import pytest

from triax.errors import ConfigError
from triax.pipeline import report
from triax.pipeline import schedule as sched
from triax.pipeline.ir import v_placement
from triax.pipeline.schedules import v_family
from triax.pipeline.simulate import Costs, simulate_lockstep
from triax.pipeline.validate import validate

pytestmark = pytest.mark.fast

SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'src')
NAMES = ('v_min', 'v_half', 'v_zb')
BLOCKS = {'v_min': v_family.V_MIN, 'v_half': v_family.V_HALF, 'v_zb': v_family.V_ZB}
# The paper's peak activation memory in micro-batches of a whole stage.
PAPER_MICROBATCHES = {
  'v_min': lambda p: (p + 4) // 3,
  'v_half': lambda p: (p + 2) // 2,
  'v_zb': lambda p: p,
}
PM = [(p, m) for p in (4, 8, 16) for m in (2 * p, 4 * p)]
UNIT = Costs(t_forward=1, t_backward=1, t_weight=1)


def peak_inflight(name, p, m):
  """What `triax schedule --json` reports as peak_inflight (chunk sets)."""
  request = report.Request(schedule=name, stages=p, microbatches=m, virtual_stages=2)
  return report.summary(report.analyse(request))['peak_inflight']


@pytest.mark.parametrize('p, m', PM)
@pytest.mark.parametrize('name', NAMES)
def test_peak_memory_is_the_papers(name, p, m):
  # Two chunk residual sets make one micro-batch of a stage's activations.
  want = 2 * PAPER_MICROBATCHES[name](p)
  peaks = peak_inflight(name, p, m)
  assert max(peaks) == want, peaks
  assert len(peaks) == p


@pytest.mark.parametrize('p, m', PM)
def test_memory_against_1f1b(p, m):
  one = 2 * max(sched.lower(sched.build('1f1b', p, m)).peaks['stash'])  # chunk sets
  v_min, v_half, v_zb = (max(peak_inflight(n, p, m)) for n in NAMES)
  assert v_zb == one
  assert v_half <= one // 2 + 2
  assert v_min <= one // 3 + 3
  assert v_min <= v_half <= v_zb


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('p', [1, 2, 3, 4, 5, 6, 8, 12, 16])
def test_valid_after_lowering(name, p):
  least = BLOCKS[name].min_microbatches(p)
  for m in {least, least + 1, 2 * p, 4 * p} - {0}:
    if m < least:
      continue
    s = sched.build(name, p, m, 2)
    assert s.placement == v_placement(p)
    assert s.split_backward
    assert validate(s, sched.lower(s)) == []


@pytest.mark.parametrize('p, m', PM)
def test_v_zb_bubble_is_at_most_zb_v(p, m):
  def bubble(name):
    return simulate_lockstep(sched.lower(sched.build(name, p, m, 2)), UNIT).bubble_fraction

  v_min, v_half, v_zb, zb_v = map(bubble, NAMES + ('zb_v',))
  assert v_zb <= zb_v + 1e-12
  # Less memory costs bubble, in the paper's order.
  assert v_zb < v_half < v_min
  # V-ZB's step is the least any schedule takes: 6m actions per stage and
  # the p-1 units the last stage waits for its first input.
  assert sched.lower(sched.build('v_zb', p, m, 2)).ticks == 6 * m + p - 1


@pytest.mark.parametrize('name', NAMES)
def test_block_repeats_every_interval(name):
  """Stage d runs micro-batch j+1's block exactly one interval after j's in
  the steady phase: the schedule is the block repeated."""
  p, m = 4, 24
  program = sched.lower(sched.build(name, p, m, 2))
  tick = {a: t for t, row in enumerate(program.grid) for cell in row for a in cell}
  for d in range(p):
    for kind in 'FB':
      for c in (d, 2 * p - 1 - d):
        j = m // 2
        now, later = tick[sched.Action(kind, j, c)], tick[sched.Action(kind, j + 1, c)]
        assert later - now == v_family.INTERVAL


@pytest.mark.parametrize('name', NAMES)
def test_default_and_wrong_virtual_stages(name):
  assert sched.SCHEDULES[name](4, 16).virtual_stages == 2
  for v in (1, 3):
    with pytest.raises(ConfigError, match='exactly 2 model chunks') as e:
      sched.build(name, 4, 16, v)
    assert e.value.key == 'pipeline.virtual_stages'


@pytest.mark.parametrize('name', NAMES)
def test_too_few_microbatches_names_the_minimum(name):
  least = BLOCKS[name].min_microbatches(4)
  assert least > 1
  with pytest.raises(ConfigError, match=f'at least {least} micro-batches') as e:
    sched.build(name, 4, least - 1, 2)
  assert e.value.key == 'pipeline.microbatches'
  sched.build(name, 4, least, 2)


def run_cli(*args):
  env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run(
    [sys.executable, '-m', 'triax', 'schedule', *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )


def test_cli_rejects_too_few_microbatches():
  r = run_cli('--schedule=v_min', '--stages=4', '--microbatches=1')
  assert r.returncode == 2
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: --microbatches:'), r.stderr
  assert 'at least 3' in lines[0]


def test_cli_json_grid_and_plot(tmp_path):
  r = run_cli('--schedule=v_half', '--stages=4', '--microbatches=16', '--json')
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert out['valid'] and out['virtual_stages'] == 2
  assert out['placement'] == list(v_placement(4))
  assert out['peak_inflight'] == [6, 6, 6, 6]
  r = run_cli('--schedule=v_zb', '--stages=4', '--microbatches=8')
  assert r.returncode == 0, r.stderr
  assert 'F0.0' in r.stdout and 'B0.7' in r.stdout  # the grid
  png = tmp_path / 'v.png'
  r = run_cli('--schedule=v_min', '--stages=4', '--microbatches=8', f'--plot={png}')
  assert r.returncode == 0, r.stderr
  assert 'valid' in r.stdout and png.stat().st_size > 0


@pytest.mark.parametrize('name', NAMES)
def test_blocks_fit_the_interval_and_balance_memory(name):
  block = BLOCKS[name]
  # Equal lifespans on every stage (see VBlock).
  assert block.f_down + block.b_down == block.f_up + block.b_up
  for p in range(1, 33):
    lifespans = set()
    for d in range(p):
      t = block.times(p, d)
      assert len({x % v_family.INTERVAL for x in t.values()}) == 4, (p, d, t)
      lifespans.add(t['Ba'] - t['Fa'] + t['Bb'] - t['Fb'])
    assert len(lifespans) == 1, (p, lifespans)
