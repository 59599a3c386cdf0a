"""scripts/bench_heterog.py: on HeteroG's testbed the layout matters once the model is BERT-large-sized."""

import harness
import pytest


@pytest.fixture(scope='module')
def bench():
  return harness.load_script('bench_heterog')


def test_the_mixed_clusters_are_the_ones_planned(bench):
  names = {c.name for c in bench.heterogeneous_clusters()}
  # Not the measured CPU spec, nor the learned planner's 256 GPUs.
  assert {'heterog_testbed', 'a100_v100_mixed'} <= names
  assert not names & {'cpu_forced_8', 'hetero_256', 'h100_8x_nvlink'}


def test_bert_large_on_the_heterog_testbed_beats_data_parallel(bench):
  (testbed,) = bench.heterogeneous_clusters({'heterog_testbed'})
  model = bench.LADDER[0]
  assert (model.layers, model.d_model, model.seq_len) == (24, 1024, 512)
  row = bench.plan(model, testbed)
  assert 0.3e9 < row['params'] < 0.4e9  # BERT-large's 340M, its head untied
  best = row['best'].plan
  n = testbed.num_devices
  # Not plain data parallel: on 50 Gb Ethernet its gradient all-reduce and
  # the 1080 Ti's pace cost more than another layout's.
  assert (best.data, best.tensor, best.pipe, best.state_sharding) != (n, 1, 1, 'replicated')
  assert row['speedups']['data_parallel'] > 1.05
  # The search includes its baselines: none is faster than its winner.
  for key, value in row['speedups'].items():
    assert value is None or value >= 1 - 1e-9, key
  assert bench.cell(row, 'data_parallel').endswith('x')
  assert bench.cell(dict(row, speedups={'x': None}), 'x') == 'does not fit'
