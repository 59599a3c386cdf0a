"""The loader's throughput against a training step: writes docs/bench_loader.md.

    .venv/bin/python scripts/bench_loader.py [--tokens=100_000_000] [--out=docs/bench_loader.md]

Generates token shards of >= 100M tokens in `triax prepare`'s format (random
ids of a 50,257-id vocabulary, uint16, documents of 100-4,000 tokens, 4
shards), opens them as `data.source=tokens` does, and times:

* host batches: `BatchStream.batch(step)` for all 64 rows at seq 2048
  (grain index shuffle + memory-mapped window reads + stacking), cold
  (pages not yet cached: the first pass over random windows) and warm;
* one data shard's rows (8 of 64 rows, what one of 8 data-parallel processes reads);
* device batches: `training.loop.global_batch` onto the forced CPU devices
  (the host -> device copy included), data=8;

and compares them with the step time of experiments/gpt_1b.py:smoke on one
CPU device (compiled and timed by compiled.measure). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench_harness import force_cpu_devices

force_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from triax import config as config_lib  # noqa: E402
from triax.data import prepare, sources  # noqa: E402
from triax.data.batches import BatchStream  # noqa: E402

SEQ, BATCH, VOCAB = 2048, 64, 50257


def write_shards(out: str, tokens: int, seed: int = 0) -> None:
  """Shards and a manifest as prepare writes them (random ids; the tokenizer record is nominal)."""
  rng = np.random.default_rng(seed)
  dtype = prepare.dtype_for(VOCAB)
  os.makedirs(out, exist_ok=True)
  splits = {}
  for split, total in (('train', tokens), ('val', max(tokens // 100, SEQ * BATCH + 1))):
    writer = prepare.SplitWriter(out, split, dtype, shard_tokens=tokens // 4 + 1)
    written = 0
    while written < total:
      doc = rng.integers(1, VOCAB, int(rng.integers(100, 4000)), dtype=np.int64)
      writer.add(doc, 0)
      written += doc.size + 1
    splits[split] = writer.close()
  request = {'tokenizer': {'name': 'random', 'kind': 'bench', 'vocab_size': VOCAB, 'eod_id': 0,
                           'fingerprint': 'random'}}  # fmt: skip
  prepare.write_manifest(out, request, dtype, splits)


def open_shards(out: str) -> sources.TokenStream:
  """The training stream, as sources.open_tokens builds it (without a tokenizer to match)."""
  manifest = prepare.read_manifest(out)
  assert prepare.verify(out, manifest) is None
  parts, starts = [], []
  for shard in manifest['splits']['train']['shards']:
    parts.append(np.memmap(os.path.join(out, shard['tokens']), dtype=manifest['dtype'], mode='r'))
    starts.append(
      np.fromfile(os.path.join(out, shard['docs']), '<i8') + sum(p.size for p in parts[:-1])
    )
  return sources.TokenStream(parts, np.concatenate(starts))


def time_batches(fn, steps) -> float:
  """Batches per second of fn(step) over `steps` (median of per-batch times)."""
  times = []
  for step in steps:
    t = time.perf_counter()
    fn(step)
    times.append(time.perf_counter() - t)
  return 1 / statistics.median(times)


def drop_page_cache(out: str) -> None:
  # Cold reads: ask the kernel to forget the shards' pages (posix_fadvise DONTNEED).
  for name in os.listdir(out):
    with open(os.path.join(out, name), 'rb') as f:
      os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def smoke_step_time() -> tuple[float, str]:
  from triax.compiled.measure import measure

  cfg = config_lib.from_file('experiments/gpt_1b.py', 'smoke')
  m = measure(cfg, steps=5, warmup=2, devices=jax.devices()[:1])
  shape = f'seq {cfg.model.seq_len}, batch {cfg.train.global_batch_size}'
  return m.step_time_s, shape


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--tokens', type=int, default=100_000_000)
  parser.add_argument('--out', default='docs/bench_loader.md')
  parser.add_argument('--steps', type=int, default=40)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    shards = os.path.join(tmp, 'tokens')
    started = time.perf_counter()
    write_shards(shards, args.tokens)
    write_s = time.perf_counter() - started
    stream = open_shards(shards)
    loader = BatchStream(stream, SEQ, BATCH, seed=0)
    drop_page_cache(shards)
    cold = time_batches(loader.batch, range(args.steps))
    warm = time_batches(loader.batch, range(args.steps))
    shard = time_batches(lambda s: loader.batch(s, (0, BATCH // 8)), range(args.steps))
    ids = time_batches(loader.sample_ids, range(args.steps))

    from jax.sharding import NamedSharding, PartitionSpec

    from triax.mesh import build_mesh
    from triax.training import loop

    cfg = config_lib.defaults()
    cfg.model.seq_len, cfg.train.global_batch_size = SEQ, BATCH
    cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipe = 8, 1, 1
    mesh = build_mesh(cfg.mesh, jax.devices()[:8])
    trainer = type(
      'T', (), {'cfg': cfg, 'batch_sharding': NamedSharding(mesh, PartitionSpec('data', None))}
    )

    def to_devices(step):
      batch = loop.global_batch(trainer, lambda lo, hi: loader.batch(step, (lo, hi)))
      jax.block_until_ready(batch)

    device = time_batches(to_devices, range(args.steps))
    step_s, smoke_shape = smoke_step_time()
  tokens = stream.size
  lines = [
    '# Loader throughput',
    '',
    f'`scripts/bench_loader.py` on this machine ({os.cpu_count()} CPUs): {tokens / 1e6:.0f}M '
    f'training tokens in {len(stream._parts)} uint16 shards (written in {write_s:.0f} s), '
    f'batches of {BATCH} x {SEQ} tokens, median of {args.steps} batches.',
    '',
    '| what | batches/s | ms per batch |',
    '|---|---|---|',
  ]
  for name, rate in (
    ('host batch, all 64 rows, cold page cache', cold),
    ('host batch, all 64 rows, warm', warm),
    ('one data shard: 8 of 64 rows (one process of 8)', shard),
    ('sample ids of a step only (samples.jsonl; no reads)', ids),
    ('global_batch onto 8 CPU devices (data=8), copy included', device),
  ):
    lines.append(f'| {name} | {rate:,.0f} | {1000 / rate:.2f} |')
  # The real 1B config: 20 layers of d 2048 (N = 12 L d^2 weights in the blocks), 6 N T FLOPs.
  n_params = 12 * 20 * 2048**2
  flops = 6 * n_params * SEQ * BATCH
  h200 = flops / (0.5 * 989e12)
  lines += [
    '',
    f'Step time of `experiments/gpt_1b.py:smoke` on one CPU device ({smoke_shape}): '
    f'{step_s * 1000:.1f} ms, {step_s * warm:.0f}x the time of a whole 64 x 2048 host batch. '
    f'The real 1B config (N = 12 L d^2 = {n_params / 1e9:.2f}B block weights) does 6 N T = '
    f'{flops / 1e15:.2f} PFLOP per 64 x 2048 tokens: {h200:.1f} s on an H200 at 50% of its '
    '989 TFLOP/s dense bf16 peak (an estimate from the FLOPs; no GPU was measured here). '
    f'The loader takes {1000 / warm:.1f} ms of that, {1 / warm / h200:.2%}, and the loop '
    'builds the next batch while the device runs the current step (dispatch runs one step '
    'ahead), so a step does not wait for it.',
    '',
    '```',
    json.dumps(
      {
        'tokens': tokens,
        'cold': cold,
        'warm': warm,
        'shard': shard,
        'ids': ids,
        'device': device,
        'smoke_step_s': step_s,
      },  # fmt: skip
      indent=None,
    ),
    '```',
  ]
  with open(args.out, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
