set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=scripts/gpu-run.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
DDTREE_REQUIRE_GPU=1 timeout 150 $R .gpu/gpu-test --test-threads=1 --nocapture > "$OUT/gpu-test.txt" 2>&1; echo "gpu-test rc=$?"
grep -E "test result|agreement|DDTree ==|two-stream|panicked|left:|right:|FAILED|failed" "$OUT/gpu-test.txt" | head -30
for mode in "--one-stream" ""; do
timeout 200 $R .gpu/ddtree bench --preset kimi-k2.6-ep8 $mode --budgets 8 --accept 1 --tokens 48 > "$OUT/bench$mode.txt" 2>&1; echo "bench $mode rc=$?"
grep -vE "^\[|tuned|winner" "$OUT/bench$mode.txt" | tail -22
done
