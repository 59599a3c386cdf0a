"""Where a killed and resumed run's time went: writes docs/bench_goodput.md and
docs/bench_goodput.png.

    .venv/bin/python scripts/bench_goodput.py [--steps=60] [--kill_at=35]

Trains experiments/gpt_tiny.py (data 2 x tensor 2 x pipe 2, interleaved 1F1B, 8 forced
CPU devices; a save every 20 steps) in a fresh workdir, SIGKILLs it once step --kill_at
is recorded, resumes it with the same command to --steps, and runs `triax goodput
--plot` on the workdir: the table and the figure are that command's output. A benchmark,
not a test: the seconds are this machine's, under its load at the time.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench_harness import ROOT

from triax.training import goodput


def _train(workdir: str, steps: int) -> subprocess.Popen:
  command = [
    sys.executable,
    '-m',
    'triax',
    'train',
    '--config=experiments/gpt_tiny.py',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    f'--config.train.steps={steps}',
    '--config.checkpoint.every_steps=20',
    '--config.train.eval_every=20',
  ]
  env = {**os.environ, 'PYTHONPATH': os.path.join(ROOT, 'src')}
  return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--kill_at', type=int, default=35)
  args = parser.parse_args()
  workdir = os.path.join(tempfile.mkdtemp(prefix='triax-goodput-'), 'run')
  proc = _train(workdir, args.steps)
  while not any(r['step'] >= args.kill_at for r in goodput.read(workdir) if r['kind'] == 'step'):
    if proc.poll() is not None:
      sys.exit(f'error: the run ended (status {proc.returncode}) before step {args.kill_at}')
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  if _train(workdir, args.steps).wait() != 0:
    sys.exit('error: the resumed run failed')
  plot = os.path.join(ROOT, 'docs', 'bench_goodput.png')
  table = subprocess.run(
    [sys.executable, '-m', 'triax', 'goodput', f'--workdir={workdir}', f'--plot={plot}'],
    cwd=ROOT,
    env={**os.environ, 'PYTHONPATH': os.path.join(ROOT, 'src')},
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  doc = f"""# Goodput of a killed and resumed run

Written by `scripts/bench_goodput.py --steps={args.steps} --kill_at={args.kill_at}`:
experiments/gpt_tiny.py on 8 forced CPU devices (data 2 x tensor 2 x pipe 2), a save
every 20 steps, SIGKILLed once step {args.kill_at} was recorded and resumed with the same
command; then `python -m triax goodput --workdir=DIR --plot=docs/bench_goodput.png`. The
seconds are this machine's (2 cores shared with other work), not a prediction.

{table.split(chr(10) + 'plot:')[0].strip()}

![the steps each attempt reached, and the wall time's parts](bench_goodput.png)
"""
  with open(os.path.join(ROOT, 'docs', 'bench_goodput.md'), 'w') as f:
    f.write(doc)
  print(doc)


if __name__ == '__main__':
  main()
