"""Each pipeline schedule x micro-batch count at pipe=4 (data=2, tensor=1), short runs.

Schedules: gpipe, 1f1b, interleaved_1f1b (v=2 chunks per device), bpipe,
zb_h1; micro-batches m in {4, 8, 16}. The model is a narrower, shorter-context
version of experiments/gpt_tiny.py (8 layers so interleaving gets 4 x 2 equal
chunks, d_model 64, seq_len 64), trained for 30 steps, so the fifteen points
finish in well under 15 minutes on a 2-core machine. Every point trains the
same model on the same batches: losses agree across schedules, and the
columns to compare are time per step and peak memory per device.

  python -m triax sweep --config=experiments/schedule_sweep.py --workdir=runs/schedule_sweep \
      --parallel=1 --readme=README.md

ARG: `steps=N` changes the length, e.g. --config=experiments/schedule_sweep.py:steps=10
"""

import os

from triax import config

# Builds on the default experiment beside this file.
_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt_tiny.py')

SCHEDULES = ('gpipe', '1f1b', 'interleaved_1f1b', 'bpipe', 'zb_h1')
MICROBATCHES = (4, 8, 16)


def get_config(arg=None):
  args = config.parse_arg(arg, steps=30)
  c = config.from_file(_BASE, f'steps={args["steps"]}')
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = 2, 1, 4
  c.model.num_layers = 8
  c.model.d_model = 64
  c.model.d_ff = 256
  c.model.seq_len = 64
  c.pipeline.schedule = '1f1b'
  c.pipeline.virtual_stages = 1
  c.pipeline.microbatches = 4
  # 32 rows: 16 micro-batches x 2 data shards of one row each at the most.
  c.train.global_batch_size = 32
  c.train.warmup_steps = 5
  c.train.log_every = 5
  c.train.eval_every = c.train.steps  # evaluate at step 0 and at the end only
  c.checkpoint.every_steps = 0  # only the final checkpoint
  return c


def sweep(add, arg=None):
  del arg  # the same points at any length
  for schedule in SCHEDULES:
    for m in MICROBATCHES:
      add(
        **{
          'pipeline.schedule': schedule,
          'pipeline.microbatches': m,
          'pipeline.virtual_stages': 2 if schedule == 'interleaved_1f1b' else 1,
        }
      )
