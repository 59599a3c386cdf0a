"""Training the policy (REINFORCE against the simulator) and running it.

`rollout` makes plans decision by decision with the policy's scores;
`train` is REINFORCE: reward = -log (predicted step time), minus a
penalty when the plan runs out of memory (decisions.reward); baseline = a
running mean of the reward per training problem; optax Adam. It trains on
random heterogeneous clusters (catalogue.random_cluster), never on the
shipped specs, so planning those measures what it does on clusters it has
not seen. `infer` is the greedy plan and the best of K samples; `trained`
loads a policy file or trains one and saves it there. Everything is
deterministic given the seed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from triax.plan.candidate import Estimate, Options
from triax.plan.learned import catalogue, decisions
from triax.plan.learned import features as F
from triax.plan.learned import policy as policy_lib
from triax.plan.learned.decisions import Decision, Partial, Problem
from triax.plan.learned.policy import Policy
from triax.plan.search.layouts import layouts

# Rows of every network call (a rollout's plans, padded): one compiled shape.
ROWS = 16
# Inference samples half its plans at the policy's own temperature and half
# flatter (more of the plans near the policy's choice get priced).
INFER_TEMPERATURES = (1.0, 2.0)


def rollout(
  policy: Policy,
  prob: Problem,
  count: int,
  rng: np.random.Generator | None,
  greedy: int = 0,
  temperature: float = 1.0,
) -> list[tuple[Partial, list[tuple[Decision, int]]]]:
  """`count` plans decided together: the first `greedy` take every step's
  argmax (all of them when rng is None), the rest sample at `temperature`."""
  if count > ROWS:
    first = rollout(policy, prob, ROWS, rng, greedy, temperature)
    rest = rollout(policy, prob, count - ROWS, rng, max(0, greedy - ROWS), temperature)
    return first + rest
  parts = [decisions.start(prob) for _ in range(count)]
  trails = [[] for _ in range(count)]
  scores = policy_lib.scores(policy)
  adapt = policy.adapter
  graph = adapt.graph(prob.graph)
  while True:
    decs = [decisions.decision(prob, part) if part.kind() else None for part in parts]
    live = [i for i, dec in enumerate(decs) if dec is not None]
    if not live:
      break
    rows = live + [live[0]] * (ROWS - len(live))
    ctx = adapt('context', np.stack([decs[i].ctx for i in rows]))
    cand = adapt('candidate', np.stack([decs[i].cand for i in rows]))
    node = np.stack([decs[i].node for i in rows])
    mask = np.stack([decs[i].mask for i in rows])
    logits = np.asarray(scores(policy.params, graph, ctx, cand, node, mask), np.float64)
    for row, i in enumerate(live):
      z = logits[row]
      if rng is None or i < greedy:
        index = int(np.argmax(z))
      else:
        p = np.exp((z - z.max()) / temperature) * decs[i].mask
        p /= p.sum()
        index = int(rng.choice(len(z), p=p))
      decisions.apply(prob, parts[i], decs[i], index)
      trails[i].append((decs[i], index))
  return list(zip(parts, trails))


def _batch(trails, adapt: F.Adapter) -> dict:
  """Padded arrays [K, MAX_STEPS, ...] of the decisions taken, in the policy's columns."""
  k, steps = len(trails), decisions.MAX_STEPS
  out = {
    'ctx': np.zeros((k, steps, len(F.COL['context'])), np.float32),
    'cand': np.zeros((k, steps, F.MAX_CANDIDATES, len(F.COL['candidate'])), np.float32),
    'node': -np.ones((k, steps, F.MAX_CANDIDATES), np.int32),
    'mask': np.zeros((k, steps, F.MAX_CANDIDATES), bool),
    'action': np.zeros((k, steps), np.int32),
    'live': np.zeros((k, steps), np.float32),
  }
  out['mask'][..., 0] = True  # padding steps: one candidate, no weight
  for i, trail in enumerate(trails):
    for j, (dec, index) in enumerate(trail):
      out['ctx'][i, j], out['cand'][i, j] = dec.ctx, dec.cand
      out['node'][i, j], out['mask'][i, j] = dec.node, dec.mask
      out['action'][i, j], out['live'][i, j] = index, 1.0
  out['ctx'], out['cand'] = adapt('context', out['ctx']), adapt('candidate', out['cand'])
  return out


def _loss_fn(module: policy_lib.Network, entropy_weight: float):
  import jax
  import jax.numpy as jnp

  def loss(params, graph, batch, advantage):
    k, s = batch['action'].shape
    flat = lambda x: x.reshape((k * s,) + x.shape[2:])
    logits = module.apply(
      params,
      graph,
      flat(batch['ctx']),
      flat(batch['cand']),
      flat(batch['node']),
      flat(batch['mask']),
    )
    logp = jax.nn.log_softmax(logits, -1)
    taken = jnp.take_along_axis(logp, flat(batch['action'])[:, None], -1)[:, 0].reshape(k, s)
    live = batch['live']
    probs = jnp.exp(logp) * flat(batch['mask'])
    entropy = -(probs * jnp.where(flat(batch['mask']), logp, 0.0)).sum(-1).reshape(k, s)
    per_plan = (taken * live).sum(-1)
    return -(advantage * per_plan).mean() - entropy_weight * (entropy * live).sum(-1).mean()

  return loss


@dataclasses.dataclass(frozen=True)
class TrainLog:
  """What training did: per step the problem's mean reward; seconds."""

  rewards: tuple[float, ...]
  problems: tuple[int, ...]
  seconds: float
  simulated: int


_GRADS: dict = {}


def train(
  problems: Sequence[Problem],
  steps: int = 300,
  samples: int = 16,
  learning_rate: float = 3e-3,
  entropy_weight: float = 5e-3,
  seed: int = 0,
  hidden: int = 64,
  rounds: int = 3,
  policy: Policy | None = None,
  progress: Callable[[str], None] | None = None,
) -> tuple[Policy, TrainLog]:
  """REINFORCE over `problems` (one per step, in turn): K sampled plans,
  reward -log(step time) (OOM penalised), baseline a running mean per problem.
  A given policy continues training (its problems built in its decision space)."""
  import jax
  import optax

  started = time.perf_counter()
  policy = policy or Policy.fresh(seed, hidden, rounds)
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(policy.params)
  key = (policy.hidden, policy.rounds, entropy_weight)
  if key not in _GRADS:  # one compile per process, not per call
    _GRADS[key] = jax.jit(jax.grad(_loss_fn(policy.module, entropy_weight)))
  grad = _GRADS[key]
  rng = np.random.default_rng(seed)
  baseline: dict[int, float] = {}
  rewards, which = [], []
  params = policy.params
  for step in range(steps):
    i = step % len(problems)
    prob = problems[i]
    current = dataclasses.replace(policy, params=params)
    out = rollout(current, prob, samples, rng)
    r = np.array([decisions.reward(decisions.plan_of(prob, part)) for part, _ in out])
    base = baseline.get(i, float(r.mean()))
    advantage = (r - base).astype(np.float32)
    baseline[i] = 0.8 * base + 0.2 * float(r.mean())
    batch = _batch([trail for _, trail in out], policy.adapter)
    g = grad(params, policy.adapter.graph(prob.graph), batch, advantage)
    updates, opt_state = optimizer.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    rewards.append(float(r.mean()))
    which.append(i)
    if progress and (step + 1) % 50 == 0:
      progress(f'learned: step {step + 1}/{steps}, mean reward {np.mean(rewards[-50:]):.3f}')
  simulated = sum(len(p.cache) for p in problems)
  return dataclasses.replace(policy, params=params), TrainLog(
    tuple(rewards), tuple(which), time.perf_counter() - started, simulated
  )


def infer(policy: Policy, prob: Problem, samples: int = 63, seed: int = 0) -> list[Estimate]:
  """The greedy plan and `samples` sampled ones, priced, fastest first (fitting ones first)."""
  rng = np.random.default_rng(seed)
  half = (1 + samples) // 2
  parts = rollout(policy, prob, half, rng, greedy=1, temperature=INFER_TEMPERATURES[0])
  parts += rollout(policy, prob, 1 + samples - half, rng, temperature=INFER_TEMPERATURES[1])
  found = [decisions.plan_of(prob, part) for part, _ in parts]
  unique = {id(e): e for e in found}
  return sorted(unique.values(), key=lambda e: (e.oom, e.step_time))


def training_problems(cfg, count: int = 24, seed: int = 0, options: Options = Options()):
  """`count` random clusters for cfg's model, with the analytic profile (every tensor degree)."""
  from triax.plan.cost import analytic

  rng = np.random.default_rng(seed)
  out = []
  while len(out) < count:
    cluster = catalogue.random_cluster(rng)
    found = list(layouts(cfg, cluster.num_devices))
    if not found:
      continue
    prof = analytic.build(cfg.model, sorted({l.tensor for l in found}))
    prob = decisions.problem(cfg, cluster, prof, options)
    if prob is not None:
      out.append(prob)
  return out


def model_key(cfg) -> str:
  m = cfg.model
  return (
    f'{m.family} L{m.num_layers} d{m.d_model} h{m.num_heads} ff{m.d_ff} v{m.vocab_size} '
    f's{m.seq_len} {m.dtype} batch {cfg.train.global_batch_size}'
  )


def trained(
  cfg,
  path: str | None = None,
  steps: int = 240,
  clusters: int = 24,
  seed: int = 0,
  progress: Callable[[str], None] | None = None,
) -> Policy:
  """The policy at `path`, or one trained for cfg's model (saved to `path` if given)."""
  if path and os.path.isfile(path):
    policy = policy_lib.load(path)
    if progress:
      progress(f'learned: policy {path} (trained for {policy.meta.get("model", "?")})')
    return policy
  if progress:
    progress(f'learned: training on {clusters} random clusters, {steps} steps ...')
  problems = training_problems(cfg, clusters, seed)
  policy, log = train(problems, steps=steps, seed=seed, progress=progress)
  policy.meta.update(
    model=model_key(cfg), steps=steps, clusters=clusters, seed=seed, train_s=round(log.seconds, 1)
  )
  if progress:
    progress(f'learned: trained in {log.seconds:.1f} s')
  if path:
    policy_lib.save(policy, path)
  return policy
