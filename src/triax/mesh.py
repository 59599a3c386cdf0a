"""The device mesh: named axes (data, context, tensor, pipe) over the available
devices, and `expert` carved from data when mesh.expert > 1.

Axes are `Auto` (GSPMD-style): the model states logical shardings and XLA
partitions the rest. Only the pipeline executor turns `pipe` manual, inside
its own shard_map.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from triax.config import EXPERT_AXIS, MESH_AXES
from triax.errors import ConfigError


def build_mesh(mesh_cfg, devices=None) -> Mesh:
  """Mesh of shape (data, tensor, pipe) from a validated `mesh` config group.

  With dcn factors > 1 the axes are split into a within-slice (ICI/NVLink)
  part and a between-slice (data-centre network) part, so that the axis that
  crosses slow links is the one asked for. `mesh.device_order` (a plan's
  stage placement) overrides both.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = tuple(mesh_cfg[a] for a in MESH_AXES)
  dcn = tuple(mesh_cfg[f'dcn_{a}'] for a in MESH_AXES)
  order = mesh_cfg.get('device_order') or ()
  if order:
    # A planner's placement (e.g. fast devices on the heavy pipeline stages):
    # position k of the mesh, row-major over (data, tensor, pipe), is devices[order[k]].
    grid = np.empty(len(order), dtype=object)
    grid[:] = [devices[i] for i in order]
    grid = grid.reshape(shape)
  elif any(d > 1 for d in dcn) or len({getattr(d, 'slice_index', 0) for d in devices}) > 1:
    grid = _hybrid_grid(shape, dcn, devices)
  else:
    grid = _grid(shape, devices)
  return _carve_expert(grid, mesh_cfg.get('expert', 1))


def _carve_expert(grid: np.ndarray, expert: int) -> Mesh:
  """The mesh, its `data` dimension split into (data, expert) when mesh.expert > 1.

  Expert parallelism is carved from the data-parallel devices (Megatron's
  way): mesh.data stays the data-parallel degree, the device count is
  unchanged, and the expert axis is the inner part, neighbouring devices
  (inside one slice when dcn_data > 1), because the MoE layers' all-to-all
  runs over it every layer. A mesh without experts keeps its four axes.
  """
  axes = MESH_AXES
  if expert > 1:
    grid = grid.reshape((grid.shape[0] // expert, expert) + grid.shape[1:])
    axes = (MESH_AXES[0], EXPERT_AXIS) + MESH_AXES[1:]
  return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def _grid(shape: tuple[int, ...], devices: list) -> np.ndarray:
  try:
    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  except (ValueError, NotImplementedError):
    # Topology unknown to mesh_utils (e.g. forced CPU devices): plain order.
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return grid.reshape(shape)


def _hybrid_grid(shape: tuple[int, ...], dcn: tuple[int, ...], devices: list) -> np.ndarray:
  """Axes split into a fast (within-granule) part and a slow (between-granule) part.

  A granule is a TPU slice when there are several, else a run of consecutive
  processes (one host, when processes are numbered host by host as SLURM and
  TPU VMs do). An axis of size n with dcn factor k is k blocks of n/k
  devices, each block inside one granule: only the dcn part crosses the slow
  network.
  """
  count = math.prod(dcn)
  if len({getattr(d, 'slice_index', 0) for d in devices}) > 1:
    key = lambda d: d.slice_index
    slices = len({d.slice_index for d in devices})
    if slices != count:
      raise ConfigError(
        'mesh',
        f'dcn factors {"*".join(map(str, dcn))} = {count} must equal the number of TPU '
        f'slices ({slices}): e.g. --config.mesh.dcn_data={slices}, so that only that axis '
        'crosses the data-centre network',
      )
  else:
    processes = sorted({d.process_index for d in devices})
    if len(processes) % count:
      raise ConfigError(
        'mesh',
        f'dcn factors {"*".join(map(str, dcn))} = {count} must divide '
        f'the number of processes ({len(processes)}); set mesh.dcn_* to 1 '
        'within one host',
      )
    per = len(processes) // count
    key = lambda d: processes.index(d.process_index) // per
  groups: dict[int, list] = {}
  for device in devices:
    groups.setdefault(key(device), []).append(device)
  ici = tuple(s // d for s, d in zip(shape, dcn))
  blocks = np.empty(dcn, dtype=object)
  for index, granule in zip(np.ndindex(*dcn), (groups[k] for k in sorted(groups))):
    blocks[index] = _grid(ici, granule)
  return np.block(blocks.tolist())


# What jax.distributed.initialize() reads of a SLURM job (jax's SlurmCluster): srun sets
# them for each task; a batch script's own shell has no step, hence no SLURM_STEP_NODELIST.
SLURM_VARIABLES = (
  'SLURM_JOB_ID',
  'SLURM_STEP_NODELIST',
  'SLURM_NTASKS',
  'SLURM_PROCID',
  'SLURM_LOCALID',
)


def check_slurm_environment(environ) -> None:
  """Inside a SLURM job (SLURM_JOB_ID set), the variables jax reads are all there and whole
  numbers where they count tasks.

  Raises:
    ConfigError('TRIAX_DISTRIBUTED', ...): what is missing or unreadable, and the fix.
  """
  if 'SLURM_JOB_ID' not in environ:
    return
  job = environ['SLURM_JOB_ID']
  missing = [name for name in SLURM_VARIABLES if name not in environ]
  if missing:
    raise ConfigError(
      'TRIAX_DISTRIBUTED',
      f'auto in SLURM job {job} without {", ".join(missing)} (srun sets them for each task): '
      'start train with srun (one task per process), e.g. `srun --ntasks=2 env '
      'TRIAX_DISTRIBUTED=auto python -m triax train ...`, not from the batch script itself',
    )
  for name in ('SLURM_JOB_ID', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID'):
    if not environ[name].isdigit():
      raise ConfigError(
        'TRIAX_DISTRIBUTED',
        f'auto in a SLURM job whose {name}={environ[name]!r} is not a whole number; '
        'start train with srun as it is, without setting SLURM_* variables by hand',
      )


def maybe_initialize_distributed() -> None:
  """Joins a multi-process job when the launcher says there is one.

  `scripts/launch_local.sh` sets TRIAX_COORDINATOR, TRIAX_NUM_PROCESSES and
  TRIAX_PROCESS_ID; on SLURM or TPU slices `jax.distributed.initialize()`
  finds its peers itself when TRIAX_DISTRIBUTED=auto (gloo collectives for CPU processes).

  Raises:
    ConfigError('TRIAX_DISTRIBUTED', ...): auto inside a SLURM job whose environment jax
      cannot read (`check_slurm_environment`).
  """
  coordinator = os.environ.get('TRIAX_COORDINATOR')
  auto = os.environ.get('TRIAX_DISTRIBUTED') == 'auto'
  if coordinator or auto:
    # Only the CPU client reads this (CPU processes under srun too); it must be set before
    # any backend starts.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if coordinator:
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=int(os.environ['TRIAX_NUM_PROCESSES']),
      process_id=int(os.environ['TRIAX_PROCESS_ID']),
      # JAX's default binds the coordinator on every interface ([::]:port);
      # bind only the address given (127.0.0.1 for scripts/launch_local.sh).
      coordinator_bind_address=coordinator,
    )
  elif auto:
    check_slurm_environment(os.environ)
    jax.distributed.initialize()
  else:
    return
  logging.info(
    'process %d of %d, %d local / %d global devices',
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
