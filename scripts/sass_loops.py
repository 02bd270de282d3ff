#!/usr/bin/env python3
"""Static instruction counts of the attention kernels' main loops, from `cuobjdump -sass`.

Usage: sass_loops.py SASS [REGEX]   (REGEX filters the mangled kernel names, default: decode;
                                    `prefill_mma` for the tensor-core prefill)

For each kernel: its instruction count, and the size of its main loop: the smallest loop
(a backward branch's span) that holds the tile's loads (>= 8 LDG, or LDGSTS: prefill's
cp.async copies) and its arithmetic (an HMMA or HGMMA, or >= 40 FFMA). Static counts: every instruction of the loop body once, including paths a given
launch skips (the soft-cap's tanh, say); what one iteration executes is at most that.
"""
import collections
import re
import subprocess
import sys

INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def parse(path):
    fn, funcs = None, {}
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            fn = m.group(1)
            funcs[fn] = []
        elif fn is not None and (m := INS.search(line)):
            funcs[fn].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return funcs


def main_loop(ins):
    best = None
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if not target or int(target.group(1), 16) >= addr:
            continue
        start = int(target.group(1), 16)
        body = [o for a, o, _ in ins if start <= a <= addr]
        kinds = collections.Counter(o.split(".")[0] for o in body)
        mma = kinds["HMMA"] + kinds["HGMMA"]
        if kinds["LDG"] + kinds["LDGSTS"] >= 8 and (mma > 0 or kinds["FFMA"] >= 40):
            if best is None or len(body) < len(best[0]):
                best = (body, kinds)
    return best


def demangle(name):
    try:
        out = subprocess.run(["c++filt"], input=name, capture_output=True, text=True).stdout
    except OSError:
        return name
    return re.sub(r"\(.*\)$", "", out.strip().removeprefix("void ")) or name


def main():
    pattern = re.compile(sys.argv[2] if len(sys.argv) > 2 else "decode")
    print(f"{'kernel':44s} {'instr':>6s} {'loop':>5s}  loop mix")
    for fn, ins in sorted(parse(sys.argv[1]).items(), key=lambda kv: demangle(kv[0])):
        if not pattern.search(fn):
            continue
        loop = main_loop(ins)
        size = len(loop[0]) if loop else 0
        kinds = ("LDG", "LDGSTS", "LDSM", "HMMA", "HGMMA", "FFMA", "IMAD", "MUFU", "SHFL")
        mix = " ".join(f"{k}:{loop[1][k]}" for k in kinds if loop[1][k]) if loop else ""
        print(f"{demangle(fn):44s} {len(ins):6d} {size:5d}  {mix}")


if __name__ == "__main__":
    main()
