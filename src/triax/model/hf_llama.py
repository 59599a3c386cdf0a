"""Hugging Face Llama checkpoints <-> the llama family's parameters and config.

transformers' `LlamaForCausalLM` defines what a Llama checkpoint means: its
config.json names the shapes, and its tensors (one `model.safetensors` or
shards listed in `model.safetensors.index.json`) are PyTorch `Linear`
weights, [out, in]. llama.py keeps the head dimension in HF's stored order
and rotates with HF's half-split `rotate_half`, so a weight maps by a
transpose and a reshape, and nothing is permuted (Meta's original
checkpoints interleave rotary pairs; transformers' own conversion script
permuted q/k to the half-split order once, so every HF checkpoint has it).

Everything here is numpy: the training room puts the arrays into a train
state (training/hf_checkpoint.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np

from triax.errors import ConfigError

INDEX_FILE = 'model.safetensors.index.json'
SINGLE_FILE = 'model.safetensors'

# HF config keys that must hold these values: triax's llama has no other variant.
_REQUIRED = {
  'hidden_act': 'silu',
  'attention_bias': False,
  'mlp_bias': False,
}


def _rope(hf: Mapping) -> tuple[float, dict]:
  """(rope_theta, rope_scaling fields) from an HF config: transformers 5 keeps
  them in `rope_parameters`, earlier versions in `rope_theta` and `rope_scaling`."""
  params = dict(hf.get('rope_parameters') or {})
  scaling = dict(hf.get('rope_scaling') or {})
  theta = params.get('rope_theta', hf.get('rope_theta', 10000.0))
  kind = params.get('rope_type') or scaling.get('rope_type') or scaling.get('type') or 'default'
  source = params if params.get('rope_type') == 'llama3' else scaling
  if kind == 'default':
    return float(theta), {'factor': 0.0}
  if kind != 'llama3':
    raise ConfigError(
      '--hf_dir', f"config.json: rope type {kind!r} is not supported (only 'default' and 'llama3')"
    )
  return float(theta), {
    'factor': float(source['factor']),
    'low_freq_factor': float(source['low_freq_factor']),
    'high_freq_factor': float(source['high_freq_factor']),
    'original_max_position_embeddings': int(source['original_max_position_embeddings']),
  }


def model_config(hf: Mapping, seq_len: int) -> dict:
  """The config.model keys of an HF LlamaConfig (as a dict), for `seq_len` tokens.

  Raises:
    ConfigError('--hf_dir', ...): not a Llama, or a variant triax does not run.
  """
  if hf.get('model_type') != 'llama':
    raise ConfigError(
      '--hf_dir', f'config.json: model_type {hf.get("model_type")!r}; only llama is converted'
    )
  for key, value in _REQUIRED.items():
    if hf.get(key, value) != value:
      raise ConfigError('--hf_dir', f'config.json: {key}={hf[key]!r}; triax runs {value!r} only')
  d, n = hf['hidden_size'], hf['num_attention_heads']
  if hf.get('head_dim') not in (None, d // n) or d % n:
    raise ConfigError(
      '--hf_dir',
      f'config.json: head_dim={hf.get("head_dim")} is not hidden_size/num_attention_heads',
    )
  theta, scaling = _rope(hf)
  return {
    'family': 'llama',
    'num_layers': hf['num_hidden_layers'],
    'd_model': d,
    'num_heads': n,
    'num_kv_heads': hf.get('num_key_value_heads') or n,
    'd_ff': hf['intermediate_size'],
    'vocab_size': hf['vocab_size'],
    'seq_len': seq_len,
    'rope_theta': theta,
    'rope_scaling': scaling,
    'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
    'tie_embeddings': bool(hf.get('tie_word_embeddings', False)),
  }


def hf_config(model_cfg, base: Mapping | None = None) -> dict:
  """An HF LlamaConfig dict for config.model, over `base` (the imported
  checkpoint's own config.json, so its token ids and the like survive)."""
  m = model_cfg
  out = dict(base or {})
  for key in ('rope_parameters', 'rope_scaling', 'rope_theta'):
    out.pop(key, None)
  out.update(
    architectures=['LlamaForCausalLM'],
    model_type='llama',
    hidden_size=m.d_model,
    intermediate_size=m.d_ff,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads or m.num_heads,
    head_dim=m.d_model // m.num_heads,
    vocab_size=m.vocab_size,
    max_position_embeddings=(base or {}).get('max_position_embeddings', m.seq_len),
    rms_norm_eps=m.norm_eps,
    tie_word_embeddings=m.tie_embeddings,
    hidden_act='silu',
    attention_bias=False,
    mlp_bias=False,
    torch_dtype=m.param_dtype,
    rope_theta=m.rope_theta,
  )
  r = m.rope_scaling
  if r.factor:
    out['rope_scaling'] = {
      'rope_type': 'llama3',
      'factor': r.factor,
      'low_freq_factor': r.low_freq_factor,
      'high_freq_factor': r.high_freq_factor,
      'original_max_position_embeddings': r.original_max_position_embeddings,
    }
  return out


def read_tensors(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of an HF checkpoint directory (sharded or one file), as numpy."""
  from safetensors.numpy import load_file

  index = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)['weight_map'].values()))
  elif os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
    files = [SINGLE_FILE]
  else:
    raise ConfigError(
      '--hf_dir', f'{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} (safetensors only)'
    )
  tensors = {}
  for name in files:
    path = os.path.join(hf_dir, name)
    if not os.path.isfile(path):
      raise ConfigError('--hf_dir', f'{INDEX_FILE} names {name}, which is missing')
    try:
      tensors.update(load_file(path))
    except Exception as e:  # pylint: disable=broad-except  # safetensors' errors name no type
      raise ConfigError('--hf_dir', f'{path}: not a readable safetensors file ({e})') from None
  return tensors


def _layer_names(i: int) -> dict[str, str]:
  p = f'model.layers.{i}.'
  return {
    'attn_norm': p + 'input_layernorm.weight',
    'wq': p + 'self_attn.q_proj.weight',
    'wk': p + 'self_attn.k_proj.weight',
    'wv': p + 'self_attn.v_proj.weight',
    'wo': p + 'self_attn.o_proj.weight',
    'mlp_norm': p + 'post_attention_layernorm.weight',
    'w_gate': p + 'mlp.gate_proj.weight',
    'w_up': p + 'mlp.up_proj.weight',
    'w_down': p + 'mlp.down_proj.weight',
  }


def _shapes(m) -> dict[str, tuple[int, ...]]:
  """Each layer weight's triax shape (without the layer axis)."""
  n, kv, d, f = m.num_heads, m.num_kv_heads or m.num_heads, m.d_model, m.d_ff
  hd = d // n
  return {
    'attn_norm': (d,),
    'wq': (d, n, hd),
    'wk': (d, kv, hd),
    'wv': (d, kv, hd),
    'wo': (n, hd, d),
    'mlp_norm': (d,),
    'w_gate': (d, f),
    'w_up': (d, f),
    'w_down': (f, d),
  }


def params_from_hf(tensors: Mapping[str, np.ndarray], model_cfg, dtype) -> dict:
  """The llama parameter tree (numpy, `dtype`) of an HF checkpoint's tensors.

  Raises:
    ConfigError('--hf_dir', ...): a tensor missing, of the wrong shape, or left over.
  """
  m = model_cfg
  used = set()

  def take(name, shape, linear=True):
    if name not in tensors:
      raise ConfigError('--hf_dir', f'the checkpoint has no tensor {name}')
    used.add(name)
    array = np.asarray(tensors[name])
    # A Linear's weight is [out, in]; ours are [in, out...]. Norms and the embedding table stay.
    out = (array.T if linear and array.ndim == 2 else array).astype(dtype)
    if out.size != int(np.prod(shape)):
      raise ConfigError(
        '--hf_dir', f'{name} has shape {array.shape}, config.json implies {tuple(shape)}'
      )
    return out.reshape(shape)

  shapes = _shapes(m)
  layers = {
    key: np.stack([take(_layer_names(i)[key], shape) for i in range(m.num_layers)])
    for key, shape in shapes.items()
  }
  params = {
    'embed': {'tokens': take('model.embed_tokens.weight', (m.vocab_size, m.d_model), False)},
    'layers': layers,
    'head': {'norm': take('model.norm.weight', (m.d_model,))},
  }
  if not m.tie_embeddings:
    params['head']['out'] = take('lm_head.weight', (m.d_model, m.vocab_size))
  # A tied checkpoint may still carry lm_head.weight (a copy of the table).
  left = sorted(set(tensors) - used - {'lm_head.weight'} - _buffers(tensors))
  if left:
    raise ConfigError('--hf_dir', f'tensors this Llama config does not use: {", ".join(left[:3])}')
  return params


def _buffers(tensors) -> set[str]:
  """Non-parameter entries some exports include (rotary inverse frequencies)."""
  return {name for name in tensors if name.endswith('rotary_emb.inv_freq')}


def params_to_hf(params: Mapping, model_cfg) -> dict[str, np.ndarray]:
  """HF tensors (numpy, the params' dtype) of a llama parameter tree."""
  m = model_cfg
  out = {'model.embed_tokens.weight': np.asarray(params['embed']['tokens'])}
  for i in range(m.num_layers):
    for key, name in _layer_names(i).items():
      array = np.asarray(params['layers'][key][i])
      if array.ndim == 1:
        out[name] = array
      else:  # back to a Linear's [out, in]; wo's inputs are its (head, head_dim) dims
        inputs = array.shape[0] * (array.shape[1] if key == 'wo' else 1)
        out[name] = np.ascontiguousarray(array.reshape(inputs, -1).T)
  out['model.norm.weight'] = np.asarray(params['head']['norm'])
  if not m.tie_embeddings:
    out['lm_head.weight'] = np.ascontiguousarray(np.asarray(params['head']['out']).T)
  return out


def write_tensors(tensors: Mapping[str, np.ndarray], out_dir: str, max_shard_bytes: int) -> None:
  """Writes `model.safetensors`, or shards of at most `max_shard_bytes` and
  their index when the tensors are larger (HF's layout, names in order)."""
  from safetensors.numpy import save_file

  total = sum(a.nbytes for a in tensors.values())
  if total <= max_shard_bytes:
    save_file(dict(tensors), os.path.join(out_dir, SINGLE_FILE), metadata={'format': 'pt'})
    return
  shards, current, size = [], {}, 0
  for name, array in tensors.items():
    if current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = array
    size += array.nbytes
  shards.append(current)
  weight_map = {}
  for k, shard in enumerate(shards):
    name = f'model-{k + 1:05d}-of-{len(shards):05d}.safetensors'
    save_file(shard, os.path.join(out_dir, name), metadata={'format': 'pt'})
    weight_map.update(dict.fromkeys(shard, name))
  with open(os.path.join(out_dir, INDEX_FILE), 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
