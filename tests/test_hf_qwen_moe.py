"""Hugging Face Qwen2-MoE and Qwen3-MoE checkpoints against the reference:
transformers' Qwen2MoeForCausalLM and Qwen3MoeForCausalLM.

A small model of each with random weights (4 experts, 2 per token,
grouped-query attention) is written by transformers itself, in shards, then
imported as a mixtral. Qwen2-MoE's parts: q/k/v biases, a gated shared
expert twice the experts' width, the chosen experts' weights left
unnormalised. Qwen3-MoE's: per-head q/k RMSNorms, heads wider than
hidden_size / heads, no shared expert, the weights renormalised. triax must
give its logits (one device), its training loss with the load-balancing
term (data x tensor layout) and its greedy tokens; export -> import ->
export must be bit-identical and give back transformers' tensors. Nothing
is downloaded.
"""

import hf_round_trip
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax.convert import hf_checkpoint, hf_llama  # noqa: E402
from triax.errors import ConfigError  # noqa: E402

SEQ = 32
# Each model: its config's own keys, the routers and gates sharpened, the
# model keys the import must set, and a tensor only that model has.
MODELS = {
  'qwen2_moe': (
    {'shared_expert_intermediate_size': 96, 'norm_topk_prob': False, 'rms_norm_eps': 1e-5},
    ['mlp.gate.weight', 'shared_expert_gate.weight'],
    {'qkv_bias': True, 'qk_norm': False, 'shared_experts': 2, 'shared_expert_gate': True},
    'model.layers.1.mlp.shared_expert_gate.weight',
  ),
  'qwen3_moe': (
    {'head_dim': 32, 'norm_topk_prob': True, 'rms_norm_eps': 1e-6},
    ['mlp.gate.weight'],
    {'qkv_bias': False, 'qk_norm': True, 'shared_experts': 0, 'head_dim': 32},
    'model.layers.1.self_attn.q_norm.weight',
  ),
}


def _classes(name):
  prefix = {'qwen2_moe': 'Qwen2Moe', 'qwen3_moe': 'Qwen3Moe'}[name]
  return getattr(transformers, f'{prefix}Config'), getattr(transformers, f'{prefix}ForCausalLM')


def _hf_model(name, **overrides):
  own, sharpened, _, _ = MODELS[name]
  fields = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=80,  # the dense MLP's: no block here has one
    moe_intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=SEQ,
    router_aux_loss_coef=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  config_cls, model_cls = _classes(name)
  cfg = config_cls(**{**fields, **own, **overrides})
  return hf_round_trip.random_model(model_cls, cfg, sharpened)


@pytest.fixture(scope='module', params=list(MODELS))
def imported(request, tmp_path_factory):
  model = _hf_model(request.param)
  return hf_round_trip.imported(model, tmp_path_factory)


def _name(imported) -> str:
  return 'qwen3_moe' if imported[3]['config'].model.qk_norm else 'qwen2_moe'


def _tokens(batch=2, length=SEQ, seed=0):
  return hf_round_trip.tokens(length, batch, seed)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.num_experts, m.d_ff) == ('mixtral', 4, 48)
  assert m.norm_topk_prob == MODELS[_name(imported)][0]['norm_topk_prob']
  assert {key: m[key] for key in MODELS[_name(imported)][2]} == MODELS[_name(imported)][2]
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_training_objective_is_transformers_loss_with_its_aux_loss(imported):
  model, _, workdir, _ = imported
  hf_round_trip.check_moe_objective(model, workdir, _tokens(4, SEQ + 1, seed=1), 0.02)


def test_greedy_generation_gives_transformers_tokens(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])


def test_export_import_export_is_bit_identical(imported, tmp_path):
  name = _name(imported)
  holds = MODELS[name][3]
  hf_round_trip.check_export(imported, tmp_path, _classes(name)[1], _tokens(), holds)


@pytest.mark.parametrize(
  'name, overrides, match',
  [
    ('qwen2_moe', {'decoder_sparse_step': 2}, 'decoder_sparse_step=2'),
    ('qwen2_moe', {'mlp_only_layers': [0]}, 'mlp_only_layers'),
    (
      'qwen2_moe',
      {'shared_expert_intermediate_size': 72},
      'not a multiple of moe_intermediate_size=48',
    ),
    ('qwen3_moe', {'decoder_sparse_step': 2}, 'decoder_sparse_step=2'),
  ],
)
def test_variants_triax_does_not_run_are_refused_in_one_line(name, overrides, match, tmp_path):
  hf_dir = str(tmp_path / 'hf')
  _hf_model(name, **overrides).save_pretrained(hf_dir)
  with pytest.raises(ConfigError, match=match) as e:
    hf_checkpoint.import_hf(hf_dir, str(tmp_path / 'w'))
  assert e.value.key == '--hf_dir' and not (tmp_path / 'w').exists()


def test_a_mixtral_with_only_some_of_either_qwens_parts_is_not_exported(imported):
  cfg = imported[3]['config']
  model = cfg.model.copy_and_resolve_references()
  if _name(imported) == 'qwen2_moe':
    model.shared_expert_gate = False
    match = 'without model.shared_expert_gate: neither'
  else:
    model.shared_experts = 1
    match = 'Qwen3MoeForCausalLM has neither'
  with pytest.raises(ConfigError, match=match):
    hf_llama.hf_config(model)
