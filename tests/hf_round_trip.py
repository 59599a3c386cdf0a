"""What an HF checkpoint must satisfy, for every family that converts: greedy
tokens equal to transformers' generate; on export the tensors transformers
wrote, export -> import -> export bit-identical file by file (shards and
index), and transformers reading the export back to the same logits. Shared
by tests/test_hf_llama.py and tests/test_hf_mixtral.py."""

import filecmp
import os

import numpy as np

from triax.model import generation, hf_llama
from triax.training import hf_checkpoint
from triax.training import workdir as workdir_lib


def import_sharded(model, base):
  """(hf_dir, workdir, import result): `model` saved by transformers in shards
  of at most 100 kB (the index path, as large checkpoints are stored) under
  `base`, then imported."""
  hf_dir = str(base / 'hf')
  model.save_pretrained(hf_dir, max_shard_size='100KB')
  assert os.path.isfile(os.path.join(hf_dir, hf_llama.INDEX_FILE))
  workdir = str(base / 'w')
  return hf_dir, workdir, hf_checkpoint.import_hf(hf_dir, workdir)


def check_greedy(model, workdir, cfg):
  """triax's greedy tokens from the imported checkpoint equal transformers'."""
  import torch

  params = workdir_lib.restore_params(workdir, cfg, 0)
  prompt = [5, 17, 200, 33]
  ours = generation.generate(
    generation.sampling_model(cfg),
    params,
    prompt,
    generation.Sampling(max_new_tokens=12, temperature=0.0),
  )
  with torch.no_grad():
    theirs = model.generate(
      torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
    )[0, len(prompt) :].numpy()
  assert ours.tolist() == theirs.tolist()


def check(first, reference, tmp_path, model, reader, tokens):
  """`first`: an export; `reference`: {name: array} it must hold; `model`:
  the transformers model; `reader`: its class (from_pretrained)."""
  import torch

  tensors = hf_llama.read_tensors(first)
  assert set(tensors) == set(reference)
  for name, array in reference.items():
    np.testing.assert_array_equal(tensors[name], array, err_msg=name)
  again = str(tmp_path / 'w2')
  hf_checkpoint.import_hf(first, again)
  second = str(tmp_path / 'second')
  hf_checkpoint.export_hf(again, second, max_shard_bytes=100_000)
  names = sorted(os.listdir(first))
  assert names == sorted(os.listdir(second)) and len(names) > 2  # shards and the index
  _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
  assert (mismatch, errors) == ([], []), (mismatch, errors)
  back = reader.from_pretrained(first).eval()  # transformers reads the export back
  with torch.no_grad():
    x = torch.from_numpy(tokens).long()
    np.testing.assert_array_equal(back(x).logits.numpy(), model(x).logits.numpy())
