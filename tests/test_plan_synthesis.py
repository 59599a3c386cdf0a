"""The planner choosing a synthesised schedule (plan/search/synthesized.py),
its plan file, and training that file.

The case: four layers on four devices of 1.5 GB whose links are too slow
for data parallelism's gradient all-reduce and for BPipe's moves, so the
pipeline p = 4, m = 8 wins. There each stage's state takes 0.4 GB and each
residual set or cut 0.1 GB: 1F1B (4 sets, 1 cut) fits, ZB-H1 (4 sets, 4
cuts) does not, and the synthesiser fills the gap with 4 sets and 3 cuts,
a step of 28 ticks against 1F1B's 30.
"""

import os

import harness
import pytest
from test_plan_search import small_config
from test_plan_simulator import make_cluster

from triax.pipeline import files
from triax.plan import candidate
from triax.plan.candidate import Options
from triax.plan.cost import profile
from triax.plan.search import emit, exhaustive, synthesized

# The train step's memory alone: evaluating the whole batch at once would
# not fit these made-up devices either.
STEP_ONLY = Options(state_programs=False)
# Devices on which the zero-bubble schedules' cuts do not fit but a
# synthesised schedule's do.
BINDING = '1.56 GB'


def _profile():
  return profile.synthetic(
    layer_fwd=1.0, layer_bwd=2.0, stash_per_seq=1e8, act_per_seq=1e3, layer_param_bytes=1e8
  )


def _search(memory: str):
  cluster = make_cluster(groups=(('gpu', 4, 1.0, memory),), bandwidth=1e8, latency='10 us')
  return exhaustive.search(
    small_config(batch=8), cluster, top_k=3, profile=_profile(), options=STEP_ONLY
  )


@pytest.mark.fast
def test_planner_picks_a_synthesised_schedule_where_memory_binds(monkeypatch):
  # (A cut holds the weight matmuls' inputs and their output cotangents:
  # twice this profile's stash set; memory.chunk_cut.)
  found = _search(BINDING)
  best = found.top[0]
  schedule = candidate.given(best.plan.schedule)
  assert schedule is not None and schedule.name == 'synthesized', best.plan.describe()
  # The layout synthesised first, its bubble-free bound the lowest
  # (synthesized.LAYOUTS): d2 p2 v2 m4 was 0.002% faster, found only when
  # every layout is synthesised.
  p, m, v = best.plan.pipe, best.plan.microbatches, best.plan.virtual_stages
  assert (p, m, v) == (4, 8, 1)
  prog = candidate.program(best.plan.schedule, p, m, v)
  assert not best.oom and prog.slots['stash'] <= schedule.stash_cap
  # ZB-H1's cuts are what does not fit.
  assert prog.slots['cut'] < candidate.program('zb_h1', p, m, v).slots['cut']
  # Without synthesis the same search's best is slower: 1F1B, as no
  # zero-bubble schedule fits.
  monkeypatch.setattr(synthesized, 'candidates', lambda *args: [])
  named = _search(BINDING).top[0]
  assert named.plan.schedule == '1f1b' and named.step_time > best.step_time * 1.03


@pytest.mark.fast
def test_with_memory_to_spare_nothing_is_synthesised(monkeypatch):
  calls = []
  real = synthesized.synthesised.__wrapped__
  monkeypatch.setattr(synthesized, 'synthesised', lambda *args: calls.append(args) or real(*args))
  best = _search('80 GB').top[0]
  assert candidate.given(best.plan.schedule) is None and calls == []


def _write_base(path) -> None:
  """An experiment file of small_config(batch=8) that the trainer runs in seconds."""
  path.write_text(
    'from triax import config\n\n\n'
    'def get_config(arg=None):\n'
    '  c = config.defaults()\n'
    '  c.model.num_layers, c.model.d_model, c.model.num_heads = 4, 32, 4\n'
    '  c.model.d_ff, c.model.seq_len = 64, 16\n'
    '  c.train.global_batch_size = 8\n'
    '  return c\n'
  )


def _load(path):
  return harness.load_file(path, 'triax_test_plan')


def test_plan_file_holds_the_schedule_and_trains_it_as_given_directly(tmp_path):
  best = _search(BINDING).top[0]
  p, m, v = best.plan.pipe, best.plan.microbatches, best.plan.virtual_stages
  schedule = candidate.given(best.plan.schedule)
  base, out = tmp_path / 'base.py', str(tmp_path / 'plan.py')
  _write_base(base)
  emit.write(out, best, str(base), None, {}, 'test')
  beside = str(tmp_path / 'plan.schedule.json')
  os.remove(beside)  # the plan file alone brings it back
  cfg = _load(out).get_config()
  assert cfg.pipeline.schedule_file == beside
  assert files.load(beside, p, m, v) == schedule
  assert (cfg.mesh.pipe, cfg.pipeline.microbatches, cfg.model.remat) == (p, m, best.plan.remat)
  direct = str(tmp_path / 'direct.json')
  files.write_json(schedule, direct)
  cfg_direct = _load(out).get_config()
  cfg_direct.pipeline.schedule_file = direct
  trainer = harness.make_trainer(cfg)
  assert trainer.program.source == schedule  # the trainer runs the planner's orders
  # The planner reads the config back to the same schedule (what --verify prices).
  assert candidate.given(candidate.from_config(trainer.cfg).schedule) == schedule
  from_plan = harness.train_losses(cfg, steps=2)
  assert from_plan == harness.train_losses(cfg_direct, steps=2)
  assert all(0 < x < 10 for x in from_plan)  # finite: not NaN
