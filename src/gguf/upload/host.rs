//! The host copy engine: a [`CopyEngine`] (with [`DequantEngine`] and [`RegisterEngine`])
//! whose "device memory" is host memory and whose stream is a worker thread, so that the upload
//! schedules run, and are checked, in ordinary tests without a GPU. It is a test backend, not a
//! fast path.
//!
//! # How it models a CUDA stream
//!
//! * The stream is one worker thread fed by a channel: [`CopyEngine::copy_async`],
//!   [`RegisterEngine::copy_registered_async`] and [`DequantEngine::dequantize_async`] send a
//!   job and return; the worker runs jobs one at a time in the order sent, each after a random
//!   delay in `[0, HostConfig::max_delay]`. A job reads its source bytes when it *runs*, not
//!   when it is queued, so a buffer rewritten before its copy ran puts the new bytes into the
//!   old destination — wrong bytes, as on a GPU.
//! * Job `t` (tickets count from 1) sets `completed = t` when done. An event is a ticket:
//!   [`CopyEngine::record`] stores the ticket of the last job queued, and [`CopyEngine::wait`]
//!   blocks until `completed` reaches it — like `cuEventRecord`, it covers every job queued
//!   before it, whichever buffer it read. [`RegisterEngine::synchronize`] waits for the last
//!   job queued.
//! * Staging, registered and destination bytes are `AtomicU8`s (relaxed), so a schedule that
//!   races the worker produces wrong bytes, never undefined behaviour. The channel (job
//!   hand-over) and the `completed` mutex (event completion) order the bytes as the stream
//!   does. Registration copies the host bytes (a pinned page outlives its mapping; the copy
//!   models that, so a leaked registration stays sound).
//! * A dequantization job converts with the CPU dequantizer ([`crate::gguf::dequantize_into_f16`]
//!   / [`crate::gguf::dequantize_into_bf16`]), or, with feature `cuda-emu`, with the device
//!   kernel itself (`pkv_dequantize` on the CPU emulation).
//!
//! # Contract checks
//!
//! On top of the bytes, the engine checks the engines' safety contracts: it remembers, per
//! staging buffer and registration, the range each queued copy reads and its ticket, and the
//! highest event ticket the host has waited on (`observed`). A fill that overlaps a read newer
//! than `observed`, a free of a buffer or an unregister of a registration that still has one,
//! is a [`Violation`]; so is a job that finds its memory already freed or unregistered when it
//! runs. A fill on the thread that waited sees `observed` as of its last wait, so the check is
//! deterministic there; a fill on a fill thread sees it as of the hand-over at the latest (a
//! wait the coordinator makes meanwhile may mask a breach, never invent one). Violations are
//! collected, not raised (some happen in `Drop`), and read through [`HostProbe`].
//!
//! [`HostFault`] makes the n-th call of one operation fail, to drive the schedules' error paths.
//!
//! The engine is a test double, not a protocol loom checks: it uses std's thread, channel and
//! mutex directly rather than through `crate::sync`.

use super::engine::{CopyEngine, DequantEngine, RegisterEngine};
use super::DequantTo;
use crate::gguf::GgmlType;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
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
    /// [`DequantEngine::dequantize_async`].
    Dequant,
    /// [`RegisterEngine::register`].
    Register,
    /// [`RegisterEngine::copy_registered_async`].
    CopyRegistered,
    /// [`RegisterEngine::synchronize`].
    Synchronize,
    /// [`RegisterEngine::unregister`].
    Unregister,
    /// [`CopyEngine::fill`]: the faulty call *panics* (as a fill thread would on a bug), so the
    /// schedule's recovery of a buffer held by a panicking thread is tested.
    Fill,
}

impl HostOp {
    const COUNT: usize = 11;

    fn name(self) -> &'static str {
        match self {
            HostOp::StagingAlloc => "alloc_staging",
            HostOp::DstAlloc => "alloc_dst",
            HostOp::Copy => "copy_async",
            HostOp::Record => "record",
            HostOp::Wait => "wait",
            HostOp::Dequant => "dequantize_async",
            HostOp::Register => "register",
            HostOp::CopyRegistered => "copy_registered_async",
            HostOp::Synchronize => "synchronize",
            HostOp::Unregister => "unregister",
            HostOp::Fill => "fill",
        }
    }
}

/// Makes call number `call` (0-based, counted over the engine's life) of `op` fail with
/// [`UploadError::Injected`]; a failed queueing call queues nothing, a failed unregister
/// leaves the memory registered, a failing [`HostOp::Fill`] panics.
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
    /// Each job waits a uniformly random time in `[0, max_delay]` before it reads its source
    /// bytes (zero: it runs as soon as the worker reaches it).
    pub max_delay: Duration,
    /// Each [`CopyEngine::fill`] sleeps a pseudo-random time in `[0, max_fill_delay]` first
    /// (from `seed` and the call's number), so that fills on fill threads finish out of order.
    pub max_fill_delay: Duration,
    /// Seed of the delays.
    pub seed: u64,
    /// A call to fail, if any.
    pub fault: Option<HostFault>,
}

/// A breach of an engine contract the host engine saw.
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
    /// `unregister` ended a registration that a queued copy, not yet observed complete, reads.
    UnregisteredUnderCopy {
        /// Registration (numbered in registration order).
        region: usize,
        /// The pending copy's source bytes.
        read: Range<usize>,
    },
    /// A copy ran after its registration had ended.
    CopyFromUnregistered {
        /// Registration.
        region: usize,
    },
    /// A dequantization job could not run as asked (a kernel refusal or a length the CPU
    /// dequantizer rejects): the schedule passed arguments outside the contract.
    DequantRefused {
        /// What refused it.
        reason: String,
    },
}

/// Memory a job reads from: a staging buffer or a registration.
#[derive(Debug)]
struct SourceMem {
    /// Number in allocation (or registration) order, for [`Violation`]s.
    id: usize,
    /// A registration rather than a staging buffer.
    registered: bool,
    bytes: Box<[AtomicU8]>,
    /// Set by `free_staging` / `unregister` (Release; the worker's Acquire load then sees it).
    gone: AtomicBool,
}

/// A [`HostEngine`] staging buffer and its event.
#[derive(Debug)]
pub struct HostStaging {
    mem: Arc<SourceMem>,
    /// The engine's shared state, for the check in `fill` (which has no engine).
    shared: Arc<Shared>,
    /// The event: the ticket of the last job queued when it was recorded (0: never recorded).
    event: u64,
    /// Copies queued from this buffer (ticket, source range), pruned once `observed` passes
    /// them: those still here may be pending as far as the host can know.
    reads: Vec<(u64, Range<usize>)>,
}

/// A [`HostEngine`] registration: a copy of the registered bytes, read by its copies.
#[derive(Debug)]
pub struct HostRegistered {
    mem: Arc<SourceMem>,
    /// Copies queued from it (ticket, source range), as for [`HostStaging`].
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

/// One queued job.
enum Job {
    Copy {
        src: Arc<SourceMem>,
        range: Range<usize>,
        dst: Arc<[AtomicU8]>,
        dst_offset: usize,
    },
    Dequant {
        src: Arc<[AtomicU8]>,
        src_offset: usize,
        ty: GgmlType,
        n: usize,
        dst: Arc<[AtomicU8]>,
        dst_elem: usize,
        to: DequantTo,
    },
}

/// A job with its ticket and delay.
struct Queued {
    ticket: u64,
    delay: Duration,
    job: Job,
}

/// State the worker and the host (and probes) share.
#[derive(Debug, Default)]
struct Shared {
    /// Ticket of the last job the worker finished (0: none). Tickets finish in order.
    completed: Mutex<u64>,
    /// Notified after each change of `completed`.
    progressed: Condvar,
    /// Bytes copied by finished copy jobs; updated (Release) before `completed`.
    bytes_copied: AtomicU64,
    /// Highest event ticket a `wait` (or `synchronize`) has returned for: every job up to it
    /// has finished, and the host knows it. Raised with Release by the waiting thread, read
    /// with Acquire by `fill` (on whichever thread holds the buffer).
    observed: AtomicU64,
    /// Registrations not yet unregistered (leaked ones stay counted).
    live_registrations: AtomicUsize,
    /// Staging buffers allocated and not freed (leaked ones stay counted).
    live_staging: AtomicUsize,
    /// `fill` calls so far (fills run on any thread).
    fill_calls: AtomicU64,
    /// The configured fault, fill delay and seed, for `fill` (which has no engine).
    fault: Option<HostFault>,
    max_fill_delay: Duration,
    seed: u64,
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

    fn observed(&self) -> u64 {
        // Acquire pairs with the Release fetch_max in `wait` / `synchronize`.
        self.observed.load(Ordering::Acquire)
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

    /// Bytes the stream has finished copying (copy jobs, not conversions).
    pub fn bytes_copied(&self) -> u64 {
        // Acquire pairs with the worker's Release add, made after the bytes were written.
        self.0.bytes_copied.load(Ordering::Acquire)
    }

    /// Jobs the stream has finished.
    pub fn copies_completed(&self) -> u64 {
        *lock(&self.0.completed)
    }

    /// Registrations made and not unregistered (a leaked one stays counted).
    pub fn live_registrations(&self) -> usize {
        self.0.live_registrations.load(Ordering::Acquire)
    }

    /// Staging buffers allocated and not freed (a leaked one stays counted).
    pub fn live_staging(&self) -> usize {
        self.0.live_staging.load(Ordering::Acquire)
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
    tx: Option<Sender<Queued>>,
    worker: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    rng: SmallRng,
    config: HostConfig,
    /// Calls made so far per [`HostOp`] (indexed by `HostOp as usize`).
    calls: [u64; HostOp::COUNT],
    /// Ticket of the last job queued (0: none).
    last_ticket: u64,
    next_staging_id: usize,
    next_region_id: usize,
}

impl HostEngine {
    /// Starts the stream's worker thread.
    pub fn new(config: HostConfig) -> Self {
        let shared = Arc::new(Shared {
            fault: config.fault,
            max_fill_delay: config.max_fill_delay,
            seed: config.seed,
            ..Shared::default()
        });
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
            calls: [0; HostOp::COUNT],
            last_ticket: 0,
            next_staging_id: 0,
            next_region_id: 0,
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

    /// Sends `job` to the stream; returns its ticket.
    fn send(&mut self, job: Job) -> Result<u64, UploadError> {
        let max = u64::try_from(self.config.max_delay.as_nanos()).unwrap_or(u64::MAX);
        let delay = Duration::from_nanos(if max == 0 {
            0
        } else {
            self.rng.gen_range(0..=max)
        });
        let ticket = self.last_ticket + 1;
        let tx = self.tx.as_ref().ok_or(UploadError::StreamStopped)?;
        // The send orders the host's earlier stores (fills) before the worker's loads.
        tx.send(Queued { ticket, delay, job })
            .map_err(|_| UploadError::StreamStopped)?;
        self.last_ticket = ticket;
        Ok(ticket)
    }

    /// Blocks until job `ticket` has finished; then the host knows it.
    fn wait_ticket(&mut self, ticket: u64) -> Result<(), UploadError> {
        let mut done = lock(&self.shared.completed);
        while *done < ticket {
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
        drop(done);
        // Release pairs with Shared::observed's Acquire (in fills on other threads).
        self.shared.observed.fetch_max(ticket, Ordering::Release);
        Ok(())
    }

    fn check_range(what: &str, range: &Range<usize>, src_len: usize, dst: usize, dst_len: usize) {
        assert!(
            range.start <= range.end
                && range.end <= src_len
                && dst.checked_add(range.len()).is_some_and(|e| e <= dst_len),
            "{what} {range:?} of a {src_len}-byte source to {dst}.. of a {dst_len}-byte destination"
        );
    }
}

/// The stream: runs jobs in order until the engine drops its sender.
fn run_stream(rx: &Receiver<Queued>, shared: &Shared) {
    for q in rx {
        let mut paused = lock(&shared.paused);
        while *paused {
            paused = shared
                .resumed
                .wait(paused)
                .unwrap_or_else(PoisonError::into_inner);
        }
        drop(paused);
        if !q.delay.is_zero() {
            std::thread::sleep(q.delay);
        }
        match q.job {
            Job::Copy {
                src,
                range,
                dst,
                dst_offset,
            } => {
                let d = &dst[dst_offset..dst_offset + range.len()];
                for (d, s) in d.iter().zip(&src.bytes[range.clone()]) {
                    d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
                }
                // Acquire pairs with the Release store of `gone`; checked after the read, so a
                // free during it is caught too.
                if src.gone.load(Ordering::Acquire) {
                    shared.violation(if src.registered {
                        Violation::CopyFromUnregistered { region: src.id }
                    } else {
                        Violation::CopyFromFreed { buffer: src.id }
                    });
                }
                // Release pairs with HostProbe::bytes_copied's Acquire: the bytes are in `dst`.
                shared
                    .bytes_copied
                    .fetch_add(range.len() as u64, Ordering::Release);
            }
            Job::Dequant {
                src,
                src_offset,
                ty,
                n,
                dst,
                dst_elem,
                to,
            } => {
                let bytes = ty
                    .bytes_for(n as u64)
                    .and_then(|b| usize::try_from(b).ok())
                    .filter(|&b| src_offset + b <= src.len() && 2 * (dst_elem + n) <= dst.len());
                match bytes {
                    None => shared.violation(Violation::DequantRefused {
                        reason: format!(
                            "{n} {ty} elements from byte {src_offset} of {} into element \
                             {dst_elem} of {} bytes",
                            src.len(),
                            dst.len()
                        ),
                    }),
                    Some(b) => {
                        let raw: Vec<u8> = src[src_offset..src_offset + b]
                            .iter()
                            .map(|x| x.load(Ordering::Relaxed))
                            .collect();
                        match convert(ty, &raw, n, to) {
                            Ok(out) => {
                                let d = &dst[2 * dst_elem..2 * (dst_elem + n)];
                                for (d, s) in d.chunks_exact(2).zip(out) {
                                    let [lo, hi] = s.to_le_bytes();
                                    d[0].store(lo, Ordering::Relaxed);
                                    d[1].store(hi, Ordering::Relaxed);
                                }
                            }
                            Err(reason) => shared.violation(Violation::DequantRefused { reason }),
                        }
                    }
                }
            }
        }
        // The mutex orders the writes above before any `wait` that sees this ticket.
        *lock(&shared.completed) = q.ticket;
        shared.progressed.notify_all();
    }
}

/// The device conversion of a dequantization job: the CPU dequantizer.
#[cfg(not(all(feature = "cuda-emu", not(feature = "cuda"))))]
fn convert(ty: GgmlType, raw: &[u8], n: usize, to: DequantTo) -> Result<Vec<u16>, String> {
    use half::{bf16, f16};
    match to {
        DequantTo::F16 => {
            let mut v = vec![f16::ZERO; n];
            crate::gguf::dequantize_into_f16(ty, raw, &mut v).map_err(|e| e.to_string())?;
            Ok(v.iter().map(|x| x.to_bits()).collect())
        }
        DequantTo::BF16 => {
            let mut v = vec![bf16::ZERO; n];
            crate::gguf::dequantize_into_bf16(ty, raw, &mut v).map_err(|e| e.to_string())?;
            Ok(v.iter().map(|x| x.to_bits()).collect())
        }
    }
}

/// The device conversion of a dequantization job: the device kernel, on the CPU emulation.
#[cfg(all(feature = "cuda-emu", not(feature = "cuda")))]
fn convert(ty: GgmlType, raw: &[u8], n: usize, to: DequantTo) -> Result<Vec<u16>, String> {
    use crate::cuda_emu::{ffi, EmuBuf};
    let src = EmuBuf::from_slice(raw).ok_or("cannot map an emulated device buffer")?;
    let out = EmuBuf::zeroed(2 * n).ok_or("cannot map an emulated device buffer")?;
    let dtype = match to {
        DequantTo::F16 => ffi::PKV_DTYPE_F16,
        DequantTo::BF16 => ffi::PKV_DTYPE_BF16,
    };
    let (ty_id, n_i64) = (
        i32::try_from(ty.id()).map_err(|e| e.to_string())?,
        i64::try_from(n).map_err(|e| e.to_string())?,
    );
    // SAFETY: `src` holds the raw blocks (`raw.len()` bytes, which the worker sized for `n`
    // elements of `ty`), `out` 2 * n bytes; both are live, 16-byte aligned guarded allocations
    // that do not overlap, and the emulated launch is synchronous, so nothing reads them after.
    let status = unsafe {
        ffi::pkv_dequantize(
            out.ptr(),
            dtype as i32,
            src.ptr() as *const std::ffi::c_void,
            ty_id,
            n_i64,
            std::ptr::null_mut(),
        )
    };
    if status != ffi::PKV_OK as i32 {
        return Err(format!(
            "pkv_dequantize: {} (status {status})",
            crate::cuda_emu::status_string(status)
        ));
    }
    Ok(out.as_slice::<u8>()[..2 * n]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect())
}

impl CopyEngine for HostEngine {
    type Error = UploadError;
    type Staging = HostStaging;
    type Dst = HostDst;

    fn alloc_staging(&mut self, bytes: usize) -> Result<HostStaging, UploadError> {
        self.call(HostOp::StagingAlloc)?;
        let id = self.next_staging_id;
        self.next_staging_id += 1;
        // Release pairs with HostProbe::live_staging's Acquire.
        self.shared.live_staging.fetch_add(1, Ordering::Release);
        Ok(HostStaging {
            mem: Arc::new(SourceMem {
                id,
                registered: false,
                bytes: (0..bytes).map(|_| AtomicU8::new(0)).collect(),
                gone: AtomicBool::new(false),
            }),
            shared: Arc::clone(&self.shared),
            event: 0,
            reads: Vec::new(),
        })
    }

    // The `unsafe` of the methods below is the engine traits' contract for engines whose
    // memory a device reads behind the host's back. This engine needs none of it for soundness
    // (its bytes are atomics, freed memory is only flagged, registrations are copies): it
    // records each breach of the contract as a Violation for the tests to see instead.
    unsafe fn free_staging(&mut self, staging: HostStaging) {
        let observed = self.shared.observed();
        for (_, read) in staging.reads.iter().filter(|(t, _)| *t > observed) {
            self.shared.violation(Violation::FreedUnderCopy {
                buffer: staging.mem.id,
                read: read.clone(),
            });
        }
        // Release pairs with the worker's Acquire load after a job's read.
        staging.mem.gone.store(true, Ordering::Release);
        self.shared.live_staging.fetch_sub(1, Ordering::Release);
    }

    fn alloc_dst(&mut self, bytes: usize) -> Result<HostDst, UploadError> {
        self.call(HostOp::DstAlloc)?;
        Ok(HostDst {
            mem: (0..bytes).map(|_| AtomicU8::new(HOST_DST_POISON)).collect(),
        })
    }

    unsafe fn fill(staging: &mut HostStaging, at: usize, src: &[u8]) {
        // Relaxed: the counter only numbers calls; which thread's call is number n is the
        // test's business (it injects one panic somewhere in an upload).
        let call = staging.shared.fill_calls.fetch_add(1, Ordering::Relaxed);
        if let Some(HostFault {
            op: HostOp::Fill,
            call: n,
        }) = staging.shared.fault
        {
            assert!(call != n, "injected panic in host engine call fill #{call}");
        }
        let max = u64::try_from(staging.shared.max_fill_delay.as_nanos()).unwrap_or(u64::MAX);
        if max > 0 {
            let mut rng = SmallRng::seed_from_u64(staging.shared.seed ^ call.rotate_left(32));
            std::thread::sleep(Duration::from_nanos(rng.gen_range(0..=max)));
        }
        let write = at..at + src.len();
        assert!(
            write.end <= staging.mem.bytes.len(),
            "fill {write:?} past a {}-byte staging buffer",
            staging.mem.bytes.len()
        );
        let observed = staging.shared.observed();
        staging.reads.retain(|(t, _)| *t > observed);
        for (_, read) in &staging.reads {
            if read.start < write.end && write.start < read.end {
                staging.shared.violation(Violation::RewriteUnderCopy {
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
        Self::check_range(
            "copy",
            &range,
            staging.mem.bytes.len(),
            dst_offset,
            dst.mem.len(),
        );
        let ticket = self.send(Job::Copy {
            src: Arc::clone(&staging.mem),
            range: range.clone(),
            dst: Arc::clone(&dst.mem),
            dst_offset,
        })?;
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
        self.wait_ticket(staging.event)
    }
}

impl DequantEngine for HostEngine {
    unsafe fn dequantize_async(
        &mut self,
        src: &HostDst,
        src_offset: usize,
        ty: GgmlType,
        n_elements: usize,
        dst: &mut HostDst,
        dst_elem: usize,
        to: DequantTo,
    ) -> Result<(), UploadError> {
        self.call(HostOp::Dequant)?;
        // The alignment a device kernel needs (pkv_dequantize refuses less), checked here too.
        if src_offset % 16 != 0 || (2 * dst_elem) % 16 != 0 {
            self.shared.violation(Violation::DequantRefused {
                reason: format!(
                    "misaligned: source offset {src_offset}, destination element {dst_elem}"
                ),
            });
        }
        self.send(Job::Dequant {
            src: Arc::clone(&src.mem),
            src_offset,
            ty,
            n: n_elements,
            dst: Arc::clone(&dst.mem),
            dst_elem,
            to,
        })?;
        Ok(())
    }
}

impl RegisterEngine for HostEngine {
    type Registered = HostRegistered;

    unsafe fn register(&mut self, host: &[u8]) -> Result<HostRegistered, UploadError> {
        self.call(HostOp::Register)?;
        let id = self.next_region_id;
        self.next_region_id += 1;
        // Release pairs with HostProbe::live_registrations' Acquire.
        self.shared
            .live_registrations
            .fetch_add(1, Ordering::Release);
        Ok(HostRegistered {
            mem: Arc::new(SourceMem {
                id,
                registered: true,
                bytes: host.iter().map(|&b| AtomicU8::new(b)).collect(),
                gone: AtomicBool::new(false),
            }),
            reads: Vec::new(),
        })
    }

    unsafe fn copy_registered_async(
        &mut self,
        registered: &mut HostRegistered,
        range: Range<usize>,
        dst: &mut HostDst,
        dst_offset: usize,
    ) -> Result<(), UploadError> {
        self.call(HostOp::CopyRegistered)?;
        Self::check_range(
            "registered copy",
            &range,
            registered.mem.bytes.len(),
            dst_offset,
            dst.mem.len(),
        );
        let ticket = self.send(Job::Copy {
            src: Arc::clone(&registered.mem),
            range: range.clone(),
            dst: Arc::clone(&dst.mem),
            dst_offset,
        })?;
        registered.reads.push((ticket, range));
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), UploadError> {
        self.call(HostOp::Synchronize)?;
        self.wait_ticket(self.last_ticket)
    }

    unsafe fn unregister(&mut self, registered: HostRegistered) -> Result<(), UploadError> {
        self.call(HostOp::Unregister)?;
        let observed = self.shared.observed();
        for (_, read) in registered.reads.iter().filter(|(t, _)| *t > observed) {
            self.shared.violation(Violation::UnregisteredUnderCopy {
                region: registered.mem.id,
                read: read.clone(),
            });
        }
        // Release pairs with the worker's Acquire load after a job's read.
        registered.mem.gone.store(true, Ordering::Release);
        self.shared
            .live_registrations
            .fetch_sub(1, Ordering::Release);
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
/// that runs the upload schedules in ordinary tests.
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
    /// The engine's stream thread has stopped, so queued jobs will never complete.
    #[error("the host copy stream's worker thread has stopped")]
    StreamStopped,
}
