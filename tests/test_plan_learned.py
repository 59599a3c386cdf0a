"""The learned planner: valid plans, REINFORCE that learns, save/load, and the CLI's library."""

import io
import os

import numpy as np
import pytest

from triax import config
from triax.plan import analytic, learned, report, search
from triax.plan import cluster as cluster_lib

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

ROOT = os.path.join(os.path.dirname(__file__), '..')
TESTBED = os.path.join(ROOT, 'experiments', 'clusters', 'heterog_testbed.yaml')


def small_config():
  cfg = config.defaults()
  m = cfg.model
  m.num_layers, m.d_model, m.num_heads, m.d_ff, m.vocab_size, m.seq_len = 4, 256, 8, 1024, 512, 128
  m.dtype = 'bfloat16'
  cfg.train.global_batch_size = 16
  return cfg


def _problem(cfg, cluster):
  layouts = list(search.layouts(cfg, cluster.num_devices))
  prof = analytic.build(cfg.model, sorted({l.tensor for l in layouts}))
  return learned.problem(cfg, cluster, prof)


@pytest.fixture(scope='module')
def trained():
  """A policy trained a few dozen steps on two random clusters, and its log."""
  cfg = small_config()
  problems = learned.training_problems(cfg, count=2, seed=0)
  policy, log = learned.train(problems, steps=30, seed=0, learning_rate=1e-2)
  return cfg, policy, log


def test_sampled_plans_are_valid_configs():
  cfg = small_config()
  cluster = cluster_lib.load(TESTBED)
  prob = _problem(cfg, cluster)
  policy = learned.Policy(learned.net.init(learned.net.Policy(), 0))
  rollouts = learned.rollout(policy, prob, 16, np.random.default_rng(0), greedy=1)
  layouts = set(prob.layouts)
  for part, trail in rollouts:
    assert len(trail) == len(learned.KINDS) - 1 + part.choices['pipe']
    plan = learned.plan_of(prob, part).plan
    layout = search.Layout(
      plan.data, plan.tensor, plan.pipe, plan.schedule, plan.microbatches, plan.virtual_stages
    )
    assert layout in layouts
    assert sorted(plan.devices) == list(range(cluster.num_devices))
    # What the search asks of its own plans: the config validator accepts it.
    assert search._plan_config_ok(cfg, plan, cluster.num_devices), plan.describe()


def test_reinforce_improves_the_expected_reward(trained):
  _, _, log = trained
  # Steps alternate between the two problems: equal counts of each on both sides.
  first, last = np.mean(log.rewards[:8]), np.mean(log.rewards[-8:])
  assert last > first + 0.1, (first, last)


def test_save_load_round_trip_gives_the_same_plan(trained, tmp_path):
  cfg, policy, _ = trained
  path = str(tmp_path / 'policy.msgpack')
  learned.save(policy, path)
  loaded = learned.load(path)
  prob = _problem(cfg, cluster_lib.load(TESTBED))
  plans = [learned.infer(p, prob, samples=7, seed=3)[0].plan for p in (policy, loaded, policy)]
  assert plans[0] == plans[1] == plans[2]


def test_plan_cli_library_with_search_learned(trained, tmp_path):
  cfg, policy, _ = trained
  path = str(tmp_path / 'policy.msgpack')
  learned.save(policy, path)
  request = report.Request(
    cfg=cfg,
    config_path='experiments/gpt_tiny.py',
    config_overrides={},
    cluster=TESTBED,
    profile='analytic',
    search='learned',
    policy=path,
    out=str(tmp_path / 'plan.py'),
  )
  out = io.StringIO()
  summary = report.run(request, as_json=True, out=out)
  assert summary['top'] and not summary['top'][0]['oom']
  assert os.path.isfile(tmp_path / 'plan.py')
  assert '--search=learned' in open(tmp_path / 'plan.py').read()


def test_training_is_deterministic_by_seed():
  cfg = small_config()
  runs = []
  for _ in range(2):
    problems = learned.training_problems(cfg, count=1, seed=1)
    policy, log = learned.train(problems, steps=3, seed=1)
    runs.append((log.rewards, policy.params))
  assert runs[0][0] == runs[1][0]
  import jax

  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), runs[0][1], runs[1][1])
  assert all(jax.tree.leaves(same))
