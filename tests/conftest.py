"""Forces 8 CPU devices once, before JAX starts (never per test); shared fixtures.

A test that needs another device count runs a subprocess (see
tests/harness.py: run_cli).
"""

import os
import shutil
import sys
import tempfile

import pytest

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
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
  del config
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
