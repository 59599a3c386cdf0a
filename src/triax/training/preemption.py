"""Stopping a run cleanly on SIGTERM or SIGINT, the same way on every process.

Cluster schedulers (SLURM, Kubernetes, TPU maintenance) announce a
preemption with SIGTERM and kill the job some time later; Ctrl-C sends
SIGINT. The first of either asks the loop to stop after the step in flight:
it saves that step, waits until the checkpoint is complete and exits 0. A
second signal exits at once (status 128 + the signal, 130 for Ctrl-C),
without waiting for a save: the last complete checkpoint is still there.

In a multi-process run every process must stop after the same step, or the
ones still stepping wait forever in the next collective; time-based saves
(checkpoint.every_seconds) must agree too. Process 0 decides both, each
step, and every process reads its decision from the coordinator's key-value
store (as orbax's time-based save policy does): host to host, no device
work, so the host still need not wait for the device. A process that
receives a signal files a request there, which process 0 sees at its next
decision. jax's own preemption service (`reached_preemption_sync_point`) is
not used: it watches SIGTERM only, and orbax's saves call it with their own
step numbers from a background thread, which can move its counter past the
agreed step.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import jax

_KEYS = 'triax/stop'
# A decision waits for process 0 to reach the same step: an hour covers any
# step, evaluation or save; a process that died makes the coordinator fail first.
_DECISION_TIMEOUT_MS = 60 * 60 * 1000


class Stopped(SystemExit):
  """The run stopped early on a signal after saving; exits 0 if not caught."""

  def __init__(self, message: str, step: int):
    super().__init__(0)
    self.message = message
    self.step = step


def say(line: str, bar=None) -> None:
  """Writes a line to stderr from a signal handler, on a line of its own.

  One unbuffered write: print() could find stderr's buffer in use by the
  code the signal interrupted (a progress bar, say) and raise, and
  tqdm.write takes the bar's locks. An open progress bar (`bar`, a tqdm on
  stderr) leaves its line without a newline: the write ends that line
  first, and the bar draws itself again below.
  """
  start = '\n' if bar is not None and not bar.disable else ''  # a closed bar is disabled
  os.write(2, (start + line + '\n').encode())  # fd 2: sys.stderr may be a stand-in without one


def coordinator_client():
  """The jax.distributed client: its key-value store is how processes agree host to host."""
  from jax._src import distributed  # orbax reaches the coordinator the same way

  return distributed.global_state.client


class StopSignals:
  """SIGTERM/SIGINT handling for the duration of a `with` block, and per-step decisions.

  Args:
    on_second: called (in the signal handler) with the signal number when a
      second signal arrives; expected to exit the process.
  """

  def __init__(self, on_second: Callable[[int], None]):
    self._on_second = on_second
    self._previous: dict[int, object] = {}
    self._count = 0
    self._reported = False
    self.received: str | None = None  # the first signal this process received
    self.stopped_by: str | None = None  # the signal process 0 stopped the run for
    self.bar = None  # the run's progress bar while one is drawn: notices end its line first
    self._processes = jax.process_count()

  @property
  def name(self) -> str:
    """The signal that stopped the run (another process's, if it was not this one's)."""
    return self.stopped_by or self.received or 'a signal'

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      # (Python runs signal handlers in the main thread only; elsewhere they stay as they are.)
      # In a multi-process run this replaces the SIGTERM handler of jax's
      # preemption service, which nothing here reads.
      for signum in (signal.SIGINT, signal.SIGTERM):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous.clear()

  def _handle(self, signum, frame) -> None:
    del frame
    self._count += 1
    if self._count > 1:
      self._on_second(signum)
      return
    self.received = signal.Signals(signum).name
    say(
      f'{self.received}: stopping after the step in flight, once its checkpoint is complete '
      '(send it again to stop at once)',
      self.bar,
    )

  def decide(self, step: int, save_due: bool) -> tuple[bool, bool]:
    """Whether to stop, and whether to save, after `step`: process 0's answer on every process.

    Every process must call it once per step, in step order. `save_due` is
    this process's view (its clock); only process 0's counts.
    """
    if self._processes == 1:
      return self.received is not None, save_due
    client, me = coordinator_client(), jax.process_index()
    if self.received and not self._reported:
      client.key_value_set(f'{_KEYS}/request/{me}', self.received, allow_overwrite=True)
      self._reported = True
    key = f'{_KEYS}/step/{step}'
    if me == 0:
      requests = client.key_value_dir_get(f'{_KEYS}/request/')
      stop_by = self.received or (requests[0][1] if requests else '')
      client.key_value_set(key, f'{stop_by},{int(save_due)}')
      # Every process has read it: each step's collectives keep them within a step of process 0.
      client.key_value_delete(f'{_KEYS}/step/{step - 16}')
    stop_by, save = client.blocking_key_value_get(key, _DECISION_TIMEOUT_MS).split(',')
    if stop_by:
      self.stopped_by = stop_by
    return bool(stop_by), save == '1'
