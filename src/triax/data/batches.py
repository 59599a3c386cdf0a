"""Deterministic, resumable global batches of next-byte prediction windows.

The text is cut into N non-overlapping windows of seq_len + 1 tokens. Global
sample g is window perm_e[g % N] of epoch e = g // N, where perm_e is drawn
from the seed and the epoch alone, and step s holds samples s*B ... s*B+B-1.
A batch is therefore a pure function of the step: resuming needs only the step
number, so a checkpoint stores the step and nothing else about the data, and
every process computes the batch without talking to the others. The
training loop has each process compute the whole global batch
(process_count=1) and hands every device its block of it
(training.loop.global_batch), which is right for any mesh; the per-process
rows below suit a mesh whose data axis splits exactly along processes.
"""

from __future__ import annotations

import numpy as np

from triax.errors import ConfigError

Batch = dict[str, np.ndarray]


class BatchStream:
  """Shuffled training batches and fixed evaluation batches over one split.

  Each window is used exactly once per epoch. Process i of P gets rows
  [i*b, (i+1)*b) of every global batch, b = B // P, so the P local batches
  concatenated in process order are the global batch.

  Attributes:
    seq_len: tokens per input row.
    global_batch_size: B, rows per step over all processes.
    local_batch_size: b = B // process_count, rows this process gets.
    num_windows: N, windows in the split (samples per epoch).
  """

  def __init__(
    self,
    tokens: np.ndarray,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split_name: str = 'train',
  ):
    """Builds the stream; checks that the text holds at least one batch.

    Args:
      tokens: 1-D integer token array (uint8 bytes for the byte corpus).
      seq_len: tokens per input row; each window has seq_len + 1 tokens.
      global_batch_size: rows per step over all processes.
      seed: shuffling seed, >= 0.
      process_index: this process, in [0, process_count).
      process_count: number of processes sharing each global batch.
      split_name: named in error messages ('train', 'val').

    Raises:
      ConfigError: a batch does not divide over the processes, or the text is
        too short for one global batch.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(
        f'tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}'
      )
    if not 0 <= process_index < process_count:
      raise ValueError(f'process_index {process_index} is not in [0, {process_count})')
    if seq_len < 1:
      raise ConfigError('model.seq_len', f'{seq_len} must be >= 1')
    if global_batch_size < 1:
      raise ConfigError('train.global_batch_size', f'{global_batch_size} must be >= 1')
    if global_batch_size % process_count:
      raise ConfigError(
        'train.global_batch_size',
        f'{global_batch_size} does not divide over {process_count} '
        f'processes; use a multiple of {process_count}',
      )
    if seed < 0:
      # SeedSequence rejects negative entropy; say so in config terms.
      raise ConfigError('train.seed', f'{seed} must be >= 0')
    num_windows = max(0, (tokens.size - 1) // seq_len)
    if num_windows < global_batch_size:
      raise ConfigError(
        'data.path',
        f'{split_name} text has {tokens.size} bytes: too little for one '
        f'batch of {global_batch_size} x {seq_len + 1}; give more text or '
        'lower train.global_batch_size/model.seq_len',
      )

    self.seq_len = seq_len
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.num_windows = num_windows
    self.seed = seed
    self.process_index = process_index
    self.process_count = process_count
    self.split_name = split_name
    self._tokens = tokens
    self._offsets = np.arange(seq_len + 1, dtype=np.int64)
    # Two permutations suffice: a local batch spans at most two epochs since
    # N >= B. Keeping the previous one avoids recomputing it at a boundary.
    self._perms: dict[int, np.ndarray] = {}

  def epoch_at(self, step: int) -> float:
    """Epochs completed (fractional) before `step`, for logging."""
    return step * self.global_batch_size / self.num_windows

  def batch(self, step: int) -> Batch:
    """This process's rows of the global batch at `step`.

    Args:
      step: training step, >= 0.

    Returns:
      inputs: int32[b, seq_len] tokens.
      targets: int32[b, seq_len], inputs shifted left by one token.
      sample_ids: int64[b], the window index of each row (0 ... N-1).
    """
    if step < 0:
      raise ValueError(f'step must be >= 0, got {step}')
    first = step * self.global_batch_size + (self.process_index * self.local_batch_size)
    g = first + np.arange(self.local_batch_size, dtype=np.int64)
    epochs = g // self.num_windows
    positions = g % self.num_windows
    windows = np.empty_like(g)
    for epoch in range(int(epochs[0]), int(epochs[-1]) + 1):
      rows = epochs == epoch
      windows[rows] = self._permutation(epoch)[positions[rows]]
    return self._gather(windows)

  def eval_batches(self, num_batches: int) -> list[Batch]:
    """Fixed evaluation batches: the first windows in text order, unshuffled.

    Args:
      num_batches: batches wanted; fewer come back when the split holds fewer
        than num_batches * global_batch_size windows, so no window repeats.

    Returns:
      min(num_batches, N // B) batches, as `batch` returns them.
    """
    num_batches = min(num_batches, self.num_windows // self.global_batch_size)
    local = np.arange(self.local_batch_size, dtype=np.int64)
    return [
      self._gather(i * self.global_batch_size + self.process_index * self.local_batch_size + local)
      for i in range(num_batches)
    ]

  def _permutation(self, epoch: int) -> np.ndarray:
    perm = self._perms.get(epoch)
    if perm is None:
      perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
      self._perms[epoch] = perm
      while len(self._perms) > 2:
        del self._perms[next(iter(self._perms))]
    return perm

  def _gather(self, windows: np.ndarray) -> Batch:
    idx = windows[:, None] * self.seq_len + self._offsets
    rows = self._tokens[idx].astype(np.int32)
    return {
      'inputs': np.ascontiguousarray(rows[:, :-1]),
      'targets': np.ascontiguousarray(rows[:, 1:]),
      'sample_ids': windows.astype(np.int64),
    }
