"""train.offload_optimizer: Adam's state in host memory between steps.

On the CPU's XLA (its devices have a pinned_host memory) the numbers must be
the device-resident run's exactly, through a save's and a restore's
conversions; on XLA:TPU (compiled for a v5p slice here, no TPU) the
device's argument bytes fall by the optimizer state's, and the run's peak
with them.
"""

import os
import types

import harness
import jax
import numpy as np
import pytest

from triax.errors import ConfigError
from triax.training import step as step_lib

# A pipelined layout (the executor's train step) with ZeRO-1 moments split over data.
LAYOUT = {
  'mesh.data': 2,
  'mesh.tensor': 2,
  'mesh.pipe': 2,
  'pipeline.microbatches': 4,
  'train.optimizer_sharding': 'data',
}


def _run(offload: bool, steps: int = 3):
  cfg = harness.tiny_config(**LAYOUT, **{'train.offload_optimizer': offload})
  trainer = harness.make_trainer(cfg)
  state = harness.initial_state(trainer, cfg.train.seed)
  losses = []
  with jax.set_mesh(trainer.mesh):
    for i in range(steps):
      batch = jax.device_put(harness.random_batch(cfg, seed=i), trainer.batch_sharding)
      state, out = trainer.train_step(state, batch)
      losses.append(float(out['loss']))
    # A save's conversion and a restore's, back to the train state's layout.
    restored = trainer.from_canonical(trainer.to_canonical(state))
  return trainer, state, restored, losses


def test_offloaded_optimizer_state_trains_and_converts_as_on_the_device():
  _, state, _, losses = _run(offload=False)
  trainer, off_state, off_restored, off_losses = _run(offload=True)
  assert off_losses == losses
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(off_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(off_state), jax.tree.leaves(off_restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(off_state.opt_state)}
  assert kinds == {step_lib.HOST}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(off_state.params)} == {'device'}
  # The checkpoint's copy stays on the host too.
  canonical = trainer.canonical_shardings.opt_state
  assert {s.memory_kind for s in jax.tree.leaves(canonical)} == {step_lib.HOST}


def test_a_backend_without_host_memory_is_refused():
  memory = types.SimpleNamespace(kind='device')
  device = types.SimpleNamespace(platform='abc', addressable_memories=lambda: [memory])
  with pytest.raises(ConfigError) as e:
    step_lib.check_host_memory(device)
  assert e.value.key == 'train.offload_optimizer' and 'no pinned_host' in e.value.message
  step_lib.check_host_memory(jax.devices()[0])  # the CPU's has one


def _tpu_stats(tmp_path, name: str, *flags: str) -> dict:
  """compile_stats.json of the 1B smoke config compiled for 4 v5p chips with `flags`."""
  import json

  workdir = str(tmp_path / name)
  result = harness.run_cli(
    'triax.cli.train',
    '--config=experiments/llama_1b.py:smoke,attention=xla',
    f'--workdir={workdir}',
    '--compile_only',
    '--topology=v5p:2x2x1',
    *flags,
  )
  assert result.returncode == 0, result.stderr
  with open(os.path.join(workdir, 'compile_stats.json')) as f:
    return json.load(f)


def _optimizer_stats(tmp_path, offload: bool) -> dict:
  flag = f'--config.train.offload_optimizer={str(offload).lower()}'
  return _tpu_stats(
    tmp_path, f'optimizer_{offload}', '--config.mesh.data=4', '--config.mesh.fsdp=true', flag
  )


def test_on_a_tpu_the_devices_hold_no_optimizer_state(tmp_path):
  pytest.importorskip('libtpu')
  on, off = _optimizer_stats(tmp_path, False), _optimizer_stats(tmp_path, True)
  assert off['offloaded_bytes'] == off['optimizer_bytes'] == on['optimizer_bytes'] > 0
  # XLA:TPU's arguments in device memory: the parameters and the batch, no
  # moments (TPU tiles pad small arrays: more than their logical bytes leave).
  assert off['param_bytes'] <= off['argument_bytes']
  assert off['argument_bytes'] <= on['argument_bytes'] - on['optimizer_bytes']
  assert off['peak_bytes'] < on['peak_bytes']


# pipeline.offload_stash: the executor's residual sets in host memory between
# their F and their B and W. The same arithmetic, but XLA:CPU's loop
# emitters that the tests compile with (conftest.py) fuse the two programs
# apart, so a sum may round differently: measured 2e-7 of the largest
# gradient, held to 1e-6, ten times under parity's 1e-5 (with jaxlib's
# default emitters the two are the same bits).
STASH_LAYOUTS = {
  '1f1b-pipe4': {'mesh.pipe': 4, 'pipeline.microbatches': 8},
  'zb_h1-2x2x2': {
    'mesh.data': 2,
    'mesh.tensor': 2,
    'mesh.pipe': 2,
    'pipeline.microbatches': 4,
    'pipeline.schedule': 'zb_h1',
  },
  # Experts split over 2 of the data devices (their dispatch's own backward).
  'mixtral-expert2-pipe2': {
    'model.family': 'mixtral',
    'mesh.data': 2,
    'mesh.expert': 2,
    'mesh.pipe': 2,
    'pipeline.microbatches': 4,
    'model.router_aux_loss_scope': 'microbatch',
  },
}


@pytest.mark.parametrize('layout', list(STASH_LAYOUTS.values()), ids=list(STASH_LAYOUTS))
def test_an_offloaded_stash_gives_the_devices_numbers(layout):
  make = (
    harness.tiny_mixtral_config if layout.get('model.family') == 'mixtral' else harness.tiny_config
  )
  loss, grads = harness.loss_and_grads(make(**layout))
  off_loss, off_grads = harness.loss_and_grads(make(**layout, **{'pipeline.offload_stash': True}))
  assert abs(off_loss - loss) <= 1e-6 * abs(loss), (off_loss, loss)
  assert harness.max_rel_err(grads, off_grads) <= 1e-6


def _stash_stats(tmp_path, offload: bool) -> dict:
  return _tpu_stats(
    tmp_path,
    f'stash_{offload}',
    '--config.mesh.data=1',
    '--config.mesh.pipe=4',
    '--config.pipeline.microbatches=8',
    '--config.pipeline.schedule=gpipe',  # a slot per micro-batch
    # The smoke model made wide enough that its stash, not XLA:TPU's tiles, dominates.
    '--config.train.global_batch_size=16',
    '--config.model.num_layers=4',
    '--config.model.d_model=512',
    '--config.model.d_ff=1024',
    '--config.model.seq_len=512',
    f'--config.pipeline.offload_stash={str(offload).lower()}',
  )


def test_on_a_tpu_an_offloaded_stash_leaves_the_devices(tmp_path):
  pytest.importorskip('libtpu')
  on, off = _stash_stats(tmp_path, False), _stash_stats(tmp_path, True)
  schedule = off['schedule']
  assert schedule['offload_stash'] and not on['schedule']['offload_stash']
  slots, one_set = schedule['stash_slots'], schedule['residual_bytes_per_slot']
  assert slots == 8 and on['host_temp_bytes'] == 0
  # The pool and its spare slot are in host memory (but a set's scalars and
  # vectors, a few bytes). The device's heap keeps at most two sets of it: the
  # one an F has made and the one a B or W reads (7.35 of the 8 sets leave it
  # on libtpu 0.0.42, 7.17 on 0.0.50).
  assert off['host_temp_bytes'] >= 0.99 * (slots + 1) * one_set
  # The fit line says what waits in host memory, beside HBM's figure.
  host = f'; {off["host_temp_bytes"] / 2**30:.2f} GiB per device in host memory'
  assert off['fit_line'].endswith(host) and 'host memory' not in on['fit_line']
  assert off['temp_heap_bytes'] <= on['temp_heap_bytes'] - (slots - 2) * one_set


@pytest.mark.fast
def test_the_planner_counts_one_set_of_an_offloaded_stash():
  from triax import config as config_lib
  from triax.pipeline import schedule as sched
  from triax.plan import candidate
  from triax.plan.cost import analytic, memory

  path = os.path.join(os.path.dirname(__file__), '..', 'experiments', 'llama_1b.py')
  cfg = config_lib.from_file(path, 'attention=splash,remat=none')
  layout = {
    'mesh.data': 1,
    'mesh.pipe': 4,
    'pipeline.microbatches': 8,
    'pipeline.schedule': 'gpipe',
  }
  for key, value in layout.items():
    config_lib.set_dotted(cfg, key, value)
  cfg = config_lib.validate(cfg, 4)
  plan, profile = candidate.from_config(cfg), analytic.build(cfg.model, (1,))
  program = sched.lower(sched.from_config(cfg.pipeline, 4, 8, 1))
  one_set = memory.chunk_stash(plan, profile, 4)

  def stash(offload):
    options = candidate.Options(offload_stash=offload)
    return memory.pools(plan, profile, options, program, 0, 4)['stash']

  assert stash(False) == 8 * one_set and stash(True) == one_set


# Two searches of the 1B model's top 100 (seconds each): the whole suite's, not the fast tier's.
def test_the_planner_keeps_offloaded_moments_off_the_device_until_the_update(capsys):
  """`triax plan` reads train.offload_optimizer: each layout's peak loses
  Adam's moments through the forward and backward, and holds them again,
  beside the parameters and gradients, for the update; each step takes their
  trip over the host link, there and back."""
  from triax import config as config_lib
  from triax.plan import report

  config = os.path.join(harness.ROOT, 'experiments', 'llama_1b.py')
  cluster = os.path.join(harness.ROOT, 'experiments', 'clusters', 'dgx_h100.yaml')

  def top(offload):
    cfg = config_lib.from_file(config, 'attention=xla')
    cfg.train.offload_optimizer = offload
    request = report.Request(
      cfg=cfg,
      config_path=config,
      config_overrides={},
      cluster=cluster,
      top=100,
      profile='analytic',
      gpus=8,
    )
    return {row['plan']: row for row in report.run(request)['top']}

  on_device, offloaded = top(False), top(True)
  capsys.readouterr()
  both = on_device.keys() & offloaded.keys()  # the top 100 of each ranking
  assert len(both) > 4
  for plan in both:
    row = offloaded[plan]
    assert row['step_time_s'] > on_device[plan]['step_time_s'], plan
    for before, after in zip(on_device[plan]['memory_bytes'], row['memory_bytes']):
      assert after < before, plan


def _pp4_plan(cluster_name):
  from triax import config as config_lib
  from triax.plan import candidate
  from triax.plan import cluster as cluster_lib
  from triax.plan.cost import analytic

  cfg = config_lib.from_file(
    os.path.join(harness.ROOT, 'experiments', 'llama_1b.py'), 'attention=xla,remat=none'
  )
  for key, value in {'mesh.data': 1, 'mesh.pipe': 4, 'pipeline.microbatches': 8}.items():
    config_lib.set_dotted(cfg, key, value)
  cfg = config_lib.validate(cfg, 4)
  cluster = cluster_lib.load(
    os.path.join(harness.ROOT, 'experiments', 'clusters', f'{cluster_name}.yaml')
  )
  return candidate.from_config(cfg), analytic.build(cfg.model, (1,)), cluster_lib.resize(cluster, 4)


@pytest.mark.fast
def test_the_planner_prices_the_host_copies():
  import dataclasses

  from triax.plan import candidate
  from triax.plan.cost import host, memory, simulator

  plan, profile, cluster = _pp4_plan('dgx_h100')
  stash = candidate.Options(offload_stash=True)
  one_set = memory.chunk_stash(plan, profile, 4)
  assert host.stash_seconds(plan, profile, cluster, stash) == (one_set / 64e9,) * 4
  base = simulator.simulate_plan(plan, profile, cluster)
  assert simulator.simulate_plan(plan, profile, cluster, stash).step_time >= base.step_time
  # Over a slow link every tick waits for its copy: the ticks times one set's.
  slow = dataclasses.replace(
    cluster,
    groups={k: dataclasses.replace(g, host_bandwidth=1e6) for k, g in cluster.groups.items()},
  )
  estimate = simulator.simulate_plan(plan, profile, slow, stash)
  ticks = candidate.program(plan.schedule, 4, 8, 1).ticks
  assert ticks * one_set / 1e6 <= estimate.pipeline_time <= 1.01 * ticks * one_set / 1e6
  # The optimizer's moments: there and back once a step, after the backward.
  moved = simulator.simulate_plan(plan, profile, cluster, candidate.Options(offload_optimizer=True))
  trip = host.optimizer_seconds(plan, profile, cluster, candidate.Options(offload_optimizer=True))
  assert trip > 0 and moved.tail_time - base.tail_time == pytest.approx(trip)


@pytest.mark.fast
@pytest.mark.parametrize('key', ['pipeline.offload_stash', 'train.offload_optimizer'])
def test_an_offload_on_a_cluster_without_its_host_link_says_what_to_add(key):
  from triax.plan import candidate
  from triax.plan.cost import simulator

  plan, profile, cluster = _pp4_plan('tpu_v5p')
  options = candidate.Options(**{key.split('.')[1]: True})
  with pytest.raises(ConfigError) as error:
    simulator.simulate_plan(plan, profile, cluster, options)
  assert error.value.key == key
  assert "host_bandwidth of tpu_v5p's group v5p" in error.value.message
