#!/usr/bin/env bash
# Writes link-time stand-ins for the CUDA libraries that candle's cudarc (0.19, dynamic-linking)
# links against, so that the candle CUDA client (crates/pagedkv-candle-llama, feature `cuda`)
# can be *linked* on a machine without a CUDA driver or cuBLAS, and its binaries carried to a
# GPU machine (shared/gpu/bundle.sh). Prints the `export` line that puts them in reach:
#
#   eval "$(scripts/cuda-link-stubs.sh)"     # after building once (the link then fails)
#
# Each stand-in is a shared library with the real library's SONAME (CUDA 13: libcuda.so.1,
# libcudart.so.13, libnvrtc.so.13, libcurand.so.10, libcublas.so.13, libcublasLt.so.13) that
# defines every symbol the built crates leave undefined, as an empty function. Nothing of it
# runs: at run time the dynamic loader finds the GPU machine's real libraries by SONAME (put
# their directory on LD_LIBRARY_PATH there if it is not a default one, e.g.
# /usr/local/cuda/lib64). Never install the stand-ins where a program could load them.
#
# Where: $PAGEDKV_CUDA_STUBS, else cuda-link-stubs in cargo's target directory
# ($CARGO_TARGET_DIR, else target). Reads the undefined symbols of the compiled cudarc 0.19 rlib
# and candle-kernels' static library under that directory's release/ (where the build above
# put them).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
out=${PAGEDKV_CUDA_STUBS:-$target/cuda-link-stubs}
deps=$target/release
mkdir -p "$out"
objs=$(ls "$deps"/deps/libcudarc-*.rlib "$deps"/build/candle-kernels-*/out/*.a 2>/dev/null || true)
[ -n "$objs" ] || { echo "cuda-link-stubs: build the cuda client once first (no cudarc rlib under $deps)" >&2; exit 1; }
syms=$(for f in $objs; do nm -u --format=just-symbols "$f" 2>/dev/null || true; done | sort -u)
declare -A soname=(
  [cuda]=libcuda.so.1 [cudart]=libcudart.so.13 [nvrtc]=libnvrtc.so.13
  [curand]=libcurand.so.10 [cublas]=libcublas.so.13 [cublasLt]=libcublasLt.so.13
)
for lib in "${!soname[@]}"; do : > "$out/$lib.c"; done
while read -r s; do
  case "$s" in
    cublasLt*) lib=cublasLt ;;
    cublas*) lib=cublas ;;
    curand*) lib=curand ;;
    nvrtc*) lib=nvrtc ;;
    cuda[A-Z]*|__cuda*) lib=cudart ;;
    cu[A-Z]*) lib=cuda ;;
    *) continue ;;
  esac
  echo "void $s(void) {}" >> "$out/$lib.c"
done <<< "$syms"
for lib in "${!soname[@]}"; do
  cc -shared -fPIC -o "$out/lib$lib.so" "$out/$lib.c" -Wl,-soname,"${soname[$lib]}"
  echo "cuda-link-stubs: $out/lib$lib.so ($(grep -c . "$out/$lib.c") symbols, SONAME ${soname[$lib]})" >&2
done
echo "export LIBRARY_PATH=$out\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
