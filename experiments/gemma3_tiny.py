"""A small byte-level Gemma 3 on the Python standard library's source, 8 devices.

llama_tiny's run with the Gemma 3 family: six layers, five local to one global
(model.sliding_window_pattern=6) with a window a quarter of the sequence, the
local layers rotating with base 10000 and the global one with 1000000, pre- and
post-norms of (1 + weight), a GeGLU MLP, q/k norms, the embedding scaled by
sqrt(d_model) and tied to the output layer. data=2 x tensor=2 x pipe=2 with
the interleaved 1F1B schedule (v=3 chunks of one layer per device: the chunks
start all over the pattern), on 8 forced CPU devices:

  python -m triax train --config=experiments/gemma3_tiny.py --workdir=runs/gemma3_tiny --cpu_devices=8

ARG is `key=value,...`: `smoke` shrinks everything to a seconds-long run
(tests), `steps=N` changes the length, e.g. --config=experiments/gemma3_tiny.py:smoke
"""

import os

from triax import config

# The run this one repeats with the Gemma 3 family: mesh, training, smoke lengths.
LLAMA_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama_tiny.py')


def get_config(arg=None):
  c = config.from_file(LLAMA_TINY, arg)
  c.model.family = 'gemma3'
  # Gemma 3's 5:1 of local to global layers, one chunk of one layer each.
  c.model.num_layers = 6
  c.model.sliding_window_pattern = 6
  c.pipeline.virtual_stages = 3
  # A quarter of the sequence: the local layers see 32 of 128 positions (8 of 32 in smoke).
  c.model.sliding_window = c.model.seq_len // 4
  # Gemma 3's bases: the global layers' (model.rope_theta) and the local ones'.
  c.model.rope_theta = 1_000_000.0
  c.model.rope_local_theta = 10_000.0
  # Gemma 3's RMSNorm epsilon; its attention scale 1/sqrt(head_dim) (query_pre_attn_scalar 0).
  c.model.norm_eps = 1e-6
  return c
