"""Hugging Face checkpoints in and out of triax workdirs (`python -m triax convert`):
Llama, Qwen2/3 and their MoEs, Mixtral (hf_llama), DeepSeek-V3 (hf_deepseek), Gemma 3 (hf_gemma).

Import writes what a triax train run would have written at step 0: the
validated config (config.json, the model keys from the HF config), a
checkpoint of the converted weights with a fresh optimizer state, and the
HF config itself (hf_config.json, so an export keeps its token ids and the
like), the checkpoint's generation_config.json and the files transformers
keeps beside its tokenizer (TOKENIZER_FILES: tokenizer_config.json, ...) in
hf_files/; with a tokenizer (given, or the checkpoint's own tokenizer.json or
sentencepiece tokenizer.model), a copy of it (tokenizer.json or
tokenizer.model), the run's data.tokenizer, which triax sample
encodes and decodes with and `triax prepare` tokenizes fine-tuning text
with. A vocabulary other than 256 ids needs one: without it, ids would be
read as bytes. `python -m triax train --workdir=DIR` then fine-tunes it (on
the stdlib's bytes when it has no tokenizer, else on
`--config.data.source=tokens --config.data.path=TOKENS`) and
`python -m triax sample --workdir=DIR` samples it. Export writes the latest
checkpoint's parameters back as HF's config.json and safetensors, in the
imported checkpoint's dtype (or `--dtype`'s; `export_dtype`), with hf_files/
and the run's tokenizer beside them: transformers' AutoTokenizer and
GenerationConfig read the directory as they read the original.

Everything is checked (HF config, every tensor's name and shape, the
tokenizer, an empty workdir) before anything is written.

Both directions stream: an import reads one HF tensor at a time and writes
the checkpoint leaf by leaf, each leaf block by block (one layer's, or one
expert's, slice: convert/rules.py, training/blockwise.py); an export reads
the leaves block by block too, as they are stored (one layer of an imported
leaf; a stage's layers, or a whole leaf, of one training wrote) and writes
each HF tensor into place in the shards. Neither holds the model: an
import, one HF tensor and its block (and a chunk being written); an export,
one stored slab of a leaf (two leaves' for DeepSeek's kv projections) and a
tensor made of it.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_collections
import ml_dtypes
import numpy as np

from triax import config as config_lib
from triax.convert import hf_deepseek, hf_gemma, hf_llama, rules
from triax.convert import safetensors_files as files_lib
from triax.data import tokenizer as tokenizer_lib
from triax.errors import ConfigError
from triax.training import atomic
from triax.training import lock as lock_lib
from triax.training import workdir as workdir_lib

MAX_SHARD_BYTES = files_lib.MAX_SHARD_BYTES
# One module per group of HF architectures, each with MODEL_TYPES (HF model_type ->
# (triax family, HF class)), FAMILIES, model_config, hf_config, tensor_rules, ignored.
_CONVERTERS = (hf_llama, hf_deepseek, hf_gemma)


def _return_freed_buffers() -> None:
  """Makes glibc's malloc give buffers of 1 MiB or more back to the system when
  they are freed (where the C library is glibc; elsewhere nothing).

  A conversion allocates and frees one tensor-sized buffer after another,
  from Python and TensorStore's threads. glibc serves large ones with mmap
  only below a threshold that it raises to the size of the largest freed
  (up to 32 MiB), after which they come from its heaps and stay there once
  freed: measured on scripts/bench_convert.py's export, 525 MiB held at the
  end instead of 164 MiB. A fixed threshold keeps the peak to what is live.
  """
  import ctypes
  import ctypes.util

  name = ctypes.util.find_library('c')
  if name and 'libc.so' in name:
    libc = ctypes.CDLL(name)
    if hasattr(libc, 'mallopt') and hasattr(libc, 'gnu_get_libc_version'):
      libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


# glibc's mallopt parameter (malloc.h).
_M_MMAP_THRESHOLD = -3


def _for_model_type(hf: dict):
  """The converter of an HF config's model_type.

  Raises:
    ConfigError('--hf_dir', ...): a model_type none converts.
  """
  kind = hf.get('model_type')
  for converter in _CONVERTERS:
    if kind in converter.MODEL_TYPES:
      return converter
  known = [k for c in _CONVERTERS for k in c.MODEL_TYPES]
  raise ConfigError(
    '--hf_dir', f'config.json: model_type {kind!r}; only {", ".join(known)} are converted'
  )


def _for_family(family: str, workdir: str):
  """The converter of a triax family.

  Raises:
    ConfigError('--workdir', ...): a family none exports.
  """
  for converter in _CONVERTERS:
    if family in converter.FAMILIES:
      return converter
  raise ConfigError(
    '--workdir',
    f'{workdir} holds a {family} model; only llama, mixtral, deepseek and gemma3 export to HF: train '
    'one with a llama config, e.g. --config=experiments/llama_tiny.py (the same flags as '
    'gpt_tiny.py)',
  )


def _read_json(path: str, key: str) -> dict:
  if not os.path.isfile(path):
    raise ConfigError(key, f'{path}: no such file')
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(key, f'{path}: not JSON ({e})') from None


def import_config(hf: dict, seq_len: int):
  """The triax config (validated) of an HF config: defaults plus its model keys."""
  if seq_len <= 0:
    # No learned positions: seq_len is only the training window; the HF
    # context may be 128k, which a first fine-tune rarely wants.
    # A composite config (Gemma 3's multimodal one) keeps its text model's under text_config.
    text = hf.get('text_config') or hf
    seq_len = min(int(text.get('max_position_embeddings', 2048)), 2048)
  cfg = config_lib.defaults()
  for key, value in _for_model_type(hf).model_config(hf, seq_len).items():
    if isinstance(value, dict):
      for sub, v in value.items():
        cfg.model[key][sub] = v
    else:
      cfg.model[key] = value
  return cfg


def _portable(cfg, recorded: str) -> str:
  """The config.json an import writes: `cfg` with its tokenizer as data.tokenizer.

  The tokenizer is named by the workdir's copy (`recorded`, '' without one),
  as the workdir was given: fine-tuning reads text tokenized with it
  (`triax prepare --tokenizer=` that copy, `data.source=tokens`), and a byte
  source is then refused with that advice, where it would otherwise train the
  model's embedding on byte ids.
  """
  portable = ml_collections.ConfigDict(cfg.to_dict())
  if recorded:
    portable.data.tokenizer = recorded
  return portable.to_json(indent=2)


def _tokenizer_name(tokenizer: str) -> str:
  """The workdir's name for a copy of `tokenizer` (a sentencepiece model keeps its kind)."""
  return workdir_lib.TOKENIZER_MODEL if tokenizer.endswith('.model') else workdir_lib.TOKENIZER


# What transformers keeps beside a checkpoint's tokenizer.json, read by its
# AutoTokenizer (special tokens, the chat template; a sentencepiece model for
# its slow tokenizer, where the run's tokenizer is the json).
TOKENIZER_FILES = (
  'tokenizer_config.json',
  'special_tokens_map.json',
  'added_tokens.json',
  'chat_template.jinja',
  'chat_template.json',
  workdir_lib.TOKENIZER_MODEL,
)
# Beside the weights: GenerationConfig's (sampling defaults, stop ids).
GENERATION_CONFIG = 'generation_config.json'


def _side_files(hf_dir: str, tokenizer: str) -> list[str]:
  """The HF files an import keeps (in DIR/hf_files) and an export writes back:
  generation_config.json from `hf_dir`, the TOKENIZER_FILES beside the
  tokenizer (in `hf_dir` unless --tokenizer named another), but not the
  tokenizer itself. Their JSON is checked here, before anything is written.

  Raises:
    ConfigError('--hf_dir' or '--tokenizer', ...): one that is not JSON.
  """
  found = []
  places = [(hf_dir, (GENERATION_CONFIG,), '--hf_dir')]
  if tokenizer:
    beside = os.path.dirname(os.path.abspath(tokenizer))
    key = '--hf_dir' if beside == os.path.abspath(hf_dir) else '--tokenizer'
    places.append((beside, TOKENIZER_FILES, key))
  for where, names, key in places:
    for name in names:
      path = os.path.join(where, name)
      if not os.path.isfile(path) or (tokenizer and os.path.samefile(path, tokenizer)):
        continue
      if name.endswith('.json'):
        _read_json(path, key)
      found.append(path)
  return found


def import_hf(hf_dir: str, workdir: str, *, tokenizer: str = '', seq_len: int = 0) -> dict:
  """Writes a triax workdir holding the HF checkpoint in `hf_dir` (a model_type
  of a converter's MODEL_TYPES: hf_llama's, hf_deepseek's, hf_gemma's; an HF config is checked by its module).

  Returns:
    {'step': 0, 'params': parameter count, 'config': the triax config,
     'tokenizer': the workdir's copy of the tokenizer ('' without one),
     'left_behind': the checkpoint's tensors not imported (a tied lm_head's copy,
     DeepSeek's MTP layers, Gemma 3's vision tower), sorted}
  """
  from triax import mesh as mesh_lib
  from triax.training import checkpoint as ckpt_lib
  from triax.training import step as step_lib

  if not os.path.isdir(hf_dir):
    raise ConfigError('--hf_dir', f'{hf_dir}: no such directory')
  _return_freed_buffers()
  hf = _read_json(os.path.join(hf_dir, 'config.json'), '--hf_dir')
  if os.path.exists(workdir) and os.listdir(workdir):
    raise ConfigError(
      '--workdir', f'{workdir} is not empty; import into a new directory (nothing was written)'
    )
  cfg = import_config(hf, seq_len)
  if not tokenizer:  # where transformers (and our export) keep it
    for name in (workdir_lib.TOKENIZER, workdir_lib.TOKENIZER_MODEL):
      if os.path.isfile(os.path.join(hf_dir, name)):
        tokenizer = os.path.join(hf_dir, name)
        break
  if tokenizer:
    tok = tokenizer_lib.load(tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
      raise ConfigError(
        '--tokenizer',
        f'{tok.describe()} is larger than the checkpoint vocabulary {cfg.model.vocab_size}',
      )
  elif cfg.model.vocab_size != tokenizer_lib.BytesTokenizer.vocab_size:
    # Without one, sampling reads ids as bytes, and an id past 255 is no byte.
    raise ConfigError(
      '--tokenizer',
      f'the checkpoint has {cfg.model.vocab_size} token ids and {hf_dir} holds no '
      f'{workdir_lib.TOKENIZER} or {workdir_lib.TOKENIZER_MODEL}: give its tokenizer, '
      '--tokenizer=PATH/tokenizer.json (nothing was written)',
    )
  side_files = _side_files(hf_dir, tokenizer)
  # One device's worth of layout: the checkpoint restores under any other.
  cfg.mesh.data, cfg.mesh.tensor, cfg.mesh.pipe = -1, 1, 1
  # Saved as given (data = -1, whatever devices there are): validation
  # resolves it to this machine's count, which a fine-tune elsewhere lacks.
  recorded = os.path.join(workdir, _tokenizer_name(tokenizer)) if tokenizer else ''
  portable = _portable(cfg, recorded)
  cfg = config_lib.validate(cfg, jax.device_count())
  converter = _for_model_type(hf)
  shards = files_lib.Shards(hf_dir)
  tensor_rules = converter.tensor_rules(cfg.model, np.dtype(cfg.model.param_dtype), hf)
  ignored = converter.ignored(shards.names(), cfg.model, hf)
  rules.check_sources(tensor_rules, shards, ignored, cfg.model.family)

  lock_lib.check_free(workdir)
  os.makedirs(workdir, exist_ok=True)
  if tokenizer:
    shutil.copyfile(tokenizer, recorded)
  if side_files:
    os.makedirs(workdir_lib.path(workdir, workdir_lib.HF_FILES))
    for source in side_files:
      target = os.path.join(
        workdir_lib.path(workdir, workdir_lib.HF_FILES), os.path.basename(source)
      )
      shutil.copyfile(source, target)
  leaves = rules.import_leaves(tensor_rules)
  with lock_lib.WorkdirLock(workdir):
    trainer = step_lib.build_trainer(cfg, mesh_lib.build_mesh(cfg.mesh))
    ckpt = ckpt_lib.Checkpointer(workdir, cfg)
    ckpt.save_canonical(trainer, 0, _initial_state(trainer, leaves, shards.read))
    ckpt.wait()
    ckpt.close()
    atomic.write_json(workdir_lib.path(workdir, workdir_lib.HF_CONFIG), hf)
    atomic.write_text(workdir_lib.path(workdir, workdir_lib.CONFIG), portable)
  count = sum(int(np.prod(leaf.shape)) for leaf in leaves)
  return {
    'step': 0,
    'params': count,
    'config': cfg,
    'tokenizer': recorded,
    'left_behind': sorted(ignored),
  }


def _initial_state(trainer, leaves: list[rules.Leaf], read):
  """The canonical train state at step 0 of the parameters `leaves` make
  (`read(name)` an HF tensor), as `Deferred` leaves made while the
  checkpoint is written, with `optimizer.init`'s state (zeros, see
  `_zero_init`: written from a zero-strided view, never allocated)."""
  from triax.training import blockwise
  from triax.training import step as step_lib

  abstract = trainer.abstract_canonical_state()
  params = {}
  for leaf in leaves:
    blocks = lambda leaf=leaf: leaf.blocks(read)  # noqa: E731
    rules.put(
      params, leaf.path, blockwise.Deferred(leaf.shape, leaf.dtype, blocks, leaf.block_ndim)
    )
  made, wanted = _leaf_shapes(params), _leaf_shapes(abstract.params)
  if made != wanted:  # a converter's rules and the model disagree: a bug, not bad input
    odd = sorted(set(made.items()) ^ set(wanted.items()), key=str)[:3]
    raise ValueError(f"the converted leaves are not the model's: {odd}")
  _zero_init(trainer.optimizer, abstract.params)

  def zeros(s):
    view = lambda s=s: iter([((), np.broadcast_to(np.zeros((), s.dtype), s.shape))])  # noqa: E731
    return blockwise.Deferred(s.shape, s.dtype, view) if s.shape else np.zeros((), s.dtype)

  return step_lib.TrainState(
    step=np.zeros((), np.int32),
    params=params,
    opt_state=jax.tree.map(zeros, abstract.opt_state),
    # model.fp8=delayed's histories before the first step: all zero (None without it).
    fp8=jax.tree.map(zeros, abstract.fp8),
  )


def _leaf_shapes(tree) -> dict:
  """{leaf path: (shape, dtype)} of a tree of arrays, `Deferred`s or shape structs."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): (tuple(a.shape), np.dtype(a.dtype)) for p, a in flat}


def _zero_init(optimizer, shapes) -> None:
  """Raises unless `optimizer.init` gives zeros whatever the parameters (AdamW's
  moments and counts do), checked on ones of one element per leaf: the
  import writes the state at step 0 as zeros without the parameters in hand."""
  ones = jax.tree.map(lambda s: np.ones((1,) * len(s.shape), s.dtype), shapes)
  if any(np.any(np.asarray(a)) for a in jax.tree.leaves(optimizer.init(ones))):
    raise NotImplementedError(
      "the optimizer's initial state depends on the parameters; the import writes it as zeros"
    )


# What `--dtype` names: the floating dtypes HF checkpoints are released in.
EXPORT_DTYPES = {
  'float32': np.dtype(np.float32),
  'bfloat16': np.dtype(ml_dtypes.bfloat16),
  'float16': np.dtype(np.float16),
}


def export_dtype(dtype: str, base: dict | None, param_dtype: str) -> str:
  """The dtype an export writes the parameters in: `dtype` if given, else the
  imported checkpoint's own (`base`'s `dtype`, or the older `torch_dtype`),
  else the run's model.param_dtype.

  Training keeps fp32 master weights (model.param_dtype) whatever a checkpoint
  was released in; its own dtype is what a user of the export expects back,
  and a round trip of a bf16 checkpoint is then bit-identical (bf16 -> fp32 is
  exact, and back).

  `dtype` is one of EXPORT_DTYPES or '' (export_hf checks it first).
  """
  if dtype:
    return dtype
  for key in ('dtype', 'torch_dtype'):
    if (base or {}).get(key) in EXPORT_DTYPES:
      return base[key]
  return param_dtype


def export_hf(
  workdir: str,
  out_dir: str,
  *,
  max_shard_bytes: int = MAX_SHARD_BYTES,
  drop_mtp: bool = False,
  dtype: str = '',
) -> dict:
  """Writes the latest checkpoint of a llama, mixtral, deepseek or gemma3 workdir
  as an HF checkpoint directory; `drop_mtp`: a deepseek's MTP modules are left
  behind (no HF class holds them; without it such a model is refused); `dtype`:
  see `export_dtype` (parameters the model keeps in fp32 whatever its dtype,
  DeepSeek's router, stay fp32). config.json's dtype says what was written.
  An import's other HF files (DIR/hf_files: tokenizer_config.json,
  generation_config.json, ...) and the run's tokenizer are written beside;
  a run trained here gets its own (`_made_side_files`).

  Returns:
    {'step': the checkpoint's step, 'files': names written, 'architecture': HF's class name,
     'dtype': the parameters' dtype}
  """
  if dtype and dtype not in EXPORT_DTYPES:
    raise ConfigError('--dtype', f'{dtype!r}: give {", ".join(EXPORT_DTYPES)}, or leave it out')
  _return_freed_buffers()
  cfg = workdir_lib.load_config(workdir)
  converter = _for_family(cfg.model.family, workdir)
  if os.path.exists(out_dir) and os.listdir(out_dir):
    raise ConfigError('--hf_dir', f'{out_dir} is not empty; export into a new directory')
  base = None
  if os.path.isfile(workdir_lib.path(workdir, workdir_lib.HF_CONFIG)):
    base = _read_json(workdir_lib.path(workdir, workdir_lib.HF_CONFIG), '--workdir')
  written = export_dtype(dtype, base, cfg.model.param_dtype)
  exported = cfg.model
  if drop_mtp and exported.get('mtp_depth'):
    exported = ml_collections.ConfigDict(exported.to_dict())
    exported.mtp_depth = 0  # the model HF's class holds: its head without the MTP modules
  # Before anything is read or written: a model no HF class holds is refused here.
  hf_config = converter.hf_config(exported, base)
  hf_config.pop('torch_dtype', None)
  # transformers 5 writes `dtype`, older ones `torch_dtype`; both read either.
  hf_config['dtype' if base is None or 'dtype' in base else 'torch_dtype'] = written
  reader, shapes = workdir_lib.params_reader(workdir, cfg)  # checked as a resume checks it
  tensor_rules = converter.tensor_rules(exported, np.dtype(exported.param_dtype), hf_config)
  created = not os.path.exists(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  param_dtype = np.dtype(exported.param_dtype)

  def dtype_of(path):
    stored = np.dtype(rules.get(shapes, path).dtype)
    return EXPORT_DTYPES[written] if stored == param_dtype else stored

  specs = rules.export_specs(tensor_rules, dtype_of)
  dtypes = {name: spec_dtype for name, _, spec_dtype in specs}
  writer = files_lib.ShardWriter(out_dir, specs, max_shard_bytes)
  try:
    for rule in tensor_rules:
      # The rule's leaves block by block, in step: each block index is one HF tensor.
      stored = [reader.blocks(path, rule.names.ndim) for path in rule.paths]
      for blocks in zip(*stored):
        name = rule.names[blocks[0][0]]
        tensor = rule.to_hf(*(block for _, block in blocks))
        writer.write(name, _cast(name, tensor, dtypes[name], written))
  except ConfigError:
    # out_dir was empty or absent: everything in it is this export's (the
    # writer holds no file open between writes).
    for name in os.listdir(out_dir):
      os.remove(os.path.join(out_dir, name))
    if created:
      os.rmdir(out_dir)
    raise
  writer.close()
  atomic.write_json(os.path.join(out_dir, 'config.json'), hf_config)
  kept = workdir_lib.path(workdir, workdir_lib.HF_FILES)
  for name in sorted(os.listdir(kept)) if os.path.isdir(kept) else ():
    shutil.copyfile(os.path.join(kept, name), os.path.join(out_dir, name))
  tok = _run_tokenizer_file(workdir, cfg)
  if tok is not None:
    shutil.copyfile(tok, os.path.join(out_dir, _tokenizer_name(tok)))
    if base is None:  # a run trained here: no HF files of its own
      for name, record in _made_side_files(tok, cfg.model.seq_len).items():
        atomic.write_json(os.path.join(out_dir, name), record)
  for name in os.listdir(out_dir):
    # safetensors writes 0600; a checkpoint to share reads as HF's do.
    os.chmod(os.path.join(out_dir, name), 0o644)
  architecture = hf_config['architectures'][0]
  return {
    'step': reader.step,
    'files': sorted(os.listdir(out_dir)),
    'architecture': architecture,
    'dtype': written,
  }


def _cast(name: str, tensor: np.ndarray, dtype: np.dtype, written: str) -> np.ndarray:
  """`tensor` as `dtype`.

  Raises:
    ConfigError('--dtype', ...): float16, whose range (65504) is fp32's and
      bfloat16's in nothing, would turn a value of it into an infinity.
  """
  with np.errstate(over='ignore'):  # an overflow is refused below, with its name
    out = tensor.astype(dtype, copy=False)
  if dtype == np.float16 and not np.isfinite(out).all() and np.isfinite(tensor).all():
    largest = float(np.max(np.abs(tensor)))
    raise ConfigError(
      '--dtype',
      f"{name} holds {largest:g}, past {written}'s range: export bfloat16 or float32 "
      '(nothing was written)',
    )
  return out


def _made_side_files(tokenizer: str, seq_len: int) -> dict[str, dict]:
  """The side files an export of a run trained here (no import's files) writes:
  generation_config.json, whose stop id is the tokenizer's end of document,
  and for a tokenizer.json a tokenizer_config.json naming the fast tokenizer
  class and that token. Without them AutoTokenizer knows no eos token and
  generate() does not stop at a document's end (transformers 5.25)."""
  tok = tokenizer_lib.load(tokenizer)
  files = {GENERATION_CONFIG: {'eos_token_id': tok.eod_id}}
  if tok.kind == 'huggingface':
    files['tokenizer_config.json'] = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      'eos_token': tok.token(tok.eod_id),
      'model_max_length': seq_len,
      'clean_up_tokenization_spaces': False,
    }
  return files


def _run_tokenizer_file(workdir: str, cfg) -> str | None:
  """The file of the run's tokenizer (as workdir.tokenizer picks it), if it has one."""
  if cfg.data.tokenizer != tokenizer_lib.BYTES:
    return cfg.data.tokenizer if os.path.isfile(cfg.data.tokenizer) else None
  for name in (workdir_lib.TOKENIZER, workdir_lib.TOKENIZER_MODEL):
    if os.path.isfile(os.path.join(workdir, name)):
      return os.path.join(workdir, name)
  return None
