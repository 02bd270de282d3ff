//! Budget coordinator benches: the hot-path calls and the recomputation for 64 engines, each
//! beside the kapsl design (`GlobalKvScheduler`: a `HashMap` of engines, `&mut self`, so shared
//! behind a `Mutex`) in the same group. kapsl has no acquire/release; its baseline keeps the
//! used tokens and held blocks in the same `HashMap` entries, under the same lock, checked
//! against the budgets of its last `allocate_budgets` — the way its callers would bolt it on.
//!
//! `cargo bench --bench budget -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::block::EngineId;
use pagedkv::budget::{BudgetConfig, BudgetCoordinator, Publication};
use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Our re-implementation of the kapsl `GlobalKvScheduler` design, with per-engine usage counters.
mod kapsl {
    use std::collections::HashMap;

    #[derive(Debug)]
    struct Engine {
        weight: u32,
        active: bool,
        budget: usize,
        used_tokens: usize,
        block_quota: usize,
        held_blocks: usize,
    }

    #[derive(Debug)]
    pub struct Scheduler {
        tokens: usize,
        blocks: usize,
        cap_permille: u32,
        engines: HashMap<u32, Engine>,
        order: Vec<u32>,
    }

    impl Scheduler {
        pub fn new(tokens: usize, blocks: usize, cap_permille: u32) -> Self {
            Self {
                tokens,
                blocks,
                cap_permille,
                engines: HashMap::new(),
                order: Vec::new(),
            }
        }

        pub fn register(&mut self, id: u32, weight: u32) {
            if !self.engines.contains_key(&id) {
                self.order.push(id);
            }
            let e = Engine {
                weight: weight.max(1),
                active: false,
                budget: 0,
                used_tokens: 0,
                block_quota: 0,
                held_blocks: 0,
            };
            self.engines.insert(id, e);
        }

        pub fn set_active(&mut self, id: u32, active: bool) {
            if let Some(e) = self.engines.get_mut(&id) {
                e.active = active;
            }
        }

        /// kapsl's algorithm: natural shares over all engines, idle engines' natural shares all
        /// to the first active engine (uncapped), the rounding leftover to it within the cap.
        pub fn allocate_budgets(&self) -> Vec<(u32, usize)> {
            let any_active = self.engines.values().any(|e| e.active);
            let total_weight: u64 = self
                .engines
                .values()
                .map(|e| u64::from(e.weight))
                .sum::<u64>()
                .max(1);
            let cap = self.tokens * self.cap_permille as usize / 1000;
            let mut out = Vec::with_capacity(self.order.len());
            let (mut idle, mut natural_sum) = (0usize, 0usize);
            for id in &self.order {
                let Some(e) = self.engines.get(id) else {
                    continue;
                };
                let natural = (self.tokens as u64 * u64::from(e.weight) / total_weight) as usize;
                natural_sum += natural;
                if e.active || !any_active {
                    out.push((*id, natural.min(cap)));
                } else {
                    idle += natural;
                    out.push((*id, 0));
                }
            }
            if let Some(first) = out.iter_mut().find(|b| b.1 > 0) {
                first.1 += idle;
                let rounding = self.tokens.saturating_sub(natural_sum);
                first.1 += rounding.min(cap.saturating_sub(first.1));
            }
            out
        }

        /// kapsl's `budget_for`: recomputes every budget to answer for one engine.
        pub fn budget_for(&self, id: u32) -> Option<usize> {
            self.allocate_budgets()
                .into_iter()
                .find(|b| b.0 == id)
                .map(|b| b.1)
        }

        /// Recomputes and caches the budgets (and block quotas by weight) in the engines.
        pub fn refresh(&mut self) -> usize {
            let budgets = self.allocate_budgets();
            let total_weight: u64 = self
                .engines
                .values()
                .map(|e| u64::from(e.weight))
                .sum::<u64>()
                .max(1);
            let mut sum = 0;
            for (id, b) in budgets {
                if let Some(e) = self.engines.get_mut(&id) {
                    e.budget = b;
                    e.block_quota =
                        (self.blocks as u64 * u64::from(e.weight) / total_weight) as usize;
                    sum += b;
                }
            }
            sum
        }

        pub fn cached_budget(&self, id: u32) -> usize {
            self.engines.get(&id).map_or(0, |e| e.budget)
        }

        pub fn try_acquire_tokens(&mut self, id: u32, n: usize) -> bool {
            match self.engines.get_mut(&id) {
                Some(e) if e.used_tokens + n <= e.budget => {
                    e.used_tokens += n;
                    true
                }
                _ => false,
            }
        }

        pub fn release_tokens(&mut self, id: u32, n: usize) {
            if let Some(e) = self.engines.get_mut(&id) {
                e.used_tokens -= n;
            }
        }

        pub fn try_acquire_blocks(&mut self, id: u32, n: usize) -> bool {
            // kapsl has no cross-engine block view: the engine's quota is all it can check.
            match self.engines.get_mut(&id) {
                Some(e) if e.held_blocks + n <= e.block_quota => {
                    e.held_blocks += n;
                    true
                }
                _ => false,
            }
        }

        pub fn release_blocks(&mut self, id: u32, n: usize) {
            if let Some(e) = self.engines.get_mut(&id) {
                e.held_blocks -= n;
            }
        }
    }
}

const TOKENS: u32 = 8192;
const BLOCKS: u32 = 4096;

/// Both designs with `n` engines of weights 1..=4, every other one active.
fn setup(n: u16) -> (BudgetCoordinator, Mutex<kapsl::Scheduler>) {
    let ours = BudgetCoordinator::new(BudgetConfig::new(n, TOKENS, BLOCKS).with_cap_permille(900))
        .unwrap();
    let mut theirs = kapsl::Scheduler::new(TOKENS as usize, BLOCKS as usize, 900);
    for i in 0..n {
        let w = u32::from(i % 4) + 1;
        let e = ours.register(w).unwrap();
        assert_eq!(e, EngineId(i));
        theirs.register(u32::from(i), w);
        let active = i % 2 == 0;
        ours.set_active(e, active);
        theirs.set_active(u32::from(i), active);
    }
    ours.recompute();
    theirs.refresh();
    (ours, Mutex::new(theirs))
}

fn hot_path(c: &mut Criterion) {
    let (ours, theirs) = setup(8);
    let e = EngineId(0);
    assert!(ours.token_budget(e) > 16 && ours.block_limit(e) > 4);
    assert!(theirs.lock().unwrap().cached_budget(0) > 16);

    let mut g = c.benchmark_group("budget/hot/tokens_acquire_release");
    g.throughput(Throughput::Elements(1));
    g.bench_function("pagedkv", |b| {
        b.iter(|| {
            assert!(ours.try_acquire_tokens(black_box(e), 16));
            ours.release_tokens(e, 16).unwrap();
        })
    });
    g.bench_function("kapsl_mutex", |b| {
        b.iter(|| {
            let mut s = theirs.lock().unwrap();
            assert!(s.try_acquire_tokens(black_box(0), 16));
            s.release_tokens(0, 16);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("budget/hot/blocks_acquire_release");
    g.throughput(Throughput::Elements(1));
    g.bench_function("pagedkv", |b| {
        b.iter(|| {
            ours.try_acquire_blocks(black_box(e), 4).unwrap();
            ours.release_blocks(e, 4).unwrap();
        })
    });
    g.bench_function("kapsl_mutex", |b| {
        b.iter(|| {
            let mut s = theirs.lock().unwrap();
            assert!(s.try_acquire_blocks(black_box(0), 4));
            s.release_blocks(0, 4);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("budget/hot/set_active");
    g.throughput(Throughput::Elements(1));
    // Marking an already-active engine active: the per-step call an engine makes.
    g.bench_function("pagedkv", |b| {
        b.iter(|| assert!(ours.set_active(black_box(e), true)))
    });
    g.bench_function("kapsl_mutex", |b| {
        b.iter(|| theirs.lock().unwrap().set_active(black_box(0), true))
    });
    g.finish();

    let mut g = c.benchmark_group("budget/hot/read_budget");
    g.throughput(Throughput::Elements(1));
    let want = ours.token_budget(e);
    g.bench_function("pagedkv", |b| {
        b.iter(|| assert!(ours.token_budget(black_box(e)) == want))
    });
    g.bench_function("kapsl_mutex_cached", |b| {
        b.iter(|| assert!(theirs.lock().unwrap().cached_budget(black_box(0)) > 0))
    });
    g.bench_function("kapsl_mutex_budget_for", |b| {
        b.iter(|| assert!(theirs.lock().unwrap().budget_for(black_box(0)).is_some()))
    });
    g.finish();
}

fn recompute(c: &mut Criterion) {
    let mut g = c.benchmark_group("budget/recompute");
    for n in [8u16, 64] {
        let (ours, theirs) = setup(n);
        g.throughput(Throughput::Elements(u64::from(n)));
        // An engine turns idle or active, then everything is recomputed (the common trigger).
        let mut flip = false;
        g.bench_with_input(BenchmarkId::new("pagedkv_activity", n), &n, |b, _| {
            b.iter(|| {
                flip = !flip;
                ours.set_active(EngineId(1), flip);
                assert!(matches!(ours.recompute(), Publication::Published { .. }));
            })
        });
        ours.set_active(EngineId(1), true);
        ours.recompute();
        let sum: u32 = (0..n).map(|i| ours.token_budget(EngineId(i))).sum();
        assert_eq!(sum, TOKENS);
        // An active engine's demand moves between a few tokens and all it can take, then
        // everything is recomputed: the per-step trigger under token lending (a second
        // water-fill, capped by demand). kapsl has no lending: compare with the activity rows.
        let mut low = false;
        g.bench_with_input(BenchmarkId::new("pagedkv_demand", n), &n, |b, _| {
            b.iter(|| {
                low = !low;
                ours.publish_demand(EngineId(0), if low { 8 } else { u32::MAX });
                assert!(matches!(ours.recompute(), Publication::Published { .. }));
            })
        });
        ours.publish_demand(EngineId(0), u32::MAX);
        ours.recompute();
        // The same for block demand: an active engine needs a few of its blocks, then all it
        // can get (block lending: the lendable blocks filled by demand, then the leftover).
        g.bench_with_input(BenchmarkId::new("pagedkv_block_demand", n), &n, |b, _| {
            b.iter(|| {
                low = !low;
                ours.publish_block_demand(EngineId(0), if low { 1 } else { u32::MAX });
                assert!(matches!(ours.recompute(), Publication::Published { .. }));
            })
        });
        ours.publish_block_demand(EngineId(0), u32::MAX);
        ours.recompute();
        g.bench_with_input(BenchmarkId::new("kapsl_mutex_activity", n), &n, |b, _| {
            b.iter(|| {
                flip = !flip;
                let mut s = theirs.lock().unwrap();
                s.set_active(1, flip);
                assert!(s.refresh() > 0);
            })
        });
        // A weight changes: block quotas are recomputed too.
        let mut w = 1;
        g.bench_with_input(BenchmarkId::new("pagedkv_reweight", n), &n, |b, _| {
            b.iter(|| {
                w = w % 7 + 1;
                ours.set_weight(EngineId(3), w).unwrap();
            })
        });
        let quotas: u32 = (0..n).map(|i| ours.block_quota(EngineId(i))).sum();
        assert_eq!(quotas, BLOCKS);
        g.bench_with_input(BenchmarkId::new("kapsl_mutex_reweight", n), &n, |b, _| {
            b.iter(|| {
                w = w % 7 + 1;
                let mut s = theirs.lock().unwrap();
                s.register(3, w);
                s.set_active(3, true);
                assert!(s.refresh() > 0);
            })
        });
    }
    g.finish();
}

/// Runs `op` on two threads at once, `iters` times each; returns the wall time.
fn two_threads(iters: u64, op: impl Fn(usize) + Sync) -> Duration {
    let barrier = Barrier::new(2);
    thread::scope(|s| {
        let h = s.spawn(|| {
            barrier.wait();
            for _ in 0..iters {
                op(1);
            }
        });
        barrier.wait();
        let start = Instant::now();
        for _ in 0..iters {
            op(0);
        }
        h.join().unwrap();
        start.elapsed()
    })
}

fn contended(c: &mut Criterion) {
    let (ours, theirs) = setup(8);
    let (ours, theirs) = (Arc::new(ours), Arc::new(theirs));
    // Thread t drives engine 2t (both active): each engine's own thread, as in a server.
    let engine = |t: usize| EngineId(2 * t as u16);

    let mut g = c.benchmark_group("budget/contended_2_threads/tokens_acquire_release");
    g.throughput(Throughput::Elements(2));
    g.bench_function("pagedkv", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |t| {
                assert!(ours.try_acquire_tokens(engine(t), 16));
                ours.release_tokens(engine(t), 16).unwrap();
            })
        })
    });
    g.bench_function("kapsl_mutex", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |t| {
                let id = engine(t).0.into();
                let mut s = theirs.lock().unwrap();
                assert!(s.try_acquire_tokens(id, 16));
                s.release_tokens(id, 16);
            })
        })
    });
    g.finish();

    let mut g = c.benchmark_group("budget/contended_2_threads/same_engine_tokens");
    g.throughput(Throughput::Elements(2));
    // Both threads on one engine (budget 1024: weight 1 of the active weight 8): the worst case.
    g.bench_function("pagedkv", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |_| {
                assert!(ours.try_acquire_tokens(EngineId(0), 16));
                ours.release_tokens(EngineId(0), 16).unwrap();
            })
        })
    });
    g.bench_function("kapsl_mutex", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |_| {
                let mut s = theirs.lock().unwrap();
                assert!(s.try_acquire_tokens(0, 16));
                s.release_tokens(0, 16);
            })
        })
    });
    g.finish();

    let mut g = c.benchmark_group("budget/contended_2_threads/blocks_acquire_release");
    g.throughput(Throughput::Elements(2));
    g.bench_function("pagedkv", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |t| {
                ours.try_acquire_blocks(engine(t), 4).unwrap();
                ours.release_blocks(engine(t), 4).unwrap();
            })
        })
    });
    g.bench_function("kapsl_mutex", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, |t| {
                let id = engine(t).0.into();
                let mut s = theirs.lock().unwrap();
                assert!(s.try_acquire_blocks(id, 4));
                s.release_blocks(id, 4);
            })
        })
    });
    g.finish();
    assert_eq!(ours.blocks_in_use(), 0);
}

criterion_group!(benches, hot_path, recompute, contended);
criterion_main!(benches);
