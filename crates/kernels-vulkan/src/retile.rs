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
    let mut codes = vec![0u32; n_out * ng * 32 * lw];
    let mut scales = vec![0f32; n_out * nblk];
    let row_bytes = nblk * kind.block_bytes();
    // rows are independent: split them over the machine's threads (a 27B load re-tiles ~4 GB)
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(32);
    let rows_per = n_out.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for ((src, dst), sdst) in data
            .chunks(rows_per * row_bytes)
            .zip(codes.chunks_mut(rows_per * ng * 32 * lw))
            .zip(scales.chunks_mut(rows_per * nblk))
        {
            sc.spawn(move || {
                let mut row = vec![0u8; nblk * kind.code_bytes()];
                for ((rb, out), sc_row) in src
                    .chunks_exact(row_bytes)
                    .zip(dst.chunks_exact_mut(ng * 32 * lw))
                    .zip(sdst.chunks_exact_mut(nblk))
                {
                    for ((b, blk), d) in rb.chunks_exact(kind.block_bytes()).enumerate().zip(sc_row)
                    {
                        *d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                        row[b * kind.code_bytes()..(b + 1) * kind.code_bytes()]
                            .copy_from_slice(&blk[2..]);
                    }
                    tile_row(kind, &row, n_in, out);
                }
            });
        }
    });
    Some((codes, scales))
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
