"""pipeline/cpu_dots.py: weight gradients XLA:CPU runs in fusions, not as Eigen dots.

jax 0.12's XLA:CPU (the 3.12 leg) made a one-sequence micro-batch's weight
gradient an Eigen dot thunk; jax 0.10's fused it either way, so there the
structural checks hold with or without cpu_dots and only the numerics test it.
"""

import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.pipeline import cpu_dots, split_backward


def _unfused_dots(hlo: str) -> int:
  """Dots in the compiled program outside every fused computation."""
  count, computation = 0, ''
  for line in hlo.splitlines():
    if re.match(r'^(ENTRY )?%?\S+ .*\{$', line):
      computation = line.split()[1] if line.startswith('ENTRY') else line.split()[0]
    if ' dot(' in line and not computation.startswith('%fused_computation'):
      count += 1
  return count


@pytest.mark.fast
@pytest.mark.parametrize(
  'lhs_shape, rhs_shape, numbers',
  [
    ((6, 5), (6, 7), (((0,), (0,)), ((), ()))),  # a weight gradient
    ((1, 6, 5), (1, 6, 7), (((0, 1), (0, 1)), ((), ()))),  # one sequence's
    ((3, 4, 5, 6), (5, 3, 6, 2), (((3, 2), (2, 0)), ((), ()))),  # contracted out of order
    ((2, 6, 3, 4), (4, 2, 6, 5), (((1,), (2,)), ((0,), (1,)))),  # a batch dimension
    ((4, 5), (5, 3), (((1,), (0,)), ((), ()))),  # laid out already
  ],
)
def test_a_dot_made_row_major_is_the_same_product(lhs_shape, rhs_shape, numbers):
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.normal(size=lhs_shape), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=rhs_shape), jnp.float32)
  want = jax.lax.dot_general(lhs, rhs, numbers)
  got = jax.jit(lambda a, b: _row_major_dot(a, b, numbers))(lhs, rhs)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _row_major_dot(lhs, rhs, numbers):
  """lax.dot_general through cpu_dots, with the params jax itself binds."""
  closed = jax.make_jaxpr(lambda a, b: jax.lax.dot_general(a, b, numbers))(lhs, rhs)
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == 'dot_general']
  params = eqn.primitive.get_bind_params(eqn.params)
  return cpu_dots.dot_general(eqn.primitive, lhs, rhs, params)


@pytest.mark.fast
def test_a_one_sequence_weight_gradient_is_fused_under_row_major():
  x = jnp.ones((1, 256, 128), jnp.bfloat16)
  g = jnp.ones((1, 256, 384), jnp.bfloat16)

  def weight_grad(x, g):
    w = jnp.ones((128, 384), jnp.bfloat16)
    _, pull = jax.vjp(lambda w: jnp.einsum('bsd,df->bsf', x, w), w)
    return pull(g)[0]

  fused = jax.jit(lambda x, g: split_backward.row_major_call(weight_grad, x, g))
  np.testing.assert_array_equal(fused(x, g), jax.jit(weight_grad)(x, g))
  assert _unfused_dots(fused.lower(x, g).compile().as_text()) == 0


@pytest.mark.fast
def test_the_cpu_tick_program_runs_every_matmul_in_a_fusion():
  """PP 2, 1f1b, one sequence a micro-batch, bf16, full remat: the split
  backward's W and the edges' head made after the loop (edge_grads=after)
  hold their weight gradients, which cpu_dots lays out (3 Eigen dots on jax
  0.12 without it)."""
  cfg = harness.tiny_config(
    **{
      'model.num_layers': 2,
      'model.d_model': 128,
      'model.num_heads': 4,
      'model.d_ff': 384,
      'model.seq_len': 256,
      'model.vocab_size': 512,
      'model.dtype': 'bfloat16',
      'model.remat': 'full',
      'mesh.data': 1,
      'mesh.pipe': 2,
      'pipeline.schedule': '1f1b',
      'pipeline.microbatches': 4,
      'pipeline.edge_grads': 'after',
      'train.global_batch_size': 4,
    }
  )
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    hlo = trainer.train_step.lower(trainer.abstract_state(), batch).compile().as_text()
  assert trainer.pipeline.edge_grads == 'after'
  assert _unfused_dots(hlo) == 0
