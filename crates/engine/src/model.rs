//! The qwen35 target: weights, per-sequence state, and THE forward, written once over [`Backend`].
//!
//! Storage conventions (MODEL.md §2.4) the backend relies on: every `*_norm.weight` except `ssm_norm`
//! is stored as `1 + w` and multiplied as is; `ssm_a = −exp(A_log)`; v-heads are in tiled order (GGUF
//! v-head `h` uses k-head `h mod H_k`); attention `attn_q` rows are per head `[q(hd) ‖ gate(hd)]`; GQA is
//! grouped (q head `h` uses kv head `h / (n_head / n_head_kv)`).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, GdnMode, Step};
use crate::config::TargetConfig;
use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// Weights of one Gated DeltaNet mixer.
pub struct GdnWeights<B: Backend> {
    pub attn_norm: B::Vector, // [n_embd]
    pub qkv: B::Mat,          // [n_embd, 2·H_k·d_k + H_v·d_v]  (q ‖ k ‖ v tiled)
    pub gate: B::Mat,         // [n_embd, H_v·d_v]             (z, tiled)
    pub beta: B::Mat,         // [n_embd, H_v]
    pub alpha: B::Mat,        // [n_embd, H_v]
    pub conv1d: B::Vector,    // [conv_dim, conv_kernel]   (per-channel taps, last = current)
    pub dt_bias: B::Vector,   // [H_v]
    pub ssm_a: B::Vector,     // [H_v] = −exp(A_log)
    pub ssm_norm: B::Vector,  // [d_v] raw w (not 1+w), shared by all heads
    pub ssm_out: B::Mat,      // [H_v·d_v, n_embd]
}

/// Weights of one gated full-attention mixer.
pub struct AttnWeights<B: Backend> {
    pub attn_norm: B::Vector, // [n_embd]
    pub q: B::Mat,            // [n_embd, n_head·2·hd]  per head q ‖ gate
    pub k: B::Mat,            // [n_embd, n_kv·hd]
    pub v: B::Mat,            // [n_embd, n_kv·hd]
    pub q_norm: B::Vector,    // [hd]
    pub k_norm: B::Vector,    // [hd]
    pub out: B::Mat,          // [n_head·hd, n_embd]
}

pub struct MlpWeights<B: Backend> {
    pub post_norm: B::Vector, // [n_embd]
    pub gate: B::Mat,         // [n_embd, n_ff]
    pub up: B::Mat,           // [n_embd, n_ff]
    pub down: B::Mat,         // [n_ff, n_embd]
}

pub enum Mixer<B: Backend> {
    Gdn(GdnWeights<B>),
    Attn(AttnWeights<B>),
}

pub struct Layer<B: Backend> {
    pub mixer: Mixer<B>,
    pub mlp: MlpWeights<B>,
}

/// Ids of loaded weight sets ([`Weights::id`]); never reused in a process.
static NEXT_WEIGHTS_ID: AtomicU64 = AtomicU64::new(1);

pub struct Weights<B: Backend> {
    /// Unique in the process for every [`Weights::load`] (never reused, unlike the addresses of
    /// freed device buffers): what captured graphs key on for the weight buffers they bake in.
    pub id: u64,
    pub tok_embd: B::Mat,       // [n_embd, n_vocab]
    pub output_norm: B::Vector, // [n_embd]
    /// `None` when the file has no `output.weight`: the head is tied to `tok_embd`.
    pub output: Option<B::Mat>, // [n_embd, n_vocab]
    pub layers: Vec<Layer<B>>,
}

impl<B: Backend> Weights<B> {
    pub fn load(b: &B, g: &Arc<Gguf>, cfg: &TargetConfig) -> Result<Weights<B>> {
        if cfg.fused_attn_qkv {
            return Err(Error::Unsupported(
                "attention layers with a fused attn_qkv tensor are not supported yet (the Bonsai files \
                 use separate attn_q/attn_k/attn_v)"
                    .into(),
            ));
        }
        let e = cfg.n_embd;
        let hk = cfg.ssm_n_group * cfg.ssm_d_state;
        let inner = cfg.ssm_inner;
        let conv_dim = 2 * hk + inner;
        let hd = cfg.head_dim;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            // the matrices that read the same normed row are loaded together (`load_mats`)
            let mixer = if cfg.is_attn_layer(il) {
                let [q, k, v]: [B::Mat; 3] = b
                    .load_mats(
                        g,
                        &[
                            (&n("attn_q.weight"), e, cfg.n_head * 2 * hd),
                            (&n("attn_k.weight"), e, cfg.n_head_kv * hd),
                            (&n("attn_v.weight"), e, cfg.n_head_kv * hd),
                        ],
                    )?
                    .try_into()
                    .map_err(|_| Error::Backend("load_mats: not one matrix per spec".into()))?;
                Mixer::Attn(AttnWeights {
                    attn_norm: b.load_vector(g, &n("attn_norm.weight"), e)?,
                    q,
                    k,
                    v,
                    q_norm: b.load_vector(g, &n("attn_q_norm.weight"), hd)?,
                    k_norm: b.load_vector(g, &n("attn_k_norm.weight"), hd)?,
                    out: b.load_mat(g, &n("attn_output.weight"), cfg.n_head * hd, e)?,
                })
            } else {
                let [qkv, gate, beta, alpha]: [B::Mat; 4] = b
                    .load_mats(
                        g,
                        &[
                            (&n("attn_qkv.weight"), e, conv_dim),
                            (&n("attn_gate.weight"), e, inner),
                            (&n("ssm_beta.weight"), e, cfg.ssm_dt_rank),
                            (&n("ssm_alpha.weight"), e, cfg.ssm_dt_rank),
                        ],
                    )?
                    .try_into()
                    .map_err(|_| Error::Backend("load_mats: not one matrix per spec".into()))?;
                Mixer::Gdn(GdnWeights {
                    attn_norm: b.load_vector(g, &n("attn_norm.weight"), e)?,
                    qkv,
                    gate,
                    beta,
                    alpha,
                    conv1d: b.load_vector(
                        g,
                        &n("ssm_conv1d.weight"),
                        conv_dim * cfg.ssm_conv_kernel,
                    )?,
                    dt_bias: b.load_vector(g, &n("ssm_dt.bias"), cfg.ssm_dt_rank)?,
                    ssm_a: b.load_vector(g, &n("ssm_a"), cfg.ssm_dt_rank)?,
                    ssm_norm: b.load_vector(g, &n("ssm_norm.weight"), cfg.ssm_d_state)?,
                    ssm_out: b.load_mat(g, &n("ssm_out.weight"), inner, e)?,
                })
            };
            let [gate, up]: [B::Mat; 2] = b
                .load_mats(
                    g,
                    &[
                        (&n("ffn_gate.weight"), e, cfg.n_ff),
                        (&n("ffn_up.weight"), e, cfg.n_ff),
                    ],
                )?
                .try_into()
                .map_err(|_| Error::Backend("load_mats: not one matrix per spec".into()))?;
            let mlp = MlpWeights {
                post_norm: b.load_vector(g, &n("post_attention_norm.weight"), e)?,
                gate,
                up,
                down: b.load_mat(g, &n("ffn_down.weight"), cfg.n_ff, e)?,
            };
            layers.push(Layer { mixer, mlp });
        }
        Ok(Weights {
            id: NEXT_WEIGHTS_ID.fetch_add(1, Ordering::Relaxed),
            tok_embd: b.load_mat(g, "token_embd.weight", e, cfg.n_vocab)?,
            output_norm: b.load_vector(g, "output_norm.weight", e)?,
            output: if cfg.has_output {
                Some(b.load_mat(g, "output.weight", e, cfg.n_vocab)?)
            } else {
                None
            },
            layers,
        })
    }

    pub fn head_mat(&self) -> &B::Mat {
        self.output.as_ref().unwrap_or(&self.tok_embd)
    }
}

/// Per-sequence state: a value with explicit snapshot / restore / truncate.
pub struct SeqState<B: Backend> {
    /// Number of committed positions.
    pub pos: usize,
    pub n_ctx: usize,
    /// One per attention layer, in layer order.
    pub kv: Vec<B::Kv>,
    /// One per GDN layer, in layer order.
    pub gdn: Vec<B::Gdn>,
}

impl<B: Backend> SeqState<B> {
    pub fn new(b: &B, cfg: &TargetConfig, n_ctx: usize) -> Result<SeqState<B>> {
        let n_attn = (0..cfg.n_layer).filter(|&il| cfg.is_attn_layer(il)).count();
        let n_gdn = cfg.n_layer - n_attn;
        Ok(SeqState {
            pos: 0,
            n_ctx,
            kv: (0..n_attn)
                .map(|_| b.new_kv(cfg, n_ctx))
                .collect::<Result<_>>()?,
            gdn: (0..n_gdn).map(|_| b.new_gdn(cfg)).collect::<Result<_>>()?,
        })
    }

    /// Back to an empty sequence.
    pub fn reset(&mut self, b: &B) {
        self.pos = 0;
        for kv in &mut self.kv {
            b.truncate_kv(kv, 0);
        }
        for g in &mut self.gdn {
            b.reset_gdn(g);
        }
    }

    /// `self ← other` (same shapes).
    pub fn copy_from(&mut self, b: &B, other: &SeqState<B>) {
        self.pos = other.pos;
        for (d, s) in self.kv.iter_mut().zip(&other.kv) {
            b.copy_kv(s, d);
        }
        for (d, s) in self.gdn.iter_mut().zip(&other.gdn) {
            b.copy_gdn(s, d);
        }
    }
}

/// Which rows of a step produce logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    /// Only the last row (prefill).
    Last,
    /// Every row (verify, oracle dumps).
    All,
}

/// Rows of the target residual stream to copy out after selected layers (DSpark taps, MODEL.md §4.4).
pub struct TapRequest<'a> {
    /// Target layers (0-based) whose output is tapped, in tap order.
    pub layers: &'a [usize],
    /// Rows of the step to tap.
    pub rows: Range<usize>,
    /// Destination `[rows.len(), layers.len() · n_embd]` host f32 (resized): row `r` is
    /// `[h_{layers[0]}(r) ‖ h_{layers[1]}(r) ‖ …]`.
    pub out: &'a mut Vec<f32>,
}

/// Optional side outputs of one forward step (speculative decoding).
pub struct Capture<'a, B: Backend> {
    pub taps: Option<TapRequest<'a>>,
    /// One verify record per GDN layer, in layer order ([`GdnMode::Recurrent`] only); each is an
    /// activation buffer of at least `n` rows of [`crate::backend::gdn_rec_width`].
    pub gdn_rec: Option<&'a mut [B::Act]>,
}

impl<B: Backend> Capture<'_, B> {
    /// No side outputs (plain prefill and decode).
    pub fn none() -> Self {
        Capture {
            taps: None,
            gdn_rec: None,
        }
    }
}

/// Run the target over `ids` at positions `st.pos ..`, advancing the state. Writes logits of the
/// requested rows into `logits` (`[rows, n_vocab]`, resized) and the side outputs `cap` asks for.
/// Returns the number of logit rows.
#[allow(clippy::too_many_arguments)]
pub fn forward<B: Backend>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    st: &mut SeqState<B>,
    ids: &[u32],
    gdn_mode: GdnMode,
    rows: LogitRows,
    logits: &mut Vec<f32>,
    cap: Capture<'_, B>,
) -> Result<usize> {
    let Capture {
        mut taps,
        mut gdn_rec,
    } = cap;
    let n = ids.len();
    if n == 0 {
        return Err(Error::InvalidRequest("forward over zero tokens".into()));
    }
    if st.pos + n > st.n_ctx {
        return Err(Error::ContextOverflow(format!(
            "{} positions requested, context is {}",
            st.pos + n,
            st.n_ctx
        )));
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cfg.n_vocab) {
        return Err(Error::InvalidRequest(format!(
            "token id {bad} out of range (n_vocab {})",
            cfg.n_vocab
        )));
    }
    let s = Step {
        pos: st.pos,
        n,
        gdn_mode,
    };
    if let Some(t) = taps.as_mut() {
        if t.rows.end > n {
            return Err(Error::InvalidRequest(format!(
                "tap rows {:?} outside the step's {n} rows",
                t.rows
            )));
        }
        t.out
            .resize(t.rows.len() * t.layers.len() * cfg.n_embd, 0.0);
    }
    if gdn_rec.is_some() && gdn_mode != GdnMode::Recurrent {
        return Err(Error::InvalidRequest(
            "GDN verify records need GdnMode::Recurrent".into(),
        ));
    }

    // 1. embed: x [n, n_embd] f32 (the residual stream)
    let mut x = b.new_act(n, cfg.n_embd);
    b.embed(&w.tok_embd, ids, &mut x)?;

    // 2. 64 layers: token mixer (GDN or gated attention), then the SwiGLU MLP, each with its residual.
    //    Taps copy x at the end of the selected layers.
    let (mut i_attn, mut i_gdn) = (0, 0);
    for (il, layer) in w.layers.iter().enumerate() {
        match &layer.mixer {
            Mixer::Gdn(gw) => {
                match gdn_rec.as_deref_mut() {
                    Some(recs) => {
                        b.gdn_block_rec(cfg, gw, &mut st.gdn[i_gdn], &mut x, &s, &mut recs[i_gdn])?
                    }
                    None => b.gdn_block(cfg, gw, &mut st.gdn[i_gdn], &mut x, &s)?,
                }
                i_gdn += 1;
            }
            Mixer::Attn(aw) => {
                b.attn_block(cfg, aw, &mut st.kv[i_attn], &mut x, &s)?;
                i_attn += 1;
            }
        }
        b.mlp_block(cfg, &layer.mlp, &mut x)?;
        if let Some(t) = taps.as_mut() {
            let e = cfg.n_embd;
            let width = t.layers.len() * e;
            for (j, _) in t.layers.iter().enumerate().filter(|(_, &l)| l == il) {
                for (i, r) in t.rows.clone().enumerate() {
                    b.read_row(
                        &x,
                        r,
                        &mut t.out[i * width + j * e..i * width + (j + 1) * e],
                    );
                }
            }
        }
    }
    st.pos += n;

    // 3. head: logits [rows, n_vocab] for the rows that need them.
    let range = match rows {
        LogitRows::None => return Ok(0),
        LogitRows::Last => n - 1..n,
        LogitRows::All => 0..n,
    };
    logits.resize(range.len() * cfg.n_vocab, 0.0);
    b.head(cfg, &w.output_norm, w.head_mat(), &x, range.clone(), logits)?;
    Ok(range.len())
}

/// One plain decode step through [`forward`]: token `id` at `st.pos` with the recurrent GDN form, no
/// side outputs, logits of the row into `logits` (`[n_vocab]`). The reference for
/// [`Backend::decode_step`].
pub fn decode_step_eager<B: Backend>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    st: &mut SeqState<B>,
    id: u32,
    logits: &mut Vec<f32>,
) -> Result<()> {
    forward(
        b,
        cfg,
        w,
        st,
        &[id],
        GdnMode::Recurrent,
        LogitRows::Last,
        logits,
        Capture::none(),
    )
    .map(|_| ())
}

/// The verify pass of a speculative round through [`forward`]: `ids` at `st.pos ..` with the
/// recurrent GDN form, verify records into `recs`, logits of every row, taps of every row after
/// `taps.0` into `taps.1`. The reference (and the default) for [`Backend::verify_forward`].
#[allow(clippy::too_many_arguments)]
pub fn verify_forward_eager<B: Backend>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    st: &mut SeqState<B>,
    ids: &[u32],
    recs: &mut [B::Act],
    taps: Option<(&[usize], &mut Vec<f32>)>,
    logits: &mut Vec<f32>,
) -> Result<()> {
    let n = ids.len();
    let taps = taps.map(|(layers, out)| TapRequest {
        layers,
        rows: 0..n,
        out,
    });
    forward(
        b,
        cfg,
        w,
        st,
        ids,
        GdnMode::Recurrent,
        LogitRows::All,
        logits,
        Capture {
            taps,
            gdn_rec: Some(recs),
        },
    )
    .map(|_| ())
}
