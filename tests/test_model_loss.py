"""The chunked cross-entropy (model.loss_chunk): today's value, a fraction of its
memory at a 128k vocabulary, still split over the vocabulary under tensor parallelism."""

import functools

import harness
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from triax import sharding
from triax.mesh import build_mesh

V = 128 * 1024
_RULES = (
  ('batch', None),
  ('seq', None),
  ('residual_seq', None),
  ('embed', None),
  ('vocab', 'tensor'),
)


def _llama(seq, chunk):
  return harness.model_of(
    family='llama', num_layers=1, d_model=64, num_heads=2, d_ff=64, vocab_size=V, seq_len=seq,
    loss_chunk=chunk,
  )  # fmt: skip


@functools.cache
def _temp_bytes(chunk, tensor, b=4, s=512):
  """Per-device temp bytes of the head's loss and gradients (compiled, not run)."""
  model = _llama(s, chunk)
  mesh = build_mesh(
    harness.tiny_config(**{'mesh.data': 1, 'mesh.tensor': tensor}).mesh, jax.devices()[:tensor]
  )
  head = jax.eval_shape(model.init, jax.random.key(0))['head']
  shard = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  head = {'norm': shard(head['norm'], P()), 'out': shard(head['out'], P(None, 'tensor'))}
  x = shard(jax.ShapeDtypeStruct((b, s, 64), jnp.float32), P())
  targets = shard(jax.ShapeDtypeStruct((b, s), jnp.int32), P())

  def loss_and_grads(head, x, targets):
    with sharding.axis_rules(_RULES):
      return jax.value_and_grad(model.head_loss, argnums=(0, 1))(head, x, targets)

  with jax.set_mesh(mesh):
    compiled = jax.jit(loss_and_grads).lower(head, x, targets).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_loss_equals_the_whole_sequence_loss():
  whole, chunked = _llama(64, 0), _llama(64, 16)
  head = jax.jit(whole.init)(jax.random.key(0))['head']
  x = jax.random.normal(jax.random.key(1), (2, 64, 64))
  targets = jax.random.randint(jax.random.key(2), (2, 64), 0, V)
  grad = lambda m: jax.jit(jax.value_and_grad(m.head_loss, argnums=(0, 1)))(head, x, targets)
  (ref, ref_grads), (got, got_grads) = grad(whole), grad(chunked)
  assert abs(float(got) - float(ref)) <= 1e-6 * abs(float(ref)), (got, ref)
  assert harness.max_rel_err(ref_grads, got_grads) <= 1e-5


def test_chunked_loss_needs_a_quarter_of_the_memory_at_128k_vocabulary():
  # 512 positions in chunks of 64: one eighth of the logits at a time.
  whole, chunked = _temp_bytes(0, 1), _temp_bytes(64, 1)
  assert chunked <= whole / 4, (chunked, whole)
  # Split over tensor=2, each device holds half the vocabulary of each chunk.
  assert _temp_bytes(64, 2) <= 0.6 * chunked, (_temp_bytes(64, 2), chunked)


def test_chunked_loss_in_the_pipeline_with_tensor_parallelism_matches_one_device():
  overrides = {'model.family': 'llama', 'model.num_layers': 4, 'model.loss_chunk': 4}
  ref_loss, ref_grads = harness.loss_and_grads(harness.tiny_config(**overrides, **{'mesh.data': 1}))
  loss, grads = harness.loss_and_grads(
    harness.tiny_config(
      **overrides,
      **{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2, 'pipeline.microbatches': 4},
    )
  )
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


def _head_case(chunk):
  """(a one-layer llama, its edges, hidden states, targets, a zero gradient like the edges)."""
  model = harness.model_of(
    family='llama', num_layers=1, d_model=32, num_heads=2, d_ff=32, vocab_size=512, seq_len=64,
    loss_chunk=chunk,
  )  # fmt: skip
  params = jax.jit(model.init)(jax.random.key(0))
  edges = {'embed': params['embed'], 'head': params['head']}
  x = jax.random.normal(jax.random.key(1), (2, 64, 32))
  targets = jax.random.randint(jax.random.key(2), (2, 64), 0, 512)
  return model, edges, x, targets, jax.tree.map(jnp.zeros_like, edges)


@pytest.mark.fast
@pytest.mark.parametrize('chunk', [0, 16])
def test_each_gradient_of_the_loss_can_be_made_alone(chunk):
  """head_loss_and_grad without one of its two gradients (the pipeline makes
  the head's weight gradient after its tick loop): the other one and the
  loss as when both are made, chunked and whole."""
  model, edges, x, targets, zeros = _head_case(chunk)
  loss, g, dx = model.head_loss_and_grad(edges, x, targets, zeros, 0.5)
  loss_x, no_g, dx_alone = model.head_loss_and_grad(edges, x, targets, None, 0.5)
  loss_w, g_alone, no_dx = model.head_loss_and_grad(edges, x, targets, zeros, 0.5, input_grad=False)
  assert no_g is None and no_dx is None
  assert float(loss_x) == float(loss) == float(loss_w)
  assert harness.max_rel_err(g, g_alone) <= 1e-6
  assert harness.max_rel_err(dx, dx_alone) <= 1e-6
  # A partial accumulator (None leaves: loss.partial_vjp): the vectors' gradients with dx,
  # the matrices' alone, the pipeline's split (executor._split_by_rank); together, the whole.
  vectors = jax.tree.map(lambda a: None if a.ndim >= 2 else a, zeros)
  matrices = jax.tree.map(lambda a: a if a.ndim >= 2 else None, zeros)
  _, g_vectors, dx_vectors = model.head_loss_and_grad(edges, x, targets, vectors, 0.5)
  _, g_matrices, _ = model.head_loss_and_grad(edges, x, targets, matrices, 0.5, input_grad=False)
  joined = jax.tree.map(
    lambda v, m: m if v is None else v, g_vectors, g_matrices, is_leaf=lambda a: a is None
  )
  assert harness.max_rel_err(g, joined) <= 1e-6 and harness.max_rel_err(dx, dx_vectors) <= 1e-6
  assert {a.ndim for a in jax.tree.leaves(g_vectors)} == {1}
  assert {a.ndim for a in jax.tree.leaves(g_matrices)} == {2}


@pytest.mark.fast
def test_the_head_matrix_gradient_alone_makes_no_input_gradient_product():
  """The matrices' gradient alone (the pipeline's edge rows) runs two of the
  head's vocabulary-sized matmuls, the logits and the weight gradient, where
  the whole parameter gradient runs three (the final norm's scale needs the
  input gradient's product by the head matrix)."""
  from triax.compiled import hlo_work

  model, edges, x, targets, zeros = _head_case(0)
  matrices = jax.tree.map(lambda a: a if a.ndim >= 2 else None, zeros)

  def flops(acc):
    run = jax.jit(lambda *a: model.head_loss_and_grad(*a, 1.0, input_grad=False)[1])
    return hlo_work.work(run.lower(edges, x, targets, acc).compile().as_text()).flops

  one = 2 * 2 * 64 * 32 * 512  # one [128 x 32] x [32 x 512] matmul
  assert flops(zeros) == 3 * one and flops(matrices) == 2 * one
