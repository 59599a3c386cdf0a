"""The strategy maker: layer partitions, enumeration, baselines, plan files."""

import random

import harness
import pytest
from test_plan_simulator import make_cluster, make_plan

from triax import config
from triax.errors import ConfigError
from triax.plan.cost import profile
from triax.plan.cost.simulator import Options, simulate_plan
from triax.plan.search import baselines, emit, exhaustive, partition
from triax.plan.search import layouts as layouts_lib


@pytest.mark.fast
@pytest.mark.parametrize('seed', range(40))
def test_partition_minimises_the_slowest_stage(seed):
  rng = random.Random(seed)
  p, unit = rng.randint(1, 4), rng.choice([1, 1, 2])
  layers = unit * rng.randint(p, 7)
  speed = [rng.uniform(0.5, 3.0) for _ in range(p)]
  extra = [rng.uniform(0.0, 2.0) for _ in range(p)]
  cap = [rng.randint(1, layers) for _ in range(p)]
  cost = lambda s, n: extra[s] + n * speed[s]
  allowed = lambda s, n: n <= cap[s]
  got = partition.balance(layers, p, cost, allowed, unit)
  want = partition.brute_force(layers, p, cost, allowed, unit)
  assert (got is None) == (want is None)
  if got:
    split, slowest = got
    assert sum(split) == layers and all(n % unit == 0 and n > 0 for n in split)
    assert slowest == pytest.approx(want)
    assert max(cost(s, n) for s, n in enumerate(split)) == pytest.approx(want)


@pytest.mark.fast
def test_partition_prefers_even_among_equals():
  assert partition.balance(8, 4, lambda s, n: n) == ((2, 2, 2, 2), 2)
  assert partition.balance(6, 2, lambda s, n: n * (1 if s == 0 else 2)) == ((4, 2), 4)
  assert partition.even(7, 2) is None


def small_config(layers=4, batch=8):
  cfg = config.defaults()
  cfg.model.num_layers = layers
  cfg.model.d_model, cfg.model.num_heads, cfg.model.d_ff = 32, 4, 64
  cfg.model.seq_len = 16
  cfg.train.global_batch_size = batch
  return cfg


# Not in the fast tier: three searches (3 s).
def test_search_returns_valid_plans_and_baselines():
  cfg = small_config(layers=8, batch=16)
  prof = profile.synthetic(
    layer_fwd=1.0,
    layer_bwd=2.0,
    head=1.0,
    tensors=(1, 2, 4),
    layer_param_bytes=1e6,
    act_per_seq=1e5,
  )
  spec = make_cluster(groups=(('gpu', 8, 1.0, '80 GB'),), bandwidth=1e9, latency='10 us')
  result = exhaustive.search(cfg, spec, top_k=4, profile=prof)
  assert 1 <= len(result.top) <= 4
  times = [e.step_time for e in result.top]
  assert times == sorted(times)
  for e in result.top:
    p = e.plan
    assert p.data * p.context * p.tensor * p.pipe == 8
    assert p.num_layers == 8 and sum(p.chunk_layers) == 8
    assert sorted(p.devices) == list(range(8))
    assert not e.oom
  assert set(result.baselines) == set(baselines.BASELINES)
  assert result.baselines['data_parallel'].plan.data == 8
  assert result.baselines['data_parallel'].plan.state_sharding == 'replicated'
  assert result.baselines['zero3'].plan.state_sharding == 'fsdp'
  for key in result.baselines:
    assert result.speedup(key) >= 1.0 - 1e-9
  assert result.evaluated > 10 and result.search_s > 0


@pytest.mark.fast
def test_search_gives_fast_devices_more_layers():
  cfg = small_config(layers=8, batch=8)
  prof = profile.synthetic(layer_fwd=1.0, layer_bwd=2.0, tensors=(1, 2))
  spec = make_cluster(
    groups=(('slow', 1, 1.0, '80 GB'), ('fast', 1, 3.0, '80 GB')),
    nodes=[{'name': 'a', 'devices': {'slow': 1}}, {'name': 'b', 'devices': {'fast': 1}}],
  )
  result = exhaustive.search(cfg, spec, top_k=3, profile=prof)
  best = result.top[0].plan
  assert best.pipe == 2
  fast_stage = next(s for s, devs in enumerate(best.stages) if devs == (1,))
  assert best.layers[fast_stage] == 6 and best.layers[1 - fast_stage] == 2
  assert result.speedup('even_split') > 1.3
  # A planner that thinks both are slow picks the even split.
  assumed = result.baselines['homogeneous_slowest']
  assert assumed.plan.even and result.speedup('homogeneous_slowest') > 1.3


@pytest.mark.fast
def test_search_uses_remat_only_when_memory_demands_it():
  cfg = small_config(layers=4, batch=8)
  prof = profile.synthetic(
    layer_fwd=1.0, layer_bwd=2.0, tensors=(1,), layer_param_bytes=1e8, stash_per_seq=2e8
  )
  prof.shards[1].stash_per_seq.update(attention=1e8, dots=1e7, full=1e6)
  # The train step's memory alone: the evaluation's forward (no stash, so no
  # remat) of the whole batch would not fit in 2 GB either.
  step_only = Options(state_programs=False)
  plenty = exhaustive.search(
    cfg, make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),)), profile=prof, options=step_only
  )
  assert plenty.top[0].plan.remat == 'none'
  # Without remat the stashed residuals no longer fit: recompute.
  tight = exhaustive.search(
    cfg, make_cluster(groups=(('gpu', 2, 1.0, '2 GB'),)), profile=prof, options=step_only
  )
  assert tight.top and tight.top[0].plan.remat in ('attention', 'dots', 'full')
  assert all(not e.oom for e in tight.top)


def _load(path):
  return harness.load_file(path, 'plan_under_test')


@pytest.mark.fast
def test_plan_file_round_trips(tmp_path):
  base = tmp_path / 'experiments' / 'base.py'
  base.parent.mkdir()
  base.write_text(
    'from triax import config\n\n\ndef get_config(arg=None):\n'
    '  c = config.defaults()\n  c.model.num_layers = 8\n'
    '  c.model.d_model = 64 if arg == "wide" else 32\n  return c\n'
  )
  plan = make_plan(p=2, m=4, d=2, t=2, name='gpipe', remat='attention', layers=(4, 4))
  prof = profile.synthetic(tensors=(2,))
  est = simulate_plan(plan, prof, make_cluster())
  out = tmp_path / 'plans' / 'plan.py'
  out.parent.mkdir()
  text = emit.write(str(out), est, str(base), 'wide', {'train.steps': 7}, 'test')
  assert 'python -m triax train --config=' in text
  cfg = _load(str(out)).get_config()
  assert (cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipe) == (2, 2, 2)
  assert cfg.pipeline.schedule == 'gpipe' and cfg.pipeline.microbatches == 4
  assert cfg.pipeline.virtual_stages == 1 and cfg.model.remat == 'attention'
  assert cfg.train.global_batch_size == plan.global_batch and cfg.train.steps == 7
  assert cfg.model.d_model == 64 and cfg.model.num_layers == 8  # the base, with its arg
  if 'layers_per_stage' in config.defaults().pipeline:
    assert tuple(cfg.pipeline.layers_per_stage) == ()
  config.validate(cfg, 8)
  # An explicit argument replaces the recorded one.
  assert _load(str(out)).get_config('narrow').model.d_model == 32


@pytest.mark.fast
def test_uneven_plan_file_names_its_chunks(tmp_path):
  base = tmp_path / 'base.py'
  base.write_text(
    'from triax import config\n\n\ndef get_config():\n'
    '  c = config.defaults()\n  c.model.num_layers = 6\n  return c\n'
  )
  plan = make_plan(p=2, m=2, v=2, name='interleaved_1f1b', layers=(4, 2))
  est = simulate_plan(plan, profile.synthetic(), make_cluster())
  out = tmp_path / 'plan.py'
  emit.write(str(out), est, str(base), None, {}, 'test')
  assert emit.overrides(plan)['pipeline.layers_per_stage'] == (2, 1, 2, 1)
  module = _load(str(out))
  if 'layers_per_stage' in config.defaults().pipeline:
    assert tuple(module.get_config().pipeline.layers_per_stage) == (2, 1, 2, 1)
  else:
    with pytest.raises(ValueError, match='layers_per_stage'):
      module.get_config()


@pytest.mark.fast
def test_layouts_do_not_list_a_schedule_twice():
  # interleaved_zb at v = 1 builds zb_h1's orders (and interleaved_1f1b
  # 1f1b's): the same plan would fill two of the top rows.
  found = list(layouts_lib.layouts(small_config(layers=8, batch=16), 8))
  assert not [
    l
    for l in found
    if l.schedule in ('interleaved_zb', 'interleaved_1f1b') and l.virtual_stages == 1
  ]
  assert any(l.schedule == 'zb_h1' for l in found)


@pytest.mark.fast
def test_layouts_respect_grouped_query_heads():
  cfg = small_config(layers=8, batch=8)
  cfg.model.family, cfg.model.num_heads, cfg.model.num_kv_heads = 'llama', 12, 6
  cfg.model.d_model, cfg.model.d_ff = 96, 192
  # tensor=4 divides the 12 query heads, but 6 K/V heads (>= 4) cannot split
  # over it and validation refuses them; tensor=8 divides no heads.
  assert {l.tensor for l in layouts_lib.layouts(cfg, 8)} == {1, 2}


@pytest.mark.fast
def test_the_planner_prices_every_remat_policy_the_model_has():
  # One list of policies: config's (what a run may ask for) and the model's, which the
  # profile orders by recompute; the planner searches the profile's.
  from triax import config
  from triax.model import common
  from triax.plan.cost import profile
  from triax.plan.search import evaluate

  assert set(profile.REMATS) == set(config.REMAT_POLICIES) == set(common.REMAT_POLICIES)
  assert evaluate.REMATS is profile.REMATS
  # A renamed policy is refused naming what replaced it.
  cfg = config.defaults()
  cfg.model.remat = 'selective'
  with pytest.raises(ConfigError, match="'dots'.*'attention'") as e:
    config.validate(cfg, 1)
  assert e.value.key == 'model.remat'
