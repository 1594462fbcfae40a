// Implementation of the CPU rendezvous: one global table of rounds guarded by a mutex, a thread that warns
// about and then fails the rounds whose peers are late, and a pool of threads that complete the waiting
// participants' futures.
// Collectives on the CPU backend are for development and CI, so clarity wins over lock-free speed here.
#include "common/rendezvous.h"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "common/checks.h"
#include "common/monitor.h"

namespace jax_ncclx {
namespace {

using Clock = std::chrono::steady_clock;

struct Round;

// One waiting participant's timeout, watched by the reaper thread.
struct Deadline {
  Round* round;  // the entry is erased before its round is freed
  int64_t rank;
  std::string op, what;
  std::chrono::milliseconds timeout;
};
using Deadlines = std::multimap<Clock::time_point, Deadline>;

// A round's late-peer warning, due `warn_after` after its first participant began to wait.
struct Warning {
  Round* round;  // the entry is erased before its round is freed
  std::string op, what;
  std::chrono::milliseconds warn_after, timeout;
};
using Warnings = std::multimap<Clock::time_point, Warning>;

struct Round {
  explicit Round(int64_t size) : published(size), work(size), waiting(size), deadlines(size), arrived(size, false) {}
  std::vector<Published> published;
  std::vector<CollectiveWork> work;
  std::vector<std::optional<ffi::Promise>> waiting;  // the futures of the participants that returned pending
  std::vector<std::optional<Deadlines::iterator>> deadlines;  // their entries in State::deadlines
  std::optional<Warnings::iterator> warning;                  // its entry in State::warnings, until due
  std::vector<bool> arrived;
  int64_t num_arrived = 0;
  bool abandoned = false;  // a participant gave up waiting for arrivals; everyone else fails too
  std::string missing;     // the ranks it gave up on, for everyone else's error
  std::string waited;      // its timeout in seconds, for the same
};

// Never destroyed: detached threads use them until the process exits.
struct State {
  std::mutex mu;
  std::map<RoundKey, std::shared_ptr<Round>> rounds;
  std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>> sequences;  // (op, partition) -> (run, next)
  Deadlines deadlines;
  Warnings warnings;
  std::condition_variable deadlines_changed;  // or warnings
  bool reaper_started = false;

  std::mutex completions_mu;
  std::condition_variable completions_ready;
  std::deque<std::pair<ffi::Promise, ffi::Error>> completions;
  int64_t idle_completers = 0;
};

State& GetState() {
  static State* state = new State();
  return *state;
}

std::string MissingRanks(const std::vector<bool>& present) {
  std::string out;
  for (size_t r = 0; r < present.size(); ++r) {
    if (!present[r]) out += (out.empty() ? "" : ", ") + std::to_string(r);
  }
  return out;
}

ffi::Error AbandonedError(std::string_view op, std::string_view what, const Round& round) {
  // Named as the peer that timed out saw them: a late rank that arrives afterwards is no longer missing.
  return DeadlineExceeded(op, std::string(what) + ": abandoned because a peer timed out after " + round.waited +
                                  " s waiting for rank(s) " + round.missing + " (" + std::string(kTimeoutSettings) +
                                  ")");
}

// Completes `promise` on a pool thread: completing a future runs XLA's continuation of that device's program
// on the completing thread, which may then block in one of XLA's own collectives, so neither the arriving
// participant's thread nor the reaper may do it. A pool thread is added whenever none is idle.
void CompleteLater(ffi::Promise promise, ffi::Error error) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.completions_mu);
  state.completions.emplace_back(std::move(promise), std::move(error));
  if (state.idle_completers > 0) {
    --state.idle_completers;
    state.completions_ready.notify_one();
    return;
  }
  std::thread([] {
    State& state = GetState();
    std::unique_lock<std::mutex> lock(state.completions_mu);
    for (;;) {
      while (!state.completions.empty()) {
        auto [promise, error] = std::move(state.completions.front());
        state.completions.pop_front();
        lock.unlock();
        if (error.success()) {
          promise.SetAvailable();
        } else {
          promise.SetError(std::move(error));
        }
        lock.lock();
      }
      ++state.idle_completers;
      state.completions_ready.wait(lock, [&] { return !state.completions.empty(); });
    }
  }).detach();
}

// Erases the timeouts of `round`'s waiting participants and its warning. Called with state.mu held.
void ForgetDeadlines(State& state, Round& round) {
  for (std::optional<Deadlines::iterator>& entry : round.deadlines) {
    if (entry) state.deadlines.erase(*entry);
    entry.reset();
  }
  if (round.warning) state.warnings.erase(*round.warning);
  round.warning.reset();
}

// Prints the warning of a round whose peers are late: once, on stderr (the process's log, as XLA's own
// warnings about a stuck rendezvous), naming the call and the ranks still missing. Called with state.mu held.
void WarnLate(State& state, const Warning& due) {
  Round& round = *due.round;
  state.warnings.erase(*round.warning);
  round.warning.reset();
  const std::string waiting = due.timeout.count() > 0
                                  ? "until the timeout of " + DescribeSeconds(due.timeout.count() * 1000000) + " (" +
                                        std::string(kTimeoutSettings) + "; "
                                  : "with no timeout (JAX_NCCLX_TIMEOUT_S=0; ";
  const std::string message = due.op + ": " + due.what + ": rank(s) " + MissingRanks(round.arrived) + " of " +
                              std::to_string(round.arrived.size()) + " have not arrived after " +
                              DescribeSeconds(due.warn_after.count() * 1000000) + "; still waiting, " + waiting +
                              "JAX_NCCLX_WARN_AFTER_S sets when this is printed)";
  std::fprintf(stderr, "jax_ncclx: warning: %s\n", message.c_str());
  std::fflush(stderr);
}

// Fails every participant of `round` that is waiting; the one whose timeout expired names the missing ranks,
// the others say that a peer gave up. Called with state.mu held.
void Abandon(State& state, Round& round, const Deadline& expired) {
  ForgetDeadlines(state, round);
  round.abandoned = true;
  round.missing = MissingRanks(round.arrived);
  char seconds[32];  // snprintf, not an ostream: the module's own libstdc++ locale is not set up
  std::snprintf(seconds, sizeof(seconds), "%g", expired.timeout.count() / 1000.0);
  round.waited = seconds;
  for (size_t r = 0; r < round.waiting.size(); ++r) {
    if (!round.waiting[r]) continue;
    ffi::Error error = static_cast<int64_t>(r) == expired.rank
                           ? DeadlineExceeded(expired.op, expired.what + ": rank(s) " + round.missing +
                                                              " did not arrive within " + seconds + " s (" +
                                                              std::string(kTimeoutSettings) + ")")
                           : AbandonedError(expired.op, expired.what, round);
    round.work[r]({});
    CompleteLater(std::move(*round.waiting[r]), std::move(error));
    round.waiting[r].reset();
  }
  round.work.assign(round.work.size(), nullptr);
}

// Warns about the rounds whose peers are late past the grace, and fails those whose participants waited past
// their timeout. An abandoned round stays in the table, so that a rank arriving late learns why.
void RunReaper() {
  State& state = GetState();
  std::unique_lock<std::mutex> lock(state.mu);
  for (;;) {
    if (state.deadlines.empty() && state.warnings.empty()) {
      state.deadlines_changed.wait(lock);
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (!state.warnings.empty() && state.warnings.begin()->first <= now) {
      const Warning due = state.warnings.begin()->second;
      WarnLate(state, due);  // erases the entry
      continue;
    }
    if (!state.deadlines.empty() && state.deadlines.begin()->first <= now) {
      const Deadline expired = state.deadlines.begin()->second;
      Abandon(state, *expired.round, expired);  // erases the entry with the round's other timeouts
      continue;
    }
    Clock::time_point next = Clock::time_point::max();
    if (!state.deadlines.empty()) next = state.deadlines.begin()->first;
    if (!state.warnings.empty()) next = std::min(next, state.warnings.begin()->first);
    state.deadlines_changed.wait_until(lock, next);
  }
}

}  // namespace

bool RoundKey::operator<(const RoundKey& other) const {
  return std::tie(op_id, group_idx, run_id, sequence) <
         std::tie(other.op_id, other.group_idx, other.run_id, other.sequence);
}

int64_t RendezvousSequence(int64_t op_id, int64_t partition_id, int64_t run_id) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mu);
  auto& [run, next] = state.sequences[{op_id, partition_id}];
  if (run != run_id) {
    run = run_id;
    next = 0;
  }
  return next++;
}

ffi::Future CompletedFuture(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(std::move(error));
  }
  return future;
}

ffi::Future JoinCollective(std::string_view op, std::string what, const RoundKey& key, int64_t rank, int64_t size,
                           Published mine, std::chrono::milliseconds timeout, std::chrono::milliseconds warn_after,
                           CollectiveWork work) {
  State& state = GetState();
  std::unique_lock<std::mutex> lock(state.mu);
  std::shared_ptr<Round>& slot = state.rounds[key];
  if (!slot) slot = std::make_shared<Round>(size);
  std::shared_ptr<Round> round = slot;
  if (static_cast<int64_t>(round->published.size()) != size || rank < 0 || rank >= size || round->arrived[rank]) {
    return CompletedFuture(InvalidArgument(op, "rank " + std::to_string(rank) + " joined a group of size " +
                                                   std::to_string(round->published.size()) + " twice or out of range"));
  }
  round->arrived[rank] = true;
  ++round->num_arrived;
  if (round->abandoned) {
    work({});
    return CompletedFuture(AbandonedError(op, what, *round));
  }
  round->published[rank] = mine;
  round->work[rank] = std::move(work);

  if (round->num_arrived < size) {
    ffi::Promise promise;
    ffi::Future future(promise);
    round->waiting[rank] = std::move(promise);
    // The first to wait schedules the round's warning, if it comes before the timeout.
    const bool warn = round->num_arrived == 1 && warn_after.count() > 0 &&
                      (timeout.count() == 0 || warn_after < timeout);
    if (timeout.count() > 0 || warn) {
      if (!state.reaper_started) {
        state.reaper_started = true;
        std::thread(RunReaper).detach();
      }
      const Clock::time_point now = Clock::now();
      if (warn) {
        round->warning = state.warnings.emplace(now + warn_after,
                                                Warning{round.get(), std::string(op), what, warn_after, timeout});
      }
      if (timeout.count() > 0) {
        round->deadlines[rank] = state.deadlines.emplace(now + timeout, Deadline{round.get(), rank, std::string(op),
                                                                                 std::move(what), timeout});
      }
      state.deadlines_changed.notify_one();
    }
    return future;
  }

  // The last to arrive: every operand is published and stays alive until its owner's future completes. With
  // the round out of the table and its timeouts erased, nobody else touches it.
  state.rounds.erase(key);
  ForgetDeadlines(state, *round);
  lock.unlock();
  std::vector<ffi::Error> errors(size);
  for (int64_t r = 0; r < size; ++r) errors[r] = round->work[r](round->published);
  for (int64_t r = 0; r < size; ++r) {
    if (round->waiting[r]) CompleteLater(std::move(*round->waiting[r]), std::move(errors[r]));
  }
  return CompletedFuture(std::move(errors[rank]));
}

}  // namespace jax_ncclx
