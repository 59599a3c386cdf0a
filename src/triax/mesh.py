"""The device mesh: named axes (data, tensor, pipe) over the available devices.

Axes are `Auto` (GSPMD-style): the model states logical shardings and XLA
partitions the rest. Only the pipeline executor turns `pipe` manual, inside
its own shard_map.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from triax.config import MESH_AXES


def build_mesh(mesh_cfg, devices=None) -> Mesh:
  """Mesh of shape (data, tensor, pipe) from a validated `mesh` config group.

  With dcn factors > 1 the axes are split into a within-slice (ICI/NVLink)
  part and a between-slice (data-centre network) part, so that the axis that
  crosses slow links is the one asked for.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(mesh_cfg[a] for a in MESH_AXES)
  dcn = tuple(mesh_cfg[f'dcn_{a}'] for a in MESH_AXES)
  if any(d > 1 for d in dcn):
    ici = tuple(s // d for s, d in zip(shape, dcn))
    grid = mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, allow_split_physical_axes=True)
  else:
    try:
      grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError):
      # Topology unknown to mesh_utils (e.g. forced CPU devices): plain order.
      grid = np.asarray(devices).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def maybe_initialize_distributed() -> None:
  """Joins a multi-process job when the launcher says there is one.

  `scripts/launch_local.sh` sets TRIAX_COORDINATOR, TRIAX_NUM_PROCESSES and
  TRIAX_PROCESS_ID; on SLURM or TPU slices `jax.distributed.initialize()`
  finds its peers itself when TRIAX_DISTRIBUTED=auto.
  """
  coordinator = os.environ.get('TRIAX_COORDINATOR')
  if coordinator:
    # Only the CPU client reads this; it must be set before any backend starts.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(os.environ['TRIAX_NUM_PROCESSES']),
        process_id=int(os.environ['TRIAX_PROCESS_ID']))
  elif os.environ.get('TRIAX_DISTRIBUTED') == 'auto':
    jax.distributed.initialize()
  else:
    return
  logging.info('process %d of %d, %d local / %d global devices', jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
