//! Causal grouped-query attention over a KV cache with the σ(gate) output gate fused, computed in
//! fixed chunks of [`ATTN_CHUNK`] key positions.
//!
//! Every (row, q head) result is one fixed function of its query, its gate and its key prefix
//! `0..len`, whatever the number of rows, their start position, the thread count or the schedule:
//!
//! - chunk `c` holds keys `c·C .. min((c+1)·C, len)` (C = [`ATTN_CHUNK`], cut at absolute
//!   positions, so a verify row and the single-token step at its position see the same chunks);
//! - per chunk, in position order: scores `s_j = dot_f32(q, k_j)·scale`, `m = max s_j`,
//!   `p_j = e^(s_j − m)` (the polynomial `exp` of [`ops::log_sum_exp`], which vectorizes),
//!   `l = Σ p_j`, `o = Σ p_j·v_j` (element-wise multiply then add);
//! - chunks merged in increasing order, the first taken as it is, each next one by
//!   `M' = max(M, m)`, `L' = L·e^(M−M') + l·e^(m−M')`, `O' = O·e^(M−M') + o·e^(m−M')`;
//! - `out = O / L · σ(gate)` ([`ops::sigmoid_fast`]).
//!
//! A prefix of one chunk (len ≤ C) is therefore the plain one-pass softmax, bit for bit.
//!
//! Two schedules give the same bits: a few rows (decode, verify) run one task per (kv head,
//! chunk), which converts the chunk's K/V to f32 once for every row and q head of the group and
//! writes each chunk's partial, then one task per (row, q head) merges them; many rows (prefill)
//! run one task per (kv head, block of rows) that walks the chunks and merges as it goes. A task
//! holds one chunk of K/V as f32 (`C·hd` floats each), never a whole prefix.

use crate::ops::{self, Isa};
use crate::par;

/// Key positions per chunk (the merge unit of [`attention_gated`]).
pub const ATTN_CHUNK: usize = 256;

/// Rows at or below which [`attention_gated`] runs the per-chunk schedule.
const FEW_ROWS: usize = 8;

/// Query rows per task of the many-rows schedule.
const ROW_BLOCK: usize = 16;

/// The K/V cache of one attention layer as [`attention_gated`] reads it.
pub trait KvSource: Sync {
    /// Keys of positions `pos .. pos + out.len() / hd` of kv head `g`, as f32 rows `[len, hd]`.
    fn keys(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]);
    /// The values, as [`KvSource::keys`].
    fn values(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]);
}

/// Contiguous f32 caches `[T, n_kv, hd]` (tests and the reference comparisons).
pub struct F32Kv<'a> {
    pub k: &'a [f32], // [T, n_kv, hd]
    pub v: &'a [f32], // [T, n_kv, hd]
    pub n_kv: usize,
}

impl KvSource for F32Kv<'_> {
    fn keys(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]) {
        copy_rows(self.k, self.n_kv, pos, g, hd, out)
    }
    fn values(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]) {
        copy_rows(self.v, self.n_kv, pos, g, hd, out)
    }
}

fn copy_rows(src: &[f32], n_kv: usize, pos: usize, g: usize, hd: usize, out: &mut [f32]) {
    for (j, o) in out.chunks_exact_mut(hd).enumerate() {
        let r = ((pos + j) * n_kv + g) * hd;
        o.copy_from_slice(&src[r..r + hd]);
    }
}

/// Shapes of one [`attention_gated`] call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query rows.
    pub n: usize,
    /// Position of row 0: row `t` attends to keys `0 ..= pos0 + t`.
    pub pos0: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub hd: usize,
    pub scale: f32,
}

/// Which schedule [`attention_gated_with`] runs (both give the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnSchedule {
    /// Pick by row count: [`AttnSchedule::PerChunk`] up to 8 rows, else [`AttnSchedule::RowBlocks`].
    Auto,
    /// One task per (kv head, chunk) writing partials, then one per (row, q head) merging them.
    PerChunk,
    /// One task per (kv head, block of rows), merging chunk by chunk.
    RowBlocks,
}

/// `out[t, h] = softmax(q[t, h]·K[..=pos0+t]ᵀ·scale)·V · σ(gate[t, h])` for every row and q head
/// (grouped: q head `h` reads kv head `h / (n_head / n_kv)`), as the module docs define it.
pub fn attention_gated(
    kv: &dyn KvSource,
    q: &[f32],    // [n, n_head, hd] normed, rotated queries
    gate: &[f32], // [n, n_head, hd] gate logits
    s: AttnShape,
    out: &mut [f32], // [n, n_head, hd]
) {
    attention_gated_with(AttnSchedule::Auto, kv, q, gate, s, out)
}

/// [`attention_gated`] with a chosen schedule (A/B and tests).
pub fn attention_gated_with(
    sched: AttnSchedule,
    kv: &dyn KvSource,
    q: &[f32],    // [n, n_head, hd]
    gate: &[f32], // [n, n_head, hd]
    s: AttnShape,
    out: &mut [f32], // [n, n_head, hd]
) {
    let AttnShape {
        n,
        n_head,
        n_kv,
        hd,
        ..
    } = s;
    assert!(
        n_kv >= 1 && n_head % n_kv == 0,
        "attention: {n_head} q heads over {n_kv} kv heads"
    );
    assert_eq!(q.len(), n * n_head * hd, "attention: q length");
    assert_eq!(gate.len(), n * n_head * hd, "attention: gate length");
    assert_eq!(out.len(), n * n_head * hd, "attention: out length");
    if n == 0 || hd == 0 {
        return;
    }
    let few = match sched {
        AttnSchedule::Auto => n <= FEW_ROWS,
        AttnSchedule::PerChunk => true,
        AttnSchedule::RowBlocks => false,
    };
    if few {
        per_chunk(kv, q, gate, s, out)
    } else {
        row_blocks(kv, q, gate, s, out)
    }
}

/// One loaded chunk's partials for `np = nks.len()` (row, q head) pairs at once: pair p's query is
/// `qs[p]` (`[np, hd]`), it sees the chunk's first `nks[p]` keys / values (`kf` / `vf`,
/// `[nk, hd]`), and gets `ml[p] = (m, l)` and `os[p]` (`[np, hd]`); `sc` is scratch `[np, C]`.
/// Per pair the operations are one pair's alone, in the same order (keys ascending for the
/// scores, the max, the sum and every output element's Σ p·v); the pairs only share the walk over
/// the keys, in sub-blocks of [`SUB`] that stay in L1 while every pair passes. The same bits on
/// every ISA: the AVX bodies are this code compiled for wider registers (Rust never fuses a
/// multiply and an add on its own), with [`ops::dot_f32`]'s AVX2 form, which equals its scalar one.
#[allow(clippy::too_many_arguments)]
fn chunk_partials(
    isa: Isa,
    qs: &[f32],
    nks: &[usize],
    kf: &[f32],
    vf: &[f32],
    hd: usize,
    scale: f32,
    sc: &mut [f32],
    os: &mut [f32],
    ml: &mut [(f32, f32)],
) {
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: `isa` comes from `ops::active_isa` (or a test's `isa_supported` check), which
        // give only ISAs this CPU supports.
        Isa::Avx512 => {
            return unsafe { chunk_partials_avx512(qs, nks, kf, vf, hd, scale, sc, os, ml) }
        }
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { chunk_partials_avx2(qs, nks, kf, vf, hd, scale, sc, os, ml) },
        Isa::Scalar => {}
    }
    let _ = isa;
    chunk_partials_body::<64>(
        |a, b| ops::dot_f32_isa(Isa::Scalar, a, b),
        qs,
        nks,
        kf,
        vf,
        hd,
        scale,
        sc,
        os,
        ml,
    )
}

/// Keys per sub-block of [`chunk_partials`]: 32 keys of K (or V) are 16 KB at hd 128.
const SUB: usize = 32;

/// [`chunk_partials`] compiled for an x86 feature set, with `B` outputs per register block.
macro_rules! chunk_partials_for {
    ($name:ident, $features:literal, $b:literal, $what:literal) => {
        #[doc = concat!("[`chunk_partials`] for ", $what, ".")]
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, ".")]
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            qs: &[f32],
            nks: &[usize],
            kf: &[f32],
            vf: &[f32],
            hd: usize,
            scale: f32,
            sc: &mut [f32],
            os: &mut [f32],
            ml: &mut [(f32, f32)],
        ) {
            chunk_partials_body::<$b>(
                // SAFETY: AVX2 + FMA are enabled here (the caller's contract); a key row and
                // the query have hd elements each.
                |a, b| unsafe { crate::avx2::dot(a, b) },
                qs,
                nks,
                kf,
                vf,
                hd,
                scale,
                sc,
                os,
                ml,
            )
        }
    };
}
chunk_partials_for!(chunk_partials_avx2, "avx2,fma,f16c", 64, "AVX2");
chunk_partials_for!(
    chunk_partials_avx512,
    "avx2,fma,f16c,avx512f",
    128,
    "AVX-512 (the element-wise loops 16 lanes wide)"
);

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn chunk_partials_body<const B: usize>(
    dot: impl Fn(&[f32], &[f32]) -> f32,
    qs: &[f32],
    nks: &[usize],
    kf: &[f32],
    vf: &[f32],
    hd: usize,
    scale: f32,
    sc: &mut [f32],
    os: &mut [f32],
    ml: &mut [(f32, f32)],
) {
    let nmax = nks.iter().copied().max().unwrap_or(0);
    // scores: sc[p][j] = q_p·k_j·scale, a sub-block of keys against every pair
    for k0 in (0..nmax).step_by(SUB) {
        for (p, &nk) in nks.iter().enumerate() {
            let qh = &qs[p * hd..(p + 1) * hd];
            for j in k0..(k0 + SUB).min(nk) {
                sc[p * ATTN_CHUNK + j] = dot(qh, &kf[j * hd..(j + 1) * hd]) * scale;
            }
        }
    }
    // per pair: the max, the exps and their sum, in key order
    for (p, &nk) in nks.iter().enumerate() {
        let row = &mut sc[p * ATTN_CHUNK..p * ATTN_CHUNK + nk];
        let m = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        for x in row.iter_mut() {
            *x = ops::exp_nonpos(*x - m);
        }
        ml[p] = (m, row.iter().fold(0f32, |l, &x| l + x));
    }
    // o_p = Σ p_j·v_j, each element from 0 in key order, a sub-block of values against every pair
    os[..nks.len() * hd].fill(0.0);
    for k0 in (0..nmax).step_by(SUB) {
        for (p, &nk) in nks.iter().enumerate() {
            if nk > k0 {
                let pj = &sc[p * ATTN_CHUNK + k0..p * ATTN_CHUNK + (k0 + SUB).min(nk)];
                pv_add::<B>(pj, &vf[k0 * hd..], hd, &mut os[p * hd..(p + 1) * hd]);
            }
        }
    }
}

/// `o += Σ_j p_j·v_j` over `p`'s keys (`vf` from the first of them), each element in key order
/// (multiply, then add). The output is walked in register-sized blocks with the keys inside, so a
/// block's sums stay in registers; the operations per element are the plain loop's. `B`: 8
/// independent vector sums (64 for 8-lane AVX2, 128 for 16-lane AVX-512), enough to hide the add
/// latency.
#[inline(always)]
fn pv_add<const B: usize>(p: &[f32], vf: &[f32], hd: usize, o: &mut [f32]) {
    let mut i0 = 0;
    while i0 + B <= hd {
        let mut acc: [f32; B] = o[i0..i0 + B].try_into().unwrap();
        for (j, &pj) in p.iter().enumerate() {
            let v: &[f32; B] = vf[j * hd + i0..j * hd + i0 + B].try_into().unwrap();
            for i in 0..B {
                acc[i] += pj * v[i];
            }
        }
        o[i0..i0 + B].copy_from_slice(&acc);
        i0 += B;
    }
    if i0 < hd {
        for (j, &pj) in p.iter().enumerate() {
            for (x, v) in o[i0..].iter_mut().zip(&vf[j * hd + i0..(j + 1) * hd]) {
                *x += pj * v;
            }
        }
    }
}

/// Merges a chunk's partial `(m, l, o)` into the running `(acc_m, acc_l, acc_o)`; the first chunk
/// (`acc_m` = −∞) is taken as it is.
fn merge(acc_m: &mut f32, acc_l: &mut f32, acc_o: &mut [f32], m: f32, l: f32, o: &[f32]) {
    if *acc_m == f32::NEG_INFINITY {
        *acc_m = m;
        *acc_l = l;
        acc_o.copy_from_slice(o);
        return;
    }
    let mn = acc_m.max(m);
    let (a, b) = ((*acc_m - mn).exp(), (m - mn).exp());
    *acc_l = *acc_l * a + l * b;
    for (x, y) in acc_o.iter_mut().zip(o) {
        *x = *x * a + *y * b;
    }
    *acc_m = mn;
}

/// `out = o / l · σ(gate)`.
fn finish(o: &[f32], l: f32, gate: &[f32], out: &mut [f32]) {
    for ((y, x), gv) in out.iter_mut().zip(o).zip(gate) {
        *y = *x / l * ops::sigmoid_fast(*gv);
    }
}

/// One task's scratch for one chunk: its keys and values as f32 (`[C, hd]` each), and for up to
/// `pairs` (row, q head) pairs their queries, scores, partial outputs and `(m, l)`.
struct ChunkScratch {
    kf: Vec<f32>,             // [C, hd]
    vf: Vec<f32>,             // [C, hd]
    qs: Vec<f32>,             // [pairs, hd]
    nks: Vec<usize>,          // [pairs]
    who: Vec<(usize, usize)>, // [pairs] (row, q head in the group)
    sc: Vec<f32>,             // [pairs, C]
    os: Vec<f32>,             // [pairs, hd]
    ml: Vec<(f32, f32)>,      // [pairs]
}

impl ChunkScratch {
    fn new(hd: usize, pairs: usize) -> Self {
        ChunkScratch {
            kf: vec![0f32; ATTN_CHUNK * hd],
            vf: vec![0f32; ATTN_CHUNK * hd],
            qs: Vec::with_capacity(pairs * hd),
            nks: Vec::with_capacity(pairs),
            who: Vec::with_capacity(pairs),
            sc: vec![0f32; pairs * ATTN_CHUNK],
            os: vec![0f32; pairs * hd],
            ml: vec![(0f32, 0f32); pairs],
        }
    }

    /// Loads chunk `c` of kv head `g` as far as row `rows.end − 1` reaches, then gives every row
    /// of `rows` that reaches the chunk and every q head of the group its partial:
    /// `f(t, jh, m, l, o)`.
    #[allow(clippy::too_many_arguments)]
    fn walk(
        &mut self,
        isa: Isa,
        kv: &dyn KvSource,
        q: &[f32],
        s: &AttnShape,
        g: usize,
        c: usize,
        rows: std::ops::Range<usize>,
        mut f: impl FnMut(usize, usize, f32, f32, &[f32]),
    ) {
        let (hd, group) = (s.hd, s.n_head / s.n_kv);
        let c0 = c * ATTN_CHUNK;
        let span = (s.pos0 + rows.end - c0).min(ATTN_CHUNK); // keys the longest row sees
        kv.keys(c0, g, hd, &mut self.kf[..span * hd]);
        kv.values(c0, g, hd, &mut self.vf[..span * hd]);
        self.qs.clear();
        self.nks.clear();
        self.who.clear();
        for t in rows {
            let len = s.pos0 + t + 1;
            if len <= c0 {
                continue;
            }
            for jh in 0..group {
                let th = t * s.n_head + g * group + jh;
                self.qs.extend_from_slice(&q[th * hd..(th + 1) * hd]);
                self.nks.push((len - c0).min(ATTN_CHUNK));
                self.who.push((t, jh));
            }
        }
        chunk_partials(
            isa,
            &self.qs,
            &self.nks,
            &self.kf,
            &self.vf,
            hd,
            s.scale,
            &mut self.sc,
            &mut self.os,
            &mut self.ml,
        );
        for (p, &(t, jh)) in self.who.iter().enumerate() {
            let (m, l) = self.ml[p];
            f(t, jh, m, l, &self.os[p * hd..(p + 1) * hd]);
        }
    }
}

fn per_chunk(kv: &dyn KvSource, q: &[f32], gate: &[f32], s: AttnShape, out: &mut [f32]) {
    let (n, hd, n_head) = (s.n, s.hd, s.n_head);
    let group = n_head / s.n_kv;
    let isa = ops::active_isa();
    // chunks of the longest row
    let nch = (s.pos0 + n).div_ceil(ATTN_CHUNK);
    // one partial: m, l, o[hd]
    let slot = hd + 2;
    // parts: [n_kv, nch, n, group, hd + 2]; a row's slots past its own prefix stay unused
    let mut parts = vec![0f32; s.n_kv * nch * n * group * slot];
    par::for_each_chunk_mut(&mut parts, n * group * slot, 1, |gc, part| {
        let mut scratch = ChunkScratch::new(hd, n * group);
        scratch.walk(
            isa,
            kv,
            q,
            &s,
            gc / nch,
            gc % nch,
            0..n,
            |t, jh, m, l, o| {
                let p = &mut part[(t * group + jh) * slot..(t * group + jh + 1) * slot];
                p[0] = m;
                p[1] = l;
                p[2..].copy_from_slice(o);
            },
        );
    });
    par::for_each_chunk_mut(out, hd, 1, |th, oh| {
        let (t, h) = (th / n_head, th % n_head);
        let (g, jh) = (h / group, h % group);
        let len = s.pos0 + t + 1;
        let (mut am, mut al) = (f32::NEG_INFINITY, 0f32);
        let mut ao = vec![0f32; hd];
        for c in 0..len.div_ceil(ATTN_CHUNK) {
            let i = (((g * nch + c) * n + t) * group + jh) * slot;
            let p = &parts[i..i + slot];
            merge(&mut am, &mut al, &mut ao, p[0], p[1], &p[2..]);
        }
        finish(&ao, al, &gate[th * hd..(th + 1) * hd], oh);
    });
}

fn row_blocks(kv: &dyn KvSource, q: &[f32], gate: &[f32], s: AttnShape, out: &mut [f32]) {
    let (n, hd, n_head, n_kv) = (s.n, s.hd, s.n_head, s.n_kv);
    let group = n_head / n_kv;
    let isa = ops::active_isa();
    let nb = n.div_ceil(ROW_BLOCK);
    // one task's rows × q heads of its group
    let blk = ROW_BLOCK * group * hd;
    // res: [n_kv, nb·ROW_BLOCK, group, hd], then scattered into out's [n, n_head, hd]
    let mut res = vec![0f32; n_kv * nb * blk];
    par::for_each_chunk_mut(&mut res, blk, 1, |gb, rb| {
        let (g, b) = (gb / nb, gb % nb);
        let (t0, t1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(n));
        let rows = (t1 - t0) * group;
        let mut scratch = ChunkScratch::new(hd, rows);
        let mut am = vec![f32::NEG_INFINITY; rows]; // [rows, group] running max
        let mut al = vec![0f32; rows]; // [rows, group] running sum
        for c in 0..(s.pos0 + t1).div_ceil(ATTN_CHUNK) {
            scratch.walk(isa, kv, q, &s, g, c, t0..t1, |t, jh, m, l, o| {
                let r = (t - t0) * group + jh;
                merge(
                    &mut am[r],
                    &mut al[r],
                    &mut rb[r * hd..(r + 1) * hd],
                    m,
                    l,
                    o,
                );
            });
        }
        let mut o = vec![0f32; hd];
        for t in t0..t1 {
            for jh in 0..group {
                let r = (t - t0) * group + jh;
                let th = t * n_head + g * group + jh;
                o.copy_from_slice(&rb[r * hd..(r + 1) * hd]);
                finish(
                    &o,
                    al[r],
                    &gate[th * hd..(th + 1) * hd],
                    &mut rb[r * hd..(r + 1) * hd],
                );
            }
        }
    });
    par::for_each_chunk_mut(out, group * hd, 1, |tg, og| {
        let (t, g) = (tg / n_kv, tg % n_kv);
        let (b, r) = (t / ROW_BLOCK, t % ROW_BLOCK);
        let i = (g * nb + b) * blk + r * group * hd;
        og.copy_from_slice(&res[i..i + group * hd]);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    struct Case {
        k: Vec<f32>,
        v: Vec<f32>,
        q: Vec<f32>,
        gate: Vec<f32>,
        s: AttnShape,
    }

    fn case(n: usize, pos0: usize, n_head: usize, n_kv: usize, hd: usize, seed: u64) -> Case {
        let mut sd = seed;
        let t = pos0 + n;
        let mut gen =
            |len: usize, amp: f32| (0..len).map(|_| lcg(&mut sd) * amp).collect::<Vec<_>>();
        Case {
            k: gen(t * n_kv * hd, 1.0),
            v: gen(t * n_kv * hd, 1.0),
            q: gen(n * n_head * hd, 2.0),
            gate: gen(n * n_head * hd, 3.0),
            s: AttnShape {
                n,
                pos0,
                n_head,
                n_kv,
                hd,
                scale: 1.0 / (hd as f32).sqrt(),
            },
        }
    }

    fn run(c: &Case, sched: AttnSchedule) -> Vec<f32> {
        let kv = F32Kv {
            k: &c.k,
            v: &c.v,
            n_kv: c.s.n_kv,
        };
        let mut out = vec![0f32; c.q.len()];
        attention_gated_with(sched, &kv, &c.q, &c.gate, c.s, &mut out);
        out
    }

    #[test]
    fn every_isa_gives_the_scalar_partial_bits() {
        // pairs with ragged key counts (one past a sub-block, one inside the first); each pair's
        // partial is also the one-pair call's, so batching changes no bits
        for &(hd, nks) in &[
            (128, &[ATTN_CHUNK, 33, 1][..]),
            (40, &[37, 5][..]),
            (256, &[5][..]),
        ] {
            let np = nks.len();
            let c = case(np, ATTN_CHUNK - np, 1, 1, hd, hd as u64 + np as u64);
            let run_isa = |isa: Isa, qs: &[f32], nks: &[usize]| {
                let np = nks.len();
                let (mut sc, mut os) = (vec![0f32; np * ATTN_CHUNK], vec![0f32; np * hd]);
                let mut ml = vec![(0f32, 0f32); np];
                chunk_partials(
                    isa, qs, nks, &c.k, &c.v, hd, c.s.scale, &mut sc, &mut os, &mut ml,
                );
                let ml: Vec<_> = ml.iter().map(|(m, l)| (m.to_bits(), l.to_bits())).collect();
                (ml, os.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            let want = run_isa(Isa::Scalar, &c.q, nks);
            for isa in Isa::ALL.into_iter().filter(|&i| ops::isa_supported(i)) {
                assert_eq!(
                    run_isa(isa, &c.q, nks),
                    want,
                    "{isa:?} hd {hd} keys {nks:?}"
                );
                for p in 0..np {
                    let (ml, os) = run_isa(isa, &c.q[p * hd..(p + 1) * hd], &nks[p..p + 1]);
                    assert_eq!(ml[0], want.0[p], "{isa:?} pair {p} alone: m, l");
                    assert_eq!(
                        os,
                        want.1[p * hd..(p + 1) * hd],
                        "{isa:?} pair {p} alone: o"
                    );
                }
            }
        }
    }

    #[test]
    fn matches_the_f64_reference_across_chunks() {
        for &(n, pos0) in &[(1, 0), (1, 700), (3, 253), (20, 500), (37, 0)] {
            let c = case(n, pos0, 6, 2, 32, 7 + n as u64);
            let got = run(&c, AttnSchedule::Auto);
            let (nh, hd) = (c.s.n_head, c.s.hd);
            for t in 0..n {
                let mut want = vec![0f32; nh * hd];
                let len = pos0 + t + 1;
                reference::attention(
                    &c.q[t * nh * hd..(t + 1) * nh * hd],
                    &c.k,
                    &c.v,
                    len,
                    nh,
                    c.s.n_kv,
                    hd,
                    c.s.scale,
                    &mut want,
                );
                for i in 0..nh * hd {
                    let g = ops::sigmoid_fast(c.gate[t * nh * hd + i]);
                    let w = want[i] * g;
                    let e = (got[t * nh * hd + i] - w).abs();
                    assert!(
                        e <= 2e-5 * (1.0 + w.abs()),
                        "n {n} pos0 {pos0} row {t} elem {i}: {} vs {w}",
                        got[t * nh * hd + i]
                    );
                }
            }
        }
    }

    #[test]
    fn one_chunk_is_the_one_pass_softmax_bit_for_bit() {
        // the one-pass softmax (the CPU backend's formula before chunking, with the polynomial exp)
        // over a prefix of ≤ ATTN_CHUNK keys
        let c = case(4, ATTN_CHUNK - 4, 4, 2, 40, 3); // hd: one 32-block and a tail
        let got = run(&c, AttnSchedule::Auto);
        let AttnShape {
            n,
            pos0,
            n_head,
            n_kv,
            hd,
            scale,
        } = c.s;
        let group = n_head / n_kv;
        for t in 0..n {
            for h in 0..n_head {
                let g = h / group;
                let qh = &c.q[(t * n_head + h) * hd..(t * n_head + h + 1) * hd];
                let len = pos0 + t + 1;
                let mut sc: Vec<f32> = (0..len)
                    .map(|j| {
                        ops::dot_f32(qh, &c.k[(j * n_kv + g) * hd..(j * n_kv + g + 1) * hd]) * scale
                    })
                    .collect();
                let mx = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut sum = 0f32;
                for x in sc.iter_mut() {
                    *x = ops::exp_nonpos(*x - mx);
                    sum += *x;
                }
                let mut o = vec![0f32; hd];
                for (j, &p) in sc.iter().enumerate() {
                    for (x, v) in o
                        .iter_mut()
                        .zip(&c.v[(j * n_kv + g) * hd..(j * n_kv + g + 1) * hd])
                    {
                        *x += p * v;
                    }
                }
                for i in 0..hd {
                    let th = t * n_head + h;
                    let want = o[i] / sum * ops::sigmoid_fast(c.gate[th * hd + i]);
                    assert_eq!(
                        got[th * hd + i].to_bits(),
                        want.to_bits(),
                        "row {t} head {h} elem {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn schedules_rows_and_threads_give_the_same_bits() {
        let (n, pos0) = (21, 3 * ATTN_CHUNK - 9);
        let c = case(n, pos0, 6, 3, 24, 11);
        let a = run(&c, AttnSchedule::PerChunk);
        let b = run(&c, AttnSchedule::RowBlocks);
        assert_eq!(a, b, "schedules differ");
        let pool = par::SpinPool::new(3, std::time::Duration::from_micros(100)).unwrap();
        let p = pool.install(|| run(&c, AttnSchedule::RowBlocks));
        assert_eq!(a, p, "thread count changed the bits");
        // every row alone (a decode step at its position) equals its row of the batch
        let w = c.s.n_head * c.s.hd;
        for t in [0, 9, n - 1] {
            let one = Case {
                k: c.k.clone(),
                v: c.v.clone(),
                q: c.q[t * w..(t + 1) * w].to_vec(),
                gate: c.gate[t * w..(t + 1) * w].to_vec(),
                s: AttnShape {
                    n: 1,
                    pos0: pos0 + t,
                    ..c.s
                },
            };
            assert_eq!(
                run(&one, AttnSchedule::Auto),
                a[t * w..(t + 1) * w].to_vec(),
                "row {t} alone"
            );
        }
    }
}
