//! Admission queues without locks: where server threads hand requests to engine workers.
//! Most calls never wait for another thread, but the queues are not lock-free in the strict
//! sense (a stalled submitter holds up its queue, and drop-oldest can block): see "Progress".
//!
//! An [`Admission`] queue set has one pair of bounded queues per worker — latency-critical and
//! throughput ([`Priority`]) — and one [`OverflowPolicy`] for what happens when a queue is full.
//! [`Admission::try_submit`] / [`Admission::submit`] route a request ([`Route`]): a session id
//! always reaches the same worker ([`session_worker`], a jump consistent hash), anything else
//! goes to the least-loaded worker. Each admitted request yields a [`Ticket`] that resolves to
//! the worker's result, or to the error that ended the request. Workers take requests with
//! [`Admission::pop`] (latency-critical first) or wait for one with [`Admission::pop_wait`], and
//! answer through [`Job::complete`].
//!
//! # Algorithms
//!
//! - Queues: Dmitry Vyukov's bounded MPMC ring ([`ring`](self) module docs: stamps per slot,
//!   lapped positions; no reclamation, ABA excluded by monotonic positions).
//! - Tickets: a one-shot cell, one `AtomicUsize` of state bits arbitrating a value slot and a
//!   waker slot (`oneshot` module docs).
//! - Token streams ([`token_stream`], [`StreamRequest`]): a request's tokens while it runs, on a
//!   wait-free single-producer single-consumer ring with a register/wake cell for the reader's
//!   waker (`stream` module docs: lag policy, cancel on drop).
//! - Waiting (blocked submitters, idle workers): a Treiber stack of parked tasks whose only
//!   removal is take-all (`waitlist` module docs: ABA-free by construction, `Arc` reclamation),
//!   with the register / `fence(SeqCst)` / re-check handshake that excludes lost wake-ups.
//! - Accounting: one cache-padded load counter per worker (admitted, not yet completed), the
//!   basis of least-loaded routing and of [`Admission::in_flight`]; per-reason drop counters.
//!
//! # Progress
//!
//! No operation takes a lock, and what each call guarantees is this:
//!
//! - [`Admission::pop`], [`Admission::try_submit`] under `Block` and `DropNewest`, and every poll
//!   of [`PopWait`] and [`Submit`] never wait for another thread. They are lock-free except for
//!   the caveat of Vyukov's queue (`ring` module docs): a request whose submitter is descheduled
//!   between claiming its slot and publishing it holds up the requests behind it in that queue.
//!   `pop` then returns `None` for that class ("nothing to take without waiting"; it still takes
//!   from the other class), a `try_submit` that needs a slot whose consumer is descheduled
//!   mid-read is refused `QueueFull`, and the waiting forms return `Pending` and are woken by
//!   the thread that finishes the step.
//! - `submit(...).await` under [`OverflowPolicy::Block`] and `pop_wait` park the *task* (any
//!   executor, or the thread with [`block_on`]) and are woken by the pop / submit that makes
//!   room / work (register / `fence(SeqCst)` / re-check, so no wake-up is lost).
//! - Under [`OverflowPolicy::DropOldest`] a `try_submit` **can block**: if the slot it needs is
//!   held by a descheduled thread mid-way (a consumer reading it out, or the submitter of the
//!   oldest request still writing it, so there is nothing to evict), it waits with `Backoff`
//!   (spinning, then yielding its time slice) until that thread runs again. A poll of
//!   `submit(...)` does not wait there: it wakes its own task and returns `Pending`, and the
//!   executor polls it again (no wait list serves this case, so the task is re-polled while
//!   that thread stays descheduled).
//!
//! # Closing
//!
//! [`Admission::close`] refuses every later submit. A submit that races it is either refused
//! `Closed` or admitted and drained. Each worker has one word that counts the push attempts in
//! progress on its queues and carries a `CLOSED` bit: an attempt raises the count with an RMW
//! whose result says whether `close` (an RMW setting the bit) came first, and then refuses, so
//! the word's modification order decides every race. `pop_wait` reports `Closed` only when
//! it reads the bit with a zero count and then finds its queues empty; the attempt that lowers
//! the count to zero (after its push) wakes the waiting workers.
//!
//! # Overflow policies
//!
//! | policy                       | `try_submit` on a full queue | `submit(...).await` on a full queue       |
//! |------------------------------|------------------------------|-------------------------------------------|
//! | [`OverflowPolicy::Block`]      | refused, `QueueFull`         | waits for room                            |
//! | [`OverflowPolicy::DropNewest`] | refused, `QueueFull`         | refused, `QueueFull`                      |
//! | [`OverflowPolicy::DropOldest`] | admitted; the oldest request of that queue is evicted and its ticket gets `EvictedOldest` | same |
//!
//! Drop-oldest retries its push before each eviction and evicts only from a queue that is
//! full at the instant of the eviction (`Ring::evict_if_full`), so it never evicts while there
//! is room. The window that remains: a slot its eviction frees can be taken by a concurrent
//! submit first; the submit then evicts again (each eviction still from a full queue), so one
//! admission can evict more than one request while several submitters race on a full queue.
//!
//! A refused request comes back to the caller inside [`Refused`], payload included.
//!
//! # Example
//!
//! ```
//! use pagedkv::sched::admission::{Admission, AdmissionConfig, OverflowPolicy, Route};
//! use pagedkv::sched::Priority;
//!
//! let q: Admission<&str, usize> =
//!     Admission::new(AdmissionConfig::new(2, 64, OverflowPolicy::DropNewest)).unwrap();
//! let mut ticket = q
//!     .try_submit("hello", Priority::LatencyCritical, Route::session("user-42"))
//!     .unwrap();
//! let worker = pagedkv::sched::admission::session_worker(Route::session_key("user-42"), 2);
//! let job = q.pop(worker).unwrap().expect("routed to the session's worker");
//! let len = job.payload().len();
//! job.complete(len);
//! assert_eq!(ticket.try_take(), Some(Ok(5)));
//! ```

mod job;
mod oneshot;
mod ring;
mod stream;
mod wait;
mod waitlist;

pub use crate::error::{AdmissionError, OverloadReason};
use crate::sched::Priority;
pub use job::{Completion, Job};
pub use oneshot::Ticket;
pub use stream::{
    token_stream, Recv, SendError, StreamError, StreamEvent, StreamRequest, StreamRouter,
    StreamSender, TokenStream, DEFAULT_STREAM_CAPACITY, MAX_STREAM_CAPACITY,
};
#[cfg(not(loom))]
pub use wait::block_on;
pub use wait::{PopWait, Submit};

use crate::sync::{fence, Arc, AtomicBool, AtomicU64, AtomicUsize, Backoff, CachePadded, Ordering};
use oneshot::Completer;
use ring::{Pop, PushError, Ring};
use wait::SubmitStage;
use waitlist::WaitList;

/// What a submit does when its target queue is full. One policy per queue set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OverflowPolicy {
    /// `submit(...).await` waits until a pop makes room; `try_submit` is refused.
    Block,
    /// The new request is refused at once with [`OverloadReason::QueueFull`].
    DropNewest,
    /// The oldest queued request of the same worker and class is evicted (its ticket resolves
    /// to [`OverloadReason::EvictedOldest`]) and the new one admitted.
    DropOldest,
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// To the worker with the smallest load (queued plus running requests) at submit time.
    LeastLoaded,
    /// To the session's worker, `session_worker(key, workers)`: the same key always reaches the
    /// same worker of a queue set (and of any queue set with the same number of workers).
    Session(u64),
    /// To this worker.
    Worker(usize),
}

impl Route {
    /// The route of a session named by a string or bytes (see [`Route::session_key`]).
    pub fn session(id: impl AsRef<[u8]>) -> Self {
        Route::Session(Self::session_key(id))
    }

    /// A stable 64-bit key for a session id: FNV-1a over the bytes. Stable across processes,
    /// platforms and releases (unlike `std`'s `RandomState`), so every server replica routes a
    /// session alike.
    pub fn session_key(id: impl AsRef<[u8]>) -> u64 {
        const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        id.as_ref()
            .iter()
            .fold(OFFSET, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
    }
}

/// The worker a session key maps to among `workers` (`0` if `workers` is 0): Lamping and
/// Veach's jump consistent hash over a SplitMix64-mixed key. Deterministic, uniform, and
/// when the worker count grows from `n` to `n + 1` only `1 / (n + 1)` of the sessions move.
pub fn session_worker(key: u64, workers: usize) -> usize {
    if workers <= 1 {
        return 0;
    }
    // SplitMix64 finaliser: spreads sequential or low-entropy keys over all 64 bits.
    let mut k = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
    k = (k ^ (k >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    k = (k ^ (k >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    k ^= k >> 31;
    // Jump consistent hash (arXiv:1406.2294), with `workers` capped to what fits an i64.
    let n = workers.min(i64::MAX as usize) as i64;
    let (mut b, mut j) = (-1i64, 0i64);
    while j < n {
        b = j;
        k = k.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((k >> 33) + 1) as f64)) as i64;
    }
    b as usize
}

/// The shape of a queue set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Number of workers (engine threads), at least 1.
    pub workers: usize,
    /// Capacity of each worker's latency-critical queue, at least 1.
    pub high_capacity: usize,
    /// Capacity of each worker's throughput queue, at least 1.
    pub low_capacity: usize,
    /// What a submit does when its queue is full.
    pub policy: OverflowPolicy,
}

/// Largest accepted queue capacity (keeps the ring's lap arithmetic far from overflow).
pub const MAX_QUEUE_CAPACITY: usize = 1 << 30;
/// Largest accepted worker count (worker indices travel as `u32`).
pub const MAX_WORKERS: usize = 1 << 16;

impl AdmissionConfig {
    /// `workers` workers, both classes with room for `capacity` requests each.
    pub fn new(workers: usize, capacity: usize, policy: OverflowPolicy) -> Self {
        Self {
            workers,
            high_capacity: capacity,
            low_capacity: capacity,
            policy,
        }
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), AdmissionError> {
        if self.workers == 0 {
            return Err(AdmissionError::InvalidConfig("workers must be at least 1"));
        }
        if self.workers > MAX_WORKERS {
            return Err(AdmissionError::InvalidConfig(
                "workers must be at most 65536",
            ));
        }
        for cap in [self.high_capacity, self.low_capacity] {
            if cap == 0 {
                return Err(AdmissionError::InvalidConfig(
                    "queue capacities must be at least 1",
                ));
            }
            if cap > MAX_QUEUE_CAPACITY {
                return Err(AdmissionError::InvalidConfig(
                    "queue capacities must be at most 2^30",
                ));
            }
        }
        Ok(())
    }
}

/// A request the queue set did not admit, handed back with the reason.
#[derive(Debug)]
pub struct Refused<T> {
    /// Why it was refused: `Overloaded` (`QueueFull`), `Closed` or `UnknownWorker`.
    pub error: AdmissionError,
    /// The caller's request, untouched.
    pub payload: T,
}

impl<T> Refused<T> {
    /// The request, dropping the reason.
    pub fn into_payload(self) -> T {
        self.payload
    }
}

impl<T> std::fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request refused: {}", self.error)
    }
}

impl<T: std::fmt::Debug> std::error::Error for Refused<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// A queued request: the caller's payload and the sending end of its ticket.
struct Entry<T, R> {
    payload: T,
    tx: Completer<R>,
}

/// One worker's queues.
struct WorkerQueues<T, R> {
    /// Latency-critical requests.
    high: Ring<Entry<T, R>>,
    /// Throughput requests.
    low: Ring<Entry<T, R>>,
    /// Submitters blocked on a full `high` (only under [`OverflowPolicy::Block`]).
    high_room: WaitList,
    /// Submitters blocked on a full `low` (only under [`OverflowPolicy::Block`]).
    low_room: WaitList,
    /// Idle `pop_wait` callers of this worker.
    work: WaitList,
}

impl<T, R> WorkerQueues<T, R> {
    fn ring(&self, p: Priority) -> &Ring<Entry<T, R>> {
        match p {
            Priority::LatencyCritical => &self.high,
            Priority::Throughput => &self.low,
        }
    }

    fn room(&self, p: Priority) -> &WaitList {
        match p {
            Priority::LatencyCritical => &self.high_room,
            Priority::Throughput => &self.low_room,
        }
    }
}

/// One worker's counters, on one cache line: `load` is written by every submit to and every
/// completion of this worker; the drop counters only on its overflow paths.
struct WorkerCounters {
    /// Requests routed to this worker that are queued or popped and not yet completed (a
    /// submit adds 1 before its push and takes it back if refused; completion, abandonment and
    /// eviction take 1). Least-loaded routing reads it.
    load: AtomicUsize,
    /// `CLOSED_BIT | n`: the bit is set once by `close`; `n` counts the push attempts in
    /// progress on this worker's queues (raised by `Attempt::start`, lowered by its drop, after
    /// the push). A closed queue set is drained for this worker once this reads exactly
    /// `CLOSED_BIT` and the queues are then empty (see `Admission::enqueue`).
    submitting: AtomicUsize,
    /// Submits refused because this worker's queue was full.
    rejected_full: AtomicU64,
    /// Queued requests of this worker evicted by drop-oldest.
    evicted_oldest: AtomicU64,
    /// Popped requests dropped without completing.
    abandoned: AtomicU64,
}

/// Counters shared by the queue set and every outstanding [`Completion`] (which may outlive
/// the queue set, hence the `Arc`).
struct Counters {
    /// Indexed by worker.
    workers: Box<[CachePadded<WorkerCounters>]>,
    /// Submits refused because the queue set was closed.
    rejected_closed: CachePadded<AtomicU64>,
}

impl Counters {
    fn bump(c: &AtomicU64) {
        // Relaxed: statistics; readers want a recent value, not an ordering.
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn load(&self, worker: usize) -> &AtomicUsize {
        &self.workers[worker].load
    }

    fn release_load(&self, worker: usize) {
        // Relaxed: the count is advisory for routing; `in_flight` readers that need it after a
        // ticket resolved get it through the ticket's Release/Acquire (this decrement is
        // sequenced before the completer's send).
        self.workers[worker].load.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A queue set without locks (progress per call in the module docs): per-worker bounded
/// priority queues with routing and an overflow policy. `T` is the request payload, `R` the
/// worker's result type. Share it with `Arc`.
pub struct Admission<T, R> {
    workers: Box<[WorkerQueues<T, R>]>,
    counters: Arc<Counters>,
    policy: OverflowPolicy,
    /// Set once by [`Admission::close`] (with `CLOSED_BIT` in every worker's `submitting`
    /// word, which is what the handshakes read); read by `is_closed` and `admit`'s fast path.
    closed: AtomicBool,
}

/// Why `enqueue` gave an entry back.
enum Rejected<T, R> {
    /// The queue set is closed.
    Closed(Entry<T, R>),
    /// No usable slot now (`Block` and `DropNewest` only: drop-oldest evicts instead).
    Full(Entry<T, R>),
    /// Drop-oldest, for a poll (`in_poll`): the slot the push needs, or the oldest request to
    /// evict, is held by a thread mid-way. Only that thread's next step frees it, and no
    /// wait list is woken by it, so the poll retries at its next one.
    Busy(Entry<T, R>),
}

/// The closed flag in `WorkerCounters::submitting`; the bits below count attempts (at most one
/// per thread, so they never reach it).
const CLOSED_BIT: usize = 1 << (usize::BITS - 1);

/// One push attempt in progress on a worker (see `Admission::enqueue`). Dropping it, on every
/// path including a panic from a waker, withdraws the announcement, gives back an unused load
/// count, and wakes the worker's idle `pop_wait`s when they may be waiting for this attempt.
struct Attempt<'a, T, R> {
    adm: &'a Admission<T, R>,
    worker: usize,
    /// `close` came first (the announcing RMW saw `CLOSED_BIT`): the attempt must not push.
    closed: bool,
    /// The worker's load was raised for this attempt's entry.
    loaded: bool,
    /// The entry is in the queue.
    pushed: bool,
}

impl<'a, T, R> Attempt<'a, T, R> {
    fn start(adm: &'a Admission<T, R>, worker: usize) -> Self {
        // Relaxed: the RMW's place in the word's modification order, relative to `close`'s
        // `fetch_or`, is all the closing handshake needs from it (`Admission::enqueue`); the
        // data it publishes goes out with the Release lowering in `drop`.
        let prev = adm.counters.workers[worker]
            .submitting
            .fetch_add(1, Ordering::Relaxed);
        Self {
            adm,
            worker,
            closed: prev & CLOSED_BIT != 0,
            loaded: false,
            pushed: false,
        }
    }

    fn count_load(&mut self) {
        // Counted before the push so that a pop and completion racing right behind it can
        // never take the count below zero. Relaxed: see `Counters::release_load`.
        self.adm
            .counters
            .load(self.worker)
            .fetch_add(1, Ordering::Relaxed);
        self.loaded = true;
    }
}

impl<T, R> Drop for Attempt<'_, T, R> {
    fn drop(&mut self) {
        let adm = self.adm;
        if self.loaded && !self.pushed {
            adm.counters.release_load(self.worker);
        }
        // Release: a closing worker's Acquire load (`closed_and_quiet`) that reads this
        // lowering, or any later RMW of the word (all of them are RMWs: a release sequence),
        // synchronises with it, so our push (before it) is visible to the worker's take.
        let prev = adm.counters.workers[self.worker]
            .submitting
            .fetch_sub(1, Ordering::Release);
        // SeqCst fence: the waker half of the wait-list handshake (waitlist module docs),
        // pairing with the fence after registration in `PopWait::poll`: either we see the idle
        // worker's registration, or its re-check sees our push and our lowered count.
        fence(Ordering::SeqCst);
        let wq = &adm.workers[self.worker];
        // Wake idle workers if there is new work, or if the queue set is closed: a worker may
        // then be waiting for this attempt to end (it read `CLOSED_BIT` with our count in the
        // word, so the bit precedes our lowering and `prev` has it). Otherwise a failed attempt
        // wakes nobody.
        if wq.work.has_waiters() && (self.pushed || prev & CLOSED_BIT != 0) {
            match wq.work.wake_all_catching() {
                Some(p) if !std::thread::panicking() => std::panic::resume_unwind(p),
                // Already unwinding: a second panic would abort; every waiter was woken.
                _ => {}
            }
        }
    }
}

/// A request taken from its queue whose job does not exist yet (`Admission::take`, while
/// wakers run): dropping it does what dropping the job would, for the load counters.
struct Taken<'a> {
    counters: &'a Counters,
    worker: usize,
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        self.counters.release_load(self.worker);
        Counters::bump(&self.counters.workers[self.worker].abandoned);
    }
}

/// The outcome of one admission attempt.
enum Admit<T, R> {
    Admitted(Ticket<R>),
    Refused(Refused<T>),
    /// The queue was full under [`OverflowPolicy::Block`]; the caller may wait. Or, for a
    /// poll under [`OverflowPolicy::DropOldest`], a thread mid-way held the slot it needed
    /// (`Rejected::Busy`); the caller retries at its next poll.
    Full {
        entry: Entry<T, R>,
        ticket: Ticket<R>,
        worker: usize,
    },
}

impl<T, R> Admission<T, R> {
    /// A queue set of the given shape.
    pub fn new(config: AdmissionConfig) -> Result<Self, AdmissionError> {
        config.validate()?;
        // Every slot is allocated here: a shape whose slots cannot fit is refused (the
        // allocator's refusal, not an abort). A shape that fits but exceeds the machine's
        // memory is the operator's to size.
        let no_room = AdmissionError::InvalidConfig("the queues' slots do not fit in memory");
        let slot_bytes = Ring::<Entry<T, R>>::SLOT_BYTES;
        let slots = (config.high_capacity + config.low_capacity)
            .checked_mul(config.workers)
            .and_then(|n| n.checked_mul(slot_bytes))
            .filter(|&b| b <= isize::MAX as usize);
        if slots.is_none() {
            return Err(no_room);
        }
        let mut workers = Vec::new();
        workers
            .try_reserve_exact(config.workers)
            .map_err(|_| no_room)?;
        for _ in 0..config.workers {
            workers.push(WorkerQueues {
                high: Ring::try_new(config.high_capacity).ok_or(no_room)?,
                low: Ring::try_new(config.low_capacity).ok_or(no_room)?,
                high_room: WaitList::new(),
                low_room: WaitList::new(),
                work: WaitList::new(),
            });
        }
        let workers = workers.into_boxed_slice();
        let counters = Arc::new(Counters {
            workers: (0..config.workers)
                .map(|_| {
                    CachePadded::new(WorkerCounters {
                        load: AtomicUsize::new(0),
                        submitting: AtomicUsize::new(0),
                        rejected_full: AtomicU64::new(0),
                        evicted_oldest: AtomicU64::new(0),
                        abandoned: AtomicU64::new(0),
                    })
                })
                .collect(),
            rejected_closed: CachePadded::new(AtomicU64::new(0)),
        });
        Ok(Self {
            workers,
            counters,
            policy: config.policy,
            closed: AtomicBool::new(false),
        })
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// The overflow policy.
    pub fn policy(&self) -> OverflowPolicy {
        self.policy
    }

    /// Capacity of each worker's queue of class `priority`.
    pub fn capacity(&self, priority: Priority) -> usize {
        self.workers[0].ring(priority).capacity()
    }

    /// Admits `payload` without waiting for room. On a full queue: refused under `Block` and
    /// `DropNewest`, the oldest request evicted under `DropOldest`. Under `Block` and
    /// `DropNewest` it never waits for another thread; under `DropOldest` it can: when the
    /// slot it needs is held by a thread mid-way (a consumer reading it out, or the oldest
    /// request's submitter still writing it), it spins and yields until that thread runs on
    /// (module docs, "Progress").
    pub fn try_submit(
        &self,
        payload: T,
        priority: Priority,
        route: Route,
    ) -> Result<Ticket<R>, Refused<T>> {
        match self.admit(payload, priority, route, false) {
            Admit::Admitted(t) => Ok(t),
            Admit::Refused(r) => Err(r),
            // `admit` with `may_wait == false` never reports `Full`; refuse defensively.
            Admit::Full { entry, .. } => Err(Refused {
                error: AdmissionError::Closed,
                payload: entry.payload,
            }),
        }
    }

    /// Admits `payload`, waiting for room under [`OverflowPolicy::Block`] (`DropNewest` resolves
    /// at the first poll, like `try_submit`; so does `DropOldest`, unless the slot it needs is
    /// held by a thread mid-way: where `try_submit` then waits for that thread, the future
    /// wakes its own task and returns `Pending`, to retry at its next poll; an eviction it made
    /// before stays made). Runtime-agnostic: the returned future
    /// parks on the `Waker` it is polled with and is woken by the pop that frees room, or by
    /// [`Admission::close`] (then it resolves to `Closed`). Dropping it withdraws the request.
    pub fn submit(&self, payload: T, priority: Priority, route: Route) -> Submit<'_, T, R> {
        Submit {
            adm: self,
            stage: SubmitStage::Start {
                payload,
                priority,
                route,
            },
            reg: None,
        }
    }

    /// [`Admission::submit`], blocking the calling thread (parks it) instead of a task. Under
    /// `DropNewest` and `DropOldest` it is [`try_submit`](Self::try_submit).
    #[cfg(not(loom))]
    pub fn submit_blocking(
        &self,
        payload: T,
        priority: Priority,
        route: Route,
    ) -> Result<Ticket<R>, Refused<T>> {
        if self.policy != OverflowPolicy::Block {
            // Nothing to park for: the other policies never wait for room. A drop-oldest
            // submit can wait for a thread mid-way in its slot, which wakes nobody: the future
            // re-polls itself (a busy loop here), `try_submit` backs off and yields.
            return self.try_submit(payload, priority, route);
        }
        block_on(self.submit(payload, priority, route))
    }

    /// Resolves `route` to a worker index.
    fn route(&self, route: Route) -> Result<usize, AdmissionError> {
        let n = self.workers.len();
        match route {
            Route::Worker(w) if w < n => Ok(w),
            Route::Worker(w) => Err(AdmissionError::UnknownWorker {
                worker: w,
                workers: n,
            }),
            Route::Session(key) => Ok(session_worker(key, n)),
            Route::LeastLoaded => Ok(self.least_loaded()),
        }
    }

    /// The worker with the smallest load; ties broken by a per-thread rotating start so that
    /// producers racing on equal loads spread out instead of piling on worker 0.
    fn least_loaded(&self) -> usize {
        let n = self.workers.len();
        if n == 1 {
            return 0;
        }
        let start = next_start() % n;
        let mut best = start;
        let mut best_load = usize::MAX;
        for i in 0..n {
            let w = (start + i) % n;
            // Relaxed: a heuristic snapshot.
            let load = self.counters.load(w).load(Ordering::Relaxed);
            if load < best_load {
                best = w;
                best_load = load;
                if load == 0 {
                    break;
                }
            }
        }
        best
    }

    /// One admission attempt. `may_wait`: report `Full` under `Block` instead of refusing.
    fn admit(&self, payload: T, priority: Priority, route: Route, may_wait: bool) -> Admit<T, R> {
        // Relaxed here is only a fast path (it keeps `Closed` ahead of routing errors); the
        // check that settles a race with `close` is the SeqCst one in `enqueue`.
        if self.closed.load(Ordering::Relaxed) {
            return Admit::Refused(self.refuse_closed(payload));
        }
        let worker = match self.route(route) {
            Ok(w) => w,
            Err(error) => return Admit::Refused(Refused { error, payload }),
        };
        let (tx, ticket) = oneshot::channel();
        let entry = Entry { payload, tx };
        match self.enqueue(worker, priority, entry, may_wait) {
            Ok(()) => Admit::Admitted(ticket),
            Err(Rejected::Closed(entry)) => Admit::Refused(self.refuse_closed(entry.payload)),
            Err(Rejected::Full(entry)) if may_wait && self.policy == OverflowPolicy::Block => {
                Admit::Full {
                    entry,
                    ticket,
                    worker,
                }
            }
            // Only for a poll (`may_wait`), under drop-oldest.
            Err(Rejected::Busy(entry)) => Admit::Full {
                entry,
                ticket,
                worker,
            },
            Err(Rejected::Full(entry)) => {
                Counters::bump(&self.counters.workers[worker].rejected_full);
                Admit::Refused(Refused {
                    error: overloaded(OverloadReason::QueueFull, worker),
                    payload: entry.payload,
                })
            }
        }
    }

    /// Counts and builds a `Closed` refusal.
    fn refuse_closed(&self, payload: T) -> Refused<T> {
        Counters::bump(&self.counters.rejected_closed);
        Refused {
            error: AdmissionError::Closed,
            payload,
        }
    }

    /// One push attempt of `entry` on `worker`'s queue of class `priority` (evicting under
    /// drop-oldest), with load accounting, the closing handshake and the wake-up of idle
    /// workers. Gives the entry back if the queue set is closed, or (`Block`, `DropNewest`) if
    /// the queue has no usable slot now.
    ///
    /// The closing handshake, all on the worker's `submitting` word: the attempt raises the
    /// count with an RMW and pushes only if that RMW did not see `CLOSED_BIT`, that is, only if
    /// it precedes `close`'s `fetch_or` in the word's modification order. A worker that reads
    /// the word as exactly `CLOSED_BIT` reads a point after the `fetch_or`, hence after every
    /// admitted attempt's raise, with a zero count: after each such attempt's lowering too. The
    /// lowering follows the push and is Release, the worker's load Acquire, so the worker's
    /// take then sees every admitted request. So `pop_wait` cannot report `Closed` while an
    /// admitted request is still on its way into the queue.
    ///
    /// `in_poll`: the caller is a poll, which must not wait for another thread; under
    /// drop-oldest a slot held by a thread mid-way is then reported `Busy` instead of waited
    /// for (`push_evicting`).
    fn enqueue(
        &self,
        worker: usize,
        priority: Priority,
        entry: Entry<T, R>,
        in_poll: bool,
    ) -> Result<(), Rejected<T, R>> {
        let mut attempt = Attempt::start(self, worker);
        if attempt.closed {
            return Err(Rejected::Closed(entry));
        }
        attempt.count_load();
        let ring = self.workers[worker].ring(priority);
        match self.policy {
            OverflowPolicy::DropOldest => self
                .push_evicting(worker, ring, entry, in_poll)
                .map_err(Rejected::Busy)?,
            OverflowPolicy::Block | OverflowPolicy::DropNewest => ring
                .try_push(entry)
                .map_err(|e| Rejected::Full(e.into_inner()))?,
        }
        attempt.pushed = true;
        Ok(())
    }

    /// Drop-oldest: pushes `entry`, evicting the oldest entry of the (full) ring as often as it
    /// takes. The push is retried before each eviction, and an eviction only takes from a ring
    /// that is full at that instant (`Ring::evict_if_full`): a pop that made room meanwhile
    /// means no eviction. A round repeats without waiting only when another thread completed a
    /// step (a concurrent submit took the freed slot, or a pop made room), so that is lock-free;
    /// when the slot needed is held by a thread mid-way (`Busy`), evicting cannot help and this
    /// waits with `Backoff` for that thread (documented in the module's progress section), or,
    /// `in_poll`, gives the entry back at once.
    fn push_evicting(
        &self,
        worker: usize,
        ring: &Ring<Entry<T, R>>,
        mut entry: Entry<T, R>,
        in_poll: bool,
    ) -> Result<(), Entry<T, R>> {
        let backoff = Backoff::new();
        loop {
            match ring.try_push(entry) {
                Ok(()) => return Ok(()),
                Err(PushError::Full(e)) => entry = e,
                Err(PushError::Busy(e)) => {
                    // A consumer is handing back the very slot we need.
                    if in_poll {
                        return Err(e);
                    }
                    entry = e;
                    backoff.snooze();
                    continue;
                }
            }
            match ring.evict_if_full() {
                Pop::Value(old) => {
                    self.counters.release_load(worker);
                    Counters::bump(&self.counters.workers[worker].evicted_oldest);
                    old.tx
                        .send(Err(overloaded(OverloadReason::EvictedOldest, worker)));
                    drop(old.payload);
                }
                // Not full any more: a pop made room; retry the push. The spin is a pause
                // hint, like the ring's own retries after a stale position: this thread's
                // `Full` and `Empty` can both come from a view that lags the other threads'
                // completed steps (Relaxed `head` / `tail` loads), and it is the pause that
                // lets loom (which may serve a stale value for as long as a thread never
                // yields) see them too.
                Pop::Empty => backoff.spin(),
                // The oldest request is still being written by its submitter.
                Pop::Busy if in_poll => return Err(entry),
                Pop::Busy => backoff.snooze(),
            }
        }
    }

    /// Takes the next request of `worker`: its oldest latency-critical request, else its oldest
    /// throughput request. Never waits. When it takes nothing, `busy` says whether some queue's
    /// oldest request is still being written (else both queues were empty).
    ///
    /// Shaped for the code it inlines into: the job is built from the entry's fields in the
    /// expression that returns it, after any waker ran. With a job alive across a waker call,
    /// rustc kept it in memory for the unwinding path and moved it into the caller's
    /// `Result<Option<Job>, AdmissionError>` in pieces that straddle the error's byte fields;
    /// reassembling them defeated store-to-load forwarding, about 1.6x on the uncontended
    /// submit + pop (BENCHMARKS.md, admission). What an unwinding job would do is done by
    /// [`Taken`] instead.
    #[inline]
    fn take(&self, worker: usize, busy: &mut bool) -> Option<Job<T, R>> {
        let wq = &self.workers[worker];
        *busy = false;
        for priority in [Priority::LatencyCritical, Priority::Throughput] {
            let entry = match wq.ring(priority).try_pop() {
                Pop::Value(entry) => entry,
                Pop::Empty => continue,
                Pop::Busy => {
                    *busy = true;
                    continue;
                }
            };
            if self.policy == OverflowPolicy::Block {
                // If a waker panics, the request ends as a dropped job would: `entry`'s
                // completer resolves the ticket `Abandoned`, the guard releases the load and
                // counts the abandonment.
                let taken = Taken {
                    counters: &self.counters,
                    worker,
                };
                // SeqCst fence: the waker half of the handshake with blocked submitters
                // (pairs with the fence after registration in `Submit::poll`).
                fence(Ordering::SeqCst);
                let room = wq.room(priority);
                if room.has_waiters() {
                    room.wake_all();
                }
                std::mem::forget(taken);
            }
            return Some(Job {
                payload: entry.payload,
                completion: Completion {
                    tx: Some(entry.tx),
                    counters: self.counters.clone(),
                    worker: worker as u32,
                },
                priority,
            });
        }
        None
    }

    /// True if the queue set is closed and no push attempt on `worker` is in progress: then
    /// queues that a later `take` finds empty stay empty (see `enqueue`).
    fn closed_and_quiet(&self, worker: usize) -> bool {
        // Acquire: pairs with the Release lowering in `Attempt::drop` (see `enqueue`).
        self.counters.workers[worker]
            .submitting
            .load(Ordering::Acquire)
            == CLOSED_BIT
    }

    /// Takes the next request of `worker` without waiting: its oldest latency-critical request,
    /// else its oldest throughput request, else `None`. `None` means nothing could be taken
    /// without waiting: the queues are empty, or the oldest request of a queue is still being
    /// written by its submitter (the waiting [`Admission::pop_wait`] is woken when it lands).
    pub fn pop(&self, worker: usize) -> Result<Option<Job<T, R>>, AdmissionError> {
        self.worker_queues(worker)?;
        Ok(self.take(worker, &mut false))
    }

    /// Waits for the next request of `worker` (a future; runtime-agnostic). Resolves to
    /// `Err(Closed)` once the queue set is closed and the worker's queues are empty, so a worker
    /// loop `while let Ok(job) = q.pop_wait(w).await` drains and ends on shutdown.
    pub fn pop_wait(&self, worker: usize) -> PopWait<'_, T, R> {
        PopWait {
            adm: self,
            worker,
            reg: None,
        }
    }

    /// [`Admission::pop_wait`], parking the calling thread.
    #[cfg(not(loom))]
    pub fn pop_blocking(&self, worker: usize) -> Result<Job<T, R>, AdmissionError> {
        block_on(self.pop_wait(worker))
    }

    /// Closes the queue set: every later submit is refused with `Closed`, blocked submitters
    /// wake and get `Closed`, and idle `pop_wait`s end with `Closed` once their queues are
    /// empty. Requests already queued, and submits racing the close that are admitted, stay
    /// for the workers to drain (module docs, "Closing").
    ///
    /// # Panics
    ///
    /// If a waker panics: every waiter is woken first, then the first panic is resumed.
    pub fn close(&self) {
        // SeqCst: `is_closed` readers and the fast path of `admit`; the handshakes below do not
        // rely on this store.
        self.closed.store(true, Ordering::SeqCst);
        for c in self.counters.workers.iter() {
            // Relaxed: its place in the word's modification order decides each racing attempt
            // (`enqueue`); the fence below orders it before our wake-ups.
            c.submitting.fetch_or(CLOSED_BIT, Ordering::Relaxed);
        }
        // SeqCst fence: the waker half of the handshake with every waiter, which registers,
        // fences and then reads the `submitting` word (a blocked submitter's next attempt, an
        // idle worker's `closed_and_quiet`): either our wake-ups below take its registration or
        // its read sees `CLOSED_BIT`.
        fence(Ordering::SeqCst);
        let mut first_panic = None;
        for wq in self.workers.iter() {
            for list in [&wq.high_room, &wq.low_room, &wq.work] {
                if let Some(p) = list.wake_all_catching() {
                    first_panic.get_or_insert(p);
                }
            }
        }
        if let Some(p) = first_panic {
            std::panic::resume_unwind(p);
        }
    }

    /// True once [`Admission::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    fn worker_queues(&self, worker: usize) -> Result<&WorkerQueues<T, R>, AdmissionError> {
        self.workers
            .get(worker)
            .ok_or(AdmissionError::UnknownWorker {
                worker,
                workers: self.workers.len(),
            })
    }

    /// Requests queued for `worker` in class `priority` (a consistent snapshot of that queue).
    pub fn depth(&self, worker: usize, priority: Priority) -> Result<usize, AdmissionError> {
        Ok(self.worker_queues(worker)?.ring(priority).len())
    }

    /// Requests routed to `worker` that are queued or running (popped, not yet completed).
    pub fn worker_load(&self, worker: usize) -> Result<usize, AdmissionError> {
        self.worker_queues(worker)?;
        Ok(self.counters.load(worker).load(Ordering::Relaxed))
    }

    /// Requests admitted and not yet completed (queued or running), over all workers.
    pub fn in_flight(&self) -> usize {
        self.counters
            .workers
            .iter()
            // Relaxed: a statistic (each worker's figure is exact at quiescence).
            .map(|c| c.load.load(Ordering::Relaxed))
            .sum()
    }

    /// False when the queue set is closed or any queue is at least 80% full.
    pub fn is_healthy(&self) -> bool {
        !self.is_closed()
            && self.workers.iter().all(|wq| {
                [&wq.high, &wq.low]
                    .iter()
                    .all(|r| !over_high_water(r.len(), r.capacity()))
            })
    }

    /// A snapshot of every figure (allocates one `Vec` for the per-worker figures).
    pub fn metrics(&self) -> AdmissionMetrics {
        let workers: Vec<WorkerMetrics> = self
            .workers
            .iter()
            .enumerate()
            .map(|(w, wq)| {
                let c = &self.counters.workers[w];
                // Relaxed: statistics.
                WorkerMetrics {
                    high_depth: wq.high.len(),
                    low_depth: wq.low.len(),
                    load: c.load.load(Ordering::Relaxed),
                    rejected_full: c.rejected_full.load(Ordering::Relaxed),
                    evicted_oldest: c.evicted_oldest.load(Ordering::Relaxed),
                    abandoned: c.abandoned.load(Ordering::Relaxed),
                }
            })
            .collect();
        let high_cap = self.capacity(Priority::LatencyCritical);
        let low_cap = self.capacity(Priority::Throughput);
        let closed = self.is_closed();
        let healthy = !closed
            && workers.iter().all(|m| {
                !over_high_water(m.high_depth, high_cap) && !over_high_water(m.low_depth, low_cap)
            });
        AdmissionMetrics {
            in_flight: workers.iter().map(|m| m.load).sum(),
            rejected_full: workers.iter().map(|m| m.rejected_full).sum(),
            evicted_oldest: workers.iter().map(|m| m.evicted_oldest).sum(),
            abandoned: workers.iter().map(|m| m.abandoned).sum(),
            rejected_closed: self.counters.rejected_closed.load(Ordering::Relaxed),
            workers,
            healthy,
            closed,
        }
    }
}

/// `depth` is at least 80% of `cap` (integer arithmetic, exact).
fn over_high_water(depth: usize, cap: usize) -> bool {
    depth.saturating_mul(5) >= cap.saturating_mul(4)
}

fn overloaded(reason: OverloadReason, worker: usize) -> AdmissionError {
    AdmissionError::Overloaded {
        reason,
        worker: worker as u32,
    }
}

/// A per-thread counter for least-loaded tie-breaking (no shared cache line is written).
fn next_start() -> usize {
    use std::cell::Cell;
    thread_local!(static NEXT: Cell<usize> = const { Cell::new(0) });
    NEXT.with(|c| {
        let v = c.get();
        c.set(v.wrapping_add(1));
        v
    })
}

impl<T, R> Drop for Admission<T, R> {
    fn drop(&mut self) {
        // Requests nobody will pop now: their tickets learn the queue set is gone.
        for wq in self.workers.iter() {
            for ring in [&wq.high, &wq.low] {
                // `&mut self`: no push is in progress, so the ring is never `Busy` here.
                while let Pop::Value(entry) = ring.try_pop() {
                    entry.tx.send(Err(AdmissionError::Closed));
                }
            }
        }
    }
}

impl<T, R> std::fmt::Debug for Admission<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("policy", &self.policy)
            .field("metrics", &self.metrics())
            .finish()
    }
}

/// Figures of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerMetrics {
    /// Latency-critical requests queued.
    pub high_depth: usize,
    /// Throughput requests queued.
    pub low_depth: usize,
    /// Requests routed here that are queued or running.
    pub load: usize,
    /// Submits refused because this worker's queue was full.
    pub rejected_full: u64,
    /// Queued requests evicted by drop-oldest.
    pub evicted_oldest: u64,
    /// Popped requests dropped without an outcome.
    pub abandoned: u64,
}

/// A snapshot of a queue set's figures, read without a lock (each figure is read atomically;
/// the set of figures is not one atomic snapshot while traffic flows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionMetrics {
    /// Per-worker figures, indexed by worker.
    pub workers: Vec<WorkerMetrics>,
    /// Requests admitted and not yet completed.
    pub in_flight: usize,
    /// Submits refused on a full queue (drop-newest, or `try_submit` under block).
    pub rejected_full: u64,
    /// Queued requests evicted by drop-oldest.
    pub evicted_oldest: u64,
    /// Submits refused because the queue set was closed.
    pub rejected_closed: u64,
    /// Popped requests dropped by their worker without an outcome.
    pub abandoned: u64,
    /// False when closed or when any queue is at least 80% full.
    pub healthy: bool,
    /// True once closed.
    pub closed: bool,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::ring::stall::{self, within, Point};
    use super::{Admission, AdmissionConfig, AdmissionError, OverflowPolicy, Priority, Route};
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc::channel;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Panics;
    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("this waker panics");
        }
    }

    /// A pop under `Block` that wakes a blocked submitter whose waker panics: the panic reaches
    /// the popping worker, and the request it took ends as a dropped job does (its ticket
    /// `Abandoned`, its load released, the abandonment counted) instead of vanishing with the
    /// load still counted. The blocked submit then gets the room.
    #[test]
    fn a_panicking_room_waker_abandons_the_taken_request() {
        let q: Admission<u32, u32> =
            Admission::new(AdmissionConfig::new(1, 1, OverflowPolicy::Block)).unwrap();
        let first = q
            .try_submit(1, Priority::Throughput, Route::Worker(0))
            .unwrap();
        let mut blocked = std::pin::pin!(q.submit(2, Priority::Throughput, Route::Worker(0)));
        let panics = Waker::from(Arc::new(Panics));
        assert!(blocked
            .as_mut()
            .poll(&mut Context::from_waker(&panics))
            .is_pending());
        assert_eq!(q.in_flight(), 1);
        let popped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| q.pop(0)));
        assert!(popped.is_err(), "the waker's panic reaches the worker");
        assert_eq!(first.wait(), Err(AdmissionError::Abandoned));
        assert_eq!(q.in_flight(), 0, "the taken request's load was released");
        assert_eq!(q.metrics().abandoned, 1);
        let count = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
        let Poll::Ready(Ok(second)) = blocked.as_mut().poll(&mut Context::from_waker(&count))
        else {
            panic!("the blocked submit has room now")
        };
        let job = q.pop(0).unwrap().expect("the second request");
        job.complete(20);
        assert_eq!(second.wait(), Ok(20));
        assert_eq!(q.in_flight(), 0);
    }

    /// A submit stopped between claiming its slot and publishing it (a descheduled thread):
    /// `pop` returns `None` and a `PopWait` poll returns `Pending` at once (before the fix the
    /// poll spun until the submitter ran again), even after `close` (the request is on its way,
    /// so `Closed` would strand its ticket); the submitter's push wakes the waiter, whose next
    /// poll takes the request; only then does it report `Closed`.
    #[test]
    fn pop_wait_does_not_spin_on_a_stalled_submit_and_is_woken_when_it_lands() {
        within("pop_wait with a stalled submitter", || {
            let q: Arc<Admission<u32, u32>> = Arc::new(
                Admission::new(AdmissionConfig::new(1, 4, OverflowPolicy::DropNewest)).unwrap(),
            );
            let (stopped_tx, stopped) = channel();
            let (resume, resume_rx) = channel();
            let submitter = {
                let q = q.clone();
                std::thread::spawn(move || {
                    stall::once_at(Point::Claimed, stopped_tx, resume_rx);
                    q.try_submit(7, Priority::Throughput, Route::Worker(0))
                        .map_err(|r| r.error)
                })
            };
            stopped.recv().unwrap();
            assert!(q.pop(0).unwrap().is_none());
            let count = Arc::new(Count(AtomicUsize::new(0)));
            let waker = Waker::from(count.clone());
            let mut cx = Context::from_waker(&waker);
            let mut fut = std::pin::pin!(q.pop_wait(0));
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            q.close();
            let woken_by_close = count.0.load(Ordering::SeqCst);
            assert!(
                fut.as_mut().poll(&mut cx).is_pending(),
                "closed, but an admitted request is still being written: not `Closed` yet"
            );
            resume.send(()).unwrap();
            let ticket = submitter
                .join()
                .unwrap()
                .expect("admitted before the close");
            assert!(
                count.0.load(Ordering::SeqCst) > woken_by_close,
                "the landing push woke the waiting worker"
            );
            let Poll::Ready(Ok(job)) = fut.as_mut().poll(&mut cx) else {
                panic!("the request is there")
            };
            assert_eq!(*job.payload(), 7);
            job.complete(70);
            assert_eq!(ticket.wait(), Ok(70));
            let mut fut = std::pin::pin!(q.pop_wait(0));
            assert!(matches!(
                fut.as_mut().poll(&mut cx),
                Poll::Ready(Err(AdmissionError::Closed))
            ));
        });
    }

    /// A drop-oldest `submit` whose slot a consumer is still reading out (stopped between its
    /// head CAS and its stamp store): the poll returns `Pending` at once, having woken its own
    /// task, instead of waiting for the consumer (before the fix it spun and yielded its
    /// thread until the consumer ran again: an executor thread blocked by another thread); the
    /// next poll after the consumer finishes admits the request.
    #[test]
    fn a_drop_oldest_submit_poll_does_not_wait_for_a_stalled_consumer() {
        let q: Arc<Admission<u32, u32>> = Arc::new(
            Admission::new(AdmissionConfig::new(1, 1, OverflowPolicy::DropOldest)).unwrap(),
        );
        let first = q
            .try_submit(1, Priority::Throughput, Route::Worker(0))
            .unwrap();
        let (stopped_tx, stopped) = channel();
        let (resume, resume_rx) = channel();
        let consumer = {
            let q = q.clone();
            std::thread::spawn(move || {
                stall::once_at(Point::Taken, stopped_tx, resume_rx);
                q.pop(0).unwrap().map(|job| job.complete(10))
            })
        };
        stopped.recv().unwrap();
        // The future borrows the queue set across threads: a leaked handle is `'static`.
        let q2: &'static Admission<u32, u32> = Box::leak(Box::new(q.clone()));
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            within(
                "a drop-oldest submit poll with a stalled consumer",
                move || {
                    let count = Arc::new(Count(AtomicUsize::new(0)));
                    let waker = Waker::from(count.clone());
                    let mut cx = Context::from_waker(&waker);
                    let mut fut = Box::pin(q2.submit(2, Priority::Throughput, Route::Worker(0)));
                    let first_poll = fut.as_mut().poll(&mut cx).is_pending();
                    (fut, first_poll, count.0.load(Ordering::SeqCst))
                },
            )
        }));
        resume.send(()).unwrap();
        assert!(consumer.join().unwrap().is_some());
        assert_eq!(first.wait(), Ok(10));
        let (mut fut, pending, woken) = polled.expect("the poll waited for the consumer");
        assert!(pending, "the slot is still being read out");
        assert!(
            woken >= 1,
            "a pending poll that nothing else wakes wakes its own task"
        );
        let count = Waker::from(Arc::new(Count(AtomicUsize::new(0))));
        let Poll::Ready(Ok(second)) = fut.as_mut().poll(&mut Context::from_waker(&count)) else {
            panic!("the slot is free now")
        };
        drop(fut);
        let job = q.pop(0).unwrap().expect("the second request");
        assert_eq!(*job.payload(), 2);
        job.complete(20);
        assert_eq!(second.wait(), Ok(20));
        assert_eq!(q.metrics().evicted_oldest, 0);
        assert_eq!(q.in_flight(), 0);
    }
}
