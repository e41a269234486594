#!/usr/bin/env bash
# Run the test suite (installs what it needs into ./.venv first).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
source "$(dirname "$0")/_env.sh"
# worksteal: an idle worker takes queued tests from the busy one, so a few long
# tests near the end of the collection do not leave one core idle
python -m pytest -q -n "${MESHPLAN_TEST_WORKERS:-2}" --dist worksteal "$@"
