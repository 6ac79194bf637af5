//! The prefill GEMM (`gemm_lowbit`, tensor cores) against an exact host emulation of the
//! product of its own inputs and against the n-row mat-vec path, on random weights and
//! activations at the real Bonsai-27B shapes. Skips (and says so) when no CUDA device exists; a
//! skipped test proves nothing and is reported as SKIPPED on stderr.
//!
//! Every GEMM configuration runs every check (`Gpu::set_gemm_config`; the f16 ones share the
//! f16 tolerances):
//! - int8: sums per sub-block `xd · isum` (isum exact in int32), per scale block times the weight
//!   scale, in f32 with a fixed order. Against the f64 emulation of the same quantized product the
//!   max abs error, relative to the largest |y| of the compared set, must be < 1e-5; against the
//!   mat-vec path (a different f32 order) < 2e-5.
//! - f16: the activations become f16 (`f16p_row`, host twin of the device conversion, checked bit
//!   for bit), the weights exact f16, the products summed in f32 by the tensor cores. Against the
//!   f64 emulation of that product (same f16 activations) < 1e-4 (the tensor cores' f32 sums over
//!   K/16 steps: 2.5e-5 measured at K = 17,408); against the mat-vec path (which
//!   uses the unrounded q·d) < 2e-3, the f16 rounding of the activations (2^-11 per element).
//!
//! Grid variants (tile width, grouping, n) must agree bit for bit, as must accumulate mode with
//! `y0 + y` computed on the host.

use bonsai_kernels_cpu::quant::dequantize_row;
use bonsai_kernels_cpu::QuantType;
use bonsai_kernels_cuda::{
    f16p_row, gemmws_k_splits, host_quant, retile, retile_b1p, DevBuf, GemmConfig, GemmPath, Gpu,
    MvSeg, Retiled, WKind, MAX_ROWS,
};
use half::f16;
use rayon::prelude::*;

mod common;
use common::Rng;

/// Random GGUF rows of a low-bit type with sane f16 scales. `code3`: keep Q2 code 3 (+2d, legal
/// but never produced for ternary weights) instead of mapping it to 2.
fn rand_lowbit(rng: &mut Rng, qt: QuantType, n_in: usize, n_out: usize, code3: bool) -> Vec<u8> {
    let mut raw = rng.bytes8(qt.row_bytes(n_in).unwrap() * n_out);
    for blk in raw.chunks_exact_mut(qt.block_bytes()) {
        let d = f16::from_f32(0.01 + 0.02 * ((blk[2] & 63) as f32 / 63.0)).to_bits();
        blk[..2].copy_from_slice(&d.to_le_bytes());
        if qt.is_q2() && !code3 {
            for b in blk[2..].iter_mut() {
                let mut v = *b;
                for s in 0..4 {
                    if (v >> (2 * s)) & 3 == 3 {
                        v &= !(1 << (2 * s));
                    }
                }
                *b = v;
            }
        }
    }
    raw
}

fn down<T: Copy + Default>(g: &Gpu, b: &DevBuf, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    g.dtoh(b, 0, &mut v).unwrap();
    v
}

/// max |a - b| / max |b| over the pairs.
fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, &v| m.max(v.abs())).max(1e-12);
    a.iter()
        .zip(b)
        .fold(0f32, |m, (&x, &y)| m.max((x - y).abs()))
        / scale
}

/// One matrix on the device plus its host copies.
struct Mat {
    qt: QuantType,
    raw: Vec<u8>,
    rt: Retiled,
    codes: DevBuf,
    scales: DevBuf,
}

impl Mat {
    fn new(g: &Gpu, rng: &mut Rng, qt: QuantType, n_in: usize, n_out: usize, code3: bool) -> Mat {
        let raw = rand_lowbit(rng, qt, n_in, n_out, code3);
        let rt = retile(qt, &raw, n_in, n_out);
        assert_ne!(rt.kind, WKind::F32);
        let codes = g.upload(&rt.codes).unwrap();
        let scales = g.upload(&rt.scales).unwrap();
        Mat {
            qt,
            raw,
            rt,
            codes,
            scales,
        }
    }
    fn seg(&self, y: u64) -> MvSeg {
        MvSeg {
            codes: self.codes.ptr(),
            scales: self.scales.ptr(),
            y,
            n_out: self.rt.n_out,
        }
    }
    /// f64 emulation of the exact quantized product at (t, o) for the given (t, o) pairs.
    fn emulate(&self, q: &[i8], d: &[f32], pairs: &[(usize, usize)]) -> Vec<f32> {
        let n_in = self.rt.n_in;
        let rb = self.qt.row_bytes(n_in).unwrap();
        pairs
            .par_iter()
            .map(|&(t, o)| {
                let mut row = vec![0f32; n_in];
                dequantize_row(self.qt, &self.raw[o * rb..(o + 1) * rb], &mut row);
                let mut acc = 0f64;
                for i in 0..n_in {
                    acc += row[i] as f64 * q[t * n_in + i] as f64 * d[(t * n_in + i) / 32] as f64;
                }
                acc as f32
            })
            .collect()
    }
    /// f64 emulation of the f16 path: the activation rows as the device converts them.
    fn emulate_f16(&self, q: &[i8], d: &[f32], pairs: &[(usize, usize)]) -> Vec<f32> {
        let n_in = self.rt.n_in;
        let rb = self.qt.row_bytes(n_in).unwrap();
        let mut rows: Vec<usize> = pairs.iter().map(|p| p.0).collect();
        rows.dedup();
        let conv: Vec<(usize, (Vec<f16>, f32))> = rows
            .iter()
            .map(|&t| {
                let r = f16p_row(
                    &q[t * n_in..(t + 1) * n_in],
                    &d[t * n_in / 32..(t + 1) * n_in / 32],
                );
                (t, r)
            })
            .collect();
        pairs
            .par_iter()
            .map(|&(t, o)| {
                let (xh, xs) = &conv.iter().find(|c| c.0 == t).unwrap().1;
                let mut row = vec![0f32; n_in];
                dequantize_row(self.qt, &self.raw[o * rb..(o + 1) * rb], &mut row);
                let mut acc = 0f64;
                for i in 0..n_in {
                    // pair order: x0 x2 x1 x3 (its own inverse)
                    let p = (i & !3) | [0, 2, 1, 3][i & 3];
                    acc += row[i] as f64 * xh[p].to_f64();
                }
                (acc * *xs as f64) as f32
            })
            .collect()
    }
    /// The emulation of the path `g` is on.
    fn emulate_path(&self, g: &Gpu, q: &[i8], d: &[f32], pairs: &[(usize, usize)]) -> Vec<f32> {
        if g.gemm_config().path != GemmPath::Int8 {
            self.emulate_f16(q, d, pairs)
        } else {
            self.emulate(q, d, pairs)
        }
    }
}

/// Tolerances of the path `g` is on: (vs its emulation, vs the mat-vec path).
fn tols(g: &Gpu) -> (f32, f32) {
    if g.gemm_config().path != GemmPath::Int8 {
        (1e-4, 2e-3)
    } else {
        (1e-5, 2e-5)
    }
}

fn path(g: &Gpu) -> String {
    g.gemm_config().name()
}

/// Device int8 activations [n, k] of random f32 rows, checked against the host quantization.
struct Act {
    q: DevBuf,
    d: DevBuf,
    s: DevBuf,
    hq: Vec<i8>,
    hd: Vec<f32>,
}

fn make_act(g: &Gpu, rng: &mut Rng, n: usize, k: usize) -> Act {
    // rows of different magnitudes, some zero blocks (d = 0)
    let mut x = Vec::with_capacity(n * k);
    for t in 0..n {
        let scale = 0.25 + (t % 7) as f32;
        let mut r = rng.vec(k, scale);
        if t % 5 == 3 {
            r[..32].iter_mut().for_each(|v| *v = 0.0);
        }
        x.extend(r);
    }
    quantize(g, &x, k)
}

/// Device int8 activations of the rows `x` (width `k`), checked against the host quantization.
fn quantize(g: &Gpu, x: &[f32], k: usize) -> Act {
    let n = x.len() / k;
    let xb = g.upload(x).unwrap();
    let q = g.alloc(n * k).unwrap();
    let d = g.alloc(n * k / 32 * 4).unwrap();
    let s = g.alloc(n * k / 32 * 4).unwrap();
    g.quant_rows(xb.ptr(), n, k, q.ptr(), d.ptr(), s.ptr())
        .unwrap();
    let (hq, hd, hs) = host_quant(x, k);
    assert_eq!(down::<i8>(g, &q, n * k), hq, "int8 codes");
    assert_eq!(down::<f32>(g, &d, n * k / 32), hd, "scales");
    assert_eq!(down::<i32>(g, &s, n * k / 32), hs, "sums");
    Act { q, d, s, hq, hd }
}

const POISON: f32 = f32::NAN;
const GUARD: f32 = -7.25e30;

/// A y buffer [n, n_out] poisoned with NaN, followed by `n_out` guard values.
fn poisoned(g: &Gpu, n: usize, n_out: usize) -> DevBuf {
    let mut v = vec![POISON; n * n_out];
    v.extend(std::iter::repeat_n(GUARD, n_out));
    g.upload(&v).unwrap()
}

fn check_guard(g: &Gpu, y: &DevBuf, n: usize, n_out: usize, what: &str) {
    let all: Vec<f32> = down(g, y, (n + 1) * n_out);
    assert!(
        all[n * n_out..]
            .iter()
            .all(|v| v.to_bits() == GUARD.to_bits()),
        "{what}: wrote past the end of y"
    );
    let bad = all[..n * n_out].iter().filter(|v| !v.is_finite()).count();
    assert_eq!(
        bad, 0,
        "{what}: {bad} outputs not written (still NaN) or not finite"
    );
}

fn gemm(g: &Gpu, m: &Mat, a: &Act, y: u64, n: usize, acc: bool, bn: Option<usize>) {
    g.gemm_lowbit_multi_bn(
        m.rt.kind,
        &[m.seg(y)],
        a.q.ptr(),
        a.d.ptr(),
        m.rt.n_in,
        n,
        acc,
        bn,
    )
    .unwrap();
}

/// The n-row mat-vec path in chunks of MAX_ROWS (the reference the GEMM replaces).
fn matvec_rows(g: &Gpu, m: &Mat, a: &Act, n: usize) -> Vec<f32> {
    let (k, n_out) = (m.rt.n_in, m.rt.n_out);
    let y = g.alloc(n * n_out * 4).unwrap();
    let mut t0 = 0;
    while t0 < n {
        let nr = (n - t0).min(MAX_ROWS);
        g.mv_lowbit(
            m.rt.kind,
            m.codes.ptr(),
            m.scales.ptr(),
            a.q.at(t0 * k),
            a.d.at(t0 * k / 32 * 4),
            a.s.at(t0 * k / 32 * 4),
            y.at(t0 * n_out * 4),
            k,
            n_out,
            nr,
            false,
        )
        .unwrap();
        t0 += nr;
    }
    down(g, &y, n * n_out)
}

/// Sampled (t, o) pairs: first/last rows and outputs (edge tiles) plus random ones.
fn sample_pairs(rng: &mut Rng, n: usize, n_out: usize) -> Vec<(usize, usize)> {
    let mut ts = vec![0, n - 1, n / 2];
    for _ in 0..5 {
        ts.push(rng.below(n));
    }
    let mut os = vec![
        0,
        n_out - 1,
        n_out.saturating_sub(129),
        (n_out / 128) * 128 % n_out,
    ];
    for _ in 0..60 {
        os.push(rng.below(n_out));
    }
    let mut p = Vec::new();
    for &t in &ts {
        for &o in &os {
            p.push((t, o));
        }
    }
    p.sort_unstable();
    p.dedup();
    p
}

/// Every GEMM configuration (int8; f16 mma.sync with 8 warps, 4 warps at 2 and at 3 stages; f16
/// wgmma with 2 and 4 register sets and the shared-memory wgmma where the cubin has them); then
/// the default again.
fn each_config(g: &Gpu, mut f: impl FnMut(&Gpu)) {
    let dflt = g.gemm_config();
    for c in configs(g) {
        g.set_gemm_config(c);
        f(g);
    }
    g.set_gemm_config(dflt);
}

fn cfg(path: GemmPath, warps: usize, o4: Option<bool>, wgmma_sets: usize) -> GemmConfig {
    GemmConfig {
        path,
        warps,
        o4,
        wgmma_sets,
    }
}

fn configs(g: &Gpu) -> Vec<GemmConfig> {
    let mut v = vec![
        cfg(GemmPath::Int8, 4, None, 4),
        cfg(GemmPath::F16, 8, None, 4),
        cfg(GemmPath::F16, 4, Some(true), 4),
        cfg(GemmPath::F16, 4, Some(false), 4),
        cfg(GemmPath::F16, 4, None, 4),
    ];
    if g.gemmw_available() {
        v.push(cfg(GemmPath::Wgmma, 4, None, 2));
        v.push(cfg(GemmPath::Wgmma, 4, None, 4));
        v.push(cfg(GemmPath::WgmmaSs, 4, None, 4));
    } else {
        eprintln!("gemm: this cubin has no wgmma kernels (not sm_90a): that path is not checked");
    }
    v
}

/// [`run_shape_path`] on every GEMM configuration.
fn run_shape(g: &Gpu, qt: QuantType, n_in: usize, n_out: usize, ns: &[usize], seed: u64) {
    each_config(g, |g| run_shape_path(g, qt, n_in, n_out, ns, seed));
}

/// One (type, shape) on the path `g` is on: every n in `ns` (prefixes of one activation set), vs
/// emulation and mat-vec; every forced tile width (BN 32 and 64; shared-memory wgmma: 64 and 128)
/// == auto; rows independent of n; accumulate mode.
fn run_shape_path(g: &Gpu, qt: QuantType, n_in: usize, n_out: usize, ns: &[usize], seed: u64) {
    let (tol_em, tol_mv) = tols(g);
    let p = path(g);
    let mut rng = Rng(seed);
    let m = Mat::new(g, &mut rng, qt, n_in, n_out, false);
    let nmax = *ns.iter().max().unwrap();
    let a = make_act(g, &mut rng, nmax, n_in);
    // reference rows of the largest n (every smaller n must give the same rows bit for bit)
    let mut full: Option<Vec<f32>> = None;
    let mv_all = matvec_rows(g, &m, &a, nmax);
    for &n in ns.iter().rev() {
        let mut outs = Vec::new();
        let bns = if g.gemm_config().path == GemmPath::WgmmaSs {
            [None, Some(64), Some(128)]
        } else {
            [None, Some(32), Some(64)]
        };
        for bn in bns {
            let y = poisoned(g, n, n_out);
            gemm(g, &m, &a, y.ptr(), n, false, bn);
            check_guard(
                g,
                &y,
                n,
                n_out,
                &format!("{p} {qt:?} [{n_in}x{n_out}] n={n} bn={bn:?}"),
            );
            outs.push(down::<f32>(g, &y, n * n_out));
        }
        for (i, o) in outs.iter().enumerate().skip(1) {
            let same = o
                .iter()
                .zip(&outs[0])
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "{p} {qt:?} [{n_in}x{n_out}] n={n}: tile variant {i} differs from auto"
            );
        }
        let yg = &outs[0];
        match &full {
            None => full = Some(yg.clone()),
            Some(f) => {
                let same = yg.iter().zip(f).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{p} {qt:?} [{n_in}x{n_out}] n={n}: rows differ from the n={nmax} launch"
                );
            }
        }
        // vs the mat-vec path (all outputs)
        let mv = &mv_all[..n * n_out];
        let e_mv = max_rel(yg, mv);
        assert!(
            e_mv < tol_mv,
            "{p} {qt:?} [{n_in}x{n_out}] n={n}: vs mat-vec max rel {e_mv}"
        );
        // vs the exact emulation (sampled outputs)
        let pairs = sample_pairs(&mut rng, n, n_out);
        let em = m.emulate_path(g, &a.hq, &a.hd, &pairs);
        let got: Vec<f32> = pairs.iter().map(|&(t, o)| yg[t * n_out + o]).collect();
        let e_em = max_rel(&got, &em);
        assert!(
            e_em < tol_em,
            "{p} {qt:?} [{n_in}x{n_out}] n={n}: vs emulation max rel {e_em}"
        );
        eprintln!(
            "gemm {p} {qt:?} [{n_in}x{n_out}] n={n}: vs mat-vec {e_mv:.2e}, vs emulation {e_em:.2e} ({} samples), tile widths {bns:?} equal, rows == n={nmax}",
            pairs.len()
        );
    }
    // accumulate: y = y0 + x·Wᵀ, with the kernel's own non-accumulated value (host f32 add)
    let n = nmax;
    let y0 = rng.vec(n * n_out, 3.0);
    let mut yb = y0.clone();
    yb.extend(std::iter::repeat_n(GUARD, n_out));
    let y = g.upload(&yb).unwrap();
    gemm(g, &m, &a, y.ptr(), n, true, None);
    check_guard(g, &y, n, n_out, "accumulate");
    let ya: Vec<f32> = down(g, &y, n * n_out);
    let plain = full.as_ref().unwrap();
    for i in 0..n * n_out {
        assert_eq!(
            ya[i].to_bits(),
            (y0[i] + plain[i]).to_bits(),
            "{p} {qt:?} accumulate at {i}"
        );
    }
}

const KINDS: [QuantType; 3] = [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::Q2_0G64];
const NS: [usize; 4] = [9, 64, 100, 512];

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_real_shapes_k5120() {
    let g = need_gpu!("gemm_real_shapes_k5120");
    for (i, qt) in KINDS.into_iter().enumerate() {
        for (j, n_out) in [10240, 17408, 5120, 48].into_iter().enumerate() {
            run_shape(g, qt, 5120, n_out, &NS, 100 + 10 * i as u64 + j as u64);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_real_shapes_down_and_out() {
    let g = need_gpu!("gemm_real_shapes_down_and_out");
    for (i, qt) in KINDS.into_iter().enumerate() {
        run_shape(g, qt, 17408, 5120, &NS, 200 + i as u64);
        run_shape(g, qt, 6144, 5120, &NS, 210 + i as u64);
    }
}

/// The two f16 tensor-core paths side by side on the same inputs: `gemmws` (wgmma) against `gemmh`
/// (mma.sync). Both sum exact f16 products in f32 over the k16 steps in order, and on the H200 they
/// give the same bits (measured: 0 of 13.8 M outputs differ) with the K split off; the default
/// K-split launches (the 5,120-output shapes) add three partial sums and agree within the path's
/// emulation tolerance (1.7e-5 of max |y| measured).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_wgs_against_mma_sync() {
    let g = need_gpu!("gemm_wgs_against_mma_sync");
    if !g.gemmw_available() {
        eprintln!("SKIPPED gemm_wgs_against_mma_sync: no wgmma kernels in this cubin (not counted as run)");
        return;
    }
    let dflt = g.gemm_config();
    for (i, qt) in KINDS.into_iter().enumerate() {
        for (k, n_out) in [(5120, 10240), (17408, 5120)] {
            let mut rng = Rng(700 + i as u64);
            let m = Mat::new(g, &mut rng, qt, k, n_out, false);
            let n = 300;
            let a = make_act(g, &mut rng, n, k);
            let run = |path, split| {
                g.set_gemm_config(cfg(path, 4, None, 4));
                g.set_gemm_k_split(split);
                let y = poisoned(g, n, n_out);
                gemm(g, &m, &a, y.ptr(), n, false, None);
                g.set_gemm_k_split(true);
                down::<f32>(g, &y, n * n_out)
            };
            let mma = run(GemmPath::F16, true);
            let wgs = run(GemmPath::WgmmaSs, false);
            let wgs_split = run(GemmPath::WgmmaSs, true);
            g.set_gemm_config(dflt);
            let differ = |o: &[f32]| {
                o.iter()
                    .zip(&mma)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count()
            };
            let (d0, e0) = (differ(&wgs), max_rel(&wgs, &mma));
            let (d1, e1) = (differ(&wgs_split), max_rel(&wgs_split, &mma));
            let splits = gemmws_k_splits(n_out, k);
            eprintln!(
                "gemm wgs vs mma.sync {qt:?} [{k}x{n_out}] n={n}: {d0} of {} outputs differ (max rel {e0:.2e}); with the default K split ({splits}): {d1} (max rel {e1:.2e})",
                n * n_out
            );
            assert_eq!(d0, 0, "{qt:?} [{k}x{n_out}]: wgs vs mma.sync max rel {e0}");
            if splits == 1 {
                assert_eq!(d1, 0, "{qt:?} [{k}x{n_out}]: unsplit wgs differs");
            } else {
                assert!(
                    e1 < tols(g).0,
                    "{qt:?} [{k}x{n_out}]: K-split wgs max rel {e1}"
                );
            }
        }
    }
}

/// The GEMM over the b1-plane layout (`gemm_b1p_multi`, `gemmws_*_b1p`: the engine's norm-fed
/// projections held only in that layout) against the dp4a-layout launch of the same matrices:
/// every output bit for bit, with and without the K split, both tile widths, grouped segments
/// (GDN in-projection widths, rows not a multiple of the 128-row tile), accumulate, PQ2_0 and
/// legal code 3; and an error where the configured path cannot read the layout.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_b1p_layout_equals_dp4a_layout() {
    let g = need_gpu!("gemm_b1p_layout_equals_dp4a_layout");
    if !g.gemm_reads_b1p() {
        eprintln!("SKIPPED gemm_b1p_layout_equals_dp4a_layout: the configured GEMM ({}) cannot read the b1-plane layout (not counted as run)", path(g));
        return;
    }
    let dflt = g.gemm_config();
    let qts = [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::PQ2_0];
    for (i, qt) in qts.into_iter().enumerate() {
        for (k, outs, ns) in [
            (
                5120usize,
                vec![10240usize, 6144, 48, 48],
                vec![9usize, 100, 512],
            ),
            (17408, vec![5120], vec![300]),
            (256, vec![16, 208], vec![9, 70]),
        ] {
            let mut rng = Rng(900 + 10 * i as u64 + k as u64);
            let mats: Vec<Mat> = outs
                .iter()
                .map(|&no| Mat::new(g, &mut rng, qt, k, no, qt != QuantType::Q1_0))
                .collect();
            let b1p: Vec<(DevBuf, DevBuf)> = mats
                .iter()
                .map(|m| {
                    let t = retile_b1p(qt, &m.raw, k, m.rt.n_out);
                    (g.upload(&t.codes).unwrap(), g.upload(&t.scales).unwrap())
                })
                .collect();
            let kind = mats[0].rt.kind;
            for &n in &ns {
                let a = make_act(g, &mut rng, n, k);
                for (split, bn, acc) in [
                    (true, None, false),
                    (false, Some(64), false),
                    (true, Some(128), true),
                ] {
                    g.set_gemm_k_split(split);
                    let base: Vec<DevBuf> = mats
                        .iter()
                        .map(|m| {
                            let v: Vec<f32> =
                                (0..n * m.rt.n_out).map(|j| (j % 13) as f32 * 0.5).collect();
                            g.upload(&v).unwrap()
                        })
                        .collect();
                    let run = |b1: bool| -> Vec<Vec<f32>> {
                        let ys: Vec<DevBuf> = mats
                            .iter()
                            .zip(&base)
                            .map(|(m, b0)| {
                                let y = poisoned(g, n, m.rt.n_out);
                                if acc {
                                    g.dtod(y.ptr(), b0.ptr(), n * m.rt.n_out * 4).unwrap();
                                }
                                y
                            })
                            .collect();
                        let segs: Vec<MvSeg> = if b1 {
                            mats.iter()
                                .zip(&ys)
                                .zip(&b1p)
                                .map(|((m, y), (c, s))| MvSeg {
                                    codes: c.ptr(),
                                    scales: s.ptr(),
                                    y: y.ptr(),
                                    n_out: m.rt.n_out,
                                })
                                .collect()
                        } else {
                            mats.iter().zip(&ys).map(|(m, y)| m.seg(y.ptr())).collect()
                        };
                        if b1 {
                            g.gemm_b1p_multi(kind, &segs, a.q.ptr(), a.d.ptr(), k, n, acc, bn)
                                .unwrap();
                        } else {
                            g.gemm_lowbit_multi_bn(
                                kind,
                                &segs,
                                a.q.ptr(),
                                a.d.ptr(),
                                k,
                                n,
                                acc,
                                bn,
                            )
                            .unwrap();
                        }
                        mats.iter()
                            .zip(&ys)
                            .map(|(m, y)| {
                                check_guard(g, y, n, m.rt.n_out, "b1p gemm");
                                down::<f32>(g, y, n * m.rt.n_out)
                            })
                            .collect()
                    };
                    let (want, got) = (run(false), run(true));
                    for (mi, (w, o)) in want.iter().zip(&got).enumerate() {
                        let differ = w
                            .iter()
                            .zip(o)
                            .filter(|(x, y)| x.to_bits() != y.to_bits())
                            .count();
                        assert_eq!(
                            differ, 0,
                            "{qt:?} [{k}x{}] n={n} split {split} bn {bn:?} acc {acc}: {differ} outputs differ",
                            outs[mi]
                        );
                    }
                    eprintln!(
                        "gemm b1p layout {qt:?} [{k} -> {outs:?}] n={n} split {split} bn {bn:?} acc {acc}: every output == the dp4a layout's"
                    );
                }
            }
        }
    }
    g.set_gemm_k_split(true);
    // a path that reads only the dp4a layout refuses
    g.set_gemm_config(cfg(GemmPath::F16, 4, None, 4));
    let mut rng = Rng(990);
    let m = Mat::new(g, &mut rng, QuantType::Q1_0, 256, 16, false);
    let t = retile_b1p(QuantType::Q1_0, &m.raw, 256, 16);
    let (c, s) = (g.upload(&t.codes).unwrap(), g.upload(&t.scales).unwrap());
    let a = make_act(g, &mut rng, 9, 256);
    let y = poisoned(g, 9, 16);
    let seg = MvSeg {
        codes: c.ptr(),
        scales: s.ptr(),
        y: y.ptr(),
        n_out: 16,
    };
    let e = g
        .gemm_b1p_multi(WKind::Q1, &[seg], a.q.ptr(), a.d.ptr(), 256, 9, false, None)
        .unwrap_err();
    assert!(e.to_string().contains("dp4a layout"), "{e}");
    g.set_gemm_config(dflt);
}

/// Ragged and small shapes: fewer k chunks than pipeline stages, n_out not a multiple of the
/// 128-row tile or of 16, n not a multiple of the activation tile; PQ2_0 and legal code 3.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_ragged_shapes() {
    let g = need_gpu!("gemm_ragged_shapes");
    for (i, qt) in KINDS.into_iter().chain([QuantType::PQ2_0]).enumerate() {
        let s = 300 + 10 * i as u64;
        run_shape(g, qt, 128, 200, &[9, 33, 65], s);
        run_shape(g, qt, 256, 6, &[9, 70], s + 1);
        run_shape(g, qt, 384, 130, &[13, 127, 129], s + 2);
        run_shape(g, qt, 512, 1, &[10], s + 3);
    }
    // Q2 code 3 (+2d) is legal: the expansion maps it to +2
    for qt in [QuantType::Q2_0G128, QuantType::Q2_0G64] {
        each_config(g, |g| code3(g, qt));
    }
}

fn code3(g: &Gpu, qt: QuantType) {
    {
        let mut rng = Rng(77);
        let m = Mat::new(g, &mut rng, qt, 1024, 300, true);
        assert!(m.raw.iter().any(|&b| b & 3 == 3), "no code 3 generated");
        let a = make_act(g, &mut rng, 40, 1024);
        let y = poisoned(g, 40, 300);
        gemm(g, &m, &a, y.ptr(), 40, false, None);
        check_guard(g, &y, 40, 300, "code 3");
        let yg: Vec<f32> = down(g, &y, 40 * 300);
        let pairs: Vec<(usize, usize)> = (0..40)
            .flat_map(|t| (0..300).map(move |o| (t, o)))
            .collect();
        let em = m.emulate_path(g, &a.hq, &a.hd, &pairs);
        let e = max_rel(&yg, &em);
        let p = path(g);
        assert!(e < tols(g).0, "{p} {qt:?} code 3: max rel {e}");
        eprintln!("gemm {p} {qt:?} with code 3: vs emulation {e:.2e}");
    }
}

/// Grouped launch (the GDN in-projection layout qkv | z | β | α, and a repeated matrix): every
/// segment equals its single-matrix launch bit for bit. (With the K split off: a single launch
/// of a narrow matrix splits K by default and a grouped one does not; the other tests check the
/// split launches against the emulation.)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_grouped_segments() {
    let g = need_gpu!("gemm_grouped_segments");
    g.set_gemm_k_split(false);
    each_config(g, grouped_segments);
    g.set_gemm_k_split(true);
}

fn grouped_segments(g: &Gpu) {
    let p = path(g);
    for (i, qt) in KINDS.into_iter().enumerate() {
        let mut rng = Rng(400 + i as u64);
        let k = 5120;
        let mats: Vec<Mat> = [10240, 6144, 48, 48]
            .into_iter()
            .map(|no| Mat::new(g, &mut rng, qt, k, no, false))
            .collect();
        for n in [9, 100, 512] {
            let a = make_act(g, &mut rng, n, k);
            let ys: Vec<DevBuf> = mats.iter().map(|m| poisoned(g, n, m.rt.n_out)).collect();
            let segs: Vec<MvSeg> = mats.iter().zip(&ys).map(|(m, y)| m.seg(y.ptr())).collect();
            let kind = mats[0].rt.kind;
            g.gemm_lowbit_multi(kind, &segs, a.q.ptr(), a.d.ptr(), k, n, false)
                .unwrap();
            for (m, y) in mats.iter().zip(&ys) {
                let no = m.rt.n_out;
                check_guard(g, y, n, no, "grouped");
                let got: Vec<f32> = down(g, y, n * no);
                let one = poisoned(g, n, no);
                gemm(g, m, &a, one.ptr(), n, false, None);
                let want: Vec<f32> = down(g, &one, n * no);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{p} {qt:?} n={n}: grouped segment [{k}x{no}] differs from its own launch"
                );
            }
            eprintln!("gemm {p} {qt:?} grouped [5120 -> 10240|6144|48|48] n={n}: each segment == single launch");
        }
        // the same matrix twice plus another: outputs of the repeated one are identical
        let n = 64;
        let a = make_act(g, &mut rng, n, k);
        let (m0, m1) = (&mats[0], &mats[2]);
        let ya = poisoned(g, n, m0.rt.n_out);
        let yb = poisoned(g, n, m1.rt.n_out);
        let yc = poisoned(g, n, m0.rt.n_out);
        g.gemm_lowbit_multi(
            m0.rt.kind,
            &[m0.seg(ya.ptr()), m1.seg(yb.ptr()), m0.seg(yc.ptr())],
            a.q.ptr(),
            a.d.ptr(),
            k,
            n,
            false,
        )
        .unwrap();
        let (va, vc): (Vec<f32>, Vec<f32>) =
            (down(g, &ya, n * m0.rt.n_out), down(g, &yc, n * m0.rt.n_out));
        assert!(va.iter().zip(&vc).all(|(x, y)| x.to_bits() == y.to_bits()));
        check_guard(g, &yb, n, m1.rt.n_out, "grouped repeat");
    }
}

/// Throughput of one launch per real shape at n = 512 (informational; the benchmark in
/// crates/engine/tests/cuda_bench.rs measures the full model).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_throughput_report() {
    let g = need_gpu!("gemm_throughput_report");
    let n = 512;
    let dflt = g.gemm_config();
    // (config, forced tile width): int8, the mma.sync f16 variants, wgmma
    let mut configs = vec![(cfg(GemmPath::Int8, 4, None, 4), None)];
    for w in [4, 8] {
        for bn in [Some(32), Some(64)] {
            configs.push((cfg(GemmPath::F16, w, Some(false), 4), bn));
        }
    }
    configs.push((cfg(GemmPath::F16, 4, Some(true), 4), Some(64)));
    if g.gemmw_available() {
        configs.push((cfg(GemmPath::Wgmma, 4, None, 2), None));
        configs.push((cfg(GemmPath::Wgmma, 4, None, 4), None));
        configs.push((cfg(GemmPath::WgmmaSs, 4, None, 4), Some(64)));
        configs.push((cfg(GemmPath::WgmmaSs, 4, None, 4), Some(128)));
    }
    for qt in KINDS {
        let mut rng = Rng(500);
        for (k, n_out) in [
            (5120, 16480),
            (5120, 34816),
            (5120, 14336),
            (6144, 5120),
            (17408, 5120),
        ] {
            let m = Mat::new(g, &mut rng, qt, k, n_out, false);
            let a = make_act(g, &mut rng, n, k);
            let y = g.alloc(n * n_out * 4).unwrap();
            let mut line = format!("gemm {qt:?} [{k}x{n_out}] n={n} us:");
            for &(c, bn) in &configs {
                g.set_gemm_config(c);
                let mut ts = Vec::new();
                for rep in 0..6 {
                    let ms = g
                        .time_ms(|| {
                            g.gemm_lowbit_multi_bn(
                                m.rt.kind,
                                &[m.seg(y.ptr())],
                                a.q.ptr(),
                                a.d.ptr(),
                                k,
                                n,
                                false,
                                bn,
                            )
                        })
                        .unwrap();
                    if rep > 0 {
                        ts.push(ms as f64);
                    }
                }
                ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let ms = ts[ts.len() / 2];
                let tops = 2.0 * (n * n_out * k) as f64 / (ms / 1e3) / 1e12;
                let bn = bn.map_or("auto".to_string(), |b| b.to_string());
                line += &format!(" {}/bn{bn} {:.1} ({tops:.0} TOPS)", path(g), ms * 1e3);
            }
            eprintln!("{line}");
        }
    }
    eprintln!(
        "(TOPS = multiply-adds x 2 per second, activation conversion included, L2-warm weights)"
    );
    g.set_gemm_config(dflt);
}

/// The wgmma shared-memory descriptors: with the stride fields as the kernels set them the
/// products match the emulation; with them swapped they do not (so the check can tell a wrong
/// layout). `gemmw` swaps its activation (B) descriptor, `gemmws` its weight (A) descriptor.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_wgmma_descriptor_fields() {
    let g = need_gpu!("gemm_wgmma_descriptor_fields");
    if !g.gemmw_available() {
        eprintln!("SKIPPED gemm_wgmma_descriptor_fields: no wgmma kernels in this cubin (not counted as run)");
        return;
    }
    let dflt = g.gemm_config();
    for (path, qt) in [
        (GemmPath::Wgmma, QuantType::Q1_0),
        (GemmPath::WgmmaSs, QuantType::Q1_0),
        (GemmPath::WgmmaSs, QuantType::Q2_0G128),
    ] {
        g.set_gemm_config(cfg(path, 4, None, 4));
        let name = g.gemm_config().name();
        let mut rng = Rng(950);
        let (k, n_out, n) = (1024, 256, 70);
        let m = Mat::new(g, &mut rng, qt, k, n_out, false);
        let a = make_act(g, &mut rng, n, k);
        let pairs: Vec<(usize, usize)> = (0..n)
            .flat_map(|t| (0..n_out).map(move |o| (t, o)))
            .collect();
        let em = m.emulate_f16(&a.hq, &a.hd, &pairs);
        let mut errs = Vec::new();
        for swap in [false, true] {
            g.set_gemmw_desc_swap(swap);
            let y = poisoned(g, n, n_out);
            gemm(g, &m, &a, y.ptr(), n, false, None);
            let got: Vec<f32> = down(g, &y, n * n_out);
            let e = max_rel(&got, &em);
            eprintln!(
                "{name} {qt:?} descriptor strides swapped={swap}: vs emulation max rel {e:.2e}"
            );
            errs.push(e);
        }
        g.set_gemmw_desc_swap(false);
        g.set_gemm_config(dflt);
        assert!(
            errs[0] < 1e-4,
            "{} {qt:?} with the kernel's descriptor: max rel {}",
            name,
            errs[0]
        );
        assert!(
            errs[1].is_nan() || errs[1] > 1e-2,
            "{} {qt:?}: swapped strides should give wrong products: {}",
            name,
            errs[1]
        );
    }
}

/// The f16 path's activation conversion equals its host twin bit for bit, on rows of very
/// different ranges (the row factor keeps every value finite and normal-range): ordinary, huge
/// (|x| ~ 1e6, past f16's 65504), tiny (1e-30), all zero, and one lone large element.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gemm_f16_activation_conversion() {
    let g = need_gpu!("gemm_f16_activation_conversion");
    let mut rng = Rng(900);
    let k = 5120;
    let scales = [1.0f32, 1e6, 1e-30, 0.0, 1.0];
    let n = scales.len();
    let mut x = Vec::with_capacity(n * k);
    for (t, &sc) in scales.iter().enumerate() {
        let mut r = rng.vec(k, sc);
        if t == 4 {
            r[1234] = 3.0e5;
        }
        x.extend(r);
    }
    let Act { q, d, hq, hd, .. } = quantize(g, &x, k);
    let xh = g.alloc(n * k * 2).unwrap();
    let xs = g.alloc(n * 4).unwrap();
    g.act_q8_to_f16p(q.ptr(), d.ptr(), k, n, xh.ptr(), xs.ptr())
        .unwrap();
    let got_h: Vec<u16> = down(g, &xh, n * k);
    let got_s: Vec<f32> = down(g, &xs, n);
    for t in 0..n {
        let (want_h, want_s) = f16p_row(&hq[t * k..(t + 1) * k], &hd[t * k / 32..(t + 1) * k / 32]);
        assert_eq!(got_s[t].to_bits(), want_s.to_bits(), "row {t}: factor");
        let bad = (0..k)
            .filter(|&i| got_h[t * k + i] != want_h[i].to_bits())
            .count();
        assert_eq!(
            bad, 0,
            "row {t}: {bad} f16 values differ from the host twin"
        );
        assert!(
            want_h.iter().all(|h| h.is_finite()),
            "row {t}: a non-finite f16 value"
        );
        eprintln!(
            "act_q8_to_f16p row {t} (scale {:e}): factor {:e}, {k} values == host twin",
            scales[t], want_s
        );
    }
}
