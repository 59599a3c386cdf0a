"""Sequence parallelism (mesh.sequence_parallel) and context parallelism
(mesh.context, model.context_attention): one device's numbers on every
layout, Megatron's collectives in XLA:TPU's program, the ring's transfers
beside its work, and a run that saves on one context degree and resumes on
another.
"""

import functools
import glob
import json
import os
import re

import harness
import jax
import numpy as np
import pytest

from triax.compiled import stats as stats_lib
from triax.model import context

# (family, (data, context, tensor, pipe), context_attention, sequence_parallel, extra config).
# Every layout runs both kinds and both families, in pairs rather than all four
# combinations: both families reach the kinds through the one common.attention.
PARITY = [
  ('gpt', (1, 2, 1, 1), 'allgather', False, {}),
  ('llama', (1, 2, 1, 1), 'ring', False, {}),
  ('gpt', (1, 4, 1, 1), 'ring', False, {}),
  ('llama', (1, 4, 1, 1), 'allgather', False, {}),
  ('llama', (1, 2, 2, 1), 'allgather', True, {}),
  ('gpt', (1, 2, 2, 1), 'ring', True, {}),
  ('llama', (1, 2, 2, 1), 'ring', False, {}),
  ('gpt', (1, 2, 2, 1), 'allgather', False, {}),
  # The edges' gradients after the tick loop (pipeline.edge_grads), its pools split over context.
  (
    'llama',
    (1, 2, 2, 2),
    'allgather',
    True,
    {'pipeline.microbatches': 4, 'pipeline.edge_grads': 'after'},
  ),
  (
    'gpt',
    (2, 2, 1, 2),
    'allgather',
    False,
    {'pipeline.schedule': 'zb_h1', 'pipeline.microbatches': 2},
  ),
  (
    'llama',
    (1, 2, 1, 4),
    'allgather',
    False,
    {
      'pipeline.schedule': 'interleaved_1f1b',
      'pipeline.microbatches': 4,
      'pipeline.virtual_stages': 2,
    },
  ),
  ('llama', (2, 2, 2, 1), 'ring', True, {'mesh.fsdp': True}),
  # The executor with one stage (gradient accumulation): the ring inside its branches.
  ('gpt', (1, 2, 1, 1), 'ring', False, {'pipeline.microbatches': 2}),
  # The ring inside pipeline stages (on CPU its blocks are gathered: step._ring_transport).
  ('gpt', (1, 2, 2, 2), 'ring', True, {'pipeline.microbatches': 4, 'pipeline.edge_grads': 'after'}),
  (
    'llama',
    (2, 2, 1, 2),
    'ring',
    False,
    {'pipeline.schedule': 'zb_h1', 'pipeline.microbatches': 2},
  ),
  (
    'gpt',
    (1, 2, 1, 4),
    'ring',
    False,
    {
      'pipeline.schedule': 'interleaved_1f1b',
      'pipeline.microbatches': 4,
      'pipeline.virtual_stages': 2,
    },
  ),
]


def _masked_run(family, layout, kind='allgather', sp=False, extra=()):
  data, ctx, tensor, pipe = layout
  cfg = harness.tiny_config(
    **{
      'mesh.data': data,
      'mesh.context': ctx,
      'mesh.tensor': tensor,
      'mesh.pipe': pipe,
      'mesh.sequence_parallel': sp,
      'model.family': family,
      'model.context_attention': kind,
      'data.source': 'tokens',
      'data.path': 'unused',  # validation reads no files; the batch is made here
      'data.mask_documents': True,
      **dict(extra),
    }
  )
  cfg.model.seq_len = 32
  trainer = harness.make_trainer(cfg)
  batch = harness.random_batch(cfg)
  starts = np.random.default_rng(1).random(batch['inputs'].shape) < 0.2
  batch['segment_ids'] = np.cumsum(starts, axis=1).astype(np.int32)
  params = harness.initial_params(trainer, cfg.train.seed)
  with jax.set_mesh(trainer.mesh):
    loss, grads, _ = trainer.loss_and_grad(params, jax.device_put(batch, trainer.batch_sharding))
  return float(loss), trainer.layout.tree_to_model_order(jax.device_get(grads))


_REFERENCE = {}


@pytest.mark.parametrize(
  'family, layout, kind, sp, extra',
  PARITY,
  ids=[f'{c[0]}-{"x".join(map(str, c[1]))}-{c[2]}{"-sp" if c[3] else ""}' for c in PARITY],
)
def test_a_split_sequence_matches_one_device(family, layout, kind, sp, extra):
  if family not in _REFERENCE:
    _REFERENCE[family] = _masked_run(family, (1, 1, 1, 1))
  ref_loss, ref_grads = _REFERENCE[family]
  loss, grads = _masked_run(family, layout, kind, sp, extra.items())
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.fast
def test_the_ring_gathers_its_blocks_only_inside_pipeline_stages_on_cpu():
  """XLA:CPU's collective-permute waits for every device of the program, so
  the ring cannot use it where stages take different branches of a tick."""
  from types import SimpleNamespace

  from triax.training import step

  def transport(pipe, platform):
    cfg = SimpleNamespace(mesh=SimpleNamespace(pipe=pipe))
    device = SimpleNamespace(platform=platform)
    return step._ring_transport(cfg, SimpleNamespace(devices=np.array([device])))

  assert transport(2, 'cpu') == 'allgather'
  assert transport(1, 'cpu') == 'ppermute'
  assert transport(4, 'tpu') == transport(4, 'gpu') == 'ppermute'
  assert set(context.TRANSPORTS) == {'ppermute', 'allgather'}


@pytest.mark.fast
def test_load_balancing_gives_every_rank_the_same_causal_work():
  order = np.asarray(context.positions(16, 2))
  assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
  for ranks in (2, 4, 8):
    slots = np.asarray(context.positions(64, ranks)).reshape(ranks, -1)
    # A query at position q attends to q + 1 keys: each rank's sum is the same.
    work = (slots + 1).sum(axis=1)
    assert len(set(work.tolist())) == 1, work
    assert sorted(slots.ravel().tolist()) == list(range(64))
  assert np.asarray(context.positions(16, 1)).tolist() == list(range(16))


@pytest.mark.fast
@pytest.mark.parametrize('tile', (16, 6), ids=('whole', 'tiled'))
@pytest.mark.parametrize('transport', context.TRANSPORTS)
def test_a_ring_scored_in_key_tiles_is_attention(transport, tile):
  """4 ranks of 16 positions, each block scored whole or 4 keys at a time
  (6 asks for 4: the largest divisor), with documents: outputs and the
  q, k, v gradients of one device's masked attention."""
  from jax.sharding import PartitionSpec as P

  b, s, n, hd, ranks = 2, 64, 2, 8, 4
  q, k, v = (jax.random.normal(jax.random.key(i), (b, s, n, hd)) for i in range(3))
  pos = context.positions(s, ranks)  # the load-balanced slots
  documents = np.stack([np.repeat([0, 1], [25, 39]), np.repeat([0, 1], [40, 24])])
  segments = jax.numpy.asarray(documents[:, np.asarray(pos)])
  cotangent = jax.random.normal(jax.random.key(3), (b, s, n, hd))
  assert context._tile_size(16, 6) == 4 and context._tile_size(16, 512) == 16
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ranks]), ('context',))
  seq, row = P(None, 'context'), P('context')
  ring = jax.shard_map(
    functools.partial(context._ring, axis='context', transport=transport, tile=tile),
    mesh=mesh,
    in_specs=(seq, seq, seq, row, seq),
    out_specs=seq,
    check_vma=False,
  )

  def loss(q, k, v, attend):
    return jax.numpy.sum(attend(q, k, v, pos, segments) * cotangent)

  reference = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, context.masked_attention)
  value, grads = jax.jit(
    jax.value_and_grad(functools.partial(loss, attend=ring), argnums=(0, 1, 2))
  )(q, k, v)
  assert abs(float(value) - float(reference[0])) <= 1e-5 * abs(float(reference[0]))
  assert harness.max_rel_err(reference[1], grads) <= 1e-5


def test_key_tiles_bound_what_a_ring_step_holds(monkeypatch):
  """llama_long's width at 4096 positions over 2 context ranks (blocks of 2048
  keys), one layer, compiled by XLA:CPU: temp per device with 512-key tiles
  against whole blocks (whose fp32 scores are 128 MiB an array)."""
  from triax import config

  def temp_mib():
    cfg = config.from_file(
      os.path.join(harness.ROOT, 'experiments', 'llama_long.py'), 'seq=4096,context=2,layers=1'
    )
    cfg.mesh.data, cfg.train.global_batch_size = 1, 1
    trainer = harness.make_trainer(cfg)
    with jax.set_mesh(trainer.mesh):
      return stats_lib.compile_stats(trainer)[1]['temp_bytes'] / 2**20

  tiled = temp_mib()
  monkeypatch.setattr(context, 'KEY_TILE', 1 << 20)
  whole = temp_mib()
  assert tiled < 0.3 * whole, (tiled, whole)


def _tpu_program(tmp_path, name, *flags):
  """XLA:TPU's optimised train step for llama_tiny on 4 v5p chips, and its compile stats."""
  dump = tmp_path / f'{name}-xla'
  result = harness.run_cli(
    'triax.cli.train',
    '--config=experiments/llama_tiny.py',
    f'--workdir={tmp_path / name}',
    '--compile_only',
    '--topology=v5p:2x2x1',
    '--config.mesh.data=1',
    '--config.mesh.pipe=1',
    '--config.pipeline.microbatches=1',
    *flags,
    env_extra={'TRIAX_XLA_DUMP': str(dump)},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  (path,) = glob.glob(str(dump / '*jit_train_step*after_optimizations.txt'))
  with open(path) as f:
    hlo = f.read()
  with open(tmp_path / name / 'compile_stats.json') as f:
    return hlo, json.load(f)


def _shapes(hlo, pattern):
  return [m.group(1) for m in re.finditer(rf'= (\w+\[[\d,]*\])\S* {pattern}', hlo)]


def test_sequence_parallel_is_megatrons_collectives_on_tpu(tmp_path):
  """llama_tiny (b=32, s=128, d=128) at t=4: without SP, the tensor-parallel
  regions end in all-reduces of [b, s, d]; with SP none is left, each is a
  reduce-scatter to [b, s/4, d] (XLA:TPU's all-reduce-scatter fusion) and an
  all-gather back to [b, s, d] before the next region; less memory."""
  plain, plain_stats = _tpu_program(tmp_path, 'tp', '--config.mesh.tensor=4')
  split, split_stats = _tpu_program(
    tmp_path, 'sp', '--config.mesh.tensor=4', '--config.mesh.sequence_parallel=true'
  )
  whole, quarter = 'f32[32,128,128]', 'f32[32,32,128]'
  assert _shapes(plain, r'all-reduce(?:-start)?\(').count(whole) >= 4
  assert not re.search(r'calls=%all-reduce-scatter', plain)
  # With SP, every [b, s, d] all-reduce sits inside a reduce-scatter fusion.
  outside = [
    line
    for block in re.split(r'\n(?=\S)', split)
    if not block.startswith('%all-reduce-scatter')
    for line in block.splitlines()
    if re.search(r'\ball-reduce(?:-start)?\(', line) and whole in line
  ]
  assert not outside, outside[:2]
  assert _shapes(split, r'fusion\(.*calls=%all-reduce-scatter').count(quarter) >= 4
  assert sum(s.endswith('[32,128,128]') for s in _shapes(split, r'all-gather(?:-start)?\(')) >= 4
  # Per layer (the forward's and the backward's loop bodies): the forward
  # gathers before its two column-parallel regions; the backward holds the
  # reduce-scatters' two transposes and gathers the normed stream again for
  # the two regions' weight gradients (common.project keeps it split), which
  # the planner prices (simulator.sequence_parallel_regathers).
  gathers = [
    sum(s.endswith('[32,128,128]') for s in _shapes(block, r'all-gather(?:-start)?\('))
    for block in re.split(r'\n(?=\S)', split)
  ]
  assert sorted(gathers)[-2:] == [2, 4], sorted(gathers)
  assert split_stats['temp_bytes'] < 0.8 * plain_stats['temp_bytes']


def test_ring_transfers_overlap_the_blocks_work_on_tpu(tmp_path):
  """Each ring step's K/V collective-permute starts before a block's compute
  and completes after it: XLA:TPU schedules them side by side."""
  hlo, _ = _tpu_program(
    tmp_path,
    'ring',
    '--config.mesh.tensor=1',
    '--config.mesh.context=4',
    '--config.model.context_attention=ring',
  )
  overlapped = 0
  for block in re.split(r'\n(?=\S)', hlo):
    lines = block.splitlines()
    for i, line in enumerate(lines):
      start = re.match(r'\s*(%collective-permute-start[.\d]*) = ', line)
      if not start:
        continue
      done = next(
        j for j in range(i, len(lines)) if f'collective-permute-done({start.group(1)})' in lines[j]
      )
      overlapped += any(
        ' fusion(' in lines[j] or 'convolution(' in lines[j] for j in range(i + 1, done)
      )
  assert overlapped >= 2, overlapped


def test_a_run_saved_on_two_context_ranks_resumes_on_one(tmp_path, compile_cache):
  workdir = str(tmp_path / 'w')
  common = [
    '--config=experiments/gpt_tiny.py:smoke',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--progress=false',
  ]
  first = harness.run_cli(
    'triax.cli.train',
    *common,
    '--config.train.steps=2',
    '--config.mesh.data=1',
    '--config.mesh.context=2',
    '--config.mesh.sequence_parallel=true',
    env_extra=compile_cache,
  )
  assert first.returncode == 0, first.stderr[-3000:]
  assert 'context 2' in first.stdout
  second = harness.run_cli(
    'triax.cli.train', *common, '--config.train.steps=4', env_extra=compile_cache
  )
  assert second.returncode == 0, second.stderr[-3000:]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    steps = [json.loads(line) for line in f if '"loss"' in line]
  assert [r['step'] for r in steps if 'loss' in r][-1] == 4
