//! loom model of the block table's single-writer / snapshot-reader protocol.

use loom::sync::Arc;
use loom::thread;
use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};

/// The writer appends, truncates and appends again while a reader takes snapshots: every
/// snapshot is a state the table actually had.
#[test]
fn append_truncate_against_reader() {
    loom::model(|| {
        let pool = Arc::new(
            BlockPool::new(PoolConfig {
                device: 0,
                num_blocks: 3,
                max_engines: 1,
            })
            .unwrap(),
        );
        let mut t = BlockTable::new(pool.clone(), EngineId(0), 2);
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
