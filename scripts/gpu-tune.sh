#!/usr/bin/env bash
# The library's choices measured in one device call (~2-3 min): the `bench gpu` grid beside
# torch SDPA with the prefill tiling Auto picks (each row says which it ran), the decode split
# counts around Auto's at the batch-1 and large-batch points (`--mode splits:N`, every N on the
# same points, so Auto's row can be read against its neighbours), and ncu's stall and source
# sections on the weakest points (batch-1 decode, a 512-token prefill with no cache, the wgmma
# kernel at a 2048-token chunk) for the next kernel change. Logs in $OUT/logs.tar.gz.
#
# Here:    BUNDLE='^bin-pagedkv$|^test-cuda_kernels$' scripts/gpu-bundle.sh
# Device:  run with carry [".gpu"]:  bash scripts/gpu-tune.sh   (DEADLINE_S, default 240)
set -u
final=${OUT:-$PWD/.gpu/out}; mkdir -p "$final"
export PACK_TO=$final/logs.tar.gz
OUT=/tmp/pagedkv-tune; rm -rf "$OUT"
DEADLINE_S=${DEADLINE_S:-240}
source "$(dirname "${BASH_SOURCE[0]}")/gpu-stage.sh"
device_setup
note_machine

only='--no-cache-ops --peer none --no-check'
stage bench-auto 150 "$bin/bin-pagedkv" bench gpu --no-cache-ops --prefill-tiling auto
pts=32:8/1x512,32:8/1x4096,32:32/1x512,32:32/1x4096,32:32/8x4096,32:8/64x4096,32:8/64x32768
stage sweep-auto 30 "$bin/bin-pagedkv" bench gpu --prefill none --decode $pts $only
for n in 1 2 3 4 6 8 12 16 24 33 49 66; do
  stage "sweep-splits-$n" 40 "$bin/bin-pagedkv" bench gpu --mode "splits:$n" --prefill none \
    --decode $pts $only
done
ncu_args=(--clock-control none --section SpeedOfLight --section WarpStateStats
  --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis
  --section Occupancy)
stage ncu-decode-1x4096 60 ncu "${ncu_args[@]}" -k regex:decode -s 1 -c 1 \
  "$bin/bin-pagedkv" bench gpu --prefill none --decode 32:8/1x4096 $only \
  --launches 1 --reps 1 --iters 1 --warmup 1
stage ncu-prefill16-512 60 ncu "${ncu_args[@]}" -k regex:prefill -s 1 -c 1 \
  "$bin/bin-pagedkv" bench gpu --decode none --prefill 32:8/512+0 $only \
  --prefill-tiling 16 --launches 1 --reps 1 --iters 1 --warmup 1
stage ncu-prefill-wgmma128-ovl 60 ncu "${ncu_args[@]}" -k regex:prefill -s 1 -c 1 \
  "$bin/bin-pagedkv" bench gpu --decode none --prefill 32:8/2048+4096 $only \
  --prefill-tiling wgmma128-ovl --launches 1 --reps 1 --iters 1 --warmup 1
note done
pack "$PACK_TO"
