"""`triax convert` streams: neither direction holds the model in host memory.

scripts/bench_convert.py's checkpoint (1.2 GB of fp32 in 2 shards with their
index, its largest leaf a stacked [16, 1024, 4096] MLP weight twice its
largest tensor) is imported and exported, each direction in a process of its
own whose peak resident set (VmHWM at the end) is held to its baseline (after
its imports and JAX's start) plus twice the largest leaf; the export holds
the source's tensors bit for bit. A bfloat16 checkpoint (the dtype of most
released ones, which safetensors' numpy reader cannot hold) imports too.
"""

import json
import os
import shutil

import harness
import ml_dtypes

from triax.convert import hf_checkpoint, safetensors_files

bench = harness.load_script('bench_convert')


def test_a_checkpoint_larger_than_the_process_streams_both_ways(tmp_path):
  try:
    result = bench.run(str(tmp_path))
  finally:
    shutil.rmtree(tmp_path, ignore_errors=True)  # 3.5 GB of files
  assert result['bytes'] >= 2**30 and len(result['files']) >= 2
  assert result['largest_leaf'] >= 2 * result['largest_tensor']  # a leaf of many tensors
  for direction in ('import', 'export'):
    figures = result[direction]
    assert figures['baseline'] < result['bytes']  # the checkpoint is larger than the process
    held = figures['peak'] - figures['baseline']
    assert held <= 2 * result['largest_leaf'], (direction, held, result['largest_leaf'])
  assert result['identical']  # tensors bit for bit, and the tokenizer with them


def test_a_bfloat16_checkpoint_imports_and_exports(tmp_path):
  small = dict(
    bench.SHAPE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    torch_dtype='bfloat16',
  )
  hf_dir, workdir, out = (str(tmp_path / name) for name in ('hf', 'w', 'out'))
  bench.write_checkpoint(hf_dir, small, ml_dtypes.bfloat16, shards=2)
  hf_checkpoint.import_hf(hf_dir, workdir)
  export = lambda size: harness.run_cli(  # noqa: E731
    'triax.cli.convert', f'--workdir={workdir}', f'--hf_dir={out}', '--export', size
  )
  bad = export('--max_shard_size=large')
  assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
    "error: --max_shard_size: 'large': give bytes, or a size such as 5GB, 500MB or 2GiB"
  ]
  assert not os.path.exists(out)
  done = export('--max_shard_size=100KB')
  assert done.returncode == 0, done.stderr[-3000:]
  # Imported as the run's param_dtype (fp32), every bfloat16 value exactly, and
  # exported in the checkpoint's own dtype: bit-identical.
  source, back = safetensors_files.read_tensors(hf_dir), safetensors_files.read_tensors(out)
  assert source and set(source) == set(back)
  for name, array in source.items():
    assert array.dtype == ml_dtypes.bfloat16 and back[name].dtype == ml_dtypes.bfloat16
    assert back[name].tobytes() == array.tobytes(), name
  # Shards of at most 100 kB (a tensor larger than that alone), with their index.
  with open(os.path.join(out, safetensors_files.INDEX_FILE)) as f:
    shards = set(json.load(f)['weight_map'].values())
  assert len(shards) > 2 and shards == {n for n in os.listdir(out) if n.endswith('.safetensors')}
  largest = max(a.nbytes for a in back.values())  # header: names and offsets, a few kB
  assert all(os.path.getsize(os.path.join(out, n)) <= max(100_000, largest) + 8192 for n in shards)
