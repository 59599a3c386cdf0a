"""A mixture of experts against the dense model of the same active parameters.

Trains experiments/llama_tiny.py (dense) and experiments/mixtral_tiny.py
(its MLP as 8 experts of half the width, top-2: the parameters a token uses
are llama_tiny's plus the router) on the same data, batches, steps and
learning-rate schedule, each through `triax train` on 8 CPU devices, and
writes docs/bench_moe_dense.md: the held-out loss of both at every
evaluation (the same tokens seen), and each model's parameter counts. Losses
are deterministic; nothing here is timed.

  python scripts/bench_moe_dense.py [--steps=300]
"""

from __future__ import annotations

import json
import os
import re
import tempfile

from absl import app, flags
from bench_harness import ROOT, run_python

_STEPS = flags.DEFINE_integer('steps', 300, 'Training steps of each model.')
_OUT = flags.DEFINE_string('out', os.path.join(ROOT, 'docs', 'bench_moe_dense.md'), 'Report.')

RUNS = (('dense', 'llama_tiny.py'), ('moe', 'mixtral_tiny.py'))


def _train(experiment: str, steps: int, workdir: str) -> tuple[dict[int, float], str]:
  """({step: eval loss}, the start-up line naming the parameter counts) of one run."""
  args = [
    '-m',
    'triax',
    'train',
    f'--config=experiments/{experiment}:steps={steps}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
  ]
  out = run_python(args, check=True)
  start = next(line for line in out.stdout.splitlines() if line.startswith('triax:'))
  evals = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      record = json.loads(line)
      if 'eval_loss' in record:
        evals[record['step']] = record['eval_loss']
  return evals, start


def main(argv):
  del argv
  results, params = {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, experiment in RUNS:
      results[name], start = _train(experiment, _STEPS.value, os.path.join(tmp, name))
      params[name] = re.match(r'triax: ([^;]*);', start).group(1)
      print(name, params[name], results[name], flush=True)
  steps = sorted(set(results['dense']) & set(results['moe']))
  lines = [
    '# A mixture of experts against the dense model of the same active parameters',
    '',
    'Written by `scripts/bench_moe_dense.py`: experiments/llama_tiny.py (dense) and '
    'experiments/mixtral_tiny.py (8 experts of half the MLP width, top-2) trained '
    f'{_STEPS.value} steps each by `triax train` on 8 CPU devices, the same batches in the '
    'same order; held-out loss (nats per byte-level token) at each evaluation.',
    '',
    f'- dense: {params["dense"]}',
    f'- moe: {params["moe"]}',
    '',
    '| step | dense eval loss | moe eval loss | moe - dense |',
    '|---|---|---|---|',
  ]
  for step in steps:
    d, m = results['dense'][step], results['moe'][step]
    lines.append(f'| {step} | {d:.4f} | {m:.4f} | {m - d:+.4f} |')
  with open(_OUT.value, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  app.run(main)
