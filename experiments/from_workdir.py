"""A workdir's own config (its config.json) as a config file, so that
--config.* flags can change it: fine-tuning a checkpoint that
`python -m triax convert` imported, or resuming a run with more steps.

  python -m triax train --config=experiments/from_workdir.py:WORKDIR \
      --workdir=WORKDIR --config.train.steps=1000

(`python -m triax train --workdir=WORKDIR --config.train.steps=1000` does the
same: without --config, train loads the workdir's config through this file's
body, triax/workdir_config.py.)
"""

from triax.workdir_config import get_config  # noqa: F401  (config_flags calls it)
