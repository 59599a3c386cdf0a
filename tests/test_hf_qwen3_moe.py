"""Hugging Face Qwen3-MoE checkpoints against the reference: transformers' Qwen3MoeForCausalLM.

A small Qwen3-MoE with random weights (4 experts, 2 per token, their weights
renormalised, no shared expert, q/k RMSNorms per head, heads wider than
hidden_size / heads, grouped-query attention) is written by transformers
itself, in shards, then imported as a mixtral with model.qk_norm: triax must
give its logits (one device), its training loss with the load-balancing
term and its greedy tokens; export -> import -> export must be bit-identical
and give back transformers' tensors. Nothing is downloaded.
"""

import hf_round_trip
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax.convert import hf_checkpoint, hf_llama  # noqa: E402
from triax.errors import ConfigError  # noqa: E402

SEQ = 32


def _hf_model(**overrides):
  fields = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=80,  # the dense MLP's: no block here has one
    moe_intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-6,
    router_aux_loss_coef=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  cfg = transformers.Qwen3MoeConfig(**{**fields, **overrides})
  return hf_round_trip.random_model(transformers.Qwen3MoeForCausalLM, cfg, ['mlp.gate.weight'])


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  model = _hf_model()
  hf_dir, workdir, result = hf_round_trip.import_sharded(model, tmp_path_factory.mktemp('hf'))
  return model, hf_dir, workdir, result


def _tokens(batch=2, length=SEQ, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.int32)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.num_experts, m.d_ff, m.shared_experts) == ('mixtral', 4, 48, 0)
  assert (m.qk_norm, m.head_dim, m.qkv_bias, m.norm_topk_prob) == (True, 32, False, True)
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_training_objective_is_transformers_loss_with_its_aux_loss(imported):
  model, _, workdir, _ = imported
  hf_round_trip.check_moe_objective(model, workdir, _tokens(4, SEQ + 1, seed=1), 0.02)


def test_greedy_generation_gives_transformers_tokens(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])


def test_export_import_export_is_bit_identical(imported, tmp_path):
  model, hf_dir, workdir, _ = imported
  first = str(tmp_path / 'first')
  assert hf_checkpoint.export_hf(workdir, first, max_shard_bytes=100_000)['architecture'] == (
    'Qwen3MoeForCausalLM'
  )
  reference = hf_llama.read_tensors(hf_dir)
  assert 'model.layers.1.self_attn.q_norm.weight' in reference
  hf_round_trip.check(
    first, reference, tmp_path, model, transformers.Qwen3MoeForCausalLM, _tokens()
  )


def test_decoder_sparse_step_above_one_is_refused_in_one_line(tmp_path):
  hf_dir = str(tmp_path / 'hf')
  _hf_model(decoder_sparse_step=2).save_pretrained(hf_dir)
  with pytest.raises(ConfigError, match='decoder_sparse_step=2') as e:
    hf_checkpoint.import_hf(hf_dir, str(tmp_path / 'w'))
  assert e.value.key == '--hf_dir' and not (tmp_path / 'w').exists()


def test_a_qwen3_moe_with_shared_experts_is_not_exported(imported):
  _, _, workdir, result = imported
  cfg = result['config']
  cfg.model.shared_experts = 1
  with pytest.raises(ConfigError, match='Qwen3MoeForCausalLM has neither'):
    hf_llama.hf_config(cfg.model)
