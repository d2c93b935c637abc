// The pipeline executor on 2, 3 and 4 stages: a small model of tanh layers split over the stages
// (and chunks) gives, with every schedule and several micro-batch counts, exactly the forward
// outputs and weight gradients of the same computation on one rank; and the configurations that
// would hang or corrupt are refused on every rank, with the same message, before any message.
//
// Tolerance: none (bitwise equality). Each layer's arithmetic is the same function in the serial
// reference and in the stages, and each weight gradient sums the micro-batches in the same order
// (every schedule runs a chunk's backwards, or weight gradients, in micro-batch order).
#include <catch2/catch.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/schedules.hpp>

#include <cmath>
#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace wp = weft::pipeline;
using Catch::Contains;
using comm_t = weft::communicator<weft::mpi_backend>;
using executor_t = wp::executor<weft::mpi_backend, double>;

namespace {

comm_t pp_group() { return comm_t(weft::mpi_backend::comm::world(), "pp"); }

// The model: L layers y = tanh(W x) on d features, a micro-batch of n samples (column-major: sample
// s is x[s*d .. s*d+d)), loss 0.5 * sum(y^2) of the last layer's output.
constexpr std::size_t d = 4, n = 3, elements = d * n, layers_per_chunk = 2;

std::vector<double> initial_weight(std::size_t layer) {
  std::vector<double> w(d * d);
  for (std::size_t i = 0; i < d * d; ++i) w[i] = 0.45 * std::sin(0.7 * static_cast<double>(layer * d * d + i) + 0.3);
  return w;
}

std::vector<double> input_of(int micro_batch) {
  std::vector<double> x(elements);
  for (std::size_t i = 0; i < elements; ++i) x[i] = std::cos(1.3 * static_cast<double>(micro_batch) + 0.17 * static_cast<double>(i));
  return x;
}

void layer_forward(const std::vector<double>& w, std::span<const double> x, std::span<double> y) {
  for (std::size_t s = 0; s < n; ++s)
    for (std::size_t i = 0; i < d; ++i) {
      double sum = 0;
      for (std::size_t j = 0; j < d; ++j) sum += w[i * d + j] * x[s * d + j];
      y[s * d + i] = std::tanh(sum);
    }
}

// The gradient of the pre-activation from the output's, and the input's from it.
void layer_input_grad(const std::vector<double>& w, std::span<const double> y, std::span<const double> dy,
                      std::span<double> dpre, std::span<double> dx) {
  for (std::size_t i = 0; i < elements; ++i) dpre[i] = dy[i] * (1 - y[i] * y[i]);
  for (std::size_t s = 0; s < n; ++s)
    for (std::size_t j = 0; j < d; ++j) {
      double sum = 0;
      for (std::size_t i = 0; i < d; ++i) sum += w[i * d + j] * dpre[s * d + i];
      dx[s * d + j] = sum;
    }
}

void layer_weight_grad(std::span<const double> dpre, std::span<const double> x, std::vector<double>& dw) {
  for (std::size_t i = 0; i < d; ++i)
    for (std::size_t j = 0; j < d; ++j) {
      double sum = 0;
      for (std::size_t s = 0; s < n; ++s) sum += dpre[s * d + i] * x[s * d + j];
      dw[i * d + j] += sum;
    }
}

struct reference {
  std::vector<std::vector<double>> outputs;  // per micro-batch: the last layer's output
  std::vector<std::vector<double>> grads;    // per layer
};

// The whole model on one rank: micro-batch by micro-batch, forward then backward.
reference serial(int layers, int micro_batches) {
  const auto L = static_cast<std::size_t>(layers);
  reference ref;
  ref.grads.assign(L, std::vector<double>(d * d, 0.0));
  std::vector<std::vector<double>> w(L);
  for (std::size_t l = 0; l < L; ++l) w[l] = initial_weight(l);
  for (int mb = 0; mb < micro_batches; ++mb) {
    std::vector<std::vector<double>> act(L + 1, std::vector<double>(elements));
    act[0] = input_of(mb);
    for (std::size_t l = 0; l < L; ++l) layer_forward(w[l], act[l], act[l + 1]);
    ref.outputs.push_back(act[L]);
    std::vector<double> dy = act[L], dpre(elements), dx(elements);
    for (std::size_t l = L; l-- > 0;) {
      layer_input_grad(w[l], act[l + 1], dy, dpre, dx);
      layer_weight_grad(dpre, act[l], ref.grads[l]);
      dy = dx;
    }
  }
  return ref;
}

// One stage's share of the model: its chunks' layers, the activations of the micro-batches in
// flight, and what the last stage produced.
struct stage_model {
  const wp::schedule* s = nullptr;
  int rank = 0;
  std::map<std::size_t, std::vector<double>> w, dw;  // by global layer
  struct saved {
    std::vector<std::vector<double>> act;   // layers_per_chunk + 1 activations
    std::vector<std::vector<double>> dpre;  // per layer, for split schedules
    std::span<const double> input;          // the executor's buffer, valid until the backward
    std::vector<double> input_copy;
  };
  std::map<std::pair<int, int>, saved> live;
  std::map<int, std::vector<double>> outputs;
  int contract_violations = 0;

  std::size_t first_layer(int chunk) const {
    return static_cast<std::size_t>(s->virtual_stage(rank, chunk)) * layers_per_chunk;
  }
  bool is_last(int chunk) const { return s->virtual_stage(rank, chunk) == s->chunks_total() - 1; }

  void init() {
    for (int c = 0; c < s->virtual_stages; ++c)
      for (std::size_t l = first_layer(c); l < first_layer(c) + layers_per_chunk; ++l) {
        w[l] = initial_weight(l);
        dw[l].assign(d * d, 0.0);
      }
  }

  wp::stage_callbacks<double> callbacks() {
    wp::stage_callbacks<double> cb;
    cb.forward = [this](int mb, int chunk, std::span<const double> in, std::span<double> out) {
      saved& st = live[{mb, chunk}];
      st.act.assign(layers_per_chunk + 1, std::vector<double>(elements));
      if (in.empty()) {
        REQUIRE(s->virtual_stage(rank, chunk) == 0);
        st.act[0] = input_of(mb);
      } else {
        REQUIRE(in.size() == elements);
        st.act[0].assign(in.begin(), in.end());
        st.input = in;
        st.input_copy = st.act[0];
      }
      for (std::size_t i = 0; i < layers_per_chunk; ++i) layer_forward(w[first_layer(chunk) + i], st.act[i], st.act[i + 1]);
      if (is_last(chunk)) {
        REQUIRE(out.empty());
        outputs[mb] = st.act[layers_per_chunk];
      } else {
        REQUIRE(out.size() == elements);
        std::copy(st.act[layers_per_chunk].begin(), st.act[layers_per_chunk].end(), out.begin());
      }
    };
    cb.backward = [this](int mb, int chunk, std::span<const double> out_grad, std::span<double> in_grad) {
      saved& st = live.at({mb, chunk});
      std::vector<double> dy = is_last(chunk) ? st.act[layers_per_chunk] : std::vector<double>(out_grad.begin(), out_grad.end());
      REQUIRE(out_grad.empty() == is_last(chunk));
      std::vector<double> dx(elements);
      st.dpre.assign(layers_per_chunk, std::vector<double>(elements));
      for (std::size_t i = layers_per_chunk; i-- > 0;) {
        const std::size_t l = first_layer(chunk) + i;
        layer_input_grad(w[l], st.act[i + 1], dy, st.dpre[i], dx);
        if (!s->split_backward) layer_weight_grad(st.dpre[i], st.act[i], dw[l]);
        dy = dx;
      }
      if (s->virtual_stage(rank, chunk) == 0) {
        REQUIRE(in_grad.empty());
      } else {
        REQUIRE(in_grad.size() == elements);
        std::copy(dx.begin(), dx.end(), in_grad.begin());
      }
      check_input(st);
      if (!s->split_backward) live.erase({mb, chunk});
    };
    cb.weight = [this](int mb, int chunk) {
      saved& st = live.at({mb, chunk});
      for (std::size_t i = 0; i < layers_per_chunk; ++i) layer_weight_grad(st.dpre[i], st.act[i], dw[first_layer(chunk) + i]);
      check_input(st);
      live.erase({mb, chunk});
    };
    return cb;
  }

  // The forward's input span must still hold what it held (the executor keeps it until here).
  void check_input(const saved& st) {
    if (st.input.empty()) return;
    if (!std::equal(st.input.begin(), st.input.end(), st.input_copy.begin())) ++contract_violations;
  }
};

wp::schedule make(wp::schedule_kind kind, int p, int m) {
  return wp::make_schedule({.kind = kind, .stages = p, .micro_batches = m,
                            .virtual_stages = kind == wp::schedule_kind::interleaved ? 2 : 1});
}

void check_against_serial(comm_t& pp, wp::schedule_kind kind, int m) {
  const int p = pp.size();
  const wp::schedule s = make(kind, p, m);
  INFO("schedule " << wp::to_string(kind) << ", stages " << p << ", micro-batches " << m);
  stage_model model;
  model.s = &s;
  model.rank = pp.rank();
  model.init();
  const int layers = s.chunks_total() * static_cast<int>(layers_per_chunk);
  executor_t exec(pp, s, model.callbacks(), {.elements = elements, .layers = layers});
  const reference ref = serial(layers, m);
  for (int step = 0; step < 2; ++step) {
    for (auto& [l, g] : model.dw) g.assign(d * d, 0.0);
    model.outputs.clear();
    const wp::step_stats stats = exec.run();
    REQUIRE(model.live.empty());
    REQUIRE(model.contract_violations == 0);
    const auto plan = wp::detail::plan_exchange(s, pp.rank());
    REQUIRE(stats.sends == plan.sends);
    for (const auto& [l, g] : model.dw) {
      INFO("step " << step << ", layer " << l);
      REQUIRE(g == ref.grads[l]);
    }
    if (pp.rank() == p - 1) {
      REQUIRE(static_cast<int>(model.outputs.size()) == m);
      for (int mb = 0; mb < m; ++mb) REQUIRE(model.outputs[mb] == ref.outputs[static_cast<std::size_t>(mb)]);
    } else {
      REQUIRE(model.outputs.empty());
    }
  }
}

wp::stage_callbacks<double> idle_callbacks() {
  wp::stage_callbacks<double> cb;
  cb.forward = [](int, int, std::span<const double>, std::span<double>) {};
  cb.backward = [](int, int, std::span<const double>, std::span<double>) {};
  cb.weight = [](int, int) {};
  return cb;
}

// Building the executor throws on every rank, and nothing went over the group.
void require_refused(comm_t& pp, const wp::schedule& s, wp::stage_callbacks<double> cb, std::size_t n_elements,
                     const std::vector<std::string>& texts) {
  const auto before = pp.stats().operations;
  try {
    executor_t exec(pp, s, std::move(cb), {.elements = n_elements});
    FAIL("the executor accepted the configuration");
  } catch (const weft::error& e) {
    const std::string what = e.what();
    INFO(what);
    REQUIRE_THAT(what, Contains("refused its configuration before sending anything") && Contains("group 'pp'"));
    for (const std::string& text : texts) REQUIRE_THAT(what, Contains(text));
  }
  REQUIRE(pp.stats().operations == before);
  // The group is still usable: every rank left the agreement together.
  pp.barrier();
}

}  // namespace

TEST_CASE("the executor gives the serial model's outputs and gradients", "[pipeline][executor]") {
  comm_t pp = pp_group();
  const int p = pp.size();
  for (wp::schedule_kind kind : wp::all_schedule_kinds) {
    std::vector<int> counts;
    if (kind == wp::schedule_kind::interleaved) {
      if (p < 2) continue;
      counts = {p, 2 * p};
    } else {
      counts = {1, p, 2 * p + 1};
    }
    for (int m : counts) check_against_serial(pp, kind, m);
  }
}

TEST_CASE("the exchange plan follows each sender's order", "[pipeline][executor]") {
  // Interleaved on two stages: ranks 0 and 1 send each other activations and gradients both ways.
  const wp::schedule s = make(wp::schedule_kind::interleaved, 2, 4);
  for (int rank = 0; rank < 2; ++rank) {
    const auto plan = wp::detail::plan_exchange(s, rank);
    const auto& from = plan.messages_from(1 - rank);
    std::size_t sent = 0;
    for (const wp::action& a : s.ranks[static_cast<std::size_t>(1 - rank)]) sent += a.send_to == rank ? 1 : 0;
    REQUIRE(from.size() == sent);
    REQUIRE(plan.receives == sent);
    bool both = false;
    for (std::size_t i = 1; i < from.size(); ++i) both = both || from[i].consumer != from[0].consumer;
    REQUIRE(both);
  }
}

TEST_CASE("configurations that would hang are refused on every rank before anything is sent", "[pipeline][executor]") {
  comm_t pp = pp_group();
  const int p = pp.size();

  SECTION("a schedule for another number of stages") {
    require_refused(pp, make(wp::schedule_kind::one_f_one_b, p + 1, 4), idle_callbacks(), elements,
                    {"built for stages=" + std::to_string(p + 1), "has " + std::to_string(p) + " ranks",
                     "build it with stages=" + std::to_string(p)});
  }
  SECTION("an interleaved micro-batch count that is not a multiple of the stages") {
    // Built by hand, past make_schedule's own check, as a trainer with its own table might.
    const wp::schedule s = wp::detail::make_interleaved({.kind = wp::schedule_kind::interleaved, .stages = p,
                                                         .micro_batches = p + 1, .virtual_stages = 2});
    require_refused(pp, s, idle_callbacks(), elements, {"multiple of stages", "use micro-batches="});
  }
  SECTION("a table that deadlocks") {
    wp::schedule s = make(wp::schedule_kind::one_f_one_b, p, 2);
    // Stage 0 runs its backwards before its forwards: B0 waits for stage 1, which waits for F0.
    auto& list = s.ranks[0];
    std::stable_partition(list.begin(), list.end(), [](const wp::action& a) { return a.kind == wp::action_kind::backward; });
    require_refused(pp, s, idle_callbacks(), elements, {"deadlocks", "stuck", "use make_schedule for 1f1b"});
  }
  SECTION("stages that disagree about the tensor between them") {
    const std::size_t mine = pp.rank() == 1 ? elements + 4 : elements;
    require_refused(pp, make(wp::schedule_kind::gpipe, p, 2), idle_callbacks(), mine,
                    {"disagree about the tensor between stages",
                     "stage 1 " + std::to_string(elements + 4) + " x double", "stage 0 " + std::to_string(elements) + " x double"});
  }
  SECTION("stages that hold different schedules") {
    const int m = pp.rank() == 0 ? 4 : 5;
    require_refused(pp, make(wp::schedule_kind::one_f_one_b, p, m), idle_callbacks(), elements,
                    {"hold different schedules", "stage 0: 1f1b, " + std::to_string(p) + " stages, 4 micro-batches",
                     "stage 1: 1f1b, " + std::to_string(p) + " stages, 5 micro-batches"});
  }
  SECTION("a split backward without a weight callback") {
    wp::stage_callbacks<double> cb = idle_callbacks();
    if (pp.rank() == p - 1) cb.weight = nullptr;
    require_refused(pp, make(wp::schedule_kind::zb_h1, p, 4), std::move(cb), elements,
                    {"stage " + std::to_string(p - 1) + " has no weight callback", "zb-h1 splits the backward"});
  }
  SECTION("stages with different element types") {
    const auto before = pp.stats().operations;
    std::string what;
    try {
      if (pp.rank() == 0) {
        wp::stage_callbacks<float> cb;
        cb.forward = [](int, int, std::span<const float>, std::span<float>) {};
        cb.backward = [](int, int, std::span<const float>, std::span<float>) {};
        wp::executor<weft::mpi_backend, float> exec(pp, make(wp::schedule_kind::gpipe, p, 2), cb, {.elements = elements});
      } else {
        executor_t exec(pp, make(wp::schedule_kind::gpipe, p, 2), idle_callbacks(), {.elements = elements});
      }
    } catch (const weft::error& e) {
      what = e.what();
    }
    INFO(what);
    REQUIRE_THAT(what, Contains("stage 0 " + std::to_string(elements) + " x float") &&
                           Contains("stage 1 " + std::to_string(elements) + " x double"));
    REQUIRE(pp.stats().operations == before);
    pp.barrier();
  }
}

// Boundaries of 1 MiB, far past MPI's eager limit (Open MPI's shared-memory transport sends 4 KiB
// eagerly), so a send completes only once its receiver has posted the receive, as on NCCL; with
// in_stream_order each batch is waited for before the next is posted, as NCCL's stream runs them.
// The transfer order before batching (each send and receive alone) hangs here in 1F1B, ZB-H1 and
// interleaved until the deadline ends the job; the executor's batches complete every schedule.
// Values: forward, virtual stage k sends x + k + 1; backward, it sends (the gradient it got) + 1.
TEST_CASE("in NCCL's order, with sends that wait for their receivers, every schedule completes",
          "[pipeline][executor][rendezvous]") {
  comm_t pp = pp_group();
  pp.set_timeout(std::chrono::seconds(20));
  const int p = pp.size(), rank = pp.rank();
  constexpr std::size_t big = std::size_t{1} << 17;  // doubles per micro-batch: 1 MiB
  auto x = [](int mb, std::size_t i) { return static_cast<double>(mb * 3 + static_cast<int>(i % 13)); };
  auto g = [](int mb, std::size_t i) { return static_cast<double>(mb * 5 + static_cast<int>(i % 7)); };
  for (wp::schedule_kind kind : wp::all_schedule_kinds) {
    if (kind == wp::schedule_kind::interleaved && p < 2) continue;
    for (int m : {p, 2 * p}) {
      const wp::schedule s = make(kind, p, m);
      INFO("schedule " << wp::to_string(kind) << ", stages " << p << ", micro-batches " << m);
      const int last = s.chunks_total() - 1;
      int forwards = 0, backwards = 0, weights = 0, wrong = 0;
      wp::stage_callbacks<double> cb;
      cb.forward = [&](int mb, int chunk, std::span<const double> in, std::span<double> out) {
        const int k = s.virtual_stage(rank, chunk);
        for (std::size_t i = 0; i < in.size(); ++i) wrong += in[i] != x(mb, i) + k ? 1 : 0;
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = x(mb, i) + k + 1;
        wrong += (in.empty() != (k == 0)) + (out.empty() != (k == last));
        ++forwards;
      };
      cb.backward = [&](int mb, int chunk, std::span<const double> out_grad, std::span<double> in_grad) {
        const int k = s.virtual_stage(rank, chunk);
        for (std::size_t i = 0; i < out_grad.size(); ++i) wrong += out_grad[i] != g(mb, i) + (last - k) ? 1 : 0;
        for (std::size_t i = 0; i < in_grad.size(); ++i) in_grad[i] = g(mb, i) + (last - k) + 1;
        wrong += (out_grad.empty() != (k == last)) + (in_grad.empty() != (k == 0));
        ++backwards;
      };
      cb.weight = [&](int, int) { ++weights; };
      executor_t exec(pp, s, cb, {.elements = big, .in_stream_order = true});
      exec.run();
      CHECK(wrong == 0);
      CHECK(forwards == m * s.virtual_stages);
      CHECK(backwards == m * s.virtual_stages);
      CHECK(weights == (s.split_backward ? m * s.virtual_stages : 0));
    }
  }
}
