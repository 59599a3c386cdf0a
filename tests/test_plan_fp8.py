"""The planner prices model.fp8: a spec's float8 peak, the weight GEMMs at it (a MoE's
routed experts' too) and their casts as memory traffic, the rest at the compute dtype's
peak; MFU keeps the bf16 peak."""

import json
import os
import subprocess
import sys

import harness
import pytest
import yaml

from triax import config
from triax.errors import ConfigError
from triax.plan import cluster as cluster_lib
from triax.plan import report
from triax.plan.cost import analytic

ROOT = os.path.join(os.path.dirname(__file__), '..')
CLUSTERS = os.path.join(ROOT, 'experiments', 'clusters')
DGX_H100 = os.path.join(CLUSTERS, 'dgx_h100.yaml')
SELENE = os.path.join(CLUSTERS, 'selene.yaml')
LLAMA_1B = os.path.join(ROOT, 'experiments', 'llama_1b.py')
DEEPSEEK_V3 = os.path.join(ROOT, 'experiments', 'deepseek_v3.py')
MIXTRAL_TINY = os.path.join(ROOT, 'experiments', 'mixtral_tiny.py')
# Llama 3.2 1B's layer (experiments/llama_1b.py): width, heads, K/V heads, head width, MLP, sequence.
D, N, KV, HD, F, S = 2048, 32, 8, 64, 8192, 2048
E, PE = 2, 4  # bf16 activations, fp32 weights
# The layer's weights as [k, n] matmuls: Q, K, V, the output projection, gate, up, down.
WEIGHTS = [(D, N * HD), (D, KV * HD), (D, KV * HD), (N * HD, D), (D, F), (D, F), (F, D)]
B = 4  # sequences a micro-batch: every GEMM compute-bound on both specs


def _llama(fp8='tensorwise'):
  cfg = config.from_file(LLAMA_1B)
  cfg.model.fp8 = fp8
  return cfg


def _group(path, name):
  return cluster_lib.load(path).groups[name]


@pytest.mark.fast
def test_the_h100_specs_know_an_fp8_peak_and_older_devices_none():
  for name in ('dgx_h100', 'h100_8x_nvlink', 'hetero_256'):
    h100 = _group(os.path.join(CLUSTERS, f'{name}.yaml'), 'h100')
    assert h100.fp8_peak() == 1979e12 and h100.peak('bfloat16') == 989e12
  hetero = cluster_lib.load(os.path.join(CLUSTERS, 'hetero_256.yaml')).groups
  assert hetero['l4'].fp8_peak() == 242.5e12  # the data sheet's 485 is with sparsity
  assert hetero['a100'].fp8_peak() is None
  assert _group(SELENE, 'a100').fp8_peak() is None
  assert _group(os.path.join(CLUSTERS, 'tpu_v5p.yaml'), 'v5p').fp8_peak() is None


def _spec_with(peaks: str) -> dict:
  return yaml.safe_load(f"""
name: one
groups:
  - {{name: a, type: A, count: 1, peak_flops: {peaks}, memory: 80 GB,
     memory_bandwidth: 3 TB/s}}
nodes:
  - {{name: n0, devices: {{a: 1}}}}
links:
  intra_node: {{bandwidth: 450 GB/s, latency: 1 us}}
  inter_node: {{bandwidth: 400 Gb/s, latency: 5 us}}
""")


@pytest.mark.fast
@pytest.mark.parametrize(
  'peaks, message',
  [
    ('{bfloat16: 989 TFLOP/s, float32: 495 TFLOP/s, float8: 1979 TFLOPS}', "unknown unit 'TFLOPS'"),
    ('{bfloat16: 989 TFLOP/s, float32: 495 TFLOP/s, float8: -1}', 'peak_flops.float8'),
    ('{bfloat16: 989 TFLOP/s, float32: 495 TFLOP/s, fp8: 1979 TFLOP/s}', "unknown dtype 'fp8'"),
    ('{bfloat16: 989 TFLOP/s, float8: 1979 TFLOP/s}', 'at least bfloat16 and float32'),
  ],
)
def test_a_bad_float8_peak_is_the_clusters_one_line_error(peaks, message):
  with pytest.raises(ConfigError) as info:
    cluster_lib.parse(_spec_with(peaks), 'spec.yaml')
  assert info.value.key == '--cluster' and message in info.value.message
  assert '\n' not in info.value.message
  ok = cluster_lib.parse(_spec_with('{bfloat16: 1 TFLOP/s, float32: 1 TFLOP/s, float8: 2e12}'))
  assert ok.groups['a'].fp8_peak() == 2e12


def _layer_by_hand(group, fp8_peak: float, profile) -> tuple[float, float]:
  """(forward, backward) seconds of a llama_1b layer on B sequences, FLOPs and
  cast bytes counted here; the norms' bytes (not FP8's business) from the profile."""
  eff, bw = group.matmul_efficiency, group.memory_bandwidth
  gemms = 2.0 * S * sum(k * n for k, n in WEIGHTS)
  flash = 4.0 * S * S * N * HD * 0.5  # cuDNN's fused core: the causal half of the square
  # Forward casts: x (bf16) and w (fp32) read, both written in FP8; backward x, w and g.
  cast_fwd = sum(B * S * k * (E + 1) + k * n * (PE + 1) for k, n in WEIGHTS)
  cast_bwd = sum(B * S * (k + n) * (E + 1) + k * n * (PE + 1) for k, n in WEIGHTS)
  kernels = profile.analytic.kernels[1]
  (norms,) = [k for k in kernels.layer_fwd if k.name.startswith('norms')]
  (norms_bwd,) = [k for k in kernels.layer_bwd if k.name.startswith('norms')]
  peak = group.peak('bfloat16') * eff
  fwd = B * gemms / (fp8_peak * eff) + B * flash / peak + (cast_fwd + B * norms.bytes) / bw
  bwd = (
    2 * B * gemms / (fp8_peak * eff)
    + 2.5 * B * flash / peak
    + (cast_bwd + B * norms_bwd.bytes) / bw
  )
  return group.overhead_per_layer + fwd, group.overhead_per_layer + bwd


@pytest.mark.fast
def test_llama_weight_gemms_run_at_the_h100s_fp8_peak_and_attention_at_bf16s():
  prof = analytic.build(_llama().model, [1])
  h100 = _group(DGX_H100, 'h100')
  kernels = prof.analytic.kernels[1]
  fp8 = [k for k in kernels.layer_fwd if k.fp8]
  assert sum(k.flops for k in fp8) == pytest.approx(2.0 * S * sum(k * n for k, n in WEIGHTS))
  assert not any(k.fp8 for k in (*kernels.head, *kernels.embed, *kernels.attention))
  want = _layer_by_hand(h100, 1979e12, prof)
  assert prof.analytic.layer_seconds(h100, B, 1, 'none') == pytest.approx(want, rel=1e-9)
  # Full remat reruns the forward, its FP8 GEMMs and casts included.
  full = prof.analytic.layer_seconds(h100, B, 1, 'full')
  assert full[1] == pytest.approx(want[0] + want[1], rel=1e-9)
  # The same layer in bf16: its GEMMs at 989 TFLOP/s and no casts.
  plain = analytic.build(_llama('none').model, [1]).analytic
  gemms = 3 * B * 2.0 * S * sum(k * n for k, n in WEIGHTS)
  saved = gemms / (989e12 * 0.7) - gemms / (1979e12 * 0.7)
  assert (
    sum(plain.layer_seconds(h100, B, 1, 'none'))
    > sum(want)
    > sum(plain.layer_seconds(h100, B, 1, 'none')) - saved
  )


@pytest.mark.fast
def test_an_a100_prices_fp8_gemms_at_its_bf16_peak():
  prof = analytic.build(_llama().model, [1])
  a100 = _group(SELENE, 'a100')
  want = _layer_by_hand(a100, 312e12, prof)
  assert prof.analytic.layer_seconds(a100, B, 1, 'none') == pytest.approx(want, rel=1e-9)
  # No faster than bf16: the casts only add time.
  plain = analytic.build(_llama('none').model, [1]).analytic
  assert sum(want) > sum(plain.layer_seconds(a100, B, 1, 'none'))


@pytest.mark.fast
def test_deepseeks_router_stays_in_bf16_and_its_routed_experts_run_in_fp8():
  """DeepSeek's router and its rope key's projection share their axes and
  width (d x 64 in V2-Lite): only the router is a plain einsum
  (blocks.PLAIN_EINSUM); the routed experts' grouped matmuls are FP8, each
  token through k = 6 of the 64, their weights (and casts) the experts'
  bytes that mesh.expert splits."""
  arg = 'lite,attention=xla,seq=512'
  cfg = config.from_file(DEEPSEEK_V3, arg)
  cfg.model.fp8 = 'tensorwise'
  layer = analytic.build(cfg.model, [1]).analytic.kernels[1].layer_fwd
  s, d, n, nope, rope, v, r, shared, f = 512, 2048, 16, 128, 64, 128, 512, 2, 1408
  k, experts = 6, 64
  projections = d * n * (nope + rope) + d * (r + rope) + r * n * (nope + v) + n * v * d
  fp8 = sum(k.flops for k in layer if k.fp8)
  assert fp8 == pytest.approx(2.0 * s * (projections + (shared + k) * 3 * d * f))
  plain = [k for k in layer if k.name.startswith('gemm')]
  assert [k.name for k in plain] == [f'gemm {d}x64']  # the router
  routed = [k for k in layer if k.expert_bytes]
  assert len(routed) == 6 and not any(k.fixed_bytes for k in routed)
  # Each GEMM reads the FP8 weights of every expert, each cast their fp32 and FP8 bytes.
  assert sorted(k.expert_bytes for k in routed) == [experts * d * f] * 3 + [experts * d * f * 5] * 3


def _mixtral_8x7b(fp8: str):
  """Mixtral 8x7B's layer (8 experts, top-2, d 4096, f 14336, 4096 positions), bf16 compute."""
  cfg = config.from_file(MIXTRAL_TINY)
  m = cfg.model
  m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.seq_len = 4096, 32, 8, 14336, 4096
  m.num_experts, m.experts_per_token, m.shared_experts = 8, 2, 0
  m.dtype, m.attention, m.fp8 = 'bfloat16', 'cudnn', fp8
  return analytic.build(m, [1]).analytic


@pytest.mark.fast
@pytest.mark.parametrize('expert', [1, 8])
def test_a_moe_layer_is_faster_in_fp8_than_in_bf16_on_h100s(expert):
  """Its routed experts' GEMMs at the FP8 peak, as model/ runs them: with
  4 x 4096 tokens a micro-batch each expert takes ~4096 rows, enough that
  the FLOPs saved outweigh casting all 8 experts' weights (split over
  mesh.expert). The layer's time drops by more than half what the experts'
  GEMMs alone save at the FP8 peak (the attention projections' save an
  eighth of that: the drop is mostly the experts')."""
  h100 = _group(DGX_H100, 'h100')
  d, f, k = 4096, 14336, 2
  fp8, plain = _mixtral_8x7b('tensorwise'), _mixtral_8x7b('none')
  routed = sum(x.flops for x in fp8.kernels[1].layer_fwd if x.fp8 and x.expert_bytes)
  assert routed == pytest.approx(2.0 * 4096 * k * 3 * d * f)
  fast = sum(fp8.layer_seconds(h100, B, 1, 'none', expert))
  slow = sum(plain.layer_seconds(h100, B, 1, 'none', expert))
  # The experts' GEMMs alone, forward and backward, at bf16's peak and at float8's.
  saved = 3 * B * routed * (1 / 989e12 - 1 / 1979e12) / h100.matmul_efficiency
  print(f'expert {expert}: bf16 {slow * 1e3:.2f} ms, fp8 {fast * 1e3:.2f} ms a layer')
  assert slow - fast > 0.5 * saved


def _evaluate(cluster: str, fp8: str, capsys) -> tuple[dict, str]:
  cfg = _llama(fp8)
  request = report.Request(
    cfg=cfg,
    config_path=LLAMA_1B,
    config_overrides={'model.fp8': fp8},
    cluster=cluster,
    profile='analytic',
    gpus=8,
    evaluate=True,
    layout='d8',
  )
  summary = report.run(request)
  return summary, capsys.readouterr().out


def test_the_report_says_what_fp8_runs_at_and_what_mfu_divides_by(capsys):
  _, text = _evaluate(SELENE, 'tensorwise', capsys)
  (note,) = [line for line in text.splitlines() if line.startswith('note: model.fp8')]
  assert 'on a100: the spec lists no float8 peak' in note and 'bfloat16 peak' in note
  assert "MFU of the devices' data-sheet bfloat16 peak, 312 TFLOP/s" in text
  assert 'MFU keeps the bfloat16 peak as its denominator' in text
  summary, text = _evaluate(DGX_H100, 'tensorwise', capsys)
  assert 'note: model.fp8' not in text and "at the spec's float8 peak" in text
  assert summary['peak_flops_per_device'] == 989e12 and summary['model']['fp8'] == 'tensorwise'
  _, text = _evaluate(DGX_H100, 'none', capsys)
  assert 'model.fp8' not in text


def _cli(*flags) -> dict:
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'triax',
      'plan',
      f'--config={LLAMA_1B}',
      f'--cluster={DGX_H100}',
      '--gpus=8',
      '--profile=analytic',
      '--evaluate',
      '--layout=d8',
      '--json',
      *flags,
    ],
    capture_output=True,
    text=True,
    env=harness.subprocess_env(),
    cwd=ROOT,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_evaluate_prices_fp8_faster_than_bf16_on_h100s():
  bf16, fp8 = _cli(), _cli('--config.model.fp8=tensorwise')
  assert fp8['plan']['lockstep_time_s'] < bf16['plan']['lockstep_time_s']
  # One model's FLOPs over one bf16 peak: MFU rises by exactly the speed-up.
  assert fp8['model_flops_per_step'] == bf16['model_flops_per_step']
  assert fp8['peak_flops_per_device'] == bf16['peak_flops_per_device'] == 989e12
  speedup = bf16['plan']['lockstep_time_s'] / fp8['plan']['lockstep_time_s']
  assert fp8['mfu']['lockstep'] == pytest.approx(bf16['mfu']['lockstep'] * speedup)


@pytest.mark.fast
def test_the_search_tries_no_remat_the_config_refuses_with_fp8():
  """remat=dots is refused under model.fp8 (config.remat_policies), so the
  search never proposes it: on H100s of 1 GB nothing of Llama 3.1 8B fits,
  so every policy the model allows is tried, and dots only without fp8."""
  import dataclasses

  from triax.plan.candidate import Options
  from triax.plan.search import evaluate as search
  from triax.plan.search import layouts as layouts_lib

  h100 = cluster_lib.resize(cluster_lib.load(DGX_H100), 8)
  small = dataclasses.replace(h100.groups['h100'], memory=2**30)
  h100 = dataclasses.replace(h100, groups={'h100': small})
  tried = {}
  for fp8 in ('none', 'tensorwise'):
    cfg = config.from_file(os.path.join(ROOT, 'experiments', 'llama_8b.py'))
    cfg.model.fp8 = fp8
    layout = next(l for l in layouts_lib.layouts(cfg, 8) if l.data == 8)
    prof = analytic.build(cfg.model, [1])
    found = search.evaluate(cfg, h100, prof, Options(), [layout])
    tried[fp8] = {e.plan.remat for e in found}
  assert tried == {
    'none': {'none', 'attention', 'dots', 'full'},
    'tensorwise': {'none', 'attention', 'full'},
  }
  assert config.remat_policies(cfg.model) == ('none', 'attention', 'full')


def test_delayed_is_priced_as_tensorwise_on_the_same_layouts():
  """model.fp8=delayed's GEMMs and casts are tensorwise's (its histories, 3 x
  model.fp8_amax_history fp32 per site and layer, 2.7 MiB for a 32-layer Llama at
  1024, are not priced), and the search tries the same layouts, pipelined
  ones included (the executor carries the histories)."""
  from triax.plan.search import layouts as layouts_lib

  assert _cli('--config.model.fp8=delayed')['plan'] == _cli('--config.model.fp8=tensorwise')['plan']
  tried = list(layouts_lib.layouts(_llama('delayed'), 8))
  assert tried == list(layouts_lib.layouts(_llama('tensorwise'), 8))
  assert any(l.pipe > 1 for l in tried)
