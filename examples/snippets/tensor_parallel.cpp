// docs/parallelism.md's tensor-parallel example as a program: an MLP (no activation) split over
// the tp group (every rank of the job) with sequence parallelism, forward and backward, checked
// against the same MLP computed whole on every rank. Values are small integers, so every sum is
// exact. Rank 0 prints "tensor_parallel: ok" when every check passed on every rank.
#include <weft/backend/mpi/backend.hpp>
#include <weft/tp/linear.hpp>

#include <weft/launch/mpi_environment.hpp>
#include <weft/layout/process_groups.hpp>

#include <cstdio>
#include <vector>

namespace {

int failures = 0;

/// a [rows, inner] times bᵀ, b [cols, inner]: [rows, cols].
std::vector<float> matmul_nt(const std::vector<float>& a, const std::vector<float>& b, std::size_t rows,
                             std::size_t cols, std::size_t inner) {
  std::vector<float> c(rows * cols, 0.0f);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j)
      for (std::size_t k = 0; k < inner; ++k) c[i * cols + j] += a[i * inner + k] * b[j * inner + k];
  return c;
}

/// a [rows, inner] times b, b [inner, cols]: [rows, cols].
std::vector<float> matmul_nn(const std::vector<float>& a, const std::vector<float>& b, std::size_t rows,
                             std::size_t cols, std::size_t inner) {
  std::vector<float> c(rows * cols, 0.0f);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t k = 0; k < inner; ++k)
      for (std::size_t j = 0; j < cols; ++j) c[i * cols + j] += a[i * inner + k] * b[k * cols + j];
  return c;
}

/// Rows [first, first + count) of a row-major matrix with `width` columns.
std::vector<float> rows(const std::vector<float>& m, std::size_t width, std::size_t first, std::size_t count) {
  return {m.begin() + static_cast<std::ptrdiff_t>(first * width), m.begin() + static_cast<std::ptrdiff_t>((first + count) * width)};
}

/// Columns [first, first + count) of a row-major matrix with `width` columns.
std::vector<float> columns(const std::vector<float>& m, std::size_t width, std::size_t first, std::size_t count) {
  std::vector<float> out;
  for (std::size_t r = 0; r < m.size() / width; ++r)
    for (std::size_t c = first; c < first + count; ++c) out.push_back(m[r * width + c]);
  return out;
}

std::vector<float> filled(std::size_t n, std::size_t width, int modulus) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>((i / width) * 3 + i % width * 2) % modulus - modulus / 2);
  return v;
}

void expect_equal(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  if (got != want) {
    std::fprintf(stderr, "tensor_parallel: FAILED: %s differs from the whole MLP's\n", what);
    ++failures;
  }
}

void mlp(weft::process_groups<weft::mpi_backend>& groups) {
  const std::size_t tokens = 8, hidden = 4, ffn = 16;
  const std::size_t p = static_cast<std::size_t>(groups.tp().size()), r = static_cast<std::size_t>(groups.tp().rank());
  const std::size_t local_tokens = tokens / p, local_ffn = ffn / p;
  // The whole MLP, on every rank: h = x W1ᵀ + b1, y = h W2ᵀ + b2; dh = dy W2, dx = dh W1.
  const std::vector<float> x = filled(tokens * hidden, hidden, 3), w1 = filled(ffn * hidden, hidden, 5),
                           b1 = filled(ffn, ffn, 2), w2 = filled(hidden * ffn, ffn, 3), b2 = filled(hidden, hidden, 3),
                           dy = filled(tokens * hidden, hidden, 5);
  std::vector<float> whole_h = matmul_nt(x, w1, tokens, ffn, hidden);
  for (std::size_t i = 0; i < whole_h.size(); ++i) whole_h[i] += b1[i % ffn];
  std::vector<float> whole_y = matmul_nt(whole_h, w2, tokens, hidden, ffn);
  for (std::size_t i = 0; i < whole_y.size(); ++i) whole_y[i] += b2[i % hidden];
  const std::vector<float> whole_dh = matmul_nn(dy, w2, tokens, ffn, hidden);
  const std::vector<float> whole_dx = matmul_nn(whole_dh, w1, tokens, hidden, ffn);

  // This rank's shards: its tokens (sequence parallel), its rows of W1 and b1, its columns of W2.
  const std::vector<float> x_shard = rows(x, hidden, r * local_tokens, local_tokens);
  const std::vector<float> w1_shard = rows(w1, hidden, r * local_ffn, local_ffn);
  const std::vector<float> b1_shard = rows(b1, 1, r * local_ffn, local_ffn);
  const std::vector<float> w2_shard = columns(w2, ffn, r * local_ffn, local_ffn);
  const std::vector<float> dy_shard = rows(dy, hidden, r * local_tokens, local_tokens);
  std::vector<float> h(tokens * local_ffn), y_shard(local_tokens * hidden), dh(tokens * local_ffn),
      dw2(hidden * local_ffn), db2(hidden), dx_shard(local_tokens * hidden), dw1(local_ffn * hidden), db1(local_ffn);

  auto& tp = groups.tp();
  weft::tp::column_parallel_linear<weft::mpi_backend, float> up(tp, hidden, ffn, {.sequence_parallel = true});
  weft::tp::row_parallel_linear<weft::mpi_backend, float> down(tp, ffn, hidden, {.sequence_parallel = true});
  up.forward(x_shard, w1_shard, b1_shard, h);      // all-gather along the sequence, then x W1ᵢᵀ + b1ᵢ
  down.forward(h, w2_shard, b2, y_shard);          // hᵢ W2ᵢᵀ, reduce-scatter along the sequence, + b2
  down.backward(dy_shard, w2_shard, dh, dw2, db2); // all-gather dy; dh, dW2ᵢ, db2 (complete)
  up.backward(dh, w1_shard, dx_shard, dw1, db1);   // dW1ᵢ, db1ᵢ; dx reduce-scattered along the sequence

  expect_equal(h, columns(whole_h, ffn, r * local_ffn, local_ffn), "h");
  expect_equal(y_shard, rows(whole_y, hidden, r * local_tokens, local_tokens), "y");
  expect_equal(dh, columns(whole_dh, ffn, r * local_ffn, local_ffn), "dh");
  expect_equal(dx_shard, rows(whole_dx, hidden, r * local_tokens, local_tokens), "dx");
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  weft::process_groups<weft::mpi_backend> groups(world, weft::layout::rank_layout({.world_size = world.size(), .tp = world.size()}));
  mlp(groups);
  std::vector<int> failed{failures};
  world.all_reduce(failed);
  if (world.rank() == 0 && failed[0] == 0) std::printf("tensor_parallel: ok\n");
  return failed[0] == 0 ? 0 : 1;
}
