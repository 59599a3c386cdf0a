"""Where the compiled pipeline step communicates.

Data-parallel gradients are reduced once per step, after the tick loop, not
once per micro-batch inside it: with tensor=1 no all-reduce may sit in any
computation but the entry one (the loop body and its branches are others).
"""

import functools
import re

import harness
import jax
import pytest


@pytest.mark.parametrize(
  'schedule, v', [('1f1b', 1), ('interleaved_1f1b', 2), ('zb_h1', 1), ('bpipe', 1)]
)
def test_data_parallel_gradients_are_reduced_once_per_step(schedule, v):
  cfg = harness.tiny_config(
    **{
      'mesh.data': 2,
      'mesh.tensor': 1,
      'mesh.pipe': 4,
      'pipeline.schedule': schedule,
      'pipeline.microbatches': 8,
      'pipeline.virtual_stages': v,
    }
  )
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    hlo = trainer.train_step.lower(trainer.abstract_state(), batch).compile().as_text()
  found = harness.collectives_by_computation(hlo, 'all-reduce')
  assert found, 'the step must reduce gradients somewhere'
  inside = {name: n for name, n in found.items() if not name.startswith('ENTRY')}
  assert not inside, f'all-reduces inside the tick loop (once per micro-batch): {inside}'


# gpt_tiny's widths: the failure the BPipe test guards against (XLA:CPU pairing
# the residual ppermute's rendezvous with another collective's, when `data` is
# manual too) did not show at the harness's tiny widths.
_GPT_TINY = {
  'mesh.tensor': 1,
  'pipeline.microbatches': 8,
  'model.d_model': 128,
  'model.num_heads': 4,
  'model.d_ff': 512,
  'model.seq_len': 128,
}


@functools.cache
def _one_device_losses():
  """3 steps on one device: the same model and batches for every layout, so one run."""
  return tuple(
    harness.train_losses(harness.tiny_config(**_GPT_TINY, **{'mesh.data': 1, 'mesh.pipe': 1}), 3)
  )


@pytest.mark.parametrize('data, pipe', [(2, 4), (1, 4), (2, 2)])
def test_bpipe_train_steps_match_one_device(data, pipe):
  """Whole train steps (gradients, clip norm, Adam), not only gradients: the
  residual moves' ppermute must not run alongside the tick's other two
  (without the executor's barrier: NaN gradients at (2, 4), an abort at (1, 4))."""
  ref = _one_device_losses()
  got = harness.train_losses(
    harness.tiny_config(
      **_GPT_TINY, **{'mesh.data': data, 'mesh.pipe': pipe, 'pipeline.schedule': 'bpipe'}
    ),
    3,
  )
  assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(ref, got)), (ref, got)


def _permute_operands(cfg) -> list[tuple[int, ...]]:
  """Shapes (per device) of the collective-permutes in the compiled step."""
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    hlo = trainer.train_step.lower(trainer.abstract_state(), batch).compile().as_text()
  shapes = re.findall(r'= \w+\[([\d,]+)\]\{[^}]*\} collective-permute(?:-start)?\(', hlo)
  shapes += [
    s for s in re.findall(r'= \(\w+\[([\d,]+)\]\{[^}]*\}, [^)]*\) collective-permute-start\(', hlo)
  ]
  return [tuple(int(x) for x in s.split(',')) for s in shapes]


@pytest.mark.parametrize('scatter', [True, False])
def test_pipeline_transfers_travel_split_over_tensor(scatter):
  """Megatron's scatter/gather (PTD-P 4.1): with tensor=2 each rank sends half
  of a [mb, s, d] activation, split along d, and the receiver gathers it."""
  cfg = harness.tiny_config(
    **{
      'mesh.data': 1,
      'mesh.tensor': 2,
      'mesh.pipe': 4,
      'pipeline.schedule': '1f1b',
      'pipeline.microbatches': 4,
      'pipeline.scatter_gather': scatter,
    }
  )
  mb, s, d = cfg.train.global_batch_size // 4, cfg.model.seq_len, cfg.model.d_model
  shapes = _permute_operands(cfg)
  assert shapes, 'the pipeline must send activations'
  assert set(shapes) == {(mb, s, d // 2) if scatter else (mb, s, d)}, shapes
