#!/usr/bin/env bash
# Sets up a Python 3.12 virtual environment with the pinned dependencies, builds jax_ncclx into it (the CUDA
# handlers too when nvcc is on PATH, and the test-only modules: JAX_NCCLX_TESTING=ON), showing each file as it
# compiles, then runs the main example or the test suite:
#
#   bash tools/dev.sh example            # examples/moe_step.py (all GPUs, or 8 virtual CPU devices)
#   bash tools/dev.sh test [pytest args] # the test suite: where no GPU is, the CPU tests without the slow
#                                        # cases (about 3 minutes on 2 cores); --slow: every case, as CI runs
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
mkdir -p build
log=build/dev-build.log
echo "== building jax_ncclx (full log: $log)"
# The build's steps, CMake's jax_ncclx lines (CUDA or not, and why) and ninja's one line per file compiled;
# the whole log when it fails.
set +e
JAX_NCCLX_TESTING="${JAX_NCCLX_TESTING:-ON}" "$venv/bin/python" -m pip install -v --no-build-isolation --no-deps -e . 2>&1 \
  | tee "$log" | { grep --line-buffered -E '^ *(\*\*\* |-- jax_ncclx|\[[0-9]+/[0-9]+\] |ninja: )' | sed -u 's/^ *//' || true; }
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  cat "$log" >&2
  echo "tools/dev.sh: the build failed (exit $status); the log above is in $log" >&2
  exit "$status"
fi
"$venv/bin/python" -c "import jax_ncclx as nx; print('build:', nx.build_info())"

case "$command" in
  example) exec "$venv/bin/python" examples/moe_step.py "$@" ;;
  test) exec "$venv/bin/python" -m pytest "$@" ;;
  *) echo "usage: bash tools/dev.sh example|test [args]" >&2; exit 2 ;;
esac
