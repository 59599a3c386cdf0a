"""A Llama 3.1 8B-shaped model, for compiles against TPU slices and for multi-device runs.

Llama 3.1 8B's shape: d_model 4096, 32 layers, 32 query heads and 8 K/V
heads (head_dim 128), SwiGLU 14336, vocabulary 128256 (untied), RoPE base
500000 with Llama 3.1's x8 scaling from 8192 positions; 8.03e9 parameters.
Everything else is llama_1b's: the byte corpus (ids past 256 are padding,
masked out of the loss), 8 sequences x 2048 tokens per step, bf16 compute
with fp32 parameters and Adam state (128 GB: this is a model for a slice,
not one device), the cross-entropy 256 positions at a time.

  python -m triax train --config=experiments/llama_8b.py:attention=splash,remat=full \
      --compile_only --topology=v5p:2x2x2 --workdir=runs/llama_8b_v5p16 \
      --config.mesh.tensor=4 --config.mesh.pipe=2 --config.mesh.data=1

ARG is llama_1b's (`attention=`, `batch=`, `remat=`, `pipe=`, `smoke`).
"""

import os

from triax import config

LLAMA_1B = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama_1b.py')


def get_config(arg=None):
  args = config.parse_arg(
    arg, smoke=False, attention='cudnn', batch=8, remat='none', steps=40, pipe=1
  )
  c = config.from_file(LLAMA_1B, arg)
  if args['smoke']:  # llama_1b's smoke model: the shape family is the same
    return c
  c.model.num_layers = 32
  c.model.d_model = 4096
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.d_ff = 14336
  c.model.rope_scaling.factor = 8.0
  c.model.tie_embeddings = False
  return c
