"""Files a run writes whole: written beside their path, then renamed over it,
so a reader (or a run resumed after a crash) never sees half of one."""

from __future__ import annotations

import json
import os


def write_text(path: str, text: str) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)


def write_json(path: str, obj) -> None:
  write_text(path, json.dumps(obj, indent=2))
