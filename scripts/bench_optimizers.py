"""Each train.optimizer on llama_tiny: held-out loss, step time, state bytes.

Trains experiments/llama_tiny.py once per optimizer through `triax train` on
8 CPU devices (its data 2 x tensor 2 x pipe 2 layout), the same tokens,
batches and seed, each at its usual learning rate (RATES), and writes
docs/bench_optimizers.md and docs/bench_optimizers.json: the evaluation
loss after the run, the median logged step time, and the optimizer state's
bytes per device (compile_stats.json's optimizer_bytes, what the compiled
state holds). Losses are deterministic; step times are this host's.

Then, compiled only (`_sharded`): Muon on sharded matrices. The train step
of llama_tiny at d_model 512 and 256 tokens a step (so its matrices, not
activations, dominate)
under FSDP over 8, ZeRO-1 over 8 and tensor 2 x data 4, for AdamW and Muon:
XLA's temp bytes per device (memory_analysis) and the all-gathers in the
optimised program, which say whether GSPMD gathers each matrix for its
Newton-Schulz iterations.

  python scripts/bench_optimizers.py [--steps=60]
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

import bench_harness
from absl import app, flags
from bench_harness import ROOT, run_python

_STEPS = flags.DEFINE_integer('steps', 60, 'Training steps of each run (10 of them warmup).')
_REUSE = flags.DEFINE_bool(
  'reuse_runs', False, "Take the training runs' figures from the report's .json; compile again."
)
_OUT = flags.DEFINE_string('out', os.path.join(ROOT, 'docs', 'bench_optimizers.md'), 'Report.')

# Each optimizer's usual settings beside llama_tiny's AdamW (peak 3e-3, decay 0.1, cosine):
# Muon with Moonlight's RMS matching shares AdamW's rate and decay; Lion takes a rate
# 10x smaller and a decay 10x larger (Chen et al. 2023: the same lr x decay); Adafactor's
# step is relative to each matrix's RMS (T5's 1e-2); schedule-free AdamW holds its peak
# (it averages instead of decaying; Defazio et al. 2024).
RATES = {
  'adamw': {},
  'muon': {},
  'lion': {'train.learning_rate': 3e-4, 'train.weight_decay': 1.0},
  'adafactor': {'train.learning_rate': 1e-2},
  'schedule_free_adamw': {'train.lr_schedule': 'constant'},
}


def _train(name: str, steps: int, workdir: str) -> dict:
  """One run's figures: eval loss, median step time, optimizer bytes per device."""
  overrides = {'train.optimizer': name, **RATES[name]}
  args = [
    '-m',
    'triax',
    'train',
    f'--config=experiments/llama_tiny.py:steps={steps}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    f'--config.train.eval_every={steps}',
    '--config.train.warmup_steps=10',  # llama_tiny's 30 is half of a minutes-long run
    *(f'--config.{key}={value}' for key, value in overrides.items()),
  ]
  run_python(args, check=True, drop_device_count=True)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  evals = [r['eval_loss'] for r in records if 'eval_loss' in r]
  times = [r['step_time_s'] for r in records if 'step_time_s' in r][1:]  # the first compiles
  with open(os.path.join(workdir, 'compile_stats.json')) as f:
    stats = json.load(f)
  return {
    'overrides': overrides,
    'eval_loss': evals[-1],
    'step_time_s': statistics.median(times),
    'optimizer_bytes': stats['optimizer_bytes'],
    'param_bytes': stats['param_bytes'],
  }


# Layouts Muon's sharded cost is compiled for: mesh overrides on llama_tiny.
SHARDED = {
  'fsdp 8': {'mesh.data': 8, 'mesh.tensor': 1, 'mesh.pipe': 1, 'mesh.fsdp': True},
  'zero1 8': {'mesh.data': 8, 'mesh.tensor': 1, 'mesh.pipe': 1, 'train.optimizer_sharding': 'data'},
  'tensor 2 x data 4': {'mesh.data': 4, 'mesh.tensor': 2, 'mesh.pipe': 1},
}


def _sharded(layout: str, name: str) -> dict:
  """The compiled train step's temp bytes per device and all-gathers (count, bytes)."""
  import re

  import jax

  from triax import config
  from triax.mesh import build_mesh
  from triax.training import optimizer as optimizer_lib
  from triax.training.step import build_trainer

  cfg = config.from_file(os.path.join(ROOT, 'experiments', 'llama_tiny.py'), None)
  overrides = {**SHARDED[layout], 'train.optimizer': name, 'model.d_model': 512}
  # Few tokens: the step's temporaries are then the matrices' more than the activations'.
  overrides.update({'model.d_ff': 1376, 'model.seq_len': 32, 'train.global_batch_size': 8})
  overrides.update({'pipeline.microbatches': 1, 'pipeline.virtual_stages': 1})
  for key, value in overrides.items():
    config.set_dotted(cfg, key, value)
  cfg = config.validate(cfg, 8)
  trainer = build_trainer(cfg, build_mesh(cfg.mesh))
  with jax.set_mesh(trainer.mesh):
    batch = jax.ShapeDtypeStruct(
      (cfg.train.global_batch_size, cfg.model.seq_len), 'int32', sharding=trainer.batch_sharding
    )
    compiled = trainer.train_step.lower(
      trainer.abstract_state(), {'inputs': batch, 'targets': batch}
    ).compile()
  text = compiled.as_text()
  gathers = re.findall(r'= (\w+)\[([\d,]*)\][^=]*? all-gather(?:-start)?\(', text)
  gathered = sum({'bf16': 2, 'f16': 2}.get(dtype, 4) * _prod(dims) for dtype, dims in gathers)
  leaves = optimizer_lib.Leaves(trainer.model.logical_axes())
  shapes = jax.eval_shape(trainer.model.init, jax.random.key(0))
  muon = leaves.muon_labels(())(shapes)
  matrices = sum(
    4 * a.size
    for a, label in zip(jax.tree.leaves(shapes), jax.tree.leaves(muon))
    if label == 'muon'
  )
  return {
    'muon_matrix_bytes': matrices,
    'temp_bytes': compiled.memory_analysis().temp_size_in_bytes,
    'all_gathers': len(gathers),
    'all_gather_bytes': gathered,
  }


def _prod(dims: str) -> int:
  out = 1
  for d in filter(None, dims.split(',')):
    out *= int(d)
  return out


def _table(results: dict, steps: int) -> list[str]:
  lines = [
    '# Optimizers on llama_tiny',
    '',
    'Written by `scripts/bench_optimizers.py`: experiments/llama_tiny.py trained '
    f'{steps} steps (10 of warmup) by `triax train` on 8 CPU devices (data 2 x tensor 2 x '
    'pipe 2, interleaved 1F1B), the same batches and seed for each optimizer at its usual '
    'settings; held-out loss in nats per byte-level token after the last step; step '
    'time the median of the logged steps on this (2-core) host; state bytes per device '
    'from the compiled train state.',
    '',
    '| optimizer | settings | eval loss | step time (s) | optimizer state per device | '
    'of the parameters |',
    '|---|---|---|---|---|---|',
  ]
  for name, r in results.items():
    settings = ', '.join(
      f'{k.split(".")[1]}={v}' for k, v in r['overrides'].items() if k != 'train.optimizer'
    )
    lines.append(
      f'| {name} | {settings or "as llama_tiny"} | {r["eval_loss"]:.4f} | '
      f'{r["step_time_s"]:.3f} | {r["optimizer_bytes"] / 2**10:.0f} KiB | '
      f'{r["optimizer_bytes"] / r["param_bytes"]:.2f}x |'
    )
  return lines


def _sharded_table(sharded: dict) -> list[str]:
  lines = [
    '',
    '## Muon on sharded matrices (compiled, llama_tiny at d_model 512, 8 x 32 tokens)',
    '',
    "The train step's temporaries per device (XLA's memory_analysis) and the all-gathers of "
    'its optimised program, AdamW against Muon on the same layout. Muon adds what its '
    'Newton-Schulz iterations hold; where the gathers grow, GSPMD gathers the sharded '
    'matrix (or its momentum) for them rather than running a distributed iteration.',
    '',
    f'The matrices Muon orthogonalises, all layers, fp32: '
    f'{next(iter(sharded.values()))["muon"]["muon_matrix_bytes"] / 2**20:.2f} MiB.',
    '',
    '| layout | AdamW temp | Muon temp | Muon - AdamW | all-gathers AdamW -> Muon | '
    'gathered bytes AdamW -> Muon |',
    '|---|---|---|---|---|---|',
  ]
  mib = lambda b: f'{b / 2**20:.2f} MiB'
  for layout, r in sharded.items():
    a, m = r['adamw'], r['muon']
    lines.append(
      f'| {layout} | {mib(a["temp_bytes"])} | {mib(m["temp_bytes"])} | '
      f'{mib(m["temp_bytes"] - a["temp_bytes"])} | {a["all_gathers"]} -> {m["all_gathers"]} | '
      f'{mib(a["all_gather_bytes"])} -> {mib(m["all_gather_bytes"])} |'
    )
  return lines


def main(argv):
  del argv
  results, steps = {}, _STEPS.value
  if _REUSE.value:
    with open(os.path.splitext(_OUT.value)[0] + '.json') as f:
      saved = json.load(f)
    results, steps = saved['results'], saved['steps']
  with tempfile.TemporaryDirectory() as tmp:
    for name in RATES:
      if name not in results:
        results[name] = _train(name, steps, os.path.join(tmp, name))
        print(name, results[name], flush=True)
  bench_harness.force_cpu_devices(8)
  sharded = {layout: {n: _sharded(layout, n) for n in ('adamw', 'muon')} for layout in SHARDED}
  print(sharded, flush=True)
  with open(_OUT.value, 'w') as f:
    f.write('\n'.join(_table(results, steps) + _sharded_table(sharded)) + '\n')
  with open(os.path.splitext(_OUT.value)[0] + '.json', 'w') as f:
    json.dump({'steps': steps, 'results': results, 'sharded': sharded}, f, indent=1)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  app.run(main)
