"""What `triax convert` holds in host memory, each way: writes docs/bench_convert.md.

    .venv/bin/python scripts/bench_convert.py [--out=docs/bench_convert.md] [--dir=TMP]

A random llama-shaped checkpoint of 1.2 GB (fp32; `SHAPE`: 16 layers of
d_model 1024 and d_ff 4096, so that each stacked MLP leaf, [16, 1024, 4096],
is 256 MiB, twice the largest HF tensor, the 125 MiB embedding) is written
in 2 shards with their index, imported into a workdir and exported back,
each direction in a process of its own (`child`) that reports its resident
set after its imports and JAX's start (the baseline) and its peak at the end
(VmHWM). The export is then compared with the source tensor by tensor: the
round trip is bit-identical. tests/test_convert_streaming.py runs the same
functions and holds the peaks to their bounds. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import bench_harness
import numpy as np

# The model of the benchmark checkpoint (HF config keys).
SHAPE = {
  'model_type': 'llama',
  'architectures': ['LlamaForCausalLM'],
  'hidden_size': 1024,
  'intermediate_size': 4096,
  'num_hidden_layers': 16,
  'num_attention_heads': 16,
  'num_key_value_heads': 4,
  'vocab_size': 32000,
  'max_position_embeddings': 2048,
  'rms_norm_eps': 1e-5,
  'rope_theta': 10000.0,
  'tie_word_embeddings': False,
  'hidden_act': 'silu',
  'torch_dtype': 'float32',
}
MIB = 1 << 20


def _tensors(hf: dict, dtype):
  """(name, shape, dtype) of every tensor of the HF config `hf` (hf_llama's names)."""
  from triax.convert import hf_checkpoint, hf_llama, rules

  model = hf_checkpoint.import_config(hf, 0).model
  tensor_rules = hf_llama.tensor_rules(model, dtype)
  return rules.export_specs(tensor_rules, lambda path: dtype), tensor_rules


def write_checkpoint(hf_dir: str, hf: dict = SHAPE, dtype=np.float32, shards: int = 2) -> dict:
  """Writes a random checkpoint of `hf` (values ±[0.5, 1), made from random bits)
  with safetensors itself, in `shards` shards and their index.

  Returns:
    {'bytes': the tensors' bytes, 'largest_tensor': the largest tensor's bytes,
     'largest_leaf': the largest triax leaf's bytes, 'files': the shards}
  """
  from safetensors.numpy import save_file

  os.makedirs(hf_dir)
  with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
    json.dump(hf, f, indent=2)
  specs, tensor_rules = _tensors(hf, np.dtype(dtype))
  sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, _ in specs]
  total, rng, weight_map, start = sum(sizes), np.random.default_rng(0), {}, 0
  ends = np.cumsum(sizes)
  for k in range(shards):
    name = f'model-{k + 1:05d}-of-{shards:05d}.safetensors'
    # shard k ends past the tensor that crosses (k + 1) / shards of the bytes
    end = (
      len(specs) if k == shards - 1 else int(np.searchsorted(ends, total * (k + 1) / shards)) + 1
    )
    save_file(
      {n: _random(rng, shape, dtype) for n, shape, _ in specs[start:end]},
      os.path.join(hf_dir, name),
      metadata={'format': 'pt'},
    )
    weight_map.update(dict.fromkeys((n for n, _, _ in specs[start:end]), name))
    start = end
  index = {'metadata': {'total_size': total}, 'weight_map': weight_map}
  with open(os.path.join(hf_dir, 'model.safetensors.index.json'), 'w') as f:
    json.dump(index, f, indent=2)
  # Its tokenizer travels with it (a small BPE: a vocabulary of 32000 ids needs one).
  from triax.data import tokenizer as tokenizer_lib

  texts = (f'text number {i} of a few words' for i in range(200))
  tokenizer_lib.train_bpe(texts, 320, os.path.join(hf_dir, 'tokenizer.json'))
  leaves = [int(np.prod(r.names.shape + s)) * 4 for r in tensor_rules for s in r.shapes]
  return {
    'bytes': total,
    'largest_tensor': max(sizes),
    'largest_leaf': max(leaves),  # fp32, the import's param_dtype
    'files': sorted(set(weight_map.values())),
  }


def _random(rng, shape, dtype) -> np.ndarray:
  """Values ±[0.5, 1) of `dtype` (fp32 or bf16) from random bits: sign and mantissa random."""
  bits = np.dtype(dtype).itemsize * 8
  raw = rng.integers(0, 1 << bits, size=shape, dtype=np.uint32 if bits == 32 else np.uint16)
  keep, half = (0x807FFFFF, 0x3F000000) if bits == 32 else (0x807F, 0x3F00)
  return ((raw & keep) | half).view(dtype)


def _rss(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f'no {field} in /proc/self/status')


def child(direction: str, hf_dir: str, workdir: str) -> dict:
  """Runs one direction in this process: {'baseline', 'peak'} resident bytes
  (after the imports and JAX's start; the high-water mark at the end) and
  'seconds'."""
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint  # noqa: F401  # the process's own, not the conversion's
  import tensorstore  # noqa: F401

  from triax.convert import hf_checkpoint
  from triax.training import checkpoint, step  # noqa: F401

  jax.block_until_ready(jnp.zeros(8) + 1)  # the backend started, a first program compiled
  baseline = _rss('VmRSS')
  started = time.perf_counter()
  if direction == 'import':
    hf_checkpoint.import_hf(hf_dir, workdir)
  else:
    hf_checkpoint.export_hf(workdir, hf_dir)
  return {'baseline': baseline, 'peak': _rss('VmHWM'), 'seconds': time.perf_counter() - started}


def measure(direction: str, hf_dir: str, workdir: str) -> dict:
  """`child(direction, ...)` in a process of its own (one CPU device)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=bench_harness.device_count_flags(1))
  env['PYTHONPATH'] = bench_harness.SRC + os.pathsep + env.get('PYTHONPATH', '')
  args = [sys.executable, __file__, f'--child={direction}', f'--hf_dir={hf_dir}']
  done = subprocess.run(
    [*args, f'--workdir={workdir}'], env=env, capture_output=True, text=True, timeout=900
  )
  if done.returncode:
    raise RuntimeError(f'{direction} failed:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def same_tensors(first: str, second: str) -> bool:
  """Whether two checkpoint directories hold the same tensors, bit for bit (read one at a time)."""
  from triax.convert import safetensors_files

  a, b = safetensors_files.Shards(first), safetensors_files.Shards(second)
  if sorted(a.names()) != sorted(b.names()):
    return False
  for name in a.names():
    x, y = a.read(name), b.read(name)
    if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
      return False
  return True


def run(base: str) -> dict:
  """Writes, imports and exports the benchmark checkpoint under `base`; the figures."""
  hf_dir, workdir, out = (os.path.join(base, name) for name in ('hf', 'w', 'out'))
  load = os.getloadavg()[0]
  sizes = write_checkpoint(hf_dir)
  imported = measure('import', hf_dir, workdir)
  exported = measure('export', out, workdir)
  identical = same_tensors(hf_dir, out) and _same_file(hf_dir, out, 'tokenizer.json')
  return {**sizes, 'import': imported, 'export': exported, 'identical': identical, 'load': load}


def _same_file(first: str, second: str, name: str) -> bool:
  with open(os.path.join(first, name), 'rb') as a, open(os.path.join(second, name), 'rb') as b:
    return a.read() == b.read()


def _row(name: str, figures: dict, sizes: dict) -> str:
  held = figures['peak'] - figures['baseline']
  return (
    f'| {name} | {figures["baseline"] / MIB:.0f} | {figures["peak"] / MIB:.0f} | '
    f'{held / MIB:.0f} | {held / sizes["largest_leaf"]:.2f} | {held / sizes["largest_tensor"]:.2f}'
    f' | {held / sizes["bytes"]:.2f} | {figures["seconds"]:.1f} |'
  )


def write_doc(path: str, result: dict) -> None:
  s = result
  text = '\n'.join(
    [
      '# Host memory of `triax convert`',
      '',
      '`scripts/bench_convert.py`: a random llama-shaped checkpoint (fp32, 16 layers, '
      'd_model 1024, d_ff 4096, vocabulary 32000) of '
      f'{s["bytes"] / MIB:.0f} MiB in {len(s["files"])} shards, imported into a workdir '
      'and exported back, each direction in a process of its own on one CPU device. '
      f'Largest triax leaf: {s["largest_leaf"] / MIB:.0f} MiB (a stacked MLP weight, '
      f'[16, 1024, 4096]); largest HF tensor: {s["largest_tensor"] / MIB:.0f} MiB '
      "(the embedding). Baseline: the process after its imports and JAX's start; "
      'peak: its VmHWM at the end; held: peak - baseline.',
      '',
      '| direction | baseline MiB | peak MiB | held MiB | held / largest leaf | '
      'held / largest tensor | held / checkpoint | seconds |',
      '|---|---|---|---|---|---|---|---|',
      _row('import', s['import'], s),
      _row('export', s['export'], s),
      '',
      "An import holds one HF tensor and the block of a leaf made from it (a layer's "
      'slice of a stacked leaf: its bound is twice the largest tensor, whatever the leaves) '
      'while orbax writes that block chunk by chunk; an export reads each leaf a slab of '
      'its stored chunks at a time (one layer here, as the import stored it; a leaf stored '
      'in one chunk, as an unsharded training run writes it, is read whole: its bound is '
      'that leaf) and writes each tensor made of it into its place in the shards. '
      f'Round trip bit-identical, tokenizer included: {s["identical"]}. Seconds on a '
      f'shared 2-core machine (load average {s["load"]:.1f} at the start): indicative only.',
      '',
      '```',
      json.dumps(result),
      '```',
      '',
    ]
  )
  with open(path, 'w') as f:
    f.write(text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(bench_harness.ROOT, 'docs', 'bench_convert.md'))
  parser.add_argument('--dir', default=None, help='where the checkpoints go (a temporary folder)')
  parser.add_argument('--child', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--hf_dir', default=None, help=argparse.SUPPRESS)
  parser.add_argument('--workdir', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child, args.hf_dir, args.workdir)))
    return
  with tempfile.TemporaryDirectory(dir=args.dir) as base:
    result = run(base)
  print(json.dumps(result))
  write_doc(args.out, result)


if __name__ == '__main__':
  main()
