//! Token streams (sched::admission::stream), single-threaded: smoke tests of every end of a
//! stream, the router, and a proptest against a sequential model of the channel that checks
//! every item, every send's outcome and every wake-up.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures_core::Stream;
use pagedkv::sched::admission::{
    token_stream, SendError, StreamError, StreamEvent, StreamRequest, StreamRouter, StreamSender,
    TokenStream, DEFAULT_STREAM_CAPACITY, MAX_STREAM_CAPACITY,
};
use pagedkv::sched::{FinishReason, SeqRequest, SeqUpdate, StepResults, StopRules};
use proptest::prelude::*;

struct Count(AtomicUsize);
impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Arc<Count>, Waker) {
    let c = Arc::new(Count(AtomicUsize::new(0)));
    (c.clone(), Waker::from(c))
}

type Item = Option<Result<StreamEvent, StreamError>>;

fn tokens(t: &[u32]) -> Poll<Item> {
    Poll::Ready(Some(Ok(StreamEvent::Tokens(t.to_vec()))))
}

#[test]
fn tokens_then_one_finish_then_nothing() {
    let (mut tx, mut rx) = token_stream(8).unwrap();
    assert_eq!(rx.try_next(), Poll::Pending);
    tx.send(&[1, 2]).unwrap();
    tx.send(&[]).unwrap();
    tx.send(&[3]).unwrap();
    // Everything sent since the last item comes as one event, in order.
    assert_eq!(rx.try_next(), tokens(&[1, 2, 3]));
    tx.send(&[4, 5, 6, 7, 8, 9, 10, 11]).unwrap(); // exactly the capacity, after wrapping
    tx.finish(FinishReason::Caller(42)).unwrap();
    assert_eq!(rx.try_next(), tokens(&[4, 5, 6, 7, 8, 9, 10, 11]));
    assert_eq!(
        rx.try_next(),
        Poll::Ready(Some(Ok(StreamEvent::Finished(FinishReason::Caller(42)))))
    );
    assert!(rx.is_done());
    assert_eq!(rx.try_next(), Poll::Ready(None));
}

#[test]
fn a_dropped_sender_ends_the_stream_abandoned_after_its_tokens() {
    let (mut tx, mut rx) = token_stream(4).unwrap();
    tx.send(&[9]).unwrap();
    drop(tx);
    assert_eq!(rx.try_next(), tokens(&[9]));
    assert_eq!(
        rx.try_next(),
        Poll::Ready(Some(Err(StreamError::Abandoned)))
    );
    assert_eq!(rx.try_next(), Poll::Ready(None));
}

#[test]
fn a_dropped_reader_closes_the_sender() {
    let (mut tx, rx) = token_stream(4).unwrap();
    assert!(!tx.is_closed());
    drop(rx);
    assert!(tx.is_closed());
    assert_eq!(tx.send(&[1]), Err(SendError::Closed));
    assert_eq!(tx.finish(FinishReason::Eos), Err(SendError::Closed));
}

/// A reader polled (its task's waker registered) and then dropped: the sender lives on until
/// the engine has aborted the sequence (or, queued in an admission payload, until a worker pops
/// it), and the waker clone used to live as long, holding the ended reader task's memory. The
/// drop releases it; later sends and the end wake nobody.
#[test]
fn a_dropped_reader_releases_its_waker_at_once() {
    let (c, waker) = counting_waker();
    let (mut tx, mut rx) = token_stream(4).unwrap();
    assert_eq!(
        rx.poll_recv(&mut Context::from_waker(&waker)),
        Poll::Pending
    );
    assert_eq!(Arc::strong_count(&c), 3, "the stream holds one clone");
    drop(rx);
    assert_eq!(
        Arc::strong_count(&c),
        2,
        "waker clone held by a dropped reader"
    );
    assert_eq!(tx.send(&[1]), Err(SendError::Closed));
    assert_eq!(tx.finish(FinishReason::Eos), Err(SendError::Closed));
    assert_eq!(c.0.load(Ordering::SeqCst), 0, "nobody woken");
}

#[test]
fn a_lagging_reader_gets_the_tokens_that_fit_then_lagged() {
    let (mut tx, mut rx) = token_stream(3).unwrap();
    tx.send(&[1, 2]).unwrap();
    // Does not fit whole: refused whole, and the stream ends.
    assert_eq!(tx.send(&[3, 4]), Err(SendError::Lagged));
    assert!(tx.is_ended());
    assert_eq!(tx.send(&[5]), Err(SendError::Ended));
    assert_eq!(tx.finish(FinishReason::MaxTokens), Err(SendError::Ended));
    assert_eq!(rx.try_next(), tokens(&[1, 2]));
    assert_eq!(
        rx.try_next(),
        Poll::Ready(Some(Err(StreamError::Lagged { capacity: 3 })))
    );
    assert_eq!(rx.try_next(), Poll::Ready(None));
}

#[test]
fn capacities_out_of_range_are_refused() {
    assert_eq!(
        token_stream(0).unwrap_err(),
        StreamError::InvalidCapacity(0)
    );
    assert!(token_stream(MAX_STREAM_CAPACITY + 1).is_err());
    let req = SeqRequest {
        id: 1,
        prompt: vec![1],
        stop: StopRules::default(), // max_new_tokens 0
        priority: Default::default(),
    };
    assert!(StreamRequest::new(req).is_err());
}

#[test]
fn a_pending_poll_is_woken_by_the_next_send_and_by_the_end() {
    let (count, waker) = counting_waker();
    let mut cx = Context::from_waker(&waker);
    let (mut tx, mut rx) = token_stream(4).unwrap();
    assert!(Pin::new(&mut rx).poll_next(&mut cx).is_pending());
    tx.send(&[5]).unwrap();
    assert_eq!(count.0.load(Ordering::SeqCst), 1);
    assert_eq!(Pin::new(&mut rx).poll_next(&mut cx), tokens(&[5]));
    assert!(Pin::new(&mut rx).poll_next(&mut cx).is_pending());
    drop(tx);
    assert_eq!(count.0.load(Ordering::SeqCst), 2);
    assert_eq!(
        Pin::new(&mut rx).poll_next(&mut cx),
        Poll::Ready(Some(Err(StreamError::Abandoned)))
    );
}

fn update(id: u64, range: std::ops::Range<usize>, finished: Option<FinishReason>) -> SeqUpdate {
    SeqUpdate {
        id,
        tokens: range,
        finished,
    }
}

#[test]
fn the_router_routes_finishes_and_lists_sequences_to_abort() {
    let mut router = StreamRouter::new();
    let mut streams: Vec<TokenStream> = Vec::new();
    for id in 0..4 {
        let (tx, rx) = token_stream(if id == 3 { 1 } else { 8 }).unwrap();
        router.insert(id, tx).unwrap();
        streams.push(rx);
    }
    let (dup, _) = token_stream(1).unwrap();
    assert!(router.insert(2, dup).is_err(), "one stream per sequence");
    // Sequence 1's reader goes away.
    drop(streams.remove(1));
    let mut abort = Vec::new();
    router.closed_into(&mut abort);
    assert_eq!(abort, vec![1]);
    abort.clear();
    let results = StepResults {
        updates: vec![
            update(0, 0..2, None),
            update(1, 2..3, None),
            update(2, 3..4, Some(FinishReason::Eos)),
            update(3, 4..6, None), // two tokens into a one-token stream: lagged
            update(77, 6..7, None), // no stream: skipped
        ],
        tokens: vec![10, 11, 20, 30, 40, 41, 99],
    };
    router.dispatch(&results, &mut abort);
    assert_eq!(abort, vec![1, 3]);
    assert_eq!(router.len(), 3, "sequence 2 finished");
    let [s0, s2, s3] = &mut streams[..] else {
        unreachable!()
    };
    assert_eq!(s0.try_next(), tokens(&[10, 11]));
    assert_eq!(s2.try_next(), tokens(&[30]));
    assert_eq!(
        s2.try_next(),
        Poll::Ready(Some(Ok(StreamEvent::Finished(FinishReason::Eos))))
    );
    assert_eq!(
        s3.try_next(),
        Poll::Ready(Some(Err(StreamError::Lagged { capacity: 1 })))
    );
    // The engine aborts 1 and 3: their streams end (3 keeps its `Lagged`).
    let aborted = StepResults {
        updates: vec![
            update(1, 0..0, Some(FinishReason::Aborted)),
            update(3, 0..0, Some(FinishReason::Aborted)),
        ],
        tokens: vec![],
    };
    abort.clear();
    router.dispatch(&aborted, &mut abort);
    assert!(abort.is_empty());
    assert_eq!(s3.try_next(), Poll::Ready(None));
    assert_eq!(router.len(), 1);
    assert!(router.remove(0).is_some());
    assert_eq!(
        s0.try_next(),
        Poll::Ready(Some(Err(StreamError::Abandoned)))
    );
}

/// Every sequence whose reader went away is listed, not just the first the router finds (the
/// router test above drops one reader only, so a `find` in place of the `filter` passed it);
/// sequences whose readers live are not listed.
#[test]
fn closed_into_lists_every_dropped_reader() {
    let mut router = StreamRouter::new();
    let mut readers = Vec::new();
    for id in 0..5 {
        let (tx, rx) = token_stream(4).unwrap();
        router.insert(id, tx).unwrap();
        readers.push(Some(rx));
    }
    for id in [0, 2, 3] {
        readers[id] = None;
    }
    let mut abort = vec![99];
    router.closed_into(&mut abort);
    abort[1..].sort_unstable();
    assert_eq!(
        abort,
        vec![99, 0, 2, 3],
        "appended, every dropped reader once"
    );
}

// ---- proptest against a sequential model ----

#[derive(Debug, Clone)]
enum Op {
    Send(Vec<u32>),
    Finish(u8),
    DropSender,
    /// Poll with the counting waker.
    Poll,
    DropReader,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop::collection::vec(any::<u32>(), 0..5).prop_map(Op::Send),
        1 => (0u8..5).prop_map(Op::Finish),
        1 => Just(Op::DropSender),
        4 => Just(Op::Poll),
        1 => Just(Op::DropReader),
    ]
}

fn reason(r: u8) -> FinishReason {
    match r {
        0 => FinishReason::Eos,
        1 => FinishReason::MaxTokens,
        2 => FinishReason::StopSequence,
        3 => FinishReason::Aborted,
        _ => FinishReason::Caller(u32::from(r) * 1000 + 7),
    }
}

/// The channel as a sequential model.
#[derive(Default)]
struct Model {
    pending: VecDeque<u32>,
    end: Option<Result<StreamEvent, StreamError>>,
    done: bool,
    reader_gone: bool,
    /// A waker is registered (the last poll was pending) and not yet woken.
    armed: bool,
    wakes: usize,
}

impl Model {
    fn wake(&mut self) {
        if std::mem::take(&mut self.armed) {
            self.wakes += 1;
        }
    }

    fn send(&mut self, t: &[u32], cap: usize) -> Result<(), SendError> {
        if self.end.is_some() {
            return Err(SendError::Ended);
        }
        if self.reader_gone {
            return Err(SendError::Closed);
        }
        if t.is_empty() {
            return Ok(());
        }
        if self.pending.len() + t.len() > cap {
            self.end = Some(Err(StreamError::Lagged { capacity: cap }));
            self.wake();
            return Err(SendError::Lagged);
        }
        self.pending.extend(t);
        self.wake();
        Ok(())
    }

    fn end(&mut self, e: Result<StreamEvent, StreamError>) {
        self.end = Some(e);
        self.wake();
    }

    fn poll(&mut self) -> Poll<Item> {
        if self.done {
            return Poll::Ready(None);
        }
        if !self.pending.is_empty() {
            return Poll::Ready(Some(Ok(StreamEvent::Tokens(
                self.pending.drain(..).collect(),
            ))));
        }
        if let Some(e) = self.end.clone() {
            self.done = true;
            return Poll::Ready(Some(e));
        }
        self.armed = true;
        Poll::Pending
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_stream_matches_its_model(cap in 1usize..7, ops in prop::collection::vec(op(), 1..60)) {
        let (count, waker) = counting_waker();
        let (tx, rx) = token_stream(cap).unwrap();
        let (mut tx, mut rx): (Option<StreamSender>, Option<TokenStream>) = (Some(tx), Some(rx));
        let mut m = Model::default();
        let mut got = Vec::new();
        let mut accepted = Vec::new();
        for op in ops {
            match op {
                Op::Send(t) => {
                    if let Some(tx) = tx.as_mut() {
                        let r = tx.send(&t);
                        prop_assert_eq!(r, m.send(&t, cap));
                        if r.is_ok() {
                            accepted.extend(t);
                        }
                    }
                }
                Op::Finish(r) => {
                    if let Some(tx) = tx.take() {
                        let want = if m.end.is_some() {
                            Err(SendError::Ended)
                        } else {
                            m.end(Ok(StreamEvent::Finished(reason(r))));
                            if m.reader_gone { Err(SendError::Closed) } else { Ok(()) }
                        };
                        prop_assert_eq!(tx.finish(reason(r)), want);
                    }
                }
                Op::DropSender => {
                    if tx.take().is_some() && m.end.is_none() {
                        m.end(Err(StreamError::Abandoned));
                    }
                }
                Op::Poll => {
                    if let Some(rx) = rx.as_mut() {
                        let mut cx = Context::from_waker(&waker);
                        let item = Pin::new(&mut *rx).poll_next(&mut cx);
                        if let Poll::Ready(Some(Ok(StreamEvent::Tokens(t)))) = &item {
                            prop_assert!(!t.is_empty());
                            got.extend(t);
                        }
                        prop_assert_eq!(item, m.poll());
                    }
                }
                Op::DropReader => {
                    if rx.take().is_some() {
                        m.reader_gone = true;
                        // The drop frees its registered waker: nothing wakes it any more.
                        m.armed = false;
                    }
                }
            }
            prop_assert_eq!(count.0.load(Ordering::SeqCst), m.wakes, "wake-ups");
            if let Some(tx) = &tx {
                prop_assert_eq!(tx.is_closed(), m.reader_gone);
            }
        }
        // What the reader got is a prefix of what was accepted, in order; after its last item,
        // all of it.
        prop_assert!(accepted.starts_with(&got));
        if m.done {
            prop_assert_eq!(got, accepted);
        }
    }
}

/// A client's `max_new_tokens` does not size the stream past DEFAULT_STREAM_CAPACITY (it used
/// to: 64 MiB per queued request, before the engine's context check could refuse it). Such a
/// stream lags once its consumer is that many tokens behind.
#[test]
fn a_huge_max_new_tokens_gets_the_default_capacity() {
    let req = SeqRequest {
        id: 1,
        prompt: vec![1],
        stop: StopRules {
            max_new_tokens: MAX_STREAM_CAPACITY as u32,
            ..StopRules::default()
        },
        priority: Default::default(),
    };
    let (mut sr, _rx) = StreamRequest::new(req).unwrap();
    let chunk = vec![7u32; 4096];
    for _ in 0..DEFAULT_STREAM_CAPACITY / chunk.len() {
        sr.tokens.send(&chunk).unwrap();
    }
    assert!(
        sr.tokens.send(&[7]).is_err(),
        "the ring holds the default capacity"
    );
}

/// An update whose token range lies outside the results' tokens (results are plain public data
/// a caller can build) delivers nothing, cuts its stream (`Abandoned`) and its sequence is
/// listed for abort; dispatch used to panic on the slice. (Found by
/// fuzz/fuzz_targets/stream_ops.rs.)
#[test]
fn dispatch_of_an_update_past_the_tokens_aborts_it() {
    let (tx, mut rx) = token_stream(8).unwrap();
    let mut router = StreamRouter::new();
    router.insert(7, tx).unwrap();
    let results = StepResults {
        updates: vec![SeqUpdate {
            id: 7,
            tokens: 0..3,
            finished: None,
        }],
        tokens: vec![42], // the update names three tokens; there is one
    };
    let mut abort = Vec::new();
    router.dispatch(&results, &mut abort);
    assert_eq!(abort, vec![7]);
    assert!(router.is_empty(), "the stream was cut");
    assert_eq!(
        rx.try_next(),
        Poll::Ready(Some(Err(StreamError::Abandoned)))
    );
    // The engine's later report of the sequence finds no stream: skipped.
    let ok = StepResults {
        updates: vec![SeqUpdate {
            id: 7,
            tokens: 0..1,
            finished: Some(FinishReason::Eos),
        }],
        tokens: vec![42],
    };
    router.dispatch(&ok, &mut abort);
    assert_eq!(abort, vec![7]);
    assert_eq!(rx.try_next(), Poll::Ready(None));
}

/// A finishing update whose token range lies outside the results' tokens: its tokens cannot be
/// delivered, so the reader must not be told the output is complete (`Finished`) with them
/// missing. And a sequence whose update's tokens were lost must not go on to deliver later
/// tokens (a silent gap in the middle of its output) or a `Finished` end: its stream is cut.
#[test]
fn undeliverable_tokens_cut_the_stream_instead_of_leaving_a_gap() {
    // Finished in the bad update itself.
    let (tx, mut rx) = token_stream(8).unwrap();
    let mut router = StreamRouter::new();
    router.insert(7, tx).unwrap();
    let bad_end = StepResults {
        updates: vec![update(7, 0..3, Some(FinishReason::Eos))],
        tokens: vec![42],
    };
    let mut abort = Vec::new();
    router.dispatch(&bad_end, &mut abort);
    assert!(abort.is_empty(), "the sequence already ended");
    assert!(router.is_empty());
    assert_eq!(
        rx.try_next(),
        Poll::Ready(Some(Err(StreamError::Abandoned))),
        "three tokens were lost: the end must not say the output is complete"
    );
    // Lost in one step, a later step (the caller did not abort in time) finishes it.
    let (tx, mut rx) = token_stream(8).unwrap();
    router.insert(8, tx).unwrap();
    let first = StepResults {
        updates: vec![update(8, 0..1, None)],
        tokens: vec![1],
    };
    router.dispatch(&first, &mut abort);
    let bad = StepResults {
        updates: vec![update(8, 0..3, None)],
        tokens: vec![2],
    };
    router.dispatch(&bad, &mut abort);
    assert_eq!(abort, vec![8]);
    let later = StepResults {
        updates: vec![update(8, 0..1, Some(FinishReason::Eos))],
        tokens: vec![5],
    };
    router.dispatch(&later, &mut abort);
    let mut items = Vec::new();
    while let Poll::Ready(Some(item)) = rx.try_next() {
        items.push(item);
    }
    assert_eq!(
        items,
        vec![
            Ok(StreamEvent::Tokens(vec![1])),
            Err(StreamError::Abandoned)
        ],
        "the tokens after the lost ones must not be delivered as if nothing was missing"
    );
}
