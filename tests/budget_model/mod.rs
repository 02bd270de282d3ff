//! A sequential model of `pagedkv::budget::BudgetCoordinator`, written independently of it:
//! water-filling by iterative fixpoint (cap every claim whose proportional share reaches its cap,
//! repeat) instead of the library's sorted sweep, plain integers instead of atomics. Shared by the
//! integration tests (`mod budget_model;`) and the fuzz target (`#[path]`).
#![allow(dead_code)]

/// Exact water-filled shares, as rationals `num / den` (a capped claim has `den == 1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExactShares {
    /// `(numerator, denominator)` per claim; weight-0 claims get `(0, 1)`.
    pub shares: Vec<(u128, u128)>,
}

/// Water-fills `total` over `(weight, cap)` claims: the exact shares and the integer amounts
/// (floors plus largest remainders, ties to the lower index).
pub fn water_fill(total: u64, claims: &[(u64, u64)]) -> (ExactShares, Vec<u64>) {
    let n = claims.len();
    let mut capped = vec![false; n];
    loop {
        let left: u128 = u128::from(total)
            - claims
                .iter()
                .zip(&capped)
                .filter(|(_, &c)| c)
                .map(|(c, _)| u128::from(c.1))
                .sum::<u128>();
        let weight: u128 = claims
            .iter()
            .zip(&capped)
            .filter(|(c, &k)| !k && c.0 > 0)
            .map(|(c, _)| u128::from(c.0))
            .sum();
        if weight == 0 {
            break;
        }
        let mut changed = false;
        for i in 0..n {
            let (w, cap) = claims[i];
            if !capped[i] && w > 0 && left * u128::from(w) >= u128::from(cap) * weight {
                capped[i] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let left: u128 = u128::from(total)
        - claims
            .iter()
            .zip(&capped)
            .filter(|(_, &c)| c)
            .map(|(c, _)| u128::from(c.1))
            .sum::<u128>();
    let weight: u128 = claims
        .iter()
        .zip(&capped)
        .filter(|(c, &k)| !k && c.0 > 0)
        .map(|(c, _)| u128::from(c.0))
        .sum();
    let mut shares = Vec::with_capacity(n);
    let mut out = vec![0u64; n];
    let mut rems = Vec::new();
    for i in 0..n {
        let (w, cap) = claims[i];
        if w == 0 {
            shares.push((0, 1));
        } else if capped[i] {
            shares.push((u128::from(cap), 1));
            out[i] = cap;
        } else {
            let num = left * u128::from(w);
            shares.push((num, weight));
            out[i] = (num / weight) as u64;
            rems.push((num % weight, i));
        }
    }
    let handed: u128 = out
        .iter()
        .zip(&capped)
        .filter(|(_, &c)| !c)
        .map(|(&o, _)| u128::from(o))
        .sum();
    let extra = if weight == 0 {
        0
    } else {
        (left - handed) as usize
    };
    // Largest remainder first, then lower index.
    rems.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in rems.iter().take(extra) {
        out[i] += 1;
    }
    (ExactShares { shares }, out)
}

/// The token budgets' floor: when the claims of weight > 0 can each hold one unit (their
/// amounts sum to at least their count and the cap is at least 1), each of them that got 0
/// takes one, in index order, from the claim of weight > 0 then holding the most (ties to the
/// lower index).
pub fn lift_zeros(amounts: &mut [u64], claims: &[(u64, u64)]) {
    let live: Vec<usize> = (0..claims.len()).filter(|&i| claims[i].0 > 0).collect();
    let sum: u64 = live.iter().map(|&i| amounts[i]).sum();
    if live.is_empty() || claims[live[0]].1 == 0 || sum < live.len() as u64 {
        return;
    }
    for &k in &live {
        if amounts[k] != 0 {
            continue;
        }
        let mut donor = live[0];
        for &j in &live {
            if amounts[j] > amounts[donor] {
                donor = j;
            }
        }
        assert!(amounts[donor] >= 2, "no donor: {amounts:?}");
        amounts[donor] -= 1;
        amounts[k] = 1;
    }
}

/// Raises every amount below its floor to it, in index order, taking from the amount then
/// holding the most above its own floor (ties to the lower index), as much as it has.
pub fn cover_floors(amounts: &mut [u64], floors: &[u64]) {
    for k in 0..amounts.len() {
        while amounts[k] < floors[k] {
            let Some(j) = (0..amounts.len())
                .filter(|&j| amounts[j] > floors[j])
                .max_by_key(|&j| (amounts[j] - floors[j], std::cmp::Reverse(j)))
            else {
                break;
            };
            let take = (amounts[j] - floors[j]).min(floors[k] - amounts[k]);
            amounts[j] -= take;
            amounts[k] += take;
        }
    }
}

/// A published demand: `value` rounded up to `q`, `None` at or above `cap`; stored when it
/// rises (`None` is the highest) or falls by more than one quantum.
fn requantise(demand: &mut Option<u32>, value: u32, q: u64, cap: u64) {
    let rounded = u64::from(value).div_ceil(q) * q;
    let new = (rounded < cap).then_some(rounded);
    let store = match (new, demand.map(u64::from)) {
        (_, None) => new.is_some(),
        (None, Some(_)) => true,
        (Some(n), Some(o)) => n > o || n + q < o,
    };
    if store {
        *demand = new.map(|d| d as u32);
    }
}

/// One engine slot of the model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotModel {
    pub registered: bool,
    pub weight: u32,
    pub active: bool,
    pub token_budget: u32,
    /// The weighted share among the active engines; `token_budget` is this, or more when
    /// another active engine's demand leaves part of its share.
    pub token_share: u32,
    /// Published demand, rounded up to the quantum; `None`: wants its whole share.
    pub demand: Option<u32>,
    pub tokens_used: u64,
    pub tokens_granted: u64,
    pub block_quota: u32,
    /// Published block demand, rounded up to the block quantum; `None`: its whole quota.
    pub block_demand: Option<u32>,
    pub block_limit: u32,
    pub blocks_held: u64,
    pub load: Option<(u16, u32)>,
}

/// What a model call refused, in the library's terms (compared by variant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelError {
    InvalidConfig,
    ZeroWeight,
    TooManyEngines,
    UnknownEngine,
    NotRegistered,
    StillHoldsBlocks,
    OverBlockLimit,
    BlocksExhausted,
    TokensNotHeld,
    BlocksNotHeld,
}

/// Maps a library error to the model's.
pub fn kind(e: &pagedkv::error::BudgetError) -> ModelError {
    use pagedkv::error::BudgetError as B;
    match e {
        B::InvalidConfig(_) => ModelError::InvalidConfig,
        B::ZeroWeight => ModelError::ZeroWeight,
        B::TooManyEngines { .. } => ModelError::TooManyEngines,
        B::UnknownEngine { .. } => ModelError::UnknownEngine,
        B::NotRegistered { .. } => ModelError::NotRegistered,
        B::StillHoldsBlocks { .. } => ModelError::StillHoldsBlocks,
        B::OverBlockLimit { .. } => ModelError::OverBlockLimit,
        B::BlocksExhausted { .. } => ModelError::BlocksExhausted,
        B::TokensNotHeld { .. } => ModelError::TokensNotHeld,
        B::BlocksNotHeld { .. } => ModelError::BlocksNotHeld,
    }
}

/// The sequential model of the coordinator.
#[derive(Debug, Clone)]
pub struct Model {
    pub tokens_per_step: u32,
    pub total_blocks: u32,
    pub cap_permille: u16,
    pub slots: Vec<SlotModel>,
    pub in_use: u64,
    /// Tokens granted in every engine's current step: bounded by `tokens_per_step`.
    pub tokens_in_use: u64,
}

impl Model {
    pub fn new(
        max_engines: u16,
        tokens_per_step: u32,
        total_blocks: u32,
        cap_permille: u16,
    ) -> Self {
        Self {
            tokens_per_step,
            total_blocks,
            cap_permille,
            slots: vec![SlotModel::default(); usize::from(max_engines)],
            in_use: 0,
            tokens_in_use: 0,
        }
    }

    pub fn token_cap(&self) -> u64 {
        u64::from(self.tokens_per_step) * u64::from(self.cap_permille) / 1000
    }

    pub fn block_cap(&self) -> u64 {
        u64::from(self.total_blocks) * u64::from(self.cap_permille) / 1000
    }

    fn slot(&mut self, e: u16) -> Result<&mut SlotModel, ModelError> {
        self.slots
            .get_mut(usize::from(e))
            .ok_or(ModelError::UnknownEngine)
    }

    fn registered(&mut self, e: u16) -> Result<&mut SlotModel, ModelError> {
        let s = self.slot(e)?;
        if s.registered {
            Ok(s)
        } else {
            Err(ModelError::NotRegistered)
        }
    }

    pub fn register(&mut self, weight: u32) -> Result<u16, ModelError> {
        if weight == 0 {
            return Err(ModelError::ZeroWeight);
        }
        let i = self
            .slots
            .iter()
            .position(|s| !s.registered)
            .ok_or(ModelError::TooManyEngines)?;
        let s = &mut self.slots[i];
        s.registered = true;
        s.weight = weight;
        s.active = false;
        s.demand = None;
        s.block_demand = None;
        s.tokens_used = 0;
        s.tokens_granted = 0;
        s.blocks_held = 0;
        s.load = None;
        self.recompute();
        Ok(i as u16)
    }

    pub fn set_weight(&mut self, e: u16, weight: u32) -> Result<(), ModelError> {
        if weight == 0 {
            return Err(ModelError::ZeroWeight);
        }
        self.registered(e)?.weight = weight;
        self.recompute();
        Ok(())
    }

    pub fn deregister(&mut self, e: u16) -> Result<(), ModelError> {
        let s = self.registered(e)?;
        if s.blocks_held != 0 {
            return Err(ModelError::StillHoldsBlocks);
        }
        s.registered = false;
        s.active = false;
        // Its step ends with it.
        self.begin_step(e);
        self.recompute();
        Ok(())
    }

    pub fn set_active(&mut self, e: u16, active: bool) -> bool {
        match self.slot(e) {
            Ok(s) => {
                let was = std::mem::replace(&mut s.active, active);
                if was != active {
                    s.demand = None;
                    s.block_demand = None;
                }
                was
            }
            Err(_) => false,
        }
    }

    /// The demand quantum: tokens_per_step / 32 rounded up, at least 1.
    pub fn demand_quantum(&self) -> u64 {
        u64::from(self.tokens_per_step).div_ceil(32).max(1)
    }

    /// Demand rounded up to the quantum, `None` at or above the cap; stored when it rises or
    /// falls by more than one quantum.
    pub fn publish_demand(&mut self, e: u16, tokens: u32) {
        let (q, cap) = (self.demand_quantum(), self.token_cap());
        if let Ok(s) = self.slot(e) {
            requantise(&mut s.demand, tokens, q, cap);
        }
    }

    /// The block demand quantum: total_blocks / 64 rounded up, at least 1.
    pub fn block_demand_quantum(&self) -> u64 {
        u64::from(self.total_blocks).div_ceil(64).max(1)
    }

    /// Block demand, as token demand with the block quantum and cap.
    pub fn publish_block_demand(&mut self, e: u16, blocks: u32) {
        let (q, cap) = (self.block_demand_quantum(), self.block_cap());
        if let Ok(s) = self.slot(e) {
            requantise(&mut s.block_demand, blocks, q, cap);
        }
    }

    pub fn try_acquire_tokens(&mut self, e: u16, n: u32) -> bool {
        let room = u64::from(self.tokens_per_step) - self.tokens_in_use;
        let Ok(s) = self.slot(e) else { return false };
        let n = u64::from(n);
        if s.tokens_used + n <= u64::from(s.token_budget) && n <= room {
            s.tokens_used += n;
            s.tokens_granted += n;
            self.tokens_in_use += n;
            true
        } else {
            false
        }
    }

    /// As many of `n` tokens as fit the engine's budget and the device's.
    pub fn acquire_tokens_up_to(&mut self, e: u16, n: u32) -> u32 {
        let room = u64::from(self.tokens_per_step) - self.tokens_in_use;
        let Ok(s) = self.slot(e) else { return 0 };
        let own = u64::from(s.token_budget).saturating_sub(s.tokens_used);
        let got = u64::from(n).min(own).min(room);
        s.tokens_used += got;
        s.tokens_granted += got;
        self.tokens_in_use += got;
        got as u32
    }

    pub fn release_tokens(&mut self, e: u16, n: u32) -> Result<(), ModelError> {
        let s = self.slot(e)?;
        if s.tokens_granted < u64::from(n) {
            return Err(ModelError::TokensNotHeld);
        }
        s.tokens_granted -= u64::from(n);
        s.tokens_used -= u64::from(n);
        self.tokens_in_use -= u64::from(n);
        Ok(())
    }

    pub fn begin_step(&mut self, e: u16) -> u64 {
        let Ok(s) = self.slot(e) else { return 0 };
        let g = std::mem::take(&mut s.tokens_granted);
        s.tokens_used -= g;
        self.tokens_in_use -= g;
        g
    }

    pub fn try_acquire_blocks(&mut self, e: u16, n: u32) -> Result<(), ModelError> {
        let total = u64::from(self.total_blocks);
        let in_use = self.in_use;
        let s = self.slot(e)?;
        if s.blocks_held + u64::from(n) > u64::from(s.block_limit) {
            return Err(ModelError::OverBlockLimit);
        }
        if in_use + u64::from(n) > total {
            return Err(ModelError::BlocksExhausted);
        }
        s.blocks_held += u64::from(n);
        self.in_use += u64::from(n);
        Ok(())
    }

    pub fn release_blocks(&mut self, e: u16, n: u32) -> Result<(), ModelError> {
        let s = self.slot(e)?;
        if s.blocks_held < u64::from(n) {
            return Err(ModelError::BlocksNotHeld);
        }
        s.blocks_held -= u64::from(n);
        self.in_use -= u64::from(n);
        Ok(())
    }

    pub fn reclaim_for(&self, e: u16) -> u32 {
        self.slots.get(usize::from(e)).map_or(0, |s| {
            s.blocks_held.saturating_sub(u64::from(s.block_limit)) as u32
        })
    }

    pub fn publish_load(&mut self, e: u16, p: u16, freeable: u32) {
        if let Ok(s) = self.slot(e) {
            s.load = Some((p, freeable));
        }
    }

    pub fn clear_load(&mut self, e: u16) {
        if let Ok(s) = self.slot(e) {
            s.load = None;
        }
    }

    /// `(engine, priority, freeable, borrowed)` of the donor.
    pub fn pick_donor(
        &self,
        requester: u16,
        priority: u16,
        needed: u32,
    ) -> Option<(u16, u16, u32, u32)> {
        let mut candidates: Vec<(u16, u16, u32, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(i, s)| *i != usize::from(requester) && s.registered)
            .filter_map(|(i, s)| {
                let (p, f) = s.load?;
                let borrowed = s.blocks_held.saturating_sub(u64::from(s.block_quota)) as u32;
                (p < priority && f >= needed.max(1)).then_some((i as u16, p, f, borrowed))
            })
            .collect();
        candidates.sort_by(|a, b| a.1.cmp(&b.1).then(b.3.cmp(&a.3)).then(a.0.cmp(&b.0)));
        candidates.first().copied()
    }

    pub fn recompute(&mut self) {
        let live: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].registered)
            .collect();
        for s in self.slots.iter_mut() {
            s.token_budget = 0;
            s.token_share = 0;
            s.block_quota = 0;
            s.block_limit = 0;
        }
        let token_cap = self.token_cap();
        let block_cap = self.block_cap();
        let claims: Vec<(u64, u64)> = live
            .iter()
            .map(|&i| {
                let s = &self.slots[i];
                (if s.active { u64::from(s.weight) } else { 0 }, token_cap)
            })
            .collect();
        let (_, mut tokens) = water_fill(u64::from(self.tokens_per_step), &claims);
        lift_zeros(&mut tokens, &claims);
        // Lending, when an active engine published a demand: the same fill, capped by demand
        // too; a budget is the larger of share and that.
        let demand_caps: Vec<(u64, u64)> = live
            .iter()
            .zip(&claims)
            .map(|(&i, &(w, cap))| {
                (
                    w,
                    self.slots[i].demand.map_or(cap, |d| cap.min(u64::from(d))),
                )
            })
            .collect();
        let lending = live
            .iter()
            .any(|&i| self.slots[i].active && self.slots[i].demand.is_some());
        let lent = if lending {
            let mut lent = water_fill(u64::from(self.tokens_per_step), &demand_caps).1;
            // Every active engine keeps its share there, or its demand where that is lower.
            let floors: Vec<u64> = demand_caps
                .iter()
                .enumerate()
                .map(|(k, &(w, cap))| if w > 0 { tokens[k].min(cap) } else { 0 })
                .collect();
            cover_floors(&mut lent, &floors);
            lent
        } else {
            vec![0; live.len()]
        };
        let claims: Vec<(u64, u64)> = live
            .iter()
            .map(|&i| (u64::from(self.slots[i].weight), block_cap))
            .collect();
        let (_, quotas) = water_fill(u64::from(self.total_blocks), &claims);
        for (k, &i) in live.iter().enumerate() {
            let s = &mut self.slots[i];
            s.token_share = tokens[k] as u32;
            s.token_budget = tokens[k].max(lent[k]) as u32;
            s.block_quota = quotas[k] as u32;
            s.block_limit = quotas[k] as u32;
        }
        // An active engine reserves its quota, or its block demand where lower (at least what
        // it holds); an idle one what it holds.
        let reserved: u64 = live
            .iter()
            .map(|&i| {
                let s = &self.slots[i];
                let quota = u64::from(s.block_quota);
                match (s.active, s.block_demand) {
                    (true, None) => quota,
                    (true, Some(d)) => quota.min(s.blocks_held.max(u64::from(d))),
                    (false, _) => s.blocks_held,
                }
            })
            .sum();
        let lendable = u64::from(self.total_blocks).saturating_sub(reserved);
        // First to the active engines wanting more than their quota, up to their demand and
        // the cap; then what is left to every active engine, up to the cap.
        let weight = |s: &SlotModel| if s.active { u64::from(s.weight) } else { 0 };
        let claims: Vec<(u64, u64)> = live
            .iter()
            .map(|&i| {
                let s = &self.slots[i];
                let want = s
                    .block_demand
                    .map_or(block_cap, |d| block_cap.min(u64::from(d)));
                (weight(s), want.saturating_sub(u64::from(s.block_quota)))
            })
            .collect();
        let (_, lent) = water_fill(lendable, &claims);
        let given: u64 = lent.iter().sum();
        for (k, &i) in live.iter().enumerate() {
            self.slots[i].block_limit += lent[k] as u32;
        }
        let claims: Vec<(u64, u64)> = live
            .iter()
            .map(|&i| {
                let s = &self.slots[i];
                (
                    weight(s),
                    block_cap.saturating_sub(u64::from(s.block_limit)),
                )
            })
            .collect();
        let (_, rest) = water_fill(lendable - given, &claims);
        for (k, &i) in live.iter().enumerate() {
            self.slots[i].block_limit += rest[k] as u32;
        }
    }
}
