"""A ~1B-parameter byte-level GPT for one GPU: the configuration scripts/gpu_bench.sh trains.

d_model 2048, 20 layers, 16 heads (head_dim 128, what cuDNN's fused
attention wants), d_ff 8192, seq_len 2048, vocabulary 256 (the byte corpus):
1.01e9 parameters, 2.3e14 model FLOPs per step at the default 16 sequences x
2048 tokens (Megatron's formula says 3.1e14: it counts full remat's recomputed
forward, model/flops.py). bf16 compute with fp32 parameters and Adam state
(16 GB), no rematerialisation: 16 sequences' activations (~50 GB by
Megatron's 34*s*b*h bytes per layer, no score matrices with fused attention)
fit an H200's 141 GB, and recomputation is work MFU does not count.
pipe = data = tensor = 1: one device.

  scripts/gpu_bench.sh      # or:
  python -m triax train --config=experiments/gpt_1b.py --workdir=runs/gpt_1b --config.train.steps=40

ARG is `key=value,...`:
  attention=cudnn|xla  the attention kernel (default cudnn: GPU only)
  batch=N              sequences per step (default 16)
  remat=none|attention|dots|full
  pipe=P               P pipeline stages (1F1B), the rest of the devices data-parallel, with
                       min(batch, 4P) micro-batches when P > 1 (default 1: one device)
  smoke                a tiny model of the same shape family that runs on one CPU
                       device in seconds (scripts/gpu_bench.sh --smoke, tests)
"""

from triax import config


def get_config(arg=None):
  args = config.parse_arg(
    arg, smoke=False, attention='cudnn', batch=16, remat='none', steps=40, pipe=1
  )
  c = config.defaults()
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = 1, 1, args['pipe']
  if args['pipe'] > 1:
    c.mesh.data = -1
  c.pipeline.schedule = '1f1b'
  c.pipeline.microbatches = 1  # set from the batch below
  c.pipeline.virtual_stages = 1
  c.model.num_layers = 20
  c.model.d_model = 2048
  c.model.num_heads = 16
  c.model.d_ff = 8192
  c.model.vocab_size = 256
  c.model.seq_len = 2048
  c.model.dtype = 'bfloat16'
  c.model.param_dtype = 'float32'
  c.model.remat = args['remat']
  c.model.attention = args['attention']
  c.train.steps = args['steps']
  c.train.global_batch_size = args['batch']
  c.train.learning_rate = 3e-4
  c.train.warmup_steps = 10
  c.train.log_every = 5
  # A benchmark: evaluate only at the start and the end, on one batch.
  c.train.eval_every = 10_000
  c.train.eval_batches = 1
  c.checkpoint.every_steps = 0  # one checkpoint, at the end
  c.checkpoint.keep = 1
  if args['smoke']:
    c.model.num_layers, c.model.d_model, c.model.num_heads = 2, 64, 4
    c.model.d_ff, c.model.seq_len = 256, 64
    c.model.attention = 'xla'  # cuDNN attention exists only on GPU
    c.train.global_batch_size = 4
    c.train.steps = 6
    c.train.warmup_steps = 1
    c.train.log_every = 1
  c.pipeline.microbatches = microbatches(c.train.global_batch_size, c.mesh.pipe)
  return c


def microbatches(batch: int, pipe: int) -> int:
  """One micro-batch on one stage; with p stages, up to 4p (one sequence each at
  most): enough for 1F1B to bound the in-flight activations (p of m) and keep
  the bubble, (p-1)/(m+p-1), near a sixth."""
  return min(batch, 4 * pipe) if pipe > 1 else 1
