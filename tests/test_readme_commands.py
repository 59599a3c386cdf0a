"""README.md's commands: every block is tagged, what it names exists, and the
runner (scripts/readme_commands.py) runs the blocks as one shell session that
stops at the first failing command. The whole run from a fresh clone (install,
training, the suite) is the script's own job, not the suite's."""

import os
import subprocess
import sys

import harness
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'readme_commands.py')


def _script():
  """The script as a module, loaded once (its absl flags can be defined only once)."""
  return sys.modules.get('readme_commands') or harness.load_script('readme_commands')


@pytest.mark.fast
def test_blocks_need_a_tag_and_commands_join_continuations():
  r = _script()
  tagged = 'text\n<!-- readme: run given=texts -->\n```\na --x \\\n    --y  # why\n# note\nb\n```\n'
  [block] = r.blocks(tagged)
  assert (block.mode, block.options, block.line) == ('run', 'given=texts', 3)
  assert r.commands(block.text) == ['a --x --y', 'b']
  with pytest.raises(SystemExit, match='README.md:2: a block without'):
    r.blocks('text\n```\nrm -rf runs\n```\n')
  assert r.triax_command('python -m triax plan --config=x.py [--top=5]') == (
    'plan',
    ['config', 'top'],
  )


@pytest.mark.fast
def test_the_session_stops_at_the_first_failing_command(tmp_path):
  r = _script()
  blocks = r.blocks('<!-- readme: run -->\n```\necho one\nfalse\necho never\n```\n')
  script = r.session(blocks, skip=['echo skipped'])
  run = subprocess.run(['bash', '-c', script], capture_output=True, text=True, cwd=tmp_path)
  assert run.returncode == 1
  assert 'one' in run.stdout and 'never\n' not in run.stdout.replace('--- echo never', '')


def test_every_readme_block_is_tagged_and_names_what_exists():
  out = subprocess.run(
    [sys.executable, SCRIPT, '--check_only'], capture_output=True, text=True, cwd=ROOT
  )
  assert out.returncode == 0, out.stdout + out.stderr
  modes = [line.split(': ')[1].split()[0] for line in out.stdout.splitlines()]
  assert 'run' in modes and 'synopsis' in modes


def test_a_flag_the_command_lacks_is_caught(tmp_path):
  r = _script()
  [block] = r.blocks('<!-- readme: synopsis -->\n```\npython -m triax sample --nope=1 \\\n'
                     '    --config.model.nope=2 [--seed=0]\n```\n')  # fmt: skip
  assert r.check(block) == [
    'sample: --nope: not a flag of the command',
    'sample: --config.model.nope: no such config key',
  ]
