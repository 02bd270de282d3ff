//! Weighted water-filling with per-claim caps and largest-remainder rounding.
//!
//! Given an integer `total` and claims `(weight w_i > 0, cap c_i)`, the exact water-filled
//! share of claim `i` is `x_i = min(c_i, λ·w_i)`, with the water level `λ` chosen so that
//! `Σ x_i = total` (or `λ = ∞`, every claim at its cap, when `Σ c_i ≤ total`). This is weighted
//! max-min fairness ("progressive filling"): no claim can get more without taking from a claim
//! whose share per unit of weight is no larger.
//!
//! **Finding λ.** Sort the claims by `c_i / w_i` ascending. Walk them keeping the amount `R`
//! still to hand out and the weight `W` of the claims not yet fixed: claim `i` saturates iff its
//! proportional share of what is left reaches its cap, `R·w_i ≥ c_i·W` (exact, in `u128`); it
//! is then fixed at `c_i`, and `R -= c_i`, `W -= w_i`. The first claim that does not saturate
//! ends the walk: every later claim has a larger `c/w`, hence does not saturate either, and the
//! remaining claims get `R·w_i / W` exactly. One sort, one pass: O(n log n).
//!
//! **Rounding.** The unsaturated claims get `⌊R·w_i / W⌋`; the `k = R − Σ⌊…⌋ < n` units left
//! over go one each to the `k` largest remainders `R·w_i mod W`, ties to the lower id
//! (Hamilton's largest-remainder method). So every claim is within one unit of its exact share,
//! never above its cap (an unsaturated share is strictly below the integer cap, so its floor
//! plus one is at most the cap), and the amounts sum to exactly `min(total, Σ c_i)`.

use std::cmp::Ordering as CmpOrdering;

/// One claimant in a water-filling round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// Tie-break key (the engine index): lower wins an equal remainder.
    pub(crate) id: u16,
    /// Share weight; claims of weight 0 get nothing.
    pub(crate) weight: u64,
    /// The most this claim may receive.
    pub(crate) cap: u64,
}

/// Water-fills `total` over `claims`, writing each claim's amount to the same index of `out`.
/// `order` is scratch space (reused across calls to avoid allocating). Returns the amount
/// handed out, `min(total, Σ caps of claims with weight > 0)`.
pub(crate) fn water_fill(
    total: u64,
    claims: &[Claim],
    out: &mut [u64],
    order: &mut Vec<u32>,
) -> u64 {
    debug_assert_eq!(claims.len(), out.len());
    out.fill(0);
    order.clear();
    let mut weight_left: u128 = 0;
    for (i, c) in claims.iter().enumerate() {
        if c.weight > 0 {
            order.push(i as u32);
            weight_left += u128::from(c.weight);
        }
    }
    // Ascending cap per unit of weight: c_a / w_a < c_b / w_b  <=>  c_a·w_b < c_b·w_a.
    order.sort_unstable_by(|&a, &b| {
        let (a, b) = (&claims[a as usize], &claims[b as usize]);
        let lhs = u128::from(a.cap) * u128::from(b.weight);
        let rhs = u128::from(b.cap) * u128::from(a.weight);
        lhs.cmp(&rhs).then(a.id.cmp(&b.id))
    });

    let mut left = total;
    let mut first_free = order.len();
    for (pos, &i) in order.iter().enumerate() {
        let c = &claims[i as usize];
        if u128::from(left) * u128::from(c.weight) >= u128::from(c.cap) * weight_left {
            // Saturated: its cap is at most its proportional share of `left`, so cap <= left.
            out[i as usize] = c.cap;
            left -= c.cap;
            weight_left -= u128::from(c.weight);
        } else {
            first_free = pos;
            break;
        }
    }
    if first_free == order.len() {
        return total - left;
    }

    // Unsaturated tail: floors, then the leftover units by largest remainder.
    let tail = &mut order[first_free..];
    let mut handed: u64 = 0;
    for &i in tail.iter() {
        let share = u128::from(left) * u128::from(claims[i as usize].weight);
        // share / weight_left <= left, so the floor fits in u64.
        let floor = (share / weight_left) as u64;
        out[i as usize] = floor;
        handed += floor;
    }
    let extra = (left - handed) as usize;
    if extra > 0 {
        let rem = |i: u32| (u128::from(left) * u128::from(claims[i as usize].weight)) % weight_left;
        tail.sort_unstable_by(|&a, &b| match rem(b).cmp(&rem(a)) {
            CmpOrdering::Equal => claims[a as usize].id.cmp(&claims[b as usize].id),
            o => o,
        });
        for &i in tail.iter().take(extra) {
            out[i as usize] += 1;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(total: u64, claims: &[(u64, u64)]) -> Vec<u64> {
        let claims: Vec<Claim> = claims
            .iter()
            .enumerate()
            .map(|(i, &(weight, cap))| Claim {
                id: i as u16,
                weight,
                cap,
            })
            .collect();
        let mut out = vec![0; claims.len()];
        let handed = water_fill(total, &claims, &mut out, &mut Vec::new());
        assert_eq!(handed, out.iter().sum::<u64>());
        out
    }

    #[test]
    fn proportional_without_caps() {
        assert_eq!(fill(1000, &[(1, 1000), (3, 1000)]), vec![250, 750]);
        assert_eq!(fill(10, &[(1, 10), (1, 10), (1, 10)]), vec![4, 3, 3]);
    }

    #[test]
    fn capped_excess_flows_to_the_others_by_weight() {
        // Exact shares 500/250/250; cap 300 on the first: 300, then 700 split 1:1.
        assert_eq!(
            fill(1000, &[(2, 300), (1, 1000), (1, 1000)]),
            vec![300, 350, 350]
        );
        // Everyone capped below the total: sum of caps, never more.
        assert_eq!(fill(1000, &[(1, 200), (5, 300)]), vec![200, 300]);
    }

    #[test]
    fn largest_remainder_ties_go_to_lower_id() {
        // 7 over weights 1,1,1: floors 2,2,2, one left, all remainders equal -> id 0.
        assert_eq!(fill(7, &[(1, 7), (1, 7), (1, 7)]), vec![3, 2, 2]);
        // 5 over 2,1,1: exact 2.5, 1.25, 1.25 -> floors 2,1,1 and remainder .5 wins.
        assert_eq!(fill(5, &[(2, 5), (1, 5), (1, 5)]), vec![3, 1, 1]);
    }

    #[test]
    fn zero_weight_and_zero_total() {
        assert_eq!(fill(100, &[(0, 100), (1, 100)]), vec![0, 100]);
        assert_eq!(fill(0, &[(1, 100), (1, 100)]), vec![0, 0]);
        assert_eq!(fill(100, &[]), Vec::<u64>::new());
    }

    #[test]
    fn huge_weights_do_not_overflow() {
        let w = u64::from(u32::MAX);
        let out = fill(
            u64::from(u32::MAX),
            &[(w, u64::from(u32::MAX)), (w, 7), (1, u64::from(u32::MAX))],
        );
        assert_eq!(out[1], 7);
        assert_eq!(out.iter().sum::<u64>(), u64::from(u32::MAX));
    }
}
