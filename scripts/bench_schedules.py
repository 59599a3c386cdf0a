"""Schedule comparison at p = 4: the lockstep lowering beside the one it replaced.

  PYTHONPATH=src .venv/bin/python scripts/bench_schedules.py [--out=docs/bench_schedules.md] \
      [--baseline=650fb8b] [--microbatches=4,8,16,32] [--steps=3] [--rounds=3] \
      [--sections=schedules,v_family,bpipe_zb,full_remat]

Per schedule and m: lockstep ticks, simulated bubble in the executor's
lockstep model and in the papers' asynchronous one (t_F = 1 and a fused
t_B = 2, which the lowering runs as B = W = 1; split schedules F = B = W = 1),
compiled per-device temp bytes, the residual sets each stage holds at its
peak, and the step time relative to 1f1b on 8 forced CPU devices (ratios
only: the devices share this machine's cores). For each m all schedules are
compiled first and then timed in alternating rounds (A, B, C, ..., A, B, C,
...), so that the machine's drift falls on all of them alike.

The "old" columns come from the baseline commit (the lowering that ran F and
B in one tick, F ahead of B): the script checks it out into a temporary git
worktree and measures the same points there in a subprocess, so both sides
are measured by their own code on the same config.

The last line gives zb_h1 against 1f1b at m = 16 from those rounds:
zero-bubble must not cost more than the bubble it removes.

The `v_family` section compares the controllable-memory V-schedules (v_min,
v_half, v_zb; Qi et al., NeurIPS'24) with 1f1b and zb_v at p = 4, 8 and 16,
m = 4p, on the same activation-dominated config with one layer per V chunk
(2p layers, data = 8/p; at p = 16 data = 1 on 16 forced devices, in a
process of its own): compiled per-device temp bytes and step time, each
relative to 1f1b at the same p, beside the peak residual sets the schedule
holds and the paper's figure. p = 16 is where the paper's own peaks come
near its large-p fractions (V-Min 6 and V-Half 9 of 1F1B's 16 micro-batches).

The `bpipe_zb` section sets BPipe's evictions inside zero-bubble against
zb_h1, bpipe and 1f1b at p = 8, m = 32 on the V-family's config (2p layers,
data = 1): compiled temp and step time relative to zb_h1.

The `full_remat` section runs 1f1b, interleaved_1f1b and zb_h1 under full
recomputation at p = 4 and 8 with their ticks packed into rounds
(pipeline.tick_packing=auto) beside one action a tick (off), alternating:
ticks, simulated bubbles, compiled temp and step time.

`--sections` measures only the sections named and replaces their parts of
an existing `--out` file, leaving the others as they were.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_harness import ROOT, device_count_flags, force_cpu_devices, run_python

force_cpu_devices()

P, DATA = 4, 2
NEW = (
  ('gpipe', 1),
  ('1f1b', 1),
  ('interleaved_1f1b', 2),
  ('bpipe', 1),
  ('zb_h1', 1),
  ('interleaved_zb', 2),
  ('zb_v', 2),
  ('dualpipe_v', 2),  # needs m >= 2p: absent from the rows of smaller m
  ('bpipe_zb', 1),
)
OLD = {'gpipe', '1f1b', 'interleaved_1f1b', 'bpipe', 'zb_h1'}
# The V-family section: (schedule, v) at each p, and the paper's peak memory
# in micro-batches of a whole stage (Qi et al., NeurIPS'24; 1F1B's is p).
V_POINTS = (('1f1b', 1), ('zb_v', 2), ('v_min', 2), ('v_half', 2), ('v_zb', 2))
V_STAGES = (4, 8, 16)
PAPER_PEAK = {
  '1f1b': lambda p: p,
  'zb_v': lambda p: p,
  'v_min': lambda p: (p + 4) // 3,
  'v_half': lambda p: (p + 2) // 2,
  'v_zb': lambda p: p,
}
V_HEADING = '## Controllable-memory V-schedules'
# The bpipe_zb section: schedules at BZ_STAGES stages, m = 4p, against zb_h1.
BZ_POINTS = (('1f1b', 1), ('bpipe', 1), ('zb_h1', 1), ('bpipe_zb', 1))
BZ_STAGES = 8
BZ_HEADING = '## BPipe inside zero-bubble'
# The full_remat section: schedules under model.remat=full at (p, data), m = 4p,
# packed into rounds (pipeline.tick_packing=auto) and one action a tick (off).
FR_POINTS = (('1f1b', 1), ('interleaved_1f1b', 2), ('zb_h1', 1))
FR_LAYOUTS = ((4, 2), (8, 1))
FR_HEADING = '## Full recomputation: rounds against one action a tick'
# Sections in the order the report holds them; the main table has no heading.
SECTIONS = ('schedules', 'v_family', 'bpipe_zb', 'full_remat')
HEADINGS = {V_HEADING: 'v_family', BZ_HEADING: 'bpipe_zb', FR_HEADING: 'full_remat'}


def bench_config(config, m, name, v, p=P, data=DATA, layers=8):
  c = config.defaults()
  # Activation-heavy on purpose (long sequences, narrow model): where memory matters.
  c.model.num_layers, c.model.d_model, c.model.num_heads = layers, 64, 4
  c.model.d_ff, c.model.seq_len = 256, 128
  c.mesh.data, c.mesh.pipe = data, p
  c.pipeline.schedule, c.pipeline.virtual_stages, c.pipeline.microbatches = name, v, m
  c.train.global_batch_size = 4 * data * m  # fixed micro-batch of 4 sequences per data shard
  return c


def accepted(points, m: int, p: int = P) -> list:
  """The (name, v) of `points` whose builder takes m micro-batches at p."""
  from triax.errors import ConfigError
  from triax.pipeline import schedule as sched

  out = []
  for name, v in points:
    try:
      sched.build(name, p, m, v)
    except ConfigError:
      continue
    out.append((name, v))
  return out


def measure_group(
  points, m: int, steps: int, rounds: int, p: int = P, data: int = DATA, layers: int = 8
) -> dict:
  """Every (name, v) of `points` at m, timed in alternating rounds.

  Measured by whichever triax is on sys.path (new or baseline). All programs
  are compiled first, then each round times `steps` steps of each in turn,
  so that this machine's drift (its speed moves by 10-30% over minutes)
  falls on every schedule alike; a schedule's time is its median step.
  """
  import jax
  import numpy as np

  from triax import config as config_lib
  from triax.compiled.stats import compile_stats
  from triax.mesh import build_mesh
  from triax.pipeline import schedule as sched
  from triax.pipeline import simulate
  from triax.training.step import build_trainer

  out, runs = {}, {}
  for point in points:
    name, v, key = point[0], point[1], point_key(point)
    schedule = sched.build(name, p, m, v)
    c = bench_config(config_lib, m, name, v, p, data, layers)
    for dotted, value in point[2] if len(point) > 2 else ():
      group, field = dotted.split('.')
      c[group][field] = value
    cfg = config_lib.validate(c, jax.device_count())
    trainer = build_trainer(cfg, build_mesh(cfg.mesh, jax.devices()))
    # The executor's own program (a packed one under full remat); the
    # baseline's trainer may not name it.
    program = getattr(trainer, 'program', None) or sched.lower(schedule)
    costs = _design_point(simulate, schedule.split_backward, _units(cfg))
    tokens = np.random.default_rng(0).integers(
      0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_len + 1)
    )
    with jax.set_mesh(trainer.mesh):
      compiled, stats = compile_stats(trainer)
      batch = jax.device_put(
        {'inputs': tokens[:, :-1].astype(np.int32), 'targets': tokens[:, 1:].astype(np.int32)},
        trainer.batch_sharding,
      )
      state = trainer.init_state(jax.random.key(0))
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
    runs[key] = [trainer, compiled, state, batch, []]
    out[key] = {
      'ticks': program.ticks,
      'lockstep': simulate.simulate_lockstep(program, costs).bubble_fraction,
      'async': simulate.simulate_async(schedule, costs).bubble_fraction,
      'temp': stats['temp_bytes'],
      'peak': list(program.peak_stash),
      'set_bytes': stats.get('schedule', {}).get('residual_bytes_per_slot'),
      'rounds': len(getattr(program, 'rounds', ())),
    }
  for _ in range(rounds):
    for point in points:
      trainer, compiled, state, batch, times = runs[point_key(point)]
      with jax.set_mesh(trainer.mesh):
        for _ in range(steps):
          start = time.perf_counter()
          state, metrics = compiled(state, batch)
          jax.block_until_ready(metrics)
          times.append(time.perf_counter() - start)
      runs[point_key(point)][2] = state
  for point in points:
    out[point_key(point)]['step'] = statistics.median(runs[point_key(point)][4])
  return out


def point_key(point) -> str:
  """A measured point's name in the results: the schedule's, and its config
  overrides where it has any ((name, v) or (name, v, ((key, value), ...)))."""
  return ' '.join([point[0]] + [f'{k}={x}' for k, x in (point[2] if len(point) > 2 else ())])


def _units(cfg):
  """The design costs' units of the config's remat, packed or not (None
  where the baseline's code has no rounds)."""
  try:
    from triax.pipeline import rounds
  except ImportError:
    return None
  return rounds.units_for(cfg.model.remat)


def _design_point(simulate, split: bool, units=None):
  """The papers' unit costs (a packed program's: its units'); spelled out
  where the baseline's code predates `Costs.design_point`."""
  if units is not None:
    return simulate.Costs.design_point(split, units)
  if hasattr(simulate.Costs, 'design_point'):
    return simulate.Costs.design_point(split)
  if split:
    return simulate.Costs(t_forward=1.0, t_backward=1.0, t_weight=1.0)
  return simulate.Costs(t_forward=1.0, t_backward=2.0)


def run_group(
  points,
  m: int,
  steps: int,
  rounds: int,
  p: int,
  data: int,
  layers: int,
  devices: int,
  tree: str = ROOT,
) -> dict:
  """measure_group in a process of its own (this script with --_group): on
  `devices` forced CPU devices, by the triax of `tree` (this one, or a
  worktree of another commit)."""
  spec = ';'.join(f'{n},{v}' for n, v in points)
  run = run_python(
    [os.path.abspath(__file__), '--_group', f'{m}:{steps}:{rounds}:{spec}:{p}:{data}:{layers}'],
    env={'PYTHONPATH': os.path.join(tree, 'src'), 'XLA_FLAGS': device_count_flags(devices)},
    cwd=tree,
    check=True,
  )
  return json.loads(run.stdout.strip().splitlines()[-1])


def baseline_groups(rev: str, ms, steps: int, rounds: int) -> dict:
  """Measures the baseline's schedules with the code of commit `rev` (a worktree)."""
  out = {}
  points = [(n, v) for n, v in NEW if n in OLD]
  with tempfile.TemporaryDirectory() as tmp:
    tree = os.path.join(tmp, 'baseline')
    subprocess.run(
      ['git', '-C', ROOT, 'worktree', 'add', '--detach', tree, rev],
      check=True,
      capture_output=True,
    )
    try:
      for m in ms:
        group = run_group(points, m, steps, rounds, P, DATA, 8, 8, tree=tree)
        for name, row in group.items():
          out[(name, m)] = row
          print('baseline', name, m, row, flush=True)
    finally:
      subprocess.run(
        ['git', '-C', ROOT, 'worktree', 'remove', '--force', tree], capture_output=True
      )
  return out


def main(argv):
  del argv
  from triax.compiled.measure import write_report

  unknown = set(_SECTIONS.value) - set(SECTIONS)
  if unknown:
    raise SystemExit(f'--sections: unknown {sorted(unknown)}; choose {", ".join(SECTIONS)}')
  measure = {
    'schedules': schedules_section,
    'v_family': lambda: v_family_section(_STEPS.value, _ROUNDS.value),
    'bpipe_zb': lambda: bpipe_zb_section(_STEPS.value, _ROUNDS.value),
    'full_remat': lambda: full_remat_section(_STEPS.value, _ROUNDS.value),
  }
  parts = _existing_sections(_OUT.value)
  for name in SECTIONS:
    if name in _SECTIONS.value:
      parts[name] = measure[name]()
  lines = []
  for name in SECTIONS:
    if parts.get(name):
      lines += ([''] if lines else []) + parts[name]
  write_report(_OUT.value, lines)


def _existing_sections(path: str) -> dict[str, list[str]]:
  """An existing report's lines by section (the main table's has no heading)."""
  out = {}
  if not os.path.exists(path):
    return out
  name = 'schedules'
  for line in open(path).read().rstrip('\n').split('\n'):
    name = HEADINGS.get(line, name)
    out.setdefault(name, []).append(line)
  for lines in out.values():
    while lines and not lines[-1]:
      lines.pop()
  return out


def v_family_section(steps: int, rounds: int) -> list[str]:
  """The V-family rows at each p of V_STAGES, m = 4p, relative to 1f1b at
  that p; a p beyond this process's 8 devices in a process of its own."""
  rows = {}
  for p in V_STAGES:
    m, data = 4 * p, max(1, 8 // p)
    if p <= 8:
      group = measure_group(V_POINTS, m, steps, rounds, p=p, data=data, layers=2 * p)
    else:
      group = run_group(V_POINTS, m, steps, rounds, p, data, 2 * p, devices=p)
    for name, row in group.items():
      rows[(name, p)] = row
      print('v_family', name, p, row, flush=True)
  lines = [
    V_HEADING,
    '',
    'V-Min, V-Half and V-ZB (Qi et al., "Pipeline Parallelism with Controllable Memory", '
    'NeurIPS 2024) against 1f1b and zb_v at m = 4p: the config above with one layer per '
    'V chunk (2p layers), data = 8/p, fp32, 8 forced CPU devices on '
    f'{os.cpu_count()} cores (at p = 16: data = 1 on 16 devices, in a process of its own). '
    "Peak stash counts residual sets per stage (a V chunk's set is "
    'half of a 1f1b stage\'s); "paper" is the peak in micro-batches of a whole stage\'s '
    'activations the paper gives (1F1B p, V-Min (p+4)//3, V-Half (p+2)//2, V-ZB p). Temp '
    'and step time are relative to 1f1b at the same p, step times from alternating rounds '
    'in one run. Bubbles: t_F = t_B = t_W = 1 (1f1b: a fused t_B = 2).',
    '',
    '| schedule | p | m | ticks | bubble lockstep | peak stash per stage | micro-batches / '
    'paper | temp MiB | temp / 1f1b | step time / 1f1b |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for p in V_STAGES:
    one = rows[('1f1b', p)]
    for name, v in V_POINTS:
      r = rows[(name, p)]
      label = name + (f' v={v}' if v > 1 else '')
      held = max(r['peak']) / v
      lines.append(
        f'| {label} | {p} | {4 * p} | {r["ticks"]} | {r["lockstep"]:.3f} '
        f'| {",".join(map(str, r["peak"]))} | {held:g} / {PAPER_PEAK[name](p)} '
        f'| {r["temp"] / 2**20:.1f} | {r["temp"] / one["temp"]:.2f} '
        f'| {r["step"] / one["step"]:.2f} |'
      )
  bounds = '; '.join(
    f'p={p}: v_min {PAPER_PEAK["v_min"](p) / p:.3f}, v_half {PAPER_PEAK["v_half"](p) / p:.3f}'
    for p in V_STAGES
  )
  lines += [
    '',
    "The paper's own peaks bound the residual pools against 1f1b's p sets at "
    f'{bounds} (its 1/3 and 1/2 are the large-p limits); what compiled temp holds beyond '
    'the pool is the B-to-W cuts and the set a tick writes before it lands.',
  ]
  return lines


def bpipe_zb_section(steps: int, rounds: int) -> list[str]:
  """bpipe_zb beside zb_h1, bpipe and 1f1b at p = 8, m = 32, relative to zb_h1."""
  from triax.pipeline import schedule as sched

  p, m = BZ_STAGES, 4 * BZ_STAGES
  rows = measure_group(BZ_POINTS, m, steps, rounds, p=p, data=8 // p, layers=2 * p)
  for name, row in rows.items():
    print('bpipe_zb', name, p, row, flush=True)
  zb = rows['zb_h1']
  lines = [
    BZ_HEADING,
    '',
    "BPipe's activation balancing inside zero-bubble (`bpipe_zb`: 1F1B's order with the "
    "backward split, the last q stages lagging their W's as ZB-H1 does over their last q+1 "
    "backwards, BPipe's evictions between stages s and p-1-s at bpipe's own cap) against "
    f'zb_h1, bpipe and 1f1b at p = {p}, m = {m}: the V-family config with one chunk per '
    f'stage ({2 * p} layers, data = {8 // p}), fp32, 8 forced CPU devices on {os.cpu_count()} '
    'cores. Temp and step time are relative to zb_h1, step times from alternating rounds in '
    f'one run ({rounds} rounds of {steps} steps). Bubbles: '
    't_F = t_B = t_W = 1 (fused schedules: t_B = 2), moves free. Cuts are the B-to-W values '
    'a stage holds; sets moved count evictions and loads per step.',
    '',
    '| schedule | p | m | ticks | bubble lockstep | peak stash per stage | cuts per stage '
    '| sets moved | temp MiB | temp / zb_h1 | step time / zb_h1 |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  programs = {name: sched.lower(sched.build(name, p, m)) for name, _v in BZ_POINTS}
  cuts = {name: max(program.peaks['cut']) for name, program in programs.items()}
  for name, _v in BZ_POINTS:
    r, program = rows[name], programs[name]
    lines.append(
      f'| {name} | {p} | {m} | {r["ticks"]} | {r["lockstep"]:.3f} '
      f'| {",".join(map(str, r["peak"]))} | {",".join(map(str, program.peaks["cut"]))} '
      f'| {sched.transfers_per_step(program)["total"]} | {r["temp"] / 2**20:.1f} '
      f'| {r["temp"] / zb["temp"]:.2f} | {r["step"] / zb["step"]:.2f} |'
    )
  bz = rows['bpipe_zb']
  moving = int((programs['bpipe_zb'].table['move_send'] >= 0).any(axis=1).sum())
  moved = sched.transfers_per_step(programs['bpipe_zb'])['total']
  lines += [
    '',
    f"bpipe_zb against zb_h1: the worst device's compiled temp "
    f'**{bz["temp"] / zb["temp"]:.3f}x** ({max(bz["peak"])} residual sets and '
    f'{cuts["bpipe_zb"]} cuts a device against {max(zb["peak"])} and {cuts["zb_h1"]}), '
    f'step time **{bz["step"] / zb["step"]:.3f}x** (medians: zb_h1 {zb["step"] * 1e3:.0f} ms, '
    f'bpipe_zb {bz["step"] * 1e3:.0f} ms). The ticks make {bz["ticks"] / zb["ticks"]:.3f} '
    f'({bz["ticks"]} against {zb["ticks"]}); the rest is the moves: {moving} ticks move a '
    f'set, {moved} sets of {bz["set_bytes"] / 2**20:.1f} MiB a step, each a copy made by the '
    'cores that compute here (on accelerators, by the links).',
  ]
  return lines


def full_remat_section(steps: int, rounds: int) -> list[str]:
  """Each of FR_POINTS under full recomputation at FR_LAYOUTS, m = 4p, packed
  (pipeline/rounds.py) beside one action a tick, alternating in one run."""
  rows = {}
  for p, data in FR_LAYOUTS:
    m = 4 * p
    points = [
      (name, v, (('model.remat', 'full'), ('pipeline.tick_packing', packing)))
      for name, v in FR_POINTS
      for packing in ('off', 'auto')
    ]
    group = measure_group(points, m, steps, rounds, p=p, data=data, layers=2 * p)
    for point in points:
      rows[(point[0], p, point[2][1][1])] = group[point_key(point)]
      print('full_remat', point_key(point), p, group[point_key(point)], flush=True)
  lines = [
    FR_HEADING,
    '',
    'Under full recomputation (`model.remat=full`) B reruns the forward before its input '
    'gradient: two forwards of work against one for F and W. "off" runs one action per stage '
    'per tick (`pipeline.tick_packing=off`), so a tick where one stage runs B and another F '
    'or W lasts the B; "rounds" packs ticks into rounds whose stages each run actions worth '
    'the same time and meet only at sends (`tick_packing=auto`, pipeline/rounds.py). The '
    "main table's config with 2 layers a stage at each p (data = 8/p), m = 4p, fp32, 8 "
    f"forced CPU devices on {os.cpu_count()} cores. Bubbles simulated at full recomputation's "
    "design costs (t_F = 1, B 2, W 1) in each program's own lockstep model, and for the "
    "schedule run asynchronously (the papers'). Step times: medians of alternating rounds "
    f'({rounds} rounds of {steps} steps) in one run, rounds over off. On this machine idle '
    'devices give their cores to the busy ones, so a lockstep wait costs little here: the '
    'simulated bubble is what an accelerator would lose.',
    '',
    '| schedule | p | m | ticks off / rounds | rounds | bubble lockstep off / rounds '
    '| bubble async | temp MiB off / rounds | peak stash off / rounds | step time rounds / off |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for p, _data in FR_LAYOUTS:
    for name, v in FR_POINTS:
      off, on = rows[(name, p, 'off')], rows[(name, p, 'auto')]
      label = name + (f' v={v}' if v > 1 else '')
      lines.append(
        f'| {label} | {p} | {4 * p} | {off["ticks"]} / {on["ticks"]} | {on["rounds"]} '
        f'| {off["lockstep"]:.3f} / {on["lockstep"]:.3f} | {on["async"]:.3f} '
        f'| {off["temp"] / 2**20:.2f} / {on["temp"] / 2**20:.2f} '
        f'| {",".join(map(str, off["peak"]))} / {",".join(map(str, on["peak"]))} '
        f'| {on["step"] / off["step"]:.3f} |'
      )
  temp = max(
    rows[(n, p, 'auto')]['temp'] / rows[(n, p, 'off')]['temp']
    for n, _ in FR_POINTS
    for p, _ in FR_LAYOUTS
  )
  lines += [
    '',
    f'Compiled temp, rounds over off: at most **{temp:.4f}x** on these rows.',
  ]
  return lines


def schedules_section() -> list[str]:
  """The main table: every schedule at p = 4 over m, old lowering beside new."""
  ms = [int(x) for x in _MICROBATCHES.value]
  new = {}
  for m in ms:
    for name, row in measure_group(accepted(NEW, m), m, _STEPS.value, _ROUNDS.value).items():
      new[(name, m)] = row
      print('new', name, m, row, flush=True)
  old = baseline_groups(_BASELINE.value, ms, _STEPS.value, _ROUNDS.value) if _BASELINE.value else {}
  lines = [
    f'Schedules at p={P}, data={DATA}: 8 layers of width 64, 128 tokens x 4 sequences per '
    f'micro-batch per data shard, fp32, 8 forced CPU devices on {os.cpu_count()} cores. '
    'Bubbles simulated with t_F = 1 and a fused t_B = 2 (split schedules: F = B = W = 1). '
    f'"old": the lockstep lowering of commit {_BASELINE.value} (F and B in one tick), '
    'measured by its own code; "new": one action per stage per tick, fused backwards run '
    "as B then W, and attention's softmax with JAX's newer derivative (one [b, n, t, t] "
    'residual per layer less). Step times are relative to 1f1b of the same side, measured '
    'in one run.',
    '',
    '| schedule | m | ticks old / new | bubble lockstep old / new | bubble async '
    '| temp MiB old / new | peak stash per stage old / new | step time / 1f1b old / new |',
    '|---|---|---|---|---|---|---|---|',
  ]
  fmt = lambda x, f: '-' if x is None else format(x, f)
  for m in ms:
    for name, v in accepted(NEW, m):
      n, o = new[(name, m)], old.get((name, m))
      get = lambda d, k: None if d is None else d[k]
      rel_new = n['step'] / new[('1f1b', m)]['step']
      rel_old = None if o is None else o['step'] / old[('1f1b', m)]['step']
      label = name + (f' v={v}' if v > 1 else '')
      peak_old = '-' if o is None else ','.join(map(str, o['peak']))
      lines.append(
        f'| {label} | {m} | {fmt(get(o, "ticks"), "d")} / {n["ticks"]} '
        f'| {fmt(get(o, "lockstep"), ".3f")} / {n["lockstep"]:.3f} | {n["async"]:.3f} '
        f'| {fmt(None if o is None else o["temp"] / 2**20, ".1f")} / {n["temp"] / 2**20:.1f} '
        f'| {peak_old} / {",".join(map(str, n["peak"]))} '
        f'| {fmt(rel_old, ".2f")} / {rel_new:.2f} |'
      )
  if 16 in ms:
    a, b = new[('1f1b', 16)]['step'], new[('zb_h1', 16)]['step']
    lines += [
      '',
      f'zb_h1 against 1f1b at m=16 (medians of the alternating rounds): 1f1b {a * 1e3:.0f} ms, '
      f'zb_h1 {b * 1e3:.0f} ms, ratio **{b / a:.3f}**.',
    ]
  return lines


if __name__ == '__main__':
  if len(sys.argv) == 3 and sys.argv[1] == '--_group':
    # A group measured in a process of its own (run_group): on more devices,
    # or by the baseline's triax.
    m, steps, rounds, spec, p, data, layers = sys.argv[2].split(':')
    # The tree run_group names (its cwd) ahead of the src bench_harness put first.
    sys.path.insert(0, os.path.join(os.getcwd(), 'src'))
    points = [(n, int(v)) for n, v in (x.split(',') for x in spec.split(';'))]
    sizes = dict(p=int(p), data=int(data), layers=int(layers))
    print(json.dumps(measure_group(points, int(m), int(steps), int(rounds), **sizes)))
  else:
    from absl import app, flags

    _OUT = flags.DEFINE_string('out', 'docs/bench_schedules.md', 'Markdown table to write.')
    _MICROBATCHES = flags.DEFINE_list('microbatches', ['4', '8', '16', '32'], 'm values.')
    _STEPS = flags.DEFINE_integer('steps', 3, 'Timed steps per schedule and round.')
    _BASELINE = flags.DEFINE_string(
      'baseline', '650fb8b', 'Commit whose lowering the "old" columns measure; \'\' to skip them.'
    )
    _ROUNDS = flags.DEFINE_integer('rounds', 3, 'Alternating timing rounds per m.')
    _SECTIONS = flags.DEFINE_list(
      'sections',
      list(SECTIONS),
      'What to measure: schedules (the main table), v_family (the V-schedules), bpipe_zb '
      '(BPipe inside zero-bubble at p = 8), full_remat (packed rounds against one action a '
      'tick under full recomputation); the sections not named keep their part of an '
      'existing --out.',
    )
    app.run(main)
