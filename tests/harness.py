"""Shared test helpers: tiny configs, trainers on device subsets, relative errors."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from triax import config
from triax.mesh import build_mesh
from triax.model import registry
from triax.pipeline import executor
from triax.training.step import TrainState, build_trainer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))


def load_script(name: str):
  """scripts/NAME.py as a module (benchmarks whose functions tests pin), with
  scripts/ on sys.path as a script run by path has it (they import bench_harness)."""
  scripts = os.path.join(ROOT, 'scripts')
  if scripts not in sys.path:
    sys.path.append(scripts)
  return load_file(os.path.join(scripts, f'{name}.py'), name)


def load_file(path: str, name: str):
  """The Python file at `path` as module `name` (a plan or config file under test)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def tiny_config(**overrides):
  """A model small enough to compile in seconds; dotted overrides like 'mesh.pipe'."""
  c = config.defaults()
  c.model.num_layers = 8
  c.model.d_model = 32
  c.model.num_heads = 8
  c.model.d_ff = 64
  c.model.seq_len = 16
  c.train.global_batch_size = 32
  c.train.warmup_steps = 1
  c.train.learning_rate = 1e-2
  for key, value in overrides.items():
    group, name = key.split('.')
    c[group][name] = value
  return c


def tiny_mixtral_config(**overrides):
  """tiny_config as a 2-layer Mixtral: 4 experts of d_ff 32, top-2, one shared expert."""
  return tiny_config(
    **{
      'model.family': 'mixtral',
      'model.num_layers': 2,
      'model.num_kv_heads': 4,
      'model.num_experts': 4,
      'model.experts_per_token': 2,
      'model.shared_experts': 1,
      'model.d_ff': 32,
      'train.global_batch_size': 16,
      **overrides,
    }
  )


def tiny_deepseek_config(**overrides):
  """tiny_config as a DeepSeek: a dense first block then 2 MoE blocks of 8
  experts (d_ff 16) in 4 groups, top-2 of 2 groups, one shared expert; MLA
  with q and K/V latents, v heads narrower than q/k's; one MTP module."""
  return tiny_config(
    **{
      'model.family': 'deepseek',
      'model.num_layers': 3,
      'model.num_heads': 4,
      'model.q_lora_rank': 16,
      'model.kv_lora_rank': 12,
      'model.qk_nope_head_dim': 8,
      'model.qk_rope_head_dim': 4,
      'model.v_head_dim': 6,
      'model.moe_d_ff': 16,
      'model.first_k_dense': 1,
      'model.num_experts': 8,
      'model.experts_per_token': 2,
      'model.shared_experts': 1,
      'model.n_group': 4,
      'model.topk_group': 2,
      'model.routed_scaling_factor': 2.5,
      'model.mtp_depth': 1,
      'model.router_aux_loss_scope': 'microbatch',
      'train.global_batch_size': 16,
      **overrides,
    }
  )


def microbatch_reference(cfg, m: int):
  """One device's step of `cfg`'s model over m micro-batches (rows j, j+m,
  ... as the trainer splits them): (the objectives' mean, its gradient,
  {figure: mean over the micro-batches}), from the trainer's seed and
  random_batch(cfg): what a pipelined trainer's loss_and_grad must give."""
  model = registry.build(registry.spec_from_config(config.validate(cfg, 1).model))
  params = jax.device_get(jax.jit(model.init)(jax.random.key(cfg.train.seed)))
  batch = random_batch(cfg)
  # [m, rows / m, ...]: micro-batch j's rows j, j + m, ... (the trainer's split).
  split = {k: np.swapaxes(v.reshape(-1, m, v.shape[-1]), 0, 1) for k, v in batch.items()}

  def objective(params):
    # A scan, not m unrolled copies of the model: one copy to compile.
    def one(total, micro):
      loss, metrics = model.objective(params, micro['inputs'], micro['targets'])
      return total + loss / m, metrics

    return jax.lax.scan(one, jnp.zeros((), jnp.float32), split)

  (loss, figures), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
  means = {k: float(np.mean(v)) for k, v in figures.items()}
  return float(loss), jax.device_get(grads), means


def model_of(**fields):
  """A family model from config.defaults().model with `fields` replaced."""
  model_cfg = config.defaults().model
  model_cfg.update(fields)
  return registry.build(registry.spec_from_config(model_cfg))


@contextlib.contextmanager
def cpu_dots(on: bool):
  """Within: CPU pipelines compiled with pipeline/cpu_dots.py's layout `on` or
  off. Off, they hold what XLA:TPU and XLA:GPU programs hold (no transposed
  operand copies): what the schedules' memory tests measure."""
  saved = executor._Setup.row_major_dots
  executor._Setup.row_major_dots = property(lambda self: on)
  try:
    yield
  finally:
    executor._Setup.row_major_dots = saved


def make_trainer(cfg):
  n = int(np.prod([cfg.mesh[a] for a in config.MESH_AXES]))
  if min(cfg.mesh[a] for a in config.MESH_AXES) < 0:
    n = jax.device_count()
  cfg = config.validate(cfg, n)
  mesh = build_mesh(cfg.mesh, jax.devices()[:n])
  return build_trainer(cfg, mesh)


def random_batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  ids = cfg.model.vocab_used or cfg.model.vocab_size  # never a padded id (model.vocab_used)
  toks = rng.integers(0, ids, (cfg.train.global_batch_size, cfg.model.seq_len + 1))
  return {'inputs': toks[:, :-1].astype(np.int32), 'targets': toks[:, 1:].astype(np.int32)}


_INITIAL = {}


def initial_params(trainer, seed: int):
  """The parameters `trainer.init_state(key(seed))` starts from, in its layout.

  XLA:CPU takes seconds to compile a model's random init (more than the
  pipelined gradient here); the layouts a parity test compares share one
  model, so its canonical init is compiled once and only re-laid out.
  """
  spec = dataclasses.replace(trainer.model.spec, remat='none')  # remat does not change init
  if (spec, seed) not in _INITIAL:
    _INITIAL[spec, seed] = jax.device_get(jax.jit(trainer.model.init)(jax.random.key(seed)))
  to_layout = jax.jit(trainer.layout.tree_to_pipeline, out_shardings=trainer.state_shardings.params)
  with jax.set_mesh(trainer.mesh):
    return to_layout(_INITIAL[spec, seed])


def loss_and_grads(cfg, seed=0):
  """Loss and gradients at initialisation, gradients in model layer order (host arrays)."""
  trainer = make_trainer(cfg)
  params = initial_params(trainer, cfg.train.seed)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(random_batch(cfg, seed), trainer.batch_sharding)
    loss, grads, _ = trainer.loss_and_grad(params, batch)
  return float(loss), trainer.layout.tree_to_model_order(jax.device_get(grads))


def initial_state(trainer, seed: int):
  """`trainer.init_state(key(seed))`'s state, the params from `initial_params`
  (compiled once per model) and a fresh optimizer state laid out like it."""
  params = initial_params(trainer, seed)
  shardings = trainer.state_shardings
  with jax.set_mesh(trainer.mesh):
    opt_state = jax.jit(trainer.optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return TrainState(step=step, params=params, opt_state=opt_state, fp8=trainer.init_fp8())


def train_losses(cfg, steps, seed=0):
  trainer = make_trainer(cfg)
  losses = []
  state = initial_state(trainer, cfg.train.seed)
  with jax.set_mesh(trainer.mesh):
    for _ in range(steps):
      batch = jax.device_put(random_batch(cfg, seed), trainer.batch_sharding)
      state, out = trainer.train_step(state, batch)
      losses.append(float(out['loss']))
  return losses


def collectives_by_computation(hlo: str, op: str) -> dict[str, int]:
  """How many `op` collectives (e.g. 'all-reduce', 'all-gather'; async starts
  included) each computation of compiled HLO text holds; the entry one is
  named 'ENTRY ...' (loop bodies and branches are others)."""
  out = {}
  for block in re.split(r'\n(?=\S)', hlo):
    name = block.split(' ', 2)[1] if block.startswith('ENTRY') else block.split(' ', 1)[0]
    count = len(re.findall(rf'\b{op}(?:-start)?\(', block))
    if count:
      out[('ENTRY ' if block.startswith('ENTRY') else '') + name] = count
  return out


def max_rel_err(a, b) -> float:
  """Largest over leaves of max|a-b| / max|a| (a is the reference)."""
  errs = jax.tree.map(
    lambda x, y: float(
      np.max(np.abs(np.asarray(x) - np.asarray(y)))
      / max(float(np.max(np.abs(np.asarray(x)))), 1e-30)
    ),
    a,
    b,
  )
  return max(jax.tree.leaves(errs))


def run_cli(module: str, *args: str, timeout: int = 600, env_extra=None):
  """Runs `python -m module args` in a fresh process (its own device count)."""
  return subprocess.run(
    [sys.executable, '-m', module, *args],
    cwd=ROOT,
    env=subprocess_env(env_extra),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def run_script(script: str, *args: str, env=None):
  """Runs scripts/`script` with `args` in a fresh process, this environment plus `env`."""
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, 'scripts', script), *args],
    capture_output=True,
    text=True,
    env=dict(os.environ, **(env or {})),
    cwd=ROOT,
  )


def flip_a_params_byte(workdir, step: int, params) -> str:
  """Flips a bit of checkpoint `step` where its params are: read without the
  checksums, they come back changed and orbax says nothing. `params` are
  those of the intact checkpoint, placed where a read puts them. Returns the file."""
  from triax.training import workdir as workdir_lib
  from triax.training.checkpoint import Checkpointer

  cfg = workdir_lib.load_config(workdir)
  target = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
  )
  state = os.path.join(workdir, workdir_lib.CHECKPOINTS, str(step), 'state')
  files = [os.path.join(root, n) for root, _, names in os.walk(state) for n in names]
  for path in sorted(files, key=os.path.getsize, reverse=True):  # the arrays' chunks first
    size = os.path.getsize(path)
    for at in range(size // 32, size, max(1, size // 16)):
      _flip_bit(path, at)
      unchecked, reason = Checkpointer(workdir, cfg)._read_params(step, target)
      if reason is None and any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(unchecked))
      ):
        return path
      _flip_bit(path, at)  # back: no params there, or orbax noticed
  raise AssertionError(f'no byte of {state} changes the params silently')


def _flip_bit(path: str, at: int) -> None:
  with open(path, 'r+b') as f:
    f.seek(at)
    byte = f.read(1)[0]
    f.seek(at)
    f.write(bytes([byte ^ 1]))


def file_bytes(directory) -> dict:
  """Every file under `directory` (a Path) and its bytes: what a refused command leaves as it was."""
  return {p.relative_to(directory): p.read_bytes() for p in directory.rglob('*') if p.is_file()}


# ------------------------------------------------ runs of `python -m triax train` on a text

SMOKE = 'experiments/gpt_tiny.py:smoke'


def write_corpus(path, size=5700, seed=0):
  """A text file whose training split is ~21 steps of the smoke config (one epoch)."""
  import random

  rng = random.Random(seed)
  words = 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu'.split()
  text = ''
  while len(text) < size:
    text += ' '.join(rng.choice(words) for _ in range(8)) + '\n'
  path.write_text(text)
  return str(path)


def smoke_text_flags(corpus):
  """The `--config.*` flags of a 24-step smoke run over `corpus` (write_corpus's:
  ~1.15 epochs), a checkpoint every 4 steps, an eval every 8, sample ids recorded:
  the run crash, resume, elastic and multi-process tests replay."""
  return [
    '--config.data.source=text',
    f'--config.data.path={corpus}',
    '--config.train.steps=24',
    '--config.checkpoint.every_steps=4',
    '--config.train.eval_every=8',
    '--config.train.record_sample_ids=true',
  ]


def text_run_config(corpus, **overrides):
  """tiny_config on every device (mesh.data=-1) reading the text `corpus`, in-process:
  a batch of 8, a metrics line every step, no eval, no warm-up, 10 checkpoints kept."""
  return tiny_config(
    **{
      'mesh.data': -1,
      'train.warmup_steps': 0,
      'checkpoint.keep': 10,
      'data.source': 'text',
      'data.path': corpus,
      'train.eval_every': 100,
      'train.log_every': 1,
      'train.global_batch_size': 8,
      **overrides,
    }
  )


def subprocess_env(extra=None) -> dict:
  """A child process's environment: this source tree, and the suite's XLA
  flags without the device count (the CLI's --cpu_devices decides it)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.path.join(ROOT, 'src') + os.pathsep + env.get('PYTHONPATH', '')
  env['XLA_FLAGS'] = env.get('TRIAX_TEST_XLA_FLAGS', '')
  env.update(extra or {})
  return env


def cli_env(extra=None):
  # scripts/launch_local.sh's trainers run this interpreter, not .venv's (which may be another jax).
  return subprocess_env({'PYTHON': sys.executable, **(extra or {})})


def start_train(workdir, flags, log, env_extra=None):
  """Starts `python -m triax train` on the smoke config, 8 CPU devices (stdout and
  stderr to `log`.out/.err)."""
  with open(f'{log}.out', 'w') as out, open(f'{log}.err', 'w') as err:
    return subprocess.Popen(
      [
        sys.executable,
        '-m',
        'triax.cli.train',
        f'--config={SMOKE}',
        f'--workdir={workdir}',
        '--cpu_devices=8',
        '--progress=false',
        *flags,
      ],
      cwd=ROOT,
      env=cli_env(env_extra),
      stdout=out,
      stderr=err,
    )
