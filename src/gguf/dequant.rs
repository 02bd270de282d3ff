//! Dequantization to f32 (and f16/bf16), bit-exact with ggml's reference dequantizers.
//!
//! Each format has one block kernel that follows `dequantize_row_*` in ggml-quants.c (and
//! gguf-py's `gguf.quants`, our test oracle): the same element order, and the same f32
//! operations in the same order, one rounding per operation (Rust never contracts `a * b + c`
//! into a fused multiply-add), so results match bit for bit.
//!
//! Large tensors are split into chunks of whole blocks converted in parallel on rayon's pool;
//! the split never changes a result, since every block is independent.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::parse::TensorInfo;
use super::types::GgmlType;
use super::GgufError;

/// Elements per parallel work item (a multiple of every block size used here).
const CHUNK_ELEMS: usize = 1 << 14;
/// Below this many elements the conversion runs on the calling thread.
const PARALLEL_MIN_ELEMS: usize = 1 << 17;

/// The non-linear table of IQ4_NL (ggml's `kvalues_iq4nl`).
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];
/// e2m1 values, doubled (ggml's `kvalues_mxfp4`); the scale is halved to match.
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// ggml's `ggml_e8m0_to_fp32_half`: 2^(e - 128) as f32 bits, denormal for e < 2.
#[inline(always)]
fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = d * (qs[j] & 0x0F) as f32 + m;
        y[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = ((u32::from(qs[j] & 0x0F) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = ((u32::from(qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (u32::from(qs[j] & 0x0F) | h0) as f32 + m;
        y[j + 16] = d * (u32::from(qs[j] >> 4) | h1) as f32 + m;
    }
}

fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
        *yj = (q as i8) as f32 * d;
    }
}

/// Q2_K: scales[16] (4-bit scale | 4-bit min), qs[64] (2-bit), d, dmin.
fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    // Element (half h, shift s, l) is flat index h*128 + s*32 + l; its group of 16 shares
    // scales[flat / 16].
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let flat = h * 128 + s * 32 + l;
                let sc = scales[flat / 16];
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                let q = (qs[h * 32 + l] >> (2 * s)) & 3;
                y[flat] = dl * q as f32 - ml;
            }
        }
    }
}

/// Q3_K: hmask[32], qs[64], scales[12] (16 packed 6-bit), d.
fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    let mut dl = [0f32; 16];
    for (i, dli) in dl.iter_mut().enumerate() {
        let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let high = (sc[8 + (i % 4)] >> (2 * (i / 4))) & 3;
        let scale = (low | (high << 4)) as i8 - 32;
        *dli = d * scale as f32;
    }
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let flat = h * 128 + s * 32 + l;
                let ql = ((qs[h * 32 + l] >> (2 * s)) & 3) as i8;
                // The high bit subtracts 4 when it is clear (ggml stores it inverted).
                let hb = (hmask[l] >> (flat / 32)) & 1;
                let q = ql - (((hb ^ 1) << 2) as i8);
                y[flat] = dl[flat / 16] * q as f32;
            }
        }
    }
}

/// The 8 (scale, min) pairs of Q4_K/Q5_K, 6 bits each, packed in 12 bytes.
#[inline(always)]
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// Q4_K: d, dmin, scales[12], qs[128].
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qs = &b[16..144];
    for c in 0..4 {
        for h in 0..2 {
            let j = c * 2 + h;
            let d1 = d * sc[j] as f32;
            let m1 = dmin * mn[j] as f32;
            for l in 0..32 {
                let q = (qs[c * 32 + l] >> (4 * h)) & 0x0F;
                y[j * 32 + l] = d1 * q as f32 - m1;
            }
        }
    }
}

/// Q5_K: d, dmin, scales[12], qh[32], qs[128].
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        for h in 0..2 {
            let j = c * 2 + h;
            let d1 = d * sc[j] as f32;
            let m1 = dmin * mn[j] as f32;
            for l in 0..32 {
                let q = ((qs[c * 32 + l] >> (4 * h)) & 0x0F) | (((qh[l] >> j) & 1) << 4);
                y[j * 32 + l] = d1 * q as f32 - m1;
            }
        }
    }
}

/// Q6_K: ql[128], qh[64], scales[16] (i8), d.
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    for a in 0..2 {
        for (s, chunk) in y[a * 128..a * 128 + 128].chunks_exact_mut(32).enumerate() {
            for (l, yl) in chunk.iter_mut().enumerate() {
                let m = (s % 2) * 32 + l;
                let low = (ql[a * 64 + m] >> (4 * (s / 2))) & 0x0F;
                let high = (qh[a * 32 + l] >> (2 * s)) & 3;
                let q = (low | (high << 4)) as i8 - 32;
                let flat = a * 128 + s * 32 + l;
                let dl = d * (scales[flat / 16] as i8) as f32;
                *yl = dl * q as f32;
            }
        }
    }
}

fn block_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[usize::from(qs[j] & 0x0F)] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[usize::from(qs[j] >> 4)] as f32;
    }
}

fn block_mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_to_f32_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = d * KVALUES_MXFP4[usize::from(qs[j] & 0x0F)] as f32;
        y[j + 16] = d * KVALUES_MXFP4[usize::from(qs[j] >> 4)] as f32;
    }
}

fn block_f32(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn block_bf16(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
}

/// Converts a run of whole blocks on this thread.
fn run_blocks(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let ts = ty.type_size() as usize;
    let bs = ty.block_size() as usize;
    // Each block kernel is a distinct fn item, so `blocks` is monomorphized and inlined per
    // format.
    #[inline(always)]
    fn blocks<F: Fn(&[u8], &mut [f32])>(src: &[u8], dst: &mut [f32], ts: usize, bs: usize, f: F) {
        for (b, y) in src.chunks_exact(ts).zip(dst.chunks_exact_mut(bs)) {
            f(b, y);
        }
    }
    macro_rules! each {
        ($f:expr) => {
            blocks(src, dst, ts, bs, $f)
        };
    }
    match ty {
        GgmlType::F32 => each!(block_f32),
        GgmlType::F16 => {
            // f16 -> f32 is exact. half's slice conversion uses F16C/NEON when the CPU has
            // them (runtime detection); staging through an aligned [f16] buffer makes the
            // input's alignment irrelevant.
            const N: usize = 1024;
            let mut buf = [f16::ZERO; N];
            for (b, y) in src.chunks(2 * N).zip(dst.chunks_mut(N)) {
                let h = &mut buf[..y.len()];
                for (hi, bi) in h.iter_mut().zip(b.chunks_exact(2)) {
                    *hi = f16::from_le_bytes([bi[0], bi[1]]);
                }
                h.convert_to_f32_slice(y);
            }
        }
        GgmlType::BF16 => each!(block_bf16),
        GgmlType::Q4_0 => each!(block_q4_0),
        GgmlType::Q4_1 => each!(block_q4_1),
        GgmlType::Q5_0 => each!(block_q5_0),
        GgmlType::Q5_1 => each!(block_q5_1),
        GgmlType::Q8_0 => each!(block_q8_0),
        GgmlType::Q2_K => each!(block_q2_k),
        GgmlType::Q3_K => each!(block_q3_k),
        GgmlType::Q4_K => each!(block_q4_k),
        GgmlType::Q5_K => each!(block_q5_k),
        GgmlType::Q6_K => each!(block_q6_k),
        GgmlType::IQ4_NL => each!(block_iq4_nl),
        GgmlType::MXFP4 => each!(block_mxfp4),
        // dequantize_into checked can_dequantize() before calling.
        _ => {}
    }
}

fn check(ty: GgmlType, src: usize, dst: usize) -> Result<(), GgufError> {
    if !ty.can_dequantize() {
        return Err(GgufError::UnsupportedDequant(ty));
    }
    let ts = ty.type_size() as usize;
    let bs = ty.block_size() as usize;
    if src % ts != 0 || (src / ts).checked_mul(bs) != Some(dst) {
        return Err(GgufError::DequantLength {
            ty,
            src_bytes: src,
            dst_elems: dst,
        });
    }
    Ok(())
}

/// Dequantizes `src` (whole blocks of `ty`) into `dst` (as many f32 as the blocks hold),
/// in parallel for large inputs.
pub fn dequantize_into(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), GgufError> {
    check(ty, src.len(), dst.len())?;
    if dst.len() < PARALLEL_MIN_ELEMS {
        run_blocks(ty, src, dst);
    } else {
        let chunk_bytes = CHUNK_ELEMS / ty.block_size() as usize * ty.type_size() as usize;
        dst.par_chunks_mut(CHUNK_ELEMS)
            .zip(src.par_chunks(chunk_bytes))
            .for_each(|(y, b)| run_blocks(ty, b, y));
    }
    Ok(())
}

/// Dequantizes on the calling thread only (the reference the parallel path is tested against).
pub fn dequantize_into_serial(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), GgufError> {
    check(ty, src.len(), dst.len())?;
    run_blocks(ty, src, dst);
    Ok(())
}

/// A narrower float that dequantized values can be rounded to.
trait Narrow: Copy + Send + Sync {
    fn from_f32_slice(dst: &mut [Self], src: &[f32]);
}

/// The one NaN [`dequantize_into_f16`] writes (quiet, positive, no payload).
pub const F16_CANONICAL_NAN: f16 = f16::from_bits(0x7E00);
/// The one NaN [`dequantize_into_bf16`] writes (quiet, positive, no payload).
pub const BF16_CANONICAL_NAN: bf16 = bf16::from_bits(0x7FC0);

// NaNs are canonicalized because IEEE 754 leaves the payload (and sign) of an operation's NaN
// result to the implementation: x86 keeps an operand's, a GPU returns its own canonical NaN. One
// NaN for all makes the narrow outputs a function of the input bits alone, so the device
// dequantizer (kernels/dequant.cu) can be required to match them bit for bit.
impl Narrow for f16 {
    fn from_f32_slice(dst: &mut [Self], src: &[f32]) {
        // half's slice conversion rounds each element exactly as `f16::from_f32` does (round to
        // nearest even, subnormal results rounded, 65520 and up to infinity), down the same
        // paths: the F16C instruction (eight at a time, rounding fixed by its immediate, not
        // MXCSR) where the CPU has it, the AArch64 FP16 one, or the same software conversion.
        // Element by element, `from_f32` is an out-of-line F16C call or a branchy function,
        // and the loop stays scalar. A NaN keeps its sign and payload there; the select below
        // (a compare and a blend, vectorized) makes it canonical.
        // `f16_narrowing_every_f32` (tests/gguf_fixtures.rs) checks all 2^32 inputs. (The
        // lengths are equal, as the conversion asserts: `dequantize_narrow` stages `yc.len()`.)
        dst.convert_from_f32_slice(src);
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = if s.is_nan() { F16_CANONICAL_NAN } else { *d };
        }
    }
}

impl Narrow for bf16 {
    fn from_f32_slice(dst: &mut [Self], src: &[f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            // `bf16::from_f32`'s round to nearest even (ties to the even upper half; the
            // largest finite values round to infinity), as one add and shift instead of its
            // branches, so that the loop vectorizes: the NaN check below then costs a compare
            // and a select per element. A NaN's sum may carry into any bit; the select drops it.
            let x = s.to_bits();
            let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
            *d = bf16::from_bits(if s.is_nan() {
                BF16_CANONICAL_NAN.to_bits()
            } else {
                rounded
            });
        }
    }
}

/// Elements converted per step through the f32 staging buffer of the narrow paths.
const STAGE: usize = 4096;

fn dequantize_narrow<T: Narrow>(ty: GgmlType, src: &[u8], dst: &mut [T]) -> Result<(), GgufError> {
    check(ty, src.len(), dst.len())?;
    let stage_bytes = STAGE / ty.block_size() as usize * ty.type_size() as usize;
    let work = |y: &mut [T], b: &[u8]| {
        let mut buf = [0f32; STAGE];
        for (yc, bc) in y.chunks_mut(STAGE).zip(b.chunks(stage_bytes)) {
            let tmp = &mut buf[..yc.len()];
            run_blocks(ty, bc, tmp);
            T::from_f32_slice(yc, tmp);
        }
    };
    if dst.len() < PARALLEL_MIN_ELEMS {
        work(dst, src);
    } else {
        let chunk_bytes = CHUNK_ELEMS / ty.block_size() as usize * ty.type_size() as usize;
        dst.par_chunks_mut(CHUNK_ELEMS)
            .zip(src.par_chunks(chunk_bytes))
            .for_each(|(y, b)| work(y, b));
    }
    Ok(())
}

/// Dequantizes to f16: each value is [`dequantize_into`]'s f32 result rounded to nearest even
/// (overflow to infinity), and every NaN is [`F16_CANONICAL_NAN`]. The device dequantizer
/// (`kernels/dequant.cu`, `pkv_dequantize`) matches this bit for bit.
pub fn dequantize_into_f16(ty: GgmlType, src: &[u8], dst: &mut [f16]) -> Result<(), GgufError> {
    dequantize_narrow(ty, src, dst)
}

/// Dequantizes to bf16: each value is [`dequantize_into`]'s f32 result rounded to nearest even,
/// and every NaN is [`BF16_CANONICAL_NAN`]. The device dequantizer (`kernels/dequant.cu`,
/// `pkv_dequantize`) matches this bit for bit.
pub fn dequantize_into_bf16(ty: GgmlType, src: &[u8], dst: &mut [bf16]) -> Result<(), GgufError> {
    dequantize_narrow(ty, src, dst)
}

impl<'a> TensorInfo<'a> {
    /// The tensor as f32, innermost dimension first (row-major in ggml's sense).
    pub fn dequantize(&self) -> Result<Vec<f32>, GgufError> {
        if !self.ty().can_dequantize() {
            return Err(GgufError::UnsupportedDequant(self.ty()));
        }
        // n_elements was checked against the bytes present at parse time.
        let mut out = vec![0f32; self.n_elements() as usize];
        dequantize_into(self.ty(), self.data(), &mut out)?;
        Ok(out)
    }
}
