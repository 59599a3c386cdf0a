"""A workdir's own config (its config.json) as a config file, so that --config.*
flags can change it: resuming a run with more steps, or fine-tuning a
checkpoint that `python -m triax convert` imported.

`python -m triax train --workdir=DIR [--config.x=...]` without --config loads
this file with DIR as its argument; experiments/from_workdir.py names it
for an explicit --config=experiments/from_workdir.py:DIR.
"""

import os

from triax import config
from triax.errors import ConfigError
from triax.training import workdir as workdir_lib


def get_config(arg=None):
  if not arg:
    raise ConfigError('--config', 'name the workdir: --config=experiments/from_workdir.py:WORKDIR')
  path = workdir_lib.path(arg, workdir_lib.CONFIG)
  if not os.path.isfile(path):
    raise ConfigError('--config', f'{arg} has no {workdir_lib.CONFIG}: give a triax workdir')
  return config.load_json(path, '--config')
