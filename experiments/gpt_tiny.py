"""A small byte-level GPT on the Python standard library's source, 8 devices.

The default run of `scripts/train.sh`: data=2 x tensor=2 x pipe=2 with the
interleaved 1F1B schedule (v=2 chunks per device), on 8 forced CPU devices:

  python -m triax train --config=experiments/gpt_tiny.py --workdir=runs/gpt_tiny --cpu_devices=8

ARG is `key=value,...`: `smoke` shrinks everything to a seconds-long run
(tests), `steps=N` changes the length, e.g. --config=experiments/gpt_tiny.py:smoke
"""

from triax import config


def get_config(arg=None):
  args = config.parse_arg(arg, smoke=False, steps=300)
  c = config.defaults()
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = 2, 2, 2
  c.pipeline.schedule = 'interleaved_1f1b'
  c.pipeline.virtual_stages = 2
  c.pipeline.microbatches = 4
  c.model.num_layers = 4
  c.model.d_model = 128
  c.model.num_heads = 4
  c.model.d_ff = 512
  c.model.seq_len = 128
  c.train.steps = args['steps']
  c.train.global_batch_size = 32
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 30
  c.train.eval_every = 100
  c.train.log_every = 10
  c.checkpoint.every_steps = 100
  if args['smoke']:
    c.model.d_model, c.model.num_heads, c.model.d_ff, c.model.seq_len = 32, 4, 64, 32
    c.train.global_batch_size = 8
    c.train.steps = 4
    c.train.warmup_steps = 1
    c.train.eval_every = 2
    c.train.eval_batches = 1
    c.train.log_every = 1
    c.checkpoint.every_steps = 2
  return c
