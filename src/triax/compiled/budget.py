"""Which way of fitting a per-device memory limit is fastest (BPipe's question).

Given an experiment, the candidates are the config as it is (its own
schedule, layout and recompute: the reference) and the standard answers to
"it does not fit", each on the config's own schedule where it can be:
recompute activations (full, dots, or attention: Megatron's selective
recomputation), halve the micro-batch (twice the micro-batches, same
global batch), BPipe without recompute, and with data parallelism ZeRO-1
and FSDP. Every candidate is compiled first (XLA's peak
bytes per device; nothing runs), a line each as it is; then only those that
fit are timed (one over the limit could exhaust this host's memory). When
the config fits as it is, that is the answer: a variant's few per cent on a
shared CPU are noise, not a reason to change a layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import ml_collections

from triax import config as config_lib
from triax.compiled.measure import compile_config, time_steps

REFERENCE = 'as configured'
_REMAT_NAMES = {
  'none': 'no remat',
  'attention': 'attention remat',
  'dots': 'dots remat',
  'full': 'full remat',
}


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
  own, remat, m = cfg.pipeline.schedule, cfg.model.remat, cfg.pipeline.microbatches
  out = [Candidate(f'{own}, {_REMAT_NAMES[remat]} ({REFERENCE})', {})]
  out += [
    Candidate(f'{own}, {_REMAT_NAMES[r]}', {'model.remat': r})
    for r in ('full', 'dots', 'attention')
    if r != remat
  ]
  out.append(Candidate(f'{own}, half micro-batch (m={2 * m})', {'pipeline.microbatches': 2 * m}))
  if (own, remat) != ('bpipe', 'none'):
    bpipe = {'pipeline.schedule': 'bpipe', 'model.remat': 'none', 'pipeline.virtual_stages': 1}
    out.append(Candidate('bpipe, no remat', bpipe))
  # mesh.data may be -1 (the devices the other axes leave): resolved here.
  if config_lib.resolve_mesh_shape(cfg.mesh, jax.device_count())[0] > 1:
    out.append(Candidate(f'{own}, ZeRO-1', {'train.optimizer_sharding': 'data'}))
    out.append(Candidate(f'{own}, FSDP', {'mesh.fsdp': True}))
  return out


def _with(cfg, overrides: dict):
  c = ml_collections.ConfigDict(cfg.to_dict())
  for key, value in overrides.items():
    config_lib.set_dotted(c, key, value)
  return c


def evaluate(
  cfg, limit: int, *, steps: int = 5, say: Callable[[str], None] = lambda _: None
) -> list[Candidate]:
  """Compiles every candidate, then times those that fit `limit` bytes per
  device; a candidate the config cannot run records why. `say` gets a line
  per compile and per timing as it finishes."""
  cands, compiled = candidates(cfg), {}
  for cand in cands:
    try:
      compiled[cand.name] = compile_config(_with(cfg, cand.overrides))
    except ValueError as e:  # ConfigError (e.g. batch not divisible by the doubled m)
      cand.error = str(e)
      say(f'budget: {cand.name}: cannot run: {e}')
      continue
    cand.peak_bytes = compiled[cand.name].peak_bytes
    verdict = 'fits' if cand.fits(limit) else 'over the limit, not run'
    say(f'budget: {cand.name}: {cand.peak_bytes / 2**20:.1f} MiB per device, {verdict}')
  for cand in cands:
    if cand.fits(limit):
      cand.step_time_s = time_steps(compiled.pop(cand.name), steps=steps, warmup=1)
      say(f'budget: {cand.name}: {cand.step_time_s * 1e3:.1f} ms a step')
  return cands


def answer(cands: list[Candidate], limit: int) -> Candidate | None:
  """The config as it is when it fits; else the fastest candidate that fits."""
  fitting = [c for c in cands if c.fits(limit)]
  reference = next((c for c in fitting if REFERENCE in c.name), None)
  return reference or (min(fitting, key=lambda c: c.step_time_s) if fitting else None)


def report(cands: list[Candidate], limit: int) -> str:
  best = answer(cands, limit)
  # Times are compared with the reference, or the first candidate that ran if it did not.
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
    mark = 'the answer' if c is best else ''
    timed = c.step_time_s > 0
    lines.append(
      f'| {c.name} | {c.peak_bytes / 2**20:.1f} | {"yes" if c.fits(limit) else "no"} '
      f'| {f"{c.step_time_s * 1e3:.1f}" if timed else "-"} '
      f'| {f"{c.step_time_s / ref:.2f}" if timed else "-"} | {mark} |'
    )
  lines.append('')
  if base:
    lines.append(
      f'peak MiB/device: XLA temp + argument + output - aliased bytes of the compiled step; '
      f'step: median of the timed steps here (within 10% of each other is noise on a shared '
      f'CPU); relative time: step / that of "{base.name}" (below 1 = faster)'
    )
  if best and REFERENCE in best.name:
    lines.append(f'answer: {best.name}: it fits; nothing to change')
  else:
    lines.append(
      f'answer: {best.name}' if best else 'answer: nothing fits; lower the batch or add devices'
    )
  return '\n'.join(lines)
