"""Model families by name: `model.family` -> the module that defines it.

A family module (gpt.py, llama.py, mixtral.py, deepseek.py, gemma.py) defines
  Spec      a frozen dataclass subclassing common.ModelSpec; its fields are
            the config keys `model.<field>` the family reads,
  Model     a common.DecoderModel subclass (its three flax modules and
            `forward_flops()`),
  validate(model_cfg, mesh_cfg, rules) -> None
            its own checks (ConfigError naming the key) of the config as
            given; a Spec whose `executor_refusal()` says why is refused
            under the pipeline executor,
  axis_rules(model_cfg, mesh_cfg, rules) -> rules
            the logical axis rules it needs resolved for this mesh (llama's
            K/V heads, mixtral's experts), from the config's (validated) ones.
The config is stored as given; `sharding.resolve_rules` asks `axis_rules`
where the rules are used. Everything outside model/ goes through
`spec_from_config` and `build`, so adding a family is its file, one line in
FAMILIES, and its config keys (with their comments) in config.defaults().
A family's module is imported when first asked for: importing the registry
(and so triax.config) loads no JAX.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from triax.errors import ConfigError

if TYPE_CHECKING:
  from triax.model.common import DecoderModel, ModelSpec

# Family name -> its module under triax.model.
FAMILIES: dict[str, str] = {
  'gpt': 'gpt',
  'llama': 'llama',
  'mixtral': 'mixtral',
  'deepseek': 'deepseek',
  'gemma3': 'gemma',
}
# The family of runs and checkpoints written before model.family existed.
BEFORE_FAMILIES = 'gpt'
# A checkpoint's model record (shape_record) written before one of these keys
# existed lacks it and holds the model as it was then: no family (gpt), no
# q/k/v biases, no gate on the shared experts, heads d_model / num_heads wide
# (recorded as 0, see `shape_record`), no q/k norms.
RECORD_DEFAULTS = {
  'family': BEFORE_FAMILIES,
  'qkv_bias': False,
  'shared_expert_gate': False,
  'head_dim': 0,
  'qk_norm': False,
}


def _family(name: str) -> ModuleType:
  if name not in FAMILIES:
    raise ConfigError(
      'model.family', f'unknown family {name!r}; choose one of {", ".join(FAMILIES)}'
    )
  return importlib.import_module(f'triax.model.{FAMILIES[name]}')


def reads(family: str, key: str) -> bool:
  """Whether `family` (a known one) reads the config key model.`key`."""
  return key in _family(family).Spec.config_fields()


def spec_from_config(model_cfg) -> ModelSpec:
  """The family's spec from config.model (validated)."""
  return _family(model_cfg.family).Spec.from_config(model_cfg)


def build(spec: ModelSpec) -> DecoderModel:
  """The model of `spec`'s family."""
  return _family(spec.family).Model(spec)


def shape_record(model_cfg) -> dict:
  """What a checkpoint's parameter shapes depend on: family and shape keys."""
  spec = spec_from_config(model_cfg)
  record = {k: getattr(spec, k) for k in type(spec).SHAPE_KEYS}
  if record['head_dim'] == spec.d_model // spec.num_heads:
    record['head_dim'] = 0  # the default, however given: as records before the key hold it
  return record


def _plain(value):
  return value.to_dict() if hasattr(value, 'to_dict') else value


def axis_rules(model_cfg, mesh_cfg, rules) -> tuple:
  """The logical axis `rules` (validated) resolved for the family on this mesh."""
  return _family(model_cfg.family).axis_rules(model_cfg, mesh_cfg, tuple(tuple(r) for r in rules))


def validate(model_cfg, default_model_cfg, mesh_cfg, rules, pipelined: bool = False) -> None:
  """Checks the family's keys against the config's logical axis `rules`.

  A key the family does not read must keep its default: a set value would
  otherwise be silently ignored (model.num_kv_heads=2 on a GPT). `pipelined`:
  the pipeline executor will run the model (mesh.pipe or micro-batches > 1).
  """
  family = _family(model_cfg.family)
  used = set(family.Spec.config_fields())
  for key in model_cfg:
    if key not in default_model_cfg:  # a config file may add keys; flags cannot
      raise ConfigError(f'model.{key}', f'unknown key; known: {", ".join(default_model_cfg)}')
    if key in used or _plain(model_cfg[key]) == _plain(default_model_cfg[key]):
      continue
    readers = [n for n in FAMILIES if reads(n, key)]
    raise ConfigError(
      f'model.{key}',
      f'model.family={model_cfg.family} does not use it; leave it at its default '
      f'{_plain(default_model_cfg[key])!r}'
      + (f' or set model.family to {" or ".join(readers)}' if readers else ''),
    )
  family.validate(model_cfg, mesh_cfg, tuple(tuple(r) for r in rules))
  refusal = family.Spec.from_config(model_cfg).executor_refusal() if pipelined else ''
  if refusal:
    raise ConfigError('mesh.pipe' if mesh_cfg.pipe > 1 else 'pipeline.microbatches', refusal)
