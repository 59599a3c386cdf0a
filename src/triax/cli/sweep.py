"""Runs a config file's sweep: `python -m triax sweep --config=FILE[:ARG] --workdir=DIR`.

Each point of the file's `sweep(add, arg=None)` trains as its own
`python -m triax train` process in DIR/<point name>/; failures are recorded
and the sweep goes on; points already complete are skipped when the command
is run again. Writes DIR/results.csv, DIR/results.md and DIR/{loss,
throughput,memory}.png, and with --readme=README.md the table goes between
`<!-- results:NAME:begin -->` and `<!-- results:NAME:end -->` (NAME = the
config file's stem). Exit status: 0 all points ok, 1 some failed, 2 bad input.

Kept to flag parsing and one library call (triax.sweeps.runner).
"""

import os
import shlex
import sys

from absl import flags

from triax import cli
from triax.sweeps import runner

_CONFIG = flags.DEFINE_string(
  'config', None, 'Config file defining get_config(arg) and sweep(add, arg=None); FILE[:ARG].'
)
_WORKDIR = flags.DEFINE_string(
  'workdir',
  None,
  'Sweep directory: one subdirectory per point, '
  'results.{csv,md} and plots; rerunning skips complete points.',
)
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'Training processes at a time.')
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices',
  8,
  'Passed to every run as --cpu_devices; 0 leaves the devices to JAX (accelerators).',
)
_README = flags.DEFINE_string(
  'readme', '', 'Markdown file whose results:NAME block gets the table (the markers must exist).'
)
_PROGRESS = flags.DEFINE_bool('progress', True, 'Show a progress bar over the points.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'List the points and their commands; run nothing.')


def main(argv):
  if not _CONFIG.value:
    cli.fail('--config', 'is required, e.g. --config=experiments/mesh_sweep.py')
  if not _WORKDIR.value:
    cli.fail('--workdir', 'is required: where the runs and the results go')
  command = ' '.join(['python -m triax sweep'] + [shlex.quote(a) for a in sys.argv[1:]])
  with cli.config_errors_exit():
    summary = runner.run_sweep(
      _CONFIG.value,
      _WORKDIR.value,
      parallel=_PARALLEL.value,
      cpu_devices=_CPU_DEVICES.value,
      readme=_README.value,
      progress=_PROGRESS.value,
      dry_run=_DRY_RUN.value,
      command=command,
    )
  if summary.get('dry_run'):
    return
  workdir = os.path.abspath(_WORKDIR.value)
  print(
    f'results: {workdir}/results.md ({workdir}/results.csv, loss.png, throughput.png, memory.png)'
  )
  if _README.value:
    print(f'readme:  {summary["readme"]} updated')
  ok = summary['points'] - len(summary['failed'])
  print(
    f'{summary["points"]} points: {ok} ok ({summary["skipped"]} already complete), '
    f'{len(summary["failed"])} failed'
  )
  if summary['failed']:
    print(
      'failed: ' + ', '.join(summary['failed']) + ' (see DIR/<point>/stderr.txt)', file=sys.stderr
    )
    sys.exit(1)


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
