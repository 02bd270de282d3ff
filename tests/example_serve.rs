//! Runs examples/serve_two_models.rs (two models on one arena behind a tokio front end) and
//! checks every stream: each request that was not cancelled streamed exactly its tokens, in
//! order, then one `Finished`; each cancelled one was aborted by its engine; every page is
//! back in the pool after shutdown.

#[path = "../examples/serve_two_models.rs"]
#[allow(dead_code)]
mod serve;

use std::collections::HashSet;
use std::sync::mpsc;
use std::time::Duration;

use pagedkv::sched::admission::{
    Admission, AdmissionConfig, AdmissionError, OverflowPolicy, Route, StreamRequest, TokenStream,
};
use pagedkv::sched::{FinishReason, Priority, SeqRequest, StopRules};
use serve::{Outcome, ServeConfig};

fn check(cfg: ServeConfig) {
    let report = serve::run(&cfg).expect("the server ran");
    assert_eq!(report.outcomes.len() as u64, 2 * cfg.requests_per_model);
    let mut cancelled = [HashSet::new(), HashSet::new()];
    for (plan, outcome) in &report.outcomes {
        let expected = |n: usize| plan.expected_token(n as u32);
        match (plan.cancel_after, outcome) {
            (None, Outcome::Finished { tokens, reason }) => {
                assert_eq!(*reason, FinishReason::MaxTokens, "request {}", plan.id);
                assert_eq!(
                    tokens.len(),
                    plan.max_new_tokens as usize,
                    "request {}",
                    plan.id
                );
                for (n, &t) in tokens.iter().enumerate() {
                    assert_eq!(t, expected(n), "request {} token {n}", plan.id);
                }
            }
            (Some(k), Outcome::Cancelled { tokens }) => {
                assert!(tokens.len() >= k as usize, "request {}", plan.id);
                for (n, &t) in tokens.iter().enumerate() {
                    assert_eq!(t, expected(n), "request {} token {n}", plan.id);
                }
                cancelled[plan.model].insert(plan.id);
            }
            (_, other) => panic!("request {} ({plan:?}): {other:?}", plan.id),
        }
    }
    for (model, log) in report.engines.iter().enumerate() {
        // Every request of this model ended in its engine exactly once...
        let ids: HashSet<_> = report
            .outcomes
            .iter()
            .filter(|(p, _)| p.model == model)
            .map(|(p, _)| p.id)
            .collect();
        assert_eq!(log.finished.keys().copied().collect::<HashSet<_>>(), ids);
        // ...and the cancelled ones were aborted when their streams were dropped, unless the
        // cancel raced the completion: they ask for 120 tokens and are dropped after 3, but a
        // client task scheduled late reads its first event only after the engine generated
        // all 120 (the tiny model steps in microseconds), and then the engine finished it
        // first. Only aborts of cancelled requests, and at least one.
        let aborted: HashSet<_> = log.cancelled.iter().copied().collect();
        assert_eq!(aborted.len(), log.cancelled.len(), "one abort per sequence");
        assert!(aborted.is_subset(&cancelled[model]), "engine {model}");
        for id in cancelled[model].difference(&aborted) {
            assert_eq!(
                log.finished[id],
                FinishReason::MaxTokens,
                "request {id} was cancelled, and neither aborted nor finished"
            );
        }
        assert!(!aborted.is_empty());
    }
    assert_eq!(report.pool_free, report.pool_total, "pages leaked");
    assert_eq!(report.blocks_in_use, 0, "budget leaked");
}

#[test]
fn two_models_stream_cancel_and_shut_down_clean() {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        check(ServeConfig::default());
        // A small arena: the engines preempt while they stream.
        check(ServeConfig {
            pages: 24,
            ..ServeConfig::default()
        });
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => worker.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = worker.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("the server did not stop within 60 s"),
    }
}

/// A throughput request of an 8-token prompt for `max_new_tokens`, and its stream.
fn throughput_request(id: u64, max_new_tokens: u32) -> (StreamRequest, TokenStream) {
    StreamRequest::new(SeqRequest {
        id,
        prompt: vec![1; 8],
        stop: StopRules {
            max_new_tokens,
            eos: Vec::new(),
            stop_sequences: Vec::new(),
        },
        priority: Priority::Throughput,
    })
    .unwrap()
}

/// An engine that fails leaves no client waiting on it. A request queued for it while its
/// failing step ran was never popped: the close refused later submits only, so its client
/// (and `run`, which waits for every client) waited forever.
#[test]
fn a_failed_engine_leaves_no_client_waiting() {
    let shared = serve::arena(32).unwrap();
    let queues = Admission::new(AdmissionConfig::new(2, 16, OverflowPolicy::Block)).unwrap();
    let request = |id| throughput_request(id, 8);
    let submit = |req| {
        queues
            .try_submit(req, Priority::Throughput, Route::Worker(0))
            .unwrap_or_else(|r| panic!("{}", r.error))
    };
    let (first, _first_stream) = request(1);
    let mut first = submit(first);
    let mut late = None;
    let log = serve::engine_worker(&shared, &queues, 0, &mut |_| {
        // A client submits while the step runs; then the step fails.
        let (req, stream) = request(3);
        late = Some((submit(req), stream));
        Err("injected fault".into())
    });
    assert!(log.is_err());
    assert!(matches!(first.try_take(), Some(Ok(Ok(())))));
    let (mut ticket, _stream) = late.expect("the engine stepped");
    assert!(
        matches!(ticket.try_take(), Some(Err(AdmissionError::Abandoned))),
        "a client still waits on the failed engine"
    );
    assert_eq!(shared.pool().free_count(), shared.pool().total());
}

/// An engine thread that panics (a model's bug, an invariant of the engine) leaves no client
/// waiting on it either: before the fix only an `Err` closed and drained the queues, so a
/// request queued for the panicking engine kept its ticket pending forever (its client holds
/// the queue set alive, and `run` waits for every client before joining the engines).
#[test]
fn a_panicking_engine_leaves_no_client_waiting() {
    let shared = serve::arena(32).unwrap();
    let queues = Admission::new(AdmissionConfig::new(2, 16, OverflowPolicy::Block)).unwrap();
    let request = |id| throughput_request(id, 8);
    let submit = |req| {
        queues
            .try_submit(req, Priority::Throughput, Route::Worker(0))
            .unwrap_or_else(|r| panic!("{}", r.error))
    };
    let (first, mut first_stream) = request(1);
    let mut first = submit(first);
    let mut late = None;
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        serve::engine_worker(&shared, &queues, 0, &mut |_| {
            let (req, stream) = request(3);
            late = Some((submit(req), stream));
            panic!("injected panic in the engine thread");
        })
    }));
    assert!(panicked.is_err(), "the panic reaches the caller");
    assert!(matches!(first.try_take(), Some(Ok(Ok(())))));
    assert!(
        matches!(
            first_stream.try_next(),
            std::task::Poll::Ready(Some(Err(pagedkv::sched::admission::StreamError::Abandoned)))
        ),
        "the running request's stream ends"
    );
    let (mut ticket, _stream) = late.expect("the engine stepped");
    assert!(
        matches!(ticket.try_take(), Some(Err(AdmissionError::Abandoned))),
        "a client still waits on the panicked engine"
    );
    assert!(queues.is_closed(), "later submits are refused");
    assert_eq!(shared.pool().free_count(), shared.pool().total());
}

/// Back-pressure: an engine takes from its admission queue only what its batcher can start
/// soon, so a client submitting faster than the engine serves is held at the queue (refused
/// `QueueFull`, or parked under `Block`) and the requests, with their token-stream buffers,
/// stay bounded. Before the fix the engine moved every queued request into its batcher's
/// unbounded waiting list at each step: the queue never filled, and a submitter that kept
/// going had every request admitted (16 more per step here, without end).
#[test]
fn an_overloaded_engine_pushes_back_at_its_queue() {
    let shared = serve::arena(32).unwrap();
    let queues = Admission::new(AdmissionConfig::new(2, 16, OverflowPolicy::Block)).unwrap();
    let request = |id| throughput_request(id, 64);
    // One request to wake the idle engine.
    let (req, first_stream) = request(1);
    let first = queues
        .try_submit(req, Priority::Throughput, Route::Worker(0))
        .unwrap();
    let mut admitted = vec![(first, first_stream)];
    let mut next_id = 2;
    let mut refused = 0;
    let log = serve::engine_worker(&shared, &queues, 0, &mut |step| {
        if step == 12 {
            return Err("stop".into());
        }
        // A client that submits as fast as it is let: long requests, far more than the
        // engine runs at once (max_running 8).
        loop {
            let (req, stream) = request(next_id);
            next_id += 1;
            match queues.try_submit(req, Priority::Throughput, Route::Worker(0)) {
                Ok(ticket) => admitted.push((ticket, stream)),
                Err(_) => {
                    refused += 1;
                    break;
                }
            }
        }
        Ok(())
    });
    assert!(log.is_err());
    // None finished (64 tokens each): the queue (16), the batcher's running sequences (8)
    // and its backlog of waiting ones (8), not 16 more per step.
    assert!(
        admitted.len() <= 16 + 8 + 8,
        "{} requests admitted in 12 steps of an engine that runs 8 at once",
        admitted.len()
    );
    assert!(refused >= 11);
    drop(admitted);
    assert_eq!(shared.pool().free_count(), shared.pool().total());
}
