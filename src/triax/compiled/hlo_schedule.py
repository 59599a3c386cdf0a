"""What a compiled program's schedule runs while its async collectives fly.

XLA:GPU splits a collective into a start and a done, and its latency-hiding
scheduler places independent kernels between them: those kernels are what
hides the collective. `windows` reads the optimised, scheduled HLO text
(an XLA dump's `*after_optimizations.txt`, whose instructions are in
schedule order) and reports, for the computation with the most windows of
one collective (a fused pipeline tick's branch, for DualPipeV), how many
kernels run inside them, and how many of those belong to another chain:
collectives linked by data flow form a chain (one micro-batch's dispatch
and combine), and a kernel is another chain's when it feeds or is fed by
that chain's collectives and not by the window's own. In a fused tick those
are the other micro-batch's, which is the overlap DualPipe exists for.

Plain text parsing: works on any dump, needs no device.
"""

from __future__ import annotations

import dataclasses
import re

_HEADER = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?(%[\w.\-]+) = (.*)$')
# Attributes naming computations (not operands): dropped before reading operands.
_CALLED = re.compile(
  r'(?:calls|to_apply|branch_computations|true_computation|false_computation|body|condition)='
  r'(?:\{[^}]*\}|%[\w.\-]+)'
)
_METADATA = re.compile(r'metadata=\{.*?\}|backend_config=.*$')
_KERNEL = re.compile(r' (?:fusion|custom-call)\(')


@dataclasses.dataclass(frozen=True)
class Windows:
  """One computation's windows of one async collective.

  Attributes:
    computation: its name.
    pairs: start/done pairs in it.
    chains: collectives per chain (linked by data flow), largest first.
    kernels: kernels (fusions, library calls) scheduled inside any window,
      counted once per window.
    other_chain: of those, the kernels that belong to another chain only.
  """

  computation: str
  pairs: int
  chains: tuple[int, ...]
  kernels: int
  other_chain: int


def windows(hlo: str, op: str = 'all-to-all') -> Windows | None:
  """The windows of `op` in the computation that has the most; None if none."""
  best = None
  for name, body in _computations(hlo).items():
    found = _windows(name, body, op)
    if found is not None and (best is None or found.pairs > best.pairs):
      best = found
  return best


def _computations(hlo: str) -> dict[str, list[str]]:
  out, name = {}, None
  for line in hlo.split('\n'):
    header = _HEADER.match(line)
    if header and not line.startswith(' '):
      name = header.group(1)
      out[name] = []
    elif line.startswith('}'):
      name = None
    elif name is not None:
      out[name].append(line)
  return out


def _windows(name: str, body: list[str], op: str) -> Windows | None:
  order, operands, kernel = [], {}, set()
  for line in body:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    inst, rest = match.groups()
    order.append(inst)
    rest = _CALLED.sub('', _METADATA.sub('', rest))
    operands[inst] = [x for x in re.findall(r'%[\w.\-]+', rest) if x != inst]
    if _KERNEL.search(line):
      kernel.add(inst)
  starts = [x for x in order if x.startswith(f'%{op}-start')]
  done = {o: x for x in order if x.startswith(f'%{op}-done') for o in operands[x] if o in starts}
  starts = [s for s in starts if s in done]
  if not starts:
    return None
  above = _ancestors(order, operands)
  chain = _chains(starts, above)
  where = {x: i for i, x in enumerate(order)}

  def related(x: str, root: str) -> bool:
    return any(s in above[x] or x in above[s] or done[s] in above[x] for s in chain[root])

  kernels = other = 0
  for s in starts:
    own = next(r for r, members in chain.items() if s in members)
    inside = [x for x in order[where[s] + 1 : where[done[s]]] if x in kernel]
    kernels += len(inside)
    other += sum(
      1 for x in inside if not related(x, own) and any(related(x, r) for r in chain if r != own)
    )
  sizes = tuple(sorted((len(m) for m in chain.values()), reverse=True))
  return Windows(name, len(starts), sizes, kernels, other)


def _ancestors(order: list[str], operands: dict[str, list[str]]) -> dict[str, set[str]]:
  """Each instruction's transitive operands (the schedule is a topological order)."""
  above: dict[str, set[str]] = {}
  for x in order:
    mine = set()
    for o in operands[x]:
      if o in above:
        mine |= above[o]
        mine.add(o)
    above[x] = mine
  return above


def _chains(starts: list[str], above: dict[str, set[str]]) -> dict[str, list[str]]:
  """Collectives grouped by data flow: one feeds another (union-find)."""
  parent = {s: s for s in starts}

  def root(x: str) -> str:
    while parent[x] != x:
      x = parent[x]
    return x

  for s in starts:
    for t in starts:
      if t in above[s]:
        parent[root(s)] = root(t)
  chains: dict[str, list[str]] = {}
  for s in starts:
    chains.setdefault(root(s), []).append(s)
  return chains
