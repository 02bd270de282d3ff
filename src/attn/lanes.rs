//! The lane-explicit vector arithmetic of the CPU attention walk.
//!
//! Every function here fixes its lanes (eight `f32` accumulators per row, summed pairwise in
//! one order, multiply then add without FMA) so that a result does not depend on the CPU, the
//! grouping of rows or the code path: the portable forms, compiled for the build's baseline
//! target and again inside the walk's AVX2 copy, and [`Avx2`]'s hand-written [`Dot4`] all
//! round identically (bit for bit; a NaN stays a NaN, its payload bits unspecified). The hand-written form exists because LLVM vectorises the portable
//! [`dot4`] across its four rows (one lane of each row per register, with shuffles) instead of
//! along them, about four times the instructions of the loop below.

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
            acc[i] += x[i] * y[i];
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
            a0[i] += c0[i] * kc[i];
            a1[i] += c1[i] * kc[i];
            a2[i] += c2[i] * kc[i];
            a3[i] += c3[i] * kc[i];
        }
    }
    [hsum(a0), hsum(a1), hsum(a2), hsum(a3)]
}

/// `acc4[r] += p[r] * v` for four rows of `v.len()` elements, sharing each load of `v`.
#[inline(always)]
pub(super) fn axpy4(acc4: &mut [f32], p: [f32; 4], v: &[f32]) {
    let d = v.len();
    let (a0, rest) = acc4.split_at_mut(d);
    let (a1, rest) = rest.split_at_mut(d);
    let (a2, a3) = rest.split_at_mut(d);
    let (a1, a2, a3) = (&mut a1[..d], &mut a2[..d], &mut a3[..d]);
    for i in 0..d {
        let x = v[i];
        a0[i] += p[0] * x;
        a1[i] += p[1] * x;
        a2[i] += p[2] * x;
        a3[i] += p[3] * x;
    }
}

#[inline(always)]
pub(super) fn axpy(acc: &mut [f32], p: f32, v: &[f32]) {
    let acc = &mut acc[..v.len()];
    for i in 0..v.len() {
        acc[i] += p * v[i];
    }
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
/// with AVX2, by [`Avx2`]; both give bit-identical results.
pub(super) trait Dot4: Copy {
    /// As [`dot4`]: `q4` holds four rows of `k.len()` elements (a multiple of 8).
    fn dot4(self, q4: &[f32], k: &[f32]) -> [f32; 4];
}

/// The portable [`dot4`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Portable;

impl Dot4 for Portable {
    #[inline(always)]
    fn dot4(self, q4: &[f32], k: &[f32]) -> [f32; 4] {
        dot4(q4, k)
    }
}

/// Proof that the CPU supports AVX2: only [`Avx2::detect`] makes one.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(super) struct Avx2(());

#[cfg(target_arch = "x86_64")]
impl Avx2 {
    /// `Some` when the CPU running this supports AVX2.
    pub(super) fn detect() -> Option<Self> {
        std::is_x86_feature_detected!("avx2").then_some(Avx2(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl Dot4 for Avx2 {
    #[inline(always)]
    fn dot4(self, q4: &[f32], k: &[f32]) -> [f32; 4] {
        // SAFETY: `self` exists, so `Avx2::detect` found AVX2 on this CPU, which is all
        // `dot4_avx2` requires.
        unsafe { dot4_avx2(q4, k) }
    }
}

/// [`dot4`] on 256-bit registers: row `r`'s eight lanes are one register, `lane += q * k`
/// (a multiply, then an add: the portable arithmetic, lane for lane), summed by [`hsum`].
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot4_avx2(q4: &[f32], k: &[f32]) -> [f32; 4] {
    use std::arch::x86_64::{_mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps};
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
            *a = _mm256_add_ps(*a, _mm256_mul_ps(qv, kv));
        }
    }
    acc.map(|a| {
        let mut l = [0f32; 8];
        // SAFETY: `l` is valid for writing 8 floats; the store has no alignment requirement.
        unsafe { _mm256_storeu_ps(l.as_mut_ptr(), a) };
        hsum(l)
    })
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
            if let Some(avx2) = Avx2::detect() {
                let fast = avx2.dot4(q4, k);
                prop_assert_eq!(fast.map(bits), portable.map(bits));
            }
        }
    }
}
