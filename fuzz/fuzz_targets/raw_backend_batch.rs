//! Fuzz the raw-pointer engine backend (`engine::RawBackend`) with arbitrary batches, on the
//! CUDA kernels' CPU emulation: `begin` must refuse a malformed batch with an error (never
//! panic), and a batch it accepts must run `reshape_and_cache` and decode or prefill attention
//! on the emulated kernels without a fault (guarded buffers: a read or write past any buffer
//! aborts) — the host checks are what stand between device memory and bad metadata.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::cuda_emu::{EmuBuf, EmuDevice};
use pagedkv::cuda_raw::Rows;
use pagedkv::engine::{DeviceRows, KvBackend, RawBackend, RawCaps};
use pagedkv::kv::{KvDtype, ModelKvShape};
use pagedkv::sched::Batch;

const PAGES: usize = 6;
const BLOCK: usize = 16;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const D: usize = 64;

#[derive(Debug, Arbitrary)]
struct Input {
    rows: Vec<u8>,
    tokens: u8,
    starts: Vec<i8>,
    contexts: Vec<i16>,
    slots: Vec<i16>,
    tables: Vec<i8>,
    blocks_per_seq: u8,
    extra_contexts: u8,
}

fuzz_target!(|input: Input| {
    let shape = ModelKvShape {
        num_layers: 1,
        num_kv_heads: KV_HEADS,
        head_dim: D,
        dtype: KvDtype::F32,
    };
    let Ok(config) = shape.config(BLOCK, PAGES) else {
        return;
    };
    let arena = EmuBuf::zeroed(PAGES * config.page_bytes()).expect("guarded allocation");
    let caps = RawCaps {
        max_seqs: 2,
        max_tokens: 4,
        max_blocks_per_seq: 2,
        max_copies: 1,
    };
    // SAFETY: under the emulation "device" memory is host memory; `arena` holds PAGES pages of
    // the config's page size and outlives the backend (dropped at the end of this closure,
    // after it); nothing else uses it.
    let Ok(mut backend) = (unsafe {
        RawBackend::new(
            EmuDevice::new(4),
            arena.ptr() as usize as u64,
            &config,
            HEADS,
            caps,
            2,
        )
    }) else {
        return;
    };
    let seqs = input.rows.len().min(8);
    let tokens = usize::from(input.tokens % 12);
    let mbps = usize::from(input.blocks_per_seq % 5);
    let contexts = seqs + usize::from(input.extra_contexts % 2);
    let batch = Batch {
        seq_ids: (0..seqs as u64).collect(),
        input_tokens: vec![1; tokens],
        positions: vec![0; tokens],
        query_start_loc: input
            .starts
            .iter()
            .take(seqs + 1)
            .map(|&s| i32::from(s))
            .collect(),
        context_lens: input
            .contexts
            .iter()
            .cycle()
            .take(contexts)
            .map(|&c| i32::from(c))
            .collect(),
        slot_mapping: input
            .slots
            .iter()
            .cycle()
            .take(tokens)
            .map(|&s| i64::from(s))
            .collect(),
        block_tables: input
            .tables
            .iter()
            .cycle()
            .take(contexts * mbps)
            .map(|&b| i32::from(b))
            .collect(),
        max_blocks_per_seq: mbps,
        ..Batch::default()
    };
    if backend.begin(&batch).is_err() {
        return;
    }
    // Accepted: the projections the model would give, then the kernels over the metadata.
    let rows = |heads: usize| {
        let buf = EmuBuf::from_slice(&vec![0.25f32; tokens.max(1) * heads * D])
            .expect("guarded allocation");
        let view = DeviceRows {
            rows: Rows::dense(buf.ptr() as usize as u64, heads, D),
            tokens,
        };
        (buf, view)
    };
    let (_q, query) = rows(HEADS);
    let (_k, key) = rows(KV_HEADS);
    let (_v, value) = rows(KV_HEADS);
    backend
        .reshape_and_cache(0, &key, &value, &batch)
        .expect("checked metadata runs");
    let out = if tokens == seqs {
        backend.decode(0, &query, &batch)
    } else {
        backend.prefill(0, &query, &batch)
    };
    out.expect("checked metadata runs");
    backend
        .end()
        .expect("the emulation has nothing to wait for");
});
