"""The data group's checks: what the keys say against each other, told
without reading any file (config.validate dispatches here). Plain Python.
"""

from __future__ import annotations

import math

from triax import checks
from triax.errors import ConfigError

SOURCES = ('stdlib', 'text', 'tokens', 'megatron', 'mixture')
# Sources that read bytes themselves (data/corpus.py); the others read tokens made beforehand.
BYTE_SOURCES = ('stdlib', 'text')


def validate(d) -> None:
  """The data keys against each other: what can be told without reading any file.

  A key the source would ignore is an error, never dropped: data.path with
  stdlib or a mixture, data.mixture without data.source=mixture, a tokenizer
  with a source that reads bytes.
  """
  checks.one_of('data.source', d.source, SOURCES, what='source')
  if d.source in ('stdlib', 'mixture') and d.path:
    raise ConfigError(
      'data.path',
      f'data.source={d.source} does not read data.path ({d.path}); remove it, or use '
      'data.source=text (a text file or directory), tokens (a prepared directory) or megatron',
    )
  if d.source in ('tokens', 'megatron') and not d.path:
    need = 'the --out directory of python -m triax prepare' if d.source == 'tokens' else 'a PREFIX'
    raise ConfigError('data.path', f'data.source={d.source} needs data.path={need}')
  if d.source == 'mixture':
    if not d.mixture:
      raise ConfigError('data.mixture', 'data.source=mixture needs ((PATH, WEIGHT), ...)')
    for entry in d.mixture:
      if (
        not isinstance(entry, (list, tuple))
        or len(entry) != 2
        or not isinstance(entry[0], str)
        or not entry[0]
        or isinstance(entry[1], bool)
        or not isinstance(entry[1], (int, float))
        or not 0 < entry[1] < math.inf
      ):
        raise ConfigError('data.mixture', f'{entry!r} is not (PATH, WEIGHT) with a positive weight')
  elif d.mixture:
    raise ConfigError(
      'data.mixture', f'is read only with data.source=mixture (it is {d.source}); remove it'
    )
  if not isinstance(d.tokenizer, str) or not d.tokenizer:
    raise ConfigError('data.tokenizer', "give 'bytes', a tokenizer.json or a sentencepiece .model")
  if d.source in BYTE_SOURCES and d.tokenizer != 'bytes':
    raise ConfigError(
      'data.tokenizer',
      f'data.source={d.source} reads bytes; to train with {d.tokenizer}, tokenize the text with '
      'python -m triax prepare --tokenizer=... and use data.source=tokens',
    )
  checks.positive_int('data.max_text_bytes', d.max_text_bytes)
  checks.boolean('data.mask_documents', d.mask_documents)
  if d.mask_documents and d.source in BYTE_SOURCES:
    # Byte sources are one stream of text with no document boundaries recorded.
    raise ConfigError(
      'data.mask_documents',
      f'data.source={d.source} records no documents; prepare the text '
      '(python -m triax prepare) and use data.source=tokens, or set it to false',
    )
