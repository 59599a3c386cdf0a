"""A Llama 3.2 1B-shaped model for one GPU: `scripts/gpu_bench.sh --config=llama_1b`.

Llama 3.2 1B's shape: d_model 2048, 16 layers, 32 query heads and 8 K/V heads
(head_dim 64), SwiGLU 8192, vocabulary 128256 with tied embeddings, RoPE base
500000 with Llama 3's x32 scaling from 8192 positions; 1.24e9 parameters.
Trained here on the byte corpus (token ids < 256; the vocabulary is kept
for its cost: the output layer is a fifth of the FLOPs; the ids past the
bytes' 256 are padding, model.vocab_used, masked out of the loss), 8 sequences x 2048
tokens per step (1.35e14 model FLOPs), bf16 compute with fp32 parameters
and Adam state (20 GB), the cross-entropy 256 positions at a time
(model.loss_chunk), no rematerialisation (recomputation is work MFU does
not count), cuDNN fused attention. pipe = data = tensor = 1: one device.

  scripts/gpu_bench.sh --config=llama_1b     # or:
  python -m triax train --config=experiments/llama_1b.py --workdir=runs/llama_1b --config.train.steps=40

ARG is `key=value,...`:
  attention=cudnn|xla|splash  the attention kernel (default cudnn: GPU only; splash: TPU only)
  batch=N              sequences per step (default 8)
  remat=none|attention|dots|full
  pipe=P               P pipeline stages with min(batch, 4P) micro-batches (gpt_1b's)
  smoke                a tiny model of the same shape family that runs on one CPU
                       device in seconds (scripts/gpu_bench.sh --smoke, tests)
"""

import os

from triax import config

# The benchmark this one repeats with a Llama: one device, bf16 compute with fp32
# parameters and Adam state, its steps, warmup, evaluation and checkpoint cadence.
GPT_1B = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt_1b.py')


def get_config(arg=None):
  args = config.parse_arg(
    arg, smoke=False, attention='cudnn', batch=8, remat='none', steps=40, pipe=1
  )
  c = config.from_file(GPT_1B, arg)
  c.model.family = 'llama'
  c.model.num_layers = 16
  c.model.d_model = 2048
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.d_ff = 8192
  c.model.vocab_size = 128256
  c.model.vocab_used = 256  # the byte corpus's ids; the rest is padding, masked out of the loss
  c.model.rope_theta = 500000.0
  c.model.rope_scaling.factor = 32.0
  c.model.rope_scaling.low_freq_factor = 1.0
  c.model.rope_scaling.high_freq_factor = 4.0
  c.model.rope_scaling.original_max_position_embeddings = 8192
  c.model.tie_embeddings = True
  # 256 positions at a time: the fp32 logits of 8 x 2048 x 128256 would be 8.4 GB, and the
  # loss's one-hot and gradient as much again each; chunked, an eighth of that.
  c.model.loss_chunk = 256
  if args['smoke']:  # gpt_1b's smoke lengths, batch and XLA attention, with a small Llama
    c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.num_kv_heads = 2, 64, 4, 2
    c.model.d_ff, c.model.seq_len, c.model.vocab_size = 172, 64, 1024
    c.model.loss_chunk = 16
  else:
    c.train.global_batch_size = args['batch']  # 8 by default, where gpt_1b takes 16
  c.pipeline.microbatches = config.load_module(GPT_1B).microbatches(
    c.train.global_batch_size, c.mesh.pipe
  )
  return c
