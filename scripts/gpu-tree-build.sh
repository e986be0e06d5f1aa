#!/usr/bin/env bash
# The tree builder on the GPU machine in one call (run through scripts/gpu-run.sh, which puts
# libnvrtc on LD_LIBRARY_PATH):
#   scripts/gpu-run.sh scripts/gpu-tree-build.sh [BIN_DIR (default .gpu)] [TREE_BENCH_ARGS...]
# 1. `autotune --preset kimi-k2.6 --kernels tree_build` into a fresh cache folder (every budget
#    bucket at depths 7 and 15: each candidate checked against the CPU builder, then timed);
# 2. `tree-bench --build-only` with that cache, so its "engine's variant" column is the tuned one
#    the CUDA backend would launch; extra arguments go to tree-bench (e.g. --seed N).
# The cache folder is removed at the end. Exits non-zero if either step failed.
set -uo pipefail
dir="${1:-.gpu}"
shift || true
for b in autotune tree-bench; do
  [ -x "$dir/$b" ] || { echo "no $dir/$b: build with 'cargo build --release --bin $b' and copy it there" >&2; exit 2; }
done
export DDTREE_CACHE_DIR="$(mktemp -d -t ddtree-tree-XXXXXX)"
trap 'rm -rf "$DDTREE_CACHE_DIR"' EXIT
failed=0
echo "=== 1. autotune --kernels tree_build ==="
t0=$(date +%s.%N)
timeout --kill-after=10 "${T_TUNE:-300}" "$dir/autotune" --preset kimi-k2.6 --kernels tree_build || failed=1
echo "autotune: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
echo; echo "=== 2. tree-bench --build-only $* ==="
timeout --kill-after=10 "${T_BENCH:-400}" "$dir/tree-bench" --build-only "$@" || failed=1
exit $failed
