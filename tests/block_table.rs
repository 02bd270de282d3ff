//! Block tables: growth, truncation, copy-on-write, kernel rows, drops (no leak), and a writer
//! racing readers that must only ever see prefixes of the writer's history.

use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};
use pagedkv::PoolError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// What the writer did, recorded before each operation is published, so a reader can tell
/// whether a snapshot is a state the table actually had.
#[derive(Default)]
struct History {
    /// Per id ever put in the table: `(epoch it was written in, position, epoch it was removed
    /// in or u32::MAX)`. Ids are never reused (each allocation bumps the block's generation).
    ids: HashMap<BlockId, (u32, u32, u32)>,
    /// `base[e]`: the table's length when epoch `e` began (truncate / replace start an epoch).
    base: Vec<u32>,
}

impl History {
    /// Whether `snap` is a state the table had: every id sits at the position it was written
    /// to, all were in the table together during one epoch `e` (the latest epoch any of them
    /// was written in), and the snapshot is no shorter than the table was throughout `e`
    /// (within an epoch the table only grows, so its states are the prefixes of at least that
    /// length).
    fn check(&self, snap: &[BlockId]) -> Result<(), String> {
        let mut rows = Vec::with_capacity(snap.len());
        for (j, id) in snap.iter().enumerate() {
            let &(written, pos, removed) = self
                .ids
                .get(id)
                .ok_or_else(|| format!("{id:?} was never written to the table"))?;
            if pos as usize != j {
                return Err(format!("{id:?} was written at {pos}, seen at {j}"));
            }
            rows.push((id, written, removed));
        }
        let Some(epoch) = rows.iter().map(|r| r.1).max() else {
            return Ok(()); // the table starts empty
        };
        for (id, written, removed) in rows {
            if !(written <= epoch && epoch < removed) {
                return Err(format!(
                    "{id:?} (written in epoch {written}, removed in {removed}) was not in the \
                     table in epoch {epoch}, with the rest of the snapshot"
                ));
            }
        }
        let base = self.base[epoch as usize];
        if (snap.len() as u32) < base {
            return Err(format!(
                "{} blocks, but the table held at least {base} throughout epoch {epoch}",
                snap.len()
            ));
        }
        Ok(())
    }
}

#[test]
#[ignore = "fails intermittently on main (2 of 3 runs on 2026-11-23): a snapshot of 4 blocks during an epoch the history model says held >= 18; whether the table or the model is wrong is open (issue 17 note)"]
fn readers_see_only_prefixes_of_the_writer_history() {
    // The writer appends, truncates and replaces (copy-on-write) while a reader snapshots; each
    // snapshot must be a state the table actually had, checked against the writer's history.
    const DEADLINE: Duration = Duration::from_secs(60);
    let p = pool(64);
    let mut t = BlockTable::new(p.clone(), EngineId(0), 63);
    let reader = t.reader();
    let history = Arc::new(Mutex::new(History {
        ids: HashMap::new(),
        base: vec![0],
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let taken = Arc::new(AtomicU64::new(0));
    let checker = {
        let (stop, reader, taken, history) =
            (stop.clone(), reader.clone(), taken.clone(), history.clone());
        std::thread::spawn(move || {
            let mut snap: Vec<BlockId> = Vec::new();
            let mut checked = 0u64;
            while !stop.load(Ordering::Relaxed) {
                reader.snapshot_into(&mut snap);
                // The snapshot's Acquire load of the table state comes after the writer's
                // record of every id it can show (recorded before being published).
                if let Err(e) = history.lock().unwrap().check(&snap) {
                    panic!("snapshot {snap:?} is no state of the table: {e}");
                }
                checked += 1;
                taken.store(checked, Ordering::Relaxed);
            }
            checked
        })
    };
    let start = Instant::now();
    let mut epoch = 0u32;
    // Run until the reader has overlapped a good stretch of writes (the machine may be busy).
    let mut round = 0u32;
    while round < 20_000 || taken.load(Ordering::Relaxed) < 1_000 {
        assert!(
            start.elapsed() < DEADLINE && !checker.is_finished(),
            "after {round} writes the reader took {} snapshots (stuck, or it failed)",
            taken.load(Ordering::Relaxed)
        );
        round = round.wrapping_add(1);
        let target = 1 + round % 62;
        if t.len() >= target {
            let keep = round % 7;
            if keep < t.len() {
                epoch += 1;
                let mut h = history.lock().unwrap();
                for i in keep..t.len() {
                    h.ids.get_mut(&t.get(i).unwrap()).unwrap().2 = epoch;
                }
                h.base.push(keep);
                drop(h);
                t.truncate(keep);
            }
        } else if round % 5 == 0 && !t.is_empty() {
            let i = round % t.len();
            let fresh = p.alloc(EngineId(0)).unwrap();
            epoch += 1;
            let mut h = history.lock().unwrap();
            h.ids.get_mut(&t.get(i).unwrap()).unwrap().2 = epoch;
            h.ids.insert(fresh, (epoch, i, u32::MAX));
            h.base.push(t.len());
            drop(h);
            t.replace(i, fresh).unwrap();
        } else {
            let id = p.alloc(EngineId(0)).unwrap();
            history
                .lock()
                .unwrap()
                .ids
                .insert(id, (epoch, t.len(), u32::MAX));
            t.push(id).unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    assert!(checker.join().unwrap() > 0);
    drop(t);
    assert_eq!(p.free_count(), 64);
}
