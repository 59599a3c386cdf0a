"""Forces 8 CPU devices once, before JAX starts (never per test); shared fixtures.

A test that needs another device count runs a subprocess (see
tests/harness.py: run_cli).
"""

import os
import sys

import pytest

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'src'))


@pytest.fixture(scope='session')
def compile_cache(tmp_path_factory):
  """Environment for subprocesses: a persistent XLA compilation cache shared by this test run.

  The same configuration is started many times (crash, resume, compare);
  compiling once saves most of each start-up. Cached executables are the
  ones XLA would compile again, so results are unchanged.
  """
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base
  path = root / 'jax-compilation-cache'
  path.mkdir(exist_ok=True)
  return {
    'JAX_COMPILATION_CACHE_DIR': str(path),
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
  }
