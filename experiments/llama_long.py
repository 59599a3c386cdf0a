"""A long-context Llama: 32,768 positions a row, the sequence split over 8 context ranks.

llama_tiny's width (d=128, 8 query heads over 2 K/V heads) at 32k positions
on the Python standard library's bytes. One row's attention scores would be
8 x 32k x 32k fp32 values (32 GiB) on one device; with context=8 and ring
attention each device holds its 4k positions and scores one block of 4k keys
at a time, 512 keys per tile (context.KEY_TILE; load-balanced: rank i holds
chunks i and 15-i of 16). Three steps (the loss falls by the third) and two
evaluations take minutes on 8 forced CPU devices, about two a step here:

  python -m triax train --config=experiments/llama_long.py --workdir=runs/llama_long --cpu_devices=8

ARG is `key=value,...`: `seq=N` positions, `context=C` ranks (data takes the
other devices), `kind=allgather|ring`, `layers=N`, `steps=N`, `smoke` (1k
positions, seconds; tests). docs/bench_long_context.md measures what it costs.
"""

from triax import config


def get_config(arg=None):
  args = config.parse_arg(arg, smoke=False, steps=3, seq=32768, context=8, kind='ring', layers=2)
  c = config.defaults()
  c.mesh.data, c.mesh.context, c.mesh.tensor, c.mesh.pipe = -1, args['context'], 1, 1
  c.model.family = 'llama'
  c.model.context_attention = args['kind']
  c.model.num_layers = args['layers']
  c.model.d_model = 128
  c.model.num_heads = 8
  c.model.num_kv_heads = 2
  c.model.d_ff = 344
  c.model.seq_len = 1024 if args['smoke'] else args['seq']
  c.model.rope_theta = 500000.0  # Llama 3's base: long wavelengths for long windows
  c.model.remat = 'full'  # one layer's activations at a time; the ring keeps only its inputs
  c.model.loss_chunk = 1024  # fp32 logits for 1k positions at a time
  c.train.steps = 2 if args['smoke'] else args['steps']
  c.train.global_batch_size = 8 // args['context'] if args['context'] <= 8 else 1
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 1
  c.train.eval_every = c.train.steps  # one evaluation, at the end
  c.train.eval_batches = 1
  c.train.log_every = 1
  c.checkpoint.every_steps = 0
  return c
