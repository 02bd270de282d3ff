//! Element types of the KV cache and the conversions the kernels use.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::fmt;

/// The element type of a KV cache (and of the query, key, value and output tensors of the
/// kernels that use it). All accumulation and softmax arithmetic is done in `f32` whatever the
/// storage type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE-754 binary32.
    F32,
    /// IEEE-754 binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`): the top 16 bits of an `f32`.
    Bf16,
}

impl KvDtype {
    /// Bytes of one element.
    #[inline]
    pub const fn size_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// A short lowercase name (`"f32"`, `"f16"`, `"bf16"`), as the CLI and logs spell it.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A Rust type that can be stored in a KV cache: `f32`, `half::f16` or `half::bf16`.
///
/// Sealed: the kernels and [`HostKvCache`](super::HostKvCache) rely on every implementor being
/// plain old data (no padding, no invalid bit patterns, alignment at most 4) so that an aligned
/// byte buffer can be viewed as a slice of it.
pub trait KvElem:
    Copy + Send + Sync + Default + PartialEq + fmt::Debug + 'static + sealed::Sealed
{
    /// The runtime tag of this type.
    const DTYPE: KvDtype;

    /// Widens one element to `f32` (exact for every type).
    fn to_f32(self) -> f32;

    /// Narrows an `f32` with round-to-nearest-even (exact for `f32`).
    fn from_f32(x: f32) -> Self;

    /// Widens `src` into `dst` elementwise (hardware conversion where the CPU has it).
    /// `src` and `dst` must have the same length (callers in this crate guarantee it; a mismatch
    /// is a bug and panics).
    fn widen_slice(src: &[Self], dst: &mut [f32]);

    /// Narrows `src` into `dst` elementwise (round-to-nearest-even). Same length rule as
    /// [`widen_slice`](Self::widen_slice).
    fn narrow_slice(src: &[f32], dst: &mut [Self]);

    /// `Some(slice)` when `Self` is `f32`, so the kernels can skip the widening copy.
    fn as_f32_slice(s: &[Self]) -> Option<&[f32]>;
}

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline]
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn as_f32_slice(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    #[inline]
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    #[inline(always)]
    fn as_f32_slice(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl KvElem for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn widen_slice(src: &[Self], dst: &mut [f32]) {
        // bf16 -> f32 is a 16-bit left shift of the bits: a loop the compiler vectorises
        // (half's slice conversion goes element by element for bf16).
        assert_eq!(src.len(), dst.len());
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline]
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    #[inline(always)]
    fn as_f32_slice(_: &[Self]) -> Option<&[f32]> {
        None
    }
}
