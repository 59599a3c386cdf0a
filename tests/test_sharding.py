"""Parameter shardings follow the logical-axis rules (Megatron tensor parallelism)."""

import harness
import jax
import pytest
from jax.sharding import PartitionSpec as P

# The fast tier (scripts/test.sh --fast): seconds per test, no pipeline program.
pytestmark = pytest.mark.fast

# Pipeline layout: [stage, virtual, layers, ...] with stage -> pipe.
EXPECTED = {
  ('layers', 'wq'): P('pipe', None, None, None, 'tensor', None),  # column-parallel
  ('layers', 'wk'): P('pipe', None, None, None, 'tensor', None),
  ('layers', 'wv'): P('pipe', None, None, None, 'tensor', None),
  ('layers', 'wo'): P('pipe', None, None, 'tensor', None, None),  # row-parallel
  ('layers', 'w1'): P('pipe', None, None, None, 'tensor'),  # column-parallel
  ('layers', 'w2'): P('pipe', None, None, 'tensor', None),  # row-parallel
  ('layers', 'attn_norm'): P('pipe', None, None, None),
  ('embed', 'tokens'): P('tensor', None),  # vocabulary-parallel
  ('embed', 'positions'): P(None, None),
  ('head', 'out'): P(None, 'tensor'),  # vocabulary-parallel
  ('head', 'norm'): P(None),
}


def _strip(spec):
  parts = list(spec)
  while parts and parts[-1] is None:
    parts.pop()
  return tuple(parts)


def test_parameter_and_batch_shardings_follow_the_rules():
  cfg = harness.tiny_config(
    **{'mesh.data': 2, 'mesh.tensor': 2, 'mesh.pipe': 2, 'pipeline.microbatches': 2}
  )
  trainer = harness.make_trainer(cfg)
  with jax.set_mesh(trainer.mesh):
    state = trainer.init_state(jax.random.key(0))
  for (group, name), spec in EXPECTED.items():
    actual = state.params[group][name].sharding.spec
    assert _strip(actual) == _strip(spec), (group, name, actual)
  # Adam's moments are sharded like the parameters they follow.
  mu = state.opt_state[1][0].mu
  assert _strip(mu['layers']['w1'].sharding.spec) == _strip(EXPECTED[('layers', 'w1')])
  assert _strip(trainer.batch_sharding.spec) == ('data',)
