//! Token streams: one sequence's per-step results, from the engine thread to the request's
//! owner, as they are generated.
//!
//! [`token_stream`] makes a connected pair: a [`StreamSender`] that the engine thread keeps
//! (usually inside a [`StreamRouter`], fed each step's [`StepResults`]) and a [`TokenStream`]
//! that the request's owner reads with [`TokenStream::try_next`], [`TokenStream::recv`] or as a
//! [`futures_core::Stream`] (runtime-agnostic: it only uses the `Waker` it is polled with). The
//! stream yields `Tokens` events (every token sent since the last event, in order) and ends with
//! exactly one `Finished(reason)`, or with an error: [`StreamError::Abandoned`] if the sender was
//! dropped without finishing, [`StreamError::Lagged`] if the consumer fell a whole buffer behind.
//! [`StreamRequest`] pairs a [`SeqRequest`] with its sender so that an
//! [`Admission<StreamRequest, R>`](super::Admission) queue set hands both to the engine.
//!
//! # Algorithm
//!
//! A single-producer single-consumer bounded ring of token slots (Lamport's SPSC queue): the
//! producer alone advances `tail`, the consumer alone advances `head`; both are monotonic `u64`
//! positions (no wrap in practice, so no ABA) and slot `p % capacity` holds token `p`. The
//! slots are `AtomicU32`s written and read `Relaxed`: the Release store of `tail` publishes
//! them, the Release store of `head` hands consumed slots back. The end of the stream is one
//! `AtomicU64` written once (Release) after the last token's `tail` store; the consumer reads it
//! **before** `tail` (both Acquire), so an end it sees comes with every token sent before it.
//! The consumer's waker sits in a register/wake cell with the `REGISTERING`/`WAKING` state
//! machine of the futures crate's `AtomicWaker` (`WakerCell`). Reclamation is by `Arc`.
//!
//! # Progress and memory
//!
//! Every operation of both ends is wait-free: a bounded number of steps, no lock, no CAS loop,
//! no spinning; the engine thread never waits for the consumer. (A wake-up runs the executor's
//! `Waker`, whose own cost is the executor's: tokio's, for one, may queue the task under a lock
//! of its own. Likewise the reader's events own their tokens: building one allocates a `Vec`
//! through the global allocator, whose progress is its own; the sender never allocates.)
//! One window remains, as in the futures crate's `AtomicWaker`: a poll that must
//! register its waker while the producer sits between the two RMWs of a wake cannot store it,
//! so it wakes its own task and the executor polls it again; no thread waits, but a task can be
//! re-polled while a descheduled producer stays in that window.
//!
//! Memory is bounded by the capacity fixed at creation (4 bytes per token slot).
//! [`StreamRequest::new`] sizes the ring to the request's `max_new_tokens`, the most tokens the
//! sequence can ever produce, up to [`DEFAULT_STREAM_CAPACITY`]: such a stream lags only if its
//! consumer falls that many tokens behind.
//!
//! # When the consumer lags
//!
//! A send that does not fit in the free slots is refused whole ([`SendError::Lagged`]), and
//! the stream ends there: the consumer receives every token of the sends that succeeded, then
//! [`StreamError::Lagged`]. No token is dropped silently and none is delivered out of order; the
//! engine is expected to abort the sequence ([`StreamRouter::dispatch`] reports it).
//!
//! # Cancel on drop
//!
//! Dropping the [`TokenStream`] sets a flag that [`StreamSender::is_closed`] reads; later sends
//! are refused [`SendError::Closed`] and write nothing. The drop also frees the reader's
//! waker (unless a wake holds the cell, which then frees it), rather than leaving it to the
//! sender's drop. [`StreamRouter::closed_into`] lists
//! such sequences so the engine can abort them and free their pages.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::sched::sequence::{FinishReason, SeqId, SeqRequest, StepResults};
use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering, UnsafeCell};

/// Largest stream capacity, in tokens (64 MiB of slots): past any context length in use.
pub const MAX_STREAM_CAPACITY: usize = 1 << 24;

/// The most slots [`StreamRequest::new`] gives a stream (256 KiB): a request's
/// `max_new_tokens` is the client's number, and a ring sized to it alone would let each queued
/// request hold up to [`MAX_STREAM_CAPACITY`] slots before the engine's context check could
/// refuse it. A consumer that falls this far behind ends its stream with `Lagged`.
pub const DEFAULT_STREAM_CAPACITY: usize = 1 << 16;

/// What a [`TokenStream`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// Tokens generated since the previous event, in generation order (never empty).
    Tokens(Vec<u32>),
    /// The sequence ended; the last event of the stream.
    Finished(FinishReason),
}

/// Why a stream could not be made, or ended without [`StreamEvent::Finished`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The sender was dropped before finishing the stream (the engine dropped the request).
    #[error("the token stream's sender was dropped before the sequence finished")]
    Abandoned,
    /// The consumer fell `capacity` tokens behind; the tokens received before this are exactly
    /// those of the sends that succeeded.
    #[error("the consumer fell {capacity} tokens behind; the stream was cut")]
    Lagged {
        /// The stream's capacity, in tokens.
        capacity: usize,
    },
    /// A stream's capacity must be 1 to [`MAX_STREAM_CAPACITY`] tokens.
    #[error("invalid token stream capacity {0}: must be 1 to 2^24 tokens")]
    InvalidCapacity(usize),
}

/// Why [`StreamSender::send`] or [`StreamSender::finish`] did not deliver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The [`TokenStream`] was dropped: nobody reads the tokens (abort the sequence).
    #[error("the token stream was dropped by its reader")]
    Closed,
    /// The tokens did not fit: the stream ended with [`StreamError::Lagged`] (abort the
    /// sequence).
    #[error("the token stream's reader lagged a whole buffer behind; the stream was cut")]
    Lagged,
    /// The stream had already ended (it lagged before).
    #[error("the token stream already ended")]
    Ended,
}

/// `Shared::end` encodings; 0 means "not ended". `Caller(code)` keeps the code in the high half.
const END_EOS: u64 = 1;
const END_MAX_TOKENS: u64 = 2;
const END_STOP_SEQUENCE: u64 = 3;
const END_ABORTED: u64 = 4;
const END_CALLER: u64 = 5;
const END_ABANDONED: u64 = 6;
const END_LAGGED: u64 = 7;
const END_TOO_LONG: u64 = 8;

fn encode(reason: FinishReason) -> u64 {
    match reason {
        FinishReason::Eos => END_EOS,
        FinishReason::MaxTokens => END_MAX_TOKENS,
        FinishReason::StopSequence => END_STOP_SEQUENCE,
        FinishReason::Aborted => END_ABORTED,
        FinishReason::Caller(code) => END_CALLER | (u64::from(code) << 32),
        FinishReason::TooLong => END_TOO_LONG,
    }
}

/// The event for a non-zero `end` word.
fn decode(end: u64, capacity: usize) -> Result<StreamEvent, StreamError> {
    let reason = match end & 0xffff_ffff {
        END_EOS => FinishReason::Eos,
        END_MAX_TOKENS => FinishReason::MaxTokens,
        END_STOP_SEQUENCE => FinishReason::StopSequence,
        END_ABORTED => FinishReason::Aborted,
        END_CALLER => FinishReason::Caller((end >> 32) as u32),
        END_TOO_LONG => FinishReason::TooLong,
        END_LAGGED => return Err(StreamError::Lagged { capacity }),
        // `END_ABANDONED`, and nothing else is ever stored.
        _ => return Err(StreamError::Abandoned),
    };
    Ok(StreamEvent::Finished(reason))
}

/// The consumer's waker, with the register/wake protocol of the futures crate's `AtomicWaker`.
/// `state` is `WAITING` (the cell is free), or has `REGISTERING` (the consumer is writing the
/// cell) and/or `WAKING` (the producer is taking from it); a side holding its bit owns the cell.
struct WakerCell {
    state: AtomicUsize,
    /// Owned by whichever side moved `state` from `WAITING` to its own bit.
    waker: UnsafeCell<Option<Waker>>,
}

const WAITING: usize = 0;
const REGISTERING: usize = 0b01;
const WAKING: usize = 0b10;

impl WakerCell {
    fn new() -> Self {
        Self {
            state: AtomicUsize::new(WAITING),
            waker: UnsafeCell::new(None),
        }
    }

    /// Consumer only. Stores `waker` for the next [`wake`](Self::wake). If a wake runs
    /// meanwhile, `waker` is woken at once (the caller re-checks for data anyway).
    fn register(&self, waker: &Waker) {
        // Acquire: if the producer's last `wake` released the cell (`fetch_and` below, Release),
        // we see its take and every write before its wake (the tokens it published).
        match self.state.compare_exchange(
            WAITING,
            REGISTERING,
            Ordering::Acquire,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                // SAFETY: we moved `state` from WAITING to REGISTERING, so we own the cell: a
                // `wake` that runs now sees REGISTERING at its `fetch_or` and keeps off it; and
                // there is one consumer, so no other `register` runs.
                self.waker.with_mut(|w| unsafe {
                    if !(*w).as_ref().is_some_and(|old| old.will_wake(waker)) {
                        *w = Some(waker.clone());
                    }
                });
                // AcqRel: Release publishes the waker to the producer's Acquire `fetch_or`;
                // Acquire (on failure too) makes a racing producer's tokens visible.
                if self
                    .state
                    .compare_exchange(REGISTERING, WAITING, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    // A wake ran while we wrote (state is REGISTERING | WAKING) and left the
                    // cell to us: take the waker back and wake it ourselves.
                    // SAFETY: we still hold REGISTERING, and the producer saw it and backed off.
                    let w = self.waker.with_mut(|w| unsafe { (*w).take() });
                    // AcqRel: Release hands the emptied cell back to the next `wake`.
                    self.state.swap(WAITING, Ordering::AcqRel);
                    if let Some(w) = w {
                        w.wake();
                    }
                }
            }
            // The producer is taking the previous waker; it may miss this one, so wake now.
            Err(_) => waker.wake_by_ref(),
        }
    }

    /// Consumer only, from its drop: frees the stored waker now instead of with the shared
    /// block (the sender can outlive the reader by a whole queue wait or until the engine's
    /// abort lands, and a runtime's waker keeps the ended reader task's memory alive).
    fn clear(&self) {
        // Acquire: as in `register` (we see a finished wake's take).
        if self
            .state
            .compare_exchange(WAITING, REGISTERING, Ordering::Acquire, Ordering::Acquire)
            .is_err()
        {
            // The producer holds the cell (WAKING): it takes the waker itself and wakes it,
            // which a dropped reader's executor ignores.
            return;
        }
        // SAFETY: we moved `state` from WAITING to REGISTERING, so we own the cell, as in
        // `register`: a `wake` running now sees REGISTERING and keeps off it.
        let w = self.waker.with_mut(|w| unsafe { (*w).take() });
        // AcqRel: Release hands the emptied cell back to the next `wake` (Acquire `fetch_or`);
        // a wake that came meanwhile (REGISTERING | WAKING) left the cell to us and wakes
        // nobody, which is right: nobody reads any more.
        self.state.swap(WAITING, Ordering::AcqRel);
        drop(w);
    }

    /// Producer only. Wakes the registered waker, if any.
    fn wake(&self) {
        // AcqRel: Acquire pairs with the consumer's Release that stored the waker; Release
        // orders our prior token and end stores before a consumer that fails its CAS on WAKING.
        if self.state.fetch_or(WAKING, Ordering::AcqRel) != WAITING {
            // The consumer is registering: it sees WAKING when it finishes and wakes itself.
            return;
        }
        // SAFETY: we moved `state` from WAITING to WAKING, so we own the cell: the consumer's
        // `register` fails its CAS and keeps off it until our `fetch_and` below.
        let w = self.waker.with_mut(|w| unsafe { (*w).take() });
        // Release: the next `register` (Acquire CAS) sees the cell emptied.
        self.state.fetch_and(!WAKING, Ordering::Release);
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// The block both ends share.
struct Shared {
    /// Token `p` lives in `slots[p % capacity]` while `head <= p < tail`.
    slots: Box<[AtomicU32]>,
    /// Tokens sent so far. Written (Release) only by the producer, after the slots.
    tail: AtomicU64,
    /// Tokens taken so far. Written (Release) only by the consumer, after reading the slots;
    /// `tail - head <= capacity` always.
    head: AtomicU64,
    /// 0 while the stream is open; else the end (`END_*`), written once by the producer
    /// (Release) after its last `tail` store.
    end: AtomicU64,
    /// Set when the consumer is dropped.
    rx_closed: AtomicBool,
    waker: WakerCell,
}

impl Shared {
    fn capacity(&self) -> usize {
        self.slots.len()
    }
}

/// A connected pair: the engine keeps the [`StreamSender`], the request's owner reads the
/// [`TokenStream`]. Refused if `capacity` is 0 or above [`MAX_STREAM_CAPACITY`].
///
/// - **Order and completeness**: the reader gets every token of every send that returned
///   `Ok`, in order (as `Tokens` events that may merge several sends), then exactly one end:
///   `Finished(reason)`, [`StreamError::Abandoned`] if the sender was dropped unfinished, or
///   [`StreamError::Lagged`]; then `None`.
/// - **Memory and lag**: the ring holds `capacity` tokens (4 bytes each, allocated here). A send
///   that does not fit in what the reader has not yet taken is refused whole
///   ([`SendError::Lagged`]) and ends the stream `Lagged` after the tokens already sent; no
///   token is dropped silently. A capacity of at least the request's `max_new_tokens` never
///   lags; [`StreamRequest::new`] gives that only up to [`DEFAULT_STREAM_CAPACITY`] (past it,
///   a reader that falls that many tokens behind gets `Lagged`).
/// - **Cancel on drop**: dropping the reader makes [`StreamSender::is_closed`] true and later
///   sends fail [`SendError::Closed`] without writing; the engine aborts the sequence.
/// - **Progress**: both ends are wait-free and the sender never waits for the reader (the
///   module source documents the one re-poll window of the waker cell).
pub fn token_stream(capacity: usize) -> Result<(StreamSender, TokenStream), StreamError> {
    if capacity == 0 || capacity > MAX_STREAM_CAPACITY {
        return Err(StreamError::InvalidCapacity(capacity));
    }
    let shared = Arc::new(Shared {
        slots: (0..capacity).map(|_| AtomicU32::new(0)).collect(),
        tail: AtomicU64::new(0),
        head: AtomicU64::new(0),
        end: AtomicU64::new(0),
        rx_closed: AtomicBool::new(false),
        waker: WakerCell::new(),
    });
    Ok((
        StreamSender {
            shared: shared.clone(),
            tail: 0,
            ended: false,
        },
        TokenStream {
            shared,
            head: 0,
            done: false,
        },
    ))
}

/// The engine's end of a token stream. Dropping it without [`finish`](Self::finish) ends the
/// stream with [`StreamError::Abandoned`].
pub struct StreamSender {
    shared: Arc<Shared>,
    /// Our copy of `shared.tail` (we are its only writer).
    tail: u64,
    /// `end` was written.
    ended: bool,
}

impl StreamSender {
    /// Sends `tokens` (one step's tokens of the sequence), all or none, without waiting.
    /// Refused if the reader was dropped (`Closed`, nothing written), if they do not fit
    /// (`Lagged`: the stream ends after the tokens already sent), or after the stream ended.
    pub fn send(&mut self, tokens: &[u32]) -> Result<(), SendError> {
        if self.ended {
            return Err(SendError::Ended);
        }
        if self.is_closed() {
            return Err(SendError::Closed);
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let s = &*self.shared;
        let cap = s.capacity() as u64;
        // Acquire: pairs with the consumer's Release `head` store, so its reads of the slots we
        // are about to reuse happened before our writes.
        let head = s.head.load(Ordering::Acquire);
        if self.tail - head + tokens.len() as u64 > cap {
            self.end(END_LAGGED);
            return Err(SendError::Lagged);
        }
        for (p, &t) in (self.tail..).zip(tokens) {
            // Relaxed: published by the Release `tail` store below.
            s.slots[(p % cap) as usize].store(t, Ordering::Relaxed);
        }
        self.tail += tokens.len() as u64;
        // Release: publishes the slot writes to the consumer's Acquire `tail` load.
        s.tail.store(self.tail, Ordering::Release);
        s.waker.wake();
        Ok(())
    }

    /// Ends the stream with `reason`, after every token sent. Reports `Closed` if the reader
    /// had been dropped before (nobody will see the end), `Ended` if the stream had already
    /// ended.
    pub fn finish(mut self, reason: FinishReason) -> Result<(), SendError> {
        if self.ended {
            return Err(SendError::Ended);
        }
        // Checked before the end is stored: a reader that sees the end and then goes away
        // must not turn a delivered end into `Closed`.
        let closed = self.is_closed();
        self.end(encode(reason));
        if closed {
            return Err(SendError::Closed);
        }
        Ok(())
    }

    /// True once the [`TokenStream`] was dropped: nobody reads this sequence's tokens, and the
    /// engine may abort it.
    pub fn is_closed(&self) -> bool {
        // Relaxed: advisory; no data is read on the strength of it.
        self.shared.rx_closed.load(Ordering::Relaxed)
    }

    /// True once the stream ended (finished, or cut for lag).
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// The stream's capacity, in tokens.
    pub fn capacity(&self) -> usize {
        self.shared.capacity()
    }

    fn end(&mut self, code: u64) {
        self.ended = true;
        // Release: the consumer's Acquire load of `end` (which precedes its `tail` load) then
        // sees every `tail` store we made before this one.
        self.shared.end.store(code, Ordering::Release);
        self.shared.waker.wake();
    }
}

impl Drop for StreamSender {
    fn drop(&mut self) {
        if !self.ended {
            self.end(END_ABANDONED);
        }
    }
}

impl std::fmt::Debug for StreamSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSender")
            .field("sent", &self.tail)
            .field("capacity", &self.capacity())
            .field("ended", &self.ended)
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// The request owner's end of a token stream: `Tokens` events, then one `Finished` (or an
/// error), then nothing. Dropping it tells the engine to abort the sequence.
pub struct TokenStream {
    shared: Arc<Shared>,
    /// Our copy of `shared.head` (we are its only writer).
    head: u64,
    /// The last item (end or error) was returned.
    done: bool,
}

impl TokenStream {
    /// The next item without waiting: `Pending` if nothing arrived yet, `Ready(None)` after
    /// the stream's last item. The same as polling the stream, minus the waker.
    pub fn try_next(&mut self) -> Poll<Option<Result<StreamEvent, StreamError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let s = &*self.shared;
        // Acquire, and before `tail`: an end we see was stored after the last `tail` store
        // (Release), so the `tail` load below returns the final count. Reading `tail` first
        // could deliver the end ahead of the last tokens.
        let end = s.end.load(Ordering::Acquire);
        // Acquire: pairs with the producer's Release `tail` store (the slots are visible).
        let tail = s.tail.load(Ordering::Acquire);
        if tail != self.head {
            let cap = s.capacity() as u64;
            let tokens = (self.head..tail)
                // Relaxed: the Acquire load of `tail` made these writes visible.
                .map(|p| s.slots[(p % cap) as usize].load(Ordering::Relaxed))
                .collect();
            self.head = tail;
            // Release: our slot reads happen before the producer's reuse of the slots (its
            // Acquire `head` load).
            s.head.store(tail, Ordering::Release);
            return Poll::Ready(Some(Ok(StreamEvent::Tokens(tokens))));
        }
        if end != 0 {
            self.done = true;
            return Poll::Ready(Some(decode(end, s.capacity())));
        }
        Poll::Pending
    }

    /// Polls for the next item, registering `cx`'s waker if there is none yet.
    pub fn poll_recv(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<StreamEvent, StreamError>>> {
        if let Poll::Ready(item) = self.try_next() {
            return Poll::Ready(item);
        }
        // Register, then look again: a send that landed before the registration is seen by
        // the second look; one after it wakes the registered waker.
        self.shared.waker.register(cx.waker());
        self.try_next()
    }

    /// The next item, as a future (for callers without a `StreamExt`).
    pub fn recv(&mut self) -> Recv<'_> {
        Recv { stream: self }
    }

    /// True once the stream returned its last item.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

impl futures_core::Stream for TokenStream {
    type Item = Result<StreamEvent, StreamError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_recv(cx)
    }
}

impl futures_core::FusedStream for TokenStream {
    fn is_terminated(&self) -> bool {
        self.done
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        // Relaxed: advisory flag for `StreamSender::is_closed`; the Arc handles reclamation.
        self.shared.rx_closed.store(true, Ordering::Relaxed);
        self.shared.waker.clear();
    }
}

impl std::fmt::Debug for TokenStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStream")
            .field("taken", &self.head)
            .field("done", &self.done)
            .finish()
    }
}

/// The future of [`TokenStream::recv`].
#[must_use = "futures do nothing unless polled"]
#[derive(Debug)]
pub struct Recv<'a> {
    stream: &'a mut TokenStream,
}

impl Future for Recv<'_> {
    type Output = Option<Result<StreamEvent, StreamError>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().stream.poll_recv(cx)
    }
}

// SAFETY (auto traits): `Shared` holds an `UnsafeCell<Option<Waker>>`; `WakerCell`'s state bits
// give that cell one owner at a time (module docs), and `Waker` is `Send + Sync`. Everything
// else in `Shared` is atomic.
// SAFETY: see above.
unsafe impl Send for Shared {}
// SAFETY: see above.
unsafe impl Sync for Shared {}

/// A generation request with the sending end of its token stream: the payload of an
/// [`Admission<StreamRequest, R>`](super::Admission) queue set, so the worker that pops it
/// gets both.
#[derive(Debug)]
pub struct StreamRequest {
    /// The request for the engine's batcher.
    pub request: SeqRequest,
    /// Where the engine sends its tokens.
    pub tokens: StreamSender,
}

impl StreamRequest {
    /// `request` with a stream sized to its `max_new_tokens` (up to
    /// [`DEFAULT_STREAM_CAPACITY`]): it lags only if its consumer falls that far behind.
    /// [`StreamError::InvalidCapacity`] for a request of no new tokens.
    pub fn new(request: SeqRequest) -> Result<(Self, TokenStream), StreamError> {
        let capacity = (request.stop.max_new_tokens as usize).min(DEFAULT_STREAM_CAPACITY);
        Self::with_capacity(request, capacity)
    }

    /// `request` with a stream of `capacity` tokens (see the module's lag policy).
    pub fn with_capacity(
        request: SeqRequest,
        capacity: usize,
    ) -> Result<(Self, TokenStream), StreamError> {
        let (tokens, stream) = token_stream(capacity)?;
        Ok((Self { request, tokens }, stream))
    }
}

/// The engine thread's open streams, by sequence id: routes each step's [`StepResults`] to
/// them and lists the sequences to abort (reader dropped, or lagged). Single-threaded; its
/// sends are wait-free.
#[derive(Debug, Default)]
pub struct StreamRouter {
    open: HashMap<SeqId, StreamSender>,
}

impl StreamRouter {
    /// An empty router.
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes sequence `id`'s results to `tx`. Gives `tx` back if `id` already has a stream.
    pub fn insert(&mut self, id: SeqId, tx: StreamSender) -> Result<(), StreamSender> {
        match self.open.entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => Err(tx),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(tx);
                Ok(())
            }
        }
    }

    /// Sends each update's tokens to its stream and finishes the streams of sequences that
    /// ended (removing them). Appends to `abort` the sequences whose tokens could not be
    /// delivered (reader dropped, or lagged): the caller aborts them in the engine, and their
    /// streams end when the engine reports them finished. Updates of sequences without a
    /// stream are skipped.
    ///
    /// An update whose token range lies outside `results.tokens` (the engine's results never
    /// have one; results a caller builds can) has tokens nobody can deliver: its stream is cut
    /// there (dropped, so its reader gets [`StreamError::Abandoned`] after the tokens sent
    /// before, never a gap followed by more tokens or by a `Finished` that claims a complete
    /// output), and the sequence, unless the update ends it, is listed for abort.
    pub fn dispatch(&mut self, results: &StepResults, abort: &mut Vec<SeqId>) {
        for u in &results.updates {
            let Some(tx) = self.open.get_mut(&u.id) else {
                continue;
            };
            // `results` may be built by the caller (its fields are public).
            let sent = match results.tokens.get(u.tokens.clone()) {
                Some(tokens) => tx.send(tokens),
                None => {
                    // Dropping the sender ends the stream `Abandoned` (unless it had ended);
                    // later updates of the sequence find no stream and are skipped.
                    self.open.remove(&u.id);
                    if u.finished.is_none() {
                        abort.push(u.id);
                    }
                    continue;
                }
            };
            if let Some(reason) = u.finished {
                if let Some(tx) = self.open.remove(&u.id) {
                    // A lagged stream keeps its `Lagged` end; a dropped reader sees nothing.
                    let _ = tx.finish(reason);
                }
            } else if matches!(sent, Err(SendError::Closed | SendError::Lagged)) {
                abort.push(u.id);
            }
        }
    }

    /// Appends to `abort` the sequences whose readers were dropped (one relaxed load per open
    /// stream). A sequence stays listed until the engine reports it finished.
    pub fn closed_into(&self, abort: &mut Vec<SeqId>) {
        abort.extend(
            self.open
                .iter()
                .filter(|(_, tx)| tx.is_closed())
                .map(|(&id, _)| id),
        );
    }

    /// Drops sequence `id`'s stream (it ends `Abandoned`), e.g. when the engine refused it.
    pub fn remove(&mut self, id: SeqId) -> Option<StreamSender> {
        self.open.remove(&id)
    }

    /// Open streams.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// True when no stream is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}
