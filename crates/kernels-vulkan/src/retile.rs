//! The low-bit weights as the `mv` shader reads them: the file's blocks split into a code plane of
//! little-endian u32 words (the block's code bytes unchanged, 4-byte aligned) and an f32 scale
//! plane. Driven by the block layout alone (MODEL.md §1.2); knows no tensor names.

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

/// Split `data` (`n_out` rows of `n_in / block` blocks) into codes `[n_out, nblk, code_bytes / 4]`
/// u32 and scales `[n_out, nblk]` f32. `None` when `n_in` is not a whole number of blocks or the
/// byte count is not `n_out` rows of blocks.
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
    let mut codes = Vec::with_capacity(n_out * nblk * kind.code_bytes() / 4);
    let mut scales = Vec::with_capacity(n_out * nblk);
    for blk in data.chunks_exact(kind.block_bytes()) {
        scales.push(f16::from_le_bytes([blk[0], blk[1]]).to_f32());
        codes.extend(
            blk[2..]
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
        );
    }
    Some((codes, scales))
}
