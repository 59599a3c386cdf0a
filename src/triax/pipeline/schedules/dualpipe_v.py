"""DualPipeV: DeepSeek-V3's DualPipe cut in half, as torch runs it.

DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437, section
3.2.1) overlaps one micro-batch's forward with another's backward so that
expert parallelism's all-to-all hides under compute; DualPipeV is its
one-copy-of-the-weights variant (github.com/deepseek-ai/DualPipe). The
orders here are those of torch.distributed.pipelining's
`ScheduleDualPipeV._calculate_single_rank_operations`
(torch/distributed/pipelining/schedules.py, torch 2.13).
"""

from __future__ import annotations

from triax.errors import ConfigError
from triax.pipeline.ir import BACKWARD, FORWARD, WEIGHT, Action, Schedule, v_placement
from triax.pipeline.schedules.common import check_sizes, schedule


def dualpipe_v(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
  """Two chunks per stage in a V, forwards overlapped with backwards.

  Stage d holds chunk a = d and chunk b = 2p-1-d (ZB-V's V placement).
  Its order, as torch builds it (k = m - 2p + d + 1):

    1  2(p-d-1) times F(a);
    2  d+1 times F(a) F(b);
    3  p-d-1 times I(b) W F(b), W the oldest waiting weight gradient;
    4  k times (F(a);B(b)) (F(b);B(a)), the last stage running its first
       pair as F(a) B(b) apart;
    5  p-d-1 times B(b) (F(b);B(a));
    6  d+1 times B(b) B(a), the second half as I (input gradient only);
    7  p-d-1 times W I(a) (B(a) before the switch to I);
    8  the d+1 weight gradients still waiting.

  B is our B with its own W at once after it (`Schedule.full_backwards`), I
  our B alone. `(F;B)` is an overlapped pair (`Schedule.overlaps`): by
  default a pair takes consecutive ticks; `lower`'s fuse_overlaps runs it in
  one fused tick. Why: docs/design/schedules.md.

  Raises:
    ConfigError: for v != 2, or m < 2p (torch's minimum: as many
      micro-batches as chunks).
  """
  p, m, v = check_sizes(stages, microbatches, virtual_stages)
  if v != 2:
    raise ConfigError(
      'pipeline.virtual_stages', f'dualpipe_v runs exactly 2 model chunks per stage (a V); got {v}'
    )
  if m < 2 * p:
    raise ConfigError(
      'pipeline.microbatches',
      f'dualpipe_v needs at least as many micro-batches as model chunks (2 x {p} stages = '
      f'{2 * p}, as torch requires); got {m}',
    )
  builders = [_Stage(p, m, d) for d in range(p)]
  return schedule(
    'dualpipe_v',
    p,
    m,
    2,
    [s.order for s in builders],
    placement=v_placement(p),
    overlaps=[x for s in builders for x in s.overlaps],
    full_backwards=[x for s in builders for x in s.full_backwards],
  )


class _Stage:
  """Stage d's order, built by torch's eight steps (see `dualpipe_v`)."""

  def __init__(self, p: int, m: int, d: int):
    self.order: list[Action] = []
    self.overlaps: list[tuple[Action, Action]] = []
    self.full_backwards: list[Action] = []
    # Next micro-batch of each (kind, chunk), and the input gradients whose
    # weight gradient waits, oldest first, across both chunks (torch's queue).
    self._next = {(kind, c): 0 for kind in (FORWARD, BACKWARD) for c in (d, 2 * p - 1 - d)}
    self._waiting: list[Action] = []
    self._build(p, m, d)

  def _take(self, kind: str, chunk: int) -> Action:
    j = self._next[(kind, chunk)]
    self._next[(kind, chunk)] = j + 1
    return Action(kind, j, chunk)

  def forward(self, chunk: int) -> None:
    self.order.append(self._take(FORWARD, chunk))

  def input_grad(self, chunk: int) -> None:
    b = self._take(BACKWARD, chunk)
    self.order.append(b)
    self._waiting.append(b)

  def full_backward(self, chunk: int) -> None:
    b = self._take(BACKWARD, chunk)
    self.order += [b, Action(WEIGHT, b.microbatch, chunk)]
    self.full_backwards.append(b)

  def weight_if_waiting(self) -> None:
    if self._waiting:
      b = self._waiting.pop(0)
      self.order.append(Action(WEIGHT, b.microbatch, b.chunk))

  def overlapped(self, forward_chunk: int, backward_chunk: int) -> None:
    f = self._take(FORWARD, forward_chunk)
    self.order.append(f)
    self.full_backward(backward_chunk)
    self.overlaps.append((f, self.full_backwards[-1]))

  def backward(self, chunk: int, split: bool) -> None:
    (self.input_grad if split else self.full_backward)(chunk)

  def _build(self, p: int, m: int, d: int) -> None:
    a, b = d, 2 * p - 1 - d
    for _ in range(2 * (p - d - 1)):
      self.forward(a)
    for _ in range(d + 1):
      self.forward(a)
      self.forward(b)
    for _ in range(p - d - 1):
      self.input_grad(b)
      self.weight_if_waiting()
      self.forward(b)
    for i in range(m - 2 * p + d + 1):
      if i == 0 and d == p - 1:
        # torch: not overlapped, to shorten the bubble.
        self.forward(a)
        self.full_backward(b)
      else:
        self.overlapped(a, b)
      self.overlapped(b, a)
    for _ in range(p - d - 1):
      self.full_backward(b)
      self.overlapped(b, a)
    # From the middle of step 6 on, backwards are split (input gradient
    # now, weight gradient in steps 7 and 8); odd stages switch one
    # backward earlier than even ones.
    split = False
    for i in range(d + 1):
      split = split or (i == (d + 1) // 2 and d % 2 == 1)
      self.backward(b, split)
      split = split or (i == (d + 1) // 2 and d % 2 == 0)
      self.backward(a, split)
    for _ in range(p - d - 1):
      self.weight_if_waiting()
      self.backward(a, split)
    for _ in range(d + 1):
      self.weight_if_waiting()
