//! Load-time re-tiling of GGUF weight matrices into the planes the CUDA kernels read.
//!
//! A low-bit matrix `[n_in, n_out]` becomes a **code plane** `[n_out, nblk, CB]` bytes (CB = 16 for
//! Q1_0 and Q2_0 g64, 32 for Q2_0 g128 / PQ2_0; every block starts on a 16-byte boundary so a lane
//! reads it with one or two `uint4` loads) and a **scale plane** `[n_out, nblk]` f16 bits.
//!
//! - Q1_0 codes are re-ordered inside every 32-element (4-byte) word: bit `i` of byte `b` holds
//!   element `4i + b` (GGUF: bit `j & 7` of byte `j >> 3`). Then `(word >> i) & 0x01010101` is the
//!   0/1 pattern of four consecutive elements, one per byte, ready for `dp4a`.
//! - Q2 codes are re-ordered inside every 16-element (4-byte) word: 2-bit field `s` of byte `i`
//!   holds element `4s + i` of the word (GGUF: field `j & 3` of byte `j >> 2`). Then
//!   `(word >> 2s) & 0x03030303` is four consecutive codes, one per byte, ready for `dp4a`.
//!
//! - Q4_1 ([`retile_q41`], the DSpark drafter's matrices; [`WKind::from_qt`] never picks it, so the
//!   target keeps dequantizing Q4_1 to f32): the 16 code bytes of every 32-element block are kept in
//!   GGUF order (element `j` in the low nibble and element `j + 16` in the high nibble of byte `j`),
//!   so `w & 0x0F0F0F0F` and `(w >> 4) & 0x0F0F0F0F` are four consecutive codes each, ready for
//!   `dp4a` against natural-order int8 activations. The scale plane holds `(d, m)` f16 pairs
//!   `[n_out, nblk, 2]`.
//!
//! Other types (F32, F16, BF16, Q4_x, Q8_0) are dequantized to an f32 plane `[n_out, n_in]`.
//! [`detile_row`] inverts the tiling on the host; tests check it bit-exactly against
//! `bonsai_kernels_cpu::quant::dequantize_row`.

use bonsai_kernels_cpu::quant::dequantize_row;
use bonsai_kernels_cpu::QuantType;
use half::f16;
use rayon::prelude::*;

/// How the kernels see a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WKind {
    /// Dequantized f32 plane.
    F32 = 0,
    Q1 = 1,
    /// Q2_0 group 128 (legacy id 42) and PQ2_0 (id 142).
    Q2 = 2,
    /// Q2_0 group 64 (upstream id 42).
    Q2G64 = 3,
    /// Q4_1 (32-element blocks, `w = d·q + m`), only from [`retile_q41`].
    Q41 = 4,
}

impl WKind {
    pub fn from_qt(qt: QuantType) -> WKind {
        match qt {
            QuantType::Q1_0 => WKind::Q1,
            QuantType::Q2_0G128 | QuantType::PQ2_0 => WKind::Q2,
            QuantType::Q2_0G64 => WKind::Q2G64,
            _ => WKind::F32,
        }
    }
    /// Elements per block (1 for f32).
    pub fn block_elems(self) -> usize {
        match self {
            WKind::F32 => 1,
            WKind::Q1 | WKind::Q2 => 128,
            WKind::Q2G64 => 64,
            WKind::Q41 => 32,
        }
    }
    /// Code bytes per block in the code plane.
    pub fn code_bytes(self) -> usize {
        match self {
            WKind::F32 => 4,
            WKind::Q1 | WKind::Q2G64 | WKind::Q41 => 16,
            WKind::Q2 => 32,
        }
    }
}

/// A re-tiled matrix on the host, ready for upload.
pub struct Retiled {
    pub kind: WKind,
    pub n_in: usize,
    pub n_out: usize,
    /// codes: [n_out, nblk, code_bytes] (low-bit kinds; empty for F32)
    pub codes: Vec<u8>,
    /// scales: [n_out, nblk] f16 bits (low-bit kinds), [n_out, nblk, 2] `(d, m)` for Q41; empty for
    /// F32
    pub scales: Vec<u16>,
    /// f32: [n_out, n_in] (F32 kind; empty otherwise)
    pub f32data: Vec<f32>,
}

/// Q2 word re-order: 4 GGUF bytes (16 codes, element j at field j&3 of byte j>>2) to the kernel order
/// (element 4s+i at field s of byte i).
fn q2_word(src: &[u8], dst: &mut [u8]) {
    let mut out = [0u8; 4];
    for j in 0..16 {
        let c = (src[j >> 2] >> (2 * (j & 3))) & 3;
        let (s, i) = (j / 4, j % 4);
        out[i] |= c << (2 * s);
    }
    dst[..4].copy_from_slice(&out);
}

/// Q1 word re-order: 4 GGUF bytes (32 signs, element j at bit j & 7 of byte j >> 3) to the kernel
/// order (element 4i + b at bit i of byte b).
fn q1_word(src: &[u8], dst: &mut [u8]) {
    let mut out = [0u8; 4];
    for j in 0..32 {
        let bit = (src[j >> 3] >> (j & 7)) & 1;
        let (i, b) = (j / 4, j % 4);
        out[b] |= bit << i;
    }
    dst[..4].copy_from_slice(&out);
}

/// Re-tile `raw` (`n_out` GGUF rows of `n_in` elements of type `qt`). Panics if `raw` has the wrong
/// length (the loader validates extents first).
pub fn retile(qt: QuantType, raw: &[u8], n_in: usize, n_out: usize) -> Retiled {
    let rb = qt
        .row_bytes(n_in)
        .expect("n_in is a whole number of blocks");
    assert_eq!(raw.len(), rb * n_out, "retile: raw length");
    let kind = WKind::from_qt(qt);
    if kind == WKind::F32 {
        let mut f = vec![0f32; n_in * n_out]; // [n_out, n_in]
        f.par_chunks_mut(n_in.max(1))
            .enumerate()
            .for_each(|(o, row)| dequantize_row(qt, &raw[o * rb..(o + 1) * rb], row));
        return Retiled {
            kind,
            n_in,
            n_out,
            codes: Vec::new(),
            scales: Vec::new(),
            f32data: f,
        };
    }
    let be = kind.block_elems();
    let cb = kind.code_bytes();
    let bb = qt.block_bytes();
    let nblk = n_in / be;
    let mut codes = vec![0u8; n_out * nblk * cb];
    let mut scales = vec![0u16; n_out * nblk];
    codes
        .par_chunks_mut((nblk * cb).max(1))
        .zip(scales.par_chunks_mut(nblk.max(1)))
        .enumerate()
        .for_each(|(o, (crow, srow))| {
            let row = &raw[o * rb..(o + 1) * rb];
            for b in 0..nblk {
                let blk = &row[b * bb..(b + 1) * bb];
                srow[b] = u16::from_le_bytes([blk[0], blk[1]]);
                let qs = &blk[2..];
                let dst = &mut crow[b * cb..(b + 1) * cb];
                match kind {
                    WKind::Q1 => {
                        for w in 0..4 {
                            q1_word(&qs[4 * w..4 * w + 4], &mut dst[4 * w..4 * w + 4]);
                        }
                    }
                    _ => {
                        for w in 0..cb / 4 {
                            q2_word(&qs[4 * w..4 * w + 4], &mut dst[4 * w..4 * w + 4]);
                        }
                    }
                }
            }
        });
    Retiled {
        kind,
        n_in,
        n_out,
        codes,
        scales,
        f32data: Vec::new(),
    }
}

/// A Q1_0 or Q2_0 (g128 / PQ2_0) matrix in the b1-plane layout of `kernels/mvbp.cu`: codes
/// `[n_out / 16, n_in / 256, planes, 32, 4]` u32 (lane `4g + tg` of 16-row tile `T`, pair `p`, code
/// bit plane `q`: word `tg` of rows `16T + g` and `16T + g + 8` in block `2p`, then the same in block
/// `2p + 1`; bit `i` of word `tg` is bit `q` of the code of element `32tg + i` of the block — for
/// Q1_0, with one plane, the GGUF bit order read as little-endian words) and scales
/// `[n_out / 16, n_in / 128, 8]` u32 (f16 bits of row `16T + g` low, row `16T + g + 8` high).
pub struct RetiledB1p {
    pub n_in: usize,
    pub n_out: usize,
    /// Code bit planes: 1 for Q1_0, 2 for Q2_0.
    pub planes: usize,
    pub codes: Vec<u32>,
    pub scales: Vec<u32>,
}

/// The code planes of a type's b1-plane layout: 1 for Q1_0, 2 for the 128-element Q2_0 blocks
/// (Q2_0 g128, PQ2_0); `None` for every other type.
pub fn b1p_planes(qt: QuantType) -> Option<usize> {
    match qt {
        QuantType::Q1_0 => Some(1),
        QuantType::Q2_0G128 | QuantType::PQ2_0 => Some(2),
        _ => None,
    }
}

/// Whether a matrix of this type and shape has a b1-plane layout ([`b1p_planes`], `n_out % 16 ==
/// 0` and `n_in % 256 == 0`).
pub fn b1p_shape_ok(qt: QuantType, n_in: usize, n_out: usize) -> bool {
    b1p_planes(qt).is_some() && n_out % 16 == 0 && n_in % 256 == 0 && n_in > 0 && n_out > 0
}

/// Bits 0, 2, 4, …, 62 of `x` gathered into bits 0 … 31 (each step halves the gaps).
fn even_bits(x: u64) -> u32 {
    let mut x = x & 0x5555_5555_5555_5555;
    x = (x | x >> 1) & 0x3333_3333_3333_3333;
    x = (x | x >> 2) & 0x0f0f_0f0f_0f0f_0f0f;
    x = (x | x >> 4) & 0x00ff_00ff_00ff_00ff;
    x = (x | x >> 8) & 0x0000_ffff_0000_ffff;
    x = (x | x >> 16) & 0x0000_0000_ffff_ffff;
    x as u32
}

/// Re-tile `raw` (`n_out` GGUF rows of `n_in` elements, Q1_0, Q2_0 g128 or PQ2_0) into
/// [`RetiledB1p`]. Panics if the shape is not [`b1p_shape_ok`] or `raw` has the wrong length (the
/// loader validates extents).
pub fn retile_b1p(qt: QuantType, raw: &[u8], n_in: usize, n_out: usize) -> RetiledB1p {
    assert!(
        b1p_shape_ok(qt, n_in, n_out),
        "retile_b1p: {qt:?} {n_in} x {n_out}"
    );
    let planes = b1p_planes(qt).expect("checked");
    let rb = qt.row_bytes(n_in).expect("whole blocks");
    assert_eq!(raw.len(), rb * n_out, "retile_b1p: raw length");
    let (nblk, npair, ntile) = (n_in / 128, n_in / 256, n_out / 16);
    // GGUF block: f16 d, then 16 (Q1_0: element j at bit j & 7 of byte j >> 3) or 32 code bytes
    // (Q2_0: element j at bits 2·(j & 3) of byte j >> 2)
    let bb = 2 + 16 * planes;
    let block = |r: usize, b: usize| &raw[r * rb + b * bb..r * rb + (b + 1) * bb];
    let word = |r: usize, b: usize, q: usize, tg: usize| -> u32 {
        let c = &block(r, b)[2..];
        if planes == 1 {
            u32::from_le_bytes([c[4 * tg], c[4 * tg + 1], c[4 * tg + 2], c[4 * tg + 3]])
        } else {
            // the 32 codes of word tg as one little-endian u64 (code i at bits 2i, 2i + 1): plane
            // q is bit q of every pair, gathered into bit i
            let w = u64::from_le_bytes(c[8 * tg..8 * tg + 8].try_into().expect("8 bytes"));
            even_bits(w >> q)
        }
    };
    let scale = |r: usize, b: usize| {
        let q = block(r, b);
        u16::from_le_bytes([q[0], q[1]]) as u32
    };
    let mut codes = vec![0u32; ntile * npair * planes * 128];
    let mut scales = vec![0u32; ntile * nblk * 8];
    codes
        .par_chunks_mut(npair * planes * 128)
        .zip(scales.par_chunks_mut(nblk * 8))
        .enumerate()
        .for_each(|(t, (ct, st))| {
            for p in 0..npair {
                for q in 0..planes {
                    for lane in 0..32 {
                        let (g, tg) = (lane / 4, lane % 4);
                        let (r0, r1) = (16 * t + g, 16 * t + g + 8);
                        let o = ((p * planes + q) * 32 + lane) * 4;
                        ct[o] = word(r0, 2 * p, q, tg);
                        ct[o + 1] = word(r1, 2 * p, q, tg);
                        ct[o + 2] = word(r0, 2 * p + 1, q, tg);
                        ct[o + 3] = word(r1, 2 * p + 1, q, tg);
                    }
                }
            }
            for b in 0..nblk {
                for g in 0..8 {
                    st[b * 8 + g] = scale(16 * t + g, b) | scale(16 * t + g + 8, b) << 16;
                }
            }
        });
    RetiledB1p {
        n_in,
        n_out,
        planes,
        codes,
        scales,
    }
}

/// One delta swap: the bit at each position `p` of `m` trades places with the one at `p + d`.
fn delta_swap(x: u32, d: u32, m: u32) -> u32 {
    let t = ((x >> d) ^ x) & m;
    x ^ t ^ (t << d)
}

/// A Q1_0 b1-plane code word (element `n` at bit `n`) as the dp4a re-tiled word of [`retile`]
/// (element `4i + b` at bit `8b + i`): the bit index `(s4 s3 s2 s1 s0)` becomes
/// `(s1 s0 s4 s3 s2)`. The host twin of `b1p_word_to_q1` in kernels/gemm.cu (the same swaps),
/// which lets the prefill GEMM read the b1-plane layout.
pub fn b1p_word_to_q1(w: u32) -> u32 {
    let w = delta_swap(w, 1, 0x2222_2222);
    let w = delta_swap(w, 3, 0x0a0a_0a0a);
    let w = delta_swap(w, 6, 0x00cc_00cc);
    delta_swap(w, 12, 0x0000_f0f0)
}

/// Half `k` (elements `16k .. 16k + 15`) of a Q2_0 sub-block's two b1-plane words (`p0` code bit
/// 0, `p1` bit 1) as one word of 2-bit codes, element `x` at bits `16·x1 + 8·x3 + 4·x2 + 2·x0`
/// (`x = (x3 x2 x1 x0)`): elements `x` and `x + 2` 16 bits apart, as the prefill GEMM's
/// expansion pairs them (the same pairs as in the dp4a word of [`retile`], at other bits). The
/// host twin of `b1p_words_to_q2` in kernels/gemm.cu.
pub fn b1p_words_to_q2(p0: u32, p1: u32, k: usize) -> u32 {
    let sh = 16 * k as u32;
    let w = ((p0 >> sh) & 0xffff) | ((p1 >> sh) & 0xffff) << 16;
    delta_swap(delta_swap(w, 1, 0x2222_2222), 15, 0x0000_aaaa)
}

/// The b1-plane activations of one row `x` (`x.len() % 256 == 0`), the host twin of the device
/// quantizer (`quant_p16_part` in bonsai.cu): per 128-element block u = amax / 32767, codes
/// `rint(x · (1 / u))` clamped to ±32767 (0 where amax is 0); planes `[n_in / 256, 32, 4]` u32 in
/// the layout of `kernels/mvbp.cu`, u `[n_in / 128]`, sums `[n_in / 128, 4]` (the code sum of each
/// 32-element sub-block).
/// Also returns the codes.
pub fn host_quant_p16(x: &[f32]) -> (Vec<u32>, Vec<f32>, Vec<i32>, Vec<i16>) {
    assert_eq!(x.len() % 256, 0, "host_quant_p16: {} elements", x.len());
    let nblk = x.len() / 128;
    let mut planes = vec![0u32; x.len() / 2];
    let mut us = vec![0f32; nblk];
    let mut sums = vec![0i32; nblk * 4];
    let mut codes = vec![0i16; x.len()];
    for b in 0..nblk {
        let v = &x[b * 128..(b + 1) * 128];
        let amax = v.iter().fold(0f32, |m, e| m.max(e.abs()));
        let u = amax / 32767.0;
        let iu = if u != 0.0 { 1.0 / u } else { 0.0 };
        for (k, &e) in v.iter().enumerate() {
            let c = (e * iu).round_ties_even().clamp(-32767.0, 32767.0) as i32;
            codes[b * 128 + k] = c as i16;
            sums[b * 4 + k / 32] += c;
        }
        us[b] = u;
        let (pair, hb) = (b / 2, b % 2);
        for j in 0..4 {
            for p in 0..16 {
                let mut w = 0u32;
                for i in 0..32 {
                    w |= ((codes[b * 128 + 32 * j + i] as u16 as u32 >> p) & 1) << i;
                }
                let lane = 4 * (p % 8) + j;
                planes[(pair * 32 + lane) * 4 + 2 * hb + p / 8] = w;
            }
        }
    }
    (planes, us, sums, codes)
}

/// The byte-split activation codes of the int8 tensor-core verify (`mvbq_q1_*` in
/// `kernels/mvbp.cu`) from one row's int16 `codes` (`codes.len() % 128 == 0`): per 128-element
/// block four 64-byte quarters {hi(j 0, 1), lo(j 0, 1), hi(j 2, 3), lo(j 2, 3)}, each the 16 bytes
/// of the block's four 32-element sub-blocks in order, where byte 8·(j & 1) + 4h + m of a
/// sub-block's 16 holds element 2j + h + 8m of the sub-block: hi = code >> 8 (signed), lo =
/// code & 0xff, so code = 256·hi + lo. The host twin of what `quant_p16_part` writes to its `xv`
/// output.
pub fn b1q_acts_host(codes: &[i16]) -> Vec<u8> {
    assert_eq!(codes.len() % 128, 0, "b1q_acts_host: {} codes", codes.len());
    let mut out = vec![0u8; codes.len() * 2];
    for (sb, sub) in codes.chunks_exact(32).enumerate() {
        let (blk, tg) = (sb / 4, sb % 4);
        for (e, &c) in sub.iter().enumerate() {
            let (j, h, m) = ((e >> 1) & 3, e & 1, e >> 3);
            let o = blk * 256 + (j >> 1) * 128 + tg * 16 + (j & 1) * 8 + h * 4 + m;
            out[o] = ((c as i32) >> 8) as u8;
            out[o + 64] = c as u8;
        }
    }
    out
}

/// Re-tile a Q4_1 matrix (`n_out` GGUF rows of `n_in` elements, `n_in % 32 == 0`) into a 16-byte
/// code plane `[n_out, n_in/32, 16]` (GGUF nibble order) and a `(d, m)` plane `[n_out, n_in/32, 2]`
/// f16 bits. Panics if `raw` has the wrong length (the loader validates extents first).
pub fn retile_q41(raw: &[u8], n_in: usize, n_out: usize) -> Retiled {
    let qt = QuantType::Q4_1;
    let rb = qt
        .row_bytes(n_in)
        .expect("n_in is a whole number of blocks");
    assert_eq!(raw.len(), rb * n_out, "retile_q41: raw length");
    let nblk = n_in / 32;
    let mut codes = vec![0u8; n_out * nblk * 16];
    let mut scales = vec![0u16; n_out * nblk * 2];
    codes
        .par_chunks_mut((nblk * 16).max(1))
        .zip(scales.par_chunks_mut((nblk * 2).max(1)))
        .enumerate()
        .for_each(|(o, (crow, srow))| {
            let row = &raw[o * rb..(o + 1) * rb];
            for b in 0..nblk {
                // GGUF block: d f16, m f16, qs[16]
                let blk = &row[b * 20..(b + 1) * 20];
                srow[2 * b] = u16::from_le_bytes([blk[0], blk[1]]);
                srow[2 * b + 1] = u16::from_le_bytes([blk[2], blk[3]]);
                crow[b * 16..(b + 1) * 16].copy_from_slice(&blk[4..20]);
            }
        });
    Retiled {
        kind: WKind::Q41,
        n_in,
        n_out,
        codes,
        scales,
        f32data: Vec::new(),
    }
}

/// Dequantize row `o` of a re-tiled matrix on the host (the inverse of [`retile`]). out: `[n_in]`.
pub fn detile_row(r: &Retiled, o: usize, out: &mut [f32]) {
    assert_eq!(out.len(), r.n_in);
    if r.kind == WKind::F32 {
        out.copy_from_slice(&r.f32data[o * r.n_in..(o + 1) * r.n_in]);
        return;
    }
    let be = r.kind.block_elems();
    let cb = r.kind.code_bytes();
    let nblk = r.n_in / be;
    if r.kind == WKind::Q41 {
        for b in 0..nblk {
            let d = f16::from_bits(r.scales[(o * nblk + b) * 2]).to_f32();
            let m = f16::from_bits(r.scales[(o * nblk + b) * 2 + 1]).to_f32();
            let c = &r.codes[(o * nblk + b) * 16..(o * nblk + b + 1) * 16];
            for j in 0..16 {
                // same float ops as the CPU dequantization: code·d + m
                out[b * 32 + j] = (c[j] & 0xF) as f32 * d + m;
                out[b * 32 + j + 16] = (c[j] >> 4) as f32 * d + m;
            }
        }
        return;
    }
    for b in 0..nblk {
        let d = f16::from_bits(r.scales[o * nblk + b]).to_f32();
        let c = &r.codes[(o * nblk + b) * cb..(o * nblk + b + 1) * cb];
        for j in 0..be {
            out[b * be + j] = match r.kind {
                WKind::Q1 => {
                    let (w, rr) = (j / 32, j % 32);
                    if (c[4 * w + (rr & 3)] >> (rr >> 2)) & 1 == 1 {
                        d
                    } else {
                        -d
                    }
                }
                _ => {
                    let (w, rr) = (j / 16, j % 16);
                    let (s, i) = (rr / 4, rr % 4);
                    let code = (c[4 * w + i] >> (2 * s)) & 3;
                    (code as f32 - 1.0) * d
                }
            };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic pseudo-random bytes (splitmix64).
    pub(crate) fn rand_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E3779B97F4A7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
                (z ^ (z >> 31)) as u8
            })
            .collect()
    }

    /// Random GGUF rows of `qt` with finite f16 scales.
    fn rand_matrix(qt: QuantType, n_in: usize, n_out: usize, seed: u64) -> Vec<u8> {
        let mut raw = rand_bytes(seed, qt.row_bytes(n_in).unwrap() * n_out);
        if qt.is_lowbit() {
            for blk in raw.chunks_exact_mut(qt.block_bytes()) {
                let d = f16::from_f32(0.001 + (blk[2] as f32) / 1000.0).to_bits();
                blk[..2].copy_from_slice(&d.to_le_bytes());
            }
        }
        raw
    }

    fn check_exact(qt: QuantType, n_in: usize, n_out: usize) {
        let raw = rand_matrix(qt, n_in, n_out, n_in as u64 * 31 + n_out as u64);
        let r = retile(qt, &raw, n_in, n_out);
        let rb = qt.row_bytes(n_in).unwrap();
        let (mut a, mut b) = (vec![0f32; n_in], vec![0f32; n_in]);
        for o in 0..n_out {
            dequantize_row(qt, &raw[o * rb..(o + 1) * rb], &mut a);
            detile_row(&r, o, &mut b);
            for i in 0..n_in {
                assert_eq!(
                    a[i].to_bits(),
                    b[i].to_bits(),
                    "{qt:?} row {o} elem {i}: {} vs {}",
                    a[i],
                    b[i]
                );
            }
        }
    }

    #[test]
    fn retile_is_bit_exact_real_shapes() {
        // The real row lengths (5120, 6144, 17408) on a slice of rows each.
        for qt in [
            QuantType::Q1_0,
            QuantType::Q2_0G128,
            QuantType::PQ2_0,
            QuantType::Q2_0G64,
        ] {
            for (n_in, n_out) in [(5120, 48), (6144, 40), (17408, 24)] {
                check_exact(qt, n_in, n_out);
            }
        }
    }

    #[test]
    fn retile_other_types_to_f32() {
        for qt in [
            QuantType::F32,
            QuantType::F16,
            QuantType::Q8_0,
            QuantType::Q4_1,
        ] {
            let (n_in, n_out) = (256, 7);
            let raw = rand_bytes(7, qt.row_bytes(n_in).unwrap() * n_out);
            // keep values finite: only compare bit patterns of what dequantize_row produces
            let r = retile(qt, &raw, n_in, n_out);
            assert_eq!(r.kind, WKind::F32);
            let rb = qt.row_bytes(n_in).unwrap();
            let (mut a, mut b) = (vec![0f32; n_in], vec![0f32; n_in]);
            for o in 0..n_out {
                dequantize_row(qt, &raw[o * rb..(o + 1) * rb], &mut a);
                detile_row(&r, o, &mut b);
                for i in 0..n_in {
                    assert_eq!(a[i].to_bits(), b[i].to_bits());
                }
            }
        }
    }

    #[test]
    fn retile_q41_is_bit_exact() {
        // the drafter's shapes (scaled rows): 5120 and 25600 inputs, and a small odd row count
        for (n_in, n_out) in [(5120, 9), (25600, 3), (64, 33)] {
            let qt = QuantType::Q4_1;
            let mut raw = rand_bytes(n_in as u64 + 5, qt.row_bytes(n_in).unwrap() * n_out);
            for blk in raw.chunks_exact_mut(20) {
                // finite d and m of both signs
                let d = f16::from_f32(0.0005 + (blk[4] as f32) / 4000.0).to_bits();
                let m = f16::from_f32((blk[5] as f32 - 128.0) / 500.0).to_bits();
                blk[..2].copy_from_slice(&d.to_le_bytes());
                blk[2..4].copy_from_slice(&m.to_le_bytes());
            }
            let r = retile_q41(&raw, n_in, n_out);
            assert_eq!(r.kind, WKind::Q41);
            assert_eq!(r.codes.len(), n_out * n_in / 32 * 16);
            assert_eq!(r.scales.len(), n_out * n_in / 32 * 2);
            let rb = qt.row_bytes(n_in).unwrap();
            let (mut a, mut b) = (vec![0f32; n_in], vec![0f32; n_in]);
            for o in 0..n_out {
                dequantize_row(qt, &raw[o * rb..(o + 1) * rb], &mut a);
                detile_row(&r, o, &mut b);
                for i in 0..n_in {
                    assert_eq!(a[i].to_bits(), b[i].to_bits(), "Q4_1 row {o} elem {i}");
                }
            }
        }
    }

    #[test]
    fn q41_nibble_masks_give_consecutive_codes() {
        // byte j holds element j (low) and j + 16 (high): word w & 0x0F0F0F0F = elements 4w..4w+3,
        // (word >> 4) & 0x0F0F0F0F = elements 16 + 4w..
        let qs: Vec<u8> = (0..16u8)
            .map(|j| (j & 0xF) | (((15 - j) & 0xF) << 4))
            .collect();
        for w in 0..4 {
            let word = u32::from_le_bytes([qs[4 * w], qs[4 * w + 1], qs[4 * w + 2], qs[4 * w + 3]]);
            let (lo, hi) = (word & 0x0F0F_0F0F, (word >> 4) & 0x0F0F_0F0F);
            for b in 0..4 {
                let j = 4 * w + b;
                assert_eq!((lo >> (8 * b)) & 0xF, j as u32);
                assert_eq!((hi >> (8 * b)) & 0xF, 15 - j as u32);
            }
        }
    }

    #[test]
    fn q1_word_layout_is_consecutive_per_bit() {
        // element j set iff j % 3 == 0: bit i of byte b must be element 4i + b
        let mut src = [0u8; 4];
        for j in 0..32 {
            if j % 3 == 0 {
                src[j >> 3] |= 1 << (j & 7);
            }
        }
        let mut dst = [0u8; 4];
        q1_word(&src, &mut dst);
        let w = u32::from_le_bytes(dst);
        for i in 0..8 {
            let f = (w >> i) & 0x0101_0101;
            for b in 0..4 {
                assert_eq!((f >> (8 * b)) & 1 == 1, (4 * i + b) % 3 == 0);
            }
        }
    }

    #[test]
    fn q2_word_layout_is_consecutive_per_field() {
        // Elements 0..16 with codes j % 4: field s of byte i must be element 4s + i.
        let mut src = [0u8; 4];
        for j in 0..16 {
            src[j >> 2] |= ((j % 4) as u8) << (2 * (j & 3));
        }
        let mut dst = [0u8; 4];
        q2_word(&src, &mut dst);
        let w = u32::from_le_bytes(dst);
        for s in 0..4 {
            let f = (w >> (2 * s)) & 0x0303_0303;
            for i in 0..4 {
                assert_eq!((f >> (8 * i)) & 3, ((4 * s + i) % 4) as u32);
            }
        }
    }

    /// The b1-plane tiles hold every Q1_0 weight: sign from the code word, scale from the scale
    /// plane, against `dequantize_row`.
    #[test]
    fn b1p_retile_matches_dequantize() {
        // Q1_0: w = ±d by the bit; Q2_0 g128 / PQ2_0: w = (c − 1)·d, c = plane 0 + 2·plane 1
        for qt in [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::PQ2_0] {
            for (n_in, n_out) in [(256usize, 16usize), (5120, 48), (17408, 32)] {
                let raw = rand_matrix(qt, n_in, n_out, 7 + n_in as u64);
                let t = retile_b1p(qt, &raw, n_in, n_out);
                let planes = t.planes;
                assert_eq!(planes, if qt == QuantType::Q1_0 { 1 } else { 2 });
                assert_eq!(t.codes.len(), n_out * n_in / 32 * planes);
                let (nblk, npair) = (n_in / 128, n_in / 256);
                let rb = qt.row_bytes(n_in).unwrap();
                let mut want = vec![0f32; n_in];
                let mut seen3 = false;
                for r in 0..n_out {
                    dequantize_row(qt, &raw[r * rb..(r + 1) * rb], &mut want);
                    let (tile, g, half) = (r / 16, r % 8, (r % 16) / 8);
                    for k in 0..n_in {
                        let (b, tg, i) = (k / 128, (k % 128) / 32, k % 32);
                        let (p, hb) = (b / 2, b % 2);
                        let bit = |q: usize| {
                            let w = t.codes[(((tile * npair + p) * planes + q) * 32 + 4 * g + tg)
                                * 4
                                + 2 * hb
                                + half];
                            (w >> i) & 1
                        };
                        let sc = t.scales[(tile * nblk + b) * 8 + g] >> (16 * half) & 0xffff;
                        let d = f16::from_bits(sc as u16).to_f32();
                        let v = if planes == 1 {
                            if bit(0) == 1 {
                                d
                            } else {
                                -d
                            }
                        } else {
                            let c = bit(0) + 2 * bit(1);
                            seen3 |= c == 3;
                            (c as f32 - 1.0) * d
                        };
                        assert_eq!(v, want[k], "{qt:?} [{n_in} x {n_out}] row {r} element {k}");
                    }
                }
                // random code bytes include code 3 (+2d), which the layout keeps
                assert!(
                    planes == 1 || seen3,
                    "{qt:?}: no code 3 in the random matrix"
                );
            }
        }
        assert!(!b1p_shape_ok(QuantType::Q1_0, 128, 16));
        assert!(!b1p_shape_ok(QuantType::Q1_0, 256, 24));
        assert!(!b1p_shape_ok(QuantType::Q2_0G64, 256, 16));
        assert!(!b1p_shape_ok(QuantType::Q4_1, 256, 16));
        assert!(b1p_shape_ok(QuantType::Q2_0G128, 256, 16));
    }

    /// What the b1-plane GEMM (`gemmws_*_b1p`) reads for weight row `o` and 64-element chunk
    /// `c`, emulated with its index arithmetic (each thread's 8-byte copies into the tile's
    /// stage as `load_chunk` makes them, the row's words read back at `sidx`, then the
    /// permutation), gives the expansion the codes
    /// the dp4a GEMM expands from the dp4a layout of `retile` (Q1_0: the same words; Q2_0: the
    /// same pair of fields for every f16x2 register); and the b1-plane scale index
    /// (`gemmws_scale_b1p`) gives the row's scale.
    #[test]
    fn b1p_gemm_chunks_equal_dp4a_chunks() {
        for qt in [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::PQ2_0] {
            for (n_in, n_out) in [(256usize, 16usize), (1280, 48), (5120, 32)] {
                let raw = rand_matrix(qt, n_in, n_out, 11 + n_in as u64 + n_out as u64);
                let t = retile_b1p(qt, &raw, n_in, n_out);
                let r = retile(qt, &raw, n_in, n_out);
                let pl = t.planes;
                let (npair, nblk, nc) = (n_in / 256, n_in / 128, n_in / 64);
                let cbc = if pl == 1 { 8 } else { 16 }; // dp4a code bytes per row and chunk
                for o in 0..n_out {
                    let (tile, g, up) = (o >> 4, o & 7, (o >> 3) & 1);
                    for c in 0..nc {
                        let (b, tg0) = (c >> 1, 2 * (c & 1));
                        let (p, hb) = (b >> 1, b & 1);
                        // the tile's stage ([word row][16 rows in the order g, g + 8 side by
                        // side]): thread (g', up') copies 8 bytes, word tg0 + up' of rows g' and
                        // g' + 8, into word row 2q + up' at 2g', 2g' + 1
                        let mut stage = [[0u32; 16]; 4];
                        for gp in 0..8 {
                            for upp in 0..2 {
                                let wb1 = (tile * npair * pl * 32 + 4 * gp + upp) * 4;
                                for q in 0..pl {
                                    let a = wb1 + ((p * pl + q) * 32 + tg0) * 4 + 2 * hb;
                                    stage[2 * q + upp][2 * gp] = t.codes[a];
                                    stage[2 * q + upp][2 * gp + 1] = t.codes[a + 1];
                                }
                            }
                        }
                        // this row's words: word row 2q + j at sidx = 2g + up
                        let st: Vec<u32> = (0..4).map(|wr| stage[wr][2 * g + up]).collect();
                        let got: Vec<u32> = if pl == 1 {
                            vec![b1p_word_to_q1(st[0]), b1p_word_to_q1(st[1])]
                        } else {
                            vec![
                                b1p_words_to_q2(st[0], st[2], 0),
                                b1p_words_to_q2(st[0], st[2], 1),
                                b1p_words_to_q2(st[1], st[3], 0),
                                b1p_words_to_q2(st[1], st[3], 1),
                            ]
                        };
                        let off = o * nc * cbc + c * cbc;
                        let want: Vec<u32> = r.codes[off..off + cbc]
                            .chunks_exact(4)
                            .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
                            .collect();
                        if pl == 1 {
                            assert_eq!(got, want, "{qt:?} [{n_in} x {n_out}] row {o} chunk {c}");
                        } else {
                            // the two 2-bit fields register j of unit kb reads (gemmws_expand_row):
                            // the b1-plane words at 8h + 4(j >> 1) + 2(j & 1), the dp4a words at
                            // 4h + 8(j & 1) + 2(j >> 1), each with the field 16 bits above
                            for kb in 0..8 {
                                let h = kb & 1;
                                for j in 0..4 {
                                    let rb = 8 * h + 4 * (j >> 1) + 2 * (j & 1);
                                    let rd = 4 * h + 8 * (j & 1) + 2 * (j >> 1);
                                    assert_eq!(
                                        (got[kb >> 1] >> rb) & 0x0003_0003,
                                        (want[kb >> 1] >> rd) & 0x0003_0003,
                                        "{qt:?} [{n_in} x {n_out}] row {o} chunk {c} unit {kb} register {j}"
                                    );
                                }
                            }
                        }
                        let v = t.scales[((o >> 4) * nblk + (c >> 1)) * 8 + (o & 7)];
                        let sc = if o & 8 != 0 { v >> 16 } else { v & 0xffff };
                        assert_eq!(sc as u16, r.scales[o * nblk + (c >> 1)]);
                    }
                }
            }
        }
    }

    #[test]
    fn b1q_fragments_give_the_block_integer() {
        // one 128-element block: thread tg's A bytes (word >> i) & 0x01010101 for i = 2j, 2j + 1
        // (Q2_0: plus plane 1's at bit 1 of each byte, codes 0..3) against its B bytes b0 / b1 of
        // the byte-split layout give, summed over the four lanes and the four k-steps,
        // 256·Σ c·hi + Σ c·lo = Σ c·a; then S = 2·that − Σ a = Σ (2c − 1)·a (Q1_0), or
        // S = that − Σ a = Σ (c − 1)·a (Q2_0)
        let mut st = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        const M: u32 = 0x0101_0101;
        for planes in [1usize, 2] {
            for _ in 0..200 {
                let codes: Vec<i16> = (0..128)
                    .map(|_| ((next() % 65535) as i32 - 32767) as i16)
                    .collect();
                // bits[q][tg]: plane q's word tg
                let bits: Vec<Vec<u32>> = (0..planes)
                    .map(|_| (0..4).map(|_| next() as u32).collect())
                    .collect();
                let xv = b1q_acts_host(&codes);
                let (mut hi, mut lo) = (0i64, 0i64);
                for tg in 0..4 {
                    for j in 0..4 {
                        for h in 0..2 {
                            let i = 2 * j + h;
                            let a = if planes == 1 {
                                (bits[0][tg] >> i) & M
                            } else {
                                ((bits[0][tg] >> i) & M) | (((bits[1][tg] >> i) & M) << 1)
                            };
                            for m in 0..4 {
                                let c = ((a >> (8 * m)) & 0xff) as i64;
                                let o = (j >> 1) * 128 + tg * 16 + (j & 1) * 8 + h * 4 + m;
                                hi += c * xv[o] as i8 as i64;
                                lo += c * xv[o + 64] as i64;
                            }
                        }
                    }
                }
                let sum: i64 = codes.iter().map(|&c| c as i64).sum();
                let want: i64 = codes
                    .iter()
                    .enumerate()
                    .map(|(k, &c)| {
                        let bit = |q: usize| ((bits[q][k / 32] >> (k % 32)) & 1) as i64;
                        let w = if planes == 1 {
                            2 * bit(0) - 1
                        } else {
                            bit(0) + 2 * bit(1) - 1
                        };
                        w * c as i64
                    })
                    .sum();
                let f = if planes == 1 { 2 } else { 1 };
                assert_eq!(f * (256 * hi + lo) - sum, want, "{planes} plane(s)");
            }
        }
    }

    /// The host b1-plane quantizer: codes within half a unit of x / u, planes that spell the codes
    /// back in the kernel's layout, sums of the codes; and the kernel's integer fold
    /// (2·Σ w_p·popc(W AND P_p) − Σa) equals the ±1 dot product of codes and weights.
    #[test]
    fn host_quant_p16_planes_spell_the_codes() {
        let bytes = rand_bytes(3, 4 * 512);
        let mut x: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32 / u32::MAX as f32) - 0.5)
            .collect();
        x[7] = 40.0; // an outlier block
        for v in &mut x[256..384] {
            *v = 0.0; // an all-zero block
        }
        let (planes, u, sums, codes) = host_quant_p16(&x);
        for b in 0..x.len() / 128 {
            let blk = &x[b * 128..(b + 1) * 128];
            let amax = blk.iter().fold(0f32, |m, e| m.max(e.abs()));
            assert_eq!(u[b], amax / 32767.0);
            let mut sum = 0i32;
            for k in 0..128 {
                let c = codes[b * 128 + k] as i32;
                sum += c;
                if u[b] != 0.0 {
                    assert!((c as f64 * u[b] as f64 - blk[k] as f64).abs() <= 0.51 * u[b] as f64);
                } else {
                    assert_eq!(c, 0);
                }
                let (j, i, pair, hb) = (k / 32, k % 32, b / 2, b % 2);
                let mut back = 0u32;
                for p in 0..16 {
                    let lane = 4 * (p % 8) + j;
                    let w = planes[(pair * 32 + lane) * 4 + 2 * hb + p / 8];
                    back |= ((w >> i) & 1) << p;
                }
                assert_eq!(back as u16 as i16 as i32, c, "block {b} element {k}");
            }
            for j in 0..4 {
                let sj: i32 = (0..32).map(|i| codes[b * 128 + 32 * j + i] as i32).sum();
                assert_eq!(sums[b * 4 + j], sj, "block {b} sub-block {j}");
            }
            assert_eq!(sums[b * 4..b * 4 + 4].iter().sum::<i32>(), sum);
            // the fold with random weight words
            let ws: Vec<u32> = rand_bytes(b as u64, 16)
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let want: i64 = (0..128)
                .map(|k| {
                    let c = codes[b * 128 + k] as i64;
                    if (ws[k / 32] >> (k % 32)) & 1 == 1 {
                        c
                    } else {
                        -c
                    }
                })
                .sum();
            let mut s1 = 0i64;
            for p in 0..16 {
                let wp = if p == 15 { -(1i64 << 15) } else { 1i64 << p };
                let pc: u32 = (0..4)
                    .map(|j| {
                        let lane = 4 * (p % 8) + j;
                        (ws[j] & planes[(b / 2 * 32 + lane) * 4 + 2 * (b % 2) + p / 8]).count_ones()
                    })
                    .sum();
                s1 += wp * pc as i64;
            }
            assert_eq!(2 * s1 - sum as i64, want, "block {b}");
            // Q2_0's fold (two code planes ws, vs; c = bit 0 + 2·bit 1):
            // Σ_p w_p·(popc(C0 AND P_p) + 2·popc(C1 AND P_p)) − Σa = Σ (c − 1)·a
            let vs: Vec<u32> = rand_bytes(100 + b as u64, 16)
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let want2: i64 = (0..128)
                .map(|k| {
                    let c = ((ws[k / 32] >> (k % 32)) & 1) + 2 * ((vs[k / 32] >> (k % 32)) & 1);
                    (c as i64 - 1) * codes[b * 128 + k] as i64
                })
                .sum();
            let mut s2 = 0i64;
            for p in 0..16 {
                let wp = if p == 15 { -(1i64 << 15) } else { 1i64 << p };
                let pc = |w: &[u32]| -> i64 {
                    (0..4)
                        .map(|j| {
                            let lane = 4 * (p % 8) + j;
                            (w[j] & planes[(b / 2 * 32 + lane) * 4 + 2 * (b % 2) + p / 8])
                                .count_ones() as i64
                        })
                        .sum()
                };
                s2 += wp * (pc(&ws) + 2 * pc(&vs));
            }
            assert_eq!(s2 - sum as i64, want2, "block {b}, two planes");
        }
    }
}
