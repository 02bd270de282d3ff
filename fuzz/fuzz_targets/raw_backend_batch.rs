//! Fuzz the raw-pointer engine backend (`engine::RawBackend`) on the CUDA kernels' CPU
//! emulation (guarded buffers: a read or write past any buffer aborts), against the CPU
//! kernels (`attn::cpu`, the oracle) on a host copy of the arena.
//!
//! The input is a small description of a step: the sequences (cached tokens and new tokens
//! each), a permutation of the arena's pages handed out to them, the dtype and head grouping,
//! the emulation's scheduling, the backend's starting capacities, and an optional copy or swap
//! before the step. From it the target builds a *well-formed* batch (query starts, context
//! lengths, slot mapping and block tables consistent with each other), so most inputs reach
//! the kernels: `reshape_and_cache` must write exactly what the CPU kernel writes (and no page
//! outside the batch's slots changes), and decode or prefill attention must match the CPU
//! kernel within the dtype's tolerance. Now and then the decode step that follows runs next
//! on the same backend (reading the keys and values the first step wrote; a fresh page where a
//! sequence's last one is full). Copies and swaps must be accepted or refused as the host
//! cache refuses them, and move the same bytes.
//!
//! About one input in eight (a fuzzed byte) first applies one targeted corruption to the
//! batch (a slot or block id out of range, a query start that goes down, a context shorter
//! than its new tokens or past its table, a wrong length) or to the rows handed to a launch:
//! the backend must refuse it with the expected typed error and leave the arena as it was (a
//! refused batch: its capacities too, and no step to launch on), and then run the well-formed
//! batch as above.
#![no_main]

use arbitrary::Arbitrary;
use half::{bf16, f16};
use libfuzzer_sys::fuzz_target;
use pagedkv::attn::{cpu, AttnWorkspace};
use pagedkv::cuda_emu::{self, EmuBuf, EmuDevice, EmuElem, Schedule};
use pagedkv::cuda_raw::Rows;
use pagedkv::engine::{DeviceRows, KvBackend, RawBackend, RawCaps};
use pagedkv::error::{AttnError, EngineError};
use pagedkv::kv::{
    AttnParams, HostKvCache, KvCacheConfig, KvElem, ModelKvShape, PagedSeqs, SwapSpace,
};
use pagedkv::sched::Batch;

const PAGES: usize = 10;
const LAYERS: usize = 2;
const D: usize = 64;
const SWAP_SLOTS: usize = 3;
const MAX_SEQS: usize = 4;

#[derive(Debug, Arbitrary)]
struct Input {
    /// dtype (3), head grouping (4), block size (3), layer (2).
    geometry: u8,
    /// Scheduling (2 bits), SM count (3), compute capability (3: 9.0 where all set).
    emu: u8,
    /// Starting capacities (small, so that many steps grow the buffers).
    caps: u8,
    /// `(cached, new)` tokens of each sequence (at most MAX_SEQS).
    seqs: Vec<(u8, u8)>,
    /// Fisher-Yates draws for the permutation of the pages handed out.
    pages: [u8; PAGES],
    /// Shape bits: decode (every row one token), a spare table column, padding slots, prefill
    /// of a decode-shaped batch, programmatic launch, a decode step after the first, cp.async
    /// copies landing at their issue.
    shape: u8,
    /// What unused table entries hold (the kernels must not read them).
    pad_block: i8,
    /// `fault % 8 == 7`: corrupt (kind `fault / 8`), at `fault_at`.
    fault: u8,
    fault_at: u8,
    seed: u8,
    pre: Pre,
}

#[derive(Debug, Arbitrary)]
enum Pre {
    None,
    Copy(Vec<(u8, u8)>),
    Swap {
        out: Vec<(u8, u8)>,
        back: Vec<(u8, u8)>,
    },
}

trait Elem: KvElem + EmuElem {
    const TOL: (f32, f32);
}
impl Elem for f32 {
    const TOL: (f32, f32) = (2e-5, 1e-4);
}
impl Elem for f16 {
    const TOL: (f32, f32) = (2e-3, 4e-3);
}
impl Elem for bf16 {
    const TOL: (f32, f32) = (1e-2, 2e-2);
}

fn val<T: KvElem>(i: usize, seed: u8) -> T {
    T::from_f32(((i as f32) * 0.37 + f32::from(seed) * 0.11).sin())
}

/// Compute capability 9.0 (the emulation's default and the wgmma prefill tilings, some five
/// times slower to emulate than 8.0's) for one input in eight, else 8.0.
fn sm90(input: &Input) -> bool {
    input.emu >> 5 == 7
}

/// A well-formed step: its batch and what the checks need of it.
struct Step {
    batch: Batch,
    /// Pages some token of the batch writes.
    written: Vec<bool>,
    decode: bool,
}

/// A sequence of the step: its pages, context length (new tokens included), new tokens.
type SeqRow = (Vec<usize>, usize, usize);

/// The sequences the input describes, on pages of a permutation of the arena's, and the pages
/// left free.
fn describe(input: &Input, bs: usize) -> (Vec<SeqRow>, Vec<usize>) {
    let mut perm: Vec<usize> = (0..PAGES).collect();
    for i in (1..PAGES).rev() {
        perm.swap(i, usize::from(input.pages[i]) % (i + 1));
    }
    let decode = input.shape & 1 == 1;
    let mut free = perm.into_iter();
    let mut rows = Vec::new();
    // Compute capability 9.0's wgmma prefill is the slowest to emulate (some 100 ms a thread
    // block): at most two sequences there.
    let max_seqs = if sm90(input) { 2 } else { MAX_SEQS };
    for &(cached, new) in input.seqs.iter().take(max_seqs) {
        let new = if decode { 1 } else { usize::from(new % 9) };
        let mut cached = usize::from(cached % 48);
        let have = free.len() * bs;
        if new > have {
            break;
        }
        cached = cached.min(have - new);
        let ctx = cached + new;
        let pages: Vec<usize> = free.by_ref().take(ctx.div_ceil(bs)).collect();
        rows.push((pages, ctx, new));
    }
    (rows, free.collect())
}

/// The next step after `rows`: a decode step (one new token each), a fresh page for a
/// sequence whose last page is full, a sequence left out where none is free.
fn next_decode(rows: &[SeqRow], free: &mut Vec<usize>, bs: usize) -> Vec<SeqRow> {
    let mut next = Vec::new();
    for (pages, ctx, _) in rows {
        let mut pages = pages.clone();
        if ctx % bs == 0 {
            let Some(p) = free.pop() else { continue };
            pages.push(p);
        }
        next.push((pages, ctx + 1, 1));
    }
    next
}

fn batch_of(input: &Input, rows: &[SeqRow], bs: usize) -> Step {
    let mbps =
        rows.iter().map(|r| r.0.len()).max().unwrap_or(0) + usize::from(input.shape >> 1 & 1);
    let mut batch = Batch {
        max_blocks_per_seq: mbps,
        query_start_loc: vec![0],
        ..Batch::default()
    };
    let mut written = vec![false; PAGES];
    for (s, (pages, ctx, new)) in rows.iter().enumerate() {
        batch.seq_ids.push(s as u64 + 1);
        batch.context_lens.push(*ctx as i32);
        for c in 0..mbps {
            batch.block_tables.push(match pages.get(c) {
                Some(&p) => p as i32,
                None => i32::from(input.pad_block),
            });
        }
        for pos in ctx - new..*ctx {
            let t = batch.input_tokens.len();
            batch.input_tokens.push(7);
            batch.positions.push(pos as i32);
            // A padding token (-1: no write) now and then.
            if input.shape >> 2 & 1 == 1 && t % 3 == 2 {
                batch.slot_mapping.push(-1);
            } else {
                let page = pages[pos / bs];
                written[page] = true;
                batch.slot_mapping.push((page * bs + pos % bs) as i64);
            }
        }
        let end = batch.input_tokens.len() as i32;
        batch.query_start_loc.push(end);
    }
    let one_each = rows.iter().all(|r| r.2 == 1);
    Step {
        batch,
        written,
        decode: one_each && input.shape >> 3 & 1 == 0,
    }
}

/// How a corruption must be refused.
#[derive(Debug, Clone, Copy)]
enum Want {
    Slot,
    Block,
    QueryStart,
    QueryLonger,
    Length,
    Context,
}

fn refused_as(e: &EngineError, want: Want) -> bool {
    use AttnError as A;
    match e {
        EngineError::Attn(a) => matches!(
            (want, a),
            (Want::Slot, A::SlotOutOfRange { .. })
                | (Want::Block, A::BlockOutOfRange { .. })
                | (Want::QueryStart, A::QueryStartLoc { .. })
                | (Want::QueryLonger, A::QueryLongerThanContext { .. })
                | (Want::Length, A::LengthMismatch { .. })
                | (Want::Context, A::ContextLen { .. })
        ),
        _ => false,
    }
}

/// The batch with one corruption `begin` must refuse, or None where the batch has nothing to
/// corrupt that way.
fn corrupt(b: &Batch, kind: u8, at: u8, cfg: &KvCacheConfig) -> Option<(Batch, Want)> {
    let mut b = b.clone();
    let at = usize::from(at);
    let (seqs, tokens) = (b.num_seqs(), b.num_tokens());
    let num_slots = (cfg.num_blocks() * cfg.block_size()) as i64;
    let want = match kind % 9 {
        0 => {
            if tokens == 0 {
                return None;
            }
            let bad = [num_slots, -2, i64::MAX, i64::MIN, num_slots + 1000][at / 16 % 5];
            b.slot_mapping[at % tokens] = bad;
            Want::Slot
        }
        1 => {
            let live: Vec<usize> = (0..seqs).filter(|&s| b.context_lens[s] > 0).collect();
            if live.is_empty() {
                return None;
            }
            let s = live[at % live.len()];
            let n = cfg.blocks_for_tokens(b.context_lens[s] as usize);
            let bad = [cfg.num_blocks() as i32, -1, i32::MAX, i32::MIN][at / 16 % 4];
            b.block_tables[s * b.max_blocks_per_seq + at / 4 % n] = bad;
            Want::Block
        }
        2 => {
            // A start that goes down (or a first start other than 0).
            let s = at % (seqs + 1);
            if s == 0 {
                b.query_start_loc[0] = if at & 64 == 0 { 1 } else { -1 };
            } else {
                b.query_start_loc[s] = b.query_start_loc[s - 1] - 1 - (at / 32) as i32;
            }
            Want::QueryStart
        }
        3 => {
            // A context shorter than its new tokens.
            let with_new: Vec<usize> = (0..seqs)
                .filter(|&s| b.query_start_loc[s + 1] > b.query_start_loc[s])
                .collect();
            if with_new.is_empty() {
                return None;
            }
            let s = with_new[at % with_new.len()];
            b.context_lens[s] = b.query_start_loc[s + 1] - b.query_start_loc[s] - 1;
            Want::QueryLonger
        }
        4 => {
            // A context past its table row, or negative.
            if seqs == 0 {
                return None;
            }
            let cap = (b.max_blocks_per_seq * cfg.block_size()) as i32;
            b.context_lens[at % seqs] = [cap + 1, -1, i32::MAX, i32::MIN][at / 16 % 4];
            Want::Context
        }
        5 => {
            // One length off: a list one entry longer or shorter than the batch says.
            let grow = at & 1 == 0;
            let edit = |v: usize| if grow { Some(v + 1) } else { v.checked_sub(1) };
            match at / 2 % 5 {
                0 => {
                    let n = edit(tokens)?;
                    b.slot_mapping.resize(n, 0);
                }
                1 => {
                    let n = edit(seqs)?;
                    b.context_lens.resize(n, 0);
                }
                2 => {
                    let n = edit(b.block_tables.len())?;
                    b.block_tables.resize(n, 0);
                }
                3 => {
                    let n = edit(seqs + 1)?;
                    b.query_start_loc.resize(n, tokens as i32);
                }
                _ => {
                    let n = edit(tokens)?;
                    b.input_tokens.resize(n, 7);
                    b.positions.resize(n, 0);
                }
            }
            Want::Length
        }
        _ => return None, // kinds 6..8: the launch's rows (see `run`)
    };
    Some((b, want))
}

fn pairs(p: &[(u8, u8)], n_src: usize, n_dst: usize) -> Vec<(u32, u32)> {
    // Mostly in range; now and then one past the end.
    p.iter()
        .take(6)
        .map(|&(a, b)| {
            (
                u32::from(a) % (n_src as u32 + 1),
                u32::from(b) % (n_dst as u32 + 1),
            )
        })
        .collect()
}

/// `out` (the backend's rows) against `want` (the oracle's), within the dtype's tolerance.
fn close<T: Elem>(out: &DeviceRows, want: &[T], what: &str) {
    let len = out.tokens * out.rows.token_stride;
    assert_eq!(len, want.len(), "{what}: output rows");
    // SAFETY: under the emulation a device pointer is a host pointer; the backend's output
    // buffer holds at least `tokens` dense rows of T, written by the launch that returned.
    let got = unsafe { std::slice::from_raw_parts(out.rows.ptr as usize as *const T, len) };
    let (atol, rtol) = T::TOL;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f32(), w.to_f32());
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}: element {i}: backend {g}, oracle {w}"
        );
    }
}

fn run<T: Elem>(input: &Input, heads: usize, kv_heads: usize, bs: usize) {
    let layer = usize::from(input.geometry >> 7);
    let shape = ModelKvShape {
        num_layers: LAYERS,
        num_kv_heads: kv_heads,
        head_dim: D,
        dtype: T::DTYPE,
    };
    let cfg = shape.config(bs, PAGES).expect("a supported geometry");
    let mut arena = EmuBuf::zeroed(PAGES * cfg.page_bytes()).expect("guarded allocation");
    // The cache holds earlier tokens' K/V everywhere (both layers); the oracle a copy.
    for (i, x) in arena.as_mut_slice::<T>().iter_mut().enumerate() {
        *x = val(i, input.seed);
    }
    let mut host = HostKvCache::new(cfg).expect("host cache");
    assert_eq!(
        host.as_bytes().len(),
        arena.len(),
        "arena and host cache sizes"
    );
    host.as_bytes_mut().copy_from_slice(arena.as_slice::<u8>());
    let mut swap = SwapSpace::new(&cfg, SWAP_SLOTS).expect("swap space");
    let caps = RawCaps {
        max_seqs: usize::from(input.caps & 3) + 1,
        max_tokens: usize::from(input.caps >> 2 & 7) * 4 + 1,
        max_blocks_per_seq: usize::from(input.caps >> 5 & 3) + 1,
        max_copies: usize::from(input.caps >> 7),
    };
    // SAFETY: under the emulation "device" memory is host memory; `arena` holds PAGES pages of
    // the config's page size and outlives the backend (declared before it, so dropped after
    // it); the batches name pages nothing else uses while the backend runs; every DeviceRows
    // handed to it below is an EmuBuf alive across the call and the step's end.
    let mut backend = unsafe {
        RawBackend::new(
            EmuDevice::new(usize::from(input.emu >> 2 & 7) + 1),
            arena.ptr() as usize as u64,
            &cfg,
            heads,
            caps,
            SWAP_SLOTS,
        )
    }
    .expect("a backend for a supported geometry");
    backend.set_programmatic_launch(input.shape >> 4 & 1 == 1);

    // A copy or swap before the step: accepted or refused as the host cache does.
    match &input.pre {
        Pre::None => {}
        Pre::Copy(p) => {
            let p = pairs(p, PAGES, PAGES);
            let raw = backend.copy_blocks(&p);
            agree("copy", &p, &raw, &host.copy_blocks(&p));
            backend.end().expect("end");
            same(&arena, &host, "copy");
        }
        Pre::Swap { out, back } => {
            let out = pairs(out, PAGES, SWAP_SLOTS);
            let raw = backend.swap_out(&out);
            agree("swap out", &out, &raw, &swap.swap_out(&host, &out));
            // Back in only from slots written (the rest hold nothing defined), or one past
            // the swap space.
            let filled: Vec<u32> = if raw.is_ok() {
                out.iter().map(|&(_, s)| s).collect()
            } else {
                Vec::new()
            };
            let back: Vec<(u32, u32)> = back
                .iter()
                .take(6)
                .map(|&(a, b)| {
                    let slot = if filled.is_empty() || a == 255 {
                        SWAP_SLOTS as u32
                    } else {
                        filled[usize::from(a) % filled.len()]
                    };
                    (slot, u32::from(b) % (PAGES as u32 + 1))
                })
                .collect();
            let raw = backend.swap_in(&back);
            agree("swap in", &back, &raw, &swap.swap_in(&mut host, &back));
            backend.end().expect("end");
            same(&arena, &host, "swap");
        }
    }

    let (seq_rows, mut free) = describe(input, bs);
    let step = batch_of(input, &seq_rows, bs);
    let batch = &step.batch;
    let tokens = batch.num_tokens();
    let rows = |heads: usize, n: usize, salt: usize| rows::<T>(heads, n, salt, input.seed);
    let (_qb, q, query) = rows(heads, tokens, 1);
    let (_kb, k, key) = rows(kv_heads, tokens, 2);
    let (_vb, v, value) = rows(kv_heads, tokens, 3);
    let (q, k, v) = (
        &q[..tokens * heads * D],
        &k[..tokens * kv_heads * D],
        &v[..tokens * kv_heads * D],
    );

    if input.fault % 8 == 7 {
        let kind = input.fault / 8;
        let caps = backend.caps();
        if let Some((bad, want)) = corrupt(batch, kind, input.fault_at, &cfg) {
            let r = backend.begin(&bad);
            assert!(
                matches!(&r, Err(e) if refused_as(e, want)),
                "corrupt batch ({want:?}) {bad:?}: {r:?}"
            );
            // Refused: nothing uploaded for a launch, nothing written, nothing grown.
            assert!(backend
                .reshape_and_cache(layer, &key, &value, &bad)
                .is_err());
            assert_eq!(format!("{:?}", backend.caps()), format!("{caps:?}"));
            backend.end().expect("end");
        } else if kind % 9 >= 6 {
            // The rows handed to a launch: one token off.
            backend.begin(batch).expect("a well-formed batch");
            let n = if input.fault_at & 1 == 0 {
                tokens + 1
            } else {
                tokens.wrapping_sub(1)
            };
            if n != usize::MAX {
                let (_b, _, off) = rows(heads.max(kv_heads), n, 4);
                let off_kv = DeviceRows {
                    rows: Rows::dense(off.rows.ptr, kv_heads, D),
                    tokens: n,
                };
                let off_q = DeviceRows {
                    rows: Rows::dense(off.rows.ptr, heads, D),
                    tokens: n,
                };
                let r = match kind % 9 {
                    6 => backend.reshape_and_cache(layer, &off_kv, &value, batch),
                    7 => backend.reshape_and_cache(layer, &key, &off_kv, batch),
                    _ if step.decode => backend.decode(layer, &off_q, batch).map(|_| ()),
                    _ => backend.prefill(layer, &off_q, batch).map(|_| ()),
                };
                assert!(
                    matches!(&r, Err(e) if refused_as(e, Want::Length)),
                    "rows of {n} tokens for {tokens}: {r:?}"
                );
            }
            // Decode of a batch whose rows are not one token each.
            if !batch
                .query_start_loc
                .iter()
                .enumerate()
                .all(|(i, &s)| s as usize == i)
            {
                assert!(
                    backend.decode(layer, &query, batch).is_err(),
                    "decode of {batch:?}"
                );
            }
            backend.end().expect("end");
        }
        same(&arena, &host, "refused");
    }

    // The well-formed batch, then (now and then) the decode step that follows it.
    let rig = Rig { layer, heads };
    rig.step::<T>(
        &mut backend,
        &arena,
        &mut host,
        &step,
        (q, k, v),
        (&query, &key, &value),
    );
    if input.shape >> 5 & 1 == 1 {
        let step = batch_of(input, &next_decode(&seq_rows, &mut free, bs), bs);
        let tokens = step.batch.num_tokens();
        let (_qb, q, query) = rows(heads, tokens, 5);
        let (_kb, k, key) = rows(kv_heads, tokens, 6);
        let (_vb, v, value) = rows(kv_heads, tokens, 7);
        let (q, k, v) = (
            &q[..tokens * heads * D],
            &k[..tokens * kv_heads * D],
            &v[..tokens * kv_heads * D],
        );
        rig.step::<T>(
            &mut backend,
            &arena,
            &mut host,
            &step,
            (q, k, v),
            (&query, &key, &value),
        );
    }
    drop(backend);
}

/// Rows of `heads` heads for `n` tokens (at least one row allocated), on the emulated device
/// and on the host.
fn rows<T: Elem>(heads: usize, n: usize, salt: usize, seed: u8) -> (EmuBuf, Vec<T>, DeviceRows) {
    let data: Vec<T> = (0..n.max(1) * heads * D)
        .map(|i| val(i * 7 + salt, seed))
        .collect();
    let buf = EmuBuf::from_slice(&data).expect("guarded allocation");
    let view = DeviceRows {
        rows: Rows::dense(buf.ptr() as usize as u64, heads, D),
        tokens: n,
    };
    (buf, data, view)
}

/// The raw backend accepts a copy or swap of `pairs` exactly when the host cache does.
fn agree<A: std::fmt::Debug, B: std::fmt::Debug>(
    what: &str,
    pairs: &[(u32, u32)],
    raw: &Result<(), A>,
    oracle: &Result<(), B>,
) {
    assert_eq!(
        raw.is_ok(),
        oracle.is_ok(),
        "{what} {pairs:?}: {raw:?} / {oracle:?}"
    );
}

fn same(arena: &EmuBuf, host: &HostKvCache, what: &str) {
    assert!(
        arena.as_slice::<u8>() == host.as_bytes(),
        "{what}: the arena differs from the host cache"
    );
}

/// The layer the steps run on and the model's query heads.
struct Rig {
    layer: usize,
    heads: usize,
}

impl Rig {
    /// Runs a well-formed step on the backend and the oracle: the cache writes must be the
    /// same bytes (and no page outside the batch's slots change), the attention outputs the
    /// same within the dtype's tolerance.
    fn step<T: Elem>(
        &self,
        backend: &mut RawBackend<EmuDevice>,
        arena: &EmuBuf,
        host: &mut HostKvCache,
        step: &Step,
        (q, k, v): (&[T], &[T], &[T]),
        (query, key, value): (&DeviceRows, &DeviceRows, &DeviceRows),
    ) {
        let (layer, heads) = (self.layer, self.heads);
        let batch = &step.batch;
        let tokens = batch.num_tokens();
        let cfg = *host.config();
        backend.begin(batch).expect("a well-formed batch");
        let before = arena.as_slice::<u8>().to_vec();
        backend
            .reshape_and_cache(layer, key, value, batch)
            .expect("a well-formed batch writes");
        {
            let mut view = host.view_mut::<T>().expect("view");
            let kv = view.layer_mut(layer).expect("layer");
            cpu::reshape_and_cache(kv, k, v, &batch.slot_mapping).expect("oracle write");
        }
        same(arena, host, "reshape_and_cache");
        let page = cfg.page_bytes();
        for p in (0..PAGES).filter(|&p| !step.written[p]) {
            assert!(
                arena.as_slice::<u8>()[p * page..(p + 1) * page]
                    == before[p * page..(p + 1) * page],
                "page {p} changed, no slot of the batch is in it"
            );
        }

        let seqs = PagedSeqs {
            block_tables: &batch.block_tables,
            max_blocks_per_seq: batch.max_blocks_per_seq,
            context_lens: &batch.context_lens,
        };
        let params = AttnParams::new(heads, D);
        let mut want = vec![T::from_f32(0.0); tokens * heads * D];
        let mut ws = AttnWorkspace::new();
        let kv = host.view::<T>().expect("view");
        let kv = kv.layer(layer).expect("layer");
        let out = if step.decode {
            cpu::paged_attention_decode(&mut ws, kv, q, &seqs, &params, &mut want)
                .expect("oracle decode");
            backend.decode(layer, query, batch)
        } else {
            cpu::paged_attention_prefill(
                &mut ws,
                kv,
                q,
                &batch.query_start_loc,
                &seqs,
                &params,
                &mut want,
            )
            .expect("oracle prefill");
            backend.prefill(layer, query, batch)
        };
        let out = out.expect("a well-formed batch attends");
        close::<T>(out, &want, if step.decode { "decode" } else { "prefill" });
        backend
            .end()
            .expect("the emulation has nothing to wait for");
        // Attention writes no page.
        same(arena, host, "attention");
    }
}

fuzz_target!(|input: Input| {
    let e = input.emu;
    cuda_emu::set_schedule(match e & 3 {
        0 => Schedule::Forward,
        1 => Schedule::Reverse,
        2 => Schedule::Random(u64::from(input.seed)),
        _ => Schedule::WarpByWarp {
            reverse: input.seed & 1 == 1,
        },
    });
    cuda_emu::set_copies_at_issue(input.shape >> 6 & 1 == 1);
    if sm90(&input) {
        cuda_emu::set_compute_capability(9, 0);
    } else {
        cuda_emu::set_compute_capability(8, 0);
    }
    let g = input.geometry;
    let (heads, kv_heads) = [(2, 1), (4, 2), (4, 1), (2, 2)][usize::from(g >> 2 & 3)];
    let bs = [8, 16, 32][usize::from(g >> 4 & 3) % 3];
    match g & 3 {
        0 | 3 => run::<f32>(&input, heads, kv_heads, bs),
        1 => run::<f16>(&input, heads, kv_heads, bs),
        _ => run::<bf16>(&input, heads, kv_heads, bs),
    }
});
