#!/usr/bin/env bash
# A/B of two source trees on one GPU machine, in one command. Builds this tree (A) and another (B, a tarball
# of its files, e.g. `git archive -o scratch/b.tgz <rev>`) as separate wheels, then runs one benchmark
# alternately with each, ROUNDS times (A B A B ...), so that what drifts during a lent machine's session
# (clocks, temperature, the other GPU work) falls on both sides; the harness is this tree's script for both.
#
#   A_COMMIT=<rev> B_COMMIT=<rev> bash tools/ab_trees.sh OUT_DIR B_TREE.tgz ROUNDS BENCHMARK [ARGS ...]
#   e.g. bash tools/ab_trees.sh "$OUT/ab" scratch/b.tgz 3 all_to_allv --tokens 16,128 \
#          --variants xla_all_to_all,nx_padded,nx_moe
#
# Each run writes OUT_DIR/<benchmark>_{a,b}<round>.{json,md,png} (XLA in every run) and its log; the end
# prints, and writes to OUT_DIR/ab_summary.md, every row's median per run and the ratio of B's mean to A's
# (tools/ab_summary.py). A_COMMIT / B_COMMIT are recorded as each run's commit (the machine's copy of the
# tree has no git history). A run that imports another copy of jax_ncclx than its side's stops the A/B: an
# editable install made earlier on the machine would shadow both wheels, so it is uninstalled first.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and its siblings). TAR=1 packs OUT_DIR into OUT_DIR.tgz
# (a lent machine returns only a few files of a folder).
# LOOPBACK="--ranks 1,8 --moe 16,128" also times the NVLink kernels per call with each tree after the rounds
# (tools/time_loopback_collectives.py with those arguments, OUT_DIR/loopback_{a,b}.{json,log}); both trees
# are then built with the test-only modules (JAX_NCCLX_TESTING=ON). WORK=DIR builds into DIR (its a/ and b/ are
# the two import folders), for a later command on the same machine, e.g. the tests with PYTHONPATH=DIR/a.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash tools/ab_trees.sh OUT_DIR B_TREE.tgz ROUNDS BENCHMARK [ARGS ...]}"
b_tree="${2:?B_TREE.tgz}"
rounds="${3:?ROUNDS}"
benchmark="${4:?BENCHMARK (all_to_allv, collectives, ...)}"
shift 4
export NCCL_NVLS_ENABLE=0 NCCL_NVLINK_MULTICAST_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python="${PYTHON:-python3}"
mkdir -p "$out"
work="${WORK:-$(mktemp -d)}"  # WORK: keep the wheels where a later command finds them
if [ "${TAR:-0}" = 1 ]; then
  trap 'tar -C "$(dirname "$out")" -czf "$out.tgz" "$(basename "$out")" && rm -rf "$out"' EXIT
fi
start=$SECONDS
"$python" -m pip uninstall -y -q jax_ncclx > /dev/null 2>&1 || true
[ -n "${LOOPBACK:-}" ] && export JAX_NCCLX_TESTING=ON

# Builds the tree at $1 into the import folder $2 (a wheel, not editable: two copies must not meet).
build() {
  local tree="$1" side="$2"
  "$python" -m pip wheel -q --no-build-isolation --no-deps -w "$work/wheel_$side" "$tree" > "$out/build_$side.log" 2>&1
  "$python" -m pip install -q --no-deps --target "$work/$side" "$work/wheel_$side"/*.whl >> "$out/build_$side.log" 2>&1
  echo "== built $side ($tree) after $((SECONDS - start)) s"
}
mkdir -p "$work/tree_b"
tar -xzf "$b_tree" -C "$work/tree_b"
build . a
build "$work/tree_b" b

for round in $(seq 1 "$rounds"); do
  for side in a b; do
    commit_var="${side^^}_COMMIT"
    name="${benchmark}_${side}${round}"
    imported=$(PYTHONPATH="$work/$side" "$python" -P -c "import jax_ncclx, os; print(os.path.dirname(jax_ncclx.__file__))")
    if [ "$imported" != "$work/$side/jax_ncclx" ]; then
      echo "== $name would import $imported, not $work/$side/jax_ncclx: stopping" >&2
      exit 1
    fi
    status=0
    PYTHONPATH="$work/$side" BENCH_GIT_COMMIT="${!commit_var:-unknown}" \
      "$python" "benchmarks/$benchmark.py" --out "$out" --name "$name" "$@" > "$out/$name.log" 2>&1 || status=$?
    echo "== $name: exit $status after $((SECONDS - start)) s"
  done
done
"$python" tools/ab_summary.py "$out" "$benchmark" | tee "$out/ab_summary.md"
if [ -n "${LOOPBACK:-}" ]; then
  for side in a b; do
    status=0
    # shellcheck disable=SC2086  # LOOPBACK is a list of arguments
    PYTHONPATH="$work/$side" "$python" -P tools/time_loopback_collectives.py "$out/loopback_$side.json" $LOOPBACK \
      > "$out/loopback_$side.log" 2>&1 || status=$?
    echo "== loopback $side: exit $status after $((SECONDS - start)) s"
    grep moe "$out/loopback_$side.log" || tail -5 "$out/loopback_$side.log"
  done
fi
