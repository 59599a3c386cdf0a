"""How long the small experiments take at their full length on 8 CPU devices:
writes docs/bench_experiments.md.

    .venv/bin/python scripts/bench_experiments.py [--experiments=deepseek_tiny,gemma3_tiny]

Each named experiment (experiments/NAME.py, as written: its mesh, schedule and
steps) trains once in a fresh workdir through `python -m triax train
--cpu_devices=8`, one after another. A row is the run's wall time, the
process's CPU seconds (other load stretches wall time, not CPU time), the
goodput ledger's compile and productive parts (training/goodput.py), the
share of the machine's cores the run had, and
the first and last logged training losses and every eval loss from
metrics.jsonl. Rows of experiments not
named keep their last figures. A benchmark, not a test: the seconds are
this machine's, under its load at the time, which the row records.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from bench_harness import ROOT, doc_sections, fail, run_python

from triax import config
from triax.training import goodput, metrics

DOC = os.path.join(ROOT, 'docs', 'bench_experiments.md')
TITLE = 'Full-length runs on 8 CPU devices'
# The experiments the issues name as training "in minutes" on the 8 CPU devices.
DEFAULT = ('deepseek_tiny', 'gemma3_tiny', 'qwen3_tiny', 'qwen3_moe_tiny')
HEADER = (
  '| experiment | layout | steps | wall min | CPU min | compile s | step s | '
  'train loss first -> last | eval loss (step) | CPU share |'
)


def _layout(c) -> str:
  """The mesh and schedule a row ran, in the config's own terms."""
  m, p = c.mesh, c.pipeline
  axes = [f'{a} {getattr(m, a)}' for a in ('data', 'fsdp', 'tensor', 'pipe') if getattr(m, a) > 1]
  text = ' x '.join(axes) or 'one device'
  if m.expert > 1:
    text += f', experts over {m.expert}'
  if m.pipe > 1:
    fused = ' fused' if p.fuse_overlaps else ''
    text += f', {p.schedule}{fused} v={p.virtual_stages} m={p.microbatches}'
  return text


def _run(name: str) -> str:
  """Trains experiments/NAME.py once; its table row."""
  path = os.path.join(ROOT, 'experiments', f'{name}.py')
  c = config.from_file(path)
  with tempfile.TemporaryDirectory() as tmp:
    workdir = os.path.join(tmp, 'w')
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    args = ['-m', 'triax', 'train', f'--config={path}', f'--workdir={workdir}']
    run_python([*args, '--cpu_devices=8', '--progress=false'], drop_device_count=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    ledger = goodput.ledger(workdir)
    lines = metrics.read_metrics(workdir)
  losses = [m['loss'] for m in lines if 'loss' in m]
  evals = [(m['step'], m['eval_loss']) for m in lines if 'eval_loss' in m]
  steps = c.train.steps
  step_s = ledger.totals['productive'] / steps
  return (
    f'| {name} | {_layout(c)} | {steps} | {wall / 60:.1f} | {cpu / 60:.1f} | '
    f'{ledger.totals["compile"]:.1f} | {step_s:.2f} | {losses[0]:.3f} -> {losses[-1]:.3f} | '
    f'{", ".join(f"{e:.3f} ({step})" for step, e in evals)} | '
    f'{cpu / (wall * os.cpu_count()):.2f} |'
  )


def _write(rows: dict[str, str]) -> None:
  lines = [
    '# The small experiments at full length',
    '',
    'Written by scripts/bench_experiments.py.',
    '',
    f'## {TITLE}',
    '',
    'Each experiment as written (experiments/NAME.py), trained once from a fresh workdir '
    'with `python -m triax train --cpu_devices=8` on this 2-core machine. wall: the '
    "process's time, start-up and compiles included; CPU: its CPU time (both cores); "
    "compile and step: the run's goodput ledger (compile time; productive time over the "
    "steps); the losses are metrics.jsonl's. CPU share: the run's CPU time over its wall time "
    "times the machine's cores (1.00: it kept every core busy the whole run; less: its "
    'single-threaded parts, start-up and compiles, or other work sharing the cores, which '
    'stretches wall time but not CPU time).',
    '',
    HEADER,
    '|---|---|---|---|---|---|---|---|---|---|',
    *(rows[name] for name in sorted(rows)),
  ]
  with open(DOC, 'w') as f:
    f.write('\n'.join(lines) + '\n')


def _stored() -> dict[str, str]:
  """The rows the page holds now, by experiment."""
  rows = {}
  for line in doc_sections(DOC).get(TITLE, []):
    cells = [cell.strip() for cell in line.strip('|').split('|')]
    if line.startswith('| ') and len(cells) > 1 and cells[0] not in ('experiment', '---'):
      rows[cells[0]] = line
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--experiments', default=','.join(DEFAULT))
  args = parser.parse_args()
  names = args.experiments.split(',')
  for name in names:  # every name checked before the first run
    if not os.path.exists(os.path.join(ROOT, 'experiments', f'{name}.py')):
      fail('--experiments', f'no experiments/{name}.py; name one that exists')
  rows = _stored()
  for name in names:
    rows[name] = _run(name)
    print(rows[name], flush=True)
    _write(rows)  # each finished run lands at once: a later one may take many minutes


if __name__ == '__main__':
  main()
