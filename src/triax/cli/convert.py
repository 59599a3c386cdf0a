"""Hugging Face Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3 and Gemma 3
checkpoints in and out of triax workdirs.

  python -m triax convert --hf_dir=DIR --workdir=WORKDIR [--tokenizer=tokenizer.json]
  python -m triax convert --workdir=WORKDIR --hf_dir=OUT --export [--max_shard_size=5GB]
      [--dtype=bfloat16]

Import reads DIR's config.json and *.safetensors (one file or shards) and
writes a workdir at step 0 that `python -m triax train --workdir=WORKDIR`
fine-tunes and `python -m triax sample --workdir=WORKDIR` samples; export
writes the workdir's latest checkpoint back as transformers' Llama (Mistral,
Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3, Gemma 3's text model), in the
imported checkpoint's dtype, with its tokenizer and generation files. Both stream: one tensor, or one leaf's
block, at a time (triax.convert.hf_checkpoint). Kept to flag parsing and one
library call.
"""

import sys

from absl import flags

from triax import cli

_HF_DIR = flags.DEFINE_string(
  'hf_dir',
  None,
  'A Hugging Face Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE, DeepSeek-V3 or Gemma 3 '
  'checkpoint directory '
  '(read; with --export, written).',
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'The triax workdir (written; with --export, read).')
_EXPORT = flags.DEFINE_bool(
  'export', False, 'Write WORKDIR as a Hugging Face checkpoint in HF_DIR.'
)
_DROP_MTP = flags.DEFINE_bool(
  'drop_mtp',
  False,
  "Export: leave a deepseek model's multi-token prediction modules behind (DeepseekV3ForCausalLM "
  'holds none; without this flag such a model is refused).',
)
_TOKENIZER = flags.DEFINE_string(
  'tokenizer',
  '',
  "The checkpoint's tokenizer.json (or sentencepiece .model), copied into the workdir for triax "
  'sample and prepare; default: HF_DIR/tokenizer.json, else HF_DIR/tokenizer.model, if there is '
  'one (a vocabulary other than 256 bytes needs one).',
)
_SEQ_LEN = flags.DEFINE_integer(
  'seq_len', 0, 'Training window (model.seq_len); 0 = the HF context, at most 2048.'
)
_MAX_SHARD_SIZE = flags.DEFINE_string(
  'max_shard_size',
  '5GB',
  "Export: the largest safetensors shard, as transformers' max_shard_size reads it (bytes, or "
  'a size such as 5GB, 500MB or 2GiB).',
)
_DTYPE = flags.DEFINE_string(
  'dtype',
  '',
  "Export: the parameters' dtype in the safetensors (float32, bfloat16 or float16); default: "
  "the imported checkpoint's own (its config.json's dtype), else model.param_dtype. Training "
  'keeps fp32 master weights either way.',
)
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', None, 'Force this many CPU devices (ignored when an accelerator is present).'
)


def main(argv):
  if not _HF_DIR.value:
    cli.fail('--hf_dir', 'is required: the Hugging Face checkpoint directory')
  if not _WORKDIR.value:
    cli.fail('--workdir', 'is required: the triax workdir')
  if _DROP_MTP.value and not _EXPORT.value:
    cli.fail('--drop_mtp', 'is for --export; an import never has MTP modules')
  if _DTYPE.value and not _EXPORT.value:
    cli.fail('--dtype', 'is for --export; an import keeps model.param_dtype (fp32) for training')
  if _EXPORT.value and _TOKENIZER.value:
    cli.fail('--tokenizer', "is for import; an export copies the run's tokenizer, if it has one")
  cli.force_cpu_devices(_CPU_DEVICES.value)
  from triax.convert import hf_checkpoint, safetensors_files  # after the device count is set

  with cli.config_errors_exit():
    if _EXPORT.value:
      result = hf_checkpoint.export_hf(
        _WORKDIR.value,
        _HF_DIR.value,
        max_shard_bytes=safetensors_files.shard_bytes(_MAX_SHARD_SIZE.value),
        drop_mtp=_DROP_MTP.value,
        dtype=_DTYPE.value,
      )
      print(
        f'{_HF_DIR.value}: step {result["step"]} of {_WORKDIR.value} as {result["architecture"]} '
        f'in {result["dtype"]} '
        f'({", ".join(result["files"])})'
      )
      return
    result = hf_checkpoint.import_hf(
      _HF_DIR.value, _WORKDIR.value, tokenizer=_TOKENIZER.value, seq_len=_SEQ_LEN.value
    )
  m = result['config'].model
  # MLA's heads share one K/V latent, where GQA's share K/V heads.
  kv = f'K/V latent {m.kv_lora_rank}' if m.family == 'deepseek' else f'{m.num_kv_heads} K/V'
  window = f', a {m.sliding_window}-position window' if m.sliding_window else ''
  print(
    f'{_WORKDIR.value}: {m.family}, {result["params"] / 1e6:.1f}M parameters ({m.num_layers} '
    f'layers, d_model {m.d_model}, {m.num_heads} heads / {kv}{window}), checkpoint at step 0',
    file=sys.stderr,
  )
  left = result['left_behind']
  if left:  # the converter's choice (convert/hf_*.py `ignored`), said rather than silent
    print(f'left behind: {len(left)} tensors of the checkpoint ({left[0]}, ...)', file=sys.stderr)
  workdir, tokenizer = _WORKDIR.value, result['tokenizer']
  if not tokenizer:
    print(f'fine-tune: python -m triax train --workdir={workdir}')
  else:  # its text must be tokenized with the checkpoint's tokenizer first
    print(
      f'fine-tune: python -m triax prepare --input=TEXTS --tokenizer={tokenizer} --out=TOKENS\n'
      f'           python -m triax train --workdir={workdir} '
      '--config.data.source=tokens --config.data.path=TOKENS'
    )


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
