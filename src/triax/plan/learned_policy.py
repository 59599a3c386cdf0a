"""The learned planner's network: message passing over layers and device groups, then a scorer.

The graph of one planning problem (plan/learned.py builds it) has two kinds
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
update residually under a LayerNorm. A decision (plan/learned.py's
`Decision`) is a choice among candidates: each is scored by an MLP of the
graph's readout, the decision's context (what was chosen before it) and the
candidate's own features, plus the embedding of the device group it names
(a stage's candidates are device groups: HeteroG's per-stage placement).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

# Padded sizes and feature widths: what a saved policy was built for.
LAYER_NODES = 12
DEVICE_NODES = 8
LAYER_FEATURES = 8
DEVICE_FEATURES = 12
EDGE_FEATURES = 3
GLOBAL_FEATURES = 6
CONTEXT_FEATURES = 24
CANDIDATE_FEATURES = 28
MAX_CANDIDATES = 16
NEG = -1e9


class Policy(nn.Module):
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


def empty_graph() -> dict:
  """A graph of the padded shapes (for initialising parameters)."""
  return {
    'layer_x': jnp.zeros((LAYER_NODES, LAYER_FEATURES)),
    'layer_mask': jnp.ones((LAYER_NODES,)),
    'chain': jnp.zeros((LAYER_NODES, LAYER_NODES)),
    'dev_x': jnp.zeros((DEVICE_NODES, DEVICE_FEATURES)),
    'dev_mask': jnp.ones((DEVICE_NODES,)),
    'edge': jnp.zeros((DEVICE_NODES, DEVICE_NODES, EDGE_FEATURES)),
    'glob': jnp.zeros((GLOBAL_FEATURES,)),
  }


def init(policy: Policy, seed: int):
  ctx = jnp.zeros((1, CONTEXT_FEATURES))
  cand = jnp.zeros((1, MAX_CANDIDATES, CANDIDATE_FEATURES))
  node = -jnp.ones((1, MAX_CANDIDATES), jnp.int32)
  mask = jnp.ones((1, MAX_CANDIDATES), bool)
  # Jitted: flax's eager init dispatches every small op on its own (seconds).
  return jax.jit(policy.init)(jax.random.key(seed), empty_graph(), ctx, cand, node, mask)
