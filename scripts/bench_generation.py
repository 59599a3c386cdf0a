"""Tokens per second of generation with the K/V cache against the cache-less
loop, at 200 new tokens: writes docs/bench_generation.md.

    .venv/bin/python scripts/bench_generation.py [--out=docs/bench_generation.md]

A Llama of random weights (4 layers, d_model 256, 8 query heads, 2 K/V
heads, seq_len 256) on one CPU device, greedy, a 16-token prompt (and a
batch of 8 such prompts with the cache); each case is compiled and run
once, then timed as the median of 3 runs. Both loops are measured in the
same process, minutes apart at most, so their ratio is the result (absolute
times on this shared 2-core machine are noisy). A benchmark, not a test:
tests/test_sample.py checks the cached tokens are the cache-less ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import bench_harness  # noqa: F401  (src/ on sys.path)
import jax
import numpy as np

from triax import config as config_lib
from triax.model import generation, registry

NEW_TOKENS, PROMPT = 200, 16


def _model():
  m = config_lib.defaults().model
  m.update(
    family='llama', num_layers=4, d_model=256, num_heads=8, num_kv_heads=2, d_ff=768, seq_len=256
  )
  return registry.build(registry.spec_from_config(m))


def _time(fn, runs=3):
  fn()  # compile and warm
  times = []
  for _ in range(runs):
    started = time.perf_counter()
    fn()
    times.append(time.perf_counter() - started)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join('docs', 'bench_generation.md'))
  args = parser.parse_args()
  model = _model()
  params = model.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 256, PROMPT).tolist()
  batch = [rng.integers(0, 256, PROMPT).tolist() for _ in range(8)]
  greedy = generation.Sampling(max_new_tokens=NEW_TOKENS, temperature=0.0)
  cases = {
    'cache-less loop, 1 prompt': lambda: generation.generate(
      model, params, prompt, greedy, cache=False
    ),
    'K/V cache, 1 prompt': lambda: generation.generate(model, params, prompt, greedy),
    'K/V cache, 8 prompts': lambda: generation.generate(model, params, batch, greedy),
  }
  same = (
    generation.generate(model, params, prompt, greedy).tolist()
    == generation.generate(model, params, prompt, greedy, cache=False).tolist()
  )
  rows, base = [], None
  for name, fn in cases.items():
    seconds = _time(fn)
    tokens = NEW_TOKENS * (8 if '8 prompts' in name else 1)
    base = base or seconds
    speed = (tokens / seconds) / (NEW_TOKENS / base)
    rows.append(f'| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {speed:.1f}x |')
    print(rows[-1], flush=True)
  text = '\n'.join(
    [
      '# Generation: K/V cache against the cache-less loop',
      '',
      'Written by `scripts/bench_generation.py` (see its docstring for the setup):',
      f'{NEW_TOKENS} new tokens after a {PROMPT}-token prompt, greedy, a 4-layer Llama',
      '(d_model 256, 8 query / 2 K/V heads, seq_len 256) on one CPU device of this',
      f'2-core machine, jax {jax.__version__}. Ratios are within one run.',
      '',
      '| loop | seconds (median of 3) | tokens/s | tokens/s against the cache-less loop |',
      '|---|---|---|---|',
      *rows,
      '',
      f'Cached greedy tokens equal the cache-less ones: {same} (the test suite checks it',
      'for GPT and Llama, one prompt and a batch).',
      '',
    ]
  )
  with open(args.out, 'w') as f:
    f.write(text)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
