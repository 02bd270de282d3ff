//! Fuzz the KV cache layer and the CPU kernels on arbitrary geometry and arguments:
//! `KvCacheConfig::new` / `with_page_stride` / `with_num_blocks`, `HostKvCache`, `SwapSpace`
//! (swap out and in, between caches of any stride), `HostKvCache::copy_blocks`,
//! `attn::cpu::{reshape_and_cache, paged_attention_decode, paged_attention_prefill,
//! copy_blocks}` (block tables, context lengths, slot mappings, query starts, ALiBi, window,
//! soft-cap, scale all arbitrary), in f32, f16 and bf16.
//!
//! Checks: no panic; a refused call writes nothing (cache, swap space and output compared
//! before and after); an accepted copy moves exactly the blocks it names (compared with a
//! snapshot); an accepted cache write puts each key and value in its slot; an accepted
//! attention output is finite and within the range of the values (softmax weights are a convex
//! combination), decode agrees with prefill of one token per sequence (and prefill, row by
//! row, with decode), and decode agrees with a dense float64 reference written from the
//! `AttnParams` contract (the other checks share the kernels' inner loop).
#![no_main]

use arbitrary::Arbitrary;
use half::{bf16, f16};
use libfuzzer_sys::fuzz_target;
use pagedkv::attn::{cpu, AttnWorkspace};
use pagedkv::kv::{AttnParams, HostKvCache, KvCacheConfig, KvElem, KvPart, PagedSeqs, SwapSpace};

#[derive(Debug, Arbitrary)]
struct Input {
    dtype: u8,
    layers: u8,
    kv_heads: u8,
    head_dim: u8,
    block_size: u8,
    num_blocks: u8,
    stride_pad: Option<u8>,
    swap_blocks: u8,
    swap_pad: Option<u8>,
    query_heads: u8,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Write {
        layer: u8,
        slots: Vec<i16>,
        len_delta: i8,
        seed: u8,
    },
    Decode {
        layer: u8,
        seqs: Seqs,
        params: Params,
        len_delta: i8,
    },
    Prefill {
        layer: u8,
        seqs: Seqs,
        q_lens: Vec<u8>,
        params: Params,
        len_delta: i8,
    },
    Copy {
        pairs: Vec<(u8, u8)>,
        typed: bool,
    },
    SwapOut {
        pairs: Vec<(u8, u8)>,
    },
    SwapIn {
        pairs: Vec<(u8, u8)>,
    },
}

#[derive(Debug, Arbitrary)]
struct Seqs {
    ctx: Vec<i16>,
    mbps: u8,
    table: Vec<i8>,
    table_delta: i8,
}

#[derive(Debug, Arbitrary)]
struct Params {
    heads_delta: i8,
    scale: u8,
    alibi: Option<Vec<i8>>,
    window: u8,
    softcap: u8,
    weird: u8,
}

fn params<'a>(
    p: &Params,
    heads: usize,
    head_dim: usize,
    slopes: &'a mut Vec<f32>,
) -> AttnParams<'a> {
    let mut a = AttnParams::new(
        (heads as isize + p.heads_delta as isize % 3).max(0) as usize,
        head_dim,
    );
    if p.scale != 0 {
        a.scale = f32::from(p.scale) / 64.0;
    }
    a.sliding_window = usize::from(p.window % 8);
    a.softcap = f32::from(p.softcap % 4) * 2.5;
    match p.weird % 16 {
        1 => a.scale = f32::NAN,
        2 => a.softcap = -1.0,
        3 => a.softcap = f32::INFINITY,
        4 => a.sliding_window = usize::MAX,
        5 => a.num_heads = usize::MAX,
        _ => {}
    }
    if let Some(s) = &p.alibi {
        *slopes = s.iter().map(|&x| f32::from(x) / 64.0).collect();
        // Mostly one slope per head (cycled), so that ALiBi reaches the kernels; otherwise the
        // length as given (mostly refused).
        if s.first().is_some_and(|&x| x % 4 != 0) && a.num_heads <= 64 {
            *slopes = (0..a.num_heads).map(|h| slopes[h % slopes.len()]).collect();
        }
        if p.weird % 16 == 6 && !slopes.is_empty() {
            slopes[0] = f32::INFINITY;
        }
        a.alibi_slopes = Some(slopes);
    }
    a
}

fn table(s: &Seqs, cfg: &KvCacheConfig) -> (Vec<i32>, Vec<i32>, usize) {
    let ctx: Vec<i32> = s
        .ctx
        .iter()
        .take(6)
        .map(|&c| {
            if c < 0 {
                i32::from(c)
            } else {
                i32::from(c % 64)
            }
        })
        .collect();
    let mbps = usize::from(s.mbps % 10);
    let n = (ctx.len() * mbps) as isize + (s.table_delta % 2) as isize;
    let nb = cfg.num_blocks() as i32;
    let t = (0..n.max(0) as usize)
        .map(|i| match s.table.get(i) {
            Some(&b) if b < -100 => i32::from(b),
            Some(&b) => i32::from(b).rem_euclid(nb + 1),
            None => (i as i32) % nb.max(1),
        })
        .collect();
    (t, ctx, mbps)
}

fn val<T: KvElem>(i: usize, seed: u8) -> T {
    T::from_f32(((i as f32) * 0.37 + f32::from(seed)).sin())
}

/// Absolute tolerance of an attention output (values within [-1, 1]) against the float64
/// reference: the element type's rounding of the output, plus f32 accumulation.
fn tol<T: KvElem>() -> f64 {
    match T::DTYPE {
        pagedkv::kv::KvDtype::F32 => 1e-4,
        pagedkv::kv::KvDtype::F16 => 4e-3,
        pagedkv::kv::KvDtype::Bf16 => 2e-2,
    }
}

/// Dense float64 decode of one sequence of context `c` (query at position `c - 1`), written
/// from `AttnParams`' contract: kv head `h / group`; key `k` visible iff `q_pos - k_pos <
/// window` (0: all); logit `softcap(scale * q.k) + slope[h] * (k_pos - q_pos)`; softmax; sum of
/// the values. The keys and values are read through `row` (the sequence's block table).
fn naive_decode<T: KvElem>(
    data: &[T],
    cfg: &KvCacheConfig,
    layer: usize,
    row: &[i32],
    c: usize,
    q: &[T],
    a: &AttnParams,
) -> Vec<f64> {
    let (d, bs) = (cfg.head_dim(), cfg.block_size());
    let nh = a.num_heads;
    let g = nh / cfg.num_kv_heads();
    let qpos = c - 1;
    let mut out = vec![0f64; nh * d];
    for h in 0..nh {
        let kvh = h / g;
        let qh = &q[h * d..(h + 1) * d];
        let mut logits = Vec::new();
        for kpos in 0..c {
            if a.sliding_window != 0 && qpos - kpos >= a.sliding_window {
                continue;
            }
            let b = row[kpos / bs] as usize;
            let ko = cfg.offset(b, layer, KvPart::Key, kpos % bs, kvh);
            let dot: f64 = (0..d)
                .map(|e| f64::from(qh[e].to_f32()) * f64::from(data[ko + e].to_f32()))
                .sum();
            let mut x = f64::from(a.scale) * dot;
            if a.softcap > 0.0 {
                let s = f64::from(a.softcap);
                x = s * (x / s).tanh();
            }
            if let Some(sl) = a.alibi_slopes {
                x += f64::from(sl[h]) * (kpos as f64 - qpos as f64);
            }
            logits.push((cfg.offset(b, layer, KvPart::Value, kpos % bs, kvh), x));
        }
        let mx = logits.iter().map(|l| l.1).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|l| (l.1 - mx).exp()).sum();
        for &(vo, x) in &logits {
            let w = (x - mx).exp() / z;
            for e in 0..d {
                out[h * d + e] += w * f64::from(data[vo + e].to_f32());
            }
        }
    }
    out
}

fn snapshot(c: &HostKvCache) -> Vec<u8> {
    c.as_bytes().to_vec()
}

/// Bytes of block `b` (its `bytes_per_block`, without page padding).
fn block(bytes: &[u8], cfg: &KvCacheConfig, b: usize) -> Vec<u8> {
    let (p, n) = (cfg.page_bytes(), cfg.bytes_per_block());
    bytes[b * p..b * p + n].to_vec()
}

fn pairs(p: &[(u8, u8)]) -> Vec<(u32, u32)> {
    p.iter()
        .take(40)
        .map(|&(s, d)| (u32::from(s % 12), u32::from(d % 12)))
        .collect()
}

/// The value range of `layer` in the cache (and 0), widened for the element type's rounding.
fn v_range<T: KvElem>(cache: &HostKvCache, layer: usize) -> (f32, f32) {
    let cfg = *cache.config();
    let view = cache.view::<T>().unwrap();
    let data = view.data();
    let (mut lo, mut hi) = (0f32, 0f32);
    for b in 0..cfg.num_blocks() {
        for t in 0..cfg.block_size() {
            let o = cfg.offset(b, layer, KvPart::Value, t, 0);
            for x in &data[o..o + cfg.token_stride()] {
                lo = lo.min(x.to_f32());
                hi = hi.max(x.to_f32());
            }
        }
    }
    (lo - 0.02, hi + 0.02)
}

fn run<T: KvElem>(input: &Input) {
    let dtype = T::DTYPE;
    let head_dim = match input.head_dim % 8 {
        7 => usize::from(input.head_dim), // usually misaligned: refused
        d => 8 * (usize::from(d % 3) + 1),
    };
    let cfg = KvCacheConfig::new(
        usize::from(input.layers % 3),
        usize::from(input.kv_heads % 4),
        head_dim,
        usize::from(input.block_size % 17),
        usize::from(input.num_blocks % 10),
        dtype,
    );
    let Ok(dense) = cfg else { return };
    let cfg = match input.stride_pad {
        Some(p) => {
            let pb = dense.bytes_per_block() + usize::from(p % 4) * 8;
            match dense.with_page_stride(pb) {
                Ok(c) => c,
                Err(_) => {
                    assert!(pb % 16 != 0);
                    return;
                }
            }
        }
        None => dense,
    };
    let mut cache = HostKvCache::new(cfg).expect("small cache");
    assert_eq!(cache.as_bytes().len(), cfg.total_bytes());
    // Fill with something recognisable.
    {
        let mut v = cache.view_mut::<T>().unwrap();
        for (i, x) in v.data_mut().iter_mut().enumerate() {
            *x = val(i, 1);
        }
    }
    let swap_cfg = match cfg.with_num_blocks(usize::from(input.swap_blocks % 8)) {
        Ok(c) => c,
        Err(_) => {
            assert_eq!(input.swap_blocks % 8, 0);
            assert!(SwapSpace::new(&cfg, 0).is_err());
            return;
        }
    };
    let mut swap = SwapSpace::new(&cfg, swap_cfg.num_blocks()).expect("swap space");
    assert!(swap.config().same_block_shape(&cfg) && swap.config().is_dense());
    // A second cache with another stride, to swap into.
    let other_cfg = match input.swap_pad {
        Some(p) => dense
            .with_page_stride(dense.bytes_per_block() + usize::from(p % 3) * 16)
            .unwrap(),
        None => dense,
    };
    let mut other = HostKvCache::new(other_cfg).unwrap();
    let heads = cfg.num_kv_heads() * (usize::from(input.query_heads % 3) + 1);
    let hd = heads * cfg.head_dim();
    let mut ws = AttnWorkspace::new();

    for op in input.ops.iter().take(24) {
        match op {
            Op::Write {
                layer,
                slots,
                len_delta,
                seed,
            } => {
                let layer = usize::from(*layer % 4);
                let nslots = cfg.num_blocks() * cfg.block_size();
                let slot_mapping: Vec<i64> = slots
                    .iter()
                    .take(32)
                    .map(|&s| {
                        if s < -2 {
                            i64::from(s)
                        } else if s < 0 {
                            -1
                        } else {
                            i64::from(s) % (nslots as i64 + 2)
                        }
                    })
                    .collect();
                let row = cfg.token_stride();
                let n = (slot_mapping.len() * row) as isize + (*len_delta % 2) as isize;
                let key: Vec<T> = (0..n.max(0) as usize).map(|i| val(i, *seed)).collect();
                let value: Vec<T> = (0..n.max(0) as usize)
                    .map(|i| val(i, seed.wrapping_add(1)))
                    .collect();
                let before = snapshot(&cache);
                let mut view = cache.view_mut::<T>().unwrap();
                let Ok(kv) = view.layer_mut(layer) else {
                    assert!(layer >= cfg.num_layers());
                    continue;
                };
                let ok = n.max(0) as usize == slot_mapping.len() * row
                    && slot_mapping
                        .iter()
                        .all(|&s| s == -1 || (0..nslots as i64).contains(&s));
                let r = cpu::reshape_and_cache(kv, &key, &value, &slot_mapping);
                assert_eq!(r.is_ok(), ok, "{r:?}");
                if !ok {
                    assert!(
                        snapshot(&cache) == before,
                        "a refused write changed the cache"
                    );
                    continue;
                }
                let view = cache.view::<T>().unwrap();
                let data = view.data();
                for (i, &s) in slot_mapping.iter().enumerate() {
                    // The last token with this slot wins.
                    if s < 0 || slot_mapping[i + 1..].contains(&s) {
                        continue;
                    }
                    let (b, t) = (s as usize / cfg.block_size(), s as usize % cfg.block_size());
                    let k = cfg.offset(b, layer, KvPart::Key, t, 0);
                    let v = cfg.offset(b, layer, KvPart::Value, t, 0);
                    assert!(data[k..k + row] == key[i * row..(i + 1) * row]);
                    assert!(data[v..v + row] == value[i * row..(i + 1) * row]);
                }
            }
            Op::Decode {
                layer,
                seqs,
                params: p,
                len_delta,
            } => {
                let layer = usize::from(*layer) % cfg.num_layers();
                let (t, ctx, mbps) = table(seqs, &cfg);
                let mut slopes = Vec::new();
                let a = params(p, heads, cfg.head_dim(), &mut slopes);
                let n = (ctx.len() * hd) as isize + (*len_delta % 2) as isize;
                let n = n.max(0) as usize;
                let query: Vec<T> = (0..n).map(|i| val(i, 3)).collect();
                let sentinel = T::from_f32(1234.0);
                let mut out = vec![sentinel; n];
                let range = v_range::<T>(&cache, layer);
                let view = cache.view::<T>().unwrap();
                let kv = view.layer(layer).unwrap();
                let s = PagedSeqs {
                    block_tables: &t,
                    max_blocks_per_seq: mbps,
                    context_lens: &ctx,
                };
                match cpu::paged_attention_decode(&mut ws, kv, &query, &s, &a, &mut out) {
                    Err(_) => assert!(out.iter().all(|x| *x == sentinel), "a refused decode wrote"),
                    Ok(()) => {
                        assert_eq!(n, ctx.len() * hd);
                        for x in &out {
                            let x = x.to_f32();
                            assert!(
                                x.is_finite() && x >= range.0 && x <= range.1,
                                "decode output {x} outside {range:?}"
                            );
                        }
                        // Against a dense reference from the contract alone: the checks here
                        // (range, decode vs prefill, prefill vs decode) all run the kernels'
                        // shared inner loop, so a wrong logit, mask or softmax there passed them.
                        for (i, &c) in ctx.iter().enumerate().filter(|&(_, &c)| c > 0) {
                            let row = &t[i * mbps..(i + 1) * mbps];
                            let want = naive_decode(
                                view.data(),
                                &cfg,
                                layer,
                                row,
                                c as usize,
                                &query[i * hd..(i + 1) * hd],
                                &a,
                            );
                            for (e, w) in want.iter().enumerate() {
                                let x = f64::from(out[i * hd + e].to_f32());
                                assert!(
                                    (x - w).abs() <= tol::<T>(),
                                    "seq {i} element {e}: decode {x} vs reference {w}"
                                );
                            }
                        }
                        // Prefill of one token per live sequence attends the same keys.
                        let mut qsl = vec![0i32];
                        for &c in &ctx {
                            qsl.push(qsl.last().unwrap() + i32::from(c > 0));
                        }
                        let rows: Vec<usize> = (0..ctx.len()).filter(|&i| ctx[i] > 0).collect();
                        let q2: Vec<T> = rows
                            .iter()
                            .flat_map(|&r| query[r * hd..(r + 1) * hd].iter().copied())
                            .collect();
                        let mut out2 = vec![sentinel; q2.len()];
                        cpu::paged_attention_prefill(&mut ws, kv, &q2, &qsl, &s, &a, &mut out2)
                            .expect("prefill of the decode batch");
                        for (j, &r) in rows.iter().enumerate() {
                            for e in 0..hd {
                                let (x, y) = (out[r * hd + e].to_f32(), out2[j * hd + e].to_f32());
                                assert!(
                                    (x - y).abs() <= 1e-3 + 1e-2 * x.abs(),
                                    "decode {x} vs prefill {y}"
                                );
                            }
                        }
                        for &r in (0..ctx.len())
                            .filter(|&i| ctx[i] == 0)
                            .collect::<Vec<_>>()
                            .iter()
                        {
                            assert!(out[r * hd..(r + 1) * hd].iter().all(|x| x.to_f32() == 0.0));
                        }
                    }
                }
            }
            Op::Prefill {
                layer,
                seqs,
                q_lens,
                params: p,
                len_delta,
            } => {
                let layer = usize::from(*layer) % cfg.num_layers();
                let (t, ctx, mbps) = table(seqs, &cfg);
                let mut slopes = Vec::new();
                let a = params(p, heads, cfg.head_dim(), &mut slopes);
                let mut qsl = vec![0i32];
                for i in 0..ctx.len() {
                    let q = q_lens.get(i).copied().unwrap_or(1);
                    let q = if q == 255 { -1 } else { i32::from(q % 8) };
                    qsl.push(qsl.last().unwrap() + q);
                }
                if q_lens.len() > ctx.len() && q_lens[ctx.len()] == 254 {
                    qsl[0] = 1;
                }
                let tokens = (*qsl.last().unwrap()).max(0) as usize;
                let n = ((tokens * hd) as isize + (*len_delta % 2) as isize).max(0) as usize;
                let query: Vec<T> = (0..n).map(|i| val(i, 4)).collect();
                let sentinel = T::from_f32(1234.0);
                let mut out = vec![sentinel; n];
                let range = v_range::<T>(&cache, layer);
                let view = cache.view::<T>().unwrap();
                let kv = view.layer(layer).unwrap();
                let s = PagedSeqs {
                    block_tables: &t,
                    max_blocks_per_seq: mbps,
                    context_lens: &ctx,
                };
                match cpu::paged_attention_prefill(&mut ws, kv, &query, &qsl, &s, &a, &mut out) {
                    Err(_) => assert!(
                        out.iter().all(|x| *x == sentinel),
                        "a refused prefill wrote"
                    ),
                    Ok(()) => {
                        for x in &out {
                            let x = x.to_f32();
                            assert!(
                                x.is_finite() && x >= range.0 && x <= range.1,
                                "prefill output {x} outside {range:?}"
                            );
                        }
                        // Causality, row by row: new token `j` of a sequence sits at position
                        // `ctx - q_len + j` and must see exactly what a one-sequence decode
                        // whose context ends there sees (same table row, same parameters).
                        // The range check above passes a mask that lets a row see the keys
                        // after it (still a convex combination of values); this does not.
                        assert_eq!(n, tokens * hd);
                        for (i, &c) in ctx.iter().enumerate() {
                            let (q0, q1) = (qsl[i] as usize, qsl[i + 1] as usize);
                            let row = &t[i * mbps..(i + 1) * mbps];
                            for tok in q0..q1 {
                                let pos = c as usize - (q1 - q0) + (tok - q0);
                                let one = [pos as i32 + 1];
                                let s1 = PagedSeqs {
                                    block_tables: row,
                                    max_blocks_per_seq: mbps,
                                    context_lens: &one,
                                };
                                let q = &query[tok * hd..(tok + 1) * hd];
                                let mut o = vec![sentinel; hd];
                                cpu::paged_attention_decode(&mut ws, kv, q, &s1, &a, &mut o)
                                    .expect("decode of one prefill row");
                                for e in 0..hd {
                                    let (x, y) = (out[tok * hd + e].to_f32(), o[e].to_f32());
                                    assert!(
                                        (x - y).abs() <= 1e-3 + 1e-2 * y.abs(),
                                        "seq {i} token at {pos}: prefill {x} vs decode {y}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
            Op::Copy { pairs: p, typed } => {
                let p = pairs(p);
                let before = snapshot(&cache);
                let r = if *typed {
                    let mut v = cache.view_mut::<T>().unwrap();
                    cpu::copy_blocks(&mut v, &p).is_ok()
                } else {
                    cache.copy_blocks(&p).is_ok()
                };
                let after = snapshot(&cache);
                if !r {
                    assert!(after == before, "a refused copy changed the cache");
                } else {
                    for &(s, d) in &p {
                        assert!(
                            block(&after, &cfg, d as usize) == block(&before, &cfg, s as usize),
                            "copy {s}->{d}"
                        );
                    }
                    for b in 0..cfg.num_blocks() {
                        if !p.iter().any(|&(_, d)| d as usize == b) {
                            assert!(
                                block(&after, &cfg, b) == block(&before, &cfg, b),
                                "block {b} not a destination changed"
                            );
                        }
                    }
                }
            }
            Op::SwapOut { pairs: p } => {
                let p = pairs(p);
                let before = snapshot(swap.storage());
                let r = swap.swap_out(&cache, &p);
                let after = snapshot(swap.storage());
                let sc = *swap.config();
                if r.is_err() {
                    assert!(after == before, "a refused swap-out changed the swap space");
                } else {
                    for &(s, d) in &p {
                        assert!(
                            block(&after, &sc, d as usize)
                                == block(cache.as_bytes(), &cfg, s as usize)
                        );
                    }
                }
            }
            Op::SwapIn { pairs: p } => {
                let p = pairs(p);
                let before = snapshot(&other);
                let r = swap.swap_in(&mut other, &p);
                let after = snapshot(&other);
                let sc = *swap.config();
                if r.is_err() {
                    assert!(after == before, "a refused swap-in changed the cache");
                } else {
                    for &(s, d) in &p {
                        assert!(
                            block(&after, &other_cfg, d as usize)
                                == block(swap.storage().as_bytes(), &sc, s as usize)
                        );
                    }
                    // Blocks not named keep their bytes (padding inside a run may be copied).
                    for b in 0..other_cfg.num_blocks() {
                        if !p.iter().any(|&(_, d)| d as usize == b) {
                            assert!(block(&after, &other_cfg, b) == block(&before, &other_cfg, b));
                        }
                    }
                }
            }
        }
    }
}

fuzz_target!(|input: Input| {
    match input.dtype % 3 {
        0 => run::<f32>(&input),
        1 => run::<f16>(&input),
        _ => run::<bf16>(&input),
    }
});
