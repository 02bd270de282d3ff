//! Identifiers handed out by the block pool and the limits they imply: the ground floor, which
//! every other module (block, budget, kv, error) may use without reaching into another.

use std::fmt;

/// Bits of a [`BlockId`] that hold the dense block index.
pub(crate) const INDEX_BITS: u32 = 24;
/// Bits of a [`BlockId`] that hold the block's generation.
pub(crate) const GEN_BITS: u32 = 24;
pub(crate) const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
pub(crate) const GEN_MASK: u64 = (1 << GEN_BITS) - 1;

/// The largest number of blocks one pool may hold. One index value (all ones) is reserved as the
/// free list's end marker.
pub const MAX_BLOCKS: u32 = (1 << INDEX_BITS) - 1;

/// A physical KV block handed out by a [`BlockPool`](crate::block::BlockPool).
///
/// Packed in one `u64` (cheap to copy, store in an atomic block-table slot, and compare):
///
/// ```text
///   63        48 47            24 23             0
///  +------------+----------------+----------------+
///  |  pool tag  |   generation   |  dense index   |
///  +------------+----------------+----------------+
/// ```
///
/// - *index*: the block's position in device memory, `0..pool.total()`; what the kernels see.
/// - *generation*: bumped each time the block is allocated, so an id kept after it was freed is
///   recognised as stale instead of silently freeing someone else's block. It has 24 bits and
///   wraps: a stale id goes unnoticed when the block has since been allocated a multiple of
///   2^24 times and is allocated now. Detection is certain below 2^24 reallocations; over an
///   arbitrary number of them it holds with probability 1 - 2^-24 (about 1 - 6 × 10^-8).
/// - *pool tag*: unique among the live pools of this process (and so per device); an id from
///   another live pool is refused. A dropped pool's tag goes back to the process, last in line
///   (at most 65,535 pools live at once).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(u64);

impl BlockId {
    pub(crate) const fn pack(pool: u16, generation: u32, index: u32) -> Self {
        Self(
            ((pool as u64) << (INDEX_BITS + GEN_BITS))
                | (((generation as u64) & GEN_MASK) << INDEX_BITS)
                | ((index as u64) & INDEX_MASK),
        )
    }

    /// The dense block index, as the kernels' block tables hold it.
    #[inline]
    pub const fn index(self) -> u32 {
        (self.0 & INDEX_MASK) as u32
    }

    /// The allocation generation of the block this id names.
    #[inline]
    pub const fn generation(self) -> u32 {
        ((self.0 >> INDEX_BITS) & GEN_MASK) as u32
    }

    /// The tag of the pool that minted this id.
    #[inline]
    pub const fn pool_tag(self) -> u16 {
        (self.0 >> (INDEX_BITS + GEN_BITS)) as u16
    }

    /// The packed representation (for atomic storage and FFI).
    #[inline]
    pub const fn to_bits(self) -> u64 {
        self.0
    }

    /// Rebuilds an id from [`to_bits`](Self::to_bits). Any `u64` is accepted; the pool validates
    /// the id when it is used.
    #[inline]
    pub const fn from_bits(bits: u64) -> Self {
        Self(bits)
    }
}

impl fmt::Debug for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BlockId(#{} gen {} pool {})",
            self.index(),
            self.generation(),
            self.pool_tag()
        )
    }
}

/// An engine (one loaded model) drawing blocks from a shared pool and budget. Dense,
/// `0..max_engines`, chosen by whoever registers engines (the budget coordinator hands them out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EngineId(pub u16);

impl EngineId {
    /// The id as an index into per-engine arrays.
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}
