"""What `python -m triax plan` does: load, profile, search, print, write.

The entry point (triax/cli/plan.py) parses flags into a `Request` and
calls `main`; everything here is importable and tested in-process. With
`Request.evaluate` one layout is priced instead of searched for (the
config's own or `Request.layout`'s, plan/evaluate.py): the same profile,
options, simulator and outputs (--out, --trace, --verify) as the search's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any, TextIO

from triax.errors import ConfigError
from triax.layout import Layout
from triax.plan import candidate, evaluate
from triax.plan import cluster as cluster_lib
from triax.plan.candidate import Estimate
from triax.plan.cost import host, roofline, trace
from triax.plan.cost.simulator import simulate_plan
from triax.plan.search import baselines as baselines_lib
from triax.plan.search import emit, exhaustive, layouts

PROFILES = ('local', 'analytic')
SEARCHES = ('exhaustive', 'learned')
# One layer's forward+backward above this many FLOPs takes tens of seconds
# per timing on a CPU, and the profile times dozens: refuse, point to analytic.
_LOCAL_MAX_LAYER_FLOPS = 2e11


@dataclasses.dataclass(frozen=True)
class Request:
  """One planner invocation.

  Attributes:
    cfg: the experiment config (as --config loaded it, overrides applied).
    config_path: the --config value, FILE[:ARG].
    config_overrides: the --config.* flags as {dotted key: value}.
    cluster: path of the cluster spec.
    top: plans to show.
    out: write the best plan as a config file here, or None.
    trace: write the best plan's predicted timeline (Chrome trace) here.
    model: 'lockstep' (triax's executor) or 'async' ranks the plans.
    dp_allreduce: 'per_step' (triax's executor) or 'per_microbatch'.
    profile: 'local' (measure here) or 'analytic' (plan/cost/analytic.py).
    gpus: size the cluster to this many devices (cluster.resize), or None.
    profile_cache: JSON file of measured profiles to read and extend, or None.
    verbose: print the measurements behind the profile too.
    search: 'exhaustive' (search/exhaustive.py) or 'learned' (plan/learned/'s policy).
    policy: with search='learned', the trained policy file (.msgpack) to use,
      trained first and written there when absent; None: trained here.
    verify: called with the best plan's config and its estimate before the
      report is printed; what it returns is the report's `verify` (the
      entry point compiles the plan there: the planner compiles nothing).
    verify_chips: with verify, the chips of the slice it compiles for: the
      cluster must have as many devices.
    moe_imbalance: a MoE model's busiest expert's tokens over the mean
      (candidate.Options.moe_imbalance; 1 = balanced).
    evaluate: price one layout (the config's own, or `layout`) instead of
      searching; `top`, `search` and `policy` are not read.
    layout: with evaluate, the layout to price (plan/evaluate.py's tokens,
      Plan.describe's words: 'd8,t8,p35,v3,m280'), or None: the config's.
  """

  cfg: Any
  config_path: str
  config_overrides: dict
  cluster: str
  top: int = 5
  out: str | None = None
  trace: str | None = None
  model: str = 'lockstep'
  dp_allreduce: str = 'per_step'
  profile: str = 'local'
  gpus: int | None = None
  profile_cache: str | None = None
  verbose: bool = False
  search: str = 'exhaustive'
  policy: str | None = None
  verify: Callable[[Any, Estimate], dict] | None = None
  verify_chips: int | None = None
  moe_imbalance: float = 1.0
  evaluate: bool = False
  layout: str | None = None


def local_devices(cluster_path: str) -> int | None:
  """How many devices the spec's `profile: local` groups have (None: none).

  Raises:
    ConfigError: for a bad cluster file.
  """
  spec = cluster_lib.load(cluster_path)
  count = sum(g.count for g in spec.groups.values() if g.local)
  return count or None


def _check(request: Request) -> None:
  if request.layout is not None and not request.evaluate:
    raise ConfigError(
      '--layout', 'is read only with --evaluate (which prices that layout); add --evaluate'
    )
  if request.top < 1:
    raise ConfigError('--top', f'must be >= 1, got {request.top}')
  for flag, path, suffix in (('--out', request.out, '.py'), ('--trace', request.trace, '.json')):
    if path is None:
      continue
    if not path.endswith(suffix):
      raise ConfigError(flag, f'must name a {suffix} file, got {path}')
    folder = os.path.dirname(path) or '.'
    if not os.path.isdir(folder):
      raise ConfigError(flag, f'folder {folder} does not exist')
  if request.model not in candidate.MODELS:
    raise ConfigError('--model', f'one of {", ".join(candidate.MODELS)}, got {request.model}')
  if request.dp_allreduce not in candidate.DP_ALLREDUCE:
    raise ConfigError('--dp_allreduce', f'one of {", ".join(candidate.DP_ALLREDUCE)}')
  if request.search not in SEARCHES:
    raise ConfigError('--search', f'one of {", ".join(SEARCHES)}, got {request.search}')
  if request.profile not in PROFILES:
    raise ConfigError('--profile', f'one of {", ".join(PROFILES)}, got {request.profile}')
  if request.profile_cache is not None:
    folder = os.path.dirname(request.profile_cache) or '.'
    if not request.profile_cache.endswith('.json') or not os.path.isdir(folder):
      raise ConfigError(
        '--profile_cache', f'want a .json file in an existing folder, got {request.profile_cache}'
      )


def run(request: Request, as_json: bool = False, out: TextIO | None = None) -> dict:
  """Plans, prints and writes what was asked; returns the JSON summary.

  Raises:
    ConfigError: for bad flags, a bad cluster file or an unplannable config.
  """
  out = out or sys.stdout
  _check(request)
  cluster = cluster_lib.load(request.cluster)
  if request.gpus is not None:
    cluster = cluster_lib.resize(cluster, request.gpus)
  if request.verify_chips not in (None, cluster.num_devices):
    raise ConfigError(
      '--verify',
      f'the slice has {request.verify_chips} chips and the cluster {cluster.num_devices} '
      f'devices; size the cluster to the slice (--gpus={request.verify_chips})',
    )
  import ml_collections

  cfg = ml_collections.ConfigDict(request.cfg.to_dict())
  if request.evaluate:
    # The layout's own keys (pipeline.*, train.*) set what the simulator is told.
    planned, plan, keys = evaluate.configure(cfg, request.layout, cluster.num_devices)
    options = _options(request, planned)
    host.require(cluster, options)
    return _evaluate(request, cfg, (planned, plan, keys), cluster, options, as_json, out)
  options = _options(request, cfg)
  host.require(cluster, options)
  m = cfg.model
  progress(
    f'plan: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads, seq {m.seq_len}, '
    f'batch {cfg.train.global_batch_size} on {cluster.name} ({cluster.num_devices} devices); '
    f'profile {request.profile}'
  )
  candidates = list(layouts.layouts(cfg, cluster.num_devices))
  if not candidates:
    raise layouts.no_layout(cfg, cluster)
  profile = _profile(request, cfg, cluster, candidates)
  progress(f'searching {len(candidates)} layouts ...')
  if request.search == 'learned':
    from triax.plan.learned import planner, training

    policy = training.trained(cfg, request.policy, progress=progress)
    result = planner.search(
      cfg, cluster, top_k=request.top, options=options, profile=profile, policy=policy
    )
  else:
    result = exhaustive.search(cfg, cluster, top_k=request.top, options=options, profile=profile)
  progress(f'searched {result.evaluated} plans in {result.search_s:.1f} s')
  if not result.top:
    raise ConfigError(
      '--cluster',
      f'{cluster.path}: no plan fits in memory on this '
      'cluster; use a smaller model or batch, or a bigger cluster',
    )
  best = result.top[0]
  summary = to_json(result, cfg)
  _outputs(request, best, cfg, cluster, summary)
  if as_json:
    print(json.dumps(summary), file=out)
  else:
    print(text(result, cfg, request), file=out)
    if 'verify' in summary:
      print(summary['verify']['line'], file=out)
  return summary


def _options(request: Request, cfg) -> candidate.Options:
  """The simulator's options: the flags' and the config's executor keys."""
  return candidate.Options(
    model=request.model,
    dp_allreduce=request.dp_allreduce,
    scatter_gather=bool(cfg.pipeline.scatter_gather),
    edge_grads=cfg.pipeline.edge_grads,
    offload_stash=bool(cfg.pipeline.offload_stash),
    offload_optimizer=bool(cfg.train.offload_optimizer),
    optimizer_state=_optimizer_state(cfg),
    moe_imbalance=_moe_imbalance(request),
  )


def _optimizer_state(cfg) -> tuple[float, float]:
  """train.optimizer's state per parameter byte (layers', edges'); AdamW's
  two moments without building the model."""
  if cfg.train.optimizer == 'adamw':
    return candidate.Options.optimizer_state
  from triax.training import optimizer  # JAX (shapes only), for another optimizer alone

  return optimizer.state_per_param(cfg)


def _evaluate(request: Request, cfg, layout, cluster, options, as_json: bool, out: TextIO) -> dict:
  """--evaluate: prices `layout` (evaluate.configure's validated config, plan
  and keys), prints and writes what was asked; returns the JSON summary."""
  planned, plan, keys = layout
  progress(
    f'evaluate: {plan.describe()} on {cluster.name} ({cluster.num_devices} devices); '
    f'profile {request.profile}'
  )
  profile = _profile(request, planned, cluster, [plan])
  estimate = simulate_plan(plan, profile, cluster, options)
  summary = {
    **_context_json(cluster, profile, planned),
    'layout': {'given': request.layout, 'config_keys': keys},
    'plan': _row(estimate),
    **evaluate.summary(estimate, planned, cluster, options.memory_fraction, _model_flops(planned)),
  }
  _outputs(request, estimate, cfg, cluster, summary)
  if as_json:
    print(json.dumps(summary), file=out)
    return summary
  lines = [evaluate.text(summary, _context_lines(cluster, profile, planned))]
  if request.verbose:
    lines += ['', *_measurements(profile)]
  if request.out:
    lines.append(f'wrote {request.out}: {train_command(request.out, cluster)}')
  if request.trace:
    lines.append(f'wrote {request.trace} (open in https://ui.perfetto.dev)')
  if 'verify' in summary:
    lines.append(summary['verify']['line'])
  print('\n'.join(lines), file=out)
  return summary


def _outputs(request: Request, estimate: Estimate, cfg, cluster, summary: dict) -> None:
  """--out (a plan file), --trace and --verify of the plan chosen or
  evaluated, each noted in `summary`."""
  import ml_collections

  if request.out:
    base_path, _, base_arg = request.config_path.partition(':')
    emit.write(
      request.out,
      estimate,
      base_path,
      base_arg or None,
      _base_overrides(request, base_path, base_arg or None, cfg),
      cluster.name,
      command=_planner_command(request),
      heterogeneous=cluster.heterogeneous,
      run=train_command(request.out, cluster),
      base_cfg=cfg,
    )
    summary['out'] = request.out
  if request.trace:
    with open(request.trace, 'w') as f:
      json.dump(trace.chrome_trace(estimate), f)
    summary['trace'] = request.trace
  if request.verify is not None:
    planned = emit.apply(
      ml_collections.ConfigDict(cfg.to_dict()), emit.overrides(estimate.plan, cfg=cfg)
    )
    summary['verify'] = request.verify(planned, estimate)


def _planner_command(request: Request) -> str:
  """The planner flags that made a plan, for its file's docstring."""
  flags = f'--config={request.config_path} --cluster={request.cluster}'
  if request.evaluate:
    flags += ' --evaluate' + (f' --layout={shlex.quote(request.layout)}' if request.layout else '')
  if request.profile != 'local':
    flags += f' --profile={request.profile}'
  if request.gpus is not None:
    flags += f' --gpus={request.gpus}'
  if request.search != 'exhaustive':
    flags += f' --search={request.search}' + (
      f' --policy={request.policy}' if request.policy else ''
    )
  return flags


def progress(line: str) -> None:
  """A progress line, on stderr (stdout holds the report or its JSON)."""
  print(line, file=sys.stderr, flush=True)


def _profile(request: Request, cfg, cluster, candidates):
  """The profile the search prices plans with: analytic, or measured here
  (from the cache file when it holds this one)."""
  tensors, sizes = layouts.profile_sizes(cfg, candidates)
  if request.profile == 'analytic':
    from triax.plan.cost import analytic

    analytic.check_cluster(cluster)
    prof = analytic.build(cfg.model, tensors)
    progress(f'profile: analytic, tensor degrees {tensors} (shapes and data sheets, nothing run)')
    return prof
  _check_local(cfg)
  from triax.plan.cost import profile as profile_lib
  from triax.plan.cost import profile_cache

  key = profile_cache.key(cfg.model, tensors, sizes)
  if request.profile_cache:
    cached = profile_cache.read(request.profile_cache, key)
    if cached is not None:
      progress(f'profile: from {request.profile_cache} (measured before)')
      return cached
  progress(
    f'profile: measuring here, tensor degrees {tensors}, micro-batch sizes {sizes} '
    '(minutes; --profile=analytic prices from data sheets instead)'
  )
  try:
    prof = profile_lib.measure(cfg.model, tensors, sizes, progress=progress)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(
      '--profile', f'this host cannot run the model ({first}); use --profile=analytic'
    ) from None
  if request.profile_cache:
    profile_cache.write(request.profile_cache, key, prof)
    progress(f'profile: saved to {request.profile_cache}')
  return prof


def _check_local(cfg) -> None:
  """What this host cannot profile, said before JAX tries (a traceback, or hours)."""
  import jax

  from triax.model import registry

  if cfg.model.attention == 'cudnn' and jax.default_backend() != 'gpu':
    raise ConfigError(
      '--profile',
      f'model.attention=cudnn runs only on a GPU and this host is {jax.default_backend()}; '
      'use --profile=analytic (or --config.model.attention=xla to measure here)',
    )
  spec = registry.spec_from_config(cfg.model)
  flops = registry.build(spec).forward_flops()
  layer = 3 * (flops['layer_matmul'] + flops['layer_attention'])
  if jax.default_backend() == 'cpu' and layer > _LOCAL_MAX_LAYER_FLOPS:
    raise ConfigError(
      '--profile',
      f'one layer forward+backward is {layer:.1e} FLOPs a sequence, too large to measure '
      'on this CPU in reasonable time; use --profile=analytic',
    )


def _base_overrides(request: Request, base_path: str, base_arg: str | None, cfg) -> dict:
  """Dotted keys where the planner's config differs from the base file's
  get_config (the --config.* flags), minus those the plan sets itself."""
  del base_path, base_arg, cfg
  plan_keys = set(emit.overrides(_dummy_plan(), heterogeneous=True)) | set(emit.SEQUENCE_KEYS)
  plan_keys.add(emit.SCHEDULE_FILE_KEY)  # a plan names its schedule one way or the other
  return {k: v for k, v in request.config_overrides.items() if k not in plan_keys}


def _dummy_plan() -> candidate.Plan:
  return candidate.Plan(layout=Layout(), remat='none', layers=(1,), stages=((0,),), global_batch=1)


def _row(e: Estimate) -> dict:
  p = e.plan
  return {
    'plan': p.describe(),
    'data': p.data,
    'expert': p.expert,
    'context': p.context,
    'tensor': p.tensor,
    'sequence_parallel': p.sequence_parallel,
    'context_attention': p.context_attention,
    'pipe': p.pipe,
    'schedule': p.schedule,
    'synthesized': _synthesized(p),
    'microbatches': p.microbatches,
    'microbatch_size': p.microbatch_size,
    'virtual_stages': p.virtual_stages,
    'remat': p.remat,
    'state_sharding': p.state_sharding,
    'layers': list(p.layers),
    'layers_per_chunk': list(p.chunk_layers),
    'stages': [list(s) for s in p.stages],
    'step_time_s': e.step_time,
    'lockstep_time_s': e.lockstep_time,
    'async_time_s': e.async_time,
    'bubble_fraction': e.bubble_fraction,
    'tail_s': e.tail_time,
    'dp_allreduce_s': e.dp_allreduce_time,
    'memory_bytes': list(e.memory),
    'capacity_bytes': list(e.capacity),
    'oom': e.oom,
  }


def _synthesized(plan: candidate.Plan) -> dict | None:
  """A synthesised schedule's most residual sets and cuts per stage (its
  program's slots); None for a named schedule."""
  if candidate.given(plan.schedule) is None:
    return None
  prog = plan.lowered
  return {'sets': prog.slots['stash'], 'cuts': prog.slots['cut']}


def to_json(result: exhaustive.SearchResult, cfg) -> dict:
  return {
    **_context_json(result.cluster, result.profile, cfg),
    'search_s': result.search_s,
    'evaluated': result.evaluated,
    'top': [_row(e) for e in result.top],
    'baselines': {k: (_row(e) if e else None) for k, e in result.baselines.items()},
    'speedups': {k: result.speedup(k) for k in result.baselines},
  }


# The model keys a JSON report names its model by.
_MODEL_KEYS = 'num_layers d_model num_heads d_ff vocab_size seq_len dtype fp8'.split()


def _context_json(cluster, prof, cfg) -> dict:
  """The cluster, model and profile a report priced its plans on."""
  m = prof.machine
  return {
    'cluster': cluster.name,
    'devices': cluster.num_devices,
    'model': {k: cfg.model[k] for k in _MODEL_KEYS},
    'global_batch_size': cfg.train.global_batch_size,
    'simulated': True,
    'profile': {
      'backend': m.backend,
      'devices': m.num_devices,
      'wall_s': prof.wall_s,
      'matmul_flops': m.matmul_flops,
      'memory_bandwidth': m.memory_bandwidth,
      'node_bandwidth': m.node_bandwidth,
      'effective_cores': m.effective_cores,
      'p2p': dataclasses.asdict(m.p2p),
      'allreduce': dataclasses.asdict(m.allreduce),
      'fits': {f: dataclasses.asdict(x) for f, x in prof.fits.items()},
      'points': [dataclasses.asdict(p) for p in prof.points],
      'executor_ratios': {k: list(v) for k, v in prof.ratios.items()},
      'assumption': roofline.assumption(prof) if prof.analytic is None else 'analytic',
    },
  }


def _ms(seconds: float) -> str:
  return f'{seconds * 1e3:9.2f}'


def _context_lines(c, prof, cfg) -> list[str]:
  """The cluster, model and profile a report priced its plans on."""
  m = prof.machine
  groups = ', '.join(f'{g.count}x {g.name}' for g in c.groups.values())
  mc = cfg.model
  lines = [
    f'cluster {c.name}: {c.num_devices} devices ({groups}) on {len(c.nodes)} node(s)',
    f'model: {mc.num_layers} layers, d_model {mc.d_model}, {mc.num_heads} heads, d_ff '
    f'{mc.d_ff}, vocab {mc.vocab_size}, seq {mc.seq_len}, {mc.dtype}; global batch '
    f'{cfg.train.global_batch_size}',
  ]
  if prof.analytic is not None:
    effs = ', '.join(f'{g.name} {g.matmul_efficiency:.2f}' for g in c.groups.values())
    lines.append(
      'profile: analytic (plan/cost/analytic.py): GEMMs, attention and bandwidth-bound kernels '
      "priced by the spec's data-sheet peak and memory bandwidth, matmul_efficiency "
      f'{effs}; hierarchical collectives over its links'
    )
    lines += _fp8_lines(c, mc)
  else:
    lines.append(
      f'profile ({m.backend}, {m.num_devices} local devices, {prof.wall_s:.1f} s): matmul '
      f'{m.matmul_flops / 1e9:.1f} GFLOP/s, copy {m.memory_bandwidth / 1e9:.1f} GB/s '
      f'({m.node_bandwidth / 1e9:.1f} GB/s with all devices copying), '
      f'{m.effective_cores:.2f} effective cores when all devices run a small matmul'
    )
    if not c.local:  # how the other device types were derived from this one
      lines.append(roofline.assumption(prof))
  experts = next(iter(prof.shards.values())).experts
  dense = sorted(g.name for g in c.groups.values() if g.ragged_dot == 'dense')
  if experts is not None and experts.dispatch == 'dropless' and dense:
    lines.append(
      f'note: dropless on {"/".join(dense)}: its compiler runs a grouped matmul as one dense '
      f"product over every local expert, {experts.num_experts}x the routed experts' FLOPs in "
      '[experts, rows, width] buffers whatever the expert degree (plan/cost/experts.py); '
      'model.moe_dispatch=capacity avoids both'
    )
  return lines


def _fp8_lines(c, model) -> list[str]:
  """How the analytic profile prices model.fp8's weight GEMMs, and a note
  naming the groups that run them at the compute dtype's peak."""
  if model.fp8 == 'none':
    return []
  lines = [
    f'  model.fp8={model.fp8}: the weight GEMMs (not the attention core, router, head or routed '
    "experts) at the spec's float8 peak, their operands' casts to FP8 as memory traffic"
  ]
  slow = sorted(g.name for g in c.groups.values() if g.fp8_peak() is None)
  if slow:
    lines.append(
      f'note: model.fp8={model.fp8} on {"/".join(slow)}: the spec lists no float8 peak (no FP8 '
      f'tensor cores), so its FP8 GEMMs are priced at the {model.dtype} peak, no faster, and '
      'the casts to FP8 only add time'
    )
  return lines


def text(result: exhaustive.SearchResult, cfg, request: Request | None = None) -> str:
  """The human report: context, top plans, baselines, caveats."""
  c, prof = result.cluster, result.profile
  lines = _context_lines(c, prof, cfg)
  lines.append(
    f'searched {result.evaluated} plans in {result.search_s:.2f} s; times are '
    "SIMULATED predictions (lockstep = what triax's executor runs; async = the "
    "papers' model)"
  )
  flops = _model_flops(cfg)
  width = max([58] + [len(e.plan.describe()) for e in result.top])
  head = (
    f'{"#":>2}  {"plan":{width}s} {"step ms":>9} {"async ms":>9} {"bubble":>6} {"GiB/dev":>7} '
    f'{"TF/s/dev":>8}  devices (per stage)'
  )
  lines += ['', head]
  for i, e in enumerate(result.top):
    lines.append(
      f'{i + 1:>2}  {e.plan.describe():{width}s} {_ms(e.step_time)} '
      f'{_ms(e.async_time)} {evaluate.percent(e.bubble_fraction):>6} '
      f'{e.peak_memory / 2**30:7.3f} {_tflops(flops, e, c.num_devices):>8}  '
      f'{_stages(e.plan)}'
    )
  lines.append(
    '  TF/s/dev: model FLOPs per step (no recompute: what MFU counts) over step time x devices'
  )
  lines += ['', 'baselines (speedup of #1 over each):']
  for key, name in baselines_lib.NAMES.items():
    e = result.baselines.get(key)
    if e is None:
      lines.append(f'  {name:50s}   ({_no_baseline(key, cfg, c.num_devices)})')
      continue
    lines.append(
      f'  {name:50s} {_ms(e.step_time)} ms  {result.speedup(key):5.2f}x  [{e.plan.describe()}]'
    )
  best = result.top[0].plan
  lines.append('')
  for s, devs in enumerate(best.stages[:8]):
    kinds = sorted({c.devices[d].group for d in devs})
    lines.append(
      f'  #1 stage {s}: {best.layers[s]} layers on devices {emit.device_ranges(devs)} ({"/".join(kinds)})'
    )
  if len(best.stages) > 8:
    lines.append(f'  ... {len(best.stages) - 8} more stages')
  held = _synthesized(best)
  if held is not None:
    lines.append(
      f'note: #1 runs a synthesised schedule ({held["sets"]} residual sets and {held["cuts"]} '
      "cuts per stage at most, what this memory leaves; triax.pipeline.synthesis's heuristic "
      "under the plan's costs); the plan file holds it"
    )
  if c.heterogeneous:
    lines.append(
      'note: the plan file sets mesh.device_order, so the trainer places '
      'the stages on the devices above'
    )
  if request and request.out:
    lines.append(f'wrote {request.out}: {train_command(request.out, c)}')
  elif request:
    lines.append(
      f'(--out=plan.py writes #1 as a config file to train from: {train_command("plan.py", c)})'
    )
  if request and request.trace:
    lines.append(f'wrote {request.trace} (open in https://ui.perfetto.dev)')
  if request is None or request.verbose:
    lines += ['', *_measurements(prof)]
  elif prof.points:
    lines.append('(--verbose prints the measurements behind the profile)')
  return '\n'.join(lines)


def _no_baseline(key: str, cfg, devices: int) -> str:
  """Why a baseline has no plan: a batch too small for data parallelism
  over every device is not a plan that ran out of memory."""
  batch = cfg.train.global_batch_size
  if key in ('data_parallel', 'zero3') and batch % devices:
    return f'none: a global batch of {batch} does not split evenly over {devices} devices'
  return 'none fits'


def train_command(plan_path: str, cluster) -> str:
  """The command that runs a plan file, as it must be typed: on a cluster of
  this machine's forced CPU devices the trainer needs their count too."""
  cpu = f' --cpu_devices={cluster.num_devices}' if cluster.local else ''
  return f'python -m triax train --config={plan_path} --workdir=DIR{cpu}'


def _model_flops(cfg) -> float | None:
  """Model FLOPs of one step (the family's count, no recompute), or None."""
  try:
    from triax.model import flops as flops_lib
    from triax.model import registry

    model = registry.build(registry.spec_from_config(cfg.model))
    return flops_lib.step_flops(model, cfg.train.global_batch_size)['model']
  except Exception:  # pylint: disable=broad-except
    return None  # a family without forward_flops: the column stays empty


def _tflops(flops: float | None, e: Estimate, devices: int) -> str:
  if flops is None:
    return ''
  x = flops / (e.step_time * devices) / 1e12
  return f'{x:.1f}' if x >= 1 else f'{x:.2g}'  # a tiny model's rate still reads


def _stages(plan) -> str:
  """What tells look-alike plans apart: each stage's devices (and layers)."""
  text = ' | '.join(
    f'{emit.device_ranges(devs)}:{n}' if not plan.even else emit.device_ranges(devs)
    for devs, n in zip(plan.stages, plan.layers)
  )
  return text if len(text) <= 60 else text[:57] + '...'


def _measurements(prof) -> list[str]:
  m = prof.machine
  lines = []
  for p in prof.points:
    together = (
      f', {p.concurrent * 1e3:8.3f} ms with all {m.num_devices} at once' if p.concurrent else ''
    )
    lines.append(
      f'  measured {p.function:19s} b={p.microbatch:<3d} t={p.tensor}: '
      f'{p.seconds * 1e3:8.3f} ms alone{together} (fit {p.fitted * 1e3:8.3f} ms, '
      f'{p.flops / 1e6:.0f} MFLOP)'
    )
  if prof.ratios:
    lines.append(
      '  executor variants / plain layer pair (alone, all devices at once): '
      + ', '.join(f'{k} {a:.2f}/{b:.2f}' for k, (a, b) in prof.ratios.items())
    )
  return lines


def main(request: Request, as_json: bool = False) -> int:
  """Runs the request; returns the exit status (2 for bad input, 3 for a
  verified plan or an evaluated layout that does not fit)."""
  try:
    summary = run(request, as_json=as_json)
  except ConfigError as e:
    print(f'error: {e.key}: {e.message}', file=sys.stderr)
    return 2
  if summary.get('verify', {}).get('fits') is False or summary.get('fits') is False:
    # cli.EXIT_DOES_NOT_FIT, as train --compile_only --topology: the compiled
    # plan, or the layout --evaluate priced, does not fit.
    return 3
  return 0


def _moe_imbalance(request: Request) -> float:
  """--moe_imbalance, checked: the busiest expert's load over the mean."""
  x = request.moe_imbalance
  if isinstance(x, bool) or not isinstance(x, (int, float)) or not x >= 1:
    raise ConfigError(
      '--moe_imbalance',
      f"must be a number >= 1 (the busiest expert's tokens over the mean; 1 = balanced), got {x!r}",
    )
  return float(x)
