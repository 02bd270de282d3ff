//! Fuzz the token streams (`token_stream`, `StreamSender`, `TokenStream`, `StreamRouter`) with
//! arbitrary operation sequences on up to four streams, checking every call against a
//! sequential model: each send's result (Ok / Closed / Lagged / Ended), each item the reader
//! gets (every accepted token once, in order, never an empty `Tokens`, then exactly one end,
//! then `None`), wake-ups of a registered waker, the router's abort lists, and the capacity
//! checks of `token_stream` and `StreamRequest::new`.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::sched::admission::{
    token_stream, SendError, StreamError, StreamEvent, StreamRequest, StreamRouter, StreamSender,
    TokenStream, DEFAULT_STREAM_CAPACITY, MAX_STREAM_CAPACITY,
};
use pagedkv::sched::{FinishReason, Priority, SeqRequest, SeqUpdate, StepResults, StopRules};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

#[derive(Debug, Arbitrary)]
struct Input {
    caps: [u8; 4],
    max_new: u32,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Send {
        s: u8,
        n: u8,
        base: u32,
    },
    Finish {
        s: u8,
        reason: u8,
        code: u32,
    },
    DropSender {
        s: u8,
    },
    TryNext {
        s: u8,
    },
    Poll {
        s: u8,
    },
    DropStream {
        s: u8,
    },
    Insert {
        s: u8,
        id: u8,
    },
    Dispatch {
        updates: Vec<(u8, u8, Option<u8>, bool)>,
    },
    ClosedInto,
    Remove {
        id: u8,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum End {
    Finished(FinishReason),
    Abandoned,
    Lagged,
}

enum Tx {
    Direct(StreamSender),
    Routed,
    Gone,
}

struct S {
    cap: usize,
    tx: Tx,
    rx: Option<TokenStream>,
    sent: Vec<u32>,
    recvd: usize,
    end: Option<End>,
    rx_done: bool,
    wakes: Arc<Counter>,
    registered: bool,
}

#[derive(Default)]
struct Counter(AtomicUsize);
impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn reason(r: u8, code: u32) -> FinishReason {
    match r % 5 {
        0 => FinishReason::Eos,
        1 => FinishReason::MaxTokens,
        2 => FinishReason::StopSequence,
        3 => FinishReason::Aborted,
        _ => FinishReason::Caller(code),
    }
}

impl S {
    /// The model of `send`: the expected result, with the model updated.
    fn model_send(&mut self, tokens: &[u32]) -> Result<(), SendError> {
        if self.end.is_some() {
            return Err(SendError::Ended);
        }
        if self.rx.is_none() {
            return Err(SendError::Closed);
        }
        if tokens.is_empty() {
            return Ok(());
        }
        if self.sent.len() - self.recvd + tokens.len() > self.cap {
            self.set_end(End::Lagged);
            return Err(SendError::Lagged);
        }
        self.sent.extend_from_slice(tokens);
        self.woken();
        Ok(())
    }

    fn model_finish(&mut self, r: FinishReason) -> Result<(), SendError> {
        if self.end.is_some() {
            return Err(SendError::Ended);
        }
        let closed = self.rx.is_none();
        self.set_end(End::Finished(r));
        if closed {
            Err(SendError::Closed)
        } else {
            Ok(())
        }
    }

    fn set_end(&mut self, e: End) {
        assert!(self.end.is_none());
        self.end = Some(e);
        self.woken();
    }

    /// A registered waker is woken (once, then taken) by the next publish.
    fn woken(&mut self) {
        if self.registered {
            assert!(
                self.wakes.0.load(Ordering::Relaxed) >= 1,
                "registered waker not woken"
            );
            self.wakes.0.store(0, Ordering::Relaxed);
            self.registered = false;
        }
    }

    fn check_item(&mut self, got: Poll<Option<Result<StreamEvent, StreamError>>>) {
        if self.rx_done {
            assert_eq!(got, Poll::Ready(None));
            return;
        }
        if self.recvd < self.sent.len() {
            let want = self.sent[self.recvd..].to_vec();
            self.recvd = self.sent.len();
            assert_eq!(got, Poll::Ready(Some(Ok(StreamEvent::Tokens(want)))));
            return;
        }
        let Some(end) = self.end else {
            assert_eq!(got, Poll::Pending);
            return;
        };
        self.rx_done = true;
        let want = match end {
            End::Finished(r) => Ok(StreamEvent::Finished(r)),
            End::Abandoned => Err(StreamError::Abandoned),
            End::Lagged => Err(StreamError::Lagged { capacity: self.cap }),
        };
        assert_eq!(got, Poll::Ready(Some(want)));
    }
}

fuzz_target!(|input: Input| {
    // Capacity checks without allocating a huge ring.
    assert_eq!(token_stream(0).err(), Some(StreamError::InvalidCapacity(0)));
    assert_eq!(
        token_stream(MAX_STREAM_CAPACITY + 1).err(),
        Some(StreamError::InvalidCapacity(MAX_STREAM_CAPACITY + 1))
    );
    let req = SeqRequest {
        id: 1,
        prompt: vec![1],
        stop: StopRules {
            max_new_tokens: input.max_new,
            eos: vec![],
            stop_sequences: vec![],
        },
        priority: Priority::Throughput,
    };
    match StreamRequest::new(req) {
        Ok((r, s)) => {
            assert!(input.max_new > 0);
            assert_eq!(
                r.tokens.capacity(),
                (input.max_new as usize).min(DEFAULT_STREAM_CAPACITY)
            );
            drop(s);
        }
        Err(e) => {
            assert_eq!(input.max_new, 0);
            assert_eq!(e, StreamError::InvalidCapacity(0));
        }
    }

    let mut streams: Vec<S> = input
        .caps
        .iter()
        .map(|&c| {
            let cap = usize::from(c % 16) + 1;
            let (tx, rx) = token_stream(cap).expect("valid capacity");
            assert_eq!(tx.capacity(), cap);
            S {
                cap,
                tx: Tx::Direct(tx),
                rx: Some(rx),
                sent: Vec::new(),
                recvd: 0,
                end: None,
                rx_done: false,
                wakes: Arc::new(Counter::default()),
                registered: false,
            }
        })
        .collect();
    let mut router = StreamRouter::new();
    // Router id -> stream index.
    let mut routed: std::collections::HashMap<u64, usize> = Default::default();

    for op in input.ops.into_iter().take(256) {
        match op {
            Op::Send { s, n, base } => {
                let st = &mut streams[usize::from(s % 4)];
                let tokens: Vec<u32> = (0..u32::from(n % 20))
                    .map(|i| base.wrapping_add(i))
                    .collect();
                if let Tx::Direct(tx) = &mut st.tx {
                    let got = tx.send(&tokens);
                    let want = st.model_send(&tokens);
                    assert_eq!(got, want);
                    if let Tx::Direct(tx) = &st.tx {
                        assert_eq!(tx.is_ended(), st.end.is_some());
                        assert_eq!(tx.is_closed(), st.rx.is_none());
                    }
                }
            }
            Op::Finish { s, reason: r, code } => {
                let st = &mut streams[usize::from(s % 4)];
                if let Tx::Direct(_) = st.tx {
                    let Tx::Direct(tx) = std::mem::replace(&mut st.tx, Tx::Gone) else {
                        unreachable!()
                    };
                    let r = reason(r, code);
                    assert_eq!(tx.finish(r), st.model_finish(r));
                }
            }
            Op::DropSender { s } => {
                let st = &mut streams[usize::from(s % 4)];
                if let Tx::Direct(_) = st.tx {
                    st.tx = Tx::Gone;
                    if st.end.is_none() {
                        st.set_end(End::Abandoned);
                    }
                }
            }
            Op::TryNext { s } => {
                let st = &mut streams[usize::from(s % 4)];
                if let Some(rx) = st.rx.as_mut() {
                    let got = rx.try_next();
                    st.check_item(got);
                    assert_eq!(st.rx.as_ref().unwrap().is_done(), st.rx_done);
                }
            }
            Op::Poll { s } => {
                let st = &mut streams[usize::from(s % 4)];
                if let Some(rx) = st.rx.as_mut() {
                    let waker = Waker::from(st.wakes.clone());
                    let mut cx = Context::from_waker(&waker);
                    let got = rx.poll_recv(&mut cx);
                    let pending = got.is_pending();
                    st.check_item(got);
                    if pending {
                        st.registered = true;
                        st.wakes.0.store(0, Ordering::Relaxed);
                    }
                }
            }
            Op::DropStream { s } => {
                let st = &mut streams[usize::from(s % 4)];
                st.rx = None;
                st.registered = false;
            }
            Op::Insert { s, id } => {
                let si = usize::from(s % 4);
                let id = u64::from(id % 8);
                let st = &mut streams[si];
                if let Tx::Direct(_) = st.tx {
                    let Tx::Direct(tx) = std::mem::replace(&mut st.tx, Tx::Gone) else {
                        unreachable!()
                    };
                    match router.insert(id, tx) {
                        Ok(()) => {
                            assert!(routed.insert(id, si).is_none());
                            st.tx = Tx::Routed;
                        }
                        Err(tx) => {
                            assert!(routed.contains_key(&id));
                            st.tx = Tx::Direct(tx);
                        }
                    }
                }
            }
            Op::Dispatch { updates } => {
                let mut results = StepResults::default();
                for (id, n, fin, bad) in updates.into_iter().take(16) {
                    let at = results.tokens.len();
                    let n = usize::from(n % 8);
                    results
                        .tokens
                        .extend((0..n as u32).map(|i| 1000 + at as u32 + i));
                    // A caller-built update may name tokens that are not there.
                    let end = if bad { at + n + 100 } else { at + n };
                    results.updates.push(SeqUpdate {
                        id: u64::from(id % 8),
                        tokens: at..end,
                        finished: fin.map(|r| reason(r, u32::from(r))),
                    });
                }
                let mut abort = Vec::new();
                router.dispatch(&results, &mut abort);
                let mut want = Vec::new();
                for u in &results.updates {
                    let Some(&si) = routed.get(&u.id) else {
                        continue;
                    };
                    let st = &mut streams[si];
                    let sent = match results.tokens.get(u.tokens.clone()) {
                        Some(t) => st.model_send(t),
                        None => {
                            // Undeliverable tokens cut the stream: `Abandoned` (unless it had
                            // ended), and the sequence's later updates find no stream, so the
                            // reader never sees a gap followed by more tokens or `Finished`.
                            routed.remove(&u.id);
                            st.tx = Tx::Gone;
                            if st.end.is_none() {
                                st.set_end(End::Abandoned);
                            }
                            if u.finished.is_none() {
                                want.push(u.id);
                            }
                            continue;
                        }
                    };
                    if let Some(r) = u.finished {
                        routed.remove(&u.id);
                        st.tx = Tx::Gone;
                        let _ = st.model_finish(r);
                    } else if matches!(sent, Err(SendError::Closed | SendError::Lagged)) {
                        want.push(u.id);
                    }
                }
                assert_eq!(abort, want);
            }
            Op::ClosedInto => {
                let mut abort = Vec::new();
                router.closed_into(&mut abort);
                abort.sort_unstable();
                let mut want: Vec<u64> = routed
                    .iter()
                    .filter(|(_, &si)| streams[si].rx.is_none())
                    .map(|(&id, _)| id)
                    .collect();
                want.sort_unstable();
                assert_eq!(abort, want);
            }
            Op::Remove { id } => {
                let id = u64::from(id % 8);
                let got = router.remove(id);
                assert_eq!(got.is_some(), routed.contains_key(&id));
                if let Some(si) = routed.remove(&id) {
                    let st = &mut streams[si];
                    st.tx = Tx::Gone;
                    drop(got);
                    if st.end.is_none() {
                        st.set_end(End::Abandoned);
                    }
                }
            }
        }
        assert_eq!(router.len(), routed.len());
        assert_eq!(router.is_empty(), routed.is_empty());
    }

    // Teardown: drop every sender (the router too), then each live reader drains to its end.
    drop(router);
    for (id, si) in routed.drain() {
        let _ = id;
        let st = &mut streams[si];
        st.tx = Tx::Gone;
        if st.end.is_none() {
            st.set_end(End::Abandoned);
        }
    }
    for st in &mut streams {
        if let Tx::Direct(_) = st.tx {
            st.tx = Tx::Gone;
            if st.end.is_none() {
                st.set_end(End::Abandoned);
            }
        }
        if st.rx.is_some() {
            for _ in 0..3 {
                let got = st.rx.as_mut().unwrap().try_next();
                st.check_item(got);
            }
            assert!(st.rx_done);
        }
    }
});
