"""The training loop: config -> data -> mesh -> compiled step -> steps, evals, checkpoints.

Invariants:
- a run is resumable at any moment: batches are a pure function of the step, checkpoints
  count only once complete (training/checkpoint.py), and metrics, TensorBoard events and
  sample logs are cut back to the restored step, so a killed run, started again with the
  same command, goes on to the same losses as one never interrupted;
- SIGTERM or Ctrl-C stops it after the step in flight, with a complete checkpoint of that
  step (training/preemption.py); one run at a time holds a workdir (training/lock.py);
- the host queues step s before fetching step s-1's loss, so a NaN/Inf is noticed one step
  late, but every evaluation and save fetches its own step first: a non-finite step's
  state is never evaluated or saved, and the error names the step that produced it. Each
  fetched step is judged (training/bad_steps.py): skipped or rolled back past its batches.

A run is `_Training`: `prepare` (records, compile, writers), then `steps`, whose pieces are
`_dispatch` (queue a step, fetch the one before), `_after_step` (evaluate, save, stop on a
signal), `fetch` (judge and log one step) and `_roll_back`."""

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
from triax.compiled import stats as stats_lib
from triax.data import batches
from triax.data import pipeline as data_pipeline
from triax.elastic import heartbeat
from triax.errors import ConfigError
from triax.mesh import build_mesh
from triax.model.flops import peak_flops
from triax.pipeline import simulate
from triax.training import atomic, bad_steps, goodput, preemption, stragglers
from triax.training import lock as lock_lib
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


# Where callers (the CLI) catch a diverged run.
NonFiniteError = bad_steps.NonFiniteError
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
    for k in batches.keys(cfg)
  }


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
    # The schedule CLI's default (a packed program's: full recomputation's).
    costs = simulate.Costs.design_point(program.split_backward, program.units)
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
  cfg,
  workdir: str,
  *,
  compile_only: bool = False,
  profile_steps: str = '',
  progress: bool = True,
  restore_fallback: bool = False,
  reset_optimizer: bool = False,
) -> dict:
  """Runs (or resumes) training as configured; returns a summary of the run.

  Everything that can be wrong with the input is checked before the workdir
  is touched: config, data, profile range, a lock held by another run, and
  an existing checkpoint directory (its contents and its model). Then the
  workdir's lock is taken (DIR/triax.lock, by process 0) and held until
  this returns or raises. `restore_fallback`: a damaged newest checkpoint
  is passed over for the newest intact one instead of being an error.
  `reset_optimizer`: the checkpoint's parameters, step and data position are
  resumed and the optimizer's moments start afresh (the learning-rate
  schedule goes on), which also lets train.optimizer differ from the checkpoint's.

  Raises:
    ConfigError: bad input, or the workdir is in use (nothing written).
    NonFiniteError: a NaN/Inf step beyond train.skip_nonfinite_steps (its state is not saved),
      or bad again after train.spike_max_rollbacks rollbacks.
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
      run = _RunOptions(compile_only, profile, progress, restore_fallback, reset_optimizer)
      return _run(cfg, trainer, data, workdir, workdir_lock, run)
  finally:
    workdir_lock.release()


@dataclasses.dataclass(frozen=True)
class _RunOptions:
  """The command line's choices beside the config."""

  compile_only: bool
  profile: tuple[int, int] | None  # steps A..B to trace
  progress: bool  # a progress bar
  restore_fallback: bool  # pass over a damaged newest checkpoint
  reset_optimizer: bool  # resume the params only; a fresh optimizer state


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
  options: _RunOptions,
) -> dict:
  main_process = jax.process_index() == 0
  if options.compile_only:
    _, _, stats = stats_lib.all_compile_stats(trainer)
    stats.update(stats_lib.local_fit(stats, list(trainer.mesh.devices.flat)))
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
    heartbeat.follow_supervisor()  # a supervisor's death comes as SIGTERM: saved, exits
    # Only reads until the first save.
    ckpt = Checkpointer(
      workdir,
      cfg,
      restore_fallback=options.restore_fallback,
      reset_optimizer=options.reset_optimizer,
    )
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
    run = _Training(cfg, trainer, data, workdir, ckpt, signals, position, options.profile)
    run.prepare(state, start, options.progress)
    return run.steps()


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
    'skipped_batches': [],
    'rollbacks': [],
    'restored_step': step,
    'damaged_checkpoints': [],
  }


class _Training:
  """The steps of one run, from a restored (or fresh) state to train.steps.

  The host queues step s, then fetches step s-1's outputs (`pending`), so the
  device always has the next step queued; each fetched step is judged
  (training/bad_steps.py), logged, and may roll the run back.
  """

  def __init__(self, cfg, trainer, data, workdir, ckpt, signals, position, profile):
    self.cfg, self.trainer, self.data, self.workdir = cfg, trainer, data, workdir
    self.ckpt, self.signals, self.position, self.profile = ckpt, signals, position, profile
    self.main = jax.process_index() == 0
    self.bad = bad_steps.BadSteps.from_config(
      cfg.train, ckpt.restored_progress, bad_steps.read_rollbacks(workdir)
    )
    self.pending = []  # the step whose outputs are not fetched yet: (step, out, lr)
    self.last_loss = math.nan
    self.last_save = time.monotonic()
    self.rollbacks: list[dict] = []
    self.timeline = goodput.Timeline(workdir, self.main)
    processes = jax.process_count()
    self.stragglers = stragglers.Stragglers(
      cfg.train.straggler_ratio,
      cfg.train.straggler_steps,
      jax.process_index(),
      processes,
      preemption.coordinator_client() if processes > 1 else None,
      say=lambda line: preemption.say(line, self.bar),
    )
    self.bar = None

  def prepare(self, state, start: int, progress: bool) -> None:
    """Writes the run's records, compiles, opens the writers, evaluates a fresh start."""
    cfg, workdir = self.cfg, self.workdir
    self.state, self.start = state, start
    self.timeline.record(start, 'start')
    self.ckpt.prepare_to_write()
    if self.main:
      # What the run was (for triax sample and for people): the validated config.
      atomic.write_text(workdir_lib.path(workdir, workdir_lib.CONFIG), cfg.to_json(indent=2))
      record = {'platform': jax.default_backend(), 'local_devices': jax.local_device_count()}
      atomic.write_json(workdir_lib.path(workdir, workdir_lib.DEVICES), record)
    with self.timeline.phase('compile'):
      self.compiled, self.compiled_eval, self.stats = stats_lib.all_compile_stats(self.trainer)
    if self.main:
      atomic.write_json(workdir_lib.path(workdir, workdir_lib.COMPILE_STATS), self.stats)
    self.peak = peak_flops(jax.devices()[0].device_kind, cfg.hardware.peak_flops_per_device)
    self._open_writers(start)
    self.first_eval = self.evaluate(start) if start == 0 else None
    self.last_eval = self.first_eval
    self.bar = tqdm(
      total=cfg.train.steps,
      initial=start,
      disable=not (progress and self.main),
      dynamic_ncols=True,
      desc='train',
    )
    self.signals.bar = self.bar
    self.window_start, self.window_steps = time.perf_counter(), 0
    self.timeline.clock.switch('steps')
    self.stragglers.start()

  def _open_writers(self, start: int) -> None:
    """Metrics and sample logs, cut back to `start` (a resume's, or a rollback's, step)."""
    cfg = self.cfg
    self.metrics = MetricsWriter(
      self.workdir,
      start,
      enabled=self.main,
      wandb_project=cfg.train.wandb_project,
      wandb_mode=cfg.train.wandb_mode,
      config=cfg.to_dict(),
    )
    self.samples = JsonLines(
      workdir_lib.path(self.workdir, workdir_lib.SAMPLES),
      start,
      enabled=self.main and cfg.train.record_sample_ids,
    )

  def evaluate(self, step: int) -> float:
    with self.timeline.phase('eval'):
      return self._evaluate(step)

  def _evaluate(self, step: int) -> float:
    data = self.data
    params = self.trainer.eval_params(self.state)  # schedule-free's average, else the params
    losses = [
      self.compiled_eval(
        params,
        global_batch(self.trainer, lambda lo, hi, i=i: data.val.eval_batch(i, (lo, hi))),
      )
      for i in range(data.eval_count)
    ]
    value = float(np.mean(jax.device_get(losses)))
    self.metrics.write({'step': step, 'eval_loss': value})
    return value

  def steps(self) -> dict:
    """Runs the steps; the run's summary (raises preemption.Stopped after a signal's save)."""
    stopped = None
    try:
      step = self.start
      while step < self.cfg.train.steps:
        step += 1
        if not self._dispatch(step):
          step = self.position.step  # rolled back
          continue
        stopped, rolled_back = self._after_step(step)
        if rolled_back:
          step = self.position.step
          continue
        self.timeline.record(step, 'step')
        self.stragglers.step_done(step)
        if stopped is not None:
          break
      with self.timeline.phase('checkpoint'):
        self.ckpt.close()  # the last save's wait belongs to the run's time
      self.timeline.record(step, 'end')
    finally:
      self.bar.close()
      self.ckpt.close()
      self.metrics.close()
    if stopped is not None:
      if self.main:
        print(stopped.message, flush=True)
      raise stopped
    return self.summary()

  def _dispatch(self, step: int) -> bool:
    """Queues `step`, then fetches the step before it; False if that one rolled the run back."""
    cfg, data = self.cfg, self.data
    if self.profile and step == self.profile[0]:
      jax.profiler.start_trace(workdir_lib.path(self.workdir, workdir_lib.PROFILE))
    at = self.bad.position(step)
    with self.timeline.phase('data'):
      batch = global_batch(self.trainer, lambda lo, hi: data.train.batch(at, (lo, hi)))
    # The logged learning rate is the schedule evaluated op by op, as always;
    # queued ahead of the step, it is ready when the step is (queued after
    # it, reading it would wait for the step queued next).
    logged = step % cfg.train.log_every == 0 or step == cfg.train.steps
    # Both block while the device is busy (XLA:CPU runs one program at a time): waits.
    with self.stragglers.waiting():
      step_lr = self.trainer.optimizer_schedule(step - 1) if logged else None
      self.state, out = self.compiled(self.state, batch)
    self.position.step = step
    if not self.fetch():  # the previous step's: the device has this one queued meanwhile
      return False
    self.pending.append((step, out, step_lr))
    if self.profile and step == self.profile[1]:
      jax.block_until_ready(out)
      jax.profiler.stop_trace()
    return True

  def _after_step(self, step: int) -> tuple[preemption.Stopped | None, bool]:
    """Evaluates and saves `step` when due; (a stop after its save, whether it rolled back)."""
    cfg, ckpt = self.cfg, self.ckpt
    every, every_seconds = cfg.checkpoint.every_steps, cfg.checkpoint.every_seconds
    last = step == cfg.train.steps
    # Every process asks every step, the last too: process 0 answers for all.
    with self.stragglers.waiting():
      stop, by_time = self.signals.decide(
        step, bool(every_seconds) and time.monotonic() - self.last_save >= every_seconds
      )
    stop = stop and not last  # a signal at the last step: the run simply ends
    eval_now = step % cfg.train.eval_every == 0 or last
    save_now = (
      last or stop or by_time or bool(every and step % every == 0) or ckpt.is_milestone(step)
    )
    # This step's outputs first: a non-finite one stops or rolls back here, before
    # it is evaluated or saved.
    if (eval_now or save_now) and not self.fetch():
      return None, True
    save_now = save_now and (last or stop or not self.bad.amid_bad_steps)
    if eval_now:
      self.last_eval = self.evaluate(step)
      self.window_start = time.perf_counter()
    if save_now:
      with self.timeline.phase('checkpoint'):
        ckpt.save(self.trainer, self.state, progress=self.bad.progress())
      self.last_save = time.monotonic()
      self.window_start = time.perf_counter()
    if not stop:
      return None, False
    with self.timeline.phase('checkpoint'):
      ckpt.wait()
      problem = ckpt.verify(step) if self.main else None
    if problem:
      raise RuntimeError(f'checkpoint {step} failed its check after saving: {problem}')
    message = (
      f'stopped by {self.signals.name} after step {step}; checkpoint {step} is complete; '
      'rerun the same command to resume'
    )
    return preemption.Stopped(message, step), False

  def fetch(self) -> bool:
    """Fetches the pending step's loss and gradient norm, judges and logs them.

    Returns False when that step rolled the run back (nothing is pending then).
    Raises bad_steps.NonFiniteError when no skip or rollback covers a NaN/Inf.
    """
    if not self.pending:
      return True
    step, out, step_lr = self.pending.pop()
    with self.stragglers.waiting():
      out, step_lr = jax.device_get((out, step_lr))
    # One clock reading ends this window and starts the next: host work between
    # fetches (logging, dispatch) belongs to some step's time.
    fetched = time.perf_counter()
    self.window_steps += 1
    loss, grad_norm = float(out['loss']), float(out['grad_norm'])
    verdict = self.bad.judge(step, loss, grad_norm)
    if verdict == bad_steps.ROLLBACK:
      self._roll_back()
      return False
    if verdict != bad_steps.GOOD:
      # A skipped step's state holds the previous parameters (see training.step).
      self.metrics.write(
        {
          'step': step,
          f'{verdict}_{"nonfinite" if verdict == bad_steps.SKIPPED else "loss"}': True,
          'loss': loss,
          'grad_norm': grad_norm,
          'skipped_so_far': len(self.bad.skipped_nonfinite),
        }
      )
    if self.samples.enabled:
      ids = self.data.train.sample_ids(self.bad.position(step))
      self.samples.write({'step': step, 'sample_ids': ids.tolist()})
    log_now = step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps
    if log_now and verdict == bad_steps.GOOD:
      self._log(step, out, step_lr, fetched)
    self.bar.update(1)
    heartbeat.beat()  # for a supervisor: this process is not stuck
    return True

  def _log(self, step: int, out: dict, step_lr, fetched: float) -> None:
    """One metrics record for `step`: loss, rate, throughput, MFU."""
    stats = self.stats
    step_time = (fetched - self.window_start) / self.window_steps
    record = {
      'step': step,
      'loss': float(out['loss']),
      'learning_rate': float(step_lr),
      'grad_norm': float(out['grad_norm']),
      'tokens_per_sec': self.cfg.train.global_batch_size * self.cfg.model.seq_len / step_time,
      'step_time_s': step_time,
      'epoch': self.data.train.epoch_at(self.bad.position(step) + 1),
    }
    # What the model adds (a MoE's router losses and expert load), beside the loss.
    record.update({k: float(v) for k, v in out.items() if k not in ('loss', 'grad_norm')})
    record['model_flops_per_sec'] = stats['model_flops_per_step'] / step_time
    record['hardware_flops_per_sec'] = stats['hardware_flops_per_step'] / step_time
    if self.peak:
      record['mfu'] = record['model_flops_per_sec'] / (self.peak * jax.device_count())
      record['hfu'] = record['hardware_flops_per_sec'] / (self.peak * jax.device_count())
    # Where the run's time went so far (training/goodput.py), and each process's step.
    record.update(self.timeline.ledger.metrics())
    record.update(self.stragglers.metrics())
    self.metrics.write(record)
    self.last_loss = record['loss']
    self.bar.set_postfix(loss=f'{record["loss"]:.3f}', tok_s=f'{record["tokens_per_sec"]:.0f}')
    self.window_start, self.window_steps = fetched, 0

  def _roll_back(self) -> None:
    """Back to the newest checkpoint before the bad steps, whose batches are then skipped."""
    bad = self.bad.streak
    self.pending.clear()  # the step queued after the bad one is computed from it
    # The bad state goes before the checkpoint's comes: a restore beside it would
    # hold two train states.
    self.state = None
    with self.timeline.phase('restart'):
      state = self.ckpt.roll_back(self.trainer, bad[0])
      if state is None:
        state = self.trainer.init_state(jax.random.key(self.cfg.train.seed))
      self.state = state
      restored = self.position.step = int(jax.device_get(state.step))
    self.timeline.record(restored, 'rollback')
    record = self.bad.rolled_back(self.workdir, restored, self.ckpt.restored_progress, self.main)
    self.rollbacks.append(record)
    self.metrics.close()
    self._open_writers(restored)
    if self.main:
      preemption.say(
        f'rolled back: steps {bad} were non-finite or spiked (loss > '
        f'{self.cfg.train.spike_threshold} x the mean of the last good ones); resumed from '
        f'step {restored}, skipping batches {record["skipped_batches"]}',
        self.bar,
      )
    self.bar.n = restored
    self.bar.refresh()
    self.window_start, self.window_steps = time.perf_counter(), 0

  def summary(self) -> dict:
    return {
      'workdir': os.path.abspath(self.workdir),
      'start_step': self.start,
      'steps': self.cfg.train.steps,
      'first_eval_loss': self.first_eval,
      'final_eval_loss': self.last_eval,
      'final_loss': self.last_loss,
      'unigram_entropy_nats': self.data.unigram_entropy,
      'data': self.data.description,
      'temp_bytes': self.stats['temp_bytes'],
      'skipped_nonfinite': self.bad.skipped_nonfinite,
      'skipped_batches': self.bad.skipped_batches,
      'rollbacks': self.rollbacks,
      'restored_step': self.ckpt.restored_step,
      'damaged_checkpoints': self.ckpt.damaged,
    }
