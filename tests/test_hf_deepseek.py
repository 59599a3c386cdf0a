"""Hugging Face DeepSeek-V3 checkpoints against the reference: transformers'
DeepseekV3ForCausalLM.

Small models with random weights are written by transformers itself, in
shards, then imported as model.family=deepseek: three blocks, the first
dense (first_k_dense_replace 1), then two of DeepSeekMoE (routed experts in
groups, topk_group of them kept, one shared expert, each expert's bias
random so that it moves choices), MLA with a value head narrower than the
query's, rope pairs interleaved as DeepSeek's weights have them; one model
with a query down-projection (q_lora_rank), one without. triax must give
its logits (one device), its loss and gradients on a data x tensor x pipe
layout, transformers' greedy tokens with and without its latent cache; the
export -> import -> export round trip is bit-identical and gives back
transformers' tensors (among them e_score_correction_bias). Nothing is
downloaded.
"""

import json
import os

import hf_round_trip
import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax.convert import hf_checkpoint  # noqa: E402
from triax.errors import ConfigError  # noqa: E402
from triax.model import generation  # noqa: E402
from triax.training import workdir as workdir_lib  # noqa: E402

SEQ = 32
# Each model's own config keys and the model keys the import must set.
MODELS = {
  'q_lora': (
    {'q_lora_rank': 24, 'n_routed_experts': 8, 'n_group': 4, 'topk_group': 2},
    {'q_lora_rank': 24, 'num_experts': 8, 'n_group': 4, 'topk_group': 2, 'norm_topk_prob': True},
  ),
  'q_direct': (
    {'q_lora_rank': None, 'n_routed_experts': 6, 'n_group': 2, 'topk_group': 1},
    {'q_lora_rank': 0, 'num_experts': 6, 'n_group': 2, 'topk_group': 1, 'norm_topk_prob': False},
  ),
}


def _hf_model(name='q_lora', **overrides):
  own, keys = MODELS[name]
  fields = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    routed_scaling_factor=2.5,
    norm_topk_prob=keys['norm_topk_prob'],
    rms_norm_eps=1e-5,  # the latents' norms keep 1e-6: both must be read right
    max_position_embeddings=SEQ,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  cfg = transformers.DeepseekV3Config(**{**fields, **own, **overrides})
  model = hf_round_trip.random_model(transformers.DeepseekV3ForCausalLM, cfg, ['mlp.gate.weight'])
  with torch.no_grad():  # a buffer, which random_model leaves at zeros
    for layer in model.model.layers[cfg.first_k_dense_replace :]:
      bias = layer.mlp.gate.e_score_correction_bias
      bias.copy_(0.1 * torch.randn_like(bias))
  return model


@pytest.fixture(scope='module', params=list(MODELS))
def imported(request, tmp_path_factory):
  model = _hf_model(request.param)
  return hf_round_trip.imported(model, tmp_path_factory)


def _name(imported) -> str:
  return 'q_lora' if imported[3]['config'].model.q_lora_rank else 'q_direct'


def _tokens(batch=2, length=SEQ, seed=0):
  return hf_round_trip.tokens(length, batch, seed)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.first_k_dense, m.shared_experts, m.moe_d_ff, m.mtp_depth) == (
    'deepseek',
    1,
    1,
    32,
    0,
  )
  assert (m.norm_eps, m.routed_scaling_factor, m.v_head_dim) == (1e-5, 2.5, 12)
  keys = MODELS[_name(imported)][1]
  assert {key: m[key] for key in keys} == keys
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_expert_biases_are_imported_in_fp32(imported):
  model, _, workdir, result = imported
  _, params = workdir_lib.restore_params(workdir, result['config'])
  ours = np.asarray(params['layers']['router_bias'])
  theirs = [layer.mlp.gate.e_score_correction_bias.numpy() for layer in model.model.layers[1:]]
  assert ours.dtype == np.float32 and np.any(ours != 0)
  np.testing.assert_array_equal(ours, np.stack(theirs))


def test_loss_and_gradients_on_a_layout_are_transformers(imported):
  model, _, workdir, _ = imported
  # router_bias's "gradient" is the expert load (loss-free balancing), no derivative.
  hf_round_trip.check_loss_and_grad(
    model, workdir, _tokens(4, SEQ + 1, seed=1), (2, 2, 2), skip=('e_score_correction_bias',)
  )


def test_greedy_generation_gives_transformers_tokens_cached_or_not(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])
  cfg = result['config']
  _, params = workdir_lib.restore_params(workdir, cfg)
  sampling = generation.Sampling(max_new_tokens=12, temperature=0.0)
  runs = [
    generation.generate(generation.sampling_model(cfg), params, [5, 17, 200, 33], sampling, cache=c)
    for c in (True, False)
  ]
  assert runs[0].tolist() == runs[1].tolist()


def test_export_import_export_is_bit_identical(imported, tmp_path):
  holds = 'model.layers.2.mlp.gate.e_score_correction_bias'
  hf_round_trip.check_export(
    imported, tmp_path, transformers.DeepseekV3ForCausalLM, _tokens(), holds
  )


@pytest.mark.parametrize(
  'overrides, match',
  [
    (
      {'rope_scaling': {'rope_type': 'dynamic', 'factor': 4.0}},
      "rope type 'dynamic' is not supported",
    ),
    ({'attention_bias': True}, 'attention_bias=True'),
    ({'tie_word_embeddings': True}, 'tie_word_embeddings=True'),
    ({'num_key_value_heads': 2}, 'num_key_value_heads=2'),
  ],
)
def test_variants_triax_does_not_run_are_refused_in_one_line(overrides, match, tmp_path):
  hf_dir = str(tmp_path / 'hf')
  _hf_model(**overrides).save_pretrained(hf_dir)
  with pytest.raises(ConfigError, match=match) as e:
    hf_checkpoint.import_hf(hf_dir, str(tmp_path / 'w'))
  assert e.value.key == '--hf_dir' and not (tmp_path / 'w').exists()
  assert '\n' not in str(e.value)


def test_rope_pairs_not_interleaved_are_taken_as_they_are(tmp_path):
  model = _hf_model('q_direct', rope_interleave=False)
  _, workdir, result = hf_round_trip.import_sharded(model, tmp_path)
  hf_round_trip.check_logits(model, workdir, result, _tokens())
  out = str(tmp_path / 'out')
  hf_checkpoint.export_hf(workdir, out)
  assert json.load(open(os.path.join(out, 'config.json')))['rope_interleave'] is False


def _with_mtp(imported, workdir):
  """A workdir of the import's model with one MTP module (random weights), at step 0."""
  import harness

  from triax import config as config_lib
  from triax.training import checkpoint as ckpt_lib

  cfg = config_lib.load_json(os.path.join(imported[2], 'config.json'))
  cfg.model.mtp_depth = 1
  trainer = harness.make_trainer(cfg)
  os.makedirs(workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(cfg.to_json())
  ckpt = ckpt_lib.Checkpointer(workdir, trainer.cfg)
  ckpt.save(trainer, trainer.init_state(jax.random.key(1)))
  ckpt.wait()
  ckpt.close()
  return trainer.cfg


def test_mtp_modules_are_refused_on_export_unless_dropped(imported, tmp_path):
  workdir, out = str(tmp_path / 'w'), str(tmp_path / 'out')
  cfg = _with_mtp(imported, workdir)
  with pytest.raises(ConfigError, match='model.mtp_depth=1: .* pass --drop_mtp') as e:
    hf_checkpoint.export_hf(workdir, out)
  assert e.value.key == '--workdir' and not os.path.exists(out)
  hf_checkpoint.export_hf(workdir, out, drop_mtp=True)
  back = transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()
  assert back.config.num_mtp_layers == 0
  _, params = workdir_lib.restore_params(workdir, cfg)
  tokens = _tokens()
  ours = generation.sampling_model(cfg).logits(params, tokens)
  with torch.no_grad():
    theirs = back(torch.from_numpy(tokens).long()).logits.numpy()
  assert np.max(np.abs(np.asarray(ours) - theirs)) <= 1e-4 * np.max(np.abs(theirs))
