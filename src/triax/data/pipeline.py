"""The data of a run, from its validated config: sources opened and checked, batch streams,
and one line saying what will be trained on.

Everything that can be wrong with the data (missing, empty, unfinished or
damaged files, another tokenizer, ids the model cannot hold, too little
text for a batch) raises a ConfigError here, before anything is compiled or
written.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from triax.data import sources
from triax.data import tokenizer as tokenizer_lib
from triax.data.batches import BatchStream, Mixture, Samples
from triax.data.corpus import DEFAULT_MAX_BYTES, load_corpus, unigram_entropy_nats
from triax.errors import ConfigError

# The unigram baseline is computed on at most this many training tokens (all of a byte corpus).
ENTROPY_TOKENS = 2**26


@dataclasses.dataclass
class Data:
  """A run's data.

  Attributes:
    train: the training batches (a pure function of the step).
    val: the validation split; evaluation uses its first `eval_count` batches.
    eval_count: validation batches per evaluation.
    description: the start-up line (source, files, tokens, documents, epochs of this run).
    unigram_entropy: nats per token of the training tokens' unigram distribution.
  """

  train: BatchStream
  val: BatchStream
  eval_count: int
  description: str
  unigram_entropy: float


def open_source(source: str, path: str, cfg, key: str = 'data.path') -> sources.Split:
  """The train/val token streams of one source (not a mixture)."""
  d, m = cfg.data, cfg.model
  if source in ('stdlib', 'text'):
    limit = d.max_text_bytes if source == 'text' else DEFAULT_MAX_BYTES
    # Bytes are a tokenizer of 256 ids: a larger model.vocab_size is padding, said as such.
    bytes_tok = tokenizer_lib.BytesTokenizer()
    tokenizer_lib.check_vocab(bytes_tok, m.vocab_size, cfg.mesh.tensor, m.vocab_used)
    corpus = load_corpus(source, path, max_bytes=limit)
    return sources.Split(
      train=sources.TokenStream([corpus.train]),
      val=sources.TokenStream([corpus.val]),
      what=corpus.description,
      vocab_size=256,
    )
  try:
    if source == 'tokens':
      return sources.open_tokens(path, d.tokenizer, m.vocab_size, cfg.mesh.tensor, m.vocab_used)
    return sources.open_megatron(path, d.tokenizer, m.vocab_size, cfg.mesh.tensor, m.vocab_used)
  except ConfigError as e:
    # A mixture's entry is data.mixture's fault, not data.path's.
    if e.key == 'data.path' and key != 'data.path':
      raise ConfigError(key, e.message) from None
    raise


def _mixture_kind(path: str) -> str:
  if os.path.isdir(path):
    return 'tokens'
  prefix = sources.megatron_prefix(path)
  if os.path.isfile(prefix + '.idx') or os.path.isfile(prefix + '.bin'):
    return 'megatron'
  raise ConfigError(
    'data.mixture',
    f'{path} is neither a prepared directory nor a Megatron PREFIX (PREFIX.bin/.idx)',
  )


def load(cfg) -> Data:
  """Opens and checks the configured data; builds the train and validation streams.

  Raises:
    ConfigError: naming the data key at fault.
  """
  d = cfg.data
  b, s, seed = cfg.train.global_batch_size, cfg.model.seq_len, cfg.train.seed
  args = dict(seq_len=s, global_batch_size=b, seed=seed, mask_documents=d.mask_documents)
  if d.source == 'mixture':
    splits = [open_source(_mixture_kind(p), p, cfg, key='data.mixture') for p, _ in d.mixture]
    weights = [w for _, w in d.mixture]
    for (path, _), split in zip(d.mixture, splits):
      if (split.train.size - 1) // s < 1:
        raise ConfigError('data.mixture', f'{path} holds less than one window of {s + 1} tokens')
    parts = [
      Samples(split.train, s, seed, d.mask_documents, stream_index=2 + j)
      for j, split in enumerate(splits)
    ]
    train = BatchStream(Mixture(parts, weights, seed), split_name='train', **args)
    # Evaluation stays on one fixed text: the first source's validation split.
    val = BatchStream(splits[0].val, split_name='validation', evaluation=True, **args)
    per_source = '; '.join(
      f'{w / sum(weights):.1%} {split.what} ({split.train.size:,} train tokens, '
      f'{cfg.train.steps * b * w / sum(weights) / max(p.num_windows, 1):.3g} epochs)'
      for split, w, p in zip(splits, weights, parts)
    )
    what = f'mixture of {len(splits)} sources: {per_source}; validation on the first'
    entropy_tokens = splits[0].train.head(ENTROPY_TOKENS)
  else:
    split = open_source(d.source, d.path, cfg)
    train = BatchStream(split.train, split_name='train', **args)
    val = BatchStream(split.val, split_name='validation', evaluation=True, **args)
    docs = ''
    if split.train.num_documents is not None:
      docs = (
        f'; {split.train.size:,} train tokens in {split.train.num_documents:,} documents, '
        f'{split.val.size:,} val tokens in {split.val.num_documents:,}'
      )
    what = split.what + docs
    extra = cfg.model.vocab_size - split.vocab_size
    if extra > 0:
      # Megatron-style padding: ids no token maps to, so never a target; with
      # model.vocab_used, masked out of the loss and sampling too.
      what += f'; model.vocab_size={cfg.model.vocab_size} pads {extra} ids past the tokenizer'
      if cfg.model.vocab_used:
        what += ', masked out of the loss'
    entropy_tokens = split.train.head(ENTROPY_TOKENS)
  epochs = cfg.train.steps * b / train.num_windows
  description = (
    f'data: {what}; {train.num_windows:,} windows of {s + 1} tokens per epoch; '
    f'{cfg.train.steps} steps x {b} = {epochs:.3g} epochs'
  )
  if val.num_windows < b:
    description += f'; validation: {val.num_windows} windows, repeated to fill a batch of {b}'
  return Data(
    train=train,
    val=val,
    eval_count=val.num_eval_batches(cfg.train.eval_batches),
    description=description,
    unigram_entropy=unigram_entropy_nats(np.asarray(entropy_tokens)),
  )
