"""Learning-rate schedules: values at chosen updates, and the checks on their keys.

Update k = 0 .. steps-1 is what the optimizer's count sees (metrics.jsonl logs
it at step k+1). Pure Python and optax: no devices, no compilation.
"""

import math

import pytest

from triax import config
from triax.errors import ConfigError
from triax.training import checks as train_checks
from triax.training.step import learning_rate_schedule

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

PEAK, END = 1e-2, 1e-3  # min_lr_ratio 0.1


def train_cfg(schedule, steps=100, warmup=10, **keys):
  c = config.defaults()
  c.train.update(
    lr_schedule=schedule,
    steps=steps,
    warmup_steps=warmup,
    learning_rate=PEAK,
    min_lr_ratio=END / PEAK,
    **keys,
  )
  return c


def lrs(schedule, **kw):
  """The schedule at every update of the run, as floats."""
  c = train_cfg(schedule, **kw)
  fn = learning_rate_schedule(c.train)
  return [float(fn(k)) for k in range(c.train.steps)]


@pytest.mark.parametrize('schedule', train_checks.LR_SCHEDULES)
def test_every_schedule_warms_up_linearly_from_zero(schedule):
  lr = lrs(schedule)
  assert lr[0] == 0
  for k in range(10):
    assert lr[k] == pytest.approx(PEAK * k / 10, rel=1e-6)
  assert lr[10] == pytest.approx(PEAK, rel=1e-6)


def test_cosine_is_the_default_and_unchanged():
  assert config.defaults().train.lr_schedule == 'cosine'
  lr = lrs('cosine')
  # optax's warmup-cosine: decay_steps counts the warmup, and the end is reached at k = steps.
  for k in (10, 30, 55, 99):
    cosine = 0.5 * (1 + math.cos(math.pi * (k - 10) / 90))
    assert lr[k] == pytest.approx(END + (PEAK - END) * cosine, rel=1e-5)
  assert lr[99] > END


def test_linear_decays_to_min_lr_at_the_last_update():
  lr = lrs('linear')
  assert lr[10] == pytest.approx(PEAK, rel=1e-6)
  # 89 updates from the peak (k = 10) to the end (k = 99): equal steps down.
  for k in (30, 54, 80):
    assert lr[k] == pytest.approx(PEAK + (END - PEAK) * (k - 10) / 89, rel=1e-5)
  assert lr[99] == pytest.approx(END, rel=1e-6)
  assert all(a >= b for a, b in zip(lr[10:], lr[11:]))


def test_constant_holds_the_peak_and_ignores_min_lr():
  lr = lrs('constant')
  assert all(v == pytest.approx(PEAK, rel=1e-6) for v in lr[10:])


def test_wsd_is_flat_through_the_stable_phase_then_reaches_min_lr_at_the_last_update():
  lr = lrs('wsd', decay_fraction=0.2)  # the last 20 of 100 updates decay
  assert all(v == pytest.approx(PEAK, rel=1e-6) for v in lr[10:80])
  assert lr[80] < PEAK
  for k in (80, 85, 90):
    assert lr[k] == pytest.approx(PEAK + (END - PEAK) * (k - 79) / 20, rel=1e-5)
  assert lr[99] == pytest.approx(END, rel=1e-6)
  assert all(a > b for a, b in zip(lr[79:], lr[80:]))


def test_wsd_rounds_its_decay_to_whole_updates_and_keeps_at_least_one():
  lr = lrs('wsd', steps=10, warmup=2, decay_fraction=0.04)  # 0.4 updates -> 1
  assert lr[2:9] == pytest.approx([PEAK] * 7, rel=1e-6)
  assert lr[9] == pytest.approx(END, rel=1e-6)


def test_no_warmup_starts_at_the_peak():
  for schedule in ('linear', 'constant', 'wsd'):
    assert lrs(schedule, warmup=0)[0] == pytest.approx(PEAK, rel=1e-6), schedule


def test_linear_with_a_warmup_as_long_as_the_run_ends_at_the_peak():
  lr = lrs('linear', steps=5, warmup=5)
  assert lr == pytest.approx([PEAK * k / 5 for k in range(5)], rel=1e-6)


def error(c):
  with pytest.raises(ConfigError) as e:
    config.validate(c, 8)
  return e.value


@pytest.mark.parametrize('schedule', train_checks.LR_SCHEDULES)
def test_every_schedule_validates(schedule):
  config.validate(train_cfg(schedule), 8)


def test_unknown_schedule_names_the_choices():
  e = error(train_cfg('step'))
  assert e.key == 'train.lr_schedule'
  assert "'step'" in e.message and 'cosine, linear, constant, wsd' in e.message


@pytest.mark.parametrize('fraction', [0, -0.1, 1.5])
def test_decay_fraction_must_be_in_zero_one(fraction):
  e = error(train_cfg('wsd', decay_fraction=fraction))
  assert e.key == 'train.decay_fraction' and '(0, 1]' in e.message


def test_wsd_decay_may_not_reach_into_the_warmup():
  e = error(train_cfg('wsd', steps=100, warmup=60, decay_fraction=0.4))
  assert e.key == 'train.decay_fraction'
  assert 'last 40 of train.steps=100' in e.message and 'warmup_steps=60' in e.message
  config.validate(train_cfg('wsd', steps=100, warmup=59, decay_fraction=0.4), 8)
