"""triax.layout: a config's parallel layout read, written back as its keys and
as --config flags the CLI's parser reads back exactly; no JAX imported."""

import dataclasses
import os
import subprocess
import sys

import harness
import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from triax import config
from triax import layout as layout_lib
from triax.layout import Layout

pytestmark = pytest.mark.fast

SRC = os.path.join(harness.ROOT, 'src')

# Layouts of 8 devices the config validator accepts for the experiments' smoke configs.
CASES = [
  ('gpt_tiny.py', Layout(data=2, tensor=2, pipe=2, microbatches=4)),
  (
    'gpt_tiny.py',
    Layout(data=2, tensor=2, pipe=2, schedule='interleaved_1f1b', microbatches=4, virtual_stages=2),
  ),
  ('gpt_tiny.py', Layout(tensor=4, pipe=2, schedule='zb_v', microbatches=2, virtual_stages=2)),
  ('gpt_tiny.py', Layout(tensor=2, pipe=4, sequence_parallel=True)),
  ('gpt_tiny.py', Layout(data=2, context=2, tensor=2, context_attention='ring')),
  ('mixtral_tiny.py', Layout(data=2, tensor=4, expert=2)),
  ('mixtral_tiny.py', Layout(data=8, expert=4)),
]


def _smoke(experiment):
  return config.from_file(os.path.join(harness.ROOT, 'experiments', experiment), 'smoke')


def _apply(cfg, values):
  for key, value in values.items():
    config.set_dotted(cfg, key, value)
  return cfg


@pytest.mark.parametrize('experiment, layout', CASES)
def test_config_to_layout_to_keys_to_config_is_the_same_layout(experiment, layout):
  cfg = config.validate(_apply(_smoke(experiment), layout.overrides()), 8)
  read = Layout.from_config(cfg)
  assert read == layout
  again = config.validate(_apply(_smoke(experiment), read.overrides()), 8)
  assert Layout.from_config(again) == read


def test_overrides_over_a_base_state_the_sizes_and_what_changes():
  cfg = config.validate(_smoke('gpt_tiny.py'), 8)
  own = Layout.from_config(cfg)
  sizes = {
    'mesh.data': own.data,
    'mesh.context': 1,
    'mesh.tensor': own.tensor,
    'mesh.pipe': own.pipe,
    'pipeline.microbatches': own.microbatches,
  }
  assert own.overrides(cfg) == sizes
  moved = dataclasses.replace(own, schedule='zb_h1', virtual_stages=1, sequence_parallel=True)
  assert moved.overrides(cfg) == {
    **sizes,
    'pipeline.schedule': 'zb_h1',
    'pipeline.virtual_stages': 1,
    'mesh.sequence_parallel': True,
  }


@pytest.mark.parametrize(
  'fields, says',
  [
    ({'context': 0}, 'context must be >= 1'),
    ({'context': 2, 'context_attention': 'ulysses'}, 'context_attention one of'),
    ({'sequence_parallel': True}, 'splits over tensor'),
    ({'data': 6, 'expert': 4}, 'must divide data=6'),
  ],
)
def test_a_layout_checks_itself(fields, says):
  with pytest.raises(ValueError, match=says):
    Layout(**fields)


# Each kind of value a --config flag carries: (the key's default, the value given).
KINDS = {
  'an_int': (1, -3),
  'a_float': (0.5, 1e-05),
  'a_whole_float': (0.5, 3.0),
  'a_bool': (False, True),
  'a_string': ('allgather', 'ring all'),
  'a_tuple': ((0,), (4, 5, 6)),
  'one': ((0,), (7,)),
  'empty': ((0,), ()),
  'strings': (('a',), ('a', 'b c')),
  'nested': (((1, 2),), ((1,), (2, 3))),
}


def test_flags_read_back_as_the_values_they_were_written_from():
  values = {key: given for key, (_, given) in KINDS.items()}
  argv = ['triax', *layout_lib.flags(values)]
  parsed = flags.FlagValues()
  defaults = ml_collections.ConfigDict({key: default for key, (default, _) in KINDS.items()})
  config_flags.DEFINE_config_dict('config', defaults, flag_values=parsed, sys_argv=argv)
  parsed(argv)
  assert parsed.config.to_dict() == values
  assert layout_lib.flags({'mesh.device_order': (1,), 'train.lr': 0.1}) == [
    '--config.mesh.device_order=(1,)',
    '--config.train.lr=0.1',
  ]
  with pytest.raises(TypeError, match='NoneType'):
    layout_lib.flag_value(None)


def test_layout_imports_no_jax():
  code = 'import sys, triax.layout; print(sorted(m for m in ("jax", "numpy") if m in sys.modules))'
  env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get('PYTHONPATH', ''))
  out = subprocess.run(
    [sys.executable, '-c', code], env=env, check=True, capture_output=True, text=True
  ).stdout
  assert out.strip() == '[]'
