// CPU handlers of the moe routing ops: the results of the CUDA kernels (moe_routing_kernels.cu), computed
// one element at a time. No communication: each device computes its own routing.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "ops/moe/moe_routing.h"
#include "ops/moe/moe_routing_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ncclx {
namespace {

// Block (a, b) of an [A, B] table of block sizes starts where the earlier blocks end, in row-major order.
std::vector<int32_t> ExclusiveSums(const std::vector<int32_t>& sizes) {
  std::vector<int32_t> starts(sizes.size());
  int32_t running = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    starts[i] = running;
    running += sizes[i];
  }
  return starts;
}

void PlanSendsOne(const PlanSendsShape& shape, const int32_t* ids, const float* weights, const PlanSendsResults& out) {
  const int32_t E = shape.num_experts, N = shape.num_members, local = shape.local_experts();
  const int32_t C = shape.capacity, T = shape.num_tokens, k = shape.top_k;
  const int32_t P = shape.num_pairs(), S = shape.num_rows();
  std::vector<int32_t> key_count(E + 1, 0);
  for (int32_t pair = 0; pair < P; ++pair) ++key_count[RoutingKey(ids[pair], E)];
  const std::vector<int32_t> key_start = ExclusiveSums(key_count);
  std::vector<int32_t> next = key_start;  // a stable counting sort
  std::vector<int32_t> goes(N * T, 0);     // token t goes to member m
  for (int32_t pair = 0; pair < P; ++pair) {
    const int32_t key = RoutingKey(ids[pair], E);
    const int32_t position = next[key]++;
    out.order[position] = pair;
    out.return_slot[pair] = N * C;
    if (key == E) continue;
    const int32_t member = key / local, offset = position - key_start[member * local];
    if (offset < C) {
      out.return_slot[pair] = member * C + offset;
      goes[member * T + pair / k] = 1;
    }
  }
  for (int32_t e = 0; e < E; ++e) out.send_counts[e] = key_count[e];
  for (int32_t m = 0; m < N; ++m) {
    int32_t sent = 0;
    for (int32_t e = m * local; e < (m + 1) * local; ++e) sent += key_count[e];
    out.dropped[m] = sent > C ? sent - C : 0;
  }
  // Send rows: member-major, tokens ascending within a member.
  const std::vector<int32_t> row_of = ExclusiveSums(goes);
  std::vector<int32_t> first_row(N, 0);
  for (int32_t m = 0; m < N; ++m) {
    out.token_counts[m] = 0;
    first_row[m] = row_of.empty() ? 0 : row_of[m * T];
  }
  const int32_t R = shape.rows_per_member();
  for (int32_t i = 0; i < S; ++i) out.send_token[i] = T;
  for (int32_t i = 0; i < N * T; ++i) {
    const int32_t member = i / T, token = i % T;
    const bool sent = goes[i] && row_of[i] < S;
    out.return_row[token * N + member] = sent ? member * R + row_of[i] - first_row[member] : N * R;
    if (!goes[i]) continue;
    ++out.token_counts[member];
    if (sent) out.send_token[row_of[i]] = token;
  }
  const int32_t words = shape.suffix_words(), padded = PaddedWords(k);
  for (int32_t i = 0; i < S * words; ++i) out.send_suffix[i] = i % words < padded ? -1 : 0;
  for (int32_t position = 0; position < P; ++position) {
    const int32_t pair = out.order[position];
    const int32_t key = RoutingKey(ids[pair], E);
    if (key == E) continue;
    const int32_t member = key / local, offset = position - key_start[member * local];
    const int32_t entry = first_row[member] * k + offset;
    if (offset < C && entry < S * k) {
      const int32_t row = row_of[member * T + pair / k] - first_row[member];
      out.send_suffix[entry / k * words + entry % k] = (row * k + pair % k) * local + key % local;
    }
  }
  for (int32_t row = 0; weights != nullptr && row < S; ++row) {
    if (out.send_token[row] < T) {
      std::memcpy(out.send_suffix + row * words + padded, weights + out.send_token[row] * k, k * sizeof(float));
    }
  }
}

ffi::Error PlanSendsImpl(ffi::Buffer<ffi::S32> expert_ids, std::optional<ffi::Buffer<ffi::F32>> weights,
                         Int32Result order, Int32Result send_counts, Int32Result send_token, Int32Result send_suffix,
                         Int32Result token_counts, Int32Result return_slot, Int32Result return_row, Int32Result dropped,
                         PlanSendsAttrs attrs) {
  ffi::ErrorOr<PlanSendsShape> shape = GetPlanSendsShape(expert_ids, weights, attrs);
  if (shape.has_error()) return shape.error();
  const PlanSendsShape& s = *shape;
  NCCLX_RETURN_IF_ERROR(CheckPlanSendsResults(s, order, send_counts, send_token, send_suffix, token_counts, return_slot,
                                              return_row, dropped));
  const PlanSendsResults all = PlanSendsData(order, send_counts, send_token, send_suffix, token_counts, return_slot,
                                             return_row, dropped);
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t P = s.num_pairs(), S = s.num_rows(), N = s.num_members;
    PlanSendsOne(s, expert_ids.typed_data() + b * P, weights.has_value() ? weights->typed_data() + b * P : nullptr,
                 {all.order + b * P, all.send_counts + b * s.num_experts, all.send_token + b * S,
                  all.send_suffix + b * S * s.suffix_words(), all.token_counts + b * N, all.return_slot + b * P,
                  all.return_row + b * s.num_tokens * N, all.dropped + b * N});
  }
  return ffi::Error::Success();
}

void PlaceReceivedOne(const PlaceReceivedShape& shape, const uint8_t* received, const int32_t* recv_tokens,
                      const PlaceReceivedResults& out) {
  const int32_t N = shape.num_members, R = shape.rows_per_source, k = shape.top_k;
  const int32_t local = shape.local_experts, C = shape.capacity;
  const int32_t per_source = R * k, rows = N * C;
  // Entry i of the tags, read as one list: tag i % k of received row i / k.
  auto tag = [&](int32_t i) { return SuffixWord(received + i / k * shape.row_bytes + shape.suffix_offset, i % k); };
  std::vector<int32_t> counts(N * local, 0);  // [N][E_local]
  for (int32_t entry = 0; entry < N * per_source; ++entry) {
    const int32_t source = entry / per_source;
    if ((entry % per_source) / k < recv_tokens[source] && tag(entry) >= 0) {
      ++counts[source * local + tag(entry) % local];
    }
  }
  std::vector<int32_t> by_expert(N * local);  // [E_local][N]
  for (int32_t e = 0; e < local; ++e) {
    out.group_sizes[e] = 0;
    for (int32_t source = 0; source < N; ++source) {
      by_expert[e * N + source] = counts[source * local + e];
      out.group_sizes[e] += counts[source * local + e];
    }
  }
  const std::vector<int32_t> source_major = ExclusiveSums(counts);
  const std::vector<int32_t> expert_major = ExclusiveSums(by_expert);
  for (int32_t x = 0; x < rows; ++x) {
    out.expand_rows[x] = N * R;
    out.to_expert_major[x] = rows;
    out.to_source_major[x] = rows;
    out.pair_entry[x] = N * R * k;
  }
  for (int32_t entry = 0; entry < N * R * k; ++entry) out.row_pairs[entry] = rows;
  // Walk the blocks in expert-major order, then in source-major order, filling their rows.
  for (int32_t e = 0; e < local; ++e) {
    for (int32_t source = 0; source < N; ++source) {
      const int32_t first = source_major[source * local + e] - source_major[source * local];
      for (int32_t r = 0; r < counts[source * local + e]; ++r) {
        const int32_t x = expert_major[e * N + source] + r;
        if (x >= rows) break;
        if (first + r < C) out.to_expert_major[x] = source * C + first + r;
        const int32_t value = tag(source * per_source + first + r);  // (row * k + choice) * E_local + expert
        if (value >= 0 && value / (k * local) < R) {
          const int32_t row = source * R + value / (k * local), entry = row * k + value / local % k;
          out.expand_rows[x] = row;
          out.pair_entry[x] = entry;
          out.row_pairs[entry] = x;
        }
      }
    }
  }
  for (int32_t block = 0; block < N * local; ++block) {
    for (int32_t r = 0; r < counts[block]; ++r) {
      const int32_t x = source_major[block] + r;
      if (x >= rows) break;
      out.to_source_major[x] = std::min(expert_major[(block % local) * N + block / local] + r, rows);
    }
  }
  for (int32_t i = 0; i < N * local; ++i) out.recv_counts[i] = counts[i];
  int32_t packed = 0;
  for (int32_t source = 0; source < N; ++source) {
    for (int32_t r = 0; r < std::clamp(recv_tokens[source], 0, R); ++r) out.send_back_rows[packed++] = source * R + r;
  }
  for (; packed < N * R; ++packed) out.send_back_rows[packed] = N * R;
  for (int32_t r = 0; shape.with_weights && r < N * R; ++r) {
    const uint8_t* suffix = received + r * shape.row_bytes + shape.suffix_offset;
    for (int32_t j = 0; j < k; ++j) {
      const int32_t bits = SuffixWord(suffix, PaddedWords(k) + j);
      std::memcpy(out.recv_weights + r * k + j, &bits, sizeof(bits));
    }
  }
}

ffi::Error PlaceReceivedImpl(ffi::AnyBuffer received, ffi::Buffer<ffi::S32> recv_tokens, Int32Result recv_counts,
                             Int32Result group_sizes, Int32Result expand_rows, Int32Result to_expert_major,
                             Int32Result to_source_major, Int32Result pair_entry, Int32Result row_pairs,
                             Int32Result send_back_rows, Float32Result recv_weights, PlaceReceivedAttrs attrs) {
  ffi::ErrorOr<PlaceReceivedShape> shape = GetPlaceReceivedShape(received, recv_tokens, attrs);
  if (shape.has_error()) return shape.error();
  const PlaceReceivedShape& s = *shape;
  NCCLX_RETURN_IF_ERROR(CheckPlaceReceivedResults(s, recv_counts, group_sizes, expand_rows, to_expert_major,
                                                  to_source_major, pair_entry, row_pairs, send_back_rows,
                                                  recv_weights));
  const PlaceReceivedResults all = PlaceReceivedData(recv_counts, group_sizes, expand_rows, to_expert_major,
                                                     to_source_major, pair_entry, row_pairs, send_back_rows,
                                                     recv_weights);
  const int64_t rows = s.num_members * s.capacity, blocks = s.num_members * s.local_experts;
  const int64_t received_rows = s.num_members * s.rows_per_source;
  const int64_t weight_columns = s.with_weights ? s.top_k : 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    PlaceReceivedOne(s, static_cast<const uint8_t*>(received.untyped_data()) + b * received_rows * s.row_bytes,
                     recv_tokens.typed_data() + b * s.num_members,
                     {all.recv_counts + b * blocks, all.group_sizes + b * s.local_experts, all.expand_rows + b * rows,
                      all.to_expert_major + b * rows, all.to_source_major + b * rows, all.pair_entry + b * rows,
                      all.row_pairs + b * received_rows * s.top_k, all.send_back_rows + b * received_rows,
                      all.recv_weights + b * received_rows * weight_columns});
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuMoePlanSends, PlanSendsImpl,
                              BindPlanSendsAttrs(BindPlanSendsBuffers(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuMoePlaceReceived, PlaceReceivedImpl, BindPlaceReceived(ffi::Ffi::Bind()));

}  // namespace jax_ncclx
