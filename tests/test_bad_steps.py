"""Bad steps: a spiking batch and a non-finite step roll the run back and are skipped.

Faults are injected around the real loop (training/loop.py): a data stream
that serves garbage at chosen batch positions (a loss spike, as a corrupt
shard would give), and a step whose loss and gradient norm read NaN when it
is fed an all-zero batch (a device fault: no real batch makes this model
non-finite). Each run is compared with a reference whose data stream simply
leaves the skipped positions out: the rolled-back run must train exactly as
that one, across a SIGTERM and a resume too.
"""

import json
import os
import signal

import harness
import jax.numpy as jnp
import numpy as np
import pytest
from test_reliability import intact_steps, read_jsonl, write_corpus

from triax import config as config_lib
from triax.compiled import stats as stats_lib
from triax.errors import ConfigError
from triax.training import bad_steps, loop


class Stream:
  """A BatchStream that serves `poison(batch)` at positions `bad` and reads position
  p + (number of `leave_out` positions <= it); it may SIGTERM the run when it reads
  position `stop_at` the first time."""

  def __init__(self, stream, bad=(), poison=None, leave_out=(), stop_at=None):
    self.stream, self.bad, self.poison = stream, set(bad), poison
    self.leave_out, self.stop_at = sorted(leave_out), stop_at

  def __getattr__(self, name):
    return getattr(self.stream, name)

  def _at(self, p):
    return bad_steps.position(p + 1, self.leave_out)

  def batch(self, p, rows=None):
    if p == self.stop_at:
      self.stop_at = None
      os.kill(os.getpid(), signal.SIGTERM)  # the loop stops after the step in flight
    batch = self.stream.batch(self._at(p), rows)
    return self.poison(batch) if self._at(p) in self.bad else batch

  def sample_ids(self, p):
    return self.stream.sample_ids(self._at(p))


def random_tokens(batch):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, batch['inputs'].shape, dtype=np.int32)
  return {**batch, 'inputs': tokens, 'targets': np.roll(tokens, 1, axis=1)}


def zeros(batch):
  return {**batch, 'inputs': np.zeros_like(batch['inputs'])}


def nan_on_zero_batch(monkeypatch):
  """The compiled step reports NaN loss and gradient norm for an all-zero batch."""
  compile_all = stats_lib.all_compile_stats

  def wrapped(trainer, compiler_options=None):
    compiled, compiled_eval, stats = compile_all(trainer, compiler_options)

    def step(state, batch):
      state, out = compiled(state, batch)
      bad = jnp.all(batch['inputs'] == 0)
      poisoned = {k: jnp.where(bad, jnp.nan, out[k]) for k in ('loss', 'grad_norm')}
      return state, {**out, **poisoned}

    return step, compiled_eval, stats

  monkeypatch.setattr(stats_lib, 'all_compile_stats', wrapped)


def config(tmp_path, **overrides):
  corpus = write_corpus(tmp_path / 'corpus.txt', size=20000)
  return harness.text_run_config(
    corpus,
    **{
      'train.steps': 16,
      'checkpoint.every_steps': 4,
      'train.record_sample_ids': True,
      **overrides,
    },
  )


def run(monkeypatch, cfg, workdir, **stream):
  load = loop.load_data

  def load_data(c):
    data = load(c)
    data.train = Stream(data.train, **stream)
    return data

  monkeypatch.setattr(loop, 'load_data', load_data)
  try:
    return loop.train_and_evaluate(cfg, workdir, progress=False)
  finally:
    monkeypatch.setattr(loop, 'load_data', load)


def step_losses(workdir):
  return {
    r['step']: r['loss']
    for r in read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
    if 'loss' in r and not r.get('spike_loss') and not r.get('skipped_nonfinite')
  }


def assert_trains_as(workdir, reference):
  got, want = step_losses(workdir), step_losses(reference)
  assert sorted(got) == list(range(1, 17)) and got.keys() == want.keys()
  worst = max(abs(got[s] - want[s]) for s in want)
  assert worst <= 1e-6, worst
  ids = lambda w: {r['step']: r['sample_ids'] for r in read_jsonl(os.path.join(w, 'samples.jsonl'))}
  assert ids(workdir) == ids(reference)
  return worst


@pytest.fixture(scope='module')
def spike_reference(tmp_path_factory):
  """A clean run that never reads positions 11 and 12."""
  root = tmp_path_factory.mktemp('reference')
  mp = pytest.MonkeyPatch()
  try:
    run(mp, config(root), str(root / 'run'), leave_out=(11, 12))
  finally:
    mp.undo()
  return str(root / 'run')


@pytest.mark.fast
def test_position_skips_the_skipped_positions_in_order():
  assert [bad_steps.position(s, []) for s in (1, 2, 3)] == [0, 1, 2]
  assert [bad_steps.position(s, [1, 2]) for s in (1, 2, 3, 4)] == [0, 3, 4, 5]
  assert [bad_steps.position(s, [3, 0]) for s in (1, 2, 3, 4)] == [1, 2, 4, 5]


def test_spiking_batches_roll_back_and_are_skipped_across_a_resume(
  tmp_path, monkeypatch, spike_reference, capfd
):
  spikes = {'train.spike_rollback': 2, 'train.spike_window': 3, 'train.spike_threshold': 1.5}
  cfg = config(tmp_path, **spikes)
  workdir = str(tmp_path / 'run')
  # Steps 12 and 13 read garbage and spike (step 12's save waits: it may be rolled back);
  # the run goes back to checkpoint 8, skips positions 11 and 12, and is stopped by
  # SIGTERM after step 13, which now reads position 14.
  with pytest.raises(SystemExit) as stopped:
    run(monkeypatch, cfg, workdir, bad=(11, 12), poison=random_tokens, stop_at=14)
  assert stopped.value.code in (0, None)
  assert 'rolled back: steps [12, 13]' in capfd.readouterr().err
  (record,) = bad_steps.read_rollbacks(workdir)
  assert record['bad_steps'] == [12, 13] and record['skipped_batches'] == [11, 12]
  # 12 is the step run again after the rollback; its first run's save waited.
  assert record['restored_step'] == 8 and intact_steps(workdir) == [4, 8, 12, 13]
  assert not os.path.exists(os.path.join(workdir, 'checkpoints_rolled_back'))
  # The same call resumes: the checkpoint's progress says which positions to skip.
  summary = run(monkeypatch, cfg, workdir, bad=(11, 12), poison=random_tokens)
  assert summary['skipped_batches'] == [11, 12] and summary['start_step'] == 13
  worst = assert_trains_as(workdir, spike_reference)
  spikes = [r for r in read_jsonl(os.path.join(workdir, 'metrics.jsonl')) if r.get('spike_loss')]
  assert spikes == []  # cut back with the steps they were logged at
  print(f'spike rollback + resume vs a run without those batches: max |loss diff| {worst:.3g}')


def test_nonfinite_step_without_skipping_rolls_back_at_once(tmp_path, monkeypatch):
  nan_on_zero_batch(monkeypatch)
  cfg = config(tmp_path, **{'train.spike_rollback': 3})
  workdir = str(tmp_path / 'run')
  summary = run(monkeypatch, cfg, workdir, bad=(5,), poison=zeros)
  # Step 6's state is NaN (no skipping): waiting for 3 bad steps would save nothing good.
  (record,) = summary['rollbacks']
  assert record['bad_steps'] == [6] and record['skipped_batches'] == [5]
  assert record['restored_step'] == 4
  assert intact_steps(workdir) == [4, 8, 12, 16]
  reference = str(tmp_path / 'reference')
  run(monkeypatch, config(tmp_path), reference, leave_out=(5,))
  assert_trains_as(workdir, reference)
  with open(os.path.join(workdir, 'rollbacks.jsonl')) as f:
    assert [json.loads(line)['bad_steps'] for line in f] == [[6]]


def test_skipped_nonfinite_steps_count_toward_a_rollback(tmp_path, monkeypatch):
  nan_on_zero_batch(monkeypatch)
  cfg = config(
    tmp_path, **{'train.spike_rollback': 2, 'train.skip_nonfinite_steps': 5, 'train.steps': 12}
  )
  workdir = str(tmp_path / 'run')
  summary = run(monkeypatch, cfg, workdir, bad=(6, 7), poison=zeros)
  assert summary['skipped_nonfinite'] == [7, 8]
  assert [r['bad_steps'] for r in summary['rollbacks']] == [[7, 8]]
  assert summary['skipped_batches'] == [6, 7]
  assert summary['rollbacks'][0]['restored_step'] == 4


def test_a_run_that_stays_bad_stops_after_the_rollback_budget(tmp_path, monkeypatch):
  nan_on_zero_batch(monkeypatch)
  cfg = config(tmp_path, **{'train.spike_rollback': 1, 'train.spike_max_rollbacks': 2})
  workdir = str(tmp_path / 'run')
  with pytest.raises(loop.NonFiniteError) as error:
    run(monkeypatch, cfg, workdir, bad=range(5, 100), poison=zeros)
  assert 'after 2 rollbacks' in str(error.value) and error.value.step == 6
  assert len(bad_steps.read_rollbacks(workdir)) == 2


@pytest.mark.fast
@pytest.mark.parametrize(
  'key, value',
  [
    ('train.spike_rollback', -1),
    ('train.spike_threshold', 1.0),
    ('train.spike_window', 0),
    ('train.spike_max_rollbacks', 0),
  ],
)
def test_bad_spike_settings_are_config_errors(key, value):
  cfg = config_lib.from_file(os.path.join(harness.ROOT, 'experiments', 'gpt_tiny.py'), 'smoke')
  group, name = key.split('.')
  cfg[group][name] = value
  with pytest.raises(ConfigError) as error:
    config_lib.validate(cfg, 8)
  assert error.value.key == key


@pytest.mark.fast
def test_a_bad_spike_setting_is_one_error_line(tmp_path):
  # How train says any of them (the checks themselves: the test above, in-process).
  workdir = tmp_path / 'run'
  result = harness.run_cli(
    'triax.cli.train',
    f'--config={harness.SMOKE}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--config.train.spike_threshold=1.0',
  )
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and lines[0].startswith('error: train.spike_threshold: '), result.stderr
  assert not workdir.exists()
