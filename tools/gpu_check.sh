#!/usr/bin/env bash
# Builds jax_ncclx and runs its GPU tests and benchmarks in one command, for a GPU machine lent for a few
# minutes at a time (one call, logs in one folder):
#
#   bash tools/gpu_check.sh OUT_DIR [STEP ...]
#
# Steps run in order (default: build tests multiprocess), each under what is left of BUDGET_S seconds
# (default 570) so that a slow step cannot cost the logs of the others:
#   build         JAX_NCCLX_TESTING=ON pip install --no-build-isolation --no-deps -e .  (the GPU machines have
#                 no network; the test-only modules, which tests/test_nvlink_loopback.py and
#                 benchmarks/launch_floor.py need: without them those fail rather than skip)
#   tests         pytest --slow -m "gpu and not multiprocess" (every case, the slow ones too; per-test limit
#                 150 s where pytest-timeout is installed, as on the GPU machines; a JUnit XML beside the log)
#                 over $ARGS_tests (default: tests, all of them)
#   multiprocess  pytest -m multiprocess (one process per GPU, fault injection)
#   memcheck      compute-sanitizer --tool memcheck over the adversarial all_to_allv count patterns,
#                 send_rows indices and suffixes on GPU (test_patterns, test_send_rows_gather_on_the_way,
#                 test_suffix_travels_with_rows; each with rows written straight into the peers' outputs
#                 and through the staging slots, test_all_to_allv.py's GPU_TRANSPORTS; staged pieces sent
#                 in rounds, test_staged_pieces_in_rounds), the moe routing
#                 kernels (test_moe_routing), the row copies (test_take_rows), every NVLink kernel with 2 to
#                 8 ranks on one GPU (test_nvlink_loopback, so this runs on one GPU too); the small-message
#                 all_to_all in every protocol and size class
#                 (test_nvlink_collectives.py::test_all_to_all, float32), and the zero rows left to the
#                 receiver (test_zero_rows_over_a_stale_buffer, many_zeros), and the plain run of
#                 tests/command_buffer_worker.py (every NVLink kernel in one program, the two-shot
#                 all-gather and large moves written into the peers' outputs; 180 s at most, exit 124 past
#                 that, so that a hang leaves the later steps their time; a wait for a peer gives up after
#                 60 s with the error that names it, and the Python stacks are printed at 120 s). API
#                 errors are not reported: cudaDeviceEnablePeerAccess answers "already enabled" once XLA has
#                 enabled it, by design, and the sanitizer counts each of those
#   moe_sanitize  compute-sanitizer memcheck, then racecheck (shared-memory hazards), over the MoE kernels on
#                 one GPU: test_moe.py's kernel cases (against the chain) and the loopback's moe_dispatch and
#                 moe_combine cases with 2 to 8 ranks, the shapes sweep left out, and the masked layout's
#                 kernels in loopback with 2 to 8 ranks on three routing patterns (about two minutes). Not the
#                 masked kernels through XLA: the sanitizer process crashes there (a segfault, no report) on
#                 cases that pass without it, and not always the same ones
#   copy_rates    builds and runs tools/time_copy_rates.cu (dispatch's row expansion beside the device's copy
#                 and store rates; a diagnostic, seconds)
#   decode_signal builds and runs tools/time_decode_signal.cu (what the signal between a dispatch's senders and
#                 receivers costs at decode sizes: release flags against LL128 lines; a diagnostic, seconds)
#   startup | collectives | all_to_allv | launch_floor   benchmarks/<step>.py --out OUT_DIR $ARGS_<step>
#                 (e.g. ARGS_all_to_allv="--experts-per-rank 32 --name all_to_allv_8gpu")
#   collectives_cmdbuf | all_to_allv_cmdbuf | launch_floor_cmdbuf   the same benchmark with custom calls
#                 captured in command buffers (XLA_FLAGS below), $ARGS_<step> (give it its own --name)
# The issues' targets on 4 GPUs in one call (see benchmarks/README.md, "The targets in one call").
# Every step writes OUT_DIR/<step>.log (and OUT_DIR/topology.log the GPU links); the last lines of each and the pass/fail counts are printed at the end.
# With TAR=1 the folder is packed into OUT_DIR.tgz (a lent machine returns only a few files).
# NVLink multicast stays off in every process this starts (NCCL_NVLS_ENABLE=0 and its siblings).
# Results record BENCH_GIT_COMMIT (default: git rev-parse HEAD); pass it, since a lent machine's copy of the
# working tree has been seen to report another commit.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash tools/gpu_check.sh OUT_DIR [STEP ...]}"
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests multiprocess)
mkdir -p "$out"
nvidia-smi topo -m > "$out/topology.log" 2>&1  # which GPU pairs share NVLink, for the record
export NCCL_NVLS_ENABLE=0 NCCL_NVLINK_MULTICAST_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export BENCH_GIT_COMMIT="${BENCH_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
python="${PYTHON:-python3}"
budget="${BUDGET_S:-570}"
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }

run_step() {
  local step="$1" limit
  limit=$(left)
  if [ "$limit" -lt 15 ]; then
    echo "== $step: skipped, ${limit} s left" | tee "$out/$step.log"
    return
  fi
  local pytest=("$python" -m pytest -p no:cacheprovider -rfE --tb=short --slow)  # every case (tests/conftest.py)
  "$python" -c "import pytest_timeout" 2>/dev/null && pytest+=(--timeout 150)  # a hang fails with its traceback
  case "$step" in
    build) cmd=(env JAX_NCCLX_TESTING=ON "$python" -m pip install -v --no-build-isolation --no-deps -e .) ;;
    tests)
      local paths
      read -ra paths <<< "${ARGS_tests:-tests}"
      cmd=("${pytest[@]}" -q -m "gpu and not multiprocess" --junitxml "$out/tests.xml" "${paths[@]}") ;;
    multiprocess) cmd=("${pytest[@]}" -v -m multiprocess --junitxml "$out/multiprocess.xml" tests) ;;
    memcheck)
      local sanitizer=("$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)" --tool memcheck --report-api-errors no --error-exitcode 86 --print-limit 20)
      local cases=("${pytest[@]}" -q -m gpu "tests/test_all_to_allv.py::test_patterns"
                   "tests/test_all_to_allv.py::test_send_rows_gather_on_the_way"
                   "tests/test_all_to_allv.py::test_suffix_travels_with_rows"
                   "tests/test_all_to_allv.py::test_staged_pieces_in_rounds" tests/test_moe_routing.py
                   tests/test_take_rows.py tests/test_nvlink_loopback.py)
      local once=("${pytest[@]}" -q -m gpu tests/test_nvlink_collectives.py::test_all_to_all -k float32)
      local zeros=("${pytest[@]}" -q -m gpu tests/test_all_to_allv.py::test_zero_rows_over_a_stale_buffer
                   -k many_zeros)
      # Before the worker, which GPU processes are left over (its rare hang may come from one still running).
      local apps="nvidia-smi --query-compute-apps=pid,process_name,used_gpu_memory --format=csv,noheader"
      cmd=(bash -c "${sanitizer[*]} ${cases[*]} && ${sanitizer[*]} ${once[*]} && ${sanitizer[*]} ${zeros[*]} &&
                    { echo '== GPU processes before the worker:'; $apps || true; } &&
                    JAX_NCCLX_TRANSPORT=nvlink JAX_NCCLX_TIMEOUT_S=60 WORKER_STACKS_AFTER_S=120 \
                    timeout 180 ${sanitizer[*]} $python tests/command_buffer_worker.py") ;;
    moe_sanitize)
      local sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer) --report-api-errors no --error-exitcode 86 --print-limit 20"
      local single="${pytest[*]} -q -m gpu tests/test_moe.py -k kernel"
      local loopback="${pytest[*]} -q -m gpu tests/test_nvlink_loopback.py -k 'moe and not shapes'"
      local masked="${pytest[*]} -q -m gpu tests/test_moe_masked.py -k 'loopback_kernels and (random or one_expert or tight)'"
      cmd=(bash -c "for tool in memcheck racecheck; do echo == \$tool; $sanitizer --tool \$tool $single &&
                    $sanitizer --tool \$tool $loopback && $sanitizer --tool \$tool $masked || exit; done") ;;
    copy_rates | decode_signal)
      local nvcc
      nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
      cmd=(bash -c "$nvcc -std=c++17 -O3 -arch=sm_90 -Ixla_ffi tools/time_$step.cu -o $out/time_$step.bin &&
                    $out/time_$step.bin && rm -f $out/time_$step.bin") ;;
    startup | collectives | all_to_allv | launch_floor | collectives_cmdbuf | all_to_allv_cmdbuf | launch_floor_cmdbuf)
      local args_var="ARGS_$step" extra
      read -ra extra <<< "${!args_var:-}"
      cmd=("$python" "benchmarks/${step%_cmdbuf}.py" --out "$out" "${extra[@]}")
      if [ "$step" != "${step%_cmdbuf}" ]; then  # XLA reads its flags when JAX starts: set them for the process
        cmd=(env "XLA_FLAGS=--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" "${cmd[@]}")
      fi ;;
    *) echo "== $step: unknown step" | tee "$out/$step.log"; return ;;
  esac
  echo "== $step (limit ${limit} s): ${cmd[*]}"
  timeout "$limit" "${cmd[@]}" > "$out/$step.log" 2>&1
  local rc=$?
  echo "== $step: exit $rc after $((SECONDS - start)) s" | tee -a "$out/$step.log"
}

for step in "${steps[@]}"; do run_step "$step"; done
echo "== summary"
for step in "${steps[@]}"; do
  echo "-- $step"
  if [ "$step" = copy_rates ] || [ "$step" = decode_signal ]; then tail -14 "$out/$step.log"; continue; fi  # a table
  grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped)|== $step: exit" "$out/$step.log" | tail -12
done
if [ "${TAR:-0}" = 1 ]; then
  tar -C "$(dirname "$out")" -czf "$out.tgz" "$(basename "$out")" && rm -rf "$out"
fi
