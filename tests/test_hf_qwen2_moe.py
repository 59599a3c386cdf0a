"""Hugging Face Qwen2-MoE checkpoints against the reference: transformers' Qwen2MoeForCausalLM.

A small Qwen2-MoE with random weights (4 experts, 2 per token, their weights
left unnormalised, a gated shared expert twice the experts' width, q/k/v
biases, grouped-query attention) is written by transformers itself, in
shards, then imported as a mixtral: triax must give its logits (one device),
its training loss with the load-balancing term (data x tensor layout, the
biases split over tensor) and its greedy tokens; export -> import -> export
must be bit-identical and give back transformers' tensors. Nothing is
downloaded.
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
    shared_expert_intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-5,
    router_aux_loss_coef=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  cfg = transformers.Qwen2MoeConfig(**{**fields, **overrides})
  gates = ['mlp.gate.weight', 'shared_expert_gate.weight']
  return hf_round_trip.random_model(transformers.Qwen2MoeForCausalLM, cfg, gates)


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
  assert (m.family, m.num_experts, m.d_ff, m.shared_experts) == ('mixtral', 4, 48, 2)
  assert (m.qkv_bias, m.shared_expert_gate, m.norm_topk_prob) == (True, True, False)
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
    'Qwen2MoeForCausalLM'
  )
  reference = hf_llama.read_tensors(hf_dir)
  assert 'model.layers.1.mlp.shared_expert_gate.weight' in reference
  assert 'model.layers.0.self_attn.k_proj.bias' in reference
  hf_round_trip.check(
    first, reference, tmp_path, model, transformers.Qwen2MoeForCausalLM, _tokens()
  )


@pytest.mark.parametrize(
  'overrides, match',
  [
    ({'decoder_sparse_step': 2}, 'decoder_sparse_step=2'),
    ({'mlp_only_layers': [0]}, 'mlp_only_layers'),
    ({'shared_expert_intermediate_size': 72}, 'not a multiple of moe_intermediate_size=48'),
  ],
)
def test_variants_triax_does_not_run_are_refused_in_one_line(overrides, match, tmp_path):
  hf_dir = str(tmp_path / 'hf')
  _hf_model(**overrides).save_pretrained(hf_dir)
  with pytest.raises(ConfigError, match=match) as e:
    hf_checkpoint.import_hf(hf_dir, str(tmp_path / 'w'))
  assert e.value.key == '--hf_dir' and not (tmp_path / 'w').exists()


def test_a_mixtral_with_only_some_of_qwens_parts_is_not_exported(imported, tmp_path):
  _, _, workdir, result = imported
  cfg = result['config']
  cfg.model.shared_expert_gate = False
  with pytest.raises(ConfigError, match='without model.shared_expert_gate: neither'):
    hf_llama.hf_config(cfg.model)
