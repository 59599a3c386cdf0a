"""Where a compiled program's temporary bytes go: its largest buffers, read
from XLA's own buffer assignment.

`compile_options(dir)` asks XLA to write the optimised HLO and its buffer
assignment into `dir` while it compiles (XLA:CPU and XLA:TPU alike);
`largest(dir)` then lists the biggest values of the program's temporary
allocation in the device's memory, each with its shape, its HLO name and
the JAX operation it came from (the HLO's `op_name` metadata), which says
what a figure of memory_analysis() is made of.
"""

from __future__ import annotations

import glob
import os
import re

_ALLOCATION = re.compile(r'^allocation \d+: size (\d+)(.*):$')
_VALUE = re.compile(r'^ value: <\d+ (\S+?)(?:\{[\d,]*\})? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$')
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*metadata=\{[^}]*op_name="([^"]*)"')
_LAYOUT = re.compile(r'\{[^{}]*\}')


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
  heap's fragmentation a second time: its backend log (TPU_MIN_LOG_LEVEL=0)
  at PP 4 1F1B says "Program hbm requirement 3.68G: ... HLO temp 3.65G (...
  16.5% fragmentation (615.84M))" and "Total hbm usage >= 9.59G: reserved
  263.00M, program 3.68G, arguments 5.65G", where temp_size_in_bytes is
  3.65G + 615.84M (4565410016 bytes); at TP 4, 2.98G + 1.91G. The heap is
  what the program holds.
  """
  path = _assignment(dump_dir, module)
  if path is None:
    return None
  with open(path) as f:
    for line in f:
      head = _ALLOCATION.match(line.rstrip('\n'))
      if head and _in_device_temp(head.group(2)):
        return int(head.group(1))
  return None


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
        in_temp = _in_device_temp(head.group(2))
        continue
      value = _VALUE.match(line) if in_temp else None
      if value and not value.group(4).startswith('('):  # a tuple is a table of pointers
        values.append(
          {
            'name': value.group(1),
            'bytes': int(value.group(2)),
            'shape': _LAYOUT.sub('', value.group(4)).strip(),
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
