"""Prints what a trained run writes: `python -m triax sample --workdir=DIR --prompt="def "`.

Restores the latest checkpoint of DIR (written under any parallel layout;
its checksums checked as a resume checks them) onto one device and prints
the prompt followed by the sampled continuation, decoded with the run's
tokenizer (bytes unless it trained on, or was imported with, another).
Kept to flag parsing and one library call (triax.training.sampling).
"""

import math
import sys

from absl import flags

from triax import cli

_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'Workdir of a triax train run (its config.json and checkpoints).'
)
_PROMPT = flags.DEFINE_string('prompt', None, 'Text to continue (at most model.seq_len tokens).')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 200, 'Tokens to generate.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 = greedy.')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample among the k likeliest tokens; 0 = all.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed: the same seed gives the same text.')
_MESH = flags.DEFINE_string(
  'mesh',
  '',
  'DATA,TENSOR,PIPE or DATA,CONTEXT,TENSOR,PIPE: sample on that mesh with the weights split '
  "(a model that needs it to fit), the prompt's prefill split over CONTEXT ranks; "
  "'' = one device. On a CPU it forces that many devices.",
)
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices',
  1,
  'Force this many CPU devices (set before JAX starts; ignored when an accelerator is present).',
)


def main(argv):
  if not _WORKDIR.value:
    cli.fail('--workdir', 'is required: the workdir of a triax train run')
  if _PROMPT.value is None:
    cli.fail('--prompt', 'is required, e.g. --prompt="def "')
  mesh = None
  if _MESH.value:
    try:
      mesh = tuple(int(x) for x in _MESH.value.split(','))
    except ValueError:
      mesh = ()
    if len(mesh) not in (3, 4) or min(mesh) < 1:
      cli.fail(
        '--mesh',
        'give DATA,TENSOR,PIPE or DATA,CONTEXT,TENSOR,PIPE as positive integers, '
        f'got {_MESH.value!r}',
      )
  devices = _CPU_DEVICES.value
  if mesh and _CPU_DEVICES.present == 0:
    devices = math.prod(mesh)
  cli.force_cpu_devices(devices)
  from triax.model import generation  # after the device count is set
  from triax.training import sampling as sampling_lib

  sampling = generation.Sampling(
    max_new_tokens=_MAX_NEW_TOKENS.value,
    temperature=_TEMPERATURE.value,
    top_k=_TOP_K.value,
    seed=_SEED.value,
  )
  with cli.config_errors_exit():
    _check_tokenizer(_WORKDIR.value)
    result = sampling_lib.sample(_WORKDIR.value, _PROMPT.value, sampling, mesh)
  # stdout holds the text alone, so it can be piped; where it came from goes to stderr.
  print(f'[checkpoint step {result["step"]} of {_WORKDIR.value}]', file=sys.stderr)
  print(result['text'])


def _check_tokenizer(workdir: str) -> None:
  """Refuses a model whose ids its tokenizer cannot decode: bytes stop at 255, and a
  workdir imported before convert asked for the tokenizer may have 128k ids."""
  from triax.data import tokenizer as tokenizer_lib
  from triax.training import workdir as workdir_lib

  cfg = workdir_lib.load_config(workdir)
  ids = cfg.model.vocab_used or cfg.model.vocab_size
  tok = workdir_lib.tokenizer(workdir, cfg)
  if tok.kind == tokenizer_lib.BYTES and ids > tok.vocab_size:
    cli.fail(
      '--workdir',
      f'{workdir}: the model has {ids} token ids but no tokenizer (bytes decode 256): copy '
      f"the checkpoint's tokenizer.json to {workdir}/{workdir_lib.TOKENIZER}",
    )


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
