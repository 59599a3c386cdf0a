"""The training command line end to end, and its answers to bad input."""

import json
import os

import pytest

import harness

SMOKE = 'experiments/gpt_tiny.py:smoke'


def _train(workdir, *flags):
  return harness.run_cli('triax.train', f'--config={SMOKE}', f'--workdir={workdir}',
                         '--cpu_devices=8', '--progress=false', *flags)


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
  assert steps == [1, 2, 3, 4, 5, 6]   # resumed at 5, nothing repeated or lost


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


def _too_little_text(tmp_path):
  path = tmp_path / 'tiny.txt'
  path.write_text('hello world\n')
  return ['--config.data.source=text', f'--config.data.path={path}']


BAD_INPUT = [
    # (id, flags, key expected in the message)
    ('mesh-product', ['--config.mesh.data=3', '--config.mesh.tensor=1', '--config.mesh.pipe=1'],
     'mesh'),
    ('heads-vs-tensor', ['--config.mesh.data=1', '--config.mesh.tensor=8',
                         '--config.mesh.pipe=1', '--config.model.num_heads=4'],
     'model.num_heads'),
    ('d_ff-vs-tensor', ['--config.model.d_ff=65'], 'model.d_ff'),
    ('batch-vs-data', ['--config.train.global_batch_size=12'], 'train.global_batch_size'),
    ('non-positive-layers', ['--config.model.num_layers=0'], 'model.num_layers'),
    ('non-positive-steps', ['--config.train.steps=-1'], 'train.steps'),
    ('unknown-key', ['--config.model.num_layer=4'], '--config.model.num_layer'),
    ('missing-data-path', ['--config.data.source=text', '--config.data.path=/no/such/file'],
     'data.path'),
    ('too-little-text', _too_little_text, 'data.path'),
    ('layers-vs-chunks', ['--config.model.num_layers=6'], 'model.num_layers'),
    ('interleaved-microbatches', ['--config.pipeline.microbatches=3',
                                  '--config.train.global_batch_size=12'],
     'pipeline.microbatches'),
    ('unknown-schedule', ['--config.pipeline.schedule=zigzag'], 'pipeline.schedule'),
]


@pytest.mark.parametrize('flags,key', [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_exits_2_naming_the_key(tmp_path, flags, key):
  if callable(flags):
    flags = flags(tmp_path)
  workdir = tmp_path / 'w'
  result = _train(str(workdir), *flags)
  assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
  lines = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and key in lines[0], result.stderr[-2000:]
  assert not workdir.exists()   # nothing written before the input was checked
