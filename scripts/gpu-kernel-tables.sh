#!/usr/bin/env bash
# One GPU call: checks and timings of the new GEMV / attention / builder kernels, then the
# engine's GPU tests and a short plain-decode + DDTree run. Full logs in $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=scripts/gpu-run.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 170 $R .gpu/kernel-check --decode-ops --seed 5 > "$OUT/decode-ops.txt" 2>&1; echo "decode-ops rc=$?"
timeout 150 $R .gpu/w4a16-bench --gemv --seed 5 > "$OUT/w4a16-gemv.txt" 2>&1; echo "w4a16 rc=$?"
timeout 200 $R .gpu/tree-bench --seed 7 > "$OUT/tree-bench.txt" 2>&1; echo "tree-bench rc=$?"
DDTREE_REQUIRE_GPU=1 timeout 120 $R .gpu/gpu-test --test-threads=1 > "$OUT/gpu-test.txt" 2>&1; echo "gpu-test rc=$?"
timeout 120 $R .gpu/ddtree bench --preset kimi-k2.6-ep8 --contexts 1024,32768 --budgets 8 --accept 1 --tokens 8 > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
grep -E "checks:|FAIL" "$OUT"/*.txt | head -20
grep -E "^decode ctx|budget 8:" "$OUT/bench.txt"; grep -E "test result|agreement" "$OUT/gpu-test.txt"
