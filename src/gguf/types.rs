//! The ggml tensor type table and the GGUF metadata value types.
//!
//! Type ids, block sizes and bytes per block follow ggml.h's `enum ggml_type` and
//! `ggml_type_traits` (mirrored by gguf-py's `GGML_QUANT_SIZES`). Ids that ggml removed stay
//! reserved here so that a file carrying one is refused by name rather than as "unknown".

use std::fmt;

/// A ggml tensor element type: one entry of ggml's type table.
///
/// Every quantized type stores its elements in blocks of [`block_size`](Self::block_size)
/// elements taking [`type_size`](Self::type_size) bytes; a tensor's innermost dimension must be
/// a multiple of the block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// IEEE 754 binary32.
    F32 = 0,
    /// IEEE 754 binary16.
    F16 = 1,
    /// 32 4-bit weights and an f16 scale.
    Q4_0 = 2,
    /// 32 4-bit weights, an f16 scale and an f16 minimum.
    Q4_1 = 3,
    /// 32 5-bit weights and an f16 scale.
    Q5_0 = 6,
    /// 32 5-bit weights, an f16 scale and an f16 minimum.
    Q5_1 = 7,
    /// 32 8-bit weights and an f16 scale.
    Q8_0 = 8,
    /// 32 8-bit weights, an f32 scale and an f32 sum (an activation format).
    Q8_1 = 9,
    /// k-quant super-block of 256 2-bit weights.
    Q2_K = 10,
    /// k-quant super-block of 256 3-bit weights.
    Q3_K = 11,
    /// k-quant super-block of 256 4-bit weights.
    Q4_K = 12,
    /// k-quant super-block of 256 5-bit weights.
    Q5_K = 13,
    /// k-quant super-block of 256 6-bit weights.
    Q6_K = 14,
    /// k-quant super-block of 256 8-bit weights (an activation format).
    Q8_K = 15,
    /// i-quant, 2.06 bits per weight.
    IQ2_XXS = 16,
    /// i-quant, 2.31 bits per weight.
    IQ2_XS = 17,
    /// i-quant, 3.06 bits per weight.
    IQ3_XXS = 18,
    /// i-quant, 1.56 bits per weight.
    IQ1_S = 19,
    /// 32 4-bit indices into a non-linear table and an f16 scale.
    IQ4_NL = 20,
    /// i-quant, 3.44 bits per weight.
    IQ3_S = 21,
    /// i-quant, 2.5 bits per weight.
    IQ2_S = 22,
    /// i-quant, 4.25 bits per weight.
    IQ4_XS = 23,
    /// 8-bit signed integer.
    I8 = 24,
    /// 16-bit signed integer.
    I16 = 25,
    /// 32-bit signed integer.
    I32 = 26,
    /// 64-bit signed integer.
    I64 = 27,
    /// IEEE 754 binary64.
    F64 = 28,
    /// i-quant, 1.75 bits per weight.
    IQ1_M = 29,
    /// bfloat16.
    BF16 = 30,
    /// ternary, 1.69 bits per weight.
    TQ1_0 = 34,
    /// ternary, 2.06 bits per weight.
    TQ2_0 = 35,
    /// OCP microscaling FP4: 32 e2m1 weights and an e8m0 scale.
    MXFP4 = 39,
    /// NVIDIA FP4: 64 e2m1 weights and four ue4m3 scales.
    NVFP4 = 40,
    /// 128 1-bit weights and an f16 scale.
    Q1_0 = 41,
}

/// What a ggml type id means: a current type, one ggml has removed, or none at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeId {
    /// A type of the current table.
    Known(GgmlType),
    /// A type ggml once had and removed; files using it cannot be read by current ggml.
    Removed(&'static str),
    /// An id ggml never assigned (or assigned after this table was written).
    Unknown,
}

/// Every current type, in id order.
pub const ALL_TYPES: [GgmlType; 34] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ1_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ3_S,
    GgmlType::IQ2_S,
    GgmlType::IQ4_XS,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::IQ1_M,
    GgmlType::BF16,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q1_0,
];

/// Elements per k-quant super-block (ggml's `QK_K`).
pub const QK_K: u32 = 256;

impl GgmlType {
    /// Classifies a type id read from a file.
    pub fn classify(id: u32) -> TypeId {
        match id {
            4 => TypeId::Removed("Q4_2"),
            5 => TypeId::Removed("Q4_3"),
            31 => TypeId::Removed("Q4_0_4_4"),
            32 => TypeId::Removed("Q4_0_4_8"),
            33 => TypeId::Removed("Q4_0_8_8"),
            36 => TypeId::Removed("IQ4_NL_4_4"),
            37 => TypeId::Removed("IQ4_NL_4_8"),
            38 => TypeId::Removed("IQ4_NL_8_8"),
            _ => match ALL_TYPES.iter().find(|t| t.id() == id) {
                Some(&t) => TypeId::Known(t),
                None => TypeId::Unknown,
            },
        }
    }

    /// The type with this id, if it is a current one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        match Self::classify(id) {
            TypeId::Known(t) => Some(t),
            _ => None,
        }
    }

    /// The type whose ggml name is `name` ("Q4_K"), ASCII case-insensitive.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        ALL_TYPES
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// The id stored in files.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// ggml's name for the type ("Q4_K").
    pub const fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
            Q1_0 => "Q1_0",
        }
    }

    /// Elements per block (1 for the plain scalar types).
    pub const fn block_size(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            NVFP4 => 64,
            Q1_0 => 128,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn type_size(self) -> u32 {
        use GgmlType::*;
        let k = QK_K;
        match self {
            F32 => 4,
            F16 => 2,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            // ggml's block_q8_1: two f16 (d, s) and 32 i8; gguf-py's table still says 40 (f32 d, s).
            Q8_1 => 2 + 2 + 32,
            Q2_K => 2 + 2 + k / 16 + k / 4,
            Q3_K => 2 + k / 4 + k / 8 + 12,
            Q4_K => 2 + 2 + k / 2 + 12,
            Q5_K => 2 + 2 + k / 2 + k / 8 + 12,
            Q6_K => 2 + k / 2 + k / 4 + k / 16,
            Q8_K => 4 + k + k / 8,
            IQ2_XXS => 2 + k / 4,
            IQ2_XS => 2 + k / 4 + k / 32,
            IQ3_XXS => 2 + k / 4 + k / 8,
            IQ1_S => 2 + k / 8 + k / 16,
            IQ4_NL => 2 + 16,
            IQ3_S => 2 + k / 4 + k / 8 + k / 32 + 4,
            IQ2_S => 2 + k / 4 + k / 16,
            IQ4_XS => 2 + 2 + k / 2 + k / 64,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 => 8,
            F64 => 8,
            IQ1_M => k / 8 + k / 16 + k / 32,
            BF16 => 2,
            TQ1_0 => 2 + 4 * 13,
            TQ2_0 => 2 + 64,
            MXFP4 => 1 + 16,
            NVFP4 => 4 + 32,
            Q1_0 => 2 + 16,
        }
    }

    /// Whether [`crate::gguf::dequantize_into`] converts this type.
    pub const fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16
                | BF16
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q8_0
                | Q2_K
                | Q3_K
                | Q4_K
                | Q5_K
                | Q6_K
                | IQ4_NL
                | MXFP4
        )
    }

    /// Bytes taken by `n_elements` elements, or `None` when `n_elements` is not a whole number
    /// of blocks or the size overflows `u64`.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = u64::from(self.block_size());
        if n_elements % bs != 0 {
            return None;
        }
        (n_elements / bs).checked_mul(u64::from(self.type_size()))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The type tag of a GGUF metadata value (`gguf_type` in gguf.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    /// `u8`.
    U8 = 0,
    /// `i8`.
    I8 = 1,
    /// `u16`.
    U16 = 2,
    /// `i16`.
    I16 = 3,
    /// `u32`.
    U32 = 4,
    /// `i32`.
    I32 = 5,
    /// `f32`.
    F32 = 6,
    /// One byte, 0 or 1.
    Bool = 7,
    /// Length-prefixed UTF-8.
    String = 8,
    /// Element type, length, elements.
    Array = 9,
    /// `u64`.
    U64 = 10,
    /// `i64`.
    I64 = 11,
    /// `f64`.
    F64 = 12,
}

impl ValueType {
    /// The value type with this id.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The id stored in files.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// Bytes of one value of a fixed-size type; `None` for strings and arrays.
    pub const fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// gguf-py's name for the type ("UINT32").
    pub const fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "UINT8",
            I8 => "INT8",
            U16 => "UINT16",
            I16 => "INT16",
            U32 => "UINT32",
            I32 => "INT32",
            F32 => "FLOAT32",
            Bool => "BOOL",
            String => "STRING",
            Array => "ARRAY",
            U64 => "UINT64",
            I64 => "INT64",
            F64 => "FLOAT64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
