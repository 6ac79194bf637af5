//! The DSpark drafter's Q4_1 matrices in the tensor-core layout of `mvt_q41` (`kernels/mvq41t.cu`),
//! and the kernel's host twin.
//!
//! [`retile_q41t`] cuts a matrix into tiles of 16 rows and a tile into records of
//! [`Q41T_REC`] bytes, one per pair of 32-element blocks; [`mv_q41t_host`] performs the kernel's
//! float operations in its order, so the GPU test compares the two bit for bit. The fragment test
//! below replays the kernel's register reads from the records, places them by the PTX fragment
//! layout of `mma.m16n8k32` and checks each block's integer against the GGUF codes.

use rayon::prelude::*;

/// Bytes of one record: 512 bytes of code words (a `uint4` per lane), 128 of `(d, m)` pairs.
pub const Q41T_REC: usize = 640;
/// Rows of a tile.
pub const Q41T_ROWS: usize = 16;
/// Warps of a block, each a contiguous run of a tile's chunks (`Q41T_WARPS` in the source).
pub const Q41T_WARPS: usize = 8;
/// Ring stages per warp (`Q41T_S` in the source).
pub const Q41T_STAGES: usize = 2;
/// Records per chunk, one chunk per stage (`Q41T_C` in the source).
pub const Q41T_PER_STAGE: usize = 4;

/// Dynamic shared memory of one `mvt_q41` block.
pub const fn q41t_smem_bytes() -> usize {
    Q41T_WARPS * Q41T_STAGES * Q41T_PER_STAGE * Q41T_REC
}

/// Tiles of a matrix of `n_out` rows.
pub fn q41t_tiles(n_out: usize) -> usize {
    n_out.div_ceil(Q41T_ROWS)
}

/// Records (block pairs) per tile for `n_in` inputs: a whole number of chunks.
pub fn q41t_pairs(n_in: usize) -> usize {
    (n_in / 32).div_ceil(2).next_multiple_of(Q41T_PER_STAGE)
}

/// Bytes of a re-tiled `[n_in, n_out]` matrix.
pub fn q41t_bytes(n_in: usize, n_out: usize) -> usize {
    q41t_tiles(n_out) * q41t_pairs(n_in) * Q41T_REC
}

/// Re-tile a Q4_1 matrix (`n_out` GGUF rows of `n_in` elements, `n_in % 32 == 0`) into `mvt_q41`'s
/// records (see `kernels/mvq41t.cu`): tile T, pair p at byte `(T·pairs + p)·640` with
/// [`q41t_pairs`] records per tile; in it, lane l = 4g + tg's 16 bytes at `16·l` are a word of rows
/// 16T + g and 16T + g + 8 of block 2p, then of block 2p + 1, whose byte i holds the codes of
/// elements 8tg + i (low nibble) and 8tg + 4 + i (high nibble), and g's 16 bytes at `512 + 16·g`
/// the `(d | m << 16)` of the same rows and blocks. Rows past `n_out` and blocks past `n_in / 32` are
/// zero. Panics if `raw` has the wrong
/// length (the loader validates extents first).
pub fn retile_q41t(raw: &[u8], n_in: usize, n_out: usize) -> Vec<u8> {
    assert!(n_in > 0 && n_in % 32 == 0, "retile_q41t: n_in {n_in}");
    let nb = n_in / 32;
    let rb = nb * 20;
    assert_eq!(raw.len(), rb * n_out, "retile_q41t: raw length");
    let np = q41t_pairs(n_in);
    let mut out = vec![0u8; q41t_bytes(n_in, n_out)];
    out.par_chunks_mut(np * Q41T_REC)
        .enumerate()
        .for_each(|(t, tile)| {
            // block b of row r of this tile (None past the matrix)
            let blk = |r: usize, b: usize| -> Option<&[u8]> {
                let o = t * Q41T_ROWS + r;
                (o < n_out && b < nb).then(|| &raw[o * rb + b * 20..o * rb + b * 20 + 20])
            };
            for (p, rec) in tile.chunks_exact_mut(Q41T_REC).enumerate() {
                for g in 0..8 {
                    for h in 0..2 {
                        let b = 2 * p + h;
                        for (i, r) in [g, g + 8].into_iter().enumerate() {
                            let Some(k) = blk(r, b) else { continue };
                            // GGUF code of element e: byte e (e < 16) low nibble, byte e − 16 high
                            let code = |e: usize| {
                                if e < 16 {
                                    k[4 + e] & 0xF
                                } else {
                                    k[4 + e - 16] >> 4
                                }
                            };
                            for tg in 0..4 {
                                let at = 16 * (4 * g + tg) + 4 * (2 * h + i);
                                for e in 0..4 {
                                    rec[at + e] = code(8 * tg + e) | code(8 * tg + 4 + e) << 4;
                                }
                            }
                            let at = 512 + 16 * g + 4 * (2 * h + i);
                            rec[at..at + 4].copy_from_slice(&k[..4]);
                        }
                    }
                }
            }
        });
    out
}

fn f16_bits(h: u32) -> f32 {
    half::f16::from_bits(h as u16).to_f32()
}

/// `mvt_q41` on the host, bit for bit: `y [n, n_out]` of `n` int8 activation rows (`q [n, n_in]`,
/// scales `d [n, nb]`, sums `s [n, nb]`, as `host_quant` gives them) through a matrix re-tiled by
/// [`retile_q41t`]. Per weight row o and activation row t: each warp's run of chunks,
/// `acc = fma(dt, fma(dw, C, mw·st), acc)` in increasing block order from 0 (the zero blocks past
/// `nb` too, with the last block's `dt`, `st`), then the warps' parts added in order.
pub fn mv_q41t_host(
    rec: &[u8],
    n_in: usize,
    n_out: usize,
    q: &[i8],
    d: &[f32],
    s: &[i32],
    n: usize,
) -> Vec<f32> {
    let nb = n_in / 32;
    let np = q41t_pairs(n_in);
    assert_eq!(rec.len(), q41t_bytes(n_in, n_out));
    assert!(q.len() >= n * n_in && d.len() >= n * nb && s.len() >= n * nb);
    let word = |at: usize| u32::from_le_bytes([rec[at], rec[at + 1], rec[at + 2], rec[at + 3]]);
    let mut y = vec![0f32; n * n_out];
    for o in 0..n_out {
        let (t, r) = (o / Q41T_ROWS, o % Q41T_ROWS);
        let (g, i) = (r % 8, r / 8);
        for a in 0..n {
            let mut v = 0f32;
            let nch = np / Q41T_PER_STAGE;
            for w in 0..Q41T_WARPS {
                let (k0, k1) = (w * nch / Q41T_WARPS, (w + 1) * nch / Q41T_WARPS);
                let mut acc = 0f32;
                for p in k0 * Q41T_PER_STAGE..k1 * Q41T_PER_STAGE {
                    let base = (t * np + p) * Q41T_REC;
                    for h in 0..2 {
                        // a zero block past nb: C = 0, (d, m) = 0, the last block's activations
                        let (b, ba) = (2 * p + h, (2 * p + h).min(nb - 1));
                        // the block integer: lane (g, tg)'s word, nibbles by the fragment order
                        let mut c = 0i32;
                        for tg in 0..4 {
                            let cw = word(base + 16 * (4 * g + tg) + 4 * (2 * h + i));
                            for e in 0..4 {
                                let lo = (cw >> (8 * e)) & 0xF;
                                let hi = (cw >> (8 * e + 4)) & 0xF;
                                c += lo as i32 * q[a * n_in + 32 * ba + 8 * tg + e] as i32;
                                c += hi as i32 * q[a * n_in + 32 * ba + 8 * tg + 4 + e] as i32;
                            }
                        }
                        let dm = word(base + 512 + 16 * g + 4 * (2 * h + i));
                        let (dw, mw) = (f16_bits(dm & 0xFFFF), f16_bits(dm >> 16));
                        debug_assert!(b < nb || (c == 0 && dm == 0));
                        let (dt, st) = (d[a * nb + ba], s[a * nb + ba] as f32);
                        acc = dt.mul_add(dw.mul_add(c as f32, mw * st), acc);
                    }
                }
                v = if w == 0 { acc } else { v + acc };
            }
            y[a * n_out + o] = v;
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retile::tests::rand_bytes;
    use half::f16;

    /// A random Q4_1 matrix with finite scales of both signs.
    fn rand_q41(seed: u64, n_in: usize, n_out: usize) -> Vec<u8> {
        let mut raw = rand_bytes(seed, n_in / 32 * 20 * n_out);
        for blk in raw.chunks_exact_mut(20) {
            let d = f16::from_f32(0.0005 + (blk[4] as f32) / 4000.0).to_bits();
            let m = f16::from_f32((blk[5] as f32 - 128.0) / 500.0).to_bits();
            blk[..2].copy_from_slice(&d.to_le_bytes());
            blk[2..4].copy_from_slice(&m.to_le_bytes());
        }
        raw
    }

    /// GGUF code of element j of block b of row o.
    fn code(raw: &[u8], n_in: usize, o: usize, b: usize, j: usize) -> u8 {
        let blk = &raw[(o * n_in / 32 + b) * 20..][..20];
        if j < 16 {
            blk[4 + j] & 0xF
        } else {
            blk[4 + j - 16] >> 4
        }
    }

    #[test]
    fn q41t_fragments_give_each_block_integer() {
        // ragged rows (a partial last tile), an odd block count (a lone last block), the drafter's
        // widths
        for (n_in, n_out, n) in [(96, 21, 3), (160, 16, 8), (5120, 40, 5)] {
            let raw = rand_q41(n_in as u64 * 7 + n_out as u64, n_in, n_out);
            let rec = retile_q41t(&raw, n_in, n_out);
            assert_eq!(rec.len(), q41t_bytes(n_in, n_out));
            let qa: Vec<i8> = rand_bytes(99, n * n_in).iter().map(|&b| b as i8).collect();
            let (nb, np) = (n_in / 32, q41t_pairs(n_in));
            let word = |at: usize| u32::from_le_bytes(rec[at..at + 4].try_into().unwrap());
            for t in 0..q41t_tiles(n_out) {
                for b in 0..2 * np {
                    let (p, h) = (b / 2, b % 2);
                    let base = (t * np + p) * Q41T_REC;
                    // A [16][32] and B [32][8] from the registers the kernel builds, placed by the
                    // m16n8k32 fragment layout: a0 (row g, k 4tg + e), a1 (row g + 8, same k),
                    // a2 (row g, k 16 + 4tg + e), a3 (row g + 8, same k); b0 (k 4tg + e, column g),
                    // b1 (k 16 + 4tg + e, column g); C: c0, c1 (row g, columns 2tg, 2tg + 1),
                    // c2, c3 (row g + 8)
                    let mut am = [[0i32; 32]; 16];
                    let mut bm = [[0i32; 8]; 32];
                    for lane in 0..32 {
                        let (g, tg) = (lane / 4, lane % 4);
                        let (wg, wg8) = (
                            word(base + 16 * lane + 8 * h),
                            word(base + 16 * lane + 8 * h + 4),
                        );
                        let a = [
                            wg & 0x0F0F_0F0F,
                            wg8 & 0x0F0F_0F0F,
                            (wg >> 4) & 0x0F0F_0F0F,
                            (wg8 >> 4) & 0x0F0F_0F0F,
                        ];
                        for e in 0..4 {
                            let byte = |v: u32| ((v >> (8 * e)) & 0xFF) as i32;
                            am[g][4 * tg + e] = byte(a[0]);
                            am[g + 8][4 * tg + e] = byte(a[1]);
                            am[g][16 + 4 * tg + e] = byte(a[2]);
                            am[g + 8][16 + 4 * tg + e] = byte(a[3]);
                            if g < n && b < nb {
                                // the kernel's 8-byte load at element 8tg of the block: b0
                                // elements 8tg .. 8tg + 3, b1 8tg + 4 ..
                                bm[4 * tg + e][g] = qa[g * n_in + 32 * b + 8 * tg + e] as i32;
                                bm[16 + 4 * tg + e][g] =
                                    qa[g * n_in + 32 * b + 8 * tg + 4 + e] as i32;
                            }
                        }
                    }
                    for r in 0..16 {
                        let o = t * 16 + r;
                        let dm = word(base + 512 + 16 * (r % 8) + 8 * h + 4 * (r / 8));
                        for col in 0..8 {
                            let c: i32 = (0..32).map(|k| am[r][k] * bm[k][col]).sum();
                            let want: i32 = if o < n_out && b < nb && col < n {
                                (0..32)
                                    .map(|j| {
                                        code(&raw, n_in, o, b, j) as i32
                                            * qa[col * n_in + 32 * b + j] as i32
                                    })
                                    .sum()
                            } else {
                                0
                            };
                            assert_eq!(
                                c, want,
                                "{n_in}x{n_out}: tile {t} block {b} row {r} col {col}"
                            );
                        }
                        let want_dm = if o < n_out && b < nb {
                            let k = &raw[(o * nb + b) * 20..][..4];
                            u32::from_le_bytes(k.try_into().unwrap())
                        } else {
                            0
                        };
                        assert_eq!(
                            dm, want_dm,
                            "{n_in}x{n_out}: (d, m) of tile {t} block {b} row {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn q41t_host_twin_is_the_q41_dot() {
        // the twin against an f64 sum of the same int8 math (and so the layout against GGUF)
        let (n_in, n_out, n) = (5120 + 96, 37, 4);
        let raw = rand_q41(5, n_in, n_out);
        let rec = retile_q41t(&raw, n_in, n_out);
        let x: Vec<f32> = rand_bytes(6, n * n_in)
            .iter()
            .map(|&b| (b as f32 - 127.5) / 64.0)
            .collect();
        let (q, d, s) = crate::host_quant(&x, n_in);
        let y = mv_q41t_host(&rec, n_in, n_out, &q, &d, &s, n);
        let nb = n_in / 32;
        for t in 0..n {
            for o in 0..n_out {
                let (mut r, mut mag) = (0f64, 0f64);
                for b in 0..nb {
                    let k = &raw[(o * nb + b) * 20..][..4];
                    let dw = f16::from_bits(u16::from_le_bytes([k[0], k[1]])).to_f64();
                    let mw = f16::from_bits(u16::from_le_bytes([k[2], k[3]])).to_f64();
                    let is: i64 = (0..32)
                        .map(|j| code(&raw, n_in, o, b, j) as i64 * q[t * n_in + 32 * b + j] as i64)
                        .sum();
                    let (da, sa) = (d[t * nb + b] as f64, s[t * nb + b] as f64);
                    r += da * (dw * is as f64 + mw * sa);
                    mag += da.abs() * ((dw * is as f64).abs() + (mw * sa).abs());
                }
                let e = (y[t * n_out + o] as f64 - r).abs() / (mag + 1e-6);
                assert!(
                    e <= 1e-5,
                    "row {o} t {t}: {} vs {r} (rel {e:e})",
                    y[t * n_out + o]
                );
            }
        }
    }
}
