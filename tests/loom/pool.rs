//! loom models of the block pool's Treiber stack and reference counts.

use loom::sync::Arc;
use loom::thread;
use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::error::PoolError;

fn pool(n: u32) -> Arc<BlockPool> {
    Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: n,
            // Engines 0 and 1 have a magazine under loom, engine 2 has none.
            max_engines: 3,
        })
        .unwrap(),
    )
}

/// Two threads allocate and free concurrently: no block is handed out twice while held, and
/// none is lost.
#[test]
fn concurrent_alloc_free() {
    crate::model(|| {
        let p = pool(2);
        let handles: Vec<_> = (0..2u16)
            .map(|e| {
                let p = p.clone();
                thread::spawn(move || {
                    let a = p.alloc(EngineId(e)).unwrap();
                    let idx = a.index();
                    p.free(a).unwrap();
                    let b = p.alloc(EngineId(e)).unwrap();
                    (idx, b)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // Both second allocations are held at the end: they must be distinct blocks.
        assert_ne!(results[0].1.index(), results[1].1.index());
        assert_eq!(p.free_count(), 0);
        for (_, b) in results {
            p.free(b).unwrap();
        }
        assert_eq!(p.free_count(), 2);
        assert_eq!(p.stats().held, vec![0, 0, 0]);
    });
}

/// A thread takes two blocks with one `alloc_n` while another frees two: the grab is all or
/// nothing, and the pool ends consistent either way.
#[test]
fn alloc_n_against_free_n() {
    crate::model(|| {
        let p = pool(3);
        let mut held = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut held).unwrap();
        // The grab on the spawned thread: the other way round loom ran one interleaving.
        let grab = {
            let p = p.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                let r = p.alloc_n(EngineId(1), 2, &mut got);
                (r, got)
            })
        };
        assert_eq!(p.free_n(&held), Ok(2));
        let (r, got) = grab.join().unwrap();
        match r {
            Ok(()) => {
                assert_eq!(got.len(), 2);
                assert_ne!(got[0].index(), got[1].index());
                assert_eq!(p.free_count(), 1);
                assert_eq!(p.held(EngineId(1)), 2);
                p.free_n(&got).unwrap();
            }
            Err(_) => {
                assert!(got.is_empty());
                assert_eq!(p.held(EngineId(1)), 0);
            }
        }
        assert_eq!(p.free_count(), 3);
    });
}

/// Two holders of a shared block release it concurrently: it returns to the free list exactly
/// once.
#[test]
fn share_release_race_to_zero() {
    crate::model(|| {
        let p = pool(1);
        let a = p.alloc(EngineId(0)).unwrap();
        p.share(a).unwrap();
        let other = {
            let p = p.clone();
            thread::spawn(move || p.release(a).unwrap())
        };
        let mine = p.release(a).unwrap();
        let theirs = other.join().unwrap();
        assert!(mine ^ theirs, "exactly one release is the last");
        assert_eq!(p.free_count(), 1);
        assert_eq!(p.held(EngineId(0)), 0);
        assert!(p.release(a).is_err(), "a third release is a double free");
    });
}

/// A share racing the last release: either the share wins (the block stays allocated with one
/// reference) or it is refused (the block is free); never both.
#[test]
fn share_racing_last_release() {
    crate::model(|| {
        let p = pool(1);
        let a = p.alloc(EngineId(0)).unwrap();
        let sharer = {
            let p = p.clone();
            thread::spawn(move || p.share(a).is_ok())
        };
        let freed = p.release(a).unwrap();
        let shared = sharer.join().unwrap();
        assert!(
            shared ^ freed,
            "the share either kept the block alive or was refused"
        );
        if shared {
            assert_eq!(p.ref_count(a), Ok(1));
            assert!(p.release(a).unwrap());
        }
        assert_eq!(p.free_count(), 1);
    });
}

/// Holds every block still free, checks no block is held twice across `held` and the drained
/// ones, and that the pool's counts agree; then frees everything.
fn drain_and_check(p: &BlockPool, held: &[BlockId]) {
    let mut all: Vec<BlockId> = held.to_vec();
    let free_before = p.free_count();
    while let Ok(id) = p.alloc(EngineId(1)) {
        all.push(id);
        assert!(
            all.len() <= p.total() as usize,
            "more blocks handed out than exist"
        );
    }
    assert_eq!(
        all.len() - held.len(),
        free_before as usize,
        "free count disagrees with the free list"
    );
    let mut idx: Vec<u32> = all.iter().map(|b| b.index()).collect();
    idx.sort_unstable();
    idx.dedup();
    assert_eq!(idx.len(), all.len(), "a block handed out twice: {all:?}");
    assert_eq!(all.len(), p.total() as usize, "a block lost");
    p.free_n(&all).unwrap();
    assert_eq!(p.free_count(), p.total());
}

/// The ABA adversary: one thread pops while another pops two blocks and pushes the first back,
/// so the popper's CAS sees the same top index it loaded, with a different `next` below it.
/// Only the head's tag (2 bits under loom: three updates do not wrap it) tells the popper its
/// `next` is stale; without the increment the popper installs a block the other thread holds
/// as the new top, and that block is handed out twice.
#[test]
fn pop_pop_push_aba() {
    crate::model(|| {
        let p = pool(3);
        let popper = {
            let p = p.clone();
            thread::spawn(move || p.alloc(EngineId(0)).unwrap())
        };
        let a = p.alloc(EngineId(1)).unwrap();
        let b = p.alloc(EngineId(1)).unwrap();
        p.free(a).unwrap();
        let c = popper.join().unwrap();
        drain_and_check(&p, &[b, c]);
    });
}

/// The same adversary against `alloc_n`'s chain walk: the walk read from a top that was popped
/// and pushed back meanwhile must be discarded by the CAS.
#[test]
fn alloc_n_pop_pop_push_aba() {
    crate::model(|| {
        let p = pool(4);
        let taker = {
            let p = p.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                p.alloc_n(EngineId(0), 2, &mut got).unwrap();
                got
            })
        };
        let a = p.alloc(EngineId(1)).unwrap();
        let b = p.alloc(EngineId(1)).unwrap();
        p.free(a).unwrap();
        let mut held = taker.join().unwrap();
        held.push(b);
        drain_and_check(&p, &held);
    });
}

/// Two `alloc_n` race a `free_n`: each grab is all or nothing, no block is handed out twice,
/// and the counts add up whichever order the three take.
#[test]
fn two_alloc_n_racing_free_n() {
    crate::model(|| {
        let p = pool(4);
        let mut held = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut held).unwrap();
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let p = p.clone();
                thread::spawn(move || {
                    let mut got = Vec::new();
                    match p.alloc_n(EngineId(1), 2, &mut got) {
                        Ok(()) => assert_eq!(got.len(), 2),
                        Err(_) => assert!(got.is_empty(), "a refused grab appended ids"),
                    }
                    got
                })
            })
            .collect();
        assert_eq!(p.free_n(&held), Ok(2));
        let mut got: Vec<BlockId> = Vec::new();
        for t in takers {
            got.extend(t.join().unwrap());
        }
        assert!(!got.is_empty(), "two free blocks were there from the start");
        assert_eq!(p.held(EngineId(1)), got.len() as u32);
        assert_eq!(p.free_count(), 4 - got.len() as u32);
        drain_and_check(&p, &got);
    });
}

/// Issue 17 item 1: `free_n` of two blocks while another thread releases the second (a double
/// free). Exactly one of the two releases of that block succeeds, and no block is lost
/// whichever way the race goes. The batch has the fast path's shape, so this model checks the
/// fast path's undo; the general path's release meeting the race (the first block already at
/// zero references) is `free_n_general_path_racing_a_double_release`.
#[test]
fn free_n_racing_a_double_release() {
    crate::model(|| {
        let p = pool(2);
        let mut ids = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut ids).unwrap();
        let raced = ids[1];
        let rogue = {
            let p = p.clone();
            thread::spawn(move || p.release(raced).is_ok())
        };
        let mine = match p.free_n(&ids) {
            Ok(n) => {
                assert_eq!(n, 2);
                true
            }
            Err(PoolError::NotAllocated { id }) | Err(PoolError::StaleBlock { id, .. }) => {
                assert_eq!(id, raced);
                assert_eq!(
                    p.free_n(&ids[..1]),
                    Ok(1),
                    "the first block must still be held"
                );
                false
            }
            Err(PoolError::ConcurrentDoubleFree { id, freed }) => {
                assert_eq!((id, freed), (raced, 1));
                false
            }
            Err(e) => panic!("unexpected {e}"),
        };
        let theirs = rogue.join().unwrap();
        assert!(mine ^ theirs, "exactly one release of the block succeeds");
        assert_eq!(p.free_count(), 2, "a block is neither free nor allocated");
        assert_eq!(p.held(EngineId(0)), 0);
        drain_and_check(&p, &[]);
    });
}

/// Engine 0 (the one engine with a magazine under loom) frees two blocks into its magazine
/// while another thread allocates for engine 0: the pop races the push (and its busy bit);
/// whatever the interleaving, no block is handed out twice and none is lost.
#[test]
fn magazine_pop_racing_push() {
    crate::model(|| {
        let p = pool(3);
        let mut held = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut held).unwrap();
        // The pop on the spawned thread: the other way round loom ran one interleaving.
        let popper = {
            let p = p.clone();
            thread::spawn(move || p.alloc(EngineId(0)).unwrap())
        };
        assert_eq!(p.free_n(&held), Ok(2));
        let got = popper.join().unwrap();
        assert_eq!(p.held(EngineId(0)), 1);
        assert_eq!(p.free_count(), 2);
        drain_and_check(&p, &[got]);
    });
}

/// The magazine's ABA adversary: a popper reads the top two entries' word while the main
/// thread pops both and pushes one back, so the count the popper read reappears; the push's
/// tag bump must fail the popper's CAS, or it would hand out a block the main thread holds.
#[test]
fn magazine_pop_pop_push_aba() {
    crate::model(|| {
        let p = pool(2);
        let mut two = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut two).unwrap();
        assert_eq!(p.free_n(&two), Ok(2));
        let popper = {
            let p = p.clone();
            thread::spawn(move || p.alloc(EngineId(0)).ok())
        };
        let a = p.alloc(EngineId(0)).ok();
        let b = p.alloc(EngineId(0)).ok();
        if let Some(a) = a {
            // free_n: a batch goes to the magazine (a single release goes to the shared stack).
            assert_eq!(p.free_n(&[a]), Ok(1));
        }
        let c = popper.join().unwrap();
        let held: Vec<BlockId> = [b, c].into_iter().flatten().collect();
        drain_and_check(&p, &held);
    });
}

/// Blocks parked in engine 0's magazine are free for every engine: engine 2 (no magazine)
/// asks for both while engine 0's thread returns them. A refusal must be made on a snapshot
/// that really held fewer than two free blocks; once the free is done, the request succeeds.
#[test]
fn alloc_n_reaches_blocks_in_another_magazine() {
    crate::model(|| {
        let p = pool(2);
        let mut held = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut held).unwrap();
        // The request on the spawned thread: the other way round loom ran one interleaving.
        let request = {
            let p = p.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                let first = p.alloc_n(EngineId(2), 2, &mut got);
                (first, got)
            })
        };
        assert_eq!(p.free_n(&held), Ok(2));
        let (first, mut got) = request.join().unwrap();
        match first {
            Ok(()) => assert_eq!(got.len(), 2),
            Err(PoolError::OutOfBlocks { requested: 2, free }) => {
                assert!(free < 2, "refused with {free} free");
                assert!(got.is_empty());
                p.alloc_n(EngineId(2), 2, &mut got).unwrap();
            }
            Err(e) => panic!("unexpected {e}"),
        }
        assert_eq!(p.free_count(), 0);
        assert_eq!(p.held(EngineId(2)), 2);
        assert_eq!(p.held(EngineId(0)), 0);
        p.free_n(&got).unwrap();
        assert_eq!(p.free_count(), 2);
    });
}

/// Two threads free a block of engine 0 each at once: both pushes target engine 0's magazine.
/// Only one may write entries at a time (the busy bit); the other goes to the shared stack.
/// Without that, both would write the entry at the same count and one block would be lost.
#[test]
fn magazine_two_pushers() {
    crate::model(|| {
        let p = pool(2);
        let mut two = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut two).unwrap();
        let (a, b) = (two[0], two[1]);
        let other = {
            let p = p.clone();
            thread::spawn(move || assert_eq!(p.free_n(&[a]), Ok(1)))
        };
        assert_eq!(p.free_n(&[b]), Ok(1));
        other.join().unwrap();
        assert_eq!(p.free_count(), 2);
        assert_eq!(p.held(EngineId(0)), 0);
        drain_and_check(&p, &[]);
    });
}

/// `free_n`'s fast path takes the first block to zero references, then finds the second shared
/// and puts the first back before the general path frees the batch; meanwhile another thread
/// releases the first block (a double free). Exactly one of the two releases of it succeeds
/// whichever way the race goes, and no block is lost or freed twice.
#[test]
fn free_n_fast_path_undo_racing_a_double_release() {
    crate::model(|| {
        let p = pool(2);
        let mut ids = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut ids).unwrap();
        let (first, second) = (ids[0], ids[1]);
        p.share(second).unwrap();
        let rogue = {
            let p = p.clone();
            thread::spawn(move || p.release(first).is_ok())
        };
        let mine = match p.free_n(&ids) {
            Ok(n) => {
                assert_eq!(n, 1, "only the first block reaches zero references");
                true
            }
            Err(PoolError::NotAllocated { id }) | Err(PoolError::StaleBlock { id, .. }) => {
                // Refused as a whole: the second block keeps both references.
                assert_eq!(id, first);
                assert_eq!(p.release(second), Ok(false));
                false
            }
            Err(PoolError::ConcurrentDoubleFree { id, freed }) => {
                assert_eq!((id, freed), (first, 0));
                false
            }
            Err(e) => panic!("unexpected {e}"),
        };
        let theirs = rogue.join().unwrap();
        assert!(
            mine ^ theirs,
            "exactly one release of the first block succeeds"
        );
        assert_eq!(p.release(second), Ok(true));
        assert_eq!(p.free_count(), 2, "a block is neither free nor allocated");
        assert_eq!(p.held(EngineId(0)), 0);
        drain_and_check(&p, &[]);
    });
}

/// `held` racing a flush of the engine's magazine (another engine's allocation moving the
/// parked blocks to the shared stack): engine 0 owns one block throughout, so `held` must
/// read at least 1 (the flushed blocks may count as held while they move: 3).
#[test]
fn held_racing_a_magazine_flush() {
    crate::model(|| {
        let p = pool(3);
        let mut ids = Vec::new();
        p.alloc_n(EngineId(0), 3, &mut ids).unwrap();
        assert_eq!(p.free_n(&ids[1..]), Ok(2));
        assert_eq!(p.held(EngineId(0)), 1);
        let other = {
            let p = p.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                p.alloc_n(EngineId(1), 2, &mut got).unwrap();
                got
            })
        };
        let held = p.held(EngineId(0));
        assert!(
            held == 1 || held == 3,
            "engine 0 holds 1 block, held read {held}"
        );
        let got = other.join().unwrap();
        assert_eq!(p.held(EngineId(0)), 1);
        let mut all = got;
        all.push(ids[0]);
        drain_and_check(&p, &all);
    });
}

/// `free_count` racing blocks that go round through engine 0's magazine and back to the shared
/// stack at other depths: the count it returns must be one the pool had (3, or 1 while a grab
/// or a flush has blocks in hand, or 0 at the end), never a mix of two states (2: a block's
/// depth from after the flush with the magazine's count from before it).
#[test]
fn free_count_racing_a_round_trip_through_a_magazine() {
    crate::model(|| {
        let p = pool(3);
        // The count on the spawned thread: the other way round loom ran one interleaving.
        let counter = {
            let p = p.clone();
            thread::spawn(move || p.free_count())
        };
        let mut two = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut two).unwrap();
        // Reversed: the flush pushes them back in the other order, at other depths.
        assert_eq!(p.free_n(&[two[1], two[0]]), Ok(2));
        let mut all = Vec::new();
        p.alloc_n(EngineId(1), 3, &mut all).unwrap();
        let free = counter.join().unwrap();
        assert!(matches!(free, 0 | 1 | 3), "free_count read {free}");
        p.free_n(&all).unwrap();
        assert_eq!(p.free_count(), 3);
    });
}

/// A pop from engine 0's magazine lands between a push's claim and its final CAS, with the
/// magazine already holding a block: the pop lowers the count under the pusher, whose final
/// CAS then fails and must write its entry again at the lowered count. (`magazine_pop_racing_push`
/// starts from an empty magazine, where no pop can run during the push: a pusher that kept
/// writing at the count it claimed at passed every model, and left the popped block parked
/// while its holder used it, and the pushed block lost.)
#[test]
fn magazine_pop_during_a_push_to_a_nonempty_magazine() {
    crate::model(|| {
        let p = pool(3);
        let mut two = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut two).unwrap();
        // free_n: a batch goes to the magazine (a single release goes to the shared stack).
        assert_eq!(p.free_n(&two[..1]), Ok(1));
        let popper = {
            let p = p.clone();
            thread::spawn(move || p.alloc(EngineId(0)).unwrap())
        };
        assert_eq!(p.free_n(&two[1..]), Ok(1));
        let got = popper.join().unwrap();
        assert_eq!(p.held(EngineId(0)), 1);
        assert_eq!(p.free_count(), 2);
        drain_and_check(&p, &[got]);
    });
}

/// `free_n`'s general path meets a double free after its checks: a batch of two engines'
/// blocks (not the fast path's shape, so the fast path hands it over untouched) while another
/// thread releases the second block. If the release comes between the checks and this call's
/// release of that block, the first block has already gone to zero references: the call must
/// finish the batch (recycle the first) and report the race, not return with the first block
/// neither free nor allocated. (`free_n_racing_a_double_release` cannot reach this: its batch
/// is of one engine, so the fast path's undo absorbs every interleaving.)
#[test]
fn free_n_general_path_racing_a_double_release() {
    crate::model(|| {
        let p = pool(2);
        let first = p.alloc(EngineId(0)).unwrap();
        let raced = p.alloc(EngineId(1)).unwrap();
        let rogue = {
            let p = p.clone();
            thread::spawn(move || p.release(raced).is_ok())
        };
        let mine = match p.free_n(&[first, raced]) {
            Ok(n) => {
                assert_eq!(n, 2);
                true
            }
            Err(PoolError::NotAllocated { id }) | Err(PoolError::StaleBlock { id, .. }) => {
                // Refused by the checks, as a whole: the first block is still held.
                assert_eq!(id, raced);
                assert_eq!(
                    p.free_n(&[first]),
                    Ok(1),
                    "the first block must still be held"
                );
                false
            }
            Err(PoolError::ConcurrentDoubleFree { id, freed }) => {
                assert_eq!((id, freed), (raced, 1));
                false
            }
            Err(e) => panic!("unexpected {e}"),
        };
        let theirs = rogue.join().unwrap();
        assert!(mine ^ theirs, "exactly one release of the block succeeds");
        assert_eq!(p.free_count(), 2, "a block is neither free nor allocated");
        assert_eq!(p.stats().held, vec![0, 0, 0]);
        drain_and_check(&p, &[]);
    });
}

/// `free_count` racing a block parked in engine 0's magazine and another leaving engine 1's,
/// with the shared stack untouched: the free count goes 1, 2, 1, so the snapshot must read 1 or
/// 2. A snapshot that double-collected the head alone (and read the magazines once) could add
/// engine 0's magazine from before the park to engine 1's from after the pop: 0, a state the
/// pool never had. Needs two magazines (under loom, engines 0 and 1).
#[test]
fn free_count_racing_moves_in_two_magazines() {
    crate::model(|| {
        let p = pool(2);
        let mut parked = Vec::new();
        p.alloc_n(EngineId(1), 1, &mut parked).unwrap();
        // free_n: to engine 1's magazine.
        assert_eq!(p.free_n(&parked), Ok(1));
        let mut mine = Vec::new();
        p.alloc_n(EngineId(0), 1, &mut mine).unwrap();
        // The count on the spawned thread: the other way round loom ran one interleaving.
        let counter = {
            let p = p.clone();
            thread::spawn(move || p.free_count())
        };
        assert_eq!(p.free_n(&mine), Ok(1));
        let taken = p.alloc(EngineId(1)).unwrap();
        let free = counter.join().unwrap();
        assert!(matches!(free, 1 | 2), "free_count read {free}");
        assert_eq!(p.free_count(), 1);
        drain_and_check(&p, &[taken]);
    });
}
