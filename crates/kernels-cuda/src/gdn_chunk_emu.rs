//! Host replay of the chunked GDN recurrence (`gdn_chunk_prep_d128` + `gdn_chunk_scan_d128` in
//! `kernels/prefill.cu`; tests only, no GPU), in f64 against the row-by-row gated delta rule.
//!
//! It follows the kernels' steps — per 64-row chunk the log-decay prefix sum L, the strictly lower
//! A and the causal P, the forward substitution for U0 = T (β ⊙ V) and W = T (βγ ⊙ K), then per
//! chunk in order Δ = U0 − W S, O = (γ ⊙ Q S + P Δ) / √dk and S ← γ_63 S + Σ_s e^{L_63 − L_s} k_s δ_sᵀ —
//! with rows past n padded as the kernels pad them (g = β = 0, k = q = v = 0). So it checks the
//! algebra of the chunked form, the padding of a last partial chunk and a launch split at any row;
//! `tests/gpu_kernels.rs` checks the kernels themselves on the GPU.

use crate::mvm_emu::Rng;

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

/// The chunked form, step for step as the two kernels compute it.
fn chunked(x: &Inputs, s: &mut [f64]) -> Vec<f64> {
    let (hk, hv, dk, dv) = (x.hk, x.hv, x.dk, x.dv);
    let scale = 1.0 / (dk as f64).sqrt();
    let mut out = vec![0.0; x.n * hv * dv];
    for h in 0..hv {
        let sh = &mut s[h * dk * dv..][..dk * dv];
        for t0 in (0..x.n).step_by(C) {
            let nr = C.min(x.n - t0);
            // padded rows: g = β = 0, k = q = v = 0
            let kr = |t: usize| -> Vec<f64> {
                if t < nr {
                    x.k[((t0 + t) * hk + h % hk) * dk..][..dk].to_vec()
                } else {
                    vec![0.0; dk]
                }
            };
            let qr = |t: usize| -> Vec<f64> {
                if t < nr {
                    x.q[((t0 + t) * hk + h % hk) * dk..][..dk].to_vec()
                } else {
                    vec![0.0; dk]
                }
            };
            let (kk, qq): (Vec<Vec<f64>>, Vec<Vec<f64>>) =
                ((0..C).map(kr).collect(), (0..C).map(qr).collect());
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
            let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
            // prep: A (s < t), P (s <= t), then [U0 | W] by forward substitution
            let mut a = vec![[0.0f64; C]; C];
            let mut p = vec![[0.0f64; C]; C];
            for t in 0..C {
                for sx in 0..=t {
                    let e = (l[t] - l[sx]).exp();
                    if sx < t {
                        a[t][sx] = gb(t).1 * e * dot(&kk[t], &kk[sx]);
                    }
                    p[t][sx] = e * dot(&qq[t], &kk[sx]);
                }
            }
            let mut u0 = vec![vec![0.0f64; dv]; C];
            let mut w = vec![vec![0.0f64; dk]; C];
            for t in 0..C {
                let b = gb(t).1;
                for j in 0..dv {
                    let vj = if t < nr {
                        x.v[((t0 + t) * hv + h) * dv + j]
                    } else {
                        0.0
                    };
                    u0[t][j] = b * vj - (0..t).map(|sx| a[t][sx] * u0[sx][j]).sum::<f64>();
                }
                for i in 0..dk {
                    w[t][i] = b * l[t].exp() * kk[t][i]
                        - (0..t).map(|sx| a[t][sx] * w[sx][i]).sum::<f64>();
                }
            }
            // scan: Δ, O, then the state
            let delta: Vec<Vec<f64>> = (0..C)
                .map(|t| {
                    (0..dv)
                        .map(|j| u0[t][j] - (0..dk).map(|i| w[t][i] * sh[i * dv + j]).sum::<f64>())
                        .collect()
                })
                .collect();
            for t in 0..nr {
                for j in 0..dv {
                    let qs: f64 = (0..dk).map(|i| qq[t][i] * sh[i * dv + j]).sum();
                    let pd: f64 = (0..=t).map(|sx| p[t][sx] * delta[sx][j]).sum();
                    out[((t0 + t) * hv + h) * dv + j] = (l[t].exp() * qs + pd) * scale;
                }
            }
            let gl = l[C - 1].exp();
            for i in 0..dk {
                for j in 0..dv {
                    sh[i * dv + j] = gl * sh[i * dv + j]
                        + (0..C)
                            .map(|sx| (l[C - 1] - l[sx]).exp() * kk[sx][i] * delta[sx][j])
                            .sum::<f64>();
                }
            }
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
