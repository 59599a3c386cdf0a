"""The training loop: config -> data -> mesh -> compiled step -> steps, evals, checkpoints.

A run is resumable at any moment: batches are a pure function of the step,
checkpoints are written asynchronously and count only once complete
(training/checkpoint.py), and metrics, TensorBoard events and sample logs
are cut back to the restored step, so a killed run, started again with the
same command, goes on to the same losses as one never interrupted. SIGTERM
or Ctrl-C stops it after the step in flight, with a complete checkpoint of
that step (training/preemption.py). One run at a time holds a workdir
(training/lock.py).

The host does not wait for the device each step: it queues step s, then
fetches step s-1's loss and gradient norm (done by now, or nearly), so the
device always has the next step queued. A NaN/Inf is therefore noticed one
step later than it happens, but never too late: every evaluation and save
fetches its own step first, so a non-finite step's state is never evaluated
or saved, and the error names the step that produced it.
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
from triax.data import pipeline as data_pipeline
from triax.errors import ConfigError
from triax.mesh import build_mesh
from triax.model.flops import peak_flops, step_flops
from triax.pipeline import schedule as sched
from triax.pipeline import simulate
from triax.training import atomic, preemption
from triax.training import lock as lock_lib
from triax.training import step as step_lib
from triax.training import workdir as workdir_lib
from triax.training.checkpoint import Checkpointer
from triax.training.metrics import JsonLines, MetricsWriter
from triax.training.step import Trainer, build_trainer


def recorded_cpu_devices(workdir: str) -> int | None:
  """The CPU devices per process of the workdir's last run; None when it ran elsewhere or
  recorded nothing (a run before this file, or an import)."""
  try:
    # What a resume by workdir alone needs that config.json does not say: the CPU
    # device count (forced before JAX starts, so only the command line sets it).
    with open(workdir_lib.path(workdir, workdir_lib.DEVICES)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(record, dict) or record.get('platform') != 'cpu':
    return None
  count = record.get('local_devices')
  return count if isinstance(count, int) and count >= 1 else None


class NonFiniteError(RuntimeError):
  """The loss or gradient of `step` became NaN/Inf; that state is not saved.

  The loop may notice it while the next step runs (it reads each step's loss
  one step behind); the state of that next step, computed from it, is not
  saved either.
  """

  def __init__(self, step: int, loss: float, grad_norm: float):
    self.step = step
    super().__init__(
      f'step {step}: loss={loss} grad_norm={grad_norm} is not finite; stopped '
      'without saving this step (lower train.learning_rate, or let '
      'train.skip_nonfinite_steps=N skip such steps)'
    )


Data = data_pipeline.Data


def load_data(cfg) -> Data:
  """Opens and checks the configured data (before any compile); see triax.data.pipeline."""
  return data_pipeline.load(cfg)


def global_batch(trainer: Trainer, rows) -> dict:
  """The global batch as arrays sharded by `trainer.batch_sharding`, reading only local rows.

  `rows(lo, hi)` returns host rows [lo, hi) of the global batch. Each
  process asks only for the row blocks of its own devices (a block read once
  however many of its devices hold it), so no process builds the whole batch.
  """
  cfg = trainer.cfg
  shape = (cfg.train.global_batch_size, cfg.model.seq_len)
  blocks = {}

  def block(index):
    lo, hi, _ = index[0].indices(shape[0])
    if (lo, hi) not in blocks:
      blocks[lo, hi] = rows(lo, hi)
    return blocks[lo, hi]

  return {
    k: jax.make_array_from_callback(
      shape, trainer.batch_sharding, lambda index, k=k: block(index)[k][(slice(None),) + index[1:]]
    )
    for k in batch_keys(cfg)
  }


def batch_keys(cfg) -> tuple[str, ...]:
  """The arrays of a batch: with data.mask_documents, the rows' document ids too."""
  return ('inputs', 'targets') + (('segment_ids',) if cfg.data.mask_documents else ())


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax returns one dict per program
    cost = cost[0] if cost else {}
  return cost or {}


def _abstract_batch(trainer: Trainer) -> dict:
  cfg = trainer.cfg
  shape = (cfg.train.global_batch_size, cfg.model.seq_len)
  return {
    k: jax.ShapeDtypeStruct(shape, np.int32, sharding=trainer.batch_sharding)
    for k in batch_keys(cfg)
  }


def compile_stats(trainer: Trainer, compiler_options: dict | None = None) -> tuple[object, dict]:
  """Lowers and compiles the train step; XLA's per-device memory and cost figures.

  `compiler_options`: XLA options for this compile (training/buffers.py's dump).
  """
  cfg = trainer.cfg
  b = cfg.train.global_batch_size
  started = time.perf_counter()
  state = trainer.abstract_state()
  with jax.set_mesh(trainer.mesh):
    compiled = trainer.train_step.lower(state, _abstract_batch(trainer)).compile(compiler_options)
  mem = compiled.memory_analysis()
  flops = step_flops(trainer.model, b)
  shardings = trainer.state_shardings
  params = step_lib.per_device_bytes(state.params, shardings.params)
  stats = {
    'temp_bytes': int(mem.temp_size_in_bytes),
    'argument_bytes': int(mem.argument_size_in_bytes),
    'output_bytes': int(mem.output_size_in_bytes),
    'alias_bytes': int(mem.alias_size_in_bytes),
    # Per device, from the state's shardings: what ZeRO-1 (train.optimizer_sharding=data)
    # divides by the data degree is the optimizer's; gradients are laid out as parameters.
    'param_bytes': params,
    'optimizer_bytes': step_lib.per_device_bytes(state.opt_state, shardings.opt_state),
    'gradient_bytes': params,
    'generated_code_bytes': int(mem.generated_code_size_in_bytes),
    # XLA counts a loop body once, not once per iteration (see WORKSPACE.md).
    'flops': float(_cost(compiled).get('flops', 0.0)),
    # Per step, from the family's shapes (model/flops.py): model FLOPs are the
    # useful work MFU counts; hardware FLOPs add what remat recomputes.
    'model_flops_per_step': flops['model'],
    'hardware_flops_per_step': flops['hardware'],
    'compile_seconds': time.perf_counter() - started,
    'mesh': {a: cfg.mesh[a] for a in config_lib.MESH_AXES},
    'devices': trainer.mesh.devices.size,
    'device_kind': trainer.mesh.devices.flat[0].device_kind,
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


def state_program_stats(trainer: Trainer) -> tuple[object, dict]:
  """Compiles what runs beside the train step on the same state: the
  conversions every save and restore runs (to and from the checkpoint's
  layout) and the evaluation. Returns the compiled evaluation (the loop
  evaluates with it, so it is compiled once) and their per-device bytes."""
  with jax.set_mesh(trainer.mesh):
    save = trainer.to_canonical.added_bytes(trainer.abstract_state())
    restore = trainer.from_canonical.added_bytes(trainer.abstract_canonical_state())
    evaluate = trainer.eval_loss.lower(trainer.abstract_state().params, _abstract_batch(trainer))
    evaluate = evaluate.compile()
  mem = evaluate.memory_analysis()
  return evaluate, {
    # What a save's (restore's) conversion adds per device beside the train
    # state (the checkpoint's layout): its output and temporaries.
    'checkpoint_save_bytes': int(save),
    'checkpoint_restore_bytes': int(restore),
    # The evaluation program's arguments and temporaries per device (to set beside the
    # train step's temp_bytes + argument_bytes).
    'eval_bytes': int(mem.argument_size_in_bytes + mem.temp_size_in_bytes),
  }


def step_peak_bytes(stats: dict) -> int:
  """Per-device bytes live at the train step's peak: temporaries plus un-aliased
  arguments and outputs."""
  s = stats
  return s['temp_bytes'] + s['argument_bytes'] + s['output_bytes'] - s['alias_bytes']


def run_peak_bytes(stats: dict) -> int:
  """Per-device peak of the run: the train step's, or a save, restore or
  evaluation beside the resident state, whichever is larger (a layout that
  trains must also checkpoint and evaluate)."""
  s = stats
  state = s['param_bytes'] + s['optimizer_bytes']
  return max(
    step_peak_bytes(s),
    state + s['checkpoint_save_bytes'],
    state + s['checkpoint_restore_bytes'],
    s['optimizer_bytes'] + s['eval_bytes'],  # eval_bytes holds the params it reads
  )


def all_compile_stats(
  trainer: Trainer, compiler_options: dict | None = None
) -> tuple[object, object, dict]:
  """The train step's and the state programs' figures in one record (compile_stats.json)."""
  compiled, stats = compile_stats(trainer, compiler_options)
  compiled_eval, state_stats = state_program_stats(trainer)
  stats = {**stats, **state_stats}
  stats['peak_bytes'] = run_peak_bytes(stats)
  return compiled, compiled_eval, stats


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


def check_workdir(workdir: str) -> None:
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


def _count(n: int) -> str:
  for unit, size in (('B', 1e9), ('M', 1e6), ('K', 1e3)):
    if n >= size:
      return f'{n / size:.3g}{unit}'
  return str(n)


def startup_line(trainer: Trainer, start: int) -> str:
  """What is about to run, in one line: model, mesh, schedule, batch, devices, resume."""
  cfg = trainer.cfg
  # The canonical state holds the layers in model order, without a pipeline layout's padding.
  params = sum(
    math.prod(x.shape) for x in jax.tree.leaves(trainer.abstract_canonical_state().params)
  )
  mesh = ' x '.join(f'{a} {cfg.mesh[a]}' for a in config_lib.MESH_AXES)
  dcn = [cfg.mesh[f'dcn_{a}'] for a in config_lib.MESH_AXES]
  if any(d > 1 for d in dcn):
    mesh += f' (dcn {"x".join(map(str, dcn))})'
  program = trainer.program
  if program is None:
    schedule = 'no pipeline schedule (one micro-batch, one stage)'
  else:
    s = program.schedule
    # The schedule CLI's default costs: a backward is two forwards (B and W one each when split).
    split = program.split_backward
    costs = simulate.Costs(t_backward=1.0 if split else 2.0, t_weight=1.0 if split else 0.0)
    bubble = simulate.simulate_lockstep(program, costs).bubble_fraction
    schedule = (
      f'schedule {s.name} (p={s.stages}, m={s.microbatches}, v={s.virtual_stages}): '
      f'bubble {bubble:.0%} lockstep, peak stash per stage {list(program.peak_stash)}'
    )
  devices = jax.devices()
  kinds = '/'.join(sorted({d.device_kind for d in devices}))
  processes = f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''
  tokens = cfg.train.global_batch_size * cfg.model.seq_len
  where = f'resuming from checkpoint {start}' if start else 'starting at step 0'
  active = trainer.model.active_parameters(params)
  if active != params:
    params_text = f'{_count(params)} parameters ({_count(active)} active per token)'
  else:
    params_text = f'{_count(params)} parameters'
  return (
    f'triax: {params_text}; mesh {mesh}; {schedule}; {tokens} tokens per step; '
    f'{len(devices)} devices ({kinds}){processes}; {where} of {cfg.train.steps}'
  )


def _take_lock(workdir_lock: lock_lib.WorkdirLock) -> None:
  """Process 0 takes the workdir's lock; every process raises if it could not.

  Raises:
    ConfigError: another run holds the workdir.
  """
  error = None
  if jax.process_index() == 0:
    try:
      workdir_lock.acquire()
    except ConfigError as e:
      error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    taken = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not taken and error is None:
      error = ConfigError(
        'workdir', f'{workdir_lock.workdir} is in use (process 0 could not take its lock)'
      )
  if error is not None:
    raise error


def train_and_evaluate(
  cfg, workdir: str, *, compile_only: bool = False, profile_steps: str = '', progress: bool = True
) -> dict:
  """Runs (or resumes) training as configured; returns a summary of the run.

  Everything that can be wrong with the input is checked before the workdir
  is touched: config, data, profile range, a lock held by another run, and
  an existing checkpoint directory (its contents and its model). Then the
  workdir's lock is taken (DIR/triax.lock, by process 0) and held until
  this returns or raises.

  Raises:
    ConfigError: bad input, or the workdir is in use (nothing written).
    NonFiniteError: a NaN/Inf step beyond train.skip_nonfinite_steps (its state is not saved).
    preemption.Stopped: SIGTERM or SIGINT; the step it stopped after is saved and complete
      (a SystemExit with status 0: an entry point exits 0 without catching it).
  """
  cfg = config_lib.validate(cfg, jax.device_count())
  config_lib.check_platform(cfg, jax.devices()[0].platform)
  profile = _parse_profile_steps(profile_steps, cfg.train.steps)
  check_workdir(workdir)
  lock_lib.check_free(workdir)  # early, to fail before the data is read and the step compiled
  data = load_data(cfg)
  mesh = build_mesh(cfg.mesh)
  trainer = build_trainer(cfg, mesh)

  workdir_lock = lock_lib.WorkdirLock(workdir)
  try:
    with jax.set_mesh(mesh):  # jitted functions trace on first call: they need the mesh
      return _run(cfg, trainer, data, workdir, workdir_lock, compile_only, profile, progress)
  finally:
    workdir_lock.release()


@dataclasses.dataclass
class _Position:
  """Where the run is, for the message of a second interrupt (read in a signal handler)."""

  step: int = 0
  ckpt: Checkpointer | None = None


def _run(
  cfg,
  trainer: Trainer,
  data: Data,
  workdir: str,
  workdir_lock: lock_lib.WorkdirLock,
  compile_only: bool,
  profile: tuple[int, int] | None,
  progress: bool,
) -> dict:
  main_process = jax.process_index() == 0
  if compile_only:
    _, _, stats = all_compile_stats(trainer)
    _take_lock(workdir_lock)
    if main_process:
      atomic.write_json(workdir_lib.path(workdir, workdir_lib.COMPILE_STATS), stats)
    return stats

  position = _Position()

  def interrupted(signum: int) -> None:
    # A second signal: leave now, without waiting for a save in flight (the
    # manifest rules make an unfinished one invisible to the next run).
    if main_process:
      last = position.ckpt.latest_step() if position.ckpt is not None else None
      preemption.say(
        f'interrupted at step {position.step}; last complete checkpoint '
        f'{"none" if last is None else last}; rerun the same command to resume',
        signals.bar,
      )
    workdir_lock.release()
    os._exit(128 + signum)

  signals = preemption.StopSignals(on_second=interrupted)  # bound before a signal can call it
  with signals:
    ckpt = Checkpointer(workdir, cfg)  # only reads until the first save
    position.ckpt = ckpt
    finished = ckpt.finished_step(trainer, cfg.train.steps)
    if finished is not None:
      # A rerun of a finished run: said before the step compiles or a tracker opens a run.
      return _nothing_to_do(cfg, workdir, data, finished)
    state = ckpt.restore(trainer)  # the newest intact checkpoint; checks its model
    if state is None:
      state = trainer.init_state(jax.random.key(cfg.train.seed))
    start = position.step = int(jax.device_get(state.step))
    # Input is checked; from here on the workdir is written.
    _take_lock(workdir_lock)
    if main_process:
      print(data.description, flush=True)
      print(startup_line(trainer, start), flush=True)
    return _train(
      cfg, trainer, data, workdir, ckpt, state, start, signals, position, profile, progress
    )


def _nothing_to_do(cfg, workdir: str, data: Data, step: int) -> dict:
  """The summary of a run whose checkpoint is already at train.steps (no step, no eval)."""
  return {
    'workdir': os.path.abspath(workdir),
    'start_step': step,
    'steps': cfg.train.steps,
    'first_eval_loss': None,
    'final_eval_loss': None,
    'final_loss': math.nan,
    'unigram_entropy_nats': data.unigram_entropy,
    'data': data.description,
    'temp_bytes': None,
    'skipped_nonfinite': [],
    'restored_step': step,
    'damaged_checkpoints': [],
  }


def _train(
  cfg,
  trainer: Trainer,
  data: Data,
  workdir: str,
  ckpt: Checkpointer,
  state,
  start: int,
  signals: preemption.StopSignals,
  position: _Position,
  profile: tuple[int, int] | None,
  progress: bool,
) -> dict:
  main_process = jax.process_index() == 0
  skipped = list(ckpt.restored_progress.get('skipped_nonfinite', []))
  ckpt.prepare_to_write()
  if main_process:
    # What the run was (for triax sample and for people): the validated config.
    atomic.write_text(workdir_lib.path(workdir, workdir_lib.CONFIG), cfg.to_json(indent=2))
    record = {'platform': jax.default_backend(), 'local_devices': jax.local_device_count()}
    atomic.write_json(workdir_lib.path(workdir, workdir_lib.DEVICES), record)
  skip_limit = cfg.train.skip_nonfinite_steps
  compiled, compiled_eval, stats = all_compile_stats(trainer)
  if main_process:
    atomic.write_json(workdir_lib.path(workdir, workdir_lib.COMPILE_STATS), stats)
  metrics = MetricsWriter(
    workdir,
    start,
    enabled=main_process,
    wandb_project=cfg.train.wandb_project,
    wandb_mode=cfg.train.wandb_mode,
    config=cfg.to_dict(),
  )
  samples = JsonLines(
    os.path.join(workdir, 'samples.jsonl'),
    start,
    enabled=main_process and cfg.train.record_sample_ids,
  )
  peak = peak_flops(jax.devices()[0].device_kind, cfg.hardware.peak_flops_per_device)
  tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
  lr = trainer.optimizer_schedule
  every, every_seconds = cfg.checkpoint.every_steps, cfg.checkpoint.every_seconds

  def evaluate(step: int) -> float:
    losses = [
      compiled_eval(
        state.params, global_batch(trainer, lambda lo, hi, i=i: data.val.eval_batch(i, (lo, hi)))
      )
      for i in range(data.eval_count)
    ]
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
  signals.bar = bar
  window = {'start': time.perf_counter(), 'steps': 0}
  last_loss = math.nan
  last_save = time.monotonic()
  pending = []  # the step whose outputs are not fetched yet: (step, out, lr)

  def fetch() -> None:
    """Fetches the pending step's loss and gradient norm; logs them or stops on a NaN/Inf."""
    nonlocal last_loss
    if not pending:
      return
    step, out, step_lr = pending.pop()
    out, step_lr = jax.device_get((out, step_lr))
    # One clock reading ends this window and starts the next: host work between
    # fetches (logging, dispatch) belongs to some step's time.
    fetched = time.perf_counter()
    window['steps'] += 1
    loss, grad_norm = float(out['loss']), float(out['grad_norm'])
    log_now = step % cfg.train.log_every == 0 or step == cfg.train.steps
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
      if len(skipped) >= skip_limit:
        raise NonFiniteError(step, loss, grad_norm)
      skipped.append(step)  # that step's state holds the previous parameters (see training.step)
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
    if samples.enabled:
      samples.write({'step': step, 'sample_ids': data.train.sample_ids(step - 1).tolist()})
    if log_now:
      step_time = (fetched - window['start']) / window['steps']
      record = {
        'step': step,
        'loss': loss,
        'learning_rate': float(step_lr),
        'grad_norm': grad_norm,
        'tokens_per_sec': tokens_per_step / step_time,
        'step_time_s': step_time,
        'epoch': data.train.epoch_at(step),
      }
      # What the model adds (a MoE's router losses and expert load), beside the loss.
      record.update({k: float(v) for k, v in out.items() if k not in ('loss', 'grad_norm')})
      record['model_flops_per_sec'] = stats['model_flops_per_step'] / step_time
      record['hardware_flops_per_sec'] = stats['hardware_flops_per_step'] / step_time
      if peak:
        record['mfu'] = record['model_flops_per_sec'] / (peak * jax.device_count())
        record['hfu'] = record['hardware_flops_per_sec'] / (peak * jax.device_count())
      metrics.write(record)
      last_loss = loss
      bar.set_postfix(loss=f'{loss:.3f}', tok_s=f'{record["tokens_per_sec"]:.0f}')
      window['start'], window['steps'] = fetched, 0
    bar.update(1)

  stopped = None
  try:
    for step in range(start + 1, cfg.train.steps + 1):
      if profile and step == profile[0]:
        jax.profiler.start_trace(workdir_lib.path(workdir, workdir_lib.PROFILE))
      batch = global_batch(trainer, lambda lo, hi, s=step - 1: data.train.batch(s, (lo, hi)))
      # The logged learning rate is the schedule evaluated op by op, as always;
      # queued ahead of the step, it is ready when the step is (queued after
      # it, reading it would wait for the step queued next).
      step_lr = lr(step - 1) if step % cfg.train.log_every == 0 or step == cfg.train.steps else None
      state, out = compiled(state, batch)
      position.step = step
      fetch()  # the previous step's: the device has this one queued meanwhile
      pending.append((step, out, step_lr))
      if profile and step == profile[1]:
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
      last = step == cfg.train.steps
      # Every process asks every step, the last too: process 0 answers for all.
      stop, by_time = signals.decide(
        step, bool(every_seconds) and time.monotonic() - last_save >= every_seconds
      )
      stop = stop and not last  # a signal at the last step: the run simply ends
      eval_now = step % cfg.train.eval_every == 0 or last
      save_now = (
        last or stop or by_time or bool(every and step % every == 0) or ckpt.is_milestone(step)
      )
      if eval_now or save_now:
        fetch()  # this step's: a non-finite one stops here, before it is evaluated or saved
      if eval_now:
        last_eval = evaluate(step)
        window['start'] = time.perf_counter()
      if save_now:
        ckpt.save(trainer, state, progress={'skipped_nonfinite': skipped})
        last_save = time.monotonic()
        window['start'] = time.perf_counter()
      if stop:
        ckpt.wait()
        problem = ckpt.verify(step) if main_process else None
        if problem:
          raise RuntimeError(f'checkpoint {step} failed its check after saving: {problem}')
        stopped = preemption.Stopped(
          f'stopped by {signals.name} after step {step}; checkpoint {step} is complete; '
          'rerun the same command to resume',
          step,
        )
        break
  finally:
    bar.close()
    ckpt.close()
    metrics.close()
  if stopped is not None:
    if main_process:
      print(stopped.message, flush=True)
    raise stopped
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
