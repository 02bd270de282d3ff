//! Admission queues: pagedkv's lock-free queue set beside the kapsl design (per-worker
//! high/low `Mutex<VecDeque>` queues with a capacity check; our re-implementation), in the same
//! groups so every claim is a ratio from one run.
//!
//! Both sides do the same work per request: submit (capacity check, class choice), pop (high
//! class first), complete, and hand the result back. The baseline's result slot is a bare
//! `Arc<AtomicU64>` (no waker), cheaper than pagedkv's `Ticket`, so the ratios are conservative.
//!
//! - `admission/uncontended`: one thread, submit + pop + complete + take, per request.
//! - `admission/contended_2t`: one submitter thread and one worker thread streaming requests
//!   through one worker's queue (capacity 1024); on full / empty each side yields its time
//!   slice, so the figure stays meaningful on an oversubscribed machine.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use pagedkv::sched::admission::{Admission, AdmissionConfig, OverflowPolicy, Route};
use pagedkv::sched::Priority;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CAP: usize = 1024;
const BATCH: u64 = 256;
const STREAM: u64 = 200_000;

/// One queued request of the baseline.
struct Req {
    payload: u64,
    slot: Arc<AtomicU64>,
}

/// The kapsl design: per worker, a high and a low `Mutex<VecDeque>` with a capacity.
struct Kapsl {
    high: Mutex<VecDeque<Req>>,
    low: Mutex<VecDeque<Req>>,
    cap: usize,
}

impl Kapsl {
    fn new(cap: usize) -> Self {
        Self {
            high: Mutex::new(VecDeque::with_capacity(cap)),
            low: Mutex::new(VecDeque::with_capacity(cap)),
            cap,
        }
    }

    /// Drop-newest: refused (payload back) when full.
    fn try_submit(&self, payload: u64, p: Priority) -> Result<Arc<AtomicU64>, u64> {
        let q = match p {
            Priority::LatencyCritical => &self.high,
            Priority::Throughput => &self.low,
        };
        let mut q = q.lock().unwrap();
        if q.len() >= self.cap {
            return Err(payload);
        }
        let slot = Arc::new(AtomicU64::new(u64::MAX));
        q.push_back(Req {
            payload,
            slot: slot.clone(),
        });
        Ok(slot)
    }

    fn pop(&self) -> Option<Req> {
        if let Some(r) = self.high.lock().unwrap().pop_front() {
            return Some(r);
        }
        self.low.lock().unwrap().pop_front()
    }
}

fn pagedkv_queues() -> Admission<u64, u64> {
    Admission::new(AdmissionConfig::new(1, CAP, OverflowPolicy::DropNewest)).unwrap()
}

fn uncontended(c: &mut Criterion) {
    let mut g = c.benchmark_group("admission/uncontended");
    g.throughput(Throughput::Elements(BATCH));
    let q = pagedkv_queues();
    g.bench_function("pagedkv", |b| {
        b.iter(|| {
            for i in 0..BATCH {
                let mut t = q
                    .try_submit(black_box(i), Priority::Throughput, Route::Worker(0))
                    .unwrap();
                let job = q.pop(0).unwrap().unwrap();
                let v = *job.payload();
                job.complete(v * 2);
                assert_eq!(t.try_take(), Some(Ok(i * 2)));
            }
        })
    });
    let k = Kapsl::new(CAP);
    g.bench_function("kapsl_mutex_vecdeque", |b| {
        b.iter(|| {
            for i in 0..BATCH {
                let slot = k.try_submit(black_box(i), Priority::Throughput).unwrap();
                let req = k.pop().unwrap();
                req.slot.store(req.payload * 2, Ordering::Release);
                drop(req);
                assert_eq!(slot.load(Ordering::Acquire), i * 2);
            }
        })
    });
    g.finish();
}

/// Streams `STREAM` requests from this thread to a worker thread; returns the elapsed time.
fn stream_pagedkv(q: &Arc<Admission<u64, u64>>) -> Duration {
    let worker = {
        let q = q.clone();
        std::thread::spawn(move || {
            let (mut n, mut sum, mut last) = (0u64, 0u64, None);
            while n < STREAM {
                match q.pop(0).unwrap() {
                    Some(job) => {
                        let v = *job.payload();
                        // FIFO from one submitter: strictly increasing.
                        assert!(last.is_none_or(|l| l < v));
                        last = Some(v);
                        sum += v;
                        n += 1;
                        job.complete(v);
                    }
                    None => std::thread::yield_now(),
                }
            }
            sum
        })
    };
    let start = Instant::now();
    for i in 0..STREAM {
        let mut payload = i;
        loop {
            match q.try_submit(payload, Priority::Throughput, Route::Worker(0)) {
                Ok(t) => {
                    drop(t);
                    break;
                }
                Err(r) => {
                    payload = r.payload;
                    std::thread::yield_now();
                }
            }
        }
    }
    let sum = worker.join().unwrap();
    let elapsed = start.elapsed();
    assert_eq!(sum, STREAM * (STREAM - 1) / 2);
    elapsed
}

fn stream_kapsl(k: &Arc<Kapsl>) -> Duration {
    let worker = {
        let k = k.clone();
        std::thread::spawn(move || {
            let (mut n, mut sum, mut last) = (0u64, 0u64, None);
            while n < STREAM {
                match k.pop() {
                    Some(req) => {
                        let v = req.payload;
                        assert!(last.is_none_or(|l| l < v));
                        last = Some(v);
                        sum += v;
                        n += 1;
                        req.slot.store(v, Ordering::Release);
                    }
                    None => std::thread::yield_now(),
                }
            }
            sum
        })
    };
    let start = Instant::now();
    for i in 0..STREAM {
        while let Err(_full) = k.try_submit(i, Priority::Throughput) {
            std::thread::yield_now();
        }
    }
    let sum = worker.join().unwrap();
    let elapsed = start.elapsed();
    assert_eq!(sum, STREAM * (STREAM - 1) / 2);
    elapsed
}

fn contended(c: &mut Criterion) {
    let mut g = c.benchmark_group("admission/contended_2t");
    g.throughput(Throughput::Elements(STREAM));
    g.sample_size(10);
    let q = Arc::new(pagedkv_queues());
    g.bench_function("pagedkv", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| stream_pagedkv(&q)).sum())
    });
    let k = Arc::new(Kapsl::new(CAP));
    g.bench_function("kapsl_mutex_vecdeque", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| stream_kapsl(&k)).sum())
    });
    g.finish();
}

criterion_group!(benches, uncontended, contended);
criterion_main!(benches);
