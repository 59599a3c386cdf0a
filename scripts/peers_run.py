"""One timed training run of triax or MaxText for scripts/bench_peers.py.

  python scripts/peers_run.py OUT.json triax|maxtext ARGS...

Both frameworks start the same way here, in one process on the same jax:
8 CPU devices forced through `jax_num_cpu_devices` before the backend
starts, and every `Lowered.compile` call timed (OUT.json gets their
seconds; the train step's is the longest). Then the framework's own entry
point runs with ARGS: `triax train`'s flags, or MaxText's `train` keys after
its base.yml. MaxText's CPU start-up calls `jax.distributed.initialize` for
an XPK job's processes; here there is one process, so that call is skipped,
which keeps MaxText's collectives inside the process as triax's are (with
the distributed client, XLA:CPU would run them through Gloo).

The process's CPU seconds (all its threads) are sampled with the wall clock
every SAMPLE seconds into OUT.json's `cpu_samples`, so bench_peers.py can
count a step's CPU seconds beside its wall time: other work on the machine
stretches the second, not the first. With TRIAX_PEERS_WATCH=FILE each sample
also holds FILE's line count (triax's metrics.jsonl: when its steps end).

Run by the MaxText venv's python with PYTHONPATH=src (bench_peers.py does).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

# 8 forced CPU devices; TRIAX_PEERS_DEVICES=1 for one (a GPU run leaves the GPU's count alone).
DEVICES = int(os.environ.get('TRIAX_PEERS_DEVICES', '8'))
SAMPLE = 0.1  # seconds between CPU samples


def _lines(path: str) -> int:
  try:
    with open(path, 'rb') as f:
      return f.read().count(b'\n')
  except OSError:
    return 0


WATCH = os.environ.get('TRIAX_PEERS_WATCH')


def _sample() -> list:
  """[wall, CPU seconds of the process] and, with WATCH, its line count."""
  t = os.times()
  return [time.time(), t.user + t.system] + ([_lines(WATCH)] if WATCH else [])


def _sample_cpu(samples: list) -> None:
  """Appends a `_sample()` every SAMPLE seconds, in a daemon thread."""

  def loop():
    while True:
      samples.append(_sample())
      time.sleep(SAMPLE)

  threading.Thread(target=loop, daemon=True).start()


def _time_compiles(out: str, samples: list) -> None:
  """Records each compile's seconds, written to `out` at exit with `samples`."""
  import jax

  seconds = []
  compile_ = jax.stages.Lowered.compile

  def timed(self, *args, **kwargs):
    started = time.perf_counter()
    try:
      return compile_(self, *args, **kwargs)
    finally:
      seconds.append(time.perf_counter() - started)

  jax.stages.Lowered.compile = timed

  def write():
    with open(out, 'w') as f:
      json.dump({'compile_seconds': seconds, 'cpu_samples': [*samples, _sample()]}, f)

  atexit.register(write)


def _maxtext(args: list[str]) -> None:
  import maxtext
  from absl import app
  from maxtext.trainers.pre_train import train
  from maxtext.utils import max_utils

  # One process: no distributed client (see the module docstring).
  max_utils.initialize_jax_for_cpu = lambda raw_keys: None
  base = os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml')
  sys.argv = ['train', base, *args]
  app.run(train.main)


def _triax(args: list[str]) -> None:
  from triax.cli import train

  sys.argv = ['triax train', *args]
  train.run()


def main() -> None:
  if len(sys.argv) < 3 or sys.argv[2] not in ('triax', 'maxtext'):
    print('error: usage: peers_run.py OUT.json triax|maxtext ARGS...', file=sys.stderr)
    sys.exit(2)
  out, framework, args = sys.argv[1], sys.argv[2], sys.argv[3:]
  import jax

  if DEVICES > 1:  # forced CPU devices; one device is the local platform's
    jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', DEVICES)
  samples = []
  _sample_cpu(samples)
  _time_compiles(out, samples)
  (_triax if framework == 'triax' else _maxtext)(args)


if __name__ == '__main__':
  main()
