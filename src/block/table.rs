//! Atomic block tables: one sequence's logical-to-physical block map.

use super::ids::{BlockId, EngineId};
use super::pool::BlockPool;
use crate::error::PoolError;
use crate::sync::{fence, Arc, AtomicU64, Ordering};

#[inline]
fn state_word(epoch: u32, len: u32) -> u64 {
    (u64::from(epoch) << 32) | u64::from(len)
}

#[inline]
fn state_len(state: u64) -> u32 {
    state as u32
}

#[inline]
fn state_epoch(state: u64) -> u32 {
    (state >> 32) as u32
}

/// Blocks a truncation hands the pool per `free_n` call: the pool's largest recycled chain and a
/// magazine's capacity, and few enough to keep on the writer's stack.
const RELEASE_BATCH: usize = 64;

#[derive(Debug)]
struct Shared {
    /// `epoch (32) | len (32)`; written only by the table's single writer.
    state: AtomicU64,
    /// `slots[i]` for `i < len` is the packed [`BlockId`] of logical block `i`.
    slots: Box<[AtomicU64]>,
}

/// A sequence's block table: the writer's handle. Owns one reference to each of its blocks.
///
///
/// # Protocol
///
/// One writer (the engine's scheduler, through the `&mut` methods of [`BlockTable`]) and any
/// number of readers ([`TableReader`], e.g. metrics or a prefix-cache indexer on other threads).
///
/// ```text
///  state: | epoch (32 bits) | len (32 bits) |
///  slots: [AtomicU64; capacity]   slot i < len holds the BlockId of logical block i
/// ```
///
/// - **append** (wait-free, two stores): write `slots[len]`, then store `state = (epoch, len+1)`
///   with Release. Appends never change a slot below `len`.
/// - **truncate / replace**: store `state = (epoch+1, new_len)` with Release (it is itself a
///   state readers may accept), a Release fence, then write slots. This is the writer side of a
///   **sequence lock**: the epoch changes *before* any slot below the old length can be
///   overwritten.
/// - **snapshot** (reader): load `state` (Acquire), copy `slots[..len]`, an Acquire fence, load
///   `state` again; if the epoch is unchanged the copy is exactly the table at the first load
///   (appends in between only touched slots at or past `len`), otherwise retry. If a copied slot
///   saw a write made after an epoch bump, the writer's Release fence synchronises with the
///   reader's Acquire fence and the second load sees the new epoch. Readers retry only across a
///   truncate or replace; the epoch would have to wrap (2^32 truncations during one copy) to
///   fool them.
///
/// Blocks are owned by the table: dropping it, or truncating it, releases them through the pool's
/// reference counting, so a table never leaks a block.
///
/// # Progress
///
/// `push` is wait-free (one load to check the id, two stores). The table's own part of
/// `truncate`, `replace` and `clear` is a fixed number of stores, but they (and `drop`) then
/// release blocks through the pool, whose reference-count and free-list updates are CAS loops:
/// those calls are **lock-free**, not wait-free (a call can retry only because another
/// thread's pool operation succeeded).
/// `grow` and `fork` allocate or share through the pool and are lock-free too. A reader's
/// `snapshot_into` retries only when the writer began a truncate or replace meanwhile (each
/// bumps the epoch once, before anything else), so it is lock-free, and it waits for nothing:
/// a writer stalled half way leaves a state readers accept (a reader retries across its bump
/// once, then accepts).
#[derive(Debug)]
pub struct BlockTable {
    shared: Arc<Shared>,
    pool: Arc<BlockPool>,
    engine: EngineId,
    /// The writer's own copy of `state` (it is the only writer), so it never reads its atomic.
    epoch: u32,
    len: u32,
}

/// A reader's handle on a table, for other threads: consistent snapshots, no ownership.
#[derive(Debug, Clone)]
pub struct TableReader {
    shared: Arc<Shared>,
}

impl BlockTable {
    /// An empty table for a sequence of `engine` that can hold up to `capacity` blocks.
    ///
    /// The slots are allocated here, 8 bytes a block, so `capacity` is bounded by the pool's
    /// [`total`](BlockPool::total) blocks ([`PoolError::TableTooLarge`] above it): a sequence
    /// longer than the whole pool could never be resident, and an unchecked `u32::MAX` would
    /// ask for 32 GiB.
    pub fn new(pool: Arc<BlockPool>, engine: EngineId, capacity: u32) -> Result<Self, PoolError> {
        if capacity > pool.total() {
            return Err(PoolError::TableTooLarge {
                capacity,
                total: pool.total(),
            });
        }
        let slots = (0..capacity).map(|_| AtomicU64::new(0)).collect();
        Ok(Self {
            shared: Arc::new(Shared {
                state: AtomicU64::new(0),
                slots,
            }),
            pool,
            engine,
            epoch: 0,
            len: 0,
        })
    }

    /// Blocks in the table.
    #[inline]
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the table holds no block.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most blocks the table can hold.
    #[inline]
    pub fn capacity(&self) -> u32 {
        self.shared.slots.len() as u32
    }

    /// The engine whose blocks the table holds.
    #[inline]
    pub fn engine(&self) -> EngineId {
        self.engine
    }

    /// The pool the table's blocks come from.
    #[inline]
    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// A handle other threads can read snapshots through.
    pub fn reader(&self) -> TableReader {
        TableReader {
            shared: Arc::clone(&self.shared),
        }
    }

    /// The id of logical block `i`.
    #[inline]
    pub fn get(&self, i: u32) -> Option<BlockId> {
        // Relaxed: the writer reads its own writes.
        (i < self.len)
            .then(|| BlockId::from_bits(self.shared.slots[i as usize].load(Ordering::Relaxed)))
    }

    /// The last block, if any.
    #[inline]
    pub fn last(&self) -> Option<BlockId> {
        self.len.checked_sub(1).and_then(|i| self.get(i))
    }

    /// Appends a block the caller holds one reference to; the table takes that reference.
    /// Wait-free: one load (the id is checked against the table's pool: another pool's, out of
    /// range, free or stale ids are refused, since the table's release of them would fail and
    /// leak its slot's block), one slot store and one state store. On error the caller keeps its
    /// reference.
    pub fn push(&mut self, id: BlockId) -> Result<(), PoolError> {
        self.pool.ref_count(id)?;
        self.push_checked(id)
    }

    /// [`push`](Self::push) of an id known to be a live block of this table's pool.
    fn push_checked(&mut self, id: BlockId) -> Result<(), PoolError> {
        let Some(slot) = self.shared.slots.get(self.len as usize) else {
            return Err(PoolError::TableFull {
                capacity: self.capacity(),
            });
        };
        // Relaxed: published by the Release store of `state` below.
        slot.store(id.to_bits(), Ordering::Relaxed);
        self.len += 1;
        // Release: a reader that sees the new length sees the slot.
        self.shared
            .state
            .store(state_word(self.epoch, self.len), Ordering::Release);
        Ok(())
    }

    /// Allocates `n` blocks from the pool for this table's engine and appends them, all or
    /// nothing. `scratch` is a reusable buffer (cleared first).
    pub fn grow(&mut self, n: u32, scratch: &mut Vec<BlockId>) -> Result<(), PoolError> {
        if self.len as u64 + n as u64 > self.capacity() as u64 {
            return Err(PoolError::TableFull {
                capacity: self.capacity(),
            });
        }
        scratch.clear();
        self.pool.alloc_n(self.engine, n, scratch)?;
        for &id in scratch.iter() {
            // Cannot fail: capacity was checked above, and the pool just allocated the id.
            self.push_checked(id)?;
        }
        Ok(())
    }

    /// Keeps the first `new_len` blocks and releases the rest through the pool. Returns how many
    /// blocks went back to the free list (shared ones only lose a reference). Lock-free: the
    /// releases are the pool's CAS loops (see the module's Progress section).
    ///
    /// The blocks go back in batches of up to 64 through [`BlockPool::free_n`], so a
    /// sequence's unshared pages refill its engine's magazine (the engine's next `alloc_n`
    /// takes them without the pool's shared head) instead of being pushed one CAS on the
    /// shared head at a time.
    pub fn truncate(&mut self, new_len: u32) -> u32 {
        if new_len >= self.len {
            return 0;
        }
        let old_len = self.len;
        self.bump_epoch(new_len);
        let mut batch = [BlockId::from_bits(0); RELEASE_BATCH];
        let mut freed = 0;
        let mut start = new_len;
        while start < old_len {
            let n = (old_len - start).min(RELEASE_BATCH as u32);
            for (k, dst) in batch[..n as usize].iter_mut().enumerate() {
                // Relaxed: the writer reads its own writes.
                let slot = &self.shared.slots[start as usize + k];
                *dst = BlockId::from_bits(slot.load(Ordering::Relaxed));
            }
            freed += self.release_batch(&batch[..n as usize]);
            start += n;
        }
        freed
    }

    /// Releases every block; the table is empty afterwards.
    pub fn clear(&mut self) -> u32 {
        self.truncate(0)
    }

    /// Replaces logical block `i` with `id` (copy-on-write: the caller copied the shared block
    /// into a fresh one). The table takes the caller's reference to `id` and releases its
    /// reference to the old block; returns the old id. Lock-free (the release is the pool's).
    pub fn replace(&mut self, i: u32, id: BlockId) -> Result<BlockId, PoolError> {
        let old = self.get(i).ok_or(PoolError::PastTableEnd {
            from: i,
            end: u64::from(i) + 1,
            len: self.len,
        })?;
        // As in `push`: an id the table could not release later is refused now.
        self.pool.ref_count(id)?;
        self.bump_epoch(self.len);
        // Relaxed: ordered after the epoch bump by the Release fence in bump_epoch.
        self.shared.slots[i as usize].store(id.to_bits(), Ordering::Relaxed);
        // Release: publish the slot to readers that start after this.
        self.shared
            .state
            .store(state_word(self.epoch, self.len), Ordering::Release);
        self.release_owned(old);
        Ok(old)
    }

    /// A new table (same engine, same capacity) holding one more reference to each of this
    /// table's blocks: a fork, or prefix reuse.
    pub fn fork(&self) -> Result<Self, PoolError> {
        let mut child = Self::new(Arc::clone(&self.pool), self.engine, self.capacity())?;
        for i in 0..self.len {
            let id = self.get(i).ok_or(PoolError::TableFull {
                capacity: self.capacity(),
            })?;
            // On error `child` drops and releases the references taken so far.
            self.pool.share(id)?;
            child.push_checked(id)?;
        }
        Ok(child)
    }

    /// Whether logical block `i` is shared with another holder (write to it only after a copy).
    pub fn is_shared(&self, i: u32) -> Result<bool, PoolError> {
        match self.get(i) {
            Some(id) => self.pool.is_shared(id),
            None => Ok(false),
        }
    }

    /// Writes the table's block indices into `row` (one row of the kernels' flat
    /// `[num_seqs, max_blocks]` i32 table) and fills the rest of the row with `pad`. No
    /// allocation. Fails if the row is shorter than the table.
    pub fn write_row(&self, row: &mut [i32], pad: i32) -> Result<(), PoolError> {
        let len = self.len as usize;
        if row.len() < len {
            return Err(PoolError::RowTooShort {
                needed: self.len,
                row: row.len(),
            });
        }
        for (dst, slot) in row.iter_mut().zip(&self.shared.slots[..len]) {
            // Relaxed: the writer reads its own writes.
            *dst = BlockId::from_bits(slot.load(Ordering::Relaxed)).index() as i32;
        }
        row[len..].fill(pad);
        Ok(())
    }

    /// Writes the indices of logical blocks `from..from + dst.len()` into `dst` (a part of a
    /// kernel row: a scheduler that keeps rows across steps only writes the blocks that are
    /// new). Fails if the range passes the table's end.
    pub fn write_indices(&self, from: u32, dst: &mut [i32]) -> Result<(), PoolError> {
        let start = from as usize;
        let end = start.saturating_add(dst.len());
        if end > self.len as usize {
            return Err(PoolError::PastTableEnd {
                from,
                end: end as u64,
                len: self.len,
            });
        }
        for (d, slot) in dst.iter_mut().zip(&self.shared.slots[start..end]) {
            // Relaxed: the writer reads its own writes.
            *d = BlockId::from_bits(slot.load(Ordering::Relaxed)).index() as i32;
        }
        Ok(())
    }

    /// Copies the table's ids into `out` (cleared first).
    pub fn ids_into(&self, out: &mut Vec<BlockId>) {
        out.clear();
        out.extend(
            self.shared.slots[..self.len as usize]
                .iter()
                .map(|s| BlockId::from_bits(s.load(Ordering::Relaxed))),
        );
    }

    fn bump_epoch(&mut self, new_len: u32) {
        self.epoch = self.epoch.wrapping_add(1);
        self.len = new_len;
        // Release store: a reader that sees this state also sees every slot written before it
        // (the state is itself a snapshot readers accept). Then a Release fence: it orders the
        // new epoch before every later slot store of the writer (the sequence-lock writer side,
        // see the module docs). loom found the first half missing: with a Relaxed store here a
        // reader could load the bumped state and still read a slot's initial value.
        self.shared
            .state
            .store(state_word(self.epoch, new_len), Ordering::Release);
        fence(Ordering::Release);
    }

    /// Releases a reference the table held. The table only ever holds live ids of its own
    /// pool, so the pool cannot refuse; if it did, the table's invariant was broken elsewhere
    /// and the block is left to the pool's accounting rather than panicking.
    fn release_owned(&self, id: BlockId) -> bool {
        let result = self.pool.release(id);
        debug_assert!(result.is_ok(), "block table held an invalid id: {result:?}");
        result.unwrap_or(false)
    }

    /// Releases one reference to each block of `ids` (a slice of the table's own slots) with
    /// one `free_n`; returns how many went back to the free list. As for
    /// [`release_owned`](Self::release_owned) the pool cannot refuse the table's ids; if its
    /// checks did (the pool unchanged), each id is released alone, so the others still go back.
    fn release_batch(&self, ids: &[BlockId]) -> u32 {
        match self.pool.free_n(ids) {
            Ok(freed) => freed,
            Err(PoolError::ConcurrentDoubleFree { freed, .. }) => {
                debug_assert!(false, "a block table's reference was released by another");
                freed
            }
            Err(e) => {
                debug_assert!(false, "block table held an invalid id: {e:?}");
                ids.iter()
                    .map(|&id| u32::from(self.release_owned(id)))
                    .sum()
            }
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.truncate(0);
    }
}

impl TableReader {
    /// Copies a consistent snapshot of the table's ids into `out` (cleared first): the table as
    /// it was at one instant. Retries only if the writer truncated or replaced meanwhile.
    pub fn snapshot_into(&self, out: &mut Vec<BlockId>) {
        loop {
            out.clear();
            // Acquire pairs with the writer's Release store of `state`: slots below len are
            // visible.
            let before = self.shared.state.load(Ordering::Acquire);
            let len = state_len(before) as usize;
            out.extend(
                self.shared.slots[..len]
                    .iter()
                    .map(|s| BlockId::from_bits(s.load(Ordering::Relaxed))),
            );
            // Acquire fence pairs with the writer's Release fence in bump_epoch: if any slot
            // load above saw a post-bump write, the load below sees the bumped epoch.
            fence(Ordering::Acquire);
            let after = self.shared.state.load(Ordering::Relaxed);
            if state_epoch(before) == state_epoch(after) {
                return;
            }
            crate::sync::hint::spin_loop();
        }
    }

    /// Blocks in the table at this instant.
    pub fn len(&self) -> u32 {
        state_len(self.shared.state.load(Ordering::Acquire))
    }

    /// Whether the table is empty at this instant.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
