"""Runs `python -m MODULE ARGS` cases as forked children of one warm process.

A command-line case costs a Python start and the imports of JAX, flax,
optax, orbax and triax (about 3 s of a core each here) before it reaches
the check it is about; the bad-input catalogue runs ninety of them. A
server started once imports those libraries, then forks a child per case:
the child is a fresh process as far as the case can tell (its own absl
flags, its own device count, since no JAX backend starts before the fork),
and it runs the module as `python -m` would, with stdout and stderr in
files and the exit status returned.

Only libraries are imported before the fork, never a `triax.cli` module:
each defines absl flags at import, and a case must define its own.

  server = ForkServer()            # one per thread that runs cases
  result = server.run('triax.cli.train', ['--config=...'], timeout=300)
  result.returncode, result.stdout, result.stderr
  server.close()
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What every case imports anyway; importing them once is the point.
WARM = (
  'numpy',
  'jax',
  'jax.numpy',
  'flax',
  'flax.linen',
  'optax',
  'orbax.checkpoint',
  'absl.flags',
  'absl.app',
  'ml_collections',
  'ml_collections.config_flags',
  'triax.config',
  'triax.training.loop',
)


class ForkServer:
  """A warm process that runs each case in a forked child (see the module doc)."""

  def __init__(self, env_extra: dict | None = None):
    import harness  # the test process's module (this file is also the server's __main__)

    env = harness.subprocess_env(env_extra)  # each case's --cpu_devices decides, as in run_cli
    self._proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__)],
      cwd=ROOT,
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    self._dir = tempfile.mkdtemp(prefix='forkserver-')
    self._count = 0

  def run(self, module: str, args, timeout: int = 600):
    """Runs one case; returns an object with returncode, stdout, stderr."""
    self._count += 1
    out = os.path.join(self._dir, f'{self._count}.out')
    err = os.path.join(self._dir, f'{self._count}.err')
    request = {'module': module, 'args': list(args), 'out': out, 'err': err, 'timeout': timeout}
    self._proc.stdin.write(json.dumps(request) + '\n')
    self._proc.stdin.flush()
    line = self._proc.stdout.readline()
    if not line:
      raise RuntimeError('fork server died')
    reply = json.loads(line)
    with open(out) as f:
      stdout = f.read()
    with open(err) as f:
      stderr = f.read()
    return types.SimpleNamespace(returncode=reply['returncode'], stdout=stdout, stderr=stderr)

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait(timeout=60)


def _child(request) -> None:
  """In the forked child: becomes `python -m MODULE ARGS` and never returns."""
  import runpy

  code = 1
  try:
    out = os.open(request['out'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request['err'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0)
    sys.stdout = open(1, 'w', buffering=1)
    sys.stderr = open(2, 'w', buffering=1)
    sys.argv = [request['module']] + request['args']
    try:
      runpy.run_module(request['module'], run_name='__main__', alter_sys=True)
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      if not isinstance(e.code, (int, type(None))):
        print(e.code, file=sys.stderr)
    except BaseException:
      import traceback

      traceback.print_exc()
      code = 1
  finally:
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(code)


def _serve() -> None:
  import importlib
  import signal
  import time

  for name in WARM:
    importlib.import_module(name)
  for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
      _child(request)
    deadline = time.monotonic() + request['timeout']
    done, status = os.waitpid(pid, os.WNOHANG)
    while not done and time.monotonic() < deadline:
      time.sleep(0.02)
      done, status = os.waitpid(pid, os.WNOHANG)
    if not done:  # past its timeout: killed, as subprocess.run's timeout would
      os.kill(pid, signal.SIGKILL)
      _, status = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps({'returncode': os.waitstatus_to_exitcode(status)}) + '\n')
    sys.stdout.flush()


if __name__ == '__main__':
  sys.path.insert(0, os.path.join(ROOT, 'src'))
  _serve()
