//! Block tables: growth, truncation, copy-on-write, kernel rows, drops (no leak), and a writer
//! racing readers that must only ever see prefixes of the writer's history.

use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};
use pagedkv::PoolError;
use std::sync::Arc;

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

#[test]
fn grow_write_row_truncate_drop() {
    let p = pool(16);
    let mut scratch = Vec::new();
    let mut t = BlockTable::new(p.clone(), EngineId(1), 8);
    t.grow(3, &mut scratch).unwrap();
    t.grow(2, &mut scratch).unwrap();
    assert_eq!(t.len(), 5);
    assert_eq!(p.free_count(), 11);
    assert_eq!(p.held(EngineId(1)), 5);
    let mut rows = [0i32; 2 * 8];
    t.write_row(&mut rows[8..], -1).unwrap();
    let ids: Vec<i32> = (0..5).map(|i| t.get(i).unwrap().index() as i32).collect();
    assert_eq!(&rows[8..13], &ids[..]);
    assert_eq!(&rows[13..16], &[-1, -1, -1]);
    assert_eq!(&rows[..8], &[0; 8], "other rows untouched");
    assert_eq!(
        t.write_row(&mut rows[..4], -1),
        Err(PoolError::RowTooShort { needed: 5, row: 4 })
    );
    // Over capacity: refused, nothing allocated.
    assert_eq!(
        t.grow(4, &mut scratch),
        Err(PoolError::TableFull { capacity: 8 })
    );
    assert_eq!(p.free_count(), 11);
    assert_eq!(t.truncate(2), 3);
    assert_eq!(p.free_count(), 14);
    drop(t);
    assert_eq!(p.free_count(), 16);
    assert_eq!(p.held(EngineId(1)), 0);
}

#[test]
fn out_of_blocks_leaves_table_and_pool_unchanged() {
    let p = pool(4);
    let mut scratch = Vec::new();
    let mut t = BlockTable::new(p.clone(), EngineId(0), 8);
    t.grow(3, &mut scratch).unwrap();
    assert!(matches!(
        t.grow(2, &mut scratch),
        Err(PoolError::OutOfBlocks {
            requested: 2,
            free: 1
        })
    ));
    assert_eq!(t.len(), 3);
    assert_eq!(p.free_count(), 1);
}

#[test]
fn fork_shares_and_copy_on_write_replaces() {
    let p = pool(8);
    let mut scratch = Vec::new();
    let mut a = BlockTable::new(p.clone(), EngineId(0), 4);
    a.grow(2, &mut scratch).unwrap();
    let mut b = a.fork().unwrap();
    assert_eq!(p.free_count(), 6, "a fork allocates nothing");
    assert!(b.is_shared(1).unwrap());
    // Copy-on-write of b's last block.
    let fresh = p.alloc(EngineId(0)).unwrap();
    let old = b.replace(1, fresh).unwrap();
    assert_eq!(old, a.get(1).unwrap());
    assert!(!a.is_shared(1).unwrap());
    assert!(a.is_shared(0).unwrap());
    drop(a);
    assert_eq!(p.free_count(), 6);
    drop(b);
    assert_eq!(p.free_count(), 8);
}

#[test]
fn push_refuses_when_full_and_caller_keeps_the_reference() {
    let p = pool(4);
    let mut t = BlockTable::new(p.clone(), EngineId(0), 1);
    t.push(p.alloc(EngineId(0)).unwrap()).unwrap();
    let extra = p.alloc(EngineId(0)).unwrap();
    assert_eq!(t.push(extra), Err(PoolError::TableFull { capacity: 1 }));
    assert_eq!(p.ref_count(extra), Ok(1));
    p.free(extra).unwrap();
}

#[test]
fn readers_see_only_prefixes_of_the_writer_history() {
    // The writer appends ids in a known order and periodically truncates; every snapshot a
    // reader takes must equal some state the table actually had: a prefix of the append log
    // since the last truncation.
    let p = pool(64);
    let mut t = BlockTable::new(p.clone(), EngineId(0), 64);
    let reader = t.reader();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let taken = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let checker = {
        let (stop, reader, taken) = (stop.clone(), reader.clone(), taken.clone());
        std::thread::spawn(move || {
            let mut snap: Vec<BlockId> = Vec::new();
            let mut checked = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                reader.snapshot_into(&mut snap);
                // Ids in one snapshot are distinct blocks (no block twice in a table).
                let mut idx: Vec<u32> = snap.iter().map(|b| b.index()).collect();
                idx.sort_unstable();
                idx.dedup();
                assert_eq!(idx.len(), snap.len(), "snapshot mixed two table states");
                checked += 1;
                taken.store(checked, std::sync::atomic::Ordering::Relaxed);
            }
            checked
        })
    };
    let mut scratch = Vec::new();
    // Run until the reader has overlapped a good stretch of writes (the machine may be busy).
    let mut round = 0u32;
    while round < 20_000 || taken.load(std::sync::atomic::Ordering::Relaxed) < 1_000 {
        round = round.wrapping_add(1);
        let target = 1 + round % 63;
        if t.len() >= target {
            t.truncate(round % 7);
        } else {
            t.grow(1, &mut scratch).unwrap();
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(checker.join().unwrap() > 0);
    drop(t);
    assert_eq!(p.free_count(), 64);
}
