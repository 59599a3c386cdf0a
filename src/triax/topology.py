"""Accelerator slices compiled for without being there: a TPU topology name
-> the compile-only devices XLA:TPU targets, and the memory of each kind.

With libtpu installed (`pip install 'triax[tpu]'`, pinned to the installed
jax), jax.experimental.topologies describes a TPU slice on any host, a
CPU-only one included. A program jitted over a mesh of those devices is
compiled by the chip's own compiler, so its memory_analysis() is the chip's.
The devices hold no arrays: only traced code may touch them. MaxText's
train_compile does the same, so that a job is sized before there are chips.

A name is `KIND:AxB` (v5e, v6e: 2-D tori) or `KIND:AxBxC` (v4, v5p: 3-D),
in chips, as Cloud TPU's topologies are written: v5p:2x2x1 is 4 chips.
"""

from __future__ import annotations

import dataclasses
import math
import re

from triax.errors import ConfigError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class TpuKind:
  """One TPU generation: how libtpu names it and what one device holds."""

  # As libtpu's topology names spell the generation (v5p is 'v5' there).
  libtpu_name: str
  # jax's Device.device_kind of such a device.
  device_kind: str
  # HBM of one device, from the data sheet (Cloud TPU's system architecture
  # pages; their "GB" are GiB: a v5e's XLA limit is 15.75 GiB). XLA keeps a
  # little of it for itself, so a fit within a few hundred MiB is not one.
  hbm_bytes: int
  # Torus dimensions its topology names have.
  dims: int
  # 'megacore': the chip's two TensorCores are one device (one per chip),
  # as every framework runs v4 and v5p; 'default': one core per chip.
  chip_config: str


TPU_KINDS = {
  'v4': TpuKind('v4', 'TPU v4', 32 * GiB, 3, 'megacore'),
  'v5e': TpuKind('v5e', 'TPU v5 lite', 16 * GiB, 2, 'default'),
  'v5p': TpuKind('v5', 'TPU v5', 95 * GiB, 3, 'megacore'),
  'v6e': TpuKind('v6e', 'TPU v6 lite', 32 * GiB, 2, 'default'),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A named slice (or `slices` of them over the data-centre network)."""

  name: str
  kind: TpuKind
  shape: tuple[int, ...]
  slices: int = 1

  @property
  def chips(self) -> int:
    return math.prod(self.shape) * self.slices

  @property
  def hbm_bytes(self) -> int:
    return self.kind.hbm_bytes

  def devices(self) -> list:
    """The slice's compile-only devices (one per chip), slice by slice.

    Raises:
      ConfigError('--topology', ...): libtpu is not installed.
    """
    try:
      import libtpu  # noqa: F401  (only to tell a missing compiler from a bad name)
    except ImportError:
      raise ConfigError(
        '--topology',
        "compiling for a TPU needs libtpu: pip install 'triax[tpu]' (it is pinned to the "
        'installed jax)',
      ) from None
    from jax.experimental import topologies

    _quiet_libtpu(self)
    dims = self.shape + (1,) * (3 - len(self.shape))
    description = topologies.get_topology_desc(
      platform='tpu',
      topology_name=f'{self.kind.libtpu_name}:{"x".join(map(str, self.shape))}',
      chip_config_name=self.kind.chip_config,
      # Four chips a host (2x2x1), as every multi-host Cloud TPU slice has them.
      chips_per_host_bounds=tuple(min(2, d) for d in dims[:2]) + (1,),
      num_slices=self.slices,
      wrap=_wrap(self.kind, self.shape),
    )
    return list(description.devices)


def _quiet_libtpu(topology: Topology) -> None:
  """Tells libtpu what a TPU VM's metadata server would, before it loads, and
  that it owns no chips.

  Off a TPU VM, loading libtpu prints a screen of warnings and errors about
  the accelerator type and worker hostnames it could not find (harmless: the
  topology is given). A real VM's own values win (setdefault); these only
  describe the slice compiled for, as one host.
  """
  import os

  cores = 2 if topology.kind.chip_config == 'megacore' else 1
  name = next(k for k, v in TPU_KINDS.items() if v is topology.kind)
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', f'{name}-{topology.chips * cores}')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  os.environ.setdefault('TPU_WORKER_ID', '0')
  # libtpu locks /tmp/libtpu_lockfile so that one process owns the chips;
  # there are none here, and compiles may run side by side (tests, sweeps).
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')


def _wrap(kind: TpuKind, shape: tuple[int, ...]) -> tuple[bool, bool, bool]:
  """Which axes close into a ring: a 3-D slice whose sides are multiples of
  4 is a full torus (a whole cube or several); a 2-D kind only as a whole
  16x16 pod (its third axis has none)."""
  if kind.dims == 3:
    full = all(d % 4 == 0 for d in shape)
    return (full, full, full)
  pod = shape == (16, 16)
  return (pod, pod, False)


def parse(name: str, slices: int = 1) -> Topology:
  """`KIND:AxB[xC]` (e.g. v5p:2x2x1, v5e:4x4) -> Topology.

  Raises:
    ConfigError('--topology' or '--topology_slices', ...): an unknown kind,
      a shape of the wrong rank, or a slice count below 1.
  """
  known = ', '.join(f'{k}:{"x".join(["A"] * v.dims)}' for k, v in TPU_KINDS.items())
  match = re.fullmatch(r'([a-z0-9]+):(\d+(?:x\d+)*)', name or '')
  if not match or match.group(1) not in TPU_KINDS:
    raise ConfigError(
      '--topology', f'unknown topology {name!r}; known: {known} (chips per side, e.g. v5p:2x2x1)'
    )
  kind = TPU_KINDS[match.group(1)]
  shape = tuple(int(d) for d in match.group(2).split('x'))
  if len(shape) != kind.dims or min(shape) < 1:
    raise ConfigError(
      '--topology',
      f'{name}: a {match.group(1)} slice has {kind.dims} sides of at least 1 chip '
      f'({match.group(1)}:{"x".join(["2"] * kind.dims)}); known: {known}',
    )
  if not isinstance(slices, int) or slices < 1:
    raise ConfigError('--topology_slices', f'must be a positive integer, got {slices!r}')
  return Topology(name, kind, shape, slices)


def fit_line(topology: Topology, peak_bytes: int) -> tuple[bool, str]:
  """(fits, one line saying so): the per-device peak against the kind's HBM."""
  where = f'{topology.chips} x {topology.kind.device_kind}'
  if topology.slices > 1:
    where += f' ({topology.slices} slices)'
  return fit(peak_bytes, topology.hbm_bytes, 'HBM', where)


def fit(peak_bytes: int, capacity: int, memory: str, where: str) -> tuple[bool, str]:
  """(fits, one line saying so): a per-device peak against `capacity` bytes of `memory`."""
  if peak_bytes <= capacity:
    return True, (
      f'fits: {peak_bytes / GiB:.2f} GiB per device of {capacity / GiB:.0f} GiB {memory} '
      f'({capacity / GiB - peak_bytes / GiB:.2f} GiB spare) on {where}'
    )
  return False, (
    f'does not fit: {peak_bytes / GiB:.2f} GiB per device, {(peak_bytes - capacity) / GiB:.2f} GiB '
    f'over the {capacity / GiB:.0f} GiB {memory} of {where}'
  )
