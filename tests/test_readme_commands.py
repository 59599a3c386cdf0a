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


def test_the_qwen3_fine_tune_block_runs_as_written(tmp_path):
  """README's import -> prepare -> train -> export of a Qwen3, run by the
  script's own session and fixtures (what its tag gives) in an empty folder,
  with this checkout's interpreter and sources."""
  pytest.importorskip('transformers')
  r = _script()
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    [block] = [b for b in r.blocks(f.read()) if 'given=hf_qwen3' in b.options]
  assert r.givens([block]) == ['texts', 'hf_qwen3']
  for name in r.givens([block]):
    r.GIVEN[name](str(tmp_path))
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, 'src'))
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  run = subprocess.run(
    ['bash', '-c', r.session([block], skip=[])],
    capture_output=True,
    text=True,
    cwd=tmp_path,
    env=env,
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert 'runs/q3-hf: step 6 of runs/q3 as Qwen3ForCausalLM in bfloat16' in run.stdout
  assert 'torch.bfloat16 <|endoftext|>' in run.stdout
  exported = sorted(os.listdir(tmp_path / 'runs' / 'q3-hf'))
  assert {'generation_config.json', 'tokenizer.json', 'tokenizer_config.json'} <= set(exported)
