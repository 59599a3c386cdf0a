"""A small byte-level Qwen3 on the Python standard library's source, 8 devices.

llama_tiny's run with Qwen3's attention: each head's q and k RMS-normalised
before the rotation (model.qk_norm), heads twice as wide as d_model / heads
(model.head_dim, as Qwen3's are), tied embeddings (Qwen3's small sizes),
grouped-query attention with 2 K/V heads for 8 query heads. data=2 x
tensor=2 x pipe=2 with the interleaved 1F1B schedule (v=2 chunks per
device), on 8 forced CPU devices:

  python -m triax train --config=experiments/qwen3_tiny.py --workdir=runs/qwen3_tiny --cpu_devices=8

ARG is `key=value,...`: `smoke` shrinks everything to a seconds-long run
(tests), `steps=N` changes the length, e.g. --config=experiments/qwen3_tiny.py:smoke
"""

import os

from triax import config

# The run this one repeats with Qwen3's attention: mesh, schedule, training, smoke lengths.
LLAMA_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama_tiny.py')


def get_config(arg=None):
  c = qwen3_attention(config.from_file(LLAMA_TINY, arg))
  c.model.tie_embeddings = True  # Qwen3's small sizes tie them
  return c


def qwen3_attention(c):
  """`c` with Qwen3's attention (qwen3_moe_tiny.py's too)."""
  c.model.qk_norm = True
  # Twice d_model / num_heads: Qwen3's heads are wider than the residual stream's share.
  c.model.head_dim = 2 * c.model.d_model // c.model.num_heads
  # Qwen3's RMSNorm epsilon.
  c.model.norm_eps = 1e-6
  return c
