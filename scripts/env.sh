# Sourced by the other scripts: creates or updates a venv and activates it.
# Usage: source scripts/env.sh [EXTRAS]   (EXTRAS=test installs the test extra;
# several as dev,tpu). TRIAX_VENV picks the venv's directory (default .venv),
# TRIAX_PYTHON the interpreter that makes it (default: Python 3.11, else
# the first of 3.12 and python3 that is >= 3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
extra="${1:-}"
VENV="${TRIAX_VENV:-.venv}"
# jax 0.10.2 is what the whole suite runs on (Python 3.11); 0.12 on 3.12 (setup.cfg).
PY="${TRIAX_PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      PY="$candidate"; break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "error: scripts/env.sh: need Python >= 3.11 (set TRIAX_PYTHON=/path/to/python)" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# Reinstall only when the package metadata changed (or the extra is new).
stamp="$VENV/.triax-installed${extra:+-$extra}"
want="$(cat setup.cfg pyproject.toml | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # grep drops this machine's pip warnings about index locations it cannot use.
  "$VENV/bin/python" -m pip install --quiet --upgrade pip 2>&1 | { grep -v 'is ignored' || true; }
  "$VENV/bin/python" -m pip install --quiet -e ".${extra:+[$extra]}" 2>&1 | { grep -v 'is ignored' || true; }
  if [ "$extra" = test ]; then
    # XLA:GPU for the GPU topology tests: jax's CUDA plugin for the installed jax,
    # outside site-packages so that JAX does not load it at every start-up
    # (tests/test_gpu_topology.py passes it as TRIAX_XLA_CUDA_PLUGIN).
    jax_version="$("$VENV/bin/python" -c 'import jax; print(jax.__version__)')"
    "$VENV/bin/python" -m pip install --quiet --no-deps --upgrade --target "$VENV/xla-cuda" \
      "jax-cuda12-pjrt==$jax_version" 2>&1 | { grep -v 'is ignored' || true; }
  fi
  echo "$want" > "$stamp"
fi
export PATH="$ROOT/$VENV/bin:$PATH"
