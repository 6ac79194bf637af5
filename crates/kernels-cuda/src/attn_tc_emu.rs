//! Host replay of the tensor-core prefill attention (`attn_prefill_tc_hd*` in
//! `kernels/prefill.cu`; tests only, no GPU), lane by lane, against causal attention in f64.
//!
//! Shared memory is an array of f16 values at the kernel's element offsets; `ldmatrix` (plain and
//! `.trans`) and `mma.m16n8k16` act on per-lane registers with the PTX ISA's fragment layouts
//! (written here from the ISA, not from the kernel), with the products in f64. Everything else —
//! the K / V tile copy, the lane addresses, the C-to-A register reuse for P, masks, the online
//! softmax over quads, the rescale, the staging and the epilogue's chunk walk — uses the kernel's
//! index expressions. So a wrong address, fragment or mask shows as an O(1) error; the hi / lo
//! split leaves ~1e-7. `tests/gpu_kernels.rs` checks the kernel itself on the GPU.

use crate::frag_emu::mma_c_add;
use crate::frag_emu::Rng;
use half::f16;

const BQ: usize = 64;
const BK: usize = 32;

/// A 32-bit register of two f16 values (low half first).
type R2 = [f64; 2];

fn h(x: f32) -> f64 {
    f16::from_f32(x).to_f64()
}

/// f32 pair -> (hi, lo) f16 pairs (`split_h2`).
fn split(x0: f32, x1: f32) -> (R2, R2) {
    let (h0, h1) = (h(x0), h(x1));
    (([h0, h1]), [h(x0 - h0 as f32), h(x1 - h1 as f32)])
}

/// `ldmatrix.x4` (`.trans` with `trans`): lane 8i + r gives row r of matrix i (8 consecutive f16 at
/// element offset addr[8i + r]); lane l receives, per matrix i, row l/4, columns 2(l%4), +1 — or,
/// transposed, rows 2(l%4), +1 of column l/4.
fn ldsm(sm: &[f64], addr: &[usize; 32], trans: bool) -> [[R2; 4]; 32] {
    let mut out = [[[0.0; 2]; 4]; 32];
    for (l, o) in out.iter_mut().enumerate() {
        let (r, c) = (l / 4, 2 * (l % 4));
        for (i, reg) in o.iter_mut().enumerate() {
            *reg = if trans {
                [sm[addr[8 * i + c] + r], sm[addr[8 * i + c + 1] + r]]
            } else {
                [sm[addr[8 * i + r] + c], sm[addr[8 * i + r] + c + 1]]
            };
        }
    }
    out
}

/// `mma.m16n8k16.row.col` f16 -> f32 (here f64), g = lane / 4, q = lane % 4:
/// A a0 (g, 2q..2q+1), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..);
/// B b0 (k 2q..2q+1, n g), b1 (k 2q+8.., n g); C c0, c1 (g, 2q, 2q+1), c2, c3 (g+8, 2q, 2q+1).
fn mma(c: &mut [[f64; 4]; 32], a: &[[R2; 4]; 32], b: &[[R2; 2]; 32]) {
    let mut am = [[0.0f64; 16]; 16];
    let mut bm = [[0.0f64; 8]; 16];
    for lane in 0..32 {
        let (g, q) = (lane / 4, lane % 4);
        for e in 0..2 {
            am[g][2 * q + e] = a[lane][0][e];
            am[g + 8][2 * q + e] = a[lane][1][e];
            am[g][2 * q + 8 + e] = a[lane][2][e];
            am[g + 8][2 * q + 8 + e] = a[lane][3][e];
            bm[2 * q + e][g] = b[lane][0][e];
            bm[2 * q + 8 + e][g] = b[lane][1][e];
        }
    }
    mma_c_add(c, |r, col| {
        (0..16).map(|k| am[r][k] * bm[k][col]).sum::<f64>()
    });
}

/// B fragments of n8 tile `t` from an x4 load's registers (2t, 2t + 1).
fn bpair(x: &[[R2; 4]; 32], t: usize) -> [[R2; 2]; 32] {
    let mut b = [[[0.0; 2]; 2]; 32];
    for l in 0..32 {
        b[l] = [x[l][2 * t], x[l][2 * t + 1]];
    }
    b
}

/// One launch's inputs: qo [n, nh, hd] f32, qf [n, nh, 2, hd] (the gate half read), the f16 caches
/// [n_ctx, nkv·hd] (NaN past pos0 + n: never read).
struct Launch<'a> {
    hd: usize,
    nh: usize,
    nkv: usize,
    n: usize,
    pos0: usize,
    qo: &'a [f32],
    qf: &'a [f32],
    kc: &'a [f64],
    vc: &'a [f64],
}

/// `attn_prefill_tc_body` over the whole grid: the gated outputs [n, nh, hd].
fn kernel(x: &Launch) -> Vec<f64> {
    let (hd, nh, nkv, n, p0) = (x.hd, x.nh, x.nkv, x.n, x.pos0);
    let st = hd + 8;
    let nj = hd / 8;
    let (qh, ql, ks, vs) = (0, BQ * st, 2 * BQ * st, 2 * BQ * st + BK * st);
    let l_all = p0 + n;
    let kvw = nkv * hd;
    let scale = (1.0f32 / (hd as f32).sqrt()) as f64;
    let gy = n.div_ceil(BQ);
    let mut out = vec![f64::NAN; n * nh * hd];
    for hh in 0..nh {
        for by in 0..gy {
            let t0 = (gy - 1 - by) * BQ;
            let lt = p0 + (t0 + BQ).min(n);
            let nkt = lt.div_ceil(BK);
            let kvh = hh / (nh / nkv);
            let mut sm = vec![f64::NAN; 2 * BQ * st + 2 * BK * st];
            // K / V tile copy: thread tid, chunk tid % CPR of rows tid / CPR + RPI·i
            let (cpr, rpi) = (hd / 8, 128 / (hd / 8));
            let issue = |sm: &mut [f64], dst: usize, src: &[f64], kt: usize| {
                for tid in 0..128 {
                    let (ld_r, ld_c) = (tid / cpr, 8 * (tid % cpr));
                    for i in 0..BK / rpi {
                        let p = (kt * BK + ld_r + rpi * i).min(l_all - 1);
                        for e in 0..8 {
                            sm[dst + (ld_r + rpi * i) * st + ld_c + e] =
                                src[p * kvw + kvh * hd + ld_c + e];
                        }
                    }
                }
            };
            // Q tile, hi / lo
            for r in 0..BQ {
                for c4 in 0..hd / 4 {
                    let v: [f32; 4] = std::array::from_fn(|i| {
                        if t0 + r < n {
                            x.qo[((t0 + r) * nh + hh) * hd + 4 * c4 + i]
                        } else {
                            0.0
                        }
                    });
                    let (a, b) = (split(v[0], v[1]), split(v[2], v[3]));
                    let at = r * st + 4 * c4;
                    sm[qh + at..qh + at + 4].copy_from_slice(&[a.0[0], a.0[1], b.0[0], b.0[1]]);
                    sm[ql + at..ql + at + 4].copy_from_slice(&[a.1[0], a.1[1], b.1[0], b.1[1]]);
                }
            }
            let mut os = vec![0.0f64; BQ * hd];
            // the warps run one after another here; each reads only its own Q rows and the tiles
            let mut warps: Vec<Warp> = (0..4).map(|_| Warp::new(nj)).collect();
            for kt in 0..nkt {
                issue(&mut sm, ks, x.kc, kt);
                issue(&mut sm, vs, x.vc, kt);
                for (w, wp) in warps.iter_mut().enumerate() {
                    wp.tile(&sm, (qh, ql, ks, vs), st, hd, w, kt, p0 + t0, scale);
                }
            }
            for (w, wp) in warps.iter().enumerate() {
                for l in 0..32 {
                    let (g, tg) = (l / 4, l % 4);
                    for j in 0..nj {
                        for r in 0..2 {
                            let row = 16 * w + g + 8 * r;
                            for e in 0..2 {
                                os[row * hd + 8 * j + 2 * tg + e] =
                                    wp.acc[j][l][2 * r + e] / wp.l[l][r];
                            }
                        }
                    }
                }
                // the epilogue's chunks: e = 4 (lane + 32 it), row t0 + 16w + e / hd
                for it in 0..hd / 8 {
                    for lane in 0..32 {
                        let e = 4 * (lane + 32 * it);
                        let t = t0 + 16 * w + e / hd;
                        if t >= n {
                            continue;
                        }
                        for i in 0..4 {
                            let gate = x.qf[(t * nh + hh) * 2 * hd + hd + e % hd + i] as f64;
                            out[(t * nh + hh) * hd + e % hd + i] =
                                os[16 * w * hd + e + i] / (1.0 + (-gate).exp());
                        }
                    }
                }
            }
        }
    }
    out
}

/// One warp's registers across key tiles.
struct Warp {
    m: [[f64; 2]; 32],
    l: [[f64; 2]; 32],
    acc: Vec<[[f64; 4]; 32]>,
}

impl Warp {
    fn new(nj: usize) -> Self {
        Warp {
            m: [[f64::NEG_INFINITY; 2]; 32],
            l: [[0.0; 2]; 32],
            acc: vec![[[0.0; 4]; 32]; nj],
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn tile(
        &mut self,
        sm: &[f64],
        (qh, ql, ks, vs): (usize, usize, usize, usize),
        st: usize,
        hd: usize,
        w: usize,
        kt: usize,
        pw: usize, // position of the block's row 0 (p0 + t0)
        scale: f64,
    ) {
        let wlast = pw + 16 * w + 15;
        if kt * BK > wlast {
            return; // the whole tile is masked for the warp
        }
        // lane addresses (elements): A from Q, B from K, B from V transposed
        let qa: [usize; 32] =
            std::array::from_fn(|l| (16 * w + (l & 7) + 8 * ((l >> 3) & 1)) * st + 8 * (l >> 4));
        let ka: [usize; 32] =
            std::array::from_fn(|l| ks + ((l & 7) + 8 * (l >> 4)) * st + 8 * ((l >> 3) & 1));
        let va: [usize; 32] =
            std::array::from_fn(|l| vs + ((l & 7) + 8 * ((l >> 3) & 1)) * st + 8 * (l >> 4));
        let off = |a: &[usize; 32], d: usize| -> [usize; 32] { std::array::from_fn(|l| a[l] + d) };
        let mut sc = [[[0.0f64; 4]; 32]; 4];
        let mut sl = [[[0.0f64; 4]; 32]; 4];
        for kk in 0..hd / 16 {
            let ah = ldsm(sm, &off(&qa, qh + 16 * kk), false);
            let al = ldsm(sm, &off(&qa, ql + 16 * kk), false);
            let b0 = ldsm(sm, &off(&ka, 16 * kk), false);
            let b1 = ldsm(sm, &off(&ka, 16 * kk + 16 * st), false);
            for j in 0..4 {
                let b = bpair(if j < 2 { &b0 } else { &b1 }, j & 1);
                mma(&mut sc[j], &ah, &b);
                mma(&mut sl[j], &al, &b);
            }
        }
        // mask and online softmax; a row's 32 keys lie in its quad (lanes 4g..4g+3)
        let mut p = [[[0.0f64; 4]; 32]; 4];
        let mut mx = [[f64::NEG_INFINITY; 2]; 32];
        let full = kt * BK + BK - 1 <= pw + 16 * w;
        for l in 0..32 {
            let (g, tg) = (l / 4, l % 4);
            for j in 0..4 {
                for e in 0..4 {
                    let pk = kt * BK + 8 * j + 2 * tg + (e & 1);
                    let prow = pw + 16 * w + g + 8 * (e >> 1);
                    let s = sc[j][l][e] + sl[j][l][e];
                    let sv = if full || pk <= prow {
                        s * scale
                    } else {
                        f64::NEG_INFINITY
                    };
                    p[j][l][e] = sv;
                    mx[l][e >> 1] = mx[l][e >> 1].max(sv);
                }
            }
        }
        let quad = |v: &[[f64; 2]; 32], l: usize, r: usize, f: fn(f64, f64) -> f64| {
            let b = l & !3;
            (1..4).fold(v[b][r], |a, i| f(a, v[b + i][r]))
        };
        let mut corr = [[0.0f64; 2]; 32];
        let mut mnew = self.m;
        for l in 0..32 {
            for r in 0..2 {
                let m = self.m[l][r].max(quad(&mx, l, r, f64::max));
                corr[l][r] = (self.m[l][r] - m).exp();
                mnew[l][r] = m;
            }
        }
        self.m = mnew;
        let mut rs = [[0.0f64; 2]; 32];
        for l in 0..32 {
            for j in 0..4 {
                for e in 0..4 {
                    p[j][l][e] = (p[j][l][e] - self.m[l][e >> 1]).exp();
                    rs[l][e >> 1] += p[j][l][e];
                }
            }
        }
        for l in 0..32 {
            for r in 0..2 {
                self.l[l][r] = self.l[l][r] * corr[l][r] + quad(&rs, l, r, |a, b| a + b);
            }
            for a in self.acc.iter_mut() {
                for e in 0..4 {
                    a[l][e] *= corr[l][e >> 1];
                }
            }
        }
        // P (f32 in the kernel) as A fragments of k16 step s: C of n8 tiles 2s, 2s + 1
        for s in 0..2 {
            let mut ph = [[[0.0; 2]; 4]; 32];
            let mut pl = [[[0.0; 2]; 4]; 32];
            for l in 0..32 {
                let f = |j: usize, e: usize| p[j][l][e] as f32;
                let regs = [
                    split(f(2 * s, 0), f(2 * s, 1)),
                    split(f(2 * s, 2), f(2 * s, 3)),
                    split(f(2 * s + 1, 0), f(2 * s + 1, 1)),
                    split(f(2 * s + 1, 2), f(2 * s + 1, 3)),
                ];
                for (i, (hi, lo)) in regs.into_iter().enumerate() {
                    ph[l][i] = hi;
                    pl[l][i] = lo;
                }
            }
            for jp in 0..hd / 16 {
                let b = ldsm(sm, &off(&va, 16 * s * st + 16 * jp), true);
                for t in 0..2 {
                    let bb = bpair(&b, t);
                    mma(&mut self.acc[2 * jp + t], &ph, &bb);
                    mma(&mut self.acc[2 * jp + t], &pl, &bb);
                }
            }
        }
    }
}

/// Causal gated attention in f64 on the same operands (q as f32, K / V as f16).
fn reference(x: &Launch) -> Vec<f64> {
    let (hd, nh, nkv) = (x.hd, x.nh, x.nkv);
    let kvw = nkv * hd;
    let scale = (1.0f32 / (hd as f32).sqrt()) as f64;
    let mut out = vec![0.0; x.n * nh * hd];
    for t in 0..x.n {
        for hh in 0..nh {
            let g = hh / (nh / nkv);
            let q = &x.qo[(t * nh + hh) * hd..][..hd];
            let np = x.pos0 + t + 1;
            let s: Vec<f64> = (0..np)
                .map(|p| {
                    let k = &x.kc[p * kvw + g * hd..][..hd];
                    scale * q.iter().zip(k).map(|(&a, &b)| a as f64 * b).sum::<f64>()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let o: f64 = (0..np)
                    .map(|p| e[p] * x.vc[p * kvw + g * hd + d])
                    .sum::<f64>()
                    / z;
                let gate = x.qf[(t * nh + hh) * 2 * hd + hd + d] as f64;
                out[(t * nh + hh) * hd + d] = o / (1.0 + (-gate).exp());
            }
        }
    }
    out
}

#[test]
fn tensor_core_attention_indexing_equals_causal_attention() {
    // (hd, nh, nkv, n, pos0): the 27B head dim with a partial last row tile and earlier context,
    // the tiny preset's, a context where a key tile ends one position past a warp's first row
    // (pos0 + 16w ≡ 30 mod 32: the unmasked fast path must not take it) and one where a key tile
    // starts at a warp's last row (≡ 17: that tile must not be skipped)
    for (hd, nh, nkv, n, pos0) in [
        (256usize, 2usize, 1usize, 130usize, 37usize),
        (64, 4, 2, 77, 5),
        (64, 2, 1, 40, 30),
        (64, 2, 1, 40, 17),
    ] {
        let mut rng = Rng(31 + n as u64);
        let mut uni = |a: f32| ((rng.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a;
        let n_ctx = pos0 + n + 8;
        let kvw = nkv * hd;
        let qo: Vec<f32> = (0..n * nh * hd).map(|_| uni(0.6)).collect();
        let qf: Vec<f32> = (0..n * nh * 2 * hd).map(|_| uni(2.0)).collect();
        let cache = |uni: &mut dyn FnMut(f32) -> f32| -> Vec<f64> {
            (0..n_ctx * kvw)
                .map(|i| {
                    if i < (pos0 + n) * kvw {
                        h(uni(1.0))
                    } else {
                        f64::NAN
                    }
                })
                .collect()
        };
        let kc = cache(&mut uni);
        let vc = cache(&mut uni);
        let x = Launch {
            hd,
            nh,
            nkv,
            n,
            pos0,
            qo: &qo,
            qf: &qf,
            kc: &kc,
            vc: &vc,
        };
        let (got, want) = (kernel(&x), reference(&x));
        let top = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0.0f64, |a, (g, w)| a.max((g - w).abs()));
        assert!(
            err.is_finite() && err < 1e-5 * top,
            "hd {hd}: max |Δ| {err:e} of {top:e}"
        );
        // split launch: rows 0..m at pos0, rows m..n at pos0 + m: the same values, exactly
        let m = n / 2 - 3;
        let part = |r0: usize, r1: usize| {
            kernel(&Launch {
                n: r1 - r0,
                pos0: pos0 + r0,
                qo: &qo[r0 * nh * hd..r1 * nh * hd],
                qf: &qf[r0 * nh * 2 * hd..r1 * nh * 2 * hd],
                ..x
            })
        };
        let mut split = part(0, m);
        split.extend(part(m, n));
        assert!(
            split
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "hd {hd}: split launch differs"
        );
    }
}
