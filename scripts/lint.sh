#!/usr/bin/env bash
# The lint and format gate .ci/run applies before the tests (ruff, configured in
# pyproject.toml). To fix what it reports: ruff check --fix ...; ruff format ...
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
paths=(src tests scripts experiments)
ruff check "${paths[@]}"
ruff format --check "${paths[@]}"
