//! Scalar reference ops: the oracle every optimized and GPU kernel is checked against.
//!
//! Written for clarity, never optimized. Math follows MODEL.md §3. Reductions (dot products,
//! sums of squares, softmax sums) accumulate in **f64** and round once to f32 at the end; stored
//! state stays f32 (MODEL.md §3.0). All buffers are row-major f32 slices with explicit dims.

use crate::quant::{dequantize_row, QuantType};

/// `y[o] = Σ_i W[o, i] · x[i]` for a raw GGUF weight `w` of `n_out` rows of `n_in` elements.
///
/// Dequantizes each row with [`dequantize_row`] and dots it with the f32 activations in f64.
/// No activation quantization: this is the exact f32-activation oracle.
pub fn matvec(
    w: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    x: &[f32],     // [n_in]
    y: &mut [f32], // [n_out]
) {
    let rb = qt
        .row_bytes(n_in)
        .expect("matvec: n_in is not a whole number of blocks");
    assert_eq!(w.len(), rb * n_out, "matvec: weight bytes");
    assert_eq!(x.len(), n_in);
    assert_eq!(y.len(), n_out);
    let mut row = vec![0f32; n_in]; // row: [n_in] dequantized weights of one output
    for o in 0..n_out {
        dequantize_row(qt, &w[o * rb..(o + 1) * rb], &mut row);
        let mut acc = 0f64;
        for i in 0..n_in {
            acc += row[i] as f64 * x[i] as f64;
        }
        y[o] = acc as f32;
    }
}

/// `out = x / sqrt(mean(x²) + eps) * w`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len());
    assert_eq!(x.len(), out.len());
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = 1.0 / (ss / x.len() as f64 + eps as f64).sqrt();
    for i in 0..x.len() {
        out[i] = (x[i] as f64 * inv) as f32 * w[i];
    }
}

/// RMSNorm in place over each `head_dim` slice of `x`, with one weight `w: [head_dim]` shared by all heads.
pub fn rmsnorm_heads(x: &mut [f32], head_dim: usize, w: &[f32], eps: f32) {
    assert_eq!(w.len(), head_dim);
    assert_eq!(x.len() % head_dim, 0);
    let mut tmp = vec![0f32; head_dim];
    for h in x.chunks_exact_mut(head_dim) {
        rmsnorm(h, w, eps, &mut tmp);
        h.copy_from_slice(&tmp);
    }
}

/// `x / max(‖x‖₂, eps)` in place, per `head_dim` slice.
pub fn l2norm_heads(x: &mut [f32], head_dim: usize, eps: f32) {
    assert_eq!(x.len() % head_dim, 0);
    for h in x.chunks_exact_mut(head_dim) {
        let ss: f64 = h.iter().map(|&v| v as f64 * v as f64).sum();
        let inv = 1.0 / ss.sqrt().max(eps as f64);
        for v in h.iter_mut() {
            *v = (*v as f64 * inv) as f32;
        }
    }
}

/// NEOX RoPE in place on every head of `x` (`x.len() / head_dim` heads): for `d < n_rot/2` the pair
/// `(d, d + n_rot/2)` rotates by `theta_d = pos · base^(−2d/n_rot)`. Dims `n_rot..head_dim` are untouched.
pub fn rope_neox(x: &mut [f32], head_dim: usize, n_rot: usize, pos: usize, base: f32) {
    assert!(n_rot <= head_dim && n_rot % 2 == 0);
    assert_eq!(x.len() % head_dim, 0);
    let half = n_rot / 2;
    for h in x.chunks_exact_mut(head_dim) {
        for d in 0..half {
            let theta = pos as f64 * (base as f64).powf(-2.0 * d as f64 / n_rot as f64);
            let (s, c) = theta.sin_cos();
            let a = h[d] as f64;
            let b = h[d + half] as f64;
            h[d] = (a * c - b * s) as f32;
            h[d + half] = (a * s + b * c) as f32;
        }
    }
}

/// `x · σ(x)`.
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `1 / (1 + e^{−x})`.
pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

/// `ln(1 + e^x)`, and `x` itself for `x > 20` (ggml's switch point).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (x as f64).exp().ln_1p() as f32
    }
}

/// One step of the causal depthwise conv with SiLU (MODEL.md §3.2 step 2).
///
/// `out[c] = SiLU(Σ_{j<k−1} w[c, j] · state[j, c] + w[c, k−1] · x[c])`; then the state shifts by one
/// row and `x` becomes its newest (last) row.
pub fn conv1d_silu_step(
    state: &mut [f32], // [k-1, C] pre-conv inputs, oldest first
    x: &[f32],         // [C] this token's pre-conv input
    w: &[f32],         // [C, k] per-channel taps, tap k-1 = current token
    k: usize,
    out: &mut [f32], // [C]
) {
    conv1d_step(state, x, w, k, out);
    out.iter_mut().for_each(|v| *v = silu(*v));
}

/// [`conv1d_silu_step`] without the SiLU: `out[c]` is the conv sum (f64 accumulation in tap order,
/// rounded once to f32), and the state shifts the same way.
pub fn conv1d_step(
    state: &mut [f32], // [k-1, C] pre-conv inputs, oldest first
    x: &[f32],         // [C] this token's pre-conv input
    w: &[f32],         // [C, k] per-channel taps, tap k-1 = current token
    k: usize,
    out: &mut [f32], // [C]
) {
    let c = x.len();
    assert!(k >= 1);
    assert_eq!(state.len(), (k - 1) * c);
    assert_eq!(w.len(), c * k);
    assert_eq!(out.len(), c);
    for ch in 0..c {
        let mut acc = w[ch * k + k - 1] as f64 * x[ch] as f64;
        for j in 0..k - 1 {
            acc += w[ch * k + j] as f64 * state[j * c + ch] as f64;
        }
        out[ch] = acc as f32;
    }
    if k > 1 {
        state.copy_within(c.., 0);
        state[(k - 2) * c..].copy_from_slice(x);
    }
}

/// One gated delta-rule step for every v-head (MODEL.md §3.2 step 5), TILED head order:
/// v-head `h` uses k-head `h % h_k`.
///
/// `S ← exp(g)·S; u = Sᵀk; δ = β(v − u); S += k δᵀ; o = (1/√d_k)·Sᵀq`.
pub fn gdn_step(
    s: &mut [f32], // [h_v, d_k, d_v] S[h][i][j], i = key dim
    q: &[f32],     // [h_k, d_k] l2-normed
    k: &[f32],     // [h_k, d_k] l2-normed
    v: &[f32],     // [h_v, d_v]
    g: &[f32],     // [h_v] log-decay ≤ 0
    beta: &[f32],  // [h_v]
    h_k: usize,
    d_k: usize,
    d_v: usize,
    out: &mut [f32], // [h_v, d_v]
) {
    let h_v = g.len();
    assert_eq!(s.len(), h_v * d_k * d_v);
    assert_eq!(q.len(), h_k * d_k);
    assert_eq!(k.len(), h_k * d_k);
    assert_eq!(v.len(), h_v * d_v);
    assert_eq!(beta.len(), h_v);
    assert_eq!(out.len(), h_v * d_v);
    let scale = 1.0 / (d_k as f64).sqrt();
    for h in 0..h_v {
        let kap = h % h_k;
        let sh = &mut s[h * d_k * d_v..(h + 1) * d_k * d_v]; // sh: [d_k, d_v]
        let kh = &k[kap * d_k..(kap + 1) * d_k];
        let qh = &q[kap * d_k..(kap + 1) * d_k];
        let vh = &v[h * d_v..(h + 1) * d_v];
        let decay = (g[h] as f64).exp() as f32;
        for e in sh.iter_mut() {
            *e *= decay;
        }
        for j in 0..d_v {
            let mut u = 0f64;
            for i in 0..d_k {
                u += sh[i * d_v + j] as f64 * kh[i] as f64;
            }
            let delta = (beta[h] as f64 * (vh[j] as f64 - u)) as f32;
            for i in 0..d_k {
                sh[i * d_v + j] += kh[i] * delta;
            }
        }
        for j in 0..d_v {
            let mut o = 0f64;
            for i in 0..d_k {
                o += sh[i * d_v + j] as f64 * qh[i] as f64;
            }
            out[h * d_v + j] = (o * scale) as f32;
        }
    }
}

/// The chunked form of `t` consecutive [`gdn_step`]s (MODEL.md §3.3), chunk size `chunk` (64 in the model).
///
/// Same layouts as `gdn_step` with a leading `[T]` axis; `s` is the incoming state and is updated to the
/// state after the last token. Must equal `t` repeated `gdn_step`s within f32 rounding.
pub fn gdn_chunked(
    s: &mut [f32], // [h_v, d_k, d_v]
    q: &[f32],     // [T, h_k, d_k] l2-normed (unscaled)
    k: &[f32],     // [T, h_k, d_k] l2-normed
    v: &[f32],     // [T, h_v, d_v]
    g: &[f32],     // [T, h_v]
    beta: &[f32],  // [T, h_v]
    t: usize,
    h_k: usize,
    d_k: usize,
    d_v: usize,
    chunk: usize,
    out: &mut [f32], // [T, h_v, d_v]
) {
    assert!(chunk >= 1);
    let h_v = g
        .len()
        .checked_div(t)
        .unwrap_or(s.len() / (d_k * d_v).max(1));
    assert_eq!(s.len(), h_v * d_k * d_v);
    assert_eq!(q.len(), t * h_k * d_k);
    assert_eq!(k.len(), t * h_k * d_k);
    assert_eq!(v.len(), t * h_v * d_v);
    assert_eq!(g.len(), t * h_v);
    assert_eq!(beta.len(), t * h_v);
    assert_eq!(out.len(), t * h_v * d_v);
    let scale = 1.0 / (d_k as f64).sqrt();
    for h in 0..h_v {
        let kap = h % h_k;
        let sh = &mut s[h * d_k * d_v..(h + 1) * d_k * d_v]; // sh: [d_k, d_v]
        let mut c0 = 0;
        while c0 < t {
            let l = chunk.min(t - c0); // rows in this chunk (padding rows would change nothing)
            let krow =
                |r: usize| &k[((c0 + r) * h_k + kap) * d_k..((c0 + r) * h_k + kap + 1) * d_k];
            let qrow =
                |r: usize| &q[((c0 + r) * h_k + kap) * d_k..((c0 + r) * h_k + kap + 1) * d_k];
            let vrow = |r: usize| &v[((c0 + r) * h_v + h) * d_v..((c0 + r) * h_v + h + 1) * d_v];
            let bt = |r: usize| beta[(c0 + r) * h_v + h] as f64;
            // gamma: [l] cumulative log-decay inside the chunk
            let mut gamma = vec![0f64; l];
            let mut cum = 0f64;
            for r in 0..l {
                cum += g[(c0 + r) * h_v + h] as f64;
                gamma[r] = cum;
            }
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
            };
            // a: [l, l] strictly lower: β_t (k_t·k_s) exp(γ_t − γ_s)
            let mut a = vec![0f64; l * l];
            for r in 0..l {
                for c in 0..r {
                    a[r * l + c] = bt(r) * dot(krow(r), krow(c)) * (gamma[r] - gamma[c]).exp();
                }
            }
            // u: [l, d_v] = (I+A)^-1 β v ; w: [l, d_k] = (I+A)^-1 (β k exp(γ)) by forward substitution
            let mut u = vec![0f64; l * d_v];
            let mut w = vec![0f64; l * d_k];
            for r in 0..l {
                for j in 0..d_v {
                    u[r * d_v + j] = bt(r) * vrow(r)[j] as f64;
                }
                for i in 0..d_k {
                    w[r * d_k + i] = bt(r) * krow(r)[i] as f64 * gamma[r].exp();
                }
                for c in 0..r {
                    let arc = a[r * l + c];
                    for j in 0..d_v {
                        u[r * d_v + j] -= arc * u[c * d_v + j];
                    }
                    for i in 0..d_k {
                        w[r * d_k + i] -= arc * w[c * d_k + i];
                    }
                }
            }
            // vp: [l, d_v] = U − W·S  (row r is δ_r of the recurrence)
            let mut vp = u;
            for r in 0..l {
                for j in 0..d_v {
                    let mut acc = 0f64;
                    for i in 0..d_k {
                        acc += w[r * d_k + i] * sh[i * d_v + j] as f64;
                    }
                    vp[r * d_v + j] -= acc;
                }
            }
            // O = (q ⊙ exp(γ))·S + ((q·kᵀ) ⊙ D)·V'  with q scaled by 1/√d_k
            for r in 0..l {
                let qr = qrow(r);
                for j in 0..d_v {
                    let mut acc = 0f64;
                    for i in 0..d_k {
                        acc += qr[i] as f64 * sh[i * d_v + j] as f64;
                    }
                    acc *= gamma[r].exp();
                    for c in 0..=r {
                        acc += dot(qr, krow(c)) * (gamma[r] - gamma[c]).exp() * vp[c * d_v + j];
                    }
                    out[((c0 + r) * h_v + h) * d_v + j] = (acc * scale) as f32;
                }
            }
            // S ← exp(γ_last)·S + (k ⊙ exp(γ_last − γ))ᵀ·V'
            let gl = gamma[l - 1];
            for i in 0..d_k {
                for j in 0..d_v {
                    let mut acc = gl.exp() * sh[i * d_v + j] as f64;
                    for r in 0..l {
                        acc += krow(r)[i] as f64 * (gl - gamma[r]).exp() * vp[r * d_v + j];
                    }
                    sh[i * d_v + j] = acc as f32;
                }
            }
            c0 += l;
        }
    }
}

/// Softmax attention of one query row over `t` cached positions (the caller passes the causal prefix).
/// GROUPED GQA: q head `h` uses kv head `h / (n_head / n_kv)`.
pub fn attention(
    q: &[f32],       // [n_head, hd]
    k_cache: &[f32], // [T, n_kv, hd]
    v_cache: &[f32], // [T, n_kv, hd]
    t: usize,
    n_head: usize,
    n_kv: usize,
    hd: usize,
    scale: f32,
    out: &mut [f32], // [n_head, hd]
) {
    assert!(t >= 1 && n_kv >= 1 && n_head % n_kv == 0);
    assert_eq!(q.len(), n_head * hd);
    assert!(k_cache.len() >= t * n_kv * hd && v_cache.len() >= t * n_kv * hd);
    assert_eq!(out.len(), n_head * hd);
    let group = n_head / n_kv;
    let mut p = vec![0f64; t]; // p: [T] scores then probabilities
    for h in 0..n_head {
        let kv = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        for (pos, pv) in p.iter_mut().enumerate() {
            let kr = &k_cache[(pos * n_kv + kv) * hd..(pos * n_kv + kv + 1) * hd];
            let d: f64 = qh.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
            *pv = d * scale as f64;
        }
        let m = p.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let mut sum = 0f64;
        for pv in p.iter_mut() {
            *pv = (*pv - m).exp();
            sum += *pv;
        }
        for j in 0..hd {
            let mut acc = 0f64;
            for (pos, &pv) in p.iter().enumerate() {
                acc += pv * v_cache[(pos * n_kv + kv) * hd + j] as f64;
            }
            out[h * hd + j] = (acc / sum) as f32;
        }
    }
}
