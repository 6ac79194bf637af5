//! bonsai CUDA kernels: a cudarc context, the embedded `.cu` kernels compiled by NVRTC at first use
//! (disk cache keyed by source hash, GPU arch and NVRTC version), device buffers and typed launchers.
//! No model types: launchers take device buffers and dimensions.
//!
//! Everything is loaded at run time (`dynamic-loading`): this crate builds and its host-side tests
//! run on a machine with no CUDA at all. Call [`cuda_available`] before [`Gpu::new`].

#[cfg(test)]
mod attn_tc_emu;
#[cfg(test)]
mod frag_emu;
#[cfg(test)]
mod gdn_chunk_emu;
mod gemm;
mod q41t;
pub mod retile;
mod spec;

use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys, CudaContext, CudaStream};
use cudarc::nvrtc::{result as nvrtc_r, sys as nvrtc_sys};

pub use gemm::{
    f16p_row, f16p_row_exp, gemm_pick_bn, gemm_supported, gemmws_k_splits, GemmConfig, GemmPath,
    GEMM_BM, GEMM_KC,
};
pub use q41t::{
    mv_q41t_host, q41t_bytes, q41t_pairs, q41t_smem_bytes, q41t_tiles, retile_q41t, Q41T_REC,
};
pub use retile::{
    b1p_planes, b1p_shape_ok, b1p_word_to_q1, b1p_words_to_q2, b1q_acts_host, detile_row,
    host_quant_p16, retile, retile_b1p, retile_q41, Retiled, RetiledB1p, WKind,
};
pub use spec::{
    dsp_attn_chunk_len, dsp_attn_chunks, dsp_attn_kv_smem, dsp_attn_max_chunks,
    dsp_attn_part_floats, gdn_rec_width, DspAttnKernel, DspPar, NormRopeSet, PlaneKind, Ring,
    DSP_ATTN_CHUNK, DSP_ATTN_KV_CHUNK, DSP_ATTN_KV_SPREAD, DSP_ATTN_SPREAD, Q41_MAX_SEGS,
    REPLAY_MAX_LAYERS,
};

/// The kernel source, embedded in the crate: one NVRTC translation unit made of the files in
/// `kernels/` (the core decode kernels first; the others use its helpers).
pub const SOURCE: &str = concat!(
    include_str!("../kernels/bonsai.cu"),
    include_str!("../kernels/gemm.cu"),
    include_str!("../kernels/spec.cu"),
    include_str!("../kernels/prefill.cu"),
    include_str!("../kernels/mvp.cu"),
    include_str!("../kernels/mvs.cu"),
    include_str!("../kernels/mvbp.cu"),
    include_str!("../kernels/mvq41t.cu"),
);

/// Largest number of rows the low-bit mat-vec kernels take in one launch (`MAXN` in the source).
pub const MAX_ROWS: usize = 8;

/// Most matrices one grouped mat-vec launch covers (`mv_lowbit_multi`).
pub const MAX_SEGS: usize = 4;
/// Positions per attention chunk (`AT_CHUNK` in the source).
pub const ATTN_CHUNK: usize = 32;
/// Default most blocks per head (grid.y) of a flash-decode chunk launch ([`Gpu::attn_gy`]) of one
/// row and of more rows: 96 and 32 were the best or within 3 % of it from 32 to 4,000 positions on
/// the H200 (`gpu_kernels::attn_decode_timing`).
pub const ATTN_GY: [usize; 2] = [96, 32];
/// q heads per block a flash-decode chunk launch at head dim 256 may take (`attn_chunks_hd256_h*`).
pub const ATTN_HPBS: [usize; 4] = [1, 2, 3, 6];
/// Default q heads per block of a flash-decode chunk launch ([`Gpu::attn_hpb`]) of one row and of
/// more rows: 2 was within 4 % of 1 at 32 positions and 1–10 % faster from 1,024 to 4,000 on the
/// H200 (`gpu_kernels::attn_decode_timing`); 3 and 6 lose at short contexts (fewer blocks, longer
/// chains).
pub const ATTN_HPB: [usize; 2] = [2, 2];

/// f32 elements of the attention partials scratch for `n` rows, `nh` heads of `hd`, `n_ctx` positions.
pub fn attn_part_floats(n: usize, nh: usize, hd: usize, n_ctx: usize) -> usize {
    n * nh * n_ctx.div_ceil(ATTN_CHUNK) * (hd + 2)
}

/// Rows per block of `gdn_conv_rows` (`GC_ROWS` in the source).
const GDN_CONV_ROWS: usize = 32;
/// Rows per block of `gdn_conv_rows_k4` (8 warps x `GC4_RW`).
const GDN_CONV4_ROWS: usize = 64;
/// Query rows per block of the prefill attention (`AP_BQ`); key positions per tile (`AP_BK`).
const ATTN_PREFILL_ROWS: usize = 32;
const ATTN_PREFILL_KEYS: usize = 32;

/// Dynamic shared memory of `attn_prefill_hd{hd}`: Q [32, hd] f32, K [32, hd + 8] f16,
/// V [32, hd] f16, P [32, 32 + 4] f32.
pub fn attn_prefill_smem(hd: usize) -> usize {
    ATTN_PREFILL_ROWS * hd * 4
        + ATTN_PREFILL_KEYS * (hd + 8) * 2
        + ATTN_PREFILL_KEYS * hd * 2
        + ATTN_PREFILL_KEYS * (ATTN_PREFILL_ROWS + 4) * 4
}

/// Query rows per block of the tensor-core prefill attention (`AT_BQ`); key positions per tile
/// (`AT_BK`).
const ATTN_TC_ROWS: usize = 64;
const ATTN_TC_KEYS: usize = 32;

/// Dynamic shared memory of `attn_prefill_tc_hd{hd}`: Q hi and lo [64, hd + 8] f16, K and V
/// [32, hd + 8] f16 (`AT_SMEM`).
pub fn attn_prefill_tc_smem(hd: usize) -> usize {
    (2 * ATTN_TC_ROWS + 2 * ATTN_TC_KEYS) * (hd + 8) * 2
}

/// Whether the prefill GDN kernels (`gdn_conv_rows`, `gdn_step_seq`) take head dims `dk`, `dv`.
pub fn gdn_prefill_supported(dk: usize, dv: usize) -> bool {
    dk % 32 == 0 && (32..=128).contains(&dk) && dv % 16 == 0 && dv > 0
}

/// Rows per chunk of the chunked GDN prefill (`GK_C` in the source).
const GDN_CHUNK: usize = 64;
/// Value columns per `gdn_chunk_scan` block (`GK_JS`).
const GDN_CHUNK_COLS: usize = 16;

/// How prefill runs the GDN recurrence ([`Gpu::set_gdn_prefill`]; `BONSAI_CUDA_GDN_CHUNKED=1`
/// for [`GdnPrefill::Chunked`], `=tc` for [`GdnPrefill::ChunkedTc`]). The chunked forms apply
/// where [`gdn_chunked_supported`]; elsewhere prefill runs row by row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnPrefill {
    /// `gdn_step_seq` (the default: on the H200 it ties the chunked form inside a forward, and a
    /// prefill split at any row gives the one-launch bits).
    RowByRow,
    /// `gdn_chunk_prep_d128` + the FP32 chunk walk `gdn_chunk_scan_d128`.
    Chunked,
    /// `gdn_chunk_prep_d128` + the tensor-core (3×TF32) chunk walk `gdn_chunk_scan_tc_d128`.
    /// On the H200 as accurate as the FP32 walk (max relative 4.6e-7 against `gdn_step` at
    /// n = 512) and no faster (274 vs 277 µs per 27B layer with prep; row by row 223).
    ChunkedTc,
}

impl GdnPrefill {
    /// Every mode, the default first.
    pub const ALL: [GdnPrefill; 3] = [
        GdnPrefill::RowByRow,
        GdnPrefill::Chunked,
        GdnPrefill::ChunkedTc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            GdnPrefill::RowByRow => "row-by-row",
            GdnPrefill::Chunked => "chunked",
            GdnPrefill::ChunkedTc => "chunked-tc",
        }
    }

    fn from_env() -> Self {
        match std::env::var("BONSAI_CUDA_GDN_CHUNKED").as_deref() {
            Ok("1") => GdnPrefill::Chunked,
            Ok("tc") => GdnPrefill::ChunkedTc,
            _ => GdnPrefill::RowByRow,
        }
    }
}

/// Whether the chunked GDN prefill ([`Gpu::gdn_step_chunked`]) takes head dims `dk`, `dv`: the
/// 27B head (128, 128), compiled in.
pub fn gdn_chunked_supported(dk: usize, dv: usize) -> bool {
    dk == 128 && dv == 128
}

/// f32 elements of the scratch [`Gpu::gdn_step_chunked`] needs for `n` rows of `hv` heads of
/// `dk` (= dv): U0 and W [hv, npad, dk] each, P [hv, ⌈n/64⌉, 64, 64], γ and the decay to the chunk
/// end [hv, npad] each (npad = 64 ⌈n/64⌉).
pub fn gdn_chunk_scratch_floats(hv: usize, dk: usize, n: usize) -> usize {
    let nch = n.div_ceil(GDN_CHUNK);
    let npad = nch * GDN_CHUNK;
    hv * npad * (2 * dk + 2) + hv * nch * GDN_CHUNK * GDN_CHUNK
}

/// Dynamic shared memory of `gdn_chunk_prep_d128`: K, Q [64, 132] f32 | A [64, 68] f32 | L [64]
/// f64 | γ, β [64] f32.
const GDN_CHUNK_PREP_SMEM: usize = (2 * GDN_CHUNK * 132 + GDN_CHUNK * 68 + 4 * GDN_CHUNK) * 4;
/// Dynamic shared memory of `gdn_chunk_scan_d128`: S [128, 16] | W, Q half tiles [2, 64, 68]
/// (then K [64, 132]) | Δ, Δ scaled [64, 16] each.
const GDN_CHUNK_SCAN_SMEM: usize =
    (128 * GDN_CHUNK_COLS + 2 * GDN_CHUNK * 68 + 2 * GDN_CHUNK * GDN_CHUNK_COLS) * 4;
/// Dynamic shared memory of `gdn_chunk_scan_tc_d128`: S [128, 24] | [W; Q] half tile [128, 68]
/// (then K [64, 136]) | Δ, Δ scaled [64, 24] each.
const GDN_CHUNK_TC_SMEM: usize = (128 * 24 + 2 * GDN_CHUNK * 68 + 2 * GDN_CHUNK * 24) * 4;
const _: () = assert!(3 * (GDN_CHUNK_TC_SMEM + 1024) <= 228 * 1024);
const _: () = assert!(GDN_CHUNK * 136 <= 2 * GDN_CHUNK * 68);
// Two prep blocks and four scan blocks fit one H200 SM (228 KiB, 1 KiB reserved per block), and
// the scan's K tile [64, 132] fits where its W / Q half tiles [2, 64, 68] were.
const _: () = assert!(2 * (GDN_CHUNK_PREP_SMEM + 1024) <= 228 * 1024);
const _: () = assert!(4 * (GDN_CHUNK_SCAN_SMEM + 1024) <= 228 * 1024);
const _: () = assert!(GDN_CHUNK * 132 <= 2 * GDN_CHUNK * 68);

/// Warps per mat-vec block (`MV_WARPS` in the source).
const MV_WARPS: usize = 4;

/// How one low-bit dp4a mat-vec launch (`mv_*`) is cut: `r` weight rows per warp (n = 1 only;
/// the n-row variants take `rn`), `ks` warps of a block splitting each row's K range. `pre`: load
/// the first weights before waiting for the previous kernel (PDL). `r`, `rn`, `n5` and `pre` never
/// change a row's float ops; `ks` does, so it is a function of the matrix shape alone, never of n
/// (batch invariance: a verify row equals the decode row bit for bit).
///
/// `pipe` (one-row launches only, n > 1 ignores it): the pipelined persistent
/// kernels `mvp_*` (`kernels/mvp.cu`) with `r` (2 or 4) rows per group and a grid sized to what
/// fits on the GPU at once. They reproduce the float order of the dp4a kernels with the same `ks`
/// (which they emulate inside one warp), so a `pipe` decode row equals the verify row bit for
/// bit. The defaults use it only for the mid-sized Q2 launches (`mvp_default_on`); other launches
/// take it only in explicit plans ([`Gpu::set_mv_override`], the plan sweep). Measured on the
/// H200 (bench/results/cuda-mv-sweep-*.json, `pipe_vs_dp4a`) it is 0.77–1.02× the plain kernels
/// on the Q1 27B shapes and 0.77–1.22× on Q2, and a whole graph decode step was slower with every
/// one-row launch on it (cuda-decode-27b-*.json `mv_pipe`: Q1 3.83 against 3.24 ms; that switch
/// was removed on 2026-12-07), so more loads in flight per warp is not what limits the decode
/// mat-vec.
///
/// Four other mat-vec families with their own float orders (`mma`: int8 tensor cores, `mvm` /
/// `mvd` / `mvx`; `b1`: binary tensor cores on 8 activation planes, `mvb`; `o8`: 8 interleaved
/// partials, `mvo` / `mvt`; the integer sub-scale kernels `mvq*`) and the dp4a-order tensor-core
/// verify `mvc` were measured slower and removed on 2026-12-06; the crate README says where and by
/// how much.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MvPlan {
    pub r: usize,
    pub ks: usize,
    pub pre: bool,
    pub pipe: bool,
    /// Weight rows per warp of the n ≥ 2 dp4a launches (`mv_*_n8`, 2; `mv_*_n8r4` / `mv_*_n5r4`,
    /// 4; `mv_*_n5r8`, 8 for n ≤ 5). Like `r` it never changes a row's float order.
    pub rn: usize,
    /// n-row launches of n ≤ 5 run the 5-row kernels (`mv_*_n5r4` / `mv_*_n5r8`); `rn` 8 without
    /// them (or for n > 5) runs as 4.
    pub n5: bool,
}

impl MvPlan {
    /// A plain dp4a plan: `r` weight rows per warp, K split `ks`, weights loaded before the PDL
    /// wait when `pre`; every other family flag off. Other plans set theirs with struct update
    /// syntax (`MvPlan { pipe: true, ..MvPlan::dp4a(4, 1, true) }`).
    pub const fn dp4a(r: usize, ks: usize, pre: bool) -> MvPlan {
        MvPlan {
            r,
            ks,
            pre,
            pipe: false,
            rn: 2,
            n5: false,
        }
    }
}

/// The K split for a launch of `rows` output rows (all segments) of width `n_in`: launches of
/// fewer rows split each row over 2 warps so they still fill the GPU. Measured on the H200 at the
/// 27B shapes (`tests/cuda_mv_sweep.rs`, bench/results/cuda-mv-sweep-*.json): K split 2 took the
/// 5120-row outputs (ssm_out, attn_out, ffn_down) from 5.2 / 5.5 / 11.8 µs to 4.0 / 3.9 / 8.5 µs (Q1)
/// and attn q‖k‖v (14,336 rows) from 9.7 to 8.5 µs; the larger launches gain nothing.
fn mv_default_ks(_kind: WKind, rows: usize, _n_in: usize) -> usize {
    if rows <= 15_000 {
        2
    } else {
        1
    }
}

/// Weight rows per warp of an n = 1 launch (the n ≤ 8 variants always take 2): 4, but 2 for the
/// large Q2 launches (measured the same or better) and 8 for the large Q1 launches (K split 1),
/// where each activation load then feeds 8 rows: H200 sweep of the 27B Q1_0 file
/// (bench/results/cuda-mv-sweep-r8-q1.json), µs per launch r4 → r8: gdn q‖z‖b‖a 8.80 → 8.32,
/// gate‖up 13.93 → 13.18, head 81.4 → 75.7; the 5120-row outputs and attn q‖k‖v (K split 2)
/// are slower with 8.
fn mv_default_r(kind: WKind, rows: usize) -> usize {
    match (kind, rows > 15_000) {
        (WKind::Q1, true) => 8,
        (_, true) => 2,
        _ => 4,
    }
}

/// The shape-based default plan of a low-bit mat-vec over `rows` output rows of width `n_in` with
/// `n` activation rows on the dp4a kernels; the verify (n ≥ 2) rows per warp and 5-row kernels
/// are [`mv_verify_default`]'s.
pub fn mv_default_plan(kind: WKind, n: usize, rows: usize, n_in: usize) -> MvPlan {
    let pipe = n == 1 && mvp_default_on(kind, rows);
    let r = if pipe {
        mvp_default_r(kind, rows)
    } else if n == 1 {
        mv_default_r(kind, rows)
    } else {
        2
    };
    let (rn, n5) = mv_verify_default(kind);
    MvPlan {
        pipe,
        rn,
        n5,
        ..MvPlan::dp4a(r, mv_default_ks(kind, rows, n_in), true)
    }
}

/// Whether a one-row launch of `rows` output rows takes the pipelined kernel (`mvp_*`, the same
/// float order as the plain dp4a kernels, so verify rows still equal decode rows) by default: the
/// mid-sized Q2 launches, where the plain grid ends in a poorly filled last wave (Q2's 5 blocks
/// per SM). H200 sweeps (bench/results/cuda-mv-sweep-q2.json at e54a60c, and again on 2026-11-30):
/// gdn q‖z‖b‖a (16,480 rows) 10.9 → 9.0 µs and attn q‖k‖v (14,336 rows, K split 2) 10.1 → 9.2 µs;
/// gate‖up (34,816), the head and the 5120-row outputs are faster plain, and so is every Q1 launch
/// but one (gdn q‖z‖b‖a, by 1.5 %). Decode graph 3.956 → 3.846 ms on Q2. Since
/// [`MVS_MIN_ROWS`] is 8,192 the staged kernel takes these launches first; the pipelined one
/// keeps them where the staged one cannot (shape, alignment, `BONSAI_CUDA_MV_STAGED=0`).
fn mvp_default_on(kind: WKind, rows: usize) -> bool {
    kind == WKind::Q2 && mvp_mid_rows(rows)
}

/// The mid-sized one-row launches of [`mvp_default_on`].
fn mvp_mid_rows(rows: usize) -> bool {
    (8_192..32_768).contains(&rows)
}

/// Rows per group of the pipelined decode kernel (`mvp_*`) for a launch of `rows` output rows: 4,
/// the fastest mvp plan on most 27B categories in the H200 sweep (bench/results/
/// cuda-mv-sweep-*.json, `pipe_vs_dp4a` and `all`).
pub fn mvp_default_r(_kind: WKind, _rows: usize) -> usize {
    4
}

/// The default verify (n ≥ 2) dp4a plan of `kind`: weight rows per warp, and whether launches of
/// n ≤ 5 take the 5-row kernels (`mv_*_n5r*`, registers for 5 activation rows instead of 8). More
/// rows per warp: each activation load feeds more rows. H200, 27B files, n-gram round with round
/// graphs, replay rollback, k = 0 (`cuda_spec_bench`, bench/results/cuda-spec-27b-*-rn*.json):
/// Q1_0 11.64 ms with 2 rows (R 3.74), 10.66 with 4 (`_n8r4`), 10.11 with 4 on `_n5r4`, 9.78 with
/// 8 on `_n5r8` (R 3.14); Q2_0 12.88 → 12.11 ms with 4 (R 3.57 → 3.35), and on 2026-11-30
/// (afde082, one process per plan) 12.33 ms with 4 on `_n8r4`, 11.15 with 4 on `_n5r4`, 12.02 with
/// 8 on `_n5r8`: Q2_0 takes 4 rows on the 5-row kernels. Q2_0 with 64-blocks is not measured (no
/// 27B file of that layout) and keeps `_n8r4`.
pub fn mv_verify_default(kind: WKind) -> (usize, bool) {
    match kind {
        WKind::Q1 => (8, true),
        WKind::Q2 => (4, true),
        _ => (4, false),
    }
}

/// The dp4a kernel variants of `mv_func`'s table, by row: the name suffix in `MV_KIND_ENTRIES`
/// (bonsai.cu), its activation rows (NT), weight rows per warp (R) and row split (RS: blocks
/// per row group, each holding NT activation rows; `MV_RS_ENTRY`).
const MV_VARIANTS: [(&str, usize, usize, usize); 9] = [
    ("n8", 8, 2, 1),
    ("n8r4", 8, 4, 1),
    ("n1_r2", 1, 2, 1),
    ("n1_r4", 1, 4, 1),
    ("n1_r8", 1, 8, 1),
    ("n5r4", 5, 4, 1),
    ("n5r8", 5, 8, 1),
    ("n3r4s", 3, 4, 2),
    ("n3r8s", 3, 8, 2),
];

/// The dp4a variant (row of [`MV_VARIANTS`]) and the rows per warp it runs with for `n`
/// activation rows, `r` asked rows per warp, the 5-row kernels on or off and the row split on or
/// off: n = 1 takes `r` as asked; 4 ≤ n ≤ 5 with `n5` and `rsplit` takes the row-split kernel of 4
/// or 8 rows (2 blocks of 3 activation rows), n ≤ 5 with `n5` otherwise the 5-row kernel of 4 or 8
/// rows; otherwise the 8-row kernel of 2 rows, or of 4 for an asked 4 or 8.
fn mv_variant(n: usize, r: usize, n5: bool, rsplit: bool) -> Option<(usize, usize)> {
    let split = rsplit && (4..=5).contains(&n);
    let row = match (n == 1, n5 && n <= 5, split, r) {
        (true, _, _, 2) => 2,
        (true, _, _, 4) => 3,
        (true, _, _, 8) => 4,
        (false, true, true, 4) => 7,
        (false, true, true, 8) => 8,
        (false, true, _, 4) => 5,
        (false, true, _, 8) => 6,
        (false, _, _, 2) => 0,
        (false, _, _, 4 | 8) => 1,
        _ => return None,
    };
    Some((row, MV_VARIANTS[row].2))
}

/// `BONSAI_CUDA_MV_RN` (2, 4 or 8): the verify rows per warp for every kind (0: per kind).
fn mv_rn_env() -> usize {
    match std::env::var("BONSAI_CUDA_MV_RN").as_deref() {
        Ok("2") => 2,
        Ok("4") => 4,
        Ok("8") => 8,
        _ => 0,
    }
}

/// `BONSAI_CUDA_MV_N5` (0 or 1): the 5-row verify kernels off or on for every kind (2: per kind).
fn mv_n5_env() -> u8 {
    match std::env::var("BONSAI_CUDA_MV_N5").as_deref() {
        Ok("0") => 0,
        Ok("1") => 1,
        _ => 2,
    }
}

/// Which one-row launches take the staged decode mat-vec (`kernels/mvs.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MvStaged {
    /// None.
    Off = 0,
    /// The launches [`mvs_default_on`] picks (the long ones: many row tiles per block).
    Auto = 1,
    /// Every launch whose shape the bulk copies can take.
    All = 2,
}

impl MvStaged {
    fn from_u8(v: u8) -> MvStaged {
        match v {
            1 => MvStaged::Auto,
            2 => MvStaged::All,
            _ => MvStaged::Off,
        }
    }
}

/// `BONSAI_CUDA_MV_STAGED`: `0` off, `auto` (or `1`) [`MvStaged::Auto`], `all` (or `2`) every
/// launch; unset (or anything else): [`MV_STAGED_DEFAULT`] (read once per `Gpu`).
fn mv_staged_env() -> MvStaged {
    match std::env::var("BONSAI_CUDA_MV_STAGED").as_deref() {
        Ok("0") => MvStaged::Off,
        Ok("1" | "auto") => MvStaged::Auto,
        Ok("2" | "all") => MvStaged::All,
        _ => MV_STAGED_DEFAULT,
    }
}

/// Which one-row launches take the staged kernel when `BONSAI_CUDA_MV_STAGED` is unset.
pub const MV_STAGED_DEFAULT: MvStaged = MvStaged::Auto;

/// Whether [`MvStaged::Auto`] stages a one-row launch of `rows` output rows of `kind`: the Q2
/// launches of at least [`MVS_MIN_ROWS`] rows (ffn gate‖up, 34,816 rows, the head, and the GDN /
/// attention in-projections).
/// Measured on the H200 (bench/results/cuda-decode-27b-*.json, `carveout_x_staged`): Q2 decode
/// 3.789 → 3.611 ms/token with these staged (and the carveout of [`Gpu::set_carveout`] at 100 %
/// for every kernel, which a staged launch sets unless one was chosen); Q1 3.177 → 3.233, so Q1
/// keeps the plain kernels. Launches that fit in about one wave gain nothing from a ring and pay
/// its set-up.
pub fn mvs_default_on(kind: WKind, rows: usize) -> bool {
    mvs_auto(kind, rows, MVS_MIN_ROWS, false)
}

/// The fewest rows of a Q2 launch that [`MvStaged::Auto`] stages (`BONSAI_CUDA_MVS_MIN_ROWS`
/// overrides it): 8,192, so the GDN / attention in-projections (16,480 / 14,336 rows) are staged
/// too, not pipelined (`mvp`). Measured on the H200 in `cuda_bench`'s A/B (8,192 against 32,768):
/// a wash while staged launches set a 100 % carveout (3.614 against 3.607 ms/token,
/// bench/results/cuda-staged-min-rows-27b-q2.json); at the 58 % carveout, 3.317 against 3.343
/// (fc75e0c) and 3.314 against 3.341 (22a66b2), two device sessions.
pub const MVS_MIN_ROWS: usize = 8_192;

/// [`MvStaged::Auto`]'s rule: launches of at least `min_rows` rows, of Q1 only with `q1`
/// ([`Gpu::mvs_q1`]).
fn mvs_auto(kind: WKind, rows: usize, min_rows: usize, q1: bool) -> bool {
    (kind != WKind::Q1 || q1) && rows >= min_rows
}

fn mvs_min_rows_env() -> usize {
    env_usize("BONSAI_CUDA_MVS_MIN_ROWS").unwrap_or(MVS_MIN_ROWS)
}

/// The K split of a b1-plane mat-vec (`kernels/mvbp.cu`, Q1_0 or Q2_0) over `tiles` 16-row tiles of width
/// `n_in`: the smallest of 1, 2, 4, 8, 16 that gives at least [`MVBP_MIN_WARPS`] warps, while every
/// K part keeps at least two 256-element pairs. A function of the shape alone, never of n, so a
/// verify row equals the decode row bit for bit. On the 27B Q1_0 model: 2 for the GDN and
/// attention in-projections, 1 for gate‖up and the head.
pub fn mvbp_ks(tiles: usize, n_in: usize) -> usize {
    mvbp_ks_for(tiles, n_in, mvbp_min_warps())
}

/// [`mvbp_ks`] with the warp target as a parameter.
pub fn mvbp_ks_for(tiles: usize, n_in: usize, min_warps: usize) -> usize {
    let pairs = n_in / 256;
    let mut ks = 1;
    while ks < 16 && tiles * ks < min_warps && pairs >= 4 * ks {
        ks *= 2;
    }
    ks
}

/// The default warp target of [`mvbp_ks`]: 1,792 (about 14 per SM on the H200). The prototype's
/// sweep (`bench/results/cuda-b1plane-proto-27b-q1.json`) chose 2,048; with the shared-memory
/// activation kernels the Q1_0 decode graph measured 2.476 ms per token at 2,048 and 2.459 at
/// 1,792 (two processes each, alternating; `bench/results/cuda-b1p-xs-ks-27b-q1.json`): the
/// attention in-projection (896 tiles) drops from a K split of 4 (896 blocks, 1.4 waves at 5
/// blocks per SM) to 2 (448 blocks, one wave), 6.8 → 6.2 µs per launch.
pub const MVBP_MIN_WARPS: usize = 1792;

/// The warp target of [`mvbp_ks`]: [`MVBP_MIN_WARPS`], or `BONSAI_CUDA_MVBP_WARPS` (read once; a
/// benchmark knob — it changes the float order, so decode and verify must run under one value).
fn mvbp_min_warps() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| env_usize("BONSAI_CUDA_MVBP_WARPS").unwrap_or(MVBP_MIN_WARPS))
}

/// Warps per block of a b1-plane launch with K split `ks` (4, or `ks` above 4).
pub fn mvbp_warps(ks: usize) -> usize {
    ks.max(4)
}

/// Most u64 words of the struct a [`Gpu`] launch passes by value as a kernel's first parameter
/// (the parameter space is 4 KiB; the rest is left for the scalar parameters after it).
pub const BLOB_MAX_U64: usize = 480;

/// Most activation rows of one b1-plane launch.
pub const MVBP_MAX_ROWS: usize = 5;

/// The default of [`Gpu::b1q_tiles`]: 2, or `BONSAI_CUDA_B1Q_R=1` (read at `Gpu::new`).
fn mvbq_tiles_env() -> usize {
    env_usize("BONSAI_CUDA_B1Q_R")
        .filter(|&r| r == 1)
        .unwrap_or(2)
}

/// The b1-plane launches take 1 (Q1_0) or 2 (Q2_0 g128 / PQ2_0) code planes.
fn check_planes(name: &str, planes: usize) -> Result<()> {
    if planes == 1 || planes == 2 {
        Ok(())
    } else {
        Err(CudaError(format!(
            "{name}: {planes} code planes (1 for Q1_0, 2 for Q2_0)"
        )))
    }
}

/// The checks and kernel arguments shared by the b1-plane launches ([`Gpu::mv_b1p`],
/// [`Gpu::mv_b1q`]): up to `max_rows` activation rows and [`MAX_SEGS`] segments, `n_in` a
/// multiple of 256 and every `n_out` of 16, the activations `x` = (codes, scales, sums) aligned
/// to 16, `xu_align` and 16 bytes. The arguments and the 16-row tile count over all segments, or
/// `None` when there are no tiles.
fn b1_plane_args(
    name: &str,
    segs: &[MvSeg],
    x: (u64, u64, u64),
    xu_align: u64,
    (n_in, n, max_rows): (usize, usize, usize),
    accumulate: bool,
) -> Result<Option<(Vec<Arg>, usize)>> {
    let (xc, xu, xs) = x;
    if !(1..=max_rows).contains(&n) || !(1..=MAX_SEGS).contains(&segs.len()) {
        return Err(CudaError(format!(
            "{name}: {n} rows, {} segments",
            segs.len()
        )));
    }
    if n_in == 0 || n_in % 256 != 0 || segs.iter().any(|s| s.n_out % 16 != 0) {
        return Err(CudaError(format!(
            "{name}: n_in {n_in} must be a multiple of 256 and every n_out of 16"
        )));
    }
    if xc % 16 != 0 || xu % xu_align != 0 || xs % 16 != 0 {
        return Err(CudaError(format!(
            "{name}: misaligned activations {xc:#x} xu {xu:#x} xs {xs:#x}"
        )));
    }
    let mut args = Vec::with_capacity(4 * MAX_SEGS + 7);
    // 16-row tiles over all segments (every n_out is a multiple of 16, checked above)
    let tiles = push_seg_args(&mut args, segs, MAX_SEGS, 16);
    if tiles == 0 {
        return Ok(None);
    }
    args.extend([
        Arg::P(xc),
        Arg::P(xu),
        Arg::P(xs),
        Arg::I(n_in as i32),
        Arg::I(n as i32),
        Arg::I(accumulate as i32),
        Arg::I(1),
    ]);
    Ok(Some((args, tiles)))
}

/// Dynamic shared memory of a one-row b1-plane launch that holds its activation row
/// (`mvbp_q1_n1x_*`, width `n_in`): planes (2 bytes an element), then per 128-element block 4
/// i32 sums and one f32 unit.
pub fn mvbp_xs_bytes(n_in: usize) -> usize {
    2 * n_in + n_in / 128 * 20
}

/// Widest input the b1-plane timing substitution's scratch planes cover.
const B1P_TIMING_MAX_IN: usize = 32_768;
/// Output rows of the timing substitution's scratch for the SwiGLU gate‖up launch.
const B1P_TIMING_MAX_OUT: usize = 65_536;

/// The fewest rows of a launch the b1-plane timing substitution takes: 8,192 (the launches whose
/// input is an RMS norm: GDN / attention in-projections, gate‖up, the head; on the H200 the
/// 5,120-row launches were slower on b1-planes), or `BONSAI_CUDA_B1P_MIN_ROWS` (read once).
fn b1p_timing_min_rows() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| env_usize("BONSAI_CUDA_B1P_MIN_ROWS").unwrap_or(8192))
}

/// Scratch of the b1-plane timing substitution ([`Gpu::set_b1p_timing`]): zeroed activation
/// planes `[MVBP_MAX_ROWS, B1P_TIMING_MAX_IN / 256, 32]` uint4, block scales and sums, and output
/// rows for the gate‖up launch (whose real output is the quantized SwiGLU).
struct B1pTiming {
    planes: DevBuf,
    u: DevBuf,
    sa: DevBuf,
    y: DevBuf,
}

/// Whether an environment variable is set to `1` (the on value of every `BONSAI_CUDA_*` switch
/// that is off by default).
fn env_on(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// An environment variable read as an unsigned integer (`None`: unset or not a number).
fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// A `one-row,more-rows` pair of counts from `$name` (`BONSAI_CUDA_ATTN_GY=96,32`): each part that
/// is missing, unparsable or fails `ok` takes its default.
fn env_pair(name: &str, default: [usize; 2], ok: impl Fn(usize) -> bool) -> [AtomicUsize; 2] {
    let v = std::env::var(name).unwrap_or_default();
    let mut it = v.split(',').map(|x| x.trim().parse::<usize>().ok());
    default.map(|d| AtomicUsize::new(it.next().flatten().filter(|&v| ok(v)).unwrap_or(d)))
}

/// The shared-memory carveout (percent) every kernel but the n-row verify mat-vecs gets once a
/// staged launch runs, unless one was chosen ([`Gpu::set_carveout`], `BONSAI_CUDA_CARVEOUT`): the
/// staged kernels need much of the unified L1 as shared memory, and one setting for all decode
/// kernels spares the SMs a carveout switch (a drain) before and after each staged launch. The
/// verify mat-vecs keep the driver's choice: they re-read up to 8 activation rows from L1.
/// 58 % (132 KiB of shared memory on the H200) leaves the other kernels more L1 and still holds 4
/// staged blocks per SM: Q2_0 decode graph 3.396 ms/token at 100 %, 3.352 at 58 or 64 %, 3.38 at
/// 72 %, 3.77 at 30–50 % (too few staged blocks); `bench/results/cuda-gate-up-swi-27b.json`.
pub const STAGED_CARVEOUT: u8 = 58;

/// Rows per warp of the staged kernel (`BONSAI_CUDA_MVS_ROWS`: 1, 2 or 4; unset or 0: chosen
/// per launch by [`mvs_layout`]).
fn mvs_rows_env() -> usize {
    env_usize("BONSAI_CUDA_MVS_ROWS")
        .filter(|r| matches!(r, 1 | 2 | 4))
        .unwrap_or(0)
}

/// Stages of the staged decode mat-vec's shared-memory ring (`BONSAI_CUDA_MVS_STAGES`, 1 to 8;
/// unset or 0: chosen per launch by [`mvs_layout`]).
fn mvs_stages_env() -> usize {
    env_usize("BONSAI_CUDA_MVS_STAGES")
        .filter(|&s| s <= 8)
        .unwrap_or(0)
}

/// Shared-memory layout of a staged decode mat-vec launch (`kernels/mvs.cu`): rows per warp,
/// bytes of one ring stage, stages, and the dynamic shared memory of a block; `None` where the
/// kernel cannot take the shape (every bulk copy must be a multiple of 16 bytes, so `n_in` a
/// multiple of 1024). The float order does not depend on the rows per warp (only on `ks`), so
/// `r` is free: `rows` if not 0, else `r_plan`, or 2 where a stage of `r_plan` would pass 24 KiB.
/// Stages: `stages` if not 0, else 2 (the H200 sweep: more stages cost resident blocks and were
/// slower).
pub fn mvs_layout(
    kind: WKind,
    n_in: usize,
    r_plan: usize,
    ks: usize,
    stages: usize,
    rows: usize,
) -> Option<(usize, usize, usize, usize)> {
    let (code_row, be) = match kind {
        WKind::Q1 => (n_in / 8, 128),
        WKind::Q2 => (n_in / 4, 128),
        WKind::Q2G64 => (n_in / 4, 64),
        _ => return None,
    };
    if n_in == 0
        || n_in % 1024 != 0
        || !matches!(ks, 1 | 2 | 4)
        || !matches!(r_plan, 1 | 2 | 4)
        || !matches!(rows, 0 | 1 | 2 | 4)
    {
        return None;
    }
    let nblk = n_in / be;
    let stage = |r: usize| {
        let rows = (MV_WARPS / ks) * r;
        rows * code_row + (rows * nblk * 2).next_multiple_of(16)
    };
    let r = if rows > 0 {
        rows
    } else if r_plan == 4 && stage(4) > 24 << 10 {
        2
    } else {
        r_plan
    };
    let sb = stage(r);
    let act = n_in + 8 * (n_in / 32);
    let s = if stages > 0 { stages } else { 2 };
    Some((r, sb, s, act + s * sb))
}

/// One row's statistics as `logit_stats_rows` writes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitRowStats {
    /// First maximum; `None` when no logit is finite or above −inf.
    pub argmax: Option<u32>,
    pub max: f32,
    pub lse: f64,
}

impl LogitRowStats {
    /// Decode the 4 words of one row.
    pub fn from_words(w: &[u32]) -> LogitRowStats {
        LogitRowStats {
            argmax: (w[0] != 0x7fff_ffff).then_some(w[0]),
            max: f32::from_bits(w[1]),
            lse: f64::from_bits(w[2] as u64 | (w[3] as u64) << 32),
        }
    }
}

/// Decode one row of [`Gpu::topk_rows`]' output (`[TOPK_ROW, 2]` u32): the `(id, value)` pairs
/// with `id < nv`, best first.
pub fn topk_from_words(w: &[u32], nv: usize) -> Vec<(u32, f32)> {
    w.chunks_exact(2)
        .filter(|p| (p[0] as usize) < nv)
        .map(|p| (p[0], f32::from_bits(p[1])))
        .collect()
}

/// Host twin of `logit_stats_rows` for one row: NaN read as −inf, the first maximum and its value,
/// and the log-sum-exp in f64 (`argmax: None` when no logit is above −inf).
pub fn host_logit_stats(row: &[f32]) -> LogitRowStats {
    let clean = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let mut best = 0usize;
    for (i, &x) in row.iter().enumerate() {
        if clean(x) > clean(row[best]) {
            best = i;
        }
    }
    let m = row.get(best).copied().map_or(f32::NEG_INFINITY, clean);
    if m == f32::NEG_INFINITY {
        return LogitRowStats {
            argmax: None,
            max: m,
            lse: f64::NEG_INFINITY,
        };
    }
    let sum: f64 = row
        .iter()
        .map(|&x| (clean(x) as f64 - m as f64).exp())
        .sum();
    LogitRowStats {
        argmax: Some(best as u32),
        max: m,
        lse: m as f64 + sum.ln(),
    }
}

/// Host twin of [`Gpu::topk_rows`] for one row: its `min(TOPK_ROW, row.len())` best entries, best
/// first, by value descending then the lower id, with NaN read as −inf and −0 as +0.
pub fn host_topk_row(row: &[f32]) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
            (i as u32, if v == 0.0 { 0.0 } else { v })
        })
        .collect();
    // no NaN is left, so the order is total
    all.sort_unstable_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    all.truncate(TOPK_ROW);
    all
}

/// Whether `got` (from [`topk_from_words`]) is [`host_topk_row`]`(row)`, every entry bit for bit.
pub fn host_topk_matches(row: &[f32], got: &[(u32, f32)]) -> bool {
    let want = host_topk_row(row);
    want.len() == got.len()
        && want
            .iter()
            .zip(got)
            .all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits())
}

/// One matrix of a grouped mat-vec launch: re-tiled codes and scales, output `y [n, n_out]` f32.
#[derive(Clone, Copy, Debug)]
pub struct MvSeg {
    pub codes: u64,
    pub scales: u64,
    pub y: u64,
    pub n_out: usize,
}

/// A CUDA-side failure, with context.
#[derive(Debug)]
pub struct CudaError(pub String);

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for CudaError {}

pub type Result<T> = std::result::Result<T, CudaError>;

fn err<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> CudaError + '_ {
    move |e| CudaError(format!("{what}: {e:?}"))
}

/// True when the CUDA driver library loads and reports at least one device. Never panics.
pub fn cuda_available() -> bool {
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made when it is absent.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    cu::init().is_ok() && cu::device::get_count().map(|n| n > 0).unwrap_or(false)
}

/// True when libnvrtc loads (needed only when no cached cubin exists).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen libnvrtc.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// `BONSAI_CUDA_NO_GRIDDEP=1`: compile the kernels without the programmatic-dependent-launch
/// instructions (and launch without PDL). A benchmark switch for A/B runs; part of the cache key.
fn no_griddep() -> bool {
    env_on("BONSAI_CUDA_NO_GRIDDEP")
}

/// FNV-1a 64-bit (cache key; stable across builds and platforms).
fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// The cubin cache folder: `$BONSAI_CUDA_CACHE`, else `$XDG_CACHE_HOME/bonsai/cuda`, else
/// `~/.cache/bonsai/cuda`, else the temp dir.
pub fn cache_dir() -> PathBuf {
    if let Ok(p) = std::env::var("BONSAI_CUDA_CACHE") {
        return PathBuf::from(p);
    }
    if let Ok(p) = std::env::var("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("bonsai").join("cuda");
    }
    if let Ok(p) = std::env::var("HOME") {
        return PathBuf::from(p).join(".cache").join("bonsai").join("cuda");
    }
    std::env::temp_dir().join("bonsai-cuda")
}

fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0i32, 0i32);
    // SAFETY: out-pointers to two live ints.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError(format!("nvrtcVersion: {r:?}")));
    }
    Ok((a, b))
}

/// Compile `src` to a cubin for `sm_{major}{minor}` with NVRTC (sm_90 as `sm_90a`, the target
/// with the warpgroup MMA the prefill GEMM uses; such a cubin runs on compute capability 9.0
/// only, which is the device it is built for). Returns the cubin bytes.
pub fn compile_cubin(src: &str, major: i32, minor: i32) -> Result<Vec<u8>> {
    let csrc = CString::new(src).map_err(err("kernel source"))?;
    let prog =
        nvrtc_r::create_program(&csrc, Some(c"bonsai.cu")).map_err(err("nvrtcCreateProgram"))?;
    let suffix = if (major, minor) == (9, 0) { "a" } else { "" };
    let mut opts = vec![
        format!("--gpu-architecture=sm_{major}{minor}{suffix}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ];
    if no_griddep() {
        opts.push("-DBONSAI_NO_GRIDDEP".to_string());
    }
    // SAFETY: prog is a live program; options are valid strings.
    let res = unsafe { nvrtc_r::compile_program(prog, &opts) };
    if res.is_err() {
        // SAFETY: prog is live.
        let log = unsafe { nvrtc_r::get_program_log(prog) }
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        // SAFETY: prog is live and destroyed once.
        let _ = unsafe { nvrtc_r::destroy_program(prog) };
        return Err(CudaError(format!("NVRTC compile failed:\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: prog compiled; size is a live out-pointer.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        // SAFETY: prog is live and destroyed once.
        let _ = unsafe { nvrtc_r::destroy_program(prog) };
        return Err(CudaError(format!("nvrtcGetCUBINSize: {r:?}")));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: cubin has exactly `size` bytes as NVRTC reported.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _) };
    // SAFETY: prog is live and destroyed once.
    let _ = unsafe { nvrtc_r::destroy_program(prog) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError(format!("nvrtcGetCUBIN: {r:?}")));
    }
    Ok(cubin)
}

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded_cubins.rs"));
}

/// Where a module's cubin came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CubinSource {
    /// Precompiled at wheel build (`scripts/build_cubins.py`) for this exact source and arch.
    Embedded,
    /// The on-disk cache of an earlier NVRTC compile.
    Cache,
    /// Compiled by NVRTC just now (and cached).
    Nvrtc,
}

/// The embedded cubin for `sm_{major}{minor}`, when one was built from this exact source.
pub fn embedded_cubin(major: i32, minor: i32) -> Option<&'static [u8]> {
    if no_griddep() || embedded::EMBEDDED_SOURCE_HASH != format!("{:016x}", source_hash()) {
        return None;
    }
    embedded::EMBEDDED_CUBINS
        .iter()
        .find(|(a, b, _)| *a == major && *b == minor)
        .map(|(_, _, c)| *c)
}

/// The architectures with an embedded cubin for this source (empty when the crate was built
/// without `scripts/build_cubins.py`).
pub fn embedded_archs() -> Vec<(i32, i32)> {
    if embedded::EMBEDDED_SOURCE_HASH != format!("{:016x}", source_hash()) {
        return Vec::new();
    }
    embedded::EMBEDDED_CUBINS
        .iter()
        .map(|(a, b, _)| (*a, *b))
        .collect()
}

/// The cache key of the kernel source (and the compile switches that change the cubin).
fn source_hash() -> u64 {
    fnv64(&[
        SOURCE.as_bytes(),
        if no_griddep() { b"no-griddep" } else { b"" },
    ])
}

/// The cubin for this GPU: from the disk cache when present, else compiled and cached.
/// Returns the bytes and whether they came from the cache.
pub fn cubin_for(major: i32, minor: i32) -> Result<(Vec<u8>, bool)> {
    let dir = cache_dir();
    let src_hash = source_hash();
    // The NVRTC version is part of the key, but asking for it needs libnvrtc; a cache hit must work
    // without it, so the file name carries the version and any matching file is accepted when
    // NVRTC is absent.
    let prefix = format!("bonsai-{src_hash:016x}-sm{major}{minor}-nvrtc");
    if nvrtc_available() {
        let (va, vb) = nvrtc_version()?;
        let path = dir.join(format!("{prefix}{va}.{vb}.cubin"));
        if let Ok(b) = std::fs::read(&path) {
            if !b.is_empty() {
                return Ok((b, true));
            }
        }
        let cubin = compile_cubin(SOURCE, major, minor)?;
        if std::fs::create_dir_all(&dir).is_ok() {
            let tmp = dir.join(format!("{prefix}{va}.{vb}.{}.tmp", std::process::id()));
            if std::fs::write(&tmp, &cubin).is_ok() {
                let _ = std::fs::rename(&tmp, &path);
            }
        }
        Ok((cubin, false))
    } else {
        let rd = std::fs::read_dir(&dir).map_err(|_| {
            CudaError(format!(
                "libnvrtc not found and no cached kernels in {}: install NVRTC (pip install \
                 nvidia-cuda-nvrtc) or put it on LD_LIBRARY_PATH",
                dir.display()
            ))
        })?;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) && name.ends_with(".cubin") {
                if let Ok(b) = std::fs::read(e.path()) {
                    return Ok((b, true));
                }
            }
        }
        Err(CudaError(format!(
            "libnvrtc not found and no cached kernels for sm_{major}{minor} in {}",
            dir.display()
        )))
    }
}

/// A device allocation, freed on drop.
pub struct DevBuf {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a device pointer is a plain address valid in its context from any thread; frees bind the
// context first.
unsafe impl Send for DevBuf {}
// SAFETY: see Send; &DevBuf exposes only the address.
unsafe impl Sync for DevBuf {}

impl DevBuf {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Address of byte `off`.
    pub fn at(&self, off: usize) -> u64 {
        debug_assert!(off <= self.bytes);
        self.ptr + off as u64
    }
}

/// Page-locked (pinned) host memory, freed on drop. Stream copies to and from it are truly
/// asynchronous and can be captured into a graph (pageable copies cannot).
pub struct PinnedBuf {
    ptr: *mut c_void,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a host allocation usable from any thread; the owner orders host access against the
// stream (write before launch, read after sync).
unsafe impl Send for PinnedBuf {}
// SAFETY: see Send; shared access only reads.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The first `n` f32 values. The caller must have synchronized the stream after the last copy
    /// into the buffer.
    pub fn f32s(&self, n: usize) -> &[f32] {
        assert!(n * 4 <= self.bytes, "pinned read out of bounds");
        // SAFETY: ptr is a live host allocation of `bytes` (page aligned), n·4 ≤ bytes, and f32 has
        // no invalid bit patterns.
        unsafe { std::slice::from_raw_parts(self.ptr as *const f32, n) }
    }
    /// The first `n` u32 values (same contract as [`PinnedBuf::f32s`]).
    pub fn u32s(&self, n: usize) -> &[u32] {
        assert!(n * 4 <= self.bytes, "pinned read out of bounds");
        // SAFETY: ptr is a live host allocation of `bytes` (page aligned), n·4 ≤ bytes, and u32 has
        // no invalid bit patterns.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u32, n) }
    }
    /// Write `v` at element offset `i` (i32 slots). No copy may be in flight from this buffer.
    pub fn set_i32(&mut self, i: usize, v: i32) {
        assert!((i + 1) * 4 <= self.bytes, "pinned write out of bounds");
        // SAFETY: in bounds of a live, page-aligned host allocation; &mut self gives exclusivity.
        unsafe { (self.ptr as *mut i32).add(i).write(v) }
    }
    /// Write `v` from byte offset `off`. No copy may be in flight from this buffer.
    pub fn write<T: Copy>(&mut self, off: usize, v: &[T]) {
        let n = std::mem::size_of_val(v);
        assert!(off + n <= self.bytes, "pinned write out of bounds");
        // SAFETY: in bounds of a live host allocation; &mut self gives exclusivity; T: Copy is
        // plain data, copied bytewise (no alignment needed for a byte copy).
        unsafe {
            std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, self.at(off) as *mut u8, n)
        }
    }
    /// Read `dst.len()` i32 values from byte offset `off`. The caller must have synchronized the
    /// stream after the last copy into the buffer.
    pub fn read_i32s(&self, off: usize, dst: &mut [i32]) {
        let n = std::mem::size_of_val(dst);
        assert!(off + n <= self.bytes, "pinned read out of bounds");
        // SAFETY: in bounds of a live host allocation, copied bytewise into dst; every bit pattern
        // is a valid i32.
        unsafe {
            std::ptr::copy_nonoverlapping(self.at(off) as *const u8, dst.as_mut_ptr() as *mut u8, n)
        }
    }
    /// Address of byte `off`, as a host pointer.
    fn at(&self, off: usize) -> *mut c_void {
        debug_assert!(off <= self.bytes);
        // SAFETY: off ≤ bytes, inside the allocation.
        unsafe { (self.ptr as *mut u8).add(off) as *mut c_void }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if !self.ptr.is_null() && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from malloc_host in this context and is freed once.
            let _ = unsafe { cu::free_host(self.ptr) };
        }
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr != 0 && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from malloc_sync in this context and is freed once.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

/// A kernel argument: a device pointer, an i32 or an f32.
#[derive(Clone, Copy)]
pub enum Arg {
    P(u64),
    I(i32),
    F(f32),
}

impl Arg {
    /// The 8-byte slot the launch reads from (little-endian: a 4-byte param reads the low half).
    fn slot(self) -> u64 {
        match self {
            Arg::P(p) => p,
            Arg::I(i) => i as u32 as u64,
            Arg::F(f) => f.to_bits() as u64,
        }
    }
}

/// The parameter list `gdn_step` and `gdn_step_seq*` share (see [`Gpu::gdn_step`]).
#[allow(clippy::too_many_arguments)]
fn gdn_step_args(
    s: u64,
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    n: usize,
    out: u64,
) -> [Arg; 12] {
    [
        Arg::P(s),
        Arg::P(q),
        Arg::P(k),
        Arg::P(v),
        Arg::P(g),
        Arg::P(beta),
        Arg::I(hk as i32),
        Arg::I(hv as i32),
        Arg::I(dk as i32),
        Arg::I(dv as i32),
        Arg::I(n as i32),
        Arg::P(out),
    ]
}

/// The parameter list `gdn_conv` and `gdn_conv_rows` share (see [`Gpu::gdn_conv`]).
#[allow(clippy::too_many_arguments)]
fn gdn_conv_args(
    mixed: u64,
    conv_state: u64,
    convw: u64,
    kconv: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    n: usize,
    eps: f32,
    qo: u64,
    ko: u64,
    vo: u64,
    bb: u64,
    aa: u64,
    dt_bias: u64,
    ssm_a: u64,
    beta: u64,
    g: u64,
) -> [Arg; 18] {
    [
        Arg::P(mixed),
        Arg::P(conv_state),
        Arg::P(convw),
        Arg::I(kconv as i32),
        Arg::I(hk as i32),
        Arg::I(hv as i32),
        Arg::I(dk as i32),
        Arg::I(n as i32),
        Arg::F(eps),
        Arg::P(qo),
        Arg::P(ko),
        Arg::P(vo),
        Arg::P(bb),
        Arg::P(aa),
        Arg::P(dt_bias),
        Arg::P(ssm_a),
        Arg::P(beta),
        Arg::P(g),
    ]
}

/// Push the per-segment kernel parameters `codes, scales, y, n_out` of `slots` segments (unused
/// slots are zero, n_out = 0) and return the number of row groups of `rpw` rows over all of them.
/// Shared by the mat-vec, GEMM and Q4_1 launchers.
pub(crate) fn push_seg_args(
    args: &mut Vec<Arg>,
    segs: &[MvSeg],
    slots: usize,
    rpw: usize,
) -> usize {
    let mut groups = 0usize;
    for i in 0..slots {
        let sg = segs.get(i).copied().unwrap_or(MvSeg {
            codes: 0,
            scales: 0,
            y: 0,
            n_out: 0,
        });
        groups += sg.n_out.div_ceil(rpw);
        args.extend([
            Arg::P(sg.codes),
            Arg::P(sg.scales),
            Arg::P(sg.y),
            Arg::I(sg.n_out as i32),
        ]);
    }
    groups
}

/// The parameter list of both SwiGLU gate‖up kernels (`MV_SWI_ENTRY` in bonsai.cu,
/// `MVS_SWI_ENTRY` in mvs.cu): gate and up codes / scales, n_out, the activations, n_in, pre, then
/// where SiLU(gate) ⊙ up goes.
fn swi_args(
    (gate_codes, gate_scales): (u64, u64),
    (up_codes, up_scales): (u64, u64),
    n_out: usize,
    (q, d, s): (u64, u64, u64),
    n_in: usize,
    pre: bool,
    out: QuantOut,
) -> [Arg; 14] {
    [
        Arg::P(gate_codes),
        Arg::P(gate_scales),
        Arg::P(up_codes),
        Arg::P(up_scales),
        Arg::I(n_out as i32),
        Arg::P(q),
        Arg::P(d),
        Arg::P(s),
        Arg::I(n_in as i32),
        Arg::I(pre as i32),
        Arg::P(out.f),
        Arg::P(out.q),
        Arg::P(out.d),
        Arg::P(out.s),
    ]
}

/// How many workers (≤ `cap`, at least 1 unit each) share `units` so that each takes the same
/// number of units ± 1: the grid of the persistent mat-vec kernels.
fn balanced_count(units: usize, cap: usize) -> usize {
    units.div_ceil(units.div_ceil(cap.max(1)))
}

/// The kernel of a family's table by rows per work unit (1, 2, 4) and K split (1, 2, 4).
fn pick_r_ks(
    t: [[sys::CUfunction; 3]; 3],
    family: &str,
    unit: &str,
    r: usize,
    ks: usize,
) -> Result<sys::CUfunction> {
    match (r, ks) {
        (1 | 2 | 4, 1 | 2 | 4) => Ok(t[r.trailing_zeros() as usize][ks.trailing_zeros() as usize]),
        _ => Err(CudaError(format!(
            "mv_lowbit ({family}): no variant with {r} rows per {unit}, K split {ks}"
        ))),
    }
}

/// The parameter list every low-bit mat-vec family shares (`MV_SEG_ENTRY` in the source) for
/// `segs` with `rpw` weight rows per work unit, and the number of row groups of `rpw` rows.
#[allow(clippy::too_many_arguments)]
fn mv_seg_args(
    segs: &[MvSeg],
    rpw: usize,
    x: u64,
    d: u64,
    s: u64,
    n_in: usize,
    n: usize,
    accumulate: bool,
    plan: MvPlan,
) -> (Vec<Arg>, usize) {
    let mut args = Vec::with_capacity(4 * MAX_SEGS + 7);
    let groups = push_seg_args(&mut args, segs, MAX_SEGS, rpw);
    args.extend([
        Arg::P(x),
        Arg::P(d),
        Arg::P(s),
        Arg::I(n_in as i32),
        Arg::I(n as i32),
        Arg::I(accumulate as i32),
        Arg::I(plan.pre as i32),
    ]);
    (args, groups)
}

macro_rules! kernels {
    (pdl: [$($p:ident),* $(,)?], plain: [$($q:ident),* $(,)?] $(,)?) => {
        /// Function handles of every kernel in the module.
        #[allow(non_snake_case)]
        struct Funcs { $($p: sys::CUfunction,)* $($q: sys::CUfunction,)* }
        /// The names of the kernels launched with programmatic stream serialization (the `pdl`
        /// list; `tests::pdl_kernels_wait_first` checks their source).
        #[cfg(test)]
        const PDL_NAMES: &[&str] = &[$(stringify!($p)),*];
        impl Funcs {
            fn load(module: sys::CUmodule) -> Result<Funcs> {
                Ok(Funcs {
                    $($p: Self::get(module, stringify!($p))?,)*
                    $($q: Self::get(module, stringify!($q))?,)*
                })
            }
            fn get(module: sys::CUmodule, name: &str) -> Result<sys::CUfunction> {
                let n = CString::new(name).expect("kernel name");
                // SAFETY: module is a live module loaded from our cubin.
                unsafe { cu::module::get_function(module, n) }.map_err(err(name))
            }
            /// The kernel name of a handle of this table (profiling).
            fn name(&self, f: sys::CUfunction) -> &'static str {
                $(if f == self.$p { return stringify!($p); })*
                $(if f == self.$q { return stringify!($q); })*
                "?"
            }
            /// Whether the kernel calls `PDL_WAIT` before any dependent memory access (and so may
            /// be launched with programmatic stream serialization).
            fn pdl_aware(&self, f: sys::CUfunction) -> bool {
                $(if f == self.$p { return true; })*
                false
            }
            /// Every kernel of the module, with its name.
            fn all(&self) -> Vec<(&'static str, sys::CUfunction)> {
                vec![$((stringify!($p), self.$p),)* $((stringify!($q), self.$q),)*]
            }
        }
    };
}

// `pdl`: kernels that start with `PDL_WAIT` (bonsai.cu); they are launched with programmatic
// stream serialization when it is on. `plain`: every other kernel (always a full dependency).
kernels!(
    pdl: [
        quant_rows,
        rmsnorm_quant,
        rmsnorm_quant_rows,
        // spec.cu (the speculative round's record and rollback, the DSpark drafter)
        gdn_rec_write,
        gdn_replay,
        gdn_replay_layers,
        mv_q41,
        mv_q41_n4,
        mv_q41_n4f,
        mvt_q41,
        dsp_norm_rope,
        dsp_copy_rows,
        dsp_attn_part,
        dsp_attn_part_e1,
        dsp_attn_part_e2,
        dsp_attn_part_e4,
        dsp_attn_kv,
        dsp_attn_merge,
        dsp_markov_scores,
        mv_q1_n8_k1,
        mv_q1_n8_k2,
        mv_q1_n8_k4,
        mv_q1_n8r4_k1,
        mv_q1_n8r4_k2,
        mv_q1_n8r4_k4,
        mv_q1_n5r4_k1,
        mv_q1_n5r4_k2,
        mv_q1_n5r4_k4,
        mv_q1_n5r8_k1,
        mv_q1_n5r8_k2,
        mv_q1_n5r8_k4,
        mv_q1_n5r4f_k1,
        mv_q1_n5r4f_k2,
        mv_q1_n5r4f_k4,
        mv_q1_n5r8f_k1,
        mv_q1_n5r8f_k2,
        mv_q1_n5r8f_k4,
        mv_q1_n3r4s_k1,
        mv_q1_n3r4s_k2,
        mv_q1_n3r4s_k4,
        mv_q1_n3r8s_k1,
        mv_q1_n3r8s_k2,
        mv_q1_n3r8s_k4,
        mv_q1_n1_r2_k1,
        mv_q1_n1_r2_k2,
        mv_q1_n1_r2_k4,
        mv_q1_n1_r4_k1,
        mv_q1_n1_r4_k2,
        mv_q1_n1_r4_k4,
        mv_q1_n1_r8_k1,
        mv_q1_n1_r8_k2,
        mv_q1_n1_r8_k4,
        mv_q2_n8_k1,
        mv_q2_n8_k2,
        mv_q2_n8_k4,
        mv_q2_n8r4_k1,
        mv_q2_n8r4_k2,
        mv_q2_n8r4_k4,
        mv_q2_n5r4_k1,
        mv_q2_n5r4_k2,
        mv_q2_n5r4_k4,
        mv_q2_n5r8_k1,
        mv_q2_n5r8_k2,
        mv_q2_n5r8_k4,
        mv_q2_n5r4f_k1,
        mv_q2_n5r4f_k2,
        mv_q2_n5r4f_k4,
        mv_q2_n5r8f_k1,
        mv_q2_n5r8f_k2,
        mv_q2_n5r8f_k4,
        mv_q2_n3r4s_k1,
        mv_q2_n3r4s_k2,
        mv_q2_n3r4s_k4,
        mv_q2_n3r8s_k1,
        mv_q2_n3r8s_k2,
        mv_q2_n3r8s_k4,
        mv_q2_n1_r2_k1,
        mv_q2_n1_r2_k2,
        mv_q2_n1_r2_k4,
        mv_q2_n1_r4_k1,
        mv_q2_n1_r4_k2,
        mv_q2_n1_r4_k4,
        mv_q2_n1_r8_k1,
        mv_q2_n1_r8_k2,
        mv_q2_n1_r8_k4,
        mv_q2g64_n8_k1,
        mv_q2g64_n8_k2,
        mv_q2g64_n8_k4,
        mv_q2g64_n8r4_k1,
        mv_q2g64_n8r4_k2,
        mv_q2g64_n8r4_k4,
        mv_q2g64_n5r4_k1,
        mv_q2g64_n5r4_k2,
        mv_q2g64_n5r4_k4,
        mv_q2g64_n5r8_k1,
        mv_q2g64_n5r8_k2,
        mv_q2g64_n5r8_k4,
        mv_q2g64_n5r4f_k1,
        mv_q2g64_n5r4f_k2,
        mv_q2g64_n5r4f_k4,
        mv_q2g64_n5r8f_k1,
        mv_q2g64_n5r8f_k2,
        mv_q2g64_n5r8f_k4,
        mv_q2g64_n3r4s_k1,
        mv_q2g64_n3r4s_k2,
        mv_q2g64_n3r4s_k4,
        mv_q2g64_n3r8s_k1,
        mv_q2g64_n3r8s_k2,
        mv_q2g64_n3r8s_k4,
        mv_q2g64_n1_r2_k1,
        mv_q2g64_n1_r2_k2,
        mv_q2g64_n1_r2_k4,
        mv_q2g64_n1_r4_k1,
        mv_q2g64_n1_r4_k2,
        mv_q2g64_n1_r4_k4,
        mv_q2g64_n1_r8_k1,
        mv_q2g64_n1_r8_k2,
        mv_q2g64_n1_r8_k4,
        mv_q1_n1_r8_k1_swi,
        mv_q2_n1_r8_k1_swi,
        mv_q2g64_n1_r8_k1_swi,
        mv_f32,
        embed_rows,
        gdn_conv,
        gdn_step,
        gdn_conv_step,
        gdn_conv_step_norm_d128,
        gdn_conv_step_norm_snap_d128,
        gdn_conv_step_norm_bn_d128,
        gdn_conv_step_norm_early_d128,
        gdn_conv_step_norm_bn_early_d128,
        gdn_conv_step_norm_bn_pw_d128,
        gdn_conv_step_norm_p16_d128,
        gated_norm_quant,
        gated_norm_quant_v4,
        attn_prep,
        attn_chunks_hd64,
        attn_chunks_hd128,
        attn_chunks_hd256,
        attn_chunks_hd256_h2,
        attn_chunks_hd256_h3,
        attn_chunks_hd256_h6,
        attn_merge_quant,
        attn_merge_quant_serial,
        swiglu_quant,
        swiglu_quant_v4,
        swiglu_quant_p16,
        argmax_rows,
        logit_stats_rows,
        topk_rows,
        step_advance,
        // ---- prefill.cu (n > MAX_ROWS) ----
        gdn_conv_rows,
        gdn_conv_rows_k4,
        gdn_conv_window,
        gdn_step_seq,
        gdn_step_seq_d128,
        gdn_chunk_prep_d128,
        gdn_chunk_scan_d128,
        gdn_chunk_scan_tc_d128,
        attn_prefill_hd64,
        attn_prefill_hd128,
        attn_prefill_hd256,
        attn_prefill_tc_hd64,
        attn_prefill_tc_hd128,
        attn_prefill_tc_hd256,
        // ---- mvbp.cu (b1-plane decode mat-vec, int8 tensor-core verify) ----
        mvbp_q1_n1_k1,
        mvbp_q1_n1_k2,
        mvbp_q1_n1_k4,
        mvbp_q1_n1_k8,
        mvbp_q1_n1_k16,
        mvbp_q1_n5_k1,
        mvbp_q1_n5_k2,
        mvbp_q1_n5_k4,
        mvbp_q1_n5_k8,
        mvbp_q1_n5_k16,
        mvbp_q1_n1_k1_swi,
        mvbp_q1_n1x_k1,
        mvbp_q1_n1x_k2,
        mvbp_q1_n1x_k4,
        mvbp_q1_n1x_k8,
        mvbp_q1_n1x_k16,
        mvbp_q1_n1x_k1_swi,
        mvbp_q1_n1x_k1_swi_p16,
        mvbq_q1_r1_k1,
        mvbq_q1_r1_k2,
        mvbq_q1_r1_k4,
        mvbq_q1_r1_k8,
        mvbq_q1_r1_k16,
        mvbq_q1_r2_k1,
        mvbq_q1_r2_k2,
        mvbq_q1_r2_k4,
        mvbq_q1_r2_k8,
        mvbq_q1_r2_k16,
        mvbq_q1_r2a_k1,
        mvbq_q1_r2a_k2,
        mvbq_q1_r2a_k4,
        mvbq_q1_r2a_k8,
        mvbq_q1_r2a_k16,
        mvbp_q2_n1_k1,
        mvbp_q2_n1_k2,
        mvbp_q2_n1_k4,
        mvbp_q2_n1_k8,
        mvbp_q2_n1_k16,
        mvbp_q2_n5_k1,
        mvbp_q2_n5_k2,
        mvbp_q2_n5_k4,
        mvbp_q2_n5_k8,
        mvbp_q2_n5_k16,
        mvbp_q2_n1_k1_swi,
        mvbp_q2_n1x_k1,
        mvbp_q2_n1x_k2,
        mvbp_q2_n1x_k4,
        mvbp_q2_n1x_k8,
        mvbp_q2_n1x_k16,
        mvbp_q2_n1x_k1_swi,
        mvbp_q2_n1x_k1_swi_p16,
        mvbq_q2_r1_k1,
        mvbq_q2_r1_k2,
        mvbq_q2_r1_k4,
        mvbq_q2_r1_k8,
        mvbq_q2_r1_k16,
        mvbq_q2_r2_k1,
        mvbq_q2_r2_k2,
        mvbq_q2_r2_k4,
        mvbq_q2_r2_k8,
        mvbq_q2_r2_k16,
        mvbq_q2_r2a_k1,
        mvbq_q2_r2a_k2,
        mvbq_q2_r2a_k4,
        mvbq_q2_r2a_k8,
        mvbq_q2_r2a_k16,
        launch_chain_step,
        // ---- mvp.cu (pipelined persistent decode mat-vec, n = 1) ----
        mvp_q1_r2_k1,
        mvp_q1_r2_k2,
        mvp_q1_r2_k4,
        mvp_q1_r4_k1,
        mvp_q1_r4_k2,
        mvp_q1_r4_k4,
        mvp_q2_r2_k1,
        mvp_q2_r2_k2,
        mvp_q2_r2_k4,
        mvp_q2_r4_k1,
        mvp_q2_r4_k2,
        mvp_q2_r4_k4,
        mvp_q2g64_r2_k1,
        mvp_q2g64_r2_k2,
        mvp_q2g64_r2_k4,
        mvp_q2g64_r4_k1,
        mvp_q2g64_r4_k2,
        mvp_q2g64_r4_k4,
        // ---- mvs.cu (staged persistent decode mat-vec, n = 1) ----
        mvs_q1_r1_k1,
        mvs_q1_r1_k2,
        mvs_q1_r1_k4,
        mvs_q1_r2_k1,
        mvs_q1_r2_k2,
        mvs_q1_r2_k4,
        mvs_q1_r4_k1,
        mvs_q1_r4_k2,
        mvs_q1_r4_k4,
        mvs_q2_r1_k1,
        mvs_q2_r1_k2,
        mvs_q2_r1_k4,
        mvs_q2_r2_k1,
        mvs_q2_r2_k2,
        mvs_q2_r2_k4,
        mvs_q2_r4_k1,
        mvs_q2_r4_k2,
        mvs_q2_r4_k4,
        mvs_q2g64_r1_k1,
        mvs_q2g64_r1_k2,
        mvs_q2g64_r1_k4,
        mvs_q2g64_r2_k1,
        mvs_q2g64_r2_k2,
        mvs_q2g64_r2_k4,
        mvs_q2g64_r4_k1,
        mvs_q2g64_r4_k2,
        mvs_q2g64_r4_k4,
        mvs_q1_o1_swi,
        mvs_q1_o2_swi,
        mvs_q2_o1_swi,
        mvs_q2_o2_swi,
        mvs_q2g64_o1_swi,
        mvs_q2g64_o2_swi,
    ],
    plain: [
        spin_ns,
        // ---- gemm.cu (prefill) ----
        gemm_q1,
        gemm_q2,
        gemm_q2g64,
        gemm_q1_n32,
        gemm_q2_n32,
        gemm_q2g64_n32,
        act_q8_to_f16p,
        gemmh_q1,
        gemmh_q2,
        gemmh_q2g64,
        gemmh_q1_n32,
        gemmh_q2_n32,
        gemmh_q2g64_n32,
        gemmh_q1_w8,
        gemmh_q2_w8,
        gemmh_q2g64_w8,
        gemmh_q1_w8_n32,
        gemmh_q2_w8_n32,
        gemmh_q2g64_w8_n32,
        gemmh_q1_o4,
        gemmh_q2_o4,
        gemmh_q2g64_o4,
        gemmw_available,
        gemmw_q1,
        gemmw_q2,
        gemmw_q2g64,
        gemmw_q1_s4,
        gemmw_q2_s4,
        gemmw_q2g64_s4,
        gemmws_q1,
        gemmws_q2,
        gemmws_q2g64,
        gemmws_q1_n64,
        gemmws_q2_n64,
        gemmws_q2g64_n64,
        gemmws_q1_b1p,
        gemmws_q2_b1p,
        gemmws_q1_b1p_n64,
        gemmws_q2_b1p_n64,
        gemm_splitk_sum,
    ],
);

/// A captured and instantiated CUDA graph.
pub struct Graph {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
    ctx: Arc<CudaContext>,
}
// SAFETY: graph handles are used under the owner's &mut / single-stream discipline.
unsafe impl Send for Graph {}
// SAFETY: launching is done through &Gpu on its one stream.
unsafe impl Sync for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: handles created by end_capture/instantiate, destroyed once.
            unsafe {
                let _ = cu::graph::exec_destroy(self.exec);
                let _ = cu::graph::destroy(self.graph);
            }
        }
    }
}

/// One GPU: context, one stream (and a side stream for forked graph launches), the kernel module.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The side stream of [`Gpu::launch_graph_forked`]: the speculative round's rollback replay
    /// runs there while the drafter's work (in [`Gpu::detached`] scopes) runs on `stream`.
    side: Arc<CudaStream>,
    /// Recorded on `stream` before a forked launch; `side` waits on it.
    ev_fork: sys::CUevent,
    /// Recorded on `side` after a forked launch; `stream` waits on it before its next operation
    /// outside a detached scope.
    ev_join: sys::CUevent,
    /// A forked launch `stream` has not waited for yet.
    join_pending: AtomicBool,
    /// Open [`Gpu::detached`] scopes: while > 0, `stream`'s operations do not wait for a forked
    /// launch.
    detached: AtomicUsize,
    /// [`Gpu::fork_replay`] (`BONSAI_CUDA_FORK=1` turns it on).
    fork: AtomicBool,
    f: Funcs,
    _module: sys::CUmodule,
    pub arch: (i32, i32),
    pub device_name: String,
    /// Where the cubin came from.
    pub cubin_source: CubinSource,
    /// Per-launch timings while profiling ([`Gpu::profile_begin`]): (kernel grid, µs).
    prof: Mutex<Option<Vec<(String, f32)>>>,
    /// Programmatic dependent launch for PDL-aware kernels ([`Gpu::set_pdl`]).
    pdl: AtomicBool,
    /// Whether the last operation queued on the stream was a kernel launch.
    prev_kernel: AtomicBool,
    /// A forced mat-vec plan ([`Gpu::set_mv_override`]).
    mv_override: Mutex<Option<MvPlan>>,
    /// [`MvStaged::Auto`] stages Q1_0's long launches too ([`Gpu::set_mvs_q1`],
    /// `BONSAI_CUDA_MVS_Q1=1`; off; benchmarks compare).
    mvs_q1: AtomicBool,
    /// Rows per warp of the default n ≥ 2 dp4a plans, 0: per kind ([`Gpu::set_mv_verify`]).
    mv_rn: AtomicUsize,
    /// The 5-row verify kernels: 0 off, 1 on, 2 per kind ([`Gpu::set_mv_verify`]).
    mv_n5: AtomicU8,
    /// Which one-row dp4a launches use the staged kernels ([`Gpu::mv_staged_mode`], an
    /// [`MvStaged`]).
    mv_staged: AtomicU8,
    /// Ring stages of the staged kernels (0: per launch; `BONSAI_CUDA_MVS_STAGES`).
    mvs_stages: AtomicUsize,
    /// Rows per warp of the staged kernels (0: per launch; `BONSAI_CUDA_MVS_ROWS`).
    mvs_rows: AtomicUsize,
    /// The fewest rows of a Q2 launch that the automatic mode stages.
    mvs_min_rows: AtomicUsize,
    /// The dynamic shared memory limit set on each kernel so far (only ever raised: a lower
    /// limit would fail a later launch, or graph node, that needs more).
    smem_limit: Mutex<Vec<(usize, usize)>>,
    /// The most shared memory one block may opt in to ([`Gpu::smem_optin`], read once).
    smem_optin: std::sync::OnceLock<usize>,
    /// The preferred shared-memory carveout of every kernel ([`Gpu::set_carveout`]) and whether
    /// it was chosen (then a staged launch leaves it alone).
    carveout: Mutex<(Option<u8>, bool)>,
    /// Resident blocks (SMs × blocks per SM) of each pipelined kernel, by function handle.
    resident_capacity: Mutex<Vec<((usize, usize), usize)>>,
    /// The b1-plane timing substitution ([`Gpu::set_b1p_timing`]): its zeroed activation planes
    /// and output rows, allocated when it is turned on; `None` while off.
    b1p_timing: Mutex<Option<B1pTiming>>,
    /// Projections that have a b1-plane layout and b1-plane activations run on
    /// [`Gpu::mv_b1p`] (`BONSAI_CUDA_B1P=0` turns it off; [`Gpu::set_b1p`]).
    mv_b1p: AtomicBool,
    /// [`Gpu::b1p_xs`] (`BONSAI_CUDA_B1P_XS=0` turns it off).
    b1p_xs: AtomicBool,
    /// [`Gpu::gdn_early_count`] (`BONSAI_CUDA_GDN_EARLY=0` turns it off).
    gdn_early: AtomicBool,
    /// [`Gpu::gdn_producer`] (`BONSAI_CUDA_GDN_PW=0` turns it off).
    gdn_pw: AtomicBool,
    /// [`Gpu::b1q`] (`BONSAI_CUDA_B1Q=0` turns it off).
    b1q: AtomicBool,
    /// [`Gpu::gdn_norm_batch`] (`BONSAI_CUDA_GDN_NORM_BATCH=0` turns it off).
    gdn_norm_batch: AtomicBool,
    /// [`Gpu::mv_rows_first`] (`BONSAI_CUDA_MV_ROWS_FIRST=0` turns it off).
    mv_rows_first: AtomicBool,
    /// [`Gpu::b1q_ahead`] (`BONSAI_CUDA_B1Q_AHEAD=0` turns it off).
    b1q_ahead: AtomicBool,
    /// [`Gpu::b1q_tiles`] (`BONSAI_CUDA_B1Q_R=1`).
    b1q_tiles: AtomicUsize,
    /// [`Gpu::norm_p16_only`] (`BONSAI_CUDA_NORM_P16_ONLY=0` turns it off).
    norm_p16_only: AtomicBool,
    /// [`Gpu::norm_b1q_only`] (`BONSAI_CUDA_NORM_B1Q_ONLY=0` turns it off).
    norm_b1q_only: AtomicBool,
    /// [`Gpu::spec_pdl`] (`BONSAI_CUDA_SPEC_PDL=1` turns it on).
    spec_pdl: AtomicBool,
    /// [`Gpu::norm_segs`] (`BONSAI_CUDA_NORM_SEGS`, default 1).
    norm_segs: AtomicUsize,
    /// [`Gpu::b1p_out`] (`BONSAI_CUDA_B1P_OUT=1` turns it on).
    b1p_out: AtomicBool,
    /// [`Gpu::b2p`] (`BONSAI_CUDA_B2P=0` turns it off).
    b2p: AtomicBool,
    /// [`Gpu::mv_rsplit`]: 0 off, 1 on for every kind, 2 per kind (`BONSAI_CUDA_MV_RSPLIT=0|1`;
    /// unset: 2).
    mv_rsplit: AtomicU8,
    /// Prefill GEMM launch facts (SM count, CTAs per SM of each variant), filled at first use.
    gemm_occ: std::sync::OnceLock<gemm::GemmOcc>,
    /// Whether the cubin has the warpgroup-MMA GEMM (compiled for sm_90a), asked once at start.
    gemmw_ok: bool,
    /// Swap the two stride fields of the wgmma shared-memory descriptor (a hardware check).
    gemmw_desc_swap: AtomicBool,
    /// Whether one-matrix `gemmws` launches of narrow matrices split K (`gemm::gemmws_k_splits`).
    gemm_k_split: AtomicBool,
    /// `gdn_step_seq` always takes the kernel for any head dim ([`Gpu::set_gdn_seq_generic`]).
    gdn_seq_generic: AtomicBool,
    /// How prefill runs the GDN recurrence ([`GdnPrefill`] as u8; [`Gpu::set_gdn_prefill`]).
    gdn_prefill: AtomicU8,
    /// Prefill attention on tensor cores ([`Gpu::set_attn_prefill_tc`]; `BONSAI_CUDA_ATTN_TC=0`
    /// for the FP32 kernels).
    attn_prefill_tc: AtomicBool,
    /// The chunked GDN recurrence's scratch (U0, W, P, decays), grown on demand
    /// ([`Gpu::gdn_step_chunked`], [`gdn_chunk_scratch_floats`]).
    gdn_chunk_scratch: Mutex<Option<DevBuf>>,
    /// Which prefill GEMM kernels run ([`Gpu::set_gemm_config`]; `BONSAI_CUDA_GEMM*`).
    gemm_config: Mutex<gemm::GemmConfig>,
    /// The f16 GEMM's activations: `[n, n_in]` f16 then `[n]` f32 row factors, grown on demand.
    gemm_f16_scratch: Mutex<Option<DevBuf>>,
    /// Partial sums of the K-split prefill GEMM (`gemm::gemm_part_scratch`).
    gemm_part_scratch: Mutex<Option<DevBuf>>,
    /// The row-statistics kernels' block partials `[ROW_STATS_ROWS, ROW_STATS_MAX_BLOCKS, 4]` u32
    /// and per-row arrival counters `[ROW_STATS_ROWS]` u32 (zero between launches), allocated
    /// with the GPU so that a captured launch can use them.
    row_stats: std::sync::OnceLock<DevBuf>,
    /// `topk_rows`' block selections `[TOPK_ROWS, ROW_STATS_MAX_BLOCKS, TOPK_ROW]` u64 and per-row
    /// arrival counters `[TOPK_ROWS]` u32 (zero between launches), allocated with the GPU so that
    /// a captured launch can use them.
    topk_scratch: std::sync::OnceLock<DevBuf>,
    /// `gdn_conv_step`'s per-k-head arrival counters `[GDN_CNT]` u32 (zero between launches),
    /// allocated with the GPU so that a captured launch can use them.
    gdn_cnt: std::sync::OnceLock<DevBuf>,
    /// How decode / verify GDN layers fuse their kernels ([`GdnFused`] as u8;
    /// [`Gpu::set_gdn_fused`], `BONSAI_CUDA_GDN_FUSED=0|1|2`).
    gdn_fused: AtomicU8,
    /// Rows per warp of the one-row dp4a launches of more than 15,000 rows when not 0
    /// ([`Gpu::set_mv_long_r`], `BONSAI_CUDA_MV_LONG_R`; benchmarks compare).
    mv_long_r: AtomicUsize,
    /// Decode gate‖up launches with the SwiGLU fused in where the plan allows
    /// ([`Gpu::mv_swiglu`]; `BONSAI_CUDA_SWIGLU_FUSED=0` turns it off).
    swiglu_fused: AtomicBool,
    /// Flash-decode merges take the first, one-load-per-chunk form ([`Gpu::set_attn_merge_serial`],
    /// `BONSAI_CUDA_ATTN_MERGE=serial`; the same bits, for the A/B and the bit-equality test).
    attn_merge_serial: AtomicBool,
    /// Most blocks per head (grid.y) of a flash-decode chunk launch of one row and of more rows
    /// ([`Gpu::set_attn_gy`], `BONSAI_CUDA_ATTN_GY=n1,rows`; the same bits at any value).
    attn_gy: [AtomicUsize; 2],
    /// q heads per block of a flash-decode chunk launch at head dim 256, one row and more rows
    /// ([`Gpu::set_attn_hpb`], `BONSAI_CUDA_ATTN_HPB=n1,rows`; the same bits at any value).
    attn_hpb: [AtomicUsize; 2],
    /// Kernels whose launches are dropped ([`Gpu::set_skip_kernels`]; benchmarks only).
    skip: Mutex<Vec<&'static str>>,
    /// Whether `skip` is non-empty (checked on every launch without the lock).
    skip_any: AtomicBool,
}

/// Which of a decode / verify GDN layer's kernels run fused (the same bits in every mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnFused {
    /// `gdn_conv`, `gdn_step`, `gated_norm_quant`: three launches.
    Off = 0,
    /// `gdn_conv_step` (the conv inside the recurrence), then `gated_norm_quant`.
    Conv = 1,
    /// `gdn_conv_step_norm_d128`: the gated norm fused in too, one launch (dv = 128; other
    /// heads take [`GdnFused::Conv`]).
    ConvNorm = 2,
}

impl GdnFused {
    /// Every mode, by its `u8` value.
    pub const ALL: [GdnFused; 3] = [GdnFused::Off, GdnFused::Conv, GdnFused::ConvNorm];

    /// `BONSAI_CUDA_GDN_FUSED=0|1|2`, else the default.
    fn from_env() -> GdnFused {
        match std::env::var("BONSAI_CUDA_GDN_FUSED").as_deref() {
            Ok("0") => GdnFused::Off,
            Ok("1") => GdnFused::Conv,
            Ok("2") => GdnFused::ConvNorm,
            _ => GDN_FUSED_DEFAULT,
        }
    }
}

/// The default [`GdnFused`] mode.
pub const GDN_FUSED_DEFAULT: GdnFused = GdnFused::ConvNorm;

/// Where a fused kernel writes an activation row set `[n, k]` the next mat-vec reads: f32 `f`
/// (unless 0) and the int8 codes `q` (16-byte aligned), scales `d` and code sums `s` per 32
/// (`[n, k / 32]` f32 / i32), as the quantize kernels (`gated_norm_quant`, `swiglu_quant`,
/// `attn_merge_quant`) write them.
#[derive(Clone, Copy, Debug)]
pub struct QuantOut {
    /// f32 values, or 0.
    pub f: u64,
    /// int8 codes.
    pub q: u64,
    /// Scales per 32.
    pub d: u64,
    /// Code sums per 32.
    pub s: u64,
}

/// Where a producer writes b1-plane activations `[n, k]` (the input of [`Gpu::mv_b1p`] /
/// [`Gpu::mv_b1q`], as [`Gpu::rmsnorm_quant_p16`] writes them): planes `xp` `[n, k / 256, 32, 4]`
/// u32, units `xu` `[n, k / 128]` f32, sums `xs` `[n, k / 128, 4]` i32, and the byte-split codes
/// `xv` `[n, k / 128, 4 quarters, 4 sub-blocks]` uint4 for [`Gpu::mv_b1q`] (0: not written).
/// Needs `k % 256 == 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P16Out {
    /// Bit planes.
    pub xp: u64,
    /// Block units (f32 per 128).
    pub xu: u64,
    /// Sub-block code sums (i32 per 32).
    pub xs: u64,
    /// Byte-split codes, or 0.
    pub xv: u64,
}

impl P16Out {
    fn check(&self, what: &str, k: usize) -> Result<()> {
        if k % 256 != 0
            || self.xp % 16 != 0
            || self.xu % 8 != 0
            || self.xs % 16 != 0
            || self.xv % 16 != 0
        {
            return Err(CudaError(format!(
                "{what}: b1-plane outputs need k % 256 == 0 (k = {k}) and aligned buffers (xp {:#x}, xu {:#x}, xs {:#x}, xv {:#x})",
                self.xp, self.xu, self.xs, self.xv
            )));
        }
        Ok(())
    }
}

/// Where a verify's [`Gpu::gdn_conv_step`] writes its side outputs, the pieces of the GDN verify
/// record: the L2-normed k, v and the gates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnSide {
    /// Their own buffers: k `[n, hk·dk]`, v `[n, hv·dv]`, β and g `[n, hv]` (f32), for
    /// [`Gpu::gdn_rec_write`] to copy into the record.
    Bufs { k: u64, v: u64, beta: u64, g: u64 },
    /// The record `[n, gdn_rec_width]` itself (`mixed ‖ k ‖ v ‖ g ‖ β`, f32 rows): the launch also
    /// copies each row's pre-conv input there, so no [`Gpu::gdn_rec_write`] follows. The same
    /// record bit for bit.
    Record(u64),
}

impl GdnSide {
    /// The kernel's side-output parameters (k, v, β, g, row stride; stride 0 for the own
    /// buffers' layouts) for heads (hk, hv, dk, dv).
    pub fn ptrs(self, hk: usize, hv: usize, dk: usize, dv: usize) -> (u64, u64, u64, u64, usize) {
        match self {
            GdnSide::Bufs { k, v, beta, g } => (k, v, beta, g, 0),
            GdnSide::Record(rec) => {
                // the record row: mixed ‖ k ‖ v ‖ g ‖ β (f32)
                let conv_dim = 2 * hk * dk + hv * dv;
                let k = rec + 4 * conv_dim as u64;
                let v = k + 4 * (hk * dk) as u64;
                let g = v + 4 * (hv * dv) as u64;
                (k, v, g + 4 * hv as u64, g, gdn_rec_width(hk, hv, dk, dv))
            }
        }
    }
}

/// Where `gdn_conv_step_norm_d128` writes the gated norm of its output (as
/// [`Gpu::gated_norm_quant`] does): gate input `z` `[n, hv·dv]`, norm weight `w` `[dv]`, `eps`,
/// and the output.
#[derive(Clone, Copy, Debug)]
pub struct GdnNormOut {
    /// The gate input `[n, hv·dv]` f32.
    pub z: u64,
    /// The norm weight `[dv]` f32.
    pub w: u64,
    /// The norm's epsilon.
    pub eps: f32,
    /// The normed, gated values `[n, hv·dv]` (with `p16`: only the f32 `out.f` of it).
    pub out: QuantOut,
    /// The values as b1-plane activations instead of int8 codes
    /// (`gdn_conv_step_norm_p16_d128`; `hv·dv % 256 == 0`).
    pub p16: Option<P16Out>,
}

/// K-heads (`hk`) `gdn_conv_step`'s arrival counters cover.
const GDN_CNT: usize = 256;
/// Threads of a fused GDN decode / verify block (`GDN_CS_THREADS` in the source): 4 warps of
/// 8 columns × 4 chunk pairs.
const GDN_CS_THREADS: u32 = 128;
/// Threads of the producer-warp verify block (`GDN_PW_THREADS`): the 4 recurrence warps of
/// `GDN_CS_THREADS` and 4 producer warps ([`Gpu::gdn_producer`]).
const GDN_PW_THREADS: u32 = 256;

/// Whether [`Gpu::gdn_conv_step`] takes a GDN layer of these dims: dk == dv, dk a multiple of 32
/// up to 128, 1 ≤ kconv ≤ 8, hk ≤ 256 and hv ≥ hk (every k-head read by some block).
pub fn gdn_fused_supported(hk: usize, hv: usize, dk: usize, dv: usize, kconv: usize) -> bool {
    dk == dv
        && dk % 32 == 0
        && (32..=128).contains(&dk)
        && (1..=8).contains(&kconv)
        && (1..=GDN_CNT).contains(&hk)
        && hv >= hk
}

/// Rows one launch of a row-statistics kernel covers (longer launches go in chunks of this).
const ROW_STATS_ROWS: usize = 64;
/// The most blocks a row-statistics kernel splits one row over (the last block's merge takes two
/// partials per lane).
const ROW_STATS_MAX_BLOCKS: usize = 64;

/// Entries per row of [`Gpu::topk_rows`] (`TOPK_N` in bonsai.cu): the most a device-side
/// candidate list serves (a top-k draw with k ≤ this, top-N logprobs).
pub const TOPK_ROW: usize = 64;
/// Rows one `topk_rows` launch covers (longer launches go in chunks of this).
const TOPK_ROWS: usize = 16;

/// Blocks per row of the row-statistics kernels: from the row length alone (never from the row
/// count), about 4,096 logits per block.
fn row_stats_blocks(nv: usize) -> u32 {
    nv.div_ceil(4096).clamp(1, ROW_STATS_MAX_BLOCKS) as u32
}

// SAFETY: CUfunction/CUmodule handles are immutable after load and valid from any thread once the
// context is bound (every method binds it first); the stream is used by one caller at a time.
unsafe impl Send for Gpu {}
// SAFETY: see Send.
unsafe impl Sync for Gpu {}

fn cdiv(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.side.synchronize();
            // SAFETY: events created in Gpu::new, destroyed once; nothing queued waits on them
            // any more (the side stream is drained, and the main stream's waits were queued
            // before its last operation).
            unsafe {
                let _ = cu::event::destroy(self.ev_fork);
                let _ = cu::event::destroy(self.ev_join);
            }
        }
    }
}

impl Gpu {
    /// Open device `ordinal`, compile (or load cached) kernels. Fails cleanly when CUDA is absent.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        if !cuda_available() {
            return Err(CudaError("no CUDA driver or no CUDA device".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(err("cuda context"))?;
        // SAFETY: one stream, synchronized by hand; no CudaSlice is used by this crate.
        unsafe { ctx.disable_event_tracking() };
        // with the forked rollback on (BONSAI_CUDA_FORK=1), the side stream at the lowest
        // priority and the main one at the highest, so that the block scheduler takes the
        // drafter's launches first while both have work (BONSAI_CUDA_SIDE_PRIO=0: both at the
        // default priority, as every stream is without the fork)
        let fork = std::env::var("BONSAI_CUDA_FORK").is_ok_and(|v| v == "1");
        let (least, greatest) =
            if !fork || std::env::var("BONSAI_CUDA_SIDE_PRIO").is_ok_and(|v| v == "0") {
                (0, 0)
            } else {
                cu::stream::get_priority_range().unwrap_or((0, 0))
            };
        let stream = ctx
            .new_stream_with_priority(greatest)
            .map_err(err("cuda stream"))?;
        let side = ctx
            .new_stream_with_priority(least)
            .map_err(err("cuda side stream"))?;
        let arch = ctx
            .compute_capability()
            .map_err(err("compute capability"))?;
        let device_name = ctx.name().unwrap_or_default();
        ctx.bind_to_thread().map_err(err("bind"))?;
        // SAFETY (both loads): the bytes are a complete ELF image produced by NVRTC for this arch.
        let load = |c: &[u8]| unsafe { cu::module::load_data(c.as_ptr() as *const c_void) };
        let embedded = embedded_cubin(arch.0, arch.1).and_then(|c| load(c).ok());
        let (module, cubin_source) = match embedded {
            Some(m) => (m, CubinSource::Embedded),
            None => {
                let (cubin, cached) = cubin_for(arch.0, arch.1)?;
                let m = load(&cubin).map_err(err("cuModuleLoadData"))?;
                let src = if cached {
                    CubinSource::Cache
                } else {
                    CubinSource::Nvrtc
                };
                (m, src)
            }
        };
        let f = Funcs::load(module)?;
        let gpu = Gpu {
            ctx,
            stream,
            side,
            ev_fork: cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(err("event"))?,
            ev_join: cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(err("event"))?,
            join_pending: AtomicBool::new(false),
            detached: AtomicUsize::new(0),
            fork: AtomicBool::new(fork),
            f,
            _module: module,
            arch,
            device_name,
            cubin_source,
            prof: Mutex::new(None),
            pdl: AtomicBool::new(
                arch.0 >= 9
                    && !no_griddep()
                    && std::env::var("BONSAI_CUDA_PDL").map_or(true, |v| v != "0"),
            ),
            prev_kernel: AtomicBool::new(false),
            mv_override: Mutex::new(None),
            mvs_q1: AtomicBool::new(env_on("BONSAI_CUDA_MVS_Q1")),
            mv_rn: AtomicUsize::new(mv_rn_env()),
            mv_n5: AtomicU8::new(mv_n5_env()),
            mv_staged: AtomicU8::new(mv_staged_env() as u8),
            mvs_stages: AtomicUsize::new(mvs_stages_env()),
            mvs_rows: AtomicUsize::new(mvs_rows_env()),
            mvs_min_rows: AtomicUsize::new(mvs_min_rows_env()),
            smem_limit: Mutex::new(Vec::new()),
            smem_optin: std::sync::OnceLock::new(),
            carveout: Mutex::new((None, false)),
            resident_capacity: Mutex::new(Vec::new()),
            b1p_timing: Mutex::new(None),
            mv_b1p: AtomicBool::new(std::env::var("BONSAI_CUDA_B1P").map_or(true, |v| v != "0")),
            b1p_xs: AtomicBool::new(std::env::var("BONSAI_CUDA_B1P_XS").map_or(true, |v| v != "0")),
            gdn_early: AtomicBool::new(
                std::env::var("BONSAI_CUDA_GDN_EARLY").map_or(true, |v| v != "0"),
            ),
            gdn_pw: AtomicBool::new(std::env::var("BONSAI_CUDA_GDN_PW").map_or(true, |v| v != "0")),
            b1q: AtomicBool::new(std::env::var("BONSAI_CUDA_B1Q").map_or(true, |v| v != "0")),
            gdn_norm_batch: AtomicBool::new(
                std::env::var("BONSAI_CUDA_GDN_NORM_BATCH").map_or(true, |v| v != "0"),
            ),
            mv_rows_first: AtomicBool::new(
                std::env::var("BONSAI_CUDA_MV_ROWS_FIRST").map_or(true, |v| v != "0"),
            ),
            b1q_ahead: AtomicBool::new(
                std::env::var("BONSAI_CUDA_B1Q_AHEAD").map_or(true, |v| v != "0"),
            ),
            b1q_tiles: AtomicUsize::new(mvbq_tiles_env()),
            norm_p16_only: AtomicBool::new(
                std::env::var("BONSAI_CUDA_NORM_P16_ONLY").map_or(true, |v| v != "0"),
            ),
            norm_b1q_only: AtomicBool::new(
                std::env::var("BONSAI_CUDA_NORM_B1Q_ONLY").map_or(true, |v| v != "0"),
            ),
            spec_pdl: AtomicBool::new(
                std::env::var("BONSAI_CUDA_SPEC_PDL").is_ok_and(|v| v == "1"),
            ),
            norm_segs: AtomicUsize::new(
                std::env::var("BONSAI_CUDA_NORM_SEGS")
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|&v| (1..=8).contains(&v))
                    .unwrap_or(1),
            ),
            b1p_out: AtomicBool::new(std::env::var("BONSAI_CUDA_B1P_OUT").is_ok_and(|v| v == "1")),
            b2p: AtomicBool::new(std::env::var("BONSAI_CUDA_B2P").map_or(true, |v| v != "0")),
            mv_rsplit: AtomicU8::new(match std::env::var("BONSAI_CUDA_MV_RSPLIT").as_deref() {
                Ok("0") => 0,
                Ok("1") => 1,
                _ => 2,
            }),
            gemm_occ: std::sync::OnceLock::new(),
            gemmw_ok: false,
            gemmw_desc_swap: AtomicBool::new(false),
            gemm_k_split: AtomicBool::new(true),
            gdn_seq_generic: AtomicBool::new(false),
            gdn_prefill: AtomicU8::new(GdnPrefill::from_env() as u8),
            attn_prefill_tc: AtomicBool::new(
                std::env::var("BONSAI_CUDA_ATTN_TC").as_deref() != Ok("0"),
            ),
            gdn_chunk_scratch: Mutex::new(None),
            gemm_config: Mutex::new(gemm::GemmConfig::from_env()),
            gemm_f16_scratch: Mutex::new(None),
            gemm_part_scratch: Mutex::new(None),
            row_stats: std::sync::OnceLock::new(),
            topk_scratch: std::sync::OnceLock::new(),
            gdn_cnt: std::sync::OnceLock::new(),
            gdn_fused: AtomicU8::new(GdnFused::from_env() as u8),
            attn_merge_serial: AtomicBool::new(
                std::env::var("BONSAI_CUDA_ATTN_MERGE").as_deref() == Ok("serial"),
            ),
            attn_gy: env_pair("BONSAI_CUDA_ATTN_GY", ATTN_GY, |v| (1..=65535).contains(&v)),
            attn_hpb: env_pair("BONSAI_CUDA_ATTN_HPB", ATTN_HPB, |v| ATTN_HPBS.contains(&v)),
            swiglu_fused: AtomicBool::new(
                std::env::var("BONSAI_CUDA_SWIGLU_FUSED").as_deref() != Ok("0"),
            ),
            mv_long_r: AtomicUsize::new(
                std::env::var("BONSAI_CUDA_MV_LONG_R")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .filter(|r| [2, 4, 8].contains(r))
                    .unwrap_or(0),
            ),
            skip: Mutex::new(Vec::new()),
            skip_any: AtomicBool::new(false),
        };
        let rs = gpu.alloc(ROW_STATS_ROWS * (ROW_STATS_MAX_BLOCKS * 4 + 1) * 4)?;
        let _ = gpu.row_stats.set(rs);
        let tk = gpu.alloc(TOPK_ROWS * (ROW_STATS_MAX_BLOCKS * TOPK_ROW * 8 + 4))?;
        let _ = gpu.topk_scratch.set(tk);
        let gc = gpu.alloc(GDN_CNT * 4)?;
        let _ = gpu.gdn_cnt.set(gc);
        let mut gpu = gpu;
        gpu.gemmw_ok = gpu.probe_gemmw()?;
        // the pipelined kernels' resident capacity, queried now rather than on a first launch
        // that may happen inside a graph capture
        for kind in [WKind::Q1, WKind::Q2, WKind::Q2G64] {
            for r in [2, 4] {
                for ks in [1, 2, 4] {
                    gpu.mvp_blocks(gpu.mvp_func(kind, r, ks)?)?;
                }
            }
        }
        if let Some(pct) = std::env::var("BONSAI_CUDA_CARVEOUT")
            .ok()
            .and_then(|v| v.trim().parse::<u8>().ok())
        {
            gpu.set_carveout(Some(pct))?;
        }
        Ok(gpu)
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(err("bind context"))
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cu::mem_get_info().map_err(err("mem_get_info"))
    }

    /// A zeroed device buffer of `bytes` (at least 1).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.bind()?;
        let bytes = bytes.max(1);
        // SAFETY: plain allocation in the bound context.
        let ptr = unsafe { cu::malloc_sync(bytes) }.map_err(err("cuMemAlloc"))?;
        let b = DevBuf {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        };
        self.zero(ptr, bytes)?;
        Ok(b)
    }

    /// Upload a host slice into a new buffer.
    pub fn upload<T: Copy>(&self, src: &[T]) -> Result<DevBuf> {
        let b = self.alloc(std::mem::size_of_val(src))?;
        self.htod(&b, 0, src)?;
        Ok(b)
    }

    /// Copy `src` into `dst` at byte offset `off` (ordered on the stream, returns when done).
    pub fn htod<T: Copy>(&self, dst: &DevBuf, off: usize, src: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(src);
        if n == 0 {
            return Ok(());
        }
        assert!(off + n <= dst.bytes, "htod out of bounds");
        self.bind()?;
        // SAFETY: bounds checked above; the host slice outlives the synchronous copy below.
        unsafe {
            cu::memcpy_htod_async(dst.ptr + off as u64, src, self.op_stream())
                .map_err(err("htod"))?;
        }
        self.sync()
    }

    /// A zeroed pinned host buffer of `bytes` (at least 4).
    pub fn alloc_pinned(&self, bytes: usize) -> Result<PinnedBuf> {
        self.bind()?;
        let bytes = bytes.max(4);
        // SAFETY: plain host allocation in the bound context; zeroed right below.
        let ptr = unsafe { cu::malloc_host(bytes, 0) }.map_err(err("cuMemHostAlloc"))?;
        // SAFETY: ptr is a fresh allocation of `bytes`.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(PinnedBuf {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// Stream-ordered copy of `bytes` from pinned `src` at byte `src_off` to device `dst`. Does not
    /// wait (capturable): the host must not change `src` until the stream has passed the copy.
    pub fn htod_pinned_async(
        &self,
        dst: u64,
        src: &PinnedBuf,
        src_off: usize,
        bytes: usize,
    ) -> Result<()> {
        assert!(src_off + bytes <= src.bytes, "htod_pinned out of bounds");
        self.bind()?;
        // SAFETY: in bounds of a live pinned allocation; the device range is the caller's buffer.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.at(src_off), bytes, self.op_stream())
                .result()
                .map_err(err("htod pinned"))
        }
    }

    /// Stream-ordered copy of `bytes` from device `src` into pinned `dst` at byte `dst_off`. Does not
    /// wait (capturable): read `dst` only after [`Gpu::sync`].
    pub fn dtoh_pinned_async(
        &self,
        dst: &PinnedBuf,
        dst_off: usize,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        assert!(dst_off + bytes <= dst.bytes, "dtoh_pinned out of bounds");
        self.bind()?;
        // SAFETY: in bounds of a live pinned allocation; the device range is the caller's buffer.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.at(dst_off), src, bytes, self.op_stream())
                .result()
                .map_err(err("dtoh pinned"))
        }
    }

    /// Copy `dst.len()` elements from `src` at byte offset `off` to the host (waits for the stream).
    pub fn dtoh<T: Copy>(&self, src: &DevBuf, off: usize, dst: &mut [T]) -> Result<()> {
        let n = std::mem::size_of_val(dst);
        if n == 0 {
            return Ok(());
        }
        assert!(off + n <= src.bytes, "dtoh out of bounds");
        self.bind()?;
        // SAFETY: bounds checked; we synchronize before returning so dst is written.
        unsafe {
            cu::memcpy_dtoh_async(dst, src.ptr + off as u64, self.op_stream())
                .map_err(err("dtoh"))?;
        }
        self.sync()
    }

    /// Device-to-device copy of `bytes` (stream-ordered).
    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes addresses inside live buffers of at least `bytes`.
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.op_stream()) }.map_err(err("dtod"))
    }

    /// Device-to-device copy of `height` rows of `width` bytes, from rows `src_pitch` bytes apart
    /// to rows `dst_pitch` bytes apart (stream-ordered, capturable).
    pub fn dtod_2d(
        &self,
        dst: u64,
        dst_pitch: usize,
        src: u64,
        src_pitch: usize,
        width: usize,
        height: usize,
    ) -> Result<()> {
        if width == 0 || height == 0 {
            return Ok(());
        }
        assert!(
            width <= src_pitch && width <= dst_pitch,
            "dtod_2d: rows of {width} bytes at pitches {src_pitch} / {dst_pitch}"
        );
        self.bind()?;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: height,
        };
        // SAFETY: the caller passes device ranges of `height` rows at the given pitches inside
        // live buffers; the descriptor is read during the call.
        unsafe {
            sys::cuMemcpy2DAsync_v2(&copy, self.op_stream())
                .result()
                .map_err(err("dtod 2d"))
        }
    }

    /// Zero `bytes` at `dst` (stream-ordered).
    pub fn zero(&self, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes an address inside a live buffer of at least `bytes`.
        unsafe { cu::memset_d8_async(dst, 0, bytes, self.op_stream()) }.map_err(err("memset"))
    }

    /// Wait for all queued work (outside a [`Self::detached`] scope, a forked launch's too).
    pub fn sync(&self) -> Result<()> {
        self.main_stream();
        self.stream.synchronize().map_err(err("stream sync"))
    }

    /// The stream for the next operation. Outside a [`Self::detached`] scope, a forked launch not
    /// waited for yet is joined first: the stream waits on its event, so whatever comes next
    /// (the next verify or decode step, a copy of the state) runs after it, and the next kernel
    /// takes a full dependency. Should the event wait fail, the side stream is drained instead.
    fn main_stream(&self) -> sys::CUstream {
        let s = self.stream.cu_stream();
        if self.join_pending.load(Ordering::Relaxed) && self.detached.load(Ordering::Relaxed) == 0 {
            // SAFETY: the stream and the event are live for as long as self.
            let waited = unsafe {
                cu::stream::wait_event(
                    s,
                    self.ev_join,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            };
            if waited.is_err() {
                let _ = self.side.synchronize();
            }
            self.join_pending.store(false, Ordering::Relaxed);
            self.prev_kernel.store(false, Ordering::Relaxed);
        }
        s
    }

    /// The stream, for a copy, memset, event or graph launch: the next kernel then takes a full
    /// dependency (programmatic edges are only ever made from one kernel to the next).
    fn op_stream(&self) -> sys::CUstream {
        let s = self.main_stream();
        self.prev_kernel.store(false, Ordering::Relaxed);
        s
    }

    /// Launch `g` on the side stream, after everything queued so far, without making the main
    /// stream wait for it: operations queued inside [`Self::detached`] scopes may run beside it,
    /// and the first operation outside one waits for it. For work that nothing in those scopes
    /// reads or writes (the speculative round's rollback replay, beside the drafter's stage and
    /// draft). With [`Self::fork_replay`] off, a plain [`Self::launch_graph`].
    pub fn launch_graph_forked(&self, g: &Graph) -> Result<()> {
        if !self.fork_replay() {
            return self.launch_graph(g);
        }
        self.bind()?;
        let main = self.op_stream();
        let side = self.side.cu_stream();
        // SAFETY: live events, streams and graph of this context; the side stream waits for the
        // main stream's work so far, then the graph, then the join event.
        unsafe {
            cu::event::record(self.ev_fork, main).map_err(err("record fork"))?;
            cu::stream::wait_event(
                side,
                self.ev_fork,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(err("wait fork"))?;
            cu::graph::launch(g.exec, side).map_err(err("graph launch (side)"))?;
            cu::event::record(self.ev_join, side).map_err(err("record join"))?;
        }
        self.join_pending.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Run `f` with the main stream's operations not waiting for a forked launch (the GPU
    /// drafter's stage and draft, which read and write none of what the forked rollback does).
    /// Its host synchronizations then drain the main stream only.
    pub fn detached<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Scope<'a>(&'a AtomicUsize);
        impl Drop for Scope<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.detached.fetch_add(1, Ordering::Relaxed);
        let _scope = Scope(&self.detached);
        f()
    }

    /// Whether [`Self::launch_graph_forked`] uses the side stream (`BONSAI_CUDA_FORK=1`; off by
    /// default, everything on one stream, until it has run on a GPU: built on 2026-12-06 without
    /// one).
    pub fn fork_replay(&self) -> bool {
        self.fork.load(Ordering::Relaxed)
    }

    /// Set [`Self::fork_replay`] (joins a pending forked launch first).
    pub fn set_fork_replay(&self, on: bool) {
        self.main_stream();
        self.fork.store(on, Ordering::Relaxed);
    }

    fn launch(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<()> {
        self.launch_smem(f, grid, block, 0, args)
    }

    /// [`Self::launch`] with `smem` bytes of dynamic shared memory (above 48 KiB the kernel's
    /// limit is raised first).
    fn launch_smem(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        self.launch_params(f, grid, block, smem, &mut params)
    }

    /// A launch of a kernel whose first parameter is a struct of `blob.len()` u64 passed by value
    /// (at most [`BLOB_MAX_U64`]: the parameter space is 4 KiB), then `args` as for
    /// [`Self::launch`]; no dynamic shared memory.
    pub(crate) fn launch_blob(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        blob: &[u64],
        args: &[Arg],
    ) -> Result<()> {
        if blob.len() > BLOB_MAX_U64 {
            return Err(CudaError(format!(
                "launch {}: a {}-word parameter struct (at most {BLOB_MAX_U64})",
                self.f.name(f),
                blob.len()
            )));
        }
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = Vec::with_capacity(slots.len() + 1);
        // the driver only reads kernel parameters (it copies them at the launch)
        params.push(blob.as_ptr() as *mut c_void);
        params.extend(slots.iter_mut().map(|s| s as *mut u64 as *mut c_void));
        self.launch_params(f, grid, block, 0, &mut params)
    }

    /// The launch itself: `params` point at the kernel's parameters, in order (see the SAFETY
    /// notes below).
    fn launch_params(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut Vec<*mut c_void>,
    ) -> Result<()> {
        self.bind()?;
        if self.skip_any.load(Ordering::Relaxed)
            && self
                .skip
                .lock()
                .expect("skip lock")
                .contains(&self.f.name(f))
        {
            return Ok(());
        }
        if smem > 48 * 1024 {
            self.raise_smem_limit(f, smem as usize)?;
        }
        let stream = self.main_stream();
        let profiling = self.prof.lock().expect("prof lock").is_some();
        if profiling && f != self.f.spin_ns {
            // spin first so that the events and the kernel are queued before the GPU reaches them:
            // the measured time is the kernel alone, launch ramp included
            self.launch_smem(self.f.spin_ns, (1, 1, 1), (1, 1, 1), 0, &[Arg::P(40_000)])?;
            let name = format!("{} {}x{}x{}", self.f.name(f), grid.0, grid.1, grid.2);
            let us = self.time_ms(|| {
                // SAFETY: as below.
                unsafe {
                    cu::launch_kernel(f, grid, block, smem, stream, params).map_err(err("launch"))
                }
            })? * 1e3;
            if let Some(v) = self.prof.lock().expect("prof lock").as_mut() {
                v.push((name, us));
            }
            return Ok(());
        }
        let after_kernel = self.prev_kernel.swap(true, Ordering::Relaxed);
        if after_kernel
            && self.pdl.load(Ordering::Relaxed)
            && self.f.pdl_aware(f)
            && (self.spec_pdl() || !self.is_spec_kernel(f))
        {
            let mut attr = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                // SAFETY: the value is a plain C union of integers and structs of integers, so all
                // zero bytes is a valid value.
                value: unsafe { std::mem::zeroed() },
            };
            // the member the attribute id selects
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: smem,
                hStream: stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as for the plain launch below; cfg and attr outlive the call, and the kernel
            // is PDL-aware (it waits for the previous grid before any dependent access).
            return unsafe {
                sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut())
                    .result()
                    .map_err(err("launch (PDL)"))
            };
        }
        // SAFETY: f is a kernel of our module; params point at one 8-byte slot per declared kernel
        // parameter, in order (pointers 8 bytes, int/float read from the low 4 bytes), or, for
        // launch_blob's first parameter, at the whole struct the kernel declares (its u64 words,
        // borrowed for the call and only read: the launch copies parameters); every pointer argument
        // comes from a live DevBuf sized by the caller for the given dims.
        unsafe { cu::launch_kernel(f, grid, block, smem, stream, params).map_err(err("launch")) }
    }

    /// Raise kernel `f`'s dynamic shared memory limit to at least `smem` bytes (never lowers it:
    /// launches of one kernel with different sizes, and graph nodes captured earlier, keep
    /// working). The call fails cleanly past the device's maximum.
    fn raise_smem_limit(&self, f: sys::CUfunction, smem: usize) -> Result<()> {
        let mut lim = self.smem_limit.lock().expect("smem limit lock");
        let key = f as usize;
        let cur = lim
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(48 << 10, |e| e.1);
        if smem <= cur {
            return Ok(());
        }
        // SAFETY: f is a kernel of our loaded module; the attribute only raises its dynamic
        // shared memory limit.
        unsafe {
            sys::cuFuncSetAttribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .result()
            .map_err(err("cuFuncSetAttribute"))?;
        }
        lim.retain(|(k, _)| *k != key);
        lim.push((key, smem));
        Ok(())
    }

    /// Whether PDL-aware kernels are launched with programmatic stream serialization (sm_90+;
    /// on by default, `BONSAI_CUDA_PDL=0` turns it off). A graph captures the setting in force.
    pub fn pdl(&self) -> bool {
        self.pdl.load(Ordering::Relaxed)
    }

    /// Turn programmatic dependent launch on or off (ignored below sm_90). Benchmarks compare both.
    pub fn set_pdl(&self, on: bool) {
        self.pdl
            .store(on && self.arch.0 >= 9 && !no_griddep(), Ordering::Relaxed);
    }

    /// Whether the speculative round's record and rollback kernels and the DSpark drafter's
    /// kernels (`kernels/spec.cu`) take programmatic dependent launch like the others (with
    /// [`Self::pdl`]). They wait on entry, so either is correct (the GPU tests passed with it on),
    /// but on the H200 it measured level (`bench/results/cuda-spec-pdl-ab-27b.json`: draft
    /// 1.062–1.065 ms plain, 1.069–1.086 with it; rounds within noise), so it is off by default
    /// (`BONSAI_CUDA_SPEC_PDL=1` on). A graph captures the setting in force.
    pub fn spec_pdl(&self) -> bool {
        self.spec_pdl.load(Ordering::Relaxed)
    }

    /// Set [`Self::spec_pdl`] (benchmarks compare both in one process).
    pub fn set_spec_pdl(&self, on: bool) {
        self.spec_pdl.store(on, Ordering::Relaxed);
    }

    /// 256-element segments per block of a short (≤ [`MAX_ROWS`] rows) `rmsnorm_quant` launch
    /// (`BONSAI_CUDA_NORM_SEGS`, 1..=8, default 1): fewer blocks that each re-read the row for its
    /// sum of squares, each doing more segments. Every output is the same whatever the split.
    pub fn norm_segs(&self) -> usize {
        self.norm_segs.load(Ordering::Relaxed)
    }

    /// Set [`Self::norm_segs`] (1..=8; capture graphs after setting it).
    pub fn set_norm_segs(&self, segs: usize) {
        self.norm_segs.store(segs.clamp(1, 8), Ordering::Relaxed);
    }

    /// Whether `f` is one of `kernels/spec.cu`'s kernels ([`Self::spec_pdl`]).
    fn is_spec_kernel(&self, f: sys::CUfunction) -> bool {
        let k = &self.f;
        [
            k.gdn_rec_write,
            k.gdn_replay,
            k.gdn_replay_layers,
            k.mv_q41,
            k.mv_q41_n4,
            k.mv_q41_n4f,
            k.mvt_q41,
            k.dsp_norm_rope,
            k.dsp_copy_rows,
            k.dsp_attn_part,
            k.dsp_attn_part_e1,
            k.dsp_attn_part_e2,
            k.dsp_attn_part_e4,
            k.dsp_attn_kv,
            k.dsp_attn_merge,
            k.dsp_markov_scores,
        ]
        .contains(&f)
    }

    /// Start profiling: from now on every launch is preceded by a short spin kernel and timed
    /// alone with events (slow; never while capturing a graph).
    pub fn profile_begin(&self) {
        *self.prof.lock().expect("prof lock") = Some(Vec::new());
    }

    /// Stop profiling; returns (kernel name and grid, µs) per launch, in launch order.
    pub fn profile_end(&self) -> Vec<(String, f32)> {
        self.prof
            .lock()
            .expect("prof lock")
            .take()
            .unwrap_or_default()
    }

    // ---- typed launchers ------------------------------------------------------------------------

    /// Quantize `n` rows of `k` f32 (k % 32 == 0) to int8 codes + per-32 scales and sums.
    pub fn quant_rows(&self, x: u64, n: usize, k: usize, q: u64, d: u64, s: u64) -> Result<()> {
        assert_eq!(k % 32, 0);
        self.launch(
            self.f.quant_rows,
            (cdiv(k / 32, 8), n as u32, 1),
            (256, 1, 1),
            &[Arg::P(x), Arg::I(k as i32), Arg::P(q), Arg::P(d), Arg::P(s)],
        )
    }

    /// `xn = rmsnorm(x) ⊙ w` per row (also written as f32 to `xf` unless 0) and quantized.
    pub fn rmsnorm_quant(
        &self,
        x: u64,
        w: u64,
        eps: f32,
        n: usize,
        k: usize,
        xf: u64,
        q: u64,
        d: u64,
        s: u64,
    ) -> Result<()> {
        self.rmsnorm_quant_p16(x, w, eps, n, k, xf, q, d, s, (0, 0, 0, 0))
    }

    /// [`Self::rmsnorm_quant`] that also writes the b1-plane activations of each row (`p16` =
    /// planes `[n, k / 256, 32, 4]` u32, units `[n, k / 128]` f32, sums `[n, k / 128, 4]` i32, the
    /// input of [`Self::mv_b1p`]; `(0, 0, 0, 0)`: none) from the same normalized values; host twin
    /// [`host_quant_p16`]. The fourth buffer (0: none) gets the same codes byte-split for
    /// [`Self::mv_b1q`] (`[n, k / 128, 4 quarters, 4 sub-blocks]` uint4, host twin
    /// [`b1q_acts_host`]). The b1-plane outputs need `k % 256 == 0`. With them, `q = 0` skips the int8 codes (`d`, `s` unused):
    /// for rows whose every consumer reads the b1-plane outputs (the planes do not change). With
    /// the byte-split codes, `xp = 0` skips the planes: for rows that only [`Self::mv_b1q`]
    /// reads (the units, sums and byte-split codes do not change).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_quant_p16(
        &self,
        x: u64,
        w: u64,
        eps: f32,
        n: usize,
        k: usize,
        xf: u64,
        q: u64,
        d: u64,
        s: u64,
        (xp, xu, xs, xv): (u64, u64, u64, u64),
    ) -> Result<()> {
        assert_eq!(k % 32, 0);
        // b1-plane outputs: the planes and / or the byte-split codes, each with the units and sums
        let p16 = xp != 0 || xv != 0;
        if p16 && (k % 256 != 0 || xu == 0 || xs == 0) || (!p16 && (xu != 0 || xs != 0)) {
            return Err(CudaError(format!(
                "rmsnorm_quant: b1-plane outputs need k % 256 == 0, the planes or the byte-split codes, and the units and sums (k = {k})"
            )));
        }
        if !p16 && (q == 0 || d == 0 || s == 0) {
            return Err(CudaError(
                "rmsnorm_quant: the int8 codes (q, d, s) may be skipped only when the b1-plane outputs are written"
                    .into(),
            ));
        }
        let args = [
            Arg::P(x),
            Arg::P(w),
            Arg::F(eps),
            Arg::I(k as i32),
            Arg::P(xf),
            Arg::P(q),
            Arg::P(d),
            Arg::P(s),
            Arg::P(xp),
            Arg::P(xu),
            Arg::P(xs),
            Arg::P(xv),
        ];
        if !p16 && n > MAX_ROWS && k % 128 == 0 && (x | w | xf) % 16 == 0 && q % 4 == 0 {
            // long launches: one block per row, which reads the row once (same bits)
            return self.launch(
                self.f.rmsnorm_quant_rows,
                (n as u32, 1, 1),
                (256, 1, 1),
                &args,
            );
        }
        // segments of 256 per block: one for short launches, else enough blocks for ~2,048 in
        // all (values do not depend on the split)
        let segs = k.div_ceil(256);
        let gx = if n <= MAX_ROWS {
            segs.div_ceil(self.norm_segs())
        } else {
            segs.min(2048usize.div_ceil(n)).max(1)
        };
        self.launch(
            self.f.rmsnorm_quant,
            (gx as u32, n as u32, 1),
            (256, 1, 1),
            &args,
        )
    }

    /// `y[t, o] (+)= Σ_i W[o, i] x[t, i]` for a low-bit re-tiled matrix and int8 activations
    /// (`n <= MAX_ROWS`). Rows are batch-invariant: row t equals the n = 1 launch bit for bit.
    pub fn mv_lowbit(
        &self,
        kind: WKind,
        codes: u64,
        scales: u64,
        q: u64,
        d: u64,
        s: u64,
        y: u64,
        n_in: usize,
        n_out: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.mv_lowbit_multi(
            kind,
            &[MvSeg {
                codes,
                scales,
                y,
                n_out,
            }],
            q,
            d,
            s,
            n_in,
            n,
            accumulate,
        )
    }

    /// One launch over up to [`MAX_SEGS`] low-bit matrices of the same kind and `n_in` that share
    /// the input activations (e.g. gate ‖ up): segment `i` writes `y_i[t, o]` (`[n, n_out_i]`).
    /// Each output equals the single-matrix launch bit for bit (under the same plan). Runs the
    /// dp4a kernels (plain, pipelined or staged, as the plan and the shape say).
    pub fn mv_lowbit_multi(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        s: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        assert!((1..=MAX_ROWS).contains(&n), "mv_lowbit: n = {n}");
        assert!(
            (1..=MAX_SEGS).contains(&segs.len()),
            "mv_lowbit: {} segments",
            segs.len()
        );
        assert_eq!(n_in % 64, 0, "mv_lowbit: n_in = {n_in}");
        if self.b1p_stand_in(kind, segs, n_in, n, accumulate, false)? {
            return Ok(());
        }
        let rows: usize = segs.iter().map(|s| s.n_out).sum();
        let plan = self.mv_plan(kind, n, rows, n_in);
        if n == 1
            && self.staged_for(kind, rows)
            && self.launch_mv_staged(kind, segs, q, d, s, n_in, accumulate, plan)?
        {
            return Ok(());
        }
        if n == 1 && plan.pipe {
            let f = self.mvp_func(kind, plan.r, plan.ks)?;
            return self.launch_mv_pipe(f, segs, plan.r, q, d, s, n_in, accumulate, plan);
        }
        // rows per warp-level work unit, the kernel and `rs` blocks per row group (the dp4a
        // row-split verify kernels: 2)
        let r = if n == 1 { plan.r } else { plan.rn };
        let (rpw, f, rs) = self.mv_func(kind, n, r, plan.ks, plan.n5)?;
        self.launch_mv_segs(f, segs, rpw, rs, q, d, s, n_in, n, accumulate, plan)
    }

    /// The pipelined decode kernel of `kind` with `r` rows per group emulating K split `ks`.
    fn mvp_func(&self, kind: WKind, r: usize, ks: usize) -> Result<sys::CUfunction> {
        let f = &self.f;
        let t = match kind {
            WKind::Q1 => [
                [f.mvp_q1_r2_k1, f.mvp_q1_r2_k2, f.mvp_q1_r2_k4],
                [f.mvp_q1_r4_k1, f.mvp_q1_r4_k2, f.mvp_q1_r4_k4],
            ],
            WKind::Q2 => [
                [f.mvp_q2_r2_k1, f.mvp_q2_r2_k2, f.mvp_q2_r2_k4],
                [f.mvp_q2_r4_k1, f.mvp_q2_r4_k2, f.mvp_q2_r4_k4],
            ],
            WKind::Q2G64 => [
                [f.mvp_q2g64_r2_k1, f.mvp_q2g64_r2_k2, f.mvp_q2g64_r2_k4],
                [f.mvp_q2g64_r4_k1, f.mvp_q2g64_r4_k2, f.mvp_q2g64_r4_k4],
            ],
            _ => return Err(CudaError(format!("mv_lowbit (mvp) on {kind:?}"))),
        };
        match (r, ks) {
            (2 | 4, 1 | 2 | 4) => Ok(t[r / 4][ks.trailing_zeros() as usize]),
            _ => Err(CudaError(format!(
                "mv_lowbit (mvp): no variant with {r} rows per group, K split {ks}"
            ))),
        }
    }

    /// Set every kernel's preferred shared-memory carveout (percent of the unified L1 / shared
    /// memory; `None`: the driver's default). One setting for all kernels means the SMs never
    /// switch carveout between consecutive kernels (a switch drains the SM, which a kernel that
    /// asks for much shared memory after one that asks for none would otherwise cause).
    /// `BONSAI_CUDA_CARVEOUT` (0..=100) sets it when the `Gpu` is made.
    /// `None` also hands the choice back to the staged launches ([`STAGED_CARVEOUT`]).
    pub fn set_carveout(&self, pct: Option<u8>) -> Result<()> {
        self.apply_carveout(pct, pct.is_some())
    }

    fn apply_carveout(&self, pct: Option<u8>, chosen: bool) -> Result<()> {
        self.bind()?;
        let v = pct.map_or(-1, |p| p.min(100) as i32);
        for (name, f) in self.f.all() {
            // the automatic setting leaves the n-row verify mat-vecs (`_n8*`, `_n5*`) on the
            // driver's choice: they re-read up to 8 activation rows from L1 (Q2 verify round
            // 12.5 → 14.5 ms at 100 %); and the prefill kernels with large tiles in shared
            // memory, which the staged carveout would leave fewer blocks per SM
            let prefill = ["gemm", "attn_prefill", "gdn_chunk", "gdn_step_seq"]
                .iter()
                .any(|p| name.starts_with(p));
            let v = if !chosen && (name.contains("_n8") || name.contains("_n5") || prefill) {
                -1
            } else {
                v
            };
            // SAFETY: f is a kernel of our loaded module; the attribute is a scheduling hint.
            unsafe {
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    v,
                )
                .result()
                .map_err(err("carveout"))?;
            }
        }
        *self.carveout.lock().expect("carveout lock") = (pct, chosen);
        Ok(())
    }

    /// The carveout every kernel has now (`None`: the driver's default).
    pub fn carveout(&self) -> Option<u8> {
        self.carveout.lock().expect("carveout lock").0
    }

    /// Before a staged launch: [`STAGED_CARVEOUT`] for every kernel but the n-row verify mat-vecs
    /// (`mv_*_n8_*`) unless a carveout was chosen.
    fn staged_carveout(&self) -> Result<()> {
        let (cur, chosen) = *self.carveout.lock().expect("carveout lock");
        if chosen || cur == Some(STAGED_CARVEOUT) {
            return Ok(());
        }
        self.apply_carveout(Some(STAGED_CARVEOUT), false)
    }

    /// The most shared memory one block may opt in to (bytes).
    pub fn smem_optin(&self) -> Result<usize> {
        if let Some(&v) = self.smem_optin.get() {
            return Ok(v);
        }
        self.bind()?;
        let v = self
            .ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(err("shared memory per block"))?
            .max(0) as usize;
        Ok(*self.smem_optin.get_or_init(|| v))
    }

    /// The names of every kernel in the module.
    pub fn kernel_names(&self) -> Vec<&'static str> {
        self.f.all().into_iter().map(|(n, _)| n).collect()
    }

    /// The names of the module's mat-vec kernels (every family: `mv*`).
    pub fn matvec_kernel_names(&self) -> Vec<&'static str> {
        self.kernel_names()
            .into_iter()
            .filter(|n| n.starts_with("mv"))
            .collect()
    }

    /// Drop every launch of the named kernels (an empty list restores them): a benchmark knob
    /// that measures what those launches cost inside the decode graph. The results are wrong while
    /// any kernel is skipped. Unknown names are an error.
    pub fn set_skip_kernels(&self, names: &[&str]) -> Result<()> {
        let all = self.f.all();
        let mut v = Vec::new();
        for n in names {
            match all.iter().find(|(k, _)| k == n) {
                Some((k, _)) => v.push(*k),
                None => return Err(CudaError(format!("set_skip_kernels: no kernel named {n}"))),
            }
        }
        self.skip_any.store(!v.is_empty(), Ordering::Relaxed);
        *self.skip.lock().expect("skip lock") = v;
        Ok(())
    }

    /// Every launch setting a captured graph bakes in (PDL edges, mat-vec families and their
    /// staged layout, the carveout): part of the key of every graph of mat-vec launches.
    pub fn launch_mode_key(&self) -> [u64; 14] {
        let skipped = self.skip.lock().expect("skip lock");
        [
            skipped
                .iter()
                .flat_map(|n| n.bytes())
                .fold(skipped.len() as u64, |h, b| {
                    h.wrapping_mul(131).wrapping_add(b as u64)
                }),
            self.pdl() as u64,
            self.mv_rn.load(Ordering::Relaxed) as u64,
            self.mv_n5.load(Ordering::Relaxed) as u64,
            self.mv_staged_mode() as u64,
            self.mvs_stages() as u64,
            self.mvs_rows() as u64,
            self.mvs_min_rows() as u64,
            self.carveout().map_or(u64::MAX, u64::from),
            self.gdn_fused() as u64,
            self.mv_long_r.load(Ordering::Relaxed) as u64,
            self.swiglu_fused() as u64,
            (self.attn_merge_serial() as u64) << 1
                | (self.attn_gy(1) as u64) << 2
                | (self.attn_gy(2) as u64) << 18
                | (self.attn_hpb(1) as u64) << 34
                | (self.attn_hpb(2) as u64) << 38,
            self.mvs_q1() as u64
                | (self.b1p() as u64) << 1
                | (self.b1p_timing() as u64) << 2
                | (self.b1p_xs() as u64) << 3
                | (self.b1q() as u64) << 4
                | (self.b1p_out() as u64) << 5
                | (self.gdn_norm_batch() as u64) << 6
                | (self.mv_rsplit.load(Ordering::Relaxed) as u64) << 22
                | (self.norm_p16_only() as u64) << 23
                | (self.norm_b1q_only() as u64) << 24
                | (self.spec_pdl() as u64) << 25
                | (self.norm_segs() as u64) << 26
                | (self.gdn_early_count() as u64) << 27
                | (self.mv_rows_first() as u64) << 29
                | (self.b1q_ahead() as u64) << 30
                | (self.b1q_tiles() as u64) << 31
                | (self.gdn_producer() as u64) << 34,
        ]
    }

    /// The device's multiprocessor count (binds the context first; at least 1).
    fn sm_count(&self) -> Result<usize> {
        self.bind()?;
        Ok(self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(err("SM count"))?
            .max(1) as usize)
    }

    /// How many blocks of the pipelined kernel `f` fit on the GPU at once (SMs × resident blocks
    /// per SM), queried once per kernel.
    fn mvp_blocks(&self, f: sys::CUfunction) -> Result<usize> {
        self.resident_blocks(f, 0)
    }

    /// How many blocks of `MV_WARPS` warps of kernel `f` with `smem` bytes of dynamic shared
    /// memory fit on the GPU at once (SMs × resident blocks per SM), queried once per kernel and
    /// size (the kernel's shared-memory limit raised to `smem` first).
    fn resident_blocks(&self, f: sys::CUfunction, smem: usize) -> Result<usize> {
        let key = (f as usize, smem);
        let mut cap = self.resident_capacity.lock().expect("capacity lock");
        if let Some(&(_, b)) = cap.iter().find(|(k, _)| *k == key) {
            return Ok(b);
        }
        let sms = self.sm_count()?;
        self.raise_smem_limit(f, smem)?;
        // SAFETY: f is a kernel of our loaded module, its limit covers `smem`.
        let per_sm = unsafe {
            cu::occupancy::max_active_block_per_multiprocessor(f, (MV_WARPS * 32) as i32, smem)
        }
        .map_err(err("occupancy"))?
        .max(1) as usize;
        cap.push((key, sms * per_sm));
        Ok(sms * per_sm)
    }

    /// The staged decode kernel of `kind` with `r` rows per warp and K split `ks`.
    fn mvs_func(&self, kind: WKind, r: usize, ks: usize) -> Result<sys::CUfunction> {
        let f = &self.f;
        let t = match kind {
            WKind::Q1 => [
                [f.mvs_q1_r1_k1, f.mvs_q1_r1_k2, f.mvs_q1_r1_k4],
                [f.mvs_q1_r2_k1, f.mvs_q1_r2_k2, f.mvs_q1_r2_k4],
                [f.mvs_q1_r4_k1, f.mvs_q1_r4_k2, f.mvs_q1_r4_k4],
            ],
            WKind::Q2 => [
                [f.mvs_q2_r1_k1, f.mvs_q2_r1_k2, f.mvs_q2_r1_k4],
                [f.mvs_q2_r2_k1, f.mvs_q2_r2_k2, f.mvs_q2_r2_k4],
                [f.mvs_q2_r4_k1, f.mvs_q2_r4_k2, f.mvs_q2_r4_k4],
            ],
            WKind::Q2G64 => [
                [f.mvs_q2g64_r1_k1, f.mvs_q2g64_r1_k2, f.mvs_q2g64_r1_k4],
                [f.mvs_q2g64_r2_k1, f.mvs_q2g64_r2_k2, f.mvs_q2g64_r2_k4],
                [f.mvs_q2g64_r4_k1, f.mvs_q2g64_r4_k2, f.mvs_q2g64_r4_k4],
            ],
            _ => return Err(CudaError(format!("mv_lowbit (mvs) on {kind:?}"))),
        };
        pick_r_ks(t, "mvs", "warp", r, ks)
    }

    /// One-row launch of the staged kernel (`kernels/mvs.cu`) under `plan`'s K split; `false`
    /// (nothing launched) where the shape or an address does not suit its bulk copies. The grid
    /// is persistent: as few blocks as give every block the same number of row tiles (± 1)
    /// without exceeding what is resident at once.
    #[allow(clippy::too_many_arguments)]
    fn launch_mv_staged(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        s: u64,
        n_in: usize,
        accumulate: bool,
        plan: MvPlan,
    ) -> Result<bool> {
        let layout = mvs_layout(
            kind,
            n_in,
            plan.r,
            plan.ks,
            self.mvs_stages(),
            self.mvs_rows(),
        );
        let Some((r, _stage, _stages, smem)) = layout else {
            return Ok(false);
        };
        // a forced ring or row count can ask for more than a block may have
        if smem + 1024 > self.smem_optin()? {
            return Ok(false);
        }
        let aligned = [q, d, s].iter().all(|p| p % 16 == 0)
            && segs
                .iter()
                .all(|sg| sg.codes % 16 == 0 && sg.scales % 16 == 0);
        if !aligned {
            return Ok(false);
        }
        let f = self.mvs_func(kind, r, plan.ks)?;
        self.staged_carveout()?;
        let tile = (MV_WARPS / plan.ks) * r;
        let tiles: usize = segs.iter().map(|sg| sg.n_out.div_ceil(tile)).sum();
        if tiles == 0 {
            return Ok(true);
        }
        let blocks = balanced_count(tiles, self.resident_blocks(f, smem)?);
        let (args, _) = mv_seg_args(segs, r, q, d, s, n_in, 1, accumulate, plan);
        self.launch_smem(
            f,
            (blocks as u32, 1, 1),
            ((MV_WARPS * 32) as u32, 1, 1),
            smem as u32,
            &args,
        )?;
        Ok(true)
    }

    /// Launch the pipelined decode kernel `f` over `segs` (groups of `r` rows): as few warps as
    /// give every warp the same number of groups (± 1) without exceeding what is resident at once.
    #[allow(clippy::too_many_arguments)]
    fn launch_mv_pipe(
        &self,
        f: sys::CUfunction,
        segs: &[MvSeg],
        r: usize,
        q: u64,
        d: u64,
        s: u64,
        n_in: usize,
        accumulate: bool,
        plan: MvPlan,
    ) -> Result<()> {
        let (args, groups) = mv_seg_args(segs, r, q, d, s, n_in, 1, accumulate, plan);
        if groups == 0 {
            return Ok(());
        }
        let warps = balanced_count(groups, self.mvp_blocks(f)? * MV_WARPS);
        self.launch(
            f,
            (cdiv(warps, MV_WARPS), 1, 1),
            ((MV_WARPS * 32) as u32, 1, 1),
            &args,
        )
    }

    /// Launch a low-bit mat-vec kernel `f` (any family: they share the parameter list of
    /// `MV_ENTRY`) over `segs` with `rpw` weight rows per warp-level work unit; `x` is what the
    /// kernel reads as its activation codes (int8 `q`, or the b1 planes). Nothing runs when the
    /// segments hold no rows.
    #[allow(clippy::too_many_arguments)]
    fn launch_mv_segs(
        &self,
        f: sys::CUfunction,
        segs: &[MvSeg],
        rpw: usize,
        rs: usize,
        x: u64,
        d: u64,
        s: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
        plan: MvPlan,
    ) -> Result<()> {
        let (args, groups) = mv_seg_args(segs, rpw, x, d, s, n_in, n, accumulate, plan);
        if groups == 0 {
            return Ok(());
        }
        // every family: MV_WARPS (= MVM_WARPS = MVB_WARPS) warps per block, `ks` of them per row
        // group
        self.launch(
            f,
            (cdiv(groups, MV_WARPS / plan.ks) * rs as u32, 1, 1),
            ((MV_WARPS * 32) as u32, 1, 1),
            &args,
        )
    }

    /// The b1-plane mat-vec (`kernels/mvbp.cu`) of `planes` code planes (1: Q1_0, 2: Q2_0 g128 /
    /// PQ2_0; [`retile_b1p`]): `segs` in the tiled b1-plane layout (codes
    /// `[n_out / 16, n_in / 256, planes, 32]` uint4, scales `[n_out / 16, n_in / 128, 8]` u32), activations
    /// as int16 bit planes `xp` `[n, n_in / 256, 32]` uint4 with block scales `xu` `[n, n_in / 128]`
    /// f32 and sums `xs` `[n, n_in / 128, 4]` i32; `y_i[t, o]` as [`Self::mv_lowbit_multi`]. The K
    /// split comes from the shape ([`mvbp_ks`]), so row t of an n-row launch equals the one-row
    /// launch bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn mv_b1p(
        &self,
        planes: usize,
        segs: &[MvSeg],
        xp: u64,
        xu: u64,
        xs: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let Some((args, tiles)) = b1_plane_args(
            "mv_b1p",
            segs,
            (xp, xu, xs),
            8,
            (n_in, n, MVBP_MAX_ROWS),
            accumulate,
        )?
        else {
            return Ok(());
        };
        let ks = mvbp_ks(tiles, n_in);
        let xs_smem = self.mvbp_xs_smem(n, n_in);
        let f = self.mvbp_func(planes, n, ks, xs_smem > 0)?;
        let warps = mvbp_warps(ks);
        self.launch_smem(
            f,
            (cdiv(tiles, warps / ks), 1, 1),
            ((warps * 32) as u32, 1, 1),
            xs_smem as u32,
            &args,
        )
    }

    /// The dynamic shared memory of a b1-plane launch of `n` rows and width `n_in` on the kernels
    /// that hold the activation row in shared memory ([`mvbp_xs_bytes`]), or 0 where they do not
    /// apply: off ([`Self::b1p_xs`]), more than one row, or more than 48 KiB.
    fn mvbp_xs_smem(&self, n: usize, n_in: usize) -> usize {
        let b = mvbp_xs_bytes(n_in);
        if n == 1 && self.b1p_xs() && b <= 48 << 10 {
            b
        } else {
            0
        }
    }

    /// Whether one-row b1-plane launches copy their activation row into shared memory and keep
    /// more weights in flight (`mvbp_q1_n1x_*`; default on, `BONSAI_CUDA_B1P_XS=0` off). Same
    /// float operations: decode and verify rows stay bit-equal either way.
    pub fn b1p_xs(&self) -> bool {
        self.b1p_xs.load(Ordering::Relaxed)
    }

    /// Set [`Self::b1p_xs`] (capture graphs after setting it).
    pub fn set_b1p_xs(&self, on: bool) {
        self.b1p_xs.store(on, Ordering::Relaxed);
    }

    /// Whether a fused GDN launch with the int8 gated norm counts its shared q / k window loads
    /// before its PDL wait with a release-only add instead of after its first barriers with an
    /// acq_rel one: the decode step (no snapshot, `gdn_conv_step_norm_early_d128`) and the
    /// batched-norm verify launches (below); the one-row snapshot launch keeps the late count
    /// (default on, `BONSAI_CUDA_GDN_EARLY=0` off). The same bits; the count's fence and round
    /// trip then overlap the PDL wait instead of stalling the block's barrier chain: decode graph
    /// −0.012 ms per token on Q1_0, −0.018 on Q2_0 (`bench/results/cuda-gdn-early-ab-27b-*.json`).
    /// The batched-norm verify launches (2–8 rows) take `gdn_conv_step_norm_bn_early_d128`; there
    /// the late count's fence also waited for the snapshot stores thread 0 had just issued.
    pub fn gdn_early_count(&self) -> bool {
        self.gdn_early.load(Ordering::Relaxed)
    }

    /// Set [`Self::gdn_early_count`] (capture graphs after setting it).
    pub fn set_gdn_early_count(&self, on: bool) {
        self.gdn_early.store(on, Ordering::Relaxed);
    }

    /// Whether the batched-norm verify launches with the early count and conv width 4 take the
    /// producer-warp kernel `gdn_conv_step_norm_bn_pw_d128` (256 threads: 4 recurrence warps, and
    /// 4 warps that run every row's convs, norms, gates and record stores ahead of them and hand
    /// them over through shared memory and named barriers) instead of
    /// `gdn_conv_step_norm_bn_early_d128`, whose 4 warps each do both. The same float operations
    /// in the same order, so the same bits. On by default (`BONSAI_CUDA_GDN_PW=0` off): on an H100
    /// the 27B rejected round went 6.081 → 6.052 ms (Q1_0) and 7.211 → 7.197 ms (Q2_0), lower in
    /// every one of 4 + 4 alternations, the step unchanged (the kernels README has the numbers).
    pub fn gdn_producer(&self) -> bool {
        self.gdn_pw.load(Ordering::Relaxed)
    }

    /// Set [`Self::gdn_producer`] (capture graphs after setting it).
    pub fn set_gdn_producer(&self, on: bool) {
        self.gdn_pw.store(on, Ordering::Relaxed);
    }

    /// The SwiGLU-fused decode gate‖up launch on b1-planes (`mvbp_q1_n1_k1_swi`; `mvbp_q2_*` for
    /// `planes` = 2): gate and up in the b1-plane layout (`(codes, scales)` each), one activation row; writes SiLU(gate) ⊙ up to
    /// `out` exactly as [`Self::mv_b1p`] over `[gate, up]` followed by [`Self::swiglu_quant`]
    /// would. `Ok(false)` (nothing launched) where the fusion is off, `n_out % 32 != 0`, or the
    /// shape's K split ([`mvbp_ks`] of the 2·n_out rows) is not 1.
    /// With `p16`, the output goes there as b1-plane activations instead of int8 codes (only
    /// `out.f` of `out` is written), exactly as [`Self::mv_b1p`] followed by
    /// [`Self::swiglu_quant_p16`] would write them (`mvbp_q1_n1x_k1_swi_p16`, `mvbp_q2_*`: a cluster of the 4
    /// blocks of each 128 outputs); that needs `n_out % 256 == 0` and the activation row in shared
    /// memory ([`Self::b1p_xs`]), else `Ok(false)`.
    #[allow(clippy::too_many_arguments)]
    pub fn mv_swiglu_b1p(
        &self,
        planes: usize,
        gate: (u64, u64),
        up: (u64, u64),
        n_out: usize,
        n_in: usize,
        (xp, xu, xs): (u64, u64, u64),
        out: QuantOut,
        p16: Option<P16Out>,
    ) -> Result<bool> {
        if !self.swiglu_fused()
            || n_out == 0
            || n_out % 32 != 0
            || n_in == 0
            || n_in % 256 != 0
            || mvbp_ks(2 * n_out / 16, n_in) != 1
        {
            return Ok(false);
        }
        check_planes("mv_swiglu_b1p", planes)?;
        if xp % 16 != 0 || xu % 8 != 0 || xs % 16 != 0 {
            return Err(CudaError(format!(
                "mv_swiglu_b1p: misaligned activations xp {xp:#x} xu {xu:#x} xs {xs:#x}"
            )));
        }
        let xs_smem = self.mvbp_xs_smem(1, n_in);
        if let Some(p) = p16 {
            if !self.hopper() || xs_smem == 0 || n_out % 256 != 0 {
                return Ok(false);
            }
            p.check("mv_swiglu_b1p", n_out)?;
            let mut args = swi_args(gate, up, n_out, (xp, xu, xs), n_in, true, out).to_vec();
            args.truncate(11); // through hf
            args.extend([Arg::P(p.xp), Arg::P(p.xu), Arg::P(p.xs), Arg::P(p.xv)]);
            self.launch_smem(
                if planes == 1 {
                    self.f.mvbp_q1_n1x_k1_swi_p16
                } else {
                    self.f.mvbp_q2_n1x_k1_swi_p16
                },
                ((n_out / 32) as u32, 1, 1),
                (128, 1, 1),
                xs_smem as u32,
                &args,
            )?;
            return Ok(true);
        }
        let f = match (planes, xs_smem > 0) {
            (1, true) => self.f.mvbp_q1_n1x_k1_swi,
            (1, false) => self.f.mvbp_q1_n1_k1_swi,
            (_, true) => self.f.mvbp_q2_n1x_k1_swi,
            (_, false) => self.f.mvbp_q2_n1_k1_swi,
        };
        self.launch_smem(
            f,
            ((n_out / 32) as u32, 1, 1),
            (128, 1, 1),
            xs_smem as u32,
            &swi_args(gate, up, n_out, (xp, xu, xs), n_in, true, out),
        )?;
        Ok(true)
    }

    /// The int8 tensor-core verify mat-vec on the b1-plane layout (`mvbq_q1_*`, `kernels/mvbp.cu`):
    /// `segs` as [`Self::mv_b1p`], activations as the norm's byte-split codes `xv`
    /// `[n, n_in / 128, 4 quarters, 4 sub-blocks]` uint4 ([`b1q_acts_host`] spells the layout) with
    /// the block scales `xu` and sub-block sums `xs` of the b1-plane activations; `n` ≤
    /// [`MAX_ROWS`]. Same exact block integers and float operations as the b1-plane kernels with
    /// the shape's K split, so row t equals the one-row [`Self::mv_b1p`] launch of that row bit
    /// for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn mv_b1q(
        &self,
        planes: usize,
        segs: &[MvSeg],
        xv: u64,
        xu: u64,
        xs: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        let Some((args, tiles)) = b1_plane_args(
            "mv_b1q",
            segs,
            (xv, xu, xs),
            4,
            (n_in, n, MAX_ROWS),
            accumulate,
        )?
        else {
            return Ok(());
        };
        check_planes("mv_b1q", planes)?;
        let ks = mvbp_ks(tiles, n_in);
        let f = &self.f;
        // the variants by K split 1, 2, 4, 8, 16, and the launch shape
        let r = self.b1q_tiles();
        let t = match (planes, r, self.b1q_ahead()) {
            (1, 1, _) => [
                f.mvbq_q1_r1_k1,
                f.mvbq_q1_r1_k2,
                f.mvbq_q1_r1_k4,
                f.mvbq_q1_r1_k8,
                f.mvbq_q1_r1_k16,
            ],
            (1, _, true) => [
                f.mvbq_q1_r2a_k1,
                f.mvbq_q1_r2a_k2,
                f.mvbq_q1_r2a_k4,
                f.mvbq_q1_r2a_k8,
                f.mvbq_q1_r2a_k16,
            ],
            (1, _, false) => [
                f.mvbq_q1_r2_k1,
                f.mvbq_q1_r2_k2,
                f.mvbq_q1_r2_k4,
                f.mvbq_q1_r2_k8,
                f.mvbq_q1_r2_k16,
            ],
            (_, 1, _) => [
                f.mvbq_q2_r1_k1,
                f.mvbq_q2_r1_k2,
                f.mvbq_q2_r1_k4,
                f.mvbq_q2_r1_k8,
                f.mvbq_q2_r1_k16,
            ],
            (_, _, true) => [
                f.mvbq_q2_r2a_k1,
                f.mvbq_q2_r2a_k2,
                f.mvbq_q2_r2a_k4,
                f.mvbq_q2_r2a_k8,
                f.mvbq_q2_r2a_k16,
            ],
            (_, _, false) => [
                f.mvbq_q2_r2_k1,
                f.mvbq_q2_r2_k2,
                f.mvbq_q2_r2_k4,
                f.mvbq_q2_r2_k8,
                f.mvbq_q2_r2_k16,
            ],
        };
        // each warp takes r consecutive tiles
        let warps = mvbp_warps(ks);
        let grid = cdiv(tiles, warps / ks * r);
        let f = match ks {
            1 | 2 | 4 | 8 | 16 => t[ks.trailing_zeros() as usize],
            _ => return Err(CudaError(format!("mv_b1q: no variant with K split {ks}"))),
        };
        self.launch(f, (grid, 1, 1), ((warps * 32) as u32, 1, 1), &args)
    }

    /// Whether verify launches (2..=8 rows) of b1-plane matrices take the int8 tensor-core kernel
    /// [`Self::mv_b1q`] on the norm's byte-split codes (default on; `BONSAI_CUDA_B1Q=0` keeps the
    /// 5-row b1-plane kernels). The same bits either way.
    pub fn b1q(&self) -> bool {
        self.b1q.load(Ordering::Relaxed)
    }

    /// Set [`Self::b1q`] (capture graphs after setting it).
    pub fn set_b1q(&self, on: bool) {
        self.b1q.store(on, Ordering::Relaxed);
    }

    /// Whether verify launches (2..=8 rows) of the GDN kernel with the int8 gated norm take
    /// `gdn_conv_step_norm_bn_d128`: the norm of all rows after the recurrence, one cluster
    /// exchange instead of a cluster barrier per row (default on;
    /// `BONSAI_CUDA_GDN_NORM_BATCH=0` off). The same bits either way; decode keeps the one-row
    /// kernel.
    pub fn gdn_norm_batch(&self) -> bool {
        self.gdn_norm_batch.load(Ordering::Relaxed)
    }

    /// Set [`Self::gdn_norm_batch`] (capture graphs after setting it).
    pub fn set_gdn_norm_batch(&self, on: bool) {
        self.gdn_norm_batch.store(on, Ordering::Relaxed);
    }

    /// Whether an RMS norm whose every consumer reads its b1-plane outputs skips the int8 codes
    /// ([`Self::rmsnorm_quant_p16`] with `q = 0`; the engine decides per norm). Default on;
    /// `BONSAI_CUDA_NORM_P16_ONLY=0` writes them always. The same planes either way.
    pub fn norm_p16_only(&self) -> bool {
        self.norm_p16_only.load(Ordering::Relaxed)
    }

    /// Set [`Self::norm_p16_only`] (capture graphs after setting it).
    pub fn set_norm_p16_only(&self, on: bool) {
        self.norm_p16_only.store(on, Ordering::Relaxed);
    }

    /// Whether an RMS norm of verify rows whose every consumer runs on [`Self::mv_b1q`] also
    /// skips the b1-plane planes (`xp = 0`: that kernel reads the byte-split codes, units and
    /// sums). Takes effect with [`Self::norm_p16_only`]. Default on;
    /// `BONSAI_CUDA_NORM_B1Q_ONLY=0` writes them always. The same verify bits either way.
    pub fn norm_b1q_only(&self) -> bool {
        self.norm_b1q_only.load(Ordering::Relaxed)
    }

    /// Set [`Self::norm_b1q_only`] (capture graphs after setting it).
    pub fn set_norm_b1q_only(&self, on: bool) {
        self.norm_b1q_only.store(on, Ordering::Relaxed);
    }

    /// Whether the producers of the out-projections' inputs (the gated norm fused into the GDN
    /// step for ssm_out, the SwiGLU for ffn_down) write b1-plane activations, so that those
    /// Q1_0 projections run on the b1-plane kernels ([`Self::mv_b1p`], and [`Self::mv_b1q`] for
    /// verify rows) like the norm-fed ones. Off by default (`BONSAI_CUDA_B1P_OUT=1` on): on the
    /// H200 (27B Q1_0, `bench/results/cuda-b1p-out-ab-27b-q1.json`) it made the greedy step slower,
    /// 2.545 → 2.865 ms (its mat-vecs 1.87 → 2.09 ms: the one-row b1-plane launches of these
    /// 5,120-output, long-K shapes have one 16-row tile per block, so each block reads a whole
    /// activation row of 2 bytes per element for as many weight bytes), and the round 7.72 →
    /// 7.89 ms (the tensor-core verify of these shapes took about what the dp4a one did). Needs
    /// [`Self::b1p`]; decode and verify rows stay bit-equal either way.
    pub fn b1p_out(&self) -> bool {
        self.b1p_out.load(Ordering::Relaxed) && self.b1p()
    }

    /// Set [`Self::b1p_out`] (capture graphs after setting it).
    pub fn set_b1p_out(&self, on: bool) {
        self.b1p_out.store(on, Ordering::Relaxed);
    }

    /// Whether a loader gives the Q2_0 g128 / PQ2_0 projections a b1-plane layout of two code
    /// planes (`kernels/mvbp.cu`'s `mvbp_q2_*` / `mvbq_q2_*`) as it does the Q1_0 ones; read at
    /// load only (default on, `BONSAI_CUDA_B2P=0` off). Once loaded, [`Self::b1p`] switches both
    /// kinds at run time. Q2_0 g64 has no such layout (its scales change every 64 elements).
    pub fn b2p(&self) -> bool {
        self.b2p.load(Ordering::Relaxed)
    }

    /// Set [`Self::b2p`] (before loading a model).
    pub fn set_b2p(&self, on: bool) {
        self.b2p.store(on, Ordering::Relaxed);
    }

    /// Whether the dp4a verify launches of `kind` with 4 or 5 rows that would take the 5-row
    /// kernels split their activation rows over 2 blocks of 3 (`mv_*_n3r4s` / `mv_*_n3r8s`: twice
    /// the warps, each with registers for 3 rows). Every row keeps the one-row launch's operations,
    /// so verify rows still equal decode rows bit for bit. Default: Q2_0 g128 / PQ2_0 on (its
    /// 27B round 8.77 → 8.01 ms at 4 rows per warp on the H200), Q1_0 off (7.28 → 7.40 ms);
    /// `BONSAI_CUDA_MV_RSPLIT=0|1` or [`Self::set_mv_rsplit`] forces it for every kind.
    pub fn mv_rsplit(&self, kind: WKind) -> bool {
        match self.mv_rsplit.load(Ordering::Relaxed) {
            0 => false,
            1 => true,
            _ => kind == WKind::Q2,
        }
    }

    /// Force [`Self::mv_rsplit`] on or off for every kind (`None`: per kind). Capture graphs
    /// after setting it.
    pub fn set_mv_rsplit(&self, on: Option<bool>) {
        self.mv_rsplit
            .store(on.map_or(2, |v| v as u8), Ordering::Relaxed);
    }

    /// Whether the dp4a verify launches that take the 5-row kernels (`_n5r4`, `_n5r8`) take their
    /// rows-first forms (`_n5r4f`, `_n5r8f`: a sub-block's activation rows loaded first, each
    /// weight word unpacked once for all of them, where ptxas unpacks it again for every row in
    /// the plain ones; the Q1_0 `_n5r8_k2` main loop 2,523 → 1,705 instructions). On by default
    /// (`BONSAI_CUDA_MV_ROWS_FIRST=0` off): the 27B Q1_0 rejected round graph 6.96–6.99 → 6.59–6.61
    /// ms on the H200, the step unchanged (`cuda_spec_bench::cuda_rows_first_round_ab`,
    /// `bench/results/cuda-rows-first-ab-27b-*.json`). The same float operations
    /// per row, so the same bits by construction; `gpu_kernels::matvec_rsplit_equals_one_row`
    /// runs both. The row split ([`Self::mv_rsplit`], Q2_0's default) takes precedence. It also
    /// switches the DSpark drafter's Q4_1 block launches (n ≤ 4) to `mv_q41_n4f`, the same
    /// transformation of `mv_q41_n4` (`cuda_drafter::cuda_q41_mv_vs_reference` runs both).
    pub fn mv_rows_first(&self) -> bool {
        self.mv_rows_first.load(Ordering::Relaxed)
    }

    /// Set [`Self::mv_rows_first`] (capture graphs after setting it).
    pub fn set_mv_rows_first(&self, on: bool) {
        self.mv_rows_first.store(on, Ordering::Relaxed);
    }

    /// Whether the int8 tensor-core verify ([`Self::mv_b1q`], two tiles per warp) takes its AHEAD
    /// form (`_r2a`): each block's activation operands loaded one block ahead of their use, the
    /// weights and scales without allocating in L1. On by default (`BONSAI_CUDA_B1Q_AHEAD=0`
    /// off): the 27B rejected round on an H100 6.56–6.71 → 6.32–6.36 ms (Q1_0) and 7.78–7.91 →
    /// 7.36–7.46 (Q2_0), the step unchanged (`cuda_spec_bench::cuda_b1q_ahead_round_ab`,
    /// `bench/results/cuda-h100-verify-loads-ab*-27b-*.json`). The same float operations, so the
    /// same bits; `gpu_kernels::mv_b1q_equals_b1p_one_row` runs both forms.
    pub fn b1q_ahead(&self) -> bool {
        self.b1q_ahead.load(Ordering::Relaxed)
    }

    /// Set [`Self::b1q_ahead`] (capture graphs after setting it).
    pub fn set_b1q_ahead(&self, on: bool) {
        self.b1q_ahead.store(on, Ordering::Relaxed);
    }

    /// Consecutive 16-row tiles per warp of the int8 tensor-core verify ([`Self::mv_b1q`]): 2
    /// (`_r2` / `_r2a` by [`Self::b1q_ahead`], the default) or 1 (`_r1`; `BONSAI_CUDA_B1Q_R=1` at
    /// `Gpu::new`). A warp's tiles share each block's activation operands: on the 27B Q1_0 round
    /// (5-row verify, round graphs) the verify's launches took 2.76 ms with 2 and 4.15 ms with 1
    /// (`bench/results/cuda-b1q-tiles-27b-q1.json`); 4 tiles per warp (`_r4a`, removed) made the
    /// round slower (`bench/results/cuda-h100-b1q-tiles-ab-27b-*.json`). The same bits either way.
    pub fn b1q_tiles(&self) -> usize {
        self.b1q_tiles.load(Ordering::Relaxed)
    }

    /// Set [`Self::b1q_tiles`] to 1 or 2 (capture graphs after setting it).
    pub fn set_b1q_tiles(&self, r: usize) -> Result<()> {
        if !matches!(r, 1 | 2) {
            return Err(CudaError(format!("b1q tiles per warp {r}: 1 or 2")));
        }
        self.b1q_tiles.store(r, Ordering::Relaxed);
        Ok(())
    }

    /// The b1-plane kernel of `planes` code planes for `n` activation rows (1, or 2..=5) and K
    /// split `ks`; with `shared` (one row only) the one holding its activation row in shared memory.
    fn mvbp_func(
        &self,
        planes: usize,
        n: usize,
        ks: usize,
        shared: bool,
    ) -> Result<sys::CUfunction> {
        check_planes("mv_b1p", planes)?;
        let f = &self.f;
        let t = if planes == 2 {
            if n == 1 && shared {
                [
                    f.mvbp_q2_n1x_k1,
                    f.mvbp_q2_n1x_k2,
                    f.mvbp_q2_n1x_k4,
                    f.mvbp_q2_n1x_k8,
                    f.mvbp_q2_n1x_k16,
                ]
            } else if n == 1 {
                [
                    f.mvbp_q2_n1_k1,
                    f.mvbp_q2_n1_k2,
                    f.mvbp_q2_n1_k4,
                    f.mvbp_q2_n1_k8,
                    f.mvbp_q2_n1_k16,
                ]
            } else {
                [
                    f.mvbp_q2_n5_k1,
                    f.mvbp_q2_n5_k2,
                    f.mvbp_q2_n5_k4,
                    f.mvbp_q2_n5_k8,
                    f.mvbp_q2_n5_k16,
                ]
            }
        } else if n == 1 && shared {
            [
                f.mvbp_q1_n1x_k1,
                f.mvbp_q1_n1x_k2,
                f.mvbp_q1_n1x_k4,
                f.mvbp_q1_n1x_k8,
                f.mvbp_q1_n1x_k16,
            ]
        } else if n == 1 {
            [
                f.mvbp_q1_n1_k1,
                f.mvbp_q1_n1_k2,
                f.mvbp_q1_n1_k4,
                f.mvbp_q1_n1_k8,
                f.mvbp_q1_n1_k16,
            ]
        } else {
            [
                f.mvbp_q1_n5_k1,
                f.mvbp_q1_n5_k2,
                f.mvbp_q1_n5_k4,
                f.mvbp_q1_n5_k8,
                f.mvbp_q1_n5_k16,
            ]
        };
        match ks {
            1 | 2 | 4 | 8 | 16 => Ok(t[ks.trailing_zeros() as usize]),
            _ => Err(CudaError(format!("mv_b1p: no variant with K split {ks}"))),
        }
    }

    /// The b1-plane timing substitution (benchmarks only; every result is wrong while it is on):
    /// the Q1_0 mat-vecs of up to [`MVBP_MAX_ROWS`] rows, and the SwiGLU gate‖up launch, run
    /// [`Self::mv_b1p`] on the model's own code and scale bytes (read as if tiled: the same bytes
    /// from DRAM) against zeroed activation planes, so a decode graph measures what the b1-plane
    /// kernels would cost in it before the activation producers write planes. Turning it on
    /// allocates its scratch (do it before a graph capture); off frees it.
    pub fn set_b1p_timing(&self, on: bool) -> Result<()> {
        let mut t = self.b1p_timing.lock().expect("b1p timing lock");
        if !on {
            *t = None;
            return Ok(());
        }
        if t.is_none() {
            let zeroed = |bytes: usize| -> Result<DevBuf> {
                let b = self.alloc(bytes)?;
                self.zero(b.ptr(), bytes)?;
                Ok(b)
            };
            let blocks = MVBP_MAX_ROWS * B1P_TIMING_MAX_IN / 128;
            *t = Some(B1pTiming {
                planes: zeroed(MVBP_MAX_ROWS * B1P_TIMING_MAX_IN * 2)?,
                u: zeroed(blocks * 4)?,
                sa: zeroed(blocks * 16)?,
                y: zeroed(MVBP_MAX_ROWS * B1P_TIMING_MAX_OUT * 4)?,
            });
        }
        Ok(())
    }

    /// Whether projections with a b1-plane layout (Q1_0; Q2_0 with [`Self::b2p`]) take [`Self::mv_b1p`] when their input
    /// comes with b1-plane activations (default on; `BONSAI_CUDA_B1P=0` off). The engine decides
    /// per launch; captured graphs key on it. Decode and verify rows always agree, because both
    /// follow the same switch.
    pub fn b1p(&self) -> bool {
        self.mv_b1p.load(Ordering::Relaxed)
    }

    /// Set [`Self::b1p`] (benchmarks compare; capture graphs after setting it).
    pub fn set_b1p(&self, on: bool) {
        self.mv_b1p.store(on, Ordering::Relaxed);
    }

    /// Whether the b1-plane timing substitution is on ([`Self::set_b1p_timing`]).
    pub fn b1p_timing(&self) -> bool {
        self.b1p_timing.lock().expect("b1p timing lock").is_some()
    }

    /// Under the timing substitution, the b1-plane launch standing in for a Q1_0 mat-vec (`y`
    /// `None`) or for the SwiGLU gate‖up launch (`y` the scratch rows): `Ok(false)` where it does
    /// not apply (off, another kind, more rows or a shape the kernel does not take).
    fn b1p_stand_in(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        n_in: usize,
        n: usize,
        accumulate: bool,
        swiglu: bool,
    ) -> Result<bool> {
        let t = self.b1p_timing.lock().expect("b1p timing lock");
        let Some(t) = t.as_ref() else {
            return Ok(false);
        };
        let rows: usize = segs.iter().map(|s| s.n_out).sum();
        if kind != WKind::Q1
            || rows < b1p_timing_min_rows()
            || n > MVBP_MAX_ROWS
            || n_in % 256 != 0
            || n_in > B1P_TIMING_MAX_IN
            || segs.iter().any(|s| s.n_out % 16 != 0)
            || (swiglu && rows > B1P_TIMING_MAX_OUT)
        {
            return Ok(false);
        }
        let mut v = segs.to_vec();
        if swiglu {
            let mut o = 0;
            for s in &mut v {
                s.y = t.y.ptr() + (o * 4) as u64;
                o += s.n_out;
            }
        }
        self.mv_b1p(
            1,
            &v,
            t.planes.ptr(),
            t.u.ptr(),
            t.sa.ptr(),
            n_in,
            n,
            accumulate,
        )?;
        Ok(true)
    }

    /// The launch plan of a low-bit mat-vec over `rows` output rows of width `n_in` with `n`
    /// activation rows: the override when one is set ([`Gpu::set_mv_override`]), else the defaults
    /// ([`mv_default_plan`], with the verify plan of [`Gpu::mv_verify`] and the long launches'
    /// rows per warp of [`Gpu::set_mv_long_r`]).
    pub fn mv_plan(&self, kind: WKind, n: usize, rows: usize, n_in: usize) -> MvPlan {
        if let Some(p) = *self.mv_override.lock().expect("mv override lock") {
            return p;
        }
        let mut p = mv_default_plan(kind, n, rows, n_in);
        (p.rn, p.n5) = self.mv_verify(kind);
        let long_r = self.mv_long_r.load(Ordering::Relaxed);
        if n == 1 && !p.pipe && long_r != 0 && rows > 15_000 {
            p.r = long_r;
        }
        p
    }

    /// Whether [`MvStaged::Auto`] stages Q1_0's long one-row launches too (gate‖up, then with the
    /// SwiGLU in `mvs_*_swi`, and the head); off: a benchmark switch (H200, 22a66b2: Q1_0 decode
    /// graph 2.870 → 2.923 ms/token with it). The same bits either way.
    pub fn mvs_q1(&self) -> bool {
        self.mvs_q1.load(Ordering::Relaxed)
    }

    /// Set [`Self::mvs_q1`].
    pub fn set_mvs_q1(&self, on: bool) {
        self.mvs_q1.store(on, Ordering::Relaxed);
    }

    /// The verify (n ≥ 2) dp4a plan of `kind`'s default plans: weight rows per warp and whether
    /// n ≤ 5 takes the 5-row kernels (`BONSAI_CUDA_MV_RN`, `BONSAI_CUDA_MV_N5`, else
    /// [`mv_verify_default`]).
    pub fn mv_verify(&self, kind: WKind) -> (usize, bool) {
        let (rn, n5) = mv_verify_default(kind);
        let rn = match self.mv_rn.load(Ordering::Relaxed) {
            0 => rn,
            r => r,
        };
        let n5 = match self.mv_n5.load(Ordering::Relaxed) {
            2 => n5,
            v => v == 1,
        };
        (rn, n5)
    }

    /// Force the verify plan for every kind (`None`: per kind). `rn` 2, 4 or 8 (anything else is
    /// 4). Verify rows stay equal to decode rows either way; captured graphs key on it.
    pub fn set_mv_verify(&self, rn: Option<usize>, n5: Option<bool>) {
        let rn = rn.map_or(0, |r| if matches!(r, 2 | 8) { r } else { 4 });
        self.mv_rn.store(rn, Ordering::Relaxed);
        self.mv_n5
            .store(n5.map_or(2, |on| on as u8), Ordering::Relaxed);
    }

    /// Which one-row dp4a launches take the staged kernel (`kernels/mvs.cu`: weights through a
    /// shared-memory ring filled by the bulk copy engine; `BONSAI_CUDA_MV_STAGED`, default
    /// [`MV_STAGED_DEFAULT`]). Same float order as the plain kernel with the plan's K split, so it
    /// may change at any time without changing a result; shapes it cannot take fall back.
    pub fn mv_staged_mode(&self) -> MvStaged {
        if !self.hopper() {
            // bulk copies with mbarriers: sm_90+
            return MvStaged::Off;
        }
        MvStaged::from_u8(self.mv_staged.load(Ordering::Relaxed))
    }

    /// Whether this GPU has the sm_90 features some kernels need (thread-block clusters, bulk
    /// copies with mbarriers). Below it the kernels compile with trapping stubs and the getters of
    /// the modes that would launch them ([`Self::mv_staged_mode`], [`Self::gdn_fused`],
    /// [`Self::swiglu_fused`]) answer with the plain kernels.
    pub fn hopper(&self) -> bool {
        self.arch.0 >= 9
    }

    /// Set [`Self::mv_staged_mode`].
    pub fn set_mv_staged_mode(&self, m: MvStaged) {
        self.mv_staged.store(m as u8, Ordering::Relaxed);
    }

    /// Whether any launch is staged ([`Self::mv_staged_mode`] is not off).
    pub fn mv_staged(&self) -> bool {
        self.mv_staged_mode() != MvStaged::Off
    }

    /// Every launch staged (`true`: [`MvStaged::All`]) or none.
    pub fn set_mv_staged(&self, on: bool) {
        self.set_mv_staged_mode(if on { MvStaged::All } else { MvStaged::Off });
    }

    /// Whether a one-row launch of `rows` rows of `kind` takes the staged kernel under the mode.
    fn staged_for(&self, kind: WKind, rows: usize) -> bool {
        match self.mv_staged_mode() {
            MvStaged::Off => false,
            MvStaged::Auto => mvs_auto(kind, rows, self.mvs_min_rows(), self.mvs_q1()),
            MvStaged::All => true,
        }
    }

    /// The fewest rows of a Q2 launch that [`MvStaged::Auto`] stages (default [`MVS_MIN_ROWS`]).
    pub fn mvs_min_rows(&self) -> usize {
        self.mvs_min_rows.load(Ordering::Relaxed)
    }

    /// Set [`Self::mvs_min_rows`].
    pub fn set_mvs_min_rows(&self, rows: usize) {
        self.mvs_min_rows.store(rows, Ordering::Relaxed);
    }

    /// Rows per warp of the staged kernel (0: chosen per launch by [`mvs_layout`]).
    pub fn mvs_rows(&self) -> usize {
        self.mvs_rows.load(Ordering::Relaxed)
    }

    /// Set [`Self::mvs_rows`] (0, 1, 2 or 4; anything else is 0).
    pub fn set_mvs_rows(&self, r: usize) {
        let r = if matches!(r, 1 | 2 | 4) { r } else { 0 };
        self.mvs_rows.store(r, Ordering::Relaxed);
    }

    /// Ring stages of the staged kernel (0: chosen per launch by [`mvs_layout`]).
    pub fn mvs_stages(&self) -> usize {
        self.mvs_stages.load(Ordering::Relaxed)
    }

    /// Set [`Self::mvs_stages`] (0 to 8).
    pub fn set_mvs_stages(&self, s: usize) {
        self.mvs_stages.store(s.min(8), Ordering::Relaxed);
    }

    /// Force one plan for every low-bit mat-vec (benchmark sweeps and tests); `None` restores the
    /// shape-based defaults. `r` 2, 4 or 8 (2 or 4 when pipelined); `ks` 1, 2 or 4.
    pub fn set_mv_override(&self, plan: Option<MvPlan>) {
        if let Some(p) = plan {
            let r_ok = if p.pipe {
                matches!(p.r, 2 | 4)
            } else {
                matches!(p.r, 2 | 4 | 8)
            };
            assert!(
                r_ok && matches!(p.ks, 1 | 2 | 4) && matches!(p.rn, 2 | 4 | 8),
                "bad plan {p:?}"
            );
        }
        *self.mv_override.lock().expect("mv override lock") = plan;
    }

    /// The dp4a kernel of `kind` for `n` activation rows with `r` weight rows per warp and K split
    /// `ks`: `_n1_rR` for n = 1, `_n5rR` (R 4 or 8) for n ≤ 5 when `n5`, else `_n8` (R 2) or
    /// `_n8r4` (R 4, also for an asked 8). Returns the rows per warp it runs with.
    fn mv_func(
        &self,
        kind: WKind,
        n: usize,
        r: usize,
        ks: usize,
        n5: bool,
    ) -> Result<(usize, sys::CUfunction, usize)> {
        let f = &self.f;
        let t = match kind {
            WKind::Q1 => [
                [f.mv_q1_n8_k1, f.mv_q1_n8_k2, f.mv_q1_n8_k4],
                [f.mv_q1_n8r4_k1, f.mv_q1_n8r4_k2, f.mv_q1_n8r4_k4],
                [f.mv_q1_n1_r2_k1, f.mv_q1_n1_r2_k2, f.mv_q1_n1_r2_k4],
                [f.mv_q1_n1_r4_k1, f.mv_q1_n1_r4_k2, f.mv_q1_n1_r4_k4],
                [f.mv_q1_n1_r8_k1, f.mv_q1_n1_r8_k2, f.mv_q1_n1_r8_k4],
                [f.mv_q1_n5r4_k1, f.mv_q1_n5r4_k2, f.mv_q1_n5r4_k4],
                [f.mv_q1_n5r8_k1, f.mv_q1_n5r8_k2, f.mv_q1_n5r8_k4],
                [f.mv_q1_n3r4s_k1, f.mv_q1_n3r4s_k2, f.mv_q1_n3r4s_k4],
                [f.mv_q1_n3r8s_k1, f.mv_q1_n3r8s_k2, f.mv_q1_n3r8s_k4],
                [f.mv_q1_n5r4f_k1, f.mv_q1_n5r4f_k2, f.mv_q1_n5r4f_k4],
                [f.mv_q1_n5r8f_k1, f.mv_q1_n5r8f_k2, f.mv_q1_n5r8f_k4],
            ],
            WKind::Q2 => [
                [f.mv_q2_n8_k1, f.mv_q2_n8_k2, f.mv_q2_n8_k4],
                [f.mv_q2_n8r4_k1, f.mv_q2_n8r4_k2, f.mv_q2_n8r4_k4],
                [f.mv_q2_n1_r2_k1, f.mv_q2_n1_r2_k2, f.mv_q2_n1_r2_k4],
                [f.mv_q2_n1_r4_k1, f.mv_q2_n1_r4_k2, f.mv_q2_n1_r4_k4],
                [f.mv_q2_n1_r8_k1, f.mv_q2_n1_r8_k2, f.mv_q2_n1_r8_k4],
                [f.mv_q2_n5r4_k1, f.mv_q2_n5r4_k2, f.mv_q2_n5r4_k4],
                [f.mv_q2_n5r8_k1, f.mv_q2_n5r8_k2, f.mv_q2_n5r8_k4],
                [f.mv_q2_n3r4s_k1, f.mv_q2_n3r4s_k2, f.mv_q2_n3r4s_k4],
                [f.mv_q2_n3r8s_k1, f.mv_q2_n3r8s_k2, f.mv_q2_n3r8s_k4],
                [f.mv_q2_n5r4f_k1, f.mv_q2_n5r4f_k2, f.mv_q2_n5r4f_k4],
                [f.mv_q2_n5r8f_k1, f.mv_q2_n5r8f_k2, f.mv_q2_n5r8f_k4],
            ],
            WKind::Q2G64 => [
                [f.mv_q2g64_n8_k1, f.mv_q2g64_n8_k2, f.mv_q2g64_n8_k4],
                [f.mv_q2g64_n8r4_k1, f.mv_q2g64_n8r4_k2, f.mv_q2g64_n8r4_k4],
                [
                    f.mv_q2g64_n1_r2_k1,
                    f.mv_q2g64_n1_r2_k2,
                    f.mv_q2g64_n1_r2_k4,
                ],
                [
                    f.mv_q2g64_n1_r4_k1,
                    f.mv_q2g64_n1_r4_k2,
                    f.mv_q2g64_n1_r4_k4,
                ],
                [
                    f.mv_q2g64_n1_r8_k1,
                    f.mv_q2g64_n1_r8_k2,
                    f.mv_q2g64_n1_r8_k4,
                ],
                [f.mv_q2g64_n5r4_k1, f.mv_q2g64_n5r4_k2, f.mv_q2g64_n5r4_k4],
                [f.mv_q2g64_n5r8_k1, f.mv_q2g64_n5r8_k2, f.mv_q2g64_n5r8_k4],
                [
                    f.mv_q2g64_n3r4s_k1,
                    f.mv_q2g64_n3r4s_k2,
                    f.mv_q2g64_n3r4s_k4,
                ],
                [
                    f.mv_q2g64_n3r8s_k1,
                    f.mv_q2g64_n3r8s_k2,
                    f.mv_q2g64_n3r8s_k4,
                ],
                [
                    f.mv_q2g64_n5r4f_k1,
                    f.mv_q2g64_n5r4f_k2,
                    f.mv_q2g64_n5r4f_k4,
                ],
                [
                    f.mv_q2g64_n5r8f_k1,
                    f.mv_q2g64_n5r8f_k2,
                    f.mv_q2g64_n5r8f_k4,
                ],
            ],
            WKind::F32 => return Err(CudaError("mv_lowbit on an f32 matrix".into())),
            WKind::Q41 => return Err(CudaError("mv_lowbit on a Q4_1 matrix (use mv_q41)".into())),
        };
        let Some((row, rpw)) = mv_variant(n, r, n5, self.mv_rsplit(kind)) else {
            return Err(CudaError(format!(
                "mv_lowbit: no variant with {r} rows per warp"
            )));
        };
        let col = match ks {
            1 => 0,
            2 => 1,
            4 => 2,
            _ => {
                return Err(CudaError(format!(
                    "mv_lowbit: no variant with K split {ks}"
                )))
            }
        };
        // rows 9 and 10 of each table: the rows-first forms of rows 5 and 6 (the 5-row kernels)
        let trow = match row {
            5 | 6 if self.mv_rows_first() => row + 4,
            _ => row,
        };
        Ok((rpw, t[trow][col], MV_VARIANTS[row].3))
    }

    /// f32 weights `[n_out, n_in]` times f32 activations `[n, n_in]`.
    pub fn mv_f32(
        &self,
        w: u64,
        x: u64,
        y: u64,
        n_in: usize,
        n_out: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.launch(
            self.f.mv_f32,
            (cdiv(n_out, 8), 1, 1),
            (256, 1, 1),
            &[
                Arg::P(w),
                Arg::P(x),
                Arg::P(y),
                Arg::I(n_in as i32),
                Arg::I(n_out as i32),
                Arg::I(n as i32),
                Arg::I(accumulate as i32),
            ],
        )
    }

    /// `x[t] = table[ids[t]]` dequantized (ids: device i32 `[n]`).
    pub fn embed_rows(
        &self,
        kind: WKind,
        codes: u64,
        scales: u64,
        f32tab: u64,
        ids: u64,
        n: usize,
        n_rows: usize,
        n_in: usize,
        x: u64,
    ) -> Result<()> {
        self.launch(
            self.f.embed_rows,
            // about 4 elements per thread (5 blocks per row for n_in = 5,120)
            (n as u32, cdiv(n_in, 1024), 1),
            (256, 1, 1),
            &[
                Arg::I(kind as i32),
                Arg::P(codes),
                Arg::P(scales),
                Arg::P(f32tab),
                Arg::P(ids),
                Arg::I(n_rows.min(i32::MAX as usize) as i32),
                Arg::I(n_in as i32),
                Arg::P(x),
            ],
        )
    }

    /// GDN conv + SiLU + q/k L2 norm + gates over `n` rows (see the kernel for layouts).
    pub fn gdn_conv(
        &self,
        mixed: u64,
        conv_state: u64,
        convw: u64,
        kconv: usize,
        hk: usize,
        hv: usize,
        dk: usize,
        n: usize,
        eps: f32,
        qo: u64,
        ko: u64,
        vo: u64,
        bb: u64,
        aa: u64,
        dt_bias: u64,
        ssm_a: u64,
        beta: u64,
        g: u64,
    ) -> Result<()> {
        assert!(dk <= 1024 && dk % 32 == 0);
        self.launch(
            self.f.gdn_conv,
            ((2 * hk + hv + 1) as u32, 1, 1),
            (dk as u32, 1, 1),
            &gdn_conv_args(
                mixed, conv_state, convw, kconv, hk, hv, dk, n, eps, qo, ko, vo, bb, aa, dt_bias,
                ssm_a, beta, g,
            ),
        )
    }

    /// `n` recurrent gated delta-rule steps (dk ≤ 128, dk % 8 == 0, dv % 32 == 0).
    pub fn gdn_step(
        &self,
        s: u64,
        q: u64,
        k: u64,
        v: u64,
        g: u64,
        beta: u64,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        n: usize,
        out: u64,
    ) -> Result<()> {
        assert!(dk <= 128 && dk % 8 == 0 && dv % 32 == 0);
        self.launch(
            self.f.gdn_step,
            (hv as u32, (dv / 32) as u32, 1),
            (256, 1, 1),
            &gdn_step_args(s, q, k, v, g, beta, hk, hv, dk, dv, n, out),
        )
    }

    /// [`Self::gdn_conv`] fused into [`Self::gdn_step`] (`gdn_conv_step`): the conv window, the
    /// state `s` and `out` (unless 0) come out bit for bit as from the two launches; q never
    /// leaves the kernel, and the L2-normed k, v and the gates go to `rec_out` when given (the
    /// verify record: [`GdnSide`]). With `norm` (dv = 128 only), the gated norm of
    /// the output is fused in as well (`gdn_conv_step_norm_d128`, a cluster of the head's 4
    /// blocks): `norm` receives what [`Self::gated_norm_quant`] would write, bit for bit.
    /// With `snap = Some((s_snap, conv_snap))` the state and conv window as the launch reads them
    /// are also written there (the speculative round's snapshot, no separate copy).
    /// Decode and verify launches (n ≤ 8); needs [`gdn_fused_supported`]. Not for two streams
    /// at once: the arrival counters are the `Gpu`'s.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_conv_step(
        &self,
        s: u64,
        mixed: u64,
        conv_state: u64,
        convw: u64,
        kconv: usize,
        (hk, hv, dk, dv): (usize, usize, usize, usize),
        n: usize,
        eps: f32,
        (bb, aa, dt_bias, ssm_a): (u64, u64, u64, u64),
        out: u64,
        rec_out: Option<GdnSide>,
        snap: Option<(u64, u64)>,
        norm: Option<GdnNormOut>,
    ) -> Result<()> {
        if !gdn_fused_supported(hk, hv, dk, dv, kconv)
            || (norm.is_some() && (dv != 128 || !self.hopper()))
        {
            return Err(CudaError(format!(
                "gdn_conv_step: no kernel for hk {hk}, hv {hv}, dk {dk}, dv {dv}, conv {kconv}{}",
                if norm.is_some() {
                    " with the gated norm"
                } else {
                    ""
                }
            )));
        }
        if n > MAX_ROWS {
            return Err(CudaError(format!(
                "gdn_conv_step: {n} rows, at most {MAX_ROWS} per launch (decode and verify)"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let cnt = self.gdn_cnt.get().expect("gdn counters").ptr();
        let (ko, vo, beta, g, rec_w) = match rec_out {
            None => (0, 0, 0, 0, 0),
            Some(side) => side.ptrs(hk, hv, dk, dv),
        };
        let mut args = vec![
            Arg::P(s),
            Arg::P(mixed),
            Arg::P(conv_state),
            Arg::P(convw),
            Arg::I(kconv as i32),
            Arg::I(hk as i32),
            Arg::I(hv as i32),
            Arg::I(dk as i32),
            Arg::I(n as i32),
            Arg::F(eps),
            Arg::P(bb),
            Arg::P(aa),
            Arg::P(dt_bias),
            Arg::P(ssm_a),
            Arg::P(cnt),
            Arg::P(out),
            Arg::P(ko),
            Arg::P(vo),
            Arg::P(beta),
            Arg::P(g),
            Arg::I(rec_w as i32),
            Arg::P(snap.map_or(0, |(ss, _)| ss)),
            Arg::P(snap.map_or(0, |(_, cs)| cs)),
        ];
        let mut threads = GDN_CS_THREADS;
        let f = match norm {
            Some(m) => {
                args.extend([Arg::P(m.z), Arg::P(m.w), Arg::F(m.eps), Arg::P(m.out.f)]);
                match m.p16 {
                    Some(p) => {
                        p.check("gdn_conv_step (gated norm)", hv * dv)?;
                        args.extend([Arg::P(p.xp), Arg::P(p.xu), Arg::P(p.xs), Arg::P(p.xv)]);
                        self.f.gdn_conv_step_norm_p16_d128
                    }
                    None => {
                        args.extend([Arg::P(m.out.q), Arg::P(m.out.d), Arg::P(m.out.s)]);
                        if n >= 2 && self.gdn_norm_batch() {
                            if self.gdn_early_count() && self.gdn_producer() && kconv == 4 {
                                threads = GDN_PW_THREADS;
                                self.f.gdn_conv_step_norm_bn_pw_d128
                            } else if self.gdn_early_count() {
                                self.f.gdn_conv_step_norm_bn_early_d128
                            } else {
                                self.f.gdn_conv_step_norm_bn_d128
                            }
                        } else if snap.is_some() {
                            self.f.gdn_conv_step_norm_snap_d128
                        } else if self.gdn_early_count() {
                            self.f.gdn_conv_step_norm_early_d128
                        } else {
                            self.f.gdn_conv_step_norm_d128
                        }
                    }
                }
            }
            None => self.f.gdn_conv_step,
        };
        self.launch(f, (hv as u32, (dv / 32) as u32, 1), (threads, 1, 1), &args)
    }

    /// Which decode / verify GDN kernels run fused (default [`GDN_FUSED_DEFAULT`];
    /// `BONSAI_CUDA_GDN_FUSED=0|1|2`). The same bits in every mode; captured graphs key on it.
    pub fn gdn_fused(&self) -> GdnFused {
        match GdnFused::ALL[self.gdn_fused.load(Ordering::Relaxed) as usize] {
            // the gated-norm fusion runs as a thread-block cluster: sm_90+
            GdnFused::ConvNorm if !self.hopper() => GdnFused::Conv,
            m => m,
        }
    }

    /// Set [`Self::gdn_fused`].
    pub fn set_gdn_fused(&self, mode: GdnFused) {
        self.gdn_fused.store(mode as u8, Ordering::Relaxed);
    }

    /// Rows per warp of the default one-row dp4a plans for launches of more than 15,000 rows
    /// (`0`: the per-kind default; 2, 4 or 8 otherwise; `BONSAI_CUDA_MV_LONG_R`). A staged launch
    /// ([`Self::mv_staged_mode`]) keeps its own layout.
    pub fn set_mv_long_r(&self, r: usize) {
        assert!([0, 2, 4, 8].contains(&r), "rows per warp {r}");
        self.mv_long_r.store(r, Ordering::Relaxed);
    }

    /// [`Self::set_mv_long_r`]'s value.
    pub fn mv_long_r(&self) -> usize {
        self.mv_long_r.load(Ordering::Relaxed)
    }

    /// Per-head `rmsnorm(o) ⊙ w ⊙ SiLU(z)`, f32 to `yf` (unless 0) and quantized. Launches of
    /// more than `MAX_ROWS` rows with dv = 128 take `gated_norm_quant_v4` (same bits).
    pub fn gated_norm_quant(
        &self,
        o: u64,
        z: u64,
        w: u64,
        eps: f32,
        n: usize,
        hv: usize,
        dv: usize,
        yf: u64,
        q: u64,
        d: u64,
        s: u64,
    ) -> Result<()> {
        assert!(dv % 32 == 0 && dv <= 1024);
        // long launches (prefill) with 128-wide heads: one warp per (row, head), 16-byte loads,
        // the same bits (`gated_norm_quant_v4`)
        if n > MAX_ROWS && dv == 128 && (o | z | w | yf) % 16 == 0 && q % 4 == 0 {
            return self.launch(
                self.f.gated_norm_quant_v4,
                (cdiv(n * hv, 8), 1, 1),
                (256, 1, 1),
                &[
                    Arg::P(o),
                    Arg::P(z),
                    Arg::P(w),
                    Arg::F(eps),
                    Arg::I(n as i32),
                    Arg::I(hv as i32),
                    Arg::P(yf),
                    Arg::P(q),
                    Arg::P(d),
                    Arg::P(s),
                ],
            );
        }
        self.launch(
            self.f.gated_norm_quant,
            (hv as u32, n as u32, 1),
            (dv as u32, 1, 1),
            &[
                Arg::P(o),
                Arg::P(z),
                Arg::P(w),
                Arg::F(eps),
                Arg::I(hv as i32),
                Arg::I(dv as i32),
                Arg::P(yf),
                Arg::P(q),
                Arg::P(d),
                Arg::P(s),
            ],
        )
    }

    /// q/k norm + partial NEOX RoPE + K/V append. `pos0`: device i32 holding the first position.
    pub fn attn_prep(
        &self,
        qf: u64,
        kf: u64,
        vf: u64,
        qn: u64,
        kn: u64,
        eps: f32,
        n: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        n_rot: usize,
        rope_base: f32,
        pos0: u64,
        qo: u64,
        kc: u64,
        vc: u64,
    ) -> Result<()> {
        assert!(hd <= 1024 && hd % 32 == 0 && n_rot <= hd);
        self.launch(
            self.f.attn_prep,
            ((nh + nkv) as u32, n as u32, 1),
            (hd as u32, 1, 1),
            &[
                Arg::P(qf),
                Arg::P(kf),
                Arg::P(vf),
                Arg::P(qn),
                Arg::P(kn),
                Arg::F(eps),
                Arg::I(nh as i32),
                Arg::I(nkv as i32),
                Arg::I(hd as i32),
                Arg::I(n_rot as i32),
                Arg::F(rope_base),
                Arg::P(pos0),
                Arg::P(qo),
                Arg::P(kc),
                Arg::P(vc),
            ],
        )
    }

    /// Whether [`Self::attn_decode`] merges with `attn_merge_quant_serial` (one L2 round trip per
    /// chunk; the form before 2026-12-04) instead of `attn_merge_quant` (the loads of a tile of
    /// chunks at once). The same bits either way; graphs key on it.
    pub fn attn_merge_serial(&self) -> bool {
        self.attn_merge_serial.load(Ordering::Relaxed)
    }

    /// Set [`Self::attn_merge_serial`].
    pub fn set_attn_merge_serial(&self, on: bool) {
        self.attn_merge_serial.store(on, Ordering::Relaxed);
    }

    /// Most blocks per head of [`Self::attn_decode`]'s chunk launch of `n` rows (defaults
    /// [`ATTN_GY`]). Chunks are fixed, so any value gives the same bits; graphs key on it.
    pub fn attn_gy(&self, n: usize) -> usize {
        self.attn_gy[(n > 1) as usize].load(Ordering::Relaxed)
    }

    /// Set [`Self::attn_gy`] for one-row launches and for launches of more rows (each clamped to
    /// 1..=65535).
    pub fn set_attn_gy(&self, n1: usize, rows: usize) {
        self.attn_gy[0].store(n1.clamp(1, 65535), Ordering::Relaxed);
        self.attn_gy[1].store(rows.clamp(1, 65535), Ordering::Relaxed);
    }

    /// q heads per block of [`Self::attn_decode`]'s chunk launch of `n` rows at head dim 256 (one
    /// of [`ATTN_HPBS`]; defaults [`ATTN_HPB`]); a launch whose kv group size it does not divide,
    /// or of another head dim, takes 1. Any value gives the same bits; graphs key on it.
    pub fn attn_hpb(&self, n: usize) -> usize {
        self.attn_hpb[(n > 1) as usize].load(Ordering::Relaxed)
    }

    /// Set [`Self::attn_hpb`] for one-row launches and for launches of more rows (a value not in
    /// [`ATTN_HPBS`] is taken as 1).
    pub fn set_attn_hpb(&self, n1: usize, rows: usize) {
        let ok = |v: usize| if ATTN_HPBS.contains(&v) { v } else { 1 };
        self.attn_hpb[0].store(ok(n1), Ordering::Relaxed);
        self.attn_hpb[1].store(ok(rows), Ordering::Relaxed);
    }

    /// Causal attention of `n` rows over the f16 cache (flash-decode: fixed 32-position chunks,
    /// fixed-order merge) ⊙ σ(gate), written f32 to `out` (unless 0) and int8-quantized into
    /// `q`/`d`/`s` (`[n, nh·hd]`, per-32 blocks). `part`: scratch of
    /// [`attn_part_floats`]`(n, nh, hd, n_ctx)` f32. Row t attends to positions `0..=*pos0 + t`.
    pub fn attn_decode(
        &self,
        qo: u64,
        qf: u64,
        kc: u64,
        vc: u64,
        n: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        pos0: u64,
        n_ctx: usize,
        part: u64,
        out: u64,
        q: u64,
        d: u64,
        s: u64,
    ) -> Result<()> {
        assert!(nkv > 0 && nh % nkv == 0);
        let hpb = match self.attn_hpb(n) {
            v if hd == 256 && (nh / nkv) % v == 0 => v,
            _ => 1,
        };
        let f = match (hd, hpb) {
            (64, _) => self.f.attn_chunks_hd64,
            (128, _) => self.f.attn_chunks_hd128,
            (256, 2) => self.f.attn_chunks_hd256_h2,
            (256, 3) => self.f.attn_chunks_hd256_h3,
            (256, 6) => self.f.attn_chunks_hd256_h6,
            (256, _) => self.f.attn_chunks_hd256,
            _ => {
                return Err(CudaError(format!(
                    "attention: head dim {hd} not in 64/128/256"
                )))
            }
        };
        let nchunk = n_ctx.div_ceil(ATTN_CHUNK);
        // grid.y only bounds the parallelism; chunks are fixed, so results do not depend on it
        let gy = nchunk.clamp(1, self.attn_gy(n)) as u32;
        self.launch(
            f,
            ((nh / hpb) as u32, gy, n as u32),
            (128, 1, 1),
            &[
                Arg::P(qo),
                Arg::P(kc),
                Arg::P(vc),
                Arg::I(nh as i32),
                Arg::I(nkv as i32),
                Arg::P(pos0),
                Arg::I(nchunk as i32),
                Arg::P(part),
            ],
        )?;
        let merge = if self.attn_merge_serial() {
            self.f.attn_merge_quant_serial
        } else {
            self.f.attn_merge_quant
        };
        self.launch(
            merge,
            (nh as u32, n as u32, 1),
            (hd as u32, 1, 1),
            &[
                Arg::P(part),
                Arg::P(qf),
                Arg::I(nh as i32),
                Arg::I(hd as i32),
                Arg::P(pos0),
                Arg::I(nchunk as i32),
                Arg::P(out),
                Arg::P(q),
                Arg::P(d),
                Arg::P(s),
            ],
        )
    }

    /// Prefill form of [`Self::gdn_conv`] (same arguments, same outputs bit for bit, same conv
    /// window afterwards): rows in parallel (`gdn_conv_rows`, grid (2·hk + hv + 1, ⌈n/32⌉)), then
    /// the window update (`gdn_conv_window`). Needs dk % 32 == 0, dk ≤ 128, 1 ≤ kconv ≤ 8.
    pub fn gdn_conv_rows(
        &self,
        mixed: u64,
        conv_state: u64,
        convw: u64,
        kconv: usize,
        hk: usize,
        hv: usize,
        dk: usize,
        n: usize,
        eps: f32,
        qo: u64,
        ko: u64,
        vo: u64,
        bb: u64,
        aa: u64,
        dt_bias: u64,
        ssm_a: u64,
        beta: u64,
        g: u64,
    ) -> Result<()> {
        assert!(gdn_prefill_supported(dk, dk) && (1..=8).contains(&kconv) && n > 0);
        let conv_dim = 2 * hk * dk + hv * dk;
        // 4 taps (the model's conv): the sliding-window kernel, 8 rows per warp (same bits)
        let (f, rows) = if kconv == 4 {
            (self.f.gdn_conv_rows_k4, GDN_CONV4_ROWS)
        } else {
            (self.f.gdn_conv_rows, GDN_CONV_ROWS)
        };
        self.launch(
            f,
            ((2 * hk + hv + 1) as u32, cdiv(n, rows), 1),
            (256, 1, 1),
            &gdn_conv_args(
                mixed, conv_state, convw, kconv, hk, hv, dk, n, eps, qo, ko, vo, bb, aa, dt_bias,
                ssm_a, beta, g,
            ),
        )?;
        self.launch(
            self.f.gdn_conv_window,
            (cdiv(conv_dim, 256), 1, 1),
            (256, 1, 1),
            &[
                Arg::P(mixed),
                Arg::P(conv_state),
                Arg::I(conv_dim as i32),
                Arg::I(kconv as i32),
                Arg::I(n as i32),
            ],
        )
    }

    /// Whether prefill attention runs on tensor cores (`attn_prefill_tc_hd*`, the default) or on
    /// CUDA cores (`attn_prefill_hd*`).
    pub fn attn_prefill_tc(&self) -> bool {
        self.attn_prefill_tc.load(Ordering::Relaxed)
    }

    /// Choose the prefill attention kernels (tests and benchmarks compare the two).
    pub fn set_attn_prefill_tc(&self, on: bool) {
        self.attn_prefill_tc.store(on, Ordering::Relaxed);
    }

    /// How prefill runs the GDN recurrence (default [`GdnPrefill::RowByRow`]).
    pub fn gdn_prefill(&self) -> GdnPrefill {
        GdnPrefill::ALL[self.gdn_prefill.load(Ordering::Relaxed) as usize]
    }

    /// Choose how prefill runs the GDN recurrence (benchmarks compare the modes). The chunk walk
    /// of [`Self::gdn_step_chunked`] follows it too: the tensor-core walk for
    /// [`GdnPrefill::ChunkedTc`], else the FP32 one.
    pub fn set_gdn_prefill(&self, mode: GdnPrefill) {
        self.gdn_prefill.store(mode as u8, Ordering::Relaxed);
    }

    /// Prefill form of [`Self::gdn_step`] in chunks of 64 rows (same arguments and layouts as
    /// [`Self::gdn_step_seq`], equal to it within f32 rounding; `prefill.cu` has the math): one
    /// launch solves every chunk's triangular system in parallel (`gdn_chunk_prep_d128`, grid
    /// (hv, ⌈n/64⌉), 256 threads), a second walks the chunks in order, 16 value columns per
    /// block (`gdn_chunk_scan_d128`, grid (hv, dv/16), 256 threads). Its scratch
    /// ([`gdn_chunk_scratch_floats`]`(hv, dk, n)` f32) is the GPU's own, grown on demand (so not
    /// while a graph is being captured: prefill never is). Needs
    /// [`gdn_chunked_supported`]`(dk, dv)`.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_step_chunked(
        &self,
        s: u64,
        q: u64,
        k: u64,
        v: u64,
        g: u64,
        beta: u64,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        n: usize,
        out: u64,
    ) -> Result<()> {
        if !gdn_chunked_supported(dk, dv) || n == 0 || hk == 0 || hv % hk != 0 {
            return Err(CudaError(format!(
                "chunked GDN: heads hk {hk} hv {hv} dk {dk} dv {dv}, n {n} not supported"
            )));
        }
        let need = gdn_chunk_scratch_floats(hv, dk, n) * 4;
        let mut scratch = self.gdn_chunk_scratch.lock().expect("gdn scratch lock");
        if scratch.as_ref().is_none_or(|b| b.bytes() < need) {
            // earlier launches may still read the old buffer
            self.sync()?;
            *scratch = None;
            *scratch = Some(self.alloc(need)?);
        }
        let nch = n.div_ceil(GDN_CHUNK);
        let npad = nch * GDN_CHUNK;
        // scratch: U0 | W | P | γ | decay to the chunk end (every region 16-byte aligned)
        let u0 = scratch.as_ref().expect("gdn scratch").ptr();
        let wk = u0 + (hv * npad * dk * 4) as u64;
        let pm = wk + (hv * npad * dk * 4) as u64;
        let gam = pm + (hv * nch * GDN_CHUNK * GDN_CHUNK * 4) as u64;
        let dl = gam + (hv * npad * 4) as u64;
        self.launch_smem(
            self.f.gdn_chunk_prep_d128,
            (hv as u32, nch as u32, 1),
            (256, 1, 1),
            GDN_CHUNK_PREP_SMEM as u32,
            &[
                Arg::P(q),
                Arg::P(k),
                Arg::P(v),
                Arg::P(g),
                Arg::P(beta),
                Arg::I(hk as i32),
                Arg::I(hv as i32),
                Arg::I(n as i32),
                Arg::P(u0),
                Arg::P(wk),
                Arg::P(pm),
                Arg::P(gam),
                Arg::P(dl),
            ],
        )?;
        let (walk, threads, smem) = if self.gdn_prefill() == GdnPrefill::ChunkedTc {
            (self.f.gdn_chunk_scan_tc_d128, 128, GDN_CHUNK_TC_SMEM)
        } else {
            (self.f.gdn_chunk_scan_d128, 256, GDN_CHUNK_SCAN_SMEM)
        };
        self.launch_smem(
            walk,
            (hv as u32, (dv / GDN_CHUNK_COLS) as u32, 1),
            (threads, 1, 1),
            smem as u32,
            &[
                Arg::P(s),
                Arg::P(q),
                Arg::P(k),
                Arg::P(u0),
                Arg::P(wk),
                Arg::P(pm),
                Arg::P(gam),
                Arg::P(dl),
                Arg::I(hk as i32),
                Arg::I(hv as i32),
                Arg::I(n as i32),
                Arg::P(out),
            ],
        )
    }

    /// Make [`Self::gdn_step_seq`] take the kernel for any head dim even at dk = 128 (tests: the
    /// specialized kernel must give the same bits).
    pub fn set_gdn_seq_generic(&self, on: bool) {
        self.gdn_seq_generic.store(on, Ordering::Relaxed);
    }

    /// Prefill form of [`Self::gdn_step`] (same arguments and layouts): equal within f32 rounding,
    /// no block barrier per row. Needs [`gdn_prefill_supported`]`(dk, dv)`.
    pub fn gdn_step_seq(
        &self,
        s: u64,
        q: u64,
        k: u64,
        v: u64,
        g: u64,
        beta: u64,
        hk: usize,
        hv: usize,
        dk: usize,
        dv: usize,
        n: usize,
        out: u64,
    ) -> Result<()> {
        assert!(gdn_prefill_supported(dk, dv) && n > 0);
        // the 27B head (dk 128) with its loop bounds compiled in; same operations, same bits
        // (`set_gdn_seq_generic` turns it off for the test that checks this)
        let f = if dk == 128 && !self.gdn_seq_generic.load(Ordering::Relaxed) {
            self.f.gdn_step_seq_d128
        } else {
            self.f.gdn_step_seq
        };
        self.launch(
            f,
            (hv as u32, (dv / 16) as u32, 1),
            (128, 1, 1),
            &gdn_step_args(s, q, k, v, g, beta, hk, hv, dk, dv, n, out),
        )
    }

    /// Causal prefill attention of `n` rows in one launch (flash attention over 32-row query
    /// tiles, see `attn_prefill_body`): the same arguments and outputs as [`Self::attn_decode`]
    /// without its partials scratch, equal within f32 rounding. Row t attends to positions
    /// `0..=*pos0 + t`; the cache must hold positions `0..*pos0 + n`.
    pub fn attn_prefill(
        &self,
        qo: u64,
        qf: u64,
        kc: u64,
        vc: u64,
        n: usize,
        nh: usize,
        nkv: usize,
        hd: usize,
        pos0: u64,
        out: u64,
        q: u64,
        d: u64,
        s: u64,
    ) -> Result<()> {
        // the tensor-core kernel moves Q, the gate and the output in 16-byte pieces, stores the
        // codes 4 at a time and needs 99 KiB of shared memory at hd 256 (what sm_86 / sm_89 allow
        // a block; sm_80 and sm_90 more): else the FP32 kernel
        let tc = self.attn_prefill_tc()
            && (qo | qf | kc | vc | out) % 16 == 0
            && q % 4 == 0
            && attn_prefill_tc_smem(hd) <= self.smem_optin()?;
        let f = match (hd, tc) {
            (64, false) => self.f.attn_prefill_hd64,
            (128, false) => self.f.attn_prefill_hd128,
            (256, false) => self.f.attn_prefill_hd256,
            (64, true) => self.f.attn_prefill_tc_hd64,
            (128, true) => self.f.attn_prefill_tc_hd128,
            (256, true) => self.f.attn_prefill_tc_hd256,
            _ => {
                return Err(CudaError(format!(
                    "attention: head dim {hd} not in 64/128/256"
                )))
            }
        };
        assert!(nkv > 0 && nh % nkv == 0 && n > 0);
        let (rows, smem) = if tc {
            (ATTN_TC_ROWS, attn_prefill_tc_smem(hd))
        } else {
            (ATTN_PREFILL_ROWS, attn_prefill_smem(hd))
        };
        self.launch_smem(
            f,
            (nh as u32, cdiv(n, rows), 1),
            (128, 1, 1),
            smem as u32,
            &[
                Arg::P(qo),
                Arg::P(qf),
                Arg::P(kc),
                Arg::P(vc),
                Arg::I(n as i32),
                Arg::I(nh as i32),
                Arg::I(nkv as i32),
                Arg::P(pos0),
                Arg::P(out),
                Arg::P(q),
                Arg::P(d),
                Arg::P(s),
            ],
        )
    }

    /// Decode gate‖up with [`Self::swiglu_quant`] fused in: one launch instead of two, and the
    /// gate / up rows never leave the kernel. Each row is the one-row dp4a launch's bit for bit
    /// (K split 1); `out` receives SiLU(gate) ⊙ up as [`Self::swiglu_quant`] writes it (f32 `f`
    /// unless 0, int8 `q` / `d` / `s`). `out` must not alias the activations `q` / `d` / `s`
    /// (other blocks may still read them). Two kernels: where the launch would be staged (Q2_0's
    /// default for gate‖up), the staged one (`mvs_*_swi`, whole groups of 32 outputs per block);
    /// where the plan is the plain dp4a kernel with 8 rows per warp (Q1_0's default),
    /// `mv_*_n1_r8_k1_swi` (a 2-block cluster per 32 outputs). Both need K split 1,
    /// `n_out % 32 == 0` and [`Self::swiglu_fused`] on; otherwise this returns `Ok(false)` and
    /// launches nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn mv_swiglu(
        &self,
        kind: WKind,
        gate: (u64, u64),
        up: (u64, u64),
        n_out: usize,
        n_in: usize,
        act: (u64, u64, u64),
        out: QuantOut,
    ) -> Result<bool> {
        if !self.swiglu_fused() || n_out % 32 != 0 || n_out == 0 || n_in % 64 != 0 {
            return Ok(false);
        }
        let segs = [
            MvSeg {
                codes: gate.0,
                scales: gate.1,
                y: 0,
                n_out,
            },
            MvSeg {
                codes: up.0,
                scales: up.1,
                y: 0,
                n_out,
            },
        ];
        if self.b1p_stand_in(kind, &segs, n_in, 1, false, true)? {
            return Ok(true);
        }
        let rows = 2 * n_out;
        let plan = self.mv_plan(kind, 1, rows, n_in);
        let pick = if self.staged_for(kind, rows) {
            self.mvs_swi_kernel(kind, gate, up, n_out, n_in, act, plan)?
        } else {
            Self::mv_swi_kernel(&self.f, kind, plan).map(|f| (f, rows / 32, 0))
        };
        let Some((f, blocks, smem)) = pick else {
            return Ok(false);
        };
        self.launch_smem(
            f,
            (blocks as u32, 1, 1),
            ((MV_WARPS * 32) as u32, 1, 1),
            smem as u32,
            &swi_args(gate, up, n_out, act, n_in, plan.pre, out),
        )?;
        Ok(true)
    }

    /// The cluster SwiGLU kernel (`mv_*_n1_r8_k1_swi`, grid 2·n_out / 32) where `plan` is the plain
    /// dp4a one with 8 rows per warp and K split 1.
    fn mv_swi_kernel(f: &Funcs, kind: WKind, plan: MvPlan) -> Option<sys::CUfunction> {
        if plan.pipe || plan.ks != 1 || plan.r != 8 {
            return None;
        }
        match kind {
            WKind::Q1 => Some(f.mv_q1_n1_r8_k1_swi),
            WKind::Q2 => Some(f.mv_q2_n1_r8_k1_swi),
            WKind::Q2G64 => Some(f.mv_q2g64_n1_r8_k1_swi),
            _ => None,
        }
    }

    /// The staged SwiGLU kernel (`mvs_*_swi`) with its grid and dynamic shared memory (the staged
    /// carveout applied); `None` where the plan's K split is not 1 or the shape or an address does
    /// not suit the bulk copies.
    #[allow(clippy::too_many_arguments)]
    fn mvs_swi_kernel(
        &self,
        kind: WKind,
        (gate_codes, gate_scales): (u64, u64),
        (up_codes, up_scales): (u64, u64),
        n_out: usize,
        n_in: usize,
        (q, d, s): (u64, u64, u64),
        plan: MvPlan,
    ) -> Result<Option<(sys::CUfunction, usize, usize)>> {
        if plan.ks != 1 {
            return Ok(None);
        }
        // rows per warp: the layout's choice for the plan (gate and up rows in pairs, so 2 or 4)
        let r_plan = plan.r.clamp(1, 4);
        let Some((r, _, _, _)) = mvs_layout(kind, n_in, r_plan, 1, 0, self.mvs_rows()) else {
            return Ok(None);
        };
        let r = if r >= 4 { 4 } else { 2 };
        let Some((_, _, _, smem)) = mvs_layout(kind, n_in, r, 1, self.mvs_stages(), r) else {
            return Ok(None);
        };
        if smem + 1024 > self.smem_optin()? {
            return Ok(None);
        }
        let aligned = [q, d, s, gate_codes, gate_scales, up_codes, up_scales]
            .iter()
            .all(|p| p % 16 == 0);
        if !aligned {
            return Ok(None);
        }
        let f = &self.f;
        let f = match (kind, r) {
            (WKind::Q1, 2) => f.mvs_q1_o1_swi,
            (WKind::Q1, _) => f.mvs_q1_o2_swi,
            (WKind::Q2, 2) => f.mvs_q2_o1_swi,
            (WKind::Q2, _) => f.mvs_q2_o2_swi,
            (WKind::Q2G64, 2) => f.mvs_q2g64_o1_swi,
            (WKind::Q2G64, _) => f.mvs_q2g64_o2_swi,
            _ => return Ok(None),
        };
        self.staged_carveout()?;
        // whole quant groups of 32 outputs per block
        let blocks = balanced_count(n_out / 32, self.resident_blocks(f, smem)?);
        Ok(Some((f, blocks, smem)))
    }

    /// Whether decode gate‖up launches take [`Self::mv_swiglu`] where they can (default on;
    /// `BONSAI_CUDA_SWIGLU_FUSED=0` turns it off). The same bits either way; graphs key on it.
    pub fn swiglu_fused(&self) -> bool {
        // 2-block clusters: sm_90+
        self.hopper() && self.swiglu_fused.load(Ordering::Relaxed)
    }

    /// Set [`Self::swiglu_fused`].
    pub fn set_swiglu_fused(&self, on: bool) {
        self.swiglu_fused.store(on, Ordering::Relaxed);
    }

    /// `h = SiLU(g) ⊙ u`, f32 to `hf` (unless 0) and quantized.
    pub fn swiglu_quant(
        &self,
        g: u64,
        u: u64,
        n: usize,
        k: usize,
        hf: u64,
        q: u64,
        d: u64,
        s: u64,
    ) -> Result<()> {
        assert_eq!(k % 32, 0);
        // prefill: 16-byte loads, 8 lanes per block (same bits)
        let (f, grid) = if n > MAX_ROWS && (g | u | hf) % 16 == 0 && q % 4 == 0 {
            (self.f.swiglu_quant_v4, (cdiv(k, 1024), n as u32, 1))
        } else {
            (self.f.swiglu_quant, (cdiv(k / 32, 8), n as u32, 1))
        };
        self.launch(
            f,
            grid,
            (256, 1, 1),
            &[
                Arg::P(g),
                Arg::P(u),
                Arg::I(k as i32),
                Arg::P(hf),
                Arg::P(q),
                Arg::P(d),
                Arg::P(s),
            ],
        )
    }

    /// [`Self::swiglu_quant`]'s values `SiLU(g) ⊙ u` (f32 to `hf` unless 0) written as b1-plane
    /// activations (`swiglu_quant_p16`), the input of a b1-plane ffn_down; host twin: the SwiGLU
    /// then [`host_quant_p16`] (and [`b1q_acts_host`] for `out.xv`). `k % 256 == 0`.
    pub fn swiglu_quant_p16(
        &self,
        g: u64,
        u: u64,
        n: usize,
        k: usize,
        hf: u64,
        out: P16Out,
    ) -> Result<()> {
        out.check("swiglu_quant_p16", k)?;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            self.f.swiglu_quant_p16,
            ((k / 128) as u32, n as u32, 1),
            (128, 1, 1),
            &[
                Arg::P(g),
                Arg::P(u),
                Arg::I(k as i32),
                Arg::P(hf),
                Arg::P(out.xp),
                Arg::P(out.xu),
                Arg::P(out.xs),
                Arg::P(out.xv),
            ],
        )
    }

    /// Per row of `logits [rows, nv]`: argmax (first maximum), max and log-sum-exp into
    /// `out [rows, 4]` u32 (see `logit_stats_rows` in bonsai.cu; [`LogitRowStats::from_words`]).
    pub fn logit_stats_rows(&self, logits: u64, rows: usize, nv: usize, out: u64) -> Result<()> {
        self.row_stats_launch(self.f.logit_stats_rows, logits, rows, nv, out, 16)
    }

    /// Per row of `logits [rows, nv]`: its [`TOPK_ROW`] best entries, best first, in the host
    /// sampler's order (value descending, then the lower id; NaN counts as −inf, −0 as +0), into
    /// `out [rows, TOPK_ROW, 2]` u32 as (id, f32 bits); ids `0xffff_ffff` pad rows shorter than
    /// [`TOPK_ROW`]. [`topk_from_words`] decodes a row; [`host_topk_row`] is the host twin.
    pub fn topk_rows(&self, logits: u64, rows: usize, nv: usize, out: u64) -> Result<()> {
        let tk = self.topk_scratch.get().expect("top-k scratch");
        let cnt = tk.at(TOPK_ROWS * ROW_STATS_MAX_BLOCKS * TOPK_ROW * 8);
        let mut t0 = 0;
        while t0 < rows {
            let nr = (rows - t0).min(TOPK_ROWS);
            self.launch(
                self.f.topk_rows,
                (row_stats_blocks(nv), nr as u32, 1),
                (512, 1, 1),
                &[
                    Arg::P(logits + (t0 * nv * 4) as u64),
                    Arg::I(nv as i32),
                    Arg::P(out + (t0 * TOPK_ROW * 8) as u64),
                    Arg::P(tk.ptr()),
                    Arg::P(cnt),
                ],
            )?;
            t0 += nr;
        }
        Ok(())
    }

    /// `ids[t] = argmax logits[t]` (lowest index on ties), rows × nv.
    pub fn argmax_rows(&self, logits: u64, rows: usize, nv: usize, ids: u64) -> Result<()> {
        self.row_stats_launch(self.f.argmax_rows, logits, rows, nv, ids, 4)
    }

    /// A row-statistics kernel over `rows` rows of `nv` logits, `out_row` output bytes per row:
    /// [`row_stats_blocks`] blocks per row, at most [`ROW_STATS_ROWS`] rows per launch.
    fn row_stats_launch(
        &self,
        f: sys::CUfunction,
        logits: u64,
        rows: usize,
        nv: usize,
        out: u64,
        out_row: usize,
    ) -> Result<()> {
        let rs = self.row_stats.get().expect("row-stats scratch");
        let cnt = rs.at(ROW_STATS_ROWS * ROW_STATS_MAX_BLOCKS * 16);
        let mut t0 = 0;
        while t0 < rows {
            let nr = (rows - t0).min(ROW_STATS_ROWS);
            self.launch(
                f,
                (row_stats_blocks(nv), nr as u32, 1),
                (256, 1, 1),
                &[
                    Arg::P(logits + (t0 * nv * 4) as u64),
                    Arg::I(nv as i32),
                    Arg::P(out + (t0 * out_row) as u64),
                    Arg::P(rs.ptr()),
                    Arg::P(cnt),
                ],
            )?;
            t0 += nr;
        }
        Ok(())
    }

    /// `hist[*pos] = *tok; *pos += 1` (the tail of a captured decode step).
    pub fn step_advance(&self, pos: u64, tok: u64, hist: u64, hist_len: usize) -> Result<()> {
        self.launch(
            self.f.step_advance,
            (1, 1, 1),
            (1, 1, 1),
            &[
                Arg::P(pos),
                Arg::P(tok),
                Arg::P(hist),
                Arg::I(hist_len as i32),
            ],
        )
    }

    // ---- graphs and timing ----------------------------------------------------------------------

    /// One link of a dependent launch chain (`launch_chain_step`, PDL-aware): `*p += 1` (i32) once
    /// the previous kernel on the stream has finished, in a grid of `blocks` blocks of 128 threads.
    /// For measuring the cost of a kernel boundary (tests/gpu_kernels.rs `launch_chain_cost`).
    pub fn launch_chain_step(&self, p: u64, blocks: usize) -> Result<()> {
        self.launch(
            self.f.launch_chain_step,
            (blocks.max(1) as u32, 1, 1),
            (128, 1, 1),
            &[Arg::P(p)],
        )
    }

    /// Start capturing this GPU's stream into a graph.
    pub fn begin_capture(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: our own non-default stream; ended by end_capture.
        unsafe {
            cu::stream::begin_capture(
                self.op_stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(err("begin capture"))
    }

    /// End the capture and instantiate the graph.
    pub fn end_capture(&self) -> Result<Graph> {
        self.bind()?;
        // SAFETY: the stream is capturing (begin_capture succeeded).
        let graph =
            unsafe { cu::stream::end_capture(self.op_stream()) }.map_err(err("end capture"))?;
        // SAFETY: graph is a valid captured graph.
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(err("graph instantiate"))?;
        Ok(Graph {
            exec,
            graph,
            ctx: self.ctx.clone(),
        })
    }

    /// Launch a graph on this GPU's stream (asynchronous).
    pub fn launch_graph(&self, g: &Graph) -> Result<()> {
        self.bind()?;
        // SAFETY: exec is a live instantiated graph of this context.
        unsafe { cu::graph::launch(g.exec, self.op_stream()) }.map_err(err("graph launch"))
    }

    /// Run `f` (which queues work on this GPU) and return the GPU time in ms between two events.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        self.bind()?;
        let a = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(err("event"))?;
        let b = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(err("event"))?;
        // SAFETY: events are live; recorded on our stream; destroyed below.
        let r = unsafe {
            cu::event::record(a, self.op_stream()).map_err(err("record"))?;
            f()?;
            cu::event::record(b, self.op_stream()).map_err(err("record"))?;
            cu::event::synchronize(b).map_err(err("event sync"))?;
            cu::event::elapsed(a, b).map_err(err("elapsed"))
        };
        // SAFETY: live events, destroyed once.
        unsafe {
            let _ = cu::event::destroy(a);
            let _ = cu::event::destroy(b);
        }
        r
    }
}

/// Quantize activations on the host exactly as the kernels do (per 32: `d = amax/127` f32,
/// `q = round_half_away(x·(1/d))` clamped to ±127). Returns (q [n·k], d [n·k/32], s [n·k/32]).
/// For tests and host-side emulation.
pub fn host_quant(x: &[f32], k: usize) -> (Vec<i8>, Vec<f32>, Vec<i32>) {
    assert_eq!(k % 32, 0);
    let nb = x.len() / 32;
    let mut q = vec![0i8; x.len()];
    let mut d = vec![0f32; nb];
    let mut s = vec![0i32; nb];
    for b in 0..nb {
        let xb = &x[32 * b..32 * b + 32];
        let amax = xb.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if db != 0.0 { 1.0 / db } else { 0.0 };
        let mut sum = 0;
        for j in 0..32 {
            let v = (xb[j] * id).round().clamp(-127.0, 127.0) as i32;
            q[32 * b + j] = v as i8;
            sum += v;
        }
        d[b] = db;
        s[b] = sum;
    }
    (q, d, s)
}

#[cfg(test)]
mod tests {
    /// `env_pair`: each part of `one-row,more-rows` falls back to its default on its own.
    #[test]
    fn env_pair_parts_default_separately() {
        let get = |v: Option<&str>| {
            let name = "BONSAI_TEST_ENV_PAIR_PARTS";
            match v {
                Some(v) => std::env::set_var(name, v),
                None => std::env::remove_var(name),
            }
            super::env_pair(name, [96, 32], |v| (1..=128).contains(&v)).map(|a| a.into_inner())
        };
        assert_eq!(get(None), [96, 32]);
        assert_eq!(get(Some("64")), [64, 32]);
        assert_eq!(get(Some("x, 16")), [96, 16]);
        assert_eq!(get(Some("0,129")), [96, 32]);
        assert_eq!(get(Some(" 8 , 4 ,9")), [8, 4]);
    }

    /// The index in `s` of the `close` that matches the first `open` (nesting counted).
    fn matching(s: &str, open: char, close: char) -> Option<usize> {
        let mut depth = 0usize;
        for (i, c) in s.char_indices() {
            if c == open {
                depth += 1;
            } else if c == close && depth > 0 {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
        }
        None
    }

    /// The body of the function `name` in `src` defined with `qual` (`__global__` for a kernel,
    /// `__device__` for a helper; from its opening brace to the matching closing one), or None
    /// where the name is made by a macro (token pasting).
    fn fn_body<'a>(src: &'a str, name: &str, qual: &str) -> Option<&'a str> {
        let mut from = 0;
        while let Some(at) = src[from..].find(name) {
            let at = from + at;
            from = at + name.len();
            let before = src[..at].trim_end();
            let after = &src[at + name.len()..];
            let is_def = after.starts_with('(')
                && (before.ends_with("void") || before.ends_with(')'))
                && src[..at].rfind(qual).is_some_and(|e| {
                    let head = &src[e..at];
                    !head.contains(';') && !head.contains('{') && !head.contains('}')
                });
            if !is_def {
                continue;
            }
            // past the parameter list (which may hold `= {}` defaults), then the body's braces
            let close = matching(after, '(', ')')?;
            let open = at + name.len() + close + after[close..].find('{')?;
            let end = matching(&src[open..], '{', '}')?;
            return Some(&src[open..open + end + 1]);
        }
        None
    }

    /// Every kernel on the `pdl` list whose definition is spelled out in the source (the others
    /// are instances of macros) waits for the previous grid (`PDL_ENTRY()` / `PDL_WAIT()`, directly
    /// or in the one `__device__` body it calls): a kernel launched with programmatic stream
    /// serialization that read or wrote dependent memory before that wait would race its
    /// predecessor.
    #[test]
    fn pdl_kernels_wait_first() {
        use super::{PDL_NAMES, SOURCE};
        let waits = |b: &str| b.contains("PDL_ENTRY()") || b.contains("PDL_WAIT()");
        // the `*_body` helper a kernel calls, if any: its name is the identifier before "_body"
        let helper = |b: &str| -> Option<String> {
            let at = b.find("_body")?;
            let start = b[..at]
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(0, |i| i + 1);
            Some(format!("{}_body", &b[start..at]))
        };
        let mut spelled = 0;
        let mut missing = Vec::new();
        for name in PDL_NAMES {
            let Some(body) = fn_body(SOURCE, name, "__global__") else {
                continue;
            };
            spelled += 1;
            let ok = waits(body)
                || helper(body)
                    .and_then(|h| fn_body(SOURCE, &h, "__device__"))
                    .is_some_and(waits);
            if !ok {
                missing.push(*name);
            }
        }
        assert!(
            missing.is_empty(),
            "pdl kernels without a wait: {missing:?}"
        );
        assert!(
            spelled >= 30,
            "only {spelled} pdl kernels found in the source"
        );
        eprintln!(
            "{spelled} of {} pdl kernels spelled out in the source, each waits",
            PDL_NAMES.len()
        );
    }

    /// Every (n, r, n5) the launcher can ask for maps to a kernel whose compiled R is the rows per
    /// warp the launch grid is sized with, and whose NT covers n (a mismatch would compute rows of
    /// other warps' groups or drop activation rows, silently).
    #[test]
    fn mv_variants_match_the_kernel_source() {
        use super::{mv_variant, MV_VARIANTS, SOURCE};
        for (suffix, nt, r, rs) in MV_VARIANTS {
            for ks in [1, 2, 4] {
                let entry = if rs == 1 { "MV_ENTRY" } else { "MV_RS_ENTRY" };
                let name = format!("{entry}(mv_##K##_{suffix}_k{ks}, KIND, ");
                let at = SOURCE
                    .find(&name)
                    .unwrap_or_else(|| panic!("{name} not in the source"));
                let args: Vec<&str> = SOURCE[at + name.len()..]
                    .split(')')
                    .next()
                    .unwrap()
                    .split(',')
                    .map(str::trim)
                    .collect();
                let nt_src = if args[0] == "MAXN" {
                    super::MAX_ROWS
                } else {
                    args[0].parse().unwrap()
                };
                assert_eq!(nt_src, nt, "{suffix}_k{ks}: NT");
                assert_eq!(args[1].parse::<usize>().unwrap(), r, "{suffix}_k{ks}: R");
                assert_eq!(args[3].parse::<usize>().unwrap(), ks, "{suffix}_k{ks}: KS");
            }
        }
        // the row-split kernels are the source's MV_RS_ENTRY, whose row split is 2
        assert!(SOURCE.contains("mv_lowbit<KIND, NT, R, U, KS, false, 2>"));
        // the rows-first forms (`Gpu::mv_rows_first`) of rows 5 and 6 have their NT, R and KS
        assert!(SOURCE.contains("mv_lowbit<KIND, NT, R, U, KS, false, 1, true>"));
        for (suffix, nt, r, _) in &MV_VARIANTS[5..=6] {
            for ks in [1, 2, 4] {
                let name = format!("MV_RF_ENTRY(mv_##K##_{suffix}f_k{ks}, KIND, ");
                let at = SOURCE
                    .find(&name)
                    .unwrap_or_else(|| panic!("{name} not in the source"));
                let args: Vec<usize> = SOURCE[at + name.len()..]
                    .split(')')
                    .next()
                    .unwrap()
                    .split(',')
                    .map(|a| a.trim().parse().unwrap())
                    .collect();
                assert_eq!(
                    (args[0], args[1], args[3]),
                    (*nt, *r, ks),
                    "{suffix}f_k{ks}"
                );
            }
        }
        for n in 1..=super::MAX_ROWS {
            for r in [2, 4, 8] {
                for n5 in [false, true] {
                    for split in [false, true] {
                        let what = format!("n {n} r {r} n5 {n5} rsplit {split}");
                        let (row, rpw) = mv_variant(n, r, n5, split).expect("variant");
                        let (_, nt, kr, rs) = MV_VARIANTS[row];
                        assert_eq!(rpw, kr, "{what}");
                        assert!(nt * rs >= n, "{what}: NT {nt} × RS {rs}");
                        if n == 1 {
                            assert_eq!(rpw, r);
                        }
                        // the split only where it was asked for
                        assert!(rs == 1 || (split && n5 && n >= 4), "{what}");
                    }
                }
            }
        }
        assert!(mv_variant(1, 3, false, false).is_none());
    }

    use super::*;

    #[test]
    fn balanced_grid_gives_every_worker_the_same_units_plus_minus_one() {
        // 2,176 tiles over at most 924 blocks: 3 tiles each, 726 blocks
        assert_eq!(balanced_count(2176, 924), 726);
        assert_eq!(balanced_count(100, 1000), 100);
        assert_eq!(balanced_count(1000, 1000), 1000);
        assert_eq!(balanced_count(1001, 1000), 501);
        assert_eq!(balanced_count(5, 0), 1);
    }

    #[test]
    fn b1p_k_split_follows_the_shape() {
        // the 27B Q1_0 launches: 5,120-row launches (320 tiles) of width 6,144 and 17,408, the
        // GDN in-projection (16,480 rows), attention in-projection (14,336), gate‖up (34,816), head
        assert_eq!(mvbp_ks_for(320, 6144, 2048), 8); // 24 pairs: 3 per part
        assert_eq!(mvbp_ks_for(320, 17408, 2048), 8);
        assert_eq!(mvbp_ks_for(1030, 5120, 2048), 2);
        assert_eq!(mvbp_ks_for(896, 5120, 2048), 4);
        assert_eq!(mvbp_ks_for(2176, 5120, 2048), 1);
        assert_eq!(mvbp_ks_for(15_520, 5120, 2048), 1);
        // the default target: the attention in-projection takes 2, the rest as above
        assert_eq!(mvbp_ks_for(896, 5120, MVBP_MIN_WARPS), 2);
        assert_eq!(mvbp_ks_for(1030, 5120, MVBP_MIN_WARPS), 2);
        assert_eq!(mvbp_ks_for(2176, 5120, MVBP_MIN_WARPS), 1);
        assert_eq!(mvbp_ks_for(15_520, 5120, MVBP_MIN_WARPS), 1);
        // every K part keeps at least two pairs, and 16 is the most
        assert_eq!(mvbp_ks_for(1, 256, 2048), 1);
        assert_eq!(mvbp_ks_for(1, 1024, 2048), 2);
        assert_eq!(mvbp_ks_for(1, 1 << 20, 2048), 16);
        for (tiles, n_in) in [(1usize, 512usize), (20, 17408), (4, 8192), (7, 2560)] {
            let ks = mvbp_ks_for(tiles, n_in, 2048);
            assert!(ks.is_power_of_two() && ks <= 16);
            assert!(ks == 1 || n_in / 256 / ks >= 2, "{tiles} x {n_in}: {ks}");
            assert_eq!(mvbp_warps(ks) % ks, 0);
        }
    }

    #[test]
    fn b1p_shared_row_takes_what_the_kernel_reads() {
        // 5,120 wide: 20 pairs × 32 lanes × 16 bytes of planes, then 40 blocks × 16 bytes of
        // sub-block sums and 40 f32 units (the layout `mvbp_q1` reads with XS)
        assert_eq!(mvbp_xs_bytes(5120), 20 * 32 * 16 + 40 * 16 + 40 * 4);
        // the widest row a one-row launch keeps in its 48 KiB
        assert!(mvbp_xs_bytes(22_784) <= 48 << 10);
        assert!(mvbp_xs_bytes(23_040) > 48 << 10);
    }

    #[test]
    fn staged_by_default_for_the_q2_launches_from_8192_rows() {
        // ffn gate‖up (2 × 17,408 rows), the head (248,320) and the GDN / attention
        // in-projections (16,480 / 14,336) of Q2 / Q2 g64; not the 5120-row outputs; nothing of Q1
        for kind in [WKind::Q2, WKind::Q2G64] {
            assert!(mvs_default_on(kind, 34_816));
            assert!(mvs_default_on(kind, 248_320));
            assert!(mvs_default_on(kind, 16_480)); // gdn q‖z‖b‖a
            assert!(mvs_default_on(kind, 14_336)); // attn q‖k‖v
            assert!(!mvs_default_on(kind, 5_120)); // ssm_out, attn_out, ffn_down
        }
        assert!(!mvs_default_on(WKind::Q1, 248_320));
        assert_eq!(MvStaged::from_u8(MvStaged::Auto as u8), MvStaged::Auto);
        assert_eq!(MvStaged::from_u8(7), MvStaged::Off);
    }

    #[test]
    fn mvs_layout_of_the_27b_shapes() {
        // Q1 5120-wide, 4 rows per warp, no K split: tiles of 16 rows (10,240 code bytes + 1,280
        // scale bytes), activations 5120 + 8·160 bytes, 4 stages under 75 KiB
        assert_eq!(
            mvs_layout(WKind::Q1, 5120, 4, 1, 0, 0),
            Some((4, 11_520, 2, 6_400 + 2 * 11_520))
        );
        // Q2 17408-wide (ffn_down), K split 2: a 4-row stage would be 37 KB, so 2 rows per warp
        let (r, sb, st, smem) = mvs_layout(WKind::Q2, 17408, 4, 2, 0, 0).unwrap();
        assert_eq!((r, sb), (2, 4 * 4352 + 4 * 136 * 2));
        assert_eq!(st, 2);
        assert_eq!(smem, 17408 + 8 * 544 + 2 * sb);
        // forced stages and rows; shapes the bulk copies cannot take
        assert_eq!(mvs_layout(WKind::Q1, 5120, 2, 4, 7, 0).unwrap().2, 7);
        assert_eq!(mvs_layout(WKind::Q1, 5120, 4, 1, 0, 1).unwrap().0, 1);
        assert!(mvs_layout(WKind::Q1, 384, 4, 1, 0, 0).is_none());
        assert!(mvs_layout(WKind::F32, 5120, 4, 1, 0, 0).is_none());
        assert!(mvs_layout(WKind::Q1, 5120, 3, 1, 0, 0).is_none());
        assert!(mvs_layout(WKind::Q1, 5120, 4, 1, 0, 3).is_none());
    }

    #[test]
    fn cache_key_changes_with_source() {
        assert_ne!(fnv64(&[b"a"]), fnv64(&[b"b"]));
        assert_ne!(fnv64(&[b"ab", b"c"]), fnv64(&[b"a", b"bc"]));
    }

    #[test]
    fn cache_key_matches_build_cubins_py() {
        // scripts/build_cubins.py writes this hash into cubins/manifest.txt: same function
        assert_eq!(fnv64(&[b"abc", b""]), 0x650c_2f2d_77a2_6d79);
    }

    #[test]
    fn embedded_cubins_only_for_this_source() {
        // whatever the build embedded, a lookup never returns a cubin of another source
        for (ma, mi) in embedded_archs() {
            assert!(embedded_cubin(ma, mi).is_some());
        }
        assert!(embedded_cubin(1, 0).is_none());
    }

    #[test]
    fn source_needs_no_headers() {
        assert!(
            !SOURCE.contains("#include"),
            "kernels must compile without headers"
        );
    }

    #[test]
    fn prefill_attention_smem_layout() {
        // Q | K (padded rows) | V | P: every region starts 16-byte aligned, and three 27B blocks
        // (hd 256) fit one H200 SM (228 KiB)
        for hd in [64usize, 128, 256] {
            let q = ATTN_PREFILL_ROWS * hd * 4;
            let k = ATTN_PREFILL_KEYS * (hd + 8) * 2;
            let v = ATTN_PREFILL_KEYS * hd * 2;
            assert!(q % 16 == 0 && (q + k) % 16 == 0 && (q + k + v) % 16 == 0);
            assert_eq!(
                attn_prefill_smem(hd),
                q + k + v + ATTN_PREFILL_KEYS * (ATTN_PREFILL_ROWS + 4) * 4
            );
        }
        assert!(3 * attn_prefill_smem(256) <= 228 * 1024);
        // tensor-core kernel: Qh | Ql | K | V rows of hd + 8 f16 (16-byte aligned regions); the
        // f32 output staging [64, hd] fits over Qh | Ql; two 27B blocks per SM
        for hd in [64usize, 128, 256] {
            let row = (hd + 8) * 2;
            assert_eq!(row % 16, 0);
            assert_eq!(
                attn_prefill_tc_smem(hd),
                (2 * ATTN_TC_ROWS + 2 * ATTN_TC_KEYS) * row
            );
            assert!(ATTN_TC_ROWS * hd * 4 <= 2 * ATTN_TC_ROWS * row);
        }
        assert!(2 * (attn_prefill_tc_smem(256) + 1024) <= 228 * 1024);
        assert!(gdn_prefill_supported(128, 128) && gdn_prefill_supported(64, 64));
        assert!(!gdn_prefill_supported(256, 256) && !gdn_prefill_supported(128, 8));
    }

    #[test]
    fn gdn_chunked_smem_and_scratch() {
        assert!(gdn_chunked_supported(128, 128) && !gdn_chunked_supported(64, 64));
        // 27B heads, one 512-row prefill chunk: 8 chunks
        let f = gdn_chunk_scratch_floats(48, 128, 512);
        assert_eq!(f, 48 * 512 * 258 + 48 * 8 * 4096);
        // a partial chunk pads to 64 rows
        assert_eq!(
            gdn_chunk_scratch_floats(48, 128, 65),
            gdn_chunk_scratch_floats(48, 128, 128)
        );
    }

    #[test]
    fn mv_default_plans_never_depend_on_n() {
        // batch invariance: the float order (ks) of a matrix is the same for the decode launch
        // (n = 1) and every verify launch (n <= 8)
        for kind in [WKind::Q1, WKind::Q2, WKind::Q2G64] {
            for rows in [48usize, 5120, 14_336, 16_480, 34_816, 248_320] {
                let p1 = mv_default_plan(kind, 1, rows, 5120);
                // the pipelined kernels are one-row kernels of the dp4a order
                assert!(!p1.pipe || matches!(p1.r, 2 | 4));
                for n in 2..=MAX_ROWS {
                    let p = mv_default_plan(kind, n, rows, 5120);
                    assert!(!p.pipe);
                    assert_eq!(p.ks, p1.ks, "{kind:?} {rows} n={n}");
                }
            }
        }
        // one grid formula: the source's block shape is this crate's
        assert!(SOURCE.contains("#define MV_WARPS 4"));
        assert_eq!(MV_WARPS, 4);
    }

    #[test]
    fn arg_slots_little_endian() {
        assert_eq!(Arg::I(-1).slot(), 0xffff_ffff);
        assert_eq!(Arg::F(1.0).slot(), 0x3f80_0000);
        assert_eq!(Arg::P(0x1234_5678_9abc).slot(), 0x1234_5678_9abc);
    }

    #[test]
    fn availability_probe_never_panics() {
        // On a machine without CUDA this is false; with CUDA it may be true. Either way no panic.
        let a = cuda_available();
        if !a {
            eprintln!("cuda_available() = false on this machine (no libcuda / no device)");
        }
    }
}

#[cfg(test)]
mod nvrtc_tests {
    /// Compiles the embedded source for sm_90 when libnvrtc is present (no GPU needed); reports a
    /// skip otherwise.
    #[test]
    fn kernels_compile_for_sm90_when_nvrtc_present() {
        if !super::nvrtc_available() {
            eprintln!("SKIPPED kernels_compile_for_sm90: libnvrtc not found (not counted as run)");
            return;
        }
        let cubin = super::compile_cubin(super::SOURCE, 9, 0).expect("NVRTC compile");
        assert_eq!(&cubin[..4], b"\x7fELF");
    }
}
