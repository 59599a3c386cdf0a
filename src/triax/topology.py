"""Accelerator slices compiled for without being there: a TPU topology name
or a GPU node count -> the compile-only devices XLA targets, and the memory
of each kind.

With libtpu installed (`pip install 'triax[tpu]'`, pinned to the installed
jax), jax.experimental.topologies describes a TPU slice on any host, a
CPU-only one included. A program jitted over a mesh of those devices is
compiled by the chip's own compiler, so its memory_analysis() is the chip's.
The devices hold no arrays: only traced code may touch them. MaxText's
train_compile does the same, so that a job is sized before there are chips.

A TPU name is `KIND:AxB` (v5e, v6e: 2-D tori) or `KIND:AxBxC` (v4, v5p:
3-D), in chips, as Cloud TPU's topologies are written: v5p:2x2x1 is 4 chips.

XLA's GPU compiler does the same from a description of the GPU (XLA's
GpuTargetConfigProto: the figures a CUDA device query reports), with jax's
CUDA PJRT plugin loaded and no GPU or driver present. A GPU name is
`KIND:N` (N GPUs in one host) or `KIND:HxN` (H hosts of N): h100:8, h100:4x8.
"""

from __future__ import annotations

import dataclasses
import math
import os
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
class GpuKind:
  """One GPU model, as XLA's GPU compiler is told it where there is none.

  The figures are the ones cudaGetDeviceProperties reports for the model
  (and its data sheet): they decide XLA's fusion, tiling and kernel choices,
  hence the buffers a program holds.
  """

  # jax's Device.device_kind of such a device (the driver's name).
  device_kind: str
  # Memory of one device as nvidia-smi reports it (the data sheet's 80 GB).
  hbm_bytes: int
  compute_capability: tuple[int, int]
  # Streaming multiprocessors, FP32 lanes of each, its shared memory and the
  # most of that one block may opt into.
  sms: int
  fpus_per_sm: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  l2_cache_bytes: int
  memory_bandwidth: int  # bytes/s
  clock_ghz: float

  def target_config(self) -> str:
    """XLA's GpuTargetConfigProto of this model, in text format."""
    major, minor = self.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: {self.fpus_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.hbm_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 }}
device_description_str: "{self.device_kind}"
"""


MiB = 2**20
# H100 SXM5 80GB HBM3 (nvidia-smi: 81559 MiB).
_H100 = GpuKind(
  device_kind='NVIDIA H100 80GB HBM3',
  hbm_bytes=81559 * MiB,
  compute_capability=(9, 0),
  sms=132,
  fpus_per_sm=128,
  shared_memory_per_sm=228 * 1024,
  shared_memory_per_block_optin=227 * 1024,
  l2_cache_bytes=50 * MiB,
  memory_bandwidth=3_352_320_000_000,
  clock_ghz=1.98,
)
GPU_KINDS = {
  'h100': _H100,
  # H200 SXM 141GB HBM3e (nvidia-smi: 143771 MiB): H100's chip, more and faster memory.
  'h200': dataclasses.replace(
    _H100,
    device_kind='NVIDIA H200',
    hbm_bytes=143771 * MiB,
    memory_bandwidth=4_800_000_000_000,
  ),
  # A100 SXM4 80GB (nvidia-smi: 81920 MiB).
  'a100': GpuKind(
    device_kind='NVIDIA A100-SXM4-80GB',
    hbm_bytes=81920 * MiB,
    compute_capability=(8, 0),
    sms=108,
    fpus_per_sm=64,
    shared_memory_per_sm=164 * 1024,
    shared_memory_per_block_optin=163 * 1024,
    l2_cache_bytes=40 * MiB,
    memory_bandwidth=2_039_000_000_000,
    clock_ghz=1.41,
  ),
}
# Where jax's CUDA plugin is not installed: the path of its xla_cuda_plugin.so
# (the jax-cuda12-pjrt wheel's, of the installed jax's version), loaded for a
# GPU topology only. Installed, the plugin loads at every JAX start-up and
# logs that it found no driver; this way only a GPU compile loads it.
CUDA_PLUGIN_VAR = 'TRIAX_XLA_CUDA_PLUGIN'


@dataclasses.dataclass(frozen=True)
class Topology:
  """A named slice (or `slices` of them over the data-centre network), or
  GPU hosts (shape: hosts, GPUs per host)."""

  name: str
  kind: TpuKind | GpuKind
  shape: tuple[int, ...]
  slices: int = 1

  @property
  def platform(self) -> str:
    """jax's platform name of the devices: 'gpu' or 'tpu'."""
    return 'gpu' if isinstance(self.kind, GpuKind) else 'tpu'

  @property
  def compiler(self) -> str:
    return f'XLA:{self.platform.upper()}'

  @property
  def chips(self) -> int:
    return math.prod(self.shape) * self.slices

  @property
  def hbm_bytes(self) -> int:
    return self.kind.hbm_bytes

  def devices(self) -> list:
    """The slice's compile-only devices (one per chip), slice by slice, or
    the GPUs host by host.

    Raises:
      ConfigError('--topology', ...): libtpu is not installed (a TPU), jax's
        CUDA plugin is not there (a GPU).
    """
    if isinstance(self.kind, GpuKind):
      return _gpu_devices(self)
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


def _gpu_devices(topology: Topology) -> list:
  """The GPUs of `topology`, from jax's CUDA plugin (see CUDA_PLUGIN_VAR)."""
  from jax.experimental import topologies

  _load_cuda_plugin()
  hosts, per_host = topology.shape
  try:
    description = topologies.get_topology_desc(
      topology.name,
      platform='cuda',
      # The plugin's shape: slices x hosts x devices per host.
      topology=f'1x{hosts}x{per_host}',
      target_config=topology.kind.target_config(),
    )
  except NotImplementedError:
    raise ConfigError(
      '--topology',
      "compiling for a GPU needs jax's CUDA plugin: pip install 'triax[gpu]' (pinned to the "
      f'installed jax), or set {CUDA_PLUGIN_VAR} to its xla_cuda_plugin.so',
    ) from None
  return list(description.devices)


def _load_cuda_plugin() -> None:
  """Registers the plugin CUDA_PLUGIN_VAR names, unless one is loaded."""
  path = os.environ.get(CUDA_PLUGIN_VAR)
  if not path:
    return
  if not os.path.isfile(path):
    raise ConfigError(
      CUDA_PLUGIN_VAR, f'{path} is not a file; give the xla_cuda_plugin.so of jax-cuda12-pjrt'
    )
  from jax._src import xla_bridge
  from jax._src.lib import xla_client

  if not xla_client.pjrt_plugin_loaded('cuda'):
    # What jax's own CUDA plugin package does at start-up (jax_plugins.xla_cuda12).
    xla_bridge.register_plugin('cuda', priority=500, library_path=path)


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
  known = ', '.join(
    [f'{k}:{"x".join(["A"] * v.dims)}' for k, v in TPU_KINDS.items()]
    + [f'{k}:N or {k}:HxN' for k in GPU_KINDS]
  )
  match = re.fullmatch(r'([a-z0-9]+):(\d+(?:x\d+)*)', name or '')
  if not match or match.group(1) not in TPU_KINDS | GPU_KINDS:
    raise ConfigError(
      '--topology',
      f'unknown topology {name!r}; known: {known} (TPU chips per side, e.g. v5p:2x2x1; '
      'GPUs per host, e.g. h100:8, or hosts x GPUs, h100:2x8)',
    )
  shape = tuple(int(d) for d in match.group(2).split('x'))
  if match.group(1) in GPU_KINDS:
    return _gpu_topology(name, match.group(1), shape, slices)
  kind = TPU_KINDS[match.group(1)]
  if len(shape) != kind.dims or min(shape) < 1:
    raise ConfigError(
      '--topology',
      f'{name}: a {match.group(1)} slice has {kind.dims} sides of at least 1 chip '
      f'({match.group(1)}:{"x".join(["2"] * kind.dims)}); known: {known}',
    )
  if not isinstance(slices, int) or slices < 1:
    raise ConfigError('--topology_slices', f'must be a positive integer, got {slices!r}')
  return Topology(name, kind, shape, slices)


def _gpu_topology(name: str, kind: str, shape: tuple[int, ...], slices: int) -> Topology:
  if len(shape) == 1:
    shape = (1,) + shape
  if len(shape) != 2 or min(shape) < 1:
    raise ConfigError(
      '--topology',
      f'{name}: a GPU topology is {kind}:N or {kind}:HxN (N GPUs in each of H hosts, e.g. '
      f'{kind}:8 or {kind}:2x8)',
    )
  if slices != 1:
    raise ConfigError(
      '--topology_slices', f'a GPU topology names its hosts ({kind}:{slices}x8), not slices'
    )
  return Topology(name, GPU_KINDS[kind], shape)


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
