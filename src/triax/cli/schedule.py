r"""Show, time and plot a pipeline schedule without any devices.

  python -m triax schedule --schedule=interleaved_1f1b --stages=4 \
      --microbatches=8 --virtual_stages=2 [--json] [--plot=grid.png] \
      [--write_csv=order.csv] \
      [--t_forward=1 --t_backward=2 --t_transfer=0 --t_weight=1 --t_evict=0] \
      [--t_exchange=0] [--fuse_overlaps] [--full_remat]
  python -m triax schedule --schedule_file=order.csv [--stages=4 ...] [--json]
  python -m triax schedule --synthesize --stages=4 --microbatches=8 \
      [--virtual_stages=2] --memory_limit=4 [--time_limit_s=10] \
      [--t_forward=1 --t_backward=1 --t_weight=1 --t_transfer=0] \
      [--write_json=synth.json] [--write_csv=synth.csv] [--json] [--plot=x.png]
  python -m triax schedule --synthesize --stages=4 --microbatches=8 \
      --memory_limit_mib=512 --config=experiments/gpt_tiny.py [--config.mesh.data=2]

--schedule_file reads torch's CSV or triax's JSON (triax.pipeline.files); sizes given must
match the file's. --synthesize finds the least-makespan split-backward schedule whose
stages hold at most --memory_limit residual sets (triax.pipeline.synthesis); with
--memory_limit_mib the limit is priced from --config's model (plan/search/synthesized.py's
sets_within; the conversion is printed on stderr). Bad input prints one
`error: <flag>: <message>` line and exits with 2. More: docs/design/schedules.md."""

import inspect
import sys

from absl import flags
from ml_collections import config_flags

from triax import cli
from triax.pipeline import report
from triax.pipeline.schedule import SCHEDULES

_SCHEDULE = flags.DEFINE_string('schedule', '1f1b', f'Schedule: one of {", ".join(SCHEDULES)}.')
_STAGES = flags.DEFINE_integer('stages', 4, 'Pipeline stages p.')
_MICROBATCHES = flags.DEFINE_integer('microbatches', 8, 'Micro-batches m.')
_VIRTUAL_STAGES = flags.DEFINE_integer(
  'virtual_stages',
  1,
  "Model chunks per stage v (interleaved schedules); unset, the schedule's own: 2 for zb_v's V.",
)
_T_FORWARD = flags.DEFINE_float(
  't_forward', 1.0, 'Forward time of one micro-batch through one stage.'
)
_T_BACKWARD = flags.DEFINE_float(
  't_backward',
  None,
  'Backward time of one micro-batch through one stage (input gradient '
  'only for zero-bubble schedules); default 2 for a fused backward, 1 for a split one.',
)
_T_TRANSFER = flags.DEFINE_float('t_transfer', 0.0, 'Time to send one activation or gradient.')
_T_WEIGHT = flags.DEFINE_float(
  't_weight',
  None,
  'Weight-gradient (W) time of one micro-batch through one '
  'stage: zero-bubble schedules (default 1), or the part of a fused backward the '
  "lowering's W takes (default half of it).",
)
_T_EVICT = flags.DEFINE_float(
  't_evict', 0.0, 'Time to move one residual set to or from the partner stage (bpipe).'
)
_T_EXCHANGE = flags.DEFINE_float(
  't_exchange',
  0.0,
  "Expert parallelism's all-to-all time in one micro-batch's forward through one stage, and "
  'again in its backward.',
)
_FUSE_OVERLAPS = flags.DEFINE_bool(
  'fuse_overlaps',
  False,
  "Run each overlapped pair (dualpipe_v's) in one tick, its all-to-alls beside the other's "
  'compute (pipeline.fuse_overlaps).',
)
_FULL_REMAT = flags.DEFINE_bool(
  'full_remat',
  False,
  'Lower for a model whose backward reruns its forward (model.remat=full): B costs two '
  "forwards, so the lockstep program packs ticks into rounds (pipeline.tick_packing's auto); "
  'the default costs become B 2, W 1.',
)
_SCHEDULE_FILE = flags.DEFINE_string(
  'schedule_file',
  None,
  "Analyse this schedule file instead of --schedule: torch's compute-only .csv or triax's .json.",
)
_SYNTHESIZE = flags.DEFINE_bool(
  'synthesize', False, 'Synthesise the schedule under --memory_limit instead of --schedule.'
)
_MEMORY_LIMIT = flags.DEFINE_integer(
  'memory_limit',
  None,
  'With --synthesize: the most residual sets (micro-batch-chunks) a stage holds.',
)
_MEMORY_LIMIT_MIB = flags.DEFINE_float(
  'memory_limit_mib',
  None,
  'With --synthesize and --config: the MiB of residual sets a stage may hold, instead of '
  '--memory_limit.',
)
_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  'With --memory_limit_mib: the experiment config (FILE[:ARG]) whose model sizes one set.',
  lock_config=True,
)
_TIME_LIMIT_S = flags.DEFINE_float(
  'time_limit_s', 10.0, "With --synthesize: the solver's time limit in seconds."
)
_WRITE_JSON = flags.DEFINE_string('write_json', None, "Write the schedule here as triax's JSON.")
_JSON = flags.DEFINE_bool('json', False, 'Print one JSON object.')
_PLOT = flags.DEFINE_string('plot', None, 'Write a Gantt chart PNG here.')
_WRITE_CSV = flags.DEFINE_string(
  'write_csv', None, "Write the schedule here as torch's compute-only CSV."
)


def main(argv: list[str]) -> int:
  from_file = bool(_SCHEDULE_FILE.value)
  if from_file and _SCHEDULE.present:
    cli.fail('--schedule_file', 'give --schedule or --schedule_file, not both')
  _check_synthesis_flags(from_file)

  def size(holder):
    # A file brings its own sizes; the flags then only check them if given.
    return holder.value if holder.present or not from_file else None

  return report.main(
    report.Request(
      schedule=_SCHEDULE.value,
      stages=size(_STAGES),
      microbatches=size(_MICROBATCHES),
      virtual_stages=size(_VIRTUAL_STAGES)
      if from_file or _SYNTHESIZE.value
      else _own_virtual_stages(),
      t_forward=_T_FORWARD.value,
      t_backward=_T_BACKWARD.value,
      t_transfer=_T_TRANSFER.value,
      t_weight=_T_WEIGHT.value,
      t_evict=_T_EVICT.value,
      plot=_PLOT.value,
      schedule_file=_SCHEDULE_FILE.value,
      write_csv=_WRITE_CSV.value,
      memory_limit=_memory_limit() if _SYNTHESIZE.value else None,
      time_limit_s=_TIME_LIMIT_S.value,
      write_json=_WRITE_JSON.value,
      t_exchange=_T_EXCHANGE.value,
      fuse_overlaps=_FUSE_OVERLAPS.value,
      full_remat=_FULL_REMAT.value,
    ),
    as_json=_JSON.value,
  )


def _check_synthesis_flags(from_file: bool) -> None:
  """--synthesize needs one of --memory_limit and --memory_limit_mib (that
  one with --config) and excludes a named or filed schedule."""
  if not _SYNTHESIZE.value:
    for holder in (_MEMORY_LIMIT, _MEMORY_LIMIT_MIB, _TIME_LIMIT_S):
      if holder.present:
        cli.fail(f'--{holder.name}', 'only --synthesize reads it; add --synthesize')
    return
  if _SCHEDULE.present or from_file:
    cli.fail('--synthesize', 'give --synthesize or --schedule / --schedule_file, not both')
  if _MEMORY_LIMIT.value is not None and _MEMORY_LIMIT_MIB.value is not None:
    cli.fail('--memory_limit_mib', 'give --memory_limit (sets) or --memory_limit_mib, not both')
  if _MEMORY_LIMIT.value is None and _MEMORY_LIMIT_MIB.value is None:
    cli.fail(
      '--memory_limit',
      'give the most residual sets a stage may hold, e.g. --memory_limit=4 '
      '(or --memory_limit_mib=MiB with --config)',
    )
  given = flags.FLAGS['config'].present
  if _MEMORY_LIMIT_MIB.value is None and given:
    cli.fail('--config', 'only --memory_limit_mib reads it; drop it or give the limit in MiB')
  if _MEMORY_LIMIT_MIB.value is not None and not given:
    cli.fail('--config', 'give the experiment config whose model sizes one residual set')


def _memory_limit() -> int:
  """--memory_limit, or the sets --memory_limit_mib holds (said on stderr)."""
  if _MEMORY_LIMIT_MIB.value is None:
    return _MEMORY_LIMIT.value
  mib = _MEMORY_LIMIT_MIB.value
  if not mib > 0 or mib == float('inf'):
    cli.fail('--memory_limit_mib', f'must be a finite number of MiB > 0; got {mib}')
  try:
    cfg = _CONFIG.value
    cfg.to_dict()  # a config file that failed to load raises on first use
  except Exception as e:  # pylint: disable=broad-except
    cli.fail('--config', f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}')
  from triax.plan.search import synthesized

  v = _VIRTUAL_STAGES.value
  with cli.config_errors_exit():
    sets, per_set = synthesized.sets_within(cfg, _STAGES.value, _MICROBATCHES.value, v, mib * 2**20)
  least = v  # a stage holds every chunk's set of one micro-batch at once
  if sets < least:
    cli.fail(
      '--memory_limit_mib',
      f'{mib:g} MiB holds {sets} residual set(s) of {per_set / 2**20:.3g} MiB (one '
      f'micro-batch of one chunk); the least any schedule needs is {least}: give at least '
      f'{least * per_set / 2**20:.4g} MiB',
    )
  print(
    f'memory_limit_mib: {mib:g} MiB holds {sets} residual sets of {per_set / 2**20:.3g} MiB '
    '(one micro-batch of one chunk, plan/cost/memory.chunk_stash): --memory_limit='
    f'{sets}',
    file=sys.stderr,
  )
  return sets


def _own_virtual_stages() -> int:
  """--virtual_stages, or when unset the v the schedule's builder defaults to.

  zb_v runs only as a V of 2 chunks, so the flag's default of 1 would make
  every `--schedule=zb_v` an error; a value given is passed on as it is.
  """
  builder = SCHEDULES.get(_SCHEDULE.value)
  if _VIRTUAL_STAGES.present or builder is None:
    return _VIRTUAL_STAGES.value
  return inspect.signature(builder).parameters['virtual_stages'].default


def run():
  cli.run(main)


if __name__ == '__main__':
  run()
