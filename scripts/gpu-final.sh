#!/usr/bin/env bash
# One GPU call: the engine's GPU tests, then `ddtree bench` on the Kimi K2.6 EP8 preset
# (plain decode at 1K/8K/32K, DDTree budgets 8..256 and auto for four drafter profiles).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=scripts/gpu-run.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
DDTREE_REQUIRE_GPU=1 timeout 120 $R .gpu/gpu-test --test-threads=1 --nocapture > "$OUT/gpu-test.txt" 2>&1; echo "gpu-test rc=$?"
grep -E "test result|agreement|DDTree ==|panicked|left:|right:" "$OUT/gpu-test.txt"
timeout 420 $R .gpu/ddtree bench --preset kimi-k2.6-ep8 --accept 1,0.7,0.5,switching --tokens 96 --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
grep -vE "^\[|tuned|winner" "$OUT/bench.txt" | tail -45
