#!/usr/bin/env bash
# Per-instruction (SASS) hot spots of one kernel launch under Nsight Compute, on the GPU
# machine: warp-stall samples and executed instructions per SASS line, as CSV.
#   OUT=DIR scripts/gpu-ncu-source.sh NAME REGEX SKIP CMD [ARGS...]
# profiles the launch after SKIP launches of kernels matching REGEX; writes
# $OUT/NAME.ncu-rep (the report), $OUT/NAME-sass.csv (the source page) and
# $OUT/NAME-details.txt (the section details).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name=$1 regex=$2 skip=$3; shift 3
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout "${NCU_TIMEOUT:-240}" scripts/gpu-run.sh "$NCU" --clock-control none --set full \
  --import-source no -k "regex:$regex" --launch-skip "$skip" --launch-count 1 \
  -o "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
echo "ncu $name rc=$?"
"$NCU" -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name-sass.csv" 2>&1
echo "source page rc=$? ($(wc -l < "$OUT/$name-sass.csv") lines)"
"$NCU" -i "$OUT/$name.ncu-rep" --page details --print-details all > "$OUT/$name-details.txt" 2>&1
rm -f "$OUT/$name.ncu-rep"
