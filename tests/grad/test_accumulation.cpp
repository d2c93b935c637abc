// Gradient accumulation: k micro-steps on every dp rank give the gradient of the one large batch
// computed on one rank, for each scaling policy.
#include <catch2/catch.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/synchronizer.hpp>

#include "dp_group.hpp"
#include "mlp.hpp"

#include <cmath>
#include <vector>

using grad_test::mlp;
using grad_test::range;

namespace {

template <class T>
double tolerance() {
  return std::is_same_v<T, double> ? 1e-12 : 2e-6;
}

template <class T>
void register_mlp(weft::grad::synchronizer<weft::mpi_backend, T>& sync) {
  for (std::size_t p = 0; p < 4; ++p) sync.add_param(mlp::names[p], mlp::sizes[p]);
  sync.freeze();
}

// Runs one backward: the gradient of the summed loss over `samples` times `factor`, marked in
// backward order (last parameter first). Half the parameters go through mark_ready(p, gradient),
// the others are added into the view by hand.
template <class T>
void backward(weft::grad::synchronizer<weft::mpi_backend, T>& sync, const mlp& model,
              std::span<const std::size_t> samples, double factor) {
  for (std::size_t p = 4; p-- > 0;) {
    std::vector<double> g = model.gradient(p, samples, factor);
    std::vector<T> gt(g.begin(), g.end());
    if (p % 2 == 0) {
      sync.mark_ready(p, std::span<const T>(gt));
    } else {
      auto view = sync.grad(p);
      for (std::size_t i = 0; i < view.size(); ++i) view[i] += gt[i];
      sync.mark_ready(p);
    }
  }
}

template <class T>
void require_close(std::span<const T> got, const std::vector<double>& want, std::size_t param) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("parameter " << mlp::names[param] << " element " << i);
    REQUIRE(static_cast<double>(got[i]) ==
            Approx(want[i]).epsilon(tolerance<T>()).margin(tolerance<T>()));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("accumulated micro-steps on dp ranks equal one large batch (mean over dp x k)",
                   "[grad][accumulation]", double, float) {
  auto dp = dp_group();
  const std::size_t ranks = static_cast<std::size_t>(dp.size()), rank = static_cast<std::size_t>(dp.rank());
  const int k = 3;
  const std::size_t m = 4;  // samples per micro-batch
  // Small buckets, so several reductions are in flight at once.
  weft::grad::synchronizer<weft::mpi_backend, TestType> sync(
      dp, {.bucket_bytes = 64, .first_bucket_bytes = 16, .pad_elements = 8, .accumulation_steps = k});
  register_mlp(sync);
  REQUIRE(sync.plan().buckets().size() >= 3);
  mlp model;

  for (int step = 0; step < 2; ++step) {  // two optimizer steps: the window restarts cleanly
    for (int j = 0; j < k; ++j) {
      REQUIRE(sync.micro_step() == j);
      auto before = dp.stats();
      auto samples = range((static_cast<std::size_t>(j) * ranks + rank) * m, m);
      backward(sync, model, samples, 1.0 / static_cast<double>(m));  // each micro-step: a mean
      bool reduced = sync.finish();
      REQUIRE(reduced == (j == k - 1));
      if (!reduced) REQUIRE(dp.stats().bytes == before.bytes);  // nothing communicated
    }
    auto all = range(0, ranks * static_cast<std::size_t>(k) * m);
    for (std::size_t p = 0; p < 4; ++p)
      require_close<TestType>(sync.grad(p), model.gradient(p, all, 1.0 / static_cast<double>(all.size())), p);
    sync.zero_grad();
  }
  REQUIRE(sync.steps() == 2);
}

TEST_CASE("token-count scaling: micro-batches of different sizes", "[grad][accumulation]") {
  auto dp = dp_group();
  const std::size_t ranks = static_cast<std::size_t>(dp.size()), rank = static_cast<std::size_t>(dp.rank());
  const int k = 4;
  // Rank r's micro-step j holds 1 + (r + 2j) % 5 samples; samples are numbered consecutively over
  // (j, r), so every rank knows the global batch.
  auto batch_size = [](std::size_t r, int j) { return 1 + (r + 2 * static_cast<std::size_t>(j)) % 5; };
  std::size_t first_of_mine[k] = {}, total = 0;
  for (int j = 0; j < k; ++j)
    for (std::size_t r = 0; r < ranks; ++r) {
      if (r == rank) first_of_mine[j] = total;
      total += batch_size(r, j);
    }

  for (bool count_known_early : {true, false}) {
    DYNAMIC_SECTION("token count given " << (count_known_early ? "before" : "after") << " the last backward") {
      weft::grad::synchronizer<weft::mpi_backend, double> sync(
          dp, {.bucket_bytes = 128, .first_bucket_bytes = 32, .accumulation_steps = k,
               .scale = weft::grad::scaling::token_count});
      register_mlp(sync);
      mlp model;
      if (count_known_early) sync.set_token_count(static_cast<double>(total));
      for (int j = 0; j < k; ++j) {
        auto samples = range(first_of_mine[j], batch_size(rank, j));
        backward(sync, model, samples, 1.0);  // sums over tokens
        if (j == k - 1 && !count_known_early) sync.set_token_count(static_cast<double>(total));
        sync.finish();
      }
      auto all = range(0, total);
      for (std::size_t p = 0; p < 4; ++p)
        require_close<double>(sync.grad(p), model.gradient(p, all, 1.0 / static_cast<double>(total)), p);
    }
  }
}

TEST_CASE("sum scaling leaves the sum over ranks and micro-steps", "[grad][accumulation]") {
  auto dp = dp_group();
  const std::size_t ranks = static_cast<std::size_t>(dp.size()), rank = static_cast<std::size_t>(dp.rank());
  const int k = 2;
  weft::grad::synchronizer<weft::mpi_backend, double> sync(
      dp, {.accumulation_steps = k, .scale = weft::grad::scaling::sum});
  register_mlp(sync);
  mlp model;
  for (int j = 0; j < k; ++j) {
    backward(sync, model, range((static_cast<std::size_t>(j) * ranks + rank) * 3, 3), 1.0);
    sync.finish();
  }
  auto all = range(0, ranks * k * 3);
  for (std::size_t p = 0; p < 4; ++p) require_close<double>(sync.grad(p), model.gradient(p, all, 1.0), p);
}

TEST_CASE("reduce_all() is the same reduction for trainers without per-parameter hooks", "[grad][accumulation]") {
  auto dp = dp_group();
  const std::size_t ranks = static_cast<std::size_t>(dp.size()), rank = static_cast<std::size_t>(dp.rank());
  const int k = 2;
  weft::grad::synchronizer<weft::mpi_backend, double> sync(dp, {.bucket_bytes = 64, .accumulation_steps = k});
  register_mlp(sync);
  mlp model;
  for (int j = 0; j < k; ++j) {
    auto samples = range((static_cast<std::size_t>(j) * ranks + rank) * 2, 2);
    for (std::size_t p = 0; p < 4; ++p) {
      auto g = model.gradient(p, samples, 0.5);
      auto view = sync.grad(p);
      for (std::size_t i = 0; i < view.size(); ++i) view[i] += g[i];
    }
    REQUIRE(sync.reduce_all() == (j == k - 1));
  }
  REQUIRE(sync.last_report().warning.empty());  // no overlap was asked for
  auto all = range(0, ranks * k * 2);
  for (std::size_t p = 0; p < 4; ++p)
    require_close<double>(sync.grad(p), model.gradient(p, all, 1.0 / static_cast<double>(all.size())), p);
}
