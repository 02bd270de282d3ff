//! The paged KV layout: the one place it is defined. The CPU kernels ([`crate::attn::cpu`]), the
//! CUDA kernels (`kernels/*.cu`, `src/cuda`), host storage and swap all address bytes through
//! the strides of [`KvCacheConfig`] and nothing else.

use super::arena::PAGE_ALIGN;
use super::dtype::KvDtype;
use crate::error::KvError;
use crate::ids::MAX_BLOCKS;

/// `head_dim` must be a multiple of this many elements: 16 bytes of `f16`/`bf16`, the width
/// the CUDA kernels load per thread and the CPU kernels' inner-loop unroll.
pub const HEAD_DIM_ALIGN: usize = 8;

/// Which half of a (block, layer): keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvPart {
    /// Keys (stored first).
    Key = 0,
    /// Values (stored second, `kv_stride` elements after the keys).
    Value = 1,
}

/// The geometry of one paged KV cache: a validated, immutable description of the layout
/// below. Cheap to copy.
///
/// Invariant (checked by [`new`](Self::new) and [`with_page_stride`](Self::with_page_stride)):
/// every field is at least 1, `head_dim` is a multiple of [`HEAD_DIM_ALIGN`],
/// `num_blocks <= MAX_BLOCKS`, `page_elems >= L*2*BS*H*D`, and
/// `num_blocks * page_elems * dtype.size_bytes()` does not overflow and fits in `isize`.
///
/// # Layout
///
/// One allocation per pool (device memory for a GPU pool, [`HostKvCache`](super::HostKvCache)
/// on the host, [`SwapSpace`](super::SwapSpace) for swapped-out blocks), row-major, element
/// offsets:
///
/// ```text
/// [num_blocks][num_layers][2 (K then V)][block_size][num_kv_heads][head_dim]
/// ```
///
/// With `L = num_layers`, `BS = block_size`, `H = num_kv_heads`, `D = head_dim`:
///
/// | stride (elements) | value          | what one step moves over                    |
/// |-------------------|----------------|---------------------------------------------|
/// | `head_stride`     | `D`            | one KV head of one token                    |
/// | `token_stride`    | `H*D`          | one token (all KV heads) of one K or V      |
/// | `kv_stride`       | `BS*H*D`       | K -> V of one block of one layer             |
/// | `layer_stride`    | `2*BS*H*D`     | one layer of one block                      |
/// | `block_stride`    | `P >= L*2*BS*H*D` | one block (all layers): the *page stride* |
///
/// `P`, the page stride, is the distance between consecutive blocks. A cache that owns its
/// memory packs blocks densely (`P = elems_per_block = L*2*BS*H*D`); a model's view of a shared
/// [`KvArena`](crate::kv::KvArena) uses the arena's page size, so `P` may exceed the block's
/// own size and the tail of each page (`page_bytes - bytes_per_block`) is padding the model
/// never touches. Every offset below, on the CPU and on the GPU, steps over blocks by `P`.
///
/// The head vector of token `t` (`0..BS`) of block `b`, layer `l`, K (`kv = 0`) or V (`kv = 1`),
/// KV head `h` starts at element
///
/// ```text
/// b*block_stride + l*layer_stride + kv*kv_stride + t*token_stride + h*head_stride
/// ```
///
/// and its `D` elements are contiguous. A token at logical position `p` of a sequence lives in
/// block `block_table[p / BS]`, token `p % BS`; its *slot* is `block * BS + p % BS` (what
/// `slot_mapping` holds).
///
/// # Why this order
///
/// A block is the unit the pool hands out, shares (copy-on-write) and swaps; putting the block
/// index outermost makes one block, across all layers and both K and V, **one contiguous run of
/// [`bytes_per_block`](KvCacheConfig::bytes_per_block) bytes**. `copy_blocks` and swap-in/out
/// are therefore one `memcpy` per block (and one per run of consecutive blocks, which
/// [`coalesce_block_runs`](super::coalesce_block_runs) merges), instead of one per block per
/// layer per K/V as with vLLM's per-layer `[num_blocks, ...]` tensors. The price is that one
/// layer of the cache is not a dense tensor: a kernel on layer `l` strides over blocks by
/// `block_stride`, which costs nothing since kernels reach blocks through the block table
/// anyway. Inside one (block, layer, K|V) the order `[BS][H][D]` keeps a token's heads
/// contiguous, so `reshape_and_cache` writes each new token with one contiguous copy of `H*D`
/// elements, and a kernel reading KV head `h` walks `BS` rows of `D` contiguous elements.
///
/// # Limits
///
/// All sizes are at least 1; `head_dim` is a multiple of [`HEAD_DIM_ALIGN`] (so a head vector
/// is whole 16-byte vectors in every dtype); `num_blocks` is at most
/// [`crate::ids::MAX_BLOCKS`] (block tables hold `i32`, block ids 24 bits); the
/// whole pool's byte size fits in `isize` (and so every element offset fits in `i64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvCacheConfig {
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
    dtype: KvDtype,
    /// Elements from one block to the next (the page stride); `elems_per_block` when dense.
    page_elems: usize,
}

impl KvCacheConfig {
    /// Validates and builds a geometry.
    ///
    /// # Errors
    /// [`KvError::ZeroDimension`] if any size is 0, [`KvError::HeadDimAlignment`] if `head_dim`
    /// is not a multiple of [`HEAD_DIM_ALIGN`], [`KvError::TooManyBlocks`] above
    /// [`MAX_BLOCKS`], [`KvError::SizeOverflow`] if the pool's byte size overflows `isize`.
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> Result<Self, KvError> {
        for (what, v) in [
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
            ("num_blocks", num_blocks),
        ] {
            if v == 0 {
                return Err(KvError::ZeroDimension { what });
            }
        }
        if head_dim % HEAD_DIM_ALIGN != 0 {
            return Err(KvError::HeadDimAlignment {
                head_dim,
                align: HEAD_DIM_ALIGN,
            });
        }
        if num_blocks > MAX_BLOCKS as usize {
            return Err(KvError::TooManyBlocks {
                num_blocks,
                max: MAX_BLOCKS as usize,
            });
        }
        let total = [
            num_layers,
            2,
            block_size,
            num_kv_heads,
            head_dim,
            num_blocks,
            dtype.size_bytes(),
        ]
        .into_iter()
        .try_fold(1usize, |acc, x| acc.checked_mul(x))
        .filter(|&b| b <= isize::MAX as usize);
        if total.is_none() {
            return Err(KvError::SizeOverflow);
        }
        Ok(Self {
            num_layers,
            num_kv_heads,
            head_dim,
            block_size,
            num_blocks,
            dtype,
            page_elems: num_layers * 2 * block_size * num_kv_heads * head_dim,
        })
    }

    /// The same geometry with blocks `page_bytes` apart instead of packed: a model's view of
    /// an arena of `page_bytes`-byte pages. The block's own bytes are the first
    /// [`bytes_per_block`](Self::bytes_per_block) of each page; the rest is padding.
    ///
    /// # Errors
    /// [`KvError::PageTooSmall`] if a block does not fit a page, [`KvError::PageMisaligned`]
    /// if `page_bytes` is not a multiple of [`PAGE_ALIGN`] (every page must start at a
    /// 16-byte boundary for the kernels' vector loads), [`KvError::SizeOverflow`] if
    /// `num_blocks * page_bytes` overflows `isize`.
    pub fn with_page_stride(&self, page_bytes: usize) -> Result<Self, KvError> {
        if page_bytes % PAGE_ALIGN != 0 {
            return Err(KvError::PageMisaligned {
                page_bytes,
                align: PAGE_ALIGN,
            });
        }
        if page_bytes < self.bytes_per_block() {
            return Err(KvError::PageTooSmall {
                page_bytes,
                block_bytes: self.bytes_per_block(),
            });
        }
        if page_bytes
            .checked_mul(self.num_blocks)
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(KvError::SizeOverflow);
        }
        Ok(Self {
            page_elems: page_bytes / self.dtype.size_bytes(),
            ..*self
        })
    }

    /// The same geometry with another block count (a swap space sized for `num_blocks` blocks of
    /// this cache's shape). The result is densely packed (its page stride is the block size)
    /// whatever this one's is.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_num_blocks(&self, num_blocks: usize) -> Result<Self, KvError> {
        Self::new(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            num_blocks,
            self.dtype,
        )
    }

    /// True when `other` has the same block shape (everything but `num_blocks` and the page
    /// stride): its blocks can be copied byte for byte into this cache's.
    pub fn same_block_shape(&self, other: &Self) -> bool {
        self.num_layers == other.num_layers
            && self.num_kv_heads == other.num_kv_heads
            && self.head_dim == other.head_dim
            && self.block_size == other.block_size
            && self.dtype == other.dtype
    }

    /// Transformer layers.
    #[inline]
    pub const fn num_layers(&self) -> usize {
        self.num_layers
    }
    /// KV heads per layer.
    #[inline]
    pub const fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    /// Elements per head vector.
    #[inline]
    pub const fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Tokens per block.
    #[inline]
    pub const fn block_size(&self) -> usize {
        self.block_size
    }
    /// Blocks in the pool.
    #[inline]
    pub const fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// Element type.
    #[inline]
    pub const fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Elements from one KV head of a token to the next: `D`.
    #[inline]
    pub const fn head_stride(&self) -> usize {
        self.head_dim
    }
    /// Elements from one token to the next inside a (block, layer, K|V): `H*D`.
    #[inline]
    pub const fn token_stride(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Elements from a (block, layer)'s keys to its values: `BS*H*D`.
    #[inline]
    pub const fn kv_stride(&self) -> usize {
        self.block_size * self.token_stride()
    }
    /// Elements from one layer of a block to the next: `2*BS*H*D`.
    #[inline]
    pub const fn layer_stride(&self) -> usize {
        2 * self.kv_stride()
    }
    /// Elements from one block to the next: the page stride, at least
    /// [`elems_per_block`](Self::elems_per_block) (equal when the cache is dense).
    #[inline]
    pub const fn block_stride(&self) -> usize {
        self.page_elems
    }
    /// Bytes from one block to the next: the page size of the arena this geometry views.
    #[inline]
    pub const fn page_bytes(&self) -> usize {
        self.page_elems * self.dtype.size_bytes()
    }
    /// Whether blocks are packed back to back (page stride = block size).
    #[inline]
    pub const fn is_dense(&self) -> bool {
        self.page_elems == self.elems_per_block()
    }
    /// Bytes of each page this geometry leaves unused: `page_bytes - bytes_per_block`.
    #[inline]
    pub const fn wasted_bytes_per_page(&self) -> usize {
        self.page_bytes() - self.bytes_per_block()
    }
    /// Elements in one block (all layers, K and V): `L*2*BS*H*D`.
    #[inline]
    pub const fn elems_per_block(&self) -> usize {
        self.num_layers * self.layer_stride()
    }
    /// Bytes in one block (all layers, K and V): the unit of copy and swap.
    #[inline]
    pub const fn bytes_per_block(&self) -> usize {
        self.elems_per_block() * self.dtype.size_bytes()
    }
    /// Elements the whole pool spans (`num_blocks` pages).
    #[inline]
    pub const fn total_elems(&self) -> usize {
        self.num_blocks * self.page_elems
    }
    /// Bytes in the whole pool.
    #[inline]
    pub const fn total_bytes(&self) -> usize {
        self.total_elems() * self.dtype.size_bytes()
    }
    /// Bytes one token occupies across all layers, K and V (the KV footprint of a token).
    #[inline]
    pub const fn bytes_per_token(&self) -> usize {
        self.num_layers * 2 * self.token_stride() * self.dtype.size_bytes()
    }
    /// Blocks needed to hold `tokens` tokens (`ceil(tokens / block_size)`).
    #[inline]
    pub const fn blocks_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Element offset of the head vector (`head_dim` contiguous elements) of token `token`
    /// (`0..block_size`) of block `block`, layer `layer`, `part`, KV head `head`. Arguments are
    /// not range-checked (debug builds assert); see [`KvCacheConfig`] for the formula.
    #[inline]
    pub fn offset(
        &self,
        block: usize,
        layer: usize,
        part: KvPart,
        token: usize,
        head: usize,
    ) -> usize {
        debug_assert!(block < self.num_blocks && layer < self.num_layers);
        debug_assert!(token < self.block_size && head < self.num_kv_heads);
        block * self.block_stride()
            + layer * self.layer_stride()
            + part as usize * self.kv_stride()
            + token * self.token_stride()
            + head * self.head_stride()
    }
}
