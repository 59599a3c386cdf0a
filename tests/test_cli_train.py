"""The training command line end to end (its answers to bad input: test_bad_input.py)."""

import json
import os

import harness

SMOKE = 'experiments/gpt_tiny.py:smoke'


def _train(workdir, *flags):
  return harness.run_cli(
    'triax.train',
    f'--config={SMOKE}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    *flags,
  )


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_train_writes_metrics_checkpoints_and_resumes(tmp_path):
  workdir = str(tmp_path / 'run')
  first = _train(workdir)
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

  second = _train(workdir, '--config.train.steps=6')
  assert second.returncode == 0, second.stderr
  steps = [r['step'] for r in _records(workdir) if 'loss' in r]
  assert steps == [1, 2, 3, 4, 5, 6]  # resumed at 5, nothing repeated or lost


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
  for key in ('temp_bytes', 'argument_bytes', 'output_bytes', 'flops'):
    assert stats[key] > 0, key
  assert stats['schedule']['name'] == 'interleaved_1f1b'
  assert not os.path.exists(os.path.join(workdir, 'metrics.jsonl'))


# Bad input (config values, keys, flags, files, checkpoints): tests/test_bad_input.py.
