//! The waiting operations: [`Submit`] (a blocking-policy submit that parks until a pop makes
//! room), [`PopWait`] (an idle worker parked until a submit brings work) and [`block_on`].
//! Both futures use the wait-list handshake of the `waitlist` module.
//!
//! No poll ever waits for another thread: a poll makes a bounded number of attempts (one before
//! and one after registering its waker; a blocking `Submit`'s first poll makes one more, its
//! initial admission) and returns `Pending` if none succeeds; the thread whose
//! step would let it progress (a pop that frees a slot, a push that lands, a `close`, a push
//! attempt ending on a closed queue set) wakes it. The one exception to the wake-up (not to the
//! no-waiting): a drop-oldest `Submit` whose slot is held by a thread mid-way, which nothing
//! wakes a waiter for, wakes its own task and is polled again.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::waitlist::{Registration, WaitList};
use super::Job;
use super::{
    Admission, AdmissionError, Admit, Entry, OverflowPolicy, Priority, Refused, Rejected, Route,
    Ticket,
};
use crate::sync::{fence, Ordering};

/// Gives up a resolving future's registration, if it has one. Its node can still be queued:
/// the future registered, then its re-check succeeded, and the step that made it succeed
/// (a push, a pop, a `close`) ran its wake-up before the node was in the list. The list
/// cannot unlink one node, so without this the node and its clone of the task's waker stayed
/// until the list's next wake-up (for a `pop_wait` that ended `Closed`, until the queue set's
/// drop), holding a finished task's memory in a runtime and waking it spuriously later.
/// `Registration::abandon` takes the list instead (its other waiters re-register).
///
/// # Panics
/// A waker's panic, as `Registration::abandon`; the outcome the poll was returning is then
/// dropped as on any unwind (a taken job resolves its ticket `Abandoned`; an admitted submit's
/// ticket is dropped, so its worker sees the request cancelled).
fn release(reg: &mut Option<Registration>, list: &WaitList) {
    if let Some(reg) = reg.take() {
        reg.abandon(list);
    }
}

pub(super) enum SubmitStage<T, R> {
    Start {
        payload: T,
        priority: Priority,
        route: Route,
    },
    Waiting {
        entry: Entry<T, R>,
        ticket: Ticket<R>,
        worker: usize,
        priority: Priority,
    },
    Done,
}

/// The future of [`Admission::submit`].
#[must_use = "futures do nothing unless polled"]
pub struct Submit<'a, T, R> {
    pub(super) adm: &'a Admission<T, R>,
    pub(super) stage: SubmitStage<T, R>,
    /// This task's node in the queue's room wait list, while waiting.
    pub(super) reg: Option<Registration>,
}

// `Submit` never pins its fields (the payload moves in and out of the stage by value), so it is
// `Unpin` whatever `T` is.
impl<T, R> Unpin for Submit<'_, T, R> {}

impl<T, R> Future for Submit<'_, T, R> {
    type Output = Result<Ticket<R>, Refused<T>>;

    /// # Panics
    ///
    /// If polled again after it returned `Ready` (the `Future` contract).
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let adm = this.adm;
        let (mut entry, ticket, worker, priority, attempted) =
            match std::mem::replace(&mut this.stage, SubmitStage::Done) {
                SubmitStage::Start {
                    payload,
                    priority,
                    route,
                } => match adm.admit(payload, priority, route, true) {
                    Admit::Admitted(t) => return Poll::Ready(Ok(t)),
                    Admit::Refused(r) => return Poll::Ready(Err(r)),
                    Admit::Full {
                        entry,
                        ticket,
                        worker,
                    } => (entry, ticket, worker, priority, true),
                },
                SubmitStage::Waiting {
                    entry,
                    ticket,
                    worker,
                    priority,
                } => (entry, ticket, worker, priority, false),
                SubmitStage::Done => panic!("Submit polled after it completed"),
            };
        if adm.policy == OverflowPolicy::DropOldest {
            // Drop-oldest never waits for room; what stopped it is a thread mid-way in the slot
            // it needs (`Rejected::Busy`), which wakes no wait list. Waiting for that thread
            // here would block the executor's thread: retry once per poll, and have the task
            // polled again.
            if !attempted {
                match adm.enqueue(worker, priority, entry, true) {
                    Ok(()) => return Poll::Ready(Ok(ticket)),
                    Err(Rejected::Closed(e)) => {
                        return Poll::Ready(Err(adm.refuse_closed(e.payload)))
                    }
                    Err(Rejected::Full(e) | Rejected::Busy(e)) => entry = e,
                }
            }
            this.stage = SubmitStage::Waiting {
                entry,
                ticket,
                worker,
                priority,
            };
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let room = adm.workers[worker].room(priority);
        // Two rounds: a plain retry, then (unless our wake-up is still owed) register and retry.
        for registered in [false, true] {
            if registered {
                if this.reg.as_ref().is_some_and(|r| r.is_current(cx.waker())) {
                    break;
                }
                if let Some(old) = this.reg.take() {
                    old.abandon(room);
                }
                this.reg = Some(room.register(cx.waker()));
                // SeqCst fence: the waiter half of the handshake (pairs with the fence in
                // `Admission::take` after it frees a slot, and in `close`).
                fence(Ordering::SeqCst);
            }
            // `enqueue`'s announcing RMW on the worker's `submitting` word comes after our
            // fence, so a `close` whose wake-up missed our registration is seen there.
            match adm.enqueue(worker, priority, entry, true) {
                Ok(()) => {
                    release(&mut this.reg, room);
                    return Poll::Ready(Ok(ticket));
                }
                Err(Rejected::Closed(e)) => {
                    release(&mut this.reg, room);
                    return Poll::Ready(Err(adm.refuse_closed(e.payload)));
                }
                // (`Busy` is drop-oldest's only.)
                Err(Rejected::Full(e) | Rejected::Busy(e)) => entry = e,
            }
        }
        this.stage = SubmitStage::Waiting {
            entry,
            ticket,
            worker,
            priority,
        };
        Poll::Pending
    }
}

impl<T, R> Drop for Submit<'_, T, R> {
    /// A submit dropped while waiting gives up its place in the room list (see
    /// `Registration::abandon`); its request was never queued, so it just goes.
    fn drop(&mut self) {
        if let (
            Some(reg),
            SubmitStage::Waiting {
                worker, priority, ..
            },
        ) = (self.reg.take(), &self.stage)
        {
            reg.abandon(self.adm.workers[*worker].room(*priority));
        }
    }
}

impl<T, R> std::fmt::Debug for Submit<'_, T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stage = match self.stage {
            SubmitStage::Start { .. } => "start",
            SubmitStage::Waiting { .. } => "waiting",
            SubmitStage::Done => "done",
        };
        f.debug_struct("Submit").field("stage", &stage).finish()
    }
}

/// The future of [`Admission::pop_wait`].
#[must_use = "futures do nothing unless polled"]
pub struct PopWait<'a, T, R> {
    pub(super) adm: &'a Admission<T, R>,
    pub(super) worker: usize,
    /// This task's node in the worker's work wait list, while waiting.
    pub(super) reg: Option<Registration>,
}

impl<T, R> Future for PopWait<'_, T, R> {
    type Output = Result<Job<T, R>, AdmissionError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let adm = this.adm;
        let wq = match adm.worker_queues(this.worker) {
            Ok(wq) => wq,
            Err(e) => return Poll::Ready(Err(e)),
        };
        for registered in [false, true] {
            if registered {
                if this.reg.as_ref().is_some_and(|r| r.is_current(cx.waker())) {
                    break;
                }
                if let Some(old) = this.reg.take() {
                    old.abandon(&wq.work);
                }
                this.reg = Some(wq.work.register(cx.waker()));
                // SeqCst fence: the waiter half of the handshake (pairs with the fence that
                // ends every push attempt, `Attempt::drop`, and with the one in `close`).
                fence(Ordering::SeqCst);
            }
            // Closed and quiet *before* the take: then nothing admitted is still on its way,
            // and a take that finds the queues empty means they stay empty (the closing
            // handshake, `Admission::enqueue`).
            let drained_if_empty = adm.closed_and_quiet(this.worker);
            let mut busy = false;
            if let Some(job) = adm.take(this.worker, &mut busy) {
                release(&mut this.reg, &wq.work);
                return Poll::Ready(Ok(job));
            }
            if drained_if_empty && !busy {
                release(&mut this.reg, &wq.work);
                return Poll::Ready(Err(AdmissionError::Closed));
            }
            // Busy: a submit is writing the oldest request; it wakes us when it lands.
        }
        Poll::Pending
    }
}

impl<T, R> Drop for PopWait<'_, T, R> {
    /// A pop dropped while waiting gives up its place in the work list (see
    /// `Registration::abandon`).
    fn drop(&mut self) {
        if let (Some(reg), Ok(wq)) = (self.reg.take(), self.adm.worker_queues(self.worker)) {
            reg.abandon(&wq.work);
        }
    }
}

impl<T, R> std::fmt::Debug for PopWait<'_, T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PopWait")
            .field("worker", &self.worker)
            .field("waiting", &self.reg.is_some())
            .finish()
    }
}

/// Runs a future to completion on the calling thread, parking it while the future is pending
/// (a minimal executor for callers without an async runtime).
#[cfg(not(loom))]
pub fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unparker(std::thread::Thread);
    impl std::task::Wake for Unparker {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let mut fut = std::pin::pin!(fut);
    let waker = std::task::Waker::from(std::sync::Arc::new(Unparker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        // A wake between the poll and here leaves the unpark token set: park returns at once.
        std::thread::park();
    }
}
