//! sched::admission: behaviour of each operation and policy, one at a time.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use pagedkv::sched::admission::{
    block_on, session_worker, Admission, AdmissionConfig, AdmissionError, OverflowPolicy,
    OverloadReason, Route,
};
use pagedkv::sched::Priority;

const HI: Priority = Priority::LatencyCritical;
const LO: Priority = Priority::Throughput;

fn queues(workers: usize, cap: usize, policy: OverflowPolicy) -> Admission<u32, u32> {
    Admission::new(AdmissionConfig::new(workers, cap, policy)).expect("valid config")
}

/// Joins `h`, failing with `what` if it has not finished within 10 s: a waiter that is never
/// woken fails the test with a message instead of hanging the test run.
fn join_within<R>(what: &str, h: thread::JoinHandle<R>) -> R {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !h.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not woken within 10 s"
        );
        thread::sleep(Duration::from_millis(5));
    }
    h.join().unwrap()
}

#[test]
fn config_is_validated() {
    let bad = [
        AdmissionConfig::new(0, 4, OverflowPolicy::Block),
        AdmissionConfig::new(1, 0, OverflowPolicy::Block),
        AdmissionConfig {
            workers: 1,
            high_capacity: 4,
            low_capacity: 0,
            policy: OverflowPolicy::Block,
        },
        AdmissionConfig::new(1, usize::MAX, OverflowPolicy::Block),
        AdmissionConfig::new(usize::MAX, 1, OverflowPolicy::Block),
    ];
    for cfg in bad {
        assert!(matches!(
            Admission::<u32, u32>::new(cfg),
            Err(AdmissionError::InvalidConfig(_))
        ));
    }
    let q = queues(3, 7, OverflowPolicy::DropOldest);
    assert_eq!(q.workers(), 3);
    assert_eq!(q.capacity(HI), 7);
    assert_eq!(q.policy(), OverflowPolicy::DropOldest);
}

#[test]
fn latency_critical_first_fifo_within_class() {
    let q = queues(1, 8, OverflowPolicy::DropNewest);
    let w = Route::Worker(0);
    let mut tickets = Vec::new();
    for (id, p) in [(1, LO), (2, HI), (3, LO), (4, HI), (5, LO)] {
        tickets.push((id, q.try_submit(id, p, w).unwrap()));
    }
    assert_eq!(q.depth(0, HI), Ok(2));
    assert_eq!(q.depth(0, LO), Ok(3));
    let mut order = Vec::new();
    while let Some(job) = q.pop(0).unwrap() {
        order.push((*job.payload(), job.priority()));
        let v = *job.payload();
        job.complete(v * 10);
    }
    assert_eq!(order, vec![(2, HI), (4, HI), (1, LO), (3, LO), (5, LO)]);
    for (id, mut t) in tickets {
        assert_eq!(t.try_take(), Some(Ok(id * 10)));
        assert_eq!(t.try_take(), None, "taken once");
    }
    assert_eq!(q.in_flight(), 0);
}

#[test]
fn drop_newest_refuses_with_payload_back() {
    let q = queues(1, 2, OverflowPolicy::DropNewest);
    let _a = q.try_submit(1, LO, Route::Worker(0)).unwrap();
    let _b = q.try_submit(2, LO, Route::Worker(0)).unwrap();
    let r = q.try_submit(3, LO, Route::Worker(0)).unwrap_err();
    assert_eq!(r.payload, 3);
    assert_eq!(
        r.error,
        AdmissionError::Overloaded {
            reason: OverloadReason::QueueFull,
            worker: 0
        }
    );
    // The async path refuses at once too.
    let r = block_on(q.submit(4, LO, Route::Worker(0))).unwrap_err();
    assert_eq!(r.into_payload(), 4);
    // The other class still has room.
    assert!(q.try_submit(5, HI, Route::Worker(0)).is_ok());
    let m = q.metrics();
    assert_eq!(m.rejected_full, 2);
    assert_eq!(m.in_flight, 3);
    assert_eq!(m.workers[0].low_depth, 2);
}

#[test]
fn drop_oldest_evicts_and_tells_the_evicted_waiter() {
    let q = queues(1, 3, OverflowPolicy::DropOldest);
    let mut tickets: Vec<_> = (0..5)
        .map(|i| q.try_submit(i, LO, Route::Worker(0)).unwrap())
        .collect();
    let evicted = AdmissionError::Overloaded {
        reason: OverloadReason::EvictedOldest,
        worker: 0,
    };
    assert_eq!(tickets[0].try_take(), Some(Err(evicted)));
    assert_eq!(tickets[1].try_take(), Some(Err(evicted)));
    assert!(tickets[2].try_take().is_none());
    // The async submit evicts as well.
    let mut t5 = block_on(q.submit(5, LO, Route::Worker(0))).unwrap();
    assert_eq!(tickets[2].try_take(), Some(Err(evicted)));
    let popped: Vec<u32> = std::iter::from_fn(|| q.pop(0).unwrap())
        .map(|j| {
            let v = *j.payload();
            j.complete(v);
            v
        })
        .collect();
    assert_eq!(popped, vec![3, 4, 5]);
    assert_eq!(tickets[3].try_take(), Some(Ok(3)));
    assert_eq!(t5.try_take(), Some(Ok(5)));
    let m = q.metrics();
    assert_eq!((m.evicted_oldest, m.rejected_full, m.in_flight), (3, 0, 0));
    // Evictions stay within the class: a full throughput queue never evicts latency-critical.
    let q = queues(1, 1, OverflowPolicy::DropOldest);
    let mut hi = q.try_submit(1, HI, Route::Worker(0)).unwrap();
    let _lo = q.try_submit(2, LO, Route::Worker(0)).unwrap();
    let _lo2 = q.try_submit(3, LO, Route::Worker(0)).unwrap();
    assert!(hi.try_take().is_none());
}

#[test]
fn block_policy_try_submit_refuses_and_submit_waits_for_room() {
    let q = Arc::new(queues(1, 2, OverflowPolicy::Block));
    let _a = q.try_submit(1, HI, Route::Worker(0)).unwrap();
    let _b = q.try_submit(2, HI, Route::Worker(0)).unwrap();
    let r = q.try_submit(3, HI, Route::Worker(0)).unwrap_err();
    assert!(matches!(r.error, AdmissionError::Overloaded { .. }));
    let q2 = q.clone();
    let submitter = thread::spawn(move || {
        let mut t = q2.submit_blocking(3, HI, Route::Worker(0)).unwrap();
        t.try_take()
    });
    thread::sleep(Duration::from_millis(50));
    assert!(
        !submitter.is_finished(),
        "must wait while the queue is full"
    );
    let job = q.pop(0).unwrap().unwrap();
    assert_eq!(*job.payload(), 1);
    assert_eq!(
        submitter.join().unwrap(),
        None,
        "admitted, not yet completed"
    );
    assert_eq!(q.depth(0, HI), Ok(2));
    drop(job);
}

#[test]
fn close_refuses_wakes_blocked_and_drains() {
    let q = Arc::new(queues(2, 1, OverflowPolicy::Block));
    let mut queued = q.try_submit(7, LO, Route::Worker(0)).unwrap();
    let q2 = q.clone();
    let blocked = thread::spawn(move || q2.submit_blocking(8, LO, Route::Worker(0)));
    let q3 = q.clone();
    let idle = thread::spawn(move || q3.pop_blocking(1).map(|j| *j.payload()));
    thread::sleep(Duration::from_millis(50));
    q.close();
    let r = join_within("the blocked submitter after close", blocked).unwrap_err();
    assert_eq!((r.error, r.payload), (AdmissionError::Closed, 8));
    assert_eq!(
        join_within("the idle pop_wait after close", idle),
        Err(AdmissionError::Closed)
    );
    assert_eq!(
        q.try_submit(9, HI, Route::LeastLoaded).unwrap_err().error,
        AdmissionError::Closed
    );
    assert!(!q.is_healthy());
    // Draining still works after close; then pop_wait reports Closed.
    let job = q.pop_blocking(0).unwrap();
    job.complete(70);
    assert_eq!(queued.try_take(), Some(Ok(70)));
    assert_eq!(q.pop_blocking(0).unwrap_err(), AdmissionError::Closed);
    assert_eq!(q.metrics().rejected_closed, 2);
}

#[test]
fn dropping_the_queue_set_resolves_queued_tickets_closed() {
    let q = queues(1, 4, OverflowPolicy::Block);
    let mut t = q.try_submit(1, LO, Route::Worker(0)).unwrap();
    let mut queued = q.try_submit(2, LO, Route::Worker(0)).unwrap();
    let popped = q.pop(0).unwrap().unwrap();
    drop(q);
    assert_eq!(queued.try_take(), Some(Err(AdmissionError::Closed)));
    // The popped job outlives the queue set and can still be completed.
    assert_eq!(*popped.payload(), 1);
    popped.complete(11);
    assert_eq!(t.try_take(), Some(Ok(11)));
}

#[test]
fn abandoned_and_cancelled() {
    let q = queues(1, 4, OverflowPolicy::DropNewest);
    let mut t = q.try_submit(1, LO, Route::Worker(0)).unwrap();
    let job = q.pop(0).unwrap().unwrap();
    assert!(!job.is_cancelled());
    drop(job);
    assert_eq!(t.try_take(), Some(Err(AdmissionError::Abandoned)));
    assert_eq!(q.metrics().abandoned, 1);
    assert_eq!(q.in_flight(), 0);

    let t = q.try_submit(2, LO, Route::Worker(0)).unwrap();
    drop(t);
    let job = q.pop(0).unwrap().unwrap();
    assert!(job.is_cancelled());
    let (payload, completion) = job.into_parts();
    assert_eq!(payload, 2);
    assert!(completion.is_cancelled());
    completion.complete(0); // nobody listens; must not fail
    assert_eq!(q.in_flight(), 0);
}

#[test]
fn unknown_worker() {
    let q = queues(2, 4, OverflowPolicy::DropNewest);
    let r = q.try_submit(1, LO, Route::Worker(2)).unwrap_err();
    assert_eq!(
        r.error,
        AdmissionError::UnknownWorker {
            worker: 2,
            workers: 2
        }
    );
    assert!(q.pop(5).is_err());
    assert!(q.depth(2, HI).is_err());
    assert!(q.worker_load(2).is_err());
    assert!(matches!(
        block_on(q.pop_wait(9)),
        Err(AdmissionError::UnknownWorker { .. })
    ));
}

#[test]
fn health_turns_at_eighty_percent() {
    let q = queues(2, 5, OverflowPolicy::DropNewest);
    for i in 0..3 {
        q.try_submit(i, LO, Route::Worker(1)).unwrap();
    }
    assert!(q.is_healthy(), "3/5 = 60%");
    q.try_submit(3, LO, Route::Worker(1)).unwrap();
    assert!(!q.is_healthy(), "4/5 = 80%");
    assert!(!q.metrics().healthy);
    q.pop(1).unwrap().unwrap().complete(0);
    assert!(q.is_healthy());
    assert!(q.metrics().healthy);
}

#[test]
fn in_flight_counts_queued_and_running() {
    let q = queues(2, 8, OverflowPolicy::DropNewest);
    let t: Vec<_> = (0..3)
        .map(|i| q.try_submit(i, HI, Route::Worker(0)).unwrap())
        .collect();
    let _t2 = q.try_submit(9, LO, Route::Worker(1)).unwrap();
    assert_eq!(q.in_flight(), 4);
    let job = q.pop(0).unwrap().unwrap();
    assert_eq!(q.in_flight(), 4, "running still counts");
    assert_eq!(q.worker_load(0), Ok(3));
    assert_eq!(q.depth(0, HI), Ok(2));
    job.complete(1);
    assert_eq!(q.in_flight(), 3);
    assert_eq!(q.worker_load(1), Ok(1));
    drop(t);
}

#[test]
fn sessions_stick_and_spread() {
    let q = queues(4, 1024, OverflowPolicy::DropNewest);
    let mut counts = [0usize; 4];
    for s in 0..400u64 {
        let want = session_worker(s, 4);
        counts[want] += 1;
        for _ in 0..2 {
            q.try_submit(s as u32, LO, Route::Session(s)).unwrap();
        }
        // Both landed on `want`: it is the only worker whose load grew by two.
        assert_eq!(
            q.worker_load(want).unwrap(),
            q.metrics().workers[want].low_depth
        );
    }
    for w in 0..4 {
        let d = q.depth(w, LO).unwrap();
        assert_eq!(d, 2 * counts[w]);
        assert!((60..=140).contains(&counts[w]), "uneven: {counts:?}");
        while let Some(job) = q.pop(w).unwrap() {
            assert_eq!(session_worker(u64::from(*job.payload()), 4), w);
        }
    }
    // String sessions hash stably (FNV-1a; a fixed vector guards against accidental changes).
    assert_eq!(Route::session_key(""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(Route::session_key("a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(Route::session("abc"), Route::session(String::from("abc")));
    // Consistent: growing 4 -> 5 workers moves only sessions that go to the new worker.
    let moved = (0..10_000u64)
        .filter(|&s| session_worker(s, 4) != session_worker(s, 5))
        .inspect(|&s| assert_eq!(session_worker(s, 5), 4))
        .count();
    assert!((1_500..=2_500).contains(&moved), "moved {moved}");
}

#[test]
fn least_loaded_prefers_idle_workers() {
    let q = queues(3, 16, OverflowPolicy::DropNewest);
    for i in 0..5 {
        q.try_submit(i, LO, Route::Worker(0)).unwrap();
        q.try_submit(i, LO, Route::Worker(2)).unwrap();
    }
    for i in 0..5 {
        q.try_submit(100 + i, HI, Route::LeastLoaded).unwrap();
    }
    assert_eq!(q.worker_load(1), Ok(5));
    // Now all equal (5 each): the next 3 spread one per worker.
    for i in 0..3 {
        q.try_submit(200 + i, HI, Route::LeastLoaded).unwrap();
    }
    for w in 0..3 {
        assert_eq!(q.worker_load(w), Ok(6), "worker {w}");
    }
}

#[test]
fn pop_wait_is_woken_by_submit_and_ticket_by_completion() {
    let q = Arc::new(queues(1, 4, OverflowPolicy::Block));
    let q2 = q.clone();
    let worker = thread::spawn(move || {
        let mut served = 0;
        while let Ok(job) = q2.pop_blocking(0) {
            let v = *job.payload();
            job.complete(v + 1);
            served += 1;
        }
        served
    });
    for i in 0..200 {
        thread::yield_now();
        let t = q.submit_blocking(i, LO, Route::Worker(0)).unwrap();
        assert_eq!(t.wait(), Ok(i + 1));
    }
    q.close();
    assert_eq!(join_within("the idle worker after close", worker), 200);
}

/// A queue shape whose slots cannot fit in memory is refused with a typed error (it aborted
/// the process on the allocation); the validation's limits alone allowed it.
#[test]
fn a_shape_whose_slots_cannot_fit_is_refused() {
    // Past isize::MAX bytes in all; 2 PiB in one ring (past any address space, so no
    // allocator can hand it out even where it overcommits).
    for (workers, cap) in [(65_536, 1 << 30), (1, 1 << 30)] {
        let r = Admission::<[u8; 1 << 20], u32>::new(AdmissionConfig::new(
            workers,
            cap,
            OverflowPolicy::DropNewest,
        ));
        assert!(
            matches!(r, Err(AdmissionError::InvalidConfig(_))),
            "{workers} x {cap}"
        );
    }
}

/// The documented limits are inclusive: `MAX_WORKERS` workers and `MAX_QUEUE_CAPACITY`-slot
/// queues are accepted, one more is refused (only the over-limit values were checked before).
#[test]
fn config_limits_are_inclusive() {
    use pagedkv::sched::admission::{MAX_QUEUE_CAPACITY, MAX_WORKERS};
    let check = |w, c| AdmissionConfig::new(w, c, OverflowPolicy::Block).validate();
    assert_eq!(check(MAX_WORKERS, 1), Ok(()));
    assert_eq!(check(1, MAX_QUEUE_CAPACITY), Ok(()));
    for (w, c) in [(MAX_WORKERS + 1, 1), (1, MAX_QUEUE_CAPACITY + 1)] {
        assert!(matches!(check(w, c), Err(AdmissionError::InvalidConfig(_))));
    }
    let q: Admission<u32, u32> = Admission::new(AdmissionConfig::new(
        MAX_WORKERS,
        1,
        OverflowPolicy::DropNewest,
    ))
    .unwrap();
    assert_eq!(q.workers(), MAX_WORKERS);
    let last = MAX_WORKERS - 1;
    let mut t = q.try_submit(7, LO, Route::Worker(last)).unwrap();
    q.pop(last)
        .unwrap()
        .expect("routed to the last worker")
        .complete(8);
    assert_eq!(t.try_take(), Some(Ok(8)));
}
