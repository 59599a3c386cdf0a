"""Deterministic, resumable global batches of next-token prediction windows, on grain.

A split's tokens (a `TokenStream`: documents packed back to back) are cut into N
non-overlapping windows of seq_len + 1 tokens (window k starts at token k * seq_len).
Global sample g is window perm_e[g % N] of epoch e = g // N, perm_e being grain's index
shuffle seeded by the seed and the epoch (`MapDataset.range(N).shuffle(seed).repeat()`,
indexed at random by g); step s holds samples s*B ... s*B+B-1.

Invariants: a batch is a pure function of the step, so resuming needs only the step number
and a checkpoint stores nothing else about the data; each process reads only the rows its
devices hold (`batch(step, rows=...)`), any row range of the global batch, without talking
to the others. A `Mixture` interleaves sources by weight: in every block of MIXTURE_BLOCK
global samples each source gets its share of slots (largest remainder), shuffled per
block, so the proportions hold to 1/MIXTURE_BLOCK over every whole block and the order is
a pure function of the sample index too. Why not grain's own batching:
docs/design/training.md."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from triax.data.sources import TokenStream
from triax.errors import ConfigError

Batch = dict[str, np.ndarray]

# Samples per mixture block: the proportions of each whole block are the weights to 1e-3.
MIXTURE_BLOCK = 1000


def _shuffled_range(n: int, seed: int):
  """grain's `MapDataset.range(n).shuffle(seed).repeat()`: index g -> perm_{g // n}(g % n).

  grain is imported here, not at the top: its import is slow, which only a run
  that reads data should pay (not every entry point that imports the loop).
  """
  import grain

  return grain.MapDataset.range(n).shuffle(seed=seed).repeat()


def grain_seed(seed: int, stream: int = 0) -> int:
  """grain's 32-bit shuffle seed for a run seed (and a source of a mixture).

  grain seeds epoch e with seed + e, so run seeds s and s+1 would share
  shifted epoch orders if passed as they are; hashing them first does not.
  """
  return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


class Samples:
  """One split's windows in the order of the contract above: sample g -> (window id, tokens).

  `stream_index` gives a mixture's sources orders of their own (0 for a lone source,
  1 for a mixture's slots, 2 + j for its source j).

  Attributes:
    num_windows: N, windows in the split (samples per epoch).
  """

  def __init__(
    self,
    stream: TokenStream,
    seq_len: int,
    seed: int,
    mask_documents: bool = False,
    stream_index: int = 0,
  ):
    self.stream = stream
    self.seq_len = seq_len
    self.mask_documents = mask_documents
    if mask_documents and stream.doc_starts is None:
      raise ValueError('mask_documents needs a stream that records its documents')
    self.num_windows = max(0, (stream.size - 1) // seq_len)
    if self.num_windows:
      self.order = _shuffled_range(self.num_windows, grain_seed(seed, stream_index))
      self.rows = self.order.map(self.window)

  def window(self, k: int) -> dict:
    start = int(k) * self.seq_len
    row = {'window': int(k), 'tokens': self.stream.read(start, self.seq_len + 1)}
    if self.mask_documents:
      row['segments'] = self.stream.segment_ids(start, self.seq_len + 1)
    return row

  def window_id(self, g: int) -> int:
    return int(self.order[int(g)])

  def read(self, g: int) -> dict:
    return self.rows[int(g)]


class Mixture:
  """Samples of several sources interleaved by weight; sample ids offset per source.

  Global sample g falls in block b = g // K at slot grain-shuffled(g) of the
  block; slots [c_0 + ... + c_{j-1}, ... + c_j) belong to source j, whose
  sample number is then b * c_j + (slot's rank among its source's slots),
  so each source's samples are consumed in order, block by block, each
  source cycling through its own epochs.
  """

  def __init__(self, sources: Sequence[Samples], weights: Sequence[float], seed: int):
    weights = np.asarray(weights, dtype=np.float64)
    share = weights / weights.sum() * MIXTURE_BLOCK
    counts = np.floor(share).astype(np.int64)
    # Largest remainder: the block's leftover slots go to the sources furthest below their share.
    for j in np.argsort(-(share - counts), kind='stable')[: MIXTURE_BLOCK - counts.sum()]:
      counts[j] += 1
    self.sources = list(sources)
    self.counts = counts
    self.weights = weights / weights.sum()
    self._source_of = np.repeat(np.arange(len(counts)), counts)
    self._rank = np.arange(MIXTURE_BLOCK) - np.repeat(np.cumsum(counts) - counts, counts)
    self._offsets = np.cumsum([0] + [s.num_windows for s in self.sources])
    self.num_windows = int(self._offsets[-1])
    self.mask_documents = self.sources[0].mask_documents
    self.seq_len = self.sources[0].seq_len
    self._slots = _shuffled_range(MIXTURE_BLOCK, grain_seed(seed, 1))

  def locate(self, g: int) -> tuple[int, int]:
    """(source, that source's sample number) of global sample g."""
    slot = int(self._slots[int(g)])
    j = int(self._source_of[slot])
    return j, int(g) // MIXTURE_BLOCK * int(self.counts[j]) + int(self._rank[slot])

  def window_id(self, g: int) -> int:
    j, c = self.locate(g)
    return int(self._offsets[j]) + self.sources[j].window_id(c)

  def read(self, g: int) -> dict:
    j, c = self.locate(g)
    row = dict(self.sources[j].read(c))
    row['window'] += int(self._offsets[j])
    return row


class BatchStream:
  """Shuffled training batches and fixed evaluation batches over one split (or a mixture).

  Each window is used exactly once per epoch. Process i of P gets rows
  [i*b, (i+1)*b) of every global batch by default, b = B // P; `rows=`
  asks for any other range (a device's block).

  Attributes:
    seq_len: tokens per input row.
    global_batch_size: B, rows per step over all processes.
    local_batch_size: b = B // process_count.
    num_windows: N, windows in the split (samples per epoch).
  """

  def __init__(
    self,
    tokens: np.ndarray | TokenStream | Mixture,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split_name: str = 'train',
    mask_documents: bool = False,
    evaluation: bool = False,
  ):
    """Builds the stream; checks that the split holds at least one batch.

    An `evaluation` split needs one window only: one shorter than a batch is
    repeated from its start to fill the batch, as torch's DistributedSampler
    pads an eval set, so a small corpus's validation still has a loss.

    Args:
      tokens: a 1-D integer token array, a TokenStream, or a Mixture of samples.
      seq_len: tokens per input row; each window has seq_len + 1 tokens.
      global_batch_size: rows per step over all processes.
      seed: shuffling seed, >= 0.
      process_index: this process, in [0, process_count).
      process_count: processes sharing each global batch (for the default rows).
      split_name: named in error messages ('train', 'val').
      mask_documents: add int32 'segment_ids' (document number within the row).
      evaluation: the split is only evaluated on (`eval_batch`): one window is enough.

    Raises:
      ConfigError: a batch does not divide over the processes, or the split is
        too short for one global batch.
    """
    if isinstance(tokens, np.ndarray) or not isinstance(tokens, (TokenStream, Mixture)):
      tokens = np.asarray(tokens)
      if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
          f'tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}'
        )
      tokens = TokenStream([tokens])
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
    if isinstance(tokens, Mixture):
      samples = tokens
      short = [s for s in tokens.sources if s.num_windows < 1]
      size = min(s.stream.size for s in tokens.sources)
      unit = 'tokens'
    else:
      samples = Samples(tokens, seq_len, seed, mask_documents)
      short = [samples] if samples.num_windows < (1 if evaluation else global_batch_size) else []
      size = tokens.size
      unit = 'bytes' if tokens.dtype == np.uint8 else 'tokens'
    if short and evaluation:
      raise ConfigError(
        'data.path',
        f'{split_name} text has {size} {unit}: too little for one window of {seq_len + 1}; '
        'hold out more of the text (triax prepare --val_fraction), give more, or lower '
        'model.seq_len',
      )
    if short:
      raise ConfigError(
        'data.path',
        f'{split_name} text has {size} {unit}: too little for one '
        f'batch of {global_batch_size} x {seq_len + 1}; give more text or '
        'lower train.global_batch_size/model.seq_len',
      )

    self.seq_len = seq_len
    self.global_batch_size = global_batch_size
    self.local_batch_size = global_batch_size // process_count
    self.num_windows = samples.num_windows
    self.seed = seed
    self.process_index = process_index
    self.process_count = process_count
    self.split_name = split_name
    self.samples = samples

  def epoch_at(self, step: int) -> float:
    """Epochs completed (fractional) before `step`, for logging."""
    return step * self.global_batch_size / self.num_windows

  def _rows(self, rows: tuple[int, int] | None) -> np.ndarray:
    if rows is None:
      first = self.process_index * self.local_batch_size
      rows = (first, first + self.local_batch_size)
    lo, hi = rows
    if not 0 <= lo < hi <= self.global_batch_size:
      raise ValueError(f'rows {rows} are not a range of [0, {self.global_batch_size})')
    return np.arange(lo, hi, dtype=np.int64)

  def sample_ids(self, step: int) -> np.ndarray:
    """int64[B]: the window of every row of the global batch at `step` (nothing is read)."""
    g = step * self.global_batch_size + np.arange(self.global_batch_size)
    return np.array([self.samples.window_id(x) for x in g], dtype=np.int64)

  def batch(self, step: int, rows: tuple[int, int] | None = None) -> Batch:
    """Rows [lo, hi) of the global batch at `step` (default: this process's rows).

    Returns:
      inputs: int32[r, seq_len] tokens.
      targets: int32[r, seq_len], inputs shifted left by one token.
      sample_ids: int64[r], the window index of each row (0 ... N-1).
      segment_ids: int32[r, seq_len] (with mask_documents), the document
        number of each input token within its row, from 0.
    """
    if step < 0:
      raise ValueError(f'step must be >= 0, got {step}')
    g = step * self.global_batch_size + self._rows(rows)
    return self._stack([self.samples.read(x) for x in g])

  def eval_batch(self, index: int, rows: tuple[int, int] | None = None) -> Batch:
    """Evaluation batch `index`: windows index*B ... in text order, unshuffled
    (modulo N: a split shorter than one batch repeats from its start)."""
    if isinstance(self.samples, Mixture):
      raise ValueError('evaluation batches come from one source')
    k = (index * self.global_batch_size + self._rows(rows)) % self.num_windows
    return self._stack([self.samples.window(x) for x in k])

  def num_eval_batches(self, num_batches: int) -> int:
    """min(num_batches, N // B), at least one: no window repeats unless N < B."""
    return min(num_batches, max(1, self.num_windows // self.global_batch_size))

  def eval_batches(self, num_batches: int) -> list[Batch]:
    """Fixed evaluation batches (this process's rows): the first windows in text order."""
    return [self.eval_batch(i) for i in range(self.num_eval_batches(num_batches))]

  def _stack(self, items: list[dict]) -> Batch:
    rows = np.stack([item['tokens'] for item in items]).astype(np.int32)
    batch = {
      'inputs': np.ascontiguousarray(rows[:, :-1]),
      'targets': np.ascontiguousarray(rows[:, 1:]),
      'sample_ids': np.array([item['window'] for item in items], dtype=np.int64),
    }
    if self.samples.mask_documents:
      batch['segment_ids'] = np.stack([item['segments'][:-1] for item in items])
    return batch


def keys(cfg) -> tuple[str, ...]:
  """The arrays of a batch: with data.mask_documents, the rows' document ids too."""
  return ('inputs', 'targets') + (('segment_ids',) if cfg.data.mask_documents else ())
