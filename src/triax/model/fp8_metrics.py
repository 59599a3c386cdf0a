"""model.fp8_metrics: the FP8 weight matmuls' amax, scales and overflow, logged per step.

Each weight-matmul kind (its einsum equation: attention's input and output
projections, the MLP's input and output, the routed experts' input and
output, MLA's and MTP's projections) gets
the forward's x and w amax and their largest scales (under rowwise, the
scale of the row holding the amax; the other rows' are smaller), maximised
over its calls and layers, as fp8_{kind}_{x,w}_{amax,scale}. Overflow is
the fraction of elements whose |value / scale| exceeds the FP8 format's max
before `quantize` saturates them: fp8_overflow over the forward's E4M3
operands, fp8_grad_overflow over the backward's cotangents (model.fp8_grad's format). Current
scaling makes both 0 by construction (each scale comes from the very tensor
it scales); they turn nonzero when a tensor holds an inf (the scale it
shares falls back to 1: tensorwise, the whole tensor's; rowwise, its row's),
and under delayed scaling (the scale from past steps' amax) when a tensor
outgrows its history: what they are for.

The figures travel as the MoE's do, as the objective's logged aux: a
`recording` tape, opened around the objective, gathers what `record` is
given; the layer scan gives each layer its own tape and returns it as a
per-layer output (`taped`); the backward's counts come out as the gradient
of a probe every FP8 einsum takes (fp8.einsum's `probe`). The pipeline
executor's step does not carry them (config.py refuses fp8_metrics there).
The routed experts' matmuls run inside moe.py's shard_maps: their figures
are taken over the whole tensors there (`record`'s `split`) and leave as
the shard_map's outputs (`with_figures`, `merge`); the probe does not enter
those shard_maps, so fp8_grad_overflow counts the other matmuls' casts only.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from triax.model import fp8

# Short names of the weight matmuls' equations; another equation is named by its letters.
KINDS = {
  'bsd,dnk->bsnk': 'attn_in',
  'bsnk,nkd->bsd': 'attn_out',
  'bsd,df->bsf': 'mlp_in',
  'bsf,fd->bsd': 'mlp_out',
  'bsd,dr->bsr': 'mla_down',
  'bsr,rnk->bsnk': 'mla_up',
  'bse,ed->bsd': 'mtp_proj',
  # The routed experts' (moe.py): capacity's einsums, dropless's grouped matmuls.
  'becd,edf->becf': 'expert_in',
  'becf,efd->becd': 'expert_out',
  'td,edf->tf': 'expert_in',
  'tf,efd->td': 'expert_out',
}


def kind(equation: str) -> str:
  """A weight matmul's short name (KINDS), or its equation's letters."""
  return KINDS.get(equation) or ''.join(c for c in equation if c.isalpha())


# How each forward figure merges over calls and layers.
MAXIMA = ('x_amax', 'w_amax', 'x_scale', 'w_scale')
SUMS = ('overflow', 'elements')


class _Tape:
  """What one recording holds: {equation: {figure: fp32 scalar}} and the backward's probe."""

  def __init__(self, probe):
    self.figures: dict[str, dict[str, jax.Array]] = {}
    self.probe = probe

  def add(self, equation: str, figures: dict) -> None:
    old = self.figures.get(equation)
    self.figures[equation] = figures if old is None else _merged(old, figures)


_TAPE: contextvars.ContextVar[_Tape | None] = contextvars.ContextVar('fp8_tape', default=None)


def _merged(a: dict, b: dict) -> dict:
  return {k: (jnp.maximum if k in MAXIMA else jnp.add)(a[k], b[k]) for k in a}


@contextlib.contextmanager
def recording(probe):
  """A tape for `record` to write to while the block runs (the figures must
  leave the trace they were made in: the objective's aux, a scan's output)."""
  tape = _Tape(probe)
  token = _TAPE.set(tape)
  try:
    yield tape
  finally:
    _TAPE.reset(token)


def active() -> bool:
  return _TAPE.get() is not None


def probe():
  """The open tape's probe for fp8.einsum (None when nothing records)."""
  tape = _TAPE.get()
  return None if tape is None else tape.probe


def record(equation: str, x, w, recipe: str, split=(), history=None) -> None:
  """Adds the forward figures of einsum(equation, x, w) under `recipe` to the
  open tape, if any; under delayed, with the scales its site's `history`
  gives (fp8.delayed_scale). `split`, inside a shard_map: fp8.einsum's (label, mesh
  axes) pairs; each figure is then the whole tensors' (a max or a sum over
  the shards of the axes splitting them), so `with_figures` can return it
  replicated. The routed experts' grouped matmuls record as the einsums
  'td,edf->tf' and 'tf,efd->td': their figures are the same maxima as the
  per-expert scales', w's overflow taken per column across experts."""
  tape = _TAPE.get()
  if tape is None:
    return
  x, w, history = jax.lax.stop_gradient((x, w, history))
  ins, out = equation.split('->')
  figures = {'overflow': jnp.zeros((), jnp.float32), 'elements': jnp.zeros((), jnp.float32)}
  for i, (name, t, labels) in enumerate(zip('xw', (x, w), ins.split(','))):
    axes = fp8.scaled_axes(labels, out, recipe)
    t_amax = fp8.amax(t, axes, fp8.spanned_mesh_axes(labels, axes, split))
    shards = fp8.spanned_mesh_axes(labels, None, split)  # every axis t is split over
    figures[f'{name}_amax'] = _whole(jnp.max(t_amax), jax.lax.pmax, shards)
    if history is None:
      scale = fp8.scale_of(t_amax, fp8.FORWARD)
      # The scale of the row holding the amax: the largest but those of rows of zeros (1).
      figures[f'{name}_scale'] = fp8.scale_of(figures[f'{name}_amax'], fp8.FORWARD)
    else:
      scale = fp8.delayed_scale(history[i], t_amax, fp8.FORWARD)
      figures[f'{name}_scale'] = scale
    overflow = _whole(fp8.overflow(t, scale, fp8.FORWARD), jax.lax.psum, shards)
    figures['overflow'] = figures['overflow'] + overflow
    figures['elements'] = figures['elements'] + _whole(jnp.float32(t.size), jax.lax.psum, shards)
  tape.add(equation, figures)


def _whole(value, op, axes: tuple):
  """op(value, axes) (a pmax or psum over those shards), or value with no axes."""
  return op(value, axes) if axes else value


def taped(layer):
  """layer(p, h) -> (h, out), as (h, (out, its FP8 figures)) recorded on a
  tape of its own (inside a scan's body, whose values cannot leave it but
  as outputs); with no tape open, `layer` itself."""
  if not active():
    return layer

  def run(p, h):
    with recording(probe()) as tape:
      h, out = layer(p, h)
    return h, (out, tape.figures)

  return run


def with_figures(fn):
  """fn(*args) -> (its output, {equation: figures} its FP8 matmuls recorded)
  on a tape of its own (a shard_map's body, whose values leave it only as
  outputs; `record`'s `split` makes them the whole tensors'), the figures
  {} with no tape open; `merge` adds them to the open tape outside."""
  if not active():
    return lambda *args: (fn(*args), {})

  def run(*args):
    with recording(None) as tape:
      result = fn(*args)
    return result, tape.figures

  return run


def merge(figures: dict) -> None:
  """Adds {equation: figures} (`with_figures`') to the open tape, if any."""
  tape = _TAPE.get()
  if tape is not None:
    for equation, f in figures.items():
      tape.add(equation, f)


def add_layers(figures: dict) -> None:
  """Merges a scan's stacked per-layer figures ([layers] each) into the open tape."""
  tape = _TAPE.get()
  for equation, stacked in figures.items():
    tape.add(equation, {k: (jnp.max if k in MAXIMA else jnp.sum)(v) for k, v in stacked.items()})


def value_and_grad(objective):
  """jax.value_and_grad(objective, has_aux=True) whose aux also holds the FP8 figures.

  objective(params, *args) -> (loss, {name: scalar}); the result returns
  ((loss, metrics), grads) with metrics gaining fp8_{kind}_{x,w}_{amax,scale},
  fp8_overflow and fp8_grad_overflow."""

  def with_tape(params, counts, *args):
    with recording(counts) as tape:
      loss, metrics = objective(params, *args)
    return loss, {**metrics, **_forward_figures(tape.figures)}

  def run(params, *args):
    grad = jax.value_and_grad(with_tape, (0, 1), has_aux=True)
    (loss, metrics), (grads, counts) = grad(params, jnp.zeros(2, jnp.float32), *args)
    return (loss, {**metrics, 'fp8_grad_overflow': counts[0] / counts[1]}), grads

  return run


def _forward_figures(figures: dict) -> dict[str, jax.Array]:
  out = {}
  for equation, f in figures.items():
    out.update({f'fp8_{kind(equation)}_{k}': f[k] for k in MAXIMA})
  overflow = sum(f['overflow'] for f in figures.values())
  return {**out, 'fp8_overflow': overflow / sum(f['elements'] for f in figures.values())}
