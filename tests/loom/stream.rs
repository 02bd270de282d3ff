//! loom models: token streams (see tests/loom.rs).
//!
//! - sends and the end racing the reader's polls and waker registrations: every token arrives,
//!   in order, before exactly one end (a lost wake-up leaves the reader parked forever, which
//!   loom reports as a deadlock; an end read ahead of the last `tail` loses tokens, which the
//!   assertions catch);
//! - a one-slot ring whose second send races the read that frees the slot: the send's outcome
//!   and the reader's items agree (both tokens then `Finished`, or the first then `Lagged`);
//! - the reader's drop racing sends: once a send is refused `Closed` every later one is, and the
//!   shared block is freed (loom's `Arc` checks leaks);
//! - the reader's drop after a poll racing sends: its waker is freed by the drop or by the
//!   wake holding the cell, though the sender lives on;
//! - a dropped sender wakes a waiting reader, which gets the tokens then `Abandoned`;
//! - a reader that re-polls with a new waker is woken through the new one.
//!
//! Readers run on a thread of their own and the main thread only joins: a wake-up that lands
//! after the reader found its data would otherwise unpark a thread blocked in `join`, which
//! loom 0.7 does not support (it fails `Notify::wait`'s assertion).
//!
//! Not modelled: loom explores executions in program order, so it cannot produce load
//! buffering; a `Relaxed` `head` store (the slot hand-back) would not fail here. The one-slot
//! model still checks the values read from reused slots.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use loom::thread;

use pagedkv::sched::admission::{token_stream, SendError, StreamError, StreamEvent, TokenStream};
use pagedkv::sched::FinishReason;

/// A waker that notes the wake-up and unparks this loom thread. The note lets the reader tell a
/// wake-up that came while it was running (its own, when a poll raced the sender's wake) from
/// none: loom's `yield_now` forgets a pending unpark, so the reader yields only when woken.
struct Unpark {
    thread: thread::Thread,
    /// A plain std atomic: bookkeeping of the test's executor, not part of the model.
    woken: AtomicBool,
}

impl Wake for Unpark {
    fn wake(self: std::sync::Arc<Self>) {
        self.woken.store(true, Ordering::Relaxed);
        self.thread.unpark();
    }
}

/// Reads `rx` to its end, parking while it is pending; returns the tokens and the last item.
fn drain(rx: &mut TokenStream) -> (Vec<u32>, Result<StreamEvent, StreamError>) {
    let unpark = std::sync::Arc::new(Unpark {
        thread: thread::current(),
        woken: AtomicBool::new(false),
    });
    let waker = Waker::from(unpark.clone());
    let mut tokens = Vec::new();
    loop {
        let mut next = rx.recv();
        match Pin::new(&mut next).poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(Some(Ok(StreamEvent::Tokens(t)))) => {
                assert!(!t.is_empty());
                tokens.extend(t);
            }
            Poll::Ready(Some(end)) => {
                assert_eq!(rx.try_next(), Poll::Ready(None), "one end, then nothing");
                return (tokens, end);
            }
            Poll::Ready(None) => panic!("the stream ended without an end item"),
            Poll::Pending => {
                if unpark.woken.swap(false, Ordering::Relaxed) {
                    // Woken during the poll (a poll that raced the sender's wake wakes
                    // itself): like an executor, run others first, then poll again.
                    thread::yield_now();
                } else {
                    // Not woken yet: a lost wake-up leaves every thread blocked, which loom
                    // reports as a deadlock.
                    thread::park();
                    unpark.woken.store(false, Ordering::Relaxed);
                }
            }
        }
    }
}

#[test]
fn sends_and_finish_racing_polls_deliver_everything_in_order() {
    crate::model(|| {
        let (mut tx, mut rx) = token_stream(3).unwrap();
        let sender = thread::spawn(move || {
            tx.send(&[1]).unwrap();
            tx.send(&[2, 3]).unwrap();
            tx.finish(FinishReason::Caller(9)).unwrap();
        });
        let reader = thread::spawn(move || drain(&mut rx));
        sender.join().unwrap();
        let (tokens, end) = reader.join().unwrap();
        assert_eq!(tokens, [1, 2, 3]);
        assert_eq!(end, Ok(StreamEvent::Finished(FinishReason::Caller(9))));
    });
}

#[test]
fn a_send_racing_the_read_that_frees_its_slot() {
    crate::model(|| {
        let (mut tx, mut rx) = token_stream(1).unwrap();
        let sender = thread::spawn(move || {
            tx.send(&[1]).unwrap();
            let second = tx.send(&[2]);
            if second.is_ok() {
                tx.finish(FinishReason::Eos).unwrap();
            }
            second
        });
        let reader = thread::spawn(move || drain(&mut rx));
        let second = sender.join().unwrap();
        let (tokens, end) = reader.join().unwrap();
        match second {
            Ok(()) => {
                assert_eq!(tokens, [1, 2]);
                assert_eq!(end, Ok(StreamEvent::Finished(FinishReason::Eos)));
            }
            Err(e) => {
                assert_eq!(e, SendError::Lagged);
                assert_eq!(tokens, [1]);
                assert_eq!(end, Err(StreamError::Lagged { capacity: 1 }));
            }
        }
    });
}

#[test]
fn the_readers_drop_racing_sends() {
    crate::model(|| {
        let (mut tx, mut rx) = token_stream(2).unwrap();
        let sender = thread::spawn(move || {
            let a = tx.send(&[1]);
            let b = tx.send(&[2]);
            let closed = tx.is_closed();
            (a, b, closed, tx.finish(FinishReason::MaxTokens))
        });
        let first = rx.try_next();
        drop(rx);
        let (a, b, closed, fin) = sender.join().unwrap();
        if a == Err(SendError::Closed) {
            assert_eq!(b, Err(SendError::Closed), "closed stays closed");
        }
        assert!(a.is_ok() || a == Err(SendError::Closed));
        assert!(b.is_ok() || b == Err(SendError::Closed));
        if closed {
            assert_eq!(fin, Err(SendError::Closed));
        }
        // Whatever the reader saw before dropping is a prefix of the accepted tokens.
        match first {
            Poll::Ready(Some(Ok(StreamEvent::Tokens(t)))) => {
                assert!(a.is_ok());
                assert!(t == [1] || (t == [1, 2] && b.is_ok()));
            }
            Poll::Pending => {}
            other => panic!("unexpected {other:?}"),
        }
    });
}

/// The reader registers a waker, then is dropped while the sender sends: the drop frees the
/// waker unless a wake holds the cell, which then frees it; once the sender's sends are done the
/// waker is gone although the sender lives on (loom's cell check fails the drop's take racing
/// a wake's). Its sends are refused `Closed` from the first that sees the drop on.
#[test]
fn the_readers_drop_after_a_poll_frees_its_waker() {
    struct Nobody;
    impl Wake for Nobody {
        fn wake(self: std::sync::Arc<Self>) {}
    }
    crate::model(|| {
        let (mut tx, mut rx) = token_stream(2).unwrap();
        let sender = thread::spawn(move || {
            let a = tx.send(&[1]);
            let b = tx.send(&[2]);
            (a, b, tx)
        });
        let probe = std::sync::Arc::new(Nobody);
        let waker = Waker::from(probe.clone());
        let first = rx.poll_recv(&mut Context::from_waker(&waker));
        drop(waker);
        drop(rx);
        let (a, b, tx) = sender.join().unwrap();
        if a == Err(SendError::Closed) {
            assert_eq!(b, Err(SendError::Closed), "closed stays closed");
        }
        assert!(matches!(first, Poll::Pending | Poll::Ready(Some(Ok(_)))));
        assert_eq!(
            std::sync::Arc::strong_count(&probe),
            1,
            "the reader's waker outlived its drop"
        );
        drop(tx);
    });
}

#[test]
fn a_dropped_sender_wakes_the_reader_with_abandoned() {
    crate::model(|| {
        let (mut tx, mut rx) = token_stream(2).unwrap();
        let sender = thread::spawn(move || {
            tx.send(&[7]).unwrap();
            drop(tx);
        });
        let reader = thread::spawn(move || drain(&mut rx));
        sender.join().unwrap();
        let (tokens, end) = reader.join().unwrap();
        assert_eq!(tokens, [7]);
        assert_eq!(end, Err(StreamError::Abandoned));
    });
}

#[test]
fn a_repoll_with_a_new_waker_is_woken_through_it() {
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    crate::model(|| {
        let (mut tx, mut rx) = token_stream(2).unwrap();
        let sender = thread::spawn(move || {
            tx.send(&[4]).unwrap();
            tx.finish(FinishReason::MaxTokens).unwrap();
        });
        let reader = thread::spawn(move || {
            // A first poll with a waker that will never unpark us, then `drain` with its own:
            // if only the old waker were woken, the reader would stay parked (a deadlock).
            let old = Waker::from(std::sync::Arc::new(Count(AtomicUsize::new(0))));
            match rx.poll_recv(&mut Context::from_waker(&old)) {
                Poll::Ready(Some(Ok(StreamEvent::Tokens(t)))) => {
                    let (more, end) = drain(&mut rx);
                    (t.into_iter().chain(more).collect::<Vec<_>>(), end)
                }
                Poll::Pending => drain(&mut rx),
                other => panic!("unexpected {other:?}"),
            }
        });
        sender.join().unwrap();
        let (tokens, end) = reader.join().unwrap();
        assert_eq!(tokens, [4]);
        assert_eq!(end, Ok(StreamEvent::Finished(FinishReason::MaxTokens)));
    });
}
