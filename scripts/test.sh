#!/usr/bin/env bash
# Run the test suite (installs what it needs into ./.venv first).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
source "$(dirname "$0")/_env.sh"
python -m pytest -q -n "${MESHPLAN_TEST_WORKERS:-2}" "$@"
