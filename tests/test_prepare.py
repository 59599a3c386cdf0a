"""Tokenizers (bytes, a BPE trained here, sentencepiece) and `prepare`: token shards, the
split by document, a rerun that does nothing, damaged outputs rebuilt, bad input touching nothing."""

import json
import os
import random

import harness
import numpy as np
import pytest

from triax.data import documents, prepare
from triax.data import tokenizer as tokenizer_lib
from triax.errors import ConfigError

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

WORDS = 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu'.split()


def sentence(rng, n=12):
  return ' '.join(rng.choice(WORDS) for _ in range(n)) + '.'


def write_inputs(root, text_files=6, jsonl_lines=60, seed=0):
  """A folder of text files and one .jsonl; returns the documents in reading order."""
  rng = random.Random(seed)
  root.mkdir(parents=True, exist_ok=True)
  docs = []
  with open(root / 'notes.jsonl', 'w') as f:
    lines = [sentence(rng, rng.randint(3, 30)) for _ in range(jsonl_lines)]
    for line in lines:
      f.write(json.dumps({'text': line, 'id': 1}) + '\n')
  for i in range(text_files):
    text = '\n'.join(sentence(rng) for _ in range(rng.randint(2, 8)))
    (root / f'page{i}.txt').write_text(text)
  # list_inputs sorts: notes.jsonl first, then page0..page5.txt
  docs = lines + [(root / f'page{i}.txt').read_text() for i in range(text_files)]
  return docs


@pytest.fixture(scope='module')
def bpe(tmp_path_factory):
  root = tmp_path_factory.mktemp('bpe')
  write_inputs(root / 'in')
  texts = (t for i in documents.list_inputs([str(root / 'in')]) for t in documents.read(i))
  return tokenizer_lib.train_bpe(texts, 320, str(root / 'tokenizer.json'))


def decode_split(out, split):
  """The documents of a prepared split, decoded by its shard and index files."""
  manifest = prepare.read_manifest(out)
  docs = []
  for shard in manifest['splits'][split]['shards']:
    tokens = np.fromfile(os.path.join(out, shard['tokens']), dtype=manifest['dtype'])
    starts = np.fromfile(os.path.join(out, shard['docs']), dtype='<i8')
    ends = list(starts[1:]) + [tokens.size]
    docs += [tokens[a:b] for a, b in zip(starts, ends)]
  return docs


class TestTokenizers:
  def test_bytes(self):
    tok = tokenizer_lib.load('bytes')
    assert (tok.vocab_size, tok.eod_id) == (256, 0)
    assert tok.encode('hé') == [104, 195, 169]
    assert tok.decode(tok.encode('hé')) == 'hé'

  def test_bpe_trained_here(self, bpe):
    # The words of this corpus run out of merges before 320: fewer ids, never more.
    assert 257 < bpe.vocab_size <= 320
    text = 'alpha beta gamma. Unseen wörds too!'
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode())  # merges learnt from the corpus
    assert bpe.decode(ids) == text
    assert bpe.eod_id not in ids
    again = tokenizer_lib.load(bpe.name)
    assert (again.vocab_size, again.eod_id, again.fingerprint) == (
      bpe.vocab_size,
      bpe.eod_id,
      bpe.fingerprint,
    )

  def test_sentencepiece(self, tmp_path):
    import sentencepiece

    rng = random.Random(1)
    sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter([sentence(rng) for _ in range(200)]),
      model_prefix=str(tmp_path / 'sp'),
      vocab_size=30,
      minloglevel=2,
    )
    tok = tokenizer_lib.load(str(tmp_path / 'sp.model'))
    assert tok.kind == 'sentencepiece' and tok.vocab_size == 30 and tok.eod_id == 2
    assert tok.decode(tok.encode('alpha beta')) == 'alpha beta'

  @pytest.mark.parametrize('spec', ['', '/no/such/tokenizer.json', __file__])
  def test_bad_specs(self, spec):
    with pytest.raises(ConfigError) as info:
      tokenizer_lib.load(spec)
    assert info.value.key == 'data.tokenizer'

  def test_vocab_check_names_the_padded_size(self, bpe):
    assert tokenizer_lib.padded_vocab_size(320, 1) == 384
    assert tokenizer_lib.padded_vocab_size(320, 4) == 512
    assert tokenizer_lib.padded_vocab_size(50257, 8) == 51200  # GPT-2 under Megatron, t=8
    tokenizer_lib.check_vocab(bpe, bpe.vocab_size, 1)
    with pytest.raises(ConfigError) as info:
      tokenizer_lib.check_vocab(bpe, 256, 2)
    assert info.value.key == 'model.vocab_size'
    assert 'model.vocab_size=512' in info.value.message  # 303 ids padded to 2 * 128 multiples

  def test_train_rejects_a_vocabulary_without_room_for_the_bytes(self, tmp_path):
    with pytest.raises(ConfigError) as info:
      tokenizer_lib.train_bpe(iter(['x']), 100, str(tmp_path / 't.json'))
    assert info.value.key == '--vocab_size'
    assert not os.listdir(tmp_path)


class TestPrepare:
  def test_shards_hold_every_document_with_its_end_token(self, tmp_path, bpe):
    docs = write_inputs(tmp_path / 'in')
    out = str(tmp_path / 'out')
    manifest = prepare.prepare(
      [str(tmp_path / 'in')], out, bpe.name, val_fraction=0.1, workers=1, progress=False
    )
    assert manifest['rebuilt'] and manifest['dtype'] == 'uint16'
    every = 10
    want = {
      'train': [d for n, d in enumerate(docs, 1) if n % every],
      'val': [d for n, d in enumerate(docs, 1) if n % every == 0],
    }
    for split in ('train', 'val'):
      got = decode_split(out, split)
      assert len(got) == len(want[split]) == manifest['splits'][split]['documents']
      for ids, text in zip(got, want[split]):
        assert ids[-1] == bpe.eod_id
        assert bpe.decode(ids[:-1]) == text
    assert manifest['splits']['train']['max_id'] < bpe.vocab_size

  def test_parallel_workers_write_the_same_bytes(self, tmp_path, bpe):
    write_inputs(tmp_path / 'in', jsonl_lines=700)  # several chunks of documents
    outs = []
    for workers in (1, 2):
      out = str(tmp_path / f'out{workers}')
      prepare.prepare([str(tmp_path / 'in')], out, bpe.name, workers=workers, progress=False)
      outs.append(prepare.read_manifest(out)['splits'])
    assert outs[0] == outs[1]

  def test_shards_split_at_document_boundaries(self, tmp_path):
    docs = write_inputs(tmp_path / 'in')
    out = str(tmp_path / 'out')
    m = prepare.prepare([str(tmp_path / 'in')], out, 'bytes', shard_tokens=500, progress=False)
    assert len(m['splits']['train']['shards']) > 2
    got = decode_split(out, 'train') + decode_split(out, 'val')
    assert sorted(bytes(d[:-1].astype(np.uint8)).decode() for d in got) == sorted(docs)

  def test_parquet_and_arrow(self, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({'body': [f'row {i} text' for i in range(30)], 'n': list(range(30))})
    (tmp_path / 'in').mkdir()
    pq.write_table(table, tmp_path / 'in' / 'a.parquet')
    with pa.ipc.new_stream(tmp_path / 'in' / 'b.arrow', table.schema) as w:  # datasets' format
      w.write_table(table)
    out = str(tmp_path / 'out')
    m = prepare.prepare(
      [str(tmp_path / 'in')], out, 'bytes', text_key='body', val_fraction=0.5, progress=False
    )
    assert m['splits']['train']['documents'] + m['splits']['val']['documents'] == 60
    first = decode_split(out, 'train')[0]
    assert bytes(first.astype(np.uint8)) == b'row 0 text\0'

  def test_rerun_is_a_no_op_and_damage_is_rebuilt(self, tmp_path, bpe):
    write_inputs(tmp_path / 'in')
    out = str(tmp_path / 'out')
    args = ([str(tmp_path / 'in')], out, bpe.name)
    first = prepare.prepare(*args, progress=False)
    shard = os.path.join(out, first['splits']['train']['shards'][0]['tokens'])
    stamp = os.stat(shard).st_mtime_ns
    again = prepare.prepare(*args, progress=False)
    assert not again['rebuilt'] and os.stat(shard).st_mtime_ns == stamp

    def damage_and_rerun(damage):
      damage()
      assert prepare.verify(out, prepare.read_manifest(out) or first, checksums=True) or (
        prepare.read_manifest(out) is None
      )
      result = prepare.prepare(*args, progress=False)
      assert result['rebuilt']
      assert prepare.verify(out, result, checksums=True) is None
      assert result['splits'] == first['splits']

    with open(shard, 'r+b') as f:  # truncated (a partial copy)
      damage_and_rerun(lambda: f.truncate(10))

    def flip():  # same size, other bytes
      data = bytearray(open(shard, 'rb').read())
      data[3] ^= 0xFF
      open(shard, 'wb').write(bytes(data))

    damage_and_rerun(flip)
    damage_and_rerun(lambda: os.remove(os.path.join(out, prepare.MANIFEST)))  # unfinished
    # Other inputs: rebuilt for them.
    (tmp_path / 'in' / 'page0.txt').write_text('changed')
    assert prepare.prepare(*args, progress=False)['rebuilt']

  def test_bad_record_midway_keeps_the_previous_output(self, tmp_path):
    write_inputs(tmp_path / 'in')
    out = str(tmp_path / 'out')
    prepare.prepare([str(tmp_path / 'in')], out, 'bytes', progress=False)
    before = {n: open(os.path.join(out, n), 'rb').read() for n in os.listdir(out)}
    with open(tmp_path / 'in' / 'notes.jsonl', 'a') as f:
      f.write(json.dumps({'body': 'no text key'}) + '\n')
    with pytest.raises(ConfigError) as info:
      prepare.prepare([str(tmp_path / 'in')], out, 'bytes', workers=2, progress=False)
    assert info.value.key == '--text_key' and 'notes.jsonl:61' in info.value.message
    assert {n: open(os.path.join(out, n), 'rb').read() for n in os.listdir(out)} == before
    # A new directory is not left behind either.
    with pytest.raises(ConfigError):
      prepare.prepare([str(tmp_path / 'in')], str(tmp_path / 'new'), 'bytes', progress=False)
    assert not os.path.exists(tmp_path / 'new')

  @pytest.mark.parametrize(
    'case, key',
    [
      ('missing-input', '--input'),
      ('empty-file', '--input'),
      ('foreign-out', '--out'),
      ('one-document', '--val_fraction'),
      ('bad-tokenizer', '--tokenizer'),
      ('nul-with-bytes', '--tokenizer'),
      ('not-utf8', '--input'),
    ],
  )
  def test_bad_input(self, tmp_path, case, key):
    (tmp_path / 'in').mkdir()
    (tmp_path / 'in' / 'a.txt').write_text('one document')
    inputs, out, tok = [str(tmp_path / 'in')], str(tmp_path / 'out'), 'bytes'
    if case == 'missing-input':
      inputs = [str(tmp_path / 'nope')]
    elif case == 'empty-file':
      (tmp_path / 'in' / 'b.txt').write_text('')
    elif case == 'foreign-out':
      os.makedirs(out)
      open(os.path.join(out, 'mine.txt'), 'w').write('keep me')
    elif case == 'bad-tokenizer':
      tok = str(tmp_path / 'missing.json')
    elif case == 'not-utf8':
      (tmp_path / 'in' / 'latin1.txt').write_bytes('café'.encode('latin-1'))
    elif case == 'nul-with-bytes':  # NUL is the bytes tokenizer's end-of-document
      for i in range(30):
        (tmp_path / 'in' / f'{i}.txt').write_text('text\0more' if i == 7 else 'text')
    before = sorted(str(p) for p in tmp_path.rglob('*'))
    with pytest.raises(ConfigError) as info:
      prepare.prepare(inputs, out, tok, progress=False)
    assert info.value.key == key, info.value
    assert sorted(str(p) for p in tmp_path.rglob('*')) == before

  def test_an_error_line_is_not_glued_to_the_progress_bar(self, tmp_path):
    (tmp_path / 'in').mkdir()
    (tmp_path / 'in' / 'a.txt').write_text('one document')
    (tmp_path / 'in' / 'latin1.txt').write_bytes('café'.encode('latin-1'))
    result = harness.run_cli(
      'triax',
      'prepare',
      f'--input={tmp_path / "in"}',
      f'--out={tmp_path / "out"}',
      '--workers=1',
      timeout=120,
    )
    assert result.returncode == 2
    assert 'prepare:' in result.stderr  # the bar was drawn
    errors = [line for line in result.stderr.split('\n') if 'error:' in line]
    assert len(errors) == 1 and errors[0].startswith('error: --input: '), result.stderr

  def test_sentencepiece_in_worker_processes(self, tmp_path):
    import sentencepiece

    rng = random.Random(2)
    sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter([sentence(rng) for _ in range(200)]),
      model_prefix=str(tmp_path / 'sp'),
      vocab_size=30,
      minloglevel=2,
    )
    docs = write_inputs(tmp_path / 'in')
    out = str(tmp_path / 'out')
    model = str(tmp_path / 'sp.model')
    m = prepare.prepare([str(tmp_path / 'in')], out, model, workers=2, progress=False)
    assert m['request']['tokenizer']['kind'] == 'sentencepiece'
    tok = tokenizer_lib.load(model)
    got = [tok.decode(d[:-1]) for d in decode_split(out, 'train')]
    assert all(d[-1] == tok.eod_id for d in decode_split(out, 'train'))
    want = [d for n, d in enumerate(docs, 1) if n % 20]
    # sentencepiece normalises whitespace (newlines become spaces): compare word by word.
    assert [g.split() for g in got] == [w.split() for w in want]

  def test_uint32_when_ids_do_not_fit_in_16_bits(self):
    assert prepare.dtype_for(65536) == np.uint16
    assert prepare.dtype_for(65537) == np.uint32
