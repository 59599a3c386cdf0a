"""Plans data x context x tensor x pipeline parallelism (and sequence parallelism) for a model on a cluster.

  python -m triax plan --config=experiments/gpt_tiny.py
      --cluster=experiments/clusters/heterog_testbed.yaml
      [--profile=local|analytic] [--gpus=N] [--top=5] [--json] [--verbose]
      [--out=plan.py] [--trace=trace.json] [--profile_cache=FILE]
      [--search=exhaustive|learned] [--policy=FILE.msgpack]
      [--verify=v5p:2x2x1|h100:8 [--verify_slices=N]] [--moe_imbalance=1.0]
      [--evaluate [--layout=d8,t8,p35,v3,m280]]

Profiles the model here (--profile=local) or prices it from its shapes and the spec's data
sheets (--profile=analytic), simulates candidate plans on the cluster (a MoE model's
expert degree too) and prints the best beside baselines; --out writes the best as a plan
file. With --evaluate nothing is searched: one layout is priced (plan/evaluate.py), and
the command exits 3 when it does not fit. Bad input prints one `error: KEY: message` line
and exits with 2. How the search works: docs/design/planner_search.md."""

import os
import sys

from absl import flags
from ml_collections import config_flags

from triax import cli
from triax.plan import report

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Experiment config file (Python, get_config(arg)); FILE[:ARG].', lock_config=True
)
_CLUSTER = flags.DEFINE_string(
  'cluster', None, 'Cluster spec (YAML), e.g. experiments/clusters/heterog_testbed.yaml.'
)
_TOP = flags.DEFINE_integer('top', 5, 'How many plans to show.')
_PROFILE = flags.DEFINE_enum(
  'profile',
  'local',
  ['local', 'analytic'],
  'local: measure the model on this machine; analytic: price it from its shapes and the '
  "cluster spec's data sheets (plan/cost/analytic.py), nothing run here.",
)
_GPUS = flags.DEFINE_integer(
  'gpus', None, "Size the cluster to N devices (whole nodes of the spec's one node type)."
)
_CACHE = flags.DEFINE_string(
  'profile_cache',
  None,
  'JSON file of measured profiles (--profile=local), keyed by model shape, device kind and '
  'count and jax version: a second cluster for the same model reuses the measurement.',
)
_VERBOSE = flags.DEFINE_bool('verbose', False, 'Also print the measurements behind the profile.')
_JSON = flags.DEFINE_bool('json', False, 'Print one JSON object instead of tables.')
_OUT = flags.DEFINE_string(
  'out',
  None,
  'Write the best plan (with --evaluate: the layout priced) as a config file (.py) here, to '
  'train from: '
  'python -m triax train --config=FILE --workdir=DIR.',
)
_TRACE = flags.DEFINE_string(
  'trace',
  None,
  "Write the best (or the evaluated) plan's predicted timeline as a Chrome trace (.json, opens "
  'in Perfetto) here.',
)
_MODEL = flags.DEFINE_enum(
  'model',
  'lockstep',
  ['lockstep', 'async'],
  "Time model that ranks plans: lockstep (triax's executor) or async (the papers').",
)
_DP = flags.DEFINE_enum(
  'dp_allreduce',
  'per_step',
  ['per_microbatch', 'per_step'],
  'Where the data-parallel gradient all-reduce is charged: '
  "per_step (triax's executor) or per_microbatch.",
)
_SEARCH = flags.DEFINE_enum(
  'search',
  'exhaustive',
  ['exhaustive', 'learned'],
  'exhaustive: enumerate and simulate every layout (plan/search/exhaustive.py); learned: a '
  'graph-network policy trained against the simulator on random clusters (plan/learned/).',
)
_POLICY = flags.DEFINE_string(
  'policy',
  None,
  'With --search=learned: the trained policy (.msgpack); trained first (minutes) and written '
  'here when absent. E.g. experiments/policies/gpt_1b_b64.msgpack.',
)
_VERIFY = flags.DEFINE_string(
  'verify',
  None,
  'Compile the best (or the evaluated) plan for this TPU slice (KIND:AxB[xC], e.g. v5p:2x2x1) or these GPUs '
  "(h100:8, a100:4x8; its chip count the cluster's) with XLA:TPU or XLA:GPU here, as train "
  "--compile_only --topology does, and print its train step's peak per device beside the "
  "planner's; exit 3 if it does not fit.",
)
_VERIFY_SLICES = flags.DEFINE_integer(
  'verify_slices', 1, 'With --verify: this many slices joined by the data-centre network.'
)
_EVALUATE = flags.DEFINE_bool(
  'evaluate',
  False,
  "Price one layout instead of searching: the config's own (its mesh, pipeline, train and "
  "model keys) or --layout's. Prints step time, tokens/s, TFLOP/s and MFU per device, bubble, "
  'memory per device by part and whether it fits (exit 3 if not); --out, --trace and '
  '--verify act on it.',
)
_LAYOUT = flags.DEFINE_string(
  'layout',
  None,
  'With --evaluate: the layout to price, in the words the search prints its plans in, comma- '
  'or space-separated: dN eN cN tN pN (mesh degrees), mN or mbN (micro-batches, or sequences '
  'in one), vN, a schedule name, remat=POLICY, sp|nosp, replicated|zero1|fsdp, '
  'allgather|ring, layers=A/B/... (per stage). E.g. d8,t8,p35,interleaved_1f1b,v3,m280. '
  "Keys it does not name keep the config's values.",
)
# Flags only a search reads: refused with --evaluate rather than ignored.
_SEARCH_ONLY = ('top', 'search', 'policy')
_MOE_IMBALANCE = flags.DEFINE_float(
  'moe_imbalance',
  1.0,
  "A MoE model's expert load: the busiest expert's tokens over the mean (metrics' "
  'moe_load_max; 1 = balanced). With the experts split, the busiest one slows every device.',
)


def _verifier():
  """The --verify callable and the slice's chips ((None, None) without the flag);
  a bad name fails before any search."""
  if _VERIFY.value is None:
    if _VERIFY_SLICES.present:
      cli.fail('--verify_slices', 'only --verify reads it; add --verify=KIND:AxB[xC]')
    return None, None
  from triax import topology
  from triax.errors import ConfigError

  try:
    slice_ = topology.parse(_VERIFY.value, _VERIFY_SLICES.value)
  except ConfigError as e:
    cli.fail('--verify' if e.key == '--topology' else '--verify_slices', e.message)

  def verify(cfg, estimate):
    from triax.compiled import aot

    return aot.verify_plan(cfg, estimate, slice_)

  return verify, slice_.chips


def main(argv):
  if _CONFIG.value is None:
    cli.fail('--config', 'is required, e.g. --config=experiments/gpt_tiny.py')
  if _EVALUATE.value:
    for name in _SEARCH_ONLY:
      if flags.FLAGS[name].present:
        cli.fail(f'--{name}', 'only a search reads it, and --evaluate prices one layout; remove it')
  if not _CLUSTER.value:
    cli.fail('--cluster', 'is required, e.g. --cluster=experiments/clusters/h100_8x_nvlink.yaml')
  config_path = config_flags.get_config_filename(flags.FLAGS['config'])
  if not os.path.isfile(config_path.partition(':')[0]):
    cli.fail('--config', f'{config_path}: no such file')
  with cli.config_errors_exit():
    # Profiling this machine as a spec's `profile: local` group needs its
    # device count before JAX starts (forced CPU devices).
    if _PROFILE.value == 'local':
      cli.force_cpu_devices(report.local_devices(_CLUSTER.value))
  try:
    cfg = _CONFIG.value
    cfg.to_dict()  # a config file that failed to load raises on first use
  except Exception as e:  # pylint: disable=broad-except
    cli.fail('--config', f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}')
  verify, verify_chips = _verifier()
  request = report.Request(
    cfg=cfg,
    config_path=config_path,
    config_overrides=config_flags.get_override_values(flags.FLAGS['config']),
    cluster=_CLUSTER.value,
    top=_TOP.value,
    out=_OUT.value,
    trace=_TRACE.value,
    model=_MODEL.value,
    dp_allreduce=_DP.value,
    profile=_PROFILE.value,
    gpus=_GPUS.value,
    profile_cache=_CACHE.value,
    verbose=_VERBOSE.value,
    search=_SEARCH.value,
    policy=_POLICY.value,
    verify=verify,
    verify_chips=verify_chips,
    moe_imbalance=_MOE_IMBALANCE.value,
    evaluate=_EVALUATE.value,
    layout=_LAYOUT.value,
  )
  sys.exit(report.main(request, as_json=_JSON.value))


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
