"""Decoding a trained model: a prompt's continuation from given parameters.

A run's parameters come back from its workdir in model layer order
(training/workdir.py), onto one device or a `Placement`'s mesh whatever
(data, tensor, pipe, schedule) wrote them; training/sampling.py puts the two
together for `triax sample`.

Generation is one jitted program: a prefill of the (left-padded) prompts
into a per-layer K/V cache (GQA-sized), then one token a step against it.
Past model.seq_len tokens of context the remaining ones come from a sliding
window of the last seq_len tokens, rerun whole each step (as the cache-less
loop always did), so the model always sees the positions it was trained on
and the output is the cache-less loop's.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from triax import sharding as sharding_lib
from triax.data import tokenizer as tokenizer_lib
from triax.errors import ConfigError
from triax.model import registry


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How to pick each next token."""

  max_new_tokens: int = 200
  temperature: float = 0.8  # 0 = greedy (argmax)
  top_k: int = 0  # 0 = the whole vocabulary
  seed: int = 0

  def check(self, vocab_size: int | None = None) -> None:
    if self.max_new_tokens < 1:
      raise ConfigError('--max_new_tokens', f'must be >= 1, got {self.max_new_tokens}')
    if not self.temperature >= 0:
      raise ConfigError('--temperature', f'must be >= 0 (0 = greedy), got {self.temperature}')
    if self.top_k < 0 or (vocab_size is not None and self.top_k > vocab_size):
      raise ConfigError(
        '--top_k', f'must be in [0, {vocab_size or "vocab_size"}] (0 = no cut), got {self.top_k}'
      )
    if self.seed < 0:
      raise ConfigError('--seed', f'must be >= 0, got {self.seed}')


def encode_prompt(prompt: str, seq_len: int, tok: tokenizer_lib.Tokenizer) -> list[int]:
  """The prompt's tokens, which must fit the model's context."""
  tokens = tok.encode(prompt)
  if not tokens:
    raise ConfigError('--prompt', 'is empty; give at least one character to continue from')
  if len(tokens) > seq_len:
    raise ConfigError(
      '--prompt',
      f"is {len(tokens)} tokens ({tok.describe()}), longer than the model's context "
      f'of model.seq_len={seq_len}; shorten it',
    )
  return tokens


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where sampling runs: one device, or a (data, context, tensor, pipe) mesh.

  On a mesh the weights are split as evaluation splits the layers' (training's
  rules for heads, MLP and vocabulary over `tensor`; d_model over `pipe`,
  gathered a layer at a time), the embedding and head too, so a model that
  needs the mesh to fit is sampled there.
  The batch of one prompt is not split (data replicas compute the same).
  With context ranks the prefill's sequence is split over them
  (`prefill_rules`: the prompt's activations, s/c positions a device; GSPMD
  gathers what attention needs); a decode step's one position is not split
  (`rules`), and the weights never are.
  """

  mesh: jax.sharding.Mesh | None = None
  rules: tuple = ()
  prefill_rules: tuple = ()

  @property
  def context(self) -> int:
    return 1 if self.mesh is None else self.mesh.shape['context']

  @classmethod
  def build(cls, cfg, shape: tuple[int, ...] | None) -> Placement:
    """`shape`: (data, tensor, pipe) or (data, context, tensor, pipe); None: one device."""
    if shape is None:
      return cls()
    data, context, tensor, pipe = shape if len(shape) == 4 else (shape[0], 1, *shape[1:])
    m = cfg.model
    for key, size in (('num_heads', tensor), ('d_ff', tensor), ('vocab_size', tensor)):
      if m[key] % size:
        raise ConfigError('--mesh', f'model.{key}={m[key]} does not divide by tensor={tensor}')
    if m.d_model % pipe:
      raise ConfigError('--mesh', f'model.d_model={m.d_model} does not divide by pipe={pipe}')
    if m.seq_len % context:
      raise ConfigError('--mesh', f'model.seq_len={m.seq_len} does not divide by context={context}')
    devices = data * context * tensor * pipe
    if devices > jax.device_count():
      raise ConfigError(
        '--mesh',
        f'{"x".join(map(str, shape))} needs {devices} devices, there are {jax.device_count()}',
      )
    from triax import mesh as mesh_lib

    mesh_cfg = ml_collections.ConfigDict(cfg.mesh.to_dict())
    mesh_cfg.data, mesh_cfg.context, mesh_cfg.tensor, mesh_cfg.pipe = data, context, tensor, pipe
    mesh_cfg.dcn_data = mesh_cfg.dcn_context = mesh_cfg.dcn_tensor = mesh_cfg.dcn_pipe = 1
    mesh_cfg.device_order = ()
    mesh = mesh_lib.build_mesh(mesh_cfg, jax.devices()[:devices])
    split = {'batch': None, 'embed': 'pipe' if pipe > 1 else None, 'residual_seq': None}
    given = sharding_lib.resolve_rules(cfg, mesh_cfg)
    rules = tuple((name, split.get(name, axis)) for name, axis in given)
    decode = tuple((name, None if name == 'seq' else axis) for name, axis in rules)
    prefill = tuple((name, 'context' if name == 'seq' else axis) for name, axis in rules)
    return cls(mesh, decode, prefill if context > 1 else decode)

  def shardings(self, model) -> object:
    if self.mesh is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      return jax.tree.map(
        lambda _: device, model.logical_axes(), is_leaf=lambda a: isinstance(a, tuple)
      )
    return sharding_lib.tree_shardings(model.logical_axes(), self.mesh, self.rules)


def sampling_model(cfg):
  """The run's model as inference runs it: its own dtype, cuDNN attention only on GPU."""
  spec = registry.spec_from_config(cfg.model)
  attention = spec.attention if jax.default_backend() == 'gpu' else 'xla'
  return registry.build(dataclasses.replace(spec, attention=attention, remat='none'))


def _picker(sampling: Sampling):
  """(logits [..., vocab], key) -> token ids [...]: argmax, or a draw at the
  temperature among the top k."""
  greedy, top_k = sampling.temperature == 0, sampling.top_k

  def pick(logits, key):
    if greedy:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k:
      kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / sampling.temperature).astype(jnp.int32)

  return pick


def _sliding(model, params, pick, buffer, length, key, out, first: int, last: int):
  """Tokens first..last-1 of `out` by rerunning the model over the buffer of the
  last seq_len tokens (no cache): once full it slides left by one a token, so
  the model always sees the positions it was trained on."""
  seq_len = model.spec.seq_len

  def step(i, carry):
    buffer, length, key, out = carry
    logits = model.logits(params, buffer[None])[0]
    key, sub = jax.random.split(key)
    token = pick(logits[jnp.minimum(length, seq_len) - 1], sub)
    full = length >= seq_len
    buffer = jnp.where(full, jnp.roll(buffer, -1), buffer)
    buffer = buffer.at[jnp.minimum(length, seq_len - 1)].set(token)
    return buffer, length + 1, key, out.at[i].set(token)

  return jax.lax.fori_loop(first, last, step, (buffer, length, key, out))[-1]


def sampler(
  model,
  sampling: Sampling,
  prompt_len: int,
  batch: int = 1,
  *,
  cache: bool = True,
  prefill_rules: tuple | None = None,
  padded: bool = False,
):
  """The jitted generation of `sampling.max_new_tokens` tokens after
  left-padded prompts: (params, tokens [batch, prompt_len], start [batch], key)
  -> tokens [batch, max_new_tokens].

  With the K/V cache (`init_cache`, GQA-sized): one prefill of the prompts,
  then one token a step, each attending to the cached keys and values. While
  the context fits model.seq_len this is exactly the cache-less loop's
  computation; past it (one prompt only) the remaining tokens come from the
  cache-less sliding window, as before, so the output is the same.
  `cache=False` is that cache-less loop throughout (benchmarks compare them).
  `prefill_rules`: the logical rules the prefill is traced under (a
  Placement's, splitting the prompt over context ranks); None, the caller's.
  `padded`: the one prompt may be left-padded (context ranks pad it to a
  multiple of theirs).
  The sliding window reruns one unpadded prompt, so several prompts, or a
  padded one, must fit the cache with every new token.
  """
  seq_len, n = model.spec.seq_len, sampling.max_new_tokens
  pick = _picker(sampling)
  cached = min(n, seq_len - prompt_len + 1) if cache else 0
  if (batch > 1 or padded) and prompt_len + n - 1 > seq_len:
    prompts = f'{batch} prompts of up to' if batch > 1 else 'a prompt padded to'
    raise ConfigError(
      '--max_new_tokens',
      f'{prompts} {prompt_len} tokens and {n} new ones exceed model.seq_len={seq_len}; '
      'a sliding window is for one unpadded prompt (no context ranks): sample fewer tokens',
    )

  def run(params, tokens, start, key):
    out = jnp.zeros((batch, n), jnp.int32)
    if cached:
      caches = model.init_cache(batch)
      with contextlib.ExitStack() as stack:
        if prefill_rules is not None:
          stack.enter_context(sharding_lib.axis_rules(prefill_rules))
        logits, caches = model.decode(params, tokens, caches, 0, start)
      key, sub = jax.random.split(key)
      token = pick(logits[:, -1], sub)
      out = out.at[:, 0].set(token)

      def step(i, carry):
        caches, token, key, out = carry
        logits, caches = model.decode(params, token[:, None], caches, prompt_len + i - 1, start)
        key, sub = jax.random.split(key)
        token = pick(logits[:, 0], sub)
        return caches, token, key, out.at[:, i].set(token)

      _, _, key, out = jax.lax.fori_loop(1, cached, step, (caches, token, key, out))
    if cached == n:
      return out
    # One prompt (start = 0): the cache-less loop from where the cache stopped.
    context = jnp.concatenate([tokens[0], out[0, :cached]])
    length = prompt_len + cached
    buffer = jnp.zeros((seq_len,), jnp.int32)
    window = context[-seq_len:] if length >= seq_len else context
    buffer = jax.lax.dynamic_update_slice(buffer, window, (0,))
    rest = _sliding(model, params, pick, buffer, jnp.int32(length), key, out[0], cached, n)
    return rest[None]

  return jax.jit(run)


def generate(
  model,
  params,
  prompts,
  sampling: Sampling,
  placement: Placement = Placement(),
  *,
  cache: bool = True,
):
  """The `sampling.max_new_tokens` tokens after each prompt (a list of token
  ids, or a list of such lists for a batch): host int arrays, [new] or [batch, new]."""
  single = not prompts or not isinstance(prompts[0], (list, tuple, np.ndarray))
  rows = [list(prompts)] if single else [list(p) for p in prompts]
  width = max(len(r) for r in rows)
  # The prefill's positions split evenly over context ranks: more left
  # padding, which `start` masks.
  width = -(-width // placement.context) * placement.context
  tokens = np.zeros((len(rows), width), np.int32)
  start = np.array([width - len(r) for r in rows], np.int32)
  for i, r in enumerate(rows):
    tokens[i, start[i] :] = r  # left-padded: every row's last prompt token at width-1
  rules = placement.rules if placement.mesh is not None else None
  prefill = placement.prefill_rules if placement.mesh is not None else None
  padded = placement.context > 1
  run = sampler(
    model, sampling, width, len(rows), cache=cache, prefill_rules=prefill, padded=padded
  )
  with contextlib.ExitStack() as stack:
    if placement.mesh is not None:
      stack.enter_context(jax.set_mesh(placement.mesh))
    stack.enter_context(sharding_lib.axis_rules(rules))
    out = np.asarray(jax.device_get(run(params, tokens, start, jax.random.key(sampling.seed))))
  return out[0] if single else out
