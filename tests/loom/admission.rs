//! loom models: admission (see tests/loom.rs).
//!
//! - drop-oldest racing a pop: every request is popped exactly once or reported evicted
//!   exactly once, never both, never neither;
//! - a blocking submit on a full queue is woken by the pop that makes room (a lost wake-up
//!   would leave `block_on` parked forever, which loom reports as a deadlock);
//! - `close` wakes a blocked submitter, which then gets `Closed`;
//! - an idle `pop_wait` is woken by the submit that brings work;
//! - the ticket one-shot: completion racing the ticket's poll, and the ticket's drop (loom's
//!   `Arc` checks that nothing leaks); a ticket re-polled with a new waker while completing;
//!   a polled ticket dropped while completing (the drop takes its waker back);
//! - a multi-slot ring with two producers and a consumer, across a lap boundary: every admitted
//!   request is taken exactly once, in each producer's order, at least two of four admitted;
//! - drop-oldest evicts only from a full queue: a pop that frees a slot first means no eviction;
//! - a `pop_wait` polled again with a different waker is woken through the new one;
//! - a blocking submit withdrawn beside a waiting one: the withdrawal takes the room list and
//!   the other waiter is still admitted once there is room;
//! - `pop_wait` against `close`: an idle worker is woken and ends with `Closed`;
//! - a submit racing `close`: refused `Closed`, or admitted and drained by the worker's
//!   `pop_wait` loop before it sees `Closed` (its ticket resolves);
//! - a blocking submit re-polled with a new waker while a pop makes room: woken through it;
//! - `close` racing a blocked submit and the worker's drain loop: refused or drained;
//! - the drop-oldest `submit` future racing a pop: its poll wakes its own task while a popper
//!   holds the slot mid-read, and every request is popped or evicted exactly once;
//! - two drop-oldest `try_submit`s on a full queue (one slot, two slots) while a worker pops
//!   once: each can take the slot the other's eviction freed and wait for the other or the
//!   worker mid-way; every request is completed xor evicted, none lost, counters exact.
//!
//! CI runs these with `LOOM_MAX_PREEMPTIONS=2`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Wake, Waker};

use loom::sync::Arc;
use loom::thread;

use pagedkv::sched::admission::{
    Admission, AdmissionConfig, AdmissionError, OverflowPolicy, OverloadReason, Route,
};
use pagedkv::sched::Priority;

/// Drives `f` on this loom thread, parking it (loom's `park`) while pending. A wake-up that
/// never comes leaves every thread parked, which loom reports as a deadlock.
fn block_on<F: Future>(f: F) -> F::Output {
    block_on_pinned(std::pin::pin!(f))
}

/// [`block_on`] for a future that may have been polled before (with another waker).
///
/// A wake-up is noted in a plain std flag besides the unpark: loom's `yield_now` (which the
/// library's `Backoff` calls under loom) drops a pending unpark, so a wake-up that lands while
/// the poll is still running, before a backoff inside it, would otherwise be lost and the
/// thread would park for good: a deadlock that std's `park` (whose token survives a yield)
/// never has. With the flag, a poll woken while it ran polls again instead of parking.
fn block_on_pinned<F: Future>(mut f: Pin<&mut F>) -> F::Output {
    use std::sync::atomic::{AtomicBool, Ordering};
    struct Unpark {
        thread: thread::Thread,
        /// Bookkeeping of this executor, not part of the model: a plain std atomic.
        woken: AtomicBool,
    }
    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.woken.store(true, Ordering::Relaxed);
            self.thread.unpark();
        }
    }
    let unpark = std::sync::Arc::new(Unpark {
        thread: thread::current(),
        woken: AtomicBool::new(false),
    });
    let waker = Waker::from(unpark.clone());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut Context::from_waker(&waker)) {
            return v;
        }
        // No loom operation between this check and `park`, so no other thread runs in
        // between: a wake-up after the check finds this thread parked (or unparks it first).
        if !unpark.woken.swap(false, Ordering::Relaxed) {
            thread::park();
            unpark.woken.store(false, Ordering::Relaxed);
        }
    }
}

const P: Priority = Priority::Throughput;
const W0: Route = Route::Worker(0);

fn one_slot(policy: OverflowPolicy) -> Arc<Admission<u32, u32>> {
    Arc::new(Admission::new(AdmissionConfig::new(1, 1, policy)).unwrap())
}

#[test]
fn drop_oldest_racing_pop() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropOldest);
        let mut ta = q.try_submit(1, P, W0).unwrap();
        let submitter = {
            let q = q.clone();
            thread::spawn(move || q.try_submit(2, P, W0).unwrap())
        };
        let popper = {
            let q = q.clone();
            thread::spawn(move || {
                q.pop(0).unwrap().map(|job| {
                    let id = *job.payload();
                    job.complete(id * 10);
                    id
                })
            })
        };
        let mut tb = submitter.join().unwrap();
        let mut popped: Vec<u32> = popper.join().unwrap().into_iter().collect();
        while let Some(job) = q.pop(0).unwrap() {
            let id = *job.payload();
            job.complete(id * 10);
            popped.push(id);
        }
        let a = ta.try_take().expect("request 1 has an outcome");
        let b = tb.try_take().expect("request 2 has an outcome");
        let evicted = Err(AdmissionError::Overloaded {
            reason: OverloadReason::EvictedOldest,
            worker: 0,
        });
        // Request 1: popped xor evicted.
        match popped.iter().filter(|&&id| id == 1).count() {
            1 => assert_eq!(a, Ok(10)),
            0 => assert_eq!(a, evicted),
            n => panic!("request 1 popped {n} times"),
        }
        // Request 2 is never evicted (nobody submits after it) and is popped exactly once.
        assert_eq!(popped.iter().filter(|&&id| id == 2).count(), 1);
        assert_eq!(b, Ok(20));
        assert_eq!(q.in_flight(), 0);
        assert_eq!(q.metrics().evicted_oldest, u64::from(a == evicted));
    });
}

#[test]
fn blocking_submit_is_woken_by_pop() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let _ta = q.try_submit(1, P, W0).unwrap();
        let submitter = {
            let q = q.clone();
            thread::spawn(move || block_on(q.submit(2, P, W0)).map_err(|r| r.error))
        };
        let job = q.pop(0).unwrap().expect("request 1 is queued");
        assert_eq!(*job.payload(), 1);
        job.complete(0);
        let mut tb = submitter
            .join()
            .unwrap()
            .expect("admitted once room was made");
        let job = q.pop(0).unwrap().expect("request 2 is queued");
        assert_eq!(*job.payload(), 2);
        job.complete(5);
        assert_eq!(tb.try_take(), Some(Ok(5)));
    });
}

#[test]
fn close_wakes_blocked_submit() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let _ta = q.try_submit(1, P, W0).unwrap();
        let submitter = {
            let q = q.clone();
            thread::spawn(move || block_on(q.submit(2, P, W0)).map_err(|r| (r.error, r.payload)))
        };
        q.close();
        let r = submitter.join().unwrap();
        assert_eq!(r.unwrap_err(), (AdmissionError::Closed, 2));
    });
}

#[test]
fn pop_wait_is_woken_by_submit() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropNewest);
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                let job = block_on(q.pop_wait(0)).expect("work arrives");
                let id = *job.payload();
                job.complete(id + 1);
            })
        };
        let t = q.try_submit(7, P, W0).unwrap();
        assert_eq!(block_on(t), Ok(8));
        worker.join().unwrap();
    });
}

#[test]
fn ticket_oneshot_complete_races_poll_and_drop() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropNewest);
        let t1 = q.try_submit(1, P, W0).unwrap();
        let job = q.pop(0).unwrap().unwrap();
        let completer = thread::spawn(move || job.complete(11));
        assert_eq!(block_on(t1), Ok(11));
        completer.join().unwrap();

        // The ticket dropped while the worker completes: no leak, no double free.
        let t2 = q.try_submit(2, P, W0).unwrap();
        let job = q.pop(0).unwrap().unwrap();
        let completer = thread::spawn(move || {
            let _ = job.is_cancelled();
            job.complete(22);
        });
        drop(t2);
        completer.join().unwrap();
        assert_eq!(q.in_flight(), 0);
    });
}

#[test]
fn abandoned_job_wakes_ticket() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let t = q.try_submit(1, P, W0).unwrap();
        let job = q.pop(0).unwrap().unwrap();
        let worker = thread::spawn(move || drop(job));
        assert_eq!(block_on(t), Err(AdmissionError::Abandoned));
        worker.join().unwrap();
    });
}

/// Two producers and a consumer on one worker's ring of capacity 2, starting one slot before a
/// lap boundary (so positions cross it): the Vyukov stamps and lapped positions under
/// contention. Every admitted request is popped exactly once, each producer's requests in its
/// order, and at least two of the four are admitted (the consumer takes at most one). A refusal
/// is `QueueFull`; it can come with one request queued, while the consumer is mid-way through
/// taking the other (the ring reports Busy, which a non-blocking submit reports as full).
#[test]
fn two_producers_multi_slot_ring() {
    crate::model(|| {
        let q = Arc::new(
            Admission::<u32, u32>::new(AdmissionConfig::new(1, 2, OverflowPolicy::DropNewest))
                .unwrap(),
        );
        // Move head and tail to position 1: the next two positions straddle the lap boundary.
        let t0 = q.try_submit(0, P, W0).unwrap();
        q.pop(0).unwrap().unwrap().complete(0);
        drop(t0);
        let producers: Vec<_> = [10u32, 20]
            .into_iter()
            .map(|base| {
                let q = q.clone();
                thread::spawn(move || {
                    (base..base + 2)
                        .map(|id| (id, q.try_submit(id, P, W0).map_err(|r| r.error)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let consumer = {
            let q = q.clone();
            thread::spawn(move || {
                q.pop(0).unwrap().map(|job| {
                    let id = *job.payload();
                    job.complete(id + 1);
                    id
                })
            })
        };
        let mut popped: Vec<u32> = consumer.join().unwrap().into_iter().collect();
        let results: Vec<_> = producers
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        while let Some(job) = q.pop(0).unwrap() {
            let id = *job.payload();
            job.complete(id + 1);
            popped.push(id);
        }
        let mut admitted = 0;
        for (id, r) in results {
            match r {
                Ok(mut t) => {
                    admitted += 1;
                    assert_eq!(
                        popped.iter().filter(|&&p| p == id).count(),
                        1,
                        "request {id}"
                    );
                    assert_eq!(t.try_take(), Some(Ok(id + 1)));
                }
                Err(e) => {
                    assert!(matches!(
                        e,
                        AdmissionError::Overloaded {
                            reason: OverloadReason::QueueFull,
                            ..
                        }
                    ));
                    assert!(!popped.contains(&id));
                }
            }
        }
        assert_eq!(popped.len(), admitted);
        // The consumer took at most one, so at least two of the four were admitted.
        assert!(admitted >= 2);
        for base in [10u32, 20] {
            let mine: Vec<u32> = popped
                .iter()
                .copied()
                .filter(|p| p / 10 * 10 == base)
                .collect();
            assert!(
                mine.windows(2).all(|w| w[0] < w[1]),
                "FIFO per producer: {popped:?}"
            );
        }
        assert_eq!(q.in_flight(), 0);
        assert_eq!(q.metrics().rejected_full as usize, 4 - admitted);
    });
}

/// Drop-oldest on a full queue of capacity 2 (requests 1 and 2) while a worker pops once: if
/// the worker's pop frees a slot first, the new request takes it and nothing is evicted; an
/// eviction, if any, takes request 1 (the oldest of a full queue), never request 2.
#[test]
fn drop_oldest_evicts_only_a_full_queue() {
    crate::model(|| {
        let q = Arc::new(
            Admission::<u32, u32>::new(AdmissionConfig::new(1, 2, OverflowPolicy::DropOldest))
                .unwrap(),
        );
        let mut t1 = q.try_submit(1, P, W0).unwrap();
        let mut t2 = q.try_submit(2, P, W0).unwrap();
        let submitter = {
            let q = q.clone();
            thread::spawn(move || q.try_submit(3, P, W0).unwrap())
        };
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                let job = q.pop(0).unwrap().expect("the queue is never empty here");
                let id = *job.payload();
                job.complete(id);
                id
            })
        };
        let mut t3 = submitter.join().unwrap();
        let first = worker.join().unwrap();
        let mut rest = Vec::new();
        while let Some(job) = q.pop(0).unwrap() {
            let id = *job.payload();
            job.complete(id);
            rest.push(id);
        }
        let evicted = Err(AdmissionError::Overloaded {
            reason: OverloadReason::EvictedOldest,
            worker: 0,
        });
        let (o1, o2, o3) = (t1.try_take(), t2.try_take(), t3.try_take());
        assert_ne!(
            o2,
            Some(evicted),
            "request 2 evicted: worker took {first}, then {rest:?}"
        );
        assert_eq!(o3, Some(Ok(3)));
        if first == 1 {
            assert_eq!(
                (o1, o2),
                (Some(Ok(1)), Some(Ok(2))),
                "room was made: nothing evicted"
            );
            assert_eq!(q.metrics().evicted_oldest, 0);
        } else {
            // Request 1 was evicted before the worker's pop, which took request 2.
            assert_eq!((first, o1, o2), (2, Some(evicted), Some(Ok(2))));
            assert_eq!(q.metrics().evicted_oldest, 1);
        }
        assert_eq!(q.in_flight(), 0);
    });
}

/// A `pop_wait` polled once with one waker, then again with another (a task moved between
/// executors, or a runtime that re-creates wakers): the submit must wake the second. If the
/// second poll trusted the first registration, the worker would park forever (a loom deadlock).
#[test]
fn pop_wait_with_a_waker_replaced_between_polls() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropNewest);
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                let mut fut = std::pin::pin!(q.pop_wait(0));
                // First poll with a waker that wakes nobody.
                let first = fut.as_mut().poll(&mut Context::from_waker(Waker::noop()));
                let job = match first {
                    Poll::Ready(r) => r,
                    Poll::Pending => block_on_pinned(fut),
                }
                .expect("work arrives");
                let id = *job.payload();
                job.complete(id + 1);
            })
        };
        let t = q.try_submit(7, P, W0).unwrap();
        assert_eq!(block_on(t), Ok(8));
        worker.join().unwrap();
    });
}

/// A blocking submit withdrawn after one poll (its future dropped) while another submitter
/// waits and the worker pops: the withdrawal takes the whole room list (the only way its node
/// leaves it) and wakes the other waiter spuriously; that one must still be admitted once there
/// is room, not left parked (a loom deadlock), and the withdrawn request is queued only if its
/// one poll admitted it.
#[test]
fn withdrawn_submit_beside_a_waiting_one() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let _t1 = q.try_submit(1, P, W0).unwrap();
        let waiting = {
            let q = q.clone();
            thread::spawn(move || block_on(q.submit(2, P, W0)).map_err(|r| r.error))
        };
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                let job = q.pop(0).unwrap().expect("request 1 is queued");
                let id = *job.payload();
                job.complete(0);
                id
            })
        };
        // Withdrawn on a third thread: polled once, then dropped (registered unless the poll
        // admitted it). On the main thread loom missed interleavings (it never had the waiter
        // poll `Pending` three times beside an admitted request 3).
        let withdrawn = {
            let q = q.clone();
            thread::spawn(move || {
                let mut fut = std::pin::pin!(q.submit(3, P, W0));
                matches!(
                    fut.as_mut().poll(&mut Context::from_waker(Waker::noop())),
                    Poll::Ready(Ok(_))
                )
            })
        };
        let admitted_3 = withdrawn.join().unwrap();
        assert_eq!(worker.join().unwrap(), 1);
        let mut popped = Vec::new();
        let mut pop = || {
            let job = q.pop(0).unwrap().expect("a request is queued");
            popped.push(*job.payload());
            job.complete(0);
        };
        if admitted_3 {
            pop(); // 3 holds the slot; 2 waits for this pop
        }
        let _t2 = waiting
            .join()
            .unwrap()
            .expect("admitted once room was made");
        pop();
        assert_eq!(popped, if admitted_3 { vec![3, 2] } else { vec![2] });
        assert!(q.pop(0).unwrap().is_none());
    });
}

/// An idle worker parked in `pop_wait` while the queue set is closed: woken, it ends `Closed`.
#[test]
fn pop_wait_against_close() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let worker = {
            let q = q.clone();
            thread::spawn(move || block_on(q.pop_wait(0)).map(|job| *job.payload()))
        };
        q.close();
        assert_eq!(worker.join().unwrap(), Err(AdmissionError::Closed));
    });
}

/// A submit racing `close` while the worker runs the usual drain loop
/// (`while let Ok(job) = pop_wait(w).await`): the submit is refused `Closed`, or it is admitted
/// and the worker takes it before it sees `Closed`, so every admitted ticket resolves.
///
/// (The worker loop runs on its own thread and nothing joins while it may still be unparked:
/// a wake-up of a stale registration, harmless with std, trips loom if its target is blocked
/// in `join`.)
#[test]
fn submit_racing_close_is_refused_or_drained() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropNewest);
        let submitter = {
            let q = q.clone();
            thread::spawn(move || q.try_submit(5, P, W0).map_err(|r| (r.error, r.payload)))
        };
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                let mut served = 0;
                while let Ok(job) = block_on(q.pop_wait(0)) {
                    let id = *job.payload();
                    job.complete(id * 2);
                    served += 1;
                }
                served
            })
        };
        // The close on a third thread: on the main thread loom missed interleavings (it never
        // had the worker's `pop_wait` return `Pending` two or three times before serving an
        // admitted request).
        let closer = {
            let q = q.clone();
            thread::spawn(move || q.close())
        };
        closer.join().unwrap();
        let submitted = submitter.join().unwrap();
        let served = worker.join().unwrap();
        match submitted {
            Ok(mut t) => {
                assert_eq!(
                    t.try_take(),
                    Some(Ok(10)),
                    "admitted, so drained before `Closed`"
                );
                assert_eq!(served, 1);
            }
            Err(refused) => {
                assert_eq!(refused, (AdmissionError::Closed, 5));
                assert_eq!(served, 0);
            }
        }
        assert_eq!(q.in_flight(), 0);
    });
}

/// A ticket polled once with one waker, then waited on with another while the worker
/// completes it (the one-shot's waker replacement: `fetch_and(!RX_WAKER)`, rewrite, `fetch_or`):
/// the completion must wake the second waker or be seen by the poll; a completion that woke
/// only the first (noop) waker would leave the waiter parked (a loom deadlock).
#[test]
fn ticket_polled_with_a_waker_replaced_while_completing() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropNewest);
        let t = q.try_submit(3, P, W0).unwrap();
        let job = q.pop(0).unwrap().unwrap();
        let mut t = std::pin::pin!(t);
        assert!(t
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending());
        let completer = thread::spawn(move || job.complete(33));
        assert_eq!(block_on_pinned(t), Ok(33));
        completer.join().unwrap();
    });
}

/// A ticket polled (its waker stored) and then dropped while the worker completes it: the drop
/// takes the waker back unless the completion's RMW came first, and a completion after the drop
/// never reads it (loom's cell check fails a read racing the drop's take; its `Arc` check
/// fails a one-shot block left behind).
#[test]
fn ticket_dropped_after_a_poll_races_completion() {
    struct Nobody;
    impl Wake for Nobody {
        fn wake(self: std::sync::Arc<Self>) {}
    }
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropNewest);
        let mut t = Box::pin(q.try_submit(1, P, W0).unwrap());
        let job = q.pop(0).unwrap().unwrap();
        let waker = Waker::from(std::sync::Arc::new(Nobody));
        assert!(t
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        let completer = thread::spawn(move || job.complete(5));
        drop(t);
        completer.join().unwrap();
        assert_eq!(q.in_flight(), 0);
    });
}

/// A blocking submit polled once with one waker, then again with another, while the pop that
/// makes room runs: the second poll gives up the first registration and must be woken through
/// the new waker (else a loom deadlock), and its request lands behind the popped one.
#[test]
fn blocking_submit_repolled_with_a_new_waker() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let t1 = q.try_submit(1, P, W0).unwrap();
        let sub = {
            let q = q.clone();
            thread::spawn(move || {
                let mut fut = std::pin::pin!(q.submit(2, P, W0));
                let first = fut.as_mut().poll(&mut Context::from_waker(Waker::noop()));
                match first {
                    Poll::Ready(r) => r,
                    Poll::Pending => block_on_pinned(fut),
                }
                .map_err(|r| r.error)
            })
        };
        let job = q.pop(0).unwrap().expect("1 queued");
        job.complete(10);
        let _t2 = sub.join().unwrap().expect("admitted");
        assert_eq!(*q.pop(0).unwrap().unwrap().payload(), 2);
        drop(t1);
    });
}

/// `close` racing a submit blocked on a full queue and the worker's drain loop
/// (`while let Ok(job) = pop_wait`): the submit is refused `Closed`, or admitted and drained
/// before the worker sees `Closed`; nobody parks forever and nothing stays in flight.
#[test]
fn close_racing_a_blocked_submit_and_the_drain() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let _t1 = q.try_submit(1, P, W0).unwrap();
        let sub = {
            let q = q.clone();
            thread::spawn(move || block_on(q.submit(2, P, W0)).map_err(|r| r.error))
        };
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                while let Ok(job) = block_on(q.pop_wait(0)) {
                    got.push(*job.payload());
                    job.complete(0);
                }
                got
            })
        };
        q.close();
        let r2 = sub.join().unwrap();
        let got = worker.join().unwrap();
        match r2 {
            Ok(mut t) => {
                assert_eq!(got, vec![1, 2]);
                assert_eq!(t.try_take(), Some(Ok(0)));
            }
            Err(e) => {
                assert_eq!(e, AdmissionError::Closed);
                assert_eq!(got, vec![1]);
            }
        }
        assert_eq!(q.in_flight(), 0);
    });
}

/// The drop-oldest `submit` future (its poll path: a slot held by a thread mid-way makes it
/// wake its own task and return `Pending` instead of waiting for that thread) racing a pop on a
/// full one-slot queue: request 1 is popped xor evicted, request 2 is admitted and popped
/// exactly once, and the counters agree.
#[test]
fn drop_oldest_submit_future_racing_pop() {
    crate::model(|| {
        let q = one_slot(OverflowPolicy::DropOldest);
        let mut ta = q.try_submit(1, P, W0).unwrap();
        let submitter = {
            let q = q.clone();
            thread::spawn(move || {
                block_on_yielding(q.submit(2, P, W0))
                    .map_err(|r| r.error)
                    .unwrap()
            })
        };
        let popper = {
            let q = q.clone();
            thread::spawn(move || {
                q.pop(0).unwrap().map(|job| {
                    let id = *job.payload();
                    job.complete(id * 10);
                    id
                })
            })
        };
        let mut tb = submitter.join().unwrap();
        let mut popped: Vec<u32> = popper.join().unwrap().into_iter().collect();
        while let Some(job) = q.pop(0).unwrap() {
            let id = *job.payload();
            job.complete(id * 10);
            popped.push(id);
        }
        let a = ta.try_take().expect("request 1 has an outcome");
        let b = tb.try_take().expect("request 2 has an outcome");
        let evicted = Err(AdmissionError::Overloaded {
            reason: OverloadReason::EvictedOldest,
            worker: 0,
        });
        match popped.iter().filter(|&&id| id == 1).count() {
            1 => assert_eq!(a, Ok(10)),
            0 => assert_eq!(a, evicted),
            n => panic!("request 1 popped {n} times"),
        }
        assert_eq!(popped.iter().filter(|&&id| id == 2).count(), 1);
        assert_eq!(b, Ok(20));
        assert_eq!(q.in_flight(), 0);
        assert_eq!(q.metrics().evicted_oldest, u64::from(a == evicted));
    });
}

/// [`block_on`] for a future that may wake its own task (a drop-oldest `submit` whose slot a
/// thread holds mid-way): woken during its poll, it yields to the other threads before polling
/// again, as an executor runs other tasks first (loom has no fair scheduler: an immediate
/// re-poll would spin).
fn block_on_yielding<F: Future>(f: F) -> F::Output {
    use std::sync::atomic::{AtomicBool, Ordering};
    struct Unpark {
        thread: thread::Thread,
        /// Bookkeeping of this executor, not part of the model: a plain std atomic.
        woken: AtomicBool,
    }
    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.woken.store(true, Ordering::Relaxed);
            self.thread.unpark();
        }
    }
    let unpark = std::sync::Arc::new(Unpark {
        thread: thread::current(),
        woken: AtomicBool::new(false),
    });
    let waker = Waker::from(unpark.clone());
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut Context::from_waker(&waker)) {
            return v;
        }
        if unpark.woken.swap(false, Ordering::Relaxed) {
            thread::yield_now();
        } else {
            thread::park();
            unpark.woken.store(false, Ordering::Relaxed);
        }
    }
}

/// Two drop-oldest `try_submit`s on a full one-slot queue (positions step a whole lap, 2, per
/// value) while a worker pops once. See [`two_drop_oldest_submitters_and_a_worker`].
#[test]
fn two_drop_oldest_submitters_one_slot() {
    two_drop_oldest_submitters_and_a_worker(1);
}

/// As above on a full two-slot queue, where an eviction can also meet a queue that is not full
/// (the worker's pop made room). That it evicts nothing then is checked by
/// `drop_oldest_evicts_only_a_full_queue`: here the outcomes cannot show it (an eviction from a
/// non-full queue takes the request the other submitter's eviction would have taken).
#[test]
fn two_drop_oldest_submitters_two_slots() {
    two_drop_oldest_submitters_and_a_worker(2);
}

/// A queue of `cap` slots, full (requests `1..=cap`); two threads `try_submit` one request
/// each under drop-oldest while a worker pops once (or finds nothing to take without waiting);
/// then the queue is drained. Every request is completed xor answered `EvictedOldest` (none
/// lost, none both), not every request is evicted (the one admitted last cannot be: evictions
/// only come before a submitter's own push), and the counters agree with the tickets.
///
/// With two evicting submitters, each can take the slot the other's eviction freed (the other
/// then evicts again), and each can find the slot it needs held mid-way by the other or by the
/// worker, which makes it wait: the model needs `Backoff`'s loom bound on such waits to finish
/// (src/sync.rs).
fn two_drop_oldest_submitters_and_a_worker(cap: usize) {
    crate::model(move || {
        let q = Arc::new(
            Admission::<u32, u32>::new(AdmissionConfig::new(1, cap, OverflowPolicy::DropOldest))
                .unwrap(),
        );
        let mut tickets: Vec<_> = (1..=cap as u32)
            .map(|id| q.try_submit(id, P, W0).unwrap())
            .collect();
        let submitter = |id: u32| {
            let q = q.clone();
            thread::spawn(move || q.try_submit(id, P, W0).unwrap())
        };
        let (a, b) = (cap as u32 + 1, cap as u32 + 2);
        let (sa, sb) = (submitter(a), submitter(b));
        let worker = {
            let q = q.clone();
            thread::spawn(move || {
                q.pop(0).unwrap().map(|job| {
                    let id = *job.payload();
                    job.complete(id * 10);
                    id
                })
            })
        };
        tickets.push(sa.join().unwrap());
        tickets.push(sb.join().unwrap());
        let mut popped: Vec<u32> = worker.join().unwrap().into_iter().collect();
        while let Some(job) = q.pop(0).unwrap() {
            let id = *job.payload();
            job.complete(id * 10);
            popped.push(id);
        }
        let evicted = Err(AdmissionError::Overloaded {
            reason: OverloadReason::EvictedOldest,
            worker: 0,
        });
        let mut n_evicted = 0;
        for (id, ticket) in (1u32..).zip(&mut tickets) {
            let outcome = ticket
                .try_take()
                .unwrap_or_else(|| panic!("request {id} lost (no outcome); popped {popped:?}"));
            match popped.iter().filter(|&&p| p == id).count() {
                1 => assert_eq!(outcome, Ok(id * 10), "request {id}; popped {popped:?}"),
                0 => {
                    assert_eq!(outcome, evicted, "request {id}; popped {popped:?}");
                    n_evicted += 1;
                }
                n => panic!("request {id} popped {n} times: {popped:?}"),
            }
        }
        assert!(!popped.is_empty(), "every request evicted");
        assert_eq!(q.in_flight(), 0, "popped {popped:?}");
        assert_eq!(q.metrics().evicted_oldest, n_evicted, "popped {popped:?}");
    });
}
