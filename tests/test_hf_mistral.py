"""Hugging Face Mistral checkpoints against the reference: transformers'
MistralForCausalLM, a Llama whose every layer attends within a sliding window.

A small Mistral with random weights and an 8-token window (a quarter of the
32-token sequence) is written by transformers itself, in shards, then
imported as a llama with model.sliding_window: triax must give its logits
(one device), its training loss and gradients on (data, tensor, pipe) =
(2, 2, 2) under 1F1B and (1, 2, 4) interleaved, and its greedy tokens past
the window; export -> import -> export must be bit-identical and give back
transformers' tensors. Nothing is downloaded.
"""

import harness
import hf_round_trip
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax import config as config_lib  # noqa: E402
from triax.convert import hf_llama  # noqa: E402
from triax.errors import ConfigError  # noqa: E402

SEQ = 32
WINDOW = 8


def _config(**overrides):
  fields = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    sliding_window=WINDOW,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  return transformers.MistralConfig(**{**fields, **overrides})


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  model = hf_round_trip.random_model(transformers.MistralForCausalLM, _config())
  return hf_round_trip.imported(model, tmp_path_factory)


def _tokens(batch=2, length=SEQ, seed=0):
  return hf_round_trip.tokens(length, batch, seed)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.sliding_window, m.sliding_window_pattern) == ('llama', WINDOW, 0)
  tokens = _tokens()
  hf_round_trip.check_logits(model, workdir, result, tokens)
  # The window matters on these tokens: transformers without it gives other logits.
  x = torch.from_numpy(tokens).long()
  with torch.no_grad():
    windowed = model(x).logits.numpy()
    model.config.sliding_window = None
    try:
      whole = model(x).logits.numpy()
    finally:
      model.config.sliding_window = WINDOW
  assert np.max(np.abs(windowed - whole)) > 1e-2


@pytest.mark.parametrize(
  'layout,overrides',
  [
    ((2, 2, 2), {'pipeline.schedule': '1f1b'}),
    ((1, 2, 4), {'pipeline.schedule': 'interleaved_1f1b', 'pipeline.virtual_stages': 2}),
  ],
  ids=['1f1b-2x2x2', 'interleaved-1x2x4'],
)
def test_loss_and_gradients_on_pipelines_are_transformers(imported, layout, overrides):
  model, _, workdir, _ = imported
  tokens = _tokens(4, SEQ + 1, seed=1)
  hf_round_trip.check_loss_and_grad(model, workdir, tokens, layout, overrides=overrides)


def test_greedy_generation_past_the_window_gives_transformers_tokens(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])  # 4 + 12 tokens > WINDOW


def test_export_import_export_is_bit_identical(imported, tmp_path):
  holds = 'model.layers.7.self_attn.k_proj.weight'
  reader = transformers.MistralForCausalLM
  hf_round_trip.check_export(imported, tmp_path, reader, _tokens(), holds)
  exported = hf_llama.hf_config(imported[3]['config'].model)
  assert (exported['model_type'], exported['sliding_window']) == ('mistral', WINDOW)


@pytest.mark.fast
def test_a_window_at_least_the_sequence_imports_as_global():
  hf = _config(sliding_window=SEQ).to_dict()
  assert 'sliding_window' not in hf_llama.model_config(hf, SEQ)
  assert hf_llama.model_config(hf, SEQ * 2)['sliding_window'] == SEQ


@pytest.mark.fast
def test_windows_mistral_cannot_hold_are_refused():
  hf = transformers.Qwen2Config(use_sliding_window=True, sliding_window=4).to_dict()
  with pytest.raises(ConfigError, match='mistral only') as e:
    hf_llama.model_config(hf, 16)
  assert e.value.key == '--hf_dir'
  model = config_lib.defaults().model
  model.update(family='llama', sliding_window=4, sliding_window_pattern=2)
  with pytest.raises(ConfigError, match='window on every layer') as e:
    hf_llama.hf_config(model)
  assert e.value.key == '--workdir'
  model.update(sliding_window_pattern=0, qkv_bias=True)
  with pytest.raises(ConfigError, match='window on every layer'):
    hf_llama.hf_config(model)


def test_convert_imports_a_window_shorter_than_the_context(imported, tmp_path):
  _, hf_dir, _, _ = imported
  made = harness.run_cli('triax', 'convert', f'--hf_dir={hf_dir}', f'--workdir={tmp_path}/w')
  assert made.returncode == 0, made.stderr[-2000:]
  assert f'a {WINDOW}-position window), checkpoint at step 0' in made.stderr
