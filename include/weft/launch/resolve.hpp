#pragma once
/// \file
/// Who am I in the job: rank, local rank, world size, local world size and node, read from the
/// variables the launcher set: Slurm (srun), Open MPI (mpirun) or torchrun-style (RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE). The resolver is a pure function of an environment
/// map, so every launcher's case is testable anywhere; `resolve_launch()` reads this process's
/// environment.
///
/// Which launcher: WEFT_LAUNCHER (slurm, openmpi, torchrun, none) if set; otherwise the most
/// specific one present: torchrun-style variables (set per process, also by wrappers running
/// under srun or mpirun), then Open MPI's (set per process by mpirun, also inside a Slurm
/// allocation whose own SLURM_* variables describe the job script, not the rank), then Slurm's.
/// No launcher variables at all means a single process.
///
/// Missing variables of the chosen launcher, values that are not numbers, and values that
/// contradict each other (a rank beyond the world size, torchrun and Open MPI variables naming
/// different ranks, ...) are errors that name the variables and their values.

#include <cstddef>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <weft/core/error.hpp>

extern char** environ;  // POSIX: the process environment

namespace weft {

/// Variable name → value. `std::less<>` allows lookups by string_view.
using environment_map = std::map<std::string, std::string, std::less<>>;

/// Where the process layout came from.
enum class launcher {
  none,      ///< no launcher variables: a single process
  slurm,     ///< SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_*TASKS_PER_NODE, ...
  open_mpi,  ///< OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
  torchrun,  ///< RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (GROUP_RANK for the node)
  mpi,       ///< MPI's own view (see cross_check_with_mpi), when no launcher variables were set
};

constexpr std::string_view to_string(launcher source) noexcept {
  switch (source) {
    case launcher::none: return "none";
    case launcher::slurm: return "slurm";
    case launcher::open_mpi: return "openmpi";
    case launcher::torchrun: return "torchrun";
    case launcher::mpi: return "mpi";
  }
  return "?";
}

/// This process's place in the job.
struct launch_info {
  launcher source = launcher::none;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        ///< rank among the processes on this node
  int local_world_size = 1;  ///< processes on this node
  int node = 0;              ///< index of this node, -1 if unknown
  int node_count = 1;        ///< nodes in the job, -1 if unknown
  /// True when node and node_count were computed from the rank layout (ranks filled node by node)
  /// rather than read from the launcher; cross_check_with_mpi replaces them with MPI's view.
  bool node_derived = false;
  /// The variables used, "NAME=value" separated by spaces, for logs and error messages.
  std::string variables;

  /// "rank 3 of 8, local rank 1 of 2, node 1 of 4 (from torchrun: RANK=3 ...)".
  std::string describe() const {
    std::string text = "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + ", local rank " +
                       std::to_string(local_rank) + " of " + std::to_string(local_world_size) + ", node ";
    text += node >= 0 ? std::to_string(node) : std::string("?");
    text += " of ";
    text += node_count >= 0 ? std::to_string(node_count) : std::string("?");
    text += " (from " + std::string(to_string(source));
    if (!variables.empty()) text += ": " + variables;
    return text + ")";
  }
};

namespace detail::launch {

[[noreturn]] inline void launch_error(const std::string& message) { throw error("weft: launch: " + message); }

/// Reads variables of one launcher, remembering which were used and which were missing.
class reader {
 public:
  explicit reader(const environment_map& env) : env_(env) {}

  /// The value of the first of `names` that is set (an empty value counts as unset).
  std::optional<std::string> text(std::initializer_list<std::string_view> names) {
    for (std::string_view name : names) {
      auto it = env_.find(name);
      if (it == env_.end() || it->second.empty()) continue;
      if (!used_.empty()) used_ += ' ';
      used_ += std::string(name) + "=" + it->second;
      return it->second;
    }
    return std::nullopt;
  }

  /// A non-negative integer from the first of `names` that is set.
  std::optional<int> number(std::initializer_list<std::string_view> names) {
    for (std::string_view name : names) {
      auto it = env_.find(name);
      if (it == env_.end() || it->second.empty()) continue;
      std::optional<int> value = parse(it->second);
      if (!value)
        launch_error(std::string(name) + "='" + it->second + "' is not a non-negative integer; fix or unset it");
      if (!used_.empty()) used_ += ' ';
      used_ += std::string(name) + "=" + it->second;
      return value;
    }
    return std::nullopt;
  }

  /// Like number(), but a missing variable is recorded (reported together by finish()).
  int required(std::initializer_list<std::string_view> names) {
    if (std::optional<int> value = number(names)) return *value;
    std::string alternatives;
    for (std::string_view name : names) alternatives += (alternatives.empty() ? "" : " or ") + std::string(name);
    missing_.push_back(alternatives);
    return 0;
  }

  void add_missing(std::string what) { missing_.push_back(std::move(what)); }

  /// Throws if anything required was missing, naming every missing variable at once.
  void finish(std::string_view launcher_name, std::string_view hint) const {
    if (missing_.empty()) return;
    std::string list;
    for (const std::string& m : missing_) list += (list.empty() ? "" : ", ") + m;
    launch_error(std::string(launcher_name) + " variables are incomplete: missing " + list +
                 (used_.empty() ? std::string() : " (found " + used_ + ")") + "; " + std::string(hint));
  }

  const std::string& used() const noexcept { return used_; }

  static std::optional<int> parse(std::string_view s) {
    if (s.empty() || s.size() > 9) return std::nullopt;
    int value = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return std::nullopt;
      value = value * 10 + (c - '0');
    }
    return value;
  }

 private:
  const environment_map& env_;
  std::string used_;
  std::vector<std::string> missing_;
};

inline bool any_set(const environment_map& env, std::initializer_list<std::string_view> names) {
  for (std::string_view name : names) {
    auto it = env.find(name);
    if (it != env.end() && !it->second.empty()) return true;
  }
  return false;
}

/// Expands Slurm's compressed task counts per node: "2(x3),1" → {2, 2, 2, 1}.
inline std::vector<int> parse_tasks_per_node(std::string_view name, std::string_view value) {
  std::vector<int> counts;
  auto bad = [&] {
    launch_error(std::string(name) + "='" + std::string(value) +
                 "' is not a Slurm task list such as '4(x2),3'; fix or unset it");
  };
  std::size_t pos = 0;
  while (pos <= value.size()) {
    std::size_t comma = value.find(',', pos);
    std::string_view item = value.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    int repeat = 1;
    if (std::size_t paren = item.find('('); paren != std::string_view::npos) {
      if (item.size() < paren + 4 || item.substr(paren, 2) != "(x" || item.back() != ')') bad();
      std::optional<int> r = reader::parse(item.substr(paren + 2, item.size() - paren - 3));
      if (!r || *r == 0) bad();
      repeat = *r;
      item = item.substr(0, paren);
    }
    std::optional<int> count = reader::parse(item);
    if (!count) bad();
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), *count);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return counts;
}

/// The contradictions any launcher's numbers can have.
inline void check_consistent(const launch_info& info, std::string_view rank_var, std::string_view size_var,
                             std::string_view local_rank_var, std::string_view local_size_var,
                             std::string_view node_var, std::string_view nodes_var) {
  auto say = [&](std::string_view a, int av, std::string_view relation, std::string_view b, int bv) {
    launch_error("contradictory launcher variables: " + std::string(a) + "=" + std::to_string(av) + " " +
                 std::string(relation) + " " + std::string(b) + "=" + std::to_string(bv) + " (all used: " +
                 info.variables + "); the job was launched inconsistently or the variables were set by hand");
  };
  if (info.world_size < 1) say(size_var, info.world_size, "must be at least", "1", 1);
  if (info.rank >= info.world_size) say(rank_var, info.rank, "is not below", size_var, info.world_size);
  if (info.local_world_size < 1) say(local_size_var, info.local_world_size, "must be at least", "1", 1);
  if (info.local_rank >= info.local_world_size)
    say(local_rank_var, info.local_rank, "is not below", local_size_var, info.local_world_size);
  if (info.local_world_size > info.world_size)
    say(local_size_var, info.local_world_size, "exceeds", size_var, info.world_size);
  if (!info.node_derived && info.node >= 0 && info.node_count >= 0) {
    if (info.node >= info.node_count) say(node_var, info.node, "is not below", nodes_var, info.node_count);
    if (info.node_count > info.world_size) say(nodes_var, info.node_count, "exceeds", size_var, info.world_size);
  }
}

/// Node index and count when the launcher gives none: ranks fill nodes in order, local_world_size each.
inline void derive_nodes(launch_info& info) {
  info.node_derived = true;
  if (info.local_world_size > 0 && info.world_size % info.local_world_size == 0) {
    info.node = info.rank / info.local_world_size;
    info.node_count = info.world_size / info.local_world_size;
  } else {
    info.node = -1;  // uneven nodes: unknown without asking MPI
    info.node_count = -1;
  }
}

inline launch_info from_slurm(const environment_map& env) {
  reader r(env);
  launch_info info;
  info.source = launcher::slurm;
  info.rank = r.required({"SLURM_PROCID"});
  info.world_size = r.required({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  info.local_rank = r.required({"SLURM_LOCALID"});
  info.node = r.required({"SLURM_NODEID"});
  std::optional<int> nodes = r.number({"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"});
  // Tasks per node: the step's list, else the job's, else the uniform --ntasks-per-node.
  std::string list_name = "SLURM_STEP_TASKS_PER_NODE";
  std::optional<std::string> list = r.text({"SLURM_STEP_TASKS_PER_NODE"});
  if (!list) {
    list_name = "SLURM_TASKS_PER_NODE";
    list = r.text({"SLURM_TASKS_PER_NODE"});
  }
  std::optional<int> uniform = list ? std::nullopt : r.number({"SLURM_NTASKS_PER_NODE"});
  if (!list && !uniform) r.add_missing("SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE");
  r.finish("Slurm", "launch with srun (not a bare program in the batch script), or set WEFT_LAUNCHER");
  info.variables = r.used();

  std::string local_size_var = "SLURM_NTASKS_PER_NODE";
  std::string nodes_var = "SLURM_NNODES";
  if (list) {
    std::vector<int> counts = parse_tasks_per_node(list_name, *list);
    local_size_var = list_name + "[" + std::to_string(info.node) + "]";
    nodes_var = nodes ? "SLURM_NNODES" : "the length of " + list_name;
    if (!nodes) nodes = static_cast<int>(counts.size());
    if (static_cast<int>(counts.size()) != *nodes)
      launch_error("contradictory launcher variables: " + list_name + "='" + *list + "' lists " +
                   std::to_string(counts.size()) + " nodes but the node count is " + std::to_string(*nodes) +
                   " (all used: " + info.variables + ")");
    if (info.node >= static_cast<int>(counts.size()))
      launch_error("contradictory launcher variables: SLURM_NODEID=" + std::to_string(info.node) + " but " +
                   list_name + "='" + *list + "' lists " + std::to_string(counts.size()) +
                   " nodes (all used: " + info.variables + ")");
    info.local_world_size = counts[static_cast<std::size_t>(info.node)];
    if (list_name == "SLURM_STEP_TASKS_PER_NODE") {
      long total = 0;
      for (int c : counts) total += c;
      if (total != info.world_size)
        launch_error("contradictory launcher variables: " + list_name + "='" + *list + "' adds up to " +
                     std::to_string(total) + " tasks but the world size is " + std::to_string(info.world_size) +
                     " (all used: " + info.variables + ")");
    }
  } else {
    info.local_world_size = *uniform;
  }
  if (nodes) {
    info.node_count = *nodes;
  } else {
    info.node_count = info.local_world_size > 0 && info.world_size % info.local_world_size == 0
                          ? info.world_size / info.local_world_size
                          : -1;
  }
  check_consistent(info, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_size_var, "SLURM_NODEID", nodes_var);
  return info;
}

inline launch_info from_open_mpi(const environment_map& env) {
  reader r(env);
  launch_info info;
  info.source = launcher::open_mpi;
  info.rank = r.required({"OMPI_COMM_WORLD_RANK"});
  info.world_size = r.required({"OMPI_COMM_WORLD_SIZE"});
  info.local_rank = r.required({"OMPI_COMM_WORLD_LOCAL_RANK"});
  info.local_world_size = r.required({"OMPI_COMM_WORLD_LOCAL_SIZE"});
  r.finish("Open MPI", "launch with Open MPI's mpirun, or set WEFT_LAUNCHER");
  info.variables = r.used();
  // Open MPI names no node index (OMPI_COMM_WORLD_NODE_RANK is a rank within the node, across
  // jobs): derive it, and let the MPI cross-check replace it with the true grouping.
  derive_nodes(info);
  check_consistent(info, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_LOCAL_SIZE", "node", "nodes");
  return info;
}

inline launch_info from_torchrun(const environment_map& env) {
  reader r(env);
  launch_info info;
  info.source = launcher::torchrun;
  info.rank = r.required({"RANK"});
  info.world_size = r.required({"WORLD_SIZE"});
  info.local_rank = r.required({"LOCAL_RANK"});
  info.local_world_size = r.required({"LOCAL_WORLD_SIZE"});
  std::optional<int> node = r.number({"GROUP_RANK", "NODE_RANK"});
  std::optional<int> nodes = r.number({"GROUP_WORLD_SIZE", "NNODES"});
  r.finish("torchrun-style", "set all four of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, or set WEFT_LAUNCHER");
  info.variables = r.used();
  if (node) {
    info.node = *node;
    if (nodes)
      info.node_count = *nodes;
    else if (info.local_world_size > 0 && info.world_size % info.local_world_size == 0)
      info.node_count = info.world_size / info.local_world_size;
    else
      info.node_count = -1;
  } else {
    derive_nodes(info);
  }
  check_consistent(info, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE");
  // Wrappers that set RANK under mpirun must agree with it.
  reader ompi(env);
  std::optional<int> ompi_rank = ompi.number({"OMPI_COMM_WORLD_RANK"});
  std::optional<int> ompi_size = ompi.number({"OMPI_COMM_WORLD_SIZE"});
  if ((ompi_rank && *ompi_rank != info.rank) || (ompi_size && *ompi_size != info.world_size))
    launch_error("contradictory launcher variables: RANK=" + std::to_string(info.rank) +
                 " WORLD_SIZE=" + std::to_string(info.world_size) + " but " + ompi.used() +
                 "; fix whatever sets RANK/WORLD_SIZE, or set WEFT_LAUNCHER=openmpi to use Open MPI's");
  return info;
}

}  // namespace detail::launch

/// The process layout described by `env` (see the file comment for the rules).
inline launch_info resolve_launch(const environment_map& env) {
  using namespace detail::launch;
  const bool torchrun = any_set(env, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"});
  const bool open_mpi = any_set(env, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"});
  const bool slurm = any_set(env, {"SLURM_PROCID"});

  if (auto it = env.find("WEFT_LAUNCHER"); it != env.end() && !it->second.empty()) {
    const std::string& choice = it->second;
    if (choice == "slurm") return from_slurm(env);
    if (choice == "openmpi") return from_open_mpi(env);
    if (choice == "torchrun") return from_torchrun(env);
    if (choice == "none") return launch_info{};
    launch_error("WEFT_LAUNCHER='" + choice + "' is not one of slurm, openmpi, torchrun, none");
  }
  if (torchrun) return from_torchrun(env);
  if (open_mpi) return from_open_mpi(env);
  if (slurm) return from_slurm(env);
  return launch_info{};
}

/// This process's environment as a map.
inline environment_map current_environment() {
  environment_map env;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    std::size_t eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
  }
  return env;
}

/// The layout of this process, from its environment.
inline launch_info resolve_launch() { return resolve_launch(current_environment()); }

}  // namespace weft
