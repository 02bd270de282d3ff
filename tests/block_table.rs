//! Block tables: growth, truncation, copy-on-write, kernel rows, drops (no leak), and a writer
//! racing readers that must only ever see prefixes of the writer's history.

use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};
use pagedkv::error::PoolError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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
    let mut t = BlockTable::new(p.clone(), EngineId(1), 8).unwrap();
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
    let p = pool(8);
    let mut scratch = Vec::new();
    let held: Vec<_> = (0..4).map(|_| p.alloc(EngineId(1)).unwrap()).collect();
    let mut t = BlockTable::new(p.clone(), EngineId(0), 8).unwrap();
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
    for id in held {
        p.free(id).unwrap();
    }
}

#[test]
fn fork_shares_and_copy_on_write_replaces() {
    let p = pool(8);
    let mut scratch = Vec::new();
    let mut a = BlockTable::new(p.clone(), EngineId(0), 4).unwrap();
    a.grow(2, &mut scratch).unwrap();
    let mut b = a.fork().unwrap();
    assert_eq!(p.free_count(), 6, "a fork allocates nothing");
    assert!(b.is_shared(1).unwrap());
    // Copy-on-write of b's last block.
    let fresh = p.alloc(EngineId(0)).unwrap();
    // Past the end: refused by what was asked (not "table full"), the caller keeps `fresh`.
    assert_eq!(
        b.replace(2, fresh),
        Err(PoolError::PastTableEnd {
            from: 2,
            end: 3,
            len: 2
        })
    );
    let mut part = [0i32; 2];
    assert_eq!(
        b.write_indices(1, &mut part),
        Err(PoolError::PastTableEnd {
            from: 1,
            end: 3,
            len: 2
        })
    );
    assert_eq!(p.ref_count(fresh), Ok(1));
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
    let mut t = BlockTable::new(p.clone(), EngineId(0), 1).unwrap();
    t.push(p.alloc(EngineId(0)).unwrap()).unwrap();
    let extra = p.alloc(EngineId(0)).unwrap();
    assert_eq!(t.push(extra), Err(PoolError::TableFull { capacity: 1 }));
    assert_eq!(p.ref_count(extra), Ok(1));
    p.free(extra).unwrap();
}

#[test]
fn a_table_larger_than_its_pool_is_refused_before_allocating_its_slots() {
    let p = pool(4);
    // u32::MAX slots would be 32 GiB: refused, typed, instead of aborting the process.
    for capacity in [5, u32::MAX] {
        match BlockTable::new(p.clone(), EngineId(0), capacity) {
            Err(e) => assert_eq!(e, PoolError::TableTooLarge { capacity, total: 4 }),
            Ok(t) => panic!("a table of {} blocks over a pool of 4", t.capacity()),
        }
    }
    // The whole pool is a valid capacity, and a fork keeps it.
    let mut t = BlockTable::new(p.clone(), EngineId(0), 4).unwrap();
    let mut scratch = Vec::new();
    t.grow(4, &mut scratch).unwrap();
    assert_eq!(t.fork().unwrap().capacity(), 4);
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
    /// to, and there is one epoch `e` in which all of them were in the table together and the
    /// table was never longer than the snapshot at the start of `e` (within an epoch the table
    /// only grows, so its states are the prefixes of at least `base[e]` blocks).
    ///
    /// `e` is any epoch from the latest one an id of the snapshot was written in up to (not
    /// including) the earliest one an id was removed in. It need not be the latest write epoch:
    /// a truncate starts an epoch without writing an id, so a replace at position 0 of 13
    /// blocks (epoch 69, base 13) followed by a truncate to 1 block (epoch 70, base 1) leaves a
    /// 1-block table whose only id was written in epoch 69. The first version of this model
    /// took `e` to be the latest write epoch and rejected that state (2 of 3 runs).
    fn check(&self, snap: &[BlockId]) -> Result<(), String> {
        let mut latest_write = 0;
        let mut first_removal = self.base.len() as u32;
        for (j, id) in snap.iter().enumerate() {
            let &(written, pos, removed) = self
                .ids
                .get(id)
                .ok_or_else(|| format!("{id:?} was never written to the table"))?;
            if pos as usize != j {
                return Err(format!("{id:?} was written at {pos}, seen at {j}"));
            }
            latest_write = latest_write.max(written);
            first_removal = first_removal.min(removed);
        }
        if snap.is_empty() {
            return Ok(()); // the table starts empty
        }
        if latest_write >= first_removal {
            return Err(format!(
                "an id written in epoch {latest_write} and one removed in epoch {first_removal} \
                 were never in the table together"
            ));
        }
        let len = snap.len() as u32;
        if (latest_write..first_removal).any(|e| self.base[e as usize] <= len) {
            return Ok(());
        }
        Err(format!(
            "{len} blocks, but the table held more at the start of each of epochs \
             {latest_write}..{first_removal} (bases {:?}), the only ones its ids shared",
            &self.base[latest_write as usize..first_removal as usize]
        ))
    }
}

/// The writer's script: appends, truncates and copy-on-write replaces, each recorded in the
/// history before it is published.
struct Writer {
    pool: Arc<BlockPool>,
    table: BlockTable,
    history: Arc<Mutex<History>>,
    epoch: u32,
}

impl Writer {
    fn new(pool: Arc<BlockPool>, capacity: u32) -> Self {
        Self {
            table: BlockTable::new(pool.clone(), EngineId(0), capacity).unwrap(),
            pool,
            history: Arc::new(Mutex::new(History {
                ids: HashMap::new(),
                base: vec![0],
            })),
            epoch: 0,
        }
    }

    /// One operation, chosen by `round`: grow towards a target of `1 + round % 62` blocks,
    /// truncate to `round % 7` once there, and every fifth growing round replace a block.
    fn step(&mut self, round: u32) {
        let t = &mut self.table;
        let target = 1 + round % 62;
        if t.len() >= target {
            let keep = round % 7;
            if keep < t.len() {
                self.epoch += 1;
                let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
                for i in keep..t.len() {
                    h.ids.get_mut(&t.get(i).unwrap()).unwrap().2 = self.epoch;
                }
                h.base.push(keep);
                drop(h);
                t.truncate(keep);
            }
        } else if round % 5 == 0 && !t.is_empty() {
            let i = round % t.len();
            let fresh = self.pool.alloc(EngineId(0)).unwrap();
            self.epoch += 1;
            let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
            h.ids.get_mut(&t.get(i).unwrap()).unwrap().2 = self.epoch;
            h.ids.insert(fresh, (self.epoch, i, u32::MAX));
            h.base.push(t.len());
            drop(h);
            t.replace(i, fresh).unwrap();
        } else {
            let id = self.pool.alloc(EngineId(0)).unwrap();
            self.history
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .ids
                .insert(id, (self.epoch, t.len(), u32::MAX));
            t.push(id).unwrap();
        }
    }
}

/// The model against the writer alone: every state the table passes through is accepted, and
/// states it never had (an old and a new generation mixed, a prefix shorter than the table
/// was, an id at the wrong position) are refused. The first version of the model fails the
/// first half (see `History::check`).
#[test]
fn history_model_accepts_exactly_the_writer_states() {
    let p = pool(64);
    let mut w = Writer::new(p.clone(), 63);
    let mut longest = 0;
    let mut snap = Vec::new();
    let reader = w.table.reader();
    let (mut torn, mut short) = (0, 0);
    let mut before_cut: Vec<BlockId> = Vec::new();
    for round in 1..=5_000 {
        let before = w.table.len();
        let old: Vec<BlockId> = (0..before).map(|i| w.table.get(i).unwrap()).collect();
        w.step(round);
        reader.snapshot_into(&mut snap);
        let h = w.history.lock().unwrap();
        if let Err(e) = h.check(&snap) {
            panic!("round {round}: the table's own state {snap:?} refused: {e}");
        }
        // A torn copy across a truncate: blocks pushed since, then one the truncate removed.
        let now = snap.len();
        if now < old.len() {
            before_cut = old.clone();
        }
        if now > 0 && now < before_cut.len() && snap[now - 1] != before_cut[now - 1] {
            let mut mixed = snap.clone();
            mixed.push(before_cut[now]);
            assert!(h.check(&mixed).is_err(), "torn {mixed:?} accepted");
            torn += 1;
        }
        // After a replace at `d`: the prefix up to the fresh block, shorter than the table
        // has been since the fresh block went in.
        if now == old.len() {
            if let Some(d) = (0..now)
                .find(|&i| snap[i] != old[i])
                .filter(|&d| d + 1 < now)
            {
                assert!(
                    h.check(&snap[..=d]).is_err(),
                    "short {:?} accepted",
                    &snap[..=d]
                );
                short += 1;
            }
        }
        if now >= 2 {
            let mut swapped = snap.clone();
            swapped.swap(0, 1);
            assert!(h.check(&swapped).is_err(), "swapped {swapped:?} accepted");
        }
        drop(h);
        longest = longest.max(now);
    }
    assert!(
        torn > 100,
        "the script truncated and regrew only {torn} times"
    );
    assert!(
        short > 100,
        "the script replaced inside the table only {short} times"
    );
    assert!(longest >= 40, "the table never grew past {longest} blocks");
    drop(w);
    assert_eq!(p.free_count(), 64);
}

#[test]
fn readers_see_only_prefixes_of_the_writer_history() {
    // The writer appends, truncates and replaces (copy-on-write) while a reader snapshots; each
    // snapshot must be a state the table actually had, checked against the writer's history.
    // The reader checks its snapshots in batches, so the history's lock rarely slows either
    // thread and the copies overlap as many writes as they can.
    // At least RUN, then until the reader has seen WANTED new states (fewer when the machine
    // is busy and the two threads rarely run at once), at most LONGEST. DEADLINE turns a
    // reader stuck in `snapshot_into` into a failure.
    const RUN: Duration = Duration::from_secs(1);
    const LONGEST: Duration = Duration::from_secs(10);
    const WANTED: u64 = 100_000;
    const DEADLINE: Duration = Duration::from_secs(60);
    const BATCH: usize = 256;
    let p = pool(64);
    let mut w = Writer::new(p.clone(), 63);
    let reader = w.table.reader();
    let history = w.history.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let taken = Arc::new(AtomicU64::new(0));
    let seen_new = Arc::new(AtomicU64::new(0));
    let checker = {
        let (stop, taken, seen_new) = (stop.clone(), taken.clone(), seen_new.clone());
        std::thread::spawn(move || {
            // `batch[..kept]`: the snapshots that differ from the one before (repeats add
            // nothing to check).
            let mut batch: Vec<Vec<BlockId>> = vec![Vec::new(); BATCH + 1];
            let (mut taken_here, mut changes) = (0u64, 0u64);
            let mut done = false;
            while !done {
                done = stop.load(Ordering::Relaxed);
                let mut kept = 1;
                for _ in 0..BATCH {
                    let (earlier, rest) = batch.split_at_mut(kept);
                    reader.snapshot_into(&mut rest[0]);
                    if rest[0] != earlier[kept - 1] {
                        kept += 1;
                    }
                }
                // Each snapshot's Acquire load of the table state came after the writer
                // recorded every id it can show (recorded before being published), and later
                // records only add epochs after it.
                let h = history.lock().unwrap();
                for snap in &batch[1..kept] {
                    if let Err(e) = h.check(snap) {
                        panic!("snapshot {snap:?} is no state of the table: {e}");
                    }
                }
                drop(h);
                batch.swap(0, kept - 1);
                changes += kept as u64 - 1;
                taken_here += BATCH as u64;
                taken.store(taken_here, Ordering::Relaxed);
                seen_new.store(changes, Ordering::Relaxed);
            }
            (taken_here, changes)
        })
    };
    let start = Instant::now();
    // Run until the reader has overlapped a good stretch of writes (the machine may be busy).
    let mut round = 0u32;
    while start.elapsed() < RUN
        || (seen_new.load(Ordering::Relaxed) < WANTED && start.elapsed() < LONGEST)
        || taken.load(Ordering::Relaxed) < 10_000
    {
        if checker.is_finished() {
            // Its panic (the refused snapshot) is the failure to report.
            std::panic::resume_unwind(checker.join().unwrap_err());
        }
        assert!(
            start.elapsed() < DEADLINE,
            "after {round} writes the reader took only {} snapshots in {DEADLINE:?}",
            taken.load(Ordering::Relaxed)
        );
        round = round.wrapping_add(1);
        w.step(round);
    }
    stop.store(true, Ordering::Relaxed);
    let (taken, changes) = checker
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));
    eprintln!("{round} writes, {taken} snapshots, {changes} of them new states (checked)");
    assert!(changes > 0, "the reader never saw the table change");
    drop(w);
    assert_eq!(p.free_count(), 64);
}

/// A table refuses ids it could not release later (another pool's, a freed block's): it used to
/// take them, and its release on drop failed (a debug assert; in release builds the caller's
/// reference, and so the block, was leaked).
#[test]
fn push_and_replace_refuse_ids_the_table_could_not_release() {
    let (a, b) = (pool(4), pool(4));
    let from_b = b.alloc(EngineId(0)).unwrap();
    let mut t = BlockTable::new(a.clone(), EngineId(0), 4).unwrap();
    assert!(matches!(
        t.push(from_b),
        Err(PoolError::ForeignBlock { .. })
    ));
    let freed = a.alloc(EngineId(0)).unwrap();
    a.free(freed).unwrap();
    assert!(t.push(freed).is_err(), "a free block");
    let mut scratch = Vec::new();
    t.grow(1, &mut scratch).unwrap();
    assert!(matches!(
        t.replace(0, from_b),
        Err(PoolError::ForeignBlock { .. })
    ));
    assert_eq!(t.len(), 1);
    drop(t);
    assert_eq!(a.free_count(), 4);
    assert_eq!(b.ref_count(from_b), Ok(1), "the caller kept its reference");
}

/// A table's pages go back to its engine's magazine, not the shared stack: another engine's
/// allocation right after is served from the shared stack (other blocks), and the same engine's
/// next allocation gets its own pages back. (Tables released page by page onto the shared head,
/// where the other engine's allocation took exactly those pages and the magazine stayed empty.)
#[test]
fn a_cleared_table_refills_its_engines_magazine() {
    let p = pool(64);
    let mut scratch = Vec::new();
    let mut t = BlockTable::new(p.clone(), EngineId(1), 16).unwrap();
    t.grow(16, &mut scratch).unwrap();
    let mut mine: Vec<BlockId> = Vec::new();
    t.ids_into(&mut mine);
    assert_eq!(t.clear(), 16);
    assert_eq!(p.free_count(), 64, "parked pages count as free");
    let mut other = Vec::new();
    p.alloc_n(EngineId(0), 16, &mut other).unwrap();
    let taken: Vec<u32> = mine.iter().map(|id| id.index()).collect();
    assert!(
        other.iter().all(|id| !taken.contains(&id.index())),
        "engine 0 took engine 1's pages from the shared stack: {other:?}"
    );
    let mut again = Vec::new();
    p.alloc_n(EngineId(1), 16, &mut again).unwrap();
    let mut back: Vec<u32> = again.iter().map(|id| id.index()).collect();
    back.sort_unstable();
    let mut want = taken.clone();
    want.sort_unstable();
    assert_eq!(
        back, want,
        "engine 1 gets its own pages back from its magazine"
    );
    p.free_n(&other).unwrap();
    p.free_n(&again).unwrap();
    assert_eq!(p.free_count(), 64);
}

/// A fork belongs to its parent's engine: blocks it grows by are charged to that engine.
#[test]
fn a_fork_grows_for_its_parents_engine() {
    let p = pool(8);
    let mut scratch = Vec::new();
    let mut a = BlockTable::new(p.clone(), EngineId(1), 4).unwrap();
    a.grow(1, &mut scratch).unwrap();
    let mut b = a.fork().unwrap();
    assert_eq!(b.engine(), EngineId(1));
    b.grow(2, &mut scratch).unwrap();
    assert_eq!((p.held(EngineId(0)), p.held(EngineId(1))), (0, 3));
    drop((a, b));
    assert_eq!((p.free_count(), p.held(EngineId(1))), (8, 0));
}

/// A truncation of more blocks than one release batch (64) frees, and counts, every one of them.
#[test]
fn truncating_more_than_one_batch_frees_and_counts_every_block() {
    let p = pool(200);
    let mut scratch = Vec::new();
    let mut t = BlockTable::new(p.clone(), EngineId(0), 150).unwrap();
    t.grow(150, &mut scratch).unwrap();
    assert_eq!(t.truncate(10), 140);
    assert_eq!((p.free_count(), p.held(EngineId(0))), (190, 10));
    assert_eq!(t.clear(), 10);
    assert_eq!((p.free_count(), p.held(EngineId(0))), (200, 0));
}
