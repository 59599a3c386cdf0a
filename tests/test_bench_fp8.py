"""scripts/bench_fp8.py: its smoke run writes a row per recipe and the figure, a
rerun keeps the rows it does not redo, and bad flags are one line and exit 2."""

import json

import harness
import pytest


def _run(*args):
  return harness.run_script('bench_fp8.py', *args)


def _rows(doc: str, name: str) -> dict[str, list[str]]:
  """The table's cells by recipe, for experiment `name`."""
  cells = [[c.strip() for c in line.strip('|').split('|')] for line in doc.splitlines()]
  return {c[2]: c for c in cells if c[0] == name}


def test_a_smoke_run_writes_a_row_per_recipe_and_the_curves(tmp_path):
  out = tmp_path / 'bench_fp8.md'
  done = _run('--smoke', '--experiments=llama_tiny', '--recipes=none,rowwise', f'--out={out}')
  assert done.returncode == 0, done.stderr
  rows = _rows(out.read_text(), 'llama_tiny')
  assert set(rows) == {'none', 'rowwise'}
  assert rows['none'][4:6] == ['reference', '-']
  # FP8 against bf16 from the same seed: a signed percentage and a verdict against 2%.
  assert rows['rowwise'][4].endswith('%') and rows['rowwise'][4][0] in '+-'
  assert rows['rowwise'][5] in ('PASS', 'over')
  # Both ran in this invocation, so the step time's ratio is given.
  assert rows['rowwise'][7].endswith('x')
  assert (tmp_path / 'bench_fp8.png').read_bytes()[:4] == b'\x89PNG'
  runs = json.loads((tmp_path / 'bench_fp8.json').read_text())['runs']['llama_tiny']
  assert [step for step, _ in runs['recipes']['rowwise']['loss']] == [1, 2, 3, 4]


@pytest.mark.fast
def test_a_rerun_keeps_the_rows_it_does_not_redo(tmp_path):
  bench = harness.load_script('bench_fp8')
  run = {'mesh': 'data 8', 'loss': [[1, 5.0]], 'eval': [[4, 4.0]], 'step_time_s': 0.1}
  saved = {
    'llama_tiny': {'steps': 200, 'recipes': {'none': {**run, 'invocation': 'a'}}},
    'mixtral_tiny': {'steps': 200, 'recipes': {'rowwise': {**run, 'invocation': 'a'}}},
  }
  path = tmp_path / 'bench_fp8.json'
  path.write_text(json.dumps({'smoke': False, 'runs': saved}))
  # Rerunning llama_tiny at 200 steps keeps its bf16 row; at 100, it starts over.
  assert bench._load(str(path), {'llama_tiny': 200}, False) == saved
  assert bench._load(str(path), {'llama_tiny': 100}, False) == {
    'mixtral_tiny': saved['mixtral_tiny']
  }
  assert bench._load(str(path), {'llama_tiny': 200}, True) == {}
  # A row of another invocation is compared in loss, not in seconds.
  row = bench._row(
    'llama_tiny',
    'rowwise',
    {**run, 'eval': [[4, 4.1]], 'invocation': 'b'},
    saved['llama_tiny']['recipes']['none'],
  )
  assert row.split('|')[5:9] == [' +2.50% ', ' over ', ' 0.100 ', ' - ']


@pytest.mark.fast
@pytest.mark.parametrize(
  'flag, message',
  [
    (
      '--recipes=none,fp4',
      "error: --recipes: unknown recipe 'fp4'; choose from none, tensorwise, rowwise, delayed",
    ),
    (
      '--experiments=llama_huge',
      'error: --experiments: no experiments/llama_huge.py; name ones that exist, comma-separated',
    ),
    (
      '--fp8_grads=e5m2,e3m4',
      "error: --fp8_grads: unknown format 'e3m4'; choose from e5m2, e4m3",
    ),
    (
      '--steps=1',
      'error: --steps: must be >= 2 (a first step compiles, the rest are timed), got 1',
    ),
  ],
)
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path, flag, message):
  out = tmp_path / 'bench_fp8.md'
  done = _run(flag, f'--out={out}')
  assert (done.returncode, done.stderr.strip()) == (2, message)
  assert not out.exists()


@pytest.mark.fast
def test_report_only_writes_the_stored_runs_and_trains_nothing(tmp_path, monkeypatch):
  """After a run cut short, --report_only draws the page and figure from the .json alone."""
  bench = harness.load_script('bench_fp8')
  run = {'mesh': 'data 8', 'loss': [[1, 5.0], [2, 4.5]], 'eval': [[2, 4.0]], 'step_time_s': 0.1}
  stored = {'none': {**run, 'invocation': 'a'}, 'rowwise': {**run, 'invocation': 'a'}}
  out = tmp_path / 'bench_fp8.md'
  runs = {'llama_tiny': {'steps': 200, 'recipes': stored}}
  (tmp_path / 'bench_fp8.json').write_text(json.dumps({'smoke': False, 'runs': runs}))
  monkeypatch.setattr(bench, '_train', lambda *a: pytest.fail('--report_only trained'))
  bench.main([f'--out={out}', '--report_only'])
  assert set(_rows(out.read_text(), 'llama_tiny')) == {'none', 'rowwise'}
  assert (tmp_path / 'bench_fp8.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.fast
def test_every_recipe_runs_on_the_experiments_own_layout(monkeypatch):
  """delayed too (the pipeline executor carries its histories): llama_tiny's
  pipe 2 stays; only --spread's run changes the layout."""
  bench = harness.load_script('bench_fp8')
  seen = []
  monkeypatch.setattr(bench, 'run_python', lambda argv, **_: seen.append(argv) or _Failed())
  for run in ('delayed', bench.SPREAD):
    with pytest.raises(SystemExit):
      bench._train('llama_tiny', run, 4, True, '/nonexistent')
  assert not any(a.startswith('--config.mesh.') for a in seen[0])
  assert '--config.model.fp8=delayed' in seen[0]
  assert '--config.mesh.pipe=1' in seen[1] and '--config.model.fp8=none' in seen[1]


@pytest.mark.fast
def test_the_spread_is_bf16_on_another_layout_and_no_candidate(tmp_path):
  """--spread's run: llama_tiny's pipe folded into data, mixtral_tiny's experts
  unsplit; its row gives its distance from bf16 and no verdict, the FP8 rows
  keep theirs against 2%."""
  bench = harness.load_script('bench_fp8')
  llama = bench._other_layout(bench._config('llama_tiny', True))
  assert (llama['mesh.data'], llama['mesh.pipe']) == (4, 1)
  assert bench._other_layout(bench._config('mixtral_tiny', True)) == {'mesh.expert': 1}
  one = bench._config('llama_tiny', True)
  for axis in ('data', 'tensor', 'pipe', 'expert'):
    one.mesh[axis] = 1
  assert bench._other_layout(one) == {}
  run = {'mesh': 'data 8', 'loss': [[1, 5.0]], 'step_time_s': 0.1, 'invocation': 'a'}
  recipes = {
    'none': {**run, 'eval': [[1, 4.0]]},
    bench.SPREAD: {**run, 'eval': [[1, 4.1]]},
    'tensorwise': {**run, 'eval': [[1, 4.04]]},
  }
  doc = bench._doc({'llama_tiny': {'steps': 200, 'recipes': recipes}}, str(tmp_path / 'f.png'))
  rows = _rows(doc, 'llama_tiny')
  assert list(rows) == ['none', bench.SPREAD, 'tensorwise']
  assert rows[bench.SPREAD][4:6] == ['+2.50%', '-']
  assert rows['tensorwise'][4:6] == ['+1.00%', 'PASS']


@pytest.mark.fast
def test_a_spread_without_another_layout_is_one_line_and_exit_2(monkeypatch, capsys):
  bench = harness.load_script('bench_fp8')
  monkeypatch.setattr(bench, '_other_layout', lambda c: {})
  with pytest.raises(SystemExit) as e:
    bench._args(['--spread', '--experiments=llama_tiny'])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip() == (
    'error: --spread: llama_tiny runs on one device: there is no other layout to compare'
  )


@pytest.mark.fast
def test_each_fp8_recipe_runs_once_per_gradient_format_and_bf16_once(monkeypatch):
  """--fp8_grads=e5m2,e4m3: each FP8 recipe twice, its e4m3 run its own row
  (model.fp8_grad=e4m3 in its overrides), bf16 once; the rows in ORDER."""
  bench = harness.load_script('bench_fp8')
  args = bench._args(['--recipes=none,rowwise', '--fp8_grads=e5m2,e4m3', '--smoke'])
  assert args.runs == ['none', 'rowwise', 'rowwise, e4m3 grads']
  assert [bench._parse(k) for k in args.runs] == [
    ('none', 'e5m2'),
    ('rowwise', 'e5m2'),
    ('rowwise', 'e4m3'),
  ]
  assert bench._parse(bench.SPREAD) == ('none', 'e5m2')
  assert all(k in bench.ORDER for k in args.runs)
  seen = []
  monkeypatch.setattr(bench, 'run_python', lambda argv, **_: seen.append(argv) or _Failed())
  with pytest.raises(SystemExit, match='rowwise, e4m3 grads failed'):
    bench._train('llama_tiny', 'rowwise, e4m3 grads', 4, True, '/nonexistent')
  assert '--config.model.fp8=rowwise' in seen[0]
  assert '--config.model.fp8_grad=e4m3' in seen[0]


@pytest.mark.fast
def test_fp32_is_bf16s_run_in_float32_and_no_candidate(monkeypatch, tmp_path):
  """--fp32's run: recipe none with model.dtype=float32 on the experiment's
  own layout; its row gives its distance from bf16 and no verdict."""
  bench = harness.load_script('bench_fp8')
  assert bench._args(['--recipes=', '--fp32', '--smoke']).runs == [bench.FP32]
  seen = []
  monkeypatch.setattr(bench, 'run_python', lambda argv, **_: seen.append(argv) or _Failed())
  with pytest.raises(SystemExit):
    bench._train('llama_tiny', bench.FP32, 4, True, '/nonexistent')
  assert '--config.model.dtype=float32' in seen[0] and '--config.model.fp8=none' in seen[0]
  assert not any(a.startswith('--config.mesh.') for a in seen[0])
  run = {'mesh': 'data 8', 'loss': [[1, 5.0]], 'step_time_s': 0.1, 'invocation': 'a'}
  recipes = {'none': {**run, 'eval': [[1, 4.0]]}, bench.FP32: {**run, 'eval': [[1, 3.9]]}}
  doc = bench._doc({'llama_tiny': {'steps': 200, 'recipes': recipes}}, str(tmp_path / 'f.png'))
  assert _rows(doc, 'llama_tiny')[bench.FP32][4:6] == ['-2.50%', '-']


class _Failed:
  returncode, stderr = 1, 'stopped by the test'
