#!/usr/bin/env python3
"""PyTorch baseline for `pagedkv bench gpu`: decode attention the way an engine without paged
kernels does it -- gather each sequence's K/V blocks from the paged cache into contiguous
tensors, then torch.nn.functional.scaled_dot_product_attention -- timed end to end (gather
included) and, separately, SDPA alone on pre-gathered K/V.

Same grid and cache shape as `pagedkv bench gpu` (bf16, head dim 128, block 16, batch
{1,8,64,256} x context {512,4096,32768}, 32 query / 8 KV heads and 32/32), same layout
([num_blocks][layers=1][2][block_size][kv_heads][head_dim]) with shuffled block tables, CUDA
events, warm-up, median. Run on the GPU machine:

    python3 benches/gpu_sdpa_baseline.py [--iters 20] [--batches 1,8,64,256] ...
"""
import argparse
import torch
import torch.nn.functional as F


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="512,4096,32768")
    p.add_argument("--heads", default="32:8,32:32")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    ms = median_ms(lambda: dst.copy_(src), a.warmup, a.iters)
    d2d = 2 * n / (ms * 1e-3) / 1e9
    print(f"d2d copy: {d2d:.1f} GB/s (read + write)")
    del src, dst

    d, bs = a.head_dim, a.block_size
    print(f"{'heads':>7} {'batch':>6} {'ctx':>7} {'gather+sdpa ms':>15} {'sdpa ms':>9} {'GB/s e2e':>9} {'% d2d':>6}")
    g = torch.Generator(device="cpu").manual_seed(1)
    for h in a.heads.split(","):
        nh, hkv = (int(x) for x in h.split(":"))
        for batch in (int(x) for x in a.batches.split(",")):
            for ctx in (int(x) for x in a.contexts.split(",")):
                bps = -(-ctx // bs)
                nblocks = batch * bps
                cache_bytes = nblocks * 2 * bs * hkv * d * 2
                # cache + gathered copy must fit
                if 2.2 * cache_bytes > 0.8 * props.total_memory:
                    print(f"{h:>7} {batch:>6} {ctx:>7}   skipped: needs {2.2 * cache_bytes / 2**30:.1f} GiB")
                    continue
                cache = torch.randn(nblocks, 1, 2, bs, hkv, d, dtype=torch.bfloat16, device=dev)
                tables = torch.randperm(nblocks, generator=g).view(batch, bps).to(dev)
                q = torch.randn(batch, nh, 1, d, dtype=torch.bfloat16, device=dev)

                def gather():
                    blocks = cache[tables.flatten(), 0]                      # [B*bps, 2, bs, hkv, d]
                    kv = blocks.view(batch, bps, 2, bs, hkv, d)
                    kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, hkv, bps * bs, d)
                    return kv[0, :, :, :ctx], kv[1, :, :, :ctx]

                def attend(k, v):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=(nh != hkv))

                def e2e():
                    k, v = gather()
                    return attend(k, v)

                ms_e2e = median_ms(e2e, a.warmup, a.iters)
                k, v = gather()
                k, v = k.contiguous(), v.contiguous()
                ms_sdpa = median_ms(lambda: attend(k, v), a.warmup, a.iters)
                kv_bytes = batch * ctx * hkv * d * 2 * 2
                bw = kv_bytes / (ms_e2e * 1e-3) / 1e9
                print(f"{h:>7} {batch:>6} {ctx:>7} {ms_e2e:>15.4f} {ms_sdpa:>9.4f} {bw:>9.1f} {100 * bw / d2d:>5.1f}%")
                del cache, k, v
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
