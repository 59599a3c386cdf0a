"""Which of 1f1b+remat, 1f1b with a smaller micro-batch, or bpipe fits a memory limit, fastest?

  python -m triax budget --config=experiments/gpt_tiny.py --memory_limit_mib=64 --cpu_devices=8

Compiles and times each candidate (see triax.training.budget) and prints a table.
"""

from absl import flags
from ml_collections import config_flags

from triax import cli

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Experiment config file.', lock_config=True
)
_LIMIT = flags.DEFINE_float('memory_limit_mib', None, 'Per-device memory limit in MiB.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', None, 'Force this many CPU devices.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Timed steps per candidate.')


def main(argv):
  cfg = cli.config_value(_CONFIG)
  if cfg is None:
    cli.fail('--config', 'is required, e.g. --config=experiments/gpt_tiny.py')
  if _LIMIT.value is None or _LIMIT.value <= 0:
    cli.fail('--memory_limit_mib', 'give the per-device limit in MiB, e.g. 64')
  cli.force_cpu_devices(_CPU_DEVICES.value)
  from triax.training import budget  # after the device count is set

  with cli.config_errors_exit():
    cands = budget.evaluate(cfg, steps=_STEPS.value)
  print(budget.report(cands, int(_LIMIT.value * 2**20)))


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
