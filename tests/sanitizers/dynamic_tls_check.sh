#!/usr/bin/env bash
# Checks the leak check scripts/sanitize.sh relies on with intercept_tls_get_addr=0 (why it is off:
# the comment at its ASan options): a pointer held only in a dynamically loaded library's thread-local
# variable is still a root (what the dynamic linker allocates counts as reachable), so it is not
# reported, and an allocation nobody holds still is. A toolchain whose LeakSanitizer drops that
# (its use_ld_allocations is marked for removal upstream) fails here, not in false leak reports.
#   dynamic_tls_check.sh REPO_ROOT CXX
set -euo pipefail
repo="${1:?usage: dynamic_tls_check.sh REPO_ROOT CXX}"
cxx="${2:?usage: dynamic_tls_check.sh REPO_ROOT CXX}"
# sanitize.sh's own ASan options, as its address runs set them.
asan="$(sed -n 's/^ *asan="\(.*\)"$/\1/p' "$repo/scripts/sanitize.sh")"
case "$asan" in
  *intercept_tls_get_addr=0*) ;;
  *) echo "dynamic_tls_check: scripts/sanitize.sh's ASan options ('$asan') no longer turn off intercept_tls_get_addr"; exit 1 ;;
esac
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cat >"$work/keep.cpp" <<'SOURCE'
#include <cstdlib>
thread_local void* kept = nullptr;
extern "C" void keep() { kept = std::malloc(100); }
SOURCE
cat >"$work/main.cpp" <<'SOURCE'
#include <dlfcn.h>
#include <cstdio>
#include <cstdlib>
void* volatile sink;
int main(int argc, char** argv) {
  void* library = dlopen(argv[1], RTLD_NOW);
  if (library == nullptr) { std::puts(dlerror()); return 2; }
  reinterpret_cast<void (*)()>(dlsym(library, "keep"))();
  if (argc > 2) { sink = std::malloc(33); sink = nullptr; }  // held by nobody: a leak
  return 0;
}
SOURCE
"$cxx" -fsanitize=address -g -O0 -shared -fPIC -o "$work/libkeep.so" "$work/keep.cpp"
"$cxx" -fsanitize=address -g -O0 -o "$work/main" "$work/main.cpp" -ldl
failures=0
rc=0
ASAN_OPTIONS="$asan" "$work/main" "$work/libkeep.so" >"$work/held.txt" 2>&1 || rc=$?
if [ "$rc" != 0 ]; then
  echo "FAILED: a pointer held in a loaded library's thread-local variable was reported (exit $rc):"; cat "$work/held.txt"
  failures=$((failures + 1))
else
  echo "ok: a pointer held in a loaded library's thread-local variable is not a leak"
fi
rc=0
ASAN_OPTIONS="$asan" "$work/main" "$work/libkeep.so" leak >"$work/lost.txt" 2>&1 || rc=$?
if [ "$rc" = 23 ] && grep -q "33 byte(s) in 1 object(s)" "$work/lost.txt"; then
  echo "ok: an allocation nobody holds is reported (exit 23)"
else
  echo "FAILED: the allocation nobody holds was not reported as the one leak (exit $rc):"; cat "$work/lost.txt"
  failures=$((failures + 1))
fi
[ "$failures" = 0 ]
