//! Multi-engine scenarios: batchers sharing one pool and one coordinator, stepped the way the
//! engine driver steps them, checked against the coordinator's documented arithmetic.

use pagedkv::block::{BlockPool, EngineId, PoolConfig};
use pagedkv::budget::{BudgetConfig, BudgetCoordinator};
use pagedkv::sched::{
    Batcher, BatcherConfig, EngineShare, FinishedSeq, PreemptionMode, Priority, SeqRequest,
    StopRules,
};
use std::sync::Arc;

const BS: u32 = 4;

struct Eng {
    id: EngineId,
    bt: Batcher,
    next: u64,
    done: Vec<FinishedSeq>,
    scheduled: Vec<u32>,
}

struct World {
    c: Arc<BudgetCoordinator>,
    pool: Arc<BlockPool>,
    engines: Vec<Eng>,
}

fn world(max_engines: u16, tokens: u32, blocks: u32) -> World {
    let c =
        Arc::new(BudgetCoordinator::new(BudgetConfig::new(max_engines, tokens, blocks)).unwrap());
    let pool = Arc::new(
        BlockPool::new(PoolConfig {
            device: 0,
            num_blocks: blocks,
            max_engines,
        })
        .unwrap(),
    );
    World {
        c,
        pool,
        engines: Vec::new(),
    }
}

impl World {
    fn join(&mut self, weight: u32, preemption: PreemptionMode) -> usize {
        let id = self.c.register(weight).unwrap();
        self.c.recompute();
        let mut bt = Batcher::new(
            BatcherConfig {
                engine: id,
                block_size: BS,
                max_running: 64,
                max_batched_tokens: 4096,
                max_prefill_chunk: 4096,
                max_blocks_per_seq: 256,
                preemption,
                swap_blocks: 64,
            },
            self.pool.clone(),
        )
        .unwrap();
        bt.attach_budget(Box::new(EngineShare::new(self.c.clone(), id)));
        self.engines.push(Eng {
            id,
            bt,
            next: 0,
            done: Vec::new(),
            scheduled: Vec::new(),
        });
        self.engines.len() - 1
    }

    fn add(&mut self, e: usize, n: usize, prompt: usize, new: u32, priority: Priority) {
        let eng = &mut self.engines[e];
        for _ in 0..n {
            eng.next += 1;
            eng.bt
                .add(SeqRequest {
                    id: eng.next,
                    prompt: vec![7; prompt],
                    stop: StopRules {
                        max_new_tokens: new,
                        ..Default::default()
                    },
                    priority,
                })
                .unwrap();
        }
    }

    /// One step of every engine, in order, as the driver does it.
    fn step(&mut self) {
        for e in 0..self.engines.len() {
            self.schedule_one(e);
            self.commit_one(e);
        }
        self.c.recompute();
    }

    /// Engine `e`'s schedule, as the driver starts a step: activity, a pending publication, a
    /// lender's reclaim order, then the batch.
    fn schedule_one(&mut self, e: usize) {
        let c = &self.c;
        let eng = &mut self.engines[e];
        eng.bt.sync_activity();
        c.maybe_recompute();
        let shed = c.reclaim_for(eng.id);
        if shed > 0 {
            eng.bt.request_shed(shed);
        }
        let t = eng.bt.schedule_into(&mut eng.done).num_tokens() as u32;
        eng.scheduled.push(t);
    }

    /// Engine `e`'s commit of its scheduled batch, and a pending publication.
    fn commit_one(&mut self, e: usize) {
        let eng = &mut self.engines[e];
        let n = eng.bt.batch().num_samples();
        eng.bt.commit(&vec![9; n], &mut eng.done).unwrap();
        self.c.maybe_recompute();
    }

    fn check_sums(&self) {
        let s = self.c.snapshot();
        let held: u64 = s.engines.iter().map(|e| e.blocks_held).sum();
        assert_eq!(held, s.blocks_in_use, "{s:?}");
        assert!(s.blocks_in_use <= u64::from(s.total_blocks));
        assert_eq!(
            u64::from(self.pool.total() - self.pool.free_count()),
            s.blocks_in_use,
            "pool and budget disagree: {s:?}"
        );
        assert!(s.tokens_in_use <= u64::from(s.tokens_per_step));
    }
}

/// Both engines saturated at weights 1:3: after the first step (B not active yet), every step
/// schedules exactly 16 and 48 of the device's 64 tokens.
#[test]
fn saturated_engines_get_tokens_by_weight() {
    let mut w = world(4, 64, 256);
    let a = w.join(1, PreemptionMode::Recompute);
    let b = w.join(3, PreemptionMode::Recompute);
    w.add(a, 40, 64, 2, Priority::Throughput);
    w.add(b, 40, 64, 2, Priority::Throughput);
    for _ in 0..20 {
        w.step();
        w.check_sums();
    }
    let ta: u32 = w.engines[a].scheduled[2..20].iter().sum();
    let tb: u32 = w.engines[b].scheduled[2..20].iter().sum();
    assert_eq!((ta, tb), (16 * 18, 48 * 18));
}

impl World {
    fn leave(&mut self, e: usize) {
        let eng = self.engines.remove(e);
        let id = eng.id;
        drop(eng);
        self.c.deregister(id).unwrap();
        self.c.recompute();
    }
}

/// A borrower that leaves with a reclaim order pending, and engines leaving one by one while
/// others borrow, leave the pool and the coordinator's counts in agreement, and all at zero.
#[test]
fn engines_leaving_mid_loan_and_mid_reclaim_leak_nothing() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let mut w = world(4, 64, 64);
        let a = w.join(1, mode);
        let _b = w.join(2, mode);
        w.add(a, 30, 20, 40, Priority::Throughput);
        for _ in 0..6 {
            w.step();
            w.check_sums();
        }
        // B bursts: A is over its new limit; a third engine joins too.
        w.add(1, 10, 20, 40, Priority::LatencyCritical);
        w.engines[1].bt.sync_activity();
        let c = w.join(1, mode);
        w.add(c, 5, 30, 10, Priority::Throughput);
        w.c.recompute();
        assert!(w.c.reclaim_for(w.engines[a].id) > 0);
        w.check_sums();
        // A leaves before shedding.
        w.leave(a);
        w.check_sums();
        for _ in 0..5 {
            w.step();
            w.check_sums();
        }
        w.leave(0);
        for _ in 0..3 {
            w.step();
            w.check_sums();
        }
        w.leave(0);
        w.check_sums();
        assert_eq!(w.c.blocks_in_use(), 0);
        assert_eq!(w.c.tokens_in_use(), 0);
        assert_eq!(w.pool.free_count(), 64);
    }
}

/// An idle engine's share is lent to the busy one, and given back at the borrower's next step
/// once the lender has work.
#[test]
fn idle_share_is_lent_and_given_back() {
    let mut w = world(4, 64, 64);
    let a = w.join(1, PreemptionMode::Recompute);
    let b = w.join(1, PreemptionMode::Recompute);
    // A alone: borrows B's share (64 blocks of 4 tokens = 256 tokens).
    w.add(a, 30, 20, 40, Priority::Throughput);
    for _ in 0..10 {
        w.step();
        w.check_sums();
    }
    let s = w.c.snapshot();
    assert!(s.engines[a].blocks_held > 32, "{s:?}");
    // B bursts: A's limit falls back to its quota at once, and A gives the pages back at
    // its next step.
    w.add(b, 10, 20, 40, Priority::Throughput);
    for step in 0..30 {
        w.step();
        w.check_sums();
        let (ida, idb) = (w.engines[a].id, w.engines[b].id);
        assert_eq!((w.c.block_limit(ida), w.c.block_limit(idb)), (32, 32));
        if step >= 1 {
            assert!(
                w.c.blocks_held(ida) <= 32,
                "step {step}: {:?}",
                w.c.snapshot()
            );
        }
    }
}

/// Random joins, leaves and bursts of 1-4 engines: pool and coordinator agree after every step,
/// the active engines' reservations and loans never promise more than the pool less what idle
/// engines hold, every
/// engine's work drains, and nothing is left once all have left.
#[test]
fn random_join_leave_burst_keeps_the_books() {
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    for seed in 0..40u64 {
        let mut rng = SmallRng::seed_from_u64(seed);
        let blocks = rng.gen_range(16..96);
        let tokens = rng.gen_range(8..128);
        let mut w = world(4, tokens, blocks);
        for _ in 0..200 {
            match rng.gen_range(0..10) {
                0 if w.engines.len() < 4 => {
                    let mode = if rng.gen() {
                        PreemptionMode::Swap
                    } else {
                        PreemptionMode::Recompute
                    };
                    w.join(rng.gen_range(1..5), mode);
                }
                1 if !w.engines.is_empty() && rng.gen_range(0..4) == 0 => {
                    let e = rng.gen_range(0..w.engines.len());
                    w.leave(e);
                }
                2 | 3 if !w.engines.is_empty() => {
                    let e = rng.gen_range(0..w.engines.len());
                    let q = w.c.guaranteed_blocks(w.engines[e].id).unwrap_or(0);
                    let max_tokens = (q * BS).min(200) as usize;
                    if max_tokens > 8 {
                        let p = rng.gen_range(1..max_tokens / 2);
                        let new = rng.gen_range(1..(max_tokens - p) as u32);
                        let prio = if rng.gen() {
                            Priority::LatencyCritical
                        } else {
                            Priority::Throughput
                        };
                        let n = rng.gen_range(1..6);
                        let eng = &mut w.engines[e];
                        for _ in 0..n {
                            eng.next += 1;
                            let _ = eng.bt.add(SeqRequest {
                                id: eng.next,
                                prompt: vec![7; p],
                                stop: StopRules {
                                    max_new_tokens: new,
                                    ..Default::default()
                                },
                                priority: prio,
                            });
                        }
                    }
                }
                _ => {}
            }
            w.step();
            w.check_sums();
            // What the active engines reserve (their quota, or their block demand where lower,
            // at least what they hold) and may borrow above their quotas fits beside what the
            // idle ones hold (the publication at the end of the step saw these holdings).
            let s = w.c.snapshot();
            assert!(s.consistent);
            let promised: u64 = s
                .engines
                .iter()
                .map(|e| e.blocks_reserved() + u64::from(e.block_limit - e.block_quota))
                .sum();
            assert!(promised <= u64::from(blocks), "seed {seed}: {s:?}");
        }
        // Drain, then everyone leaves.
        for _ in 0..2000 {
            if w.engines.iter().all(|e| !e.bt.has_work()) {
                break;
            }
            w.step();
            w.check_sums();
        }
        let stuck: Vec<_> = w
            .engines
            .iter()
            .map(|e| {
                (
                    e.id,
                    e.bt.num_waiting(),
                    e.bt.num_running(),
                    e.bt.num_swapped(),
                    w.c.token_budget(e.id),
                    w.c.block_limit(e.id),
                )
            })
            .filter(|x| x.1 + x.2 + x.3 > 0)
            .collect();
        assert!(
            stuck.is_empty(),
            "seed {seed}: starved {stuck:?} {:?}",
            w.c.snapshot()
        );
        while !w.engines.is_empty() {
            w.leave(0);
        }
        assert_eq!(
            (
                w.c.blocks_in_use(),
                w.c.tokens_in_use(),
                w.pool.free_count()
            ),
            (0, 0, blocks)
        );
    }
}

/// Weights 1000:1:1 over 512 tokens: exact shares 510.98, 0.51, 0.51, which largest-remainder
/// rounding makes 511, 1, 0 (the tie to the lower id). The third engine, of the same weight as
/// the second, then never got a token while the others had work, though the heavy engine
/// used one token a step of its 511.
#[test]
fn equal_weight_engines_are_not_starved_by_rounding() {
    let mut w = world(4, 512, 1024);
    let big = w.join(1000, PreemptionMode::Recompute);
    let x = w.join(1, PreemptionMode::Recompute);
    let y = w.join(1, PreemptionMode::Recompute);
    // The big engine has a little work that lasts: one long decode.
    w.add(big, 1, 4, 1000, Priority::Throughput);
    w.add(x, 100, 2, 2, Priority::Throughput);
    w.add(y, 1, 2, 2, Priority::Throughput);
    for _ in 0..200 {
        w.step();
    }
    let budgets: Vec<u32> = w.engines.iter().map(|e| w.c.token_budget(e.id)).collect();
    assert!(!w.engines[x].done.is_empty());
    assert_eq!(
        w.engines[y].done.len(),
        1,
        "engine y, weight 1 like x, never ran: budgets {budgets:?}"
    );
}

/// An active engine that uses less than its share (A: four decoders) lends the rest to one
/// that wants more (B: long prompts), step after step, and takes its whole share back the
/// step its own work grows: B gives back what it holds above its share once its batch has
/// run, so A does not wait for B's next step.
#[test]
fn an_active_engines_unused_share_is_lent_and_taken_back() {
    // 64 tokens, weights 1:1: shares of 32; demand quantum 2.
    let mut w = world(4, 64, 256);
    let a = w.join(1, PreemptionMode::Recompute);
    let b = w.join(1, PreemptionMode::Recompute);
    w.add(a, 4, 4, 200, Priority::Throughput);
    w.add(b, 40, 64, 2, Priority::Throughput);
    for _ in 0..6 {
        w.step();
        w.check_sums();
    }
    let (ida, idb) = (w.engines[a].id, w.engines[b].id);
    // A decodes 4 tokens a step and says so; B takes the other 60.
    assert_eq!(w.c.token_demand(ida), Some(4));
    assert_eq!(w.c.token_demand(idb), None);
    assert_eq!((w.c.token_share(ida), w.c.token_share(idb)), (32, 32));
    assert_eq!((w.c.token_budget(ida), w.c.token_budget(idb)), (32, 60));
    for _ in 0..4 {
        w.step();
        w.check_sums();
        let last = |e: usize| *w.engines[e].scheduled.last().unwrap();
        assert_eq!((last(a), last(b)), (4, 60), "{:?}", w.c.snapshot());
        // Between steps B holds no more than its share.
        assert_eq!(w.c.tokens_granted(idb), 32);
    }
    // A's work grows: its next step takes its whole share, and B, whose budget still says 60
    // until the publication after A's step, gets what the device has left.
    w.add(a, 10, 64, 2, Priority::Throughput);
    w.step();
    w.check_sums();
    let last = |w: &World, e: usize| *w.engines[e].scheduled.last().unwrap();
    assert_eq!((last(&w, a), last(&w, b)), (32, 32));
    assert_eq!(w.c.token_demand(ida), None);
    assert_eq!((w.c.token_budget(ida), w.c.token_budget(idb)), (32, 32));
    for _ in 0..5 {
        w.step();
        w.check_sums();
        assert_eq!((last(&w, a), last(&w, b)), (32, 32));
    }
}

impl World {
    /// One step of every engine with their steps overlapping, as engines on their own threads
    /// run them: each schedules in `order` while the ones before it hold their batches, then
    /// every batch runs and commits.
    fn step_overlapped(&mut self, order: &[usize]) {
        for &e in order {
            self.schedule_one(e);
        }
        for &e in order {
            self.commit_one(e);
        }
        self.c.recompute();
    }
}

/// A light engine (Z, weight 1: its share of 64 tokens rounds to 0 and is lifted to one token)
/// beside a lender (A, four decoders) and a borrower (B, long prompts), their steps
/// overlapping. The lending fill, without the lift, gave B every token A's demand leaves, Z's
/// lifted one included: while B's step ran it held them all, and Z, scheduling then, got
/// nothing, step after step.
#[test]
fn a_lifted_share_is_not_lent_away() {
    let mut w = world(4, 64, 4096);
    let a = w.join(1000, PreemptionMode::Recompute);
    let b = w.join(1000, PreemptionMode::Recompute);
    let z = w.join(1, PreemptionMode::Recompute);
    w.add(a, 4, 4, 200, Priority::Throughput);
    w.add(b, 40, 64, 2, Priority::Throughput);
    for _ in 0..4 {
        w.step();
        w.check_sums();
    }
    assert_eq!(w.c.token_demand(w.engines[a].id), Some(4));
    // Z gets work while B borrows.
    w.add(z, 4, 2, 2, Priority::Throughput);
    for step in 0..6 {
        w.step_overlapped(&[b, a, z]);
        w.check_sums();
        if step >= 1 {
            let s = w.c.snapshot();
            assert!(
                *w.engines[z].scheduled.last().unwrap() >= 1,
                "step {step}: Z, share {}, got no token; B's budget {}: {s:?}",
                s.engines[z].token_share,
                s.engines[b].token_budget
            );
        }
    }
}

/// Block lending between active engines: A runs two short sequences and says it needs about
/// 24 of its 64 pages, so B, flooded, borrows the rest of A's quota while A stays active. When
/// A's work grows past the pages the pool has free, its next step's demand counts the new
/// work: B's limit drops by as much (not to its quota: A still leaves part of its own), B
/// gives the pages back at its next step, and A meanwhile waits for them rather than preempt
/// its own sequences.
#[test]
fn an_active_engines_unused_pages_are_lent_and_taken_back() {
    // 128 blocks of 4 tokens, weights 1:1: quotas of 64; block demand quantum 2.
    let mut w = world(4, 256, 128);
    let a = w.join(1, PreemptionMode::Recompute);
    let b = w.join(1, PreemptionMode::Recompute);
    let (ida, idb) = (w.engines[a].id, w.engines[b].id);
    w.add(a, 2, 8, 40, Priority::Throughput);
    w.add(b, 40, 16, 40, Priority::Throughput);
    for _ in 0..8 {
        w.step();
        w.check_sums();
    }
    let demand = w.c.block_demand(ida).expect("A published a demand");
    assert!(demand <= 24, "{:?}", w.c.snapshot());
    assert_eq!(w.c.block_demand(idb), None);
    assert_eq!((w.c.block_quota(ida), w.c.block_quota(idb)), (64, 64));
    assert_eq!(w.c.block_limit(idb), 128 - demand);
    assert!(
        w.c.blocks_held(idb) > 64,
        "B borrowed nothing: {:?}",
        w.c.snapshot()
    );
    // A's work grows within its quota (two more sequences of 18 pages at most, 16 at their
    // admission), past the pages the pool has free beside what B borrowed.
    let free = 128 - w.c.blocks_in_use();
    assert!(free < 32, "{:?}", w.c.snapshot());
    w.add(a, 2, 64, 8, Priority::Throughput);
    let held = w.c.blocks_held(ida);
    w.step();
    w.check_sums();
    // Its demand: what it held, the new sequences' 36 pages and its first ones' growth.
    let raised = w.c.block_demand(ida).expect("A still lends");
    assert!(
        u64::from(raised) >= held + 36 && raised < 64,
        "{:?}",
        w.c.snapshot()
    );
    assert_eq!(w.c.block_limit(idb), 128 - raised);
    // B gives the pages back at its next step; A's work runs to its end.
    for step in 0..40 {
        w.step();
        w.check_sums();
        if step == 0 {
            assert!(
                w.c.blocks_held(idb) <= u64::from(128 - raised),
                "{:?}",
                w.c.snapshot()
            );
        }
    }
    let s = w.engines[a].bt.stats();
    assert_eq!(
        (s.preempted_recompute, s.preempted_swap),
        (0, 0),
        "A preempted its own sequences for pages it had lent"
    );
    assert_eq!(w.engines[a].bt.stats().finished, 4);
}

/// Engines A and B (quotas of 16 of 32 pages of 4 tokens; block demand quantum 1): A runs one
/// throughput sequence (a page of prompt, 6 pages at its longest) and needs 6 pages; B, flooded,
/// holds the other 10 of A's quota beside its own 16. Five pages are free.
fn a_lends_to_b() -> (World, usize, usize) {
    let mut w = world(4, 256, 32);
    let a = w.join(1, PreemptionMode::Recompute);
    let b = w.join(1, PreemptionMode::Recompute);
    let (ida, idb) = (w.engines[a].id, w.engines[b].id);
    w.add(a, 1, 4, 20, Priority::Throughput);
    w.schedule_one(a);
    w.commit_one(a);
    assert_eq!(w.c.block_demand(ida), Some(6));
    w.add(b, 20, 8, 40, Priority::Throughput);
    for _ in 0..10 {
        w.schedule_one(b);
        w.commit_one(b);
        if w.c.blocks_held(idb) == 26 {
            break;
        }
    }
    assert_eq!(w.c.block_limit(idb), 26);
    assert_eq!(w.c.blocks_held(idb), 26, "{:?}", w.c.snapshot());
    (w, a, b)
}

/// [`a_lends_to_b`], then A's pages taken back: A's demand has just risen to 11 and B's limit
/// fallen to 21, and the pool is full. A's next step's decode row needs a page.
fn lender_short_of_lent_pages() -> (World, usize, usize) {
    let (mut w, a, b) = a_lends_to_b();
    let idb = w.engines[b].id;
    // A admits a 4-page prompt into the 5 free pages (its first sequence takes one more): the
    // pool is full, and A's demand rises to 11, taking 5 pages back from B's limit.
    w.add(a, 1, 16, 2, Priority::Throughput);
    w.schedule_one(a);
    w.commit_one(a);
    assert_eq!(w.c.blocks_in_use(), 32);
    assert_eq!(w.c.block_limit(idb), 21);
    (w, a, b)
}

/// A lender that steps twice while the borrower's step runs: its second step's decode row
/// needs a page while the borrower still holds what the first step's raised demand took back
/// from its limit. The row waits a step for the borrower to give the pages back; it preempted
/// the sequence (its whole context recomputed) for a page the engine's own quota covers.
#[test]
fn a_lender_short_of_lent_pages_waits_rather_than_preempt_its_own() {
    let (mut w, a, b) = lender_short_of_lent_pages();
    let idb = w.engines[b].id;
    // A steps again before B: its new sequence's first decode row needs a fifth page.
    w.schedule_one(a);
    w.commit_one(a);
    let s = w.engines[a].bt.stats();
    assert_eq!(
        (s.preempted_recompute, s.preempted_swap),
        (0, 0),
        "A preempted its own sequence for a page it had lent"
    );
    // B gives back at its step; A's row runs at its next.
    w.schedule_one(b);
    w.commit_one(b);
    assert!(w.c.blocks_held(idb) <= 21);
    for _ in 0..30 {
        w.step();
        w.check_sums();
    }
    assert_eq!(w.engines[a].bt.stats().finished, 2);
    let s = w.engines[a].bt.stats();
    assert_eq!((s.preempted_recompute, s.preempted_swap), (0, 0));
}

/// A lender whose borrower does not step (its driver stalled) waits for its lent pages only a
/// few steps, then preempts as with nothing lent: its work is not held up for as long as the
/// borrower stalls.
#[test]
fn a_lender_waits_for_a_borrower_that_does_not_step_only_a_few_steps() {
    let (mut w, a, _) = lender_short_of_lent_pages();
    let preempted = |w: &World| {
        let s = w.engines[a].bt.stats();
        s.preempted_recompute + s.preempted_swap
    };
    for step in 0..4 {
        w.schedule_one(a);
        w.commit_one(a);
        assert_eq!(preempted(&w), 0, "step {step}");
    }
    w.schedule_one(a);
    w.commit_one(a);
    assert_eq!(preempted(&w), 1, "A waited on past its bound");
}

/// A lender's latency-critical row short of pages it lent does not wait for the borrower's
/// step when the engine's own throughput work can give them up at once: it preempts that work
/// as it did before lending (the same order as a latency-critical admission, which asks another
/// engine to donate only what its own throughput sequences do not cover).
#[test]
fn a_lenders_latency_critical_row_preempts_its_throughput_rather_than_wait() {
    let (mut w, a, _) = a_lends_to_b();
    // A admits a latency-critical 4-page prompt into the 5 free pages: the pool is full.
    w.add(a, 1, 16, 4, Priority::LatencyCritical);
    w.schedule_one(a);
    w.commit_one(a);
    assert_eq!(w.c.blocks_in_use(), 32);
    // A steps again before B: the latency-critical decode row needs a fifth page, which the
    // pool has not (B still holds what it borrowed) but A's throughput sequence has.
    w.schedule_one(a);
    let batch = w.engines[a].bt.batch();
    assert!(
        batch.seq_ids.contains(&2),
        "the latency-critical row waited for B: batch {:?}, {:?}",
        batch.seq_ids,
        w.c.snapshot()
    );
    w.commit_one(a);
    assert_eq!(w.engines[a].bt.stats().preempted_recompute, 1);
    for _ in 0..40 {
        w.step();
        w.check_sums();
    }
    assert_eq!(w.engines[a].bt.stats().finished, 2);
}

/// A lender's prefill chunk short of pages it lent runs as much of itself as the pages on hand
/// hold (here the rest of its last page), as it would short of pages for any other reason,
/// rather than wait with nothing for the borrower to give back.
#[test]
fn a_lenders_prefill_chunk_short_of_lent_pages_runs_shorter_rather_than_wait() {
    // 64 blocks of 4 tokens, 16 tokens a step, weights 1:1: quotas of 32; quantum 1.
    let mut w = world(4, 16, 64);
    let a = w.join(1, PreemptionMode::Recompute);
    let b = w.join(1, PreemptionMode::Recompute);
    let idb = w.engines[b].id;
    // A: one short sequence (its demand 6 pages); B, flooded, borrows the rest of A's quota.
    w.add(a, 1, 4, 20, Priority::Throughput);
    w.schedule_one(a);
    w.commit_one(a);
    w.add(b, 30, 8, 40, Priority::Throughput);
    for _ in 0..200 {
        w.schedule_one(b);
        w.commit_one(b);
        if w.c.blocks_held(idb) == 58 {
            break;
        }
    }
    assert_eq!(w.c.blocks_held(idb), 58, "{:?}", w.c.snapshot());
    // A admits a 56-token prompt, 7 tokens a step (its token budget of 8 less its decode):
    // two steps before B's take the pool's last free pages.
    w.add(a, 1, 56, 2, Priority::Throughput);
    for _ in 0..2 {
        w.schedule_one(a);
        w.commit_one(a);
    }
    assert_eq!(w.c.blocks_in_use(), 64, "{:?}", w.c.snapshot());
    // The third chunk's pages are lent to B; the rest of the prompt's last page is not.
    w.schedule_one(a);
    assert!(
        w.engines[a].bt.batch().seq_ids.contains(&2),
        "the prefill row waited with its last page unfilled: {:?}",
        w.engines[a].bt.batch().seq_ids
    );
    w.commit_one(a);
    for _ in 0..60 {
        w.step();
        w.check_sums();
    }
    let s = w.engines[a].bt.stats();
    assert_eq!(
        (s.preempted_recompute, s.preempted_swap, s.finished),
        (0, 0, 2)
    );
}

/// An engine's block demand counts the pages its sequences take over their next 128 tokens
/// (`BLOCK_DEMAND_HORIZON`), not up to their longest: a lender whose one sequence may generate
/// 1000 tokens (252 pages) but has 8 (2 pages) keeps about 34 pages out of what it lends.
/// Counted to its longest, it kept nearly its whole quota from the borrowers for a sequence
/// that may stop at any token.
#[test]
fn a_lenders_block_demand_looks_a_horizon_ahead_not_to_the_longest() {
    // 1024 blocks of 4 tokens, weights 1:1: quotas of 512; block demand quantum 16.
    let mut w = world(4, 256, 1024);
    let a = w.join(1, PreemptionMode::Recompute);
    w.join(1, PreemptionMode::Recompute);
    let ida = w.engines[a].id;
    w.add(a, 1, 8, 1000, Priority::Throughput);
    for _ in 0..4 {
        w.step();
        w.check_sums();
    }
    // What it holds and its sequence's next 128 tokens: 35 pages or fewer, 48 in quanta of 16
    // (counted to its longest: 252 pages).
    let demand = w.c.block_demand(ida);
    assert_eq!(
        demand,
        Some(48),
        "A's demand is not its sequence's next 128 tokens: {:?}",
        w.c.snapshot()
    );
}

/// A slot reused by a new registration starts clean: nothing the departed engine published
/// (its load, its token and block demands, its activity, its step's tokens, its budgets) is
/// read as the new engine's, by the accessors, the snapshot or a donor search.
#[test]
fn a_reused_slot_carries_nothing_of_the_departed_engine() {
    let c = BudgetCoordinator::new(BudgetConfig::new(2, 64, 32)).unwrap();
    let (old, other) = (c.register(1).unwrap(), c.register(1).unwrap());
    c.set_active(old, true);
    c.set_active(other, true);
    c.recompute();
    assert_eq!(c.acquire_tokens_up_to(old, 8), 8);
    c.publish_demand(old, 4);
    c.publish_block_demand(old, 3);
    c.publish_load(old, 0, 5);
    c.deregister(old).unwrap();
    let new = c.register(3).unwrap();
    assert_eq!(new, old, "the slot was not reused");
    assert!(!c.is_active(new));
    assert_eq!(c.token_demand(new), None);
    assert_eq!(c.block_demand(new), None);
    assert_eq!((c.tokens_used(new), c.tokens_granted(new)), (0, 0));
    assert_eq!(
        c.tokens_in_use(),
        0,
        "the departed engine's step still counts"
    );
    assert_eq!(c.token_budget(new), 0, "an idle engine has no token budget");
    assert_eq!(
        c.pick_donor(other, 9, 1),
        None,
        "the departed engine's load was read"
    );
    let stats = c.snapshot().engines;
    let mine = stats.iter().find(|s| s.engine == new).unwrap();
    assert_eq!((mine.weight, mine.load, mine.token_demand), (3, None, None));
}
