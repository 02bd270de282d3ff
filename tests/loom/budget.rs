//! loom models: budget (see tests/loom.rs). The fetch-and-add admission with compensation, the
//! per-step reset, and the delegated single publisher racing the hot path and the registry.

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;
use pagedkv::block::EngineId;
use pagedkv::budget::{BudgetConfig, BudgetCoordinator, Publication, PublishFault, MAX_ROUNDS};

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
    crate::model(|| {
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
    crate::model(|| {
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
    crate::model(|| {
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
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        assert_eq!(c.token_budget(a), 4);
        // Both sides on spawned threads: with the acquire on the main thread loom never ran
        // the publication first (the refused acquire, `got == false`, went unexplored).
        let t = {
            let c = c.clone();
            thread::spawn(move || {
                c.set_active(b, true);
                c.recompute()
            })
        };
        let acquirer = {
            let c = c.clone();
            thread::spawn(move || {
                let got = c.try_acquire_tokens(a, 3);
                let s = c.snapshot();
                if s.consistent {
                    let sum: u32 = s.engines.iter().map(|x| x.token_budget).sum();
                    assert!(sum <= 4);
                }
                got
            })
        };
        let got = acquirer.join().unwrap();
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
    crate::model(|| {
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
        // The plain recompute on a spawned thread too: on the main thread loom never had the
        // other publisher take up its deferred request before it returned `Deferred`.
        let plain = {
            let c = c.clone();
            thread::spawn(move || c.recompute())
        };
        let mine = plain.join().unwrap();
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
    crate::model(|| {
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

/// A deregister racing a publication that frees its slot and a register that reuses it (one
/// slot): the old engine's last writes (idle, end of step) must not land on the new engine,
/// which stays active with its grant counted once, device-wide and in its slot. Before the fix
/// (those writes after the slot was LEAVING) the new engine ended idle with its grant erased.
#[test]
fn deregister_does_not_touch_a_reused_slot() {
    crate::model(|| {
        let c = Arc::new(coordinator(1, 4, 4));
        let old = active_engine(&c);
        assert!(c.try_acquire_tokens(old, 2));
        let t = {
            let c = c.clone();
            thread::spawn(move || {
                c.recompute();
                let e = c.register(1).ok()?;
                c.set_active(e, true);
                c.recompute();
                Some((e, c.acquire_tokens_up_to(e, 4)))
            })
        };
        c.deregister(old).unwrap();
        match t.join().unwrap() {
            Some((new, granted)) => {
                assert!(c.is_active(new), "the old deregister idled the new engine");
                assert_eq!(c.tokens_granted(new), u64::from(granted), "grant erased");
                assert_eq!(c.tokens_in_use(), u64::from(granted), "device count off");
            }
            None => assert_eq!(c.tokens_in_use(), 0, "the old engine's step still counted"),
        }
    });
}

/// One engine alone, budget and limit both `limit`.
fn single(limit: u32) -> (Arc<BudgetCoordinator>, EngineId) {
    let c = Arc::new(coordinator(1, limit, limit));
    let e = active_engine(&c);
    (c, e)
}

/// A refused token release racing a failing and a would-be over-granting acquirer (issue 17
/// item 3): budget 10, 5 held; an acquire of 10 in flight, a bogus release of 11, an acquire of
/// 6. Before the fix the release's transient `fetch_sub` took the counter to 4 while the 10 were
/// in flight, and the 6 were granted (11 of 10). The device has 20 tokens and a cap of half of
/// them per engine, so the device-wide counter (which would refuse the 11th of 10 tokens on
/// its own) cannot hide an over-grant of the engine's budget.
#[test]
fn bogus_token_release_never_lets_an_acquirer_over_grant() {
    crate::model(|| {
        let c = Arc::new(
            BudgetCoordinator::new(BudgetConfig::new(1, 20, 20).with_cap_permille(500)).unwrap(),
        );
        let e = active_engine(&c);
        assert_eq!(c.token_budget(e), 10);
        assert!(c.try_acquire_tokens(e, 5));
        let failing = {
            let c = c.clone();
            thread::spawn(move || assert!(!c.try_acquire_tokens(e, 10)))
        };
        let bogus = {
            let c = c.clone();
            thread::spawn(move || assert!(c.release_tokens(e, 11).is_err()))
        };
        assert!(!c.try_acquire_tokens(e, 6), "11 tokens granted against 10");
        failing.join().unwrap();
        bogus.join().unwrap();
        assert_eq!(c.tokens_used(e), 5);
        assert_eq!(c.begin_step(e), 5);
    });
}

/// The same on blocks (limit 10, 5 held): the bogus release of 11 must be refused even while an
/// acquire of 10 has inflated the admission counter to 15 (before the fix it was accepted, and
/// took the pool's count below zero), and the acquirer of 6 must be refused.
#[test]
fn bogus_block_release_is_refused_and_never_over_grants() {
    crate::model(|| {
        let (c, e) = single(10);
        c.try_acquire_blocks(e, 5).unwrap();
        let failing = {
            let c = c.clone();
            thread::spawn(move || assert!(c.try_acquire_blocks(e, 10).is_err()))
        };
        let bogus = {
            let c = c.clone();
            thread::spawn(move || {
                assert!(c.release_blocks(e, 11).is_err(), "bogus release accepted")
            })
        };
        assert!(
            c.try_acquire_blocks(e, 6).is_err(),
            "11 blocks granted against 10"
        );
        failing.join().unwrap();
        bogus.join().unwrap();
        assert_eq!((c.blocks_held(e), c.blocks_in_use()), (5, 5));
    });
}

/// A bogus release below zero racing an acquire at the limit: before the fix the counter
/// wrapped to 2^64 − 1 for a moment, `held + n` overflowed (a panic in debug) and wrapped to a
/// grant in release (2 blocks held against a limit of 1).
#[test]
fn bogus_block_release_cannot_wrap_the_counter_into_a_grant() {
    crate::model(|| {
        // Two active engines of weight 1 over 2 blocks: limit 1 each.
        let c = Arc::new(coordinator(2, 2, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.set_active(b, true);
        c.recompute();
        assert_eq!(c.block_limit(a), 1);
        c.try_acquire_blocks(a, 1).unwrap();
        // A refused release and a refused acquire only read: the held block is also given
        // back and taken again beside them, so that the counter moves under the bogus release
        // (without those writes loom has one interleaving to run).
        let bogus = {
            let c = c.clone();
            thread::spawn(move || assert!(c.release_blocks(a, 2).is_err()))
        };
        c.release_blocks(a, 1).unwrap();
        c.try_acquire_blocks(a, 1).unwrap();
        assert!(
            c.try_acquire_blocks(a, 1).is_err(),
            "2 blocks held against a limit of 1"
        );
        bogus.join().unwrap();
        assert_eq!((c.blocks_held(a), c.blocks_in_use()), (1, 1));
    });
}

/// The device's token cap across engines (issue 17 item 8): a held 3 of 4 tokens alone; then b
/// became active and the recompute gave each 2. b's acquire of 2 races a's step reset and new
/// acquire, and a release of part of it: at every grant the tokens outstanding across both
/// engines are at most 4 (before the fix b was granted at once: 5 of 4).
#[test]
fn global_token_cap_holds_across_a_step_reset() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        assert!(c.try_acquire_tokens(a, 3));
        c.set_active(b, true);
        c.recompute();
        assert_eq!((c.token_budget(a), c.token_budget(b)), (2, 2));
        // The shadow: counted after a grant returns, uncounted before a release or reset.
        let outstanding = Arc::new(AtomicU64::new(3));
        let t = {
            let (c, out) = (c.clone(), outstanding.clone());
            thread::spawn(move || {
                let got = c.try_acquire_tokens(b, 2);
                if got {
                    assert!(
                        out.fetch_add(2, Ordering::SeqCst) + 2 <= 4,
                        "over the device cap"
                    );
                }
                got
            })
        };
        outstanding.fetch_sub(3, Ordering::SeqCst);
        assert_eq!(c.begin_step(a), 3);
        let mine = c.try_acquire_tokens(a, 2);
        if mine {
            assert!(
                outstanding.fetch_add(2, Ordering::SeqCst) + 2 <= 4,
                "over the device cap"
            );
            outstanding.fetch_sub(1, Ordering::SeqCst);
            c.release_tokens(a, 1).unwrap();
        }
        let theirs = t.join().unwrap();
        let held = c.tokens_granted(a) + c.tokens_granted(b);
        assert_eq!(held, outstanding.load(Ordering::SeqCst));
        assert_eq!(c.tokens_in_use(), held);
        // Both engines fit once a has reset: at least one of them got its tokens.
        assert!(mine || theirs);
    });
}

/// The engine link's step protocol: a partial acquire racing another engine's reset, release
/// and acquire. The partial grant is exactly what the device had left at some point, and the
/// counters agree with the grants afterwards.
#[test]
fn partial_token_acquire_racing_a_reset() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        assert!(c.try_acquire_tokens(a, 4));
        c.set_active(b, true);
        c.recompute();
        let outstanding = Arc::new(AtomicU64::new(4));
        let t = {
            let (c, out) = (c.clone(), outstanding.clone());
            thread::spawn(move || {
                let got = u64::from(c.acquire_tokens_up_to(b, 2));
                assert!(
                    out.fetch_add(got, Ordering::SeqCst) + got <= 4,
                    "over the device cap"
                );
                got
            })
        };
        outstanding.fetch_sub(4, Ordering::SeqCst);
        assert_eq!(c.begin_step(a), 4);
        let mine = u64::from(c.acquire_tokens_up_to(a, 2));
        assert!(
            outstanding.fetch_add(mine, Ordering::SeqCst) + mine <= 4,
            "over the device cap"
        );
        let theirs = t.join().unwrap();
        assert_eq!(mine, 2, "a's own budget always fits after its reset");
        assert_eq!(c.tokens_granted(b), theirs);
        assert_eq!(c.tokens_in_use(), mine + theirs);
    });
}

/// A publisher that panics half way through its writes, racing a recompute that defers to it
/// (issue 17 item 2): afterwards no one holds BUSY, the epoch is even, the snapshot is one whole
/// publication, and the next recompute serves the deferred request. Before the drop guard BUSY
/// stayed set and every later recompute deferred.
#[test]
fn panicking_publisher_releases_and_keeps_deferred_requests() {
    crate::model(|| {
        let mut c = coordinator(2, 4, 2);
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        c.fail_next_publication(PublishFault::Writing);
        let c = Arc::new(c);
        // Whichever round comes first reaches the fault.
        let panics = |c: &BudgetCoordinator| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.recompute())).is_err()
        };
        let t = {
            let c = c.clone();
            thread::spawn(move || panics(&c))
        };
        c.set_active(b, true);
        let mine = panics(&c);
        let theirs = t.join().unwrap();
        assert!(mine != theirs, "exactly one round panics");
        // Right away: an even epoch, one whole publication, and b's activity either published
        // or still requested.
        assert_eq!(c.epoch() % 2, 0, "odd epoch left behind");
        assert!(c.snapshot().consistent);
        if !c.is_dirty() {
            assert_eq!(
                (c.token_budget(a), c.token_budget(b)),
                (2, 2),
                "a request was lost"
            );
        }
        // No publisher is left running: a recompute publishes now.
        assert!(matches!(c.recompute(), Publication::Published { .. }));
        let s = c.snapshot();
        assert!(s.consistent);
        assert_eq!((c.token_budget(a), c.token_budget(b)), (2, 2));
        assert_eq!(c.epoch() % 2, 0);
        assert!(!c.is_dirty());
    });
}

/// A release's compare-exchange racing an acquire on the same engine (the retry path): tokens
/// and blocks, budget and limit 4, 2 of each held. Whatever the order, the counters end equal
/// to the grants, and the device counters to the engine's.
#[test]
fn release_retries_against_a_concurrent_acquire() {
    crate::model(|| {
        let (c, e) = single(4);
        assert!(c.try_acquire_tokens(e, 2));
        c.try_acquire_blocks(e, 2).unwrap();
        let t = {
            let c = c.clone();
            thread::spawn(move || {
                (
                    c.try_acquire_tokens(e, 2),
                    c.try_acquire_blocks(e, 2).is_ok(),
                )
            })
        };
        c.release_tokens(e, 2).unwrap();
        c.release_blocks(e, 2).unwrap();
        let (tokens, blocks) = t.join().unwrap();
        // 2 + 2 fit the budget and the limit, so the acquirer always got both.
        assert!(tokens && blocks);
        assert_eq!(
            (c.tokens_used(e), c.tokens_granted(e), c.tokens_in_use()),
            (2, 2, 2)
        );
        assert_eq!((c.blocks_held(e), c.blocks_in_use()), (2, 2));
        assert!(c.release_tokens(e, 3).is_err() && c.release_blocks(e, 3).is_err());
    });
}

/// The device's token cap under a concurrent recompute (issue 17 item 8): a holds 3 of the 4
/// tokens alone; b becomes active and a recompute (a: 2, b: 2) runs on one thread while b asks
/// for 2 tokens and a for 1 more on another. b's budget may already be 2 when it asks, but a's
/// 3 still count, so b is refused whatever the interleaving; a's extra token fits while its
/// budget still reads 4. Before the fix b was granted as soon as its budget was published: 5
/// tokens of 4.
#[test]
fn global_token_cap_holds_under_a_concurrent_recompute() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        assert!(c.try_acquire_tokens(a, 3));
        let acquirer = {
            let c = c.clone();
            thread::spawn(move || (c.try_acquire_tokens(b, 2), c.try_acquire_tokens(a, 1)))
        };
        c.set_active(b, true);
        let published = c.recompute();
        let (got_b, got_a) = acquirer.join().unwrap();
        let held = c.tokens_granted(a) + c.tokens_granted(b);
        assert!(!got_b, "b granted 2 while a holds 3: {held} tokens of 4");
        assert_eq!(held, 3 + u64::from(got_a));
        assert!(matches!(published, Publication::Published { .. }));
        assert_eq!((c.token_budget(a), c.token_budget(b)), (2, 2));
        assert_eq!(c.tokens_in_use(), held);
        // Once a's step ends, b's share is there.
        c.begin_step(a);
        assert!(c.try_acquire_tokens(b, 2));
    });
}

/// Every engine's quotas read (`EngineShare::block_quotas`, what prefix-cache eviction weighs
/// engines by) while a weight change republishes them: the publisher lowers a's quota before
/// it raises b's, so reading the slots one by one can pair a's new quota with b's old one
/// ([1, 2] of 4 blocks: b looks over its share, a publication that never existed). The
/// figures must come from one publication.
#[test]
fn block_quotas_come_from_one_publication() {
    use pagedkv::sched::{EngineBudget, EngineShare};
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 4));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        assert_eq!((c.block_quota(a), c.block_quota(b)), (2, 2));
        let t = {
            let c = c.clone();
            thread::spawn(move || c.set_weight(b, 3).unwrap())
        };
        // Let the publisher start first too (loom's partial-order reduction does not move
        // a load ahead of a store that the storing thread itself loaded just before).
        thread::yield_now();
        let quotas = EngineShare::new(c.clone(), a).block_quotas();
        assert!(
            quotas == [2, 2] || quotas == [1, 3],
            "quotas {quotas:?} pair two publications"
        );
        t.join().unwrap();
    });
}

/// A publisher racing a registration, with an observer asking for the new engine's guaranteed
/// blocks (what the scheduler refuses over-long requests by): once the engine reads as joined,
/// its quota is the one its publication wrote, never the 0 the slot held before. Checks two
/// orderings no other model needed: `register`'s Release store of JOINING (without it the
/// publisher may read the slot JOINING with its weight still 0, publish a quota of 0 and make
/// it LIVE) and `guaranteed_blocks`' Acquire load of LIVE (without it the observer may see LIVE
/// before the quota written ahead of it).
#[test]
fn guaranteed_blocks_of_a_joining_engine_are_its_published_quota() {
    crate::model(|| {
        let c = Arc::new(coordinator(1, 4, 4));
        let registrar = {
            let c = c.clone();
            thread::spawn(move || c.register(1).unwrap())
        };
        let publisher = {
            let c = c.clone();
            thread::spawn(move || {
                c.recompute();
            })
        };
        let observer = {
            let c = c.clone();
            thread::spawn(move || c.guaranteed_blocks(EngineId(0)))
        };
        if let Some(q) = observer.join().unwrap() {
            assert_eq!(q, 4, "a joined engine's quota read as {q}");
        }
        let e = registrar.join().unwrap();
        publisher.join().unwrap();
        c.maybe_recompute();
        assert_eq!(c.guaranteed_blocks(e), Some(4));
    });
}

/// A slot freed by a deregister's publication and reused by a register on another thread: the
/// new engine starts idle, so right after `register` returns its token budget reads 0 and it
/// is granted nothing, whichever publication it came after. Checks `register`'s Acquire claim
/// of the FREE slot (pairing with the publisher's Release store of FREE, made after it zeroed
/// the old engine's figures): without it the new engine may still read the old engine's budget
/// and be granted tokens it never had.
#[test]
fn a_reused_slot_starts_with_the_old_engines_figures_zeroed() {
    crate::model(|| {
        let c = Arc::new(coordinator(1, 4, 4));
        let old = active_engine(&c);
        assert_eq!(c.token_budget(old), 4);
        let leaver = {
            let c = c.clone();
            thread::spawn(move || c.deregister(old).unwrap())
        };
        let joiner = {
            let c = c.clone();
            thread::spawn(move || {
                let e = c.register(1).ok()?;
                Some((c.token_budget(e), c.try_acquire_tokens(e, 1)))
            })
        };
        leaver.join().unwrap();
        if let Some((budget, granted)) = joiner.join().unwrap() {
            assert_eq!(
                budget, 0,
                "the new, idle engine read the old engine's budget"
            );
            assert!(!granted, "the new, idle engine was granted tokens");
        }
    });
}

/// An engine marks itself active and then only calls `maybe_recompute` (the once-a-step call),
/// while another thread's `recompute` runs: the change is either published or still marked.
/// Checks the pairing of `mark_dirty`'s Release with the publisher's Acquire on `ctl`: without
/// it the publisher may take the DIRTY bit and clear it, read the activity as it was before,
/// and publish that; the engine's `maybe_recompute` then finds nothing to do and the engine
/// stays at a budget of 0 until some unrelated change.
#[test]
fn an_activity_change_is_published_or_left_marked() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        let engine = {
            let c = c.clone();
            thread::spawn(move || {
                c.set_active(b, true);
                c.maybe_recompute();
            })
        };
        let publisher = {
            let c = c.clone();
            thread::spawn(move || {
                c.recompute();
            })
        };
        engine.join().unwrap();
        publisher.join().unwrap();
        assert!(
            c.is_dirty() || (c.token_budget(a), c.token_budget(b)) == (2, 2),
            "b's activity was lost: budgets ({}, {}), nothing marked",
            c.token_budget(a),
            c.token_budget(b)
        );
    });
}

/// Two requests deferred to one publisher (an activity change marked during its round, and a
/// recompute that found it busy): the publisher runs the rounds they need (within
/// `MAX_ROUNDS`), so once both calls returned nothing is left marked and the budgets are the
/// final ones. A publisher that returned after one round whatever was marked meanwhile left
/// the deferred request to some later caller.
#[test]
fn a_deferred_request_is_served_before_the_publisher_returns() {
    crate::model(|| {
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
        let plain = {
            let c = c.clone();
            thread::spawn(move || c.recompute())
        };
        let out_of_rounds = |p: Publication| matches!(p, Publication::Published { rounds, .. } if rounds == MAX_ROUNDS);
        let plain = plain.join().unwrap();
        let theirs = t.join().unwrap();
        // A publisher that ran all its rounds may leave the last request marked (out of reach
        // at preemption bound 2: a third change would have to land in its second round).
        assert!(
            !c.is_dirty() || out_of_rounds(plain) || out_of_rounds(theirs),
            "a deferred request was left marked"
        );
        assert_eq!((c.token_budget(a), c.token_budget(b)), (2, 2));
    });
}

/// A deregister racing a publisher that read the engine live, and a register that reuses the
/// slot: the slot is freed only by a round that read it as leaving (and so wrote its figures
/// to zero), so the new engine never reads the old engine's budget nor is granted under it.
#[test]
fn a_slot_is_freed_only_by_a_round_that_zeroed_it() {
    crate::model(|| {
        let c = Arc::new(coordinator(1, 4, 4));
        let old = active_engine(&c);
        let publisher = {
            let c = c.clone();
            thread::spawn(move || {
                c.recompute();
            })
        };
        let joiner = {
            let c = c.clone();
            thread::spawn(move || {
                let e = c.register(1).ok()?;
                Some((c.token_budget(e), c.try_acquire_tokens(e, 1)))
            })
        };
        c.deregister(old).unwrap();
        publisher.join().unwrap();
        if let Some((budget, granted)) = joiner.join().unwrap() {
            assert_eq!(budget, 0, "the new engine read the old engine's budget");
            assert!(!granted, "the new, idle engine was granted tokens");
        }
    });
}

/// Token lending (`publish_demand`): a (share 4 of 8) said it uses 1, so b's budget is 7, and
/// both hold their steps' tokens (1 + 7). Then a's demand rises while b starts its next step:
/// a's step gets at least its published 1 whatever the order (b holds at most 7), the device's
/// 8 are never over-granted, a's budget never drops below its share, and the raised demand is
/// never lost: once both have returned, either the budgets are the shares again or the
/// request is still marked for the next publisher.
#[test]
fn lending_racing_a_lenders_rise() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 8, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.set_active(b, true);
        c.publish_demand(a, 1);
        c.recompute();
        assert_eq!((c.token_budget(a), c.token_budget(b)), (4, 7));
        assert_eq!(c.acquire_tokens_up_to(a, 4), 4);
        c.release_tokens(a, 3).unwrap();
        assert_eq!(c.acquire_tokens_up_to(b, 7), 7);
        // The shadow: counted after a grant returns, uncounted before a reset.
        let outstanding = Arc::new(AtomicU64::new(8));
        let grant = |c: &BudgetCoordinator, e: EngineId, out: &AtomicU64, held: u64| {
            out.fetch_sub(held, Ordering::SeqCst);
            assert_eq!(c.begin_step(e), held);
            let got = c.acquire_tokens_up_to(e, c.token_budget(e));
            let now = out.fetch_add(u64::from(got), Ordering::SeqCst) + u64::from(got);
            assert!(now <= 8, "over the device cap: {now}");
            got
        };
        let lender = {
            let (c, out) = (c.clone(), outstanding.clone());
            thread::spawn(move || {
                assert!(c.token_budget(a) >= 4, "a lender's budget below its share");
                let got = grant(&c, a, &out, 1);
                // No recompute of its own: the borrower's step (or the next) publishes it.
                c.publish_demand(a, u32::MAX);
                got
            })
        };
        let borrower = {
            let (c, out) = (c.clone(), outstanding.clone());
            thread::spawn(move || {
                let got = grant(&c, b, &out, 7);
                c.maybe_recompute();
                got
            })
        };
        let got_a = lender.join().unwrap();
        let got_b = borrower.join().unwrap();
        assert!(got_a >= 1, "the lender got less than its published demand");
        assert!(u64::from(got_a + got_b) <= 8);
        assert_eq!(c.tokens_in_use(), u64::from(got_a + got_b));
        assert_eq!(c.token_demand(a), None);
        if !c.is_dirty() {
            assert_eq!(
                (c.token_budget(a), c.token_budget(b)),
                (4, 4),
                "the raised demand was lost"
            );
        }
        c.maybe_recompute();
        assert_eq!((c.token_budget(a), c.token_budget(b)), (4, 4));
    });
}

/// Block lending (`publish_block_demand`): a (quota 4 of 8) said it needs 1 block, so b's limit
/// is 7, and b holds 7. Then b gives one back and takes one again while a, refused for the pool
/// being lent out, raises its demand: the pool's 8 are never over-granted, a's limit never
/// drops below its quota, and the raised demand is never lost: once both have returned, either
/// b's limit is its quota again (and b owes what it holds above it) or the request is still
/// marked for the next publisher.
#[test]
fn block_lending_racing_a_lenders_rise() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 8, 8));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.set_active(b, true);
        c.recompute();
        c.try_acquire_blocks(a, 1).unwrap();
        c.publish_block_demand(a, 1);
        c.recompute();
        assert_eq!((c.block_limit(a), c.block_limit(b)), (4, 7));
        c.try_acquire_blocks(b, 7).unwrap();
        // The shadow: counted after a grant returns, uncounted before a release.
        let outstanding = Arc::new(AtomicU64::new(8));
        let take = |c: &BudgetCoordinator, e: EngineId, out: &AtomicU64, n: u32| {
            let granted = c.try_acquire_blocks(e, n).is_ok();
            if granted {
                let now = out.fetch_add(u64::from(n), Ordering::SeqCst) + u64::from(n);
                assert!(now <= 8, "pool over-granted: {now}");
            }
            granted
        };
        let lender = {
            let (c, out) = (c.clone(), outstanding.clone());
            thread::spawn(move || {
                let got = take(&c, a, &out, 1);
                assert!(c.block_limit(a) >= 4, "a lender's limit below its quota");
                if !got {
                    // Short of pages: it wants its whole quota back.
                    c.publish_block_demand(a, u32::MAX);
                    c.maybe_recompute();
                }
                got
            })
        };
        let borrower = {
            let (c, out) = (c.clone(), outstanding.clone());
            thread::spawn(move || {
                out.fetch_sub(1, Ordering::SeqCst);
                c.release_blocks(b, 1).unwrap();
                take(&c, b, &out, 1);
                c.maybe_recompute();
                // Its next step gives back what it owes.
                let owe = c.reclaim_for(b);
                out.fetch_sub(u64::from(owe), Ordering::SeqCst);
                c.release_blocks(b, owe).unwrap();
            })
        };
        let got_a = lender.join().unwrap();
        borrower.join().unwrap();
        let (held_a, held_b) = (c.blocks_held(a), c.blocks_held(b));
        assert_eq!(held_a, 1 + u64::from(got_a));
        assert_eq!(c.blocks_in_use(), held_a + held_b);
        assert_eq!(outstanding.load(Ordering::SeqCst), held_a + held_b);
        if !got_a {
            assert_eq!(c.block_demand(a), None);
            if !c.is_dirty() {
                assert_eq!(c.block_limit(b), 4, "the raised demand was lost");
            }
            c.maybe_recompute();
            assert_eq!((c.block_limit(a), c.block_limit(b)), (4, 4));
            assert_eq!(u64::from(c.reclaim_for(b)), held_b.saturating_sub(4));
        }
    });
}

/// Every figure a publication writes, for comparing two publications.
fn published(c: &BudgetCoordinator, engines: &[EngineId]) -> Vec<(u32, u32, u32, u32)> {
    engines
        .iter()
        .map(|&e| {
            (
                c.token_budget(e),
                c.token_share(e),
                c.block_quota(e),
                c.block_limit(e),
            )
        })
        .collect()
}

/// A publisher that runs out of rounds (`MAX_ROUNDS`, 2 under loom) while changes keep coming
/// (b's activity, a's block demand, each landing in a different round) returns with the last
/// change unpublished: it must leave it marked, so that the next `maybe_recompute` publishes
/// it. Once every call returned, the figures are those of the final inputs or `DIRTY` is set.
/// A publisher that cleared `DIRTY` on giving up lost the change (b's limit stayed 2, not 3).
#[test]
fn a_publisher_out_of_rounds_leaves_the_request_marked() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 4));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        let publisher = {
            let c = c.clone();
            thread::spawn(move || {
                c.recompute();
            })
        };
        let activity = {
            let c = c.clone();
            thread::spawn(move || {
                c.set_active(b, true);
            })
        };
        let demand = {
            let c = c.clone();
            thread::spawn(move || c.publish_block_demand(a, 1))
        };
        publisher.join().unwrap();
        activity.join().unwrap();
        demand.join().unwrap();
        let marked = c.is_dirty();
        let before = published(&c, &[a, b]);
        c.recompute();
        let after = published(&c, &[a, b]);
        // a reserves its demand of 1, so b borrows 1: limit 3.
        assert_eq!(c.block_limit(b), 3);
        assert!(
            marked || before == after,
            "a change was lost: published {before:?}, final inputs give {after:?}, nothing marked"
        );
    });
}

/// A deregister of an engine still `JOINING` (its registration's publication deferred to a
/// publisher already running), racing that publisher's `JOINING -> LIVE` step: the engine
/// leaves (deregister succeeds whenever it is registered) and its slot is freed, never made
/// `LIVE` again. Checks the compare-exchange of `JOINING -> LIVE` (a plain store of `LIVE`
/// overwrote `LEAVING`: the departed engine stayed registered, its slot never freed) and
/// `deregister`'s attempt from `JOINING` (without it the deregister of a joining engine is
/// refused as `NotRegistered`).
#[test]
fn a_joining_engine_can_leave_before_its_publication() {
    crate::model(|| {
        let c = Arc::new(coordinator(1, 4, 4));
        let publisher = {
            let c = c.clone();
            thread::spawn(move || {
                c.recompute();
            })
        };
        let registrar = {
            let c = c.clone();
            thread::spawn(move || c.register(1).unwrap())
        };
        let leaver = {
            let c = c.clone();
            thread::spawn(move || {
                let e = EngineId(0);
                // Only this thread deregisters, so a registered engine stays registered until
                // this call: it must succeed.
                c.is_registered(e) && {
                    c.deregister(e).unwrap();
                    true
                }
            })
        };
        publisher.join().unwrap();
        let e = registrar.join().unwrap();
        let left = leaver.join().unwrap();
        c.maybe_recompute();
        assert_eq!(c.is_registered(e), !left, "a departed engine is registered");
        if left {
            assert_eq!(
                c.register(2),
                Ok(e),
                "the departed engine's slot was not freed"
            );
        }
    });
}

/// The device-wide token count carries acquires in flight, so it can exceed `tokens_per_step`
/// for a moment; an acquirer that reads it then must be refused, not wrap `total - in_use`
/// into a grant. Lending makes the budgets sum past the device (a, demand 0: share 4; b:
/// budget 8, of 8 tokens), a holds 1 and b 5 (2 left): a asks for 3 and b for up to 3, each
/// within its own budget. While a's 3 are in flight (count 9) b's partial acquire must get at
/// most what is left, never 3 (9 tokens of 8).
#[test]
fn device_token_count_in_flight_never_wraps_into_a_grant() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 8, 2));
        let a = c.register(1).unwrap();
        let b = c.register(1).unwrap();
        c.set_active(a, true);
        c.set_active(b, true);
        c.publish_demand(a, 0);
        c.recompute();
        assert_eq!((c.token_budget(a), c.token_budget(b)), (4, 8));
        assert!(c.try_acquire_tokens(a, 1) && c.try_acquire_tokens(b, 5));
        let t = {
            let c = c.clone();
            thread::spawn(move || c.try_acquire_tokens(a, 3))
        };
        let got_b = u64::from(c.acquire_tokens_up_to(b, 3));
        let got_a = t.join().unwrap();
        assert!(!got_a, "3 tokens granted with 2 left");
        assert!(got_b <= 2, "{got_b} tokens granted with 2 left");
        assert_eq!(c.tokens_in_use(), 6 + got_b);
    });
}

/// Two registrations racing for the slots of a two-engine registry: each gets its own slot
/// (the claim is a compare-exchange on `FREE`: a load then a store let both take slot 0).
#[test]
fn two_registrations_never_share_a_slot() {
    crate::model(|| {
        let c = Arc::new(coordinator(2, 4, 4));
        let t = {
            let c = c.clone();
            thread::spawn(move || c.register(1).unwrap())
        };
        let mine = c.register(1).unwrap();
        let theirs = t.join().unwrap();
        assert_ne!(mine, theirs, "two engines registered in one slot");
        c.maybe_recompute();
        assert_eq!(c.snapshot().engines.len(), 2);
    });
}

/// Observers that find engines by scanning the slots (`snapshot`, `pick_donor`) racing the
/// registration that reuses a departed engine's slot: an engine they see as joined shows its
/// own figures (weight 2, no preemption figures published), never the old engine's (weight 1,
/// a published load that `deregister` leaves in the slot). Checks their Acquire loads of the
/// slot state, which pair with `register`'s Release store of `JOINING` after it refilled the
/// slot: without them the observer may see `JOINING` and then the old engine's figures.
#[test]
fn observers_see_a_reused_slot_with_the_new_engines_figures() {
    crate::model(|| {
        let c = Arc::new(coordinator(1, 4, 4));
        let old = active_engine(&c);
        c.publish_load(old, 0, 1);
        c.deregister(old).unwrap();
        let registrar = {
            let c = c.clone();
            thread::spawn(move || c.register(2).unwrap())
        };
        // On a spawned thread too: on the main thread loom ran one interleaving only.
        let observer = {
            let c = c.clone();
            thread::spawn(move || {
                // The requester's id is out of range: every registered engine is a candidate.
                let donor = c.pick_donor(EngineId(1), 5, 1);
                assert_eq!(donor, None, "the old engine's load offered as a donor");
                if let Some(s) = c.snapshot().engines.first() {
                    assert_eq!(
                        (s.weight, s.load),
                        (2, None),
                        "the old engine's figures listed"
                    );
                }
            })
        };
        observer.join().unwrap();
        registrar.join().unwrap();
    });
}
