//! The registered upload: DMA straight from host memory registered in place (the mapped
//! file's pages), generic over a [`RegisterEngine`].
//!
//! Register the whole span once, queue every copy (raw: one per tensor, straight into its
//! destination; dequantized: per chunk of whole blocks, a copy into a device staging area and
//! the conversion out of it, the next chunk's copy ordered after the conversion by the stream),
//! synchronize the stream, unregister. No host copy, no staging ring; the registration pins
//! every page first, which costs time proportional to the bytes (and reads from disk what is
//! not in the page cache).
//!
//! # Never unregistered under a copy
//!
//! The registration is ended only after a synchronize that returned after the last copy was
//! queued. On every error the function synchronizes before it unregisters; if that synchronize
//! (or the one at the end) fails, it cannot know whether a copy still reads the pages and leaks
//! the registration instead (it stays pinned until the process exits).

use super::engine::{DequantEngine, RegisterEngine};
use super::pipeline::{dequant_granule, elements};
use super::{DequantTo, RingError};
use crate::gguf::GgmlType;
use std::num::NonZeroUsize;
use std::ops::Range;

/// Copies each `tensors[i]` (a range of `host`) into a destination of its own, straight from
/// `host` registered for DMA; `progress(i, done)` is called for every non-empty tensor, in
/// order, once the stream has finished (a running sum of bytes).
///
/// # Errors
/// [`RingError::OutOfRange`] for a range outside `host` (before anything happens);
/// [`RingError::Engine`] for an allocation, registration, copy, synchronize or unregister
/// failure (destinations are dropped; see the module docs for the registration).
pub fn upload_registered<E: RegisterEngine>(
    engine: &mut E,
    host: &[u8],
    tensors: &[Range<usize>],
    progress: impl FnMut(usize, u64),
) -> Result<Vec<E::Dst>, RingError<E::Error>> {
    check_ranges(host.len(), tensors)?;
    let mut dst = Vec::with_capacity(tensors.len());
    for r in tensors {
        dst.push(engine.alloc_dst(r.len())?);
    }
    registered(engine, host, tensors, progress, |engine, reg| {
        for (i, r) in tensors.iter().enumerate() {
            // SAFETY: `r` lies inside the registration (check_ranges) and the destination was
            // allocated with r.len() bytes; `registered` synchronizes before it unregisters.
            unsafe { engine.copy_registered_async(reg, r.clone(), &mut dst[i], 0) }?;
        }
        Ok(())
    })?;
    Ok(dst)
}

/// As [`upload_registered`], landing tensors `(type, range of host)` dequantized to `to`:
/// each chunk of at most `staging_bytes` (whole units of [`super::DEQUANT_GRANULE`] elements)
/// is copied into a device staging area of that size and converted from there into the
/// tensor's destination (2-byte values of `to`, bit for bit the CPU's).
///
/// # Errors
/// As [`upload_registered`], plus [`RingError::NotDequantizable`], [`RingError::PartialBlock`]
/// and [`RingError::StagingTooSmall`] before anything is allocated.
pub fn upload_registered_dequantized<E: RegisterEngine + DequantEngine>(
    engine: &mut E,
    host: &[u8],
    tensors: &[(GgmlType, Range<usize>)],
    to: DequantTo,
    staging_bytes: NonZeroUsize,
    progress: impl FnMut(usize, u64),
) -> Result<Vec<E::Dst>, RingError<E::Error>> {
    let ranges: Vec<Range<usize>> = tensors.iter().map(|t| t.1.clone()).collect();
    check_ranges(host.len(), &ranges)?;
    // Every tensor's type and length first, then the area against the largest unit (as the
    // staged path does): `needed` is what the area must grow to, not the first unit too big.
    let mut granules = Vec::with_capacity(tensors.len());
    for (i, (ty, r)) in tensors.iter().enumerate() {
        granules.push(dequant_granule(i, *ty, r.len())?);
    }
    let needed = granules.iter().copied().max().unwrap_or(1);
    if needed > staging_bytes.get() {
        return Err(RingError::StagingTooSmall {
            needed,
            have: staging_bytes.get(),
        });
    }
    let mut dst = Vec::with_capacity(tensors.len());
    for (ty, r) in tensors {
        dst.push(engine.alloc_dst(elements(*ty, r.len()) * DequantTo::BYTES)?);
    }
    let mut stage = engine.alloc_dst(staging_bytes.get())?;
    registered(engine, host, &ranges, progress, |engine, reg| {
        for (i, (ty, r)) in tensors.iter().enumerate() {
            let (bs, ts) = (ty.block_size() as usize, ty.type_size() as usize);
            let chunk = staging_bytes.get() / granules[i] * granules[i];
            let mut off = 0;
            while off < r.len() {
                let len = (r.len() - off).min(chunk);
                let src = r.start + off..r.start + off + len;
                // SAFETY: `src` lies inside the registration (check_ranges); the staging area
                // holds `chunk` >= len bytes. The conversion queued after the previous chunk
                // reads the area; this copy is queued after it on the same stream, so it does
                // not overwrite the area early. `registered` synchronizes before unregistering.
                unsafe { engine.copy_registered_async(reg, src, &mut stage, 0) }?;
                // SAFETY: the type passed dequant_granule; the chunk is whole blocks (a
                // multiple of the granule, or the tensor's whole-block tail) starting at a
                // multiple of 256 elements (so 2 * dst_elem is a multiple of 16), the area's
                // offset 0 is aligned; the element range lies inside dst[i]; the copy that
                // writes the area is queued just before; area and destination differ.
                unsafe {
                    engine.dequantize_async(
                        &stage,
                        0,
                        *ty,
                        len / ts * bs,
                        &mut dst[i],
                        off / ts * bs,
                        to,
                    )
                }?;
                off += len;
            }
        }
        Ok(())
    })?;
    drop(stage);
    Ok(dst)
}

fn check_ranges<E>(len: usize, tensors: &[Range<usize>]) -> Result<(), RingError<E>> {
    for (i, r) in tensors.iter().enumerate() {
        if r.start > r.end || r.end > len {
            return Err(RingError::OutOfRange {
                tensor: i,
                start: r.start,
                end: r.end,
                len,
            });
        }
    }
    Ok(())
}

/// Registers `host`, runs `queue`, synchronizes and unregisters (see the module docs), then
/// reports every range in order.
fn registered<E: RegisterEngine>(
    engine: &mut E,
    host: &[u8],
    ranges: &[Range<usize>],
    mut progress: impl FnMut(usize, u64),
    queue: impl FnOnce(&mut E, &mut E::Registered) -> Result<(), E::Error>,
) -> Result<(), RingError<E::Error>> {
    if host.is_empty() || ranges.iter().all(|r| r.is_empty()) {
        return Ok(()); // no bytes to copy: nothing to register, nothing to report
    }
    // SAFETY: `host` is borrowed for this whole call, so it stays allocated, mapped and
    // unmodified (a shared borrow) until the unregister below returns. A registration this
    // function drops without unregistering (after a failed synchronize) stays registered, and
    // the engine keeps the copies still queued from it sound after the borrow ends (the
    // RegisterEngine contract).
    let mut reg = unsafe { engine.register(host) }?;
    if let Err(e) = queue(engine, &mut reg) {
        // Copies queued before the failure may still run: unregister only once they are done.
        if engine.synchronize().is_ok() {
            // SAFETY: the synchronize just returned after every copy was queued.
            let _ = unsafe { engine.unregister(reg) };
        }
        return Err(e.into());
    }
    // On failure `reg` drops still registered: leaked, never unregistered under a copy.
    engine.synchronize()?;
    // SAFETY: the synchronize returned after the last copy from `reg` was queued.
    unsafe { engine.unregister(reg) }?;
    let mut done = 0u64;
    for (i, r) in ranges.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
        done += r.len() as u64;
        progress(i, done);
    }
    Ok(())
}
