"""Cluster specs: the shipped files load, bad ones fail naming the file."""

import glob
import os

import pytest

from triax.errors import ConfigError
from triax.plan import cluster

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

ROOT = os.path.join(os.path.dirname(__file__), '..')
SHIPPED = sorted(glob.glob(os.path.join(ROOT, 'experiments', 'clusters', '*.yaml')))

GOOD = """
name: tiny
groups:
  - {name: a, type: A, count: 2, peak_flops: {bfloat16: 100 TFLOP/s, float32: 50 TFLOP/s},
     memory: 16 GiB, memory_bandwidth: 1 TB/s}
  - {name: b, type: B, count: 1, peak_flops: {bfloat16: 1e13, float32: 1e13},
     memory: 8 GB, memory_bandwidth: 500 GB/s}
nodes:
  - {name: n0, devices: {a: 2}, nic_bandwidth: 50 Gb/s}
  - {name: n1, devices: {b: 1}}
links:
  intra_node: {bandwidth: 12 GB/s, latency: 10 us}
  inter_node: {bandwidth: 100 Gb/s, latency: 25 us}
"""


def _write(tmp_path, text, name='spec.yaml'):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_shipped_specs_load():
  names = {os.path.basename(p) for p in SHIPPED}
  assert {
    'heterog_testbed.yaml',
    'a100_v100_mixed.yaml',
    'h100_8x_nvlink.yaml',
    'cpu_forced_8.yaml',
  } <= names
  # The seed's scale: Selene as the Megatron paper ran it, and DGX H100s.
  sizes = {'selene.yaml': 4480, 'dgx_h100.yaml': 1024, 'hetero_256.yaml': 256, 'tpu_v5p.yaml': 256}
  assert set(sizes) <= names
  for path in SHIPPED:
    spec = cluster.load(path)
    assert spec.num_devices == sizes.get(os.path.basename(path), 8), path
    assert all(g.memory > 0 for g in spec.groups.values())
    # Every GPU's compiler (XLA:GPU) runs a grouped matmul dense; TPU's and the measured CPU's not.
    gpu = {g.name: g.ragged_dot == 'dense' for g in spec.groups.values()}
    assert gpu == {g.name: g.name not in ('v5p', 'cpu') for g in spec.groups.values()}, path


def test_heterog_testbed_layout():
  spec = cluster.load(os.path.join(ROOT, 'experiments/clusters/heterog_testbed.yaml'))
  counts = {g.name: g.count for g in spec.groups.values()}
  assert counts == {'v100': 2, 'p100': 2, 'gtx1080ti': 4}
  assert len(spec.nodes) == 4
  # Between a 100 Gb and a 50 Gb node the slower NIC decides: 6.25 GB/s.
  v100, gtx = spec.devices[0].index, spec.devices[-1].index
  assert spec.link(v100, gtx).bandwidth == pytest.approx(50e9 / 8)
  assert spec.link(0, 1).bandwidth == pytest.approx(12e9)


def test_cpu_spec_says_cores_are_shared():
  spec = cluster.load(os.path.join(ROOT, 'experiments/clusters/cpu_forced_8.yaml'))
  assert spec.nodes[0].shared_cores == 2
  assert all(g.local for g in spec.groups.values())


def test_units_and_links(tmp_path):
  spec = cluster.load(_write(tmp_path, GOOD))
  a = spec.groups['a']
  assert a.memory == 16 * 2**30
  assert a.peak('bfloat16') == 100e12 and a.peak('float16') == 100e12
  assert a.memory_bandwidth == 1e12
  assert [d.group for d in spec.devices] == ['a', 'a', 'b']
  assert spec.link(0, 1).bandwidth == 12e9
  assert spec.link(0, 1).latency == pytest.approx(10e-6)
  assert spec.link(0, 2).bandwidth == 50e9 / 8  # n0's NIC caps it
  assert spec.link(0, 2).latency == pytest.approx(25e-6)
  assert spec.link(0, 2).time(0) == 0.0
  assert spec.link(0, 1).time(12e9) == pytest.approx(1 + 10e-6)


@pytest.mark.parametrize(
  'edit, message',
  [
    (lambda t: t.replace('count: 2', 'count: 3'), 'count 3 but the nodes place 2'),
    (lambda t: t.replace('16 GiB', '16 GiBs'), "unknown unit 'GiBs'"),
    (lambda t: t.replace('memory: 8 GB,', ''), "missing 'memory'"),
    (lambda t: t.replace('{a: 2}', '{c: 2}'), "unknown group 'c'"),
    (lambda t: t.replace('bfloat16: 1e13, ', ''), 'at least bfloat16 and float32'),
    (lambda t: t.replace('500 GB/s', 'measured'), 'needs profile: local'),
    (lambda t: t.replace('latency: 25 us', 'latency: -1'), 'must be non-negative'),
    (lambda t: t + 'extra: 1\n', 'unknown top-level key(s) extra'),
    (
      lambda t: t.replace(
        'name: n1, devices: {b: 1}', 'name: n1, devices: {b: 1}, shared_cores: 0'
      ),
      'shared_cores',
    ),
    (lambda t: 'name: [unclosed', 'not valid YAML'),
    (
      lambda t: t.replace('memory: 8 GB,', 'memory: 8 GB, ragged_dot: sparse,'),
      "ragged_dot: want one of grouped, dense, got 'sparse'",
    ),
  ],
)
def test_bad_specs_name_the_file_and_the_fix(tmp_path, edit, message):
  path = _write(tmp_path, edit(GOOD))
  with pytest.raises(ConfigError) as info:
    cluster.load(path)
  assert info.value.key == '--cluster'
  assert info.value.message.startswith(path + ': ')
  assert message in info.value.message


def test_missing_file(tmp_path):
  with pytest.raises(ConfigError, match='no such file'):
    cluster.load(str(tmp_path / 'nope.yaml'))
