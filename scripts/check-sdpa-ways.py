#!/usr/bin/env python3
"""Checks, on CPU torch (no GPU), that every way benches/gpu_sdpa_baseline.py runs a prefill
point computes the same attention as an explicit softmax with the bottom-right causal mask
(GQA and MHA, over 0, 1 and 7 cached tokens), and that a way computing something else (a mask
read top-left aligned) is left out by the peer's own check rather than timed. TORCH_PATH may name
a --target install of torch.

    TORCH_PATH=/tmp/torchcpu python3 scripts/check-sdpa-ways.py
"""
import importlib.util, math, os, sys
sys.path.insert(0, os.environ.get("TORCH_PATH", ""))
import torch, torch.nn.functional as F
spec = importlib.util.spec_from_file_location("peer", os.path.join(os.path.dirname(__file__), "..", "benches", "gpu_sdpa_baseline.py"))
peer = importlib.util.module_from_spec(spec); spec.loader.exec_module(peer)
torch.manual_seed(0)
d = 16
for nh, hkv in [(4, 2), (4, 4)]:
    for chunk, cached in [(5, 0), (5, 7), (3, 1)]:
        ctx = chunk + cached
        sets = [(torch.randn(1, nh, chunk, d), torch.randn(1, hkv, ctx, d), torch.randn(1, hkv, ctx, d)) for _ in range(2)]
        scale = 1 / math.sqrt(d)
        ways = peer.prefill_ways(torch, F, sets, nh, hkv, chunk, cached, scale, log=print)
        print(nh, hkv, chunk, cached, [(w, n) for w, _, n in ways])
        for i, (q, k, v) in enumerate(sets):
            r = nh // hkv
            kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
            s = (q @ kk.transpose(-1, -2)) * scale
            qi = torch.arange(chunk)[:, None] + cached
            kj = torch.arange(ctx)[None, :]
            s = s.masked_fill(kj > qi, float("-inf"))
            ref = torch.softmax(s, -1) @ vv
            for way, calls, _ in ways:
                out = calls[i]()
                err = (out - ref).abs().max().item()
                assert err < 1e-4, (way, err)
print("ok")

# A way whose kernel computes something else (here: a materialized mask read as top-left
# aligned, as a backend that mishandled it would) must be left out, not timed as SDPA: on the
# GPU the ways run different kernels than here, so the peer checks each against an explicit
# softmax of a few query rows before timing it.
class WrongMask:
    def __getattr__(self, k):
        return getattr(F, k)

    @staticmethod
    def scaled_dot_product_attention(q, k, v, attn_mask=None, **kw):
        if type(attn_mask) is torch.Tensor:  # not the CausalBias subclass
            attn_mask = torch.ones_like(attn_mask).tril()  # top-left
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)

logged = []
for nh, hkv in [(4, 2), (4, 4)]:
    chunk, cached, ctx = 5, 7, 12
    sets = [(torch.randn(1, nh, chunk, d), torch.randn(1, hkv, ctx, d), torch.randn(1, hkv, ctx, d))]
    ways = peer.prefill_ways(torch, WrongMask(), sets, nh, hkv, chunk, cached, 1 / math.sqrt(d), log=logged.append)
    names = [w for w, _, _ in ways]
    assert all("dense mask" not in w for w in names), (names, logged)
    assert "lower-right bias" in names, (names, logged)
assert any("differs" in m for m in logged), logged
print("wrong ways left out: ok")
