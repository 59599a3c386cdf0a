"""The learned planner's policy: its network, and the file that holds it with its feature schema.

The graph of one planning problem (features.graph builds it) has two kinds
of nodes, padded to fixed counts so one compiled program serves every
cluster:

  layer nodes   the model's layer groups, its embedding and its head (FLOPs,
                parameter and stash bytes per sequence), joined in sequence;
  device nodes  the cluster's device groups (peak FLOP/s, memory, memory
                bandwidth, count, node size and links, and a layer's time
                on it), joined to each other by edges that carry the link
                between them.

Every round, a layer node hears its sequence neighbours and the mean device
group, and a device group hears every other one through its link (a
message computed from the sender and the edge) and the mean layer; both
update residually under a LayerNorm. A decision (decisions.py's
`Decision`) is a choice among candidates: each is scored by an MLP of the
graph's readout, the decision's context (what was chosen before it) and the
candidate's own features, plus the embedding of the device group it names
(a stage's candidates are device groups: HeteroG's per-stage placement).

A `Policy` is the network's parameters with the `features.Schema` they
were trained on; `save` writes both (msgpack, flax.serialization) and
`load` reads a file back only when its schema can be fed by name
(`features.check`), refusing it with one ConfigError line otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from triax.errors import ConfigError
from triax.plan.learned import features
from triax.plan.learned.features import DEVICE_NODES, LAYER_NODES, MAX_CANDIDATES

NEG = -1e9


class Network(nn.Module):
  """Scores candidates of a batch of decisions on one graph.

  __call__(graph, ctx [B, CONTEXT], cand [B, C, CANDIDATE], node [B, C]
  (device group a candidate names, -1 for none), mask [B, C]) -> logits
  [B, C], NEG where masked.
  """

  hidden: int = 64
  rounds: int = 3

  @nn.compact
  def __call__(self, graph, ctx, cand, node, mask):
    h = self.hidden
    layer_mask = graph['layer_mask'][:, None]
    dev_mask = graph['dev_mask'][:, None]
    hl = nn.relu(nn.Dense(h, name='layer_in')(graph['layer_x']))
    hd = nn.relu(nn.Dense(h, name='device_in')(graph['dev_x']))
    groups = hd.shape[0]
    for r in range(self.rounds):
      dev_mean = (hd * dev_mask).sum(0) / jnp.maximum(dev_mask.sum(), 1.0)
      layer_mean = (hl * layer_mask).sum(0) / jnp.maximum(layer_mask.sum(), 1.0)
      along = graph['chain'] @ hl
      new_l = nn.Dense(h, name=f'layer_update{r}')(
        jnp.concatenate([hl, along, jnp.broadcast_to(dev_mean, hl.shape)], -1)
      )
      # Message from group j to group i, computed from j and the link i-j.
      pair = jnp.concatenate([jnp.broadcast_to(hd[None], (groups, groups, h)), graph['edge']], -1)
      message = nn.relu(nn.Dense(h, name=f'link_message{r}')(pair))
      senders = graph['dev_mask'][None, :, None]
      heard = (message * senders).sum(1) / jnp.maximum(senders.sum(1), 1.0)
      new_d = nn.Dense(h, name=f'device_update{r}')(
        jnp.concatenate([hd, heard, jnp.broadcast_to(layer_mean, hd.shape)], -1)
      )
      hl = nn.LayerNorm(name=f'layer_norm{r}')(hl + nn.relu(new_l)) * layer_mask
      hd = nn.LayerNorm(name=f'device_norm{r}')(hd + nn.relu(new_d)) * dev_mask
    readout = jnp.concatenate(
      [
        (hl * layer_mask).sum(0) / jnp.maximum(layer_mask.sum(), 1.0),
        (hd * dev_mask).sum(0) / jnp.maximum(dev_mask.sum(), 1.0),
        jnp.where(dev_mask > 0, hd, -1e4).max(0),
        graph['glob'],
      ]
    )
    readout = nn.relu(nn.Dense(h, name='readout')(readout))
    batch, count = cand.shape[:2]
    named = jnp.where((node >= 0)[..., None], hd[jnp.maximum(node, 0)], 0.0)
    x = jnp.concatenate(
      [
        jnp.broadcast_to(readout, (batch, count, h)),
        jnp.broadcast_to(ctx[:, None, :], (batch, count, ctx.shape[-1])),
        cand,
        named,
      ],
      -1,
    )
    x = nn.relu(nn.Dense(h, name='score0')(x))
    x = nn.relu(nn.Dense(h, name='score1')(x))
    logits = nn.Dense(1, name='score_out')(x)[..., 0]
    return jnp.where(mask, logits, NEG)


def empty_graph(schema: features.Schema) -> dict:
  """A graph of the padded shapes (for initialising parameters)."""
  return {
    'layer_x': jnp.zeros((LAYER_NODES, len(schema.layer))),
    'layer_mask': jnp.ones((LAYER_NODES,)),
    'chain': jnp.zeros((LAYER_NODES, LAYER_NODES)),
    'dev_x': jnp.zeros((DEVICE_NODES, len(schema.device))),
    'dev_mask': jnp.ones((DEVICE_NODES,)),
    'edge': jnp.zeros((DEVICE_NODES, DEVICE_NODES, len(schema.edge))),
    'glob': jnp.zeros((len(schema.glob),)),
  }


def init(network: Network, seed: int, schema: features.Schema):
  ctx = jnp.zeros((1, len(schema.context)))
  cand = jnp.zeros((1, MAX_CANDIDATES, len(schema.candidate)))
  node = -jnp.ones((1, MAX_CANDIDATES), jnp.int32)
  mask = jnp.ones((1, MAX_CANDIDATES), bool)
  graph = empty_graph(schema)
  # Jitted: flax's eager init dispatches every small op on its own (seconds).
  return jax.jit(network.init)(jax.random.key(seed), graph, ctx, cand, node, mask)


@dataclasses.dataclass
class Policy:
  """A policy's network and parameters, the schema its inputs follow, and
  what it was trained for (meta)."""

  params: object
  hidden: int = 64
  rounds: int = 3
  meta: dict = dataclasses.field(default_factory=dict)
  schema: features.Schema = dataclasses.field(default_factory=features.Schema.current)

  @classmethod
  def fresh(cls, seed: int = 0, hidden: int = 64, rounds: int = 3, schema=None) -> Policy:
    """Untrained parameters for `schema` (this code's by default)."""
    schema = schema or features.Schema.current()
    return cls(init(Network(hidden, rounds), seed, schema), hidden, rounds, {}, schema)

  @property
  def module(self) -> Network:
    return Network(hidden=self.hidden, rounds=self.rounds)

  @functools.cached_property
  def adapter(self) -> features.Adapter:
    """This code's feature arrays in this policy's columns."""
    return features.Adapter(self.schema)


_JITTED: dict = {}


def scores(policy: Policy):
  """The jitted network (one compile per shape, shared by every policy)."""
  key = (policy.hidden, policy.rounds)
  if key not in _JITTED:
    _JITTED[key] = jax.jit(policy.module.apply)
  return _JITTED[key]


def save(policy: Policy, path: str) -> None:
  """Writes the policy (parameters, sizes, meta and feature schema) to `path`, whole."""
  blob = serialization.msgpack_serialize(
    {
      'params': serialization.to_state_dict(policy.params),
      'hidden': policy.hidden,
      'rounds': policy.rounds,
      'meta': policy.meta,
      'schema': policy.schema.to_dict(),
    }
  )
  folder = os.path.dirname(path) or '.'
  os.makedirs(folder, exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'wb') as f:
    f.write(blob)
  os.replace(tmp, path)


def load(path: str) -> Policy:
  """The policy at `path`.

  Raises:
    ConfigError('--policy', ...): a file without a schema, or one whose
      inputs this code cannot feed by name (features.check), or whose
      weights do not match its schema.
  """
  with open(path, 'rb') as f:
    raw = serialization.msgpack_restore(f.read())
  if not isinstance(raw, dict) or 'schema' not in raw:
    raise ConfigError(
      '--policy',
      f'{path} holds no feature schema (saved before policies named their inputs); '
      'train a new one (--policy=NEW.msgpack trains one)',
    )
  schema = features.Schema.from_dict(raw['schema'], path)
  features.check(schema, path)
  hidden, rounds = int(raw['hidden']), int(raw['rounds'])
  template = jax.eval_shape(lambda: init(Network(hidden, rounds), 0, schema))
  params = serialization.from_state_dict(template, raw['params'])
  shapes = jax.tree.map(lambda t, a: tuple(t.shape) == np.shape(a), template, params)
  if not all(jax.tree.leaves(shapes)):
    raise ConfigError('--policy', f'{path}: its weights do not fit its own feature schema')
  params = jax.tree.map(lambda a: np.asarray(a), params)
  return Policy(params, hidden, rounds, dict(raw.get('meta') or {}), schema)
