//! The raw-pointer backend's refusals (feature `cuda-emu`): calls in an order or shape the
//! executor never makes, through the public trait, must be refused instead of launching a
//! kernel past its buffers or over metadata that was never uploaded.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use pagedkv::cuda_emu::{EmuBuf, EmuDevice};
use pagedkv::cuda_raw::Rows;
use pagedkv::engine::{DeviceRows, KvBackend, RawBackend, RawCaps};
use pagedkv::kv::{KvCacheConfig, KvDtype};
use pagedkv::sched::Batch;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const D: usize = 64;
const BS: usize = 16;
const BLOCKS: usize = 8;

fn config() -> KvCacheConfig {
    KvCacheConfig::new(1, KV_HEADS, D, BS, BLOCKS, KvDtype::F32).unwrap()
}

/// A backend with room for 4 sequences but 1 token per step (its output buffer: 1 row).
fn backend(arena: &EmuBuf) -> RawBackend<EmuDevice> {
    let cfg = config();
    assert!(arena.len() >= cfg.total_bytes());
    let caps = RawCaps {
        max_seqs: 4,
        max_tokens: 1,
        max_blocks_per_seq: 1,
        max_copies: 0,
    };
    // SAFETY: emulated device memory is host memory; `arena` holds the cache's pages and
    // outlives the backend; the batches below name pages nothing else uses, and the rows
    // handed to the backend are emulated buffers alive across each call.
    unsafe { RawBackend::new(EmuDevice::new(8), arena.ptr() as u64, &cfg, HEADS, caps, 1) }.unwrap()
}

/// Three sequences over one token row (empty rows pass the batch checks): decode would read
/// three query rows and write three output rows of one-row buffers (the emulation's illegal
/// address). The host backend refuses it; so must this one.
#[test]
fn decode_refuses_a_step_with_more_sequences_than_tokens() {
    let arena = EmuBuf::zeroed(config().total_bytes()).unwrap();
    let mut b = backend(&arena);
    let batch = Batch {
        seq_ids: vec![1, 2, 3],
        input_tokens: vec![7],
        positions: vec![0],
        query_start_loc: vec![0, 1, 1, 1],
        context_lens: vec![1, 1, 1],
        slot_mapping: vec![0],
        block_tables: vec![0, 1, 2],
        max_blocks_per_seq: 1,
        ..Batch::default()
    };
    b.begin(&batch).unwrap();
    let q = EmuBuf::zeroed(HEADS * D * 4).unwrap();
    let query = DeviceRows {
        rows: Rows::dense(q.ptr() as u64, HEADS, D),
        tokens: 1,
    };
    assert!(
        b.decode(0, &query, &batch).is_err(),
        "decode of 3 sequences over 1 row ran"
    );
    b.end().unwrap();
}

/// Copy pairs past the capacity after `begin` grow the device buffers: the step's uploaded
/// slot mapping stayed in the old block, and the cache write used to read the new, never
/// filled one (its K/V landed in page 0, which the batch does not name). Now refused until
/// the next `begin`.
#[test]
fn a_buffer_growth_after_begin_ends_the_step() {
    let cfg = config();
    let mut arena = EmuBuf::zeroed(cfg.total_bytes()).unwrap();
    let mut b = backend(&arena);
    let batch = Batch {
        seq_ids: vec![1],
        input_tokens: vec![7],
        positions: vec![2],
        query_start_loc: vec![0, 1],
        context_lens: vec![3],
        slot_mapping: vec![(3 * BS + 2) as i64],
        block_tables: vec![3],
        max_blocks_per_seq: 1,
        ..Batch::default()
    };
    b.begin(&batch).unwrap();
    b.copy_blocks(&[(5, 6)]).unwrap(); // max_copies 0: the buffers grow
    let k = EmuBuf::from_slice(&vec![1.0f32; KV_HEADS * D]).unwrap();
    let rows = DeviceRows {
        rows: Rows::dense(k.ptr() as u64, KV_HEADS, D),
        tokens: 1,
    };
    assert!(b.reshape_and_cache(0, &rows, &rows, &batch).is_err());
    b.end().unwrap();
    // Begun again, the step runs and writes the token's slot only.
    b.begin(&batch).unwrap();
    b.reshape_and_cache(0, &rows, &rows, &batch).unwrap();
    b.end().unwrap();
    let cache = arena.as_mut_slice::<f32>();
    let page = cfg.block_stride();
    let at = 3 * page + 2 * KV_HEADS * D;
    assert!(
        cache[at..at + KV_HEADS * D].iter().all(|&x| x == 1.0),
        "the token's K"
    );
    assert!(
        cache[..page].iter().all(|&x| x == 0.0),
        "page 0 was written"
    );
}
