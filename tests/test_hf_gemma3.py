"""Hugging Face Gemma 3 (text) checkpoints against the reference: transformers'
Gemma3ForCausalLM, the gemma3 family.

A small Gemma 3 with random weights is written by transformers itself, in
shards, then imported: 8 layers, every 3rd global (so pipeline chunks start
mid-pattern), an 8-position window (a quarter of the 32-token sequence, half
a context shard at context 2), its local layers rotating with their own base
and the global ones with linear RoPE scaling (Gemma 3's larger sizes'),
query_pre_attn_scalar unlike head_dim, and norms away from their zero init.
triax must give its logits (one device), its training loss and gradients on
(data, tensor, pipe) = (2, 2, 2) under 1F1B, (1, 2, 4) interleaved and at
context 2 with ring and all-gather attention, and its greedy tokens past the
window, cached and uncached; export -> import -> export must be bit-identical
and give back transformers' tensors. Nothing is downloaded.
"""

import hf_round_trip
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

import harness  # noqa: E402

from triax import config as config_lib  # noqa: E402
from triax.convert import hf_gemma  # noqa: E402
from triax.errors import ConfigError  # noqa: E402
from triax.model import generation  # noqa: E402
from triax.training import workdir as workdir_lib  # noqa: E402

SEQ = 32
WINDOW = 8
PATTERN = 3
ROPE = {
  'full_attention': {'rope_type': 'linear', 'factor': 8.0, 'rope_theta': 1e6},
  'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4},
}


def _config(**overrides):
  fields = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=SEQ,
    sliding_window=WINDOW,
    sliding_window_pattern=PATTERN,
    query_pre_attn_scalar=24,
    rms_norm_eps=1e-6,
    rope_parameters={k: dict(v) for k, v in ROPE.items()},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  return transformers.Gemma3TextConfig(**{**fields, **overrides})


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  model = hf_round_trip.random_model(transformers.Gemma3ForCausalLM, _config())
  return hf_round_trip.imported(model, tmp_path_factory)


def _tokens(batch=2, length=SEQ, seed=0):
  return hf_round_trip.tokens(length, batch, seed)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.sliding_window, m.sliding_window_pattern) == ('gemma3', WINDOW, PATTERN)
  assert (m.rope_theta, m.rope_local_theta, m.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
  assert (m.rope_scaling.rope_type, m.rope_scaling.factor) == ('linear', 8.0)
  hf_round_trip.check_logits(model, workdir, result, _tokens())


def test_a_window_spanning_the_sequence_keeps_its_layers_local(imported, tmp_path):
  """Imported for 8 positions, the 8-position window spans the sequence: its
  layers see every key but still rotate with the local base (transformers' logits)."""
  from triax.convert import hf_checkpoint

  model, hf_dir, _, _ = imported
  workdir = str(tmp_path / 'w8')
  result = hf_checkpoint.import_hf(hf_dir, workdir, seq_len=WINDOW)
  m = result['config'].model
  assert (m.seq_len, m.sliding_window, m.sliding_window_pattern) == (WINDOW, WINDOW, PATTERN)
  hf_round_trip.check_logits(model, workdir, result, _tokens(length=WINDOW))


@pytest.mark.parametrize(
  'layout,overrides',
  [
    ((2, 2, 2), {'pipeline.schedule': '1f1b'}),
    ((1, 2, 4), {'pipeline.schedule': 'interleaved_1f1b', 'pipeline.virtual_stages': 2}),
    ((2, 2, 1), {'mesh.context': 2, 'model.context_attention': 'ring'}),
    ((2, 2, 1), {'mesh.context': 2, 'model.context_attention': 'allgather'}),
  ],
  ids=['1f1b-2x2x2', 'interleaved-1x2x4', 'ring-context-2', 'allgather-context-2'],
)
def test_loss_and_gradients_on_layouts_are_transformers(imported, layout, overrides):
  model, _, workdir, _ = imported
  tokens = _tokens(4, SEQ + 1, seed=1)
  hf_round_trip.check_loss_and_grad(model, workdir, tokens, layout, overrides=overrides)


def test_greedy_tokens_past_the_window_are_transformers_cached_and_uncached(imported):
  model, _, workdir, result = imported
  cfg = result['config']
  hf_round_trip.check_greedy(model, workdir, cfg)  # cached on both sides: 4 + 12 > WINDOW
  _, params = workdir_lib.restore_params(workdir, cfg)
  prompt = [5, 17, 200, 33]
  sampling = generation.Sampling(max_new_tokens=12, temperature=0.0)
  ours = generation.generate(generation.sampling_model(cfg), params, prompt, sampling, cache=False)
  with torch.no_grad():
    theirs = model.generate(
      torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12, use_cache=False
    )[0, len(prompt) :].numpy()
  assert ours.tolist() == theirs.tolist()


def test_export_import_export_is_bit_identical(imported, tmp_path):
  holds = 'model.layers.7.post_feedforward_layernorm.weight'
  reader = transformers.Gemma3ForCausalLM
  hf_round_trip.check_export(imported, tmp_path, reader, _tokens(), holds)
  exported = hf_gemma.hf_config(imported[3]['config'].model)
  assert exported['model_type'] == 'gemma3_text'
  assert exported['layer_types'] == _config().layer_types


@pytest.mark.fast
def test_older_configs_and_long_windows_import():
  """rope_theta, rope_local_base_freq and rope_scaling (the Hub's Gemma 3
  files) read as transformers 5's rope_parameters; a window past seq_len
  spans it, its layers still local."""
  hf = {k: v for k, v in _config().to_dict().items() if k not in ('rope_parameters', 'layer_types')}
  hf.update(
    rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={'rope_type': 'linear', 'factor': 8.0}
  )
  m = hf_gemma.model_config(hf, 4)
  assert (m['rope_theta'], m['rope_local_theta'], m['rope_scaling']['factor']) == (1e6, 1e4, 8.0)
  assert (m['sliding_window'], m['sliding_window_pattern']) == (4, PATTERN)


@pytest.mark.fast
@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'final_logit_softcapping': 30.0}, 'final_logit_softcapping=30.0'),
    ({'attn_logit_softcapping': 50.0}, 'attn_logit_softcapping=50.0'),
    ({'hidden_activation': 'gelu'}, 'hidden_activation'),
    ({'layer_types': ['full_attention'] + ['sliding_attention'] * 7}, 'every Nth layer global'),
  ],
  ids=['final-softcap', 'attn-softcap', 'activation', 'pattern'],
)
def test_variants_gemma3_does_not_run_are_refused(overrides, message):
  hf = _config(**overrides).to_dict()
  with pytest.raises(ConfigError, match=message) as e:
    hf_gemma.model_config(hf, SEQ)
  assert e.value.key == '--hf_dir'


def _gemma_config(**fields):
  cfg = harness.tiny_config(
    **{
      'model.family': 'gemma3',
      'model.num_layers': 4,
      'model.sliding_window': 4,
      'model.sliding_window_pattern': 2,
      **fields,
    }
  )
  return cfg


@pytest.mark.fast
@pytest.mark.parametrize(
  'fields,key,message',
  [
    ({'model.sliding_window': 0}, 'model.sliding_window', 'must be 1..model.seq_len'),
    ({'model.sliding_window_pattern': 1}, 'model.sliding_window_pattern', 'every layer global'),
    ({'model.rope_local_theta': 0.0}, 'model.rope_local_theta', 'positive'),
    ({'model.query_pre_attn_scalar': -1.0}, 'model.query_pre_attn_scalar', '>= 0'),
    ({'model.qk_norm': True}, 'model.qk_norm', 'does not use'),
    ({'model.tie_embeddings': True}, 'model.tie_embeddings', 'does not use'),
  ],
  ids=['no-window', 'all-global', 'local-theta', 'scalar', 'qk-norm', 'tie'],
)
def test_bad_gemma3_keys_are_refused_naming_the_key(fields, key, message):
  config_lib.validate(_gemma_config(), 8)
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.validate(_gemma_config(**fields), 8)
  assert e.value.key == key
