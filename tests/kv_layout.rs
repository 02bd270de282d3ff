//! KV cache geometry: validation, strides, byte sizes per dtype, the offset formula, and the
//! host cache's alignment and typed views.

use half::{bf16, f16};
use pagedkv::block::MAX_BLOCKS;
use pagedkv::error::KvError;
use pagedkv::kv::{
    coalesce_block_runs, BlockRun, HostKvCache, KvCacheConfig, KvCacheView, KvDtype, KvPart,
    HEAD_DIM_ALIGN, HOST_ALIGN,
};
use proptest::prelude::*;

#[test]
fn invalid_geometry_is_a_typed_error() {
    let ok = |l, h, d, bs, n| KvCacheConfig::new(l, h, d, bs, n, KvDtype::F16);
    for (args, what) in [
        ((0, 8, 128, 16, 10), "num_layers"),
        ((2, 0, 128, 16, 10), "num_kv_heads"),
        ((2, 8, 0, 16, 10), "head_dim"),
        ((2, 8, 128, 0, 10), "block_size"),
        ((2, 8, 128, 16, 0), "num_blocks"),
    ] {
        let (l, h, d, bs, n) = args;
        assert_eq!(ok(l, h, d, bs, n), Err(KvError::ZeroDimension { what }));
    }
    for d in [1, 4, 60, 129, 250] {
        assert_eq!(
            ok(1, 1, d, 16, 1),
            Err(KvError::HeadDimAlignment {
                head_dim: d,
                align: HEAD_DIM_ALIGN
            })
        );
    }
    assert!(matches!(
        ok(1, 1, 64, 16, MAX_BLOCKS as usize + 1),
        Err(KvError::TooManyBlocks { .. })
    ));
    assert_eq!(
        ok(1 << 40, 1 << 20, 1 << 10, 16, 1),
        Err(KvError::SizeOverflow)
    );
    assert_eq!(ok(usize::MAX, 1, 8, 1, 1), Err(KvError::SizeOverflow));
    // Fits usize but not isize.
    assert_eq!(
        ok(1 << 31, 1 << 10, 1 << 10, 1 << 10, 1),
        Err(KvError::SizeOverflow)
    );
    assert!(ok(80, 8, 128, 16, MAX_BLOCKS as usize).is_ok());
}

#[test]
fn strides_and_bytes_per_dtype() {
    for (dt, size) in [(KvDtype::F32, 4), (KvDtype::F16, 2), (KvDtype::Bf16, 2)] {
        assert_eq!(dt.size_bytes(), size);
        let (l, h, d, bs, n) = (32, 8, 128, 16, 1000);
        let c = KvCacheConfig::new(l, h, d, bs, n, dt).unwrap();
        assert_eq!(c.head_stride(), d);
        assert_eq!(c.token_stride(), h * d);
        assert_eq!(c.kv_stride(), bs * h * d);
        assert_eq!(c.layer_stride(), 2 * bs * h * d);
        assert_eq!(c.block_stride(), l * 2 * bs * h * d);
        assert_eq!(c.elems_per_block(), c.block_stride());
        // Llama-3-8B-like geometry: 32 layers x 2 x 16 tokens x 8 heads x 128 = 1 Mi elements.
        assert_eq!(c.bytes_per_block(), (1 << 20) * size);
        assert_eq!(c.total_bytes(), n * (1 << 20) * size);
        assert_eq!(c.bytes_per_token(), l * 2 * h * d * size);
        assert_eq!(c.bytes_per_token() * bs, c.bytes_per_block());
        assert_eq!(c.blocks_for_tokens(0), 0);
        assert_eq!(c.blocks_for_tokens(16), 1);
        assert_eq!(c.blocks_for_tokens(17), 2);
    }
}

#[test]
fn offset_formula_is_row_major_over_the_documented_order() {
    let c = KvCacheConfig::new(3, 2, 16, 4, 5, KvDtype::F32).unwrap();
    let mut expected = 0;
    // Walking the dimensions in the documented order visits offsets 0, D, 2D, ... in sequence.
    for b in 0..5 {
        for l in 0..3 {
            for part in [KvPart::Key, KvPart::Value] {
                for t in 0..4 {
                    for h in 0..2 {
                        assert_eq!(c.offset(b, l, part, t, h), expected);
                        expected += 16;
                    }
                }
            }
        }
    }
    assert_eq!(expected, c.total_elems());
}

/// With a page stride, block `b` starts `b` pages in, each block laid out as in a dense cache
/// (the padding at the end of each page). Every kernel, CPU and CUDA, and `reshape_and_cache`
/// address through `offset`, so a formula that stepped blocks by the dense block size would
/// agree with itself everywhere and still put block 1 inside block 0's page padding.
#[test]
fn offset_steps_blocks_by_the_page_stride() {
    let dense = KvCacheConfig::new(3, 2, 16, 4, 5, KvDtype::F32).unwrap();
    let page_bytes = dense.bytes_per_block() + 48;
    let c = dense.with_page_stride(page_bytes).unwrap();
    let page_elems = page_bytes / 4;
    for b in 0..5 {
        for l in 0..3 {
            for part in [KvPart::Key, KvPart::Value] {
                for t in 0..4 {
                    for h in 0..2 {
                        assert_eq!(
                            c.offset(b, l, part, t, h),
                            b * page_elems + dense.offset(0, l, part, t, h),
                            "block {b} layer {l} {part:?} token {t} head {h}"
                        );
                    }
                }
            }
        }
    }
    assert_eq!(c.total_elems(), 5 * page_elems);
}

#[test]
fn block_is_one_contiguous_run_of_bytes_per_block() {
    let c = KvCacheConfig::new(4, 2, 64, 8, 6, KvDtype::Bf16).unwrap();
    let lo = c.offset(3, 0, KvPart::Key, 0, 0);
    let hi = c.offset(3, 3, KvPart::Value, 7, 1) + c.head_dim();
    assert_eq!((hi - lo) * 2, c.bytes_per_block());
    assert_eq!(lo * 2, 3 * c.bytes_per_block());
}

#[test]
fn host_cache_is_aligned_zeroed_and_typed() {
    for dt in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let c = KvCacheConfig::new(2, 2, 64, 16, 7, dt).unwrap();
        let mut cache = HostKvCache::new(c).unwrap();
        assert_eq!(cache.as_bytes().as_ptr() as usize % HOST_ALIGN, 0);
        assert_eq!(cache.as_bytes().len(), c.total_bytes());
        assert!(cache.as_bytes().iter().all(|&b| b == 0));
        assert_eq!(cache.block_bytes(6).unwrap().len(), c.bytes_per_block());
        assert_eq!(
            cache.block_bytes(7),
            Err(KvError::BlockOutOfRange {
                block: 7,
                num_blocks: 7
            })
        );
        match dt {
            KvDtype::F32 => {
                let mut v = cache.view_mut::<f32>().unwrap();
                v.data_mut()[c.offset(1, 1, KvPart::Value, 3, 1)] = 1.5;
                assert!(cache.view::<f16>().is_err());
                assert!(cache.view::<bf16>().is_err());
                let o = c.offset(1, 1, KvPart::Value, 3, 1) * 4;
                assert_eq!(&cache.as_bytes()[o..o + 4], &1.5f32.to_ne_bytes());
            }
            KvDtype::F16 => {
                assert_eq!(cache.view::<f16>().unwrap().data().len(), c.total_elems());
                assert!(cache.view::<f32>().is_err());
            }
            KvDtype::Bf16 => {
                assert_eq!(cache.view::<bf16>().unwrap().data().len(), c.total_elems());
                assert!(matches!(
                    cache.view_mut::<f16>(),
                    Err(KvError::DtypeMismatch {
                        expected: KvDtype::Bf16,
                        found: KvDtype::F16
                    })
                ));
            }
        }
    }
}

/// `HOST_ALIGN`'s claim: blocks start 64-byte aligned when the page stride is a multiple of 64,
/// padded caches included (with `bytes_per_block = 256` and a 272-byte stride block 1 starts at
/// byte 272: the stride, not the block size, is what the claim needs).
#[test]
fn host_blocks_start_64_aligned_when_the_page_stride_is() {
    let dense = KvCacheConfig::new(1, 1, 8, 4, 5, KvDtype::F32).unwrap();
    assert_eq!(dense.bytes_per_block(), 256);
    for c in [dense, dense.with_page_stride(320).unwrap()] {
        let cache = HostKvCache::new(c).unwrap();
        for b in 0..c.num_blocks() {
            let p = cache.block_bytes(b).unwrap().as_ptr() as usize;
            assert_eq!(p % 64, 0, "block {b} of a {}-byte stride", c.page_bytes());
        }
    }
}

/// A geometry `KvCacheConfig` accepts (its size fits `isize`) whose size rounded up to
/// `HOST_ALIGN` does not: a typed error, as `HostKvCache::new` documents, not a panic.
#[test]
fn host_cache_of_a_size_within_a_page_of_isize_max_is_refused() {
    let c = KvCacheConfig::new((1 << 57) - 1, 1, 8, 1, 1, KvDtype::F32).unwrap();
    assert_eq!(c.total_bytes(), isize::MAX as usize - 63);
    assert_eq!(HostKvCache::new(c).unwrap_err(), KvError::SizeOverflow);
}

#[test]
fn views_over_plain_slices_check_length_dtype_and_layer() {
    let c = KvCacheConfig::new(2, 1, 8, 4, 3, KvDtype::F32).unwrap();
    let data = vec![1.0f32; c.total_elems()];
    let v = KvCacheView::new(&c, &data).unwrap();
    assert_eq!(v.layer(1).unwrap().layer(), 1);
    assert_eq!(
        v.layer(2).unwrap_err(),
        KvError::LayerOutOfRange {
            layer: 2,
            num_layers: 2
        }
    );
    assert!(matches!(
        KvCacheView::new(&c, &data[1..]),
        Err(KvError::LengthMismatch { .. })
    ));
    let halves = vec![f16::ONE; c.total_elems()];
    assert!(matches!(
        KvCacheView::new(&c, &halves),
        Err(KvError::DtypeMismatch { .. })
    ));
}

#[test]
fn coalesce_merges_only_consecutive_pairs() {
    let runs: Vec<BlockRun> =
        coalesce_block_runs(&[(4, 9), (5, 10), (6, 11), (8, 12), (9, 2), (10, 3), (0, 0)])
            .collect();
    assert_eq!(
        runs,
        vec![
            BlockRun {
                src: 4,
                dst: 9,
                len: 3
            },
            BlockRun {
                src: 8,
                dst: 12,
                len: 1
            },
            BlockRun {
                src: 9,
                dst: 2,
                len: 2
            },
            BlockRun {
                src: 0,
                dst: 0,
                len: 1
            },
        ]
    );
    assert_eq!(coalesce_block_runs(&[]).count(), 0);
    assert_eq!(coalesce_block_runs(&[(u32::MAX, 0), (0, 1)]).count(), 2);
}

proptest! {
    /// The runs expand back to exactly the input pairs, in order.
    #[test]
    fn coalesce_round_trips(pairs in proptest::collection::vec((0u32..20, 0u32..20), 0..40)) {
        let expanded: Vec<(u32, u32)> = coalesce_block_runs(&pairs)
            .flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i)))
            .collect();
        prop_assert_eq!(expanded, pairs);
    }
}
