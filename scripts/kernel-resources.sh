#!/usr/bin/env bash
# Prints each kernel instance's registers, stack and spills as ptxas reports them for one
# architecture (default sm_90; the sm_90a unit prefill_wgmma.cu at sm_90a), for every .cu in
# kernels/, and on stderr ptxas's performance notes (e.g. a wgmma pipeline it serialized).
# Needs nvcc (eval the output of scripts/install-cuda-toolchain.sh first), no GPU.
# Usage: scripts/kernel-resources.sh [ARCH [UNIT.cu ...]]   (units: default every .cu)
set -euo pipefail
arch=${1:-90}
shift $(( $# > 0 ? 1 : 0 ))
cd "$(dirname "${BASH_SOURCE[0]}")/../kernels"
units=("$@")
[ ${#units[@]} -gt 0 ] || units=(*.cu)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%-56s %5s %6s %6s %6s\n' "kernel (sm_$arch)" regs stack spill-st spill-ld
for cu in "${units[@]}"; do
  a=$arch
  # The sm_90a unit (wgmma) compiles for sm_90a only: with ARCH 90, its arch-specific twin.
  if [ "$cu" = prefill_wgmma.cu ]; then
    [ "$arch" = 90 ] || continue
    a=90a
  fi
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode "arch=compute_$a,code=sm_$a" \
    -Xptxas -v -c "$cu" -o "$tmp/k.o" 2>"$tmp/log" || { cat "$tmp/log" >&2; exit 1; }
  # ptxas's performance notes (C75xx: wgmma pipelines it serialized), on stderr.
  grep -h "Potential Performance Loss" "$tmp/log" | sed -E 's/^ptxas info *: */'"$cu"': /' >&2 || true
  # ptxas prints, per entry: the name line, then "N bytes stack frame, S bytes spill stores",
  # then "Used R registers". Stack and spills are bytes per thread.
  awk '/Compiling entry function/ { match($0, /'"'"'[^'"'"']+'"'"'/); name = substr($0, RSTART + 1, RLENGTH - 2) }
       /bytes stack frame/ { stack = $1; st = $5; ld = $9 }
       /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") regs = $(i + 1);
                                 print name, regs, stack, st, ld }' "$tmp/log" |
    while read -r name regs stack st ld; do
      printf '%-56s %5s %6s %6s %6s\n' "$(c++filt "$name" | sed -E 's/\(anonymous namespace\):://g; s/^void //; s/\([^()]*\)$//')" \
        "$regs" "$stack" "$st" "$ld"
    done
done | sort
