"""Forces 8 CPU devices once, before JAX starts (never per test).

A test that needs another device count runs a subprocess (see
tests/cli_helpers.py).
"""

import os
import sys

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'src'))
