"""Sequence (SP) and context (CP) parallelism in the planner: memory, collectives, choice, plan files.

The memory figures are Korthikanti et al.'s (2022) per-layer count without
dropout (plan/cost/memory.py's docstring), on the analytic profile of a small
GPT; the collectives are arithmetic on plan/comm.py's ring formulas over
test clusters.
"""

import dataclasses

import pytest
from test_plan_search import small_config
from test_plan_simulator import make_cluster, make_plan

from triax import config
from triax.pipeline import schedule as sched
from triax.plan import cluster as cluster_lib
from triax.plan.cost import analytic, memory, profile, simulator
from triax.plan.cost.comm import Comm
from triax.plan.cost.simulator import Options, simulate_plan
from triax.plan.search import emit, evaluate, exhaustive
from triax.plan.search import layouts as layouts_lib

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

MB = 2**20


def gpt(seq_len=2048, d_model=2048, heads=16, layers=20):
  cfg = config.defaults()
  m = cfg.model
  m.num_layers, m.d_model, m.num_heads, m.d_ff = layers, d_model, heads, 4 * d_model
  m.vocab_size, m.seq_len, m.dtype = 256, seq_len, 'bfloat16'
  return cfg


def gpus(n, memory='80 GB'):
  """n GPUs of H100's data sheet on one NVLink node."""
  raw = {
    'name': 'gpus',
    'groups': [
      {
        'name': 'gpu',
        'type': 'gpu',
        'count': n,
        'peak_flops': {'bfloat16': '989 TFLOP/s', 'float32': '495 TFLOP/s'},
        'memory': memory,
        'memory_bandwidth': '3350 GB/s',
        'matmul_efficiency': 0.7,
      }
    ],
    'nodes': [{'name': 'n0', 'devices': {'gpu': n}}],
    'links': {
      'intra_node': {'bandwidth': '370 GB/s', 'latency': '3 us'},
      'inter_node': {'bandwidth': '50 GB/s', 'latency': '5 us'},
    },
  }
  return cluster_lib.parse(raw, 'gpus.yaml')


def sequence_plan(c=1, t=1, sp=False, kind='allgather', remat='none', d=1, p=1, m=1, layers=None):
  plan = make_plan(p=p, m=m, d=d * c, t=t, remat=remat, layers=layers)
  layout = dataclasses.replace(
    plan.layout, data=d, context=c, sequence_parallel=sp, context_attention=kind
  )
  return dataclasses.replace(plan, layout=layout, global_batch=m * d)


@pytest.mark.parametrize('remat', profile.REMATS)
def test_sequence_parallel_lowers_activations_by_the_papers_ratio(remat):
  # A 1B-ish GPT at t = 4: s = h = 2048, a = 16, 2-byte activations.
  s, h, a, t, e = 2048, 2048, 16, 4, 2
  shard = analytic.build(gpt().model, [t]).shards[t]
  # Per layer and sequence (Korthikanti et al., less dropout): s h e times;
  # attention (their selective recomputation) keeps 4 + 12 / t; dots keeps
  # the layer's input and the attention's output projection (2) and Q, K, V
  # and fc1's outputs (7 / t).
  per_she = {
    'none': (4 + 12 / t + a * s / (h * t), 16 / t + a * s / (h * t)),
    'attention': (4 + 12 / t, 16 / t),
    'dots': (2 + 7 / t, 9 / t),
    'full': (1, 1 / t),
  }[remat]
  tp = memory.layer_stash(sequence_plan(t=t, remat=remat), shard)
  sp = memory.layer_stash(sequence_plan(t=t, sp=True, remat=remat), shard)
  assert tp == pytest.approx(s * h * e * per_she[0])
  assert sp == pytest.approx(s * h * e * per_she[1])
  if remat == 'none':
    assert (tp / MB, sp / MB) == pytest.approx((88, 64))
  # A stashed micro-batch's chunk input is the residual stream: split too.
  # The executor's pool splits the whole part over tensor without SP as well
  # (GSPMD's layout of the unpinned pool), so only the chunk input differs.
  prof = analytic.build(gpt().model, [t])
  fixed = shard.stash_fixed_per_seq
  one = memory.chunk_stash(sequence_plan(t=t, remat=remat), prof, 1)
  assert one == pytest.approx(sp + fixed)
  assert memory.chunk_stash(sequence_plan(t=t, sp=True, remat=remat), prof, 1) == pytest.approx(
    sp + fixed / t
  )


@pytest.mark.parametrize('remat', profile.REMATS)
def test_context_parallel_halves_the_activations(remat):
  prof = analytic.build(gpt().model, [1, 4])
  for t in (1, 4):
    shard = prof.shards[t]
    whole = memory.layer_stash(sequence_plan(t=t, remat=remat), shard)
    ring = memory.layer_stash(sequence_plan(c=2, t=t, kind='ring', remat=remat), shard)
    gathered = memory.layer_stash(sequence_plan(c=2, t=t, remat=remat), shard)
    assert ring == pytest.approx(whole / 2)
    # The all-gather kind keeps the other rank's K and V for the backward,
    # unless the layer's checkpoint gathers them again.
    kv = 2 * 2048 * (16 // t) * 128 * 2
    assert shard.kv_per_seq == kv
    kept = remat in ('none', 'attention')
    assert gathered == pytest.approx(whole / 2 + (kv / 2 if kept else 0.0))
  # Messages and the head's logits: half the positions.
  plain, split = sequence_plan(t=4), sequence_plan(c=2, t=4)
  assert memory.residual_share(split) == memory.residual_share(plain) / 2
  assert memory.residual_share(sequence_plan(c=2, t=4, sp=True)) == 1 / 8


def test_context_and_sequence_collectives_are_priced_by_the_links():
  # 4 devices, 1 GB/s and 1 ms a step; K/V of 0.1 GB per sequence.
  GB = 1e9
  prof = profile.synthetic(
    layer_fwd=0.01, layer_bwd=0.02, kv_per_seq=0.1 * GB, act_per_seq=0.2 * GB
  )
  prof.shards[1] = dataclasses.replace(prof.shards[1], attention_fraction=0.5)
  cluster = make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),), bandwidth=1 * GB, latency='1 ms')
  comm = Comm(cluster, prof)
  shard = prof.shards[1]
  # allgather at c = 4: K/V gathered in the forward, their gradients
  # reduce-scattered in the backward: 3 steps of 1/4 each, not overlapped.
  step = 3 * 1e-3 + 0.75 * 0.1
  gathered = sequence_plan(c=4, remat='none')
  assert simulator.context_seconds(gathered, shard, comm, 0, 0.01) == pytest.approx((step, step))
  # Recomputing the layer gathers again in the backward; recomputing the
  # attention core alone does not (the gathered K/V are its inputs).
  assert simulator.context_seconds(
    dataclasses.replace(gathered, remat='dots'), shard, comm, 0, 0.01
  ) == pytest.approx((step, 2 * step))
  assert simulator.context_seconds(
    dataclasses.replace(gathered, remat='attention'), shard, comm, 0, 0.01
  ) == pytest.approx((step, step))
  # ring: 3 passes of a 1/4 block, each beside the attention of one block
  # (half the layer's 0.01 s forward, over 4 blocks); the backward's carry
  # K/V and their gradients beside twice that.
  ring = sequence_plan(c=4, kind='ring')
  block = 0.01 * 0.5 / 4
  hop = 1e-3 + 0.025
  assert simulator.context_seconds(ring, shard, comm, 0, 0.01) == pytest.approx(
    (3 * (hop - block), 3 * (1e-3 + 0.05 - 2 * block))
  )
  # SP: each tensor all-reduce becomes a reduce-scatter and an all-gather
  # of the same bytes (the same time); a pipeline message needs no gather.
  # The backward gathers the normed stream again before the weight
  # gradients of attention's and the MLP's first matmuls (common.project),
  # which B and W share as they share the backward; full remat's rerun
  # forward gathers it instead.
  gather = 1e-3 + 0.5 * 0.2  # half a ring all-reduce over the 2 tensor ranks
  synthetic = profile.synthetic(tensors=(2,), act_per_seq=0.2 * GB, num_layers=2)
  for remat, regathers in (('none', 2 * gather), ('attention', 2 * gather), ('full', 0.0)):
    tp, sp = (
      sequence_plan(t=2, p=2, m=2, layers=(1, 1), remat=remat),
      sequence_plan(t=2, p=2, m=2, sp=True, layers=(1, 1), remat=remat),
    )
    tp_costs = simulator.action_costs(tp, synthetic, cluster)
    sp_costs = simulator.action_costs(sp, synthetic, cluster)
    for a, b in zip(sp_costs.chunk, tp_costs.chunk, strict=True):
      assert a[sched.FORWARD] == b[sched.FORWARD]
      backward = a[sched.BACKWARD] + a[sched.WEIGHT] - b[sched.BACKWARD] - b[sched.WEIGHT]
      assert backward == pytest.approx(regathers)
    assert tp_costs.transfer[0] - sp_costs.transfer[0] == pytest.approx(gather)


def test_gradients_are_reduced_over_data_and_context():
  GB = 1e9
  prof = profile.synthetic(layer_param_bytes=0.1 * GB)
  cluster = make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),), bandwidth=1 * GB)
  cp = simulate_plan(sequence_plan(d=2, c=2, m=1, layers=(8,)), prof, cluster)
  dp = simulate_plan(make_plan(p=1, m=1, d=4, layers=(8,)), prof, cluster)
  # Both all-reduce the 0.8 GB of gradients over all 4 devices.
  assert cp.dp_allreduce_time == pytest.approx(dp.dp_allreduce_time) == pytest.approx(1.5 * 0.8)


def test_context_one_and_no_sp_change_nothing():
  prof = analytic.build(gpt(layers=4).model, [1, 2])
  cluster = gpus(8)
  for t in (1, 2):
    plan = make_plan(p=2, m=4, d=4 // t, t=t, layers=(2, 2))
    layout = dataclasses.replace(
      plan.layout, context=1, sequence_parallel=False, context_attention='ring'
    )
    same = dataclasses.replace(plan, layout=layout)
    a, b = simulate_plan(plan, prof, cluster), simulate_plan(same, prof, cluster)
    assert (a.step_time, a.memory) == (b.step_time, b.memory)
    assert 'c1' not in plan.describe() and 'sp' not in plan.describe()


def test_layouts_offer_context_where_the_sequence_splits_and_sp_where_tensor_does():
  cfg = small_config(layers=4, batch=8)
  # Context degrees c dividing 8 with seq_len % 2c == 0 and at least
  # MIN_CONTEXT_POSITIONS (1024) a rank: 4 would leave 768.
  cfg.model.seq_len = 3072
  found = list(layouts_lib.layouts(cfg, 8))
  assert {l.context for l in found} == {1, 2}
  assert all(l.tensor > 1 for l in found if l.sequence_parallel)
  # The config's context attention kind: the simulator prices either.
  assert {l.context_attention for l in found} == {'allgather'}
  cfg.model.context_attention = 'ring'
  assert {l.context_attention for l in layouts_lib.layouts(cfg, 8)} == {'ring'}
  assert all(l.data * l.context * l.tensor * l.pipe == 8 for l in found)
  cfg.model.seq_len = 2050  # not 4 equal chunks
  assert {l.context for l in layouts_lib.layouts(cfg, 8)} == {1}
  cfg.model.seq_len = 3072
  cfg.model.attention = 'splash'  # the load-balanced mask is the xla path's alone
  assert {l.context for l in layouts_lib.layouts(cfg, 8)} == {1}


def test_a_long_sequence_the_memory_cannot_hold_whole_is_split_over_context():
  # 2 layers, 2 heads (tensor <= 2), 32k tokens a sequence, 4 sequences on
  # 4 GPUs: the scores of a whole sequence do not fit 6 GB at any remat
  # policy, tensor or pipeline degree; split over context they do.
  cfg = gpt(seq_len=32768, d_model=512, heads=2, layers=2)
  cfg.train.global_batch_size = 4
  prof = analytic.build(cfg.model, [1, 2])
  tight = gpus(4, '6 GB')
  result = exhaustive.search(cfg, tight, top_k=3, profile=prof)
  best = result.top[0]
  assert best.plan.context > 1 and not best.oom
  everything = evaluate.evaluate(cfg, tight, prof, Options(), list(layouts_lib.layouts(cfg, 4)))
  assert all(e.oom for e in everything if e.plan.context == 1)
  # With room the same search keeps the sequence whole (data parallelism
  # moves no K/V).
  roomy = exhaustive.search(cfg, gpus(4, '80 GB'), top_k=1, profile=prof)
  assert roomy.top[0].plan.context == 1


def test_plan_file_writes_the_sequence_keys_only_when_used(tmp_path):
  cfg = small_config(layers=4, batch=8)
  plain = make_plan(p=2, m=4, d=2, t=2, layers=(2, 2))
  assert not set(emit.SEQUENCE_KEYS) & set(emit.overrides(plain, heterogeneous=True))
  plan = sequence_plan(d=1, c=2, t=2, p=2, m=4, sp=True, kind='ring', layers=(2, 2))
  plan = dataclasses.replace(plan, global_batch=8)
  keys = emit.overrides(plan, heterogeneous=True)
  assert keys['mesh.context'] == 2 and keys['mesh.sequence_parallel'] is True
  assert keys['model.context_attention'] == 'ring'
  # Row-major over (data, context, tensor, pipe): stage s's devices in their
  # own order, the stages interleaved.
  assert keys['mesh.device_order'] == (0, 4, 1, 5, 2, 6, 3, 7)
  validated = config.validate(evaluate.with_plan(cfg, plan), 8)
  assert (validated.mesh.context, validated.mesh.tensor, validated.mesh.pipe) == (2, 2, 2)
  # A config that says otherwise gets the plan's value written.
  cfg.mesh.context, cfg.mesh.data = 2, 2
  assert emit.overrides(plain, cfg=cfg)['mesh.context'] == 1
  base = tmp_path / 'base.py'
  base.write_text(
    'from triax import config\n\n\ndef get_config(arg=None):\n  return config.defaults()\n'
  )
  est = simulate_plan(plan, profile.synthetic(tensors=(2,)), make_cluster())
  text = emit.write(str(tmp_path / 'plan.py'), est, str(base), None, {}, 'test')
  assert "'mesh.context': 2" in text and "'model.context_attention': 'ring'" in text


def test_a_window_prices_the_blocks_it_reaches():
  # test_context_and_sequence_collectives_are_priced_by_the_links's links and
  # K/V; 64 positions over 4 ranks (chunks of 8) and a 5-position window:
  # a local layer meets 3 of the 4 blocks (model/window.py), 2 fetched.
  GB = 1e9
  prof = profile.synthetic(layer_fwd=0.01, layer_bwd=0.02, kv_per_seq=0.1 * GB)
  cluster = make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),), bandwidth=1 * GB, latency='1 ms')
  comm = Comm(cluster, prof)
  block, hop, hop2 = 0.01 * 0.5 / 4, 1e-3 + 0.025, 1e-3 + 0.05
  for share in (1.0, 0.5):
    window = profile.Window(seq_len=64, size=5, local_share=share)
    assert window.steps(4) == 3
    shard = dataclasses.replace(prof.shards[1], attention_fraction=0.5, window=window)
    ring = simulator.context_seconds(sequence_plan(c=4, kind='ring'), shard, comm, 0, 0.01)
    whole = (3 * (hop - block), 3 * (hop2 - 2 * block))
    near = (2 * (hop - block), 2 * (hop2 - 2 * block))
    assert ring == pytest.approx(tuple(share * n + (1 - share) * w for n, w in zip(near, whole)))
    # The all-gather kind fetches the 2 blocks in reach rather than gathering all 4.
    gathered = simulator.context_seconds(sequence_plan(c=4), shard, comm, 0, 0.01)
    gather = 3 * 1e-3 + 0.75 * 0.1
    expected = (share * 2 * hop + (1 - share) * gather, share * 2 * hop2 + (1 - share) * gather)
    assert gathered == pytest.approx(expected)
    # A local layer's attention core (half the layer) skips 1 block of 4.
    for kind in ('ring', 'allgather'):
      plan = sequence_plan(c=4, kind=kind)
      assert simulator.context_compute_share(plan, shard) == pytest.approx(1 - 0.5 * share / 4)
  assert simulator.context_compute_share(sequence_plan(c=1), shard) == 1.0
  # The all-gather kind's local layers keep no gathered K/V (their own backward fetches again).
  gathered, windowed = sequence_plan(c=4), dataclasses.replace(shard, window=window)
  kept = memory.layer_stash(gathered, prof.shards[1]) - memory.layer_stash(gathered, windowed)
  assert kept == pytest.approx(0.1 * GB * 0.75 * window.local_share)


@pytest.mark.parametrize('attention', ('splash', 'xla'))
def test_a_flash_kernel_computes_a_windows_share_of_the_scores(attention):
  # Llama, 2048 positions, 16 heads of 128, a 512-position window on 3 of every 4 layers.
  def layer_flops(window, pattern):
    cfg = gpt(layers=8)
    cfg.model.update(family='llama', attention=attention, sliding_window=window)
    cfg.model.sliding_window_pattern = pattern
    return analytic.build(cfg.model, [1]).shards[1].work['layer_fwd'].flops_per_seq

  s, w, heads, hd = 2048, 512, 16, 128
  saved = layer_flops(0, 0) - layer_flops(w, 4)
  if attention == 'xla':  # XLA's masked core computes the whole square either way
    assert saved == 0
    return
  windowed = (w * s - w * (w - 1) / 2) / (s * s)
  assert saved == pytest.approx(0.75 * 4.0 * s * s * heads * hd * (0.5 - windowed))
