//! A model's view of the device's [`KvArena`]: its own geometry (layers, KV heads, head dim,
//! dtype, tokens per block) laid over the arena's pages with the page size as block stride.
//!
//! # Fitting models of different sizes into one page size
//!
//! A page has one size for every model; a model's block is `tokens x bytes_per_token` bytes.
//! Each model gets its own **tokens per page**: the largest power of two from
//! [`MIN_TOKENS_PER_PAGE`] to [`MAX_TOKENS_PER_PAGE`] whose block fits the page (the scheme of
//! vLLM's `unify_kv_cache_spec_page_size`, which scales each spec's block size to one page
//! size, generalised with padding so sizes need not divide). The rest of the page is padding,
//! reported by [`ArenaView::wasted_bytes_per_page`]. [`page_bytes_for`] sizes the page so that
//! the model with the largest tokens footprint gets the tokens per page asked for; when every
//! per-token size is a power of two (as in most models: heads, head dims and layer counts are)
//! every model then fills its pages exactly, unless it would need more than
//! [`MAX_TOKENS_PER_PAGE`] tokens to: a model whose per-token size is below 1/256 of the page
//! (a small draft model beside a large one: 1 KiB per token on a page sized for 16 tokens of
//! 512 KiB) gets 256 tokens and leaves the rest of every page unused, as its
//! [`ArenaView::wasted_bytes_per_page`] reports. A model whose smallest block does not fit a
//! page is refused with [`KvError::ModelDoesNotFit`].
//!
//! Powers of two keep the kernels' `position / block_size` a shift, and the CUDA kernels accept
//! exactly those from 8 to 256.

use super::arena::{KvArena, PAGE_ALIGN};
use super::dtype::{KvDtype, KvElem};
use super::host::{check_block_mapping, coalesce_block_runs, LayerKv, LayerKvMut, SwapSpace};
use super::layout::KvCacheConfig;
use crate::error::KvError;
use crate::sync::Arc;
use std::ptr::NonNull;

/// The fewest tokens a model's block may hold (the kernels' smallest block size).
pub const MIN_TOKENS_PER_PAGE: usize = 8;
/// The most tokens a model's block may hold (the kernels' largest block size).
pub const MAX_TOKENS_PER_PAGE: usize = 256;

/// What the arena needs to know of a model to lay its KV over pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelKvShape {
    /// Transformer layers whose KV is cached.
    pub num_layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Elements per head vector.
    pub head_dim: usize,
    /// Storage type.
    pub dtype: KvDtype,
}

impl ModelKvShape {
    /// Bytes one token occupies: every layer's K and V. Saturates at `usize::MAX` for a shape
    /// whose size does not fit (no page holds it: [`tokens_per_page`](Self::tokens_per_page)
    /// and [`page_bytes_for`] refuse it), where a wrapped product could look small. A shape
    /// with a zero size is 0 however large the others are (checked before multiplying, which
    /// could saturate on them first), so it is refused as the zero-size shape it is.
    pub fn bytes_per_token(&self) -> usize {
        if self.num_layers == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return 0;
        }
        [2, self.num_kv_heads, self.head_dim, self.dtype.size_bytes()]
            .into_iter()
            .try_fold(self.num_layers, usize::checked_mul)
            .unwrap_or(usize::MAX)
    }

    /// This shape's geometry with `block_size` tokens per block over `num_blocks` blocks,
    /// densely packed.
    ///
    /// # Errors
    /// As [`KvCacheConfig::new`].
    pub fn config(&self, block_size: usize, num_blocks: usize) -> Result<KvCacheConfig, KvError> {
        KvCacheConfig::new(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            block_size,
            num_blocks,
            self.dtype,
        )
    }

    /// The tokens per page this shape gets on pages of `page_bytes`: the largest power of two
    /// in `MIN_TOKENS_PER_PAGE..=MAX_TOKENS_PER_PAGE` whose block fits.
    ///
    /// # Errors
    /// [`KvError::ModelDoesNotFit`] if not even [`MIN_TOKENS_PER_PAGE`] tokens fit;
    /// [`KvError::ZeroDimension`] if the shape has a zero size.
    pub fn tokens_per_page(&self, page_bytes: usize) -> Result<usize, KvError> {
        let per_token = self.bytes_per_token();
        if per_token == 0 {
            return Err(KvError::ZeroDimension {
                what: "bytes per token",
            });
        }
        let fit = page_bytes / per_token;
        if fit < MIN_TOKENS_PER_PAGE {
            return Err(KvError::ModelDoesNotFit {
                bytes_per_token: per_token,
                min_tokens: MIN_TOKENS_PER_PAGE,
                page_bytes,
            });
        }
        // The largest power of two <= fit, capped.
        let pow = 1usize << (usize::BITS - 1 - fit.leading_zeros());
        Ok(pow.min(MAX_TOKENS_PER_PAGE))
    }
}

/// The page size that gives the model with the largest per-token size `tokens_per_page`
/// tokens per page (rounded up to [`PAGE_ALIGN`]).
///
/// `tokens_per_page` must be a power of two from [`MIN_TOKENS_PER_PAGE`] to
/// [`MAX_TOKENS_PER_PAGE`]: the only counts [`ModelKvShape::tokens_per_page`] gives a model
/// (any other would size a page on which the largest model gets fewer tokens than asked and
/// leaves the rest of every page unused, or none at all).
///
/// # Errors
/// [`KvError::TokensPerPage`] for any other `tokens_per_page`; [`KvError::ZeroDimension`] for
/// an empty list or a zero-size shape; [`KvError::SizeOverflow`].
pub fn page_bytes_for(shapes: &[ModelKvShape], tokens_per_page: usize) -> Result<usize, KvError> {
    if !tokens_per_page.is_power_of_two()
        || !(MIN_TOKENS_PER_PAGE..=MAX_TOKENS_PER_PAGE).contains(&tokens_per_page)
    {
        return Err(KvError::TokensPerPage {
            tokens_per_page,
            min: MIN_TOKENS_PER_PAGE,
            max: MAX_TOKENS_PER_PAGE,
        });
    }
    if shapes.iter().any(|s| s.bytes_per_token() == 0) {
        return Err(KvError::ZeroDimension {
            what: "bytes per token",
        });
    }
    let largest = shapes
        .iter()
        .map(ModelKvShape::bytes_per_token)
        .max()
        .ok_or(KvError::ZeroDimension { what: "models" })?;
    largest
        .checked_mul(tokens_per_page)
        .and_then(|b| b.checked_next_multiple_of(PAGE_ALIGN))
        .ok_or(KvError::SizeOverflow)
}

/// One model's cache over the shared arena: the arena and a geometry whose blocks are the
/// arena's pages (`num_blocks = num_pages`, block stride = page size).
///
/// Reading and writing go through the `unsafe` accessors: the arena is shared with other
/// engines' threads, and only the block pool's ownership protocol (see [`KvArena`]) makes a
/// page this view's to touch.
#[derive(Debug, Clone)]
pub struct ArenaView {
    arena: Arc<KvArena>,
    config: KvCacheConfig,
}

impl ArenaView {
    /// A view with the tokens per page [`ModelKvShape::tokens_per_page`] picks.
    ///
    /// # Errors
    /// [`KvError::ModelDoesNotFit`], or as [`ArenaView::with_block_size`].
    pub fn new(arena: Arc<KvArena>, shape: &ModelKvShape) -> Result<Self, KvError> {
        let tokens = shape.tokens_per_page(arena.page_bytes())?;
        Self::with_block_size(arena, shape, tokens)
    }

    /// A view with `block_size` tokens per page (any size whose block fits; the CUDA kernels
    /// take powers of two from 8 to 256).
    ///
    /// # Errors
    /// As [`KvCacheConfig::new`] and [`KvCacheConfig::with_page_stride`]
    /// ([`KvError::PageTooSmall`] when the block does not fit), or [`KvError::PageMisaligned`]
    /// when the page size is not a multiple of the dtype's size.
    pub fn with_block_size(
        arena: Arc<KvArena>,
        shape: &ModelKvShape,
        block_size: usize,
    ) -> Result<Self, KvError> {
        let config = shape
            .config(block_size, arena.num_pages())?
            .with_page_stride(arena.page_bytes())?;
        Ok(Self { arena, config })
    }

    /// The model's geometry over the arena.
    #[inline]
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The arena.
    #[inline]
    pub fn arena(&self) -> &Arc<KvArena> {
        &self.arena
    }

    /// Bytes of each page this model leaves unused.
    #[inline]
    pub fn wasted_bytes_per_page(&self) -> usize {
        self.config.wasted_bytes_per_page()
    }

    fn base<T: KvElem>(&self) -> NonNull<T> {
        // The arena's base is non-null and ARENA_ALIGN-aligned, more than any `KvElem` needs.
        NonNull::new(self.arena.base_ptr().cast::<T>()).unwrap_or(NonNull::dangling())
    }

    /// Layer `layer` of this model's cache, read-only: what the attention kernels take.
    ///
    /// # Errors
    /// [`KvError::DtypeMismatch`], [`KvError::LayerOutOfRange`].
    ///
    /// # Safety
    /// While the view lives, no one writes a page this model's kernels read through it: every
    /// page named by the block tables given to a kernel is held by this engine (its sequences
    /// hold a reference), and pages held with more than one reference are only read.
    pub unsafe fn layer<T: KvElem>(&self, layer: usize) -> Result<LayerKv<'_, T>, KvError> {
        // SAFETY: the arena's allocation spans `num_pages * page_bytes` bytes = the config's
        // `total_elems()` elements of `T` (page stride = page size), alive while `&self` is;
        // the caller's promise is exactly `LayerKv::from_raw`'s.
        unsafe { LayerKv::from_raw(&self.config, self.base(), layer) }
    }

    /// Layer `layer` of this model's cache, mutable: what `reshape_and_cache` takes.
    ///
    /// # Errors
    /// As [`layer`](Self::layer).
    ///
    /// # Safety
    /// While the view lives, no one else accesses a page written through it: every slot given
    /// to the kernel lies in a page this engine holds alone (reference count 1).
    pub unsafe fn layer_mut<T: KvElem>(&self, layer: usize) -> Result<LayerKvMut<'_, T>, KvError> {
        // SAFETY: as in `layer`; the caller's promise is `LayerKvMut::from_raw`'s.
        unsafe { LayerKvMut::from_raw(&self.config, self.base(), layer) }
    }

    /// Copies whole blocks between this model's pages (copy-on-write), `(src, dst)` pairs.
    ///
    /// # Errors
    /// See [`check_block_mapping`]; nothing is copied on error.
    ///
    /// # Safety
    /// During the call no one writes a source page and no one else accesses a destination
    /// page (this engine holds every destination alone).
    pub unsafe fn copy_blocks(&self, pairs: &[(u32, u32)]) -> Result<(), KvError> {
        let n = self.config.num_blocks();
        check_block_mapping(pairs, n, n, true)?;
        let (page, len) = (self.config.page_bytes(), self.config.bytes_per_block());
        let base = self.arena.base_ptr();
        for run in coalesce_block_runs(pairs) {
            let bytes = (run.len as usize - 1) * page + len;
            // SAFETY: both runs are whole in-range pages (validated), so the byte ranges lie in
            // the allocation; sources and destinations are distinct pages (validated), so the
            // ranges do not overlap; the caller guarantees no concurrent access to them.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    base.add(run.src as usize * page),
                    base.add(run.dst as usize * page),
                    bytes,
                );
            }
        }
        Ok(())
    }

    /// Swaps blocks out of the arena into `swap` (dense, this model's block shape):
    /// `(page, swap_block)` pairs, `bytes_per_block` each.
    ///
    /// # Errors
    /// [`KvError::GeometryMismatch`]; see [`check_block_mapping`]. Nothing is copied on error.
    ///
    /// # Safety
    /// No one writes a source page during the call.
    pub unsafe fn swap_out(
        &self,
        swap: &mut SwapSpace,
        mapping: &[(u32, u32)],
    ) -> Result<(), KvError> {
        self.check_swap(swap, mapping, true)?;
        let (page, len) = (self.config.page_bytes(), self.config.bytes_per_block());
        let out = swap.storage_mut().as_bytes_mut();
        for &(p, s) in mapping {
            let d = s as usize * len;
            // SAFETY: `p < pages` (validated), so the page's first `len` bytes are inside the
            // arena; the caller guarantees no concurrent writer of it. `out` is the swap
            // space's own buffer, distinct from the arena.
            let src = unsafe {
                std::slice::from_raw_parts(self.arena.base_ptr().add(p as usize * page), len)
            };
            out[d..d + len].copy_from_slice(src);
        }
        Ok(())
    }

    /// Swaps blocks back in: `(swap_block, page)` pairs.
    ///
    /// # Errors
    /// As [`swap_out`](Self::swap_out).
    ///
    /// # Safety
    /// No one else accesses a destination page during the call (this engine holds it alone).
    pub unsafe fn swap_in(&self, swap: &SwapSpace, mapping: &[(u32, u32)]) -> Result<(), KvError> {
        self.check_swap(swap, mapping, false)?;
        let (page, len) = (self.config.page_bytes(), self.config.bytes_per_block());
        let from = swap.storage().as_bytes();
        for &(s, p) in mapping {
            let src = &from[s as usize * len..(s as usize + 1) * len];
            // SAFETY: `p` is an in-range page (validated), so the `len` bytes written lie in
            // the arena; `src` is the swap space's buffer, distinct from the arena; the caller
            // guarantees no one else accesses the page.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    self.arena.base_ptr().add(p as usize * page),
                    len,
                );
            }
        }
        Ok(())
    }

    /// Validates a swap mapping (`out`: arena to swap space).
    fn check_swap(
        &self,
        swap: &SwapSpace,
        mapping: &[(u32, u32)],
        out: bool,
    ) -> Result<(), KvError> {
        let sc = swap.config();
        if !sc.same_block_shape(&self.config) || !sc.is_dense() {
            return Err(KvError::GeometryMismatch);
        }
        let (pages, slots) = (self.config.num_blocks(), sc.num_blocks());
        let (src, dst) = if out { (pages, slots) } else { (slots, pages) };
        check_block_mapping(mapping, src, dst, false)
    }
}
