"""Trains a model as configured: `python -m triax train --config=FILE[:ARG] --workdir=DIR`.

Kept to flag parsing and one library call (triax.training.loop), so the
logic stays importable and testable. Config files are Python code and are
executed as such: only run config files you trust.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from triax import cli, mesh
from triax import config as config_lib

_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  'Experiment config file (Python, get_config(arg)); FILE[:ARG]. Without it, WORKDIR/config.json '
  '(a run to resume, or a checkpoint imported by triax convert).',
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  'workdir',
  None,
  'Directory for metrics, TensorBoard logs and checkpoints; an existing one is resumed.',
)
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices',
  None,
  'Force this many CPU devices (set before JAX starts; ignored when an accelerator is present).',
)
_COMPILE_ONLY = flags.DEFINE_bool(
  'compile_only', False, 'Compile the train step, write WORKDIR/compile_stats.json and exit.'
)
_PROFILE_STEPS = flags.DEFINE_string(
  'profile_steps', '', 'A:B: write a jax.profiler trace of steps A..B to WORKDIR/profile.'
)
_PROGRESS = flags.DEFINE_bool('progress', True, 'Show a progress bar.')


def main(argv):
  if not _WORKDIR.value:
    cli.fail('--workdir', 'is required: where metrics and checkpoints go')
  cfg = cli.config_value(_CONFIG)
  saved = os.path.join(_WORKDIR.value, 'config.json')
  if cfg is None:
    if not os.path.isfile(saved):
      cli.fail('--config', 'is required, e.g. --config=experiments/gpt_tiny.py')
    # The workdir's own config: a run to resume, or an imported checkpoint to fine-tune.
    with cli.config_errors_exit():
      cfg = config_lib.load_json(saved)
    cfg.lock()
  cli.force_cpu_devices(_CPU_DEVICES.value)
  mesh.maybe_initialize_distributed()
  cli.warn_if_accelerator(_CPU_DEVICES.value)
  from triax.training import (
    loop,  # after the device count is set: importing jax is fine, starting it is not
  )

  try:
    with cli.config_errors_exit():
      summary = loop.train_and_evaluate(
        cfg,
        _WORKDIR.value,
        compile_only=_COMPILE_ONLY.value,
        profile_steps=_PROFILE_STEPS.value,
        progress=_PROGRESS.value,
      )
  except loop.NonFiniteError as e:
    # Not bad input (exit 2): the run itself diverged. The last checkpoint stays the last good one.
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
  import jax

  if jax.process_index() != 0:
    return  # process 0 speaks for a multi-process run
  workdir = os.path.abspath(_WORKDIR.value)
  if _COMPILE_ONLY.value:
    print(
      f'compile stats: {workdir}/compile_stats.json '
      f'(temp {summary["temp_bytes"] / 2**20:.1f} MiB per device)'
    )
    return
  print(f'metrics:     {workdir}/metrics.jsonl')
  # The tensorboard beside this interpreter (the venv's), so the printed
  # command works from a shell that has not activated the venv.
  board = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
  board = board if os.path.exists(board) else 'tensorboard'
  print(f'tensorboard: {board} --logdir {workdir}/tb')
  print(f'checkpoints: {workdir}/checkpoints')
  if summary['skipped_nonfinite']:
    print(
      f'skipped {len(summary["skipped_nonfinite"])} non-finite steps: '
      f'{summary["skipped_nonfinite"]} (see skipped_nonfinite in metrics.jsonl)'
    )
  if summary['final_eval_loss'] is None:
    print(
      f'nothing to do: the checkpoint is at step {summary["start_step"]} and '
      f'train.steps={summary["steps"]}'
    )
  elif summary['first_eval_loss'] is not None:
    print(
      f'eval loss {summary["first_eval_loss"]:.3f} -> {summary["final_eval_loss"]:.3f} nats '
      f'(unigram baseline of the corpus: {summary["unigram_entropy_nats"]:.3f})'
    )
  else:
    print(
      f'eval loss {summary["final_eval_loss"]:.3f} nats (resumed at step {summary["start_step"]})'
    )


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
