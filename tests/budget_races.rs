//! Races on the budget coordinator's counters (issue 17, items 3 and 8), each checked at every
//! grant against a sequential shadow of what is outstanding, with a deadline that turns a hang
//! into a failure:
//!
//! - a refused (bogus) release racing acquirers must neither let them over-grant nor be
//!   accepted because an acquire in flight inflated the counter;
//! - the tokens acquired by all engines together never exceed `tokens_per_step`, even right
//!   after a recomputation moved budget from an engine that still holds tokens to another.

use pagedkv::block::EngineId;
use pagedkv::budget::{BudgetConfig, BudgetCoordinator};
use pagedkv::error::BudgetError;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long each stress runs (the threads stop on their own, or on the first violation).
const RUN: Duration = Duration::from_millis(if cfg!(debug_assertions) { 300 } else { 1500 });
/// The whole test fails if its threads have not all finished by then.
const DEADLINE: Duration = Duration::from_secs(60);

/// Joins every thread, failing with a message if one has not finished by the deadline (a hang)
/// and re-raising the first thread's panic (a violation).
fn join_all(handles: Vec<JoinHandle<()>>, stop: &AtomicBool, what: &str) {
    let start = Instant::now();
    while !handles.iter().all(|h| h.is_finished()) {
        if start.elapsed() > DEADLINE {
            stop.store(true, Ordering::SeqCst);
            panic!("{what}: threads still running after {DEADLINE:?} (a hang)");
        }
        thread::sleep(Duration::from_millis(5));
    }
    for h in handles {
        if let Err(p) = h.join() {
            std::panic::resume_unwind(p);
        }
    }
}

/// One active engine alone on the coordinator: token budget and block limit both `limit`.
fn single_engine(limit: u32) -> (Arc<BudgetCoordinator>, EngineId) {
    let c = Arc::new(BudgetCoordinator::new(BudgetConfig::new(2, limit, limit)).unwrap());
    let e = c.register(1).unwrap();
    c.set_active(e, true);
    c.recompute();
    assert_eq!((c.token_budget(e), c.block_limit(e)), (limit, limit));
    (c, e)
}

/// Runs `threads` closures (each called in a loop until the run ends or another thread failed),
/// started together.
fn run_loops(threads: Vec<Box<dyn FnMut() + Send>>, what: &str) {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(threads.len()));
    let handles = threads
        .into_iter()
        .map(|mut body| {
            let (stop, start) = (stop.clone(), start.clone());
            thread::spawn(move || {
                start.wait();
                let t0 = Instant::now();
                while !stop.load(Ordering::Relaxed) && t0.elapsed() < RUN {
                    for _ in 0..64 {
                        // A violation panics; tell the others to stop.
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut body));
                        if let Err(p) = r {
                            stop.store(true, Ordering::SeqCst);
                            std::panic::resume_unwind(p);
                        }
                    }
                }
            })
        })
        .collect();
    join_all(handles, &stop, what);
}

/// Budget 10; 5 tokens held for the whole run. A failing acquirer of 10 keeps 10 in flight, a
/// bogus releaser keeps releasing 11 (more than can ever be granted), and an acquirer of 6 must
/// never be granted (5 + 6 > 10). Before the fix the bogus release's transient `fetch_sub` took
/// the counter down to 4 while the 10 were in flight, and the acquirer of 6 got in: 11 of 10.
#[test]
fn bogus_token_releases_never_let_acquirers_over_grant() {
    // The engine's budget (10) below the device's tokens_per_step (20, cap 500 per mille): with
    // the two equal, the device-wide count refuses the 11th token on its own and hides a
    // per-engine over-grant (this test then passed with the transient-fetch_sub release).
    let c = Arc::new(
        BudgetCoordinator::new(BudgetConfig::new(2, 20, 20).with_cap_permille(500)).unwrap(),
    );
    let e = c.register(1).unwrap();
    c.set_active(e, true);
    c.recompute();
    assert_eq!(c.token_budget(e), 10);
    assert!(c.try_acquire_tokens(e, 5));
    // The shadow: tokens granted and not yet given back, counted after each grant.
    let outstanding = Arc::new(AtomicU64::new(5));
    let refused = Arc::new(AtomicU64::new(0));
    let failing = {
        let c = c.clone();
        Box::new(move || assert!(!c.try_acquire_tokens(e, 10), "10 granted over 5 held"))
            as Box<dyn FnMut() + Send>
    };
    let bogus = {
        let (c, refused) = (c.clone(), refused.clone());
        Box::new(move || {
            match c.release_tokens(e, 11) {
                Err(BudgetError::TokensNotHeld { .. }) => {}
                other => panic!("a release of 11 tokens with at most 10 granted: {other:?}"),
            }
            refused.fetch_add(1, Ordering::Relaxed);
        }) as Box<dyn FnMut() + Send>
    };
    let acquirer = {
        let (c, out) = (c.clone(), outstanding.clone());
        Box::new(move || {
            if c.try_acquire_tokens(e, 6) {
                let now = out.fetch_add(6, Ordering::SeqCst) + 6;
                assert!(
                    now <= 10,
                    "over-granted: {now} tokens outstanding, budget 10"
                );
                out.fetch_sub(6, Ordering::SeqCst);
                c.release_tokens(e, 6).unwrap();
            }
        }) as Box<dyn FnMut() + Send>
    };
    run_loops(vec![failing, bogus, acquirer], "bogus token releases");
    assert!(refused.load(Ordering::Relaxed) > 0);
    // Quiet: exactly the 5 held remain, and they can be given back.
    assert_eq!(c.tokens_used(e), 5);
    c.release_tokens(e, 5).unwrap();
    assert_eq!(c.tokens_used(e), 0);
}

/// The same race on blocks (limit 10, 5 held): a release of 11 must always be refused (before the
/// fix it was accepted whenever an acquire of 10 was in flight, and took `blocks_in_use` below
/// zero), and an acquirer of 6 must never be granted.
#[test]
fn bogus_block_releases_are_refused_and_never_over_grant() {
    let (c, e) = single_engine(10);
    c.try_acquire_blocks(e, 5).unwrap();
    let outstanding = Arc::new(AtomicU64::new(5));
    let failing = {
        let c = c.clone();
        Box::new(move || {
            let r = c.try_acquire_blocks(e, 10);
            assert!(
                matches!(r, Err(BudgetError::OverBlockLimit { .. })),
                "10 blocks over 5 held: {r:?}"
            );
        }) as Box<dyn FnMut() + Send>
    };
    let bogus = {
        let c = c.clone();
        Box::new(move || match c.release_blocks(e, 11) {
            Err(BudgetError::BlocksNotHeld { .. }) => {}
            other => panic!("a release of 11 blocks with at most 10 held: {other:?}"),
        }) as Box<dyn FnMut() + Send>
    };
    let acquirer = {
        let (c, out) = (c.clone(), outstanding.clone());
        Box::new(move || {
            if c.try_acquire_blocks(e, 6).is_ok() {
                let now = out.fetch_add(6, Ordering::SeqCst) + 6;
                assert!(
                    now <= 10,
                    "over-granted: {now} blocks outstanding, limit 10"
                );
                out.fetch_sub(6, Ordering::SeqCst);
                c.release_blocks(e, 6).unwrap();
            }
        }) as Box<dyn FnMut() + Send>
    };
    run_loops(vec![failing, bogus, acquirer], "bogus block releases");
    assert_eq!((c.blocks_held(e), c.blocks_in_use()), (5, 5));
    c.release_blocks(e, 5).unwrap();
    assert_eq!((c.blocks_held(e), c.blocks_in_use()), (0, 0));
}

/// A refused release leaves every counter as it was (sequentially).
#[test]
fn refused_releases_change_nothing() {
    let (c, e) = single_engine(10);
    assert!(c.try_acquire_tokens(e, 3));
    c.try_acquire_blocks(e, 4).unwrap();
    assert!(matches!(
        c.release_tokens(e, 4),
        Err(BudgetError::TokensNotHeld {
            released: 4,
            granted: 3,
            ..
        })
    ));
    assert!(matches!(
        c.release_blocks(e, 5),
        Err(BudgetError::BlocksNotHeld {
            released: 5,
            held: 4,
            ..
        })
    ));
    assert_eq!(c.tokens_used(e), 3);
    assert_eq!((c.blocks_held(e), c.blocks_in_use()), (4, 4));
    // Exactly the rest of the budget and limit can still be taken.
    assert!(c.try_acquire_tokens(e, 7));
    assert!(!c.try_acquire_tokens(e, 1));
    c.try_acquire_blocks(e, 6).unwrap();
    assert!(c.try_acquire_blocks(e, 1).is_err());
}

/// Engine a alone holds all 4 tokens of the step; b becomes active and the recompute gives each
/// 2. Until a starts its next step, b must not get any: 4 + 2 > 4 (before the fix it got 2).
#[test]
fn global_token_cap_holds_after_a_recompute_moves_budget() {
    let c = BudgetCoordinator::new(BudgetConfig::new(2, 4, 8)).unwrap();
    let a = c.register(1).unwrap();
    let b = c.register(1).unwrap();
    c.set_active(a, true);
    c.recompute();
    assert!(c.try_acquire_tokens(a, 4));
    c.set_active(b, true);
    c.recompute();
    assert_eq!((c.token_budget(a), c.token_budget(b)), (2, 2));
    assert!(
        !c.try_acquire_tokens(b, 1),
        "5 tokens of 4 granted in one step"
    );
    // a's step ends: its 4 are spent, and b's budget is there.
    assert_eq!(c.begin_step(a), 4);
    assert!(c.try_acquire_tokens(b, 2));
    assert!(c.try_acquire_tokens(a, 2));
    assert!(!c.try_acquire_tokens(a, 1));
    // A release by a frees room for b only up to b's own budget.
    c.release_tokens(a, 1).unwrap();
    assert!(!c.try_acquire_tokens(b, 1));
    assert!(c.try_acquire_tokens(a, 1));
}

/// Engines stepping on their own threads (begin a step, take tokens until refused, sometimes
/// give some back) while a publisher moves budget between them: at every grant, the tokens that
/// all engines have been granted and not yet given back or reset stay within the device's
/// `tokens_per_step`. The shadow counts a grant after it returns and uncounts tokens before they
/// are released or reset, so it never exceeds what the coordinator holds outstanding.
#[test]
fn global_token_cap_holds_while_budgets_move() {
    const TOKENS: u32 = 64;
    const ENGINES: usize = 3;
    let c = Arc::new(BudgetCoordinator::new(BudgetConfig::new(4, TOKENS, 64)).unwrap());
    let ids: Vec<EngineId> = (0..ENGINES)
        .map(|i| c.register(i as u32 + 1).unwrap())
        .collect();
    for &e in &ids {
        c.set_active(e, true);
    }
    c.recompute();
    let shadow = Arc::new(AtomicU64::new(0));
    let grants = Arc::new(AtomicU64::new(0));
    let mut threads: Vec<Box<dyn FnMut() + Send>> = Vec::new();
    for (t, &e) in ids.iter().enumerate() {
        let (c, shadow, grants) = (c.clone(), shadow.clone(), grants.clone());
        let mut rng = SmallRng::seed_from_u64(t as u64);
        let mut mine = 0u64;
        threads.push(Box::new(move || {
            shadow.fetch_sub(mine, Ordering::SeqCst);
            let reset = c.begin_step(e);
            assert_eq!(
                reset, mine,
                "begin_step took back what the engine did not hold"
            );
            mine = 0;
            loop {
                let n = rng.gen_range(1..=8);
                if !c.try_acquire_tokens(e, n) {
                    break;
                }
                mine += u64::from(n);
                let now = shadow.fetch_add(u64::from(n), Ordering::SeqCst) + u64::from(n);
                assert!(
                    now <= u64::from(TOKENS),
                    "{now} tokens acquired across engines, device budget {TOKENS}"
                );
                grants.fetch_add(1, Ordering::Relaxed);
            }
            if mine > 0 && rng.gen_bool(0.3) {
                let n = rng.gen_range(1..=mine);
                shadow.fetch_sub(n, Ordering::SeqCst);
                mine -= n;
                c.release_tokens(e, n as u32).unwrap();
            }
        }));
    }
    {
        let (c, ids) = (c.clone(), ids.clone());
        let mut rng = SmallRng::seed_from_u64(99);
        threads.push(Box::new(move || {
            let e = ids[rng.gen_range(0..ids.len())];
            if rng.gen_bool(0.5) {
                c.set_active(e, rng.gen_bool(0.6));
            } else {
                c.set_weight(e, rng.gen_range(1..8)).unwrap();
            }
            c.recompute();
        }));
    }
    run_loops(threads, "global token cap");
    assert!(grants.load(Ordering::Relaxed) > 0);
    // Quiet: the device counter is exactly what the engines hold, and each step's end empties it.
    let held: u64 = ids.iter().map(|&e| c.tokens_granted(e)).sum();
    assert_eq!(c.tokens_in_use(), held);
    assert_eq!(c.tokens_in_use(), shadow.load(Ordering::SeqCst));
    for &e in &ids {
        c.begin_step(e);
    }
    assert_eq!(c.tokens_in_use(), 0);
}
