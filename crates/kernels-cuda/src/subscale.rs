//! The integer sub-scale activation format on the host (the design of the kernels README,
//! emulated in `sub_emu.rs`): the twin of the `quant_rows_sub` kernel, and a replay of the
//! `mvq_*` mat-vec in its float order. The GPU tests check the kernels against these.

use crate::retile::{Retiled, WKind};
use half::f16;

const LEVELS: i32 = 16;

/// Activation rows in the sub-scale format.
pub struct SubActs {
    /// [n, k] codes.
    pub q: Vec<i8>,
    /// [n, k / ge] the group's unit amax / (127 · 16): a code q of sub-block j is worth q · u · m_j.
    pub u: Vec<f32>,
    /// [n, k / 32] sub-scales, 1..=16.
    pub m: Vec<i32>,
    /// [n, k / 32] code sums.
    pub s: Vec<i32>,
}

/// Host twin of `quant_rows_sub` (integer sub-scale activations, groups of `ge`): codes
/// `[n, k]`, units `[n, k / ge]` (amax / (127 · 16)), sub-scales 1..=16 and code sums `[n, k / 32]`.
/// Per group: the amax A and u = A / (127 · 16); per sub-block j: its amax a_j,
/// m_j = clamp(ceil(16 · a_j / A), 1, 16), codes round(x / (u · m_j)) clamped to ±127 — the f32
/// operations of the kernel, so the bits agree.
pub fn host_quant_sub(x: &[f32], k: usize, ge: usize) -> (Vec<i8>, Vec<f32>, Vec<i32>, Vec<i32>) {
    assert!(k % ge == 0 && ge % 32 == 0);
    let n = x.len() / k;
    let (ng, nsb, spg) = (k / ge, k / 32, ge / 32);
    let (mut q, mut u) = (vec![0i8; n * k], vec![0f32; n * ng]);
    let (mut m, mut s) = (vec![1i32; n * nsb], vec![0i32; n * nsb]);
    for t in 0..n {
        for gi in 0..ng {
            let xg = &x[t * k + gi * ge..t * k + (gi + 1) * ge];
            let amax = xg.iter().fold(0f32, |m, &v| m.max(v.abs()));
            let un = amax / (127.0 * LEVELS as f32);
            u[t * ng + gi] = un;
            for (jj, xs) in xg.chunks_exact(32).enumerate() {
                let j = gi * spg + jj;
                let aj = xs.iter().fold(0f32, |m, &v| m.max(v.abs()));
                let mj = if amax > 0.0 {
                    ((LEVELS as f32 * aj / amax).ceil() as i32).clamp(1, LEVELS)
                } else {
                    1
                };
                let dj = un * mj as f32;
                let id = if dj != 0.0 { 1.0 / dj } else { 0.0 };
                let mut sum = 0;
                for (e, &v) in xs.iter().enumerate() {
                    let qv = (v * id).round().clamp(-127.0, 127.0) as i32;
                    q[t * k + 32 * j + e] = qv as i8;
                    sum += qv;
                }
                m[t * nsb + j] = mj;
                s[t * nsb + j] = sum;
            }
        }
    }
    (q, u, m, s)
}

/// Σ code · q over sub-block `j` of row `o` (Q1 ±1, Q2 c − 1) from the re-tiled code words: the
/// exact integer every kernel's sub-block dot gives.
fn isum(rt: &Retiled, nsb: usize, o: usize, j: usize, qa: &[i8]) -> i32 {
    let word = |i: usize| u32::from_le_bytes(rt.codes[4 * i..4 * i + 4].try_into().unwrap());
    let mut sum = 0;
    if rt.kind == WKind::Q1 {
        // bit i of byte b is element 4i + b
        let w = word(o * nsb + j);
        for (e, &q) in qa.iter().enumerate() {
            let bit = (w >> (8 * (e % 4) + e / 4)) & 1;
            sum += if bit == 1 { q as i32 } else { -(q as i32) };
        }
    } else {
        // two words; 2-bit field s of byte i of a word is element 4s + i of its 16
        for h in 0..2 {
            let w = word(2 * (o * nsb + j) + h);
            for e in 0..16 {
                let c = ((w >> (8 * (e % 4) + 2 * (e / 4))) & 3) as i32;
                sum += (c - 1) * qa[16 * h + e] as i32;
            }
        }
    }
    sum
}

/// The `mvq_*` kernel's value of row `o` of the re-tiled matrix `rt` for one activation row
/// (`q`, `u`, `m`, `s` of [`host_quant_sub`] with groups of the weight block), K split `ks`:
/// block B adds `fma(dw_B · u_B, Σ_j m_j · isum_j, ·)` into partial B mod BPC (8 per chunk of 32
/// sub-blocks; 16 for g64), the chunks of a K part (c ≡ kp mod ks) in increasing order; then the
/// butterfly over the partials (p with p ^ 1, p ^ 2, ...), then the K parts in order.
pub fn mv_sub_host(rt: &Retiled, q: &[i8], u: &[f32], m: &[i32], o: usize, ks: usize) -> f32 {
    let n_in = rt.n_in;
    let nsb = n_in / 32;
    let spb = if rt.kind == WKind::Q2G64 { 2 } else { 4 };
    let (nblk, bpc) = (nsb / spb, 32 / spb);
    let nch = nblk.div_ceil(bpc);
    let mut v = 0f32;
    for kp in 0..ks {
        let mut part = vec![0f32; bpc];
        for c in (kp..nch).step_by(ks) {
            for (p, pa) in part.iter_mut().enumerate() {
                let blk = c * bpc + p;
                if blk >= nblk {
                    continue;
                }
                let mut s = 0i32;
                for j in blk * spb..(blk + 1) * spb {
                    s += m[j] * isum(rt, nsb, o, j, &q[32 * j..32 * j + 32]);
                }
                let dw = f16::from_bits(rt.scales[o * nblk + blk]).to_f32();
                *pa = (dw * u[blk]).mul_add(s as f32, *pa);
            }
        }
        let mut x = part;
        let mut w = 1;
        while w < x.len() {
            x = (0..x.len()).map(|p| x[p] + x[p ^ w]).collect();
            w <<= 1;
        }
        v = if kp == 0 { x[0] } else { v + x[0] };
    }
    v
}
