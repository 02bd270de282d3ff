//! What a worker holds: a popped [`Job`] and the right to answer it ([`Completion`]).

use super::oneshot::Completer;
use super::{Counters, Priority};
use crate::sync::Arc;

/// A request taken by a worker. Answer it with [`Job::complete`]; dropping it unanswered
/// resolves its ticket to [`AdmissionError::Abandoned`](super::AdmissionError::Abandoned).
pub struct Job<T, R> {
    pub(super) payload: T,
    pub(super) completion: Completion<R>,
    pub(super) priority: Priority,
}

impl<T, R> Job<T, R> {
    /// The request.
    pub fn payload(&self) -> &T {
        &self.payload
    }

    /// The request, mutably.
    pub fn payload_mut(&mut self) -> &mut T {
        &mut self.payload
    }

    /// Its class.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// The worker it was routed to.
    pub fn worker(&self) -> usize {
        self.completion.worker as usize
    }

    /// True if the submitter dropped its ticket: nobody waits for the outcome, and the worker
    /// may skip the work (it should still complete or drop the job).
    pub fn is_cancelled(&self) -> bool {
        self.completion.is_cancelled()
    }

    /// Resolves the ticket with `result`.
    pub fn complete(self, result: R) {
        self.completion.complete(result);
    }

    /// Splits the job into its payload and the right to complete it, so that the payload can
    /// move into the engine's own structures while the completion waits elsewhere.
    pub fn into_parts(self) -> (T, Completion<R>) {
        (self.payload, self.completion)
    }
}

impl<T: std::fmt::Debug, R> std::fmt::Debug for Job<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("payload", &self.payload)
            .field("priority", &self.priority)
            .field("worker", &self.completion.worker)
            .finish()
    }
}

/// The right to answer one request. Dropping it unanswered resolves the ticket to
/// [`AdmissionError::Abandoned`](super::AdmissionError::Abandoned) (and counts it in [`AdmissionMetrics::abandoned`](super::AdmissionMetrics::abandoned)).
pub struct Completion<R> {
    /// `None` once completed.
    pub(super) tx: Option<Completer<R>>,
    pub(super) counters: Arc<Counters>,
    pub(super) worker: u32,
}

impl<R> Completion<R> {
    /// Resolves the ticket with `result`.
    pub fn complete(mut self, result: R) {
        if let Some(tx) = self.tx.take() {
            // Load first: a submitter that sees the result also sees the request leave
            // `in_flight` (the send's Release orders this decrement before the ticket's Acquire).
            self.counters.release_load(self.worker as usize);
            tx.send(Ok(result));
        }
    }

    /// True if the submitter dropped its ticket.
    pub fn is_cancelled(&self) -> bool {
        self.tx.as_ref().is_none_or(Completer::is_closed)
    }

    /// The worker the request was routed to.
    pub fn worker(&self) -> usize {
        self.worker as usize
    }
}

impl<R> Drop for Completion<R> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            self.counters.release_load(self.worker as usize);
            Counters::bump(&self.counters.workers[self.worker as usize].abandoned);
            drop(tx); // resolves the ticket to `Abandoned`
        }
    }
}

impl<R> std::fmt::Debug for Completion<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("worker", &self.worker)
            .field("completed", &self.tx.is_none())
            .finish()
    }
}
