"""Does the config fit a memory limit, and if not, which of recompute, a smaller micro-batch,
BPipe, ZeRO-1 or FSDP does, fastest?

  python -m triax budget --config=experiments/gpt_tiny.py --memory_limit_mib=64 --cpu_devices=8

Compiles each candidate (a line each), times those that fit (see triax.compiled.budget)
and prints a table.
"""

from absl import flags
from ml_collections import config_flags

from triax import cli

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Experiment config file.', lock_config=True
)
_LIMIT = flags.DEFINE_float('memory_limit_mib', None, 'Per-device memory limit in MiB.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', None, 'Force this many CPU devices.')
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps per candidate that fits (their median).')


def main(argv):
  cfg = cli.config_value(_CONFIG)
  if cfg is None:
    cli.fail('--config', 'is required, e.g. --config=experiments/gpt_tiny.py')
  if _LIMIT.value is None or _LIMIT.value <= 0:
    cli.fail('--memory_limit_mib', 'give the per-device limit in MiB, e.g. 64')
  cli.force_cpu_devices(_CPU_DEVICES.value)
  from triax.compiled import budget  # after the device count is set

  limit = int(_LIMIT.value * 2**20)
  with cli.config_errors_exit():
    cands = budget.evaluate(
      cfg, limit, steps=_STEPS.value, say=lambda line: print(line, flush=True)
    )
  print(budget.report(cands, limit))


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
