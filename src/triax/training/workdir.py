"""A run's workdir: every name in it, and what reading a run back needs.

  DIR/config.json          the validated config (train, or an import)
  DIR/devices.json         the CPU device count a resume needs (CPU runs)
  DIR/compile_stats.json   XLA's memory and cost analysis of the step
  DIR/metrics.jsonl        one JSON object per logged step
  DIR/tb/                  TensorBoard events
  DIR/wandb_run_id         the W&B run a resume continues
  DIR/profile/             jax.profiler traces (--profile_steps)
  DIR/checkpoints/STEP/    orbax checkpoints (training/checkpoint.py)
  DIR/tokenizer.json       an import's tokenizer (triax convert)
  DIR/hf_config.json       an import's HF config (export keeps its ids)
  DIR/triax.lock           who is writing the workdir (training/lock.py)
  DIR/elastic.jsonl        one record per restart of `triax supervise` (training/elastic.py)
  DIR/rollbacks.jsonl      one line per bad-step rollback (training/bad_steps.py)
  DIR/checkpoints_rolled_back/STEP/  checkpoints a rollback set aside

`sample`, `convert --export` and a resume read a run back with
`load_config`, `tokenizer`, `latest_step` and `restore_params`.
"""

from __future__ import annotations

import os

from triax.errors import ConfigError

# The readers import what they need when called: the lock and the metrics
# writers name their files from this module without importing JAX.

CONFIG = 'config.json'
DEVICES = 'devices.json'
COMPILE_STATS = 'compile_stats.json'
METRICS = 'metrics.jsonl'
TENSORBOARD = 'tb'
WANDB_RUN_ID = 'wandb_run_id'
PROFILE = 'profile'
CHECKPOINTS = 'checkpoints'
TOKENIZER = 'tokenizer.json'
HF_CONFIG = 'hf_config.json'
LOCK = 'triax.lock'
ELASTIC = 'elastic.jsonl'
ROLLBACKS = 'rollbacks.jsonl'
ROLLED_BACK = 'checkpoints_rolled_back'


def path(workdir: str, name: str) -> str:
  """DIR/name for one of the names above."""
  return os.path.join(workdir, name)


def checkpoint_state(workdir: str, step: int) -> str:
  """Where checkpoint `step`'s train state is (absolute: orbax wants one)."""
  return os.path.join(os.path.abspath(workdir), CHECKPOINTS, str(step), 'state')


def load_config(workdir: str):
  """The config a training run (or an import) saved in its workdir (a ConfigDict)."""
  from triax import config as config_lib

  if not os.path.isdir(workdir):
    raise ConfigError('--workdir', f'{workdir}: no such directory')
  if not os.path.isfile(path(workdir, CONFIG)):
    raise ConfigError(
      '--workdir', f'{workdir} has no {CONFIG}: give the --workdir of a triax train run'
    )
  # Keys an older run lacks (model families, say) keep their defaults: a GPT.
  return config_lib.load_json(path(workdir, CONFIG))


def tokenizer(workdir: str, cfg):
  """What the run's tokens mean (a data.tokenizer.Tokenizer): its data.tokenizer,
  else the tokenizer.json an import recorded beside it (training/hf_checkpoint.py),
  else bytes."""
  from triax.data import tokenizer as tokenizer_lib

  if cfg.data.tokenizer != tokenizer_lib.BYTES:
    return tokenizer_lib.load(cfg.data.tokenizer)
  recorded = path(workdir, TOKENIZER)
  return tokenizer_lib.load(recorded if os.path.isfile(recorded) else tokenizer_lib.BYTES)


def latest_step(workdir: str, cfg) -> int:
  """The step of the run's newest intact checkpoint."""
  from triax.training.checkpoint import Checkpointer  # it names its folder from here

  step = Checkpointer(workdir, cfg).latest_step()
  if step is None:
    raise ConfigError(
      '--workdir',
      f'{workdir} has no checkpoints yet: train first '
      f'(python -m triax train ... --workdir={workdir})',
    )
  return step


def restore_params(workdir: str, cfg, step: int, shardings=None):
  """The params of checkpoint `step`, placed by `shardings` (a tree like the
  params'; None: the first device). The optimizer state, twice their size,
  is not read."""
  import jax
  import orbax.checkpoint as ocp

  from triax.model import generation, registry

  model = registry.build(registry.spec_from_config(cfg.model))
  abstract = jax.eval_shape(model.init, jax.random.key(0))
  if shardings is None:
    shardings = generation.Placement().shardings(model)  # the first device
  target = {
    'params': jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings
    )
  }
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(
      checkpoint_state(workdir, step),
      args=ocp.args.PyTreeRestore(
        item=target,
        restore_args={
          'params': jax.tree.map(lambda sh: ocp.ArrayRestoreArgs(sharding=sh), shardings)
        },
        partial_restore=True,
      ),
    )
  return restored['params']
