"""Which way of fitting a per-device memory limit is fastest (BPipe's question).

Given an experiment, the candidates are the standard answers to "1F1B does
not fit": recompute activations (full or selective), halve the micro-batch
(twice the micro-batches, same global batch), or BPipe without recompute.
Each is compiled (XLA's peak bytes per device) and timed on this machine.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from triax import config as config_lib
from triax.training.measure import measure


@dataclasses.dataclass
class Candidate:
  name: str
  overrides: dict
  peak_bytes: int = 0
  step_time_s: float = 0.0
  error: str = ''

  def fits(self, limit: int) -> bool:
    return not self.error and self.peak_bytes <= limit


def candidates(cfg) -> list[Candidate]:
  m = cfg.pipeline.microbatches
  return [
    Candidate('1f1b, no remat (reference)', {'pipeline.schedule': '1f1b', 'model.remat': 'none'}),
    Candidate('1f1b, full remat', {'pipeline.schedule': '1f1b', 'model.remat': 'full'}),
    Candidate('1f1b, selective remat', {'pipeline.schedule': '1f1b', 'model.remat': 'selective'}),
    Candidate(
      f'1f1b, half micro-batch (m={2 * m})',
      {'pipeline.schedule': '1f1b', 'model.remat': 'none', 'pipeline.microbatches': 2 * m},
    ),
    Candidate('bpipe, no remat', {'pipeline.schedule': 'bpipe', 'model.remat': 'none'}),
  ] + (
    [
      Candidate(
        '1f1b, ZeRO-1',
        {'pipeline.schedule': '1f1b', 'model.remat': 'none', 'train.optimizer_sharding': 'data'},
      ),
      Candidate(
        '1f1b, FSDP', {'pipeline.schedule': '1f1b', 'model.remat': 'none', 'mesh.fsdp': True}
      ),
    ]
    if cfg.mesh.data > 1
    else []
  )


def _with(cfg, overrides: dict):
  c = ml_collections.ConfigDict(cfg.to_dict())
  c.pipeline.virtual_stages = 1
  for key, value in overrides.items():
    config_lib.set_dotted(c, key, value)
  return c


def evaluate(cfg, *, steps: int = 3) -> list[Candidate]:
  """Compiles and times every candidate; a candidate the config cannot run records why."""
  out = []
  for cand in candidates(cfg):
    try:
      result = measure(_with(cfg, cand.overrides), steps=steps, warmup=1)
    except ValueError as e:  # ConfigError (e.g. batch not divisible by the doubled m)
      cand.error = str(e)
    else:
      cand.peak_bytes, cand.step_time_s = result.peak_bytes, result.step_time_s
    out.append(cand)
  return out


def report(cands: list[Candidate], limit: int) -> str:
  fitting = [c for c in cands if c.fits(limit)]
  best = min(fitting, key=lambda c: c.step_time_s) if fitting else None
  # Times are compared with the reference, or the first candidate that ran if it could not.
  base = next((c for c in cands if c.step_time_s), None)
  ref = base.step_time_s if base else 1.0
  lines = [
    f'per-device memory limit: {limit / 2**20:.1f} MiB',
    '',
    '| candidate | peak MiB/device | fits | step (ms) | relative time | note |',
    '|---|---:|---|---:|---:|---|',
  ]
  for c in cands:
    if c.error:
      lines.append(f'| {c.name} | - | no | - | - | cannot run: {c.error} |')
      continue
    mark = 'fastest that fits' if c is best else ''
    lines.append(
      f'| {c.name} | {c.peak_bytes / 2**20:.1f} | {"yes" if c.fits(limit) else "no"} '
      f'| {c.step_time_s * 1e3:.1f} | {c.step_time_s / ref:.2f} | {mark} |'
    )
  lines.append('')
  if base:
    lines.append(
      f'peak MiB/device: XLA temp + argument + output - aliased bytes of the compiled step; '
      f'step: median of the timed steps here; relative time: step / that of "{base.name}" '
      '(below 1 = faster)'
    )
  lines.append(
    f'answer: {best.name}' if best else 'answer: nothing fits; lower the batch or add devices'
  )
  return '\n'.join(lines)
