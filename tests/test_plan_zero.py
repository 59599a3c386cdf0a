"""ZeRO-1 and FSDP in the planner: memory, collectives, choice, plan files, the zero3 baseline.

Hand-built (synthetic) profiles and test clusters: every figure below is
arithmetic on the formulas of plan/cost/memory.py and plan/cost/simulator.py.
"""

import dataclasses

import pytest
from test_plan_search import small_config
from test_plan_simulator import make_cluster, make_plan

from triax import config, sharding
from triax.plan.cost import memory, profile
from triax.plan.cost.simulator import Options, simulate_plan
from triax.plan.search import emit, evaluate, exhaustive

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

GB = 1e9
STEP_ONLY = Options(state_programs=False)


def sharded(plan, kind):
  return dataclasses.replace(plan, state_sharding=kind)


@pytest.mark.parametrize('d', [2, 4, 8])
def test_state_memory_falls_by_the_data_degree(d):
  prof = profile.synthetic(layer_param_bytes=1 * GB, edge_param_bytes=0.5 * GB)
  params = 8 * 1 * GB + 0.5 * GB  # 8 layers and the edges on the one stage
  unpiped = make_plan(p=1, m=1, d=d, layers=(8,))
  rep = memory.state(unpiped, prof, params)
  assert rep == {'params': params, 'grads': params, 'moments': 2 * params, 'gathered': 0.0}
  zero1 = memory.state(sharded(unpiped, 'zero1'), prof, params)
  # ZeRO-1: only Adam's two moments split.
  assert zero1['moments'] == pytest.approx(rep['moments'] / d)
  assert (zero1['params'], zero1['grads']) == (params, params)
  # FSDP at pipe = m = 1: parameters, gradients and moments split; what a
  # layer gathers as it runs is the step's work (below).
  fsdp = memory.state(sharded(unpiped, 'fsdp'), prof, params)
  for part in ('params', 'grads', 'moments'):
    assert fsdp[part] == pytest.approx(rep[part] / d)
  assert fsdp['gathered'] == 0.0
  # With the executor (m > 1) the stage's weights are gathered whole once
  # per step and live through the tick loop, beside the whole accumulator.
  stepped = memory.state(sharded(make_plan(p=1, m=2, d=d, layers=(8,)), 'fsdp'), prof, params)
  assert stepped['params'] == pytest.approx(params / d) and stepped['gathered'] == params
  assert stepped['grads'] == params
  # The simulator's step peak carries the same state (no activations here).
  cluster = make_cluster(groups=(('gpu', d, 1.0, '80 GB'),))
  peaks = {
    k: simulate_plan(
      sharded(unpiped, k) if k != 'replicated' else unpiped, prof, cluster, STEP_ONLY
    )
    for k in ('replicated', 'zero1', 'fsdp')
  }
  assert peaks['replicated'].step_memory[0] == pytest.approx(4 * params)
  assert peaks['zero1'].step_memory[0] == pytest.approx(2 * params + 2 * params / d)
  # FSDP's: beside it, a layer's weights gathered twice (forward and backward).
  assert peaks['fsdp'].step_memory[0] == pytest.approx(4 * params / d + 2 * GB)


def test_save_and_eval_count_beside_the_resident_state():
  prof = profile.synthetic(layer_param_bytes=1 * GB, stash_per_seq=0.1 * GB, act_per_seq=0.01 * GB)
  plan = make_plan(p=1, m=1, d=2, layers=(4,))
  plan = dataclasses.replace(plan, global_batch=8)  # 4 rows per replica
  progs = memory.state_programs(sharded(plan, 'zero1'), prof, 4 * GB)
  resident = 4 * GB + 2 * 4 * GB / 2  # parameters and the moments' half
  # Save / restore: the state and one leaf's conversion (the checkpoint's copy is
  # in host memory): one weight of the layer stack, memory.LARGEST_WEIGHT of it.
  leaf = 4 * GB / 3
  assert progs['save'] == progs['restore'] == pytest.approx(resident + leaf)
  # Evaluation: the replica's 4 rows (the step's micro-batch) through one layer
  # at a time, no stash.
  assert progs['eval'] == pytest.approx(resident + 4 * (0.1 + 2 * 0.01) * GB)
  est = simulate_plan(
    sharded(plan, 'zero1'), prof, make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),))
  )
  assert est.state_memory[0] == pytest.approx(resident + leaf)
  assert est.memory[0] == max(est.step_memory[0], est.state_memory[0])


def test_eval_runs_the_steps_micro_batch_over_the_pipe_ranks():
  # 16 rows, 2 replicas, 4 stages of 1 layer: 8 rows a replica, 2 a pipe rank,
  # in 2 micro-batches of 1 (the step's: 16 / (2 x 8)). Beside the resident
  # state: the layers resharded over pipe (1 GB), one layer gathered (1 GB).
  prof = profile.synthetic(layer_param_bytes=1 * GB, stash_per_seq=0.1 * GB, act_per_seq=0.01 * GB)
  plan = dataclasses.replace(make_plan(p=4, m=8, d=2), global_batch=16)
  progs = memory.state_programs(plan, prof, 1 * GB)
  assert progs['eval'] == pytest.approx(3 * GB + 1 * GB + 1 * GB + 1 * (0.1 + 2 * 0.01) * GB)


def test_only_zero1_fits_and_is_chosen():
  # One layer (no pipeline), two devices (d = 2, t = 1): the state is
  # 1.1 GB of parameters. Replicated 4.4 GB, ZeRO-1 2.2 + 1.1, FSDP 2.2 + 2
  # (one layer gathered) or 2.2 + 1.65 (gathered once a step): only ZeRO-1
  # fits under 90% of 4 GB.
  cfg = small_config(layers=1, batch=2)
  prof = profile.synthetic(layer_param_bytes=1 * GB, edge_param_bytes=0.1 * GB)
  result = exhaustive.search(
    cfg, make_cluster(groups=(('gpu', 2, 1.0, '4 GB'),)), profile=prof, options=STEP_ONLY
  )
  assert result.top and {e.plan.state_sharding for e in result.top} == {'zero1'}
  assert result.baselines['data_parallel'] is None and result.baselines['zero3'] is None
  roomy = exhaustive.search(
    cfg, make_cluster(groups=(('gpu', 2, 1.0, '80 GB'),)), profile=prof, options=STEP_ONLY
  )
  assert roomy.baselines['data_parallel'] is not None


def test_only_fsdp_fits_with_its_state_programs_and_is_chosen():
  # Four devices, one layer of 1 GB and 1 GB of edges (P = 2 GB). The step:
  # replicated 8 GB, ZeRO-1 5, FSDP per layer 2 + 2 (the larger of a layer
  # and the edges, gathered, and its gradient). Beside the resident state
  # (replicated 6, ZeRO-1 3, FSDP 1.5) a save holds one leaf's conversion (the
  # head's 0.5 GB, a quarter of it with FSDP) and an evaluation FSDP's
  # gathered layer (1 GB): FSDP's 2.5. Under 90% of 5 GB only FSDP at m = 1
  # (ZeRO-3 proper) fits.
  cfg = small_config(layers=1, batch=4)
  cfg.model.d_model = 64
  prof = profile.synthetic(layer_param_bytes=1 * GB, edge_param_bytes=1 * GB)
  result = exhaustive.search(cfg, make_cluster(groups=(('gpu', 4, 1.0, '5 GB'),)), profile=prof)
  best = result.top[0]
  assert best.plan.state_sharding == 'fsdp' and best.plan.microbatches == 1
  assert best.step_memory[0] == pytest.approx(4 * GB)
  assert best.state_memory[0] == pytest.approx(2.5 * GB)
  assert result.baselines['zero3'].plan == best.plan
  assert result.baselines['data_parallel'] is None


def test_fsdp_collectives_per_layer_and_per_step():
  # 4 devices on one node, 1 GB/s, no latency; 8 layers of 0.1 GB, no
  # edges; compute 0.01 s forward, 0.02 s backward per layer.
  prof = profile.synthetic(layer_fwd=0.01, layer_bwd=0.02, layer_param_bytes=0.1 * GB)
  cluster = make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),), bandwidth=1 * GB)
  gather = 0.75 * 0.1  # an all-gather of 0.1 GB over 4: 3/4 of it through each link
  scatter = gather
  plan = make_plan(p=1, m=1, d=4, layers=(8,))
  c_f, c_b = 0.01, 0.02  # one sequence per replica
  fsdp = sharded(plan, 'fsdp')
  overlapped = simulate_plan(fsdp, prof, cluster, Options(fsdp_overlap=True))
  serial = simulate_plan(fsdp, prof, cluster)  # the default: triax's scan, no overlap
  compute = 8 * (c_f + c_b)
  # Not overlapped: every layer's gather (forward), gather and reduce-scatter (backward).
  assert serial.step_time == pytest.approx(compute + 8 * (2 * gather + scatter))
  # Overlapped (ZeRO-3's prefetch): g + 7 max(c, g) + c each way.
  want = (gather + 7 * max(c_f, gather) + c_f) + (
    gather + scatter + 7 * max(c_b, gather + scatter) + c_b
  )
  assert overlapped.step_time == pytest.approx(want)
  assert overlapped.dp_allreduce_time == 0.0  # no edges: nothing per step
  # Per step (the executor, m = 2): the stage's 0.8 GB gathered once before
  # the tick loop and its gradients all-reduced after it.
  stepped = simulate_plan(sharded(make_plan(p=1, m=2, d=4, layers=(8,)), 'fsdp'), prof, cluster)
  assert stepped.dp_allreduce_time == pytest.approx(0.75 * 0.8 + 1.5 * 0.8)
  # Replicated: the all-reduce alone; ZeRO-1 without the executor: a
  # reduce-scatter and the updated parameters' all-gather, the same bytes.
  rep = simulate_plan(plan, prof, cluster)
  zero1 = simulate_plan(sharded(plan, 'zero1'), prof, cluster)
  assert rep.dp_allreduce_time == pytest.approx(1.5 * 0.8)
  assert zero1.dp_allreduce_time == pytest.approx(rep.dp_allreduce_time)
  # With the executor, its psum over data and then the all-gather.
  zero1_m2 = simulate_plan(sharded(make_plan(p=1, m=2, d=4, layers=(8,)), 'zero1'), prof, cluster)
  assert zero1_m2.dp_allreduce_time == pytest.approx(1.5 * 0.8 + 0.75 * 0.8)


@pytest.mark.parametrize(
  'kind, keys',
  [
    ('zero1', ('data', False)),
    ('fsdp', ('replicated', True)),
    ('replicated', ('replicated', False)),
  ],
)
def test_plan_file_sets_the_sharding_keys_and_validates(tmp_path, kind, keys):
  base = tmp_path / 'base.py'
  base.write_text(
    'from triax import config\n\n\ndef get_config(arg=None):\n'
    '  c = config.defaults()\n  c.model.num_layers = 4\n  c.mesh.fsdp = True\n  return c\n'
  )
  plan = sharded(make_plan(p=2, m=4, d=2, t=2, layers=(2, 2)), kind)
  est = simulate_plan(plan, profile.synthetic(tensors=(2,)), make_cluster())
  out = tmp_path / 'plan.py'
  text = emit.write(str(out), est, str(base), None, {}, 'test')
  assert ('zero1' in text) == (kind == 'zero1')
  cfg = config.from_file(str(out))
  assert (cfg.train.optimizer_sharding, cfg.mesh.fsdp) == keys  # the base's fsdp overridden
  cfg = config.validate(cfg, 8)
  assert (('embed', 'data') in sharding.resolve_rules(cfg)) == keys[1]


def test_zero3_baseline_is_reported():
  cfg = small_config(layers=4, batch=8)
  prof = profile.synthetic(layer_param_bytes=1e6, act_per_seq=1e5, tensors=(1, 2))
  result = exhaustive.search(cfg, make_cluster(groups=(('gpu', 4, 1.0, '80 GB'),)), profile=prof)
  zero3 = result.baselines['zero3']
  assert zero3 is not None and not zero3.oom
  assert (zero3.plan.data, zero3.plan.tensor, zero3.plan.pipe) == (4, 1, 1)
  assert zero3.plan.state_sharding == 'fsdp'
  assert result.speedup('zero3') >= 1.0 - 1e-9
  # Candidates carry every sharding where data > 1, only replicated where not.
  assert evaluate.state_shardings(cfg, 1) == ('replicated',)
  assert evaluate.state_shardings(cfg, 4) == ('replicated', 'zero1', 'fsdp')
  assert evaluate.state_shardings(cfg, 3) == ('replicated', 'zero1')  # 32 % 3: no FSDP


def test_the_optimizer_state_follows_train_optimizer():
  """Options.optimizer_state (training/optimizer.state_per_param): the layers'
  and the edges' state per parameter byte, each on its own bytes."""
  prof = profile.synthetic(layer_param_bytes=1 * GB, edge_param_bytes=0.5 * GB)
  params = 8 * 1 * GB + 0.5 * GB
  plan = make_plan(p=1, m=1, d=1, layers=(8,))
  cluster = make_cluster(groups=(('gpu', 1, 1.0, '80 GB'),))
  adamw = simulate_plan(plan, prof, cluster, STEP_ONLY).step_memory[0]
  # Muon: one moment on the layers' matrices, AdamW's two on the edges.
  muon = Options(state_programs=False, optimizer_state=(1.0, 2.0))
  assert memory.stage_moments(plan, prof, muon, 8) * params == pytest.approx(8 * GB + 1 * GB)
  assert simulate_plan(plan, prof, cluster, muon).step_memory[0] == pytest.approx(adamw - 8 * GB)
  # ZeRO-1 splits whatever the optimizer holds.
  assert memory.copies('zero1', 4, moments=1.0)['moments'] == 0.25


def test_state_per_param_counts_each_optimizers_state():
  from triax.training import optimizer

  cfg = small_config()
  figures = {}
  for name in ('adamw', 'muon', 'lion', 'adafactor', 'schedule_free_adamw'):
    cfg.train.optimizer = name
    figures[name] = optimizer.state_per_param(cfg)
  # (Step counts and other scalars are the edges' few bytes more.)
  assert figures['adamw'] == pytest.approx((2.0, 2.0), rel=1e-3)
  assert figures['lion'] == pytest.approx((1.0, 1.0), rel=1e-3)
  assert figures['muon'][0] == pytest.approx(1.0, abs=0.01)  # norms take AdamW's 2
  assert figures['muon'][1] == pytest.approx(2.0, abs=1e-3)
  assert figures['schedule_free_adamw'][0] == pytest.approx(2.0, abs=1e-3)  # z and v
  # No first moment; the second unfactored at widths below 128 (llama_8b's: 0.0018).
  assert figures['adafactor'][0] == pytest.approx(1.0, rel=1e-2)
