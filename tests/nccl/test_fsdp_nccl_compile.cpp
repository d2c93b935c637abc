// The fully sharded model on device memory, compiled by the host compiler with the project's
// warnings: every member of sharded_model<nccl_backend, float | double> instantiated. Compile
// only: the GPU runs are test_fsdp_nccl_gpu (label gpu).
#include <catch2/catch.hpp>

#include <weft/backend/nccl/backend.hpp>
#include <weft/fsdp/sharded_model.hpp>

template class weft::fsdp::sharded_model<weft::nccl_backend, float>;
template class weft::fsdp::sharded_model<weft::nccl_backend, double>;

TEST_CASE("fsdp on NCCL: device memory, the master type gathered") {
  using model = weft::fsdp::sharded_model<weft::nccl_backend, float>;
  STATIC_REQUIRE(model::on_device);
  STATIC_REQUIRE(model::memory == weft::memory_space::device);
  STATIC_REQUIRE(std::is_same_v<model::master_type, float>);
}
