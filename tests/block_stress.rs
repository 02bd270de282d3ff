//! Multi-threaded stress of the pool and tables: threads do random operations (alloc, alloc_n,
//! share, release, free_n, and handing references to each other through an exchange), and at
//! quiescent points (a barrier) the pool is checked against the sequential model rebuilt from
//! what every thread holds.

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};

const THREADS: usize = 4;
const ENGINES: u16 = 3;
const BLOCKS: u32 = 256;
const ROUNDS: usize = 20;
/// Operations per thread per round: 4 threads x 20 rounds x 30k = 2.4 million operations.
const OPS: usize = 30_000;
const EXCHANGE: usize = 16;
const EMPTY: u64 = u64::MAX;

#[test]
fn random_operations_match_the_sequential_model() {
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: BLOCKS,
            max_engines: ENGINES,
        })
        .unwrap(),
    );
    // References in transit between threads.
    let exchange: Arc<Vec<AtomicU64>> =
        Arc::new((0..EXCHANGE).map(|_| AtomicU64::new(EMPTY)).collect());
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    // Each thread publishes the references it holds at each quiescent point (test-side only).
    let held: Arc<Vec<Mutex<Vec<BlockId>>>> =
        Arc::new((0..THREADS).map(|_| Mutex::new(Vec::new())).collect());

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, exchange, barrier, held) = (
                pool.clone(),
                exchange.clone(),
                barrier.clone(),
                held.clone(),
            );
            std::thread::spawn(move || {
                let engine = EngineId((t % ENGINES as usize) as u16);
                let mut rng = SmallRng::seed_from_u64(0x5eed + t as u64);
                let mut mine: Vec<BlockId> = Vec::new();
                let mut scratch = Vec::new();
                for _ in 0..ROUNDS {
                    for _ in 0..OPS {
                        match rng.gen_range(0..100) {
                            0..=24 => {
                                if let Ok(id) = pool.alloc(engine) {
                                    mine.push(id);
                                }
                            }
                            25..=34 => {
                                scratch.clear();
                                let n = rng.gen_range(1..=8);
                                let before = mine.len();
                                match pool.alloc_n(engine, n, &mut scratch) {
                                    Ok(()) => {
                                        assert_eq!(scratch.len(), n as usize);
                                        mine.extend_from_slice(&scratch);
                                    }
                                    Err(_) => assert!(scratch.is_empty()),
                                }
                                assert!(mine.len() == before || mine.len() == before + n as usize);
                            }
                            35..=49 if !mine.is_empty() => {
                                let id = mine[rng.gen_range(0..mine.len())];
                                pool.share(id).unwrap();
                                mine.push(id);
                            }
                            50..=79 if !mine.is_empty() => {
                                let id = mine.swap_remove(rng.gen_range(0..mine.len()));
                                pool.release(id).unwrap();
                            }
                            80..=84 if mine.len() >= 4 => {
                                let k = rng.gen_range(1..=4);
                                let at = mine.len() - k;
                                let batch: Vec<_> = mine.drain(at..).collect();
                                pool.free_n(&batch).unwrap();
                            }
                            85..=92 if !mine.is_empty() => {
                                // Hand a reference to whichever thread takes it.
                                let slot = &exchange[rng.gen_range(0..EXCHANGE)];
                                let id = mine.swap_remove(rng.gen_range(0..mine.len()));
                                let prev = slot.swap(id.to_bits(), Ordering::AcqRel);
                                if prev != EMPTY {
                                    mine.push(BlockId::from_bits(prev));
                                }
                            }
                            _ => {
                                let slot = &exchange[rng.gen_range(0..EXCHANGE)];
                                let prev = slot.swap(EMPTY, Ordering::AcqRel);
                                if prev != EMPTY {
                                    mine.push(BlockId::from_bits(prev));
                                }
                            }
                        }
                        // Keep the working set bounded so the pool is neither always full nor empty.
                        if mine.len() > 80 {
                            let id = mine.swap_remove(0);
                            pool.release(id).unwrap();
                        }
                    }
                    *held[t].lock().unwrap() = mine.clone();
                    barrier.wait(); // quiescent: the checker runs
                    barrier.wait(); // checker done
                }
                pool.free_n(&mine).unwrap();
            })
        })
        .collect();

    for round in 0..ROUNDS {
        barrier.wait();
        // The sequential model: every reference anyone holds.
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        for h in held.iter() {
            for &id in h.lock().unwrap().iter() {
                *refs.entry(id).or_default() += 1;
            }
        }
        for slot in exchange.iter() {
            let v = slot.load(Ordering::Acquire);
            if v != EMPTY {
                *refs.entry(BlockId::from_bits(v)).or_default() += 1;
            }
        }
        let distinct_indices: std::collections::HashSet<u32> =
            refs.keys().map(|id| id.index()).collect();
        assert_eq!(
            distinct_indices.len(),
            refs.len(),
            "round {round}: one block under two live ids"
        );
        assert_eq!(
            pool.free_count() as usize,
            BLOCKS as usize - refs.len(),
            "round {round}: free count"
        );
        let mut per_engine = vec![0u32; ENGINES as usize];
        for (&id, &n) in &refs {
            assert_eq!(pool.ref_count(id), Ok(n), "round {round}: refs of {id:?}");
            per_engine[pool.owner(id).unwrap().index()] += 1;
        }
        assert_eq!(
            pool.stats().held,
            per_engine,
            "round {round}: per-engine held"
        );
        barrier.wait();
    }
    for w in workers {
        w.join().unwrap();
    }
    for slot in exchange.iter() {
        let v = slot.swap(EMPTY, Ordering::AcqRel);
        if v != EMPTY {
            pool.release(BlockId::from_bits(v)).unwrap();
        }
    }
    assert_eq!(pool.free_count(), BLOCKS);
    assert_eq!(pool.stats().held, vec![0; ENGINES as usize]);
}
