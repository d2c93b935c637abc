#pragma once
/// \file
/// Dispatch and combine over the ep group. The E experts are split evenly over the ep group's
/// ranks in order (rank r owns experts r·E/ep .. (r+1)·E/ep - 1), so rows permuted by expert
/// (permutation.hpp) are already grouped by destination rank.
///
///  - plan(rows per expert, row length): the counts are exchanged first
///    (communicator::exchange_counts of rows), so every rank learns how many rows each source
///    sends to each of its local experts, and the ranks' row shapes are compared there;
///  - dispatch(rows): one all_to_allv; received rows lie by source rank, then by local expert
///    (segment(source, e) says where), and are not copied again: the experts run one product per
///    segment;
///  - combine(rows): the inverse all_to_allv, back to the senders in their order.
///
/// At the default check level (agreement) the count exchange's call agreement stands for the
/// dispatch and combine that follow it directly: one agreement a layer's forward, not three
/// (communicator::all_to_allv with paired_counts). A backward's dispatch and combine, run later
/// with the same plan, agree on their calls as usual.
///
/// Any count may be zero: a rank that sends nothing, a rank or an expert that receives nothing.

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/error.hpp>

namespace weft::moe {

template <backend B>
class token_dispatcher {
 public:
  /// `experts`: E over the whole group (a multiple of the group's size).
  token_dispatcher(communicator<B>& ep, std::size_t experts) : ep_(ep.ref()), experts_(experts) {
    ranks_ = static_cast<std::size_t>(ep.size());
    if (experts_ == 0 || experts_ % ranks_ != 0)
      fail("weft::moe::token_dispatcher (group '" + ep.name() + "' of " + std::to_string(ranks_) + " ranks): " +
           std::to_string(experts_) + " experts do not divide over the ranks of the ep group; choose E a multiple of ep");
    local_ = experts_ / ranks_;
  }

  std::size_t local_experts() const noexcept { return local_; }
  /// The first (global) expert this rank owns.
  std::size_t first_expert() const { return static_cast<std::size_t>(ep_.get().rank()) * local_; }

  /// Exchanges the counts: `rows_per_expert` [E] is how many rows this rank sends to each expert;
  /// every row moved with this plan is `width` elements of T (the same on every rank).
  template <class T = float>
  void plan(std::span<const std::size_t> rows_per_expert, std::size_t width) {
    communicator<B>& ep = ep_.get();
    if (rows_per_expert.size() != experts_)
      fail("weft::moe::token_dispatcher::plan on group '" + ep.name() + "': " + std::to_string(rows_per_expert.size()) +
           " counts for " + std::to_string(experts_) + " experts");
    std::vector<std::int64_t> mine(rows_per_expert.begin(), rows_per_expert.end());
    received_.assign(experts_, 0);
    counts_ = ep.exchange_counts(mine, received_, dtype_of<T>, width);
    inverse_ = counts_.inverse();
    recv_rows_.assign(ranks_, 0);
    for (std::size_t r = 0; r < ranks_; ++r)
      for (std::size_t e = 0; e < local_; ++e) recv_rows_[r] += static_cast<std::size_t>(received_[r * local_ + e]);
    sent_ = std::accumulate(rows_per_expert.begin(), rows_per_expert.end(), std::size_t{0});
    received_total_ = std::accumulate(recv_rows_.begin(), recv_rows_.end(), std::size_t{0});
  }

  std::size_t rows_sent() const noexcept { return sent_; }
  std::size_t rows_received() const noexcept { return received_total_; }

  /// Where the rows from `source` for local expert `e` lie in the received buffer.
  struct segment {
    std::size_t first = 0, rows = 0;
  };
  segment received_segment(std::size_t source, std::size_t e) const {
    std::size_t first = 0;
    for (std::size_t r = 0; r < source; ++r) first += recv_rows_[r];
    for (std::size_t q = 0; q < e; ++q) first += static_cast<std::size_t>(received_[source * local_ + q]);
    return {first, static_cast<std::size_t>(received_[source * local_ + e])};
  }
  /// Rows for local expert `e` from every source.
  std::size_t received_for_expert(std::size_t e) const {
    std::size_t n = 0;
    for (std::size_t r = 0; r < ranks_; ++r) n += static_cast<std::size_t>(received_[r * local_ + e]);
    return n;
  }

  /// The row length the plan was made for.
  std::size_t width() const noexcept { return counts_.row_elements(); }

  /// rows [rows_sent(), width()], grouped by expert -> received [rows_received(), width()].
  template <class T>
  void dispatch(std::span<const T> rows, std::span<T> received) {
    ep_.get().all_to_allv(rows, received, counts_);
  }
  /// The inverse: rows [rows_received(), width()] as received -> returned [rows_sent(), width()].
  template <class T>
  void combine(std::span<const T> rows, std::span<T> returned) {
    ep_.get().all_to_allv(rows, returned, inverse_);
  }

 private:
  communicator_ref<B> ep_;
  std::size_t experts_ = 0, ranks_ = 1, local_ = 0;
  std::vector<std::int64_t> received_;  ///< [ep, local experts]: rows from each source for each local expert
  std::vector<std::size_t> recv_rows_;  ///< [ep]: rows from each source
  paired_counts counts_, inverse_;  ///< elements for and from each rank: dispatch's, combine's
  std::size_t sent_ = 0, received_total_ = 0;
};

}  // namespace weft::moe
