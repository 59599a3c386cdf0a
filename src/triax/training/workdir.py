"""A run's workdir: every name in it, and what reading a run back needs.

  DIR/config.json          the validated config (train, or an import)
  DIR/devices.json         the CPU device count a resume needs (CPU runs)
  DIR/compile_stats.json   XLA's memory and cost analysis of the step
  DIR/metrics.jsonl        one JSON object per logged step
  DIR/samples.jsonl        each step's window ids (train.record_sample_ids)
  DIR/tb/                  TensorBoard events
  DIR/wandb_run_id         the W&B run a resume continues
  DIR/wandb/               W&B's own files of the run (it names the folder)
  DIR/profile/             jax.profiler traces (--profile_steps)
  DIR/checkpoints/STEP/    orbax checkpoints (training/checkpoint.py), each with
    triax_manifest.json    the size and CRC-32 of every file of the step
  DIR/checkpoints_damaged/STEP/      damaged steps a --restore_fallback resume set aside
  DIR/checkpoints_rolled_back/STEP/  checkpoints a rollback set aside
  DIR/tokenizer.json       an import's tokenizer (triax convert; a sentencepiece one:
  DIR/tokenizer.model        tokenizer.model)
  DIR/hf_files/            an import's other HF files (tokenizer_config.json,
                           generation_config.json, ...), which an export writes back
  DIR/hf_config.json       an import's HF config (export keeps its ids)
  DIR/triax.lock           who is writing the workdir (training/lock.py)
  DIR/elastic.jsonl        one record per restart of `triax supervise` (elastic/supervisor.py)
  DIR/rollbacks.jsonl      one line per bad-step rollback (training/bad_steps.py)
  DIR/goodput.jsonl        every attempt's time by what it went to (training/goodput.py)
  DIR/heartbeats/TASK      `triax supervise --launcher=srun`'s heartbeat files (elastic/heartbeat.py)

Every other module names these through the constants below (`path(DIR, NAME)`);
`NAMES` is the whole list, which a test holds a real run's workdir to.
`sample`, `convert --export` and a resume read a run back with
`load_config`, `tokenizer` and `restore_params` (or `params_reader`, leaf by
leaf), whose checks are the resume's.
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
SAMPLES = 'samples.jsonl'
TENSORBOARD = 'tb'
WANDB_RUN_ID = 'wandb_run_id'
WANDB = 'wandb'
PROFILE = 'profile'
CHECKPOINTS = 'checkpoints'
MANIFEST = 'triax_manifest.json'  # in each DIR/checkpoints/STEP/
DAMAGED = 'checkpoints_damaged'
ROLLED_BACK = 'checkpoints_rolled_back'
TOKENIZER = 'tokenizer.json'
TOKENIZER_MODEL = 'tokenizer.model'
HF_FILES = 'hf_files'
HF_CONFIG = 'hf_config.json'
LOCK = 'triax.lock'
ELASTIC = 'elastic.jsonl'
ROLLBACKS = 'rollbacks.jsonl'
GOODPUT = 'goodput.jsonl'
HEARTBEATS = 'heartbeats'

# What DIR itself may hold (MANIFEST lives a level down, in each step).
NAMES = (
  CONFIG,
  DEVICES,
  COMPILE_STATS,
  METRICS,
  SAMPLES,
  TENSORBOARD,
  WANDB_RUN_ID,
  WANDB,
  PROFILE,
  CHECKPOINTS,
  DAMAGED,
  ROLLED_BACK,
  TOKENIZER,
  TOKENIZER_MODEL,
  HF_FILES,
  HF_CONFIG,
  LOCK,
  ELASTIC,
  ROLLBACKS,
  GOODPUT,
  HEARTBEATS,
)


def path(workdir: str, name: str) -> str:
  """DIR/name for one of the names above."""
  return os.path.join(workdir, name)


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
  else the tokenizer.json an import recorded beside it (convert/hf_checkpoint.py),
  else bytes."""
  from triax.data import tokenizer as tokenizer_lib

  if cfg.data.tokenizer != tokenizer_lib.BYTES:
    return tokenizer_lib.load(cfg.data.tokenizer)
  recorded = path(workdir, TOKENIZER)
  return tokenizer_lib.load(recorded if os.path.isfile(recorded) else tokenizer_lib.BYTES)


def restore_params(workdir: str, cfg, shardings=None) -> tuple[int, object]:
  """The step and params of the run's newest checkpoint, placed by `shardings`
  (a tree like the params'; None: the first device).

  Read by `Checkpointer.restore_params`, which checks them as a resume does
  (checksums, model record); the optimizer state, twice their size, is not read.

  Raises:
    ConfigError: no checkpoint yet, a damaged newest one, or another model's.
  """
  import jax

  from triax.model import generation, registry

  if shardings is None:
    model = registry.build(registry.spec_from_config(cfg.model))
    shardings = generation.Placement().shardings(model)  # the first device
  reader, shapes = params_reader(workdir, cfg)
  target = jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )
  return reader.step, reader.read(target)


def params_reader(workdir: str, cfg):
  """(reader, shapes) of the run's newest checkpoint: `Checkpointer.params_reader`'s
  `ParamsReader` (the step checked as a resume checks it), and the params'
  tree of `jax.ShapeDtypeStruct`s (no sharding).

  Raises:
    ConfigError: no checkpoint yet, a damaged newest one, or another model's.
  """
  import jax

  from triax.model import registry
  from triax.training.checkpoint import Checkpointer  # it names its folders from here

  model = registry.build(registry.spec_from_config(cfg.model))
  found = Checkpointer(workdir, cfg).params_reader()
  if found is None:
    raise ConfigError(
      '--workdir',
      f'{workdir} has no checkpoints yet: train first '
      f'(python -m triax train ... --workdir={workdir})',
    )
  return found, jax.eval_shape(model.init, jax.random.key(0))
