"""What every script under scripts/ shares: the repository's paths, forced CPU
devices, and triax run in a process of its own.

A script runs as `python scripts/NAME.py`, so scripts/ is first on sys.path
and `import bench_harness` finds this file (tests load scripts with
tests/harness.load_script, which puts scripts/ there too). Importing it puts
this tree's src/ on sys.path once, so the script imports triax without
PYTHONPATH; a script that forces devices calls `force_cpu_devices()` before
it imports JAX.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NoReturn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, 'src')
if SRC not in sys.path:
  sys.path.insert(0, SRC)

# XLA:CPU's device count; jax reads XLA_FLAGS once, when its backend starts.
DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def force_cpu_devices(n: int = 8) -> None:
  """Asks XLA:CPU for `n` devices through XLA_FLAGS; call it before JAX starts
  its backend (afterwards it changes nothing). A count XLA_FLAGS names already
  is kept (the caller chose it); other flags there stay beside the count."""
  flags = os.environ.get('XLA_FLAGS', '')
  if DEVICE_COUNT_FLAG not in flags:
    os.environ['XLA_FLAGS'] = f'{flags} {DEVICE_COUNT_FLAG}={n}'.strip()


def fail(key: str, message: str) -> NoReturn:
  """Bad input to a script: one line naming the flag (or what is missing)
  and what to do, exit 2, before anything is written."""
  print(f'error: {key}: {message}', file=sys.stderr)
  sys.exit(2)


def device_count_flags(n: int) -> str:
  """XLA_FLAGS for a process of its own on `n` forced CPU devices."""
  return f'{DEVICE_COUNT_FLAG}={n}'


def run_python(
  args: list[str],
  *,
  python: str = sys.executable,
  env: dict[str, str] | None = None,
  drop_device_count: bool = False,
  cwd: str = ROOT,
  check: bool = False,
) -> subprocess.CompletedProcess[str]:
  """`PYTHON ARGS...` in a process of its own, the way the scripts run triax
  (`-m triax train ...`, `-m triax.cli.budget ...`, a runner script):

  - `python`: this interpreter, or another venv's (MaxText's) that imports
    this tree's triax through PYTHONPATH;
  - its environment: this process's, PYTHONPATH = SRC in place of ours, then
    `env` on top (which may name another tree's src);
  - `drop_device_count`: XLA_FLAGS inherited without its forced device count (ours
    would clash with the one the command sets itself, e.g. `--cpu_devices`);
    the other flags stay (under pytest, the tests' compile flags: conftest.py);
  - in `cwd`, ROOT unless named (the commands' experiments/ paths are
    relative to it);
  - stdout and stderr captured as text; `check`: CalledProcessError on a
    nonzero exit, else the caller reads `returncode`.
  """
  inherited = dict(os.environ)
  if drop_device_count:
    kept = [
      f for f in inherited.pop('XLA_FLAGS', '').split() if not f.startswith(DEVICE_COUNT_FLAG)
    ]
    if kept:
      inherited['XLA_FLAGS'] = ' '.join(kept)
  return subprocess.run(
    [python, *args],
    cwd=cwd,
    env={**inherited, 'PYTHONPATH': SRC, **(env or {})},
    capture_output=True,
    text=True,
    check=check,
  )


def doc_sections(path: str) -> dict[str, list[str]]:
  """The lines under each `## title` of a report as its script last wrote it,
  so a script can rerun some sections and keep the others."""
  if not os.path.exists(path):
    return {}
  sections, title = {}, None
  with open(path) as f:
    for line in f.read().splitlines():
      if line.startswith('## '):
        title = line[3:]
        sections[title] = []
      elif title is not None:
        sections[title].append(line)
  return {t: '\n'.join(rows).strip('\n').splitlines() for t, rows in sections.items()}
