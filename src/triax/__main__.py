"""`python -m triax COMMAND [flags]`: one command line for every entry point.

  python -m triax train --config=experiments/gpt_tiny.py --workdir=runs/tiny
  python -m triax schedule --schedule=1f1b --stages=4 --microbatches=8
  python -m triax plan --config=... --cluster=experiments/clusters/selene.yaml

The commands live in `triax/cli/` (one module each, also runnable as
`python -m triax.cli.COMMAND`); only the chosen one is imported, so each
defines its own absl flags. No command, or `--help`, lists them; an unknown
one is one `error:` line and exit 2.
"""

import importlib
import sys

from triax import cli

USAGE = 'usage: python -m triax COMMAND [flags]   (python -m triax COMMAND --help for its flags)'


def main(argv: list[str]) -> None:
  if len(argv) < 2 or argv[1] in ('-h', '--help', 'help'):
    print(USAGE)
    print('commands:')
    for name, summary in cli.COMMANDS.items():
      print(f'  {name:<10} {summary}')
    sys.exit(0 if len(argv) >= 2 else cli.EXIT_BAD_INPUT)
  name = argv[1]
  if name not in cli.COMMANDS:
    cli.fail('COMMAND', f'{name!r} is not a triax command; choose one of {", ".join(cli.COMMANDS)}')
  module = importlib.import_module(f'triax.cli.{name}')
  # absl reads the program name and flags from sys.argv, and names the process after it
  # (/proc/PID/stat's comm): no space there, or SLURM's proctrack/linuxproc, which reads
  # that file with "%d (%s)", loses the process and never signals it (scancel, requeue).
  sys.argv = [f'triax-{name}'] + argv[2:]
  module.run()


def main_entry() -> None:
  """The `triax` console script."""
  main(sys.argv)


if __name__ == '__main__':
  main_entry()
