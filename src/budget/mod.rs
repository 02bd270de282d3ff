//! Global budget coordinator: weighted token and KV-block shares across the models (engines)
//! that share one device, with no lock and no call that blocks on another (progress per call
//! in "Progress" below).
//!
//! One [`BudgetCoordinator`] per device, shared by every engine through `Arc`. It answers:
//!
//! - **tokens**: how many tokens each engine may schedule per step (its weighted share of
//!   `tokens_per_step`; idle engines' shares, and what active engines' published demand
//!   leaves of theirs, lent to the active ones that want more in proportion to their weights,
//!   no engine above the cap), with [`try_acquire_tokens`](BudgetCoordinator::try_acquire_tokens)
//!   / [`release_tokens`](BudgetCoordinator::release_tokens) / [`begin_step`](BudgetCoordinator::begin_step);
//! - **blocks**: each engine's guaranteed share of the block pool ([`block_quota`](BudgetCoordinator::block_quota)),
//!   the limit it may grow to by borrowing what idle engines, and active engines' published
//!   block demand, leave unused ([`block_limit`](BudgetCoordinator::block_limit)), and, once a
//!   lender needs its share again, which borrower must give back how many
//!   ([`reclaim_orders`](BudgetCoordinator::reclaim_orders));
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
//! admission counter per engine (the used field of `Slot::tokens`, `blocks_claimed`) plus one
//! device-wide counter (`tokens_in_use`, `blocks_in_use`). An acquire of `n` does
//! `prev = counter.fetch_add(n)` and is granted iff `prev + n ≤ limit` (checked, so a counter
//! near its top refuses rather than wraps); otherwise it undoes itself with
//! `counter.fetch_sub(n)`. Acquires have no compare-and-swap and no loop: each is a fixed number
//! of atomic instructions whatever other threads do (wait-free, population-oblivious).
//! Releases are checked against the exact holding (the granted field of `Slot::tokens`,
//! `blocks_held`), which no acquire in flight inflates, by a compare-exchange loop: a refused
//! release then changes nothing, not even for an instant (a `fetch_sub` then undo would
//! transiently lower the counter and let a concurrent acquire over-grant). So releases are
//! lock-free, not wait-free.
//!
//! # Progress
//!
//! | call | atomic operations | progress |
//! |---|---|---|
//! | [`token_budget`], [`token_share`], [`block_quota`], [`guaranteed_blocks`], [`block_limit`], [`reclaim_for`] | 1–2 loads | wait-free |
//! | [`set_active`] | 1 swap + (if it changed) 2 stores, 1 `fetch_or` | wait-free |
//! | [`try_acquire_tokens`], [`acquire_tokens_up_to`] | 1 load, ≤ 6 `fetch_add`/`fetch_sub` | wait-free |
//! | [`release_tokens`] | a CAS loop on the engine's token word, then 1 `fetch_sub` | lock-free |
//! | [`begin_step`] | 1 load, 2 `fetch_sub` | wait-free |
//! | [`try_acquire_blocks`] | 1 load, ≤ 3 `fetch_add`, ≤ 2 `fetch_sub` | wait-free |
//! | [`release_blocks`] | a CAS loop on the engine's holding, then 2 `fetch_sub` | lock-free |
//! | [`publish_load`], [`clear_load`] | 1 store | wait-free |
//! | [`publish_demand`], [`publish_block_demand`] | 1 load, ≤ 1 store, ≤ 1 `fetch_or` | wait-free |
//! | [`pick_donor`] | O(max_engines) loads | wait-free |
//! | [`reclaim_orders`] | O(max_engines) loads, allocates its result | bounded steps, but allocates |
//! | [`snapshot`], [`block_quotas`] | ≤ 8 passes of O(max_engines) loads, allocates its result | bounded steps, but allocates |
//! | [`recompute`] (and [`maybe_recompute`] once it finds a change, [`register`], [`set_weight`], [`deregister`]) | ≤ [`MAX_ROUNDS`] rounds (a [`register`] that finds no free slot while one is leaving: two recomputes) | bounded steps; may delegate |
//!
//! A release's loop retries only when its compare-exchange failed because another operation on
//! the same word succeeded (an acquire, a release or a step reset of that engine), so some call
//! always completes, or because the weak compare-exchange failed spuriously (an interrupted
//! load-linked/store-conditional pair, which does not recur forever); `Backoff` spaces the
//! retries. No call waits for another thread to do something: a thread stalled anywhere delays
//! no other call's return. The one thing a stalled
//! thread can delay is a *publication*: while a publisher holds `BUSY`, a `recompute` elsewhere
//! returns [`Publication::Deferred`] at once and the new budgets appear only when that publisher
//! runs on (or unwinds: a panicking round gives `BUSY` back through a drop guard).
//!
//! *Why concurrent acquirers are never granted more than the limit in total.* Every `fetch_add`
//! is eventually matched by exactly one `fetch_sub` of the same amount (its undo, or the
//! holder's release), so at any point of the counter's modification order its value is at least
//! the sum of the grants that are still outstanding and were added before that point (the
//! counters cannot wrap: block counters are `u64` with adds of at most `u32::MAX`, and the token
//! field's bound is argued at `Slot::tokens`). Take the set `G` of
//! grants outstanding at some instant, and let `g` be the one whose `fetch_add` came last in the
//! counter's modification order: every other member of `G` added before it and has not yet
//! subtracted, so `g`'s `prev ≥ Σ_{G∖g} n`, and `g` was granted because `prev + n_g ≤ limit`;
//! hence `Σ_G n ≤ limit`. An acquirer that fails only ever makes the counter larger while it is
//! in flight, which can make a concurrent acquirer fail too (conservative), never succeed
//! wrongly. On one counter the argument needs only the atomicity of each read-modify-write, so
//! the admission RMWs are `Relaxed`. A release subtracts from the device-wide counter (and for
//! blocks the engine's admission counter) after its compare-exchange on the exact holding; for
//! that subtraction to come after the grant's addition in the second counter's modification
//! order, the grant's final add to the holding is `Release` and the release's compare-exchange
//! (or `begin_step`'s load) `Acquire`. A limit changed by a concurrent recomputation is read
//! once per call: the bound holds for the limit each grant saw.
//!
//! **Global token cap.** Each engine's budget bounds its own grants, but budgets change: after a
//! recomputation lowers engine A and raises B, A's tokens granted under the old budget plus B's
//! new grant could sum past `tokens_per_step`. So every token grant is also admitted against
//! the device-wide `tokens_in_use` counter (the same fetch-and-add admission, limit
//! `tokens_per_step`), and stays counted there until it is released or its engine's
//! [`begin_step`] takes it out. What is bounded, at every instant: the tokens granted to all
//! engines in their current steps and not yet released total at most `tokens_per_step`,
//! whatever recomputations happen meanwhile. Engines' steps are not synchronised, so this is a
//! bound on tokens held at once, not on a device-wide step; the scheduler link
//! ([`EngineShare`](crate::sched::EngineShare)) holds a step's tokens from the start of its
//! schedule until the start of the next, so the tokens of steps that may run at once are what
//! it bounds.
//!
//! **Per-step token reset.** The used-token counter also carries the in-flight adds of
//! acquirers about to fail, so it cannot simply be zeroed (their later undo would then make
//! room that does not exist). Granted tokens are counted a second time in a *granted* field of
//! the same word (net of releases); [`begin_step`] reads it and subtracts that amount from both
//! fields in one `fetch_sub`. A grant racing with the reset lands in one step or the next, never
//! in neither, so the reset can only under-grant. Keeping both fields in one word makes a reset
//! one `fetch_sub` and a release one successful compare-exchange, and orders every token
//! operation on an engine by coherence alone.
//!
//! **Recomputation: single publisher by delegation, under a sequence lock.** A control word holds
//! `BUSY | DIRTY`. Anything that changes the inputs (registration, weights, activity) sets
//! `DIRTY`. [`recompute`](BudgetCoordinator::recompute) does one `fetch_or(BUSY | DIRTY)`: if
//! `BUSY` was already set, another thread is publishing and will see `DIRTY`, so this call
//! returns [`Publication::Deferred`] at once (it never waits). Otherwise it is the one
//! publisher: it clears `DIRTY`, reads every engine's weight, activity and held blocks, water-fills
//! (see `waterfill.rs`), writes the results, and gives up `BUSY`; if `DIRTY` was set again
//! meanwhile it runs another round, at most [`MAX_ROUNDS`] in all, leaving `DIRTY` set for the
//! next caller after that. A round is O(max_engines log max_engines) at worst (usually
//! O(max_engines): see `waterfill.rs`), so a `recompute` call returns within `MAX_ROUNDS`
//! rounds, and never waits; the publication it asks for may be left to another publisher. Its working space lives in the coordinator and is
//! touched only by the `BUSY` holder (an `UnsafeCell`, which the loom models check: letting two
//! publishers in fails them). Because there is only ever one publisher, every published
//! field has a single writer; the
//! publisher writes lowered budgets before raised ones (in its program order: a reader loading
//! budgets one by one, Relaxed, may still pair a raised one with another not yet seen lowered,
//! so what enforces the device's cap is the acquire path's count of tokens in use, never a
//! sum of budgets). Around its writes it bumps an epoch (odd while
//! writing), so [`snapshot`](BudgetCoordinator::snapshot) can tell a consistent set of budgets
//! from a torn one; readers never delay the publisher.
//!
//! **Registry.** Engines live in `max_engines` fixed slots. A slot moves
//! `FREE → CLAIMED → JOINING → LIVE → LEAVING → FREE`: `register` claims a free slot with one
//! compare-exchange per slot it tries (never retried: a bounded scan; when none is free but one
//! is `LEAVING`, it recomputes first, in case that slot's freeing was left pending, and scans
//! once more), fills it and marks it `JOINING`; `deregister` marks it `LEAVING`. Only the
//! publisher turns `JOINING` into `LIVE` and `LEAVING` into `FREE` (after zeroing the slot's
//! budgets), so a slot is never reused while a publisher could still write an old engine's
//! figures into it. No memory is ever reclaimed (slots live as long as the coordinator), so
//! there is no ABA or reclamation hazard.
//!
//! # Water-filling
//!
//! Tokens: the active engines' **shares** of `tokens_per_step` are by weight, each capped at
//! `⌊tokens_per_step · cap_permille / 1000⌋`; what a capped engine cannot take flows to the
//! others by weight; the integer remainder goes by largest remainder, ties to the lower engine
//! id. The shares sum to exactly `tokens_per_step` when `active · cap ≥ tokens_per_step`, and
//! never above it; each is within one token of its exact share. Idle engines get zero. Then,
//! when the device has a token for every active engine (`tokens_per_step ≥ active` and a cap
//! of at least one token), an active engine whose share rounded to 0 takes one token from the
//! engine then holding the most (ties to the lower id): otherwise a share below one token
//! (weights 1000:1:1 over 512 tokens: 510.98, 0.51, 0.51, rounded to 511, 1, 0) stays 0 for as
//! long as the others have work, and the engine's requests never run, however little the
//! others use. Only those donors can end up more than one token below their exact shares.
//!
//! **Token lending.** An active engine that uses less than its share (a model decoding a few
//! sequences beside one working through long prompts) would leave the rest of the device's
//! tokens unused every step. Each engine publishes its **demand**: what its last step scheduled,
//! or, when its token grant left work out, its whole `max_batched_tokens` ([`publish_demand`]; the
//! scheduler's link does it each step). The publisher runs the same water-fill again with every
//! active engine also capped by its demand, so what a low demand leaves goes to the engines that
//! want more, by weight, and then raises every engine that fill left below its share (or its
//! demand, where lower) to it, taking from those it gave the most above theirs: a share lifted from
//! 0, or rounded a token higher than the second fill rounds it, is not lent away too. An engine's
//! **budget** is the larger of its share and that figure (with no demand published by an active
//! engine, the budgets are the shares). So a lender's budget stays its share (its demand can rise
//! at any step), and the budgets may sum past `tokens_per_step`: the device-wide `tokens_in_use`
//! admission keeps the grants within it (above), and the borrowers' figures fit beside the lenders'
//! demands and the other engines' shares. When a lender's demand rises past what the borrowers
//! leave, its step gets what the device has left: at least its published demand (while the
//! borrowers hold no more than the publication gave them), and its whole share once the borrowers
//! hold no more than theirs. A borrower's step in flight keeps what it was granted (tokens cannot
//! be taken back inside a step); the scheduler's link ([`EngineShare`](crate::sched::EngineShare))
//! gives back what a step holds above the engine's share as soon as its batch has run, and the next
//! publication lowers the borrowers' budgets. Demand is published in multiples of
//! [`BudgetConfig::demand_quantum`], rounded up, so a lender keeps up to that much headroom and a
//! demand wavering by a few tokens does not ask for a publication every step. An engine whose
//! activity changes counts as wanting its whole share until it publishes again.
//!
//! Blocks: every registered engine's **quota** is its water-filled share of `total_blocks`
//! (all registered engines, active or not, with the same per-mille cap), so a lender's share is
//! waiting for it when it becomes active. An active engine **reserves** its quota, an idle one
//! what it holds; the blocks no engine reserves are **lendable**, and an active engine's
//! **limit** is its quota plus its part of them. An idle engine's limit is its quota. When a
//! lender's reservation grows, the next recomputation lowers the borrowers' limits; an engine
//! holding more than its limit must give back the difference ([`reclaim_for`],
//! [`reclaim_orders`]). Limits bound each engine; the device-wide `blocks_in_use` counter
//! bounds their sum by `total_blocks`, so an engine inside its quota can still be refused
//! ([`BudgetError::BlocksExhausted`]) until borrowers give back.
//!
//! **Block lending.** An active engine running a few short sequences would otherwise reserve
//! its whole quota while another engine preempts for pages. Each engine publishes its **block
//! demand**: what it holds plus what its work (running, swapped out, and waiting where a
//! running slot is free, each for its next 128 tokens) will take ([`publish_block_demand`];
//! the scheduler's link does it each step). An active engine with a demand below its quota
//! reserves only that demand (at least what it holds). The lendable blocks go first to the
//! active engines whose demand is above their quota, by weight, each up to its demand and the
//! cap, then what they leave to every active engine by weight, up to the cap. A lender's limit
//! never drops below its quota (what the others leave may raise it): when its demand rises it
//! takes the pool's free blocks at once, and the rest once the borrowers give back what the
//! next publication takes from their limits (the same reclaim as a lender becoming active).
//! Meanwhile its rows short of pages it lent wait for them (up to four steps in a row) rather
//! than preempt a sequence of their own class; a latency-critical row still preempts
//! throughput work at once. Demand is published in multiples of
//! [`BudgetConfig::block_demand_quantum`], rounded up, so a lender keeps up to that much
//! headroom and a demand moving by a few pages does not republish every step. An engine whose
//! activity changes reserves its whole quota until it publishes again.
//!
//! Only the quota is guaranteed: what an engine borrows lasts while the lenders stay idle or
//! light. So one sequence needing more than its engine's quota could finish only while others
//! leave pages unused, and would otherwise be preempted again and again; the scheduler refuses
//! such a request, and ends a queued one whose engine's quota shrank below its need (another
//! engine registered, or weights changed), rather than let it spin ([`guaranteed_blocks`],
//! [`EngineShare`](crate::sched::EngineShare)).
//!
//! [`token_budget`]: BudgetCoordinator::token_budget
//! [`token_share`]: BudgetCoordinator::token_share
//! [`block_quota`]: BudgetCoordinator::block_quota
//! [`block_limit`]: BudgetCoordinator::block_limit
//! [`guaranteed_blocks`]: BudgetCoordinator::guaranteed_blocks
//! [`reclaim_for`]: BudgetCoordinator::reclaim_for
//! [`reclaim_orders`]: BudgetCoordinator::reclaim_orders
//! [`set_active`]: BudgetCoordinator::set_active
//! [`try_acquire_tokens`]: BudgetCoordinator::try_acquire_tokens
//! [`release_tokens`]: BudgetCoordinator::release_tokens
//! [`begin_step`]: BudgetCoordinator::begin_step
//! [`try_acquire_blocks`]: BudgetCoordinator::try_acquire_blocks
//! [`release_blocks`]: BudgetCoordinator::release_blocks
//! [`publish_load`]: BudgetCoordinator::publish_load
//! [`clear_load`]: BudgetCoordinator::clear_load
//! [`acquire_tokens_up_to`]: BudgetCoordinator::acquire_tokens_up_to
//! [`publish_demand`]: BudgetCoordinator::publish_demand
//! [`publish_block_demand`]: BudgetCoordinator::publish_block_demand
//! [`pick_donor`]: BudgetCoordinator::pick_donor
//! [`snapshot`]: BudgetCoordinator::snapshot
//! [`block_quotas`]: BudgetCoordinator::block_quotas
//! [`recompute`]: BudgetCoordinator::recompute
//! [`maybe_recompute`]: BudgetCoordinator::maybe_recompute
//! [`register`]: BudgetCoordinator::register
//! [`set_weight`]: BudgetCoordinator::set_weight
//! [`deregister`]: BudgetCoordinator::deregister

mod hot;
mod publish;
mod registry;
mod snapshot;
mod waterfill;

use crate::error::BudgetError;
use crate::ids::EngineId;
use crate::sync::{AtomicBool, AtomicU32, AtomicU64, CachePadded, Ordering, UnsafeCell};
#[cfg(any(test, loom))]
#[doc(hidden)]
pub use publish::PublishFault;
use publish::Scratch;
use std::fmt;

/// The most publishing rounds one [`BudgetCoordinator::recompute`] call runs before it leaves
/// further requests to the next caller.
#[cfg(not(loom))]
pub const MAX_ROUNDS: u32 = 3;
/// Two under loom: a publisher reaches its last round with a change still marked only if it
/// was preempted in every round, which at the models' preemption bound of 2 is out of reach
/// with three rounds (tests/loom/budget.rs,
/// `a_publisher_out_of_rounds_leaves_the_request_marked`).
#[cfg(loom)]
pub const MAX_ROUNDS: u32 = 2;

/// The largest `tokens_per_step` (2^24 − 1): the granted-token field of a slot is 24 bits wide.
pub const MAX_TOKENS_PER_STEP: u32 = (1 << 24) - 1;

/// Bits of the used-token field (`Slot::tokens`).
const USED_BITS: u32 = 40;
const USED_MASK: u64 = (1 << USED_BITS) - 1;

/// The rank of a priority class in the coordinator's donor choice; larger is more important.
/// The scheduler's classes map onto it with [`Priority::rank`](crate::sched::Priority::rank);
/// the coordinator, a floor below the scheduler, only compares ranks.
pub type Rank = u16;

// Slot states (`Slot::state`).
const FREE: u32 = 0;
const CLAIMED: u32 = 1;
const JOINING: u32 = 2;
const LIVE: u32 = 3;
const LEAVING: u32 = 4;

// Control word bits (`BudgetCoordinator::ctl`).
const BUSY: u32 = 1;
const DIRTY: u32 = 2;

/// `Slot::demand` when the engine published no demand below its share's cap: it takes part in
/// the token water-fill with the uniform cap. `Slot::block_demand` when it published no block
/// demand: it reserves its whole quota, and borrows up to the cap.
const NO_DEMAND: u32 = u32::MAX;

/// Demand is published in multiples of `tokens_per_step / DEMAND_STEPS` (rounded up), so that
/// an engine whose use wavers by a few tokens from step to step does not ask for a
/// republication each step, and keeps up to that much headroom above its last use.
const DEMAND_STEPS: u32 = 32;

/// Block demand is published in multiples of `total_blocks / BLOCK_DEMAND_STEPS` (rounded up):
/// a lender keeps that much headroom above what it said it needs, and a demand moving by a few
/// pages (sequences growing, finishing) does not ask for a republication each step.
const BLOCK_DEMAND_STEPS: u32 = 64;

/// `Slot::load` packing: bit 63 set when published, priority in bits 32..48, freeable blocks in
/// the low 32 bits. Zero means "nothing published".
const LOAD_PUBLISHED: u64 = 1 << 63;

/// Construction parameters of a [`BudgetCoordinator`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetConfig {
    /// Capacity of the registry (engine ids are `0..max_engines`). At least 1.
    pub max_engines: u16,
    /// The global token budget per step, shared by the active engines. At most
    /// [`MAX_TOKENS_PER_STEP`].
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

    /// The unit demand is published in ([`BudgetCoordinator::publish_demand`]):
    /// `⌈tokens_per_step / 32⌉`, at least 1.
    pub fn demand_quantum(&self) -> u32 {
        self.tokens_per_step.div_ceil(DEMAND_STEPS).max(1)
    }

    /// The unit block demand is published in ([`BudgetCoordinator::publish_block_demand`]):
    /// `⌈total_blocks / 64⌉`, at least 1.
    pub fn block_demand_quantum(&self) -> u32 {
        self.total_blocks.div_ceil(BLOCK_DEMAND_STEPS).max(1)
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
    pub priority: Rank,
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
    /// What it may take per step: its share, or more where other active engines' published
    /// demand leaves part of theirs unused.
    pub token_budget: u32,
    /// Its weighted share of `tokens_per_step` among the active engines: its budget is never
    /// below this.
    pub token_share: u32,
    /// Its published demand per step (rounded up to the demand quantum), or `None`: none
    /// published since it last became active, so it counts as wanting its whole share.
    pub token_demand: Option<u32>,
    /// Tokens counted against this step's budget (may include an acquire in flight).
    pub tokens_used: u64,
    /// Its guaranteed share of the pool.
    pub block_quota: u32,
    /// The blocks it said it needs (rounded up to the block demand quantum), or `None`: none
    /// published since it last became active, so it reserves its whole quota.
    pub block_demand: Option<u32>,
    /// What it may hold: quota plus what it may borrow.
    pub block_limit: u32,
    /// Blocks it holds: granted and not released.
    pub blocks_held: u64,
    /// Blocks held above its quota.
    pub blocks_borrowed: u64,
    /// Blocks held above its limit, which it must give back.
    pub blocks_to_reclaim: u64,
    /// Its published `(lowest running priority, freeable blocks)`, if any.
    pub load: Option<(Rank, u32)>,
}

impl EngineStats {
    /// The blocks a publication from these figures keeps out of the lendable pool for this
    /// engine: an active one its quota, or its block demand where lower (at least what it
    /// holds); an idle one what it holds (module docs, "Block lending"). Beside every engine's
    /// loan (`block_limit - block_quota`), these sum to at most `total_blocks` just after a
    /// publication.
    pub fn blocks_reserved(&self) -> u64 {
        let demand = self.block_demand.unwrap_or(NO_DEMAND);
        blocks_reserved(self.active, self.block_quota, demand, self.blocks_held)
    }
}

/// What an engine reserves of the pool in a publication (module docs, "Block lending"): an
/// active one its quota, or its block demand (`NO_DEMAND`: none) where lower, at least what it
/// holds; an idle one what it holds. The publisher and [`EngineStats::blocks_reserved`] share it.
fn blocks_reserved(active: bool, quota: u32, demand: u32, held: u64) -> u64 {
    let quota = u64::from(quota);
    match (active, demand) {
        (false, _) => held,
        (true, NO_DEMAND) => quota,
        (true, d) => quota.min(held.max(u64::from(d))),
    }
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
    /// Tokens counted against `tokens_per_step` by all engines' current steps (may include
    /// acquires in flight).
    pub tokens_in_use: u64,
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
    /// Tokens it may take per step: its share, or more where other active engines' published
    /// demand leaves part of theirs unused. Single writer: the publisher.
    token_budget: AtomicU32,
    /// Its weighted share of `tokens_per_step` among the active engines, what the lending
    /// never lowers its budget below. Single writer: the publisher.
    token_share: AtomicU32,
    /// The tokens it said it would use per step ([`BudgetCoordinator::publish_demand`],
    /// rounded up to a multiple of the demand quantum), or `NO_DEMAND` (it may use its whole
    /// share: never published, or reset when its activity changed). Written by the engine, read
    /// by the publisher.
    demand: AtomicU32,
    /// Token accounting of the current step, two fields in one word so that a reset is one
    /// `fetch_sub`, a release one successful compare-exchange, and every token operation on
    /// the engine is ordered by coherence alone:
    ///
    /// ```text
    ///   63            40 39                                   0
    ///  +----------------+--------------------------------------+
    ///  | granted (24)   | used (40)                            |
    ///  +----------------+--------------------------------------+
    /// ```
    ///
    /// *used*: tokens granted this step and not released, plus the amounts of acquires in
    /// flight; the admission counter (granted outstanding ≤ the budget each grant saw).
    /// *granted*: tokens granted this step net of releases, what `begin_step` takes away;
    /// it never includes an acquire that will fail, and used ≥ granted at all times.
    /// Budgets are below 2^24 (`MAX_TOKENS_PER_STEP`) and an acquire larger than the budget
    /// is refused before it adds, so used < 2^24 · (1 + acquires in flight): overflowing 40
    /// bits would take 65,535 threads acquiring on one engine at once.
    tokens: AtomicU64,
    /// Guaranteed blocks. Single writer: the publisher.
    block_quota: AtomicU32,
    /// The blocks it said it needs ([`BudgetCoordinator::publish_block_demand`], rounded up to
    /// a multiple of the block demand quantum), or `NO_DEMAND` (it reserves its whole quota:
    /// never published, or reset when its activity changed). Written by the engine, read by
    /// the publisher.
    block_demand: AtomicU32,
    /// Quota plus borrowable blocks. Single writer: the publisher.
    block_limit: AtomicU32,
    /// The block admission counter: blocks granted and not released, plus the amounts of
    /// acquires in flight. Granted blocks ≤ the limit each grant saw. Always ≥ `blocks_held`:
    /// an acquire adds here before it adds there, a release subtracts there before here.
    blocks_claimed: AtomicU64,
    /// Blocks granted and not released, exactly (no acquire in flight): what a release is
    /// checked against, by a compare-exchange, so a refused release never touches a counter.
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
            token_share: AtomicU32::new(0),
            demand: AtomicU32::new(NO_DEMAND),
            tokens: AtomicU64::new(0),
            block_quota: AtomicU32::new(0),
            block_demand: AtomicU32::new(NO_DEMAND),
            block_limit: AtomicU32::new(0),
            blocks_claimed: AtomicU64::new(0),
            blocks_held: AtomicU64::new(0),
            load: AtomicU64::new(0),
        }
    }
}

/// The cross-engine token and block budget coordinator of one device: acquires and reads are
/// wait-free, releases lock-free (module docs, "Progress").
pub struct BudgetCoordinator {
    config: BudgetConfig,
    slots: Box<[CachePadded<Slot>]>,
    /// Blocks held by all engines, plus acquires in flight. Granted total ≤ `total_blocks`.
    blocks_in_use: CachePadded<AtomicU64>,
    /// Tokens granted to all engines in their current steps and not released, plus acquires in
    /// flight: the device-wide admission counter. Granted total ≤ `tokens_per_step`.
    tokens_in_use: CachePadded<AtomicU64>,
    /// `BUSY` while a publisher runs; `DIRTY` when inputs changed since the last round began.
    ctl: CachePadded<AtomicU32>,
    /// Publication sequence: odd while the publisher writes, even otherwise.
    epoch: CachePadded<AtomicU64>,
    /// The publisher's working space; accessed only by the thread holding `BUSY`.
    scratch: UnsafeCell<Scratch>,
}

// SAFETY: every field but `scratch` is `Sync` (atomics, and a boxed slice of them). `scratch` is
// read and written only inside `recompute` by the thread that holds the `BUSY` bit of `ctl`:
// `BUSY` is taken by a `fetch_or` that saw it clear and given back by a `fetch_and`, both
// `AcqRel` on one atomic, so at most one thread holds it at a time and each holder's accesses
// happen-before the next holder's. Sharing `&BudgetCoordinator` across threads therefore never
// gives two threads access to `scratch` at once. (`Send` is automatic: `Scratch` is plain data.)
unsafe impl Sync for BudgetCoordinator {}

impl fmt::Debug for BudgetCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BudgetCoordinator")
            .field("config", &self.config)
            .field("epoch", &self.epoch.load(Ordering::Relaxed))
            .field("ctl", &self.ctl.load(Ordering::Relaxed))
            .field("blocks_in_use", &self.blocks_in_use.load(Ordering::Relaxed))
            .field("tokens_in_use", &self.tokens_in_use.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl BudgetCoordinator {
    /// A coordinator with no engines registered.
    pub fn new(config: BudgetConfig) -> Result<Self, BudgetError> {
        if config.max_engines == 0 {
            return Err(BudgetError::InvalidConfig("max_engines must be at least 1"));
        }
        if config.tokens_per_step > MAX_TOKENS_PER_STEP {
            return Err(BudgetError::InvalidConfig(
                "tokens_per_step must be below 2^24 (MAX_TOKENS_PER_STEP)",
            ));
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
            tokens_in_use: CachePadded::new(AtomicU64::new(0)),
            ctl: CachePadded::new(AtomicU32::new(0)),
            epoch: CachePadded::new(AtomicU64::new(0)),
            scratch: UnsafeCell::new(Scratch::default()),
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
    /// value or a later one in the RMW chain ([`recompute`](Self::recompute)).
    #[inline]
    fn mark_dirty(&self) {
        self.ctl.fetch_or(DIRTY, Ordering::Release);
    }
}

/// Unpacks `Slot::load`.
#[inline]
fn unpack_load(word: u64) -> Option<(Rank, u32)> {
    (word & LOAD_PUBLISHED != 0).then_some((((word >> 32) & 0xFFFF) as Rank, word as u32))
}
