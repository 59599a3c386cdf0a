"""Hugging Face Qwen2 checkpoints against the reference: transformers' Qwen2ForCausalLM.

A small Qwen2 with random weights (grouped-query attention, q/k/v biases)
is written by transformers itself, in shards, then imported as a llama with
model.qkv_bias: triax must give its logits (one device), its loss on a
tensor x pipeline layout (the biases split over tensor, stacked per stage)
and its greedy tokens; export -> import -> export must be bit-identical and
give back transformers' tensors. Nothing is downloaded.
"""

import hf_round_trip
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax.convert import hf_checkpoint, hf_llama  # noqa: E402

SEQ = 32


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  cfg = transformers.Qwen2Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  model = hf_round_trip.random_model(transformers.Qwen2ForCausalLM, cfg)
  hf_dir, workdir, result = hf_round_trip.import_sharded(model, tmp_path_factory.mktemp('hf'))
  return model, hf_dir, workdir, result


def _tokens(batch=2, length=SEQ, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.int32)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.qkv_bias, m.num_kv_heads) == ('llama', True, 2)
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_loss_on_a_tensor_and_pipeline_layout_is_transformers(imported):
  model, _, workdir, _ = imported
  hf_round_trip.check_eval_loss(model, workdir, _tokens(4, SEQ + 1, seed=1), 1, 4, 2)


def test_greedy_generation_gives_transformers_tokens(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])


def test_export_import_export_is_bit_identical(imported, tmp_path):
  model, hf_dir, workdir, _ = imported
  first = str(tmp_path / 'first')
  assert hf_checkpoint.export_hf(workdir, first, max_shard_bytes=100_000)['architecture'] == (
    'Qwen2ForCausalLM'
  )
  reference = hf_llama.read_tensors(hf_dir)
  assert 'model.layers.3.self_attn.v_proj.bias' in reference
  hf_round_trip.check(first, reference, tmp_path, model, transformers.Qwen2ForCausalLM, _tokens())
