"""The loader's sources and batches: prepared token shards, Megatron .bin/.idx pairs written
here from the documented format, mixtures, segment ids, and the rows each process reads."""

import os
import struct
import types

import harness
import jax
import numpy as np
import pytest

from triax.data import pipeline, prepare, sources
from triax.data import tokenizer as tokenizer_lib
from triax.data.batches import MIXTURE_BLOCK, BatchStream, Mixture, Samples
from triax.errors import ConfigError
from triax.mesh import build_mesh
from triax.training import loop

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast


def write_docs(root, n=40, seed=0):
  rng = np.random.default_rng(seed)
  root.mkdir(parents=True, exist_ok=True)
  for i in range(n):
    words = rng.choice(['red', 'green', 'blue', 'cyan', 'magenta'], rng.integers(5, 60))
    (root / f'doc{i:03d}.txt').write_text(' '.join(words))
  return str(root)


def write_megatron(prefix, docs, dtype=np.uint16, code=8, sequences_per_doc=2):
  """A Megatron MMapIndexedDataset pair, written from the format's description.

  .idx: b'MMIDIDX\\x00\\x00', <Q version 1, <B dtype code, <Q sequence count, <Q document
  count (documents + 1), int32 sizes, int64 byte pointers, int64 document indices.
  Each document is split into `sequences_per_doc` sequences (Megatron's sentences).
  """
  seqs, doc_idx = [], [0]
  for doc in docs:
    seqs += [s for s in np.array_split(np.asarray(doc, dtype), sequences_per_doc) if s.size]
    doc_idx.append(len(seqs))
  sizes = np.array([s.size for s in seqs], np.int32)
  pointers = (
    np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64))]) * np.dtype(dtype).itemsize
  )
  with open(prefix + '.bin', 'wb') as f:
    for s in seqs:
      f.write(s.tobytes())
  with open(prefix + '.idx', 'wb') as f:
    f.write(b'MMIDIDX\x00\x00')
    f.write(struct.pack('<Q', 1))
    f.write(struct.pack('<B', code))
    f.write(struct.pack('<Q', len(seqs)))
    f.write(struct.pack('<Q', len(doc_idx)))
    f.write(sizes.tobytes())
    f.write(pointers.astype(np.int64).tobytes())
    f.write(np.array(doc_idx, np.int64).tobytes())
  return prefix


def config(**overrides):
  c = harness.tiny_config(**{'mesh.data': 1, 'train.global_batch_size': 8, **overrides})
  return c


class TestTokenStream:
  def test_reads_and_segments_cross_shards(self):
    parts = [np.arange(0, 5), np.arange(5, 7), np.arange(7, 20)]
    stream = sources.TokenStream(parts, doc_starts=np.array([0, 3, 6, 15]))
    np.testing.assert_array_equal(stream.read(3, 10), np.arange(3, 13))
    np.testing.assert_array_equal(stream.read(0, 20), np.arange(20))
    np.testing.assert_array_equal(stream.segment_ids(4, 13), [0, 0] + [1] * 9 + [2, 2])
    assert stream.num_documents == 4


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  root = tmp_path_factory.mktemp('tokens')
  out = str(root / 'out')
  prepare.prepare([write_docs(root / 'in')], out, 'bytes', val_fraction=0.2, shard_tokens=300,
                  progress=False)  # fmt: skip
  return out


class TestTokensSource:
  def test_windows_are_the_packed_documents(self, prepared):
    split = sources.open_tokens(prepared, 'bytes', 256, 1)
    shards = prepare.read_manifest(prepared)['splits']['train']['shards']
    assert len(shards) > 3  # windows cross shard boundaries
    whole = np.concatenate(
      [np.fromfile(os.path.join(prepared, s['tokens']), np.uint16) for s in shards]
    )
    assert split.train.size == whole.size
    stream = BatchStream(split.train, 16, 8, seed=0)
    batch = stream.batch(5)
    for row, k in enumerate(batch['sample_ids']):
      np.testing.assert_array_equal(batch['inputs'][row], whole[k * 16 : k * 16 + 16])
      np.testing.assert_array_equal(batch['targets'][row], whole[k * 16 + 1 : k * 16 + 17])
    assert (whole == 0).sum() == split.train.num_documents  # one end-of-document (NUL) each

  def test_each_window_once_per_epoch_and_rows_partition(self, prepared):
    split = sources.open_tokens(prepared, 'bytes', 256, 1)
    stream = BatchStream(split.train, 16, 8, seed=3)
    n = stream.num_windows
    ids = np.concatenate([stream.sample_ids(s) for s in range(3 * n // 8 + 1)])
    for epoch in range(3):
      np.testing.assert_array_equal(np.sort(ids[epoch * n : (epoch + 1) * n]), np.arange(n))
    for step in (0, n // 8, 2 * n // 8 + 1):
      whole = stream.batch(step, (0, 8))
      parts = [stream.batch(step, (lo, lo + 2)) for lo in range(0, 8, 2)]
      np.testing.assert_array_equal(np.concatenate([p['inputs'] for p in parts]), whole['inputs'])
      np.testing.assert_array_equal(whole['sample_ids'], stream.sample_ids(step))
    again = BatchStream(split.train, 16, 8, seed=3)  # a resumed run
    np.testing.assert_array_equal(again.batch(7)['inputs'], stream.batch(7)['inputs'])

  def test_segment_ids_follow_document_starts(self, prepared):
    split = sources.open_tokens(prepared, 'bytes', 256, 1)
    stream = BatchStream(split.train, 64, 8, seed=0, mask_documents=True)
    batch = stream.batch(2)
    for row in range(8):
      seg = batch['segment_ids'][row]
      assert seg[0] == 0 and np.all(np.diff(seg) >= 0)
      # A new segment starts right after each end-of-document token.
      ends = np.flatnonzero(batch['inputs'][row] == 0)
      np.testing.assert_array_equal(np.flatnonzero(np.diff(seg)), ends[ends < 63])

  def test_damage_and_mismatches_are_errors(self, prepared, tmp_path):
    import shutil

    copy = str(tmp_path / 'copy')
    shutil.copytree(prepared, copy)
    with pytest.raises(ConfigError) as info:
      sources.open_tokens(copy, 'bytes', 128, 1)
    assert info.value.key == 'model.vocab_size'
    tok = tokenizer_lib.train_bpe(['red green blue'] * 20, 300, str(tmp_path / 'tok.json'))
    with pytest.raises(ConfigError) as info:
      sources.open_tokens(copy, tok.name, 512, 1)
    assert info.value.key == 'data.tokenizer' and 'data.tokenizer=bytes' in info.value.message
    shard = os.path.join(copy, 'train-00001.tokens')
    with open(shard, 'r+b') as f:
      f.truncate(7)
    with pytest.raises(ConfigError) as info:
      sources.open_tokens(copy, 'bytes', 256, 1)
    assert info.value.key == 'data.path' and 'damaged' in info.value.message
    os.remove(os.path.join(copy, prepare.MANIFEST))
    with pytest.raises(ConfigError) as info:
      sources.open_tokens(copy, 'bytes', 256, 1)
    assert info.value.key == 'data.path' and 'did not finish' in info.value.message


class TestMegatron:
  def docs(self, n=30, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, 1000, rng.integers(3, 80))) + [0] for _ in range(n)]

  def test_reads_the_documented_format(self, tmp_path):
    docs = self.docs()
    prefix = write_megatron(str(tmp_path / 'corpus_text_document'), docs)
    split = sources.open_megatron(prefix + '.bin', 'bytes', 1024, 1)
    n_val = max(1, int(len(docs) * sources.MEGATRON_VAL_FRACTION))
    train_docs, val_docs = docs[:-n_val], docs[-n_val:]
    np.testing.assert_array_equal(split.train.read(0, split.train.size), np.concatenate(train_docs))
    np.testing.assert_array_equal(split.val.read(0, split.val.size), np.concatenate(val_docs))
    np.testing.assert_array_equal(
      split.train.doc_starts, np.cumsum([0] + [len(d) for d in train_docs[:-1]])
    )
    assert split.train.num_documents == len(train_docs)

  @pytest.mark.parametrize('damage, key', [
    ('header', 'data.path'), ('short-bin', 'data.path'), ('big-id', 'model.vocab_size'),
    ('missing-idx', 'data.path'),
  ])  # fmt: skip
  def test_errors(self, tmp_path, damage, key):
    docs = self.docs()
    if damage == 'big-id':
      docs[3][1] = 5000
    prefix = write_megatron(str(tmp_path / 'c'), docs)
    if damage == 'header':
      with open(prefix + '.idx', 'r+b') as f:
        f.write(b'NOTMEGA')
    elif damage == 'short-bin':
      with open(prefix + '.bin', 'r+b') as f:
        f.truncate(100)
    elif damage == 'missing-idx':
      os.remove(prefix + '.idx')
    with pytest.raises(ConfigError) as info:
      sources.open_megatron(prefix, 'bytes', 1024, 1)
    assert info.value.key == key, info.value


class TestMixture:
  def streams(self, sizes=(4000, 2500, 1200)):
    rng = np.random.default_rng(0)
    return [sources.TokenStream([rng.integers(0, 256, n)]) for n in sizes]

  def test_proportions_within_one_percent_and_deterministic(self):
    weights = (0.6, 0.3, 0.1)
    parts = [Samples(s, 16, 0, stream_index=2 + j) for j, s in enumerate(self.streams())]
    mixture = Mixture(parts, weights, seed=0)
    stream = BatchStream(mixture, 16, 32, seed=0)
    steps = 100  # 3.2 blocks: a partial block too
    ids = np.concatenate([stream.sample_ids(s) for s in range(steps)])
    offsets = np.cumsum([0] + [p.num_windows for p in parts])
    source = np.searchsorted(offsets, ids, side='right') - 1
    shares = np.bincount(source, minlength=3) / ids.size
    assert np.all(np.abs(shares - weights) < 0.01), shares
    # Every whole block holds each source's exact share of slots.
    block = source[:MIXTURE_BLOCK]
    np.testing.assert_array_equal(np.bincount(block, minlength=3), mixture.counts)
    # A pure function of the step: a fresh mixture (a resumed run) gives the same rows.
    again = BatchStream(
      Mixture([Samples(s, 16, 0, stream_index=2 + j) for j, s in enumerate(self.streams())],
              weights, seed=0), 16, 32, seed=0)  # fmt: skip
    np.testing.assert_array_equal(again.batch(77)['inputs'], stream.batch(77)['inputs'])
    # Each source goes through its own windows once per its own epoch, in its sample order
    # (within a block its samples are shuffled, so whole blocks are counted).
    whole = range(steps * 32 // MIXTURE_BLOCK * MIXTURE_BLOCK)
    for j, p in enumerate(parts):
      numbers = sorted(mixture.locate(g)[1] for g in whole if mixture.locate(g)[0] == j)
      assert numbers == list(range(len(numbers)))  # no sample number skipped or repeated
      windows = [p.window_id(c) for c in numbers]
      for e in range(len(windows) // p.num_windows):
        chunk = windows[e * p.num_windows : (e + 1) * p.num_windows]
        assert sorted(chunk) == list(range(p.num_windows))


def test_pipeline_describes_the_data(tmp_path):
  out = str(tmp_path / 'out')
  prepare.prepare([write_docs(tmp_path / 'in')], out, 'bytes', val_fraction=0.2, progress=False)
  cfg = config(**{'data.source': 'tokens', 'data.path': out, 'train.steps': 50})
  data = pipeline.load(cfg)
  line = data.description
  assert line.startswith(f'data: tokens {out} (bytes tokenizer (256 ids); 40 input files')
  m = prepare.read_manifest(out)['splits']
  assert f'{m["train"]["tokens"]:,} train tokens in 32 documents' in line
  epochs = 50 * 8 / data.train.num_windows
  assert f'50 steps x 8 = {epochs:.3g} epochs' in line


def test_each_process_reads_only_its_devices_rows():
  # A 2 x 2 x 2 mesh: each data shard's rows are held by 4 devices; each block is read once.
  cfg = config(**{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2})
  mesh = build_mesh(cfg.mesh, jax.devices()[:8])
  trainer = types.SimpleNamespace(cfg=cfg, batch_sharding=loop.jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec('data', None)))  # fmt: skip
  stream = BatchStream(np.random.default_rng(0).integers(0, 256, 5000), 16, 8, seed=0)
  asked = []

  def rows(lo, hi):
    asked.append((lo, hi))
    return stream.batch(3, (lo, hi))

  arrays = loop.global_batch(trainer, rows)
  assert sorted(asked) == [(0, 4), (4, 8)]
  whole = stream.batch(3, (0, 8))
  for k in ('inputs', 'targets'):
    np.testing.assert_array_equal(np.asarray(arrays[k]), whole[k])
    assert arrays[k].sharding == trainer.batch_sharding


def test_a_text_directory_past_the_old_16_mib_cap_is_read_whole(tmp_path):
  # The case: 24 MiB in 3 files used to load 2 of them, silently.
  from triax.data.corpus import DEFAULT_MAX_BYTES

  line = b'some text that is long enough to count, line after line\n'
  for i in range(3):
    (tmp_path / f'part{i}.txt').write_bytes(line * (8 * 2**20 // len(line)))
  total = sum(p.stat().st_size for p in tmp_path.iterdir())
  assert total > DEFAULT_MAX_BYTES
  cfg = config(**{'data.source': 'text', 'data.path': str(tmp_path)})
  data = pipeline.load(cfg)
  assert '3 files' in data.description
  assert data.train.samples.stream.size + data.val.samples.stream.size == total + 2 * 2
  cfg.data.max_text_bytes = total - 1
  with pytest.raises(ConfigError) as info:
    pipeline.load(cfg)
  assert info.value.key == 'data.max_text_bytes'


def test_a_mixture_of_a_prepared_directory_and_a_megatron_pair(tmp_path, prepared):
  rng = np.random.default_rng(1)
  docs = [list(rng.integers(1, 256, rng.integers(20, 200))) + [0] for _ in range(60)]
  prefix = write_megatron(str(tmp_path / 'mega'), docs, dtype=np.uint8, code=1)
  cfg = config(
    **{
      'data.source': 'mixture',
      'data.mixture': ((prepared, 3.0), (prefix, 1.0)),
      'train.steps': 125,
    }  # fmt: skip
  )
  data = pipeline.load(cfg)
  assert data.description.startswith('data: mixture of 2 sources: 75.0% tokens ')
  assert '25.0% megatron ' in data.description
  first = data.train.samples.sources[0].num_windows
  ids = np.concatenate([data.train.sample_ids(s) for s in range(125)])  # one block
  assert (ids < first).sum() == 750 and (ids >= first).sum() == 250
  # Evaluation stays on the first source's validation text.
  assert data.val.samples.stream.size == sources.open_tokens(prepared, 'bytes', 256, 1).val.size
  bad = config(**{'data.source': 'mixture', 'data.mixture': ((str(tmp_path / 'none'), 1.0),)})
  with pytest.raises(ConfigError) as info:
    pipeline.load(bad)
  assert info.value.key == 'data.mixture'
