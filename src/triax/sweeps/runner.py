"""Loads a config file's sweep, names its points and runs each as a `triax train` process.

Every point runs in its own process (its own device count, its own compile
cache, and a crash takes down only that point) in WORKDIR/<point name>/,
with the same config file and argument as the sweep plus the point's
overrides as `--config.KEY=VALUE` flags. A point whose metrics already reach
its final step is skipped, so an interrupted or partly failed sweep is
finished by running the same command again. The directory name is the
only identity a point has across runs: change the base config and you want
a new --workdir.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import ml_collections
from tqdm import tqdm

import triax
from triax import config as config_lib
from triax import layout as layout_lib
from triax.errors import ConfigError
from triax.sweeps import plots, results

Scalar = bool | int | float | str

# Longest directory name we generate (file systems allow 255 bytes).
_MAX_NAME = 120


@dataclasses.dataclass(frozen=True)
class Point:
  """One run of a sweep."""

  overrides: tuple[tuple[str, Scalar], ...]  # (dotted key, value), as added
  name: str  # directory name under the sweep's workdir
  steps: int  # train.steps of this point: its final step

  def flags(self) -> list[str]:
    return layout_lib.flags(dict(self.overrides))


@dataclasses.dataclass(frozen=True)
class Sweep:
  """A config file's sweep: where it came from and its points."""

  path: str  # absolute path of the config file
  arg: str | None  # the config argument after ':', if any
  points: tuple[Point, ...]

  @property
  def name(self) -> str:
    """The file's stem: names the README block the results go into."""
    return os.path.splitext(os.path.basename(self.path))[0]

  @property
  def config_flag(self) -> str:
    return f'--config={self.path}' + (f':{self.arg}' if self.arg is not None else '')


def point_name(overrides: tuple[tuple[str, Scalar], ...]) -> str:
  """A stable, filesystem-safe directory name such as `data=2,tensor=4,pipe=1`.

  Keys are shortened to their last component unless two of the point's keys
  share it; characters outside [A-Za-z0-9._+-] become '-'. A name longer
  than _MAX_NAME is cut and given a hash of the full one, so it stays unique.
  """
  if not overrides:
    return 'base'
  leaves = [key.rsplit('.', 1)[-1] for key, _ in overrides]
  parts = []
  for (key, value), leaf in zip(overrides, leaves):
    label = leaf if leaves.count(leaf) == 1 else key
    parts.append(f'{label}={layout_lib.flag_value(value)}')
  name = re.sub(r'[^A-Za-z0-9._+=,-]', '-', ','.join(parts))
  if len(name) > _MAX_NAME:
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    name = f'{name[: _MAX_NAME - 11]}-{digest}'
  return name


def _split_spec(spec: str) -> tuple[str, str | None]:
  path, sep, arg = spec.partition(':')
  return path, (arg if sep else None)


def _load_module(path: str):
  return config_lib.load_module(path)


def _call(fn, arg, what: str, path: str):
  try:
    return fn(arg) if arg is not None else fn()
  except ConfigError:
    raise
  except Exception as e:
    raise ConfigError('--config', f'{what} of {path} raised {type(e).__name__}: {e}') from None


def _apply(base: ml_collections.ConfigDict, key: str, value, where: str) -> None:
  """Sets a dotted key on `base` (an unlocked copy), refusing keys it lacks."""
  try:
    config_lib.set_dotted(base, key, value)
  except ConfigError as e:
    raise ConfigError(e.key, f'{e.message} ({where})') from None


def load_sweep(spec: str) -> Sweep:
  """Loads `FILE.py[:ARG]`, calls its sweep(add[, arg]) and checks every point.

  Each point's overrides are applied to a copy of get_config(ARG) here, so a
  misspelt key or a value of the wrong type fails the whole sweep at once;
  combinations the trainer rejects (a mesh that does not fit, say) are left
  to the point's own run, which records the failure.

  Raises:
    ConfigError: naming the file, key or point at fault.
  """
  path, arg = _split_spec(spec)
  path = os.path.abspath(path)
  module = _load_module(path)
  for fn in ('get_config', 'sweep'):
    if not callable(getattr(module, fn, None)):
      usage = 'get_config(arg=None)' if fn == 'get_config' else 'sweep(add, arg=None)'
      raise ConfigError(
        '--config', f'{path} defines no {usage}; a sweep file needs both (see triax.sweeps)'
      )
  base = _call(module.get_config, arg, 'get_config()', path)
  if not isinstance(base, ml_collections.ConfigDict):
    raise ConfigError(
      '--config',
      f'get_config() of {path} returned {type(base).__name__}, not an ml_collections.ConfigDict',
    )
  added: list[tuple[tuple[str, Scalar], ...]] = []

  def add(*args, **overrides):
    where = f'point {len(added) + 1} of sweep() in {os.path.basename(path)}'
    if args:
      raise ConfigError(
        '--config',
        f'{where}: add() takes keyword overrides only, e.g. '
        "add(**{'mesh.data': 2, 'mesh.tensor': 4})",
      )
    for key, value in overrides.items():
      if '.' not in key:
        raise ConfigError(
          key,
          f'{where}: override keys are dotted config paths; write '
          f"add(**{{'train.{key}': ...}}) (or the right group)",
        )
      if not isinstance(value, (bool, int, float, str)):
        raise ConfigError(
          key,
          f'{where}: only bool, int, float or str values can be swept, got {type(value).__name__}',
        )
    added.append(tuple(overrides.items()))

  _call(lambda *a: module.sweep(add, *a), arg, 'sweep()', path)
  if not added:
    raise ConfigError('--config', f'sweep() of {path} added no points')

  points, names = [], {}
  for index, overrides in enumerate(added):
    where = f'point {index + 1} of sweep() in {os.path.basename(path)}'
    cfg = ml_collections.ConfigDict(base.to_dict())
    for key, value in overrides:
      _apply(cfg, key, value, where)
    name = point_name(overrides)
    if name in names:
      raise ConfigError(
        '--config',
        f'points {names[name] + 1} and {index + 1} of sweep() in '
        f'{os.path.basename(path)} are both {name!r}; add each point once',
      )
    names[name] = index
    points.append(Point(overrides=overrides, name=name, steps=int(cfg.train.steps)))
  return Sweep(path=path, arg=arg, points=tuple(points))


def is_complete(point: Point, directory: str) -> bool:
  """Whether the point's metrics reach its final step (train line and eval line)."""
  return results.is_complete(results.summarize_run(directory), point.steps)


def _child_env() -> dict:
  # The child must import this very triax, however the parent found it.
  env = dict(os.environ)
  src = os.path.dirname(os.path.dirname(os.path.abspath(triax.__file__)))
  env['PYTHONPATH'] = src + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
  return env


def train_command(sweep: Sweep, point: Point, directory: str, cpu_devices: int) -> list[str]:
  command = [
    sys.executable,
    '-m',
    'triax.cli.train',
    sweep.config_flag,
    f'--workdir={directory}',
    '--progress=false',
  ]
  if cpu_devices:
    command.append(f'--cpu_devices={cpu_devices}')
  return command + point.flags()


def _last_line(path: str) -> str | None:
  with open(path, errors='replace') as f:
    lines = [line.strip() for line in f if line.strip()]
  return lines[-1] if lines else None


class _Processes:
  """The training processes running now, so an interrupt can end exactly those."""

  def __init__(self):
    self._lock = threading.Lock()
    self._live: set[subprocess.Popen] = set()
    self.stopping = False

  def run(self, command: list[str], stdout, stderr) -> int:
    with self._lock:
      if self.stopping:
        return -1
      proc = subprocess.Popen(
        command, stdout=stdout, stderr=stderr, env=_child_env(), stdin=subprocess.DEVNULL
      )
      self._live.add(proc)
    try:
      return proc.wait()
    finally:
      with self._lock:
        self._live.discard(proc)

  def terminate_all(self) -> None:
    with self._lock:
      self.stopping = True
      for proc in self._live:
        proc.terminate()


def _run_point(
  sweep: Sweep, point: Point, workdir: str, cpu_devices: int, processes: _Processes
) -> dict:
  directory = os.path.join(workdir, point.name)
  os.makedirs(directory, exist_ok=True)
  command = train_command(sweep, point, directory, cpu_devices)
  started = time.perf_counter()
  out_path, err_path = (os.path.join(directory, f) for f in ('stdout.txt', 'stderr.txt'))
  with open(out_path, 'w') as out, open(err_path, 'w') as err:
    returncode = processes.run(command, out, err)
  status = {
    'point': point.name,
    'overrides': dict(point.overrides),
    'command': command,
    'returncode': returncode,
    'error': _last_line(err_path) if returncode else None,
    'seconds': round(time.perf_counter() - started, 1),
  }
  with open(os.path.join(directory, results.STATUS_FILE), 'w') as f:
    json.dump(status, f, indent=2)
  return status


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
  """Inside: SIGTERM (a job scheduler, `kill`) raises SystemExit as Ctrl-C raises
  KeyboardInterrupt, so the sweep stops its training processes instead of orphaning them."""
  if threading.current_thread() is not threading.main_thread():
    yield  # only the main thread may set signal handlers
    return
  previous = signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def _say(bar: tqdm, line: str) -> None:
  bar.write(line)
  sys.stdout.flush()  # a sweep's log is often a file: show each point as it ends


def check_workdir(workdir: str) -> None:
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError('--workdir', f'{workdir} is a file; give a directory')


def run_sweep(
  spec: str,
  workdir: str,
  *,
  parallel: int = 1,
  cpu_devices: int = 8,
  readme: str = '',
  progress: bool = True,
  dry_run: bool = False,
  command: str = '',
) -> dict:
  """Runs every point of the sweep in `spec` not yet complete; writes tables and plots.

  Args:
    spec: `FILE.py[:ARG]`, a config file defining get_config and sweep.
    workdir: the sweep's directory; point P runs in workdir/P.
    parallel: training processes at a time.
    cpu_devices: --cpu_devices for each run; 0 leaves the device choice to JAX.
    readme: a Markdown file whose `<!-- results:NAME:begin/end -->` block
      (NAME = the config file's stem) gets the results table; '' for none.
    progress: show a progress bar over the points.
    dry_run: print the points and their commands, run nothing.
    command: the command line, quoted under the results table.

  Returns:
    {'points', 'ran', 'skipped', 'failed': [names], 'results_md', ...}

  Raises:
    ConfigError: bad input, before any run starts or any file is written.
  """
  if not isinstance(parallel, int) or parallel < 1:
    raise ConfigError('--parallel', f'must be >= 1, got {parallel}')
  if cpu_devices < 0:
    raise ConfigError('--cpu_devices', f'must be >= 0 (0 = let JAX choose), got {cpu_devices}')
  check_workdir(workdir)
  sweep = load_sweep(spec)
  if readme:
    results.check_readme_block(readme, sweep.name)
  workdir = os.path.abspath(workdir)
  if dry_run:
    for point in sweep.points:
      command = train_command(sweep, point, os.path.join(workdir, point.name), cpu_devices)
      print(f'{point.name}: {" ".join(shlex.quote(c) for c in command)}')
    return {'points': len(sweep.points), 'ran': 0, 'skipped': 0, 'failed': [], 'dry_run': True}

  os.makedirs(workdir, exist_ok=True)
  todo = [p for p in sweep.points if not is_complete(p, os.path.join(workdir, p.name))]
  skipped = len(sweep.points) - len(todo)
  failures = 0
  bar = tqdm(
    total=len(sweep.points),
    initial=skipped,
    disable=not progress,
    unit='point',
    desc=f'sweep {sweep.name}',
    dynamic_ncols=True,
  )
  if skipped:
    _say(bar, f'skipping {skipped} complete point(s) in {workdir}')
  processes = _Processes()
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallel)
  try:
    with _sigterm_exits():
      futures = {
        pool.submit(_run_point, sweep, p, workdir, cpu_devices, processes): p for p in todo
      }
      for future in concurrent.futures.as_completed(futures):
        point, status = futures[future], future.result()
        if status['returncode'] == 0:
          _say(bar, f'ok      {point.name} ({status["seconds"]:.0f} s)')
        else:
          failures += 1
          _say(bar, f'FAILED  {point.name} (exit {status["returncode"]}): {status["error"]}')
        bar.update(1)
        bar.set_postfix(failed=failures)
  except BaseException:  # Ctrl-C, or SIGTERM (see _sigterm_exits)
    processes.terminate_all()  # only the training processes this sweep started
    pool.shutdown(wait=True, cancel_futures=True)
    raise
  finally:
    bar.close()
  pool.shutdown()

  rows = [
    results.read_point(os.path.join(workdir, p.name), p.name, dict(p.overrides), p.steps)
    for p in sweep.points
  ]
  caption = results.caption(command, cpu_devices)
  paths = results.write_tables(rows, workdir, caption)
  paths.update(plots.write_plots(rows, workdir, title=sweep.name))
  if readme:
    results.replace_readme_block(readme, sweep.name, results.markdown(rows, caption))
    paths['readme'] = os.path.abspath(readme)
  return {
    'points': len(sweep.points),
    'ran': len(todo),
    'skipped': skipped,
    'failed': [r.name for r in rows if r.status != 'ok'],
    **paths,
  }
