// The NCCL backend's decisions that need no GPU (and no NCCL): the deadline from the environment,
// which scaling factors may be folded into a reduction of which element type, and the messages
// for a timed-out operation and for two ranks on one GPU; the elements an older NCCL leaves
// unwritten in a one-rank scaled reduction; and, with a stand-in backend that keeps its own
// deadline as NCCL does, that weft::communicator keeps that deadline equal to its own.
#include <catch2/catch.hpp>

#include <weft/backend/backend.hpp>
#include <weft/backend/nccl/detail/policy.hpp>
#include <weft/comm/communicator.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>

using Catch::Contains;
using weft::dtype;
using namespace weft::detail::nccl;
using std::chrono::milliseconds;

TEST_CASE("the deadline: WEFT_COMM_TIMEOUT, then the deprecated WEFT_NCCL_TIMEOUT, else 10 minutes", "[nccl][policy]") {
  CHECK(timeout_from(nullptr, nullptr) == milliseconds(600000));
  CHECK(timeout_from("", "") == milliseconds(600000));
  CHECK(timeout_from("2.5", nullptr) == milliseconds(2500));
  CHECK(timeout_from(nullptr, "30") == milliseconds(30000));
  CHECK(timeout_from("5", "30") == milliseconds(5000));  // the new name wins
  CHECK(timeout_from("0", nullptr) == milliseconds(0));  // no deadline
  CHECK(timeout_from(nullptr, "0") == milliseconds(0));
  CHECK_THROWS_WITH(timeout_from("soon", nullptr), Contains("WEFT_COMM_TIMEOUT='soon' is not a number of seconds"));
  CHECK_THROWS_WITH(timeout_from(nullptr, "-1"), Contains("WEFT_NCCL_TIMEOUT='-1'"));
}

TEST_CASE("fp16 cannot hold token-count factors: they are not folded into the reduction", "[nccl][policy]") {
  // 1/4M tokens: a subnormal half, about 5 % off.
  const scale_fold four_million = fold_scale_factor(1.0 / 4e6, dtype::float16);
  CHECK_FALSE(four_million.fold);
  CHECK(four_million.subnormal);
  CHECK(four_million.relative_error > 0.04);
  // 1/33.5M tokens: one unit of the last place, twice the factor.
  const scale_fold many = fold_scale_factor(1.0 / 33.5e6, dtype::float16);
  CHECK_FALSE(many.fold);
  CHECK(many.relative_error > 0.5);
  // 2^-25 (and anything below): zero in half, every gradient would be zero.
  const scale_fold tiny = fold_scale_factor(std::ldexp(1.0, -25), dtype::float16);
  CHECK_FALSE(tiny.fold);
  CHECK(tiny.stored == 0.0);
  CHECK_FALSE(fold_scale_factor(1.0 / 40e6, dtype::float16).fold);
  // Exact but subnormal: refused too (products with it lose precision).
  CHECK_FALSE(fold_scale_factor(std::ldexp(1.0, -20), dtype::float16).fold);
  // Too large for half.
  CHECK_FALSE(fold_scale_factor(1e6, dtype::float16).fold);
}

TEST_CASE("1/dp and other ordinary factors fold in every floating type", "[nccl][policy]") {
  for (int dp = 1; dp <= 16384; ++dp) {
    INFO("dp " << dp);
    const scale_fold h = fold_scale_factor(1.0 / dp, dtype::float16);
    CHECK(h.fold);
    CHECK(h.relative_error <= 0x1p-11);
    CHECK(fold_scale_factor(1.0 / dp, dtype::bfloat16).fold);
    CHECK(fold_scale_factor(1.0 / dp, dtype::float32).fold);
    CHECK(fold_scale_factor(1.0 / dp, dtype::float64).fold);
  }
  CHECK(fold_scale_factor(1.0, dtype::float16).fold);
  CHECK(fold_scale_factor(0.0, dtype::float16).fold);
}

TEST_CASE("bfloat16, float and double hold token-count factors", "[nccl][policy]") {
  for (double f : {1.0 / 4e6, 1.0 / 33.5e6, std::ldexp(1.0, -25), 1.0 / 1e9}) {
    INFO("factor " << f);
    CHECK(fold_scale_factor(f, dtype::bfloat16).fold);
    CHECK(fold_scale_factor(f, dtype::float32).fold);
    CHECK(fold_scale_factor(f, dtype::float64).fold);
  }
  CHECK_FALSE(fold_scale_factor(1.0, dtype::int32).fold);  // only floating types are scaled
  CHECK_FALSE(fold_scale_factor(std::nan(""), dtype::float32).fold);
}

TEST_CASE("the refusal of an unfoldable factor says what and what to do", "[nccl][policy]") {
  const double f = 1.0 / 4e6;
  const std::string message = unfoldable_factor_message(f, dtype::float16, fold_scale_factor(f, dtype::float16));
  CHECK_THAT(message, Contains("2.5e-07") && Contains("float16") && Contains("subnormal"));
  CHECK_THAT(message, Contains("synchronizer<B, float>") && Contains("scaling::sum"));
}

TEST_CASE("two ranks on one GPU: the message names the ranks, host, bus id and NCCL_HOSTID", "[nccl][policy]") {
  const std::string nccl = "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000";
  REQUIRE(is_duplicate_gpu(nccl));
  CHECK_FALSE(is_duplicate_gpu("unhandled cuda error"));
  auto ranks = duplicate_gpu_ranks(nccl);
  REQUIRE(ranks.has_value());
  CHECK(ranks->first == 1);
  CHECK(ranks->second == 0);
  const std::string message = duplicate_gpu_message(1, 2, "node7", "0000:1B:00.0", nccl);
  CHECK_THAT(message, Contains("as rank 1 of 2"));
  CHECK_THAT(message, Contains("ranks 1 and 0 are on the same GPU (PCI bus id 0000:1B:00.0) on host node7"));
  CHECK_THAT(message, Contains("distinct NCCL_HOSTID"));
  // NCCL's text without ranks: this rank is still named.
  CHECK_THAT(duplicate_gpu_message(3, 4, "h", "0000:01:00.0", "Duplicate GPU"), Contains("rank 3 and another rank"));
}

TEST_CASE("the timeout message names rank, host, group, operation and the wait", "[nccl][policy]") {
  wait_site site{.rank = 3, .size = 8, .device = 2, .host = "node7", .group = "dp"};
  const std::string message = timeout_message(site, "all_reduce", milliseconds(1234), milliseconds(1000));
  CHECK_THAT(message, Contains("rank 3 of 8 on host node7 (CUDA device 2), group 'dp'"));
  CHECK_THAT(message, Contains("all_reduce did not complete within the deadline of 1.0 s (waited 1.2 s"));
  CHECK_THAT(message, Contains("WEFT_COMM_TIMEOUT") && Contains("aborted"));
  site.group.clear();
  CHECK_THAT(timeout_message(site, "x", milliseconds(0), milliseconds(0)), Contains("unnamed group"));
}

TEST_CASE("one-rank scaled reductions: the elements NCCL before 2.29.7 leaves unwritten", "[nccl][policy]") {
  // By hand from the kernel's split: 4099 doubles make 3 blocks of alignUp(1366, 2) = 1366, which
  // stop at 4098 (the element a one-rank avg of double left at 0 on an H200 with NCCL 2.28.9).
  CHECK(one_rank_scaled_written(4099, 8, 22809) == 4098);
  // 4099 floats: 2 blocks of alignUp(2049, 4) = 2052 cover all of them.
  CHECK(one_rank_scaled_written(4099, 4, 22809) == 4099);
  // 24577 halves: 4 blocks of alignUp(6144, 8) = 6144 stop at 24576.
  CHECK(one_rank_scaled_written(24577, 2, 22809) == 24576);
  // Fixed in 2.29.7; one block covers every short call.
  CHECK(one_rank_scaled_written(4099, 8, nccl_one_rank_tail_fixed) == 4099);
  CHECK(one_rank_scaled_written(1, 8, 22809) == 1);
  CHECK(one_rank_scaled_written(0, 8, 22809) == 0);
  // The backend reduces the missed tail with one more call: that call writes all of it.
  for (std::size_t size : {2u, 4u, 8u})
    for (std::size_t n = 1; n < 600000; n += 97) {
      const std::size_t first = one_rank_scaled_written(n, size, 22809);
      INFO("n " << n << " element size " << size);
      REQUIRE(first <= n);
      REQUIRE(first > 0);
      REQUIRE(one_rank_scaled_written(n - first, size, 22809) == n - first);
    }
}

namespace {

// A one-rank backend whose communicator records the deadline it is given, as NCCL's keeps one.
struct own_deadline_backend {
  static constexpr std::string_view name = "own-deadline";
  struct request {
    request() = default;
    request(request&&) = default;
    request& operator=(request&&) = default;
    void wait() {}
    bool test() { return true; }
  };
  struct comm {
    milliseconds deadline{-1};  // -1: never set
    void set_timeout(milliseconds timeout) { deadline = timeout; }
    int rank() const { return 0; }
    int size() const { return 1; }
    bool valid() const { return true; }
    request all_reduce(const void*, void*, std::size_t, dtype, weft::reduce_op, weft::completion) { return {}; }
    request reduce(const void*, void*, std::size_t, dtype, weft::reduce_op, int, weft::completion) { return {}; }
    request broadcast(const void*, void*, std::size_t, dtype, int, weft::completion) { return {}; }
    request all_gather(const void*, void*, std::size_t, dtype, weft::completion) { return {}; }
    request reduce_scatter(const void*, void*, std::size_t, dtype, weft::reduce_op, weft::completion) { return {}; }
    request all_to_all(const void*, void*, std::size_t, dtype, weft::completion) { return {}; }
    request send(const void*, std::size_t, dtype, int, weft::completion) { return {}; }
    request recv(void*, std::size_t, dtype, int, weft::completion) { return {}; }
    request group_p2p(std::span<const weft::p2p_op>, weft::completion) { return {}; }
    request barrier(weft::completion) { return {}; }
    comm split(int, int) { return {}; }
    void host_all_gather(std::span<const std::int64_t> local, std::span<std::int64_t> gathered) {
      std::copy(local.begin(), local.end(), gathered.begin());
    }
  };
};
static_assert(weft::backend<own_deadline_backend> && weft::keeps_own_deadline<own_deadline_backend>);

}  // namespace

TEST_CASE("a backend's own deadline is the communicator's: constructor, environment, set_timeout, split",
          "[nccl][policy][deadline]") {
  using fake = weft::communicator<own_deadline_backend>;
  fake given(own_deadline_backend::comm{}, "given", weft::check_level::local, std::chrono::hours(1));
  CHECK(given.native().deadline == milliseconds(3600000));
  given.set_timeout(milliseconds(0));  // no deadline: none for the backend either
  CHECK(given.timeout() == milliseconds(0));
  CHECK(given.native().deadline == milliseconds(0));
  given.set_timeout(milliseconds(2500));
  CHECK(given.native().deadline == milliseconds(2500));
  std::optional<fake> child = given.split(0, 0, "child");
  REQUIRE(child);
  CHECK(child->timeout() == milliseconds(2500));
  CHECK(child->native().deadline == milliseconds(2500));

  const char* saved = std::getenv("WEFT_COMM_TIMEOUT");
  const std::string restore = saved ? saved : "";
  ::setenv("WEFT_COMM_TIMEOUT", "7", 1);
  fake from_environment(own_deadline_backend::comm{}, "environment", weft::check_level::local);
  if (saved) ::setenv("WEFT_COMM_TIMEOUT", restore.c_str(), 1);
  else ::unsetenv("WEFT_COMM_TIMEOUT");
  CHECK(from_environment.timeout() == milliseconds(7000));
  CHECK(from_environment.native().deadline == milliseconds(7000));
}
