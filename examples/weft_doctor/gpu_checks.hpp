#pragma once
// weft-doctor's GPU checks: the GPUs of a node from the PCI bus (sysfs), and from NVML when it
// loads: model, driver and CUDA versions, ECC errors, retired pages and row remapping, throttling,
// and the topology (GPU-GPU links, the NUMA node and RDMA device nearest each GPU).

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "checks.hpp"

namespace weft_doctor {

/// What a node's GPUs are, for the checks and for the comparison across nodes.
struct gpu_facts {
  std::vector<gpu_info> gpus;
  std::string driver;       // "550.54.15", or "" without a driver
  std::string cuda_driver;  // the CUDA version the driver supports, or ""
  std::string source;       // where the list came from (NVML or the PCI bus)
};

inline gpu_facts read_gpus(const roots& r, const nvml_library& nvml) {
  gpu_facts facts;
  facts.gpus = pci_gpus(r);
  facts.source = "the PCI bus (" + (r.sysfs / "bus/pci/devices").string() + ")";
  facts.driver = proc_driver_version(r);
  if (nvml.ready()) {
    std::vector<gpu_info> listed;
    for (auto d : nvml.devices()) {
      gpu_info g{nvml.bus_id(d), nvml.text("nvmlDeviceGetName", d), -1};
      if (auto n = read_line(r.sysfs / "bus/pci/devices" / g.bus_id / "numa_node")) g.numa_node = std::atoi(n->c_str());
      listed.push_back(g);
    }
    facts.gpus = listed;
    facts.source = "NVML";
    if (auto v = nvml.driver_version(); !v.empty()) facts.driver = v;
    facts.cuda_driver = nvml.cuda_driver_version();
  }
  return facts;
}

/// NVML's counters of one GPU that say it is failing (counted in `failing`) or slowed down.
inline std::vector<std::string> gpu_health_problems(const nvml_library& nvml, nvml_library::device d, int* failing) {
  std::vector<std::string> problems;
  // nvmlDeviceGetTotalEccErrors(device, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1, NVML_VOLATILE_ECC = 0, count)
  unsigned long long ecc = 0;
  if (auto f = nvml.symbol<int (*)(nvml_library::device, int, int, unsigned long long*)>("nvmlDeviceGetTotalEccErrors");
      f && f(d, 1, 0, &ecc) == nvml_library::success && ecc > 0) {
    problems.push_back(std::to_string(ecc) + " uncorrected ECC errors since the driver loaded");
    ++*failing;
  }
  // nvmlDeviceGetRemappedRows (A100 and later): a pending remap needs a GPU reset; a failure, a replacement.
  unsigned corrected = 0, uncorrected = 0, pending = 0, failed = 0;
  if (auto f = nvml.symbol<int (*)(nvml_library::device, unsigned*, unsigned*, unsigned*, unsigned*)>(
          "nvmlDeviceGetRemappedRows");
      f && f(d, &corrected, &uncorrected, &pending, &failed) == nvml_library::success) {
    if (pending) problems.push_back("a row remap is pending (reset the GPU)");
    if (failed) problems.push_back("row remapping failed (replace the GPU)");
    *failing += (pending ? 1 : 0) + (failed ? 1 : 0);
  } else if (auto g = nvml.symbol<int (*)(nvml_library::device, int, unsigned*, unsigned long long*)>(
                 "nvmlDeviceGetRetiredPages")) {
    // Older GPUs retire pages instead: cause 1 is a double-bit ECC error.
    unsigned count = 0;
    g(d, 1, &count, nullptr);
    if (count > 0) {
      problems.push_back(std::to_string(count) + " pages retired for double-bit ECC errors");
      ++*failing;
    }
  }
  // Throttle reasons other than idle (0x1) and the application clock setting (0x2).
  unsigned long long reasons = 0;
  if (auto f = nvml.symbol<int (*)(nvml_library::device, unsigned long long*)>("nvmlDeviceGetCurrentClocksThrottleReasons");
      f && f(d, &reasons) == nvml_library::success && (reasons & ~0x3ull) != 0) {
    std::vector<std::string> why;
    if (reasons & 0x4) why.push_back("software power cap");
    if (reasons & 0x8) why.push_back("hardware slowdown");
    if (reasons & 0x20) why.push_back("software thermal");
    if (reasons & 0x40) why.push_back("hardware thermal");
    if (reasons & 0x80) why.push_back("power brake");
    char hex[20];
    std::snprintf(hex, sizeof hex, "0x%llx", reasons);
    problems.push_back("clocks throttled (reasons " + std::string(hex) + (why.empty() ? "" : ": " + joined(why)) + ")");
  }
  return problems;
}

/// The node's GPU checks: count and model, health, topology.
inline std::vector<check> check_gpus(const nvml_library& nvml, const gpu_facts& facts,
                                     const std::vector<rdma_port>& ports) {
  std::vector<check> checks;
  if (facts.gpus.empty()) {
    const std::string why = "no NVIDIA GPU on this node (none on the PCI bus" +
                            std::string(nvml.ready() ? ", none in NVML)" : "; " + nvml.reason() + ")");
    checks.push_back({"gpu.count", status::skip, why, "the GPUs the job runs on, the same on every node", "", ""});
    checks.push_back({"gpu.health", status::skip, "no GPU to check", "no ECC errors, pending remaps or throttling", "", ""});
    checks.push_back({"gpu.topology", status::skip, "no GPU to check", "each GPU's NVLink/PCIe links, nearest NIC and NUMA node", "", ""});
    return checks;
  }
  std::vector<std::string> models;
  for (const gpu_info& g : facts.gpus) models.push_back(g.model);
  std::sort(models.begin(), models.end());
  models.erase(std::unique(models.begin(), models.end()), models.end());
  checks.push_back({"gpu.count", status::pass,
                    std::to_string(facts.gpus.size()) + " x " + joined(models) + " (from " + facts.source +
                        "), driver " + (facts.driver.empty() ? "unknown" : facts.driver) +
                        (facts.cuda_driver.empty() ? "" : ", CUDA " + facts.cuda_driver),
                    "the GPUs the job runs on, the same on every node (compared below)", "", ""});
  if (!nvml.ready()) {
    checks.push_back({"gpu.health", status::skip, nvml.reason(), "no ECC errors, pending remaps or throttling", "", ""});
  } else {
    std::vector<std::string> problems;
    int failing = 0;  // problems other than throttling
    const auto devices = nvml.devices();
    for (std::size_t i = 0; i < devices.size(); ++i)
      for (const std::string& p : gpu_health_problems(nvml, devices[i], &failing))
        problems.push_back("GPU " + std::to_string(i) + ": " + p);
    check c{"gpu.health", problems.empty() ? status::pass : status::fail,
            problems.empty() ? "no uncorrected ECC errors, no pending or failed remaps, no throttling" : joined(problems, "; "),
            "no ECC errors, pending remaps or throttling", "", ""};
    if (!problems.empty())
      c.fix = "drain the node: reset GPUs with pending remaps (nvidia-smi -r), replace GPUs with failed remaps or "
              "growing ECC counts, and check cooling and power limits of throttled ones (nvidia-smi -q -d "
              "PERFORMANCE); see docs/doctor.md#gpus";
    if (!problems.empty() && failing == 0) c.result = status::warn;  // throttled only
    checks.push_back(c);
  }
  // Topology: each GPU's NUMA node and the RDMA devices on the same NUMA node; GPU pairs over NVML.
  std::vector<std::string> lines, problems;
  for (std::size_t i = 0; i < facts.gpus.size(); ++i) {
    const gpu_info& g = facts.gpus[i];
    std::vector<std::string> near;
    for (const rdma_port& p : ports)
      if (p.numa_node == g.numa_node && g.numa_node >= 0 && (near.empty() || near.back() != p.device)) near.push_back(p.device);
    lines.push_back("GPU " + std::to_string(i) + " " + g.bus_id + ": NUMA " + std::to_string(g.numa_node) +
                    ", NIC " + (near.empty() ? "none on its NUMA node" : joined(near, "/")));
    if (!ports.empty() && near.empty()) problems.push_back("GPU " + std::to_string(i) + " has no RDMA device on its NUMA node");
  }
  if (nvml.ready()) {
    // nvmlDeviceGetTopologyCommonAncestor: 0 same board, 10 one PCIe switch, 20 several switches,
    // 30 host bridge, 40 same CPU, 50 across CPUs. NVLink shows in nvmlDeviceGetNvLinkState.
    auto ancestor = nvml.symbol<int (*)(nvml_library::device, nvml_library::device, int*)>(
        "nvmlDeviceGetTopologyCommonAncestor");
    auto nvlink = nvml.symbol<int (*)(nvml_library::device, unsigned, int*)>("nvmlDeviceGetNvLinkState");
    const auto devices = nvml.devices();
    int links = 0;
    for (std::size_t i = 0; i < devices.size(); ++i)
      for (unsigned l = 0; nvlink && l < 18; ++l) {
        int active = 0;
        if (nvlink(devices[i], l, &active) == nvml_library::success && active) ++links;
      }
    std::string pairs;
    for (std::size_t i = 0; ancestor && i < devices.size(); ++i)
      for (std::size_t j = i + 1; j < devices.size(); ++j) {
        int level = -1;
        if (ancestor(devices[i], devices[j], &level) != nvml_library::success) continue;
        const char* name = level <= 10 ? "PIX" : level <= 20 ? "PXB" : level <= 30 ? "PHB" : level <= 40 ? "NODE" : "SYS";
        if (level > 40) pairs += " " + std::to_string(i) + "-" + std::to_string(j) + ":" + name;
      }
    lines.push_back(std::to_string(links) + " active NVLinks");
    if (links == 0 && devices.size() > 1)
      lines.push_back("GPU pairs across CPU sockets (PCIe only):" + (pairs.empty() ? std::string(" none") : pairs));
  } else {
    lines.push_back("GPU-GPU links not read (" + nvml.reason() + ")");
  }
  check c{"gpu.topology", problems.empty() ? status::pass : status::warn, joined(lines, "; "),
          "each GPU with an RDMA device on its NUMA node; NVLink between the GPUs of a node", "", ""};
  if (!problems.empty())
    c.fix = joined(problems, "; ") + ": its traffic crosses the CPU interconnect; check `nvidia-smi topo -m` and "
            "that NCCL_IB_HCA does not leave out its nearest NIC; see docs/doctor.md#topology";
  checks.push_back(c);
  return checks;
}

/// GPUDirect RDMA lets the NIC read GPU memory without a copy through the host: the
/// nvidia_peermem module (nv_peer_mem before it), or dma-buf (the open kernel module on Linux 5.12+).
inline check check_gpudirect(const roots& r, bool has_gpus, bool has_rdma) {
  check c{"network.gpudirect_rdma", status::pass, "", "nvidia_peermem loaded, or dma-buf (open module, Linux 5.12+)", "", ""};
  if (!has_gpus || !has_rdma) {
    c.result = status::skip;
    c.value = std::string("no ") + (!has_gpus ? "GPU" : "RDMA device") + " on this node";
    return c;
  }
  bool open_module = false;
  proc_driver_version(r, &open_module);
  if (module_loaded(r, "nvidia_peermem") || module_loaded(r, "nv_peer_mem")) {
    c.value = "nvidia_peermem loaded";
  } else if (open_module && kernel_version(r) >= 512) {
    c.value = "dma-buf (NVIDIA open kernel module, Linux " + read_line(r.proc / "sys/kernel/osrelease").value_or("?") + ")";
  } else {
    c.result = status::warn;
    c.value = "neither nvidia_peermem nor dma-buf";
    c.fix = "modprobe nvidia_peermem (and load it at boot), or use the open kernel module on Linux 5.12+ for dma-buf; "
            "without GPUDirect RDMA every inter-node transfer is staged through host memory (NCCL_DEBUG=INFO shows "
            "GDRDMA when it is used); see docs/doctor.md#gpudirect-rdma";
  }
  return c;
}

}  // namespace weft_doctor
