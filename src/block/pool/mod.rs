//! The lock-free KV block pool of one device: the pool, its layout and its counts here; the
//! allocation side in `alloc.rs`, the release side in `free.rs`.

mod alloc;
mod free;

use super::ids::{self, BlockId, EngineId, INDEX_BITS, INDEX_MASK, MAX_BLOCKS};
use super::magazine::{count_of, Magazine, MAG_CAP};
use crate::error::PoolError;
use crate::sync::{fence, global, AtomicU32, AtomicU64, Backoff, CachePadded, Ordering};

/// End-of-list marker in a link or the head (all index bits set).
const NIL: u32 = MAX_BLOCKS;
const TAG_SHIFT: u32 = INDEX_BITS;
/// Bits of the head's ABA tag: 40, or 2 under loom, so that a model with a few head updates can
/// wrap the tag and loom can show the tag is what stops ABA (tests/loom/pool.rs,
/// `pop_pop_push_aba`: three updates between a popper's load and its CAS must still be caught).
const TAG_BITS: u32 = if cfg!(loom) { 2 } else { 64 - INDEX_BITS };
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;

const RC_BITS: u32 = 24;
const RC_MASK: u64 = (1 << RC_BITS) - 1;
const GEN_SHIFT: u32 = RC_BITS;
const GEN_MASK: u64 = (1 << 24) - 1;
const OWNER_SHIFT: u32 = 48;
/// The generation's bits, at the same place in a metadata word and in a [`BlockId`]
/// (`pool (16) | generation (24) | index (24)`), so the fast paths compare and mint
/// generations without shifting them.
const GEN_FIELD: u64 = GEN_MASK << GEN_SHIFT;
const GEN_ONE: u64 = 1 << GEN_SHIFT;
/// Where a [`BlockId`] keeps its pool tag.
const POOL_SHIFT: u32 = INDEX_BITS + ids::GEN_BITS;
const OWNER_FIELD: u64 = 0xffff << OWNER_SHIFT;
const _: () =
    assert!(GEN_SHIFT == INDEX_BITS && OWNER_SHIFT == POOL_SHIFT && GEN_MASK == ids::GEN_MASK);
/// The largest reference count a block can reach.
pub const MAX_REFS: u32 = (1 << RC_BITS) - 1;
/// Ids `free_n` checks with their words kept (and blocks it pushes with one CAS).
const CHAIN: usize = 64;
/// Engines with a magazine (engines beyond use the shared stack alone), bounding the pool's
/// magazine memory and the snapshot a refusal reads. Under loom engines 0 and 1 have one: two,
/// so that models reach a snapshot racing moves in and out of two magazines (with one, a
/// double collect of the head alone would pass every model), and engines from 2 on use the
/// shared stack alone.
const MAG_ENGINES: u16 = if cfg!(loom) { 2 } else { 64 };

#[inline]
fn head_word(tag_of: u64, index: u32) -> u64 {
    // The new tag is the old one plus one, wrapping at TAG_BITS.
    ((((tag_of >> TAG_SHIFT).wrapping_add(1)) & TAG_MASK) << TAG_SHIFT) | u64::from(index)
}

#[inline]
fn head_index(head: u64) -> u32 {
    (head & INDEX_MASK) as u32
}

#[inline]
fn link_word(depth: u32, next: u32) -> u64 {
    (u64::from(depth) << 32) | u64::from(next)
}

#[inline]
fn link_next(link: u64) -> u32 {
    (link & INDEX_MASK) as u32
}

#[inline]
fn link_depth(link: u64) -> u32 {
    (link >> 32) as u32
}

#[inline]
fn meta_word(refs: u32, generation: u32, owner: EngineId) -> u64 {
    u64::from(refs)
        | ((u64::from(generation) & GEN_MASK) << GEN_SHIFT)
        | (u64::from(owner.0) << OWNER_SHIFT)
}

#[inline]
fn meta_refs(meta: u64) -> u32 {
    (meta & RC_MASK) as u32
}

#[inline]
fn meta_gen(meta: u64) -> u32 {
    ((meta >> GEN_SHIFT) & GEN_MASK) as u32
}

#[inline]
fn meta_owner(meta: u64) -> EngineId {
    EngineId((meta >> OWNER_SHIFT) as u16)
}

/// One block's words, alone on a cache line: blocks of different engines never share a line,
/// so two engines' scheduler threads releasing and claiming their own blocks write no common
/// line (with 8-byte words packed, neighbouring blocks of two engines made every release a
/// line transfer between cores: 2.4x the pair's time with 2 threads, BENCHMARKS.md). 64 bytes
/// of host memory per block (64 MiB for a million blocks).
#[derive(Debug)]
#[repr(align(64))]
struct BlockLine {
    /// `owner (16) | generation (24) | refs (24)`; `refs == 0` iff the block is free.
    meta: AtomicU64,
    /// `depth (32) | next (24)`. Meaningful only while the block is on the shared stack: `next`
    /// is the block below it, `depth` the stack's length from it to the bottom.
    link: AtomicU64,
}

/// How a pool is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// The device whose memory the blocks name (an id chosen by the caller, e.g. the CUDA
    /// ordinal); carried for error messages and checked through the pool tag of every id.
    pub device: u32,
    /// Blocks in the pool, `1..=MAX_BLOCKS`.
    pub num_blocks: u32,
    /// Engines that may allocate from the pool, `1..=u16::MAX`; engine ids are `0..max_engines`.
    pub max_engines: u16,
}

/// Counts read from a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks in the pool.
    pub total: u32,
    /// Blocks on the free list.
    pub free: u32,
    /// Physical blocks owned by each engine, indexed by engine id.
    pub held: Vec<u32>,
}

/// The free KV blocks of one device, shared by every engine (model) through `Arc`.
///
/// Lock-free: every operation completes in a bounded number of its own steps unless another
/// thread's operation on the same word (the head, a magazine, a block) succeeded meanwhile; no
/// operation waits for another to finish (a magazine another thread is pushing to is skipped). The algorithm and the ABA argument
/// follow.
///
///
/// # Algorithm
///
/// The free blocks form a **Treiber stack** (R. K. Treiber, 1986) threaded through a per-block
/// link array, with a **tagged head word** against ABA:
///
/// ```text
///  head: |        tag (40 bits)        | top index (24 bits) |
///  link[i]: | depth (32 bits) | next index (24 bits, low) |
/// ```
///
/// - `pop` reads the head, reads `link[top].next`, and CASes the head to `(tag + 1, next)`.
/// - `push(i)` writes `link[i] = (depth(top) + 1, top)` and CASes the head to `(tag + 1, i)`.
/// - `alloc_n(n)` walks `n` links from the top and detaches the whole chain with **one** CAS,
///   so it takes `n` blocks or none: no partial grab is ever visible to anyone.
///
/// **ABA.** Every successful CAS on the head increments the 40-bit tag. A CAS that compares
/// against a head it read earlier can only succeed if no other CAS succeeded in between, unless
/// a multiple of 2^40 (1.1 × 10^12) head updates happened while this thread was between its load
/// and its CAS: at one update per 10 ns that is a stall of three hours inside a handful of
/// instructions. (Under loom the tag has 2 bits, so that models can show it is what stops ABA.) Within that argument, a successful CAS proves the stack was untouched since the
/// load, so the `next` (or the chain) read from it was the live one. Links read from a stale head
/// may be garbage; they are only used if the CAS proves them current, and every link value is an
/// index below the pool size or the end marker, so reading them is always in bounds.
///
/// **Reclamation.** Nodes are never freed: the link array lives as long as the pool, so a stale
/// reader never touches freed memory (no hazard pointers or epochs needed).
///
/// # Per-engine magazines
///
/// Beside the shared stack, each of the first 64 engines has a **magazine** (magazine.rs): a
/// bounded array stack of up to 64 free blocks with one pusher at a time and any number of
/// poppers, so an engine's scheduler thread recycles its own blocks without the shared head and
/// without walking links.
///
/// - Blocks whose last reference `free_n` releases go to their owner's magazine if they fit and
///   no other push to that magazine is in progress (never awaited), else to the shared stack. A
///   single `release` pushes to the shared stack (one CAS, cheaper than a magazine push).
/// - `alloc`/`alloc_n` take from the caller's magazine when it holds enough (one CAS, a slice of
///   the array), else from the shared stack (one CAS). Each grab takes from one list, so no
///   partial grab is ever visible.
/// - When neither holds enough, the refusal is decided on a snapshot of the shared stack and
///   every magazine at one instant (a double collect: every change to any of those words changes
///   it, tags included). If the snapshot holds enough, every magazine is moved to the shared
///   stack and the grab retried: a retry means another thread's operation completed a step, so
///   this stays lock-free.
///
/// **Exact counts.** Each link records the depth of the stack below and including its node, set
/// when pushed; a magazine's word holds its count. The free count is the stack's top depth plus
/// every magazine's count: exact whenever no operation is in flight. During concurrent
/// operations a refusal (and `free_count`) reflects one instant at which the free lists held
/// fewer blocks than asked; blocks between lists at that instant count as not free: a block
/// being released (between its last reference and its push, as before magazines) and, new with
/// magazines, blocks another allocation is moving from the magazines to the shared stack.
///
/// # Ownership, reference counts and stale ids
///
/// Each block has a metadata word:
///
/// ```text
///  meta[i]: | owner engine (16) | generation (24) | reference count (24) |
/// ```
///
/// A count of zero means the block is on the free list. Only the thread that popped a block
/// writes its metadata while the count is zero (the block is unreachable by anyone else), so
/// allocation publishes `count = 1, generation + 1, owner` with a plain store. Every other change
/// (`share`, `release`) is a CAS that requires a non-zero count and the caller's generation: a
/// double free and a free of a never-allocated block are refused with an error, and so is a free
/// through an id kept after the block was freed and reallocated, unless the 24-bit generation
/// wrapped in between (the block reallocated a multiple of 2^24 times: see [`BlockId`]; with an
/// arbitrary reuse count a stale id is caught with probability 1 - 2^-24). The pool stays
/// consistent either way. The release that takes the count from one to zero is the only one
/// that pushes the block back, so a block returns to the free list exactly once.
///
/// # Per-engine accounting
///
/// The engine that allocates a block owns it until it returns to the free list;
/// [`held`](Self::held) counts the physical blocks each engine owns (shared references do not
/// count twice). It is kept as `acct[engine]` (owned plus parked in the engine's magazine) minus
/// the magazine's count, so a batch moving between an engine and its own magazine (the common
/// `alloc_n` / `free_n` pair) updates no counter: the counters change only when blocks move to
/// or from the shared stack.
///
/// # Memory
///
/// Each block's metadata word and link share one 64-byte line of their own (64 bytes of host
/// memory per block: 64 MiB for a million blocks), so blocks of different engines never share
/// a line: two engines' scheduler threads recycling their own blocks write no common line.
///
/// # Read-modify-writes per batch
///
/// The fast pair `alloc_n(n)` + `free_n` of those blocks does `n + 3` of them: the magazine pop,
/// one CAS per block (the release, which is also the block's check), and the magazine push's
/// claim and release. The per-block CAS is what makes a double free racing the batch come out
/// with exactly one success; it is most of the pair's time (see BENCHMARKS.md).
#[derive(Debug)]
pub struct BlockPool {
    /// `tag (40) | top index (24)`. The tag increments on every successful CAS; the index is the
    /// top of the free stack, or `NIL` when the pool is exhausted.
    head: CachePadded<AtomicU64>,
    /// Each block's words (metadata and free-list link), one cache line per block.
    blocks: Box<[BlockLine]>,
    /// Per engine: the physical blocks it owns (last reference still held) plus the free blocks
    /// parked in its magazine. A block moving between an engine's ownership and its magazine
    /// (the fast paths of `alloc_n` and `free_n`) leaves this unchanged, so those paths do no
    /// read-modify-write on it; only moves to or from the shared stack change it. `held`
    /// subtracts the magazine's count.
    acct: Box<[CachePadded<AtomicU32>]>,
    /// Free blocks parked per engine (the first `MAG_ENGINES` engines): a block whose last
    /// reference is released goes to its owner's magazine when there is room and no other push
    /// to it is in progress, else to the shared stack. Free = shared stack + every magazine.
    mags: Box<[Magazine]>,
    tag: u16,
    device: u32,
    total: u32,
}

impl Drop for BlockPool {
    /// Gives the pool's tag back for a later pool.
    fn drop(&mut self) {
        global::release_pool_tag(self.tag);
    }
}

impl BlockPool {
    /// Builds a pool with every block free.
    pub fn new(config: PoolConfig) -> Result<Self, PoolError> {
        if config.num_blocks == 0 {
            return Err(PoolError::InvalidConfig("num_blocks must be at least 1"));
        }
        if config.num_blocks > MAX_BLOCKS {
            return Err(PoolError::InvalidConfig(
                "num_blocks exceeds MAX_BLOCKS (2^24 - 1)",
            ));
        }
        if config.max_engines == 0 {
            return Err(PoolError::InvalidConfig("max_engines must be at least 1"));
        }
        let tag = global::acquire_pool_tag().ok_or(PoolError::InvalidConfig(
            "65,535 block pools are alive: no pool tag is free",
        ))?;
        let n = config.num_blocks;
        // Block 0 on top, so a fresh pool hands out 0, 1, 2, ... (predictable in tests).
        let blocks = (0..n)
            .map(|i| {
                let next = if i + 1 == n { NIL } else { i + 1 };
                BlockLine {
                    meta: AtomicU64::new(meta_word(0, 0, EngineId(0))),
                    link: AtomicU64::new(link_word(n - i, next)),
                }
            })
            .collect();
        let acct = (0..config.max_engines)
            .map(|_| CachePadded::new(AtomicU32::new(0)))
            .collect();
        let mag_cap = MAG_CAP.min(n);
        let mags = (0..config.max_engines.min(MAG_ENGINES))
            .map(|_| Magazine::new(mag_cap))
            .collect();
        Ok(Self {
            head: CachePadded::new(AtomicU64::new(0)),
            blocks,
            acct,
            mags,
            tag,
            device: config.device,
            total: n,
        })
    }

    /// Blocks in the pool.
    #[inline]
    pub fn total(&self) -> u32 {
        self.total
    }

    /// The device this pool's blocks live on.
    #[inline]
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The tag every id from this pool carries.
    #[inline]
    pub fn tag(&self) -> u16 {
        self.tag
    }

    /// Engines this pool serves.
    #[inline]
    pub fn max_engines(&self) -> u16 {
        self.acct.len() as u16
    }

    /// Free blocks (the shared stack plus every magazine). Exact whenever no operation is in
    /// flight; during concurrent operations it is the number of free blocks at some instant of
    /// the call (blocks a concurrent allocation is moving between free lists count as not
    /// free at that instant, as blocks being released always have).
    pub fn free_count(&self) -> u32 {
        self.snapshot_free()
    }

    /// Free blocks on the shared stack alone, from a head word read with Acquire.
    #[inline]
    fn stack_depth(&self, head: u64) -> u32 {
        let top = head_index(head);
        if top == NIL {
            0
        } else {
            // Relaxed: the caller's Acquire load of `head` pairs with the Release CAS of the
            // push that made this top current, so its link (and depth) is visible.
            link_depth(self.blocks[top as usize].link.load(Ordering::Relaxed))
        }
    }

    /// The free count at one instant, by double collect: read the head and every magazine
    /// word, read them again, and accept when nothing changed (every change to any of them
    /// changes its word: tags rise on every push, counts fall on every pop). Lock-free: a retry
    /// means another operation completed a step meanwhile.
    fn snapshot_free(&self) -> u32 {
        let mut words = [0u64; MAG_ENGINES as usize];
        let backoff = Backoff::new();
        loop {
            // Acquire: see stack_depth.
            let head = self.head.load(Ordering::Acquire);
            let mut free = self.stack_depth(head);
            for (w, m) in words.iter_mut().zip(self.mags.iter()) {
                *w = m.word();
                free += count_of(*w);
            }
            // Acquire fence, paired with the Release fence at the start of `push_chain`: if the
            // Relaxed read of the top's depth above saw a link written by a later push (the
            // top was popped and pushed again since our first head load), the head load below
            // sees that pop, and the collect is retried. Without it the memory model lets the
            // second load return the old head too, and the count mixes a depth from after a
            // push with magazine counts from before it (loom
            // `free_count_racing_a_round_trip_through_a_magazine`: 2 of 3 blocks free, a state
            // the pool never had).
            fence(Ordering::Acquire);
            let same = self.head.load(Ordering::Acquire) == head
                && words
                    .iter()
                    .zip(self.mags.iter())
                    .all(|(&w, m)| m.word() == w);
            if same {
                return free;
            }
            backoff.spin();
        }
    }

    /// Physical blocks owned by `engine` (0 for an engine out of range).
    ///
    /// Exact whenever no operation is in flight. During concurrent operations it is the count
    /// at some instant of the call, except that blocks another thread is moving from `engine`'s
    /// magazine to the shared stack (the slow path of an allocation that found too few blocks
    /// where it looked) count as held until they reach the stack.
    pub fn held(&self, engine: EngineId) -> u32 {
        let Some(acct) = self.acct.get(engine.index()) else {
            return 0;
        };
        let Some(m) = self.mags.get(engine.index()) else {
            // Relaxed: a statistic; no memory is published through it.
            return acct.load(Ordering::Relaxed);
        };
        // Double collect: the magazine's word changes with every push and pop, so an unchanged
        // word around the read of `acct` gives the magazine's count at that read's instant.
        let backoff = Backoff::new();
        loop {
            let word = m.word();
            // Acquire pairs with the Release subtraction of a magazine flush: having read the
            // count after a flush moved parked blocks out, the second read of the word sees
            // that move, so a lowered count is never paired with the word from before it
            // (with Relaxed the memory model allows it: `held` read k too low, loom
            // `held_racing_a_magazine_flush`).
            let owned_or_parked = acct.load(Ordering::Acquire);
            if m.word() == word {
                return owned_or_parked.saturating_sub(count_of(word));
            }
            backoff.spin();
        }
    }

    /// A snapshot of the pool's counts (`held` of each engine as [`held`](Self::held) reads it).
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            total: self.total,
            free: self.snapshot_free(),
            held: (0..self.max_engines())
                .map(|e| self.held(EngineId(e)))
                .collect(),
        }
    }

    #[inline]
    fn check_engine(&self, engine: EngineId) -> Result<(), PoolError> {
        if engine.index() < self.acct.len() {
            Ok(())
        } else {
            Err(PoolError::UnknownEngine {
                engine,
                max_engines: self.max_engines(),
            })
        }
    }

    /// Checks that `id` was minted by this pool and is in range; returns its index.
    #[inline]
    fn check_id(&self, id: BlockId) -> Result<usize, PoolError> {
        if id.pool_tag() != self.tag {
            return Err(PoolError::ForeignBlock {
                id,
                id_pool: id.pool_tag(),
                pool: self.tag,
                device: self.device,
            });
        }
        if id.index() >= self.total {
            return Err(PoolError::OutOfRange {
                id,
                total: self.total,
            });
        }
        Ok(id.index() as usize)
    }

    #[inline]
    fn check_live(&self, id: BlockId, meta: u64) -> Result<(), PoolError> {
        if meta_gen(meta) != id.generation() {
            return Err(PoolError::StaleBlock {
                id,
                current: meta_gen(meta),
            });
        }
        if meta_refs(meta) == 0 {
            return Err(PoolError::NotAllocated { id });
        }
        Ok(())
    }

    /// Whether more than one holder references the block (copy-on-write must copy before
    /// writing).
    pub fn is_shared(&self, id: BlockId) -> Result<bool, PoolError> {
        Ok(self.ref_count(id)? > 1)
    }

    /// The block's current reference count (at least 1 for a live id).
    pub fn ref_count(&self, id: BlockId) -> Result<u32, PoolError> {
        let index = self.check_id(id)?;
        let meta = self.blocks[index].meta.load(Ordering::Acquire);
        self.check_live(id, meta)?;
        Ok(meta_refs(meta))
    }

    /// The engine that owns (allocated) the block.
    pub fn owner(&self, id: BlockId) -> Result<EngineId, PoolError> {
        let index = self.check_id(id)?;
        let meta = self.blocks[index].meta.load(Ordering::Acquire);
        self.check_live(id, meta)?;
        Ok(meta_owner(meta))
    }
}
