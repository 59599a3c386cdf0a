"""Where a run's wall time went, across its restarts: `python -m triax goodput --workdir=DIR
[--plot=FILE.png]`.

Reads DIR/goodput.jsonl (what train records: training/goodput.py) and prints the time of
productive steps, compile, data, checkpoints, evaluation, steps lost to a kill or a
rollback, restarts and start-up, which add up to the wall time. Kept to flag parsing and
one library call (triax.training.goodput_report).
"""

from absl import flags

from triax import cli

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train --workdir.')
_PLOT = flags.DEFINE_string('plot', None, 'Also draw the split and the steps reached to this PNG.')


def main(argv):
  del argv
  if not _WORKDIR.value:
    cli.fail('--workdir', 'is required: the train --workdir to account for')
  from triax.training import goodput, goodput_report

  with cli.config_errors_exit():
    ledger = goodput.ledger(_WORKDIR.value)
  print(goodput_report.table(ledger))
  if _PLOT.value:
    goodput_report.plot(goodput.read(_WORKDIR.value), ledger, _PLOT.value)
    print(f'plot: {_PLOT.value}')


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
