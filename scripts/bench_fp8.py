"""FP8 weight matmuls against bf16 from the same seed: writes docs/bench_fp8.md,
docs/bench_fp8.png and docs/bench_fp8.json (issue 55's numerics on CPU).

    .venv/bin/python scripts/bench_fp8.py [--steps=200] [--experiments=llama_tiny,mixtral_tiny]
        [--recipes=none,tensorwise,rowwise,delayed] [--fp8_grads=e5m2,e4m3] [--spread] [--fp32]
        [--smoke]
        [--out=docs/bench_fp8.md] [--report_only]

Each named experiment (experiments/NAME.py, its own mesh and schedule) trains once per
model.fp8 recipe through `python -m triax train --cpu_devices=8`, each in a fresh
workdir: bfloat16 compute over float32 parameters, the same seed, hence the same
initial parameters and batches; `none` is the bf16 reference. A row is the last eval
loss, its difference to bf16's relative to it (the issue's goal: within 2%), and the
median logged step time. --fp8_grads: the FP8 recipes' cotangent formats
(model.fp8_grad), each FP8 recipe once per format; a run in e4m3 is its own row,
`RECIPE, e4m3 grads`. --spread adds bf16 once more on another layout of the same
devices (`_other_layout`): the same arithmetic with its sums in another order, whose
distance from bf16 is how far this experiment's eval loss moves under a perturbation
that changes no precision, the yardstick an FP8 row is read against. --fp32 adds recipe
none with float32 compute: where bf16's own roundings take the loss. The figure draws
each run's training loss, the recipes of an experiment overlaid, and each curve's
difference to bf16's beneath.

The .json holds every row and its curve: rerunning some experiments or recipes keeps
the others, as long as --steps and --smoke match theirs (otherwise it starts over).
--smoke trains the experiments' `:smoke` configs (a few steps) into a temporary folder
unless --out names one: a check of this script, not of FP8. --report_only trains
nothing and writes the report and figure from the .json's runs.

model.fp8_metrics stays off: it is refused under a pipeline (llama_tiny's pipe 2), and
the losses are what the issue asks about. Every recipe runs on the experiment's own layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from bench_harness import ROOT, fail, run_python

from triax import config
from triax.training import metrics

# The --spread run's key among an experiment's recipes: recipe none on another layout.
SPREAD = 'none, other layout'
# The --fp32 run's key: recipe none with float32 compute.
FP32 = 'none, fp32 compute'
# The rows an FP8 row is read against, with no verdict of their own.
YARDSTICKS = (SPREAD, FP32)
# One colour per recipe in both panels of the figure; its e4m3-gradient run dashed.
COLORS = {
  'none': 'black',
  'tensorwise': 'tab:orange',
  'rowwise': 'tab:blue',
  'delayed': 'tab:green',
  SPREAD: 'gray',
  FP32: 'tab:purple',
}
DEFAULT_EXPERIMENTS = ('llama_tiny', 'mixtral_tiny')
# model.fp8_grad's default: a run in it is keyed by its recipe alone.
DEFAULT_GRAD = config.FP8_GRADS[0]


def _key(recipe: str, grad: str) -> str:
  """A run's key among an experiment's runs: its recipe, and the gradient format if not e5m2."""
  return recipe if grad == DEFAULT_GRAD else f'{recipe}, {grad} grads'


def _parse(key: str) -> tuple[str, str]:
  """(model.fp8, model.fp8_grad) of a run's key (`_key`; SPREAD's is none's)."""
  if key in YARDSTICKS:
    return 'none', DEFAULT_GRAD
  recipe, _, grad = key.partition(', ')
  return recipe, grad.removesuffix(' grads') or DEFAULT_GRAD


# The rows' order: bf16, its spread, then the FP8 recipes, each in every gradient format.
ORDER = (
  'none',
  *YARDSTICKS,
  *(_key(r, g) for r in config.FP8_RECIPES[1:] for g in config.FP8_GRADS),
)
# The bound on the FP8 eval loss's distance from bf16's, relative to bf16's.
TOLERANCE = 0.02
# Evaluations per run: eval_every is steps over this (50 at 200 steps).
EVALS = 4
HEADER = '| experiment | mesh | recipe | eval loss | vs bf16 | within 2% | step s | step vs bf16 |'


def _args(argv: list[str] | None = None) -> argparse.Namespace:
  """The flags, each checked here: a bad one ends the script before any training."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=None, help="200, or the :smoke config's")
  parser.add_argument('--experiments', default=','.join(DEFAULT_EXPERIMENTS))
  parser.add_argument('--recipes', default=','.join(config.FP8_RECIPES))
  parser.add_argument(
    '--fp8_grads', default=DEFAULT_GRAD, help="the FP8 recipes' model.fp8_grad, comma-separated"
  )
  parser.add_argument(
    '--spread', action='store_true', help='also bf16 on another layout: its distance from bf16'
  )
  parser.add_argument(
    '--fp32', action='store_true', help='also bf16 with float32 compute: where its roundings go'
  )
  parser.add_argument('--smoke', action='store_true', help="the experiments' :smoke configs")
  parser.add_argument('--out', default=None, help='the report (.md; .png and .json beside it)')
  parser.add_argument(
    '--report_only',
    action='store_true',
    help='train nothing: write the report and figure from the runs the .json holds '
    '(after a run cut short, which keeps each finished run there)',
  )
  args = parser.parse_args(argv)
  if args.steps is not None and args.steps < 2:
    fail('--steps', f'must be >= 2 (a first step compiles, the rest are timed), got {args.steps}')
  args.experiments = [n for n in args.experiments.split(',') if n]
  for name in args.experiments:
    if not os.path.exists(os.path.join(ROOT, 'experiments', f'{name}.py')):
      fail('--experiments', f'no experiments/{name}.py; name ones that exist, comma-separated')
  if not args.experiments:
    fail('--experiments', 'name at least one, e.g. llama_tiny')
  args.recipes = [r for r in args.recipes.split(',') if r]
  for recipe in args.recipes:
    if recipe not in config.FP8_RECIPES:
      fail('--recipes', f'unknown recipe {recipe!r}; choose from {", ".join(config.FP8_RECIPES)}')
  if not args.recipes and not args.spread and not args.fp32:
    fail('--recipes', 'name at least one, e.g. none,rowwise (or --spread or --fp32 alone)')
  args.fp8_grads = [g for g in args.fp8_grads.split(',') if g]
  for grad in args.fp8_grads:
    if grad not in config.FP8_GRADS:
      fail('--fp8_grads', f'unknown format {grad!r}; choose from {", ".join(config.FP8_GRADS)}')
  if not args.fp8_grads:
    fail('--fp8_grads', 'name at least one, e.g. e5m2')
  args.runs = (
    [_key(r, g) for r in args.recipes for g in ([DEFAULT_GRAD] if r == 'none' else args.fp8_grads)]
    + [SPREAD] * args.spread
    + [FP32] * args.fp32
  )
  if args.spread:
    for name in args.experiments:
      if not _other_layout(_config(name, args.smoke)):
        fail('--spread', f'{name} runs on one device: there is no other layout to compare')
  if args.out is None:
    folder = tempfile.mkdtemp(prefix='triax-bench-fp8-') if args.smoke else 'docs'
    args.out = os.path.join(ROOT, folder, 'bench_fp8.md')
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  return args


def _config_arg(name: str, smoke: bool) -> str:
  return f'experiments/{name}.py' + (':smoke' if smoke else '')


def _config(name: str, smoke: bool):
  """experiments/NAME.py's config as the run reads it, before the overrides."""
  return config.from_file(
    os.path.join(ROOT, 'experiments', f'{name}.py'), 'smoke' if smoke else None
  )


def _steps(name: str, args: argparse.Namespace) -> int:
  """The run's length: --steps, else 200 (the issue's), or the :smoke config's."""
  if args.steps is not None:
    return args.steps
  return _config(name, True).train.steps if args.smoke else 200


def _mesh(c) -> str:
  """The run's mesh in the config's terms: whether it pipelines, and over what."""
  m = c.mesh
  text = f'data {m.data} x tensor {m.tensor} x pipe {m.pipe}'
  return text + (f', experts over {m.expert}' if m.expert > 1 else '')


def _pipe_folded(c) -> dict:
  """The experiment's pipe folded into data: one micro-batch, one chunk per stage."""
  m = c.mesh
  return {
    'mesh.data': m.data * m.pipe,
    'mesh.pipe': 1,
    'pipeline.microbatches': 1,
    'pipeline.virtual_stages': 1,
    'pipeline.schedule': '1f1b',
  }


def _other_layout(c) -> dict:
  """--spread's layout of the experiment's devices: a pipeline folded into data
  (`_pipe_folded`), else the experts unsplit, else tensor folded into data; {} on one device."""
  m = c.mesh
  if m.pipe > 1:
    return _pipe_folded(c)
  if m.expert > 1:
    return {'mesh.expert': 1}
  if m.tensor > 1:
    return {'mesh.data': m.data * m.tensor, 'mesh.tensor': 1}
  return {}


def _train(name: str, run: str, steps: int, smoke: bool, workdir: str) -> dict:
  """One run's figures from its metrics.jsonl: the curves and the median step time.
  `run`: a key of `_key`'s, SPREAD (none on `_other_layout`) or FP32."""
  c = _config(name, smoke)
  recipe, grad = _parse(run)
  layout = _other_layout(c) if run == SPREAD else {}
  for key, value in layout.items():
    config.set_dotted(c, key, value)
  overrides = {
    **layout,
    'train.steps': steps,
    'model.dtype': 'float32' if run == FP32 else 'bfloat16',
    'model.param_dtype': 'float32',
    'model.fp8': recipe,
    **({} if grad == DEFAULT_GRAD else {'model.fp8_grad': grad}),
    'train.eval_every': max(1, steps // EVALS),
    'train.log_every': 1,  # every step's loss for the curves, and a step time each
    'checkpoint.every_steps': 0,  # one save at the end: not the numerics' business
  }
  args = [
    '-m',
    'triax',
    'train',
    f'--config={_config_arg(name, smoke)}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    *(f'--config.{key}={value}' for key, value in overrides.items()),
  ]
  done = run_python(args, drop_device_count=True)
  if done.returncode != 0:
    sys.exit(f'error: {name} with {run} failed:\n{done.stderr[-4000:]}')
  records = metrics.read_metrics(workdir)
  logged = [r for r in records if 'step_time_s' in r]
  return {
    'mesh': _mesh(c),
    'loss': [[r['step'], round(r['loss'], 5)] for r in logged],
    'eval': [[r['step'], r['eval_loss']] for r in records if 'eval_loss' in r],
    # The first logged step holds the compile: the median leaves it out.
    'step_time_s': statistics.median(r['step_time_s'] for r in logged[1:]),
  }


def _load(path: str, steps: dict[str, int], smoke: bool) -> dict:
  """The stored runs this invocation keeps: none if --smoke differs from theirs, and
  of the experiments it reruns only those of the same length (`steps`)."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    saved = json.load(f)
  if saved.get('smoke') != smoke:
    return {}
  runs = saved['runs']
  return {n: runs[n] for n in runs if n not in steps or runs[n]['steps'] == steps[n]}


def _row(name: str, recipe: str, run: dict, ref: dict | None) -> str:
  """One table row; the bf16 reference `ref` of the same experiment, if there is one."""
  loss = run['eval'][-1][1]
  if recipe == 'none':
    versus, verdict = 'reference', '-'
  elif ref is None:
    versus, verdict = 'no bf16 row', '-'
  else:
    rel = loss / ref['eval'][-1][1] - 1
    versus, verdict = f'{rel:+.2%}', 'PASS' if abs(rel) <= TOLERANCE else 'over'
    verdict = '-' if recipe in YARDSTICKS else verdict  # a yardstick, not a candidate
  # Seconds from different invocations met different loads: compare within one only.
  same = ref is not None and ref['invocation'] == run['invocation']
  ratio = f'{run["step_time_s"] / ref["step_time_s"]:.2f}x' if same else '-'
  return (
    f'| {name} | {run["mesh"]} | {recipe} | {loss:.4f} | {versus} | {verdict} | '
    f'{run["step_time_s"]:.3f} | {ratio} |'
  )


def _doc(runs: dict, png: str) -> str:
  lines = [
    '# FP8 weight matmuls against bf16 on CPU',
    '',
    'Written by `scripts/bench_fp8.py` (issue 55). Each experiment trained by '
    '`python -m triax train --cpu_devices=8` with its own mesh and schedule, model.dtype='
    'bfloat16 over float32 parameters, once per model.fp8 recipe from the same seed (the '
    'same initial parameters and batches). eval loss: the held-out loss after the last '
    "step, nats per byte-level token; vs bf16: its difference to recipe none's, relative "
    "to it; within 2%: the issue's goal. step s: the median logged step time on this "
    "2-core machine, shared with other work: the seconds are this machine's, and the "
    'ratio to bf16 is given only between runs of one invocation of the script. XLA:CPU '
    'converts FP8 operands up and multiplies in float32 (its optimised HLO), so here FP8 '
    "only adds the scaling and casts: its step time says nothing of a GPU's. model.fp8 "
    "covers every weight matmul, mixtral_tiny's routed experts included; the router, "
    'attention core and head stay in bf16.',
    '',
    "Both recipes' scales are powers of two, and multiplying by one changes no value's "
    "rounding to E4M3 or E5M2 except where it falls below the format's normal range "
    '(in E4M3 about 2^-15 of the amax it is scaled by): rowwise and tensorwise differ '
    "only through such small values, so equal rows mean no operand's values spanned that "
    'much.',
    '',
    f'{SPREAD} (where present): bf16 again on another layout of the same devices, the same '
    'arithmetic with its sums in another order. Its distance from bf16 is what a '
    'perturbation that changes no precision does to this eval loss: an FP8 row no '
    'further off is as close to bf16 as bf16 is to itself.',
    '',
    f'{FP32} (where present): recipe none with model.dtype=float32, the same run without '
    "bf16's roundings: which side of bf16 the exact arithmetic lies, for an FP8 row that "
    'ends below it.',
    '',
    'RECIPE, e4m3 grads (where present): the same recipe with model.fp8_grad=e4m3, the '
    "backward's cotangents in E4M3 (3 mantissa bits, max 448) rather than E5M2 (2 bits, max "
    "57344) in both backward GEMMs: DeepSeek-V3's format for them. Dashed in the figure.",
  ]
  for name in sorted(runs):
    recipes = runs[name]['recipes']
    first = next(iter(recipes.values()))
    lines += ['', f'## {name}, {runs[name]["steps"]} steps', '', HEADER, '|---' * 8 + '|']
    evals = ', '.join(str(step) for step, _ in first['eval'])
    for recipe in ORDER:
      if recipe in recipes:
        lines.append(_row(name, recipe, recipes[recipe], recipes.get('none')))
    lines += ['', f'Evaluated at steps {evals}.']
  lines += ['', f'![training loss per recipe, and FP8 minus bf16]({os.path.basename(png)})']
  return '\n'.join(lines) + '\n'


def _plot(runs: dict, path: str) -> None:
  """Per experiment: the recipes' training losses overlaid, and each FP8 minus bf16 below."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  names = sorted(runs)
  fig, axes = plt.subplots(
    2,
    len(names),
    figsize=(5.5 * len(names), 6),
    squeeze=False,
    sharex='col',
    gridspec_kw={'height_ratios': [2, 1]},
  )
  for col, name in enumerate(names):
    recipes = runs[name]['recipes']
    ref = dict(map(tuple, recipes['none']['loss'])) if 'none' in recipes else {}
    top, bottom = axes[0][col], axes[1][col]
    for recipe in ORDER:
      if recipe not in recipes:
        continue
      steps, losses = zip(*recipes[recipe]['loss'])
      label = {'none': 'bf16', SPREAD: 'bf16, other layout', FP32: 'fp32 compute'}.get(
        recipe, f'fp8 {recipe}'
      )
      scaling, grad = _parse(recipe)
      style = {
        'linewidth': 1,
        'color': COLORS[recipe if recipe in YARDSTICKS else scaling],
        'linestyle': '-' if grad == DEFAULT_GRAD else '--',
      }
      top.plot(steps, losses, label=label, **style)
      if recipe != 'none' and ref:  # FP8's distance from bf16, and the yardsticks'
        diff = [(s, v - ref[s]) for s, v in zip(steps, losses) if s in ref]
        bottom.plot(*zip(*diff), label=label, **style)
    top.set_title(f'{name}: training loss')
    top.set_ylabel('loss (nats per byte)')
    top.legend()
    bottom.axhline(0, color='gray', linewidth=0.5)
    bottom.set_ylabel('minus bf16')
    bottom.set_xlabel('step')
    bottom.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> None:
  args = _args(argv)
  stem = os.path.splitext(args.out)[0]
  steps = {name: _steps(name, args) for name in args.experiments}
  runs = _load(stem + '.json', steps, args.smoke)
  invocation = time.strftime('%Y-%m-%dT%H:%M:%S')
  for name in [] if args.report_only else args.experiments:
    runs.setdefault(name, {'steps': steps[name], 'recipes': {}})
    for key in args.runs:
      with tempfile.TemporaryDirectory() as tmp:
        run = _train(name, key, steps[name], args.smoke, os.path.join(tmp, 'w'))
      runs[name]['recipes'][key] = {**run, 'invocation': invocation}
      print(_row(name, key, runs[name]['recipes'][key], runs[name]['recipes'].get('none')))
      # Each finished run lands at once: the next may take minutes.
      with open(stem + '.json', 'w') as f:
        json.dump({'smoke': args.smoke, 'runs': runs}, f, indent=1)
  _plot(runs, stem + '.png')
  with open(args.out, 'w') as f:
    f.write(_doc(runs, stem + '.png'))
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
