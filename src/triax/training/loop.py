"""The training loop: config -> data -> mesh -> compiled step -> steps, evals, checkpoints.

A run is resumable at any moment: batches are a pure function of the step,
checkpoints are written asynchronously and count only once complete
(training/checkpoint.py), and metrics and sample logs are cut back to the
restored step, so a killed run, started again with the same command, goes on
to the same losses as one never interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from triax import config as config_lib
from triax.data.batches import BatchStream
from triax.data.corpus import load_corpus, unigram_entropy_nats
from triax.errors import ConfigError
from triax.mesh import build_mesh
from triax.model.flops import megatron_flops_per_step, peak_flops
from triax.pipeline import schedule as sched
from triax.training.checkpoint import Checkpointer
from triax.training.metrics import JsonLines, MetricsWriter
from triax.training.step import Trainer, build_trainer


class NonFiniteError(RuntimeError):
  """The loss or gradient became NaN/Inf; the state of that step is not saved."""

  def __init__(self, step: int, loss: float, grad_norm: float):
    self.step = step
    super().__init__(
      f'step {step}: loss={loss} grad_norm={grad_norm} is not finite; stopped '
      'without saving this step (lower train.learning_rate, or let '
      'train.skip_nonfinite_steps=N skip such steps)'
    )


@dataclasses.dataclass
class Data:
  train: BatchStream
  eval_batches: list
  description: str
  unigram_entropy: float


def load_data(cfg) -> Data:
  """Reads the corpus and checks it holds at least one batch (before any compile).

  Every process computes the whole global batch (B x seq_len bytes: cheap)
  and `global_batch` hands each device its block, so batches are right
  whatever devices each process holds (with mesh.data=1, for one, every
  process needs every row).
  """
  corpus = load_corpus(cfg.data.source, cfg.data.path)
  args = dict(
    seq_len=cfg.model.seq_len, global_batch_size=cfg.train.global_batch_size, seed=cfg.train.seed
  )
  train = BatchStream(corpus.train, split_name='train', **args)
  val = BatchStream(corpus.val, split_name='validation', **args)
  return Data(
    train=train,
    eval_batches=val.eval_batches(cfg.train.eval_batches),
    description=corpus.description,
    unigram_entropy=unigram_entropy_nats(corpus.train),
  )


def global_batch(trainer: Trainer, batch: dict) -> dict:
  """The global batch (host arrays, all rows) as arrays sharded by `trainer.batch_sharding`."""
  return {
    k: jax.make_array_from_callback(
      batch[k].shape, trainer.batch_sharding, lambda index, a=batch[k]: a[index]
    )
    for k in ('inputs', 'targets')
  }


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax returns one dict per program
    cost = cost[0] if cost else {}
  return cost or {}


def compile_stats(trainer: Trainer) -> tuple[object, dict]:
  """Lowers and compiles the train step; XLA's per-device memory and cost figures."""
  cfg = trainer.cfg
  b, s = cfg.train.global_batch_size, cfg.model.seq_len
  batch = {
    k: jax.ShapeDtypeStruct((b, s), np.int32, sharding=trainer.batch_sharding)
    for k in ('inputs', 'targets')
  }
  started = time.perf_counter()
  with jax.set_mesh(trainer.mesh):
    compiled = trainer.train_step.lower(trainer.abstract_state(), batch).compile()
  mem = compiled.memory_analysis()
  stats = {
    'temp_bytes': int(mem.temp_size_in_bytes),
    'argument_bytes': int(mem.argument_size_in_bytes),
    'output_bytes': int(mem.output_size_in_bytes),
    'alias_bytes': int(mem.alias_size_in_bytes),
    'generated_code_bytes': int(mem.generated_code_size_in_bytes),
    # XLA counts a loop body once, not once per iteration (see WORKSPACE.md).
    'flops': float(_cost(compiled).get('flops', 0.0)),
    'model_flops_per_step': megatron_flops_per_step(
      b, s, cfg.model.num_layers, cfg.model.d_model, cfg.model.vocab_size
    ),
    'compile_seconds': time.perf_counter() - started,
    'mesh': {a: cfg.mesh[a] for a in config_lib.MESH_AXES},
    'devices': jax.device_count(),
    'schedule': None,
  }
  if trainer.program is not None:
    prog = trainer.program
    stats['schedule'] = {
      'name': prog.schedule.name,
      'stages': prog.schedule.stages,
      'microbatches': prog.schedule.microbatches,
      'virtual_stages': prog.schedule.virtual_stages,
      'ticks': prog.ticks,
      'stash_slots': prog.num_stash_slots,
      'peak_stash': list(prog.peak_stash),
      'message_slots': prog.slots['msg'],
      'cut_slots': prog.slots['cut'],
      'residual_bytes_per_slot': trainer.pipeline.residual_bytes,
      'cut_bytes_per_slot': trainer.pipeline.cut_bytes,
    }
    moved = sched.transfers_per_step(prog)['total']
    # Residual sets BPipe moves between partners per step (global bytes,
    # summed over the data/tensor shards of each set).
    stats['schedule']['residual_bytes_moved_per_step'] = moved * trainer.pipeline.residual_bytes
  return compiled, stats


def _write_json(path: str, obj) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def _parse_profile_steps(spec: str, last_step: int) -> tuple[int, int] | None:
  if not spec:
    return None
  try:
    first, last = (int(x) for x in spec.split(':'))
  except ValueError:
    raise ConfigError('--profile_steps', f'{spec!r} is not A:B (e.g. 5:8)') from None
  if not 0 < first <= last <= last_step:
    raise ConfigError('--profile_steps', f'need 0 < A <= B <= train.steps={last_step}, got {spec}')
  return first, last


def _check_workdir(workdir: str) -> None:
  """The workdir is a directory, or can become one (its nearest existing ancestor is one)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError('--workdir', f'{workdir} is a file; give a directory')
  ancestor = os.path.dirname(os.path.abspath(workdir))
  while not os.path.exists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if not os.path.isdir(ancestor):
    raise ConfigError(
      '--workdir', f'cannot create {workdir}: {ancestor} is a file; give a directory path'
    )
  if not os.access(ancestor if not os.path.isdir(workdir) else workdir, os.W_OK):
    raise ConfigError('--workdir', f'{workdir} is not writable; choose another --workdir')


def train_and_evaluate(
  cfg, workdir: str, *, compile_only: bool = False, profile_steps: str = '', progress: bool = True
) -> dict:
  """Runs (or resumes) training as configured; returns a summary of the run.

  Everything that can be wrong with the input is checked before the workdir
  is touched: config, data, profile range, and an existing checkpoint
  directory (its contents and its model).

  Raises:
    ConfigError: bad input (nothing written).
    NonFiniteError: a NaN/Inf step beyond train.skip_nonfinite_steps (its state is not saved).
  """
  cfg = config_lib.validate(cfg, jax.device_count())
  profile = _parse_profile_steps(profile_steps, cfg.train.steps)
  _check_workdir(workdir)
  data = load_data(cfg)
  mesh = build_mesh(cfg.mesh)
  trainer = build_trainer(cfg, mesh)

  with jax.set_mesh(mesh):  # jitted functions trace on first call: they need the mesh
    return _run(cfg, trainer, data, workdir, compile_only, profile, progress)


def _run(
  cfg,
  trainer: Trainer,
  data: Data,
  workdir: str,
  compile_only: bool,
  profile: tuple[int, int] | None,
  progress: bool,
) -> dict:
  main_process = jax.process_index() == 0
  if compile_only:
    _, stats = compile_stats(trainer)
    if main_process:
      os.makedirs(workdir, exist_ok=True)
      _write_json(os.path.join(workdir, 'compile_stats.json'), stats)
    return stats

  ckpt = Checkpointer(workdir, cfg)  # only reads until the first save
  state = ckpt.restore(trainer)  # the newest intact checkpoint; checks its model
  if state is None:
    state = trainer.init_state(jax.random.key(cfg.train.seed))
  skipped = list(ckpt.restored_progress.get('skipped_nonfinite', []))
  # Input is checked; from here on the workdir is written.
  if main_process:
    os.makedirs(workdir, exist_ok=True)
  ckpt.prepare_to_write()
  if main_process:
    # What the run was (for triax.sample and for people): the validated config.
    with open(os.path.join(workdir, 'config.json.tmp'), 'w') as f:
      f.write(cfg.to_json(indent=2))
    os.replace(os.path.join(workdir, 'config.json.tmp'), os.path.join(workdir, 'config.json'))
  start = int(jax.device_get(state.step))
  skip_limit = cfg.train.skip_nonfinite_steps
  compiled, stats = compile_stats(trainer)
  if main_process:
    _write_json(os.path.join(workdir, 'compile_stats.json'), stats)
  metrics = MetricsWriter(workdir, start, enabled=main_process)
  samples = JsonLines(
    os.path.join(workdir, 'samples.jsonl'),
    start,
    enabled=main_process and cfg.train.record_sample_ids,
  )
  peak = peak_flops(jax.devices()[0].device_kind, cfg.hardware.peak_flops_per_device)
  tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
  lr = trainer.optimizer_schedule

  def evaluate(step: int) -> float:
    losses = [trainer.eval_loss(state.params, global_batch(trainer, b)) for b in data.eval_batches]
    value = float(np.mean(jax.device_get(losses)))
    metrics.write({'step': step, 'eval_loss': value})
    return value

  first_eval = evaluate(start) if start == 0 else None
  last_eval = first_eval
  bar = tqdm(
    total=cfg.train.steps,
    initial=start,
    disable=not (progress and main_process),
    dynamic_ncols=True,
    desc='train',
  )
  window_start, window_steps = time.perf_counter(), 0
  last_loss = math.nan
  try:
    for step in range(start + 1, cfg.train.steps + 1):
      if profile and step == profile[0]:
        jax.profiler.start_trace(os.path.join(workdir, 'profile'))
      host_batch = data.train.batch(step - 1)
      new_state, out = compiled(state, global_batch(trainer, host_batch))
      window_steps += 1
      log_now = step % cfg.train.log_every == 0 or step == cfg.train.steps
      if profile and step == profile[1]:
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
      # Fetching two scalars each step costs little and lets a NaN stop the
      # run at the step that produced it, before that state can be saved.
      out = jax.device_get(out)
      loss, grad_norm = float(out['loss']), float(out['grad_norm'])
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        if len(skipped) >= skip_limit:
          raise NonFiniteError(step, loss, grad_norm)
        skipped.append(step)  # new_state holds the previous parameters (see training.step)
        metrics.write(
          {
            'step': step,
            'skipped_nonfinite': True,
            'loss': loss,
            'grad_norm': grad_norm,
            'skipped_so_far': len(skipped),
          }
        )
        log_now = False
      samples.write({'step': step, 'sample_ids': host_batch['sample_ids'].tolist()})
      if log_now:
        elapsed = time.perf_counter() - window_start
        step_time = elapsed / window_steps
        record = {
          'step': step,
          'loss': loss,
          'learning_rate': float(lr(step - 1)),
          'grad_norm': grad_norm,
          'tokens_per_sec': tokens_per_step / step_time,
          'step_time_s': step_time,
          'epoch': data.train.epoch_at(step),
        }
        if peak:
          record['mfu'] = stats['model_flops_per_step'] / step_time / (peak * jax.device_count())
        metrics.write(record)
        last_loss = loss
        bar.set_postfix(loss=f'{loss:.3f}', tok_s=f'{record["tokens_per_sec"]:.0f}')
        window_start, window_steps = time.perf_counter(), 0
      state = new_state
      bar.update(1)
      if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
        last_eval = evaluate(step)
        window_start = time.perf_counter()
      every = cfg.checkpoint.every_steps
      if (every and step % every == 0) or step == cfg.train.steps:
        ckpt.save(trainer, state, progress={'skipped_nonfinite': skipped})
        window_start = time.perf_counter()
  finally:
    bar.close()
    ckpt.close()
    metrics.close()
  return {
    'workdir': os.path.abspath(workdir),
    'start_step': start,
    'steps': cfg.train.steps,
    'first_eval_loss': first_eval,
    'final_eval_loss': last_eval,
    'final_loss': last_loss,
    'unigram_entropy_nats': data.unigram_entropy,
    'data': data.description,
    'temp_bytes': stats['temp_bytes'],
    'skipped_nonfinite': skipped,
    'restored_step': ckpt.restored_step,
    'damaged_checkpoints': ckpt.damaged,
  }
