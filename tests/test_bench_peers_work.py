"""scripts/bench_peers_work.py: bad input is one line and exit 2, the XLA-attention
rows repeat bench_tpu_compile's but for the attention, and the table shows both
frameworks where both were compiled."""

import json

import harness
import pytest


def _run(*args, env=None):
  return harness.run_script('bench_peers_work.py', *args, env=env)


@pytest.mark.fast
def test_an_unknown_row_is_one_line_and_exit_2(tmp_path):
  out = tmp_path / 'work.json'
  done = _run('--rows=pp4_xla_attn,pp9', f'--results={out}')
  assert done.returncode == 2
  assert done.stderr.startswith("error: --rows: unknown row 'pp9'; choose from fsdp4_xla_attn")
  assert len(done.stderr.strip().splitlines()) == 1
  assert not out.exists()


@pytest.mark.fast
def test_a_missing_maxtext_venv_is_one_line_and_exit_2(tmp_path):
  out = tmp_path / 'work.json'
  done = _run('--rows=pp4_xla_attn', f'--results={out}', env={'TRIAX_BENCH_DIR': str(tmp_path)})
  assert done.returncode == 2
  assert done.stderr.startswith(f'error: MaxText venv: no {tmp_path}/maxtext-venv/.installed')
  assert len(done.stderr.strip().splitlines()) == 1
  assert not out.exists()


@pytest.mark.fast
def test_the_xla_attention_rows_are_bench_tpu_compiles_but_for_the_attention():
  work = harness.load_script('bench_peers_work')
  tpu = harness.load_script('bench_tpu_compile')
  rows = work.rows()
  for name, (what, topology, (config, overrides), mt) in tpu.ROWS.items():
    row = rows[f'{name}_xla_attn']
    assert (row.what, row.topology, row.triax[1], row.base) == (what, topology, overrides, name)
    assert row.triax[0] == config.replace('attention=splash', 'attention=xla') != config
    assert row.same_compiler
    if mt is None:
      assert row.maxtext is None
    else:
      assert row.maxtext == {**mt, 'attention': 'dot_product'}


@pytest.mark.fast
def test_the_table_shows_both_sides_of_each_xla_attention_row():
  work = harness.load_script('bench_peers_work')
  with open(work.RESULTS) as f:
    results = json.load(f)
  lines = work.work_table(results)
  both = [k for k, r in results.items() if r.get('attention') == 'xla']
  for name in both:
    (line,) = [x for x in lines if x.startswith(f'| {name} |')]
    if 'maxtext' in results[name]:
      t, m = results[name]['triax'], results[name]['maxtext']
      assert f'{t["flops"] / 1e12:.2f}' in line and f'/ {m["flops"] / 1e12:.2f}' in line
      assert f'{(t["flops"] - m["flops"]) / 1e12:+.2f}' in line
  # Each row is in one table only.
  for name in results:
    assert sum(x.startswith(f'| {name} |') for x in lines) == 1


@pytest.mark.fast
def test_a_busiest_stage_beyond_maxtext_says_where():
  work = harness.load_script('bench_peers_work')
  stage = lambda flops, head, edge: {'flops': flops, 'head_in_loop': head, 'edge_rows': edge}  # noqa: E731
  triax = {
    'flops': 4.5e12,
    'flops_max': 5.8e12,
    'stages': [stage(4e12, 0, 1e12), stage(5.8e12, 2e12, 1e12)],
  }
  row = {'triax': triax, 'maxtext': {'flops': 5.3e12, 'flops_max': 5.3e12}}
  (line,) = [x for x in work._beyond_maxtext({'pp2_xla_attn': row}) if x.startswith('- ')]
  assert line.startswith("- pp2_xla_attn: stage 1 executes +0.50 TFLOP beyond MaxText's device")
  assert 'take 2.00 and its edge rows after the loop 1.00' in line
  row['maxtext']['flops_max'] = 6e12
  assert work._beyond_maxtext({'pp2_xla_attn': row}) == []
