//! The DSpark drafter on the GPU (MODEL.md §4.5–§4.6): the same math as the host [`Drafter`] (the
//! oracle), with device weights and a device context window.
//!
//! - Weights: Q4_1 matrices re-tiled by `retile_q41` (`Gpu::mv_q41`), or by `retile_q41t` for the
//!   tensor-core kernel (`Gpu::mv_q41t`, sm_90+: the LM head by default, `Gpu::q41_tc_head`; every
//!   matrix opt-in, `BONSAI_CUDA_Q41_TC=1`), int8 activations either way; any other
//!   type is dequantized to an f32 plane at load (`Gpu::mv_f32`). The Markov tables stay in their
//!   file type (BF16 / F16 / F32 planes read by `dsp_markov_scores`).
//! - Context rows ([`CudaDrafter::stage`]): tap rows are uploaded (`[n, n_taps·E]` f32, ≤ 8 rows per
//!   pass), `c = RMSNorm(W_fc·f) ⊙ hidden_norm`, then per layer `K = RoPE(RMSNorm_hd(W_k·c) ⊙ k_norm)`
//!   and `V = W_v·c` written into a ring of `window` rows (f32) at absolute positions. Eviction is the
//!   host's: the newest `window` rows stay live. A stage of up to 8 rows (a round's accepted rows,
//!   a decode step's row) replays a captured graph per row count, like the draft.
//! - A draft ([`CudaDrafter::draft`]): block rows `E[token] + snr` (row 0 built on the host from the
//!   mapped embedding, the mask rows precomputed on the device), six layers with non-causal block
//!   attention over `[context ; block]`, the head, then the sequential Markov correction on the
//!   device: step k reads `prev` from device memory (`ids[k]`), scores
//!   `logits[k] + markov_b·markov_a[prev]` with the mask id at −inf, and `argmax_rows` (first maximum,
//!   like the host) writes `ids[k + 1]`. Only the drafted ids come back.
//!
//! Numerics differ from the host drafter in the usual ways: int8 activations for Q4_1 (the host
//! dequantizes Q4_1 rows and uses f32 activations), f32 norms (host f64), flash-style softmax
//! merging. So drafts equal the host's except at near-ties; speculation stays lossless either way.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bonsai_kernels_cpu::quant::dequantize_row;
use bonsai_kernels_cpu::QuantType;
use bonsai_kernels_cuda::{self as kc, DevBuf, DspPar, Gpu, MvSeg, PinnedBuf, PlaneKind, Ring};
use rayon::prelude::*;

use crate::backend::cuda::CudaBackend;
use crate::config::DrafterConfig;
use crate::drafter::{Drafter, HostMat};
use crate::error::{Error, Result};

fn be(e: kc::CudaError) -> Error {
    Error::Backend(format!("cuda drafter: {e}"))
}

/// A drafter matrix `[n_in, n_out]` on the device.
enum DMat {
    /// codes `[n_out, n_in/32, 16]` bytes, dm `[n_out, n_in/32]` u32 `(d, m)` f16 pairs.
    Q41 {
        codes: DevBuf,
        dm: DevBuf,
        n_in: usize,
        n_out: usize,
    },
    /// The records of `retile_q41t` (`Gpu::mv_q41t`).
    Q41t {
        rec: DevBuf,
        n_in: usize,
        n_out: usize,
    },
    /// f32 `[n_out, n_in]` (dequantized at load).
    F32 {
        w: DevBuf,
        n_in: usize,
        n_out: usize,
    },
}

impl DMat {
    /// `m` on the device: a Q4_1 matrix in the tensor-core layout where `Gpu::q41_tc` is on,
    /// else in the dp4a layout.
    fn load(gpu: &Gpu, m: &HostMat) -> Result<DMat> {
        Self::load_as(gpu, m, gpu.q41_tc())
    }

    /// [`DMat::load`] with the layout of a Q4_1 matrix chosen by `tc`.
    fn load_as(gpu: &Gpu, m: &HostMat, tc: bool) -> Result<DMat> {
        let (n_in, n_out) = (m.n_in, m.n_out);
        if m.qt == QuantType::Q4_1 && tc {
            let rec = kc::retile_q41t(m.data(), n_in, n_out);
            return Ok(DMat::Q41t {
                rec: gpu.upload(&rec).map_err(be)?,
                n_in,
                n_out,
            });
        }
        if m.qt == QuantType::Q4_1 {
            let r = kc::retile_q41(m.data(), n_in, n_out);
            return Ok(DMat::Q41 {
                codes: gpu.upload(&r.codes).map_err(be)?,
                dm: gpu.upload(&r.scales).map_err(be)?,
                n_in,
                n_out,
            });
        }
        let rb = m.qt.row_bytes(n_in).expect("validated at load");
        let raw = m.data();
        let mut f = vec![0f32; n_in * n_out]; // [n_out, n_in]
        f.par_chunks_mut(n_in.max(1))
            .enumerate()
            .for_each(|(o, row)| dequantize_row(m.qt, &raw[o * rb..(o + 1) * rb], row));
        Ok(DMat::F32 {
            w: gpu.upload(&f).map_err(be)?,
            n_in,
            n_out,
        })
    }

    fn n_in(&self) -> usize {
        match self {
            DMat::Q41 { n_in, .. } | DMat::Q41t { n_in, .. } | DMat::F32 { n_in, .. } => *n_in,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            DMat::Q41 { codes, dm, .. } => codes.bytes() + dm.bytes(),
            DMat::Q41t { rec, .. } => rec.bytes(),
            DMat::F32 { w, .. } => w.bytes(),
        }
    }
}

/// A Markov table `[V, rank]` on the device, in its file type when that is BF16 / F16 / F32.
struct Plane {
    buf: DevBuf,
    kind: PlaneKind,
}

impl Plane {
    fn load(gpu: &Gpu, m: &HostMat) -> Result<Plane> {
        let raw = m.data();
        let half = |b: &[u8]| -> Vec<u16> {
            b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let (buf, kind) = match m.qt {
            QuantType::BF16 => (gpu.upload(&half(raw)), PlaneKind::Bf16),
            QuantType::F16 => (gpu.upload(&half(raw)), PlaneKind::F16),
            qt => {
                let rb = qt.row_bytes(m.n_in).expect("validated at load");
                let mut f = vec![0f32; m.n_in * m.n_out]; // [n_out, n_in]
                f.par_chunks_mut(m.n_in.max(1))
                    .enumerate()
                    .for_each(|(o, row)| dequantize_row(qt, &raw[o * rb..(o + 1) * rb], row));
                (gpu.upload(&f), PlaneKind::F32)
            }
        };
        Ok(Plane {
            buf: buf.map_err(be)?,
            kind,
        })
    }
}

struct DevLayer {
    attn_norm: DevBuf, // [E] f32
    q: DMat,           // [E, nh·hd]
    k: DMat,           // [E, kvw]
    v: DMat,           // [E, kvw]
    q_norm: DevBuf,    // [hd]
    k_norm: DevBuf,    // [hd]
    out: DMat,         // [nh·hd, E]
    ffn_norm: DevBuf,  // [E]
    gate: DMat,        // [E, n_ff]
    up: DMat,          // [E, n_ff]
    down: DMat,        // [n_ff, E]
}

/// A drafter on the GPU (weights only; per-sequence state is [`CudaDraftState`]).
pub struct CudaDrafter {
    gpu: Arc<Gpu>,
    /// The host drafter: its mapped embedding builds block row 0, and it is the tests' oracle.
    host: Drafter,
    pub cfg: DrafterConfig,
    fc: DMat,              // [n_taps·E, E]
    hidden_norm: DevBuf,   // [E]
    output_norm: DevBuf,   // [E]
    output: DMat,          // [E, V]
    markov_a: Plane,       // [V, rank]
    markov_b: Plane,       // [V, rank]
    mask_rows: DevBuf,     // [bs − 1, E] f32: E[mask] + snr_mask
    layers: Vec<DevLayer>, // n_layer
    /// Drafts replay a captured graph per state (on unless `BONSAI_CUDA_DRAFT_GRAPH=0`;
    /// [`CudaDrafter::set_graph`]).
    graph: AtomicBool,
    /// The draft's fused launches (on unless `BONSAI_CUDA_DRAFT_FUSED=0`, read at load): q and k
    /// heads normed in one launch, and the block attention as [`Self::attn_kernel`] says. Off: two
    /// norm launches and a block per q head over chunks of up to 256 keys (the A/B baseline).
    /// [`CudaDrafter::set_fused`].
    fused: AtomicBool,
    /// The fused draft's block attention: a block per kv head for all its q heads
    /// ([`kc::DspAttnKernel::PerKvHead`], the default since 2026-12-04), or with
    /// `BONSAI_CUDA_DRAFT_ATTN=head` (read at load) a block per q head with the keys spread over up
    /// to [`kc::DSP_ATTN_SPREAD`] chunks. [`CudaDrafter::set_attn_per_kv_head`].
    attn_kv: AtomicBool,
    /// The Markov steps alternate the direction their blocks take the vocabulary in (on unless
    /// `BONSAI_CUDA_MARKOV_ALT=0`, read at load; [`CudaDrafter::set_markov_alt`]): step k + 1
    /// starts with the rows of `markov_b` (a 127 MB table on the 27B drafter, read once a step)
    /// that step k read last, which the L2 still holds. The same scores either way.
    markov_alt: AtomicBool,
    /// Stages of up to 8 rows replay a captured graph per row count while [`Self::graph`] is on
    /// (on unless `BONSAI_CUDA_STAGE_GRAPH=0`, read at load; [`CudaDrafter::set_stage_graph`]).
    stage_graph: AtomicBool,
}

/// Where a draft's inputs come from.
#[derive(Clone, Copy)]
enum DraftIn {
    /// Host copies of block row 0 and `id_last`, and `start` / the window as launch arguments.
    Eager { id_last: u32, start: usize },
    /// The state's pinned input (block row 0, [`DspPar`], `id_last`) copied in by the graph, and
    /// the position and window read from device memory by the kernels; the drafted ids are copied
    /// back to the state's pinned output.
    Graph,
}

/// Where a stage pass's inputs come from.
#[derive(Clone, Copy)]
enum StageIn {
    /// Taps already in `xf`; the position and the ring rows as launch arguments.
    Eager { pos: usize, ring: Ring },
    /// The state's pinned stage input ([`DspPar`] with `pos0` and `slot`, and the taps unless
    /// `src` is their device address) copied in by the pass, and the position and ring slot read
    /// from device memory by the kernels.
    Graph { src: u64 },
}

/// Where a stage's tap rows are (`[n, tap_width]` f32).
#[derive(Clone, Copy)]
enum TapSrc<'a> {
    Host(&'a [f32]),
    /// A device address.
    Dev(u64),
}

impl TapSrc<'_> {
    /// The rows from float `floats` on.
    fn skip(self, floats: usize) -> Self {
        match self {
            TapSrc::Host(t) => TapSrc::Host(&t[floats..]),
            TapSrc::Dev(p) => TapSrc::Dev(p + (floats * 4) as u64),
        }
    }
}

/// Rows per device pass (the mat-vec kernels take at most 8).
const ROWS: usize = kc::MAX_ROWS;

impl CudaDrafter {
    /// Put a loaded (and checked) host drafter on the GPU.
    pub fn new(gpu: Arc<Gpu>, host: Drafter) -> Result<CudaDrafter> {
        let cfg = host.cfg.clone();
        let (e, hd, bs) = (cfg.n_embd, cfg.head_dim, cfg.block_size);
        if bs > ROWS {
            return Err(Error::DrafterMismatch(format!(
                "the CUDA drafter takes a block of at most {ROWS} rows, found block_size {bs}"
            )));
        }
        if hd % 32 != 0 || hd > 256 || e % 32 != 0 || cfg.n_ff % 32 != 0 {
            return Err(Error::DrafterMismatch(format!(
                "the CUDA drafter needs head_dim a multiple of 32 up to 256 and n_embd, n_ff \
                 multiples of 32 (head_dim {hd}, n_embd {e}, n_ff {})",
                cfg.n_ff
            )));
        }
        if cfg.n_head_kv == 0 || cfg.n_head % cfg.n_head_kv != 0 {
            return Err(Error::DrafterMismatch(format!(
                "{} q heads are not a multiple of {} kv heads",
                cfg.n_head, cfg.n_head_kv
            )));
        }
        let g = &*gpu;
        let up = |v: &[f32]| g.upload(v).map_err(be);
        let mut layers = Vec::with_capacity(host.layers.len());
        for l in &host.layers {
            layers.push(DevLayer {
                attn_norm: up(&l.attn_norm)?,
                q: DMat::load(g, &l.q)?,
                k: DMat::load(g, &l.k)?,
                v: DMat::load(g, &l.v)?,
                q_norm: up(&l.q_norm)?,
                k_norm: up(&l.k_norm)?,
                out: DMat::load(g, &l.out)?,
                ffn_norm: up(&l.ffn_norm)?,
                gate: DMat::load(g, &l.gate)?,
                up: DMat::load(g, &l.up)?,
                down: DMat::load(g, &l.down)?,
            });
        }
        // the mask rows never change: E[mask] + snr_mask, computed exactly as the host does
        let mut mask_rows = Vec::with_capacity((bs - 1).max(1) * e); // [bs − 1, E]
        for k in 1..bs {
            mask_rows.extend(host.block_row(k, cfg.mask_token_id));
        }
        if mask_rows.is_empty() {
            mask_rows.resize(e, 0.0);
        }
        Ok(CudaDrafter {
            fc: DMat::load(g, &host.fc)?,
            hidden_norm: up(&host.hidden_norm)?,
            output_norm: up(&host.output_norm)?,
            // the head runs only in the 4-row draft block: the tensor cores there by default
            output: DMat::load_as(g, &host.output, g.q41_tc() || g.q41_tc_head())?,
            markov_a: Plane::load(g, &host.markov_a)?,
            markov_b: Plane::load(g, &host.markov_b)?,
            mask_rows: up(&mask_rows)?,
            layers,
            graph: AtomicBool::new(
                std::env::var("BONSAI_CUDA_DRAFT_GRAPH").map_or(true, |v| v != "0"),
            ),
            fused: AtomicBool::new(
                std::env::var("BONSAI_CUDA_DRAFT_FUSED").map_or(true, |v| v != "0"),
            ),
            attn_kv: AtomicBool::new(
                std::env::var("BONSAI_CUDA_DRAFT_ATTN").map_or(true, |v| v != "head"),
            ),
            markov_alt: AtomicBool::new(
                std::env::var("BONSAI_CUDA_MARKOV_ALT").map_or(true, |v| v != "0"),
            ),
            stage_graph: AtomicBool::new(
                std::env::var("BONSAI_CUDA_STAGE_GRAPH").map_or(true, |v| v != "0"),
            ),
            cfg,
            host,
            gpu,
        })
    }

    /// Whether drafts replay a captured graph (the default; `BONSAI_CUDA_DRAFT_GRAPH=0` turns it
    /// off). The drafts are the same bits either way (`tests/cuda_drafter.rs`
    /// `cuda_drafter_graph_equals_eager`).
    pub fn graph(&self) -> bool {
        self.graph.load(Ordering::Relaxed)
    }

    /// Turn the draft graph on or off (benchmarks compare both).
    pub fn set_graph(&self, on: bool) {
        self.graph.store(on, Ordering::Relaxed);
    }

    /// Whether drafts take the fused launches (the default; `BONSAI_CUDA_DRAFT_FUSED=0` at load or
    /// [`Self::set_fused`] turns them off). Drafts may differ from the unfused ones at near-ties
    /// (the attention's chunking changes the float order); speculation is lossless either way.
    pub fn fused(&self) -> bool {
        self.fused.load(Ordering::Relaxed)
    }

    /// Turn the fused draft launches on or off (benchmarks compare both; a state's captured draft
    /// is captured again).
    pub fn set_fused(&self, on: bool) {
        self.fused.store(on, Ordering::Relaxed);
    }

    /// Whether the fused draft's block attention takes a block per kv head
    /// ([`kc::DspAttnKernel::PerKvHead`], the default) rather than one per q head.
    pub fn attn_per_kv_head(&self) -> bool {
        self.attn_kv.load(Ordering::Relaxed)
    }

    /// Choose the fused draft's block attention kernel (benchmarks compare both; a state's
    /// captured draft is captured again). Drafts may differ at near-ties (another float order).
    pub fn set_attn_per_kv_head(&self, on: bool) {
        self.attn_kv.store(on, Ordering::Relaxed);
    }

    /// Whether the Markov steps alternate their vocabulary order (the default;
    /// `BONSAI_CUDA_MARKOV_ALT=0` at load or [`Self::set_markov_alt`] turns it off). The drafts are
    /// the same bits either way (`tests/cuda_drafter.rs` `cuda_drafter_graph_equals_eager`).
    pub fn markov_alt(&self) -> bool {
        self.markov_alt.load(Ordering::Relaxed)
    }

    /// Turn the Markov steps' alternating order on or off (benchmarks compare both; a state's
    /// captured draft is captured again).
    pub fn set_markov_alt(&self, on: bool) {
        self.markov_alt.store(on, Ordering::Relaxed);
    }

    /// Whether stages of up to 8 rows replay a captured graph (with [`Self::graph`] on; the
    /// default). The staged rows are the same bits either way (`tests/cuda_drafter.rs`
    /// `cuda_drafter_graph_equals_eager`).
    pub fn stage_graph(&self) -> bool {
        self.graph() && self.stage_graph.load(Ordering::Relaxed)
    }

    /// Turn the captured stage on or off (benchmarks compare both).
    pub fn set_stage_graph(&self, on: bool) {
        self.stage_graph.store(on, Ordering::Relaxed);
    }

    /// The block attention kernel a draft launches now.
    fn attn_kernel(&self) -> kc::DspAttnKernel {
        match (self.fused(), self.attn_per_kv_head()) {
            (false, _) => kc::DspAttnKernel::PerHead { spread: 1 },
            (true, false) => kc::DspAttnKernel::PerHead {
                spread: kc::DSP_ATTN_SPREAD,
            },
            (true, true) => kc::DspAttnKernel::PerKvHead,
        }
    }

    /// What a state's captured draft bakes in besides the state's own buffers: this drafter's
    /// weights and the launch mode.
    fn graph_key(&self) -> [u64; 3] {
        let w = match &self.output {
            DMat::Q41 { codes, .. } => codes.ptr(),
            DMat::Q41t { rec, .. } => rec.ptr(),
            DMat::F32 { w, .. } => w.ptr(),
        };
        [
            self.mask_rows.ptr(),
            w,
            self.gpu.pdl() as u64
                | (self.gpu.spec_pdl() as u64) << 2
                | (self.fused() as u64) << 3
                | (self.attn_per_kv_head() as u64) << 4
                | (self.gpu.mv_rows_first() as u64) << 5
                | (self.markov_alt() as u64) << 6,
        ]
    }

    /// The host drafter this one was built from (the oracle).
    pub fn host(&self) -> &Drafter {
        &self.host
    }

    /// Context rows kept: the trained positions minus one block (MODEL.md §4.10).
    pub fn window(&self) -> usize {
        self.host.window()
    }

    /// Width of one tap row: `n_taps · n_embd`.
    pub fn tap_width(&self) -> usize {
        self.host.tap_width()
    }

    /// True when `token_embd` has the target's bytes (the host copy reads the target's mapping).
    pub fn embd_shared(&self) -> bool {
        self.host.embd_shared
    }

    /// Device bytes of the weights.
    pub fn weight_bytes(&self) -> usize {
        let mats = self
            .layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.out, &l.gate, &l.up, &l.down]);
        mats.chain([&self.fc, &self.output])
            .map(DMat::bytes)
            .sum::<usize>()
            + self.markov_a.buf.bytes()
            + self.markov_b.buf.bytes()
    }

    /// A fresh per-sequence state (device context window and scratch).
    pub fn new_state(&self) -> Result<CudaDraftState> {
        let c = &self.cfg;
        let g = &*self.gpu;
        let (e, hd, nh, nkv) = (c.n_embd, c.head_dim, c.n_head, c.n_head_kv);
        let kvw = nkv * hd;
        let qw = nh * hd;
        let tw = self.tap_width();
        let kmax = tw.max(e).max(qw).max(c.n_ff);
        let window = self.window();
        let f = 4usize;
        let a = |bytes: usize| g.alloc(bytes).map_err(be);
        let mut k = Vec::with_capacity(c.n_layer);
        let mut v = Vec::with_capacity(c.n_layer);
        for _ in 0..c.n_layer {
            k.push(a(window * kvw * f)?);
            v.push(a(window * kvw * f)?);
        }
        Ok(CudaDraftState {
            k,
            v,
            kvw,
            cap: window,
            off: 0,
            len: 0,
            next_pos: 0,
            xf: a(ROWS * kmax * f)?,
            xq: a(ROWS * kmax)?,
            xd: a(ROWS * kmax / 32 * f)?,
            xs: a(ROWS * kmax / 32 * f)?,
            h: a(ROWS * e * f)?,
            x: a(ROWS * e * f)?,
            qf: a(ROWS * qw * f)?,
            kf: a(ROWS * kvw * f)?,
            vf: a(ROWS * kvw * f)?,
            qo: a(ROWS * qw * f)?,
            kb: a(ROWS * kvw * f)?,
            gt: a(ROWS * c.n_ff * f)?,
            up: a(ROWS * c.n_ff * f)?,
            logits: a(c.block_size * c.n_vocab * f)?,
            scores: a(c.n_vocab * f)?,
            ids: a((c.block_size + 1) * 4)?,
            part: a(kc::dsp_attn_part_floats(ROWS, nh, hd, window + ROWS) * f)?,
            gin: g
                .alloc_pinned(e * f + (DspPar::SLOTS + 1) * 4)
                .map_err(be)?,
            gpar: a(DspPar::SLOTS * 4)?,
            gout: g.alloc_pinned((c.block_size + 1) * 4).map_err(be)?,
            graph: None,
            sin: g
                .alloc_pinned(ROWS * tw * f + DspPar::SLOTS * 4)
                .map_err(be)?,
            spar: a(DspPar::SLOTS * 4)?,
            stage_graphs: (0..2 * (ROWS + 1)).map(|_| None).collect(),
            sin_busy: false,
        })
    }

    /// Projections of the current scratch input (`xf` / `xq` / `xd` / `xs`, width `n_in` of the
    /// matrices) into `(matrix, y [n, n_out])` pairs: one grouped Q4_1 launch when every matrix is
    /// Q4_1 in the same layout and of the same width (up to 3), else one launch each.
    fn mv(&self, st: &CudaDraftState, mats: &[(&DMat, u64)], n: usize, acc: bool) -> Result<()> {
        let g = &*self.gpu;
        let k = mats[0].0.n_in();
        let (xq, xd, xs) = (st.xq.ptr(), st.xd.ptr(), st.xs.ptr());
        let seg = |m: &DMat, y: u64| match m {
            DMat::Q41 {
                codes, dm, n_out, ..
            } => Some(MvSeg {
                codes: codes.ptr(),
                scales: dm.ptr(),
                y,
                n_out: *n_out,
            }),
            DMat::Q41t { rec, n_out, .. } => Some(MvSeg {
                codes: rec.ptr(),
                scales: 0,
                y,
                n_out: *n_out,
            }),
            DMat::F32 { .. } => None,
        };
        let tc = |m: &DMat| matches!(m, DMat::Q41t { .. });
        // the Q4_1 launch of `segs` in the layout of `m`
        let q41 = |m: &DMat, segs: &[MvSeg], k: usize| {
            if tc(m) {
                g.mv_q41t(segs, xq, xd, xs, k, n, acc)
            } else {
                g.mv_q41(segs, xq, xd, xs, k, n, acc)
            }
        };
        let grouped = mats.len() <= kc::Q41_MAX_SEGS
            && mats.iter().all(|(m, _)| {
                !matches!(m, DMat::F32 { .. }) && tc(m) == tc(mats[0].0) && m.n_in() == k
            });
        if grouped {
            let segs: Vec<MvSeg> = mats.iter().filter_map(|&(m, y)| seg(m, y)).collect();
            return q41(mats[0].0, &segs, k).map_err(be);
        }
        for &(m, y) in mats {
            match (m, seg(m, y)) {
                (_, Some(sg)) => q41(m, &[sg], m.n_in()),
                (DMat::F32 { w, n_in, n_out }, None) => {
                    g.mv_f32(w.ptr(), st.xf.ptr(), y, *n_in, *n_out, n, acc)
                }
                (_, None) => unreachable!("only f32 matrices have no segment"),
            }
            .map_err(be)?;
        }
        Ok(())
    }

    /// `rmsnorm(x[t]) ⊙ w` of `n` rows of width `k` into the scratch input (f32 and int8).
    fn norm_in(&self, st: &CudaDraftState, x: u64, w: &DevBuf, n: usize, k: usize) -> Result<()> {
        self.gpu
            .rmsnorm_quant(
                x,
                w.ptr(),
                self.cfg.rms_eps,
                n,
                k,
                st.xf.ptr(),
                st.xq.ptr(),
                st.xd.ptr(),
                st.xs.ptr(),
            )
            .map_err(be)
    }

    /// Stage `n` committed positions `pos0 .. pos0 + n` from their tap rows (taps: host
    /// `[n, tap_width]`). Positions must continue the staged ones (a fresh state accepts any start).
    /// Same contract and window as [`Drafter::stage`]. With [`Self::stage_graph`] on, up to 8 rows are
    /// one replay of the state's captured stage for that row count (the same launches, the
    /// position and ring slot read from device memory), queued without waiting for it; more rows
    /// go in eager passes of 8.
    pub fn stage(
        &self,
        st: &mut CudaDraftState,
        taps: &[f32],
        pos0: usize,
        n: usize,
    ) -> Result<()> {
        let tw = self.tap_width();
        if taps.len() != n * tw {
            return Err(Error::Backend(format!(
                "drafter stage: {} tap floats for {n} rows of {tw}",
                taps.len()
            )));
        }
        self.stage_from(st, TapSrc::Host(taps), pos0, n)
    }

    /// [`Self::stage`] from tap rows already on the device: `src` holds `[n, tap_width]` f32 (the
    /// target's verify taps, `CudaBackend::last_verify_taps`), `n ≤ 8`. The rows are copied on
    /// the device, so nothing goes through the host; the same operations as [`Self::stage`].
    pub fn stage_dev(
        &self,
        st: &mut CudaDraftState,
        src: u64,
        pos0: usize,
        n: usize,
    ) -> Result<()> {
        if n > ROWS || src == 0 {
            return Err(Error::Backend(format!(
                "drafter stage from device taps: {n} rows (at most {ROWS}) at address {src:#x}"
            )));
        }
        self.stage_from(st, TapSrc::Dev(src), pos0, n)
    }

    /// Stage the first `keep` rows of the last verify (starting at position `start`): from
    /// `host_taps` (the verify's host copy, `[rows, tap_width]`) when it holds them, else from
    /// where the verify left them on the device (`CudaBackend::last_verify_taps`). What the engine
    /// does after every round.
    pub fn stage_verified(
        &self,
        st: &mut CudaDraftState,
        cuda: Option<&CudaBackend>,
        host_taps: &[f32],
        start: usize,
        keep: usize,
    ) -> Result<()> {
        let tw = self.tap_width();
        if !host_taps.is_empty() {
            let Some(rows) = host_taps.get(..keep * tw) else {
                return Err(Error::Backend(format!(
                    "drafter stage: {keep} kept rows of {} verify tap floats",
                    host_taps.len()
                )));
            };
            return self.stage(st, rows, start, keep);
        }
        match cuda.and_then(|c| c.last_verify_taps()) {
            Some((src, rows, width)) if keep <= rows && width == tw => {
                self.stage_dev(st, src, start, keep)
            }
            Some((_, rows, width)) => Err(Error::Backend(format!(
                "drafter stage: {keep} kept rows of {tw} tap floats, the verify left {rows} rows \
                 of {width}"
            ))),
            None => Err(Error::Backend(format!(
                "drafter stage: the verify left no taps to stage {keep} rows of"
            ))),
        }
    }

    /// [`Self::stage_from_main`] in a detached scope of the GPU: the stage reads the target's taps
    /// (written before the round's rollback is forked) and the drafter's own buffers, never the
    /// GDN state a forked rollback replay writes, so it need not wait for that replay.
    fn stage_from(
        &self,
        st: &mut CudaDraftState,
        taps: TapSrc,
        pos0: usize,
        n: usize,
    ) -> Result<()> {
        self.gpu
            .detached(|| self.stage_from_main(st, taps, pos0, n))
    }

    fn stage_from_main(
        &self,
        st: &mut CudaDraftState,
        taps: TapSrc,
        pos0: usize,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if st.len > 0 && pos0 != st.next_pos {
            return Err(Error::Backend(format!(
                "drafter context is staged up to position {}, got rows from {pos0}",
                st.next_pos
            )));
        }
        let tw = self.tap_width();
        let g = &*self.gpu;
        // rows older than the window would be evicted right away: never compute them
        let skip = n.saturating_sub(st.cap);
        let (taps, pos0, n) = (taps.skip(skip * tw), pos0 + skip, n - skip);
        if self.stage_graph() && n <= ROWS {
            // one pass: the state's captured stage of n rows, [pos0, slot] (and host taps) through
            // pinned memory (a stage launched before may still be reading them: wait for it)
            if st.sin_busy {
                g.sync().map_err(be)?;
                st.sin_busy = false;
            }
            let ring;
            (st.off, st.len, ring) = ring_append(st.cap, st.off, st.len, n);
            let src = match taps {
                TapSrc::Host(t) => {
                    st.sin.write(0, t);
                    0
                }
                TapSrc::Dev(p) => p,
            };
            let mut par = [0i32; DspPar::SLOTS];
            par[DspPar::POS] = pos0 as i32;
            par[DspPar::SLOT] = ring.slot0 as i32;
            st.sin.write(ROWS * tw * 4, &par);
            let [k0, k1, k2] = self.graph_key();
            let key = [k0, k1, k2, src];
            // host-tap stages (a decode step's row) and device-tap ones (a round's kept rows)
            // keep a graph each, so an engine that mixes them captures neither again
            let slot = n + (src != 0) as usize * (ROWS + 1);
            if st.stage_graphs[slot].as_ref().map(|(k, _)| *k) != Some(key) {
                st.stage_graphs[slot] = None;
                g.sync().map_err(be)?;
                g.begin_capture().map_err(be)?;
                let queued = self.enqueue_stage(st, n, StageIn::Graph { src });
                // end the capture whatever happened, so the stream is usable again
                let graph = g.end_capture().map_err(be);
                queued?;
                st.stage_graphs[slot] = Some((key, graph?));
            }
            let (_, graph) = st.stage_graphs[slot].as_ref().expect("captured above");
            g.launch_graph(graph).map_err(be)?;
            st.sin_busy = true;
            st.next_pos = pos0 + n;
            return Ok(());
        }
        let mut t0 = 0;
        while t0 < n {
            let nr = (n - t0).min(ROWS);
            let ring;
            (st.off, st.len, ring) = ring_append(st.cap, st.off, st.len, nr);
            let pos = pos0 + t0;
            // taps [nr, tw] f32 → xf (quantized in place by the pass)
            match taps {
                TapSrc::Host(t) => g.htod(&st.xf, 0, &t[t0 * tw..(t0 + nr) * tw]),
                TapSrc::Dev(p) => g.dtod(st.xf.ptr(), p + (t0 * tw * 4) as u64, nr * tw * 4),
            }
            .map_err(be)?;
            self.enqueue_stage(st, nr, StageIn::Eager { pos, ring })?;
            st.next_pos = pos + nr;
            t0 += nr;
        }
        debug_assert!(st.len <= st.cap);
        Ok(())
    }

    /// Queue one stage pass of `nr ≤ 8` rows whose taps are in `xf` (`Eager`) or in the state's
    /// pinned stage input (`Graph`, copied in by the pass; the position and the ring slot then come
    /// from device memory): `c = RMSNorm(W_fc·f) ⊙ hidden_norm`, then per layer the context K
    /// (normed, roped) and V rows into the ring.
    fn enqueue_stage(&self, st: &CudaDraftState, nr: usize, inp: StageIn) -> Result<()> {
        let c = &self.cfg;
        let (e, hd, nkv) = (c.n_embd, c.head_dim, c.n_head_kv);
        let (kvw, tw) = (st.kvw, self.tap_width());
        let g = &*self.gpu;
        let (pos, ring, par) = match inp {
            StageIn::Eager { pos, ring } => (pos, ring, 0),
            StageIn::Graph { src } => {
                if src == 0 {
                    g.htod_pinned_async(st.xf.ptr(), &st.sin, 0, nr * tw * 4)
                } else {
                    g.dtod(st.xf.ptr(), src, nr * tw * 4)
                }
                .map_err(be)?;
                g.htod_pinned_async(st.spar.ptr(), &st.sin, ROWS * tw * 4, DspPar::SLOTS * 4)
                    .map_err(be)?;
                let ring = Ring {
                    cap: st.cap,
                    slot0: 0,
                };
                (0, ring, st.spar.ptr())
            }
        };
        // xf [nr, tw] quantized in place
        g.quant_rows(st.xf.ptr(), nr, tw, st.xq.ptr(), st.xd.ptr(), st.xs.ptr())
            .map_err(be)?;
        self.mv(st, &[(&self.fc, st.h.ptr())], nr, false)?; // h [nr, E]
        self.norm_in(st, st.h.ptr(), &self.hidden_norm, nr, e)?; // c
        for (il, l) in self.layers.iter().enumerate() {
            self.mv(st, &[(&l.k, st.kf.ptr()), (&l.v, st.vf.ptr())], nr, false)?;
            g.dsp_norm_rope(
                st.kf.ptr(),
                kvw,
                nkv,
                nr,
                l.k_norm.ptr(),
                c.rms_eps,
                hd,
                pos,
                c.rope_base,
                st.k[il].ptr(),
                kvw,
                ring,
                par,
            )
            .map_err(be)?;
            g.dsp_copy_rows(st.vf.ptr(), kvw, kvw, nr, st.v[il].ptr(), ring, par)
                .map_err(be)?;
        }
        Ok(())
    }

    /// Draft `block_size` tokens following `id_last` at position `start` (MODEL.md §4.5–§4.6).
    pub fn draft(&self, st: &mut CudaDraftState, id_last: u32, start: usize) -> Result<Vec<u32>> {
        self.run_draft(st, id_last, start, false)
            .map(|(ids, _)| ids)
    }

    /// [`CudaDrafter::draft`] that also returns the head logits before the Markov correction
    /// (`[block_size, V]`, debug / tests).
    pub fn draft_with_logits(
        &self,
        st: &mut CudaDraftState,
        id_last: u32,
        start: usize,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        self.run_draft(st, id_last, start, true)
            .map(|(ids, l)| (ids, l.expect("logits requested")))
    }

    /// [`Self::run_draft_main`] in a detached scope of the GPU (see [`Self::stage_from`]): the
    /// draft's synchronization drains the main stream only, not a forked rollback replay.
    fn run_draft(
        &self,
        st: &mut CudaDraftState,
        id_last: u32,
        start: usize,
        want_logits: bool,
    ) -> Result<(Vec<u32>, Option<Vec<f32>>)> {
        self.gpu
            .detached(|| self.run_draft_main(st, id_last, start, want_logits))
    }

    fn run_draft_main(
        &self,
        st: &mut CudaDraftState,
        id_last: u32,
        start: usize,
        want_logits: bool,
    ) -> Result<(Vec<u32>, Option<Vec<f32>>)> {
        if st.len > 0 && st.next_pos != start {
            return Err(Error::Backend(format!(
                "drafter context ends at {}, the block starts at {start}",
                st.next_pos
            )));
        }
        let c = &self.cfg;
        if id_last as usize >= c.n_vocab {
            return Err(Error::Backend(format!(
                "drafter: token {id_last} is outside the vocabulary ({})",
                c.n_vocab
            )));
        }
        if start > i32::MAX as usize - ROWS {
            return Err(Error::Backend(format!(
                "drafter: position {start} is past the kernels' i32 positions"
            )));
        }
        let (e, bs, nv) = (c.n_embd, c.block_size, c.n_vocab);
        let g = &*self.gpu;
        let mut ids = vec![0i32; bs + 1];
        if self.graph() && st.cap > 0 {
            // inputs: block row 0 = E[id_last] + snr_anchor, then [pos0, off, len] and id_last
            st.gin.write(0, &self.host.block_row(0, id_last));
            let mut par = [0i32; DspPar::SLOTS + 1];
            par[DspPar::POS] = start as i32;
            par[DspPar::OFF] = st.off as i32;
            par[DspPar::LEN] = st.len as i32;
            par[DspPar::SLOTS] = id_last as i32;
            st.gin.write(e * 4, &par);
            let key = self.graph_key();
            if st.graph.as_ref().map(|(k, _)| *k) != Some(key) {
                st.graph = None;
                g.sync().map_err(be)?;
                g.begin_capture().map_err(be)?;
                let queued = self.enqueue_draft(st, DraftIn::Graph);
                // end the capture whatever happened, so the stream is usable again
                let graph = g.end_capture().map_err(be);
                queued?;
                st.graph = Some((key, graph?));
            }
            let (_, graph) = st.graph.as_ref().expect("captured above");
            g.launch_graph(graph).map_err(be)?;
            g.sync().map_err(be)?;
            st.gout.read_i32s(0, &mut ids);
        } else {
            self.enqueue_draft(st, DraftIn::Eager { id_last, start })?;
            g.dtoh(&st.ids, 0, &mut ids).map_err(be)?;
        }
        // the stream is drained: no stage reads the stage input any more
        st.sin_busy = false;
        // A row with no finite score (non-finite drafter logits) has no argmax; the host drafter
        // then keeps its initial pick, id 0, and so does this one (the next Markov step clamps
        // the same way on the device). A draft is only a proposal: verification stays exact.
        let out: Vec<u32> = ids[1..]
            .iter()
            .map(|&i| {
                if (i as u32 as usize) < nv {
                    i as u32
                } else {
                    0
                }
            })
            .collect();
        let logits = if want_logits {
            let mut l = vec![0f32; bs * nv];
            g.dtoh(&st.logits, 0, &mut l).map_err(be)?;
            Some(l)
        } else {
            None
        };
        Ok((out, logits))
    }

    /// Queue one draft's device work (MODEL.md §4.5–§4.6): the block rows, six layers, the head and
    /// the sequential Markov correction into `st.ids[1..]`. `DraftIn::Graph` queues only
    /// capturable work (async copies from and to the state's pinned buffers).
    fn enqueue_draft(&self, st: &CudaDraftState, inp: DraftIn) -> Result<()> {
        let c = &self.cfg;
        let (e, bs, hd) = (c.n_embd, c.block_size, c.head_dim);
        let (nh, nkv, kvw, nv) = (c.n_head, c.n_head_kv, st.kvw, c.n_vocab);
        let (qw, eps) = (nh * hd, c.rms_eps);
        let fused = self.fused();
        let attn = self.attn_kernel();
        let g = &*self.gpu;
        // x [bs, E]: row 0 = E[id_last] + snr_anchor (host), rows 1.. = the precomputed mask rows;
        // ids[0] = id_last
        let (start, par) = match inp {
            DraftIn::Eager { id_last, start } => {
                g.htod(&st.x, 0, &self.host.block_row(0, id_last))
                    .map_err(be)?;
                g.htod(&st.ids, 0, &[id_last as i32]).map_err(be)?;
                (start, 0)
            }
            DraftIn::Graph => {
                g.htod_pinned_async(st.x.ptr(), &st.gin, 0, e * 4)
                    .map_err(be)?;
                g.htod_pinned_async(st.gpar.ptr(), &st.gin, e * 4, DspPar::SLOTS * 4)
                    .map_err(be)?;
                g.htod_pinned_async(st.ids.ptr(), &st.gin, e * 4 + DspPar::SLOTS * 4, 4)
                    .map_err(be)?;
                (0, st.gpar.ptr())
            }
        };
        if bs > 1 {
            g.dtod(st.x.at(e * 4), self.mask_rows.ptr(), (bs - 1) * e * 4)
                .map_err(be)?;
        }
        let x = st.x.ptr();
        let scale = 1.0 / (hd as f32).sqrt();
        for (il, l) in self.layers.iter().enumerate() {
            self.norm_in(st, x, &l.attn_norm, bs, e)?;
            self.mv(
                st,
                &[
                    (&l.q, st.qf.ptr()),
                    (&l.k, st.kf.ptr()),
                    (&l.v, st.vf.ptr()),
                ],
                bs,
                false,
            )?;
            // the q and k heads: one launch, or one each
            let qset = kc::NormRopeSet {
                src: st.qf.ptr(),
                src_stride: qw,
                heads: nh,
                w: l.q_norm.ptr(),
                dst: st.qo.ptr(),
                dst_stride: qw,
            };
            let kset = kc::NormRopeSet {
                src: st.kf.ptr(),
                src_stride: kvw,
                heads: nkv,
                w: l.k_norm.ptr(),
                dst: st.kb.ptr(),
                dst_stride: kvw,
            };
            let norm_rope = |a, b| {
                g.dsp_norm_rope_sets(a, b, bs, eps, hd, start, c.rope_base, Ring::PLAIN, par)
                    .map_err(be)
            };
            if fused {
                norm_rope(qset, kset)?;
            } else {
                let none = |s: kc::NormRopeSet| kc::NormRopeSet { heads: 0, ..s };
                norm_rope(qset, none(qset))?;
                norm_rope(kset, none(kset))?;
            }
            // attention f32 into xf and int8 into xq/xd/xs: the out-projection's input
            g.dsp_attention(
                st.qo.ptr(),
                st.k[il].ptr(),
                st.v[il].ptr(),
                st.cap,
                st.off,
                st.len,
                st.kb.ptr(),
                st.vf.ptr(),
                bs,
                nh,
                nkv,
                hd,
                scale,
                st.part.ptr(),
                st.xf.ptr(),
                st.xq.ptr(),
                st.xd.ptr(),
                st.xs.ptr(),
                par,
                attn,
            )
            .map_err(be)?;
            self.mv(st, &[(&l.out, x)], bs, true)?;
            self.norm_in(st, x, &l.ffn_norm, bs, e)?;
            self.mv(
                st,
                &[(&l.gate, st.gt.ptr()), (&l.up, st.up.ptr())],
                bs,
                false,
            )?;
            g.swiglu_quant(
                st.gt.ptr(),
                st.up.ptr(),
                bs,
                c.n_ff,
                st.xf.ptr(),
                st.xq.ptr(),
                st.xd.ptr(),
                st.xs.ptr(),
            )
            .map_err(be)?;
            self.mv(st, &[(&l.down, x)], bs, true)?;
        }
        self.norm_in(st, x, &self.output_norm, bs, e)?;
        self.mv(st, &[(&self.output, st.logits.ptr())], bs, false)?;
        // the sequential Markov correction: step k conditions on ids[k], the token just chosen
        let alt = self.markov_alt();
        for k in 0..bs {
            g.dsp_markov_scores(
                st.logits.at(k * nv * 4),
                self.markov_a.buf.ptr(),
                self.markov_a.kind,
                self.markov_b.buf.ptr(),
                self.markov_b.kind,
                c.markov_rank,
                nv,
                c.mask_token_id as usize,
                st.ids.at(k * 4),
                st.scores.ptr(),
                alt && k % 2 == 1,
            )
            .map_err(be)?;
            g.argmax_rows(st.scores.ptr(), 1, nv, st.ids.at((k + 1) * 4))
                .map_err(be)?;
        }
        if let DraftIn::Graph = inp {
            g.dtoh_pinned_async(&st.gout, 0, st.ids.ptr(), (bs + 1) * 4)
                .map_err(be)?;
        }
        Ok(())
    }

    /// The scores of the last draft's last Markov step (`[V]`; debug / tests).
    #[doc(hidden)]
    pub fn last_markov_scores(&self, st: &CudaDraftState) -> Result<Vec<f32>> {
        let mut v = vec![0f32; self.cfg.n_vocab];
        self.gpu.dtoh(&st.scores, 0, &mut v).map_err(be)?;
        Ok(v)
    }

    /// Test / debug export in [`crate::drafter::DraftState::export`]'s format: `(first position,
    /// per layer K rows ‖ V rows of the live window, oldest first)`.
    pub fn export(&self, st: &CudaDraftState) -> Result<(usize, Vec<f32>)> {
        let kvw = st.kvw;
        let mut out = Vec::with_capacity(2 * self.layers.len() * st.len * kvw);
        let mut buf = vec![0f32; st.cap * kvw];
        for il in 0..self.layers.len() {
            for b in [&st.k[il], &st.v[il]] {
                self.gpu.dtoh(b, 0, &mut buf).map_err(be)?;
                for i in 0..st.len {
                    let r = (st.off + i) % st.cap;
                    out.extend_from_slice(&buf[r * kvw..(r + 1) * kvw]);
                }
            }
        }
        Ok((st.next_pos - st.len, out))
    }
}

/// Append `nr ≤ cap` rows to a ring of `cap` rows holding `len` live rows from `off`: evict the
/// oldest rows the ring cannot hold after the append (the host window's eviction). Returns the new
/// `(off, len)` (the appended rows included) and where the rows go.
fn ring_append(cap: usize, off: usize, len: usize, nr: usize) -> (usize, usize, Ring) {
    debug_assert!(nr <= cap && len <= cap && off < cap.max(1));
    let over = (len + nr).saturating_sub(cap).min(len);
    let (off, len) = ((off + over) % cap, len - over);
    let ring = Ring {
        cap,
        slot0: (off + len) % cap,
    };
    (off, len + nr, ring)
}

/// The GPU drafter's per-sequence state: the context K/V window (per layer a ring of `cap =
/// window` rows, f32 `[cap, kvw]`; live rows are ring rows `off .. off + len` mod cap at positions
/// `next_pos − len .. next_pos`) and the scratch of one pass (≤ 8 rows).
pub struct CudaDraftState {
    k: Vec<DevBuf>,
    v: Vec<DevBuf>,
    kvw: usize,
    cap: usize,
    off: usize,
    len: usize,
    next_pos: usize,
    // projection input: xf f32 [8, kmax], xq i8 [8, kmax], xd f32 / xs i32 [8, kmax/32]
    xf: DevBuf,
    xq: DevBuf,
    xd: DevBuf,
    xs: DevBuf,
    h: DevBuf,      // fc output [8, E]
    x: DevBuf,      // block residual stream [8, E]
    qf: DevBuf,     // [8, nh·hd]
    kf: DevBuf,     // [8, kvw]
    vf: DevBuf,     // [8, kvw]
    qo: DevBuf,     // normed + roped queries [8, nh·hd]
    kb: DevBuf,     // normed + roped block keys [8, kvw]
    gt: DevBuf,     // [8, n_ff]
    up: DevBuf,     // [8, n_ff]
    logits: DevBuf, // [bs, V]
    scores: DevBuf, // [V]
    ids: DevBuf,    // [bs + 1] i32: id_last, then the drafts
    part: DevBuf,   // attention partials [8, nh, dsp_attn_max_chunks(window + 8), hd + 2]
    // the captured draft's input: pinned [block row 0 (E f32) ‖ DspPar (i32 × 3) ‖ id_last (i32)]
    gin: PinnedBuf,
    gpar: DevBuf,    // DspPar [3] i32 on the device, read by the graph's kernels
    gout: PinnedBuf, // [bs + 1] i32: the graph's copy of ids
    /// The captured draft (its key: [`CudaDrafter::graph_key`]); it bakes in this state's buffers.
    graph: Option<([u64; 3], kc::Graph)>,
    // the captured stage's input: pinned [taps (8 rows of tap_width f32) ‖ DspPar (i32 × 4)]
    sin: PinnedBuf,
    spar: DevBuf, // DspPar [4] i32 on the device, read by the stage graphs' kernels
    /// The captured stage of n rows from the pinned input at index n, from device taps at index
    /// n + ROWS + 1 (key: the draft's, then the device address of the taps, 0 for the pinned
    /// input).
    stage_graphs: Vec<Option<([u64; 4], kc::Graph)>>,
    /// A stage graph was launched since the last synchronization: it may still read `sin`.
    sin_busy: bool,
}

impl CudaDraftState {
    /// Forget the context (the device buffers are kept).
    pub fn reset(&mut self) {
        self.off = 0;
        self.len = 0;
        self.next_pos = 0;
    }

    /// Forget the staged positions at and after `pos` (the engine's prompt cache resumes a
    /// sequence at `pos`); the ring rows before it stay where they are. A `pos` at or before the
    /// oldest live row forgets everything, like [`CudaDraftState::reset`].
    pub fn truncate(&mut self, pos: usize) {
        match crate::drafter::cut_context(self.next_pos, self.len, pos) {
            None => {}
            Some(0) => self.reset(),
            Some(len) => (self.len, self.next_pos) = (len, pos),
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

    /// Whether a draft graph is captured for this state (it is after the first draft with
    /// [`CudaDrafter::graph`] on).
    pub fn graph_captured(&self) -> bool {
        self.graph.is_some()
    }

    /// How many row counts have a captured stage (each is captured at its first stage with
    /// [`CudaDrafter::graph`] on).
    pub fn stage_graphs_captured(&self) -> usize {
        self.stage_graphs.iter().filter(|g| g.is_some()).count()
    }

    /// Device bytes of the context window (K and V, all layers).
    pub fn window_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::ring_append;

    /// The ring keeps exactly the newest `cap` positions, each at the slot it was written to, for
    /// uneven appends (the host window keeps the same positions).
    #[test]
    fn ring_keeps_the_newest_window() {
        let cap = 37;
        let mut slots = vec![usize::MAX; cap]; // slot -> position written there
        let (mut off, mut len, mut next) = (0usize, 0usize, 0usize);
        for (i, nr) in [1usize, 5, 8, 13, 3, 8, 8, 1, 2, 4, 7, 8, 8, 8, 1]
            .iter()
            .cycle()
            .take(60)
            .enumerate()
        {
            let r;
            (off, len, r) = ring_append(cap, off, len, *nr);
            for t in 0..*nr {
                slots[(r.slot0 + t) % cap] = next + t;
            }
            next += nr;
            assert_eq!(len, next.min(cap), "append {i}");
            // logical row j is the position next − len + j
            for j in 0..len {
                assert_eq!(slots[(off + j) % cap], next - len + j, "append {i} row {j}");
            }
        }
    }
}
