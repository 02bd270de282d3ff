#!/usr/bin/env python3
"""Fits a per-block cost model to measured prefill times (BENCHMARKS.md, "No GPU: where the
prefill over no cached tokens loses"): the kernel's time is the makespan of its thread blocks
over the SMs (one block per SM, taken in launch order: longest first, as the grid runs them),
each block costing F + tiles * t, plus a constant C. A grid search on the relative error.

The measured figures are the H100's of BENCHMARKS.md "Fourth GPU session", call 5 (Auto =
Wgmma128, bf16 d128, 128-row blocks, 128-key tiles, graph us). No arguments; prints the fit
and the per-point table (markdown)."""
import heapq
import math

SMS = 132
# (chunk, cached, group) -> graph us; KV heads 8 at group 4 (32:8), 32 at group 1 (32:32).
MEASURED = {
    (512, 0, 4): 22.9, (512, 4096, 4): 105.7, (512, 32768, 4): 676.2,
    (2048, 0, 4): 128.7, (2048, 4096, 4): 443.4, (2048, 32768, 4): 2659.4,
    (512, 0, 1): 23.4, (512, 4096, 1): 114.2, (512, 32768, 1): 743.2,
    (2048, 0, 1): 133.4, (2048, 4096, 1): 456.8, (2048, 32768, 1): 2775.9,
}


def blocks(chunk, cached, group, rows=128, keys=128):
    """Key tiles of each block, in launch order (the last row tile first)."""
    kv_heads = 32 // group
    tokens = rows // group
    row_tiles = chunk * group // rows
    out = []
    for y in range(row_tiles):
        last_key = cached + tokens * (row_tiles - y)
        out += [math.ceil(last_key / keys)] * kv_heads
    return out


def makespan(tiles, t, f):
    sms = [0.0] * SMS
    for n in tiles:
        heapq.heappush(sms, heapq.heappop(sms) + f + n * t)
    return max(sms)


def error(t, f, c):
    return sum(((makespan(blocks(*k), t, f) + c - m) / m) ** 2 for k, m in MEASURED.items())


best = min((error(t / 100, f / 2, c), t / 100, f / 2, c)
           for t in range(230, 290, 2) for f in range(0, 40) for c in range(0, 6))
_, t, f, c = best
print(f"t = {t} us per tile, F = {f} us per block, C = {c} us")
print("| heads | chunk + cached | measured us | model us | model error | model with F = 0 |"
      " blocks | key tiles per block |")
print("|---|---|---|---|---|---|---|---|")
for (chunk, cached, group), m in MEASURED.items():
    b = blocks(chunk, cached, group)
    p, p0 = makespan(b, t, f) + c, makespan(b, t, 0.0) + c
    print(f"| {'32:8' if group == 4 else '32:32'} | {chunk} + {cached} | {m} | {p:.1f} |"
          f" {100 * (p - m) / m:+.0f}% | {p0:.1f} | {len(b)} | {min(b)}-{max(b)} |")
