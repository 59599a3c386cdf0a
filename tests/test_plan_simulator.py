"""The planner's simulator: analytic cases, communication, memory, traces.

Plain Python over synthetic profiles: nothing here compiles.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from triax.layout import Layout
from triax.pipeline import schedule as sched
from triax.pipeline import simulate
from triax.plan import candidate
from triax.plan import cluster as cluster_lib
from triax.plan.cost import profile, profiler, simulator, trace
from triax.plan.cost.simulator import Options, Plan, simulate_plan

FAST = '1e30'  # bytes/s: communication that takes no time
SRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'src')


def make_cluster(
  groups=(('gpu', 8, 1.0, '80 GB'),), nodes=None, bandwidth=FAST, latency='0 s', shared_cores=None
):
  """A spec whose group g computes `speed` FLOP/s (profile 'FLOPs' = seconds)."""
  raw = {
    'name': 'test',
    'groups': [],
    'nodes': [],
    'links': {
      'intra_node': {'bandwidth': bandwidth, 'latency': latency},
      'inter_node': {'bandwidth': bandwidth, 'latency': latency},
    },
  }
  for name, count, speed, memory in groups:
    raw['groups'].append(
      {
        'name': name,
        'type': name,
        'count': count,
        'peak_flops': {'bfloat16': speed, 'float32': speed},
        'memory': memory,
        'memory_bandwidth': FAST,
      }
    )
  if nodes is None:
    node = {'name': 'n0', 'devices': {g[0]: g[1] for g in groups}}
    if shared_cores:
      node['shared_cores'] = shared_cores
    nodes = [node]
  raw['nodes'] = nodes
  return cluster_lib.parse(raw, 'test.yaml')


def make_plan(p=4, m=8, d=1, t=1, v=1, name='1f1b', layers=None, remat='none', order=None):
  n = d * t * p
  order = order or list(range(n))
  size = d * t
  stages = tuple(tuple(order[s * size : (s + 1) * size]) for s in range(p))
  return Plan(
    layout=Layout(data=d, tensor=t, pipe=p, schedule=name, microbatches=m, virtual_stages=v),
    remat=remat,
    layers=layers or (v,) * p,
    stages=stages,
    global_batch=m * d,
  )


@pytest.mark.parametrize('p, m', [(2, 2), (4, 8), (4, 3), (8, 16)])
def test_1f1b_analytic_step(p, m):
  # Uniform stages, zero communication. Lockstep: the fused backward (2 s)
  # runs as B then W of 1 s each, one action a tick, 3m + 2(p-1) ticks.
  # Asynchronous (the papers'): (m + p - 1)(t_F + t_B).
  prof = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0)
  est = simulate_plan(make_plan(p=p, m=m), prof, make_cluster(groups=(('gpu', p, 1.0, '80 GB'),)))
  assert est.step_time == est.lockstep_time == pytest.approx(3 * m + 2 * (p - 1))
  assert est.async_time == pytest.approx((m + p - 1) * 3.0)
  assert est.bubble_fraction == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)))
  assert est.result.ticks == 3 * m + 2 * (p - 1)


@pytest.mark.parametrize(
  'name, p, m, v',
  [
    ('gpipe', 4, 8, 1),
    ('1f1b', 4, 8, 1),
    ('interleaved_1f1b', 4, 8, 2),
    ('zb_h1', 4, 8, 1),
    ('gpipe', 2, 4, 2),
  ],
)
def test_lockstep_agrees_with_the_pipeline_simulator(name, p, m, v):
  """Without core sharing, the planner's costs and simulate.Costs time the
  same program alike: both run the one lockstep model."""
  prog = sched.lower(sched.build(name, p, m, v))
  fused = not prog.source.split_backward
  per = [
    simulate.Costs(
      t_forward=1.0 + s, t_backward=2.0 + s, t_weight=0.0 if fused else 1.0 + s, t_transfer=0.1 * s
    )
    for s in range(p)
  ]
  chunk = tuple(
    {k: per[prog.schedule.stage_of(c)].lockstep(k, v, fused) for k in 'FBW'} for c in range(p * v)
  )
  ours = simulator.simulate_lockstep(
    prog,
    simulator.ActionCosts(
      chunk=chunk, transfer=tuple(c.t_transfer for c in per), evict=(0.0,) * p, tick_transfer=0.0
    ),
  )
  theirs = simulate.simulate_lockstep(prog, per)
  assert ours.total_time == pytest.approx(theirs.total_time)
  assert ours.busy == pytest.approx(theirs.busy)


def test_cli_and_planner_agree_on_the_lockstep_time():
  """One lockstep model: the schedule CLI (simulate.Costs) and the planner
  (ActionCosts) time 1f1b p=4 m=8 alike given the same per-action costs:
  F = 1, the fused backward 2 run as B = W = 1, and 0.1 per message. 28 of
  the 30 ticks send one (the last two run only chunk 0's B and W's)."""
  out = subprocess.run(
    [
      sys.executable,
      '-m',
      'triax.cli.schedule',
      '--schedule=1f1b',
      '--stages=4',
      '--microbatches=8',
      '--t_forward=1',
      '--t_backward=2',
      '--t_weight=1',
      '--t_transfer=0.1',
      '--json',
    ],
    env=dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get('PYTHONPATH', '')),
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert out.returncode == 0, out.stderr
  cli = json.loads(out.stdout)['models']['lockstep']['total_time']
  p = 4
  costs = simulator.ActionCosts(
    chunk=({sched.FORWARD: 1.0, sched.BACKWARD: 1.0, sched.WEIGHT: 1.0},) * p,
    transfer=(0.1,) * p,
    evict=(0.0,) * p,
    tick_transfer=0.0,
  )
  planner = simulator.simulate_lockstep(candidate.program('1f1b', p, 8, 1), costs)
  assert planner.ticks == 30
  assert cli == pytest.approx(planner.total_time) == pytest.approx(30 + 28 * 0.1)


def test_placement_sets_the_chunk_layers():
  assert make_plan(p=2, v=2, m=4, layers=(4, 2), name='interleaved_1f1b').chunk_layers == (
    2,
    1,
    2,
    1,
  )
  if 'zb_v' in sched.SCHEDULES:
    # A V: chunks 0 and 3 on stage 0, 1 and 2 on stage 1.
    plan = make_plan(p=2, v=2, m=4, layers=(4, 2), name='zb_v')
    assert plan.placement == (0, 1, 1, 0)
    assert plan.chunk_layers == (2, 1, 1, 2)


def test_heterogeneous_stages_the_slow_one_dominates():
  prof = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0)
  spec = make_cluster(groups=(('fast', 1, 1.0, '80 GB'), ('slow', 1, 0.5, '80 GB')))
  p, m = 2, 8
  est = simulate_plan(make_plan(p=p, m=m), prof, spec)
  # The slow stage is busy 6 s per micro-batch (F, B, W of 2 s each, one a
  # tick), plus the first and last ticks, where only the fast one works.
  assert est.step_time == pytest.approx(m * 6.0 + 2 * 1.0)
  uniform_slow = simulate_plan(
    make_plan(p=p, m=m), prof, make_cluster(groups=(('slow', 2, 0.5, '80 GB'),))
  )
  uniform_fast = simulate_plan(
    make_plan(p=p, m=m), prof, make_cluster(groups=(('fast', 2, 1.0, '80 GB'),))
  )
  assert uniform_fast.step_time < est.step_time < uniform_slow.step_time
  # Giving the fast stage a second layer balances it: 2 layers at 3 s vs 1
  # at 6 s, so every tick lasts 2 s (the papers': (m + 1) 6 s).
  balanced = simulate_plan(make_plan(p=p, m=m, layers=(2, 1)), prof, spec)
  assert balanced.step_time == pytest.approx((3 * m + 2 * (p - 1)) * 2.0)
  assert balanced.async_time == pytest.approx((m + 1) * 6.0)


def test_data_parallel_allreduce_adds_latency_plus_bytes_over_bandwidth():
  nbytes, bandwidth, latency = 1e9, 1e10, 1e-3
  prof = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0, layer_param_bytes=nbytes, num_layers=1)
  alone = make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),))
  linked = make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),), bandwidth=bandwidth, latency=latency)
  plan = make_plan(p=1, m=1, d=2, layers=(1,))
  for mode in ('per_step', 'per_microbatch'):
    opts = Options(dp_allreduce=mode)
    a = simulate_plan(plan, prof, alone, opts)
    b = simulate_plan(plan, prof, linked, opts)
    # Ring over 2 devices: 2 steps of latency and nbytes / 2 each way.
    assert b.step_time - a.step_time == pytest.approx(2 * latency + nbytes / bandwidth)
    assert b.dp_allreduce_time == pytest.approx(2 * latency + nbytes / bandwidth)


def test_pipeline_transfers_cost_every_tick():
  prof = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0, act_per_seq=1e6)
  linked = make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),), bandwidth=1e9, latency=1e-3)
  plan = make_plan(p=4, m=8)
  base = simulate_plan(plan, prof, make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),)))
  est = simulate_plan(plan, prof, linked)
  ticks = sched.lower(sched.build('1f1b', 4, 8)).ticks
  # The executor ppermutes both ways in every tick, idle or not.
  assert est.step_time - base.step_time == pytest.approx(ticks * 2 * (1e-3 + 1e6 / 1e9))
  # At p = 2 both neighbours are the one other stage: one ppermute a tick.
  pair = make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),), bandwidth=1e9, latency=1e-3)
  alone = simulate_plan(make_plan(p=2, m=4), prof, make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),)))
  est = simulate_plan(make_plan(p=2, m=4), prof, pair)
  ticks = sched.lower(sched.build('1f1b', 2, 4)).ticks
  assert est.step_time - alone.step_time == pytest.approx(ticks * (1e-3 + 1e6 / 1e9))


def test_shared_cores_bound_concurrent_compute():
  prof = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0, num_layers=1)
  plan = make_plan(p=1, m=1, d=8, layers=(1,))
  free = simulate_plan(plan, prof, make_cluster())
  shared = simulate_plan(plan, prof, make_cluster(shared_cores=2))
  assert free.step_time == pytest.approx(3.0)
  # 8 devices busy for 3 s each on 2 cores.
  assert shared.step_time == pytest.approx(8 * 3.0 / 2)


def _local_cluster(count: int, shared_cores=None):
  node = {'name': 'host', 'devices': {'cpu': count}}
  if shared_cores:
    node['shared_cores'] = shared_cores
  raw = {
    'name': 'local',
    'groups': [
      {
        'name': 'cpu',
        'type': 'cpu',
        'count': count,
        'profile': 'local',
        'peak_flops': {'bfloat16': 'measured', 'float32': 'measured'},
        'memory': '80 GB',
        'memory_bandwidth': 'measured',
      }
    ],
    'nodes': [node],
    'links': {
      'intra_node': {'bandwidth': FAST, 'latency': '0 s'},
      'inter_node': {'bandwidth': FAST, 'latency': '0 s'},
    },
  }
  return cluster_lib.parse(raw, 'local.yaml')


def test_measured_sharing_is_per_function_and_remat_is_measured():
  """On this machine's local group, a tick on a shared node costs what the
  profiler measured with every device running the function at once, and a
  measured remat policy replaces the on-paper recompute."""
  import dataclasses

  base = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0, num_layers=1)
  machine = dataclasses.replace(base.machine, num_devices=8)
  fits = dict(base.fits)
  fits['layer_fwd/full'] = fits['layer_bwd/full'] = profile.Fit(0.0, 1.0)
  # Alone: fwd 1 s, bwd 2 s. All 8 at once: fwd 4 s (2 devices' worth run
  # together), bwd 16 s (1 device's worth). Full remat, measured: fwd 0.5 s,
  # bwd 1 s alone, 2 s and 4 s together (cheaper than on paper here).
  points = tuple(
    profile.Point(
      function=f, microbatch=1, tensor=1, seconds=solo, fitted=solo, flops=solo, concurrent=together
    )
    for f, solo, together in (
      ('layer_fwd', 1.0, 4.0),
      ('layer_bwd', 2.0, 16.0),
      ('layer_fwd/full', 0.5, 2.0),
      ('layer_bwd/full', 1.0, 4.0),
    )
  )
  prof = dataclasses.replace(base, machine=machine, fits=fits, points=points)
  local = _local_cluster(8, shared_cores=2)
  plain = simulate_plan(make_plan(p=1, m=1, d=8, layers=(1,)), prof, local)
  # 8 devices each take 4/8 + 16/8 s of the node.
  assert plain.step_time == pytest.approx(8 * (4.0 + 16.0) / 8)
  full = simulate_plan(make_plan(p=1, m=1, d=8, layers=(1,), remat='full'), prof, local)
  assert full.step_time == pytest.approx(8 * (2.0 + 4.0) / 8)
  # A policy not measured is priced on paper: the forward again in the backward.
  for remat in ('attention', 'dots'):
    recompute = simulate_plan(make_plan(p=1, m=1, d=8, layers=(1,), remat=remat), prof, local)
    assert recompute.step_time == pytest.approx(plain.step_time)  # attention_fraction = 0


def test_memory_and_oom_flag():
  prof = profile.synthetic(layer_param_bytes=1e9, stash_per_seq=1e8)
  plan = make_plan(p=4, m=8)
  big = simulate_plan(plan, prof, make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),)))
  small = simulate_plan(plan, prof, make_cluster(groups=(('gpu', 4, 1.0, '4 GB'),)))
  assert not big.oom and small.oom
  # Parameters, gradients and Adam moments: 4 copies of 1 GB, plus stash
  # and cut slots (a cut: the unrematerialised stash set as the weight
  # matmuls' inputs, and their output cotangents: the synthetic stash is all
  # tensor-split, so as much again).
  slots = sched.lower(sched.build('1f1b', 4, 8)).slots
  assert (slots['stash'], slots['cut']) == (4, 1)
  assert big.step_memory[0] == pytest.approx(4e9 + (4 + 2) * 1e8 + 2e8)
  # An evaluation beside the resident state (parameters and moments, 3 GB)
  # holds the layers resharded over pipe (1 GB), one layer gathered (1 GB)
  # and one row's forward (the step's micro-batch: 0.1 GB): with one layer a
  # stage, the run's peak here, not the step's.
  assert big.state_memory[0] == pytest.approx(3e9 + 2e9 + 1e8)
  assert big.memory[0] == max(big.step_memory[0], big.state_memory[0])
  assert small.capacity[0] == pytest.approx(0.9 * 4e9)
  # Full remat stashes (here: the same synthetic bytes) but recomputes the
  # forward, in B: F 1 s, B 1 + 1 s, W 1 s (the papers': (m + p - 1) 4 s).
  full = simulate_plan(
    make_plan(p=4, m=8, remat='full'), prof, make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),))
  )
  spans = {(x.stage, str(x.action)): x.end - x.start for x in full.result.timeline}
  assert (spans[(0, 'F0.0')], spans[(0, 'B0.0')], spans[(0, 'W0.0')]) == (1, 2, 1)
  assert full.async_time == pytest.approx((8 + 3) * 4.0)


def test_chrome_trace_is_perfetto_json():
  prof = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0)
  est = simulate_plan(make_plan(p=2, m=4), prof, make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),)))
  events = json.loads(json.dumps(trace.chrome_trace(est)))
  spans = [e for e in events['traceEvents'] if e['ph'] == 'X']
  assert len([e for e in spans if e['cat'] in 'FB']) == 2 * 4 * 2
  assert events['otherData']['step_time_s'] == pytest.approx(est.step_time)
  assert max(e['ts'] + e['dur'] for e in spans) == pytest.approx(est.step_time * 1e6)


def test_plan_checks_itself():
  with pytest.raises(ValueError, match='multiple of v'):
    make_plan(p=2, v=2, layers=(3, 1))
  with pytest.raises(ValueError, match='global batch'):
    Plan(
      layout=Layout(data=2, microbatches=3),
      remat='none',
      layers=(4,),
      stages=((0, 1),),
      global_batch=8,
    )
  plan = make_plan(p=2, v=2, layers=(4, 2), m=4, name='interleaved_1f1b')
  assert plan.chunk_layers == (2, 1, 2, 1)
  assert not plan.even and math.isclose(plan.microbatch_size, 1)


def test_profile_measures_every_size_at_the_smallest_degree():
  """Every micro-batch size the search considers is measured at the smallest
  tensor degree (log-spaced beyond _MAX_SIZES); other degrees at the ends."""
  points = profiler._points_to_measure([1, 2, 4], [1, 2, 4, 8, 16], seq_len=128)
  layer = {(b, t) for f, b, t in points if f == 'layer_fwd'}
  assert layer == {(b, 1) for b in (1, 2, 4, 8, 16)} | {(b, t) for b in (1, 16) for t in (2, 4)}
  many = profiler._points_to_measure([1], list(range(1, 17)), seq_len=128)
  sizes = sorted(b for f, b, t in many if f == 'layer_fwd')
  assert len(sizes) <= profiler._MAX_SIZES and sizes[0] == 1 and sizes[-1] == 16


def test_a_degree_measured_at_its_ends_borrows_the_smallest_degrees_curve():
  """t=2 measured at b=1 and 4 only; t=1 at 1, 2, 4 with a kink at b=2. The
  t=2 time at b=2 follows t=1's kink, scaled by t=2's own ratio to t=1."""
  import dataclasses

  base = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0, num_layers=1, tensors=(1, 2))
  rows = [
    ('layer_fwd', 1, 1, 1.0),
    ('layer_fwd', 2, 1, 3.0),
    ('layer_fwd', 4, 1, 4.0),
    ('layer_fwd', 1, 2, 0.5),
    ('layer_fwd', 4, 2, 3.0),
  ]
  points = tuple(
    profile.Point(function=f, microbatch=b, tensor=t, seconds=s, fitted=s, flops=s, concurrent=0.0)
    for f, b, t, s in rows
  )
  prof = dataclasses.replace(base, points=points)
  assert prof.local_seconds('layer_fwd', 2, 1) == pytest.approx(3.0)
  assert prof.local_seconds('layer_fwd', 3, 1) == pytest.approx(3.5)  # between its neighbours
  # Ratio to t=1: 0.5 at b=1, 0.75 at b=4 -> 0.5 + 0.25/3 at b=2.
  assert prof.local_seconds('layer_fwd', 2, 2) == pytest.approx((0.5 + 0.25 / 3) * 3.0)
  assert prof.local_seconds('layer_fwd', 4, 2) == pytest.approx(3.0)


def test_a_layer_costs_what_it_costs_in_a_chunk_of_its_length():
  """On this machine a layer's time depends on the chunk it runs in (XLA:CPU
  runs a 1-layer chunk without a loop), measured as the profile's stackN
  ratios to its 2-layer chunk; B and W are the executor's measured halves.
  An uneven split runs the padded stack, and without the executor the
  whole model is one stack whose backward runs fused."""
  import dataclasses

  base = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0, num_layers=8)
  ratios = {
    'stack1_fwd': (0.5, 0.5),
    'stack1_bwd': (0.25, 0.25),
    'stack4_fwd': (2.0, 2.0),
    'stack4_bwd': (3.0, 3.0),
    'split_b': (0.3, 0.3),
    'split_w': (0.4, 0.4),
    'split_b/full': (0.6, 0.6),
    'split_w/full': (0.2, 0.2),
  }
  prof = dataclasses.replace(base, ratios=ratios)
  local = _local_cluster(8)

  def costs(**kw):
    return simulator.action_costs(make_plan(**kw), prof, local).chunk

  one = costs(p=8, m=8, layers=(1,) * 8)[3]
  assert (one['F'], one['B'], one['W']) == pytest.approx((0.5, 2 * 0.25 * 0.3, 2 * 0.25 * 0.4))
  two = costs(p=4, m=8, layers=(2,) * 4)[1]
  assert (two['F'], two['B'], two['W']) == pytest.approx((2.0, 4 * 0.3, 4 * 0.4))
  four = costs(p=2, m=4, layers=(4, 4))[0]
  assert (four['F'], four['B']) == pytest.approx((4 * 2.0, 4 * 2 * 3.0 * 0.3))
  # Uneven 3/3/2: every chunk runs a 3-layer stack (halfway from 2 to 4 layers).
  short = costs(p=3, m=3, layers=(3, 3, 2))[2]
  assert short['F'] == pytest.approx(2 * 1.5)
  # One value_and_grad over 8 layers: a 4+-layer stack, the backward fused.
  whole = costs(p=1, m=1, d=8, layers=(8,))[0]
  assert (whole['F'], whole['B'], whole['W']) == pytest.approx((8 * 2.0, 8 * 2 * 3.0, 0.0))
  # A policy's own split where it was measured: full remat's B reruns the
  # forward (1 s a layer, on paper here) and splits the rest 0.6 / 0.2.
  full = costs(p=4, m=8, layers=(2,) * 4, remat='full')[1]
  assert (full['B'], full['W']) == pytest.approx((2 * 2.0 * 0.6 + 2 * 1.0, 2 * 2.0 * 0.2))
  # Elsewhere (not this machine's group) no ratio applies: halves of a backward.
  gpu = simulator.action_costs(make_plan(p=8, m=8, layers=(1,) * 8), prof, make_cluster()).chunk[0]
  assert (gpu['F'], gpu['B'], gpu['W']) == pytest.approx((1.0, 1.0, 1.0))
