// What the NCCL side can show without a GPU: the checked-call macros' exceptions, the group
// guard, the type maps, empty and invalid objects, and the clear errors when no GPU or driver is
// present. On a machine with a GPU the no-GPU cases check the working path instead.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/backend/nccl/check.hpp>
#include <weft/backend/nccl/datatypes.hpp>
#include <weft/backend/nccl/group_guard.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/launch/device.hpp>

#include <cstdlib>
#include <stdexcept>
#include <string>

using Catch::Contains;

// Every member of the synchronizer on device memory compiles (and warns about nothing); the GPU
// test (test_grad_nccl) runs it.
template class weft::grad::synchronizer<weft::nccl_backend, float>;
template class weft::grad::synchronizer<weft::nccl_backend, weft::half>;

namespace {

cudaError_t returns(cudaError_t code) { return code; }

// Whether this process can use a GPU, asked of CUDA directly (not through weft).
bool gpu_usable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

struct rank_for_messages {
  explicit rank_for_messages(int r) { weft::detail::known_world_rank().store(r); }
  ~rank_for_messages() { weft::detail::known_world_rank().store(-1); }
};

}  // namespace

// The watchdog aborts NCCL communicators from its own thread (weft/trace/watchdog.hpp).
static_assert(weft::aborts_from_any_thread<weft::nccl_backend>,
              "the NCCL communicator must give the watchdog an abort action");

TEST_CASE("the watchdog's abort action of an invalid NCCL communicator does nothing", "[nccl]") {
  weft::nccl_backend::comm none;
  weft::trace::abort_action action = none.abort_action();
  REQUIRE(action.run);
  REQUIRE_FALSE(action.ends_process);
  action.run(1);  // no state: nothing to abort, and no crash
  REQUIRE_FALSE(none.valid());
}

TEST_CASE("WEFT_CHECK_CUDA throws CUDA's name and message, the call, where, rank and host", "[nccl][check]") {
  rank_for_messages rank(5);
  int line = 0;
  try {
    line = __LINE__ + 1;
    WEFT_CHECK_CUDA(returns(cudaErrorInvalidValue));
    FAIL("no exception");
  } catch (const weft::backend_error& e) {
    CHECK(e.library() == weft::backend_library::cuda);
    CHECK(e.code() == static_cast<int>(cudaErrorInvalidValue));
    CHECK(e.call() == "returns(cudaErrorInvalidValue)");
    CHECK(e.location().line() == static_cast<unsigned>(line));
    CHECK(e.rank() == 5);
    CHECK(!e.host().empty());
    CHECK_THAT(e.library_message(), Contains("cudaErrorInvalidValue") &&
                                        Contains(cudaGetErrorString(cudaErrorInvalidValue)));
    std::string what = e.what();
    CHECK_THAT(what, Contains("CUDA error " + std::to_string(static_cast<int>(cudaErrorInvalidValue))));
    CHECK_THAT(what, Contains("in returns(cudaErrorInvalidValue) at "));
    CHECK_THAT(what, Contains("test_checks.cpp:" + std::to_string(line)));
    CHECK_THAT(what, Contains("on rank 5 (host " + e.host() + ")"));
  }
  CHECK_NOTHROW(WEFT_CHECK_CUDA(returns(cudaSuccess)));
}

TEST_CASE("WEFT_CHECK_NCCL adds NCCL's own last-error text", "[nccl][check]") {
  rank_for_messages rank(2);
  try {
    WEFT_CHECK_NCCL(ncclGetUniqueId(nullptr), nullptr);
    FAIL("no exception");
  } catch (const weft::backend_error& e) {
    CHECK(e.library() == weft::backend_library::nccl);
    CHECK(e.code() == static_cast<int>(ncclInvalidArgument));
    CHECK(e.call() == "ncclGetUniqueId(nullptr)");
    CHECK_THAT(e.library_message(), Contains(ncclGetErrorString(ncclInvalidArgument)));
    // NCCL's last error names the bad argument; the result string alone would not.
    CHECK_THAT(e.library_message(), Contains("NCCL says: ") && Contains("NULL"));
    std::string what = e.what();
    CHECK_THAT(what, Contains("NCCL error 4 (invalid argument"));
    CHECK_THAT(what, Contains("test_checks.cpp") && Contains("on rank 2"));
  }
  ncclUniqueId id{};
  CHECK_NOTHROW(WEFT_CHECK_NCCL(ncclGetUniqueId(&id), nullptr));
}

TEST_CASE("group_guard always closes the NCCL group", "[nccl][group]") {
  SECTION("end() closes it") {
    weft::nccl::group_guard group;
    group.end();
    group.end();  // a second end() does nothing
  }
  SECTION("an exception inside the group closes it") {
    try {
      weft::nccl::group_guard group;
      throw std::runtime_error("failure between start and end");
    } catch (const std::runtime_error&) {
    }
  }
  // No group is open any more: NCCL refuses an unmatched ncclGroupEnd.
  CHECK(ncclGroupEnd() == ncclInvalidUsage);
}

TEST_CASE("weft's dtypes and reduce ops map to NCCL's", "[nccl]") {
  using weft::dtype;
  using weft::reduce_op;
  using weft::detail::nccl::datatype_of;
  using weft::detail::nccl::op_of;
  CHECK(datatype_of(dtype::float32) == ncclFloat32);
  CHECK(datatype_of(dtype::float64) == ncclFloat64);
  CHECK(datatype_of(dtype::float16) == ncclFloat16);
  CHECK(datatype_of(dtype::bfloat16) == ncclBfloat16);
  CHECK(datatype_of(dtype::int32) == ncclInt32);
  CHECK(datatype_of(dtype::int64) == ncclInt64);
  CHECK(datatype_of(dtype::uint8) == ncclUint8);
  CHECK(op_of(reduce_op::sum) == ncclSum);
  CHECK(op_of(reduce_op::prod) == ncclProd);
  CHECK(op_of(reduce_op::min) == ncclMin);
  CHECK(op_of(reduce_op::max) == ncclMax);
  CHECK(op_of(reduce_op::avg) == ncclAvg);
}

TEST_CASE("an empty NCCL request is complete; an invalid communicator refuses work", "[nccl]") {
  weft::nccl_backend::request request;
  CHECK_FALSE(request.pending());
  CHECK(request.test());
  CHECK_NOTHROW(request.wait());

  weft::nccl_backend::comm comm;
  CHECK_FALSE(comm.valid());
  CHECK(comm.native() == nullptr);
  CHECK(comm.device() == -1);
  CHECK_THROWS_WITH(comm.all_reduce(nullptr, nullptr, 1, weft::dtype::float32, weft::reduce_op::sum,
                                    weft::completion::blocking),
                    Contains("NCCL all_reduce: the communicator is not valid"));
  CHECK_THROWS_WITH(comm.split(0, 0), Contains("NCCL split: the communicator is not valid"));
  CHECK_NOTHROW(comm.abort());  // nothing to abort
  CHECK_THROWS_WITH(comm.send(nullptr, 1, weft::dtype::float32, 0, weft::completion::async),
                    Contains("NCCL send_async") && Contains("batch()"));
  CHECK_THROWS_WITH(comm.recv(nullptr, 1, weft::dtype::float32, 0, weft::completion::async),
                    Contains("NCCL recv_async") && Contains("batch()"));
  CHECK_THROWS_WITH(weft::nccl_backend::comm::init_rank(2, ncclUniqueId{}, 2), Contains("rank 2 is not within 0..1"));
}

TEST_CASE("the NCCL deadline: WEFT_COMM_TIMEOUT, the deprecated WEFT_NCCL_TIMEOUT, else 10 minutes", "[nccl]") {
  using weft::detail::nccl::timeout_from_environment;
  unsetenv("WEFT_COMM_TIMEOUT");
  setenv("WEFT_NCCL_TIMEOUT", "2.5", 1);
  CHECK(timeout_from_environment().count() == 2500);
  setenv("WEFT_COMM_TIMEOUT", "7", 1);
  CHECK(timeout_from_environment().count() == 7000);
  setenv("WEFT_COMM_TIMEOUT", "soon", 1);
  CHECK_THROWS_WITH(timeout_from_environment(), Contains("WEFT_COMM_TIMEOUT='soon' is not a number of seconds"));
  unsetenv("WEFT_COMM_TIMEOUT");
  unsetenv("WEFT_NCCL_TIMEOUT");
  CHECK(timeout_from_environment().count() == 600000);
}

TEST_CASE("without a GPU driver, GPU selection says so clearly", "[nccl][nogpu]") {
  int count = -1;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess) {
    WARN("a GPU driver is present: checking the working path instead");
    weft::launch_info single;
    if (count > 0) CHECK(weft::select_device(single) == 0);
    return;
  }
  // The driver-less facts this relies on: an error code and no count written.
  CHECK(count == -1);
  try {
    weft::visible_device_count();
    FAIL("no exception");
  } catch (const weft::backend_error& e) {
    CHECK(e.library() == weft::backend_library::cuda);
    CHECK(e.code() == static_cast<int>(status));
    CHECK(e.call() == "cudaGetDeviceCount(&count)");
    std::string what = e.what();
    CHECK_THAT(what, Contains(cudaGetErrorName(status)));
    CHECK_THAT(what, Contains("no usable GPU") && Contains("CUDA_VISIBLE_DEVICES=") && Contains("nvidia-smi"));
  }
  CHECK_THROWS_AS(weft::select_device(weft::launch_info{}), weft::backend_error);
}

TEST_CASE("without a GPU, joining an NCCL communicator fails with a clear error", "[nccl][nogpu]") {
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);  // works without a GPU
  if (gpu_usable()) {
    WARN("a GPU is present: checking that a one-rank communicator works instead");
    auto comm = weft::nccl_backend::comm::init_rank(1, id, 0);
    CHECK(comm.valid());
    CHECK(comm.size() == 1);
    return;
  }
  try {
    weft::nccl_backend::comm::init_rank(1, id, 0);
    FAIL("no exception");
  } catch (const weft::backend_error& e) {
    CHECK(e.library() == weft::backend_library::nccl);
    CHECK(e.code() == static_cast<int>(ncclUnhandledCudaError));
    CHECK(e.call() == "ncclCommInitRankConfig(&handle, ranks, id, rank, &config)");
    std::string what = e.what();
    CHECK_THAT(what, Contains(ncclGetErrorString(ncclUnhandledCudaError)));
    CHECK_THAT(what, Contains("joining an NCCL communicator as rank 0 of 1 failed: no usable GPU"));
    int probe = 0;
    CHECK_THAT(what, Contains(cudaGetErrorName(cudaGetDeviceCount(&probe))));
  }
}
