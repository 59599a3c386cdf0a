"""The schedule synthesiser under a memory limit (triax.pipeline.synthesis):
exact against heuristic, against every named schedule, its limits and bad
input, the CLI, files torch accepts, and parity with one device.

Pure Python except the parity test (a compile) and the torch test (torch's
own CSV loader and validator, under the test extra).
"""

import functools
import json

import harness
import pytest

from triax.errors import ConfigError
from triax.pipeline import files, synthesis
from triax.pipeline import schedule as sched
from triax.pipeline.simulate import Costs, simulate_async, simulate_lockstep
from triax.pipeline.validate import validate
from triax.plan.search import synthesized

UNIT = Costs(t_forward=1, t_backward=1, t_weight=1)
UNEVEN = Costs(t_forward=1, t_backward=1.5, t_weight=0.5, t_transfer=0.25)


def held(schedule):
  """Each stage's peak residual sets in the lowered (executor's) program."""
  return sched.lower(schedule).peaks['stash']


# Small enough for HiGHS to prove the optimum in about a second each.
# Limits 2, 3 and p, each once (a set: at p = 2 and 3, p is one of the others).
EXACT_GRID = [
  (p, m, k, costs)
  for p in (2, 3, 4)
  for m in (2, 4)
  for k in sorted({2, 3, p})
  for costs in (UNIT, UNEVEN)
  if k <= p
]


@pytest.mark.parametrize('p, m, k, costs', EXACT_GRID)
def test_heuristic_is_within_2_percent_of_the_exact_optimum(p, m, k, costs):
  exact = synthesis.run(p, m, 1, k, costs, time_limit_s=60, method='milp')
  assert exact.optimal, exact.warning
  heuristic = synthesis.run(p, m, 1, k, costs, method='heuristic')
  assert exact.async_time <= heuristic.async_time + 1e-9
  assert heuristic.async_time <= 1.02 * exact.async_time, (heuristic.async_time, exact.async_time)


@pytest.mark.fast
@pytest.mark.parametrize('p, m', [(2, 4), (4, 8)])
def test_enough_memory_reaches_zero_bubbles_optimum(p, m):
  # With K >= p the least any schedule takes is 3m + p - 1 unit actions
  # (the last stage waits p - 1 for its first input): ZB-H1's, proved.
  found = synthesis.run(p, m, 1, p, UNIT)
  assert found.optimal and found.async_time == 3 * m + p - 1
  assert found.lockstep.total_time == found.async_time  # unit costs: one tick each


# p = 8 with v = 2 is left to test_result_is_valid...: about 20 s per schedule compared.
# The fast tier compares the smallest; v = 2 and p = 8 (seconds each) run in the whole suite.
CASES = [pytest.param(4, 8, 1, marks=pytest.mark.fast), (4, 8, 2), (8, 16, 1)]


@functools.cache
def _synthesized(p, m, v, k, costs):
  """One synthesis per memory limit: the named schedules that hold the same
  peak are all compared with it (1F1B, ZB-H1, BPipe's and others share one)."""
  return synthesis.run(p, m, v, k, costs, time_limit_s=0.2)


@pytest.mark.parametrize('p, m, v', CASES)
@pytest.mark.parametrize('costs', [UNIT, UNEVEN], ids=['unit', 'uneven'])
def test_never_above_a_named_schedule_that_meets_the_limit(p, m, v, costs):
  compared = 0
  for name in sched.SCHEDULES:
    try:
      built = sched.build(name, p, m, v)
    except ConfigError:
      continue
    # BPipe's moves are not in the synthesiser's model; run returns BPipe then.
    split = sched.with_split_backward(built)
    k = max(held(built))
    # The named schedules seed the heuristic, and 'auto' returns one that
    # moves sets where it is faster: the bound holds at any time limit.
    found = _synthesized(p, m, v, k, costs)
    assert max(held(found.schedule)) <= k
    assert found.async_time <= simulate_async(split, costs).total_time + 1e-9, name
    if costs == UNIT:  # every action one tick: the executor's own count
      assert sched.lower(found.schedule).ticks <= sched.lower(built).ticks, name
    compared += 1
  assert compared >= 2


@pytest.mark.parametrize(
  'p, m, v, k',
  [
    pytest.param(4, 8, 1, 2, marks=pytest.mark.fast),
    (4, 8, 2, 3),  # 2-3 s each: the whole suite's
    (8, 16, 2, 6),
    (3, 5, 3, 4),
  ],
)
def test_result_is_valid_within_the_limit_and_says_so(p, m, v, k):
  found = synthesis.run(p, m, v, k, UNEVEN, time_limit_s=2)
  s = found.schedule
  assert (s.stages, s.microbatches, s.virtual_stages, s.stash_cap) == (p, m, v, k)
  assert s.split_backward and s.name == 'synthesized'
  assert validate(s, sched.lower(s)) == []
  assert max(held(s)) <= k
  assert max(simulate_async(s, UNEVEN).peak_inflight) <= k
  # The asynchronous makespan is what was optimised; the lockstep one is measured.
  assert simulate_async(s, UNEVEN).total_time == pytest.approx(found.async_time)
  assert found.lockstep.total_time == simulate_lockstep(sched.lower(s), UNEVEN).total_time
  assert found.lower_bound <= found.async_time + 1e-9


# v = 2 not in the fast tier (2.5 s on jax 0.12).
@pytest.mark.parametrize(
  'v, least',
  [pytest.param(1, 1, marks=pytest.mark.fast), (2, 2), pytest.param(3, 3, marks=pytest.mark.fast)],
)
def test_a_limit_below_the_least_names_it(v, least):
  assert synthesis.least_memory(4, 8, v) == least
  assert max(held(synthesis.synthesize(4, 8, v, least, time_limit_s=1))) == least
  with pytest.raises(ConfigError, match=f'below the least any schedule needs: {least} ') as e:
    synthesis.synthesize(4, 8, v, least - 1)
  assert e.value.key == 'synthesis.memory_limit'


@pytest.mark.fast
@pytest.mark.parametrize(
  'kwargs, key',
  [
    ({'memory_limit': 2.5}, 'synthesis.memory_limit'),
    ({'time_limit_s': 0}, 'synthesis.time_limit_s'),
    ({'method': 'guess'}, 'synthesis.method'),
    ({'costs': Costs(t_forward=0)}, 'synthesis.t_forward'),
    ({'stages': 0}, 'mesh.pipe'),
  ],
)
def test_bad_input_names_the_key(kwargs, key):
  args = {'stages': 4, 'microbatches': 8, 'memory_limit': 4, **kwargs}
  with pytest.raises(ConfigError) as e:
    synthesis.run(**args)
  assert e.value.key == key


@pytest.mark.fast
@pytest.mark.parametrize('p, m, v, k', [(4, 8, 1, 4)])
def test_a_cut_limit_bounds_the_executor_cuts_and_trades_bubble(p, m, v, k):
  """Each cut (B done, W not yet) is a buffer of the executor's beside the
  stash: fewer cuts, the later W's fill less bubble."""
  times = []
  for c in range(1, k + 1):
    found = synthesis.run(p, m, v, k, UNIT, time_limit_s=0.5, cut_limit=c)
    program = sched.lower(found.schedule)
    assert max(program.peaks['cut']) <= c and max(program.peaks['stash']) <= k
    assert validate(found.schedule, program) == [] and found.method == 'heuristic'
    times.append(found.async_time)
  # 1F1B's one cut at one end, a zero-bubble order's at the other.
  assert times[0] > times[-1]
  assert (
    times[0] <= simulate_async(sched.build('1f1b', p, m, v), Costs.design_point(False)).total_time
  )


@pytest.mark.fast
@pytest.mark.parametrize(
  'kwargs, message',
  [
    ({'cut_limit': 0}, 'must be an integer >= 1'),
    ({'cut_limit': 2, 'method': 'milp'}, 'the exact program does not model cuts'),
  ],
)
def test_a_bad_cut_limit_names_the_key(kwargs, message):
  with pytest.raises(ConfigError, match=message) as e:
    synthesis.run(4, 8, 1, 4, UNIT, **kwargs)
  assert e.value.key == 'synthesis.cut_limit'


@pytest.mark.fast
def test_the_time_limit_keeps_the_best_found_and_warns(caplog):
  found = synthesis.run(4, 8, 1, 3, UNIT, time_limit_s=1, method='milp')
  assert not found.optimal
  assert found.warning.startswith('synthesis: the time limit (1 s) stopped the exact program')
  assert found.warning in caplog.text
  assert validate(found.schedule, sched.lower(found.schedule)) == []
  assert found.lower_bound < found.async_time


# Not in the fast tier: a synthesis (2.5 s).
def test_json_round_trip_keeps_the_limit(tmp_path):
  s = synthesis.synthesize(4, 8, 2, 5, UNIT, time_limit_s=1)
  path = str(tmp_path / 'synth.json')
  files.write_json(s, path)
  loaded = files.load(path, 4, 8, 2)
  assert loaded == s and loaded.stash_cap == 5


def test_cli_synthesises_writes_and_reports(tmp_path):
  out_json, out_csv = str(tmp_path / 's.json'), str(tmp_path / 's.csv')
  result = harness.run_cli(
    'triax.cli.schedule',
    '--synthesize',
    '--stages=4',
    '--microbatches=8',
    '--memory_limit=2',
    '--t_transfer=0.25',
    f'--write_json={out_json}',
    f'--write_csv={out_csv}',
    '--json',
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert report['schedule'] == 'synthesized' and report['valid'] is True
  assert max(report['peak_inflight']) <= 2 and report['stash_cap'] == 2
  assert report['synthesis']['memory_limit'] == 2
  assert report['synthesis']['method'] in ('milp', 'heuristic')
  assert report['json'] == out_json and report['csv'] == out_csv
  from_json = files.load(out_json, 4, 8, 1)
  assert from_json.stash_cap == 2
  assert files.load(out_csv, 4, 8, 1).orders == from_json.orders


@pytest.mark.parametrize(
  'args, line',
  [
    (
      ['--synthesize', '--memory_limit=1', '--virtual_stages=2'],
      'error: --memory_limit: 1 is below the least any schedule needs: 2 residual sets per '
      'stage (each stage holds its 2 chunk set(s) of a micro-batch at once)',
    ),
    (['--synthesize'], 'error: --memory_limit: give the most residual sets a stage may hold'),
    (['--memory_limit=3'], 'error: --memory_limit: only --synthesize reads it; add --synthesize'),
    (
      ['--synthesize', '--memory_limit=3', '--schedule=1f1b'],
      'error: --synthesize: give --synthesize or --schedule / --schedule_file, not both',
    ),
    (
      ['--synthesize', '--memory_limit=3', '--memory_limit_mib=64'],
      'error: --memory_limit_mib: give --memory_limit (sets) or --memory_limit_mib, not both',
    ),
    (
      ['--synthesize', '--memory_limit_mib=64'],
      'error: --config: give the experiment config whose model sizes one residual set',
    ),
    (
      ['--synthesize', '--memory_limit_mib=0.01', '--config=experiments/gpt_tiny.py'],
      'error: --memory_limit_mib: 0.01 MiB holds 0 residual set(s) of ',
    ),
  ],
)
def test_cli_bad_input_exits_2_with_one_line(args, line):
  result = harness.run_cli(
    'triax.cli.schedule', '--stages=4', '--microbatches=8', *args, timeout=120
  )
  assert result.returncode == 2 and result.stdout == ''
  assert len(result.stderr.strip().splitlines()) == 1
  assert result.stderr.startswith(line), result.stderr


def _gpt_tiny():
  """experiments/gpt_tiny.py's config."""
  import importlib.util
  import os

  path = os.path.join(harness.ROOT, 'experiments', 'gpt_tiny.py')
  spec = importlib.util.spec_from_file_location('gpt_tiny', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.fast
def test_a_limit_in_bytes_counts_the_planners_sets():
  """One set is one micro-batch of one chunk as the planner's memory model
  prices a stash slot: it scales with the micro-batch and the chunk."""
  cfg = _gpt_tiny()  # data 2, batch 32, 4 layers
  _, per_set = synthesized.sets_within(cfg, 2, 8, 1, 1e9)
  assert synthesized.sets_within(cfg, 2, 16, 1, 1e9)[1] == pytest.approx(per_set / 2)
  assert synthesized.sets_within(cfg, 2, 8, 2, 1e9)[1] < per_set  # half the layers a chunk
  assert synthesized.sets_within(cfg, 2, 8, 1, 3 * per_set)[0] == 3
  assert synthesized.sets_within(cfg, 2, 8, 1, 3 * per_set - 1)[0] == 2
  cfg.mesh.data = -1
  with pytest.raises(ConfigError, match='give the data degree') as e:
    synthesized.sets_within(cfg, 2, 8, 1, 1e9)
  assert e.value.key == '--config'


def test_cli_memory_limit_mib_synthesises_under_the_sets_it_holds():
  cfg = _gpt_tiny()
  k, _ = synthesized.sets_within(cfg, 4, 8, 1, 10 * 2**20)
  result = harness.run_cli(
    'triax.cli.schedule',
    '--synthesize',
    '--stages=4',
    '--microbatches=8',
    '--memory_limit_mib=10',
    '--config=experiments/gpt_tiny.py',
    '--time_limit_s=1',
    '--json',
    timeout=300,
  )
  assert result.returncode == 0, result.stderr
  assert f'10 MiB holds {k} residual sets' in result.stderr
  report = json.loads(result.stdout)
  assert report['stash_cap'] == k and max(report['peak_inflight']) <= k


@pytest.mark.parametrize('p, m, v, k', [(4, 8, 1, 3), (4, 8, 2, 5), (8, 16, 2, 8)])
def test_torch_loads_and_validates_the_csv(p, m, v, k, tmp_path):
  """torch.distributed.pipelining's own loader: its order validator
  (`_validate_and_set_stage_mapping`) and its lowering with send/recv
  (`_add_send_recv`, which fails on an order that cannot progress)."""
  pytest.importorskip('torch')
  from torch.distributed.pipelining import schedules

  sizes_only = harness.load_script('torch_schedule_csv')._SizesOnlyStage
  # The heuristic alone: the exact program would run to its time limit and
  # only reorder what torch reads the same way.
  s = synthesis.synthesize(p, m, v, k, UNIT, time_limit_s=2, method='heuristic')
  path = str(tmp_path / 'synth.csv')
  files.write_csv(s, path)
  runtime = schedules._PipelineScheduleRuntime([sizes_only(p * v, p) for _ in range(v)], m)
  runtime._load_csv(path, 'compute_only')
  assert runtime.stage_index_to_group_rank == dict(enumerate(s.placement))
  for rank, order in enumerate(s.orders):
    loaded = [str(a) for a in runtime.pipeline_order[rank] if a is not None]
    letter = {'F': 'F', 'B': 'I', 'W': 'W'}
    assert loaded == [f'{a.chunk}{letter[a.kind]}{a.microbatch}' for a in order]
    kinds = {a.computation_type.name for a in runtime.pipeline_order_with_comms[rank]}
    assert {'SEND_F', 'RECV_F', 'SEND_B', 'RECV_B'} & kinds or p == 1


_PARITY_BASE = {'model.num_layers': 8, 'train.global_batch_size': 32}


@functools.cache
def _one_device():
  """The parity tests' reference: one model, one batch, so one run serves both."""
  return harness.loss_and_grads(harness.tiny_config(**_PARITY_BASE, **{'mesh.data': 1}))


@pytest.mark.parametrize('v, k', [(1, 3), (2, 5)])
def test_a_synthesised_schedule_matches_one_device(v, k, tmp_path):
  """Loss and gradients at (data, tensor, pipe) = (1, 1, 4) against one
  device, fp32, through pipeline.schedule_file."""
  path = str(tmp_path / 'synth.json')
  # The heuristic's orders (the exact program's differ only by where its
  # time limit stopped it): the executor runs any valid order alike.
  schedule = synthesis.synthesize(4, 8, v, k, UNIT, time_limit_s=2, method='heuristic')
  files.write_json(schedule, path)
  ref_loss, ref_grads = _one_device()
  cfg = harness.tiny_config(
    **_PARITY_BASE,
    **{
      'mesh.data': 1,
      'mesh.tensor': 1,
      'mesh.pipe': 4,
      'pipeline.microbatches': 8,
      'pipeline.virtual_stages': v,
      'pipeline.schedule_file': path,
    },
  )
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.fast
def test_a_named_schedule_that_moves_sets_is_returned_where_it_is_faster():
  """At 3 sets a stage (p = 4, m = 16) BPipe-ZB's moves make 52 time units
  where the synthesiser's best without moves takes more: BPipe-ZB is returned."""
  found = synthesis.run(4, 16, 1, 3, UNIT, time_limit_s=1)
  assert found.method == 'built-in' and found.schedule.name == 'bpipe_zb'
  assert found.async_time == 52 and found.beaten >= 1.1 * 52
  assert max(held(found.schedule)) <= 3 and found.schedule.evicted
  assert validate(found.schedule, sched.lower(found.schedule)) == []
