//! The DSpark drafter (arch `dspark`, MODEL.md §4.2–§4.6), run on the host with the CPU kernels.
//!
//! - Context rows (one per committed target position) are staged incrementally from the target's
//!   taps right after each target pass: `c = RMSNorm(W_fc·f) ⊙ hidden_norm`, then per layer the roped,
//!   normed K and the V of `c`. They never enter the residual stream, so a row's K/V depends on that
//!   row only and is computed once. The cache is a sliding window of `context_length − block_size`
//!   rows at absolute positions (RoPE scores depend only on distances, so this equals rebasing).
//! - A draft runs the `block_size` block rows `[id_last, M, M, M]` (embedding + one of two precomputed
//!   log-SNR vectors) through the layers with non-causal attention over `[context ; block]`, then the
//!   head and the SEQUENTIAL Markov correction with the mask id excluded.
//!
//! Drafter norms are plain `w` (no `+1`). The token embedding is shared with the target when the
//! bytes are equal.

use std::path::Path;
use std::sync::Arc;

use bonsai_kernels_cpu::{ops, reference as r, QuantType};

use crate::config::{DrafterConfig, TargetConfig};
use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// A weight matrix `[n_in, n_out]` read in place from a mapped file.
pub struct HostMat {
    g: Arc<Gguf>,
    idx: usize,
    pub qt: QuantType,
    pub n_in: usize,
    pub n_out: usize,
}

impl HostMat {
    pub fn load(g: &Arc<Gguf>, name: &str, n_in: usize, n_out: usize) -> Result<HostMat> {
        let (idx, qt, _) = g.matrix(name, n_in, n_out)?;
        Ok(HostMat {
            g: g.clone(),
            idx,
            qt,
            n_in,
            n_out,
        })
    }

    /// The matrix bytes: `n_out` rows of `row_bytes(n_in)`. Checked at load.
    pub fn data(&self) -> &[u8] {
        let t = &self.g.tensors()[self.idx];
        self.g
            .tensor_data(t)
            .expect("tensor extent validated at load")
    }

    fn row_bytes(&self) -> usize {
        self.qt.row_bytes(self.n_in).expect("validated")
    }

    /// y: `[n, n_out]` = x `[n, n_in]` · Wᵀ (batch-invariant kernels).
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * self.n_out];
        ops::matmul(self.data(), self.qt, self.n_in, self.n_out, x, n, &mut y);
        y
    }

    /// Dequantized row `i` (`[n_in]`).
    pub fn row(&self, i: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        bonsai_kernels_cpu::quant::dequantize_row(self.qt, &self.data()[i * rb..(i + 1) * rb], out);
    }
}

fn vector(g: &Gguf, name: &str, n: usize) -> Result<Vec<f32>> {
    let v = g.tensor_f32(name)?;
    if v.len() != n {
        return Err(Error::tensor(
            name,
            format!("expected {n} elements, found {}", v.len()),
        ));
    }
    if v.iter().any(|x| !x.is_finite()) {
        return Err(Error::tensor(name, "non-finite value"));
    }
    Ok(v)
}

pub(crate) struct DLayer {
    pub(crate) attn_norm: Vec<f32>, // [E]
    pub(crate) q: HostMat,          // [E, n_head·hd]
    pub(crate) k: HostMat,          // [E, n_kv·hd]
    pub(crate) v: HostMat,          // [E, n_kv·hd]
    pub(crate) q_norm: Vec<f32>,    // [hd]
    pub(crate) k_norm: Vec<f32>,    // [hd]
    pub(crate) out: HostMat,        // [n_head·hd, E]
    pub(crate) ffn_norm: Vec<f32>,  // [E]
    pub(crate) gate: HostMat,       // [E, n_ff]
    pub(crate) up: HostMat,         // [E, n_ff]
    pub(crate) down: HostMat,       // [n_ff, E]
}

/// A loaded drafter (weights only; per-sequence state is [`DraftState`]).
pub struct Drafter {
    pub cfg: DrafterConfig,
    /// True when `token_embd` has the target's bytes and the target's copy is used.
    pub embd_shared: bool,
    pub(crate) embd: HostMat,         // [E, V]
    pub(crate) output: HostMat,       // [E, V]
    pub(crate) output_norm: Vec<f32>, // [E]
    pub(crate) fc: HostMat,           // [n_taps·E, E]
    pub(crate) hidden_norm: Vec<f32>, // [E]
    pub(crate) markov_a: HostMat,     // [rank, V]: one rank-row per previous token
    pub(crate) markov_b: HostMat,     // [rank, V]: one rank-row per vocab entry
    /// The two log-SNR conditioning vectors `[E]`: anchor (k = 0) and mask rows.
    pub(crate) snr: [Vec<f32>; 2],
    pub(crate) layers: Vec<DLayer>,
}

impl Drafter {
    /// Load a `dspark` file for the target `tcfg` (whose file is `target`), refusing a drafter that
    /// does not fit it.
    pub fn load(path: &Path, target: &Arc<Gguf>, tcfg: &TargetConfig) -> Result<Drafter> {
        let g = Arc::new(Gguf::open(path)?);
        let cfg = DrafterConfig::from_gguf(&g)?;
        cfg.check_against(tcfg)?;
        if cfg.block_size < 1 || cfg.n_ctx_train <= cfg.block_size {
            return Err(Error::DrafterMismatch(format!(
                "block_size {} does not fit context_length {}",
                cfg.block_size, cfg.n_ctx_train
            )));
        }
        let (e, v) = (cfg.n_embd, cfg.n_vocab);
        let (hd, q, kv) = (
            cfg.head_dim,
            cfg.n_head * cfg.head_dim,
            cfg.n_head_kv * cfg.head_dim,
        );
        // Share the target's embedding when the bytes are equal.
        let own = HostMat::load(&g, "token_embd.weight", e, v)?;
        let shared = HostMat::load(target, "token_embd.weight", e, v)
            .ok()
            .filter(|t| t.qt == own.qt && t.data() == own.data());
        let embd_shared = shared.is_some();
        let embd = shared.unwrap_or(own);
        // block rows read one embedding row per draft straight from the map: read the whole table
        // in now rather than a disk read per new token inside the drafts
        embd.g.prefault(embd.data());
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            layers.push(DLayer {
                attn_norm: vector(&g, &n("attn_norm.weight"), e)?,
                q: HostMat::load(&g, &n("attn_q.weight"), e, q)?,
                k: HostMat::load(&g, &n("attn_k.weight"), e, kv)?,
                v: HostMat::load(&g, &n("attn_v.weight"), e, kv)?,
                q_norm: vector(&g, &n("attn_q_norm.weight"), hd)?,
                k_norm: vector(&g, &n("attn_k_norm.weight"), hd)?,
                out: HostMat::load(&g, &n("attn_output.weight"), q, e)?,
                ffn_norm: vector(&g, &n("ffn_norm.weight"), e)?,
                gate: HostMat::load(&g, &n("ffn_gate.weight"), e, cfg.n_ff)?,
                up: HostMat::load(&g, &n("ffn_up.weight"), e, cfg.n_ff)?,
                down: HostMat::load(&g, &n("ffn_down.weight"), cfg.n_ff, e)?,
            });
        }
        let snr = if cfg.log_snr_conditioning {
            let fc1 = HostMat::load(&g, "dspark.log_snr_fc1.weight", cfg.log_snr_dim, e)?;
            let b1 = vector(&g, "dspark.log_snr_fc1.bias", e)?;
            let fc2 = HostMat::load(&g, "dspark.log_snr_fc2.weight", e, e)?;
            let b2 = vector(&g, "dspark.log_snr_fc2.bias", e)?;
            let one = |lambda: f32| -> Vec<f32> {
                // t = 1000·(λ − λ_min)/(λ_max − λ_min); φ = [sin(t·ω) ‖ cos(t·ω)], ω_i = 10000^(−i/half)
                let t = 1000.0 * (lambda - cfg.min_log_snr) as f64
                    / (cfg.max_log_snr - cfg.min_log_snr) as f64;
                let half = cfg.log_snr_dim / 2;
                let mut phi = vec![0f32; cfg.log_snr_dim]; // [log_snr_dim]
                for i in 0..half {
                    let w = (-(10000f64.ln()) * i as f64 / half as f64).exp();
                    phi[i] = (t * w).sin() as f32;
                    phi[half + i] = (t * w).cos() as f32;
                }
                let mut h = fc1.matmul(&phi, 1); // [E]
                for (hi, bi) in h.iter_mut().zip(&b1) {
                    *hi = r::silu(*hi + bi);
                }
                let mut o = fc2.matmul(&h, 1); // [E]
                for (oi, bi) in o.iter_mut().zip(&b2) {
                    *oi += bi;
                }
                o
            };
            [one(cfg.max_log_snr), one(cfg.min_log_snr)]
        } else {
            [vec![0.0; e], vec![0.0; e]]
        };
        Ok(Drafter {
            embd_shared,
            embd,
            output: HostMat::load(&g, "output.weight", e, v)?,
            output_norm: vector(&g, "output_norm.weight", e)?,
            fc: HostMat::load(&g, "dspark.fc.weight", cfg.target_layers.len() * e, e)?,
            hidden_norm: vector(&g, "dspark.hidden_norm.weight", e)?,
            markov_a: HostMat::load(&g, "dspark.markov_head_a.weight", cfg.markov_rank, v)?,
            markov_b: HostMat::load(&g, "dspark.markov_head_b.weight", cfg.markov_rank, v)?,
            snr,
            layers,
            cfg,
        })
    }

    /// Context rows kept: the trained positions minus one block (MODEL.md §4.10).
    pub fn window(&self) -> usize {
        self.cfg.n_ctx_train - self.cfg.block_size
    }

    /// Width of one tap row: `n_taps · n_embd`.
    pub fn tap_width(&self) -> usize {
        self.cfg.target_layers.len() * self.cfg.n_embd
    }

    pub fn new_state(&self) -> DraftState {
        DraftState {
            k: vec![Vec::new(); self.cfg.n_layer],
            v: vec![Vec::new(); self.cfg.n_layer],
            kvw: self.cfg.n_head_kv * self.cfg.head_dim,
            off: 0,
            len: 0,
            next_pos: 0,
            window: self.window(),
            slack: (self.window() / 8).max(1),
            block: self.cfg.block_size,
        }
    }

    /// Per-head RMSNorm ⊙ w, then NEOX RoPE over all head dims at `pos`. x: `[heads·hd]`.
    fn norm_rope(&self, x: &mut [f32], w: &[f32], pos: usize) {
        let hd = self.cfg.head_dim;
        r::rmsnorm_heads(x, hd, w, self.cfg.rms_eps);
        r::rope_neox(x, hd, hd, pos, self.cfg.rope_base);
    }

    /// Stage `n` committed positions `pos0 .. pos0 + n` from their tap rows (taps: `[n, tap_width]`).
    /// Positions must continue the staged ones (a fresh state accepts any start).
    pub fn stage(&self, st: &mut DraftState, taps: &[f32], pos0: usize, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if st.len > 0 && pos0 != st.next_pos {
            return Err(Error::Backend(format!(
                "drafter context is staged up to position {}, got rows from {pos0}",
                st.next_pos
            )));
        }
        let e = self.cfg.n_embd;
        debug_assert_eq!(taps.len(), n * self.tap_width());
        // Rows older than the window would be evicted right away: never compute them.
        let skip = n.saturating_sub(st.window);
        let (taps, pos0, n) = (&taps[skip * self.tap_width()..], pos0 + skip, n - skip);
        st.make_room(n);
        let h = self.fc.matmul(taps, n); // [n, E]
        let mut c = vec![0f32; n * e]; // [n, E]
        for (hr, cr) in h.chunks_exact(e).zip(c.chunks_exact_mut(e)) {
            r::rmsnorm(hr, &self.hidden_norm, self.cfg.rms_eps, cr);
        }
        let kvw = st.kvw;
        for (il, l) in self.layers.iter().enumerate() {
            let mut k = l.k.matmul(&c, n); // [n, kvw]
            let v = l.v.matmul(&c, n); // [n, kvw]
            for (t, kr) in k.chunks_exact_mut(kvw).enumerate() {
                self.norm_rope(kr, &l.k_norm, pos0 + t);
            }
            st.k[il].extend_from_slice(&k);
            st.v[il].extend_from_slice(&v);
        }
        st.len += n;
        st.next_pos = pos0 + n;
        debug_assert!(st.len <= st.window && st.k[0].len() == (st.off + st.len) * kvw);
        Ok(())
    }

    /// Draft `block_size` tokens following `id_last` at position `start` (MODEL.md §4.5–§4.6).
    pub fn draft(&self, st: &mut DraftState, id_last: u32, start: usize) -> Result<Vec<u32>> {
        let logits = self.draft_logits(st, id_last, start)?;
        Ok(self.markov(&logits, id_last))
    }

    /// Block row `k` of a draft's input: `E[token] + snr_k` (`[E]`), token `id_last` for k = 0 and
    /// the mask id otherwise.
    pub fn block_row(&self, k: usize, id_last: u32) -> Vec<f32> {
        let c = &self.cfg;
        let tok = if k == 0 { id_last } else { c.mask_token_id };
        let mut xr = vec![0f32; c.n_embd];
        self.embd.row(tok as usize, &mut xr);
        let snr = &self.snr[usize::from(k % c.block_size != 0)];
        for (xi, si) in xr.iter_mut().zip(snr) {
            *xi += si;
        }
        xr
    }

    /// The head logits of a draft before the Markov correction: `[block_size, V]` (test / debug
    /// oracle of the GPU drafter; [`Drafter::draft`] is `markov(draft_logits)`).
    pub fn draft_logits(
        &self,
        st: &mut DraftState,
        id_last: u32,
        start: usize,
    ) -> Result<Vec<f32>> {
        if st.len > 0 && st.next_pos != start {
            return Err(Error::Backend(format!(
                "drafter context ends at {}, the block starts at {start}",
                st.next_pos
            )));
        }
        let c = &self.cfg;
        let (e, bs, hd) = (c.n_embd, c.block_size, c.head_dim);
        let (nh, nkv, kvw) = (c.n_head, c.n_head_kv, st.kvw);
        let eps = c.rms_eps;
        // room for the block rows appended (and dropped) per layer below: no reallocation
        st.make_room(0);
        // x: [bs, E] block rows [id_last, M, M, M] + log-SNR conditioning
        let mut x = vec![0f32; bs * e];
        for k in 0..bs {
            x[k * e..(k + 1) * e].copy_from_slice(&self.block_row(k, id_last));
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut u = vec![0f32; bs * e]; // [bs, E]
        for (il, l) in self.layers.iter().enumerate() {
            for (xr, ur) in x.chunks_exact(e).zip(u.chunks_exact_mut(e)) {
                r::rmsnorm(xr, &l.attn_norm, eps, ur);
            }
            let mut q = l.q.matmul(&u, bs); // [bs, nh·hd]
            let mut kb = l.k.matmul(&u, bs); // [bs, kvw]
            let vb = l.v.matmul(&u, bs); // [bs, kvw]
            for t in 0..bs {
                self.norm_rope(&mut q[t * nh * hd..(t + 1) * nh * hd], &l.q_norm, start + t);
                self.norm_rope(&mut kb[t * kvw..(t + 1) * kvw], &l.k_norm, start + t);
            }
            // non-causal attention over [context ; block]: append the block K/V, attend, drop them
            let (kc, vc) = (&mut st.k[il], &mut st.v[il]);
            let keep = kc.len();
            kc.extend_from_slice(&kb);
            vc.extend_from_slice(&vb);
            let t_all = st.len + bs;
            let mut att = vec![0f32; bs * nh * hd]; // [bs, nh·hd]
            for (t, ar) in att.chunks_exact_mut(nh * hd).enumerate() {
                ops::attention(
                    &q[t * nh * hd..(t + 1) * nh * hd],
                    &kc[st.off * kvw..],
                    &vc[st.off * kvw..],
                    t_all,
                    nh,
                    nkv,
                    hd,
                    scale,
                    ar,
                );
            }
            kc.truncate(keep);
            vc.truncate(keep);
            let y = l.out.matmul(&att, bs); // [bs, E]
            for (xi, yi) in x.iter_mut().zip(&y) {
                *xi += yi;
            }
            for (xr, ur) in x.chunks_exact(e).zip(u.chunks_exact_mut(e)) {
                r::rmsnorm(xr, &l.ffn_norm, eps, ur);
            }
            let mut gt = l.gate.matmul(&u, bs); // [bs, n_ff]
            let up = l.up.matmul(&u, bs); // [bs, n_ff]
            ops::silu_op(ops::SiluOp::GateMulUp, &mut gt, &up);
            let y = l.down.matmul(&gt, bs); // [bs, E]
            for (xi, yi) in x.iter_mut().zip(&y) {
                *xi += yi;
            }
        }
        for (xr, ur) in x.chunks_exact(e).zip(u.chunks_exact_mut(e)) {
            r::rmsnorm(xr, &self.output_norm, eps, ur);
        }
        Ok(self.output.matmul(&u, bs)) // [bs, V]
    }

    /// The sequential Markov correction: each step conditions on the token just chosen; the mask id
    /// is never drafted. logits: `[bs, V]`.
    pub fn markov(&self, logits: &[f32], id_last: u32) -> Vec<u32> {
        let v = self.cfg.n_vocab;
        let mut prev = id_last;
        let mut out = Vec::with_capacity(self.cfg.block_size);
        for row in logits.chunks_exact(v) {
            let scores = self.markov_scores(row, prev);
            // the first maximum in increasing id order (strict >); the mask id is −inf
            let mut best = (f32::NEG_INFINITY, 0u32);
            for (i, &s) in scores.iter().enumerate() {
                if s > best.0 {
                    best = (s, i as u32);
                }
            }
            prev = best.1;
            out.push(prev);
        }
        out
    }

    /// One Markov step's scores: `row[v] + markov_b[v]·markov_a[prev]` (`[V]`), the mask id −inf.
    pub fn markov_scores(&self, row: &[f32], prev: u32) -> Vec<f32> {
        let rank = self.cfg.markov_rank;
        let mut e = vec![0f32; rank]; // [rank]
        self.markov_a.row(prev as usize, &mut e);
        let mut s = self.markov_b.matmul(&e, 1); // [V]
        for (si, &l) in s.iter_mut().zip(row) {
            *si += l;
        }
        s[self.cfg.mask_token_id as usize] = f32::NEG_INFINITY;
        s
    }
}

/// A drafter context of `len` rows ending before position `next_pos`, cut to end before `pos`: `None`
/// when it keeps every row (`pos ≥ next_pos`), else the rows left (0: none, the context restarts).
pub(crate) fn cut_context(next_pos: usize, len: usize, pos: usize) -> Option<usize> {
    (pos < next_pos).then(|| len.saturating_sub(next_pos - pos))
}

/// The drafter's per-sequence state: the context K/V window. k, v per layer: `[off + len, kvw]` f32;
/// the live rows are `off .. off + len` at positions `next_pos − len .. next_pos`.
///
/// Memory is bounded once the window is full: each buffer holds at most
/// `window + slack + block` rows ([`DraftState::cap_rows`]); dead rows are dropped by compacting
/// (moving the live rows to the front) when the next append would pass that, never by growing.
#[derive(Clone)]
pub struct DraftState {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    kvw: usize,
    off: usize,
    len: usize,
    next_pos: usize,
    window: usize,
    /// Dead rows tolerated before compaction (amortizes the move of the live window).
    slack: usize,
    /// Block rows the draft appends temporarily.
    block: usize,
}

impl DraftState {
    pub fn reset(&mut self) {
        for b in self.k.iter_mut().chain(self.v.iter_mut()) {
            b.clear();
        }
        self.off = 0;
        self.len = 0;
        self.next_pos = 0;
    }

    /// Forget the staged positions at and after `pos` (the engine's prompt cache resumes a
    /// sequence at `pos`); the rows before it stay. A `pos` at or before the oldest live row
    /// forgets everything, like [`DraftState::reset`].
    pub fn truncate(&mut self, pos: usize) {
        match cut_context(self.next_pos, self.len, pos) {
            None => {}
            Some(0) => self.reset(),
            Some(len) => {
                (self.len, self.next_pos) = (len, pos);
                let end = (self.off + len) * self.kvw;
                for b in self.k.iter_mut().chain(self.v.iter_mut()) {
                    b.truncate(end);
                }
            }
        }
    }

    /// Number of context rows held (≤ the window).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The position after the last staged row.
    pub fn next_pos(&self) -> usize {
        self.next_pos
    }

    /// Bytes held by the context buffers (capacity).
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.capacity() * 4).sum()
    }

    /// Most rows a buffer ever holds: the window, the compaction slack and one draft block.
    pub fn cap_rows(&self) -> usize {
        self.window + self.slack + self.block
    }

    /// Bytes the buffers can ever hold ([`DraftState::cap_rows`] rows of K and V per layer).
    pub fn max_bytes(&self) -> usize {
        self.cap_rows() * self.kvw * 4 * (self.k.len() + self.v.len())
    }

    /// Make room to append `n ≤ window` rows plus a draft block: evict the oldest rows the window
    /// will not hold after the append, compact when the buffer end would pass
    /// [`DraftState::cap_rows`], and grow capacity (doubling, capped at `cap_rows`) only while the
    /// window is filling.
    fn make_room(&mut self, n: usize) {
        debug_assert!(n <= self.window);
        let over = (self.len + n).saturating_sub(self.window).min(self.len);
        self.off += over;
        self.len -= over;
        let cap = self.cap_rows();
        if self.off > 0 && self.off + self.len + n + self.block > cap {
            let (a, b) = (self.off * self.kvw, (self.off + self.len) * self.kvw);
            for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
                buf.copy_within(a..b, 0);
                buf.truncate(b - a);
            }
            self.off = 0;
        }
        let need = (self.off + self.len + n + self.block) * self.kvw;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            if buf.capacity() < need {
                let target = need.max((2 * buf.capacity()).min(cap * self.kvw));
                buf.reserve_exact(target - buf.len());
            }
        }
    }

    /// Test / debug export: `(first position, per layer K rows ‖ V rows)` of the live window.
    pub fn export(&self) -> (usize, Vec<f32>) {
        let (a, b) = (self.off * self.kvw, (self.off + self.len) * self.kvw);
        let mut out = Vec::new();
        for (k, v) in self.k.iter().zip(&self.v) {
            out.extend_from_slice(&k[a..b]);
            out.extend_from_slice(&v[a..b]);
        }
        (self.next_pos - self.len, out)
    }
}
