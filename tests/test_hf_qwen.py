"""Hugging Face Qwen2 and Qwen3 checkpoints against the reference: transformers'
Qwen2ForCausalLM and Qwen3ForCausalLM.

A small model of each with random weights is written by transformers itself,
in shards, then imported as a llama: Qwen2's q/k/v biases as model.qkv_bias;
Qwen3's per-head q/k RMSNorms as model.qk_norm, its heads wider than
hidden_size / heads as model.head_dim, its embeddings tied as its small sizes
have them. triax must give its logits (one device), its loss on a tensor x
pipeline layout (biases and norms split over tensor, stacked per stage) and
its greedy tokens; export -> import -> export must be bit-identical and give
back transformers' tensors. Nothing is downloaded.
"""

import json

import hf_round_trip
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax import config as config_lib  # noqa: E402
from triax.convert import hf_checkpoint, hf_llama  # noqa: E402
from triax.errors import ConfigError  # noqa: E402

SEQ = 32
# Each model: its config's own keys, the model keys the import must set,
# and a tensor only that model has (the export must hold it).
MODELS = {
  'qwen2': (
    {},
    {'qkv_bias': True, 'qk_norm': False, 'head_dim': 0, 'tie_embeddings': False},
    'model.layers.3.self_attn.v_proj.bias',
  ),
  'qwen3': (
    # 4 heads x 32 = 128 > 64: Qwen3's widening.
    {'head_dim': 32, 'rope_theta': 1e6, 'tie_word_embeddings': True},
    {'qkv_bias': False, 'qk_norm': True, 'head_dim': 32, 'tie_embeddings': True},
    'model.layers.3.self_attn.k_norm.weight',
  ),
}


def _classes(name):
  prefix = {'qwen2': 'Qwen2', 'qwen3': 'Qwen3'}[name]
  return getattr(transformers, f'{prefix}Config'), getattr(transformers, f'{prefix}ForCausalLM')


@pytest.fixture(scope='module', params=list(MODELS))
def imported(request, tmp_path_factory):
  config_cls, model_cls = _classes(request.param)
  cfg = config_cls(
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
    **MODELS[request.param][0],
  )
  model = hf_round_trip.random_model(model_cls, cfg)
  return hf_round_trip.imported(model, tmp_path_factory)


def _name(imported) -> str:
  return 'qwen3' if imported[3]['config'].model.qk_norm else 'qwen2'


def _tokens(batch=2, length=SEQ, seed=0):
  return hf_round_trip.tokens(length, batch, seed)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.num_kv_heads) == ('llama', 2)
  assert {key: m[key] for key in MODELS[_name(imported)][1]} == MODELS[_name(imported)][1]
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_loss_on_a_tensor_and_pipeline_layout_is_transformers(imported):
  model, _, workdir, _ = imported
  hf_round_trip.check_eval_loss(model, workdir, _tokens(4, SEQ + 1, seed=1), 1, 4, 2)


def test_greedy_generation_gives_transformers_tokens(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])


def test_export_import_export_is_bit_identical(imported, tmp_path):
  name = _name(imported)
  holds = MODELS[name][2]
  hf_round_trip.check_export(imported, tmp_path, _classes(name)[1], _tokens(), holds)


def test_a_qwen3_with_biases_is_not_exported():
  model = config_lib.defaults().model
  model.update(family='llama', qk_norm=True, qkv_bias=True)
  with pytest.raises(ConfigError, match='no q/k/v biases') as e:
    hf_llama.hf_config(model)
  assert e.value.key == '--workdir'


def test_a_refused_export_reads_and_writes_nothing(tmp_path):
  cfg = config_lib.defaults()
  cfg.model.update(family='llama', qk_norm=True, qkv_bias=True)
  workdir = tmp_path / 'w'
  workdir.mkdir()
  (workdir / 'config.json').write_text(json.dumps(cfg.to_dict()))
  # No checkpoint either: the refusal comes before any is read, and no file is written.
  with pytest.raises(ConfigError, match='no q/k/v biases'):
    hf_checkpoint.export_hf(str(workdir), str(tmp_path / 'hf'))
  assert not (tmp_path / 'hf').exists()


def test_an_odd_head_dim_is_refused_in_one_line():
  cfg = config_lib.defaults()
  cfg.model.update(family='llama', qk_norm=True, head_dim=33)
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert e.value.key == 'model.head_dim'
