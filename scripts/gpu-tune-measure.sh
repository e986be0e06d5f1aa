#!/usr/bin/env bash
# Issue 3 measurements on the GPU machine, in one call (run through scripts/gpu-run.sh, which
# puts libnvrtc on LD_LIBRARY_PATH):
#   scripts/gpu-run.sh scripts/gpu-tune-measure.sh [BIN_DIR (default .gpu)]
# Prints: NVRTC compile time per variant, cold vs warm compile cache; the total time of a cold
# `autotune --preset kimi-k2.6` (empty compile and tune caches) with its winner-vs-default
# table; a warm re-run; warm startup to the first launch. Uses a fresh cache folder, removed
# at the end (the tune cache JSON is printed first).
set -euo pipefail
bin="${1:-.gpu}/autotune"
[ -x "$bin" ] || { echo "no $bin: build with 'cargo build --release --bin autotune' and copy it there" >&2; exit 2; }
export DDTREE_CACHE_DIR="$(mktemp -d -t ddtree-tune-XXXXXX)"
trap 'rm -rf "$DDTREE_CACHE_DIR"' EXIT
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv 2>/dev/null || true
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)   date: $(date -u +%F)   cache: $DDTREE_CACHE_DIR"

echo; echo "=== 1. NVRTC compile time per variant, cold vs warm compile cache ==="
"$bin" --preset kimi-k2.6 --compile-report

echo; echo "=== 2. cold autotune --preset kimi-k2.6 (empty compile + tune caches) ==="
t0=$(now); "$bin" --preset kimi-k2.6; t1=$(now)
echo "COLD autotune wall time: $(secs "$t0" "$t1") s (goal <= 120 s)"

echo; echo "=== 3. warm re-run (everything cached) ==="
t0=$(now); "$bin" --preset kimi-k2.6 > /dev/null; t1=$(now)
echo "WARM autotune wall time: $(secs "$t0" "$t1") s"

echo; echo "=== 4. warm startup to first launch (fresh process) ==="
t0=$(now); "$bin" --preset kimi-k2.6 --startup; t1=$(now)
echo "WARM startup process wall time: $(secs "$t0" "$t1") s (goal <= 2 s)"

echo; echo "=== 5. the tune cache file ==="
ls -la "$DDTREE_CACHE_DIR"/tune "$DDTREE_CACHE_DIR"/cubin | head -5
head -c 3000 "$DDTREE_CACHE_DIR"/tune/*.json; echo; echo "..."
