//! loom models: budget (see tests/loom.rs). The fetch-and-add admission with compensation, the
//! per-step reset, and the delegated single publisher racing the hot path and the registry.

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use pagedkv::budget::{BudgetConfig, BudgetCoordinator, Publication};
use pagedkv::EngineId;

fn coordinator(max_engines: u16, tokens: u32, blocks: u32) -> BudgetCoordinator {
    BudgetCoordinator::new(BudgetConfig::new(max_engines, tokens, blocks)).unwrap()
}

fn active_engine(c: &BudgetCoordinator) -> EngineId {
    let e = c.register(1).unwrap();
    c.set_active(e, true);
    c.recompute();
    e
}

/// Two acquirers of 2 tokens against a budget of 3, one of them releasing: never both outstanding.
#[test]
fn token_acquirers_never_over_grant() {
    loom::model(|| {
        let c = Arc::new(coordinator(1, 3, 1));
        let e = active_engine(&c);
        let outstanding = Arc::new(AtomicU64::new(0));
        let t = {
            let (c, out) = (c.clone(), outstanding.clone());
            thread::spawn(move || {
                if c.try_acquire_tokens(e, 2) {
                    assert!(out.fetch_add(2, Ordering::SeqCst) + 2 <= 3, "over-granted");
                    out.fetch_sub(2, Ordering::SeqCst);
                    c.release_tokens(e, 2).unwrap();
                    true
                } else {
                    false
                }
            })
        };
        let mine = c.try_acquire_tokens(e, 2);
        if mine {
            assert!(
                outstanding.fetch_add(2, Ordering::SeqCst) + 2 <= 3,
                "over-granted"
            );
        }
        let theirs = t.join().unwrap();
        assert!(mine || theirs, "the first fetch_add always sees room");
        assert_eq!(c.tokens_used(e), if mine { 2 } else { 0 });
        assert_eq!(c.begin_step(e), if mine { 2 } else { 0 });
        assert_eq!(c.tokens_used(e), 0);
    });
}

/// A step reset racing an acquirer (and a failing acquirer's undo) loses nothing and grants nothing
/// twice: the grant counts in exactly one step.
#[test]
fn begin_step_racing_acquirers() {
    loom::model(|| {
        let c = Arc::new(coordinator(1, 3, 1));
        let e = active_engine(&c);
        assert!(c.try_acquire_tokens(e, 2));
        let t = {
            let c = c.clone();
            // Fails unless the reset came first; either way its undo must not make room.
            thread::spawn(move || c.try_acquire_tokens(e, 3))
        };
        let reset = c.begin_step(e);
        let granted = t.join().unwrap();
        assert_eq!(reset, 2);
        let next = c.begin_step(e);
        assert_eq!(next, if granted { 3 } else { 0 });
        assert_eq!(c.tokens_used(e), 0);
        // The budget is whole again, and not more than whole.
        assert!(c.try_acquire_tokens(e, 3));
        assert!(!c.try_acquire_tokens(e, 1));
    });
}

/// Two engines racing for the last blocks: per-engine limits and the pool total both hold.
#[test]
fn block_acquirers_respect_pool_total() {
    loom::model(|| {
        // Pool of 2; engine a active (quota 1 + borrows b's idle 1 = limit 2), b idle (limit 1).
        let c = Arc::new(coordinator(2, 2, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        assert_eq!((c.block_limit(a), c.block_limit(b)), (2, 1));
        let t = {
            let c = c.clone();
            thread::spawn(move || c.try_acquire_blocks(b, 1).is_ok())
        };
        let got_a = c.try_acquire_blocks(a, 2).is_ok();
        let got_b = t.join().unwrap();
        assert!(!(got_a && got_b), "pool over-granted");
        assert!(
            got_a || got_b,
            "a grant was lost to a transient undo in both orders"
        );
        assert_eq!(c.blocks_in_use(), if got_a { 2 } else { 1 });
        assert_eq!(c.blocks_held(a) + c.blocks_held(b), c.blocks_in_use());
    });
}

/// A lender becoming active and recomputing while the borrower acquires: the budgets each call
/// saw bound its grant, the published sum never exceeds the global, and the final publication
/// is the water-filling of the final inputs.
#[test]
fn recompute_racing_acquire() {
    loom::model(|| {
        let c = Arc::new(coordinator(2, 4, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        assert_eq!(c.token_budget(a), 4);
        let t = {
            let c = c.clone();
            thread::spawn(move || {
                c.set_active(b, true);
                c.recompute()
            })
        };
        let got = c.try_acquire_tokens(a, 3);
        let s = c.snapshot();
        if s.consistent {
            let sum: u32 = s.engines.iter().map(|x| x.token_budget).sum();
            assert!(sum <= 4);
        }
        assert!(matches!(t.join().unwrap(), Publication::Published { .. }));
        assert_eq!((c.token_budget(a), c.token_budget(b)), (2, 2));
        assert_eq!(c.tokens_used(a), if got { 3 } else { 0 });
        assert!(!c.is_dirty());
    });
}

/// Two publishers at once: one defers to the other, and no request is lost — once both have
/// returned, either the budgets reflect every change or the request is still marked dirty.
#[test]
fn concurrent_recomputes_lose_no_request() {
    loom::model(|| {
        let c = Arc::new(coordinator(2, 4, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        let t = {
            let c = c.clone();
            thread::spawn(move || {
                c.set_active(b, true);
                c.recompute()
            })
        };
        let mine = c.recompute();
        let theirs = t.join().unwrap();
        assert!(
            matches!(mine, Publication::Published { .. })
                || matches!(theirs, Publication::Published { .. })
        );
        if !c.is_dirty() {
            assert_eq!(
                (c.token_budget(a), c.token_budget(b)),
                (2, 2),
                "a request was lost"
            );
        }
        c.maybe_recompute();
        assert_eq!((c.token_budget(a), c.token_budget(b)), (2, 2));
        assert_eq!(c.epoch() % 2, 0);
    });
}

/// Deregistration racing registration (and their recomputations): the slot is freed and reused
/// only after its figures are zeroed, and the final publication gives the survivor everything.
#[test]
fn register_deregister_racing_recompute() {
    loom::model(|| {
        let c = Arc::new(coordinator(2, 4, 4));
        let old = active_engine(&c);
        let t = {
            let c = c.clone();
            thread::spawn(move || {
                let e = c.register(1).unwrap();
                c.set_active(e, true);
                e
            })
        };
        c.deregister(old).unwrap();
        let new = t.join().unwrap();
        c.recompute();
        c.recompute();
        assert!(c.is_registered(new));
        let s = c.snapshot();
        assert!(s.consistent);
        assert_eq!(s.engines.len(), 1);
        assert_eq!(
            (
                s.engines[0].engine,
                s.engines[0].token_budget,
                s.engines[0].block_quota
            ),
            (new, 4, 4)
        );
        if new != old {
            assert_eq!(
                (c.token_budget(old), c.block_quota(old), c.block_limit(old)),
                (0, 0, 0)
            );
        }
    });
}
