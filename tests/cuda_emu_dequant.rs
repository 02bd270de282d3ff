//! The device dequantizer (kernels/dequant.cu, `pkv_dequantize`) on the CPU emulation (feature
//! `cuda-emu`, see kernels/emu/emu.h) against the CPU dequantizer: for every supported source
//! type (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q6_K) and both outputs (f16, bf16), the kernel's
//! bits must equal `dequantize_into_f16` / `dequantize_into_bf16`'s, NaNs included (both write
//! the canonical NaN).
//!
//! Inputs: random blocks whose scale fields are drawn from random f16 bits and from a list of
//! extremes (infinities, NaNs of both signs and kinds, the largest finite value, the smallest
//! subnormal, signed zeros); F32 / F16 / BF16 values with rounding ties, the f16 overflow edge
//! and f16 subnormals; sizes of 1 block up to several thousand, element counts of the plain
//! types that are multiples of nothing (a lane's 8 outputs cut short at the tensor's end), and
//! sizes above one launch's worth of warps (the grid-stride loop, with the emulated device set
//! to one SM). Buffers are guarded: a read or write past either tensor aborts with the
//! offending thread. The launcher's refusals (type, dtype, size, alignment, null) are checked
//! too.
#![cfg(all(feature = "cuda-emu", not(feature = "cuda")))]

use half::{bf16, f16};
use pagedkv::cuda_emu::{self, ffi, EmuBuf, Schedule};
use pagedkv::gguf::{dequantize_into_bf16, dequantize_into_f16, GgmlType};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use std::ffi::c_void;

const OK: i32 = ffi::PKV_OK as i32;

/// The types the device converts, with their ggml ids as pagedkv.h names them.
const TYPES: [(GgmlType, u32); 7] = [
    (GgmlType::F32, ffi::PKV_GGML_F32),
    (GgmlType::F16, ffi::PKV_GGML_F16),
    (GgmlType::BF16, ffi::PKV_GGML_BF16),
    (GgmlType::Q4_0, ffi::PKV_GGML_Q4_0),
    (GgmlType::Q8_0, ffi::PKV_GGML_Q8_0),
    (GgmlType::Q4_K, ffi::PKV_GGML_Q4_K),
    (GgmlType::Q6_K, ffi::PKV_GGML_Q6_K),
];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Out {
    F16,
    Bf16,
}

impl Out {
    fn dtype(self) -> i32 {
        match self {
            Out::F16 => ffi::PKV_DTYPE_F16 as i32,
            Out::Bf16 => ffi::PKV_DTYPE_BF16 as i32,
        }
    }
}

/// f16 bit patterns that stress a scale: infinities, quiet and signalling NaNs of both signs,
/// the extremes of the finite range, subnormals, signed zeros, one.
const EXTREME_F16: [u16; 14] = [
    0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0xFD55, 0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x0000,
    0x8000, 0x3C00,
];

/// f32 values whose rounding to f16 or bf16 is delicate.
fn extreme_f32() -> Vec<u32> {
    let mut v = vec![
        0x7F80_0000, // inf
        0xFF80_0000,
        0x7FC0_0000, // NaN
        0x7F80_0001, // signalling NaN
        0xFFC1_2345, // negative NaN with payload
        0x0000_0000,
        0x8000_0000,
        0x0000_0001, // smallest f32 subnormal
        0x7F7F_FFFF, // f32 max: bf16 rounds it up to inf
        0x3F80_8000, // bf16 tie, even below: stays
        0x3F81_8000, // bf16 tie, odd below: rounds up
        0x3F80_8001, // just above a bf16 tie
        0x477F_EFFF, // just below f16's overflow threshold (65520)
        0x477F_F000, // 65520: f16 rounds to inf
        0x3380_0000, // 2^-24: f16's smallest subnormal
        0x3300_0000, // 2^-25: a tie between 0 and the smallest subnormal (rounds to 0)
        0x3300_0001, // just above: rounds to the smallest subnormal
        0x3880_0000, // 2^-14: f16's smallest normal
        0x387F_E000, // f16's largest subnormal boundary
        0x3F80_1000, // f16 tie, even below
        0x3F80_3000, // f16 tie, odd below
    ];
    let more: Vec<u32> = v.iter().map(|b| b ^ 0x8000_0000).collect();
    v.extend(more);
    v
}

/// `blocks` random blocks of `ty`; each f16 scale field is random bits or, one time in three,
/// an extreme; plain types mix random bits with delicate values.
fn random_tensor(rng: &mut SmallRng, ty: GgmlType, n: usize) -> Vec<u8> {
    let bytes = ty.bytes_for(n as u64).expect("whole blocks") as usize;
    let mut b = vec![0u8; bytes];
    rng.fill_bytes(&mut b);
    let ts = ty.type_size() as usize;
    let scale = |rng: &mut SmallRng, at: &mut [u8]| {
        if rng.gen_range(0..3) == 0 {
            let v = EXTREME_F16[rng.gen_range(0..EXTREME_F16.len())];
            at.copy_from_slice(&v.to_le_bytes());
        }
    };
    let extremes = extreme_f32();
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 => {
            for blk in b.chunks_exact_mut(ts) {
                scale(rng, &mut blk[0..2]);
            }
        }
        GgmlType::Q4_K => {
            for blk in b.chunks_exact_mut(ts) {
                scale(rng, &mut blk[0..2]);
                scale(rng, &mut blk[2..4]);
            }
        }
        GgmlType::Q6_K => {
            for blk in b.chunks_exact_mut(ts) {
                scale(rng, &mut blk[208..210]);
            }
        }
        GgmlType::F32 => {
            for x in b.chunks_exact_mut(4) {
                if rng.gen_range(0..4) == 0 {
                    let v = extremes[rng.gen_range(0..extremes.len())];
                    x.copy_from_slice(&v.to_le_bytes());
                } else if rng.gen_range(0..2) == 0 {
                    // An ordinary value: random bits give mostly huge or tiny magnitudes.
                    let v: f32 = rng.gen_range(-70_000.0..70_000.0);
                    x.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for x in b.chunks_exact_mut(2) {
                if rng.gen_range(0..5) == 0 {
                    let v = EXTREME_F16[rng.gen_range(0..EXTREME_F16.len())];
                    // In bf16 these bits are other delicate values (NaNs, huge, subnormal).
                    x.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        _ => unreachable!("not a device type"),
    }
    b
}

/// The CPU dequantizer's bits.
fn oracle(ty: GgmlType, src: &[u8], n: usize, out: Out) -> Vec<u16> {
    match out {
        Out::F16 => {
            let mut v = vec![f16::ZERO; n];
            dequantize_into_f16(ty, src, &mut v).expect("cpu f16");
            v.iter().map(|x| x.to_bits()).collect()
        }
        Out::Bf16 => {
            let mut v = vec![bf16::ZERO; n];
            dequantize_into_bf16(ty, src, &mut v).expect("cpu bf16");
            v.iter().map(|x| x.to_bits()).collect()
        }
    }
}

/// Runs the kernel on `src` (n elements of `id`) into a poisoned guarded buffer.
fn device(id: u32, src: &[u8], n: usize, out: Out) -> Vec<u16> {
    let s = EmuBuf::from_slice(src).expect("guarded allocation");
    let mut d = EmuBuf::zeroed(2 * n).expect("guarded allocation");
    d.as_mut_slice::<u8>().fill(0xA5);
    // SAFETY: both are live guarded allocations of the documented sizes (src holds the n
    // elements' blocks, dst n 2-byte elements), 16-byte aligned, not overlapping; the emulated
    // launch is synchronous, so nothing reads them after the call.
    let st = unsafe {
        ffi::pkv_dequantize(
            d.ptr(),
            out.dtype(),
            s.ptr() as *const c_void,
            id as i32,
            n as i64,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(
        st,
        OK,
        "status {st} ({}); last fault {:?}",
        cuda_emu::status_string(st),
        cuda_emu::last_fault()
    );
    d.as_slice::<u8>()[..2 * n]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect()
}

fn check(ty: GgmlType, id: u32, src: &[u8], n: usize, out: Out, what: &str) {
    let want = oracle(ty, src, n, out);
    let got = device(id, src, n, out);
    if let Some(i) = (0..n).find(|&i| got[i] != want[i]) {
        let bs = ty.block_size() as usize;
        let ts = ty.type_size() as usize;
        let blk = &src[(i / bs) * ts..(i / bs + 1) * ts];
        panic!(
            "{ty} -> {out:?}, {what}, n = {n}: element {i} is {:#06x}, the CPU gives {:#06x} \
             (block {}: {blk:02x?})",
            got[i],
            want[i],
            i / bs
        );
    }
}

/// Element counts for `ty`: whole blocks, small and odd, around a warp's 256-output tile.
fn sizes(ty: GgmlType) -> Vec<usize> {
    let bs = ty.block_size() as usize;
    if bs == 1 {
        vec![1, 7, 8, 9, 255, 256, 257, 1001, 2048 + 24, 4099]
    } else {
        [1, 2, 3, 7, 8, 9, 31, 33]
            .iter()
            .map(|b| b * bs)
            .chain([256 * 40 + bs])
            .collect()
    }
}

#[test]
fn every_type_matches_the_cpu_bit_for_bit() {
    let mut rng = SmallRng::seed_from_u64(0xde9);
    for (ty, id) in TYPES {
        for n in sizes(ty) {
            for out in [Out::F16, Out::Bf16] {
                for rep in 0..3 {
                    let src = random_tensor(&mut rng, ty, n);
                    check(ty, id, &src, n, out, &format!("random #{rep}"));
                }
            }
        }
    }
}

#[test]
fn every_scale_extreme_in_every_position() {
    // Each block type with each extreme f16 in each scale field, the rest random: every
    // element of the block goes through the extreme scale.
    let mut rng = SmallRng::seed_from_u64(11);
    let fields: [(GgmlType, u32, &[usize]); 4] = [
        (GgmlType::Q8_0, ffi::PKV_GGML_Q8_0, &[0]),
        (GgmlType::Q4_0, ffi::PKV_GGML_Q4_0, &[0]),
        (GgmlType::Q4_K, ffi::PKV_GGML_Q4_K, &[0, 2]),
        (GgmlType::Q6_K, ffi::PKV_GGML_Q6_K, &[208]),
    ];
    for (ty, id, offsets) in fields {
        let n = ty.block_size() as usize * 8;
        let ts = ty.type_size() as usize;
        for &at in offsets {
            for x in EXTREME_F16 {
                let mut src = vec![0u8; ty.bytes_for(n as u64).expect("size") as usize];
                rng.fill_bytes(&mut src);
                for blk in src.chunks_exact_mut(ts) {
                    blk[at..at + 2].copy_from_slice(&x.to_le_bytes());
                }
                for out in [Out::F16, Out::Bf16] {
                    check(
                        ty,
                        id,
                        &src,
                        n,
                        out,
                        &format!("scale {x:#06x} at byte {at}"),
                    );
                }
            }
        }
    }
}

#[test]
fn plain_types_cover_every_delicate_value() {
    // Every delicate f32 (and its f16/bf16 bit twins) at every lane position.
    let ex = extreme_f32();
    let src: Vec<u8> = ex
        .iter()
        .cycle()
        .take(ex.len() * 9)
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let n = src.len() / 4;
    for out in [Out::F16, Out::Bf16] {
        check(
            GgmlType::F32,
            ffi::PKV_GGML_F32,
            &src,
            n,
            out,
            "delicate f32",
        );
    }
    let h: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
    for out in [Out::F16, Out::Bf16] {
        check(
            GgmlType::F16,
            ffi::PKV_GGML_F16,
            &h,
            1 << 16,
            out,
            "every f16",
        );
        check(
            GgmlType::BF16,
            ffi::PKV_GGML_BF16,
            &h,
            1 << 16,
            out,
            "every bf16",
        );
    }
}

#[test]
fn results_do_not_depend_on_thread_order_or_the_grid() {
    // One emulated SM: 8 thread blocks, so these sizes take several trips of the grid-stride
    // loop; reverse and random fiber orders.
    cuda_emu::set_sm_count(1);
    let mut rng = SmallRng::seed_from_u64(5);
    for (k, schedule) in [Schedule::Reverse, Schedule::Random(3), Schedule::Forward]
        .into_iter()
        .enumerate()
    {
        cuda_emu::set_schedule(schedule);
        for (ty, id) in TYPES {
            let n = if ty.block_size() == 1 {
                256 * 8 * 8 * 3 + 13
            } else {
                256 * 8 * 8 * 2 + ty.block_size() as usize
            };
            let src = random_tensor(&mut rng, ty, n);
            let out = if k % 2 == 0 { Out::Bf16 } else { Out::F16 };
            check(ty, id, &src, n, out, &format!("{schedule:?}, one SM"));
        }
    }
    let stats = cuda_emu::take_stats();
    // 3 schedules x 7 types, each one launch of at most 8 blocks.
    assert_eq!(stats.launches, 21);
    assert!(stats.blocks <= 21 * 8, "{} blocks", stats.blocks);
    cuda_emu::set_schedule(Schedule::Forward);
    cuda_emu::set_sm_count(132);
}

#[test]
fn the_launcher_refuses_what_it_cannot_do() {
    let src = EmuBuf::zeroed(4096).expect("alloc");
    let dst = EmuBuf::zeroed(4096).expect("alloc");
    let call = |dst: *mut c_void, dtype: u32, src: *const c_void, ty: u32, n: i64| {
        // SAFETY: every call either is refused before touching memory or converts at most 256
        // elements between the two 4 KiB guarded buffers (offset by at most 2 bytes, still
        // inside them); the emulated launch is synchronous.
        unsafe { ffi::pkv_dequantize(dst, dtype as i32, src, ty as i32, n, std::ptr::null_mut()) }
    };
    let (d, s) = (dst.ptr(), src.ptr() as *const c_void);
    let bf = ffi::PKV_DTYPE_BF16;
    let dtype_err = ffi::PKV_ERR_DTYPE as i32;
    let arg_err = ffi::PKV_ERR_INVALID_ARG as i32;
    // Unsupported ggml types (Q5_K, IQ4_NL, an unknown id) and output dtypes (f32, unknown).
    for ty in [13u32, 20, 99] {
        assert_eq!(call(d, bf, s, ty, 256), dtype_err, "type {ty}");
        // SAFETY: reads a constant; no preconditions.
        assert_eq!(unsafe { ffi::pkv_dequant_supported(ty as i32) }, 0);
    }
    for (_, id) in TYPES {
        // SAFETY: as above.
        assert_eq!(unsafe { ffi::pkv_dequant_supported(id as i32) }, 1);
    }
    assert_eq!(
        call(d, ffi::PKV_DTYPE_F32, s, ffi::PKV_GGML_Q8_0, 32),
        dtype_err
    );
    assert_eq!(call(d, 7, s, ffi::PKV_GGML_Q8_0, 32), dtype_err);
    // Sizes: negative, not a whole number of blocks.
    assert_eq!(call(d, bf, s, ffi::PKV_GGML_Q8_0, -32), arg_err);
    assert_eq!(call(d, bf, s, ffi::PKV_GGML_Q8_0, 48), arg_err);
    assert_eq!(call(d, bf, s, ffi::PKV_GGML_Q4_K, 32), arg_err);
    // Alignment of either pointer.
    // SAFETY: offsets inside the 4 KiB allocations.
    let (d2, s2) = unsafe { (d.cast::<u8>().add(2).cast(), s.cast::<u8>().add(2).cast()) };
    assert_eq!(call(d2, bf, s, ffi::PKV_GGML_F16, 64), arg_err);
    assert_eq!(call(d, bf, s2, ffi::PKV_GGML_F16, 64), arg_err);
    // Null pointers, and nothing to do.
    let null = std::ptr::null_mut::<c_void>();
    assert_eq!(
        call(null, bf, s, ffi::PKV_GGML_F16, 64),
        ffi::PKV_ERR_NULL_POINTER as i32
    );
    assert_eq!(
        call(d, bf, null, ffi::PKV_GGML_F16, 64),
        ffi::PKV_ERR_NULL_POINTER as i32
    );
    let _ = cuda_emu::take_stats();
    assert_eq!(call(null, bf, null, ffi::PKV_GGML_Q4_K, 0), OK);
    assert_eq!(
        cuda_emu::take_stats().launches,
        0,
        "nothing refused or empty launched"
    );
    assert_eq!(call(d, bf, s, ffi::PKV_GGML_Q4_K, 256), OK);
    assert_eq!(cuda_emu::take_stats().launches, 1);
}
