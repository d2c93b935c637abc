// docs/parallelism.md's pipeline examples as one program: a schedule and its verifier (pure), then
// the executor running 1F1B over the pp group (every rank of the job) for a model whose stages
// each add 1 to the activations. The last stage checks what arrives, the first stage the
// gradients that come back; rank 0 prints "pipeline: ok" when every check passed on every rank.
#include <weft/pipeline/schedules.hpp>
#include <weft/pipeline/verify.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/pipeline/executor.hpp>

#include <weft/launch/mpi_environment.hpp>

#include <cstdio>
#include <span>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "pipeline: FAILED: %s\n", what);
    ++failures;
  }
}

void verify_a_table() {
  namespace wp = weft::pipeline;
  wp::schedule s = wp::make_schedule(wp::interleaved<2>{}, /*stages*/ 4, /*micro-batches*/ 8);
  wp::verify_report r = wp::verify(s, {.forward = 1, .backward = 2});
  // r.ok(), r.makespan, r.bubble_fraction, r.peak_in_flight[stage], r.times[rank][i]
  expect(r.ok() && r.makespan > 0 && r.bubble_fraction > 0 && r.bubble_fraction < 1, "the interleaved table verifies");
}

/// One stage of the model: the first reads micro-batch mb itself, every stage adds 1, and the
/// last checks what arrives: mb + (stages - 1).
void stage_forward(int stages, int mb, std::span<const float> in, std::span<float> out) {
  const float x0 = static_cast<float>(mb);
  for (float x : out.empty() ? in : std::span<const float>{})
    expect(x == x0 + static_cast<float>(stages - 1), "the last stage's input");
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = (in.empty() ? x0 : in[i]) + 1.0f;
}

/// Its backward: the last stage starts from mb, every other stage adds 1 on the way back, and the
/// first checks what arrives: mb + (stages - 2).
void stage_backward(int stages, int mb, std::span<const float> dout, std::span<float> din) {
  const float g0 = static_cast<float>(mb);
  for (float g : din.empty() ? dout : std::span<const float>{})
    expect(g == g0 + static_cast<float>(stages - 2), "the first stage's input gradient");
  for (std::size_t i = 0; i < din.size(); ++i) din[i] = dout.empty() ? g0 : dout[i] + 1.0f;
}

void run_the_executor(weft::communicator<weft::mpi_backend>& pp) {
  const std::size_t micro_batch = 2, seq = 8, hidden = 4;
  const int steps = 2;

  namespace wp = weft::pipeline;
  wp::schedule s = wp::make_schedule(wp::one_f_one_b{}, pp.size(), /*micro-batches*/ 8);
  wp::stage_callbacks<float> cb{
      .forward = [&](int mb, int chunk, std::span<const float> in, std::span<float> out) { (void)chunk; stage_forward(pp.size(), mb, in, out); },
      .backward = [&](int mb, int chunk, std::span<const float> dout, std::span<float> din) { (void)chunk; stage_backward(pp.size(), mb, dout, din); },
      .weight = [&](int mb, int chunk) { (void)mb; (void)chunk; },  // only for zb-h1
  };
  wp::executor<weft::mpi_backend, float> exec(pp, s, cb, {.elements = micro_batch * seq * hidden});
  for (int step = 0; step < steps; ++step) exec.run();  // one training step per call
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "pp");
  verify_a_table();
  run_the_executor(world);
  std::vector<int> failed{failures};
  world.all_reduce(failed);
  if (world.rank() == 0 && failed[0] == 0) std::printf("pipeline: ok\n");
  return failed[0] == 0 ? 0 : 1;
}
