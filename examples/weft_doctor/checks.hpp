#pragma once
// weft-doctor's checks of one node, read from sysfs and procfs (or fake trees of them, for tests)
// and from NVML when the node has it: pure functions of what they read, no MPI.

#include <dlfcn.h>
#include <ifaddrs.h>
#include <net/if.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace weft_doctor {

enum class status { pass, warn, fail, skip };

inline const char* status_name(status s) {
  switch (s) {
    case status::pass: return "PASS";
    case status::warn: return "WARN";
    case status::fail: return "FAIL";
    case status::skip: return "SKIP";
  }
  return "?";
}

/// One line of the report: what was checked, on which node, what was measured against what was
/// expected, and what to do about it (empty when there is nothing to do).
struct check {
  std::string name;
  status result = status::skip;
  std::string value;
  std::string expected;
  std::string fix;
  std::string node;
};

/// Where the node's kernel interfaces are read: / normally, fake trees in the tests.
struct roots {
  std::filesystem::path sysfs = "/sys";
  std::filesystem::path proc = "/proc";
};

/// The first line of a sysfs/procfs file without its line end, or nothing when it cannot be read.
inline std::optional<std::string> read_line(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' ')) line.pop_back();
  return line;
}

inline std::string read_all(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// The entries of a directory, sorted by name (none when it does not exist).
inline std::vector<std::string> entries(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

inline std::string joined(const std::vector<std::string>& items, std::string_view separator = ", ") {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? std::string(separator) : std::string()) + items[i];
  return out;
}

inline std::string number(double value, const char* pattern = "%.3g") {
  char text[64];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

/// "0-3,8,10-11" to the CPUs it lists.
inline std::set<int> parse_cpu_list(std::string_view list) {
  std::set<int> cpus;
  std::size_t at = 0;
  while (at < list.size()) {
    std::size_t end = list.find(',', at);
    if (end == std::string_view::npos) end = list.size();
    const std::string part(list.substr(at, end - at));
    int first = 0, last = 0;
    if (std::sscanf(part.c_str(), "%d-%d", &first, &last) == 2) {
      for (int c = first; c <= last && c - first < 1 << 16; ++c) cpus.insert(c);
    } else if (std::sscanf(part.c_str(), "%d", &first) == 1) {
      cpus.insert(first);
    }
    at = end + 1;
  }
  return cpus;
}

// ---- InfiniBand / RoCE ports ----

/// One port of an RDMA device, as sysfs shows it under class/infiniband/<device>/ports/<port>/.
struct rdma_port {
  std::string device;
  std::string port;
  std::string state;       // "4: ACTIVE"
  std::string phys_state;  // "5: LinkUp"
  std::string rate;        // "400 Gb/sec (4X NDR)"
  std::string link_layer;  // "InfiniBand" or "Ethernet" (RoCE)
  double gbps = 0;         // the number the rate begins with
  int numa_node = -1;      // of the device's PCI function; -1 when unknown
};

inline std::vector<rdma_port> rdma_ports(const roots& r) {
  std::vector<rdma_port> ports;
  const auto base = r.sysfs / "class/infiniband";
  for (const std::string& device : entries(base)) {
    int numa = -1;
    if (auto n = read_line(base / device / "device/numa_node")) numa = std::atoi(n->c_str());
    for (const std::string& port : entries(base / device / "ports")) {
      const auto dir = base / device / "ports" / port;
      rdma_port p{device, port, read_line(dir / "state").value_or("?"), read_line(dir / "phys_state").value_or("?"),
                  read_line(dir / "rate").value_or("?"), read_line(dir / "link_layer").value_or("InfiniBand"), 0, numa};
      p.gbps = std::atof(p.rate.c_str());
      ports.push_back(p);
    }
  }
  return ports;
}

inline bool port_active(const rdma_port& p) { return p.state.find("ACTIVE") != std::string::npos; }

/// One check per port: up, and at the rate the fabric is built for.
inline std::vector<check> check_rdma_ports(const std::vector<rdma_port>& ports, double expect_gbps) {
  std::vector<check> checks;
  if (ports.empty()) {
    checks.push_back({"network.rdma", status::skip, "no InfiniBand or RoCE device (class/infiniband is empty)",
                      "devices with ports ACTIVE at " + number(expect_gbps, "%g") + " Gb/s",
                      "", ""});
    return checks;
  }
  for (const rdma_port& p : ports) {
    check c{"network.rdma." + p.device + ":" + p.port, status::pass,
            p.link_layer + ", state " + p.state + ", physical " + p.phys_state + ", rate " + p.rate,
            "ACTIVE, LinkUp, " + number(expect_gbps, "%g") + " Gb/s (--expect-link-gbps)", "", ""};
    if (!port_active(p)) {
      c.result = status::fail;
      c.fix = "port " + p.device + ":" + p.port + " is down (physical state " + p.phys_state +
              "): check the cable and the switch port (ibstat " + p.device + ", iblinkinfo), that a subnet manager "
              "runs on the fabric (opensm; state INIT means none has configured the port), and exclude the port "
              "with NCCL_IB_HCA until it is fixed; see docs/doctor.md#rdma-ports";
    } else if (p.gbps + 1e-9 < expect_gbps) {
      c.result = status::fail;
      c.fix = "the link trained at " + number(p.gbps, "%g") + " Gb/s, not " + number(expect_gbps, "%g") +
              ": a cable, a transceiver or HCA/switch firmware that does not match (mlxlink -d " + p.device +
              ", mlxfwmanager --query; update the firmware on both ends, reseat or replace the cable); pass "
              "--expect-link-gbps if the fabric is built for this rate; see docs/doctor.md#rdma-ports";
    }
    checks.push_back(c);
  }
  return checks;
}

// ---- network interfaces and NCCL's variables ----

/// The real system's interfaces are asked of the kernel, not of /sys: sysfs shows the network
/// namespace it was mounted in, which is not the process's when it entered another one with
/// `nsenter --net` (a container runtime or a test's hosts on one machine); a tree given with
/// --sysfs-root is read as it is.
inline bool reads_live_system(const roots& r) { return r.sysfs == std::filesystem::path("/sys"); }

/// The interfaces of this process's network namespace with their flags (getifaddrs).
inline std::map<std::string, unsigned> live_interfaces() {
  std::map<std::string, unsigned> found;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return found;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next)
    if (a->ifa_name != nullptr) found[a->ifa_name] |= a->ifa_flags;
  freeifaddrs(list);
  return found;
}

/// The node's network interfaces, by name.
inline std::vector<std::string> network_interfaces(const roots& r) {
  if (!reads_live_system(r)) return entries(r.sysfs / "class/net");
  std::vector<std::string> names;
  for (const auto& [name, flags] : live_interfaces()) names.push_back(name);
  return names;
}

/// A network interface is up when its operstate says so, or when it is "unknown" (loopback,
/// some virtual devices) with IFF_UP set in its flags; on the live system, when the kernel says
/// it is up and running.
inline bool interface_up(const roots& r, const std::string& name) {
  if (reads_live_system(r)) {
    const auto live = live_interfaces();
    const auto it = live.find(name);
    return it != live.end() && (it->second & IFF_UP) != 0 && (it->second & IFF_RUNNING) != 0;
  }
  const auto dir = r.sysfs / "class/net" / name;
  const std::string state = read_line(dir / "operstate").value_or("");
  if (state == "up") return true;
  if (state == "unknown" || state.empty()) {
    const std::string flags = read_line(dir / "flags").value_or("0");
    return (std::strtoul(flags.c_str(), nullptr, 16) & 0x1) != 0;
  }
  return false;
}

/// NCCL_SOCKET_IFNAME: a comma-separated list of interface name prefixes ("=eth0" for an exact
/// name, a leading "^" to exclude them instead). Every name it lists must match an interface
/// that exists and is up (an exclusion list is checked to leave one).
inline check check_socket_ifname(const roots& r, const char* variable) {
  check c{"nccl.socket_ifname", status::pass, "", "names interfaces of this node that are up", "", ""};
  const std::vector<std::string> interfaces = network_interfaces(r);
  if (variable == nullptr) {
    c.result = status::skip;
    c.value = "NCCL_SOCKET_IFNAME is not set: NCCL picks an interface itself (interfaces: " + joined(interfaces) + ")";
    return c;
  }
  std::string list = variable;
  c.value = "NCCL_SOCKET_IFNAME=" + list;
  const bool exclude = !list.empty() && list[0] == '^';
  if (exclude) list.erase(0, 1);
  bool exact = !list.empty() && list[0] == '=';
  if (exact) list.erase(0, 1);
  std::vector<std::string> wanted;
  std::stringstream items(list);
  for (std::string item; std::getline(items, item, ',');)
    if (!item.empty()) wanted.push_back(item);
  auto matches = [&](const std::string& pattern, const std::string& name) {
    return exact ? name == pattern : name.rfind(pattern, 0) == 0;
  };
  std::vector<std::string> missing, down, left;
  if (exclude) {
    for (const std::string& name : interfaces)
      if (std::none_of(wanted.begin(), wanted.end(), [&](const std::string& w) { return matches(w, name); }) &&
          interface_up(r, name))
        left.push_back(name);
    if (left.empty()) missing.push_back("any interface outside " + joined(wanted));
  } else {
    for (const std::string& w : wanted) {
      std::vector<std::string> found;
      for (const std::string& name : interfaces)
        if (matches(w, name)) found.push_back(name);
      if (found.empty()) missing.push_back(w);
      else if (std::none_of(found.begin(), found.end(), [&](const std::string& n) { return interface_up(r, n); }))
        down.push_back(w + " (" + joined(found) + ")");
    }
  }
  if (!missing.empty() || !down.empty()) {
    c.result = status::fail;
    if (!missing.empty()) c.value += "; no interface " + joined(missing);
    if (!down.empty()) c.value += "; down: " + joined(down);
    c.fix = "set NCCL_SOCKET_IFNAME to the interface of the fast network on every node (this node has " +
            joined(interfaces) + "; `ip -br link`); NCCL otherwise fails to connect or falls back to a slow one; "
            "see docs/doctor.md#nccl-variables";
  }
  return c;
}

/// NCCL_IB_HCA: RDMA devices (optionally :port) NCCL may use, each a name prefix ("=" exact,
/// "^" excludes). Every one listed must exist with an ACTIVE port.
inline check check_ib_hca(const std::vector<rdma_port>& ports, const char* variable) {
  check c{"nccl.ib_hca", status::pass, "", "names RDMA devices of this node with an ACTIVE port", "", ""};
  std::vector<std::string> devices;
  for (const rdma_port& p : ports)
    if (devices.empty() || devices.back() != p.device) devices.push_back(p.device);
  if (variable == nullptr) {
    c.result = status::skip;
    c.value = "NCCL_IB_HCA is not set: NCCL uses every RDMA device (" + (devices.empty() ? "none" : joined(devices)) + ")";
    return c;
  }
  std::string list = variable;
  c.value = "NCCL_IB_HCA=" + list;
  if (!list.empty() && list[0] == '^') {
    c.value += " (an exclusion list: not checked)";
    return c;
  }
  const bool exact = !list.empty() && list[0] == '=';
  if (exact) list.erase(0, 1);
  std::vector<std::string> problems;
  std::stringstream items(list);
  for (std::string item; std::getline(items, item, ',');) {
    if (item.empty()) continue;
    const std::string device = item.substr(0, item.find(':'));
    const std::string port = item.find(':') == std::string::npos ? "" : item.substr(item.find(':') + 1);
    bool seen = false, active = false;
    for (const rdma_port& p : ports) {
      if (!(exact ? p.device == device : p.device.rfind(device, 0) == 0) || (!port.empty() && p.port != port)) continue;
      seen = true;
      active = active || port_active(p);
    }
    if (!seen) problems.push_back("no device " + item);
    else if (!active) problems.push_back(item + " has no ACTIVE port");
  }
  if (!problems.empty()) {
    c.result = status::fail;
    c.value += "; " + joined(problems, "; ");
    c.fix = "set NCCL_IB_HCA to this node's RDMA devices with active ports (" +
            (devices.empty() ? std::string("it has none") : joined(devices)) +
            "; ibv_devinfo), or leave it unset; see docs/doctor.md#nccl-variables";
  }
  return c;
}

// ---- limits, kernel modules, CPU affinity ----

/// RDMA registers (pins) the buffers it sends from; a memlock limit makes NCCL's InfiniBand
/// transport fail or fall back to sockets.
inline check check_memlock(const roots& r, bool has_rdma) {
  check c{"limits.memlock", status::pass, "", "unlimited (ulimit -l)", "", ""};
  const std::string limits = read_all(r.proc / "self/limits");
  const auto at = limits.find("Max locked memory");
  if (at == std::string::npos) {
    c.result = status::skip;
    c.value = "cannot read " + (r.proc / "self/limits").string();
    return c;
  }
  std::string soft;
  std::stringstream(limits.substr(at + std::string_view("Max locked memory").size())) >> soft;
  c.value = soft == "unlimited" ? "unlimited" : soft + " bytes";
  if (soft != "unlimited") {
    c.result = has_rdma ? status::fail : status::warn;
    c.fix = "raise the memlock limit to unlimited for the job: `* - memlock unlimited` in "
            "/etc/security/limits.conf, LimitMEMLOCK=infinity for slurmd (PropagateResourceLimits), or `ulimit -l "
            "unlimited` before the launch; RDMA pins its buffers" +
            std::string(has_rdma ? "" : " (this node has no RDMA device, so it matters only once it has one)") +
            "; see docs/doctor.md#limits";
  }
  return c;
}

inline bool module_loaded(const roots& r, std::string_view name) {
  std::ifstream in(r.proc / "modules");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(std::string(name) + " ", 0) == 0) return true;
  return false;
}

/// The kernel's version as major * 100 + minor, from proc/sys/kernel/osrelease (0 when unknown).
inline int kernel_version(const roots& r) {
  int major = 0, minor = 0;
  const std::string release = read_line(r.proc / "sys/kernel/osrelease").value_or("");
  std::sscanf(release.c_str(), "%d.%d", &major, &minor);
  return major * 100 + minor;
}

// ---- GPUs ----

/// An NVIDIA GPU as the PCI bus shows it (sysfs), with what NVML adds when it is there.
struct gpu_info {
  std::string bus_id;  // "0000:17:00.0"
  std::string model;   // NVML's name, or the PCI device id
  int numa_node = -1;
};

/// NVIDIA GPUs (vendor 0x10de, display or 3D controller) on the PCI bus.
inline std::vector<gpu_info> pci_gpus(const roots& r) {
  std::vector<gpu_info> gpus;
  const auto base = r.sysfs / "bus/pci/devices";
  for (const std::string& bus_id : entries(base)) {
    if (read_line(base / bus_id / "vendor").value_or("") != "0x10de") continue;
    const std::string klass = read_line(base / bus_id / "class").value_or("");
    if (klass.rfind("0x0300", 0) != 0 && klass.rfind("0x0302", 0) != 0) continue;
    gpu_info g{bus_id, "NVIDIA PCI device " + read_line(base / bus_id / "device").value_or("?"), -1};
    if (auto n = read_line(base / bus_id / "numa_node")) g.numa_node = std::atoi(n->c_str());
    gpus.push_back(g);
  }
  return gpus;
}

/// The NVIDIA driver's version from proc/driver/nvidia/version ("... Kernel Module  550.54.15 ..."),
/// or "" without the driver.
inline std::string proc_driver_version(const roots& r, bool* open_module = nullptr) {
  const std::string text = read_all(r.proc / "driver/nvidia/version");
  if (open_module) *open_module = text.find("Open Kernel Module") != std::string::npos;
  const auto at = text.find("Kernel Module");
  if (at == std::string::npos) return "";
  std::stringstream rest(text.substr(at + std::string_view("Kernel Module").size()));
  std::string word;
  while (rest >> word)
    if (!word.empty() && word[0] >= '0' && word[0] <= '9') return word;
  return "";
}

/// NVML, loaded with dlopen so that weft-doctor runs where there is none. The declarations are
/// NVML's stable C ABI (nvml.h), written here so that building needs no NVML either.
class nvml_library {
 public:
  using device = void*;
  static constexpr int success = 0;

  nvml_library() {
    handle_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      const char* why = dlerror();
      reason_ = std::string("NVML is not installed (dlopen libnvidia-ml.so.1: ") + (why ? why : "not found") + ")";
      return;
    }
    auto init = symbol<int (*)()>("nvmlInit_v2");
    if (init == nullptr) {
      reason_ = "libnvidia-ml.so.1 has no nvmlInit_v2";
      return;
    }
    if (const int code = init(); code != success) {
      reason_ = "nvmlInit_v2 failed with NVML error " + std::to_string(code) + " (is the NVIDIA driver loaded?)";
      return;
    }
    ready_ = true;
  }
  ~nvml_library() {
    if (ready_)
      if (auto shutdown = symbol<int (*)()>("nvmlShutdown")) shutdown();
    if (handle_ != nullptr) dlclose(handle_);
  }
  nvml_library(const nvml_library&) = delete;
  nvml_library& operator=(const nvml_library&) = delete;

  bool ready() const { return ready_; }
  const std::string& reason() const { return reason_; }

  /// The function `name` of NVML, or nullptr when this NVML lacks it.
  template <class F>
  F symbol(const char* name) const {
    return handle_ == nullptr ? nullptr : reinterpret_cast<F>(dlsym(handle_, name));
  }

  std::vector<device> devices() const {
    std::vector<device> found;
    unsigned count = 0;
    auto get_count = symbol<int (*)(unsigned*)>("nvmlDeviceGetCount_v2");
    auto get_handle = symbol<int (*)(unsigned, device*)>("nvmlDeviceGetHandleByIndex_v2");
    if (!get_count || !get_handle || get_count(&count) != success) return found;
    for (unsigned i = 0; i < count; ++i) {
      device d = nullptr;
      if (get_handle(i, &d) == success) found.push_back(d);
    }
    return found;
  }
  std::string text(const char* function, device d) const {
    char buffer[96] = {};
    if (auto f = symbol<int (*)(device, char*, unsigned)>(function); f && f(d, buffer, sizeof buffer) == success)
      return buffer;
    return "";
  }
  std::string driver_version() const {
    char buffer[96] = {};
    auto f = symbol<int (*)(char*, unsigned)>("nvmlSystemGetDriverVersion");
    return f && f(buffer, sizeof buffer) == success ? buffer : "";
  }
  /// The CUDA version the driver supports, "12.4".
  std::string cuda_driver_version() const {
    int version = 0;
    auto f = symbol<int (*)(int*)>("nvmlSystemGetCudaDriverVersion_v2");
    if (!f || f(&version) != success) return "";
    return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
  }
  /// nvmlPciInfo_t's busId ("00000000:17:00.0"), lower case with a 4-digit domain as in sysfs.
  std::string bus_id(device d) const {
    struct pci_info {
      char bus_id_legacy[16];
      unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
      char bus_id[32];
    } info{};
    auto f = symbol<int (*)(device, pci_info*)>("nvmlDeviceGetPciInfo_v3");
    if (!f || f(d, &info) != success) return "";
    char id[32];
    std::snprintf(id, sizeof id, "%04x:%02x:%02x.0", info.domain & 0xffff, info.bus, info.device);
    return id;
  }

 private:
  void* handle_ = nullptr;
  bool ready_ = false;
  std::string reason_;
};

}  // namespace weft_doctor
