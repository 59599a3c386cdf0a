"""Where a compiled program's temporary bytes go: its largest buffers, read
from XLA's own buffer assignment.

`compile_options(dir)` asks XLA to write the optimised HLO and its buffer
assignment into `dir` while it compiles (XLA:CPU and XLA:TPU alike);
`largest(dir)` then lists the biggest values of the program's temporary
allocation in the device's memory, each with its shape, its HLO name and
the JAX operation it came from (the HLO's `op_name` metadata), which says
what a figure of memory_analysis() is made of; `temp_heap(dir)` is that
allocation's size and `live_peak(dir)` the bytes in use at once at the
program's worst point.
"""

from __future__ import annotations

import glob
import os
import re

_ALLOCATION = re.compile(r'^allocation (\d+): size (\d+)(.*):$')
# A value's name, its tuple index ({} when it is none), size, offset and shape.
_VALUE = re.compile(r'^ value: <\d+ (\S+?)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$')
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*metadata=\{[^}]*op_name="([^"]*)"')
_LAYOUT = re.compile(r'\{[^{}]*\}')
_LIVE = re.compile(r'^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$')


def compile_options(dump_dir: str, module: str = 'train_step') -> dict:
  """XLA debug options (as `.compile(compiler_options=...)` takes them) that
  write the buffer assignment of the jitted function named `module`."""
  return {
    'xla_dump_to': dump_dir,
    'xla_dump_hlo_module_re': f'.*{module}.*',
    'xla_dump_hlo_as_text': True,
  }


def largest(dump_dir: str, count: int = 10, module: str = 'train_step') -> list[dict]:
  """The `count` largest values in the temporary allocation of the device's memory.

  Values that share bytes at different times each appear: the list is the
  biggest arrays the program holds at some point, not a peak's snapshot.
  Returns [] when the dump has no buffer assignment (nothing was compiled).
  """
  path = _assignment(dump_dir, module)
  if path is None:
    return []
  values = _temp_values(path)
  op_names = _op_names(path.replace('-buffer-assignment.txt', '.txt'))
  values.sort(key=lambda v: -v['bytes'])
  out = []
  for v in values[:count]:
    out.append({**v, 'op_name': op_names.get(v['name'], '')})
  return out


def temp_heap(dump_dir: str, module: str = 'train_step') -> int | None:
  """Bytes of the program's temporary allocation in the device's memory:
  the heap XLA allocates for its temporaries, holes included; None when the
  dump has no buffer assignment.

  On XLA:TPU, memory_analysis()'s temp_size_in_bytes is this heap plus the
  heap's fragmentation a second time, as its backend log (TPU_MIN_LOG_LEVEL=0)
  shows (docs/design/hlo_work.md). The heap is what the program holds.
  """
  path = _assignment(dump_dir, module)
  if path is None:
    return None
  with open(path) as f:
    for line in f:
      head = _ALLOCATION.match(line.rstrip('\n'))
      if head and _in_device_temp(head.group(3)):
        return int(head.group(2))
  return None


def live_peak(dump_dir: str, module: str = 'train_step') -> int | None:
  """Bytes in use at once at the program's worst point: arguments, outputs
  and temporaries, without the holes the heap's packing leaves between them
  (`temp_heap` counts those). None when the dump lacks what it needs.

  From the buffer assignment (where each value sits: its allocation, offset
  and size) and XLA's live-range analysis of the schedule (when each value
  is live). Values that share bytes count once: an output in the buffer of
  the argument it was donated, an update made in place. (XLA's own "peak
  usage" line adds values, so it counts those twice.) This is what the
  planner's memory model prices; docs/bench_gpu_compile.md sets it beside
  XLA:GPU's arguments and heap, layout by layout.
  """
  path = _assignment(dump_dir, module)
  ranges = path and path.replace('-buffer-assignment.txt', '-live-range.txt')
  if not ranges or not os.path.exists(ranges):
    return None
  places = _places(path)
  events = []  # (time, +1 starts / -1 ends, (allocation, offset, size))
  with open(ranges) as f:
    for line in f:
      match = _LIVE.match(line)
      place = match and places.get(match.group(1))
      if place:
        # A range ends at its last reader, inclusive: an instruction's
        # operands and its output are in use at once.
        events.append((int(match.group(2)), 1, place))
        events.append((int(match.group(3)) + 1, -1, place))
  if not events:
    return None
  events.sort(key=lambda e: (e[0], e[1]))  # at one time, ends before starts
  live, used, peak = {}, 0, 0
  for _, step, place in events:
    # Bytes in use: each distinct (allocation, offset, size) once.
    before = live.get(place, 0)
    live[place] = before + step
    if before == 0 and step > 0:
      used += place[2]
    elif before == 1 and step < 0:
      used -= place[2]
    peak = max(peak, used)
  return peak


def _places(path: str) -> dict[str, tuple[int, int, int]]:
  """Value (`name{index}`, as the live-range dump names it) -> (allocation,
  offset, size), for the values in the device's memory (see _in_device_temp)."""
  out, allocation = {}, None
  with open(path) as f:
    for line in f:
      head = _ALLOCATION.match(line.rstrip('\n'))
      if head:
        allocation = None if 'color' in head.group(3) else int(head.group(1))
        continue
      value = _VALUE.match(line.rstrip('\n'))
      if value and allocation is not None:
        name = value.group(1) + (value.group(2) or '{}')
        out[name] = (allocation, int(value.group(4)), int(value.group(3)))
  return out


def _assignment(dump_dir: str, module: str) -> str | None:
  """The buffer assignment of the last compiled module named `module`."""
  found = sorted(
    glob.glob(os.path.join(dump_dir, f'*{module}*after_optimizations-buffer-assignment.txt'))
  )
  return found[-1] if found else None


def _in_device_temp(allocation_tail: str) -> bool:
  # Other memory spaces (VMEM, SMEM, host) say `color N`; the device's memory has none.
  return 'preallocated-temp' in allocation_tail and 'color' not in allocation_tail


def _temp_values(path: str) -> list[dict]:
  """Values of the default memory space's preallocated temporary allocation."""
  values, in_temp = [], False
  with open(path) as f:
    for line in f:
      line = line.rstrip('\n')
      head = _ALLOCATION.match(line)
      if head:
        in_temp = _in_device_temp(head.group(3))
        continue
      value = _VALUE.match(line) if in_temp else None
      if value and not value.group(5).startswith('('):  # a tuple is a table of pointers
        values.append(
          {
            'name': value.group(1),
            'bytes': int(value.group(3)),
            'shape': _LAYOUT.sub('', value.group(5)).strip(),
          }
        )
  return values


def _op_names(hlo_path: str) -> dict[str, str]:
  """HLO instruction name -> the JAX operation it came from."""
  names = {}
  if not os.path.exists(hlo_path):
    return names
  with open(hlo_path) as f:
    for line in f:
      match = _OP_NAME.match(line)
      if match:
        names.setdefault(match.group(1), match.group(2))
  return names
