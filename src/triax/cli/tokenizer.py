"""Trains a byte-level BPE tokenizer locally: `python -m triax tokenizer train
--input=FILES_OR_DIRS --vocab_size=N --out=tokenizer.json`.

For users without a tokenizer file; nothing is downloaded. Inputs are read as
`triax prepare` reads them (text files, .jsonl with --text_key, .parquet,
.arrow). Kept to flag parsing and one library call (triax.data.tokenizer).
"""

import os

from absl import flags

from triax import cli

_INPUT = flags.DEFINE_list('input', None, 'Files or directories to train on (comma-separated).')
_VOCAB_SIZE = flags.DEFINE_integer('vocab_size', None, 'Vocabulary size, special token included.')
_OUT = flags.DEFINE_string('out', None, 'Where to write the tokenizer (a tokenizer.json).')
_TEXT_KEY = flags.DEFINE_string('text_key', 'text', 'Field of the text in .jsonl/.parquet/.arrow.')


def main(argv):
  if argv[1:] != ['train']:
    cli.fail('command', f'expected `train`, got {argv[1:]}; e.g. python -m triax tokenizer train')
  if not _INPUT.value:
    cli.fail('--input', 'is required: the text files or directories to train on')
  if _VOCAB_SIZE.value is None:
    cli.fail('--vocab_size', 'is required, e.g. --vocab_size=8192')
  if not _OUT.value or not _OUT.value.endswith('.json'):
    cli.fail('--out', 'is required and names a .json file, e.g. --out=tokenizer.json')
  parent = os.path.dirname(os.path.abspath(_OUT.value))
  if not os.path.isdir(parent):
    cli.fail('--out', f'{parent} is not a directory; create it first')
  from triax.data import documents, tokenizer

  with cli.config_errors_exit():
    inputs = documents.list_inputs(_INPUT.value)
    first = [next(iter(documents.read(i, _TEXT_KEY.value)), None) for i in inputs[:1]]
    del first  # reads the first record now, so a wrong --text_key fails before training
    texts = (t for i in inputs for t in documents.read(i, _TEXT_KEY.value))
    tok = tokenizer.train_bpe(texts, _VOCAB_SIZE.value, _OUT.value)
  fewer = (
    f' (asked for {_VOCAB_SIZE.value}: the text ran out of merges)'
    if tok.vocab_size < _VOCAB_SIZE.value
    else ''
  )
  print(
    f'{_OUT.value}: byte-level BPE, {tok.vocab_size} ids{fewer}, trained on {len(inputs)} files'
  )


def run():
  cli.run(main, takes_arguments=True)


if __name__ == '__main__':
  run()
