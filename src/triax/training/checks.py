"""The train and checkpoint groups' checks (config.validate dispatches to
`validate_train` and `validate_checkpoint`), and the rules of the batch's
split that the train step and the planner share. Plain Python: no JAX.
"""

from __future__ import annotations

import importlib.util

from triax import checks
from triax.errors import ConfigError

LR_SCHEDULES = ('cosine', 'linear', 'constant', 'wsd')
WANDB_MODES = ('online', 'offline')
OPTIMIZER_SHARDINGS = ('replicated', 'data')
OPTIMIZERS = ('adamw', 'muon', 'lion', 'adafactor', 'schedule_free_adamw')
# Each optimizer's own keys, and the optimizers that read them (training/optimizer.py).
OPTIMIZER_KEYS = {
  'adam_b1': ('adamw', 'muon'),
  'adam_b2': ('adamw', 'muon', 'schedule_free_adamw'),
  'muon_beta': ('muon',),
  'muon_ns_steps': ('muon',),
  'muon_rms_scale': ('muon',),
  'muon_exclude': ('muon',),
  'lion_b1': ('lion',),
  'lion_b2': ('lion',),
  'adafactor_decay_rate': ('adafactor',),
  'adafactor_clipping_threshold': ('adafactor',),
  'schedule_free_b1': ('schedule_free_adamw',),
}


def wsd_decay_steps(train_cfg) -> int:
  """Updates in WSD's final linear decay: train.decay_fraction of the run, at least one."""
  return max(1, round(train_cfg.decay_fraction * train_cfg.steps))


def validate_train(cfg, default_train) -> None:
  """The train group: counts, the batch split, the optimizer and its schedule;
  `default_train` is config.defaults().train (the keys an optimizer leaves unread keep it)."""
  t = cfg.train
  for key in ('steps', 'global_batch_size', 'eval_every', 'eval_batches', 'log_every'):
    checks.positive_int(f'train.{key}', t[key])
  checks.positive_int('train.straggler_steps', t.straggler_steps)
  ratio = t.straggler_ratio
  if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 1:
    raise ConfigError(
      'train.straggler_ratio', f'must be a number above 1 (1.2 = 20% slower), got {ratio!r}'
    )
  check_batch_split(t, cfg.mesh.data, cfg.pipeline.microbatches)
  _eval_microbatches(cfg)
  for key in ('learning_rate', 'weight_decay', 'grad_clip_norm', 'min_lr_ratio'):
    checks.non_negative_number(f'train.{key}', t[key])
  for key in ('warmup_steps', 'skip_nonfinite_steps', 'spike_rollback'):
    checks.non_negative_int(f'train.{key}', t[key])
  _spikes(t)
  _wandb(t)
  validate_optimizer(t, default_train)
  checks.boolean('train.offload_optimizer', t.offload_optimizer)
  checks.one_of('train.optimizer_sharding', t.optimizer_sharding, OPTIMIZER_SHARDINGS)
  checks.one_of('train.lr_schedule', t.lr_schedule, LR_SCHEDULES)
  fraction = t.decay_fraction
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
    raise ConfigError(
      'train.decay_fraction', f'must be a number in (0, 1] (0.2 = the last fifth), got {fraction!r}'
    )
  if t.lr_schedule == 'wsd':
    # The decay's updates are the run's last n; they may not reach back into the warmup,
    # and one update between them holds the peak.
    n = wsd_decay_steps(t)
    if t.warmup_steps + n >= t.steps:
      raise ConfigError(
        'train.decay_fraction',
        f'{fraction} decays over the last {n} of train.steps={t.steps}, which leaves no '
        f'stable phase after train.warmup_steps={t.warmup_steps}; lower one of them '
        f'(warmup_steps + decay steps must be below steps)',
      )


def validate_optimizer(t, default_train) -> None:
  """train.optimizer and its keys: another optimizer's key keeps its default
  (a set value would otherwise be silently ignored), and each value is in range."""
  checks.one_of('train.optimizer', t.optimizer, OPTIMIZERS, what='optimizer')
  for key, readers in OPTIMIZER_KEYS.items():
    if t.optimizer not in readers and _plain(t[key]) != _plain(default_train[key]):
      raise ConfigError(
        f'train.{key}',
        f'train.optimizer={t.optimizer} does not use it; leave it at its default '
        f'{_plain(default_train[key])!r} or set train.optimizer to {" or ".join(readers)}',
      )
  for key in ('adam_b1', 'adam_b2', 'muon_beta', 'lion_b1', 'lion_b2'):
    _fraction(f'train.{key}', t[key], 'a decay rate: 0.9 keeps 90% a step', top=False)
  _fraction('train.schedule_free_b1', t.schedule_free_b1, 'its average is y / b1', bottom=False)
  _fraction('train.adafactor_decay_rate', t.adafactor_decay_rate, "0.8, as Adafactor's paper")
  checks.positive_int('train.muon_ns_steps', t.muon_ns_steps)
  checks.non_negative_number('train.muon_rms_scale', t.muon_rms_scale, zero='sqrt(max(1, out/in))')
  checks.non_negative_number(
    'train.adafactor_clipping_threshold', t.adafactor_clipping_threshold, zero='off'
  )
  exclude = t.muon_exclude
  if not isinstance(exclude, (tuple, list)) or not all(isinstance(n, str) for n in exclude):
    raise ConfigError(
      'train.muon_exclude', f"must be a tuple of parameter names, e.g. ('router',); got {exclude!r}"
    )


def _fraction(key: str, value, why: str, *, top: bool = True, bottom: bool = True) -> None:
  """A number in [0, 1], without 1 unless `top`, without 0 unless `bottom`."""
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  ok = ok and (0 <= value if bottom else 0 < value) and (value <= 1 if top else value < 1)
  if not ok:
    span = ('[' if bottom else '(') + '0, 1' + (']' if top else ')')
    raise ConfigError(key, f'must be a number in {span} ({why}), got {value!r}')


def _plain(value):
  """A config value as compared with its default (a JSON round trip makes tuples lists)."""
  return tuple(value) if isinstance(value, list) else value


def validate_checkpoint(cfg) -> None:
  """The checkpoint group: when to save and what to keep."""
  c = cfg.checkpoint
  checks.non_negative_int('checkpoint.every_steps', c.every_steps, zero='only at the end')
  checks.non_negative_number('checkpoint.every_seconds', c.every_seconds, zero='off')
  checks.non_negative_int('checkpoint.keep_every_steps', c.keep_every_steps, zero='off')
  checks.positive_int('checkpoint.keep', c.keep)


def _spikes(t) -> None:
  """train.spike_*: a threshold above the mean itself, a window and a rollback budget of >= 1."""
  threshold = t.spike_threshold
  if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 1 < threshold:
    raise ConfigError(
      'train.spike_threshold',
      f'must be a number > 1 (2 = a loss twice the recent mean spikes), got {threshold!r}',
    )
  for key in ('spike_window', 'spike_max_rollbacks'):
    checks.positive_int(f'train.{key}', t[key])


def _wandb(t) -> None:
  if not isinstance(t.wandb_project, str):
    raise ConfigError('train.wandb_project', f'must be a string; got {t.wandb_project!r}')
  checks.one_of('train.wandb_mode', t.wandb_mode, WANDB_MODES, what='mode')
  if t.wandb_project and importlib.util.find_spec('wandb') is None:
    raise ConfigError(
      'train.wandb_project', "needs the wandb package: pip install 'triax[wandb]' (or wandb)"
    )


def check_batch_split(t, data: int, microbatches: int) -> None:
  """train.global_batch_size over data replicas and micro-batches (validate's
  check, and the planner's for every data degree it tries)."""
  unit = data * microbatches
  if t.global_batch_size % unit:
    # Offer the multiples nearest the value given: the one below it, if any, and those above.
    first = max(unit, t.global_batch_size // unit * unit)
    near = [first + i * unit for i in range(3)]
    raise ConfigError(
      'train.global_batch_size',
      f'{t.global_batch_size} must be a multiple of mesh.data*pipeline.microbatches = '
      f'{data}*{microbatches} = {unit} (equal micro-batch shards), e.g. '
      f'{near[0]}, {near[1]} or {near[2]}',
    )


def eval_split(
  global_batch: int, data: int, pipe: int, microbatches: int, asked: int = 0
) -> tuple[int, int]:
  """How an evaluation forwards a global batch: (the pipe ranks each data
  replica's rows are split over, the micro-batches it runs them in).

  Every pipe rank takes its own rows when they divide by `pipe` (else each
  runs the replica's rows, as a pipe rank must: a stage's weights alone
  make no loss); `asked` micro-batches (train.eval_microbatches), or with
  0 the fewest that keep one no larger, per device, than the train step's
  micro-batch per replica, so the forward never holds more rows at once
  than the step's. The planner prices the evaluation by it too.
  """
  rows = global_batch // data
  spread = pipe if rows % pipe == 0 else 1
  rows //= spread
  if asked:
    return spread, asked
  train_rows = global_batch // (data * microbatches)
  return spread, min(k for k in range(1, rows + 1) if rows % k == 0 and rows // k <= train_rows)


def _eval_microbatches(cfg) -> None:
  t, mesh = cfg.train, cfg.mesh
  asked = t.eval_microbatches
  checks.non_negative_int('train.eval_microbatches', asked, zero='automatic')
  spread, _ = eval_split(t.global_batch_size, mesh.data, mesh.pipe, cfg.pipeline.microbatches)
  rows = t.global_batch_size // (mesh.data * spread)
  if asked and rows % asked:
    split = f'train.global_batch_size={t.global_batch_size} / mesh.data={mesh.data}'
    split += f' / mesh.pipe={spread}' if spread > 1 else ''
    divisors = ', '.join(str(k) for k in range(1, rows + 1) if rows % k == 0)
    raise ConfigError(
      'train.eval_microbatches',
      f'{asked} does not divide the {rows} rows each device evaluates ({split}); '
      f'use one of {divisors}, or 0 (automatic)',
    )
