"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, model_type
gemma3: 4B and larger) import their text model as the gemma3 family.

A small one with random weights (a 4-layer text model, every 2nd layer global
with a 4-position window, and a one-layer vision tower) is written by
transformers itself, in shards: its text config under `text_config`, its text
tensors under `language_model.model.`, the vision tower and projector beside
them. triax must give its logits on text (one device), leave the vision tower
behind, and export the text model as Gemma3ForCausalLM, which transformers
reads back to the same logits; export -> import -> export is bit-identical.
The Hub's multimodal config.json states only what differs from
Gemma3TextConfig's defaults: such a partial config imports to the same keys.
Nothing is downloaded.
"""

import filecmp
import json
import os

import hf_round_trip
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax.convert import hf_checkpoint, hf_gemma, safetensors_files  # noqa: E402
from triax.model import generation  # noqa: E402
from triax.training import workdir as workdir_lib  # noqa: E402

SEQ = 16
TEXT = dict(
  vocab_size=256,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=SEQ,
  sliding_window=4,
  sliding_window_pattern=2,
  query_pre_attn_scalar=24,
  rope_parameters={
    'full_attention': {'rope_type': 'linear', 'factor': 8.0, 'rope_theta': 1e6},
    'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4},
  },
)
VISION = dict(
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=1,
  num_attention_heads=2,
  image_size=28,
  patch_size=14,
)


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  cfg = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
  model = hf_round_trip.random_model(transformers.Gemma3ForConditionalGeneration, cfg)
  base = tmp_path_factory.mktemp('hf')
  hf_dir, workdir, result = hf_round_trip.import_sharded(model, base)
  return model, hf_dir, workdir, result


def _tokens(batch=2, length=SEQ, seed=0):
  # Below the image tokens' ids (boi, eoi, image: past the vocabulary's text).
  return np.random.default_rng(seed).integers(0, 250, (batch, length)).astype(np.int32)


def _logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


def test_the_text_model_imports_with_transformers_logits(imported):
  model, hf_dir, workdir, result = imported
  m = result['config'].model
  assert (m.family, m.num_layers, m.sliding_window, m.sliding_window_pattern) == (
    'gemma3',
    4,
    4,
    2,
  )
  assert (m.rope_theta, m.rope_local_theta, m.rope_scaling.factor) == (1e6, 1e4, 8.0)
  names = safetensors_files.Shards(hf_dir).names()
  vision = [n for n in names if n.startswith(('vision_tower.', 'multi_modal_projector.'))]
  assert vision and result['left_behind'] == sorted(vision)
  text = model.model.language_model
  assert result['params'] == sum(p.numel() for p in text.parameters())  # no vision weight
  _, params = workdir_lib.restore_params(workdir, result['config'])
  tokens = _tokens()
  ours = generation.sampling_model(result['config']).logits(params, jnp.asarray(tokens))
  theirs = _logits(model, tokens)
  err = np.max(np.abs(np.asarray(ours) - theirs)) / np.max(np.abs(theirs))
  assert err <= 1e-4, err


def test_the_export_is_the_text_model_and_round_trips(imported, tmp_path):
  model, hf_dir, workdir, _ = imported
  first, again, second = (str(tmp_path / n) for n in ('first', 'w2', 'second'))
  exported = hf_checkpoint.export_hf(workdir, first, max_shard_bytes=100_000)
  assert exported['architecture'] == 'Gemma3ForCausalLM'
  source = safetensors_files.read_tensors(hf_dir)
  tensors = safetensors_files.read_tensors(first)
  text = {n[len('language_model.') :]: a for n, a in source.items() if n.startswith('language_')}
  assert set(tensors) == set(text)
  for name, array in text.items():
    np.testing.assert_array_equal(tensors[name], array, err_msg=name)
  hf_checkpoint.import_hf(first, again)
  hf_checkpoint.export_hf(again, second, max_shard_bytes=100_000)
  names = sorted(os.listdir(first))
  assert names == sorted(os.listdir(second)) and len(names) > 2
  _, mismatch, errors = filecmp.cmpfiles(first, second, names, shallow=False)
  assert (mismatch, errors) == ([], []), (mismatch, errors)
  back = transformers.Gemma3ForCausalLM.from_pretrained(first).eval()
  tokens = _tokens(seed=1)
  np.testing.assert_allclose(_logits(back, tokens), _logits(model, tokens), rtol=0, atol=1e-5)


def test_the_hubs_partial_config_imports_to_the_same_keys(imported):
  _, hf_dir, _, result = imported
  with open(os.path.join(hf_dir, 'config.json')) as f:
    full = json.load(f)
  # What the Hub's gemma-3-4b config.json states: the text model's own sizes only.
  defaults = transformers.Gemma3TextConfig().to_dict()
  partial = dict(full)
  partial['text_config'] = {
    k: v for k, v in full['text_config'].items() if k not in defaults or defaults[k] != v
  }
  assert 'query_pre_attn_scalar' in partial['text_config']  # 24, not the default
  assert 'rms_norm_eps' not in partial['text_config']
  assert hf_gemma.model_config(partial, SEQ) == hf_gemma.model_config(full, SEQ)
  assert hf_gemma.model_config(full, SEQ)['num_layers'] == result['config'].model.num_layers
