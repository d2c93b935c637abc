#pragma once
/// \file
/// The all-gather of strings a distributed save needs, over a weft communicator: the lengths
/// first, then every rank's text padded to the longest.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <weft/checkpoint/distributed.hpp>
#include <weft/comm/communicator.hpp>

namespace weft::checkpoint {

/// An exchange_function over `comm` (which must outlive it), for distributed_saver.
template <backend B>
exchange_function exchange_over(communicator<B>& comm) {
  return [ref = comm.ref()](std::string mine) {
    communicator<B>& group = ref.get();
    const auto ranks = static_cast<std::size_t>(group.size());
    std::vector<std::int64_t> length{static_cast<std::int64_t>(mine.size())};
    std::vector<std::int64_t> lengths(ranks);
    group.all_gather(length, lengths);
    const auto longest = static_cast<std::size_t>(*std::max_element(lengths.begin(), lengths.end()));
    std::vector<std::uint8_t> send(std::max<std::size_t>(longest, 1), 0);
    std::copy(mine.begin(), mine.end(), send.begin());
    std::vector<std::uint8_t> all(send.size() * ranks);
    group.all_gather(send, all);
    std::vector<std::string> texts;
    for (std::size_t r = 0; r < ranks; ++r) {
      const auto* begin = all.data() + r * send.size();
      texts.emplace_back(reinterpret_cast<const char*>(begin), static_cast<std::size_t>(lengths[r]));
    }
    return texts;
  };
}

}  // namespace weft::checkpoint
