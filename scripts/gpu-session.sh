#!/usr/bin/env bash
# Everything a GPU session measures, in one device call under one deadline, most important
# first, every stage's log packed into $OUT/logs.tar.gz as soon as it ends (a call cut short
# still returns what finished). Device time is scarce (15 minutes a session, machine start included), so each stage
# runs under the smaller of its own cap and the time left; stages past the deadline are skipped
# and say so in $OUT/timeline.log.
#
# Here:    scripts/gpu-bundle.sh
# Device:  run with carry [".gpu"]:  bash scripts/gpu-session.sh        (DEADLINE_S, default 500)
#          then $OUT/logs.tar.gz holds every stage's log and timeline.log.
#
# Stages: the CUDA tests (every .gpu/bin/test-*, PAGEDKV_REQUIRE_GPU=1), `pagedkv bench gpu`
# (issue 15's grid beside torch SDPA), ncu on three attention points, the GGUF upload bench on a
# synthetic 2.45 GB llama, the candle client's tokens/s (tiny model, then the synthetic one),
# the decode modes at batch 1, compute-sanitizer on the decode tests.
set -u
final=${OUT:-$PWD/.gpu/out}; mkdir -p "$final"
# The device call returns only a few files: logs are written outside $OUT and packed.
export PACK_TO=$final/logs.tar.gz
OUT=/tmp/pagedkv-gpu-session; rm -rf "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu-stage.sh"
device_setup
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  nvcc --version | tail -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())'
  ncu --version | tail -1; nproc; } >"$OUT/machine.txt" 2>&1
note "machine: $(head -2 "$OUT/machine.txt" | tail -1)"

for t in "$bin"/test-*; do stage "$(basename "$t")" 120 "$t"; done
stage bench-gpu 240 "$bin/bin-pagedkv" bench gpu
small='--prefill none --no-cache-ops --peer none --no-check'
ncu_args=(--clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats)
stage ncu-decode 90 ncu "${ncu_args[@]}" -k regex:decode -c 12 \
  "$bin/bin-pagedkv" bench gpu --decode 32:8/64x4096,32:8/1x4096,32:32/64x4096 $small \
  --launches 1 --reps 1 --iters 1 --warmup 1
stage ncu-prefill 60 ncu "${ncu_args[@]}" -k regex:prefill -c 8 \
  "$bin/bin-pagedkv" bench gpu --decode none --prefill 32:8/2048+4096,32:32/2048+4096 \
  --no-cache-ops --peer none --no-check --launches 1 --reps 1 --iters 1 --warmup 1
synth=/tmp/pagedkv-synth.gguf
stage gguf-synth 60 "$bin/bin-pagedkv" gguf synth "$synth" --layers 8 --kv-heads 8
stage gguf-upload 90 "$bin/bin-pagedkv" gguf upload-bench "$synth" --iters 3
if [ -x "$bin/example-generate" ]; then
  tiny=/tmp/pagedkv-tiny.gguf
  "$bin/example-generate" --write-tiny "$tiny" >"$OUT/generate-write.log" 2>&1
  for s in 1 32; do
    stage "generate-tiny-s$s" 40 "$bin/example-generate" "$tiny" --cuda --kv bf16 --seqs "$s" --max-new 128
    stage "generate-synth-s$s" 60 "$bin/example-generate" "$synth" --cuda --kv bf16 --seqs "$s" --max-new 64
    # Each layer's attention launch over its cache write's tail (programmatic launches).
    stage "generate-synth-s$s-programmatic" 60 "$bin/example-generate" "$synth" --cuda --kv bf16 \
      --seqs "$s" --max-new 64 --programmatic
  done
fi
for mode in single split; do
  stage "bench-decode-$mode" 45 "$bin/bin-pagedkv" bench gpu --mode "$mode" \
    --decode 32:8/1x512,32:8/1x4096,32:8/1x32768,32:8/8x4096,32:32/1x4096 $small
done
stage memcheck-decode 90 compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$bin/test-cuda_kernels" decode
stage racecheck-decode 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
  "$bin/test-cuda_kernels" decode_grid_bf16
note done
grep -h -E "^test result|FAILED|panicked" "$OUT"/test-*.log | tail -40
pack "$PACK_TO"
