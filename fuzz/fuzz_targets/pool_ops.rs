//! Fuzz the block pool and tables with arbitrary operation sequences, checking every step
//! against a `Vec` model: counts exact, refused operations change nothing, no panic. Each
//! block's owner is the engine that allocated it (tables: the table's engine), and each
//! engine's `held` is exactly the live blocks it owns (not just the sum over engines: a free
//! that credits the wrong engine keeps the sum).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};
use pagedkv::error::PoolError;
use std::sync::Arc;

#[derive(Debug, Arbitrary)]
struct Input {
    num_blocks: u8,
    max_engines: u8,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Alloc(u8),
    AllocN(u8, u8),
    Share(u8),
    Release(u8),
    FreeN(u8),
    RawRelease(u64),
    RawShare(u64),
    TableNew(u8, u8),
    TableGrow(u8, u8),
    TableTruncate(u8, u8),
    TableFork(u8),
    TableDrop(u8),
    TableRow(u8, u8),
}

fuzz_target!(|input: Input| {
    let n = u32::from(input.num_blocks);
    let engines = u16::from(input.max_engines);
    let pool = match BlockPool::new(PoolConfig {
        device: 7,
        num_blocks: n,
        max_engines: engines,
    }) {
        Ok(p) => Arc::new(p),
        Err(_) => {
            assert!(n == 0 || engines == 0);
            return;
        }
    };
    let mut refs: Vec<BlockId> = Vec::new();
    let mut tables: Vec<BlockTable> = Vec::new();
    // The engine of each table in `tables`, and the owner of each live block.
    let mut table_engines: Vec<u16> = Vec::new();
    let mut owners: std::collections::HashMap<BlockId, u16> = Default::default();
    let mut scratch = Vec::new();
    let live = |refs: &Vec<BlockId>, tables: &Vec<BlockTable>| {
        let mut all = refs.clone();
        for t in tables {
            for j in 0..t.len() {
                all.push(t.get(j).unwrap());
            }
        }
        all
    };
    for op in input.ops.into_iter().take(512) {
        let before = pool.stats();
        // The engine a new block of this operation belongs to.
        let allocating = match op {
            Op::Alloc(e) | Op::AllocN(e, _) => Some(u16::from(e)),
            Op::TableGrow(t, _) if !tables.is_empty() => {
                Some(table_engines[t as usize % tables.len()])
            }
            _ => None,
        };
        match op {
            Op::Alloc(e) => match pool.alloc(EngineId(u16::from(e))) {
                Ok(id) => refs.push(id),
                Err(_) => assert_eq!(pool.stats(), before),
            },
            Op::AllocN(e, k) => {
                let mut out = Vec::new();
                match pool.alloc_n(EngineId(u16::from(e)), u32::from(k), &mut out) {
                    Ok(()) => {
                        assert_eq!(out.len(), k as usize);
                        refs.extend(out);
                    }
                    Err(_) => {
                        assert!(out.is_empty());
                        assert_eq!(pool.stats(), before);
                    }
                }
            }
            Op::Share(i) if !refs.is_empty() => {
                let id = refs[i as usize % refs.len()];
                pool.share(id).unwrap();
                refs.push(id);
            }
            Op::Release(i) if !refs.is_empty() => {
                let id = refs.swap_remove(i as usize % refs.len());
                pool.release(id).unwrap();
            }
            Op::FreeN(k) if !refs.is_empty() => {
                let k = 1 + k as usize % refs.len();
                let batch: Vec<_> = refs.drain(..k).collect();
                pool.free_n(&batch).unwrap();
            }
            Op::RawRelease(bits) | Op::RawShare(bits) => {
                let id = BlockId::from_bits(bits);
                if !live(&refs, &tables).contains(&id) {
                    // Not a reference anyone holds: must be refused without effect.
                    let r = if matches!(op, Op::RawRelease(_)) {
                        pool.release(id).map(|_| ())
                    } else {
                        pool.share(id)
                    };
                    assert!(r.is_err(), "{id:?} accepted");
                    assert_eq!(pool.stats(), before);
                }
            }
            Op::TableNew(e, cap) => {
                if u16::from(e) < engines && tables.len() < 8 {
                    match BlockTable::new(pool.clone(), EngineId(u16::from(e)), u32::from(cap)) {
                        Ok(t) => {
                            tables.push(t);
                            table_engines.push(u16::from(e));
                        }
                        Err(err) => assert!(
                            u32::from(cap) > pool.total()
                                && matches!(err, PoolError::TableTooLarge { .. }),
                            "table of {cap} refused: {err}"
                        ),
                    }
                }
            }
            Op::TableGrow(t, k) if !tables.is_empty() => {
                let i = t as usize % tables.len();
                let len = tables[i].len();
                if tables[i].grow(u32::from(k % 16), &mut scratch).is_err() {
                    assert_eq!(tables[i].len(), len);
                    assert_eq!(pool.stats(), before);
                }
            }
            Op::TableTruncate(t, k) if !tables.is_empty() => {
                let i = t as usize % tables.len();
                tables[i].truncate(u32::from(k));
            }
            Op::TableFork(t) if !tables.is_empty() && tables.len() < 8 => {
                let i = t as usize % tables.len();
                let f = tables[i].fork().unwrap();
                tables.push(f);
                table_engines.push(table_engines[i]);
            }
            Op::TableDrop(t) if !tables.is_empty() => {
                let i = t as usize % tables.len();
                tables.swap_remove(i);
                table_engines.swap_remove(i);
            }
            Op::TableRow(t, width) if !tables.is_empty() => {
                let i = t as usize % tables.len();
                let mut row = vec![0i32; width as usize];
                let r = tables[i].write_row(&mut row, -1);
                assert_eq!(r.is_ok(), width as u32 >= tables[i].len());
            }
            _ => {}
        }
        let all = live(&refs, &tables);
        let mut distinct = all.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(pool.free_count() as usize, n as usize - distinct.len());
        assert_eq!(
            pool.stats().held.iter().sum::<u32>() as usize,
            distinct.len()
        );
        for id in &distinct {
            let k = all.iter().filter(|x| *x == id).count() as u32;
            assert_eq!(pool.ref_count(*id), Ok(k));
            let owner = *owners
                .entry(*id)
                .or_insert_with(|| allocating.expect("only an allocation makes a block live"));
            assert_eq!(pool.owner(*id), Ok(EngineId(owner)));
        }
        owners.retain(|id, _| distinct.binary_search(id).is_ok());
        let held = pool.stats().held;
        for (e, &h) in held.iter().enumerate() {
            let mine = owners.values().filter(|&&o| usize::from(o) == e).count();
            assert_eq!(h as usize, mine, "engine {e} held");
        }
    }
    drop(tables);
    pool.free_n(&refs).unwrap();
    assert_eq!(pool.free_count(), n);
});
