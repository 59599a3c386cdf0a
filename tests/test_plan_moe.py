"""The planner and mixture of experts: the all-to-all priced, load imbalance, the expert degree searched."""

import dataclasses
import importlib.util
import json
import os

import pytest
from test_plan_simulator import make_cluster

from triax import config
from triax.errors import ConfigError
from triax.layout import Layout
from triax.model import mixtral, moe
from triax.plan import cluster as cluster_lib
from triax.plan import report
from triax.plan.candidate import Options, Plan
from triax.plan.cost import analytic, memory, profile, profile_cache
from triax.plan.cost import experts as experts_lib
from triax.plan.cost.comm import Comm
from triax.plan.cost.simulator import simulate_plan
from triax.plan.search import evaluate, exhaustive
from triax.plan.search import layouts as layouts_lib

ROOT = os.path.join(os.path.dirname(__file__), '..')
MIXTRAL_TINY = os.path.join(ROOT, 'experiments', 'mixtral_tiny.py')
H100 = os.path.join(ROOT, 'experiments', 'clusters', 'h100_8x_nvlink.yaml')
# mixtral_tiny's experts: 8 of d_ff 172 (3 x 128 x 172 fp32 weights each), top-2, 128 positions.
EXPERTS = profile.Experts(
  num_experts=8,
  per_token=2,
  dispatch='dropless',
  capacity_factor=1.25,
  seq_len=128,
  d_model=128,
  hidden=172,
  dtype_bytes=4,
  param_bytes=8 * 3 * 128 * 172 * 4.0,
  fraction=0.6,
)


def moe_plan(data, expert, tensor=1, rows=4, remat='none'):
  """One stage of data x tensor devices, `rows` sequences per replica, no pipeline."""
  return Plan(
    layout=Layout(data=data, tensor=tensor, expert=expert),
    remat=remat,
    layers=(4,),
    stages=(tuple(range(data * tensor)),),
    global_batch=rows * data,
  )


def moe_profile(experts=EXPERTS, **kwargs):
  return profile.synthetic(tensors=(1, 2, 4), experts=experts, **kwargs)


@pytest.mark.fast
def test_all_to_all_bytes_and_seconds_by_hand():
  # Dropless at expert 4, 4 rows of 128 positions, top-2: 1024 assignments a
  # device, and a buffer with room for all of them for each of the 4
  # destinations, 128 fp32 wide: 4 x 1024 x 512 B.
  plan = moe_plan(data=8, expert=4)
  assert experts_lib.exchange_bytes(plan, EXPERTS) == 4 * 1024 * 128 * 4
  # Capacity: each row's [E, C, d] buffers, C = ceil(1.25 x 128 x 2 / 8) = 40, moe.py's own.
  capacity = dataclasses.replace(EXPERTS, dispatch='capacity')
  assert experts_lib.capacity(capacity) == moe.capacity_of(128, 2, 8, 1.25) == 40
  assert experts_lib.exchange_bytes(plan, capacity) == 4 * 8 * 40 * 128 * 4
  # The all-to-all groups: 4 consecutive data replicas (the inner part of data).
  assert plan.expert_groups(0) == [(0, 1, 2, 3), (4, 5, 6, 7)]
  assert moe_plan(data=4, expert=2, tensor=2).expert_groups(0) == [(0, 2), (1, 3), (4, 6), (5, 7)]
  # One node, 1 GB/s, 1 us: (n-1) latencies and (n-1)/n of the buffer leaves each device.
  cluster = make_cluster(bandwidth='1 GB/s', latency='1 us')
  comm = Comm(cluster, moe_profile())
  shard = moe_profile().shards[1]
  one = 3e-6 + 0.75 * 4 * 1024 * 512 / 1e9
  ids = 3e-6 + 0.75 * 4 * 1024 * 4 / 1e9  # the rows' expert ids, int32
  fwd, bwd = experts_lib.seconds(plan, shard, comm, 0)
  assert fwd == pytest.approx(2 * one + ids) and bwd == pytest.approx(2 * one)
  # Remat reruns the forward's three in the backward; expert 1 exchanges nothing.
  full = experts_lib.seconds(moe_plan(data=8, expert=4, remat='full'), shard, comm, 0)
  assert full == pytest.approx((fwd, bwd + fwd))
  assert experts_lib.seconds(moe_plan(data=8, expert=1), shard, comm, 0) == (0.0, 0.0)
  # A dense layer has none.
  dense = profile.synthetic(tensors=(1,)).shards[1]
  assert experts_lib.seconds(plan, dense, comm, 0) == (0.0, 0.0)


def two_nodes(inter='1 GB/s'):
  """Two nodes of 4 devices: 100 GB/s inside a node, `inter` between them."""
  cluster = make_cluster(
    nodes=[{'name': 'a', 'devices': {'gpu': 4}}, {'name': 'b', 'devices': {'gpu': 4}}]
  )
  return dataclasses.replace(
    cluster,
    intra_node=dataclasses.replace(cluster.intra_node, bandwidth=100e9, latency=1e-6),
    inter_node=dataclasses.replace(cluster.inter_node, bandwidth=1e9 if inter else 100e9),
  )


@pytest.mark.fast
def test_all_to_all_time_grows_with_the_expert_degree_across_a_slower_link():
  cluster = two_nodes()
  prof = moe_profile(layer_fwd=1e-3, layer_bwd=2e-3)
  comm = Comm(cluster, prof)
  # The same pair of devices costs more across the nodes than inside one.
  assert comm.alltoall((0, 4), 2**20) > 10 * comm.alltoall((0, 1), 2**20)
  shard = prof.shards[1]
  seconds = {e: experts_lib.seconds(moe_plan(8, e), shard, comm, 0)[0] for e in (2, 4, 8)}
  # Within a node the buffer grows with the degree; at 8 the group spans both nodes.
  assert 0 < seconds[2] < seconds[4] and seconds[8] > 10 * seconds[4]
  steps = [simulate_plan(moe_plan(8, e), prof, cluster).step_time for e in (1, 4, 8)]
  assert steps[0] < steps[1] < steps[2]
  # On links alike, crossing nodes costs nothing more.
  flat = experts_lib.seconds(moe_plan(8, 8), shard, Comm(two_nodes(inter=None), prof), 0)[0]
  assert flat < seconds[8] / 10


@pytest.mark.fast
def test_imbalance_slows_the_experts_only_where_they_are_split():
  shard = moe_profile().shards[1]
  # The busiest expert's device: (imbalance + g - 1) / g of a balanced share, g experts each.
  assert experts_lib.compute_scale(moe_plan(8, 8), shard, 2.0) == pytest.approx(1 + 0.6 * 1.0)
  assert experts_lib.compute_scale(moe_plan(8, 2), shard, 2.0) == pytest.approx(1 + 0.6 * 0.25)
  assert experts_lib.compute_scale(moe_plan(8, 1), shard, 2.0) == 1.0
  # Capacity's buffers are fixed: the busiest expert's excess is dropped, not computed.
  capacity = dataclasses.replace(shard, experts=dataclasses.replace(EXPERTS, dispatch='capacity'))
  assert experts_lib.compute_scale(moe_plan(8, 8), capacity, 2.0) == 1.0
  prof, cluster = moe_profile(layer_fwd=1e-3, layer_bwd=2e-3), make_cluster()
  for e, slower in ((1, False), (8, True)):
    even = simulate_plan(moe_plan(8, e), prof, cluster).step_time
    skewed = simulate_plan(moe_plan(8, e), prof, cluster, Options(moe_imbalance=2.0)).step_time
    assert (skewed > even * 1.5) if slower else skewed == pytest.approx(even)
  with pytest.raises(ValueError, match='moe_imbalance'):
    Options(moe_imbalance=0.5)


@pytest.mark.fast
def test_profile_cache_keeps_the_experts():
  prof = moe_profile()
  assert profile_cache.from_dict(json.loads(json.dumps(profile_cache.to_dict(prof)))) == prof
  grouped = dataclasses.replace(prof, layers_per_entry=2)
  assert profile_cache.from_dict(json.loads(json.dumps(profile_cache.to_dict(grouped)))) == grouped


def mixtral_config(**model):
  cfg = config.from_file(MIXTRAL_TINY)
  for key, value in model.items():
    cfg.model[key] = value
  return cfg


@pytest.mark.fast
def test_state_per_device_matches_the_compiled_bytes_of_bench_moe():
  # docs/bench_moe.md: mixtral_tiny at data=8, its compiled parameter and
  # Adam bytes per device by expert degree (MiB).
  compiled = {1: (8.96, 17.92), 2: (4.93, 9.85), 4: (2.91, 5.82)}
  prof = analytic.build(mixtral_config().model, [1])
  shard = prof.shards[1]
  layers = 4
  params = shard.layer_param_bytes * layers + shard.edge_param_bytes
  experts = experts_lib.expert_param_bytes(shard) * layers
  for e, (want_params, want_adam) in compiled.items():
    state = memory.state(moe_plan(8, e), prof, params, experts)
    assert state['params'] / 2**20 == pytest.approx(want_params, abs=0.01)
    assert state['moments'] / 2**20 == pytest.approx(want_adam, abs=0.01)
  # ZeRO-1 splits the moments over the mesh's data axis, data / expert devices
  # (the expert axis is carved from it): the routed experts' at 1/data.
  zero1 = dataclasses.replace(moe_plan(8, 4), state_sharding='zero1')
  moments = 2 * (params - experts) / 2 + 2 * experts / 8
  assert memory.state(zero1, prof, params, experts)['moments'] == pytest.approx(moments)


@pytest.mark.fast
def test_analytic_profile_counts_the_active_experts():
  shard = analytic.build(mixtral_config().model, [1]).shards[1]
  s, d, f, k = 128, 128, 172, 2
  # A token runs k of the 8 experts: 3 matmuls of d x f each, 2 FLOPs a multiply-add.
  routed = 2 * s * 3 * d * f * k
  assert shard.experts.fraction * shard.work['layer_fwd'].flops_per_seq == pytest.approx(routed)
  assert shard.experts.param_bytes == 8 * 3 * d * f * 4


@pytest.mark.fast
def test_search_respects_the_familys_refusal_of_the_executor(monkeypatch):
  cfg = mixtral_config()
  found = list(layouts_lib.layouts(cfg, 8))
  assert {(l.pipe, l.microbatches) for l in found} == {(1, 1)}
  # Expert degrees: divisors of the 8 experts that divide data (d_ff = 172
  # allows tensor 1, 2, 4: data 8, 4, 2).
  assert {(l.data, l.expert) for l in found} == {
    (d, e) for d in (2, 4, 8) for e in (1, 2, 4, 8) if e <= d
  }
  # The refusal is the spec's word, read as the search runs: lifted, pipelines come back.
  monkeypatch.setattr(mixtral.MixtralSpec, 'executor_refusal', lambda self: '')
  assert any(l.pipe > 1 for l in layouts_lib.layouts(cfg, 8))
  # A dense family has no expert degree.
  dense = config.from_file(os.path.join(ROOT, 'experiments', 'llama_tiny.py'))
  assert {l.expert for l in layouts_lib.layouts(dense, 8)} == {1}


@pytest.mark.fast
def test_search_splits_the_experts_where_memory_forces_it_and_not_where_it_does_not_pay():
  cfg = mixtral_config()
  gb = 1e9
  # Big experts (0.9 of a 1 GB layer), little activation: at 4 GB a device,
  # no replicated plan fits with every expert on every device (its step holds
  # 4 GB at tensor 4).
  big = dataclasses.replace(EXPERTS, param_bytes=0.9 * gb)
  prof = moe_profile(big, layer_fwd=1e-3, layer_bwd=2e-3, layer_param_bytes=gb)
  cluster = make_cluster(groups=(('gpu', 8, 1.0, '4 GB'),), bandwidth='10 GB/s', latency='5 us')
  result = exhaustive.search(cfg, cluster, profile=prof, top_k=3)
  assert result.top and result.top[0].plan.expert > 1
  found = evaluate.evaluate(cfg, cluster, prof, Options(), layouts_lib.layouts(cfg, 8))
  replicated = [e for e in found if e.plan.expert == 1 and e.plan.state_sharding == 'replicated']
  assert replicated and all(e.oom for e in replicated)
  # Small experts and long, wide tokens over a slow link: the all-to-all
  # costs more than the split saves, and memory is ample.
  wide = dataclasses.replace(EXPERTS, seq_len=4096, d_model=4096, param_bytes=1e6)
  prof = moe_profile(wide, layer_fwd=1e-3, layer_bwd=2e-3, layer_param_bytes=2e6)
  cluster = make_cluster(bandwidth='1 GB/s', latency='5 us')
  result = exhaustive.search(cfg, cluster, profile=prof, top_k=3)
  assert result.top[0].plan.expert == 1


@pytest.mark.fast
def test_cli_plans_mixtral_tiny_end_to_end(tmp_path, capsys):
  out = tmp_path / 'plan.py'
  request = report.Request(
    cfg=config.from_file(MIXTRAL_TINY),
    config_path=MIXTRAL_TINY,
    config_overrides={},
    cluster=H100,
    top=3,
    out=str(out),
    profile='analytic',
    moe_imbalance=1.5,
  )
  report.run(request, as_json=True)
  best = json.loads(capsys.readouterr().out)['top'][0]
  assert best['pipe'] == 1 and best['microbatches'] == 1
  spec = importlib.util.spec_from_file_location('moe_plan', str(out))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  # mixtral_tiny splits its experts 2 ways: the plan writes its own degree over it.
  assert cfg.mesh.expert == best['expert'] and 'mesh.expert' in out.read_text()
  config.validate(cfg, 8)
  with pytest.raises(ConfigError, match='--moe_imbalance'):
    report.run(dataclasses.replace(request, out=None, moe_imbalance=0.5))


def grouped_config(every=2, **model):
  """mixtral_tiny with a MoE block in every `every` and pipelines allowed."""
  return mixtral_config(moe_every=every, router_aux_loss_scope='microbatch', **model)


def dense_config():
  """The dense Llama of mixtral_tiny's shapes (d_ff that of one expert)."""
  cfg = config.from_file(os.path.join(ROOT, 'experiments', 'llama_tiny.py'))
  cfg.model.d_ff = mixtral_config().model.d_ff
  return cfg


@pytest.mark.fast
def test_groups_of_dense_and_moe_blocks_price_as_their_average_block():
  # moe_every=2: a group of a dense block and a MoE block, priced per block
  # as their mean, between the dense model and the all-MoE one.
  dense, grouped, moe_only = (
    analytic.build(c.model, [1]) for c in (dense_config(), grouped_config(), mixtral_config())
  )
  assert (dense.layers_per_entry, grouped.layers_per_entry, moe_only.layers_per_entry) == (1, 2, 1)
  d, g, m = (p.shards[1] for p in (dense, grouped, moe_only))
  for f in ('layer_fwd', 'layer_bwd'):
    for key in ('flops_per_seq', 'bytes_fixed', 'bytes_per_seq'):
      mean = (getattr(d.work[f], key) + getattr(m.work[f], key)) / 2
      assert getattr(g.work[f], key) == pytest.approx(mean, rel=1e-12)
  assert g.layer_param_bytes == pytest.approx((d.layer_param_bytes + m.layer_param_bytes) / 2)
  # Without remat the dense block's gated MLP keeps a hidden-wide value more
  # than the MoE block's own (its experts' are the dispatch's, plan/cost/experts.py).
  mean = (d.stash_per_seq['none'] + m.stash_per_seq['none']) / 2
  assert d.stash_per_seq['none'] > m.stash_per_seq['none']
  assert g.stash_per_seq['none'] == pytest.approx(mean, rel=1e-12)
  # Full remat keeps a group's input only: half a block's.
  assert g.stash_per_seq['full'] == m.stash_per_seq['full'] / 2
  # The experts: half a MoE block's parameters and FLOP share, the same exchange.
  assert g.experts.every == 2 and g.experts.param_bytes == m.experts.param_bytes / 2
  routed = m.experts.fraction * m.work['layer_fwd'].flops_per_seq
  assert g.experts.fraction * g.work['layer_fwd'].flops_per_seq == pytest.approx(routed / 2)
  # A step: strictly between the dense and the all-MoE model, at every expert degree.
  cluster = cluster_lib.load(H100)
  for e in (1, 4):
    steps = [
      simulate_plan(moe_plan(8, e if p is not dense else 1), p, cluster).step_time
      for p in (dense, grouped, moe_only)
    ]
    assert steps[0] < steps[1] < steps[2]
  # Only the MoE block exchanges tokens: the average block, half its all-to-alls.
  comm = Comm(cluster, grouped)
  for remat in ('none', 'full'):
    plan = moe_plan(data=8, expert=4, remat=remat)
    one = experts_lib.seconds(plan, m, comm, 0)
    assert one[0] > 0 and experts_lib.seconds(plan, g, comm, 0) == (one[0] / 2, one[1] / 2)
    assert (
      experts_lib.dispatch_stash(plan, g, remat) == experts_lib.dispatch_stash(plan, m, remat) / 2
    )
  assert experts_lib.seconds(moe_plan(data=8, expert=4), d, comm, 0) == (0.0, 0.0)


# Not in the fast tier: the search prices some 2,300 plans (10 s).
def test_groups_of_dense_and_moe_blocks_split_in_whole_groups():
  # 8 blocks in groups of 2 on a fast and a slow stage: balancing by block
  # would give the fast stage 5 (every block's cost equal to the slow
  # stage's 3); in whole groups it takes 6. Every split is one config.py accepts.
  cfg = grouped_config(num_layers=8)
  prof = dataclasses.replace(moe_profile(num_layers=8), layers_per_entry=2)
  cluster = make_cluster(groups=(('fast', 4, 2.0, '80 GB'), ('slow', 4, 1.0, '80 GB')))
  layouts = [l for l in layouts_lib.layouts(cfg, 8) if l.pipe > 1]
  assert {(l.pipe, l.virtual_stages) for l in layouts} == {(2, 1), (2, 2), (4, 1)}
  found = evaluate.evaluate(cfg, cluster, prof, Options(), layouts)
  splits = {e.plan.layers for e in found}
  assert (6, 2) in splits and all(n % 2 == 0 for e in found for n in e.plan.chunk_layers)
  for plan in {
    dataclasses.replace(e.plan, remat='none', state_sharding='replicated') for e in found
  }:
    config.validate(evaluate.with_plan(cfg, plan), 8)


# Not in the fast tier: a search of mixtral_tiny's layouts (3 s).
def test_cli_plans_groups_of_dense_and_moe_blocks(tmp_path, capsys):
  cfg = grouped_config()
  out = tmp_path / 'plan.py'
  request = report.Request(
    cfg=cfg,
    config_path=MIXTRAL_TINY,
    config_overrides={'model.moe_every': 2, 'model.router_aux_loss_scope': 'microbatch'},
    cluster=H100,
    top=5,
    out=str(out),
    profile='analytic',
  )
  top = report.run(request, as_json=True)['top']
  capsys.readouterr()
  assert any(p['pipe'] > 1 for p in top)
  assert all(n % 2 == 0 for p in top for n in p['layers_per_chunk'])
  spec = importlib.util.spec_from_file_location('grouped_plan', str(out))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  planned = module.get_config()
  assert planned.model.moe_every == 2
  config.validate(planned, 8)
  # Every plan the search shows is one the validator takes.
  prof = analytic.build(cfg.model, [1, 2, 4])
  for e in exhaustive.search(cfg, cluster_lib.load(H100), profile=prof, top_k=10).top:
    config.validate(evaluate.with_plan(cfg, e.plan), 8)
  # An elastic restart with a cluster prices it too.
  from triax.elastic import replan

  assert replan.searched(cfg, 4, cluster_lib.load(H100))[1] == 'planner search'


@pytest.mark.fast
def test_the_learned_planner_takes_the_best_expert_degree_of_its_decisions():
  # The memory-bound case above: only split experts fit. The policy decides
  # no expert degree; pricing its decisions takes the best one accepted.
  from triax.plan.learned import decisions

  cfg = mixtral_config()
  big = dataclasses.replace(EXPERTS, param_bytes=0.9e9)
  prof = moe_profile(big, layer_fwd=1e-3, layer_bwd=2e-3, layer_param_bytes=1e9)
  cluster = make_cluster(groups=(('gpu', 8, 1.0, '6 GB'),), bandwidth='10 GB/s', latency='5 us')
  best = exhaustive.search(cfg, cluster, profile=prof, top_k=1).top[0]
  b = best.plan
  choices = {
    'tensor': b.tensor,
    'pipe': b.pipe,
    'microbatches': b.microbatches,
    'schedule': (b.schedule, b.virtual_stages),
    'remat': b.remat,
    'sharding': b.state_sharding,
  }
  part = decisions.Partial(choices=choices, stages=list(b.stages))
  got = decisions.plan_of(decisions.problem(cfg, cluster, prof), part)
  assert got.plan.expert == b.expert > 1 and not got.oom
  assert got.step_time == pytest.approx(best.step_time)
