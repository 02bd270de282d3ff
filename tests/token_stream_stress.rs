//! Token streams under real threads: many sender/reader pairs at once with random chunk sizes,
//! small capacities (so streams lag), readers that park (`block_on`), spin (`try_next`) or
//! leave early, and senders that finish or drop. Each pair is checked against the sequential
//! model of the channel: the reader gets exactly the accepted tokens in order and then the
//! sender's end; a reader that left got a prefix, and once a send is refused `Closed` every
//! later one is. Runs under a deadline, so a lost wake-up fails instead of hanging.

use std::sync::mpsc;
use std::task::Poll;
use std::thread;
use std::time::Duration;

use pagedkv::sched::admission::{
    block_on, token_stream, SendError, StreamError, StreamEvent, StreamSender, TokenStream,
};
use pagedkv::sched::FinishReason;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Runs `f` on its own thread; fails with `what` if it does not finish within `secs` seconds.
fn with_deadline(what: &str, secs: u64, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: did not finish within {secs} s (a lost wake-up?)")
        }
    }
}

/// How the sender's side went.
#[derive(Debug)]
struct Sent {
    /// Tokens of the sends that returned `Ok`, in order.
    accepted: Vec<u32>,
    /// The end the reader must see, if it reads to the end.
    end: Result<StreamEvent, StreamError>,
}

fn sender(mut tx: StreamSender, seed: u64, tokens: u32) -> Sent {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut accepted = Vec::new();
    let mut next = 0u32;
    let mut closed = false;
    while next < tokens {
        let n = rng.gen_range(0..4u32).min(tokens - next);
        let chunk: Vec<u32> = (next..next + n).collect();
        next += n;
        match tx.send(&chunk) {
            Ok(()) => {
                assert!(!closed, "a send succeeded after one was refused Closed");
                accepted.extend(chunk);
            }
            Err(SendError::Closed) => closed = true,
            Err(SendError::Lagged) => {
                let capacity = tx.capacity();
                return Sent {
                    accepted,
                    end: Err(StreamError::Lagged { capacity }),
                };
            }
            Err(SendError::Ended) => panic!("ended without a lag"),
        }
        if rng.gen_bool(0.2) {
            thread::yield_now();
        }
    }
    if rng.gen_bool(0.25) {
        drop(tx);
        return Sent {
            accepted,
            end: Err(StreamError::Abandoned),
        };
    }
    let reason = FinishReason::Caller(seed as u32);
    let _ = tx.finish(reason);
    Sent {
        accepted,
        end: Ok(StreamEvent::Finished(reason)),
    }
}

/// How the reader's side went: the tokens, and the last item if it read to the end.
type Read = (Vec<u32>, Option<Result<StreamEvent, StreamError>>);

fn reader(mut rx: TokenStream, seed: u64) -> Read {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x5eed);
    // A quarter of the readers leave after a few items.
    let leave_after = rng.gen_bool(0.25).then(|| rng.gen_range(0..4u32));
    let parks = rng.gen_bool(0.5);
    let mut tokens = Vec::new();
    let mut items = 0;
    loop {
        if leave_after == Some(items) {
            return (tokens, None);
        }
        let item = if parks {
            block_on(rx.recv())
        } else {
            loop {
                match rx.try_next() {
                    Poll::Ready(item) => break item,
                    Poll::Pending => thread::yield_now(),
                }
            }
        };
        items += 1;
        match item {
            Some(Ok(StreamEvent::Tokens(t))) => {
                assert!(!t.is_empty());
                tokens.extend(t);
            }
            Some(end) => {
                assert_eq!(rx.try_next(), Poll::Ready(None));
                return (tokens, Some(end));
            }
            None => panic!("the stream ended without an end item"),
        }
    }
}

fn round(seed: u64, pairs: u64) {
    let handles: Vec<_> = (0..pairs)
        .map(|p| {
            let seed = seed * 1000 + p;
            let mut rng = SmallRng::seed_from_u64(seed);
            let tokens = rng.gen_range(0..2000);
            // Half the streams are small enough to lag; the others never do.
            let capacity = if rng.gen_bool(0.5) {
                rng.gen_range(1..12)
            } else {
                tokens as usize + 1
            };
            let (tx, rx) = token_stream(capacity).unwrap();
            let s = thread::spawn(move || sender(tx, seed, tokens));
            let r = thread::spawn(move || reader(rx, seed));
            (seed, s, r)
        })
        .collect();
    for (seed, s, r) in handles {
        let sent = s.join().unwrap();
        let (got, end) = r.join().unwrap();
        match end {
            Some(end) => {
                assert_eq!(got, sent.accepted, "seed {seed}");
                assert_eq!(end, sent.end, "seed {seed}");
            }
            None => assert!(sent.accepted.starts_with(&got), "seed {seed}"),
        }
    }
}

#[test]
fn many_pairs_match_the_sequential_model() {
    with_deadline("token stream stress", 60, || {
        for seed in 0..200 {
            round(seed, 6);
        }
    });
}
