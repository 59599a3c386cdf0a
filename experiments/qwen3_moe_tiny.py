"""A small byte-level Qwen3-MoE on the Python standard library's source, 8 devices.

mixtral_tiny's run with Qwen3's attention: each head's q and k RMS-normalised
before the rotation (model.qk_norm), heads twice as wide as d_model / heads
(model.head_dim); 8 experts, the top 2 of the router's softmax renormalised
(Qwen3-MoE's norm_topk_prob), no shared expert. data=4 x tensor=2 with the
experts split over 2 of the 4 data-parallel devices (mesh.expert=2):

  python -m triax train --config=experiments/qwen3_moe_tiny.py --workdir=runs/qwen3_moe_tiny --cpu_devices=8

ARG is `key=value,...`: `smoke` shrinks everything to a seconds-long run
(tests), `steps=N` changes the length, e.g. --config=experiments/qwen3_moe_tiny.py:smoke
"""

import os

from triax import config

# The run this one repeats with Qwen3's attention (qwen3_tiny.py's): model, mesh, training.
MIXTRAL_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'mixtral_tiny.py')
QWEN3_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'qwen3_tiny.py')


def get_config(arg=None):
  c = config.load_module(QWEN3_TINY).qwen3_attention(config.from_file(MIXTRAL_TINY, arg))
  c.model.norm_topk_prob = True  # Qwen3-MoE renormalises its top-k weights
  return c
