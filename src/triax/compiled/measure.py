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
from triax.compiled.stats import all_compile_stats, run_peak_bytes, step_peak_bytes
from triax.mesh import build_mesh
from triax.training.step import Trainer, build_trainer


@dataclasses.dataclass
class Measurement:
  stats: dict  # all_compile_stats(): temp/argument/output and state-program bytes, flops, schedule
  step_time_s: float  # median of the timed steps
  trainer: Trainer

  @property
  def step_peak_bytes(self) -> int:
    """The train step's per-device peak (stats.step_peak_bytes)."""
    return step_peak_bytes(self.stats)

  @property
  def peak_bytes(self) -> int:
    """The run's per-device peak: the step, a save, a restore or an eval (stats.run_peak_bytes)."""
    return run_peak_bytes(self.stats)


@dataclasses.dataclass
class Compiled:
  """A configuration's compiled train step, before anything has run."""

  trainer: Trainer
  step: object  # the compiled train step
  stats: dict  # all_compile_stats()

  @property
  def peak_bytes(self) -> int:
    return run_peak_bytes(self.stats)


def compile_config(cfg, devices=None) -> Compiled:
  """Validates `cfg` for `devices` (default: all) and compiles its programs;
  nothing runs, so a layout far over the host's memory costs nothing here."""
  devices = list(jax.devices() if devices is None else devices)
  cfg = config_lib.validate(cfg, len(devices))
  config_lib.check_platform(cfg, devices[0].platform)
  trainer = build_trainer(cfg, build_mesh(cfg.mesh, devices))
  with jax.set_mesh(trainer.mesh):
    # The state programs too: a layout's peak may be a save or an eval (Measurement.peak_bytes).
    compiled, _, stats = all_compile_stats(trainer)
  return Compiled(trainer, compiled, stats)


def time_steps(compiled: Compiled, *, steps: int = 5, warmup: int = 2) -> float:
  """Median wall time of `steps` train steps on random tokens, after `warmup`."""
  trainer, cfg = compiled.trainer, compiled.trainer.cfg
  rng = np.random.default_rng(0)
  shape = (cfg.train.global_batch_size, cfg.model.seq_len + 1)
  # Ids the data could hold: none past model.vocab_used (padding, whose targets would cost inf).
  tokens = rng.integers(0, cfg.model.vocab_used or cfg.model.vocab_size, shape).astype(np.int32)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(
      {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}, trainer.batch_sharding
    )
    state = trainer.init_state(jax.random.key(0))
    times = []
    for i in range(warmup + steps):
      start = time.perf_counter()
      state, out = compiled.step(state, batch)
      jax.block_until_ready(out)
      if i >= warmup:
        times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(cfg, *, steps: int = 5, warmup: int = 2, devices=None) -> Measurement:
  """Validates `cfg` for `devices` (default: all), compiles its train step and times it."""
  compiled = compile_config(cfg, devices)
  step_time = time_steps(compiled, steps=steps, warmup=warmup)
  return Measurement(stats=compiled.stats, step_time_s=step_time, trainer=compiled.trainer)


def write_report(path: str, lines: list[str]) -> None:
  """Writes a benchmark's markdown lines to `path` and echoes them."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
