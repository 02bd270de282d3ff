//! Block pool: smoke, error paths (state unchanged after each refusal), reference counting and
//! per-engine accounting.

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig, MAX_REFS};
use pagedkv::error::PoolError;

const E0: EngineId = EngineId(0);
const E1: EngineId = EngineId(1);

fn pool(n: u32) -> BlockPool {
    BlockPool::new(PoolConfig {
        device: 0,
        num_blocks: n,
        max_engines: 4,
    })
    .unwrap()
}

#[test]
fn fresh_pool_counts() {
    let p = pool(10);
    assert_eq!(p.total(), 10);
    assert_eq!(p.free_count(), 10);
    assert_eq!(p.stats().held, vec![0, 0, 0, 0]);
}

#[test]
fn invalid_configs_are_refused() {
    for (n, e) in [(0, 1), (1, 0), (pagedkv::block::MAX_BLOCKS + 1, 1)] {
        let r = BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: n,
            max_engines: e,
        });
        assert!(matches!(r, Err(PoolError::InvalidConfig(_))), "{n} {e}");
    }
}

#[test]
fn alloc_all_then_exhausted_then_free() {
    let p = pool(8);
    let mut ids: Vec<_> = (0..8).map(|_| p.alloc(E0).unwrap()).collect();
    let mut idx: Vec<u32> = ids.iter().map(|b| b.index()).collect();
    idx.sort_unstable();
    assert_eq!(
        idx,
        (0..8).collect::<Vec<_>>(),
        "every block handed out once"
    );
    assert_eq!(p.free_count(), 0);
    assert_eq!(
        p.alloc(E0),
        Err(PoolError::OutOfBlocks {
            requested: 1,
            free: 0
        })
    );
    assert_eq!(p.held(E0), 8);
    for id in ids.drain(..) {
        assert_eq!(p.free(id), Ok(true));
    }
    assert_eq!(p.free_count(), 8);
    assert_eq!(p.held(E0), 0);
}

#[test]
fn alloc_n_is_all_or_nothing() {
    let p = pool(10);
    let mut out = Vec::new();
    p.alloc_n(E0, 7, &mut out).unwrap();
    assert_eq!(out.len(), 7);
    let err = p.alloc_n(E1, 4, &mut out).unwrap_err();
    assert_eq!(
        err,
        PoolError::OutOfBlocks {
            requested: 4,
            free: 3
        }
    );
    assert_eq!(out.len(), 7, "nothing appended on failure");
    assert_eq!(p.free_count(), 3);
    assert_eq!(p.held(E1), 0);
    p.alloc_n(E1, 3, &mut out).unwrap();
    assert_eq!(p.free_count(), 0);
    assert_eq!((p.held(E0), p.held(E1)), (7, 3));
    let mut all: Vec<u32> = out.iter().map(|b| b.index()).collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 10);
    assert_eq!(p.free_n(&out), Ok(10));
    assert_eq!(p.free_count(), 10);
    assert_eq!(
        p.alloc_n(E0, 11, &mut out).unwrap_err(),
        PoolError::OutOfBlocks {
            requested: 11,
            free: 10
        }
    );
    p.alloc_n(E0, 0, &mut out).unwrap();
}

#[test]
fn double_free_and_never_allocated_are_refused() {
    let p = pool(4);
    let a = p.alloc(E0).unwrap();
    assert_eq!(p.free(a), Ok(true));
    assert_eq!(p.free(a), Err(PoolError::NotAllocated { id: a }));
    assert_eq!(p.free_count(), 4);
    // An id the pool never minted for a free block: generation 0, never allocated.
    let never = BlockId::from_bits(
        (u64::from(p.tag()) << 48) | 3, /* index 3, generation 0 */
    );
    assert_eq!(p.free(never), Err(PoolError::NotAllocated { id: never }));
    assert_eq!(p.free_count(), 4);
}

#[test]
fn stale_id_after_reuse_is_refused() {
    let p = pool(1);
    let a = p.alloc(E0).unwrap();
    p.free(a).unwrap();
    let b = p.alloc(E1).unwrap();
    assert_eq!(a.index(), b.index());
    assert_ne!(a, b);
    assert!(matches!(p.free(a), Err(PoolError::StaleBlock { .. })));
    assert!(matches!(p.share(a), Err(PoolError::StaleBlock { .. })));
    assert_eq!(p.ref_count(b), Ok(1), "the new holder's block is untouched");
    assert_eq!(p.held(E1), 1);
}

#[test]
fn foreign_and_out_of_range_ids_are_refused() {
    let p = pool(4);
    let q = BlockPool::new(PoolConfig {
        device: 1,
        num_blocks: 4,
        max_engines: 1,
    })
    .unwrap();
    let theirs = q.alloc(E0).unwrap();
    assert!(matches!(
        p.free(theirs),
        Err(PoolError::ForeignBlock { device: 0, .. })
    ));
    assert_eq!(q.ref_count(theirs), Ok(1));
    // Far past the end, and one past it (index == total: the boundary).
    for index in [100, 4] {
        let far = BlockId::from_bits((u64::from(p.tag()) << 48) | (1 << 24) | index);
        assert_eq!(
            p.free(far),
            Err(PoolError::OutOfRange { id: far, total: 4 })
        );
        assert_eq!(
            p.ref_count(far),
            Err(PoolError::OutOfRange { id: far, total: 4 })
        );
    }
    assert!(matches!(
        p.alloc(EngineId(4)),
        Err(PoolError::UnknownEngine { max_engines: 4, .. })
    ));
    assert_eq!(p.free_count(), 4);
}

#[test]
fn share_release_returns_block_exactly_once() {
    let p = pool(2);
    let a = p.alloc(E1).unwrap();
    p.share(a).unwrap();
    p.share(a).unwrap();
    assert_eq!(p.ref_count(a), Ok(3));
    assert_eq!(p.is_shared(a), Ok(true));
    assert_eq!(p.owner(a), Ok(E1));
    assert_eq!(p.release(a), Ok(false));
    assert_eq!(p.release(a), Ok(false));
    assert_eq!(p.is_shared(a), Ok(false));
    assert_eq!(p.held(E1), 1, "shared references do not count twice");
    assert_eq!(p.free_count(), 1);
    assert_eq!(p.release(a), Ok(true));
    assert_eq!(p.free_count(), 2);
    assert_eq!(p.held(E1), 0);
    assert!(p.release(a).is_err());
}

/// `free_n` finds repeated mentions through a filter of index bits for batches up to 64 and a
/// sorted copy beyond: blocks that share a filter bit are not mistaken for repeats, and a real
/// repeat past its reference count is refused on both paths with nothing released.
#[test]
fn free_n_repeat_checks_on_both_paths() {
    let p = pool(200);
    let mut ids = Vec::new();
    p.alloc_n(E0, 130, &mut ids).unwrap();
    assert_eq!(
        (ids[0].index(), ids[64].index(), ids[128].index()),
        (0, 64, 128)
    );
    // Indices 0, 64 and 128 share a filter bit but are different blocks.
    assert_eq!(p.free_n(&[ids[0], ids[64], ids[128]]), Ok(3));
    let mut again = Vec::new();
    p.alloc_n(E0, 3, &mut again).unwrap();
    ids[0] = again[0];
    ids[64] = again[1];
    ids[128] = again[2];
    // A repeat 63 places apart in a batch of 64: refused, nothing released.
    let mut batch: Vec<BlockId> = ids[..63].to_vec();
    batch.push(ids[0]);
    assert_eq!(
        p.free_n(&batch),
        Err(PoolError::NotAllocated { id: ids[0] })
    );
    assert_eq!(p.free_count(), 70);
    // The same past 64 ids (sorted-copy path).
    let mut long: Vec<BlockId> = ids[..100].to_vec();
    long.push(ids[99]);
    assert_eq!(
        p.free_n(&long),
        Err(PoolError::NotAllocated { id: ids[99] })
    );
    assert_eq!(p.free_count(), 70);
    // Backed by a second reference, both are fine.
    p.share(ids[0]).unwrap();
    p.share(ids[99]).unwrap();
    assert_eq!(p.free_n(&batch), Ok(63));
    assert_eq!(p.free_n(&long[63..]), Ok(37));
    assert_eq!(p.free_n(&ids[100..]), Ok(30));
    assert_eq!(p.free_count(), 200);
    assert_eq!(p.held(E0), 0);
}

#[test]
fn free_n_refuses_bad_lists_without_changing_anything() {
    let p = pool(40);
    let mut ids = Vec::new();
    p.alloc_n(E0, 3, &mut ids).unwrap();
    // Duplicate beyond the reference count: refused before any release.
    let dup = vec![ids[0], ids[1], ids[0]];
    assert_eq!(p.free_n(&dup), Err(PoolError::NotAllocated { id: ids[0] }));
    assert_eq!(p.free_count(), 37);
    // Duplicate backed by a shared reference: fine.
    p.share(ids[0]).unwrap();
    assert_eq!(p.free_n(&dup), Ok(2));
    assert_eq!(p.free_count(), 39);
    // A long list (sorted-copy path) with one stale id at the end.
    let mut many = Vec::new();
    p.alloc_n(E0, 39, &mut many).unwrap();
    many.push(ids[0]);
    assert_eq!(p.free_count(), 0);
    assert!(p.free_n(&many).is_err());
    assert_eq!(p.free_count(), 0, "refused list released nothing");
    many.pop();
    many.push(ids[2]);
    assert_eq!(p.free_n(&many), Ok(40));
    assert_eq!(p.free_count(), 40);
    assert_eq!(p.held(E0), 0);
}

#[test]
fn shared_through_arc_across_threads() {
    let p = std::sync::Arc::new(pool(64));
    let handles: Vec<_> = (0..4u16)
        .map(|t| {
            let p = std::sync::Arc::clone(&p);
            std::thread::spawn(move || {
                let mut mine = Vec::new();
                for _ in 0..1000 {
                    if let Ok(id) = p.alloc(EngineId(t)) {
                        mine.push(id);
                    }
                    if mine.len() > 8 {
                        p.free(mine.remove(0)).unwrap();
                    }
                }
                p.free_n(&mine).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(p.free_count(), 64);
    assert_eq!(p.stats().held, vec![0; 4]);
}

/// A freed block parks in its owner's magazine; allocating it again (from there) mints the next
/// generation, and the old id is stale.
#[test]
fn reuse_through_the_magazine_bumps_the_generation() {
    let p = pool(8);
    let mut ids = Vec::new();
    p.alloc_n(E0, 2, &mut ids).unwrap();
    assert_eq!(p.free_n(&ids), Ok(2));
    let again = p.alloc(E0).unwrap();
    let old = ids.iter().find(|b| b.index() == again.index()).unwrap();
    assert_eq!(again.generation(), old.generation() + 1);
    assert!(matches!(p.free(*old), Err(PoolError::StaleBlock { .. })));
    assert_eq!(p.ref_count(again), Ok(1));
    assert_eq!(p.owner(again), Ok(E0));
    assert_eq!(p.free(again), Ok(true));
    assert_eq!(p.free_count(), 8);
    assert_eq!(p.stats().held, vec![0; 4]);
}

/// Blocks parked in one engine's magazine count as free and serve every engine: another engine
/// can take the whole pool, and a request beyond it is refused with the exact free count.
#[test]
fn blocks_parked_in_a_magazine_serve_other_engines() {
    let p = pool(32);
    let mut ids = Vec::new();
    p.alloc_n(E0, 20, &mut ids).unwrap();
    assert_eq!(p.free_n(&ids), Ok(20));
    assert_eq!(p.free_count(), 32);
    let mut all = Vec::new();
    assert_eq!(
        p.alloc_n(E1, 33, &mut all),
        Err(PoolError::OutOfBlocks {
            requested: 33,
            free: 32
        })
    );
    assert!(all.is_empty());
    p.alloc_n(E1, 32, &mut all).unwrap();
    let mut idx: Vec<u32> = all.iter().map(|b| b.index()).collect();
    idx.sort_unstable();
    idx.dedup();
    assert_eq!(idx.len(), 32, "a block handed out twice");
    assert_eq!(p.free_count(), 0);
    assert_eq!(p.held(E1), 32);
    assert!(p.alloc(E0).is_err());
    assert_eq!(p.free_n(&all), Ok(32));
    assert_eq!(p.free_count(), 32);
}

/// `free_n`'s fast path (distinct blocks of one owner with one reference each) and the general
/// path agree: a batch mixing owners, a shared block, or a repeat goes the general way and is
/// still all or nothing.
#[test]
fn free_n_fast_and_general_paths_agree() {
    let p = pool(16);
    let mut a = Vec::new();
    let mut b = Vec::new();
    p.alloc_n(E0, 3, &mut a).unwrap();
    p.alloc_n(E1, 3, &mut b).unwrap();
    // A repeat of a block with one reference: refused, nothing released.
    let repeat = [a[0], a[1], a[0]];
    assert!(matches!(
        p.free_n(&repeat),
        Err(PoolError::NotAllocated { .. })
    ));
    assert_eq!(p.held(E0), 3);
    // Mixed owners and a shared block: the general path.
    p.share(a[2]).unwrap();
    let mixed = [a[0], b[0], a[2]];
    assert_eq!(p.free_n(&mixed), Ok(2));
    assert_eq!(p.ref_count(a[2]), Ok(1));
    assert_eq!((p.held(E0), p.held(E1)), (2, 2));
    // The fast path: distinct, one owner, one reference each.
    assert_eq!(p.free_n(&[a[1], a[2]]), Ok(2));
    assert_eq!(p.free_n(&b[1..]), Ok(2));
    assert_eq!(p.free_count(), 16);
    assert_eq!(p.stats().held, vec![0; 4]);
}

/// A batch that starts with one of this pool's ids and goes on with another pool's id naming
/// the same index, generation and owner is refused as foreign, and neither pool changes:
/// `free_n`'s one-pass path must check the tag of every id, not only the first one's (else it
/// frees this pool's block through the other pool's id).
#[test]
fn free_n_refuses_a_foreign_id_after_the_first() {
    let p = pool(4);
    let q = pool(4);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    p.alloc_n(E0, 2, &mut ours).unwrap();
    q.alloc_n(E0, 2, &mut theirs).unwrap();
    // Only the pool tag tells the two apart.
    assert_eq!(
        (ours[1].index(), ours[1].generation()),
        (theirs[1].index(), theirs[1].generation())
    );
    assert!(matches!(
        p.free_n(&[ours[0], theirs[1]]),
        Err(PoolError::ForeignBlock { id, .. }) if id == theirs[1]
    ));
    assert_eq!((p.ref_count(ours[0]), p.ref_count(ours[1])), (Ok(1), Ok(1)));
    assert_eq!((p.free_count(), p.held(E0)), (2, 2));
    assert_eq!(q.ref_count(theirs[1]), Ok(1));
    assert_eq!(p.free_n(&ours), Ok(2));
    assert_eq!(q.free_n(&theirs), Ok(2));
}

/// A block's reference count stops at `MAX_REFS`: the share past it is refused with the block
/// unchanged (an unchecked one would carry into the generation bits and free the block), and
/// every reference taken is still released, the last one freeing the block.
#[test]
fn share_past_max_refs_is_refused_with_the_block_unchanged() {
    let p = pool(2);
    let a = p.alloc(E0).unwrap();
    for _ in 1..MAX_REFS {
        p.share(a).unwrap();
    }
    assert_eq!(p.ref_count(a), Ok(MAX_REFS));
    assert_eq!(p.share(a), Err(PoolError::TooManyRefs { id: a }));
    assert_eq!((p.ref_count(a), p.owner(a)), (Ok(MAX_REFS), Ok(E0)));
    assert_eq!((p.free_count(), p.held(E0)), (1, 1));
    for _ in 1..MAX_REFS {
        assert_eq!(p.release(a), Ok(false));
    }
    assert_eq!(p.release(a), Ok(true));
    assert_eq!((p.free_count(), p.held(E0)), (2, 0));
}
