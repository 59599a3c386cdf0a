"""The exhaustive strategy maker (`--search=exhaustive`): enumerate, balance, simulate, rank.

`search(cfg, cluster, top_k, options, profile)` tries every layout layouts.py enumerates
(data x context x tensor x pipe over the device count, sequence parallelism, a MoE model's
expert degree, micro-batches, virtual stages and every schedule the config validator
accepts for those sizes), and for each evaluate.py's device assignments, layer partitions
(the even split and partition.balance's under each stage's memory), remat policies and
state shardings (candidate.STATE_SHARDINGS); synthesized.py adds a synthesised schedule
where memory leaves the named ones bubble. Each plan is simulated (ranked by the lockstep
model, the executor's, unless `options` say otherwise).

Returns a `SearchResult`: the `top_k` fastest plans that fit in memory and that triax's
config validator accepts, and baselines (baselines.py's, and this search rerun on the
cluster made of its slowest device type). Ties rank the plan without context parallelism,
then without sequence parallelism, first. Remat other than 'none' is tried only where
'none' runs out of memory, unless remat was measured on this machine.
What is enumerated and why: docs/design/planner_search.md."""

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
