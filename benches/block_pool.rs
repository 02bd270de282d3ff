//! Block pool: pagedkv's lock-free pool beside the kapsl design (`Mutex<VecDeque>` free list,
//! our re-implementation) and crossbeam's `ArrayQueue` used as a free list (a lock-free peer),
//! in the same groups so every claim is a ratio from one run.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use pagedkv::block::{BlockId, BlockPool, BlockTable, EngineId, PoolConfig};
use std::collections::VecDeque;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

const BLOCKS: u32 = 4096;

/// The three free lists under test, behind one small interface.
trait FreeList: Send + Sync {
    fn alloc(&self) -> Option<u32>;
    fn free(&self, b: u32);
    /// All or nothing.
    fn alloc_n(&self, n: usize, out: &mut Vec<u32>) -> bool;
    fn free_n(&self, blocks: &[u32]);
    fn free_count(&self) -> usize;
}

/// pagedkv's pool (ids kept as packed bits so the interface stays `u32`-free of ids).
struct Pagedkv {
    pool: BlockPool,
    ids: Vec<std::sync::atomic::AtomicU64>,
}

impl Pagedkv {
    fn new() -> Self {
        Self {
            pool: BlockPool::new(PoolConfig {
                device: 0,
                num_blocks: BLOCKS,
                max_engines: 4,
            })
            .unwrap(),
            ids: (0..BLOCKS)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }
}

/// The benches call pagedkv directly (below); this impl only serves the shared checks.
impl FreeList for Pagedkv {
    fn alloc(&self) -> Option<u32> {
        let id = self.pool.alloc(EngineId(0)).ok()?;
        self.ids[id.index() as usize].store(id.to_bits(), std::sync::atomic::Ordering::Relaxed);
        Some(id.index())
    }
    fn free(&self, b: u32) {
        let bits = self.ids[b as usize].load(std::sync::atomic::Ordering::Relaxed);
        self.pool.free(BlockId::from_bits(bits)).unwrap();
    }
    fn alloc_n(&self, _n: usize, _out: &mut Vec<u32>) -> bool {
        unreachable!("benched directly")
    }
    fn free_n(&self, _blocks: &[u32]) {
        unreachable!("benched directly")
    }
    fn free_count(&self) -> usize {
        self.pool.free_count() as usize
    }
}

/// The kapsl design: a `VecDeque` free list behind a `Mutex`, shared by every engine.
struct KapslMutexVecDeque(Mutex<VecDeque<u32>>);

impl KapslMutexVecDeque {
    fn new() -> Self {
        Self(Mutex::new((0..BLOCKS).collect()))
    }
}

impl FreeList for KapslMutexVecDeque {
    fn alloc(&self) -> Option<u32> {
        self.0.lock().unwrap().pop_front()
    }
    fn free(&self, b: u32) {
        self.0.lock().unwrap().push_front(b);
    }
    fn alloc_n(&self, n: usize, out: &mut Vec<u32>) -> bool {
        let mut q = self.0.lock().unwrap();
        if q.len() < n {
            return false;
        }
        out.extend(q.drain(..n));
        true
    }
    fn free_n(&self, blocks: &[u32]) {
        let mut q = self.0.lock().unwrap();
        for &b in blocks {
            q.push_front(b);
        }
    }
    fn free_count(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// A lock-free peer: crossbeam's bounded MPMC queue as the free list. It has no all-or-nothing
/// multi-pop, so `alloc_n` pops one by one and puts back a partial grab.
struct CrossbeamArrayQueue(ArrayQueue<u32>);

impl CrossbeamArrayQueue {
    fn new() -> Self {
        let q = ArrayQueue::new(BLOCKS as usize);
        for b in 0..BLOCKS {
            q.push(b).unwrap();
        }
        Self(q)
    }
}

impl FreeList for CrossbeamArrayQueue {
    fn alloc(&self) -> Option<u32> {
        self.0.pop()
    }
    fn free(&self, b: u32) {
        self.0.push(b).unwrap();
    }
    fn alloc_n(&self, n: usize, out: &mut Vec<u32>) -> bool {
        let start = out.len();
        for _ in 0..n {
            match self.0.pop() {
                Some(b) => out.push(b),
                None => {
                    for b in out.drain(start..) {
                        self.0.push(b).unwrap();
                    }
                    return false;
                }
            }
        }
        true
    }
    fn free_n(&self, blocks: &[u32]) {
        for &b in blocks {
            self.0.push(b).unwrap();
        }
    }
    fn free_count(&self) -> usize {
        self.0.len()
    }
}

fn alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free");
    g.throughput(Throughput::Elements(1));
    let p = Pagedkv::new();
    g.bench_function("pagedkv", |b| {
        b.iter(|| {
            let id = p.pool.alloc(EngineId(0)).unwrap();
            p.pool.free(black_box(id)).unwrap();
        })
    });
    assert_eq!(p.free_count(), BLOCKS as usize);
    let m = KapslMutexVecDeque::new();
    g.bench_function("mutex_vecdeque", |b| {
        b.iter(|| {
            let id = m.alloc().unwrap();
            m.free(black_box(id));
        })
    });
    assert_eq!(m.free_count(), BLOCKS as usize);
    let q = CrossbeamArrayQueue::new();
    g.bench_function("crossbeam_arrayqueue", |b| {
        b.iter(|| {
            let id = q.alloc().unwrap();
            q.free(black_box(id));
        })
    });
    assert_eq!(q.free_count(), BLOCKS as usize);
    g.finish();
}

/// Two threads (this machine's core count) each doing `iters` alloc+free pairs on one list;
/// reports the wall time of the slower thread.
fn run_contended(iters: u64, op: impl Fn() + Sync) -> Duration {
    let barrier = Barrier::new(2);
    let op = &op;
    let barrier = &barrier;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..iters {
                        op();
                    }
                    t.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .max()
            .unwrap()
    })
}

/// [`run_contended`] with per-thread scratch state (a reused id vector) and the thread's
/// number (0 or 1) passed to `op`.
fn run_contended_with<S: Clone + Send + Sync>(
    iters: u64,
    scratch: S,
    op: impl Fn(&mut S, u16) + Sync,
) -> Duration {
    let barrier = Barrier::new(2);
    let op = &op;
    let barrier = &barrier;
    let scratch = &scratch;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2u16)
            .map(|thread| {
                s.spawn(move || {
                    // Cloned on the thread, so the two threads' scratch buffers come from
                    // their own allocator arenas and share no cache line.
                    let mut state = scratch.clone();
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..iters {
                        op(&mut state, thread);
                    }
                    t.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .max()
            .unwrap()
    })
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("contended");
    // Each iteration is one alloc+free pair on each of the two threads.
    g.throughput(Throughput::Elements(2));
    let p = Arc::new(Pagedkv::new());
    g.bench_function("pagedkv", |b| {
        b.iter_custom(|iters| {
            run_contended(iters, || {
                let id = p.pool.alloc(EngineId(0)).unwrap();
                p.pool.free(black_box(id)).unwrap();
            })
        })
    });
    assert_eq!(p.free_count(), BLOCKS as usize);
    let m = Arc::new(KapslMutexVecDeque::new());
    g.bench_function("mutex_vecdeque", |b| {
        b.iter_custom(|iters| {
            run_contended(iters, || {
                let id = m.alloc().unwrap();
                m.free(black_box(id));
            })
        })
    });
    assert_eq!(m.free_count(), BLOCKS as usize);
    let q = Arc::new(CrossbeamArrayQueue::new());
    g.bench_function("crossbeam_arrayqueue", |b| {
        b.iter_custom(|iters| {
            run_contended(iters, || {
                let id = q.alloc().unwrap();
                q.free(black_box(id));
            })
        })
    });
    assert_eq!(q.free_count(), BLOCKS as usize);
    g.finish();
}

fn alloc_n(c: &mut Criterion) {
    const N: u32 = 16;
    let mut g = c.benchmark_group("alloc_n");
    g.throughput(Throughput::Elements(u64::from(N)));
    let p = Pagedkv::new();
    let mut ids = Vec::with_capacity(N as usize);
    g.bench_function(BenchmarkId::new("pagedkv", N), |b| {
        b.iter(|| {
            ids.clear();
            p.pool.alloc_n(EngineId(0), N, &mut ids).unwrap();
            p.pool.free_n(black_box(&ids)).unwrap();
        })
    });
    assert_eq!(p.free_count(), BLOCKS as usize);
    let mut out = Vec::with_capacity(N as usize);
    let m = KapslMutexVecDeque::new();
    g.bench_function(BenchmarkId::new("mutex_vecdeque", N), |b| {
        b.iter(|| {
            out.clear();
            assert!(m.alloc_n(N as usize, &mut out));
            m.free_n(black_box(&out));
        })
    });
    assert_eq!(m.free_count(), BLOCKS as usize);
    let q = CrossbeamArrayQueue::new();
    g.bench_function(BenchmarkId::new("crossbeam_arrayqueue", N), |b| {
        b.iter(|| {
            out.clear();
            assert!(q.alloc_n(N as usize, &mut out));
            q.free_n(black_box(&out));
        })
    });
    assert_eq!(q.free_count(), BLOCKS as usize);
    g.finish();
}

/// Two threads each doing `alloc_n(16) + free_n(16)` in a loop on one shared list; one
/// iteration is one batch pair on each thread (throughput: 32 blocks through the list).
///
/// `pagedkv` runs the deployment the pool is built for: each thread is one engine's scheduler
/// (engines 0 and 1, two models on one pool), so each recycles through its own magazine.
/// `pagedkv_same_engine` has both threads allocate for engine 0 (one magazine, pushes
/// contend and fall back to the shared stack). The baselines have no notion of engine.
fn alloc_n_contended(c: &mut Criterion) {
    const N: u32 = 16;
    let mut g = c.benchmark_group("alloc_n_contended");
    g.throughput(Throughput::Elements(u64::from(2 * N)));
    let p = Arc::new(Pagedkv::new());
    g.bench_function(BenchmarkId::new("pagedkv", N), |b| {
        b.iter_custom(|iters| {
            run_contended_with(iters, Vec::with_capacity(N as usize), |ids, thread| {
                ids.clear();
                p.pool.alloc_n(EngineId(thread), N, ids).unwrap();
                p.pool.free_n(black_box(ids)).unwrap();
            })
        })
    });
    assert_eq!(p.free_count(), BLOCKS as usize);
    g.bench_function(BenchmarkId::new("pagedkv_same_engine", N), |b| {
        b.iter_custom(|iters| {
            run_contended_with(iters, Vec::with_capacity(N as usize), |ids, _| {
                ids.clear();
                p.pool.alloc_n(EngineId(0), N, ids).unwrap();
                p.pool.free_n(black_box(ids)).unwrap();
            })
        })
    });
    assert_eq!(p.free_count(), BLOCKS as usize);
    let m = Arc::new(KapslMutexVecDeque::new());
    g.bench_function(BenchmarkId::new("mutex_vecdeque", N), |b| {
        b.iter_custom(|iters| {
            run_contended_with(iters, Vec::with_capacity(N as usize), |out, _| {
                out.clear();
                assert!(m.alloc_n(N as usize, out));
                m.free_n(black_box(out));
            })
        })
    });
    assert_eq!(m.free_count(), BLOCKS as usize);
    let q = Arc::new(CrossbeamArrayQueue::new());
    g.bench_function(BenchmarkId::new("crossbeam_arrayqueue", N), |b| {
        b.iter_custom(|iters| {
            run_contended_with(iters, Vec::with_capacity(N as usize), |out, _| {
                out.clear();
                assert!(q.alloc_n(N as usize, out));
                q.free_n(black_box(out));
            })
        })
    });
    assert_eq!(q.free_count(), BLOCKS as usize);
    g.finish();
}

/// A thread's table (made on its first iteration, reused: a table's slots are allocated once)
/// and `grow`'s scratch.
#[derive(Default)]
struct TableScratch {
    table: Option<BlockTable>,
    ids: Vec<BlockId>,
}

impl Clone for TableScratch {
    fn clone(&self) -> Self {
        Self::default()
    }
}

/// A sequence's pages as the engine's batcher handles them: two threads, each one engine's
/// scheduler (engines 0 and 1 on one pool), each growing a [`BlockTable`] by 16 pages and
/// clearing it (a sequence admitted and finished); one iteration is one such pair on each
/// thread. `release_each` is the same pair with each page released alone (`alloc_n` +
/// 16 x `release`: how tables gave pages back before they went through `free_n`, every page
/// a CAS on the shared head); the kapsl mutex does `alloc_n` + `free_n` under its lock.
fn table_contended(c: &mut Criterion) {
    const N: u32 = 16;
    let mut g = c.benchmark_group("table_contended");
    g.throughput(Throughput::Elements(u64::from(2 * N)));
    let pool = Arc::new(Pagedkv::new().pool);
    g.bench_function(BenchmarkId::new("pagedkv_table", N), |b| {
        b.iter_custom(|iters| {
            run_contended_with(iters, TableScratch::default(), |s, thread| {
                let table = s.table.get_or_insert_with(|| {
                    BlockTable::new(Arc::clone(&pool), EngineId(thread), N).unwrap()
                });
                table.grow(N, &mut s.ids).unwrap();
                black_box(table.clear());
            })
        })
    });
    assert_eq!(pool.free_count(), BLOCKS);
    g.bench_function(BenchmarkId::new("release_each", N), |b| {
        b.iter_custom(|iters| {
            run_contended_with(iters, Vec::with_capacity(N as usize), |ids, thread| {
                ids.clear();
                pool.alloc_n(EngineId(thread), N, ids).unwrap();
                for &id in ids.iter() {
                    pool.release(black_box(id)).unwrap();
                }
            })
        })
    });
    assert_eq!(pool.free_count(), BLOCKS);
    let m = Arc::new(KapslMutexVecDeque::new());
    g.bench_function(BenchmarkId::new("mutex_vecdeque", N), |b| {
        b.iter_custom(|iters| {
            run_contended_with(iters, Vec::with_capacity(N as usize), |out, _| {
                out.clear();
                assert!(m.alloc_n(N as usize, out));
                m.free_n(black_box(out));
            })
        })
    });
    assert_eq!(m.free_count(), BLOCKS as usize);
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = alloc_free, contended, alloc_n, alloc_n_contended, table_contended
}
criterion_main!(benches);
