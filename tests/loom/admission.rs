//! loom models: admission (see tests/loom.rs).
//!
//! - drop-oldest racing a pop: every request is popped exactly once or reported evicted
//!   exactly once, never both, never neither;
//! - a blocking submit on a full queue is woken by the pop that makes room (a lost wake-up
//!   would leave `block_on` parked forever, which loom reports as a deadlock);
//! - `close` wakes a blocked submitter, which then gets `Closed`;
//! - an idle `pop_wait` is woken by the submit that brings work;
//! - the ticket one-shot: completion racing the ticket's poll, and the ticket's drop (loom's
//!   `Arc` checks that nothing leaks).

use std::future::Future;
use std::task::{Context, Poll, Wake, Waker};

use loom::sync::Arc;
use loom::thread;

use pagedkv::sched::admission::{
    Admission, AdmissionConfig, AdmissionError, OverflowPolicy, OverloadReason, Priority, Route,
};

/// Drives `f` on this loom thread, parking it (loom's `park`) while pending. A wake-up that
/// never comes leaves every thread parked, which loom reports as a deadlock.
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(thread::Thread);
    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(std::sync::Arc::new(Unpark(thread::current())));
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut Context::from_waker(&waker)) {
            return v;
        }
        thread::park();
    }
}

const P: Priority = Priority::Throughput;
const W0: Route = Route::Worker(0);

fn one_slot(policy: OverflowPolicy) -> Arc<Admission<u32, u32>> {
    Arc::new(Admission::new(AdmissionConfig::new(1, 1, policy)).unwrap())
}

#[test]
fn drop_oldest_racing_pop() {
    loom::model(|| {
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
    loom::model(|| {
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
    loom::model(|| {
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
    loom::model(|| {
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
    loom::model(|| {
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
    loom::model(|| {
        let q = one_slot(OverflowPolicy::Block);
        let t = q.try_submit(1, P, W0).unwrap();
        let job = q.pop(0).unwrap().unwrap();
        let worker = thread::spawn(move || drop(job));
        assert_eq!(block_on(t), Err(AdmissionError::Abandoned));
        worker.join().unwrap();
    });
}
