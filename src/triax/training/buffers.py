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
  found = sorted(
    glob.glob(os.path.join(dump_dir, f'*{module}*after_optimizations-buffer-assignment.txt'))
  )
  if not found:
    return []
  path = found[-1]  # the last compiled module of that name
  values = _temp_values(path)
  op_names = _op_names(path.replace('-buffer-assignment.txt', '.txt'))
  values.sort(key=lambda v: -v['bytes'])
  out = []
  for v in values[:count]:
    out.append({**v, 'op_name': op_names.get(v['name'], '')})
  return out


def _temp_values(path: str) -> list[dict]:
  """Values of the default memory space's preallocated temporary allocation."""
  values, in_temp = [], False
  with open(path) as f:
    for line in f:
      line = line.rstrip('\n')
      head = _ALLOCATION.match(line)
      if head:
        # Other memory spaces (VMEM, SMEM, host) say `color N`; the device's HBM has none.
        in_temp = 'preallocated-temp' in head.group(2) and 'color' not in head.group(2)
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
