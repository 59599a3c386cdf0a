"""Splits a backward pass into its input-gradient (B) and weight-gradient (W) halves.

`SplitBackward` traces a chunk's fused backward once to a jaxpr and partitions its
equations: everything the input gradient depends on is B; what only the weight gradients
need is W; the values B computes that W reads (the cotangents at each weight matmul's
output, a layer's output gradient) are B's extra outputs, the "cut", which the executor
keeps from the B to the W. A `scan` becomes a B scan that emits each iteration's cut and a
W scan that consumes it; a `cond` a B switch and a W switch; a nested `jit` or
`checkpoint` is inlined. Cheap W equations (no matmul) move into B where that makes the cut
no larger (`_promote_cheap`).

Invariants: every equation of the fused backward runs exactly once, in B or in W, so
B + W execute its FLOPs; the split needs no cooperation from the model.
Why calling `vjp` twice does not give this split: docs/design/executor.md."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

from triax.pipeline import cpu_dots

_B, _W, _DEAD, _SPLIT = 'B', 'W', '-', 'S'


@dataclasses.dataclass
class _Plan:
  """How one jaxpr's equations divide between B and W.

  Attributes:
    jaxpr: the (open) jaxpr.
    consts: values of its constvars (a closed jaxpr's consts), or ().
    need_b, need_w: outvar indices B, resp. W, must produce (disjoint).
    roles: per equation, B, W, dead or split.
    subs: equation index -> the rule's plan for a split equation.
    b_in, w_in: invar indices the B, resp. W, part reads.
    cuts: vars B defines and W reads, in a fixed order.
  """

  jaxpr: Any
  consts: tuple
  need_b: tuple[int, ...]
  need_w: tuple[int, ...]
  roles: list[str]
  subs: dict[int, Any]
  b_in: set[int]
  w_in: set[int]
  cuts: list[Any]


def _is_var(v) -> bool:
  return not isinstance(v, core.Literal)


def _analyze(jaxpr, consts, need_b, need_w) -> _Plan:
  """Assigns every equation to B or W by backward reachability."""
  need_w = tuple(sorted(set(need_w) - set(need_b)))
  need_b = tuple(sorted(need_b))
  live_b = {jaxpr.outvars[i] for i in need_b if _is_var(jaxpr.outvars[i])}
  live_w = {jaxpr.outvars[i] for i in need_w if _is_var(jaxpr.outvars[i])}
  roles: list[str] = [_DEAD] * len(jaxpr.eqns)
  subs: dict[int, Any] = {}
  defined_b: set = set()
  for n in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[n]
    ob = {k for k, v in enumerate(eqn.outvars) if v in live_b}
    ow = {k for k, v in enumerate(eqn.outvars) if v in live_w} - ob
    rule = _RULES.get(eqn.primitive.name)
    if ob and ow and rule is not None:
      sub, ins_b, ins_w = rule.analyze(eqn, ob, ow)
      roles[n], subs[n] = _SPLIT, sub
      live_b |= {eqn.invars[i] for i in ins_b if _is_var(eqn.invars[i])}
      live_w |= {eqn.invars[i] for i in ins_w if _is_var(eqn.invars[i])}
      defined_b |= {eqn.outvars[k] for k in ob}
    elif ob:
      roles[n] = _B
      live_b |= {v for v in eqn.invars if _is_var(v)}
      defined_b |= set(eqn.outvars)
    elif ow:
      roles[n] = _W
      live_w |= {v for v in eqn.invars if _is_var(v)}
  live_w = _promote_cheap(jaxpr, roles, subs, live_b, defined_b, need_w)
  cuts = sorted((v for v in live_w if v in defined_b), key=_order(jaxpr))
  return _Plan(
    jaxpr,
    tuple(consts),
    need_b,
    need_w,
    roles,
    subs,
    {i for i, v in enumerate(jaxpr.invars) if v in live_b},
    {i for i, v in enumerate(jaxpr.invars) if v in live_w},
    cuts,
  )


# Equations too costly to move from W to B: the weight gradients' matmuls
# (what W exists to defer) and anything that talks to other devices.
_COSTLY = frozenset({'dot_general', 'conv_general_dilated', 'ragged_dot', 'ragged_dot_general'})


def _cheap(eqn) -> bool:
  """Elementwise, reduction or shape work on this device only (a `jit` of such)."""
  name, params = eqn.primitive.name, eqn.params
  # psum and its kin name mesh axes (a reduction's axes are dimensions); a
  # cast to varying names them too but moves nothing.
  named = any(isinstance(a, str) for a in params.get('axes', ()))
  collective = 'axis_name' in params or (named and not _casts_to_varying(eqn))
  if name in _COSTLY or collective:
    return False
  if name in ('jit', 'pjit'):
    return all(_cheap(e) for e in _open(params['jaxpr'])[0].eqns)
  # Any other inner program (a cond's branches, a loop's body) may hold matmuls.
  inner = [q for p in params.values() for q in (p if isinstance(p, (tuple, list)) else (p,))]
  return not any(isinstance(q, (core.Jaxpr, core.ClosedJaxpr)) for q in inner)


def _nbytes(v) -> int:
  aval = v.aval
  return math.prod(aval.shape) * aval.dtype.itemsize


def _w_reads(jaxpr, roles, subs, need_w) -> collections.Counter:
  """How often W reads each var: its equations, split equations' W parts, its outputs."""
  reads = collections.Counter(jaxpr.outvars[i] for i in need_w if _is_var(jaxpr.outvars[i]))
  for n, eqn in enumerate(jaxpr.eqns):
    if roles[n] == _W:
      reads.update(v for v in eqn.invars if _is_var(v))
    elif roles[n] == _SPLIT:
      reads.update(eqn.invars[i] for i in subs[n].ins_w if _is_var(eqn.invars[i]))
  return reads


def _promote_cheap(jaxpr, roles, subs, live_b, defined_b, need_w) -> set:
  """Moves cheap W equations into B where that makes the cut no larger; the new live_w.

  Backward reachability leaves in W everything only the weight gradients
  need, so B hands W the big inputs of small results: an RMSNorm's output
  gradient and normalised input (two [tokens, d] tensors, fp32) for its
  [d] scale gradient, SwiGLU's gate and up projections for the down
  projection's input. Made in B, the cut holds the result instead (the
  [d] gradient, one [tokens, ff] input), a large share of each
  micro-batch's cut at Llama 3.1 8B's shape. Moves that leave the
  cut's bytes as they are count too, so chains (silu, then the product)
  move together. An equation moves only when B already has its inputs
  (B's values, the invars B reads, consts), so B reads nothing new.
  `roles` and `defined_b` are updated in place.
  """
  available = set(defined_b) | {v for v in jaxpr.invars if v in live_b} | set(jaxpr.constvars)
  reads = _w_reads(jaxpr, roles, subs, need_w)
  moved = True
  while moved:
    moved = False
    for n, eqn in enumerate(jaxpr.eqns):
      ins = [v for v in eqn.invars if _is_var(v)]
      if roles[n] != _W or not _cheap(eqn) or not all(v in available for v in ins):
        continue
      own = collections.Counter(ins)
      freed = sum(_nbytes(v) for v in own if v in defined_b and reads[v] == own[v])
      added = sum(_nbytes(v) for v in eqn.outvars if reads[v])
      if added <= freed:
        roles[n] = _B
        reads.subtract(own)
        available |= set(eqn.outvars)
        defined_b |= set(eqn.outvars)
        moved = True
  return {v for v, count in reads.items() if count > 0}


def _order(jaxpr) -> Callable:
  position = {}
  for n, eqn in enumerate(jaxpr.eqns):
    for k, v in enumerate(eqn.outvars):
      position[v] = (n, k)
  return lambda v: position[v]


def _read(env, v):
  return v.val if isinstance(v, core.Literal) else env[v]


def _bind(eqn, invals):
  # As jax's own eval_jaxpr binds an equation (jax 0.10: no subfuns).
  params = eqn.primitive.get_bind_params(eqn.params)
  if cpu_dots.active():
    name = eqn.primitive.name
    if name in ('jit', 'pjit'):  # its dots are made here too
      return _inline(params['jaxpr'], invals)
    if name == 'dot_general':
      with eqn.ctx.manager:
        return [cpu_dots.dot_general(eqn.primitive, *invals, params)]
  if _casts_to_varying(eqn):
    # A value the executor already holds varying (a cut read back from its
    # pool, typed as the pool) meets the jaxpr's own cast: cast only what is missing.
    (x,) = invals
    have = _varying_axes(jax.typeof(x))
    axes = tuple(a for a in params['axes'] if a not in have)
    if not axes:
      return [x]
    params = dict(params, axes=axes)
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*invals, **params)
  return outs if eqn.primitive.multiple_results else [outs]


def _inline(closed, invals) -> list:
  """A (closed) jaxpr's outputs for `invals`, its equations bound one by one."""
  jaxpr, consts = _open(closed)
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, invals))
  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
  return [_read(env, v) for v in jaxpr.outvars]


def row_major_call(fn: Callable, *args):
  """fn(*args), its matmuls made as cpu_dots.row_major() makes them."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  with cpu_dots.row_major():
    outs = _inline(closed, jax.tree.leaves(args))
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _casts_to_varying(eqn) -> bool:
  """Whether eqn is a cast to varying over manual axes (jax 0.10's pvary, later pcast)."""
  name = eqn.primitive.name
  return name == 'pvary' or (name == 'pcast' and str(eqn.params.get('to', '')).endswith('varying'))


def _env(plan: _Plan, invals: dict[int, Any]) -> dict:
  env = dict(zip(plan.jaxpr.constvars, plan.consts))
  for i, val in invals.items():
    env[plan.jaxpr.invars[i]] = val
  return env


def _run_b(plan: _Plan, invals: dict[int, Any]):
  """Runs the B part: (outputs need_b -> value, cut pytree)."""
  env = _env(plan, invals)
  sub_cuts = {}
  for n, eqn in enumerate(plan.jaxpr.eqns):
    role = plan.roles[n]
    if role == _B:
      outs = _bind(eqn, [_read(env, v) for v in eqn.invars])
      env.update(zip(eqn.outvars, outs))
    elif role == _SPLIT:
      rule = _RULES[eqn.primitive.name]
      outs, sub_cuts[n] = rule.run_b(
        plan.subs[n],
        eqn,
        [_read(env, v) if i in plan.subs[n].ins_b else None for i, v in enumerate(eqn.invars)],
      )
      env.update({eqn.outvars[k]: val for k, val in outs.items()})
  outs = {i: _read(env, plan.jaxpr.outvars[i]) for i in plan.need_b}
  return outs, ([env[v] for v in plan.cuts], sub_cuts)


def _run_w(plan: _Plan, invals: dict[int, Any], cuts, acc=None) -> dict[int, Any]:
  """Runs the W part from its inputs and B's cut: outputs need_w -> value.

  With `acc` (outvar index -> (accumulator, index prefix, combine)), those
  outputs are combined into their accumulators at `prefix` (`combine` 'add',
  or 'max': `_combined`) and the accumulators returned in their place; where
  an output is a scan's stacked per-iteration values (a layer stack's weight
  gradients), each iteration combines its own into the accumulator inside
  the scan, so the stack never exists on its own.
  """
  acc = acc or {}
  env = _env(plan, invals)
  cut_vals, sub_cuts = cuts
  env.update(zip(plan.cuts, cut_vals))
  inside = _accumulated_in_scans(plan, acc)
  for n, eqn in enumerate(plan.jaxpr.eqns):
    role = plan.roles[n]
    if role == _W:
      outs = _bind(eqn, [_read(env, v) for v in eqn.invars])
      env.update(zip(eqn.outvars, outs))
    elif role == _SPLIT:
      rule = _RULES[eqn.primitive.name]
      into = {k: acc[i] for (m, k), i in inside.items() if m == n}
      outs = rule.run_w(
        plan.subs[n],
        eqn,
        [_read(env, v) if i in plan.subs[n].ins_w else None for i, v in enumerate(eqn.invars)],
        sub_cuts[n],
        *((into,) if into else ()),
      )
      env.update({eqn.outvars[k]: val for k, val in outs.items()})
  done = set(inside.values())
  out = {}
  for i in plan.need_w:
    value = _read(env, plan.jaxpr.outvars[i])
    if i in acc and i not in done:
      total, prefix, combine = acc[i]
      value = _combined(total, prefix, value, combine)
    out[i] = value
  return out


def _combined(total, index: tuple, value, combine: str):
  """total with `value` added into total[index] ('add') or taken where larger ('max')."""
  at = total.at[index]
  return (at.max if combine == 'max' else at.add)(value.astype(total.dtype))


def _accumulated_in_scans(plan: _Plan, acc: dict) -> dict[tuple[int, int], int]:
  """(scan equation, its output k) -> outvar index, for accumulated outputs a
  split scan's W stacks and nothing else reads."""
  if not acc:
    return {}
  read = collections.Counter(
    v for n, eqn in enumerate(plan.jaxpr.eqns) if plan.roles[n] != _DEAD for v in eqn.invars
  )
  read.update(plan.jaxpr.outvars)
  found = {}
  for n, eqn in enumerate(plan.jaxpr.eqns):
    if plan.roles[n] != _SPLIT or not isinstance(_RULES[eqn.primitive.name], _Scan):
      continue
    for k in plan.subs[n].extra['yw']:
      var = eqn.outvars[k]
      for i in acc:
        if plan.jaxpr.outvars[i] is var and read[var] == 1:
          found[(n, k)] = i
  return found


# ------------------------------------------------------------------ rules


@dataclasses.dataclass
class _Sub:
  """A split equation's plan: its body plan(s) and which invars each part reads."""

  plans: Any
  ins_b: set[int]
  ins_w: set[int]
  extra: dict = dataclasses.field(default_factory=dict)


def _open(jaxpr) -> tuple[Any, tuple]:
  """(open jaxpr, its consts) of a closed or open jaxpr (jax 0.12's scan holds an open one)."""
  if isinstance(jaxpr, core.ClosedJaxpr):
    return jaxpr.jaxpr, tuple(jaxpr.consts)
  return jaxpr, ()


def _scan_counts(eqn) -> tuple[int, int]:
  """(consts, carries) of a scan equation's operands, which come in the order consts, carries, xs.

  jax 0.10 names the counts (`num_consts`, `num_carry`); jax 0.12 gives the
  operands' flat tree (`ft_in`) of the three groups instead.
  """
  params = eqn.params
  if 'num_consts' in params:
    return params['num_consts'], params['num_carry']
  consts, carry, _ = params['ft_in'].unpack()
  return len(consts), len(carry)


class _Inline:
  """`jit` and `checkpoint`: the inner jaxpr's parts run inline."""

  def analyze(self, eqn, ob, ow):
    jaxpr, consts = _open(eqn.params['jaxpr'])
    plan = _analyze(jaxpr, consts, ob, ow)
    return _Sub(plan, set(plan.b_in), set(plan.w_in)), plan.b_in, plan.w_in

  def run_b(self, sub, eqn, invals):
    return _run_b(sub.plans, {i: invals[i] for i in sub.ins_b})

  def run_w(self, sub, eqn, invals, cuts):
    return _run_w(sub.plans, {i: invals[i] for i in sub.ins_w}, cuts)

  def cut_avals(self, sub, eqn):
    return _cut_avals(sub.plans)


class _Scan:
  """`scan`: a B scan emitting each iteration's cut, then a W scan reading it."""

  def analyze(self, eqn, ob, ow):
    nc, nk = _scan_counts(eqn)
    body, body_consts = _open(eqn.params['jaxpr'])
    kb = {k for k in ob if k < nk}
    yb = {k for k in ob if k >= nk}
    # Carries B needs: those whose results it reads, closed under the body's
    # dependencies (a carry feeding a B carry is B's too).
    while True:
      plan = _analyze(body, body_consts, kb | yb, ())
      more = {i - nc for i in plan.b_in if nc <= i < nc + nk} - kb
      if not more:
        break
      kb |= more
    kw = {k for k in ow if k < nk} - kb
    yw = {k for k in ow if k >= nk}
    while True:
      plan = _analyze(body, body_consts, kb | yb, kw | yw)
      more = {i - nc for i in plan.w_in if nc <= i < nc + nk} - kb - kw
      if not more:
        break
      kw |= more
    consts_b = {i for i in plan.b_in if i < nc}
    consts_w = {i for i in plan.w_in if i < nc}
    xs_b = {i for i in plan.b_in if i >= nc + nk}
    xs_w = {i for i in plan.w_in if i >= nc + nk}
    # B carries W reads inside the body: each iteration's value is cut.
    carries_cut = sorted(i for i in plan.w_in if nc <= i < nc + nk and i - nc in kb)
    ins_b = consts_b | {nc + k for k in kb} | xs_b
    ins_w = consts_w | {nc + k for k in kw} | xs_w
    sub = _Sub(
      plan,
      ins_b,
      ins_w,
      dict(
        kb=sorted(kb),
        yb=sorted(yb),
        kw=sorted(kw),
        yw=sorted(yw),
        consts_b=sorted(consts_b),
        consts_w=sorted(consts_w),
        xs_b=sorted(xs_b),
        xs_w=sorted(xs_w),
        carries_cut=carries_cut,
      ),
    )
    return sub, ins_b, ins_w

  def run_b(self, sub, eqn, invals):
    x, plan = sub.extra, sub.plans
    nc = _scan_counts(eqn)[0]
    consts = {i: invals[i] for i in x['consts_b']}

    def body(carry, xs):
      vals = dict(consts)
      vals.update({nc + k: c for k, c in zip(x['kb'], carry)})
      vals.update(zip(x['xs_b'], xs))
      outs, cuts = _run_b(plan, vals)
      return (
        [outs[k] for k in x['kb']],
        ([outs[y] for y in x['yb']], cuts, [vals[i] for i in x['carries_cut']]),
      )

    carry, (ys, cuts, carried) = jax.lax.scan(
      body,
      [invals[nc + k] for k in x['kb']],
      [invals[i] for i in x['xs_b']],
      length=eqn.params['length'],
      reverse=eqn.params['reverse'],
      unroll=eqn.params['unroll'],
    )
    outs = dict(zip(x['kb'], carry))
    outs.update(zip(x['yb'], ys))
    return outs, (cuts, carried)

  def run_w(self, sub, eqn, invals, cuts, acc=None):
    """The W scan; `acc` (output k -> (accumulator, prefix, combine)): those
    stacked outputs are combined into accumulator[prefix + (iteration,)] as
    they are made."""
    x, plan = sub.extra, sub.plans
    nc = _scan_counts(eqn)[0]
    consts = {i: invals[i] for i in x['consts_w']}
    acc = acc or {}
    into = sorted(acc)
    stacked = [y for y in x['yw'] if y not in acc]

    def body(carry, xs):
      own_carry, totals = carry
      index, own, (cut, carried) = xs
      vals = dict(consts)
      vals.update({nc + k: c for k, c in zip(x['kw'], own_carry)})
      vals.update(zip(x['xs_w'], own))
      vals.update(zip(x['carries_cut'], carried))
      outs = _run_w(plan, vals, cut)
      totals = [
        _combined(t, acc[k][1] + (index,), outs[k], acc[k][2]) for k, t in zip(into, totals)
      ]
      return ([outs[k] for k in x['kw']], totals), [outs[y] for y in stacked]

    length = eqn.params['length']
    (carry, totals), ys = jax.lax.scan(
      body,
      ([invals[nc + k] for k in x['kw']], [acc[k][0] for k in into]),
      # The iteration's position in the stack (a reversed scan counts down).
      (jnp.arange(length), [invals[i] for i in x['xs_w']], cuts),
      length=length,
      reverse=eqn.params['reverse'],
      unroll=eqn.params['unroll'],
    )
    outs = dict(zip(x['kw'], carry))
    outs.update(zip(stacked, ys))
    outs.update(zip(into, totals))
    return outs

  def cut_avals(self, sub, eqn):
    """Each iteration's cut, stacked `length` deep as the B scan emits it."""
    length = eqn.params['length']
    vma = lambda a: {'vma': frozenset(_varying_axes(a))} if _varying_axes(a) else {}
    stack = lambda a: jax.core.ShapedArray((length,) + a.shape, a.dtype, **vma(a))
    plan = sub.plans
    carried = [plan.jaxpr.invars[i].aval for i in sub.extra['carries_cut']]
    return jax.tree.map(
      stack, (_cut_avals(plan), carried), is_leaf=lambda a: isinstance(a, jax.core.ShapedArray)
    )


def _varying_axes(aval) -> tuple:
  """The manual axes a value varies over (jax 0.10: `vma` or `manual_axis_type`)."""
  varying = getattr(aval, 'vma', None)
  if varying is None and hasattr(aval, 'manual_axis_type'):
    varying = aval.manual_axis_type.varying
  return tuple(varying or ())


def _zeros(aval):
  z = jnp.zeros(aval.shape, aval.dtype)
  if _varying_axes(aval):
    z = jax.lax.pcast(z, _varying_axes(aval), to='varying')
  return z


def _cut_avals(plan: _Plan):
  """The abstract values of a plan's cut pytree."""
  avals = [v.aval for v in plan.cuts]
  subs = {}
  for n, role in enumerate(plan.roles):
    if role == _SPLIT:
      eqn = plan.jaxpr.eqns[n]
      subs[n] = _RULES[eqn.primitive.name].cut_avals(plan.subs[n], eqn)
  return avals, subs


class _Cond:
  """`cond`: a B switch returning every branch's cut (zeros for the others)."""

  def analyze(self, eqn, ob, ow):
    plans = [_analyze(*_open(br), ob, ow) for br in eqn.params['branches']]
    ins_b = {0} | {1 + i for p in plans for i in p.b_in}
    ins_w = {0} | {1 + i for p in plans for i in p.w_in}
    return _Sub(plans, ins_b, ins_w), ins_b, ins_w

  def run_b(self, sub, eqn, invals):
    plans = sub.plans
    ops = {i - 1: invals[i] for i in sub.ins_b if i > 0}
    cut_avals = [_cut_avals(p) for p in plans]
    need = plans[0].need_b

    def branch(b):
      def fn(ops):
        outs, cuts = _run_b(plans[b], {i: ops[i] for i in plans[b].b_in})
        all_cuts = [
          cuts if c == b else jax.tree.map(_zeros, cut_avals[c]) for c in range(len(plans))
        ]
        return [outs[i] for i in need], all_cuts

      return fn

    outs, cuts = jax.lax.switch(invals[0], [branch(b) for b in range(len(plans))], ops)
    return dict(zip(need, outs)), cuts

  def run_w(self, sub, eqn, invals, cuts):
    plans = sub.plans
    ops = {i - 1: invals[i] for i in sub.ins_w if i > 0}
    need = plans[0].need_w

    def branch(b):
      def fn(ops, cuts):
        outs = _run_w(plans[b], {i: ops[i] for i in plans[b].w_in}, cuts[b])
        return [outs[i] for i in need]

      return fn

    outs = jax.lax.switch(invals[0], [branch(b) for b in range(len(plans))], ops, cuts)
    return dict(zip(need, outs))

  def cut_avals(self, sub, eqn):
    return [_cut_avals(p) for p in sub.plans]


_RULES = {
  'jit': _Inline(),
  'pjit': _Inline(),
  'checkpoint': _Inline(),
  'remat2': _Inline(),
  'scan': _Scan(),
  'cond': _Cond(),
}


class SplitBackward:
  """A backward function bwd(residuals, g) -> (weight grads, input grad), split.

  b(residuals, g) -> (input grad, cut) and w(residuals, cut) -> weight grads
  together compute bwd's outputs, each equation once. `cut` is a pytree of
  arrays whose structure is fixed at construction (`cut_shapes`).
  """

  def __init__(self, bwd: Callable, residuals: list, g, row_major_dots: bool = False):
    self._row_major = row_major_dots  # cpu_dots.row_major() in b and w
    closed, out_shape = jax.make_jaxpr(bwd, return_shape=True)(residuals, g)
    self._out_tree = jax.tree.structure(out_shape)
    n_out = len(closed.jaxpr.outvars)
    self._n_res = len(residuals)
    dx_index = n_out - 1  # bwd returns (weight grads, input grad): dx is last
    self._plan = _analyze(closed.jaxpr, closed.consts, {dx_index}, set(range(dx_index)))
    self._dx = dx_index
    self._g_in_w = self._n_res in self._plan.w_in
    self.cut_shapes = jax.eval_shape(lambda r, g: self.b(r, g)[1], residuals, g)

  def b(self, residuals, g):
    invals = {i: residuals[i] for i in self._plan.b_in if i < self._n_res}
    if self._n_res in self._plan.b_in:
      invals[self._n_res] = g
    with cpu_dots.row_major(self._row_major):
      outs, cuts = _run_b(self._plan, invals)
    return outs[self._dx], (g if self._g_in_w else None, cuts)

  def w(self, residuals, cut, acc=None, maxed=None):
    """The weight gradients; with acc = (gradient tree, index), added into
    the tree at `index` (its leaves are stacks of the weight gradients' shape
    behind the index's dimensions) and the tree returned instead. `maxed`:
    per leaf of the tree, whether it keeps the larger of its value and the
    gradient instead of their sum (None: none does)."""
    g, cuts = cut
    invals = {i: residuals[i] for i in self._plan.w_in if i < self._n_res}
    if self._g_in_w:
      invals[self._n_res] = g
    totals = None
    if acc is not None:
      tree, index = acc
      prefix = tuple(index) if isinstance(index, tuple) else (index,)
      totals = jax.tree.leaves(tree)
      maxed = maxed or [False] * len(totals)
      acc = {i: (t, prefix, 'max' if m else 'add') for i, (t, m) in enumerate(zip(totals, maxed))}
    with cpu_dots.row_major(self._row_major):
      outs = _run_w(self._plan, invals, cuts, acc)
    leaves = [outs[i] for i in range(self._dx)]
    if totals is not None:
      return jax.tree.unflatten(jax.tree.structure(tree), leaves)
    return jax.tree.unflatten(self._out_tree, leaves + [None])[0]
