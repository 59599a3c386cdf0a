"""Compiling for GPUs that are not here: `triax train --compile_only --topology=h100:8`.

XLA's GPU compiler runs on this CPU host from a description of the GPU
(topology.GpuKind.target_config), through jax's CUDA PJRT plugin, which
scripts/env.sh puts in .venv/xla-cuda/ for the test extra (outside
site-packages: installed, JAX would load it at every start-up). Its memory
figures are deterministic, so they may be asserted.
"""

import glob
import json
import os
import sys

import harness
import pytest

from triax import topology
from triax.compiled import hlo_schedule
from triax.errors import ConfigError

GiB = 2**30
SMOKE = 'experiments/llama_1b.py:smoke,attention=xla'
# The smoke config's batch over h100:8's devices.
EIGHT_REPLICAS = ('--config.mesh.data=8', '--config.train.global_batch_size=8')
PLUGIN = os.path.join(sys.prefix, 'xla-cuda', 'jax_plugins', 'xla_cuda12', 'xla_cuda_plugin.so')


@pytest.mark.fast
def test_gpu_topology_names():
  node = topology.parse('h100:8')
  assert (node.shape, node.chips, node.compiler) == ((1, 8), 8, 'XLA:GPU')
  assert node.kind.device_kind == 'NVIDIA H100 80GB HBM3'
  assert node.hbm_bytes == 81559 * 2**20
  assert topology.parse('a100:4x8').chips == 32
  assert topology.parse('v5p:2x2x1').compiler == 'XLA:TPU'
  assert topology.parse('h200:8').hbm_bytes == 143771 * 2**20
  for bad in ('h100:2x2x2', 'h100:0', 'b300:8'):
    with pytest.raises(ConfigError) as error:
      topology.parse(bad)
    assert error.value.key == '--topology' and 'h100:N or h100:HxN' in error.value.message
  with pytest.raises(ConfigError) as error:
    topology.parse('h100:8', slices=2)
  assert error.value.key == '--topology_slices' and 'h100:2x8' in error.value.message
  config = topology.parse('a100:8').kind.target_config()
  assert 'core_count: 108' in config and 'major: 8 minor: 0' in config


def _compile(workdir, *flags, plugin=PLUGIN, config=SMOKE, name='h100:8'):
  result = harness.run_cli(
    'triax.cli.train',
    f'--config={config}',
    f'--workdir={workdir}',
    '--compile_only',
    f'--topology={name}',
    *flags,
    env_extra={topology.CUDA_PLUGIN_VAR: plugin} if plugin else None,
  )
  path = os.path.join(workdir, 'compile_stats.json')
  stats = None
  if os.path.exists(path):
    with open(path) as f:
      stats = json.load(f)
  return result, stats


def test_fsdp_splits_the_state_over_eight_h100s(tmp_path):
  """The same train step for 8 H100s, replicated and FSDP: XLA:GPU's per-device
  arguments (the state and the batch) fall to an eighth of the state."""
  assert os.path.isfile(PLUGIN), 'scripts/env.sh test installs the CUDA plugin there'
  runs = {}
  for name, flags in (('dp', ()), ('fsdp', ('--config.mesh.fsdp=true',))):
    result, stats = _compile(str(tmp_path / name), *EIGHT_REPLICAS, *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith('fits: '), result.stdout
    assert 'on 8 x NVIDIA H100 80GB HBM3' in result.stdout
    assert (stats['device_kind'], stats['chips'], stats['topology']) == (
      'NVIDIA H100 80GB HBM3',
      8,
      'h100:8',
    )
    assert stats['hbm_bytes_per_device'] == 81559 * 2**20 and stats['fits']
    assert any('train_step' in b['op_name'] for b in stats['largest_buffers'])
    runs[name] = stats
  state = runs['dp']['param_bytes'] + runs['dp']['optimizer_bytes']
  batch = runs['dp']['argument_bytes'] - state
  assert 0 <= batch < state / 100
  assert runs['fsdp']['argument_bytes'] == pytest.approx(state / 8 + batch, rel=0.01)


def test_a_pipeline_compiles_for_two_hosts_of_eight(tmp_path):
  result, stats = _compile(
    str(tmp_path / 'w'),
    '--config.mesh.data=4',
    '--config.mesh.tensor=2',
    '--config.mesh.pipe=2',
    '--config.pipeline.microbatches=2',
    '--config.train.global_batch_size=8',
    name='h100:2x8',
  )
  assert result.returncode == 0, result.stderr
  assert stats['chips'] == 16 and stats['schedule']['stages'] == 2
  assert 0 < stats['temp_bytes'] < GiB


_SCHEDULED = """
%branch (p: (f32[4], f32[4])) -> f32[4] {
  %p = (f32[4], f32[4]) parameter(0)
  %a = f32[4] get-tuple-element(%p), index=0
  %b = f32[4] get-tuple-element(%p), index=1
  %all-to-all-start.1 = ((f32[4]), f32[4]) all-to-all-start(%a), metadata={op_name="x"}
  %k1 = f32[4] fusion(%b), kind=kLoop, calls=%f1
  %k2 = f32[4] fusion(%a), kind=kLoop, calls=%f2
  %all-to-all-done.1 = f32[4] all-to-all-done(%all-to-all-start.1)
  %all-to-all-start.2 = ((f32[4]), f32[4]) all-to-all-start(%k1)
  %all-to-all-done.2 = f32[4] all-to-all-done(%all-to-all-start.2)
  ROOT %r = f32[4] add(%all-to-all-done.1, %all-to-all-done.2)
}
"""


@pytest.mark.fast
def test_windows_count_the_other_chains_kernels():
  """k1 feeds the second all-to-all, so inside the first's window it is the
  other chain's; k2 shares only an input with the first and is neither's."""
  w = hlo_schedule.windows(_SCHEDULED)
  assert w == hlo_schedule.Windows('branch', 2, (1, 1), 2, 1)


def test_a_fused_tick_lets_xla_gpu_hide_one_micro_batchs_all_to_all(tmp_path):
  """DualPipeV fused (pipeline.fuse_overlaps) with the layers unrolled: in
  its fused branch XLA:GPU's scheduler runs the other micro-batch's
  kernels inside the all-to-alls' windows. The two micro-batches' chains
  stay apart: with signed gather indices, jnp's negative-index fix-up
  shared one zeros array between them, and XLA fused their gathers into
  one kernel, which tied the chains into one, and no window held any of
  the other's kernels (moe._rows)."""
  bench = harness.load_script('bench_moe')
  label, xla_flags = bench.GPU_PASSES[0]
  assert (label, xla_flags) == ('as they are', '')
  result = harness.run_cli(
    'triax.cli.train',
    '--config=experiments/mixtral_tiny.py',
    f'--workdir={tmp_path / "w"}',
    '--compile_only',
    '--topology=h100:8',
    *(f'--config.{k}={v}' for k, v in bench.GPU_CONFIG.items()),
    env_extra={
      topology.CUDA_PLUGIN_VAR: PLUGIN,
      'XLA_FLAGS': xla_flags,
      'TRIAX_XLA_DUMP': str(tmp_path / 'dump'),
    },
  )
  assert result.returncode == 0, result.stderr
  (path,) = glob.glob(str(tmp_path / 'dump' / '*gpu_after_optimizations.txt'))
  with open(path) as f:
    w = hlo_schedule.windows(f.read())
  # The B's five all-to-alls (its dispatch run again, then transposed) and the F's three.
  assert (w.pairs, w.chains) == (8, (5, 3))
  assert w.other_chain > w.kernels / 3, w


@pytest.mark.parametrize(
  'plugin, flags, line',
  [
    (
      None,
      (),
      "error: --topology: compiling for a GPU needs jax's CUDA plugin: pip install 'triax[gpu]'",
    ),
    ('/no/such/plugin.so', (), 'error: TRIAX_XLA_CUDA_PLUGIN: /no/such/plugin.so is not a file'),
    (PLUGIN, ('--config.model.attention=cudnn',), 'error: model.attention: cudnn attention is'),
  ],
)
def test_what_a_gpu_compile_cannot_do_is_one_line(tmp_path, plugin, flags, line):
  result, stats = _compile(str(tmp_path / 'w'), *EIGHT_REPLICAS, *flags, plugin=plugin)
  assert result.returncode == 2 and stats is None, result.stderr
  (error,) = result.stderr.splitlines()
  assert error.startswith(line), result.stderr


def test_plan_verify_compiles_the_best_plan_for_eight_h100s():
  result = harness.run_cli(
    'triax.cli.plan',
    f'--config={SMOKE}',
    '--config.train.global_batch_size=8',
    '--cluster=experiments/clusters/dgx_h100.yaml',
    '--gpus=8',
    '--profile=analytic',
    '--top=1',
    '--verify=h100:8',
    '--json',
    env_extra={topology.CUDA_PLUGIN_VAR: PLUGIN},
  )
  assert result.returncode == 0, result.stderr
  verify = json.loads(result.stdout)['verify']
  assert verify['topology'] == 'h100:8' and verify['fits'] is True
  assert verify['xla_step_peak_bytes'] > 0
  assert verify['line'].startswith('verify: XLA:GPU compiled the best plan for h100:8: ')


# docs/bench_gpu_compile.json: XLA:GPU's bytes of each row (scripts/bench_gpu_compile.py).
# Rows where the planner's memory model (fitted to XLA:TPU) is within 10% of XLA:GPU.
WITHIN_XLA_GPU = ('fsdp8', 'tp8', 'tp2pp4', 'tp8_8b', 'fsdp16_8b')


@pytest.fixture(scope='module')
def gpu_bench():
  return harness.load_script('bench_gpu_compile')


@pytest.fixture(scope='module')
def gpu_rows():
  with open(os.path.join(harness.ROOT, 'docs', 'bench_gpu_compile.json')) as f:
    return json.load(f)


@pytest.mark.fast
@pytest.mark.parametrize('name', WITHIN_XLA_GPU)
def test_planner_peak_within_ten_percent_of_xla_gpu(gpu_bench, gpu_rows, name):
  row = gpu_rows[name]
  assert isinstance(row['temp'], int) and isinstance(row['argument'], int)
  _, topology_name, (config, overrides) = gpu_bench.ROWS[name]
  predicted = gpu_bench.tpu.planner_peak(topology_name, config, overrides, gpu_bench.CLUSTER)
  assert 0.9 <= predicted / (row['argument'] + row['temp']) <= 1.1


@pytest.mark.fast
@pytest.mark.parametrize('name', ['fsdp8_fp8', 'fsdp8_fp8_rowwise', 'tp8_8b_fp8'])
def test_under_fp8_the_bf16_matmuls_are_the_attention_core_and_the_head(gpu_bench, gpu_rows, name):
  """The FP8 rows of docs/bench_gpu_compile.md: of the matmul FLOPs XLA:GPU's
  step executes, those not on FP8 operands are model/flops.py's attention core
  and head, so every weight matmul ran in FP8; all of them Triton's."""
  row = gpu_rows[name]
  _, topology_name, (config, overrides) = gpu_bench.row_spec(name)
  weights, rest = gpu_bench.model_matmul_flops(topology_name, config, overrides)
  assert row['flops'] - row['fp8_flops'] == pytest.approx(rest, rel=1e-6)
  assert 0 < row['fp8_flops'] < weights  # short by the dead second forward of the down projection
  assert row['fp8_gemms']['cublaslt'] == 0 and row['fp8_gemms']['triton'] > 0


@pytest.mark.fast
def test_a_row_the_gpu_bench_does_not_have_is_one_error_line(gpu_bench, tmp_path):
  out = tmp_path / 'page.md'
  done = harness.run_script('bench_gpu_compile.py', '--rows=nope', f'--out={out}')
  rows = ', '.join([*gpu_bench.ROWS, *gpu_bench.FP8_ROWS])
  assert done.returncode == 2 and not out.exists()
  assert [line for line in done.stderr.splitlines() if line.startswith('error:')] == [
    f"error: --rows: no row 'nope'; name rows of {rows}"
  ]


@pytest.mark.fast
def test_xla_gpus_steps_use_their_arguments_and_part_of_their_heap(gpu_bench, gpu_rows):
  """The bytes in use at a step's worst point (buffers.live_peak) lie between
  its arguments and its arguments plus its heap: the rest of the heap is
  holes, which the planner does not model (docs/bench_gpu_compile.md)."""
  for name in gpu_bench.ROWS:
    row = gpu_rows[name]
    assert row['argument'] < row['live'] <= row['argument'] + row['heap'], name
  # The two rows the planner misses by over 10%: holes, not bytes in use.
  for name in ('pp8_zb', 'tp4pp2_8b'):
    row = gpu_rows[name]
    assert row['argument'] + row['heap'] - row['live'] > 2 * GiB, name
