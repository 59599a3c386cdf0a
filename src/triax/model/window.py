"""Sliding windows' arithmetic, without JAX: which ring steps a window reaches
(what context parallelism runs and moves, and what the planner prices) and
the share of the score square a windowed causal kernel computes."""

from __future__ import annotations


def ring_steps(ranks: int, local: int, window: int) -> tuple[int, ...]:
  """The ring steps some rank's queries need: j where rank r meets rank
  r-j's block, for `ranks` ranks of `local` load-balanced slots each
  (context.positions: rank r holds chunks r and 2c-1-r of local/2
  positions). Within `window` (0: every step) a key chunk a serves query
  chunk b when a == b or, a < b, its last key is fewer than `window`
  positions back: (b - a - 1) * chunk + 1 < window."""
  if not window:
    return tuple(range(ranks))
  size = local // 2
  chunks = lambda r: (r, 2 * ranks - 1 - r)  # noqa: E731
  near = lambda b, a: a == b or (a < b and (b - a - 1) * size + 1 < window)  # noqa: E731
  return tuple(
    j
    for j in range(ranks)
    if any(near(b, a) for r in range(ranks) for b in chunks(r) for a in chunks((r - j) % ranks))
  )


def attended_share(seq_len: int, window: int) -> float:
  """The share of the seq_len x seq_len score square a causal query set
  attends within `window` (0: the causal half, the flash kernels' convention
  for a whole causal square): each query its min(i + 1, window) keys."""
  if not window:
    return 0.5
  w = min(window, seq_len)
  return (w * seq_len - w * (w - 1) / 2) / (seq_len * seq_len)
