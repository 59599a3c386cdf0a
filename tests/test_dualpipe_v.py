"""DualPipeV (pipeline.schedule=dualpipe_v): torch's orders, its CSV cells
(`(0F3;7B1)OVERLAP_F_B`, full backwards beside I and W) read and written
byte for byte, the lockstep program's ticks and stash, the CLI, bad input,
and one device's losses from a file torch wrote.

tests/data/torch_dualpipev_p4_v2_m8.csv was written by torch 2.13's
`ScheduleDualPipeV._dump_csv` (scripts/torch_schedule_csv.py); the tests
that build torch's orders at other sizes need torch (the test extra).
"""

import collections
import dataclasses
import functools
import json
import os

import harness
import numpy as np
import pytest

from triax import config
from triax.errors import ConfigError
from triax.pipeline import files
from triax.pipeline import schedule as sched
from triax.pipeline.ir import Action
from triax.pipeline.simulate import Costs, simulate_async, simulate_lockstep
from triax.pipeline.validate import validate

FIXTURE = os.path.join(harness.ROOT, 'tests', 'data', 'torch_dualpipev_p4_v2_m8.csv')
SIZES = [(p, m) for p in range(1, 9) for m in sorted({2 * p, 2 * p + 1, 3 * p, 4 * p})]


def read_bytes(path):
  with open(path, 'rb') as f:
    return f.read()


def torch_csv(p, m, path):
  """Writes torch's own DualPipeV orders for (p, m) with its `_dump_csv`."""
  pytest.importorskip('torch')
  script = harness.load_script('torch_schedule_csv')
  stages = [script._SizesOnlyStage(2 * p, p) for _ in range(2)]  # pylint: disable=protected-access
  schedules = script.schedules
  schedules.ScheduleDualPipeV(stages, m)._dump_csv(path, 'compute_only')  # pylint: disable=protected-access


# ---------------------------------------------------------------- torch's orders


@pytest.mark.fast
@pytest.mark.parametrize('p, m', SIZES)
def test_orders_and_cells_are_torchs(p, m, tmp_path):
  theirs, ours = str(tmp_path / 'torch.csv'), str(tmp_path / 'ours.csv')
  torch_csv(p, m, theirs)
  built = sched.build('dualpipe_v', p, m, 2)
  files.write_csv(built, ours)
  assert read_bytes(ours) == read_bytes(theirs)
  loaded = files.load(theirs, p, m, 2)
  assert loaded.orders == built.orders and loaded.placement == sched.v_placement(p)
  assert loaded.overlaps == built.overlaps and loaded.full_backwards == built.full_backwards


@pytest.mark.fast
def test_torchs_file_round_trips_byte_for_byte(tmp_path):
  text = read_bytes(FIXTURE).decode()
  assert '(0F7;7B3)OVERLAP_F_B' in text and '7I0,7W0' in text and ',7B4,' in text
  loaded = files.load(FIXTURE, 4, 8, 2)
  assert len(loaded.overlaps) == text.count('OVERLAP_F_B') == 25
  out = str(tmp_path / 'out.csv')
  files.write_csv(loaded, out)
  assert read_bytes(out) == read_bytes(FIXTURE)
  files.write_json(loaded, str(tmp_path / 'out.json'))
  assert files.load(str(tmp_path / 'out.json')) == loaded


@pytest.mark.fast
def test_a_cell_is_one_two_or_three_of_our_actions():
  s = sched.build('dualpipe_v', 4, 8, 2)
  f, b = Action('F', 7, 0), Action('B', 3, 7)  # torch's (0F7;7B3)OVERLAP_F_B
  assert (f, b) in s.overlaps and b in s.full_backwards
  order = s.orders[0]
  i = order.index(f)
  assert order[i : i + 3] == (f, b, Action('W', 3, 7))
  # torch's 7I0,7W0: an input gradient, then its weight gradient, not a full backward.
  assert Action('B', 0, 7) not in s.full_backwards
  sizes = collections.Counter(len(cell) for row in files.torch_cells(s) for cell in row)
  assert sizes == {1: 6 * 8 * 4 - 2 * 42 - 25, 2: 42 - 25, 3: 25}


# ---------------------------------------------------------------- builder and program


@pytest.mark.fast
@pytest.mark.parametrize('p, m', SIZES)
def test_valid_and_as_short_as_zb_v(p, m):
  """Each action once on its stage; the lockstep program (a pair in
  consecutive ticks) takes ZB-V's 6m + p - 1 ticks and stashes one chunk
  set more than ZB-V on every stage (2p + 1)."""
  s = sched.build('dualpipe_v', p, m, 2)
  seen = collections.Counter(a for order in s.orders for a in order)
  want = {Action(k, j, c) for k in 'FBW' for j in range(m) for c in range(2 * p)}
  assert set(seen) == want and set(seen.values()) == {1}
  assert all({s.stage_of(a.chunk) for a in o} == {d} for d, o in enumerate(s.orders))
  program = sched.lower(s)
  assert validate(s, program) == []
  assert program.ticks == sched.lower(sched.build('zb_v', p, m, 2)).ticks == 6 * m + p - 1
  assert program.peaks['stash'] == (2 * p + 1,) * p
  # The as-soon-as-possible timing of the same orders, each chunk action
  # costing one (stage costs of 2 split over v = 2): the same ticks and stash.
  unit = simulate_async(s, Costs(2, 2, 2))
  assert (unit.total_time, unit.peak_inflight) == (program.ticks, program.peaks['stash'])


@pytest.mark.fast
@pytest.mark.parametrize('p, m', SIZES)
def test_fused_ticks_run_each_pair_with_its_w(p, m):
  """pipeline.fuse_overlaps: every overlapped pair runs in one tick with its
  B's W; the F's set is written after that W freed its own, so every stage
  but the last holds one set less. For p >= 3 the program takes 2m + 6p - 2
  ticks."""
  s = sched.build('dualpipe_v', p, m, 2)
  program = sched.lower(s, fuse_overlaps=True)
  assert validate(s, program) == []
  cells = {tuple(cell) for row in program.grid for cell in row if len(cell) > 1}
  assert cells == {(f, b, Action('W', b.microbatch, b.chunk)) for f, b in s.overlaps}
  assert program.peaks['stash'] == (2 * p,) * (p - 1) + (2 * p + 1,)
  if p >= 3:
    assert program.ticks == 2 * m + 6 * p - 2


@pytest.mark.fast
@pytest.mark.parametrize('p', [4, 8])
def test_a_fused_tick_hides_the_exchange_at_a_price_in_the_ramps(p):
  """Timed in lockstep (costs 2 a stage, so 1 a chunk action): a fused tick
  lasts its three actions, and a stage beside it running one waits, which
  costs the ramps the same time at m = 2p and 4p; with an all-to-all as
  long as the compute (DeepSeek-V3's case), hiding it wins."""
  extra, won = [], []
  for m in (2 * p, 4 * p):
    s = sched.build('dualpipe_v', p, m, 2)
    plain, fused = sched.lower(s), sched.lower(s, fuse_overlaps=True)
    time = lambda prog, x: simulate_lockstep(prog, Costs(2, 2, 2, t_exchange=x)).total_time  # noqa: E731
    extra.append(time(fused, 0) - time(plain, 0))
    won.append(time(fused, 2) / time(plain, 2))
  assert extra[0] == extra[1] > 0
  assert 1 > won[0] > won[1]  # and more so the longer the steady state


@pytest.mark.fast
@pytest.mark.parametrize(
  'table, says',
  [
    ('src', 'holds act'),
    ('stash', 'holds set'),
    ('mb', "but the tables say ['F"),
  ],
)
def test_the_validator_replays_the_second_lane(table, says):
  s = sched.build('dualpipe_v', 4, 8, 2)
  program = sched.lower(s, fuse_overlaps=True)
  t, stage = (int(x) for x in np.argwhere(program.lane2['mb'] >= 0)[5])
  lane2 = {k: v.copy() for k, v in program.lane2.items()}
  lane2[table][t, stage] = (lane2[table][t, stage] + 1) % 3
  problems = validate(s, dataclasses.replace(program, lane2=lane2))
  assert problems and says in problems[0], problems


@pytest.mark.fast
def test_cli_times_plots_and_writes_torchs_csv(tmp_path):
  out_csv, png = str(tmp_path / 'd.csv'), str(tmp_path / 'd.png')
  result = harness.run_cli(
    'triax.cli.schedule',
    '--schedule=dualpipe_v',
    '--stages=4',
    '--microbatches=8',
    '--json',
    f'--plot={png}',
    f'--write_csv={out_csv}',
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert (report['virtual_stages'], report['ticks'], report['valid']) == (2, 51, True)
  assert report['peak_inflight'] == [9, 9, 9, 9]
  assert report['bubble_fraction'] == pytest.approx(3 / 51)
  assert read_bytes(out_csv) == read_bytes(FIXTURE)
  assert read_bytes(png)[:4] == b'\x89PNG'


@pytest.mark.fast
def test_cli_times_the_fused_ticks_with_their_exchange():
  result = harness.run_cli(
    'triax.cli.schedule',
    '--schedule=dualpipe_v',
    '--stages=4',
    '--microbatches=16',
    '--fuse_overlaps',
    '--t_exchange=1',
    '--json',
    timeout=120,
  )
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert (report['ticks'], report['fused_ticks'], report['valid']) == (54, 89, True)
  # Half docs/bench_moe.md's one-to-one row at m = 16 (136): here a chunk
  # action and its exchange cost 0.5 each (stage costs of 1 over v = 2).
  assert report['models']['lockstep']['total_time'] == 68
  assert report['peak_inflight'] == [8, 8, 8, 9]


# ---------------------------------------------------------------- bad input


@pytest.mark.fast
@pytest.mark.parametrize(
  'flags, says',
  [
    (
      ('--microbatches=7',),
      'error: --microbatches: dualpipe_v needs at least as many micro-batches as model '
      'chunks (2 x 4 stages = 8, as torch requires); got 7',
    ),
    (
      ('--microbatches=8', '--virtual_stages=1'),
      'error: --virtual_stages: dualpipe_v runs exactly 2 model chunks per stage (a V); got 1',
    ),
    (
      ('--schedule=zb_v', '--fuse_overlaps'),
      'error: --fuse_overlaps: zb_v marks no overlapped pairs to fuse; dualpipe_v does, and a '
      'schedule file with OVERLAP_F_B cells',
    ),
    (
      ('--t_exchange=-1',),
      'error: --t_exchange: must be a finite number >= 0; got -1.0',
    ),
  ],
)
def test_cli_bad_sizes_one_line_exit_2(flags, says):
  name = () if any(f.startswith('--schedule=') for f in flags) else ('--schedule=dualpipe_v',)
  result = harness.run_cli('triax.cli.schedule', *name, '--stages=4', *flags, timeout=120)
  assert result.returncode == 2 and result.stdout == ''
  assert result.stderr.strip().splitlines() == [says]


@pytest.mark.fast
@pytest.mark.fast
@pytest.mark.parametrize(
  'overrides, says',
  [
    (
      {'pipeline.schedule': 'zb_v'},
      'zb_v marks no overlapped pairs to fuse; dualpipe_v does, and a schedule file with '
      'OVERLAP_F_B cells',
    ),
    (
      {'pipeline.offload_stash': True},
      'a fused tick reads one residual set and writes another, and pipeline.offload_stash '
      'copies one a tick; set one of them to false',
    ),
  ],
)
def test_fuse_overlaps_needs_pairs_and_a_stash_on_the_device(overrides, says):
  fused = {
    'mesh.pipe': 4,
    'pipeline.schedule': 'dualpipe_v',
    'pipeline.virtual_stages': 2,
    'pipeline.microbatches': 8,
    'pipeline.fuse_overlaps': True,
  }
  cfg = harness.tiny_config(**{**fused, **overrides})
  with pytest.raises(ConfigError) as e:
    config.validate(cfg, 4)
  assert (e.value.key, e.value.message) == ('pipeline.fuse_overlaps', says)


@pytest.mark.fast
def test_a_pair_whose_w_comes_later_is_refused_for_fusing():
  """An `(F;I)` cell (torch's I: input gradient only) with its W later."""
  f, b, w = (Action(k, j, 0) for k, j in (('F', 1), ('B', 0), ('W', 0)))
  order = (Action('F', 0, 0), f, b, Action('B', 1, 0), w, Action('W', 1, 0))
  s = sched.Schedule('file', 1, 2, 1, (order,), overlaps=[(f, b)])
  with pytest.raises(ConfigError) as e:
    sched.check_fusable(s)
  assert e.value.key == 'pipeline.fuse_overlaps'
  assert e.value.message == (
    'file: the pair (F1.0;B0.0) has its W later, not at once after its B, so it cannot run '
    'as one tick (1 such pair(s)); make its backward whole'
  )


def test_config_names_the_key():
  c = harness.tiny_config(
    **{
      'mesh.pipe': 4,
      'pipeline.schedule': 'dualpipe_v',
      'pipeline.virtual_stages': 2,
      'pipeline.microbatches': 4,
    }
  )
  with pytest.raises(ConfigError, match='at least as many micro-batches') as e:
    config.validate(c, 4)
  assert e.value.key == 'pipeline.microbatches'
  c.pipeline.microbatches = 8
  config.validate(c, 4)


@pytest.mark.fast
def test_train_refuses_too_few_microbatches_and_writes_nothing(tmp_path):
  workdir = tmp_path / 'run'
  result = harness.run_cli(
    'triax.cli.train',
    '--config=experiments/gpt_tiny.py:smoke',
    f'--workdir={workdir}',
    '--cpu_devices=8',
    '--config.mesh.data=2',
    '--config.mesh.tensor=1',
    '--config.mesh.pipe=4',
    '--config.pipeline.schedule=dualpipe_v',
    '--config.pipeline.virtual_stages=2',
    '--config.pipeline.microbatches=4',
    timeout=120,
  )
  assert result.returncode == 2 and not workdir.exists()
  assert result.stderr.strip().splitlines() == [
    'error: pipeline.microbatches: dualpipe_v needs at least as many micro-batches as model '
    'chunks (2 x 4 stages = 8, as torch requires); got 4'
  ]


OVERLAP_BAD = [
  ('(0F0)OVERLAP_F_B', "bad cell '(0F0)OVERLAP_F_B'; an overlapped pair is a forward then"),
  ('(0F0;0B0;0W0)OVERLAP_F_B', "bad cell '(0F0;0B0;0W0)OVERLAP_F_B'"),
  ('(0F0;0F1)OVERLAP_F_B', "bad cell '(0F0;0F1)OVERLAP_F_B'"),
  ('(0F0;0B0)OVERLAP_X', "bad cell '(0F0;0B0)OVERLAP_X'"),
  ('(0F0;0X0)OVERLAP_F_B', "0X0: unknown kind 'X'"),
]


@pytest.mark.fast
@pytest.mark.parametrize('cell, says', OVERLAP_BAD, ids=[c for c, _ in OVERLAP_BAD])
def test_bad_overlap_cells_name_the_cell(cell, says, tmp_path):
  path = str(tmp_path / 'x.csv')
  with open(path, 'w', newline='') as f:
    f.write(f'{cell},0B0\r\n')
  with pytest.raises(ConfigError) as e:
    files.load(path)
  assert e.value.key == 'pipeline.schedule_file'
  assert f'{path}: row 0, cell 0: {says}' in e.value.message


@pytest.mark.fast
def test_an_overlap_in_a_fused_file_round_trips(tmp_path):
  path, out = str(tmp_path / 'x.csv'), str(tmp_path / 'y.csv')
  with open(path, 'w', newline='') as f:
    f.write('0F0,(0F1;0B0)OVERLAP_F_B,0B1\r\n')
  s = files.load(path)
  assert not s.split_backward and s.overlaps == {(Action('F', 1, 0), Action('B', 0, 0))}
  assert s.orders == ((Action('F', 0, 0), Action('F', 1, 0), Action('B', 0, 0), Action('B', 1, 0)),)
  files.write_csv(s, out)
  assert read_bytes(out) == read_bytes(path)


@pytest.mark.fast
@pytest.mark.parametrize(
  'change, says',
  [
    ({'overlaps': [['F7.0', 'B4.7']]}, 'F7.0 overlaps B4.7, which must come right after it'),
    ({'overlaps': [['F7.0', 'F6.0']]}, 'overlap (F7.0, F6.0) must pair a forward with a backward'),
    ({'overlaps': 'F7.0'}, 'overlaps must be null or a list of pairs'),
    ({'full_backwards': ['B7.6']}, 'B7.6 is a full backward: its W7.6 must come right after it'),
    ({'full_backwards': ['B9.9']}, 'names an action that is in no order'),
    ({'full_backwards': ['F0.0']}, 'full_backwards must hold backward (B) actions only'),
  ],
)
def test_json_marks_must_agree_with_the_orders(change, says, tmp_path):
  path = str(tmp_path / 'x.json')
  files.write_json(sched.build('dualpipe_v', 4, 8, 2), path)
  with open(path) as f:
    doc = json.load(f)
  doc.update(change)
  with open(path, 'w') as f:
    json.dump(doc, f)
  with pytest.raises(ConfigError, match='pipeline.schedule_file') as e:
    files.load(path)
  assert says in e.value.message, e.value.message


# ---------------------------------------------------------------- one device's losses


_BASE = {'model.num_layers': 8, 'train.global_batch_size': 32, 'pipeline.microbatches': 8}


@functools.cache
def _one_device():
  """The reference every layout below is compared with: one model, one batch, one run."""
  return harness.loss_and_grads(harness.tiny_config(**_BASE, **{'mesh.data': 1}))


def _check(mesh, **overrides):
  """Loss and gradients at (data, 1, 4) against one device (fp32, 1e-5)."""
  ref_loss, ref_grads = _one_device()
  data, tensor, pipe = mesh
  cfg = harness.tiny_config(
    **_BASE,
    **{'mesh.data': data, 'mesh.tensor': tensor, 'mesh.pipe': pipe},
    **{'pipeline.virtual_stages': 2},
    **overrides,
  )
  loss, grads = harness.loss_and_grads(cfg)
  assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
  assert harness.max_rel_err(ref_grads, grads) <= 1e-5


@pytest.mark.parametrize('mesh', [(1, 1, 4), (2, 1, 4)], ids=['1x1x4', '2x1x4'])
@pytest.mark.parametrize('source', ['torch_file', 'by_name'])
def test_matches_one_device(source, mesh):
  if source == 'torch_file':
    _check(mesh, **{'pipeline.schedule_file': FIXTURE})
  else:
    _check(mesh, **{'pipeline.schedule': 'dualpipe_v'})


@pytest.mark.parametrize(
  'source, mesh',
  [('torch_file', (2, 1, 4)), ('by_name', (1, 2, 4))],
  ids=['torch_file-2x1x4', 'by_name-1x2x4'],
)
def test_fused_ticks_match_one_device(source, mesh):
  # torch's file fuses its OVERLAP_F_B cells; the orders built by name are
  # torch's (test_orders_and_cells_are_torchs), so each source runs one
  # layout. A fused tick sends two outputs (its F's and its B's) in one
  # ppermute, split over tensor at 1x2x4 (Megatron's scatter/gather).
  order = (
    {'pipeline.schedule_file': FIXTURE}
    if source == 'torch_file'
    else {'pipeline.schedule': 'dualpipe_v'}
  )
  _check(mesh, **order, **{'pipeline.fuse_overlaps': True})


def test_torchs_file_trains_with_one_devices_losses():
  ref = harness.train_losses(harness.tiny_config(**_BASE, **{'mesh.data': 1}), 3)
  cfg = harness.tiny_config(
    **_BASE,
    **{'mesh.data': 2, 'mesh.pipe': 4, 'pipeline.virtual_stages': 2},
    **{'pipeline.schedule_file': FIXTURE},
  )
  losses = harness.train_losses(cfg, 3)
  assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(ref, losses)), (ref, losses)
  assert losses[-1] < losses[0]  # it learns: not two frozen models agreeing
