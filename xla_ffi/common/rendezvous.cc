// Implementation of the CPU rendezvous: one global table of rounds guarded by a mutex. Collectives on the CPU
// backend are for development and CI, so clarity wins over lock-free speed here.
#include "common/rendezvous.h"

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <cstdio>
#include <string>
#include <tuple>
#include <utility>

namespace jax_ncclx {
namespace {

struct Round {
  explicit Round(int64_t size) : published(size), arrived(size, false) {}
  std::vector<Published> published;
  std::vector<bool> arrived;
  int64_t num_arrived = 0;
  int64_t num_departed = 0;
  bool abandoned = false;  // a participant gave up waiting for arrivals; everyone else must fail too
  std::string missing;     // the ranks it gave up on, for everyone else's error
};

std::mutex mu;
std::condition_variable cv;
std::map<RoundKey, std::shared_ptr<Round>> rounds;
std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>> sequences;  // (op, partition) -> (run, next)

std::string MissingRanks(const std::vector<bool>& present) {
  std::string out;
  for (size_t r = 0; r < present.size(); ++r) {
    if (!present[r]) out += (out.empty() ? "" : ", ") + std::to_string(r);
  }
  return out;
}

// Waits until every participant has arrived; on timeout marks the round abandoned and returns an error naming
// the ranks that have not. An abandoned round stays in the table, so that a rank arriving late learns why.
ffi::Error WaitForArrivals(std::unique_lock<std::mutex>& lock, Round& round, std::string_view op,
                           std::string_view what, std::chrono::milliseconds timeout) {
  const int64_t size = static_cast<int64_t>(round.arrived.size());
  const auto ready = [&] { return round.num_arrived == size || round.abandoned; };
  if (timeout.count() == 0) {  // JAX_NCCLX_TIMEOUT_S=0: wait forever
    cv.wait(lock, ready);
    if (!round.abandoned) return ffi::Error::Success();
  } else if (cv.wait_for(lock, timeout, ready) && !round.abandoned) {
    return ffi::Error::Success();
  }
  std::string message = std::string(what) + ": ";
  if (!round.abandoned) {
    round.abandoned = true;
    round.missing = MissingRanks(round.arrived);
    cv.notify_all();
    char seconds[32];  // snprintf, not an ostream: the module's own libstdc++ locale is not set up
    std::snprintf(seconds, sizeof(seconds), "%g", timeout.count() / 1000.0);
    message += "rank(s) " + round.missing + " did not arrive within " + seconds + " s (JAX_NCCLX_TIMEOUT_S)";
  } else {
    // Named as the peer that timed out saw them: a late rank that arrives afterwards is no longer missing.
    message += "abandoned because a peer timed out waiting for rank(s) " + round.missing;
  }
  return DeadlineExceeded(op, message);
}

}  // namespace

bool RoundKey::operator<(const RoundKey& other) const {
  return std::tie(op_id, group_idx, run_id, sequence) <
         std::tie(other.op_id, other.group_idx, other.run_id, other.sequence);
}

int64_t RendezvousSequence(int64_t op_id, int64_t partition_id, int64_t run_id) {
  std::lock_guard<std::mutex> lock(mu);
  auto& [run, next] = sequences[{op_id, partition_id}];
  if (run != run_id) {
    run = run_id;
    next = 0;
  }
  return next++;
}

ffi::Error RunCollective(std::string_view op, std::string_view what, const RoundKey& key, int64_t rank, int64_t size,
                         Published mine, std::chrono::milliseconds timeout,
                         const std::function<void(const std::vector<Published>&)>& body) {
  std::unique_lock<std::mutex> lock(mu);
  std::shared_ptr<Round>& slot = rounds[key];
  if (!slot) slot = std::make_shared<Round>(size);
  std::shared_ptr<Round> round = slot;
  if (static_cast<int64_t>(round->published.size()) != size || rank < 0 || rank >= size ||
      round->arrived[rank]) {
    return InvalidArgument(op, "rank " + std::to_string(rank) + " joined a group of size " +
                                   std::to_string(round->published.size()) + " twice or out of range");
  }
  round->published[rank] = mine;
  round->arrived[rank] = true;
  if (++round->num_arrived == size) cv.notify_all();
  NCCLX_RETURN_IF_ERROR(WaitForArrivals(lock, *round, op, what, timeout));

  lock.unlock();
  body(round->published);  // reads peers' buffers; they stay alive until everyone has departed
  lock.lock();

  if (++round->num_departed == size) {
    rounds.erase(key);
    cv.notify_all();
    return ffi::Error::Success();
  }
  // No timeout here: every peer is present and only copying, and leaving early would let XLA free buffers
  // that a peer still reads.
  cv.wait(lock, [&] { return round->num_departed == size; });
  return ffi::Error::Success();
}

}  // namespace jax_ncclx
