#!/usr/bin/env python3
"""The dense peer of `pagedkv bench gpu`: torch.nn.functional.scaled_dot_product_attention on
contiguous bf16 K/V, on the same decode and prefill grids, timed by the same rules, so that one
GPU run prints both side by side (`pagedkv bench gpu` runs this script with --jsonl and joins the
records; run alone, it prints a table).

The rules, identical to pagedkv_sim::gpu_bench (crates/pagedkv-sim/src/gpu_bench.rs; the test
crates/pagedkv-sim/tests/bench_plan.rs compares this script's --plan output with it):
- Points: decode `Q:KV/BATCHxCTX` (one query token per sequence, attending its whole context)
  and prefill `Q:KV/CHUNK+CACHED` (one sequence, CHUNK new query tokens after CACHED tokens,
  causal: query i at position CACHED + i sees keys 0..=CACHED + i).
- Bytes of a point: K and V of every token once per KV head, plus the query read and the
  output written. FLOPs of prefill: 4 * head_dim * query_heads * the causal pairs
  CHUNK * CACHED + CHUNK * (CHUNK + 1) / 2 (masked pairs are not counted).
- Timing: N launches captured once in a CUDA graph, replayed between one event pair, divided by
  N ("graph", the figure compared); N launches back to back between one event pair ("b2b"); one
  launch per event pair ("one", median). Medians over --reps.
- L2 rotation: when a point's bytes are under 3x the L2 cache, the launches cycle over
  ceil(3 * L2 / bytes) distinct copies of the inputs (at most 256, and at most what 80% of
  device memory holds), N a whole number of rotations of at least --launches.
- Data: uniform random in [-1, 1), seeded; scale 1/sqrt(head_dim).

Prefill with cached tokens needs a causal mask aligned to the bottom right (the chunk's last
query sees every key); torch's is_causal=True aligns it to the top left. Those points time
every way torch offers and report the fastest: torch.nn.attention.bias.causal_lower_right
(which torch runs on its flash kernel whatever the backend order), and a materialized mask on
the cuDNN backend and on torch's default choice. Should a way refuse grouped K/V, it runs with
K/V expanded to the query heads instead. Each way's output is first checked against an explicit
f32 softmax of a few query rows (the first, middle and last), and a way that differs is left out
(logged): on the GPU the ways run other kernels than scripts/check-sdpa-ways.py checks on CPU.
The record's note names the way that won, the others' times, and the CUDA kernels of one call of
the winner (torch.profiler), so a table says which SDPA it beat.

    python3 benches/gpu_sdpa_baseline.py                 # table, default grids
    python3 benches/gpu_sdpa_baseline.py --jsonl ...     # one JSON record per line
    python3 benches/gpu_sdpa_baseline.py --plan          # the accounting only, no GPU, no torch
"""
import argparse
import json
import math
import sys

L2_MULTIPLE = 3
MAX_COPIES = 256
GRID_HEADS = ["32:8", "32:32"]
DECODE_SHAPES = [(1, 512), (1, 4096), (1, 32768), (8, 4096), (64, 4096), (64, 32768)]
PREFILL_CHUNKS = [512, 2048]
PREFILL_CACHED = [0, 4096, 32768]
ELEM_BYTES = 2  # bf16


def default_decode():
    return [f"{h}/{b}x{c}" for h in GRID_HEADS for (b, c) in DECODE_SHAPES]


def default_prefill():
    return [f"{h}/{c}+{k}" for h in GRID_HEADS for c in PREFILL_CHUNKS for k in PREFILL_CACHED]


def parse_heads(s):
    q, kv = (int(x) for x in s.split(":"))
    if q <= 0 or kv <= 0 or q % kv:
        raise ValueError(f"bad heads {s}")
    return q, kv


def parse_decode(s):
    h, rest = s.split("/")
    b, c = rest.split("x")
    return parse_heads(h) + (int(b), int(c))


def parse_prefill(s):
    h, rest = s.split("/")
    c, k = rest.split("+")
    return parse_heads(h) + (int(c), int(k))


def decode_bytes(nh, hkv, batch, ctx, d):
    return batch * ctx * 2 * hkv * d * ELEM_BYTES + 2 * batch * nh * d * ELEM_BYTES


def causal_pairs(chunk, cached):
    return chunk * cached + chunk * (chunk + 1) // 2


def prefill_bytes(nh, hkv, chunk, cached, d):
    return (cached + chunk) * 2 * hkv * d * ELEM_BYTES + 2 * chunk * nh * d * ELEM_BYTES


def prefill_flops(nh, chunk, cached, d):
    return 4 * causal_pairs(chunk, cached) * nh * d


def rotation_copies(nbytes, l2, budget):
    nbytes = max(nbytes, 1)
    want = -(-(L2_MULTIPLE * l2) // nbytes)
    return max(1, min(want, budget // nbytes, MAX_COPIES))


def launches(min_launches, copies):
    copies = max(copies, 1)
    return copies * -(-max(min_launches, 1) // copies)


def points(arg, default):
    if arg == "default":
        return default()
    return [p.strip() for p in arg.split(",") if p.strip()] if arg != "none" else []


def plan(a):
    """The accounting of every point, as JSON records (no torch, no GPU)."""
    for p in points(a.decode, default_decode):
        nh, hkv, b, c = parse_decode(p)
        nbytes = decode_bytes(nh, hkv, b, c, a.head_dim)
        yield {"kind": "plan", "point": p, "bytes": nbytes, "flops": 4 * b * nh * c * a.head_dim,
               "copies": rotation_copies(nbytes, a.l2_bytes, a.budget_bytes)}
    for p in points(a.prefill, default_prefill):
        nh, hkv, c, k = parse_prefill(p)
        nbytes = prefill_bytes(nh, hkv, c, k, a.head_dim)
        yield {"kind": "plan", "point": p, "bytes": nbytes, "flops": prefill_flops(nh, c, k, a.head_dim),
               "copies": rotation_copies(nbytes, a.l2_bytes, a.budget_bytes)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", default="default", help="points Q:KV/BATCHxCTX,..., default or none")
    p.add_argument("--prefill", default="default", help="points Q:KV/CHUNK+CACHED,..., default or none")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (pagedkv's --device)")
    p.add_argument("--l2-bytes", type=int, default=None, help="default: the device's (50 MiB with --plan)")
    p.add_argument("--budget-bytes", type=int, default=None, help="default: 80%% of device memory (64 GiB with --plan)")
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--jsonl", action="store_true", help="one JSON record per line on stdout")
    p.add_argument("--plan", action="store_true", help="print the accounting only (no torch, no GPU)")
    a = p.parse_args()
    if a.plan:
        a.l2_bytes = a.l2_bytes if a.l2_bytes is not None else 50 << 20
        a.budget_bytes = a.budget_bytes if a.budget_bytes is not None else 64 << 30
        for rec in plan(a):
            print(json.dumps(rec))
        return 0
    return run(a)


def reference_rows(torch, q, k, v, cached, scale, rows):
    """An explicit f32 softmax with the bottom-right causal mask for the query rows `rows` of
    q [1, nh, chunk, d] over k, v [1, hkv, cached + chunk, d]: [nh, len(rows), d]."""
    nh, hkv, d = q.shape[1], k.shape[1], q.shape[3]
    r = nh // hkv
    qr = q[0][:, rows].float().reshape(hkv, r, len(rows), d)
    kf, vf = k[0].float(), v[0].float()
    s = torch.einsum("hrqd,hkd->hrqk", qr, kf) * scale
    seen = torch.tensor(rows, device=q.device)[:, None] + cached  # query i sees keys 0..=cached + i
    keys = torch.arange(k.shape[2], device=q.device)[None, :]
    s = s.masked_fill(keys > seen, float("-inf"))
    return torch.einsum("hrqk,hkd->hrqd", torch.softmax(s, dim=-1), vf).reshape(nh, len(rows), d)


# A way's output over the checked rows may differ from the f32 reference by bf16 rounding
# (~1e-3 here); a mask aligned wrong moves the first row's output by ~1.
WAY_TOLERANCE = 2e-2


def prefill_ways(torch, F, sets, nh, hkv, chunk, cached, scale, log=lambda m: None):
    """The ways to run a prefill point on SDPA, as [(way, calls, note)]: calls[i] runs on
    sets[i] = (q [1, nh, chunk, d], k, v [1, hkv, cached + chunk, d]). Over no cached tokens the
    plain is_causal=True (top-left aligned, which is bottom-right on a square); over cached
    tokens every way torch offers a bottom-right causal mask. A way that refuses grouped K/V
    runs with K/V expanded to the query heads (said in its note); a way that refuses the point,
    or whose output differs from reference_rows' on sets[0], is left out (logged)."""
    gqa = nh != hkv
    if cached == 0:
        return [("is_causal", [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=gqa) for (q, k, v) in sets], None)]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    ctx = cached + chunk
    dev = sets[0][0].device
    # Query i (at position cached + i) sees keys 0..=cached + i.
    dense = torch.ones(chunk, ctx, dtype=torch.bool, device=dev).tril(diagonal=cached)
    lower_right = causal_lower_right(chunk, ctx)

    def via(mask, backend):
        def attend(q, k, v, gqa):
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return attend

    expanded = None
    ways = []
    rows = sorted({0, chunk // 2, chunk - 1})
    ref = reference_rows(torch, *sets[0], cached, scale, rows)

    def differs(out):
        err = (out[0][:, rows].float() - ref).abs().max().item()
        return None if err <= WAY_TOLERANCE else err  # NaN differs too
    candidates = [("lower-right bias", via(lower_right, None)),
                  ("dense mask, cuDNN", via(dense, getattr(SDPBackend, "CUDNN_ATTENTION", None)))
                  if hasattr(SDPBackend, "CUDNN_ATTENTION") else None,
                  ("dense mask, default", via(dense, None))]
    for cand in candidates:
        if cand is None:
            continue
        way, attend = cand
        q, k, v = sets[0]
        use, g, note = sets, gqa, None
        try:
            out = attend(q, k, v, g)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except (RuntimeError, ValueError, NotImplementedError) as e:
            if not gqa:
                log(f"sdpa prefill {way}: refused ({str(e).splitlines()[0][:80]})")
                continue
            # Grouped K/V refused: expand to the query heads (once, shared by the ways).
            if expanded is None:
                r = nh // hkv
                expanded = [(q, k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1))
                            for (q, k, v) in sets]
            use, g = expanded, False
            note = f"{way}: K/V expanded to {nh} heads ({str(e).splitlines()[0][:60]})"
            try:
                out = attend(*use[0], g)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            except (RuntimeError, ValueError, NotImplementedError) as e2:
                log(f"sdpa prefill {way}: refused ({str(e2).splitlines()[0][:80]})")
                continue
        err = differs(out)
        if err is not None:
            log(f"sdpa prefill {way}: left out, its output differs from an explicit softmax by {err:.3g}")
            continue
        del out
        ways.append((way, [lambda q=q, k=k, v=v, attend=attend, g=g: attend(q, k, v, g) for (q, k, v) in use],
                     note))
    return ways


def run(a):
    import torch
    import torch.nn.functional as F

    # The device pagedkv's side runs on (`bench gpu --device N`), also for the streams, events
    # and graphs below, which take the current device.
    torch.cuda.set_device(a.device)
    dev = torch.device("cuda", a.device)
    props = torch.cuda.get_device_properties(dev)
    l2 = a.l2_bytes if a.l2_bytes is not None else getattr(props, "L2_cache_size", 50 << 20)
    budget = a.budget_bytes if a.budget_bytes is not None else int(0.8 * props.total_memory)
    torch.manual_seed(1)
    d = a.head_dim
    scale = 1.0 / math.sqrt(d)
    emit_json = a.jsonl

    def emit(rec, line):
        if emit_json:
            print(json.dumps(rec), flush=True)
        else:
            print(line, flush=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def span_ms(fn):
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    # Device-to-device copy (read + write bytes), as pagedkv measures it.
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    dst.copy_(src)
    d2d = 2 * n / (median([span_ms(lambda: dst.copy_(src)) for _ in range(max(a.iters, 1))]) * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    emit({"kind": "device", "name": props.name, "torch": torch.__version__, "d2d_gbps": d2d},
         f"device: {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
         f"L2 {l2 / 2**20:.0f} MiB; d2d copy {d2d:.1f} GB/s (read + write)")

    def uniform(*shape):
        # Drawn in bf16 directly: an f32 temporary of the largest K (8.6 G elements) would not fit.
        return torch.empty(*shape, dtype=torch.bfloat16, device=dev).uniform_(-1.0, 1.0)

    def time_point(calls):
        """calls[i] queues launch i's work; returns (graph, b2b, one) in microseconds."""
        copies = len(calls)
        nl = launches(a.launches, copies)
        # Warm-up on a side stream, as torch's graph capture asks, every copy at least once.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(max(copies, a.warmup)):
                calls[i % copies]()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        one = median([1e3 * span_ms(calls[i % copies]) for i in range(max(a.iters, 1))])

        def back_to_back():
            for i in range(nl):
                calls[i % copies]()

        b2b = median([1e3 * span_ms(back_to_back) / nl for _ in range(max(a.reps, 1))])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            back_to_back()
        g.replay()
        torch.cuda.synchronize()
        graph = median([1e3 * span_ms(g.replay) / nl for _ in range(max(a.reps, 1))])
        del g
        return graph, b2b, one, copies

    def kernels_of(call):
        """The CUDA kernels one call launches (names shortened), or None if profiling fails."""
        try:
            from torch.profiler import ProfilerActivity, profile
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            names = []
            for e in prof.events():
                if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
                    n = e.name.split("(")[0].split("<")[0].strip()
                    if n and n not in names:
                        names.append(n[:60])
            return ", ".join(names) or None
        except Exception as e:  # profiling is a note only: never lose the point to it
            log(f"kernel names unavailable: {str(e).splitlines()[0][:80] if str(e) else type(e).__name__}")
            return None

    def run_point(kind, point, nbytes, make_ways, rate):
        """make_ways(copies) -> [(way, calls, note)]: each way is timed, the fastest reported."""
        if nbytes > budget:
            why = f"needs {nbytes / 2**30:.1f} GiB"
            emit({"kind": "skip", "point": point, "why": why}, f"{kind:>7} {point:>18}   skipped: {why}")
            return
        copies = rotation_copies(nbytes, l2, budget)
        log(f"sdpa {kind} {point}: {copies} copies")
        timed = []
        oom = None
        try:
            ways = make_ways(copies)
        except torch.cuda.OutOfMemoryError as e:
            ways, oom = [], e
        for way, calls, note in ways:
            try:
                graph, b2b, one, n = time_point(calls)
                timed.append((graph, b2b, one, n, way, note, calls[0]))
            except torch.cuda.OutOfMemoryError as e:
                oom = e
                torch.cuda.empty_cache()
            except (RuntimeError, ValueError, NotImplementedError) as e:
                if len(ways) == 1:
                    raise
                log(f"sdpa {kind} {point}: way '{way}' failed: {str(e).splitlines()[0][:80]}")
        if not timed:
            why = f"out of memory ({str(oom).splitlines()[0][:80]})" if oom else "no way ran"
            emit({"kind": "skip", "point": point, "why": why}, f"{kind:>7} {point:>18}   skipped: {why}")
            torch.cuda.empty_cache()
            return
        timed.sort(key=lambda t: t[0])
        graph, b2b, one, copies, way, note, call = timed[0]
        parts = []
        if len(ways) > 1:
            others = ", ".join(f"{t[4]} {t[0]:.1f} us" for t in timed[1:])
            parts.append(f"fastest of {len(ways)}: {way}" + (f" (others: {others})" if others else ""))
        if note:
            parts.append(note)
        kernels = kernels_of(call)
        if kernels:
            parts.append(f"kernels: {kernels}")
        note = "; ".join(parts)
        rec = {"kind": kind, "point": point, "graph_us": graph, "b2b_us": b2b, "one_us": one, "copies": copies}
        if note:
            rec["note"] = note
        emit(rec, f"{kind:>7} {point:>18} {copies:>4} | graph {graph:>9.1f} us  b2b {b2b:>9.1f} us  "
                  f"one {one:>9.1f} us | {rate(graph)}" + (f"  ({note})" if note else ""))
        del ways, timed, call
        torch.cuda.empty_cache()

    for point in points(a.decode, default_decode):
        nh, hkv, batch, ctx = parse_decode(point)
        nbytes = decode_bytes(nh, hkv, batch, ctx, d)

        def make_decode(copies, nh=nh, hkv=hkv, batch=batch, ctx=ctx):
            sets = [(uniform(batch, nh, 1, d), uniform(batch, hkv, ctx, d), uniform(batch, hkv, ctx, d))
                    for _ in range(copies)]
            gqa = nh != hkv
            return [("sdpa", [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                                   enable_gqa=gqa)
                              for (q, k, v) in sets], None)]

        run_point("decode", point, nbytes, make_decode,
                  lambda us, nbytes=nbytes: f"{nbytes / us / 1e3:.1f} GB/s")

    for point in points(a.prefill, default_prefill):
        nh, hkv, chunk, cached = parse_prefill(point)
        nbytes = prefill_bytes(nh, hkv, chunk, cached, d)
        flops = prefill_flops(nh, chunk, cached, d)

        def make_prefill(copies, nh=nh, hkv=hkv, chunk=chunk, cached=cached):
            ctx = cached + chunk
            sets = [(uniform(1, nh, chunk, d), uniform(1, hkv, ctx, d), uniform(1, hkv, ctx, d))
                    for _ in range(copies)]
            return prefill_ways(torch, F, sets, nh, hkv, chunk, cached, scale, log)

        run_point("prefill", point, nbytes, make_prefill,
                  lambda us, flops=flops: f"{flops / us / 1e6:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
