//! Fuzz the dequantizers on arbitrary bytes: `dequantize_into` (parallel above 2^17 elements),
//! `dequantize_into_serial`, `dequantize_into_f16` and `dequantize_into_bf16`, every type, any
//! source and destination length. Checks: accepted exactly when the type can be dequantized and
//! the source is whole blocks that fill the destination exactly, else a typed error with the
//! destination untouched; the parallel result equals the serial one bit for bit; the narrow
//! results are the serial f32 rounded, with every NaN the canonical one; and for the plain and
//! legacy block types (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) the serial result is bit
//! for bit ggml's formula, written out here from the format's layout (the checks above all
//! share the library's block decoders, so a wrong decoder passed them all).
#![no_main]

use arbitrary::Arbitrary;
use half::{bf16, f16};
use libfuzzer_sys::fuzz_target;
use pagedkv::gguf::{
    dequantize_into, dequantize_into_bf16, dequantize_into_f16, dequantize_into_serial, GgmlType,
    ALL_TYPES, BF16_CANONICAL_NAN, F16_CANONICAL_NAN,
};

/// ggml's dequantization of one block of the simple types (ggml-quants.c), `None` for others.
fn reference(ty: GgmlType, b: &[u8]) -> Option<Vec<f32>> {
    let h = |i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    // Quant `j` of 32 from 16 bytes of nibbles: low nibbles are elements 0..16, high 16..32.
    let nib = |qs: &[u8], j: usize| u32::from(if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 });
    let qh = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    Some(match ty {
        GgmlType::F32 => vec![f32::from_le_bytes([b[0], b[1], b[2], b[3]])],
        GgmlType::F16 => vec![h(0)],
        GgmlType::BF16 => vec![f32::from_bits(
            u32::from(u16::from_le_bytes([b[0], b[1]])) << 16,
        )],
        GgmlType::Q8_0 => (0..32).map(|j| f32::from(b[2 + j] as i8) * h(0)).collect(),
        GgmlType::Q4_0 => (0..32)
            .map(|j| (nib(&b[2..18], j) as i32 - 8) as f32 * h(0))
            .collect(),
        GgmlType::Q4_1 => (0..32)
            .map(|j| h(0) * nib(&b[4..20], j) as f32 + h(2))
            .collect(),
        // The fifth bit of quant `j` is bit `j` of the 32-bit `qh`.
        GgmlType::Q5_0 => (0..32)
            .map(|j| {
                let q = nib(&b[6..22], j) | ((qh(2) >> j) & 1) << 4;
                (q as i32 - 16) as f32 * h(0)
            })
            .collect(),
        GgmlType::Q5_1 => (0..32)
            .map(|j| {
                let q = nib(&b[8..24], j) | ((qh(4) >> j) & 1) << 4;
                h(0) * q as f32 + h(2)
            })
            .collect(),
        _ => return None,
    })
}

#[derive(Debug, Arbitrary)]
struct Input {
    ty: u8,
    src_delta: i8,
    dst_delta: i8,
    big: u8,
    bytes: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let ty = ALL_TYPES[usize::from(input.ty) % ALL_TYPES.len()];
    let (ts, bs) = (ty.type_size() as usize, ty.block_size() as usize);
    // Whole blocks of the input's bytes (repeated to pass the parallel threshold if `big`),
    // then nudged off by a few bytes or elements.
    // Past the parallel threshold (2^17 elements) rarely: it is slow under ASan.
    let blocks = if input.big == 0xFF {
        (1usize << 17) / bs + 3
    } else {
        input.bytes.len() / ts.max(1)
    };
    let mut src: Vec<u8> = if input.bytes.is_empty() {
        vec![0; blocks * ts]
    } else {
        input
            .bytes
            .iter()
            .copied()
            .cycle()
            .take(blocks * ts)
            .collect()
    };
    if input.src_delta % 4 != 0 {
        let d = (input.src_delta % 4) as isize;
        let n = (src.len() as isize + d).max(0) as usize;
        src.resize(n, 0xA5);
    }
    let dst_len =
        ((src.len() / ts.max(1) * bs) as isize + (input.dst_delta % 3) as isize).max(0) as usize;
    let ok = ty.can_dequantize() && src.len() % ts == 0 && src.len() / ts * bs == dst_len;

    let sentinel = f32::from_bits(0x7F80_1234);
    let mut par = vec![sentinel; dst_len];
    let mut ser = vec![sentinel; dst_len];
    let mut h = vec![f16::from_bits(0x1234); dst_len];
    let mut b = vec![bf16::from_bits(0x1234); dst_len];
    let r = [
        dequantize_into(ty, &src, &mut par).is_ok(),
        dequantize_into_serial(ty, &src, &mut ser).is_ok(),
        dequantize_into_f16(ty, &src, &mut h).is_ok(),
        dequantize_into_bf16(ty, &src, &mut b).is_ok(),
    ];
    assert_eq!(r, [ok; 4], "{ty:?}: {} bytes into {dst_len}", src.len());
    if !ok {
        assert!(
            par.iter()
                .chain(&ser)
                .all(|x| x.to_bits() == sentinel.to_bits()),
            "dst written on error"
        );
        assert!(h.iter().all(|x| x.to_bits() == 0x1234) && b.iter().all(|x| x.to_bits() == 0x1234));
        return;
    }
    for (k, block) in src.chunks_exact(ts).enumerate() {
        let Some(want) = reference(ty, block) else {
            break;
        };
        for (j, w) in want.iter().enumerate() {
            let got = ser[k * bs + j];
            assert!(
                got.to_bits() == w.to_bits() || (got.is_nan() && w.is_nan()),
                "{ty:?} block {k} element {j}: {got} vs ggml's {w}"
            );
        }
    }
    for i in 0..dst_len {
        assert_eq!(
            par[i].to_bits(),
            ser[i].to_bits(),
            "{ty:?} element {i}: parallel vs serial"
        );
        let want_h = if ser[i].is_nan() {
            F16_CANONICAL_NAN
        } else {
            f16::from_f32(ser[i])
        };
        let want_b = if ser[i].is_nan() {
            BF16_CANONICAL_NAN
        } else {
            bf16::from_f32(ser[i])
        };
        assert_eq!(h[i].to_bits(), want_h.to_bits(), "{ty:?} element {i}: f16");
        assert_eq!(b[i].to_bits(), want_b.to_bits(), "{ty:?} element {i}: bf16");
    }
});
