//! sched::admission: every payload and every result is dropped exactly once, whichever path it
//! takes (refused and handed back, evicted, popped and completed, abandoned, left queued when
//! the queue set is dropped, a withdrawn blocking submit), and nothing leaks: neither do the
//! wait-list places of waiting futures dropped before they were woken.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread;

use pagedkv::sched::admission::{Admission, AdmissionConfig, OverflowPolicy, Route};
use pagedkv::sched::Priority;

/// Counts its drops in a shared per-id table; a second drop of one id fails the test.
#[derive(Debug)]
struct Tracked {
    id: usize,
    drops: Arc<Vec<AtomicUsize>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let before = self.drops[self.id].fetch_add(1, Ordering::Relaxed);
        assert_eq!(before, 0, "id {} dropped twice", self.id);
    }
}

fn table(n: usize) -> Arc<Vec<AtomicUsize>> {
    Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect())
}

fn all_dropped_once(t: &[AtomicUsize]) {
    for (i, d) in t.iter().enumerate() {
        assert_eq!(d.load(Ordering::Relaxed), 1, "id {i}");
    }
}

#[test]
fn every_path_drops_once() {
    for policy in [
        OverflowPolicy::Block,
        OverflowPolicy::DropNewest,
        OverflowPolicy::DropOldest,
    ] {
        const N: usize = 64;
        let payloads = table(N);
        let results = table(N);
        let q: Admission<Tracked, Tracked> =
            Admission::new(AdmissionConfig::new(2, 3, policy)).unwrap();
        let mut tickets = Vec::new();
        let mut jobs = Vec::new();
        for id in 0..N {
            let p = Tracked {
                id,
                drops: payloads.clone(),
            };
            let prio = if id % 4 == 0 {
                Priority::LatencyCritical
            } else {
                Priority::Throughput
            };
            if id % 9 == 8 && policy == OverflowPolicy::Block {
                // A blocking submit polled once and withdrawn: its payload must drop with it.
                let mut fut = Box::pin(q.submit(p, prio, Route::Worker(id % 2)));
                let r = fut.as_mut().poll(&mut Context::from_waker(Waker::noop()));
                if let Poll::Ready(Ok(t)) = r {
                    tickets.push(t);
                }
                continue;
            }
            match q.try_submit(p, prio, Route::Worker(id % 2)) {
                Ok(t) => tickets.push(t),
                Err(refused) => drop(refused.into_payload()),
            }
            match id % 5 {
                0 => {
                    if let Some(job) = q.pop(id % 2).unwrap() {
                        let rid = job.payload().id;
                        job.complete(Tracked {
                            id: rid,
                            drops: results.clone(),
                        });
                    }
                }
                1 => jobs.extend(q.pop(id % 2).unwrap()), // abandoned below
                2 if id % 3 == 0 => drop(tickets.pop()),
                _ => {}
            }
        }
        // Results never taken from their tickets, or never produced, still drop once.
        for (i, t) in tickets.iter_mut().enumerate() {
            if i % 2 == 0 {
                drop(t.try_take());
            }
        }
        drop(jobs);
        drop(q);
        drop(tickets);
        all_dropped_once(&payloads);
        // Results exist only for completed jobs: each of those dropped exactly once.
        for d in results.iter() {
            assert!(d.load(Ordering::Relaxed) <= 1);
        }
        assert_eq!(Arc::strong_count(&payloads), 1, "a payload leaked");
        assert_eq!(Arc::strong_count(&results), 1, "a result leaked");
    }
}

#[test]
fn concurrent_drop_oldest_drops_once() {
    const PER: usize = 2000;
    const THREADS: usize = 3;
    let payloads = table(PER * THREADS);
    let results = table(PER * THREADS);
    let q: Arc<Admission<Tracked, Tracked>> =
        Arc::new(Admission::new(AdmissionConfig::new(1, 2, OverflowPolicy::DropOldest)).unwrap());
    let producers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (q, payloads) = (q.clone(), payloads.clone());
            thread::spawn(move || {
                for i in 0..PER {
                    let p = Tracked {
                        id: t * PER + i,
                        drops: payloads.clone(),
                    };
                    // Tickets dropped at once: outcomes are irrelevant here, drops are not.
                    drop(q.try_submit(p, Priority::Throughput, Route::Worker(0)));
                }
            })
        })
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let consumer = {
        let (q, results, stop) = (q.clone(), results.clone(), stop.clone());
        thread::spawn(move || loop {
            // Read the flag before popping: once set and the pop finds nothing, all is done.
            let stopping = stop.load(Ordering::SeqCst);
            match q.pop(0).unwrap() {
                Some(job) => {
                    let id = job.payload().id;
                    if id % 7 == 0 {
                        drop(job); // abandoned
                    } else {
                        job.complete(Tracked {
                            id,
                            drops: results.clone(),
                        });
                    }
                }
                None if stopping => break,
                None => thread::yield_now(),
            }
        })
    };
    for p in producers {
        p.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    consumer.join().unwrap();
    let m = q.metrics();
    assert_eq!(m.in_flight, 0);
    assert_eq!(m.workers[0].low_depth, 0);
    drop(q);
    all_dropped_once(&payloads);
    for d in results.iter() {
        assert!(d.load(Ordering::Relaxed) <= 1);
    }
}

/// A waker that counts its wake-ups; its `Arc`'s strong count says how many clones live.
struct Counting(AtomicUsize);

impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Clones of `probe`'s waker still alive (besides the test's own reference).
fn clones(probe: &Arc<Counting>) -> usize {
    Arc::strong_count(probe) - 1
}

/// An idle worker that waits with a timeout (`select!` on `pop_wait` and a tick) drops a
/// registered `PopWait` per tick: each used to leave its node and a clone of the task's waker in
/// the work list until the next push, 10,000 of them here.
#[test]
fn dropped_pop_waits_leave_nothing_behind() {
    let q: Admission<u32, u32> =
        Admission::new(AdmissionConfig::new(1, 4, OverflowPolicy::DropNewest)).unwrap();
    let probe = Arc::new(Counting(AtomicUsize::new(0)));
    let waker = Waker::from(probe.clone());
    for _ in 0..10_000 {
        let mut fut = std::pin::pin!(q.pop_wait(0));
        assert!(fut
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
    }
    drop(waker);
    assert_eq!(clones(&probe), 0, "waker clones held");
    // A waiter still registered is woken by the next push as before.
    let other = Arc::new(Counting(AtomicUsize::new(0)));
    let other_waker = Waker::from(other.clone());
    let mut fut = Box::pin(q.pop_wait(0));
    assert!(fut
        .as_mut()
        .poll(&mut Context::from_waker(&other_waker))
        .is_pending());
    let _t = q
        .try_submit(1, Priority::Throughput, Route::Worker(0))
        .unwrap();
    assert_eq!(other.0.load(Ordering::SeqCst), 1);
    assert!(matches!(
        fut.as_mut().poll(&mut Context::from_waker(&other_waker)),
        Poll::Ready(Ok(_))
    ));
}

/// Blocking submits withdrawn while the queue stays full (a timeout, `now_or_never`) left their
/// room-list places the same way until the next pop.
#[test]
fn withdrawn_blocking_submits_leave_nothing_behind() {
    let q: Admission<u32, u32> =
        Admission::new(AdmissionConfig::new(1, 1, OverflowPolicy::Block)).unwrap();
    let _first = q
        .try_submit(0, Priority::Throughput, Route::Worker(0))
        .unwrap();
    let probe = Arc::new(Counting(AtomicUsize::new(0)));
    let waker = Waker::from(probe.clone());
    for i in 0..10_000 {
        let mut fut = std::pin::pin!(q.submit(i, Priority::Throughput, Route::Worker(0)));
        assert!(matches!(
            fut.as_mut().poll(&mut Context::from_waker(&waker)),
            Poll::Pending
        ));
    }
    drop(waker);
    assert_eq!(clones(&probe), 0, "waker clones held");
}

/// A waiting future re-polled with another task's waker gives up its first place in the list.
#[test]
fn a_pop_wait_polled_with_a_new_waker_leaves_one_place() {
    let q: Admission<u32, u32> =
        Admission::new(AdmissionConfig::new(1, 4, OverflowPolicy::DropNewest)).unwrap();
    let probe = Arc::new(Counting(AtomicUsize::new(0)));
    let mut fut = Box::pin(q.pop_wait(0));
    for _ in 0..1000 {
        let waker = Waker::from(Arc::new(Counting(AtomicUsize::new(0))));
        assert!(fut
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
    }
    let waker = Waker::from(probe.clone());
    assert!(fut
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    drop(waker);
    assert_eq!(
        clones(&probe),
        1,
        "the current registration holds one clone"
    );
    drop(fut);
    assert_eq!(clones(&probe), 0);
}

/// `wait` on a ticket whose outcome `try_take` took says so instead of panicking.
#[test]
fn wait_after_try_take_is_an_error() {
    let q: Admission<u32, u32> =
        Admission::new(AdmissionConfig::new(1, 4, OverflowPolicy::DropNewest)).unwrap();
    let mut t = q
        .try_submit(1, Priority::Throughput, Route::Worker(0))
        .unwrap();
    q.pop(0).unwrap().unwrap().complete(10);
    assert_eq!(t.try_take(), Some(Ok(10)));
    assert!(t.is_ready());
    assert_eq!(t.wait(), Err(pagedkv::error::AdmissionError::Taken));
}

/// Polling (awaiting) a ticket whose outcome `try_take` took says so, as `wait` does, instead
/// of panicking: the poll never returned `Ready`, so the `Future` contract does not excuse it.
#[test]
fn poll_after_try_take_is_an_error() {
    struct Noop;
    impl Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }
    let q: Admission<u32, u32> =
        Admission::new(AdmissionConfig::new(1, 4, OverflowPolicy::DropNewest)).unwrap();
    let mut t = q
        .try_submit(1, Priority::Throughput, Route::Worker(0))
        .unwrap();
    q.pop(0).unwrap().unwrap().complete(10);
    assert_eq!(t.try_take(), Some(Ok(10)));
    let waker = Waker::from(Arc::new(Noop));
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        std::pin::Pin::new(&mut t).poll(&mut Context::from_waker(&waker))
    }));
    assert!(
        matches!(
            polled,
            Ok(Poll::Ready(Err(pagedkv::error::AdmissionError::Taken)))
        ),
        "{polled:?}"
    );
}
