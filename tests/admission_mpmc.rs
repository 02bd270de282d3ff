//! sched::admission under concurrency: many submitters, one worker thread per worker, every
//! policy. At quiescent points (all threads parked at a barrier) the figures must equal what
//! the threads themselves counted; at the end every request has exactly one outcome.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use pagedkv::sched::admission::{
    Admission, AdmissionConfig, AdmissionError, OverflowPolicy, OverloadReason, Priority, Route,
    Ticket,
};

const WORKERS: usize = 3;
const PRODUCERS: usize = 3;
const ROUNDS: usize = 6;
const PER_ROUND: usize = 400;

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
    let stop = Arc::new(AtomicBool::new(false));
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
        let (q, barrier, popped, completed, producers_done, stop) = (
            q.clone(),
            barrier.clone(),
            popped.clone(),
            completed.clone(),
            producers_done.clone(),
            stop.clone(),
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
            // Drain until closed.
            while !stop.load(Ordering::SeqCst) || q.depth(w, Priority::Throughput).unwrap() > 0 {
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

    for _ in 0..ROUNDS {
        barrier.wait();
        // Quiescent: no thread is inside the queue set.
        let m = q.metrics();
        let depth: usize = m.workers.iter().map(|w| w.high_depth + w.low_depth).sum();
        let evicted = m.evicted_oldest as usize;
        let done = completed.load(Ordering::Relaxed);
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
            assert_eq!(q.depth(w, Priority::Throughput), Ok(wm.low_depth));
        }
        match policy {
            OverflowPolicy::Block => assert_eq!(evicted, 0),
            OverflowPolicy::DropNewest => assert_eq!(evicted, 0),
            OverflowPolicy::DropOldest => assert_eq!(m.rejected_full, 0),
        }
        barrier.wait();
    }
    stop.store(true, Ordering::SeqCst);
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
    stress(OverflowPolicy::Block);
}

#[test]
fn mpmc_drop_newest() {
    stress(OverflowPolicy::DropNewest);
}

#[test]
fn mpmc_drop_oldest() {
    stress(OverflowPolicy::DropOldest);
}

/// Several submitters blocked on one full queue, one slow worker: all are admitted in the end.
#[test]
fn many_blocked_submitters_all_get_in() {
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
