"""Random heterogeneous clusters the learned planner trains on (never the shipped specs)."""

from __future__ import annotations

import numpy as np

from triax.plan import cluster as cluster_lib
from triax.plan.cluster import Cluster

# Device types random training clusters draw from (data-sheet-like figures,
# each perturbed per cluster): bf16 TFLOP/s, GB, GB/s, matmul efficiency,
# intra-node GB/s, devices per node.
CATALOGUE = (
  ('h100', 989, 80, 3350, 0.7, 450, 8),
  ('a100_80', 312, 80, 2039, 0.65, 300, 8),
  ('a100_40', 312, 40, 1555, 0.65, 240, 8),
  ('v100_32', 15.7, 32, 900, 0.65, 120, 8),
  ('l40s', 362, 48, 864, 0.6, 25, 4),
  ('a10', 125, 24, 600, 0.6, 25, 4),
  ('l4', 121, 24, 300, 0.6, 25, 4),
  ('rtx4090', 165, 24, 1008, 0.6, 25, 4),
  ('mi250', 362, 64, 3200, 0.5, 200, 8),
)


def random_cluster(rng: np.random.Generator, devices: int | None = None) -> Cluster:
  """A random heterogeneous cluster: 1-3 device types in whole nodes,
  figures perturbed, links between nodes of 100-3200 Gb/s a node."""
  total = devices or int(rng.choice([8, 16, 32, 64, 128]))
  kinds = int(rng.choice([1, 2, 2, 3, 3]))
  unit = 8 if total >= 8 * kinds else 4
  units = total // unit
  kinds = min(kinds, units)
  cuts = sorted(rng.choice(np.arange(1, units), size=kinds - 1, replace=False)) if kinds > 1 else []
  sizes = np.diff([0, *cuts, units]) * unit
  chosen = rng.choice(len(CATALOGUE), size=kinds, replace=False)
  groups, nodes = [], []
  for idx, count in zip(chosen, sizes):
    name, tf, mem, bw, eff, intra, per = CATALOGUE[idx]
    count = int(count)
    per = per if count % per == 0 else 4
    scale = float(rng.uniform(0.7, 1.3))
    groups.append(
      {
        'name': name,
        'type': name,
        'count': count,
        'peak_flops': {'bfloat16': tf * 1e12 * scale, 'float32': tf * 0.5e12 * scale},
        'memory': mem * 1e9,
        'memory_bandwidth': bw * 1e9 * float(rng.uniform(0.8, 1.2)),
        'matmul_efficiency': eff,
        'overhead_per_layer': 40e-6,
      }
    )
    nodes.append(
      {
        'name': f'{name}-node',
        'devices': {name: per},
        'count': count // per,
        'nic_bandwidth': float(rng.choice([100, 200, 400, 1600, 3200])) * 1e9 / 8,
        'intra_bandwidth': intra * 1e9 * float(rng.uniform(0.7, 1.3)),
      }
    )
  raw = {
    'name': f'random_{total}_{"_".join(g["name"] for g in groups)}',
    'groups': groups,
    'nodes': nodes,
    'links': {
      'intra_node': {'bandwidth': 25e9, 'latency': 5e-6},
      'inter_node': {'bandwidth': float(rng.choice([100, 200, 400])) * 1e9 / 8, 'latency': 5e-6},
    },
  }
  return cluster_lib.parse(raw, raw['name'])
