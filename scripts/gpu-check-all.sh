#!/usr/bin/env bash
# One GPU call after kernel or engine changes (run on the GPU machine from the repository root,
# binaries carried in .gpu/): the decode-step kernel checks and timings (`kernel-check
# --decode-ops`), every W4A16 GEMV candidate's checks and timings (`w4a16-bench --gemv`), the
# engine's GPU tests, and plain decode of the Kimi K2.6 EP8 preset at 1K / 8K / 32K.
#   OUT=DIR scripts/gpu-check-all.sh [SEED]
# Full outputs in $OUT; a summary on stdout.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SEED=${1:-1}
R=scripts/gpu-run.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 $R .gpu/kernel-check --decode-ops --seed "$SEED" > "$OUT/decode-ops.txt" 2>&1; echo "decode-ops rc=$?"
grep -iE "passed|failed|gate_up|add2|add_rms" "$OUT/decode-ops.txt" | head -30
timeout 200 $R .gpu/w4a16-bench --gemv --seed "$SEED" > "$OUT/gemv.txt" 2>&1; echo "w4a16-bench --gemv rc=$?"
grep -iE "checks|failed|T = 1 |pair" "$OUT/gemv.txt" | head -30
DDTREE_REQUIRE_GPU=1 timeout 150 $R .gpu/gpu-test --test-threads=1 --nocapture > "$OUT/gpu-test.txt" 2>&1; echo "gpu-test rc=$?"
grep -E "test result|agreement|DDTree ==|panicked|left:|right:|identical" "$OUT/gpu-test.txt"
timeout 300 $R .gpu/ddtree bench --preset kimi-k2.6-ep8 --accept 1 --budgets 8 --tokens 16 > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
grep -E "decode ctx|budget" "$OUT/bench.txt"
