// Preloaded into one rank of a health check (LD_PRELOAD) to make that rank slow the way an
// overloaded node is: every large memcpy in the process (its own copies and Open MPI's
// shared-memory transfers alike) takes 20 ms longer. The check must single that rank out.
#include <cstddef>

#include <time.h>

extern "C" void* memmove(void* dst, const void* src, std::size_t n) noexcept;

extern "C" void* memcpy(void* dst, const void* src, std::size_t n) noexcept {
  if (n >= (std::size_t{32} << 10)) {
    timespec pause{0, 20'000'000};
    nanosleep(&pause, nullptr);
  }
  return memmove(dst, src, n);
}
