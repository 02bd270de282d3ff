//! The staging pipeline, generic over the copy engine: n-buffered staging as in NVIDIA's "How to

use super::UploadProgress;
use crate::gguf::{Gguf, TensorInfo};
use std::num::NonZeroUsize;
use std::ops::Range;

/// One in-order stream of asynchronous copies from host staging buffers into destination
/// allocations, with one event per staging buffer: the seam between [`StagingRing`]'s
/// scheduling and a transfer mechanism (CUDA's, or the host copy engine for tests, feature `test-util`).
///
/// The engine runs copies in the order they were queued; an event recorded after a copy
/// completes only once that copy (and every copy queued before it) has finished reading its
/// staging bytes and writing its destination.
pub trait CopyEngine {
    /// What a failed call returns.
    type Error;
    /// One staging buffer and its event. Dropping one without [`CopyEngine::free_staging`] must
    /// leak its memory, never free it (the ring drops a buffer it cannot prove idle).
    type Staging;
    /// One destination allocation (a tensor's memory on the device).
    type Dst;

    /// A staging buffer of `bytes` bytes (at least 1) and its event, which has nothing
    /// recorded yet (a wait on it returns at once).
    ///
    /// # Errors
    /// The engine's allocation error.
    fn alloc_staging(&mut self, bytes: usize) -> Result<Self::Staging, Self::Error>;

    /// Frees a staging buffer.
    ///
    /// # Safety
    /// No copy reading `staging` may still be pending: every copy queued from it was followed by
    /// a record of its event (or of any later event on the stream), and a wait on that event has
    /// since returned.
    unsafe fn free_staging(&mut self, staging: Self::Staging);

    /// A destination of `bytes` bytes (at least 1); its contents are unspecified until copies
    /// have written them.
    ///
    /// # Errors
    /// The engine's allocation error.
    fn alloc_dst(&mut self, bytes: usize) -> Result<Self::Dst, Self::Error>;

    /// Writes `src` into `staging` at `at`, on the host.
    ///
    /// # Safety
    /// `at + src.len()` is at most the buffer's size, and no copy queued from any of those
    /// bytes is still pending (as for [`CopyEngine::free_staging`]).
    unsafe fn fill(&mut self, staging: &mut Self::Staging, at: usize, src: &[u8]);

    /// Queues a copy of `staging[range]` to `dst[dst_offset..dst_offset + range.len()]` on the
    /// stream and returns without waiting for it.
    ///
    /// # Safety
    /// `range` lies inside the staging buffer and the destination range inside `dst`; the bytes
    /// were written by [`CopyEngine::fill`]. The caller neither writes those staging bytes nor
    /// frees the buffer until it has recorded an event after this call and waited on it.
    ///
    /// # Errors
    /// The engine's error if the copy cannot be queued (the caller must then assume it may
    /// have been).
    unsafe fn copy_async(
        &mut self,
        staging: &mut Self::Staging,
        range: Range<usize>,
        dst: &mut Self::Dst,
        dst_offset: usize,
    ) -> Result<(), Self::Error>;

    /// Records `staging`'s event at the stream's current end: it completes once every copy
    /// queued so far has.
    ///
    /// # Errors
    /// The engine's error; the event then still shows only its previous record.
    fn record(&mut self, staging: &mut Self::Staging) -> Result<(), Self::Error>;

    /// Blocks until `staging`'s last recorded event has completed.
    ///
    /// # Errors
    /// The engine's error; nothing may then be assumed about the copies the event covers.
    fn wait(&mut self, staging: &mut Self::Staging) -> Result<(), Self::Error>;
}

/// A ring of staging buffers over a [`CopyEngine`], reusable across uploads: the schedule, and
/// the invariant that keeps a buffer from being rewritten or freed under a pending copy.
///
/// Overlap Data Transfers", with one event per buffer.
///
/// [`StagingRing`] owns `n` staging buffers of `b` bytes and a [`CopyEngine`] (one in-order
/// stream of asynchronous copies from staging buffers into destination allocations, plus one
/// event per buffer). An upload cuts its tensors, in the order given, into pieces of at most
/// what is left of the current buffer: fill `k` of an upload goes to buffer `k mod n`, a buffer
/// holds pieces of as many tensors as fit, and a tensor larger than a buffer spans several fills.
/// For every piece the host writes its bytes into the buffer, queues one copy straight into the
/// tensor's destination at the piece's offset, and records the buffer's event.
///
/// # Never overwritten early
///
/// Invariant (between any two calls into the engine, so also when an error or a panicking
/// progress callback leaves an upload): every copy queued from buffer `i` is followed on the
/// stream by a record of buffer `i`'s event, so once a wait on that event returns, no queued
/// copy reads the buffer. The ring waits on a buffer's event before it writes the buffer again
/// and before it frees it. A copy queued whose record then failed breaks the invariant until
/// [`StagingRing`]'s resync (a record and wait on buffer 0 — the stream runs in order, so that
/// event covers every earlier copy) succeeds; until then the ring neither writes nor frees a
/// buffer, and a drop that cannot resync leaks the ring rather than free it under a copy.
///
/// # Progress
///
/// A buffer's pieces are reported once its event has been waited on, which happens just before
/// the buffer is refilled and, at the end, for every buffer from the oldest fill to the newest:
/// the callback sees completed bytes only, in the order the pieces were queued.
pub struct StagingRing<E: CopyEngine> {
    engine: E,
    /// Fill `k` of an upload goes to `slots[k % slots.len()]`. Every copy queued from a slot is
    /// followed by a record of that slot's event, except while `unsynced`.
    slots: Vec<E::Staging>,
    /// Bytes per slot, at least 1.
    staging_bytes: usize,
    /// A copy may be pending that no event recorded after it covers (its queueing or its
    /// record failed): no slot may be written or freed before [`StagingRing::resync`].
    unsynced: bool,
}

impl<E: CopyEngine> std::fmt::Debug for StagingRing<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingRing")
            .field("buffers", &self.slots.len())
            .field("staging_bytes", &self.staging_bytes)
            .field("unsynced", &self.unsynced)
            .finish_non_exhaustive()
    }
}

impl<E: CopyEngine> StagingRing<E> {
    /// Allocates `buffers` staging buffers of `staging_bytes` each from `engine`.
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
            unsynced: false,
        };
        for _ in 0..buffers.get() {
            let s = ring.engine.alloc_staging(ring.staging_bytes)?;
            ring.slots.push(s);
        }
        Ok(ring)
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
    ) -> Result<Vec<(TensorInfo<'a>, E::Dst)>, E::Error> {
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
    /// bytes completed so far (a running sum in queue order). Returns the destinations in the
    /// order of `tensors` once every copy has completed.
    ///
    /// Every destination is allocated before the first copy is queued, so running out of memory
    /// costs no copy.
    ///
    /// # Errors
    /// The engine's error. Destinations already allocated are dropped; the ring stays usable.
    pub fn upload_slices(
        &mut self,
        tensors: &[&[u8]],
        mut progress: impl FnMut(usize, u64),
    ) -> Result<Vec<E::Dst>, E::Error> {
        if self.unsynced {
            self.resync()?;
        }
        let mut dst = Vec::with_capacity(tensors.len());
        for t in tensors {
            dst.push(self.engine.alloc_dst(t.len())?);
        }
        let n = self.slots.len();
        // Pieces (tensor index, bytes) queued from each slot since its event was last waited on.
        let mut pending: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
        let mut done = 0u64;
        let mut report = |pieces: &mut Vec<(usize, usize)>| {
            for (ti, len) in pieces.drain(..) {
                done += len as u64;
                progress(ti, done);
            }
        };
        // The slot being filled and the bytes of it written in this fill. Slot 0 may still be
        // read by the previous upload's copies.
        let (mut slot, mut fill) = (0usize, 0usize);
        self.engine.wait(&mut self.slots[0])?;
        for (ti, data) in tensors.iter().enumerate() {
            let mut off = 0;
            while off < data.len() {
                if fill == self.staging_bytes {
                    slot = (slot + 1) % n;
                    fill = 0;
                    // The wait that lets this fill overwrite the slot: after it, no copy reads it.
                    self.engine.wait(&mut self.slots[slot])?;
                    report(&mut pending[slot]);
                }
                let len = (data.len() - off).min(self.staging_bytes - fill);
                let stage = &mut self.slots[slot];
                // SAFETY: [fill, fill + len) lies inside the slot (`len` is at most what is left
                // of it). Copies queued from the slot before this fill were covered by its event
                // (the invariant; not `unsynced`, checked above) and that event was waited on
                // when this fill began; the copies of this fill read only [0, fill).
                unsafe { self.engine.fill(stage, fill, &data[off..off + len]) };
                // Set before queueing: from here until the record succeeds a copy may be pending
                // that no event covers.
                self.unsynced = true;
                // SAFETY: the staging range was just filled and lies inside the slot; the
                // destination range [off, off + len) lies inside `dst[ti]`, allocated with
                // `data.len()` bytes. The slot is not written again before the wait above (at
                // its next fill), nor freed before the waits in `Drop`, both after the record
                // below (or, if that fails, after a resync's record).
                unsafe {
                    self.engine
                        .copy_async(stage, fill..fill + len, &mut dst[ti], off)
                }?;
                self.engine.record(stage)?;
                self.unsynced = false;
                pending[slot].push((ti, len));
                fill += len;
                off += len;
            }
        }
        // Oldest fill first, so progress stays in queue order.
        for k in 1..=n {
            let s = (slot + k) % n;
            self.engine.wait(&mut self.slots[s])?;
            report(&mut pending[s]);
        }
        Ok(dst)
    }

    /// Restores the invariant after a copy whose record may be missing: records slot 0's event
    /// after everything queued so far and waits on it.
    fn resync(&mut self) -> Result<(), E::Error> {
        self.engine.record(&mut self.slots[0])?;
        self.engine.wait(&mut self.slots[0])?;
        self.unsynced = false;
        Ok(())
    }
}

impl<E: CopyEngine> Drop for StagingRing<E> {
    fn drop(&mut self) {
        let synced = !self.unsynced || self.resync().is_ok();
        for mut s in std::mem::take(&mut self.slots) {
            if synced && self.engine.wait(&mut s).is_ok() {
                // SAFETY: every copy queued from `s` was followed by a record of its event (the
                // invariant, which holds: `synced`), and the wait on that event just returned.
                unsafe { self.engine.free_staging(s) };
            }
            // Otherwise a copy may still read it: leak it (dropping the handle frees nothing).
        }
    }
}
