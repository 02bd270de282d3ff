//! A sequential model of `sched::admission`, checked operation by operation against the real
//! queue set. Shared by tests/admission_model.rs (proptest) and the `admission_ops` fuzz target
//! (included there by path), so both drive exactly the same oracle.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use pagedkv::sched::admission::{
    session_worker, Admission, AdmissionConfig, AdmissionError, Job, OverflowPolicy,
    OverloadReason, Route, Ticket,
};
use pagedkv::sched::Priority;

/// The result a worker answers request `id` with.
fn answer(id: u32) -> u32 {
    id ^ 0x5a5a
}

/// The queue-set shape of one run.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// 1..=4 workers.
    pub workers: u8,
    /// 1..=5.
    pub high_capacity: u8,
    /// 1..=5.
    pub low_capacity: u8,
    /// 0 block, 1 drop-newest, 2 drop-oldest.
    pub policy: u8,
}

/// One operation. Indices are reduced modulo what exists at that moment.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// Submit: `route % 4`: 0 to worker `route / 4 % (workers + 1)` (one past the end is an
    /// unknown worker), 1 session `route`, 2 and 3 least-loaded. `wait`: poll
    /// `submit(...)` once with a no-op waker (and withdraw it if pending) instead of `try_submit`.
    Submit { route: u16, high: bool, wait: bool },
    /// `pop(worker % (workers + 1))`.
    Pop { worker: u8 },
    /// Poll `pop_wait(worker % workers)` once.
    PopWait { worker: u8 },
    /// Complete the `idx`-th running job.
    Complete { idx: u8 },
    /// Drop the `idx`-th running job unanswered.
    Abandon { idx: u8 },
    /// Drop the `idx`-th open ticket.
    DropTicket { idx: u8 },
    /// Close the queue set.
    Close,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    Pending,
    Done(Result<u32, AdmissionError>),
}

struct Model {
    q: Admission<u32, u32>,
    workers: usize,
    caps: [usize; 2],
    policy: OverflowPolicy,
    /// `queues[w][class]`: ids in FIFO order; class 0 latency-critical, 1 throughput.
    queues: Vec<[VecDeque<u32>; 2]>,
    /// Popped, unanswered jobs (the real ones) with their worker.
    running: Vec<(u32, Job<u32, u32>)>,
    /// Open tickets and what each must say.
    tickets: BTreeMap<u32, (Ticket<u32>, Expect)>,
    next_id: u32,
    rejected_full: u64,
    evicted: u64,
    rejected_closed: u64,
    abandoned: u64,
    closed: bool,
}

fn class(p: Priority) -> usize {
    match p {
        Priority::LatencyCritical => 0,
        Priority::Throughput => 1,
    }
}

fn poll_once<F: Future>(f: F) -> Poll<F::Output> {
    let mut f = pin!(f);
    f.as_mut().poll(&mut Context::from_waker(Waker::noop()))
}

impl Model {
    fn expect(&mut self, id: u32, outcome: Result<u32, AdmissionError>) {
        if let Some((_, e)) = self.tickets.get_mut(&id) {
            assert_eq!(*e, Expect::Pending, "request {id} resolved twice");
            *e = Expect::Done(outcome);
        }
    }

    fn submit(&mut self, route: u16, high: bool, wait: bool) {
        let id = self.next_id;
        self.next_id += 1;
        let p = if high {
            Priority::LatencyCritical
        } else {
            Priority::Throughput
        };
        let c = class(p);
        let r = match route % 4 {
            0 => Route::Worker(usize::from(route / 4) % (self.workers + 1)),
            1 => Route::Session(u64::from(route)),
            _ => Route::LeastLoaded,
        };
        // Where the model says it may go.
        let candidates: Vec<usize> = match r {
            Route::Worker(w) => vec![w],
            Route::Session(k) => vec![session_worker(k, self.workers)],
            Route::LeastLoaded => {
                let loads: Vec<usize> = (0..self.workers).map(|w| self.load(w)).collect();
                let min = *loads.iter().min().unwrap();
                (0..self.workers).filter(|&w| loads[w] == min).collect()
            }
        };
        let before = self.q.metrics();
        let got = if wait {
            match poll_once(self.q.submit(id, p, r)) {
                Poll::Ready(res) => Some(res),
                Poll::Pending => None,
            }
        } else {
            Some(self.q.try_submit(id, p, r))
        };
        if self.closed {
            let refused = got.expect("closed: refused at once").unwrap_err();
            assert_eq!(
                (refused.error, refused.payload),
                (AdmissionError::Closed, id)
            );
            self.rejected_closed += 1;
            return;
        }
        if candidates[0] >= self.workers {
            let refused = got.expect("unknown worker: refused at once").unwrap_err();
            assert!(matches!(
                refused.error,
                AdmissionError::UnknownWorker { .. }
            ));
            return;
        }
        // Identify the worker it went to among the candidates.
        let refused_at = match &got {
            Some(Err(r)) => match r.error {
                AdmissionError::Overloaded { worker, .. } => Some(worker as usize),
                e => panic!("unexpected refusal {e}"),
            },
            _ => None,
        };
        let w = if candidates.len() == 1 {
            candidates[0]
        } else if let Some(w) = refused_at {
            w
        } else {
            let grew: Vec<usize> = candidates
                .iter()
                .copied()
                .filter(|&w| self.q.worker_load(w).unwrap() > before.workers[w].load)
                .collect();
            let after = self.q.metrics();
            match grew[..] {
                [w] => w,
                [] => {
                    // No load grew: evicted-and-replaced (drop-oldest: that worker's eviction
                    // count grew), or pending (then any full candidate stands).
                    let evicted: Vec<usize> = candidates
                        .iter()
                        .copied()
                        .filter(|&w| {
                            after.workers[w].evicted_oldest > before.workers[w].evicted_oldest
                        })
                        .collect();
                    let full: Vec<usize> = candidates
                        .iter()
                        .copied()
                        .filter(|&w| self.queues[w][c].len() == self.caps[c])
                        .collect();
                    match (&evicted[..], &full[..]) {
                        ([w], _) => *w,
                        ([], [w, ..]) => *w,
                        _ => {
                            panic!("cannot place request {id}: full {full:?}, evicted {evicted:?}")
                        }
                    }
                }
                _ => panic!("one submit raised several loads: {grew:?}"),
            }
        };
        assert!(
            candidates.contains(&w),
            "routed to {w}, model allows {candidates:?}"
        );
        let queue_full = self.queues[w][c].len() == self.caps[c];
        if !queue_full {
            let ticket = got
                .expect("room: admitted at once")
                .expect("room: admitted");
            self.queues[w][c].push_back(id);
            self.tickets.insert(id, (ticket, Expect::Pending));
            return;
        }
        match self.policy {
            OverflowPolicy::DropOldest => {
                let ticket = got.expect("drop-oldest never waits").expect("admitted");
                let old = self.queues[w][c].pop_front().unwrap();
                self.expect(
                    old,
                    Err(AdmissionError::Overloaded {
                        reason: OverloadReason::EvictedOldest,
                        worker: w as u32,
                    }),
                );
                self.evicted += 1;
                self.queues[w][c].push_back(id);
                self.tickets.insert(id, (ticket, Expect::Pending));
            }
            OverflowPolicy::Block if wait => {
                assert!(got.is_none(), "blocking submit on a full queue must pend");
            }
            OverflowPolicy::Block | OverflowPolicy::DropNewest => {
                let refused = got.expect("refused at once").unwrap_err();
                assert_eq!(refused.payload, id);
                assert_eq!(
                    refused.error,
                    AdmissionError::Overloaded {
                        reason: OverloadReason::QueueFull,
                        worker: w as u32
                    }
                );
                self.rejected_full += 1;
            }
        }
    }

    fn load(&self, w: usize) -> usize {
        self.queues[w][0].len()
            + self.queues[w][1].len()
            + self.running.iter().filter(|(_, j)| j.worker() == w).count()
    }

    fn took(&mut self, w: usize, job: Option<Job<u32, u32>>) {
        let want = self.queues[w][0]
            .pop_front()
            .map(|id| (id, Priority::LatencyCritical))
            .or_else(|| {
                self.queues[w][1]
                    .pop_front()
                    .map(|id| (id, Priority::Throughput))
            });
        match (want, job) {
            (None, None) => {}
            (Some((id, p)), Some(job)) => {
                assert_eq!((*job.payload(), job.priority(), job.worker()), (id, p, w));
                assert_eq!(job.is_cancelled(), !self.tickets.contains_key(&id));
                self.running.push((id, job));
            }
            (want, job) => panic!("model pops {want:?}, queue set popped {job:?}"),
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Submit { route, high, wait } => self.submit(route, high, wait),
            Op::Pop { worker } => {
                let w = usize::from(worker) % (self.workers + 1);
                match self.q.pop(w) {
                    Err(AdmissionError::UnknownWorker { .. }) => assert_eq!(w, self.workers),
                    Err(e) => panic!("pop: {e}"),
                    Ok(job) => self.took(w, job),
                }
            }
            Op::PopWait { worker } => {
                let w = usize::from(worker) % self.workers;
                let empty = self.queues[w].iter().all(VecDeque::is_empty);
                match poll_once(self.q.pop_wait(w)) {
                    Poll::Ready(Ok(job)) => self.took(w, Some(job)),
                    Poll::Ready(Err(e)) => {
                        assert_eq!(e, AdmissionError::Closed);
                        assert!(self.closed && empty);
                    }
                    Poll::Pending => assert!(!self.closed && empty),
                }
            }
            Op::Complete { idx } => {
                if !self.running.is_empty() {
                    let (id, job) = self.running.remove(usize::from(idx) % self.running.len());
                    job.complete(answer(id));
                    self.expect(id, Ok(answer(id)));
                }
            }
            Op::Abandon { idx } => {
                if !self.running.is_empty() {
                    let (id, job) = self.running.remove(usize::from(idx) % self.running.len());
                    drop(job);
                    self.abandoned += 1;
                    self.expect(id, Err(AdmissionError::Abandoned));
                }
            }
            Op::DropTicket { idx } => {
                if !self.tickets.is_empty() {
                    let id = *self
                        .tickets
                        .keys()
                        .nth(usize::from(idx) % self.tickets.len())
                        .unwrap();
                    self.tickets.remove(&id);
                }
            }
            Op::Close => {
                self.q.close();
                self.closed = true;
            }
        }
        self.check();
    }

    fn check(&mut self) {
        let mut unhealthy = self.closed;
        for w in 0..self.workers {
            for (c, p) in [Priority::LatencyCritical, Priority::Throughput]
                .into_iter()
                .enumerate()
            {
                let depth = self.queues[w][c].len();
                assert_eq!(
                    self.q.depth(w, p),
                    Ok(depth),
                    "depth of worker {w} class {c}"
                );
                unhealthy |= depth * 5 >= self.caps[c] * 4;
            }
            assert_eq!(
                self.q.worker_load(w),
                Ok(self.load(w)),
                "load of worker {w}"
            );
        }
        let in_flight: usize = (0..self.workers).map(|w| self.load(w)).sum();
        assert_eq!(self.q.in_flight(), in_flight);
        assert_eq!(self.q.is_healthy(), !unhealthy);
        let m = self.q.metrics();
        assert_eq!(
            (
                m.rejected_full,
                m.evicted_oldest,
                m.rejected_closed,
                m.abandoned,
                m.in_flight,
                m.healthy,
                m.closed
            ),
            (
                self.rejected_full,
                self.evicted,
                self.rejected_closed,
                self.abandoned,
                in_flight,
                !unhealthy,
                self.closed
            )
        );
        // Every ticket says exactly what the model says; resolved ones are consumed.
        let mut done = Vec::new();
        for (&id, (ticket, expect)) in self.tickets.iter_mut() {
            match *expect {
                Expect::Pending => assert!(!ticket.is_ready(), "request {id} resolved early"),
                Expect::Done(outcome) => {
                    assert_eq!(ticket.try_take(), Some(outcome), "request {id}");
                    done.push(id);
                }
            }
        }
        for id in done {
            self.tickets.remove(&id);
        }
    }
}

/// Runs `ops` against a fresh queue set shaped by `params`, checking after every operation,
/// then tears it down and checks that every remaining ticket resolves.
pub fn run(params: Params, ops: &[Op]) {
    let workers = usize::from(params.workers % 4) + 1;
    let caps = [
        usize::from(params.high_capacity % 5) + 1,
        usize::from(params.low_capacity % 5) + 1,
    ];
    let policy = match params.policy % 3 {
        0 => OverflowPolicy::Block,
        1 => OverflowPolicy::DropNewest,
        _ => OverflowPolicy::DropOldest,
    };
    let q = Admission::new(AdmissionConfig {
        workers,
        high_capacity: caps[0],
        low_capacity: caps[1],
        policy,
    })
    .unwrap();
    let mut m = Model {
        q,
        workers,
        caps,
        policy,
        queues: (0..workers).map(|_| Default::default()).collect(),
        running: Vec::new(),
        tickets: BTreeMap::new(),
        next_id: 0,
        rejected_full: 0,
        evicted: 0,
        rejected_closed: 0,
        abandoned: 0,
        closed: false,
    };
    m.check();
    for &op in ops {
        m.apply(op);
    }
    // Teardown: running jobs abandoned, queued ones closed by the queue set's drop.
    for (id, job) in std::mem::take(&mut m.running) {
        drop(job);
        m.expect(id, Err(AdmissionError::Abandoned));
    }
    let queued: Vec<u32> = m
        .queues
        .iter()
        .flat_map(|qs| qs.iter().flatten().copied())
        .collect();
    let Model { q, tickets, .. } = m;
    drop(q);
    for (id, (mut ticket, expect)) in tickets {
        let want = match expect {
            Expect::Done(o) => o,
            Expect::Pending => {
                assert!(queued.contains(&id), "request {id} pending but not queued");
                Err(AdmissionError::Closed)
            }
        };
        assert_eq!(ticket.try_take(), Some(want), "request {id} at teardown");
    }
}
