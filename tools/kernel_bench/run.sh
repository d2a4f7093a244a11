#!/usr/bin/env bash
# Builds onetoken.cu with nvcc once per set of -D options given (quoted; none:
# the kernels' defaults) and runs each build, on the GPU machine (through the
# device tool: command "bash tools/kernel_bench/run.sh ...", nothing to carry).
set -euo pipefail
cd "$(dirname "$0")"
export PATH="/usr/local/cuda/bin:$PATH"
(($# > 0)) || set -- ""
i=0
for defines in "$@"; do
    # shellcheck disable=SC2086
    nvcc -O3 -arch=sm_90 -std=c++17 $defines -o "/tmp/onetoken_$i" onetoken.cu &
    i=$((i + 1))
done
wait
i=0
for defines in "$@"; do
    echo "=== ${defines:-defaults}"
    "/tmp/onetoken_$i"
    i=$((i + 1))
done
