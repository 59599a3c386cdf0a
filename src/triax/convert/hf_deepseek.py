"""Hugging Face DeepSeek-V3 checkpoints (`DeepseekV3ForCausalLM`) <-> the
deepseek family's parameters and config.

On disk (what the Hub holds and transformers 5 writes, though it fuses the
experts in memory), block i's tensors are `model.layers.{i}.`:
`input_layernorm`, `post_attention_layernorm`; `self_attn.`: `q_proj` or
`q_a_proj`, `q_a_layernorm`, `q_b_proj`; `kv_a_proj_with_mqa` [r + rope, d]
(our 'wkv_a' and 'wk_rope'), `kv_a_layernorm`, `kv_b_proj` [n (nope + v), r]
(our 'wk_b' and 'wv_b'), `o_proj`; then `mlp.{gate,up,down}_proj` in the
first first_k_dense_replace blocks (ours: params['embed']['dense_{i}']),
else `mlp.gate.weight` ('router') and `mlp.gate.e_score_correction_bias`
('router_bias'; both fp32 in triax whatever the dtype), `mlp.experts.{e}.{gate,up,down}_proj` and
`mlp.shared_experts.{gate,up,down}_proj`. Linear weights are [out, in],
ours [in, out...].

RoPE: DeepSeek's weights lay each rotated query head and the shared rope key
out in interleaved pairs (transformers' rope_interleave, true by default);
triax rotates rotate_half's halves. The rope rows of q_proj (q_b_proj) and
of kv_a_proj_with_mqa are permuted on import (ours[j] = theirs[2j],
ours[rope/2 + j] = theirs[2j + 1]) and back on export, by indexing only, so
a round trip is bit-identical; a config with rope_interleave false is taken
as it is.

Multi-token prediction: DeepseekV3ForCausalLM holds none, so an import has
model.mtp_depth 0 and drops the checkpoint's `model.layers.{n}` for n >=
num_hidden_layers (DeepSeek-V3's MTP module, which transformers' class
ignores too); an export of a model with MTP is refused unless asked to
drop them (`triax convert --export --drop_mtp`).

Everything here is numpy and data (convert/rules.py; convert/hf_checkpoint.py
streams the tensors through it), and the mapping of the RoPE scaling is
hf_llama's (DeepSeek-V3's YaRN: `rope_from_hf`, `rope_scaling_hf`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from triax.convert import hf_llama
from triax.convert import rules as rules_lib
from triax.errors import ConfigError

MODEL_TYPES = {'deepseek_v3': ('deepseek', 'DeepseekV3ForCausalLM')}
FAMILIES = ('deepseek',)
ARCHITECTURE = MODEL_TYPES['deepseek_v3'][1]

# HF config keys that must hold these values (absent = the value): triax's
# deepseek has no other variant. scoring_func, topk_method and
# moe_layer_freq are DeepSeek's own config.json keys, which transformers keeps.
_REQUIRED = {
  'hidden_act': 'silu',
  'attention_bias': False,
  'tie_word_embeddings': False,
  'scoring_func': 'sigmoid',
  'topk_method': 'noaux_tc',
  'moe_layer_freq': 1,
}


def _check(hf: Mapping) -> None:
  """Refuses an HF DeepSeek-V3 config triax's deepseek family cannot run."""
  for key, value in _REQUIRED.items():
    if hf.get(key, value) != value:
      raise ConfigError('--hf_dir', f'config.json: {key}={hf[key]!r}; triax runs {value!r} only')
  if hf.get('quantization_config'):
    raise ConfigError(
      '--hf_dir',
      'config.json: quantization_config (an fp8 checkpoint); triax reads unquantized weights: '
      "dequantize it to bf16 first (DeepSeek's fp8_cast_bf16.py)",
    )
  n, kv = hf['num_attention_heads'], hf.get('num_key_value_heads') or hf['num_attention_heads']
  if kv != n:
    raise ConfigError(
      '--hf_dir',
      f'config.json: num_key_value_heads={kv} with num_attention_heads={n}; MLA makes every '
      "head's keys from the latent, and triax runs num_key_value_heads = num_attention_heads only",
    )


def model_config(hf: Mapping, seq_len: int) -> dict:
  """The config.model keys of an HF DeepseekV3Config (as a dict), for
  `seq_len` tokens: no MTP, and no auxiliary or z-loss (transformers'
  objective is the cross-entropy alone; balancing is the bias's, at
  model.bias_update_rate's default, DeepSeek-V3's).

  Raises:
    ConfigError('--hf_dir', ...): a variant triax does not run.
  """
  _check(hf)
  theta, scaling = hf_llama.rope_from_hf(hf)
  return {
    'family': 'deepseek',
    'num_layers': hf['num_hidden_layers'],
    'd_model': hf['hidden_size'],
    'num_heads': hf['num_attention_heads'],
    'd_ff': hf['intermediate_size'],
    'moe_d_ff': hf['moe_intermediate_size'],
    'vocab_size': hf['vocab_size'],
    'seq_len': seq_len,
    'rope_theta': theta,
    'rope_scaling': scaling,
    'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
    # transformers 5 accepts num_local_experts for n_routed_experts.
    'num_experts': hf.get('n_routed_experts') or hf['num_local_experts'],
    'experts_per_token': hf['num_experts_per_tok'],
    'shared_experts': hf.get('n_shared_experts') or 0,
    'first_k_dense': hf.get('first_k_dense_replace') or 0,
    'n_group': hf.get('n_group') or 1,
    'topk_group': hf.get('topk_group') or 1,
    'routed_scaling_factor': float(hf.get('routed_scaling_factor', 1.0)),
    'norm_topk_prob': bool(hf.get('norm_topk_prob', True)),
    'q_lora_rank': hf.get('q_lora_rank') or 0,
    'kv_lora_rank': hf['kv_lora_rank'],
    'qk_nope_head_dim': hf['qk_nope_head_dim'],
    'qk_rope_head_dim': hf['qk_rope_head_dim'],
    'v_head_dim': hf['v_head_dim'],
    'router_aux_loss_coef': 0.0,
    'router_z_loss_coef': 0.0,
    # No term to balance; 'batch' would keep the import off pipelined layouts.
    'router_aux_loss_scope': 'microbatch',
    'mtp_depth': 0,
  }


def hf_config(model_cfg, base: Mapping | None = None) -> dict:
  """An HF DeepseekV3Config dict for config.model, over `base` (the imported
  checkpoint's own config.json: its token ids, rope_interleave and the like
  survive).

  Raises:
    ConfigError('--workdir', ...): MTP modules (model.mtp_depth > 0; the
      export drops them when asked, hf_checkpoint.export_hf).
  """
  m = model_cfg
  if m.mtp_depth:
    raise ConfigError(
      '--workdir',
      f'model.mtp_depth={m.mtp_depth}: {ARCHITECTURE} holds no MTP modules; pass --drop_mtp '
      'to export the model without them',
    )
  out = dict(base or {})
  for key in ('rope_parameters', 'rope_scaling', 'num_local_experts'):
    out.pop(key, None)
  out.update(
    architectures=[ARCHITECTURE],
    model_type='deepseek_v3',
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    intermediate_size=m.d_ff,
    moe_intermediate_size=m.moe_d_ff or m.d_ff,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_heads,
    n_routed_experts=m.num_experts,
    num_experts_per_tok=m.experts_per_token,
    n_shared_experts=m.shared_experts,
    first_k_dense_replace=m.first_k_dense,
    n_group=m.n_group,
    topk_group=m.topk_group,
    routed_scaling_factor=m.routed_scaling_factor,
    norm_topk_prob=m.norm_topk_prob,
    q_lora_rank=m.q_lora_rank or None,
    kv_lora_rank=m.kv_lora_rank,
    qk_nope_head_dim=m.qk_nope_head_dim,
    qk_rope_head_dim=m.qk_rope_head_dim,
    v_head_dim=m.v_head_dim,
    rope_theta=m.rope_theta,
    rope_interleave=_interleaved(base),
    max_position_embeddings=(base or {}).get('max_position_embeddings', m.seq_len),
    rms_norm_eps=m.norm_eps,
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act='silu',
    num_nextn_predict_layers=0,
    torch_dtype=m.param_dtype,
  )
  scaling = hf_llama.rope_scaling_hf(m.rope_scaling)
  if scaling:
    out['rope_scaling'] = scaling
  return out


def _interleaved(hf: Mapping | None) -> bool:
  """Whether an HF config's rope rows are in interleaved pairs (transformers'
  default, and DeepSeek's checkpoints')."""
  return bool((hf or {}).get('rope_interleave', True))


class _Rule(NamedTuple):
  """One HF tensor of a block (`name` under `model.layers.{i}.`, with '{e}'
  for an expert's, of `hf_shape`) <-> a block of some of our block's `keys`
  (of `shapes`): `to_ours(theirs)` gives a tuple in `keys`' order,
  `to_hf(*ours)` the tensor. An expert's rule is one expert's tensor and
  blocks (our leaves have the experts axis after the layers')."""

  name: str
  hf_shape: tuple[int, ...]
  keys: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  to_ours: Callable[[np.ndarray], tuple]
  to_hf: Callable[..., np.ndarray]


def _linear(name: str, key: str, shape: tuple[int, ...], ins: int = 1) -> _Rule:
  """A Linear [out, in] <-> ours `shape`, its first `ins` dims the inputs."""
  i, o = int(np.prod(shape[:ins])), int(np.prod(shape[ins:]))
  return _Rule(
    name,
    (o, i),
    (key,),
    (shape,),
    lambda a: (a.T.reshape(shape),),
    lambda w: w.reshape(i, o).T,  # a view: ShardWriter copies it a row block at a time
  )


def _vector(name: str, key: str, size: int) -> _Rule:
  return _Rule(name, (size,), (key,), ((size,),), lambda a: (a,), lambda w: w)


def _rope_order(m, interleaved: bool) -> np.ndarray:
  """Our rope dims' sources in theirs: [0, 2, 4, ..., 1, 3, 5, ...] when
  `interleaved`, else in order."""
  rope = np.arange(m.qk_rope_head_dim)
  return np.concatenate([rope[0::2], rope[1::2]]) if interleaved else rope


def _query(name: str, key: str, inputs: int, m, order: np.ndarray) -> _Rule:
  """q_proj or q_b_proj [n qk, in] <-> ours [in, n, qk], each head's rope rows reordered."""
  n, nope = m.num_heads, m.qk_nope_head_dim
  qk = nope + m.qk_rope_head_dim
  rows = np.concatenate([np.arange(nope), nope + order])
  back = np.argsort(rows)
  return _Rule(
    name,
    (n * qk, inputs),
    (key,),
    ((inputs, n, qk),),
    lambda a: (a.reshape(n, qk, inputs)[:, rows].transpose(2, 0, 1),),
    lambda w: np.ascontiguousarray(w.transpose(1, 2, 0)[:, back].reshape(n * qk, inputs)),
  )


def _kv_a(m, order: np.ndarray) -> _Rule:
  """kv_a_proj_with_mqa [r + rope, d] <-> 'wkv_a' [d, r] and 'wk_rope' [d, rope]
  (its rope rows reordered)."""
  r, d, rope = m.kv_lora_rank, m.d_model, m.qk_rope_head_dim
  rows = np.concatenate([np.arange(r), r + order])
  back = np.argsort(rows)
  return _Rule(
    'self_attn.kv_a_proj_with_mqa.weight',
    (r + rope, d),
    ('wkv_a', 'wk_rope'),
    ((d, r), (d, rope)),
    lambda a: (a[rows][:r].T, a[rows][r:].T),
    lambda wkv, wrope: np.ascontiguousarray(np.concatenate([wkv.T, wrope.T])[back]),
  )


def _kv_b(m) -> _Rule:
  """kv_b_proj [n (nope + v), r] <-> 'wk_b' [r, n, nope] and 'wv_b' [r, n, v]."""
  n, r, nope, v = m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim

  def to_hf(wk, wv):
    joined = np.concatenate([wk.transpose(1, 2, 0), wv.transpose(1, 2, 0)], 1)
    return np.ascontiguousarray(joined.reshape(n * (nope + v), r))

  return _Rule(
    'self_attn.kv_b_proj.weight',
    (n * (nope + v), r),
    ('wk_b', 'wv_b'),
    ((r, n, nope), (r, n, v)),
    lambda a: tuple(
      part.transpose(2, 0, 1) for part in np.split(a.reshape(n, nope + v, r), [nope], 1)
    ),
    to_hf,
  )


def _attention_rules(m, interleaved: bool) -> list[_Rule]:
  d, n, r, qr = m.d_model, m.num_heads, m.kv_lora_rank, m.q_lora_rank
  order = _rope_order(m, interleaved)
  a = 'self_attn.'
  if qr:
    q = [
      _linear(a + 'q_a_proj.weight', 'wq_a', (d, qr)),
      _vector(a + 'q_a_layernorm.weight', 'q_a_norm', qr),
      _query(a + 'q_b_proj.weight', 'wq_b', qr, m, order),
    ]
  else:
    q = [_query(a + 'q_proj.weight', 'wq', d, m, order)]
  return [
    _vector('input_layernorm.weight', 'attn_norm', d),
    *q,
    _kv_a(m, order),
    _vector(a + 'kv_a_layernorm.weight', 'kv_a_norm', r),
    _kv_b(m),
    _linear(a + 'o_proj.weight', 'wo', (n, m.v_head_dim, d), ins=2),
    _vector('post_attention_layernorm.weight', 'mlp_norm', d),
  ]


def _mlp_rules(m, moe: bool) -> list[_Rule]:
  d = m.d_model
  swiglu = lambda prefix, key, f: [  # noqa: E731
    _linear(f'mlp.{prefix}gate_proj.weight', f'{key}gate', (d, f)),
    _linear(f'mlp.{prefix}up_proj.weight', f'{key}up', (d, f)),
    _linear(f'mlp.{prefix}down_proj.weight', f'{key}down', (f, d)),
  ]
  if not moe:
    return swiglu('', 'w_', m.d_ff)
  f = m.moe_d_ff or m.d_ff
  rules = [
    _linear('mlp.gate.weight', 'router', (d, m.num_experts)),
    _vector('mlp.gate.e_score_correction_bias', 'router_bias', m.num_experts),
    # One expert's Linear [out, in] <-> ours [in, out] (its slice of [E, in, out]).
    *swiglu('experts.{e}.', 'w_', f),
  ]
  return rules + (
    swiglu('shared_experts.', 'shared_', m.shared_experts * f) if m.shared_experts else []
  )


def _rules(m, moe: bool, interleaved: bool) -> list[_Rule]:
  """Every rule of one block: dense (the first first_k_dense) or MoE."""
  return _attention_rules(m, interleaved) + _mlp_rules(m, moe)


# Kept in fp32 whatever the parameters' dtype, as the model holds them (model/deepseek.py:
# transformers keeps the router in fp32; the bias's updates are smaller than bf16 resolves).
_FP32 = ('router', 'router_bias')


def tensor_rules(model_cfg, dtype, hf: Mapping | None = None) -> list[rules_lib.TensorRule]:
  """The HF tensors of a deepseek config <-> its parameter leaves (convert/rules.py),
  imported as `dtype` (the router and its bias as fp32), in the rope layout
  `hf` (the checkpoint's config.json) names. MTP modules have no rule (the
  module docstring)."""
  m = model_cfg
  interleaved = _interleaved(hf)
  d, v = m.d_model, m.vocab_size
  out = [
    rules_lib.reshaped('model.embed_tokens.weight', ('embed', 'tokens'), (v, d), dtype, (v, d))
  ]
  for i in range(m.first_k_dense):
    out += [
      _tensor_rule(rule, [i], ('embed', f'dense_{i}'), m, dtype)
      for rule in _rules(m, False, interleaved)
    ]
  stacked = list(range(m.first_k_dense, m.num_layers))
  out += [
    _tensor_rule(rule, stacked, ('layers',), m, dtype) for rule in _rules(m, True, interleaved)
  ]
  out.append(rules_lib.reshaped('model.norm.weight', ('head', 'norm'), (d,), dtype))
  out.append(rules_lib.linear('lm_head.weight', ('head', 'out'), (d, v), dtype))
  return out


def _tensor_rule(rule: _Rule, layers: list[int], parent: tuple[str, ...], m, dtype):
  """`rule` over `layers`: stacked on a leading layer axis under `parent`
  ('layers'), or one dense block's own leaves (`parent` its subtree, one layer)."""
  names = [f'model.layers.{i}.{rule.name}' for i in layers]
  if '{e}' in rule.name:
    names = [[name.format(e=e) for e in range(m.num_experts)] for name in names]
  if parent != ('layers',):
    names = names[0]  # a dense block's leaves have no layer axis
  return rules_lib.TensorRule(
    rules_lib.names_array(names),
    rule.hf_shape,
    tuple(parent + (key,) for key in rule.keys),
    rule.shapes,
    tuple(np.dtype(np.float32 if key in _FP32 else dtype) for key in rule.keys),
    rule.to_ours,
    rule.to_hf,
  )


def ignored(names, model_cfg, hf: Mapping | None = None) -> set[str]:
  """What an import leaves out of `names` (a checkpoint's tensors): layers past
  num_hidden_layers (DeepSeek-V3's MTP module) and rotary inverse
  frequencies some exports include."""
  del hf
  out = set()
  for name in names:
    layer = _LAYER.match(name)
    if (layer and int(layer.group(1)) >= model_cfg.num_layers) or name.endswith(
      'rotary_emb.inv_freq'
    ):
      out.add(name)
  return out


_LAYER = re.compile(r'model\.layers\.(\d+)\.')


def params_to_hf(params: Mapping, model_cfg, hf: Mapping | None = None) -> dict[str, np.ndarray]:
  """HF tensors (numpy, the params' dtype) of a deepseek parameter tree held in
  memory, in the rope layout `hf` (the exported config.json) names; MTP
  modules are not written (hf_config refuses them unless dropped)."""
  return rules_lib.params_to_hf(tensor_rules(model_cfg, model_cfg.param_dtype, hf), params)
