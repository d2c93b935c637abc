#pragma once
/// \file
/// `weft::trace::flight_recorder`: the last N operations of one communicator (operation, dtype,
/// count, peer or root, sequence number, issue / start / end times, state), kept in a ring so
/// that a hung or failed job can say what every rank was doing. The communicator writes one entry
/// per operation at its single choke point; the backend's progress thread marks async operations
/// started and finished; the watchdog thread reads the ring to find operations past their
/// deadline and to write the dump (weft/trace/watchdog.hpp).
///
/// Cost: one entry is a handful of atomic stores (plain stores on x86) plus two reads of the coarse monotonic
/// clock (CLOCK_MONOTONIC_COARSE: a few nanoseconds, resolution one kernel tick, 1-4 ms), which is
/// plenty to tell a 10-minute hang from a 2-second one and cheap enough for the hot path
/// (docs/benchmarks.md measures it). The rolling fingerprint of the collectives issued so far
/// (operation, dtype, count, root, sequence) lets ranks compare their histories cheaply
/// (weft/trace/fingerprint.hpp).
///
/// Threads: one writer issues (the thread using the communicator); any thread may mark an entry
/// started, completed or failed; any thread may take a snapshot. Every field is an atomic, and a
/// reader checks the entry's sequence number before and after reading it, so a snapshot never
/// mixes two operations that shared a slot. Marking is atomic per slot: start/finish claim the
/// slot with a compare-and-swap on its tag (the sequence number and a busy bit), so an operation
/// issued into the slot meanwhile is never marked by its predecessor's completion; issue waits
/// for such a claim (two stores long) before it rewrites the slot.

#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <time.h>

#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/trace/fingerprint.hpp>
#include <weft/trace/operation.hpp>

namespace weft::trace {

/// Nanoseconds on the coarse monotonic clock (the recorder's clock).
inline std::int64_t monotonic_ns() noexcept {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

/// One operation as a snapshot sees it.
struct flight_record {
  std::uint64_t sequence = 0;  ///< 1, 2, ... per communicator, in issue order
  operation op = operation::all_reduce;
  dtype type = dtype::uint8;
  std::uint64_t count = 0;  ///< elements (per rank's block for all_gather / reduce_scatter / all_to_all; the group size for all_to_allv)
  int peer = -1;            ///< p2p peer or collective root (rank in the group); -1: none
  int reduction = -1;       ///< the reduce_op's value for reducing operations; -1: none
  op_state state = op_state::issued;
  std::int64_t issued_ns = 0;   ///< monotonic_ns() when the communicator issued it
  std::int64_t started_ns = 0;  ///< when it began to run (0: not yet)
  std::int64_t ended_ns = 0;    ///< when it completed or failed (0: not yet)
};

/// The most entries a recorder keeps: 65536 (48 bytes each: 3 MiB per communicator). The watchdog scans
/// the unfinished part of every ring on each poll, and a dump writes every entry, so the ring is
/// bounded where both stay in the milliseconds.
inline constexpr std::size_t max_flight_recorder_entries = std::size_t{1} << 16;

/// Entries kept per communicator: WEFT_FLIGHT_RECORDER_ENTRIES (rounded up to a power of two),
/// default 1024 (48 KiB), at most max_flight_recorder_entries.
inline std::size_t flight_recorder_capacity_from_environment() {
  constexpr std::size_t default_entries = 1024;
  const char* value = std::getenv("WEFT_FLIGHT_RECORDER_ENTRIES");
  if (value == nullptr || *value == '\0') return default_entries;
  char* end = nullptr;
  const unsigned long long parsed = std::strtoull(value, &end, 10);
  if (end == value || *end != '\0' || value[0] == '-' || parsed < 1 || parsed > max_flight_recorder_entries)
    throw error(std::string("weft: WEFT_FLIGHT_RECORDER_ENTRIES='") + value + "' is not a number of entries from 1 to " +
                std::to_string(max_flight_recorder_entries) + "; the default is 1024");
  return static_cast<std::size_t>(parsed);
}

class flight_recorder {
 public:
  /// `group`: the communicator's name; `rank`, `size`: this rank's place in it; `capacity`: how
  /// many operations the ring keeps; `timeout`: the deadline of each operation (0: none).
  /// @throws weft::error when `capacity` is above max_flight_recorder_entries.
  flight_recorder(std::string group, int rank, int size, std::size_t capacity = flight_recorder_capacity_from_environment(),
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(0))
      : group_(std::move(group)),
        rank_(rank),
        size_(size),
        capacity_(checked_capacity(capacity)),
        slot_mask_(capacity_ - 1),
        slots_(std::make_unique<slot[]>(capacity_)),
        timeout_ms_(timeout.count()) {}

  flight_recorder(const flight_recorder&) = delete;
  flight_recorder& operator=(const flight_recorder&) = delete;

  const std::string& group() const noexcept { return group_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return capacity_; }

  std::chrono::milliseconds timeout() const noexcept {
    return std::chrono::milliseconds(timeout_ms_.load(std::memory_order_relaxed));
  }
  void set_timeout(std::chrono::milliseconds timeout) noexcept {
    timeout_ms_.store(timeout.count(), std::memory_order_relaxed);
  }

  /// World ranks of the group's members, in group order, when the backend can tell (empty: unknown).
  void set_members(std::vector<int> world_ranks) { members_ = std::move(world_ranks); }
  const std::vector<int>& members() const noexcept { return members_; }

  /// Records a new operation (called by the one thread using the communicator) and returns its
  /// sequence number. Collectives also enter the rolling fingerprint. `started`: the operation
  /// runs from now on (blocking calls), which saves a second read of the clock.
  std::uint64_t issue(operation op, dtype type, std::uint64_t count, int peer, int reduction = -1,
                      bool started = false) noexcept {
    const std::uint64_t sequence = issued_.load(std::memory_order_relaxed) + 1;
    slot& s = slots_[sequence & slot_mask_];
    // Take the slot from its previous operation: wait out a start/finish that holds it (a few
    // stores), then tag it 0, so that marks of the previous operation no longer match. Readers
    // skip the slot while it changes. The field stores are releases (plain stores on x86) rather
    // than relaxed stores behind a fence: a reader that sees any new field then also sees this 0
    // when it checks the tag again, and ThreadSanitizer understands it.
    std::uint64_t tag = s.tag.load(std::memory_order_relaxed);
    while ((tag & busy_bit) != 0 || !s.tag.compare_exchange_weak(tag, 0, std::memory_order_acquire, std::memory_order_relaxed))
      if ((tag & busy_bit) != 0) tag = s.tag.load(std::memory_order_relaxed);
    s.op.store(static_cast<std::uint8_t>(op), std::memory_order_release);
    s.type.store(static_cast<std::uint8_t>(type), std::memory_order_release);
    s.state.store(static_cast<std::uint8_t>(started ? op_state::started : op_state::issued), std::memory_order_release);
    s.count.store(count, std::memory_order_release);
    s.peer.store(peer, std::memory_order_release);
    s.reduction.store(static_cast<std::int8_t>(reduction), std::memory_order_release);
    const std::int64_t now = monotonic_ns();
    s.issued_ns.store(now, std::memory_order_release);
    s.started_ns.store(started ? now : 0, std::memory_order_release);
    s.ended_ns.store(0, std::memory_order_release);
    s.tag.store(sequence << 1, std::memory_order_release);
    issued_.store(sequence, std::memory_order_release);
    if (is_collective(op)) {
      const std::uint64_t collectives = collectives_.load(std::memory_order_relaxed) + 1;
      collectives_.store(collectives, std::memory_order_relaxed);
      fingerprint_.store(fold_call(fingerprint_.load(std::memory_order_relaxed), op, type, count, reduction, peer, collectives),
                         std::memory_order_relaxed);
    }
    return sequence;
  }

  /// The operation began to run (async operations: when the progress thread takes it up).
  void start(std::uint64_t sequence) noexcept {
    if (slot* s = claim_slot(sequence)) {
      s->started_ns.store(monotonic_ns(), std::memory_order_release);
      s->state.store(static_cast<std::uint8_t>(op_state::started), std::memory_order_release);
      release_slot(*s, sequence);
    }
  }
  /// The operation finished: `ok` false when it failed.
  void finish(std::uint64_t sequence, bool ok = true) noexcept {
    if (slot* s = claim_slot(sequence)) {
      const std::int64_t now = monotonic_ns();
      if (s->started_ns.load(std::memory_order_relaxed) == 0) s->started_ns.store(now, std::memory_order_release);
      s->ended_ns.store(now, std::memory_order_release);
      s->state.store(static_cast<std::uint8_t>(ok ? op_state::completed : op_state::failed),
                     std::memory_order_release);
      release_slot(*s, sequence);
    }
  }

  /// The backend will not report this async operation's completion: no deadline applies to it.
  void untracked(std::uint64_t sequence) noexcept {
    if (slot* s = claim_slot(sequence)) {
      s->state.store(static_cast<std::uint8_t>(op_state::untracked), std::memory_order_release);
      release_slot(*s, sequence);
    }
  }

  /// Hands an async operation's sequence number to the backend that runs it: the communicator
  /// offers it just before calling the backend, a backend that reports completion claims it
  /// (0: nothing offered). Only the thread using the communicator calls these.
  void offer(std::uint64_t sequence) noexcept { offered_ = sequence; }
  std::uint64_t claim() noexcept { return std::exchange(offered_, 0); }

  /// Operations issued so far (the newest sequence number).
  std::uint64_t issued() const noexcept { return issued_.load(std::memory_order_acquire); }
  /// Collectives issued so far, and the rolling fingerprint over them.
  std::uint64_t collectives() const noexcept { return collectives_.load(std::memory_order_relaxed); }
  std::uint64_t fingerprint() const noexcept { return fingerprint_.load(std::memory_order_relaxed); }

  /// The entries still in the ring, oldest first.
  std::vector<flight_record> snapshot() const {
    std::vector<flight_record> records;
    const std::uint64_t newest = issued();
    const std::uint64_t oldest = newest > capacity_ ? newest - capacity_ + 1 : 1;
    records.reserve(static_cast<std::size_t>(newest - oldest + 1));
    for (std::uint64_t sequence = oldest; sequence <= newest && sequence != 0; ++sequence) {
      if (auto record = read(sequence)) records.push_back(*record);
    }
    return records;
  }

  /// The oldest operation that has not finished (issued or started), if any is still in the ring.
  std::optional<flight_record> oldest_unfinished() const {
    const std::uint64_t newest = issued();
    const std::uint64_t oldest = newest > capacity_ ? newest - capacity_ + 1 : 1;
    for (std::uint64_t sequence = oldest; sequence <= newest && sequence != 0; ++sequence) {
      const slot& s = slots_[sequence & slot_mask_];
      const auto state = static_cast<op_state>(s.state.load(std::memory_order_acquire));
      if (state == op_state::completed || state == op_state::failed) continue;
      if (auto record = read(sequence); record && !finished(record->state)) return record;
    }
    return std::nullopt;
  }

  /// The entry of `sequence`, if it is still in the ring.
  std::optional<flight_record> read(std::uint64_t sequence) const noexcept {
    if (sequence == 0) return std::nullopt;  // no operation; tag 0 is a slot being rewritten
    const slot& s = slots_[sequence & slot_mask_];
    std::uint64_t tag = s.tag.load(std::memory_order_acquire);
    // A start/finish holds the slot for two stores: wait it out rather than drop the entry.
    for (int spins = 0; tag == ((sequence << 1) | busy_bit) && spins < 1000; ++spins) tag = s.tag.load(std::memory_order_acquire);
    if (tag != sequence << 1) return std::nullopt;
    flight_record r;
    r.sequence = sequence;
    r.op = static_cast<operation>(s.op.load(std::memory_order_acquire));
    r.type = static_cast<dtype>(s.type.load(std::memory_order_acquire));
    r.count = s.count.load(std::memory_order_acquire);
    r.peer = s.peer.load(std::memory_order_acquire);
    r.reduction = s.reduction.load(std::memory_order_acquire);
    r.state = static_cast<op_state>(s.state.load(std::memory_order_acquire));
    r.issued_ns = s.issued_ns.load(std::memory_order_acquire);
    r.started_ns = s.started_ns.load(std::memory_order_acquire);
    r.ended_ns = s.ended_ns.load(std::memory_order_acquire);
    // The loads above are acquires, so this check cannot move before them.
    if (s.tag.load(std::memory_order_relaxed) != tag) return std::nullopt;  // marked or reused meanwhile
    return r;
  }

 private:
  /// A slot's tag: its operation's sequence number shifted left by one, with this bit set while a
  /// start/finish/untracked call marks it; 0 while empty or being rewritten by issue().
  static constexpr std::uint64_t busy_bit = 1;

  struct slot {
    std::atomic<std::uint64_t> tag{0};
    std::atomic<std::uint8_t> op{0};
    std::atomic<std::uint8_t> type{0};
    std::atomic<std::uint8_t> state{0};
    std::atomic<std::int8_t> reduction{-1};
    std::atomic<std::int32_t> peer{-1};
    std::atomic<std::uint64_t> count{0};
    std::atomic<std::int64_t> issued_ns{0};
    std::atomic<std::int64_t> started_ns{0};
    std::atomic<std::int64_t> ended_ns{0};
  };

  static std::size_t checked_capacity(std::size_t capacity) {
    if (capacity > max_flight_recorder_entries)
      throw error("weft: a flight recorder of " + std::to_string(capacity) + " entries is more than the limit of " +
                  std::to_string(max_flight_recorder_entries) + "; ask for fewer (WEFT_FLIGHT_RECORDER_ENTRIES)");
    return std::bit_ceil(capacity < 1 ? std::size_t{1} : capacity);
  }

  /// Takes the slot of `sequence` for marking, or null when another operation holds it now. The
  /// compare-and-swap both checks the sequence and keeps issue() from reusing the slot until
  /// release_slot(): the check and the stores cannot be split by a reuse.
  slot* claim_slot(std::uint64_t sequence) noexcept {
    if (sequence == 0) return nullptr;  // no operation; tag 0 is a slot being rewritten
    slot& s = slots_[sequence & slot_mask_];
    const std::uint64_t mine = sequence << 1;
    for (;;) {
      std::uint64_t expected = mine;
      if (s.tag.compare_exchange_weak(expected, mine | busy_bit, std::memory_order_acquire, std::memory_order_relaxed))
        return &s;
      if (expected != mine && expected != (mine | busy_bit)) return nullptr;  // reused (or never ours)
      // Another thread marks the same operation (start racing finish): wait for it.
    }
  }
  static void release_slot(slot& s, std::uint64_t sequence) noexcept { s.tag.store(sequence << 1, std::memory_order_release); }

  std::string group_;
  int rank_;
  int size_;
  std::size_t capacity_;  ///< a power of two: the slot is the sequence's low bits, no division per call
  std::uint64_t slot_mask_;
  std::unique_ptr<slot[]> slots_;
  std::atomic<std::int64_t> timeout_ms_;
  std::vector<int> members_;
  std::atomic<std::uint64_t> issued_{0};
  std::uint64_t offered_ = 0;
  std::atomic<std::uint64_t> collectives_{0};
  std::atomic<std::uint64_t> fingerprint_{fingerprint_seed};
};

}  // namespace weft::trace
