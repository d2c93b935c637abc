#pragma once
/// \file
/// Everything this build of weft has: the core (types, errors, layouts, bucket plans, tuner,
/// flight recorder and watchdog) always; the MPI backend when built with MPI (WEFT_HAS_MPI); the NCCL backend when built with
/// CUDA and NCCL (WEFT_HAS_NCCL).

#include <weft/config.hpp>

#include <weft/backend/backend.hpp>
#include <weft/checkpoint/async_writer.hpp>
#include <weft/checkpoint/distributed.hpp>
#include <weft/checkpoint/exchange.hpp>
#include <weft/checkpoint/safetensors.hpp>
#include <weft/comm/buffer.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/core/float16.hpp>
#include <weft/core/reduce_op.hpp>
#include <weft/cp/attention_reference.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ring_attention.hpp>
#include <weft/cp/ulysses.hpp>
#include <weft/fsdp/adamw.hpp>
#include <weft/fsdp/hybrid_groups.hpp>
#include <weft/fsdp/options.hpp>
#include <weft/fsdp/schedule.hpp>
#include <weft/fsdp/sharded_model.hpp>
#include <weft/fsdp/unit_grouping.hpp>
#include <weft/fsdp/unit_plan.hpp>
#include <weft/fsdp/unit_sizing.hpp>
#include <weft/fsdp/whole_tensor.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/comm_hook.hpp>
#include <weft/grad/flat_buffer.hpp>
#include <weft/grad/options.hpp>
#include <weft/grad/param_gather.hpp>
#include <weft/grad/step_report.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/layout/layout.hpp>
#include <weft/layout/model_shape.hpp>
#include <weft/layout/node_placement.hpp>
#include <weft/layout/process_groups.hpp>
#include <weft/moe/balance_loss.hpp>
#include <weft/moe/dispatcher.hpp>
#include <weft/moe/experts.hpp>
#include <weft/moe/gemm.hpp>
#include <weft/moe/layer.hpp>
#include <weft/moe/permutation.hpp>
#include <weft/moe/router.hpp>
#include <weft/moe/shape.hpp>
#include <weft/launch/device.hpp>
#include <weft/launch/resolve.hpp>
#include <weft/pipeline/schedules.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/theory.hpp>
#include <weft/tp/collective_matmul.hpp>
#include <weft/tp/linear.hpp>
#include <weft/tp/mappings.hpp>
#include <weft/tp/tensor_view.hpp>
#include <weft/tp/vocab_parallel.hpp>
#include <weft/tune/cost_model.hpp>
#include <weft/tune/hardware.hpp>
#include <weft/tune/hardware_file.hpp>
#include <weft/tune/layout.hpp>
#include <weft/tune/model.hpp>
#include <weft/tune/report.hpp>
#include <weft/tune/search.hpp>
#include <weft/trace/flight_dump.hpp>
#include <weft/trace/flight_recorder.hpp>
#include <weft/trace/trace_diff.hpp>
#include <weft/trace/watchdog.hpp>

#if WEFT_HAS_MPI
#include <weft/backend/mpi/backend.hpp>
#include <weft/launch/mpi_cross_check.hpp>
#include <weft/launch/mpi_environment.hpp>
#endif

#if WEFT_HAS_NCCL
#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/cuda/stream.hpp>
#include <weft/backend/nccl/backend.hpp>
#endif

#if WEFT_HAS_NCCL && WEFT_HAS_MPI
#include <weft/launch/nccl_bootstrap.hpp>
#endif
