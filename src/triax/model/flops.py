"""Model FLOPs per step (Megatron-LM, Narayanan et al. SC'21, eq. 3) and MFU.

F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) counts forward and backward
(3x the forward) of the matmuls with d_ff = 4h and no recomputation, which
is the convention MFU uses: recomputed FLOPs are not useful work.
"""

from __future__ import annotations

# Dense bf16 peak FLOP/s per device, by substring of jax's device_kind.
# Sources: vendor data sheets (dense, no sparsity).
PEAK_BF16_FLOPS = (
  ('H200', 989e12),
  ('H100', 989e12),
  ('A100', 312e12),
  ('L4', 121e12),
  ('A10', 125e12),
  ('V100', 125e12),
  ('TPU v5p', 459e12),
  ('TPU v5 lite', 197e12),
  ('TPU v5e', 197e12),
  ('TPU v4', 275e12),
  ('TPU v6', 918e12),
)


def megatron_flops_per_step(
  batch: int, seq_len: int, num_layers: int, d_model: int, vocab_size: int
) -> float:
  """Megatron's model FLOPs for one optimizer step on `batch` sequences."""
  b, s, l, h, v = batch, seq_len, num_layers, d_model, vocab_size
  return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def peak_flops(device_kind: str, configured: float = 0.0) -> float | None:
  """Peak FLOP/s of one device: the configured value, else a known kind, else None."""
  if configured > 0:
    return configured
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None
