"""`python -m triax COMMAND`: one command line over the entry points in triax/cli/."""

import ast
import configparser
import os
import re
import subprocess
import sys

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


def _console_scripts() -> dict[str, str]:
  # setup.cfg's console_scripts, `triax-NAME = triax.cli.NAME:run` -> {NAME: module}.
  parser = configparser.ConfigParser()
  parser.read(os.path.join(harness.ROOT, 'setup.cfg'))
  scripts = {}
  for line in parser['options.entry_points']['console_scripts'].strip().splitlines():
    script, target = (part.strip() for part in line.split('='))
    if script.startswith('triax-'):
      scripts[script[len('triax-') :]] = target.split(':')[0]
  return scripts


def _own_flags(name: str) -> set[str]:
  # The flags a command's module defines, read from its source, not imported.
  with open(os.path.join(CLI_DIR, f'{name}.py')) as f:
    return set(re.findall(r"DEFINE_\w+\(\s*'(\w+)'", f.read()))


def _assert_lists_own_flags(name: str, result) -> None:
  assert result.returncode == 0 and '\nflags:\n' in result.stdout, (name, result.stdout)
  block = result.stdout.split('\nflags:\n', 1)[1].split('\n\n', 1)[0].splitlines()
  lines = [re.fullmatch(r'  --(?:\[no\])?(\w+): \S.*', line) for line in block]
  assert all(lines), (name, block)  # one line a flag
  assert {m.group(1) for m in lines} == _own_flags(name), (name, result.stdout)
  assert f'python -m triax {name}' in result.stdout, name  # its usage, not the dispatcher's


def test_every_command_help_lists_its_own_flags():
  for name in cli.COMMANDS:
    _assert_lists_own_flags(name, harness.run_cli('triax', name, '--help', timeout=120))


def test_every_console_script_help_lists_its_own_flags():
  scripts = _console_scripts()
  assert set(scripts) == set(cli.COMMANDS)
  for name, module in scripts.items():
    # What the installed script does: import the module, call run(), argv[0] the script.
    code = f"import sys; sys.argv[0] = 'triax-{name}'; from {module} import run; run()"
    env = dict(os.environ, PYTHONPATH=os.path.join(harness.ROOT, 'src'))
    result = subprocess.run(
      [sys.executable, '-c', code, '--help'], env=env, capture_output=True, text=True, timeout=120
    )
    _assert_lists_own_flags(name, result)
