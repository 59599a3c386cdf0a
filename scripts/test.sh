#!/usr/bin/env bash
# Runs the whole test suite on forced CPU devices (tests/conftest.py sets 8).
# Extra arguments go to pytest, e.g. scripts/test.sh -k pipeline -x
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
workers="${TRIAX_TEST_WORKERS:-2}"
exec python -m pytest -n "$workers" --dist loadfile "$@"
