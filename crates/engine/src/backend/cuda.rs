//! The CUDA backend: weights re-tiled at load into code + scale planes (see
//! `bonsai_kernels_cuda::retile`), f32 residual stream and GDN state, f16 KV cache, int8
//! activations for the low-bit mat-vecs (per-32 blocks, f32 scales), every op a kernel from
//! `bonsai_kernels_cuda`. Steps of at most 8 rows (decode, speculative verify) run the projections
//! as mat-vec launches in which each row is computed exactly as in a 1-row launch (batch
//! invariance), so verify equals decode bit for bit. Longer steps (prefill chunks) run each
//! projection as one int8 tensor-core GEMM launch over all rows: deterministic, equal to the
//! mat-vec path within f32 rounding, not bit for bit. The head always uses the mat-vec path.
//! Prefill steps also use the prefill kernels of `kernels/prefill.cu`: the GDN conv parallel over
//! rows (bit-equal to the decode conv), the GDN recurrence without per-row block barriers, and one
//! causal flash-attention launch (both equal within f32 rounding). Every one of them computes a
//! row the same way wherever it sits in the step, so a prompt split into steps gives the same bits.
//!
//! Decode can also run as one captured CUDA graph per token ([`CudaBackend::capture_decode`]):
//! the token id and position live in device memory, and the graph ends with the head, a device
//! argmax that feeds the next step's embedding, and a position increment.
//! The engine's plain decode step ([`Backend::decode_step`]) replays a similar graph that ends with
//! the row's statistics (argmax, max, log-sum-exp) and the logits row copied to pinned host memory
//! instead. A second variant without the row copy serves [`Backend::decode_step_stats`] when the
//! sampler reads only the statistics (greedy), and a third serves [`Backend::decode_step_top`]:
//! it ends with `topk_rows` and copies back the row's 64 best entries, from which the host
//! sampler draws a top-k token (top-k ≤ 64, no bias or penalties) without the 1 MB row. When the
//! statistics turn out unusable the row is copied from the device logits afterwards.
//!
//! Speculative rounds (MODEL.md §4.9 option C): [`Backend::gdn_block_rec`] adds one copy kernel
//! per GDN layer that writes each verify row's replay inputs (pre-conv `mixed` ‖ L2-normed `k` ‖
//! `v` ‖ log-decay `g` ‖ `β`) from the conv kernel's outputs; [`Backend::gdn_replay`] advances the
//! conv window and the recurrent state over the accepted rows with a kernel that repeats
//! `gdn_step`'s arithmetic without the output. The round's snapshot is a side output of the
//! verify's fused GDN kernels ([`Backend::round_snapshot`]), and the replay reads it and writes
//! the state's own buffers, so their addresses (baked into the decode graph) never change
//! (`BONSAI_CUDA_SNAP_FUSED=0`: snapshot and restore copies instead).
//!
//! By default (`BONSAI_CUDA_ROUND_GRAPH=0` or [`CudaBackend::set_round_graph`] turns it off) the
//! round's device work replays captured graphs (`RoundGraphs`): the verify forward per row
//! count (records, taps and logits into fixed buffers, one async copy each to pinned memory, row
//! statistics for a greedy pick; without the logits copy when the sampler needs no rows), the
//! snapshot / restore copies where they are used, and the replay rollback per accept count.
//! `tests/cuda_round_graph.rs` checks them against the eager round bit for bit.
//!
//! That is `Backend::verify_forward`, `round_snapshot`, `copy_gdn_all` and `rollback_gdn`.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use bonsai_kernels_cpu::QuantType;
use bonsai_kernels_cuda::{self as kc, DevBuf, Gpu, WKind};

use super::{gdn_rec_width, Backend, GdnMode, Step};
use crate::config::TargetConfig;
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::model::{AttnWeights, GdnWeights, Mixer, MlpWeights, SeqState, Weights};
use crate::sampling::LogitStats;

fn be(e: kc::CudaError) -> Error {
    Error::Backend(format!("cuda: {e}"))
}

/// A weight matrix `[n_in, n_out]` on the device.
pub struct CudaMat {
    pub kind: WKind,
    pub n_in: usize,
    pub n_out: usize,
    /// codes: [n_out, nblk, CB] (low-bit) or f32 [n_out, n_in] (WKind::F32); `None` for a
    /// projection held only in its b1-plane layout ([`CudaBackend::load_mats`])
    codes: Option<DevBuf>,
    /// scales: [n_out, nblk] f16 (low-bit with codes only)
    scales: Option<DevBuf>,
    /// The b1-plane layout of a Q1_0 or Q2_0 (g128 / PQ2_0) projection whose input is an RMS
    /// norm ([`b1p_consumer`]), for decode and verify rows, and for the prefill GEMM where it
    /// reads that layout ([`kc::Gpu::gemm_reads_b1p`]); then the dp4a layout above is not kept.
    b1p: Option<B1pLayout>,
}

/// A matrix in the b1-plane layout (`kc::retile_b1p`).
struct B1pLayout {
    codes: DevBuf,
    scales: DevBuf,
    /// Code bit planes: 1 for Q1_0, 2 for Q2_0.
    planes: usize,
}

impl CudaMat {
    /// The code planes of the b1-plane layout, if it has one.
    fn b1p_planes(&self) -> Option<usize> {
        self.b1p.as_ref().map(|l| l.planes)
    }

    /// Device pointers of the dp4a layout `(codes, scales)` of a low-bit matrix, or of the f32
    /// data `(data, 0)`; an error for a projection held only in its b1-plane layout (a path that
    /// needs the other layout was reached: the b1-plane kernels switched off after load, or a
    /// prefill GEMM that reads only the dp4a layout).
    fn dp4a(&self) -> Result<(u64, u64)> {
        match &self.codes {
            Some(c) => Ok((c.ptr(), self.scales.as_ref().map_or(0, |s| s.ptr()))),
            None => Err(Error::Backend(format!(
                "cuda: a [{} x {}] projection is held only in its b1-plane layout, and this path \
                 needs the dp4a one (set BONSAI_CUDA_B1P_DP4A=1 at load to keep both)",
                self.n_out, self.n_in
            ))),
        }
    }
}

/// Whether the tensor `name` is a projection of an RMS-normed row (GDN and attention
/// in-projections, ffn gate and up, the output head): the norm writes b1-plane activations for
/// them. Other projections read int8 activations from producers that write no planes.
fn b1p_consumer(name: &str) -> bool {
    name == "output.weight"
        || [
            ".attn_q.weight",
            ".attn_k.weight",
            ".attn_v.weight",
            ".attn_qkv.weight",
            ".attn_gate.weight",
            ".ssm_beta.weight",
            ".ssm_alpha.weight",
            ".ffn_gate.weight",
            ".ffn_up.weight",
        ]
        .iter()
        .any(|s| name.ends_with(s))
}

/// Whether the tensor `name` is an out-projection whose producer can write b1-plane
/// activations ([`kc::Gpu::b1p_out`]): ffn_down (the SwiGLU) and ssm_out (the gated norm fused
/// into the GDN step). Their b1-plane layouts are uploaded only when `b1p_out` is on at load
/// (about 1 GB more for the 27B model); switched on later, they keep the int8 path.
fn b1p_out_consumer(name: &str) -> bool {
    name.ends_with(".ffn_down.weight") || name.ends_with(".ssm_out.weight")
}

/// An f32 vector on the device.
pub struct CudaVec {
    pub n: usize,
    buf: DevBuf,
}

/// Activation rows `[n, width]` f32 on the device.
pub struct CudaAct {
    pub n: usize,
    pub width: usize,
    buf: DevBuf,
}

/// One attention layer's cache: K and V `[n_ctx, n_kv·hd]` f16.
pub struct CudaKv {
    width: usize,
    n_ctx: usize,
    len: usize,
    k: DevBuf,
    v: DevBuf,
}

/// One GDN layer's state: conv window `[k−1, conv_dim]` f32 and S `[H_v, d_k, d_v]` f32.
pub struct CudaGdn {
    conv: DevBuf,
    s: DevBuf,
}

/// Per-call temporaries, sized for `cap` rows; the decode graph captures their addresses, so they
/// are only ever grown (reallocated) by a larger step, never shrunk.
struct Scratch {
    cap: usize,
    kmax: usize,
    // input of a projection: xf f32 [cap, kmax], xq i8 [cap, kmax], xd f32 / xs i32 [cap, kmax/32]
    xf: DevBuf,
    xq: DevBuf,
    xd: DevBuf,
    xs: DevBuf,
    // b1-plane activations of a normed row (`rmsnorm_quant_p16`), for up to MV_ROWS rows: planes
    // [MV_ROWS, kmax / 256, 32, 4] u32, units [MV_ROWS, kmax / 128] f32, sums [.., 4] i32
    xp: DevBuf,
    xu: DevBuf,
    xsum: DevBuf,
    // the same codes byte-split for the int8 tensor-core verify (`Gpu::mv_b1q`): [MV_ROWS, kmax / 128,
    // 4, 64] u8
    xv: DevBuf,
    // one row of b1-plane activations written by the SwiGLU-fused decode gate‖up launch while it
    // still reads xp (planes, units, sums as xp / xu / xsum)
    yp: DevBuf,
    yu: DevBuf,
    ysum: DevBuf,
    // projection outputs, each f32 [cap, pmax]
    p: [DevBuf; 4],
    // GDN: q, k [cap, hk·dk]; v, o [cap, hv·dv]; beta, g [cap, hv]
    gq: DevBuf,
    gk: DevBuf,
    gv: DevBuf,
    go: DevBuf,
    gbeta: DevBuf,
    gg: DevBuf,
    // attention: qo, att [cap, nh·hd]; scores: flash-decode chunk partials
    // [8, nh, ceil(n_ctx/32), hd + 2] f32
    qo: DevBuf,
    att: DevBuf,
    scores: DevBuf,
    scores_ctx: usize,
    // positions pos0 + t [cap] i32 and what was last uploaded; token ids [cap] i32
    pos: DevBuf,
    pos_host: Option<(usize, usize)>,
    ids: DevBuf,
    // head: logits [8, n_vocab] f32; argmax ids [8] i32; token history for graph runs
    logits: DevBuf,
    amax: DevBuf,
    /// Bumped on every reallocation: a captured graph is valid only for the generation it saw.
    gen: u64,
    /// The model dimensions the buffers were sized for ([`scratch_dims`]): another model on the
    /// same backend gets new scratch.
    dims: [usize; 10],
}

/// Every model dimension a [`Scratch`] buffer size depends on.
fn scratch_dims(cfg: &TargetConfig) -> [usize; 10] {
    [
        cfg.n_embd,
        cfg.n_ff,
        cfg.n_vocab,
        cfg.n_head,
        cfg.n_head_kv,
        cfg.head_dim,
        cfg.ssm_n_group,
        cfg.ssm_dt_rank,
        cfg.ssm_d_state,
        cfg.ssm_inner,
    ]
}

pub struct CudaBackend {
    gpu: Arc<Gpu>,
    scratch: Mutex<Option<Scratch>>,
    /// Generations handed out to scratch allocations (never reused, also after a failed one).
    scratch_gens: AtomicU64,
    max_ctx: Mutex<usize>,
    /// The captured plain decode steps ([`Backend::decode_step`]), rebuilt when their key
    /// changes, one per [`StepOut`] (indexed by it): the statistics alone, the statistics and
    /// the row's best entries, or the whole logits row.
    step_graph: Mutex<[Option<StepGraph>; 3]>,
    /// Whether the speculative round's device work replays captured graphs
    /// ([`Backend::verify_forward`], [`Backend::copy_gdn_all`], [`Backend::rollback_gdn`]). On by
    /// default; `BONSAI_CUDA_ROUND_GRAPH=0` turns it off, [`CudaBackend::set_round_graph`] too.
    round_graph: AtomicBool,
    /// The captured round graphs and the buffers they read and write.
    round_graphs: Mutex<RoundGraphs>,
    /// The speculative round's snapshot asked for by [`Backend::round_snapshot`] and taken by
    /// the next [`Backend::verify_forward`]: per GDN layer, the live buffers and the snapshot's.
    pending_snap: Mutex<Option<Vec<SnapPair>>>,
    /// Whether the round's snapshot is a side output of the verify's GDN kernels and the
    /// rollback's replay reads it directly (on unless `BONSAI_CUDA_SNAP_FUSED=0`; off: a copy of
    /// every layer before the verify, and a restore copy before an in-place replay).
    snap_fused: AtomicBool,
    /// Whether a rollback replays every GDN layer in one `gdn_replay_layers` launch (on unless
    /// `BONSAI_CUDA_REPLAY_LAYERS=0`; off: one `gdn_replay` launch per layer). The same states.
    replay_layers: AtomicBool,
    /// Whether the verify's fused GDN kernel writes the GDN verify record itself (1) or its side
    /// outputs, then a `gdn_rec_write` launch per layer (0); 2: the default (on), see
    /// [`CudaBackend::rec_fused`]. `BONSAI_CUDA_REC_FUSED=0|1`. The same records either way.
    rec_fused: AtomicU8,
    /// Tests only ([`CudaBackend::set_force_row_fallback`]): treat every row's statistics as
    /// unusable when deciding whether rows may be skipped.
    force_row_fallback: AtomicBool,
    /// Whether the verify graphs copy their taps to the host ([`CudaBackend::set_verify_taps_on_host`]).
    verify_taps_host: AtomicBool,
    /// The last verify's taps on the device, `(address, rows, row width)` of `[rows, n_taps·n_embd]`
    /// f32, when its graph left them there ([`CudaBackend::last_verify_taps`]).
    verify_taps: Mutex<Option<(u64, usize, usize)>>,
}

/// The speculative round's captured graphs (see [`CudaBackend::set_round_graph`]).
///
/// `tests/cuda_round_graph.rs` checks it on the H200 (the round with graphs against the eager
/// round: tokens, logits, taps and state bit for bit).
///
/// - **verify** (one graph per row count n = 1..=8, tap layer list, with or without the logits
///   copy, scratch generation, weight set, state / record addresses, launch mode,
///   mat-vec family): pinned `[ids ‖ positions]` → the device id and
///   position slots, embed, the 64 layers with the GDN verify records written into the round's
///   record buffers, each tapped layer's n rows copied into `taps_dev`, the head over the n rows,
///   `logit_stats_rows`, then async copies of the logits (only in the variant with rows), the
///   statistics and the taps to pinned memory. Without rows, a verify whose statistics are
///   unusable copies the rows from the scratch logits (which still hold them) after the replay.
///   The launches are those of the eager `model::forward` over the same rows, in the
///   same order, so every output is bit-identical. Positions come from device memory (the
///   n-row attention kernels read `sc.pos`; the GDN kernels take none), so one graph replays at
///   any position.
/// - **copy** (snapshot before the verify, restore before a re-forward): the per-layer
///   conv-window and state copies, keyed by the source and destination addresses.
/// - **rollback** (one per accept count `keep`): restore every layer from the snapshot, then
///   `gdn_replay` over `keep` rows of every record, keyed by `keep` and the addresses.
#[derive(Default)]
struct RoundGraphs {
    /// Buffers the verify graphs bake in; reallocating them drops every graph.
    io: Option<RoundIo>,
    /// `(key, graph)`, oldest first; at most [`ROUND_GRAPHS_MAX`].
    graphs: Vec<(Vec<u64>, kc::Graph)>,
}

/// Most round graphs kept (verify n = 1..=8 with and without taps, with and without rows, 7
/// rollbacks, 2 copies).
const ROUND_GRAPHS_MAX: usize = 48;
/// First key word of each round graph kind.
const KEY_VERIFY: u64 = 0x5645_5249;
const KEY_COPY: u64 = 0x434f_5059;
const KEY_ROLLBACK: u64 = 0x524f_4c4c;

/// Host ↔ device buffers of the verify graphs (addresses baked into every one).
struct RoundIo {
    n_embd: usize,
    n_vocab: usize,
    /// Tap layers the tap buffers hold (at most).
    tap_slots: usize,
    /// The residual stream `[MV_ROWS, n_embd]` f32.
    x: CudaAct,
    /// `[ids (MV_ROWS) ‖ positions (MV_ROWS)]` i32, read by the graph's first two copies.
    input: kc::PinnedBuf,
    /// `[n, n_vocab]` f32 logits of the last verify.
    logits: kc::PinnedBuf,
    /// Per-row statistics `[MV_ROWS, 4]` u32: device, then pinned.
    stats_dev: DevBuf,
    stats: kc::PinnedBuf,
    /// Per-row best entries `[MV_ROWS, TOPK_ROW, 2]` u32 (`topk_rows`): device, then pinned.
    top_dev: DevBuf,
    top: kc::PinnedBuf,
    /// Taps `[row][tap layer j][n_embd]` f32 (`TapRequest`'s layout; one 2D copy per tapped layer):
    /// device, then pinned unless they stay on the device
    /// ([`CudaBackend::set_verify_taps_on_host`]).
    taps_dev: DevBuf,
    taps: kc::PinnedBuf,
}

/// One plain decode step captured as a CUDA graph: pinned `[id, pos]` → device slots, embed, 64
/// layers, head, row statistics → pinned host buffer, and (in the variant with the row) the
/// logits row → pinned host buffer. Valid while every address it baked in is alive and unchanged,
/// which `key` records.
struct StepGraph {
    /// Scratch generation, n_ctx, weight and state buffer addresses at capture.
    key: Vec<u64>,
    graph: kc::Graph,
    /// The residual stream x: [1, n_embd] f32 (address baked into the graph).
    _x: CudaAct,
    /// [id, pos] i32, read by the graph's first two copies.
    input: kc::PinnedBuf,
    /// [n_vocab] f32, written by the graph's logits copy (`None`: the variants without it).
    logits: Option<kc::PinnedBuf>,
    /// The row's best entries: device [TOPK_ROW, 2] u32 → pinned (`topk_rows`; `None`: the
    /// variants without them).
    top: Option<(DevBuf, kc::PinnedBuf)>,
    /// The row's statistics: device [4] u32 → pinned [4] u32 (argmax, max, lse).
    _stats_dev: DevBuf,
    stats: kc::PinnedBuf,
}

/// Rows per mat-vec launch.
const MV_ROWS: usize = kc::MAX_ROWS;

/// A decode step's request for the row's best entries: how many the sampler reads, and the list
/// to fill (best first).
type RowTop<'a> = (usize, &'a mut Vec<(u32, f32)>);

/// A verify's request for each row's best entries: how many the sampler reads, and the lists to
/// fill (one per row, best first).
type RowTops<'a> = (usize, &'a mut Vec<Vec<(u32, f32)>>);

/// What a captured decode step copies back besides the row's statistics (the index of its
/// variant in `CudaBackend::step_graph`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepOut {
    /// The statistics alone (a greedy pick).
    Stats = 0,
    /// The statistics and the row's [`kc::TOPK_ROW`] best entries (a top-k draw, top-N logprobs).
    Top = 1,
    /// The statistics and the whole logits row.
    Row = 2,
}

impl StepOut {
    /// The variant for a caller that asks for best entries (`top`), else for the rows or not.
    fn of(rows_needed: bool, top: bool) -> StepOut {
        match (top, rows_needed) {
            (true, _) => StepOut::Top,
            (false, true) => StepOut::Row,
            (false, false) => StepOut::Stats,
        }
    }
}

/// A GDN layer's two device buffers as addresses and sizes (what a pending snapshot keeps).
#[derive(Clone, Copy, Debug)]
struct GdnPtrs {
    conv: u64,
    s: u64,
    conv_bytes: usize,
    s_bytes: usize,
}

impl CudaGdn {
    fn ptrs(&self) -> GdnPtrs {
        GdnPtrs {
            conv: self.conv.ptr(),
            s: self.s.ptr(),
            conv_bytes: self.conv.bytes(),
            s_bytes: self.s.bytes(),
        }
    }

    /// Whether `other` has this layer's buffer sizes (a snapshot of it may be read into it).
    fn same_shape(&self, other: &CudaGdn) -> bool {
        self.s.bytes() == other.s.bytes() && self.conv.bytes() == other.conv.bytes()
    }
}

/// One GDN layer of a pending round snapshot: the live state and where its snapshot goes
/// ([`CudaBackend::pending_snap`]; the two have the same sizes).
#[derive(Clone, Copy, Debug)]
struct SnapPair {
    live: GdnPtrs,
    snap: GdnPtrs,
}

/// Append `(key, graph)` to a round-graph cache (dropping the oldest beyond
/// [`ROUND_GRAPHS_MAX`]; an instantiated graph still in flight is freed when it completes) and
/// return its index.
fn push_graph(graphs: &mut Vec<(Vec<u64>, kc::Graph)>, key: Vec<u64>, graph: kc::Graph) -> usize {
    if graphs.len() >= ROUND_GRAPHS_MAX {
        graphs.remove(0);
    }
    graphs.push((key, graph));
    graphs.len() - 1
}

/// The index of the round graph cached under `key`; on a miss `capture` records it and it is
/// cached with [`push_graph`].
fn cached_graph(
    graphs: &mut Vec<(Vec<u64>, kc::Graph)>,
    key: Vec<u64>,
    capture: impl FnOnce() -> Result<kc::Graph>,
) -> Result<usize> {
    match graphs.iter().position(|(k, _)| *k == key) {
        Some(i) => Ok(i),
        None => Ok(push_graph(graphs, key, capture()?)),
    }
}

/// A snapshot `snap` that the replay may read into `state`: the same state and window sizes.
fn snap_fits(what: &str, snap: &CudaGdn, state: &CudaGdn) -> Result<()> {
    if snap.same_shape(state) {
        return Ok(());
    }
    Err(Error::Backend(format!(
        "{what}: snapshot of {} + {} bytes for a state of {} + {}",
        snap.s.bytes(),
        snap.conv.bytes(),
        state.s.bytes(),
        state.conv.bytes()
    )))
}

/// A decode step captured as one CUDA graph (n = 1, greedy): `embed(ids[0])` → 64 layers → head →
/// argmax → `ids[0]`; `hist[pos] = token`; `pos += 1`.
pub struct DecodeGraph {
    graph: kc::Graph,
    hist: DevBuf,
    hist_len: usize,
    /// The residual stream the graph works in (its address is baked into the graph).
    _x: CudaAct,
}

impl CudaBackend {
    /// Open CUDA device `ordinal` and compile (or load cached) kernels.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        if !kc::cuda_available() {
            return Err(Error::BackendUnavailable(
                "CUDA: no driver library (libcuda.so.1) or no device".into(),
            ));
        }
        let gpu = Gpu::new(ordinal).map_err(|e| Error::BackendUnavailable(format!("CUDA: {e}")))?;
        Ok(CudaBackend {
            gpu: Arc::new(gpu),
            scratch: Mutex::new(None),
            scratch_gens: AtomicU64::new(0),
            max_ctx: Mutex::new(1),
            step_graph: Mutex::new([None, None, None]),
            round_graph: AtomicBool::new(
                std::env::var("BONSAI_CUDA_ROUND_GRAPH").map_or(true, |v| v != "0"),
            ),
            round_graphs: Mutex::new(RoundGraphs::default()),
            pending_snap: Mutex::new(None),
            snap_fused: AtomicBool::new(
                std::env::var("BONSAI_CUDA_SNAP_FUSED").map_or(true, |v| v != "0"),
            ),
            replay_layers: AtomicBool::new(
                std::env::var("BONSAI_CUDA_REPLAY_LAYERS").map_or(true, |v| v != "0"),
            ),
            rec_fused: AtomicU8::new(match std::env::var("BONSAI_CUDA_REC_FUSED").as_deref() {
                Ok("0") => 0,
                Ok("1") => 1,
                _ => 2,
            }),
            force_row_fallback: AtomicBool::new(false),
            verify_taps_host: AtomicBool::new(true),
            verify_taps: Mutex::new(None),
        })
    }

    /// Whether the speculative round replays captured graphs (see `RoundGraphs`; on unless
    /// `BONSAI_CUDA_ROUND_GRAPH=0`).
    pub fn round_graph(&self) -> bool {
        self.round_graph.load(Ordering::Relaxed)
    }

    /// Turn the round graphs on or off (tests and benchmarks compare both in one process). The
    /// graphs already captured are kept; they are valid only while their keys match.
    pub fn set_round_graph(&self, on: bool) {
        self.round_graph.store(on, Ordering::Relaxed);
    }

    /// Whether the round's GDN snapshot is written by the verify and read by the replay (see
    /// `snap_fused`; on unless `BONSAI_CUDA_SNAP_FUSED=0`). The same states either way.
    pub fn snap_fused(&self) -> bool {
        self.snap_fused.load(Ordering::Relaxed)
    }

    /// Set [`Self::snap_fused`] (benchmarks compare both in one process).
    pub fn set_snap_fused(&self, on: bool) {
        self.snap_fused.store(on, Ordering::Relaxed);
    }

    /// Whether a rollback replays all GDN layers in one launch (see `replay_layers`; on unless
    /// `BONSAI_CUDA_REPLAY_LAYERS=0`). The same states either way.
    pub fn replay_layers(&self) -> bool {
        self.replay_layers.load(Ordering::Relaxed)
    }

    /// Set [`Self::replay_layers`] (benchmarks compare both in one process).
    pub fn set_replay_layers(&self, on: bool) {
        self.replay_layers.store(on, Ordering::Relaxed);
    }

    /// Whether the verify's fused GDN kernel writes the verify record itself
    /// (`BONSAI_CUDA_REC_FUSED=0|1`; on by default). The same records either way. On the H200's
    /// 27B rounds (`cuda_spec_bench::cuda_replay_round_ab`) it took Q2_0's round from 7.84–7.88
    /// to 7.74–7.77 ms at 470bc9a (`bench/results/cuda-rollback-ab-27b-*.json`), while Q1_0's
    /// went 7.13–7.16 → 7.15–7.18 ms then, so Q1_0 kept the `gdn_rec_write` launches. Since the
    /// norms skip their unread outputs (b0cdaf7) it gains on both (`cuda-replay-pdl-ab-27b-*.json`,
    /// b012dcc): Q1_0 7.05–7.08 → 7.01–7.02 ms, Q2_0 7.73–7.75 → 7.63–7.65 ms; the reason for
    /// the earlier Q1_0 result was not found.
    pub fn rec_fused(&self) -> bool {
        self.rec_fused.load(Ordering::Relaxed) != 0
    }

    /// The [`Self::rec_fused`] setting: `Some(on)` forced, `None` the default.
    pub fn rec_fused_mode(&self) -> Option<bool> {
        match self.rec_fused.load(Ordering::Relaxed) {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    /// Set [`Self::rec_fused`] (benchmarks compare both in one process; the verify graphs key on
    /// it).
    pub fn set_rec_fused(&self, mode: Option<bool>) {
        self.rec_fused
            .store(mode.map_or(2, u8::from), Ordering::Relaxed);
    }

    /// One decode step through the captured graph of the variant [`StepOut::of`] picks. With
    /// `top = Some((n, list))` the row's best entries go to `list` when they serve a sampler that
    /// reads `n` of them (usable statistics, `min(n, n_vocab)` entries); otherwise `list` stays
    /// empty and the row is read from the device logits instead.
    #[allow(clippy::too_many_arguments)]
    fn decode_step_out(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        id: u32,
        logits: &mut Vec<f32>,
        rows_needed: bool,
        top: Option<RowTop<'_>>,
    ) -> Result<Option<LogitStats>> {
        let out = StepOut::of(rows_needed, top.is_some());
        if st.pos + 1 > st.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "{} positions requested, context is {}",
                st.pos + 1,
                st.n_ctx
            )));
        }
        if id as usize >= cfg.n_vocab || id as usize >= w.tok_embd.n_out {
            return Err(Error::InvalidRequest(format!(
                "token id {id} out of range (n_vocab {})",
                cfg.n_vocab
            )));
        }
        if w.head_mat().n_out != cfg.n_vocab {
            return Err(Error::Backend(format!(
                "head has {} rows, n_vocab is {}",
                w.head_mat().n_out,
                cfg.n_vocab
            )));
        }
        if let Some(kv) = st.kv.iter().find(|kv| kv.len != st.pos) {
            return Err(Error::Backend(format!(
                "KV cache holds {} rows, step starts at {}",
                kv.len, st.pos
            )));
        }
        let nv = cfg.n_vocab;
        let mut slots = self.step_graph.lock().expect("step graph lock");
        let slot = &mut slots[out as usize];
        let stats = self.with_scratch(cfg, 1, |sc| {
            let mut key = Self::step_key(cfg, w, st, sc.gen);
            // a graph bakes in the launch mode (PDL edges or full ones), the mat-vec family and
            // what it copies back
            key.extend(self.gpu.launch_mode_key());
            key.push(out as u64);
            if slot.as_ref().is_none_or(|g| g.key != key) {
                *slot = None;
                *slot = Some(self.capture_step(sc, cfg, w, st, key, out)?);
            }
            let g = slot.as_mut().expect("step graph");
            g.input.set_i32(0, id as i32);
            g.input.set_i32(1, st.pos as i32);
            // the graph overwrites the device position slot
            sc.pos_host = None;
            self.gpu.launch_graph(&g.graph).map_err(be)?;
            self.gpu.sync().map_err(be)?;
            let r = kc::LogitRowStats::from_words(g.stats.u32s(4));
            let stats = r.argmax.map(|argmax| LogitStats {
                argmax,
                max: r.max,
                lse: r.lse,
            });
            logits.clear();
            let mut served = self.rows_skippable(&[stats], 1, nv);
            if let (Some((_, host)), Some((n, top))) = (&g.top, top) {
                top.clear();
                if served {
                    top.extend(kc::topk_from_words(host.u32s(kc::TOPK_ROW * 2), nv));
                    served = top.len() >= n.min(nv);
                }
                if !served {
                    top.clear();
                }
            }
            if let Some(row) = &g.logits {
                logits.extend_from_slice(row.f32s(nv));
            } else if !served {
                // a row-less graph ran and the statistics are unusable (or the best entries too
                // few): the step has advanced the state (no replay), but the scratch logits still
                // hold the row
                logits.resize(nv, 0.0);
                self.gpu.dtoh(&sc.logits, 0, &mut logits[..]).map_err(be)?;
            }
            Ok(stats)
        })?;
        st.pos += 1;
        for kv in &mut st.kv {
            kv.len = st.pos;
        }
        Ok(stats)
    }

    /// [`Backend::verify_forward`] with the round graph of the variant [`StepOut::of`] picks. With
    /// `top` each row's best entries go to `top.1` when they serve a sampler that reads `top.0` of
    /// them (usable statistics, `min(top.0, n_vocab)` entries for every row); otherwise
    /// `top.1` stays empty and the rows are read from the device logits instead. The eager path
    /// (round graphs off, more than 8 rows, taps past the layers) always fills the rows.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn verify_forward_out(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        ids: &[u32],
        recs: &mut [CudaAct],
        taps: Option<(&[usize], &mut Vec<f32>)>,
        logits: &mut Vec<f32>,
        rows_needed: bool,
        top: Option<RowTops<'_>>,
    ) -> Result<Vec<Option<LogitStats>>> {
        let n = ids.len();
        *self.verify_taps.lock().expect("verify taps lock") = None;
        let taps_inside = taps
            .as_ref()
            .is_none_or(|(l, _)| l.iter().all(|&il| il < w.layers.len()));
        let graph = self.round_graph() && n > 0 && n <= MV_ROWS && taps_inside;
        // a snapshot asked for by round_snapshot: the fused GDN kernels of the verify graph write
        // it as they read the state; every other path copies it first
        let pending = self.pending_snap.lock().expect("snapshot lock").take();
        let mut snaps = Vec::new();
        if let Some(pairs) = pending {
            if pairs.len() != st.gdn.len()
                || pairs
                    .iter()
                    .zip(&st.gdn)
                    .any(|(p, g)| p.live.s != g.s.ptr() || p.live.conv != g.conv.ptr())
            {
                return Err(Error::Backend(
                    "verify_forward: the round snapshot was taken of another sequence's state"
                        .into(),
                ));
            }
            if graph && self.gdn_fused_path(cfg, n) {
                snaps = pairs;
            } else {
                for p in &pairs {
                    self.copy_gdn_ptrs(p.live, p.snap)?;
                }
            }
        }
        if !graph {
            crate::model::verify_forward_eager(self, cfg, w, st, ids, recs, taps, logits)?;
            return Ok(Vec::new());
        }
        let (layers, out) = match taps {
            Some((l, o)) => (l, Some(o)),
            None => (&[][..], None),
        };
        self.verify_graph(
            cfg,
            w,
            st,
            ids,
            recs,
            layers,
            out,
            logits,
            rows_needed,
            top,
            &snaps,
        )
    }

    /// Whether a verify through the round graph copies the rows' taps to the host (the default).
    /// Off (a GPU drafter stages them from device memory): the graph leaves them on the device,
    /// [`Backend::verify_forward`] returns no taps, and [`Self::last_verify_taps`] says where they
    /// are. An eager verify (round graphs off, or a row count they do not take) still returns them.
    pub fn set_verify_taps_on_host(&self, on: bool) {
        self.verify_taps_host.store(on, Ordering::Relaxed);
    }

    /// See [`Self::set_verify_taps_on_host`].
    pub fn verify_taps_on_host(&self) -> bool {
        self.verify_taps_host.load(Ordering::Relaxed)
    }

    /// The taps of the last verify, when its graph left them on the device: `(address, rows, row
    /// width)` of `[rows, n_taps·n_embd]` f32 (row r: its taps in tap-layer order, `TapRequest`'s
    /// layout). Valid until the next verify.
    pub fn last_verify_taps(&self) -> Option<(u64, usize, usize)> {
        *self.verify_taps.lock().expect("verify taps lock")
    }

    /// Tests only: with `on`, [`Backend::decode_step_stats`] and [`Backend::verify_forward`]
    /// treat every row's statistics as unusable when deciding whether the rows may be skipped,
    /// so a caller that needs no rows still gets them through the fallback (a synchronous copy
    /// from the device logits after the row-less graph). The statistics returned are unchanged.
    #[doc(hidden)]
    pub fn set_force_row_fallback(&self, on: bool) {
        self.force_row_fallback.store(on, Ordering::Relaxed);
    }

    /// Whether `stats` lets a caller that needs no rows skip them: one per row, each usable
    /// (what `Sampler::sample_from_stats` accepts), and no forced fallback.
    fn rows_skippable(&self, stats: &[Option<LogitStats>], n: usize, nv: usize) -> bool {
        !self.force_row_fallback.load(Ordering::Relaxed)
            && stats.len() == n
            && stats.iter().all(|s| {
                s.is_some_and(|s| {
                    (s.argmax as usize) < nv && s.max.is_finite() && s.lse.is_finite()
                })
            })
    }

    /// True when a CUDA device can be opened here (never panics).
    pub fn available() -> bool {
        kc::cuda_available()
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// A shared handle on the device (the GPU drafter queues its work on the same stream).
    pub fn gpu_arc(&self) -> Arc<Gpu> {
        self.gpu.clone()
    }

    fn with_scratch<T>(
        &self,
        cfg: &TargetConfig,
        n: usize,
        f: impl FnOnce(&mut Scratch) -> Result<T>,
    ) -> Result<T> {
        let mut g = self.scratch.lock().expect("scratch lock");
        let max_ctx = *self.max_ctx.lock().expect("ctx lock");
        let need_new = match g.as_ref() {
            None => true,
            Some(s) => s.cap < n || s.scores_ctx < max_ctx || s.dims != scratch_dims(cfg),
        };
        if need_new {
            let cap = n.max(g.as_ref().map_or(1, |s| s.cap)).max(MV_ROWS);
            *g = None;
            let mut sc = self.alloc_scratch(cfg, cap, max_ctx)?;
            sc.gen = self.scratch_gens.fetch_add(1, Ordering::Relaxed);
            *g = Some(sc);
        }
        f(g.as_mut().expect("scratch"))
    }

    fn alloc_scratch(&self, cfg: &TargetConfig, cap: usize, n_ctx: usize) -> Result<Scratch> {
        let gpu = &self.gpu;
        let hd = cfg.head_dim;
        let kmax = cfg
            .n_embd
            .max(cfg.n_ff)
            .max(cfg.ssm_inner)
            .max(cfg.n_head * hd);
        let pmax = cfg
            .conv_dim()
            .max(cfg.n_ff)
            .max(cfg.n_head * 2 * hd)
            .max(cfg.ssm_inner);
        let f = 4usize;
        let a = |bytes: usize| gpu.alloc(bytes).map_err(be);
        let hkdk = cfg.ssm_key_dim();
        let hvdv = cfg.ssm_inner;
        Ok(Scratch {
            cap,
            kmax,
            xf: a(cap * kmax * f)?,
            xq: a(cap * kmax)?,
            xd: a(cap * kmax / 32 * f)?,
            xs: a(cap * kmax / 32 * f)?,
            xp: a(MV_ROWS * kmax * 2)?,
            xu: a(MV_ROWS * kmax / 128 * f)?,
            xsum: a(MV_ROWS * kmax / 128 * 4 * f)?,
            xv: a(MV_ROWS * kmax * 2)?,
            yp: a(kmax * 2)?,
            yu: a(kmax / 128 * f)?,
            ysum: a(kmax / 128 * 4 * f)?,
            p: [
                a(cap * pmax * f)?,
                a(cap * pmax * f)?,
                a(cap * pmax * f)?,
                a(cap * pmax * f)?,
            ],
            gq: a(cap * hkdk * f)?,
            gk: a(cap * hkdk * f)?,
            gv: a(cap * hvdv * f)?,
            go: a(cap * hvdv * f)?,
            gbeta: a(cap * cfg.ssm_dt_rank * f)?,
            gg: a(cap * cfg.ssm_dt_rank * f)?,
            qo: a(cap * cfg.n_head * hd * f)?,
            att: a(cap * cfg.n_head * hd * f)?,
            scores: a(kc::attn_part_floats(MV_ROWS, cfg.n_head, hd, n_ctx) * f)?,
            scores_ctx: n_ctx,
            pos: a(cap * 4)?,
            pos_host: None,
            ids: a(cap * 4)?,
            logits: a(MV_ROWS * cfg.n_vocab * f)?,
            amax: a(MV_ROWS * 4)?,
            gen: 0,
            dims: scratch_dims(cfg),
        })
    }

    /// Whether an `n`-row projection of `m` runs on the tensor-core GEMM (prefill: more rows than
    /// one mat-vec launch takes) instead of the batch-invariant mat-vec path (decode, verify).
    fn use_gemm(m: &CudaMat, n: usize) -> bool {
        n > MV_ROWS && kc::gemm_supported(m.kind, m.n_in)
    }

    /// `y[n, n_out] (+)= x · Wᵀ` from the scratch input (xf/xq/xd/xs, width `m.n_in`): one GEMM
    /// launch when [`Self::use_gemm`], else in groups of at most 8 rows.
    fn proj(&self, sc: &Scratch, m: &CudaMat, n: usize, y: u64, accumulate: bool) -> Result<()> {
        self.proj_from(
            sc,
            m,
            n,
            y,
            accumulate,
            (sc.xq.ptr(), sc.xd.ptr(), sc.xs.ptr()),
        )
    }

    /// [`Self::proj`] with the int8 input `(q, d, s)` (`[n, m.n_in]` codes, `[n, m.n_in / 32]`
    /// scales and sums) taken from there instead of the scratch's (f32 matrices still read `xf`).
    fn proj_from(
        &self,
        sc: &Scratch,
        m: &CudaMat,
        n: usize,
        y: u64,
        accumulate: bool,
        (xq, xd, xs): (u64, u64, u64),
    ) -> Result<()> {
        let k = m.n_in;
        debug_assert!(k <= sc.kmax);
        if Self::use_gemm(m, n) {
            if m.codes.is_none() {
                return self.gemm_b1p(&[(m, y)], xq, xd, n, accumulate);
            }
            let (codes, scales) = m.dp4a()?;
            return self
                .gpu
                .gemm_lowbit(m.kind, codes, scales, xq, xd, y, k, m.n_out, n, accumulate)
                .map_err(be);
        }
        let (codes, scales) = m.dp4a()?;
        let mut t0 = 0;
        while t0 < n {
            let nr = (n - t0).min(MV_ROWS);
            let yo = y + (t0 * m.n_out * 4) as u64;
            match m.kind {
                WKind::F32 => {
                    self.gpu
                        .mv_f32(codes, sc.xf.at(t0 * k * 4), yo, k, m.n_out, nr, accumulate)
                }
                kind => self.gpu.mv_lowbit(
                    kind,
                    codes,
                    scales,
                    xq + (t0 * k) as u64,
                    xd + (t0 * k / 32 * 4) as u64,
                    xs + (t0 * k / 32 * 4) as u64,
                    yo,
                    k,
                    m.n_out,
                    nr,
                    accumulate,
                ),
            }
            .map_err(be)?;
            t0 += nr;
        }
        Ok(())
    }

    /// Several projections of the same input (`(matrix, y)` pairs): one grouped launch (the GEMM
    /// for more than 8 rows, else a mat-vec per 8-row chunk) when all are low-bit of one kind and
    /// width (up to `kc::MAX_SEGS`), else one [`Self::proj`] each. Outputs are bit-identical
    /// either way.
    fn proj_multi(
        &self,
        sc: &Scratch,
        mats: &[(&CudaMat, u64)],
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (m0, _) = mats[0];
        let groupable = mats.len() <= kc::MAX_SEGS
            && m0.kind != WKind::F32
            && mats
                .iter()
                .all(|(m, _)| m.kind == m0.kind && m.n_in == m0.n_in);
        if !groupable {
            for &(m, y) in mats {
                self.proj(sc, m, n, y, accumulate)?;
            }
            return Ok(());
        }
        let k = m0.n_in;
        if Self::use_gemm(m0, n) {
            if mats.iter().any(|(m, _)| m.codes.is_none()) {
                return self.gemm_b1p(mats, sc.xq.ptr(), sc.xd.ptr(), n, accumulate);
            }
            let segs: Vec<kc::MvSeg> = mats
                .iter()
                .map(|&(m, y)| {
                    let (codes, scales) = m.dp4a()?;
                    Ok(kc::MvSeg {
                        codes,
                        scales,
                        y,
                        n_out: m.n_out,
                    })
                })
                .collect::<Result<_>>()?;
            return self
                .gpu
                .gemm_lowbit_multi(m0.kind, &segs, sc.xq.ptr(), sc.xd.ptr(), k, n, accumulate)
                .map_err(be);
        }
        let mut t0 = 0;
        while t0 < n {
            let nr = (n - t0).min(MV_ROWS);
            let segs: Vec<kc::MvSeg> = mats
                .iter()
                .map(|&(m, y)| {
                    let (codes, scales) = m.dp4a()?;
                    Ok(kc::MvSeg {
                        codes,
                        scales,
                        y: y + (t0 * m.n_out * 4) as u64,
                        n_out: m.n_out,
                    })
                })
                .collect::<Result<_>>()?;
            self.gpu
                .mv_lowbit_multi(
                    m0.kind,
                    &segs,
                    sc.xq.at(t0 * k),
                    sc.xd.at(t0 * k / 32 * 4),
                    sc.xs.at(t0 * k / 32 * 4),
                    k,
                    nr,
                    accumulate,
                )
                .map_err(be)?;
            t0 += nr;
        }
        Ok(())
    }

    /// The prefill GEMM of `mats` (`(matrix, y)`, one `n_in`, each with a b1-plane layout of one
    /// plane count) from their b1-plane layouts ([`kc::Gpu::gemm_b1p_multi`]: the same bits as
    /// the dp4a-layout GEMM), for projections held only in that layout.
    fn gemm_b1p(
        &self,
        mats: &[(&CudaMat, u64)],
        xq: u64,
        xd: u64,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (m0, _) = mats[0];
        let planes = m0.b1p_planes();
        let segs: Vec<kc::MvSeg> = mats
            .iter()
            .map(|&(m, y)| match &m.b1p {
                Some(l) if m.b1p_planes() == planes && m.n_in == m0.n_in => Ok(kc::MvSeg {
                    codes: l.codes.ptr(),
                    scales: l.scales.ptr(),
                    y,
                    n_out: m.n_out,
                }),
                _ => Err(Error::Backend(format!(
                    "cuda: a GEMM group mixes a b1-plane-only projection with a [{} x {}] matrix \
                     of another layout",
                    m.n_out, m.n_in
                ))),
            })
            .collect::<Result<_>>()?;
        self.gpu
            .gemm_b1p_multi(m0.kind, &segs, xq, xd, m0.n_in, n, accumulate, None)
            .map_err(be)
    }

    /// The f32 copy of a projection input (`sc.xf`) when one of its `consumers` reads it (an f32
    /// matrix: `mv_f32`), else 0: the low-bit mat-vecs and GEMMs read only the int8 codes, so the
    /// producing kernel then skips the f32 write (a third of a prefill norm's memory traffic).
    fn f32_input(sc: &Scratch, consumers: &[&CudaMat]) -> u64 {
        if consumers.iter().any(|m| m.kind == WKind::F32) {
            sc.xf.ptr()
        } else {
            0
        }
    }

    /// RMSNorm of `n` rows into the projection input (int8 codes; the f32 copy only when one of
    /// `consumers` needs it; the b1-plane activations too when `n ≤ MV_ROWS`, [`Gpu::b1p`] is on
    /// and a consumer has a b1-plane layout). The int8 codes are skipped when every consumer
    /// takes the b1-plane path of [`Self::proj_multi_p16`] ([`Self::b1p_mats`]) and
    /// [`Gpu::norm_p16_only`] is on; then for verify rows ([`Self::b1q_rows`]) the planes too,
    /// which [`Gpu::mv_b1q`] does not read ([`Gpu::norm_b1q_only`]). Returns whether it wrote
    /// the b1-plane activations (then pass `true` to [`Self::proj_multi_p16`]; `consumers` must
    /// be the matrices passed there).
    #[allow(clippy::too_many_arguments)]
    fn norm_in(
        &self,
        sc: &Scratch,
        x: u64,
        w: &CudaVec,
        eps: f32,
        n: usize,
        k: usize,
        consumers: &[&CudaMat],
    ) -> Result<bool> {
        let p16 = n <= MV_ROWS
            && k % 256 == 0
            && k <= sc.kmax
            && self.gpu.b1p()
            && consumers.iter().any(|m| m.b1p.is_some());
        // no int8 codes where nothing reads them (the b1-plane kernels read only the b1-plane
        // outputs), and for verify rows on the int8 tensor cores no planes either (mv_b1q reads
        // the byte-split codes, units and sums)
        let only_p16 =
            p16 && self.gpu.norm_p16_only() && self.b1p_mats(consumers.iter().copied(), k);
        let q = if only_p16 { 0 } else { sc.xq.ptr() };
        let planes = if only_p16 && self.b1q_rows(n) && self.gpu.norm_b1q_only() {
            0
        } else {
            sc.xp.ptr()
        };
        self.gpu
            .rmsnorm_quant_p16(
                x,
                w.buf.ptr(),
                eps,
                n,
                k,
                Self::f32_input(sc, consumers),
                q,
                sc.xd.ptr(),
                sc.xs.ptr(),
                if p16 {
                    let xv = if self.b1q_rows(n) { sc.xv.ptr() } else { 0 };
                    (planes, sc.xu.ptr(), sc.xsum.ptr(), xv)
                } else {
                    (0, 0, 0, 0)
                },
            )
            .map_err(be)?;
        Ok(p16)
    }

    /// Whether an `n`-row b1-plane projection runs on the int8 tensor-core verify kernel
    /// ([`Gpu::mv_b1q`]; the norm then also writes the byte-split codes): 2..=MV_ROWS rows with
    /// [`Gpu::b1q`] on.
    fn b1q_rows(&self, n: usize) -> bool {
        (2..=MV_ROWS).contains(&n) && self.gpu.b1q()
    }

    /// [`Self::proj_multi`] of a normed input: when the norm wrote b1-plane activations (`p16`)
    /// and every matrix has a b1-plane layout: verify rows ([`Self::b1q_rows`]) on the int8
    /// tensor-core kernel ([`Gpu::mv_b1q`]) in one launch, other row counts on the b1-plane
    /// mat-vec ([`Gpu::mv_b1p`]) in chunks of up to `kc::MVBP_MAX_ROWS` rows. Both give each row the
    /// bits of the one-row decode kernel (same block integers, same float order), so decode and
    /// verify rows agree bit for bit. Else the int8 path, which the norm wrote too.
    fn proj_multi_p16(
        &self,
        sc: &Scratch,
        mats: &[(&CudaMat, u64)],
        n: usize,
        accumulate: bool,
        p16: bool,
    ) -> Result<()> {
        let k = mats[0].0.n_in;
        let b1p = p16 && n <= MV_ROWS && self.b1p_mats(mats.iter().map(|&(m, _)| m), k);
        if !b1p {
            return self.proj_multi(sc, mats, n, accumulate);
        }
        self.proj_b1p(mats, n, accumulate, Self::p16_acts(sc, n, self.b1q_rows(n)))
    }

    /// Whether [`Self::proj_multi_p16`] runs `mats` (inputs `k` wide) on the b1-plane kernels
    /// when the norm wrote b1-plane activations: [`Gpu::b1p`] on, at most `kc::MAX_SEGS`
    /// matrices, each with a b1-plane layout of `k` inputs and the same plane count. The norm
    /// skips its int8 codes on exactly this condition, so the two must stay one function.
    fn b1p_mats<'m>(&self, mut mats: impl Iterator<Item = &'m CudaMat> + Clone, k: usize) -> bool {
        let Some(first) = mats.clone().next() else {
            return false;
        };
        self.gpu.b1p()
            && mats.clone().count() <= kc::MAX_SEGS
            && mats.all(|m| m.b1p.is_some() && m.n_in == k && m.b1p_planes() == first.b1p_planes())
    }

    /// The scratch's b1-plane activation rows (`xp`, `xu`, `xsum`; `xv` with `byte_split`).
    fn p16_acts(sc: &Scratch, n: usize, byte_split: bool) -> kc::P16Out {
        debug_assert!(n <= MV_ROWS);
        kc::P16Out {
            xp: sc.xp.ptr(),
            xu: sc.xu.ptr(),
            xs: sc.xsum.ptr(),
            xv: if byte_split { sc.xv.ptr() } else { 0 },
        }
    }

    /// Whether the producer of `m`'s input writes b1-plane activations for `n` rows
    /// ([`kc::Gpu::b1p_out`], a b1-plane layout, `n ≤ MV_ROWS`); then [`Self::proj_b1p`] runs it.
    fn b1p_out_for(&self, sc: &Scratch, m: &CudaMat, n: usize) -> bool {
        n <= MV_ROWS
            && self.gpu.b1p_out()
            && m.b1p.is_some()
            && m.n_in % 256 == 0
            && m.n_in <= sc.kmax
    }

    /// The b1-plane projections of `mats` (each with a b1-plane layout, one `n_in`) from the
    /// activations `acts` (`n` rows): verify rows ([`Self::b1q_rows`], `acts.xv` written) on the
    /// int8 tensor-core kernel ([`Gpu::mv_b1q`]) in one launch, other row counts on the b1-plane
    /// mat-vec ([`Gpu::mv_b1p`]) in chunks of up to `kc::MVBP_MAX_ROWS` rows.
    fn proj_b1p(
        &self,
        mats: &[(&CudaMat, u64)],
        n: usize,
        accumulate: bool,
        acts: kc::P16Out,
    ) -> Result<()> {
        let k = mats[0].0.n_in;
        let planes = mats[0].0.b1p_planes().expect("b1p layout");
        let seg = |(m, y): &(&CudaMat, u64), t0: usize| {
            let l = m.b1p.as_ref().expect("b1p layout");
            debug_assert_eq!(l.planes, planes);
            kc::MvSeg {
                codes: l.codes.ptr(),
                scales: l.scales.ptr(),
                y: y + (t0 * m.n_out * 4) as u64,
                n_out: m.n_out,
            }
        };
        if self.b1q_rows(n) {
            // verify rows: all of them on the int8 tensor cores (the norm wrote the byte-split codes)
            let segs: Vec<kc::MvSeg> = mats.iter().map(|m| seg(m, 0)).collect();
            debug_assert!(acts.xv != 0);
            return self
                .gpu
                .mv_b1q(planes, &segs, acts.xv, acts.xu, acts.xs, k, n, accumulate)
                .map_err(be);
        }
        let mut t0 = 0;
        while t0 < n {
            let nr = (n - t0).min(kc::MVBP_MAX_ROWS);
            let segs: Vec<kc::MvSeg> = mats.iter().map(|m| seg(m, t0)).collect();
            self.gpu
                .mv_b1p(
                    planes,
                    &segs,
                    acts.xp + (t0 * k * 2) as u64,
                    acts.xu + (t0 * k / 128 * 4) as u64,
                    acts.xs + (t0 * k / 128 * 16) as u64,
                    k,
                    nr,
                    accumulate,
                )
                .map_err(be)?;
            t0 += nr;
        }
        Ok(())
    }

    fn set_pos(&self, sc: &mut Scratch, pos: usize, n: usize) -> Result<()> {
        if sc.pos_host != Some((pos, n)) {
            let p: Vec<i32> = (0..n).map(|t| (pos + t) as i32).collect();
            self.gpu.htod(&sc.pos, 0, &p).map_err(be)?;
            sc.pos_host = Some((pos, n));
        }
        Ok(())
    }

    fn gdn_impl(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut CudaGdn,
        x: u64,
        n: usize,
    ) -> Result<()> {
        self.gdn_impl_rec(sc, cfg, w, st, x, n, None, None)
    }

    /// [`Self::gdn_impl`]; with `rec` (a device `[≥ n, gdn_rec_width]` f32 buffer), also writes each
    /// row's verify record (MODEL.md §4.9 option C) from the conv kernel's outputs. The record is
    /// a side copy: the launches that compute the outputs and the state are the same either way.
    /// With `snap` (snapshot S, snapshot window; only where [`Self::gdn_fused_path`] holds) the
    /// fused kernel also writes the state and window it reads there: the round's snapshot.
    #[allow(clippy::too_many_arguments)]
    fn gdn_impl_rec(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut CudaGdn,
        x: u64,
        n: usize,
        rec: Option<u64>,
        snap: Option<(u64, u64)>,
    ) -> Result<()> {
        let e = cfg.n_embd;
        let eps = cfg.rms_eps;
        let (hk, hv, dk) = (cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state);
        let dv = cfg.ssm_head_v_dim();
        let p16 = self.norm_in(
            sc,
            x,
            &w.attn_norm,
            eps,
            n,
            e,
            &[&w.qkv, &w.gate, &w.beta, &w.alpha],
        )?;
        let [mixed, z, bb, aa] = [sc.p[0].ptr(), sc.p[1].ptr(), sc.p[2].ptr(), sc.p[3].ptr()];
        self.proj_multi_p16(
            sc,
            &[(&w.qkv, mixed), (&w.gate, z), (&w.beta, bb), (&w.alpha, aa)],
            n,
            false,
            p16,
        )?;
        let g = &self.gpu;
        // prefill (more rows than a mat-vec launch, never a verify step): rows in parallel and a
        // recurrence without per-row block barriers; decode and verify keep the batch-invariant
        // kernels (the speculative replay repeats their arithmetic)
        let prefill = n > MV_ROWS
            && rec.is_none()
            && kc::gdn_prefill_supported(dk, dv)
            && (1..=8).contains(&cfg.ssm_conv_kernel);
        let fused = g.gdn_fused();
        if !prefill && self.gdn_fused_path(cfg, n) {
            // decode / verify: the conv inside the recurrence, and the gated norm too where the
            // head is 128 wide (one launch, the same bits); the verify record takes k, v and the
            // gates from the fused kernel's side outputs
            // ssm_out on the b1-plane kernels: the fused norm writes b1-plane activations
            let out_p16 = self
                .b1p_out_for(sc, &w.ssm_out, n)
                .then(|| Self::p16_acts(sc, n, self.b1q_rows(n)));
            let norm = (fused == kc::GdnFused::ConvNorm && dv == 128).then(|| kc::GdnNormOut {
                z,
                w: w.ssm_norm.buf.ptr(),
                eps,
                out: kc::QuantOut {
                    f: Self::f32_input(sc, &[&w.ssm_out]),
                    q: sc.xq.ptr(),
                    d: sc.xd.ptr(),
                    s: sc.xs.ptr(),
                },
                p16: out_p16,
            });
            let rec_fused = self.rec_fused();
            g.gdn_conv_step(
                st.s.ptr(),
                mixed,
                st.conv.ptr(),
                w.conv1d.buf.ptr(),
                cfg.ssm_conv_kernel,
                (hk, hv, dk, dv),
                n,
                eps,
                (bb, aa, w.dt_bias.buf.ptr(), w.ssm_a.buf.ptr()),
                if norm.is_some() { 0 } else { sc.go.ptr() },
                // the verify record written by the kernel itself (no gdn_rec_write launch), or
                // its pieces for gdn_rec_write
                rec.map(|r| {
                    if rec_fused {
                        kc::GdnSide::Record(r)
                    } else {
                        kc::GdnSide::Bufs {
                            k: sc.gk.ptr(),
                            v: sc.gv.ptr(),
                            beta: sc.gbeta.ptr(),
                            g: sc.gg.ptr(),
                        }
                    }
                }),
                snap,
                norm,
            )
            .map_err(be)?;
            if !rec_fused {
                Self::gdn_record(g, sc, mixed, (hk, hv, dk, dv), n, rec)?;
            }
            if let Some(acts) = norm.and_then(|m| m.p16) {
                return self.proj_b1p(&[(&w.ssm_out, x)], n, true, acts);
            }
            if norm.is_some() {
                return self.proj(sc, &w.ssm_out, n, x, true);
            }
            return self.gdn_out(sc, cfg, w, z, x, n);
        }
        if snap.is_some() {
            return Err(Error::Backend(
                "gdn: a snapshot side output needs the fused decode / verify kernel".into(),
            ));
        }
        let conv = if prefill {
            kc::Gpu::gdn_conv_rows
        } else {
            kc::Gpu::gdn_conv
        };
        conv(
            g,
            mixed,
            st.conv.ptr(),
            w.conv1d.buf.ptr(),
            cfg.ssm_conv_kernel,
            hk,
            hv,
            dk,
            n,
            eps,
            sc.gq.ptr(),
            sc.gk.ptr(),
            sc.gv.ptr(),
            bb,
            aa,
            w.dt_bias.buf.ptr(),
            w.ssm_a.buf.ptr(),
            sc.gbeta.ptr(),
            sc.gg.ptr(),
        )
        .map_err(be)?;
        Self::gdn_record(g, sc, mixed, (hk, hv, dk, dv), n, rec)?;
        // Prefill runs the recurrence row by row, or in chunks of 64 rows when chosen
        // (`Gpu::set_gdn_prefill`) and the head has that kernel (dk = dv = 128); both equal the
        // decode kernel within f32 rounding, and decode / verify never take them.
        let step = if !prefill {
            kc::Gpu::gdn_step
        } else if g.gdn_prefill() != kc::GdnPrefill::RowByRow && kc::gdn_chunked_supported(dk, dv) {
            kc::Gpu::gdn_step_chunked
        } else {
            kc::Gpu::gdn_step_seq
        };
        step(
            g,
            st.s.ptr(),
            sc.gq.ptr(),
            sc.gk.ptr(),
            sc.gv.ptr(),
            sc.gg.ptr(),
            sc.gbeta.ptr(),
            hk,
            hv,
            dk,
            dv,
            n,
            sc.go.ptr(),
        )
        .map_err(be)?;
        self.gdn_out(sc, cfg, w, z, x, n)
    }

    /// Whether an n-row GDN launch outside prefill runs the fused conv + recurrence kernel
    /// (`Gpu::gdn_conv_step`): its mode is on, it has the head shape, and n ≤ 8.
    fn gdn_fused_path(&self, cfg: &TargetConfig, n: usize) -> bool {
        let (hk, hv, dk) = (cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state);
        self.gpu.gdn_fused() != kc::GdnFused::Off
            && kc::gdn_fused_supported(hk, hv, dk, cfg.ssm_head_v_dim(), cfg.ssm_conv_kernel)
            && n <= MV_ROWS
    }

    /// `gdn_replay` of one layer over the first `n` rows of its record (checked by the callers):
    /// in place, or with `src` (the round's snapshot) read and `dst` written — the restore and
    /// the replay in one launch.
    fn replay_layer(
        &self,
        cfg: &TargetConfig,
        dst: &CudaGdn,
        src: Option<&CudaGdn>,
        rec: &CudaAct,
        n: usize,
    ) -> Result<()> {
        if let Some(s) = src {
            snap_fits("gdn_replay", s, dst)?;
        }
        self.gpu
            .gdn_replay(
                dst.s.ptr(),
                dst.conv.ptr(),
                src.map(|s| (s.s.ptr(), s.conv.ptr())),
                rec.buf.ptr(),
                gdn_rec_width(cfg),
                cfg.ssm_n_group,
                cfg.ssm_dt_rank,
                cfg.ssm_d_state,
                cfg.ssm_head_v_dim(),
                cfg.ssm_conv_kernel,
                n,
            )
            .map_err(be)
    }

    /// With `rec` (a verify), each row's record `[n, gdn_rec_width]`: pre-conv `mixed` ‖ the
    /// L2-normed k ‖ v ‖ g (log-decay) ‖ β, from the conv's outputs in the scratch.
    fn gdn_record(
        g: &kc::Gpu,
        sc: &Scratch,
        mixed: u64,
        (hk, hv, dk, dv): (usize, usize, usize, usize),
        n: usize,
        rec: Option<u64>,
    ) -> Result<()> {
        let Some(rec) = rec else {
            return Ok(());
        };
        g.gdn_rec_write(
            mixed,
            sc.gk.ptr(),
            sc.gv.ptr(),
            sc.gg.ptr(),
            sc.gbeta.ptr(),
            hk,
            hv,
            dk,
            dv,
            n,
            rec,
        )
        .map_err(be)
    }

    /// A GDN layer's tail: the gated norm of the recurrence's output `sc.go` (quantized for the
    /// out-projection), then `x += ssm_out(·)`.
    fn gdn_out(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        z: u64,
        x: u64,
        n: usize,
    ) -> Result<()> {
        let (hv, dv) = (cfg.ssm_dt_rank, cfg.ssm_head_v_dim());
        self.gpu
            .gated_norm_quant(
                sc.go.ptr(),
                z,
                w.ssm_norm.buf.ptr(),
                cfg.rms_eps,
                n,
                hv,
                dv,
                Self::f32_input(sc, &[&w.ssm_out]),
                sc.xq.ptr(),
                sc.xd.ptr(),
                sc.xs.ptr(),
            )
            .map_err(be)?;
        self.proj(sc, &w.ssm_out, n, x, true)
    }

    fn attn_impl(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &AttnWeights<Self>,
        kv: &CudaKv,
        x: u64,
        n: usize,
    ) -> Result<()> {
        let e = cfg.n_embd;
        let eps = cfg.rms_eps;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let p16 = self.norm_in(sc, x, &w.attn_norm, eps, n, e, &[&w.q, &w.k, &w.v])?;
        let [qf, kf, vf] = [sc.p[0].ptr(), sc.p[1].ptr(), sc.p[2].ptr()];
        self.proj_multi_p16(sc, &[(&w.q, qf), (&w.k, kf), (&w.v, vf)], n, false, p16)?;
        let g = &self.gpu;
        let k = nh * hd;
        g.attn_prep(
            qf,
            kf,
            vf,
            w.q_norm.buf.ptr(),
            w.k_norm.buf.ptr(),
            eps,
            n,
            nh,
            nkv,
            hd,
            cfg.n_rot,
            cfg.rope_base,
            sc.pos.ptr(),
            sc.qo.ptr(),
            kv.k.ptr(),
            kv.v.ptr(),
        )
        .map_err(be)?;
        if n > MV_ROWS {
            // prefill: one causal flash-attention launch over all rows
            g.attn_prefill(
                sc.qo.ptr(),
                qf,
                kv.k.ptr(),
                kv.v.ptr(),
                n,
                nh,
                nkv,
                hd,
                sc.pos.ptr(),
                // the f32 output only for an f32 out-projection (copied into xf below)
                if w.out.kind == WKind::F32 {
                    sc.att.ptr()
                } else {
                    0
                },
                sc.xq.ptr(),
                sc.xd.ptr(),
                sc.xs.ptr(),
            )
            .map_err(be)?;
        }
        let mut t0 = if n > MV_ROWS { n } else { 0 };
        while t0 < n {
            let nr = (n - t0).min(MV_ROWS);
            // attention ⊙ gate, f32 into att and int8-quantized into the projection input
            g.attn_decode(
                sc.qo.at(t0 * k * 4),
                qf + (t0 * nh * 2 * hd * 4) as u64,
                kv.k.ptr(),
                kv.v.ptr(),
                nr,
                nh,
                nkv,
                hd,
                sc.pos.at(t0 * 4),
                sc.scores_ctx,
                sc.scores.ptr(),
                sc.att.at(t0 * k * 4),
                sc.xq.at(t0 * k),
                sc.xd.at(t0 * k / 32 * 4),
                sc.xs.at(t0 * k / 32 * 4),
            )
            .map_err(be)?;
            t0 += nr;
        }
        // f32 copy of the attention output for non-low-bit out-projections
        if w.out.kind == WKind::F32 {
            g.dtod(sc.xf.ptr(), sc.att.ptr(), n * nh * hd * 4)
                .map_err(be)?;
        }
        self.proj(sc, &w.out, n, x, true)
    }

    fn mlp_impl(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &MlpWeights<Self>,
        x: u64,
        n: usize,
    ) -> Result<()> {
        let p16 = self.norm_in(
            sc,
            x,
            &w.post_norm,
            cfg.rms_eps,
            n,
            cfg.n_embd,
            &[&w.gate, &w.up],
        )?;
        let [gt, up] = [sc.p[0].ptr(), sc.p[1].ptr()];
        let (g, u) = (&w.gate, &w.up);
        if n == 1
            && g.kind != WKind::F32
            && g.kind == u.kind
            && (g.n_in, g.n_out) == (u.n_in, u.n_out)
            && g.n_out == cfg.n_ff
        {
            // decode: the SwiGLU inside the gate‖up launch, into p[2] (codes) and p[3] (scales,
            // then sums): its activations in xq are still being read while it writes
            let nb = cfg.n_ff / 32;
            let out = kc::QuantOut {
                f: Self::f32_input(sc, &[&w.down]),
                q: sc.p[2].ptr(),
                d: sc.p[3].ptr(),
                s: sc.p[3].at((nb * 4).next_multiple_of(16)),
            };
            if let (true, true, Some(gl), Some(ul)) =
                (p16, self.gpu.b1p(), g.b1p.as_ref(), u.b1p.as_ref())
            {
                // b1-plane gate‖up with the SwiGLU inside (else: the b1-plane mat-vec below, then
                // swiglu_quant, the same bits); with a b1-plane ffn_down, the SwiGLU written as
                // b1-plane activations into the one-row y buffers (xp is still being read)
                let down_p16 = self.b1p_out_for(sc, &w.down, 1).then(|| kc::P16Out {
                    xp: sc.yp.ptr(),
                    xu: sc.yu.ptr(),
                    xs: sc.ysum.ptr(),
                    xv: 0,
                });
                if self
                    .gpu
                    .mv_swiglu_b1p(
                        gl.planes,
                        (gl.codes.ptr(), gl.scales.ptr()),
                        (ul.codes.ptr(), ul.scales.ptr()),
                        cfg.n_ff,
                        g.n_in,
                        (sc.xp.ptr(), sc.xu.ptr(), sc.xsum.ptr()),
                        out,
                        down_p16,
                    )
                    .map_err(be)?
                {
                    return match down_p16 {
                        Some(acts) => self.proj_b1p(&[(&w.down, x)], 1, true, acts),
                        None => self.proj_from(sc, &w.down, 1, x, true, (out.q, out.d, out.s)),
                    };
                }
            } else if let (Ok(gd), Ok(ud)) = (g.dp4a(), u.dp4a()) {
                // (a projection held only in its b1-plane layout takes proj_multi_p16 below)
                if self
                    .gpu
                    .mv_swiglu(
                        g.kind,
                        gd,
                        ud,
                        cfg.n_ff,
                        g.n_in,
                        (sc.xq.ptr(), sc.xd.ptr(), sc.xs.ptr()),
                        out,
                    )
                    .map_err(be)?
                {
                    return self.proj_from(sc, &w.down, 1, x, true, (out.q, out.d, out.s));
                }
            }
        }
        self.proj_multi_p16(sc, &[(g, gt), (u, up)], n, false, p16)?;
        if self.b1p_out_for(sc, &w.down, n) {
            // ffn_down on the b1-plane kernels (gate‖up are done reading xp)
            let acts = Self::p16_acts(sc, n, self.b1q_rows(n));
            self.gpu
                .swiglu_quant_p16(gt, up, n, cfg.n_ff, Self::f32_input(sc, &[&w.down]), acts)
                .map_err(be)?;
            return self.proj_b1p(&[(&w.down, x)], n, true, acts);
        }
        self.gpu
            .swiglu_quant(
                gt,
                up,
                n,
                cfg.n_ff,
                Self::f32_input(sc, &[&w.down]),
                sc.xq.ptr(),
                sc.xd.ptr(),
                sc.xs.ptr(),
            )
            .map_err(be)?;
        self.proj(sc, &w.down, n, x, true)
    }

    fn embed_impl(&self, table: &CudaMat, ids: u64, n: usize, x: u64) -> Result<()> {
        let (codes, scales, f32tab) = match table.kind {
            WKind::F32 => (0, 0, table.dp4a()?.0),
            _ => {
                let (c, sc) = table.dp4a()?;
                (c, sc, 0)
            }
        };
        self.gpu
            .embed_rows(
                table.kind,
                codes,
                scales,
                f32tab,
                ids,
                n,
                table.n_out,
                table.n_in,
                x,
            )
            .map_err(be)
    }

    /// Norm + head for `nr ≤ 8` rows of x starting at `x`, logits into scratch `logits`.
    fn head_impl(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        norm: &CudaVec,
        out: &CudaMat,
        x: u64,
        nr: usize,
    ) -> Result<()> {
        let p16 = self.norm_in(sc, x, norm, cfg.rms_eps, nr, cfg.n_embd, &[out])?;
        self.proj_multi_p16(sc, &[(out, sc.logits.ptr())], nr, false, p16)
    }

    /// Greedy decode of `steps` tokens after the committed state, eagerly (no graph), with the
    /// argmax on the device. Returns the tokens. `first` is the token at position `st.pos`.
    pub fn greedy_eager(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        first: u32,
        steps: usize,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(steps);
        let mut tok = first;
        let x = self.new_act(1, cfg.n_embd);
        for _ in 0..steps {
            if st.pos + 1 > st.n_ctx {
                return Err(Error::ContextOverflow("greedy_eager".into()));
            }
            self.with_scratch(cfg, 1, |sc| {
                self.gpu.htod(&sc.ids, 0, &[tok as i32]).map_err(be)?;
                self.set_pos(sc, st.pos, 1)?;
                self.step_body(sc, cfg, w, st, x.buf.ptr())?;
                let mut id = [0i32];
                self.gpu.dtoh(&sc.amax, 0, &mut id).map_err(be)?;
                tok = id[0] as u32;
                Ok(())
            })?;
            st.pos += 1;
            for kv in &mut st.kv {
                kv.len = st.pos;
            }
            out.push(tok);
        }
        Ok(out)
    }

    /// The device work of one n = 1 decode step reading the token from `sc.ids[0]` and the
    /// position from `sc.pos[0]`; ends with argmax into `sc.amax[0]`. No host synchronization, so
    /// it can be captured. Does not touch host-side bookkeeping.
    fn step_body(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        x: u64,
    ) -> Result<()> {
        self.step_logits(sc, cfg, w, st, x)?;
        self.gpu
            .argmax_rows(sc.logits.ptr(), 1, cfg.n_vocab, sc.amax.ptr())
            .map_err(be)?;
        // next step's input token = this step's argmax
        self.gpu.dtod(sc.ids.ptr(), sc.amax.ptr(), 4).map_err(be)
    }

    /// The device work of one n = 1 step up to the logits: token from `sc.ids[0]`, position from
    /// `sc.pos[0]`, logits row into `sc.logits[0]`. The same launches, in the same order, as the
    /// eager `forward` over one row. No host synchronization (capturable).
    fn step_logits(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        x: u64,
    ) -> Result<()> {
        self.embed_impl(&w.tok_embd, sc.ids.ptr(), 1, x)?;
        let (mut ia, mut ig) = (0, 0);
        for layer in &w.layers {
            match &layer.mixer {
                Mixer::Gdn(gw) => {
                    self.gdn_impl(sc, cfg, gw, &mut st.gdn[ig], x, 1)?;
                    ig += 1;
                }
                Mixer::Attn(aw) => {
                    self.attn_impl(sc, cfg, aw, &st.kv[ia], x, 1)?;
                    ia += 1;
                }
            }
            self.mlp_impl(sc, cfg, &layer.mlp, x, 1)?;
        }
        self.head_impl(sc, cfg, &w.output_norm, w.head_mat(), x, 1)
    }

    /// What a captured plain decode step depends on: the scratch generation, the context size,
    /// the model scalars baked into the launches, the weight set ([`Weights::id`]: a graph bakes
    /// in every weight buffer, and a freed buffer's address comes back for another tensor when
    /// weights are reloaded, so keying on some addresses could replay a graph that reads freed
    /// memory) and the addresses of the per-sequence state.
    fn step_key(cfg: &TargetConfig, w: &Weights<Self>, st: &SeqState<Self>, gen: u64) -> Vec<u64> {
        let mut k = vec![
            gen,
            st.n_ctx as u64,
            cfg.rms_eps.to_bits() as u64,
            cfg.rope_base.to_bits() as u64,
            cfg.n_rot as u64,
            cfg.ssm_conv_kernel as u64,
            w.id,
        ];
        for kv in &st.kv {
            k.extend([kv.k.ptr(), kv.v.ptr()]);
        }
        for g in &st.gdn {
            k.extend([g.conv.ptr(), g.s.ptr()]);
        }
        k
    }

    /// Capture [`Backend::decode_step`]'s device work as one graph (see [`StepGraph`]), with or
    /// without the copy of the logits row to pinned memory (`with_row`).
    fn capture_step(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        key: Vec<u64>,
        out: StepOut,
    ) -> Result<StepGraph> {
        let nv = cfg.n_vocab;
        let x = self.new_act(1, cfg.n_embd);
        let input = self.gpu.alloc_pinned(8).map_err(be)?;
        let logits = if out == StepOut::Row {
            Some(self.gpu.alloc_pinned(nv * 4).map_err(be)?)
        } else {
            None
        };
        let top = if out == StepOut::Top {
            Some((
                self.gpu.alloc(kc::TOPK_ROW * 8).map_err(be)?,
                self.gpu.alloc_pinned(kc::TOPK_ROW * 8).map_err(be)?,
            ))
        } else {
            None
        };
        let stats_dev = self.gpu.alloc(16).map_err(be)?;
        let stats = self.gpu.alloc_pinned(16).map_err(be)?;
        self.gpu.sync().map_err(be)?;
        self.gpu.begin_capture().map_err(be)?;
        let r = (|| {
            let g = &self.gpu;
            g.htod_pinned_async(sc.ids.ptr(), &input, 0, 4)
                .map_err(be)?;
            g.htod_pinned_async(sc.pos.ptr(), &input, 4, 4)
                .map_err(be)?;
            self.step_logits(sc, cfg, w, st, x.buf.ptr())?;
            g.logit_stats_rows(sc.logits.ptr(), 1, nv, stats_dev.ptr())
                .map_err(be)?;
            if let Some(logits) = &logits {
                g.dtoh_pinned_async(logits, 0, sc.logits.ptr(), nv * 4)
                    .map_err(be)?;
            }
            if let Some((dev, host)) = &top {
                g.topk_rows(sc.logits.ptr(), 1, nv, dev.ptr()).map_err(be)?;
                g.dtoh_pinned_async(host, 0, dev.ptr(), kc::TOPK_ROW * 8)
                    .map_err(be)?;
            }
            g.dtoh_pinned_async(&stats, 0, stats_dev.ptr(), 16)
                .map_err(be)
        })();
        let graph = self.gpu.end_capture().map_err(be);
        sc.pos_host = None;
        r?;
        Ok(StepGraph {
            key,
            graph: graph?,
            _x: x,
            input,
            logits,
            top,
            _stats_dev: stats_dev,
            stats,
        })
    }

    /// Capture the launches `body` queues (no host synchronization inside) as one graph. The
    /// stream is drained first; a failed body still ends the capture.
    fn capture_graph(&self, body: impl FnOnce() -> Result<()>) -> Result<kc::Graph> {
        self.gpu.sync().map_err(be)?;
        self.gpu.begin_capture().map_err(be)?;
        let r = body();
        let graph = self.gpu.end_capture().map_err(be);
        r?;
        graph
    }

    /// The two device copies of one GDN layer's state (conv window, then S): the eager
    /// [`Backend::copy_gdn`] and the snapshot / rollback graphs.
    fn copy_gdn_state(&self, src: &CudaGdn, dst: &CudaGdn) -> Result<()> {
        self.copy_gdn_ptrs(src.ptrs(), dst.ptrs())
    }

    /// [`Self::copy_gdn_state`] on addresses (`src`'s sizes).
    fn copy_gdn_ptrs(&self, src: GdnPtrs, dst: GdnPtrs) -> Result<()> {
        self.gpu
            .dtod(dst.conv, src.conv, src.conv_bytes)
            .map_err(be)?;
        self.gpu.dtod(dst.s, src.s, src.s_bytes).map_err(be)
    }

    fn alloc_round_io(&self, n_embd: usize, n_vocab: usize, tap_slots: usize) -> Result<RoundIo> {
        let g = &self.gpu;
        let tap_bytes = tap_slots * MV_ROWS * n_embd * 4;
        Ok(RoundIo {
            n_embd,
            n_vocab,
            tap_slots,
            x: CudaAct {
                n: MV_ROWS,
                width: n_embd,
                buf: g.alloc(MV_ROWS * n_embd * 4).map_err(be)?,
            },
            input: g.alloc_pinned(2 * MV_ROWS * 4).map_err(be)?,
            logits: g.alloc_pinned(MV_ROWS * n_vocab * 4).map_err(be)?,
            stats_dev: g.alloc(MV_ROWS * 16).map_err(be)?,
            stats: g.alloc_pinned(MV_ROWS * 16).map_err(be)?,
            top_dev: g.alloc(MV_ROWS * kc::TOPK_ROW * 8).map_err(be)?,
            top: g.alloc_pinned(MV_ROWS * kc::TOPK_ROW * 8).map_err(be)?,
            taps_dev: g.alloc(tap_bytes).map_err(be)?,
            taps: g.alloc_pinned(tap_bytes).map_err(be)?,
        })
    }

    /// The device work of one verify pass over `n ≤ 8` rows (captured by
    /// [`Self::verify_graph`]): ids and positions from `io.input` into the device slots, then the
    /// launches of the eager `model::forward` over the same rows in the same order (embed; per
    /// layer the mixer — GDN with its verify record into `recs[i]` — and the MLP; after each
    /// tapped layer one 2D copy of its n rows into `io.taps_dev`), the head over the n rows, the
    /// per-row logit statistics, and async copies of logits (only with `rows`), statistics and
    /// (with `taps_host`) taps to pinned memory. No host synchronization (capturable).
    #[allow(clippy::too_many_arguments)]
    fn verify_body(
        &self,
        sc: &mut Scratch,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        io: &RoundIo,
        recs: &[u64],
        snaps: &[SnapPair],
        tap_layers: &[usize],
        taps_host: bool,
        n: usize,
        out: StepOut,
    ) -> Result<()> {
        let g = &self.gpu;
        let (e, nv) = (cfg.n_embd, cfg.n_vocab);
        let tw = tap_layers.len() * e; // a row's taps
        let x = io.x.buf.ptr();
        g.htod_pinned_async(sc.ids.ptr(), &io.input, 0, n * 4)
            .map_err(be)?;
        g.htod_pinned_async(sc.pos.ptr(), &io.input, MV_ROWS * 4, n * 4)
            .map_err(be)?;
        self.embed_impl(&w.tok_embd, sc.ids.ptr(), n, x)?;
        let (mut ia, mut ig) = (0, 0);
        for (il, layer) in w.layers.iter().enumerate() {
            match &layer.mixer {
                Mixer::Gdn(gw) => {
                    let snap = snaps.get(ig).map(|p| (p.snap.s, p.snap.conv));
                    self.gdn_impl_rec(sc, cfg, gw, &mut st.gdn[ig], x, n, Some(recs[ig]), snap)?;
                    ig += 1;
                }
                Mixer::Attn(aw) => {
                    self.attn_impl(sc, cfg, aw, &st.kv[ia], x, n)?;
                    ia += 1;
                }
            }
            self.mlp_impl(sc, cfg, &layer.mlp, x, n)?;
            // taps [n, n_taps·e]: row t's tap j at columns j·e..
            for (j, _) in tap_layers.iter().enumerate().filter(|(_, &l)| l == il) {
                g.dtod_2d(io.taps_dev.at(j * e * 4), tw * 4, x, e * 4, e * 4, n)
                    .map_err(be)?;
            }
        }
        self.head_impl(sc, cfg, &w.output_norm, w.head_mat(), x, n)?;
        g.logit_stats_rows(sc.logits.ptr(), n, nv, io.stats_dev.ptr())
            .map_err(be)?;
        match out {
            StepOut::Row => g
                .dtoh_pinned_async(&io.logits, 0, sc.logits.ptr(), n * nv * 4)
                .map_err(be)?,
            StepOut::Top => {
                g.topk_rows(sc.logits.ptr(), n, nv, io.top_dev.ptr())
                    .map_err(be)?;
                g.dtoh_pinned_async(&io.top, 0, io.top_dev.ptr(), n * kc::TOPK_ROW * 8)
                    .map_err(be)?;
            }
            StepOut::Stats => {}
        }
        g.dtoh_pinned_async(&io.stats, 0, io.stats_dev.ptr(), n * 16)
            .map_err(be)?;
        if !tap_layers.is_empty() && taps_host {
            g.dtoh_pinned_async(&io.taps, 0, io.taps_dev.ptr(), n * tw * 4)
                .map_err(be)?;
        }
        Ok(())
    }

    /// [`Backend::verify_forward`] through a captured graph (see [`RoundGraphs`]): captured at the
    /// first call for a key, replayed afterwards. Checked by `tests/cuda_round_graph.rs`.
    ///
    /// With `rows_needed == false` the graph without the logits copy runs, and `logits` stays
    /// empty when every row's statistics are usable; otherwise (a NaN / −inf row) the rows are
    /// copied synchronously from the scratch logits, which still hold them after the replay (the
    /// scratch lock is held throughout, so nothing overwrites them in between).
    #[allow(clippy::too_many_arguments)]
    fn verify_graph(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        ids: &[u32],
        recs: &mut [CudaAct],
        tap_layers: &[usize],
        tap_out: Option<&mut Vec<f32>>,
        logits: &mut Vec<f32>,
        rows_needed: bool,
        top: Option<RowTops<'_>>,
        snaps: &[SnapPair],
    ) -> Result<Vec<Option<LogitStats>>> {
        let out = StepOut::of(rows_needed, top.is_some());
        let n = ids.len();
        let (e, nv) = (cfg.n_embd, cfg.n_vocab);
        // the checks of model::forward and of the eager blocks, before anything is queued
        if st.pos + n > st.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "{} positions requested, context is {}",
                st.pos + n,
                st.n_ctx
            )));
        }
        if let Some(&bad) = ids
            .iter()
            .find(|&&t| t as usize >= nv || t as usize >= w.tok_embd.n_out)
        {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} out of range (n_vocab {nv})"
            )));
        }
        if w.head_mat().n_out != nv {
            return Err(Error::Backend(format!(
                "head has {} rows, n_vocab is {nv}",
                w.head_mat().n_out
            )));
        }
        if let Some(kv) = st
            .kv
            .iter()
            .find(|kv| kv.len != st.pos || st.pos + n > kv.n_ctx)
        {
            return Err(Error::Backend(format!(
                "KV cache holds {} of {} rows, verify of {n} rows starts at {}",
                kv.len, kv.n_ctx, st.pos
            )));
        }
        let width = gdn_rec_width(cfg);
        if recs.len() != st.gdn.len()
            || recs
                .iter()
                .any(|r| r.width != width || r.buf.bytes() < n * width * 4)
        {
            return Err(Error::Backend(format!(
                "verify_forward: {} records for {} GDN layers, each needs {n} rows of width {width}",
                recs.len(),
                st.gdn.len()
            )));
        }
        let n_taps = tap_layers.len();
        let taps_host = self.verify_taps_on_host();
        let mut guard = self.round_graphs.lock().expect("round graph lock");
        let rg = &mut *guard;
        if rg
            .io
            .as_ref()
            .is_none_or(|io| io.n_embd != e || io.n_vocab != nv || io.tap_slots < n_taps)
        {
            // every verify graph bakes in the old buffers
            rg.graphs.clear();
            rg.io = None;
            rg.io = Some(self.alloc_round_io(e, nv, n_taps.max(8))?);
        }
        let RoundGraphs { io, graphs } = rg;
        let io = io.as_mut().expect("round io");
        let stats = self.with_scratch(cfg, n, |sc| {
            let recp: Vec<u64> = recs.iter().map(|r| r.buf.ptr()).collect();
            // the kind tag first (the copy and rollback keys start with theirs)
            let mut key = vec![KEY_VERIFY, n as u64];
            key.extend(self.gpu.launch_mode_key());
            key.push(self.rec_fused() as u64);
            key.extend([
                io.x.buf.ptr(),
                io.stats_dev.ptr(),
                io.taps_dev.ptr(),
                n_taps as u64,
                taps_host as u64,
                out as u64,
            ]);
            key.extend(tap_layers.iter().map(|&l| l as u64));
            key.extend(&recp);
            // the snapshot side outputs (their addresses are baked in too)
            key.push(snaps.len() as u64);
            key.extend(snaps.iter().flat_map(|p| [p.snap.s, p.snap.conv]));
            key.extend(Self::step_key(cfg, w, st, sc.gen));
            let io_ref: &RoundIo = io;
            let idx = cached_graph(graphs, key, || {
                self.capture_graph(|| {
                    self.verify_body(
                        sc, cfg, w, st, io_ref, &recp, snaps, tap_layers, taps_host, n, out,
                    )
                })
            })?;
            for (t, &id) in ids.iter().enumerate() {
                io.input.set_i32(t, id as i32);
                io.input.set_i32(MV_ROWS + t, (st.pos + t) as i32);
            }
            // the graph overwrites the device position slots
            sc.pos_host = None;
            self.gpu.launch_graph(&graphs[idx].1).map_err(be)?;
            self.gpu.sync().map_err(be)?;
            let stats = io
                .stats
                .u32s(4 * n)
                .chunks_exact(4)
                .map(|words| {
                    let r = kc::LogitRowStats::from_words(words);
                    r.argmax.map(|argmax| LogitStats {
                        argmax,
                        max: r.max,
                        lse: r.lse,
                    })
                })
                .collect::<Vec<_>>();
            logits.clear();
            let mut served = self.rows_skippable(&stats, n, nv);
            if let Some((n_top, tops)) = top {
                tops.clear();
                if served {
                    let words = io.top.u32s(n * kc::TOPK_ROW * 2);
                    tops.extend(
                        words
                            .chunks_exact(kc::TOPK_ROW * 2)
                            .map(|w| kc::topk_from_words(w, nv)),
                    );
                    served = tops.iter().all(|t| t.len() >= n_top.min(nv));
                }
                if !served {
                    tops.clear();
                }
            }
            if out == StepOut::Row {
                logits.extend_from_slice(io.logits.f32s(n * nv));
            } else if !served {
                // a row-less graph ran: the rows are still in the scratch logits
                logits.resize(n * nv, 0.0);
                self.gpu.dtoh(&sc.logits, 0, &mut logits[..]).map_err(be)?;
            }
            Ok(stats)
        })?;
        if let Some(out) = tap_out {
            // [row][j][e] (TapRequest's layout) on the device; on the host too unless they stay
            out.clear();
            if taps_host {
                out.extend_from_slice(io.taps.f32s(n * n_taps * e));
            } else if n_taps > 0 {
                *self.verify_taps.lock().expect("verify taps lock") =
                    Some((io.taps_dev.ptr(), n, n_taps * e));
            }
        }
        for r in recs.iter_mut() {
            r.n = n;
        }
        st.pos += n;
        for kv in &mut st.kv {
            kv.len = st.pos;
        }
        Ok(stats)
    }

    /// Capture one greedy decode step as a CUDA graph. The graph reads the token from the device
    /// id slot and the position from the device position slot, and advances both itself, so
    /// [`CudaBackend::run_graph`] can replay it back to back with no host round trip.
    pub fn capture_decode(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
    ) -> Result<DecodeGraph> {
        let x = self.new_act(1, cfg.n_embd);
        let hist_len = st.n_ctx + 1;
        let hist = self.gpu.alloc(hist_len * 4).map_err(be)?;
        let graph = self.with_scratch(cfg, 1, |sc| {
            // make sure nothing else is pending, then capture
            self.gpu.sync().map_err(be)?;
            self.gpu.begin_capture().map_err(be)?;
            let r = self.step_body(sc, cfg, w, st, x.buf.ptr());
            let r2 = r.and_then(|_| {
                self.gpu
                    .step_advance(sc.pos.ptr(), sc.amax.ptr(), hist.ptr(), hist_len)
                    .map_err(be)
            });
            let g = self.gpu.end_capture().map_err(be);
            r2?;
            sc.pos_host = None;
            g
        })?;
        Ok(DecodeGraph {
            graph,
            hist,
            hist_len,
            _x: x,
        })
    }

    /// Replay a captured decode graph `steps` times starting from token `first` at `st.pos`.
    /// Returns the generated tokens; advances `st`.
    pub fn run_graph(
        &self,
        cfg: &TargetConfig,
        dg: &DecodeGraph,
        st: &mut SeqState<Self>,
        first: u32,
        steps: usize,
    ) -> Result<Vec<u32>> {
        if st.pos + steps > st.n_ctx || st.pos + steps >= dg.hist_len {
            return Err(Error::ContextOverflow("run_graph".into()));
        }
        self.with_scratch(cfg, 1, |sc| {
            self.gpu.htod(&sc.ids, 0, &[first as i32]).map_err(be)?;
            self.gpu.htod(&sc.pos, 0, &[st.pos as i32]).map_err(be)?;
            sc.pos_host = None;
            for _ in 0..steps {
                self.gpu.launch_graph(&dg.graph).map_err(be)?;
            }
            self.gpu.sync().map_err(be)
        })?;
        let mut h = vec![0i32; steps];
        self.gpu.dtoh(&dg.hist, st.pos * 4, &mut h).map_err(be)?;
        st.pos += steps;
        for kv in &mut st.kv {
            kv.len = st.pos;
        }
        Ok(h.into_iter().map(|t| t as u32).collect())
    }

    /// Time `steps` graph replays (GPU time, ms), no host round trip inside.
    pub fn time_graph(
        &self,
        cfg: &TargetConfig,
        dg: &DecodeGraph,
        st: &mut SeqState<Self>,
        first: u32,
        steps: usize,
    ) -> Result<(f32, Vec<u32>)> {
        if st.pos + steps > st.n_ctx || st.pos + steps >= dg.hist_len {
            return Err(Error::ContextOverflow("time_graph".into()));
        }
        let ms = self.with_scratch(cfg, 1, |sc| {
            self.gpu.htod(&sc.ids, 0, &[first as i32]).map_err(be)?;
            self.gpu.htod(&sc.pos, 0, &[st.pos as i32]).map_err(be)?;
            sc.pos_host = None;
            self.gpu
                .time_ms(|| {
                    for _ in 0..steps {
                        self.gpu.launch_graph(&dg.graph)?;
                    }
                    Ok(())
                })
                .map_err(be)
        })?;
        let mut h = vec![0i32; steps];
        self.gpu.dtoh(&dg.hist, st.pos * 4, &mut h).map_err(be)?;
        st.pos += steps;
        for kv in &mut st.kv {
            kv.len = st.pos;
        }
        Ok((ms, h.into_iter().map(|t| t as u32).collect()))
    }

    /// GPU time (ms) of one pass that launches, back to back, one mat-vec (n = 1) per entry of
    /// `groups` (each entry one grouped launch over its matrices, outputs into scratch). Matrices
    /// are taken in order, so a pass over all layers reads more than the L2 holds. For profiling.
    pub fn time_mv_pass(
        &self,
        cfg: &TargetConfig,
        groups: &[Vec<&CudaMat>],
        reps: usize,
    ) -> Result<Vec<f32>> {
        self.time_mv_pass_n(cfg, groups, 1, reps)
    }

    /// [`Self::time_mv_pass`] with `n` (1..=8) activation rows per launch (n = 5: the cost of a
    /// speculative verify's mat-vecs), on whatever the scratch input holds (int8 codes, or the
    /// b1-plane activations for projections held only in that layout). Outputs that do not fit
    /// a scratch projection buffer (the head) go to the logits buffer.
    pub fn time_mv_pass_n(
        &self,
        cfg: &TargetConfig,
        groups: &[Vec<&CudaMat>],
        n: usize,
        reps: usize,
    ) -> Result<Vec<f32>> {
        if !(1..=MV_ROWS).contains(&n) {
            return Err(Error::Backend(format!("time_mv_pass_n: n = {n}")));
        }
        self.with_scratch(cfg, MV_ROWS, |sc| {
            let outs = [sc.p[0].ptr(), sc.p[1].ptr(), sc.p[2].ptr(), sc.p[3].ptr()];
            let mut times = Vec::with_capacity(reps);
            for _ in 0..reps {
                let ms = self
                    .gpu
                    .time_ms(|| {
                        for g in groups {
                            let mats: Vec<(&CudaMat, u64)> = g
                                .iter()
                                .zip(outs)
                                .map(|(&m, y)| {
                                    if n * m.n_out > sc.kmax.max(sc.p[0].bytes() / 4) {
                                        (m, sc.logits.ptr())
                                    } else {
                                        (m, y)
                                    }
                                })
                                .collect();
                            // projections held only in the b1-plane layout: the b1-plane kernels
                            // the step and the verify run (on whatever the planes hold)
                            if mats.iter().any(|(m, _)| m.codes.is_none()) {
                                let acts = Self::p16_acts(sc, n, self.b1q_rows(n));
                                self.proj_b1p(&mats, n, false, acts)
                            } else {
                                self.proj_multi(sc, &mats, n, false)
                            }
                            .map_err(|e| kc::CudaError(e.to_string()))?;
                        }
                        Ok(())
                    })
                    .map_err(be)?;
                times.push(ms);
            }
            Ok(times)
        })
    }

    /// GPU time (ms) of one pass of `n`-row projections (prefill: the GEMM when `n` > 8), one
    /// grouped launch per entry of `groups` as `proj_multi` runs them, back to back, on
    /// whatever the scratch input holds; `reps` passes, each timed. Every matrix must fit the
    /// scratch outputs (not the head). For profiling.
    pub fn time_proj_pass(
        &self,
        cfg: &TargetConfig,
        groups: &[Vec<&CudaMat>],
        n: usize,
        reps: usize,
    ) -> Result<Vec<f32>> {
        self.with_scratch(cfg, n.max(MV_ROWS), |sc| {
            let cap_out = sc.p[0].bytes() / 4 / sc.cap;
            if let Some(m) = groups.iter().flatten().find(|m| m.n_out > cap_out) {
                return Err(Error::Backend(format!(
                    "time_proj_pass: {} outputs exceed the scratch",
                    m.n_out
                )));
            }
            let outs = [sc.p[0].ptr(), sc.p[1].ptr(), sc.p[2].ptr(), sc.p[3].ptr()];
            let mut times = Vec::with_capacity(reps);
            for _ in 0..reps {
                let ms = self
                    .gpu
                    .time_ms(|| {
                        for g in groups {
                            let mats: Vec<(&CudaMat, u64)> =
                                g.iter().zip(outs).map(|(&m, y)| (m, y)).collect();
                            self.proj_multi(sc, &mats, n, false)
                                .map_err(|e| kc::CudaError(e.to_string()))?;
                        }
                        Ok(())
                    })
                    .map_err(be)?;
                times.push(ms);
            }
            Ok(times)
        })
    }

    /// GPU time (ms) of `reps` passes of one eager n = 1 decode step body (no graph), each timed.
    pub fn time_step_eager(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        reps: usize,
    ) -> Result<Vec<f32>> {
        let x = self.new_act(1, cfg.n_embd);
        self.with_scratch(cfg, 1, |sc| {
            self.set_pos(sc, st.pos, 1)?;
            let mut v = Vec::new();
            for _ in 0..reps {
                let ms = self
                    .gpu
                    .time_ms(|| {
                        self.step_body(sc, cfg, w, st, x.buf.ptr())
                            .map_err(|e| kc::CudaError(e.to_string()))
                    })
                    .map_err(be)?;
                v.push(ms);
            }
            Ok(v)
        })
    }

    /// The code planes of the b1-plane layout a matrix `name` of type `qt` gets at load (the
    /// switches, the type and the shape), or `None`.
    fn b1p_planes_for(
        &self,
        name: &str,
        qt: QuantType,
        n_in: usize,
        n_out: usize,
    ) -> Option<usize> {
        let wanted = self.gpu.b1p()
            && (b1p_consumer(name) || (b1p_out_consumer(name) && self.gpu.b1p_out()))
            && kc::b1p_shape_ok(qt, n_in, n_out)
            && (qt == QuantType::Q1_0 || self.gpu.b2p());
        kc::b1p_planes(qt).filter(|_| wanted)
    }

    /// Whether norm-fed projections may be held only in their b1-plane layout: the prefill GEMM
    /// reads it ([`kc::Gpu::gemm_reads_b1p`], the sm_90a default) and `BONSAI_CUDA_B1P_DP4A=1`
    /// (keep both layouts, for A/B runs that switch the b1-plane kernels or the GEMM path off
    /// after load) is not set.
    fn b1p_only_ok(&self) -> bool {
        self.gpu.gemm_reads_b1p() && std::env::var("BONSAI_CUDA_B1P_DP4A").as_deref() != Ok("1")
    }

    /// Whether any matrix of `w` is held only in its b1-plane layout (then switching the b1-plane
    /// kernels or the prefill GEMM path off after load makes its projections fail).
    pub fn b1p_only(w: &Weights<Self>) -> bool {
        let mut any = w.head_mat().codes.is_none();
        for l in &w.layers {
            let mats: Vec<&CudaMat> = match &l.mixer {
                Mixer::Gdn(x) => vec![&x.qkv, &x.gate, &x.beta, &x.alpha],
                Mixer::Attn(x) => vec![&x.q, &x.k, &x.v],
            };
            any |= mats
                .into_iter()
                .chain([&l.mlp.gate, &l.mlp.up])
                .any(|m| m.codes.is_none());
        }
        any
    }

    /// Load one matrix: the dp4a layout (unless `b1p_only` and it gets a b1-plane layout) and,
    /// for the projections that take it, the b1-plane layout.
    fn load_mat_as(
        &self,
        g: &Arc<Gguf>,
        name: &str,
        n_in: usize,
        n_out: usize,
        b1p_only: bool,
    ) -> Result<CudaMat> {
        let (_, qt, data) = g.matrix(name, n_in, n_out)?;
        if qt.is_lowbit() && n_in % 64 != 0 {
            return Err(Error::tensor(name, "n_in must be a multiple of 64 on CUDA"));
        }
        let b1p = if self.b1p_planes_for(name, qt, n_in, n_out).is_some() {
            let t = kc::retile_b1p(qt, data, n_in, n_out);
            Some(B1pLayout {
                codes: self.gpu.upload(&t.codes).map_err(be)?,
                scales: self.gpu.upload(&t.scales).map_err(be)?,
                planes: t.planes,
            })
        } else {
            None
        };
        let kind = WKind::from_qt(qt);
        let (codes, scales) = if b1p_only && b1p.is_some() {
            (None, None)
        } else {
            let r = kc::retile(qt, data, n_in, n_out);
            if r.kind == WKind::F32 {
                (Some(self.gpu.upload(&r.f32data).map_err(be)?), None)
            } else {
                (
                    Some(self.gpu.upload(&r.codes).map_err(be)?),
                    Some(self.gpu.upload(&r.scales).map_err(be)?),
                )
            }
        };
        Ok(CudaMat {
            kind,
            n_in,
            n_out,
            codes,
            scales,
            b1p,
        })
    }

    /// Bytes of one layout of a matrix, what a step reads: the dp4a layout where it is held, else
    /// the b1-plane one.
    pub fn mat_bytes(m: &CudaMat) -> usize {
        match (&m.codes, &m.b1p) {
            (Some(c), _) => c.bytes() + m.scales.as_ref().map_or(0, |s| s.bytes()),
            (None, Some(l)) => l.codes.bytes() + l.scales.bytes(),
            (None, None) => 0,
        }
    }
}

impl Backend for CudaBackend {
    type Mat = CudaMat;
    type Vector = CudaVec;
    type Act = CudaAct;
    type Kv = CudaKv;
    type Gdn = CudaGdn;

    fn name(&self) -> String {
        let kernels = match self.gpu.cubin_source {
            kc::CubinSource::Embedded => "kernels embedded",
            kc::CubinSource::Cache => "kernels from cache",
            kc::CubinSource::Nvrtc => "kernels compiled by NVRTC",
        };
        format!(
            "cuda ({}, sm_{}{}, {kernels})",
            self.gpu.device_name, self.gpu.arch.0, self.gpu.arch.1
        )
    }

    /// A single matrix. The output head, the one RMS-normed projection loaded alone, is held
    /// only in its b1-plane layout where `b1p_only_ok`.
    fn load_mat(&self, g: &Arc<Gguf>, name: &str, n_in: usize, n_out: usize) -> Result<CudaMat> {
        let only = name == "output.weight"
            && self.b1p_only_ok()
            && self
                .b1p_planes_for(name, g.matrix(name, n_in, n_out)?.1, n_in, n_out)
                .is_some();
        self.load_mat_as(g, name, n_in, n_out, only)
    }

    /// Matrices that read one normed row (GDN and attention in-projections, ffn gate and up):
    /// when all of them get b1-plane layouts of one plane count (so every path that reads them,
    /// decode, verify and the prefill GEMM, takes those layouts) and `b1p_only_ok`, they
    /// are held only in the b1-plane layout — about 2.9 GB less resident for the 27B Q1_0 model
    /// and 5.1 GB for Q2_0 — else in both layouts.
    fn load_mats(&self, g: &Arc<Gguf>, specs: &[(&str, usize, usize)]) -> Result<Vec<CudaMat>> {
        let mut planes = Vec::with_capacity(specs.len());
        for &(name, n_in, n_out) in specs {
            planes.push(if b1p_consumer(name) {
                self.b1p_planes_for(name, g.matrix(name, n_in, n_out)?.1, n_in, n_out)
            } else {
                None
            });
        }
        let only = self.b1p_only_ok()
            && specs.len() <= kc::MAX_SEGS
            && planes.iter().all(|p| p.is_some() && *p == planes[0])
            && specs.iter().all(|s| s.1 == specs[0].1);
        specs
            .iter()
            .map(|&(name, n_in, n_out)| self.load_mat_as(g, name, n_in, n_out, only))
            .collect()
    }

    fn load_vector(&self, g: &Arc<Gguf>, name: &str, n: usize) -> Result<CudaVec> {
        let v = g.vector(name, n)?;
        Ok(CudaVec {
            n,
            buf: self.gpu.upload(&v).map_err(be)?,
        })
    }

    fn new_act(&self, n: usize, width: usize) -> CudaAct {
        CudaAct {
            n,
            width,
            buf: self
                .gpu
                .alloc(n * width * 4)
                .expect("cuda: activation allocation failed"),
        }
    }

    fn new_kv(&self, cfg: &TargetConfig, n_ctx: usize) -> Result<CudaKv> {
        let width = cfg.n_head_kv * cfg.head_dim;
        {
            let mut m = self.max_ctx.lock().expect("ctx lock");
            *m = (*m).max(n_ctx);
        }
        Ok(CudaKv {
            width,
            n_ctx,
            len: 0,
            k: self.gpu.alloc(n_ctx * width * 2).map_err(be)?,
            v: self.gpu.alloc(n_ctx * width * 2).map_err(be)?,
        })
    }

    fn new_gdn(&self, cfg: &TargetConfig) -> Result<CudaGdn> {
        let dv = cfg.ssm_head_v_dim();
        if cfg.ssm_d_state != dv || cfg.ssm_d_state > 128 || dv % 32 != 0 {
            return Err(Error::Unsupported(format!(
                "CUDA GDN kernels need d_k == d_v <= 128 and a multiple of 32 (d_k {}, d_v {dv})",
                cfg.ssm_d_state
            )));
        }
        Ok(CudaGdn {
            conv: self
                .gpu
                .alloc((cfg.ssm_conv_kernel - 1) * cfg.conv_dim() * 4)
                .map_err(be)?,
            s: self
                .gpu
                .alloc(cfg.ssm_dt_rank * cfg.ssm_d_state * dv * 4)
                .map_err(be)?,
        })
    }

    fn reset_gdn(&self, st: &mut CudaGdn) {
        self.gpu
            .zero(st.conv.ptr(), st.conv.bytes())
            .and_then(|_| self.gpu.zero(st.s.ptr(), st.s.bytes()))
            .expect("cuda: reset_gdn");
    }

    fn copy_gdn(&self, src: &CudaGdn, dst: &mut CudaGdn) {
        self.copy_gdn_state(src, dst).expect("cuda: copy_gdn");
    }

    fn truncate_kv(&self, kv: &mut CudaKv, len: usize) {
        kv.len = kv.len.min(len);
    }

    fn copy_kv(&self, src: &CudaKv, dst: &mut CudaKv) {
        assert!(src.len <= dst.n_ctx, "copy_kv: destination too short");
        let bytes = src.len * src.width * 2;
        self.gpu
            .dtod(dst.k.ptr(), src.k.ptr(), bytes)
            .and_then(|_| self.gpu.dtod(dst.v.ptr(), src.v.ptr(), bytes))
            .expect("cuda: copy_kv");
        dst.len = src.len;
    }

    fn gdn_to_host(&self, st: &CudaGdn) -> Result<Vec<f32>> {
        // conv window [k−1, conv_dim] then S [H_v, d_k, d_v]: the CPU backend's layout
        let (nc, ns) = (st.conv.bytes() / 4, st.s.bytes() / 4);
        let mut out = vec![0f32; nc + ns];
        let (c, s) = out.split_at_mut(nc);
        self.gpu.dtoh(&st.conv, 0, c).map_err(be)?;
        self.gpu.dtoh(&st.s, 0, s).map_err(be)?;
        Ok(out)
    }

    fn kv_to_host(&self, kv: &CudaKv) -> Result<(usize, Vec<f32>)> {
        let (len, w) = (kv.len, kv.width);
        let mut h = vec![0u16; 2 * len * w]; // [K rows ‖ V rows] f16 bits
        let (kh, vh) = h.split_at_mut(len * w);
        self.gpu.dtoh(&kv.k, 0, kh).map_err(be)?;
        self.gpu.dtoh(&kv.v, 0, vh).map_err(be)?;
        let out = h
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect();
        Ok((len, out))
    }

    fn gdn_block_rec(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut CudaGdn,
        x: &mut CudaAct,
        s: &Step,
        rec: &mut CudaAct,
    ) -> Result<()> {
        if s.gdn_mode != GdnMode::Recurrent {
            return Err(Error::Backend(
                "gdn_block_rec records recurrent steps only".into(),
            ));
        }
        let width = gdn_rec_width(cfg);
        if rec.width != width || rec.buf.bytes() < s.n * width * 4 {
            return Err(Error::Backend(format!(
                "gdn_block_rec: the record holds {} bytes of rows of width {}, the step needs {} rows \
                 of width {width}",
                rec.buf.bytes(),
                rec.width,
                s.n
            )));
        }
        let n = x.n;
        let recp = rec.buf.ptr();
        self.with_scratch(cfg, n, |sc| {
            self.gdn_impl_rec(sc, cfg, w, st, x.buf.ptr(), s.n, Some(recp), None)
        })?;
        // rows of the record that are valid (the buffer keeps its capacity)
        rec.n = s.n;
        Ok(())
    }

    fn gdn_replay(
        &self,
        cfg: &TargetConfig,
        st: &mut CudaGdn,
        rec: &CudaAct,
        n: usize,
    ) -> Result<()> {
        let width = gdn_rec_width(cfg);
        if n > rec.n || rec.width != width {
            return Err(Error::Backend(format!(
                "gdn_replay: {n} rows requested, the record holds {} rows of width {} (expected {width})",
                rec.n, rec.width
            )));
        }
        self.replay_layer(cfg, st, None, rec, n)
    }

    /// With the round graphs on: one captured graph of the per-layer copies (keyed by the
    /// addresses), else [`Backend::copy_gdn`] per layer. The same copies either way.
    fn copy_gdn_all(&self, src: &[CudaGdn], dst: &mut [CudaGdn]) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::Backend(format!(
                "copy_gdn_all: {} source layers, {} destination layers",
                src.len(),
                dst.len()
            )));
        }
        if !self.round_graph() || src.is_empty() {
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                self.copy_gdn(s, d);
            }
            return Ok(());
        }
        let mut key = vec![KEY_COPY, src.len() as u64];
        for (s, d) in src.iter().zip(dst.iter()) {
            key.extend([
                s.conv.ptr(),
                s.s.ptr(),
                d.conv.ptr(),
                d.s.ptr(),
                s.conv.bytes() as u64,
                s.s.bytes() as u64,
            ]);
        }
        let mut rg = self.round_graphs.lock().expect("round graph lock");
        let idx = cached_graph(&mut rg.graphs, key, || {
            self.capture_graph(|| {
                for (s, d) in src.iter().zip(dst.iter()) {
                    self.copy_gdn_state(s, d)?;
                }
                Ok(())
            })
        })?;
        // asynchronous, like the eager copies
        self.gpu.launch_graph(&rg.graphs[idx].1).map_err(be)
    }

    /// With the round graphs on: one captured graph per `keep` of the restore copies then the
    /// `gdn_replay` launches (the default's launches, in its order), else those launches eagerly.
    fn rollback_gdn(
        &self,
        cfg: &TargetConfig,
        gdn: &mut [CudaGdn],
        snap: &[CudaGdn],
        recs: &[CudaAct],
        keep: usize,
    ) -> Result<()> {
        let width = gdn_rec_width(cfg);
        if recs.len() != gdn.len() || snap.len() != gdn.len() {
            return Err(Error::Backend(format!(
                "rollback_gdn: {} records and {} snapshots for {} GDN layers",
                recs.len(),
                snap.len(),
                gdn.len()
            )));
        }
        if let Some(rec) = recs.iter().find(|r| keep > r.n || r.width != width) {
            return Err(Error::Backend(format!(
                "rollback_gdn: {keep} rows requested, a record holds {} rows of width {} (expected \
                 {width})",
                rec.n, rec.width
            )));
        }
        // each layer's replay reads the snapshot and writes the live state (no restore copy;
        // with snap_fused off: the restore copies, then the replays in place)
        let fused = self.snap_fused();
        let layers = self.replay_layers();
        let replay_all = |gdn: &[CudaGdn]| -> Result<()> {
            if !fused {
                for (g, s) in gdn.iter().zip(snap) {
                    self.copy_gdn_state(s, g)?;
                }
            }
            if layers {
                // one launch: per layer the live state and window, where they are read from (the
                // snapshot, or in place after the restore copies) and the record
                let mut tab = Vec::with_capacity(gdn.len());
                for ((g, s), rec) in gdn.iter().zip(snap).zip(recs) {
                    snap_fits("rollback_gdn", s, g)?;
                    let src = if fused { s } else { g };
                    tab.push([
                        g.s.ptr(),
                        g.conv.ptr(),
                        src.s.ptr(),
                        src.conv.ptr(),
                        rec.buf.ptr(),
                    ]);
                }
                return self
                    .gpu
                    .gdn_replay_layers(
                        &tab,
                        width,
                        cfg.ssm_n_group,
                        cfg.ssm_dt_rank,
                        cfg.ssm_d_state,
                        cfg.ssm_head_v_dim(),
                        cfg.ssm_conv_kernel,
                        keep,
                    )
                    .map_err(be);
            }
            for ((g, s), rec) in gdn.iter().zip(snap).zip(recs) {
                self.replay_layer(cfg, g, fused.then_some(s), rec, keep)?;
            }
            Ok(())
        };
        if !self.round_graph() || gdn.is_empty() {
            return replay_all(gdn);
        }
        let (hk, hv, dk) = (cfg.ssm_n_group, cfg.ssm_dt_rank, cfg.ssm_d_state);
        let (dv, kconv) = (cfg.ssm_head_v_dim(), cfg.ssm_conv_kernel);
        let mut key = vec![
            KEY_ROLLBACK,
            keep as u64,
            fused as u64,
            layers as u64,
            self.gpu.pdl() as u64 | (self.gpu.spec_pdl() as u64) << 1,
            width as u64,
            hk as u64,
            hv as u64,
            dk as u64,
            dv as u64,
            kconv as u64,
        ];
        for ((g, s), r) in gdn.iter().zip(snap).zip(recs) {
            key.extend([
                g.conv.ptr(),
                g.s.ptr(),
                s.conv.ptr(),
                s.s.ptr(),
                s.conv.bytes() as u64,
                s.s.bytes() as u64,
                r.buf.ptr(),
            ]);
        }
        let mut rg = self.round_graphs.lock().expect("round graph lock");
        // the eager path's launches (records checked above), in its order
        let idx = cached_graph(&mut rg.graphs, key, || {
            self.capture_graph(|| replay_all(gdn))
        })?;
        // on the side stream: the drafter's stage and next draft (detached scopes in
        // `CudaDrafter`) run beside it, and the next target operation waits for it
        self.gpu.launch_graph_forked(&rg.graphs[idx].1).map_err(be)
    }

    /// With the round graphs on and at most 8 rows (every tap layer inside the model): one
    /// captured graph per row count, tap list and `rows_needed` (`CudaBackend::verify_graph`),
    /// which also returns the per-row logit statistics and skips the rows when they are not
    /// needed and the statistics are usable. Otherwise the eager forward (no statistics, rows
    /// always filled).
    fn verify_forward(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        ids: &[u32],
        recs: &mut [CudaAct],
        taps: Option<(&[usize], &mut Vec<f32>)>,
        logits: &mut Vec<f32>,
        rows_needed: bool,
    ) -> Result<Vec<Option<LogitStats>>> {
        self.verify_forward_out(cfg, w, st, ids, recs, taps, logits, rows_needed, None)
    }

    /// The round graph's variant that ends with `topk_rows` over the verified rows and copies
    /// back their [`kc::TOPK_ROW`] best entries instead of the rows, for `n_top <= TOPK_ROW`; the
    /// one with the rows otherwise.
    fn verify_forward_top(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        ids: &[u32],
        recs: &mut [CudaAct],
        taps: Option<(&[usize], &mut Vec<f32>)>,
        n_top: usize,
        logits: &mut Vec<f32>,
        tops: &mut Vec<Vec<(u32, f32)>>,
    ) -> Result<Vec<Option<LogitStats>>> {
        tops.clear();
        if n_top == 0 || n_top > kc::TOPK_ROW {
            return self.verify_forward_out(cfg, w, st, ids, recs, taps, logits, true, None);
        }
        let top = Some((n_top, tops));
        self.verify_forward_out(cfg, w, st, ids, recs, taps, logits, false, top)
    }

    /// No copy here: the next [`Backend::verify_forward`] takes the snapshot — its fused GDN
    /// kernels write the state and window they read into `snap` (the verify graph), or it copies
    /// them first (every other path).
    fn round_snapshot(&self, gdn: &[CudaGdn], snap: &mut [CudaGdn]) -> Result<()> {
        if !self.snap_fused() {
            return self.copy_gdn_all(gdn, snap);
        }
        if gdn.len() != snap.len() || gdn.iter().zip(snap.iter()).any(|(g, s)| !g.same_shape(s)) {
            return Err(Error::Backend(format!(
                "round_snapshot: {} layers into {} snapshot layers of other sizes",
                gdn.len(),
                snap.len()
            )));
        }
        let pairs = gdn
            .iter()
            .zip(snap.iter())
            .map(|(g, s)| SnapPair {
                live: g.ptrs(),
                snap: s.ptrs(),
            })
            .collect();
        *self.pending_snap.lock().expect("snapshot lock") = Some(pairs);
        Ok(())
    }

    fn embed(&self, table: &CudaMat, ids: &[u32], x: &mut CudaAct) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.n_out) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} out of range ({})",
                table.n_out
            )));
        }
        let n = ids.len();
        let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let ib = self.gpu.upload(&ids32).map_err(be)?;
        self.embed_impl(table, ib.ptr(), n, x.buf.ptr())?;
        // ib is freed on drop; make sure the kernel has read it first
        self.gpu.sync().map_err(be)
    }

    fn gdn_block(
        &self,
        cfg: &TargetConfig,
        w: &GdnWeights<Self>,
        st: &mut CudaGdn,
        x: &mut CudaAct,
        s: &Step,
    ) -> Result<()> {
        let n = x.n;
        self.with_scratch(cfg, n, |sc| self.gdn_impl(sc, cfg, w, st, x.buf.ptr(), s.n))
    }

    fn attn_block(
        &self,
        cfg: &TargetConfig,
        w: &AttnWeights<Self>,
        kv: &mut CudaKv,
        x: &mut CudaAct,
        s: &Step,
    ) -> Result<()> {
        if kv.len != s.pos {
            return Err(Error::Backend(format!(
                "KV cache holds {} rows, step starts at {}",
                kv.len, s.pos
            )));
        }
        if s.pos + s.n > kv.n_ctx {
            return Err(Error::ContextOverflow(format!(
                "{} positions, KV cache holds {}",
                s.pos + s.n,
                kv.n_ctx
            )));
        }
        self.with_scratch(cfg, s.n, |sc| {
            self.set_pos(sc, s.pos, s.n)?;
            self.attn_impl(sc, cfg, w, kv, x.buf.ptr(), s.n)
        })?;
        kv.len = s.pos + s.n;
        Ok(())
    }

    fn mlp_block(&self, cfg: &TargetConfig, w: &MlpWeights<Self>, x: &mut CudaAct) -> Result<()> {
        let n = x.n;
        self.with_scratch(cfg, n, |sc| self.mlp_impl(sc, cfg, w, x.buf.ptr(), n))
    }

    fn head(
        &self,
        cfg: &TargetConfig,
        norm: &CudaVec,
        out: &CudaMat,
        x: &CudaAct,
        rows: Range<usize>,
        logits: &mut [f32],
    ) -> Result<()> {
        let e = x.width;
        let nv = out.n_out;
        assert_eq!(logits.len(), rows.len() * nv);
        self.with_scratch(cfg, MV_ROWS, |sc| {
            let mut r0 = rows.start;
            while r0 < rows.end {
                let nr = (rows.end - r0).min(MV_ROWS);
                self.head_impl(sc, cfg, norm, out, x.buf.at(r0 * e * 4), nr)?;
                let o = (r0 - rows.start) * nv;
                self.gpu
                    .dtoh(&sc.logits, 0, &mut logits[o..o + nr * nv])
                    .map_err(be)?;
                r0 += nr;
            }
            Ok(())
        })
    }

    fn read_row(&self, x: &CudaAct, row: usize, out: &mut [f32]) {
        self.gpu
            .dtoh(&x.buf, row * x.width * 4, out)
            .expect("cuda: read_row");
    }

    /// Replays one captured graph per token (captured at the first step, and again whenever the
    /// weights, the state buffers, the context size or the scratch change): the token and the
    /// position go in through a pinned buffer, the logits row comes back through another. The
    /// launches are those of the eager forward, so the logits are bit-identical.
    /// [`Backend::decode_step_stats`] with `row_needed == false` replays a second graph without
    /// the row copy, [`Backend::decode_step_top`] a third that copies back the row's best entries
    /// instead (the variants are kept, keyed separately).
    fn decode_step(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        id: u32,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        self.decode_step_stats(cfg, w, st, id, logits, true)
            .map(|_| ())
    }

    fn decode_step_stats(
        &self,
        cfg: &TargetConfig,
        w: &Weights<Self>,
        st: &mut SeqState<Self>,
        id: u32,
        logits: &mut Vec<f32>,
        row_needed: bool,
    ) -> Result<Option<LogitStats>> {
        self.decode_step_out(cfg, w, st, id, logits, row_needed, None)
    }

    /// The variant of the decode graph that ends with `topk_rows` and copies back the row's
    /// [`kc::TOPK_ROW`] best entries instead of the row, for `n <= TOPK_ROW`; the one with the row
    /// otherwise. Falls back to the row like [`Backend::decode_step_stats`] when the statistics
    /// are unusable.
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
        top.clear();
        if n == 0 || n > kc::TOPK_ROW {
            return self.decode_step_out(cfg, w, st, id, logits, true, None);
        }
        self.decode_step_out(cfg, w, st, id, logits, false, Some((n, top)))
    }
}
