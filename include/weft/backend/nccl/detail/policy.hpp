#pragma once
/// \file
/// The NCCL backend's decisions that need no GPU, as plain functions of their inputs (so they are
/// unit-tested on any machine): the wait deadline from the environment, whether a scaling factor
/// can be folded into a reduction of a given element type, and the text of the errors for a
/// timed-out operation and for two ranks on one GPU. No NCCL or CUDA header is needed here.

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/core/float16.hpp>
#include <weft/core/timeout.hpp>

namespace weft::detail::nccl {

// ---- deadline --------------------------------------------------------------------------------

/// The deadline given the values of WEFT_COMM_TIMEOUT and of its deprecated alias
/// WEFT_NCCL_TIMEOUT (null or empty: unset). WEFT_COMM_TIMEOUT wins; neither: 10 minutes.
inline std::chrono::milliseconds timeout_from(const char* comm_timeout, const char* nccl_timeout) {
  if (comm_timeout != nullptr && *comm_timeout != '\0') return parse_comm_timeout(comm_timeout, "WEFT_COMM_TIMEOUT");
  if (nccl_timeout != nullptr && *nccl_timeout != '\0')
    return parse_comm_timeout(nccl_timeout, "WEFT_NCCL_TIMEOUT");
  return default_comm_timeout;
}

/// The deadline from the environment (see timeout_from); says once that WEFT_NCCL_TIMEOUT is deprecated.
inline std::chrono::milliseconds timeout_from_environment() {
  const char* comm_timeout = std::getenv("WEFT_COMM_TIMEOUT");
  const char* nccl_timeout = std::getenv("WEFT_NCCL_TIMEOUT");
  if (nccl_timeout != nullptr && *nccl_timeout != '\0') {
    static const bool warned = [] {
      std::fprintf(stderr, "weft: WEFT_NCCL_TIMEOUT is deprecated; use WEFT_COMM_TIMEOUT (seconds, 0: none)\n");
      return true;
    }();
    (void)warned;
  }
  return timeout_from(comm_timeout, nccl_timeout);
}

/// "600 s", "0.2 s": a duration for messages.
inline std::string seconds_text(std::chrono::milliseconds d) {
  char buffer[48];
  std::snprintf(buffer, sizeof(buffer), "%.1f s", static_cast<double>(d.count()) / 1000.0);
  return buffer;
}

/// Who is waiting, for messages.
struct wait_site {
  int rank = 0;
  int size = 0;
  int device = -1;
  std::string host;
  std::string group;  ///< the communicator's name; empty when unknown
};

/// "rank 3 of 8 on host n7 (CUDA device 3), group 'dp'".
inline std::string describe(const wait_site& s) {
  std::string text = "rank " + std::to_string(s.rank) + " of " + std::to_string(s.size) + " on host " + s.host +
                     " (CUDA device " + std::to_string(s.device) + ")";
  text += s.group.empty() ? ", unnamed group" : ", group '" + s.group + "'";
  return text;
}

/// The error for an operation that passed its deadline (the communicator has been aborted by then).
inline std::string timeout_message(const wait_site& s, std::string_view operation, std::chrono::milliseconds waited,
                                   std::chrono::milliseconds limit) {
  return "weft: NCCL " + describe(s) + ": " + std::string(operation) + " did not complete within the deadline of " +
         seconds_text(limit) + " (waited " + seconds_text(waited) +
         "; WEFT_COMM_TIMEOUT, or set_timeout()): a peer is stopped, stuck, or waiting in a different operation. "
         "The communicator was aborted (its kernels stopped); every rank must build a new one";
}

// ---- scaling factors folded into a reduction -------------------------------------------------

/// What folding `factor` into a reduction of one element type would do.
struct scale_fold {
  bool fold = false;          ///< the factor is applied accurately enough inside the reduction
  double stored = 0;          ///< the factor as the element type holds it
  double relative_error = 0;  ///< |stored - factor| / |factor|
  bool subnormal = false;     ///< stored is a subnormal number of the type (precision lost)
};

/// The largest relative error of a folded factor accepted for `type`: about one rounding of a
/// 16-bit type (half: 2^-11, bfloat16: 2^-8), a few ulps for float and double.
inline double fold_tolerance(dtype type) {
  switch (type) {
    case dtype::float16: return 0x1p-11;
    case dtype::bfloat16: return 0x1p-8;
    case dtype::float32: return 0x1p-22;
    case dtype::float64: return 0x1p-50;
    default: return 0.0;
  }
}

/// Whether `factor` can be folded into a sum of `type` (NCCL's pre-multiplied sum converts it to
/// the element type): it must be finite, not subnormal, and held within fold_tolerance(type).
/// Only floating-point types can be scaled at all.
inline scale_fold fold_scale_factor(double factor, dtype type) {
  scale_fold r;
  double min_normal = 0;
  switch (type) {
    case dtype::float16:
      r.stored = static_cast<double>(static_cast<float>(half(static_cast<float>(factor))));
      min_normal = 0x1p-14;
      break;
    case dtype::bfloat16:
      r.stored = static_cast<double>(static_cast<float>(bfloat16(static_cast<float>(factor))));
      min_normal = 0x1p-126;
      break;
    case dtype::float32:
      r.stored = static_cast<double>(static_cast<float>(factor));
      min_normal = static_cast<double>(std::numeric_limits<float>::min());
      break;
    case dtype::float64:
      r.stored = factor;
      min_normal = std::numeric_limits<double>::min();
      break;
    default: return r;
  }
  if (!std::isfinite(factor) || !std::isfinite(r.stored)) {
    r.relative_error = std::numeric_limits<double>::infinity();
    return r;
  }
  if (factor == 0.0) {
    r.fold = true;
    return r;
  }
  r.relative_error = std::abs(r.stored - factor) / std::abs(factor);
  r.subnormal = std::abs(r.stored) < min_normal;
  r.fold = !r.subnormal && r.relative_error <= fold_tolerance(type);
  return r;
}

/// Why a factor is refused for a scaled sum of `type`, with the ways out.
inline std::string unfoldable_factor_message(double factor, dtype type, const scale_fold& r) {
  char numbers[160];
  std::snprintf(numbers, sizeof(numbers), "%.6g becomes %.6g (relative error %.3g%s)", factor, r.stored,
                r.relative_error, r.subnormal ? ", a subnormal number" : "");
  return "NCCL scaled sum: the factor " + std::string(numbers) + " in " + std::string(to_string(type)) +
         ", the element type the reduction applies it in; folding it would scale the gradients wrongly (zero "
         "below 2^-25 in float16). Reduce in float (synchronizer<B, float>, or a float buffer), or reduce a plain "
         "sum and apply the factor in float yourself (scaling::sum, then multiply in the optimizer step)";
}

// ---- one-rank scaled reductions -----------------------------------------------------------

/// The first NCCL release (2.29.7, as ncclGetVersion's code) that writes every element of a
/// one-rank scaled reduction.
inline constexpr int nccl_one_rank_tail_fixed = 22907;

/// How many of `n` elements NCCL writes when a communicator of one rank reduces with a scaling
/// operator (avg or a pre-multiplied sum of a floating type), given ncclGetVersion's code. Before
/// 2.29.7 its kernel gives each of min(32, ceil(n·size / 16 KiB)) blocks alignUp(n / blocks,
/// 16 / size) elements, counted from the start, and when those add up to fewer than n the last
/// ones are left unwritten (4099 doubles in 3 blocks of 1366: element 4098). From 2.29.7 it writes
/// all n. Pure, so the backend can reduce the missed tail with a call of its own.
constexpr std::size_t one_rank_scaled_written(std::size_t n, std::size_t element_size, int nccl_version) noexcept {
  if (nccl_version >= nccl_one_rank_tail_fixed || n == 0 || element_size == 0 || element_size > 16) return n;
  const std::size_t per_pack = 16 / element_size;
  const std::size_t bytes = n * element_size;
  std::size_t blocks = (bytes + (16u << 10) - 1) / (16u << 10);
  if (blocks > 32) blocks = 32;
  const std::size_t per_block = (n / blocks + per_pack - 1) / per_pack * per_pack;
  const std::size_t written = blocks * per_block;
  return written < n ? written : n;
}

// ---- two ranks on one GPU --------------------------------------------------------------------

/// Whether NCCL's error text is its duplicate-GPU check (two ranks of a communicator on one GPU).
inline bool is_duplicate_gpu(std::string_view nccl_text) {
  return nccl_text.find("Duplicate GPU") != std::string_view::npos ||
         nccl_text.find("duplicate GPU") != std::string_view::npos;
}

/// The two ranks NCCL names in "... rank A and rank B both on CUDA device ...", if it does.
inline std::optional<std::pair<int, int>> duplicate_gpu_ranks(std::string_view nccl_text) {
  const std::size_t first = nccl_text.find("rank ");
  if (first == std::string_view::npos) return std::nullopt;
  const std::size_t second = nccl_text.find("and rank ", first);
  if (second == std::string_view::npos) return std::nullopt;
  const std::string text(nccl_text);
  char* end = nullptr;
  const long a = std::strtol(text.c_str() + first + 5, &end, 10);
  if (end == text.c_str() + first + 5) return std::nullopt;
  const long b = std::strtol(text.c_str() + second + 9, &end, 10);
  if (end == text.c_str() + second + 9) return std::nullopt;
  return std::pair<int, int>(static_cast<int>(a), static_cast<int>(b));
}

/// The error for two ranks of one communicator on one GPU (NCCL says only "Duplicate GPU").
inline std::string duplicate_gpu_message(int rank, int ranks, std::string_view host, std::string_view bus_id,
                                         std::string_view nccl_text) {
  std::string who;
  if (auto pair = duplicate_gpu_ranks(nccl_text))
    who = "ranks " + std::to_string(pair->first) + " and " + std::to_string(pair->second);
  else
    who = "rank " + std::to_string(rank) + " and another rank";
  return "joining an NCCL communicator as rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
         " failed: " + who + " are on the same GPU (PCI bus id " + std::string(bus_id) + ") on host " +
         std::string(host) +
         ", and NCCL allows one rank per GPU in a communicator. Give each rank a GPU of its own "
         "(CUDA_VISIBLE_DEVICES, one rank per GPU per node); to run two processes on one GPU on purpose (tests), "
         "give each a distinct NCCL_HOSTID (e.g. NCCL_HOSTID=$(hostname)-$OMPI_COMM_WORLD_RANK), so NCCL "
         "treats them as on different hosts";
}

}  // namespace weft::detail::nccl
