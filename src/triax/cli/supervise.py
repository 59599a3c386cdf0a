"""Runs a train command as N processes and restarts it, re-planned, on the devices
left when one fails: `python -m triax supervise [--processes=2] -- python -m triax train
--config=FILE --workdir=DIR [--config.x=...]`.

Each restart resumes DIR's newest checkpoint on a layout for the devices
left (the same tensor x pipe with a smaller data degree and more
micro-batches where that divides, else the planner's choice), with the
global batch and the order of the tokens unchanged; it is one log line and
one record in DIR/elastic.jsonl. Kept to flag parsing and one library call
(triax.elastic.supervisor).
"""

import os
import sys

from absl import flags

from triax import cli

_PROCESSES = flags.DEFINE_integer(
  'processes', 2, 'Processes to start (loopback, one jax.distributed job); at least 2.'
)
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', None, 'CPU devices per process (default: 8 / --processes, as launch_local.sh).'
)
_MAX_RESTARTS = flags.DEFINE_integer('max_restarts', 3, 'Restarts before giving up.')
_GRACE_S = flags.DEFINE_float(
  'grace_s', 10.0, 'Seconds the other processes get to exit after SIGTERM before SIGKILL.'
)
_HEARTBEAT_S = flags.DEFINE_float(
  'heartbeat_s',
  600.0,
  'After every process has finished a step: when none finishes another for this long (a hung '
  'device or link stalls all of them in a collective), stop the job and start it again on the '
  'same layout from its checkpoint. Longer than the slowest evaluation or save; 0: off.',
)
_CLUSTER = flags.DEFINE_string(
  'cluster',
  None,
  'Cluster spec (YAML) the re-planning prices layouts on (analytic profile) when the same '
  'tensor x pipe does not fit; without it, the valid layout nearest the old one.',
)
_SEARCH_S = flags.DEFINE_float('search_s', 30.0, 'Seconds the re-planning search may take.')
_LAUNCHER = flags.DEFINE_enum(
  'launcher',
  'local',
  ['local', 'srun'],
  'local: processes on this machine over loopback. srun: inside a SLURM allocation (sbatch, '
  'salloc), each attempt one srun step of --processes tasks; the devices left are those of '
  'the nodes SLURM still reports up.',
)


def main(argv):
  from triax.elastic import supervisor
  from triax.errors import ConfigError

  processes = _PROCESSES.value
  if processes < 2:
    cli.fail(
      '--processes',
      f'{processes} process leaves no devices to re-plan onto when it fails; use 2 or more '
      '(python -m triax train runs one process)',
    )
  per = _CPU_DEVICES.value
  if per is None:
    if 8 % processes:
      cli.fail('--cpu_devices', f'8 CPU devices do not split over {processes} processes; give it')
    per = 8 // processes
  if per < 1:
    cli.fail('--cpu_devices', f'must be >= 1, got {per}')
  if _MAX_RESTARTS.value < 0:
    cli.fail('--max_restarts', f'must be >= 0, got {_MAX_RESTARTS.value}')
  for name, value in (
    ('--grace_s', _GRACE_S.value),
    ('--search_s', _SEARCH_S.value),
    ('--heartbeat_s', _HEARTBEAT_S.value),
  ):
    if value < 0:
      cli.fail(name, f'must be >= 0, got {value}')
  if _LAUNCHER.value == 'srun' and 'SLURM_JOB_NODELIST' not in os.environ:
    cli.fail(
      '--launcher',
      'srun runs inside a SLURM allocation (no SLURM_JOB_NODELIST here): start supervise '
      'from an sbatch script or salloc',
    )
  with cli.config_errors_exit():
    command = supervisor.parse_command(argv[1:])
    cluster = None
    if _CLUSTER.value:
      from triax.plan import cluster as cluster_lib
      from triax.plan.cost import analytic

      cluster = cluster_lib.load(_CLUSTER.value)
      try:
        analytic.check_cluster(cluster)
      except ConfigError as e:
        # The re-planning prices with the analytic profile (a failing machine cannot be measured).
        detail = e.message.split('; use ')[0]
        raise ConfigError('--cluster', f'{detail}; give a spec with data-sheet figures') from None
  options = supervisor.Options(
    processes,
    per,
    max_restarts=_MAX_RESTARTS.value,
    grace_s=_GRACE_S.value,
    heartbeat_s=_HEARTBEAT_S.value,
    cluster=cluster,
    search_s=_SEARCH_S.value,
    launcher=_LAUNCHER.value,
  )
  sys.exit(supervisor.supervise(command, options))


def run():
  if '--' not in sys.argv and not cli.asks_for_help(sys.argv):
    cli.fail('command', 'give the train command after --, e.g. -- python -m triax train ...')
  cli.run(main, takes_arguments=True)


if __name__ == '__main__':
  run()
