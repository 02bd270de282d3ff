#!/usr/bin/env bash
# Installs a pinned CUDA 13.0 compiler toolchain from PyPI (no GPU, no root, no system CUDA
# needed) and prints, on stdout and nothing else, the lines that put it in reach:
#
#   eval "$(scripts/install-cuda-toolchain.sh)"      # then: cargo build --features cuda
#
# Idempotent: a second run with the same pins only prints the exports. Logs go to stderr.
#
# Where: $PAGEDKV_CUDA_DIR, else .cuda-toolchain/ in the checkout (ignored by git).
# Pins: 13.0.x, to match the CUDA 13.0 driver (580) of the GPU machines we test on; a newer
# toolkit would emit PTX/cubins that driver refuses.
#
# The pip wheels all unpack into one tree, <dir>/nvidia/cu13/{bin,nvvm,include,lib}:
#   bin/nvcc (+ nvcc.profile, which finds nvvm/bin/cicc and include/cccl by itself),
#   include/ (runtime headers, crt/ headers from nvidia-cuda-crt, cccl/ from nvidia-cuda-cccl),
#   lib/libcudart_static.a (lib/, not lib64/ as a system install has; build.rs searches both).
# This script checks that layout and compiles a tiny kernel to prove nvcc works end to end.
set -euo pipefail

log() { echo "install-cuda-toolchain: $*" >&2; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${PAGEDKV_CUDA_DIR:-$root/.cuda-toolchain}
pins=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
)
stamp="$dir/.pins"
cuda="$dir/nvidia/cu13"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$cuda/bin/nvcc" ]; then
  log "already installed in $dir"
else
  py=$(command -v python3 || command -v python || true)
  [ -n "$py" ] || { log "error: python3 with pip is needed"; exit 1; }
  log "installing ${pins[*]} into $dir"
  rm -rf "$dir"
  mkdir -p "$dir"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-script-location \
    --target "$dir" "${pins[@]}" >&2
  echo "${pins[*]}" > "$stamp"
fi

# Check the pieces nvcc needs, so that a changed wheel layout fails here and not deep in cc.
for f in bin/nvcc bin/ptxas bin/fatbinary bin/nvlink bin/cudafe++ nvvm/bin/cicc \
         nvvm/libdevice/libdevice.10.bc include/cuda_runtime.h include/crt/host_config.h \
         include/cccl/cuda/std/cstdint include/cuda_bf16.h lib/libcudart_static.a; do
  [ -e "$cuda/$f" ] || { log "error: $cuda/$f missing (wheel layout changed?)"; exit 1; }
done
# A system-style lib64/ beside lib/, for tools that only look there.
[ -e "$cuda/lib64" ] || ln -s lib "$cuda/lib64"

# Smoke test once per install: compile (not run) a kernel for sm_80.
if [ ! -f "$dir/.smoke-ok" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cat > "$tmp/smoke.cu" <<'CU'
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda/std/cstdint>
__global__ void smoke(float *x) { x[threadIdx.x] = __bfloat162float(__float2bfloat16(1.0f)); }
extern "C" int smoke_launch(float *x) { smoke<<<1, 32>>>(x); return (int)cudaGetLastError(); }
CU
  "$cuda/bin/nvcc" -c "$tmp/smoke.cu" -o "$tmp/smoke.o" -gencode arch=compute_80,code=sm_80 >&2 \
    || { log "error: nvcc could not compile a test kernel"; exit 1; }
  touch "$dir/.smoke-ok"
  log "nvcc smoke test passed"
fi

echo "export NVCC=$cuda/bin/nvcc"
echo "export CUDA_PATH=$cuda"
echo "export PATH=$cuda/bin:\$PATH"
