// The cluster health check: run it on the nodes of a job before training on them.
//
// It all-reduces 512 MiB of float32 (10 warm-up rounds, then 100 timed rounds, each started from a
// barrier), checks every element of the result, and reports the average time per round with the
// algorithm and bus bandwidth in GB/s and Gb/s, then each rank's own timing and host, so that one
// slow rank or node stands out: a rank is marked `<- slowest` when both its mean and its fastest
// round in the all-reduce are over 1.25 x the median rank's (the rule that singles a rank out in
// the verdict too): slower every round, not in one late round, which `<- jitter` marks. When
// the ranks span several hosts it also times the same all-reduce inside each host, which tells a
// slow host apart from a slow network.
//
// The reference thresholds are those operators use for 512 MB over 64 H100 GPUs on 400 Gb/s
// InfiniBand: under 5 ms is healthy, over 10 ms means the network is broken. Above --fail-ms (or
// with a wrong result) the program says what is likely wrong and exits non-zero:
//   0  healthy (or only above --expect-ms: a warning)
//   1  bad command line
//   2  slower than --fail-ms
//   3  wrong all-reduce result
//   4  an error inside MPI or weft (every rank is aborted)
//   124  an operation passed its deadline (--comm-timeout or WEFT_COMM_TIMEOUT, default 10 minutes):
//        a rank that never joined; every rank dumps weft-flight-<rank>.json ($WEFT_TRACE_DIR).
//        Every exchange between the ranks, from the start-up to the final status, goes through a
//        weft communicator, so each one has the deadline: no phase can hang.
//
//   mpirun -n 64 health_check                          # the reference run
//   mpirun -n 4 health_check --bytes 64M --rounds 20 --expect-ms 200 --fail-ms 1000
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "all_reduce_timing.hpp"
#include "command_line.hpp"
#include "json_output.hpp"

namespace {

using weft_programs::parse_bytes;
using weft_programs::parse_integer;
using weft_programs::parse_real;
using weft_programs::usage_error;
using weft_programs::all_reduce_platform;
using weft_programs::bus_factor;
using weft_programs::clock_type;
using weft_programs::control_comm;
using weft_programs::median;
using weft_programs::seconds_since;

struct options {
  std::size_t bytes = std::size_t{512} << 20;
  int warmup = 10;
  int rounds = 100;
  double expect_ms = 5.0;
  double fail_ms = 10.0;
  int host_rounds = 10;
  std::string backend = "auto";
  std::string json_path;
  std::optional<std::chrono::milliseconds> comm_timeout;  // --comm-timeout, else WEFT_COMM_TIMEOUT
  bool help = false;
};

constexpr const char* usage_text =
    "usage: mpirun -n RANKS health_check [options]\n"
    "  --bytes SIZE       all-reduce size in bytes, float32 (K, M, G suffixes) [512M]\n"
    "  --warmup N         untimed rounds first [10]\n"
    "  --rounds N         timed rounds [100]\n"
    "  --expect-ms T      a healthy cluster averages below T ms per round; above it: a warning [5]\n"
    "  --fail-ms T        above T ms per round the check fails (exit 2) [10]\n"
    "  --host-rounds N    rounds of the per-host all-reduce when ranks span several hosts (0: skip) [10]\n"
    "  --backend NAME     nccl (GPU buffers), mpi (host buffers), or auto: nccl when every rank sees a GPU [auto]\n"
    "  --json FILE        also write the results as JSON\n"
    "  --comm-timeout S   deadline of each all-reduce in seconds; a rank that never joins makes the others\n"
    "                     dump their flight recorders and end the job (exit 124); 0: none [WEFT_COMM_TIMEOUT, else 600]\n"
    "The default thresholds are for 512 MiB over 64 H100 on 400 Gb/s InfiniBand; set your own for\n"
    "other sizes and hardware.\n";

// Rounds: up to 2^24, far beyond any useful check. Thresholds: from a nanosecond up.
constexpr int most_rounds = 1 << 24;
constexpr double least_threshold_ms = 1e-6;
constexpr double most_threshold_ms = std::numeric_limits<double>::max();

options parse(int argc, char** argv) {
  options o;
  for (weft_programs::option_walker args(argc, argv); args.next();) {
    const std::string& arg = args.name();
    auto next = [&] { return args.value(); };
    if (arg == "--bytes") o.bytes = parse_bytes(arg, next());
    else if (arg == "--warmup") o.warmup = parse_integer(arg, next(), 0, most_rounds);
    else if (arg == "--rounds") o.rounds = parse_integer(arg, next(), 1, most_rounds);
    else if (arg == "--expect-ms") o.expect_ms = parse_real(arg, next(), least_threshold_ms, most_threshold_ms);
    else if (arg == "--fail-ms") o.fail_ms = parse_real(arg, next(), least_threshold_ms, most_threshold_ms);
    else if (arg == "--host-rounds") o.host_rounds = parse_integer(arg, next(), 0, most_rounds);
    else if (arg == "--backend") o.backend = next();
    else if (arg == "--json") o.json_path = next();
    else if (arg == "--comm-timeout") o.comm_timeout = weft_programs::parse_comm_timeout_flag(arg, next());
    else if (arg == "-h" || arg == "--help") o.help = true;
    else throw usage_error("unknown option '" + arg + "'");
  }
  if (o.bytes < sizeof(float)) throw usage_error("--bytes must hold at least one float (4 bytes)");
  if (o.backend != "auto" && o.backend != "mpi" && o.backend != "nccl")
    throw usage_error("--backend: unknown backend '" + o.backend + "' (nccl, mpi or auto)");
#if !WEFT_HAS_NCCL
  if (o.backend == "nccl") throw usage_error("--backend nccl: this build of weft has no NCCL backend");
#endif
  if (o.fail_ms < o.expect_ms)
    throw usage_error("--fail-ms (" + std::to_string(o.fail_ms) + ") is below --expect-ms (" +
                      std::to_string(o.expect_ms) + ")");
  return o;
}

/// What one rank measured, gathered on rank 0.
struct rank_report {
  double mean_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  double copy_gbps = 0;  // local memory copy bandwidth, GB/s
  double wrong = 0;      // wrong elements seen by this rank
  double host_index = 0;
  double host_busbw = 0;  // this host's own all-reduce bus bandwidth, GB/s (0: not measured)
};
constexpr int report_fields = 7;

std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), pattern, value);
  return text;
}

template <class B>
int run(const options& o, control_comm& control) {
  using support = all_reduce_platform<B>;
  std::optional<typename support::comm_type> made;
  auto& world = support::world(control, made);
  if (o.comm_timeout) world.set_timeout(*o.comm_timeout);
  const int rank = world.rank();
  const int ranks = world.size();

  // Hosts, numbered in order of first appearance.
  const weft_programs::rank_hosts placement = weft_programs::gather_hosts(control, weft_programs::host_name());
  const std::vector<std::string>& host_of = placement.host_of;
  const std::vector<std::string>& hosts = placement.hosts;
  const int my_host = placement.index_of[static_cast<std::size_t>(rank)];

  const std::size_t count = o.bytes / sizeof(float);
  const double bytes = static_cast<double>(count * sizeof(float));
  auto send_buffer = support::allocate(count);
  auto recv_buffer = support::allocate(count);
  support::fill(send_buffer, rank);
  const double copy_gbps = support::copy_gbps(send_buffer, recv_buffer);
  const weft_programs::all_reduce_rounds timed =
      weft_programs::time_all_reduce<support>(world, control, send_buffer, recv_buffer, o.warmup, o.rounds);
  const std::vector<double>& round_s = timed.round_s;
  const std::size_t wrong = timed.wrong;

  // A round lasts as long as its slowest rank.
  std::vector<double> slowest(round_s);
  control.all_reduce(slowest, weft::reduce_op::max);

  // The same all-reduce inside each host: tells a slow host apart from a slow network.
  double host_busbw = 0;
  if (hosts.size() > 1 && o.host_rounds > 0) {
    auto local = world.split(my_host, rank, "host");
    if (local->size() > 1) {
      const auto host_rounds = weft_programs::time_all_reduce<support>(*local, *local, send_buffer, recv_buffer, 2,
                                                                        o.host_rounds);
      double total = 0;
      for (double s : host_rounds.round_s) total += s;
      // This rank's view; rank 0 takes the slowest rank of each host.
      host_busbw = bytes / (total / o.host_rounds) / 1e9 * bus_factor(local->size());
    }
  }

  rank_report mine;
  mine.mean_ms = 1e3 * [&] {
    double sum = 0;
    for (double s : round_s) sum += s;
    return sum / static_cast<double>(round_s.size());
  }();
  mine.min_ms = 1e3 * *std::min_element(round_s.begin(), round_s.end());
  mine.max_ms = 1e3 * *std::max_element(round_s.begin(), round_s.end());
  mine.copy_gbps = copy_gbps;
  mine.wrong = static_cast<double>(wrong);
  mine.host_index = my_host;
  mine.host_busbw = host_busbw;
  const std::vector<double> fields = {mine.mean_ms, mine.min_ms,     mine.max_ms,   mine.copy_gbps,
                                      mine.wrong,   mine.host_index, mine.host_busbw};
  std::vector<double> gathered(static_cast<std::size_t>(report_fields * ranks));
  control.all_gather(fields, gathered);

  int status = 0;
  if (rank == 0) {
    std::vector<rank_report> reports(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      const double* f = &gathered[static_cast<std::size_t>(r * report_fields)];
      reports[static_cast<std::size_t>(r)] = {f[0], f[1], f[2], f[3], f[4], f[5], f[6]};
    }
    double avg_s = 0;
    for (double s : slowest) avg_s += s;
    avg_s /= o.rounds;
    const double avg_ms = avg_s * 1e3;
    const double min_ms = 1e3 * *std::min_element(slowest.begin(), slowest.end());
    const double max_ms = 1e3 * *std::max_element(slowest.begin(), slowest.end());
    const double algbw = bytes / avg_s / 1e9;
    const double busbw = algbw * bus_factor(ranks);
    double total_wrong = 0;
    std::string wrong_ranks;
    int slowest_rank = 0;
    std::vector<double> means, fastest_rounds, copies, max_rounds;
    for (int r = 0; r < ranks; ++r) {
      const rank_report& rep = reports[static_cast<std::size_t>(r)];
      total_wrong += rep.wrong;
      if (rep.wrong > 0) wrong_ranks += (wrong_ranks.empty() ? "" : ", ") + std::to_string(r);
      if (rep.mean_ms > reports[static_cast<std::size_t>(slowest_rank)].mean_ms) slowest_rank = r;
      means.push_back(rep.mean_ms);
      fastest_rounds.push_back(rep.min_ms);
      copies.push_back(rep.copy_gbps);
      max_rounds.push_back(rep.max_ms);
    }
    const double median_copy = median(copies);
    const double median_max_round = median(max_rounds);
    // A rank stands out when it spends over 1.25 x the median rank's time in the all-reduce, in
    // its mean and in its fastest round alike: one late round (a rank descheduled once, on an
    // oversubscribed node) raises the mean alone, and so once marked a healthy rank here.
    const double median_mean = median(means);
    const rank_report& candidate = reports[static_cast<std::size_t>(slowest_rank)];
    const bool slowest_stands_out = ranks > 1 && candidate.mean_ms > 1.25 * median_mean &&
                                    candidate.min_ms > 1.25 * median(fastest_rounds);

    std::printf("weft health check: all-reduce of %zu bytes (%zu float32) over %d ranks on %zu host%s, %s backend\n",
                count * sizeof(float), count, ranks, hosts.size(), hosts.size() == 1 ? "" : "s", support::name);
    std::printf("  %d warm-up rounds, %d timed rounds, each from a barrier; a round lasts as long as its slowest rank\n\n",
                o.warmup, o.rounds);
    std::printf("  average time   %10.3f ms   (fastest round %.3f ms, slowest %.3f ms)\n", avg_ms, min_ms, max_ms);
    std::printf("  algbw          %10.3f GB/s = %10.3f Gb/s\n", algbw, algbw * 8);
    std::printf("  busbw          %10.3f GB/s = %10.3f Gb/s   (algbw x 2(n-1)/n)\n\n", busbw, busbw * 8);

    std::printf("  per rank: its own time in the all-reduce (mean, min, max over rounds), local memory copy bandwidth\n");
    std::printf("  %6s  %-24s %10s %10s %10s %12s%s\n", "rank", "host", "mean ms", "min ms", "max ms", "copy GB/s",
                hosts.size() > 1 ? "   host busbw GB/s" : "");
    for (int r = 0; r < ranks; ++r) {
      const rank_report& rep = reports[static_cast<std::size_t>(r)];
      std::string notes;
      if (r == slowest_rank && slowest_stands_out) notes += "  <- slowest";
      if (rep.copy_gbps < 0.5 * median_copy) notes += "  <- slow local memory";
      if (rep.max_ms > 3.0 * median_max_round && rep.max_ms > 1.5 * rep.mean_ms) notes += "  <- jitter";
      if (rep.wrong > 0) notes += "  <- WRONG RESULTS";
      std::string host_bw = hosts.size() > 1 ? format("   %15.3f", rep.host_busbw) : "";
      std::printf("  %6d  %-24s %10.3f %10.3f %10.3f %12.2f%s%s\n", r, host_of[static_cast<std::size_t>(r)].c_str(),
                  rep.mean_ms, rep.min_ms, rep.max_ms, rep.copy_gbps, host_bw.c_str(), notes.c_str());
    }
    std::printf("\n");

    // ---- verdict and likely causes ----
    std::vector<std::string> causes;
    if (total_wrong > 0) {
      status = 3;
      causes.push_back("the all-reduce returned wrong values (" + format("%.0f", total_wrong) +
                       " wrong elements, on ranks " + wrong_ranks +
                       "): suspect faulty memory or GPU on those ranks, or a transport that corrupts data; do not "
                       "train on these nodes");
    }
    const bool too_slow = avg_ms > o.fail_ms;
    const bool slow = avg_ms > o.expect_ms;
    if (too_slow && status == 0) status = 2;
    if (slow) {
      // Which ranks or hosts stand out?
      const rank_report& worst = reports[static_cast<std::size_t>(slowest_rank)];
      bool singled_out = false;
      if (slowest_stands_out) {
        causes.push_back("rank " + std::to_string(slowest_rank) + " on " + host_of[static_cast<std::size_t>(slowest_rank)] +
                         " spends " + format("%.2f", worst.mean_ms / median_mean) +
                         "x the median time in the all-reduce: check that rank's node (other processes, CPU or GPU "
                         "clocks, its network link)");
        singled_out = true;
      }
      for (int r = 0; r < ranks; ++r) {
        if (reports[static_cast<std::size_t>(r)].copy_gbps < 0.5 * median_copy) {
          causes.push_back("rank " + std::to_string(r) + " on " + host_of[static_cast<std::size_t>(r)] +
                           " copies memory at " + format("%.1f", reports[static_cast<std::size_t>(r)].copy_gbps) +
                           " GB/s against a median of " + format("%.1f", median_copy) +
                           " GB/s: that node is slow or overloaded");
          singled_out = true;
        }
      }
      if (hosts.size() > 1 && o.host_rounds > 0) {
        // A host's own bandwidth is what its slowest rank saw.
        std::vector<double> per_host(hosts.size(), 0.0);
        for (const rank_report& rep : reports) {
          double& h = per_host[static_cast<std::size_t>(rep.host_index)];
          if (rep.host_busbw > 0) h = h > 0 ? std::min(h, rep.host_busbw) : rep.host_busbw;
        }
        std::vector<double> host_bw;
        for (double bw : per_host)
          if (bw > 0) host_bw.push_back(bw);
        const double median_host = median(host_bw);
        for (std::size_t h = 0; h < hosts.size(); ++h) {
          if (per_host[h] > 0 && per_host[h] < 0.5 * median_host) {
            causes.push_back("host " + hosts[h] + " is slow even on its own (all-reduce inside the host: " +
                             format("%.2f", per_host[h]) + " GB/s busbw, median host " + format("%.2f", median_host) +
                             " GB/s): check its GPUs and their links (nvidia-smi topo -m, NVLink errors, PCIe width)");
            singled_out = true;
          }
        }
        if (!singled_out && !host_bw.empty() && median_host > 2.0 * busbw)
          causes.push_back("every host is fast on its own (" + format("%.2f", median_host) +
                           " GB/s busbw inside a host against " + format("%.2f", busbw) +
                           " GB/s across hosts): the inter-node network is the problem");
      }
      if (!singled_out) {
        if (hosts.size() == 1) {
          causes.push_back("all ranks are on one host, so no network is involved: the time is that of the host's "
                           "own links (shared memory, PCIe, NVLink); check for other jobs on the host, CPU binding "
                           "and GPU topology, or whether the thresholds suit this size and hardware");
        } else {
          causes.push_back(
              "all ranks are uniformly slow, which points at the network configuration rather than one node: "
              "check that the traffic uses InfiniBand/RoCE and not TCP over a slow Ethernet interface (with NCCL, "
              "NCCL_DEBUG=INFO shows NET/IB or NET/Socket; NCCL_SOCKET_IFNAME must name the fast interface, "
              "NCCL_IB_HCA the right adapters, NCCL_IB_DISABLE must not be set, GPUDirect RDMA (nvidia-peermem) "
              "should be loaded; with MPI, check UCX_NET_DEVICES or OMPI_MCA_btl_tcp_if_include), link speeds "
              "(ibstat: 400 Gb/s Active), and that the job is not spread across distant switches");
        }
      }
    }

    const char* verdict = status == 3 ? "FAILED: wrong results"
                          : too_slow  ? "FAILED: too slow"
                          : slow      ? "WARNING: slower than expected"
                                      : "OK";
    std::printf("  result: %s (%.0f wrong elements)\n", total_wrong == 0 ? "correct on every rank" : "WRONG",
                total_wrong);
    std::printf("  verdict: %s (average %.3f ms; expected under %.3f ms, failure above %.3f ms)\n", verdict, avg_ms,
                o.expect_ms, o.fail_ms);
    if (!causes.empty()) {
      std::printf("  likely cause%s:\n", causes.size() > 1 ? "s" : "");
      for (const std::string& c : causes) std::printf("   - %s\n", c.c_str());
      if (slow)
        std::printf("  (the default thresholds, 5 and 10 ms, are for 512 MiB over 64 H100 on 400 Gb/s InfiniBand; "
                    "pass --expect-ms and --fail-ms for other sizes and hardware)\n");
    }
    std::fflush(stdout);

    if (!o.json_path.empty()) {
      std::ofstream out = weft_programs::open_json_output(o.json_path);
      out << "{\"bytes\": " << count * sizeof(float) << ", \"ranks\": " << ranks << ", \"hosts\": " << hosts.size()
          << ", \"backend\": \"" << support::name << "\", \"warmup\": " << o.warmup << ", \"rounds\": " << o.rounds
          << ", \"avg_ms\": " << avg_ms << ", \"min_ms\": " << min_ms << ", \"max_ms\": " << max_ms
          << ", \"algbw_GBps\": " << algbw << ", \"busbw_GBps\": " << busbw << ", \"algbw_Gbps\": " << algbw * 8
          << ", \"busbw_Gbps\": " << busbw * 8 << ", \"expect_ms\": " << o.expect_ms << ", \"fail_ms\": " << o.fail_ms
          << ", \"wrong\": " << static_cast<long long>(total_wrong) << ", \"status\": \""
          << (status == 3 ? "wrong" : too_slow ? "failed" : slow ? "slow" : "ok") << "\", \"per_rank\": [";
      for (int r = 0; r < ranks; ++r) {
        const rank_report& rep = reports[static_cast<std::size_t>(r)];
        std::string name = host_of[static_cast<std::size_t>(r)];
        std::string escaped;
        for (char c : name) {
          if (c == '"' || c == '\\') escaped += '\\';
          escaped += c;
        }
        out << (r == 0 ? "" : ", ") << "{\"rank\": " << r << ", \"host\": \"" << escaped
            << "\", \"mean_ms\": " << rep.mean_ms << ", \"min_ms\": " << rep.min_ms << ", \"max_ms\": " << rep.max_ms
            << ", \"copy_GBps\": " << rep.copy_gbps << ", \"host_busbw_GBps\": " << rep.host_busbw
            << ", \"wrong\": " << static_cast<long long>(rep.wrong) << ", \"slowest\": "
            << (r == slowest_rank ? "true" : "false") << "}";
      }
      out << "]}\n";
      if (!out) throw std::runtime_error("cannot write '" + o.json_path + "'");
    }
  }
  control.broadcast(std::span<int>(&status, 1), 0);
  // The ranks leave together: one stopped after the status would otherwise leave the others in
  // MPI_Finalize, which has no deadline.
  control.barrier();
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr int exit_aborted = 4;  // the exit statuses: at the top of this file
  return weft_programs::mpi_main(
      "health_check", usage_text, argc, argv,
      [&](int rank) {
        const options o = parse(argc, argv);
        if (o.help) {
          if (rank == 0) std::printf("%s", usage_text);
          return 0;
        }
        // The timed collectives measure the fabric, so they carry no call agreement unless
        // WEFT_CHECK_LEVEL asks for one (every rank passes the sizes this program computes alike).
        control_comm control(weft::mpi_backend::comm::world(o.comm_timeout), "world",
                             weft::check_level_from_environment().value_or(weft::check_level::local), o.comm_timeout);
        std::string backend = o.backend;
        if (backend == "auto") backend = weft_programs::every_rank_has_gpu(control) ? "nccl" : "mpi";
#if WEFT_HAS_NCCL
        if (backend == "nccl") return run<weft::nccl_backend>(o, control);
#endif
        return run<weft::mpi_backend>(o, control);
      },
      exit_aborted);
}
