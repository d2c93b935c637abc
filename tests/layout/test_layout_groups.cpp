// Exact groups for hand-worked layouts, including non-default orders and expert layouts.
#include <catch2/catch.hpp>

#include <weft/layout/layout.hpp>

#include <vector>

using weft::layout::group_kind;
using weft::layout::layout_spec;
using weft::layout::rank_layout;
using groups_t = std::vector<std::vector<int>>;

TEST_CASE("default order, tp=2 pp=4 on 16 ranks: tensor ranks adjacent, stages farthest apart") {
  const rank_layout layout({.world_size = 16, .tp = 2, .pp = 4});
  CHECK(layout.dp() == 2);
  CHECK(layout.order().to_string() == "tp-cp-ep-dp-pp");
  CHECK(layout.groups(group_kind::tp) == groups_t{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(layout.groups(group_kind::dp) == groups_t{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(layout.groups(group_kind::pp) == groups_t{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  CHECK(layout.groups(group_kind::tp_pp) == groups_t{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}});
  CHECK(layout.groups(group_kind::tp_dp) == groups_t{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}});
  CHECK(layout.groups(group_kind::embedding) == groups_t{{0, 12}, {1, 13}, {2, 14}, {3, 15}});
  CHECK(layout.groups(group_kind::position_embedding) == groups_t{{0}, {1}, {2}, {3}});
  CHECK(layout.groups(group_kind::cp).size() == 16);
}

TEST_CASE("context parallel on the default order: cp between tp and dp") {
  // Strides: tp 1, cp 2, dp 4, pp 8.
  const rank_layout layout({.world_size = 16, .tp = 2, .cp = 2, .pp = 2});
  CHECK(layout.dp() == 2);
  CHECK(layout.groups(group_kind::cp) == groups_t{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(layout.groups(group_kind::dp) == groups_t{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}});
  CHECK(layout.groups(group_kind::dp_cp) == groups_t{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
  CHECK(layout.groups(group_kind::tp_cp) == groups_t{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}});
  CHECK(layout.groups(group_kind::tp_dp_cp) == groups_t{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}});
  CHECK(layout.groups(group_kind::tp_pp) == groups_t{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}});
  CHECK(layout.groups(group_kind::embedding) == groups_t{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
}

TEST_CASE("order dp-tp-pp: data-parallel ranks adjacent") {
  // Strides: dp 1, tp 2, pp 4.
  const rank_layout layout({.world_size = 8, .tp = 2, .pp = 2, .order = "dp-tp-pp"});
  CHECK(layout.order().to_string() == "dp-tp-pp-cp-ep");
  CHECK(layout.groups(group_kind::dp) == groups_t{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(layout.groups(group_kind::tp) == groups_t{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(layout.groups(group_kind::pp) == groups_t{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  // Inside a tp-dp group dp varies fastest because it comes first in the order.
  CHECK(layout.groups(group_kind::tp_dp) == groups_t{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(layout.groups(group_kind::tp_pp) == groups_t{{0, 2, 4, 6}, {1, 3, 5, 7}});
}

TEST_CASE("order pp-dp-tp: pipeline stages adjacent, tensor ranks farthest apart") {
  // Strides: pp 1, dp 2, tp 4.
  const rank_layout layout({.world_size = 12, .tp = 3, .pp = 2, .order = "pp-dp-tp"});
  CHECK(layout.dp() == 2);
  CHECK(layout.groups(group_kind::tp) == groups_t{{0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {3, 7, 11}});
  CHECK(layout.groups(group_kind::pp) == groups_t{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}});
  CHECK(layout.groups(group_kind::dp) == groups_t{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}});
  CHECK(layout.groups(group_kind::tp_pp) == groups_t{{0, 1, 4, 5, 8, 9}, {2, 3, 6, 7, 10, 11}});
  CHECK(layout.groups(group_kind::embedding) == groups_t{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}});
  CHECK(layout.groups(group_kind::position_embedding) == groups_t{{0}, {2}, {4}, {6}, {8}, {10}});
  const auto c = layout.coordinates(7);  // 7 = pp 1 + dp 1 * 2 + tp 1 * 4
  CHECK(c.pp == 1);
  CHECK(c.dp == 1);
  CHECK(c.tp == 1);
}

TEST_CASE("order tp-pp-dp with cp=1: stages inside a data-parallel replica block") {
  // Strides: tp 2 -> 1, pp 2 -> 2, dp 2 -> 4.
  const rank_layout layout({.world_size = 8, .tp = 2, .pp = 2, .order = "tp-pp-dp"});
  CHECK(layout.groups(group_kind::pp) == groups_t{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(layout.groups(group_kind::dp) == groups_t{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(layout.groups(group_kind::tp_pp) == groups_t{{0, 1, 2, 3}, {4, 5, 6, 7}});
}

TEST_CASE("expert layers: ep carved out of tp x dp, expert-tp defaults to tp") {
  // Expert grid: expert-tp 2 (stride 1), ep 4 (stride 2), expert-dp 2 (stride 8).
  const rank_layout layout({.world_size = 16, .tp = 2, .ep = 4});
  CHECK(layout.dp() == 8);
  CHECK(layout.expert_tp() == 2);
  CHECK(layout.expert_dp() == 2);
  CHECK(layout.groups(group_kind::ep) == groups_t{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
  CHECK(layout.groups(group_kind::expert_tp) == layout.groups(group_kind::tp));
  CHECK(layout.groups(group_kind::expert_dp) ==
        groups_t{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
  CHECK(layout.groups(group_kind::expert_tp_ep) == groups_t{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}});
  // Dense data parallelism still spans all 8 tensor-parallel replicas.
  CHECK(layout.groups(group_kind::dp).front() == std::vector<int>{0, 2, 4, 6, 8, 10, 12, 14});
}

TEST_CASE("expert layers with expert-tp=1 and cp > 1 together") {
  // Dense: tp 2, cp 2, dp 2, pp 1. Expert: expert-tp 1, ep 4 (stride 1), expert-dp 2 (stride 4).
  const rank_layout layout({.world_size = 8, .tp = 2, .cp = 2, .ep = 4, .expert_tp = 1});
  CHECK(layout.expert_dp() == 2);
  CHECK(layout.groups(group_kind::ep) == groups_t{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(layout.groups(group_kind::expert_dp) == groups_t{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(layout.groups(group_kind::expert_tp) == groups_t{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  CHECK(layout.groups(group_kind::cp) == groups_t{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  const auto c = layout.coordinates(6);
  CHECK(c.ep == 2);
  CHECK(c.expert_dp == 1);
  CHECK(c.cp == 1);
  CHECK(c.dp == 1);
}

TEST_CASE("pp=1: the embedding group of a rank is the rank itself") {
  const rank_layout layout({.world_size = 4, .tp = 2});
  CHECK(layout.groups(group_kind::embedding) == groups_t{{0}, {1}, {2}, {3}});
  CHECK(layout.group_of(group_kind::embedding, 3).ranks == std::vector<int>{3});
  CHECK(layout.group_of(group_kind::embedding, 3).position == 0);
}

TEST_CASE("one rank's view: index, position and membership of every kind, in creation order") {
  const rank_layout layout({.world_size = 16, .tp = 2, .pp = 4});
  const auto all = layout.rank_groups(13);  // tp 1, dp 0, pp 3
  REQUIRE(all.size() == weft::layout::all_group_kinds.size());
  for (std::size_t i = 0; i < all.size(); ++i) CHECK(all[i].kind == weft::layout::all_group_kinds[i]);
  CHECK(all[0].name() == "tp");
  CHECK(all[0].ranks == std::vector<int>{12, 13});
  CHECK(all[0].index == 6);
  CHECK(all[0].position == 1);
  const auto pp = layout.group_of(group_kind::pp, 13);
  CHECK(pp.ranks == std::vector<int>{1, 5, 9, 13});
  CHECK(pp.position == 3);
  const auto embedding = layout.group_of(group_kind::embedding, 13);
  CHECK(embedding.member());
  CHECK(embedding.ranks == std::vector<int>{1, 13});
  CHECK(embedding.position == 1);
  CHECK_FALSE(layout.group_of(group_kind::position_embedding, 13).member());
  CHECK(layout.group_of(group_kind::position_embedding, 13).ranks.empty());
  CHECK_FALSE(layout.group_of(group_kind::embedding, 5).member());  // a middle stage
  CHECK(layout.group_of(group_kind::position_embedding, 1).ranks == std::vector<int>{1});
}
