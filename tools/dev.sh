#!/usr/bin/env bash
# Sets up a Python 3.12 virtual environment with the pinned dependencies, builds jax_ncclx into it (the CUDA
# handlers too when nvcc is on PATH), then runs the main example or the test suite:
#
#   bash tools/dev.sh example            # examples/moe_step.py (all GPUs, or 8 virtual CPU devices)
#   bash tools/dev.sh test [pytest args] # the test suite (GPU tests skip with a reason where no GPU is)
#
# PYTHON picks the interpreter (default python3.12), VENV the environment folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
command="${1:-}"
shift || true
venv="${VENV:-.venv}"

# A Python 3.12 interpreter: $PYTHON, python3.12 on PATH, or pyenv's 3.12.x.
find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
  echo "tools/dev.sh: no Python 3.12 found; set PYTHON=/path/to/python3.12" >&2
  exit 1
}

if [ ! -x "$venv/bin/python" ]; then
  python="$(find_python)"
  echo "== creating $venv with $python"
  "$python" -m venv "$venv"
fi
echo "== installing pinned dependencies"
"$venv/bin/python" -m pip install -q -r requirements-dev.txt
echo "== building jax_ncclx"
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$venv/bin/python" -c "import jax_ncclx as nx; print('build:', nx.build_info())"

case "$command" in
  example) exec "$venv/bin/python" examples/moe_step.py "$@" ;;
  test) exec "$venv/bin/python" -m pytest "$@" ;;
  *) echo "usage: bash tools/dev.sh example|test [args]" >&2; exit 2 ;;
esac
