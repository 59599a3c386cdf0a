"""Trains a model as configured: `python -m triax train --config=FILE[:ARG] --workdir=DIR`;
`python -m triax train --workdir=DIR [--config.x=...]` resumes DIR with its own config.json.

Kept to flag parsing and one library call (triax.training.loop), so the
logic stays importable and testable. Config files are Python code and are
executed as such: only run config files you trust.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from triax import cli, mesh, workdir_config
from triax.training import workdir as workdir_lib  # names only: no JAX

_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  'Experiment config file (Python, get_config(arg)); FILE[:ARG]. Without it, WORKDIR/config.json '
  '(a run to resume, or a checkpoint imported by triax convert), which --config.x flags override.',
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
  'compile_only',
  False,
  'Compile the train step, write WORKDIR/compile_stats.json and exit. On a GPU, also the fit '
  'against the memory XLA may allocate there; exit 3 if it does not fit.',
)
_TOPOLOGY = flags.DEFINE_string(
  'topology',
  None,
  'With --compile_only: compile for this TPU slice or these GPUs instead of the local devices, '
  "on any host. TPU (needs libtpu: pip install 'triax[tpu]'): KIND:AxB or KIND:AxBxC chips, "
  "e.g. v5p:2x2x2, v5e:4x4, v6e:8x8, v4:2x2x2. GPU (needs jax's CUDA plugin: pip install "
  "'triax[gpu]', or TRIAX_XLA_CUDA_PLUGIN=its .so): h100:8, h200:8 or a100:8 (one host of "
  '8), h100:4x8 (4 hosts of 8). Writes the fit against its HBM; exit 3 if it does not fit.',
)
_TOPOLOGY_SLICES = flags.DEFINE_integer(
  'topology_slices', 1, 'With --topology: this many slices joined by the data-centre network.'
)
_PROFILE_STEPS = flags.DEFINE_string(
  'profile_steps', '', 'A:B: write a jax.profiler trace of steps A..B to WORKDIR/profile.'
)
_PROGRESS = flags.DEFINE_bool('progress', True, 'Show a progress bar.')
_RESTORE_FALLBACK = flags.DEFINE_bool(
  'restore_fallback',
  False,
  'When the newest checkpoint is damaged (its files fail their checksums), resume from the '
  'newest intact one instead of stopping with an error.',
)
_RESET_OPTIMIZER = flags.DEFINE_bool(
  'reset_optimizer',
  False,
  "Resume the newest checkpoint's parameters, step and data position with a fresh optimizer "
  'state (new moments; the learning-rate schedule goes on where the run is): how a run '
  'changes train.optimizer, which a resume otherwise refuses.',
)


def main(argv):
  if not _WORKDIR.value:
    cli.fail('--workdir', 'is required: where metrics and checkpoints go')
  cfg = cli.config_value(_CONFIG)
  if cfg is None:  # with a workdir's config.json, run() has named it as the config
    cli.fail('--config', 'is required, e.g. --config=experiments/gpt_tiny.py')
  if _TOPOLOGY.value is not None:
    return _compile_for_topology(cfg)
  # Importing jax is fine before the device count is set; starting it is not.
  from triax.training import loop

  devices = _CPU_DEVICES.value
  if devices is None:
    devices = loop.recorded_cpu_devices(_WORKDIR.value)  # a resume gets the devices it had
  cli.force_cpu_devices(devices)
  with cli.config_errors_exit():
    mesh.maybe_initialize_distributed()
  cli.warn_if_accelerator(_CPU_DEVICES.value)
  import jax

  try:
    # Every process finds the same bad input: process 0 says it (srun merges their output).
    with cli.config_errors_exit(quiet=jax.process_index() != 0):
      summary = loop.train_and_evaluate(
        cfg,
        _WORKDIR.value,
        compile_only=_COMPILE_ONLY.value,
        profile_steps=_PROFILE_STEPS.value,
        progress=_PROGRESS.value,
        restore_fallback=_RESTORE_FALLBACK.value,
        reset_optimizer=_RESET_OPTIMIZER.value,
      )
  except loop.NonFiniteError as e:
    # Not bad input (exit 2): the run itself diverged. The last checkpoint stays the last good one.
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
  if jax.process_index() != 0:
    return  # process 0 speaks for a multi-process run
  workdir = os.path.abspath(_WORKDIR.value)
  if _COMPILE_ONLY.value:
    print(
      f'compile stats: {workdir_lib.path(workdir, workdir_lib.COMPILE_STATS)} '
      f'(temp {summary["temp_bytes"] / 2**20:.1f} MiB per device)'
    )
    if 'fit_line' in summary:  # an accelerator that reports its memory (a GPU)
      _say_fit(summary)
    return
  print(f'metrics:     {workdir_lib.path(workdir, workdir_lib.METRICS)}')
  # The tensorboard beside this interpreter (the venv's), so the printed
  # command works from a shell that has not activated the venv.
  board = os.path.join(os.path.dirname(sys.executable), 'tensorboard')
  board = board if os.path.exists(board) else 'tensorboard'
  print(f'tensorboard: {board} --logdir {workdir_lib.path(workdir, workdir_lib.TENSORBOARD)}')
  print(f'checkpoints: {workdir_lib.path(workdir, workdir_lib.CHECKPOINTS)}')
  if summary['skipped_nonfinite']:
    print(
      f'skipped {len(summary["skipped_nonfinite"])} non-finite steps: '
      f'{summary["skipped_nonfinite"]} (see skipped_nonfinite in {workdir_lib.METRICS})'
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


def _compile_for_topology(cfg) -> None:
  """--compile_only --topology: the run's programs compiled by XLA:TPU or XLA:GPU here; exit 3
  if they do not fit."""
  if not _COMPILE_ONLY.value:
    cli.fail(
      '--topology', 'compiles only: add --compile_only (there is no such slice here to train on)'
    )
  if _CPU_DEVICES.value is not None:
    cli.fail('--cpu_devices', 'has no meaning with --topology (the slice gives the devices)')
  from triax import topology
  from triax.compiled import aot

  with cli.config_errors_exit():
    slice_ = topology.parse(_TOPOLOGY.value, _TOPOLOGY_SLICES.value)
    stats = aot.compile_for_topology(cfg, _WORKDIR.value, slice_)
  workdir = os.path.abspath(_WORKDIR.value)
  print(f'compile stats: {workdir_lib.path(workdir, workdir_lib.COMPILE_STATS)}')
  for buffer in stats['largest_buffers'][:3]:
    print(f'  {buffer["bytes"] / 2**30:7.2f} GiB  {buffer["shape"]}  {buffer["op_name"]}')
  _say_fit(stats)


def _say_fit(stats: dict) -> None:
  """The compiled run's fit line; exit 3 when it does not fit."""
  print(stats['fit_line'])
  if not stats['fits']:
    sys.exit(cli.EXIT_DOES_NOT_FIT)


def with_workdir_config(argv: list[str]) -> list[str]:
  """argv with `--config=.../workdir_config.py:DIR` added when it names no config and
  --workdir=DIR holds a config.json: resuming (or fine-tuning an import) by the
  workdir alone, where --config.x overrides need a config file to apply to."""
  if any(a == '--config' or a.startswith('--config=') for a in argv[1:]):
    return argv
  workdir = None
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith('--workdir='):
      workdir = arg.split('=', 1)[1]
    elif arg == '--workdir' and i + 1 < len(argv):
      workdir = argv[i + 1]
  if not workdir or not os.path.isfile(workdir_lib.path(workdir, workdir_lib.CONFIG)):
    return argv
  return [argv[0], f'--config={workdir_config.__file__}:{workdir}', *argv[1:]]


def run():
  sys.argv = with_workdir_config(sys.argv)
  cli.run(main)


if __name__ == '__main__':
  run()
