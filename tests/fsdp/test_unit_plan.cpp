// The shard layout of a fully sharded model is pure: shards cover every parameter element exactly
// once, in equal padded parts, and the fingerprint changes with anything that changes the shards.
#include <catch2/catch.hpp>

#include <weft/fsdp/unit_plan.hpp>
#include <weft/fsdp/whole_tensor.hpp>

#include <vector>

using weft::fsdp::unit_plan;
using weft::fsdp::unit_spec;

namespace {

std::vector<unit_spec> units() {
  return {{"embed", {{"table", 50}}}, {"block0", {{"qkv", 37}, {"proj", 11}, {"norm", 5}}}, {"head", {{"w", 23}}}};
}

}  // namespace

TEST_CASE("every parameter element is in exactly one shard", "[fsdp][plan]") {
  for (int shards : {1, 2, 3, 4, 7}) {
    for (std::size_t pad : {std::size_t{1}, std::size_t{8}}) {
      unit_plan plan(units(), weft::dtype::float32, pad, shards);
      for (std::size_t u = 0; u < plan.size(); ++u) {
        const auto& unit = plan.unit(u);
        REQUIRE(unit.padded_elements() % static_cast<std::size_t>(shards) == 0);
        REQUIRE(unit.padded_elements() % pad == 0);
        std::vector<int> seen;
        for (const auto& p : unit.params()) seen.resize(seen.size() + p.count);
        std::size_t used = 0;
        for (const auto& p : unit.params()) used += p.count;
        REQUIRE(unit.padded_elements() >= used);
        REQUIRE(unit.padded_elements() < used + pad * static_cast<std::size_t>(shards));
        std::vector<std::size_t> first(unit.params().size());
        for (std::size_t p = 1; p < first.size(); ++p) first[p] = first[p - 1] + unit.params()[p - 1].count;
        for (int r = 0; r < shards; ++r) {
          for (const auto& run : unit.runs(r)) {
            REQUIRE(run.shard_offset + run.count <= unit.shard_elements());
            // The run is where the buffer says the parameter's elements are.
            REQUIRE(unit.shard_offset(r) + run.shard_offset == unit.offset_of(run.param) + run.param_offset);
            for (std::size_t i = 0; i < run.count; ++i) ++seen[first[run.param] + run.param_offset + i];
          }
        }
        for (int count : seen) REQUIRE(count == 1);
      }
    }
  }
}

TEST_CASE("cutting whole tensors into shards and gathering them back is the identity", "[fsdp][plan]") {
  for (int shards : {1, 3, 4}) {
    unit_plan plan(units(), weft::dtype::float64, 4, shards);
    std::vector<weft::fsdp::whole_tensor<double>> whole;
    for (const auto& unit : plan.units())
      for (std::size_t p = 0; p < unit.params().size(); ++p) {
        std::vector<double> values(unit.params()[p].count);
        for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(p * 1000 + i) + 0.5;
        whole.push_back({weft::fsdp::whole_name("", unit, p), values});
      }
    std::vector<weft::fsdp::whole_tensor<double>> back;
    for (const auto& unit : plan.units()) {
      std::vector<double> gathered(unit.padded_elements(), -1.0);
      for (int r = 0; r < shards; ++r) {
        std::vector<double> shard(unit.shard_elements(), -7.0);
        weft::fsdp::cut_shard<double>(unit, r, whole, "", shard);
        std::copy(shard.begin(), shard.end(), gathered.begin() + static_cast<std::ptrdiff_t>(unit.shard_offset(r)));
      }
      weft::fsdp::append_whole<double>(unit, gathered, "", back);
    }
    REQUIRE(back.size() == whole.size());
    for (std::size_t t = 0; t < whole.size(); ++t) {
      REQUIRE(back[t].name == whole[t].name);
      REQUIRE(back[t].values == whole[t].values);
    }
  }
}

TEST_CASE("the fingerprint follows what determines the shards", "[fsdp][plan]") {
  const auto base = unit_plan(units(), weft::dtype::float32, 8, 4).fingerprint();
  REQUIRE(unit_plan(units(), weft::dtype::float32, 8, 4).fingerprint() == base);
  REQUIRE(unit_plan(units(), weft::dtype::bfloat16, 8, 4).fingerprint() != base);
  REQUIRE(unit_plan(units(), weft::dtype::float32, 16, 4).fingerprint() != base);
  REQUIRE(unit_plan(units(), weft::dtype::float32, 8, 2).fingerprint() != base);
  auto other = units();
  other[1].params[2].count = 6;
  REQUIRE(unit_plan(other, weft::dtype::float32, 8, 4).fingerprint() != base);
  other = units();
  std::swap(other[0], other[2]);
  REQUIRE(unit_plan(other, weft::dtype::float32, 8, 4).fingerprint() != base);
}

TEST_CASE("bad unit plans are refused with the way out", "[fsdp][plan][errors]") {
  REQUIRE_THROWS_WITH(unit_plan({}, weft::dtype::float32, 8, 2), Catch::Contains("no units registered"));
  REQUIRE_THROWS_WITH(unit_plan({{"a", {}}}, weft::dtype::float32, 8, 2), Catch::Contains("has no parameters"));
  REQUIRE_THROWS_WITH(unit_plan({{"a", {{"w", 3}}}, {"a", {{"w", 3}}}}, weft::dtype::float32, 8, 2),
                      Catch::Contains("two units are named 'a'"));
  unit_plan plan(units(), weft::dtype::float64, 4, 2);
  std::vector<double> shard(plan.unit(0).shard_elements());
  std::vector<weft::fsdp::whole_tensor<double>> wrong{{"embed.table", std::vector<double>(49)}};
  REQUIRE_THROWS_WITH(weft::fsdp::cut_shard<double>(plan.unit(0), 0, wrong, "", shard),
                      Catch::Contains("has 49 elements but the parameter is registered with 50"));
  REQUIRE_THROWS_WITH(weft::fsdp::cut_shard<double>(plan.unit(1), 0, wrong, "", shard),
                      Catch::Contains("the shard given for unit 'block0' has 26 elements, the layout 28"));
  std::vector<double> block_shard(plan.unit(1).shard_elements());
  REQUIRE_THROWS_WITH(weft::fsdp::cut_shard<double>(plan.unit(1), 0, wrong, "", block_shard),
                      Catch::Contains("no whole tensor named 'block0.qkv'"));
}
