"""Ahead of time: a run's programs compiled for a TPU slice or GPU hosts
that are not here.

`triax train --compile_only --topology=v5p:2x2x2` (or h100:8) builds the
run's mesh over the slice's compile-only devices (topology.py), compiles the
train step, the evaluation and the checkpoint conversions with XLA:TPU (or
XLA:GPU), and writes what they hold per device beside the chip's HBM: the
same figures a run on the slice would show, before anyone has the chips.
Nothing is trained and no data is read (the data may live only where the
slice is).
"""

from __future__ import annotations

import os
import re
import tempfile

import jax

from triax import config as config_lib
from triax import topology as topology_lib
from triax.compiled import buffers
from triax.compiled import stats as stats_lib
from triax.errors import ConfigError
from triax.mesh import build_mesh
from triax.training import atomic, loop
from triax.training import lock as lock_lib
from triax.training import workdir as workdir_lib
from triax.training.step import build_trainer


def compile_for_topology(cfg, workdir: str, topology: topology_lib.Topology) -> dict:
  """Compiles `cfg`'s programs for `topology`; writes WORKDIR/compile_stats.json.

  Returns the stats, with the fit against the chip's HBM (`fits`, `fit_line`)
  the train step's largest buffers (`largest_buffers`) and the heap its
  temporaries take (`temp_heap_bytes`: on XLA:TPU, temp_bytes less the
  fragmentation it counts twice; buffers.temp_heap).

  Raises:
    ConfigError: bad config or topology (a mesh whose device count is not the
      slice's, dcn factors that are not its slice count: mesh.build_mesh), or
      a busy workdir; nothing is written then.
  """
  # The config first: its errors come before libtpu or the CUDA plugin loads
  # (and logs what it found of a driver), in one line.
  cfg = config_lib.validate(cfg, topology.chips)
  config_lib.check_platform(cfg, topology.platform)
  if cfg.model.attention == 'cudnn':
    # jax asks the cuDNN library for its version as it traces the kernel, and
    # cuDNN builds the kernel's graph on a GPU: neither is here.
    raise ConfigError(
      'model.attention',
      'cudnn attention is built by the cuDNN library on a GPU, which a topology compile has '
      'not; compile with attention=xla (it holds the scores, so its bytes are an upper bound)',
    )
  devices = topology.devices()
  loop.check_workdir(workdir)
  lock_lib.check_free(workdir)
  # build_mesh checks the dcn factors against the slice count.
  trainer = build_trainer(cfg, build_mesh(cfg.mesh, devices))
  with tempfile.TemporaryDirectory(prefix='triax-xla-dump-') as scratch:
    # TRIAX_XLA_DUMP=DIR keeps XLA's whole dump of the train step (HLO, buffer
    # assignment, memory report) for a closer look.
    dump = os.environ.get('TRIAX_XLA_DUMP') or scratch
    try:
      _, _, stats = stats_lib.all_compile_stats(trainer, buffers.compile_options(dump))
      fits, line = topology_lib.fit_line(topology, stats['peak_bytes'])
      line += _host_note(stats)
    except jax.errors.JaxRuntimeError as e:
      stats = _refused(e)  # XLA:TPU compiles nothing that exceeds the chip's HBM
      fits, line = False, stats['compile_error']
    stats['largest_buffers'] = buffers.largest(dump)
    stats['temp_heap_bytes'] = buffers.temp_heap(dump)
  stats.update(
    topology=topology.name,
    topology_slices=topology.slices,
    chips=topology.chips,
    device_kind=devices[0].device_kind,
    hbm_bytes_per_device=topology.hbm_bytes,
    fits=fits,
    fit_line=line,
  )
  workdir_lock = lock_lib.WorkdirLock(workdir)
  workdir_lock.acquire()
  try:
    atomic.write_json(workdir_lib.path(workdir, workdir_lib.COMPILE_STATS), stats)
  finally:
    workdir_lock.release()
  return stats


def _host_note(stats: dict) -> str:
  """What the fit line adds for what a device keeps in its host's memory (an
  offloaded optimizer state or stash), which HBM does not hold."""
  host = stats['offloaded_bytes'] + stats['host_temp_bytes']
  return f'; {host / 2**30:.2f} GiB per device in host memory' if host else ''


# XLA:TPU's refusal: "... the total memory required for HLO temporaries
# (24.12G) exceeds available HBM (15.75G)."
_EXHAUSTED = re.compile(
  r'required for (.*?) \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)'
)
_UNIT = {'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}


def _refused(error: Exception) -> dict:
  """The stats of a program XLA:TPU would not compile for want of HBM.

  Raises:
    the error itself, when it is not that.
  """
  text = str(error)
  found = _EXHAUSTED.search(text)
  if 'RESOURCE_EXHAUSTED' not in text or not found:
    raise error
  what, need, need_unit, have, have_unit = found.groups()
  needed, available = float(need) * _UNIT[need_unit], float(have) * _UNIT[have_unit]
  return {
    'required_bytes': int(needed),
    'available_bytes': int(available),
    'compile_error': (
      f'does not fit: XLA:TPU refuses the train step, whose {what} alone need '
      f'{needed / 2**30:.2f} GiB per device, {(needed - available) / 2**30:.2f} GiB over the '
      f'{available / 2**30:.2f} GiB it may use'
    ),
  }


def verify_plan(cfg, estimate, topology: topology_lib.Topology) -> dict:
  """`triax plan --verify`: a plan's config compiled for `topology` by its XLA,
  its train step's per-device peak against the planner's prediction.

  `estimate`: the planner's candidate.Estimate of the plan (`step_memory`:
  the train step's peak per stage). Returns the report's `verify` record,
  `line` the one line that says it; `fits`: the run's peak (the step, or a
  save, restore or evaluation beside the state) within the chip's HBM.

  The planner checked that the plan's devices are the slice's chips
  (report.run, `verify_chips`).
  """
  predicted = max(estimate.step_memory)
  with tempfile.TemporaryDirectory(prefix='triax-verify-') as workdir:
    stats = compile_for_topology(cfg, workdir, topology)
  out = {
    'topology': topology.name,
    'planned_step_peak_bytes': predicted,
    'fits': stats['fits'],
    'fit_line': stats['fit_line'],
  }
  if 'temp_bytes' not in stats:  # refused for want of HBM: no figures to compare
    out['line'] = f'verify: {topology.name}: {stats["fit_line"]}'
    return out
  compiled = stats_lib.step_peak_bytes(stats)
  out.update(xla_step_peak_bytes=compiled, planned_over_xla=predicted / compiled)
  out['line'] = (
    f'verify: {topology.compiler} compiled the best plan for {topology.name}: train step peak '
    f'{compiled / 2**30:.2f} GiB per device, the planner predicted {predicted / 2**30:.2f} GiB '
    f'({predicted / compiled:.2f}x); {stats["fit_line"]}'
  )
  return out
