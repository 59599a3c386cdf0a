"""What a compiled run holds per device: the train step's figures
(compile_stats.json's schema), the programs beside it on the same state
(save, restore, evaluation), their peaks, and the fit against a local card.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from triax import config as config_lib
from triax import sharding
from triax import topology as topology_lib
from triax.data import batches
from triax.model.flops import step_flops
from triax.pipeline import schedule as sched
from triax.training.step import Trainer


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax returns one dict per program
    cost = cost[0] if cost else {}
  return cost or {}


def _abstract_batch(trainer: Trainer) -> dict:
  cfg = trainer.cfg
  shape = (cfg.train.global_batch_size, cfg.model.seq_len)
  return {
    k: jax.ShapeDtypeStruct(shape, np.int32, sharding=trainer.batch_sharding)
    for k in batches.keys(cfg)
  }


def compile_stats(trainer: Trainer, compiler_options: dict | None = None) -> tuple[object, dict]:
  """Lowers and compiles the train step; XLA's per-device memory and cost figures.

  `compiler_options`: XLA options for this compile (compiled/buffers.py's dump).
  """
  cfg = trainer.cfg
  b = cfg.train.global_batch_size
  started = time.perf_counter()
  state = trainer.abstract_state()
  with jax.set_mesh(trainer.mesh):
    compiled = trainer.train_step.lower(state, _abstract_batch(trainer)).compile(compiler_options)
  mem = compiled.memory_analysis()
  flops = step_flops(trainer.model, b)
  shardings = trainer.state_shardings
  params = sharding.per_device_bytes(state.params, shardings.params)
  optimizer = sharding.per_device_bytes(state.opt_state, shardings.opt_state)
  stats = {
    'temp_bytes': int(mem.temp_size_in_bytes),
    'argument_bytes': int(mem.argument_size_in_bytes),
    'output_bytes': int(mem.output_size_in_bytes),
    'alias_bytes': int(mem.alias_size_in_bytes),
    # Per device, from the state's shardings: what ZeRO-1 (train.optimizer_sharding=data)
    # divides by the data degree is the optimizer's; gradients are laid out as parameters.
    'param_bytes': params,
    'optimizer_bytes': optimizer,
    # Of the state's bytes, those kept in host memory (train.offload_optimizer).
    'offloaded_bytes': optimizer if cfg.train.offload_optimizer else 0,
    'gradient_bytes': params,
    # Temporaries XLA places in host memory: an offloaded stash (pipeline.offload_stash).
    'host_temp_bytes': int(mem.host_temp_size_in_bytes),
    'generated_code_bytes': int(mem.generated_code_size_in_bytes),
    # XLA counts a loop body once, not once per iteration (see WORKSPACE.md).
    'flops': float(_cost(compiled).get('flops', 0.0)),
    # Per step, from the family's shapes (model/flops.py): model FLOPs are the
    # useful work MFU counts; hardware FLOPs add what remat recomputes.
    'model_flops_per_step': flops['model'],
    'hardware_flops_per_step': flops['hardware'],
    'compile_seconds': time.perf_counter() - started,
    'mesh': {a: cfg.mesh[a] for a in config_lib.MESH_AXES},
    'devices': trainer.mesh.devices.size,
    'device_kind': trainer.mesh.devices.flat[0].device_kind,
    'schedule': None,
  }
  if trainer.program is not None:
    prog = trainer.program
    stats['schedule'] = {
      'name': prog.schedule.name,
      'stages': prog.schedule.stages,
      'microbatches': prog.schedule.microbatches,
      'virtual_stages': prog.schedule.virtual_stages,
      'ticks': prog.ticks,
      # Rounds of a packed program (pipeline/rounds.py); 0: one action a tick.
      'rounds': len(prog.rounds),
      'stash_slots': prog.num_stash_slots,
      'peak_stash': list(prog.peak_stash),
      'message_slots': prog.slots['msg'],
      'cut_slots': prog.slots['cut'],
      'residual_bytes_per_slot': trainer.pipeline.residual_bytes,
      'cut_bytes_per_slot': trainer.pipeline.cut_bytes,
      'edge_grads': trainer.pipeline.edge_grads,
      'offload_stash': cfg.pipeline.offload_stash,
    }
    moved = sched.transfers_per_step(prog)['total']
    # Residual sets BPipe moves between partners per step (global bytes,
    # summed over the data/tensor shards of each set).
    stats['schedule']['residual_bytes_moved_per_step'] = moved * trainer.pipeline.residual_bytes
  return compiled, stats


def state_program_stats(trainer: Trainer) -> tuple[object, dict]:
  """Compiles what runs beside the train step on the same state: the
  conversions every save and restore runs (to and from the checkpoint's
  layout) and the evaluation. Returns the compiled evaluation (the loop
  evaluates with it, so it is compiled once) and their per-device bytes."""
  state = trainer.abstract_state()
  shardings = trainer.state_shardings
  # The train state's bytes in device memory (an offloaded optimizer state's are not).
  resident = sharding.per_device_bytes(state.params, shardings.params)
  if not trainer.cfg.train.offload_optimizer:
    resident += sharding.per_device_bytes(state.opt_state, shardings.opt_state)
  with jax.set_mesh(trainer.mesh):
    save = trainer.to_canonical.peak_bytes(state)
    restore = trainer.from_canonical.peak_bytes(trainer.abstract_canonical_state())
    evaluate = trainer.eval_loss.lower(state.params, _abstract_batch(trainer)).compile()
  mem = evaluate.memory_analysis()
  return evaluate, {
    # What a save's (restore's) conversion holds per device at its peak beyond
    # the train state: the leaf it converts, its temporaries (relayout.py).
    'checkpoint_save_bytes': int(save - resident),
    'checkpoint_restore_bytes': int(restore - resident),
    # The evaluation program's arguments and temporaries per device (to set beside the
    # train step's temp_bytes + argument_bytes).
    'eval_bytes': int(mem.argument_size_in_bytes + mem.temp_size_in_bytes),
  }


def step_peak_bytes(stats: dict) -> int:
  """Per-device bytes live at the train step's peak: temporaries plus un-aliased
  arguments and outputs."""
  s = stats
  return s['temp_bytes'] + s['argument_bytes'] + s['output_bytes'] - s['alias_bytes']


def program_peaks(stats: dict) -> dict[str, int]:
  """Per-device peak of each program a run holds on the devices: the train
  step's, and a save's, a restore's and an evaluation's beside the resident
  state."""
  s = stats
  # The device's: an offloaded optimizer state is in host memory (memory_analysis
  # counts the train step's host arguments apart too).
  optimizer = s['optimizer_bytes'] - s['offloaded_bytes']
  state = s['param_bytes'] + optimizer
  return {
    'step': step_peak_bytes(s),
    'save': state + s['checkpoint_save_bytes'],
    'restore': state + s['checkpoint_restore_bytes'],
    'eval': optimizer + s['eval_bytes'],  # eval_bytes holds the params it reads
  }


def run_peak_bytes(stats: dict) -> int:
  """Per-device peak of the run: the train step's, or a save, restore or
  evaluation beside the resident state, whichever is larger (a layout that
  trains must also checkpoint and evaluate)."""
  return max(program_peaks(stats).values())


def all_compile_stats(
  trainer: Trainer, compiler_options: dict | None = None
) -> tuple[object, object, dict]:
  """The train step's and the state programs' figures in one record (compile_stats.json)."""
  compiled, stats = compile_stats(trainer, compiler_options)
  compiled_eval, state_stats = state_program_stats(trainer)
  stats = {**stats, **state_stats}
  stats['peak_bytes'] = run_peak_bytes(stats)
  return compiled, compiled_eval, stats


def local_fit(stats: dict, devices: list) -> dict:
  """The compiled run's per-device peak against the memory the local accelerator's
  allocator may take (on a GPU, XLA_PYTHON_CLIENT_MEM_FRACTION of the card):
  `fits`, `fit_line`, the device kind and that limit. {} where the device reports
  no limit (CPU): there is nothing to fit then."""
  limit = (devices[0].memory_stats() or {}).get('bytes_limit')
  if not limit:
    return {}
  where = f'{len(devices)} x {devices[0].device_kind}'
  fits, line = topology_lib.fit(stats['peak_bytes'], limit, 'that XLA may allocate', where)
  return dict(
    device_kind=devices[0].device_kind, memory_bytes_per_device=limit, fits=fits, fit_line=line
  )
