//! proptest: random operation sequences on a pool and its tables against a `Vec`-based model.

use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};
use proptest::prelude::*;
use std::sync::Arc;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u16),
    AllocN(u16, u32),
    Share(usize),
    Release(usize),
    FreeN(usize),
    /// A bogus id: index, generation (may be stale or never allocated).
    ReleaseBogus(u32, u32),
    TableGrow(u32),
    TableTruncate(u32),
    TableFork,
    TableDrop,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u16..3).prop_map(Op::Alloc),
        (0u16..3, 0u32..12).prop_map(|(e, n)| Op::AllocN(e, n)),
        any::<usize>().prop_map(Op::Share),
        any::<usize>().prop_map(Op::Release),
        any::<usize>().prop_map(Op::FreeN),
        (0u32..40, 0u32..4).prop_map(|(i, g)| Op::ReleaseBogus(i, g)),
        (0u32..6).prop_map(Op::TableGrow),
        (0u32..10).prop_map(Op::TableTruncate),
        Just(Op::TableFork),
        Just(Op::TableDrop),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn pool_matches_vec_model(ops in proptest::collection::vec(op(), 1..200)) {
        const N: u32 = 32;
        let pool = Arc::new(BlockPool::new(PoolConfig { device: 0, num_blocks: N, max_engines: 3 }).unwrap());
        // Model: references held directly (a Vec with repeats), and by tables.
        let mut refs: Vec<BlockId> = Vec::new();
        let mut tables: Vec<BlockTable> = Vec::new();
        let mut scratch = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(e) => {
                    let free = pool.free_count();
                    match pool.alloc(EngineId(e)) {
                        Ok(id) => { prop_assert!(free > 0); refs.push(id) }
                        Err(_) => prop_assert_eq!(free, 0),
                    }
                }
                Op::AllocN(e, n) => {
                    let free = pool.free_count();
                    let mut out = Vec::new();
                    let r = pool.alloc_n(EngineId(e), n, &mut out);
                    prop_assert_eq!(r.is_ok(), n <= free);
                    prop_assert_eq!(out.len(), if r.is_ok() { n as usize } else { 0 });
                    refs.extend(out);
                }
                Op::Share(i) if !refs.is_empty() => {
                    let id = refs[i % refs.len()];
                    pool.share(id).unwrap();
                    refs.push(id);
                }
                Op::Release(i) if !refs.is_empty() => {
                    let id = refs.swap_remove(i % refs.len());
                    let last = !refs.contains(&id) && !tables.iter().any(|t| (0..t.len()).any(|j| t.get(j) == Some(id)));
                    prop_assert_eq!(pool.release(id), Ok(last));
                }
                Op::FreeN(k) if !refs.is_empty() => {
                    let k = 1 + k % refs.len();
                    let batch: Vec<_> = refs.drain(..k).collect();
                    pool.free_n(&batch).unwrap();
                }
                Op::ReleaseBogus(index, generation) => {
                    let id = BlockId::from_bits((u64::from(pool.tag()) << 48) | (u64::from(generation) << 24) | u64::from(index));
                    let live = refs.contains(&id) || tables.iter().any(|t| (0..t.len()).any(|j| t.get(j) == Some(id)));
                    if !live {
                        let before = pool.stats();
                        prop_assert!(pool.release(id).is_err());
                        prop_assert_eq!(pool.stats(), before);
                    }
                }
                Op::TableGrow(n) => {
                    if tables.is_empty() {
                        tables.push(BlockTable::new(pool.clone(), EngineId(2), 16).unwrap());
                    }
                    let t = tables.last_mut().unwrap();
                    let (len, free) = (t.len(), pool.free_count());
                    let r = t.grow(n, &mut scratch);
                    prop_assert_eq!(r.is_ok(), n <= free && len + n <= 16);
                    prop_assert_eq!(t.len(), if r.is_ok() { len + n } else { len });
                }
                Op::TableTruncate(n) => {
                    if let Some(t) = tables.last_mut() {
                        let keep = n.min(t.len());
                        t.truncate(n);
                        prop_assert_eq!(t.len(), keep);
                    }
                }
                Op::TableFork => {
                    if let Some(t) = tables.last() {
                        let f = t.fork().unwrap();
                        tables.push(f);
                    }
                }
                Op::TableDrop => { tables.pop(); }
                _ => {}
            }
            // The model's invariants after every step.
            let mut live: Vec<BlockId> = refs.clone();
            for t in &tables { for j in 0..t.len() { live.push(t.get(j).unwrap()); } }
            let mut distinct = live.clone();
            distinct.sort_unstable();
            distinct.dedup();
            prop_assert_eq!(pool.free_count() as usize, N as usize - distinct.len());
            for id in &distinct {
                let n = live.iter().filter(|x| *x == id).count() as u32;
                prop_assert_eq!(pool.ref_count(*id), Ok(n));
            }
            let held: u32 = pool.stats().held.iter().sum();
            prop_assert_eq!(held as usize, distinct.len());
        }
        drop(tables);
        pool.free_n(&refs).unwrap();
        prop_assert_eq!(pool.free_count(), N);
    }
}
