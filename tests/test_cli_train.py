"""The training command line end to end (its answers to bad input: test_bad_input.py)."""

import json
import os
import shutil
from pathlib import Path

import harness
import pytest
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


@pytest.fixture(scope='module')
def first_run(tmp_path_factory, compile_cache):
  """The smoke config's 4 steps with W&B, on the suite's compile cache: (workdir, result).
  Tests copy the workdir before they write into it."""
  workdir = str(tmp_path_factory.mktemp('train') / 'run')
  result = _train(workdir, *WANDB, env_extra=compile_cache)
  assert result.returncode == 0, result.stderr
  return workdir, result


def _copy(first_run, tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(first_run[0], workdir)  # mtimes kept
  return workdir


def test_train_writes_metrics_checkpoints_and_resumes(first_run, tmp_path, compile_cache):
  workdir, first = first_run
  records = _records(workdir)
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == [1, 2, 3, 4]
  for key in ('loss', 'learning_rate', 'grad_norm', 'tokens_per_sec', 'step_time_s'):
    assert all(key in r for r in train), key
  assert [r['step'] for r in records if 'eval_loss' in r] == [0, 2, 4]
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['2', '4']
  assert any(name.startswith('events') for name in os.listdir(os.path.join(workdir, 'tb')))
  assert 'checkpoints' in first.stdout and 'metrics.jsonl' in first.stdout

  # Resumed by the workdir alone with an override: no --config and no --cpu_devices,
  # the workdir's config.json and devices.json say them (W&B's flags too). Under a
  # supervisor (elastic/heartbeat.py) each fetched step touches the heartbeat file.
  workdir = _copy(first_run, tmp_path)
  beat = str(tmp_path / 'heartbeat')
  second = harness.run_cli(
    'triax',
    'train',
    f'--workdir={workdir}',
    '--config.train.steps=6',
    '--progress=false',
    env_extra={**compile_cache, 'TRIAX_HEARTBEAT': beat},
  )
  assert second.returncode == 0, second.stderr[-3000:]
  assert os.path.getmtime(beat) >= os.path.getmtime(os.path.join(workdir, 'config.json'))
  assert not os.path.exists(os.path.join(workdir, 'heartbeat'))
  assert json.loads(_read(workdir, 'config.json'))['train']['steps'] == 6
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


def test_same_command_twice_gives_identical_losses(first_run, tmp_path):
  # The first run's command again, compiled afresh (no shared cache): two compiles
  # and two runs of the same command agree to the bit.
  workdir = str(tmp_path / 'again')
  result = _train(workdir, *WANDB)
  assert result.returncode == 0, result.stderr
  runs = [[r['loss'] for r in _records(w) if 'loss' in r] for w in (first_run[0], workdir)]
  assert len(runs[0]) == 4 and runs[0] == runs[1]


def test_compile_only_writes_stats_and_does_not_train(tmp_path, compile_cache):
  workdir = str(tmp_path / 'c')
  # The suite's compile cache: a cached executable's memory and cost analyses are XLA's.
  result = _train(workdir, '--compile_only', env_extra=compile_cache)
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


def _small_texts(folder, files=30):
  """`files` text files of ~8 kB of made-up words: about 26k BPE tokens in all."""
  import random

  rng = random.Random(0)
  letters = 'abcdefghijklmnopqrstuvwxyz'
  words = [''.join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]
  folder.mkdir()
  for i in range(files):
    lines = (' '.join(rng.choices(words, k=12)) + '.' for _ in range(60))
    (folder / f'doc{i:02d}.txt').write_text('\n'.join(lines) + '\n')


def test_own_text_recipe_on_30_small_files(tmp_path, compile_cache):
  # README's "Your own text", as written (2 steps): one validation document
  # of ~900 tokens holds 6 windows, not a batch of 32, and still evaluates.
  texts, tok, tokens = tmp_path / 'texts', tmp_path / 'tokenizer.json', tmp_path / 'tokens'
  _small_texts(texts)
  run = lambda *args: harness.run_cli('triax', *args, env_extra=compile_cache)  # noqa: E731
  made = run('tokenizer', 'train', f'--input={texts}', '--vocab_size=8192', f'--out={tok}')
  assert made.returncode == 0, made.stderr
  prepared = run('prepare', f'--input={texts}', f'--tokenizer={tok}', f'--out={tokens}')
  assert prepared.returncode == 0, prepared.stderr
  workdir = str(tmp_path / 'mine')
  trained = run(
    'train',
    '--config=experiments/gpt_tiny.py',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--config.data.source=tokens',
    f'--config.data.path={tokens}',
    f'--config.data.tokenizer={tok}',
    '--config.model.vocab_size=8192',
    '--config.train.steps=2',
    # gpt_tiny's data 2 x tensor 2 x pipe 2 with this 8192-id head has deadlocked
    # XLA:CPU's collectives under load here (a rendezvous abort in the first step,
    # not a data matter); the validation split does not depend on the mesh.
    '--config.mesh.data=4',
    '--config.mesh.tensor=1',
    '--progress=false',
  )
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert 'repeated to fill a batch of 32' in trained.stdout
  assert [r['step'] for r in _records(workdir) if 'eval_loss' in r] == [0, 2]


def _compiled(cache):
  """The programs a run compiled, named as their cache entries are ('jit_train_step', ...)."""
  return {name.split('-')[0] for name in os.listdir(cache)}


def _cache_env(cache):
  # Every program compiled is written to this cache: no minimum time or size.
  cache.mkdir()
  return {
    'JAX_COMPILATION_CACHE_DIR': str(cache),
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
  }


def test_rerun_of_a_finished_run_compiles_nothing_and_opens_no_tracker(
  first_run, tmp_path, compile_cache
):
  # Runs write their programs to the cache under these names (so an empty answer
  # below means nothing compiled, not a name that changed).
  assert {'jit_train_step', 'jit_eval_loss'} <= _compiled(
    Path(compile_cache['JAX_COMPILATION_CACHE_DIR'])
  )
  workdir = _copy(first_run, tmp_path)
  wandb_runs = sorted(os.listdir(os.path.join(workdir, 'wandb')))
  before = {name: os.stat(os.path.join(workdir, name)).st_mtime_ns for name in os.listdir(workdir)}
  again = _train(workdir, *WANDB, env_extra=_cache_env(tmp_path / 'again'))
  assert again.returncode == 0, again.stderr
  assert 'nothing to do: the checkpoint is at step 4 and train.steps=4' in again.stdout
  assert not {'jit_train_step', 'jit_eval_loss'} & _compiled(tmp_path / 'again')
  assert sorted(os.listdir(os.path.join(workdir, 'wandb'))) == wandb_runs
  after = {name: os.stat(os.path.join(workdir, name)).st_mtime_ns for name in os.listdir(workdir)}
  assert after == before  # config.json, compile_stats.json, metrics.jsonl: untouched
