"""Measures the configured model on the local backend (JAX): `measure` -> a measured `Profile`.

For each tensor degree t, a shard of one layer (num_heads/t heads, d_ff/t MLP columns,
vocab_size/t rows: the real `Block` of triax.model) runs on one device; the Megatron
all-reduces between shards are not in it (the simulator adds them from the link model).
Measured, warm and jitted, median of a few runs:

- a chunk's forward and forward+backward as the executor runs them, per remat policy asked
  for (the backward is the difference), and the embedding's and head's;
- once, the executor's variants of a layer as ratios to its plain pair (EXECUTOR_RATIOS);
- with several local devices, each function again on all of them at once (its effective
  cores), and ppermute / all-reduce times fitted as latency + bytes / bandwidth;
- this backend's matmul rate and copy bandwidth (plan/cost/microbench.py).

FLOPs and bytes come from XLA's cost analysis of the lowered functions and residual bytes
from `jax.eval_shape` of the chunk's vjp (no execution). Times at other shapes and on other
devices follow time = c0 + k * max(flops / peak, bytes / bandwidth), (c0, k) fitted per
function here. A grouped entry (model.moe_every = n) is measured by entries and reported
per average block. Results are cached per (model, tensor degrees, micro-batch sizes).
Why each measurement is there: docs/design/planner_costs.md."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from triax.plan.cluster import Link
from triax.plan.cost import microbench
from triax.plan.cost.profile import (
  FUNCTIONS,
  LAYER_FUNCTIONS,
  REMATS,
  STACK_LENGTHS,
  Fit,
  Machine,
  Point,
  Profile,
  Shard,
  Work,
  experts_of,
  kv_per_seq,
  variant,
  window_of,
)

# Rounds over every timed function (the fastest round is kept).
_ROUNDS = 2
# Largest micro-batch measured, in tokens: keeps profiling to seconds.
_MAX_MEASURED_TOKENS = 2048
# Micro-batch sizes measured at the smallest tensor degree, at most.
_MAX_SIZES = 6
# Threads compiling at once, at most one per core: XLA compiles outside the
# GIL but tracing holds it, and more threads than cores only contend (they
# took more CPU time for the same programs).
_COMPILE_THREADS = 4


def _quiet(line: str) -> None:
  del line


# Where progress lines go during a `measure` call (its `progress` argument).
_PROGRESS: list[Callable[[str], None]] = [_quiet]


def _say(line: str) -> None:
  _PROGRESS[0](line)


def measure(
  model_cfg,
  tensors: Sequence[int],
  microbatches: Sequence[int],
  remats: Sequence[str] = REMATS,
  progress: Callable[[str], None] | None = None,
) -> Profile:
  """Profiles `model_cfg` (config.model) for the given degrees and sizes.

  Args:
    model_cfg: the model config group (num_layers, d_model, ...).
    tensors: tensor degrees t the search considers (each divides heads, d_ff
      and vocab).
    microbatches: per-replica micro-batch sizes b the search considers.
    remats: remat policies whose layer costs are measured ('none' always is);
      the simulator derives the others from FLOPs.
    progress: called with a line per step and per timed function (a
      profile takes minutes here; people want to see it move).

  Returns:
    A Profile; repeated calls with the same arguments return the cached one.
  """
  remats = tuple(r for r in REMATS if r in set(remats) | {'none'})
  key = (
    _model_key(model_cfg),
    tuple(sorted(set(tensors))),
    tuple(sorted(set(microbatches))),
    remats,
  )
  _PROGRESS[0] = progress or _quiet
  try:
    return _measure_cached(*key)
  finally:
    _PROGRESS[0] = _quiet


def _model_key(model_cfg):
  """What a profile depends on: the family's whole spec but remat (measured per policy)."""
  from triax.model import registry

  return dataclasses.replace(registry.spec_from_config(model_cfg), remat='none')


@functools.lru_cache(maxsize=16)
def _measure_cached(
  model_key, tensors: tuple[int, ...], microbatches: tuple[int, ...], remats: tuple[str, ...]
) -> Profile:
  started = time.perf_counter()
  spec = dataclasses.asdict(model_key)
  prof = _Profiler(model_key)
  shards = {t: prof.shard(t) for t in tensors}
  _say(f'profile: shapes, FLOPs and residual bytes of tensor degrees {list(tensors)}')
  machine = prof.machine()
  _say(
    f'profile: this machine: matmul {machine.matmul_flops / 1e9:.1f} GFLOP/s, copy '
    f'{machine.memory_bandwidth / 1e9:.1f} GB/s, {machine.num_devices} devices'
  )
  points = prof.time_points(_points_to_measure(tensors, microbatches, spec['seq_len'], remats))
  executor = prof.executor_ratios(
    min(tensors),
    min(max(microbatches), max(1, _MAX_MEASURED_TOKENS // spec['seq_len'])),
    remats,
  )
  roof = {p: shards[p[2]].work[p[0].split('/')[0]] for p in points}
  fits = {}
  n = machine.num_devices
  for function in sorted({p[0] for p in points}):
    mine = [(p, s) for p, s in points.items() if p[0] == function]
    xs = [
      max(
        roof[p].flops(p[1]) / machine.matmul_flops, roof[p].bytes(p[1]) / machine.memory_bandwidth
      )
      for p, _ in mine
    ]
    fit = _fit(xs, [solo for _, (solo, _) in mine])
    together = [(solo, conc) for _, (solo, conc) in mine if conc > 0]
    if together:
      # Median over the sizes measured; a function never runs at more than N
      # devices' worth, nor at less than one device's.
      ratios = sorted(min(float(n), max(1.0, n * solo / conc)) for solo, conc in together)
      fit = dataclasses.replace(fit, cores=ratios[len(ratios) // 2])
    fits[function] = fit
  profile = Profile(
    seq_len=spec['seq_len'],
    d_model=spec['d_model'],
    num_layers=spec['num_layers'],
    dtype=spec['dtype'],
    shards=shards,
    fits=fits,
    machine=machine,
    layers_per_entry=model_key.layers_per_entry,
  )
  rows = tuple(
    Point(
      function=f,
      microbatch=b,
      tensor=t,
      seconds=solo,
      fitted=profile.fitted_seconds(f, b, t),
      flops=shards[t].work[f.split('/')[0]].flops(b),
      concurrent=conc,
    )
    for (f, b, t), (solo, conc) in sorted(points.items())
  )
  return dataclasses.replace(
    profile, points=rows, ratios=executor, wall_s=time.perf_counter() - started
  )


def _points_to_measure(
  tensors, microbatches, seq_len, remats=('none',)
) -> list[tuple[str, int, int]]:
  """The (function, b, t) points that pin the fits: the layer at small and
  large b at every t and at every size at the smallest t, under each remat
  policy (the simulator interpolates between them on this machine);
  compiles dominate profiling, so few sizes elsewhere."""
  cap = max(1, _MAX_MEASURED_TOKENS // seq_len)
  bs = sorted({min(b, cap) for b in microbatches})
  lo, hi = bs[0], bs[-1]
  # Per-sequence cost is not flat in b on a cache-bound CPU, nor smooth: a
  # line from b=1 to b=4 missed the measured b=2 badly, most for full
  # remat's backward. So every size the search considers is measured
  # at the smallest degree, where most plans are (at most _MAX_SIZES,
  # spread evenly in log b); other degrees get the two ends.
  if len(bs) > _MAX_SIZES:
    logs = [math.log(b) for b in bs]
    want = [logs[0] + (logs[-1] - logs[0]) * i / (_MAX_SIZES - 1) for i in range(_MAX_SIZES)]
    bs = sorted({min(bs, key=lambda b: abs(math.log(b) - w)) for w in want})
  pairs = {(b, t) for b in (lo, hi) for t in tensors} | {(b, min(tensors)) for b in bs}
  out = []
  for remat in remats:
    for b, t in sorted(pairs):
      out += [(variant('layer_fwd', remat), b, t), (variant('layer_bwd', remat), b, t)]
  # The embedding and head are small and linear in b: one point each.
  out += [('embed', hi, min(tensors)), ('head', hi, min(tensors))]
  return out


def _fit(roofline: Sequence[float], seconds: Sequence[float]) -> Fit:
  """Least squares on relative error for time = c0 + k * roofline; c0 >= 0, k > 0."""
  x, y = np.asarray(roofline, float), np.asarray(seconds, float)
  if len(x) == 1 or np.ptp(x) <= 1e-12 * max(x.max(), 1e-30):
    return Fit(0.0, float(np.mean(y / x)))
  w = 1.0 / y  # relative-error weights
  a = np.stack([w, w * x], axis=1)
  c0, k = np.linalg.lstsq(a, np.ones_like(y), rcond=None)[0]
  if c0 < 0 or k <= 0:
    return Fit(0.0, float(np.sum(x * y * w * w) / np.sum(x * x * w * w)))
  return Fit(float(c0), float(k))


class _Profiler:
  """The JAX side: builds shard models, lowers, compiles and times them."""

  def __init__(self, model_spec):
    import jax

    self.jax = jax
    self.model_spec = model_spec  # the family's ModelSpec (model/common.py)
    self.spec = dataclasses.asdict(model_spec)
    # Blocks a stack entry holds: a measured entry's figures over it are the average block's.
    self.every = model_spec.layers_per_entry
    self._functions = {}
    # (name, b, t, remat) -> (alone, all devices at once) seconds per call,
    # of every function timed so far (executor_ratios reuses the layer pair).
    self._timed = {}

  # -- shapes and cost analysis (lowering only: cheap) --

  def _model(self, t: int, remat: str = 'none'):
    from triax.model import registry

    return registry.build(dataclasses.replace(self.model_spec.tensor_shard(t), remat=remat))

  def _stack(self, model, layers: int):
    jax = self.jax
    stack = jax.eval_shape(model.init, jax.random.key(0))['layers']
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((layers,) + a.shape[1:], a.dtype), stack)

  def _act(self, b: int):
    import jax.numpy as jnp

    return self.jax.ShapeDtypeStruct(
      (b, self.spec['seq_len'], self.spec['d_model']), jnp.dtype(self.spec['dtype'])
    )

  def _tokens(self, b: int):
    import jax.numpy as jnp

    return self.jax.ShapeDtypeStruct((b, self.spec['seq_len']), jnp.int32)

  def functions(
    self, t: int, b: int, layers: int = 1, remat: str = 'none'
  ) -> dict[str, tuple[Callable, tuple]]:
    """name -> (function, abstract args) for the timed functions (cached:
    tracing the model for shapes is the slow part of building them):
    layer_fwd, layer_fwd_bwd (forward then backward in one program, as the
    executor runs them), embed and head."""
    key = (t, b, layers, remat)
    if key not in self._functions:
      self._functions[key] = self._build_functions(t, b, layers, remat)
    return self._functions[key]

  def _build_functions(self, t: int, b: int, layers: int, remat: str) -> dict:
    jax = self.jax
    import jax.numpy as jnp

    model = self._model(t, remat)
    stack = self._stack(model, layers)
    x, tok = self._act(b), self._tokens(b)
    # As the stages call them: a tied head reads the embedding table too.
    embed_params, head_params = model.edge_params(jax.eval_shape(model.init, jax.random.key(0)))
    edges = {'embed': embed_params, 'head': head_params}
    fwd = lambda p, x: jax.vjp(model.layers, p, x)

    def fwd_bwd(p, x):
      y, back = jax.vjp(model.layers, p, x)
      return back(y)

    def embed(e, tokens):
      y, back = jax.vjp(lambda e: model.embed(e, tokens), e)
      return back(y)

    def under_cond(active):
      def pair(p, x):
        y, back = jax.vjp(lambda p, x: model.layers(p, x, jnp.int32(active)), p, x)
        return back(y)

      return pair

    head = jax.value_and_grad(model.head_loss, argnums=(0, 1))
    return {
      'layer_fwd': (fwd, (stack, x)),
      'layer_fwd_bwd': (fwd_bwd, (stack, x)),
      'cond_active': (under_cond(layers), (stack, x)),
      'cond_skipped': (under_cond(0), (stack, x)),
      'embed': (embed, (edges['embed'], tok)),
      'head': (head, (edges['head'], x, tok)),
    }

  def split_functions(
    self, t: int, b: int, layers: int, remat: str = 'none'
  ) -> dict[str, tuple[Callable, tuple]]:
    """'split_b' and 'split_w' -> (function, abstract args): the executor's
    B and W of a layer stack, each on its own (as its B and W branches run
    them): SplitBackward of the stack's vjp, B fed the residuals and an
    output gradient, W the residuals and B's cut. Timing 'input gradient
    only' and 'weight gradient only' of the whole vjp instead measured what
    XLA keeps of each (a W with most of the input gradient chain: B + W =
    1.2 backwards here) rather than the split. Built on demand (cached):
    only the executor ratios' point times them, and splitting the traced
    backward is the slow part."""
    key = ('split', t, b, layers, remat)
    if key not in self._functions:
      model = self._model(t, remat)
      split_b, split_w = self._split_backward(
        model.layers, self._stack(model, layers), self._act(b)
      )
      self._functions[key] = {'split_b': split_b, 'split_w': split_w}
    return self._functions[key]

  def _split_backward(self, layers_fn, stack, x):
    jax = self.jax
    from triax.pipeline.split_backward import SplitBackward

    found = {}

    def residuals(p, x):
      y, vjp_fn = jax.vjp(layers_fn, p, x)
      leaves, found['tree'] = jax.tree.flatten(vjp_fn)
      return leaves, y

    res, y = jax.eval_shape(residuals, stack, x)
    split = SplitBackward(lambda r, g: jax.tree.unflatten(found['tree'], r)(g), res, y)
    return (split.b, (res, y)), (split.w, (res, split.cut_shapes))

  def _work(
    self,
    t: int,
    function: str,
    stash_per_seq: float,
    act_per_seq: float,
    layer_params: float,
    edge_params: float,
  ) -> Work:
    """FLOPs from XLA's cost analysis of the lowered function (at b = 1 and 2);
    bytes from the tensors a fused kernel must move: the unoptimised HLO's
    "bytes accessed" counts every intermediate and would make any layer look
    memory-bound."""

    def count(name, b):
      fn, args = self.functions(t, b)[name]
      c = self.jax.jit(fn).lower(*args).cost_analysis()
      c = c[0] if isinstance(c, (list, tuple)) else c
      return float(c.get('flops', 0.0))

    def flops(b):
      if function == 'layer_bwd':  # timed (and counted) as the pair minus the forward
        return count('layer_fwd_bwd', b) - count('layer_fwd', b)
      return count(function, b)

    logits = self.spec['seq_len'] * self.spec['vocab_size'] // t * 4
    fixed, per_seq = {
      # weights read; input read, output and residuals written
      'layer_fwd': (layer_params, 2 * act_per_seq + stash_per_seq),
      # weights read, weight gradients written; residuals, output gradient
      # read, input gradient written
      'layer_bwd': (2 * layer_params, 2 * act_per_seq + stash_per_seq),
      # table rows gathered, then scattered back as gradients
      'embed': (edge_params / 2, 3 * act_per_seq),
      # output layer read and its gradient written; logits and their
      # gradient written and read
      'head': (edge_params, 2 * act_per_seq + 4 * logits),
    }[function]
    per = self.every if function in LAYER_FUNCTIONS else 1  # an entry's blocks
    return Work(flops_per_seq=flops(2) / (2 * per), bytes_fixed=fixed, bytes_per_seq=per_seq)

  def _stash_bytes(self, t: int, remat: str, layers: int, b: int = 1) -> float:
    """Residual bytes the executor stashes for a chunk of `layers` layers."""
    jax = self.jax
    model = self._model(t, remat)

    def probe(params, x):
      _, vjp_fn = jax.vjp(model.layers, params, x)
      weights = jax.tree.leaves(params)
      return [leaf for leaf in jax.tree.leaves(vjp_fn) if not any(leaf is w for w in weights)]

    shapes = jax.eval_shape(probe, self._stack(model, layers), self._act(b))
    return float(sum(math.prod(s.shape) * s.dtype.itemsize for s in shapes))

  def shard(self, t: int) -> Shard:
    jax = self.jax
    model = self._model(t)
    nbytes = lambda tree: float(
      sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))
    )
    edges = jax.eval_shape(model.init, jax.random.key(0))
    stash = {}
    fixed = 0.0
    for remat in REMATS:
      one, two = self._stash_bytes(t, remat, 1), self._stash_bytes(t, remat, 2)
      stash[remat] = (two - one) / self.every
      if remat == 'none':
        fixed = max(one - (two - one), 0.0)
    s, d = self.spec['seq_len'], self.spec['d_model']
    # The shard's own layer FLOPs, by its family (fewer heads, K/V heads, MLP columns).
    flops = model.forward_flops()
    matmuls, attention = flops['layer_matmul'], flops['layer_attention']
    dtype_bytes = np.dtype(self.spec['dtype']).itemsize
    act = float(s * d * dtype_bytes)
    layer_params = nbytes(self._stack(model, 1)) / self.every
    edge_params = nbytes(edges['embed']) + nbytes(edges['head'])
    work = {f: self._work(t, f, stash['none'], act, layer_params, edge_params) for f in FUNCTIONS}
    return Shard(
      tensor=t,
      work=work,
      layer_param_bytes=layer_params,
      edge_param_bytes=edge_params,
      stash_per_seq=stash,
      stash_fixed_per_seq=fixed,
      act_per_seq=act,
      # model.loss_chunk: the fp32 logits live that many positions at a time.
      logits_per_seq=float(min(self.spec['loss_chunk'] or s, s) * self.spec['vocab_size'] // t * 4),
      attention_fraction=attention / (matmuls + attention),
      kv_per_seq=kv_per_seq(self.model_spec, t),
      window=window_of(self.model_spec),
      experts=experts_of(self.model_spec.tensor_shard(t), matmuls + attention),
    )

  # -- timing (compiles: the expensive part) --

  def _compile_all(self, jobs: dict) -> dict:
    """Compiles in threads (XLA compiles outside the GIL; helps where cores are free)."""
    jax = self.jax

    def compile_one(item):
      fn, args = item
      return jax.jit(fn).lower(*args).compile()

    with concurrent.futures.ThreadPoolExecutor(max_workers=_compile_threads()) as pool:
      return dict(zip(jobs, pool.map(compile_one, jobs.values())))

  def _host_values(self, args):
    """Host (numpy) values for abstract args: integers 0..6 in turn, floats
    N(0, 0.02). Built on the host and put on devices as they are: jnp ops
    here compiled a conversion, broadcast and reslicing per shape (about
    100 programs for a small model, besides the ones timed)."""
    jax = self.jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(args)
    out = []
    for i, a in enumerate(leaves):
      if jnp.issubdtype(a.dtype, jnp.integer):
        out.append((np.arange(math.prod(a.shape)).reshape(a.shape) % 7).astype(a.dtype))
      else:
        out.append(np.random.default_rng(i).normal(0, 0.02, a.shape).astype(a.dtype))
    return jax.tree.unflatten(tree, out)

  def time_points(self, points: Sequence[tuple[str, int, int]]) -> dict:
    """(function, b, t) -> (solo, concurrent) median seconds per layer
    (layer functions) or per call; concurrent is every local device running
    it at once (0.0 with one device).

    A layer backward is timed as forward+backward in one program minus the
    forward: the executor runs them in one program, and on XLA:CPU that is
    not what a backward fed the forward's outputs costs on its own.
    """
    layers = min(2, self.model_spec.stack_depth)
    jobs = {}
    for function, b, t in points:
      base, _, remat = function.partition('/')
      remat = remat or 'none'
      name = 'layer_fwd_bwd' if base == 'layer_bwd' else base
      stack = layers if base in LAYER_FUNCTIONS else 1
      jobs[(name, b, t, remat)] = self.functions(t, b, stack, remat)[name]
    n = len(self.jax.local_devices())
    timed = self._time_all(jobs)
    for key, (solo, together) in timed.items():
      per = layers * self.every if key[0].startswith('layer') else 1
      timed[key] = (solo / per, together / per if n > 1 else 0.0)
    out = {}
    for function, b, t in points:
      base, _, remat = function.partition('/')
      remat = remat or 'none'
      if base == 'layer_bwd':
        both, fwd = timed[('layer_fwd_bwd', b, t, remat)], timed[('layer_fwd', b, t, remat)]
        out[(function, b, t)] = tuple(_backward_part(x, y) for x, y in zip(both, fwd))
      else:
        out[(function, b, t)] = timed[(base, b, t, remat)]
    return out

  def _time_all(self, jobs: dict) -> dict:
    """key -> (alone, all local devices at once; inf with one device) seconds
    per call of each (function, abstract args) in `jobs`, compiled both ways.

    Rounds over all functions, keeping each one's fastest round: other
    processes and the scheduling of 8 device threads on a few cores only
    ever slow a run down, and in separate rounds they rarely hit the same
    function twice (one round's medians varied by up to 25% here).
    """
    n = len(self.jax.local_devices())
    host = {k: self._host_values(abstract) for k, (_, abstract) in jobs.items()}
    args = {k: self.jax.device_put(a) for k, a in host.items()}
    stacked = {k: self._stacked(a) for k, a in host.items()} if n > 1 else {}
    _say(
      f'profile: compiling {len(jobs)} functions'
      + (f', alone and on all {n} devices' if n > 1 else '')
    )
    started = time.perf_counter()
    compiled = self._compile_all(jobs)
    shared = (
      self._compile_all({k: (self._on_every_device(fn), stacked[k]) for k, (fn, _) in jobs.items()})
      if n > 1
      else {}
    )
    _say(f'profile: compiled in {time.perf_counter() - started:.0f} s; timing')
    timed = {}
    for r in range(_ROUNDS):
      for i, key in enumerate(jobs):
        solo = microbench.median_time(compiled[key], args[key])
        together = microbench.median_time(shared[key], stacked[key]) if n > 1 else math.inf
        old = timed.get(key, (math.inf, math.inf))
        timed[key] = (min(old[0], solo), min(old[1], together))
        name, b, t, remat = key
        _say(
          f'profile: round {r + 1}/{_ROUNDS}, {i + 1}/{len(jobs)}: {name} b={b} t={t} '
          f'remat={remat}: {solo * 1e3:.2f} ms'
        )
    self._timed.update(timed)
    return dict(timed)

  def executor_ratios(self, t: int, b: int, remats: Sequence[str] = ('none',)) -> dict:
    """EXECUTOR_RATIOS at (b, t): name -> (alone, all at once), for remat
    none; the split and chunk-length ones again per other policy in
    `remats`, named NAME/POLICY (remat moves work between B and W: B reruns
    the forward and hands W what it rematerialised in the cut).

    The plain layer pair comes from time_points' measurement at (b, t) when
    it made one (it does: the largest size at every degree)."""
    layers = min(2, self.model_spec.stack_depth)  # chunk lengths in entries, as the scan's
    stacks = [n for n in STACK_LENGTHS if n != layers and n <= self.model_spec.stack_depth]
    jobs = {}
    for remat in remats:
      built = {**self.functions(t, b, layers, remat), **self.split_functions(t, b, layers, remat)}
      names = ('layer_fwd', 'layer_fwd_bwd', 'split_b', 'split_w')
      if remat == 'none':
        names += ('cond_active', 'cond_skipped')
      jobs.update({(k, b, t, remat): built[k] for k in names})
      # The same layer in chunks of other lengths (a stage's chunk is the
      # executor's scan over its layers; one layer is not a loop at all).
      for n in stacks:
        other = self.functions(t, b, n, remat)
        for k in ('layer_fwd', 'layer_fwd_bwd'):
          jobs[(f'{k}@{n}', b, t, remat)] = other[k]
    self._time_all({key: job for key, job in jobs.items() if key not in self._timed})
    single = len(self.jax.local_devices()) == 1
    timed = {}
    for key in jobs:
      solo, together = self._timed[key]
      timed[(key[0], key[3])] = (solo, solo if single else together)
    out = {}
    for remat in remats:
      tag = '' if remat == 'none' else f'/{remat}'
      for i in range(2):
        fwd, pair = timed[('layer_fwd', remat)][i], timed[('layer_fwd_bwd', remat)][i]
        bwd = _backward_part(pair, fwd)
        for k in ('split_b', 'split_w'):
          out.setdefault(k + tag, [0.0, 0.0])[i] = timed[(k, remat)][i] / bwd
        if remat == 'none':
          for k in ('cond_active', 'cond_skipped'):
            out.setdefault(k, [0.0, 0.0])[i] = timed[(k, remat)][i] / pair
        for n in stacks:
          fwd_n = timed[(f'layer_fwd@{n}', remat)][i]
          pair_n = timed[(f'layer_fwd_bwd@{n}', remat)][i]
          # Per layer in a chunk of n over per layer in the profile's chunk.
          out.setdefault(f'stack{n}_fwd{tag}', [0.0, 0.0])[i] = (fwd_n / n) / (fwd / layers)
          out.setdefault(f'stack{n}_bwd{tag}', [0.0, 0.0])[i] = (
            _backward_part(pair_n, fwd_n) / n
          ) / (bwd / layers)
    return {k: tuple(v) for k, v in out.items()}

  def _on_every_device(self, fn: Callable) -> Callable:
    """fn run by every local device at once on its own copy of the arguments
    (leading axis: one copy per device)."""
    jax = self.jax
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((len(jax.local_devices()),), ('devices',), devices=jax.local_devices())

    def per_device(*args):
      out = fn(*jax.tree.map(lambda a: a[0], args))
      return jax.tree.map(lambda a: a[None], out)

    # check_vma off: the copies never communicate, and a function traced
    # outside shard_map (SplitBackward's halves) mixes its constants with the
    # per-device values.
    return jax.shard_map(
      per_device, mesh=mesh, in_specs=P('devices'), out_specs=P('devices'), check_vma=False
    )

  def _stacked(self, args):
    """Per-device copies of host args (`_host_values`' output), laid out one per local device."""
    jax = self.jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.local_devices()
    mesh = jax.make_mesh((len(devices),), ('devices',), devices=devices)
    sharding = NamedSharding(mesh, P('devices'))
    put = lambda a: jax.device_put(np.broadcast_to(a, (len(devices),) + a.shape), sharding)
    return jax.tree.map(put, args)

  def machine(self) -> Machine:
    jax = self.jax
    import jax.numpy as jnp

    dtype = jnp.dtype(self.spec['dtype'])
    n = 1024
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda a, b: a @ b)
    matmul_flops = (
      2 * n**3 / microbench.median_time(mm.lower(a, a).compile(), (a, a), microbench.QUICK_RUNS)
    )
    devices = jax.local_devices()
    bandwidth, node_bandwidth, cores = microbench.measure_sharing(devices)
    p2p, allreduce = (
      microbench.measure_collectives(devices)
      if len(devices) > 1
      else (Link(math.inf, 0.0), Link(math.inf, 0.0))
    )
    return Machine(
      backend=jax.default_backend(),
      device_kind=devices[0].device_kind,
      num_devices=len(devices),
      matmul_flops=matmul_flops,
      memory_bandwidth=bandwidth,
      node_bandwidth=node_bandwidth,
      effective_cores=cores,
      p2p=p2p,
      allreduce=allreduce,
    )


def _compile_threads() -> int:
  """_COMPILE_THREADS, or the cores this process may run on if fewer."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return max(1, min(_COMPILE_THREADS, cores or 1))


def _backward_part(pair: float, fwd: float) -> float:
  """A backward's time: its forward+backward program's minus the forward's.
  Timing noise could make the difference tiny or negative; a backward is
  never cheaper than a fifth of the pair."""
  return max(pair - fwd, 0.2 * pair)
