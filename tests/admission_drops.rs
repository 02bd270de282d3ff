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

/// A waker whose copies are counted one by one (`live`) and whose first clone runs `on_clone`: the clone a wait-list registration makes is the moment between a waiting future's
/// plain attempt and its registered re-check, so the hook makes the re-check succeed (another
/// thread's step landing in that window, made deterministic).
struct CloneHook {
    /// Live wakers on this hook, the test's own included.
    live: AtomicUsize,
    on_clone: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

mod clone_hook {
    use super::CloneHook;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{RawWaker, RawWakerVTable, Waker};

    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, wake, wake_by_ref, drop);

    /// # Safety
    /// `p` is the data pointer of a `RawWaker` of this vtable.
    unsafe fn hook(p: *const ()) -> &'static CloneHook {
        // SAFETY: every `RawWaker` of this vtable points at a leaked (`'static`) `CloneHook`.
        unsafe { &*(p as *const CloneHook) }
    }

    // The vtable's functions are called only with this vtable's data pointers (the
    // `RawWaker` contract), which is `hook`'s requirement.
    unsafe fn clone(p: *const ()) -> RawWaker {
        // SAFETY: `p` is this vtable's data pointer (above).
        let h = unsafe { hook(p) };
        h.live.fetch_add(1, Ordering::SeqCst);
        let f = h.on_clone.lock().unwrap().take();
        if let Some(f) = f {
            f();
        }
        RawWaker::new(p, &VTABLE)
    }

    unsafe fn wake(p: *const ()) {
        // By value: the wake-up itself does nothing here, then this copy is dropped.
        // SAFETY: `p` is this vtable's data pointer.
        unsafe { hook(p) }.live.fetch_sub(1, Ordering::SeqCst);
    }

    unsafe fn wake_by_ref(_: *const ()) {}

    unsafe fn drop(p: *const ()) {
        // SAFETY: `p` is this vtable's data pointer.
        unsafe { hook(p) }.live.fetch_sub(1, Ordering::SeqCst);
    }

    /// A waker on a new leaked hook that runs `on_clone` at its first clone.
    pub(super) fn waker(on_clone: impl FnOnce() + Send + 'static) -> (&'static CloneHook, Waker) {
        let h: &'static CloneHook = Box::leak(Box::new(CloneHook {
            live: AtomicUsize::new(1),
            on_clone: std::sync::Mutex::new(Some(Box::new(on_clone))),
        }));
        // SAFETY: the vtable's functions uphold the `RawWaker` contract for `h`, which lives
        // for the rest of the process.
        let w =
            unsafe { Waker::from_raw(RawWaker::new(h as *const CloneHook as *const (), &VTABLE)) };
        (h, w)
    }
}

/// A waiting future whose registered re-check succeeds (the work, the room or the close arrived
/// between its plain attempt and its registration, unseen by that step's wake-up) resolves with
/// its node still in the wait list. That node, and the clone of the task's waker in it, used to
/// stay there until the list's next wake-up: the next push for a worker's `pop_wait`, the next
/// pop for a blocked submit, and for a `pop_wait` that ended `Closed` never (the queue set's
/// drop), holding a finished task's memory in a runtime and waking it spuriously later.
#[test]
fn a_waiter_ready_at_its_registered_recheck_leaves_nothing_behind() {
    let q: Arc<Admission<u32, u32>> =
        Arc::new(Admission::new(AdmissionConfig::new(1, 1, OverflowPolicy::Block)).unwrap());

    // `pop_wait`: the request lands while it registers.
    let q2 = q.clone();
    let (hook, waker) = clone_hook::waker(move || {
        drop(
            q2.try_submit(1, Priority::Throughput, Route::Worker(0))
                .unwrap(),
        );
    });
    let mut fut = Box::pin(q.pop_wait(0));
    let Poll::Ready(Ok(job)) = fut.as_mut().poll(&mut Context::from_waker(&waker)) else {
        panic!("the request landed during the registration")
    };
    drop(fut);
    assert_eq!(
        hook.live.load(Ordering::SeqCst),
        1,
        "pop_wait: waker clones held besides the test's"
    );

    // A blocking submit: the room is made while it registers (the queue holds request 2).
    drop(
        q.try_submit(2, Priority::Throughput, Route::Worker(0))
            .unwrap(),
    );
    let q2 = q.clone();
    let (hook, waker) = clone_hook::waker(move || q2.pop(0).unwrap().unwrap().complete(0));
    let mut fut = Box::pin(q.submit(3, Priority::Throughput, Route::Worker(0)));
    let Poll::Ready(Ok(_t3)) = fut.as_mut().poll(&mut Context::from_waker(&waker)) else {
        panic!("room was made during the registration")
    };
    drop(fut);
    assert_eq!(
        hook.live.load(Ordering::SeqCst),
        1,
        "submit: waker clones held"
    );
    job.complete(0);
    q.pop(0).unwrap().unwrap().complete(0);

    // A blocking submit refused `Closed`: the close comes while it registers.
    let closing: Arc<Admission<u32, u32>> =
        Arc::new(Admission::new(AdmissionConfig::new(1, 1, OverflowPolicy::Block)).unwrap());
    let _queued = closing
        .try_submit(4, Priority::Throughput, Route::Worker(0))
        .unwrap();
    let c2 = closing.clone();
    let (hook, waker) = clone_hook::waker(move || c2.close());
    let mut fut = Box::pin(closing.submit(5, Priority::Throughput, Route::Worker(0)));
    let Poll::Ready(Err(refused)) = fut.as_mut().poll(&mut Context::from_waker(&waker)) else {
        panic!("closed during the registration")
    };
    assert_eq!(refused.error, pagedkv::error::AdmissionError::Closed);
    drop(fut);
    assert_eq!(
        hook.live.load(Ordering::SeqCst),
        1,
        "closed submit: waker clones held"
    );

    // `pop_wait` ending `Closed`: the close comes while it registers.
    let q2 = q.clone();
    let (hook, waker) = clone_hook::waker(move || q2.close());
    let mut fut = Box::pin(q.pop_wait(0));
    assert!(matches!(
        fut.as_mut().poll(&mut Context::from_waker(&waker)),
        Poll::Ready(Err(pagedkv::error::AdmissionError::Closed))
    ));
    drop(fut);
    assert_eq!(
        hook.live.load(Ordering::SeqCst),
        1,
        "closed pop_wait: waker clones held"
    );
    assert_eq!(q.in_flight(), 0);
}

/// A ticket polled (its task's waker stored) and then dropped (a client's timeout, a `select!`
/// that went the other way) while its request is still queued or running: the waker clone used
/// to stay in the one-shot until the worker completed the request, which under load (a long
/// queue, a long generation) held the client task's memory long after the task had ended.
/// Dropping the ticket releases it; the completion still resolves nothing and wakes nobody.
#[test]
fn a_dropped_ticket_releases_its_waker_at_once() {
    let q: Admission<u32, u32> =
        Admission::new(AdmissionConfig::new(1, 4, OverflowPolicy::DropNewest)).unwrap();
    let probe = Arc::new(Counting(AtomicUsize::new(0)));
    let waker = Waker::from(probe.clone());
    for popped_first in [false, true] {
        let mut ticket = Box::pin(
            q.try_submit(1, Priority::Throughput, Route::Worker(0))
                .unwrap(),
        );
        assert!(ticket
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        assert_eq!(clones(&probe), 2, "the ticket holds one clone");
        let job = popped_first.then(|| q.pop(0).unwrap().unwrap());
        drop(ticket);
        assert_eq!(clones(&probe), 1, "waker clone held by a dropped ticket");
        let job = job.unwrap_or_else(|| q.pop(0).unwrap().unwrap());
        assert!(job.is_cancelled());
        job.complete(10);
    }
    assert_eq!(probe.0.load(Ordering::SeqCst), 0, "nobody woken");
    assert_eq!(q.in_flight(), 0);
}
