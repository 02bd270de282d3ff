//! Launch statuses (feature `cuda-emu`): each raw launch reports its own outcome. The CUDA
//! runtime keeps the last failed call's error per thread until `cudaGetLastError` reads it, so
//! a launcher that launched and then asked `cudaGetLastError` reported an earlier, unrelated
//! failure (a prefill whose shared-memory opt-in the device refused) as its own, although its
//! kernel had been queued and ran: the caller was told the write failed after it happened.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use half::f16;
use pagedkv::cuda_emu::{self, EmuBuf};
use pagedkv::cuda_raw::{self, AttnParamsRaw, CacheView, PrefillTiling, RawError, Rows, SeqTables};
use pagedkv::kv::{KvCacheConfig, KvDtype};

fn ptr(b: &EmuBuf) -> u64 {
    b.ptr() as u64
}

/// Head dim 256 on a device of compute capability 8.9 (99 KiB of opt-in shared memory per
/// block): the f16 prefill's 64-row kernel asks for 102,144 bytes and is refused (a typed
/// error). The cache write and the block copy launched after it on the same thread must report
/// their own success, not that refusal.
#[test]
fn a_refused_launch_is_not_reported_by_the_next_cache_write() {
    let (d, bs, blocks) = (256, 16, 4);
    let cfg = KvCacheConfig::new(1, 1, d, bs, blocks, KvDtype::F16).unwrap();
    let arena = EmuBuf::zeroed(cfg.total_bytes()).unwrap();
    let cache = CacheView {
        base: ptr(&arena),
        config: cfg,
    };
    let null = std::ptr::null_mut();

    // One sequence of 4 tokens, all new (prefill).
    let tokens = 4usize;
    let q = EmuBuf::from_slice(&vec![f16::from_f32(0.5); tokens * d]).unwrap();
    let out = EmuBuf::zeroed(tokens * d * 2).unwrap();
    let tables = EmuBuf::from_slice(&[0i32]).unwrap();
    let ctx = EmuBuf::from_slice(&[tokens as i32]).unwrap();
    let qsl = EmuBuf::from_slice(&[0i32, tokens as i32]).unwrap();
    let seqs = SeqTables {
        block_tables: ptr(&tables),
        max_blocks_per_seq: 1,
        context_lens: ptr(&ctx),
        num_seqs: 1,
    };
    cuda_emu::set_compute_capability(8, 9);
    // SAFETY: every pointer is a live emulated buffer of the documented size.
    let refused = unsafe {
        cuda_raw::paged_attention_prefill(
            &cache,
            0,
            Rows::dense(ptr(&q), 1, d),
            Rows::dense(ptr(&out), 1, d),
            &seqs,
            ptr(&qsl),
            tokens,
            &AttnParamsRaw::new(1, d),
            null,
        )
    };
    cuda_emu::set_compute_capability(9, 0);
    assert!(
        matches!(refused, Err(RawError::Launch { .. })),
        "the 99 KiB device refuses the d256 prefill: {refused:?}"
    );

    // A cache write of one token into slot 5 (block 0, row 5): it runs, and says so.
    let k = EmuBuf::from_slice(&vec![f16::from_f32(1.0); d]).unwrap();
    let v = EmuBuf::from_slice(&vec![f16::from_f32(2.0); d]).unwrap();
    let slots = EmuBuf::from_slice(&[5i64]).unwrap();
    // SAFETY: as above.
    let wrote = unsafe {
        cuda_raw::reshape_and_cache(
            &cache,
            0,
            Rows::dense(ptr(&k), 1, d),
            Rows::dense(ptr(&v), 1, d),
            ptr(&slots),
            1,
            null,
        )
    };
    let cached = arena.as_slice::<f16>();
    assert_eq!(cached[5 * d], f16::from_f32(1.0), "the kernel ran");
    assert!(wrote.is_ok(), "a cache write that ran reports {wrote:?}");

    // A block copy 0 -> 2: it runs, and says so.
    let pairs = EmuBuf::from_slice(&[0i32, 2]).unwrap();
    // SAFETY: as above.
    let copied = unsafe { cuda_raw::copy_blocks(&cache, ptr(&pairs), 1, null) };
    let page = cfg.page_bytes() / 2;
    assert_eq!(
        arena.as_slice::<f16>()[2 * page + 5 * d],
        f16::from_f32(1.0)
    );
    assert!(copied.is_ok(), "a block copy that ran reports {copied:?}");
}

/// Values in [-1, 1) from a fixed sequence (no generator needed).
fn values(n: usize, seed: u32) -> Vec<f16> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            f16::from_f32((x % 2048) as f32 / 1024.0 - 1.0)
        })
        .collect()
}

/// The 128-row mma.sync prefill (WarpRows32) asks 105,984 bytes of shared memory at head dim
/// 128: more than a block may opt in to on compute capability 8.6 / 8.9 / 12.x (99 KiB; the
/// sm_80 SASS runs there, the compute_90 PTX is JIT-compiled for 12.x). Auto chose it there for
/// any prefill whose blocks fill the SMs, and the launch failed at cudaFuncSetAttribute. It
/// must run WarpRows16 there instead (as a tiling a launch cannot run does), with that kernel's
/// results.
#[test]
fn warp32_is_not_chosen_where_its_shared_memory_does_not_fit() {
    let (d, bs, nh, tokens) = (128usize, 16usize, 2usize, 128usize);
    let blocks = tokens / bs;
    let cfg = KvCacheConfig::new(1, 1, d, bs, blocks, KvDtype::F16).unwrap();
    let arena = EmuBuf::from_slice(&values(cfg.total_bytes() / 2, 1)).unwrap();
    let cache = CacheView {
        base: ptr(&arena),
        config: cfg,
    };
    let q = EmuBuf::from_slice(&values(tokens * nh * d, 2)).unwrap();
    let tables = EmuBuf::from_slice(&(0..blocks as i32).collect::<Vec<_>>()).unwrap();
    let ctx = EmuBuf::from_slice(&[tokens as i32]).unwrap();
    let qsl = EmuBuf::from_slice(&[0i32, tokens as i32]).unwrap();
    let seqs = SeqTables {
        block_tables: ptr(&tables),
        max_blocks_per_seq: blocks,
        context_lens: ptr(&ctx),
        num_seqs: 1,
    };
    let run = |tiling: PrefillTiling| {
        let out = EmuBuf::zeroed(tokens * nh * d * 2).unwrap();
        let params = AttnParamsRaw {
            prefill_tiling: tiling,
            ..AttnParamsRaw::new(nh, d)
        };
        let _ = cuda_emu::take_stats();
        // SAFETY: every pointer is a live emulated buffer of the documented size.
        let r = unsafe {
            cuda_raw::paged_attention_prefill(
                &cache,
                0,
                Rows::dense(ptr(&q), nh, d),
                Rows::dense(ptr(&out), nh, d),
                &seqs,
                ptr(&qsl),
                tokens,
                &params,
                std::ptr::null_mut(),
            )
        };
        let smem = cuda_emu::take_stats().max_dynamic_smem;
        (r, out.as_slice::<f16>().to_vec(), smem)
    };
    // One SM: the launch's 2 blocks of 128 rows fill it, so Auto wants WarpRows32.
    cuda_emu::set_sm_count(1);
    cuda_emu::set_compute_capability(8, 0);
    let on_80 = PrefillTiling::Auto.resolve(&cfg, nh, 1, tokens, 1);
    cuda_emu::set_compute_capability(8, 9);
    let on_89 = PrefillTiling::Auto.resolve(&cfg, nh, 1, tokens, 1);
    let asked_89 = PrefillTiling::WarpRows32.resolve(&cfg, nh, 1, tokens, 1);
    let (auto_89, got, smem) = run(PrefillTiling::Auto);
    let (asked, got_asked, _) = run(PrefillTiling::WarpRows32);
    cuda_emu::set_compute_capability(9, 0);
    let (_, want, _) = run(PrefillTiling::WarpRows16);
    cuda_emu::set_sm_count(132);
    assert!(auto_89.is_ok(), "Auto prefill on cc 8.9: {auto_89:?}");
    assert!(asked.is_ok(), "WarpRows32 prefill on cc 8.9: {asked:?}");
    assert_eq!(on_80, Ok(Some(PrefillTiling::WarpRows32)), "cc 8.0 fits it");
    assert_eq!(on_89, Ok(Some(PrefillTiling::WarpRows16)), "Auto on cc 8.9");
    assert_eq!(
        asked_89,
        Ok(Some(PrefillTiling::WarpRows16)),
        "WarpRows32 on cc 8.9"
    );
    assert!(smem <= 99 * 1024, "{smem} bytes of shared memory");
    assert!(got == want && got_asked == want, "not WarpRows16's results");
}
