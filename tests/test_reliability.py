"""Checkpoints across layouts, crash and resume, damaged checkpoints, NaN steps, data accounting.

The crash test kills real `python -m triax train` processes (SIGKILL) during
steps and during an asynchronous save (the save of step 8 is under way, so
step 4 is the previous checkpoint, and it restores), damages a checkpoint
(flipped bytes: an error, then `--restore_fallback`), and checks the resumed
run against an uninterrupted one: same losses, same samples, each window
once per epoch. Bad steps and rollbacks: tests/test_bad_steps.py.
"""

import json
import os
import random
import shutil
import signal
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Also imported from here by the other run tests (their home is harness.py).
from harness import SMOKE, cli_env, start_train, write_corpus  # noqa: F401

from triax.errors import ConfigError
from triax.training import checkpoint as ckpt_lib
from triax.training import workdir as workdir_lib
from triax.training.checkpoint import Checkpointer

# ---------------------------------------------------------------- helpers


def kill_when(proc, condition, timeout=300):
  """SIGKILLs `proc` as soon as `condition()` holds (polled every 2 ms)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      return
    assert proc.poll() is None, f'finished (status {proc.returncode}) before the kill point'
    time.sleep(0.002)
  proc.kill()
  raise AssertionError('kill point never reached')


def read_jsonl(path):
  """Strict JSON lines (NaN/Infinity are not JSON and fail here)."""

  def reject(name):
    raise ValueError(f'{path}: non-JSON constant {name}')

  with open(path) as f:
    return [json.loads(line, parse_constant=reject) for line in f if line.strip()]


def losses(workdir):
  return {
    (r['step'], 'loss' if 'loss' in r else 'eval_loss'): r.get('loss', r.get('eval_loss'))
    for r in read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  }


def sample_ids(workdir):
  return {r['step']: r['sample_ids'] for r in read_jsonl(os.path.join(workdir, 'samples.jsonl'))}


def assert_same_losses(got, want, tol=1e-6):
  assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
  worst = max(abs(got[k] - want[k]) for k in want)
  assert worst <= tol, worst
  return worst


def assert_each_window_once_per_epoch(ids_by_step, num_windows):
  flat = [i for step in sorted(ids_by_step) for i in ids_by_step[step]]
  assert sorted(ids_by_step) == list(range(1, len(ids_by_step) + 1))
  for start in range(0, len(flat), num_windows):
    epoch = flat[start : start + num_windows]
    assert len(set(epoch)) == len(epoch), 'a window repeats within an epoch'
    if len(epoch) == num_windows:
      assert sorted(epoch) == list(range(num_windows))


def intact_steps(workdir):
  directory = os.path.join(workdir, 'checkpoints')
  return sorted(
    int(n)
    for n in os.listdir(directory)
    if n.isdigit() and os.path.exists(os.path.join(directory, n, workdir_lib.MANIFEST))
  )


def largest_file(directory):
  files = [os.path.join(root, n) for root, _, names in os.walk(directory) for n in names]
  return max(files, key=os.path.getsize)


def truncate_half(path):
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)


def flip_bytes(path, count=16):
  """Inverts `count` bytes in the middle of a file; its size stays the same."""
  with open(path, 'r+b') as f:
    f.seek(os.path.getsize(path) // 2)
    data = f.read(count)
    f.seek(-len(data), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in data))


# ---------------------------------------------- canonical checkpoints (in-process)


def _layout(data, tensor, pipe, schedule='1f1b', v=1, m=1):
  return harness.tiny_config(
    **{
      'mesh.data': data,
      'mesh.tensor': tensor,
      'mesh.pipe': pipe,
      'pipeline.schedule': schedule,
      'pipeline.virtual_stages': v,
      'pipeline.microbatches': m,
    }
  )


def _put(trainer, batch):
  return jax.device_put(batch, trainer.batch_sharding)


def test_checkpoint_restores_under_other_layouts(tmp_path):
  source = harness.make_trainer(_layout(2, 2, 2, 'interleaved_1f1b', v=2, m=2))
  batches = [harness.random_batch(source.cfg, seed=i) for i in range(4)]
  state = harness.initial_state(source, 0)
  with jax.set_mesh(source.mesh):
    for batch in batches[:3]:
      state, _ = source.train_step(state, _put(source, batch))
    saver = Checkpointer(str(tmp_path), source.cfg)
    saver.save(source, state)
    saver.close()
    want = jax.device_get(source.to_canonical(state))
    _, out = source.train_step(state, _put(source, batches[3]))
    want_loss = float(out['loss'])

  for cfg in (
    _layout(1, 1, 1),
    _layout(1, 2, 4, '1f1b', m=4),
    _layout(4, 2, 1),
    _layout(1, 1, 8, '1f1b', m=8),
  ):
    trainer = harness.make_trainer(cfg)
    with jax.set_mesh(trainer.mesh):
      restored = Checkpointer(str(tmp_path), trainer.cfg).restore(trainer)
      got = jax.device_get(trainer.to_canonical(restored))
      _, out = trainer.train_step(restored, _put(trainer, batches[3]))
    assert int(got.step) == 3
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), want, got))
    assert max(diffs) == 0.0  # restoring moves data; it computes nothing
    assert abs(float(out['loss']) - want_loss) <= 1e-6, (cfg.mesh, float(out['loss']), want_loss)
    print(
      f'restored on mesh {tuple(trainer.cfg.mesh[a] for a in ("data", "tensor", "pipe"))}: '
      f'state diff {max(diffs)}, next-step loss diff {abs(float(out["loss"]) - want_loss):.3g}'
    )


# ------------------------------------------------ damaged checkpoints (in-process)


@pytest.fixture(scope='module')
def small_trainer():
  return harness.make_trainer(_layout(1, 1, 1))


def _save_steps(trainer, workdir, steps, keep=3):
  cfg = trainer.cfg.copy_and_resolve_references()
  cfg.checkpoint.keep = keep
  with jax.set_mesh(trainer.mesh):
    state = trainer.init_state(jax.random.key(0))
    saver = Checkpointer(workdir, cfg)
    for step in steps:
      saver.save(trainer, state.replace(step=jnp.asarray(step, jnp.int32)))
    saver.close()
  return cfg


@pytest.mark.parametrize('damage', ['truncated', 'partly-deleted', 'flipped'])
def test_damaged_latest_checkpoint_falls_back_to_previous(tmp_path, small_trainer, damage, caplog):
  workdir = str(tmp_path)
  cfg = _save_steps(small_trainer, workdir, [2, 4, 6])
  latest = os.path.join(workdir, 'checkpoints', '6')
  shard = largest_file(os.path.join(latest, 'state'))
  if damage == 'truncated':
    truncate_half(shard)
  elif damage == 'flipped':
    flip_bytes(shard)  # the size is right: only the checksum sees it
  else:
    shutil.rmtree(os.path.join(latest, 'state', 'd'))

  with jax.set_mesh(small_trainer.mesh):
    # Without the fallback, damage is an error naming the step and the file.
    with pytest.raises(ConfigError) as error:
      Checkpointer(workdir, cfg).restore(small_trainer)
    assert error.value.key == '--workdir' and 'checkpoint 6 is damaged' in error.value.message
    if damage != 'partly-deleted':
      assert shard in error.value.message, error.value.message
    assert '--restore_fallback' in error.value.message and '\n' not in error.value.message
    ckpt = Checkpointer(workdir, cfg, restore_fallback=True)
    assert ckpt.latest_step() == (6 if damage == 'flipped' else 4)  # sizes only: cheap
    restored = ckpt.restore(small_trainer)
    assert int(restored.step) == 4 and [s for s, _ in ckpt.damaged] == [6]
    warnings = [r.getMessage() for r in caplog.records if 'damaged checkpoint' in r.getMessage()]
    assert len(warnings) == 1 and latest in warnings[0] and latest[:-1] + '4' in warnings[0]
    assert '\n' not in warnings[0]
    ckpt.prepare_to_write()  # moves the damaged step aside so step 6 can be written again
    assert os.path.isdir(os.path.join(workdir, workdir_lib.DAMAGED, '6'))
    ckpt.save(small_trainer, restored.replace(step=jnp.asarray(6, jnp.int32)))
    ckpt.close()
    again = Checkpointer(workdir, cfg)
    assert int(again.restore(small_trainer).step) == 6 and again.damaged == []


def test_manifest_holds_a_checksum_of_every_file(tmp_path, small_trainer):
  workdir = str(tmp_path)
  _save_steps(small_trainer, workdir, [2])
  step = os.path.join(workdir, 'checkpoints', '2')
  with open(os.path.join(step, workdir_lib.MANIFEST)) as f:
    files = json.load(f)['files']
  assert files and any(rel.startswith('state' + os.sep) for rel in files)
  for rel, entry in files.items():
    path = os.path.join(step, rel)
    assert entry == {'bytes': os.path.getsize(path), 'crc32': ckpt_lib.crc32(path)}, rel


def test_fallback_with_no_intact_step_is_one_input_error(tmp_path, small_trainer):
  workdir = str(tmp_path)
  cfg = _save_steps(small_trainer, workdir, [2, 4])
  for step in ('2', '4'):
    flip_bytes(largest_file(os.path.join(workdir, 'checkpoints', step, 'state')))
  with jax.set_mesh(small_trainer.mesh), pytest.raises(ConfigError) as error:
    Checkpointer(workdir, cfg, restore_fallback=True).restore(small_trainer)
  assert error.value.key == '--workdir' and 'no intact checkpoint' in error.value.message
  assert '2: ' in error.value.message and '4: ' in error.value.message


def test_no_intact_checkpoint_is_an_input_error(tmp_path, small_trainer):
  workdir = str(tmp_path)
  cfg = _save_steps(small_trainer, workdir, [2])
  os.remove(os.path.join(workdir, 'checkpoints', '2', workdir_lib.MANIFEST))
  before = sorted(os.listdir(os.path.join(workdir, 'checkpoints', '2')))
  with jax.set_mesh(small_trainer.mesh), pytest.raises(ConfigError) as error:
    Checkpointer(workdir, cfg).restore(small_trainer)
  assert error.value.key == '--workdir' and 'no intact checkpoint' in error.value.message
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints', '2'))) == before


def test_retention_keeps_the_last_good_checkpoint_until_a_newer_one_is_intact(
  tmp_path, small_trainer
):
  workdir = str(tmp_path)
  cfg = _save_steps(small_trainer, workdir, [2], keep=1)
  directory = os.path.join(workdir, 'checkpoints')
  # A newer step that is damaged (say, a disk that lost part of it) must not
  # count as one of the `keep`, or retention would delete step 2, the last good one.
  shutil.copytree(os.path.join(directory, '2'), os.path.join(directory, '4'))
  truncate_half(largest_file(os.path.join(directory, '4', 'state')))
  with jax.set_mesh(small_trainer.mesh):
    ckpt = Checkpointer(workdir, cfg)
    state = small_trainer.init_state(jax.random.key(0))
    ckpt.save(small_trainer, state.replace(step=jnp.asarray(6, jnp.int32)))
    assert os.path.isdir(os.path.join(directory, '2'))  # 6 may still be in flight
    ckpt.wait()
    assert sorted(os.listdir(directory)) == ['6']  # 6 is intact: now 2 (and damaged 4) go
    ckpt.close()


def test_foreign_checkpoint_directory_is_refused(tmp_path, small_trainer):
  (tmp_path / 'checkpoints').mkdir()
  (tmp_path / 'checkpoints' / 'notes.txt').write_text('not a checkpoint')
  with pytest.raises(ConfigError) as error:
    Checkpointer(str(tmp_path), small_trainer.cfg)
  assert 'notes.txt' in error.value.message


# ---------------------------------------------------------------- non-finite steps

BLOW_UP = [
  '--config.train.learning_rate=1e30',
  '--config.train.grad_clip_norm=0',
  '--config.train.warmup_steps=0',
  '--config.checkpoint.every_steps=1',
]


def test_nonfinite_step_stops_with_one_line_and_is_not_saved(tmp_path, compile_cache):
  # Step 1 moves every weight by ~1e30; the gradient of step 2 is NaN.
  workdir = str(tmp_path / 'run')
  result = harness.run_cli(
    'triax.cli.train',
    f'--config={SMOKE}',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
    *BLOW_UP,
    env_extra=compile_cache,
  )
  assert result.returncode == 1, result.stderr[-3000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and errors[0].startswith('error: step 2:'), result.stderr[-3000:]
  assert 'skip_nonfinite_steps' in errors[0] and 'Traceback' not in result.stderr
  assert intact_steps(workdir) == [1]  # step 2's state was not saved
  read_jsonl(os.path.join(workdir, 'metrics.jsonl'))


def read_state(step_dir):
  """A checkpoint's train state as saved (nested dicts of arrays), without a trainer."""
  import orbax.checkpoint as ocp

  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
    return jax.device_get(
      reader.restore(step_dir, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']
    )


def test_skip_nonfinite_steps_keeps_the_state_then_stops(tmp_path):
  from triax.training import loop

  corpus = write_corpus(tmp_path / 'corpus.txt', size=20000)
  cfg = harness.text_run_config(
    corpus,
    **{
      'train.learning_rate': 1e30,
      'train.grad_clip_norm': 0.0,
      'train.steps': 4,
      'checkpoint.every_steps': 1,
      'train.skip_nonfinite_steps': 1,
    },
  )
  workdir = str(tmp_path / 'run')
  with pytest.raises(loop.NonFiniteError) as error:
    loop.train_and_evaluate(cfg, workdir, progress=False)
  assert error.value.step == 3  # step 2 was skipped, the second non-finite step stops
  records = read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  assert [r['step'] for r in records if r.get('skipped_nonfinite')] == [2]
  assert intact_steps(workdir) == [1, 2]
  # The skipped step left parameters and optimizer state as step 1 made them.
  step1, step2 = (read_state(os.path.join(workdir, 'checkpoints', s)) for s in ('1', '2'))
  assert int(step1['step']) == 1 and int(step2['step']) == 2
  jax.tree.map(np.testing.assert_array_equal, step2['params'], step1['params'])
  jax.tree.map(np.testing.assert_array_equal, step2['opt_state'], step1['opt_state'])
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(step2['params']))


# ------------------------------------------ crash, resume, damage, data accounting


@pytest.fixture(scope='module')
def crash_setup(tmp_path_factory, smoke_text_run):
  """The flags of a 24-step run over ~1.15 epochs of a small text, and its uninterrupted
  result (conftest.py: one run for every test file that replays it)."""
  run = smoke_text_run
  root = tmp_path_factory.mktemp('crash')
  return root, run['flags'], run['workdir'], run['windows'], run['env']


def test_sigkill_anywhere_then_resume_gives_the_same_run(crash_setup):
  root, flags, reference, windows, env = crash_setup
  workdir = str(root / 'crashed')
  directory = os.path.join(workdir, 'checkpoints')

  # 1. Killed during the asynchronous save of step 8: its directory exists, unfinished.
  def saving_8():
    return os.path.isdir(directory) and any(
      (m := ckpt_lib._UNFINISHED.match(n)) and m.group(1) == '8' for n in os.listdir(directory)
    )

  kill_when(start_train(workdir, flags, str(root / 'run1'), env), saving_8)
  assert not os.path.exists(os.path.join(directory, '8')), 'the save finished before the kill'
  assert intact_steps(workdir) == [4]

  # 2. The same command resumes from 4; killed at a seeded-random step, between saves.
  kill_step = random.Random(6).choice([13, 14, 15, 17, 18, 19])

  def reached():
    try:
      return any(
        r.get('step', 0) >= kill_step and 'loss' in r
        for r in read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
      )
    except (OSError, ValueError):
      return False  # absent, or a line being written

  kill_when(start_train(workdir, flags, str(root / 'run2'), env), reached)
  assert intact_steps(workdir)[-1] >= 12

  # 3. The latest checkpoint damaged too (bytes flipped, sizes kept): the same command
  #    stops with one error line naming the file and the step, and exit 2; with
  #    --restore_fallback it warns once, naming it and the one before, resumes from
  #    that one and finishes.
  *_, previous, latest = intact_steps(workdir)
  shard = largest_file(os.path.join(directory, str(latest), 'state'))
  flip_bytes(shard)
  proc = start_train(workdir, flags, str(root / 'run3'), env)
  assert proc.wait(timeout=600) == 2, open(str(root / 'run3.err')).read()[-3000:]
  errors = [l for l in open(str(root / 'run3.err')).read().splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and f'checkpoint {latest} is damaged' in errors[0], errors
  assert shard in errors[0] and '--restore_fallback' in errors[0], errors
  proc = start_train(workdir, [*flags, '--restore_fallback'], str(root / 'run4'), env)
  assert proc.wait(timeout=600) == 0, open(str(root / 'run4.err')).read()[-3000:]
  warned = [
    l for l in open(str(root / 'run4.err')).read().splitlines() if 'damaged checkpoint' in l
  ]
  assert len(warned) == 1, warned
  assert all(os.path.join(directory, str(s)) in warned[0] for s in (latest, previous)), warned
  assert f'resumed at step {previous})' in open(str(root / 'run4.out')).read()
  assert os.path.isdir(os.path.join(workdir, workdir_lib.DAMAGED, str(latest)))
  assert intact_steps(workdir) == [16, 20, 24]

  worst = assert_same_losses(losses(workdir), losses(reference))
  print(
    f'crash/resume: max |loss - uninterrupted| = {worst:.3g} (killed mid-save of 8 and at '
    f'step >= {kill_step}; resumed from 4, then from {previous} past flipped {latest})'
  )
  assert sample_ids(workdir) == sample_ids(reference)
  assert_each_window_once_per_epoch(sample_ids(workdir), windows)


def test_no_pickle_in_checkpoints_or_metrics(crash_setup):
  reference = crash_setup[2]
  for root, _, names in os.walk(reference):
    for name in names:
      path = os.path.join(root, name)
      assert not name.endswith(('.pkl', '.pickle', '.npy', '.npz')), path
      with open(path, 'rb') as f:
        head = f.read(2)
      assert head not in (b'\x80\x02', b'\x80\x03', b'\x80\x04', b'\x80\x05'), path
  for name in ('metrics.jsonl', 'samples.jsonl'):
    assert read_jsonl(os.path.join(reference, name))  # strict JSON, every line
  with open(os.path.join(reference, 'config.json')) as f:
    json.load(f)
