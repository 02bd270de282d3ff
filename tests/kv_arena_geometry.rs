//! Models of random geometry (layers, KV heads, head dim, dtype, tokens per page) sharing one
//! arena: every head vector of a model lies inside the block part of its own page and no two
//! overlap, writes through one model's view leave every other page and every page's padding
//! untouched, and a swap-out / swap-in through the view (and through a dense and a padded host
//! cache) moves exactly the block's bytes, for every dtype.

use pagedkv::kv::{
    page_bytes_for, ArenaView, HostKvCache, KvArena, KvDtype, KvElem, KvPart, ModelKvShape,
    SwapSpace, POISON_BYTE,
};
use proptest::prelude::*;
use std::sync::Arc;

const DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

/// Every head vector's element range in `pages`, checked to lie in the block part of its
/// page; returns them sorted, so overlaps show as neighbours.
fn head_ranges(v: &ArenaView, pages: &[u32]) -> Vec<(usize, usize)> {
    let c = *v.config();
    let page_elems = c.block_stride();
    let mut out = Vec::new();
    for &p in pages {
        let (lo, hi) = (
            p as usize * page_elems,
            p as usize * page_elems + c.elems_per_block(),
        );
        for l in 0..c.num_layers() {
            for part in [KvPart::Key, KvPart::Value] {
                for t in 0..c.block_size() {
                    for h in 0..c.num_kv_heads() {
                        let off = c.offset(p as usize, l, part, t, h);
                        assert!(lo <= off && off + c.head_dim() <= hi, "outside its block");
                        out.push((off, off + c.head_dim()));
                    }
                }
            }
        }
    }
    out.sort_unstable();
    out
}

/// Writes every head vector of `pages` through the view (values exact in every dtype), then
/// reads each back through a read-only view.
fn write_and_read_back<T: KvElem>(v: &ArenaView, pages: &[u32], tag: usize) {
    let c = *v.config();
    let value = |off: usize, i: usize| T::from_f32(((tag * 31 + off + i) % 250) as f32);
    for l in 0..c.num_layers() {
        // SAFETY: single-threaded test; the pages are this model's alone.
        let mut kv = unsafe { v.layer_mut::<T>(l).unwrap() };
        for (off, end) in head_ranges(v, pages) {
            let row: Vec<T> = (off..end).map(|o| value(o, l)).collect();
            // Only this layer's vectors: the ranges of other layers are written in their turn.
            if (off % c.block_stride()) / c.layer_stride() == l {
                kv.write(off, &row);
            }
        }
    }
    for l in 0..c.num_layers() {
        // SAFETY: as above.
        let kv = unsafe { v.layer::<T>(l).unwrap() };
        for (off, end) in head_ranges(v, pages) {
            if (off % c.block_stride()) / c.layer_stride() == l {
                let want: Vec<T> = (off..end).map(|o| value(o, l)).collect();
                assert_eq!(kv.head(off, end - off), &want[..]);
            }
        }
    }
}

fn page(arena: &KvArena, p: u32) -> Vec<u8> {
    // SAFETY: single-threaded test.
    unsafe { arena.read_page(p).unwrap() }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn models_share_pages_without_touching_what_they_do_not_own(
        specs in proptest::collection::vec((1usize..4, 1usize..5, 1usize..4, 0usize..3), 1..4),
        tpp_log2 in 3u32..6,
        extra_align_units in 0usize..4,
    ) {
        let shapes: Vec<ModelKvShape> = specs
            .iter()
            .map(|&(l, h, d, t)| ModelKvShape {
                num_layers: l,
                num_kv_heads: h,
                head_dim: d * 8,
                dtype: DTYPES[t],
            })
            .collect();
        let page_bytes = page_bytes_for(&shapes, 1 << tpp_log2).unwrap() + 16 * extra_align_units;
        let n = 2 * shapes.len();
        let arena = Arc::new(KvArena::new(n, page_bytes).unwrap());
        let all: Vec<u32> = (0..n as u32).collect();
        // SAFETY: single-threaded test.
        unsafe { arena.poison_pages(&all).unwrap() };
        let views: Vec<ArenaView> =
            shapes.iter().map(|s| ArenaView::new(arena.clone(), s).unwrap()).collect();
        for (i, v) in views.iter().enumerate() {
            let own = [2 * i as u32, 2 * i as u32 + 1];
            let ranges = head_ranges(v, &own);
            prop_assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "head vectors overlap");
            let others: Vec<Vec<u8>> =
                all.iter().filter(|p| !own.contains(p)).map(|&p| page(&arena, p)).collect();
            match v.config().dtype() {
                KvDtype::F32 => write_and_read_back::<f32>(v, &own, i),
                KvDtype::F16 => write_and_read_back::<half::f16>(v, &own, i),
                KvDtype::Bf16 => write_and_read_back::<half::bf16>(v, &own, i),
            }
            let after: Vec<Vec<u8>> =
                all.iter().filter(|p| !own.contains(p)).map(|&p| page(&arena, p)).collect();
            prop_assert_eq!(others, after, "a write reached another model's page");
            let bpb = v.config().bytes_per_block();
            for p in own {
                prop_assert!(page(&arena, p)[bpb..].iter().all(|&x| x == POISON_BYTE));
            }

            // Swap both pages out, poison them, swap them back crossed.
            let before = [page(&arena, own[0]), page(&arena, own[1])];
            let mut swap = SwapSpace::new(v.config(), 3).unwrap();
            // SAFETY: single-threaded test.
            unsafe {
                v.swap_out(&mut swap, &[(own[0], 1), (own[1], 2)]).unwrap();
                arena.poison_pages(&own).unwrap();
                v.swap_in(&swap, &[(2, own[0]), (1, own[1])]).unwrap();
            }
            let (a0, a1) = (page(&arena, own[0]), page(&arena, own[1]));
            prop_assert_eq!(&a0[..bpb], &before[1][..bpb]);
            prop_assert_eq!(&a1[..bpb], &before[0][..bpb]);
            prop_assert!(a0[bpb..].iter().chain(&a1[bpb..]).all(|&x| x == POISON_BYTE));

            // The same swap space against host caches, dense and padded like the arena.
            let dense = v.config().with_num_blocks(2).unwrap();
            for cfg in [dense, dense.with_page_stride(page_bytes).unwrap()] {
                let mut host = HostKvCache::new(cfg).unwrap();
                swap.swap_in(&mut host, &[(2, 0), (1, 1)]).unwrap();
                prop_assert_eq!(host.block_bytes(0).unwrap(), &before[1][..bpb]);
                prop_assert_eq!(host.block_bytes(1).unwrap(), &before[0][..bpb]);
                let mut back = SwapSpace::new(v.config(), 2).unwrap();
                back.swap_out(&host, &[(1, 0), (0, 1)]).unwrap();
                prop_assert_eq!(back.storage().block_bytes(0).unwrap(), &before[0][..bpb]);
                prop_assert_eq!(back.storage().block_bytes(1).unwrap(), &before[1][..bpb]);
            }
        }
    }
}
