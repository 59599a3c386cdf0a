"""Hugging Face Gemma 3 text checkpoints (`Gemma3ForCausalLM`, model_type gemma3_text)
<-> the gemma3 family's parameters and config.

Tensors map as llama's do (transposes and reshapes, nothing permuted; the norms' weights
as stored, w of 1 + w): `input_layernorm` -> 'attn_norm', `post_attention_layernorm`
-> 'post_attn_norm', `pre_feedforward_layernorm` -> 'mlp_norm',
`post_feedforward_layernorm` -> 'post_mlp_norm', `self_attn.{q,k}_norm` -> 'q_norm',
'k_norm'; the embedding is the output layer (tied). The config's per-layer kinds
(`layer_types`, or the older `sliding_window_pattern`) must repeat every Nth layer global
(model.sliding_window_pattern); the local layers' RoPE (`rope_parameters`'
sliding_attention, or the older `rope_local_base_freq`) must be unscaled. Logit
soft-capping (Gemma 2's) is refused: Gemma 3 has none.

Gemma 3's multimodal checkpoints (4B and larger: `Gemma3ForConditionalGeneration`,
model_type gemma3) import their text model: its config is `text_config` (over
Gemma3TextConfig's defaults, which the Hub's files leave out), its tensors are under
`language_model.model.` (as the Hub stores them and transformers 5 writes them), and the
vision tower and its projector (`vision_tower.`, `multi_modal_projector.`) are left
behind. Such a run exports as `Gemma3ForCausalLM`, the text model, which transformers
reads as the language model of the original.

Everything here is numpy and data: convert/hf_checkpoint.py streams the tensors through it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from triax import config as config_lib
from triax.convert import hf_llama, rules
from triax.errors import ConfigError

MODEL_TYPES = {
  'gemma3_text': ('gemma3', 'Gemma3ForCausalLM'),
  'gemma3': ('gemma3', 'Gemma3ForConditionalGeneration'),
}
FAMILIES = ('gemma3',)
_KIND = 'gemma3_text'
_MULTIMODAL = 'gemma3'
# Where a multimodal checkpoint keeps its text model, and what it holds besides.
_TEXT_PREFIX = 'language_model.'
_VISION_PREFIXES = ('vision_tower.', 'multi_modal_projector.')
# Gemma3TextConfig's defaults (transformers) of the keys read here: the Hub's
# multimodal config.json states only those its text model changes.
_TEXT_DEFAULTS = {
  'vocab_size': 262208,
  'hidden_size': 2304,
  'intermediate_size': 9216,
  'num_hidden_layers': 26,
  'num_attention_heads': 8,
  'num_key_value_heads': 4,
  'head_dim': 256,
  'query_pre_attn_scalar': 256,
  'sliding_window': 4096,
  'sliding_window_pattern': 6,
  'rms_norm_eps': 1e-6,
  'max_position_embeddings': 131072,
  'rope_theta': 1_000_000.0,
  'rope_local_base_freq': 10_000.0,
}


def _multimodal(hf: Mapping | None) -> bool:
  return (hf or {}).get('model_type') == _MULTIMODAL


def text_config(hf: Mapping) -> dict:
  """The text model's config of an HF Gemma 3 config: itself (gemma3_text), or a
  multimodal one's `text_config` over Gemma3TextConfig's defaults, with the top
  level's tie_word_embeddings and dtype."""
  if not _multimodal(hf):
    return dict(hf)
  text = hf.get('text_config') or {}
  out = {**_TEXT_DEFAULTS, **text}
  for key in ('tie_word_embeddings', 'dtype', 'torch_dtype'):
    if key in hf and key not in text:
      out[key] = hf[key]
  return out


# HF config keys that must hold these values: what triax's gemma3 runs.
_REQUIRED = {
  'hidden_activation': 'gelu_pytorch_tanh',
  'attention_bias': False,
  'final_logit_softcapping': None,
  'attn_logit_softcapping': None,
  'use_bidirectional_attention': False,
  'tie_word_embeddings': True,
}
_LOCAL, _GLOBAL = 'sliding_attention', 'full_attention'


def model_config(hf: Mapping, seq_len: int) -> dict:
  """The config.model keys of an HF Gemma3TextConfig (as a dict), for `seq_len` tokens.

  Raises:
    ConfigError('--hf_dir', ...): a variant triax does not run.
  """
  hf = text_config(hf)
  for key, value in _REQUIRED.items():
    if hf.get(key, value) != value:
      raise ConfigError('--hf_dir', f'config.json: {key}={hf[key]!r}; triax runs {value!r} only')
  d, n = hf['hidden_size'], hf['num_attention_heads']
  head_dim = hf.get('head_dim') or d // n
  theta, scaling, local_theta = _rope(hf)
  return {
    'family': 'gemma3',
    'num_layers': hf['num_hidden_layers'],
    'd_model': d,
    'num_heads': n,
    'head_dim': 0 if head_dim == d // n else head_dim,
    'num_kv_heads': hf.get('num_key_value_heads') or n,
    'd_ff': hf['intermediate_size'],
    'vocab_size': hf['vocab_size'],
    'seq_len': seq_len,
    'rope_theta': theta,
    'rope_scaling': scaling,
    'rope_local_theta': local_theta,
    'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
    'query_pre_attn_scalar': float(hf.get('query_pre_attn_scalar', 256)),
    # A window of None or past seq_len spans the sequence; its layers stay local (their base).
    'sliding_window': min(hf.get('sliding_window') or seq_len, seq_len),
    'sliding_window_pattern': _pattern(hf),
  }


def _rope(hf: Mapping) -> tuple[float, dict, float]:
  """(global base, model.rope_scaling, local base) from transformers 5's
  per-kind `rope_parameters`, or the older rope_theta, rope_scaling and
  rope_local_base_freq."""
  params = hf.get('rope_parameters') or {}
  if _GLOBAL in params or _LOCAL in params:
    theta, scaling = hf_llama.rope_from_hf({'rope_parameters': params.get(_GLOBAL) or {}})
    local = params.get(_LOCAL) or {}
    if (local.get('rope_type') or local.get('type') or 'default') != 'default':
      raise ConfigError(
        '--hf_dir',
        f"config.json: the local layers' RoPE is scaled ({local}); triax runs it unscaled",
      )
    return theta, scaling, float(local.get('rope_theta', 10000.0))
  theta, scaling = hf_llama.rope_from_hf({k: v for k, v in hf.items() if k != 'rope_parameters'})
  return theta, scaling, float(hf.get('rope_local_base_freq', 10000.0))


def _pattern(hf: Mapping) -> int:
  """model.sliding_window_pattern of the config's layer kinds: N when every
  Nth layer is global, 0 when every layer is local.

  Raises:
    ConfigError('--hf_dir', ...): kinds that repeat no such pattern.
  """
  layers = hf['num_hidden_layers']
  kinds = hf.get('layer_types') or _kinds(layers, int(hf.get('sliding_window_pattern', 6)))
  n = kinds.index(_GLOBAL) + 1 if _GLOBAL in kinds else 0
  if list(kinds) != _kinds(layers, n):
    raise ConfigError(
      '--hf_dir',
      f'config.json: layer_types {kinds} do not make every Nth layer global; triax runs that '
      'pattern only (model.sliding_window_pattern)',
    )
  return n


def _kinds(layers: int, n: int) -> list[str]:
  """transformers' layer_types of sliding_window_pattern n (0: every layer local)."""
  return [_GLOBAL if n and (i + 1) % n == 0 else _LOCAL for i in range(layers)]


def _number(x: float):
  """x as JSON writes HF's integral values (query_pre_attn_scalar 256, not 256.0)."""
  return int(x) if float(x).is_integer() else x


def hf_config(model_cfg, base: Mapping | None = None) -> dict:
  """An HF Gemma3TextConfig dict for config.model, over `base` (the imported
  checkpoint's own config.json, so its token ids and the like survive; a
  multimodal one's text model: `text_config`)."""
  m = model_cfg
  out = text_config(base) if base else {}
  for key in ('_sliding_window_pattern', 'rope_local_base_freq', 'sliding_window_pattern'):
    out.pop(key, None)
  stale = ('rope_parameters', 'rope_scaling', 'rope_theta', 'rope_local_base_freq')
  for key in stale + ('sliding_window_pattern',):  # layer_types says the pattern
    out.pop(key, None)
  hd = config_lib.head_dim(m)
  out.update(
    architectures=[MODEL_TYPES[_KIND][1]],
    model_type=_KIND,
    hidden_size=m.d_model,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads or m.num_heads,
    head_dim=hd,
    intermediate_size=m.d_ff,
    vocab_size=m.vocab_size,
    max_position_embeddings=(base or {}).get('max_position_embeddings', m.seq_len),
    rms_norm_eps=m.norm_eps,
    tie_word_embeddings=True,
    hidden_activation='gelu_pytorch_tanh',
    attention_bias=False,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    query_pre_attn_scalar=_number(m.query_pre_attn_scalar or hd),
    sliding_window=m.sliding_window,
    layer_types=_kinds(m.num_layers, m.sliding_window_pattern),
    torch_dtype=m.param_dtype,
    rope_parameters={
      _GLOBAL: {'rope_type': 'default', 'rope_theta': m.rope_theta},
      _LOCAL: {'rope_type': 'default', 'rope_theta': m.rope_local_theta},
    },
  )
  scaling = hf_llama.rope_scaling_hf(m.rope_scaling)
  if scaling:
    out['rope_parameters'][_GLOBAL].update(scaling)
  return out


def _layer_names(i: int, prefix: str) -> dict[str, str]:
  """Layer i's HF tensor name of each triax layer key, in HF's order."""
  p = f'{prefix}model.layers.{i}.'
  return {
    'attn_norm': p + 'input_layernorm.weight',
    'wq': p + 'self_attn.q_proj.weight',
    'wk': p + 'self_attn.k_proj.weight',
    'wv': p + 'self_attn.v_proj.weight',
    'wo': p + 'self_attn.o_proj.weight',
    'q_norm': p + 'self_attn.q_norm.weight',
    'k_norm': p + 'self_attn.k_norm.weight',
    'post_attn_norm': p + 'post_attention_layernorm.weight',
    'mlp_norm': p + 'pre_feedforward_layernorm.weight',
    'post_mlp_norm': p + 'post_feedforward_layernorm.weight',
    'w_gate': p + 'mlp.gate_proj.weight',
    'w_up': p + 'mlp.up_proj.weight',
    'w_down': p + 'mlp.down_proj.weight',
  }


def _shapes(m) -> dict[str, tuple[int, ...]]:
  """Each layer weight's triax shape (without the layer axis)."""
  n, kv, d, f = m.num_heads, m.num_kv_heads or m.num_heads, m.d_model, m.d_ff
  hd = config_lib.head_dim(m)
  norms = {key: (d,) for key in ('attn_norm', 'post_attn_norm', 'mlp_norm', 'post_mlp_norm')}
  return {
    **norms,
    'wq': (d, n, hd),
    'wk': (d, kv, hd),
    'wv': (d, kv, hd),
    'wo': (n, hd, d),
    'q_norm': (hd,),
    'k_norm': (hd,),
    'w_gate': (d, f),
    'w_up': (d, f),
    'w_down': (f, d),
  }


def tensor_rules(model_cfg, dtype, hf: Mapping | None = None) -> list[rules.TensorRule]:
  """The HF tensors of a gemma3 config <-> its parameter leaves, imported as
  `dtype` (convert/rules.py); `hf`, the checkpoint's config.json, says where
  they are (a multimodal one's under `language_model.`)."""
  m = model_cfg
  prefix = _TEXT_PREFIX if _multimodal(hf) else ''
  layers = [_layer_names(i, prefix) for i in range(m.num_layers)]
  shapes = _shapes(m)
  table = (m.vocab_size, m.d_model)
  embed = prefix + 'model.embed_tokens.weight'
  out = [rules.reshaped(embed, ('embed', 'tokens'), table, dtype, table)]
  for key in layers[0]:
    names, path, shape = [names[key] for names in layers], ('layers', key), shapes[key]
    if len(shape) == 1:
      out.append(rules.reshaped(names, path, shape, dtype))
    else:
      # wo's inputs are its (head, head_dim) dims
      out.append(rules.linear(names, path, shape, dtype, ins=2 if key == 'wo' else 1))
  out.append(rules.reshaped(prefix + 'model.norm.weight', ('head', 'norm'), (m.d_model,), dtype))
  return out


def ignored(names, model_cfg, hf: Mapping | None = None) -> set[str]:
  """What an import leaves out of `names`: the tied table's copy as lm_head.weight;
  a multimodal checkpoint's vision tower and projector, and its lm_head copy."""
  out = hf_llama.ignored(names, model_cfg)
  if _multimodal(hf):
    copy = _TEXT_PREFIX + 'lm_head.weight'
    out |= {n for n in names if n.startswith(_VISION_PREFIXES) or n == copy}
  return out


def params_to_hf(params: Mapping, model_cfg, hf: Mapping | None = None) -> dict[str, np.ndarray]:
  """HF tensors (numpy, the params' dtype) of a gemma3 parameter tree held in memory."""
  del hf
  return rules.params_to_hf(tensor_rules(model_cfg, model_cfg.param_dtype), params)
