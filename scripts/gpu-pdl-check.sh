#!/usr/bin/env bash
# One GPU call: the GPU tests (graphs + PDL vs eager without PDL) and plain-decode / DDTree
# timings on the Kimi K2.6 EP8 preset with and without programmatic dependent launch.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
DDTREE_REQUIRE_GPU=1 timeout 200 scripts/gpu-run.sh .gpu/gpu-test --test-threads=1 2>&1 | grep -E "test result|agreement|panicked|FAILED|^test " | head -20
for flag in "" "--no-pdl"; do
  echo "== bench $flag"
  timeout 200 scripts/gpu-run.sh .gpu/ddtree bench --preset kimi-k2.6-ep8 --contexts 1024,32768 --budgets 8 --accept 1 --tokens 24 $flag 2>&1 | grep -vE "^\[|tuned|winner" | tail -25
done
