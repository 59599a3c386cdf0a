"""`triax plan --evaluate`: one layout priced, the config's own or --layout's,
against simulate_plan called directly; its bad input one line and exit 2."""

import io
import json
import os

import harness
import pytest

from triax import config
from triax.errors import ConfigError
from triax.layout import Layout
from triax.model import flops as flops_lib
from triax.model import registry
from triax.plan import candidate, evaluate, report
from triax.plan import cluster as cluster_lib
from triax.plan.cost import analytic
from triax.plan.cost import memory as memory_lib
from triax.plan.cost.simulator import simulate_plan
from triax.plan.search import emit

pytestmark = pytest.mark.fast

ROOT = harness.ROOT
H100 = os.path.join(ROOT, 'experiments', 'clusters', 'h100_8x_nvlink.yaml')
MIXED = os.path.join(ROOT, 'experiments', 'clusters', 'a100_v100_mixed.yaml')
# harness.tiny_config's model (8 layers, 8 heads, batch 32) as a config file,
# for the plan files --out writes.
BASE = """from triax import config


def get_config(arg=None):
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.num_heads = 8, 32, 8
  c.model.d_ff, c.model.seq_len = 64, 16
  c.train.global_batch_size = 32
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = 2, 2, 2
  c.pipeline.schedule, c.pipeline.microbatches = 'zb_h1', 4
  return c
"""


@pytest.fixture
def base(tmp_path):
  path = tmp_path / 'base.py'
  path.write_text(BASE)
  return str(path)


def _request(base, cluster=H100, **fields):
  cfg = harness.load_file(base, 'evaluate_base').get_config()
  fields = {'profile': 'analytic', 'evaluate': True, **fields}
  return report.Request(cfg=cfg, config_path=base, config_overrides={}, cluster=cluster, **fields)


def _run(request, as_json=True):
  out = io.StringIO()
  summary = report.run(request, as_json=as_json, out=out)
  return summary, out.getvalue()


def _direct(cfg, plan, cluster=H100, **options):
  """simulate_plan called on `plan` as a user of plan/ would."""
  spec = cluster_lib.load(cluster)
  profile = analytic.build(cfg.model, [plan.tensor])
  return simulate_plan(plan, profile, spec, candidate.Options(**options))


def test_the_configs_own_layout_is_what_simulate_plan_predicts(base):
  summary, printed = _run(_request(base))
  cfg = config.validate(harness.load_file(base, 'evaluate_base').get_config(), 8)
  plan = candidate.from_config(cfg)
  est = _direct(cfg, plan)
  assert json.loads(printed) == json.loads(json.dumps(summary))
  row = summary['plan']
  assert row['plan'] == plan.describe() == 'd2 t2 p2 zb_h1 m=4 v=1 mb=4 remat=none'
  assert (row['lockstep_time_s'], row['async_time_s']) == (est.lockstep_time, est.async_time)
  assert row['bubble_fraction'] == est.bubble_fraction > 0
  assert row['memory_bytes'] == list(est.memory) and row['capacity_bytes'] == list(est.capacity)
  assert summary['fits'] is (not est.oom) is True
  for s, stage in enumerate(summary['stages']):
    assert {k: stage[k] for k in est.memory_parts[s]} == est.memory_parts[s]
    # The parts are the step's peak, and the peak the larger of it and the state programs.
    assert sum(stage[k] for k in memory_lib.STEP_PARTS) == pytest.approx(stage['step'])
    assert stage['peak'] == max(stage['step'], stage['save'], stage['restore'], stage['eval'])
    assert stage['spare'] == est.capacity[s] - est.memory[s]
    assert stage['device_memory'] == pytest.approx(80e9)  # h100_8x_nvlink's 80 GB
  tight = min(est.capacity[s] - est.memory[s] for s in range(2))
  assert summary['spare_bytes'] == tight
  # Throughput and MFU by the family's own FLOPs count and the spec's peak.
  model = registry.build(registry.spec_from_config(cfg.model))
  step = flops_lib.step_flops(model, 32)['model']
  assert summary['model_flops_per_step'] == step
  assert summary['tokens_per_s']['lockstep'] == 32 * 16 / est.lockstep_time
  assert summary['tflops_per_device']['async'] == pytest.approx(step / (est.async_time * 8) / 1e12)
  peak = cluster_lib.load(H100).groups['h100'].peak('float32')
  assert summary['mfu']['lockstep'] == pytest.approx(step / (est.lockstep_time * 8 * peak))


def test_the_text_report_prints_the_same_figures(base):
  summary, text = _run(_request(base), as_json=False)
  row = summary['plan']
  assert "layout: d2 t2 p2 zb_h1 m=4 v=1 mb=4 remat=none  (the config's own)" in text
  assert f'{row["lockstep_time_s"] * 1e3:12.2f}{row["async_time_s"] * 1e3:12.2f}' in text
  assert f'bubble: {evaluate.percent(row["bubble_fraction"])} (lockstep model)' in text
  # A small model's memory in MiB (in GiB its figures would all read 0.00).
  assert 'memory per device, MiB' in text
  stage = summary['stages'][1]
  assert f'    1{stage["params"] / 2**20:9.2f}' in text
  assert f'{stage["peak"] / 2**20:9.2f}{stage["capacity"] / 2**20:9.2f}' in text
  spare = summary['spare_bytes'] / 2**20
  assert f'fits: {spare:.2f} MiB ({summary["spare_fraction"]:.1%}) to spare' in text


def test_a_measured_cluster_has_no_peak_to_give_an_mfu(base):
  """A cluster of this machine's devices (profile: local) states no peak:
  the report says TFLOP/s and leaves MFU out."""
  summary, _ = _run(_request(base))
  plan = candidate.from_config(config.validate(harness.tiny_config(), 8))
  cpu = cluster_lib.load(os.path.join(ROOT, 'experiments', 'clusters', 'cpu_forced_8.yaml'))
  assert evaluate._peak_flops(cpu, plan, 'float32') is None
  summary.update(peak_flops_per_device=None, mfu=None)
  text = evaluate.text(summary, [])
  assert '\nTFLOP/s/dev ' in text and '\nMFU ' not in text


def test_a_layout_prices_the_plan_it_names(base):
  layout = 'd4,t1,p2,1f1b,m8,remat=full,zero1'
  summary, _ = _run(_request(base, layout=layout))
  plan = candidate.Plan(
    layout=Layout(data=4, pipe=2, microbatches=8),
    remat='full',
    layers=(4, 4),
    stages=((0, 1, 2, 3), (4, 5, 6, 7)),
    global_batch=32,
    state_sharding='zero1',
  )
  est = _direct(harness.tiny_config(), plan)
  row = summary['plan']
  assert row['plan'] == plan.describe()
  assert (row['lockstep_time_s'], row['async_time_s']) == (est.lockstep_time, est.async_time)
  assert row['bubble_fraction'] == est.bubble_fraction
  assert row['memory_bytes'] == list(est.memory)
  assert summary['layout'] == {
    'given': layout,
    'config_keys': {
      'mesh.data': 4,
      'mesh.tensor': 1,
      'mesh.pipe': 2,
      'pipeline.schedule': '1f1b',
      'pipeline.microbatches': 8,
      'model.remat': 'full',
      'train.optimizer_sharding': 'data',
      'mesh.fsdp': False,
    },
  }


@pytest.mark.parametrize(
  'described',
  [
    'd8 t1 p1 1f1b m=1 v=1 mb=4 remat=none',
    'd2 t2 sp p2 zb_h1 m=16 v=1 mb=1 remat=dots layers=6/2 fsdp',
    'd1 t2 p4 interleaved_1f1b m=8 v=2 mb=4 remat=full',
    'd4 t1 p2 zb_v m=4 v=2 mb=2 remat=none layers=6/2',
    'd2 c2 t2 sp p1 1f1b m=1 v=1 mb=16 remat=none zero1 ring',
  ],
)
def test_what_the_search_prints_reads_back_as_the_same_plan(described):
  cfg = harness.tiny_config(**{'model.seq_len': 2048, 'mesh.data': -1})
  _, plan, _ = evaluate.configure(cfg, described, 8)
  assert plan.describe() == described


def test_mb_sets_the_microbatches():
  cfg = harness.tiny_config()
  _, plan, keys = evaluate.configure(cfg, 'd2,p4,mb2', 8)
  assert (plan.microbatches, plan.microbatch_size) == (8, 2)
  assert keys['pipeline.microbatches'] == 8


def test_a_placed_plan_reads_back_on_its_devices():
  """mesh.device_order (a plan file for a mixed cluster) places the stages."""
  cfg = harness.tiny_config(**{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2})
  plan = candidate.from_config(config.validate(cfg, 8))
  placed = candidate.Plan(**{**plan.__dict__, 'stages': ((6, 2, 7, 3), (4, 0, 5, 1))})
  emit.apply(cfg, emit.overrides(placed, heterogeneous=True))
  assert candidate.from_config(config.validate(cfg, 8)).stages == placed.stages


def test_a_layout_that_moves_the_stages_drops_the_placement_written_for_them():
  placed = {'mesh.device_order': tuple(range(7, -1, -1)), 'pipeline.layers_per_stage': (6, 2)}
  cfg = harness.tiny_config(**{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2, **placed})
  _, plan, keys = evaluate.configure(cfg, 'd2,t2,p2', 8)  # the config's own degrees
  assert plan.layers == (6, 2) and plan.stages[0] == (7, 5, 3, 1)
  assert keys == {'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2}
  _, plan, keys = evaluate.configure(cfg, 'd1,t2,p4', 8)
  assert plan.layers == (2, 2, 2, 2) and plan.stages == ((0, 1), (2, 3), (4, 5), (6, 7))
  assert keys['mesh.device_order'] == () and keys['pipeline.layers_per_stage'] == ()


def test_a_layout_that_does_not_fit_says_by_how_much_and_exits_3(base, capsys):
  request = _request(base, cluster=MIXED)
  big = {'model.d_model': 2048, 'model.num_heads': 16, 'model.d_ff': 8192, 'model.seq_len': 2048}
  for key, value in big.items():
    config.set_dotted(request.cfg, key, value)
  request = report.Request(**{**request.__dict__, 'layout': 'd8,t1,p1,m1'})
  assert report.main(request) == 3
  text = capsys.readouterr().out
  summary, _ = _run(request)
  assert not summary['fits'] and summary['spare_bytes'] < 0
  over = -summary['spare_bytes'] / 2**30
  assert f'does NOT fit: {over:.2f} GiB ({-summary["spare_fraction"]:.1%}) over' in text
  # The V100s' 16 GB hold less than the A100s' 40: their stage is the tightest.
  v100 = summary['stages'][summary['tightest_stage']]
  assert v100['device_memory'] == pytest.approx(16e9)


def test_out_trace_and_verify_act_on_the_evaluated_layout(base, tmp_path):
  seen = []

  def verify(cfg, estimate):
    seen.append((cfg, estimate))
    return {'line': 'verify: compiled', 'fits': False}

  out, trace = str(tmp_path / 'plan.py'), str(tmp_path / 'trace.json')
  request = _request(base, layout='d2,t1,p4,m8', out=out, trace=trace, verify=verify)
  summary, _ = _run(request)
  ((cfg, estimate),) = seen
  assert (
    estimate.plan.describe() == summary['plan']['plan'] == 'd2 t1 p4 zb_h1 m=8 v=1 mb=2 remat=none'
  )
  assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipe, cfg.pipeline.microbatches) == (2, 1, 4, 8)
  assert summary['verify']['line'] == 'verify: compiled' and report.main(request) == 3
  assert json.loads(open(trace).read())['traceEvents']
  # The plan file is the layout: evaluated again, it predicts the same.
  again, _ = _run(_request(out, layout=None))
  assert again['plan'] == summary['plan']


BAD_LAYOUTS = [
  # (layout, devices, the config key or flag the error names, words of its message)
  ('d3,t1,p1', 8, 'mesh', 'but there are 8 devices'),
  ('d2,t3,p1', 6, 'model.num_heads', 'cannot be split over mesh.tensor=3'),
  ('d2,t1,p3', 6, 'model.num_layers', '8 layers cannot be cut into'),
  ('d2,t1,p4,m3', 8, 'train.global_batch_size', 'must be a multiple of'),
  ('d2,t1,p4,v3', 8, 'pipeline.virtual_stages', 'zb_h1 runs one model chunk'),
  ('d2,t4,x2', 8, '--layout', "'x2' is not a layout token"),
  ('d2,d4', 8, '--layout', 'sets mesh.data a second time'),
  ('d2,t1,p4,mb3', 8, '--layout', 'does not make micro-batches of 3'),
  ('d4,t1,p2,m4,mb4', 8, '--layout', 'disagree'),
  ('d2,t1,p4,layers=2/2/4', 8, '--layout', 'one count per pipeline stage'),
  (' , ', 8, '--layout', 'is empty'),
]


@pytest.mark.parametrize('layout,devices,key,words', BAD_LAYOUTS)
def test_a_bad_layout_is_one_line_naming_its_key(base, capsys, layout, devices, key, words):
  assert report.main(_request(base, layout=layout, gpus=devices)) == 2
  err = capsys.readouterr().err
  (line,) = [l for l in err.splitlines() if l.startswith('error:')]
  assert line.startswith(f'error: {key}: ') and words in line, line
  if key != '--layout':  # the config's own message, and what the layout set
    assert f'(--layout={layout} sets ' in line


def test_the_configs_own_layout_on_another_cluster_size(base):
  with pytest.raises(
    ConfigError, match="^mesh: .*the config's own layout on the cluster's 16 devices"
  ):
    report.run(_request(base, gpus=16))


def test_a_layout_without_evaluate_is_refused(base):
  with pytest.raises(ConfigError, match='^--layout: is read only with --evaluate'):
    report.run(_request(base, evaluate=False, layout='d8'))
