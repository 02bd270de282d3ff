#!/usr/bin/env bash
# Prepares .gpu/ for a GPU session in one command: shared/gpu/bundle.sh's CUDA tests, benches
# and binaries of pagedkv, plus the candle client's CUDA test (pagedkv-candle-llama, feature
# candle-cuda), linked against stand-ins for the CUDA libraries candle links
# (scripts/cuda-link-stubs.sh), and binaries too large for the device call's 64 MiB carry
# compressed, with .gpu/unpack.sh to restore them there. Then, on the device:
#
#   bash .gpu/unpack.sh && LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} bash .gpu/run.sh
#
# Targets sm_90 (H100/H200) unless PAGEDKV_CUDA_ARCHS / CUDA_COMPUTE_CAP say otherwise.
# BUNDLE (a regex over names like test-cuda_graph, bin-pagedkv) narrows what is carried.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
log() { echo "gpu-bundle: $*" >&2; }
if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1; then
  eval "$(scripts/install-cuda-toolchain.sh)"
fi
export PAGEDKV_CUDA_ARCHS=${PAGEDKV_CUDA_ARCHS:-90}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# candle's libraries are absent here: a first build of the client's CUDA test compiles
# everything and fails to link; the stand-ins are made from what it compiled.
log "building the candle client's CUDA test once (its first link is expected to fail)"
cargo build --release -p pagedkv-candle-llama --features candle-cuda --test cuda_matches_candle \
  >/dev/null 2>&1 || true
# (Its failure stops the bundle here: `eval "$(...)"` alone would go on to a link error.)
stubs=$(scripts/cuda-link-stubs.sh)
eval "$stubs"
# The CPU candle tests and examples would carry candle's CUDA kernels too: leave them out.
# (The emulation's tests run in CI; the device runs the real thing.)
# example-generate: the candle client's tokens/s and per-step latency on the GPU
# (`generate --write-tiny F`, then `generate F --cuda --kv bf16 --seqs 1|32`).
export BUNDLE=${BUNDLE:-'^bin-|^test-cuda_(?!emu)|^test-gpu|^test-gguf_upload$|^example-generate$'}
"$root/../shared/gpu/bundle.sh" -p pagedkv -p pagedkv-sim -p pagedkv-candle-llama \
  --features pagedkv-candle-llama/candle-cuda
# Every binary holds the kernels' fatbin (about 12 MB at sm_90) and the candle test candle's
# PTX (65 MB): compress what is over 4 MiB, to be restored on the device.
: > .gpu/unpack.sh
for f in .gpu/bin/*; do
  if [ "$(stat -c %s "$f")" -gt $((4 << 20)) ]; then
    gzip -9 "$f"
    echo "gunzip -f '$f.gz'" >> .gpu/unpack.sh
    log "compressed $f"
  fi
done
# The 64 MiB a device call carries hold the working tree that travels with .gpu (tracked and
# untracked-not-ignored files).
gpu=$(du -sb .gpu | cut -f1)
tree=$({ git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true; } |
  awk '{s += $1} END {print s + 0}')
total=$((gpu + tree))
log "$(ls .gpu/bin | wc -l) executables, $((gpu >> 20)) MiB in .gpu + $((tree >> 20)) MiB of working tree (a call carries 64 MiB)"
[ "$total" -lt $((64 << 20)) ] || { log "error: .gpu and the working tree are over 64 MiB; narrow BUNDLE"; exit 1; }
