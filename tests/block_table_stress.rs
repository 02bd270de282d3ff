//! Tables of several engines (one with a magazine beyond the first 64 engines: none) grow,
//! fork, copy-on-write, truncate and drop on several threads, handing tables to each other so
//! batches mix owners and shared pages; at quiescent points the pool matches what the tables
//! hold.

use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};
use pagedkv::error::PoolError;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::{Arc, Barrier, Mutex};

const BLOCKS: u32 = 150;
const ENGINES: [u16; 4] = [0, 0, 1, 65];
const ROUNDS: usize = 30;
const OPS: usize = 10_000;

#[test]
fn tables_of_several_engines_match_the_pool() {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: BLOCKS,
            max_engines: 66,
        })
        .unwrap(),
    );
    let threads = ENGINES.len();
    let barrier = Arc::new(Barrier::new(threads + 1));
    let exchange: Arc<Mutex<Vec<BlockTable>>> = Arc::new(Mutex::new(Vec::new()));
    let held: Arc<Vec<Mutex<Vec<Vec<BlockId>>>>> =
        Arc::new((0..threads).map(|_| Mutex::new(Vec::new())).collect());
    let workers: Vec<_> = ENGINES
        .iter()
        .enumerate()
        .map(|(t, &e)| {
            let (pool, barrier, exchange, held) = (
                pool.clone(),
                barrier.clone(),
                exchange.clone(),
                held.clone(),
            );
            std::thread::spawn(move || {
                let engine = EngineId(e);
                let mut rng = SmallRng::seed_from_u64(0x7ab1e + t as u64);
                let mut tables: Vec<BlockTable> = Vec::new();
                let mut scratch = Vec::new();
                for _round in 0..ROUNDS {
                    for _ in 0..OPS {
                        match rng.gen_range(0..10) {
                            0 | 1 => {
                                tables.push(BlockTable::new(pool.clone(), engine, 120).unwrap())
                            }
                            2 | 3 if !tables.is_empty() => {
                                let i = rng.gen_range(0..tables.len());
                                let n = rng.gen_range(1..=80);
                                match tables[i].grow(n, &mut scratch) {
                                    Ok(()) => {}
                                    Err(PoolError::OutOfBlocks { requested, free }) => {
                                        assert!(
                                            requested == n && free < n,
                                            "refused {n} with {free} free"
                                        );
                                    }
                                    Err(PoolError::TableFull { .. }) => {}
                                    Err(e) => panic!("grow: {e}"),
                                }
                            }
                            4 if !tables.is_empty() => {
                                let i = rng.gen_range(0..tables.len());
                                let f = tables[i].fork().unwrap();
                                exchange.lock().unwrap().push(f);
                            }
                            5 => {
                                if let Some(t) = exchange.lock().unwrap().pop() {
                                    tables.push(t);
                                }
                            }
                            6 | 7 if !tables.is_empty() => {
                                let i = rng.gen_range(0..tables.len());
                                let keep = rng.gen_range(0..=tables[i].len());
                                tables[i].truncate(keep);
                            }
                            8 if !tables.is_empty() => {
                                let i = rng.gen_range(0..tables.len());
                                if !tables[i].is_empty() {
                                    let j = rng.gen_range(0..tables[i].len());
                                    if let Ok(b) = pool.alloc(engine) {
                                        tables[i].replace(j, b).unwrap();
                                    }
                                }
                            }
                            9 if !tables.is_empty() => {
                                let i = rng.gen_range(0..tables.len());
                                drop(tables.swap_remove(i));
                            }
                            _ => {}
                        }
                    }
                    let mut mine = Vec::new();
                    for t in &tables {
                        let mut ids = Vec::new();
                        t.ids_into(&mut ids);
                        mine.push(ids);
                    }
                    *held[t].lock().unwrap() = mine;
                    barrier.wait();
                    barrier.wait();
                }
                drop(tables);
                barrier.wait();
            })
        })
        .collect();
    for round in 0..ROUNDS {
        barrier.wait();
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        for h in held.iter() {
            for ids in h.lock().unwrap().iter() {
                for &id in ids {
                    *refs.entry(id).or_default() += 1;
                }
            }
        }
        for t in exchange.lock().unwrap().iter() {
            let mut ids = Vec::new();
            t.ids_into(&mut ids);
            for id in ids {
                *refs.entry(id).or_default() += 1;
            }
        }
        let mut owned = vec![0u32; 66];
        for (&id, &n) in &refs {
            assert_eq!(pool.ref_count(id), Ok(n), "round {round}: {id:?}");
            owned[pool.owner(id).unwrap().index()] += 1;
        }
        assert_eq!(
            pool.free_count() as usize + refs.len(),
            BLOCKS as usize,
            "round {round}: free + held"
        );
        assert_eq!(pool.stats().held, owned, "round {round}: held per engine");
        barrier.wait();
    }
    barrier.wait();
    for w in workers {
        w.join().unwrap();
    }
    exchange.lock().unwrap().clear();
    assert_eq!(pool.free_count(), BLOCKS);
    assert!(pool.stats().held.iter().all(|&h| h == 0));
    let mut all = Vec::new();
    pool.alloc_n(EngineId(0), BLOCKS, &mut all).unwrap();
    assert_eq!(pool.free_n(&all), Ok(BLOCKS));
}
