"""The bubble-memory frontier of synthesised schedules, beside the named ones.

  .venv/bin/python scripts/bench_synthesis.py [--stages=8] [--microbatches=32] \
      [--virtual_stages=1,2] [--time_limit_s=10] [--out=docs/bench_synthesis.md]

Under unit costs (t_F = t_B = t_W = 1), for each v: `synthesis.run` at every
memory limit K from `synthesis.least_memory` up, until the makespan meets
the memory-free lower bound or stops improving; each point's asynchronous
makespan and bubble, lockstep ticks and the residual sets a stage holds at
its peak in the lowered program. Beside them every named schedule at each v
in {1, 2} that builds, its fused backward split as the synthesiser's is,
and whether a synthesised schedule holding no more is at least as fast.
Writes the Markdown report and, next to it, `<out>_frontier.png`.
"""

import math
import os
import shlex
import sys
import time

from absl import app, flags
from bench_harness import ROOT

_STAGES = flags.DEFINE_integer('stages', 8, 'Pipeline stages p.')
_MICROBATCHES = flags.DEFINE_integer('microbatches', 32, 'Micro-batches m.')
_VIRTUAL = flags.DEFINE_list('virtual_stages', ['1', '2'], 'Chunks per stage v, one frontier each.')
_TIME_LIMIT = flags.DEFINE_float('time_limit_s', 10.0, 'Solver time limit per memory limit K.')
_OUT = flags.DEFINE_string('out', 'docs/bench_synthesis.md', 'Markdown report to write.')

# Limits past the last improvement tried before calling the frontier flat:
# the heuristic is not monotone in K, and a named schedule returned at a small
# K (BPipe's moves) holds the makespan flat for a few limits more.
PATIENCE = 3
# Named schedules are built at these v whatever the frontiers run: the
# single-chunk builders take v = 1, the chunked ones v = 2.
NAMED_V = (1, 2)
EPS = 1e-9


def unit_costs():
  from triax.pipeline.simulate import Costs

  return Costs.design_point(split=True)


def memory_free_bound(p, m, v, costs):
  """The least makespan any schedule can take, memory aside (both placements
  the synthesiser tries for v = 2)."""
  from triax.pipeline.ir import interleaved_placement, v_placement
  from triax.pipeline.synthesis.problem import Problem, lower_bound

  placements = [interleaved_placement(p, v)] + ([v_placement(p)] if v == 2 else [])
  return min(lower_bound(Problem(p, m, v, pl, m * v, costs)) for pl in placements)


def held(schedule):
  """A stage's peak residual sets in the lowered (executor's) program."""
  from triax.pipeline import schedule as sched

  return max(sched.lower(schedule).peaks['stash'])


def synthesised_point(p, m, v, k, costs, time_limit_s):
  from triax.pipeline import synthesis
  from triax.pipeline.simulate import simulate_async

  found = synthesis.run(p, m, v, k, costs, time_limit_s=time_limit_s, method='auto')
  timed = simulate_async(found.schedule, costs)
  return {
    'v': v,
    'k': k,
    'held': held(found.schedule),
    'makespan': found.async_time,
    'lockstep': found.lockstep.total_time,
    'bubble': timed.bubble_fraction,
    'optimal': found.optimal,
    'method': found.method,
  }


def frontier(p, m, v, costs, time_limit_s):
  """Synthesised points from the least K up, until the makespan meets the
  memory-free bound or has not improved for PATIENCE limits."""
  from triax.pipeline import synthesis

  bound = memory_free_bound(p, m, v, costs)
  points, best, flat = [], float('inf'), 0
  for k in range(synthesis.least_memory(p, m, v), m * v + 1):
    point = synthesised_point(p, m, v, k, costs, time_limit_s)
    points.append(point)
    print(f'v={v} K={k}: {point}', flush=True)
    flat = flat + 1 if point['makespan'] >= best - EPS else 0
    best = min(best, point['makespan'])
    if best <= bound + EPS or flat >= PATIENCE:
      break
  return points, bound


def named_points(p, m, costs):
  """Every named schedule that builds at a v in NAMED_V, timed with its
  backward split (as tests/test_synthesize.py compares them)."""
  from triax.errors import ConfigError
  from triax.pipeline import schedule as sched
  from triax.pipeline.simulate import simulate_async, simulate_lockstep

  rows = []
  for v in NAMED_V:
    for name in sched.SCHEDULES:
      try:
        built = sched.build(name, p, m, v)
      except ConfigError:
        continue
      split = sched.with_split_backward(built)
      timed = simulate_async(split, costs)
      rows.append(
        {
          'name': name,
          'v': v,
          'held': held(built),
          'makespan': timed.total_time,
          'lockstep': simulate_lockstep(sched.lower(split), costs).total_time,
          'bubble': timed.bubble_fraction,
          'fused': not built.split_backward,
          'evicts': bool(built.evicted),
        }
      )
  return rows


def best_within(points, held_limit):
  """The fastest synthesised point holding at most held_limit, or None."""
  within = [q for q in points if q['held'] <= held_limit]
  return min(within, key=lambda q: q['makespan']) if within else None


def compare(row, frontiers):
  """'below' if the named schedule beats every synthesised point holding no
  more, 'on/above' if one matches or beats it, None if not comparable."""
  if row['v'] not in frontiers:
    return None
  best = best_within(frontiers[row['v']][0], row['held'])
  if best is None:
    return 'below'
  return 'below' if row['makespan'] < best['makespan'] - EPS else 'on/above'


def synthesised_table(frontiers):
  lines = [
    '| v | K | held | makespan | lockstep ticks | bubble | optimal | method |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for v, (points, _) in frontiers.items():
    for q in points:
      lines.append(
        f'| {v} | {q["k"]} | {q["held"]} | {q["makespan"]:g} | {q["lockstep"]:g} '
        f'| {q["bubble"]:.3f} | {"yes" if q["optimal"] else "no"} | {q["method"]} |'
      )
  return lines


def named_table(rows, frontiers):
  lines = [
    '| schedule | v | backward | held | makespan | lockstep ticks | bubble '
    '| best synthesised within held | vs frontier |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    verdict = compare(r, frontiers)
    best = best_within(frontiers[r['v']][0], r['held']) if r['v'] in frontiers else None
    best_cell = f'{best["makespan"]:g} (K={best["k"]})' if best else '-'
    lines.append(
      f'| {r["name"]} | {r["v"]} | {"fused (timed split)" if r["fused"] else "split"} | {r["held"]} '
      f'| {r["makespan"]:g} | {r["lockstep"]:g} | {r["bubble"]:.3f} | {best_cell} '
      f'| {verdict or "no frontier at this v"} |'
    )
  return lines


def summary(frontiers, rows):
  """One paragraph, every figure from the measurements."""
  parts = []
  for v, (points, bound) in frontiers.items():
    first = points[0]
    floor = min(points, key=lambda q: (q['makespan'], q['held']))
    reached = 'meets' if floor['makespan'] <= bound + EPS else 'stays above'
    parts.append(
      f'At v = {v} the least memory, K = {first["k"]}, costs a bubble of {first["bubble"]:.3f} '
      f'(makespan {first["makespan"]:g}); the bubble falls to {floor["bubble"]:.3f} '
      f'(makespan {floor["makespan"]:g}) at K = {floor["k"]}, {floor["held"]} sets held, which '
      f'{reached} the memory-free lower bound of {bound:g}.'
    )
  verdicts = [(r, compare(r, frontiers)) for r in rows]
  compared = [(r, c) for r, c in verdicts if c is not None]
  below = [r for r, c in compared if c == 'below']
  if below:
    names = ', '.join(f'{r["name"]} (v = {r["v"]})' for r in below)
    parts.append(
      f'{len(below)} of {len(compared)} named schedules lie below the frontier: {names}.'
    )
  else:
    gains = [
      (r['makespan'] - best_within(frontiers[r['v']][0], r['held'])['makespan'], r)
      for r, _ in compared
    ]
    gain, r = max(gains, key=lambda x: x[0])
    parts.append(
      f'None of the {len(compared)} comparable named schedules lies below the frontier: a '
      f'synthesised schedule holding no more is at least as fast as each, by up to {gain:g} '
      f'time units ({r["name"]}, v = {r["v"]}, {r["held"]} sets held).'
    )
  return ' '.join(parts)


def _close(a, b, dx=0.1, dy=0.015):
  """Whether two named points would draw their labels over each other."""
  return (
    abs(math.log2(a['held']) - math.log2(b['held'])) < dx and abs(a['bubble'] - b['bubble']) < dy
  )


def _label_groups(rows):
  """Named points close on the plot share one label."""
  groups = []
  for r in sorted(rows, key=lambda r: (r['held'], -r['bubble'])):
    match = next((g for g in groups if any(_close(r, q) for q in g)), None)
    if match is None:
      groups.append([r])
    else:
      match.append(r)
  return groups


def plot(path, frontiers, rows, title):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from matplotlib import ticker

  fig, ax = plt.subplots(figsize=(11, 5))
  fig.subplots_adjust(left=0.07, right=0.65, bottom=0.11)
  colors = {}
  for v, (points, _) in frontiers.items():
    (line,) = ax.plot(
      [q['held'] for q in points], [q['bubble'] for q in points], 'o-', label=f'synthesised, v={v}'
    )
    colors[v] = line.get_color()
  for r in rows:
    marker = 'x' if r['evicts'] else 's'
    ax.scatter(r['held'], r['bubble'], marker=marker, color=colors.get(r['v'], 'gray'), zorder=3)
  # Names would cover each other: each group of close points gets a number,
  # the key beside the axes names them.
  key = []
  for i, group in enumerate(_label_groups(rows), 1):
    top = max(group, key=lambda r: r['bubble'])
    ax.annotate(str(i), (top['held'], top['bubble']), xytext=(4, 4), textcoords='offset points')
    key += [f'{i}: ' + ', '.join(f'{r["name"]} (v={r["v"]}, {r["held"]})' for r in group)]
  key = ['named schedules (v, held; x: evicts)'] + key
  fig.text(0.67, 0.5, '\n'.join(key), fontsize=7, va='center', wrap=True)
  # held spans 1 to m*v (gpipe): a log axis keeps the frontier's knee readable.
  ax.set_xscale('log', base=2)
  ax.xaxis.set_major_formatter(ticker.FormatStrFormatter('%g'))
  ax.set_xlabel('peak residual sets held per stage')
  ax.set_ylabel('bubble (asynchronous, unit costs)')
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def report(command, p, m, time_limit_s, frontiers, rows, timings, png):
  lines = [
    f'# Synthesised schedules: the bubble-memory frontier at p = {p}, m = {m}',
    '',
    f'Written by `{command}`.',
    '',
    f'Unit costs (t_F = t_B = t_W = 1, no transfer time), `synthesis.run(..., '
    f"time_limit_s={time_limit_s:g}, method='auto')` per memory limit K, from "
    '`synthesis.least_memory` up until the makespan meets the memory-free lower bound '
    f'(`synthesis.problem.lower_bound`) or has not improved for {PATIENCE} limits. '
    '"optimal": the makespan is proved least for that K. '
    + ' '.join(f'The v = {v} frontier took {t:.0f} s.' for v, t in timings.items()),
    '',
    '"held" is the most residual sets (micro-batch-chunks) a stage holds at '
    "once in the lowered program; with v = 2 a set is half a stage's activations, "
    'so compare held within one v. The bubble is `simulate.Result.bubble_fraction` '
    'of the asynchronous timing, 1 - busy / (p x makespan).',
    '',
    f'![frontier]({os.path.basename(png)})',
    '',
    '## Synthesised',
    '',
    *synthesised_table(frontiers),
    '',
    '## Named schedules',
    '',
    'Named schedules with a fused backward are timed with their backward split '
    '(`schedule.with_split_backward`: each B followed by its own W), as the '
    "synthesiser's are, so both sides run the same unit F, B and W actions. "
    "BPipe's evictions are outside what the synthesiser searches, but with method `auto` it "
    'returns a named schedule within the limit where that is faster (method `built-in` in '
    'the table above), so BPipe is compared like the others.',
    '',
    *named_table(rows, frontiers),
    '',
    '## What it shows',
    '',
    summary(frontiers, rows),
    '',
  ]
  return '\n'.join(lines)


def command_line(argv):
  script = os.path.relpath(os.path.abspath(argv[0]), ROOT)
  return shlex.join(['.venv/bin/python', script, *argv[1:]])


def main(argv):
  del argv  # flags only
  p, m, limit = _STAGES.value, _MICROBATCHES.value, _TIME_LIMIT.value
  costs = unit_costs()
  frontiers, timings = {}, {}
  for v in sorted({int(x) for x in _VIRTUAL.value}):
    start = time.time()
    frontiers[v] = frontier(p, m, v, costs, limit)
    timings[v] = time.time() - start
  rows = named_points(p, m, costs)
  out = os.path.join(ROOT, _OUT.value) if not os.path.isabs(_OUT.value) else _OUT.value
  png = os.path.splitext(out)[0] + '_frontier.png'
  plot(png, frontiers, rows, f'p={p}, m={m}, unit costs')
  with open(out, 'w') as f:
    f.write(report(command_line(sys.argv), p, m, limit, frontiers, rows, timings, png))
  print(f'wrote {out} and {png}')


if __name__ == '__main__':
  app.run(main)
