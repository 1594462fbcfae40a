#!/usr/bin/env bash
# Lints the tracked sources: `ruff check` over the Python files ([tool.ruff] in pyproject.toml) and
# `clang-format --dry-run --Werror` over the C++ and CUDA files (.clang-format). Uses the virtual environment's
# ruff and clang-format (pinned in requirements-dev.txt; tools/dev.sh installs them), else those on PATH.
#
#   bash tools/lint.sh          # check; exit 1 on any finding
#   bash tools/lint.sh --fix    # reformat the C++ in place and apply ruff's safe fixes, then check
#
# VENV picks the environment folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

tool() {
  local venv="${VENV:-.venv}"
  if [ -x "$venv/bin/$1" ]; then echo "$venv/bin/$1"; return; fi
  command -v "$1" || { echo "tools/lint.sh: $1 not found: pip install -r requirements-dev.txt" >&2; exit 2; }
}
ruff=$(tool ruff)
clang_format=$(tool clang-format)

mapfile -t python < <(git ls-files -- '*.py')
mapfile -t cpp < <(git ls-files -- '*.cc' '*.h' '*.cu' '*.cuh')

if [ "${1:-}" = "--fix" ]; then
  "$clang_format" -i "${cpp[@]}"
  "$ruff" check --fix --quiet "${python[@]}" || true
fi

status=0
echo "== ruff check (${#python[@]} files)"
"$ruff" check "${python[@]}" || status=1
echo "== clang-format --dry-run --Werror (${#cpp[@]} files)"
"$clang_format" --dry-run --Werror "${cpp[@]}" || status=1
[ "$status" -eq 0 ] && echo "== lint: clean" || echo "== lint: findings above (bash tools/lint.sh --fix formats the C++)"
exit "$status"
