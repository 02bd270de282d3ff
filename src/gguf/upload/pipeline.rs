//! The staged upload: a ring of staging buffers filled by a pool of fill threads and drained by
//! one stream of asynchronous copies, generic over the [`CopyEngine`].

use super::engine::{CopyEngine, DequantEngine};
use super::plan::{Piece, Planner};
use super::{device_can_dequantize, DequantTo, RingError, UploadProgress, DEQUANT_GRANULE};
use crate::gguf::{GgmlType, Gguf, TensorInfo};
use std::any::Any;
use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};

/// An upload's result: each tensor with its destination, in upload order.
pub type Landed<'a, D> = Vec<(TensorInfo<'a>, D)>;

/// Most fill threads a ring runs.
pub const MAX_FILL_THREADS: usize = 64;

/// A ring of staging buffers over a [`CopyEngine`], reusable across uploads: n-buffered staging
/// as in NVIDIA's "How to Overlap Data Transfers", with one event per buffer and a pool of fill
/// threads.
///
/// # Schedule
///
/// An upload cuts its tensors, in the order given, into *fills* of at most one buffer each
/// (`upload/plan.rs`: a fill holds pieces of as many tensors as fit, a tensor larger than a
/// buffer spans several fills). The thread that called the upload (the *coordinator*) owns the
/// engine; it hands fill `k` with a free buffer to an idle fill thread, which copies the
/// pieces' bytes from the file into the buffer ([`CopyEngine::fill`]) and hands the buffer
/// back. The coordinator queues the copies of a returned fill at once — fills come back, and
/// are queued, in the order they finish, not the order they were planned — each piece its own
/// copy straight into its tensor's destination (or, dequantizing, into the buffer's twin on the
/// device followed by the conversion into the destination), then records the buffer's event.
/// Free buffers are handed out oldest record first. So several fills run at once (one host core
/// copies from the page cache slower than a PCIe 5 DMA engine reads), while the copies of the
/// fills before them run on the stream. With `fill_threads == 0` the coordinator fills each
/// buffer itself (no threads).
///
/// # Never overwritten early
///
/// Invariant (between any two calls into the engine, so also when an error or a panicking
/// progress callback leaves an upload): every copy queued from buffer `i` is followed on the
/// stream by a record of buffer `i`'s event, so once a wait on that event returns, no queued
/// copy reads the buffer. The coordinator waits on a buffer's event before it hands the buffer
/// to a fill thread (the hand-over is a channel send, which orders the wait before the thread's
/// writes) and before it frees it; while a fill thread holds a buffer, nothing is queued from
/// it. A copy queued whose record then failed breaks the invariant until [`StagingRing`]'s
/// resync (a record and wait on any one buffer — the stream runs in order, so that event covers
/// every earlier copy) succeeds; until then the ring neither writes nor frees a buffer, and a
/// drop that cannot resync leaks the ring rather than free it under a copy.
///
/// # Never lost
///
/// Every exit from an upload — success, an engine error, a panicking progress callback, a panic
/// inside a fill (caught on the fill thread and resumed on the coordinator) — first takes back
/// every buffer the fill threads hold, so the ring keeps all of its buffers.
///
/// # Progress
///
/// A fill's pieces are reported once a wait has returned on an event recorded after its copies
/// (every buffer is waited on before reuse and at the end), and fills are reported in planned
/// order: the callback sees completed bytes only, piece by piece in the order the tensors were
/// given.
pub struct StagingRing<E: CopyEngine> {
    engine: E,
    /// Buffer `i` with its event. `Some` between uploads; during one, `None` while a fill
    /// thread holds it. Every copy queued from a buffer is followed by a record of its event,
    /// except while `unsynced`.
    slots: Vec<Option<E::Staging>>,
    /// Bytes per buffer, at least 1.
    staging_bytes: usize,
    /// Fill threads per upload, 0 (the coordinator fills) to [`MAX_FILL_THREADS`].
    fill_threads: usize,
    /// A copy may be pending that no event recorded after it covers (its queueing or its
    /// record failed): no buffer may be written or freed before [`StagingRing::resync`].
    unsynced: bool,
    /// What the last upload did.
    stats: FillStats,
}

/// What an upload's fills did (see [`StagingRing::last_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FillStats {
    /// Fills queued (each one buffer's worth of pieces).
    pub fills: usize,
    /// Fills queued while a fill planned before them was still being filled: the stream got
    /// their copies earlier than an in-order schedule would have given them.
    pub out_of_order: usize,
    /// Fill threads that ran (0: the calling thread filled).
    pub threads: usize,
}

impl<E: CopyEngine> std::fmt::Debug for StagingRing<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingRing")
            .field("buffers", &self.slots.len())
            .field("staging_bytes", &self.staging_bytes)
            .field("fill_threads", &self.fill_threads)
            .field("unsynced", &self.unsynced)
            .finish_non_exhaustive()
    }
}

impl<E: CopyEngine> StagingRing<E> {
    /// Allocates `buffers` staging buffers of `staging_bytes` each from `engine`; uploads fill
    /// them on one fill thread until [`StagingRing::set_fill_threads`].
    ///
    /// # Errors
    /// The engine's allocation error (buffers already allocated are freed).
    pub fn new(
        engine: E,
        buffers: NonZeroUsize,
        staging_bytes: NonZeroUsize,
    ) -> Result<Self, E::Error> {
        let mut ring = Self {
            engine,
            slots: Vec::with_capacity(buffers.get()),
            staging_bytes: staging_bytes.get(),
            fill_threads: 1,
            unsynced: false,
            stats: FillStats::default(),
        };
        for _ in 0..buffers.get() {
            let s = ring.engine.alloc_staging(ring.staging_bytes)?;
            ring.slots.push(Some(s));
        }
        Ok(ring)
    }

    /// Sets the fill threads of later uploads: 0 fills on the calling thread, more run that
    /// many fills at once (capped at [`MAX_FILL_THREADS`]; more threads than buffers wait).
    pub fn set_fill_threads(&mut self, threads: usize) {
        self.fill_threads = threads.min(MAX_FILL_THREADS);
    }

    /// Fill threads per upload.
    pub fn fill_threads(&self) -> usize {
        self.fill_threads
    }

    /// What the last upload's fills did (all zero before the first, or after one that failed,
    /// or panicked, before its first fill).
    pub fn last_stats(&self) -> FillStats {
        self.stats
    }

    /// Zeroes [`StagingRing::last_stats`], for a caller whose upload is refused before it
    /// reaches the ring (the uploader's own checks).
    #[cfg(feature = "cuda")]
    pub(crate) fn clear_stats(&mut self) {
        self.stats = FillStats::default();
    }

    /// The engine.
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// Number of staging buffers.
    pub fn buffers(&self) -> usize {
        self.slots.len()
    }

    /// Bytes per staging buffer.
    pub fn staging_bytes(&self) -> usize {
        self.staging_bytes
    }

    /// Copies every tensor of `gguf` into a destination of its own, largest first
    /// ([`Gguf::tensors_largest_first`]), calling `progress` as pieces complete (its last call
    /// reports `done == total`); returns the tensors with their destinations in that order once
    /// every copy has completed.
    ///
    /// # Errors
    /// The engine's error. Destinations already allocated are dropped; the ring stays usable.
    pub fn upload<'a>(
        &mut self,
        gguf: &Gguf<'a>,
        mut progress: impl FnMut(UploadProgress<'_>),
    ) -> Result<Landed<'a, E::Dst>, E::Error> {
        let order: Vec<TensorInfo<'a>> =
            gguf.tensors_largest_first().into_iter().copied().collect();
        let total = gguf.total_tensor_bytes();
        let data: Vec<&[u8]> = order.iter().map(TensorInfo::data).collect();
        let dst = self.upload_slices(&data, |ti, done| {
            progress(UploadProgress {
                done,
                total,
                tensor: order[ti].name(),
            })
        })?;
        Ok(order.into_iter().zip(dst).collect())
    }

    /// Copies `tensors`, in this order, each into a destination of its own; `progress(i, done)`
    /// is called as pieces complete, with `i` the tensor the piece belongs to and `done` the
    /// bytes completed so far (a running sum in the order of `tensors`). Returns the
    /// destinations in the order of `tensors` once every copy has completed.
    ///
    /// Every destination is allocated before the first copy is queued, so running out of memory
    /// costs no copy.
    ///
    /// # Errors
    /// The engine's error. Destinations already allocated are dropped; the ring stays usable.
    pub fn upload_slices(
        &mut self,
        tensors: &[&[u8]],
        progress: impl FnMut(usize, u64),
    ) -> Result<Vec<E::Dst>, E::Error> {
        // Whatever happens below, the stats describe this upload, not the one before.
        self.stats = FillStats::default();
        if self.unsynced {
            self.resync()?;
        }
        let mut dst = Vec::with_capacity(tensors.len());
        for t in tensors {
            dst.push(self.engine.alloc_dst(t.len())?);
        }
        let planner = Planner::raw(
            tensors.iter().map(|t| t.len()).collect(),
            self.staging_bytes,
        );
        self.run(
            tensors,
            planner,
            |engine, staging, _slot, p| {
                let len = p.src.len();
                // SAFETY: the coordinator calls this for a piece of a fill that a fill thread
                // has just written ([p.at, p.at + len) inside the buffer: the planner keeps
                // every piece inside staging_bytes) and records the buffer's event after it; the
                // destination range [p.src.start, p.src.end) lies inside dst[p.tensor],
                // allocated with the tensor's length. The buffer is not written again before a
                // wait on that event, nor freed before the waits of Drop.
                unsafe {
                    engine.copy_async(staging, p.at..p.at + len, &mut dst[p.tensor], p.src.start)
                }
            },
            progress,
        )?;
        Ok(dst)
    }

    /// Restores the invariant after a copy whose record may be missing: records a buffer's
    /// event after everything queued so far (the stream runs in order, so it covers every
    /// earlier copy) and waits on it.
    fn resync(&mut self) -> Result<(), E::Error> {
        // Every buffer is home between uploads; with none home nothing may be written or freed
        // anyway, so the ring stays unsynced.
        let Some(s) = self.slots.iter_mut().flatten().next() else {
            return Ok(());
        };
        self.engine.record(s)?;
        self.engine.wait(s)?;
        self.unsynced = false;
        Ok(())
    }

    /// Runs one upload's fills: see the type's docs. `queue` queues the copies (and whatever
    /// follows them on the stream) of one piece of a filled buffer; the coordinator records
    /// the buffer's event after a fill's last piece.
    fn run(
        &mut self,
        sources: &[&[u8]],
        planner: Planner,
        queue: impl FnMut(&mut E, &mut E::Staging, usize, &Piece) -> Result<(), E::Error>,
        progress: impl FnMut(usize, u64),
    ) -> Result<(), E::Error> {
        // A panic (a fill's, resumed on the coordinator, or the progress callback's) ends the
        // upload as an error does: the stats rule below applies to it before it propagates.
        let result = catch_unwind(AssertUnwindSafe(|| {
            self.run_fills(sources, planner, queue, progress)
        }));
        // An upload that failed before its first fill was queued reports all zero (as
        // `last_stats` says), not the fill threads it spawned for nothing.
        if !matches!(result, Ok(Ok(()))) && self.stats.fills == 0 {
            self.stats = FillStats::default();
        }
        result.unwrap_or_else(|panic| resume_unwind(panic))
    }

    /// [`StagingRing::run`] without the stats rule for a failed upload.
    fn run_fills(
        &mut self,
        sources: &[&[u8]],
        mut planner: Planner,
        mut queue: impl FnMut(&mut E, &mut E::Staging, usize, &Piece) -> Result<(), E::Error>,
        mut progress: impl FnMut(usize, u64),
    ) -> Result<(), E::Error> {
        let threads = self.fill_threads;
        let Self {
            engine,
            slots,
            unsynced,
            stats,
            ..
        } = self;
        *stats = FillStats::default();
        std::thread::scope(|scope| {
            let (done_tx, done_rx) = mpsc::channel::<Done<E::Staging>>();
            let mut jobs = Vec::with_capacity(threads);
            for attempt in 0..threads {
                let (tx, rx) = mpsc::channel::<Job<E::Staging>>();
                let done_tx = done_tx.clone();
                // The thread's id is the index its job channel gets in `jobs` (the fleet hands
                // it back to `idle` and indexes `jobs` with it), not the attempt number: after
                // a failed spawn the two differ.
                let w = jobs.len();
                let spawned = !spawn_refused(attempt)
                    && std::thread::Builder::new()
                        .name(format!("pagedkv-fill-{w}"))
                        .spawn_scoped(scope, move || fill_worker::<E>(w, &rx, &done_tx, sources))
                        .is_ok();
                // A thread that cannot be spawned is one fill thread fewer; with none, the
                // coordinator fills itself.
                if spawned {
                    jobs.push(tx);
                }
            }
            drop(done_tx);
            stats.threads = jobs.len();
            let mut fleet = Fleet {
                idle: (0..jobs.len()).rev().collect(),
                jobs,
                done: done_rx,
                ready: VecDeque::new(),
                slots,
                out: 0,
                sources,
            };
            let mut c = Coordinator {
                records: 0,
                known: 0,
                slot_rec: vec![0; fleet.slots.len()],
                free: (0..fleet.slots.len()).collect(),
                pending: VecDeque::new(),
                reported: 0,
                done_bytes: 0,
                stats,
            };
            c.drive::<E>(
                engine,
                &mut fleet,
                unsynced,
                &mut planner,
                &mut queue,
                &mut progress,
            )
            // `fleet` drops here, before the scope joins the fill threads: it takes back every
            // buffer still out and closes the job channels, so the threads exit.
        })
    }
}

impl<E: DequantEngine> StagingRing<E> {
    /// As [`StagingRing::upload`], landing every tensor dequantized to `to` (its destination
    /// holds `n_elements` 2-byte values): each piece is copied into the device twin of its
    /// staging buffer, then converted on the device into the tensor's destination. Progress
    /// counts the file's bytes.
    ///
    /// # Errors
    /// As [`StagingRing::upload_slices_dequantized`].
    pub fn upload_dequantized<'a>(
        &mut self,
        gguf: &Gguf<'a>,
        to: DequantTo,
        mut progress: impl FnMut(UploadProgress<'_>),
    ) -> Result<Landed<'a, E::Dst>, RingError<E::Error>> {
        let order: Vec<TensorInfo<'a>> =
            gguf.tensors_largest_first().into_iter().copied().collect();
        let total = gguf.total_tensor_bytes();
        let data: Vec<(GgmlType, &[u8])> = order.iter().map(|t| (t.ty(), t.data())).collect();
        let dst = self.upload_slices_dequantized(&data, to, |ti, done| {
            progress(UploadProgress {
                done,
                total,
                tensor: order[ti].name(),
            })
        })?;
        Ok(order.into_iter().zip(dst).collect())
    }

    /// As [`StagingRing::upload_slices`], for tensors `(type, bytes)` landed dequantized to
    /// `to`: destination `i` holds the tensor's elements as 2-byte values of `to`, bit for bit
    /// [`crate::gguf::dequantize_into_f16`] / [`crate::gguf::dequantize_into_bf16`] of its
    /// bytes. Pieces are cut at whole units of [`DEQUANT_GRANULE`] elements and start on
    /// 16-byte boundaries; the device staging area is one twin per staging buffer (`buffers x
    /// staging_bytes` rounded up to 16, allocated for the upload), so a piece's conversion is
    /// covered by its buffer's event.
    ///
    /// # Errors
    /// [`RingError::NotDequantizable`] or [`RingError::PartialBlock`] for a tensor the device
    /// cannot take, [`RingError::StagingTooSmall`] for buffers below one unit (before anything
    /// is allocated); [`RingError::Engine`] otherwise (destinations already allocated are
    /// dropped; the ring stays usable).
    pub fn upload_slices_dequantized(
        &mut self,
        tensors: &[(GgmlType, &[u8])],
        to: DequantTo,
        progress: impl FnMut(usize, u64),
    ) -> Result<Vec<E::Dst>, RingError<E::Error>> {
        self.stats = FillStats::default();
        let mut granules = Vec::with_capacity(tensors.len());
        for (i, &(ty, data)) in tensors.iter().enumerate() {
            granules.push(dequant_granule(i, ty, data.len())?);
        }
        let stride = self.staging_bytes.next_multiple_of(16);
        let planner = Planner::aligned(
            tensors.iter().map(|t| t.1.len()).collect(),
            granules,
            16,
            self.staging_bytes,
        )
        .map_err(|needed| RingError::StagingTooSmall {
            needed,
            have: self.staging_bytes,
        })?;
        if self.unsynced {
            self.resync()?;
        }
        let mut dst = Vec::with_capacity(tensors.len());
        for &(ty, data) in tensors {
            dst.push(
                self.engine
                    .alloc_dst(elements(ty, data.len()) * DequantTo::BYTES)?,
            );
        }
        let mut twin = self.engine.alloc_dst(stride * self.slots.len())?;
        let sources: Vec<&[u8]> = tensors.iter().map(|t| t.1).collect();
        self.run(
            &sources,
            planner,
            |engine, staging, slot, p| {
                let (ty, len) = (tensors[p.tensor].0, p.src.len());
                let at = slot * stride + p.at;
                // SAFETY: as in upload_slices for the staging side; the twin range [at, at +
                // len) lies inside the twin (p.at + len <= staging_bytes <= stride) and belongs
                // to this buffer alone, whose event — recorded after this piece — is waited on
                // before the buffer, and so its twin, is used again.
                unsafe { engine.copy_async(staging, p.at..p.at + len, &mut twin, at) }?;
                let bs = ty.block_size() as usize;
                let ts = ty.type_size() as usize;
                // SAFETY: `ty` passed dequant_granule; the piece is whole blocks (cut at
                // granules, or the tensor's whole-block tail), so its element range is exact
                // and inside dst[p.tensor] (allocated for all the tensor's elements). `at` is a
                // multiple of 16 (stride and p.at are) and the element offset a multiple of 256
                // (pieces start at granules), so 2 * dst_elem is too. The copy that writes the
                // twin's bytes is queued just before, on the same stream; twin and destination
                // are different allocations.
                unsafe {
                    engine.dequantize_async(
                        &twin,
                        at,
                        ty,
                        len / ts * bs,
                        &mut dst[p.tensor],
                        p.src.start / ts * bs,
                        to,
                    )
                }
            },
            progress,
        )?;
        drop(twin);
        Ok(dst)
    }
}

/// Elements in `bytes` of `ty` (whole blocks, checked by [`dequant_granule`]).
pub(crate) fn elements(ty: GgmlType, bytes: usize) -> usize {
    bytes / ty.type_size() as usize * ty.block_size() as usize
}

/// The bytes of one cut unit of tensor `i`, after checking that the device converts its type
/// and that its bytes are whole blocks.
pub(crate) fn dequant_granule<E>(
    i: usize,
    ty: GgmlType,
    bytes: usize,
) -> Result<usize, RingError<E>> {
    if !device_can_dequantize(ty) {
        return Err(RingError::NotDequantizable { tensor: i, ty });
    }
    if bytes % ty.type_size() as usize != 0 {
        return Err(RingError::PartialBlock {
            tensor: i,
            ty,
            bytes,
        });
    }
    // Every supported block size divides DEQUANT_GRANULE.
    Ok(ty
        .bytes_for(DEQUANT_GRANULE)
        .map_or(usize::MAX, |b| b as usize))
}

impl<E: CopyEngine> Drop for StagingRing<E> {
    fn drop(&mut self) {
        let synced = !self.unsynced || self.resync().is_ok();
        for mut s in std::mem::take(&mut self.slots).into_iter().flatten() {
            if synced && self.engine.wait(&mut s).is_ok() {
                // SAFETY: every copy queued from `s` was followed by a record of its event (the
                // invariant, which holds: `synced`), and the wait on that event just returned.
                unsafe { self.engine.free_staging(s) };
            }
            // Otherwise a copy may still read it: leak it (dropping the handle frees nothing).
        }
    }
}

// ---- fill threads ---------------------------------------------------------------------------

/// Whether spawn attempt `attempt` of an upload is made to fail (unit tests only: a spawn
/// failure cannot be provoked from outside).
#[cfg(test)]
fn spawn_refused(attempt: usize) -> bool {
    tests::REFUSED_SPAWNS.with(|r| attempt < 64 && r.get() >> attempt & 1 == 1)
}

#[cfg(not(test))]
#[inline(always)]
fn spawn_refused(_attempt: usize) -> bool {
    false
}

/// A fill handed to a fill thread: write `pieces` into `staging` (buffer `slot`).
struct Job<S> {
    /// Planned order of the fill.
    seq: usize,
    slot: usize,
    staging: S,
    pieces: Vec<Piece>,
}

/// A fill handed back by fill thread `worker` (`None`: filled on the coordinator), with the
/// panic of the fill if it panicked.
struct Done<S> {
    worker: Option<usize>,
    job: Job<S>,
    panic: Option<Box<dyn Any + Send>>,
}

/// A fill whose buffer is home again: what the coordinator queues.
struct Back {
    seq: usize,
    slot: usize,
    pieces: Vec<Piece>,
    panic: Option<Box<dyn Any + Send>>,
}

/// Writes a job's pieces into its buffer; a panic is caught so that the buffer goes back.
fn fill_job<E: CopyEngine>(
    job: &mut Job<E::Staging>,
    sources: &[&[u8]],
) -> Option<Box<dyn Any + Send>> {
    catch_unwind(AssertUnwindSafe(|| {
        for p in &job.pieces {
            // SAFETY: the planner keeps [p.at, p.at + len) inside the buffer; the coordinator
            // waited on the buffer's event (covering every copy queued from it) before handing
            // it over through a channel, which orders that wait before these writes; nothing is
            // queued from the buffer while this thread holds it.
            unsafe { E::fill(&mut job.staging, p.at, &sources[p.tensor][p.src.clone()]) };
        }
    }))
    .err()
}

/// A fill thread: fills jobs until its job channel closes (or the coordinator is gone).
fn fill_worker<E: CopyEngine>(
    id: usize,
    jobs: &Receiver<Job<E::Staging>>,
    done: &Sender<Done<E::Staging>>,
    sources: &[&[u8]],
) {
    for mut job in jobs {
        let panic = fill_job::<E>(&mut job, sources);
        let back = Done {
            worker: Some(id),
            job,
            panic,
        };
        if done.send(back).is_err() {
            return;
        }
    }
}

/// The fill threads of one upload, and the buffers they hold. Dropping it takes back every
/// buffer still out (waiting for the fills to finish) and closes the job channels.
struct Fleet<'s, 'd, S> {
    /// Job channel of fill thread `i`; empty: the coordinator fills.
    jobs: Vec<Sender<Job<S>>>,
    /// Fill threads without a job.
    idle: Vec<usize>,
    done: Receiver<Done<S>>,
    /// Fills done on the coordinator, not yet taken.
    ready: VecDeque<Done<S>>,
    /// The ring's buffers; `None` while out.
    slots: &'s mut Vec<Option<S>>,
    /// Fills out at fill threads.
    out: usize,
    sources: &'d [&'d [u8]],
}

impl<S> Fleet<'_, '_, S> {
    /// Whether a fill can be handed out now (an idle thread, or no threads at all).
    fn can_take(&self) -> bool {
        self.jobs.is_empty() || !self.idle.is_empty()
    }

    /// Hands the buffer of `slot` (home) over for fill `seq`, or fills it here without threads.
    fn dispatch<E: CopyEngine<Staging = S>>(
        &mut self,
        seq: usize,
        slot: usize,
        pieces: Vec<Piece>,
    ) {
        let Some(staging) = self.slots[slot].take() else {
            return; // the coordinator dispatches home buffers only
        };
        let mut job = Job {
            seq,
            slot,
            staging,
            pieces,
        };
        while let Some(w) = self.idle.pop() {
            match self.jobs[w].send(job) {
                Ok(()) => {
                    self.out += 1;
                    return;
                }
                // The thread is gone (it cannot be: a fill's panic is caught on the thread);
                // try another, and fill here when none is left.
                Err(mpsc::SendError(j)) => job = j,
            }
        }
        let panic = fill_job::<E>(&mut job, self.sources);
        self.ready.push_back(Done {
            worker: None,
            job,
            panic,
        });
    }

    /// A finished fill, waiting for one if `block`, with its buffer home again; `None` when
    /// none is out (or, not blocking, none has finished).
    fn take(&mut self, block: bool) -> Option<Back> {
        let d = match self.ready.pop_front() {
            Some(d) => d,
            None if self.out == 0 => return None,
            // The threads hold senders while a fill is out, so a blocking receive returns.
            None if block => match self.done.recv() {
                Ok(d) => d,
                Err(_) => return self.lost(),
            },
            None => match self.done.try_recv() {
                Ok(d) => d,
                Err(TryRecvError::Empty) => return None,
                Err(TryRecvError::Disconnected) => return self.lost(),
            },
        };
        Some(self.home(d))
    }

    /// Every fill thread is gone with fills out (cannot happen: a fill's panic is caught on
    /// its thread): those buffers are lost (leaked by the ring, never freed under a copy) and
    /// the coordinator fills the rest itself.
    fn lost(&mut self) -> Option<Back> {
        self.out = 0;
        self.jobs.clear();
        self.idle.clear();
        None
    }

    fn home(&mut self, d: Done<S>) -> Back {
        if let Some(w) = d.worker {
            self.out -= 1;
            self.idle.push(w);
        }
        let Job {
            seq,
            slot,
            staging,
            pieces,
        } = d.job;
        self.slots[slot] = Some(staging);
        Back {
            seq,
            slot,
            pieces,
            panic: d.panic,
        }
    }
}

impl<S> Drop for Fleet<'_, '_, S> {
    fn drop(&mut self) {
        // Closed job channels let each thread finish its fill, send it and exit.
        self.jobs.clear();
        while self.out > 0 {
            match self.done.recv() {
                Ok(d) => {
                    let _ = self.home(d);
                }
                Err(_) => break, // every thread is gone: nothing more can come back
            }
        }
    }
}

// ---- the coordinator ---------------------------------------------------------------------------

/// A fill whose copies are queued: the number of the record that covers them, and its pieces
/// (tensor, bytes) for the progress report.
type QueuedFill = (u64, Vec<(usize, usize)>);

/// The coordinator's bookkeeping for one upload.
struct Coordinator<'a> {
    /// Records made in this upload (record numbers start at 1).
    records: u64,
    /// Every record numbered up to this has been waited on: its copies are complete.
    known: u64,
    /// Number of slot `i`'s last record in this upload (0: none yet).
    slot_rec: Vec<u64>,
    /// Home buffers, oldest record first: the next fill takes the front.
    free: VecDeque<usize>,
    /// Fills dispatched and not yet reported, in planned order: the record number that covers
    /// each once its copies are queued, and its pieces (tensor, bytes).
    pending: VecDeque<Option<QueuedFill>>,
    /// Fills reported so far (the planned index of `pending`'s front).
    reported: usize,
    /// Bytes reported so far.
    done_bytes: u64,
    /// The ring's statistics of this upload.
    stats: &'a mut FillStats,
}

impl Coordinator<'_> {
    /// Reports, in planned order, every fill whose copies are known complete.
    fn report(&mut self, progress: &mut impl FnMut(usize, u64)) {
        while let Some(Some((rec, _))) = self.pending.front() {
            if *rec > self.known {
                break;
            }
            let Some(Some((_, pieces))) = self.pending.pop_front() else {
                break;
            };
            self.reported += 1;
            for (tensor, len) in pieces {
                self.done_bytes += len as u64;
                progress(tensor, self.done_bytes);
            }
        }
    }

    /// Waits on `slot`'s event: every copy queued from it (in this upload or before) is done.
    fn wait<E: CopyEngine>(
        &mut self,
        engine: &mut E,
        staging: Option<&mut E::Staging>,
        slot: usize,
        progress: &mut impl FnMut(usize, u64),
    ) -> Result<(), E::Error> {
        if let Some(s) = staging {
            engine.wait(s)?;
        }
        self.known = self.known.max(self.slot_rec[slot]);
        self.report(progress);
        Ok(())
    }

    /// The upload: dispatch fills while threads and buffers allow, queue every fill that comes
    /// back, then wait on every buffer.
    fn drive<E: CopyEngine>(
        &mut self,
        engine: &mut E,
        fleet: &mut Fleet<'_, '_, E::Staging>,
        unsynced: &mut bool,
        planner: &mut Planner,
        queue: &mut impl FnMut(&mut E, &mut E::Staging, usize, &Piece) -> Result<(), E::Error>,
        progress: &mut impl FnMut(usize, u64),
    ) -> Result<(), E::Error> {
        let mut planned = 0usize;
        let mut exhausted = false;
        loop {
            // Queue every finished fill first, so the stream gets work as early as possible.
            while let Some(b) = fleet.take(false) {
                self.queue_back(engine, fleet, unsynced, b, queue)?;
            }
            if !exhausted && fleet.can_take() {
                if let Some(&slot) = self.free.front() {
                    let Some(pieces) = planner.next_fill() else {
                        exhausted = true;
                        continue;
                    };
                    self.free.pop_front();
                    // The wait that lets the fill overwrite the buffer: after it, no queued
                    // copy reads it.
                    let waited = self.wait(engine, fleet.slots[slot].as_mut(), slot, progress);
                    if let Err(e) = waited {
                        self.free.push_front(slot);
                        return Err(e);
                    }
                    self.pending.push_back(None);
                    fleet.dispatch::<E>(planned, slot, pieces);
                    planned += 1;
                    continue;
                }
            }
            match fleet.take(true) {
                Some(b) => self.queue_back(engine, fleet, unsynced, b, queue)?,
                None if exhausted => break,
                // Nothing out and more to plan: every buffer is home and free, every thread
                // idle, so the dispatch above runs next.
                None => assert!(
                    !self.free.is_empty(),
                    "staging ring: every buffer was lost with its fill thread"
                ),
            }
        }
        // Every fill is queued: wait on every buffer, oldest record first.
        while let Some(slot) = self.free.pop_front() {
            let waited = self.wait(engine, fleet.slots[slot].as_mut(), slot, progress);
            if let Err(e) = waited {
                self.free.push_front(slot);
                return Err(e);
            }
        }
        debug_assert!(self.pending.is_empty());
        Ok(())
    }

    /// Queues the copies of a fill whose buffer is home again and records its event.
    fn queue_back<E: CopyEngine>(
        &mut self,
        engine: &mut E,
        fleet: &mut Fleet<'_, '_, E::Staging>,
        unsynced: &mut bool,
        b: Back,
        queue: &mut impl FnMut(&mut E, &mut E::Staging, usize, &Piece) -> Result<(), E::Error>,
    ) -> Result<(), E::Error> {
        if let Some(p) = b.panic {
            // The fill panicked (a bug in an engine's fill): the buffer is home, nothing was
            // queued from it; unwinding drops the fleet, which takes back the others.
            resume_unwind(p);
        }
        let Some(staging) = fleet.slots[b.slot].as_mut() else {
            return Ok(()); // home() just put it back
        };
        // From the first queued copy until the record succeeds, a copy may be pending that no
        // event covers.
        *unsynced = true;
        for p in &b.pieces {
            queue(engine, staging, b.slot, p)?;
        }
        engine.record(staging)?;
        *unsynced = false;
        self.records += 1;
        self.slot_rec[b.slot] = self.records;
        self.free.push_back(b.slot);
        let summary = b.pieces.iter().map(|p| (p.tensor, p.src.len())).collect();
        let at = b.seq - self.reported;
        self.stats.fills += 1;
        if self.pending.iter().take(at).any(Option::is_none) {
            self.stats.out_of_order += 1;
        }
        if let Some(entry) = self.pending.get_mut(at) {
            *entry = Some((self.records, summary));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::ops::Range;

    thread_local! {
        /// Bit `i` set: spawn attempt `i` of an upload on this thread fails.
        pub(super) static REFUSED_SPAWNS: Cell<u64> = const { Cell::new(0) };
    }

    /// A synchronous engine: copies run when queued, events are no-ops.
    struct Immediate;

    impl CopyEngine for Immediate {
        type Error = ();
        type Staging = Vec<u8>;
        type Dst = Vec<u8>;
        fn alloc_staging(&mut self, bytes: usize) -> Result<Vec<u8>, ()> {
            Ok(vec![0; bytes])
        }
        unsafe fn free_staging(&mut self, _staging: Vec<u8>) {}
        fn alloc_dst(&mut self, bytes: usize) -> Result<Vec<u8>, ()> {
            Ok(vec![0; bytes])
        }
        unsafe fn fill(staging: &mut Vec<u8>, at: usize, src: &[u8]) {
            staging[at..at + src.len()].copy_from_slice(src);
        }
        unsafe fn copy_async(
            &mut self,
            staging: &mut Vec<u8>,
            range: Range<usize>,
            dst: &mut Vec<u8>,
            dst_offset: usize,
        ) -> Result<(), ()> {
            dst[dst_offset..dst_offset + range.len()].copy_from_slice(&staging[range]);
            Ok(())
        }
        fn record(&mut self, _staging: &mut Vec<u8>) -> Result<(), ()> {
            Ok(())
        }
        fn wait(&mut self, _staging: &mut Vec<u8>) -> Result<(), ()> {
            Ok(())
        }
    }

    #[test]
    fn a_failed_spawn_before_a_successful_one_leaves_the_fleet_consistent() {
        let tensors: Vec<Vec<u8>> = (0..6u8)
            .map(|i| vec![i + 1; 100 + usize::from(i)])
            .collect();
        let slices: Vec<&[u8]> = tensors.iter().map(Vec::as_slice).collect();
        // Bit i: spawn attempt i fails. 0b001: attempt 0 fails, 1 and 2 succeed, so the two
        // threads must get ids 0 and 1 (the old code gave them 1 and 2 and indexed past `jobs`).
        for refused in [0b001u64, 0b011, 0b101, 0b010] {
            REFUSED_SPAWNS.with(|r| r.set(refused));
            let mut ring = StagingRing::new(
                Immediate,
                NonZeroUsize::new(4).expect("4"),
                NonZeroUsize::new(64).expect("64"),
            )
            .expect("ring");
            ring.set_fill_threads(3);
            let dst = ring.upload_slices(&slices, |_, _| {}).expect("upload");
            assert_eq!(dst, tensors, "refused spawns {refused:#b}");
            assert_eq!(ring.last_stats().threads, 3 - refused.count_ones() as usize);
        }
        REFUSED_SPAWNS.with(|r| r.set(0));
    }
}
