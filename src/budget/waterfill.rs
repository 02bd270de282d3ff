//! Weighted water-filling with per-claim caps and largest-remainder rounding.
//!
//! Given an integer `total` and claims `(weight w_i > 0, cap c_i)`, the exact water-filled
//! share of claim `i` is `x_i = min(c_i, λ·w_i)`, with the water level `λ` chosen so that
//! `Σ x_i = total` (or `λ = ∞`, every claim at its cap, when `Σ c_i ≤ total`). This is weighted
//! max-min fairness ("progressive filling"): no claim can get more without taking from a claim
//! whose share per unit of weight is no larger.
//!
//! **Finding λ.** Keep the amount `R` still to hand out and the weight `W` of the claims not
//! yet fixed. At the current level `R / W`, claim `i` saturates iff its proportional share
//! reaches its cap, `R·w_i ≥ c_i·W` (exact integers). Fixing saturated claims at their caps only
//! raises the level for the rest (each took at most its proportional share), so a claim that
//! saturates at some level saturates at the final one. A pass fixes every claim that saturates
//! at the current level; when a pass fixes nothing, the level is final and the remaining claims
//! get `R·w_i / W` exactly. Usually that is one or two passes, O(n) each. After
//! [`FAST_PASSES`] passes (inputs built to need many) the remaining claims are sorted by
//! `c_i / w_i` and swept once: a claim saturates iff it does at the level left by the claims
//! before it, and the first one that does not ends the sweep, since every later claim has a
//! larger `c/w`. So O(n log n) at worst.
//!
//! **Rounding.** The unsaturated claims get `⌊R·w_i / W⌋`; the `k = R − Σ⌊…⌋ < n` units left
//! over go one each to the `k` largest remainders `R·w_i mod W`, ties to the lower id
//! (Hamilton's largest-remainder method; claims come in engine-id order). So every claim is within one unit of its exact share,
//! never above its cap (an unsaturated share is strictly below the integer cap, so its floor
//! plus one is at most the cap), and the amounts sum to exactly `min(total, Σ c_i)`.

/// One claimant in a water-filling round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    /// Share weight; claims of weight 0 get nothing.
    pub(crate) weight: u32,
    /// The most this claim may receive.
    pub(crate) cap: u32,
}

/// Progressive-filling passes before falling back to the sort-and-sweep.
pub(crate) const FAST_PASSES: u32 = 3;

/// Reusable scratch space, so a round does not allocate once warm.
#[derive(Debug, Default)]
pub(crate) struct FillScratch {
    /// Indices of the claims not (yet) saturated.
    free: Vec<u32>,
    /// `remainder << 16 | (0xFFFF − claim index)` of the unsaturated claims: ordering these
    /// keys descending is "largest remainder first, then lower index" (remainders are below the
    /// weight sum, `< 2^48`, and indices below 2^16, so the key is exact).
    rems: Vec<u64>,
}

/// Water-fills `total` over `claims` (at most 65,536 of them, in tie-break order: an equal
/// remainder goes to the lower index), writing each claim's amount to
/// the same index of `out`. Returns the amount handed out, `min(total, Σ caps of claims with
/// weight > 0)`.
///
/// Arithmetic: `total`, weights and caps are `u32`, so `left·w < 2^64`, `cap·w < 2^64` and the
/// weight sum `< 2^48`; only the saturation test `left·w ≥ cap·W` needs a `u128` product, and
/// every division is a `u64` one.
pub(crate) fn water_fill(
    total: u32,
    claims: &[Claim],
    out: &mut [u64],
    s: &mut FillScratch,
) -> u64 {
    debug_assert_eq!(claims.len(), out.len());
    out.fill(0);
    s.free.clear();
    let mut weight_left: u64 = 0;
    for (i, c) in claims.iter().enumerate() {
        if c.weight > 0 {
            s.free.push(i as u32);
            weight_left += u64::from(c.weight);
        }
    }
    let saturates = |c: &Claim, left: u64, weight: u64| {
        u128::from(left) * u128::from(c.weight) >= u128::from(c.cap) * u128::from(weight)
    };

    let total = u64::from(total);
    let mut left = total;
    let mut passes = 0;
    while !s.free.is_empty() {
        if passes == FAST_PASSES {
            // Sort by ascending cap per unit of weight (c_a·w_b < c_b·w_a, products < 2^64),
            // then sweep with the level updated claim by claim.
            s.free.sort_unstable_by(|&a, &b| {
                let (a, b) = (&claims[a as usize], &claims[b as usize]);
                let lhs = u64::from(a.cap) * u64::from(b.weight);
                let rhs = u64::from(b.cap) * u64::from(a.weight);
                lhs.cmp(&rhs)
            });
            let mut fixed = 0;
            for &i in &s.free {
                let c = &claims[i as usize];
                if !saturates(c, left, weight_left) {
                    break;
                }
                out[i as usize] = u64::from(c.cap);
                left -= u64::from(c.cap);
                weight_left -= u64::from(c.weight);
                fixed += 1;
            }
            s.free.drain(..fixed);
            break;
        }
        // One pass at the level `level_left / level_weight`: the caps fixed in it sum to at most
        // that level times their weight, so at most `level_left`.
        let (level_left, level_weight) = (left, weight_left);
        let before = s.free.len();
        s.free.retain(|&i| {
            let c = &claims[i as usize];
            if saturates(c, level_left, level_weight) {
                out[i as usize] = u64::from(c.cap);
                left -= u64::from(c.cap);
                weight_left -= u64::from(c.weight);
                false
            } else {
                true
            }
        });
        if s.free.len() == before {
            break;
        }
        passes += 1;
    }
    if s.free.is_empty() {
        return total - left;
    }

    // Unsaturated claims: floors, then the leftover units by largest remainder.
    s.rems.clear();
    let mut handed: u64 = 0;
    let div = Reciprocal::new(weight_left);
    for &i in &s.free {
        // left <= total < 2^32 and weight < 2^32: the product fits in u64.
        let share = left * u64::from(claims[i as usize].weight);
        let (floor, rem) = div.div_rem(share);
        out[i as usize] = floor;
        handed += floor;
        s.rems.push((rem << 16) | u64::from(0xFFFF - i));
    }
    let extra = (left - handed) as usize;
    if extra > 0 {
        // Largest remainder first, ties to the lower index; only the first `extra` matter.
        if extra < s.rems.len() {
            s.rems.select_nth_unstable_by(extra - 1, |a, b| b.cmp(a));
        }
        for &key in &s.rems[..extra] {
            out[(0xFFFF - (key & 0xFFFF)) as usize] += 1;
        }
    }
    total
}

/// Gives one unit to every claim that got none, each taken from the claim then holding the
/// most (ties to the lower index), when every claim can hold one: `Σ out ≥ out.len()` and a
/// cap of at least 1. Otherwise leaves `out` as it is. The sum is unchanged, no claim goes
/// above its cap (a lifted claim gets 1 ≤ cap, a donor only loses), and a donor always keeps
/// at least one (while a claim holds 0 and the sum is at least the count, the largest holds
/// at least 2).
///
/// Largest-remainder rounding alone gives a claim whose exact share is below one unit 0 for
/// as long as the inputs stay the same, and, between equal remainders, always to the same
/// (lower) index: an active engine whose weighted share of a step's tokens is below one token
/// (weights 1000:1:1 over 512 tokens gives 511, 1, 0) would get nothing for as long as the
/// others have any work, however little they use. A floor of one unit for every claim
/// ([`cover_floors`]: the donor holding the most above its floor of one is the one holding
/// the most), O(n + z log n) for `z` lifted claims; `heap` is reused scratch.
pub(crate) fn lift_zeros(out: &mut [u64], cap: u32, heap: &mut Vec<(u64, std::cmp::Reverse<u32>)>) {
    let n = out.len() as u64;
    if cap == 0 || out.iter().sum::<u64>() < n {
        return;
    }
    cover_floors(out, |_| 1, heap);
}

/// Raises every claim below its floor (`floor(k)`) to it, taking the units from the claims
/// holding the most above theirs (ties to the lower index), as far as they hold any. The sum is
/// unchanged, a raised claim gets no more than its floor, and a donor keeps at least its own.
///
/// The lending fill (module docs of `budget`, "Token lending") gives a claim whose share was
/// lifted from 0 ([`lift_zeros`]) nothing again, and may round a claim a unit below its share:
/// the borrowers' figures then count that unit too, and while their steps hold them, that
/// engine finds the device's tokens all taken. O(n + d log n) for `d` claims below their floor;
/// `heap` is reused scratch.
pub(crate) fn cover_floors(
    out: &mut [u64],
    floor: impl Fn(usize) -> u64,
    heap: &mut Vec<(u64, std::cmp::Reverse<u32>)>,
) {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    if (0..out.len()).all(|k| out[k] >= floor(k)) {
        return;
    }
    heap.clear();
    heap.extend(
        out.iter()
            .enumerate()
            .filter(|&(k, &x)| x > floor(k))
            .map(|(k, &x)| (x - floor(k), Reverse(k as u32))),
    );
    let mut donors = BinaryHeap::from(std::mem::take(heap));
    for k in 0..out.len() {
        let mut need = floor(k).saturating_sub(out[k]);
        while need > 0 {
            let Some((surplus, Reverse(j))) = donors.pop() else {
                break;
            };
            let take = surplus.min(need);
            out[j as usize] -= take;
            out[k] += take;
            need -= take;
            if surplus > take {
                donors.push((surplus - take, Reverse(j)));
            }
        }
    }
    *heap = donors.into_vec();
}

/// Division of many `u64` numerators by one divisor through a multiply: `m = ⌊2^64 / d⌋`
/// computed once, then `q̂ = ⌊n·m / 2^64⌋` is at most 1 below `⌊n / d⌋` (because
/// `n·m / 2^64 > n/d − n/2^64 ≥ n/d − 1`) and never above it, so one correction step is exact.
/// A hardware 64-bit division costs tens of cycles; this is one widening multiply.
#[derive(Debug, Clone, Copy)]
struct Reciprocal {
    d: u64,
    m: u64,
}

impl Reciprocal {
    fn new(d: u64) -> Self {
        debug_assert!(d > 0);
        // d = 1 would give 2^64, which does not fit: saturate (n·(2^64 − 1) / 2^64 is n − 1 for
        // n > 0, corrected below like any other estimate).
        let m = u64::try_from((1u128 << 64) / u128::from(d)).unwrap_or(u64::MAX);
        Self { d, m }
    }

    #[inline]
    fn div_rem(self, n: u64) -> (u64, u64) {
        let mut q = ((u128::from(n) * u128::from(self.m)) >> 64) as u64;
        let mut r = n - q * self.d;
        if r >= self.d {
            q += 1;
            r -= self.d;
        }
        (q, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(total: u32, claims: &[(u32, u32)]) -> Vec<u64> {
        let claims: Vec<Claim> = claims
            .iter()
            .map(|&(weight, cap)| Claim { weight, cap })
            .collect();
        let mut out = vec![0; claims.len()];
        let handed = water_fill(total, &claims, &mut out, &mut FillScratch::default());
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
    fn many_passes_fall_back_to_sort_and_sweep() {
        // Geometric weights under one cap: each pass saturates only the heaviest claim left, so
        // the fast passes run out (4096, 1024, 256 saturate at 10 each) and the sweep finishes:
        // 10 left over weights 64, 16, 4, 1 (sum 85) = 7.53, 1.88, 0.47, 0.12 -> floors 7, 1, 0, 0
        // and the two leftover units to the remainders .88 and .53.
        let claims: Vec<(u32, u32)> = [4096, 1024, 256, 64, 16, 4, 1]
            .iter()
            .map(|&w| (w, 10))
            .collect();
        let out = fill(40, &claims);
        assert_eq!(out.iter().sum::<u64>(), 40);
        // More saturating claims than fast passes: the sweep itself must fix some.
        let claims: Vec<(u32, u32)> = (0..10).map(|k| (1u32 << (3 * (9 - k)), 10)).collect();
        let out10 = fill(60, &claims);
        assert_eq!(out10.iter().sum::<u64>(), 60);
        assert_eq!(&out10[..6], &[10, 10, 10, 10, 10, 9]);
        assert_eq!(out, vec![10, 10, 10, 8, 2, 0, 0]);
    }

    #[test]
    fn reciprocal_division_is_exact() {
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for d in [1u64, 2, 3, 7, 1 << 32, (1 << 48) - 1, u64::MAX] {
            let r = Reciprocal::new(d);
            for n in [0, 1, d - 1, d, d.wrapping_add(1), u64::MAX, u64::MAX - 1] {
                assert_eq!(r.div_rem(n), (n / d, n % d), "{n} / {d}");
            }
        }
        for _ in 0..100_000 {
            let d = (next() >> (next() % 64)).max(1);
            let n = next() >> (next() % 64);
            assert_eq!(Reciprocal::new(d).div_rem(n), (n / d, n % d), "{n} / {d}");
        }
    }

    fn lifted(mut out: Vec<u64>, cap: u32) -> Vec<u64> {
        lift_zeros(&mut out, cap, &mut Vec::new());
        out
    }

    #[test]
    fn claims_below_one_unit_get_one_when_every_claim_can() {
        // Weights 1000:1:1 over 512: 510.98, 0.51, 0.51 -> 511, 1, 0 -> 510, 1, 1.
        let out = fill(512, &[(1000, 512), (1, 512), (1, 512)]);
        assert_eq!(out, vec![511, 1, 0]);
        assert_eq!(lifted(out, 512), vec![510, 1, 1]);
        // Donors by largest amount, ties to the lower index; sums kept.
        assert_eq!(lifted(vec![0, 3, 3, 0, 0], 9), vec![1, 1, 2, 1, 1]);
        // Exactly one each (the boundary): every claim gets its one.
        assert_eq!(lifted(vec![3, 0, 0], 3), vec![1, 1, 1]);
        // Not enough for one each, or a cap of 0: unchanged.
        assert_eq!(lifted(vec![2, 0, 0], 5), vec![2, 0, 0]);
        assert_eq!(lifted(vec![0, 0], 0), vec![0, 0]);
        assert_eq!(lifted(vec![], 1), Vec::<u64>::new());
    }

    #[test]
    fn huge_weights_do_not_overflow() {
        let m = u32::MAX;
        let out = fill(m, &[(m, m), (m, 7), (1, m), (m, m)]);
        assert_eq!(out[1], 7);
        assert_eq!(out.iter().sum::<u64>(), u64::from(m));
    }
}
