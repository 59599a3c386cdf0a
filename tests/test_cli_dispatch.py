"""`python -m triax COMMAND`: one command line over the entry points in triax/cli/."""

import ast
import os

import harness

from triax import cli

CLI_DIR = os.path.join(harness.ROOT, 'src', 'triax', 'cli')


def test_every_command_is_a_module_with_run():
  # Parsed, not imported: each module defines its own absl flags (several
  # define --config), so two of them never share a process.
  for name in cli.COMMANDS:
    with open(os.path.join(CLI_DIR, f'{name}.py')) as f:
      tree = ast.parse(f.read())
    assert any(isinstance(n, ast.FunctionDef) and n.name == 'run' for n in tree.body), name
  modules = {n[:-3] for n in os.listdir(CLI_DIR) if n.endswith('.py') and n != '__init__.py'}
  assert modules == set(cli.COMMANDS)


def test_help_lists_the_commands_and_no_command_is_bad_input():
  listed = harness.run_cli('triax', '--help', timeout=120)
  assert listed.returncode == 0
  assert all(f'  {name} ' in listed.stdout for name in cli.COMMANDS)
  bare = harness.run_cli('triax', timeout=120)
  assert bare.returncode == 2 and 'commands:' in bare.stdout


def test_an_unknown_command_is_one_error_line():
  result = harness.run_cli('triax', 'zigzag', timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
    f"error: COMMAND: 'zigzag' is not a triax command; choose one of {', '.join(cli.COMMANDS)}"
  ]


def test_a_command_runs_with_its_flags_and_their_errors():
  ok = harness.run_cli(
    'triax', 'schedule', '--schedule=1f1b', '--stages=2', '--microbatches=4', timeout=120
  )
  assert ok.returncode == 0, ok.stderr
  assert '1f1b' in ok.stdout
  bad = harness.run_cli('triax', 'schedule', '--stages=0', timeout=120)
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith('error: --stages')
