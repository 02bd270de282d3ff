//! Wait-free global budget coordinator: weighted token and KV-block shares across the models
//! (engines) that share one device.
//!
//! One [`BudgetCoordinator`] per device, shared by every engine through `Arc`. It answers, with
//! no call ever waiting on another:
//!
//! - **tokens**: how many tokens each engine may schedule per step (its weighted share of
//!   `tokens_per_step`; idle engines' shares lent to the active ones in proportion to their
//!   weights, no engine above the cap), with [`try_acquire_tokens`](BudgetCoordinator::try_acquire_tokens)
//!   / [`release_tokens`](BudgetCoordinator::release_tokens) / [`begin_step`](BudgetCoordinator::begin_step);
//! - **blocks**: each engine's guaranteed share of the block pool ([`block_quota`](BudgetCoordinator::block_quota)),
//!   the limit it may grow to by borrowing what idle engines leave unused
//!   ([`block_limit`](BudgetCoordinator::block_limit)), and, once a lender is active again, which
//!   borrower must give back how many ([`reclaim_orders`](BudgetCoordinator::reclaim_orders));
//! - **preemption**: which engine should give up blocks to a higher-priority request
//!   ([`pick_donor`](BudgetCoordinator::pick_donor)), from figures each engine publishes;
//! - **observability**: [`snapshot`](BudgetCoordinator::snapshot).
//!
//! The coordinator keeps its own per-engine block accounting: the batcher calls
//! `try_acquire_blocks(engine, n)` before `pool.alloc_n(engine, n)`, and `release_blocks` after
//! freeing. It never looks inside the pool.
//!
//! # Algorithms
//!
//! **Hot path: fetch-and-add admission with compensation.** Every budgeted quantity is one
//! counter per engine (`tokens_used`, `blocks_held`) plus, for blocks, one device-wide counter
//! (`blocks_in_use`). An acquire of `n` does `prev = counter.fetch_add(n)` and is granted iff
//! `prev + n ≤ limit`; otherwise it undoes itself with `counter.fetch_sub(n)`. There is no
//! compare-and-swap and no loop, so every call is a fixed number of atomic instructions whatever
//! other threads do (wait-free, population-oblivious):
//!
//! | call | atomic operations |
//! |---|---|
//! | [`token_budget`], [`block_quota`], [`block_limit`], [`reclaim_for`] | 1–2 loads |
//! | [`set_active`] | 1 swap + (if it changed) 1 `fetch_or` |
//! | [`try_acquire_tokens`] | 1 load, 1 `fetch_add`, then 1 `fetch_add` (granted) or 1 `fetch_sub` (undo) |
//! | [`release_tokens`] | 2 `fetch_sub` (+1 `fetch_add` undo on a caller error) |
//! | [`begin_step`] | 1 swap, 1 `fetch_sub` |
//! | [`try_acquire_blocks`] | 1 load, ≤ 2 `fetch_add`, ≤ 2 `fetch_sub` |
//! | [`release_blocks`] | 2 `fetch_sub` (+1 `fetch_add` undo on a caller error) |
//! | [`publish_load`] | 1 store |
//!
//! *Why concurrent acquirers are never granted more than the limit in total.* Every `fetch_add`
//! is eventually matched by exactly one `fetch_sub` of the same amount (its undo, or the
//! holder's release), so at any point of the counter's modification order its value is at least
//! the sum of the grants that are still outstanding and were added before that point (counters
//! are `u64` and each step adds at most `u32::MAX`, so the sum cannot wrap). Take the set `G` of
//! grants outstanding at some instant, and let `g` be the one whose `fetch_add` came last in the
//! counter's modification order: every other member of `G` added before it and has not yet
//! subtracted, so `g`'s `prev ≥ Σ_{G∖g} n`, and `g` was granted because `prev + n_g ≤ limit`;
//! hence `Σ_G n ≤ limit`. An acquirer that fails only ever makes the counter larger while it is
//! in flight, which can make a concurrent acquirer fail too (conservative), never succeed
//! wrongly. The counting argument needs only the atomicity of each read-modify-write, not any
//! ordering with other memory, so the counters use `Relaxed`. A limit changed by a concurrent
//! recomputation is read once per call: the bound holds for the limit each grant saw.
//!
//! **Per-step token reset.** `tokens_used` also carries the in-flight adds of acquirers about to
//! fail, so it cannot simply be zeroed (their later undo would then make room that does not
//! exist). Granted tokens are counted a second time in `tokens_granted` (net of releases);
//! [`begin_step`] swaps that to zero and subtracts exactly what it took from `tokens_used`. A
//! grant racing with the reset lands in one step or the next, never in neither, so the reset
//! can only under-grant.
//!
//! **Recomputation: single publisher by delegation, under a sequence lock.** A control word holds
//! `BUSY | DIRTY`. Anything that changes the inputs (registration, weights, activity) sets
//! `DIRTY`. [`recompute`](BudgetCoordinator::recompute) does one `fetch_or(BUSY | DIRTY)`: if
//! `BUSY` was already set, another thread is publishing and will see `DIRTY`, so this call
//! returns [`Publication::Deferred`] at once (it never waits). Otherwise it is the one
//! publisher: it clears `DIRTY`, reads every engine's weight, activity and held blocks, water-fills
//! (see `waterfill.rs`), writes the results, and gives up `BUSY`; if `DIRTY` was set again
//! meanwhile it runs another round, at most [`MAX_ROUNDS`] in all, leaving `DIRTY` set for the
//! next caller after that. Every step is a fixed amount of work over `max_engines` slots, so
//! recomputation is wait-free too (bounded by `MAX_ROUNDS · max_engines`), only it may defer.
//! Because there is only ever one publisher, every published field has a single writer; the
//! publisher writes lowered budgets before raised ones, so the sum of budgets is never above
//! `tokens_per_step` even between two writes. Around its writes it bumps an epoch (odd while
//! writing), so [`snapshot`](BudgetCoordinator::snapshot) can tell a consistent set of budgets
//! from a torn one; readers never delay the publisher.
//!
//! **Registry.** Engines live in `max_engines` fixed slots. A slot moves
//! `FREE → CLAIMED → JOINING → LIVE → LEAVING → FREE`: `register` claims a free slot with one
//! compare-exchange per slot it tries (never retried: a bounded scan), fills it and marks it
//! `JOINING`; `deregister` marks it `LEAVING`. Only the publisher turns `JOINING` into `LIVE`
//! and `LEAVING` into `FREE` (after zeroing the slot's budgets), so a slot is never reused while
//! a publisher could still write an old engine's figures into it. No memory is ever reclaimed
//! (slots live as long as the coordinator), so there is no ABA or reclamation hazard.
//!
//! # Water-filling
//!
//! Tokens: the active engines share `tokens_per_step` by weight, each capped at
//! `⌊tokens_per_step · cap_permille / 1000⌋`; what a capped engine cannot take flows to the
//! others by weight; the integer remainder goes by largest remainder, ties to the lower engine
//! id. The budgets sum to exactly `tokens_per_step` when `active · cap ≥ tokens_per_step`, and
//! never above it; each is within one token of its exact share. Idle engines get zero.
//!
//! Blocks: every registered engine's **quota** is its water-filled share of `total_blocks`
//! (all registered engines, active or not, with the same per-mille cap), so a lender's share is
//! waiting for it when it becomes active. The blocks neither guaranteed to an active engine nor
//! held by an idle one are **lendable**; they are water-filled over the active engines by weight,
//! each up to the cap, and an active engine's **limit** is its quota plus its part of them. An
//! idle engine's limit is its quota. When a lender becomes active, the next recomputation lowers
//! the borrowers' limits; an engine holding more than its limit must give back the difference
//! ([`reclaim_for`], [`reclaim_orders`]). Limits bound each engine; the device-wide
//! `blocks_in_use` counter bounds their sum by `total_blocks`, so an engine inside its quota can
//! still be refused ([`BudgetError::BlocksExhausted`]) until borrowers give back.
//!
//! [`token_budget`]: BudgetCoordinator::token_budget
//! [`block_quota`]: BudgetCoordinator::block_quota
//! [`block_limit`]: BudgetCoordinator::block_limit
//! [`reclaim_for`]: BudgetCoordinator::reclaim_for
//! [`reclaim_orders`]: BudgetCoordinator::reclaim_orders
//! [`set_active`]: BudgetCoordinator::set_active
//! [`try_acquire_tokens`]: BudgetCoordinator::try_acquire_tokens
//! [`release_tokens`]: BudgetCoordinator::release_tokens
//! [`begin_step`]: BudgetCoordinator::begin_step
//! [`try_acquire_blocks`]: BudgetCoordinator::try_acquire_blocks
//! [`release_blocks`]: BudgetCoordinator::release_blocks
//! [`publish_load`]: BudgetCoordinator::publish_load

mod waterfill;

use crate::block::EngineId;
use crate::error::BudgetError;
use crate::sync::{fence, AtomicBool, AtomicU32, AtomicU64, CachePadded, Ordering};
use waterfill::{water_fill, Claim};

/// The most publishing rounds one [`BudgetCoordinator::recompute`] call runs before it leaves
/// further requests to the next caller.
pub const MAX_ROUNDS: u32 = 3;

/// A request or running work's priority; larger is more important.
pub type Priority = u16;

// Slot states (`Slot::state`).
const FREE: u32 = 0;
const CLAIMED: u32 = 1;
const JOINING: u32 = 2;
const LIVE: u32 = 3;
const LEAVING: u32 = 4;

// Control word bits (`BudgetCoordinator::ctl`).
const BUSY: u32 = 1;
const DIRTY: u32 = 2;

/// `Slot::load` packing: bit 63 set when published, priority in bits 32..48, freeable blocks in
/// the low 32 bits. Zero means "nothing published".
const LOAD_PUBLISHED: u64 = 1 << 63;

/// Construction parameters of a [`BudgetCoordinator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetConfig {
    /// Capacity of the registry (engine ids are `0..max_engines`). At least 1.
    pub max_engines: u16,
    /// The global token budget per step, shared by the active engines.
    pub tokens_per_step: u32,
    /// The blocks of the device's pool, shared by the registered engines.
    pub total_blocks: u32,
    /// No engine's token budget or block limit exceeds this per-mille of the global figure.
    /// `1..=1000`; 1000 means no cap.
    pub cap_permille: u16,
}

impl BudgetConfig {
    /// A configuration without a cap (`cap_permille = 1000`).
    pub fn new(max_engines: u16, tokens_per_step: u32, total_blocks: u32) -> Self {
        Self {
            max_engines,
            tokens_per_step,
            total_blocks,
            cap_permille: 1000,
        }
    }

    /// The same configuration with a cap of `cap_permille` per mille.
    pub fn with_cap_permille(self, cap_permille: u16) -> Self {
        Self {
            cap_permille,
            ..self
        }
    }

    /// The per-engine token cap, in whole tokens.
    pub fn token_cap(&self) -> u32 {
        (u64::from(self.tokens_per_step) * u64::from(self.cap_permille) / 1000) as u32
    }

    /// The per-engine block cap, in whole blocks.
    pub fn block_cap(&self) -> u32 {
        (u64::from(self.total_blocks) * u64::from(self.cap_permille) / 1000) as u32
    }
}

/// The outcome of [`BudgetCoordinator::recompute`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publication {
    /// This call published; the epoch after its last round.
    Published {
        /// The (even) epoch of the last publication.
        epoch: u64,
        /// Rounds run (more than one when inputs changed during a round).
        rounds: u32,
    },
    /// Another thread was publishing; it (or the next `recompute`) will take this request.
    Deferred,
}

/// An engine that should preempt work to give blocks to a higher-priority request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Donor {
    /// The engine to preempt on.
    pub engine: EngineId,
    /// The lowest priority it runs, as it last published.
    pub priority: Priority,
    /// Blocks it said it could free.
    pub freeable_blocks: u32,
    /// Blocks it holds above its quota.
    pub borrowed_blocks: u32,
}

/// A borrower that must give blocks back because a lender needs its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reclaim {
    /// The borrower.
    pub engine: EngineId,
    /// Blocks it holds above its current limit.
    pub blocks: u32,
}

/// One engine's figures in a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineStats {
    /// The engine.
    pub engine: EngineId,
    /// Its share weight.
    pub weight: u32,
    /// Whether it has work (as last set by [`BudgetCoordinator::set_active`]).
    pub active: bool,
    /// Its token budget per step.
    pub token_budget: u32,
    /// Tokens counted against this step's budget (may include an acquire in flight).
    pub tokens_used: u64,
    /// Its guaranteed share of the pool.
    pub block_quota: u32,
    /// What it may hold: quota plus what it may borrow.
    pub block_limit: u32,
    /// Blocks it holds (may include an acquire in flight).
    pub blocks_held: u64,
    /// Blocks held above its quota.
    pub blocks_borrowed: u64,
    /// Blocks held above its limit, which it must give back.
    pub blocks_to_reclaim: u64,
    /// Its published `(lowest running priority, freeable blocks)`, if any.
    pub load: Option<(Priority, u32)>,
}

/// A view of every registered engine, from [`BudgetCoordinator::snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The publication epoch the budgets were read under.
    pub epoch: u64,
    /// Whether every engine's budget, quota and limit come from the same publication (a
    /// snapshot taken while a publisher writes may not be, after a few retries).
    pub consistent: bool,
    /// The global token budget per step.
    pub tokens_per_step: u32,
    /// Blocks in the pool.
    pub total_blocks: u32,
    /// Blocks held by all engines together (may include acquires in flight).
    pub blocks_in_use: u64,
    /// Every registered engine, by id.
    pub engines: Vec<EngineStats>,
}

/// One engine's state. All of it in one padded slot, so engines never share a cache line.
#[derive(Debug)]
struct Slot {
    /// `FREE`, `CLAIMED`, `JOINING`, `LIVE` or `LEAVING`. `FREE → CLAIMED` by `register`'s
    /// compare-exchange only; `CLAIMED → JOINING` by that same caller once the slot is filled;
    /// `LIVE/JOINING → LEAVING` by `deregister`; `JOINING → LIVE` and `LEAVING → FREE` by the
    /// publisher only.
    state: AtomicU32,
    /// Share weight, ≥ 1 while registered. Written by `register`/`set_weight`.
    weight: AtomicU32,
    /// Has work. Written by `set_active`, read by the publisher.
    active: AtomicBool,
    /// Tokens per step. Single writer: the publisher.
    token_budget: AtomicU32,
    /// Tokens granted this step and not released, plus the amounts of acquires in flight.
    /// Granted tokens outstanding ≤ the budget each grant saw (module docs).
    tokens_used: AtomicU64,
    /// Tokens granted this step, net of releases: what `begin_step` subtracts from
    /// `tokens_used`. Never includes an acquire that will fail.
    tokens_granted: AtomicU64,
    /// Guaranteed blocks. Single writer: the publisher.
    block_quota: AtomicU32,
    /// Quota plus borrowable blocks. Single writer: the publisher.
    block_limit: AtomicU32,
    /// Blocks granted and not released, plus acquires in flight. Granted blocks ≤ the limit each
    /// grant saw.
    blocks_held: AtomicU64,
    /// Preemption figures, packed (see `LOAD_PUBLISHED`). Written by the engine, read by
    /// `pick_donor`.
    load: AtomicU64,
}

impl Slot {
    fn new() -> Self {
        Self {
            state: AtomicU32::new(FREE),
            weight: AtomicU32::new(0),
            active: AtomicBool::new(false),
            token_budget: AtomicU32::new(0),
            tokens_used: AtomicU64::new(0),
            tokens_granted: AtomicU64::new(0),
            block_quota: AtomicU32::new(0),
            block_limit: AtomicU32::new(0),
            blocks_held: AtomicU64::new(0),
            load: AtomicU64::new(0),
        }
    }
}

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

/// Scratch space of one publishing round.
#[derive(Debug, Default)]
struct Scratch {
    rows: Vec<Row>,
    claims: Vec<Claim>,
    idx: Vec<usize>,
    out: Vec<u64>,
    order: Vec<u32>,
}

/// The wait-free cross-engine token and block budget coordinator of one device (module docs).
#[derive(Debug)]
pub struct BudgetCoordinator {
    config: BudgetConfig,
    slots: Box<[CachePadded<Slot>]>,
    /// Blocks held by all engines, plus acquires in flight. Granted total ≤ `total_blocks`.
    blocks_in_use: CachePadded<AtomicU64>,
    /// `BUSY` while a publisher runs; `DIRTY` when inputs changed since the last round began.
    ctl: CachePadded<AtomicU32>,
    /// Publication sequence: odd while the publisher writes, even otherwise.
    epoch: CachePadded<AtomicU64>,
}

impl BudgetCoordinator {
    /// A coordinator with no engines registered.
    pub fn new(config: BudgetConfig) -> Result<Self, BudgetError> {
        if config.max_engines == 0 {
            return Err(BudgetError::InvalidConfig("max_engines must be at least 1"));
        }
        if config.cap_permille == 0 || config.cap_permille > 1000 {
            return Err(BudgetError::InvalidConfig(
                "cap_permille must be in 1..=1000",
            ));
        }
        let slots = (0..config.max_engines)
            .map(|_| CachePadded::new(Slot::new()))
            .collect();
        Ok(Self {
            config,
            slots,
            blocks_in_use: CachePadded::new(AtomicU64::new(0)),
            ctl: CachePadded::new(AtomicU32::new(0)),
            epoch: CachePadded::new(AtomicU64::new(0)),
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &BudgetConfig {
        &self.config
    }

    #[inline]
    fn slot(&self, engine: EngineId) -> Result<&Slot, BudgetError> {
        self.slots
            .get(engine.index())
            .map(|s| &**s)
            .ok_or(BudgetError::UnknownEngine {
                engine,
                max_engines: self.config.max_engines,
            })
    }

    /// Marks the inputs changed. `Release`: the change the caller made before (weight,
    /// activity, slot state) is visible to the publisher whose `Acquire` RMW on `ctl` reads this
    /// value or a later one in the RMW chain (`recompute_inner`).
    #[inline]
    fn mark_dirty(&self) {
        self.ctl.fetch_or(DIRTY, Ordering::Release);
    }

    // ---------------------------------------------------------------------------------------
    // Registry
    // ---------------------------------------------------------------------------------------

    /// Registers an engine with share weight `weight` (≥ 1) and returns its id, reusing the
    /// lowest free slot. The engine starts idle; its quotas appear with the publication this
    /// call runs (or, if another thread is publishing, the one after).
    pub fn register(&self, weight: u32) -> Result<EngineId, BudgetError> {
        if weight == 0 {
            return Err(BudgetError::ZeroWeight);
        }
        for (i, slot) in self.slots.iter().enumerate() {
            // One compare-exchange per slot, never retried: a bounded scan. `Acquire` on success
            // pairs with the publisher's `Release` store of `FREE`, so its zeroing of the slot is
            // visible before we fill it.
            if slot.state.load(Ordering::Relaxed) != FREE
                || slot
                    .state
                    .compare_exchange(FREE, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            slot.weight.store(weight, Ordering::Relaxed);
            slot.active.store(false, Ordering::Relaxed);
            slot.tokens_used.store(0, Ordering::Relaxed);
            slot.tokens_granted.store(0, Ordering::Relaxed);
            slot.blocks_held.store(0, Ordering::Relaxed);
            slot.load.store(0, Ordering::Relaxed);
            // `Release`: the publisher that sees JOINING (`Acquire` load) sees the filled slot.
            slot.state.store(JOINING, Ordering::Release);
            self.mark_dirty();
            self.recompute();
            return Ok(EngineId(i as u16));
        }
        Err(BudgetError::TooManyEngines {
            max_engines: self.config.max_engines,
        })
    }

    /// Changes an engine's share weight (≥ 1) and republishes.
    pub fn set_weight(&self, engine: EngineId, weight: u32) -> Result<(), BudgetError> {
        if weight == 0 {
            return Err(BudgetError::ZeroWeight);
        }
        let slot = self.registered(engine)?;
        slot.weight.store(weight, Ordering::Relaxed);
        self.mark_dirty();
        self.recompute();
        Ok(())
    }

    /// Deregisters an engine (its model is unloaded). It must hold no blocks (release them
    /// first), and the caller must not use the id afterwards: the slot is reused by a later
    /// [`register`](Self::register) once the publisher has zeroed it.
    pub fn deregister(&self, engine: EngineId) -> Result<(), BudgetError> {
        let slot = self.registered(engine)?;
        let held = slot.blocks_held.load(Ordering::Relaxed);
        if held != 0 {
            return Err(BudgetError::StillHoldsBlocks { engine, held });
        }
        // Two single-shot attempts in the only order the publisher can move the state
        // (JOINING -> LIVE, never back): a bounded sequence, not a retry loop.
        let left = [JOINING, LIVE].into_iter().any(|from| {
            slot.state
                .compare_exchange(from, LEAVING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        });
        if !left {
            return Err(BudgetError::NotRegistered { engine });
        }
        slot.active.store(false, Ordering::Relaxed);
        self.mark_dirty();
        self.recompute();
        Ok(())
    }

    /// The slot of a registered (`JOINING` or `LIVE`) engine.
    fn registered(&self, engine: EngineId) -> Result<&Slot, BudgetError> {
        let slot = self.slot(engine)?;
        match slot.state.load(Ordering::Acquire) {
            JOINING | LIVE => Ok(slot),
            _ => Err(BudgetError::NotRegistered { engine }),
        }
    }

    /// Whether `engine` is registered (and not deregistered).
    pub fn is_registered(&self, engine: EngineId) -> bool {
        self.registered(engine).is_ok()
    }

    // ---------------------------------------------------------------------------------------
    // Hot path
    // ---------------------------------------------------------------------------------------

    /// Marks an engine active (it has work) or idle; returns the previous value. Wait-free: one
    /// swap, plus one `fetch_or` when the value changed. Budgets follow at the next
    /// [`recompute`](Self::recompute) / [`maybe_recompute`](Self::maybe_recompute). An id out of
    /// range is ignored (returns `false`).
    #[inline]
    pub fn set_active(&self, engine: EngineId, active: bool) -> bool {
        let Ok(slot) = self.slot(engine) else {
            return false;
        };
        // Relaxed: published to the recompute by `mark_dirty`'s Release RMW.
        let was = slot.active.swap(active, Ordering::Relaxed);
        if was != active {
            self.mark_dirty();
        }
        was
    }

    /// Whether the engine is marked active.
    #[inline]
    pub fn is_active(&self, engine: EngineId) -> bool {
        self.slot(engine)
            .is_ok_and(|s| s.active.load(Ordering::Relaxed))
    }

    /// The engine's token budget per step (0 for an unknown or idle engine). One load.
    #[inline]
    pub fn token_budget(&self, engine: EngineId) -> u32 {
        // Relaxed: a plain figure, no data published with it.
        self.slot(engine)
            .map_or(0, |s| s.token_budget.load(Ordering::Relaxed))
    }

    /// Tokens counted against the engine's current step.
    #[inline]
    pub fn tokens_used(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .map_or(0, |s| s.tokens_used.load(Ordering::Relaxed))
    }

    /// Takes `n` tokens of the engine's budget for this step, or nothing. Wait-free: one load
    /// and two read-modify-writes, no retry. Concurrent acquirers on one engine are never granted
    /// more than its budget in total (module docs). `false` for an unknown engine.
    #[inline]
    pub fn try_acquire_tokens(&self, engine: EngineId, n: u32) -> bool {
        let Ok(slot) = self.slot(engine) else {
            return false;
        };
        let n = u64::from(n);
        let budget = u64::from(slot.token_budget.load(Ordering::Relaxed));
        // Relaxed: the grant argument needs only this RMW's atomicity (module docs).
        let prev = slot.tokens_used.fetch_add(n, Ordering::Relaxed);
        if prev + n <= budget {
            // Release: pairs with `begin_step`'s Acquire swap, so a reset that subtracts this
            // grant is ordered after the `fetch_add` above in `tokens_used`.
            slot.tokens_granted.fetch_add(n, Ordering::Release);
            true
        } else {
            slot.tokens_used.fetch_sub(n, Ordering::Relaxed);
            false
        }
    }

    /// Gives back `n` tokens granted in the current step (a sequence dropped from the batch).
    /// Must not race with [`begin_step`](Self::begin_step) on the same engine (both belong to
    /// the engine's step owner). Releasing more than was granted is refused.
    #[inline]
    pub fn release_tokens(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let n = u64::from(n);
        let prev = slot.tokens_granted.fetch_sub(n, Ordering::Relaxed);
        if prev < n {
            slot.tokens_granted.fetch_add(n, Ordering::Relaxed);
            return Err(BudgetError::TokensNotHeld {
                engine,
                released: n,
                granted: prev,
            });
        }
        slot.tokens_used.fetch_sub(n, Ordering::Relaxed);
        Ok(())
    }

    /// Starts a new step for the engine: the tokens granted in the previous one are spent and
    /// no longer count. Returns how many that was. Wait-free: one swap, one `fetch_sub`. Safe
    /// against concurrent acquirers (a grant racing with it counts in this step or the next).
    #[inline]
    pub fn begin_step(&self, engine: EngineId) -> u64 {
        let Ok(slot) = self.slot(engine) else {
            return 0;
        };
        // Acquire: pairs with the Release `fetch_add` of each grant we take, so every grant
        // counted in `granted` has its `tokens_used` add before our subtraction.
        let granted = slot.tokens_granted.swap(0, Ordering::Acquire);
        slot.tokens_used.fetch_sub(granted, Ordering::Relaxed);
        granted
    }

    /// The engine's guaranteed share of the pool. One load.
    #[inline]
    pub fn block_quota(&self, engine: EngineId) -> u32 {
        self.slot(engine)
            .map_or(0, |s| s.block_quota.load(Ordering::Relaxed))
    }

    /// What the engine may hold now: its quota plus what it may borrow. One load.
    #[inline]
    pub fn block_limit(&self, engine: EngineId) -> u32 {
        self.slot(engine)
            .map_or(0, |s| s.block_limit.load(Ordering::Relaxed))
    }

    /// Blocks the engine holds (counting an acquire in flight).
    #[inline]
    pub fn blocks_held(&self, engine: EngineId) -> u64 {
        self.slot(engine)
            .map_or(0, |s| s.blocks_held.load(Ordering::Relaxed))
    }

    /// Blocks held by all engines together.
    #[inline]
    pub fn blocks_in_use(&self) -> u64 {
        self.blocks_in_use.load(Ordering::Relaxed)
    }

    /// Takes `n` blocks against the engine's limit and the device's total, or nothing. Call it
    /// before `pool.alloc_n(engine, n)`, and [`release_blocks`](Self::release_blocks) if the
    /// allocation fails. Wait-free: one load, at most two `fetch_add` and two `fetch_sub`.
    ///
    /// [`BudgetError::OverBlockLimit`]: the engine is at its limit (ask for a donor, or wait);
    /// [`BudgetError::BlocksExhausted`]: the engine is within its limit but the pool is lent out
    /// (see [`reclaim_orders`](Self::reclaim_orders)).
    #[inline]
    pub fn try_acquire_blocks(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let n64 = u64::from(n);
        let limit = slot.block_limit.load(Ordering::Relaxed);
        // Relaxed: counting needs only RMW atomicity (module docs); the pool allocation that
        // follows has its own synchronisation.
        let held = slot.blocks_held.fetch_add(n64, Ordering::Relaxed);
        if held + n64 > u64::from(limit) {
            slot.blocks_held.fetch_sub(n64, Ordering::Relaxed);
            return Err(BudgetError::OverBlockLimit {
                engine,
                requested: n,
                held,
                limit,
            });
        }
        let in_use = self.blocks_in_use.fetch_add(n64, Ordering::Relaxed);
        let total = self.config.total_blocks;
        if in_use + n64 > u64::from(total) {
            self.blocks_in_use.fetch_sub(n64, Ordering::Relaxed);
            slot.blocks_held.fetch_sub(n64, Ordering::Relaxed);
            return Err(BudgetError::BlocksExhausted {
                requested: n,
                in_use,
                total,
            });
        }
        Ok(())
    }

    /// Gives back `n` blocks the engine acquired (after freeing them in the pool). Releasing
    /// more than it holds is refused.
    #[inline]
    pub fn release_blocks(&self, engine: EngineId, n: u32) -> Result<(), BudgetError> {
        let slot = self.slot(engine)?;
        let n64 = u64::from(n);
        let held = slot.blocks_held.fetch_sub(n64, Ordering::Relaxed);
        if held < n64 {
            slot.blocks_held.fetch_add(n64, Ordering::Relaxed);
            return Err(BudgetError::BlocksNotHeld {
                engine,
                released: n,
                held,
            });
        }
        self.blocks_in_use.fetch_sub(n64, Ordering::Relaxed);
        Ok(())
    }

    /// Blocks the engine must give back: what it holds above its current limit. Two loads.
    #[inline]
    pub fn reclaim_for(&self, engine: EngineId) -> u32 {
        self.slot(engine).map_or(0, |s| {
            let held = s.blocks_held.load(Ordering::Relaxed);
            let limit = u64::from(s.block_limit.load(Ordering::Relaxed));
            held.saturating_sub(limit).min(u64::from(u32::MAX)) as u32
        })
    }

    /// Every registered engine holding more than its limit, by id: the borrowers that must give
    /// blocks back to lenders that became active.
    pub fn reclaim_orders(&self) -> Vec<Reclaim> {
        (0..self.slots.len())
            .map(|i| EngineId(i as u16))
            .filter(|&e| self.is_registered(e))
            .filter_map(|engine| {
                let blocks = self.reclaim_for(engine);
                (blocks > 0).then_some(Reclaim { engine, blocks })
            })
            .collect()
    }

    // ---------------------------------------------------------------------------------------
    // Preemption donor
    // ---------------------------------------------------------------------------------------

    /// Publishes the engine's preemption figures: the lowest priority among its running work,
    /// and how many blocks preempting that work would free. One store.
    #[inline]
    pub fn publish_load(
        &self,
        engine: EngineId,
        lowest_running_priority: Priority,
        freeable_blocks: u32,
    ) {
        if let Ok(slot) = self.slot(engine) {
            let word = LOAD_PUBLISHED
                | (u64::from(lowest_running_priority) << 32)
                | u64::from(freeable_blocks);
            // Relaxed: the two figures travel in one word; nothing else is published with them.
            slot.load.store(word, Ordering::Relaxed);
        }
    }

    /// Withdraws the engine's preemption figures (it runs nothing preemptible).
    #[inline]
    pub fn clear_load(&self, engine: EngineId) {
        if let Ok(slot) = self.slot(engine) {
            slot.load.store(0, Ordering::Relaxed);
        }
    }

    /// The engine to preempt so that `requester` can admit a request of `priority` needing
    /// `blocks_needed` blocks: among the other registered engines running strictly
    /// lower-priority work with at least `blocks_needed` (and at least one) freeable blocks, the
    /// lowest priority first, then the largest borrower above its quota, then the lowest id.
    /// `None` when no engine qualifies.
    pub fn pick_donor(
        &self,
        requester: EngineId,
        priority: Priority,
        blocks_needed: u32,
    ) -> Option<Donor> {
        let mut best: Option<Donor> = None;
        for (i, slot) in self.slots.iter().enumerate() {
            let engine = EngineId(i as u16);
            if engine == requester || !matches!(slot.state.load(Ordering::Acquire), JOINING | LIVE)
            {
                continue;
            }
            let Some((p, freeable)) = unpack_load(slot.load.load(Ordering::Relaxed)) else {
                continue;
            };
            if p >= priority || freeable < blocks_needed.max(1) {
                continue;
            }
            let held = slot.blocks_held.load(Ordering::Relaxed);
            let quota = u64::from(slot.block_quota.load(Ordering::Relaxed));
            let borrowed = held.saturating_sub(quota).min(u64::from(u32::MAX)) as u32;
            let better = match best {
                None => true,
                // Ids ascend, so on a full tie the earlier (lower) id stays.
                Some(b) => p < b.priority || (p == b.priority && borrowed > b.borrowed_blocks),
            };
            if better {
                best = Some(Donor {
                    engine,
                    priority: p,
                    freeable_blocks: freeable,
                    borrowed_blocks: borrowed,
                });
            }
        }
        best
    }

    // ---------------------------------------------------------------------------------------
    // Recomputation
    // ---------------------------------------------------------------------------------------

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
    /// (one load). Engines call it once per step.
    #[inline]
    pub fn maybe_recompute(&self) -> Option<Publication> {
        self.is_dirty().then(|| self.recompute())
    }

    /// Recomputes every engine's token budget, block quota and limit from the current weights,
    /// activity and holdings, and publishes them. Never waits: if another thread is publishing
    /// it takes over this request and this call returns [`Publication::Deferred`]. Bounded by
    /// [`MAX_ROUNDS`] rounds of O(max_engines log max_engines) work (module docs).
    pub fn recompute(&self) -> Publication {
        let mut scratch = Scratch::default();
        self.recompute_with(&mut scratch)
    }

    fn recompute_with(&self, scratch: &mut Scratch) -> Publication {
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
            let epoch = self.publish_round(scratch);
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
        let token_cap = u64::from(self.config.token_cap());
        self.fill(
            s,
            u64::from(self.config.tokens_per_step),
            |r| r.active,
            |_| token_cap,
        );
        for k in 0..s.idx.len() {
            s.rows[s.idx[k]].token_budget = s.out[k] as u32;
        }
        // Block quotas: every registered engine, uniform cap.
        let block_cap = u64::from(self.config.block_cap());
        self.fill(
            s,
            u64::from(self.config.total_blocks),
            |_| true,
            |_| block_cap,
        );
        for k in 0..s.idx.len() {
            let r = &mut s.rows[s.idx[k]];
            r.block_quota = s.out[k] as u32;
            r.block_limit = r.block_quota;
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
        let lendable = u64::from(self.config.total_blocks).saturating_sub(reserved);
        if lendable > 0 {
            self.fill(
                s,
                lendable,
                |r| r.active,
                |r| block_cap.saturating_sub(u64::from(r.block_quota)),
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
        total: u64,
        pick: impl Fn(&Row) -> bool,
        cap: impl Fn(&Row) -> u64,
    ) {
        s.idx.clear();
        s.claims.clear();
        for (i, r) in s.rows.iter().enumerate() {
            if r.live && pick(r) {
                s.idx.push(i);
                s.claims.push(Claim {
                    id: i as u16,
                    weight: u64::from(r.weight),
                    cap: cap(r),
                });
            }
        }
        s.out.clear();
        s.out.resize(s.claims.len(), 0);
        water_fill(total, &s.claims, &mut s.out, &mut s.order);
    }

    // ---------------------------------------------------------------------------------------
    // Observability
    // ---------------------------------------------------------------------------------------

    /// Every registered engine's figures. Budgets, quotas and limits are read under the
    /// publication epoch and retried (a bounded number of times) until they come from one
    /// publication; counters are read as they are at that moment.
    pub fn snapshot(&self) -> Snapshot {
        const ATTEMPTS: u32 = 8;
        let mut engines = Vec::with_capacity(self.slots.len());
        let mut attempt = 0;
        loop {
            engines.clear();
            // Acquire: pairs with the publisher's final Release store of the even epoch.
            let before = self.epoch.load(Ordering::Acquire);
            for (i, slot) in self.slots.iter().enumerate() {
                let state = slot.state.load(Ordering::Acquire);
                if state != JOINING && state != LIVE {
                    continue;
                }
                let held = slot.blocks_held.load(Ordering::Relaxed);
                let quota = slot.block_quota.load(Ordering::Relaxed);
                let limit = slot.block_limit.load(Ordering::Relaxed);
                engines.push(EngineStats {
                    engine: EngineId(i as u16),
                    weight: slot.weight.load(Ordering::Relaxed),
                    active: slot.active.load(Ordering::Relaxed),
                    token_budget: slot.token_budget.load(Ordering::Relaxed),
                    tokens_used: slot.tokens_used.load(Ordering::Relaxed),
                    block_quota: quota,
                    block_limit: limit,
                    blocks_held: held,
                    blocks_borrowed: held.saturating_sub(u64::from(quota)),
                    blocks_to_reclaim: held.saturating_sub(u64::from(limit)),
                    load: unpack_load(slot.load.load(Ordering::Relaxed)),
                });
            }
            // Acquire fence: if we read any value written after the publisher's odd store, the
            // re-read below sees an epoch past `before` (pairs with its Release fence).
            fence(Ordering::Acquire);
            let after = self.epoch.load(Ordering::Relaxed);
            attempt += 1;
            let consistent = before == after && before % 2 == 0;
            if consistent || attempt == ATTEMPTS {
                return Snapshot {
                    epoch: after,
                    consistent,
                    tokens_per_step: self.config.tokens_per_step,
                    total_blocks: self.config.total_blocks,
                    blocks_in_use: self.blocks_in_use(),
                    engines,
                };
            }
            crate::sync::hint::spin_loop();
        }
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

#[inline]
fn unpack_load(word: u64) -> Option<(Priority, u32)> {
    (word & LOAD_PUBLISHED != 0).then_some((((word >> 32) & 0xFFFF) as Priority, word as u32))
}
