#!/usr/bin/env bash
# Checks the decode plan's resident-block tables (kernels/decode_resident.cuh) against ptxas:
# every decode kernel instance of paged_attention.cu at sm_90 must allow, by its registers
# (65536 per SM, allocated in multiples of 8 per thread, at most 16 blocks of 128 threads: 64
# warps), exactly the blocks per SM its body's entry says, and none may spill. A table the
# registers have drifted from makes the Auto plan count resident slots the device lacks (or
# leave some idle). Needs nvcc (eval the output of scripts/install-cuda-toolchain.sh) and a
# C++ compiler, no GPU; CI runs it. Exit 1 on a mismatch or a spill. ptxas's figures come from
# scripts/kernel-resources.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../kernels"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The tables as the plan reads them: "dtype-class body-heads head-dim blocks".
cat > "$tmp/table.cpp" <<'CPP'
#include <cstdio>
#include <initializer_list>
#define __host__
#define __device__
#include "decode_resident.cuh"
int main() {
  for (int d : {64, 80, 96, 112, 128, 256}) {
    for (int gt : {1, 8, 16})
      if (gt != 16 || d <= 128) std::printf("16bit %d %d %d\n", gt, d, pkv::decode_resident(gt, d));
    for (int gt : {1, 4, 8}) std::printf("f32 %d %d %d\n", gt, d, pkv::decode_resident_f32(gt, d));
  }
}
CPP
c++ -std=c++17 -I. "$tmp/table.cpp" -o "$tmp/table"
"$tmp/table" | sort > "$tmp/want"

# What ptxas gives each instance (f16 and bf16 both listed), from kernel-resources.sh's table
# (name, then registers, stack, spill stores, spill loads): the same line format.
../scripts/kernel-resources.sh 90 paged_attention.cu |
  while read -r line; do
    [[ $line =~ decode_(mma|simt)_kernel\<([^,]+),\ ([0-9]+),\ ([0-9]+)\>\ +([0-9]+)\ +[0-9]+\ +([0-9]+)\ +([0-9]+)$ ]] ||
      continue
    t=${BASH_REMATCH[2]} d=${BASH_REMATCH[3]} gt=${BASH_REMATCH[4]} regs=${BASH_REMATCH[5]}
    spill=$((BASH_REMATCH[6] + BASH_REMATCH[7]))
    class=$([ "$t" = float ] && echo f32 || echo 16bit)
    alloc=$(( (regs + 7) / 8 * 8 ))
    blocks=$(( 65536 / (128 * alloc) ))
    [ "$blocks" -gt 16 ] && blocks=16
    echo "$class $gt $d $blocks $regs $spill $t"
  done | sort > "$tmp/got"

[ -s "$tmp/got" ] || { echo "check-decode-resident: no decode instance in ptxas's output" >&2; exit 1; }
status=0
while read -r class gt d blocks regs spill t; do
  want=$(awk -v c="$class" -v g="$gt" -v d="$d" '$1 == c && $2 == g && $3 == d { print $4 }' "$tmp/want")
  if [ -z "$want" ]; then
    echo "MISSING  $t d$d $gt heads: no table entry (registers $regs)"; status=1
  elif [ "$want" != "$blocks" ]; then
    echo "MISMATCH $t d$d $gt heads: $regs registers allow $blocks blocks per SM, the table says $want"; status=1
  fi
  if [ "$spill" != 0 ]; then
    echo "SPILL    $t d$d $gt heads: $spill bytes of spill stores and loads"; status=1
  fi
done < "$tmp/got"
n=$(wc -l < "$tmp/got")
[ "$status" = 0 ] && echo "check-decode-resident: $n decode instances match kernels/decode_resident.cuh, no spills"
exit "$status"
