//! Weight block formats: sizes by ggml type id and the reference dequantization of every type
//! the Bonsai files use. This is the bit-level oracle: every optimized or GPU kernel, and every
//! re-tiled layout, is checked against `dequantize_row`.
//!
//! Formats (MODEL.md §1.2), each block in file order:
//! - Q1_0   (41): 128 elems, 18 B: `d: f16, qs: u8[16]`; bit j set → +d else −d.
//! - Q2_0   (42, legacy PrismML): 128 elems, 34 B: `d: f16, qs: u8[32]`; code c → (c−1)·d.
//! - PQ2_0 (142): identical bytes to Q2_0 g128.
//! - Q2_0   (42, upstream ggml): 64 elems, 18 B: `d: f16, qs: u8[16]`; same code mapping.
//! - Q4_0 (2), Q4_1 (3), Q8_0 (8): ggml layouts, 32-element blocks.

use half::{bf16, f16};

/// A tensor storage type with its block geometry resolved. Id 42 is ambiguous in the file and is
/// resolved per file from tensor extents into `Q2_0G128` or `Q2_0G64` before anything reads data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q1_0,
    /// Legacy PrismML Q2_0: id 42, 128-element / 34-byte blocks.
    Q2_0G128,
    /// Upstream ggml Q2_0: id 42, 64-element / 18-byte blocks.
    Q2_0G64,
    /// PrismML PQ2_0: id 142, same bytes as `Q2_0G128`.
    PQ2_0,
}

pub const GGML_TYPE_F32: u32 = 0;
pub const GGML_TYPE_F16: u32 = 1;
pub const GGML_TYPE_Q4_0: u32 = 2;
pub const GGML_TYPE_Q4_1: u32 = 3;
pub const GGML_TYPE_Q8_0: u32 = 8;
pub const GGML_TYPE_BF16: u32 = 30;
pub const GGML_TYPE_Q1_0: u32 = 41;
pub const GGML_TYPE_Q2_0: u32 = 42;
pub const GGML_TYPE_PQ2_0: u32 = 142;
/// Ternary-Bonsai-2's base-3 packed type. Not supported; recognised to refuse Bonsai 2 files.
pub const GGML_TYPE_PTQ1_0: u32 = 143;

impl QuantType {
    /// The type for an unambiguous ggml id. Id 42 returns `None`: it needs the extent test.
    pub fn from_ggml_unambiguous(id: u32) -> Option<QuantType> {
        Some(match id {
            GGML_TYPE_F32 => QuantType::F32,
            GGML_TYPE_F16 => QuantType::F16,
            GGML_TYPE_BF16 => QuantType::BF16,
            GGML_TYPE_Q4_0 => QuantType::Q4_0,
            GGML_TYPE_Q4_1 => QuantType::Q4_1,
            GGML_TYPE_Q8_0 => QuantType::Q8_0,
            GGML_TYPE_Q1_0 => QuantType::Q1_0,
            GGML_TYPE_PQ2_0 => QuantType::PQ2_0,
            _ => return None,
        })
    }

    pub fn ggml_id(self) -> u32 {
        match self {
            QuantType::F32 => GGML_TYPE_F32,
            QuantType::F16 => GGML_TYPE_F16,
            QuantType::BF16 => GGML_TYPE_BF16,
            QuantType::Q4_0 => GGML_TYPE_Q4_0,
            QuantType::Q4_1 => GGML_TYPE_Q4_1,
            QuantType::Q8_0 => GGML_TYPE_Q8_0,
            QuantType::Q1_0 => GGML_TYPE_Q1_0,
            QuantType::Q2_0G128 | QuantType::Q2_0G64 => GGML_TYPE_Q2_0,
            QuantType::PQ2_0 => GGML_TYPE_PQ2_0,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 => 32,
            QuantType::Q1_0 | QuantType::Q2_0G128 | QuantType::PQ2_0 => 128,
            QuantType::Q2_0G64 => 64,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q8_0 => 34,
            QuantType::Q1_0 => 18,
            QuantType::Q2_0G128 | QuantType::PQ2_0 => 34,
            QuantType::Q2_0G64 => 18,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "F32",
            QuantType::F16 => "F16",
            QuantType::BF16 => "BF16",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q1_0 => "Q1_0",
            QuantType::Q2_0G128 => "Q2_0(g128)",
            QuantType::Q2_0G64 => "Q2_0(g64)",
            QuantType::PQ2_0 => "PQ2_0",
        }
    }

    /// True for the 2-bit ternary code formats (all three Q2 variants).
    pub fn is_q2(self) -> bool {
        matches!(
            self,
            QuantType::Q2_0G128 | QuantType::Q2_0G64 | QuantType::PQ2_0
        )
    }

    /// True for the low-bit weight formats the target's matrices may use.
    pub fn is_lowbit(self) -> bool {
        self == QuantType::Q1_0 || self.is_q2()
    }

    /// Bytes of a row of `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if n % self.block_elems() != 0 {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantize `out.len()` elements (a whole number of blocks) from `src` (exactly
/// `row_bytes(out.len())` bytes). Panics on a length mismatch: callers pass validated extents.
pub fn dequantize_row(qt: QuantType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    let need = qt
        .row_bytes(n)
        .expect("dequantize_row: length is not a whole number of blocks");
    assert_eq!(
        src.len(),
        need,
        "dequantize_row: {} bytes for {} {} elements",
        src.len(),
        n,
        qt.name()
    );
    let be = qt.block_elems();
    let bb = qt.block_bytes();
    match qt {
        QuantType::F32 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f32::from_le_bytes([
                    src[4 * i],
                    src[4 * i + 1],
                    src[4 * i + 2],
                    src[4 * i + 3],
                ]);
            }
        }
        QuantType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(src, 2 * i);
            }
        }
        QuantType::BF16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32();
            }
        }
        _ => {
            for (blk, ob) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                dequantize_block(qt, blk, ob);
            }
        }
    }
}

/// Dequantize one block of a blocked type.
pub fn dequantize_block(qt: QuantType, b: &[u8], o: &mut [f32]) {
    match qt {
        QuantType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                o[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
                o[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        QuantType::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qs = &b[4..20];
            for j in 0..16 {
                o[j] = (qs[j] & 0xF) as f32 * d + m;
                o[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        QuantType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                o[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        QuantType::Q1_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..128 {
                let bit = (qs[j >> 3] >> (j & 7)) & 1;
                o[j] = if bit != 0 { d } else { -d };
            }
        }
        QuantType::Q2_0G128 | QuantType::PQ2_0 | QuantType::Q2_0G64 => {
            let d = f16_at(b, 0);
            let n = qt.block_elems();
            let qs = &b[2..2 + n / 4];
            for j in 0..n {
                let c = (qs[j >> 2] >> (2 * (j & 3))) & 3;
                o[j] = (c as i32 - 1) as f32 * d;
            }
        }
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => {
            dequantize_row(qt, b, o);
        }
    }
}

/// True when any Q2 code in `src` is 3 (+2d). Ternary-only kernels may be used only when false.
pub fn q2_has_code3(qt: QuantType, src: &[u8]) -> bool {
    assert!(qt.is_q2());
    let bb = qt.block_bytes();
    src.chunks_exact(bb).any(|blk| {
        blk[2..].iter().any(|&q| {
            // A code 3 is a bit pair 0b11: both bits set in any of the four 2-bit lanes.
            (q & (q >> 1) & 0x55) != 0
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn q1_0_hand_block() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16b(0.5));
        b[2] = 0b0000_0101; // elems 0 and 2 set
        b[17] = 0x80; // elem 127 set
        let mut o = vec![0f32; 128];
        dequantize_row(QuantType::Q1_0, &b, &mut o);
        assert_eq!(o[0], 0.5);
        assert_eq!(o[1], -0.5);
        assert_eq!(o[2], 0.5);
        assert_eq!(o[126], -0.5);
        assert_eq!(o[127], 0.5);
    }

    #[test]
    fn q2_0_both_layouts_hand_block() {
        for qt in [QuantType::Q2_0G128, QuantType::Q2_0G64, QuantType::PQ2_0] {
            let n = qt.block_elems();
            let mut b = vec![0u8; qt.block_bytes()];
            b[0..2].copy_from_slice(&f16b(2.0));
            // element 0: code 0 (−d), 1: code 1 (0), 2: code 2 (+d), 3: code 3 (+2d)
            b[2] = 0b11_10_01_00;
            // last element: code 2
            b[2 + n / 4 - 1] = 0b10_01_01_01;
            let mut o = vec![0f32; n];
            dequantize_row(qt, &b, &mut o);
            assert_eq!(&o[0..4], &[-2.0, 0.0, 2.0, 4.0]);
            assert_eq!(o[n - 1], 2.0);
            assert_eq!(o[n - 2], 0.0);
            assert!(q2_has_code3(qt, &b));
            b[2] = 0b10_10_01_00;
            assert!(!q2_has_code3(qt, &b));
        }
    }

    #[test]
    fn q4_1_layout_is_d_m_qs_low_then_high() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16b(0.25));
        b[2..4].copy_from_slice(&f16b(-1.0));
        b[4] = 0x3A; // elem 0 = 0xA, elem 16 = 0x3
        let mut o = vec![0f32; 32];
        dequantize_row(QuantType::Q4_1, &b, &mut o);
        assert_eq!(o[0], 10.0 * 0.25 - 1.0);
        assert_eq!(o[16], 3.0 * 0.25 - 1.0);
        assert_eq!(o[1], -1.0);
    }

    #[test]
    fn q4_0_and_q8_0_hand_blocks() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16b(1.0));
        b[2] = 0x0F; // elem 0 = 15-8 = 7, elem 16 = 0-8 = -8
        let mut o = vec![0f32; 32];
        dequantize_row(QuantType::Q4_0, &b, &mut o);
        assert_eq!(o[0], 7.0);
        assert_eq!(o[16], -8.0);
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16b(0.5));
        b[2] = (-3i8) as u8;
        b[33] = 127;
        dequantize_row(QuantType::Q8_0, &b, &mut o);
        assert_eq!(o[0], -1.5);
        assert_eq!(o[31], 63.5);
    }

    #[test]
    fn float_types() {
        let src: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let mut o = vec![0f32; 2];
        dequantize_row(QuantType::F32, &src, &mut o);
        assert_eq!(o, vec![1.5, -2.0]);
        let src: Vec<u8> = [f16b(1.5), f16b(-2.0)].concat();
        dequantize_row(QuantType::F16, &src, &mut o);
        assert_eq!(o, vec![1.5, -2.0]);
        let src: Vec<u8> = [0x3FC0u16, 0xC000]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        dequantize_row(QuantType::BF16, &src, &mut o);
        assert_eq!(o, vec![1.5, -2.0]);
    }

    #[test]
    fn sizes() {
        assert_eq!(QuantType::Q1_0.row_bytes(5120), Some(40 * 18));
        assert_eq!(QuantType::Q2_0G128.row_bytes(5120), Some(40 * 34));
        assert_eq!(QuantType::Q2_0G64.row_bytes(5120), Some(80 * 18));
        assert_eq!(QuantType::Q1_0.row_bytes(100), None);
    }
}
