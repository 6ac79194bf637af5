//! The Q1_0 *mask layout*: Q1_0 rows re-laid at load for the AVX2 / AVX-512 mat-vecs, so that 64
//! weights become the integer-dot operand of the 64 permuted activation codes they multiply with
//! one broadcast load and one AND (two on AVX2, one per 32-byte half) — no unpacking shuffle,
//! compare or mask register at run time.
//!
//! A row keeps its length and its file bytes past the last whole 512 elements. Each whole
//! 512-element *pair* (chunks 2s and 2s + 1 of 256, file blocks 4s .. 4s + 3: 72 bytes) becomes
//!
//! ```text
//! bytes 0..8         d of blocks 4s, 4s+1, 4s+2, 4s+3 (f16, little-endian, as in the file)
//! bytes 8+8k..16+8k  word k (u64, little-endian), k = 0..8: bit 8·b + j is the weight bit that
//!                    multiplies byte p = 8·j + b of the pair's 64-byte activation vector k,
//!                    i.e. pair element 256·h + 32·l + 4·k + m with h = p / 32, 4·l + m = p % 32
//! ```
//!
//! Activation vector k is what `QuantActs::q1p` keeps for the pair: vector k of chunk h at byte
//! `32·h + 4·l + m`. Broadcast word k to the 8 qwords of a vector and AND byte p with `1 << (p / 8)`:
//! byte p becomes `b·2^j` with j = p / 8, the same j for the 4 bytes of i32 lane L = p / 4 (j =
//! L / 2). So `vpdpbusd` over the pair's 8 vectors leaves `2^(L/2) · Σ b·q` of block
//! `8·(2s + h) + l` in lane `L = 8h + l`, an exact multiple that one arithmetic shift per lane
//! divides back — the block integers of the chunk kernels, whose float operations the mask kernel
//! keeps (`ops` module doc: the same bits). AVX2 reads the same bytes: broadcast to 4 qwords and
//! ANDed with `1 << (p / 8)` for the low half (chunk 2s) and `1 << (4 + p / 8)` for the high half,
//! then `vpmaddubsw` (at most 2·128·127 a pair, no saturation) and `vpmaddwd`.

use rayon::prelude::*;

/// Elements of a pair (two 256-element chunks).
pub const PAIR_ELEMS: usize = 512;
/// Bytes of a pair: 4 Q1_0 blocks of 18, in either layout.
pub const PAIR_BYTES: usize = 72;
const BLOCK_BYTES: usize = 18;

/// The weight bit (1 = +d) of element `e` (`< n_in`) of a Q1_0 row in file layout.
#[inline]
fn file_bit(row: &[u8], e: usize) -> u64 {
    let b = &row[(e / 128) * BLOCK_BYTES + 2..];
    ((b[(e % 128) / 8] >> (e % 8)) & 1) as u64
}

/// Pair element that bit i of word k stands for: activation byte p = 8·(i % 8) + i / 8 of
/// vector k.
#[inline]
fn pair_elem(k: usize, i: usize) -> usize {
    let p = 8 * (i % 8) + i / 8;
    let (h, q) = (p / 32, p % 32);
    256 * h + 32 * (q / 4) + 4 * k + q % 4
}

fn check_row(src: &[u8], n_in: usize, dst: &[u8]) {
    assert_eq!(n_in % 128, 0, "q1m: n_in must be whole Q1_0 blocks");
    assert_eq!(src.len(), n_in / 128 * BLOCK_BYTES, "q1m: row bytes");
    assert_eq!(dst.len(), src.len(), "q1m: destination row bytes");
}

/// File layout → mask layout for one row of `n_in` elements (the scalar definition).
pub fn pack_row(src: &[u8], n_in: usize, dst: &mut [u8]) {
    check_row(src, n_in, dst);
    dst.copy_from_slice(src);
    for s in 0..n_in / PAIR_ELEMS {
        let sp = &src[s * PAIR_BYTES..(s + 1) * PAIR_BYTES];
        let dp = &mut dst[s * PAIR_BYTES..(s + 1) * PAIR_BYTES];
        for b in 0..4 {
            dp[2 * b..2 * b + 2].copy_from_slice(&sp[b * BLOCK_BYTES..b * BLOCK_BYTES + 2]);
        }
        for k in 0..8 {
            let mut word = 0u64;
            for i in 0..64 {
                word |= file_bit(sp, pair_elem(k, i)) << i;
            }
            dp[8 + 8 * k..16 + 8 * k].copy_from_slice(&word.to_le_bytes());
        }
    }
}

/// [`pack_row`] with whole-word operations: for word k, the 16 nibbles `4k..4k+4` of each 32-element
/// block (file byte `4l + k/2` of chunk h, nibble `k % 2`) in activation order (bit p), then the
/// 8×8 bit transpose into the layout's order. The same bytes (`pack_fast_equals_definition`).
pub fn pack_row_fast(src: &[u8], n_in: usize, dst: &mut [u8]) {
    check_row(src, n_in, dst);
    dst.copy_from_slice(src);
    for s in 0..n_in / PAIR_ELEMS {
        let sp = &src[s * PAIR_BYTES..(s + 1) * PAIR_BYTES];
        let dp = &mut dst[s * PAIR_BYTES..(s + 1) * PAIR_BYTES];
        // bits[h]: chunk h's 32 bytes of weight bits (blocks 2h, 2h + 1 of the pair)
        let mut bits = [[0u8; 32]; 2];
        for (h, b) in bits.iter_mut().enumerate() {
            b[..16].copy_from_slice(&sp[36 * h + 2..36 * h + 18]);
            b[16..].copy_from_slice(&sp[36 * h + 20..36 * h + 36]);
        }
        for b in 0..4 {
            dp[2 * b..2 * b + 2].copy_from_slice(&sp[b * BLOCK_BYTES..b * BLOCK_BYTES + 2]);
        }
        for k in 0..8 {
            let mut m = 0u64; // bit p = weight of activation byte p of vector k
            for (h, b) in bits.iter().enumerate() {
                for l in 0..8 {
                    let nib = (b[4 * l + k / 2] >> (4 * (k % 2))) & 15;
                    m |= (nib as u64) << (32 * h + 4 * l);
                }
            }
            let word = transpose8x8(m);
            dp[8 + 8 * k..16 + 8 * k].copy_from_slice(&word.to_le_bytes());
        }
    }
}

/// The 8×8 bit matrix of `x` (byte r = row r, bit c = column c) transposed: bit `8c + r` of the
/// result is bit `8r + c` of `x`.
#[inline]
pub(crate) fn transpose8x8(mut x: u64) -> u64 {
    let t = (x ^ (x >> 7)) & 0x00AA_00AA_00AA_00AA;
    x ^= t ^ (t << 7);
    let t = (x ^ (x >> 14)) & 0x0000_CCCC_0000_CCCC;
    x ^= t ^ (t << 14);
    let t = (x ^ (x >> 28)) & 0x0000_0000_F0F0_F0F0;
    x ^ t ^ (t << 28)
}

/// Mask layout → file layout for one row (the inverse of [`pack_row`]).
pub fn unpack_row(src: &[u8], n_in: usize, dst: &mut [u8]) {
    check_row(src, n_in, dst);
    dst.copy_from_slice(src);
    for s in 0..n_in / PAIR_ELEMS {
        let sp = &src[s * PAIR_BYTES..(s + 1) * PAIR_BYTES];
        let dp = &mut dst[s * PAIR_BYTES..(s + 1) * PAIR_BYTES];
        dp.fill(0);
        for b in 0..4 {
            dp[b * BLOCK_BYTES..b * BLOCK_BYTES + 2].copy_from_slice(&sp[2 * b..2 * b + 2]);
        }
        for k in 0..8 {
            let word = u64::from_le_bytes(sp[8 + 8 * k..16 + 8 * k].try_into().unwrap());
            for i in 0..64 {
                let e = pair_elem(k, i);
                let bit = ((word >> i) & 1) as u8;
                dp[(e / 128) * BLOCK_BYTES + 2 + (e % 128) / 8] |= bit << (e % 8);
            }
        }
    }
}

/// A whole Q1_0 matrix (`n_out` rows of `n_in`, file layout) in the mask layout. Rows run in
/// parallel; where the CPU has AVX-512 BITALG the pairs are re-laid with `vpshufbitqmb`, elsewhere
/// by [`pack_row_fast`] (the same bytes as [`pack_row`]: `tests/q1m.rs`).
pub fn pack(w: &[u8], n_in: usize, n_out: usize) -> Vec<u8> {
    pack_isa(crate::ops::active_isa(), w, n_in, n_out)
}

/// [`pack`] with an explicit ISA (AVX-512 BITALG: `vpshufbitqmb`; else [`pack_row_fast`]).
pub fn pack_isa(isa: crate::ops::Isa, w: &[u8], n_in: usize, n_out: usize) -> Vec<u8> {
    let mut out = vec![0u8; w.len()];
    pack_into_isa(isa, w, n_in, n_out, &mut out);
    out
}

/// [`pack`] into a caller's buffer of `w.len()` bytes (e.g. huge-page-backed memory).
pub fn pack_into(w: &[u8], n_in: usize, n_out: usize, out: &mut [u8]) {
    pack_into_isa(crate::ops::active_isa(), w, n_in, n_out, out)
}

/// [`pack_into`] with an explicit ISA.
pub fn pack_into_isa(isa: crate::ops::Isa, w: &[u8], n_in: usize, n_out: usize, out: &mut [u8]) {
    assert_eq!(n_in % 128, 0, "q1m: n_in must be whole Q1_0 blocks");
    let rb = n_in / 128 * BLOCK_BYTES;
    assert_eq!(w.len(), rb * n_out, "q1m: matrix bytes");
    assert_eq!(out.len(), w.len(), "q1m: destination bytes");
    if rb == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let fast = isa == crate::ops::Isa::Avx512 && crate::ops::isa_supported(isa);
    #[cfg(not(target_arch = "x86_64"))]
    let fast = {
        let _ = isa;
        false
    };
    out.par_chunks_mut(rb)
        .zip(w.par_chunks(rb))
        .for_each(|(d, s)| {
            if fast {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa_supported(Avx512)` checked the CPU features; `s` and `d` are one row
                // of `rb` bytes each (checked inside).
                unsafe {
                    crate::avx512::q1m_pack_row(s, n_in, d)
                }
            } else {
                pack_row_fast(s, n_in, d)
            }
        });
}
