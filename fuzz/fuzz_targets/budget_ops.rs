//! Fuzz the budget coordinator with arbitrary operation sequences, checking every call and every
//! published figure against the sequential model of tests/budget_model (an independent
//! water-filling by iterative fixpoint), plus the invariants: shares sum to at most the global,
//! each budget within its cap and at least its share (budgets may sum past the global where
//! demand lends tokens), blocks in use within the pool, and the tokens outstanding across all
//! engines within `tokens_per_step` (the device token cap).
#![no_main]

#[path = "../../tests/budget_model/mod.rs"]
mod budget_model;

use arbitrary::Arbitrary;
use budget_model::{kind, Model};
use libfuzzer_sys::fuzz_target;
use pagedkv::block::EngineId;
use pagedkv::budget::{BudgetConfig, BudgetCoordinator};

#[derive(Debug, Arbitrary)]
struct Input {
    max_engines: u8,
    tokens_per_step: u32,
    total_blocks: u16,
    cap_permille: u16,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Register(u32),
    Deregister(u8),
    SetWeight(u8, u32),
    SetActive(u8, bool),
    Recompute,
    MaybeRecompute,
    AcquireTokens(u8, u32),
    ReleaseTokens(u8, u32),
    BeginStep(u8),
    AcquireBlocks(u8, u16),
    ReleaseBlocks(u8, u16),
    PublishLoad(u8, u16, u32),
    ClearLoad(u8),
    PickDonor(u8, u16, u32),
    AcquireTokensUpTo(u8, u32),
    PublishDemand(u8, u32),
    PublishBlockDemand(u8, u32),
}

fuzz_target!(|input: Input| {
    let max_engines = u16::from(input.max_engines % 17);
    let blocks = u32::from(input.total_blocks);
    let config = BudgetConfig::new(max_engines, input.tokens_per_step, blocks)
        .with_cap_permille(input.cap_permille);
    let c = match BudgetCoordinator::new(config) {
        Ok(c) => c,
        Err(_) => {
            assert!(
                max_engines == 0
                    || input.cap_permille == 0
                    || input.cap_permille > 1000
                    || input.tokens_per_step > pagedkv::budget::MAX_TOKENS_PER_STEP
            );
            return;
        }
    };
    let mut m = Model::new(
        max_engines,
        input.tokens_per_step,
        blocks,
        input.cap_permille,
    );
    // Ids up to one past the registry, so out-of-range ids are exercised.
    let id = |e: u8| u16::from(e) % (max_engines + 1);
    for op in input.ops.into_iter().take(256) {
        match op {
            Op::Register(w) => assert_eq!(
                c.register(w).map(|e| e.0).map_err(|e| kind(&e)),
                m.register(w)
            ),
            Op::Deregister(e) => {
                assert_eq!(
                    c.deregister(EngineId(id(e))).map_err(|e| kind(&e)),
                    m.deregister(id(e))
                )
            }
            Op::SetWeight(e, w) => {
                assert_eq!(
                    c.set_weight(EngineId(id(e)), w).map_err(|e| kind(&e)),
                    m.set_weight(id(e), w)
                )
            }
            Op::SetActive(e, a) => {
                assert_eq!(c.set_active(EngineId(id(e)), a), m.set_active(id(e), a))
            }
            Op::Recompute => {
                c.recompute();
                m.recompute();
            }
            Op::MaybeRecompute => {
                if c.maybe_recompute().is_some() {
                    m.recompute();
                }
            }
            Op::AcquireTokens(e, n) => {
                assert_eq!(
                    c.try_acquire_tokens(EngineId(id(e)), n),
                    m.try_acquire_tokens(id(e), n)
                )
            }
            Op::ReleaseTokens(e, n) => assert_eq!(
                c.release_tokens(EngineId(id(e)), n).map_err(|e| kind(&e)),
                m.release_tokens(id(e), n)
            ),
            Op::AcquireTokensUpTo(e, n) => assert_eq!(
                c.acquire_tokens_up_to(EngineId(id(e)), n),
                m.acquire_tokens_up_to(id(e), n)
            ),
            Op::BeginStep(e) => assert_eq!(c.begin_step(EngineId(id(e))), m.begin_step(id(e))),
            Op::AcquireBlocks(e, n) => assert_eq!(
                c.try_acquire_blocks(EngineId(id(e)), u32::from(n))
                    .map_err(|e| kind(&e)),
                m.try_acquire_blocks(id(e), u32::from(n))
            ),
            Op::ReleaseBlocks(e, n) => assert_eq!(
                c.release_blocks(EngineId(id(e)), u32::from(n))
                    .map_err(|e| kind(&e)),
                m.release_blocks(id(e), u32::from(n))
            ),
            Op::PublishLoad(e, p, f) => {
                c.publish_load(EngineId(id(e)), p, f);
                m.publish_load(id(e), p, f);
            }
            Op::ClearLoad(e) => {
                c.clear_load(EngineId(id(e)));
                m.clear_load(id(e));
            }
            Op::PublishDemand(e, n) => {
                c.publish_demand(EngineId(id(e)), n);
                m.publish_demand(id(e), n);
            }
            Op::PublishBlockDemand(e, n) => {
                c.publish_block_demand(EngineId(id(e)), n);
                m.publish_block_demand(id(e), n);
            }
            Op::PickDonor(e, p, n) => {
                let got = c
                    .pick_donor(EngineId(id(e)), p, n)
                    .map(|d| (d.engine.0, d.priority, d.freeable_blocks, d.borrowed_blocks));
                assert_eq!(got, m.pick_donor(id(e), p, n));
            }
        }
        let mut token_sum = 0u64;
        for (i, s) in m.slots.iter().enumerate() {
            let e = EngineId(i as u16);
            assert_eq!(c.is_registered(e), s.registered);
            assert_eq!(c.is_active(e), s.active);
            assert_eq!(c.token_budget(e), s.token_budget);
            assert_eq!(c.token_share(e), s.token_share);
            assert_eq!(c.token_demand(e), s.demand);
            assert_eq!(c.block_demand(e), s.block_demand);
            assert!(s.token_budget >= s.token_share);
            assert_eq!(c.tokens_used(e), s.tokens_used);
            assert_eq!(c.tokens_granted(e), s.tokens_granted);
            assert_eq!(c.block_quota(e), s.block_quota);
            assert_eq!(c.block_limit(e), s.block_limit);
            assert_eq!(c.blocks_held(e), s.blocks_held);
            assert_eq!(c.reclaim_for(e), m.reclaim_for(i as u16));
            assert!(s.token_budget <= config.token_cap());
            assert!(s.block_limit <= config.block_cap().max(s.block_quota));
            token_sum += u64::from(s.token_share);
        }
        assert!(token_sum <= u64::from(input.tokens_per_step));
        assert!(c.blocks_in_use() <= u64::from(blocks));
        // The device's token cap: every engine's outstanding grants together.
        assert_eq!(c.tokens_in_use(), m.tokens_in_use);
        assert!(c.tokens_in_use() <= u64::from(input.tokens_per_step));
        assert_eq!(c.blocks_in_use(), m.in_use);
        let snap = c.snapshot();
        assert!(snap.consistent);
        assert_eq!(
            snap.engines.len(),
            m.slots.iter().filter(|s| s.registered).count()
        );
    }
});
