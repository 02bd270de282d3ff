//! Recomputation: the delegated single publisher, the water-filling of one round, and its
//! publication under the epoch (module docs).

use super::waterfill::{cover_floors, lift_zeros, water_fill, Claim, FillScratch};
use super::{
    blocks_reserved, BudgetCoordinator, Publication, BUSY, DIRTY, FREE, JOINING, LEAVING, LIVE,
    MAX_ROUNDS,
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
    /// Published demand (`NO_DEMAND`: the whole share).
    demand: u32,
    /// Published block demand (`NO_DEMAND`: the whole quota, and borrowing up to the cap).
    block_demand: u32,
    token_budget: u32,
    token_share: u32,
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
    /// Donor heap of [`lift_zeros`].
    lift: Vec<(u64, std::cmp::Reverse<u32>)>,
    /// The registry the cached quotas were computed for: each slot's weight, 0 if not live.
    quota_key: Vec<u32>,
    /// Block quotas per slot for `quota_key` (they depend on nothing else). `quota_key` is
    /// emptied before these are rewritten and refilled after, so a round that unwinds in
    /// between leaves no key that matches them.
    quotas: Vec<u32>,
    /// How far the current round got: what [`Unwind`] finds if the round panics.
    phase: Phase,
    /// A panic to inject into the next round that reaches this point (tests only). A `Cell`,
    /// so the write phase, which has `&Scratch`, can take it.
    #[cfg(any(test, loom))]
    fault: std::cell::Cell<Option<PublishFault>>,
}

/// How far a publishing round got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Phase {
    /// No round in progress, or one that has not written anything yet: `rows` may be partial,
    /// and nothing of this round is published.
    #[default]
    Computing,
    /// Every row is computed and the round is writing them under the odd epoch.
    Writing,
}

/// Where a test makes the next publishing round panic (`BudgetCoordinator::fail_next_publication`).
#[doc(hidden)]
#[cfg_attr(not(any(test, loom)), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishFault {
    /// While recomputing the block quotas (a round whose registry changed), after the cached
    /// quotas were overwritten: nothing is published yet.
    Computing,
    /// Between the lowering and the raising pass of the writes: the epoch is odd and the figures
    /// are half written.
    Writing,
}

/// The drop guard of one publishing round. If the round unwinds (a panic in the round, or in
/// anything it calls), dropping the guard finishes what a publisher owes: a round that had
/// started writing is written out in full from its computed rows (the writes are idempotent),
/// which leaves the epoch even and the figures one whole publication; one that had not leaves
/// the previous publication as it was. Then it sets `DIRTY`, so the interrupted request (and any
/// deferred to this publisher) is served by the next [`recompute`](BudgetCoordinator::recompute),
/// and gives up `BUSY`. Without it a panic left `BUSY` set forever: every later recompute
/// deferred, joining engines never joined, leaving ones were never freed.
struct Unwind<'a>(&'a BudgetCoordinator);

impl Drop for Unwind<'_> {
    fn drop(&mut self) {
        let c = self.0;
        c.scratch.with(|scratch| {
            // SAFETY: this thread still holds BUSY (the round's `fetch_or` took it and only the
            // code after a round that returned gives it back, which did not run), so no other
            // thread touches `scratch`; and the round's `&mut` to it is gone, its frame unwound
            // before this guard, declared before it, is dropped. So this shared reference is the
            // only one.
            let s = unsafe { &*scratch };
            if s.phase == Phase::Writing {
                // Cannot panic: atomic loads, stores and compare-exchanges over slices of equal
                // length (and a test's injected fault fires once).
                c.write_round(s);
            }
        });
        // Release (both): as at the end of a round, our writes happen-before the next
        // publisher's Acquire `fetch_or`. DIRTY first, so no round can start and find it clear.
        c.ctl.fetch_or(DIRTY, Ordering::Release);
        c.ctl.fetch_and(!BUSY, Ordering::Release);
    }
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
    /// (one load). Engines call it once per step. Registration, weights, activity and demand
    /// mark the inputs changed; block holdings do not (that would put a load on every acquire),
    /// so the lendable pool, which counts idle engines' held blocks, is refreshed by the next
    /// recomputation: call [`recompute`](Self::recompute) on a timer too (the scheduler tick).
    #[inline]
    pub fn maybe_recompute(&self) -> Option<Publication> {
        self.is_dirty().then(|| self.recompute())
    }

    /// Recomputes every engine's token share and budget, block quota and limit from the current
    /// weights, activity, demand and holdings, and publishes them. Never waits: if another
    /// thread is publishing it takes over this request and this call returns
    /// [`Publication::Deferred`]. Bounded by [`MAX_ROUNDS`] rounds of
    /// O(max_engines log max_engines) work (module docs).
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
            // Declared before the `with_mut` below, so that if the round unwinds, the round's
            // reference to `scratch` is gone when the guard runs.
            let guard = Unwind(self);
            let epoch = self.scratch.with_mut(|scratch| {
                // SAFETY: we hold BUSY (set by our `fetch_or` that saw it clear, not yet cleared
                // by us), and only the BUSY holder touches `scratch`, so this is the only
                // reference to it. The previous holder's accesses happen-before ours: it cleared
                // BUSY with a Release RMW that our Acquire `fetch_or` read (or a later RMW of
                // the same release sequence).
                let scratch = unsafe { &mut *scratch };
                self.publish_round(scratch)
            });
            // The round completed: BUSY is given back below, the normal way.
            std::mem::forget(guard);
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

    /// Makes the next publishing round that reaches `at` panic (tests only: the unwinding
    /// path of [`recompute`](Self::recompute)). `&mut self`: set before the coordinator is
    /// shared.
    #[cfg(any(test, loom))]
    #[doc(hidden)]
    pub fn fail_next_publication(&mut self, at: PublishFault) {
        self.scratch.with_mut(|scratch| {
            // SAFETY: `&mut self` is the only reference to the coordinator, so nothing else
            // can reach `scratch`.
            unsafe { (*scratch).fault.set(Some(at)) }
        });
    }

    /// Panics if a test asked for a fault at `at` (once). Nothing outside tests.
    #[inline(always)]
    #[allow(unused_variables)]
    fn fault_point(s: &Scratch, at: PublishFault) {
        #[cfg(any(test, loom))]
        if s.fault.get() == Some(at) {
            s.fault.set(None);
            panic!("injected panic during publication ({at:?})");
        }
    }

    /// One publishing round; the caller holds `BUSY`. Returns the new (even) epoch.
    fn publish_round(&self, s: &mut Scratch) -> u64 {
        s.phase = Phase::Computing;
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
                row.demand = slot.demand.load(Ordering::Relaxed);
                row.block_demand = slot.block_demand.load(Ordering::Relaxed);
                row.held = slot.blocks_held.load(Ordering::Relaxed);
            }
        }

        // Tokens: active engines, uniform cap.
        let token_cap = self.config.token_cap();
        self.fill(s, self.config.tokens_per_step, |r| r.active, |_| token_cap);
        // Every active engine gets at least one token when the device has one for each: a
        // share rounded down to 0 would otherwise stay 0 while the others have work.
        lift_zeros(&mut s.out, token_cap, &mut s.lift);
        for k in 0..s.idx.len() {
            let row = &mut s.rows[s.idx[k]];
            row.token_share = s.out[k] as u32;
            row.token_budget = row.token_share;
        }
        // Lending: the same water-fill with each engine capped by its published demand too, so
        // what an engine's demand leaves of its share goes to the engines that want more, by
        // weight. A budget is the larger of the two: never below the share.
        if s.rows
            .iter()
            .any(|r| r.live && r.active && r.demand < token_cap)
        {
            self.fill(
                s,
                self.config.tokens_per_step,
                |r| r.active,
                |r| r.demand.min(token_cap),
            );
            // Each engine keeps in that fill what it is promised beside the borrowers: its
            // share, or its demand where that is lower. Otherwise a share lifted from 0 (or
            // rounded a token higher than the fill rounds it) counts in a borrower's budget
            // too, and while the borrower's step holds it that engine gets nothing.
            let (rows, idx) = (&s.rows, &s.idx);
            cover_floors(
                &mut s.out,
                |k| {
                    let r = &rows[idx[k]];
                    u64::from(r.token_share.min(r.demand.min(token_cap)))
                },
                &mut s.lift,
            );
            for k in 0..s.idx.len() {
                let row = &mut s.rows[s.idx[k]];
                row.token_budget = row.token_budget.max(s.out[k] as u32);
            }
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
            // Invalidate the cache before touching it (a round that unwinds from here on must
            // not leave the old key beside new quotas).
            s.quota_key.clear();
            self.fill(s, self.config.total_blocks, |_| true, |_| block_cap);
            s.quotas.clear();
            s.quotas.resize(n, 0);
            for k in 0..s.idx.len() {
                s.quotas[s.idx[k]] = s.out[k] as u32;
            }
            Self::fault_point(s, PublishFault::Computing);
            s.quota_key
                .extend(s.rows.iter().map(|r| if r.live { r.weight } else { 0 }));
        }
        for (r, &q) in s.rows.iter_mut().zip(&s.quotas) {
            r.block_quota = q;
            r.block_limit = q;
        }
        // Lendable: blocks neither reserved by an active engine nor held by an idle one. An
        // active engine reserves its quota, or, where its published demand is lower, that
        // demand (at least what it holds): the rest of its quota is lent until its demand
        // rises (module docs, "Block lending").
        let reserved: u64 = s
            .rows
            .iter()
            .filter(|r| r.live)
            .map(|r| blocks_reserved(r.active, r.block_quota, r.block_demand, r.held))
            .sum();
        // At most `total_blocks`, so it fits in u32.
        let lendable = u64::from(self.config.total_blocks).saturating_sub(reserved) as u32;
        if lendable > 0 {
            // To the active engines that want more than their quota, by weight, each up to its
            // demand and the cap; then what they leave to every active engine, by weight.
            self.fill(
                s,
                lendable,
                |r| r.active,
                |r| block_cap.min(r.block_demand).saturating_sub(r.block_quota),
            );
            let mut lent = 0;
            for k in 0..s.idx.len() {
                s.rows[s.idx[k]].block_limit += s.out[k] as u32;
                lent += s.out[k] as u32;
            }
            if lent < lendable {
                self.fill(
                    s,
                    lendable - lent,
                    |r| r.active,
                    |r| block_cap.saturating_sub(r.block_limit),
                );
                for k in 0..s.idx.len() {
                    s.rows[s.idx[k]].block_limit += s.out[k] as u32;
                }
            }
        }

        s.phase = Phase::Writing;
        let epoch = self.write_round(s);
        s.phase = Phase::Computing;
        epoch
    }

    /// The write phase of a round: publishes the computed rows under the sequence lock and
    /// makes the registry transitions. The caller holds `BUSY`. Idempotent (its every write
    /// puts a computed value, and the epoch it starts from is the even one below the current),
    /// so the unwinding guard can run it again over a round that panicked inside it. Returns the
    /// new (even) epoch.
    fn write_round(&self, s: &Scratch) -> u64 {
        // Publish under the sequence lock, lowered figures first (a reader checking under the
        // epoch sees all or none; one loading figures one by one may still pair a raised figure
        // with one not yet seen lowered: the caps are enforced by the acquire paths' counts, not
        // by these figures' sums). Single writer (the BUSY holder):
        // the epoch is even unless a round of ours unwound inside this function.
        let epoch = self.epoch.load(Ordering::Relaxed) & !1;
        self.epoch.store(epoch + 1, Ordering::Relaxed);
        // Release fence: a reader that sees any of the writes below also sees the odd epoch
        // (pairs with the Acquire fence in `snapshot`).
        fence(Ordering::Release);
        for lowering in [true, false] {
            for (row, slot) in s.rows.iter().zip(self.slots.iter()) {
                put(&slot.token_budget, row.token_budget, lowering);
                put(&slot.token_share, row.token_share, lowering);
                put(&slot.block_quota, row.block_quota, lowering);
                put(&slot.block_limit, row.block_limit, lowering);
            }
            if lowering {
                // A test's fault lands here: odd epoch, figures half written.
                Self::fault_point(s, PublishFault::Writing);
            }
        }
        // Registry transitions, after the slot's figures are written.
        for (row, slot) in s.rows.iter().zip(self.slots.iter()) {
            // Acquire: pairs with `deregister`'s CAS into LEAVING, so the leaving engine's last
            // writes (idle, step ended) happen before our FREE store below, and so before the
            // next `register` of the slot (its Acquire CAS on FREE).
            let state = slot.state.load(Ordering::Acquire);
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

#[cfg(test)]
mod tests {
    use super::super::{BudgetConfig, BudgetCoordinator, Publication, PublishFault};
    use super::{BUSY, FREE, JOINING, LEAVING, LIVE};
    use crate::ids::EngineId;
    use crate::sync::Ordering;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// Runs `f`, which must panic with the injected fault.
    fn expect_injected_panic<R>(f: impl FnOnce() -> R) {
        let r = catch_unwind(AssertUnwindSafe(f));
        let p = r.err().expect("the injected fault did not fire");
        let msg = p.downcast_ref::<String>().map(String::as_str).unwrap_or("");
        assert!(
            msg.starts_with("injected panic during publication"),
            "{msg}"
        );
    }

    /// The protocol state after an unwound round: no publisher, an even epoch, and the
    /// interrupted request still pending.
    fn assert_recovered(c: &BudgetCoordinator) {
        assert_eq!(c.ctl.load(Ordering::Relaxed) & BUSY, 0, "BUSY left set");
        assert_eq!(c.epoch() % 2, 0, "odd epoch left behind");
        assert!(c.is_dirty(), "the interrupted request was dropped");
    }

    fn state(c: &BudgetCoordinator, e: EngineId) -> u32 {
        c.slots[e.index()].state.load(Ordering::Relaxed)
    }

    /// Recompute, join and leave after an unwound round, and the figures of every later
    /// publication those of a coordinator that never panicked.
    fn check_still_works(c: &BudgetCoordinator, a: EngineId, b: EngineId) {
        assert!(matches!(
            c.maybe_recompute(),
            Some(Publication::Published { .. })
        ));
        assert!(!c.is_dirty());
        // Join: a third engine becomes live and takes its share.
        let d = c.register(1).unwrap();
        assert_eq!(state(c, d), LIVE);
        c.set_active(d, true);
        c.recompute();
        let s = c.snapshot();
        assert!(s.consistent);
        let budgets: Vec<u32> = s.engines.iter().map(|x| x.token_budget).collect();
        let quotas: Vec<u32> = s.engines.iter().map(|x| x.block_quota).collect();
        // Weights a 1, b 2, d 1 of 12 tokens and 40 blocks, all active.
        assert_eq!((budgets, quotas), (vec![3, 6, 3], vec![10, 20, 10]));
        // Leave: a's slot is freed and reused.
        c.deregister(a).unwrap();
        assert_eq!(state(c, a), FREE);
        assert_eq!(c.register(1).unwrap(), a);
        assert!(c.is_registered(b) && c.is_registered(d));
        assert_eq!(c.epoch() % 2, 0);
    }

    /// Two engines, a (weight 1, active) and b (weight 2, idle), 12 tokens and 40 blocks.
    fn two_engines() -> (BudgetCoordinator, EngineId, EngineId) {
        let c = BudgetCoordinator::new(BudgetConfig::new(3, 12, 40)).unwrap();
        let a = c.register(1).unwrap();
        let b = c.register(2).unwrap();
        c.set_active(a, true);
        c.recompute();
        assert_eq!((c.token_budget(a), c.token_budget(b)), (12, 0));
        (c, a, b)
    }

    /// A panic half way through the writes (odd epoch, a's budget lowered, b's not yet raised):
    /// the guard writes the round out, so the snapshot right after is one whole publication.
    #[test]
    fn a_panic_while_writing_is_written_out_and_released() {
        let (mut c, a, b) = two_engines();
        c.fail_next_publication(PublishFault::Writing);
        c.set_active(b, true);
        expect_injected_panic(|| c.recompute());
        assert_recovered(&c);
        let s = c.snapshot();
        assert!(s.consistent, "{s:?}");
        assert_eq!((c.token_budget(a), c.token_budget(b)), (4, 8));
        check_still_works(&c, a, b);
    }

    /// A panic while computing, after the cached block quotas were overwritten for a new
    /// registry: nothing is published, and the cache is not reused for the old registry.
    #[test]
    fn a_panic_while_computing_publishes_nothing_and_drops_the_quota_cache() {
        let (mut c, a, b) = two_engines();
        c.set_weight(b, 1).unwrap();
        assert_eq!((c.block_quota(a), c.block_quota(b)), (20, 20));
        let published = |c: &BudgetCoordinator| {
            let s = c.snapshot();
            assert!(s.consistent);
            let figures: Vec<_> = s
                .engines
                .iter()
                .map(|x| (x.token_budget, x.block_quota, x.block_limit))
                .collect();
            (s.epoch, figures)
        };
        let before = published(&c);
        c.fail_next_publication(PublishFault::Computing);
        // Quotas for weights 1:2 are computed, then the round unwinds; set_weight's panic
        // reaches its caller.
        expect_injected_panic(|| c.set_weight(b, 2));
        assert_recovered(&c);
        assert_eq!(published(&c), before, "a partial round was published");
        // Back to the registry the cache was keyed on: its quotas must be recomputed, not the
        // ones the unwound round left in the cache.
        c.set_weight(b, 1).unwrap();
        assert_eq!((c.block_quota(a), c.block_quota(b)), (20, 20));
        c.set_weight(b, 2).unwrap();
        c.set_active(b, true);
        check_still_works(&c, a, b);
    }

    /// A panic inside `register`'s publication: the engine still joins at the next one.
    #[test]
    fn a_panic_while_joining_leaves_the_engine_to_join_next_round() {
        let c = BudgetCoordinator::new(BudgetConfig::new(3, 12, 40)).unwrap();
        let a = c.register(1).unwrap();
        c.set_active(a, true);
        c.recompute();
        let mut c = c;
        c.fail_next_publication(PublishFault::Writing);
        let b = EngineId(1);
        expect_injected_panic(|| c.register(2));
        assert_recovered(&c);
        assert_eq!(
            state(&c, b),
            LIVE,
            "the written-out round lets the engine join"
        );
        c.set_active(b, true);
        check_still_works(&c, a, b);
    }

    /// An engine whose joining round unwound before writing stays `JOINING` until the next
    /// round: registered, so the snapshot lists it (weight, zero figures), and its quota is not
    /// yet a guarantee (`guaranteed_blocks` is `None` until a publication makes it `LIVE`).
    #[test]
    fn a_joining_engine_is_listed_but_not_yet_guaranteed() {
        let c = BudgetCoordinator::new(BudgetConfig::new(3, 12, 40)).unwrap();
        let a = c.register(1).unwrap();
        let mut c = c;
        c.fail_next_publication(PublishFault::Computing);
        expect_injected_panic(|| c.register(3));
        assert_recovered(&c);
        let b = EngineId(1);
        assert_eq!(state(&c, b), JOINING);
        assert!(c.is_registered(b));
        let s = c.snapshot();
        let listed: Vec<_> = s.engines.iter().map(|x| (x.engine, x.weight)).collect();
        assert_eq!(listed, vec![(a, 1), (b, 3)], "a joining engine left out");
        assert_eq!(c.guaranteed_blocks(a), Some(40));
        assert_eq!(
            c.guaranteed_blocks(b),
            None,
            "an unpublished quota read as guaranteed"
        );
        c.recompute();
        assert_eq!(state(&c, b), LIVE);
        assert_eq!(
            (c.guaranteed_blocks(a), c.guaranteed_blocks(b)),
            (Some(10), Some(30))
        );
    }

    /// A departed engine's slot is freed by a publication. When the request for one is left
    /// pending with no publisher running (a round that unwound, as here, or a publisher that
    /// ran out of rounds and left `DIRTY` for the next caller), a full registry's `register`
    /// serves it and reuses the slot rather than refusing with `TooManyEngines` until some
    /// other call happens to recompute.
    #[test]
    fn register_serves_a_pending_departure_before_refusing() {
        let c = BudgetCoordinator::new(BudgetConfig::new(1, 12, 40)).unwrap();
        let a = c.register(1).unwrap();
        let mut c = c;
        c.fail_next_publication(PublishFault::Computing);
        expect_injected_panic(|| c.deregister(a));
        assert_recovered(&c);
        assert_eq!(state(&c, a), LEAVING);
        assert!(!c.is_registered(a));
        let b = c.register(2);
        assert_eq!(b, Ok(a), "the departed engine's slot was not reused");
        assert_eq!(state(&c, a), LIVE);
        assert_eq!(c.guaranteed_blocks(a), Some(40));
    }
}
