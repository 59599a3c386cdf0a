"""What travels with a converted checkpoint besides its tensors, and in what dtype.

A small Qwen3 is written by transformers in bfloat16, as checkpoints are
released, with a tokenizer as transformers saves one (tokenizer.json,
tokenizer_config.json with its special tokens and chat template) and a
generation_config.json of its own. The import keeps those files
(DIR/hf_files) and trains in fp32; the export writes the tensors back in
bfloat16, bit-identical, and beside them the files transformers'
AutoTokenizer and GenerationConfig read the directory with, as they read
the original. `--dtype` chooses another dtype, and config.json says which
was written. A sentencepiece checkpoint's tokenizer.model is the run's
tokenizer and travels under its own name. Nothing is downloaded.
"""

import json
import os
import sysconfig

import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from triax.convert import hf_checkpoint, safetensors_files  # noqa: E402
from triax.data import tokenizer as tokenizer_lib  # noqa: E402
from triax.errors import ConfigError  # noqa: E402
from triax.training import workdir as workdir_lib  # noqa: E402

VOCAB = 320
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _lines():
  with open(os.path.join(sysconfig.get_paths()['stdlib'], 'argparse.py'), encoding='utf-8') as f:
    return f.read().splitlines()[:400]


def _qwen3(hf_dir, dtype=torch.bfloat16):
  cfg = transformers.Qwen3Config(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=True,
  )
  torch.manual_seed(0)
  transformers.Qwen3ForCausalLM(cfg).to(dtype).save_pretrained(hf_dir)


@pytest.fixture(scope='module')
def released(tmp_path_factory):
  """(hf_dir, workdir): a bf16 Qwen3 with its tokenizer files and generation config, imported."""
  base = tmp_path_factory.mktemp('released')
  hf_dir = str(base / 'hf')
  _qwen3(hf_dir)
  bpe = tokenizer_lib.train_bpe(_lines(), 300, str(base / 'bpe.json'))
  assert bpe.vocab_size <= VOCAB
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_file=str(base / 'bpe.json'),
    eos_token='<|endoftext|>',
    pad_token='<|endoftext|>',
    chat_template=TEMPLATE,
  )
  fast.save_pretrained(hf_dir)
  generation = transformers.GenerationConfig(
    eos_token_id=bpe.eod_id, temperature=0.7, top_p=0.8, do_sample=True
  )
  generation.save_pretrained(hf_dir)
  workdir = str(base / 'w')
  hf_checkpoint.import_hf(hf_dir, workdir)
  return hf_dir, workdir


def test_the_import_keeps_the_tokenizer_files_and_the_generation_config(released):
  hf_dir, workdir = released
  kept = sorted(os.listdir(workdir_lib.path(workdir, workdir_lib.HF_FILES)))
  assert 'tokenizer_config.json' in kept and 'generation_config.json' in kept
  assert workdir_lib.TOKENIZER not in kept  # the run's tokenizer sits in DIR itself
  for name in kept:
    with (
      open(os.path.join(hf_dir, name), 'rb') as a,
      open(workdir_lib.path(workdir, os.path.join(workdir_lib.HF_FILES, name)), 'rb') as b,
    ):
      assert a.read() == b.read(), name
  with open(workdir_lib.path(workdir, workdir_lib.CONFIG)) as f:
    model = json.load(f)['model']
  assert model['param_dtype'] == 'float32'  # fp32 master weights, whatever was released


def test_a_bf16_checkpoint_exports_bit_identical_and_transformers_reads_its_files(
  released, tmp_path
):
  hf_dir, workdir = released
  out = str(tmp_path / 'out')
  result = hf_checkpoint.export_hf(workdir, out)
  assert result['dtype'] == 'bfloat16'
  ours, theirs = safetensors_files.read_tensors(out), safetensors_files.read_tensors(hf_dir)
  assert set(ours) == set(theirs)
  for name, array in theirs.items():
    assert ours[name].dtype == array.dtype == np.dtype('bfloat16'), name
    assert ours[name].tobytes() == array.tobytes(), name
  with open(os.path.join(out, 'config.json')) as f:
    assert json.load(f)['dtype'] == 'bfloat16'
  assert transformers.AutoConfig.from_pretrained(out).dtype == torch.bfloat16
  text = 'def parse_args(self, args=None):\n    return self'
  original = transformers.AutoTokenizer.from_pretrained(hf_dir)
  exported = transformers.AutoTokenizer.from_pretrained(out)
  assert exported(text)['input_ids'] == original(text)['input_ids']
  assert (exported.eos_token, exported.pad_token) == ('<|endoftext|>', '<|endoftext|>')
  chat = [{'role': 'user', 'content': 'hi'}]
  assert exported.apply_chat_template(chat, tokenize=False) == '<|im_start|>hi<|im_end|>'
  generation = transformers.GenerationConfig.from_pretrained(out)
  assert generation.to_dict() == transformers.GenerationConfig.from_pretrained(hf_dir).to_dict()
  assert (generation.temperature, generation.top_p) == (0.7, 0.8)


def test_dtype_chooses_what_the_export_writes(released, tmp_path):
  hf_dir, workdir = released
  out = str(tmp_path / 'fp32')
  assert hf_checkpoint.export_hf(workdir, out, dtype='float32')['dtype'] == 'float32'
  ours, theirs = safetensors_files.read_tensors(out), safetensors_files.read_tensors(hf_dir)
  for name, array in theirs.items():
    assert ours[name].dtype == np.float32, name
    np.testing.assert_array_equal(ours[name], array.astype(np.float32), err_msg=name)
  with open(os.path.join(out, 'config.json')) as f:
    assert json.load(f)['dtype'] == 'float32'
  with pytest.raises(ConfigError, match='float32, bfloat16, float16') as e:
    hf_checkpoint.export_hf(workdir, str(tmp_path / 'bad'), dtype='fp8')
  assert e.value.key == '--dtype' and not (tmp_path / 'bad').exists()


@pytest.mark.fast
def test_a_generation_config_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
  hf_dir = str(tmp_path / 'hf')
  _qwen3(hf_dir, torch.float32)
  tokenizer_lib.train_bpe(_lines(), 300, os.path.join(hf_dir, workdir_lib.TOKENIZER))
  with open(os.path.join(hf_dir, 'generation_config.json'), 'w') as f:
    f.write('{"eos_token_id": ')
  with pytest.raises(ConfigError, match='generation_config.json: not JSON') as e:
    hf_checkpoint.import_hf(hf_dir, str(tmp_path / 'w'))
  assert e.value.key == '--hf_dir' and not (tmp_path / 'w').exists()


def test_a_sentencepiece_checkpoint_keeps_its_tokenizer_model(tmp_path):
  import sentencepiece

  hf_dir = str(tmp_path / 'hf')
  _qwen3(hf_dir, torch.float32)
  sentencepiece.SentencePieceTrainer.train(
    sentence_iterator=iter(_lines()),
    model_prefix=os.path.join(hf_dir, 'tokenizer'),
    vocab_size=200,
    model_type='bpe',
    minloglevel=2,
  )
  workdir, out = str(tmp_path / 'w'), str(tmp_path / 'out')
  result = hf_checkpoint.import_hf(hf_dir, workdir)
  recorded = workdir_lib.path(workdir, workdir_lib.TOKENIZER_MODEL)
  cfg = workdir_lib.load_config(workdir)
  assert result['tokenizer'] == recorded and cfg.data.tokenizer == recorded
  assert not os.path.exists(workdir_lib.path(workdir, workdir_lib.TOKENIZER))
  tok = workdir_lib.tokenizer(workdir, cfg)
  assert tok.kind == 'sentencepiece' and tok.decode(tok.encode('import os')) == 'import os'
  assert hf_checkpoint.export_hf(workdir, out)['dtype'] == 'float32'
  with open(os.path.join(hf_dir, 'tokenizer.model'), 'rb') as a:
    with open(os.path.join(out, 'tokenizer.model'), 'rb') as b:
      assert a.read() == b.read()


def test_a_value_past_float16s_range_is_refused_and_nothing_is_left(tmp_path):
  hf_dir, workdir = str(tmp_path / 'hf'), str(tmp_path / 'w')
  _qwen3(hf_dir, torch.float32)
  tokenizer_lib.train_bpe(_lines(), 300, os.path.join(hf_dir, workdir_lib.TOKENIZER))
  tensors = safetensors_files.read_tensors(hf_dir)
  name = 'model.layers.1.mlp.down_proj.weight'
  tensors[name][0, 0] = 1e5  # fp32 and bf16 hold it; float16 stops at 65504
  import safetensors.numpy

  safetensors.numpy.save_file(tensors, os.path.join(hf_dir, 'model.safetensors'))
  hf_checkpoint.import_hf(hf_dir, workdir)
  out = tmp_path / 'out'
  with pytest.raises(ConfigError, match=f'{name} holds 100000') as e:
    hf_checkpoint.export_hf(workdir, str(out), dtype='float16')
  assert e.value.key == '--dtype' and not out.exists()
  assert hf_checkpoint.export_hf(workdir, str(out), dtype='bfloat16')['dtype'] == 'bfloat16'


def test_a_run_trained_here_exports_a_tokenizer_config_and_a_generation_config(tmp_path):
  """A workdir train wrote (no import's HF files) with a tokenizer.json of its
  own: the export writes a tokenizer_config.json, with which AutoTokenizer
  encodes and decodes as triax does and knows the end-of-document token as
  its eos (without it, none), and a generation_config.json that stops there."""
  import harness
  import jax

  from triax.training import checkpoint as ckpt_lib

  bpe = tokenizer_lib.train_bpe(_lines(), 300, str(tmp_path / 'bpe.json'))
  cfg = harness.tiny_config(
    **{
      'model.family': 'llama',
      'model.num_layers': 2,
      'model.vocab_size': 384,  # a multiple of 128 (data.tokenizer's padding rule)
      'model.vocab_used': bpe.vocab_size,
      'data.tokenizer': str(tmp_path / 'bpe.json'),
      'data.source': 'tokens',  # as a run on prepared text is
      'data.path': str(tmp_path / 'tokens'),
      'mesh.data': 1,
    }
  )
  trainer = harness.make_trainer(cfg)
  workdir, out = str(tmp_path / 'w'), str(tmp_path / 'out')
  os.makedirs(workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(trainer.cfg.to_json())
  ckpt = ckpt_lib.Checkpointer(workdir, trainer.cfg)
  ckpt.save(trainer, trainer.init_state(jax.random.key(0)))
  ckpt.wait()
  ckpt.close()
  hf_checkpoint.export_hf(workdir, out)
  assert {'tokenizer.json', 'tokenizer_config.json', 'generation_config.json'} <= set(
    os.listdir(out)
  )
  text = 'def parse_args(self, args=None):\n    return self'
  exported = transformers.AutoTokenizer.from_pretrained(out)
  assert exported(text)['input_ids'] == bpe.encode(text)
  assert exported.decode(bpe.encode(text)) == bpe.decode(bpe.encode(text))
  assert exported.eos_token_id == bpe.eod_id
  assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == bpe.eod_id
