"""The training command line end to end (its answers to bad input: test_bad_input.py)."""

import json
import os

import harness
import wandb_files

SMOKE = 'experiments/gpt_tiny.py:smoke'


def _train(workdir, *flags, env_extra=None):
  return harness.run_cli(
    'triax.cli.train',
    f'--config={SMOKE}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    *flags,
    env_extra=env_extra,
  )


# W&B in its offline mode: it writes DIR/wandb, nothing is sent.
WANDB = ('--config.train.wandb_project=triax-test', '--config.train.wandb_mode=offline')


def _read(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    return f.read()


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_train_writes_metrics_checkpoints_and_resumes(tmp_path):
  workdir = str(tmp_path / 'run')
  first = _train(workdir, *WANDB)
  assert first.returncode == 0, first.stderr
  records = _records(workdir)
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == [1, 2, 3, 4]
  for key in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec', 'step_time_s'):
    assert all(key in r for r in train), key
  assert [r['step'] for r in records if 'eval_loss' in r] == [0, 2, 4]
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['2', '4']
  assert any(name.startswith('events') for name in os.listdir(os.path.join(workdir, 'tb')))
  assert 'checkpoints' in first.stdout and 'metrics.jsonl' in first.stdout

  second = _train(workdir, '--config.train.steps=6', *WANDB)
  assert second.returncode == 0, second.stderr
  records = _records(workdir)
  steps = [r['step'] for r in records if 'loss' in r]
  assert steps == [1, 2, 3, 4, 5, 6]  # resumed at 5, nothing repeated or lost
  # W&B got the same numbers, in one run that the resumed process continued.
  history = wandb_files.history(workdir)
  assert {run_id for run_id, _, _ in history} == {_read(workdir, 'wandb_run_id').strip()}
  logged = [(step, row['loss']) for _, step, row in history if 'loss' in row]
  assert logged == [(r['step'], r['loss']) for r in records if 'loss' in r]
  evals = [(step, row['eval_loss']) for _, step, row in history if 'eval_loss' in row]
  assert evals == [(r['step'], r['eval_loss']) for r in records if 'eval_loss' in r]


def test_same_command_twice_gives_identical_losses(tmp_path):
  runs = []
  for name in ('a', 'b'):
    result = _train(str(tmp_path / name), '--config.checkpoint.every_steps=0')
    assert result.returncode == 0, result.stderr
    runs.append([r['loss'] for r in _records(str(tmp_path / name)) if 'loss' in r])
  assert runs[0] == runs[1]


def test_compile_only_writes_stats_and_does_not_train(tmp_path):
  workdir = str(tmp_path / 'c')
  result = _train(workdir, '--compile_only')
  assert result.returncode == 0, result.stderr
  with open(os.path.join(workdir, 'compile_stats.json')) as f:
    stats = json.load(f)
  for key in (
    'temp_bytes',
    'argument_bytes',
    'output_bytes',
    'flops',
    'param_bytes',
    'optimizer_bytes',
    'checkpoint_save_bytes',
    'checkpoint_restore_bytes',
    'eval_bytes',
  ):
    assert stats[key] > 0, key
  assert stats['schedule']['name'] == 'interleaved_1f1b'
  assert not os.path.exists(os.path.join(workdir, 'metrics.jsonl'))


# Bad input (config values, keys, flags, files, checkpoints): tests/test_bad_input.py.
