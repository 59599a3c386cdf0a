"""compiled/buffers.py on a program small enough to count by hand (XLA:CPU)."""

import jax
import jax.numpy as jnp
import pytest

from triax.compiled import buffers

ONE = 256 * 256 * 4  # bytes of one f32[256,256]


def _compile(dump: str):
  """y = sin(x @ x) @ x, its XLA dump written into `dump`."""
  x = jnp.ones((256, 256), jnp.float32)
  fn = jax.jit(lambda x: jnp.sin(x @ x) @ x)
  return fn.lower(x).compile(compiler_options=buffers.compile_options(dump, module='lambda'))


@pytest.mark.fast
def test_live_peak_is_what_the_worst_point_of_the_schedule_holds(tmp_path):
  dump = str(tmp_path)
  stats = _compile(dump).memory_analysis()
  # The last product reads x and sin(x @ x) and writes y: three arrays at
  # once, the argument, the temporary and the output (nothing aliases).
  assert (stats.argument_size_in_bytes, stats.output_size_in_bytes) == (ONE, ONE)
  assert buffers.live_peak(dump, module='lambda') == 3 * ONE
  heap = buffers.temp_heap(dump, module='lambda')
  assert heap is not None and ONE <= heap <= stats.temp_size_in_bytes


@pytest.mark.fast
def test_an_output_in_its_donated_arguments_bytes_counts_once(tmp_path):
  # y = 2x + 1 written over x: one array's bytes in use, though the argument
  # and the output are two values live at once (XLA's own peak line adds them).
  x = jnp.ones((256, 256), jnp.float32)
  fn = jax.jit(lambda x: x * 2.0 + 1.0, donate_argnums=0)
  options = buffers.compile_options(str(tmp_path), module='lambda')
  stats = fn.lower(x).compile(compiler_options=options).memory_analysis()
  assert stats.alias_size_in_bytes == ONE
  assert buffers.live_peak(str(tmp_path), module='lambda') == ONE


@pytest.mark.fast
def test_no_dump_no_figures(tmp_path):
  assert buffers.live_peak(str(tmp_path)) is None
  assert buffers.temp_heap(str(tmp_path)) is None
  assert buffers.largest(str(tmp_path)) == []
