// Invalid layouts, model shapes and node placements are refused with messages that say what to do.
#include <catch2/catch.hpp>

#include <weft/layout/layout.hpp>
#include <weft/layout/model_shape.hpp>
#include <weft/layout/node_placement.hpp>

#include <string>
#include <vector>

namespace wl = weft::layout;
using Catch::Contains;
using wl::group_kind;

namespace {

std::string only_problem(const wl::layout_spec& spec) {
  const std::vector<std::string> problems = wl::validate(spec);
  INFO("problems: " << problems.size());
  REQUIRE(problems.size() == 1);
  return problems.front();
}

}  // namespace

TEST_CASE("degrees whose product does not divide the world size") {
  const std::string p = only_problem({.world_size = 16, .tp = 3, .pp = 4});
  CHECK_THAT(p, Contains("tp=3 x cp=1 x pp=4 = 12 does not divide the world size 16"));
  CHECK_THAT(p, Contains("dp"));
  CHECK_THAT(p, Contains("tp in {1, 2, 4} (keeping cp=1, pp=4)"));
}

TEST_CASE("an explicit dp that does not complete the world size") {
  const std::string p = only_problem({.world_size = 16, .tp = 2, .pp = 4, .dp = 4});
  CHECK_THAT(p, Contains("tp=2 x cp=1 x pp=4 x dp=4 = 32 but the world size is 16"));
  CHECK_THAT(p, Contains("leave dp out to derive it (it would be 2)"));
  CHECK(wl::validate({.world_size = 16, .tp = 2, .pp = 4, .dp = 2}).empty());
}

TEST_CASE("degrees below 1 and a bad world size") {
  CHECK_THAT(only_problem({.world_size = 8, .tp = 0}), Contains("tp=0 is invalid: every degree must be at least 1"));
  CHECK_THAT(only_problem({.world_size = 8, .pp = -2}), Contains("pp=-2 is invalid"));
  CHECK_THAT(only_problem({.world_size = 8, .dp = -1}), Contains("leave it out (0) to derive it"));
  CHECK_THAT(only_problem({.world_size = 0}), Contains("world size 0 is invalid"));
  // Every bad degree is reported at once.
  CHECK(wl::validate({.world_size = 8, .tp = 0, .cp = 0, .ep = 0, .pp = 0}).size() == 4);
}

TEST_CASE("unknown, repeated and empty names in the order") {
  CHECK_THAT(only_problem({.world_size = 8, .order = "tp-xp-dp"}), Contains("unknown dimension 'xp'"));
  CHECK_THAT(only_problem({.world_size = 8, .order = "tp-dp-tp"}), Contains("dimension 'tp' appears more than once"));
  CHECK_THAT(only_problem({.world_size = 8, .order = "tp--dp"}), Contains("empty name"));
  CHECK_THAT(only_problem({.world_size = 8, .order = ""}), Contains("is empty"));
  CHECK_THAT(only_problem({.world_size = 8, .order = "TP-DP"}), Contains("unknown dimension 'TP'"));
  CHECK_THROWS_WITH(wl::dim_order::parse("tp-pp-tp"), Contains("appears more than once"));
}

TEST_CASE("a dimension larger than 1 that the order leaves out") {
  const std::string p = only_problem({.world_size = 16, .pp = 4, .order = "tp-dp"});
  CHECK_THAT(p, Contains("pp=4 but the order 'tp-dp' does not name pp"));
  CHECK_THAT(p, Contains("'tp-dp-pp'"));
  // Leaving out a dimension of size 1 is fine.
  CHECK(wl::validate({.world_size = 16, .tp = 4, .order = "tp-dp"}).empty());
  // dp = 1 but expert-dp = 4 still needs dp in the order.
  CHECK_THAT(only_problem({.world_size = 8, .tp = 8, .expert_tp = 2, .order = "tp-pp"}), Contains("expert-dp=4"));
  CHECK_THAT(only_problem({.world_size = 8, .ep = 2, .order = "tp-dp-pp"}), Contains("ep=2 but the order"));
}

TEST_CASE("expert degrees that do not divide the world size") {
  const std::string p = only_problem({.world_size = 16, .ep = 4, .pp = 4, .expert_tp = 2});
  CHECK_THAT(p, Contains("expert-tp=2 x ep=4 x pp=4 = 32 does not divide the world size 16"));
  CHECK_THAT(p, Contains("ep in {1, 2}"));
}

TEST_CASE("ep and cp together are fine; orders that split the pipeline differently are not") {
  CHECK(wl::validate({.world_size = 16, .cp = 2, .ep = 2, .pp = 2}).empty());
  // Dense stride of pp is cp = 2, expert stride is 1: the stages would differ.
  const std::string p = only_problem({.world_size = 16, .cp = 2, .ep = 2, .pp = 2, .order = "tp-cp-pp-ep-dp"});
  CHECK_THAT(p, Contains("pipeline groups of dense layers (rank 0's is {0, 2}) and of expert layers (rank 0's is {0, 1}) differ"));
  CHECK_THAT(p, Contains("put pp last in the order"));
  // pp not last and dp != expert-dp.
  const std::string q = only_problem({.world_size = 16, .ep = 2, .pp = 2, .order = "tp-pp-ep-dp"});
  CHECK_THAT(q, Contains("dp=8 and expert-dp=4"));
}

TEST_CASE("an invalid spec throws weft::error listing every problem") {
  try {
    const wl::rank_layout layout({.world_size = 16, .tp = 3, .ep = 0});
    FAIL("no exception");
  } catch (const weft::error& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Contains("invalid layout (world size 16)"));
    CHECK_THAT(what, Contains("ep=0 is invalid"));
  }
  const wl::rank_layout layout({.world_size = 4, .tp = 2});
  CHECK_THROWS_WITH(layout.group_of(group_kind::tp, 4), Contains("rank 4 is outside the layout's world of 4 ranks"));
  CHECK_THROWS_AS(layout.coordinates(-1), weft::error);
}

TEST_CASE("the default order keeps tensor parallelism inside nodes") {
  const wl::rank_layout layout({.world_size = 32, .tp = 8, .pp = 2});
  const wl::node_report report = wl::place_on_nodes(layout, 8);
  CHECK(report.node_count == 4);
  CHECK(report.warnings.empty());
  CHECK(report[group_kind::tp].inside_nodes());
  CHECK(report[group_kind::tp].max_nodes == 1);
  CHECK_FALSE(report[group_kind::dp].inside_nodes());
  CHECK(report[group_kind::dp].crossing == 16);
  CHECK(report[group_kind::dp].max_nodes == 2);
  CHECK(report[group_kind::pp].max_nodes == 2);
}

TEST_CASE("an order that puts dp inside nodes and tp across them is flagged") {
  const wl::rank_layout layout({.world_size = 16, .tp = 8, .order = "dp-tp-pp"});
  const wl::node_report report = wl::place_on_nodes(layout, 8);
  CHECK(report[group_kind::tp].crossing == 2);
  CHECK(report[group_kind::dp].inside_nodes());
  REQUIRE(report.warnings.size() == 2);
  CHECK_THAT(report.warnings[0], Contains("TP groups span nodes: 2 of 2 tp groups (size 8)"));
  CHECK_THAT(report.warnings[0], Contains("put tp first in the order"));
  CHECK_THAT(report.warnings[1], Contains("keeps DP groups inside nodes while TP groups cross nodes"));
}

TEST_CASE("tensor parallelism larger than a node, and a partly filled node") {
  const wl::node_report big = wl::place_on_nodes(wl::rank_layout({.world_size = 32, .tp = 16}), 8);
  REQUIRE_FALSE(big.warnings.empty());
  CHECK_THAT(big.warnings[0], Contains("lower tp to at most 8"));
  const wl::node_report uneven = wl::place_on_nodes(wl::rank_layout({.world_size = 12, .tp = 3}), 8);
  CHECK(uneven.node_count == 2);
  CHECK_THAT(uneven.warnings[0], Contains("world size 12 is not a multiple of 8 GPUs per node"));
  CHECK_THAT(uneven.warnings[1], Contains("choose tp dividing 8"));
  CHECK_THROWS_WITH(wl::place_on_nodes(wl::rank_layout({.world_size = 4}), 0), Contains("gpus per node 0 is invalid"));
}

TEST_CASE("expert tensor groups across nodes get their own warning") {
  // Dense tp groups are inside nodes; expert-tp 2 with ep first in the order is strided by ep.
  const wl::rank_layout layout({.world_size = 16, .tp = 2, .ep = 8, .order = "ep-tp-cp-dp-pp"});
  const wl::node_report report = wl::place_on_nodes(layout, 8);
  CHECK_FALSE(report[group_kind::expert_tp].inside_nodes());
  REQUIRE(report.warnings.size() >= 1);
  CHECK_THAT(report.warnings.back(), Contains("expert TP groups span nodes"));
}

TEST_CASE("model shapes that do not split over the layout") {
  const wl::rank_layout layout({.world_size = 32, .tp = 4, .cp = 2, .ep = 2, .pp = 2});
  CHECK(wl::check_model_shape(layout, {.heads = 32, .kv_heads = 8, .layers = 24, .virtual_stages = 3, .experts = 8, .seq_length = 4096}).empty());
  const auto problems = wl::check_model_shape(layout, {.heads = 6, .kv_heads = 2, .layers = 10, .virtual_stages = 2, .experts = 3, .seq_length = 1002});
  REQUIRE(problems.size() == 5);
  CHECK_THAT(problems[0], Contains("6 attention heads do not divide over tp=4: choose tp in {1, 2, 3, 6}"));
  CHECK_THAT(problems[1], Contains("2 key/value heads do not divide over tp=4"));
  CHECK_THAT(problems[2], Contains("10 layers do not divide over pp=2 x virtual stages=2 = 4 model chunks"));
  CHECK_THAT(problems[3], Contains("3 experts do not divide over ep=2"));
  CHECK_THAT(problems[4], Contains("pad the sequence to a multiple of 4"));
  CHECK_THROWS_WITH(wl::require_model_shape(wl::rank_layout({.world_size = 4}), {.virtual_stages = 2}),
                    Contains("virtual stages 2 need pipeline parallelism"));
}

TEST_CASE("virtual stages belong to the layout: checked, carried, and agreed on by every rank") {
  CHECK_THAT(only_problem({.world_size = 8, .tp = 2, .virtual_stages = 2}),
             Contains("virtual stages 2 need pipeline parallelism, but pp=1"));
  CHECK_THAT(only_problem({.world_size = 8, .pp = 2, .virtual_stages = 0}), Contains("virtual stages 0 is invalid"));
  const wl::rank_layout plain({.world_size = 8, .tp = 2, .pp = 2});
  const wl::rank_layout interleaved({.world_size = 8, .tp = 2, .pp = 2, .virtual_stages = 3});
  CHECK(plain.virtual_stages() == 1);
  CHECK(interleaved.virtual_stages() == 3);
  // Same groups, different fingerprints: ranks that disagree on the schedule are caught.
  CHECK(plain.groups(group_kind::pp) == interleaved.groups(group_kind::pp));
  CHECK(plain.fingerprint() != interleaved.fingerprint());
  // Without interleaving the text is what it always was (layouts from before virtual stages agree).
  CHECK(plain.canonical_text() ==
        "weft.layout.v1 world=8 order=tp-cp-ep-dp-pp tp=2 cp=1 dp=2 pp=2 ep=1 expert-tp=2 expert-dp=2");
  // The model shape takes the layout's virtual stages when it gives none, and must agree when it does.
  CHECK_THAT(wl::check_model_shape(interleaved, {.layers = 8}).at(0), Contains("8 layers do not divide over pp=2 x virtual stages=3"));
  CHECK(wl::check_model_shape(interleaved, {.layers = 12}).empty());
  CHECK_THAT(wl::check_model_shape(interleaved, {.layers = 12, .virtual_stages = 2}).at(0),
             Contains("split into 2 virtual stages but the layout has 3"));
}
