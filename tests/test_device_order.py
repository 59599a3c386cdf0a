"""mesh.device_order: a plan's placement of devices on mesh positions.

A heterogeneous plan puts fast devices on heavy stages; the trainer must
place them where the plan says, and placement must not change the numbers.
"""

import importlib.util

import harness
import jax
import numpy as np
import pytest

from triax import config
from triax.errors import ConfigError
from triax.layout import Layout
from triax.mesh import build_mesh
from triax.plan import cluster as cluster_lib
from triax.plan.cost import profile
from triax.plan.cost.simulator import Plan, simulate_plan
from triax.plan.search import emit


def test_mesh_places_devices_in_the_given_order():
  cfg = harness.tiny_config(**{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2})
  order = [7, 3, 5, 1, 6, 2, 4, 0]
  cfg.mesh.device_order = tuple(order)
  cfg = config.validate(cfg, 8)
  mesh = build_mesh(cfg.mesh, jax.devices())
  devices = jax.devices()
  for k, (i, j, s) in enumerate(np.ndindex(2, 2, 2)):
    assert mesh.devices[i, 0, j, s] == devices[order[k]]


@pytest.mark.parametrize(
  'order',
  [(0, 1, 2), (0, 1, 2, 3, 4, 5, 6, 6), (1, 2, 3, 4, 5, 6, 7, 8), (0.0, 1, 2, 3, 4, 5, 6, 7)],
)
def test_bad_orders_name_the_key(order):
  cfg = harness.tiny_config(**{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2})
  cfg.mesh.device_order = order
  with pytest.raises(ConfigError, match='mesh.device_order'):
    config.validate(cfg, 8)


def test_order_cannot_mix_with_dcn():
  cfg = harness.tiny_config(
    **{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2, 'mesh.dcn_pipe': 2}
  )
  cfg.mesh.device_order = tuple(range(8))
  with pytest.raises(ConfigError, match='mesh.device_order'):
    config.validate(cfg, 8)


def test_placement_does_not_change_the_numbers():
  """Same loss and gradients (fp32) with the devices permuted, pipelined."""
  overrides = {
    'mesh.data': 2,
    'mesh.tensor': 2,
    'mesh.pipe': 2,
    'pipeline.schedule': '1f1b',
    'pipeline.microbatches': 4,
  }
  loss, grads = harness.loss_and_grads(harness.tiny_config(**overrides))
  moved = harness.tiny_config(**overrides)
  moved.mesh.device_order = (5, 2, 7, 0, 3, 6, 1, 4)
  loss2, grads2 = harness.loss_and_grads(moved)
  assert abs(loss - loss2) <= 1e-5 * abs(loss)
  assert harness.max_rel_err(grads, grads2) <= 1e-5


def test_heterogeneous_plan_file_carries_its_placement(tmp_path):
  """The planner's stage->device assignment reaches the trainer's mesh."""
  raw = {
    'name': 'mixed',
    'groups': [
      {
        'name': 'fast',
        'type': 'fast',
        'count': 4,
        'peak_flops': {'bfloat16': 2.0, 'float32': 2.0},
        'memory': '80 GB',
        'memory_bandwidth': '1e30',
      },
      {
        'name': 'slow',
        'type': 'slow',
        'count': 4,
        'peak_flops': {'bfloat16': 1.0, 'float32': 1.0},
        'memory': '80 GB',
        'memory_bandwidth': '1e30',
      },
    ],
    'nodes': [{'name': 'n0', 'devices': {'fast': 4, 'slow': 4}}],
    'links': {
      'intra_node': {'bandwidth': '1e30', 'latency': '0 s'},
      'inter_node': {'bandwidth': '1e30', 'latency': '0 s'},
    },
  }
  cluster = cluster_lib.parse(raw, 'mixed.yaml')
  assert cluster.heterogeneous
  # Stage 0 on slow devices 4..7 (replica-major: replica i = stage[i*t:(i+1)*t]).
  stages = ((4, 6, 5, 7), (0, 2, 1, 3))
  plan = Plan(
    layout=Layout(data=2, tensor=2, pipe=2, microbatches=4),
    remat='none',
    layers=(4, 4),
    stages=stages,
    global_batch=32,
  )
  est = simulate_plan(plan, profile.synthetic(tensors=(2,)), cluster)
  base = tmp_path / 'base.py'
  base.write_text(
    'from triax import config\n\n\ndef get_config(arg=None):\n'
    '  c = config.defaults()\n  c.model.num_layers = 8\n'
    '  c.model.d_model, c.model.num_heads, c.model.d_ff = 32, 8, 64\n'
    '  c.model.seq_len = 16\n  return c\n'
  )
  out = tmp_path / 'plan.py'
  text = emit.write(str(out), est, str(base), None, {}, cluster.name, heterogeneous=True)
  assert 'mesh.device_order' in text
  spec = importlib.util.spec_from_file_location('plan_under_test', out)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = config.validate(module.get_config(), 8)
  mesh = build_mesh(cfg.mesh, jax.devices())
  devices = jax.devices()
  for s, stage in enumerate(stages):
    for i in range(2):
      for j in range(2):
        assert mesh.devices[i, 0, j, s] == devices[stage[i * 2 + j]]
  # One device type: the mesh keeps its own (topology-aware) order.
  assert 'mesh.device_order' not in emit.overrides(plan, heterogeneous=False)
