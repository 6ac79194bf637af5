//! The Q2 *mask layout*: ternary rows (`Q2_0` g128, `PQ2_0`, `Q2_0` g64) re-laid at load for the
//! AVX2 / AVX-512 mat-vecs, the Q2 twin of [`crate::q1m`]. 64 weights become the integer-dot
//! operand of the same 64 permuted activation codes (`QuantActs::q1p`) with one 16-byte broadcast
//! load and one AND (two on AVX2, one per 32-byte half) — no shifts and no per-chunk unpacking.
//!
//! A row keeps its length and its file bytes past the last whole 512 elements. Each whole
//! 512-element *pair* (the file's 4 g128 blocks of 34 bytes or 8 g64 blocks of 18: 136 / 144
//! bytes) becomes
//!
//! ```text
//! bytes 0 .. 2·nb                the pair's nb = 512 / G block scales d (f16, little-endian, in
//!                                block order, as in the file)
//! bytes 2·nb + 16k .. + 16       vector k, k = 0..8: byte i, bits 2ℓ and 2ℓ + 1 (ℓ = 0..4) hold
//!                                the code c ∈ 0..2 of the element that byte p = 16ℓ + i of the
//!                                pair's 64-byte q1p activation vector k multiplies,
//!                                i.e. pair element 128·ℓ + 32·(i / 4) + 4·k + i % 4
//! ```
//!
//! Broadcast vector k's 16 bytes to the 4 128-bit lanes of a 512-bit register and AND lane ℓ's
//! bytes with `3 << 2ℓ`: byte p becomes `c·4^ℓ`, the same power for the 4 bytes of i32 lane
//! `L = p / 4` (ℓ = L / 4). `vpdpbusd` over the pair's 8 vectors then leaves `4^(L/4) · Σ c·q` of
//! 32-element block `16s + L` in lane L, which one arithmetic shift per lane divides back: the
//! block integers of the file-layout Q2 kernels (`Σ (c − 1)·q = Σ c·q − Σ q`), whose float
//! operations the mask kernels keep — the same bits (`ops` module doc). AVX2 reads the same bytes
//! with the same broadcast, ANDs each 256-bit half (lanes ℓ = 2h, 2h + 1) and uses `vpmaddubsw`:
//! a byte pair is at most `2·128·127 = 32512`, no saturation, because the layout is only made for
//! matrices whose codes are all 0..2 ([`pack_into`] says so; a file with the unused code 3 keeps
//! its file layout and the file kernels).

use crate::quant::QuantType;
use rayon::prelude::*;

/// Elements of a pair (two 256-element chunks).
pub const PAIR_ELEMS: usize = 512;

/// Whether `qt` has a Q2 mask layout: `Q2_0` g128, `PQ2_0` and `Q2_0` g64.
pub fn supports(qt: QuantType) -> bool {
    matches!(
        qt,
        QuantType::Q2_0G128 | QuantType::PQ2_0 | QuantType::Q2_0G64
    )
}

/// Bytes of one 512-element pair of `qt` (a Q2 type), in either layout: 136 (g128) or 144 (g64).
pub fn pair_bytes(qt: QuantType) -> usize {
    assert!(supports(qt), "q2m: {qt:?} is not a Q2 type");
    PAIR_ELEMS / qt.block_elems() * qt.block_bytes()
}

/// Bytes of a pair's scales at its start: 2 per block.
pub fn scale_bytes(qt: QuantType) -> usize {
    2 * (PAIR_ELEMS / qt.block_elems())
}

/// Code (0..3) of element `e` of a pair in file layout (`g` elements a block).
#[inline]
fn file_code(pair: &[u8], g: usize, e: usize) -> u8 {
    let b = &pair[(e / g) * (2 + g / 4) + 2..];
    (b[(e % g) / 4] >> (2 * (e % 4))) & 3
}

/// Pair element of byte i, field ℓ, of vector k.
#[inline]
fn pair_elem(k: usize, i: usize, l: usize) -> usize {
    128 * l + 32 * (i / 4) + 4 * k + i % 4
}

fn check_row(qt: QuantType, src: &[u8], n_in: usize, dst: &[u8]) {
    assert!(supports(qt), "q2m: {qt:?} is not a Q2 type");
    assert_eq!(
        Some(src.len()),
        qt.row_bytes(n_in),
        "q2m: row bytes for {n_in} elements"
    );
    assert_eq!(dst.len(), src.len(), "q2m: destination row bytes");
}

/// Copies the pair's block scales (bytes 0..2 of each file block) to its first bytes.
fn pack_scales(qt: QuantType, sp: &[u8], dp: &mut [u8]) {
    let bb = qt.block_bytes();
    for b in 0..PAIR_ELEMS / qt.block_elems() {
        dp[2 * b..2 * b + 2].copy_from_slice(&sp[b * bb..b * bb + 2]);
    }
}

/// File layout → mask layout for one row of `n_in` elements (the scalar definition).
pub fn pack_row(qt: QuantType, src: &[u8], n_in: usize, dst: &mut [u8]) {
    check_row(qt, src, n_in, dst);
    dst.copy_from_slice(src);
    let (pb, sb, g) = (pair_bytes(qt), scale_bytes(qt), qt.block_elems());
    for s in 0..n_in / PAIR_ELEMS {
        let sp = &src[s * pb..(s + 1) * pb];
        let dp = &mut dst[s * pb..(s + 1) * pb];
        pack_scales(qt, sp, dp);
        for k in 0..8 {
            for i in 0..16 {
                let mut byte = 0u8;
                for l in 0..4 {
                    byte |= file_code(sp, g, pair_elem(k, i, l)) << (2 * l);
                }
                dp[sb + 16 * k + i] = byte;
            }
        }
    }
}

/// The 4×4 matrix of 2-bit fields of `x` (field (r, c) at bit `8r + 2c`) transposed.
#[inline]
fn transpose4x4_2bit(mut x: u32) -> u32 {
    let t = (x ^ (x >> 6)) & 0x00CC_00CC;
    x ^= t ^ (t << 6);
    let t = (x ^ (x >> 12)) & 0x0000_F0F0;
    x ^ t ^ (t << 12)
}

/// The pair's code bytes by field ℓ: `src[ℓ][8a + k]` is the file byte holding elements
/// `128ℓ + 32a + 4k .. + 4` (g128: block ℓ's 32 bytes; g64: blocks 2ℓ and 2ℓ + 1, 16 each).
fn code_bytes_by_field(qt: QuantType, sp: &[u8]) -> [[u8; 32]; 4] {
    let mut src = [[0u8; 32]; 4];
    for (l, s) in src.iter_mut().enumerate() {
        if qt == QuantType::Q2_0G64 {
            s[..16].copy_from_slice(&sp[18 * (2 * l) + 2..18 * (2 * l) + 18]);
            s[16..].copy_from_slice(&sp[18 * (2 * l + 1) + 2..18 * (2 * l + 1) + 18]);
        } else {
            s.copy_from_slice(&sp[34 * l + 2..34 * l + 34]);
        }
    }
    src
}

/// [`pack_row`] with whole-word operations: byte `8a + k` of the 4 fields' code bytes as one u32
/// (field ℓ in byte ℓ), whose 4×4 2-bit transpose is bytes `4a .. 4a + 4` of vector k. The same
/// bytes (`tests/q2m.rs`).
pub fn pack_row_fast(qt: QuantType, src: &[u8], n_in: usize, dst: &mut [u8]) {
    check_row(qt, src, n_in, dst);
    dst.copy_from_slice(src);
    let (pb, sb) = (pair_bytes(qt), scale_bytes(qt));
    for s in 0..n_in / PAIR_ELEMS {
        let sp = &src[s * pb..(s + 1) * pb];
        let dp = &mut dst[s * pb..(s + 1) * pb];
        let f = code_bytes_by_field(qt, sp);
        pack_scales(qt, sp, dp);
        for j in 0..32 {
            let x = u32::from_le_bytes([f[0][j], f[1][j], f[2][j], f[3][j]]);
            let (a, k) = (j / 8, j % 8);
            let o = sb + 16 * k + 4 * a;
            dp[o..o + 4].copy_from_slice(&transpose4x4_2bit(x).to_le_bytes());
        }
    }
}

/// Mask layout → file layout for one row (the inverse of [`pack_row`]).
pub fn unpack_row(qt: QuantType, src: &[u8], n_in: usize, dst: &mut [u8]) {
    check_row(qt, src, n_in, dst);
    dst.copy_from_slice(src);
    let (pb, sb, g) = (pair_bytes(qt), scale_bytes(qt), qt.block_elems());
    let bb = qt.block_bytes();
    for s in 0..n_in / PAIR_ELEMS {
        let sp = &src[s * pb..(s + 1) * pb];
        let dp = &mut dst[s * pb..(s + 1) * pb];
        dp.fill(0);
        for b in 0..PAIR_ELEMS / g {
            dp[b * bb..b * bb + 2].copy_from_slice(&sp[2 * b..2 * b + 2]);
        }
        for k in 0..8 {
            for i in 0..16 {
                for l in 0..4 {
                    let e = pair_elem(k, i, l);
                    let c = (sp[sb + 16 * k + i] >> (2 * l)) & 3;
                    dp[(e / g) * bb + 2 + (e % g) / 4] |= c << (2 * (e % 4));
                }
            }
        }
    }
}

/// Whether any code of `bytes` (whole Q2 blocks in file layout) is the unused code 3.
fn has_code3(qt: QuantType, bytes: &[u8]) -> bool {
    bytes
        .chunks_exact(qt.block_bytes())
        .any(|b| b[2..].iter().fold(0u8, |m, &q| m | (q & (q >> 1) & 0x55)) != 0)
}

/// A whole Q2 matrix (`n_out` rows of `n_in`, file layout) into the mask layout in `out`
/// (`w.len()` bytes, e.g. huge-page-backed memory). Rows run in parallel; with AVX2 the pairs are
/// re-laid 8 words at a time, elsewhere by [`pack_row_fast`] (the same bytes as [`pack_row`]:
/// `tests/q2m.rs`). Returns false, with `out` unspecified, when a code is 3 (no ternary weight;
/// the AVX2 kernel's bound needs 0..2): such a matrix stays in the file layout.
pub fn pack_into(qt: QuantType, w: &[u8], n_in: usize, n_out: usize, out: &mut [u8]) -> bool {
    pack_into_isa(crate::ops::active_isa(), qt, w, n_in, n_out, out)
}

/// [`pack_into`] with an explicit ISA (AVX2 and AVX-512: the AVX2 packer; else
/// [`pack_row_fast`]).
pub fn pack_into_isa(
    isa: crate::ops::Isa,
    qt: QuantType,
    w: &[u8],
    n_in: usize,
    n_out: usize,
    out: &mut [u8],
) -> bool {
    assert!(supports(qt), "q2m: {qt:?} is not a Q2 type");
    let rb = qt.row_bytes(n_in).expect("q2m: n_in must be whole blocks");
    assert_eq!(w.len(), rb * n_out, "q2m: matrix bytes");
    assert_eq!(out.len(), w.len(), "q2m: destination bytes");
    if rb == 0 {
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    let simd = isa != crate::ops::Isa::Scalar && crate::ops::isa_supported(isa);
    #[cfg(not(target_arch = "x86_64"))]
    let simd = {
        let _ = isa;
        false
    };
    let tail = n_in / PAIR_ELEMS * pair_bytes(qt);
    out.par_chunks_mut(rb)
        .zip(w.par_chunks(rb))
        .map(|(d, s)| {
            if simd {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa_supported` verified AVX2 (every non-scalar ISA has it); the
                // packer checks the row lengths before any access.
                return !unsafe { crate::avx2::q2m_pack_row(qt, s, n_in, d) }
                    && !has_code3(qt, &s[tail..]);
            }
            if has_code3(qt, s) {
                return false;
            }
            pack_row_fast(qt, s, n_in, d);
            true
        })
        .reduce(|| true, |a, b| a && b)
}

/// [`pack_into`] into a new buffer: `None` when a code is 3.
pub fn pack(qt: QuantType, w: &[u8], n_in: usize, n_out: usize) -> Option<Vec<u8>> {
    pack_isa(crate::ops::active_isa(), qt, w, n_in, n_out)
}

/// [`pack`] with an explicit ISA.
pub fn pack_isa(
    isa: crate::ops::Isa,
    qt: QuantType,
    w: &[u8],
    n_in: usize,
    n_out: usize,
) -> Option<Vec<u8>> {
    let mut out = vec![0u8; w.len()];
    pack_into_isa(isa, qt, w, n_in, n_out, &mut out).then_some(out)
}
