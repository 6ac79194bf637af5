//! The backend contract: the model's fused, model-shaped ops (DESIGN.md §4), not a tensor algebra.
//!
//! The qwen35 forward (`model.rs`) is written once against this trait. Every method is required.
//! Buffers are opaque per backend; shapes come from [`TargetConfig`]. A step processes `n` rows at
//! consecutive positions: `n = 1` for decode, `n = 5` for a speculative verify, a chunk for prefill.
//! Per-sequence state (attention KV, GDN conv + recurrent state) lives in backend buffers with explicit
//! reset / copy (snapshot, restore) / truncate operations.
//!
//! Backends are listed in one place only: `AnyBackend`-style matches live in `engine.rs`.

pub mod cpu;
pub mod cuda;
pub mod cuda_drafter;
pub mod vulkan;

use std::ops::Range;
use std::sync::Arc;

use crate::config::TargetConfig;
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::model::{AttnWeights, GdnWeights, MlpWeights, SeqState, Weights};
use crate::sampling::LogitStats;

/// How the GDN recurrence runs over the rows of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnMode {
    /// One recurrent delta-rule step per row, in order. Decode and verify use this, so every row is
    /// computed exactly as a single-token step computes it (batch invariance).
    Recurrent,
    /// The chunked (WY / UT-transform) form of MODEL.md §3.3, chunk 64. Prefill only.
    Chunked,
}

/// Storage of the attention KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// IEEE half per value (the default; llama.cpp's default too).
    #[default]
    F16,
    /// ggml q8_0: 32 int8 codes + one f16 scale per block (≈ 8.5 bits per value, ~47% less memory).
    Q8_0,
}

impl KvType {
    pub fn parse(s: &str) -> Option<KvType> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Some(KvType::F16),
            "q8_0" | "q8" => Some(KvType::Q8_0),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }
}

/// One forward step: `n` rows at positions `pos .. pos + n`.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub pos: usize,
    pub n: usize,
    pub gdn_mode: GdnMode,
}

pub trait Backend: Send + Sync + Sized + 'static {
    /// A weight matrix `[n_in, n_out]`, packed however the backend likes.
    type Mat: Send + Sync;
    /// A small f32 weight vector (norms, gates, conv taps).
    type Vector: Send + Sync;
    /// Activation rows: `[n, width]` f32.
    type Act: Send;
    /// One attention layer's KV cache.
    type Kv: Send;
    /// One GDN layer's conv window and recurrent state.
    type Gdn: Send;

    fn name(&self) -> String;
    /// Rows at whose multiples (counted from position 0) a chunked prefill may be split into
    /// forwards of any lengths and still give every row the bits of one forward over them all;
    /// `None` (the default): only at the multiples of the prefill chunk. The prompt cache keeps a
    /// boundary at the last such multiple before a prompt's end where this divides the chunk
    /// ([`crate::engine::EngineOptions::prefill_chunk`]), so a chat's next turn prefills fewer rows.
    fn prefill_granule(&self) -> Option<usize> {
        None
    }

    // ---- loading -------------------------------------------------------------------------------
    /// Load the matrix `name` (ggml `[n_in, n_out]`), checking its shape.
    fn load_mat(&self, g: &Arc<Gguf>, name: &str, n_in: usize, n_out: usize) -> Result<Self::Mat>;
    /// Load matrices that take the same input (`(name, n_in, n_out)` each), in order. A backend
    /// may place them side by side so that one launch computes them all; by default, one
    /// [`Backend::load_mat`] each.
    fn load_mats(&self, g: &Arc<Gguf>, specs: &[(&str, usize, usize)]) -> Result<Vec<Self::Mat>> {
        specs
            .iter()
            .map(|&(name, n_in, n_out)| self.load_mat(g, name, n_in, n_out))
            .collect()
    }
    /// Load the f32 tensor `name` of `n` elements.
    fn load_vector(&self, g: &Arc<Gguf>, name: &str, n: usize) -> Result<Self::Vector>;

    // ---- buffers and per-sequence state ---------------------------------------------------------
    fn new_act(&self, n: usize, width: usize) -> Self::Act;
    fn new_kv(&self, cfg: &TargetConfig, n_ctx: usize) -> Result<Self::Kv>;
    fn new_gdn(&self, cfg: &TargetConfig) -> Result<Self::Gdn>;
    /// Zero the conv window and the recurrent state (sequence start).
    fn reset_gdn(&self, st: &mut Self::Gdn);
    /// `dst ← src` (snapshot / restore).
    fn copy_gdn(&self, src: &Self::Gdn, dst: &mut Self::Gdn);
    /// Forget KV rows at positions `>= len`.
    fn truncate_kv(&self, kv: &mut Self::Kv, len: usize);
    fn copy_kv(&self, src: &Self::Kv, dst: &mut Self::Kv);
    /// Test / debug export: the conv window then the recurrent state, host f32, in the backend's
    /// layout (equal states give equal vectors).
    fn gdn_to_host(&self, _st: &Self::Gdn) -> Result<Vec<f32>> {
        Err(Error::Unsupported(format!("{}: gdn_to_host", self.name())))
    }
    /// Test / debug export: `(len, K rows ‖ V rows)` as host f32.
    fn kv_to_host(&self, _kv: &Self::Kv) -> Result<(usize, Vec<f32>)> {
        Err(Error::Unsupported(format!("{}: kv_to_host", self.name())))
    }

    // ---- the model's fused ops --------------------------------------------------------------------
    /// `x[t] = token_embd[ids[t]]` (dequantized rows). x: `[n, n_embd]`.
    fn embed(&self, table: &Self::Mat, ids: &[u32], x: &mut Self::Act) -> Result<()>;
    /// `x += ssm_out(gated_norm(delta_rule(conv_silu(in_proj(rmsnorm(x) ⊙ attn_norm)))))`,
    /// advancing the layer's conv + recurrent state over the step's rows.
    fn gdn_block(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut Self::Gdn,
        x: &mut Self::Act,
        s: &Step,
    ) -> Result<()>;
    /// [`Backend::gdn_block`] in [`GdnMode::Recurrent`] that also writes each row's replay inputs
    /// (MODEL.md §4.9 option C) into the verify record `rec`, an activation buffer of at least `s.n`
    /// rows of [`gdn_rec_width`] (per row: the pre-conv `mixed` row, the L2-normed `k`, `v`, `g`,
    /// `β`). The outputs and the state are exactly those of `gdn_block`.
    fn gdn_block_rec(
        &self,
        _cfg: &TargetConfig,
        _w: &GdnWeights<Self>,
        _st: &mut Self::Gdn,
        _x: &mut Self::Act,
        _s: &Step,
        _rec: &mut Self::Act,
    ) -> Result<()> {
        Err(Error::Unsupported(format!(
            "{}: speculative verify (gdn_block_rec) is not implemented",
            self.name()
        )))
    }
    /// Advance `st` (conv window + recurrent state) over the first `n` rows of the verify record
    /// `rec`, with no outputs: the rollback of MODEL.md §4.9 option C. The result equals the state
    /// `gdn_block` left after those rows.
    fn gdn_replay(
        &self,
        _cfg: &TargetConfig,
        _st: &mut Self::Gdn,
        _rec: &Self::Act,
        _n: usize,
    ) -> Result<()> {
        Err(Error::Unsupported(format!(
            "{}: speculative rollback (gdn_replay) is not implemented",
            self.name()
        )))
    }
    /// Copy every GDN layer's state, `dst[i] ← src[i]` (the speculative round's snapshot and its
    /// restore before a re-forward). The default calls [`Backend::copy_gdn`] per layer; the CUDA
    /// backend may replay one captured graph of the same copies (by default; `BONSAI_CUDA_ROUND_GRAPH=0`: eager).
    fn copy_gdn_all(&self, src: &[Self::Gdn], dst: &mut [Self::Gdn]) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::Backend(format!(
                "copy_gdn_all: {} source layers, {} destination layers",
                src.len(),
                dst.len()
            )));
        }
        for (s, d) in src.iter().zip(dst.iter_mut()) {
            self.copy_gdn(s, d);
        }
        Ok(())
    }
    /// The speculative round's snapshot of every GDN layer, `snap[i] ← gdn[i]`, taken right
    /// before [`Backend::verify_forward`] and read only after it returns. The default copies now
    /// ([`Backend::copy_gdn_all`]). The CUDA backend leaves it to that verify: its fused GDN
    /// kernels write the state they read into `snap` (no separate copy of every layer).
    fn round_snapshot(&self, gdn: &[Self::Gdn], snap: &mut [Self::Gdn]) -> Result<()> {
        self.copy_gdn_all(gdn, snap)
    }
    /// The replay rollback of a speculative round (MODEL.md §4.9 option C) over every GDN layer:
    /// restore `gdn[i] ← snap[i]` for all layers, then [`Backend::gdn_replay`] the first `keep`
    /// rows of `recs[i]` into each. The default runs exactly that; the CUDA backend may replay one
    /// captured graph per `keep` of the same launches (by default; `BONSAI_CUDA_ROUND_GRAPH=0`: eager).
    fn rollback_gdn(
        &self,
        cfg: &TargetConfig,
        gdn: &mut [Self::Gdn],
        snap: &[Self::Gdn],
        recs: &[Self::Act],
        keep: usize,
    ) -> Result<()> {
        if recs.len() != gdn.len() {
            return Err(Error::Backend(format!(
                "rollback_gdn: {} records for {} GDN layers",
                recs.len(),
                gdn.len()
            )));
        }
        self.copy_gdn_all(snap, gdn)?;
        for (g, rec) in gdn.iter_mut().zip(recs) {
            self.gdn_replay(cfg, g, rec, keep)?;
        }
        Ok(())
    }
    /// The verify pass of a speculative round: the forward over `ids` at `st.pos ..` with the
    /// recurrent GDN form, one verify record per GDN layer into `recs`, the logits of every row
    /// into `logits` (`[n, n_vocab]`, resized) and, with `taps = Some((layers, out))`, the residual
    /// rows after those layers into `out` (`[n, layers.len() · n_embd]`, resized; the layout of
    /// [`crate::model::TapRequest`]). Advances the state by `n`.
    ///
    /// Returns per-row [`LogitStats`] when the backend computed them where the logits live (row
    /// `i` of the result belongs to logits row `i`; `None` for a row whose statistics are
    /// unusable), or an empty vector. The default runs [`crate::model::verify_forward_eager`]
    /// and computes none. An override must give the same logits, taps, records and state bit for
    /// bit (the CUDA backend replays a captured graph of the same launches by default;
    /// `BONSAI_CUDA_ROUND_GRAPH=0`: eager).
    ///
    /// With `rows_needed == false` a backend that returns usable statistics for every row
    /// (one per row, each `Some` with argmax below n_vocab and finite max and log-sum-exp: what
    /// [`crate::sampling::Sampler::sample_from_stats`] accepts) may leave `logits` empty instead
    /// of copying the rows (a greedy accept reads only the statistics); otherwise it fills all
    /// `n` rows. The default always fills them.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn verify_forward(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        ids: &[u32],
        recs: &mut [Self::Act],
        taps: Option<(&[usize], &mut Vec<f32>)>,
        logits: &mut Vec<f32>,
        rows_needed: bool,
    ) -> Result<Vec<Option<LogitStats>>> {
        let _ = rows_needed;
        crate::model::verify_forward_eager(self, cfg, w, st, ids, recs, taps, logits)?;
        Ok(Vec::new())
    }
    /// [`Backend::verify_forward`] for a sampler that reads each row's statistics and its `n_top`
    /// best entries ([`crate::sampling::RowNeed::Top`]). A backend that computes them where the
    /// logits live fills `tops` with one list per row (best first, value descending then the
    /// lower id, NaN as −inf; at least `min(n_top, n_vocab)` entries each) and usable statistics
    /// for every row, and may then leave `logits` empty; otherwise it leaves `tops` empty and
    /// fills the rows. Logits, taps, records and state are those of `verify_forward`. The default
    /// computes no entries and fills the rows.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn verify_forward_top(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        ids: &[u32],
        recs: &mut [Self::Act],
        taps: Option<(&[usize], &mut Vec<f32>)>,
        n_top: usize,
        logits: &mut Vec<f32>,
        tops: &mut Vec<Vec<(u32, f32)>>,
    ) -> Result<Vec<Option<LogitStats>>> {
        let _ = n_top;
        tops.clear();
        self.verify_forward(cfg, w, st, ids, recs, taps, logits, true)
    }
    /// `x += W_o(σ(gate) ⊙ attn(rope(qnorm(q)), rope(knorm(k)), v))`, appending K/V at the step's
    /// positions (causal within the step).
    fn attn_block(
        &self,
        cfg: &TargetConfig,
        w: &AttnWeights<Self>,
        kv: &mut Self::Kv,
        x: &mut Self::Act,
        s: &Step,
    ) -> Result<()>;
    /// `x += W_down(SiLU(W_gate u) ⊙ W_up u)` with `u = rmsnorm(x) ⊙ post_attention_norm`.
    fn mlp_block(&self, cfg: &TargetConfig, w: &MlpWeights<Self>, x: &mut Self::Act) -> Result<()>;
    /// Logits of `rows` of x: `W_out(rmsnorm(x) ⊙ output_norm)`. logits: `[rows.len(), n_vocab]` (host).
    fn head(
        &self,
        cfg: &TargetConfig,
        norm: &Self::Vector,
        out: &Self::Mat,
        x: &Self::Act,
        rows: Range<usize>,
        logits: &mut [f32],
    ) -> Result<()>;
    /// Copy row `row` of x to the host (`[width]`): drafter taps, probes, tests.
    fn read_row(&self, x: &Self::Act, row: usize, out: &mut [f32]);

    // ---- whole steps ------------------------------------------------------------------------------
    /// One plain decode step: feed token `id` at position `st.pos`, advance the state by one, and
    /// write that row's logits to the host (`logits`: `[n_vocab]`, resized). The result must equal
    /// [`crate::model::decode_step_eager`] (the plain forward over one row) bit for bit; a backend
    /// may run it differently (the CUDA backend replays a captured graph).
    fn decode_step(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        id: u32,
        logits: &mut Vec<f32>,
    ) -> Result<()>;

    /// [`Backend::decode_step`] that may also return the row's [`LogitStats`] when the backend
    /// computes them cheaply where the logits live (the CUDA graph does, so a greedy sampler
    /// need not scan the row on the host). With `row_needed == false` a backend that returns
    /// usable statistics (argmax below n_vocab, finite max and log-sum-exp) may leave `logits`
    /// empty instead of copying the row (a greedy pick reads only the statistics); whenever the
    /// statistics are missing or unusable the row is filled. The default computes none and always
    /// fills the row.
    fn decode_step_stats(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        id: u32,
        logits: &mut Vec<f32>,
        row_needed: bool,
    ) -> Result<Option<LogitStats>> {
        let _ = row_needed;
        self.decode_step(cfg, w, st, id, logits)?;
        Ok(None)
    }

    /// [`Backend::decode_step_stats`] for a sampler that reads the row's statistics and its `n`
    /// best entries ([`crate::sampling::RowNeed::Top`]). A backend that computes them where the
    /// logits live fills `top` (best first, value descending then the lower id, NaN as −inf; at
    /// least `min(n, n_vocab)` entries) with usable statistics, and may then leave `logits`
    /// empty; otherwise it leaves `top` empty and fills the row. The default computes no entries
    /// and fills the row.
    #[allow(clippy::too_many_arguments)]
    fn decode_step_top(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        id: u32,
        n: usize,
        logits: &mut Vec<f32>,
        top: &mut Vec<(u32, f32)>,
    ) -> Result<Option<LogitStats>> {
        let _ = n;
        top.clear();
        self.decode_step_stats(cfg, w, st, id, logits, true)
    }
}

/// Width of one verify-record row of a GDN layer: `mixed` (conv_dim) ‖ `k` (H_k·d_k) ‖ `v` (H_v·d_v)
/// ‖ `g` (H_v) ‖ `β` (H_v).
pub fn gdn_rec_width(cfg: &TargetConfig) -> usize {
    let qk = cfg.ssm_n_group * cfg.ssm_d_state;
    let conv_dim = 2 * qk + cfg.ssm_inner;
    conv_dim + qk + cfg.ssm_inner + 2 * cfg.ssm_dt_rank
}
