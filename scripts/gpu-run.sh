#!/usr/bin/env bash
# Runs carried release binaries on the GPU machine (see DESIGN.md, "Running on the GPU machine").
# Usage (there): scripts/gpu-run.sh BIN [ARGS...]
# Finds libnvrtc.so.13 and libcublas.so.13 (CUDA toolkit or the nvidia-* Python wheels) and puts
# their folders on LD_LIBRARY_PATH first.
set -euo pipefail
libdirs=()
for lib in libnvrtc.so.13 libcublas.so.13; do
  found=$(find /usr/local/cuda*/ /usr/lib /opt /usr/local/lib -name "$lib" 2>/dev/null | head -n1 || true)
  [ -n "$found" ] && libdirs+=("$(dirname "$found")")
done
LD_LIBRARY_PATH="$(IFS=:; echo "${libdirs[*]:-}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$@"
