//! The KV byte arena of one device: one allocation of `num_pages x page_bytes` bytes that every
//! loaded model's KV cache is a view of.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

use crate::error::KvError;

/// Alignment of the arena's allocation (a host page: pinning for DMA covers whole pages).
pub const ARENA_ALIGN: usize = 4096;

/// Page sizes must be a multiple of this many bytes, so every block of every view starts on a
/// 16-byte boundary (the width of the CUDA kernels' vector loads).
pub const PAGE_ALIGN: usize = 16;

/// The byte written over a poisoned page: `0xFF` bytes read as NaN in f32, f16 and bf16, so
/// a kernel that reads a stale byte of a page's previous owner produces a NaN that tests catch.
pub const POISON_BYTE: u8 = 0xFF;

/// One host allocation of `num_pages` pages of `page_bytes` bytes each, zeroed at creation.
///
/// Invariant: `ptr` was returned by `alloc_zeroed(Layout::from_size_align(num_pages *
/// page_bytes, ARENA_ALIGN))`, `num_pages >= 1`, `page_bytes >= 1` and a multiple of
/// [`PAGE_ALIGN`], the product fits in `isize`; the allocation is owned
/// by this value and freed exactly once, by `Drop`. No `&`/`&mut` to the bytes outlives one
/// method call of this type or a view's head-vector access (see below).
///
/// A [`BlockId`](crate::block::BlockId) handed out by the
/// [`BlockPool`](crate::block::BlockPool) names a page, whichever model holds it: a page one model
/// frees is memory another model can write the next step, so a block lent between models is
/// the same bytes, not a second allocation.
///
/// This is the host arena (the CPU path, and the host image of a device arena in tests); the
/// device arena is `cuda::DeviceArena`. How each model's geometry lays its blocks over a page
/// is [`crate::kv::ArenaView`]'s business: the arena only knows pages.
///
/// # Sharing without a lock
///
/// Engine threads read and write their own pages concurrently. No Rust reference ever spans
/// the whole arena: accessors hand out raw page pointers, and the views built on them
/// ([`crate::kv::LayerKv`]) turn them into references only for one head vector at a time. Who
/// may touch a page is decided by the block pool, not by this type: a page is written only by
/// the engine whose sequence holds it with reference count 1, and read only by engines holding
/// a reference (copy-on-write keeps shared pages read-only). The pool's release on free pairs
/// with its acquire on allocation, so a page's last writes by its old owner happen before the
/// new owner's first access. That contract is why the accessors that build views are `unsafe`.
pub struct KvArena {
    ptr: NonNull<u8>,
    num_pages: usize,
    page_bytes: usize,
}

// SAFETY: the arena owns its allocation; every access goes through raw pointers whose users
// (the `unsafe` view constructors) promise that no two threads access one page concurrently
// unless both only read (the block pool's ownership protocol, module docs). Moving the owner
// between threads moves nothing but the pointer.
unsafe impl Send for KvArena {}
// SAFETY: as for `Send`: `&KvArena` exposes raw page pointers and whole-page operations whose
// callers uphold the per-page ownership contract; the type itself holds no other state.
unsafe impl Sync for KvArena {}

impl fmt::Debug for KvArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvArena")
            .field("num_pages", &self.num_pages)
            .field("page_bytes", &self.page_bytes)
            .finish()
    }
}

impl KvArena {
    /// Allocates a zeroed arena of `num_pages` pages of `page_bytes` bytes.
    ///
    /// # Errors
    /// [`KvError::ZeroDimension`] if either is 0, [`KvError::PageMisaligned`] if `page_bytes`
    /// is not a multiple of [`PAGE_ALIGN`],
    /// [`KvError::TooManyBlocks`] above [`MAX_BLOCKS`](crate::ids::MAX_BLOCKS),
    /// [`KvError::SizeOverflow`], [`KvError::AllocFailed`].
    pub fn new(num_pages: usize, page_bytes: usize) -> Result<Self, KvError> {
        let total = check_arena_size(num_pages, page_bytes)?;
        let layout =
            Layout::from_size_align(total, ARENA_ALIGN).map_err(|_| KvError::SizeOverflow)?;
        // SAFETY: `total >= 1` (both factors checked non-zero), as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(KvError::AllocFailed { bytes: total })?;
        Ok(Self {
            ptr,
            num_pages,
            page_bytes,
        })
    }

    /// Pages in the arena (the block pool's `total`).
    #[inline]
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Bytes per page.
    #[inline]
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Bytes in the whole arena: `num_pages * page_bytes`, the one KV allocation of the device.
    #[inline]
    pub fn total_bytes(&self) -> usize {
        self.num_pages * self.page_bytes
    }

    /// The base of the allocation, [`ARENA_ALIGN`]-aligned. Page `p` starts `p * page_bytes`
    /// bytes after it. Reading or writing through it is subject to the module's ownership
    /// contract.
    #[inline]
    pub fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Overwrites pages with [`POISON_BYTE`], so that a later reader of bytes it never wrote
    /// sees NaN. Tests call it on freed pages to prove that no byte of a page's previous owner
    /// leaks into the next owner's results (engines do not poison the pages they free).
    ///
    /// # Errors
    /// [`KvError::BlockOutOfRange`] if a page is not in the arena (nothing is written).
    ///
    /// # Safety
    /// No other thread accesses any of `pages` during the call (the caller owns them, or they
    /// are free and no one can allocate them before the call returns).
    pub unsafe fn poison_pages(&self, pages: &[u32]) -> Result<(), KvError> {
        for &p in pages {
            self.check_page(p)?;
        }
        for &p in pages {
            // SAFETY: `p < num_pages` (checked above), so the page's `page_bytes` bytes lie
            // inside the allocation; the caller guarantees no concurrent access to them.
            unsafe {
                std::ptr::write_bytes(
                    self.base_ptr().add(p as usize * self.page_bytes),
                    POISON_BYTE,
                    self.page_bytes,
                );
            }
        }
        Ok(())
    }

    /// A copy of page `page`'s bytes (tests and debugging).
    ///
    /// # Errors
    /// [`KvError::BlockOutOfRange`].
    ///
    /// # Safety
    /// No thread writes the page during the call.
    pub unsafe fn read_page(&self, page: u32) -> Result<Vec<u8>, KvError> {
        self.check_page(page)?;
        let mut out = vec![0u8; self.page_bytes];
        // SAFETY: the page lies inside the allocation (checked), `out` is a distinct buffer of
        // the same length, and the caller guarantees no concurrent writer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base_ptr().add(page as usize * self.page_bytes),
                out.as_mut_ptr(),
                self.page_bytes,
            );
        }
        Ok(out)
    }

    fn check_page(&self, page: u32) -> Result<(), KvError> {
        if page as usize >= self.num_pages {
            return Err(KvError::BlockOutOfRange {
                block: i64::from(page),
                num_blocks: self.num_pages,
            });
        }
        Ok(())
    }
}

impl Drop for KvArena {
    fn drop(&mut self) {
        // Cannot fail: the same size and alignment were accepted in `new`.
        let layout =
            Layout::from_size_align(self.total_bytes(), ARENA_ALIGN).unwrap_or(Layout::new::<u8>());
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout (type invariant) and
        // is freed only here; `&mut self` proves no view borrows it any more.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// Validates an arena's shape and returns its byte size (shared with the device arena).
///
/// # Errors
/// As [`KvArena::new`], allocation aside.
pub fn check_arena_size(num_pages: usize, page_bytes: usize) -> Result<usize, KvError> {
    if num_pages == 0 {
        return Err(KvError::ZeroDimension { what: "num_pages" });
    }
    if page_bytes == 0 {
        return Err(KvError::ZeroDimension { what: "page_bytes" });
    }
    if page_bytes % PAGE_ALIGN != 0 {
        return Err(KvError::PageMisaligned {
            page_bytes,
            align: PAGE_ALIGN,
        });
    }
    if num_pages > crate::ids::MAX_BLOCKS as usize {
        return Err(KvError::TooManyBlocks {
            num_blocks: num_pages,
            max: crate::ids::MAX_BLOCKS as usize,
        });
    }
    num_pages
        .checked_mul(page_bytes)
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(KvError::SizeOverflow)
}
