"""What a plan file (`triax plan --out`, written by plan/search/emit.py) runs.

A plan file holds data only (BASE, BASE_ABSOLUTE, BASE_ARG, BASE_OVERRIDES,
PLAN and, for a synthesised schedule, SCHEDULE_FILE and SCHEDULE); its
`get_config` calls `config` here. Plain Python: no JAX.
"""

from __future__ import annotations

import importlib.util
import os

from triax import config as config_lib


def config(
  plan_path: str,
  base: str,
  base_absolute: str,
  base_arg: str | None,
  base_overrides: dict,
  plan: dict,
  arg: str | None = None,
  schedule_file: str = '',
  schedule: str = '',
):
  """The plan's config: the base experiment's (`base` relative to the plan
  file while both stay put, else `base_absolute`; `arg`, else `base_arg`),
  then `base_overrides`, then `plan`. With `schedule` (triax's JSON), it is
  written as `schedule_file` beside the plan file (rewritten only when it
  differs) and `pipeline.schedule_file` points at it."""
  path = os.path.join(os.path.dirname(os.path.abspath(plan_path)), base)
  if not os.path.isfile(path):
    path = base_absolute
  spec = importlib.util.spec_from_file_location('triax_plan_base', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  arg = base_arg if arg is None else arg
  cfg = module.get_config(arg) if arg is not None else module.get_config()
  for values in (base_overrides, plan):
    for key, value in values.items():
      config_lib.set_dotted(cfg, key, value)
  if schedule:
    cfg.pipeline.schedule_file = _write_beside(plan_path, schedule_file, schedule)
  return cfg


def _write_beside(plan_path: str, name: str, text: str) -> str:
  """`text` as file `name` beside the plan file (rewritten only when it differs); its path."""
  path = os.path.join(os.path.dirname(os.path.abspath(plan_path)), name)
  try:
    with open(path, encoding='utf-8') as f:
      same = f.read() == text
  except OSError:
    same = False
  if not same:
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(path + '.tmp', path)
  return path
