"""Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints
<-> the llama and mixtral families' parameters and config.

transformers' `*ForCausalLM` classes of those models define what a checkpoint means: config.json names the shapes
(`model_config`, `hf_config`), and its tensors (`model.safetensors`, or shards listed in
`model.safetensors.index.json`: convert/safetensors_files.py) are PyTorch `Linear`
weights, [out, in]. `tensor_rules` maps them onto our leaves (convert/rules.py) by
transposes and reshapes only, nothing permuted: llama.py keeps the head dimension in HF's
stored order and rotates with HF's half-split `rotate_half`.

Names: Mixtral's experts per expert as the Hub stores them
(`block_sparse_moe.gate.weight` -> 'router', `experts.{e}.w1/w3/w2` -> 'w_gate'/'w_up'/
'w_down'[e]); Qwen2's q/k/v biases -> 'bq', 'bk', 'bv' (model.qkv_bias); Qwen2-MoE's
`mlp.gate`, `mlp.experts.{e}.*_proj`, `mlp.shared_expert.*_proj` and
`mlp.shared_expert_gate` (model.shared_experts, model.shared_expert_gate,
model.norm_topk_prob); Qwen3's and Qwen3-MoE's `self_attn.{q,k}_norm` -> 'q_norm', 'k_norm'
(model.qk_norm, their head width model.head_dim); Mistral is a llama with
`sliding_window` (model.sliding_window; one at least seq_len is global, 0). Only the
MoEs' released forms convert:
experts in every block (decoder_sparse_step 1, no mlp_only_layers).

Everything here is numpy and data: convert/hf_checkpoint.py streams the tensors through it.
Why no permutation is needed: docs/design/models.md."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from triax import config as config_lib
from triax.convert import rules
from triax.errors import ConfigError

# HF config keys that must hold these values: triax's llama has no other variant.
_REQUIRED = {
  'hidden_act': 'silu',
  'attention_bias': False,
  'mlp_bias': False,
  # mixtral: training-time noise on the router's input, which triax does not add.
  'router_jitter_noise': 0.0,
  # qwen2_moe, qwen3_moe: experts in every block (triax's moe_every > 1 has no converter).
  'decoder_sparse_step': 1,
  'mlp_only_layers': [],
}
# HF model_type -> (the triax family it converts to, HF's architecture class).
MODEL_TYPES = {
  'llama': ('llama', 'LlamaForCausalLM'),
  'mistral': ('llama', 'MistralForCausalLM'),
  'qwen2': ('llama', 'Qwen2ForCausalLM'),
  'qwen3': ('llama', 'Qwen3ForCausalLM'),
  'mixtral': ('mixtral', 'MixtralForCausalLM'),
  'qwen2_moe': ('mixtral', 'Qwen2MoeForCausalLM'),
  'qwen3_moe': ('mixtral', 'Qwen3MoeForCausalLM'),
}
# The triax families that convert.
FAMILIES = ('llama', 'mixtral')


def model_type(model_cfg) -> str:
  """The HF model_type a triax model config exports to (whose tensor names
  its layers have): a llama with q/k norms is a qwen3, with q/k/v biases a
  qwen2, with a sliding window a mistral; a mixtral with q/k norms a qwen3_moe,
  with Qwen2-MoE's parts a qwen2_moe."""
  m = model_cfg
  if m.family == 'llama':
    if m.qk_norm or m.qkv_bias:
      return 'qwen3' if m.qk_norm else 'qwen2'
    return 'mistral' if m.sliding_window else 'llama'
  if m.qk_norm:
    return 'qwen3_moe'
  if m.qkv_bias or m.shared_experts or not m.norm_topk_prob:
    return 'qwen2_moe'
  return m.family


def architecture(model_cfg) -> str:
  """HF's class name for a triax model config (see `model_type`)."""
  return MODEL_TYPES[model_type(model_cfg)][1]


def rope_from_hf(hf: Mapping) -> tuple[float, dict]:
  """(rope_theta, model.rope_scaling fields) from an HF config: transformers 5
  keeps them in `rope_parameters`, earlier versions (and DeepSeek's files) in
  `rope_theta` and `rope_scaling`; read as transformers reads them.

  Raises:
    ConfigError('--hf_dir', ...): a kind of scaling triax does not run.
  """
  params = dict(hf.get('rope_parameters') or {})
  theta = params.get('rope_theta', hf.get('rope_theta', 10000.0))
  source = params if params.get('rope_type') or params.get('type') else hf.get('rope_scaling') or {}
  kind = source.get('rope_type') or source.get('type') or 'default'
  if kind == 'default':
    return float(theta), {'factor': 0.0}
  if kind == 'yarn':
    return float(theta), _yarn_from_hf(source, hf)
  if kind == 'linear':
    return float(theta), {'rope_type': 'linear', 'factor': float(source['factor'])}
  if kind != 'llama3':
    raise ConfigError(
      '--hf_dir',
      f"config.json: rope type {kind!r} is not supported (only 'default', 'linear', 'llama3' "
      "and 'yarn')",
    )
  return float(theta), {
    'rope_type': 'llama3',
    'factor': float(source['factor']),
    'low_freq_factor': float(source['low_freq_factor']),
    'high_freq_factor': float(source['high_freq_factor']),
    'original_max_position_embeddings': int(source['original_max_position_embeddings']),
  }


def _yarn_from_hf(source: Mapping, hf: Mapping) -> dict:
  """model.rope_scaling of an HF yarn entry, with transformers' defaults: the
  original context max_position_embeddings (a top-level one first), the
  factor their ratio, beta_fast 32, beta_slow 1, mscales unset."""
  for key, value in (('attention_factor', None), ('truncate', True)):
    if source.get(key, value) != value:
      raise ConfigError(
        '--hf_dir',
        f'config.json: yarn with {key}={source[key]!r}; triax runs {value!r} only (the attention '
        'factor derived from factor, mscale and mscale_all_dim; the correction range truncated)',
      )
  ctx = (
    hf.get('original_max_position_embeddings')
    or source.get('original_max_position_embeddings')
    or hf['max_position_embeddings']
  )
  return {
    'rope_type': 'yarn',
    'factor': float(source.get('factor') or hf['max_position_embeddings'] / ctx),
    'original_max_position_embeddings': int(ctx),
    'beta_fast': float(source.get('beta_fast') or 32),
    'beta_slow': float(source.get('beta_slow') or 1),
    'mscale': float(source.get('mscale') or 0),
    'mscale_all_dim': float(source.get('mscale_all_dim') or 0),
  }


def rope_scaling_hf(r) -> dict | None:
  """The HF `rope_scaling` entry of model.rope_scaling `r` (transformers 5
  reads it into rope_parameters), or None unscaled; yarn's unset mscales left out."""
  if not r.factor:
    return None
  if r.rope_type == 'linear':
    return {'rope_type': 'linear', 'factor': r.factor}
  keys = ('low_freq_factor', 'high_freq_factor')
  if r.rope_type == 'yarn':
    keys = ('beta_fast', 'beta_slow') + tuple(k for k in ('mscale', 'mscale_all_dim') if r[k])
  entry = {'rope_type': r.rope_type, 'factor': r.factor, **{k: r[k] for k in keys}}
  entry['original_max_position_embeddings'] = r.original_max_position_embeddings
  return entry


def model_config(hf: Mapping, seq_len: int) -> dict:
  """The config.model keys of an HF LlamaConfig or MixtralConfig (as a dict),
  for `seq_len` tokens.

  Raises:
    ConfigError('--hf_dir', ...): neither, or a variant triax does not run.
  """
  kind = hf.get('model_type')
  if kind not in MODEL_TYPES:
    raise ConfigError(
      '--hf_dir',
      f'config.json: model_type {kind!r}; only {", ".join(MODEL_TYPES)} are converted',
    )
  window = _window(hf, kind, seq_len)
  for key, value in _REQUIRED.items():
    if hf.get(key, value) != value:
      raise ConfigError('--hf_dir', f'config.json: {key}={hf[key]!r}; triax runs {value!r} only')
  d, n = hf['hidden_size'], hf['num_attention_heads']
  head_dim = hf.get('head_dim') or 0
  if not head_dim and d % n:
    raise ConfigError(
      '--hf_dir', f'config.json: no head_dim, and num_attention_heads={n} does not divide {d}'
    )
  theta, scaling = rope_from_hf(hf)
  extra = {'qkv_bias': True} if kind == 'qwen2' else {}
  if window:
    extra['sliding_window'] = window
  if MODEL_TYPES[kind][0] == 'mixtral':
    extra = {
      # transformers 5 writes Qwen3-MoE's count as num_local_experts, its hub configs num_experts.
      'num_experts': hf.get('num_local_experts') or hf['num_experts'],
      'experts_per_token': hf['num_experts_per_tok'],
      # transformers' training objective: its aux loss weight, no z-loss.
      'router_aux_loss_coef': float(hf.get('router_aux_loss_coef', 0.001)),
      'router_z_loss_coef': 0.0,
    }
  if kind == 'qwen2_moe':
    extra.update(_qwen2_moe(hf))
  if kind in ('qwen3', 'qwen3_moe'):
    extra.update(qk_norm=True)
  if kind == 'qwen3_moe':
    extra.update(norm_topk_prob=bool(hf.get('norm_topk_prob', False)))
  return {
    'family': MODEL_TYPES[kind][0],
    'num_layers': hf['num_hidden_layers'],
    'd_model': d,
    'num_heads': n,
    'head_dim': 0 if head_dim == d // n else head_dim,
    'num_kv_heads': hf.get('num_key_value_heads') or n,
    'd_ff': hf['moe_intermediate_size' if kind.endswith('_moe') else 'intermediate_size'],
    'vocab_size': hf['vocab_size'],
    'seq_len': seq_len,
    'rope_theta': theta,
    'rope_scaling': scaling,
    'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
    'tie_embeddings': bool(hf.get('tie_word_embeddings', False)),
    **extra,
  }


def _window(hf: Mapping, kind: str, seq_len: int) -> int:
  """model.sliding_window of an HF config: Mistral's window when shorter
  than `seq_len` (else every query sees every key anyway: 0).

  Raises:
    ConfigError('--hf_dir', ...): a window shorter than seq_len on another
      model_type (Qwen2's on some layers only), or Mistral's per-layer kinds.
  """
  # Qwen's configs name a window they do not use (use_sliding_window false).
  window = hf.get('sliding_window') if hf.get('use_sliding_window', True) else None
  if not window or window >= seq_len:
    return 0
  if kind != 'mistral':
    raise ConfigError(
      '--hf_dir',
      f'config.json: sliding_window={window} is shorter than the {seq_len}-token window, and '
      f'triax runs windows on mistral only, not {kind}; pass --seq_len at most that',
    )
  kinds = set(hf.get('layer_types') or ('sliding_attention',))
  if kinds != {'sliding_attention'}:
    raise ConfigError(
      '--hf_dir',
      f'config.json: layer_types {sorted(kinds)}; triax converts a Mistral whose every layer '
      'has the sliding window',
    )
  return int(window)


def _qwen2_moe(hf: Mapping) -> dict:
  """The config.model keys of Qwen2-MoE's own parts."""
  f, shared = hf['moe_intermediate_size'], hf['shared_expert_intermediate_size']
  if not shared or shared % f:
    raise ConfigError(
      '--hf_dir',
      f'config.json: shared_expert_intermediate_size={shared} is not a multiple of '
      f"moe_intermediate_size={f}; triax runs shared experts of the experts' width",
    )
  return {
    'shared_experts': shared // f,
    'shared_expert_gate': True,
    'norm_topk_prob': bool(hf.get('norm_topk_prob', False)),
    'qkv_bias': bool(hf.get('qkv_bias', True)),
  }


def _qwen2_moe_hf(m, base: Mapping | None) -> dict:
  """HF's Qwen2MoeConfig keys of a mixtral config with Qwen2-MoE's parts.

  Raises:
    ConfigError('--workdir', ...): parts Qwen2-MoE always has, missing.
  """
  parts = {
    'qkv_bias': m.qkv_bias,
    'shared_experts': m.shared_experts > 0,
    'shared_expert_gate': m.shared_expert_gate,
  }
  lacking = [f'model.{key}' for key, ok in parts.items() if not ok]
  if lacking:
    given = [f'model.{key}={m[key]}' for key, ok in parts.items() if ok]
    given += [] if m.norm_topk_prob else ['model.norm_topk_prob=False']
    raise ConfigError(
      '--workdir',
      f'{" and ".join(given)} without {" and ".join(lacking)}: neither MixtralForCausalLM nor '
      'Qwen2MoeForCausalLM holds that (Qwen2-MoE has q/k/v biases and a gated shared expert, '
      'Mixtral neither)',
    )
  return dict(
    num_experts=m.num_experts,
    num_experts_per_tok=m.experts_per_token,
    moe_intermediate_size=m.d_ff,
    shared_expert_intermediate_size=m.shared_experts * m.d_ff,
    # The dense MLP's width, which no block of this model has (every block is a MoE).
    intermediate_size=(base or {}).get('intermediate_size', m.shared_experts * m.d_ff),
    norm_topk_prob=m.norm_topk_prob,
    qkv_bias=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    use_sliding_window=False,
    router_aux_loss_coef=m.router_aux_loss_coef,
    output_router_logits=False,
  )


def _qwen3_moe_hf(m, base: Mapping | None) -> dict:
  """HF's Qwen3MoeConfig keys of a mixtral config with q/k norms.

  Raises:
    ConfigError('--workdir', ...): parts Qwen3-MoE does not have (q/k/v
      biases, shared experts).
  """
  if m.qkv_bias or m.shared_experts:
    raise ConfigError(
      '--workdir',
      'model.qk_norm with q/k/v biases or shared experts: Qwen3MoeForCausalLM has neither',
    )
  return dict(
    num_experts=m.num_experts,
    num_local_experts=m.num_experts,
    num_experts_per_tok=m.experts_per_token,
    moe_intermediate_size=m.d_ff,
    # The dense MLP's width, which no block of this model has (every block is a MoE).
    intermediate_size=(base or {}).get('intermediate_size', m.d_ff),
    norm_topk_prob=m.norm_topk_prob,
    attention_bias=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    use_sliding_window=False,
    sliding_window=None,
    router_aux_loss_coef=m.router_aux_loss_coef,
    output_router_logits=False,
  )


def hf_config(model_cfg, base: Mapping | None = None) -> dict:
  """An HF LlamaConfig (MixtralConfig, Qwen2MoeConfig: see `model_type`) dict
  for config.model, over `base` (the imported checkpoint's own config.json,
  so its token ids and the like survive).

  Raises:
    ConfigError('--workdir', ...): a mixtral with dense blocks (model.moe_every
      > 1), or with parts of Qwen2-MoE but not all of them.
  """
  m = model_cfg
  kind = model_type(m)
  out = dict(base or {})
  for key in ('rope_parameters', 'rope_scaling', 'rope_theta'):
    out.pop(key, None)
  if m.family == 'llama' and m.sliding_window and (m.sliding_window_pattern or kind != 'mistral'):
    raise ConfigError(
      '--workdir',
      'model.sliding_window with '
      + ('model.sliding_window_pattern' if m.sliding_window_pattern else 'q/k norms or biases')
      + ': MistralForCausalLM has a window on every layer and neither of those',
    )
  if m.family == 'mixtral' and m.moe_every != 1:
    raise ConfigError(
      '--workdir',
      f'model.moe_every={m.moe_every}: the converter writes experts in every block',
    )
  if kind == 'qwen2_moe':
    out.update(_qwen2_moe_hf(m, base))
  elif kind == 'qwen3_moe':
    out.update(_qwen3_moe_hf(m, base))
  elif kind == 'mixtral':
    out.update(
      num_local_experts=m.num_experts,
      num_experts_per_tok=m.experts_per_token,
      router_aux_loss_coef=m.router_aux_loss_coef,
      router_jitter_noise=0.0,
      sliding_window=None,
      output_router_logits=False,
    )
  elif kind == 'qwen2':
    out.update(use_sliding_window=False, sliding_window=None)
  elif kind == 'mistral':
    out.update(sliding_window=m.sliding_window)
  elif kind == 'qwen3':
    if m.qkv_bias:  # imports refuse attention_bias too (_REQUIRED): the released Qwen3 has none
      raise ConfigError(
        '--workdir', 'model.qk_norm with model.qkv_bias: Qwen3ForCausalLM here has no q/k/v biases'
      )
    out.update(use_sliding_window=False, sliding_window=None, attention_bias=False)
  else:
    out.update(attention_bias=False, mlp_bias=False)
  if not kind.endswith('_moe'):
    out['intermediate_size'] = m.d_ff
  out.update(
    architectures=[MODEL_TYPES[kind][1]],
    model_type=kind,
    hidden_size=m.d_model,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads or m.num_heads,
    head_dim=config_lib.head_dim(m),
    vocab_size=m.vocab_size,
    max_position_embeddings=(base or {}).get('max_position_embeddings', m.seq_len),
    rms_norm_eps=m.norm_eps,
    tie_word_embeddings=m.tie_embeddings,
    hidden_act='silu',
    torch_dtype=m.param_dtype,
    rope_theta=m.rope_theta,
  )
  scaling = rope_scaling_hf(m.rope_scaling)
  if scaling:
    out['rope_scaling'] = scaling
  return out


def _layer_names(i: int, m) -> dict[str, str | list[str]]:
  """Layer i's HF tensor name of each triax layer key; a list, one per
  expert, for the experts' weights (stacked on their leading axis)."""
  p = f'model.layers.{i}.'
  names = {
    'attn_norm': p + 'input_layernorm.weight',
    'wq': p + 'self_attn.q_proj.weight',
    'wk': p + 'self_attn.k_proj.weight',
    'wv': p + 'self_attn.v_proj.weight',
    'wo': p + 'self_attn.o_proj.weight',
    'mlp_norm': p + 'post_attention_layernorm.weight',
  }
  if m.qkv_bias:
    names.update({f'b{x}': f'{p}self_attn.{x}_proj.bias' for x in 'qkv'})
  if m.qk_norm:
    names.update({f'{x}_norm': f'{p}self_attn.{x}_norm.weight' for x in 'qk'})
  kind = model_type(m)
  if kind in ('llama', 'mistral', 'qwen2', 'qwen3'):
    return {
      **names,
      'w_gate': p + 'mlp.gate_proj.weight',
      'w_up': p + 'mlp.up_proj.weight',
      'w_down': p + 'mlp.down_proj.weight',
    }
  block, weights = _MOE_NAMES[kind]
  moe = p + block
  experts = lambda w: [f'{moe}experts.{e}.{w}.weight' for e in range(m.num_experts)]  # noqa: E731
  names.update(router=moe + 'gate.weight')
  names.update({key: experts(w) for key, w in zip(('w_gate', 'w_up', 'w_down'), weights)})
  if kind == 'qwen2_moe':
    names.update({f'shared_{w}': f'{moe}shared_expert.{w}_proj.weight' for w in _SHARED})
    names['shared_expert_gate'] = moe + 'shared_expert_gate.weight'
  return names


# A MoE model_type's MLP: its module under the layer, and the experts' gate,
# up and down weights' names.
_MOE_NAMES = {
  'mixtral': ('block_sparse_moe.', ('w1', 'w3', 'w2')),
  'qwen2_moe': ('mlp.', ('gate_proj', 'up_proj', 'down_proj')),
  'qwen3_moe': ('mlp.', ('gate_proj', 'up_proj', 'down_proj')),
}
# The shared expert's weights (triax's 'shared_gate', ...; HF's '{w}_proj').
_SHARED = ('gate', 'up', 'down')


def _shapes(m) -> dict[str, tuple[int, ...]]:
  """Each layer weight's triax shape (without the layer axis; an expert's
  without the experts axis)."""
  n, kv, d, f = m.num_heads, m.num_kv_heads or m.num_heads, m.d_model, m.d_ff
  hd = config_lib.head_dim(m)
  extra = {'router': (d, m.num_experts)} if m.family == 'mixtral' else {}
  if m.qkv_bias:
    extra.update(bq=(n, hd), bk=(kv, hd), bv=(kv, hd))
  if m.qk_norm:
    extra.update(q_norm=(hd,), k_norm=(hd,))
  if m.family == 'mixtral' and m.shared_experts:
    s = m.shared_experts * f
    extra.update(shared_gate=(d, s), shared_up=(d, s), shared_down=(s, d))
    if m.shared_expert_gate:
      extra['shared_expert_gate'] = (d, 1)
  return {
    **extra,
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


def tensor_rules(model_cfg, dtype, hf: Mapping | None = None) -> list[rules.TensorRule]:
  """The HF tensors of a llama or mixtral config (named as `model_type` says)
  <-> its parameter leaves, imported as `dtype` (convert/rules.py); `hf`,
  the checkpoint's config.json, is not read (the model config says all)."""
  del hf
  m = model_cfg
  layers = [_layer_names(i, m) for i in range(m.num_layers)]
  shapes = _shapes(m)
  out = [
    rules.reshaped(
      'model.embed_tokens.weight',
      ('embed', 'tokens'),
      (m.vocab_size, m.d_model),
      dtype,
      (m.vocab_size, m.d_model),
    )
  ]
  for key in layers[0]:  # HF's order within a layer
    names, path, shape = [names[key] for names in layers], ('layers', key), shapes[key]
    if len(shape) == 1 or key in _BIASES:
      out.append(rules.reshaped(names, path, shape, dtype))
    else:
      # wo's inputs are its (head, head_dim) dims
      out.append(rules.linear(names, path, shape, dtype, ins=2 if key == 'wo' else 1))
  out.append(rules.reshaped('model.norm.weight', ('head', 'norm'), (m.d_model,), dtype))
  if not m.tie_embeddings:
    out.append(rules.linear('lm_head.weight', ('head', 'out'), (m.d_model, m.vocab_size), dtype))
  return out


def ignored(names, model_cfg, hf: Mapping | None = None) -> set[str]:
  """What an import leaves out of `names` (a checkpoint's tensors): a tied
  checkpoint's copy of the table as lm_head.weight, and rotary inverse
  frequencies some exports include."""
  del model_cfg, hf
  return {n for n in names if n == 'lm_head.weight' or n.endswith('rotary_emb.inv_freq')}


# Layer keys of biases: [heads, head_dim] here, one vector in HF.
_BIASES = ('bq', 'bk', 'bv')


def params_to_hf(params: Mapping, model_cfg, hf: Mapping | None = None) -> dict[str, np.ndarray]:
  """HF tensors (numpy, the params' dtype) of a llama or mixtral parameter tree
  held in memory (named as `model_type` says; `hf`, the exported config, is not read)."""
  del hf
  return rules.params_to_hf(tensor_rules(model_cfg, model_cfg.param_dtype), params)
