"""hlo_work counts what a compiled program executes: loops by their trips,
branches by their runs, collectives by the bytes they move."""

import functools
import re

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from triax.compiled import gemms, hlo_work
from triax.model import flops as flops_lib
from triax.pipeline import executor

M, K, N, TRIPS = 8, 16, 32, 6


def _matmuls(x, ws):
  def body(c, w):
    return jnp.tanh(c @ w), None

  return jax.lax.scan(body, x, ws)[0]


@pytest.mark.fast
def test_a_scan_counts_every_trip_where_cost_analysis_counts_one():
  x, ws = jnp.ones((M, K)), jnp.ones((TRIPS, K, K))
  compiled = jax.jit(_matmuls).lower(x, ws).compile()
  one = 2 * M * K * K
  assert hlo_work.work(compiled.as_text()).flops == TRIPS * one
  # Why this module exists: XLA's own figure is one trip's (and a few
  # elementwise FLOPs: the tanh).
  assert one <= compiled.cost_analysis()['flops'] < 2 * one


def _taken(x, w, ks):
  def body(c, k):
    def matmul(c):
      with jax.named_scope('mark_A'):
        return c @ w

    return jax.lax.cond(k > 0, matmul, lambda c: c, c), None

  return jax.lax.scan(body, x, ks)[0]


@pytest.mark.fast
def test_a_cond_in_a_loop_counts_its_branch_as_often_as_it_runs():
  ks = np.array([1, 0, 1, 1, 0, 0, 0, 1])  # taken 4 of 8 trips
  x, w = jnp.ones((M, N)), jnp.ones((N, N))
  hlo = jax.jit(_taken).lower(x, w, jnp.asarray(ks)).compile().as_text()
  one = 2 * M * N * N
  exact = hlo_work.work(hlo, {'mark_A': int(ks.sum())})
  assert exact.flops == ks.sum() * one and exact.unweighted_conditionals == 0
  bound = hlo_work.work(hlo)
  assert bound.flops == len(ks) * one and bound.unweighted_conditionals == 1
  with pytest.raises(ValueError, match='runs 8 times'):
    hlo_work.work(hlo, {'mark_A': 9})


@pytest.mark.fast
def test_collectives_in_a_loop_count_their_bytes_every_trip():
  mesh = jax.make_mesh((8,), ('x',))
  pairs = [(i, (i + 1) % 8) for i in range(8)]

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P('x'), out_specs=P('x'))
  def f(x):
    def body(c, _):
      c = jax.lax.psum(c, 'x') * 0.5
      return jax.lax.ppermute(c, 'x', pairs), None

    return jax.lax.scan(body, x, None, length=TRIPS)[0]

  # 16 floats a device: 64 bytes.
  x = jax.device_put(jnp.ones((8 * 16,), jnp.float32), jax.NamedSharding(mesh, P('x')))
  w = hlo_work.work(jax.jit(f).lower(x).compile().as_text())
  assert w.collective_bytes == {'all-reduce': TRIPS * 64, 'collective-permute': TRIPS * 64}
  assert w.collective_counts == {'all-reduce': TRIPS, 'collective-permute': TRIPS}


@pytest.mark.fast
def test_a_while_without_a_trip_count_needs_one():
  def f(x):
    return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c @ c + 1.0, x)

  hlo = jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text()
  with pytest.raises(ValueError, match='known_trip_count'):
    hlo_work.work(hlo)
  (name,) = re.findall(r'%([\w.]+) = \S+ while\(', hlo)
  assert hlo_work.work(hlo, trip_counts={name: 3}).flops == 3 * 2 * 4 * 4 * 4


@pytest.mark.fast
def test_work_adds_and_scales():
  a = hlo_work.Work(flops=2.0, bytes=4.0, collective_bytes={'all-gather': 8.0})
  b = hlo_work.Work(flops=1.0, collective_bytes={'all-gather': 1.0, 'all-reduce': 2.0})
  assert (a + b).collective_bytes == {'all-gather': 9.0, 'all-reduce': 2.0}
  assert (3 * a).flops == 6.0 and (a * 3).collective_bytes == {'all-gather': 24.0}


@pytest.mark.parametrize('edge_grads', ['loop', 'after'])
def test_a_pipelined_step_executes_the_models_hardware_flops(edge_grads):
  """PP 4 x DP 2, 1f1b, m=8, full remat: the tick loop's F, B and W, each
  counted by the tick tables, and the edges, add up to model/flops.py's
  hardware FLOPs of the step (forward, backward, the recomputed forward),
  exactly, but for two things the formula does not know: XLA drops the
  recomputed forward's last matmul (the MLP's down projection: the
  backward needs its input, not its output), and with the edges' gradients
  made after the loop the head runs its forward again (one head forward's
  worth: the final norm's scale takes its gradient in the loop, with the
  input gradient, so the rows after it make no second one)."""
  cfg = harness.tiny_config(
    **{
      'mesh.data': 2,
      'mesh.pipe': 4,
      'pipeline.schedule': '1f1b',
      'pipeline.microbatches': 8,
      'pipeline.edge_grads': edge_grads,
      'model.remat': 'full',
    }
  )
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    batch = jax.device_put(harness.random_batch(cfg), trainer.batch_sharding)
    hlo = trainer.train_step.lower(trainer.abstract_state(), batch).compile().as_text()
  assert trainer.pipeline.edge_grads == edge_grads
  counts = executor.branch_counts(trainer.program, edge_grads == 'after')
  # Lockstep: every stage runs as many F, B and W as the others.
  for mark in (executor.MARK_F, executor.MARK_B, executor.MARK_W):
    assert len({c[mark] for c in counts}) == 1, mark
  assert counts[0][f'{executor.MARK_F}/{executor.MARK_EMBED}'] == 8
  assert counts[-1][f'{executor.MARK_F}/{executor.MARK_HEAD}'] == 8
  stages = [hlo_work.work(hlo, c) for c in counts]
  assert all(w.unweighted_conditionals == 0 for w in stages)
  executed = cfg.mesh.data * sum(w.flops for w in stages)
  step = flops_lib.step_flops(trainer.model, cfg.train.global_batch_size)
  batch, m = cfg.train.global_batch_size, cfg.model
  head_again = batch * trainer.model.forward_flops()['head'] if edge_grads == 'after' else 0.0
  down_projection = batch * m.num_layers * 2 * m.seq_len * m.d_ff * m.d_model
  assert executed == step['hardware'] - down_projection + head_again
  # No counts: every cond counts its costliest branch on every tick.
  bound = hlo_work.work(hlo)
  assert bound.flops > 2 * stages[0].flops and bound.unweighted_conditionals > 0


# (lhs shape NCHW-like, kernel shape, strides, padding, lhs dilation, rhs dilation, groups)
_CONVOLUTIONS = (
  ((2, 4, 9, 7), (6, 4, 3, 2), (1, 1), 'VALID', (1, 1), (1, 1), 1),
  ((2, 4, 9, 7), (6, 4, 3, 2), (2, 1), ((2, 3), (1, 0)), (1, 1), (1, 1), 1),
  ((2, 4, 9, 7), (6, 2, 3, 3), (1, 2), ((1, 2), (2, 2)), (2, 1), (1, 2), 2),
  ((1, 8, 5, 1), (8, 8, 5, 1), (1, 1), ((4, 4), (0, 0)), (1, 1), (1, 1), 1),
)


@pytest.mark.fast
@pytest.mark.parametrize('case', range(len(_CONVOLUTIONS)))
def test_a_convolution_counts_its_valid_window_positions_as_xla_does(case):
  """Padding and dilation hold no multiply-adds: each convolution's count
  equals XLA's own cost analysis of it (one instruction, no loop), which is
  what XLA:TPU's matmuls-as-convolutions need (their batch windows are padded)."""
  lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups = _CONVOLUTIONS[case]

  def conv(x, w):
    return jax.lax.conv_general_dilated(
      x, w, strides, padding, lhs_dilation, rhs_dilation, feature_group_count=groups
    )

  compiled = jax.jit(conv).lower(jnp.ones(lhs), jnp.ones(rhs)).compile()
  assert 'convolution(' in compiled.as_text()
  assert hlo_work.work(compiled.as_text()).flops == compiled.cost_analysis()['flops']


# XLA:TPU's reduce-scatter: a kCustom fusion of an all-reduce and a slice of it.
_TPU_REDUCE_SCATTER = """HloModule m, entry_computation_layout={(bf16[64,32]{1,0})->bf16[16,32]{1,0}}

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%all-reduce-scatter.clone (input: bf16[64,32]) -> bf16[16,32] {
  %input = bf16[64,32]{1,0} parameter(0)
  %all-reduce.1 = bf16[64,32]{1,0} all-reduce(%input), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %zero = u32[] constant(0)
  %id = u32[] partition-id()
  ROOT %slice = bf16[16,32]{1,0} dynamic-slice(%all-reduce.1, %id, %zero), dynamic_slice_sizes={16,32}
}

ENTRY %main (p: bf16[64,32]) -> bf16[16,32] {
  %p = bf16[64,32]{1,0} parameter(0)
  ROOT %fusion.1 = bf16[16,32]{1,0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter.clone
}
"""


@pytest.mark.fast
def test_a_tpu_reduce_scatter_fusion_counts_as_a_reduce_scatter_of_its_operand():
  w = hlo_work.work(_TPU_REDUCE_SCATTER)
  assert w.collective_bytes == {'reduce-scatter': 64 * 32 * 2}
  assert w.collective_counts == {'reduce-scatter': 1}
  assert w.bytes == (64 + 16) * 32 * 2  # the fusion's operand and output, not its inside


# A fusion that adds into one row of a buffer in place (a stacked accumulator's layer).
_IN_PLACE = """HloModule m, entry_computation_layout={(f32[8,64]{1,0}, f32[1,64]{1,0}, s32[])->f32[8,64]{1,0}}

%fused_add (param_0: f32[8,64], param_1: f32[1,64], param_2: s32[]) -> f32[8,64] {
  %param_0 = f32[8,64]{1,0} parameter(0)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %row = f32[1,64]{1,0} dynamic-slice(%param_0, %param_2, %zero), dynamic_slice_sizes={1,64}
  %param_1 = f32[1,64]{1,0} parameter(1)
  %sum = f32[1,64]{1,0} add(%row, %param_1)
  ROOT %dus = f32[8,64]{1,0} dynamic-update-slice(%param_0, %sum, %param_2, %zero)
}

ENTRY %main (acc: f32[8,64], g: f32[1,64], k: s32[]) -> f32[8,64] {
  %acc = f32[8,64]{1,0} parameter(0)
  %g = f32[1,64]{1,0} parameter(1)
  %k = s32[] parameter(2)
  ROOT %fusion.1 = f32[8,64]{1,0} fusion(%acc, %g, %k), kind=kLoop, calls=%fused_add
}
"""


@pytest.mark.fast
def test_an_in_place_update_counts_the_slice_it_reads_and_writes_not_the_buffer():
  row = 64 * 4
  # The row read and written, the update read, the index.
  assert hlo_work.work(_IN_PLACE).bytes == 2 * row + row + 4


# XLA:GPU's forms of an FP8 matmul: a dot on FP8 operands in a Triton GEMM
# fusion, and cuBLASLt's FP8 GEMM; beside them a bf16 dot.
_FP8_GEMMS = """HloModule m, entry_computation_layout={(f8e4m3fn[8,16]{1,0}, f8e4m3fn[16,32]{1,0}, bf16[8,16]{1,0}, bf16[16,32]{1,0})->(bf16[8,32]{1,0}, bf16[8,32]{1,0}, bf16[8,32]{1,0})}

%triton_gemm (a: f8e4m3fn[8,16], b: f8e4m3fn[16,32]) -> bf16[8,32] {
  %a = f8e4m3fn[8,16]{1,0} parameter(0)
  %b = f8e4m3fn[16,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x8: f8e4m3fn[8,16], w8: f8e4m3fn[16,32], x: bf16[8,16], w: bf16[16,32]) -> (bf16[8,32], bf16[8,32], bf16[8,32]) {
  %x8 = f8e4m3fn[8,16]{1,0} parameter(0)
  %w8 = f8e4m3fn[16,32]{1,0} parameter(1)
  %x = bf16[8,16]{1,0} parameter(2)
  %w = bf16[16,32]{1,0} parameter(3)
  %fusion.1 = bf16[8,32]{1,0} fusion(%x8, %w8), kind=kCustom, calls=%triton_gemm
  %one = f32[] constant(1)
  %cublas = (bf16[8,32]{1,0}, s8[1024]{0}) custom-call(%x8, %w8, %one, %one), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %gte = bf16[8,32]{1,0} get-tuple-element(%cublas), index=0
  %dot.2 = bf16[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (bf16[8,32]{1,0}, bf16[8,32]{1,0}, bf16[8,32]{1,0}) tuple(%fusion.1, %gte, %dot.2)
}
"""


@pytest.mark.fast
def test_fp8_flops_are_the_matmuls_on_two_fp8_operands():
  one = 2 * 8 * 16 * 32
  w = hlo_work.work(_FP8_GEMMS)
  assert (w.flops, w.fp8_flops) == (3 * one, 2 * one)
  assert (2 * w).fp8_flops == 4 * one and (w + w).fp8_flops == 4 * one
  assert gemms.fp8_gemms(_FP8_GEMMS) == {'cublaslt': 1, 'triton': 1}
