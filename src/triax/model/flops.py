"""FLOPs of one optimizer step, model and hardware, and peak FLOP/s for MFU.

Conventions (Megatron-LM's, Narayanan et al. SC'21, and PaLM's MFU):
  * a matmul of [m, k] by [k, n] is 2mkn FLOPs; norms, softmax, rotary and activations are
    not counted; the embedding lookup is 0 FLOPs;
  * causal attention counts the full s x s score square (4 s^2 h per layer forward);
  * the backward costs twice the forward, so training is three forwards;
  * model FLOPs count only that, so MFU does not depend on remat; hardware FLOPs add what
    remat recomputes (full: each layer's forward; dots: the attention core; attention:
    Q K^T only).

Each family's `forward_flops()` gives one sequence's forward from its own shapes (a mixture
of experts counts its active parameters). Derivations and Megatron's eq. 3:
docs/design/models.md."""

from __future__ import annotations

# Dense bf16 peak FLOP/s per device, by substring of jax's device_kind.
# Sources: vendor data sheets (dense, no sparsity). MFU's denominator under
# model.fp8 too, so FP8 and bf16 runs compare on one scale
# (docs/design/planner_costs.md, Cluster specs).
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

# What each remat policy recomputes in the backward: the share of each part of
# forward_flops() (the attention core's two matmuls count alike).
_RECOMPUTED = {
  'none': {},
  'attention': {'layer_attention': 0.5},
  'dots': {'layer_attention': 1.0},
  'full': {'layer_matmul': 1.0, 'layer_attention': 1.0},
}


def step_flops(model, batch: int) -> dict[str, float]:
  """{'model': ..., 'hardware': ...} FLOPs of one optimizer step on `batch` sequences.

  `model` is a family model (its spec's num_layers and remat are read).
  """
  fwd = model.forward_flops()
  layers = model.spec.num_layers
  forward = layers * (fwd['layer_matmul'] + fwd['layer_attention']) + fwd['head']
  recomputed = layers * sum(fwd[k] * x for k, x in _RECOMPUTED[model.spec.remat].items())
  return {'model': 3.0 * batch * forward, 'hardware': batch * (3.0 * forward + recomputed)}


def weight_matmul_flops(model, batch: int) -> float:
  """Of `step_flops`' hardware FLOPs, the layers' weight matmuls' (what
  model.fp8 runs in FP8): forward, both backward GEMMs, and what remat
  recomputes of them; not the attention core's or the head's."""
  recomputed = _RECOMPUTED[model.spec.remat].get('layer_matmul', 0.0)
  return batch * model.spec.num_layers * model.forward_flops()['layer_matmul'] * (3.0 + recomputed)


def peak_flops(device_kind: str, configured: float = 0.0) -> float | None:
  """Peak FLOP/s of one device: the configured value, else a known kind, else None."""
  if configured > 0:
    return configured
  for name, flops in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return flops
  return None
