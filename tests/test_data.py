"""Tests for the byte corpus and the deterministic batch stream."""

import math

import numpy as np
import pytest

from triax.data.batches import BatchStream
from triax.data.corpus import SEPARATOR, load_corpus, unigram_entropy_bits, unigram_entropy_nats
from triax.errors import ConfigError

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast


def _tokens(n: int = 10_001, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _assert_batches_equal(a, b):
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope='module')
def stdlib():
  return load_corpus('stdlib', '')


class TestBatchStream:
  def test_shapes_and_dtypes(self):
    batch = BatchStream(_tokens(), 16, 8, seed=0).batch(3)
    assert batch['inputs'].shape == (8, 16)
    assert batch['inputs'].dtype == np.int32
    assert batch['targets'].shape == (8, 16)
    assert batch['targets'].dtype == np.int32
    assert batch['sample_ids'].shape == (8,)
    assert batch['sample_ids'].dtype == np.int64

  def test_deterministic(self):
    a = BatchStream(_tokens(), 16, 8, seed=5)
    b = BatchStream(_tokens(), 16, 8, seed=5)
    for step in (0, 1, 77, 1000):
      _assert_batches_equal(a.batch(step), b.batch(step))

  def test_seeds_differ(self):
    a = BatchStream(_tokens(), 16, 8, seed=0).batch(0)
    b = BatchStream(_tokens(), 16, 8, seed=1).batch(0)
    assert not np.array_equal(a['sample_ids'], b['sample_ids'])

  def test_targets_are_inputs_shifted_and_match_text(self):
    tokens = _tokens()
    stream = BatchStream(tokens, 16, 8, seed=0)
    batch = stream.batch(2)
    np.testing.assert_array_equal(batch['inputs'][:, 1:], batch['targets'][:, :-1])
    for row, k in enumerate(batch['sample_ids']):
      window = tokens[k * 16 : k * 16 + 17]
      np.testing.assert_array_equal(batch['inputs'][row], window[:-1])
      np.testing.assert_array_equal(batch['targets'][row], window[1:])

  @pytest.mark.parametrize('size', [8 * 16 * 10 + 1, 8 * 16 * 10 + 50])
  def test_each_window_once_per_epoch(self, size):
    # size gives N = 80 windows (N % B == 0) and N = 83 (epochs straddle
    # batches); either way each epoch's samples are a permutation of range(N).
    stream = BatchStream(_tokens(size), 16, 8, seed=3)
    n = stream.num_windows
    ids = np.concatenate([stream.batch(s)['sample_ids'] for s in range(3 * n // 8 + 1)])
    for epoch in range(3):
      got = np.sort(ids[epoch * n : (epoch + 1) * n])
      np.testing.assert_array_equal(got, np.arange(n))
    # A fresh permutation each epoch, not the same order repeated.
    assert not np.array_equal(ids[:n], ids[n : 2 * n])

  @pytest.mark.parametrize('processes', [2, 4])
  def test_process_shards_partition_global_batch(self, processes):
    tokens = _tokens(83 * 16 + 1)  # N = 83: some batches straddle epochs
    whole = BatchStream(tokens, 16, 8, seed=2)
    shards = [
      BatchStream(tokens, 16, 8, seed=2, process_index=i, process_count=processes)
      for i in range(processes)
    ]
    for step in (0, 9, 10, 11, 500):
      want = whole.batch(step)
      parts = [s.batch(step) for s in shards]
      for key in want:
        np.testing.assert_array_equal(
          np.concatenate([p[key] for p in parts]), want[key], err_msg=key
        )

  def test_resume_equals_uninterrupted(self):
    tokens = _tokens()
    run = BatchStream(tokens, 16, 8, seed=4)
    history = [run.batch(s) for s in range(200)]  # crosses two epochs (N=625)
    for k in (0, 1, 78, 79, 150, 199):
      _assert_batches_equal(BatchStream(tokens, 16, 8, seed=4).batch(k), history[k])
    # Going back after the cache moved on still gives the same batch.
    _assert_batches_equal(run.batch(3), history[3])

  def test_eval_batches_fixed_and_in_order(self):
    tokens = _tokens()
    stream = BatchStream(tokens, 16, 8, seed=0, split_name='val')
    batches = stream.eval_batches(3)
    assert len(batches) == 3
    ids = np.concatenate([b['sample_ids'] for b in batches])
    np.testing.assert_array_equal(ids, np.arange(24))
    again = BatchStream(tokens, 16, 8, seed=9).eval_batches(3)
    for a, b in zip(batches, again):
      _assert_batches_equal(a, b)
    # Never more batches than the split holds, so no window repeats.
    assert len(stream.eval_batches(10_000)) == stream.num_windows // 8

  def test_eval_batches_sharded(self):
    tokens = _tokens()
    whole = BatchStream(tokens, 16, 8, seed=0).eval_batches(2)
    halves = [
      BatchStream(tokens, 16, 8, seed=0, process_index=i, process_count=2).eval_batches(2)
      for i in range(2)
    ]
    for i, want in enumerate(whole):
      got = np.concatenate([halves[0][i]['inputs'], halves[1][i]['inputs']])
      np.testing.assert_array_equal(got, want['inputs'])

  def test_too_little_text(self):
    # 8 windows of 17 bytes need 8 * 16 + 1 = 129 bytes.
    BatchStream(_tokens(129), 16, 8, seed=0)
    with pytest.raises(ConfigError) as info:
      BatchStream(_tokens(128), 16, 8, seed=0, split_name='val')
    assert info.value.key == 'data.path'
    assert 'val text has 128 bytes' in info.value.message

  def test_validation_shorter_than_a_batch_repeats_from_its_start(self):
    # 5 windows of 17 bytes (81 bytes), a batch of 8: one batch, windows 0-4 then 0-2.
    stream = BatchStream(_tokens(81), 16, 8, seed=0, split_name='validation', evaluation=True)
    assert stream.num_eval_batches(4) == 1
    np.testing.assert_array_equal(stream.eval_batch(0)['sample_ids'], [0, 1, 2, 3, 4, 0, 1, 2])
    with pytest.raises(ConfigError, match='prepare --val_fraction') as info:
      BatchStream(_tokens(16), 16, 8, seed=0, split_name='validation', evaluation=True)
    assert info.value.key == 'data.path'

  def test_batch_not_divisible_by_processes(self):
    with pytest.raises(ConfigError) as info:
      BatchStream(_tokens(), 16, 6, seed=0, process_count=4)
    assert info.value.key == 'train.global_batch_size'


class TestCorpus:
  def test_stdlib_is_substantial(self, stdlib):
    assert stdlib.train.dtype == np.uint8
    assert stdlib.val.dtype == np.uint8
    assert stdlib.train.size > 1_000_000
    assert stdlib.val.size > 0
    assert stdlib.files == len(stdlib.train_files) + len(stdlib.val_files)
    assert 'stdlib' in stdlib.description

  def test_stdlib_split_by_file(self, stdlib):
    assert stdlib.val_files
    assert not set(stdlib.train_files) & set(stdlib.val_files)
    assert not any(
      'site-packages' in n or '__pycache__' in n or '/test/' in n or n.startswith('test/')
      for n in stdlib.train_files + stdlib.val_files
    )
    # Validation is roughly 5% of the files.
    assert 0.01 < len(stdlib.val_files) / stdlib.files < 0.15

  def test_stdlib_deterministic(self, stdlib):
    again = load_corpus('stdlib', '')
    np.testing.assert_array_equal(again.train, stdlib.train)
    np.testing.assert_array_equal(again.val, stdlib.val)

  def test_max_bytes_caps_in_sorted_order(self, stdlib):
    small = load_corpus('stdlib', '', max_bytes=200_000)
    names = small.train_files + small.val_files
    assert sorted(names) == sorted(stdlib.train_files + stdlib.val_files)[: len(names)]
    assert small.train.size + small.val.size <= (200_000 + len(SEPARATOR) * small.files)

  def test_text_file_byte_split(self, tmp_path):
    text = b'hello world\n' * 1000
    path = tmp_path / 'a.txt'
    path.write_bytes(text)
    corpus = load_corpus('text', str(path))
    assert corpus.files == 1
    assert corpus.val.size == len(text) // 20
    assert corpus.train.tobytes() + corpus.val.tobytes() == text

  def test_text_directory_split_by_file(self, tmp_path):
    for i in range(60):
      (tmp_path / f'doc{i:02d}.md').write_bytes(f'document {i}\n'.encode() * 50)
    (tmp_path / 'image.txt').write_bytes(b'\x89PNG\0\0binary')
    (tmp_path / 'skip.bin').write_bytes(b'not read')
    (tmp_path / '.git').mkdir()
    (tmp_path / '.git' / 'HEAD').write_bytes(b'ref: main')
    corpus = load_corpus('text', str(tmp_path))
    assert corpus.files == 60
    assert corpus.val_files
    assert not set(corpus.train_files) & set(corpus.val_files)
    first_val = (tmp_path / corpus.val_files[0]).read_bytes()
    assert corpus.val.tobytes().startswith(first_val)

  def test_text_errors(self, tmp_path):
    cases = [
      ('', 'data.path'),
      (str(tmp_path / 'missing.txt'), 'data.path'),
      (str(tmp_path), 'data.path'),  # empty directory: no text
    ]
    for path, key in cases:
      with pytest.raises(ConfigError) as info:
        load_corpus('text', path)
      assert info.value.key == key, path
    with pytest.raises(ConfigError) as info:
      load_corpus('wiki', '')
    assert info.value.key == 'data.source'

  def test_tiny_text_too_little_for_a_batch(self, tmp_path):
    path = tmp_path / 'tiny.txt'
    path.write_bytes(b'short text\n' * 10)
    corpus = load_corpus('text', str(path))
    with pytest.raises(ConfigError) as info:
      BatchStream(corpus.train, 64, 8, seed=0)
    assert info.value.key == 'data.path'


class TestEntropy:
  def test_uniform_is_eight_bits(self):
    tokens = np.tile(np.arange(256, dtype=np.uint8), 100)
    assert unigram_entropy_bits(tokens) == pytest.approx(8.0)
    assert unigram_entropy_nats(tokens) == pytest.approx(8 * math.log(2))

  def test_random_bytes_near_eight_bits(self):
    bits = unigram_entropy_bits(_tokens(1_000_000))
    assert bits == pytest.approx(8, abs=1e-3)

  def test_constant_is_zero(self):
    assert unigram_entropy_bits(np.zeros(10, np.uint8)) == 0.0

  def test_code_is_below_eight_bits(self, stdlib):
    assert 4.0 < unigram_entropy_bits(stdlib.val) < 6.0
