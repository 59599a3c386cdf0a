"""Every schedule gives one device's loss and gradients (fp32, <= 1e-5 relative).

The grid covers each schedule with pipe in {2, 4, 8}, v in {1, 2} where the
schedule has chunks, m in {p, 2p, 4p}, the 3-D meshes (2,2,2), (1,2,4),
(2,1,4), (4,1,2), and both remat policies, without running the full product
(each case compiles). bpipe and zb_h1 (v = 1 only) run with data and tensor axes too.
"""

import functools

import pytest

import harness

# (schedule, (data, tensor, pipe), virtual stages, micro-batches, remat, layers)
CASES = [
    ('gpipe', (1, 1, 2), 1, 2, 'none', 8),
    ('gpipe', (2, 1, 4), 1, 8, 'none', 8),
    ('gpipe', (4, 1, 2), 2, 4, 'full', 8),
    ('gpipe', (1, 1, 8), 2, 8, 'none', 16),
    ('1f1b', (1, 1, 2), 1, 8, 'none', 8),
    ('1f1b', (1, 2, 4), 1, 4, 'full', 8),
    ('1f1b', (2, 2, 2), 1, 4, 'selective', 8),
    ('1f1b', (1, 1, 8), 1, 16, 'none', 8),
    ('interleaved_1f1b', (2, 2, 2), 2, 4, 'none', 8),
    ('interleaved_1f1b', (4, 1, 2), 2, 8, 'full', 8),
    ('interleaved_1f1b', (1, 2, 4), 2, 16, 'selective', 8),
    ('interleaved_1f1b', (2, 1, 4), 1, 4, 'none', 8),
    ('interleaved_1f1b', (1, 1, 8), 2, 8, 'none', 16),
    ('bpipe', (1, 1, 2), 1, 8, 'none', 8),
    ('bpipe', (2, 2, 2), 1, 4, 'none', 8),
    ('bpipe', (1, 2, 4), 1, 16, 'full', 8),
    ('bpipe', (1, 1, 8), 1, 16, 'none', 8),
    ('bpipe', (1, 1, 8), 1, 8, 'none', 8),
    ('zb_h1', (1, 1, 2), 1, 2, 'none', 8),
    ('zb_h1', (2, 1, 4), 1, 8, 'selective', 8),
    ('zb_h1', (2, 2, 2), 1, 8, 'none', 8),
    ('zb_h1', (1, 1, 8), 1, 32, 'none', 8),
]


def _config(layers, **overrides):
  return harness.tiny_config(**{'model.num_layers': layers, **overrides})


@functools.lru_cache(maxsize=None)
def _reference(layers):
  return harness.loss_and_grads(_config(layers, **{'mesh.data': 1}))


@pytest.mark.parametrize('schedule,mesh,v,m,remat,layers', CASES,
                         ids=[f'{c[0]}-{"x".join(map(str, c[1]))}-v{c[2]}-m{c[3]}-{c[4]}'
                              for c in CASES])
def test_loss_and_gradients_match_one_device(schedule, mesh, v, m, remat, layers):
  ref_loss, ref_grads = _reference(layers)
  data, tensor, pipe = mesh
  cfg = _config(layers, **{
      'mesh.data': data, 'mesh.tensor': tensor, 'mesh.pipe': pipe,
      'pipeline.schedule': schedule, 'pipeline.virtual_stages': v,
      'pipeline.microbatches': m, 'model.remat': remat})
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


# Uneven layer partitions (pipeline.layers_per_stage, what the planner emits
# for mixed devices): shorter chunks are padded and their padding skipped.
UNEVEN = [
    ('1f1b', (1, 1, 4), 1, 4, (3, 2, 2, 1)),
    ('interleaved_1f1b', (2, 1, 2), 2, 4, (1, 3, 2, 2)),
    ('bpipe', (1, 2, 4), 1, 8, (1, 2, 2, 3)),
    ('zb_h1', (1, 1, 2), 1, 4, (5, 3)),
]


@pytest.mark.parametrize('schedule,mesh,v,m,split', UNEVEN,
                         ids=[f'{c[0]}-{"-".join(map(str, c[4]))}' for c in UNEVEN])
def test_uneven_split_matches_one_device(schedule, mesh, v, m, split):
  ref_loss, ref_grads = _reference(8)
  data, tensor, pipe = mesh
  cfg = _config(8, **{
      'mesh.data': data, 'mesh.tensor': tensor, 'mesh.pipe': pipe,
      'pipeline.schedule': schedule, 'pipeline.virtual_stages': v,
      'pipeline.microbatches': m, 'pipeline.layers_per_stage': split})
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5
