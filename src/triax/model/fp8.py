"""FP8 weight matmuls (model.fp8=tensorwise): current scaling, one scale per tensor.

`einsum` is what common.matmul runs for a weight matmul when the spec says
fp8: both operands quantized to E4M3 with a scale from the tensor's own amax
this step, the product taken on the FP8 operands (`preferred_element_type`
the compute dtype, so XLA:GPU emits cuBLASLt's FP8 GEMM), the two scales
applied to the output. Its backward quantizes the cotangent to E5M2 (the
range gradients need) for both GEMMs, dx = g w^T and dw = x^T g, each again
FP8 x FP8. The weights, their gradients and the optimizer stay in
param_dtype; only the GEMMs' operands are FP8. Quantizing and dequantizing
are flax's (`flax.linen.fp8_ops`); the scales are powers of two, so
dividing by one and multiplying back are exact in any dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

# Forward operands keep precision (3 mantissa bits, max 448); gradients range (2 bits, max 57344).
FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2


def einsum(equation: str, x, w, dtype):
  """einsum(equation, x, w) with FP8 operands, in `dtype`; gradients in x's and w's dtypes.

  `equation` is a weight matmul's ('bsd,dnk->bsnk'): every label in exactly
  two of x, w and the output, so both backward GEMMs are einsums too. The
  backward keeps x and w as they arrive and quantizes them again (the same
  bytes: the scale depends on the tensor only), rather than keep FP8 copies:
  as common.recast keeps w rather than its cast."""
  return _einsum(equation, jnp.dtype(dtype), x, w)


def quantize(t, q_dtype):
  """(t / scale in q_dtype, scale): scale (fp32) the smallest power of two
  that brings max|t| within q_dtype's range; 1 where t is all zero or its
  amax is not finite (a NaN stays one, for the bad-step guard to see)."""
  fp8_max = fp8_ops.get_fp8_max(q_dtype, jnp.float32)
  amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
  scale = fp8_ops.compute_scale(amax, jnp.ones((), jnp.float32), fp8_max)
  mantissa, exponent = jnp.frexp(scale)
  # scale = mantissa * 2^exponent, mantissa in [0.5, 1): 0.5 is already a power of two.
  scale = jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))
  return fp8_ops.quantize(t, q_dtype, scale, t.dtype), scale


@functools.cache
def transposed(equation: str) -> tuple[str, str]:
  """(dx's equation (g, w -> x), dw's equation (x, g -> w)) of a weight matmul's `equation`."""
  ins, out = equation.split('->')
  xs, ws = ins.split(',')
  for label in set(xs + ws + out):
    if sum(label in term for term in (xs, ws, out)) != 2:
      raise ValueError(f'{equation}: {label!r} must be in exactly two of its three terms')
  return f'{out},{ws}->{xs}', f'{xs},{out}->{ws}'


def _scaled(equation: str, a, b, scale, dtype):
  """einsum of FP8 a and b in `dtype`, times `scale` (their scales' product)."""
  out = jnp.einsum(equation, a, b, preferred_element_type=dtype)
  return out * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum(equation: str, dtype, x, w):
  (xq, sx), (wq, sw) = quantize(x, FORWARD), quantize(w, FORWARD)
  return _scaled(equation, xq, wq, sx * sw, dtype)


def _einsum_fwd(equation: str, dtype, x, w):
  return _einsum(equation, dtype, x, w), (x, w)


def _einsum_bwd(equation: str, dtype, residuals, g):
  x, w = residuals
  (xq, sx), (wq, sw), (gq, sg) = quantize(x, FORWARD), quantize(w, FORWARD), quantize(g, BACKWARD)
  dx_equation, dw_equation = transposed(equation)
  dx = _scaled(dx_equation, gq, wq, sg * sw, dtype)
  dw = _scaled(dw_equation, xq, gq, sx * sg, dtype)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)
