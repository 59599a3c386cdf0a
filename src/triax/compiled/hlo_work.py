"""The work a compiled program executes: matmul FLOPs, bytes and collective bytes, with every
loop counted by its trips and every branch by its runs.

`compiled.cost_analysis()` counts a `while` body once and every branch of a `conditional`
once, so it cannot say what a pipelined or scanned step executes. `work(hlo_text,
branch_counts, trip_counts)` reads the optimised HLO text of one module (an XLA dump's
`*after_optimizations.txt`, or `compiled.as_text()`) from its entry computation and returns
one device's `Work` (the SPMD-partitioned program is one device's):

- a `while` counts by its trip count: XLA's `known_trip_count`, else a counted loop read
  from its condition, initial tuple and body, else `trip_counts[name]`; otherwise an error;
- a `conditional`'s branches count by `branch_counts[path]`: how often the branch runs per
  device per execution of the module, its path being the `jax.named_scope` markers its
  instructions' op_names carry (executor.py's `triax_F`, `triax_F/triax_head`, ...); the
  conditional's uncounted runs go to its one unmarked branch, or to its costliest (an upper
  bound, tallied in `unweighted_conditionals`);
- call, fusion and async-start computations count once per execution.

flops are matmul FLOPs (dot, convolution, cuBLAS GEMM and Pallas custom-calls; others are
`opaque_calls`), bytes HloCostAnalysis's "bytes accessed" simplified, collective_bytes the
data one device's collectives move, per kind. Plain text parsing: any dump, no device.
How each figure is counted: docs/design/hlo_work.md."""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import os
import re

import numpy as np

from triax.compiled.hlo_schedule import _HEADER

_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$')
_SHAPE = re.compile(r'\b(pred|token|[suf]\d+|bf16|c64|c128|f8e\w+|f4e\w+)\[([\d,]*)\]')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = {
  'calls': re.compile(r'\bcalls=%?([\w.\-]+)'),
  'to_apply': re.compile(r'\bto_apply=%?([\w.\-]+)'),
  'body': re.compile(r'\bbody=%?([\w.\-]+)'),
  'condition': re.compile(r'\bcondition=%?([\w.\-]+)'),
}
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRUE_FALSE = re.compile(r'(?:true|false)_computation=%?([\w.\-]+)')
_DIMS = re.compile(r'lhs_contracting_dims=\{([\d,]*)\}')
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_DIM_LABELS = re.compile(r'dim_labels=(\w+)_(\w+)->(\w+)')
_WINDOW = re.compile(r'window=\{([^}]*)\}')
_GROUPS = re.compile(r'(feature|batch)_group_count=(\d+)')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_COST_FLOPS = re.compile(r'"cost_estimate":\s*\{[^}]*?"flops":\s*"?(\d+)')

_BITS = {'pred': 8, 'token': 0, 'bf16': 16, 'c64': 64, 'c128': 128}
COLLECTIVES = (
  'all-reduce',
  'all-gather',
  'reduce-scatter',
  'all-to-all',
  'collective-permute',
  'ragged-all-to-all',
  'collective-broadcast',
)
# Collectives whose figure is their output (the rest: their operands).
_BY_OUTPUT = ('all-gather',)
_BOOKKEEPING = {
  'parameter',
  'constant',
  'tuple',
  'get-tuple-element',
  'bitcast',
  'optimization-barrier',
  'after-all',
  'partition-id',
  'replica-id',
  'while',
  'conditional',
  'call',
  'async-start',
  'async-update',
  'async-done',
}
_GEMMS = ('__cublas$gemm', '__cublas$lt$matmul')


@dataclasses.dataclass
class Work:
  """What one device executes in one run of a module.

  Attributes:
    flops: matmul FLOPs (see the module docstring).
    bytes: bytes accessed by top-level instructions.
    collective_bytes: collective kind -> bytes moved.
    collective_counts: collective kind -> executions.
    unweighted_conditionals: conditionals counted by their costliest branch
      (no branch counts matched them): each once, however often it ran.
    opaque_calls: executed custom-calls whose FLOPs are unknown (each run).
    flops_by_op: the JAX operation (op_name metadata) -> its matmul FLOPs,
      for saying where the FLOPs are.
    fp8_flops: of `flops`, those of matmuls on two FP8 operands (a dot's,
      in a Triton GEMM fusion or not, or cuBLASLt's FP8 GEMM's): model.fp8's.
  """

  flops: float = 0.0
  bytes: float = 0.0
  collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
  collective_counts: dict[str, float] = dataclasses.field(default_factory=dict)
  unweighted_conditionals: int = 0
  opaque_calls: float = 0.0
  flops_by_op: dict[str, float] = dataclasses.field(default_factory=dict)
  fp8_flops: float = 0.0

  def __add__(self, other: Work) -> Work:
    out = Work()
    out.add(self)
    out.add(other)
    return out

  def add(self, other: Work, runs: float = 1.0) -> None:
    """In place: `runs` runs of `other` added (its conditionals once)."""
    self.flops += other.flops * runs
    self.fp8_flops += other.fp8_flops * runs
    self.bytes += other.bytes * runs
    for mine, theirs in (
      (self.collective_bytes, other.collective_bytes),
      (self.collective_counts, other.collective_counts),
      (self.flops_by_op, other.flops_by_op),
    ):
      for k, v in theirs.items():
        mine[k] = mine.get(k, 0) + v * runs
    self.unweighted_conditionals += other.unweighted_conditionals
    self.opaque_calls += other.opaque_calls * runs

  def __mul__(self, k: float) -> Work:
    """k runs of this work (`unweighted_conditionals` counts places, not runs)."""
    scale = lambda d: {key: v * k for key, v in d.items()}  # noqa: E731
    return Work(
      self.flops * k,
      self.bytes * k,
      scale(self.collective_bytes),
      scale(self.collective_counts),
      self.unweighted_conditionals,
      self.opaque_calls * k,
      scale(self.flops_by_op),
      self.fp8_flops * k,
    )

  __rmul__ = __mul__

  @property
  def total_collective_bytes(self) -> float:
    return sum(self.collective_bytes.values())

  def top_ops(self, count: int = 10, depth: int | None = None) -> list[tuple[str, float]]:
    """The `count` JAX operations with the most FLOPs; `depth`: op_names cut
    to their last `depth` components first (and summed)."""
    merged: dict[str, float] = collections.Counter()
    for name, flops in self.flops_by_op.items():
      merged['/'.join(name.split('/')[-depth:]) if depth else name] += flops
    return sorted(merged.items(), key=lambda kv: -kv[1])[:count]

  def summary(self) -> dict:
    """The figures as JSON-ready values (no per-operation breakdown)."""
    out = dataclasses.asdict(self)
    out.pop('flops_by_op')
    return out


def work(
  hlo_text: str,
  branch_counts: dict[str, float] | None = None,
  trip_counts: dict[str, int] | None = None,
) -> Work:
  """The work one device executes in one run of the module `hlo_text`.

  Args:
    hlo_text: the optimised HLO of one module.
    branch_counts: marker path -> runs of the branch so marked, per device
      per run of the module (module docstring); None: every conditional
      counts its costliest branch.
    trip_counts: while instruction name -> trips, for loops XLA printed no
      known trip count for.

  Raises:
    ValueError: a while with no known trip count and none given, or branch
      counts that exceed the runs of their conditional.
  """
  return _Module(hlo_text, branch_counts or {}, trip_counts or {}).run()


def after_optimizations(dump_dir: str, module: str = 'train_step') -> str | None:
  """The optimised HLO file of the last compiled module named `module` in an
  XLA dump (buffers.compile_options names what it dumps); None if none."""
  found = sorted(glob.glob(os.path.join(dump_dir, f'*{module}*after_optimizations.txt')))
  return found[-1] if found else None


def work_of_dump(
  dump_dir: str,
  module: str = 'train_step',
  branch_counts: dict[str, float] | None = None,
  trip_counts: dict[str, int] | None = None,
) -> Work:
  """`work` of the dump's after-optimizations HLO of `module`.

  Raises:
    FileNotFoundError: the dump has no such file.
  """
  path = after_optimizations(dump_dir, module)
  if path is None:
    raise FileNotFoundError(f'{dump_dir} has no *{module}*after_optimizations.txt')
  with open(path) as f:
    return work(f.read(), branch_counts, trip_counts)


@dataclasses.dataclass(frozen=True)
class _Inst:
  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  args: str
  attrs: str
  op_name: str


class _Module:
  def __init__(self, text: str, counts: dict, trips: dict):
    self.counts, self.trips = counts, trips
    self.markers = {part for key in counts for part in key.split('/')}
    self.computations: dict[str, list[_Inst]] = {}
    self.types: dict[str, str] = {}
    self.instructions: dict[str, _Inst] = {}
    self.entry = None
    name = None
    for line in text.split('\n'):
      header = _HEADER.match(line)
      if header and not line.startswith(' '):
        name = header.group(1)
        self.computations[name] = []
        if line.startswith('ENTRY'):
          self.entry = name
      elif line.rstrip() == '}':  # not a '}' opening a line of a kernel's multi-line config
        name = None
      elif name is not None:
        inst = _parse(line)
        if inst is not None:
          self.computations[name].append(inst)
          self.types[inst.name] = inst.type
          self.instructions[inst.name] = inst
    if self.entry is None:
      raise ValueError('no ENTRY computation in the HLO text')
    self._fused: dict[str, Work] = {}
    self._leaves: dict[str, Work] = {}

  def run(self) -> Work:
    return self.computation(self.entry, 1.0, '')

  def computation(self, name: str, runs: float, path: str) -> Work:
    """The work of `runs` executions of computation `name` (inside the
    branch marked `path`)."""
    total = Work()
    for inst in self.computations[name]:
      op = inst.opcode
      if op == 'while':
        trips = self.trip_count(inst)
        for key in ('body', 'condition'):
          called = _CALLED[key].search(inst.attrs).group(1)
          total.add(self.computation(called, runs * trips, path))
      elif op == 'conditional':
        total.add(self.conditional(inst, runs, path))
      elif op in ('call', 'async-start'):
        key = 'to_apply' if op == 'call' else 'calls'
        total.add(self.computation(_CALLED[key].search(inst.attrs).group(1), runs, path))
      elif not (op in _BOOKKEEPING or op.endswith(('-done', '-update'))):
        if inst.name not in self._leaves:
          self._leaves[inst.name] = self.leaf(inst)
        total.add(self._leaves[inst.name], runs)
    return total

  def trip_count(self, inst: _Inst) -> int:
    if inst.name in self.trips:
      return self.trips[inst.name]
    found = _TRIPS.search(inst.attrs)
    if found is not None:
      return int(found.group(1))
    trips = self.counted_loop(inst)
    if trips is None:
      raise ValueError(
        f'while {inst.name} ({inst.op_name}) has no known_trip_count; pass trip_counts'
      )
    return trips

  def counted_loop(self, inst: _Inst) -> int | None:
    """The trips of a loop `for (i = a; i < n; i += b)` read from its HLO: XLA:TPU
    prints no known_trip_count. The condition's root must be
    `compare(get-tuple-element(param, k), constant(n)), direction=LT`, the
    while's operand a tuple whose element k is a constant (through copies),
    and its step the constant the body adds to element k (1 where no such
    add is found: jax's loops step by 1); None otherwise."""
    cond = self.computations[_CALLED['condition'].search(inst.attrs).group(1)]
    body = self.computations[_CALLED['body'].search(inst.attrs).group(1)]
    by_name = {i.name: i for c in (cond, body) for i in c}
    root = cond[-1] if cond else None
    for i in cond:
      if i.attrs and i.opcode == 'compare' and 'direction=LT' in i.attrs:
        root = i
    if root is None or root.opcode != 'compare' or len(root.operands) != 2:
      return None
    index, limit = (by_name.get(o) for o in root.operands)
    if index is None or index.opcode != 'get-tuple-element' or limit is None:
      return None
    k = int(re.search(r'index=(\d+)', index.attrs).group(1))
    n = self.constant(limit)
    start = self.tuple_element(inst.operands[0], k)
    # The step: an add of a constant to element k of the body's parameter
    # (jax's loops step by 1, which is assumed where the add is fused away).
    step = 1
    counter = {i.name for i in body if i.opcode == 'get-tuple-element' and f'index={k}' in i.attrs}
    for i in body:
      if i.opcode == 'add' and counter & set(i.operands):
        found = [self.constant(by_name.get(o)) for o in i.operands if o not in counter]
        step = next((c for c in found if c), step)
    if n is None or start is None or not step:
      return None
    return max(0, -(-(n - start) // step))

  def constant(self, inst: _Inst | None) -> int | None:
    while inst is not None and inst.opcode in ('copy', 'copy-done') and inst.operands:
      inst = self.instructions.get(inst.operands[0])
    if inst is None or inst.opcode != 'constant':
      return None
    try:
      return int(inst.args.strip())
    except ValueError:
      return None

  def tuple_element(self, name: str, k: int) -> int | None:
    inst = self.instructions.get(name)
    while inst is not None and inst.opcode == 'copy' and inst.operands:
      inst = self.instructions.get(inst.operands[0])
    if inst is None or inst.opcode != 'tuple' or len(inst.operands) <= k:
      return None
    return self.constant(self.instructions.get(inst.operands[k]))

  def conditional(self, inst: _Inst, runs: float, path: str) -> Work:
    found = _BRANCHES.search(inst.attrs)
    if found:
      branches = [b.strip().lstrip('%') for b in found.group(1).split(',')]
    else:
      # true_computation first in the text, branch 0 is false's in XLA; the
      # order does not matter here.
      branches = _TRUE_FALSE.findall(inst.attrs)
    marked = {b: self.branch_path(b) for b in branches}
    counted = {b: m for b, m in marked.items() if m and m != path and m in self.counts}
    total = Work()
    for b, m in counted.items():
      total.add(self.computation(b, self.counts[m], m))
    rest = runs - sum(self.counts[m] for m in counted.values())
    if rest < -1e-9:
      raise ValueError(
        f'conditional {inst.name} ({inst.op_name}) runs {runs:g} times, but its branches '
        f'{sorted(counted.values())} are given {runs - rest:g} runs'
      )
    others = [b for b in branches if b not in counted]
    if rest > 0 and others:
      options = [self.computation(b, rest, path) for b in others]
      worst = max(options, key=lambda w: (w.flops, w.bytes))
      if not counted or len(others) > 1:
        worst.unweighted_conditionals += 1
      total.add(worst)
    return total

  def branch_path(self, name: str) -> str:
    """The markers of a branch's instructions (their most common path)."""
    if not self.markers:
      return ''
    votes = collections.Counter()
    for inst in self.computations[name]:
      parts = [p for p in inst.op_name.split('/') if p in self.markers]
      if parts:
        votes['/'.join(parts)] += 1
    return votes.most_common(1)[0][0] if votes else ''

  def leaf(self, inst: _Inst) -> Work:
    """One execution of a top-level instruction that is not control flow."""
    operands = sum(_bytes(self.types.get(o, '')) for o in inst.operands)
    output = _bytes(inst.type)
    op = inst.opcode
    base = op[: -len('-start')] if op.endswith('-start') else op
    if op.endswith('-start') and inst.type.startswith('('):
      output = max(output - operands, 0)  # the result tuple echoes its operands
    work = Work(bytes=operands + output)
    if base in COLLECTIVES:
      moved = output if base in _BY_OUTPUT else operands
      work.collective_bytes = {base: moved}
      work.collective_counts = {base: 1}
    if op == 'fusion':
      called = _CALLED['calls'].search(inst.attrs).group(1)
      work.add(self.fused(called))
      work.bytes -= self.in_place_excess(inst, called)
    elif op == 'custom-call':
      flops = self.custom_flops(inst)
      if flops is None:
        work.opaque_calls = 1
      elif flops:
        work.add(self.matmul(inst, flops))
    else:
      flops = self.matmul_flops(inst)
      if flops:
        work.add(self.matmul(inst, flops))
    return work

  def matmul(self, inst: _Inst, flops: float) -> Work:
    """A matmul's Work: its FLOPs, by operation, and as FP8's where both operands are."""
    fp8 = all(self.types.get(o, '').startswith('f8') for o in inst.operands[:2])
    return Work(flops=flops, flops_by_op={inst.op_name: flops}, fp8_flops=flops if fp8 else 0.0)

  def in_place_excess(self, inst: _Inst, called: str) -> float:
    """The bytes a fusion's operands and output overstate where its root
    updates a parameter in place (a dynamic-update-slice, or a tuple of them):
    such a buffer is read and written a slice at a time (the update's bytes
    each way, as XLA's cost analysis counts a dynamic-update-slice), not whole."""
    body = self.computations[called]
    if not body:
      return 0.0
    params = {i.name: int(i.args) for i in body if i.opcode == 'parameter' and i.args.isdigit()}
    by_name = {i.name: i for i in body}
    root = body[-1]  # XLA prints a computation's root last
    updates = [by_name.get(o) for o in root.operands] if root.opcode == 'tuple' else [root]
    excess = 0.0
    for dus in updates:
      if dus is None or dus.opcode != 'dynamic-update-slice' or dus.operands[0] not in params:
        continue
      k = params[dus.operands[0]]
      if k >= len(inst.operands):
        continue
      whole = _bytes(self.types.get(inst.operands[k], ''))
      excess += 2 * (whole - _bytes(self.types.get(dus.operands[1], '')))
    return max(excess, 0.0)

  def fused(self, name: str) -> Work:
    """A fused computation's matmul FLOPs and collectives (its bytes are its
    fusion's). XLA:TPU fuses a reduce-scatter as an all-reduce and a slice of
    its result (a kCustom fusion calling `all-reduce-scatter...`): it counts as
    a reduce-scatter of the all-reduce's operand."""
    if name not in self._fused:
      total = Work()
      for inst in self.computations[name]:
        if inst.opcode == 'fusion':
          total.add(self.fused(_CALLED['calls'].search(inst.attrs).group(1)))
        base = inst.opcode.removesuffix('-start')
        if base in COLLECTIVES:
          kind = 'reduce-scatter' if name.startswith('all-reduce-scatter') else base
          by = (
            inst.type
            if base in _BY_OUTPUT
            else ''.join(self.types.get(o, '') for o in inst.operands)
          )
          total.add(Work(collective_bytes={kind: _bytes(by)}, collective_counts={kind: 1}))
        flops = self.matmul_flops(inst)
        if flops:
          total.add(self.matmul(inst, flops))
      self._fused[name] = total
    return self._fused[name]

  def matmul_flops(self, inst: _Inst) -> float:
    if inst.opcode == 'dot':
      lhs = _dims(self.types.get(inst.operands[0], ''))
      found = _DIMS.search(inst.attrs)
      contract = [int(d) for d in found.group(1).split(',') if d] if found else []
      return 2.0 * math.prod(_dims(inst.type)) * math.prod(lhs[d] for d in contract)
    if inst.opcode == 'convolution':
      return _convolution_flops(
        _dims(self.types.get(inst.operands[0], '')),
        _dims(self.types.get(inst.operands[1], '')),
        _dims(inst.type),
        inst.attrs,
      )
    return 0.0

  def custom_flops(self, inst: _Inst) -> float | None:
    target = _TARGET.search(inst.attrs)
    target = target.group(1) if target else ''
    if target.startswith(_GEMMS):
      lhs = _dims(self.types.get(inst.operands[0], ''))
      result = _dims(inst.type)
      found = _GEMM_DIMS.search(inst.attrs)
      contract = (
        [int(d.strip().strip('"')) for d in found.group(1).split(',') if d.strip()]
        if found
        else [len(lhs) - 1]
      )
      return 2.0 * math.prod(result) * math.prod(lhs[d] for d in contract)
    found = _COST_FLOPS.search(inst.attrs)
    if found:
      return float(found.group(1))
    return None


def _convolution_flops(lhs: list[int], rhs: list[int], out: list[int], attrs: str) -> float:
  """2 x the multiply-adds of a convolution, as XLA's HloCostAnalysis counts
  them: per spatial dimension only the (output, kernel) position pairs that
  land on the input (not on padding or between dilated elements), times the
  input features per group, the output features and the batch per group.
  XLA:TPU writes matmuls with batch dimensions as such convolutions (a batch
  dimension becomes a padded, reversed window), so the padding must not count."""
  labels = _DIM_LABELS.search(attrs)
  if not labels or not (lhs and rhs and out):
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  groups = dict((k, int(v)) for k, v in _GROUPS.findall(attrs))
  spatial = sorted(c for c in lhs_l if c.isdigit())
  window = _window(attrs, len(spatial))
  valid = 1
  for i, d in enumerate(spatial):
    valid *= _valid_positions(
      lhs[lhs_l.index(d)], rhs[rhs_l.index(d)], out[out_l.index(d)], window[i]
    )
  fma = (
    lhs[lhs_l.index('f')]
    // groups.get('feature', 1)
    * out[out_l.index('f')]
    * (lhs[lhs_l.index('b')] // groups.get('batch', 1))
    * valid
  )
  return 2.0 * fma


def _window(attrs: str, rank: int) -> list[dict]:
  """Per spatial dimension: stride, padding low, lhs (base) and rhs (window) dilation."""
  dims = [{'stride': 1, 'low': 0, 'lhs_dilate': 1, 'rhs_dilate': 1} for _ in range(rank)]
  found = _WINDOW.search(attrs)
  for field in found.group(1).split() if found else ():
    key, _, value = field.partition('=')
    for i, part in enumerate(value.split('x')[:rank]):
      if key == 'pad':
        dims[i]['low'] = int(part.split('_')[0])
      elif key in ('stride', 'lhs_dilate', 'rhs_dilate'):
        dims[i][key] = int(part)
  return dims


def _valid_positions(size: int, kernel: int, out: int, w: dict) -> int:
  """(output, kernel) pairs of one spatial dimension that read an input element."""
  o = np.arange(out)[:, None]
  k = np.arange(kernel)[None, :]
  at = o * w['stride'] - w['low'] + k * w['rhs_dilate']
  base = w['lhs_dilate']
  ok = (at % base == 0) & (at >= 0) & (at // base < size)
  return int(ok.sum())


def _parse(line: str) -> _Inst | None:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.groups()
  if rest.startswith('('):
    end = _closing(rest, 0)
    type_, rest = rest[: end + 1], rest[end + 1 :].lstrip()
  else:
    type_, _, rest = rest.partition(' ')
  opcode, paren, rest = rest.partition('(')
  if not paren:
    return None
  end = _closing('(' + rest, 0)
  args, attrs = rest[: end - 1], rest[end:]
  op_name = _OP_NAME.search(attrs)
  return _Inst(
    name=name,
    type=type_,
    opcode=opcode.strip(),
    operands=tuple(re.findall(r'%([\w.\-]+)', args)),
    args=args,
    attrs=attrs,
    op_name=op_name.group(1) if op_name else '',
  )


def _closing(text: str, start: int) -> int:
  """The index of the parenthesis closing the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == '(':
      depth += 1
    elif text[i] == ')':
      depth -= 1
      if depth == 0:
        return i
  return len(text)


def _bits(dtype: str) -> int:
  if dtype in _BITS:
    return _BITS[dtype]
  if dtype.startswith(('f8', 'f4')):
    return int(dtype[1])
  return int(dtype[1:])


def _bytes(type_: str) -> float:
  """Bytes of every array in an HLO type (a tuple's leaves summed)."""
  return sum(
    math.prod(int(d) for d in dims.split(',') if d) * _bits(dtype) / 8
    for dtype, dims in _SHAPE.findall(type_)
  )


def _dims(type_: str) -> list[int]:
  """The first array's dimensions (of a tuple: a GEMM's result, its workspace after)."""
  found = _SHAPE.search(type_)
  return [int(d) for d in found.group(2).split(',') if d] if found else []
