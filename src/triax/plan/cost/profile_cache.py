"""Measured profiles kept in a JSON file, so the next cluster for a model takes seconds.

`python -m triax plan --profile_cache=FILE` reads a profile from FILE when
one was measured for the same key, and adds each new one. The key is what a
measurement depends on: the model's shape (its family spec but remat, which
is measured per policy), this machine's backend, device kind and count, the
jax version, the tensor degrees and micro-batch sizes measured, and the
profiler's FORMAT.
"""

from __future__ import annotations

import dataclasses
import json
import os

from triax.errors import ConfigError
from triax.plan.cluster import Link
from triax.plan.cost import profile as profile_lib

# What the profiler measures, by version: a profile measured before a change
# to it is not read back as if it were measured now (2: the executor's B and
# W timed as it splits them, and the chunk-length ratios; 3: those per remat
# policy; 4: each shard's K/V bytes, which context parallelism moves; 5: a MoE
# shard's routed experts; 6: the policies attention and dots, selective's
# new name).
FORMAT = 6


def key(model_cfg, tensors, sizes) -> str:
  """The cache key of a measurement, as a string (stable JSON)."""
  import jax

  from triax.model import registry

  spec = dataclasses.replace(registry.spec_from_config(model_cfg), remat='none')
  device = jax.devices()[0]
  return json.dumps(
    {
      'format': FORMAT,
      'model': dataclasses.asdict(spec),
      'backend': jax.default_backend(),
      'device_kind': device.device_kind,
      'devices': len(jax.local_devices()),
      'jax': jax.__version__,
      'tensors': sorted(set(tensors)),
      'sizes': sorted(set(sizes)),
    },
    sort_keys=True,
  )


def _entries(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(
      '--profile_cache', f'{path}: not a profile cache ({e}); remove it or name another file'
    ) from None
  if not isinstance(data, dict) or not isinstance(data.get('profiles'), dict):
    raise ConfigError('--profile_cache', f'{path}: not a profile cache; name another file')
  return data['profiles']


def read(path: str, cache_key: str) -> profile_lib.Profile | None:
  """The profile cached under `cache_key`, or None."""
  raw = _entries(path).get(cache_key)
  return None if raw is None else from_dict(raw)


def write(path: str, cache_key: str, prof: profile_lib.Profile) -> None:
  """Adds (or replaces) one profile; other entries stay."""
  entries = _entries(path)
  entries[cache_key] = to_dict(prof)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump({'profiles': entries}, f)
  os.replace(tmp, path)  # a reader never sees half a file


def to_dict(prof: profile_lib.Profile) -> dict:
  out = dataclasses.asdict(dataclasses.replace(prof, analytic=None))
  out['shards'] = {str(t): v for t, v in out['shards'].items()}
  return out


def from_dict(raw: dict) -> profile_lib.Profile:
  m = dict(raw['machine'])
  m['p2p'], m['allreduce'] = Link(**m['p2p']), Link(**m['allreduce'])
  shards = {}
  for t, sh in raw['shards'].items():
    work = {f: profile_lib.Work(**w) for f, w in sh['work'].items()}
    experts = sh.get('experts') and profile_lib.Experts(**sh['experts'])
    blocks = tuple(sh.get('edge_blocks', (0, 0)))
    window = sh.get('window') and profile_lib.Window(**sh['window'])
    shards[int(t)] = profile_lib.Shard(
      **{**sh, 'work': work, 'experts': experts, 'edge_blocks': blocks, 'window': window}
    )
  return profile_lib.Profile(
    seq_len=raw['seq_len'],
    d_model=raw['d_model'],
    num_layers=raw['num_layers'],
    dtype=raw['dtype'],
    shards=shards,
    fits={f: profile_lib.Fit(**x) for f, x in raw['fits'].items()},
    machine=profile_lib.Machine(**m),
    points=tuple(profile_lib.Point(**p) for p in raw['points']),
    wall_s=0.0,
    ratios={k: tuple(v) for k, v in raw['ratios'].items()},
    layers_per_entry=raw.get('layers_per_entry', 1),
  )
