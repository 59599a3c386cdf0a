"""The Llama that scripts/bench_peers.py times beside MaxText on 8 forced CPU devices.

A shape wide enough that matmuls dominate a step on XLA:CPU (d_model 512,
8 layers: PP 4 with v = 2 needs a layer per chunk), Llama 2's vocabulary and
grouped-query attention (8 heads of 64, 4 K/V heads: one per rank at TP 4),
SwiGLU 1536, 16 sequences x 512 tokens a step (8 micro-batches on each of
2 data replicas under PP 4 x DP 2), bf16 compute with fp32 parameters and
AdamW state, full recomputation (as docs/bench_tpu_compile.md's rows). The
data is the byte corpus: MaxText's synthetic batches cost its step nothing
either, and the step's cost does not depend on the token ids.

  python -m triax train --config=experiments/llama_peers.py:layout=tp2_fsdp4 \
      --workdir=runs/peers --cpu_devices=8

ARG is `key=value,...`:
  layout=NAME   one of LAYOUTS' names (default dp8)
  steps=N       steps to run (default 6; the first two are warm-up)
"""

from triax import config

# name -> mesh and pipeline keys; MaxText's counterparts are scripts/bench_peers.py's.
LAYOUTS = {
  'dp8': {'mesh.data': 8},
  'fsdp8': {'mesh.data': 8, 'mesh.fsdp': True},
  'tp2_fsdp4': {'mesh.data': 4, 'mesh.fsdp': True, 'mesh.tensor': 2},
  'tp4_dp2': {'mesh.data': 2, 'mesh.tensor': 4},
  'pp4_dp2_1f1b': {
    'mesh.data': 2,
    'mesh.pipe': 4,
    'pipeline.microbatches': 8,
    'pipeline.schedule': '1f1b',
  },
  'pp4_dp2_zb_h1': {
    'mesh.data': 2,
    'mesh.pipe': 4,
    'pipeline.microbatches': 8,
    'pipeline.schedule': 'zb_h1',
  },
  'pp4_v2_dp2': {
    'mesh.data': 2,
    'mesh.pipe': 4,
    'pipeline.microbatches': 8,
    'pipeline.schedule': 'interleaved_1f1b',
    'pipeline.virtual_stages': 2,
  },
}


def get_config(arg=None):
  args = config.parse_arg(arg, layout='dp8', steps=6)
  if args['layout'] not in LAYOUTS:
    raise config.ConfigError('layout', f'unknown layout; choose one of {", ".join(LAYOUTS)}')
  c = config.defaults()
  c.model.family = 'llama'
  c.model.num_layers = 8
  c.model.d_model = 512
  c.model.num_heads = 8
  c.model.num_kv_heads = 4
  c.model.d_ff = 1536
  c.model.vocab_size = 8192
  c.model.vocab_used = 256  # the byte corpus's ids; the rest is padding, masked out of the loss
  c.model.seq_len = 512
  c.model.rope_theta = 10000.0
  c.model.dtype = 'bfloat16'
  c.model.param_dtype = 'float32'
  c.model.remat = 'full'
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = 8, 1, 1
  for key, value in LAYOUTS[args['layout']].items():
    section, name = key.split('.')
    c[section][name] = value
  c.train.global_batch_size = 16
  c.train.steps = args['steps']
  c.train.warmup_steps = 1
  c.train.log_every = 1
  # A benchmark: evaluation only at the start and the end, on one batch; one checkpoint, at the end.
  c.train.eval_every = 10_000
  c.train.eval_batches = 1
  c.checkpoint.every_steps = 0
  return c
