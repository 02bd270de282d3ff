//! Recomputation: the delegated single publisher, the water-filling of one round, and its
//! publication under the epoch (module docs).

use super::waterfill::{water_fill, Claim, FillScratch};
use super::{
    BudgetCoordinator, Publication, BUSY, DIRTY, FREE, JOINING, LEAVING, LIVE, MAX_ROUNDS,
};
use crate::sync::{fence, AtomicU32, Ordering};

/// What the publisher read of one slot, and what it computed for it.
#[derive(Debug, Clone, Copy, Default)]
struct Row {
    /// The slot takes part in this round (`JOINING`, `LIVE`).
    live: bool,
    active: bool,
    weight: u32,
    held: u64,
    token_budget: u32,
    block_quota: u32,
    block_limit: u32,
}

/// Scratch space of the publishing rounds, kept in the coordinator so that a warm round does
/// not allocate. Only the thread holding `BUSY` touches it.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    rows: Vec<Row>,
    claims: Vec<Claim>,
    idx: Vec<usize>,
    out: Vec<u64>,
    fill: FillScratch,
    /// The registry the cached quotas were computed for: each slot's weight, 0 if not live.
    quota_key: Vec<u32>,
    /// Block quotas per slot for `quota_key` (they depend on nothing else).
    quotas: Vec<u32>,
}

impl BudgetCoordinator {
    /// Whether inputs changed since the last publishing round began.
    #[inline]
    pub fn is_dirty(&self) -> bool {
        self.ctl.load(Ordering::Relaxed) & DIRTY != 0
    }

    /// The current publication epoch (even when no publication is in progress).
    #[inline]
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// [`recompute`](Self::recompute) if inputs changed since the last round; `None` otherwise
    /// (one load). Engines call it once per step. Registration, weights and activity mark the
    /// inputs changed; block holdings do not (that would put a load on every acquire), so the
    /// lendable pool, which counts idle engines' held blocks, is refreshed by the next
    /// recomputation: call [`recompute`](Self::recompute) on a timer too (the scheduler tick).
    #[inline]
    pub fn maybe_recompute(&self) -> Option<Publication> {
        self.is_dirty().then(|| self.recompute())
    }

    /// Recomputes every engine's token budget, block quota and limit from the current weights,
    /// activity and holdings, and publishes them. Never waits: if another thread is publishing
    /// it takes over this request and this call returns [`Publication::Deferred`]. Bounded by
    /// [`MAX_ROUNDS`] rounds of O(max_engines log max_engines) work (module docs).
    pub fn recompute(&self) -> Publication {
        // AcqRel: Acquire pairs with the Release RMWs of `mark_dirty` (we see the changes that
        // were marked), Release orders nothing before it but keeps the RMW chain a release
        // sequence.
        let prev = self.ctl.fetch_or(BUSY | DIRTY, Ordering::AcqRel);
        if prev & BUSY != 0 {
            return Publication::Deferred;
        }
        let mut rounds = 0;
        loop {
            // Clear DIRTY before reading: a change marked after this point triggers another
            // round. Acquire: see every change marked before.
            self.ctl.fetch_and(!DIRTY, Ordering::AcqRel);
            let epoch = self.scratch.with_mut(|scratch| {
                // SAFETY: we hold BUSY (set by our `fetch_or` that saw it clear, not yet cleared
                // by us), and only the BUSY holder touches `scratch`, so this is the only
                // reference to it. The previous holder's accesses happen-before ours: it cleared
                // BUSY with a Release RMW that our Acquire `fetch_or` read (or a later RMW of
                // the same release sequence).
                let scratch = unsafe { &mut *scratch };
                self.publish_round(scratch)
            });
            rounds += 1;
            // Release: our writes happen-before the next publisher's Acquire on `ctl`.
            let prev = self.ctl.fetch_and(!BUSY, Ordering::AcqRel);
            if prev & DIRTY == 0 || rounds == MAX_ROUNDS {
                return Publication::Published { epoch, rounds };
            }
            let prev = self.ctl.fetch_or(BUSY, Ordering::AcqRel);
            if prev & BUSY != 0 {
                // Another thread became the publisher and will serve the request.
                return Publication::Published { epoch, rounds };
            }
        }
    }

    /// One publishing round; the caller holds `BUSY`. Returns the new (even) epoch.
    fn publish_round(&self, s: &mut Scratch) -> u64 {
        let n = self.slots.len();
        s.rows.clear();
        s.rows.resize(n, Row::default());
        for (row, slot) in s.rows.iter_mut().zip(self.slots.iter()) {
            // Acquire: pairs with `register`'s Release store of JOINING (the weight is filled).
            let state = slot.state.load(Ordering::Acquire);
            row.live = state == JOINING || state == LIVE;
            if row.live {
                row.weight = slot.weight.load(Ordering::Relaxed);
                row.active = slot.active.load(Ordering::Relaxed);
                row.held = slot.blocks_held.load(Ordering::Relaxed);
            }
        }

        // Tokens: active engines, uniform cap.
        let token_cap = self.config.token_cap();
        self.fill(s, self.config.tokens_per_step, |r| r.active, |_| token_cap);
        for k in 0..s.idx.len() {
            s.rows[s.idx[k]].token_budget = s.out[k] as u32;
        }
        // Block quotas: every registered engine, uniform cap. They depend only on which slots
        // are live and their weights, so they are reused while those are unchanged.
        let block_cap = self.config.block_cap();
        let same_registry = s.quota_key.len() == n
            && s.rows
                .iter()
                .zip(&s.quota_key)
                .all(|(r, &k)| k == if r.live { r.weight } else { 0 });
        if !same_registry {
            self.fill(s, self.config.total_blocks, |_| true, |_| block_cap);
            s.quotas.clear();
            s.quotas.resize(n, 0);
            for k in 0..s.idx.len() {
                s.quotas[s.idx[k]] = s.out[k] as u32;
            }
            s.quota_key.clear();
            s.quota_key
                .extend(s.rows.iter().map(|r| if r.live { r.weight } else { 0 }));
        }
        for (r, &q) in s.rows.iter_mut().zip(&s.quotas) {
            r.block_quota = q;
            r.block_limit = q;
        }
        // Lendable: blocks neither guaranteed to an active engine nor held by an idle one.
        let reserved: u64 = s
            .rows
            .iter()
            .filter(|r| r.live)
            .map(|r| {
                if r.active {
                    u64::from(r.block_quota)
                } else {
                    r.held
                }
            })
            .sum();
        // At most `total_blocks`, so it fits in u32.
        let lendable = u64::from(self.config.total_blocks).saturating_sub(reserved) as u32;
        if lendable > 0 {
            self.fill(
                s,
                lendable,
                |r| r.active,
                |r| block_cap.saturating_sub(r.block_quota),
            );
            for k in 0..s.idx.len() {
                s.rows[s.idx[k]].block_limit += s.out[k] as u32;
            }
        }

        // Publish under the sequence lock, lowered figures first so that the sum of budgets
        // never exceeds the global one between two writes.
        let epoch = self.epoch.load(Ordering::Relaxed);
        self.epoch.store(epoch + 1, Ordering::Relaxed);
        // Release fence: a reader that sees any of the writes below also sees the odd epoch
        // (pairs with the Acquire fence in `snapshot`).
        fence(Ordering::Release);
        for lowering in [true, false] {
            for (row, slot) in s.rows.iter().zip(self.slots.iter()) {
                put(&slot.token_budget, row.token_budget, lowering);
                put(&slot.block_quota, row.block_quota, lowering);
                put(&slot.block_limit, row.block_limit, lowering);
            }
        }
        // Registry transitions, after the slot's figures are written.
        for (row, slot) in s.rows.iter().zip(self.slots.iter()) {
            let state = slot.state.load(Ordering::Relaxed);
            if row.live && state == JOINING {
                // Only `deregister` may race (JOINING -> LEAVING); if it won, the slot is
                // freed by the next round, which its mark_dirty guarantees.
                let _ =
                    slot.state
                        .compare_exchange(JOINING, LIVE, Ordering::AcqRel, Ordering::Relaxed);
            } else if state == LEAVING && !row.live {
                // This round read it as not live, so the passes above wrote its figures to zero.
                // Release: pairs with `register`'s Acquire CAS, which then sees them zeroed.
                slot.state.store(FREE, Ordering::Release);
            }
        }
        // Release: pairs with the Acquire epoch load in `snapshot`.
        self.epoch.store(epoch + 2, Ordering::Release);
        epoch + 2
    }

    /// Water-fills `total` over the live rows selected by `pick`, each capped by `cap`.
    /// Leaves the row indices in `s.idx` and amounts in `s.out`.
    fn fill(
        &self,
        s: &mut Scratch,
        total: u32,
        pick: impl Fn(&Row) -> bool,
        cap: impl Fn(&Row) -> u32,
    ) {
        s.idx.clear();
        s.claims.clear();
        for (i, r) in s.rows.iter().enumerate() {
            if r.live && pick(r) {
                s.idx.push(i);
                s.claims.push(Claim {
                    weight: r.weight,
                    cap: cap(r),
                });
            }
        }
        s.out.clear();
        s.out.resize(s.claims.len(), 0);
        water_fill(total, &s.claims, &mut s.out, &mut s.fill);
    }
}

/// Writes `value` in the pass that matches its direction: lowering values in the first pass,
/// raising ones in the second. Single writer (the publisher), so a load-then-store is exact.
#[inline]
fn put(cell: &AtomicU32, value: u32, lowering: bool) {
    let old = cell.load(Ordering::Relaxed);
    if (value < old) == lowering && value != old {
        cell.store(value, Ordering::Relaxed);
    }
}
