#!/usr/bin/env bash
# The one entry point for work on the GPU machine (see docs/gpu.md). Run it there from the
# repository root, with release binaries built here and carried in .gpu/ (or the folder given).
#
#   scripts/gpu.sh run BIN [ARGS...]            BIN with libnvrtc/libcublas found and put on LD_LIBRARY_PATH
#   scripts/gpu.sh check [SEED]                 decode-op checks + timings, every W4A16 GEMV candidate,
#                                               the engine's GPU tests, a short Kimi EP8 plain decode + DDTree
#   scripts/gpu.sh kernels                      decode-op, W4A16 GEMV and tree-bench tables, GPU tests, short bench
#   scripts/gpu.sh engine BIN_DIR [--skip-checks] [-- BENCH ARGS...]
#                                               kernel checks, GPU tests, `generate` on cpu and cuda, `ddtree bench`
#                                               (VERIFY_COST_PRESET=P adds `autotune --preset P --verify-cost`)
#   scripts/gpu.sh final                        the GPU tests and the full Kimi K2.6 EP8 bench (four drafter profiles)
#   scripts/gpu.sh train [TARGET_MIN DRAFTER_MIN]  train the built-in tiny-code pair (.gpu/train: docs/models.md)
#   scripts/gpu.sh parallel                     multi-GPU code on one GPU: NCCL with one rank (eager and in a graph),
#                                               virtual ranks vs one rank, nccl_bench, one rank's share of TP8+EP8
#   scripts/gpu.sh tree-build [BIN_DIR] [TREE_BENCH_ARGS...]
#                                               autotune tree_build into a fresh cache, then `tree-bench --build-only`
#   scripts/gpu.sh tune [BIN_DIR]               NVRTC compile cache, cold/warm autotune, warm startup
#   scripts/gpu.sh profile [LAYERS]             every decode-step kernel under ncu (one metric) + bench at N, N + 4 layers
#   scripts/gpu.sh ncu NAME REGEX SKIP COUNT CMD...   ncu's full sections for chosen launches, as text
#   scripts/gpu.sh ncu-source NAME REGEX SKIP CMD...  per-SASS-line stall samples of one launch, as CSV
#
# Full outputs go to $OUT (default /tmp/out); a short summary goes to stdout. `env` is another
# name for `run`. Every step runs under `timeout`, so one slow step cannot use up a device call.
set -uo pipefail

OUT=${OUT:-/tmp/out}
BIN=.gpu

usage() {
  sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}

# libnvrtc.so.13 and libcublas.so.13 (CUDA toolkit or the nvidia-* Python wheels) go first on
# LD_LIBRARY_PATH for every subcommand, so the carried binaries load them.
lib_path() {
  local libdirs=() lib found
  for lib in libnvrtc.so.13 libcublas.so.13; do
    found=$(find /usr/local/cuda*/ /usr/lib /opt /usr/local/lib -name "$lib" 2>/dev/null | head -n1 || true)
    [ -n "$found" ] && libdirs+=("$(dirname "$found")")
  done
  LD_LIBRARY_PATH="$(IFS=:; echo "${libdirs[*]:-}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
}

gpu_name() { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; }

find_ncu() {
  local f
  command -v ncu && return
  for f in /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu; do
    [ -x "$f" ] && { echo "$f"; return; }
  done
  echo ncu
}

need() { # need DIR BIN...: every BIN is an executable in DIR
  local dir=$1 b; shift
  for b in "$@"; do
    [ -x "$dir/$b" ] || { echo "no $dir/$b: build it with cargo (see docs/gpu.md) and copy it there" >&2; exit 2; }
  done
}

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# The engine's GPU tests; PATTERN picks the summary lines.
gpu_tests() {
  local limit=$1 pattern=$2; shift 2
  DDTREE_REQUIRE_GPU=1 timeout "$limit" "$BIN/gpu-test" --test-threads=1 "$@" > "$OUT/gpu-test.txt" 2>&1
  echo "gpu-test rc=$?"
  grep -E "$pattern" "$OUT/gpu-test.txt"
}

cmd_check() {
  local seed=${1:-1}
  gpu_name
  timeout 200 "$BIN/kernel-check" --decode-ops --seed "$seed" > "$OUT/decode-ops.txt" 2>&1
  echo "decode-ops rc=$?"
  grep -iE "passed|failed|gate_up|add2|add_rms" "$OUT/decode-ops.txt" | head -30
  timeout 200 "$BIN/w4a16-bench" --gemv --seed "$seed" > "$OUT/gemv.txt" 2>&1
  echo "w4a16-bench --gemv rc=$?"
  grep -iE "checks|failed|T = 1 |pair" "$OUT/gemv.txt" | head -30
  gpu_tests 150 "test result|agreement|DDTree ==|panicked|left:|right:|identical" --nocapture
  timeout 300 "$BIN/ddtree" bench --preset kimi-k2.6-ep8 --accept 1 --budgets 8 --tokens 16 > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?"
  grep -E "decode ctx|budget" "$OUT/bench.txt"
}

cmd_kernels() {
  gpu_name
  timeout 170 "$BIN/kernel-check" --decode-ops --seed 5 > "$OUT/decode-ops.txt" 2>&1; echo "decode-ops rc=$?"
  timeout 150 "$BIN/w4a16-bench" --gemv --seed 5 > "$OUT/w4a16-gemv.txt" 2>&1; echo "w4a16 rc=$?"
  timeout 200 "$BIN/tree-bench" --seed 7 > "$OUT/tree-bench.txt" 2>&1; echo "tree-bench rc=$?"
  gpu_tests 120 "test result|agreement"
  timeout 120 "$BIN/ddtree" bench --preset kimi-k2.6-ep8 --contexts 1024,32768 --budgets 8 --accept 1 --tokens 8 \
    > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?"
  grep -E "checks:|FAIL" "$OUT"/decode-ops.txt "$OUT"/w4a16-gemv.txt "$OUT"/tree-bench.txt | head -20
  grep -E "^decode ctx|budget 8:" "$OUT/bench.txt"
}

cmd_engine() {
  local dir=${1:?engine: BIN_DIR with ddtree, gpu-test, kernel-check}; shift
  local checks=1 dev
  if [ "${1:-}" = "--skip-checks" ]; then checks=0; shift; fi
  [ "${1:-}" = "--" ] && shift
  BIN=$dir
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  if [ $checks = 1 ]; then
    timeout 240 "$BIN/kernel-check" --skip-bench --small --seed 29 > "$OUT/kernel-check.txt" 2>&1
    echo "kernel-check rc=$?"
    grep -E 'passed|FAILED' "$OUT/kernel-check.txt" | tail -3
    gpu_tests 240 'agreement|DDTree ==|DFlash on|test result|panicked' --nocapture
    for dev in cpu cuda; do
      timeout 60 "$BIN/ddtree" generate --device "$dev" --prompt-ids 5,17 --max-tokens 24 --json \
        > "$OUT/generate-$dev.json" 2>&1
      echo "generate $dev rc=$?: $(grep -o '"tokens":\[[0-9,]*\]' "$OUT/generate-$dev.json")"
    done
  fi
  if [ $# -gt 0 ]; then
    timeout 500 "$BIN/ddtree" bench "$@" --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.log"
    echo "bench rc=$?"
    tail -5 "$OUT/bench.log"; cat "$OUT/bench.txt"
  fi
  if [ -x "$BIN/autotune" ] && [ -n "${VERIFY_COST_PRESET:-}" ]; then
    timeout 200 "$BIN/autotune" --preset "$VERIFY_COST_PRESET" --verify-cost > "$OUT/verify-cost.txt" 2>&1
    echo "autotune --verify-cost rc=$?"
    tail -15 "$OUT/verify-cost.txt"
  fi
}

# Needs .gpu/gpu-nccl and .gpu/gpu-parallel (the test executables of ddtree-engine's gpu_nccl
# and gpu_parallel tests) and .gpu/nccl_bench beside ddtree.
cmd_parallel() {
  gpu_name
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  local t
  for t in gpu-nccl gpu-parallel; do
    DDTREE_REQUIRE_GPU=1 timeout 90 "$BIN/$t" --test-threads=1 --nocapture > "$OUT/$t.txt" 2>&1
    echo "$t rc=$?"
    grep -E "^test |test result|panicked" "$OUT/$t.txt" | head -12
  done
  timeout 60 "$BIN/nccl_bench" --gpus 1 > "$OUT/nccl-bench.txt" 2>&1; echo "nccl_bench rc=$?"
  tail -n 8 "$OUT/nccl-bench.txt"
  timeout 120 "$BIN/ddtree" bench --preset kimi-k2.6 --gpus 8 --virtual-rank 0 --accept 1 --budgets 8 --tokens 16 \
    > "$OUT/virtual-rank.txt" 2>&1
  echo "virtual-rank bench rc=$?"
  tail -n 12 "$OUT/virtual-rank.txt"
}

# .gpu/train holds a copy of scripts/ and ddtree-engine/models/tiny-code/target/tokenizer.json in
# the repository's layout, whl/ (transformers 4.57.3, tokenizers 0.22.2, huggingface_hub 0.36.0)
# and tokens.pt.xz (train_target.py --dump-tokens). $OUT gets target-bf16.pt (bf16 loses nothing
# the export keeps; the routing bias stays f32), dflash.pt, the logs and the device's export.
cmd_train() {
  local tm=${1:-4.2} dm=${2:-3.3} dir=$BIN/train pyx=/tmp/pyx-train w=/tmp/train-work
  gpu_name
  python3 -m pip install -q --no-deps --no-index --target "$pyx" "$dir"/whl/*.whl || return
  xz -dc "$dir/tokens.pt.xz" > /tmp/tokens.pt || return
  rm -rf "$w"; mkdir -p "$w" "$OUT/target"
  (
    cd "$dir/scripts" && export PYTHONPATH=$pyx
    python3 train_target.py --tokens /tmp/tokens.pt --device cuda --batch 64 --minutes "$tm" --work "$w" 2>&1 | tail -n 12
    python3 - "$w" "$OUT" <<'PY'
import sys, torch
w, out = sys.argv[1:]
sd = torch.load(f"{w}/target.pt", map_location="cpu")
sd = {k: v if "correction_bias" in k or not v.is_floating_point() else v.to(torch.bfloat16) for k, v in sd.items()}
torch.save(sd, f"{out}/target-bf16.pt")
PY
    cp ../ddtree-engine/models/tiny-code/target/{config.json,model.safetensors,golden.json} "$OUT/target/"
    python3 train_dflash.py --tokens /tmp/tokens.pt --device cuda --batch 64 --minutes "$dm" --work "$w" --no-export 2>&1 | tail -n 6
  )
  cp "$w/dflash.pt" "$w/train_target.log" "$w/train_dflash.log" "$OUT/"
}

cmd_final() {
  gpu_name
  gpu_tests 120 "test result|agreement|DDTree ==|panicked|left:|right:" --nocapture
  timeout 420 "$BIN/ddtree" bench --preset kimi-k2.6-ep8 --accept 1,0.7,0.5,switching --tokens 96 \
    --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?"
  grep -vE "^\[|tuned|winner" "$OUT/bench.txt" | tail -45
}

# autotune tree_build into a fresh cache (every budget bucket at depths 7 and 15: each candidate
# checked against the CPU builder, then timed), then `tree-bench --build-only` with that cache,
# so its "engine's variant" column is the tuned one the CUDA backend would launch.
cmd_tree_build() {
  local dir=${1:-.gpu} failed=0 t0
  shift || true
  need "$dir" autotune tree-bench
  DDTREE_CACHE_DIR="$(mktemp -d -t ddtree-tree-XXXXXX)"
  export DDTREE_CACHE_DIR
  # shellcheck disable=SC2064 # the folder is fixed now
  trap "rm -rf '$DDTREE_CACHE_DIR'" EXIT
  echo "=== 1. autotune --kernels tree_build ==="
  t0=$(now)
  timeout --kill-after=10 "${T_TUNE:-300}" "$dir/autotune" --preset kimi-k2.6 --kernels tree_build || failed=1
  echo "autotune: $(secs "$t0" "$(now)") s"
  echo; echo "=== 2. tree-bench --build-only $* ==="
  timeout --kill-after=10 "${T_BENCH:-400}" "$dir/tree-bench" --build-only "$@" || failed=1
  exit $failed
}

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
    124|137) echo "$label TIMED OUT after $(secs "$t0" "$t1") s (limit $limit s)"; tune_failed=1 ;;
    *) echo "$label FAILED (exit $rc) after $(secs "$t0" "$t1") s"; tune_failed=1 ;;
  esac
}

show_tune_cache() {
  local f
  echo; echo "=== 5. the tune cache file ==="
  # shellcheck disable=SC2012 # a listing for the eye, not parsed
  ls -la "$DDTREE_CACHE_DIR"/tune "$DDTREE_CACHE_DIR"/cubin 2>&1 | head -5
  for f in "$DDTREE_CACHE_DIR"/tune/*.json; do
    [ -f "$f" ] || { echo "(no tune cache file)"; continue; }
    echo "$f: $(grep -c '"kernel"' "$f") entries"
    head -c 3000 "$f"; echo; echo "..."
  done
  rm -rf "$DDTREE_CACHE_DIR"
}

# The runtime's measurements in one call, in a fresh cache folder removed at the end: NVRTC
# compile time per variant (cold vs warm compile cache), a cold `autotune --preset kimi-k2.6`
# with its winner-vs-default table, a warm re-run, warm startup to the first launch, and the
# tune cache JSON whatever happened. A failed step does not stop the later ones.
cmd_tune() {
  local dir=${1:-.gpu} bin
  bin="$dir/autotune"
  need "$dir" autotune
  : "${T_REPORT:=60}" "${T_COLD:=300}" "${T_WARM:=60}" "${T_STARTUP:=30}"
  DDTREE_CACHE_DIR="$(mktemp -d -t ddtree-tune-XXXXXX)"
  export DDTREE_CACHE_DIR
  tune_failed=0
  trap show_tune_cache EXIT
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
  exit $tune_failed
}

# Per-kernel device times of the Kimi K2.6 EP8 decode step on its first N layers:
# 0. `ddtree bench --layers N` without the profiler (tunes what it needs into the tune cache, so
#    the profiled run launches no tuning candidates);
# 1. the same under Nsight Compute, one metric (gpu__time_duration), every kernel of the first
#    decode steps (graph replays are profiled node by node, serialized), CSV in $OUT/ncu.csv;
# 2. the bench at N + 4 layers: the graph's time per layer is the difference over 4, to set
#    against the sum of its kernels' times from 1.
# Summarize with scripts/profile_table.py $OUT/ncu.csv.
cmd_profile() {
  local n=${1:-3} ncu
  local bench=("$BIN/ddtree" bench --preset kimi-k2.6-ep8 --contexts 1024 --accept 1 --budgets 8 --tokens 8)
  gpu_name
  ncu=$(find_ncu); echo "ncu: $ncu"
  timeout 300 "${bench[@]}" --layers "$n" > "$OUT/bench-$n.txt" 2>&1; echo "bench --layers $n rc=$?"
  grep -E "decode ctx" "$OUT/bench-$n.txt"
  timeout 300 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --launch-count "${NCU_LAUNCHES:-1500}" --log-file "$OUT/ncu.csv" "${bench[@]}" --layers "$n" \
    > "$OUT/ncu-bench.txt" 2>&1
  echo "ncu rc=$? ($(wc -l < "$OUT/ncu.csv") lines)"
  timeout 200 "${bench[@]}" --layers $((n + 4)) > "$OUT/bench-$((n + 4)).txt" 2>&1
  echo "bench --layers $((n + 4)) rc=$?"
  grep -E "decode ctx" "$OUT/bench-$((n + 4)).txt"
}

# Nsight Compute's full section set (stall reasons, memory and scheduler statistics, source
# counters) for COUNT launches of kernels matching REGEX after SKIP of them; the report as text
# in $OUT/ncu-NAME.txt, the command's own output in $OUT/ncu-NAME.log. Clocks are left alone.
cmd_ncu() {
  [ $# -ge 5 ] || usage
  local name=$1 regex=$2 skip=$3 count=$4 ncu; shift 4
  ncu=$(find_ncu)
  timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none --set full \
    -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    --log-file "$OUT/ncu-$name.txt" "$@" > "$OUT/ncu-$name.log" 2>&1
  echo "ncu $name rc=$? ($(grep -c 'Section:' "$OUT/ncu-$name.txt" 2>/dev/null) sections)"
}

# Per-instruction (SASS) hot spots of the launch after SKIP launches of kernels matching REGEX:
# $OUT/NAME-sass.csv (warp-stall samples and executed instructions per SASS line),
# $OUT/NAME-details.txt (the section details) and $OUT/NAME.log; the report itself is removed.
cmd_ncu_source() {
  [ $# -ge 4 ] || usage
  local name=$1 regex=$2 skip=$3 ncu; shift 3
  ncu=$(find_ncu)
  timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none --set full \
    --import-source no -k "regex:$regex" --launch-skip "$skip" --launch-count 1 \
    -o "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "ncu $name rc=$?"
  "$ncu" -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name-sass.csv" 2>&1
  echo "source page rc=$? ($(wc -l < "$OUT/$name-sass.csv") lines)"
  "$ncu" -i "$OUT/$name.ncu-rep" --page details --print-details all > "$OUT/$name-details.txt" 2>&1
  rm -f "$OUT/$name.ncu-rep"
}

[ $# -ge 1 ] || usage
sub=$1; shift
lib_path
case $sub in
  run|env) [ $# -ge 1 ] || usage; exec "$@" ;;
  -h|--help|help) usage ;;
esac
mkdir -p "$OUT"
case $sub in
  check) cmd_check "$@" ;;
  kernels) cmd_kernels ;;
  engine) cmd_engine "$@" ;;
  final) cmd_final ;;
  parallel) cmd_parallel ;;
  train) cmd_train "$@" ;;
  tree-build) cmd_tree_build "$@" ;;
  tune) cmd_tune "$@" ;;
  profile) cmd_profile "$@" ;;
  ncu) cmd_ncu "$@" ;;
  ncu-source) cmd_ncu_source "$@" ;;
  *) echo "unknown subcommand: $sub" >&2; usage ;;
esac
