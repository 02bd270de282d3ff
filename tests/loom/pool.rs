//! loom models of the block pool's Treiber stack and reference counts.

use loom::sync::Arc;
use loom::thread;
use pagedkv::block::{BlockPool, EngineId, PoolConfig};

fn pool(n: u32) -> Arc<BlockPool> {
    Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: n,
            max_engines: 2,
        })
        .unwrap(),
    )
}

/// Two threads allocate and free concurrently: no block is handed out twice while held, and
/// none is lost.
#[test]
fn concurrent_alloc_free() {
    loom::model(|| {
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
        assert_eq!(p.stats().held, vec![0, 0]);
    });
}

/// A thread takes two blocks with one `alloc_n` while another frees two: the grab is all or
/// nothing, and the pool ends consistent either way.
#[test]
fn alloc_n_against_free_n() {
    loom::model(|| {
        let p = pool(3);
        let mut held = Vec::new();
        p.alloc_n(EngineId(0), 2, &mut held).unwrap();
        let freer = {
            let p = p.clone();
            thread::spawn(move || {
                assert_eq!(p.free_n(&held), Ok(2));
            })
        };
        let mut got = Vec::new();
        let r = p.alloc_n(EngineId(1), 2, &mut got);
        freer.join().unwrap();
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
    loom::model(|| {
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
    loom::model(|| {
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
