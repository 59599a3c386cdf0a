"""Forces 8 CPU devices once, before JAX starts (never per test); shared fixtures.

A test that needs another device count runs a subprocess (see
tests/harness.py: run_cli).
"""

import importlib.metadata
import os
import shutil
import sys
import tempfile

import pytest

# LLVM's optimisation of the machine code XLA:CPU emits is about 30% of a
# pipelined test's compile, and nothing a test asserts depends on it: it runs
# after XLA's own passes, so HLO text, buffer assignment (memory_analysis)
# and cost_analysis are the same bytes at -O0 (checked on pipelined and TP
# steps, and on an XLA:TPU topology compile, whose bytes are the same too).
# Parity compares programs built alike. Subprocesses get these flags too
# (harness.subprocess_env).
TEST_XLA_FLAGS = '--xla_backend_optimization_level=0'
# XLA:CPU's loop-fusion emitters (MLIR, jaxlib 0.10's default) take half
# of a step's compile; its earlier emitters build the programs in half the
# time, and one LLVM module rather than a split one saves a tenth more. The
# earlier emitters fuse a little differently, so XLA:CPU's temporaries move
# by a few percent (zb_v's step: 1,026,152 -> 960,168 bytes): no test pins
# XLA:CPU's bytes, only bounds and ratios between programs compiled alike,
# and parity compares programs built alike. jaxlib 0.12 has no such switch
# (an unknown XLA flag aborts the process) and gains nothing from the split.
if importlib.metadata.version('jaxlib').startswith('0.10.'):
  TEST_XLA_FLAGS += ' --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1'
os.environ['TRIAX_TEST_XLA_FLAGS'] = TEST_XLA_FLAGS
os.environ['XLA_FLAGS'] = (
  f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'src'))


# One persistent XLA compilation cache per test run, shared by its workers
# (pytest-xdist starts them with the environment the first process set here).
# Set it to a folder to keep the cache between runs; 'off' compiles everything.
CACHE_VAR = 'TRIAX_TEST_COMPILE_CACHE'
_OWNED = []


def pytest_configure(config):
  """Points this process's JAX at the run's compilation cache.

  Tests build the same programs again and again (each layout against its
  one-device reference, a trainer per parameter): XLA keys the cache by the
  optimised-for program and its options, so a program compiled once loads
  from disk in every later test, in either worker. A cached executable is
  the one XLA would compile again (memory_analysis, cost_analysis and HLO
  text included): results are unchanged. Set before JAX compiles anything
  (JAX decides once per process whether it uses a cache); subprocesses get
  it only through the `compile_cache` fixture.
  """
  if hasattr(config.option, 'loadscopereorder'):
    config.option.loadscopereorder = False  # files in collection order: see _by_seconds
  if not os.environ.get(CACHE_VAR):
    os.environ[CACHE_VAR] = tempfile.mkdtemp(prefix='triax-test-jax-cache-')
    _OWNED.append(os.environ[CACHE_VAR])  # removed when this run ends
  if os.environ[CACHE_VAR] == 'off':
    return
  import jax

  jax.config.update('jax_compilation_cache_dir', os.environ[CACHE_VAR])
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def pytest_unconfigure(config):
  del config
  for path in _OWNED:
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope='session')
def compile_cache(tmp_path_factory):
  """Environment for subprocesses: the run's persistent XLA compilation cache.

  The same configuration is started many times (crash, resume, compare);
  compiling once saves most of each start-up. Cached executables are the
  ones XLA would compile again, so results are unchanged. With the cache
  'off' for in-process tests, these subprocesses still share one.
  """
  path = os.environ[CACHE_VAR]
  if path == 'off':
    base = tmp_path_factory.getbasetemp()
    path = base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base
    path = str(path / 'jax-compilation-cache')
    os.makedirs(path, exist_ok=True)
  return {
    'JAX_COMPILATION_CACHE_DIR': path,
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
  }


@pytest.fixture(scope='session')
def smoke_text_run(tmp_path_factory, compile_cache):
  """gpt_tiny's smoke config for 24 steps over a small text, never interrupted
  (harness.smoke_text_flags, every checkpoint kept): the run that the crash,
  resume, elastic and multi-process tests must reproduce. Read it, never write
  into it (copy it first).

  One run per test session: the first worker that asks runs it under a lock
  in the folder the workers share, the others find it there. Returns its
  corpus, flags (without the `keep`), workdir, the compile-cache environment
  and the number of windows in an epoch.
  """
  import fcntl

  import harness

  from triax.data.batches import BatchStream
  from triax.data.corpus import load_corpus

  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent  # every worker's basetemp sits in it
  root = shared / 'smoke-text-run'
  with open(shared / 'smoke-text-run.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not (root / 'finished').exists():
      shutil.rmtree(root, ignore_errors=True)
      root.mkdir()
      corpus = harness.write_corpus(root / 'corpus.txt')
      workdir = str(root / 'run')
      flags = harness.smoke_text_flags(corpus) + ['--config.checkpoint.keep=10']
      proc = harness.start_train(workdir, flags, workdir, compile_cache)
      assert proc.wait(timeout=600) == 0, open(workdir + '.err').read()[-3000:]
      (root / 'finished').write_text('')
  corpus = str(root / 'corpus.txt')
  return dict(
    corpus=corpus,
    flags=harness.smoke_text_flags(corpus),
    workdir=str(root / 'run'),
    env=compile_cache,
    windows=BatchStream(load_corpus('text', corpus).train, 32, 8, seed=0).num_windows,
  )


# The two workers take whole files (`--dist loadfile`); xdist hands them out
# in the order it is given, by default the files with the most tests first,
# which put the few-but-long files (multi-process runs, the profiler) last
# and left one worker idle while the other finished them. Files are ordered
# by their last measured seconds instead, longest first (a file not listed
# counts DEFAULT_SECONDS). TRIAX_TEST_SECONDS=write rewrites the list from
# this run. The order only decides which worker runs what, never a result.
SECONDS_FILE = os.path.join(os.path.dirname(__file__), 'file_seconds.json')
DEFAULT_SECONDS = 10.0
_seconds: dict[str, float] = {}


def _file_of(nodeid: str) -> str:
  return nodeid.split('::')[0]


def _by_seconds(items) -> None:
  import json

  with open(SECONDS_FILE) as f:
    seconds = json.load(f)
  # A stable sort: each file's tests stay together and in their order.
  items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), DEFAULT_SECONDS))


def pytest_collection_modifyitems(config, items):
  del config
  _by_seconds(items)


def pytest_runtest_logreport(report):
  if os.environ.get('TRIAX_TEST_SECONDS') == 'write' and not os.environ.get('PYTEST_XDIST_WORKER'):
    path = _file_of(report.nodeid)
    _seconds[path] = _seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
  del session
  if _seconds:
    import json

    with open(SECONDS_FILE) as f:
      seconds = json.load(f)  # files this run did not measure keep their figure
    seconds.update({k: round(v, 1) for k, v in _seconds.items()})
    with open(SECONDS_FILE, 'w') as f:
      json.dump(dict(sorted(seconds.items())), f, indent=0)
      f.write('\n')
