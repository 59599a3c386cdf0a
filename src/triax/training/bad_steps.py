"""Bad steps: which steps are bad, when to roll back, and which batch a step reads.

A step is *non-finite* when its loss or gradient norm is NaN/Inf, and
*spiking* when its loss is above train.spike_threshold times the mean of the
last train.spike_window good (finite, non-spiking) losses; a spike is only
judged once that window is full, so the fall of an early loss is no spike.

With train.skip_nonfinite_steps=N a non-finite step leaves the state as it
was (training/step.py), up to N times a run. With train.spike_rollback=K,
K consecutive bad steps (non-finite or spiking) roll the run back to the
newest checkpoint before the first of them, and the batches those steps read
are never read again.

Batches are a pure function of a *position* (data/batches.py); without
skips step s reads position s - 1. Skipping shifts the map: step s reads the
s-th position that is not skipped, so the data order is otherwise unchanged,
and a resume that knows the skipped positions reads exactly what an
uninterrupted run reads. The skipped positions are saved with every
checkpoint (its progress record) and in DIR/rollbacks.jsonl, one line per
rollback, so a resume from any checkpoint knows all of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from triax.training import workdir as workdir_lib

# What a step's loss and gradient norm make of it.
GOOD, SKIPPED, SPIKE, ROLLBACK = 'good', 'skipped', 'spike', 'rollback'


class NonFiniteError(RuntimeError):
  """The loss or gradient of `step` became NaN/Inf; that state is not saved.

  The loop may notice it while the next step runs (it reads each step's loss
  one step behind); the state of that next step, computed from it, is not
  saved either.
  """

  def __init__(self, step: int, loss: float, grad_norm: float):
    self.step = step
    super().__init__(
      f'step {step}: loss={loss} grad_norm={grad_norm} is not finite; stopped '
      'without saving this step (lower train.learning_rate, or let '
      'train.skip_nonfinite_steps=N skip such steps, or train.spike_rollback=K roll back)'
    )


class TooManyRollbacks(NonFiniteError):
  """The run rolled back train.spike_max_rollbacks times and went bad again (it diverged)."""

  def __init__(self, step: int, rollbacks: int):
    self.step = step
    RuntimeError.__init__(
      self,
      f'step {step}: bad again after {rollbacks} rollbacks (train.spike_max_rollbacks); '
      'stopped. The run diverges whatever batches it skips: lower train.learning_rate',
    )


def position(step: int, skipped: list[int]) -> int:
  """The batch position step `step` (from 1) reads: the step-th position not in `skipped`."""
  p = step - 1
  for s in sorted(skipped):
    if s <= p:
      p += 1
  return p


def read_rollbacks(workdir: str) -> list[dict]:
  """DIR/rollbacks.jsonl's records (an empty list when there is none)."""
  path = workdir_lib.path(workdir, workdir_lib.ROLLBACKS)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


@dataclasses.dataclass
class BadSteps:
  """The run's bad-step state; `progress()` is what a checkpoint keeps of it."""

  skip_limit: int
  rollback_after: int
  threshold: float
  window: int
  max_rollbacks: int
  skipped_nonfinite: list[int] = dataclasses.field(default_factory=list)
  skipped_batches: list[int] = dataclasses.field(default_factory=list)
  recent: list[float] = dataclasses.field(default_factory=list)  # the last good losses
  streak: list[int] = dataclasses.field(default_factory=list)  # steps of the current bad run
  rollbacks: int = 0

  @classmethod
  def from_config(cls, train_cfg, progress: dict, records: list[dict]) -> BadSteps:
    """The state a run resumes with: the checkpoint's progress plus every rollback recorded."""
    skipped = set(progress.get('skipped_batches', []))
    for record in records:
      skipped.update(record['skipped_batches'])
    return cls(
      skip_limit=train_cfg.skip_nonfinite_steps,
      rollback_after=train_cfg.spike_rollback,
      threshold=train_cfg.spike_threshold,
      window=train_cfg.spike_window,
      max_rollbacks=train_cfg.spike_max_rollbacks,
      skipped_nonfinite=list(progress.get('skipped_nonfinite', [])),
      skipped_batches=sorted(skipped),
      recent=list(progress.get('recent_losses', [])),
      streak=list(progress.get('bad_streak', [])),
      rollbacks=len(records),
    )

  def progress(self) -> dict:
    return {
      'skipped_nonfinite': self.skipped_nonfinite,
      'skipped_batches': self.skipped_batches,
      'recent_losses': self.recent,
      'bad_streak': self.streak,
    }

  @property
  def amid_bad_steps(self) -> bool:
    """Whether a rollback may come: periodic saves wait, so retention keeps the checkpoint
    before the bad steps."""
    return bool(self.rollback_after and self.streak)

  def position(self, step: int) -> int:
    return position(step, self.skipped_batches)

  def is_spike(self, loss: float) -> bool:
    full = self.rollback_after and len(self.recent) == self.window
    return bool(full) and loss > self.threshold * (sum(self.recent) / self.window)

  def judge(self, step: int, loss: float, grad_norm: float) -> str:
    """GOOD, SKIPPED (non-finite, state kept), SPIKE (counted) or ROLLBACK (now).

    Raises:
      NonFiniteError: a non-finite step that neither skipping nor rolling back covers.
      TooManyRollbacks: a rollback is due and train.spike_max_rollbacks are spent.
    """
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite and not self.is_spike(loss):
      self.streak = []
      self.recent = (self.recent + [loss])[-self.window :]
      return GOOD
    if not finite:
      # Without skipping, the state is NaN now: no later step can mend it.
      kept = len(self.skipped_nonfinite) < self.skip_limit
      if not kept and not self.rollback_after:
        raise NonFiniteError(step, loss, grad_norm)
      if kept:
        self.skipped_nonfinite.append(step)
      self.streak.append(step)
      if not kept or len(self.streak) >= self.rollback_after > 0:
        return self._rollback_due(step)
      return SKIPPED
    self.streak.append(step)
    return self._rollback_due(step) if len(self.streak) >= self.rollback_after else SPIKE

  def _rollback_due(self, step: int) -> str:
    if self.rollbacks >= self.max_rollbacks:
      raise TooManyRollbacks(step, self.rollbacks)
    return ROLLBACK

  def rolled_back(self, workdir: str, restored: int, progress: dict, main: bool) -> dict:
    """Skips the streak's batches, takes the restored checkpoint's window; records it."""
    record = {
      'time': time.time(),
      'bad_steps': self.streak,
      'skipped_batches': [self.position(s) for s in self.streak],
      'restored_step': restored,
    }
    self.skipped_batches = sorted(set(self.skipped_batches) | set(record['skipped_batches']))
    self.recent = list(progress.get('recent_losses', []))
    self.streak = []
    self.rollbacks += 1
    if main:
      with open(workdir_lib.path(workdir, workdir_lib.ROLLBACKS), 'a') as f:
        f.write(json.dumps(record) + '\n')
        f.flush()
        os.fsync(f.fileno())
    return record
