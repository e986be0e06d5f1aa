#!/usr/bin/env bash
# The CUDA backend on the GPU machine, in one call: kernel checks of every suite, the engine's
# GPU tests (agreement with the CPU, DDTree == greedy), `ddtree generate` on the tiny model on
# both devices, and `ddtree bench` (args after `--`). Writes logs to $OUT (or ./gpu-out) and
# prints a short summary.
# Usage (there): scripts/gpu-engine.sh BIN_DIR [--skip-checks] [-- BENCH ARGS...]
set -uo pipefail
bin=${1:?BIN_DIR with ddtree, gpu-test, kernel-check}; shift
out=${OUT:-./gpu-out}; mkdir -p "$out"
gpurun="$(dirname "$0")/gpu-run.sh"
checks=1
if [ "${1:-}" = "--skip-checks" ]; then checks=0; shift; fi
[ "${1:-}" = "--" ] && shift
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ $checks = 1 ]; then
  timeout 240 "$gpurun" "$bin/kernel-check" --skip-bench --small --seed 29 > "$out/kernel-check.txt" 2>&1; echo "kernel-check rc=$?"
  grep -E 'passed|FAILED' "$out/kernel-check.txt" | tail -3
  DDTREE_REQUIRE_GPU=1 timeout 240 "$gpurun" "$bin/gpu-test" --nocapture --test-threads=1 > "$out/gpu-test.txt" 2>&1; echo "gpu-test rc=$?"
  grep -E 'agreement|DDTree ==|DFlash on|test result|panicked' "$out/gpu-test.txt"
  for dev in cpu cuda; do
    timeout 60 "$gpurun" "$bin/ddtree" generate --device $dev --prompt-ids 5,17 --max-tokens 24 --json > "$out/generate-$dev.json" 2>&1
    echo "generate $dev rc=$?: $(grep -o '"tokens":\[[0-9,]*\]' "$out/generate-$dev.json")"
  done
fi
if [ $# -gt 0 ]; then
  timeout 500 "$gpurun" "$bin/ddtree" bench "$@" --json "$out/bench.json" > "$out/bench.txt" 2> "$out/bench.log"; echo "bench rc=$?"
  tail -5 "$out/bench.log"; cat "$out/bench.txt"
fi
if [ -x "$bin/autotune" ] && [ -n "${VERIFY_COST_PRESET:-}" ]; then
  timeout 200 "$gpurun" "$bin/autotune" --preset "$VERIFY_COST_PRESET" --verify-cost > "$out/verify-cost.txt" 2>&1; echo "autotune --verify-cost rc=$?"
  tail -15 "$out/verify-cost.txt"
fi
