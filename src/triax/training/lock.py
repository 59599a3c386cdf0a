"""One run per workdir: DIR/triax.lock names the run that holds it.

Two runs training into one workdir would both write checkpoints and
metrics. The lock file holds the holder's pid, host, start time and
command; while a run holds it, it also keeps an exclusive `flock` on the
file, which the kernel drops when the process dies however it dies.

A lock counts as held when its `flock` is taken, or when it names a live
process on this host (the same pid *and* the same process start time, so a
reused pid is not mistaken for the holder; a file system without `flock`
falls back to this). A lock naming a dead process on this host is stale and
is taken over with one warning. A lock from another host cannot be checked
from here and counts as held: the error says to delete the file if that run
is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys

from absl import logging

from triax.errors import ConfigError
from triax.training import workdir as workdir_lib


def lock_path(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), workdir_lib.LOCK)


def _process_start(pid: int) -> str | None:
  """The kernel's start time of `pid` (clock ticks since boot), or None without /proc."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      # Field 22; the command name (field 2) may hold spaces, so count after its ')'.
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def this_process() -> dict:
  """The record a lock of this process holds."""
  return {
    'pid': os.getpid(),
    'host': socket.gethostname(),
    'started': datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
    'command': shlex.join(sys.argv),
    'process_start': _process_start(os.getpid()),
  }


def pid_exists(pid: int) -> bool:
  """Whether a process `pid` runs on this host (perhaps another user's)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # it exists, run by another user
  return True


def _alive_here(holder: dict) -> bool:
  """Whether the holder, a process of this host, is still running."""
  pid = holder.get('pid')
  if not isinstance(pid, int) or pid <= 0 or not pid_exists(pid):
    return False
  recorded, now = holder.get('process_start'), _process_start(pid)
  return recorded is None or now is None or recorded == now


def _read(fd: int) -> dict | None:
  os.lseek(fd, 0, os.SEEK_SET)
  text = b''
  while chunk := os.read(fd, 65536):
    text += chunk
  try:
    holder = json.loads(text)
  except ValueError:
    return None  # empty (just created) or cut short by a crash while writing
  return holder if isinstance(holder, dict) else None


def _flock(fd: int, mode: int) -> bool | None:
  """True if taken, False if another process holds it, None where flock is unsupported."""
  try:
    fcntl.flock(fd, mode | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    return False
  except OSError as e:
    if e.errno in (errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
      return None
    raise


def _in_use(workdir: str, holder: dict | None) -> ConfigError:
  path = os.path.abspath(workdir)
  if holder is None:
    return ConfigError(
      'workdir', f'{path} is in use by another run; stop it or use another --workdir'
    )
  pid, host, started = holder.get('pid'), holder.get('host'), holder.get('started')
  message = (
    f'{path} is in use by pid {pid} on {host} since {started}; stop it or use another --workdir'
  )
  if host != socket.gethostname():
    message += f' (if that run is gone, delete {lock_path(workdir)})'
  return ConfigError('workdir', message)


def _busy(workdir: str, fd: int, flocked: bool | None) -> tuple[bool, dict | None]:
  """Whether the lock on `fd` is held by another run, and who holds it."""
  holder = _read(fd)
  if flocked is False:
    return True, holder
  if holder is None:
    return False, None
  if holder.get('host') != socket.gethostname():
    return True, holder
  return _alive_here(holder) and holder.get('pid') != os.getpid(), holder


def check_free(workdir: str) -> None:
  """Raises if another run holds the workdir's lock; reads only (for the early input checks).

  Raises:
    ConfigError: the workdir is in use.
  """
  path = lock_path(workdir)
  try:
    fd = os.open(path, os.O_RDONLY)
  except (FileNotFoundError, NotADirectoryError):
    return
  try:
    busy, holder = _busy(workdir, fd, _flock(fd, fcntl.LOCK_SH))
  finally:
    os.close(fd)  # drops the shared flock, if taken
  if busy:
    raise _in_use(workdir, holder)


class WorkdirLock:
  """The lock of one workdir, held from `acquire` to `release` (use as a context manager)."""

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = lock_path(workdir)
    self._fd: int | None = None

  @property
  def held(self) -> bool:
    return self._fd is not None

  def acquire(self) -> None:
    """Creates the workdir if needed and takes its lock (a stale one with a warning).

    Raises:
      ConfigError: another run holds it.
    """
    os.makedirs(self.workdir, exist_ok=True)
    for _ in range(10):
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        flocked = _flock(fd, fcntl.LOCK_EX)
        if flocked and not _same_file(fd, self.path):
          # The holder deleted it (releasing) between our open and our flock: try the new one.
          os.close(fd)
          continue
        busy, holder = _busy(self.workdir, fd, flocked)
        if busy:
          raise _in_use(self.workdir, holder)
        if holder is not None and holder.get('pid') != os.getpid():
          logging.warning(
            'workdir: taking over the lock %s of pid %s on %s (since %s), '
            'which is no longer running',
            self.path,
            holder.get('pid'),
            holder.get('host'),
            holder.get('started'),
          )
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(this_process(), indent=1) + '\n').encode(), 0)
        os.fsync(fd)
      except BaseException:
        os.close(fd)
        raise
      self._fd = fd
      return
    raise _in_use(self.workdir, None)

  def release(self) -> None:
    """Deletes the lock file and drops the flock; safe to call twice (and from a signal handler)."""
    fd, self._fd = self._fd, None
    if fd is None:
      return
    with contextlib.suppress(OSError):
      if _same_file(fd, self.path):
        os.unlink(self.path)
    os.close(fd)

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _same_file(fd: int, path: str) -> bool:
  try:
    a, b = os.fstat(fd), os.stat(path)
  except OSError:
    return False
  return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
