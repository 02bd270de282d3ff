#!/usr/bin/env python3
"""Where a profiled kernel's warps stall, from ncu's per-instruction source page as CSV (the
`*-sass.log` stages of scripts/gpu-prefill.sh with NCU_SOURCE=1: `ncu -i R --page source --csv
--print-source sass`).

    python3 scripts/ncu-sass-top.py FILE.log [N]

Prints the N (default 25) instructions with the most warp-stall samples (the first column
whose name holds "Samples"), each with its share of all samples, and the sampled totals of
every other numeric column whose name holds "Samples" or "stall" (ncu's per-reason columns, where
this version prints them), largest first. The column names are read from the CSV's header,
not assumed: an ncu whose page differs prints what it finds.
"""
import csv
import sys


def number(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    top = int(argv[2]) if len(argv) > 2 else 25
    with open(argv[1], encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    # The CSV starts at the header row that names the source column (ncu prints notes first).
    start = next((i for i, l in enumerate(lines) if '"Source"' in l or l.startswith("Source,")),
                 None)
    if start is None:
        print("no source-page CSV header found", file=sys.stderr)
        return 1
    rows = list(csv.reader(lines[start:]))
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    src = head.index("Source")
    addr = next((i for i, h in enumerate(head) if h.lower() == "address"), None)
    sampled = [i for i, h in enumerate(head) if "Samples" in h or "stall" in h.lower()]
    if not sampled:
        print(f"no sample columns among {head}", file=sys.stderr)
        return 1
    key = sampled[0]
    total = sum(number(r[key]) or 0 for r in body)
    print(f"{len(body)} instructions, {total:.0f} samples in `{head[key]}`\n")
    print("| address | instruction | samples | share |")
    print("|---|---|---|---|")
    for r in sorted(body, key=lambda r: number(r[key]) or 0, reverse=True)[:top]:
        n = number(r[key]) or 0
        at = r[addr] if addr is not None else "-"
        print(f"| {at} | `{r[src].strip()}` | {n:.0f} | {100 * n / max(total, 1):.1f}% |")
    sums = sorted(((sum(number(r[i]) or 0 for r in body), head[i]) for i in sampled[1:]),
                  reverse=True)
    if sums:
        print("\n| column | total |\n|---|---|")
        for s, h in sums:
            if s > 0:
                print(f"| {h} | {s:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
