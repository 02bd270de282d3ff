#!/usr/bin/env bash
# A prefill kernel change measured in one device call (~2 min): the wgmma layout probe, the
# kernel tests, every prefill tiling on the grid beside torch SDPA (one process: the tilings'
# rows share the peer's), memcheck of the kernel tests, racecheck of the bf16 prefill grid and
# of the persistent grid's many-item test, and ncu on chosen tilings and points (below). Logs
# in $OUT/logs.tar.gz.
#
# Here:    BUNDLE='^bin-pagedkv$|^test-cuda_kernels$' scripts/gpu-bundle.sh
# Device:  run with carry [".gpu"]:  bash scripts/gpu-prefill.sh   (DEADLINE_S, default 240: the
#          last stage ends by DEADLINE_S + 5 s and the logs are packed after every stage, so give
#          run a timeout_s of DEADLINE_S + 30 or more;
#          DIMS="64 128" (none: no grid), TILINGS=auto,32,..., SANITIZE=0 or memcheck, NCU=0,
#          TESTS=0 (no kernel tests: a call of profiles alone) narrow it;
#          NCU_TILINGS="wgmma128 wgmma128-persist" and NCU_POINTS="32:8/2048+0 32:8/512+0"
#          choose the profiles (default: 32, wgmma-ovl, wgmma128-ovl at 32:8/2048+4096);
#          NCU_SOURCE=1 adds, per profile, the per-instruction stall samples of the SASS as CSV;
#          NCU_DECODE_POINTS="32:8/1x4096" profiles decode points too;
#          DECODE=1 times the decode grid beside SDPA first; CACHE_OPS=1 the cache ops (swaps
#          beside pinned and pageable copies);
#          SWEEP_SPLITS="8 16 33" times Auto's plan and each fixed split count on SWEEP_POINTS
#          (default: the batch-1 points), to read Auto's choice against its neighbours)
# Then:    python3 scripts/gpu-tables.py <the call's files_at>/logs.tar.gz  (the BENCHMARKS tables)
#          python3 scripts/ncu-sass-top.py <an unpacked *-sass.log>  (the stalls per instruction)
set -u
final=${OUT:-$PWD/.gpu/out}; mkdir -p "$final"
export PACK_TO=$final/logs.tar.gz
OUT=/tmp/pagedkv-prefill; rm -rf "$OUT"
DEADLINE_S=${DEADLINE_S:-240}
source "$(dirname "${BASH_SOURCE[0]}")/gpu-stage.sh"
device_setup
note_machine

[ "${TESTS:-1}" = 1 ] && kernel_tests  # TESTS=0: a call of profiles alone
# The decode grid beside SDPA first when asked (DECODE=1: a decode change measured in the same
# call, ~20 s).
if [ "${DECODE:-0}" = 1 ]; then
  stage bench-decode 120 "$bin/bin-pagedkv" bench gpu --no-cache-ops --prefill none
fi
# The cache ops alone (CACHE_OPS=1, ~10 s): reshape_and_cache, copy_blocks, and the swaps
# beside pinned and pageable host copies.
if [ "${CACHE_OPS:-0}" = 1 ]; then
  stage bench-cache-ops 60 "$bin/bin-pagedkv" bench gpu --decode none --prefill none --peer none
fi
# Decode split counts around Auto's (SWEEP_SPLITS): each process times the same points, without
# the peer (its rows are in bench-decode).
if [ -n "${SWEEP_SPLITS:-}" ]; then
  sweep=(--prefill none --no-cache-ops --peer none --no-check
    --decode "${SWEEP_POINTS:-32:8/1x512,32:8/1x4096,32:8/1x32768,32:32/1x512,32:32/1x4096}")
  stage sweep-auto 40 "$bin/bin-pagedkv" bench gpu "${sweep[@]}"
  for n in $SWEEP_SPLITS; do
    stage "sweep-splits-$n" 40 "$bin/bin-pagedkv" bench gpu --mode "splits:$n" "${sweep[@]}"
  done
fi
# Head dims (DIMS, default 128; none: no grid) and tilings (TILINGS) of the grid; SANITIZE=0
# skips the sanitizers (memcheck: only memcheck), NCU=0 the profiles.
for d in ${DIMS:-128}; do
  [ "$d" = none ] && continue
  stage "bench-prefill-d$d" 150 "$bin/bin-pagedkv" bench gpu --no-cache-ops --decode none \
    --head-dim "$d" \
    --prefill-tiling "${TILINGS:-auto,16,32,wgmma,wgmma128,wgmma-ovl,wgmma128-ovl,wgmma128-persist}"
done
# The persistent grid's stream protocol first (its copies landing early are what the
# emulation cannot see), then memcheck of every kernel test, then the grid under racecheck.
if [ "${SANITIZE:-1}" = 1 ]; then
  stage racecheck-persistent 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$bin/test-cuda_kernels" persistent_prefill_streams_many_items
fi
if [ "${SANITIZE:-1}" != 0 ]; then
  stage memcheck-kernels 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$bin/test-cuda_kernels"
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  stage racecheck-prefill 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$bin/test-cuda_kernels" prefill_grid_bf16
fi
# The end of every call: the tests', sanitizers' and probe's verdicts (also into the call's
# output), the logs packed.
finish() {
  note done
  grep -h -E "^test result|FAILED|panicked|ERROR SUMMARY|RACECHECK SUMMARY|wgmma layout|wgmma swizzled" \
    "$OUT"/test-*.log "$OUT"/memcheck-*.log "$OUT"/racecheck-*.log 2>/dev/null | tail -20
  pack "$PACK_TO"
}
[ "${NCU:-1}" = 1 ] || { finish; exit 0; }
ncu_args=(--clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters)
# One profile: stage NAME, kernels matching REGEX, of the command after them (its second
# launch of them: the first is the bench's warm-up); with NCU_SOURCE=1 also the sampled stall
# reasons per SASS instruction, as CSV (where the cycles go).
profile() {
  local name=$1 regex=$2
  shift 2
  stage "$name" 60 ncu "${ncu_args[@]}" -k "regex:$regex" -s 1 -c 1 "$@"
  [ "${NCU_SOURCE:-0}" = 1 ] || return 0
  stage "$name-rep" 90 ncu --clock-control none --section WarpStateStats \
    --section SourceCounters -k "regex:$regex" -s 1 -c 1 -f -o "$OUT/$name" "$@"
  stage "$name-sass" 60 ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass
  rm -f "$OUT/$name.ncu-rep"
}
once=(--no-cache-ops --peer none --no-check --launches 1 --reps 1 --iters 1 --warmup 1)
# Decode points first when asked (NCU_DECODE_POINTS="32:8/1x4096 ...").
for point in ${NCU_DECODE_POINTS:-}; do
  profile "ncu-decode-${point//[:\/x]/_}" decode \
    "$bin/bin-pagedkv" bench gpu --prefill none --decode "$point" "${once[@]}"
done
for point in ${NCU_POINTS:-32:8/2048+4096}; do
  for tiling in ${NCU_TILINGS:-32 wgmma-ovl wgmma128-ovl}; do
    profile "ncu-prefill-$tiling-${point//[:\/+]/_}" prefill \
      "$bin/bin-pagedkv" bench gpu --decode none --prefill "$point" "${once[@]}" \
      --prefill-tiling "$tiling"
  done
done
finish
