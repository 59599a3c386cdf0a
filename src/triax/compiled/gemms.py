"""XLA:GPU's FP8 GEMMs in an optimised program's text (an XLA dump's
`*gpu_after_optimizations.txt`): how model.fp8's matmuls are run."""

from __future__ import annotations

import re

_CUBLASLT_FP8 = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')
_DOT = re.compile(r'= \S+ dot\((%\S+), (%\S+)\)')


def fp8_gemms(hlo: str) -> dict[str, int]:
  """{'cublaslt': cuBLASLt's FP8 GEMM custom calls, 'triton': dots on two FP8
  operands (those XLA:GPU leaves to its Triton GEMM fusions)}, each as often
  as the text holds it (a loop body's once)."""
  triton = 0
  for block in re.split(r'\n(?=\S)', hlo):  # one computation each
    for a, b in _DOT.findall(block):
      kinds = [re.search(re.escape(op) + r' = (\w+)\[', block) for op in (a, b)]
      triton += all(k and k.group(1).startswith('f8') for k in kinds)
  return {'cublaslt': len(_CUBLASLT_FP8.findall(hlo)), 'triton': triton}
