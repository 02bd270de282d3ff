//! Multi-threaded stress of the pool: threads do random operations (alloc, alloc_n, share,
//! release, free_n, and handing references to each other through an exchange), and at quiescent
//! points the pool is checked against the sequential model rebuilt from what every thread
//! holds; and `free_n` racing a double release of one of its blocks, checked for conservation
//! (every block free or allocated) after every round.
//!
//! Every wait has a deadline: a thread hung inside a pool operation (or one that panicked and
//! left the others waiting) fails the test with a message instead of hanging it.

use pagedkv::block::{BlockId, BlockPool, EngineId, PoolConfig};
use pagedkv::error::PoolError;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long any thread may wait for the others at a quiescent point (a healthy round takes well
/// under a second even on a loaded 2-core machine).
const STALL: Duration = Duration::from_secs(60);

/// A barrier whose waits time out, and that a panicking thread poisons so the others fail
/// promptly instead of waiting forever.
struct Gate {
    /// `(arrived, generation, poisoned)`.
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
    parties: usize,
}

impl Gate {
    fn new(parties: usize) -> Self {
        Self {
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
            parties,
        }
    }

    fn wait(&self, who: &str) {
        let deadline = Instant::now() + STALL;
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        assert!(!g.2, "{who}: another thread failed (see its panic)");
        let generation = g.1;
        g.0 += 1;
        if g.0 == self.parties {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return;
        }
        while g.1 == generation {
            assert!(!g.2, "{who}: another thread failed (see its panic)");
            let now = Instant::now();
            if now >= deadline {
                g.2 = true;
                self.cv.notify_all();
                panic!(
                    "{who}: waited {STALL:?} at a quiescent point: a thread is hung or \
                     livelocked inside a pool operation"
                );
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn poison(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).2 = true;
        self.cv.notify_all();
    }
}

/// Poisons the gate if the thread holding it unwinds.
struct PoisonOnPanic<'a>(&'a Gate);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poison();
        }
    }
}

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
    let gate = Arc::new(Gate::new(THREADS + 1));
    // Each thread publishes the references it holds at each quiescent point (test-side only).
    let held: Arc<Vec<Mutex<Vec<BlockId>>>> =
        Arc::new((0..THREADS).map(|_| Mutex::new(Vec::new())).collect());

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, exchange, gate, held) =
                (pool.clone(), exchange.clone(), gate.clone(), held.clone());
            std::thread::spawn(move || {
                let _poison = PoisonOnPanic(&gate);
                let engine = EngineId((t % ENGINES as usize) as u16);
                let mut rng = SmallRng::seed_from_u64(0x5eed + t as u64);
                let mut mine: Vec<BlockId> = Vec::new();
                let mut scratch = Vec::new();
                for round in 0..ROUNDS {
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
                    let who = format!("worker {t}, round {round}");
                    gate.wait(&who); // quiescent: the checker runs
                    gate.wait(&who); // checker done
                }
                pool.free_n(&mine).unwrap();
            })
        })
        .collect();

    let _poison = PoisonOnPanic(&gate);
    for round in 0..ROUNDS {
        let who = format!("checker, round {round}");
        gate.wait(&who);
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
        gate.wait(&who);
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

/// Spins until `done` holds (yielding now and then, in case the other thread shares this core),
/// failing with `what` once `deadline` passes.
fn spin_until(deadline: Instant, what: &str, mut done: impl FnMut() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins = spins.wrapping_add(1);
        if spins % 1024 == 0 {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Issue 17 item 1: one thread `free_n`s all 63 blocks it holds while another releases one of
/// them (a double free elsewhere). Exactly one of the two releases of that block may succeed,
/// and after every round every block is back on the free list: a `free_n` that gave up half
/// way (after dropping some references, before pushing them) would leave blocks that are
/// neither free nor allocated.
///
/// Every other round the batch's first block has a second reference, so `free_n` takes its
/// general path (check everything, then release): a batch of distinct unshared blocks takes
/// the one-pass path, where the double release can only be refused, never meet the general
/// path's second phase, and a general path that returned there half way passed this test.
#[test]
fn free_n_racing_a_double_release_loses_no_block() {
    const BLOCKS: u32 = 64;
    const BATCH: u32 = 63;
    const ROUNDS: u64 = 200_000;
    const TIME: Duration = Duration::from_secs(4);
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: BLOCKS,
            max_engines: 1,
        })
        .unwrap(),
    );
    // The id the double-freer releases (EMPTY when none), and how its release went.
    let target = Arc::new(AtomicU64::new(EMPTY));
    let outcome = Arc::new(AtomicU64::new(EMPTY));
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + STALL;
    let rogue = {
        let (pool, target, outcome, stop) =
            (pool.clone(), target.clone(), outcome.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(17);
            loop {
                let mut bits = EMPTY;
                spin_until(deadline, "the next round's target", || {
                    bits = target.swap(EMPTY, Ordering::AcqRel);
                    bits != EMPTY || stop.load(Ordering::Acquire)
                });
                if bits == EMPTY {
                    return;
                }
                // A short random delay spreads the release over the whole of free_n.
                for _ in 0..rng.gen_range(0..32) {
                    std::hint::spin_loop();
                }
                let ok = pool.release(BlockId::from_bits(bits)).is_ok();
                outcome.store(u64::from(ok), Ordering::Release);
            }
        })
    };
    // Stops the other thread however this one leaves (a failed assertion included).
    struct StopOnDrop(Arc<AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    let _stop = StopOnDrop(stop.clone());
    let mut rng = SmallRng::seed_from_u64(71);
    let mut ids = Vec::new();
    let mut phase_two_races = 0u64;
    let (mut refused, mut late) = (0u64, 0u64);
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < ROUNDS && start.elapsed() < TIME {
        rounds += 1;
        ids.clear();
        pool.alloc_n(EngineId(0), BATCH, &mut ids).unwrap();
        // The shared first block keeps a reference after the batch: one block fewer freed.
        let general = rounds % 2 == 0;
        if general {
            pool.share(ids[0]).unwrap();
        }
        let unshared = BATCH - u32::from(general);
        let raced = ids[rng.gen_range(1..BATCH as usize)];
        target.store(raced.to_bits(), Ordering::Release);
        let mine = match pool.free_n(&ids) {
            Ok(freed) => {
                assert_eq!(freed, unshared, "round {rounds}");
                late += 1;
                true
            }
            // Refused before anything was released: we still hold every other reference.
            Err(PoolError::NotAllocated { id }) | Err(PoolError::StaleBlock { id, .. }) => {
                assert_eq!(id, raced, "round {rounds}: refused the wrong id");
                ids.retain(|&b| b != raced);
                pool.free_n(&ids)
                    .unwrap_or_else(|e| panic!("round {rounds}: freeing the rest: {e}"));
                refused += 1;
                false
            }
            // The release raced phase two: everything else was released.
            Err(PoolError::ConcurrentDoubleFree { id, freed }) => {
                assert_eq!(id, raced, "round {rounds}: reported the wrong id");
                assert_eq!(freed, unshared - 1, "round {rounds}");
                phase_two_races += 1;
                false
            }
            Err(e) => panic!("round {rounds}: unexpected error {e}"),
        };
        let mut theirs = EMPTY;
        spin_until(deadline, "the double release", || {
            theirs = outcome.swap(EMPTY, Ordering::AcqRel);
            theirs != EMPTY
        });
        assert!(
            mine ^ (theirs == 1),
            "round {rounds}: exactly one release of {raced:?} succeeds (free_n: {mine}, \
             other thread: {})",
            theirs == 1
        );
        if general {
            assert_eq!(
                pool.release(ids[0]),
                Ok(true),
                "round {rounds}: the shared block"
            );
        }
        assert_eq!(
            pool.free_count(),
            BLOCKS,
            "round {rounds}: blocks lost (neither free nor allocated)"
        );
        assert_eq!(pool.held(EngineId(0)), 0, "round {rounds}: held count");
    }
    stop.store(true, Ordering::Release);
    rogue.join().unwrap();
    println!(
        "{rounds} rounds: the other release came first {refused}, during free_n's second phase \
         {phase_two_races}, after {late}"
    );
}

/// Two engines' threads allocate and free batches on a pool small enough that every free block
/// can sit in one engine's magazine, so requests regularly need blocks parked in the other
/// engine's magazine. At each quiescent point the counts match what the threads hold, and the
/// checker takes every free block at once (which must succeed, magazines included) and finds
/// none of them held by a worker.
#[test]
fn magazines_shared_by_two_engines_match_the_model() {
    const BLOCKS: u32 = 48;
    const ROUNDS: usize = 200;
    const OPS: usize = 2_000;
    const TIME: Duration = Duration::from_secs(4);
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: BLOCKS,
            max_engines: 2,
        })
        .unwrap(),
    );
    let gate = Arc::new(Gate::new(3));
    let stop = Arc::new(AtomicBool::new(false));
    let held: Arc<Vec<Mutex<Vec<BlockId>>>> =
        Arc::new((0..2).map(|_| Mutex::new(Vec::new())).collect());
    let workers: Vec<_> = (0..2u16)
        .map(|t| {
            let (pool, gate, stop, held) = (pool.clone(), gate.clone(), stop.clone(), held.clone());
            std::thread::spawn(move || {
                let _poison = PoisonOnPanic(&gate);
                let engine = EngineId(t);
                let mut rng = SmallRng::seed_from_u64(0xa9a + u64::from(t));
                let mut mine: Vec<BlockId> = Vec::new();
                let mut scratch = Vec::new();
                loop {
                    for _ in 0..OPS {
                        if rng.gen_bool(0.5) {
                            let n = rng.gen_range(1..=20);
                            scratch.clear();
                            match pool.alloc_n(engine, n, &mut scratch) {
                                Ok(()) => mine.extend_from_slice(&scratch),
                                Err(PoolError::OutOfBlocks { requested, free }) => {
                                    assert!(requested == n && free < n, "refused {n} with {free}");
                                    assert!(scratch.is_empty());
                                }
                                Err(e) => panic!("alloc_n: {e}"),
                            }
                        } else if !mine.is_empty() {
                            let k = rng.gen_range(1..=mine.len());
                            let start = mine.len() - k;
                            assert_eq!(pool.free_n(&mine[start..]), Ok(k as u32));
                            mine.truncate(start);
                        }
                    }
                    *held[t as usize].lock().unwrap() = mine.clone();
                    gate.wait("worker: round end");
                    // The checker runs alone here.
                    gate.wait("worker: round start");
                    if stop.load(Ordering::Acquire) {
                        assert_eq!(pool.free_n(&mine), Ok(mine.len() as u32));
                        return;
                    }
                }
            })
        })
        .collect();
    let start = Instant::now();
    let mut rounds = 0;
    loop {
        gate.wait("checker: round end");
        rounds += 1;
        let mut all: Vec<BlockId> = Vec::new();
        for (e, h) in held.iter().enumerate() {
            let h = h.lock().unwrap();
            assert_eq!(
                pool.held(EngineId(e as u16)),
                h.len() as u32,
                "round {rounds}"
            );
            all.extend_from_slice(&h);
        }
        let free = pool.free_count();
        assert_eq!(
            free as usize + all.len(),
            BLOCKS as usize,
            "round {rounds}: count"
        );
        let mut rest = Vec::new();
        pool.alloc_n(EngineId(1), free, &mut rest)
            .unwrap_or_else(|e| panic!("round {rounds}: every free block at once: {e}"));
        all.extend_from_slice(&rest);
        let mut idx: Vec<u32> = all.iter().map(|b| b.index()).collect();
        idx.sort_unstable();
        idx.dedup();
        assert_eq!(
            idx.len(),
            BLOCKS as usize,
            "round {rounds}: a block held twice"
        );
        assert_eq!(pool.free_n(&rest), Ok(free));
        let done = rounds >= ROUNDS || start.elapsed() >= TIME;
        stop.store(done, Ordering::Release);
        gate.wait("checker: round start");
        if done {
            break;
        }
    }
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(pool.free_count(), BLOCKS);
    assert_eq!(pool.stats().held, vec![0, 0]);
    println!("{rounds} rounds");
}

/// Engines past the first 64 have no magazine: every allocation and release of theirs goes
/// through the shared stack's head, so two of them racing there make `alloc_n`'s one-CAS grab
/// fail and retry. Each grab must hand out exactly the blocks it detached (a retry that kept a
/// failed attempt's ids handed out more than asked, some still on the free list).
#[test]
fn engines_without_magazines_racing_on_the_shared_stack() {
    const BLOCKS: u32 = 64;
    const TIME: Duration = Duration::from_secs(1);
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: BLOCKS,
            max_engines: 66,
        })
        .unwrap(),
    );
    let workers: Vec<_> = [64u16, 65]
        .into_iter()
        .map(|e| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let engine = EngineId(e);
                let mut rng = SmallRng::seed_from_u64(u64::from(e));
                let mut out = Vec::new();
                let start = Instant::now();
                let mut rounds = 0u64;
                // Each takes at most 16 of 64 blocks, so no request is ever refused.
                while start.elapsed() < TIME {
                    let n = rng.gen_range(1..=16u32);
                    out.clear();
                    pool.alloc_n(engine, n, &mut out)
                        .unwrap_or_else(|err| panic!("engine {e}: {n} blocks: {err}"));
                    assert_eq!(out.len(), n as usize, "engine {e} asked {n}: {out:?}");
                    for &id in &out {
                        assert_eq!(pool.owner(id), Ok(engine), "engine {e}: {id:?}");
                    }
                    assert_eq!(pool.free_n(&out), Ok(n), "engine {e}: {out:?}");
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    for w in workers {
        assert!(w.join().unwrap() > 0);
    }
    assert_eq!(pool.free_count(), BLOCKS);
    assert_eq!(pool.stats().held, vec![0; 66]);
}
