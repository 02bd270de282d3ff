//! The seams between the upload schedules and a transfer mechanism (CUDA's, or the host copy
//! engine for tests, feature `test-util`): [`CopyEngine`] (staging buffers, one stream of
//! asynchronous copies, one event per buffer) and its two extensions, [`DequantEngine`] (a
//! device conversion on the same stream) and [`RegisterEngine`] (copies straight from host
//! memory registered for DMA).

use super::DequantTo;
use crate::gguf::GgmlType;
use std::ops::Range;

/// One in-order stream of asynchronous copies from host staging buffers into destination
/// allocations, with one event per staging buffer.
///
/// The engine runs copies in the order they were queued; an event recorded after a copy
/// completes only once that copy (and every copy queued before it) has finished reading its
/// staging bytes and writing its destination.
pub trait CopyEngine {
    /// What a failed call returns.
    type Error;
    /// One staging buffer and its event. Dropping one without [`CopyEngine::free_staging`] must
    /// leak its memory, never free it (the ring drops a buffer it cannot prove idle). It moves
    /// to a fill thread while that thread writes it ([`CopyEngine::fill`]).
    type Staging: Send;
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

    /// A destination of `bytes` bytes, 0 for an empty tensor (the uploads ask for one per
    /// tensor, empty or not); its contents are unspecified until copies have written them.
    ///
    /// # Errors
    /// The engine's allocation error.
    fn alloc_dst(&mut self, bytes: usize) -> Result<Self::Dst, Self::Error>;

    /// Writes `src` into `staging` at `at`, on the host. Needs no engine: any thread that holds
    /// the buffer may call it, while the engine's owner queues copies from other buffers.
    ///
    /// # Safety
    /// `at + src.len()` is at most the buffer's size, and no copy queued from any of those
    /// bytes is still pending (as for [`CopyEngine::free_staging`]), the wait that proves it
    /// having happened before this call (on this thread, or on one that then handed the buffer
    /// over through a synchronizing channel).
    unsafe fn fill(staging: &mut Self::Staging, at: usize, src: &[u8]);

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

/// A [`CopyEngine`] that also converts ggml blocks to f16/bf16 on its stream, for the types of
/// [`super::DEVICE_DEQUANT_TYPES`], bit for bit as [`crate::gguf::dequantize_into_f16`] /
/// [`crate::gguf::dequantize_into_bf16`] do.
pub trait DequantEngine: CopyEngine {
    /// Queues, after everything queued so far, the conversion of the `n_elements` elements of
    /// type `ty` whose blocks start at byte `src_offset` of `src` into elements `dst_elem ..
    /// dst_elem + n_elements` of `dst` (2-byte elements of `to`). Later operations on the
    /// stream run after it; an event recorded after it covers it.
    ///
    /// # Safety
    /// `ty` is one of [`super::DEVICE_DEQUANT_TYPES`]; `n_elements` is a whole number of its
    /// blocks; both ranges lie inside their allocations, `src_offset` and `2 * dst_elem` are
    /// multiples of 16, and `src`'s bytes have been (or are queued to be, earlier on the stream)
    /// written; `src` and `dst` are different allocations.
    ///
    /// # Errors
    /// The engine's error if it cannot be queued (the caller must then assume it may have been).
    #[allow(clippy::too_many_arguments)]
    unsafe fn dequantize_async(
        &mut self,
        src: &Self::Dst,
        src_offset: usize,
        ty: GgmlType,
        n_elements: usize,
        dst: &mut Self::Dst,
        dst_elem: usize,
        to: DequantTo,
    ) -> Result<(), Self::Error>;
}

/// A [`CopyEngine`] that can also copy straight from host memory registered for DMA (pinned in
/// place, read-only), with a whole-stream synchronization.
pub trait RegisterEngine: CopyEngine {
    /// A registration of host memory. Dropping one without [`RegisterEngine::unregister`] must
    /// leave the memory registered (a leak), never unregister it under a pending copy, and must
    /// keep the copies still queued from it sound once the registered borrow has ended (a CUDA
    /// registration pins the physical pages, which outlive the mapping; the host engine reads a
    /// copy taken at registration).
    type Registered;

    /// Registers `host` (at least 1 byte) for DMA.
    ///
    /// # Safety
    /// `host` stays allocated, mapped and unmodified until [`RegisterEngine::unregister`]
    /// returns for it, or until the registration is dropped (a leak: see
    /// [`RegisterEngine::Registered`]).
    ///
    /// # Errors
    /// The engine's error (nothing is registered).
    unsafe fn register(&mut self, host: &[u8]) -> Result<Self::Registered, Self::Error>;

    /// Queues a copy of `registered[range]` to `dst[dst_offset..dst_offset + range.len()]`.
    ///
    /// # Safety
    /// Both ranges lie inside their memory; the caller does not unregister before
    /// [`RegisterEngine::synchronize`] has returned after this call.
    ///
    /// # Errors
    /// The engine's error if it cannot be queued (the caller must then assume it may have been).
    unsafe fn copy_registered_async(
        &mut self,
        registered: &mut Self::Registered,
        range: Range<usize>,
        dst: &mut Self::Dst,
        dst_offset: usize,
    ) -> Result<(), Self::Error>;

    /// Blocks until everything queued on the stream so far has completed.
    ///
    /// # Errors
    /// The engine's error; nothing may then be assumed about pending work.
    fn synchronize(&mut self) -> Result<(), Self::Error>;

    /// Ends a registration.
    ///
    /// # Safety
    /// No copy from it is pending: [`RegisterEngine::synchronize`] returned after the last one
    /// was queued.
    ///
    /// # Errors
    /// The engine's error; the memory may then still be registered.
    unsafe fn unregister(&mut self, registered: Self::Registered) -> Result<(), Self::Error>;
}
