// docs/parallelism.md's context-parallel example as a program: ring attention and Ulysses over the
// cp group (every rank of the job), forward and backward, each checked against the same causal
// attention computed over the whole sequence on one rank. Rank 0 prints "context_parallel: ok"
// when every check passed on every rank.
#include <weft/backend/mpi/backend.hpp>
#include <weft/cp/ring_attention.hpp>
#include <weft/cp/ulysses.hpp>

#include <weft/launch/mpi_environment.hpp>
#include <weft/layout/process_groups.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

int failures = 0;

std::vector<float> wave(std::size_t n, double phase) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + phase));
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::abs(got[i] - want[i]) > 1e-4f) {
      std::fprintf(stderr, "context_parallel: FAILED: %s[%zu] is %g, the whole sequence's is %g\n", what, i, got[i], want[i]);
      ++failures;
      return;
    }
}

void attention(weft::process_groups<weft::mpi_backend>& groups) {
  const std::int64_t seq = 64;
  const int heads = 4, head_dim = 8;
  const std::size_t row = static_cast<std::size_t>(heads * head_dim), n = static_cast<std::size_t>(seq) * row;
  const std::vector<float> whole_q = wave(n, 0.1), whole_k = wave(n, 0.7), whole_v = wave(n, 1.3), whole_dout = wave(n, 2.1);

  // The whole sequence on this rank alone: the result every split must reproduce.
  weft::communicator<weft::mpi_backend> alone(weft::mpi_backend::comm::self(), "alone");
  const weft::cp::sequence_split whole_split{.seq = seq, .cp = 1};
  std::vector<float> whole_out(n), whole_lse(static_cast<std::size_t>(seq * heads)), whole_dq(n), whole_dk(n), whole_dv(n);
  weft::cp::ring_attention<weft::mpi_backend> reference(alone, whole_split, {.heads = heads, .head_dim = head_dim}, {.causal = true});
  reference.forward<float>(whole_q, whole_k, whole_v, whole_out, whole_lse);
  reference.backward<float>(whole_q, whole_k, whole_v, whole_out, whole_lse, whole_dout, whole_dq, whole_dk, whole_dv);

  const int p = groups.cp().size(), r = groups.cp().rank();
  const std::size_t local = n / static_cast<std::size_t>(p);
  auto mine = [&](const std::vector<float>& whole) {
    std::vector<float> part(local);
    weft::cp::shard<float>({.seq = seq, .cp = p}, r, whole, row, part);
    return part;
  };
  const std::vector<float> q = mine(whole_q), k = mine(whole_k), v = mine(whole_v), dout = mine(whole_dout);
  std::vector<float> out(local), lse(local / static_cast<std::size_t>(head_dim)), dq(local), dk(local), dv(local);
  std::vector<float> lse_h(static_cast<std::size_t>(seq * heads / p));

  namespace cp = weft::cp;
  cp::sequence_split split{.seq = seq, .cp = groups.cp().size(), .kind = cp::split_kind::load_balanced};
  cp::ring_attention<weft::mpi_backend> ring(groups.cp(), split, {.heads = heads, .head_dim = head_dim}, {.causal = true});
  ring.forward<float>(q, k, v, out, lse);                      // lse: [local tokens, heads], kept for backward
  ring.backward<float>(q, k, v, out, lse, dout, dq, dk, dv);
  expect_close(out, mine(whole_out), "ring attention's output");
  expect_close(dq, mine(whole_dq), "ring attention's dq");
  expect_close(dk, mine(whole_dk), "ring attention's dk");
  expect_close(dv, mine(whole_dv), "ring attention's dv");

  cp::ulysses<weft::mpi_backend> a2a(groups.cp(), split, {.heads = heads, .head_dim = head_dim});
  a2a.forward<float>(q, k, v, out, lse_h, {.causal = true});   // lse_h: [seq, heads/cp]
  a2a.backward<float>(q, k, v, out, lse_h, dout, dq, dk, dv, {.causal = true});
  expect_close(out, mine(whole_out), "Ulysses' output");
  expect_close(dq, mine(whole_dq), "Ulysses' dq");
  expect_close(dk, mine(whole_dk), "Ulysses' dk");
  expect_close(dv, mine(whole_dv), "Ulysses' dv");
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  weft::process_groups<weft::mpi_backend> groups(world, weft::layout::rank_layout({.world_size = world.size(), .cp = world.size()}));
  attention(groups);
  std::vector<int> failed{failures};
  world.all_reduce(failed);
  if (world.rank() == 0 && failed[0] == 0) std::printf("context_parallel: ok\n");
  return failed[0] == 0 ? 0 : 1;
}
