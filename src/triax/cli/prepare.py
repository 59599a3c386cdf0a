"""Tokenizes text into token shards for training: `python -m triax prepare --input=FILES_OR_DIRS
--out=DIR [--tokenizer=tokenizer.json] [--text_key=text]`, then train with
`--config.data.source=tokens --config.data.path=DIR`.

Reads plain text, .jsonl, .parquet and .arrow files; a rerun on the same
inputs is a no-op, a damaged or unfinished output is rebuilt. Kept to flag
parsing and one library call (triax.data.prepare).
"""

from absl import flags

from triax import cli

_INPUT = flags.DEFINE_list('input', None, 'Files or directories to tokenize (comma-separated).')
_OUT = flags.DEFINE_string('out', None, 'Directory for the token shards and their manifest.')
_TOKENIZER = flags.DEFINE_string(
  'tokenizer', 'bytes', "'bytes', a Hugging Face tokenizer.json or a sentencepiece .model."
)
_TEXT_KEY = flags.DEFINE_string('text_key', 'text', 'Field of the text in .jsonl/.parquet/.arrow.')
_VAL_FRACTION = flags.DEFINE_float('val_fraction', 0.05, 'Share of documents held out.')
_WORKERS = flags.DEFINE_integer('workers', 0, 'Tokenizing processes; 0 = one per CPU.')
_SHARD_TOKENS = flags.DEFINE_integer('shard_tokens', 2**28, 'Most tokens per shard file.')
_PROGRESS = flags.DEFINE_bool('progress', True, 'Show a progress bar.')


def main(argv):
  if not _INPUT.value:
    cli.fail('--input', 'is required: the text files or directories to tokenize')
  if not _OUT.value:
    cli.fail('--out', 'is required: the directory to write the token shards to')
  from triax.data import prepare

  with cli.config_errors_exit():
    result = prepare.prepare(
      _INPUT.value,
      _OUT.value,
      tokenizer=_TOKENIZER.value,
      text_key=_TEXT_KEY.value,
      val_fraction=_VAL_FRACTION.value,
      workers=_WORKERS.value,
      shard_tokens=_SHARD_TOKENS.value,
      progress=_PROGRESS.value,
    )
  print(prepare.summary(_OUT.value, result))


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
