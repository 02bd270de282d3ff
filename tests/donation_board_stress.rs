//! The donation board (`SharedArena::ask_donation` / `take_donations` / `withdraw_donation` /
//! `donations_taken`) under real threads, against its sequential model: a requester following
//! the engine driver's protocol (ask again only once the donor's take count moved past the
//! one it read after its last ask) has one request outstanding at most, so no take finds more
//! than one request per requester, and every request is taken or withdrawn exactly once. The
//! loom models (tests/loom/donations.rs) explore the interleavings of two or three engines;
//! this runs more of each side at once.

use pagedkv::block::EngineId;
use pagedkv::budget::BudgetConfig;
use pagedkv::engine::SharedArena;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

#[test]
fn requesters_and_a_donor_keep_the_books() {
    const REQUESTERS: u64 = 3;
    const STEPS: u64 = 20_000;
    let shared = SharedArena::external(BudgetConfig::new(4, 64, 64), 64).unwrap();
    let donor = EngineId(0);
    let asked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let requesters: Vec<_> = (1..=REQUESTERS)
        .map(|r| {
            let (shared, asked) = (shared.clone(), asked.clone());
            thread::spawn(move || {
                // Requester r asks r pages each time: a take's total tells the requests apart.
                // Every 7th step it withdraws instead (as a leaving engine does); what it got
                // back was never taken.
                let me = EngineId(r as u16);
                let mut pending: Option<u64> = None;
                for step in 0..STEPS {
                    if step % 7 == 6 {
                        let back = u64::from(shared.withdraw_donation(me));
                        assert!(back == 0 || back == r, "withdrew {back} pages");
                        asked.fetch_sub(back, Ordering::Relaxed);
                        pending = None;
                    } else if pending.is_none_or(|seen| shared.donations_taken(donor) != seen) {
                        // Count before asking: the taker may take it before this adds.
                        asked.fetch_add(r, Ordering::Relaxed);
                        let before = shared.withdraw_donation(me);
                        // An untaken request replaced: its pages are not taken.
                        asked.fetch_sub(u64::from(before), Ordering::Relaxed);
                        shared.ask_donation(me, donor, r as u32);
                        pending = Some(shared.donations_taken(donor));
                    }
                }
            })
        })
        .collect();
    let taker = {
        let (shared, stop) = (shared.clone(), stop.clone());
        thread::spawn(move || {
            let (mut taken, mut takes) = (0u64, 0u64);
            while !stop.load(Ordering::Acquire) {
                let pages = u64::from(shared.take_donations(donor));
                // At most one request of each requester: 1 + 2 + 3 pages.
                assert!(pages <= 6, "{pages} pages in one take");
                taken += pages;
                takes += 1;
            }
            (taken, takes)
        })
    };
    for r in requesters {
        r.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    let (taken, takes) = taker.join().unwrap();
    let rest = u64::from(shared.take_donations(donor));
    assert!(rest <= 6);
    assert_eq!(
        taken + rest,
        asked.load(Ordering::Relaxed),
        "pages lost or taken twice"
    );
    // The count is the takes, the last one included.
    assert_eq!(shared.donations_taken(donor), takes + 1);
    // An unknown engine records nothing.
    shared.ask_donation(EngineId(1), EngineId(9), 5);
    shared.ask_donation(EngineId(9), donor, 5);
    assert_eq!(shared.take_donations(EngineId(9)), 0);
    assert_eq!(shared.take_donations(donor), 0);
}

/// A request larger than the pool is clamped to it; a new ask replaces the requester's
/// untaken one; 0 pages withdraws.
#[test]
fn requests_clamp_to_the_pool_and_replace_their_predecessor() {
    let shared = SharedArena::external(BudgetConfig::new(3, 64, 16), 64).unwrap();
    let (a, b, donor) = (EngineId(0), EngineId(2), EngineId(1));
    shared.ask_donation(a, donor, u32::MAX);
    shared.ask_donation(b, donor, 3);
    assert_eq!(shared.take_donations(donor), 19);
    assert_eq!(shared.donations_taken(donor), 1);
    assert_eq!(shared.take_donations(donor), 0);
    shared.ask_donation(a, donor, 2);
    shared.ask_donation(a, donor, 4);
    assert_eq!(
        shared.take_donations(donor),
        4,
        "an ask added to its predecessor"
    );
    shared.ask_donation(a, donor, 2);
    shared.ask_donation(a, donor, 0);
    assert_eq!(shared.take_donations(donor), 0, "0 pages did not withdraw");
    assert_eq!(shared.withdraw_donation(a), 0);
}
