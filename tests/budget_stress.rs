//! Multi-threaded stress: concurrent acquirers never over-grant, recomputation and registry churn
//! racing the hot path keep every invariant, and once quiet the coordinator agrees with the
//! sequential model.

mod budget_model;

use budget_model::Model;
use pagedkv::block::EngineId;
use pagedkv::budget::{BudgetConfig, BudgetCoordinator, Publication};
use pagedkv::error::BudgetError;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

const ITERS: usize = if cfg!(debug_assertions) {
    5_000
} else {
    100_000
};

#[test]
fn concurrent_token_acquirers_never_over_grant() {
    let c = Arc::new(BudgetCoordinator::new(BudgetConfig::new(2, 100, 10)).unwrap());
    let e = c.register(1).unwrap();
    c.set_active(e, true);
    c.recompute();
    assert_eq!(c.token_budget(e), 100);
    let outstanding = Arc::new(AtomicU64::new(0));
    let granted_any = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (c, out, any) = (c.clone(), outstanding.clone(), granted_any.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(t);
                for _ in 0..ITERS {
                    let n = rng.gen_range(1..=40);
                    if c.try_acquire_tokens(e, n) {
                        // Counted after the grant and uncounted before the release: never more
                        // than what the coordinator has granted and not taken back.
                        let now = out.fetch_add(u64::from(n), Ordering::SeqCst) + u64::from(n);
                        assert!(now <= 100, "over-granted: {now} tokens outstanding");
                        any.fetch_add(1, Ordering::Relaxed);
                        out.fetch_sub(u64::from(n), Ordering::SeqCst);
                        c.release_tokens(e, n).unwrap();
                    }
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert!(granted_any.load(Ordering::Relaxed) > 0);
    assert_eq!(c.tokens_used(e), 0);
    assert_eq!(c.begin_step(e), 0);
}

#[test]
fn concurrent_block_acquirers_respect_engine_and_pool_bounds() {
    // 3 engines of weight 1 over 90 blocks: quota 30 each, all active, limits 30.
    let c = Arc::new(BudgetCoordinator::new(BudgetConfig::new(3, 100, 90)).unwrap());
    let ids: Vec<EngineId> = (0..3).map(|_| c.register(1).unwrap()).collect();
    ids.iter().for_each(|&e| {
        c.set_active(e, true);
    });
    c.recompute();
    // Then one goes idle: the others may borrow its 30 (limit 45 each), yet the pool bound holds.
    c.set_active(ids[2], false);
    c.recompute();
    assert_eq!(c.block_limit(ids[0]), 45);
    let per_engine: Arc<Vec<AtomicU64>> = Arc::new((0..3).map(|_| AtomicU64::new(0)).collect());
    let total = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..6)
        .map(|t| {
            let (c, per, tot, ids) = (c.clone(), per_engine.clone(), total.clone(), ids.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(100 + t);
                let i = (t % 3) as usize;
                let e = ids[i];
                let limit = u64::from(c.block_limit(e));
                for _ in 0..ITERS {
                    let n = rng.gen_range(1..=20);
                    match c.try_acquire_blocks(e, n) {
                        Ok(()) => {
                            let mine =
                                per[i].fetch_add(u64::from(n), Ordering::SeqCst) + u64::from(n);
                            let all = tot.fetch_add(u64::from(n), Ordering::SeqCst) + u64::from(n);
                            assert!(mine <= limit, "engine over its limit: {mine} > {limit}");
                            assert!(all <= 90, "pool over-granted: {all}");
                            per[i].fetch_sub(u64::from(n), Ordering::SeqCst);
                            tot.fetch_sub(u64::from(n), Ordering::SeqCst);
                            c.release_blocks(e, n).unwrap();
                        }
                        Err(
                            BudgetError::OverBlockLimit { .. }
                            | BudgetError::BlocksExhausted { .. },
                        ) => {}
                        Err(other) => panic!("unexpected {other}"),
                    }
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(c.blocks_in_use(), 0);
    ids.iter().for_each(|&e| assert_eq!(c.blocks_held(e), 0));
}

#[test]
fn recompute_and_registry_churn_racing_the_hot_path() {
    const TOKENS: u32 = 1000;
    const BLOCKS: u32 = 200;
    let config = BudgetConfig::new(8, TOKENS, BLOCKS).with_cap_permille(700);
    let c = Arc::new(BudgetCoordinator::new(config).unwrap());
    let workers: Vec<EngineId> = (0..4).map(|i| c.register(i + 1).unwrap()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(8));
    let shadow_blocks = Arc::new(AtomicU64::new(0));
    // Tokens the engine threads hold in their current steps: with lending, budgets may sum
    // past TOKENS, and only the device-wide admission keeps the grants within it.
    let shadow_tokens = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();

    // Engine threads: each drives its own engine like a batcher.
    for (t, &e) in workers.iter().enumerate() {
        let (c, stop, start, shadow, shadow_tokens) = (
            c.clone(),
            stop.clone(),
            start.clone(),
            shadow_blocks.clone(),
            shadow_tokens.clone(),
        );
        handles.push(thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(t as u64);
            let mut held = 0u32;
            let mut step = 0u32;
            start.wait();
            while !stop.load(Ordering::Relaxed) {
                // Uncounted before the step ends, counted after each grant: never more than
                // the coordinator has granted and not taken back.
                shadow_tokens.fetch_sub(u64::from(step), Ordering::SeqCst);
                c.begin_step(e);
                if rng.gen_bool(0.05) {
                    c.set_active(e, rng.gen_bool(0.7));
                }
                c.maybe_recompute();
                step = 0;
                // Some engines use little of their budget and say so; the others want all.
                let want = if t % 2 == 0 {
                    rng.gen_range(0..=200)
                } else {
                    u32::MAX
                };
                while step < want && c.try_acquire_tokens(e, 16) {
                    step += 16;
                    assert!(step <= config.token_cap(), "token budget above the cap");
                    let all = shadow_tokens.fetch_add(16, Ordering::SeqCst) + 16;
                    assert!(
                        all <= u64::from(TOKENS),
                        "device over-granted: {all} tokens"
                    );
                }
                c.publish_demand(e, if step < want { u32::MAX } else { step });
                if rng.gen_bool(0.5) {
                    let n = rng.gen_range(1..=12);
                    if c.try_acquire_blocks(e, n).is_ok() {
                        held += n;
                        let all = shadow.fetch_add(u64::from(n), Ordering::SeqCst) + u64::from(n);
                        assert!(all <= u64::from(BLOCKS), "pool over-granted: {all}");
                    }
                } else if held > 0 {
                    let n = rng.gen_range(1..=held);
                    shadow.fetch_sub(u64::from(n), Ordering::SeqCst);
                    c.release_blocks(e, n).unwrap();
                    held -= n;
                }
                // Some engines need few pages and say so (sometimes below what they hold:
                // the coordinator reserves at least that); the others want all they can get.
                c.publish_block_demand(
                    e,
                    if t % 2 == 0 {
                        held + rng.gen_range(0..=8)
                    } else {
                        u32::MAX
                    },
                );
                // Give back what a lender reclaims.
                let owe = c.reclaim_for(e).min(held);
                if owe > 0 {
                    shadow.fetch_sub(u64::from(owe), Ordering::SeqCst);
                    c.release_blocks(e, owe).unwrap();
                    held -= owe;
                }
                c.publish_load(e, rng.gen_range(0..4), held);
            }
            shadow.fetch_sub(u64::from(held), Ordering::SeqCst);
            c.release_blocks(e, held).unwrap();
            shadow_tokens.fetch_sub(u64::from(step), Ordering::SeqCst);
            c.begin_step(e);
        }));
    }
    // Registry churn: two extra engines come and go, so one's register can reuse the slot the
    // other's deregister is leaving. Each checks that its engine stays as it set it (a late
    // write of the leaving engine would idle it, or take its grant away).
    for seed in [77, 78] {
        let (c, stop, start) = (c.clone(), stop.clone(), start.clone());
        handles.push(thread::spawn(move || {
            start.wait();
            let mut rng = SmallRng::seed_from_u64(seed);
            while !stop.load(Ordering::Relaxed) {
                if let Ok(e) = c.register(rng.gen_range(1..5)) {
                    let active = rng.gen_bool(0.5);
                    c.set_active(e, active);
                    c.recompute();
                    let got = c.acquire_tokens_up_to(e, 8);
                    let _ = c.try_acquire_blocks(e, 2).map(|()| c.release_blocks(e, 2));
                    assert_eq!(c.is_active(e), active, "another engine's write landed");
                    assert_eq!(
                        c.tokens_granted(e),
                        u64::from(got),
                        "grant changed under us"
                    );
                    c.deregister(e).unwrap();
                }
            }
        }));
    }
    // Publisher and observer: weights change, snapshots are checked.
    {
        let (c, stop, start, workers) = (c.clone(), stop.clone(), start.clone(), workers.clone());
        handles.push(thread::spawn(move || {
            start.wait();
            let mut rng = SmallRng::seed_from_u64(99);
            let mut consistent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let e = workers[rng.gen_range(0..workers.len())];
                c.set_weight(e, rng.gen_range(1..10)).unwrap();
                let _ = c.pick_donor(e, 3, 4);
                let s = c.snapshot();
                if s.consistent {
                    consistent += 1;
                    let sum: u64 = s.engines.iter().map(|x| u64::from(x.token_share)).sum();
                    assert!(
                        sum <= u64::from(TOKENS),
                        "shares sum above the global: {sum}"
                    );
                    let quotas: u64 = s.engines.iter().map(|x| u64::from(x.block_quota)).sum();
                    assert!(quotas <= u64::from(BLOCKS));
                    for x in &s.engines {
                        assert!(x.token_budget <= config.token_cap());
                        assert!(x.token_budget >= x.token_share);
                        assert!(x.block_limit <= config.block_cap());
                    }
                }
            }
            assert!(consistent > 0);
        }));
    }
    start.wait();
    thread::sleep(std::time::Duration::from_millis(
        if cfg!(debug_assertions) { 300 } else { 1500 },
    ));
    stop.store(true, Ordering::Relaxed);
    handles.into_iter().for_each(|h| h.join().unwrap());

    // Quiet: everything returned, and one more publication agrees with the sequential model.
    assert_eq!(c.blocks_in_use(), 0);
    assert_eq!(c.tokens_in_use(), 0);
    assert!(matches!(c.recompute(), Publication::Published { .. }));
    let snap = c.snapshot();
    let mut m = Model::new(8, TOKENS, BLOCKS, 700);
    for x in &snap.engines {
        let s = &mut m.slots[x.engine.index()];
        s.registered = true;
        s.weight = x.weight;
        s.active = x.active;
        s.demand = x.token_demand;
        s.block_demand = x.block_demand;
    }
    m.recompute();
    assert_eq!(
        snap.engines.len(),
        workers.len(),
        "churned engine left behind"
    );
    for x in &snap.engines {
        let s = &m.slots[x.engine.index()];
        assert_eq!(
            (x.token_budget, x.token_share, x.block_quota, x.block_limit),
            (s.token_budget, s.token_share, s.block_quota, s.block_limit)
        );
        assert_eq!((x.tokens_used, x.blocks_held), (0, 0));
    }
    for i in 0..8u16 {
        if !snap.engines.iter().any(|x| x.engine.0 == i) {
            let e = EngineId(i);
            assert_eq!(
                (c.token_budget(e), c.block_quota(e), c.block_limit(e)),
                (0, 0, 0)
            );
        }
    }
}
