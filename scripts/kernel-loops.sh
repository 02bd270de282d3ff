#!/usr/bin/env bash
# Prints the static instruction count of each decode (default) or prefill (REGEX prefill_mma)
# kernel instance and of its main (tile) loop, from the SASS of kernels/paged_attention.cu for one architecture (default sm_90): a
# measure of the work per tile that needs no GPU (scripts/sass_loops.py says what it counts).
# Needs nvcc (eval the output of scripts/install-cuda-toolchain.sh first); installs pinned
# cuobjdump and nvdisasm wheels from PyPI beside the toolchain on first use.
# Usage: scripts/kernel-loops.sh [ARCH] [REGEX]
set -euo pipefail
arch=${1:-90}
filter=${2:-decode}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tools=${PAGEDKV_CUDA_DIR:-$root/.cuda-toolchain}/sass-tools
pins=(nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51)
bin=$tools/nvidia/cu13/bin
if [ ! -x "$bin/cuobjdump" ] || [ ! -x "$bin/nvdisasm" ]; then
  echo "kernel-loops: installing ${pins[*]} into $tools" >&2
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$tools" \
    "${pins[@]}" >&2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$root/kernels" && "${NVCC:-nvcc}" -std=c++17 -O3 --expt-relaxed-constexpr \
  -gencode "arch=compute_$arch,code=sm_$arch" -c paged_attention.cu -o "$tmp/k.o")
NVDISASM_PATH=$bin "$bin/cuobjdump" -sass "$tmp/k.o" > "$tmp/k.sass"
python3 "$root/scripts/sass_loops.py" "$tmp/k.sass" "$filter"
