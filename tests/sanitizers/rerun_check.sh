#!/usr/bin/env bash
# Checks scripts/sanitize.sh's handling of LeakSanitizer's tracer crash against a stand-in test
# tree: a test that only crashed that way runs once more with the thread log, then without the
# leak check if it crashes again, and must then pass; a test that failed any other way is not rerun.
#   rerun_check.sh REPO_ROOT
set -euo pipefail
repo="${1:?usage: rerun_check.sh REPO_ROOT}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# A test program whose behaviour on each run is given by the next line of $work/plan:
# tracer (the tracer's crash), asan (an AddressSanitizer report), pass.
cat >"$work/stand_in.sh" <<'PROGRAM'
#!/usr/bin/env bash
plan="$(dirname "$0")/plan"
step="$(head -n 1 "$plan")"; sed -i 1d "$plan"
echo "All tests passed"
# what this run was given (ctest shows a passing test's output nowhere)
echo "$step: ASAN_OPTIONS=$ASAN_OPTIONS LSAN_OPTIONS=$LSAN_OPTIONS" >>"$(dirname "$0")/runs"
case "$step" in
  tracer) echo "Tracer caught signal 11: addr=0x3f88 pc=0x0 sp=0x0"
          echo "==1==LeakSanitizer has encountered a fatal error."; exit 23 ;;
  asan)   echo "==1==ERROR: AddressSanitizer: heap-use-after-free"; exit 23 ;;
  pass)   exit 0 ;;
esac
echo "stand_in.sh: no plan left"; exit 99
PROGRAM
chmod +x "$work/stand_in.sh"
cat >"$work/CTestTestfile.cmake" <<TESTS
add_test(stand_in.np4 "$work/stand_in.sh")
set_tests_properties(stand_in.np4 PROPERTIES LABELS "mpi")
add_test(other.np2 "/bin/true")
set_tests_properties(other.np2 PROPERTIES LABELS "mpi")
TESTS
failures=0
# case NAME "PLAN" EXPECTED_RC GREP...: runs sanitize.sh on the stand-in with that plan; each GREP
# pattern must be in its output or in the options each run was given (a leading ! : must not be),
# and the whole plan must be used.
case_() {
  local name="$1" plan="$2" expected="$3"; shift 3
  printf '%s\n' $plan >"$work/plan"
  : >"$work/runs"
  local rc=0 out
  out="$("$repo/scripts/sanitize.sh" --tests-only address "$work" 2>&1)" || rc=$?
  out+=$'\n'"$(cat "$work/runs")"
  local ok=1
  if [ "$expected" = 0 ] && [ "$rc" != 0 ]; then ok=0; fi
  if [ "$expected" != 0 ] && [ "$rc" = 0 ]; then ok=0; fi
  if [ -s "$work/plan" ]; then ok=0; echo "$name: not every planned run happened: $(paste -sd' ' "$work/plan")"; fi
  local pattern
  for pattern in "$@"; do
    if [ "${pattern#!}" != "$pattern" ]; then
      if grep -qE -- "${pattern#!}" <<<"$out"; then ok=0; echo "$name: output has '${pattern#!}'"; fi
    elif ! grep -qE -- "$pattern" <<<"$out"; then ok=0; echo "$name: output lacks '$pattern'"; fi
  done
  if [ "$ok" = 1 ]; then echo "ok: $name"; else
    failures=$((failures + 1)); echo "FAILED: $name (exit $rc, expected $([ "$expected" = 0 ] && echo 0 || echo 'not 0'))"
    echo "$out" | tail -n 40
  fi
}
case_ "passes" "pass" 0 '!running them once more'
case_ "a tracer crash, then a pass with the thread log" "tracer pass" 0 \
  'tracer crashed at the exit of stand_in.np4; running them once more, with its thread log' \
  'pass: .*LSAN_OPTIONS=.*:verbosity=1:log_threads=1' '!NOT RUN'
case_ "two tracer crashes, then a pass without the leak check" "tracer tracer pass" 0 \
  'leak check NOT RUN for stand_in.np4' 'pass: ASAN_OPTIONS=[^ ]*detect_leaks=0' \
  'tracer: ASAN_OPTIONS=[^ ]*detect_leaks=1.*log_threads=1'
case_ "two tracer crashes, then a sanitizer's report" "tracer tracer asan" 1 'leak check NOT RUN'
case_ "three tracer crashes" "tracer tracer tracer" 1
case_ "a sanitizer's report is not rerun" "asan" 1 '!running them once more'
[ "$failures" = 0 ] || { echo "$failures case(s) failed"; exit 1; }
