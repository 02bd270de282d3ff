//! sched::admission under concurrency: many submitters, one worker thread per worker, every
//! policy. At quiescent points (all threads parked at a barrier) the figures must equal what
//! the threads themselves counted, and every other round the queues are drained there so each
//! reported depth is checked against the requests actually in that queue; at the end every
//! request has exactly one outcome. Each test runs under a deadline: a hang fails it with a
//! message instead of hanging the suite.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::thread;
use std::time::Duration;

use pagedkv::sched::admission::{
    Admission, AdmissionConfig, AdmissionError, OverflowPolicy, OverloadReason, Route, Ticket,
};
use pagedkv::sched::Priority;

const WORKERS: usize = 3;
const PRODUCERS: usize = 3;
const ROUNDS: usize = 6;
const PER_ROUND: usize = 400;

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
            panic!("{what}: did not finish within {secs} s (hung?)")
        }
    }
}

fn route(id: u32) -> Route {
    match id % 3 {
        0 => Route::Worker(id as usize / 3 % WORKERS),
        1 => Route::Session(u64::from(id / 7)),
        _ => Route::LeastLoaded,
    }
}

fn stress(policy: OverflowPolicy) {
    let q: Arc<Admission<u32, u32>> = Arc::new(
        Admission::new(AdmissionConfig {
            workers: WORKERS,
            high_capacity: 4,
            low_capacity: 16,
            policy,
        })
        .unwrap(),
    );
    let total = PRODUCERS * ROUNDS * PER_ROUND;
    let popped: Arc<Vec<AtomicU8>> = Arc::new((0..total).map(|_| AtomicU8::new(0)).collect());
    let refused_full = Arc::new(AtomicU64::new(0));
    let admitted = Arc::new(AtomicUsize::new(0));
    let completed = Arc::new(AtomicUsize::new(0));
    let producers_done = Arc::new(AtomicUsize::new(0));
    // Producers + workers + the checking main thread.
    let barrier = Arc::new(Barrier::new(PRODUCERS + WORKERS + 1));

    let mut producer_handles = Vec::new();
    for p in 0..PRODUCERS {
        let (q, barrier, refused_full, admitted, producers_done) = (
            q.clone(),
            barrier.clone(),
            refused_full.clone(),
            admitted.clone(),
            producers_done.clone(),
        );
        producer_handles.push(thread::spawn(move || {
            let mut tickets: Vec<(u32, Ticket<u32>)> = Vec::new();
            for round in 0..ROUNDS {
                for i in 0..PER_ROUND {
                    let id = ((round * PRODUCERS + p) * PER_ROUND + i) as u32;
                    let prio = if id % 5 == 0 {
                        Priority::LatencyCritical
                    } else {
                        Priority::Throughput
                    };
                    let res = if policy == OverflowPolicy::Block && id % 2 == 0 {
                        q.submit_blocking(id, prio, route(id))
                    } else {
                        q.try_submit(id, prio, route(id))
                    };
                    match res {
                        Ok(t) => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            tickets.push((id, t));
                        }
                        Err(r) => {
                            assert_eq!(r.payload, id);
                            assert!(matches!(
                                r.error,
                                AdmissionError::Overloaded {
                                    reason: OverloadReason::QueueFull,
                                    ..
                                }
                            ));
                            refused_full.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                producers_done.fetch_add(1, Ordering::SeqCst);
                barrier.wait(); // quiescent: main checks
                barrier.wait(); // next round
            }
            tickets
        }));
    }

    let mut worker_handles = Vec::new();
    for w in 0..WORKERS {
        let (q, barrier, popped, completed, producers_done) = (
            q.clone(),
            barrier.clone(),
            popped.clone(),
            completed.clone(),
            producers_done.clone(),
        );
        worker_handles.push(thread::spawn(move || {
            for round in 0..ROUNDS {
                // Serve while producers run, then stop so the queues hold a remainder.
                while producers_done.load(Ordering::SeqCst) < (round + 1) * PRODUCERS {
                    match q.pop(w).unwrap() {
                        Some(job) => {
                            let id = *job.payload();
                            assert_eq!(job.worker(), w);
                            assert_eq!(popped[id as usize].fetch_add(1, Ordering::Relaxed), 0);
                            completed.fetch_add(1, Ordering::Relaxed);
                            job.complete(id.wrapping_mul(3));
                        }
                        None => thread::yield_now(),
                    }
                }
                barrier.wait();
                barrier.wait();
            }
            // Drain until closed: `pop_blocking` serves what is queued, both classes, and ends
            // with `Closed` only once the set is closed and this worker's queues are empty.
            // (Stopping when the throughput queue alone looked empty left latency-critical
            // requests without an outcome: a flaky failure under load.)
            loop {
                match q.pop_blocking(w) {
                    Ok(job) => {
                        let id = *job.payload();
                        assert_eq!(popped[id as usize].fetch_add(1, Ordering::Relaxed), 0);
                        completed.fetch_add(1, Ordering::Relaxed);
                        job.complete(id.wrapping_mul(3));
                    }
                    Err(AdmissionError::Closed) => break,
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }

    for round in 0..ROUNDS {
        barrier.wait();
        // Quiescent: no thread is inside the queue set.
        let m = q.metrics();
        if round % 2 == 0 {
            // Every reported depth against the requests actually in that queue: drain them
            // (serving them as a worker would) and count by worker and class.
            for w in 0..WORKERS {
                let mut found = [0usize; 2];
                while let Some(job) = q.pop(w).unwrap() {
                    let id = *job.payload();
                    assert_eq!(job.worker(), w);
                    assert_eq!(popped[id as usize].fetch_add(1, Ordering::Relaxed), 0);
                    found[(job.priority() == Priority::Throughput) as usize] += 1;
                    job.complete(id.wrapping_mul(3));
                }
                assert_eq!(
                    (m.workers[w].high_depth, m.workers[w].low_depth),
                    (found[0], found[1]),
                    "worker {w}: reported (high, low) depth vs requests found in the queues"
                );
                assert_eq!(q.depth(w, Priority::LatencyCritical), Ok(0));
                assert_eq!(q.depth(w, Priority::Throughput), Ok(0));
                completed.fetch_add(found[0] + found[1], Ordering::Relaxed);
            }
        }
        let depth: usize = m.workers.iter().map(|w| w.high_depth + w.low_depth).sum();
        let evicted = m.evicted_oldest as usize;
        let drained_now: usize = if round % 2 == 0 {
            m.workers.iter().map(|w| w.high_depth + w.low_depth).sum()
        } else {
            0
        };
        let done = completed.load(Ordering::Relaxed) - drained_now;
        let adm = admitted.load(Ordering::Relaxed);
        assert_eq!(
            adm,
            done + evicted + depth,
            "admitted = completed + evicted + queued"
        );
        assert_eq!(
            m.in_flight, depth,
            "workers complete at once, so in flight = queued"
        );
        assert_eq!(m.rejected_full, refused_full.load(Ordering::Relaxed));
        assert_eq!(m.abandoned, 0);
        for (w, wm) in m.workers.iter().enumerate() {
            assert_eq!(wm.load, wm.high_depth + wm.low_depth, "worker {w}");
            assert!(wm.high_depth <= 4 && wm.low_depth <= 16);
        }
        match policy {
            OverflowPolicy::Block => assert_eq!(evicted, 0),
            OverflowPolicy::DropNewest => assert_eq!(evicted, 0),
            OverflowPolicy::DropOldest => assert_eq!(m.rejected_full, 0),
        }
        barrier.wait();
    }
    q.close();
    for h in worker_handles {
        h.join().unwrap();
    }
    let mut outcomes = (0usize, 0usize);
    for h in producer_handles {
        for (id, mut t) in h.join().unwrap() {
            match t.try_take().expect("every admitted request has an outcome") {
                Ok(v) => {
                    assert_eq!(v, id.wrapping_mul(3));
                    assert_eq!(popped[id as usize].load(Ordering::Relaxed), 1);
                    outcomes.0 += 1;
                }
                Err(AdmissionError::Overloaded {
                    reason: OverloadReason::EvictedOldest,
                    ..
                }) => {
                    assert_eq!(policy, OverflowPolicy::DropOldest);
                    assert_eq!(popped[id as usize].load(Ordering::Relaxed), 0);
                    outcomes.1 += 1;
                }
                Err(e) => panic!("request {id}: {e}"),
            }
        }
    }
    let m = q.metrics();
    assert_eq!(m.in_flight, 0);
    assert_eq!(outcomes.1 as u64, m.evicted_oldest);
    assert_eq!(
        outcomes.0 + outcomes.1 + m.rejected_full as usize,
        total,
        "each request: completed, evicted or refused, exactly once"
    );
    if policy == OverflowPolicy::Block {
        assert!(outcomes.0 > total / 2, "blocking submits are never refused");
    }
}

#[test]
fn mpmc_block() {
    with_deadline("mpmc_block", 120, || stress(OverflowPolicy::Block));
}

#[test]
fn mpmc_drop_newest() {
    with_deadline("mpmc_drop_newest", 120, || {
        stress(OverflowPolicy::DropNewest)
    });
}

#[test]
fn mpmc_drop_oldest() {
    with_deadline("mpmc_drop_oldest", 120, || {
        stress(OverflowPolicy::DropOldest)
    });
}

/// Several submitters blocked on one full queue, one slow worker: all are admitted in the end.
#[test]
fn many_blocked_submitters_all_get_in() {
    with_deadline(
        "many_blocked_submitters_all_get_in",
        120,
        many_blocked_submitters,
    );
}

fn many_blocked_submitters() {
    let q: Arc<Admission<u32, ()>> =
        Arc::new(Admission::new(AdmissionConfig::new(1, 1, OverflowPolicy::Block)).unwrap());
    let submitters: Vec<_> = (0..6)
        .map(|s| {
            let q = q.clone();
            thread::spawn(move || {
                for i in 0..200 {
                    let t = q
                        .submit_blocking(s * 1000 + i, Priority::Throughput, Route::Worker(0))
                        .unwrap();
                    drop(t);
                }
            })
        })
        .collect();
    let mut served = 0;
    while served < 1200 {
        let job = q.pop_blocking(0).unwrap();
        job.complete(());
        served += 1;
    }
    for s in submitters {
        s.join().unwrap();
    }
    assert_eq!(q.in_flight(), 0);
    assert_eq!(q.metrics().rejected_full, 0);
}
