"""Compiling for a TPU slice that is not here: `triax train --compile_only --topology`.

libtpu (the test extra installs it) compiles for a topology's abstract
devices on this CPU host; XLA:TPU's memory figures are deterministic, so
they may be asserted. Bad topology input: tests/test_bad_input.py.
"""

import json
import os

import harness
import jax
import pytest

from triax import topology
from triax.compiled import stats as stats_lib
from triax.errors import ConfigError

GiB = 2**30
SMOKE = 'experiments/llama_1b.py:smoke,attention=xla'


def test_topology_names():
  v5p = topology.parse('v5p:2x2x1')
  assert (v5p.chips, v5p.hbm_bytes, v5p.kind.device_kind) == (4, 95 * GiB, 'TPU v5')
  assert topology.parse('v5e:4x4').chips == 16
  assert topology.parse('v6e:8x8', slices=2).chips == 128
  assert topology.parse('v4:2x2x2').hbm_bytes == 32 * GiB
  for bad in ('v9:2x2', 'v5p:2x2', 'v5e:4x4x4', 'v5p', '', 'v5p:0x2x2'):
    with pytest.raises(ConfigError) as error:
      topology.parse(bad)
    assert error.value.key == '--topology' and 'v5p:AxAxA' in error.value.message
  with pytest.raises(ConfigError) as error:
    topology.parse('v5p:2x2x1', slices=0)
  assert error.value.key == '--topology_slices'


def test_the_fit_line_says_by_how_much():
  slice_ = topology.parse('v5e:2x2')
  fits, line = topology.fit_line(slice_, 15 * GiB)
  assert fits and line.startswith('fits: 15.00 GiB per device of 16 GiB HBM (1.00 GiB spare)')
  fits, line = topology.fit_line(slice_, 18 * GiB)
  assert not fits and line.startswith('does not fit: 18.00 GiB per device, 2.00 GiB over')


class _Gpu:
  """A device as a GPU reports itself: its allocator's limit in memory_stats()."""

  device_kind = 'NVIDIA H200'

  def memory_stats(self):
    return {'bytes_limit': 128 * GiB, 'bytes_in_use': 0}


def test_compile_only_on_a_gpu_fits_against_what_its_allocator_may_take():
  fit = stats_lib.local_fit({'peak_bytes': 100 * GiB}, [_Gpu(), _Gpu()])
  assert fit['fits'] and fit['memory_bytes_per_device'] == 128 * GiB
  assert fit['fit_line'] == (
    'fits: 100.00 GiB per device of 128 GiB that XLA may allocate (28.00 GiB spare) '
    'on 2 x NVIDIA H200'
  )
  fit = stats_lib.local_fit({'peak_bytes': 130 * GiB}, [_Gpu()])
  assert not fit['fits'] and fit['fit_line'].startswith('does not fit: 130.00 GiB per device, 2.00')
  # A CPU device reports no limit: nothing to fit against, no line.
  assert stats_lib.local_fit({'peak_bytes': 1}, jax.devices()) == {}


def _compile(workdir, *flags, config=SMOKE, topology_name='v5p:2x2x1'):
  result = harness.run_cli(
    'triax.cli.train',
    f'--config={config}',
    f'--workdir={workdir}',
    '--compile_only',
    f'--topology={topology_name}',
    *flags,
  )
  stats = None
  if os.path.exists(os.path.join(workdir, 'compile_stats.json')):
    with open(os.path.join(workdir, 'compile_stats.json')) as f:
      stats = json.load(f)
  return result, stats


def test_a_pipelined_step_compiles_for_four_v5p_chips(tmp_path):
  result, stats = _compile(
    str(tmp_path / 'w'),
    '--config.mesh.data=2',
    '--config.mesh.pipe=2',
    '--config.pipeline.microbatches=2',
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().splitlines()[-1].startswith('fits: '), result.stdout
  assert 'TPU_WORKER_HOSTNAMES' not in result.stderr  # libtpu's start-up noise is silenced
  assert (stats['device_kind'], stats['devices'], stats['chips']) == ('TPU v5', 4, 4)
  assert stats['hbm_bytes_per_device'] == 95 * GiB and stats['fits']
  assert stats['schedule']['name'] == '1f1b' and stats['schedule']['stages'] == 2
  step = stats['temp_bytes'] + stats['argument_bytes'] + stats['output_bytes']
  # The run's peak is the step's: a save, a restore or an evaluation holds less.
  assert stats['peak_bytes'] == step - stats['alias_bytes'] == stats_lib.step_peak_bytes(stats)
  biggest = stats['largest_buffers']
  assert biggest and biggest[0]['bytes'] >= biggest[-1]['bytes']
  assert any('train_step' in b['op_name'] for b in biggest)
  # The same program on the CPU's XLA differs: these are the TPU compiler's bytes.
  assert 0 < stats['temp_bytes'] < 64 * 2**20
  # The heap XLA:TPU allocates holds the largest buffer; temp counts its holes twice.
  assert biggest[0]['bytes'] <= stats['temp_heap_bytes'] <= stats['temp_bytes']


@pytest.mark.fast
def test_every_benchmarked_runs_peak_is_its_train_steps():
  """docs/bench_tpu_compile.json (scripts/bench_tpu_compile.py's compiles for
  v5p slices, exact bytes): on every row a checkpoint save, a restore and an
  evaluation beside the resident state hold no more than the train step."""
  with open(os.path.join(harness.ROOT, 'docs', 'bench_tpu_compile.json')) as f:
    results = json.load(f)
  rows = {k: r['triax_programs'] for k, r in results.items() if 'triax_programs' in r}
  assert len(rows) >= 31
  for name, stats in rows.items():
    peaks = stats_lib.program_peaks(stats)
    assert max(peaks.values()) == peaks['step'], (name, peaks)


def test_splash_holds_no_scores_on_a_tpu(tmp_path):
  """At 1024 positions a layer's [b, n, s, s] scores are most of XLA attention's
  temporaries; the splash kernel (compiled by Mosaic for the TPU) keeps none."""
  flags = ('--config.mesh.data=4', '--config.model.seq_len=1024', '--config.model.loss_chunk=256')
  temp = {}
  for kind in ('xla', 'splash'):
    result, stats = _compile(str(tmp_path / kind), *flags, f'--config.model.attention={kind}')
    assert result.returncode == 0, result.stderr
    temp[kind] = stats['temp_bytes']
  scores = 4 * 4 * 1024 * 1024 * 4 // 4  # one layer's fp32 scores of a device's rows
  assert temp['splash'] + scores < temp['xla'], temp


def test_a_slice_too_small_exits_3_and_says_by_how_much(tmp_path):
  """Llama 3.1 8B's vocabulary and width, two layers, replicated over four v5e
  chips of 16 GiB: the embedding's and head's state alone is 16 GiB."""
  result, stats = _compile(
    str(tmp_path / 'w'),
    '--config.model.num_layers=2',
    '--config.mesh.data=4',
    config='experiments/llama_8b.py:attention=xla,remat=full,batch=4',
    topology_name='v5e:2x2',
  )
  assert result.returncode == 3, result.stderr
  # XLA:TPU itself refuses a program beyond the chip's HBM (what it may use
  # of a v5e's 16 GiB); the stats say by how much.
  line = result.stdout.strip().splitlines()[-1]
  assert line.startswith('does not fit: XLA:TPU refuses the train step'), line
  assert 'GiB over the 15.75 GiB it may use' in line
  assert not stats['fits'] and stats['required_bytes'] > stats['available_bytes'] == 15.75 * GiB
  assert stats['device_kind'] == 'TPU v5 lite' and stats['largest_buffers']


def _plan(*flags):
  return harness.run_cli(
    'triax.cli.plan',
    f'--config={SMOKE}',
    '--cluster=experiments/clusters/tpu_v5p.yaml',
    '--gpus=4',
    '--profile=analytic',
    '--top=1',
    *flags,
    timeout=600,
  )


def test_plan_verify_compiles_the_best_plan_for_the_slice():
  result = _plan('--verify=v5p:2x2x1', '--json')
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  verify, best = report['verify'], report['top'][0]
  assert verify['topology'] == 'v5p:2x2x1' and verify['fits'] is True
  assert verify['planned_step_peak_bytes'] == max(best['memory_bytes'])
  assert verify['xla_step_peak_bytes'] > 0
  ratio = verify['planned_step_peak_bytes'] / verify['xla_step_peak_bytes']
  assert verify['planned_over_xla'] == pytest.approx(ratio)
  assert verify['line'].startswith('verify: XLA:TPU compiled the best plan for v5p:2x2x1: ')
  assert verify['line'].endswith(verify['fit_line'])


@pytest.mark.parametrize(
  'flags, line',
  [
    (['--verify=v9:2x2'], "error: --verify: unknown topology 'v9:2x2'"),
    (['--verify=v5p:2x2x2'], 'error: --verify: the slice has 8 chips and the cluster 4 devices'),
    (['--verify_slices=2'], 'error: --verify_slices: only --verify reads it'),
  ],
)
def test_plan_verify_bad_input_is_one_line(flags, line):
  result = _plan(*flags)
  assert result.returncode == 2 and result.stdout == ''
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert result.stderr.startswith(line), result.stderr
