"""A small byte-level Llama on the Python standard library's source, 8 devices.

gpt_tiny's run with the Llama family: RoPE, SwiGLU, RMSNorm, and grouped-query
attention with 2 K/V heads for 8 query heads (fewer K/V heads than heads, as
many as tensor ranks: each rank holds one). data=2 x tensor=2 x pipe=2 with
the interleaved 1F1B schedule (v=2 chunks per device), on 8 forced CPU devices:

  python -m triax train --config=experiments/llama_tiny.py --workdir=runs/llama_tiny --cpu_devices=8

ARG is `key=value,...`: `smoke` shrinks everything to a seconds-long run
(tests), `steps=N` changes the length, e.g. --config=experiments/llama_tiny.py:smoke
"""

import os

from triax import config

# The run this one repeats with the Llama family: mesh, schedule, training, smoke lengths.
GPT_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt_tiny.py')


def get_config(arg=None):
  smoke = config.parse_arg(arg, smoke=False, steps=300)['smoke']
  c = config.from_file(GPT_TINY, arg)
  c.model.family = 'llama'
  c.model.num_heads = 8
  c.model.num_kv_heads = 2
  # SwiGLU's three matrices at 2/3 of 4h keep the MLP's parameters those of a 4h GELU MLP.
  c.model.d_ff = 88 if smoke else 344
  # Llama 2's base: at 128 positions Llama 3's 500000 leaves most pairs nearly unrotated.
  c.model.rope_theta = 10000.0
  return c
