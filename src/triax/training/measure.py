"""Compile and time one configuration in-process: what benchmarks and tools measure.

Memory comes from XLA's compiled memory analysis (deterministic); time is
the median wall time of a few warm steps on random tokens (noisy on shared
CPUs: compare ratios measured in one run, never absolute numbers).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import numpy as np

from triax import config as config_lib
from triax.mesh import build_mesh
from triax.training.loop import all_compile_stats
from triax.training.step import Trainer, build_trainer


@dataclasses.dataclass
class Measurement:
  stats: dict  # all_compile_stats(): temp/argument/output and state-program bytes, flops, schedule
  step_time_s: float  # median of the timed steps
  trainer: Trainer

  @property
  def step_peak_bytes(self) -> int:
    """Per-device bytes live at the train step's peak: temporaries plus un-aliased
    arguments and outputs."""
    s = self.stats
    return s['temp_bytes'] + s['argument_bytes'] + s['output_bytes'] - s['alias_bytes']

  @property
  def peak_bytes(self) -> int:
    """Per-device peak of the run: the train step's, or a save, restore or
    evaluation beside the resident state, whichever is larger (a layout that
    trains must also checkpoint and evaluate)."""
    s = self.stats
    state = s['param_bytes'] + s['optimizer_bytes']
    return max(
      self.step_peak_bytes,
      state + s['checkpoint_save_bytes'],
      state + s['checkpoint_restore_bytes'],
      s['optimizer_bytes'] + s['eval_bytes'],  # eval_bytes holds the params it reads
    )


def measure(cfg, *, steps: int = 5, warmup: int = 2, devices=None) -> Measurement:
  """Validates `cfg` for `devices` (default: all), compiles its train step and times it."""
  devices = list(jax.devices() if devices is None else devices)
  cfg = config_lib.validate(cfg, len(devices))
  trainer = build_trainer(cfg, build_mesh(cfg.mesh, devices))
  rng = np.random.default_rng(0)
  shape = (cfg.train.global_batch_size, cfg.model.seq_len + 1)
  # Ids the data could hold: none past model.vocab_used (padding, whose targets would cost inf).
  tokens = rng.integers(0, cfg.model.vocab_used or cfg.model.vocab_size, shape).astype(np.int32)
  with jax.set_mesh(trainer.mesh):
    # The state programs too: a layout's peak may be a save or an eval (Measurement.peak_bytes).
    compiled, _, stats = all_compile_stats(trainer)
    batch = jax.device_put(
      {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}, trainer.batch_sharding
    )
    state = trainer.init_state(jax.random.key(0))
    times = []
    for i in range(warmup + steps):
      start = time.perf_counter()
      state, out = compiled(state, batch)
      jax.block_until_ready(out)
      if i >= warmup:
        times.append(time.perf_counter() - start)
  return Measurement(stats=stats, step_time_s=statistics.median(times), trainer=trainer)


def write_report(path: str, lines: list[str]) -> None:
  """Writes a benchmark's markdown lines to `path` and echoes them."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
