#!/usr/bin/env bash
# Nsight Compute's full section set (stall reasons, memory and scheduler statistics, source
# counters) for the kernels of one command that match a name, on the GPU machine:
#   OUT=DIR scripts/gpu-ncu.sh NAME REGEX SKIP COUNT CMD [ARGS...]
# profiles COUNT launches of kernels whose name matches REGEX, after skipping SKIP of them,
# and writes the report as text to $OUT/ncu-NAME.txt (the command's own output to
# $OUT/ncu-NAME.log). Clocks are left alone (--clock-control none).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name=$1 regex=$2 skip=$3 count=$4; shift 4
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout "${NCU_TIMEOUT:-240}" scripts/gpu-run.sh "$NCU" --clock-control none --set full \
  -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
  --log-file "$OUT/ncu-$name.txt" "$@" > "$OUT/ncu-$name.log" 2>&1
echo "ncu $name rc=$? ($(grep -c 'Section:' "$OUT/ncu-$name.txt" 2>/dev/null) sections)"
