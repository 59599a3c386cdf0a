"""Hugging Face Llama checkpoints against the reference: transformers' LlamaForCausalLM.

A small Llama with random weights (grouped-query attention, Llama 3 RoPE
scaling) is written by transformers itself, in shards, then imported: triax
must give its logits (one device), its loss (pipelined and tensor-parallel
layouts restoring the imported checkpoint) and its greedy tokens; export ->
import -> export must be bit-identical and give back transformers' tensors.
Nothing is downloaded.
"""

import filecmp
import json
import os
import shutil
import zlib

import harness
import hf_round_trip
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax import config as config_lib  # noqa: E402
from triax.convert import hf_checkpoint, safetensors_files  # noqa: E402
from triax.data import tokenizer as tokenizer_lib  # noqa: E402
from triax.errors import ConfigError  # noqa: E402
from triax.model import generation  # noqa: E402
from triax.training import checkpoint as ckpt_lib  # noqa: E402
from triax.training import workdir as workdir_lib  # noqa: E402

SEQ = 32


def _hf_model(tie=False, vocab_size=256):
  cfg = transformers.LlamaConfig(
    vocab_size=vocab_size,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    # Wavelengths past 16 / low_freq_factor positions are slowed: a 32-token window sees it.
    rope_scaling={
      'rope_type': 'llama3',
      'factor': 8.0,
      'low_freq_factor': 1.0,
      'high_freq_factor': 4.0,
      'original_max_position_embeddings': 16,
    },
    tie_word_embeddings=tie,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  return hf_round_trip.random_model(transformers.LlamaForCausalLM, cfg)


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  model = _hf_model()
  return hf_round_trip.imported(model, tmp_path_factory)


def _tokens(batch=2):
  return np.random.default_rng(0).integers(0, 256, (batch, SEQ)).astype(np.int32)


def test_import_gives_transformers_logits(imported):
  model, _, workdir, result = imported
  cfg = result['config']
  assert (cfg.model.family, cfg.model.num_kv_heads, cfg.model.rope_scaling.factor) == (
    'llama',
    2,
    8.0,
  )
  hf_round_trip.check_logits(model, workdir, result, _tokens())


@pytest.mark.parametrize('layout', [(2, 2, 2), (1, 2, 4)])
def test_imported_checkpoint_gives_transformers_loss_on_parallel_layouts(imported, layout):
  model, _, workdir, _ = imported
  tokens = np.random.default_rng(1).integers(0, 256, (4, SEQ + 1)).astype(np.int32)
  hf_round_trip.check_eval_loss(model, workdir, tokens, *layout)


def test_greedy_generation_gives_transformers_tokens(imported):
  model, _, workdir, result = imported
  hf_round_trip.check_greedy(model, workdir, result['config'])


def test_export_import_export_is_bit_identical(imported, tmp_path):
  model, hf_dir, workdir, _ = imported
  first = str(tmp_path / 'first')
  hf_checkpoint.export_hf(workdir, first, max_shard_bytes=100_000)
  reference = {k: v.numpy() for k, v in model.state_dict().items()}
  hf_round_trip.check(first, reference, tmp_path, model, transformers.LlamaForCausalLM, _tokens())


def test_a_flipped_byte_in_the_params_stops_export_with_one_line(imported, tmp_path):
  """Export reads the checkpoint as a resume does: a flipped byte is one error
  line and exit 2, never a Hugging Face checkpoint of changed weights."""
  _, _, workdir, result = imported
  damaged = tmp_path / 'w'
  shutil.copytree(workdir, damaged)
  _, params = workdir_lib.restore_params(damaged, result['config'])
  shard = harness.flip_a_params_byte(damaged, 0, params)
  before = harness.file_bytes(damaged)
  out = tmp_path / 'hf'
  result = harness.run_cli(
    'triax.cli.convert', f'--workdir={damaged}', f'--hf_dir={out}', '--export'
  )
  assert result.returncode == 2 and result.stdout == ''
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith(f'error: --workdir: checkpoint 0 is damaged: {shard} '), line
  assert not out.exists() and harness.file_bytes(damaged) == before


def test_a_checkpoint_written_before_qkv_bias_existed_restores(imported, tmp_path):
  """Its model record has no 'qkv_bias' (registry.RECORD_DEFAULTS): the
  Llama of then, without biases, which this config still is."""
  _, _, workdir, result = imported
  old = str(tmp_path / 'old')
  shutil.copytree(workdir, old)
  step_dir = os.path.join(old, 'checkpoints', '0')
  path = os.path.join(step_dir, 'model', 'metadata')
  with open(path) as f:
    record = json.load(f)
  del record['qkv_bias']
  data = json.dumps(record).encode()
  with open(path, 'wb') as f:
    f.write(data)
  manifest = os.path.join(step_dir, workdir_lib.MANIFEST)
  with open(manifest) as f:
    entries = json.load(f)
  entries['files']['model/metadata'] = {'bytes': len(data), 'crc32': zlib.crc32(data)}
  with open(manifest, 'w') as f:
    json.dump(entries, f)
  cfg = result['config']
  state = ckpt_lib.Checkpointer(old, cfg).restore(harness.make_trainer(cfg))
  assert int(state.step) == 0


def test_export_of_a_gpt_run_points_to_the_llama_configs(tmp_path):
  # README's own-text recipe trains gpt_tiny; its export must say what to train instead.
  cfg = config_lib.from_file(os.path.join(harness.ROOT, 'experiments', 'gpt_tiny.py'), 'smoke')
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'config.json').write_text(cfg.to_json(indent=2))
  with pytest.raises(ConfigError, match='experiments/llama_tiny.py') as e:
    hf_checkpoint.export_hf(str(workdir), str(tmp_path / 'hf'))
  assert e.value.key == '--workdir'
  assert not (tmp_path / 'hf').exists()


def test_import_without_the_tokenizer_its_vocabulary_needs_is_refused(tmp_path):
  # 320 ids are no bytes: without its tokenizer, sampling would decode ids past 255.
  hf_dir, workdir = tmp_path / 'hf', str(tmp_path / 'w')
  _hf_model(vocab_size=320).save_pretrained(str(hf_dir))
  refused = harness.run_cli('triax', 'convert', f'--hf_dir={hf_dir}', f'--workdir={workdir}')
  assert refused.returncode == 2, refused.stderr[-3000:]
  [line] = refused.stderr.strip().splitlines()
  assert line.startswith('error: --tokenizer: the checkpoint has 320 token ids') and 'PATH' in line
  assert not os.path.exists(workdir)
  # The checkpoint's own tokenizer.json, beside its weights, is taken without the flag ...
  texts = (f'text number {i} of a few words' for i in range(200))
  tokenizer_lib.train_bpe(texts, 320, str(hf_dir / workdir_lib.TOKENIZER))
  hf_checkpoint.import_hf(str(hf_dir), workdir)
  assert filecmp.cmp(hf_dir / 'tokenizer.json', os.path.join(workdir, 'tokenizer.json'))
  # It is the run's tokenizer: a fine-tune on bytes is refused with the way to tokenize text.
  config_file = os.path.join(workdir, 'config.json')
  with open(config_file) as f:
    saved = json.load(f)
  assert saved['data']['tokenizer'] == os.path.join(workdir, 'tokenizer.json')
  fine_tune = harness.run_cli('triax', 'train', f'--workdir={workdir}')
  assert fine_tune.returncode == 2, fine_tune.stderr[-3000:]
  [line] = fine_tune.stderr.strip().splitlines()
  assert (
    line.startswith('error: data.tokenizer: data.source=stdlib reads bytes') and 'prepare' in line
  )
  # ... and export writes it back beside the weights, every file readable by all.
  out = tmp_path / 'out'
  hf_checkpoint.export_hf(workdir, str(out))
  assert filecmp.cmp(hf_dir / 'tokenizer.json', out / 'tokenizer.json')
  # (generation_config.json: save_pretrained wrote it, and the import kept it in hf_files/.)
  assert {name: (out / name).stat().st_mode & 0o777 for name in os.listdir(out)} == {
    'config.json': 0o644,
    'generation_config.json': 0o644,
    'model.safetensors': 0o644,
    'tokenizer.json': 0o644,
  }
  # A workdir imported before convert refused (no tokenizer.json): sample says so, no traceback.
  os.remove(os.path.join(workdir, 'tokenizer.json'))
  saved['data']['tokenizer'] = 'bytes'
  with open(config_file, 'w') as f:
    json.dump(saved, f)
  sampled = harness.run_cli('triax', 'sample', f'--workdir={workdir}', '--prompt=def ')
  assert sampled.returncode == 2, sampled.stderr[-3000:]
  [line] = sampled.stderr.strip().splitlines()
  assert line.startswith(f'error: --workdir: {workdir}: the model has 320 token ids')


def test_tied_embeddings_import_and_export(tmp_path):
  model = _hf_model(tie=True)
  hf_dir = str(tmp_path / 'hf')
  model.save_pretrained(hf_dir)
  workdir = str(tmp_path / 'w')
  result = hf_checkpoint.import_hf(hf_dir, workdir)
  assert result['config'].model.tie_embeddings
  _, params = workdir_lib.restore_params(workdir, result['config'])
  assert 'out' not in params['head']
  ours = generation.sampling_model(result['config']).logits(params, jnp.asarray(_tokens()))
  with torch.no_grad():
    theirs = model(torch.from_numpy(_tokens()).long()).logits.numpy()
  assert np.max(np.abs(np.asarray(ours) - theirs)) / np.max(np.abs(theirs)) <= 1e-4
  out = str(tmp_path / 'out')
  hf_checkpoint.export_hf(workdir, out)
  assert 'lm_head.weight' not in safetensors_files.read_tensors(out)


def test_cli_imports_fine_tunes_and_samples(imported, tmp_path, compile_cache):
  _, hf_dir, _, _ = imported
  workdir = str(tmp_path / 'w')
  run = lambda module, *flags: harness.run_cli(module, *flags, env_extra=compile_cache)  # noqa: E731
  bad = run('triax.cli.convert', f'--hf_dir={tmp_path}/missing', f'--workdir={workdir}')
  assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
    f'error: --hf_dir: {tmp_path}/missing: no such directory'
  ]
  assert not os.path.exists(workdir)
  made = run('triax.cli.convert', f'--hf_dir={hf_dir}', f'--workdir={workdir}')
  assert made.returncode == 0, made.stderr
  assert f'python -m triax train --workdir={workdir}' in made.stdout
  # Fine-tune two steps, the config changed by flags (experiments/from_workdir.py) ...
  tuned = run(
    'triax.cli.train',
    f'--config=experiments/from_workdir.py:{workdir}',
    f'--workdir={workdir}',
    '--config.train.steps=2',
    '--config.train.global_batch_size=8',
    '--cpu_devices=8',
    '--progress=false',
  )
  assert tuned.returncode == 0, tuned.stderr[-3000:]
  # ... then the workdir's own config.json alone: nothing left to do at step 2.
  resumed = run('triax.cli.train', f'--workdir={workdir}', '--cpu_devices=8', '--progress=false')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'checkpoint is at step 2 and train.steps=2' in resumed.stdout
  sampled = run(
    'triax.cli.sample',
    f'--workdir={workdir}',
    '--prompt=def ',
    '--temperature=0',
    '--max_new_tokens=8',
  )
  assert sampled.returncode == 0, sampled.stderr[-3000:]
  assert sampled.stdout.startswith('def ') and '[checkpoint step 2 of' in sampled.stderr
  again = run('triax.cli.convert', f'--hf_dir={hf_dir}', f'--workdir={workdir}')
  assert again.returncode == 2 and 'not empty' in again.stderr
