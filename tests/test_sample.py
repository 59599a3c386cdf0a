"""`triax sample`: a run trained under data x tensor x pipe, restored on one device, writes text."""

import importlib.util
import os
import shutil

import harness
import jax
import numpy as np
import pytest

from triax import sharding
from triax.model import generation
from triax.training import sampling as sampling_lib
from triax.training import workdir as workdir_lib


def _gpt_tiny_smoke():
  spec = importlib.util.spec_from_file_location(
    'gpt_tiny', os.path.join(harness.ROOT, 'experiments', 'gpt_tiny.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config('smoke')


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A 2-step run of the smoke config (data=2 x tensor=2 x pipe=2, interleaved), in process."""
  from triax.training import loop

  cfg = _gpt_tiny_smoke()
  cfg.train.steps = 2
  cfg.train.record_sample_ids = True  # samples.jsonl too: every name a run can write
  workdir = str(tmp_path_factory.mktemp('sample') / 'run')
  loop.train_and_evaluate(cfg, workdir, progress=False)
  return workdir


def _sample(workdir, *flags):
  return harness.run_cli('triax.cli.sample', f'--workdir={workdir}', *flags)


def test_sample_prints_the_prompt_and_a_seeded_continuation(trained):
  result = _sample(trained, '--prompt=def ', '--max_new_tokens=40', '--seed=3')
  assert result.returncode == 0, result.stderr[-2000:]
  text = result.stdout[:-1]  # print's newline
  assert text.startswith('def ') and len(text) > len('def ')
  assert '[checkpoint step 2 of' in result.stderr
  # The same seed gives the same text here too (8 devices; the CLI had 1); another seed differs.
  sampling = generation.Sampling(max_new_tokens=40, temperature=0.8, seed=3)
  assert sampling_lib.sample(trained, 'def ', sampling)['text'] == text
  other = generation.Sampling(max_new_tokens=40, temperature=0.8, seed=4)
  assert sampling_lib.sample(trained, 'def ', other)['text'] != text


def test_greedy_generation_matches_step_by_step_argmax_through_the_sliding_buffer():
  model = harness.model_of(num_layers=1, d_model=16, num_heads=2, d_ff=32, seq_len=8)
  spec = model.spec
  params = model.init(jax.random.key(1))
  prompt = [100, 101, 32]
  new = generation.generate(
    model, params, prompt, generation.Sampling(max_new_tokens=12, temperature=0.0)
  )
  logits = jax.jit(model.logits)
  tokens = list(prompt)
  for _ in range(12):  # 3 + 12 > seq_len: the last 7 tokens see a full, sliding window
    window = tokens[-spec.seq_len :]
    padded = np.zeros((1, spec.seq_len), np.int32)  # causal: what follows cannot matter
    padded[0, : len(window)] = window
    tokens.append(int(np.argmax(logits(params, padded)[0, len(window) - 1])))
  assert new.tolist() == tokens[len(prompt) :]
  # Sampling among the top 1 is greedy whatever the temperature.
  top1 = generation.generate(
    model, params, prompt, generation.Sampling(max_new_tokens=12, temperature=2.0, top_k=1)
  )
  assert top1.tolist() == new.tolist()


def test_workdir_without_checkpoints_exits_2_naming_workdir(trained, tmp_path):
  workdir = tmp_path / 'fresh'
  workdir.mkdir()
  shutil.copy(os.path.join(trained, 'config.json'), workdir)
  for directory in (workdir, tmp_path / 'missing'):
    result = _sample(directory, '--prompt=def ')
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith('error: --workdir:'), line


def test_a_runs_workdir_holds_only_names_that_workdir_py_owns(trained):
  """A new file or folder in a workdir fails here until training/workdir.py names it."""
  names = set(os.listdir(trained))
  assert names <= set(workdir_lib.NAMES), sorted(names - set(workdir_lib.NAMES))
  wrote = {workdir_lib.CONFIG, workdir_lib.METRICS, workdir_lib.SAMPLES, workdir_lib.CHECKPOINTS}
  assert wrote <= names, sorted(wrote - names)
  checkpoints = workdir_lib.path(trained, workdir_lib.CHECKPOINTS)
  for step in os.listdir(checkpoints):
    assert step.isdigit() and os.path.isfile(os.path.join(checkpoints, step, workdir_lib.MANIFEST))


def test_a_flipped_byte_in_the_params_stops_sample_with_one_line(trained, tmp_path):
  """Sample reads a checkpoint as a resume does, checksums first."""
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  _, params = workdir_lib.restore_params(workdir, workdir_lib.load_config(workdir))
  shard = harness.flip_a_params_byte(workdir, 2, params)
  before = harness.file_bytes(workdir)
  result = _sample(workdir, '--prompt=def ')
  assert result.returncode == 2 and result.stdout == ''
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith(f'error: --workdir: checkpoint 2 is damaged: {shard} '), line
  assert 'does not match its checksum' in line
  assert harness.file_bytes(workdir) == before  # nothing moved, mended or deleted


def test_prompt_longer_than_the_context_exits_2_naming_prompt(trained):
  result = _sample(trained, '--prompt=' + 'x' * 33)  # the smoke model's seq_len is 32
  assert result.returncode == 2
  (line,) = result.stderr.strip().splitlines()
  assert line.startswith('error: --prompt:') and 'model.seq_len=32' in line


def test_greedy_sampling_on_a_mesh_matches_one_device_and_splits_the_weights(trained):
  cfg = workdir_lib.load_config(trained)
  model = generation.sampling_model(cfg)
  sampling = generation.Sampling(max_new_tokens=16, temperature=0.0)
  prompt = generation.encode_prompt('def ', cfg.model.seq_len, workdir_lib.tokenizer(trained, cfg))
  outputs, weights = {}, {}
  for shape in (None, (2, 2, 2), (1, 1, 4)):
    placement = generation.Placement.build(cfg, shape)
    _, params = workdir_lib.restore_params(trained, cfg, placement.shardings(model))
    outputs[shape] = generation.generate(model, params, prompt, sampling, placement).tolist()
    # Per device, the weights the sampling program takes fall with the mesh.
    weights[shape] = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(params))
  assert outputs[(2, 2, 2)] == outputs[None] and outputs[(1, 1, 4)] == outputs[None]
  assert weights[(2, 2, 2)] < weights[None] / 3 and weights[(1, 1, 4)] < weights[None] / 3
  result = _sample(
    trained, '--prompt=def ', '--temperature=0', '--max_new_tokens=16', '--mesh=1,2,2'
  )
  assert result.returncode == 0, result.stderr[-2000:]
  text = workdir_lib.tokenizer(trained, cfg).decode(prompt + outputs[None])
  assert result.stdout[:-1] == text


def test_prefill_split_over_context_ranks_gives_one_devices_tokens(trained):
  """--mesh=DATA,CONTEXT,TENSOR,PIPE: the prompt's prefill split over context
  ranks (a 5-token prompt left-padded to a multiple of the ranks), decode
  steps whole; the greedy tokens of one device. Only the prefill's split puts
  collectives in the program (the weights are not split over context)."""
  cfg = workdir_lib.load_config(trained)
  model = generation.sampling_model(cfg)
  sampling = generation.Sampling(max_new_tokens=12, temperature=0.0)
  tok = workdir_lib.tokenizer(trained, cfg)
  outputs = {}
  for text in ('def ', 'def f'):
    prompt = generation.encode_prompt(text, cfg.model.seq_len, tok)
    for shape in (None, (1, 2, 1, 1), (1, 4, 2, 1)):
      placement = generation.Placement.build(cfg, shape)
      _, params = workdir_lib.restore_params(trained, cfg, placement.shardings(model))
      outputs[text, shape] = generation.generate(model, params, prompt, sampling, placement)
    assert outputs[text, (1, 2, 1, 1)].tolist() == outputs[text, None].tolist()
    assert outputs[text, (1, 4, 2, 1)].tolist() == outputs[text, None].tolist()

  placement = generation.Placement.build(cfg, (1, 2, 1, 1))
  _, params = workdir_lib.restore_params(trained, cfg, placement.shardings(model))
  args = (params, np.zeros((1, 4), np.int32), np.zeros((1,), np.int32), jax.random.key(0))

  def collectives(prefill_rules):
    run = generation.sampler(model, sampling, 4, prefill_rules=prefill_rules)
    with jax.set_mesh(placement.mesh), sharding.axis_rules(placement.rules):
      hlo = run.lower(*args).compile().as_text()
    return sum(hlo.count(f'{op}(') for op in ('all-gather', 'all-reduce', 'collective-permute'))

  assert collectives(placement.prefill_rules) > 0 == collectives(placement.rules)
  result = _sample(
    trained, '--prompt=def f', '--temperature=0', '--max_new_tokens=12', '--mesh=1,2,1,1'
  )
  assert result.returncode == 0, result.stderr[-2000:]
  prompt = generation.encode_prompt('def f', cfg.model.seq_len, tok)
  assert result.stdout[:-1] == tok.decode(prompt + outputs['def f', None].tolist())


def test_a_context_mesh_that_cannot_hold_the_prompt_is_one_line(trained):
  from triax.errors import ConfigError

  cfg = workdir_lib.load_config(trained)
  with pytest.raises(ConfigError, match='does not divide by context=3') as e:
    generation.Placement.build(cfg, (1, 3, 1, 1))
  assert e.value.key == '--mesh'
  placement = generation.Placement.build(cfg, (1, 2, 1, 1))
  model = generation.sampling_model(cfg)
  too_many = generation.Sampling(max_new_tokens=cfg.model.seq_len, temperature=0.0)
  with pytest.raises(ConfigError, match='padded to 6 tokens') as e:
    generation.generate(model, None, [1, 2, 3, 4, 5], too_many, placement)
  assert e.value.key == '--max_new_tokens'
  result = _sample(trained, '--prompt=def ', '--mesh=1,2')
  assert result.returncode == 2 and result.stderr.startswith('error: --mesh: give DATA,TENSOR,PIPE')


@pytest.mark.parametrize('family', ['gpt', 'llama'])
def test_kv_cache_decoding_gives_the_cache_less_tokens(family):
  fields = dict(family=family, num_layers=2, d_model=32, num_heads=4, d_ff=64, seq_len=16)
  if family == 'llama':
    fields['num_kv_heads'] = 2  # grouped-query attention: the cache holds 2 heads, not 4
  model = harness.model_of(**fields)
  params = model.init(jax.random.key(2))
  k, v = model.init_cache(3)
  assert k.shape == v.shape == (2, 3, 16, model.spec.kv_heads, 8)
  greedy = generation.Sampling(max_new_tokens=20, temperature=0.0)
  prompts = [[7, 8, 9, 10, 11], [200], [65, 66, 67]]
  # 5 + 20 > 16: the last tokens come through the sliding window, as without a cache.
  plain = {}
  for prompt in prompts:
    cached = generation.generate(model, params, prompt, greedy)
    plain[len(prompt)] = generation.generate(model, params, prompt, greedy, cache=False).tolist()
    assert cached.tolist() == plain[len(prompt)]
  # A batch of prompts of different lengths (left-padded) gives each prompt's own tokens:
  # greedy, the first 10 of its 20 cache-less ones (a token depends on those before it only).
  short = generation.Sampling(max_new_tokens=10, temperature=0.0)
  batch = generation.generate(model, params, prompts, short)
  for row, prompt in zip(batch, prompts):
    assert row.tolist() == plain[len(prompt)][:10]
  with pytest.raises(generation.ConfigError, match='max_new_tokens'):
    generation.generate(model, params, prompts, greedy)  # a batch past the context
