"""Checkpoints in a layout that does not depend on the parallel layout.

The train state is written in model layer order ([L, ...] stacks) with
orbax, next to a small JSON record of the model shape, so a checkpoint
written under one (data, tensor, pipe, v, schedule) restores under any
other valid one for the same model. The data stream needs nothing beyond
the step: batches are a pure function of it.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from absl import logging

from triax.errors import ConfigError
from triax.training.step import TrainState, Trainer

_MODEL_KEYS = ('num_layers', 'd_model', 'num_heads', 'd_ff', 'vocab_size', 'seq_len',
               'param_dtype')


def model_record(cfg) -> dict:
  """What must match between a checkpoint and the run restoring it."""
  return {k: cfg.model[k] for k in _MODEL_KEYS}


class Checkpointer:
  """Saves and restores the train state of one workdir."""

  def __init__(self, workdir: str, cfg):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self.cfg = cfg
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise ConfigError('--workdir', f'{self.directory} exists and is not a directory; '
                        'choose another --workdir')
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.keep, create=True, enable_async_checkpointing=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, trainer: Trainer, state: TrainState, *, force: bool = False) -> None:
    step = int(jax.device_get(state.step))
    canonical = trainer.to_canonical(state)
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(canonical),
        model=ocp.args.JsonSave(model_record(self.cfg))), force=force)

  def restore(self, trainer: Trainer, step: int | None = None) -> TrainState:
    step = self.latest_step() if step is None else step
    record = self.manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.JsonRestore()))['model']
    expected = model_record(self.cfg)
    for key, value in expected.items():
      if record.get(key) != value:
        raise ConfigError(f'model.{key}',
                          f'checkpoint {self.directory}/{step} has {key}={record.get(key)!r} '
                          f'but the config says {value!r}; use the same model or a new --workdir')
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(trainer.abstract_canonical_state())))['state']
    logging.info('restored step %d from %s', step, self.directory)
    return trainer.from_canonical(restored)

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
