"""Tokenizers: bytes (one token per byte), Hugging Face `tokenizer.json`, sentencepiece `.model`.

`data.tokenizer` names one: 'bytes', or a file path whose suffix says which
kind it is. Every tokenizer has a vocabulary size, an end-of-document id
(appended to each document by `triax prepare`, so a model sees where one
text ends and the next begins) and a fingerprint (the sha256 of its file),
which a prepared token directory records so it is never read with another
tokenizer. `train_bpe` trains a byte-level BPE locally, for users without a
tokenizer file; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable

from triax.errors import ConfigError

BYTES = 'bytes'

# Names models use for the end-of-document token, most common first. A
# tokenizer.json trained by `train_bpe` has the first one.
EOD_NAMES = ('<|endoftext|>', '</s>', '<eos>', '<|end_of_text|>', '<|eot_id|>')

# Megatron pads the vocabulary to a multiple of this times the tensor degree,
# so each tensor rank holds an equal, well-aligned slice of the embedding.
VOCAB_PAD_MULTIPLE = 128


class Tokenizer:
  """What the data layer needs of a tokenizer.

  Attributes:
    name: 'bytes' or the file path it was loaded from.
    kind: 'bytes', 'huggingface' or 'sentencepiece'.
    vocab_size: ids are in [0, vocab_size).
    eod_id: the end-of-document id.
    fingerprint: 'bytes', or the sha256 of the tokenizer file.
  """

  name: str
  kind: str
  vocab_size: int
  eod_id: int
  fingerprint: str

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def decode(self, ids: Iterable[int]) -> str:
    raise NotImplementedError

  def describe(self) -> str:
    return f'{self.kind} tokenizer ({self.vocab_size} ids)' + (
      f' {self.name}' if self.kind != BYTES else ''
    )

  def record(self) -> dict:
    """What a prepared directory's manifest says about its tokenizer."""
    return {
      'name': self.name,
      'kind': self.kind,
      'vocab_size': self.vocab_size,
      'eod_id': self.eod_id,
      'fingerprint': self.fingerprint,
    }


class BytesTokenizer(Tokenizer):
  """UTF-8 bytes; the end of a document is NUL, which text files do not contain.

  The byte corpus (data/corpus.py) drops files holding NUL bytes for the same
  reason, so NUL never means anything else.
  """

  name = kind = fingerprint = BYTES
  vocab_size = 256
  eod_id = 0

  def encode(self, text: str) -> list[int]:
    return list(text.encode('utf-8'))

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(int(i) for i in ids).decode('utf-8', errors='replace')


class HuggingFaceTokenizer(Tokenizer):
  kind = 'huggingface'

  def __init__(self, path: str):
    from tokenizers import Tokenizer as HFTokenizer

    try:
      self._tok = HFTokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception for a malformed file
      raise ConfigError(
        'data.tokenizer', f'{path} is not a Hugging Face tokenizer.json ({e}); give one'
      ) from None
    self.name = path
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    ids = [self._tok.token_to_id(n) for n in EOD_NAMES]
    found = [i for i in ids if i is not None]
    if not found:
      raise ConfigError(
        'data.tokenizer',
        f'{path} has no end-of-document token (one of {", ".join(EOD_NAMES)}); '
        'add one, or train a tokenizer with python -m triax tokenizer train',
      )
    self.eod_id = found[0]
    self.fingerprint = file_sha256(path)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids])

  def token(self, token_id: int) -> str:
    """The vocabulary's string for `token_id` (a special token's name)."""
    return self._tok.id_to_token(token_id)


class SentencePieceTokenizer(Tokenizer):
  kind = 'sentencepiece'

  def __init__(self, path: str):
    import sentencepiece

    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
      raise ConfigError(
        'data.tokenizer', f'{path} is not a sentencepiece model ({e}); give a .model file'
      ) from None
    self.name = path
    self.vocab_size = self._sp.get_piece_size()
    self.eod_id = self._sp.eos_id()
    if self.eod_id < 0:
      raise ConfigError(
        'data.tokenizer',
        f'{path} has no end-of-sentence piece (eos_id < 0); train it with --eos_id set',
      )
    self.fingerprint = file_sha256(path)

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])


def load(spec: str) -> Tokenizer:
  """The tokenizer `data.tokenizer` names.

  Raises:
    ConfigError: the file is missing, of an unknown kind, or malformed.
  """
  if spec == BYTES:
    return BytesTokenizer()
  if not isinstance(spec, str) or not spec:
    raise ConfigError(
      'data.tokenizer', f"give 'bytes', a tokenizer.json or a sentencepiece .model, got {spec!r}"
    )
  if not os.path.isfile(spec):
    raise ConfigError(
      'data.tokenizer',
      f'{spec}: no such file; give a tokenizer.json, a sentencepiece .model, or bytes '
      '(train one with python -m triax tokenizer train)',
    )
  if spec.endswith('.json'):
    return HuggingFaceTokenizer(spec)
  if spec.endswith('.model'):
    return SentencePieceTokenizer(spec)
  raise ConfigError(
    'data.tokenizer', f'{spec}: name a Hugging Face *.json or a sentencepiece *.model file'
  )


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def padded_vocab_size(vocab_size: int, tensor: int) -> int:
  """The vocabulary rounded up to a multiple of tensor * 128, as Megatron pads it."""
  unit = VOCAB_PAD_MULTIPLE * tensor
  return math.ceil(vocab_size / unit) * unit


def check_vocab(
  tokenizer: Tokenizer, model_vocab_size: int, tensor: int, vocab_used: int = 0
) -> None:
  """The model's vocabulary holds every id the tokenizer makes, and its
  padding (model.vocab_used) is exactly the ids past the tokenizer's.

  A vocabulary larger than the tokenizer's (Megatron's padding to a multiple
  of tensor * 128) is allowed only when said: model.vocab_used = the
  tokenizer's ids, so the padded ones are masked out of the loss and of
  sampling rather than trained towards zero probability without a word.

  Raises:
    ConfigError: on model.vocab_size (too small, naming the padded size to
      use) or model.vocab_used (not the tokenizer's id count).
  """
  n = tokenizer.vocab_size
  if n > model_vocab_size:
    padded = padded_vocab_size(n, tensor)
    # vocab_used only when there is padding to mask: otherwise it equals vocab_size.
    fix = (
      f'model.vocab_size={n}'
      if padded == n
      else f'model.vocab_size={padded} (its {n} ids padded to a multiple of mesh.tensor*'
      f'{VOCAB_PAD_MULTIPLE}, as Megatron pads) and model.vocab_used={n}'
    )
    raise ConfigError(
      'model.vocab_size',
      f'{model_vocab_size} is smaller than the {tokenizer.describe()}; set {fix}',
    )
  if (vocab_used or model_vocab_size) == n:
    return
  if n < model_vocab_size:
    who = f'{tokenizer.kind} tokenizer' + (f' {tokenizer.name}' if tokenizer.kind != BYTES else '')
    raise ConfigError(
      'model.vocab_used',
      f"set model.vocab_used={n} (the {who}'s {n} ids; the other {model_vocab_size - n} ids "
      f'of model.vocab_size={model_vocab_size} are padding, masked out of the loss)',
    )
  raise ConfigError(
    'model.vocab_used',
    f'{vocab_used} would mask ids of the {tokenizer.describe()}, which uses all '
    f'{n} of model.vocab_size; set model.vocab_used=0',
  )


def train_bpe(texts: Iterable[str], vocab_size: int, out: str) -> HuggingFaceTokenizer:
  """Trains a byte-level BPE (GPT-2 style) on `texts`, saves it to `out` (tokenizer.json).

  The 256 byte symbols are always in the vocabulary, so any text encodes;
  the end-of-document token is '<|endoftext|>'. The file is written to a
  temporary name and renamed, so `out` is never half-written.

  Raises:
    ConfigError: vocab_size too small to hold the bytes and the special token.
  """
  from tokenizers import Tokenizer as HFTokenizer
  from tokenizers import decoders, models, pre_tokenizers, trainers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise ConfigError(
      '--vocab_size', f'must be at least {len(alphabet) + 1} (the bytes and <|endoftext|>)'
    )
  tok = HFTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[EOD_NAMES[0]],
    initial_alphabet=alphabet,
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  tmp = out + '.tmp'
  tok.save(tmp)
  os.replace(tmp, out)
  return HuggingFaceTokenizer(out)
