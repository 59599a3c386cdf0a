"""The learned strategy maker against the search: regret, budgets, times (all SIMULATED).

Trains the learned planner's policy (plan/learned/: a graph network over
layers and device groups, REINFORCE against the simulator) on random
heterogeneous clusters, never the shipped specs, then plans the model on
every shipped spec (experiments/clusters/*.yaml) both ways with the same
analytic profile:

  regret    = predicted step time of the learned plan / the search's best
              (1.00x: it found the search's best; above: worse);
  search s  = the exhaustive search's wall clock; inference s = the
              learned planner's (greedy + sampled plans, priced);

and, on hetero_256 (3 device types, 256 devices: per-stage device-group
choices no enumeration covers), the learned plan against the best the
search finds within the same wall clock as the learned inference (its
layouts in its own order until the time is up), and against the full search.

  .venv/bin/python scripts/bench_learned_planner.py [--steps=240] [--clusters=24] [--samples=63]
      [--out=docs/bench_learned_planner.md] [--policy=experiments/policies/gpt_1b_b64.msgpack]

Model: experiments/gpt_1b.py at batch 64 (1.0B parameters, 20 layers,
d_model 2048, seq 2048, bf16, fp32 Adam state), profile analytic.
dgx_h100 and selene are sized to 64 GPUs (--gpus=64) so that their search
finishes in seconds; cpu_forced_8 is this machine (measured profile only)
and is listed, not planned.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench_harness import ROOT

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from triax import config as config_lib  # noqa: E402
from triax.plan import cluster as cluster_lib  # noqa: E402
from triax.plan.candidate import Options  # noqa: E402
from triax.plan.cost import analytic  # noqa: E402
from triax.plan.learned import catalogue, planner, training  # noqa: E402
from triax.plan.learned import policy as policy_lib  # noqa: E402
from triax.plan.search import evaluate, exhaustive  # noqa: E402
from triax.plan.search import layouts as layouts_lib  # noqa: E402

CLUSTERS = ROOT + '/experiments/clusters'
RESIZE = {'dgx_h100': 64, 'selene': 64}
LARGE = 'hetero_256'
CONFIG = 'batch=64'


def config():
  return config_lib.from_file(os.path.join(ROOT, 'experiments/gpt_1b.py'), CONFIG)


def profile_for(cfg, cluster):
  tensors = sorted({l.tensor for l in layouts_lib.layouts(cfg, cluster.num_devices)})
  return analytic.build(cfg.model, tensors)


def search_within(cfg, cluster, profile, options, budget_s: float):
  """The search's own candidates, layout by layout in its order, until
  budget_s has passed: the fastest plan found that fits and validates."""
  started = time.perf_counter()
  layouts = [l for l in layouts_lib.layouts(cfg, cluster.num_devices) if l.tensor in profile.shards]
  found, done = [], 0
  for layout in layouts:
    if time.perf_counter() - started > budget_s:
      break
    found += evaluate.evaluate(cfg, cluster, profile, options, [layout])
    done += 1
  for e in sorted((e for e in found if not e.oom), key=lambda e: e.step_time):
    if evaluate.valid(cfg, e.plan, cluster.num_devices):
      return e, done, len(layouts), len(found), time.perf_counter() - started
  return None, done, len(layouts), len(found), time.perf_counter() - started


def _ms(e) -> str:
  return f'{e.step_time * 1e3:.1f}' if e else '(none fits)'


def _groups(c) -> str:
  return ' + '.join(f'{g.count}x {g.name}' for g in c.groups.values())


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--steps', type=int, default=240)
  ap.add_argument('--clusters', type=int, default=24)
  ap.add_argument('--samples', type=int, default=63)
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--out', default=os.path.join(ROOT, 'docs/bench_learned_planner.md'))
  ap.add_argument('--policy', default=os.path.join(ROOT, 'experiments/policies/gpt_1b_b64.msgpack'))
  args = ap.parse_args()
  cfg = config()
  options = Options()
  say = lambda line: print(line, file=sys.stderr, flush=True)

  started = time.perf_counter()
  problems = training.training_problems(cfg, args.clusters, args.seed, options)
  built_s = time.perf_counter() - started
  policy, log = training.train(problems, steps=args.steps, seed=args.seed, progress=say)
  policy.meta.update(
    model=training.model_key(cfg),
    steps=args.steps,
    clusters=args.clusters,
    seed=args.seed,
    train_s=round(log.seconds, 1),
  )
  policy_lib.save(policy, args.policy)
  k = max(1, args.steps // 8)
  first, last = sum(log.rewards[:k]) / k, sum(log.rewards[-k:]) / k
  say(f'trained in {log.seconds:.1f} s; mean reward {first:.3f} -> {last:.3f}')

  rows = []
  for name in sorted(os.listdir(CLUSTERS)):
    if not name.endswith('.yaml'):
      continue
    cluster = cluster_lib.load(os.path.join(CLUSTERS, name))
    label = cluster.name
    if cluster.name in RESIZE:
      cluster = cluster_lib.resize(cluster, RESIZE[cluster.name])
      label += f' (--gpus={RESIZE[cluster.name]})'
    if cluster.local:
      rows.append((label, cluster, None))
      continue
    say(f'{label}: search ...')
    prof = profile_for(cfg, cluster)
    if cluster.name == LARGE:
      t0 = time.perf_counter()
      lr = planner.search(
        cfg, cluster, options=options, profile=prof, policy=policy, samples=args.samples
      )
      infer_s = time.perf_counter() - t0
      within = search_within(cfg, cluster, prof, options, infer_s)
      say(f'{label}: full search ...')
      full = exhaustive.search(cfg, cluster, options=options, profile=prof)
      rows.append((label, cluster, (full, lr, infer_s, within)))
      continue
    full = exhaustive.search(cfg, cluster, options=options, profile=prof)
    t0 = time.perf_counter()
    lr = planner.search(
      cfg, cluster, options=options, profile=prof, policy=policy, samples=args.samples
    )
    rows.append((label, cluster, (full, lr, time.perf_counter() - t0, None)))

  m = cfg.model
  lines = [
    '# Learned strategy maker vs the search (SIMULATED)',
    '',
    'Written by `scripts/bench_learned_planner.py` '
    f'(`--steps={args.steps} --clusters={args.clusters} --samples={args.samples} --seed={args.seed}`). '
    f'Model: experiments/gpt_1b.py:{CONFIG} ({m.num_layers} layers, d_model {m.d_model}, '
    f'{m.num_heads} heads, d_ff {m.d_ff}, seq {m.seq_len}, {m.dtype}, global batch '
    f'{cfg.train.global_batch_size}), `--profile=analytic`, lockstep time model. Every time is a '
    'prediction of the same simulator and memory model; both planners use the same profile.',
    '',
    f'Training: {args.clusters} random heterogeneous clusters (1-3 device types of '
    f'{len(catalogue.CATALOGUE)}, figures perturbed, 8-128 devices; none is a shipped spec), '
    f'{args.steps} REINFORCE steps of {training.ROWS} sampled plans: {log.seconds:.1f} s '
    f'(+{built_s:.1f} s building the problems), {log.simulated} distinct plans simulated; mean '
    f'reward (-log step time) of the first {k} steps {first:.3f}, of the last {k} {last:.3f}. '
    f'Policy saved to `{os.path.relpath(args.policy, ROOT)}` '
    f'({os.path.getsize(args.policy) // 1024} KiB) '
    '(`python -m triax plan ... --search=learned --policy=FILE` reuses it).',
    '',
    'Regret = learned plan step time / search best (1.00x = the same; higher = the learned '
    'plan is slower). Inference = greedy plan + '
    f'{args.samples} samples (half at temperature {training.INFER_TEMPERATURES[0]}, half at '
    f"{training.INFER_TEMPERATURES[1]}), each priced with the layer split of the search's "
    "partitioner; (plans) = distinct plans priced. Both wall clocks include each planner's "
    "baselines (plan/search/baselines.py; the exhaustive search's: the whole search again as if every device were the slowest; the "
    "learned one's: the policy on that cluster, and the data-parallel layouts), and exclude "
    'loading the policy.',
    '',
    'What the learned planner decides: tensor, pipe, micro-batches, schedule and v, remat, '
    'state sharding (where the search has it), and the device group of every stage. What it '
    "does not: the layer split (the search's partitioner, even or balanced, whichever is "
    'faster).',
    '',
    '| cluster | devices | search best | search ms | search s (plans) | learned plan | '
    'learned ms | regret | inference s (plans) |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  regrets = []
  large = None
  for label, cluster, res in rows:
    if res is None:
      lines.append(
        f'| {label} | {cluster.num_devices} | not planned: a measured (profile: local) spec, '
        'no data-sheet figures for the analytic profile | | | | | | |'
      )
      continue
    full, lr, infer_s, within = res
    best = full.top[0] if full.top else None
    mine = lr.top[0] if lr.top else None
    regret = mine.step_time / best.step_time if best and mine else None
    if regret:
      regrets.append(regret)
    lines.append(
      f'| {label} | {cluster.num_devices} ({_groups(cluster)}) | '
      f'{best.plan.describe() if best else "-"} | {_ms(best)} | {full.search_s:.1f} ({full.evaluated}) | '
      f'{mine.plan.describe() if mine else "-"} | {_ms(mine)} | '
      f'{f"{regret:.2f}x" if regret else "-"} | {infer_s:.1f} ({lr.evaluated}) |'
    )
    if within is not None:
      large = (label, cluster, full, mine, infer_s, within)
  if regrets:
    lines += [
      '',
      f'Mean regret over the planned clusters: {sum(regrets) / len(regrets):.2f}x; worst '
      f'{max(regrets):.2f}x; the learned plan matches or beats the search on '
      f'{sum(r <= 1.0 + 1e-9 for r in regrets)} of {len(regrets)}.',
    ]
  if large:
    label, cluster, full, mine, infer_s, (within_e, done, total, plans, spent) = large
    best = full.top[0] if full.top else None
    lines += [
      '',
      f'## {label}: {cluster.num_devices} devices, {_groups(cluster)}, {len(cluster.nodes)} nodes',
      '',
      "The learned planner chooses each stage's device group (3^p ways for p stages, on top of "
      'every layout); the search tries three device orders per layout (fastest first, node order, '
      'slowest first). Same wall clock: the search runs its layouts in its own order until the '
      "learned planner's inference time has passed.",
      '',
      '| planner | wall clock s | plan | step ms | vs learned |',
      '|---|---|---|---|---|',
      f'| learned (greedy + {args.samples} samples) | {infer_s:.1f} | '
      f'{mine.plan.describe() if mine else "-"} | {_ms(mine)} | 1.00x |',
      f'| search within {infer_s:.1f} s ({done} of {total} layouts, {plans} plans) | {spent:.1f} | '
      f'{within_e.plan.describe() if within_e else "-"} | {_ms(within_e)} | '
      f'{f"{within_e.step_time / mine.step_time:.2f}x" if within_e and mine else "-"} |',
      f'| full search ({full.evaluated} plans) | {full.search_s:.1f} | '
      f'{best.plan.describe() if best else "-"} | {_ms(best)} | '
      f'{f"{best.step_time / mine.step_time:.2f}x" if best and mine else "-"} |',
      '',
      '"vs learned" = that planner\'s step time over the learned plan\'s (below 1: the search '
      'plan is faster). The search enumerates data degrees from 1 up, so a short budget sees only '
      'its most pipelined and tensor-split layouts; an ordering made for budgets (or the '
      'learned plan as its first candidate) was not tried. Its full run is not a global optimum '
      'either: three device orders per layout, not every per-stage choice of device group.',
    ]
    if mine:
      groups = [
        '/'.join(sorted({cluster.devices[d].group for d in stage})) for stage in mine.plan.stages
      ]
      lines.append(f"\nLearned plan's stages (device group per stage): {', '.join(groups)}.")
  lines.append('')
  with open(args.out, 'w') as f:
    f.write('\n'.join(lines))
  say(f'wrote {args.out} in {time.perf_counter() - started:.0f} s')


if __name__ == '__main__':
  main()
