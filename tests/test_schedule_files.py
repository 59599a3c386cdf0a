"""Schedules read from and written to files (triax.pipeline.files): torch's
compute-only CSV and triax's JSON, their round trips, fixtures written by
torch itself, every kind of bad file, the config key and the CLI.

Pure Python: no JAX compiles (the CLI cases run in subprocesses), and
torch is never needed: the fixtures under tests/data were written by
scripts/torch_schedule_csv.py beforehand.
"""

import csv
import json
import os

import harness
import pytest

from triax import config
from triax.errors import ConfigError
from triax.pipeline import files
from triax.pipeline import schedule as sched

DATA = os.path.join(os.path.dirname(__file__), 'data')


def built_schedules(p=4, m=8):
  """(name, v) for every registered schedule and each v in 1, 2 it builds with."""
  out = []
  for name in sched.SCHEDULES:
    for v in (1, 2):
      try:
        sched.build(name, p, m, v)
      except ConfigError:
        continue
      out.append((name, v))
  return out


BUILT = built_schedules()
MOVES_RESIDUALS = {name for name, v in BUILT if sched.build(name, 4, 8, v).partner is not None}


def compute_orders(schedule):
  return tuple(tuple(a for a in o if a.kind in sched.COMPUTE_KINDS) for o in schedule.orders)


def cells_of(path):
  with open(path, newline='') as f:
    return [cell for row in csv.reader(f) for cell in row if cell]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize('name, v', [x for x in BUILT if x[0] not in MOVES_RESIDUALS])
def test_csv_round_trip(name, v, tmp_path):
  built = sched.build(name, 4, 8, v)
  path = str(tmp_path / f'{name}.csv')
  files.write_csv(built, path)
  loaded = files.load(path, 4, 8, v)
  assert compute_orders(loaded) == compute_orders(built)
  assert loaded.placement == built.placement
  assert loaded.split_backward == built.split_backward
  kinds = {cell.rstrip('0123456789').lstrip('0123456789') for cell in cells_of(path)}
  # A fused backward is written as torch's full backward B, a split one as I and W
  # (DualPipeV's overlapped cells and full backwards: tests/test_dualpipe_v.py).
  if not (built.overlaps or built.full_backwards):
    assert kinds == ({'F', 'I', 'W'} if built.split_backward else {'F', 'B'})
  sched.lower(loaded)


@pytest.mark.parametrize('name', sorted(MOVES_RESIDUALS))
def test_csv_cannot_hold_residual_copies(name, tmp_path):
  with pytest.raises(ValueError, match='EVICT'):
    files.write_csv(sched.build(name, 4, 8), str(tmp_path / 'x.csv'))
  assert not os.path.exists(tmp_path / 'x.csv')


@pytest.mark.parametrize('name, v', BUILT)
def test_json_round_trip_is_exact(name, v, tmp_path):
  built = sched.build(name, 4, 8, v)
  path = str(tmp_path / f'{name}.json')
  files.write_json(built, path)
  assert files.load(path, 4, 8, v) == built  # orders, placement, partner, stash_cap, name
  with open(path) as f:
    doc = json.load(f)
  assert doc['orders'][0][0] == 'F0.0' and doc['placement'] == list(built.placement)


def test_json_keeps_bpipe_copies_and_partner(tmp_path):
  built = sched.build('bpipe', 4, 16)
  path = str(tmp_path / 'bpipe.json')
  files.write_json(built, path)
  loaded = files.load(path)
  assert loaded.partner == (3, 2, 1, 0) and loaded.stash_cap == built.stash_cap
  assert loaded.evicted == built.evicted and loaded.evicted
  assert sched.transfers_per_step(sched.lower(loaded)) == sched.transfers_per_step(
    sched.lower(built)
  )


def test_csv_is_torchs_format(tmp_path):
  """No header, commas, CRLF line ends, `{chunk}{kind}{micro-batch}` cells at
  their unit-cost ticks, empty cells for idle steps, rows not padded."""
  path = str(tmp_path / 'x.csv')
  files.write_csv(sched.build('1f1b', 2, 2), path)
  with open(path, 'rb') as f:
    assert f.read() == b'0F0,0F1,,0B0,,0B1\r\n,1F0,1B0,1F1,1B1\r\n'
  zb = sched.build('zb_h1', 2, 2)
  files.write_csv(zb, path)
  letter = {'F': 'F', 'B': 'I', 'W': 'W'}  # a split backward's B is torch's I
  last = ','.join(f'1{letter[a.kind]}{a.microbatch}' for a in zb.orders[1])
  with open(path, 'rb') as f:
    assert f.read().split(b'\r\n')[1] == f',{last}'.encode()


def test_csv_sizes_come_from_the_file_when_not_given(tmp_path):
  path = str(tmp_path / 'x.csv')
  files.write_csv(sched.build('interleaved_1f1b', 2, 4, 2), path)
  loaded = files.load(path)
  assert (loaded.stages, loaded.microbatches, loaded.virtual_stages) == (2, 4, 2)
  assert loaded.name == 'x'


# ---------------------------------------------------------------- torch's own files

# file stem -> (p, m, v, our builder for the same schedule or None).
FIXTURES = {
  'torch_gpipe_p4_m8': (4, 8, 1, 'gpipe'),
  # Built by another engineer's builders, still in flux: only checked to load
  # and lower here (when written, they matched torch's orders exactly).
  'torch_interleaved_1f1b_p4_v2_m8': (4, 8, 2, None),
  'torch_interleaved_1f1b_p4_v2_m6': (4, 6, 2, None),  # m not a multiple of p
  'torch_interleaved_zb_p4_v2_m8': (4, 8, 2, None),
  'torch_zbv_p4_v2_m8': (4, 8, 2, None),
}


@pytest.mark.parametrize('stem', sorted(FIXTURES))
def test_torch_fixture_loads_and_lowers(stem):
  p, m, v, builder = FIXTURES[stem]
  loaded = files.load(os.path.join(DATA, f'{stem}.csv'), p, m, v)
  program = sched.lower(loaded)
  assert program.ticks > 0 and (loaded.stages, loaded.microbatches) == (p, m)
  if stem == 'torch_zbv_p4_v2_m8':
    assert loaded.placement == sched.v_placement(4)
  if builder is not None:
    built = sched.build(builder, p, m, v)
    assert loaded.orders == built.orders and loaded.placement == built.placement


def test_torch_single_stage_files_skip_reduce_grad():
  # torch's single-stage schedules end each rank with REDUCE_GRAD, no idle cells.
  assert 'REDUCE_GRAD' in ''.join(cells_of(os.path.join(DATA, 'torch_gpipe_p4_m8.csv')))


def test_torch_1f1b_fixture_is_wrong_on_its_last_rank():
  """torch 2.13's Schedule1F1B.pipeline_order starts the last rank at
  micro-batch 1 (3F1 ... 3F8, never 3F0): the loader says where. Its other
  ranks are our 1F1B exactly."""
  path = os.path.join(DATA, 'torch_1f1b_p4_m8.csv')
  with pytest.raises(ConfigError, match=r'row 3, cell 14: 3F8 is micro-batch 8'):
    files.load(path, 4, 8, 1)
  with pytest.raises(ConfigError, match=r'row 3, cell 1: 3B0 has no 3F0'):
    files.load(path)
  built = sched.build('1f1b', 4, 8)
  with open(path, newline='') as f:
    rows = [[x for x in row if x and 'REDUCE_GRAD' not in x] for row in csv.reader(f)]
  for s in range(3):
    assert rows[s] == [f'{a.chunk}{a.kind}{a.microbatch}' for a in built.orders[s]]


# ---------------------------------------------------------------- bad files

GOOD = '0F0,0F1,0B0,0B1\r\n1F0,1F1,1B0,1B1\r\n'  # 1f1b-ish, p=2, m=2, v=1
GOOD_JSON = {
  'name': 'x',
  'stages': 2,
  'microbatches': 1,
  'virtual_stages': 1,
  'placement': [0, 1],
  'partner': None,
  'stash_cap': None,
  'orders': [['F0.0', 'B0.0'], ['F0.1', 'B0.1']],
}


def doc(**changes):
  return json.dumps(dict(GOOD_JSON, **changes))


BAD = [
  # id, file name, contents, sizes (p, m, v), what the message must say
  ('bad-token', 'x.csv', '0F0,F1\r\n', None, 'row 0, cell 1: bad cell'),
  (
    'unknown-kind',
    'x.csv',
    GOOD.replace('1B1', '1X1'),
    None,
    "row 1, cell 3: 1X1: unknown kind 'X'",
  ),
  (
    'recompute-cell',
    'x.csv',
    GOOD.replace('1B1', '1R1,1B1'),
    None,
    'row 1, cell 3: 1R1: torch has no recompute action; B reruns the forward',
  ),
  (
    'no-microbatch',
    'x.csv',
    GOOD.replace('1B1', '1B'),
    None,
    'row 1, cell 3: 1B names no micro-batch',
  ),
  (
    'comms-cell',
    'x.csv',
    GOOD.replace('1B1', '1SEND_B1'),
    None,
    'row 1, cell 3: 1SEND_B1 is a communication',
  ),
  (
    'overlap-cell',
    'x.csv',
    GOOD.replace('1B1', '(1B1;1F1)OVERLAP_F_B'),
    None,
    "row 1, cell 3: bad cell '(1B1;1F1)OVERLAP_F_B'; an overlapped pair is a forward then",
  ),
  (
    'chunk-on-two-rows',
    'x.csv',
    GOOD.replace('1F1', '0F1'),
    None,
    'row 1, cell 1: 0F1: torch stage 0 is already on row 0',
  ),
  ('duplicate', 'x.csv', GOOD.replace('0B1', '0B0'), None, 'row 0, cell 3: 0B0 appears twice'),
  ('missing-forward', 'x.csv', GOOD.replace('1F1,', ''), None, 'row 1, cell 2: 1B1 has no 1F1'),
  ('missing-backward', 'x.csv', GOOD.replace(',1B1', ''), None, 'row 1, cell 1: 1F1 has no 1B1'),
  ('missing-weight', 'x.csv', '0F0,0I0,0W0\r\n1F0,1I0\r\n', None, 'row 1, cell 1: 1I0 has no 1W0'),
  (
    'full-b-and-its-w',
    'x.csv',
    '0F0,0B0,0W0\r\n1F0,1I0,1W0\r\n',
    None,
    'row 0, cell 2: 0W0: 0B0 at row 0, cell 1 is a full backward',
  ),
  ('uneven-rows', 'x.csv', '0F0,0B0,2F0,2B0\r\n1F0,1B0\r\n', None, 'row 1: runs torch stages [1]'),
  (
    'gap-in-chunks',
    'x.csv',
    '0F0,0B0\r\n2F0,2B0\r\n',
    None,
    'row 1, cell 0: torch stage 2 is here',
  ),
  (
    'deadlock',
    'x.csv',
    '0F0,0F1,0B1,0B0\r\n1B0,1F0,1F1,1B1\r\n',
    None,
    "row 0, cell 2: 0B1 and the other stages' next actions wait on each other",
  ),
  ('stages-differ', 'x.csv', GOOD, (4, 2, 1), '2 rows (pipeline stages), but mesh.pipe is 4'),
  (
    'microbatches-too-many',
    'x.csv',
    GOOD,
    (2, 1, 1),
    'row 0, cell 1: 0F1 is micro-batch 1, but pipeline.microbatches is 1',
  ),
  ('microbatches-too-few', 'x.csv', GOOD, (2, 3, 1), 'but pipeline.microbatches is 3'),
  ('virtual-stages-differ', 'x.csv', GOOD, (2, 2, 2), 'but pipeline.virtual_stages is 2'),
  ('empty', 'x.csv', '', None, 'no actions'),
  ('not-utf8', 'x.csv', b'\xff\xfe0F0', None, 'cannot read it'),
  ('unknown-extension', 'x.txt', GOOD, None, 'unknown file type .txt'),
  ('json-syntax', 'x.json', '{"stages": 2,', None, 'not JSON (line 1'),
  ('json-unknown-key', 'x.json', doc(stage=2), None, "unknown key 'stage'"),
  (
    'json-bad-action',
    'x.json',
    doc(orders=[['F0.0', 'B0'], ['F0.1', 'B0.1']]),
    None,
    "row 0, cell 1: bad action 'B0'",
  ),
  (
    'json-wrong-row',
    'x.json',
    doc(orders=[['F0.0', 'B0.0', 'F0.1'], ['B0.1']]),
    None,
    'row 0, cell 2: F0.1 runs on stage 1',
  ),
  (
    'json-outside-sizes',
    'x.json',
    doc(orders=[['F0.0', 'B0.0', 'F1.0'], ['F0.1', 'B0.1']]),
    None,
    'row 0, cell 2: F1.0 is outside micro-batches 0..0',
  ),
  (
    'json-evict-without-load',
    'x.json',
    doc(partner=[1, 0], orders=[['F0.0', 'EVICT0.0', 'B0.0'], ['F0.1', 'B0.1']]),
    None,
    'row 0, cell 1: EVICT0.0 has no LOAD0.0',
  ),
  (
    'json-copy-without-partner',
    'x.json',
    doc(orders=[['F0.0', 'EVICT0.0', 'B0.0'], ['F0.1', 'B0.1', 'LOAD0.0']]),
    None,
    'row 0, cell 1: EVICT0.0 moves residuals but the file gives no partner',
  ),
  ('json-partner-not-paired', 'x.json', doc(partner=[1, 1]), None, 'must pair stages up'),
  ('json-rows-differ', 'x.json', doc(orders=[['F0.0', 'B0.0']]), None, 'orders must be 2 lists'),
  ('json-stages-differ', 'x.json', json.dumps(GOOD_JSON), (4, 1, 1), 'but mesh.pipe is 4'),
]


@pytest.mark.parametrize('case', BAD, ids=[c[0] for c in BAD])
def test_bad_file_names_where_and_what(case, tmp_path):
  _, name, contents, sizes, says = case
  path = str(tmp_path / name)
  with open(path, 'wb') as f:
    f.write(contents if isinstance(contents, bytes) else contents.encode())
  with pytest.raises(ConfigError) as e:
    files.load(path, *(sizes or (None, None, None)))
  assert e.value.key == 'pipeline.schedule_file'
  assert e.value.message.startswith(f'{path}: ') and '\n' not in e.value.message
  assert says in e.value.message, e.value.message


def test_missing_file(tmp_path):
  with pytest.raises(ConfigError, match='no such file') as e:
    files.load(str(tmp_path / 'none.csv'))
  assert e.value.key == 'pipeline.schedule_file'


def test_the_bad_files_start_from_good_ones(tmp_path):
  # Each bad case above is one edit away from one of these.
  for name, text in (('x.csv', GOOD), ('x.json', json.dumps(GOOD_JSON))):
    path = str(tmp_path / name)
    with open(path, 'w', newline='') as f:
      f.write(text)
    assert files.load(path, 2, None, 1).stages == 2


# ---------------------------------------------------------------- config and CLIs


def smoke_like_config(schedule_file):
  c = config.defaults()
  c.mesh.data, c.mesh.tensor, c.mesh.pipe = 1, 1, 2
  c.pipeline.schedule, c.pipeline.virtual_stages, c.pipeline.microbatches = 'gpipe', 2, 4
  c.model.num_layers, c.train.global_batch_size = 4, 8
  c.pipeline.schedule_file = schedule_file
  return c


def test_config_validates_the_schedule_file(tmp_path):
  assert config.defaults().pipeline.schedule_file == ''
  good, bad = str(tmp_path / 'good.csv'), str(tmp_path / 'bad.csv')
  files.write_csv(sched.build('interleaved_1f1b', 2, 4, 2), good)
  config.validate(smoke_like_config(good), 2)
  with open(bad, 'w') as f:
    f.write('0F0,0X1\r\n')
  with pytest.raises(ConfigError, match=r'row 0, cell 1') as e:
    config.validate(smoke_like_config(bad), 2)
  assert e.value.key == 'pipeline.schedule_file'


def test_schedule_cli_reads_a_file_and_writes_csv(tmp_path):
  out_csv = str(tmp_path / 'out.csv')
  result = harness.run_cli(
    'triax.cli.schedule',
    f'--schedule_file={DATA}/torch_interleaved_zb_p4_v2_m8.csv',
    f'--write_csv={out_csv}',
    '--json',
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert (report['stages'], report['microbatches'], report['virtual_stages']) == (4, 8, 2)
  assert report['valid'] is True and report['split_backward'] is True
  for model in ('lockstep', 'async'):
    assert set(report['models'][model]) >= {'total_time', 'bubble_fraction', 'peak_inflight'}
    assert len(report['models'][model]['peak_inflight']) == 4
  assert report['models']['lockstep']['ticks'] == report['ticks']
  assert set(report['slots']) == {'msg', 'stash', 'cut'}
  assert report['residual_sets_moved'] == 0 and report['csv'] == out_csv
  original = files.load(f'{DATA}/torch_interleaved_zb_p4_v2_m8.csv')
  assert files.load(out_csv, 4, 8, 2).orders == original.orders


def test_schedule_cli_bad_file_exits_2_with_one_line(tmp_path):
  path = str(tmp_path / 'bad.csv')
  with open(path, 'w') as f:
    f.write(GOOD.replace('1B1', '1X1'))
  result = harness.run_cli(
    'triax.cli.schedule', f'--schedule_file={path}', '--stages=2', timeout=120
  )
  assert result.returncode == 2 and result.stdout == ''
  assert result.stderr.strip().splitlines() == [
    f"error: --schedule_file: {path}: row 1, cell 3: 1X1: unknown kind 'X'; want F "
    '(forward), B (full backward), I (input-gradient backward) or W (weight gradient)'
  ]
