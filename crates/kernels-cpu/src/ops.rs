//! Optimized CPU ops: parallel over output rows / heads ([`crate::par`]), runtime SIMD dispatch.
//!
//! ## Low-bit matmul numerics (Q1_0, Q2_0 g128/g64, PQ2_0)
//! Activations are quantized like llama.cpp's Q8_0 activations ([`quantize_acts`]): per 32-element
//! block `d = amax/127` kept as **f32** (not f16-rounded), `q = round_half_away(x · (1/d))` clamped to
//! ±127. For weight row `o` and activation row `t` the result is defined exactly as
//!
//! ```text
//! acc[0..8] = 0
//! for each 256-element chunk c, lane l in 0..8, block b = 8c + l  (b past the row: isum = 0, sc = 0)
//!     isum = Σ_{j in block b} wcode_j · q_j          (exact i32; wcode = ±1 for Q1_0, c−1 for Q2)
//!     sc   = d_w(block of b) · d_a[b]                (f32 multiply)
//!     acc[l] = fma(isum as f32, sc, acc[l])
//! y = ((acc0+acc4) + (acc2+acc6)) + ((acc1+acc5) + (acc3+acc7))
//! ```
//!
//! Every SIMD path computes exactly this (integers are exact; the float ops are the same ops in the
//! same order), so results are bit-identical across ISAs, batch sizes `n` and thread counts.
//!
//! Work order (not results): one activation row runs tasks of 16 weight rows; several rows run
//! tasks of 16 weight rows × groups of 8 activation rows, so a group's int8 rows stay in cache
//! while the task's weight rows pass over them, and AVX-512 takes two weight rows per pass so
//! each activation load feeds two `vpdpbusd`.
//!
//! Q1_0 in the mask layout ([`crate::q1m`], [`matmul_masked`]; AVX2 and AVX-512): the same
//! definition and bits. Each 512-element pair's block integers come from one broadcast, one AND and
//! one `vpdpbusd` per 64 weights (AVX2: two ANDs, `vpmaddubsw` + `vpmaddwd` per 32) instead of the
//! file layout's unpacking (`vpshufbitqmb` and a masked move per 32; AVX2: a shuffle, two ANDs and a
//! compare), and one activation row runs 4 weight rows per pass while software prefetch streams the
//! next 4 in: on a Zen 4 core that is what lets the AVX-512 mat-vec reach DRAM bandwidth (2
//! threads, 5120 × 131072: 28 GB/s against 16 GB/s in the file layout).
//!
//! The Q2 types in their mask layout ([`crate::q2m`], [`matmul_masked`]) run the same kernels with
//! 16-byte code vectors: one broadcast, one AND and one `vpdpbusd` per 64 weights, the same bits
//! as the file layout's per-chunk unpacking (2 threads, 5120 × 131072: 34–37 GB/s against 23 /
//! 14 GB/s for g128 / g64).
//!
//! ## Other weight types (F32, F16, BF16, Q4_0, Q4_1, Q8_0)
//! f32 activations: each weight row is dequantized once and dotted with each activation row by
//! [`dot_f32`] (fixed 4×8-lane order), again independent of `n` and of the thread count.

use crate::par;
use crate::quant::{dequantize_row, QuantType};
use half::f16;
use std::sync::OnceLock;

/// Instruction set used by an op. `Scalar` is the portable fallback that computes the same
/// algorithm (and the same bits) as the SIMD paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// x86_64 AVX2 + FMA + F16C and AVX-512 F / BW / VL with VNNI and BITALG (Ice Lake and later,
    /// Zen 4 and later): the low-bit matmul rows use `vpdpbusd` and `vpshufbitqmb`; every other op
    /// runs its AVX2 form. Same bits as the other ISAs.
    Avx512,
}

impl Isa {
    /// Every ISA, best last.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The name `BONSAI_CPU_ISA` takes.
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// True when the op runs the AVX2 (+FMA, F16C) code: AVX2 and AVX-512 machines.
    #[inline]
    fn avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::Avx512)
    }
}

/// True when this CPU can run `isa`.
pub fn isa_supported(isa: Isa) -> bool {
    match isa {
        Isa::Scalar => true,
        Isa::Avx2 => {
            #[cfg(target_arch = "x86_64")]
            {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        }
        Isa::Avx512 => {
            #[cfg(target_arch = "x86_64")]
            {
                isa_supported(Isa::Avx2)
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512bitalg")
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                false
            }
        }
    }
}

/// The best ISA this CPU supports.
pub fn best_isa() -> Isa {
    Isa::ALL
        .into_iter()
        .rev()
        .find(|&i| isa_supported(i))
        .unwrap_or(Isa::Scalar)
}

/// The ISA the un-suffixed ops use: the best supported one, unless the environment variable
/// `BONSAI_CPU_ISA` (`scalar`, `avx2` or `avx512`) names another; a name this CPU cannot run, or
/// an unknown one, falls back to the best supported ISA with a warning on stderr. Read once per
/// process.
pub fn active_isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let forced = std::env::var("BONSAI_CPU_ISA").unwrap_or_default();
        let best = best_isa();
        if forced.is_empty() {
            return best;
        }
        match Isa::ALL
            .into_iter()
            .find(|i| forced.eq_ignore_ascii_case(i.name()))
        {
            Some(i) if isa_supported(i) => i,
            Some(i) => {
                eprintln!(
                    "bonsai: BONSAI_CPU_ISA={forced}: this CPU cannot run {}; using {}",
                    i.name(),
                    best.name()
                );
                best
            }
            None => {
                eprintln!(
                    "bonsai: BONSAI_CPU_ISA={forced} is not one of scalar, avx2, avx512; using {}",
                    best.name()
                );
                best
            }
        }
    })
}

fn check_isa(isa: Isa) {
    assert!(
        isa_supported(isa),
        "ISA {isa:?} is not supported on this CPU"
    );
}

// ---------------------------------------------------------------------------------------------
// Activation quantization
// ---------------------------------------------------------------------------------------------

/// Activations quantized to int8 in 32-element blocks (llama.cpp Q8_0 scheme, f32 scales), for `n`
/// rows of `n_in`. Rows are zero-padded to a multiple of 256 elements. Also keeps the f32 originals
/// so [`matmul_q`] on a non-low-bit weight equals [`matmul`] exactly.
///
/// The quantizer writes the codes once, in the `q1p` order that the Q1_0 kernels and every mask
/// layout read; the natural order (`qs`: the scalar path, tests, GPU twins) and the Q2 file-layout
/// order (`qp`) are derived from it on first use.
pub struct QuantActs {
    pub(crate) n: usize,
    pub(crate) n_in: usize,
    /// `n_in` rounded up to 256.
    pub(crate) n_pad: usize,
    /// qs: [n, n_pad] int8 codes, natural order (derived from `q1p` on first use: [`Self::qs`]).
    qs: OnceLock<Vec<i8>>,
    /// qp: [n, n_pad] the same codes permuted per 128-element chunk for the Q2 kernels:
    /// `qp[128p + 32s + i] = qs[128p + 4i + s]` (the order 2-bit codes unpack in); derived on first
    /// use ([`Self::qp`]).
    qp: OnceLock<Vec<i8>>,
    /// q1p: [n, n_pad] the codes permuted per 256-element chunk for the Q1_0 kernels: vector k
    /// (32 bytes) of chunk c holds `qs[256c + 32l + 4k + m]` at byte `4l + m` (so i32 lane l of
    /// every vector is block l), and lies at [`q1p_vec`]`(n_pad, c, k)`: the two chunks of each
    /// 512-element pair interleave their vectors, so vector k of both is one 64-byte load.
    pub(crate) q1p: Vec<i8>,
    /// d: [n, n_pad/32] per-block scale (f32), 0 for padding blocks.
    pub(crate) d: Vec<f32>,
    /// sums: [n, n_pad/32] Σ q per block.
    pub(crate) sums: Vec<i32>,
    /// x: [n, n_in] the original f32 activations.
    pub(crate) x: Vec<f32>,
}

impl QuantActs {
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn n_in(&self) -> usize {
        self.n_in
    }
    /// Padded row length (`n_in` rounded up to 256).
    pub fn n_pad(&self) -> usize {
        self.n_pad
    }
    /// `[n, n_pad]` int8 codes in element order (GPU twins upload and compare these).
    pub fn codes(&self) -> &[i8] {
        self.qs()
    }
    /// `[n, n_pad]` codes in element order, gathered from `q1p` on the first call.
    pub(crate) fn qs(&self) -> &[i8] {
        self.qs.get_or_init(|| self.gather_q1p(|e| e))
    }
    /// `[n, n_pad]` codes in the Q2 file-layout order (`qp[128p + 32s + i]` = element
    /// `128p + 4i + s`), gathered from `q1p` on the first call.
    pub(crate) fn qp(&self) -> &[i8] {
        self.qp
            .get_or_init(|| self.gather_q1p(|j| j / 128 * 128 + 4 * (j % 32) + j % 128 / 32))
    }
    /// Every row's codes in an order whose position `j` holds element `elem(j)`, read from `q1p`.
    fn gather_q1p(&self, elem: impl Fn(usize) -> usize) -> Vec<i8> {
        let mut out = vec![0i8; self.q1p.len()];
        for (or, pr) in out
            .chunks_exact_mut(self.n_pad.max(1))
            .zip(self.q1p.chunks_exact(self.n_pad.max(1)))
        {
            for (j, o) in or.iter_mut().enumerate() {
                *o = pr[q1p_pos(self.n_pad, elem(j))];
            }
        }
        out
    }
    /// `[n, n_pad / 32]` block scales.
    pub fn scales(&self) -> &[f32] {
        &self.d
    }
    /// `[n, n_pad / 32]` Σ q per block.
    pub fn sums(&self) -> &[i32] {
        &self.sums
    }
    /// Dequantized value `q·d` of element `i` of row `t` (for tests and diagnostics).
    pub fn dequant(&self, t: usize, i: usize) -> f32 {
        self.qs()[t * self.n_pad + i] as f32 * self.d[t * self.n_pad / 32 + i / 32]
    }
}

/// Offset in a `q1p` row of `n_pad` codes of vector k (32 bytes) of 256-element chunk c: chunks
/// 2s and 2s + 1 of a whole 512-element pair store vector k as the low and high halves of 64
/// bytes at `512s + 64k`; a last unpaired chunk keeps `256c + 32k`.
#[inline]
pub(crate) fn q1p_vec(n_pad: usize, c: usize, k: usize) -> usize {
    let (base, stride) = q1p_chunk(n_pad, c);
    base + stride * k
}

/// Offset in a `q1p` row of `n_pad` codes of element `e`: byte `4l + m` of vector k of chunk c, for
/// `e = 256c + 32l + 4k + m`.
#[inline]
pub(crate) fn q1p_pos(n_pad: usize, e: usize) -> usize {
    q1p_vec(n_pad, e / 256, e % 32 / 4) + 4 * (e % 256 / 32) + e % 4
}

/// [`q1p_vec`] as (offset of vector 0, stride between vectors) of chunk c.
#[inline]
pub(crate) fn q1p_chunk(n_pad: usize, c: usize) -> (usize, usize) {
    if c < n_pad / 512 * 2 {
        (512 * (c / 2) + 32 * (c % 2), 64)
    } else {
        (256 * c, 32)
    }
}

/// `round_half_away(v).clamp(-127, 127) as i8` (`f32::round` then clamp, bit for bit: NaN → 0)
/// without the libm `roundf` call that `f32::round` makes on baseline x86-64. Clamping to ±128
/// first keeps the integer conversion exact and changes nothing (both bounds are integers).
#[inline]
pub fn round_to_i8(v: f32) -> i8 {
    let v = v.clamp(-128.0, 128.0);
    let t = v as i32; // toward zero; NaN → 0
    let f = v - t as f32; // exact: |v| <= 128
    (t + (f >= 0.5) as i32 - (f <= -0.5) as i32).clamp(-127, 127) as i8
}

/// Quantize `n` rows of `n_in` f32 activations (`n_in % 32 == 0`) to [`QuantActs`]:
/// `d = amax/127` (f32), `q = round_half_away(x · (1/d))` clamped to ±127; `d = 0, q = 0` for an
/// all-zero block. Rows run in parallel; each row runs [`quantize_row_isa`] on the active ISA.
pub fn quantize_acts(x: &[f32] /* [n, n_in] */, n: usize, n_in: usize) -> QuantActs {
    quantize_acts_isa(active_isa(), x, n, n_in)
}

/// [`quantize_acts`] with an explicit ISA (every ISA gives the same bytes).
pub fn quantize_acts_isa(isa: Isa, x: &[f32], n: usize, n_in: usize) -> QuantActs {
    assert_eq!(n_in % 32, 0, "quantize_acts: n_in must be a multiple of 32");
    assert_eq!(x.len(), n * n_in, "quantize_acts: x length");
    let n_pad = n_in.div_ceil(256) * 256;
    let nbp = n_pad / 32;
    let mut q1p = vec![0i8; n * n_pad];
    let mut d = vec![0f32; n * nbp];
    let mut sums = vec![0i32; n * nbp];
    let row = |t: usize, p1row: &mut [i8], drow: &mut [f32], srow: &mut [i32]| {
        quantize_row_isa(isa, &x[t * n_in..(t + 1) * n_in], p1row, drow, srow)
    };
    if n == 1 {
        // one row (decode): no parallel region
        row(0, &mut q1p, &mut d, &mut sums);
    } else if n > 1 && n_pad > 0 {
        // (zero-width rows have nothing to write, and no chunks to cut)
        par::for_each_chunk_mut3(
            &mut q1p,
            n_pad,
            &mut d,
            nbp,
            &mut sums,
            nbp,
            1,
            |t, p1row, drow, srow| row(t, p1row, drow, srow),
        );
    }
    QuantActs {
        n,
        n_in,
        n_pad,
        qs: OnceLock::new(),
        qp: OnceLock::new(),
        q1p,
        d,
        sums,
        x: x.to_vec(),
    }
}

/// One row of [`quantize_acts`]: `xr` (`n_in` f32, a multiple of 32) into its `q1p` codes
/// (`p1row`: `n_pad` bytes, zero on entry), block scales and code sums (`n_pad / 32` each, zero
/// on entry; the padding blocks stay zero).
pub fn quantize_row_isa(
    isa: Isa,
    xr: &[f32],
    p1row: &mut [i8],
    drow: &mut [f32],
    srow: &mut [i32],
) {
    let n_in = xr.len();
    let n_pad = p1row.len();
    assert!(n_in % 32 == 0 && n_pad % 256 == 0 && n_in <= n_pad && n_pad - n_in < 256);
    assert!(drow.len() == n_pad / 32 && srow.len() == n_pad / 32);
    if isa.avx2() {
        check_isa(isa);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 + FMA verified by `check_isa`; the lengths are checked above.
        unsafe {
            crate::avx2::quantize_row(xr, p1row, drow, srow)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!()
    } else {
        for b in 0..n_in / 32 {
            let xb = &xr[32 * b..32 * b + 32];
            let amax = xb.iter().fold(0f32, |m, &v| m.max(v.abs()));
            let db = amax / 127.0;
            let id = if db != 0.0 { 1.0 / db } else { 0.0 };
            let mut s = 0i32;
            for (j, &v) in xb.iter().enumerate() {
                let q = round_to_i8(v * id);
                p1row[q1p_pos(n_pad, 32 * b + j)] = q;
                s += q as i32;
            }
            drow[b] = db;
            srow[b] = s;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Matmul
// ---------------------------------------------------------------------------------------------

/// Weight rows per parallel task (does not affect results).
const ROWS_PER_TASK: usize = 16;

/// `y[t, o] = Σ_i W[o, i] · x[t, i]` for `n` activation rows. Low-bit weights use int8 activations
/// (see the module doc); other types use f32 activations.
pub fn matmul(
    w: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    matmul_isa(active_isa(), w, qt, n_in, n_out, x, n, y)
}

/// [`matmul`] with an explicit ISA (tests compare ISAs for exact equality).
pub fn matmul_isa(
    isa: Isa,
    w: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    assert_eq!(x.len(), n * n_in, "matmul: x length");
    if qt.is_lowbit() {
        let xq = quantize_acts(x, n, n_in);
        matmul_q_isa(isa, w, qt, n_in, n_out, &xq, y);
    } else {
        matmul_f32acts(isa, w, qt, n_in, n_out, x, n, y);
    }
}

/// Matmul with pre-quantized activations, so one quantization serves several matrices.
pub fn matmul_q(w: &[u8], qt: QuantType, n_in: usize, n_out: usize, xq: &QuantActs, y: &mut [f32]) {
    matmul_q_isa(active_isa(), w, qt, n_in, n_out, xq, y)
}

/// [`matmul_q`] with an explicit ISA.
pub fn matmul_q_isa(
    isa: Isa,
    w: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    xq: &QuantActs,
    y: &mut [f32],
) {
    check_isa(isa);
    assert_eq!(xq.n_in, n_in, "matmul_q: activation width");
    if !qt.is_lowbit() {
        return matmul_f32acts(isa, w, qt, n_in, n_out, &xq.x, xq.n, y);
    }
    matmul_lowbit(isa, w, qt, false, n_in, n_out, xq, y)
}

/// True when this CPU runs matrices of `qt` in a mask layout ([`crate::q1m`] for Q1_0,
/// [`crate::q2m`] for the Q2 types): the active ISA is AVX2 or AVX-512. A backend that packs a
/// matrix with `q1m::pack_into` / `q2m::pack_into` (when that succeeds) then multiplies with
/// [`matmul_masked`].
pub fn mask_layout_available(qt: QuantType) -> bool {
    (qt == QuantType::Q1_0 || crate::q2m::supports(qt)) && active_isa().avx2()
}

/// [`matmul_q`] for a matrix of `qt` in its mask layout (`wm` from [`crate::q1m::pack`] or
/// [`crate::q2m::pack`]): the same results bit for bit as [`matmul_q`] on the file bytes. Needs
/// [`mask_layout_available`].
pub fn matmul_masked(
    wm: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    xq: &QuantActs,
    y: &mut [f32],
) {
    matmul_masked_isa(active_isa(), wm, qt, n_in, n_out, xq, y)
}

/// [`matmul_masked`] with an explicit ISA: AVX2 or AVX-512.
pub fn matmul_masked_isa(
    isa: Isa,
    wm: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    xq: &QuantActs,
    y: &mut [f32],
) {
    assert_mask_layout(isa, qt);
    assert_eq!(xq.n_in, n_in, "matmul_masked: activation width");
    matmul_lowbit(isa, wm, qt, true, n_in, n_out, xq, y)
}

/// A matrix of `qt` in its mask layout can be multiplied on `isa` ([`matmul_masked`]'s checks).
fn assert_mask_layout(isa: Isa, qt: QuantType) {
    assert!(
        qt == QuantType::Q1_0 || crate::q2m::supports(qt),
        "matmul_masked: no mask layout for {qt:?}"
    );
    assert!(
        isa.avx2() && isa_supported(isa),
        "the mask layouts need AVX2 or AVX-512 ({isa:?} here)"
    );
}

/// Derive the code orders of `xq` that the low-bit kernels on `isa` will read, once, before a
/// parallel region: the natural order for the scalar kernels, the Q2 file-layout order when a
/// Q2 matrix in the file layout (`file_q2`) is to be read. (The SIMD kernels of Q1_0 and of the
/// mask layouts read `q1p`, which the quantizer writes.)
fn derive_code_orders(isa: Isa, xq: &QuantActs, file_q2: bool) {
    if isa == Isa::Scalar {
        xq.qs();
    } else if file_q2 {
        xq.qp();
    }
}

/// One matrix of [`matmul_q_many`]: its rows (`masks`: in its mask layout, as
/// [`matmul_masked`] takes them; else the file's bytes, as [`matmul_q`]), and its output.
pub struct MatQ<'a> {
    pub w: &'a [u8],
    pub qt: QuantType,
    pub masks: bool,
    pub n_out: usize,
    /// `[n, n_out]`
    pub y: &'a mut [f32],
}

/// Several matrices with one input, `xq`: each [`MatQ`] gets what [`matmul_q`] (or
/// [`matmul_masked`]) gives, bit for bit. With one activation row and low-bit matrices only (a
/// decode step's projections) every matrix's row chunks run in one parallel loop instead of a
/// loop each: fewer loops, and the small matrices (the GDN gates' 48 rows) share the big ones'.
pub fn matmul_q_many(mats: &mut [MatQ], xq: &QuantActs) {
    matmul_q_many_isa(active_isa(), mats, xq)
}

/// [`matmul_q_many`] with an explicit ISA.
pub fn matmul_q_many_isa(isa: Isa, mats: &mut [MatQ], xq: &QuantActs) {
    check_isa(isa);
    let one_loop = xq.n == 1 && mats.iter().all(|m| m.qt.is_lowbit());
    if !one_loop {
        for m in mats.iter_mut() {
            if m.masks {
                matmul_masked_isa(isa, m.w, m.qt, xq.n_in, m.n_out, xq, m.y);
            } else {
                matmul_q_isa(isa, m.w, m.qt, xq.n_in, m.n_out, xq, m.y);
            }
        }
        return;
    }
    // matmul_masked's and matmul_lowbit's checks, per matrix
    let mut first = Vec::with_capacity(mats.len() + 1); // first[i]: matrix i's first chunk
    first.push(0usize);
    for m in mats.iter() {
        if m.masks {
            assert_mask_layout(isa, m.qt);
        }
        let rb =
            m.qt.row_bytes(xq.n_in)
                .expect("matmul: n_in is not a whole number of blocks");
        assert_eq!(m.w.len(), rb * m.n_out, "matmul: weight bytes");
        assert_eq!(m.y.len(), m.n_out, "matmul: y length");
        first.push(first.last().copied().unwrap_or(0) + m.n_out.div_ceil(ROWS_PER_TASK));
    }
    derive_code_orders(isa, xq, mats.iter().any(|m| !m.masks && m.qt.is_q2()));
    let outs: Vec<DisjointOut> = mats
        .iter_mut()
        .map(|m| DisjointOut(m.y.as_mut_ptr()))
        .collect();
    let (mats, outs, first) = (&*mats, &outs, &first);
    par::for_each_index(first[mats.len()], 0, |g| {
        let i = first.partition_point(|&f| f <= g) - 1; // the matrix of chunk g
        let m = &mats[i];
        let o0 = (g - first[i]) * ROWS_PER_TASK;
        let rows = ROWS_PER_TASK.min(m.n_out - o0);
        let rb = m.w.len() / m.n_out;
        // SAFETY: o0 + rows ≤ n_out = the length of matrix i's output (asserted above); chunk g
        // alone writes rows o0..o0 + rows of it, and the outputs outlive the loop.
        let yc = unsafe { std::slice::from_raw_parts_mut(outs[i].0.add(o0), rows) };
        lowbit_rows_one_act(isa, m.qt, m.masks, &m.w[o0 * rb..(o0 + rows) * rb], xq, yc);
    });
}

/// Mask-layout kinds, the SIMD kernels' const parameter: Q1_0 ([`crate::q1m`]), Q2 g128 / PQ2_0
/// and Q2 g64 ([`crate::q2m`]).
pub(crate) const MK_Q1: u8 = 0;
pub(crate) const MK_Q2G128: u8 = 1;
pub(crate) const MK_Q2G64: u8 = 2;

/// `$body` with the const `$M` bound to the mask-layout kind of `$qt`: one arm, and so one
/// monomorphized body, per kind (the SIMD kernels' dispatch).
macro_rules! with_mask_kind {
    ($qt:expr, $M:ident => $body:expr) => {
        match $crate::ops::mask_kind($qt) {
            $crate::ops::MK_Q1 => {
                const $M: u8 = $crate::ops::MK_Q1;
                $body
            }
            $crate::ops::MK_Q2G128 => {
                const $M: u8 = $crate::ops::MK_Q2G128;
                $body
            }
            _ => {
                const $M: u8 = $crate::ops::MK_Q2G64;
                $body
            }
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use with_mask_kind;

/// The mask-layout kind of `qt` (Q1_0 or a Q2 type).
#[inline]
pub(crate) fn mask_kind(qt: QuantType) -> u8 {
    match qt {
        QuantType::Q1_0 => MK_Q1,
        QuantType::Q2_0G64 => MK_Q2G64,
        QuantType::Q2_0G128 | QuantType::PQ2_0 => MK_Q2G128,
        _ => panic!("no mask layout for {qt:?}"),
    }
}

/// A type of kind `m` (PQ2_0 and Q2_0 g128 share their bytes and kernels).
#[inline]
pub(crate) const fn mk_type(m: u8) -> QuantType {
    match m {
        MK_Q1 => QuantType::Q1_0,
        MK_Q2G128 => QuantType::Q2_0G128,
        _ => QuantType::Q2_0G64,
    }
}

/// Bytes of one 512-element pair of kind `m`: 4 Q1_0 blocks (72), 4 g128 blocks (136) or 8 g64
/// blocks (144).
#[inline]
pub(crate) const fn mk_pair_bytes(m: u8) -> usize {
    match m {
        MK_Q1 => 72,
        MK_Q2G128 => 136,
        _ => 144,
    }
}

/// The low-bit matmul of [`matmul_q_isa`]; `masks`: rows in `qt`'s mask layout (AVX2 / AVX-512).
#[allow(clippy::too_many_arguments)]
fn matmul_lowbit(
    isa: Isa,
    w: &[u8],
    qt: QuantType,
    masks: bool,
    n_in: usize,
    n_out: usize,
    xq: &QuantActs,
    y: &mut [f32],
) {
    assert!(!masks || (isa.avx2() && (qt == QuantType::Q1_0 || crate::q2m::supports(qt))));
    let rb = qt
        .row_bytes(n_in)
        .expect("matmul: n_in is not a whole number of blocks");
    assert_eq!(w.len(), rb * n_out, "matmul: weight bytes");
    let n = xq.n;
    assert_eq!(y.len(), n * n_out, "matmul: y length");
    if n == 0 || n_out == 0 {
        return;
    }
    derive_code_orders(isa, xq, !masks && qt.is_q2());
    if n == 1 {
        par::for_each_chunk_mut(y, ROWS_PER_TASK, 0, |ci, yc| {
            let o0 = ci * ROWS_PER_TASK;
            let rows = &w[o0 * rb..(o0 + yc.len()) * rb];
            lowbit_rows_one_act(isa, qt, masks, rows, xq, yc);
        });
        return;
    }
    // Several activation rows: each task takes ROWS_PER_TASK weight rows and walks the activation
    // rows in groups of ACT_GROUP, so a group's int8 rows (ACT_GROUP × n_pad bytes) stay in L1/L2
    // while every weight row of the task is dotted with them (instead of each weight row
    // streaming all n activation rows), and writes its outputs straight into `y`'s columns
    // o0..o1. The order of work only, not the results.
    const ACT_GROUP: usize = 8;
    let yp = DisjointOut(y.as_mut_ptr());
    let yp = &yp;
    par::for_each_index(n_out.div_ceil(ROWS_PER_TASK), 1, |ci| {
        let (o0, o1) = (ci * ROWS_PER_TASK, ((ci + 1) * ROWS_PER_TASK).min(n_out));
        let mut tile = [0f32; ROWS_PER_TASK * ACT_GROUP]; // tile: [rows, group]
        for tb in (0..n).step_by(ACT_GROUP) {
            let g = (n - tb).min(ACT_GROUP);
            let mut o = o0;
            while o < o1 {
                let out = &mut tile[(o - o0) * ACT_GROUP..];
                if o + 1 < o1 {
                    let (a, b) = out.split_at_mut(ACT_GROUP);
                    let rows = &w[o * rb..(o + 2) * rb];
                    lowbit_row_pair(isa, qt, masks, rows, xq, tb, &mut a[..g], &mut b[..g]);
                    o += 2;
                } else {
                    let row = &w[o * rb..(o + 1) * rb];
                    lowbit_row(isa, qt, masks, row, xq, tb, &mut out[..g]);
                    o += 1;
                }
            }
            for t in tb..tb + g {
                for o in o0..o1 {
                    // SAFETY: t < n and o < n_out, so the index is inside `y` (length
                    // n · n_out, asserted above); only this task writes columns o0..o1, so
                    // no two tasks write the same element, and `y` outlives the parallel loop.
                    unsafe { *yp.0.add(t * n_out + o) = tile[(o - o0) * ACT_GROUP + t - tb] };
                }
            }
        }
    });
}

/// `y`'s base pointer shared by tasks that write disjoint elements (see its use).
struct DisjointOut(*mut f32);
// SAFETY: the tasks sharing it write disjoint elements of one live buffer and never read it.
unsafe impl Sync for DisjointOut {}

/// [`dequantize_row`] with SIMD for the 32-element block types (Q4_0, Q4_1, Q8_0: the drafter's
/// and other f32-activation matrices); the same bits.
pub fn dequantize_row_isa(isa: Isa, qt: QuantType, src: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        check_isa(isa);
        // SAFETY: AVX2+F16C verified by `check_isa`; the kernel checks that `src` is exactly the
        // row's bytes before it reads them (and `dequantize_row` below checks the other types).
        if unsafe { crate::avx2::dequantize_row_q32(qt, src, out) } {
            return;
        }
    }
    dequantize_row(qt, src, out)
}

/// `dst[t, o] = src[o, t]`.
fn transpose_into(
    src: &[f32], /* [n_out, n] */
    n_out: usize,
    n: usize,
    dst: &mut [f32], /* [n, n_out] */
) {
    for t in 0..n {
        let row = &mut dst[t * n_out..(t + 1) * n_out];
        for (o, v) in row.iter_mut().enumerate() {
            *v = src[o * n + t];
        }
    }
}

/// `out.len()` consecutive whole weight rows against activation row 0 of `xq`: `out[r]`.
fn lowbit_rows_one_act(
    isa: Isa,
    qt: QuantType,
    masks: bool,
    rows: &[u8],
    xq: &QuantActs,
    out: &mut [f32],
) {
    assert!(xq.n >= 1, "lowbit_rows_one_act: no activation row");
    let rb = qt.row_bytes(xq.n_in).expect("whole blocks");
    assert_eq!(
        rows.len(),
        rb * out.len(),
        "lowbit_rows_one_act: weight bytes"
    );
    match isa {
        Isa::Scalar => {
            for (r, o) in out.iter_mut().enumerate() {
                *o = lowbit_dot_scalar(qt, &rows[r * rb..(r + 1) * rb], xq, 0);
            }
        }
        Isa::Avx2 => {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `check_isa` verified AVX2+FMA+F16C; `rows` is out.len() whole rows (above).
            unsafe {
                if masks {
                    crate::avx2::mask_rows_one_act(qt, rows, xq, out)
                } else {
                    crate::avx2::lowbit_rows_one_act(qt, rows, xq, out)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
        Isa::Avx512 => {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `check_isa` verified AVX2+FMA+F16C and AVX-512 F/BW/VL/VNNI/BITALG; `rows` is
            // out.len() whole rows (above).
            unsafe {
                if masks {
                    crate::avx512::mask_rows_one_act(qt, rows, xq, out)
                } else {
                    crate::avx512::lowbit_rows_one_act(qt, rows, xq, out)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

/// Two consecutive weight rows (`rows`: both, whole) against activation rows
/// `t_begin..t_begin + g` of `xq`: `out0[i]`, `out1[i]` (length g each). AVX-512 runs both rows in
/// one pass over the activations; the other ISAs run them one after the other. Same results as
/// two [`lowbit_row`] calls either way.
#[allow(clippy::too_many_arguments)]
fn lowbit_row_pair(
    isa: Isa,
    qt: QuantType,
    masks: bool,
    rows: &[u8],
    xq: &QuantActs,
    t_begin: usize,
    out0: &mut [f32],
    out1: &mut [f32],
) {
    let rb = rows.len() / 2;
    let (w0, w1) = rows.split_at(rb);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            assert!(t_begin + out0.len() <= xq.n && out0.len() == out1.len());
            // SAFETY: `check_isa` verified AVX2+FMA+F16C and AVX-512 F/BW/VL/VNNI/BITALG; the
            // kernel asserts that both rows are whole rows of `qt` and the activation rows exist.
            unsafe {
                if masks {
                    crate::avx512::mask_rows::<2>(qt, [w0, w1], xq, t_begin, [out0, out1])
                } else {
                    crate::avx512::lowbit_rows::<2>(qt, [w0, w1], xq, t_begin, [out0, out1])
                }
            }
        }
        _ => {
            lowbit_row(isa, qt, masks, w0, xq, t_begin, out0);
            lowbit_row(isa, qt, masks, w1, xq, t_begin, out1);
        }
    }
}

/// One weight row against activation rows `t_begin..t_begin + out.len()` of `xq`: `out[i]` is
/// row `t_begin + i`.
fn lowbit_row(
    isa: Isa,
    qt: QuantType,
    masks: bool,
    wrow: &[u8],
    xq: &QuantActs,
    t_begin: usize,
    out: &mut [f32],
) {
    assert!(t_begin + out.len() <= xq.n, "lowbit_row: activation rows");
    match isa {
        Isa::Scalar => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = lowbit_dot_scalar(qt, wrow, xq, t_begin + i);
            }
        }
        Isa::Avx2 => {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `check_isa` verified AVX2+FMA+F16C; `wrow` is one whole row of `qt` for
            // `xq.n_in` elements (asserted by the caller) and the rows are inside `xq` (above).
            unsafe {
                if masks {
                    crate::avx2::mask_row(qt, wrow, xq, t_begin, out)
                } else {
                    crate::avx2::lowbit_row(qt, wrow, xq, t_begin, out)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
        Isa::Avx512 => {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `check_isa` verified AVX2+FMA+F16C and AVX-512 F/BW/VL/VNNI/BITALG; `wrow` is
            // one whole row of `qt` for `xq.n_in` elements and the rows are inside `xq` (above).
            unsafe {
                if masks {
                    crate::avx512::mask_rows::<1>(qt, [wrow], xq, t_begin, [out])
                } else {
                    crate::avx512::lowbit_rows::<1>(qt, [wrow], xq, t_begin, [out])
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Weight scale of the weight block holding 32-element activation block `b`.
#[inline]
pub(crate) fn wscale(qt: QuantType, wrow: &[u8], b: usize) -> f32 {
    let wb = b * 32 / qt.block_elems();
    f16_at(wrow, wb * qt.block_bytes())
}

/// Exact integer dot of activation block `b` of row `t` with the matching 32 weight codes.
pub(crate) fn lowbit_isum(qt: QuantType, wrow: &[u8], xq: &QuantActs, t: usize, b: usize) -> i32 {
    let be = qt.block_elems();
    let bb = qt.block_bytes();
    let e0 = b * 32;
    let blk = &wrow[(e0 / be) * bb..(e0 / be + 1) * bb];
    let off = e0 % be; // element offset of this 32-run inside the weight block
    let q = &xq.qs()[t * xq.n_pad + e0..t * xq.n_pad + e0 + 32];
    let mut s = 0i32;
    match qt {
        QuantType::Q1_0 => {
            for j in 0..32 {
                let e = off + j;
                let bit = (blk[2 + (e >> 3)] >> (e & 7)) & 1;
                s += if bit != 0 {
                    q[j] as i32
                } else {
                    -(q[j] as i32)
                };
            }
        }
        _ => {
            debug_assert!(qt.is_q2());
            for j in 0..32 {
                let e = off + j;
                let c = (blk[2 + (e >> 2)] >> (2 * (e & 3))) & 3;
                s += (c as i32 - 1) * q[j] as i32;
            }
        }
    }
    s
}

/// Fixed 8-lane reduction shared by every path: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let t = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// The scalar definition of the low-bit dot (module doc).
fn lowbit_dot_scalar(qt: QuantType, wrow: &[u8], xq: &QuantActs, t: usize) -> f32 {
    let nb = xq.n_in / 32;
    let nbp = xq.n_pad / 32;
    let da = &xq.d[t * nbp..(t + 1) * nbp];
    let mut acc = [0f32; 8];
    for c in 0..nbp / 8 {
        for l in 0..8 {
            let b = 8 * c + l;
            let (is, sc) = if b < nb {
                (lowbit_isum(qt, wrow, xq, t, b), wscale(qt, wrow, b) * da[b])
            } else {
                (0, 0.0)
            };
            acc[l] = (is as f32).mul_add(sc, acc[l]);
        }
    }
    hsum8(&acc)
}

fn matmul_f32acts(
    isa: Isa,
    w: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    check_isa(isa);
    let rb = qt
        .row_bytes(n_in)
        .expect("matmul: n_in is not a whole number of blocks");
    assert_eq!(w.len(), rb * n_out, "matmul: weight bytes");
    assert_eq!(x.len(), n * n_in);
    assert_eq!(y.len(), n * n_out, "matmul: y length");
    if n == 0 || n_out == 0 {
        return;
    }
    let task = |o0: usize, buf: &mut Vec<f32>, yt: &mut [f32]| {
        // buf: [n_in] one dequantized weight row; yt: [rows, n]
        for (r, yo) in yt.chunks_exact_mut(n).enumerate() {
            let o = o0 + r;
            #[cfg(target_arch = "x86_64")]
            if isa.avx2() && fused_rows(isa, qt, &w[o * rb..(o + 1) * rb], x, n_in, yo) {
                continue;
            }
            dequantize_row_isa(isa, qt, &w[o * rb..(o + 1) * rb], buf);
            for (t, v) in yo.iter_mut().enumerate() {
                *v = dot_f32_isa(isa, buf, &x[t * n_in..(t + 1) * n_in]);
            }
        }
    };
    // buf: one dequantized row per task (a task is ROWS_PER_TASK rows of every activation row)
    let run = |ci: usize, yc: &mut [f32]| task(ci * ROWS_PER_TASK, &mut vec![0f32; n_in], yc);
    if n == 1 {
        par::for_each_chunk_mut(y, ROWS_PER_TASK, 0, run);
    } else {
        let mut yt = vec![0f32; n_out * n]; // yt: [n_out, n]
        par::for_each_chunk_mut(&mut yt, ROWS_PER_TASK * n, 0, run);
        transpose_into(&yt, n_out, n, y);
    }
}

/// One weight row of `qt` (`wrow`) against every activation row of `x` ([n, n_in]) into `yo` ([n])
/// without the dequantized row in memory: each 32-element step of the row is dequantized once into
/// registers for 4 activation rows on 512-bit vectors (AVX-512: `avx512::dot_q32_rows_512`) or 2
/// on 256-bit ones (AVX2: `avx2::dot_q32_rows`), each result `dot_f32(dequantize_row(wrow), x[t])`
/// bit for bit. False (nothing written) for a type or row length those kernels do not take. The
/// caller has checked the ISA's CPU features (`check_isa`).
#[cfg(target_arch = "x86_64")]
fn fused_rows(
    isa: Isa,
    qt: QuantType,
    wrow: &[u8],
    x: &[f32],
    n_in: usize,
    yo: &mut [f32],
) -> bool {
    use crate::avx2::dot_q32_rows;
    use crate::avx512::dot_q32_rows_512;
    let row = |t: usize| &x[t * n_in..(t + 1) * n_in];
    let wide = isa == Isa::Avx512;
    let mut t = 0;
    // SAFETY (every call below): the caller checked the CPU features (AVX-512 F/BW/VL with
    // `wide`); `wrow` is one row of `n_in` elements of `qt` (the kernels assert it) and the rows
    // exist.
    while wide && t + 4 <= yo.len() {
        let r = [row(t), row(t + 1), row(t + 2), row(t + 3)];
        let Some(v) = (unsafe { dot_q32_rows_512::<4>(qt, wrow, r) }) else {
            return false;
        };
        yo[t..t + 4].copy_from_slice(&v);
        t += 4;
    }
    while t + 2 <= yo.len() {
        let r = [row(t), row(t + 1)];
        let v = if wide {
            unsafe { dot_q32_rows_512::<2>(qt, wrow, r) }
        } else {
            unsafe { dot_q32_rows::<2>(qt, wrow, r) }
        };
        let Some(v) = v else {
            return false;
        };
        yo[t..t + 2].copy_from_slice(&v);
        t += 2;
    }
    if t < yo.len() {
        let r = [row(t)];
        let v = if wide {
            unsafe { dot_q32_rows_512::<1>(qt, wrow, r) }
        } else {
            unsafe { dot_q32_rows::<1>(qt, wrow, r) }
        };
        let Some([v]) = v else {
            return false;
        };
        yo[t] = v;
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Vector primitives (exact across ISAs)
// ---------------------------------------------------------------------------------------------

/// `Σ a[i]·b[i]` with a fixed order: 4 accumulators × 8 lanes over 32-element steps (FMA), then
/// 8-element steps into accumulator 0, combined `(acc0+acc1)+(acc2+acc3)`, reduced by the fixed
/// 8-lane tree, then the < 8 tail elements by sequential FMA.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_isa(active_isa(), a, b)
}

/// [`dot_f32`] with an explicit ISA.
/// `dst[i] = src[i] as f32` (exact). SIMD where available; the KV cache's f16 rows go through this.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    f16_to_f32_isa(active_isa(), src, dst)
}

pub fn f16_to_f32_isa(isa: Isa, src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32: lengths");
    match isa {
        Isa::Scalar => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
        Isa::Avx2 | Isa::Avx512 => {
            check_isa(isa);
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: f16 is a transparent u16 (half's documented repr), so the slice cast
                // keeps length and alignment.
                let bits: &[u16] =
                    unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u16, src.len()) };
                // SAFETY: AVX2+F16C verified by `check_isa`; lengths are equal.
                unsafe { crate::avx2::f16_to_f32(bits, dst) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

pub fn dot_f32_isa(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: lengths");
    match isa {
        Isa::Scalar => dot_scalar(a, b),
        Isa::Avx2 | Isa::Avx512 => {
            check_isa(isa);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2+FMA verified by `check_isa`; lengths are equal.
            unsafe {
                crate::avx2::dot(a, b)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    }
}

fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let mut acc = [[0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= n {
        for k in 0..4 {
            for l in 0..8 {
                acc[k][l] = a[i + 8 * k + l].mul_add(b[i + 8 * k + l], acc[k][l]);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        for l in 0..8 {
            acc[0][l] = a[i + l].mul_add(b[i + l], acc[0][l]);
        }
        i += 8;
    }
    let mut v = [0f32; 8];
    for l in 0..8 {
        v[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    let mut r = hsum8(&v);
    while i < n {
        r = a[i].mul_add(b[i], r);
        i += 1;
    }
    r
}

/// `y[j] = fma(alpha, x[j], y[j])`.
fn axpy(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers only pass an AVX2 ISA after `check_isa`; lengths are equal.
        Isa::Avx2 | Isa::Avx512 => unsafe { crate::avx2::axpy(alpha, x, y) },
        _ => {
            for (yv, &xv) in y.iter_mut().zip(x) {
                *yv = alpha.mul_add(xv, *yv);
            }
        }
    }
}

/// `y[j] = fma(alpha, x[j], y[j] · s)`.
fn scale_axpy(isa: Isa, s: f32, alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers only pass an AVX2 ISA after `check_isa`; lengths are equal.
        Isa::Avx2 | Isa::Avx512 => unsafe { crate::avx2::scale_axpy(s, alpha, x, y) },
        _ => {
            for (yv, &xv) in y.iter_mut().zip(x) {
                *yv = alpha.mul_add(xv, *yv * s);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Gated DeltaNet
// ---------------------------------------------------------------------------------------------

/// Same contract as [`crate::reference::gdn_step`], parallel over v-heads. Per head:
/// `u = exp(g)·(S_oldᵀk)`, `δ = β(v − u)`, then one fused pass `S[i,:] = exp(g)·S[i,:] + k[i]·δ`,
/// `o += q[i]·S[i,:]`, finally `o *= 1/√d_k`.
pub fn gdn_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    h_k: usize,
    d_k: usize,
    d_v: usize,
    out: &mut [f32],
) {
    gdn_step_isa(active_isa(), s, q, k, v, g, beta, h_k, d_k, d_v, out)
}

/// [`gdn_step`] with an explicit ISA.
pub fn gdn_step_isa(
    isa: Isa,
    s: &mut [f32], // [h_v, d_k, d_v]
    q: &[f32],     // [h_k, d_k]
    k: &[f32],     // [h_k, d_k]
    v: &[f32],     // [h_v, d_v]
    g: &[f32],     // [h_v]
    beta: &[f32],  // [h_v]
    h_k: usize,
    d_k: usize,
    d_v: usize,
    out: &mut [f32], // [h_v, d_v]
) {
    check_isa(isa);
    let h_v = g.len();
    assert_eq!(s.len(), h_v * d_k * d_v);
    assert_eq!(q.len(), h_k * d_k);
    assert_eq!(k.len(), h_k * d_k);
    assert_eq!(v.len(), h_v * d_v);
    assert_eq!(beta.len(), h_v);
    assert_eq!(out.len(), h_v * d_v);
    if h_v == 0 || d_v == 0 || d_k == 0 {
        return;
    }
    let scale = 1.0 / (d_k as f32).sqrt();
    par::for_each_chunk_mut2(s, d_k * d_v, out, d_v, 1, |h, sh, oh| {
        let kap = h % h_k;
        let kh = &k[kap * d_k..(kap + 1) * d_k];
        let qh = &q[kap * d_k..(kap + 1) * d_k];
        let vh = &v[h * d_v..(h + 1) * d_v];
        head_step(isa, sh, qh, kh, vh, g[h], beta[h], d_k, d_v, scale, oh);
    });
}

/// One head of the delta rule. sh: [d_k, d_v]; oh: [d_v].
fn head_step(
    isa: Isa,
    sh: &mut [f32],
    qh: &[f32],
    kh: &[f32],
    vh: &[f32],
    g: f32,
    beta: f32,
    d_k: usize,
    d_v: usize,
    scale: f32,
    oh: &mut [f32],
) {
    let decay = g.exp();
    let mut delta = vec![0f32; d_v]; // delta: [d_v], first holds S_oldᵀk
    for i in 0..d_k {
        axpy(isa, kh[i], &sh[i * d_v..(i + 1) * d_v], &mut delta);
    }
    for j in 0..d_v {
        delta[j] = beta * (vh[j] - decay * delta[j]);
    }
    oh.fill(0.0);
    for i in 0..d_k {
        let row = &mut sh[i * d_v..(i + 1) * d_v];
        scale_axpy(isa, decay, kh[i], &delta, row);
        axpy(isa, qh[i], row, oh);
    }
    for o in oh.iter_mut() {
        *o *= scale;
    }
}

/// Same contract as [`crate::reference::gdn_chunked`] (MODEL.md §3.3), parallel over v-heads.
pub fn gdn_chunked(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    t: usize,
    h_k: usize,
    d_k: usize,
    d_v: usize,
    chunk: usize,
    out: &mut [f32],
) {
    gdn_chunked_isa(
        active_isa(),
        s,
        q,
        k,
        v,
        g,
        beta,
        t,
        h_k,
        d_k,
        d_v,
        chunk,
        out,
    )
}

/// [`gdn_chunked`] with an explicit ISA.
pub fn gdn_chunked_isa(
    isa: Isa,
    s: &mut [f32], // [h_v, d_k, d_v]
    q: &[f32],     // [T, h_k, d_k] l2-normed (unscaled)
    k: &[f32],     // [T, h_k, d_k]
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
    check_isa(isa);
    assert!(chunk >= 1);
    if t == 0 || d_k == 0 || d_v == 0 {
        return;
    }
    let h_v = g.len() / t;
    assert_eq!(s.len(), h_v * d_k * d_v);
    assert_eq!(q.len(), t * h_k * d_k);
    assert_eq!(k.len(), t * h_k * d_k);
    assert_eq!(v.len(), t * h_v * d_v);
    assert_eq!(g.len(), t * h_v);
    assert_eq!(beta.len(), t * h_v);
    assert_eq!(out.len(), t * h_v * d_v);
    let scale = 1.0 / (d_k as f32).sqrt();
    // per-head outputs oh: [h_v][T, d_v], scattered into out afterwards
    let mut oh_all = vec![0f32; h_v * t * d_v];
    par::for_each_chunk_mut2(s, d_k * d_v, &mut oh_all, t * d_v, 1, |h, sh, oh| {
        let kap = h % h_k;
        let mut c0 = 0;
        while c0 < t {
            let l = chunk.min(t - c0);
            chunk_head(
                isa, sh, oh, q, k, v, g, beta, c0, l, h, kap, h_v, h_k, d_k, d_v, scale,
            );
            c0 += l;
        }
    });
    for h in 0..h_v {
        for r in 0..t {
            out[(r * h_v + h) * d_v..(r * h_v + h + 1) * d_v]
                .copy_from_slice(&oh_all[(h * t + r) * d_v..(h * t + r + 1) * d_v]);
        }
    }
}

/// One chunk of `l` rows starting at `c0` for v-head `h` (k-head `kap`). sh: [d_k, d_v]; oh: [T, d_v].
fn chunk_head(
    isa: Isa,
    sh: &mut [f32],
    oh: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    c0: usize,
    l: usize,
    h: usize,
    kap: usize,
    h_v: usize,
    h_k: usize,
    d_k: usize,
    d_v: usize,
    scale: f32,
) {
    let krow = |r: usize| &k[((c0 + r) * h_k + kap) * d_k..((c0 + r) * h_k + kap + 1) * d_k];
    let vrow = |r: usize| &v[((c0 + r) * h_v + h) * d_v..((c0 + r) * h_v + h + 1) * d_v];
    // qs: [l, d_k] scaled queries
    let mut qs = vec![0f32; l * d_k];
    for r in 0..l {
        let src = &q[((c0 + r) * h_k + kap) * d_k..((c0 + r) * h_k + kap + 1) * d_k];
        for i in 0..d_k {
            qs[r * d_k + i] = src[i] * scale;
        }
    }
    let bt: Vec<f32> = (0..l).map(|r| beta[(c0 + r) * h_v + h]).collect(); // [l]
    let mut gamma = vec![0f32; l]; // [l] cumulative log decay
    let mut cum = 0f32;
    for r in 0..l {
        cum += g[(c0 + r) * h_v + h];
        gamma[r] = cum;
    }
    // a: [l, l] strictly lower β_r (k_r·k_c) e^{γ_r−γ_c};  qk: [l, l] lower incl. diag (q_r·k_c) e^{γ_r−γ_c}
    let mut a = vec![0f32; l * l];
    let mut qk = vec![0f32; l * l];
    for r in 0..l {
        for c in 0..=r {
            let dec = (gamma[r] - gamma[c]).exp();
            if c < r {
                a[r * l + c] = bt[r] * dot_f32_isa(isa, krow(r), krow(c)) * dec;
            }
            qk[r * l + c] = dot_f32_isa(isa, &qs[r * d_k..(r + 1) * d_k], krow(c)) * dec;
        }
    }
    // vp: [l, d_v] = T·βv − (T·(βk e^γ))·S, built row by row: vp_r = βv_r − (βk_r e^{γ_r})·S − Σ_{c<r} a[r,c] vp_c
    // (forward substitution on (I+A)·V' = βv − (βk e^γ)·S, identical to U − W·S)
    let mut vp = vec![0f32; l * d_v];
    for r in 0..l {
        let (done, rest) = vp.split_at_mut(r * d_v);
        let row = &mut rest[..d_v];
        let kr = krow(r);
        let vr = vrow(r);
        let eg = gamma[r].exp();
        for j in 0..d_v {
            row[j] = bt[r] * vr[j];
        }
        for i in 0..d_k {
            axpy(isa, -bt[r] * kr[i] * eg, &sh[i * d_v..(i + 1) * d_v], row);
        }
        for c in 0..r {
            axpy(isa, -a[r * l + c], &done[c * d_v..(c + 1) * d_v], row);
        }
    }
    // O_r = e^{γ_r}·(q_r·S) + Σ_{c≤r} qk[r,c]·vp_c
    for r in 0..l {
        let orow = &mut oh[(c0 + r) * d_v..(c0 + r + 1) * d_v];
        orow.fill(0.0);
        let eg = gamma[r].exp();
        for i in 0..d_k {
            axpy(isa, qs[r * d_k + i] * eg, &sh[i * d_v..(i + 1) * d_v], orow);
        }
        for c in 0..=r {
            axpy(isa, qk[r * l + c], &vp[c * d_v..(c + 1) * d_v], orow);
        }
    }
    // S ← e^{γ_last}·S + Σ_r (k_r e^{γ_last−γ_r}) vp_rᵀ
    let gl = gamma[l - 1];
    let egl = gl.exp();
    let wr: Vec<f32> = (0..l).map(|r| (gl - gamma[r]).exp()).collect(); // [l]
    for i in 0..d_k {
        let row = &mut sh[i * d_v..(i + 1) * d_v];
        for x in row.iter_mut() {
            *x *= egl;
        }
        for r in 0..l {
            axpy(isa, krow(r)[i] * wr[r], &vp[r * d_v..(r + 1) * d_v], row);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

/// Same contract as [`crate::reference::attention`], parallel over q heads.
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    t: usize,
    n_head: usize,
    n_kv: usize,
    hd: usize,
    scale: f32,
    out: &mut [f32],
) {
    attention_isa(
        active_isa(),
        q,
        k_cache,
        v_cache,
        t,
        n_head,
        n_kv,
        hd,
        scale,
        out,
    )
}

/// [`attention`] with an explicit ISA.
pub fn attention_isa(
    isa: Isa,
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
    check_isa(isa);
    assert!(t >= 1 && n_kv >= 1 && n_head % n_kv == 0);
    assert_eq!(q.len(), n_head * hd);
    assert!(k_cache.len() >= t * n_kv * hd && v_cache.len() >= t * n_kv * hd);
    assert_eq!(out.len(), n_head * hd);
    if hd == 0 {
        return;
    }
    let group = n_head / n_kv;
    par::for_each_chunk_mut(out, hd, 1, |h, oh| {
        let kv = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut p = vec![0f32; t]; // p: [T]
        let mut m = f32::NEG_INFINITY;
        for (pos, pv) in p.iter_mut().enumerate() {
            let kr = &k_cache[(pos * n_kv + kv) * hd..(pos * n_kv + kv + 1) * hd];
            *pv = dot_f32_isa(isa, qh, kr) * scale;
            m = m.max(*pv);
        }
        let mut sum = 0f32;
        for pv in p.iter_mut() {
            *pv = (*pv - m).exp();
            sum += *pv;
        }
        oh.fill(0.0);
        for (pos, &pv) in p.iter().enumerate() {
            let vr = &v_cache[(pos * n_kv + kv) * hd..(pos * n_kv + kv + 1) * hd];
            axpy(isa, pv, vr, oh);
        }
        let inv = 1.0 / sum;
        for o in oh.iter_mut() {
            *o *= inv;
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Softmax normalizer
// ---------------------------------------------------------------------------------------------

/// `ln Σ_i exp(x_i)` over a logit row, with a vectorizable `exp` (Cody–Waite range reduction and a
/// degree-6 polynomial, relative error ≲ 2e-7 per term) and 8 f32 lane accumulators summed in a
/// fixed order, so the result is deterministic. ~10× faster than an f64 `exp` loop over a 248k
/// vocabulary, which matters once a decode step is a few milliseconds. `-inf` for an empty or
/// all-`-inf` row.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if active_isa().avx2() {
        // SAFETY: active_isa() is Avx2 or Avx512 only when the CPU has AVX2 + FMA (+ F16C).
        return unsafe { crate::avx2::log_sum_exp(x) };
    }
    log_sum_exp_scalar(x)
}

/// The portable [`log_sum_exp`] (the definition the AVX2 version matches bit for bit).
pub fn log_sum_exp_scalar(x: &[f32]) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    if max.is_nan() || max == f32::INFINITY {
        return max as f64;
    }
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] += exp_nonpos(c[l] - max);
        }
    }
    let mut tail = 0f64;
    for &v in chunks.remainder() {
        tail += exp_nonpos(v - max) as f64;
    }
    let sum = ((acc[0] as f64 + acc[4] as f64) + (acc[2] as f64 + acc[6] as f64))
        + ((acc[1] as f64 + acc[5] as f64) + (acc[3] as f64 + acc[7] as f64))
        + tail;
    max as f64 + sum.ln()
}

/// `σ(x) = 1 / (1 + e^{−x})` from the polynomial `exp` of [`log_sum_exp`] (no libm call): with
/// `t = e^{−|x|}`, `1 / (1 + t)` for `x ≥ 0` and `t / (1 + t)` otherwise. Relative error ≲ 3.4e-7
/// against the f64 [`crate::reference::sigmoid`]; the AVX2 form gives the same bits. `−87` and
/// below give exactly 0.
#[inline(always)]
pub fn sigmoid_fast(x: f32) -> f32 {
    let t = exp_nonpos(-x.abs());
    let d = 1.0 + t;
    if x >= 0.0 {
        1.0 / d
    } else {
        t / d
    }
}

/// `x · σ(x)` with [`sigmoid_fast`].
#[inline(always)]
pub fn silu_fast(x: f32) -> f32 {
    x * sigmoid_fast(x)
}

/// Which element-wise SiLU op [`silu_op_isa`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiluOp {
    /// `a[i] = silu(a[i])`; `b` unused (pass an empty slice).
    InPlace,
    /// SwiGLU: `a[i] = silu(a[i]) · b[i]` (gate in `a`, up in `b`).
    GateMulUp,
    /// Gated norm: `a[i] = a[i] · silu(b[i])` (normed values in `a`, gate `z` in `b`).
    MulByGate,
}

/// [`silu_op_isa`] on the active ISA. The element-wise SiLU ops of the forward (SwiGLU, the GDN
/// gated norm, the conv output) run through this, so every ISA, batch size and thread count gives
/// the same bits.
pub fn silu_op(op: SiluOp, a: &mut [f32], b: &[f32]) {
    silu_op_isa(active_isa(), op, a, b)
}

/// One step of the GDN's causal depthwise conv and its SiLU, in parallel over channel chunks:
/// `out[ch] = SiLU(w[ch][k−1]·x[ch] + Σ_j w[ch][j]·state[j][ch])`, the sum in f64 in
/// [`crate::reference::conv1d_step`]'s order and the SiLU [`silu_op`]'s (`InPlace`), then the
/// window slides (`state`'s oldest row out, `x` in). The same bits as those two in sequence.
pub fn conv1d_silu_step(
    state: &mut [f32], // [k-1, C] pre-conv inputs, oldest first
    x: &[f32],         // [C] this row's pre-conv input
    w: &[f32],         // [C, k] per-channel taps, tap k-1 = this row
    k: usize,
    out: &mut [f32], // [C]
) {
    conv1d_silu_step_isa(active_isa(), state, x, w, k, out)
}

/// [`conv1d_silu_step`] with an explicit ISA (for the SiLU; every ISA gives the same bits).
pub fn conv1d_silu_step_isa(
    isa: Isa,
    state: &mut [f32],
    x: &[f32],
    w: &[f32],
    k: usize,
    out: &mut [f32],
) {
    let c = x.len();
    assert!(k >= 1, "conv1d_silu_step: k ≥ 1");
    assert_eq!(state.len(), (k - 1) * c, "conv1d_silu_step: state length");
    assert_eq!(w.len(), c * k, "conv1d_silu_step: weight length");
    assert_eq!(out.len(), c, "conv1d_silu_step: out length");
    // channels per task
    const CH: usize = 512;
    // below this many channels a parallel loop costs more than it saves (a rayon region on 2
    // threads: `small` decode 389 → 313 tok/s with its ~2,000-channel convs in loops)
    const PAR_MIN: usize = 8192;
    let st = DisjointOut(state.as_mut_ptr());
    let st = &st;
    // SAFETY: `st` points at `state` ([k − 1, c]); one call of `chunk` alone reads and writes the
    // channels c0..c0 + oc.len() of every state row (the loop's chunks are disjoint), and `state`
    // outlives the loop.
    let chunk =
        |c0: usize, oc: &mut [f32]| unsafe { conv_silu_channels(isa, st.0, c, x, w, k, c0, oc) };
    if c < PAR_MIN {
        chunk(0, out);
    } else {
        par::for_each_chunk_mut(out, CH, 0, |i, oc| chunk(i * CH, oc));
    }
}

/// One row's conv step + SiLU over channels `c0 .. c0 + oc.len()`: `oc[i] = SiLU(Σ taps)` with
/// the sum in f64 in [`crate::reference::conv1d_step`]'s order, then those channels' window
/// slides (oldest row out, `x` in).
///
/// # Safety
/// `state` points at a live `[k − 1, c]` window; no one else reads or writes its channels
/// `c0 .. c0 + oc.len()` during the call; `c0 + oc.len() ≤ c = x.len()` and `w.len() = c·k`.
#[allow(clippy::too_many_arguments)]
unsafe fn conv_silu_channels(
    isa: Isa,
    state: *mut f32,
    c: usize,
    x: &[f32],
    w: &[f32],
    k: usize,
    c0: usize,
    oc: &mut [f32],
) {
    for (o, ch) in oc.iter_mut().zip(c0..) {
        // SAFETY (the unsafe blocks): j < k − 1 and ch < c, so j·c + ch lies inside the window,
        // whose channels c0.. are this call's alone (the caller's contract).
        let mut acc = w[ch * k + k - 1] as f64 * x[ch] as f64;
        for j in 0..k - 1 {
            acc += w[ch * k + j] as f64 * unsafe { *state.add(j * c + ch) } as f64;
        }
        *o = acc as f32;
        for j in 0..k.saturating_sub(1) {
            let v = if j + 2 < k {
                unsafe { *state.add((j + 1) * c + ch) }
            } else {
                x[ch]
            };
            unsafe { *state.add(j * c + ch) = v };
        }
    }
    silu_op_isa(isa, SiluOp::InPlace, oc, &[]);
}

/// [`conv1d_silu_step`] over `n` consecutive rows at once (prefill): `out[t]` and the final window
/// are those of `n` calls in row order, bit for bit, but the parallel loop runs over channel chunks
/// with every row inside (one loop instead of `n`).
pub fn conv1d_silu_rows(
    state: &mut [f32], // [k-1, C] pre-conv inputs, oldest first
    xs: &[f32],        // [n, C] the rows' pre-conv inputs
    w: &[f32],         // [C, k]
    k: usize,
    n: usize,
    out: &mut [f32], // [n, C]
) {
    let isa = active_isa();
    assert!(n >= 1 && k >= 1, "conv1d_silu_rows: n, k ≥ 1");
    let c = xs.len() / n;
    assert_eq!(xs.len(), n * c, "conv1d_silu_rows: input length");
    assert_eq!(out.len(), n * c, "conv1d_silu_rows: out length");
    assert_eq!(state.len(), (k - 1) * c, "conv1d_silu_rows: state length");
    assert_eq!(w.len(), c * k, "conv1d_silu_rows: weight length");
    // channels per task
    const CH: usize = 256;
    let st = DisjointOut(state.as_mut_ptr());
    let st = &st;
    let op = DisjointOut(out.as_mut_ptr());
    let op = &op;
    par::for_each_index(c.div_ceil(CH), 1, |ci| {
        let (c0, c1) = (ci * CH, ((ci + 1) * CH).min(c));
        for t in 0..n {
            let x = &xs[t * c..(t + 1) * c];
            // SAFETY: row t's channels c0..c1 lie inside `out` ([n, C]); only this task writes
            // channels c0..c1 of any row, and `out` outlives the loop.
            let oc = unsafe { std::slice::from_raw_parts_mut(op.0.add(t * c + c0), c1 - c0) };
            // SAFETY: as for `out`, only this task touches channels c0..c1 of the state rows.
            unsafe { conv_silu_channels(isa, st.0, c, x, w, k, c0, oc) };
        }
    });
}

/// One element-wise SiLU op (see [`SiluOp`]) with [`silu_fast`]'s arithmetic on `isa`.
pub fn silu_op_isa(isa: Isa, op: SiluOp, a: &mut [f32], b: &[f32]) {
    if op != SiluOp::InPlace {
        assert_eq!(a.len(), b.len(), "silu_op {op:?}: lengths");
    }
    let start = match isa {
        Isa::Scalar => 0,
        Isa::Avx2 | Isa::Avx512 => {
            check_isa(isa);
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: AVX2 + FMA verified by `check_isa`; `b` is as long as `a` unless the op
                // ignores it (asserted above).
                unsafe { crate::avx2::silu_op(op, a, b) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!()
        }
    };
    // the < 8 tail (all of it for Scalar)
    match op {
        SiluOp::InPlace => a[start..].iter_mut().for_each(|v| *v = silu_fast(*v)),
        SiluOp::GateMulUp => {
            for (g, u) in a[start..].iter_mut().zip(&b[start..]) {
                *g = silu_fast(*g) * *u;
            }
        }
        SiluOp::MulByGate => {
            for (o, z) in a[start..].iter_mut().zip(&b[start..]) {
                *o *= silu_fast(*z);
            }
        }
    }
}

/// `exp(x)` for `x ≤ 0` in branch-free arithmetic that LLVM vectorizes (no libm call).
#[inline(always)]
pub(crate) fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23: adding and subtracting rounds to nearest
    let xc = x.max(-87.0);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO; // |r| ≤ ln2/2
                                            // e^r ≈ 1 + r + r²/2 + … + r⁶/720 (Horner)
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    let y = p * scale;
    if x < -87.0 {
        0.0
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    /// The AVX2 `log_sum_exp` equals the portable one bit for bit, NaN, ±inf and −0 included.
    #[test]
    fn log_sum_exp_avx2_equals_scalar_bits() {
        #[cfg(target_arch = "x86_64")]
        {
            if !super::isa_supported(super::Isa::Avx2) {
                eprintln!(
                    "SKIPPED log_sum_exp_avx2_equals_scalar_bits: no AVX2 (not counted as run)"
                );
                return;
            }
            let mut s = 1u64;
            let mut next = move || {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                s >> 33
            };
            for case in 0..400 {
                let n = [0usize, 1, 7, 8, 9, 15, 16, 17, 100, 4099, 248_320][case % 11];
                let mut x: Vec<f32> = (0..n)
                    .map(|_| (next() % 100_000) as f32 / 1000.0 - 50.0)
                    .collect();
                if n > 0 {
                    match case % 7 {
                        0 => x[next() as usize % n] = f32::NAN,
                        1 => x[next() as usize % n] = f32::NEG_INFINITY,
                        2 => x[next() as usize % n] = f32::INFINITY,
                        3 => x.iter_mut().for_each(|v| *v = -0.0),
                        4 => x.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                        5 => x[next() as usize % n] = 1e30,
                        _ => {}
                    }
                }
                let a = super::log_sum_exp_scalar(&x);
                // SAFETY: AVX2 + FMA checked above.
                let b = unsafe { crate::avx2::log_sum_exp(&x) };
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "case {case} n {n}: {a} vs {b}"
                );
            }
        }
    }
}
