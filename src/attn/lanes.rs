//! The lane-explicit vector arithmetic of the CPU attention walk.
//!
//! Every function here fixes its lanes (eight `f32` accumulators per row, summed pairwise in
//! one order, each step a fused multiply-add, one rounding) so that a result does not depend on
//! the CPU, the grouping of rows or keys, or the code path: the portable forms, compiled for the
//! build's baseline target (where `mul_add` is the C library's correctly rounded `fma`, slow
//! but exact) and again inside the walk's AVX2 + FMA copy, and [`Avx2Fma`]'s hand-written
//! [`Dot4`] all round identically (bit for bit; a NaN stays a NaN, its payload bits
//! unspecified). The hand-written forms exist because LLVM vectorises the portable [`dot4`]
//! across its four rows (one lane of each row per register, with shuffles) instead of along
//! them, about four times the instructions of the loop below.
//!
//! The walk's three steps per block of keys each keep several independent sums in flight,
//! since one chain of dependent adds or fused multiply-adds waits four cycles a step:
//! [`dot4x2`] (four query rows by two keys, eight sums), [`weighted`] (up to four rows' output
//! sums in registers across the block's keys, instead of a load and a store of each per key),
//! [`max`] and [`exp_sum`] (eight lanes).

use crate::kv::KvElem;

/// `s[r..r+8]` as an array (`r + 8 <= s.len()`), so that lane loops compile to vector code.
#[inline(always)]
fn lanes(s: &[f32], r: usize) -> &[f32; 8] {
    s[r..r + 8].try_into().unwrap_or(&[0.0; 8])
}

/// Pairwise sum of eight lanes, in a fixed order shared by [`dot`] and [`dot4`].
#[inline(always)]
fn hsum(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// 8-lane dot product (`head_dim` is a multiple of 8): the lanes are explicit, so the compiler
/// keeps them in vector registers without reassociating a single accumulator.
#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let d = b.len();
    let a = &a[..d];
    let mut acc = [0f32; 8];
    for c in (0..d).step_by(8) {
        let (x, y) = (lanes(a, c), lanes(b, c));
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    hsum(acc)
}

/// Four dot products of `q4` (four rows of `k.len()` elements) with `k`, sharing each load
/// of `k`. Lane-for-lane the same arithmetic as [`dot`], so results do not depend on grouping.
#[inline(always)]
pub(super) fn dot4(q4: &[f32], k: &[f32]) -> [f32; 4] {
    let d = k.len();
    let (q0, rest) = q4.split_at(d);
    let (q1, rest) = rest.split_at(d);
    let (q2, q3) = rest.split_at(d);
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
    for c in (0..d).step_by(8) {
        let kc = lanes(k, c);
        let (c0, c1, c2, c3) = (lanes(q0, c), lanes(q1, c), lanes(q2, c), lanes(q3, c));
        for i in 0..8 {
            a0[i] = c0[i].mul_add(kc[i], a0[i]);
            a1[i] = c1[i].mul_add(kc[i], a1[i]);
            a2[i] = c2[i].mul_add(kc[i], a2[i]);
            a3[i] = c3[i].mul_add(kc[i], a3[i]);
        }
    }
    [hsum(a0), hsum(a1), hsum(a2), hsum(a3)]
}

/// Dot products of four rows `q4` with two keys `k0`, `k1` (`[key][row]`): eight independent
/// accumulators, twice what [`dot4`] keeps in flight, each rounding exactly as [`dot`].
#[inline(always)]
pub(super) fn dot4x2(q4: &[f32], k0: &[f32], k1: &[f32]) -> [[f32; 4]; 2] {
    let d = k0.len();
    let k1 = &k1[..d];
    let mut acc = [[[0f32; 8]; 4]; 2];
    for c in (0..d).step_by(8) {
        let ks = [lanes(k0, c), lanes(k1, c)];
        for r in 0..4 {
            let q = lanes(&q4[r * d..(r + 1) * d], c);
            for (a, k) in acc.iter_mut().zip(ks) {
                for i in 0..8 {
                    a[r][i] = q[i].mul_add(k[i], a[r][i]);
                }
            }
        }
    }
    acc.map(|a| a.map(hsum))
}

/// `acc[r] += sum over t < n of p[r * p_stride + t] * v[t]` for `R` rows (`acc`: `R` rows of
/// `d`), key by key in order: row `r`'s arithmetic is exactly [`axpy`] with each key's weight
/// in turn, but the sums stay in registers across the keys (one load and store of each per
/// block of keys instead of per key). Value row `t` starts at `v[t * v_stride]`.
#[inline(always)]
pub(super) fn weighted<const R: usize>(
    acc: &mut [f32],
    p: &[f32],
    p_stride: usize,
    n: usize,
    v: &[f32],
    v_stride: usize,
) {
    let d = acc.len() / R;
    if n == 0 {
        return;
    }
    // Once here, so that the loops below index without checks of their own.
    assert!(
        (R - 1) * p_stride + n <= p.len() && (n - 1) * v_stride + d <= v.len(),
        "weighted: weights or value rows out of range"
    );
    let mut c = 0;
    while c + 16 <= d {
        weighted_lanes::<R, 16>(&mut acc[..R * d], d, c, p, p_stride, n, v, v_stride);
        c += 16;
    }
    if c < d {
        weighted_lanes::<R, 8>(&mut acc[..R * d], d, c, p, p_stride, n, v, v_stride);
    }
}

/// Elements `c..c + W` of [`weighted`]'s rows (whose bounds it checked): `R x W` sums in
/// registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weighted_lanes<const R: usize, const W: usize>(
    acc: &mut [f32],
    d: usize,
    c: usize,
    p: &[f32],
    p_stride: usize,
    n: usize,
    v: &[f32],
    v_stride: usize,
) {
    let mut a = [[0f32; W]; R];
    for (r, ar) in a.iter_mut().enumerate() {
        ar.copy_from_slice(&acc[r * d + c..r * d + c + W]);
    }
    for t in 0..n {
        let vt: &[f32; W] = v[t * v_stride + c..][..W].try_into().unwrap_or(&[0.0; W]);
        for (r, ar) in a.iter_mut().enumerate() {
            let w = p[r * p_stride + t];
            for i in 0..W {
                ar[i] = w.mul_add(vt[i], ar[i]);
            }
        }
    }
    for (r, ar) in a.iter().enumerate() {
        acc[r * d + c..r * d + c + W].copy_from_slice(ar);
    }
}

#[inline(always)]
pub(super) fn axpy(acc: &mut [f32], p: f32, v: &[f32]) {
    let acc = &mut acc[..v.len()];
    for i in 0..v.len() {
        acc[i] = p.mul_add(v[i], acc[i]);
    }
}

/// The largest of `s`, NaNs skipped (as `f32::max`); `-inf` when `s` is empty or all NaN.
/// Eight independent lanes reduced as a tree instead of one fold, whose compare-and-blend
/// steps form a chain (about eight cycles an element, as much as a row's dot product). Each
/// step is `if x > m { x } else { m }`: one `maxps`, and a NaN `x` never wins. A max is exact,
/// so the order changes nothing but the sign of a zero result, which the walk cannot see (it
/// only compares the max and subtracts it).
#[inline(always)]
pub(super) fn max(s: &[f32]) -> f32 {
    #[inline(always)]
    fn gt(m: f32, x: f32) -> f32 {
        if x > m {
            x
        } else {
            m
        }
    }
    let mut m = [f32::NEG_INFINITY; 8];
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            m[i] = gt(m[i], c[i]);
        }
    }
    let h = [
        gt(m[0], m[4]),
        gt(m[1], m[5]),
        gt(m[2], m[6]),
        gt(m[3], m[7]),
    ];
    let top = gt(gt(h[0], h[2]), gt(h[1], h[3]));
    chunks.remainder().iter().fold(top, |m, &x| gt(m, x))
}

/// `e^x` in single precision, within 1 ulp of the correctly rounded value (checked against
/// `f64` in the tests, and at every float at review) wherever the result is a normal float;
/// 0 below `ln(f32::MIN_POSITIVE)` (no subnormal results: a softmax weight that small is
/// nothing beside the row's 1), `+inf` above `ln(f32::MAX)`, NaN for NaN. Every step is one
/// correctly rounded operation (fused multiply-adds, a round-to-even, exponent bits), so a
/// lane computes the same bits in any build and in [`exp_sum`]'s eight lanes as here; unlike a
/// call of the C library's `expf`, the loop over a row vectorises.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    // e^x = 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2: ln 2 in two parts, so that
    // `x - n * ln 2` keeps its low bits (n has at most 8 significant bits).
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Taylor coefficients 1/k! for k = 7 down to 2: the first omitted term is below
    // (ln 2 / 2)^8 / 8! ~ 5e-9 relative, a tenth of an ulp. (Stopping at k = 6 left
    // (ln 2 / 2)^7 / 7! ~ 1.6e-7 relative at e^r ~ 0.7, two ulp there before any rounding:
    // 3 ulp off at x = -0.3436421 and about 4,000 other floats of the walk's range.)
    const C: [f32; 6] = [
        1.0 / 5040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
    ];
    let xc = x.clamp(-87.5, 88.75);
    let n = (xc * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = C[0];
    for c in &C[1..] {
        p = p.mul_add(r, *c);
    }
    let p = p.mul_add(r, 1.0).mul_add(r, 1.0);
    // 2^n from its exponent bits, n in -126..=128 where the result is kept: 2^128 is not a
    // float, so n = 128 (x near ln(f32::MAX), e^r < 1) scales by 2^127 and then by 2, exactly.
    // (The clamps keep the bits in range in the lanes the selects below replace.)
    let top = n.min(127.0);
    // `top + 127` is an integer in 1..=254 (the clamp; a NaN `n` gives `top` 127), exact in
    // f32; adding 2^23 puts it in the low mantissa bits (a plain float add, where a
    // saturating `as` cast costs compares and blends in every lane).
    let biased = (top + 127.0 + 8_388_608.0).to_bits() & 0xff;
    let scale = f32::from_bits(biased << 23);
    let y = p * scale * if n > top { 2.0 } else { 1.0 };
    if x < -87.336_54 {
        0.0
    } else if x > 88.722_84 {
        f32::INFINITY
    } else {
        y
    }
}

/// `s[i] = exp(s[i] - m)` for every element, and their sum. Element `i` is key position
/// `first + i`; the sum keeps eight partial sums, key `p` in lane `p % 8`, added pairwise at the
/// end: so the sum of a row's weights does not depend on which masked keys (weight 0, which
/// add nothing to a lane) a walk's span includes around its visible ones, that is, on the
/// tiling, the thread count or the batch.
#[inline(always)]
pub(super) fn exp_sum(s: &mut [f32], m: f32, first: usize) -> f32 {
    for x in s.iter_mut() {
        *x = exp(*x - m);
    }
    let mut acc = [0f32; 8];
    // Up to the first key whose position is a multiple of 8, one by one; then whole lanes.
    let head = ((8 - first % 8) % 8).min(s.len());
    let (h, rest) = s.split_at(head);
    for (k, x) in h.iter().enumerate() {
        acc[(first + k) % 8] += x;
    }
    let mut chunks = rest.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    for (i, x) in chunks.remainder().iter().enumerate() {
        acc[i] += x;
    }
    hsum(acc)
}

/// Widens `src` into `buf` unless it already is `f32`.
#[inline(always)]
pub(super) fn widen<'b, T: KvElem>(src: &'b [T], buf: &'b mut [f32]) -> &'b [f32] {
    match T::as_f32_slice(src) {
        Some(s) => s,
        None => {
            T::widen_slice(src, &mut buf[..src.len()]);
            &buf[..src.len()]
        }
    }
}

/// Four dot products sharing each load of the key row: the one operation of the walk whose
/// portable form LLVM does not vectorise well. Implemented by [`Portable`] and, on x86_64 CPUs
/// with AVX2 and FMA, by [`Avx2Fma`]; both give bit-identical results.
pub(super) trait Dot4: Copy {
    /// As [`dot4`]: `q4` holds four rows of `k.len()` elements (a multiple of 8).
    fn dot4(self, q4: &[f32], k: &[f32]) -> [f32; 4];
    /// As [`dot4x2`]: `q4` holds four rows of `k0.len()` elements (a multiple of 8).
    fn dot4x2(self, q4: &[f32], k0: &[f32], k1: &[f32]) -> [[f32; 4]; 2];
}

/// The portable [`dot4`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Portable;

impl Dot4 for Portable {
    #[inline(always)]
    fn dot4(self, q4: &[f32], k: &[f32]) -> [f32; 4] {
        dot4(q4, k)
    }
    #[inline(always)]
    fn dot4x2(self, q4: &[f32], k0: &[f32], k1: &[f32]) -> [[f32; 4]; 2] {
        dot4x2(q4, k0, k1)
    }
}

/// Proof that the CPU supports AVX2 and FMA: only [`Avx2Fma::detect`] makes one.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(super) struct Avx2Fma(());

#[cfg(target_arch = "x86_64")]
impl Avx2Fma {
    /// `Some` when the CPU running this supports AVX2 and FMA.
    pub(super) fn detect() -> Option<Self> {
        (std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
            .then_some(Avx2Fma(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl Dot4 for Avx2Fma {
    #[inline(always)]
    fn dot4(self, q4: &[f32], k: &[f32]) -> [f32; 4] {
        // SAFETY: `self` exists, so `Avx2Fma::detect` found AVX2 and FMA on this CPU, which is
        // all `dot4_avx2` requires.
        unsafe { dot4_avx2(q4, k) }
    }
    #[inline(always)]
    fn dot4x2(self, q4: &[f32], k0: &[f32], k1: &[f32]) -> [[f32; 4]; 2] {
        // SAFETY: as in `dot4`: `dot4x2_avx2` requires AVX2 and FMA, which `Avx2Fma::detect`
        // found before making `self`.
        unsafe { dot4x2_avx2(q4, k0, k1) }
    }
}

/// [`dot4`] on 256-bit registers: row `r`'s eight lanes are one register, `lane = fma(q, k,
/// lane)` (the portable arithmetic, lane for lane), summed by [`hsum`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot4_avx2(q4: &[f32], k: &[f32]) -> [f32; 4] {
    use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_loadu_ps};
    use std::arch::x86_64::{_mm256_setzero_ps, _mm256_storeu_ps};
    let d = k.len();
    let (q0, rest) = q4.split_at(d);
    let (q1, rest) = rest.split_at(d);
    let (q2, q3) = rest.split_at(d);
    let mut acc = [_mm256_setzero_ps(); 4];
    for c in (0..d).step_by(8) {
        // `lanes` checks `c + 8 <= len` of each row (`d` is a multiple of 8, so it never
        // falls back to its zeros).
        let (kc, rows) = (
            lanes(k, c),
            [lanes(q0, c), lanes(q1, c), lanes(q2, c), lanes(q3, c)],
        );
        // SAFETY: each pointer comes from a `&[f32; 8]`, valid for reading 8 floats; the
        // unaligned load has no alignment requirement.
        let kv = unsafe { _mm256_loadu_ps(kc.as_ptr()) };
        for (a, q) in acc.iter_mut().zip(rows) {
            // SAFETY: as above.
            let qv = unsafe { _mm256_loadu_ps(q.as_ptr()) };
            *a = _mm256_fmadd_ps(qv, kv, *a);
        }
    }
    // A loop, not a `map` closure (see `dot4x2_avx2`).
    let mut sums = [0f32; 4];
    for (x, a) in sums.iter_mut().zip(acc) {
        let mut l = [0f32; 8];
        // SAFETY: `l` is valid for writing 8 floats; the store has no alignment requirement.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), a) };
        *x = hsum(l);
    }
    sums
}

/// [`dot4x2`] on 256-bit registers: eight accumulators (row x key), `lane = fma(q, k, lane)`,
/// each summed by [`hsum`], as the portable form lane for lane.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot4x2_avx2(q4: &[f32], k0: &[f32], k1: &[f32]) -> [[f32; 4]; 2] {
    use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_loadu_ps};
    use std::arch::x86_64::{_mm256_setzero_ps, _mm256_storeu_ps};
    let d = k0.len();
    let k1 = &k1[..d];
    let (q0, rest) = q4.split_at(d);
    let (q1, rest) = rest.split_at(d);
    let (q2, q3) = rest.split_at(d);
    let mut acc = [[_mm256_setzero_ps(); 4]; 2];
    for c in (0..d).step_by(8) {
        // `lanes` checks `c + 8 <= len` of each row, as in `dot4_avx2`.
        let ks = [lanes(k0, c), lanes(k1, c)];
        let rows = [lanes(q0, c), lanes(q1, c), lanes(q2, c), lanes(q3, c)];
        // SAFETY: each pointer comes from a `&[f32; 8]`, valid for reading 8 floats; the
        // unaligned load has no alignment requirement.
        let kv = unsafe {
            [
                _mm256_loadu_ps(ks[0].as_ptr()),
                _mm256_loadu_ps(ks[1].as_ptr()),
            ]
        };
        for (r, q) in rows.into_iter().enumerate() {
            // SAFETY: as above.
            let qv = unsafe { _mm256_loadu_ps(q.as_ptr()) };
            for (a, k) in acc.iter_mut().zip(kv) {
                a[r] = _mm256_fmadd_ps(qv, k, a[r]);
            }
        }
    }
    // Loops, not `map` closures: a closure does not inherit `target_feature`, and one taking a
    // 256-bit register was compiled as an out-of-line call passing it through memory (half
    // of the walk's time in a profile).
    let mut sums = [[0f32; 4]; 2];
    for (s, a) in sums.iter_mut().zip(acc) {
        for (x, v) in s.iter_mut().zip(a) {
            let mut l = [0f32; 8];
            // SAFETY: `l` is valid for writing 8 floats; the store has no alignment
            // requirement.
            unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
            *x = hsum(l);
        }
    }
    sums
}

/// Asks the CPU to start loading `s` into its caches (every 64-byte line of it), for a row the
/// walk reads a few rows later: the walk jumps between blocks that can lie anywhere, and a
/// jump is where the hardware prefetcher loses the stream. A hint only; no-op off x86_64.
#[inline(always)]
pub(super) fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(s);
        let p = s.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults nor changes memory, and SSE (all
            // `_mm_prefetch` needs) is part of every x86_64 CPU; `off < bytes`, so the address
            // stays inside `s`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The bits of `x`, with every NaN as one: which input NaN's payload a product carries
    /// depends on operand order, which neither Rust nor the hardware fixes.
    fn bits(x: f32) -> u32 {
        if x.is_nan() {
            f32::NAN.to_bits()
        } else {
            x.to_bits()
        }
    }

    /// Any bit pattern, NaN, infinities and subnormals included: the forms must agree on all.
    fn any_f32() -> impl Strategy<Value = f32> {
        prop_oneof![
            4 => -4.0f32..4.0,
            1 => any::<u32>().prop_map(f32::from_bits),
            1 => Just(f32::INFINITY),
            1 => Just(f32::MIN_POSITIVE / 3.0),
        ]
    }

    #[test]
    fn exp_edges() {
        assert_eq!(
            exp(0.0).to_bits(),
            1f32.to_bits(),
            "a row's max key weighs exactly 1"
        );
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-87.34), 0.0, "no subnormal results");
        assert!(exp(-87.33) > 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(88.73), f32::INFINITY);
        let top = exp(88.72);
        assert!(top.is_finite() && top > 3.3e38, "{top}");
        assert!(exp(f32::NAN).is_nan());
        // Every 4099th float of the finite range, both signs: within 1 ulp of f64 where the
        // result is normal, else as documented.
        for bits in (0..0x7f80_0000u32).step_by(4099) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                let want = (x as f64).exp();
                let got = exp(x);
                if want < f32::MIN_POSITIVE as f64 {
                    assert!(
                        got == 0.0 || (got as f64 - want).abs() <= 1.5e-45,
                        "exp({x}) = {got}"
                    );
                } else if want > f32::MAX as f64 {
                    assert_eq!(got, f32::INFINITY, "exp({x})");
                } else {
                    let ulps = (got.to_bits() as i64 - (want as f32).to_bits() as i64).abs();
                    assert!(ulps <= 1, "exp({x}) = {got}, want {want} ({ulps} ulp)");
                }
            }
        }
    }

    /// Every float of two ranges where `e^r` is near its smallest (`r` near `-ln 2 / 2`),
    /// where a polynomial one degree short is two ulp off before any rounding: within one
    /// ulp of the correctly rounded value. (A degree-6 polynomial gave `exp(-0.3436421)` 3
    /// ulp off, and about 4,000 other floats of `-87.34..0`; with degree 7 every float of
    /// `-87.34..=88.7228` is within 1 ulp, checked exhaustively at review.)
    #[test]
    fn exp_is_within_one_ulp_where_e_to_the_r_is_smallest() {
        let mut worst = (0, 0f32);
        for (lo, hi) in [(-0.3466f32, -0.34), (-1.7333f32, -1.7313)] {
            let mut x = lo;
            while x <= hi {
                let want = (x as f64).exp() as f32;
                let ulps = (exp(x).to_bits() as i64 - want.to_bits() as i64).abs();
                if ulps > worst.0 {
                    worst = (ulps, x);
                }
                x = f32::from_bits(x.to_bits() - 1); // the next float towards 0
            }
        }
        let (ulps, x) = worst;
        assert!(
            ulps <= 1,
            "exp({x:e}) is {ulps} ulp off (the worst of the ranges)"
        );
    }

    proptest! {
        #[test]
        fn the_hand_written_dot4_rounds_as_the_portable_one(
            eighths in 1usize..=33,
            data in proptest::collection::vec(any_f32(), 5 * 33 * 8),
        ) {
            let d = 8 * eighths;
            let (k, q4) = (&data[..d], &data[d..5 * d]);
            let portable = Portable.dot4(q4, k);
            for (r, p) in portable.iter().enumerate() {
                prop_assert_eq!(bits(*p), bits(dot(&q4[r * d..(r + 1) * d], k)));
            }
            #[cfg(target_arch = "x86_64")]
            if let Some(avx2) = Avx2Fma::detect() {
                let fast = avx2.dot4(q4, k);
                prop_assert_eq!(fast.map(bits), portable.map(bits));
            }
        }

        #[test]
        fn four_rows_by_two_keys_round_as_one_dot_each(
            eighths in 1usize..=33,
            data in proptest::collection::vec(any_f32(), 6 * 33 * 8),
        ) {
            let d = 8 * eighths;
            let (k0, k1, q4) = (&data[..d], &data[d..2 * d], &data[2 * d..6 * d]);
            let portable = Portable.dot4x2(q4, k0, k1);
            for (k, dots) in [k0, k1].into_iter().zip(portable) {
                for (r, x) in dots.into_iter().enumerate() {
                    prop_assert_eq!(bits(x), bits(dot(&q4[r * d..(r + 1) * d], k)));
                }
            }
            #[cfg(target_arch = "x86_64")]
            if let Some(avx2) = Avx2Fma::detect() {
                let fast = avx2.dot4x2(q4, k0, k1);
                prop_assert_eq!(fast.map(|x| x.map(bits)), portable.map(|x| x.map(bits)));
            }
        }

        /// `exp` against the correctly rounded `f64` result: within 1 ulp wherever that is a
        /// normal float; the edges as documented.
        #[test]
        fn exp_is_within_one_ulp(x in -87.33f32..88.72) {
            let want = (x as f64).exp() as f32;
            let got = exp(x);
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            prop_assert!(ulps <= 1, "exp({x}) = {got}, want {want} ({ulps} ulp)");
        }

        /// `weighted` keeps its sums in registers across keys; each row must still round as
        /// `axpy` key after key. (Zero weights are the walk's key-by-key path, not this one.)
        #[test]
        fn weighted_rows_round_as_one_axpy_per_key(
            rows in 1usize..=4,
            eighths in 1usize..=20,
            keys in 1usize..=17,
            gap in 0usize..=16,
            data in proptest::collection::vec(any_f32(), 4 * 160 + 4 * 17 + 17 * 176),
        ) {
            let d = 8 * eighths;
            let stride = d + gap;
            let (acc0, rest) = data.split_at(4 * 160);
            let (w, v) = rest.split_at(4 * 17);
            let w: Vec<f32> = w.iter().map(|&x| if x == 0.0 { 1.5 } else { x }).collect();
            let mut expect = acc0[..rows * d].to_vec();
            for r in 0..rows {
                for t in 0..keys {
                    let (x, vt) = (w[r * 17 + t], &v[t * stride..t * stride + d]);
                    axpy(&mut expect[r * d..(r + 1) * d], x, vt);
                }
            }
            let mut got = acc0[..rows * d].to_vec();
            match rows {
                4 => weighted::<4>(&mut got, &w, 17, keys, v, stride),
                3 => weighted::<3>(&mut got, &w, 17, keys, v, stride),
                2 => weighted::<2>(&mut got, &w, 17, keys, v, stride),
                _ => weighted::<1>(&mut got, &w, 17, keys, v, stride),
            }
            let (got, expect): (Vec<u32>, Vec<u32>) =
                (got.into_iter().map(bits).collect(), expect.into_iter().map(bits).collect());
            prop_assert_eq!(got, expect);
        }
    }
}
