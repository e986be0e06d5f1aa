#!/usr/bin/env bash
# Issue 3 measurements on the GPU machine, in one call (run through scripts/gpu-run.sh, which
# puts libnvrtc on LD_LIBRARY_PATH):
#   scripts/gpu-run.sh scripts/gpu-tune-measure.sh [BIN_DIR (default .gpu)]
# Prints: NVRTC compile time per variant, cold vs warm compile cache; the total time of a cold
# `autotune --preset kimi-k2.6` (empty compile and tune caches) with its winner-vs-default
# table; a warm re-run; warm startup to the first launch. Every step runs under `timeout` (its
# limit in seconds below, overridable), so one slow step cannot use up the call; the steps after
# a failed one still run, and the tune cache JSON is printed at the end whatever happened. Uses a
# fresh cache folder, removed at the end. Exits non-zero if any step failed.
set -uo pipefail
bin="${1:-.gpu}/autotune"
[ -x "$bin" ] || { echo "no $bin: build with 'cargo build --release --bin autotune' and copy it there" >&2; exit 2; }
: "${T_REPORT:=60}" "${T_COLD:=300}" "${T_WARM:=60}" "${T_STARTUP:=30}"
export DDTREE_CACHE_DIR="$(mktemp -d -t ddtree-tune-XXXXXX)"
failed=0
show_cache() {
  echo; echo "=== 5. the tune cache file ==="
  ls -la "$DDTREE_CACHE_DIR"/tune "$DDTREE_CACHE_DIR"/cubin 2>&1 | head -5
  for f in "$DDTREE_CACHE_DIR"/tune/*.json; do
    [ -f "$f" ] || { echo "(no tune cache file)"; continue; }
    echo "$f: $(grep -c '"kernel"' "$f") entries"
    head -c 3000 "$f"; echo; echo "..."
  done
  rm -rf "$DDTREE_CACHE_DIR"
}
trap show_cache EXIT
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
# step LIMIT_S LABEL CMD...: runs CMD under timeout, prints its wall time and how it ended. With
# QUIET=1 its stdout is dropped and only the last 3 lines of its stderr are shown.
step() {
  local limit="$1" label="$2"; shift 2
  local t0 t1 rc err
  err=$(mktemp)
  t0=$(now)
  if [ "${QUIET:-0}" = 1 ]; then
    timeout --kill-after=10 "$limit" "$@" > /dev/null 2> "$err"; rc=$?
    tail -n 3 "$err"
  else
    timeout --kill-after=10 "$limit" "$@"; rc=$?
  fi
  t1=$(now); rm -f "$err"
  case $rc in
    0) echo "$label wall time: $(secs "$t0" "$t1") s" ;;
    124|137) echo "$label TIMED OUT after $(secs "$t0" "$t1") s (limit $limit s)"; failed=1 ;;
    *) echo "$label FAILED (exit $rc) after $(secs "$t0" "$t1") s"; failed=1 ;;
  esac
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv 2>/dev/null || true
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)   date: $(date -u +%F)   cache: $DDTREE_CACHE_DIR"

echo; echo "=== 1. NVRTC compile time per variant, cold vs warm compile cache ==="
step "$T_REPORT" "compile report" "$bin" --preset kimi-k2.6 --compile-report

echo; echo "=== 2. cold autotune --preset kimi-k2.6 (empty compile + tune caches) ==="
step "$T_COLD" "COLD autotune (goal <= 120 s)" "$bin" --preset kimi-k2.6

echo; echo "=== 3. warm re-run (everything cached) ==="
QUIET=1 step "$T_WARM" "WARM autotune" "$bin" --preset kimi-k2.6

echo; echo "=== 4. warm startup to first launch (fresh process) ==="
step "$T_STARTUP" "WARM startup process (goal <= 2 s)" "$bin" --preset kimi-k2.6 --startup
exit $failed
