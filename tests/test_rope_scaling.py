"""YaRN RoPE scaling (model.rope_scaling.rope_type=yarn) against the reference:
transformers' _compute_yarn_parameters and yarn_apply_mscale, and the models
that use them, DeepseekV3ForCausalLM and Qwen3ForCausalLM.

The frequencies and both factors are compared on DeepSeek-V3's, V2-Lite's
and Qwen3's own settings. Small models with random weights and YaRN (factor
4 over an original context of 8 tokens, shorter than the 32 run; a ramp of
the frequencies strictly between kept and slowed; mscale and mscale_all_dim
set, so that cos and sin and DeepSeek's softmax scale all move) are written
by transformers and imported: triax must give their logits (fp32, to 1e-4),
their greedy tokens (DeepSeek: with and without its latent cache), and an
export round trip bit-identical that transformers reads back to the same
logits. A key of the other rope_type is refused in one line. Nothing is
downloaded.
"""

import hf_round_trip
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from transformers import modeling_rope_utils  # noqa: E402

from triax import config as config_lib  # noqa: E402
from triax.errors import ConfigError  # noqa: E402
from triax.model import generation, registry  # noqa: E402
from triax.training import workdir as workdir_lib  # noqa: E402

SEQ = 32
# factor 4 over 8 original positions; betas that put a partial ramp in 8- and 32-wide heads.
YARN = {
  'rope_type': 'yarn',
  'factor': 4.0,
  'original_max_position_embeddings': 8,
  'beta_fast': 4.0,
  'beta_slow': 0.25,
  'mscale': 0.9,
  'mscale_all_dim': 0.7,
}
# HF rope entries of real models (their config.json's): (dims rotated, rope_theta, the entry).
DEEPSEEK_V3 = {'type': 'yarn', 'factor': 40, 'beta_fast': 32, 'beta_slow': 1, 'mscale': 1.0}
REAL = {
  'deepseek_v3': (
    64,
    10000.0,
    {**DEEPSEEK_V3, 'mscale_all_dim': 1.0, 'original_max_position_embeddings': 4096},
  ),
  'deepseek_v2_lite': (
    64,
    10000.0,
    {
      **DEEPSEEK_V3,
      'mscale': 0.707,
      'mscale_all_dim': 0.707,
      'original_max_position_embeddings': 4096,
    },
  ),
  'qwen3': (
    128,
    1e6,
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32768},
  ),
}


def _spec(dim: int, theta: float, entry: dict):
  """triax's deepseek spec (rotating `dim` dims) for an HF rope entry, through the importer."""
  from triax.convert import hf_llama

  _, scaling = hf_llama.rope_from_hf({'rope_scaling': entry, 'max_position_embeddings': SEQ})
  m = config_lib.defaults().model
  m.update(family='deepseek', qk_rope_head_dim=dim, rope_theta=theta)
  m.rope_scaling.update(scaling)
  return registry.spec_from_config(m)


@pytest.mark.parametrize('name', list(REAL))
def test_frequencies_and_factors_are_transformers(name):
  from triax.model import llama

  dim, theta, entry = REAL[name]
  context = int(entry['factor'] * entry['original_max_position_embeddings'])
  hf = transformers.DeepseekV3Config(
    qk_rope_head_dim=dim,
    rope_scaling={**entry, 'rope_theta': theta},
    max_position_embeddings=context,
  )
  inv_freq, attention_factor = modeling_rope_utils._compute_yarn_parameters(hf)
  spec = _spec(dim, theta, entry)
  # XLA's and torch's fp32 powers may differ in their last places.
  np.testing.assert_allclose(np.asarray(llama.rope_frequencies(spec)), inv_freq.numpy(), rtol=1e-6)
  assert spec.rope_scaling.attention_factor == attention_factor
  softmax = modeling_rope_utils.yarn_apply_mscale(hf.rope_parameters, 1.0)
  assert spec.rope_scaling.softmax_factor == pytest.approx(softmax, rel=1e-15)
  cos, _ = llama.rope_tables(spec, jnp.arange(4))
  assert np.asarray(cos)[0, 0] == np.float32(attention_factor)  # position 0: cos 1, scaled


def _tokens(batch=2, length=SEQ, seed=0):
  return hf_round_trip.tokens(length, batch, seed)


def _deepseek():
  cfg = transformers.DeepseekV3Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    num_experts_per_tok=2,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=SEQ,
    rope_scaling={**YARN, 'rope_theta': 100.0},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  model = hf_round_trip.random_model(transformers.DeepseekV3ForCausalLM, cfg, ['mlp.gate.weight'])
  with torch.no_grad():  # a buffer, which random_model leaves at zeros
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    bias.copy_(0.1 * torch.randn_like(bias))
  return model


def _qwen3():
  cfg = transformers.Qwen3Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=SEQ,
    rope_scaling={**YARN, 'rope_theta': 1e6},
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  return hf_round_trip.random_model(transformers.Qwen3ForCausalLM, cfg)


# name -> (the transformers model, a tensor its export must hold)
MODELS = {
  'deepseek': (_deepseek, 'model.layers.1.mlp.gate.e_score_correction_bias'),
  'qwen3': (_qwen3, 'model.layers.1.self_attn.k_norm.weight'),
}


@pytest.fixture(scope='module', params=list(MODELS))
def imported(request, tmp_path_factory):
  model = MODELS[request.param][0]()
  return hf_round_trip.imported(model, tmp_path_factory)


def test_import_holds_yarn_and_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  r = result['config'].model.rope_scaling
  assert {key: r[key] for key in YARN} == YARN
  assert r.low_freq_factor == 1.0 and r.high_freq_factor == 4.0  # llama3's keys at their defaults
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_greedy_tokens_are_transformers_cached_or_not(imported):
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
  model = imported[0]
  name = 'deepseek' if 'Deepseek' in type(model).__name__ else 'qwen3'
  hf_round_trip.check_export(imported, tmp_path, type(model), _tokens(), MODELS[name][1])


@pytest.mark.parametrize(
  'rope_type, key, value',
  [('yarn', 'low_freq_factor', 2.0), ('llama3', 'beta_fast', 8.0), ('llama3', 'mscale', 1.0)],
)
def test_a_key_of_the_other_rope_type_is_refused_in_one_line(rope_type, key, value):
  cfg = config_lib.defaults()
  cfg.model.family = 'llama'
  cfg.model.rope_scaling.update(rope_type=rope_type, factor=4.0, **{key: value})
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert e.value.key == f'model.rope_scaling.{key}' and '\n' not in str(e.value)
  assert f'rope_type={"llama3" if rope_type == "yarn" else "yarn"}' in e.value.message


@pytest.mark.parametrize(
  'entry, match',
  [
    ({**YARN, 'attention_factor': 1.5}, 'attention_factor=1.5'),
    ({**YARN, 'truncate': False}, 'truncate=False'),
    ({'rope_type': 'longrope', 'factor': 4.0}, "rope type 'longrope' is not supported"),
  ],
)
def test_yarn_variants_triax_does_not_run_are_refused_on_import(entry, match):
  from triax.convert import hf_llama

  with pytest.raises(ConfigError, match=match) as e:
    hf_llama.rope_from_hf({'rope_scaling': entry, 'max_position_embeddings': SEQ})
  assert e.value.key == '--hf_dir' and '\n' not in str(e.value)


@pytest.mark.fast
def test_linear_scaling_is_transformers_and_round_trips():
  """Gemma 3's kind (and Llama's older one): every frequency / factor, no attention factor."""
  from triax.convert import hf_llama
  from triax.model import llama

  rope = {'rope_type': 'linear', 'factor': 8.0, 'rope_theta': 1e4}
  hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope)
  inv_freq, attention_factor = modeling_rope_utils._compute_linear_scaling_rope_parameters(hf)
  theta, scaling = hf_llama.rope_from_hf(hf.to_dict())
  m = config_lib.defaults().model
  m.update(family='llama', d_model=64, num_heads=4, rope_theta=theta)
  m.rope_scaling.update(scaling)
  spec = registry.spec_from_config(m)
  np.testing.assert_allclose(np.asarray(llama.rope_frequencies(spec)), inv_freq.numpy(), rtol=1e-6)
  assert attention_factor == spec.rope_scaling.attention_factor == 1.0
  assert hf_llama.rope_scaling_hf(m.rope_scaling) == {'rope_type': 'linear', 'factor': 8.0}
