//! Host storage of the paged layout: an aligned host KV cache, a swap space, typed views and
//! the batched block copies that copy-on-write and swapping are made of.

use std::alloc::{self, Layout};
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use super::dtype::{KvDtype, KvElem};
use super::layout::KvCacheConfig;
use crate::error::KvError;

/// Alignment of host KV storage: a page, so that a CUDA host registration (pinning) of a
/// [`SwapSpace`] starts on a page, and every block run starts at least 64-byte aligned when
/// the page stride ([`KvCacheConfig::page_bytes`]; `bytes_per_block` when dense) is a multiple
/// of 64.
pub const HOST_ALIGN: usize = 4096;

/// An owned, zero-initialised, [`HOST_ALIGN`]-aligned byte buffer.
///
/// Invariant: `ptr` was returned by `alloc_zeroed(Layout::from_size_align(len, HOST_ALIGN))`
/// with `len > 0`, is uniquely owned by this value, and is freed exactly once, by `Drop`.
struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (like a `Vec<u8>`); shared access only
// hands out `&[u8]` and mutation needs `&mut self`, so moving it to or sharing it with another
// thread cannot create a data race.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send` above: `&AlignedBuf` only gives read-only access to initialised bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn zeroed(len: usize) -> Result<Self, KvError> {
        let layout =
            Layout::from_size_align(len.max(1), HOST_ALIGN).map_err(|_| KvError::SizeOverflow)?;
        // SAFETY: `layout` has a non-zero size (`len.max(1)`), as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(KvError::AllocFailed { bytes: len })?;
        Ok(Self { ptr, len })
    }

    fn layout(&self) -> Layout {
        // Cannot fail: the same size and alignment were accepted in `zeroed`.
        Layout::from_size_align(self.len.max(1), HOST_ALIGN).unwrap_or(Layout::new::<u8>())
    }

    #[inline]
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed, then only written through
        // `bytes_mut`) bytes owned by `self`; the shared borrow of `self` keeps them alive and
        // unaliased by any `&mut` for the returned lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    #[inline]
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and the exclusive borrow of `self` makes this the only live
        // reference to the buffer.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    #[inline]
    fn typed<T: KvElem>(&self) -> &[T] {
        let n = self.len / std::mem::size_of::<T>();
        // SAFETY: `KvElem` is sealed to f32/f16/bf16: plain old data with no padding, no
        // invalid bit patterns and alignment <= 4 <= HOST_ALIGN, so any initialised, aligned
        // bytes are valid `T`s; `n * size_of::<T>() <= len`, and the borrow of `self` keeps
        // the memory alive and unmutated.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>(), n) }
    }

    #[inline]
    fn typed_mut<T: KvElem>(&mut self) -> &mut [T] {
        let n = self.len / std::mem::size_of::<T>();
        // SAFETY: as in `typed`; additionally every bit pattern written through the `&mut [T]`
        // is a valid byte sequence, and the exclusive borrow of `self` makes it unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<T>(), n) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout (type invariant) and
        // is freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout()) }
    }
}

/// A paged KV cache in host memory, laid out exactly as [`KvCacheConfig`](super::KvCacheConfig)'s layout says: the
/// pool of the CPU path, and the host image of a device pool in tests.
pub struct HostKvCache {
    config: KvCacheConfig,
    buf: AlignedBuf,
}

impl fmt::Debug for HostKvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostKvCache")
            .field("config", &self.config)
            .field("bytes", &self.buf.len)
            .finish()
    }
}

impl HostKvCache {
    /// Allocates a zeroed cache of `config.total_bytes()` bytes, [`HOST_ALIGN`]-aligned.
    ///
    /// # Errors
    /// [`KvError::SizeOverflow`] if the size rounded up to [`HOST_ALIGN`] overflows `isize`
    /// (a geometry within 4 KiB of `isize::MAX`), [`KvError::AllocFailed`] if the allocator
    /// refuses.
    pub fn new(config: KvCacheConfig) -> Result<Self, KvError> {
        let buf = AlignedBuf::zeroed(config.total_bytes())?;
        Ok(Self { config, buf })
    }

    /// The geometry.
    #[inline]
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The whole cache as bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.bytes()
    }

    /// The whole cache as mutable bytes.
    #[inline]
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.buf.bytes_mut()
    }

    /// The `bytes_per_block` bytes of block `block` (all layers, K and V).
    ///
    /// # Errors
    /// [`KvError::BlockOutOfRange`] if `block >= num_blocks`.
    pub fn block_bytes(&self, block: usize) -> Result<&[u8], KvError> {
        let (page, bpb) = (self.config.page_bytes(), self.config.bytes_per_block());
        check_block(block as u64, self.config.num_blocks())?;
        Ok(&self.as_bytes()[block * page..block * page + bpb])
    }

    /// A typed view of the whole cache.
    ///
    /// # Errors
    /// [`KvError::DtypeMismatch`] if `T` is not the cache's dtype.
    pub fn view<T: KvElem>(&self) -> Result<KvCacheView<'_, T>, KvError> {
        check_dtype::<T>(self.config.dtype())?;
        Ok(KvCacheView {
            config: self.config,
            data: self.buf.typed::<T>(),
        })
    }

    /// A typed mutable view of the whole cache.
    ///
    /// # Errors
    /// [`KvError::DtypeMismatch`] if `T` is not the cache's dtype.
    pub fn view_mut<T: KvElem>(&mut self) -> Result<KvCacheViewMut<'_, T>, KvError> {
        check_dtype::<T>(self.config.dtype())?;
        Ok(KvCacheViewMut {
            config: self.config,
            data: self.buf.typed_mut::<T>(),
        })
    }

    /// Copies whole blocks inside this cache, `(src, dst)` pairs, all layers, K and V: the
    /// copy-on-write step of a batch. Same rules and errors as
    /// [`crate::attn::cpu::copy_blocks`]; works for any dtype (it copies bytes).
    ///
    /// # Errors
    /// See [`check_block_mapping`].
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)]) -> Result<(), KvError> {
        let n = self.config.num_blocks();
        check_block_mapping(pairs, n, n, true)?;
        let (page, bpb) = (self.config.page_bytes(), self.config.bytes_per_block());
        copy_runs_within(self.as_bytes_mut(), page, bpb, pairs);
        Ok(())
    }
}

/// Host memory that swapped-out blocks live in: the same block shape as the cache it serves
/// (layers, heads, head dim, block size, dtype), its own block count, the same
/// `[num_blocks][L][2][BS][H][D]` layout, so a block is one contiguous `bytes_per_block` run
/// on both sides and a swap with a dense cache is one copy per run of consecutive blocks (with
/// a padded cache, whose page stride differs from the space's, one copy per block).
///
/// The owner (the scheduler) decides which swap blocks are in use; this type only moves bytes.
#[derive(Debug)]
pub struct SwapSpace {
    storage: HostKvCache,
}

impl SwapSpace {
    /// Allocates a zeroed swap space of `num_blocks` blocks shaped like `cache_config`'s.
    ///
    /// # Errors
    /// As [`KvCacheConfig::new`] for the resized geometry, or as [`HostKvCache::new`].
    pub fn new(cache_config: &KvCacheConfig, num_blocks: usize) -> Result<Self, KvError> {
        let config = cache_config.with_num_blocks(num_blocks)?;
        Ok(Self {
            storage: HostKvCache::new(config)?,
        })
    }

    /// The swap space's own geometry (its `num_blocks` is the swap capacity).
    #[inline]
    pub fn config(&self) -> &KvCacheConfig {
        self.storage.config()
    }

    /// The swap space as a host cache (for reading blocks, typed views, or handing its bytes to
    /// a device copy).
    #[inline]
    pub fn storage(&self) -> &HostKvCache {
        &self.storage
    }

    /// Mutable access to the storage (a device-to-host swap writes here).
    #[inline]
    pub fn storage_mut(&mut self) -> &mut HostKvCache {
        &mut self.storage
    }

    /// Swaps blocks out: for each `(cache_block, swap_block)` pair copies the whole block (all
    /// layers, K and V) from `cache` into this space. One call per swap set; consecutive pairs
    /// with consecutive source and destination indices are merged into one copy when `cache`
    /// is dense (a padded cache's blocks are not contiguous here: copied one by one).
    ///
    /// # Errors
    /// [`KvError::GeometryMismatch`] if the block shapes differ; see [`check_block_mapping`]
    /// (sources index `cache`, destinations this space; destinations distinct). Nothing is
    /// copied on error.
    pub fn swap_out(&mut self, cache: &HostKvCache, mapping: &[(u32, u32)]) -> Result<(), KvError> {
        if !cache.config().same_block_shape(self.config()) {
            return Err(KvError::GeometryMismatch);
        }
        check_block_mapping(
            mapping,
            cache.config().num_blocks(),
            self.config().num_blocks(),
            false,
        )?;
        let (src, dst) = (cache.config(), self.config());
        let strides = RunStrides::bytes(src, dst);
        copy_runs(
            cache.as_bytes(),
            self.storage.as_bytes_mut(),
            strides,
            mapping,
        );
        Ok(())
    }

    /// Swaps blocks in: for each `(swap_block, cache_block)` pair copies the whole block from
    /// this space into `cache`. Merging and errors as [`swap_out`](Self::swap_out) (sources
    /// index this space, destinations `cache`).
    ///
    /// # Errors
    /// As [`swap_out`](Self::swap_out).
    pub fn swap_in(&self, cache: &mut HostKvCache, mapping: &[(u32, u32)]) -> Result<(), KvError> {
        if !cache.config().same_block_shape(self.config()) {
            return Err(KvError::GeometryMismatch);
        }
        check_block_mapping(
            mapping,
            self.config().num_blocks(),
            cache.config().num_blocks(),
            false,
        )?;
        let strides = RunStrides::bytes(self.config(), cache.config());
        copy_runs(
            self.storage.as_bytes(),
            cache.as_bytes_mut(),
            strides,
            mapping,
        );
        Ok(())
    }
}

/// A typed, read-only view of a whole paged cache: a geometry and `total_elems` elements.
#[derive(Debug, Clone, Copy)]
pub struct KvCacheView<'a, T> {
    config: KvCacheConfig,
    data: &'a [T],
}

impl<'a, T: KvElem> KvCacheView<'a, T> {
    /// Wraps a slice laid out as `config` says (e.g. a host image of a device cache).
    ///
    /// # Errors
    /// [`KvError::DtypeMismatch`] if `T` is not `config.dtype()`, [`KvError::LengthMismatch`]
    /// if `data.len() != config.total_elems()`.
    pub fn new(config: &KvCacheConfig, data: &'a [T]) -> Result<Self, KvError> {
        check_dtype::<T>(config.dtype())?;
        check_len("kv cache", config.total_elems(), data.len())?;
        Ok(Self {
            config: *config,
            data,
        })
    }

    /// The geometry.
    #[inline]
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The elements.
    #[inline]
    pub fn data(&self) -> &'a [T] {
        self.data
    }

    /// The view of one layer, what the attention kernels take.
    ///
    /// # Errors
    /// [`KvError::LayerOutOfRange`].
    pub fn layer(&self, layer: usize) -> Result<LayerKv<'a, T>, KvError> {
        check_layer(layer, &self.config)?;
        Ok(LayerKv {
            config: self.config,
            ptr: NonNull::from(self.data).cast(),
            len: self.data.len(),
            layer,
            _borrow: PhantomData,
        })
    }
}

/// A typed, mutable view of a whole paged cache.
#[derive(Debug)]
pub struct KvCacheViewMut<'a, T> {
    config: KvCacheConfig,
    data: &'a mut [T],
}

impl<'a, T: KvElem> KvCacheViewMut<'a, T> {
    /// Wraps a mutable slice laid out as `config` says.
    ///
    /// # Errors
    /// As [`KvCacheView::new`].
    pub fn new(config: &KvCacheConfig, data: &'a mut [T]) -> Result<Self, KvError> {
        check_dtype::<T>(config.dtype())?;
        check_len("kv cache", config.total_elems(), data.len())?;
        Ok(Self {
            config: *config,
            data,
        })
    }

    /// The geometry.
    #[inline]
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The elements.
    #[inline]
    pub fn data(&self) -> &[T] {
        self.data
    }

    /// The elements, mutably.
    #[inline]
    pub fn data_mut(&mut self) -> &mut [T] {
        self.data
    }

    /// A read-only view borrowing this one.
    #[inline]
    pub fn as_view(&self) -> KvCacheView<'_, T> {
        KvCacheView {
            config: self.config,
            data: self.data,
        }
    }

    /// The mutable view of one layer, what `reshape_and_cache` takes.
    ///
    /// # Errors
    /// [`KvError::LayerOutOfRange`].
    pub fn layer_mut(&mut self, layer: usize) -> Result<LayerKvMut<'_, T>, KvError> {
        check_layer(layer, &self.config)?;
        Ok(LayerKvMut {
            config: self.config,
            ptr: NonNull::from(&mut *self.data).cast(),
            len: self.data.len(),
            layer,
            _borrow: PhantomData,
        })
    }
}

/// One layer of a paged cache, read-only: the cache a decode or prefill attention call reads.
/// Holds the base of the whole cache (or arena) and the layer index; element addressing is
/// [`KvCacheConfig::offset`].
///
/// It holds a raw base pointer, not a slice, so that it can view a [`KvArena`] that other
/// engine threads write at the same time (their own pages): a reference is formed only for
/// one head vector, by [`head`](Self::head). Views made from a borrowed slice (through
/// [`KvCacheView::layer`]) carry that borrow's lifetime; views of an arena come from the
/// `unsafe` [`ArenaView`](super::ArenaView) accessors, whose callers promise page ownership.
///
/// Invariant: `ptr` is aligned and valid for reads of `len = config.total_elems()` elements of
/// `T` for `'a`, and no element this view reads is written by anyone else during `'a`.
///
/// [`KvArena`]: crate::kv::KvArena
#[derive(Debug, Clone, Copy)]
pub struct LayerKv<'a, T> {
    config: KvCacheConfig,
    ptr: NonNull<T>,
    len: usize,
    layer: usize,
    _borrow: PhantomData<&'a [T]>,
}

// SAFETY: a `LayerKv` is a shared, read-only view (like `&'a [T]`, which is Send and Sync for
// `T: Sync`); the type invariant says nothing writes what it reads while it lives.
unsafe impl<T: Sync> Send for LayerKv<'_, T> {}
// SAFETY: as for `Send`: sharing it between threads only lets each read.
unsafe impl<T: Sync> Sync for LayerKv<'_, T> {}

impl<'a, T: KvElem> LayerKv<'a, T> {
    /// A view of layer `layer` of the cache at `ptr`.
    ///
    /// # Errors
    /// [`KvError::DtypeMismatch`], [`KvError::LayerOutOfRange`], [`KvError::BaseMisaligned`]
    /// if `ptr` is not aligned for `T` (a valid pointer need not be; the view's slices must).
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `config.total_elems()` elements for `'a`, and no one
    /// may write, during `'a`, an element that a kernel given this view reads (the pages of the
    /// block tables it is given, in this layer).
    pub unsafe fn from_raw(
        config: &KvCacheConfig,
        ptr: NonNull<T>,
        layer: usize,
    ) -> Result<Self, KvError> {
        check_dtype::<T>(config.dtype())?;
        check_layer(layer, config)?;
        check_aligned(ptr)?;
        Ok(Self {
            config: *config,
            ptr,
            len: config.total_elems(),
            layer,
            _borrow: PhantomData,
        })
    }

    /// The geometry.
    #[inline]
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }
    /// The layer index (`< num_layers`).
    #[inline]
    pub fn layer(&self) -> usize {
        self.layer
    }
    /// The `n` elements at element offset `offset` (a head vector: `offset` from
    /// [`KvCacheConfig::offset`], `n = head_dim`).
    ///
    /// # Panics
    /// If `offset + n` exceeds the cache: the kernels validate block tables first, so this is
    /// a bug in the caller, not bad input.
    #[inline]
    pub fn head(&self, offset: usize, n: usize) -> &'a [T] {
        assert!(
            offset.checked_add(n).is_some_and(|e| e <= self.len),
            "KV read out of range"
        );
        // SAFETY: `offset + n <= len` (checked), and `ptr` is aligned and valid for reads of
        // `len` elements for `'a` with nothing writing what this view reads (type invariant).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), n) }
    }
}

/// One layer of a paged cache, mutable: what `reshape_and_cache` writes. A raw base pointer
/// for the same reason as [`LayerKv`]; references are formed one token row at a time.
///
/// Invariant: `ptr` is aligned and valid for reads and writes of `len = config.total_elems()`
/// elements for `'a`, and no one else accesses an element this view writes during `'a`.
#[derive(Debug)]
pub struct LayerKvMut<'a, T> {
    config: KvCacheConfig,
    ptr: NonNull<T>,
    len: usize,
    layer: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: like `&'a mut [T]`, which is Send for `T: Send`: the view is the only accessor of
// what it writes (type invariant).
unsafe impl<T: Send> Send for LayerKvMut<'_, T> {}

impl<'a, T: KvElem> LayerKvMut<'a, T> {
    /// A mutable view of layer `layer` of the cache at `ptr`.
    ///
    /// # Errors
    /// As [`LayerKv::from_raw`].
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `config.total_elems()` elements for `'a`,
    /// and no one else may access, during `'a`, an element written through this view (the
    /// slots it is given, in this layer).
    pub unsafe fn from_raw(
        config: &KvCacheConfig,
        ptr: NonNull<T>,
        layer: usize,
    ) -> Result<Self, KvError> {
        check_dtype::<T>(config.dtype())?;
        check_layer(layer, config)?;
        check_aligned(ptr)?;
        Ok(Self {
            config: *config,
            ptr,
            len: config.total_elems(),
            layer,
            _borrow: PhantomData,
        })
    }

    /// The geometry.
    #[inline]
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }
    /// The layer index (`< num_layers`).
    #[inline]
    pub fn layer(&self) -> usize {
        self.layer
    }
    /// Copies `src` to element offset `offset`.
    ///
    /// # Panics
    /// If the destination exceeds the cache (a caller bug: slots are validated first).
    #[inline]
    pub fn write(&mut self, offset: usize, src: &[T]) {
        assert!(
            offset.checked_add(src.len()).is_some_and(|e| e <= self.len),
            "KV write out of range"
        );
        // SAFETY: the destination is inside the `len` aligned elements `ptr` is valid for
        // (checked); no one else accesses it (type invariant) and `src` is a distinct borrow (a
        // `&[T]` cannot alias memory this view alone may access).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        }
    }
    /// A read-only view of the same layer.
    #[inline]
    pub fn as_layer(&self) -> LayerKv<'_, T> {
        LayerKv {
            config: self.config,
            ptr: self.ptr,
            len: self.len,
            layer: self.layer,
            _borrow: PhantomData,
        }
    }
}

/// A run of consecutive blocks copied as one: blocks `src..src+len` to `dst..dst+len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRun {
    /// First source block.
    pub src: u32,
    /// First destination block.
    pub dst: u32,
    /// Blocks in the run (at least 1).
    pub len: u32,
}

/// Merges a `(src, dst)` block mapping, in order, into runs: consecutive pairs `(s, d)`,
/// `(s+1, d+1)`, ... become one [`BlockRun`]. With the layout's block-outermost order each run
/// is one contiguous copy on both sides of equal page stride: `(len - 1) * page_bytes +
/// bytes_per_block` bytes (`len * bytes_per_block` when dense). Pairs are not
/// reordered (the caller, typically the block pool, already hands out neighbouring blocks).
pub fn coalesce_block_runs(pairs: &[(u32, u32)]) -> impl Iterator<Item = BlockRun> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let &(src, dst) = pairs.get(i)?;
        let mut len = 1u32;
        i += 1;
        while let Some(&(s, d)) = pairs.get(i) {
            if Some(s) == src.checked_add(len) && Some(d) == dst.checked_add(len) {
                len += 1;
                i += 1;
            } else {
                break;
            }
        }
        Some(BlockRun { src, dst, len })
    })
}

/// Validates a `(src, dst)` block mapping: every source `< src_blocks`, every destination
/// `< dst_blocks`, destinations pairwise distinct, and when `same_space` (a copy inside one
/// cache) no destination is also a source of the same call, so that the result does not depend
/// on the order the copies run in (the CUDA kernel runs them concurrently).
///
/// Allocation-free for up to 32 pairs; longer lists are checked through one sorted scratch copy.
///
/// # Errors
/// [`KvError::BlockOutOfRange`], [`KvError::DuplicateDestination`], [`KvError::CopyOverlap`].
pub fn check_block_mapping(
    pairs: &[(u32, u32)],
    src_blocks: usize,
    dst_blocks: usize,
    same_space: bool,
) -> Result<(), KvError> {
    for &(s, d) in pairs {
        check_block(s as u64, src_blocks)?;
        check_block(d as u64, dst_blocks)?;
    }
    if pairs.len() <= 32 {
        for (i, &(s_i, d_i)) in pairs.iter().enumerate() {
            for &(s_j, d_j) in &pairs[..i] {
                if d_i == d_j {
                    return Err(KvError::DuplicateDestination { block: d_i });
                }
                if same_space && (d_i == s_j || s_i == d_j) {
                    return Err(KvError::CopyOverlap {
                        block: if d_i == s_j { d_i } else { d_j },
                    });
                }
            }
            if same_space && s_i == d_i {
                return Err(KvError::CopyOverlap { block: d_i });
            }
        }
        return Ok(());
    }
    let mut dsts: Vec<u32> = pairs.iter().map(|p| p.1).collect();
    dsts.sort_unstable();
    if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
        return Err(KvError::DuplicateDestination { block: w[0] });
    }
    if same_space {
        for &(s, _) in pairs {
            if dsts.binary_search(&s).is_ok() {
                return Err(KvError::CopyOverlap { block: s });
            }
        }
    }
    Ok(())
}

/// Where the blocks of a copy live on each side: the page stride of the source and of the
/// destination, and the length of a block, all in the same unit (bytes or elements).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunStrides {
    pub(crate) src_stride: usize,
    pub(crate) dst_stride: usize,
    pub(crate) block_len: usize,
}

impl RunStrides {
    /// Byte strides for a copy from a cache of geometry `src` to one of geometry `dst` (same
    /// block shape).
    pub(crate) fn bytes(src: &KvCacheConfig, dst: &KvCacheConfig) -> Self {
        Self {
            src_stride: src.page_bytes(),
            dst_stride: dst.page_bytes(),
            block_len: src.bytes_per_block(),
        }
    }
}

/// Copies validated runs from `src` to `dst` (two distinct buffers). A run of consecutive
/// blocks is one copy when both sides have the same stride (the padding between the run's
/// blocks travels with them: it is part of pages the run owns on both sides); otherwise each
/// block is copied on its own.
pub(crate) fn copy_runs(src: &[u8], dst: &mut [u8], st: RunStrides, pairs: &[(u32, u32)]) {
    for run in coalesce_block_runs(pairs) {
        let (s0, d0) = (run.src as usize, run.dst as usize);
        if st.src_stride == st.dst_stride {
            let n = (run.len as usize - 1) * st.src_stride + st.block_len;
            let (s, d) = (s0 * st.src_stride, d0 * st.dst_stride);
            dst[d..d + n].copy_from_slice(&src[s..s + n]);
        } else {
            for i in 0..run.len as usize {
                let (s, d) = ((s0 + i) * st.src_stride, (d0 + i) * st.dst_stride);
                dst[d..d + st.block_len].copy_from_slice(&src[s..s + st.block_len]);
            }
        }
    }
}

/// Copies validated runs inside one buffer whose blocks are `stride` units apart and
/// `block_len` units long (no destination is a source: see [`check_block_mapping`]). Generic
/// over the element type so typed views use it too.
pub(crate) fn copy_runs_within<E: Copy>(
    buf: &mut [E],
    stride: usize,
    block_len: usize,
    pairs: &[(u32, u32)],
) {
    for run in coalesce_block_runs(pairs) {
        let n = (run.len as usize - 1) * stride + block_len;
        let s = run.src as usize * stride;
        let d = run.dst as usize * stride;
        buf.copy_within(s..s + n, d);
    }
}

pub(crate) fn check_block(block: u64, num_blocks: usize) -> Result<(), KvError> {
    if block >= num_blocks as u64 {
        return Err(KvError::BlockOutOfRange {
            block: block as i64,
            num_blocks,
        });
    }
    Ok(())
}

pub(crate) fn check_dtype<T: KvElem>(expected: KvDtype) -> Result<(), KvError> {
    if T::DTYPE != expected {
        return Err(KvError::DtypeMismatch {
            expected,
            found: T::DTYPE,
        });
    }
    Ok(())
}

fn check_len(what: &'static str, expected: usize, found: usize) -> Result<(), KvError> {
    if expected != found {
        return Err(KvError::LengthMismatch {
            what,
            expected,
            found,
        });
    }
    Ok(())
}

/// Refuses a raw base that is not aligned for `T`: the views turn it into `&[T]` (`head`) and
/// `copy_nonoverlapping` targets (`write`), both of which require alignment that a pointer
/// "valid for reads" does not promise.
fn check_aligned<T>(ptr: NonNull<T>) -> Result<(), KvError> {
    if !ptr.as_ptr().is_aligned() {
        return Err(KvError::BaseMisaligned {
            align: std::mem::align_of::<T>(),
        });
    }
    Ok(())
}

fn check_layer(layer: usize, config: &KvCacheConfig) -> Result<(), KvError> {
    if layer >= config.num_layers() {
        return Err(KvError::LayerOutOfRange {
            layer,
            num_layers: config.num_layers(),
        });
    }
    Ok(())
}
