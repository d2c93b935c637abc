// The shard layout of a fully sharded model is pure: shards cover every parameter element exactly
// once, in equal padded parts, and the fingerprint changes with anything that changes the shards.
// Grouping layers into units by a cap is pure too: the rule, the names, the layers' places.
#include <catch2/catch.hpp>

#include <weft/fsdp/unit_grouping.hpp>
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

namespace {

// Layers of 400, 100, 100, 300, 1000 and 50 float elements (1600, 400, 400, 1200, 4000, 200 bytes).
std::vector<unit_spec> layers() {
  return {{"embed", {{"table", 400}}},       {"h.0", {{"w", 60}, {"b", 40}}}, {"h.1", {{"w", 60}, {"b", 40}}},
          {"h.2", {{"w", 200}, {"b", 100}}}, {"head", {{"w", 1000}}},         {"norm", {{"g", 50}}}};
}

// The layers' bytes in each unit, written out from the rule: consecutive layers while the unit stays
// within the cap, a larger layer alone.
std::vector<std::vector<std::size_t>> unit_layers(const weft::fsdp::layer_grouping& g) {
  std::vector<std::vector<std::size_t>> out(g.units.size());
  for (std::size_t l = 0; l < g.layers.size(); ++l) out[g.layers[l].unit].push_back(l);
  return out;
}

}  // namespace

TEST_CASE("layers are grouped into units of consecutive layers within the cap", "[fsdp][plan][grouping]") {
  using weft::fsdp::group_layers;
  const auto all = layers();
  using groups = std::vector<std::vector<std::size_t>>;
  // 2000 bytes: embed (1600) + h.0 (400) fill one unit; h.1 + h.2 (1600); head (4000) alone; norm.
  REQUIRE(unit_layers(group_layers(all, weft::dtype::float32, 2000)) == groups{{0, 1}, {2, 3}, {4}, {5}});
  // 1999 bytes: embed alone, h.0 + h.1 + ... until h.2 would pass 1999 (400 + 400 + 1200 = 2000).
  REQUIRE(unit_layers(group_layers(all, weft::dtype::float32, 1999)) == groups{{0}, {1, 2}, {3}, {4}, {5}});
  // Below every layer: the layers as registered, unchanged.
  const auto each = group_layers(all, weft::dtype::float32, 1);
  REQUIRE(unit_layers(each) == groups{{0}, {1}, {2}, {3}, {4}, {5}});
  for (std::size_t l = 0; l < all.size(); ++l) {
    REQUIRE(each.units[l].name == all[l].name);
    REQUIRE_FALSE(each.units[l].grouped_layers);
  }
  // Above the total: one unit. In double every layer is twice the bytes.
  REQUIRE(unit_layers(group_layers(all, weft::dtype::float32, 1 << 20)) == groups{{0, 1, 2, 3, 4, 5}});
  REQUIRE(unit_layers(group_layers(all, weft::dtype::float64, 4000)) == groups{{0, 1}, {2, 3}, {4}, {5}});
}

TEST_CASE("grouped layers keep their parameters, places and whole-tensor names", "[fsdp][plan][grouping]") {
  const auto all = layers();
  const auto g = weft::fsdp::group_layers(all, weft::dtype::float32, 2000);
  REQUIRE(g.units[0].name == "embed..h.0");
  REQUIRE(g.units[0].grouped_layers);
  REQUIRE(g.units[1].params.size() == 4);
  REQUIRE(g.units[1].params[2].name == "h.2.w");
  REQUIRE(g.units[1].params[2].count == 200);
  REQUIRE(g.layers[3].unit == 1);
  REQUIRE(g.layers[3].first_param == 2);
  REQUIRE(g.layers[2].first_param == 0);
  REQUIRE(g.layers_of(1) == std::pair<std::size_t, std::size_t>{2, 3});
  // Whole tensors are named as without grouping ("<layer>.<parameter>"), so a checkpoint saved
  // with one grouping is read with another; the plans differ in their fingerprints.
  const unit_plan grouped(g.units, weft::dtype::float32, 8, 2);
  const unit_plan single(all, weft::dtype::float32, 8, 2);
  std::vector<std::string> grouped_names, single_names;
  for (const auto& u : grouped.units())
    for (std::size_t p = 0; p < u.params().size(); ++p) grouped_names.push_back(weft::fsdp::whole_name("", u, p));
  for (const auto& u : single.units())
    for (std::size_t p = 0; p < u.params().size(); ++p) single_names.push_back(weft::fsdp::whole_name("", u, p));
  REQUIRE(grouped_names == single_names);
  REQUIRE(grouped_names[1] == "h.0.w");
  REQUIRE(grouped.fingerprint() != single.fingerprint());
  auto flagged = g.units;
  flagged[0].grouped_layers = false;
  REQUIRE(unit_plan(flagged, weft::dtype::float32, 8, 2).fingerprint() != grouped.fingerprint());
}

TEST_CASE("bad layer groupings are refused with the way out", "[fsdp][plan][grouping][errors]") {
  using weft::fsdp::group_layers;
  REQUIRE_THROWS_WITH(group_layers({}, weft::dtype::float32, 100), Catch::Contains("no layers given"));
  REQUIRE_THROWS_WITH(group_layers(layers(), weft::dtype::float32, 0), Catch::Contains("unit_bytes is 0"));
  std::vector<unit_spec> empty{{"a", {{"w", 3}}}, {"b", {}}};
  REQUIRE_THROWS_WITH(group_layers(empty, weft::dtype::float32, 100), Catch::Contains("layer 'b' has no parameters"));
  const auto once = group_layers(layers(), weft::dtype::float32, 2000);
  REQUIRE_THROWS_WITH(group_layers(once.units, weft::dtype::float32, 1 << 20),
                      Catch::Contains("layer 'embed..h.0' is itself a group of layers"));
}
