"""model.fp8_metrics: the FP8 weight matmuls' amax, scales and overflow, logged per step.

Each weight-matmul kind (its einsum equation: attention's input and output
projections, the MLP's input and output, MLA's and MTP's projections) gets
the forward's x and w amax and their largest scales (under rowwise, the
scale of the row holding the amax; the other rows' are smaller), maximised
over its calls and layers, as fp8_{kind}_{x,w}_{amax,scale}. Overflow is
the fraction of elements whose |value / scale| exceeds the FP8 format's max
before `quantize` saturates them: fp8_overflow over the forward's E4M3
operands, fp8_grad_overflow over the backward's E5M2 cotangents. Current
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


def record(equation: str, x, w, recipe: str, history=None) -> None:
  """Adds the forward figures of einsum(equation, x, w) under `recipe` to
  the open tape, if any; under delayed, with the scales its site's
  `history` gives (fp8.delayed_scale)."""
  tape = _TAPE.get()
  if tape is None:
    return
  x, w, history = jax.lax.stop_gradient((x, w, history))
  ins, out = equation.split('->')
  figures = {'overflow': jnp.zeros((), jnp.float32), 'elements': jnp.float32(x.size + w.size)}
  for i, (name, t, labels) in enumerate(zip('xw', (x, w), ins.split(','))):
    t_amax = fp8.amax(t, fp8.scaled_axes(labels, out, recipe))
    if history is None:
      scale = fp8.scale_of(t_amax, fp8.FORWARD)
    else:
      scale = fp8.delayed_scale(history[i], t_amax, fp8.FORWARD)
    figures[f'{name}_amax'] = jnp.max(t_amax)
    figures[f'{name}_scale'] = jnp.max(scale)
    figures['overflow'] = figures['overflow'] + fp8.overflow(t, scale, fp8.FORWARD)
  tape.add(equation, figures)


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
