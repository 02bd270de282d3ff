//! loom model of the block table's single-writer / snapshot-reader protocol.

use loom::sync::Arc;
use loom::thread;
use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};

/// A pool of `blocks` blocks for `engines` engines.
fn pool(blocks: u32, engines: u16) -> Arc<BlockPool> {
    Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: blocks,
            max_engines: engines,
        })
        .unwrap(),
    )
}

/// The writer appends, truncates and appends again while a reader takes snapshots: every
/// snapshot is a state the table actually had.
#[test]
fn append_truncate_against_reader() {
    crate::model(|| {
        let pool = pool(3, 1);
        let mut t = BlockTable::new(pool.clone(), EngineId(0), 2).unwrap();
        let reader = t.reader();
        let a = pool.alloc(EngineId(0)).unwrap();
        let b = pool.alloc(EngineId(0)).unwrap();
        let c = pool.alloc(EngineId(0)).unwrap();
        let r = thread::spawn(move || {
            let mut snap: Vec<BlockId> = Vec::new();
            reader.snapshot_into(&mut snap);
            snap
        });
        t.push(a).unwrap();
        t.push(b).unwrap();
        t.truncate(1);
        t.push(c).unwrap();
        let snap = r.join().unwrap();
        let valid: [&[BlockId]; 5] = [&[], &[a], &[a, b], &[a], &[a, c]];
        assert!(
            valid.contains(&snap.as_slice()),
            "snapshot {snap:?} is no state of the table"
        );
        drop(t);
        assert_eq!(pool.free_count(), 3);
    });
}

/// Copy-on-write racing a fork: a child table replaces its shared block while the parent forks
/// again on another thread. Every reference count ends right, a reader of the child only sees
/// states the child had, and dropping every table returns every block.
#[test]
fn replace_racing_fork() {
    crate::model(|| {
        let pool = pool(2, 1);
        let mut parent = BlockTable::new(pool.clone(), EngineId(0), 1).unwrap();
        parent.push(pool.alloc(EngineId(0)).unwrap()).unwrap();
        let shared = parent.get(0).unwrap();
        let mut child = parent.fork().unwrap();
        let fresh = pool.alloc(EngineId(0)).unwrap();
        let reader = child.reader();
        let forker = thread::spawn(move || {
            let grandchild = parent.fork().unwrap();
            let mut snap: Vec<BlockId> = Vec::new();
            reader.snapshot_into(&mut snap);
            assert!(
                snap == [shared] || snap == [fresh],
                "snapshot {snap:?} is no state of the child"
            );
            (parent, grandchild)
        });
        let old = child.replace(0, fresh).unwrap();
        assert_eq!(old, shared);
        let (parent, grandchild) = forker.join().unwrap();
        assert_eq!(grandchild.get(0), Some(shared));
        assert_eq!(pool.ref_count(shared), Ok(2), "parent and grandchild");
        assert_eq!(pool.ref_count(fresh), Ok(1), "child alone");
        drop(parent);
        drop(child);
        assert_eq!(pool.free_count(), 1);
        drop(grandchild);
        assert_eq!(pool.free_count(), 2);
        assert_eq!(pool.held(EngineId(0)), 0);
    });
}

/// The state the stress test's first history model refused (issue 17): a replace inside the
/// table, then a truncate that keeps the replaced block, then an append, against a reader.
/// The 1-block state after the truncate holds only an id written before it; every snapshot
/// is one of the four states the writer passed through.
#[test]
fn replace_then_truncate_against_reader() {
    crate::model(|| {
        let pool = pool(4, 1);
        let mut t = BlockTable::new(pool.clone(), EngineId(0), 2).unwrap();
        let a = pool.alloc(EngineId(0)).unwrap();
        let b = pool.alloc(EngineId(0)).unwrap();
        t.push(a).unwrap();
        t.push(b).unwrap();
        let fresh = pool.alloc(EngineId(0)).unwrap();
        let c = pool.alloc(EngineId(0)).unwrap();
        let reader = t.reader();
        let r = thread::spawn(move || {
            let mut snap: Vec<BlockId> = Vec::new();
            reader.snapshot_into(&mut snap);
            snap
        });
        t.replace(0, fresh).unwrap();
        t.truncate(1);
        t.push(c).unwrap();
        let snap = r.join().unwrap();
        let valid: [&[BlockId]; 4] = [&[a, b], &[fresh, b], &[fresh], &[fresh, c]];
        assert!(
            valid.contains(&snap.as_slice()),
            "snapshot {snap:?} is no state of the table"
        );
        drop(t);
        assert_eq!(pool.free_count(), 4);
    });
}

/// A replace right after an append, against a reader that loaded the length before the
/// append: the reader must not pair the old length with the replaced block (`[fresh]` was never
/// a state). Fails if `replace` stores the slot without starting a new epoch.
#[test]
fn append_then_replace_against_reader() {
    crate::model(|| {
        let pool = pool(3, 1);
        let mut t = BlockTable::new(pool.clone(), EngineId(0), 2).unwrap();
        let a = pool.alloc(EngineId(0)).unwrap();
        t.push(a).unwrap();
        let b = pool.alloc(EngineId(0)).unwrap();
        let fresh = pool.alloc(EngineId(0)).unwrap();
        let reader = t.reader();
        let r = thread::spawn(move || {
            let mut snap: Vec<BlockId> = Vec::new();
            reader.snapshot_into(&mut snap);
            snap
        });
        t.push(b).unwrap();
        t.replace(0, fresh).unwrap();
        let snap = r.join().unwrap();
        let valid: [&[BlockId]; 3] = [&[a], &[a, b], &[fresh, b]];
        assert!(
            valid.contains(&snap.as_slice()),
            "snapshot {snap:?} is no state of the table"
        );
        drop(t);
        assert_eq!(pool.free_count(), 3);
    });
}

/// Every block still free taken at once by engine 1, checked distinct from `held` and equal to
/// the free count; then everything freed.
fn drain_all(pool: &BlockPool, held: &[BlockId]) {
    let free = pool.free_count();
    let mut all = Vec::new();
    pool.alloc_n(EngineId(1), free, &mut all).unwrap();
    all.extend_from_slice(held);
    let mut idx: Vec<u32> = all.iter().map(|b| b.index()).collect();
    idx.sort_unstable();
    idx.dedup();
    assert_eq!(
        idx.len(),
        pool.total() as usize,
        "a block lost or held twice: {all:?}"
    );
    pool.free_n(&all).unwrap();
    assert_eq!(pool.free_count(), pool.total());
    assert_eq!(pool.stats().held, vec![0, 0]);
}

/// A table of engine 0 clears (its pages go to engine 0's magazine through `free_n`) while
/// engine 1 asks for two pages, more than the shared stack holds: a refusal is made on an
/// instant with fewer than two free, and no page is lost or handed out twice.
#[test]
fn clear_racing_another_engines_alloc_n() {
    crate::model(|| {
        let pool = pool(3, 2);
        let mut t = BlockTable::new(pool.clone(), EngineId(0), 2).unwrap();
        let mut scratch = Vec::new();
        t.grow(2, &mut scratch).unwrap();
        let other = {
            let pool = pool.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                let r = pool.alloc_n(EngineId(1), 2, &mut got);
                (r, got)
            })
        };
        assert_eq!(t.clear(), 2);
        let (r, mut got) = other.join().unwrap();
        match r {
            Ok(()) => assert_eq!(got.len(), 2),
            Err(pagedkv::error::PoolError::OutOfBlocks { requested: 2, free }) => {
                assert!(free < 2, "refused with {free} free");
                assert!(got.is_empty());
                pool.alloc_n(EngineId(1), 2, &mut got).unwrap();
            }
            Err(e) => panic!("unexpected {e}"),
        }
        assert_eq!(pool.held(EngineId(0)), 0);
        assert_eq!(pool.held(EngineId(1)), 2);
        assert_eq!(pool.free_count(), 1);
        drain_all(&pool, &got);
    });
}

/// A table of engine 1 holding a page of engine 0 (shared) and one of its own truncates while
/// engine 0's thread releases its reference to the shared page and allocates: the batch mixes
/// owners and a page whose count another thread changes. Every page ends free or held once.
#[test]
fn mixed_owner_truncate_racing_release_and_alloc() {
    crate::model(|| {
        let pool = pool(3, 2);
        let shared = pool.alloc(EngineId(0)).unwrap();
        pool.share(shared).unwrap();
        let own = pool.alloc(EngineId(1)).unwrap();
        let mut t = BlockTable::new(pool.clone(), EngineId(1), 2).unwrap();
        t.push(shared).unwrap();
        t.push(own).unwrap();
        let other = {
            let pool = pool.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                pool.free_n(&[shared]).unwrap();
                let _ = pool.alloc_n(EngineId(0), 2, &mut got);
                got
            })
        };
        t.clear();
        let got = other.join().unwrap();
        assert_eq!(pool.held(EngineId(0)), got.len() as u32);
        assert_eq!(pool.held(EngineId(1)), 0);
        drain_all(&pool, &got);
    });
}
