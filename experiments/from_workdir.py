"""A workdir's own config (its config.json) as a config file, so that
--config.* flags can change it: fine-tuning a checkpoint that
`python -m triax convert` imported, or resuming a run with more steps.

  python -m triax train --config=experiments/from_workdir.py:WORKDIR \
      --workdir=WORKDIR --config.train.steps=1000

(`python -m triax train --workdir=WORKDIR` alone runs config.json as it is.)
"""

import os

from triax import config
from triax.errors import ConfigError


def get_config(arg=None):
  if not arg:
    raise ConfigError('--config', 'name the workdir: --config=experiments/from_workdir.py:WORKDIR')
  path = os.path.join(arg, 'config.json')
  if not os.path.isfile(path):
    raise ConfigError('--config', f'{arg} has no config.json: give a triax workdir')
  return config.load_json(path, '--config')
