//! loom models: the donation board (see tests/loom.rs). Engines ask each other for pages
//! (`SharedArena::ask_donation`), one request per requester; the donor takes the requests
//! addressed to it at its step, and a requester that leaves withdraws its own.

use loom::sync::Arc;
use loom::thread;
use pagedkv::block::EngineId;
use pagedkv::budget::BudgetConfig;
use pagedkv::engine::SharedArena;

const A: EngineId = EngineId(0);
const B: EngineId = EngineId(1);
const C: EngineId = EngineId(2);

fn board(engines: u16) -> Arc<SharedArena> {
    SharedArena::external(BudgetConfig::new(engines, 8, 8), 64).unwrap()
}

/// A requester that asked leaves (withdraws its request) while its donor takes: the pages go to the
/// donor or back to the withdrawal, exactly once, and nothing is left for a later take. A
/// per-donor sum of requests could not take one requester's part back without racing the
/// donor's take; a take that read a cell and then cleared it with a plain store would hand
/// the pages to both.
#[test]
fn a_withdrawn_request_is_taken_or_withdrawn_exactly_once() {
    crate::model(|| {
        let shared = board(2);
        // Asked before the race, so that the take and the withdrawal meet within loom's
        // preemption bound.
        shared.ask_donation(A, B, 3);
        let requester = {
            let shared = shared.clone();
            thread::spawn(move || shared.withdraw_donation(A))
        };
        let taken = shared.take_donations(B);
        let withdrawn = requester.join().unwrap();
        assert_eq!(taken + withdrawn, 3, "taken {taken}, withdrawn {withdrawn}");
        assert_eq!(
            shared.take_donations(B),
            0,
            "a request outlived its withdrawal"
        );
    });
}

/// Two requesters ask one donor while it takes: each request is taken by that take or by the
/// next one, never lost and never twice. Checks the order of an ask (the request, then the
/// donor's flag) against a take (the flag cleared, then the scan): a flag set before its
/// request is in place can be cleared by a scan that misses the request, which no later take
/// then looks for.
#[test]
fn concurrent_asks_are_taken_once_each() {
    crate::model(|| {
        let shared = board(3);
        let askers: Vec<_> = [(A, 2), (C, 5)]
            .into_iter()
            .map(|(requester, pages)| {
                let shared = shared.clone();
                thread::spawn(move || shared.ask_donation(requester, B, pages))
            })
            .collect();
        let first = shared.take_donations(B);
        for t in askers {
            t.join().unwrap();
        }
        let second = shared.take_donations(B);
        assert!(matches!(first, 0 | 2 | 5 | 7), "first take {first}");
        assert_eq!(first + second, 7, "takes {first} then {second}");
    });
}

/// A requester asks and then reads the donor's count of takes; the donor takes concurrently.
/// If the read saw no take yet, the take that comes is the one that takes the request (the
/// requester waits for the count to move before asking again, and must not wait on a take
/// that overlooked it).
#[test]
fn a_take_the_requester_waits_for_sees_its_request() {
    crate::model(|| {
        let shared = board(2);
        let requester = {
            let shared = shared.clone();
            thread::spawn(move || {
                shared.ask_donation(A, B, 2);
                shared.donations_taken(B)
            })
        };
        let taken = shared.take_donations(B);
        let count_read = requester.join().unwrap();
        if count_read == 0 {
            assert_eq!(
                taken, 2,
                "the take the requester waited for missed its request"
            );
        }
    });
}

/// A requester stepping three times, asking one page whenever the donor's count of takes moved
/// past the one it read after its last ask (as the engine driver does), against a donor taking
/// twice: no take finds more than the one page, and the pages asked are the pages taken (the
/// last drained after both stop). On the board of one page sum per donor (before the
/// per-requester cells), an ask between the donor's count and its take of the sum saw the count
/// move, asked again, and the take found both: this model failed with "2 pages taken".
#[test]
fn a_requester_never_has_two_requests_outstanding() {
    crate::model(|| {
        let shared = board(2);
        let t = {
            let shared = shared.clone();
            thread::spawn(move || {
                let mut taken = 0;
                for _ in 0..2 {
                    let pages = shared.take_donations(B);
                    assert!(pages <= 1, "two requests outstanding: {pages} pages taken");
                    taken += pages;
                }
                taken
            })
        };
        let (mut asked, mut last_seen) = (0, None);
        for _ in 0..3 {
            if last_seen.is_none_or(|seen| shared.donations_taken(B) != seen) {
                shared.ask_donation(A, B, 1);
                last_seen = Some(shared.donations_taken(B));
                asked += 1;
            }
        }
        let taken = t.join().unwrap();
        let rest = shared.take_donations(B);
        assert!(rest <= 1, "two requests outstanding: {rest} pages left");
        // A request replaced before its take is counted once: the pages taken are at most the
        // asks, and at least one was taken.
        assert!(
            taken + rest <= asked && taken + rest >= 1,
            "asked {asked}, taken {taken} + {rest}"
        );
    });
}
