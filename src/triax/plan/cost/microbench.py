"""Micro-benchmarks of this machine: timing a compiled function, memory and core
sharing between local devices, ppermute and all-reduce on the local mesh."""

from __future__ import annotations

import time

import numpy as np

from triax.plan.cluster import Link

# Runs per timing (after one warm-up); the median is kept. On XLA:CPU a
# function's time is bimodal (fresh output buffers fault their pages in or
# not), so a layer needs a few more runs than a micro-benchmark does.
RUNS = 9
QUICK_RUNS = 3
# A timing's runs stop early past this many seconds (at least 3 runs).
TIMING_BUDGET_S = 1.0


def median_time(exe, args, runs: int = RUNS) -> float:
  """Median seconds of `runs` calls after a warm-up; fewer (at least 3) when
  one call is slow enough that the runs would take over TIMING_BUDGET_S."""
  import jax

  jax.block_until_ready(exe(*args))
  times = []
  while len(times) < runs:
    start = time.perf_counter()
    jax.block_until_ready(exe(*args))
    times.append(time.perf_counter() - start)
    if len(times) == 1:
      runs = max(3, min(runs, int(TIMING_BUDGET_S / max(times[0], 1e-9))))
  return float(np.median(times))


def measure_sharing(devices) -> tuple[float, float, float]:
  """What local devices share: memory bandwidth and cores.

  A copy of 64 MiB into a fresh buffer (memory-bound) on one device, then on
  all at once; and a chain of small in-cache matmuls (compute-bound) on the
  first k devices of one program (k a runtime input, so one compile serves
  k = 1 and k = N; the others skip it under `cond`, whose pass-through copy
  of 64 KiB is negligible, unlike a pass-through of the copy's 64 MiB).

  Returns:
    (memory_bandwidth of one device, total bandwidth of all N at once,
    effective cores: N * solo compute time / all-N compute time).
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  n = len(devices)
  words = 16 * 2**20  # 64 MiB of float32
  mesh = jax.make_mesh((n,), ('x',), axis_types=(AxisType.Explicit,), devices=devices)

  def copy(x):
    return x * 1.0001 + 1.0

  def compute(m):
    # 128x128 stays in cache: no memory traffic to speak of.
    return jax.lax.fori_loop(0, 64, lambda _, m: jnp.tanh(m @ m), m)

  def on_first_k(work):
    def body(x, k):
      me = jax.lax.axis_index('x')
      return jax.lax.cond(me < k[0], lambda: work(x[0]), lambda: x[0])[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P('x'), P('x')), out_specs=P('x')))

  put = lambda x: jax.device_put(x, NamedSharding(mesh, P('x')))
  ks = {k: put(jnp.full((n,), k, jnp.int32)) for k in sorted({1, n})}
  t = {}
  one = jax.device_put(jnp.ones((words,), jnp.float32), devices[0])
  t[('copy', 1)] = median_time(jax.jit(copy).lower(one).compile(), (one,), QUICK_RUNS)
  every = put(jnp.ones((n, words), jnp.float32))
  exe = jax.jit(jax.shard_map(copy, mesh=mesh, in_specs=P('x'), out_specs=P('x')))
  t[('copy', n)] = median_time(exe.lower(every).compile(), (every,), QUICK_RUNS)
  small = put(jnp.full((n, 128, 128), 0.01, jnp.float32))
  exe = on_first_k(compute).lower(small, ks[1]).compile()
  for k, kk in ks.items():
    t[('compute', k)] = median_time(exe, (small, kk), QUICK_RUNS)
  nbytes = 2 * 4 * words
  bandwidth = nbytes / t[('copy', 1)]
  node_bandwidth = n * nbytes / t[('copy', n)]
  cores = min(float(n), n * t[('compute', 1)] / t[('compute', n)])
  return bandwidth, node_bandwidth, cores


def measure_collectives(devices) -> tuple[Link, Link]:
  """ppermute and all-reduce on the local mesh at two sizes -> (p2p, ring) fits."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  n, reps = len(devices), 4
  mesh = jax.make_mesh((n,), ('x',), axis_types=(AxisType.Explicit,), devices=devices)
  ring = [(i, (i + 1) % n) for i in range(n)]
  sizes = (256, 2**20)  # floats per device: 1 KiB and 4 MiB

  def program(op):
    def body(x):
      return jax.lax.fori_loop(0, reps, lambda _, y: op(y) * 0.5, x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('x'), out_specs=P('x')))

  p2p = program(lambda y: jax.lax.ppermute(y, 'x', ring))
  # psum's result is the same on every device; the loop carry must stay per-device.
  psum = program(lambda y: jax.lax.pcast(jax.lax.psum(y, 'x'), ('x',), to='varying'))
  out = {}
  for name, prog in (('p2p', p2p), ('psum', psum)):
    for size in sizes:
      x = jax.device_put(jnp.ones((n * size,), jnp.float32), NamedSharding(mesh, P('x')))
      out[(name, size)] = median_time(prog.lower(x).compile(), (x,), QUICK_RUNS) / reps
  (s0, s1) = sizes
  nbytes = (4 * s0, 4 * s1)

  def fit(t0, t1, scale, steps):
    # t = steps * latency + scale * bytes / bandwidth
    slope = max((t1 - t0) / (nbytes[1] - nbytes[0]), 1e-15)
    latency = max((t0 - slope * nbytes[0]) / steps, 0.0)
    return Link(bandwidth=scale / slope, latency=latency)

  p2p_link = fit(out[('p2p', s0)], out[('p2p', s1)], 1.0, 1)
  ring_steps = 2 * (n - 1)
  ar_link = fit(out[('psum', s0)], out[('psum', s1)], 2 * (n - 1) / n, ring_steps)
  return p2p_link, ar_link
