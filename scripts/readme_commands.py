"""Runs README.md's commands in order from a fresh clone, as a newcomer would.

Every fenced block of README.md has a tag in the HTML comment on the line
above it (GitHub does not show it) saying how it is checked:

  <!-- readme: run -->               run as written
  <!-- readme: run given=texts -->   run after putting in place what a user
                                     brings (GIVEN below: their own text, a
                                     Hugging Face checkpoint; several
                                     given=NAME, each put in place once)
  <!-- readme: synopsis -->          a usage sketch ([optional] parts, DIR):
                                     not run, but its commands, config files,
                                     flags and config keys must exist
  <!-- readme: slurm -->             run with --slurm, in a fresh clone, where a SLURM
                                     cluster answers (tests/test_slurm.py starts one);
                                     otherwise checked statically only
  <!-- readme: skip REASON -->       needs what this machine has not (GPUs)

A block without a tag is an error, so a new block is never skipped silently.
Every block is checked statically first (commands, files, flags, config keys).
The `run` blocks are then one bash session in a fresh `git clone` of the
commit (a user's one terminal: `source .venv/bin/activate` in one block holds
for the next), each block announced, the first failing command ending it.

  python scripts/readme_commands.py [--skip=scripts/test.sh] [--check_only]
      [--rev=HEAD] [--clone_dir=DIR] [--keep] [--slurm]

With --slurm only the `slurm` blocks run, with this interpreter's environment (its
directory first on PATH, the clone's src on PYTHONPATH: a user's installed triax), so
that srun's tasks find the same `python`.

The GIVEN checkpoint is written with transformers and torch, so run it with
the test extra's interpreter (`.venv/bin/python` after `scripts/test.sh`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

from absl import app, flags
from bench_harness import ROOT, run_python

_SKIP = flags.DEFINE_multi_string(
  'skip', [], 'A command line of a run block to leave out (e.g. scripts/test.sh: the suite).'
)
_CHECK_ONLY = flags.DEFINE_bool('check_only', False, 'Only the static checks; clone nothing.')
_REV = flags.DEFINE_string('rev', 'HEAD', 'The commit to clone.')
_CLONE_DIR = flags.DEFINE_string('clone_dir', '', 'Where to clone (default: a new temp dir).')
_KEEP = flags.DEFINE_bool('keep', False, 'Keep the clone afterwards.')
_SLURM = flags.DEFINE_bool(
  'slurm', False, 'Run the slurm blocks (and only them) against the SLURM cluster sinfo answers.'
)

TAG = re.compile(r'<!--\s*readme:\s*(run|synopsis|slurm|skip)\b(.*?)-->')
FENCE = '```'


@dataclasses.dataclass
class Block:
  line: int  # README line of the opening fence
  mode: str  # run | synopsis | skip
  options: str  # given=NAME for run, the reason for skip
  text: str


def blocks(readme: str) -> list[Block]:
  """README's fenced blocks with their tags; an untagged block raises."""
  lines = readme.splitlines()
  found, i = [], 0
  while i < len(lines):
    if not lines[i].startswith(FENCE):
      i += 1
      continue
    end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(FENCE))
    tag = TAG.search(lines[i - 1]) if i else None
    if tag is None:
      raise SystemExit(f'error: README.md:{i + 1}: a block without a `<!-- readme: ... -->` tag')
    text = '\n'.join(lines[i + 1 : end])
    found.append(Block(i + 1, tag.group(1), tag.group(2).strip(), text))
    i = end + 1
  return found


def commands(text: str) -> list[str]:
  """A block's command lines, continuations joined, comments dropped."""
  joined = re.sub(r'\s*\\\n\s*', ' ', text)
  return [
    re.sub(r'\s+#.*$', '', line).strip()
    for line in joined.splitlines()
    if line.strip() and not line.lstrip().startswith('#')
  ]


def triax_command(line: str) -> tuple[str, list[str]] | None:
  """(NAME, its --flag names) of a `python -m triax NAME ...` line, else None."""
  match = re.search(r'python -m triax (\w+)(.*)', line)
  if not match:
    return None
  return match.group(1), re.findall(r'--([a-z_][\w.]*)', match.group(2))


_HELP: dict[str, set[str]] = {}


def command_flags(name: str) -> set[str]:
  """The flags `python -m triax NAME --help` lists (what the command defines)."""
  if name not in _HELP:
    out = run_python(['-m', 'triax', name, '--help'])
    if out.returncode != 0:
      raise SystemExit(f'error: `python -m triax {name} --help` failed: {out.stderr[-500:]}')
    _HELP[name] = set(re.findall(r'^\s+--(?:\[no\])?([a-z_]\w*)', out.stdout, re.M))
  return _HELP[name]


def check(block: Block) -> list[str]:
  """What in a block names a command, file, flag or config key that does not exist."""
  from triax import config

  keys = config.defaults()
  problems = []
  for line in commands(block.text):
    words = line.replace('[', ' ').replace(']', ' ').split()
    for word in words:
      if word.startswith(('experiments/', 'scripts/')):
        path = re.split(r'[:\[]', word.split('=')[-1])[0]
        if not os.path.exists(os.path.join(ROOT, path)):
          problems.append(f'{path}: no such file')
    parsed = triax_command(line)
    if parsed is None:
      continue
    name, names = parsed
    known = command_flags(name)
    for flag in names:
      if flag.startswith('config.'):
        if not _has_key(keys, flag.split('.')[1:]):
          problems.append(f'{name}: --{flag}: no such config key')
      elif flag not in known:
        problems.append(f'{name}: --{flag}: not a flag of the command')
  return problems


def _has_key(node, path: list[str]) -> bool:
  for part in path:
    if not hasattr(node, 'keys') or part not in node:
      return False
    node = node[part]
  return True


def _texts(clone: str) -> None:
  """A user's folder of 30 text files: the first 30 public standard-library modules over 2 kB."""
  stdlib = sysconfig.get_paths()['stdlib']
  names = sorted(n for n in os.listdir(stdlib) if n.endswith('.py'))
  big = [
    n for n in names if not n.startswith('_') and os.path.getsize(os.path.join(stdlib, n)) > 2048
  ]
  chosen = big[:30]
  os.makedirs(os.path.join(clone, 'texts'))
  for name in chosen:
    shutil.copy(os.path.join(stdlib, name), os.path.join(clone, 'texts', name[:-3] + '.txt'))


def _hf_llama(clone: str) -> None:
  """A downloaded Llama checkpoint: a small random one as transformers writes it, and its BPE."""
  try:
    import torch
    import transformers
  except ImportError:
    raise SystemExit(
      'error: given=hf_llama: needs transformers and torch (the test extra): '
      'run this script with .venv/bin/python after scripts/test.sh'
    ) from None
  from triax.data import tokenizer as tokenizer_lib

  out = os.path.join(clone, 'Llama-3.2-1B')
  vocab = 512
  hf = transformers.LlamaConfig(
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
  )
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(hf).save_pretrained(out)
  stdlib = sysconfig.get_paths()['stdlib']
  with open(os.path.join(stdlib, 'argparse.py'), encoding='utf-8') as f:
    lines = f.read().splitlines()
  tokenizer_lib.train_bpe(lines, vocab, os.path.join(out, 'tokenizer.json'))


def _hf_qwen3(clone: str) -> None:
  """A downloaded Qwen3 checkpoint as the Hub holds one: a small random one that
  transformers writes in bfloat16 with its generation_config.json, and a BPE
  saved by transformers (tokenizer.json, tokenizer_config.json)."""
  try:
    import torch
    import transformers
  except ImportError:
    raise SystemExit(
      'error: given=hf_qwen3: needs transformers and torch (the test extra): '
      'run this script with .venv/bin/python after scripts/test.sh'
    ) from None
  from triax.data import tokenizer as tokenizer_lib

  out = os.path.join(clone, 'Qwen3-0.6B')
  vocab = 512
  hf = transformers.Qwen3Config(
    vocab_size=vocab,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    tie_word_embeddings=True,
  )
  torch.manual_seed(0)
  transformers.Qwen3ForCausalLM(hf).to(torch.bfloat16).save_pretrained(out)
  stdlib = sysconfig.get_paths()['stdlib']
  with open(os.path.join(stdlib, 'argparse.py'), encoding='utf-8') as f:
    lines = f.read().splitlines()
  bpe = os.path.join(clone, 'qwen3_bpe.json')
  tokenizer_lib.train_bpe(lines, vocab, bpe)
  transformers.PreTrainedTokenizerFast(
    tokenizer_file=bpe, eos_token='<|endoftext|>', pad_token='<|endoftext|>'
  ).save_pretrained(out)
  os.remove(bpe)


GIVEN = {'texts': _texts, 'hf_llama': _hf_llama, 'hf_qwen3': _hf_qwen3}


def givens(run_blocks: list[Block]) -> list[str]:
  """What the blocks' `given=NAME` tags ask for, each once, in order."""
  names = [n for b in run_blocks for n in re.findall(r'given=(\w+)', b.options)]
  return list(dict.fromkeys(names))


def session(run_blocks: list[Block], skip: list[str]) -> str:
  """One bash script running the blocks in order, each announced, stopping at the first failure."""
  parts = ['set -euo pipefail']
  for block in run_blocks:
    parts.append(f'echo "=== README.md:{block.line}"')
    for line in commands(block.text):
      if line in skip:
        parts.append(f'echo {shlex.quote("--- skipped: " + line)}')
      else:
        parts += [f'echo {shlex.quote("--- " + line)}', line]
  return '\n'.join(parts) + '\n'


def run_in_clone(run_blocks: list[Block], skip: list[str], installed: bool = False) -> int:
  """Runs the blocks as one session in a fresh clone; its exit status. `installed`: with
  this interpreter's environment and the clone's src (the slurm blocks), else a bare one."""
  clone = _CLONE_DIR.value or tempfile.mkdtemp(prefix='triax-readme-')
  subprocess.run(['git', 'clone', '--quiet', ROOT, clone], check=True)
  subprocess.run(['git', '-C', clone, 'checkout', '--quiet', _REV.value], check=True)
  for name in givens(run_blocks):
    GIVEN[name](clone)
  script = session(run_blocks, skip)
  print(f'readme: running {len(run_blocks)} blocks in {clone}', flush=True)
  # A fresh terminal, not bench_harness.run_python's: the clone's own install,
  # no venv on PATH (the README says when to activate one).
  env = {k: v for k, v in os.environ.items() if k not in ('VIRTUAL_ENV', 'PYTHONPATH')}
  env['PATH'] = os.pathsep.join(
    p for p in env['PATH'].split(os.pathsep) if not p.startswith(os.path.dirname(sys.executable))
  )
  if installed:
    env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
    env['PYTHONPATH'] = os.path.join(clone, 'src')
  start = time.time()
  code = subprocess.run(['bash', '-c', script], cwd=clone, env=env).returncode
  print(
    f'readme: {"all passed" if code == 0 else f"FAILED (exit {code})"} in {time.time() - start:.0f} s'
  )
  if not _KEEP.value and code == 0:
    shutil.rmtree(clone)
  return code


def run_slurm(slurm_blocks: list[Block]) -> int:
  """The slurm blocks in a fresh clone, once `sinfo` shows a node that can take jobs."""
  try:
    states = subprocess.run(['sinfo', '-h', '-o', '%T'], capture_output=True, text=True)
  except FileNotFoundError:
    sys.exit('error: --slurm: no sinfo on PATH: install SLURM (Debian: slurm-wlm) or drop --slurm')
  if states.returncode != 0 or not {'idle', 'mixed'} & set(states.stdout.split()):
    sys.exit(
      f'error: --slurm: no SLURM node is idle (sinfo: {(states.stdout + states.stderr).strip()!r}); '
      'start the cluster, or set SLURM_CONF to its slurm.conf'
    )
  return run_in_clone(slurm_blocks, [], installed=True)


def main(argv: list[str]) -> None:
  del argv
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    found = blocks(f.read())
  bad = False
  for block in found:
    problems = [] if block.mode == 'skip' else check(block)
    for problem in problems:
      print(f'README.md:{block.line}: {problem}')
    bad |= bool(problems)
    print(f'README.md:{block.line}: {block.mode} {block.options}'.rstrip())
  if bad:
    sys.exit(1)
  if _CHECK_ONLY.value:
    return
  if _SLURM.value:
    sys.exit(run_slurm([b for b in found if b.mode == 'slurm']))
  unknown = [s for s in _SKIP.value if not any(s in commands(b.text) for b in found)]
  if unknown:
    sys.exit(f'error: --skip: {unknown[0]!r} is no command line of a run block')
  sys.exit(run_in_clone([b for b in found if b.mode == 'run'], _SKIP.value))


if __name__ == '__main__':
  app.run(main)
