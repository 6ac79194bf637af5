//! Host replay of the chunked GDN recurrence (`gdn_chunk_prep_d128` + `gdn_chunk_scan_d128` in
//! `kernels/prefill.cu`; tests only, no GPU), in f64 against the row-by-row gated delta rule.
//!
//! It follows the kernels' steps — per 64-row chunk the log-decay prefix sum L, the strictly lower
//! A and the causal P, the forward substitution for U0 = T (β ⊙ V) and W = T (βγ ⊙ K), then per
//! chunk in order Δ = U0 − W S, O = (γ ⊙ Q S + P Δ) / √dk and S ← γ_63 S + Σ_s e^{L_63 − L_s} k_s δ_sᵀ —
//! with rows past n padded as the kernels pad them (g = β = 0, k = q = v = 0). So it checks the
//! algebra of the chunked form, the padding of a last partial chunk and a launch split at any row;
//! `tests/gpu_kernels.rs` checks the kernels themselves on the GPU.

use crate::frag_emu::mma_c_add;
use crate::frag_emu::Rng;

const C: usize = 64;

fn uniform(rng: &mut Rng) -> f64 {
    (rng.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// Inputs of one launch: q, k [n, hk, dk] (L2-normalized rows), v [n, hv, dv], g, β [n, hv].
struct Inputs {
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    n: usize,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    beta: Vec<f64>,
}

impl Inputs {
    fn random(
        rng: &mut Rng,
        (hk, hv, dk, dv): (usize, usize, usize, usize),
        n: usize,
        decay: f64,
    ) -> Self {
        let mut unit = |len: usize| -> Vec<f64> {
            let mut x: Vec<f64> = (0..len).map(|_| uniform(rng)).collect();
            for row in x.chunks_mut(dk) {
                let norm = row.iter().map(|a| a * a).sum::<f64>().sqrt();
                row.iter_mut().for_each(|a| *a /= norm);
            }
            x
        };
        let (q, k) = (unit(n * hk * dk), unit(n * hk * dk));
        let v = (0..n * hv * dv).map(|_| uniform(rng)).collect();
        let g = (0..n * hv)
            .map(|_| -decay * (uniform(rng) + 1.05))
            .collect();
        let beta = (0..n * hv).map(|_| 0.5 * (uniform(rng) + 1.0)).collect();
        Inputs {
            hk,
            hv,
            dk,
            dv,
            n,
            q,
            k,
            v,
            g,
            beta,
        }
    }

    /// Rows r0..r1 as a launch of their own.
    fn rows(&self, r0: usize, r1: usize) -> Inputs {
        let (hk, hv, dk, dv) = (self.hk, self.hv, self.dk, self.dv);
        Inputs {
            hk,
            hv,
            dk,
            dv,
            n: r1 - r0,
            q: self.q[r0 * hk * dk..r1 * hk * dk].to_vec(),
            k: self.k[r0 * hk * dk..r1 * hk * dk].to_vec(),
            v: self.v[r0 * hv * dv..r1 * hv * dv].to_vec(),
            g: self.g[r0 * hv..r1 * hv].to_vec(),
            beta: self.beta[r0 * hv..r1 * hv].to_vec(),
        }
    }
}

/// The row-by-row rule (`gdn_step`): S [hv, dk, dv] updated in place, returns out [n, hv, dv].
fn rowwise(x: &Inputs, s: &mut [f64]) -> Vec<f64> {
    let (hk, hv, dk, dv) = (x.hk, x.hv, x.dk, x.dv);
    let scale = 1.0 / (dk as f64).sqrt();
    let mut out = vec![0.0; x.n * hv * dv];
    for t in 0..x.n {
        for h in 0..hv {
            let kh = &x.k[(t * hk + h % hk) * dk..][..dk];
            let qh = &x.q[(t * hk + h % hk) * dk..][..dk];
            let sh = &mut s[h * dk * dv..][..dk * dv];
            let (dcy, b) = (x.g[t * hv + h].exp(), x.beta[t * hv + h]);
            for j in 0..dv {
                let u: f64 = (0..dk).map(|i| sh[i * dv + j] * kh[i]).sum();
                let delta = b * (x.v[(t * hv + h) * dv + j] - dcy * u);
                for i in 0..dk {
                    sh[i * dv + j] = dcy * sh[i * dv + j] + kh[i] * delta;
                }
                out[(t * hv + h) * dv + j] =
                    (0..dk).map(|i| sh[i * dv + j] * qh[i]).sum::<f64>() * scale;
            }
        }
    }
    out
}

/// What `gdn_chunk_prep_d128` writes, per v-head h: U0 / W rows [h][npad row][column],
/// P [h][chunk][t][s], γ and the decay to the chunk end [h][npad row].
struct Prep {
    nch: usize,
    u0: Vec<Vec<Vec<f64>>>,
    wk: Vec<Vec<Vec<f64>>>,
    p: Vec<Vec<Vec<Vec<f64>>>>,
    gam: Vec<Vec<f64>>,
    dl: Vec<Vec<f64>>,
}

/// The prep kernel: per chunk the log-decay prefix sum L, the strictly lower A and the causal P,
/// then [U0 | W] by forward substitution; rows past n padded (g = β = 0, k = q = v = 0).
fn prep(x: &Inputs) -> Prep {
    let (hk, hv, dk, dv) = (x.hk, x.hv, x.dk, x.dv);
    let nch = x.n.div_ceil(C);
    let npad = nch * C;
    let mut pr = Prep {
        nch,
        u0: vec![vec![vec![0.0; dv]; npad]; hv],
        wk: vec![vec![vec![0.0; dk]; npad]; hv],
        p: vec![vec![vec![vec![0.0; C]; C]; nch]; hv],
        gam: vec![vec![0.0; npad]; hv],
        dl: vec![vec![0.0; npad]; hv],
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for h in 0..hv {
        for c in 0..nch {
            let t0 = c * C;
            let nr = C.min(x.n - t0);
            let row = |src: &[f64], t: usize| -> Vec<f64> {
                if t < nr {
                    src[((t0 + t) * hk + h % hk) * dk..][..dk].to_vec()
                } else {
                    vec![0.0; dk]
                }
            };
            let kk: Vec<Vec<f64>> = (0..C).map(|t| row(&x.k, t)).collect();
            let qq: Vec<Vec<f64>> = (0..C).map(|t| row(&x.q, t)).collect();
            let gb = |t: usize| {
                if t < nr {
                    (x.g[(t0 + t) * hv + h], x.beta[(t0 + t) * hv + h])
                } else {
                    (0.0, 0.0)
                }
            };
            let mut l = [0.0f64; C];
            let mut acc = 0.0;
            for (t, lt) in l.iter_mut().enumerate() {
                acc += gb(t).0;
                *lt = acc;
            }
            let mut a = vec![[0.0f64; C]; C];
            for t in 0..C {
                for sx in 0..=t {
                    let e = (l[t] - l[sx]).exp();
                    if sx < t {
                        a[t][sx] = gb(t).1 * e * dot(&kk[t], &kk[sx]);
                    }
                    pr.p[h][c][t][sx] = e * dot(&qq[t], &kk[sx]);
                }
            }
            for t in 0..C {
                let b = gb(t).1;
                for j in 0..dv {
                    let vj = if t < nr {
                        x.v[((t0 + t) * hv + h) * dv + j]
                    } else {
                        0.0
                    };
                    pr.u0[h][t0 + t][j] = b * vj
                        - (0..t)
                            .map(|sx| a[t][sx] * pr.u0[h][t0 + sx][j])
                            .sum::<f64>();
                }
                for i in 0..dk {
                    pr.wk[h][t0 + t][i] = b * l[t].exp() * kk[t][i]
                        - (0..t)
                            .map(|sx| a[t][sx] * pr.wk[h][t0 + sx][i])
                            .sum::<f64>();
                }
                pr.gam[h][t0 + t] = l[t].exp();
                pr.dl[h][t0 + t] = (l[C - 1] - l[t]).exp();
            }
        }
    }
    pr
}

/// The chunk walk of `gdn_chunk_scan_d128` (plain f64 sums): per chunk Δ = U0 − W S,
/// O = (γ ⊙ Q S + P Δ) / √dk, S ← γ_63 S + Σ_s e^{L_63 − L_s} k_s δ_sᵀ.
fn walk(x: &Inputs, pr: &Prep, s: &mut [f64]) -> Vec<f64> {
    let (hk, hv, dk, dv) = (x.hk, x.hv, x.dk, x.dv);
    let scale = 1.0 / (dk as f64).sqrt();
    let mut out = vec![0.0; x.n * hv * dv];
    for h in 0..hv {
        let sh = &mut s[h * dk * dv..][..dk * dv];
        for c in 0..pr.nch {
            let (t0, nr) = (c * C, C.min(x.n - c * C));
            let kq = |src: &[f64], t: usize, i: usize| {
                if t < nr {
                    src[((t0 + t) * hk + h % hk) * dk + i]
                } else {
                    0.0
                }
            };
            let delta: Vec<Vec<f64>> = (0..C)
                .map(|t| {
                    (0..dv)
                        .map(|j| {
                            pr.u0[h][t0 + t][j]
                                - (0..dk)
                                    .map(|i| pr.wk[h][t0 + t][i] * sh[i * dv + j])
                                    .sum::<f64>()
                        })
                        .collect()
                })
                .collect();
            for t in 0..nr {
                for j in 0..dv {
                    let qs: f64 = (0..dk).map(|i| kq(&x.q, t, i) * sh[i * dv + j]).sum();
                    let pd: f64 = (0..=t).map(|sx| pr.p[h][c][t][sx] * delta[sx][j]).sum();
                    out[((t0 + t) * hv + h) * dv + j] = (pr.gam[h][t0 + t] * qs + pd) * scale;
                }
            }
            let gl = pr.gam[h][t0 + C - 1];
            for i in 0..dk {
                for j in 0..dv {
                    sh[i * dv + j] = gl * sh[i * dv + j]
                        + (0..C)
                            .map(|sx| pr.dl[h][t0 + sx] * kq(&x.k, sx, i) * delta[sx][j])
                            .sum::<f64>();
                }
            }
        }
    }
    out
}

/// The chunked form: prep, then the walk.
fn chunked(x: &Inputs, s: &mut [f64]) -> Vec<f64> {
    walk(x, &prep(x), s)
}

/// The chunked form with the tensor-core walk, every block replayed lane by lane.
fn chunked_tc(x: &Inputs, s: &mut [f64]) -> Vec<f64> {
    let pr = prep(x);
    let mut out = vec![0.0; x.n * x.hv * x.dv];
    for h in 0..x.hv {
        for j0 in (0..x.dv).step_by(JS) {
            walk_tc_block(x, &pr, h, j0, s, &mut out);
        }
    }
    out
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-300f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

#[test]
fn chunked_gdn_equals_rowwise_rule() {
    let dims = (2usize, 4usize, 16usize, 8usize);
    // moderate decays, and decays down to about -40 per row (the products underflow in a chunk)
    for (decay, seed) in [(0.3f64, 1u64), (20.0, 2)] {
        for n in [1usize, 9, 64, 65, 200] {
            let mut rng = Rng(seed * 1000 + n as u64);
            let x = Inputs::random(&mut rng, dims, n, decay);
            let s0: Vec<f64> = (0..dims.1 * dims.2 * dims.3)
                .map(|_| 0.1 * uniform(&mut rng))
                .collect();
            let (mut sa, mut sb) = (s0.clone(), s0.clone());
            let (oa, ob) = (rowwise(&x, &mut sa), chunked(&x, &mut sb));
            let (eo, es) = (max_rel(&ob, &oa), max_rel(&sb, &sa));
            assert!(
                eo < 1e-12 && es < 1e-12,
                "decay {decay} n {n}: out {eo:e}, state {es:e}"
            );
            // a launch split at a row that is not a chunk boundary: the state carries over
            if n > 2 {
                let m = n / 2 + 1;
                let mut sc = s0.clone();
                let mut oc = chunked(&x.rows(0, m), &mut sc);
                oc.extend(chunked(&x.rows(m, n), &mut sc));
                let (eo, es) = (max_rel(&oc, &oa), max_rel(&sc, &sa));
                assert!(
                    eo < 1e-12 && es < 1e-12,
                    "decay {decay} n {n} split {m}: out {eo:e}, state {es:e}"
                );
            }
        }
    }
}

// ---- the tensor-core chunk walk (`gdn_chunk_scan_tc_d128`), lane by lane ------------------------

/// `mma.m16n8k8` on per-lane fragments (g = lane / 4, q = lane % 4; PTX layouts):
/// A a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4); B b0 (q, g), b1 (q+4, g);
/// C c0 (g, 2q), c1 (g, 2q+1), c2 (g+8, 2q), c3 (g+8, 2q+1). f64 (no TF32 rounding: this checks
/// which element every lane loads and where every product lands).
fn mma_m16n8k8(c: &mut [[f64; 4]; 32], a: &[[f64; 4]; 32], b: &[[f64; 2]; 32]) {
    let mut am = [[0.0f64; 8]; 16];
    let mut bm = [[0.0f64; 8]; 8];
    for lane in 0..32 {
        let (g, q) = (lane / 4, lane % 4);
        am[g][q] = a[lane][0];
        am[g + 8][q] = a[lane][1];
        am[g][q + 4] = a[lane][2];
        am[g + 8][q + 4] = a[lane][3];
        bm[q][g] = b[lane][0];
        bm[q + 4][g] = b[lane][1];
    }
    mma_c_add(c, |r, col| {
        (0..8).map(|kk| am[r][kk] * bm[kk][col]).sum::<f64>()
    });
}

// the kernel's shared-memory strides
const GT_SST: usize = 24;
const GT_XST: usize = 68;
const GT_KST: usize = 136;
const JS: usize = 16;

/// One block of `gdn_chunk_scan_tc_d128` (head h, value columns j0..j0+16) over the chunk data the
/// prep kernel writes (here from [`prep`]), with the kernel's index expressions.
#[allow(clippy::too_many_arguments)]
fn walk_tc_block(x: &Inputs, pr: &Prep, h: usize, j0: usize, s: &mut [f64], out: &mut [f64]) {
    let (hk, hv, dk) = (x.hk, x.hv, x.dk);
    let d = dk; // GK_D: dk = dv
    let scale = 1.0 / (d as f64).sqrt();
    let kap = h % hk;
    let mut ss = vec![0.0f64; d * GT_SST];
    for i in 0..d {
        for cc in 0..JS {
            ss[i * GT_SST + cc] = s[(h * d + i) * d + j0 + cc];
        }
    }
    let mut xs = vec![0.0f64; 2 * C * GT_XST];
    let mut ds = vec![0.0f64; C * GT_SST];
    let mut dts = vec![0.0f64; C * GT_SST];
    for c in 0..pr.nch {
        let (t0, nr) = (c * C, C.min(x.n - c * C));
        // per warp: [m-tile][n-tile][lane][fragment]
        let mut accw: Vec<[[[[f64; 4]; 32]; 2]; 2]> = vec![[[[[0.0f64; 4]; 32]; 2]; 2]; 4];
        for half in 0..2 {
            for r in 0..2 * C {
                for cc in 0..64 {
                    let i = half * 64 + cc;
                    xs[r * GT_XST + cc] = if r < C {
                        pr.wk[h][t0 + r][i]
                    } else if r - C < nr {
                        x.q[((t0 + r - C) * hk + kap) * dk + i]
                    } else {
                        0.0
                    };
                }
            }
            for (w, aw) in accw.iter_mut().enumerate() {
                for ks in 0..8 {
                    let mut bf = [[[0.0f64; 2]; 32]; 2];
                    for (nt, b) in bf.iter_mut().enumerate() {
                        for (lane, bl) in b.iter_mut().enumerate() {
                            let (g, qd) = (lane / 4, lane % 4);
                            bl[0] = ss[(half * 64 + 8 * ks + qd) * GT_SST + 8 * nt + g];
                            bl[1] = ss[(half * 64 + 8 * ks + qd + 4) * GT_SST + 8 * nt + g];
                        }
                    }
                    for mt in 0..2 {
                        let mut af = [[0.0f64; 4]; 32];
                        for (lane, al) in af.iter_mut().enumerate() {
                            let (g, qd) = (lane / 4, lane % 4);
                            let xr = (32 * w + 16 * mt + g) * GT_XST + 8 * ks + qd;
                            *al = [
                                xs[xr],
                                xs[xr + 8 * GT_XST],
                                xs[xr + 4],
                                xs[xr + 8 * GT_XST + 4],
                            ];
                        }
                        for nt in 0..2 {
                            mma_m16n8k8(&mut aw[mt][nt], &af, &bf[nt]);
                        }
                    }
                }
            }
        }
        // warps 0-1: Δ and Δ̃
        for (w, aw) in accw.iter().enumerate().take(2) {
            for mt in 0..2 {
                for hh in 0..2 {
                    for lane in 0..32 {
                        let (g, qd) = (lane / 4, lane % 4);
                        let t = 32 * w + 16 * mt + g + 8 * hh;
                        for nt in 0..2 {
                            let col = 8 * nt + 2 * qd;
                            for e in 0..2 {
                                let dv =
                                    pr.u0[h][t0 + t][j0 + col + e] - aw[mt][nt][lane][2 * hh + e];
                                ds[t * GT_SST + col + e] = dv;
                                dts[t * GT_SST + col + e] = pr.dl[h][t0 + t] * dv;
                            }
                        }
                    }
                }
            }
        }
        // the K tile in the half tile's place
        let mut ksm = vec![0.0f64; C * GT_KST];
        for r in 0..nr {
            for cc in 0..dk {
                ksm[r * GT_KST + cc] = x.k[((t0 + r) * hk + kap) * dk + cc];
            }
        }
        // warps 2-3: O
        for (w, aw) in accw.iter_mut().enumerate().skip(2) {
            for mt in 0..2 {
                let r0 = 32 * (w - 2) + 16 * mt;
                for nt in 0..2 {
                    for lane in 0..32 {
                        let g = lane / 4;
                        let (ga, gb) = (pr.gam[h][t0 + r0 + g], pr.gam[h][t0 + r0 + g + 8]);
                        let a = &mut aw[mt][nt][lane];
                        a[0] *= ga;
                        a[1] *= ga;
                        a[2] *= gb;
                        a[3] *= gb;
                    }
                }
                let mut ks = 0;
                while 8 * ks <= r0 + 15 {
                    let mut af = [[0.0f64; 4]; 32];
                    for (lane, al) in af.iter_mut().enumerate() {
                        let (g, qd) = (lane / 4, lane % 4);
                        let p = |t: usize, sx: usize| pr.p[h][c][t][sx];
                        *al = [
                            p(r0 + g, 8 * ks + qd),
                            p(r0 + g + 8, 8 * ks + qd),
                            p(r0 + g, 8 * ks + qd + 4),
                            p(r0 + g + 8, 8 * ks + qd + 4),
                        ];
                    }
                    for nt in 0..2 {
                        let mut bf = [[0.0f64; 2]; 32];
                        for (lane, bl) in bf.iter_mut().enumerate() {
                            let (g, qd) = (lane / 4, lane % 4);
                            *bl = [
                                ds[(8 * ks + qd) * GT_SST + 8 * nt + g],
                                ds[(8 * ks + qd + 4) * GT_SST + 8 * nt + g],
                            ];
                        }
                        mma_m16n8k8(&mut aw[mt][nt], &af, &bf);
                    }
                    ks += 1;
                }
                for hh in 0..2 {
                    for lane in 0..32 {
                        let (g, qd) = (lane / 4, lane % 4);
                        let t = r0 + g + 8 * hh;
                        if t < nr {
                            for nt in 0..2 {
                                for e in 0..2 {
                                    out[((t0 + t) * hv + h) * d + j0 + 8 * nt + 2 * qd + e] =
                                        aw[mt][nt][lane][2 * hh + e] * scale;
                                }
                            }
                        }
                    }
                }
            }
        }
        // warps 0-1: the state
        let gl = pr.gam[h][t0 + C - 1];
        for w in 0..2 {
            for mt in 0..4 {
                let i0 = 64 * w + 16 * mt;
                let mut sn = [[[0.0f64; 4]; 32]; 2];
                for (nt, snt) in sn.iter_mut().enumerate() {
                    for (lane, sl) in snt.iter_mut().enumerate() {
                        let (g, qd) = (lane / 4, lane % 4);
                        let col = 8 * nt + 2 * qd;
                        *sl = [
                            gl * ss[(i0 + g) * GT_SST + col],
                            gl * ss[(i0 + g) * GT_SST + col + 1],
                            gl * ss[(i0 + g + 8) * GT_SST + col],
                            gl * ss[(i0 + g + 8) * GT_SST + col + 1],
                        ];
                    }
                }
                for ks in 0..8 {
                    let mut af = [[0.0f64; 4]; 32];
                    for (lane, al) in af.iter_mut().enumerate() {
                        let (g, qd) = (lane / 4, lane % 4);
                        let kr = (8 * ks + qd) * GT_KST + i0 + g;
                        *al = [
                            ksm[kr],
                            ksm[kr + 8],
                            ksm[kr + 4 * GT_KST],
                            ksm[kr + 4 * GT_KST + 8],
                        ];
                    }
                    for (nt, snt) in sn.iter_mut().enumerate() {
                        let mut bf = [[0.0f64; 2]; 32];
                        for (lane, bl) in bf.iter_mut().enumerate() {
                            let (g, qd) = (lane / 4, lane % 4);
                            *bl = [
                                dts[(8 * ks + qd) * GT_SST + 8 * nt + g],
                                dts[(8 * ks + qd + 4) * GT_SST + 8 * nt + g],
                            ];
                        }
                        mma_m16n8k8(snt, &af, &bf);
                    }
                }
                for (nt, snt) in sn.iter().enumerate() {
                    for (lane, sl) in snt.iter().enumerate() {
                        let (g, qd) = (lane / 4, lane % 4);
                        let col = 8 * nt + 2 * qd;
                        ss[(i0 + g) * GT_SST + col] = sl[0];
                        ss[(i0 + g) * GT_SST + col + 1] = sl[1];
                        ss[(i0 + g + 8) * GT_SST + col] = sl[2];
                        ss[(i0 + g + 8) * GT_SST + col + 1] = sl[3];
                    }
                }
            }
        }
    }
    for i in 0..d {
        for cc in 0..JS {
            s[(h * d + i) * d + j0 + cc] = ss[i * GT_SST + cc];
        }
    }
}

#[test]
fn tensor_core_walk_indexing_equals_rowwise_rule() {
    // the kernel's shapes: dk = dv = 128 (its tiles), one k-head for two v-heads; a partial chunk,
    // and a launch split off a chunk boundary
    let dims = (1usize, 2usize, 128usize, 128usize);
    for (decay, n) in [(0.3f64, 9usize), (0.3, 130), (20.0, 70)] {
        let mut rng = Rng(77 + n as u64);
        let x = Inputs::random(&mut rng, dims, n, decay);
        let s0: Vec<f64> = (0..dims.1 * dims.2 * dims.3)
            .map(|_| 0.1 * uniform(&mut rng))
            .collect();
        let (mut sa, mut sb) = (s0.clone(), s0.clone());
        let (oa, ob) = (rowwise(&x, &mut sa), chunked_tc(&x, &mut sb));
        let (eo, es) = (max_rel(&ob, &oa), max_rel(&sb, &sa));
        assert!(
            eo < 1e-12 && es < 1e-12,
            "decay {decay} n {n}: out {eo:e}, state {es:e}"
        );
        let m = n / 2 + 1;
        let mut sc = s0.clone();
        let mut oc = chunked_tc(&x.rows(0, m), &mut sc);
        oc.extend(chunked_tc(&x.rows(m, n), &mut sc));
        let (eo, es) = (max_rel(&oc, &oa), max_rel(&sc, &sa));
        assert!(
            eo < 1e-12 && es < 1e-12,
            "decay {decay} n {n} split {m}: out {eo:e}, state {es:e}"
        );
    }
}
