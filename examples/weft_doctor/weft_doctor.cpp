// weft-doctor: the cluster readiness checklist as one command. Launched with srun / mpirun across
// the nodes to check (or alone on one node), it checks each node's GPUs, topology, RDMA ports,
// NCCL's variables, limits and Slurm's view of the job, times the storage the job reads its data
// from and saves its checkpoints to, and measures the collectives (all-reduce inside and across
// nodes, p2p between every pair of nodes) and the GEMM throughput of each rank. Every check ends
// PASS, WARN, FAIL or SKIP with the measured and the expected value and what to fix
// (docs/doctor.md). Exit status:
//   0  nothing failed (warnings allowed)
//   1  a check failed
//   2  the checks could not run (a bad command line, an error inside MPI or weft)
//   124  a collective passed its deadline (--comm-timeout or WEFT_COMM_TIMEOUT)
//
// Testing only: WEFT_DOCTOR_NODE replaces the node name (host name) a rank reports, and
// WEFT_DOCTOR_DRIVER_VERSION the NVIDIA driver version, so that the comparison across nodes can
// be tested on one machine.
//
//   srun --mpi=pmix -N 16 --ntasks-per-node 8 weft-doctor --data-dir /data --checkpoint-dir /ckpt
//   mpirun -n 4 weft-doctor --quick --json doctor.json
#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#if WEFT_DOCTOR_HAS_CBLAS
#include <cblas.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <weft/tp/linear.hpp>

#include "all_reduce_timing.hpp"
#include "checks.hpp"
#include "command_line.hpp"
#include "gpu_checks.hpp"
#include "json_output.hpp"

namespace {

using namespace weft_doctor;
using weft_programs::clock_type;
using weft_programs::control_comm;
using weft_programs::median;
using weft_programs::seconds_since;
using weft_programs::usage_error;

struct options {
  double expect_link_gbps = 400;
  std::string data_dir;
  std::string checkpoint_dir;
  double tokens_per_s = 0;  // per rank; 0: the figure of 50 MB/s per GPU
  int bytes_per_token = 2;
  std::optional<double> checkpoint_bytes;  // the whole checkpoint; else 15 GB per rank (500 MB/s x 30 s)
  double max_save_s = 30;
  std::optional<std::size_t> storage_bytes;
  std::optional<double> storage_seconds;
  std::optional<std::size_t> bytes;
  std::optional<int> rounds;
  std::optional<int> gemm_size;
  std::string sysfs_root = "/sys";
  std::string proc_root = "/proc";
  bool quick = false;
  std::string json_path;
  std::optional<std::chrono::milliseconds> comm_timeout;
  bool help = false;
};

constexpr const char* usage_text =
    "usage: srun weft-doctor [options]   or   mpirun -n RANKS weft-doctor [options]   or   weft-doctor [options]\n"
    "  --expect-link-gbps G   the rate every InfiniBand/RoCE port should run at, Gb/s [400]\n"
    "  --data-dir DIR         time direct-I/O reads and writes of the training data's storage\n"
    "  --checkpoint-dir DIR   time direct-I/O writes and reads of the checkpoints' storage\n"
    "  --tokens-per-s N       tokens each rank trains on per second; the data must be read that fast\n"
    "                         [unset: 50 MB/s per rank]\n"
    "  --bytes-per-token N    bytes a token takes in the data files [2]\n"
    "  --checkpoint-size SIZE the whole checkpoint (K, M, G suffixes) [15G per rank]\n"
    "  --max-save-s S         a checkpoint must save within S seconds [30]\n"
    "  --storage-bytes SIZE   most bytes written and read back per directory and node [1G; --quick 256M]\n"
    "  --storage-seconds S    most seconds spent writing, and reading, per directory [10; --quick 3]\n"
    "  --bytes SIZE           all-reduce size (float32) [512M; --quick 64M]\n"
    "  --rounds N             timed all-reduce rounds [20; --quick 5]\n"
    "  --gemm-size N          the GEMM's n x n x n size [1024; --quick 512]\n"
    "  --sysfs-root DIR       read sysfs from DIR instead of /sys (a fake tree, for tests)\n"
    "  --proc-root DIR        read procfs from DIR instead of /proc (a fake tree, for tests)\n"
    "  --quick                smaller measurements (about a tenth of the time)\n"
    "  --json FILE            also write {\"checks\": [{name, status, value, expected, fix, node}...]} to FILE\n"
    "  --comm-timeout S       deadline of each collective in seconds (0: none) [WEFT_COMM_TIMEOUT, else 600]\n"
    "Exit status: 0 nothing failed (warnings allowed), 1 a check failed, 2 the checks could not run.\n"
    "See docs/doctor.md for each check and how to fix what it flags.\n";

constexpr double mb = 1e6;
constexpr double data_rate_per_rank = 50 * mb;       // each GPU reads 50-100 MB/s from the data loader
constexpr double checkpoint_rate_per_rank = 500 * mb;  // checkpoint bursts of 500+ MB/s per GPU

std::string existing_directory(const std::string& flag, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec))
    throw usage_error(flag + ": '" + path + "' is not a directory");
  return path;
}

options parse(int argc, char** argv) {
  using weft_programs::parse_bytes;
  using weft_programs::parse_integer;
  using weft_programs::parse_real;
  options o;
  constexpr double most = std::numeric_limits<double>::max();
  for (weft_programs::option_walker args(argc, argv); args.next();) {
    const std::string& arg = args.name();
    auto next = [&] { return args.value(); };
    if (arg == "--expect-link-gbps") o.expect_link_gbps = parse_real(arg, next(), 1e-3, 1e6);
    else if (arg == "--data-dir") o.data_dir = existing_directory(arg, next());
    else if (arg == "--checkpoint-dir") o.checkpoint_dir = existing_directory(arg, next());
    else if (arg == "--tokens-per-s") o.tokens_per_s = parse_real(arg, next(), 1e-3, 1e12);
    else if (arg == "--bytes-per-token") o.bytes_per_token = parse_integer(arg, next(), 1, 64);
    else if (arg == "--checkpoint-size") {
      const std::size_t size = parse_bytes(arg, next());
      if (size == 0) throw usage_error("--checkpoint-size must be at least 1 byte");
      o.checkpoint_bytes = static_cast<double>(size);
    } else if (arg == "--max-save-s") o.max_save_s = parse_real(arg, next(), 1e-3, most);
    else if (arg == "--storage-bytes") {
      o.storage_bytes = parse_bytes(arg, next());
      if (*o.storage_bytes < 4096 || *o.storage_bytes > (std::size_t{1} << 40))
        throw usage_error("--storage-bytes expects a size from 4K to 1024G");
    } else if (arg == "--storage-seconds") o.storage_seconds = parse_real(arg, next(), 0.01, 3600);
    else if (arg == "--bytes") {
      o.bytes = parse_bytes(arg, next());
      if (*o.bytes < sizeof(float)) throw usage_error("--bytes must hold at least one float (4 bytes)");
    } else if (arg == "--rounds") o.rounds = parse_integer(arg, next(), 1, 1 << 20);
    else if (arg == "--gemm-size") o.gemm_size = parse_integer(arg, next(), 1, 16384);
    else if (arg == "--sysfs-root") o.sysfs_root = existing_directory(arg, next());
    else if (arg == "--proc-root") o.proc_root = existing_directory(arg, next());
    else if (arg == "--quick") o.quick = true;
    else if (arg == "--json") o.json_path = next();
    else if (arg == "--comm-timeout") o.comm_timeout = weft_programs::parse_comm_timeout_flag(arg, next());
    else if (arg == "-h" || arg == "--help") o.help = true;
    else throw weft_programs::unknown_option(arg, usage_text);
  }
  if (!o.storage_bytes) o.storage_bytes = o.quick ? std::size_t{256} << 20 : std::size_t{1} << 30;
  if (!o.storage_seconds) o.storage_seconds = o.quick ? 3.0 : 10.0;
  if (!o.bytes) o.bytes = o.quick ? std::size_t{64} << 20 : std::size_t{512} << 20;
  if (!o.rounds) o.rounds = o.quick ? 5 : 20;
  if (!o.gemm_size) o.gemm_size = o.quick ? 512 : 1024;
  return o;
}

std::string rate_text(double bytes_per_s) { return number(bytes_per_s / mb, "%.0f") + " MB/s"; }

// ---- storage ----

struct storage_result {
  double write_Bps = 0, read_Bps = 0;
  std::size_t bytes = 0;
  bool direct = true;
  std::size_t wrong_blocks = 0;
  std::string error;
};

/// Writes up to `limit` bytes to a new file in `dir` and reads them back, each direction for at
/// most `seconds`, with O_DIRECT so that the page cache does not stand in for the storage (where
/// the file system refuses O_DIRECT, e.g. tmpfs: buffered, synced, and dropped from the cache).
storage_result time_storage(const std::string& dir, const std::string& tag, std::size_t limit, double seconds) {
  storage_result r;
  constexpr std::size_t alignment = 4096;
  const std::size_t block = std::min<std::size_t>(std::size_t{4} << 20, (limit + alignment - 1) / alignment * alignment);
  void* memory = nullptr;
  if (posix_memalign(&memory, alignment, block) != 0) throw std::bad_alloc();
  std::unique_ptr<void, decltype(&std::free)> owned(memory, &std::free);
  auto* words = static_cast<std::uint64_t*>(memory);
  const std::string path = (std::filesystem::path(dir) / (".weft-doctor-" + tag + ".tmp")).string();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  if (fd < 0 && errno == EINVAL) {
    r.direct = false;
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  }
  if (fd < 0) {
    r.error = "cannot create a file in " + dir + ": " + std::strerror(errno);
    return r;
  }
  struct unlink_at_end {
    std::string path;
    ~unlink_at_end() { ::unlink(path.c_str()); }
  } remove{path};
  // Block b holds b in every word: a block read back from the wrong place or torn shows.
  std::size_t blocks = 0;
  auto start = clock_type::now();
  while (blocks * block < limit && (blocks == 0 || seconds_since(start) < seconds)) {
    std::fill(words, words + block / sizeof(std::uint64_t), blocks);
    const ssize_t done = ::write(fd, memory, block);
    if (done != static_cast<ssize_t>(block)) {
      r.error = "writing " + path + ": " + (done < 0 ? std::strerror(errno) : std::string("short write"));
      ::close(fd);
      return r;
    }
    ++blocks;
  }
  if (::fdatasync(fd) != 0) r.error = "fdatasync " + path + ": " + std::strerror(errno);
  r.write_Bps = static_cast<double>(blocks * block) / seconds_since(start);
  if (!r.direct) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  r.bytes = blocks * block;
  fd = ::open(path.c_str(), O_RDONLY | (r.direct ? O_DIRECT : 0));
  if (fd < 0) {
    r.error = "cannot read back " + path + ": " + std::strerror(errno);
    return r;
  }
  if (!r.direct) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  std::size_t read_blocks = 0;
  start = clock_type::now();
  while (read_blocks < blocks && (read_blocks == 0 || seconds_since(start) < seconds)) {
    const ssize_t done = ::read(fd, memory, block);
    if (done != static_cast<ssize_t>(block)) {
      r.error = "reading " + path + ": " + (done < 0 ? std::strerror(errno) : std::string("short read"));
      break;
    }
    if (std::any_of(words, words + block / sizeof(std::uint64_t), [&](std::uint64_t w) { return w != read_blocks; }))
      ++r.wrong_blocks;
    ++read_blocks;
  }
  r.read_Bps = static_cast<double>(read_blocks * block) / seconds_since(start);
  ::close(fd);
  return r;
}

/// The checks of one directory: `needed_*` are the rates training needs from this node (0: none).
std::vector<check> check_storage(const std::string& role, const std::string& flag, const std::string& dir,
                                 const std::string& tag, const options& o, double needed_read, double needed_write,
                                 const std::string& need_read_why, const std::string& need_write_why) {
  std::vector<check> checks;
  const std::string name = "storage." + role;
  if (dir.empty()) {
    checks.push_back({name, status::skip, flag + " not given", "", "", ""});
    return checks;
  }
  const storage_result r = time_storage(dir, tag, *o.storage_bytes, *o.storage_seconds);
  const std::string how = std::string(r.direct ? "O_DIRECT" : "buffered + fdatasync (O_DIRECT refused here)") + ", " +
                          number(static_cast<double>(r.bytes) / mb, "%.0f") + " MB in " + dir;
  if (!r.error.empty() || r.wrong_blocks > 0) {
    checks.push_back({name, status::fail,
                      r.error.empty() ? std::to_string(r.wrong_blocks) + " blocks read back differ from those written (" + how + ")" : r.error,
                      "a file written and read back intact",
                      "check the file system and its mount (permissions, free space, dmesg for I/O errors); see "
                      "docs/doctor.md#storage",
                      ""});
    return checks;
  }
  auto one = [&](const char* direction, double rate, double needed, const std::string& why) {
    check c{name + "." + direction, status::pass, rate_text(rate) + " (" + how + ")",
            needed > 0 ? "at least " + rate_text(needed) + ": " + why : "no requirement (measured for reference)", "", ""};
    if (needed > 0 && rate < needed) {
      c.result = status::fail;
      c.fix = role == "data"
                  ? "the GPUs will wait for data: put the dataset on faster storage (local NVMe, a parallel file "
                    "system, not NFS over 10 GbE), stage it to local disk before the job, or raise the data loader's "
                    "read-ahead; see docs/doctor.md#storage"
                  : "checkpoints will stall training past --max-save-s: write them to a parallel file system or "
                    "local NVMe and copy them out asynchronously, shard the writes over every rank, or save less "
                    "often; see docs/doctor.md#storage";
    }
    checks.push_back(c);
  };
  if (role == "data") {
    one("read", r.read_Bps, needed_read, need_read_why);
    one("write", r.write_Bps, 0, "");
  } else {
    one("write", r.write_Bps, needed_write, need_write_why);
    one("read", r.read_Bps, needed_write, "a resume reads the checkpoint back as fast");
  }
  return checks;
}

// ---- GEMM ----

#if WEFT_DOCTOR_HAS_CBLAS
constexpr const char* gemm_kernel = "cblas_sgemm";
#else
constexpr const char* gemm_kernel = "weft::tp::reference::matmul_nt";
#endif

struct gemm_result {
  double flops = 0;
  double wrong = 0;  // elements not equal to the exact result (NaN and Inf included)
  double non_finite = 0;
};

/// n x n x n float GEMMs (what train_gpt's CPU path runs), for about `seconds`; inputs 0.5 and
/// 0.25 make every element of the result exactly n / 8.
gemm_result time_gemm(int n, double seconds) {
  const std::size_t size = static_cast<std::size_t>(n);
  std::vector<float> a(size * size, 0.5f), b(size * size, 0.25f), c(size * size, 0.0f);
  auto run = [&] {
#if WEFT_DOCTOR_HAS_CBLAS
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
#else
    weft::tp::reference::matmul_nt(a.data(), b.data(), c.data(), size, size, size);
#endif
  };
  run();
  int repetitions = 0;
  const auto start = clock_type::now();
  do {
    run();
    ++repetitions;
  } while (seconds_since(start) < seconds && repetitions < 1000);
  gemm_result r;
  r.flops = 2.0 * static_cast<double>(size * size * size) * repetitions / seconds_since(start);
  const float expected = static_cast<float>(n) / 8.0f;
  for (float v : c) {
    r.non_finite += std::isfinite(v) ? 0 : 1;
    r.wrong += v == expected ? 0 : 1;
  }
  return r;
}

// ---- Slurm ----

/// The output and status of a shell command (for srun --mpi=list).
std::pair<std::string, int> run_command(const std::string& command) {
  std::string output;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {"", -1};
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe)) output += buffer;
  const int status = pclose(pipe);
  return {output, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

std::vector<check> check_slurm(int ranks_on_node, std::size_t gpus) {
  std::vector<check> checks;
  check pmix{"slurm.srun_pmix", status::pass, "", "srun --mpi=list names pmix", "", ""};
  // Bounded: a node whose Slurm configuration names an unreachable controller could make srun wait.
  const auto [list, code] = run_command("command -v srun >/dev/null && timeout 20 srun --mpi=list");
  if (code == 1 && list.empty()) {
    pmix.result = status::skip;
    pmix.value = "srun is not installed here: not a Slurm node";
  } else if (code != 0) {
    pmix.result = status::skip;
    std::string first = list.substr(0, list.find('\n'));
    pmix.value = "srun --mpi=list failed (" + (first.empty() ? "exit " + std::to_string(code) : first) +
                 "): no Slurm configuration reachable from this node";
  } else if (list.find("pmix") == std::string::npos) {
    pmix.result = status::fail;
    pmix.value = "srun has no pmix plugin";
    pmix.fix = "install Slurm's PMIx plugin (Debian: slurm-wlm's mpi/pmix; built --with-pmix) so that `srun "
               "--mpi=pmix` starts MPI ranks without mpirun; see docs/doctor.md#slurm";
  } else {
    pmix.value = "srun --mpi=pmix available";
  }
  checks.push_back(pmix);

  check job{"slurm.job", status::pass, "", "CPUs and GPUs of the job on this node cover its ranks", "", ""};
  const char* id = std::getenv("SLURM_JOB_ID");
  if (id == nullptr) {
    job.result = status::skip;
    job.value = "not inside a Slurm job (no SLURM_JOB_ID)";
  } else {
    auto variable = [](const char* name) {
      const char* v = std::getenv(name);
      return std::string(v ? v : "unset");
    };
    cpu_set_t set;
    CPU_ZERO(&set);
    const int usable = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    const int cpus = std::atoi(variable("SLURM_CPUS_ON_NODE").c_str());
    job.value = "job " + std::string(id) + ": " + std::to_string(ranks_on_node) + " ranks on this node, SLURM_CPUS_ON_NODE=" +
                variable("SLURM_CPUS_ON_NODE") + " (this rank may run on " + std::to_string(usable) +
                "), SLURM_GPUS_ON_NODE=" + variable("SLURM_GPUS_ON_NODE") + ", CUDA_VISIBLE_DEVICES=" +
                variable("CUDA_VISIBLE_DEVICES");
    if (cpus > 0 && cpus < ranks_on_node) {
      job.result = status::warn;
      job.fix = "the job has fewer CPUs than ranks on this node: ask for --cpus-per-task (data loading and NCCL's "
                "proxy threads need cores of their own); see docs/doctor.md#slurm";
    }
    const int job_gpus = std::getenv("SLURM_GPUS_ON_NODE") ? std::atoi(variable("SLURM_GPUS_ON_NODE").c_str()) : -1;
    if (gpus > 0 && job_gpus >= 0 && job_gpus < ranks_on_node) {
      job.result = status::fail;
      job.fix = "the job sees " + std::to_string(job_gpus) + " GPUs on this node for " + std::to_string(ranks_on_node) +
                " ranks: ask for --gpus-per-node (or --gpus-per-task 1); see docs/doctor.md#slurm";
    }
  }
  checks.push_back(job);
  return checks;
}

// ---- CPU affinity ----

check check_affinity(const roots& r, const std::vector<gpu_info>& gpus, int local_rank, int rank) {
  check c{"cpu_affinity.rank" + std::to_string(rank), status::pass, "", "the rank's CPUs on its GPU's NUMA node", "", ""};
  if (gpus.empty()) {
    c.result = status::skip;
    c.value = "no GPU on this node";
    return c;
  }
  if (static_cast<std::size_t>(local_rank) >= gpus.size()) {
    c.result = status::fail;
    c.value = "local rank " + std::to_string(local_rank) + " but " + std::to_string(gpus.size()) + " GPUs";
    c.fix = "launch at most one rank per GPU on each node (--ntasks-per-node, mpirun --map-by ppr:N:node)";
    return c;
  }
  const gpu_info& gpu = gpus[static_cast<std::size_t>(local_rank)];
  std::string allowed;
  {
    std::ifstream status_file(r.proc / "self/status");
    for (std::string line; std::getline(status_file, line);)
      if (line.rfind("Cpus_allowed_list:", 0) == 0) allowed = line.substr(line.find(':') + 1);
  }
  allowed.erase(0, allowed.find_first_not_of(" \t"));
  const auto numa_cpus = read_line(r.sysfs / "devices/system/node" / ("node" + std::to_string(gpu.numa_node)) / "cpulist");
  if (allowed.empty() || gpu.numa_node < 0 || !numa_cpus) {
    c.result = status::skip;
    c.value = "GPU " + std::to_string(local_rank) + "'s NUMA node or this rank's CPUs unknown";
    return c;
  }
  const std::set<int> mine = parse_cpu_list(allowed), near = parse_cpu_list(*numa_cpus);
  const auto inside = std::count_if(mine.begin(), mine.end(), [&](int cpu) { return near.count(cpu) > 0; });
  c.value = "CPUs " + allowed + " for GPU " + std::to_string(local_rank) + " (" + gpu.bus_id + ") on NUMA node " +
            std::to_string(gpu.numa_node) + " (CPUs " + *numa_cpus + ")";
  if (inside == 0 || inside < static_cast<long>(mine.size())) {
    c.result = inside == 0 ? status::fail : status::warn;
    c.fix = "bind each rank to the cores of its GPU's NUMA node (srun --cpu-bind=ldoms or --gpu-bind=closest, "
            "mpirun --bind-to numa with one rank per GPU): host copies and NCCL's proxy thread otherwise cross "
            "the CPU interconnect; see docs/doctor.md#cpu-affinity";
  }
  return c;
}

// ---- gathering the report ----

/// A rank's checks and facts, flattened for one all-gather: fields split by \x1f, records by \x1e.
std::string pack(const std::vector<check>& checks, const std::map<std::string, std::string>& facts) {
  std::string out;
  for (const check& c : checks)
    out += "C\x1f" + c.name + "\x1f" + status_name(c.result) + "\x1f" + c.value + "\x1f" + c.expected + "\x1f" + c.fix +
           "\x1f" + c.node + "\x1e";
  for (const auto& [key, value] : facts) out += "F\x1f" + key + "\x1f" + value + "\x1e";
  return out;
}

std::vector<std::vector<std::string>> unpack(const std::string& text) {
  std::vector<std::vector<std::string>> records;
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t end = text.find('\x1e', at);
    if (end == std::string::npos) end = text.size();
    std::vector<std::string> fields;
    std::size_t f = at;
    while (true) {
      const std::size_t stop = text.find('\x1f', f);
      if (stop == std::string::npos || stop > end) {
        fields.push_back(text.substr(f, end - f));
        break;
      }
      fields.push_back(text.substr(f, stop - f));
      f = stop + 1;
    }
    records.push_back(fields);
    at = end + 1;
  }
  return records;
}

status parse_status(const std::string& s) {
  return s == "PASS" ? status::pass : s == "WARN" ? status::warn : s == "FAIL" ? status::fail : status::skip;
}

/// Every rank's `mine`, on every rank.
std::vector<std::string> all_gather_text(control_comm& control, const std::string& mine) {
  std::vector<int> sizes(static_cast<std::size_t>(control.size()));
  std::vector<int> size{static_cast<int>(mine.size())};
  control.all_gather(size, sizes);
  const std::size_t longest = static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end()));
  std::vector<std::uint8_t> padded(longest, 0), all(longest * sizes.size());
  std::copy(mine.begin(), mine.end(), padded.begin());
  control.all_gather(padded, all);
  std::vector<std::string> texts;
  for (std::size_t r = 0; r < sizes.size(); ++r)
    texts.emplace_back(reinterpret_cast<const char*>(all.data() + r * longest), static_cast<std::size_t>(sizes[r]));
  return texts;
}

/// The checks that compare a fact of every rank across the nodes: all the same, or which differ.
check compare_across(const std::string& name, const std::string& what, const std::vector<std::map<std::string, std::string>>& facts,
                     const std::string& key, const std::string& fix) {
  std::map<std::string, std::vector<std::string>> where;  // value -> "node (ranks)"
  std::map<std::string, std::map<std::string, std::vector<int>>> ranks_of;
  for (std::size_t r = 0; r < facts.size(); ++r) {
    const auto at = facts[r].find(key);
    const std::string value = at == facts[r].end() ? "" : at->second;
    ranks_of[value][facts[r].at("node")].push_back(static_cast<int>(r));
  }
  check c{name, status::pass, "", what + " the same on every node", "", "all"};
  if (ranks_of.size() == 1 && ranks_of.begin()->first.empty()) {
    c.result = status::skip;
    c.value = "unknown on every rank";
    return c;
  }
  std::vector<std::string> parts;
  for (const auto& [value, nodes] : ranks_of) {
    std::vector<std::string> node_parts;
    for (const auto& [node, ranks] : nodes) {
      std::string list;
      for (int r : ranks) list += (list.empty() ? "" : ",") + std::to_string(r);
      node_parts.push_back(node + " (rank" + (ranks.size() > 1 ? "s " : " ") + list + ")");
    }
    parts.push_back((value.empty() ? std::string("unknown") : value) + " on " + joined(node_parts));
  }
  if (ranks_of.size() == 1) {
    const std::size_t nodes = ranks_of.begin()->second.size();
    c.value = ranks_of.begin()->first + (nodes > 1 ? " on all " + std::to_string(nodes) + " nodes" : " on the one node");
  } else {
    c.result = status::fail;
    c.value = joined(parts, "; ");
    c.fix = fix + "; see docs/doctor.md#gpus";
  }
  return c;
}

struct collective_numbers {
  double node_busbw = 0;   // this rank's view of the all-reduce inside its node, GB/s (0: not run)
  double world_busbw = 0;  // of the all-reduce over every rank, GB/s (0: not run)
  double wrong = 0;
  std::vector<std::string> p2p;  // "node_a|node_b|GB/s" for each pair, on rank 0
};

/// All-reduce inside each node and over all ranks, and p2p between the first ranks of each pair
/// of nodes, on `Platform`'s buffers (GPU with NCCL, host with MPI).
template <class B>
collective_numbers measure_collectives(const options& o, control_comm& control, const weft_programs::rank_hosts& placement) {
  using platform = weft_programs::all_reduce_platform<B>;
  std::optional<typename platform::comm_type> made;
  auto& world = platform::world(control, made);
  if (o.comm_timeout) world.set_timeout(*o.comm_timeout);
  const int rank = world.rank();
  collective_numbers numbers;
  const std::size_t count = *o.bytes / sizeof(float);
  const double bytes = static_cast<double>(count * sizeof(float));
  auto send = platform::allocate(count);
  auto recv = platform::allocate(count);
  const int warmup = o.quick ? 2 : 5;
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
  };
  auto local = world.split(placement.index_of[static_cast<std::size_t>(rank)], rank, "node");
  if (local->size() > 1) {
    auto timed = weft_programs::time_all_reduce<platform>(*local, *local, send, recv, warmup, *o.rounds);
    numbers.node_busbw = bytes / mean(timed.round_s) / 1e9 * weft_programs::bus_factor(local->size());
    numbers.wrong += static_cast<double>(timed.wrong);
  }
  if (placement.hosts.size() > 1) {
    auto timed = weft_programs::time_all_reduce<platform>(world, control, send, recv, warmup, *o.rounds);
    numbers.world_busbw = bytes / mean(timed.round_s) / 1e9 * weft_programs::bus_factor(world.size());
    numbers.wrong += static_cast<double>(timed.wrong);
    // p2p: the first rank of node i with the first rank of node j, for every pair of nodes, in
    // rounds of disjoint pairs (the circle method of a round-robin tournament: nodes - 1 rounds,
    // or nodes with an odd count), so that a large cluster is measured in as many rounds as nodes.
    const int nodes = static_cast<int>(placement.hosts.size());
    std::vector<int> first(static_cast<std::size_t>(nodes), -1);
    for (int r = static_cast<int>(placement.index_of.size()) - 1; r >= 0; --r)
      first[static_cast<std::size_t>(placement.index_of[static_cast<std::size_t>(r)])] = r;
    const std::size_t p2p_count = std::min<std::size_t>(count, (o.quick ? std::size_t{16} : std::size_t{64}) << 18);
    auto message = platform::allocate(p2p_count);
    const auto view = platform::view(message);
    const int trips = o.quick ? 3 : 10;
    const int players = nodes + nodes % 2;  // with an odd count, one node rests each round
    std::vector<double> gbps(static_cast<std::size_t>(nodes * nodes), 0.0);  // [i * nodes + j], i < j
    for (int round = 0; round < players - 1; ++round) {
      control.barrier();
      for (int k = 0; k < players / 2; ++k) {
        int i = (round + k) % (players - 1);
        int j = k == 0 ? players - 1 : (players - 1 - k + round) % (players - 1);
        if (i > j) std::swap(i, j);
        if (j >= nodes) continue;  // the resting node
        const int a = first[static_cast<std::size_t>(i)], b = first[static_cast<std::size_t>(j)];
        if (rank != a && rank != b) continue;
        // The fastest round trip: a slow link is slow in every trip, while a rank descheduled
        // once (an oversubscribed node) is slow in one.
        double seconds = std::numeric_limits<double>::max();
        for (int t = 0; t <= trips; ++t) {
          const auto start = clock_type::now();
          if (rank == a) {
            world.send(view, b);
            world.recv(view, b);
          } else {
            world.recv(view, a);
            world.send(view, a);
          }
          if (t > 0) seconds = std::min(seconds, seconds_since(start));  // the first sets up the connection
        }
        if (rank == a)
          gbps[static_cast<std::size_t>(i * nodes + j)] =
              2.0 * static_cast<double>(p2p_count * sizeof(float)) / seconds / 1e9;
      }
    }
    control.all_reduce(gbps, weft::reduce_op::max);
    if (rank == 0)
      for (int i = 0; i < nodes; ++i)
        for (int j = i + 1; j < nodes; ++j)
          numbers.p2p.push_back(placement.hosts[static_cast<std::size_t>(i)] + "|" +
                                placement.hosts[static_cast<std::size_t>(j)] + "|" +
                                std::to_string(gbps[static_cast<std::size_t>(i * nodes + j)]));
  }
  return numbers;
}

/// Rank 0's checks of the collectives, from every rank's numbers.
std::vector<check> check_collectives(const options& o, const weft_programs::rank_hosts& placement,
                                     const std::vector<std::map<std::string, std::string>>& facts,
                                     const std::vector<std::string>& p2p, const char* backend) {
  std::vector<check> checks;
  const double link_GBps = o.expect_link_gbps / 8;
  auto value_of = [&](std::size_t r, const char* key) { return std::atof(facts[r].at(key).c_str()); };
  const std::string size = number(static_cast<double>(*o.bytes) / (1 << 20), "%g") + " MiB";
  // Inside each node: a node is as fast as its slowest rank saw; results must be exact.
  for (std::size_t h = 0; h < placement.hosts.size(); ++h) {
    double busbw = 0, wrong = 0;
    int ranks = 0;
    for (std::size_t r = 0; r < facts.size(); ++r) {
      if (placement.index_of[r] != static_cast<int>(h)) continue;
      ++ranks;
      const double bw = value_of(r, "node_busbw");
      busbw = busbw == 0 ? bw : std::min(busbw, bw);
      wrong += value_of(r, "wrong");
    }
    check c{"collectives.all_reduce.node", status::pass, "", "an exact result; the bus bandwidth is for reference",
            "", placement.hosts[h]};
    if (ranks < 2) {
      c.result = status::skip;
      c.value = "one rank on this node";
    } else {
      c.value = "busbw " + number(busbw, "%.2f") + " GB/s over " + std::to_string(ranks) + " ranks (" + size + ", " +
                backend + ")";
    }
    if (wrong > 0) {
      c.result = status::fail;
      c.value += "; " + number(wrong, "%.0f") + " wrong elements";
      c.fix = "the all-reduce returned wrong sums on this node: suspect its memory, GPUs or a transport that "
              "corrupts data; drain it; see docs/doctor.md#collectives";
    }
    checks.push_back(c);
  }
  check world{"collectives.all_reduce.nodes", status::pass, "",
              "busbw at least " + number(0.8 * link_GBps, "%.1f") + " GB/s (0.8 x --expect-link-gbps); under " +
                  number(0.5 * link_GBps, "%.1f") + " fails",
              "", "all"};
  if (placement.hosts.size() < 2) {
    world.result = status::skip;
    world.value = "every rank is on one node (" + placement.hosts[0] + "): no network between nodes to measure";
  } else {
    double busbw = 0;
    for (std::size_t r = 0; r < facts.size(); ++r)
      busbw = r == 0 ? value_of(r, "world_busbw") : std::min(busbw, value_of(r, "world_busbw"));
    world.value = "busbw " + number(busbw, "%.2f") + " GB/s = " + number(busbw * 8, "%.1f") + " Gb/s over " +
                  std::to_string(facts.size()) + " ranks on " + std::to_string(placement.hosts.size()) + " nodes (" +
                  size + ", " + backend + ")";
    if (busbw < 0.8 * link_GBps) {
      world.result = busbw < 0.5 * link_GBps ? status::fail : status::warn;
      world.fix = "the network between the nodes is slower than its links: check that NCCL uses InfiniBand/RoCE, not "
                  "sockets (NCCL_DEBUG=INFO shows NET/IB), the RDMA ports and NCCL variables above, GPUDirect RDMA, "
                  "and run weft-health-check for the slowest rank; see docs/doctor.md#collectives";
    }
  }
  checks.push_back(world);
  // p2p between every pair of nodes: a pair at under half the median pair, or every pair of a node.
  check pairs{"collectives.p2p", status::pass, "", "every pair of nodes within 2x of the median pair, and at least " +
                                                       number(0.5 * link_GBps, "%.1f") + " GB/s",
              "", "all"};
  if (placement.hosts.size() < 2) {
    pairs.result = status::skip;
    pairs.value = "one node: no pair of nodes to measure";
  } else {
    std::vector<double> rates;
    std::vector<std::vector<std::string>> rows;
    for (const std::string& line : p2p) {
      std::vector<std::string> f;
      std::stringstream s(line);
      for (std::string x; std::getline(s, x, '|');) f.push_back(x);
      rows.push_back(f);
      rates.push_back(std::atof(f[2].c_str()));
    }
    const double mid = median(rates);
    std::vector<std::string> shown, slow;
    std::map<std::string, int> slow_count;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      shown.push_back(rows[i][0] + "-" + rows[i][1] + " " + number(rates[i], "%.2f") + " GB/s");
      if (rates[i] < 0.5 * mid || rates[i] < 0.5 * link_GBps) {
        slow.push_back(rows[i][0] + "-" + rows[i][1]);
        ++slow_count[rows[i][0]];
        ++slow_count[rows[i][1]];
      }
    }
    pairs.value = joined(shown, "; ");
    if (!slow.empty()) {
      pairs.result = status::fail;
      std::string culprit;
      for (const auto& [node, n] : slow_count)
        if (n == static_cast<int>(placement.hosts.size()) - 1 && placement.hosts.size() > 2) culprit = node;
      pairs.fix = "slow pairs: " + joined(slow) +
                  (culprit.empty() ? std::string() : " (every pair of " + culprit + ": that node or its link)") +
                  ": check those nodes' RDMA ports and cables (ibstat, mlxlink) and their switch ports; see "
                  "docs/doctor.md#collectives";
    }
  }
  checks.push_back(pairs);
  return checks;
}

std::vector<check> check_gemm(const std::vector<std::map<std::string, std::string>>& facts, int n) {
  std::vector<check> checks;
  std::vector<double> rates;
  for (const auto& f : facts) rates.push_back(std::atof(f.at("gemm_flops").c_str()));
  const double mid = median(rates);
  for (std::size_t r = 0; r < facts.size(); ++r) {
    const double wrong = std::atof(facts[r].at("gemm_wrong").c_str());
    const double non_finite = std::atof(facts[r].at("gemm_non_finite").c_str());
    check c{"gemm.rank" + std::to_string(r), status::pass,
            number(rates[r] / 1e9, "%.1f") + " GFLOP/s (" + std::to_string(n) + "^3 float32, CPU, " + gemm_kernel + ")",
            "exact result, no NaN/Inf; within 2x of the median rank (" + number(mid / 1e9, "%.1f") + " GFLOP/s)", "",
            facts[r].at("node")};
    if (wrong > 0) {
      c.result = status::fail;
      c.value += "; " + number(wrong, "%.0f") + " wrong elements, " + number(non_finite, "%.0f") + " NaN/Inf";
      c.fix = "the GEMM's result is wrong on this rank: faulty memory or processor (or GPU); drain the node and run "
              "its vendor diagnostics (dcgmi diag -r 3 for GPUs); see docs/doctor.md#gemm";
    } else if (rates[r] < 0.5 * mid) {
      c.result = status::warn;
      c.fix = "this rank computes under half as fast as the median: other processes on its cores, throttled clocks, "
              "or a rank bound to too few cores; see docs/doctor.md#gemm";
    }
    checks.push_back(c);
  }
  return checks;
}

template <class B>
int run(const options& o, control_comm& control) {
  const int rank = control.rank();
  const int ranks = control.size();
  const roots tree{o.sysfs_root, o.proc_root};
  const char* node_override = std::getenv("WEFT_DOCTOR_NODE");
  const std::string node = node_override && *node_override ? node_override : weft_programs::host_name();
  const weft_programs::rank_hosts placement = weft_programs::gather_hosts(control, node);
  const int my_node = placement.index_of[static_cast<std::size_t>(rank)];
  int local_rank = 0, ranks_on_node = 0, leader = -1;
  for (int r = 0; r < ranks; ++r) {
    if (placement.index_of[static_cast<std::size_t>(r)] != my_node) continue;
    if (leader < 0) leader = r;
    if (r < rank) ++local_rank;
    ++ranks_on_node;
  }
  const bool node_leader = leader == rank;

  // ---- this node and this rank ----
  std::vector<check> checks;
  std::map<std::string, std::string> facts;
  const nvml_library nvml;
  const gpu_facts gpus = read_gpus(tree, nvml);
  const std::vector<rdma_port> ports = rdma_ports(tree);
  facts["node"] = node;
  const char* injected_driver = std::getenv("WEFT_DOCTOR_DRIVER_VERSION");
  facts["driver"] = injected_driver && *injected_driver ? injected_driver : gpus.driver;
  facts["cuda_driver"] = gpus.cuda_driver;
  facts["gpu_count"] = gpus.gpus.empty() ? "" : std::to_string(gpus.gpus.size());
  facts["gpu_model"] = gpus.gpus.empty() ? "" : gpus.gpus[0].model;
#if WEFT_HAS_NCCL
  int nccl_version = 0;
  if (ncclGetVersion(&nccl_version) == ncclSuccess)
    facts["nccl"] = std::to_string(nccl_version / 10000) + "." + std::to_string(nccl_version / 100 % 100) + "." +
                    std::to_string(nccl_version % 100);
#endif
  if (node_leader) {
    for (check& c : check_gpus(nvml, gpus, ports)) checks.push_back(c);
    for (check& c : check_rdma_ports(ports, o.expect_link_gbps)) checks.push_back(c);
    checks.push_back(check_gpudirect(tree, !gpus.gpus.empty(), !ports.empty()));
    checks.push_back(check_socket_ifname(tree, std::getenv("NCCL_SOCKET_IFNAME")));
    checks.push_back(check_ib_hca(ports, std::getenv("NCCL_IB_HCA")));
    checks.push_back(check_memlock(tree, !ports.empty()));
    for (check& c : check_slurm(ranks_on_node, gpus.gpus.size())) checks.push_back(c);
  }
  checks.push_back(check_affinity(tree, gpus.gpus, local_rank, rank));

  // ---- storage: the first rank of each node, every node at once, as a job's ranks would ----
  control.barrier();
  if (node_leader) {
    const std::string tag = node + "-" + std::to_string(rank) + "-" + std::to_string(::getpid());
    const double data_need = (o.tokens_per_s > 0 ? o.tokens_per_s * o.bytes_per_token : data_rate_per_rank) * ranks_on_node;
    const std::string data_why =
        o.tokens_per_s > 0
            ? number(o.tokens_per_s, "%g") + " tokens/s x " + std::to_string(o.bytes_per_token) + " B x " +
                  std::to_string(ranks_on_node) + " ranks on this node"
            : "50 MB/s per GPU (the low end of 50-100 MB/s) x " + std::to_string(ranks_on_node) + " ranks; --tokens-per-s sets it";
    const double share = o.checkpoint_bytes ? *o.checkpoint_bytes * ranks_on_node / ranks
                                            : checkpoint_rate_per_rank * 30.0 * ranks_on_node;
    const double checkpoint_need = share / o.max_save_s;
    const std::string checkpoint_why =
        "this node's share of the checkpoint, " + number(share / mb, "%.0f") + " MB" +
        (o.checkpoint_bytes ? "" : " (15 GB per rank: 500 MB/s for 30 s; --checkpoint-size sets it)") + ", within " +
        number(o.max_save_s, "%g") + " s (--max-save-s)";
    for (check& c : check_storage("data", "--data-dir", o.data_dir, tag, o, data_need, 0, data_why, ""))
      checks.push_back(c);
    for (check& c : check_storage("checkpoint", "--checkpoint-dir", o.checkpoint_dir, tag, o, 0, checkpoint_need, "",
                                  checkpoint_why))
      checks.push_back(c);
  }
  for (check& c : checks)
    if (c.node.empty()) c.node = node;

  // ---- GEMM, every rank at once; then the collectives ----
  control.barrier();
  const gemm_result gemm = time_gemm(*o.gemm_size, o.quick ? 0.2 : 1.0);
  facts["gemm_flops"] = std::to_string(gemm.flops);
  facts["gemm_wrong"] = std::to_string(gemm.wrong);
  facts["gemm_non_finite"] = std::to_string(gemm.non_finite);
  const collective_numbers numbers = measure_collectives<B>(o, control, placement);
  facts["node_busbw"] = std::to_string(numbers.node_busbw);
  facts["world_busbw"] = std::to_string(numbers.world_busbw);
  facts["wrong"] = std::to_string(numbers.wrong);

  // ---- the report, on rank 0 ----
  const std::vector<std::string> packed = all_gather_text(control, pack(checks, facts));
  int exit_status = 0;
  if (rank == 0) {
    std::vector<check> report;
    std::vector<std::map<std::string, std::string>> all_facts;
    for (const std::string& text : packed) {
      std::map<std::string, std::string> f;
      for (const auto& record : unpack(text)) {
        if (record.size() == 7 && record[0] == "C")
          report.push_back({record[1], parse_status(record[2]), record[3], record[4], record[5], record[6]});
        else if (record.size() == 3 && record[0] == "F")
          f[record[1]] = record[2];
      }
      all_facts.push_back(f);
    }
    const std::string same_driver_fix = "install the same NVIDIA driver on every node (a job mixing drivers can hang "
                                        "or fail in NCCL, and runs at the slowest node's speed)";
    report.push_back(compare_across("same.gpu_count", "GPUs per node", all_facts, "gpu_count",
                                    "give every node the same number of working GPUs, or leave out the node short of GPUs (nvidia-smi -L)"));
    report.push_back(compare_across("same.gpu_model", "GPU model", all_facts, "gpu_model",
                                    "run the job on one GPU model: the fastest GPUs wait for the slowest at every collective"));
    report.push_back(compare_across("same.driver", "NVIDIA driver version", all_facts, "driver", same_driver_fix));
    report.push_back(compare_across("same.cuda_driver", "CUDA version of the driver", all_facts, "cuda_driver", same_driver_fix));
    report.push_back(compare_across("same.nccl", "NCCL version", all_facts, "nccl",
                                    "use one NCCL on every node (the same container image or module): NCCL's protocol "
                                    "differs between versions"));
    for (check& c : check_collectives(o, placement, all_facts, numbers.p2p, weft_programs::all_reduce_platform<B>::name))
      report.push_back(c);
    for (check& c : check_gemm(all_facts, *o.gemm_size)) report.push_back(c);

    int counts[4] = {0, 0, 0, 0};
    for (const check& c : report) ++counts[static_cast<int>(c.result)];
    std::printf("weft-doctor: %d rank%s on %zu node%s (%s)\n\n", ranks, ranks > 1 ? "s" : "", placement.hosts.size(),
                placement.hosts.size() > 1 ? "s" : "", joined(placement.hosts).c_str());
    for (const check& c : report) {
      std::printf("%-4s  %-34s %-16s %s\n", status_name(c.result), c.name.c_str(), c.node.c_str(), c.value.c_str());
      if (c.result == status::fail || c.result == status::warn) {
        if (!c.expected.empty()) std::printf("      expected: %s\n", c.expected.c_str());
        if (!c.fix.empty()) std::printf("      fix: %s\n", c.fix.c_str());
      }
    }
    std::printf("\n%d passed, %d warnings, %d failed, %d skipped\n", counts[0], counts[1], counts[2], counts[3]);
    exit_status = counts[static_cast<int>(status::fail)] > 0 ? 1 : 0;
    std::fflush(stdout);
    if (!o.json_path.empty()) {
      using weft_programs::json_string;
      std::ofstream out = weft_programs::open_json_output(o.json_path);
      out << "{\"checks\": [";
      for (std::size_t i = 0; i < report.size(); ++i) {
        const check& c = report[i];
        out << (i ? ",\n  " : "\n  ") << "{\"name\": " << json_string(c.name) << ", \"status\": "
            << json_string(status_name(c.result)) << ", \"value\": " << json_string(c.value)
            << ", \"expected\": " << json_string(c.expected) << ", \"fix\": " << json_string(c.fix)
            << ", \"node\": " << json_string(c.node) << "}";
      }
      out << "\n]}\n";
      if (!out) throw std::runtime_error("cannot write '" + o.json_path + "'");
    }
  }
  control.broadcast(std::span<int>(&exit_status, 1), 0);
  control.barrier();
  return exit_status;
}

}  // namespace

int main(int argc, char** argv) {
  constexpr int could_not_run = 2;
  return weft_programs::mpi_main(
      "weft-doctor", usage_text, argc, argv,
      [&](int rank) {
        const options o = parse(argc, argv);
        if (o.help) {
          if (rank == 0) std::printf("%s", usage_text);
          return 0;
        }
        if (!o.json_path.empty() && rank == 0) weft_programs::open_json_output(o.json_path);  // fails now, not at the end
        control_comm control(weft::mpi_backend::comm::world(o.comm_timeout), "world", weft::default_check_level(),
                             o.comm_timeout);
#if WEFT_HAS_NCCL
        if (weft_programs::every_rank_has_gpu(control)) return run<weft::nccl_backend>(o, control);
#endif
        return run<weft::mpi_backend>(o, control);
      },
      could_not_run, could_not_run);
}
