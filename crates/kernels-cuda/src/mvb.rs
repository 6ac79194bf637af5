//! Host side of the binary tensor-core Q1 mat-vec (`kernels/mvb.cu`, `mvb_q1_*` and `b1_planes`):
//! the activation bit planes, and an exact host replay of the kernel's float order (the GPU tests
//! compare the kernel against it bit for bit). The `tests` module below replays, lane by lane, what
//! the kernel puts into the `mma.m16n8k256 .b1` fragments and checks the integer results (no GPU).
//!
//! Bit order: the re-tiled Q1 code word of a 32-element sub-block holds element `4i + b` at bit
//! `8b + i` ([`q1_bit`]); plane `p` of an activation sub-block holds bit `p` of element `4i + b` at
//! the same bit, so `popc(code AND plane_p)` pairs every weight sign with its own activation.

use half::f16;

/// Bit of the re-tiled Q1 code word (and of an activation plane word) that holds element `e`
/// (0..32) of its sub-block: bit `i` of byte `b` is element `4i + b`.
pub fn q1_bit(e: usize) -> usize {
    8 * (e & 3) + (e >> 2)
}

/// The 8 plane words of one 32-element sub-block of int8 activations (what `b1_planes` writes).
pub fn plane_words(q32: &[i8]) -> [u32; 8] {
    let mut w = [0u32; 8];
    for (e, &v) in q32.iter().enumerate().take(32) {
        let u = v as u8;
        for (p, wp) in w.iter_mut().enumerate() {
            *wp |= (((u >> p) & 1) as u32) << q1_bit(e);
        }
    }
    w
}

/// Planes `[n, n_in / 32, 8]` u32 of int8 activations `q` `[n, n_in]`.
pub fn planes(q: &[i8], n: usize, n_in: usize) -> Vec<u32> {
    assert_eq!(q.len(), n * n_in);
    q.chunks_exact(32).flat_map(plane_words).collect()
}

/// The kernel's exact integer for one (weight row, activation sub-block): `2·S1 − s` with
/// `S1 = Σ_p c_p · popc(code AND plane_p)`, `c_p = 2^p` (p < 7), `c_7 = −128`.
pub fn b1_isum(code: u32, pl: &[u32; 8], s: i32) -> i32 {
    let mut s1 = 0i32;
    for (p, &x) in pl.iter().enumerate() {
        let c = if p == 7 { -128 } else { 1 << p };
        s1 += c * (code & x).count_ones() as i32;
    }
    2 * s1 - s
}

/// Exact host replay of `mvb_q1_*` with K split `ks`: `codes` `[n_out, n_in / 32]` u32 (re-tiled
/// Q1 words, little-endian bytes), `scales` `[n_out, n_in / 128]` f16 bits, `q` `[n, n_in]`, `d`
/// and `s` `[n, n_in / 32]`; returns `y` `[n, n_out]` (`y0 + v` when `y0` is given, the kernel's
/// accumulate mode). Lane `tg` of a row sums sub-blocks `8c + 2tg`, `8c + 2tg + 1` of the chunks
/// `c ≡ kp (mod ks)` in order with `fmaf(dw·da, isum, acc)`; then `(a0 + a1) + (a2 + a3)`; then the
/// K parts in order.
#[allow(clippy::too_many_arguments)]
pub fn mv_b1_host(
    codes: &[u8],
    scales: &[u16],
    n_in: usize,
    n_out: usize,
    q: &[i8],
    d: &[f32],
    s: &[i32],
    n: usize,
    ks: usize,
    y0: Option<&[f32]>,
) -> Vec<f32> {
    let nsb = n_in / 32;
    let nblk = n_in / 128;
    let nch = nsb.div_ceil(8);
    assert_eq!(codes.len(), n_out * nsb * 4);
    assert_eq!(scales.len(), n_out * nblk);
    let pl = planes(q, n, n_in);
    let mut y = vec![0f32; n * n_out];
    for o in 0..n_out {
        for t in 0..n {
            let mut tot = 0f32;
            for kp in 0..ks {
                let mut a = [0f32; 4];
                for (tg, at) in a.iter_mut().enumerate() {
                    let mut c = kp;
                    while c < nch {
                        for j in [8 * c + 2 * tg, 8 * c + 2 * tg + 1] {
                            if j >= nsb {
                                continue;
                            }
                            let off = 4 * (o * nsb + j);
                            let code = u32::from_le_bytes(codes[off..off + 4].try_into().unwrap());
                            let p: [u32; 8] = pl[8 * (t * nsb + j)..8 * (t * nsb + j) + 8]
                                .try_into()
                                .unwrap();
                            let isum = b1_isum(code, &p, s[t * nsb + j]);
                            let dw = f16::from_bits(scales[o * nblk + j / 4]).to_f32();
                            *at = (dw * d[t * nsb + j]).mul_add(isum as f32, *at);
                        }
                        c += ks;
                    }
                }
                let v = (a[0] + a[1]) + (a[2] + a[3]);
                tot = if kp == 0 { v } else { tot + v };
            }
            y[t * n_out + o] = match y0 {
                Some(y0) => y0[t * n_out + o] + tot,
                None => tot,
            };
        }
    }
    y
}

#[cfg(test)]
mod tests {
    //! Lane-level replay of `mvb_body` (kernels/mvb.cu): the A registers each lane loads, the B
    //! registers (plane words on lanes g == tg / g == tg + 4 only), the two Horner chains through
    //! the C operand, and the epilogue integers, under the PTX ISA fragment layout of
    //! `mma.m16n8k256.row.col.s32.b1.b1.s32.and.popc` — checked against Σ sign·q computed from the
    //! GGUF rows by `dequantize_row` (independent of the re-tiled bit order). Also replays the
    //! `b1_planes` ballots. Cannot catch a wrong PTX spelling or a race: the GPU tests do that.
    use super::*;
    use crate::retile::{retile, WKind};
    use bonsai_kernels_cpu::quant::dequantize_row;
    use bonsai_kernels_cpu::QuantType;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    /// mma.m16n8k256 .b1 AND.popc over the 32 lanes' fragments (PTX ISA layout, see mvb.cu).
    fn mma_b1(a: &[[u32; 4]; 32], b: &[[u32; 2]; 32], c: &[[i32; 4]; 32]) -> [[i32; 4]; 32] {
        let mut am = [[false; 256]; 16];
        let mut bm = [[false; 8]; 256];
        let mut cm = [[0i32; 8]; 16];
        for lane in 0..32 {
            let (g, tg) = (lane >> 2, lane & 3);
            for i in 0..32 {
                am[g][32 * tg + i] = (a[lane][0] >> i) & 1 == 1;
                am[g + 8][32 * tg + i] = (a[lane][1] >> i) & 1 == 1;
                am[g][128 + 32 * tg + i] = (a[lane][2] >> i) & 1 == 1;
                am[g + 8][128 + 32 * tg + i] = (a[lane][3] >> i) & 1 == 1;
                bm[32 * tg + i][g] = (b[lane][0] >> i) & 1 == 1;
                bm[128 + 32 * tg + i][g] = (b[lane][1] >> i) & 1 == 1;
            }
            cm[g][2 * tg] = c[lane][0];
            cm[g][2 * tg + 1] = c[lane][1];
            cm[g + 8][2 * tg] = c[lane][2];
            cm[g + 8][2 * tg + 1] = c[lane][3];
        }
        let mut d = [[0i32; 4]; 32];
        for lane in 0..32 {
            let (g, tg) = (lane >> 2, lane & 3);
            for (e, (r, col)) in [
                (g, 2 * tg),
                (g, 2 * tg + 1),
                (g + 8, 2 * tg),
                (g + 8, 2 * tg + 1),
            ]
            .into_iter()
            .enumerate()
            {
                let pop = (0..256).filter(|&k| am[r][k] && bm[k][col]).count() as i32;
                d[lane][e] = cm[r][col].wrapping_add(pop);
            }
        }
        d
    }

    /// `b1_planes`: lane L = 8b + i holds element 4i + b; ballot of bit p is plane p.
    fn ballot_planes(q32: &[i8]) -> [u32; 8] {
        let mut w = [0u32; 8];
        for (p, wp) in w.iter_mut().enumerate() {
            for lane in 0..32 {
                let e = 4 * (lane & 7) + (lane >> 3);
                if ((q32[e] as u8) >> p) & 1 == 1 {
                    *wp |= 1 << lane;
                }
            }
        }
        w
    }

    #[test]
    fn plane_words_match_the_ballots_and_the_code_order() {
        let mut rng = Rng(3);
        for _ in 0..200 {
            let q: Vec<i8> = (0..32).map(|_| rng.next() as i8).collect();
            let pw = plane_words(&q);
            assert_eq!(pw, ballot_planes(&q));
            // recombining the planes gives the bytes back at their code-word bits
            for e in 0..32 {
                let mut v = 0u8;
                for (p, w) in pw.iter().enumerate() {
                    v |= (((w >> q1_bit(e)) & 1) as u8) << p;
                }
                assert_eq!(v as i8, q[e]);
            }
        }
        // the code order of retile.rs: bit i of byte b is element 4i + b
        for e in 0..32 {
            let (i, b) = (e / 4, e % 4);
            assert_eq!(q1_bit(e), 8 * b + i);
        }
    }

    #[test]
    fn mvb_fragments_give_the_exact_integer_dots() {
        let mut rng = Rng(11);
        let qt = QuantType::Q1_0;
        // 384: one and a half 256-element chunks (ragged); 1024: four chunks. 20 rows: the second
        // m16 tile is partial (rows past n_out load the last row, as the kernel clamps them).
        for (n_in, n_out) in [(384usize, 20usize), (1024, 16)] {
            let rb = qt.row_bytes(n_in).unwrap();
            let mut raw: Vec<u8> = (0..rb * n_out).map(|_| rng.next() as u8).collect();
            for blk in raw.chunks_exact_mut(qt.block_bytes()) {
                blk[..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
            }
            let rt = retile(qt, &raw, n_in, n_out);
            assert_eq!(rt.kind, WKind::Q1);
            let nsb = n_in / 32;
            assert_eq!(rt.codes.len(), n_out * nsb * 4);
            let word = |o: usize, j: usize| {
                let off = 4 * (o * nsb + j);
                u32::from_le_bytes(rt.codes[off..off + 4].try_into().unwrap())
            };
            // the signs ±1 from the GGUF rows (block scales 1.0)
            let mut sign = vec![0f32; n_out * n_in];
            for o in 0..n_out {
                dequantize_row(
                    qt,
                    &raw[o * rb..(o + 1) * rb],
                    &mut sign[o * n_in..(o + 1) * n_in],
                );
            }
            for n in [1usize, 3, 8] {
                let q: Vec<i8> = (0..n * n_in).map(|_| rng.next() as i8).collect();
                let s: Vec<i32> = (0..n * nsb)
                    .map(|i| q[32 * i..32 * i + 32].iter().map(|&v| v as i32).sum())
                    .collect();
                let pl = planes(&q, n, n_in);
                let reference = |o: usize, t: usize, j: usize| -> i32 {
                    (0..32)
                        .map(|e| {
                            sign[o * n_in + 32 * j + e] as i32 * q[t * n_in + 32 * j + e] as i32
                        })
                        .sum()
                };
                let mut seen = vec![0u32; n_out * n * nsb];
                for tile0 in (0..n_out).step_by(16) {
                    for c in 0..nsb.div_ceil(8) {
                        // A registers (mvb_body `load`)
                        let mut a = [[0u32; 4]; 32];
                        for (lane, al) in a.iter_mut().enumerate() {
                            let (g, tg) = (lane >> 2, lane & 3);
                            let row = |h: usize| (tile0 + g + 8 * h).min(n_out - 1);
                            let (j0, j1) = (8 * c + tg, 8 * c + 4 + tg);
                            let ld = |h: usize, j: usize| if j < nsb { word(row(h), j) } else { 0 };
                            *al = [ld(0, j0), ld(1, j0), ld(0, j1), ld(1, j1)];
                        }
                        for t in 0..n {
                            // B registers per plane (mvb_body `compute`)
                            let bregs = |p: usize| {
                                let mut b = [[0u32; 2]; 32];
                                for (lane, bl) in b.iter_mut().enumerate() {
                                    let (g, tg) = (lane >> 2, lane & 3);
                                    let (bl0, bl1) = (g == tg, g == tg + 4);
                                    let jb = 8 * c + if bl0 { tg } else { 4 + tg };
                                    let w = if (bl0 || bl1) && jb < nsb {
                                        pl[8 * (t * nsb + jb) + p]
                                    } else {
                                        0
                                    };
                                    *bl = [if bl0 { w } else { 0 }, if bl1 { w } else { 0 }];
                                }
                                b
                            };
                            let zero = [[0i32; 4]; 32];
                            let scale = |d: &[[i32; 4]; 32], k: i32| {
                                let mut c = [[0i32; 4]; 32];
                                for l in 0..32 {
                                    for e in 0..4 {
                                        c[l][e] = k * d[l][e];
                                    }
                                }
                                c
                            };
                            // hi chain: plane 7 (C = 0), 6 (C = −2·D), 5, 4 (C = 2·D)
                            let mut hi = mma_b1(&a, &bregs(7), &zero);
                            hi = mma_b1(&a, &bregs(6), &scale(&hi, -2));
                            for p in [5, 4] {
                                hi = mma_b1(&a, &bregs(p), &scale(&hi, 2));
                            }
                            // lo chain: plane 3 (C = 0), 2, 1, 0 (C = 2·D)
                            let mut lo = mma_b1(&a, &bregs(3), &zero);
                            for p in [2, 1, 0] {
                                lo = mma_b1(&a, &bregs(p), &scale(&lo, 2));
                            }
                            // epilogue integers
                            for lane in 0..32 {
                                let (g, tg) = (lane >> 2, lane & 3);
                                let je = 8 * c + 2 * tg;
                                if je >= nsb {
                                    continue;
                                }
                                for e in 0..4 {
                                    let o = tile0 + g + 8 * (e >> 1);
                                    let j = je + (e & 1);
                                    let isum =
                                        2 * (16 * hi[lane][e] + lo[lane][e]) - s[t * nsb + j];
                                    if o >= n_out {
                                        continue; // clamped row: never stored
                                    }
                                    assert_eq!(
                                        isum,
                                        reference(o, t, j),
                                        "n_in {n_in} row {o} act {t} sub-block {j}"
                                    );
                                    let pj: [u32; 8] = pl[8 * (t * nsb + j)..8 * (t * nsb + j) + 8]
                                        .try_into()
                                        .unwrap();
                                    assert_eq!(isum, b1_isum(word(o, j), &pj, s[t * nsb + j]));
                                    seen[(o * n + t) * nsb + j] += 1;
                                }
                            }
                        }
                    }
                }
                // every (row, activation row, sub-block) exactly once
                assert!(seen.iter().all(|&k| k == 1), "coverage n_in {n_in} n {n}");
            }
        }
    }

    #[test]
    fn host_replay_is_batch_invariant_and_close_to_f64() {
        let mut rng = Rng(5);
        let qt = QuantType::Q1_0;
        let (n_in, n_out, n) = (1024usize, 24usize, 5usize);
        let rb = qt.row_bytes(n_in).unwrap();
        let mut raw: Vec<u8> = (0..rb * n_out).map(|_| rng.next() as u8).collect();
        for blk in raw.chunks_exact_mut(qt.block_bytes()) {
            let sc = 0.01 + (rng.next() % 100) as f32 * 1e-3;
            blk[..2].copy_from_slice(&f16::from_f32(sc).to_bits().to_le_bytes());
        }
        let rt = retile(qt, &raw, n_in, n_out);
        let x: Vec<f32> = (0..n * n_in)
            .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let (q, d, s) = crate::host_quant(&x, n_in);
        let mut w = vec![0f32; n_out * n_in];
        for o in 0..n_out {
            dequantize_row(
                qt,
                &raw[o * rb..(o + 1) * rb],
                &mut w[o * n_in..(o + 1) * n_in],
            );
        }
        for ks in [1, 2, 4] {
            let y = mv_b1_host(&rt.codes, &rt.scales, n_in, n_out, &q, &d, &s, n, ks, None);
            for t in 0..n {
                let y1 = mv_b1_host(
                    &rt.codes,
                    &rt.scales,
                    n_in,
                    n_out,
                    &q[t * n_in..(t + 1) * n_in],
                    &d[t * (n_in / 32)..(t + 1) * (n_in / 32)],
                    &s[t * (n_in / 32)..(t + 1) * (n_in / 32)],
                    1,
                    ks,
                    None,
                );
                for o in 0..n_out {
                    assert_eq!(y[t * n_out + o].to_bits(), y1[o].to_bits());
                    // vs the dequantized int8 activations in f64
                    let r: f64 = (0..n_in)
                        .map(|i| {
                            w[o * n_in + i] as f64
                                * q[t * n_in + i] as f64
                                * d[t * (n_in / 32) + i / 32] as f64
                        })
                        .sum();
                    let got = y[t * n_out + o] as f64;
                    assert!((got - r).abs() <= 1e-4 * (1.0 + r.abs()), "{got} vs {r}");
                }
            }
        }
    }
}
