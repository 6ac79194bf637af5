//! Host emulation of the o8 mat-vec family (`kernels/mvo.cu`; tests only, no GPU).
//!
//! `mvo_*` (dp4a, one activation row) and `mvt_*` (int8 tensor cores, n ≤ 8) were written without
//! a GPU and must agree bit for bit. These tests replay both in Rust: mvo lane by lane (the
//! sub-block → partial assignment, the split unpack of `sub_dot`, the 4-2-1 butterfly, the K
//! parts), mvt fragment by fragment (what every lane loads into the `mma.m16n8k32` A and B
//! registers, the MMA under the PTX layout of `gemm.cu`, the exact int-to-float, the partial
//! tree). They check that the two give the same bits for every row and activation row, at every
//! K split, on ragged shapes, and that both match an f64 reference. They cannot catch a wrong PTX
//! spelling or a race: `tests/gpu_kernels.rs` does that on the GPU.

use crate::host_quant;
use crate::mvm_emu::{mma, unit_rows, Rng, EMU_KINDS};
use crate::retile::{retile, Retiled, WKind};
use bonsai_kernels_cpu::quant::dequantize_row;
use bonsai_kernels_cpu::QuantType;
use half::f16;

const MAGIC: i32 = 0x4B40_0000;

fn word(c: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(c[4 * i..4 * i + 4].try_into().unwrap())
}

/// `dp4a.u32.s32`: bytes of `a` unsigned, of `b` signed.
fn dp4a_us(a: u32, b: u32, c: i32) -> i32 {
    (0..4).fold(c, |acc, e| {
        acc + ((a >> (8 * e)) & 0xff) as i32 * ((b >> (8 * e)) as u8 as i8 as i32)
    })
}

/// `sub_dot<KIND>` of bonsai.cu on code word(s) `w` (Q2: two words) and activation words `qa`.
pub(crate) fn sub_dot(kind: WKind, w: [u32; 2], qa: &[u32; 8], sa: i32) -> i32 {
    let (mut lo, mut hi) = (0i32, 0i32);
    if kind == WKind::Q1 {
        for (i, &q) in qa.iter().enumerate().take(4) {
            lo = dp4a_us((w[0] >> i) & 0x0101_0101, q, lo);
        }
        for (i, &q) in qa.iter().enumerate().skip(4) {
            hi = dp4a_us((w[0] << (7 - i)) & 0x8080_8080, q, hi);
        }
        2 * lo + (hi >> 6) - sa
    } else {
        for h in 0..2 {
            let x = w[h];
            lo = dp4a_us(x & 0x0303_0303, qa[4 * h], lo);
            lo = dp4a_us((x >> 2) & 0x0303_0303, qa[4 * h + 1], lo);
            hi = dp4a_us((x << 2) & 0xC0C0_C0C0, qa[4 * h + 2], hi);
            hi = dp4a_us(x & 0xC0C0_C0C0, qa[4 * h + 3], hi);
        }
        lo + (hi >> 6) - sa
    }
}

fn q1_plane(w: u32, i: usize) -> u32 {
    !(((w >> i) & 0x0101_0101).wrapping_mul(0xFE))
}

fn q2_plane(w: u32, s: usize) -> u32 {
    (((w >> (2 * s)) & 0x0303_0303) + 0x7F7F_7F7F) ^ 0x8080_8080
}

/// The `mma.m16n8k32` A and B fragments of every lane for sub-block `j` of the m16 tile at row
/// `o0` (rows past `n_out` clamped) against token columns 0..n (past `n` clamped): A the signed
/// codes (Q1 ±1, Q2 c − 1) in the `gemm.cu` element mapping, B the 8 activation bytes
/// 8tg..8tg + 7 of column g. `code(o, j)` gives a row's code word(s), `qword(t, byte)` 4
/// activation bytes. Shared with the sub-scale emulation (`sub_emu.rs`).
pub(crate) fn mvt_fragments(
    kind: WKind,
    code: impl Fn(usize, usize) -> [u32; 2],
    qword: impl Fn(usize, usize) -> u32,
    (o0, n_out, n): (usize, usize, usize),
    j: usize,
) -> ([[u32; 4]; 32], [[u32; 2]; 32]) {
    let mut a = [[0u32; 4]; 32];
    let mut b = [[0u32; 2]; 32];
    for lane in 0..32 {
        let (g, tg) = (lane >> 2, lane & 3);
        let ra = (o0 + g).min(n_out - 1);
        let rb = (o0 + g + 8).min(n_out - 1);
        a[lane] = if kind == WKind::Q1 {
            let (xa, xb) = (code(ra, j)[0], code(rb, j)[0]);
            [
                q1_plane(xa, 2 * tg),
                q1_plane(xb, 2 * tg),
                q1_plane(xa, 2 * tg + 1),
                q1_plane(xb, 2 * tg + 1),
            ]
        } else {
            let (xa, xb) = (code(ra, j)[tg >> 1], code(rb, j)[tg >> 1]);
            let f = 2 * (tg & 1);
            [
                q2_plane(xa, f),
                q2_plane(xb, f),
                q2_plane(xa, f + 1),
                q2_plane(xb, f + 1),
            ]
        };
        let tb = g.min(n - 1);
        b[lane] = [qword(tb, 32 * j + 8 * tg), qword(tb, 32 * j + 8 * tg + 4)];
    }
    (a, b)
}

/// `n_out` random rows of `qt` with random positive block scales (0.01..0.11), raw and re-tiled.
pub(crate) fn scaled_rows(
    rng: &mut Rng,
    qt: QuantType,
    n_in: usize,
    n_out: usize,
) -> (Vec<u8>, Retiled) {
    let mut raw = unit_rows(rng, qt, n_in, n_out);
    for blk in raw.chunks_exact_mut(qt.block_bytes()) {
        let sc = 0.01 + (rng.next() % 1000) as f32 / 1e4;
        blk[..2].copy_from_slice(&f16::from_f32(sc).to_bits().to_le_bytes());
    }
    let rt = retile(qt, &raw, n_in, n_out);
    (raw, rt)
}

/// Sub-block `j` of row `o` in a re-tiled code plane of `nsb` sub-blocks per row: its code
/// word, or (Q2 kinds, `words_per_sb` 2) its two words.
pub(crate) fn code_words(
    codes: &[u8],
    nsb: usize,
    words_per_sb: usize,
    o: usize,
    j: usize,
) -> [u32; 2] {
    let base = (o * nsb + j) * words_per_sb;
    if words_per_sb == 1 {
        [word(codes, base), 0]
    } else {
        [word(codes, base), word(codes, base + 1)]
    }
}

/// A re-tiled matrix and its int8 activations (`host_quant`'s q, d, s), as the kernels see them.
/// Shared with the mvc emulation (`mvc_emu.rs`).
pub(crate) struct Setup {
    pub(crate) rt: Retiled,
    pub(crate) nsb: usize,
    pub(crate) spb: usize,
    pub(crate) words_per_sb: usize,
    pub(crate) q: Vec<i8>,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<i32>,
}

impl Setup {
    /// `rt` with the activation rows `x` (`[n, n_in]` f32) quantized as the device does.
    pub(crate) fn new(rt: Retiled, x: &[f32], n_in: usize) -> Setup {
        let (q, d, s) = host_quant(x, n_in);
        let kind = rt.kind;
        Setup {
            nsb: n_in / 32,
            spb: if kind == WKind::Q2G64 { 2 } else { 4 },
            words_per_sb: if kind == WKind::Q1 { 1 } else { 2 },
            rt,
            q,
            d,
            s,
        }
    }
    /// Code word(s) of sub-block `j` of row `o`.
    pub(crate) fn code(&self, o: usize, j: usize) -> [u32; 2] {
        code_words(&self.rt.codes, self.nsb, self.words_per_sb, o, j)
    }
    /// The f16 weight scale of sub-block `j` of row `o`.
    pub(crate) fn dw(&self, o: usize, j: usize) -> f32 {
        let nblk = self.nsb / self.spb;
        f16::from_bits(self.rt.scales[o * nblk + j / self.spb]).to_f32()
    }
    /// Activation bytes `byte .. byte + 4` of row `t`.
    pub(crate) fn qword(&self, t: usize, byte: usize) -> u32 {
        let n_in = self.nsb * 32;
        let b = &self.q[t * n_in + byte..t * n_in + byte + 4];
        u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
    }
}

/// The mvo value of row `o` for activation row `t` with K split `ks`.
fn mvo_row(su: &Setup, o: usize, t: usize, ks: usize) -> f32 {
    let mut v = 0f32;
    for kp in 0..ks {
        let mut acc = [0f32; 8];
        for (p, a) in acc.iter_mut().enumerate() {
            let mut j = 8 * kp + p;
            while j < su.nsb {
                let qa: [u32; 8] = std::array::from_fn(|i| su.qword(t, 32 * j + 4 * i));
                let dt = su.d[t * su.nsb + j];
                let isum = sub_dot(su.rt.kind, su.code(o, j), &qa, su.s[t * su.nsb + j]);
                *a = (su.dw(o, j) * dt).mul_add(isum as f32, *a);
                j += 8 * ks;
            }
        }
        // xor butterfly 4, 2, 1 (what lane 0 ends with; every lane has the same bits)
        let part =
            ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        v = if kp == 0 { part } else { v + part };
    }
    v
}

/// The mvt values `[n][rows]` of the m16 tile starting at row `o0` (rows past `n_out` clamped
/// for loads, like the kernel), K split `ks`, `n` activation rows.
fn mvt_tile(su: &Setup, o0: usize, n_out: usize, n: usize, ks: usize) -> Vec<[f32; 16]> {
    let kind = su.rt.kind;
    let mut out = vec![[0f32; 16]; n];
    let mut total = [[0f32; 4]; 32];
    for kp in 0..ks {
        let mut acc = [[[0f32; 4]; 8]; 32]; // [lane][partial][value]
        let mut c = kp;
        while 8 * c < su.nsb {
            for s in 0..8 {
                let j = 8 * c + s;
                if j >= su.nsb {
                    continue;
                }
                let (a, b) = mvt_fragments(
                    kind,
                    |o, j| su.code(o, j),
                    |t, byte| su.qword(t, byte),
                    (o0, n_out, n),
                    j,
                );
                let d = mma(&a, &b, &[[MAGIC; 4]; 32]);
                for lane in 0..32 {
                    let (g, tg) = (lane >> 2, lane & 3);
                    let ra = (o0 + g).min(n_out - 1);
                    let rb = (o0 + g + 8).min(n_out - 1);
                    let t0 = (2 * tg).min(n - 1);
                    let t1 = (2 * tg + 1).min(n - 1);
                    let (dwa, dwb) = (su.dw(ra, j), su.dw(rb, j));
                    let (dt0, dt1) = (su.d[t0 * su.nsb + j], su.d[t1 * su.nsb + j]);
                    let sc = [dwa * dt0, dwa * dt1, dwb * dt0, dwb * dt1];
                    for e in 0..4 {
                        let f = f32::from_bits(d[lane][e] as u32) - 12_582_912.0;
                        acc[lane][s][e] = sc[e].mul_add(f, acc[lane][s][e]);
                    }
                }
            }
            c += ks;
        }
        for lane in 0..32 {
            for e in 0..4 {
                let p = |s: usize| acc[lane][s][e];
                let part = ((p(0) + p(4)) + (p(2) + p(6))) + ((p(1) + p(5)) + (p(3) + p(7)));
                total[lane][e] = if kp == 0 { part } else { total[lane][e] + part };
            }
        }
    }
    scatter_c(&total, &mut out);
    out
}

/// The C fragments of every lane (`[lane][value]`: rows g / g + 8, token columns 2tg, 2tg + 1) as
/// `out[token][row]` for the tokens `out` holds.
pub(crate) fn scatter_c(total: &[[f32; 4]; 32], out: &mut [[f32; 16]]) {
    for lane in 0..32 {
        let (g, tg) = (lane >> 2, lane & 3);
        for e in 0..4 {
            let (r, t) = (if e < 2 { g } else { g + 8 }, 2 * tg + (e & 1));
            if t < out.len() {
                out[t][r] = total[lane][e];
            }
        }
    }
}

#[test]
fn mvt_rows_equal_mvo_rows_bit_for_bit() {
    let mut rng = Rng(11);
    for qt in EMU_KINDS {
        // 384: 12 sub-blocks (a partial chunk of 8); 1280: 40 (5 chunks); 50 rows: a partial tile
        for (n_in, n_out) in [(384usize, 50usize), (1280, 16)] {
            let (raw, rt) = scaled_rows(&mut rng, qt, n_in, n_out);
            let n = 5;
            let x: Vec<f32> = (0..n * n_in)
                .map(|_| (rng.next() % 20_001) as f32 / 1e4 - 1.0)
                .collect();
            let su = Setup::new(rt, &x, n_in);
            // f64 reference from the dequantized weights and the int8 activations
            let rb = qt.row_bytes(n_in).unwrap();
            let mut wrow = vec![0f32; n_in];
            for ks in [1, 2, 4] {
                for o0 in (0..n_out).step_by(16) {
                    let tile = mvt_tile(&su, o0, n_out, n, ks);
                    for (t, row) in tile.iter().enumerate() {
                        for r in 0..16 {
                            let o = o0 + r;
                            if o >= n_out {
                                continue;
                            }
                            let one = mvo_row(&su, o, t, ks);
                            assert_eq!(
                                row[r].to_bits(),
                                one.to_bits(),
                                "{qt:?} [{n_in}x{n_out}] ks {ks} row {o} t {t}: mvt {} vs mvo {one}",
                                row[r]
                            );
                            dequantize_row(qt, &raw[o * rb..(o + 1) * rb], &mut wrow);
                            let want: f64 = (0..n_in)
                                .map(|i| {
                                    wrow[i] as f64
                                        * su.q[t * n_in + i] as f64
                                        * su.d[t * su.nsb + i / 32] as f64
                                })
                                .sum();
                            let err = (one as f64 - want).abs() / want.abs().max(1.0);
                            assert!(err < 1e-4, "{qt:?} row {o} t {t}: {one} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
