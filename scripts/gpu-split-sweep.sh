#!/usr/bin/env bash
# The decode split policy on the GPU, in one device call: the CUDA tests, the decode grid in
# Auto mode beside torch SDPA, then each point at fixed split counts (`--mode splits:N`), ncu on
# the batch-1 split launch, and compute-sanitizer on the decode tests (the split merge). Logs
# packed into $OUT/logs.tar.gz after every stage.
#
# Here:    scripts/gpu-bundle.sh
# Device:  run with carry [".gpu"]:  bash scripts/gpu-split-sweep.sh    (DEADLINE_S, default 420)
set -u
final=${OUT:-$PWD/.gpu/out}; mkdir -p "$final"
export PACK_TO=$final/logs.tar.gz
OUT=/tmp/pagedkv-split-sweep; rm -rf "$OUT"
DEADLINE_S=${DEADLINE_S:-420}
source "$(dirname "${BASH_SOURCE[0]}")/gpu-stage.sh"
device_setup
note_machine

if [ -z "${SKIP_TESTS:-}" ]; then  # SKIP_TESTS=1: after scripts/gpu-session.sh in one call
  for t in "$bin"/test-*; do stage "$(basename "$t")" 120 "$t"; done
fi
stage bench-decode-auto 120 "$bin/bin-pagedkv" bench gpu --prefill none --no-cache-ops
only='--prefill none --no-cache-ops --peer none'
large=32:8/64x4096,32:8/64x32768,32:32/64x4096,32:32/64x32768,32:8/8x4096,32:32/8x4096
for n in 1 2 3 4 6; do
  stage "sweep-large-$n" 40 "$bin/bin-pagedkv" bench gpu --mode "splits:$n" --decode "$large" $only
done
for n in 4 8 16 32; do
  stage "sweep-512-$n" 30 "$bin/bin-pagedkv" bench gpu --mode "splits:$n" \
    --decode 32:8/1x512,32:32/1x512 $only
done
for n in 16 33 66 132 264; do
  stage "sweep-long-$n" 30 "$bin/bin-pagedkv" bench gpu --mode "splits:$n" \
    --decode 32:8/1x4096,32:8/1x32768,32:32/1x4096,32:32/1x32768 $only
done
stage ncu-batch1 60 ncu --clock-control none --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section LaunchStats -k regex:decode -c 4 \
  "$bin/bin-pagedkv" bench gpu --decode 32:8/1x4096,32:8/1x512 $only --no-check \
  --launches 1 --reps 1 --iters 1 --warmup 1
[ -n "${SKIP_TESTS:-}" ] || stage memcheck-decode 90 compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$bin/test-cuda_kernels" decode
[ -n "${SKIP_TESTS:-}" ] || stage racecheck-decode 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$bin/test-cuda_kernels" decode_grid_bf16
note done
grep -h -E "^test result|FAILED|panicked" "$OUT"/test-*.log 2>/dev/null | tail -20
pack "$PACK_TO"
