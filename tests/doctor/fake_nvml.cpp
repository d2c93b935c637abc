// A stand-in for NVML (libnvidia-ml.so.1) with the functions weft-doctor looks up: two H100 GPUs
// at the PCI addresses of the fake trees' GPUs, and the faults FAKE_NVML_FAULT lists: `ecc`
// (uncorrected ECC errors on GPU 1), `remap` (a row remap pending on GPU 0), `throttle` (hardware
// thermal slowdown on both). Loaded by weft-doctor's dlopen through LD_LIBRARY_PATH.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

bool fault(const char* name) {  // FAKE_NVML_FAULT lists faults, e.g. "ecc,remap"
  const char* set = std::getenv("FAKE_NVML_FAULT");
  return set != nullptr && std::strstr(set, name) != nullptr;
}

unsigned index_of(void* device) { return static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(device) - 1); }

struct pci_info {
  char bus_id_legacy[16];
  unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};

}  // namespace

extern "C" {
int nvmlInit_v2() { return 0; }
int nvmlShutdown() { return 0; }
int nvmlDeviceGetCount_v2(unsigned* count) {
  *count = 2;
  return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned index, void** device) {
  *device = reinterpret_cast<void*>(static_cast<std::uintptr_t>(index) + 1);
  return 0;
}
int nvmlDeviceGetName(void*, char* name, unsigned length) {
  std::snprintf(name, length, "NVIDIA H100 80GB HBM3");
  return 0;
}
int nvmlSystemGetDriverVersion(char* version, unsigned length) {
  std::snprintf(version, length, "550.54.15");
  return 0;
}
int nvmlSystemGetCudaDriverVersion_v2(int* version) {
  *version = 12040;
  return 0;
}
int nvmlDeviceGetPciInfo_v3(void* device, pci_info* info) {
  std::memset(info, 0, sizeof *info);
  info->bus = index_of(device) == 0 ? 0x17 : 0xb3;
  return 0;
}
int nvmlDeviceGetTotalEccErrors(void* device, int, int, unsigned long long* count) {
  *count = fault("ecc") && index_of(device) == 1 ? 3 : 0;
  return 0;
}
int nvmlDeviceGetRemappedRows(void* device, unsigned* corrected, unsigned* uncorrected, unsigned* pending,
                              unsigned* failed) {
  *corrected = *uncorrected = *failed = 0;
  *pending = fault("remap") && index_of(device) == 0 ? 1 : 0;
  return 0;
}
int nvmlDeviceGetCurrentClocksThrottleReasons(void*, unsigned long long* reasons) {
  *reasons = fault("throttle") ? 0x40 : 0x1;  // hardware thermal slowdown, else idle
  return 0;
}
int nvmlDeviceGetTopologyCommonAncestor(void*, void*, int* level) {
  *level = 50;  // across CPU sockets
  return 0;
}
int nvmlDeviceGetNvLinkState(void*, unsigned, int* active) {
  *active = 0;
  return 0;
}
}
