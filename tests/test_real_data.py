"""From a folder of text to training, as a user runs it: a BPE tokenizer trained here
(python -m triax tokenizer), token shards (python -m triax prepare) of text files and a
.jsonl written here, then python -m triax train on them under several (data, tensor,
pipe) layouts: the same losses as one device, the same after a SIGKILL and a resume,
and every window once per epoch.
"""

import json
import os
import random

import harness
import pytest
from test_reliability import (
  assert_each_window_once_per_epoch,
  assert_same_losses,
  intact_steps,
  kill_when,
  losses,
  sample_ids,
  start_train,
)

from triax.data import prepare, sources
from triax.data import tokenizer as tokenizer_lib
from triax.data.batches import BatchStream

WORDS = (
  'the a model trains on tokens while pipelines move activations across stages and '
  'gradients flow back through every layer of the network'
).split()
STEPS = 40  # ~2.6 epochs of the ~120 training windows


def write_corpus(root):
  rng = random.Random(0)
  root.mkdir()
  for i in range(30):
    (root / f'page{i:02d}.txt').write_text(
      ' '.join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))
    )
  with open(root / 'notes.jsonl', 'w') as f:
    for _ in range(150):
      text = ' '.join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
      f.write(json.dumps({'text': text, 'source': 'notes'}) + '\n')


def run_ok(module, *args, env=None):
  result = harness.run_cli(module, *args, env_extra=env)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


@pytest.fixture(scope='module')
def prepared(tmp_path_factory, compile_cache):
  root = tmp_path_factory.mktemp('real')
  write_corpus(root / 'corpus')
  tok = str(root / 'tokenizer.json')
  run_ok(
    'triax.cli.tokenizer', 'train', f'--input={root / "corpus"}', '--vocab_size=400', f'--out={tok}'
  )
  out = str(root / 'tokens')
  args = [f'--input={root / "corpus"}', f'--out={out}', f'--tokenizer={tok}', '--val_fraction=0.1']
  first = run_ok('triax.cli.prepare', *args, '--progress=false')
  assert 'wrote' in first.stdout
  again = run_ok('triax.cli.prepare', *args, '--progress=false')
  assert 'up to date' in again.stdout
  flags = [
    '--config.data.source=tokens',
    f'--config.data.path={out}',
    f'--config.data.tokenizer={tok}',
    # The tokenizer's ids (<= 400) padded to a multiple of tensor (<= 4) x 128; the
    # padding is said (the data check asks for it) and masked out of the loss.
    '--config.model.vocab_size=512',
    f'--config.model.vocab_used={tokenizer_lib.load(tok).vocab_size}',
    f'--config.train.steps={STEPS}',
    '--config.checkpoint.every_steps=5',
    '--config.train.eval_every=10',
    '--config.train.record_sample_ids=true',
  ]
  # The reference: one device, no pipeline.
  reference = str(root / 'one_device')
  one = [
    '--cpu_devices=1',
    '--config.mesh.data=1',
    '--config.mesh.tensor=1',
    '--config.mesh.pipe=1',
    '--config.pipeline.schedule=1f1b',
    '--config.pipeline.virtual_stages=1',
    '--config.pipeline.microbatches=1',
  ]
  result = run_ok(
    'triax.cli.train',
    '--config=experiments/gpt_tiny.py:smoke',
    f'--workdir={reference}',
    '--progress=false',
    *flags,
    *one,
    env=compile_cache,
  )
  description = [l for l in result.stdout.splitlines() if l.startswith('data: ')]
  assert len(description) == 1, result.stdout
  return root, out, flags, reference, description[0], compile_cache


def test_the_data_line_says_what_is_trained_on(prepared):
  _, out, _, _, line, _ = prepared
  m = prepare.read_manifest(out)['splits']
  assert f'data: tokens {out} (huggingface tokenizer (' in line
  assert f'{m["train"]["tokens"]:,} train tokens in {m["train"]["documents"]:,} documents' in line
  assert f'{STEPS} steps x 8 = ' in line and ' epochs' in line
  used = tokenizer_lib.load(os.path.join(os.path.dirname(out), 'tokenizer.json')).vocab_size
  assert f'model.vocab_size=512 pads {512 - used} ids past the tokenizer, masked out' in line


def test_layouts_match_one_device_through_a_kill_and_resume(prepared):
  root, _, flags, reference, _, env = prepared
  want = losses(reference)
  tok = os.path.join(root, 'tokenizer.json')
  split = sources.open_tokens(prepared[1], tok, 512, 1, tokenizer_lib.load(tok).vocab_size)
  windows = BatchStream(split.train, 32, 8, 0).num_windows

  # data 1 x tensor 4 x pipe 2, 1F1B over 2 micro-batches, uninterrupted (beside the other).
  other = str(root / 'd1t4p2')
  layout = [
    '--config.mesh.data=1',
    '--config.mesh.tensor=4',
    '--config.mesh.pipe=2',
    '--config.pipeline.schedule=1f1b',
    '--config.pipeline.virtual_stages=1',
    '--config.pipeline.microbatches=2',
  ]
  beside = start_train(other, flags + layout, str(root / 'd1t4p2'), env)

  # data 2 x tensor 2 x pipe 2, interleaved 1F1B (the smoke config): SIGKILLed after
  # checkpoint 10 is complete, then the same command resumes it.
  workdir = str(root / 'd2t2p2')
  proc = start_train(workdir, flags, str(root / 'd2t2p2-run1'), env)
  kill_when(proc, lambda: os.path.isdir(os.path.join(workdir, 'checkpoints')) and any(
    s >= 10 for s in intact_steps(workdir)))  # fmt: skip
  resumed_from = intact_steps(workdir)[-1]
  assert resumed_from < STEPS
  proc = start_train(workdir, flags, str(root / 'd2t2p2-run2'), env)
  assert proc.wait(timeout=600) == 0, open(str(root / 'd2t2p2-run2.err')).read()[-3000:]
  assert f'resuming from checkpoint {resumed_from}' in open(str(root / 'd2t2p2-run2.out')).read()
  assert beside.wait(timeout=600) == 0, open(str(root / 'd1t4p2.err')).read()[-3000:]

  for run in (workdir, other):
    worst = assert_same_losses(losses(run), want, tol=2e-5)
    print(f'{os.path.basename(run)}: max |loss - one device| = {worst:.3g}')
    assert sample_ids(run) == sample_ids(reference)
  assert_each_window_once_per_epoch(sample_ids(reference), windows)
  assert STEPS * 8 >= 2 * windows  # two whole epochs were checked
