"""What an HF export must satisfy, for every family that exports: the tensors
transformers wrote, export -> import -> export bit-identical file by file
(shards and index), and transformers reading the export back to the same
logits. Shared by tests/test_hf_llama.py and tests/test_hf_mixtral.py."""

import filecmp
import os

import numpy as np

from triax.model import hf_llama
from triax.training import hf_checkpoint


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
