"""The learned planner's answer (`--search=learned`), in the exhaustive search's shape."""

from __future__ import annotations

import time

from triax.plan.candidate import Options
from triax.plan.cluster import Cluster
from triax.plan.cost import profile as profile_lib
from triax.plan.learned import decisions, training
from triax.plan.learned.policy import Policy
from triax.plan.search import baselines as baselines_lib
from triax.plan.search import evaluate
from triax.plan.search.exhaustive import SearchResult
from triax.plan.search.layouts import layouts


def search(
  cfg,
  cluster: Cluster,
  top_k: int = 5,
  options: Options = Options(),
  profile: profile_lib.Profile | None = None,
  policy: Policy | None = None,
  samples: int = 63,
  seed: int = 0,
) -> SearchResult:
  """The policy's best plans on `cluster`, with the baselines of
  plan/search/baselines.py: the data-parallel layouts priced apart, and the
  policy's own plans for the cluster made of its slowest type. search_s
  counts the baselines too, as the exhaustive search's does."""
  if profile is None:
    from triax.plan.cost import analytic

    tensors = sorted({l.tensor for l in layouts(cfg, cluster.num_devices)})
    profile = analytic.build(cfg.model, tensors)
  policy = policy or training.trained(cfg)
  started = time.perf_counter()
  space = policy.schema.space
  prob = decisions.problem(cfg, cluster, profile, options, space)
  if prob is None:
    empty = dict.fromkeys(baselines_lib.BASELINES)
    return SearchResult((), empty, 0, 0.0, profile, cluster)
  found = training.infer(policy, prob, samples, seed)
  n = cluster.num_devices
  top = evaluate.top_plans(cfg, found, top_k, n)
  dp = [l for l in prob.layouts if l.data == n]

  def on_slowest(slow: Cluster):
    slow_prob = decisions.problem(cfg, slow, profile, options, space)
    return [] if slow_prob is None else training.infer(policy, slow_prob, samples, seed)

  baselines = baselines_lib.compute(
    cfg,
    cluster,
    profile,
    options,
    top[0] if top else None,
    found,
    evaluate.evaluate(cfg, cluster, profile, options, dp),
    on_slowest,
  )
  return SearchResult(
    top=tuple(top),
    baselines=baselines,
    evaluated=len(prob.cache),
    search_s=time.perf_counter() - started,
    profile=profile,
    cluster=cluster,
  )
