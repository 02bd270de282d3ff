//! sched::admission: submits racing `close`. Submitter threads keep submitting while the queue
//! set is closed under them and each worker runs the usual drain loop
//! (`while let Ok(job) = pop_blocking(w)`). Once the workers have ended, with the queue set
//! still alive, every admitted ticket must already hold its result: a submit after the close is
//! refused `Closed`, and one that raced it was drained. Runs under a deadline, so a worker that
//! never sees `Closed` fails the test with a message instead of hanging it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use pagedkv::sched::admission::{
    Admission, AdmissionConfig, AdmissionError, OverflowPolicy, OverloadReason, Route,
};
use pagedkv::sched::Priority;

const WORKERS: usize = 2;
const SUBMITTERS: usize = 4;

/// Runs `f` on its own thread; fails with `what` if it does not finish within `secs` seconds
/// (and re-raises its panic if it panicked).
fn with_deadline(what: &str, secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: did not finish within {secs} s (a worker never saw `Closed`?)")
        }
    }
}

/// One round: returns (admitted, refused `Closed`).
fn round(policy: OverflowPolicy, seed: u64) -> (usize, usize) {
    let q: Arc<Admission<u64, u64>> =
        Arc::new(Admission::new(AdmissionConfig::new(WORKERS, 8, policy)).unwrap());
    let go = Arc::new(AtomicBool::new(false));
    // Set by the first admitted submit: every fourth round closes only after one, so the
    // rounds admit something however the threads are scheduled (on a loaded machine the
    // close could otherwise beat every submitter of all 400 rounds).
    let admitted_one = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let q = q.clone();
            thread::spawn(move || {
                let mut served = 0usize;
                while let Ok(job) = q.pop_blocking(w) {
                    let id = *job.payload();
                    job.complete(id ^ 0x5a5a);
                    served += 1;
                }
                served
            })
        })
        .collect();
    let submitters: Vec<_> = (0..SUBMITTERS as u64)
        .map(|s| {
            let (q, go, admitted_one) = (q.clone(), go.clone(), admitted_one.clone());
            thread::spawn(move || {
                while !go.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                let mut tickets = Vec::new();
                let mut closed = 0;
                for i in 0u64.. {
                    let id = (s << 32) | i;
                    let route = if i % 2 == 0 {
                        Route::LeastLoaded
                    } else {
                        Route::Worker((i as usize / 2) % WORKERS)
                    };
                    let r = if policy == OverflowPolicy::Block && i % 3 == 0 {
                        q.submit_blocking(id, Priority::Throughput, route)
                    } else {
                        q.try_submit(id, Priority::LatencyCritical, route)
                    };
                    match r {
                        Ok(t) => {
                            admitted_one.store(true, Ordering::Release);
                            tickets.push((id, t));
                        }
                        Err(refused) => match refused.error {
                            AdmissionError::Closed => {
                                closed += 1;
                                // Keep racing a little after the close, then stop.
                                if closed == 4 {
                                    break;
                                }
                            }
                            AdmissionError::Overloaded {
                                reason: OverloadReason::QueueFull,
                                ..
                            } => thread::yield_now(),
                            e => panic!("request {id}: {e}"),
                        },
                    }
                }
                (tickets, closed)
            })
        })
        .collect();
    go.store(true, Ordering::Release);
    // Close after a seed-dependent number of spins, to land at different points.
    for _ in 0..(seed * 7919 % 2000) {
        std::hint::spin_loop();
    }
    if seed % 4 == 0 {
        while !admitted_one.load(Ordering::Acquire) {
            thread::yield_now();
        }
    }
    q.close();
    let served: usize = workers.into_iter().map(|h| h.join().unwrap()).sum();
    let (mut admitted, mut refused, mut evicted) = (0, 0, 0);
    for h in submitters {
        let (tickets, closed) = h.join().unwrap();
        refused += closed;
        for (id, mut t) in tickets {
            admitted += 1;
            match t.try_take() {
                Some(Ok(v)) => assert_eq!(v, id ^ 0x5a5a),
                Some(Err(AdmissionError::Overloaded {
                    reason: OverloadReason::EvictedOldest,
                    ..
                })) if policy == OverflowPolicy::DropOldest => evicted += 1,
                Some(Err(e)) => panic!("round {seed}: request {id} ended with {e}"),
                None => panic!(
                    "round {seed}: request {id} was admitted but its ticket never resolved \
                     (the workers drained and ended while the queue set lives)"
                ),
            }
        }
    }
    assert_eq!(
        served + evicted,
        admitted,
        "round {seed}: every admitted request served or evicted, once"
    );
    assert_eq!(q.metrics().evicted_oldest as usize, evicted);
    assert_eq!(q.in_flight(), 0);
    assert_eq!(q.metrics().rejected_closed as usize, refused);
    (admitted, refused)
}

fn rounds(policy: OverflowPolicy) {
    let mut admitted = 0;
    for seed in 0..400 {
        admitted += round(policy, seed).0;
    }
    assert!(admitted > 0);
}

#[test]
fn submits_racing_close_are_refused_or_drained_drop_newest() {
    with_deadline("drop_newest", 120, || rounds(OverflowPolicy::DropNewest));
}

#[test]
fn submits_racing_close_are_refused_or_drained_block() {
    with_deadline("block", 120, || rounds(OverflowPolicy::Block));
}

#[test]
fn submits_racing_close_are_refused_or_drained_drop_oldest() {
    with_deadline("drop_oldest", 120, || rounds(OverflowPolicy::DropOldest));
}
