"""DeepSeek's sections of docs/bench_moe.md (scripts/bench_moe.py --sections=5,6,7).

5. deepseek_tiny trained BALANCE_STEPS steps twice from the same seed, the
   balancing bias's update on (the experiment's rate) and off: the max/mean
   expert load of the worst layer (metrics' moe_load_max) over the run, and
   the eval loss.
6. deepseek_tiny's per-device compiled temp bytes (XLA's memory analysis)
   and step time by layout and schedule (ratios within this one run).
7. MLA's decoding cache per token against multi-head attention's of the
   same heads (k of the q/k width and v of the v width for each head), for
   deepseek_tiny and DeepSeek-V3's shape.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

from bench_harness import ROOT, run_python

DEEPSEEK_TINY = os.path.join(ROOT, 'experiments', 'deepseek_tiny.py')
MiB = 2**20
# Steps of section 5's two runs, and the last ones its mean load is over.
BALANCE_STEPS, LAST = 100, 20
# No pipeline (the experiment's schedule keys reset with it).
UNPIPELINED = {
  'mesh.pipe': 1,
  'pipeline.microbatches': 1,
  'pipeline.schedule': '1f1b',
  'pipeline.virtual_stages': 1,
  'pipeline.fuse_overlaps': False,
}
# Section 5's layout: data 8 with the experts over 2 of it.
BALANCE_LAYOUT = {'mesh.data': 8, 'mesh.tensor': 1, **UNPIPELINED}
# Section 6: (label, config overrides) on 8 devices; the experiment's is the last.
LAYOUTS = (
  ('data 8', BALANCE_LAYOUT),
  ('data 4 x tensor 2', {'mesh.data': 4, 'mesh.tensor': 2, **UNPIPELINED}),
  (
    'data 2 x tensor 2 x pipe 2, 1f1b',
    {'pipeline.schedule': '1f1b', 'pipeline.virtual_stages': 1, 'pipeline.fuse_overlaps': False},
  ),
  ('data 2 x tensor 2 x pipe 2, dualpipe_v', {'pipeline.fuse_overlaps': False}),
  ('data 2 x tensor 2 x pipe 2, dualpipe_v fused', {}),
)
# DeepSeek-V3's attention (its config.json): layers, heads, q/k nope and rope, v, latent.
V3 = {'layers': 61, 'heads': 128, 'nope': 128, 'rope': 64, 'v': 128, 'latent': 512}


def _config(**overrides):
  from triax import config

  c = config.from_file(DEEPSEEK_TINY)
  for key, value in overrides.items():
    group, name = key.split('.')
    c[group][name] = value
  return c


def _train(rate: float, workdir: str) -> list[dict]:
  """deepseek_tiny for BALANCE_STEPS steps at bias_update_rate `rate`: its metrics lines."""
  flags = [
    f'--config={DEEPSEEK_TINY}:steps={BALANCE_STEPS}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    f'--config.model.bias_update_rate={rate}',
    # Unpipelined (the loads are the same on every layout, tests/test_deepseek_parity.py)
    # and so a few times faster a step here.
    *(f'--config.{k}={v}' for k, v in BALANCE_LAYOUT.items()),
    '--config.train.log_every=1',
    f'--config.train.eval_every={BALANCE_STEPS}',
    f'--config.checkpoint.every_steps={BALANCE_STEPS}',
  ]
  run_python(['-m', 'triax', 'train', *flags], drop_device_count=True, check=True)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def balance_rows() -> list[str]:
  rate = _config().model.bias_update_rate
  rows = [
    f'deepseek_tiny (experiments/deepseek_tiny.py: 16 experts in 4 groups, 4 per token from '
    f'2 groups, 1 shared, no auxiliary loss) at data 8 (experts over 2 of it, no pipeline) '
    f'for {BALANCE_STEPS} steps from the same seed, the '
    f"balancing bias's update at model.bias_update_rate={rate} and off (0). moe_load_max: the "
    'busiest expert over the mean, worst layer, per step (1 = balanced).',
    '',
    f'| bias update | load max/mean at step {BALANCE_STEPS} | mean over the last {LAST} steps | '
    'worst of the run | eval loss |',
    '|---|---|---|---|---|',
  ]
  for label, r in ((f'on ({rate})', rate), ('off', 0.0)):
    with tempfile.TemporaryDirectory() as tmp:
      lines = _train(r, os.path.join(tmp, 'w'))
    loads = [m['moe_load_max'] for m in lines if 'moe_load_max' in m]
    evals = [m['eval_loss'] for m in lines if 'eval_loss' in m]
    rows.append(
      f'| {label} | {loads[-1]:.2f} | {statistics.mean(loads[-LAST:]):.2f} | '
      f'{max(loads):.2f} | {evals[-1]:.3f} |'
    )
    print(rows[-1], flush=True)
  return rows


def layout_rows() -> list[str]:
  from triax.compiled import measure

  c = _config()
  m = c.model
  rows = [
    f'deepseek_tiny: {m.num_layers} layers (the first dense), d_model {m.d_model}, '
    f'{m.num_heads} heads, latents q {m.q_lora_rank} / kv {m.kv_lora_rank}, '
    f'{m.num_experts} experts of {m.moe_d_ff}, top-{m.experts_per_token}, MTP depth '
    f'{m.mtp_depth}; {m.seq_len} positions, global batch {c.train.global_batch_size}, fp32, '
    'mesh.expert=2; pipelined runs at m=4 (DualPipeV with v=2). 3 timed steps after 2; '
    'step times are ratios within this run (8 devices on 2 shared cores).',
    '',
    '| layout | temp MiB | params MiB | step s (CPU) | vs data 8 |',
    '|---|---|---|---|---|',
  ]
  base = None
  for label, overrides in LAYOUTS:
    run = measure.measure(_config(**overrides), steps=3, warmup=2)
    s, step = run.stats, run.step_time_s
    base = step if base is None else base
    rows.append(
      f'| {label} | {s["temp_bytes"] / MiB:.2f} | {s["param_bytes"] / MiB:.2f} | '
      f'{step:.3f} | {step / base:.2f}x |'
    )
    print(rows[-1], flush=True)
  return rows


def cache_rows() -> list[str]:
  from triax.model import registry

  spec = registry.spec_from_config(_config().model)
  tiny = {
    'layers': spec.num_layers,
    'heads': spec.num_heads,
    'nope': spec.qk_nope_head_dim,
    'rope': spec.qk_rope_head_dim,
    'v': spec.v_head_dim,
    'latent': spec.kv_lora_rank,
  }
  model = registry.build(spec)
  cached = sum(c.size for c in _shapes(model)) // spec.seq_len  # values per token, one row
  assert cached == tiny['layers'] * (tiny['latent'] + tiny['rope'])  # what the sampler allocates
  rows = [
    "Values a decoder caches per token (all layers): MLA's latent and rotated key "
    "(`DeepSeek.init_cache`, what triax's sampler allocates), against multi-head attention of "
    "the same heads caching each head's key (q/k width) and value; bytes in bf16.",
    '',
    '| model | MLA values | MHA values | MLA / MHA | MLA KiB (bf16) | MHA KiB (bf16) |',
    '|---|---|---|---|---|---|',
  ]
  for name, a in (('deepseek_tiny', tiny), ("DeepSeek-V3's attention", V3)):
    mla = a['layers'] * (a['latent'] + a['rope'])
    mha = a['layers'] * a['heads'] * (a['nope'] + a['rope'] + a['v'])
    rows.append(
      f'| {name} | {mla:,} | {mha:,} | {mla / mha:.3f} | {2 * mla / 1024:.1f} | '
      f'{2 * mha / 1024:.1f} |'
    )
  return rows


def _shapes(model):
  import jax

  return jax.eval_shape(lambda: model.init_cache(1))
