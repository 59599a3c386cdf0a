"""Every data x tensor x pipe factorisation of 8 CPU devices, on the tiny GPT.

The model is experiments/gpt_tiny.py's with two changes so that all ten
factorisations are valid and every point trains the same model: 8 heads (so
tensor=8 splits them one per device) and 8 layers (so pipe=8 gets one layer
per stage). pipe > 1 runs 1F1B with 2*pipe micro-batches; pipe = 1 runs one
micro-batch. The table shows the cost of each kind of parallelism for a model
far too small to need any: on CPU devices sharing a few cores, every
collective is overhead. Each point runs 20 steps (about a minute on a
2-core machine, ~12 minutes for the sweep); losses agree across layouts.

  python -m triax sweep --config=experiments/mesh_sweep.py --workdir=runs/mesh_sweep \
      --parallel=1 --readme=README.md

ARG: `steps=N` changes the length, e.g. --config=experiments/mesh_sweep.py:steps=60
"""

import itertools
import os

from triax import config

# Builds on the default experiment beside this file.
_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt_tiny.py')

_DEVICES = 8


def get_config(arg=None):
  args = config.parse_arg(arg, steps=20)
  c = config.from_file(_BASE, f'steps={args["steps"]}')
  c.model.num_layers = 8
  c.model.num_heads = 8
  c.train.warmup_steps = 5
  c.train.log_every = 5
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = _DEVICES, 1, 1
  c.pipeline.schedule = '1f1b'
  c.pipeline.virtual_stages = 1
  c.pipeline.microbatches = 1
  c.train.eval_every = c.train.steps  # one evaluation at the end (and one at step 0)
  c.checkpoint.every_steps = 0  # only the final checkpoint
  return c


def factorisations(n):
  """(data, tensor, pipe) with data * tensor * pipe = n, data-major."""
  divisors = [d for d in range(1, n + 1) if n % d == 0]
  return [
    (d, t, n // (d * t))
    for d, t in itertools.product(reversed(divisors), repeat=2)
    if n % (d * t) == 0
  ]


def sweep(add, arg=None):
  del arg  # the same points at any length
  for data, tensor, pipe in factorisations(_DEVICES):
    add(
      **{
        'mesh.data': data,
        'mesh.tensor': tensor,
        'mesh.pipe': pipe,
        'pipeline.microbatches': 2 * pipe if pipe > 1 else 1,
      }
    )
