#!/usr/bin/env bash
# Runs the test suite on forced CPU devices (tests/conftest.py sets 8).
#   scripts/test.sh            the whole suite (CI's gate; the test extra: torch, libtpu, ...)
#   scripts/test.sh --fast     the fast tier: tests marked `fast` (seconds each, one small
#                              pipeline program), minutes; what to run while editing
#                              schedules, the planner, config or data readers
# Other arguments go to pytest, e.g. scripts/test.sh -k pipeline -x
fast=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then fast=1; else args+=("$arg"); fi
done
if [ "$fast" = 1 ]; then
  source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev,tpu
  marker=(-m fast)
else
  source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
  marker=()
fi
workers="${TRIAX_TEST_WORKERS:-2}"
exec python -m pytest -n "$workers" --dist loadfile ${marker[@]+"${marker[@]}"} ${args[@]+"${args[@]}"}
