"""Hugging Face Mixtral checkpoints against the reference: transformers' MixtralForCausalLM.

A small Mixtral with random weights (4 experts, 2 per token, grouped-query
attention) is written by transformers itself, in shards, then imported:
triax must give its logits (one device), its training loss with the
load-balancing term (data x tensor layout) and its greedy tokens; export ->
import -> export must be bit-identical and give back transformers' tensors.
Nothing is downloaded.
"""

import hf_round_trip
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax.convert import hf_checkpoint  # noqa: E402
from triax.errors import ConfigError  # noqa: E402

SEQ = 32


def _hf_model(**overrides):
  cfg = transformers.MixtralConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    router_aux_loss_coef=0.02,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    **overrides,
  )
  return hf_round_trip.random_model(transformers.MixtralForCausalLM, cfg, ['mlp.gate.weight'])


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  model = _hf_model()
  return hf_round_trip.imported(model, tmp_path_factory)


def _tokens(batch=2, length=SEQ, seed=0):
  return hf_round_trip.tokens(length, batch, seed)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.num_experts, m.experts_per_token, m.router_aux_loss_coef) == (
    'mixtral',
    4,
    2,
    0.02,
  )
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_training_objective_is_transformers_loss_with_its_aux_loss(imported):
  model, _, workdir, _ = imported
  hf_round_trip.check_moe_objective(model, workdir, _tokens(4, SEQ + 1, seed=1), 0.02)


def test_greedy_generation_gives_transformers_tokens(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])


def test_export_import_export_is_bit_identical(imported, tmp_path):
  # What transformers itself wrote: the Hub's per-expert layout.
  holds = 'model.layers.1.block_sparse_moe.experts.3.w2.weight'
  hf_round_trip.check_export(imported, tmp_path, transformers.MixtralForCausalLM, _tokens(), holds)


def test_a_sliding_window_shorter_than_the_training_window_is_refused(tmp_path):
  hf_dir = str(tmp_path / 'hf')
  _hf_model(sliding_window=16).save_pretrained(hf_dir)
  with pytest.raises(ConfigError, match='sliding_window=16') as e:
    hf_checkpoint.import_hf(hf_dir, str(tmp_path / 'w'))
  assert e.value.key == '--hf_dir' and not (tmp_path / 'w').exists()
  # Within the window, it never applies: a 16-token training window imports.
  assert hf_checkpoint.import_hf(hf_dir, str(tmp_path / 'w16'), seq_len=16)['params'] > 0
