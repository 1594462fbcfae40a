// Kernel-only timing of moe's routing kernels (plan_sends, place_received) on one GPU: a diagnostic for
// changes to xla_ffi/ops/moe/moe_routing_kernels.cu, not a benchmark (no XLA baseline; time the moe layer with
// benchmarks/all_to_allv.py). Build and run from the repository root on a GPU machine:
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Ixla_ffi tools/time_routing_kernels.cu -o /tmp/time_routing && /tmp/time_routing
//
// To time another version of the kernels, point ROUTING_KERNELS at its file (an absolute path), e.g. one from git:
//   git show HEAD~1:xla_ffi/ops/moe/moe_routing_kernels.cu > /tmp/old.cu
//   nvcc ... -DROUTING_KERNELS='"/tmp/old.cu"' tools/time_routing_kernels.cu -o /tmp/time_routing_old
//
// Shapes: the all_to_allv benchmark's routing, 8 experts per member, top-8 of distinct experts drawn at random,
// router weights in the suffixes, 2 and 4 members, T = 16, 128 and 4096 tokens; capacity C = the most pairs
// any member gets (nothing dropped). place_received reads rows whose suffixes hold valid tags (each source's
// R * k entries sorted by local expert, the first C of them live), not the rows of a real exchange. Each
// kernel is captured 100 times back to back in a CUDA graph; the time per launch is the median of 20 replays.
#ifndef ROUTING_KERNELS
#define ROUTING_KERNELS "ops/moe/moe_routing_kernels.cu"
#endif
#include ROUTING_KERNELS

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

using namespace jax_ncclx;

void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}

// Device buffers of one shape's calls, freed together.
struct DeviceBuffers {
  std::vector<void*> buffers;
  ~DeviceBuffers() {
    for (void* p : buffers) cudaFree(p);
  }
  void* Bytes(int64_t n) {
    void* p = nullptr;
    Check(cudaMalloc(&p, std::max<int64_t>(n, 1)), "cudaMalloc");
    buffers.push_back(p);
    return p;
  }
  int32_t* Ints(int64_t n) { return static_cast<int32_t*>(Bytes(n * sizeof(int32_t))); }
};

// Median µs per launch of `launch(stream)` over 20 replays of a graph of 100 launches.
template <typename Launch>
double MicrosPerLaunch(Launch launch) {
  constexpr int kPerGraph = 100, kReplays = 20;
  cudaStream_t stream;
  Check(cudaStreamCreate(&stream), "cudaStreamCreate");
  Check(launch(stream), "warm-up launch");
  Check(cudaStreamSynchronize(stream), "warm-up");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  for (int i = 0; i < kPerGraph; ++i) Check(launch(stream), "captured launch");
  Check(cudaStreamEndCapture(stream, &graph), "end capture");
  Check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  Check(cudaGraphLaunch(exec, stream), "graph warm-up");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int r = 0; r < kReplays; ++r) {
    cudaEventRecord(start, stream);
    Check(cudaGraphLaunch(exec, stream), "graph launch");
    cudaEventRecord(stop, stream);
    Check(cudaEventSynchronize(stop), "replay");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(1000.0 * ms / kPerGraph);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Times both kernels at one shape and prints a table row.
void TimeShape(int members, int tokens) {
  constexpr int kTopK = 8, kExpertsPerMember = 8, kHidden = 7168;
  const int experts = kExpertsPerMember * members;
  std::mt19937 rng(1);
  std::vector<int32_t> ids(tokens * kTopK);
  std::vector<int> pairs_per_member(members, 0);
  std::vector<int> order(experts);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) order[e] = e;
    std::shuffle(order.begin(), order.end(), rng);
    for (int j = 0; j < kTopK; ++j) {
      ids[t * kTopK + j] = order[j];
      ++pairs_per_member[order[j] / kExpertsPerMember];
    }
  }
  const int capacity = *std::max_element(pairs_per_member.begin(), pairs_per_member.end());
  DeviceBuffers device;

  PlanSendsShape plan;
  plan.batch = 1;
  plan.num_tokens = tokens;
  plan.top_k = kTopK;
  plan.num_experts = experts;
  plan.num_members = members;
  plan.capacity = capacity;
  plan.with_weights = true;
  int32_t* device_ids = device.Ints(ids.size());
  Check(cudaMemcpy(device_ids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice), "ids");
  float* weights = static_cast<float*>(device.Bytes(ids.size() * sizeof(float)));
  Check(cudaMemset(weights, 0, ids.size() * sizeof(float)), "weights");
  const int64_t rows = plan.num_rows(), words = plan.suffix_words();
  PlanSendsResults sends;
  sends.order = device.Ints(plan.num_pairs());
  sends.send_counts = device.Ints(experts);
  sends.send_token = device.Ints(rows);
  sends.send_suffix = device.Ints(rows * words);
  sends.token_counts = device.Ints(members);
  sends.return_slot = device.Ints(plan.num_pairs());
  sends.return_row = device.Ints(int64_t{tokens} * members);
  sends.dropped = device.Ints(members);
  int32_t* scratch = device.Ints(PlanSendsScratchBytes(plan) / sizeof(int32_t));

  PlaceReceivedShape place;
  place.batch = 1;
  place.num_members = members;
  place.rows_per_source = plan.rows_per_member();
  place.top_k = kTopK;
  place.local_experts = kExpertsPerMember;
  place.capacity = capacity;
  place.suffix_offset = int64_t{kHidden} * 2;  // bf16 rows
  place.row_bytes = place.suffix_offset + words * sizeof(int32_t);
  place.with_weights = true;
  const int64_t per_source = place.rows_per_source;
  std::vector<uint8_t> received(members * per_source * place.row_bytes, 0);
  for (int source = 0; source < members; ++source) {
    std::vector<int32_t> tags;
    for (int64_t row = 0; row < per_source; ++row) {
      for (int j = 0; j < kTopK; ++j) {
        tags.push_back(static_cast<int32_t>((row * kTopK + j) * kExpertsPerMember + rng() % kExpertsPerMember));
      }
    }
    std::stable_sort(tags.begin(), tags.end(),
                     [](int32_t a, int32_t b) { return a % kExpertsPerMember < b % kExpertsPerMember; });
    for (int64_t entry = 0; entry < per_source * kTopK; ++entry) {
      const int32_t tag = entry < capacity ? tags[entry] : -1;
      const int64_t row = source * per_source + entry / kTopK;
      std::memcpy(&received[row * place.row_bytes + place.suffix_offset + 4 * (entry % kTopK)], &tag, 4);
    }
  }
  uint8_t* device_received = static_cast<uint8_t*>(device.Bytes(received.size()));
  Check(cudaMemcpy(device_received, received.data(), received.size(), cudaMemcpyHostToDevice), "received");
  std::vector<int32_t> recv_tokens(members, static_cast<int32_t>(per_source));
  int32_t* device_recv_tokens = device.Ints(members);
  Check(cudaMemcpy(device_recv_tokens, recv_tokens.data(), members * sizeof(int32_t), cudaMemcpyHostToDevice),
        "recv_tokens");
  const int64_t layout_rows = int64_t{members} * capacity, entries = members * per_source * kTopK;
  PlaceReceivedResults placed;
  placed.recv_counts = device.Ints(members * kExpertsPerMember);
  placed.group_sizes = device.Ints(kExpertsPerMember);
  placed.expand_rows = device.Ints(layout_rows);
  placed.to_expert_major = device.Ints(layout_rows);
  placed.to_source_major = device.Ints(layout_rows);
  placed.pair_entry = device.Ints(layout_rows);
  placed.row_pairs = device.Ints(entries);
  placed.send_back_rows = device.Ints(members * per_source);
  placed.recv_weights = static_cast<float*>(device.Bytes(entries * sizeof(float)));

  const double plan_us = MicrosPerLaunch(
      [&](cudaStream_t stream) { return LaunchPlanSends(plan, device_ids, weights, sends, scratch, stream); });
  const double place_us = MicrosPerLaunch([&](cudaStream_t stream) {
    return LaunchPlaceReceived(place, device_received, device_recv_tokens, placed, stream);
  });
  Check(cudaDeviceSynchronize(), "timing");
  std::printf("| %d | %d | %d | %.2f | %.2f |\n", members, tokens, capacity, plan_us, place_us);
}

}  // namespace

int main() {
  cudaDeviceProp properties;
  Check(cudaGetDeviceProperties(&properties, 0), "cudaGetDeviceProperties");
  std::printf("%s, kernels from %s\n\n", properties.name, ROUTING_KERNELS);
  std::printf("| members | T | C | plan_sends µs | place_received µs |\n| --- | --- | --- | --- | --- |\n");
  for (int members : {2, 4}) {
    for (int tokens : {16, 128, 4096}) TimeShape(members, tokens);
  }
  return 0;
}
