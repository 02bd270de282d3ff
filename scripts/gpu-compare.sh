#!/usr/bin/env bash
# A kernel change measured in one device call (~60 s on an H200 before the wgmma tilings; an
# estimated 3-5 min now): the wgmma layout probe, the kernel tests, the `bench gpu` grid beside torch
# SDPA (prefill at 16 and 32 query rows per warp; the four wgmma tilings in a second process),
# memcheck of the kernel tests and racecheck of the bf16 prefill grid, the grid again as
# programmatic launches, ncu on two prefill points per tiling and two batch-1 decode points,
# and the decode split counts around the Auto plan's (`--mode splits:N`) at batch 1-8, in
# that order (a stage past the deadline is skipped). Logs packed into $OUT/logs.tar.gz after
# every stage. (scripts/gpu-session.sh is the whole session: upload, client, sanitizers.)
#
# Here:    BUNDLE='^bin-pagedkv$|^test-cuda_kernels$' scripts/gpu-bundle.sh   (the two binaries
#           this script runs, ~11 MiB; the full bundle is 62 MiB of the 64 MiB carry)
# Device:  run with carry [".gpu"]:  bash scripts/gpu-compare.sh    (DEADLINE_S, default 420;
#          run's timeout_s above it)
set -u
final=${OUT:-$PWD/.gpu/out}; mkdir -p "$final"
export PACK_TO=$final/logs.tar.gz
OUT=/tmp/pagedkv-compare; rm -rf "$OUT"
DEADLINE_S=${DEADLINE_S:-420}
source "$(dirname "${BASH_SOURCE[0]}")/gpu-stage.sh"
device_setup
note_machine

kernel_tests  # the probe first, then every kernel test (gpu-stage.sh)
# The warp tilings beside SDPA and the decode grid; the wgmma tilings in their own process (a
# fault there cannot cost the others' rows; compare with the SDPA column above).
stage bench-gpu 200 "$bin/bin-pagedkv" bench gpu --no-cache-ops --prefill-tiling 16,32
only='--no-cache-ops --peer none --no-check'
stage bench-wgmma 120 "$bin/bin-pagedkv" bench gpu --no-cache-ops --peer none --decode none \
  --prefill-tiling wgmma,wgmma128,wgmma-ovl,wgmma128-ovl,wgmma128-persist
# The new kernels' memory and shared-memory hand-offs (cp.async -> ldmatrix / wgmma) under the
# sanitizers before the longer measurements.
stage memcheck-kernels 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$bin/test-cuda_kernels"
stage racecheck-prefill 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$bin/test-cuda_kernels" prefill_grid_bf16
# The same decode grid and 16-row prefill as programmatic dependent launches (back to back,
# each launch's dispatch over the previous one's tail): against bench-gpu's rows; then each
# decode point as a per-layer step (cache write + decode), plain against programmatic.
stage bench-programmatic 200 "$bin/bin-pagedkv" bench gpu --no-cache-ops --peer none \
  --programmatic --prefill-tiling 16 --step
ncu_args=(--clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats
  --section ComputeWorkloadAnalysis --section LaunchStats)
for tiling in 16 wgmma wgmma-ovl 32 wgmma128; do
  stage "ncu-prefill-$tiling" 60 ncu "${ncu_args[@]}" -k regex:prefill -c 2 \
    "$bin/bin-pagedkv" bench gpu --decode none --prefill 32:8/2048+4096,32:8/2048+0 $only \
    --prefill-tiling $tiling --launches 1 --reps 1 --iters 1 --warmup 1
done
stage ncu-decode 60 ncu "${ncu_args[@]}" -k regex:decode -c 2 \
  "$bin/bin-pagedkv" bench gpu --prefill none --decode 32:8/1x4096,32:8/1x32768 $only \
  --launches 1 --reps 1 --iters 1 --warmup 1
# Split counts around the Auto plan's (batch 1 long, batch 2-8 medium), last: the plan was
# tuned from these in the third session.
pts=32:8/1x32768,32:8/1x16384,32:8/2x16384,32:8/4x8192,32:8/8x4096
for n in 8 16 24 33 49; do
  stage "sweep-splits-$n" 30 "$bin/bin-pagedkv" bench gpu --mode "splits:$n" --prefill none \
    --decode $pts $only
done
stage sweep-auto 30 "$bin/bin-pagedkv" bench gpu --prefill none --decode $pts $only
note done
grep -h -E "^test result|FAILED|panicked|ERROR SUMMARY|wgmma layout|wgmma swizzled" "$OUT"/test-*.log \
  "$OUT"/memcheck-*.log "$OUT"/racecheck-*.log | tail -20
pack "$PACK_TO"
