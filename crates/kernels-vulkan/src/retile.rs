//! The low-bit weights as the `mv` shader reads them: the file's blocks split into a code plane
//! tiled for the shader's lanes and an f32 scale plane. Driven by the block layout alone (MODEL.md
//! §1.2); knows no tensor names.
//!
//! The shader walks a row in chunks of 128 elements; lane `l` (of 32) takes elements `4l .. 4l + 3`
//! of every chunk, and reads its codes for 8 consecutive chunks (a *group*) in one load: so one
//! group of one row is 32 lanes × (8 chunks × 4 elements × bits per code) = 128 bytes (Q1_0) or
//! 256 bytes (2-bit codes), contiguous, lane by lane.

use half::f16;

/// A low-bit block layout: `d: f16` then `code_bytes` of codes per block of `block` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LowBit {
    /// Q1_0: 128 elements, 16 code bytes (bit j of the block is element j).
    Q1,
    /// Q2_0 group 128 and PQ2_0: 128 elements, 32 code bytes (2 bits per element).
    Q2g128,
    /// Q2_0 group 64 (upstream ggml): 64 elements, 16 code bytes.
    Q2g64,
}

impl LowBit {
    pub fn block(self) -> usize {
        match self {
            LowBit::Q1 | LowBit::Q2g128 => 128,
            LowBit::Q2g64 => 64,
        }
    }
    pub fn code_bytes(self) -> usize {
        match self {
            LowBit::Q1 | LowBit::Q2g64 => 16,
            LowBit::Q2g128 => 32,
        }
    }
    /// Bytes of one block in the file.
    pub fn block_bytes(self) -> usize {
        2 + self.code_bytes()
    }
}

/// u32 code words per lane and group: 1 (Q1_0, 4 bits × 8 chunks) or 2 (2-bit codes).
pub fn lane_words(kind: LowBit) -> usize {
    match kind {
        LowBit::Q1 => 1,
        LowBit::Q2g128 | LowBit::Q2g64 => 2,
    }
}

/// Groups of 8 chunks of 128 elements in a row of `n_in`.
pub fn groups(n_in: usize) -> usize {
    n_in.div_ceil(128).div_ceil(8)
}

/// Split `data` (`n_out` rows of `n_in / block` blocks) into lane-tiled codes
/// `[n_out, groups(n_in), 32 lanes, lane_words]` u32 and scales `[n_out, n_in / block]` f32.
/// Word `q` of lane `l` in group `g` holds, for chunks `c = 8g + 4q' + k` (Q1_0: `q' = 0`, k < 8;
/// 2-bit: `q' = q`, k < 4), the codes of elements `128c + 4l .. + 3` at bit `4k` (Q1_0: 4 bits,
/// element order) or `8k` (2-bit: 8 bits, element order); chunks past the row are zero. `None`
/// when `n_in` is not a whole number of blocks or the byte count is not `n_out` rows of blocks.
pub fn split_blocks(
    kind: LowBit,
    data: &[u8],
    n_in: usize,
    n_out: usize,
) -> Option<(Vec<u32>, Vec<f32>)> {
    if n_in % kind.block() != 0 {
        return None;
    }
    let nblk = n_in / kind.block();
    if data.len() != n_out * nblk * kind.block_bytes() {
        return None;
    }
    let (ng, lw) = (groups(n_in), lane_words(kind));
    let cb = kind.code_bytes();
    Some(split_rows(
        kind,
        data,
        nblk,
        n_out,
        ng * 32 * lw,
        nblk,
        |rb, out, sc_row| {
            let mut row = vec![0u8; nblk * cb];
            for ((b, blk), d) in rb.chunks_exact(kind.block_bytes()).enumerate().zip(sc_row) {
                *d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                row[b * cb..(b + 1) * cb].copy_from_slice(&blk[2..]);
            }
            tile_row(kind, &row, n_in, out);
        },
    ))
}

/// The rows of `data` (`n_out` rows of `nblk` blocks) through `f(row bytes, its cw code words,
/// its sw scale words)`, rows split over the machine's threads (a 27B load re-tiles ~4 GB);
/// returns the code and scale planes, zeroed before `f` fills them.
fn split_rows<S: Copy + Default + Send>(
    kind: LowBit,
    data: &[u8],
    nblk: usize,
    n_out: usize,
    cw: usize,
    sw: usize,
    f: impl Fn(&[u8], &mut [u32], &mut [S]) + Sync,
) -> (Vec<u32>, Vec<S>) {
    let mut codes = vec![0u32; n_out * cw];
    let mut scales = vec![S::default(); n_out * sw];
    let row_bytes = nblk * kind.block_bytes();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(32);
    let rows_per = n_out.div_ceil(threads).max(1);
    let f = &f;
    std::thread::scope(|sc| {
        for ((src, dst), sdst) in data
            .chunks(rows_per * row_bytes)
            .zip(codes.chunks_mut(rows_per * cw))
            .zip(scales.chunks_mut(rows_per * sw))
        {
            sc.spawn(move || {
                for ((rb, out), sc_row) in src
                    .chunks_exact(row_bytes)
                    .zip(dst.chunks_exact_mut(cw))
                    .zip(sdst.chunks_exact_mut(sw))
                {
                    f(rb, out, sc_row);
                }
            });
        }
    });
    (codes, scales)
}

/// One row's code bytes (element order, blocks back to back) into its lane-tiled words `out`
/// (`[groups, 32, lane_words]`, zeroed).
fn tile_row(kind: LowBit, row: &[u8], n_in: usize, out: &mut [u32]) {
    let nch = n_in.div_ceil(128);
    for c in 0..nch {
        let (g, k) = (c / 8, c % 8);
        // lanes whose 4 elements lie inside the row
        let lanes = (n_in - 128 * c).div_ceil(4).min(32);
        match kind {
            LowBit::Q1 => {
                // lane l: the 4 bits of elements 128c + 4l ..: a nibble of byte 16c + l / 2
                let bytes = &row[16 * c..];
                for l in 0..lanes {
                    let nib = (bytes[l / 2] >> (4 * (l % 2))) & 0xF;
                    out[g * 32 + l] |= u32::from(nib) << (4 * k);
                }
            }
            LowBit::Q2g128 | LowBit::Q2g64 => {
                // 2-bit codes: lane l's 4 elements are byte 32c + l
                let bytes = &row[32 * c..];
                for (l, &byte) in bytes.iter().take(lanes).enumerate() {
                    out[(g * 32 + l) * 2 + k / 4] |= u32::from(byte) << (8 * (k % 4));
                }
            }
        }
    }
}

/// Split `data` (`n_out` rows of `n_in / block` blocks) for the int8-activation mat-vec
/// (`mv_dot.comp`): codes `[n_out, n_in / 32, words]` u32 (1 word per 32-element block for Q1_0,
/// 2 for 2-bit codes) and scales `[n_out, ceil(n_in / block / 2)]` u32, two f16 per word (the even
/// block in the low half; the file's f16 bits unchanged). In a Q1_0 word, bit `8i + k` is element
/// `4k + i` of the 32-element block, so `(w >> k) & 0x01010101` gives the bits of elements
/// `4k .. 4k + 3` as bytes; in a 2-bit word `h`, bits `8i + 2k ..` hold the code of element
/// `16h + 4k + i`, so `(w >> 2k) & 0x03030303` gives four codes as bytes. `None` as for
/// [`split_blocks`].
pub fn split_blocks_dot(
    kind: LowBit,
    data: &[u8],
    n_in: usize,
    n_out: usize,
) -> Option<(Vec<u32>, Vec<u32>)> {
    if n_in % kind.block() != 0 {
        return None;
    }
    let nblk = n_in / kind.block();
    if data.len() != n_out * nblk * kind.block_bytes() {
        return None;
    }
    let (nb32, lw) = (n_in / 32, lane_words(kind));
    Some(split_rows(
        kind,
        data,
        nblk,
        n_out,
        nb32 * lw,
        nblk.div_ceil(2),
        |rb, out, sc_row| {
            for (b, blk) in rb.chunks_exact(kind.block_bytes()).enumerate() {
                let d = u32::from(u16::from_le_bytes([blk[0], blk[1]]));
                sc_row[b / 2] |= d << (16 * (b % 2));
                let qs = &blk[2..];
                // the block's 32-element sub-blocks
                for sb in 0..kind.block() / 32 {
                    let w = &mut out[(b * kind.block() / 32 + sb) * lw..][..lw];
                    for e in 0..32 {
                        let j = 32 * sb + e; // element within the weight block
                        match kind {
                            LowBit::Q1 => {
                                let bit = (qs[j >> 3] >> (j & 7)) & 1;
                                let (k, i) = (e / 4, e % 4);
                                w[0] |= u32::from(bit) << (8 * i + k);
                            }
                            LowBit::Q2g128 | LowBit::Q2g64 => {
                                let c = (qs[j >> 2] >> (2 * (j & 3))) & 3;
                                let (h, k, i) = (e / 16, (e % 16) / 4, e % 4);
                                w[h] |= u32::from(c) << (8 * i + 2 * k);
                            }
                        }
                    }
                }
            }
        },
    ))
}
