//! Host emulation of the integer sub-scale mat-vec design (tests only; no kernel uses it yet).
//!
//! The design is the kernels README's "a verify that costs about one step". Activations carry one
//! f32 unit per weight scale block: 128 elements, or 64 for Q2_0 g64. Each 32-element sub-block
//! carries an integer sub-scale m_j in 1..=16. A block's sub-block dot products then add up
//! exactly in int32, Σ_j m_j · isum_j, before one float rescale per block.
//!
//! The only float order left is across blocks: block B adds into partial B mod (blocks per chunk),
//! each partial is an fma chain over the chunks, and the partials go through a fixed butterfly.
//! Two kernels follow that order:
//! - a one-row dp4a kernel: a lane per sub-block, as the plain kernel of `bonsai.cu`; a block's
//!   lanes add their m_j · isum_j, and one fma per block;
//! - an int8 tensor-core verify kernel: one `mma.m16n8k32` per sub-block; each accumulator
//!   fragment is multiplied by its token column's m_j in int32; one fma per block.
//!
//! The verify kernel then needs 8 partials × 4 values per lane, where the per-32 order needs 128
//! accumulator registers. The o8 family (`mvo_emu.rs`) paid 12 float operations per MMA instead.
//!
//! These tests replay both kernels and check that they give the same bits for every row and
//! activation row at every K split, and that both match an f64 reference. They also check the
//! quantizer's bounds and its error against the per-32 scheme. Like `mvo_emu.rs`, they cannot
//! catch a wrong PTX spelling or a race.

use crate::mvm_emu::{mma, Rng, EMU_KINDS};
use crate::mvo_emu::{code_words, mvt_fragments, scaled_rows, scatter_c, sub_dot};
use crate::retile::{Retiled, WKind};
use crate::{host_quant, host_quant_sub, mv_sub_host, SubActs};
use bonsai_kernels_cpu::quant::dequantize_row;
use half::f16;

/// Sub-scale levels: m_j in 1..=LEVELS.
const LEVELS: i32 = 16;

/// Rows of `x` (`[n, k]`) quantized with groups of `ge` elements by [`host_quant_sub`], the twin of
/// the `quant_rows_sub` kernel.
fn quant_sub(x: &[f32], k: usize, ge: usize) -> SubActs {
    let (q, u, m, s) = host_quant_sub(x, k, ge);
    SubActs { q, u, m, s }
}

struct Setup {
    rt: Retiled,
    nsb: usize,
    /// Sub-blocks per weight scale block (= per activation group).
    spb: usize,
    words_per_sb: usize,
    a: SubActs,
}

impl Setup {
    fn code(&self, o: usize, j: usize) -> [u32; 2] {
        code_words(&self.rt.codes, self.nsb, self.words_per_sb, o, j)
    }
    /// Weight scale of block `blk` of row `o`.
    fn dw(&self, o: usize, blk: usize) -> f32 {
        f16::from_bits(self.rt.scales[o * (self.nsb / self.spb) + blk]).to_f32()
    }
    /// Activation unit of group `blk` of row `t`.
    fn u(&self, t: usize, blk: usize) -> f32 {
        self.a.u[t * (self.nsb / self.spb) + blk]
    }
    fn m(&self, t: usize, j: usize) -> i32 {
        self.a.m[t * self.nsb + j]
    }
    fn qword(&self, t: usize, byte: usize) -> u32 {
        let n_in = self.nsb * 32;
        let b = &self.a.q[t * n_in + byte..t * n_in + byte + 4];
        u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
    }
    /// Blocks per 32-sub-block chunk: the partials of a K part.
    fn bpc(&self) -> usize {
        32 / self.spb
    }
}

/// The fixed butterfly over the partials (lane groups p and p ^ w, w = 1, 2, 4, ...): what lane
/// group 0 ends with, ((P0 + P1) + (P2 + P3)) + ((P4 + P5) + (P6 + P7)) for 8 partials. Every
/// lane gets the same bits (float addition is commutative).
fn butterfly(part: &[f32]) -> f32 {
    let mut x = part.to_vec();
    let mut w = 1;
    while w < x.len() {
        x = (0..x.len()).map(|p| x[p] + x[p ^ w]).collect();
        w <<= 1;
    }
    x[0]
}

/// The one-row dp4a kernel's value of row `o` for activation row `t`, K split `ks`. Written for a
/// lane per sub-block; a lane per block (lane q of 8 taking blocks q, q + 8, ..., the layout the
/// kernels README recommends) runs the same float operations in the same order.
/// - Chunk c (sub-blocks 32c..32c + 31, lane l on 32c + l) belongs to K part c mod ks.
/// - Lane group p (lanes spb·p ..) holds block c · bpc + p.
/// - Its lanes' Σ m_j · isum_j is exact in int32, so the order of their shuffle does not matter.
/// - One lane then does partial[p] = fma(dw · u, isum, partial[p]), the chunks in increasing order.
/// - After the chunks: the butterfly, then the K parts in order.
fn row_dp4a(su: &Setup, o: usize, t: usize, ks: usize) -> f32 {
    let (bpc, nch) = (su.bpc(), su.nsb.div_ceil(32));
    let mut v = 0f32;
    for kp in 0..ks {
        let mut part = vec![0f32; bpc];
        for c in (kp..nch).step_by(ks) {
            for (p, pa) in part.iter_mut().enumerate() {
                let blk = c * bpc + p;
                if blk * su.spb >= su.nsb {
                    continue;
                }
                let mut isum = 0i32;
                for j in blk * su.spb..(blk + 1) * su.spb {
                    let qa: [u32; 8] = std::array::from_fn(|i| su.qword(t, 32 * j + 4 * i));
                    let d = sub_dot(su.rt.kind, su.code(o, j), &qa, su.a.s[t * su.nsb + j]);
                    isum += su.m(t, j) * d;
                }
                *pa = (su.dw(o, blk) * su.u(t, blk)).mul_add(isum as f32, *pa);
            }
        }
        let tot = butterfly(&part);
        v = if kp == 0 { tot } else { v + tot };
    }
    v
}

/// The tensor-core verify kernel's values `[n][16]` for the m16 tile at row `o0` (rows past
/// `n_out` clamped for loads), `n` ≤ 8 activation rows (token columns past `n` clamped), K split
/// `ks`.
/// - Per sub-block: one `mma.m16n8k32` with C = 0. The A fragments are the signed codes (±1, or
///   c − 1) of the o8 family's `mvt`; B is 8 activation bytes of token column g.
/// - Each lane adds m_j(column) · D to its block's int32 fragment.
/// - Per block: the fma into partial (block mod bpc), then the same butterfly and K-part order as
///   [`row_dp4a`].
fn tile_mma(su: &Setup, o0: usize, n_out: usize, n: usize, ks: usize) -> Vec<[f32; 16]> {
    let (kind, bpc, nch) = (su.rt.kind, su.bpc(), su.nsb.div_ceil(32));
    let mut total = [[0f32; 4]; 32];
    for kp in 0..ks {
        let mut acc = vec![[[0f32; 4]; 32]; bpc]; // [partial][lane][value]
        for c in (kp..nch).step_by(ks) {
            for (p, accp) in acc.iter_mut().enumerate() {
                let blk = c * bpc + p;
                if blk * su.spb >= su.nsb {
                    continue;
                }
                let mut cb = [[0i32; 4]; 32]; // the block's int32 fragments
                for j in blk * su.spb..(blk + 1) * su.spb {
                    let (a, b) = mvt_fragments(
                        kind,
                        |o, j| su.code(o, j),
                        |t, byte| su.qword(t, byte),
                        (o0, n_out, n),
                        j,
                    );
                    let d = mma(&a, &b, &[[0; 4]; 32]);
                    for lane in 0..32 {
                        let tg = lane & 3;
                        for e in 0..4 {
                            let t = (2 * tg + (e & 1)).min(n - 1);
                            cb[lane][e] += su.m(t, j) * d[lane][e];
                        }
                    }
                }
                for lane in 0..32 {
                    let (g, tg) = (lane >> 2, lane & 3);
                    let ra = (o0 + g).min(n_out - 1);
                    let rb = (o0 + g + 8).min(n_out - 1);
                    for e in 0..4 {
                        let r = if e < 2 { ra } else { rb };
                        let t = (2 * tg + (e & 1)).min(n - 1);
                        let sc = su.dw(r, blk) * su.u(t, blk);
                        accp[lane][e] = sc.mul_add(cb[lane][e] as f32, accp[lane][e]);
                    }
                }
            }
        }
        for lane in 0..32 {
            for e in 0..4 {
                let part: Vec<f32> = acc.iter().map(|a| a[lane][e]).collect();
                let tot = butterfly(&part);
                total[lane][e] = if kp == 0 { tot } else { total[lane][e] + tot };
            }
        }
    }
    let mut out = vec![[0f32; 16]; n];
    scatter_c(&total, &mut out);
    out
}

/// Activation rows with some structure: a Gaussian-ish body, a few large channels and a quiet
/// stretch (so sub-scales well below 16 occur), values in about ±8.
fn acts(rng: &mut Rng, n: usize, k: usize) -> Vec<f32> {
    (0..n * k)
        .map(|i| {
            let c = i % k;
            let base = ((0..4)
                .map(|_| (rng.next() % 20_001) as f32 / 1e4 - 1.0)
                .sum::<f32>())
                * 0.5;
            if c % 97 == 5 {
                base * 8.0
            } else if (c / 32) % 5 == 3 {
                base * 0.05
            } else {
                base
            }
        })
        .collect()
}

#[test]
fn sub_scale_quantizer_bounds_and_error() {
    let mut rng = Rng(21);
    for ge in [64usize, 128] {
        let (n, k) = (3, 1024);
        let x = acts(&mut rng, n, k);
        let a = quant_sub(&x, k, ge);
        let (mut e_sub, mut e_32) = (0f64, 0f64);
        let (q32, d32, _) = host_quant(&x, k);
        for t in 0..n {
            for j in 0..k / 32 {
                let mj = a.m[t * (k / 32) + j];
                assert!((1..=LEVELS).contains(&mj), "m out of range: {mj}");
                let step = a.u[t * (k / ge) + j / (ge / 32)] as f64 * mj as f64;
                let mut sum = 0;
                for e in 0..32 {
                    let i = t * k + 32 * j + e;
                    let qv = a.q[i] as i32;
                    assert!(qv.abs() <= 127);
                    sum += qv;
                    let err = x[i] as f64 - qv as f64 * step;
                    assert!(
                        err.abs() <= 0.5 * step * (1.0 + 1e-5) + 1e-30,
                        "x {} q {qv} step {step}",
                        x[i]
                    );
                    e_sub += err * err;
                    let e32 = x[i] as f64 - q32[i] as f64 * d32[t * (k / 32) + j] as f64;
                    e_32 += e32 * e32;
                }
                assert_eq!(sum, a.s[t * (k / 32) + j]);
            }
        }
        // the sub-scales keep each sub-block's codes near its own range: a few percent more
        // error than one scale per 32 (NumPy reference: within 5–12 %), far from per-`ge` alone
        eprintln!(
            "sub-scale quantizer ge {ge}: squared error {:.3}× the per-32 scheme's",
            e_sub / e_32
        );
        assert!(e_sub < 1.5 * e_32, "ge {ge}: {e_sub} vs {e_32}");
    }
}

#[test]
fn sub_scale_tensor_core_verify_equals_dp4a_row_bit_for_bit() {
    let mut rng = Rng(23);
    for qt in EMU_KINDS {
        // 384: 12 sub-blocks (a partial chunk); 1280: 40 (a ragged last chunk); 50 rows: a
        // partial m16 tile
        for (n_in, n_out) in [(384usize, 50usize), (1280, 16)] {
            let (raw, rt) = scaled_rows(&mut rng, qt, n_in, n_out);
            let kind = rt.kind;
            let spb = if kind == WKind::Q2G64 { 2 } else { 4 };
            let n = 5;
            let x = acts(&mut rng, n, n_in);
            let su = Setup {
                nsb: n_in / 32,
                spb,
                words_per_sb: if kind == WKind::Q1 { 1 } else { 2 },
                rt,
                a: quant_sub(&x, n_in, 32 * spb),
            };
            let rb = qt.row_bytes(n_in).unwrap();
            let mut wrow = vec![0f32; n_in];
            for ks in [1, 2, 4] {
                for o0 in (0..n_out).step_by(16) {
                    let tile = tile_mma(&su, o0, n_out, n, ks);
                    for (t, row) in tile.iter().enumerate() {
                        for (r, &got) in row.iter().enumerate() {
                            let o = o0 + r;
                            if o >= n_out {
                                continue;
                            }
                            let one = row_dp4a(&su, o, t, ks);
                            // the public replay the GPU test uses (its own integer dots)
                            let (nb, ng) = (n_in / 32, n_in / (32 * spb));
                            let host = mv_sub_host(
                                &su.rt,
                                &su.a.q[t * n_in..(t + 1) * n_in],
                                &su.a.u[t * ng..(t + 1) * ng],
                                &su.a.m[t * nb..(t + 1) * nb],
                                o,
                                ks,
                            );
                            assert_eq!(
                                host.to_bits(),
                                one.to_bits(),
                                "{qt:?} row {o} t {t}: mv_sub_host"
                            );
                            assert_eq!(
                                got.to_bits(),
                                one.to_bits(),
                                "{qt:?} [{n_in}x{n_out}] ks {ks} row {o} t {t}: mma {got} vs dp4a {one}"
                            );
                            // f64 reference: dequantized weights · q · u · m
                            dequantize_row(qt, &raw[o * rb..(o + 1) * rb], &mut wrow);
                            let want: f64 = (0..n_in)
                                .map(|i| {
                                    let j = i / 32;
                                    wrow[i] as f64
                                        * su.a.q[t * n_in + i] as f64
                                        * su.u(t, j / spb) as f64
                                        * su.m(t, j) as f64
                                })
                                .sum();
                            let scale: f64 = (0..n_in)
                                .map(|i| (wrow[i] as f64 * x[t * n_in + i] as f64).abs())
                                .sum();
                            let err = (one as f64 - want).abs() / scale.max(1e-30);
                            assert!(err < 1e-5, "{qt:?} row {o} t {t}: {one} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
