"""Every schedule gives one device's loss and gradients (fp32, <= 1e-5 relative).

The grid runs every builder in the registry on the meshes (data, tensor,
pipe) = (2,1,4), (1,2,4), (1,1,8), with v = 2 where the schedule has
chunks, and the remat policies spread over them (a pure pipe of 4 added
nothing the others miss: the executor's schedule-specific paths run at
p = 8 too, and p = 4 with data and with tensor); the extra cases cover
3-D meshes, circular GPipe, interleaving with m not a multiple of p, uneven
layer splits, and schedules read from CSV files written by
torch.distributed.pipelining (tests/data/).
"""

import functools
import os

import harness
import pytest

from triax.pipeline import schedule as sched

_MESHES = [((2, 1, 4), 'dots'), ((1, 2, 4), 'full'), ((1, 1, 8), 'none')]
_CHUNKED = {'interleaved_1f1b', 'interleaved_zb', 'zb_v', 'v_min', 'v_half', 'v_zb', 'dualpipe_v'}

# (schedule, (data, tensor, pipe), virtual stages, micro-batches, remat, layers)
CASES = [
  (
    name,
    mesh,
    2 if name in _CHUNKED else 1,
    2 * mesh[2],
    remat,
    16 if name in _CHUNKED and mesh[2] == 8 else 8,
  )
  for name in sched.SCHEDULES
  for mesh, remat in _MESHES
]
CASES += [
  ('gpipe', (4, 1, 2), 2, 4, 'full', 8),
  ('1f1b', (2, 2, 2), 1, 4, 'attention', 8),
  ('interleaved_1f1b', (1, 1, 4), 2, 6, 'none', 8),
  ('interleaved_zb', (1, 2, 2), 2, 3, 'none', 8),
  ('zb_v', (2, 2, 2), 2, 4, 'full', 8),
  # Packed rounds (pipeline/rounds.py) at p = 8: sending under the next
  # round (interleaved), and after it (zb_h1).
  ('interleaved_1f1b', (1, 1, 8), 2, 16, 'full', 16),
  ('zb_h1', (1, 1, 8), 1, 16, 'full', 8),
  # Micro-batches on one stage, over tensor: every manual axis has one device
  # (the reductions executor._invariant makes; a psum there failed to compile).
  ('1f1b', (1, 2, 1), 1, 4, 'none', 4),
]
# The fast tier's one pipelined program (both jax lines run it): the split
# backward through the layer scan and remat, on the smallest pipe.
FAST = ('zb_h1', (1, 1, 2), 1, 2, 'full', 4)


def _config(layers, **overrides):
  return harness.tiny_config(**{'model.num_layers': layers, **overrides})


def _batch(m: int) -> int:
  """Global batch: 32 rows, or 8 per micro-batch when m does not divide 32."""
  return 32 if 32 % m == 0 else 8 * m


@functools.cache
def _reference(layers, batch=32, family='gpt'):
  return harness.loss_and_grads(
    _config(layers, **{'mesh.data': 1, 'train.global_batch_size': batch, 'model.family': family})
  )


def _check(layers, mesh, m, **overrides):
  """Runs the layout on `mesh` and compares it with one device."""
  ref_loss, ref_grads = _reference(layers, _batch(m), overrides.get('model.family', 'gpt'))
  data, tensor, pipe = mesh
  cfg = _config(
    layers,
    **{
      'mesh.data': data,
      'mesh.tensor': tensor,
      'mesh.pipe': pipe,
      'pipeline.microbatches': m,
      'train.global_batch_size': _batch(m),
      **overrides,
    },
  )
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.parametrize(
  'schedule,mesh,v,m,remat,layers',
  CASES + [pytest.param(*FAST, marks=pytest.mark.fast)],
  ids=[f'{c[0]}-{"x".join(map(str, c[1]))}-v{c[2]}-m{c[3]}-{c[4]}' for c in CASES + [FAST]],
)
def test_loss_and_gradients_match_one_device(schedule, mesh, v, m, remat, layers):
  _check(
    layers,
    mesh,
    m,
    **{'pipeline.schedule': schedule, 'pipeline.virtual_stages': v, 'model.remat': remat},
  )


# Uneven layer partitions (pipeline.layers_per_stage, what the planner emits
# for mixed devices): shorter chunks are padded and their padding skipped.
UNEVEN = [
  ('1f1b', (1, 1, 4), 1, 4, (3, 2, 2, 1)),
  ('interleaved_1f1b', (2, 1, 2), 2, 4, (1, 3, 2, 2)),
  ('bpipe', (1, 2, 4), 1, 8, (1, 2, 2, 3)),
  ('zb_h1', (1, 1, 2), 1, 4, (5, 3)),
  ('zb_v', (1, 1, 2), 2, 4, (3, 1, 2, 2)),
]


@pytest.mark.parametrize(
  'schedule,mesh,v,m,split', UNEVEN, ids=[f'{c[0]}-{"-".join(map(str, c[4]))}' for c in UNEVEN]
)
def test_uneven_split_matches_one_device(schedule, mesh, v, m, split):
  _check(
    8,
    mesh,
    m,
    **{
      'pipeline.schedule': schedule,
      'pipeline.virtual_stages': v,
      'pipeline.layers_per_stage': split,
    },
  )


# The edges' weight gradients made after the tick loop (pipeline.edge_grads=
# after; at this model's size 'auto' keeps them in it): both ends' chunks on
# one stage (V placements) or on two, m not a multiple of p (padded pools),
# with data and tensor axes, BPipe's moves, an untied Llama.
AFTER = [
  ('1f1b', (2, 1, 4), 1, 8, 'gpt'),
  ('zb_v', (1, 2, 2), 2, 4, 'gpt'),
  ('interleaved_1f1b', (1, 1, 4), 2, 6, 'llama'),
  ('bpipe', (2, 2, 2), 1, 4, 'llama'),
]


@pytest.mark.parametrize(
  'schedule,mesh,v,m,family', AFTER, ids=[f'{c[0]}-{c[4]}-m{c[3]}' for c in AFTER]
)
def test_edge_gradients_after_the_loop_match_one_device(schedule, mesh, v, m, family):
  _check(
    8,
    mesh,
    m,
    **{
      'pipeline.schedule': schedule,
      'pipeline.virtual_stages': v,
      'pipeline.edge_grads': 'after',
      'model.family': family,
    },
  )


# Schedules written by another tool: torch.distributed.pipelining's own
# orders, dumped with its CSV writer (scripts/torch_schedule_csv.py).
FILES = [
  ('torch_zbv_p4_v2_m8.csv', (1, 1, 4), 2, 8),
  ('torch_interleaved_1f1b_p4_v2_m6.csv', (2, 1, 4), 2, 6),
  ('torch_interleaved_zb_p4_v2_m8.csv', (1, 2, 4), 2, 8),
]


@pytest.mark.parametrize('name,mesh,v,m', FILES, ids=[c[0] for c in FILES])
def test_schedule_from_a_torch_csv_matches_one_device(name, mesh, v, m):
  path = os.path.join(harness.ROOT, 'tests', 'data', name)
  _check(8, mesh, m, **{'pipeline.schedule_file': path, 'pipeline.virtual_stages': v})
