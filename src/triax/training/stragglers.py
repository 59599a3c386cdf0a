"""Stragglers: which process of a multi-process run makes the others wait.

Collectives make every process's step last as long as the slowest one's, so the step time
alone names nobody. What differs is where the time goes on each host: the others wait
for the straggler (host-side: queueing a step and its logged learning rate, which block
while the device is busy, as XLA:CPU's does; fetching a step's outputs, which waits for the device and its
collectives; the coordinator's per-step decision), while it works. Each process
measures its step time and its waits; its own step time is its step less its waits, plus
the median process's waits (what its step would take if it waited as the others do).

Each process posts its latest (step, step time, waits) to the coordinator's key-value
store every step (one small write, no device work); process 0 reads them all. A process
whose own step time over its last `train.straggler_steps` steps is above
`train.straggler_ratio` times the median process's is named in one line on stderr (again
only after it has caught up). A window, not each step: a step ahead in flight and saves
(a barrier) move time between neighbouring steps. Seen from the host: a device that is slow while its host waits
for it shows as waiting, like everyone else's.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

_KEYS = 'triax/stragglers/'


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
  yield


class Stragglers:
  """One process's step and wait times; on process 0, the comparison of all of them.

  Args:
    ratio, steps: train.straggler_ratio, train.straggler_steps.
    process, processes: this process's index and the process count.
    client: the coordinator's client (preemption.coordinator_client); None with one process.
    say: how process 0 writes its line.
  """

  def __init__(self, ratio, steps, process, processes, client, say: Callable[[str], None]):
    self.ratio, self.steps, self.say = ratio, steps, say
    self.process, self.processes, self.client = process, processes, client
    self._started = time.perf_counter()
    self._waited = 0.0
    self._seen: dict[int, int] = {}  # process -> the step of its newest sample
    self._windows: dict[int, collections.deque] = {}  # process -> its last samples
    self._named: set[int] = set()  # named and not caught up since
    self.latest: dict[int, tuple[float, float]] = {}  # process -> (step s, waits s)

  def start(self) -> None:
    """The first step starts now (compiling and a first evaluation are no step's)."""
    self._started, self._waited = time.perf_counter(), 0.0

  def waiting(self):
    """A block whose time this process spends waiting for the others (or the device)."""
    return self._waiting() if self.processes > 1 else _nothing()

  @contextlib.contextmanager
  def _waiting(self) -> Iterator[None]:
    began = time.perf_counter()
    try:
      yield
    finally:
      self._waited += time.perf_counter() - began

  def step_done(self, step: int) -> None:
    """Ends this process's step `step`: posts its times; process 0 judges everyone's."""
    if self.processes == 1:
      return
    now = time.perf_counter()
    took, waited = now - self._started, self._waited
    self._started, self._waited = now, 0.0
    self.client.key_value_set(
      f'{_KEYS}{self.process}', f'{step},{took!r},{waited!r}', allow_overwrite=True
    )
    if self.process == 0:
      self.judge(self._samples())

  def _samples(self) -> dict[int, tuple[int, float, float]]:
    samples = {}
    for key, value in self.client.key_value_dir_get(_KEYS):
      step, took, waited = value.split(',')
      samples[int(key.rsplit('/', 1)[1])] = (int(step), float(took), float(waited))
    return samples

  def judge(self, samples: dict[int, tuple[int, float, float]]) -> list[int]:
    """Adds each process's new sample to its window of the last `steps`; once every window
    is full, names (and returns) the processes whose own step time over their window is
    above `ratio` times the median's, once until they catch up. `samples`: process ->
    (step, step s, waits s)."""
    self.latest = {p: (took, waited) for p, (_, took, waited) in samples.items()}
    for p, (step, took, waited) in samples.items():
      if self._seen.get(p) != step:  # else that process has not finished another step
        self._seen[p] = step
        window = self._windows.setdefault(p, collections.deque(maxlen=self.steps))
        window.append((took, waited))
    if len(self._windows) < self.processes or any(
      len(w) < self.steps for w in self._windows.values()
    ):
      return []
    took = {p: sum(t for t, _ in w) for p, w in self._windows.items()}
    waited = {p: sum(x for _, x in w) for p, w in self._windows.items()}
    median_wait = statistics.median(waited.values())
    own = {p: took[p] - waited[p] + median_wait for p in took}
    median = statistics.median(own.values())
    named = []
    for p in sorted(own):
      if own[p] <= self.ratio * median:
        self._named.discard(p)
      elif p not in self._named:
        self._named.add(p)
        named.append(p)
        self.say(
          f'straggler: process {p}: its own step time {own[p] / self.steps:.3f} s is '
          f"{own[p] / median:.2f}x the median process's {median / self.steps:.3f} s over "
          f'its last {self.steps} steps (to step {self._seen[p]}; '
          f'train.straggler_ratio={self.ratio}); the others wait for it'
        )
    return named

  def metrics(self) -> dict[str, list[float]]:
    """Each process's latest step time and waits (process 0, multi-process runs)."""
    if not self.latest:
      return {}
    order = sorted(self.latest)
    return {
      'process_step_s': [self.latest[p][0] for p in order],
      'process_wait_s': [self.latest[p][1] for p in order],
    }
