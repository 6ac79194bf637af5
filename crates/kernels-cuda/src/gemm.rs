//! Prefill launchers: the tensor-core low-bit GEMMs of `kernels/gemm.cu` for n > [`MAX_ROWS`]
//! activation rows (one launch for all rows, each weight byte read once per CTA of up to 128 rows).
//! Paths with the same interface (int8 activations `q`, per-32 scales `d`):
//! - **f16 wgmma, weights in shared memory** (default where the cubin is sm_90a):
//!   `act_q8_to_f16p` turns the activations into f16 rows (one power of two per row, pair order) in
//!   a scratch this `Gpu` owns; `gemmws_*` expands each 64-wide chunk of 128 weight rows into an f16
//!   tile in shared memory (the weight scale folded in exactly) and runs `wgmma` on both tiles.
//! - **f16 `mma.sync`** (default elsewhere, `BONSAI_CUDA_GEMM=f16`): the same activations; `gemmh_*`
//!   builds the `mma.m16n8k16` A fragments from the code words in registers.
//! - **int8** (`BONSAI_CUDA_GEMM=i8`, [`Gpu::set_gemm_config`]): `gemm_*`, one `mma.m16n8k32` per
//!   32-element sub-block, rescaled per sub-block in f32.
//! - `gemmw_*` (`BONSAI_CUDA_GEMM=wgmma`): f16 `wgmma` with A from registers; measured slower.
//!
//! Unlike the mat-vec kernels these are not batch-invariant with the n ≤ 8 path (the float
//! summation differs: per scale block, then times the weight scale), only equal within f32
//! rounding; but they are deterministic, and for a given matrix, input and row the result does not
//! depend on `n` or the tile width. It does not depend on the grouping either, except that a
//! one-matrix `gemmws` launch of a narrow matrix splits K ([`gemmws_k_splits`]) and a grouped one
//! does not ([`Gpu::set_gemm_k_split`] turns the split off).
//!
//! [`MAX_ROWS`]: crate::MAX_ROWS

use cudarc::driver::{result as cu, sys};

use crate::{cdiv, err, push_seg_args, Arg, CudaError, Gpu, MvSeg, Result, WKind, MAX_SEGS};

/// Weight rows per GEMM CTA (`GM_BM` in the source).
pub const GEMM_BM: usize = 128;
/// k elements per GEMM chunk (`GM_KC`): `n_in` must be a multiple of it.
pub const GEMM_KC: usize = 128;
/// Threads per GEMM CTA (`GM_THREADS`).
const GEMM_THREADS: u32 = 256;
/// Which kernels the prefill GEMM runs on (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// `gemm_*`: int8 `mma.m16n8k32`, rescaled per 32-element sub-block.
    Int8,
    /// `gemmh_*`: f16 `mma.m16n8k16` on converted activations (the default).
    F16,
    /// `gemmw_*`: f16 `wgmma` (only where [`Gpu::gemmw_available`]; else as `F16`).
    Wgmma,
    /// `gemmws_*` (the default where [`Gpu::gemmw_available`]; else as `F16`): f16 `wgmma` with the
    /// weights expanded into shared memory, both operands read by the tensor cores from there.
    WgmmaSs,
}

/// The prefill GEMM configuration: the path and its variant knobs. Results depend on the path
/// only (every variant of one path gives the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmConfig {
    pub path: GemmPath,
    /// `F16`: warps (32 weight rows each) per CTA, 4 or 8.
    pub warps: usize,
    /// `F16` with 4 warps and 64-row tiles: 2 ring stages at 4 CTAs per SM (`Some(true)`) instead
    /// of 3 at 3 (`Some(false)`); `None` (the default) picks per launch (`gemmh_o4_auto`: 2 stages for
    /// Q1_0 with n_in <= 5120, where they measured faster).
    pub o4: Option<bool>,
    /// `Wgmma`: A register sets, 2 or 4 (1 or 3 wgmma groups in flight).
    pub wgmma_sets: usize,
}

impl Default for GemmConfig {
    fn default() -> Self {
        GemmConfig {
            path: GemmPath::WgmmaSs,
            warps: 4,
            o4: None,
            wgmma_sets: 4,
        }
    }
}

impl GemmConfig {
    /// The default, changed by `BONSAI_CUDA_GEMM=i8|f16|wgmma`, `BONSAI_CUDA_GEMMH_WARPS=4|8` and
    /// `BONSAI_CUDA_GEMMH_O4=1|0` (always / never the 2-stage kernels; unset: per launch);
    /// `BONSAI_CUDA_GEMM=f16` takes the `mma.sync` kernels where the default would be `wgs`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_string());
        let mut c = GemmConfig::default();
        match var("BONSAI_CUDA_GEMM").as_deref() {
            Some("i8") => c.path = GemmPath::Int8,
            Some("f16") => c.path = GemmPath::F16,
            Some("wgmma") => c.path = GemmPath::Wgmma,
            Some("wgs") => c.path = GemmPath::WgmmaSs,
            _ => {}
        }
        if var("BONSAI_CUDA_GEMMH_WARPS").as_deref() == Some("8") {
            c.warps = 8;
        }
        c.o4 = match var("BONSAI_CUDA_GEMMH_O4").as_deref() {
            Some("1") => Some(true),
            Some("0") => Some(false),
            _ => None,
        };
        c
    }

    /// A short name for benchmark tables (`int8`, `f16-w4` (2 or 3 stages per launch), `f16-w4-o4`,
    /// `f16-w4-o3`, `f16-w8`, `f16-wgmma4`, `f16-wgs`).
    pub fn name(&self) -> String {
        match self.path {
            GemmPath::Int8 => "int8".into(),
            GemmPath::Wgmma => format!("f16-wgmma{}", self.wgmma_sets),
            GemmPath::WgmmaSs => "f16-wgs".into(),
            GemmPath::F16 if self.o4 == Some(true) && self.warps == 4 => "f16-w4-o4".into(),
            GemmPath::F16 if self.o4 == Some(false) && self.warps == 4 => "f16-w4-o3".into(),
            GemmPath::F16 => format!("f16-w{}", self.warps),
        }
    }
}

/// Whether a 4-warp, 64-row f16 GEMM launch takes the 2-stage kernel at 4 CTAs per SM when the
/// configuration leaves it open. Measured on the H200 at n = 512 (27B shapes, both variants, two
/// runs): for Q1_0 with n_in = 5120 it is faster (GDN in 270 -> 254 µs, gate|up 571 -> 558 µs),
/// for n_in = 6144 / 17408 slower (ssm_out 131 -> 133, down 340 -> 352); for Q2_0 slower on
/// every shape (its unpack needs more registers than 4 CTAs per SM leave). Same bits either way.
pub fn gemmh_o4_auto(kind: WKind, n_in: usize) -> bool {
    kind == WKind::Q1 && n_in <= 5120
}

/// The 128-row tiles of a wgmma GEMM launch over `segs` (`None`: nothing to do; an error past the
/// grid's y limit).
/// The segment count (1..=[`MAX_SEGS`]) and the sizes (n ≥ 1; n, n_in within i32) every GEMM
/// launcher checks; `what` names the launcher in the error.
fn check_gemm_launch(what: &str, segs: &[MvSeg], n_in: usize, n: usize) -> Result<()> {
    if segs.is_empty() || segs.len() > MAX_SEGS {
        return Err(CudaError(format!(
            "{what}: {} segments (1..={MAX_SEGS})",
            segs.len()
        )));
    }
    if n == 0 || n > i32::MAX as usize || n_in > i32::MAX as usize {
        return Err(CudaError(format!("{what}: n = {n}, n_in = {n_in}")));
    }
    Ok(())
}

fn wgmma_row_tiles(segs: &[MvSeg]) -> Result<Option<usize>> {
    let tiles_m: usize = segs.iter().map(|s| s.n_out.div_ceil(128)).sum();
    match tiles_m {
        0 => Ok(None),
        t if t > 65_535 => Err(CudaError(format!("gemm_lowbit: {t} row tiles"))),
        t => Ok(Some(t)),
    }
}

/// Dynamic shared memory of a warpgroup-MMA GEMM launch (`GW_SMEM`): 4 stages of 64 activation
/// rows x 128 f16 and 128 weight rows.
fn gemmw_smem(kind: WKind) -> usize {
    let wrow = if kind == WKind::Q1 { 16 } else { 48 };
    4 * (64 * 128 * 2 + 128 * wrow)
}

/// Dynamic shared memory of a `gemmws` launch (`GV_SMEM`): two 128 x 64 f16 weight tiles, and 4
/// ring stages of `bn` activation rows x 64 f16 and 128 x 16 code bytes.
fn gemmws_smem(bn: usize) -> usize {
    2 * 128 * 64 * 2 + 4 * (bn * 64 * 2 + 128 * 16)
}

/// K splits of a one-matrix `gemmws` launch: 3 for matrices of at most 48 row tiles (6,144
/// outputs) and at least 48 chunks of 64 inputs, else 1. At n = 512 the 27B's 5,120-output
/// projections (ffn_down, ssm_out, attn_out) are 160 CTAs of 128 x 128, which leave 104 of the
/// H200's 264 CTA slots empty; 3 splits make 480 (0.91 of two waves). Fixed by the shape alone, so
/// a row's result does not depend on `n`. The partial sums add up in a separate pass
/// (`gemm_splitk_sum`, in split order): not the unsplit launch's bits, equal within f32 rounding
/// (1.7e-5 of max |y| measured at 17,408 inputs). Grouped launches do not split, so a narrow
/// matrix's outputs in a group equal its own launch only with [`Gpu::set_gemm_k_split`] off.
pub fn gemmws_k_splits(n_out: usize, n_in: usize) -> usize {
    if n_out.div_ceil(128) <= 48 && n_in / 64 >= 48 {
        3
    } else {
        1
    }
}

/// Activation rows per `gemmws` CTA: 64 for n <= 64, and for Q2 kinds where 128-row tiles would
/// leave CTA slots of the machine (`slots` = SMs x CTAs per SM) empty; else 128. Measured on the
/// H200 at n = 512: the 5,120-output shapes take 123 / 332 µs at 64 rows against
/// 128 / 338 at 128 for Q2_0, but 141 / 390 against 114 / 308 for Q1_0.
pub fn gemmws_pick_bn(kind: WKind, tiles_m: usize, n: usize, slots: usize) -> usize {
    if n <= 64 || (kind != WKind::Q1 && tiles_m * n.div_ceil(128) < slots) {
        64
    } else {
        128
    }
}

/// Dynamic shared memory of an f16 GEMM launch (`GH_SMEM` in the source): `stages` of `bn`
/// activation rows (272 bytes) and 32 weight rows per warp (16 code bytes for Q1, 48 for Q2).
fn gemmh_smem(kind: WKind, bn: usize, warps: usize, stages: usize) -> usize {
    let wrow = if kind == WKind::Q1 { 16 } else { 48 };
    stages * (bn * 272 + 32 * warps * wrow)
}

/// The row exponent of `act_q8_to_f16p` (host twin of `f16p_row_exp`): `e` with `amax · 2^-e` in
/// (2^13, 2^14] for a positive normal `amax`, clamped to ±100; 0 for 0, inf or NaN.
pub fn f16p_row_exp(amax: f32) -> i32 {
    let e = ((amax.to_bits() >> 23) & 0xff) as i32;
    if amax.is_nan() || amax <= 0.0 || e == 0xff {
        return 0;
    }
    (e.max(1) - 140).clamp(-100, 100)
}

/// Host twin of `act_q8_to_f16p` for one row: the f16 values in pair order (every 4 elements
/// x0 x2 x1 x3) and the row factor `2^e`.
pub fn f16p_row(q: &[i8], d: &[f32]) -> (Vec<half::f16>, f32) {
    let m = d.iter().fold(0f32, |m, &v| m.max(v));
    let e = f16p_row_exp(m * 127.0);
    let down = f32::from_bits(((127 - e) as u32) << 23);
    let mut out = vec![half::f16::ZERO; q.len()];
    for (c, (q4, o4)) in q.chunks_exact(4).zip(out.chunks_exact_mut(4)).enumerate() {
        let s = d[c / 8] * down;
        let h = |i: usize| half::f16::from_f32(q4[i] as f32 * s);
        o4.copy_from_slice(&[h(0), h(2), h(1), h(3)]);
    }
    (out, f32::from_bits(((127 + e) as u32) << 23))
}

/// SM count and resident CTAs per SM of the BN = 64 and BN = 32 variants (same for every kind:
/// the launcher takes the smallest over kinds).
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmOcc {
    sms: usize,
    occ64: usize,
    occ32: usize,
}

/// Whether [`Gpu::gemm_lowbit_multi`] takes matrices of this kind and width.
pub fn gemm_supported(kind: WKind, n_in: usize) -> bool {
    !matches!(kind, WKind::F32 | WKind::Q41) && n_in > 0 && n_in % GEMM_KC == 0
}

/// Fraction of the machine a launch keeps busy: (tiles / slots) over whole waves, times the used
/// fraction of the activation tile rows.
fn launch_eff(tiles_m: usize, n: usize, bn: usize, occ: usize, sms: usize) -> f64 {
    let tn = n.div_ceil(bn);
    let tiles = (tiles_m * tn) as f64;
    let slots = (occ.max(1) * sms.max(1)) as f64;
    let waves = tiles / slots;
    let wave_eff = waves / waves.ceil();
    let row_eff = n as f64 / (tn * bn) as f64;
    wave_eff * row_eff
}

/// Activation rows per CTA (64 or 32) for a launch of `tiles_m` weight tiles over `n` rows, given
/// `sms` SMs and `occ64` / `occ32` resident CTAs per SM of the two variants: 32 only when it keeps
/// the machine clearly busier (it re-reads each weight tile twice as often).
pub fn gemm_pick_bn(tiles_m: usize, n: usize, sms: usize, occ64: usize, occ32: usize) -> usize {
    let e64 = launch_eff(tiles_m, n, 64, occ64, sms);
    let e32 = launch_eff(tiles_m, n, 32, occ32, sms);
    if e32 > 1.15 * e64 {
        32
    } else {
        64
    }
}

impl Gpu {
    /// The prefill GEMM configuration in force ([`GemmConfig`]), with `Wgmma` read as `F16` where
    /// this cubin has no wgmma kernels.
    pub fn gemm_config(&self) -> GemmConfig {
        let mut c = *self.gemm_config.lock().expect("gemm config lock");
        if matches!(c.path, GemmPath::Wgmma | GemmPath::WgmmaSs) && !self.gemmw_ok {
            c.path = GemmPath::F16;
        }
        c
    }

    /// Set the prefill GEMM configuration (benchmarks and tests; `warps` 4 or 8, `wgmma_sets` 2 or
    /// 4).
    pub fn set_gemm_config(&self, c: GemmConfig) {
        assert!(c.warps == 4 || c.warps == 8, "gemmh warps {}", c.warps);
        assert!(
            c.wgmma_sets == 2 || c.wgmma_sets == 4,
            "gemmw sets {}",
            c.wgmma_sets
        );
        *self.gemm_config.lock().expect("gemm config lock") = c;
    }

    /// Whether the kernels include the warpgroup-MMA GEMM (a cubin for sm_90a).
    pub fn gemmw_available(&self) -> bool {
        self.gemmw_ok
    }

    /// Ask the cubin whether its wgmma kernels are real (compiled for sm_90a).
    pub(crate) fn probe_gemmw(&self) -> Result<bool> {
        let b = self.alloc(4)?;
        self.launch(
            self.f.gemmw_available,
            (1, 1, 1),
            (1, 1, 1),
            &[Arg::P(b.ptr())],
        )?;
        let mut v = [0i32];
        self.dtoh(&b, 0, &mut v)?;
        Ok(v[0] == 1)
    }

    /// Swap the stride fields of the wgmma shared-memory descriptor (hardware check only: the
    /// wrong setting gives wrong products).
    pub fn set_gemmw_desc_swap(&self, on: bool) {
        self.gemmw_desc_swap
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Let one-matrix `gemmws` launches of narrow matrices split K (the default, see
    /// [`gemmws_k_splits`]) or not. Without the split every output equals the `mma.sync` path's
    /// and a grouped launch's bit for bit; with it, a split launch's outputs are equal within f32
    /// rounding.
    pub fn set_gemm_k_split(&self, on: bool) {
        self.gemm_k_split
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The f16 GEMM kernel of a kind, tile width and warp count, and its ring stages.
    fn gemmh_func(
        &self,
        kind: WKind,
        bn: usize,
        warps: usize,
        o4: bool,
    ) -> (sys::CUfunction, usize) {
        let f = &self.f;
        if warps == 4 && bn == 64 && o4 {
            let k = match kind {
                WKind::Q1 => f.gemmh_q1_o4,
                WKind::Q2 => f.gemmh_q2_o4,
                WKind::Q2G64 => f.gemmh_q2g64_o4,
                WKind::F32 | WKind::Q41 => unreachable!("checked by gemm_supported"),
            };
            return (k, 2);
        }
        let k = match (kind, bn, warps) {
            (WKind::Q1, 64, 4) => f.gemmh_q1,
            (WKind::Q2, 64, 4) => f.gemmh_q2,
            (WKind::Q2G64, 64, 4) => f.gemmh_q2g64,
            (WKind::Q1, _, 4) => f.gemmh_q1_n32,
            (WKind::Q2, _, 4) => f.gemmh_q2_n32,
            (WKind::Q2G64, _, 4) => f.gemmh_q2g64_n32,
            (WKind::Q1, 64, _) => f.gemmh_q1_w8,
            (WKind::Q2, 64, _) => f.gemmh_q2_w8,
            (WKind::Q2G64, 64, _) => f.gemmh_q2g64_w8,
            (WKind::Q1, _, _) => f.gemmh_q1_w8_n32,
            (WKind::Q2, _, _) => f.gemmh_q2_w8_n32,
            (WKind::Q2G64, _, _) => f.gemmh_q2g64_w8_n32,
            (WKind::F32 | WKind::Q41, _, _) => unreachable!("checked by gemm_supported"),
        };
        (k, 3)
    }

    /// The f16 activations of `q`/`d` (`[n, n_in]`) in this `Gpu`'s scratch: returns (xh, xs).
    fn gemm_f16_acts(&self, q: u64, d: u64, n_in: usize, n: usize) -> Result<(u64, u64)> {
        let hbytes = (n * n_in * 2).next_multiple_of(256);
        let need = hbytes + n * 4;
        let mut scratch = self.gemm_f16_scratch.lock().expect("gemm scratch lock");
        if scratch.as_ref().is_none_or(|b| b.bytes() < need) {
            // earlier launches may still read the old buffer
            self.sync()?;
            *scratch = None;
            *scratch = Some(self.alloc(need)?);
        }
        let base = scratch.as_ref().expect("gemm scratch").ptr();
        let (xh, xs) = (base, base + hbytes as u64);
        self.act_q8_to_f16p(q, d, n_in, n, xh, xs)?;
        Ok((xh, xs))
    }

    /// The f16 GEMM's activations: `xh [n, n_in]` f16 (pair order, 16-byte aligned rows) and
    /// `xs [n]` f32 row factors from int8 `q [n, n_in]` and per-32 scales `d` (host twin
    /// [`f16p_row`]).
    pub fn act_q8_to_f16p(
        &self,
        q: u64,
        d: u64,
        n_in: usize,
        n: usize,
        xh: u64,
        xs: u64,
    ) -> Result<()> {
        if n_in % 32 != 0 || q % 8 != 0 || d % 4 != 0 || xh % 16 != 0 || xs % 4 != 0 {
            return Err(CudaError(format!(
                "act_q8_to_f16p: n_in = {n_in}, q {q:#x}, d {d:#x}, xh {xh:#x}, xs {xs:#x}"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        self.launch(
            self.f.act_q8_to_f16p,
            (n as u32, 1, 1),
            (256, 1, 1),
            &[
                Arg::P(q),
                Arg::P(d),
                Arg::I(n_in as i32),
                Arg::P(xh),
                Arg::P(xs),
            ],
        )
    }

    /// The arguments the two wgmma GEMMs share: the segments (128-row tiles), the f16 activations,
    /// the sizes and the descriptor switch.
    fn wgmma_args(
        &self,
        segs: &[MvSeg],
        xh: u64,
        xs: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
    ) -> Vec<Arg> {
        let mut args = Vec::with_capacity(4 * MAX_SEGS + 8);
        push_seg_args(&mut args, segs, MAX_SEGS, 128);
        args.extend([
            Arg::P(xh),
            Arg::P(xs),
            Arg::I(n_in as i32),
            Arg::I(n as i32),
            Arg::I(accumulate as i32),
            Arg::I(
                self.gemmw_desc_swap
                    .load(std::sync::atomic::Ordering::Relaxed) as i32,
            ),
        ]);
        args
    }

    /// The warpgroup-MMA GEMM: 128 weight rows x 64 activation rows per CTA.
    #[allow(clippy::too_many_arguments)]
    fn gemmw_launch(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
        sets: usize,
    ) -> Result<()> {
        let Some(tiles_m) = wgmma_row_tiles(segs)? else {
            return Ok(());
        };
        let (xh, xs) = self.gemm_f16_acts(q, d, n_in, n)?;
        let f = match (kind, sets) {
            (WKind::Q1, 2) => self.f.gemmw_q1,
            (WKind::Q2, 2) => self.f.gemmw_q2,
            (WKind::Q2G64, 2) => self.f.gemmw_q2g64,
            (WKind::Q1, _) => self.f.gemmw_q1_s4,
            (WKind::Q2, _) => self.f.gemmw_q2_s4,
            (WKind::Q2G64, _) => self.f.gemmw_q2g64_s4,
            (WKind::F32 | WKind::Q41, _) => unreachable!("checked by gemm_supported"),
        };
        let args = self.wgmma_args(segs, xh, xs, n_in, n, accumulate);
        self.launch_smem(
            f,
            (cdiv(n, 64), tiles_m as u32, 1),
            (128, 1, 1),
            gemmw_smem(kind) as u32,
            &args,
        )
    }

    /// The shared-memory wgmma GEMM: 128 weight rows x `bn` (64 or 128; `None`: picked) activation
    /// rows per CTA, 2 CTAs per SM.
    #[allow(clippy::too_many_arguments)]
    /// `b1p`: the segments' weights are in the b1-plane layout (`retile_b1p`; Q1 or Q2 g128),
    /// else the dp4a layout of `retile`; the outputs are the same bits either way.
    #[allow(clippy::too_many_arguments)]
    fn gemmws_launch(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
        bn: Option<usize>,
        b1p: bool,
    ) -> Result<()> {
        let Some(tiles_m) = wgmma_row_tiles(segs)? else {
            return Ok(());
        };
        let splits =
            if segs.len() == 1 && self.gemm_k_split.load(std::sync::atomic::Ordering::Relaxed) {
                gemmws_k_splits(segs[0].n_out, n_in)
            } else {
                1
            };
        let bn = match bn {
            Some(b) => {
                assert!(b == 64 || b == 128, "gemmws: bn = {b}");
                b
            }
            None if splits > 1 => {
                if n <= 64 {
                    64
                } else {
                    128
                }
            }
            None => gemmws_pick_bn(kind, tiles_m, n, 2 * self.sm_count()?),
        };
        let (xh, xs) = self.gemm_f16_acts(q, d, n_in, n)?;
        let nc = n_in / 64;
        let kc_split = nc.div_ceil(splits);
        let part = if splits > 1 {
            self.gemm_part_scratch(splits * n * segs[0].n_out * 4)?
        } else {
            0
        };
        let f = &self.f;
        let f = match (kind, bn) {
            (WKind::Q1, 128) if b1p => f.gemmws_q1_b1p,
            (WKind::Q2, 128) if b1p => f.gemmws_q2_b1p,
            (WKind::Q1, _) if b1p => f.gemmws_q1_b1p_n64,
            (WKind::Q2, _) if b1p => f.gemmws_q2_b1p_n64,
            (_, _) if b1p => {
                return Err(CudaError(format!(
                    "gemm_b1p: {kind:?} has no b1-plane layout"
                )))
            }
            (WKind::Q1, 128) => f.gemmws_q1,
            (WKind::Q2, 128) => f.gemmws_q2,
            (WKind::Q2G64, 128) => f.gemmws_q2g64,
            (WKind::Q1, _) => f.gemmws_q1_n64,
            (WKind::Q2, _) => f.gemmws_q2_n64,
            (WKind::Q2G64, _) => f.gemmws_q2g64_n64,
            (WKind::F32 | WKind::Q41, _) => unreachable!("checked by gemm_supported"),
        };
        let mut args = self.wgmma_args(segs, xh, xs, n_in, n, accumulate);
        args.extend([Arg::I(kc_split as i32), Arg::P(part)]);
        self.launch_smem(
            f,
            (cdiv(n, bn), tiles_m as u32, splits as u32),
            (128, 1, 1),
            gemmws_smem(bn) as u32,
            &args,
        )?;
        if splits == 1 {
            return Ok(());
        }
        let total = n * segs[0].n_out;
        self.launch(
            self.f.gemm_splitk_sum,
            (total.div_ceil(256) as u32, 1, 1),
            (256, 1, 1),
            &[
                Arg::P(part),
                Arg::I(splits as i32),
                Arg::I(n as i32),
                Arg::I(segs[0].n_out as i32),
                Arg::P(xs),
                Arg::P(segs[0].y),
                Arg::I(accumulate as i32),
            ],
        )
    }

    /// A device scratch of at least `bytes` for the K-split GEMM's partial sums (grown on demand;
    /// the `Gpu`'s stream orders its uses).
    fn gemm_part_scratch(&self, bytes: usize) -> Result<u64> {
        let mut scratch = self.gemm_part_scratch.lock().expect("gemm part lock");
        if scratch.as_ref().is_none_or(|b| b.bytes() < bytes) {
            // earlier launches may still read the old buffer
            self.sync()?;
            *scratch = None;
            *scratch = Some(self.alloc(bytes)?);
        }
        Ok(scratch.as_ref().expect("gemm part scratch").ptr())
    }

    fn gemm_occ(&self) -> Result<GemmOcc> {
        if let Some(o) = self.gemm_occ.get() {
            return Ok(*o);
        }
        let sms = self.sm_count()?;
        let occ = |fs: [sys::CUfunction; 3]| -> Result<usize> {
            let mut m = usize::MAX;
            for f in fs {
                // SAFETY: f is a kernel of our loaded module; no dynamic shared memory.
                let o = unsafe {
                    cu::occupancy::max_active_block_per_multiprocessor(f, GEMM_THREADS as i32, 0)
                }
                .map_err(err("occupancy"))?;
                m = m.min(o.max(1) as usize);
            }
            Ok(m)
        };
        let o = GemmOcc {
            sms,
            occ64: occ([self.f.gemm_q1, self.f.gemm_q2, self.f.gemm_q2g64])?,
            occ32: occ([
                self.f.gemm_q1_n32,
                self.f.gemm_q2_n32,
                self.f.gemm_q2g64_n32,
            ])?,
        };
        Ok(*self.gemm_occ.get_or_init(|| o))
    }

    /// `y[t, o] (+)= Σ_i W[o, i] x[t, i]` for one low-bit matrix on the tensor cores, any `n ≥ 1`
    /// (meant for prefill, n > [`crate::MAX_ROWS`]). `q`: int8 activations `[n, n_in]`, `d`: f32
    /// per-32 scales `[n, n_in/32]`, `y`: f32 `[n, n_out]`. `n_in % GEMM_KC == 0`.
    pub fn gemm_lowbit(
        &self,
        kind: WKind,
        codes: u64,
        scales: u64,
        q: u64,
        d: u64,
        y: u64,
        n_in: usize,
        n_out: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.gemm_lowbit_multi(
            kind,
            &[MvSeg {
                codes,
                scales,
                y,
                n_out,
            }],
            q,
            d,
            n_in,
            n,
            accumulate,
        )
    }

    /// Whether the prefill GEMM can read matrices in the b1-plane layout ([`Gpu::gemm_b1p_multi`]):
    /// the shared-memory `wgmma` path (`gemmws`, the sm_90a default) is configured. Where it is,
    /// the engine keeps the norm-fed Q1_0 / Q2_0 projections in the b1-plane layout only.
    pub fn gemm_reads_b1p(&self) -> bool {
        self.gemm_config().path == GemmPath::WgmmaSs
    }

    /// [`Gpu::gemm_lowbit_multi`] for matrices in the b1-plane layout (`retile_b1p`: segment
    /// codes and scales point there; `kind` Q1 or Q2 with 128-element blocks, `n_in % 256 == 0`,
    /// `n_out % 16 == 0`). Each output equals the dp4a-layout launch of the same matrix bit for
    /// bit: the kernel permutes the code words into the dp4a order before the same expansion.
    /// Only on the `gemmws` path ([`Gpu::gemm_reads_b1p`]); elsewhere an error.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_b1p_multi(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
        bn: Option<usize>,
    ) -> Result<()> {
        if !self.gemm_reads_b1p() {
            return Err(CudaError(format!(
                "gemm_b1p: the prefill GEMM is {:?}, which reads only the dp4a layout",
                self.gemm_config().path
            )));
        }
        if !matches!(kind, WKind::Q1 | WKind::Q2) || n_in % 256 != 0 {
            return Err(CudaError(format!(
                "gemm_b1p: {kind:?} with n_in = {n_in} (needs Q1 or Q2 g128, n_in % 256 == 0)"
            )));
        }
        if segs.iter().any(|s| s.n_out % 16 != 0) {
            return Err(CudaError(
                "gemm_b1p: a segment's n_out is not a multiple of 16".into(),
            ));
        }
        check_gemm_launch("gemm_b1p", segs, n_in, n)?;
        self.gemmws_launch(kind, segs, q, d, n_in, n, accumulate, bn, true)
    }

    /// One GEMM launch over up to [`MAX_SEGS`] low-bit matrices of the same kind and `n_in` sharing
    /// the input (e.g. GDN `qkv | z | β | α`): segment `i` writes `y_i [n, n_out_i]`. Each output
    /// equals the single-matrix launch bit for bit (for a narrow matrix only with the K split off:
    /// [`Gpu::set_gemm_k_split`]).
    pub fn gemm_lowbit_multi(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.gemm_lowbit_multi_bn(kind, segs, q, d, n_in, n, accumulate, None)
    }

    /// [`Gpu::gemm_lowbit_multi`] with the activation rows per CTA forced to `bn` (32 or 64; the
    /// `WgmmaSs` path 64 or 128; `Wgmma` ignores it) instead of picked from the grid size (tests
    /// and benchmarks).
    pub fn gemm_lowbit_multi_bn(
        &self,
        kind: WKind,
        segs: &[MvSeg],
        q: u64,
        d: u64,
        n_in: usize,
        n: usize,
        accumulate: bool,
        bn: Option<usize>,
    ) -> Result<()> {
        if !gemm_supported(kind, n_in) {
            return Err(CudaError(format!(
                "gemm_lowbit: {kind:?} with n_in = {n_in} (needs a low-bit kind, n_in % {GEMM_KC} == 0)"
            )));
        }
        check_gemm_launch("gemm_lowbit", segs, n_in, n)?;
        let cfg = self.gemm_config();
        if cfg.path == GemmPath::Wgmma {
            return self.gemmw_launch(kind, segs, q, d, n_in, n, accumulate, cfg.wgmma_sets);
        }
        if cfg.path == GemmPath::WgmmaSs {
            return self.gemmws_launch(kind, segs, q, d, n_in, n, accumulate, bn, false);
        }
        let f16 = cfg.path == GemmPath::F16;
        let warps = cfg.warps;
        let bm = if f16 { 32 * warps } else { GEMM_BM };
        let tiles_m: usize = segs.iter().map(|s| s.n_out.div_ceil(bm)).sum();
        if tiles_m == 0 {
            return Ok(());
        }
        if tiles_m > 65_535 {
            return Err(CudaError(format!("gemm_lowbit: {tiles_m} row tiles")));
        }
        let bn = match bn {
            Some(b) => {
                assert!(b == 32 || b == 64, "gemm_lowbit: bn = {b}");
                b
            }
            None => {
                if f16 {
                    // measured on the H200 at n = 512: 64 rows beat 32 on every 27B shape, even
                    // where 32 fills more of the machine (attn q|k|v 238 vs 274 µs)
                    if n <= 32 {
                        32
                    } else {
                        64
                    }
                } else {
                    let o = self.gemm_occ()?;
                    gemm_pick_bn(tiles_m, n, o.sms, o.occ64, o.occ32)
                }
            }
        };
        if f16 {
            let (xh, xs) = self.gemm_f16_acts(q, d, n_in, n)?;
            let o4 = cfg.o4.unwrap_or_else(|| gemmh_o4_auto(kind, n_in));
            let (f, stages) = self.gemmh_func(kind, bn, warps, o4);
            let mut args = Vec::with_capacity(4 * MAX_SEGS + 5);
            push_seg_args(&mut args, segs, MAX_SEGS, bm);
            args.extend([
                Arg::P(xh),
                Arg::P(xs),
                Arg::I(n_in as i32),
                Arg::I(n as i32),
                Arg::I(accumulate as i32),
            ]);
            return self.launch_smem(
                f,
                (cdiv(n, bn), tiles_m as u32, 1),
                ((32 * warps) as u32, 1, 1),
                gemmh_smem(kind, bn, warps, stages) as u32,
                &args,
            );
        }
        let f = match (kind, bn) {
            (WKind::Q1, 64) => self.f.gemm_q1,
            (WKind::Q2, 64) => self.f.gemm_q2,
            (WKind::Q2G64, 64) => self.f.gemm_q2g64,
            (WKind::Q1, _) => self.f.gemm_q1_n32,
            (WKind::Q2, _) => self.f.gemm_q2_n32,
            (WKind::Q2G64, _) => self.f.gemm_q2g64_n32,
            (WKind::F32 | WKind::Q41, _) => unreachable!("checked by gemm_supported"),
        };
        let mut args = Vec::with_capacity(4 * MAX_SEGS + 5);
        push_seg_args(&mut args, segs, MAX_SEGS, GEMM_BM);
        args.extend([
            Arg::P(q),
            Arg::P(d),
            Arg::I(n_in as i32),
            Arg::I(n as i32),
            Arg::I(accumulate as i32),
        ]);
        self.launch(
            f,
            (cdiv(n, bn), tiles_m as u32, 1),
            (GEMM_THREADS, 1, 1),
            &args,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_shapes() {
        assert!(gemm_supported(WKind::Q1, 5120));
        assert!(gemm_supported(WKind::Q2G64, 17408));
        assert!(!gemm_supported(WKind::Q2G64, 192));
        assert!(!gemm_supported(WKind::F32, 5120));
        assert!(!gemm_supported(WKind::Q2, 0));
    }

    #[test]
    fn bn_pick() {
        // 5120 outputs x 512 rows on 132 SMs: BN 64 gives 320 tiles on 264 slots (1.2 waves), BN 32
        // 640 tiles on 396 slots (1.6 waves): pick 32
        assert_eq!(gemm_pick_bn(40, 512, 132, 2, 3), 32);
        // gate|up (272 tiles): BN 64 fills 8+ waves
        assert_eq!(gemm_pick_bn(272, 512, 132, 2, 3), 64);
        // few rows: a 64-row tile would be mostly empty
        assert_eq!(gemm_pick_bn(272, 20, 132, 2, 3), 32);
        // GDN in-projection (130 tiles) x 512 rows: 3.9 waves of BN 64 already fill the machine
        assert_eq!(gemm_pick_bn(130, 512, 132, 2, 2), 64);
        let e = launch_eff(10, 64, 64, 1, 10);
        assert!((e - 1.0).abs() < 1e-12);
    }

    #[test]
    fn wgs_splits_and_tiles() {
        // the 27B's 5,120-output projections split K in 3, the wide ones do not
        assert_eq!(gemmws_k_splits(5120, 17408), 3);
        assert_eq!(gemmws_k_splits(5120, 6144), 3);
        assert_eq!(gemmws_k_splits(34816, 5120), 1);
        assert_eq!(gemmws_k_splits(10240, 5120), 1);
        // too few chunks to split
        assert_eq!(gemmws_k_splits(5120, 2048), 1);
        // Q2 gdn in-projection at n = 512 fills the machine with 128 rows; ffn_down would not
        assert_eq!(gemmws_pick_bn(WKind::Q2, 130, 512, 264), 128);
        assert_eq!(gemmws_pick_bn(WKind::Q2, 40, 512, 264), 64);
        assert_eq!(gemmws_pick_bn(WKind::Q1, 40, 512, 264), 128);
        assert_eq!(gemmws_pick_bn(WKind::Q1, 272, 40, 264), 64);
    }
}
