"""A small byte-level Mixtral on the Python standard library's source, 8 devices.

llama_tiny's model with each MLP a mixture of 8 SwiGLU experts, 2 per token
(top-2, renormalised: Mixtral's routing), dropless dispatch (grouped matmuls
over tokens sorted by expert). Each expert is half llama_tiny's MLP wide, so
the parameters a token uses are llama_tiny's (plus the router), and the model
holds 4x its MLP parameters. data=4 x tensor=2, no pipeline, each expert's
hidden units split over tensor as Llama's MLP, and the experts split over 2
of the 4 data-parallel devices (mesh.expert=2: 4 experts per device, tokens
sent to them by all-to-all):

  python -m triax train --config=experiments/mixtral_tiny.py --workdir=runs/mixtral_tiny --cpu_devices=8

Pipelined, the load-balancing loss is taken per micro-batch (Megatron's;
model/mixtral.py says why), e.g. data=2 x tensor=2 x pipe=2 with 4 micro-batches:

  python -m triax train --config=experiments/mixtral_tiny.py --workdir=runs/mixtral_pipe \
    --cpu_devices=8 --config.mesh.data=2 --config.mesh.pipe=2 \
    --config.pipeline.microbatches=4 --config.model.router_aux_loss_scope=microbatch

ARG is `key=value,...`: `smoke` shrinks everything to a seconds-long run
(tests), `steps=N` changes the length, e.g. --config=experiments/mixtral_tiny.py:smoke
"""

import os

from triax import config

# The run this one repeats with a mixture of experts: model, training, smoke lengths.
LLAMA_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llama_tiny.py')


def get_config(arg=None):
  c = config.from_file(LLAMA_TINY, arg)
  c.model.family = 'mixtral'
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = 4, 2, 1
  c.mesh.expert = 2
  c.pipeline.schedule = '1f1b'
  c.pipeline.virtual_stages = 1
  c.pipeline.microbatches = 1
  c.model.num_experts = 8
  c.model.experts_per_token = 2
  # Two experts of half llama_tiny's width: a token's MLP FLOPs and parameters are its.
  c.model.d_ff //= 2
  return c
