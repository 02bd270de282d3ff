//! A one-shot result channel: one [`Ticket`] (receiver), one `Completer` (sender), one value.
//!
//! # Protocol
//!
//! One `AtomicUsize` holds the state bits below; the value and the receiver's waker live in
//! `UnsafeCell`s whose exclusive access the bits arbitrate (the scheme of tokio's oneshot):
//!
//! - The sender writes `value`, then `fetch_or(COMPLETE)` (Release publishes the value). If
//!   `RX_WAKER` was set at that RMW, it wakes the stored waker **by reference** (a read).
//! - The receiver writes `waker` only while `RX_WAKER` is clear and `COMPLETE` was not yet set:
//!   it clears `RX_WAKER` with an RMW, and gives up (the value is there) if that RMW shows
//!   `COMPLETE`. RMWs on one atomic are totally ordered, so the sender either saw `RX_WAKER`
//!   clear (and never reads the waker) or set `COMPLETE` first (and the receiver never writes).
//!   Concurrent accesses to the waker are therefore only reads (`will_wake`, `wake_by_ref`).
//! - After `COMPLETE` the value belongs to the receiver alone.
//! - The receiver's drop sets `RX_CLOSED` with an RMW. If that RMW shows `RX_WAKER` without
//!   `COMPLETE`, the sender's later RMW will see `RX_CLOSED` and never read the waker, so the
//!   drop takes it out and drops it at once: a client that gave up on a request does not keep
//!   its task's waker (in a runtime, the task's memory) alive until the request completes.
//!
//! Reclamation is by `Arc`: the shared block is freed when both ends are gone; a waker still
//! stored and any untaken value are dropped with it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::error::AdmissionError;
use crate::sync::{Arc, AtomicUsize, Ordering, UnsafeCell};

/// The receiver's waker is stored in `waker` and may be read by the sender.
const RX_WAKER: usize = 0b001;
/// The value is written; the sender will not touch the block again.
const COMPLETE: usize = 0b010;
/// The receiver (the ticket) was dropped: nobody will read the value.
const RX_CLOSED: usize = 0b100;

/// The block both ends share.
struct Shared<R> {
    /// `RX_WAKER | COMPLETE | RX_CLOSED` bits, see the module docs.
    state: AtomicUsize,
    /// Written once by the sender before `COMPLETE`; taken by the receiver after seeing it.
    value: UnsafeCell<Option<Result<R, AdmissionError>>>,
    /// The receiver's waker; written by the receiver only while `RX_WAKER` is clear.
    waker: UnsafeCell<Option<Waker>>,
}

/// Creates a connected pair.
pub(crate) fn channel<R>() -> (Completer<R>, Ticket<R>) {
    let shared = Arc::new(Shared {
        state: AtomicUsize::new(0),
        value: UnsafeCell::new(None),
        waker: UnsafeCell::new(None),
    });
    (
        Completer {
            shared: Some(shared.clone()),
        },
        Ticket {
            shared: Some(shared),
        },
    )
}

/// The sending end. Dropping it without sending resolves the ticket to
/// [`AdmissionError::Abandoned`].
pub(crate) struct Completer<R> {
    /// `None` once sent.
    shared: Option<Arc<Shared<R>>>,
}

impl<R> Completer<R> {
    /// Resolves the ticket with `value`.
    pub(crate) fn send(mut self, value: Result<R, AdmissionError>) {
        self.send_inner(value);
    }

    /// True if the ticket was dropped: nobody is waiting for the outcome.
    pub(crate) fn is_closed(&self) -> bool {
        self.shared
            .as_ref()
            // Relaxed: advisory; no data is read on the strength of it.
            .is_none_or(|s| s.state.load(Ordering::Relaxed) & RX_CLOSED != 0)
    }

    fn send_inner(&mut self, value: Result<R, AdmissionError>) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        // SAFETY: only the sender writes `value`, exactly once (`shared` was `Some` and is now
        // taken), and before `COMPLETE` is set the receiver never touches it.
        shared.value.with_mut(|v| unsafe { *v = Some(value) });
        // AcqRel: Release publishes the value write to the receiver's Acquire load of
        // `COMPLETE`; Acquire pairs with the receiver's Release `fetch_or(RX_WAKER)`, making its
        // waker write visible before we read it.
        let prev = shared.state.fetch_or(COMPLETE, Ordering::AcqRel);
        if prev & RX_WAKER != 0 && prev & RX_CLOSED == 0 {
            // SAFETY: `RX_WAKER` was set at our RMW, so the receiver finished writing the waker
            // before it (Acquire above) and, seeing `COMPLETE` from now on, will never write it
            // again; concurrent receiver accesses are reads (`will_wake`). We only read too.
            shared.waker.with(|w| unsafe {
                if let Some(w) = &*w {
                    w.wake_by_ref();
                }
            });
        }
    }
}

impl<R> Drop for Completer<R> {
    fn drop(&mut self) {
        self.send_inner(Err(AdmissionError::Abandoned));
    }
}

impl<R> std::fmt::Debug for Completer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("sent", &self.shared.is_none())
            .finish()
    }
}

/// The outcome of one admitted request: a future (and a pollable handle) that resolves to the
/// worker's result, or to the [`AdmissionError`] that ended the request (evicted by the
/// drop-oldest policy, abandoned by its worker, or closed with the queue set).
///
/// Runtime-agnostic: it only uses the `Waker` it is polled with. Dropping it tells the worker
/// that nobody is waiting (see `Job::is_cancelled`).
pub struct Ticket<R> {
    /// `None` once the value was taken.
    shared: Option<Arc<Shared<R>>>,
}

impl<R> Ticket<R> {
    /// The outcome if it is ready, without waiting. Returns `None` while the request is pending,
    /// and after the outcome was already taken.
    pub fn try_take(&mut self) -> Option<Result<R, AdmissionError>> {
        let shared = self.shared.as_ref()?;
        // Acquire: pairs with the sender's Release `fetch_or(COMPLETE)`.
        if shared.state.load(Ordering::Acquire) & COMPLETE == 0 {
            return None;
        }
        Some(self.take_value())
    }

    /// True once the outcome is ready to take (or was taken).
    pub fn is_ready(&self) -> bool {
        self.shared
            .as_ref()
            // Acquire: as in `try_take`.
            .is_none_or(|s| s.state.load(Ordering::Acquire) & COMPLETE != 0)
    }

    /// Takes the value; `COMPLETE` must have been observed with Acquire.
    fn take_value(&mut self) -> Result<R, AdmissionError> {
        let Some(shared) = self.shared.take() else {
            return Err(AdmissionError::Abandoned);
        };
        // SAFETY: `COMPLETE` was observed (Acquire), so the sender's write is visible and the
        // sender never touches `value` again; we are the only receiver, and we take it once
        // (`shared` is now `None`).
        let value = shared.value.with_mut(|v| unsafe { (*v).take() });
        // The sender always stores `Some` before `COMPLETE`; `Abandoned` is an unreachable
        // fallback that keeps this path free of panics.
        value.unwrap_or(Err(AdmissionError::Abandoned))
    }

    /// Blocks the calling thread until the outcome is ready (parks the thread; no runtime).
    /// [`AdmissionError::Taken`] if [`try_take`](Self::try_take) already took it.
    #[cfg(not(loom))]
    pub fn wait(self) -> Result<R, AdmissionError> {
        if self.shared.is_none() {
            return Err(AdmissionError::Taken);
        }
        super::block_on(self)
    }
}

impl<R> Future for Ticket<R> {
    type Output = Result<R, AdmissionError>;

    /// Polled once the outcome was taken (by [`try_take`](Ticket::try_take), or by an earlier
    /// poll that returned `Ready`), it resolves to [`AdmissionError::Taken`], as
    /// [`wait`](Ticket::wait) does.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(shared) = this.shared.as_ref() else {
            return Poll::Ready(Err(AdmissionError::Taken));
        };
        // Acquire: pairs with the sender's Release `fetch_or(COMPLETE)`.
        let state = shared.state.load(Ordering::Acquire);
        if state & COMPLETE != 0 {
            return Poll::Ready(this.take_value());
        }
        if state & RX_WAKER != 0 {
            // SAFETY: `RX_WAKER` is set, so only we may write the waker, and we are not writing;
            // the sender may be reading it concurrently, which is read/read.
            let same = shared
                .waker
                .with(|w| unsafe { (*w).as_ref().is_some_and(|w| w.will_wake(cx.waker())) });
            if same {
                return Poll::Pending;
            }
            // Take the waker slot back before overwriting it. Acquire: if `COMPLETE` shows up
            // here, the value write is visible (pairs with the sender's Release RMW).
            let prev = shared.state.fetch_and(!RX_WAKER, Ordering::Acquire);
            if prev & COMPLETE != 0 {
                return Poll::Ready(this.take_value());
            }
        }
        // SAFETY: `RX_WAKER` is clear and was clear when the sender's RMW (if any) ran, or we saw
        // `COMPLETE` above and returned; so the sender will not read the waker, and only we write.
        shared
            .waker
            .with_mut(|w| unsafe { *w = Some(cx.waker().clone()) });
        // AcqRel: Release publishes the waker to the sender's Acquire RMW; Acquire makes the value
        // visible if the sender completed first.
        let prev = shared.state.fetch_or(RX_WAKER, Ordering::AcqRel);
        if prev & COMPLETE != 0 {
            // The sender completed before seeing our waker, so it did not wake us.
            return Poll::Ready(this.take_value());
        }
        Poll::Pending
    }
}

impl<R> Drop for Ticket<R> {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            // Acquire: if `RX_WAKER` shows (and `COMPLETE` does not), our own earlier write of
            // the waker is what we drop below (program order already gives that; the Acquire
            // costs nothing on the RMW and keeps the argument local). The flag itself is
            // advisory for `Completer::is_closed`; the Arc handles reclamation.
            let prev = shared.state.fetch_or(RX_CLOSED, Ordering::Acquire);
            if prev & RX_WAKER != 0 && prev & COMPLETE == 0 {
                // Our RMW precedes the sender's `fetch_or(COMPLETE)` in the state's
                // modification order, so that RMW sees `RX_CLOSED` and never reads the waker:
                // drop the task's waker now rather than when the request completes (a long
                // queue or generation would hold the ended task's memory until then).
                // SAFETY: `RX_WAKER` was set, so only the receiver (us) writes the waker, and
                // the sender reads it only if its RMW saw `RX_WAKER` without `RX_CLOSED`,
                // which can no longer happen; `COMPLETE` clear means it has not read it yet.
                let waker = shared.waker.with_mut(|w| unsafe { (*w).take() });
                drop(waker);
            }
        }
    }
}

impl<R> std::fmt::Debug for Ticket<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("ready", &self.is_ready())
            .finish()
    }
}

// SAFETY (auto traits): `Shared<R>` contains `UnsafeCell`s, so it is neither `Send` nor `Sync`
// automatically. Sharing it moves one `R` from the sender's thread to the receiver's (needs
// `R: Send`); no `&R` is ever shared, so `R: Sync` is not needed. `Waker` is `Send + Sync`.
// SAFETY: see above — the state bits give every cell access a single owner or only readers.
unsafe impl<R: Send> Send for Shared<R> {}
// SAFETY: see above.
unsafe impl<R: Send> Sync for Shared<R> {}
