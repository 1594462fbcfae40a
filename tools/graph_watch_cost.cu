// What it costs to watch NCCL calls that XLA records into CUDA graphs (JAX_NCCLX_NCCL_COMMAND_BUFFERS=1, whose
// replays the watchdog cannot see today). A diagnostic with no XLA baseline, for choosing the mechanism.
//
// One process drives every GPU (ncclCommInitAll). Per GPU, a graph of kOps dependent 8-byte all_reduces is
// timed over kReps replays, in five forms: bare; cuStreamWriteValue64 of a sequence number before and after
// each op (memop nodes); a one-thread kernel before and after each op (atomicAdd on mapped pinned memory);
// an external event record after each op (cudaEventRecordExternal, an event record node); a memop after each
// op only. Prints µs per op for each form (best of 3). Then what a watchdog thread would see of an external
// event in a graph: its cudaEventQuery while a replay runs a 200 ms kernel before it, after that replay, and
// right after a second replay is enqueued; the same with that graph nested as a child graph node (as XLA
// nests a custom call's captured launches in its command buffer).
//
//   N=$(python3 -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])")
//   nvcc -O2 -std=c++17 -arch=sm_90 -I$N/include tools/graph_watch_cost.cu -o /tmp/graph_watch_cost \
//     -L$N/lib -l:libnccl.so.2 -l:libcuda.so.1 -Xlinker -rpath=$N/lib
//   NCCL_NVLS_ENABLE=0 /tmp/graph_watch_cost
#include <cuda.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void Fail(const char* file, int line, const char* what) {
  std::printf("%s:%d %s\n", file, line, what);
  std::exit(1);
}
#define CHECK_CUDA(x) \
  if (cudaError_t e = (x); e != cudaSuccess) Fail(__FILE__, __LINE__, cudaGetErrorString(e))
#define CHECK_NCCL(x) \
  if (ncclResult_t e = (x); e != ncclSuccess) Fail(__FILE__, __LINE__, ncclGetErrorString(e))
#define CHECK_DRIVER(x) \
  if (CUresult e = (x); e != CUDA_SUCCESS) Fail(__FILE__, __LINE__, "CUDA driver call failed")

constexpr int kOps = 200, kReps = 50, kTrials = 3;
enum Form { kBare, kMemopsAround, kKernelsAround, kEventAfter, kMemopAfter, kForms };
const char* kFormNames[kForms] = {"bare", "memop write before+after", "counter kernel before+after",
                                  "external event after", "memop after only"};

__global__ void Count(unsigned long long* counter, unsigned long long* last, unsigned long long op) {
  atomicAdd(counter, 1ull);
  *last = op;
}

__global__ void Spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Before (after = false) or after one op on device d's stream, what `form` adds.
void Mark(Form form, bool after, int op, cudaStream_t stream, unsigned long long* words, cudaEvent_t event) {
  const unsigned long long value = 2ull * op + (after ? 2 : 1);
  unsigned long long* word = words + (after ? 2 : 0);
  if (form == kMemopsAround || (after && form == kMemopAfter)) {
    CHECK_DRIVER(cuStreamWriteValue64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word),
                                      value, CU_STREAM_WRITE_VALUE_DEFAULT));
  }
  if (form == kKernelsAround) Count<<<1, 1, 0, stream>>>(word, word + 1, value);
  if (form == kEventAfter && after) CHECK_CUDA(cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal));
}

}  // namespace

int main() {
  int n = 0;
  CHECK_CUDA(cudaGetDeviceCount(&n));
  std::vector<ncclComm_t> comms(n);
  CHECK_NCCL(ncclCommInitAll(comms.data(), n, nullptr));
  std::vector<cudaStream_t> streams(n);
  std::vector<float*> buffers(n);
  std::vector<unsigned long long*> host_words(n), device_words(n);
  std::vector<std::vector<cudaEvent_t>> events(n, std::vector<cudaEvent_t>(kOps));
  for (int d = 0; d < n; ++d) {
    CHECK_CUDA(cudaSetDevice(d));
    CHECK_CUDA(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
    CHECK_CUDA(cudaMalloc(&buffers[d], 4096));
    CHECK_CUDA(cudaMemset(buffers[d], 0, 4096));
    CHECK_CUDA(cudaHostAlloc(&host_words[d], 4096, cudaHostAllocMapped));
    CHECK_CUDA(cudaHostGetDevicePointer(&device_words[d], host_words[d], 0));
    for (cudaEvent_t& event : events[d]) CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  for (int f = 0; f < kForms; ++f) {
    const Form form = static_cast<Form>(f);
    std::vector<cudaGraph_t> graphs(n);
    std::vector<cudaGraphExec_t> execs(n);
    for (int d = 0; d < n; ++d) {
      CHECK_CUDA(cudaSetDevice(d));
      CHECK_CUDA(cudaStreamBeginCapture(streams[d], cudaStreamCaptureModeRelaxed));
    }
    for (int op = 0; op < kOps; ++op) {
      for (int d = 0; d < n; ++d) {
        CHECK_CUDA(cudaSetDevice(d));
        Mark(form, /*after=*/false, op, streams[d], device_words[d], events[d][op]);
      }
      CHECK_NCCL(ncclGroupStart());
      for (int d = 0; d < n; ++d) {
        CHECK_NCCL(ncclAllReduce(buffers[d], buffers[d], 2, ncclFloat, ncclSum, comms[d], streams[d]));
      }
      CHECK_NCCL(ncclGroupEnd());
      for (int d = 0; d < n; ++d) {
        CHECK_CUDA(cudaSetDevice(d));
        Mark(form, /*after=*/true, op, streams[d], device_words[d], events[d][op]);
      }
    }
    for (int d = 0; d < n; ++d) {
      CHECK_CUDA(cudaSetDevice(d));
      CHECK_CUDA(cudaStreamEndCapture(streams[d], &graphs[d]));
      CHECK_CUDA(cudaGraphInstantiate(&execs[d], graphs[d], 0));
    }
    auto replay = [&](int times) {
      for (int r = 0; r < times; ++r) {
        for (int d = 0; d < n; ++d) {
          CHECK_CUDA(cudaSetDevice(d));
          CHECK_CUDA(cudaGraphLaunch(execs[d], streams[d]));
        }
      }
      for (int d = 0; d < n; ++d) {
        CHECK_CUDA(cudaSetDevice(d));
        CHECK_CUDA(cudaStreamSynchronize(streams[d]));
      }
    };
    double best_us = 1e30;
    for (int trial = 0; trial < kTrials; ++trial) {
      replay(1);  // warm-up
      const auto start = std::chrono::steady_clock::now();
      replay(kReps);
      const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - start;
      best_us = std::min(best_us, took.count() / (kReps * kOps));
    }
    // The words show that the marks ran: the counters count replays x ops, the others hold the last op's value.
    const unsigned long long* w = host_words[0];
    std::printf("%-28s %6.2f us/op (best of %d; %d ops x %d replays, %d GPUs); words %llu %llu %llu %llu\n",
                kFormNames[form], best_us, kTrials, kOps, kReps, n, w[0], w[1], w[2], w[3]);
    for (int d = 0; d < n; ++d) {
      CHECK_CUDA(cudaGraphExecDestroy(execs[d]));
      CHECK_CUDA(cudaGraphDestroy(graphs[d]));
    }
  }
  // Device 0: [spin 200 ms, event]. cudaSuccess means recorded, cudaErrorNotReady pending.
  CHECK_CUDA(cudaSetDevice(0));
  int clock_khz = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(streams[0], cudaStreamCaptureModeRelaxed));
  Spin<<<1, 1, 0, streams[0]>>>(200LL * clock_khz);
  CHECK_CUDA(cudaEventRecordWithFlags(events[0][0], streams[0], cudaEventRecordExternal));
  CHECK_CUDA(cudaStreamEndCapture(streams[0], &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  auto state = [&] { return cudaGetErrorName(cudaEventQuery(events[0][0])); };
  auto replay_twice = [&](cudaGraphExec_t replayed, const char* what) {
    CHECK_CUDA(cudaStreamSynchronize(streams[0]));
    std::printf("%s: event before replay 1: %s\n", what, state());
    CHECK_CUDA(cudaGraphLaunch(replayed, streams[0]));
    std::printf("%s: event while replay 1 spins: %s\n", what, state());
    CHECK_CUDA(cudaStreamSynchronize(streams[0]));
    std::printf("%s: event after replay 1: %s\n", what, state());
    CHECK_CUDA(cudaGraphLaunch(replayed, streams[0]));
    std::printf("%s: event right after replay 2 is enqueued: %s\n", what, state());
    CHECK_CUDA(cudaStreamSynchronize(streams[0]));
    std::printf("%s: event after replay 2: %s\n", what, state());
  };
  replay_twice(exec, "top-level graph");
  cudaGraph_t parent;
  cudaGraphNode_t child;
  cudaGraphExec_t parent_exec;
  CHECK_CUDA(cudaGraphCreate(&parent, 0));
  const cudaError_t nested = cudaGraphAddChildGraphNode(&child, parent, nullptr, 0, graph);
  std::printf("child graph node holding the event record: %s\n", cudaGetErrorName(nested));
  if (nested == cudaSuccess) {
    const cudaError_t instantiated = cudaGraphInstantiate(&parent_exec, parent, 0);
    std::printf("instantiating its parent: %s\n", cudaGetErrorName(instantiated));
    if (instantiated == cudaSuccess) {
      replay_twice(parent_exec, "child graph");
      CHECK_CUDA(cudaGraphExecDestroy(parent_exec));
    }
  }
  cudaGetLastError();
  CHECK_CUDA(cudaGraphDestroy(parent));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  for (ncclComm_t comm : comms) ncclCommDestroy(comm);
  return 0;
}
