# Sourced by the scripts/gpu-*.sh device scripts: a deadline, a logged and capped stage runner,
# log packing, the device setup the bundle needs (device_setup), the machine note (note_machine)
# and the kernel tests every kernel call starts with (kernel_tests).
# Expects OUT (a folder) and DEADLINE_S (seconds from sourcing, default 500); with PACK_TO (a
# path under the call's own $OUT) every stage re-packs the logs there, so a call cut short by
# its time limit still returns what finished.
t0=$(date +%s)
deadline=$((t0 + ${DEADLINE_S:-500}))
mkdir -p "$OUT"
note() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/timeline.log"; }
# stage NAME CAP_S CMD...: runs CMD under min(CAP_S, time left), output to $OUT/NAME.log; a
# stage with under 15 s left is skipped (and says so).
stage() {
  local name=$1 cap=$2; shift 2
  local left=$((deadline - $(date +%s)))
  if [ "$left" -lt 15 ]; then note "skip $name (deadline)"; return 0; fi
  [ "$cap" -lt "$left" ] || cap=$left
  note "start $name (cap ${cap}s)"
  timeout -k 5 "$cap" "$@" >"$OUT/$name.log" 2>&1
  note "end $name rc=$?"
  if [ -n "${PACK_TO:-}" ]; then pack "$PACK_TO" >/dev/null; fi
}
# The device call returns at most a few files: everything under $OUT in one archive, written
# beside it and renamed over it, so a call cut short while packing still returns the last one.
pack() { tar czf "$1.part" -C "$OUT" . && mv -f "$1.part" "$1" && note "packed $(du -h "$1" | cut -f1)"; }
# Unpacks scripts/gpu-bundle.sh's compressed binaries, puts the CUDA libraries in reach, makes
# GPU tests fail instead of skipping, and shows the checkout at the path the tests were built
# at (they find files through CARGO_MANIFEST_DIR).
device_setup() {
  bin=.gpu/bin
  [ -f .gpu/unpack.sh ] && bash .gpu/unpack.sh
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  export PAGEDKV_REQUIRE_GPU=1 RUST_BACKTRACE=1
  local m; m=$(cat .gpu/manifest_dir)
  [ -e "$m" ] || { mkdir -p "$(dirname "$m")"; ln -sfn "$PWD" "$m"; }
}
# The GPU's name, driver and memory into $OUT/machine.txt and the timeline.
note_machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/machine.txt" 2>&1
  note "machine: $(tail -1 "$OUT/machine.txt")"
}
# The wgmma descriptor probe alone first (its counts print even if a later kernel faults and
# a sticky error takes the rest of the test process with it), then every kernel test; on a
# failure once more one test at a time, so the first failing test is the one that says why.
kernel_tests() {
  stage test-wgmma-probe 30 "$bin/test-cuda_kernels" wgmma_layouts_match_the_hardware --nocapture
  stage test-cuda_kernels 90 "$bin/test-cuda_kernels"
  grep -q "^test result: ok" "$OUT/test-cuda_kernels.log" ||
    stage test-cuda_kernels-serial 120 "$bin/test-cuda_kernels" --test-threads 1
  # The engine on the GPU (its swap space pinned or not is in the log), when bundled
  # (BUNDLE='...|^test-cuda_raw_engine$').
  if [ -x "$bin/test-cuda_raw_engine" ]; then
    stage test-cuda_raw_engine 90 "$bin/test-cuda_raw_engine" --nocapture
  fi
  # The device upload (a refused upload's stats among them), when bundled
  # (BUNDLE='...|^test-gguf_upload$').
  if [ -x "$bin/test-gguf_upload" ]; then
    stage test-gguf_upload 90 "$bin/test-gguf_upload"
  fi
}
