"""scripts/bench_peers.py: bad input is one line and exit 2, the page is its
json's, and nothing in the package needs MaxText (a reference only)."""

import json
import os

import harness
import pytest

DOC = os.path.join(harness.ROOT, 'docs', 'bench_peers.md')


def _run(*args, env=None):
  return harness.run_script('bench_peers.py', *args, env=env)


@pytest.mark.fast
def test_an_unknown_layout_is_one_line_and_exit_2(tmp_path):
  out = tmp_path / 'peers.md'
  done = _run('--layouts=dp8,pp9', f'--out={out}')
  assert done.returncode == 2
  assert done.stderr.strip() == (
    "error: --layouts: unknown layout 'pp9'; choose from dp8, fsdp8, tp2_fsdp4, tp4_dp2, "
    'pp4_dp2_1f1b, pp4_dp2_zb_h1, pp4_v2_dp2'
  )
  assert not out.exists()


@pytest.mark.fast
def test_a_maxtext_venv_that_fails_to_build_is_one_line_and_exit_2(tmp_path):
  # A python that answers `-c pass` (found as 3.12) but cannot make a venv.
  fake = tmp_path / 'python3.12'
  fake.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\nexit 1\n')
  fake.chmod(0o755)
  out = tmp_path / 'peers.md'
  env = {'TRIAX_BENCH_DIR': str(tmp_path / 'bench'), 'TRIAX_PYTHON312': str(fake)}
  done = _run('--layouts=dp8', '--pairs=1', f'--out={out}', env=env)
  assert done.returncode == 2, done.stderr
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith('error: MaxText venv: building ') and last.endswith('fix pip and rerun')
  assert not out.exists()


@pytest.mark.fast
def test_one_device_without_a_maxtext_python_says_which_to_name(tmp_path):
  done = _run('--one_device', env={'TRIAX_MAXTEXT_PYTHON': str(tmp_path / 'none')})
  assert done.returncode == 2
  assert done.stderr.startswith('error: TRIAX_MAXTEXT_PYTHON: no MaxText python')
  assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.fast
def test_the_page_is_what_the_script_writes_from_its_json(tmp_path):
  """docs/bench_peers.md is the script's rendering of docs/bench_peers.json:
  every layout has both frameworks' step times, a ratio and a spread."""
  out = tmp_path / 'bench_peers.md'
  with open(os.path.join(harness.ROOT, 'docs', 'bench_peers.json')) as f:
    (tmp_path / 'bench_peers.json').write_text(f.read())
  done = _run('--layouts=', f'--out={out}')
  assert done.returncode == 0, done.stderr
  with open(DOC) as f:
    assert out.read_text() == f.read()
  peers = harness.load_script('bench_peers')
  rows = [line for line in peers.table(json.loads((tmp_path / 'bench_peers.json').read_text()))]
  assert len(rows) == 2 + len(peers.LAYOUTS)


@pytest.mark.fast
def test_maxtexts_step_times_are_the_gaps_between_its_step_lines():
  peers = harness.load_script('bench_peers')
  log = '\n'.join(
    f'I1206 17:{m:02d}:{s:02d}.500000 140 metric_logger.py:265] completed step: {i}, seconds: 0.3, '
    for i, (m, s) in enumerate([(33, 10), (33, 20), (33, 32), (34, 2)])
  )
  assert peers._maxtext_steps(log) == [10.0, 12.0, 30.0]


@pytest.mark.fast
def test_nothing_in_the_package_imports_maxtext():
  src = os.path.join(harness.ROOT, 'src')
  for root, _dirs, files in os.walk(src):
    for name in files:
      if name.endswith('.py'):
        with open(os.path.join(root, name)) as f:
          text = f.read()
        assert 'import maxtext' not in text and 'from maxtext' not in text, name
