//! Swap space: swap out then in restores the bytes exactly, batched over mapping lists; bad
//! mappings are typed errors that copy nothing.

use pagedkv::error::KvError;
use pagedkv::kv::{check_block_mapping, HostKvCache, KvCacheConfig, KvDtype, SwapSpace};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn random_cache(cfg: KvCacheConfig, seed: u64) -> HostKvCache {
    let mut c = HostKvCache::new(cfg).unwrap();
    SmallRng::seed_from_u64(seed).fill(c.as_bytes_mut());
    c
}

fn block(c: &HostKvCache, b: u32) -> Vec<u8> {
    c.block_bytes(b as usize).unwrap().to_vec()
}

#[test]
fn swap_out_then_in_restores_bytes_exactly() {
    for dt in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let cfg = KvCacheConfig::new(4, 2, 64, 16, 32, dt).unwrap();
        let mut cache = random_cache(cfg, 1);
        let mut swap = SwapSpace::new(&cfg, 12).unwrap();
        assert_eq!(swap.config().num_blocks(), 12);
        assert_eq!(swap.storage().as_bytes().len(), 12 * cfg.bytes_per_block());
        // Two sequences' blocks, one with a consecutive run, swapped in one call.
        let seq_a = [3u32, 4, 5, 6, 20];
        let seq_b = [9u32, 1, 31];
        let out_map: Vec<(u32, u32)> = seq_a
            .iter()
            .chain(&seq_b)
            .zip(0u32..)
            .map(|(&c, s)| (c, s))
            .collect();
        let saved: Vec<Vec<u8>> = out_map.iter().map(|&(c, _)| block(&cache, c)).collect();
        swap.swap_out(&cache, &out_map).unwrap();
        for (i, &(_, s)) in out_map.iter().enumerate() {
            assert_eq!(
                swap.storage().block_bytes(s as usize).unwrap(),
                &saved[i][..]
            );
        }
        // The device blocks are reused by someone else meanwhile.
        SmallRng::seed_from_u64(2).fill(cache.as_bytes_mut());
        let reused: Vec<Vec<u8>> = (0..32).map(|b| block(&cache, b)).collect();
        // Swap back in, to different cache blocks.
        let in_map: Vec<(u32, u32)> = (0..out_map.len() as u32).map(|s| (s, 10 + s)).collect();
        swap.swap_in(&mut cache, &in_map).unwrap();
        for (i, &(_, d)) in in_map.iter().enumerate() {
            assert_eq!(block(&cache, d), saved[i], "{dt}: block {d}");
        }
        for b in (0..10).chain(18..32) {
            assert_eq!(
                block(&cache, b),
                reused[b as usize],
                "{dt}: bystander block {b} changed"
            );
        }
    }
}

#[test]
fn bad_mappings_and_shapes_copy_nothing() {
    let cfg = KvCacheConfig::new(2, 2, 64, 8, 16, KvDtype::F16).unwrap();
    let mut cache = random_cache(cfg, 3);
    let mut swap = SwapSpace::new(&cfg, 4).unwrap();
    let before = swap.storage().as_bytes().to_vec();
    assert_eq!(
        swap.swap_out(&cache, &[(0, 0), (16, 1)]),
        Err(KvError::BlockOutOfRange {
            block: 16,
            num_blocks: 16
        })
    );
    assert_eq!(
        swap.swap_out(&cache, &[(0, 0), (1, 4)]),
        Err(KvError::BlockOutOfRange {
            block: 4,
            num_blocks: 4
        })
    );
    assert_eq!(
        swap.swap_out(&cache, &[(0, 2), (1, 2)]),
        Err(KvError::DuplicateDestination { block: 2 })
    );
    assert_eq!(swap.storage().as_bytes(), &before[..]);
    let cache_before = cache.as_bytes().to_vec();
    assert_eq!(
        swap.swap_in(&mut cache, &[(4, 0)]),
        Err(KvError::BlockOutOfRange {
            block: 4,
            num_blocks: 4
        })
    );
    assert_eq!(cache.as_bytes(), &cache_before[..]);
    // Other block shape: refused.
    let other = KvCacheConfig::new(2, 2, 64, 16, 16, KvDtype::F16).unwrap();
    let other_cache = HostKvCache::new(other).unwrap();
    assert_eq!(
        swap.swap_out(&other_cache, &[(0, 0)]),
        Err(KvError::GeometryMismatch)
    );
    let bf = KvCacheConfig::new(2, 2, 64, 8, 16, KvDtype::Bf16).unwrap();
    let mut bf_cache = HostKvCache::new(bf).unwrap();
    assert_eq!(
        swap.swap_in(&mut bf_cache, &[(0, 0)]),
        Err(KvError::GeometryMismatch)
    );
    assert!(matches!(
        SwapSpace::new(&cfg, 0),
        Err(KvError::ZeroDimension { .. })
    ));
    // Empty mappings are no-ops.
    swap.swap_out(&cache, &[]).unwrap();
    swap.swap_in(&mut cache, &[]).unwrap();
}

/// A host cache whose pages are wider than its blocks (`with_page_stride`): block copies move
/// every block of a consecutive run, swaps copy block by block between the padded cache and the
/// dense swap space, and `block_bytes` reads each page's leading `bytes_per_block` bytes. Every
/// other page (padding included) is left alone.
#[test]
fn padded_cache_copies_and_swaps_whole_blocks() {
    let dense = KvCacheConfig::new(2, 1, 8, 4, 16, KvDtype::F32).unwrap();
    let bpb = dense.bytes_per_block();
    let page = bpb + 128;
    let cfg = dense.with_page_stride(page).unwrap();
    assert_eq!(cfg.page_bytes(), page);
    let mut cache = random_cache(cfg, 7);
    let raw = |c: &HostKvCache, b: u32| {
        let at = b as usize * page;
        c.as_bytes()[at..at + bpb].to_vec()
    };
    for b in 0..16u32 {
        assert_eq!(block(&cache, b), raw(&cache, b), "block_bytes of page {b}");
    }
    // Copy-on-write copies: a run of three, then a single.
    let before = cache.as_bytes().to_vec();
    let pairs = [(0u32, 8u32), (1, 9), (2, 10), (5, 3)];
    cache.copy_blocks(&pairs).unwrap();
    for b in 0..16u32 {
        let src = pairs.iter().find(|p| p.1 == b).map_or(b, |p| p.0);
        let at = src as usize * page;
        assert_eq!(raw(&cache, b), &before[at..at + bpb], "copy into page {b}");
    }
    // Swap a run and a single out, scramble the cache, swap them into other pages.
    let mut swap = SwapSpace::new(&cfg, 4).unwrap();
    let out_map = [(3u32, 0u32), (4, 1), (5, 2), (11, 3)];
    let saved: Vec<Vec<u8>> = out_map.iter().map(|&(c, _)| raw(&cache, c)).collect();
    swap.swap_out(&cache, &out_map).unwrap();
    for (i, &(_, s)) in out_map.iter().enumerate() {
        assert_eq!(
            swap.storage().block_bytes(s as usize).unwrap(),
            &saved[i][..]
        );
    }
    SmallRng::seed_from_u64(8).fill(cache.as_bytes_mut());
    let scrambled = cache.as_bytes().to_vec();
    let in_map = [(0u32, 12u32), (1, 13), (2, 14), (3, 1)];
    swap.swap_in(&mut cache, &in_map).unwrap();
    let mut expect = scrambled;
    for (i, &(_, d)) in in_map.iter().enumerate() {
        let at = d as usize * page;
        expect[at..at + bpb].copy_from_slice(&saved[i]);
    }
    assert!(
        cache.as_bytes() == &expect[..],
        "swap-in wrote outside its blocks"
    );
}

proptest! {
    /// Random swap sets: out then in (to a random permutation of free blocks) restores every
    /// swapped block exactly and leaves every other block alone; the mapping check agrees with
    /// a set-based model (short lists take the quadratic path, long ones the sorted one).
    #[test]
    fn random_swap_sets_round_trip(
        seed in any::<u64>(),
        picks in proptest::collection::vec(0u32..48, 1..40),
    ) {
        let cfg = KvCacheConfig::new(2, 1, 8, 4, 48, KvDtype::Bf16).unwrap();
        let mut cache = random_cache(cfg, seed);
        let mut src: Vec<u32> = picks.clone();
        src.sort_unstable();
        src.dedup();
        let mut swap = SwapSpace::new(&cfg, src.len()).unwrap();
        let out_map: Vec<(u32, u32)> = src.iter().zip(0u32..).map(|(&c, s)| (c, s)).collect();
        let saved: Vec<Vec<u8>> = src.iter().map(|&b| block(&cache, b)).collect();
        swap.swap_out(&cache, &out_map).unwrap();
        let mut rng = SmallRng::seed_from_u64(seed ^ 0xabc);
        rng.fill(cache.as_bytes_mut());
        let snapshot: Vec<Vec<u8>> = (0..48).map(|b| block(&cache, b)).collect();
        let mut dst: Vec<u32> = (0..48).collect();
        for i in (1..dst.len()).rev() {
            dst.swap(i, rng.gen_range(0..=i));
        }
        dst.truncate(src.len());
        let in_map: Vec<(u32, u32)> = dst.iter().zip(0u32..).map(|(&d, s)| (s, d)).collect();
        swap.swap_in(&mut cache, &in_map).unwrap();
        for b in 0..48u32 {
            match dst.iter().position(|&d| d == b) {
                Some(i) => prop_assert_eq!(block(&cache, b), saved[i].clone()),
                None => prop_assert_eq!(block(&cache, b), snapshot[b as usize].clone()),
            }
        }
    }

    #[test]
    fn mapping_check_matches_set_model(
        pairs in proptest::collection::vec((0u32..70, 0u32..70), 0..60),
        same in any::<bool>(),
    ) {
        let r = check_block_mapping(&pairs, 64, 64, same);
        let oob = pairs.iter().any(|&(s, d)| s >= 64 || d >= 64);
        let mut dsts: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        dsts.sort_unstable();
        let dup = dsts.windows(2).any(|w| w[0] == w[1]);
        let overlap = same && pairs.iter().any(|&(s, _)| dsts.binary_search(&s).is_ok());
        prop_assert_eq!(r.is_ok(), !(oob || dup || overlap));
        if oob {
            let is_oob = matches!(r, Err(KvError::BlockOutOfRange { .. }));
            prop_assert!(is_oob);
        }
    }
}
