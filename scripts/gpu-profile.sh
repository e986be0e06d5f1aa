#!/usr/bin/env bash
# Per-kernel device times of the Kimi K2.6 EP8 decode step, in one GPU call (run on the GPU
# machine from the repository root, binaries carried in .gpu/):
#   OUT=DIR scripts/gpu-profile.sh [LAYERS (default 3)]
# 0. `ddtree bench --layers N` without the profiler (tunes the kernels it needs into the tune
#    cache, so the profiled run launches no tuning candidates);
# 1. the same (plain decode at 1K on the first N layers) under Nsight Compute,
#    one metric (gpu__time_duration), every kernel of the first decode steps, CSV in
#    $OUT/ncu.csv (kernels of graph replays are profiled node by node, serialized);
# 2. the same bench at N and N + 4 layers without the profiler: the graph's time per layer is
#    the difference over 4, to set against the sum of its kernels' times from 1.
# Summarize with scripts/profile_table.py $OUT/ncu.csv.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${1:-3}
R=scripts/gpu-run.sh
B=".gpu/ddtree bench --preset kimi-k2.6-ep8 --contexts 1024 --accept 1 --budgets 8 --tokens 8"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n1)
echo "ncu: $NCU"
timeout 300 $R $B --layers "$N" > "$OUT/bench-$N.txt" 2>&1; echo "bench --layers $N rc=$?"
grep -E "decode ctx" "$OUT/bench-$N.txt"
timeout 300 $R "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
  --launch-count "${NCU_LAUNCHES:-1500}" --log-file "$OUT/ncu.csv" $B --layers "$N" > "$OUT/ncu-bench.txt" 2>&1
echo "ncu rc=$? ($(wc -l < "$OUT/ncu.csv") lines)"
for n in $((N + 4)); do
  timeout 200 $R $B --layers "$n" > "$OUT/bench-$n.txt" 2>&1; echo "bench --layers $n rc=$?"
  grep -E "decode ctx" "$OUT/bench-$n.txt"
done
