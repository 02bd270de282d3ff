//! The host copy engine: a [`CopyEngine`] whose "device memory" is host memory and whose stream
//! is a worker thread, so that [`StagingRing`](super::StagingRing)'s schedule runs, and is
//! checked, in ordinary tests without a GPU. It is a test backend, not a fast path.
//!
//! # How it models a CUDA stream
//!
//! * The stream is one worker thread fed by a channel: [`CopyEngine::copy_async`] sends a job
//!   and returns; the worker runs jobs one at a time in the order sent, each after a random
//!   delay in `[0, HostConfig::max_delay]`. A job reads its staging bytes when it *runs*, not
//!   when it is queued, so a buffer rewritten before its copy ran puts the new bytes into the
//!   old destination — wrong bytes, as on a GPU.
//! * Job `t` (tickets count from 1) sets `completed = t` when done. An event is a ticket:
//!   [`CopyEngine::record`] stores the ticket of the last job queued, and [`CopyEngine::wait`]
//!   blocks until `completed` reaches it — like `cuEventRecord`, it covers every job queued
//!   before it, whichever buffer it read.
//! * Staging and destination bytes are `AtomicU8`s (relaxed), so a pipeline that races the
//!   worker produces wrong bytes, never undefined behaviour. The channel (job hand-over) and the
//!   `completed` mutex (event completion) order the bytes as the stream does.
//!
//! # Contract checks
//!
//! On top of the bytes, the engine checks [`CopyEngine`]'s safety contract deterministically,
//! whatever the timing: it remembers, per staging buffer, the range each queued copy reads and
//! its ticket, and the highest event ticket the host has waited on (`observed`). A fill that
//! overlaps a read newer than `observed`, or a free of a buffer that still has one, is a
//! [`Violation`]; so is a job that finds its buffer already freed when it runs. Violations are
//! collected, not raised (some happen in `Drop`), and read through [`HostProbe`].
//!
//! [`HostFault`] makes the n-th call of one operation fail, to drive the pipeline's error paths.
//!
//! The engine is a test double, not a protocol loom checks: it uses std's thread, channel and
//! mutex directly rather than through `crate::sync`.

use super::pipeline::CopyEngine;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// The byte a fresh destination holds: a copy that never ran shows as a run of it.
pub const HOST_DST_POISON: u8 = 0xA5;

/// The engine's operations, for [`HostFault`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostOp {
    /// [`CopyEngine::alloc_staging`].
    StagingAlloc,
    /// [`CopyEngine::alloc_dst`].
    DstAlloc,
    /// [`CopyEngine::copy_async`].
    Copy,
    /// [`CopyEngine::record`].
    Record,
    /// [`CopyEngine::wait`].
    Wait,
}

impl HostOp {
    fn name(self) -> &'static str {
        match self {
            HostOp::StagingAlloc => "alloc_staging",
            HostOp::DstAlloc => "alloc_dst",
            HostOp::Copy => "copy_async",
            HostOp::Record => "record",
            HostOp::Wait => "wait",
        }
    }
}

/// Makes call number `call` (0-based, counted over the engine's life) of `op` fail with
/// [`UploadError::Injected`]; a failed `copy_async` queues nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostFault {
    /// The operation.
    pub op: HostOp,
    /// Which call of it fails.
    pub call: u64,
}

/// How a [`HostEngine`] behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostConfig {
    /// Each copy waits a uniformly random time in `[0, max_delay]` before it reads its staging
    /// bytes (zero: it runs as soon as the worker reaches it).
    pub max_delay: Duration,
    /// Seed of the delays.
    pub seed: u64,
    /// A call to fail, if any.
    pub fault: Option<HostFault>,
}

/// A breach of [`CopyEngine`]'s safety contract the engine saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// `fill` wrote bytes that a queued copy, not yet observed complete, reads.
    RewriteUnderCopy {
        /// Staging buffer (numbered in allocation order).
        buffer: usize,
        /// The bytes written.
        write: Range<usize>,
        /// The pending copy's source bytes.
        read: Range<usize>,
    },
    /// `free_staging` freed a buffer that a queued copy, not yet observed complete, reads.
    FreedUnderCopy {
        /// Staging buffer.
        buffer: usize,
        /// The pending copy's source bytes.
        read: Range<usize>,
    },
    /// A copy ran after its staging buffer had been freed.
    CopyFromFreed {
        /// Staging buffer.
        buffer: usize,
    },
}

/// One staging buffer's memory, shared by the host handle and the jobs that read it.
#[derive(Debug)]
struct StagingMem {
    /// Number in allocation order, for [`Violation`]s.
    id: usize,
    bytes: Box<[AtomicU8]>,
    /// Set by `free_staging` (Release; the worker's Acquire load then sees it).
    freed: AtomicBool,
}

/// A [`HostEngine`] staging buffer and its event.
#[derive(Debug)]
pub struct HostStaging {
    mem: Arc<StagingMem>,
    /// The event: the ticket of the last job queued when it was recorded (0: never recorded).
    event: u64,
    /// Copies queued from this buffer (ticket, source range), pruned once `observed` passes
    /// them: those still here may be pending as far as the host can know.
    reads: Vec<(u64, Range<usize>)>,
}

/// A [`HostEngine`] destination: host memory standing for a device allocation.
#[derive(Debug, Clone)]
pub struct HostDst {
    mem: Arc<[AtomicU8]>,
}

impl HostDst {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// True when it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// A copy of its bytes as they are now (after the upload returned: all copies into it).
    pub fn to_vec(&self) -> Vec<u8> {
        self.mem.iter().map(|b| b.load(Ordering::Relaxed)).collect()
    }
}

/// One queued copy.
struct Job {
    ticket: u64,
    src: Arc<StagingMem>,
    range: Range<usize>,
    dst: Arc<[AtomicU8]>,
    dst_offset: usize,
    delay: Duration,
}

/// State the worker and the host (and probes) share.
#[derive(Debug, Default)]
struct Shared {
    /// Ticket of the last job the worker finished (0: none). Tickets finish in order.
    completed: Mutex<u64>,
    /// Notified after each change of `completed`.
    progressed: Condvar,
    /// Bytes copied by finished jobs; updated (Release) before `completed`.
    bytes_copied: AtomicU64,
    /// While true the worker starts no job ([`HostProbe::pause`]).
    paused: Mutex<bool>,
    /// Notified when `paused` turns false.
    resumed: Condvar,
    violations: Mutex<Vec<Violation>>,
}

impl Shared {
    fn violation(&self, v: Violation) {
        lock(&self.violations).push(v);
    }
}

/// A lock that ignores poisoning: every critical section here leaves its data consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reads what a [`HostEngine`] saw, also after the engine (and the ring owning it) is gone.
#[derive(Debug, Clone)]
pub struct HostProbe(Arc<Shared>);

impl HostProbe {
    /// Every contract breach seen so far.
    pub fn violations(&self) -> Vec<Violation> {
        lock(&self.0.violations).clone()
    }

    /// Bytes the stream has finished copying.
    pub fn bytes_copied(&self) -> u64 {
        // Acquire pairs with the worker's Release add, made after the bytes were written.
        self.0.bytes_copied.load(Ordering::Acquire)
    }

    /// Copies the stream has finished.
    pub fn copies_completed(&self) -> u64 {
        *lock(&self.0.completed)
    }

    /// Holds the stream: the worker finishes the job it is running and starts no other until
    /// [`HostProbe::resume`] (or the engine's drop), so a test can act while chosen copies are
    /// certainly pending. A `wait` for a held copy blocks until then.
    pub fn pause(&self) {
        *lock(&self.0.paused) = true;
    }

    /// Lets the stream run again.
    pub fn resume(&self) {
        *lock(&self.0.paused) = false;
        self.0.resumed.notify_all();
    }
}

/// The host copy engine: see the module docs.
#[derive(Debug)]
pub struct HostEngine {
    /// Job queue of the stream; `None` once dropped (the worker then drains it and exits).
    tx: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    rng: SmallRng,
    config: HostConfig,
    /// Calls made so far per [`HostOp`] (indexed by `HostOp as usize`).
    calls: [u64; 5],
    /// Ticket of the last job queued (0: none).
    last_ticket: u64,
    /// Highest event ticket a `wait` has returned for: every job up to it has finished, and the
    /// host knows it.
    observed: u64,
    next_staging_id: usize,
}

impl HostEngine {
    /// Starts the stream's worker thread.
    pub fn new(config: HostConfig) -> Self {
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel();
        let worker = {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || run_stream(&rx, &shared))
        };
        Self {
            tx: Some(tx),
            worker: Some(worker),
            shared,
            rng: SmallRng::seed_from_u64(config.seed),
            config,
            calls: [0; 5],
            last_ticket: 0,
            observed: 0,
            next_staging_id: 0,
        }
    }

    /// A handle on what the engine sees.
    pub fn probe(&self) -> HostProbe {
        HostProbe(Arc::clone(&self.shared))
    }

    /// Counts a call of `op` and fails it if it is the configured fault.
    fn call(&mut self, op: HostOp) -> Result<(), UploadError> {
        let n = &mut self.calls[op as usize];
        let call = *n;
        *n += 1;
        match self.config.fault {
            Some(f) if f.op == op && f.call == call => Err(UploadError::Injected {
                op: op.name(),
                call,
            }),
            _ => Ok(()),
        }
    }
}

/// The stream: runs jobs in order until the engine drops its sender.
fn run_stream(rx: &Receiver<Job>, shared: &Shared) {
    for job in rx {
        let mut paused = lock(&shared.paused);
        while *paused {
            paused = shared
                .resumed
                .wait(paused)
                .unwrap_or_else(PoisonError::into_inner);
        }
        drop(paused);
        if !job.delay.is_zero() {
            std::thread::sleep(job.delay);
        }
        let dst = &job.dst[job.dst_offset..job.dst_offset + job.range.len()];
        for (d, s) in dst.iter().zip(&job.src.bytes[job.range.clone()]) {
            d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        // Acquire pairs with `free_staging`'s Release store; checked after the read, so a free
        // during it is caught too.
        if job.src.freed.load(Ordering::Acquire) {
            shared.violation(Violation::CopyFromFreed { buffer: job.src.id });
        }
        // Release pairs with HostProbe::bytes_copied's Acquire: the bytes above are in `dst`.
        shared
            .bytes_copied
            .fetch_add(job.range.len() as u64, Ordering::Release);
        // The mutex orders the writes above before any `wait` that sees this ticket.
        *lock(&shared.completed) = job.ticket;
        shared.progressed.notify_all();
    }
}

impl CopyEngine for HostEngine {
    type Error = UploadError;
    type Staging = HostStaging;
    type Dst = HostDst;

    fn alloc_staging(&mut self, bytes: usize) -> Result<HostStaging, UploadError> {
        self.call(HostOp::StagingAlloc)?;
        let id = self.next_staging_id;
        self.next_staging_id += 1;
        Ok(HostStaging {
            mem: Arc::new(StagingMem {
                id,
                bytes: (0..bytes).map(|_| AtomicU8::new(0)).collect(),
                freed: AtomicBool::new(false),
            }),
            event: 0,
            reads: Vec::new(),
        })
    }

    // The `unsafe` of the three methods below is CopyEngine's contract for engines whose memory
    // a device reads behind the host's back. This engine needs none of it for soundness (its
    // bytes are atomics and a freed buffer is only flagged): it records each breach of the
    // contract as a Violation for the tests to see instead.
    unsafe fn free_staging(&mut self, staging: HostStaging) {
        let observed = self.observed;
        for (_, read) in staging.reads.iter().filter(|(t, _)| *t > observed) {
            self.shared.violation(Violation::FreedUnderCopy {
                buffer: staging.mem.id,
                read: read.clone(),
            });
        }
        // Release pairs with the worker's Acquire load after a job's read.
        staging.mem.freed.store(true, Ordering::Release);
    }

    fn alloc_dst(&mut self, bytes: usize) -> Result<HostDst, UploadError> {
        self.call(HostOp::DstAlloc)?;
        Ok(HostDst {
            mem: (0..bytes).map(|_| AtomicU8::new(HOST_DST_POISON)).collect(),
        })
    }

    unsafe fn fill(&mut self, staging: &mut HostStaging, at: usize, src: &[u8]) {
        let write = at..at + src.len();
        assert!(
            write.end <= staging.mem.bytes.len(),
            "fill {write:?} past a {}-byte staging buffer",
            staging.mem.bytes.len()
        );
        let observed = self.observed;
        staging.reads.retain(|(t, _)| *t > observed);
        for (_, read) in &staging.reads {
            if read.start < write.end && write.start < read.end {
                self.shared.violation(Violation::RewriteUnderCopy {
                    buffer: staging.mem.id,
                    write: write.clone(),
                    read: read.clone(),
                });
            }
        }
        for (d, s) in staging.mem.bytes[write].iter().zip(src) {
            d.store(*s, Ordering::Relaxed);
        }
    }

    unsafe fn copy_async(
        &mut self,
        staging: &mut HostStaging,
        range: Range<usize>,
        dst: &mut HostDst,
        dst_offset: usize,
    ) -> Result<(), UploadError> {
        self.call(HostOp::Copy)?;
        assert!(
            range.start <= range.end
                && range.end <= staging.mem.bytes.len()
                && dst_offset
                    .checked_add(range.len())
                    .is_some_and(|e| e <= dst.mem.len()),
            "copy {range:?} of a {}-byte buffer to {dst_offset}.. of a {}-byte destination",
            staging.mem.bytes.len(),
            dst.mem.len()
        );
        let max = u64::try_from(self.config.max_delay.as_nanos()).unwrap_or(u64::MAX);
        let delay = Duration::from_nanos(if max == 0 {
            0
        } else {
            self.rng.gen_range(0..=max)
        });
        let ticket = self.last_ticket + 1;
        let job = Job {
            ticket,
            src: Arc::clone(&staging.mem),
            range: range.clone(),
            dst: Arc::clone(&dst.mem),
            dst_offset,
            delay,
        };
        let tx = self.tx.as_ref().ok_or(UploadError::StreamStopped)?;
        // The send orders the fill's stores before the worker's loads (it receives the job).
        tx.send(job).map_err(|_| UploadError::StreamStopped)?;
        self.last_ticket = ticket;
        staging.reads.push((ticket, range));
        Ok(())
    }

    fn record(&mut self, staging: &mut HostStaging) -> Result<(), UploadError> {
        self.call(HostOp::Record)?;
        staging.event = self.last_ticket;
        Ok(())
    }

    fn wait(&mut self, staging: &mut HostStaging) -> Result<(), UploadError> {
        self.call(HostOp::Wait)?;
        let mut done = lock(&self.shared.completed);
        while *done < staging.event {
            if self.worker.as_ref().is_none_or(JoinHandle::is_finished) {
                return Err(UploadError::StreamStopped);
            }
            // A timeout, so that a worker that died without notifying is noticed above.
            done = self
                .shared
                .progressed
                .wait_timeout(done, Duration::from_millis(20))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        self.observed = self.observed.max(staging.event);
        Ok(())
    }
}

impl Drop for HostEngine {
    fn drop(&mut self) {
        // Closing the channel lets the worker finish the queued jobs and exit; a held stream
        // is released so that it can.
        drop(self.tx.take());
        HostProbe(Arc::clone(&self.shared)).resume();
        if let Some(w) = self.worker.take() {
            // A panicked worker has nothing left to clean up; its waits already failed.
            let _ = w.join();
        }
    }
}

/// Errors of the host copy engine ([`HostEngine`]), the stand-in for a GPU
/// that runs the upload pipeline in ordinary tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum UploadError {
    /// A failure the engine was configured to inject ([`HostFault`]).
    #[error("injected failure of host engine call {op} #{call}")]
    Injected {
        /// The engine operation that failed.
        op: &'static str,
        /// Which call of it (0-based, counted over the engine's life).
        call: u64,
    },
    /// The engine's stream thread has stopped, so queued copies will never complete.
    #[error("the host copy stream's worker thread has stopped")]
    StreamStopped,
}
