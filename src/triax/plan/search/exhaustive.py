"""The exhaustive strategy maker (`--search=exhaustive`): enumerate, balance, simulate, rank.

For a model config and a cluster it tries every

  data x context x tensor x pipe  whose product is the device count (tensor
                        must divide heads, d_ff and vocabulary; context c
                        needs seq_len % 2c == 0, the load-balanced split,
                        the xla attention path, and gives each rank at
                        least MIN_CONTEXT_POSITIONS positions),
  sequence parallelism  off, and on where tensor > 1 and seq_len splits
                        over context x tensor,
  expert degree         a MoE model's mesh.expert: each divisor of data that
                        divides num_experts (1 for a dense model);
  micro-batches m       dividing the per-replica batch (size = B / (d m));
                        pipe = m = 1 only for a family whose spec refuses
                        the pipeline executor (Spec.executor_refusal),
  virtual stages v,     schedule (every entry of schedule.SCHEDULES the
                        config validator accepts for those sizes),
  assignment            of devices to pipeline stages: by speed, fastest
                        first or last, or in node order,
  layer partition       the even split and the dynamic program's
                        (partition.balance) under each stage's memory,
  remat                 'none', or 'attention' / 'dots' / 'full' (in that
                        order, the first that fits) only where 'none' runs
                        out of memory (on paper recomputation never speeds
                        up); all four where they were measured on this
                        machine (on XLA:CPU full remat can be faster),
  state sharding        with data > 1: replicated, ZeRO-1 (moments over
                        data) and FSDP (parameters too; d_model must
                        divide by data): candidate.STATE_SHARDINGS,

(layouts.py: the layouts; evaluate.py: devices, splits, remat and state
sharding of each, priced; synthesized.py: a synthesised schedule where the
device's memory leaves the named ones bubble), simulates each (ranking by the lockstep model,
the executor's, unless asked otherwise) and keeps the fastest plans that fit in memory and that
triax's config validator accepts. Of plans predicted equally fast, the one
without context parallelism, then without sequence parallelism ranks first
(the simpler mesh; plans without them read as they did). Baselines, always
reported beside the winner: baselines.py's, this search's plans for the
cluster made of its slowest device type being the whole search again.
"""

from __future__ import annotations

import dataclasses
import time

from triax.plan.candidate import Estimate, Options
from triax.plan.cluster import Cluster
from triax.plan.cost import profile as profile_lib
from triax.plan.search import baselines as baselines_lib
from triax.plan.search import evaluate
from triax.plan.search.layouts import layouts, profile_sizes


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """The ranked plans, the baselines and what the search cost (either search's answer).

  Attributes:
    top: best plans first (no OOM), at most `top_k`.
    baselines: baselines.BASELINES to the plan (None when there is no such
      plan that fits); see plan/search/baselines.py.
    evaluated: candidate plans simulated.
    search_s: seconds spent searching (profiling excluded).
    profile: the profile used (None: nothing searched, no layout suits).
    cluster: the cluster planned for.
  """

  top: tuple[Estimate, ...]
  baselines: dict[str, Estimate | None]
  evaluated: int
  search_s: float
  profile: profile_lib.Profile | None
  cluster: Cluster

  def speedup(self, baseline: str) -> float | None:
    base = self.baselines.get(baseline)
    if base is None or not self.top:
      return None
    return base.step_time / self.top[0].step_time


def search(
  cfg,
  cluster: Cluster,
  top_k: int = 5,
  options: Options = Options(),
  profile: profile_lib.Profile | None = None,
) -> SearchResult:
  """Finds the fastest plans for `cfg` (a config) on `cluster`.

  Args:
    cfg: the experiment config (model, train.global_batch_size, ...).
    cluster: the cluster spec.
    top_k: how many plans to return.
    options: simulator options.
    profile: a profile to use; by default the model is profiled here for
      every tensor degree and micro-batch size the candidates need.

  Returns:
    A SearchResult; with no top plans and no baselines when no layout of
    the cluster's devices suits the model (`layouts.no_layout` says why).
  """
  n = cluster.num_devices
  all_layouts = list(layouts(cfg, n))
  if not all_layouts:
    # Not an error here: a benchmark over every shipped cluster meets specs
    # too large for its model (report.run turns it into one).
    empty = dict.fromkeys(baselines_lib.BASELINES)
    return SearchResult((), empty, 0, 0.0, profile, cluster)
  if profile is None:
    profile = profile_lib.measure(cfg.model, *profile_sizes(cfg, all_layouts))
  else:  # a given profile bounds the tensor degrees
    all_layouts = [l for l in all_layouts if l.tensor in profile.shards]
  started = time.perf_counter()
  found = evaluate.evaluate(cfg, cluster, profile, options, all_layouts, synthesize=True)
  top = evaluate.top_plans(cfg, found, top_k, n)

  def on_slowest(slow: Cluster):
    plans = evaluate.evaluate(cfg, slow, profile, options, all_layouts, synthesize=True)
    return sorted((e for e in plans if not e.oom), key=evaluate.rank)

  best = top[0] if top else None
  baselines = baselines_lib.compute(cfg, cluster, profile, options, best, found, found, on_slowest)
  return SearchResult(
    top=tuple(top),
    baselines=baselines,
    evaluated=len(found),
    search_s=time.perf_counter() - started,
    profile=profile,
    cluster=cluster,
  )
