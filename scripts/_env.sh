# Sourced by the set-up scripts: make ./.venv with meshplan installed (idempotent).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MESHPLAN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.meshplan-installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip 2>/dev/null || true
  # (setuptools reports every editable install of a package mapped from
  # other folders as "Editable installation."; informational only.  -qq:
  # errors only, not a machine's pip configuration naming index folders it
  # lacks, which pip repeats for every package)
  PYTHONWARNINGS="ignore:Editable installation" python -m pip install -qq -e "$ROOT[test]"
  touch "$STAMP"
fi
cd "$ROOT"
