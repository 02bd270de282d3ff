//! Property tests: the published budgets are the exact weighted water-filling (checked against an
//! independent model, and against the definition), and random operation sequences match the
//! sequential model call for call.

mod budget_model;

use budget_model::{kind, lift_zeros, water_fill, Model};
use pagedkv::block::EngineId;
use pagedkv::budget::{BudgetConfig, BudgetCoordinator, MAX_TOKENS_PER_STEP};
use proptest::prelude::*;

/// Checks that `shares` is the exact water-filling of `total` over `claims`: it sums to
/// `min(total, Σ caps)`, no share exceeds its cap, and every claim below its cap has the same
/// share per unit of weight λ, with capped claims at `cap ≤ λ·w`.
fn assert_is_water_filling(total: u64, claims: &[(u64, u64)], shares: &[(u128, u128)]) {
    let caps: u128 = claims
        .iter()
        .filter(|c| c.0 > 0)
        .map(|c| u128::from(c.1))
        .sum();
    // Σ num/den == min(total, caps): compare over a common denominator (all uncapped share one).
    let mut whole: u128 = 0;
    let mut frac: (u128, u128) = (0, 1);
    for (&(w, cap), &(num, den)) in claims.iter().zip(shares) {
        if w == 0 {
            assert_eq!(num, 0);
            continue;
        }
        assert!(num <= u128::from(cap) * den, "share above cap");
        if den == 1 {
            whole += num;
        } else {
            assert!(frac.1 == 1 || frac.1 == den);
            frac = (frac.0 + num, den);
        }
    }
    assert_eq!(
        whole * frac.1 + frac.0,
        u128::from(total).min(caps) * frac.1
    );
    // Equal level among uncapped claims; capped ones at or below it.
    let level = claims
        .iter()
        .zip(shares)
        .find(|(c, s)| c.0 > 0 && s.0 < u128::from(c.1) * s.1);
    if let Some((&(w0, _), &(n0, d0))) = level {
        for (&(w, cap), &(num, den)) in claims.iter().zip(shares) {
            if w == 0 {
                continue;
            }
            if num < u128::from(cap) * den {
                // num/(den·w) == n0/(d0·w0)
                assert_eq!(num * d0 * u128::from(w0), n0 * den * u128::from(w));
            } else {
                // cap/w <= n0/(d0·w0)
                assert!(u128::from(cap) * d0 * u128::from(w0) <= n0 * u128::from(w));
            }
        }
    }
}

fn engines_strategy() -> impl Strategy<Value = Vec<(u32, bool)>> {
    prop::collection::vec(
        (
            prop_oneof![1u32..=10, 1u32..=1000, 1u32..=u32::MAX],
            any::<bool>(),
        ),
        1..=24,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn budgets_are_the_water_filling(
        engines in engines_strategy(),
        tokens in prop_oneof![0u32..64, 0u32..100_000, Just(MAX_TOKENS_PER_STEP)],
        blocks in prop_oneof![0u32..64, 0u32..100_000],
        cap in prop_oneof![1u16..=1000, Just(1000u16)],
    ) {
        let config = BudgetConfig::new(32, tokens, blocks).with_cap_permille(cap);
        let c = BudgetCoordinator::new(config).unwrap();
        let ids: Vec<EngineId> = engines.iter().map(|&(w, a)| {
            let e = c.register(w).unwrap();
            c.set_active(e, a);
            e
        }).collect();
        c.recompute();

        let token_cap = u64::from(config.token_cap());
        let claims: Vec<(u64, u64)> =
            engines.iter().map(|&(w, a)| (if a { u64::from(w) } else { 0 }, token_cap)).collect();
        let (exact, mut want) = water_fill(u64::from(tokens), &claims);
        assert_is_water_filling(u64::from(tokens), &claims, &exact.shares);
        let rounded = want.clone();
        lift_zeros(&mut want, &claims);
        let lifted = want != rounded;

        let got: Vec<u64> = ids.iter().map(|&e| u64::from(c.token_budget(e))).collect();
        prop_assert_eq!(&got, &want);
        let active = engines.iter().filter(|e| e.1).count() as u64;
        let sum: u64 = got.iter().sum();
        if active * token_cap >= u64::from(tokens) {
            prop_assert_eq!(sum, u64::from(tokens));
        } else {
            prop_assert_eq!(sum, active * token_cap);
        }
        for (i, &g) in got.iter().enumerate() {
            prop_assert!(g <= token_cap);
            if !engines[i].1 {
                prop_assert_eq!(g, 0);
            }
            // Within one token of the exact share: |g·den − num| < den, unless the floor of one
            // token per active engine moved tokens (then only the donors may be further off).
            let (num, den) = exact.shares[i];
            if !lifted || rounded[i] == 0 {
                prop_assert!((u128::from(g) * den).abs_diff(num) < den);
            } else {
                prop_assert!(u128::from(g) * den < num + den);
            }
            if engines[i].1 && u64::from(tokens) >= active && token_cap > 0 {
                prop_assert!(g >= 1, "an active engine got no token");
            }
        }

        // Blocks: quotas water-fill the pool over every registered engine.
        let block_cap = u64::from(config.block_cap());
        let claims: Vec<(u64, u64)> = engines.iter().map(|&(w, _)| (u64::from(w), block_cap)).collect();
        let (exact, want) = water_fill(u64::from(blocks), &claims);
        assert_is_water_filling(u64::from(blocks), &claims, &exact.shares);
        let quotas: Vec<u64> = ids.iter().map(|&e| u64::from(c.block_quota(e))).collect();
        prop_assert_eq!(&quotas, &want);
        let mut active_limits = 0u64;
        for (i, &e) in ids.iter().enumerate() {
            let limit = u64::from(c.block_limit(e));
            prop_assert!(limit <= block_cap.max(quotas[i]));
            prop_assert!(limit >= quotas[i]);
            if engines[i].1 { active_limits += limit } else { prop_assert_eq!(limit, quotas[i]) }
        }
        // Nothing held: the active engines may borrow every idle share (and any slack under the
        // caps), up to their caps, and no more than the pool.
        let active = engines.iter().filter(|e| e.1).count() as u64;
        prop_assert_eq!(active_limits, u64::from(blocks).min(active * block_cap));
        prop_assert_eq!(quotas.iter().sum::<u64>(), u64::from(blocks).min(engines.len() as u64 * block_cap));
    }
}

/// One operation of a random sequence.
#[derive(Debug, Clone)]
enum Op {
    Register(u32),
    Deregister(u16),
    SetWeight(u16, u32),
    SetActive(u16, bool),
    Recompute,
    AcquireTokens(u16, u32),
    AcquireTokensUpTo(u16, u32),
    ReleaseTokens(u16, u32),
    BeginStep(u16),
    AcquireBlocks(u16, u32),
    ReleaseBlocks(u16, u32),
    PublishLoad(u16, u16, u32),
    ClearLoad(u16),
    PickDonor(u16, u16, u32),
    PublishDemand(u16, u32),
    PublishBlockDemand(u16, u32),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let e = 0u16..6; // one past max_engines = 5: out of range on purpose
    prop_oneof![
        2 => (0u32..8).prop_map(Op::Register),
        1 => e.clone().prop_map(Op::Deregister),
        1 => (e.clone(), 0u32..8).prop_map(|(e, w)| Op::SetWeight(e, w)),
        3 => (e.clone(), any::<bool>()).prop_map(|(e, a)| Op::SetActive(e, a)),
        2 => Just(Op::Recompute),
        4 => (e.clone(), 0u32..60).prop_map(|(e, n)| Op::AcquireTokens(e, n)),
        2 => (e.clone(), 0u32..120).prop_map(|(e, n)| Op::AcquireTokensUpTo(e, n)),
        2 => (e.clone(), 0u32..40).prop_map(|(e, n)| Op::ReleaseTokens(e, n)),
        2 => e.clone().prop_map(Op::BeginStep),
        4 => (e.clone(), 0u32..30).prop_map(|(e, n)| Op::AcquireBlocks(e, n)),
        3 => (e.clone(), 0u32..30).prop_map(|(e, n)| Op::ReleaseBlocks(e, n)),
        1 => (e.clone(), 0u16..8, 0u32..40).prop_map(|(e, p, f)| Op::PublishLoad(e, p, f)),
        1 => e.clone().prop_map(Op::ClearLoad),
        1 => (e.clone(), 0u16..9, 0u32..30).prop_map(|(e, p, n)| Op::PickDonor(e, p, n)),
        3 => (e.clone(), prop_oneof![0u32..12, 0u32..120, Just(u32::MAX)]).prop_map(|(e, n)| Op::PublishDemand(e, n)),
        3 => (e, prop_oneof![0u32..8, 0u32..80, Just(u32::MAX)]).prop_map(|(e, n)| Op::PublishBlockDemand(e, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn operation_sequences_match_the_model(
        ops in prop::collection::vec(op_strategy(), 1..200),
        cap in prop_oneof![1u16..=1000, Just(1000u16)],
    ) {
        let c = BudgetCoordinator::new(BudgetConfig::new(5, 100, 64).with_cap_permille(cap)).unwrap();
        let mut m = Model::new(5, 100, 64, cap);
        for op in &ops {
            match *op {
                Op::Register(w) => prop_assert_eq!(c.register(w).map(|e| e.0).map_err(|e| kind(&e)), m.register(w)),
                Op::Deregister(e) => prop_assert_eq!(c.deregister(EngineId(e)).map_err(|e| kind(&e)), m.deregister(e)),
                Op::SetWeight(e, w) => prop_assert_eq!(c.set_weight(EngineId(e), w).map_err(|e| kind(&e)), m.set_weight(e, w)),
                Op::SetActive(e, a) => prop_assert_eq!(c.set_active(EngineId(e), a), m.set_active(e, a)),
                Op::Recompute => { c.recompute(); m.recompute(); }
                Op::AcquireTokens(e, n) => prop_assert_eq!(c.try_acquire_tokens(EngineId(e), n), m.try_acquire_tokens(e, n)),
                Op::AcquireTokensUpTo(e, n) => prop_assert_eq!(c.acquire_tokens_up_to(EngineId(e), n), m.acquire_tokens_up_to(e, n)),
                Op::ReleaseTokens(e, n) => prop_assert_eq!(c.release_tokens(EngineId(e), n).map_err(|e| kind(&e)), m.release_tokens(e, n)),
                Op::BeginStep(e) => prop_assert_eq!(c.begin_step(EngineId(e)), m.begin_step(e)),
                Op::AcquireBlocks(e, n) => prop_assert_eq!(c.try_acquire_blocks(EngineId(e), n).map_err(|e| kind(&e)), m.try_acquire_blocks(e, n)),
                Op::ReleaseBlocks(e, n) => prop_assert_eq!(c.release_blocks(EngineId(e), n).map_err(|e| kind(&e)), m.release_blocks(e, n)),
                Op::PublishLoad(e, p, f) => { c.publish_load(EngineId(e), p, f); m.publish_load(e, p, f); }
                Op::ClearLoad(e) => { c.clear_load(EngineId(e)); m.clear_load(e); }
                Op::PublishDemand(e, n) => { c.publish_demand(EngineId(e), n); m.publish_demand(e, n); }
                Op::PublishBlockDemand(e, n) => { c.publish_block_demand(EngineId(e), n); m.publish_block_demand(e, n); }
                Op::PickDonor(e, p, n) => {
                    let got = c.pick_donor(EngineId(e), p, n).map(|d| (d.engine.0, d.priority, d.freeable_blocks, d.borrowed_blocks));
                    prop_assert_eq!(got, m.pick_donor(e, p, n));
                }
            }
            for (i, s) in m.slots.iter().enumerate() {
                let e = EngineId(i as u16);
                prop_assert_eq!(c.is_registered(e), s.registered);
                prop_assert_eq!(c.token_budget(e), s.token_budget);
                prop_assert_eq!(c.token_share(e), s.token_share);
                prop_assert_eq!(c.token_demand(e), s.demand);
                prop_assert!(s.token_budget >= s.token_share);
                prop_assert!(u64::from(s.token_budget) <= m.token_cap().max(u64::from(s.token_share)));
                prop_assert_eq!(c.tokens_used(e), s.tokens_used);
                prop_assert_eq!(c.tokens_granted(e), s.tokens_granted);
                prop_assert_eq!(c.block_quota(e), s.block_quota);
                prop_assert_eq!(c.block_limit(e), s.block_limit);
                prop_assert_eq!(c.block_demand(e), s.block_demand);
                prop_assert!(s.block_limit >= s.block_quota);
                prop_assert_eq!(c.blocks_held(e), s.blocks_held);
                prop_assert_eq!(c.reclaim_for(e), m.reclaim_for(i as u16));
            }
            prop_assert_eq!(c.blocks_in_use(), m.in_use);
            prop_assert_eq!(c.tokens_in_use(), m.tokens_in_use);
            prop_assert!(m.tokens_in_use <= 100);
            let snap = c.snapshot();
            prop_assert!(snap.consistent);
            prop_assert_eq!(snap.engines.len(), m.slots.iter().filter(|s| s.registered).count());
            prop_assert!(snap.engines.iter().map(|s| u64::from(s.token_share)).sum::<u64>() <= 100);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// After a publication, what the active engines may hold beside one another fits the
    /// device: a borrower (budget above its share) its budget, a lender its published demand,
    /// any other engine its share. Otherwise, while the borrowers' steps hold their budgets, a
    /// lender whose work grew gets less than its demand, and an engine whose share was lifted
    /// from 0 gets nothing.
    #[test]
    fn lent_budgets_leave_every_engine_what_it_is_promised(
        engines in prop::collection::vec(
            (
                prop_oneof![1u32..=10, 1u32..=1000, 1u32..=100_000],
                any::<bool>(),
                prop_oneof![Just(None), (0u32..200).prop_map(Some)],
            ),
            1..=12,
        ),
        tokens in prop_oneof![1u32..64, 1u32..4096],
        cap in prop_oneof![1u16..=1000, Just(1000u16)],
    ) {
        let config = BudgetConfig::new(16, tokens, 64).with_cap_permille(cap);
        let c = BudgetCoordinator::new(config).unwrap();
        let ids: Vec<EngineId> = engines.iter().map(|&(w, a, d)| {
            let e = c.register(w).unwrap();
            c.set_active(e, a);
            if let Some(d) = d {
                c.publish_demand(e, d);
            }
            e
        }).collect();
        c.recompute();
        let mut promised = 0u64;
        for &e in &ids {
            let (budget, share) = (c.token_budget(e), c.token_share(e));
            prop_assert!(budget >= share);
            promised += u64::from(match c.token_demand(e) {
                _ if budget > share => budget,
                Some(d) => d.min(share),
                None => share,
            });
        }
        prop_assert!(promised <= u64::from(tokens), "{:?}", c.snapshot());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// After a publication, what the engines may hold beside one another fits the pool: what
    /// each reserves (an active lender its published block demand, at least what it holds;
    /// any other active engine its quota; an idle one what it holds) and what it may borrow
    /// above its quota. Otherwise a lender whose demand stays as published would find the pool
    /// lent out.
    #[test]
    fn lent_block_limits_leave_every_engine_what_it_is_promised(
        engines in prop::collection::vec(
            (
                prop_oneof![1u32..=10, 1u32..=1000],
                any::<bool>(),
                prop_oneof![Just(None), (0u32..300).prop_map(Some)],
                0u32..40,
            ),
            1..=12,
        ),
        blocks in prop_oneof![1u32..64, 1u32..4096],
        cap in prop_oneof![1u16..=1000, Just(1000u16)],
    ) {
        let config = BudgetConfig::new(16, 64, blocks).with_cap_permille(cap);
        let c = BudgetCoordinator::new(config).unwrap();
        let ids: Vec<EngineId> = engines.iter().map(|&(w, _, _, _)| c.register(w).unwrap()).collect();
        // Holdings first (each engine active while it takes them, within its quota), then the
        // activity and demand under test.
        for (&e, &(_, _, _, h)) in ids.iter().zip(&engines) {
            c.set_active(e, true);
            c.recompute();
            let _ = c.try_acquire_blocks(e, h.min(c.block_quota(e)));
        }
        for (&e, &(_, a, d, _)) in ids.iter().zip(&engines) {
            c.set_active(e, a);
            if let Some(d) = d {
                c.publish_block_demand(e, d);
            }
        }
        c.recompute();
        let mut promised = 0u64;
        for &e in &ids {
            let (quota, limit, held) = (c.block_quota(e), c.block_limit(e), c.blocks_held(e));
            prop_assert!(limit >= quota);
            prop_assert!(u64::from(limit) <= u64::from(config.block_cap()).max(u64::from(quota)));
            // What it reserves, and what it may borrow above its quota.
            promised += match (c.is_active(e), c.block_demand(e)) {
                (false, _) => held,
                (true, Some(d)) => u64::from(quota).min(held.max(u64::from(d))),
                (true, None) => u64::from(quota),
            } + u64::from(limit - quota);
        }
        prop_assert!(promised <= u64::from(blocks), "{:?}", c.snapshot());
    }
}
