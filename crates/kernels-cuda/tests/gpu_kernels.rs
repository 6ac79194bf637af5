//! Every CUDA kernel against the scalar CPU reference (`bonsai_kernels_cpu::reference` / `quant`),
//! on random inputs of the real Bonsai-27B shapes. Skips (and says so) when no CUDA device exists;
//! a skipped test here proves nothing and is reported as SKIPPED on stderr.

use bonsai_kernels_cpu::quant::dequantize_row;
use bonsai_kernels_cpu::reference as r;
use bonsai_kernels_cpu::QuantType;
use bonsai_kernels_cuda::{
    b1q_acts_host, gdn_chunked_supported, host_quant, host_quant_p16, mvbp_ks, retile, DevBuf,
    GdnNormOut, GdnPrefill, GdnSide, Gpu, MvPlan, MvSeg, P16Out, QuantOut, Retiled, WKind,
};
use half::f16;

mod common;
use common::Rng;

/// Every low-bit weight kind the dp4a mat-vec kernels take.
const LOWBIT_KINDS: [QuantType; 4] = [
    QuantType::Q1_0,
    QuantType::Q2_0G128,
    QuantType::PQ2_0,
    QuantType::Q2_0G64,
];

/// Random GGUF rows of a low-bit type with sane f16 scales; Q2 codes restricted to {0,1,2}.
fn rand_lowbit(rng: &mut Rng, qt: QuantType, n_in: usize, n_out: usize) -> Vec<u8> {
    let mut raw = rng.bytes(qt.row_bytes(n_in).unwrap() * n_out);
    for blk in raw.chunks_exact_mut(qt.block_bytes()) {
        let d = f16::from_f32(0.01 + 0.02 * ((blk[2] & 63) as f32 / 63.0)).to_bits();
        blk[..2].copy_from_slice(&d.to_le_bytes());
        if qt.is_q2() {
            for b in blk[2..].iter_mut() {
                // map code 3 to 2 (ternary)
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

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, &v| m.max(v.abs())).max(1e-12);
    a.iter()
        .zip(b)
        .fold(0f32, |m, (&x, &y)| m.max((x - y).abs()))
        / scale
}

fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    num / den.max(1e-30)
}

/// Output rows `[o0, o1)` chunks for the host threads (the real shapes take seconds on one core).
fn row_chunks(n_out: usize) -> Vec<(usize, usize)> {
    let nt = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16);
    let per = n_out.div_ceil(nt).max(64);
    (0..n_out)
        .step_by(per)
        .map(|o0| (o0, (o0 + per).min(n_out)))
        .collect()
}

/// `f(o0, o1)` → the outputs of rows `[o0, o1)` as `[n, o1 - o0]`, over threads (one chunk each);
/// gathered into `[n, n_out]`. For host work whose output rows are independent.
fn par_rows(n_out: usize, n: usize, f: impl Fn(usize, usize) -> Vec<f32> + Sync) -> Vec<f32> {
    let parts: Vec<(usize, usize, Vec<f32>)> = std::thread::scope(|sc| {
        let f = &f;
        let hs: Vec<_> = row_chunks(n_out)
            .into_iter()
            .map(|(o0, o1)| sc.spawn(move || (o0, o1, f(o0, o1))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut y = vec![0f32; n * n_out];
    for (o0, o1, yo) in parts {
        let m = o1 - o0;
        for t in 0..n {
            y[t * n_out + o0..t * n_out + o1].copy_from_slice(&yo[t * m..(t + 1) * m]);
        }
    }
    y
}

/// Host emulation (f64) of the exact integer-activation product the kernel computes.
fn emulate_q(
    raw: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let rb = qt.row_bytes(n_in).unwrap();
    let (q, d, _) = host_quant(x, n_in);
    par_rows(n_out, n, |o0, o1| {
        let m = o1 - o0;
        let mut yo = vec![0f32; n * m];
        let mut row = vec![0f32; n_in];
        for o in o0..o1 {
            dequantize_row(qt, &raw[o * rb..(o + 1) * rb], &mut row);
            for t in 0..n {
                let mut acc = 0f64;
                for i in 0..n_in {
                    acc += row[i] as f64 * q[t * n_in + i] as f64 * d[(t * n_in + i) / 32] as f64;
                }
                yo[t * m + o - o0] = acc as f32;
            }
        }
        yo
    })
}

/// The scalar CPU reference mat-vec of each activation row (each output row is computed alone, so
/// splitting the rows over threads changes nothing).
fn reference_mv(
    raw: &[u8],
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    x: &[f32],
    n: usize,
) -> Vec<f32> {
    let rb = qt.row_bytes(n_in).unwrap();
    par_rows(n_out, n, |o0, o1| {
        let m = o1 - o0;
        let mut yo = vec![0f32; n * m];
        for t in 0..n {
            r::matvec(
                &raw[o0 * rb..o1 * rb],
                qt,
                n_in,
                m,
                &x[t * n_in..(t + 1) * n_in],
                &mut yo[t * m..(t + 1) * m],
            );
        }
        yo
    })
}

/// Host-only: the threaded emulation and reference equal a plain serial loop (row chunks gathered
/// in order, every activation row in place).
#[test]
fn host_emulation_threads_gather_in_order() {
    let (n_in, n_out, n) = (384usize, 1000usize, 3usize);
    let mut rng = Rng(7);
    for qt in [QuantType::Q1_0, QuantType::Q2_0G128] {
        let raw = rand_lowbit(&mut rng, qt, n_in, n_out);
        let x = rng.vec(n * n_in, 1.0);
        let rb = qt.row_bytes(n_in).unwrap();
        let (q, d, _) = host_quant(&x, n_in);
        let mut row = vec![0f32; n_in];
        let (mut em, mut rf) = (vec![0f32; n * n_out], vec![0f32; n * n_out]);
        for o in 0..n_out {
            dequantize_row(qt, &raw[o * rb..(o + 1) * rb], &mut row);
            for t in 0..n {
                let acc: f64 = (0..n_in)
                    .map(|i| row[i] as f64 * q[t * n_in + i] as f64 * d[(t * n_in + i) / 32] as f64)
                    .sum();
                em[t * n_out + o] = acc as f32;
            }
        }
        for t in 0..n {
            r::matvec(
                &raw,
                qt,
                n_in,
                n_out,
                &x[t * n_in..(t + 1) * n_in],
                &mut rf[t * n_out..(t + 1) * n_out],
            );
        }
        assert_eq!(
            emulate_q(&raw, qt, n_in, n_out, &x, n),
            em,
            "{qt:?} emulation"
        );
        assert_eq!(
            reference_mv(&raw, qt, n_in, n_out, &x, n),
            rf,
            "{qt:?} reference"
        );
    }
    assert!(
        row_chunks(1000).len() > 1
            || std::thread::available_parallelism().map_or(1, |p| p.get()) == 1
    );
}

fn run_mv(g: &Gpu, qt: QuantType, n_in: usize, n_out: usize, n: usize, seed: u64) {
    run_mv_plan(g, qt, n_in, n_out, n, seed, None);
}

/// [`run_mv`] under a forced launch plan (`None`: the shape-based default).
fn run_mv_plan(
    g: &Gpu,
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    n: usize,
    seed: u64,
    plan: Option<MvPlan>,
) {
    g.set_mv_override(plan);
    let mut rng = Rng(seed);
    let raw = rand_lowbit(&mut rng, qt, n_in, n_out);
    let x = rng.vec(n * n_in, 1.0); // [n, n_in]
    let rt = retile(qt, &raw, n_in, n_out);
    assert_ne!(rt.kind, WKind::F32);
    let codes = g.upload(&rt.codes).unwrap();
    let scales = g.upload(&rt.scales).unwrap();
    let xb = g.upload(&x).unwrap();
    let q = g.alloc(n * n_in).unwrap();
    let d = g.alloc(n * n_in / 32 * 4).unwrap();
    let s = g.alloc(n * n_in / 32 * 4).unwrap();
    g.quant_rows(xb.ptr(), n, n_in, q.ptr(), d.ptr(), s.ptr())
        .unwrap();
    // device quantization equals the host one exactly
    let (hq, hd, hs) = host_quant(&x, n_in);
    assert_eq!(down::<i8>(g, &q, n * n_in), hq, "int8 codes");
    assert_eq!(down::<f32>(g, &d, n * n_in / 32), hd, "scales");
    assert_eq!(down::<i32>(g, &s, n * n_in / 32), hs, "sums");
    // n-row launch
    let y = g.alloc(n * n_out * 4).unwrap();
    g.mv_lowbit(
        rt.kind,
        codes.ptr(),
        scales.ptr(),
        q.ptr(),
        d.ptr(),
        s.ptr(),
        y.ptr(),
        n_in,
        n_out,
        n,
        false,
    )
    .unwrap();
    let yn: Vec<f32> = down(g, &y, n * n_out);
    // 1-row launches: batch invariance, bit for bit
    let y1 = g.alloc(n_out * 4).unwrap();
    for t in 0..n {
        g.mv_lowbit(
            rt.kind,
            codes.ptr(),
            scales.ptr(),
            q.at(t * n_in),
            d.at(t * n_in / 32 * 4),
            s.at(t * n_in / 32 * 4),
            y1.ptr(),
            n_in,
            n_out,
            1,
            false,
        )
        .unwrap();
        let row: Vec<f32> = down(g, &y1, n_out);
        for o in 0..n_out {
            assert_eq!(
                row[o].to_bits(),
                yn[t * n_out + o].to_bits(),
                "{qt:?} [{n_in}x{n_out}] row {t} out {o}: n=1 {} vs n={n} {}",
                row[o],
                yn[t * n_out + o]
            );
        }
    }
    // grouped launch and accumulate mode under the same plan (the default K split depends on the
    // launch's total rows, so force the single launch's); n rows, then one row (the pipelined
    // kernels walk the groups of all segments as one stream)
    g.set_mv_override(Some(g.mv_plan(rt.kind, 1, n_out, n_in)));
    let launch = seg_launcher(g, rt.kind, &q, &d, &s, n_in);
    let one = whole_matrix(&codes, &scales, n_out);
    grouped_and_accumulate_checks(
        g,
        &rt,
        &codes,
        &scales,
        n_in,
        n_out,
        &yn,
        &[n, 1],
        &launch,
        &one,
        &mut rng,
        &format!("{qt:?} [{n_in}x{n_out}]"),
    );
    // vs exact emulation of the integer product (only float order differs)
    let em = emulate_q(&raw, qt, n_in, n_out, &x, n);
    let e1 = max_rel(&yn, &em);
    assert!(
        e1 < 1e-5,
        "{qt:?} [{n_in}x{n_out}] vs emulation: max rel {e1}"
    );
    // vs the f32-activation reference matvec (int8 activation error only)
    let refy = reference_mv(&raw, qt, n_in, n_out, &x, n);
    let e2 = nmse(&yn, &refy);
    assert!(e2 < 1e-3, "{qt:?} [{n_in}x{n_out}] vs reference: nmse {e2}");
    eprintln!(
        "mv {qt:?} [{n_in}x{n_out}] n={n} plan {:?}: emu max-rel {e1:.2e}, ref nmse {e2:.2e}, batch-invariant",
        g.mv_plan(rt.kind, 1, n_out, n_in)
    );
    g.set_mv_override(None);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn matvec_lowbit_real_shapes_vs_reference() {
    let g = need_gpu!("matvec_lowbit_real_shapes_vs_reference");
    for qt in LOWBIT_KINDS {
        run_mv(g, qt, 5120, 17408, 3, 1);
        run_mv(g, qt, 17408, 5120, 1, 2);
        run_mv(g, qt, 6144, 5120, 8, 3);
        run_mv(g, qt, 5120, 48, 5, 4);
        // ragged: n_out not a multiple of the rows per warp, n_in not a multiple of 32 sub-blocks
        run_mv(g, qt, 384, 50, 2, 5);
        // every variant: K split 1 / 2 / 4, 2, 4 or 8 rows per warp, weights loaded before or
        // after the PDL wait; the pipelined one-row kernels (`pipe`) with 2 or 4 rows per group
        for (i, (r, ks, pre, pipe)) in [
            (2, 1, true, false),
            (4, 2, false, false),
            (2, 4, true, false),
            (4, 4, true, false),
            (4, 1, false, false),
            (2, 1, false, true),
            (2, 2, false, true),
            (4, 4, true, true),
            (2, 4, true, true),
            (2, 1, true, true),
            (4, 2, false, true),
            (8, 1, true, false),
            (8, 2, false, false),
            (8, 4, true, false),
        ]
        .into_iter()
        .enumerate()
        {
            let plan = Some(MvPlan {
                pipe,
                ..MvPlan::dp4a(r, ks, pre)
            });
            run_mv_plan(g, qt, 17408, 5120, 4, 10 + i as u64, plan);
            run_mv_plan(g, qt, 384, 50, 3, 20 + i as u64, plan);
        }
        // n-row launches with 4 or 8 weight rows per warp equal the one-row launches too: n ≤ 5
        // on the 5-row kernels (`mv_*_n5r4`, `mv_*_n5r8`) or, with those off, on `mv_*_n8r4`;
        // n = 8 on `mv_*_n8r4`
        for (i, (r, ks, rn, n5)) in [
            (4, 1, 4, true),
            (8, 2, 4, false),
            (2, 4, 4, true),
            (8, 1, 8, true),
            (4, 2, 8, true),
            (4, 4, 8, false),
        ]
        .into_iter()
        .enumerate()
        {
            let plan = Some(MvPlan {
                rn,
                n5,
                ..MvPlan::dp4a(r, ks, true)
            });
            for n in [2, 5, 8] {
                run_mv_plan(g, qt, 17408, 5120, n, 30 + i as u64, plan);
                run_mv_plan(g, qt, 384, 50, n, 40 + i as u64, plan);
            }
        }
    }
}

/// `got` and `want` (`[rows, n_out]`) equal bit for bit; the first difference names its row and
/// output.
fn assert_rows_bits_eq(got: &[f32], want: &[f32], n_out: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: row {} out {}: {} vs {}",
            i / n_out,
            i % n_out,
            got[i],
            want[i]
        );
    }
}

/// The row-split dp4a verify kernels (`mv_*_n3r4s` / `mv_*_n3r8s`, [`Gpu::mv_rsplit`]): 4- and
/// 5-row launches split over 2 blocks of 3 activation rows give every row the one-row launch's
/// bits, and the 5-row kernel's, for every kind, K split and rows per warp, at real and ragged
/// shapes; grouped launches, accumulate mode and the exact emulation under the same plan. The
/// profiler confirms a row-split kernel ran (and none for 2 or 3 rows, which keep the 5-row one).
/// The 5-row kernels' rows-first forms ([`Gpu::mv_rows_first`], `_n5r4f` / `_n5r8f`) likewise, for
/// 2–5 rows.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn matvec_rsplit_equals_one_row() {
    let g = need_gpu!("matvec_rsplit_equals_one_row");
    let mut seed = 900;
    for qt in LOWBIT_KINDS {
        for (n_in, n_out) in [
            (6144, 5120),
            (17408, 5120),
            (5120, 17408),
            (384, 50),
            (1152, 37),
        ] {
            let n_max = 5;
            let c = LowbitCase::new(g, qt, n_in, n_out, n_max, seed);
            let segs = seg_launcher(g, c.rt.kind, &c.q, &c.d, &c.s, n_in);
            let one = whole_matrix(&c.codes, &c.scales, n_out);
            for ks in [1, 2, 4] {
                for rn in [4, 8] {
                    seed += 1;
                    let plan = MvPlan {
                        rn,
                        n5: true,
                        ..MvPlan::dp4a(4, ks, true)
                    };
                    g.set_mv_override(Some(plan));
                    let what = format!("{qt:?} [{n_in}x{n_out}] ks {ks} rn {rn}");
                    // the one-row rows (the oracle)
                    let y1 = one_row_rows(g, &segs, &one, n_max, n_out);
                    for n in 2..=n_max {
                        let y = g.alloc(n * n_out * 4).unwrap();
                        g.set_mv_rsplit(Some(true));
                        g.profile_begin();
                        segs(&[one(&y)], 0, n, false);
                        let prof = g.profile_end();
                        let ys = down::<f32>(g, &y, n * n_out);
                        let split = prof.iter().any(|(k, _)| k.contains("_n3r"));
                        assert_eq!(split, n >= 4, "{what} n={n}: row-split launch in {prof:?}");
                        g.set_mv_rsplit(Some(false));
                        segs(&[one(&y)], 0, n, false);
                        let y5 = down::<f32>(g, &y, n * n_out);
                        let w = format!("{what} n={n}");
                        assert_rows_bits_eq(
                            &ys,
                            &y1[..n * n_out],
                            n_out,
                            &format!("{w} split vs one-row"),
                        );
                        assert_rows_bits_eq(&ys, &y5, n_out, &format!("{w} split vs 5-row kernel"));
                        // the 5-row kernel's rows-first form (`Gpu::mv_rows_first`)
                        g.set_mv_rows_first(true);
                        g.profile_begin();
                        segs(&[one(&y)], 0, n, false);
                        let prof = g.profile_end();
                        g.set_mv_rows_first(false);
                        assert!(
                            prof.iter()
                                .any(|(k, _)| k.contains(&format!("_n5r{rn}f_k{ks}"))),
                            "{w}: rows-first launch in {prof:?}"
                        );
                        let yf = down::<f32>(g, &y, n * n_out);
                        assert_rows_bits_eq(
                            &yf,
                            &y1[..n * n_out],
                            n_out,
                            &format!("{w} rows first vs one-row"),
                        );
                    }
                    if n_out < 1000 {
                        // grouped, accumulate and the exact emulation (ragged shapes: the host
                        // emulation of the real ones is slow), row split and rows first
                        g.set_mv_rsplit(Some(true));
                        run_mv_plan(g, qt, n_in, n_out, 5, seed + 1000, Some(plan));
                        run_mv_plan(g, qt, n_in, n_out, 4, seed + 2000, Some(plan));
                        g.set_mv_rsplit(Some(false));
                        g.set_mv_rows_first(true);
                        run_mv_plan(g, qt, n_in, n_out, 5, seed + 3000, Some(plan));
                        run_mv_plan(g, qt, n_in, n_out, 3, seed + 4000, Some(plan));
                        g.set_mv_rows_first(false);
                    }
                }
            }
            eprintln!("rsplit {qt:?} [{n_in}x{n_out}]: n = 4, 5 split rows and n = 2..5 rows-first rows equal the one-row and 5-row launches");
        }
    }
    g.set_mv_rsplit(None);
    g.set_mv_override(None);
}

/// The staged decode kernels (`kernels/mvs.cu`) equal the plain one-row kernels of the same K
/// split bit for bit: every kind, K split, rows per warp, ring depth, before / after the PDL wait;
/// grouped launches whose segments end in partial tiles (rows of one matrix at row offsets), and
/// accumulate mode. The profiler confirms the staged kernel ran (no silent fallback).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn matvec_staged_equals_plain() {
    let g = need_gpu!("matvec_staged_equals_plain");
    let staged0 = g.mv_staged_mode();
    let mut cases = 0;
    for (qi, qt) in [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::Q2_0G64]
        .into_iter()
        .enumerate()
    {
        for (si, (n_in, n_out)) in [(5120, 6144), (6144, 5120), (17408, 1000), (1024, 300)]
            .into_iter()
            .enumerate()
        {
            let mut rng = Rng(700 + 10 * qi as u64 + si as u64);
            let raw = rand_lowbit(&mut rng, qt, n_in, n_out);
            let x = rng.vec(n_in, 1.0);
            let rt = retile(qt, &raw, n_in, n_out);
            let codes = g.upload(&rt.codes).unwrap();
            let scales = g.upload(&rt.scales).unwrap();
            let xb = g.upload(&x).unwrap();
            let nsb = n_in / 32;
            let q = g.alloc(n_in).unwrap();
            let d = g.alloc(nsb * 4).unwrap();
            let s = g.alloc(nsb * 4).unwrap();
            g.quant_rows(xb.ptr(), 1, n_in, q.ptr(), d.ptr(), s.ptr())
                .unwrap();
            let code_row = rt.codes.len() / n_out;
            let scale_row = rt.scales.len() * 2 / n_out; // bytes
                                                         // segments: rows [0, 37), [37, n_out - 5), [n_out - 5, n_out)
            let cuts = [0, 37, n_out - 5, n_out];
            let y0 = rng.vec(n_out, 1.0);
            let run = |staged: bool, acc: bool| -> (Vec<f32>, bool) {
                g.set_mv_staged(staged);
                let y = g.upload(&y0).unwrap();
                let segs: Vec<MvSeg> = cuts
                    .windows(2)
                    .map(|c| MvSeg {
                        codes: codes.ptr() + (c[0] * code_row) as u64,
                        scales: scales.ptr() + (c[0] * scale_row) as u64,
                        y: y.ptr() + (c[0] * 4) as u64,
                        n_out: c[1] - c[0],
                    })
                    .collect();
                g.profile_begin();
                g.mv_lowbit_multi(rt.kind, &segs, q.ptr(), d.ptr(), s.ptr(), n_in, 1, acc)
                    .unwrap();
                let ran = g.profile_end().iter().any(|(k, _)| k.starts_with("mvs_"));
                (down(g, &y, n_out), ran)
            };
            for ks in [1, 2, 4] {
                for r in [2, 4] {
                    // (ring stages, weights before the PDL wait, rows per warp: 0 = the layout's)
                    // (the last asks for more shared memory than a block may have on the widest
                    // shapes: those launches fall back to the plain kernel)
                    for (stages, pre, rows) in [
                        (0, true, 0),
                        (1, false, 0),
                        (2, true, 1),
                        (5, false, 2),
                        (2, false, 4),
                        (8, true, 4),
                    ] {
                        g.set_mv_override(Some(MvPlan::dp4a(r, ks, pre)));
                        g.set_mvs_stages(stages);
                        g.set_mvs_rows(rows);
                        for acc in [false, true] {
                            let (plain, ran_p) = run(false, acc);
                            let (staged, ran_s) = run(true, acc);
                            assert!(!ran_p, "the plain launch ran a staged kernel");
                            let smem =
                                bonsai_kernels_cuda::mvs_layout(rt.kind, n_in, r, ks, stages, rows)
                                    .expect("layout")
                                    .3;
                            let fits = smem + 1024 <= g.smem_optin().unwrap();
                            assert_eq!(
                                ran_s, fits,
                                "{qt:?} [{n_in}x{n_out}] r{r} k{ks} stages {stages} rows {rows}: \
                                 staged kernel ran {ran_s}, block needs {smem} bytes"
                            );
                            for o in 0..n_out {
                                assert_eq!(
                                    plain[o].to_bits(),
                                    staged[o].to_bits(),
                                    "{qt:?} [{n_in}x{n_out}] r{r} k{ks} stages {stages} rows {rows} \
                                     pre {pre} acc {acc} out {o}: plain {} staged {}",
                                    plain[o],
                                    staged[o]
                                );
                            }
                            cases += 1;
                        }
                    }
                }
            }
        }
    }
    // a shape the bulk copies cannot take (n_in not a multiple of 1024) falls back to the plain one
    assert!(bonsai_kernels_cuda::mvs_layout(WKind::Q1, 384, 4, 1, 0, 0).is_none());
    g.set_mv_override(None);
    g.set_mvs_stages(0);
    g.set_mvs_rows(0);
    g.set_mv_staged_mode(staged0);
    eprintln!("mvs: {cases} staged launches equal the plain ones bit for bit");
}

/// A decode gate‖up case for the SwiGLU-fused launches: random `qt` gate and up weights of
/// [n_in × n_out] (re-tiled, on the GPU), one quantized random activation row, and the unfused
/// result as words — the grouped one-row mat-vec (not staged, 4 rows per warp, K split 1) then
/// `swiglu_quant`: codes, scales, sums, f32. Leaves the staged mode off and that plan set.
struct SwiCase {
    kind: WKind,
    n_out: usize,
    gate: (DevBuf, DevBuf),
    up: (DevBuf, DevBuf),
    act: (DevBuf, DevBuf, DevBuf),
    want: [Vec<u32>; 4],
}

/// Output buffers of a SwiGLU launch of `n_out` values: f32, codes, scales, sums.
fn swi_outs(g: &Gpu, n_out: usize) -> (DevBuf, DevBuf, DevBuf, DevBuf) {
    let nb = n_out / 32;
    (
        g.alloc(n_out * 4).unwrap(),
        g.alloc(n_out).unwrap(),
        g.alloc(nb * 4).unwrap(),
        g.alloc(nb * 4).unwrap(),
    )
}

/// The [`QuantOut`] of the buffers [`swi_outs`] made.
fn quant_out((f, q, d, s): &(DevBuf, DevBuf, DevBuf, DevBuf)) -> QuantOut {
    QuantOut {
        f: f.ptr(),
        q: q.ptr(),
        d: d.ptr(),
        s: s.ptr(),
    }
}

fn swi_case(g: &Gpu, qt: QuantType, n_in: usize, n_out: usize, seed: u64) -> SwiCase {
    let mut rng = Rng(seed);
    let (rg, ru) = (
        retile(qt, &rand_lowbit(&mut rng, qt, n_in, n_out), n_in, n_out),
        retile(qt, &rand_lowbit(&mut rng, qt, n_in, n_out), n_in, n_out),
    );
    let gate = (g.upload(&rg.codes).unwrap(), g.upload(&rg.scales).unwrap());
    let up = (g.upload(&ru.codes).unwrap(), g.upload(&ru.scales).unwrap());
    let xb = g.upload(&rng.vec(n_in, 1.0)).unwrap();
    let act = (
        g.alloc(n_in).unwrap(),
        g.alloc(n_in / 8).unwrap(),
        g.alloc(n_in / 8).unwrap(),
    );
    g.quant_rows(xb.ptr(), 1, n_in, act.0.ptr(), act.1.ptr(), act.2.ptr())
        .unwrap();
    g.set_mv_staged_mode(bonsai_kernels_cuda::MvStaged::Off);
    g.set_mv_override(Some(MvPlan::dp4a(4, 1, true)));
    let (yg, yu) = (g.alloc(n_out * 4).unwrap(), g.alloc(n_out * 4).unwrap());
    let seg = |(c, sc): &(DevBuf, DevBuf), y: &DevBuf| MvSeg {
        codes: c.ptr(),
        scales: sc.ptr(),
        y: y.ptr(),
        n_out,
    };
    g.mv_lowbit_multi(
        rg.kind,
        &[seg(&gate, &yg), seg(&up, &yu)],
        act.0.ptr(),
        act.1.ptr(),
        act.2.ptr(),
        n_in,
        1,
        false,
    )
    .unwrap();
    let (hf, q, d, s) = swi_outs(g, n_out);
    g.swiglu_quant(
        yg.ptr(),
        yu.ptr(),
        1,
        n_out,
        hf.ptr(),
        q.ptr(),
        d.ptr(),
        s.ptr(),
    )
    .unwrap();
    let nb = n_out / 32;
    let want = [
        down(g, &q, n_out / 4),
        down(g, &d, nb),
        down(g, &s, nb),
        down(g, &hf, n_out),
    ];
    SwiCase {
        kind: rg.kind,
        n_out,
        gate,
        up,
        act,
        want,
    }
}

impl SwiCase {
    /// `Gpu::mv_swiglu` on this case under the current settings: `None` when it was refused
    /// (`Ok(false)`), else its codes, scales, sums and (with `f32_out`) f32 values as words.
    fn run(&self, g: &Gpu, n_in: usize, f32_out: bool) -> Option<[Vec<u32>; 4]> {
        let (hf, q, d, s) = swi_outs(g, self.n_out);
        let out = QuantOut {
            f: if f32_out { hf.ptr() } else { 0 },
            q: q.ptr(),
            d: d.ptr(),
            s: s.ptr(),
        };
        let ran = g
            .mv_swiglu(
                self.kind,
                (self.gate.0.ptr(), self.gate.1.ptr()),
                (self.up.0.ptr(), self.up.1.ptr()),
                self.n_out,
                n_in,
                (self.act.0.ptr(), self.act.1.ptr(), self.act.2.ptr()),
                out,
            )
            .unwrap();
        let nb = self.n_out / 32;
        ran.then(|| {
            [
                down(g, &q, self.n_out / 4),
                down(g, &d, nb),
                down(g, &s, nb),
                if f32_out {
                    down(g, &hf, self.n_out)
                } else {
                    Vec::new()
                },
            ]
        })
    }

    /// Assert `got` (from [`Self::run`]) equals the unfused result bit for bit.
    fn check(&self, got: &[Vec<u32>; 4], tag: &str) {
        for (i, name) in ["codes", "scales", "sums", "f32"].iter().enumerate() {
            if i < 3 || !got[3].is_empty() {
                assert_eq!(self.want[i], got[i], "{tag}: {name} differ");
            }
        }
    }
}

/// `mv_swiglu` (gate‖up with SwiGLU + quantize fused, a 2-block cluster per 32 outputs) against
/// the grouped one-row mat-vec then `swiglu_quant`, bit for bit (codes, scales, sums, f32), for
/// every weight type at the 27B ffn shape and a small one; every plan but 8 rows / K split 1 /
/// not staged is refused with `Ok(false)` and launches nothing.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn mv_swiglu_equals_matvec_then_swiglu() {
    let g = need_gpu!("mv_swiglu_equals_matvec_then_swiglu");
    let staged0 = g.mv_staged_mode();
    for (qi, qt) in [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::Q2_0G64]
        .into_iter()
        .enumerate()
    {
        for (si, (n_in, n_out)) in [(5120usize, 17408usize), (1024, 96)]
            .into_iter()
            .enumerate()
        {
            // (staged off from here on)
            let case = swi_case(g, qt, n_in, n_out, 900 + 10 * qi as u64 + si as u64);
            // fused, with and without the f32 output, with the weights before / after the PDL wait
            for (pre, f32_out) in [(true, true), (false, false)] {
                g.set_mv_override(Some(MvPlan::dp4a(8, 1, pre)));
                let tag = format!("{qt:?} [{n_in}x{n_out}] pre {pre}");
                let got = case.run(g, n_in, f32_out);
                case.check(
                    &got.unwrap_or_else(|| panic!("{tag}: the fused launch was refused")),
                    &tag,
                );
            }
            // other plans: refused
            for plan in [MvPlan::dp4a(8, 2, true), MvPlan::dp4a(4, 1, true)] {
                g.set_mv_override(Some(plan));
                assert!(
                    case.run(g, n_in, true).is_none(),
                    "{qt:?}: plan {plan:?} took the fused kernel"
                );
            }
            eprintln!("mv_swiglu {qt:?} [{n_in}x{n_out}]: bit-equal to mat-vec + swiglu_quant");
        }
    }
    g.set_mv_override(None);
    g.set_mv_staged_mode(staged0);
}

/// The staged SwiGLU launch (`mvs_*_swi`: `mv_swiglu` where gate‖up is staged) against the
/// plain grouped one-row mat-vec and `swiglu_quant`, bit for bit (codes, scales, sums, f32), for
/// every weight type at the 27B ffn shape and a small one, both row pairings per warp (plan r 2 /
/// 4), three ring depths, weights before and after the PDL wait; a K split of 2 is refused.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn mvs_swiglu_equals_matvec_then_swiglu() {
    use bonsai_kernels_cuda::MvStaged;
    let g = need_gpu!("mvs_swiglu_equals_matvec_then_swiglu");
    let staged0 = g.mv_staged_mode();
    let mut cases = 0;
    for (qi, qt) in [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::Q2_0G64]
        .into_iter()
        .enumerate()
    {
        for (si, (n_in, n_out)) in [(5120usize, 17408usize), (1024, 160)]
            .into_iter()
            .enumerate()
        {
            let case = swi_case(g, qt, n_in, n_out, 1900 + 10 * qi as u64 + si as u64);
            g.set_mv_staged_mode(MvStaged::All);
            for (r, stages, pre, f32_out) in [
                (2, 0, true, true),
                (4, 0, false, false),
                (2, 4, false, true),
                (4, 3, true, false),
            ] {
                g.set_mv_override(Some(MvPlan::dp4a(r, 1, pre)));
                g.set_mvs_stages(stages);
                let tag = format!("{qt:?} [{n_in}x{n_out}] r {r} stages {stages} pre {pre}");
                let got = case.run(g, n_in, f32_out);
                case.check(
                    &got.unwrap_or_else(|| panic!("{tag}: the staged fused launch was refused")),
                    &tag,
                );
                cases += 1;
            }
            // K split 2 (another float order): refused
            g.set_mv_override(Some(MvPlan::dp4a(2, 2, true)));
            assert!(
                case.run(g, n_in, false).is_none(),
                "{qt:?}: K split 2 took the staged SwiGLU kernel"
            );
            g.set_mvs_stages(0);
        }
    }
    g.set_mv_override(None);
    g.set_mv_staged_mode(staged0);
    eprintln!("mvs swi: {cases} staged fused launches equal mat-vec + swiglu_quant bit for bit");
}

/// A grouped low-bit mat-vec launch over the quantized activations `q`, `d`, `s` (rows of `n_in`):
/// `(segments, first activation row, rows, accumulate)`.
/// A random low-bit matrix re-tiled and uploaded, with `n_max` random activation rows quantized
/// on the device (`q` / `d` / `s`): the setup of the verify-kernel equality tests.
struct LowbitCase {
    rt: Retiled,
    codes: DevBuf,
    scales: DevBuf,
    q: DevBuf,
    d: DevBuf,
    s: DevBuf,
}

impl LowbitCase {
    fn new(g: &Gpu, qt: QuantType, n_in: usize, n_out: usize, n_max: usize, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let raw = rand_lowbit(&mut rng, qt, n_in, n_out);
        let rt = retile(qt, &raw, n_in, n_out);
        let codes = g.upload(&rt.codes).unwrap();
        let scales = g.upload(&rt.scales).unwrap();
        let x = rng.vec(n_max * n_in, 1.0);
        let xb = g.upload(&x).unwrap();
        let q = g.alloc(n_max * n_in).unwrap();
        let d = g.alloc(n_max * n_in / 32 * 4).unwrap();
        let s = g.alloc(n_max * n_in / 32 * 4).unwrap();
        g.quant_rows(xb.ptr(), n_max, n_in, q.ptr(), d.ptr(), s.ptr())
            .unwrap();
        LowbitCase {
            rt,
            codes,
            scales,
            q,
            d,
            s,
        }
    }
}

/// Rows `0..n_max` of a one-row launch each (the oracle of the n-row kernels), `[n_max, n_out]`.
fn one_row_rows(
    g: &Gpu,
    segs: &impl Fn(&[MvSeg], usize, usize, bool),
    one: &impl Fn(&DevBuf) -> MvSeg,
    n_max: usize,
    n_out: usize,
) -> Vec<f32> {
    let yr = g.alloc(n_out * 4).unwrap();
    let mut y1 = Vec::with_capacity(n_max * n_out);
    for t in 0..n_max {
        segs(&[one(&yr)], t, 1, false);
        y1.extend(down::<f32>(g, &yr, n_out));
    }
    y1
}

fn seg_launcher<'a>(
    g: &'a Gpu,
    kind: WKind,
    q: &'a DevBuf,
    d: &'a DevBuf,
    s: &'a DevBuf,
    n_in: usize,
) -> impl Fn(&[MvSeg], usize, usize, bool) + 'a {
    let nsb = n_in / 32;
    move |segs, t0, n, acc| {
        g.mv_lowbit_multi(
            kind,
            segs,
            q.at(t0 * n_in),
            d.at(t0 * nsb * 4),
            s.at(t0 * nsb * 4),
            n_in,
            n,
            acc,
        )
        .unwrap()
    }
}

/// The segment of the whole matrix (`n_out` rows) writing into `y`.
fn whole_matrix<'a>(
    codes: &'a DevBuf,
    scales: &'a DevBuf,
    n_out: usize,
) -> impl Fn(&DevBuf) -> MvSeg + 'a {
    move |y| MvSeg {
        codes: codes.ptr(),
        scales: scales.ptr(),
        y: y.ptr(),
        n_out,
    }
}

/// Shared by every low-bit mat-vec case. Grouped launch: the matrix as segments 0 and 2, its last
/// row alone as segment 1, each equal to the single-matrix result `y1` `[rows, n_out]` bit for bit,
/// for every n in `ns` (n ≤ rows). Accumulate mode (min(5, max ns) rows): y = y0 + W·x, the same
/// f32 addition the host does.
#[allow(clippy::too_many_arguments)]
fn grouped_and_accumulate_checks<L, O>(
    g: &Gpu,
    rt: &Retiled,
    codes: &DevBuf,
    scales: &DevBuf,
    n_in: usize,
    n_out: usize,
    y1: &[f32],
    ns: &[usize],
    launch: &L,
    one: &O,
    rng: &mut Rng,
    what: &str,
) where
    L: Fn(&[MvSeg], usize, usize, bool),
    O: Fn(&DevBuf) -> MvSeg,
{
    // grouped: the matrix as segments 0 and 2, its last row alone as segment 1
    let nb = rt.codes.len() / n_out;
    let sb = rt.scales.len() / n_out * 2;
    for &n in ns {
        let ya = g.alloc(n * n_out * 4).unwrap();
        let ylast = g.alloc(n * 4).unwrap();
        let yc = g.alloc(n * n_out * 4).unwrap();
        let segs = [
            one(&ya),
            MvSeg {
                codes: codes.at((n_out - 1) * nb),
                scales: scales.at((n_out - 1) * sb),
                y: ylast.ptr(),
                n_out: 1,
            },
            one(&yc),
        ];
        launch(&segs, 0, n, false);
        let (ga, gl, gc): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            down(g, &ya, n * n_out),
            down(g, &ylast, n),
            down(g, &yc, n * n_out),
        );
        for t in 0..n {
            assert_eq!(
                gl[t].to_bits(),
                y1[t * n_out + n_out - 1].to_bits(),
                "{what} [{n_in}x{n_out}] grouped 1-row segment, n={n} row {t}"
            );
            for o in 0..n_out {
                let w = y1[t * n_out + o].to_bits();
                assert_eq!(
                    ga[t * n_out + o].to_bits(),
                    w,
                    "{what} grouped seg 0 n={n} row {t} out {o}"
                );
                assert_eq!(
                    gc[t * n_out + o].to_bits(),
                    w,
                    "{what} grouped seg 2 n={n} row {t} out {o}"
                );
            }
        }
    }
    // accumulate: y = y0 + W·x, the same f32 addition the host does
    let n = ns.iter().copied().max().unwrap_or(1).min(5);
    let y0 = rng.vec(n * n_out, 3.0);
    let yb = g.upload(&y0).unwrap();
    launch(&[one(&yb)], 0, n, true);
    let ya: Vec<f32> = down(g, &yb, n * n_out);
    for i in 0..n * n_out {
        assert_eq!(
            ya[i].to_bits(),
            (y0[i] + y1[i]).to_bits(),
            "{what} [{n_in}x{n_out}] accumulate row {} out {}",
            i / n_out,
            i % n_out
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn mv_f32_vs_reference() {
    let g = need_gpu!("mv_f32_vs_reference");
    let mut rng = Rng(9);
    let (n_in, n_out, n) = (512, 300, 2);
    let w = rng.vec(n_in * n_out, 1.0);
    let x = rng.vec(n * n_in, 1.0);
    let wb = g.upload(&w).unwrap();
    let xb = g.upload(&x).unwrap();
    let y = g.alloc(n * n_out * 4).unwrap();
    g.mv_f32(wb.ptr(), xb.ptr(), y.ptr(), n_in, n_out, n, false)
        .unwrap();
    let got: Vec<f32> = down(g, &y, n * n_out);
    let raw: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut want = vec![0f32; n * n_out];
    for t in 0..n {
        r::matvec(
            &raw,
            QuantType::F32,
            n_in,
            n_out,
            &x[t * n_in..(t + 1) * n_in],
            &mut want[t * n_out..(t + 1) * n_out],
        );
    }
    assert!(max_rel(&got, &want) < 1e-5);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn embed_rows_bit_exact() {
    let g = need_gpu!("embed_rows_bit_exact");
    let mut rng = Rng(5);
    for qt in [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::Q2_0G64] {
        let (n_in, n_out) = (5120, 64);
        let raw = rand_lowbit(&mut rng, qt, n_in, n_out);
        let rt = retile(qt, &raw, n_in, n_out);
        let codes = g.upload(&rt.codes).unwrap();
        let scales = g.upload(&rt.scales).unwrap();
        // the last two ids are outside the table: they read nothing and embed zeros
        let ids = [3i32, 63, 0, 64, i32::MAX];
        let ib = g.upload(&ids).unwrap();
        let x = g.alloc(ids.len() * n_in * 4).unwrap();
        g.embed_rows(
            rt.kind,
            codes.ptr(),
            scales.ptr(),
            0,
            ib.ptr(),
            ids.len(),
            n_out,
            n_in,
            x.ptr(),
        )
        .unwrap();
        let got: Vec<f32> = down(g, &x, ids.len() * n_in);
        assert!(
            got[3 * n_in..].iter().all(|&v| v.to_bits() == 0),
            "{qt:?}: ids outside the table embed zeros"
        );
        let rb = qt.row_bytes(n_in).unwrap();
        let mut want = vec![0f32; n_in];
        for (t, &id) in ids[..3].iter().enumerate() {
            let id = id as usize;
            dequantize_row(qt, &raw[id * rb..(id + 1) * rb], &mut want);
            for i in 0..n_in {
                assert_eq!(
                    got[t * n_in + i].to_bits(),
                    want[i].to_bits(),
                    "{qt:?} row {id} elem {i}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn rmsnorm_quant_vs_reference() {
    let g = need_gpu!("rmsnorm_quant_vs_reference");
    let mut rng = Rng(11);
    let (n, k) = (3, 5120);
    let x = rng.vec(n * k, 3.0);
    let w = rng
        .vec(k, 1.0)
        .iter()
        .map(|v| 1.0 + v * 0.5)
        .collect::<Vec<_>>();
    let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let (xf, q, _, s) = rmsnorm_rows(g, &xb, &wb, 0, n, k, true);
    let got: Vec<f32> = xf.iter().map(|&b| f32::from_bits(b)).collect();
    let mut want = vec![0f32; n * k];
    for t in 0..n {
        r::rmsnorm(
            &x[t * k..(t + 1) * k],
            &w,
            1e-6,
            &mut want[t * k..(t + 1) * k],
        );
    }
    let e = max_rel(&got, &want);
    assert!(e < 1e-5, "rmsnorm max rel {e}");
    // the quantized codes are the host quantization of the device's own f32 output
    let (hq, _, hs) = host_quant(&got, k);
    assert_eq!(q, hq);
    assert_eq!(s, hs);

    // prefill-sized launches split a row into fewer blocks (several segments each, uneven at
    // k = 6144, n = 100): every row equals the decode launch's bit for bit
    for (k, nbig) in [(5120usize, 300usize), (6144, 100), (17408, 64)] {
        let x = rng.vec(nbig * k, 3.0);
        let w: Vec<f32> = rng.vec(k, 1.0).iter().map(|v| 1.0 + v * 0.5).collect();
        let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let big = rmsnorm_rows(g, &xb, &wb, 0, nbig, k, true);
        // the long launch without the f32 copy writes the same codes
        let nof = rmsnorm_rows(g, &xb, &wb, 0, nbig, k, false);
        assert!(nof.0.is_empty());
        assert_eq!(nof.1, big.1, "k={k}: codes differ without the f32 output");
        assert_eq!(nof.2, big.2, "k={k}: scales differ without the f32 output");
        assert_eq!(nof.3, big.3, "k={k}: sums differ without the f32 output");
        for t0 in (0..nbig).step_by(nbig / 5) {
            let nr = bonsai_kernels_cuda::MAX_ROWS.min(nbig - t0);
            let small = rmsnorm_rows(g, &xb, &wb, t0, nr, k, true);
            let (a, b) = (t0 * k, (t0 + nr) * k);
            assert_eq!(small.0[..], big.0[a..b], "k={k} rows {t0}..: xf differs");
            assert_eq!(small.1[..], big.1[a..b], "k={k} rows {t0}..: q differs");
            assert_eq!(
                small.2[..],
                big.2[a / 32..b / 32],
                "k={k} rows {t0}..: d differs"
            );
            assert_eq!(
                small.3[..],
                big.3[a / 32..b / 32],
                "k={k} rows {t0}..: s differs"
            );
        }
        eprintln!("rmsnorm_quant k={k}: an n={nbig} launch equals n<=8 launches bit for bit");
    }
}

/// `rmsnorm_quant_p16`: the int8 outputs and the f32 row are those of `rmsnorm_quant`, and the
/// b1-plane outputs (planes, units, sums) are `host_quant_p16` of the device's own f32 row, bit for
/// bit, for 1 and 5 rows at the 27B widths; skipping the int8 codes (`q = 0`), then the planes
/// too (`xp = 0`), leaves the other outputs' bits and the skipped buffers untouched; widths that
/// are not a multiple of 256 and output sets that make no sense are refused.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn rmsnorm_quant_p16_equals_host_twin() {
    let g = need_gpu!("rmsnorm_quant_p16_equals_host_twin");
    let mut rng = Rng(12);
    for (n, k) in [(1usize, 5120usize), (5, 5120), (2, 6144), (1, 256)] {
        let mut x = rng.vec(n * k, 3.0);
        x[k / 2] = 300.0; // an outlier block
        let w: Vec<f32> = rng.vec(k, 1.0).iter().map(|v| 1.0 + v * 0.5).collect();
        let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let (xf, q, d, s) = (
            g.alloc(n * k * 4).unwrap(),
            g.alloc(n * k).unwrap(),
            g.alloc(n * k / 32 * 4).unwrap(),
            g.alloc(n * k / 32 * 4).unwrap(),
        );
        // one launch of the norm on this row set: (xf, q, d, s) and the b1-plane outputs
        let norm = |xf: u64, q: u64, d: u64, s: u64, p: (u64, u64, u64, u64)| {
            g.rmsnorm_quant_p16(xb.ptr(), wb.ptr(), 1e-6, n, k, xf, q, d, s, p)
                .unwrap()
        };
        let ptrs = |p: &[DevBuf; 4]| (p[0].ptr(), p[1].ptr(), p[2].ptr(), p[3].ptr());
        // u32 words of the planes, units, sums and byte-split codes
        let words = [n * k / 2, n * k / 128, n * k / 32, n * k / 2];
        let what = ["planes", "units", "sums", "byte-split codes"];
        // the b1-plane outputs `from..` of `b` equal those of `a`, word for word
        let same_p16 = |a: &[DevBuf; 4], b: &[DevBuf; 4], from: usize, case: &str| {
            for i in from..4 {
                assert_eq!(
                    down::<u32>(g, &b[i], words[i]),
                    down::<u32>(g, &a[i], words[i]),
                    "[{n} x {k}] {} {case}",
                    what[i]
                );
            }
        };
        let p16 = p16_alloc(g, n, k);
        norm(xf.ptr(), q.ptr(), d.ptr(), s.ptr(), ptrs(&p16));
        let (xf0, q0, d0, s0) = rmsnorm_rows(g, &xb, &wb, 0, n, k, true);
        let got_f: Vec<u32> = down(g, &xf, n * k);
        assert_eq!(got_f, xf0, "[{n} x {k}] f32 row");
        // the int8 outputs of `q`, `d`, `s` are those of `rmsnorm_quant`
        let same_int8 = |q: &DevBuf, d: &DevBuf, s: &DevBuf, case: &str| {
            assert_eq!(down::<i8>(g, q, n * k), q0, "[{n} x {k}] codes {case}");
            assert_eq!(
                down::<u32>(g, d, n * k / 32),
                d0,
                "[{n} x {k}] scales {case}"
            );
            assert_eq!(down::<i32>(g, s, n * k / 32), s0, "[{n} x {k}] sums {case}");
        };
        same_int8(&q, &d, &s, "");
        let rows: Vec<f32> = got_f.iter().map(|&b| f32::from_bits(b)).collect();
        assert_p16_eq_host(g, &rows, n, k, &p16, true, &format!("rmsnorm [{n} x {k}]"));
        // 2 and 3 segments per block (Gpu::norm_segs): every output the same bits
        for segs in [2usize, 3] {
            let segs0 = g.norm_segs();
            g.set_norm_segs(segs);
            let (q3, d3, s3) = (
                g.alloc(n * k).unwrap(),
                g.alloc(n * k / 32 * 4).unwrap(),
                g.alloc(n * k / 32 * 4).unwrap(),
            );
            let p16s = p16_alloc(g, n, k);
            norm(0, q3.ptr(), d3.ptr(), s3.ptr(), ptrs(&p16s));
            g.set_norm_segs(segs0);
            let case = format!("with {segs} segments per block");
            same_int8(&q3, &d3, &s3, &case);
            same_p16(&p16, &p16s, 0, &case);
        }
        // the int8 codes skipped (q = 0): the same b1-plane outputs, the int8 buffers untouched
        let p16b = p16_alloc(g, n, k);
        let poison = vec![0x5a5a_5a5au32; n * k / 4];
        g.htod(&q, 0, &poison).unwrap();
        norm(0, 0, d.ptr(), s.ptr(), ptrs(&p16b));
        same_p16(&p16, &p16b, 0, "without the int8 codes");
        assert_eq!(
            down::<u32>(g, &q, n * k / 4),
            poison,
            "[{n} x {k}] codes written with q = 0"
        );
        assert_eq!(
            down::<u32>(g, &d, n * k / 32),
            d0,
            "[{n} x {k}] scales touched with q = 0"
        );
        assert_eq!(
            down::<i32>(g, &s, n * k / 32),
            s0,
            "[{n} x {k}] sums touched with q = 0"
        );
        // the planes skipped too (xp = 0; what the int8 tensor-core verify reads): the same
        // units, sums and byte-split codes, the planes untouched
        let p16c = p16_alloc(g, n, k);
        let ppoison = vec![0xa5a5_a5a5u32; n * k / 2];
        g.htod(&p16c[0], 0, &ppoison).unwrap();
        let (_, zu, zs, zv) = ptrs(&p16c);
        norm(0, 0, d.ptr(), s.ptr(), (0, zu, zs, zv));
        same_p16(&p16, &p16c, 1, "without the planes");
        assert_eq!(
            down::<u32>(g, &p16c[0], n * k / 2),
            ppoison,
            "[{n} x {k}] planes written with xp = 0"
        );
        eprintln!(
            "rmsnorm_quant_p16 [{n} x {k}]: int8 outputs unchanged, b1-plane outputs and byte-split codes == host twin, the same with the int8 codes skipped and with the planes skipped"
        );
    }
    let z = g.alloc(1 << 16).unwrap();
    let p = z.ptr();
    assert!(g
        .rmsnorm_quant_p16(p, p, 1e-6, 1, 384, 0, p, p, p, (p, p, p, 0))
        .is_err());
    // byte-split codes without the units and sums
    assert!(g
        .rmsnorm_quant_p16(p, p, 1e-6, 1, 256, 0, p, p, p, (0, 0, 0, p))
        .is_err());
    // units and sums with neither planes nor byte-split codes
    assert!(g
        .rmsnorm_quant_p16(p, p, 1e-6, 1, 256, 0, p, p, p, (0, p, p, 0))
        .is_err());
    // no int8 codes and no planes: nothing to write
    assert!(g
        .rmsnorm_quant_p16(p, p, 1e-6, 1, 256, 0, 0, p, p, (0, 0, 0, 0))
        .is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_quant_p16_equals_host_twin() {
    let g = need_gpu!("swiglu_quant_p16_equals_host_twin");
    let mut rng = Rng(31);
    for (n, k) in [(1usize, 17408usize), (5, 17408), (8, 256)] {
        let gt = rng.vec(n * k, 4.0);
        let mut upv = rng.vec(n * k, 2.0);
        upv[k / 3] = 500.0; // an outlier block
        let (gb, ub) = (g.upload(&gt).unwrap(), g.upload(&upv).unwrap());
        // swiglu_quant's f32 values are the reference (its int8 outputs: n·k codes, as one row)
        let (rf, rq, rd, rs) = swi_outs(g, n * k);
        g.swiglu_quant(
            gb.ptr(),
            ub.ptr(),
            n,
            k,
            rf.ptr(),
            rq.ptr(),
            rd.ptr(),
            rs.ptr(),
        )
        .unwrap();
        let want_f: Vec<u32> = down(g, &rf, n * k);
        let rows: Vec<f32> = want_f.iter().map(|&b| f32::from_bits(b)).collect();
        for with_xv in [false, true] {
            let hf = g.alloc(n * k * 4).unwrap();
            let p16 = p16_alloc(g, n, k);
            g.swiglu_quant_p16(gb.ptr(), ub.ptr(), n, k, hf.ptr(), p16_out(&p16, with_xv))
                .unwrap();
            assert_eq!(down::<u32>(g, &hf, n * k), want_f, "[{n} x {k}] f32");
            assert_p16_eq_host(
                g,
                &rows,
                n,
                k,
                &p16,
                with_xv,
                &format!("swiglu_quant_p16 [{n} x {k}]"),
            );
        }
        eprintln!("swiglu_quant_p16 [{n} x {k}]: f32 == swiglu_quant, b1-plane outputs and byte-split codes == host twin");
    }
    // widths that are not whole 256-element pairs are refused
    let z = g.alloc(1 << 16).unwrap();
    let p = z.ptr();
    let bad = P16Out {
        xp: p,
        xu: p,
        xs: p,
        xv: 0,
    };
    assert!(g.swiglu_quant_p16(p, p, 1, 384, 0, bad).is_err());
}

/// A fresh b1-plane activation set for `n` rows of width `k`: planes, units, sums, byte-split codes.
fn p16_alloc(g: &Gpu, n: usize, k: usize) -> [DevBuf; 4] {
    [
        g.alloc(n * k * 2).unwrap(),
        g.alloc(n * k / 128 * 4).unwrap(),
        g.alloc(n * k / 128 * 16).unwrap(),
        g.alloc(n * k * 2).unwrap(),
    ]
}

/// [`p16_alloc`]'s buffers as a [`P16Out`] (the byte-split codes only `with_xv`).
fn p16_out(b: &[DevBuf; 4], with_xv: bool) -> P16Out {
    P16Out {
        xp: b[0].ptr(),
        xu: b[1].ptr(),
        xs: b[2].ptr(),
        xv: if with_xv { b[3].ptr() } else { 0 },
    }
}

/// The b1-plane activations a kernel wrote into `b` for `n` rows of width `k` equal the host twin
/// ([`host_quant_p16`], and with `with_xv` [`b1q_acts_host`] for the byte-split codes) of the f32
/// values `rows` `[n, k]`, bit for bit.
fn assert_p16_eq_host(
    g: &Gpu,
    rows: &[f32],
    n: usize,
    k: usize,
    b: &[DevBuf; 4],
    with_xv: bool,
    tag: &str,
) {
    let planes: Vec<u32> = down(g, &b[0], n * k / 2);
    let us: Vec<u32> = down(g, &b[1], n * k / 128);
    let sums: Vec<i32> = down(g, &b[2], n * k / 32);
    let split: Vec<u8> = if with_xv {
        down(g, &b[3], n * k * 2)
    } else {
        Vec::new()
    };
    for t in 0..n {
        let (hp, hu, hs, hc) = host_quant_p16(&rows[t * k..(t + 1) * k]);
        assert_eq!(
            &planes[t * k / 2..(t + 1) * k / 2],
            &hp[..],
            "{tag}: row {t} planes"
        );
        let hu: Vec<u32> = hu.iter().map(|v| v.to_bits()).collect();
        assert_eq!(
            &us[t * k / 128..(t + 1) * k / 128],
            &hu[..],
            "{tag}: row {t} units"
        );
        assert_eq!(
            &sums[t * k / 32..(t + 1) * k / 32],
            &hs[..],
            "{tag}: row {t} sums"
        );
        if with_xv {
            assert_eq!(
                &split[t * k * 2..(t + 1) * k * 2],
                &b1q_acts_host(&hc)[..],
                "{tag}: row {t} byte-split codes"
            );
        }
    }
}

/// One `rmsnorm_quant` launch (eps 1e-6) over rows `off..off + n` of `xb` (width `k`): the f32
/// output as bits (empty without `f32_out`), the codes, the scales as bits and the sums.
fn rmsnorm_rows(
    g: &Gpu,
    xb: &DevBuf,
    wb: &DevBuf,
    off: usize,
    n: usize,
    k: usize,
    f32_out: bool,
) -> (Vec<u32>, Vec<i8>, Vec<u32>, Vec<i32>) {
    let xf = g.alloc(n * k * 4).unwrap();
    let q = g.alloc(n * k).unwrap();
    let d = g.alloc(n * k / 32 * 4).unwrap();
    let s = g.alloc(n * k / 32 * 4).unwrap();
    g.rmsnorm_quant(
        xb.at(off * k * 4),
        wb.ptr(),
        1e-6,
        n,
        k,
        if f32_out { xf.ptr() } else { 0 },
        q.ptr(),
        d.ptr(),
        s.ptr(),
    )
    .unwrap();
    (
        if f32_out {
            down::<u32>(g, &xf, n * k)
        } else {
            Vec::new()
        },
        down::<i8>(g, &q, n * k),
        down::<u32>(g, &d, n * k / 32),
        down::<i32>(g, &s, n * k / 32),
    )
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gdn_conv_and_step_vs_reference_real_shapes() {
    let g = need_gpu!("gdn_conv_and_step_vs_reference_real_shapes");
    let mut rng = Rng(21);
    let (hk, hv, dk, kconv, n) = (16usize, 48usize, 128usize, 4usize, 3usize);
    let dv = dk;
    let conv_dim = 2 * hk * dk + hv * dv;
    let eps = 1e-6f32;
    let mixed = rng.vec(n * conv_dim, 1.0);
    let mut conv_state = rng.vec((kconv - 1) * conv_dim, 1.0);
    let convw = rng.vec(conv_dim * kconv, 0.5);
    let bb = rng.vec(n * hv, 2.0);
    let aa = rng.vec(n * hv, 2.0);
    let dt_bias = rng.vec(hv, 1.0);
    let ssm_a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
    let mut s0 = rng.vec(hv * dk * dv, 0.1);

    let b = |v: &[f32]| g.upload(v).unwrap();
    let (mb, cb, wb, bbb, aab, dtb, ab) = (
        b(&mixed),
        b(&conv_state),
        b(&convw),
        b(&bb),
        b(&aa),
        b(&dt_bias),
        b(&ssm_a),
    );
    let z = |k: usize| g.alloc(k * 4).unwrap();
    let (qo, ko, vo, beta, gg) = (
        z(n * hk * dk),
        z(n * hk * dk),
        z(n * hv * dv),
        z(n * hv),
        z(n * hv),
    );
    g.gdn_conv(
        mb.ptr(),
        cb.ptr(),
        wb.ptr(),
        kconv,
        hk,
        hv,
        dk,
        n,
        eps,
        qo.ptr(),
        ko.ptr(),
        vo.ptr(),
        bbb.ptr(),
        aab.ptr(),
        dtb.ptr(),
        ab.ptr(),
        beta.ptr(),
        gg.ptr(),
    )
    .unwrap();
    let sb = b(&s0);
    let out = z(n * hv * dv);
    g.gdn_step(
        sb.ptr(),
        qo.ptr(),
        ko.ptr(),
        vo.ptr(),
        gg.ptr(),
        beta.ptr(),
        hk,
        hv,
        dk,
        dv,
        n,
        out.ptr(),
    )
    .unwrap();

    // reference
    let qk = hk * dk;
    let (mut rq, mut rk, mut rv) = (
        vec![0f32; n * qk],
        vec![0f32; n * qk],
        vec![0f32; n * hv * dv],
    );
    let (mut rbeta, mut rg) = (vec![0f32; n * hv], vec![0f32; n * hv]);
    let mut c = vec![0f32; conv_dim];
    for t in 0..n {
        r::conv1d_silu_step(
            &mut conv_state,
            &mixed[t * conv_dim..(t + 1) * conv_dim],
            &convw,
            kconv,
            &mut c,
        );
        rq[t * qk..(t + 1) * qk].copy_from_slice(&c[..qk]);
        r::l2norm_heads(&mut rq[t * qk..(t + 1) * qk], dk, eps);
        rk[t * qk..(t + 1) * qk].copy_from_slice(&c[qk..2 * qk]);
        r::l2norm_heads(&mut rk[t * qk..(t + 1) * qk], dk, eps);
        rv[t * hv * dv..(t + 1) * hv * dv].copy_from_slice(&c[2 * qk..]);
        for h in 0..hv {
            rbeta[t * hv + h] = r::sigmoid(bb[t * hv + h]);
            rg[t * hv + h] = ssm_a[h] * r::softplus(aa[t * hv + h] + dt_bias[h]);
        }
    }
    let chk = |name: &str, got: Vec<f32>, want: &[f32], tol: f32| {
        let e = max_rel(&got, want);
        assert!(e < tol, "{name}: max rel {e}");
        eprintln!("gdn {name}: max rel {e:.2e}");
    };
    chk(
        "conv state",
        down(g, &cb, (kconv - 1) * conv_dim),
        &conv_state,
        1e-6,
    );
    chk("q", down(g, &qo, n * qk), &rq, 1e-5);
    chk("k", down(g, &ko, n * qk), &rk, 1e-5);
    chk("v", down(g, &vo, n * hv * dv), &rv, 1e-5);
    chk("beta", down(g, &beta, n * hv), &rbeta, 1e-5);
    chk("g", down(g, &gg, n * hv), &rg, 1e-5);
    let mut ro = vec![0f32; n * hv * dv];
    for t in 0..n {
        r::gdn_step(
            &mut s0,
            &rq[t * qk..(t + 1) * qk],
            &rk[t * qk..(t + 1) * qk],
            &rv[t * hv * dv..(t + 1) * hv * dv],
            &rg[t * hv..(t + 1) * hv],
            &rbeta[t * hv..(t + 1) * hv],
            hk,
            dk,
            dv,
            &mut ro[t * hv * dv..(t + 1) * hv * dv],
        );
    }
    chk("o", down(g, &out, n * hv * dv), &ro, 1e-4);
    chk("S", down(g, &sb, hv * dk * dv), &s0, 1e-4);

    // batch invariance of the recurrence: n steps in one launch == n launches of one step
    let s1 = g.upload(&down::<f32>(g, &sb, hv * dk * dv)).unwrap();
    let s2 = g.upload(&down::<f32>(g, &sb, hv * dk * dv)).unwrap();
    let (o1, o2) = (z(n * hv * dv), z(hv * dv));
    g.gdn_step(
        s1.ptr(),
        qo.ptr(),
        ko.ptr(),
        vo.ptr(),
        gg.ptr(),
        beta.ptr(),
        hk,
        hv,
        dk,
        dv,
        n,
        o1.ptr(),
    )
    .unwrap();
    let all: Vec<f32> = down(g, &o1, n * hv * dv);
    for t in 0..n {
        g.gdn_step(
            s2.ptr(),
            qo.at(t * qk * 4),
            ko.at(t * qk * 4),
            vo.at(t * hv * dv * 4),
            gg.at(t * hv * 4),
            beta.at(t * hv * 4),
            hk,
            hv,
            dk,
            dv,
            1,
            o2.ptr(),
        )
        .unwrap();
        let one: Vec<f32> = down(g, &o2, hv * dv);
        assert!(
            one.iter()
                .zip(&all[t * hv * dv..])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {t}"
        );
    }
    let (sa, sb2): (Vec<f32>, Vec<f32>) = (down(g, &s1, hv * dk * dv), down(g, &s2, hv * dk * dv));
    assert!(sa.iter().zip(&sb2).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gated_norm_and_swiglu_vs_reference() {
    let g = need_gpu!("gated_norm_and_swiglu_vs_reference");
    let mut rng = Rng(31);
    let (n, hv, dv) = (2, 48, 128);
    let o = rng.vec(n * hv * dv, 1.0);
    let zz = rng.vec(n * hv * dv, 2.0);
    let w = rng.vec(dv, 1.0);
    let (ob, zb, wb) = (
        g.upload(&o).unwrap(),
        g.upload(&zz).unwrap(),
        g.upload(&w).unwrap(),
    );
    let k = hv * dv;
    let yf = g.alloc(n * k * 4).unwrap();
    let q = g.alloc(n * k).unwrap();
    let d = g.alloc(n * k / 32 * 4).unwrap();
    let s = g.alloc(n * k / 32 * 4).unwrap();
    g.gated_norm_quant(
        ob.ptr(),
        zb.ptr(),
        wb.ptr(),
        1e-6,
        n,
        hv,
        dv,
        yf.ptr(),
        q.ptr(),
        d.ptr(),
        s.ptr(),
    )
    .unwrap();
    let mut want = o.clone();
    r::rmsnorm_heads(&mut want, dv, &w, 1e-6);
    for (a, zi) in want.iter_mut().zip(&zz) {
        *a *= r::silu(*zi);
    }
    let got: Vec<f32> = down(g, &yf, n * k);
    assert!(
        max_rel(&got, &want) < 1e-5,
        "gated norm {}",
        max_rel(&got, &want)
    );
    assert_eq!(down::<i8>(g, &q, n * k), host_quant(&got, k).0);
    // a prefill-sized launch (the one-warp-per-head kernel): on the shared rows the same bits as
    // the short launch (f32 output, codes, scales, sums), everywhere the host quantization of its
    // own output; then without the f32 output, the same codes
    {
        let nl = 300;
        let mut o_l = o.clone();
        o_l.extend(rng.vec((nl - n) * k, 1.0));
        let mut z_l = zz.clone();
        z_l.extend(rng.vec((nl - n) * k, 2.0));
        let (obl, zbl) = (g.upload(&o_l).unwrap(), g.upload(&z_l).unwrap());
        let yfl = g.alloc(nl * k * 4).unwrap();
        let ql = g.alloc(nl * k).unwrap();
        let dl = g.alloc(nl * k / 32 * 4).unwrap();
        let sl = g.alloc(nl * k / 32 * 4).unwrap();
        for with_f32 in [true, false] {
            g.gated_norm_quant(
                obl.ptr(),
                zbl.ptr(),
                wb.ptr(),
                1e-6,
                nl,
                hv,
                dv,
                if with_f32 { yfl.ptr() } else { 0 },
                ql.ptr(),
                dl.ptr(),
                sl.ptr(),
            )
            .unwrap();
            let got_l: Vec<f32> = down(g, &yfl, nl * k);
            assert!(
                bits_eq(&got_l[..n * k], &got),
                "gated norm: long launch f32 rows differ from the short launch"
            );
            let (hq, hd, hs) = host_quant(&got_l, k);
            assert_eq!(down::<i8>(g, &ql, nl * k), hq, "gated norm long: codes");
            assert_eq!(
                down::<u32>(g, &dl, nl * k / 32),
                hd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "gated norm long: scales"
            );
            assert_eq!(
                down::<i32>(g, &sl, nl * k / 32),
                hs,
                "gated norm long: sums"
            );
            assert_eq!(
                down::<i32>(g, &s, n * k / 32)[..],
                down::<i32>(g, &sl, nl * k / 32)[..n * k / 32],
                "gated norm: long launch sums differ from the short launch"
            );
        }
    }

    let ff = 17408;
    let gt = rng.vec(n * ff, 3.0);
    let up = rng.vec(n * ff, 3.0);
    let (gb, ub) = (g.upload(&gt).unwrap(), g.upload(&up).unwrap());
    let hf = g.alloc(n * ff * 4).unwrap();
    let q2 = g.alloc(n * ff).unwrap();
    let d2 = g.alloc(n * ff / 32 * 4).unwrap();
    let s2 = g.alloc(n * ff / 32 * 4).unwrap();
    g.swiglu_quant(
        gb.ptr(),
        ub.ptr(),
        n,
        ff,
        hf.ptr(),
        q2.ptr(),
        d2.ptr(),
        s2.ptr(),
    )
    .unwrap();
    let want: Vec<f32> = gt.iter().zip(&up).map(|(a, b)| r::silu(*a) * b).collect();
    let got: Vec<f32> = down(g, &hf, n * ff);
    assert!(max_rel(&got, &want) < 1e-5);

    // a prefill-sized launch (the 16-byte-load kernel): the same bits as the short launch on the
    // shared rows, and the host quantization of its own output everywhere
    let nl = 40;
    let mut gt_l = gt.clone();
    gt_l.extend(rng.vec((nl - n) * ff, 3.0));
    let mut up_l = up.clone();
    up_l.extend(rng.vec((nl - n) * ff, 3.0));
    let (gbl, ubl) = (g.upload(&gt_l).unwrap(), g.upload(&up_l).unwrap());
    let hfl = g.alloc(nl * ff * 4).unwrap();
    let ql = g.alloc(nl * ff).unwrap();
    let dl = g.alloc(nl * ff / 32 * 4).unwrap();
    let sl = g.alloc(nl * ff / 32 * 4).unwrap();
    g.swiglu_quant(
        gbl.ptr(),
        ubl.ptr(),
        nl,
        ff,
        hfl.ptr(),
        ql.ptr(),
        dl.ptr(),
        sl.ptr(),
    )
    .unwrap();
    let got_l: Vec<f32> = down(g, &hfl, nl * ff);
    assert!(
        got_l[..n * ff]
            .iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "swiglu: long launch f32 rows differ from the short launch"
    );
    let (hq, hd, hs) = host_quant(&got_l, ff);
    assert_eq!(down::<i8>(g, &ql, nl * ff), hq, "swiglu long: codes");
    assert_eq!(
        down::<u32>(g, &dl, nl * ff / 32),
        hd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "swiglu long: scales"
    );
    assert_eq!(down::<i32>(g, &sl, nl * ff / 32), hs, "swiglu long: sums");
    assert_eq!(
        down::<i8>(g, &q2, n * ff)[..],
        down::<i8>(g, &ql, nl * ff)[..n * ff],
        "swiglu: long launch codes differ from the short launch"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn attention_decode_vs_reference_real_shapes() {
    let g = need_gpu!("attention_decode_vs_reference_real_shapes");
    // short (one chunk per row), several chunks, and a context longer than 32 chunks per grid row
    for (pos0, n_ctx, hd, nh, nkv) in [
        (37usize, 64usize, 256usize, 24usize, 4usize),
        (290, 320, 256, 24, 4),
        (1500, 1536, 128, 8, 2),
        (70, 96, 64, 4, 2),
        // the 27B shape at 4,000 positions: 126 chunks, four merge tiles
        (3998, 4100, 256, 24, 4),
    ] {
        attention_case(g, pos0, n_ctx, hd, nh, nkv);
    }
}

fn attention_case(g: &Gpu, pos0: usize, n_ctx: usize, hd: usize, nh: usize, nkv: usize) {
    let mut rng = Rng(41 + pos0 as u64);
    let (n_rot, base, eps) = (64usize.min(hd), 1.0e7f32, 1e-6f32);
    let n = 3usize;
    let kvw = nkv * hd;
    // earlier cache rows (already f16)
    let kc_host: Vec<u16> = (0..n_ctx * kvw)
        .map(|_| f16::from_f32(rng.f()).to_bits())
        .collect();
    let vc_host: Vec<u16> = (0..n_ctx * kvw)
        .map(|_| f16::from_f32(rng.f()).to_bits())
        .collect();
    let qf = rng.vec(n * nh * 2 * hd, 1.0);
    let kf = rng.vec(n * kvw, 1.0);
    let vf = rng.vec(n * kvw, 1.0);
    let qn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect();
    let kn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect();
    let b = |v: &[f32]| g.upload(v).unwrap();
    let (qfb, kfb, vfb, qnb, knb) = (b(&qf), b(&kf), b(&vf), b(&qn), b(&kn));
    let kc = g.upload(&kc_host).unwrap();
    let vc = g.upload(&vc_host).unwrap();
    let pos: Vec<i32> = (0..n).map(|t| (pos0 + t) as i32).collect();
    let pb = g.upload(&pos).unwrap();
    let qo = g.alloc(n * nh * hd * 4).unwrap();
    g.attn_prep(
        qfb.ptr(),
        kfb.ptr(),
        vfb.ptr(),
        qnb.ptr(),
        knb.ptr(),
        eps,
        n,
        nh,
        nkv,
        hd,
        n_rot,
        base,
        pb.ptr(),
        qo.ptr(),
        kc.ptr(),
        vc.ptr(),
    )
    .unwrap();
    let k = nh * hd;
    let part = g
        .alloc(bonsai_kernels_cuda::attn_part_floats(n, nh, hd, n_ctx) * 4)
        .unwrap();
    let out = g.alloc(n * k * 4).unwrap();
    let (aq, ad, as_) = (
        g.alloc(n * k).unwrap(),
        g.alloc(n * k / 32 * 4).unwrap(),
        g.alloc(n * k / 32 * 4).unwrap(),
    );
    // the n rows' attention into (f32 out, codes q); scales and sums into ad / as_
    let decode = |out: &DevBuf, q: &DevBuf| {
        g.attn_decode(
            qo.ptr(),
            qfb.ptr(),
            kc.ptr(),
            vc.ptr(),
            n,
            nh,
            nkv,
            hd,
            pb.ptr(),
            n_ctx,
            part.ptr(),
            out.ptr(),
            q.ptr(),
            ad.ptr(),
            as_.ptr(),
        )
        .unwrap()
    };
    decode(&out, &aq);
    let got: Vec<f32> = down(g, &out, n * k);
    // the serial merge and any chunk grid give the same bits (codes included)
    let (serial0, gy0) = (g.attn_merge_serial(), [g.attn_gy(1), g.attn_gy(2)]);
    let hpb0 = [g.attn_hpb(1), g.attn_hpb(2)];
    for (serial, gy, hpb) in [
        (true, gy0[1], 1),
        (false, 1, 2),
        (false, 7, 3),
        (true, 128, 6),
        (false, 32, 6),
    ] {
        g.set_attn_merge_serial(serial);
        g.set_attn_gy(gy, gy);
        g.set_attn_hpb(hpb, hpb);
        let o2 = g.upload(&vec![f32::NAN; n * k]).unwrap();
        let q2 = g.upload(&vec![0x7fi8; n * k]).unwrap();
        decode(&o2, &q2);
        let alt: Vec<f32> = down(g, &o2, n * k);
        assert!(
            alt.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
            "attention pos0 {pos0} hd {hd}: merge serial {serial}, gy {gy}, hpb {hpb} differs from serial {serial0}, gy {gy0:?}, hpb {hpb0:?}"
        );
        assert_eq!(
            down::<i8>(g, &q2, n * k),
            down::<i8>(g, &aq, n * k),
            "attention codes: merge serial {serial}, gy {gy}"
        );
    }
    g.set_attn_merge_serial(serial0);
    g.set_attn_gy(gy0[0], gy0[1]);
    g.set_attn_hpb(hpb0[0], hpb0[1]);
    // the fused quantization equals quantizing the f32 output
    let (hq, hd_, hs) = bonsai_kernels_cuda::host_quant(&got, k);
    assert_eq!(down::<i8>(g, &aq, n * k), hq, "attention int8 codes");
    assert_eq!(down::<f32>(g, &ad, n * k / 32), hd_, "attention scales");
    assert_eq!(down::<i32>(g, &as_, n * k / 32), hs, "attention sums");
    // batch invariance: the last row alone (n = 1 at its own position) is bit-identical
    let out1 = g.alloc(k * 4).unwrap();
    let (q1, d1, s1) = (
        g.alloc(k).unwrap(),
        g.alloc(k / 32 * 4).unwrap(),
        g.alloc(k / 32 * 4).unwrap(),
    );
    let t = n - 1;
    g.attn_decode(
        qo.at(t * k * 4),
        qfb.at(t * nh * 2 * hd * 4),
        kc.ptr(),
        vc.ptr(),
        1,
        nh,
        nkv,
        hd,
        pb.at(t * 4),
        n_ctx,
        part.ptr(),
        out1.ptr(),
        q1.ptr(),
        d1.ptr(),
        s1.ptr(),
    )
    .unwrap();
    let one: Vec<f32> = down(g, &out1, k);
    assert!(
        one.iter()
            .zip(&got[t * k..])
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "attention row {t} of an n-row launch differs from the 1-row launch"
    );

    // reference: norm + rope, f16 cache rows, attention, gate
    let mut kcache: Vec<f32> = kc_host
        .iter()
        .map(|&h| f16::from_bits(h).to_f32())
        .collect();
    let mut vcache: Vec<f32> = vc_host
        .iter()
        .map(|&h| f16::from_bits(h).to_f32())
        .collect();
    let mut want = vec![0f32; n * nh * hd];
    let mut qs = vec![vec![0f32; nh * hd]; n];
    for t in 0..n {
        let p = pos0 + t;
        for h in 0..nh {
            qs[t][h * hd..(h + 1) * hd]
                .copy_from_slice(&qf[(t * nh + h) * 2 * hd..(t * nh + h) * 2 * hd + hd]);
        }
        r::rmsnorm_heads(&mut qs[t], hd, &qn, eps);
        r::rope_neox(&mut qs[t], hd, n_rot, p, base);
        let mut kt = kf[t * kvw..(t + 1) * kvw].to_vec();
        r::rmsnorm_heads(&mut kt, hd, &kn, eps);
        r::rope_neox(&mut kt, hd, n_rot, p, base);
        for i in 0..kvw {
            kcache[p * kvw + i] = f16::from_f32(kt[i]).to_f32();
            vcache[p * kvw + i] = f16::from_f32(vf[t * kvw + i]).to_f32();
        }
    }
    // the cache rows written by the kernel match the reference's f16 rows (rounding may differ by 1 ulp)
    let kgot: Vec<u16> = down(g, &kc, n_ctx * kvw);
    let kg: Vec<f32> = kgot.iter().map(|&h| f16::from_bits(h).to_f32()).collect();
    assert!(
        max_rel(&kg, &kcache) < 2e-3,
        "K cache {}",
        max_rel(&kg, &kcache)
    );
    for t in 0..n {
        let p = pos0 + t;
        let mut o = vec![0f32; nh * hd];
        r::attention(
            &qs[t],
            &kcache,
            &vcache,
            p + 1,
            nh,
            nkv,
            hd,
            1.0 / (hd as f32).sqrt(),
            &mut o,
        );
        for h in 0..nh {
            for j in 0..hd {
                let gate = qf[(t * nh + h) * 2 * hd + hd + j];
                want[(t * nh + h) * hd + j] = o[h * hd + j] * r::sigmoid(gate);
            }
        }
    }
    let e = max_rel(&got, &want);
    eprintln!("attention pos0 {pos0} hd {hd} max rel {e:.2e}");
    assert!(e < 2e-3, "attention max rel {e}");
}

/// Timing (informational, no assertion on speed): the flash-decode launches (`attn_chunks` +
/// merge) at the 27B attention shape (24 q heads, 4 kv heads, head dim 256) over 16 layers'
/// caches of 4,096 rows (256 MB: past the L2), at 32 / 1,024 / 2,048 / 4,000 positions, one row
/// (decode) and 5 rows (verify), for the serial merge and the tiled one at several chunk grids.
/// `ATTNTIME` lines: µs per layer (median of 5 runs of the 16 layers), then one eager launch of
/// each kind timed alone (`ATTNPROF`).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn attn_decode_timing() {
    let g = need_gpu!("attn_decode_timing");
    let (nh, nkv, hd, n_ctx, layers) = (24usize, 4usize, 256usize, 4096usize, 16usize);
    let kvw = nkv * hd;
    let mut rng = Rng(97);
    let cache: Vec<u16> = (0..n_ctx * kvw)
        .map(|_| f16::from_f32(rng.f()).to_bits())
        .collect();
    let kv: Vec<(DevBuf, DevBuf)> = (0..layers)
        .map(|_| (g.upload(&cache).unwrap(), g.upload(&cache).unwrap()))
        .collect();
    let nmax = 5usize;
    let k = nh * hd;
    let qo = g.upload(&rng.vec(nmax * k, 1.0)).unwrap();
    let qf = g.upload(&rng.vec(nmax * nh * 2 * hd, 1.0)).unwrap();
    let part = g
        .alloc(bonsai_kernels_cuda::attn_part_floats(nmax, nh, hd, n_ctx) * 4)
        .unwrap();
    let out = g.alloc(nmax * k * 4).unwrap();
    let (aq, ad, as_) = (
        g.alloc(nmax * k).unwrap(),
        g.alloc(nmax * k / 32 * 4).unwrap(),
        g.alloc(nmax * k / 32 * 4).unwrap(),
    );
    let (serial0, gy0) = (g.attn_merge_serial(), [g.attn_gy(1), g.attn_gy(2)]);
    let hpb0 = [g.attn_hpb(1), g.attn_hpb(2)];
    for pos0 in [32usize, 1024, 2048, 4000] {
        let pb = g
            .upload(&(0..nmax).map(|t| (pos0 + t) as i32).collect::<Vec<_>>())
            .unwrap();
        for n in [1usize, nmax] {
            let layer = |c: &(DevBuf, DevBuf)| {
                g.attn_decode(
                    qo.ptr(),
                    qf.ptr(),
                    c.0.ptr(),
                    c.1.ptr(),
                    n,
                    nh,
                    nkv,
                    hd,
                    pb.ptr(),
                    n_ctx,
                    part.ptr(),
                    out.ptr(),
                    aq.ptr(),
                    ad.ptr(),
                    as_.ptr(),
                )
            };
            let mut line = format!("ATTNTIME pos {pos0} n {n}:");
            let mut prof = format!("ATTNPROF pos {pos0} n {n}:");
            let gys: &[usize] = if n == 1 {
                &[32, 96, 128]
            } else {
                &[16, 32, 64]
            };
            let variants = std::iter::once((true, 32usize, 1usize)).chain(
                [1usize, 2, 3, 6]
                    .into_iter()
                    .flat_map(|hpb| gys.iter().map(move |&gy| (false, gy, hpb))),
            );
            for (serial, gy, hpb) in variants {
                g.set_attn_merge_serial(serial);
                g.set_attn_gy(gy, gy);
                g.set_attn_hpb(hpb, hpb);
                let run = || -> bonsai_kernels_cuda::Result<()> {
                    for c in &kv {
                        layer(c)?;
                    }
                    Ok(())
                };
                run().unwrap();
                let mut t: Vec<f64> = (0..5).map(|_| g.time_ms(run).unwrap() as f64).collect();
                t.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let name = if serial { "serial" } else { "tiled" };
                line += &format!(
                    " {name} gy {gy} hpb {hpb} {:.2} us;",
                    t[2] * 1e3 / layers as f64
                );
                g.sync().unwrap();
                g.profile_begin();
                layer(&kv[0]).unwrap();
                let l = g.profile_end();
                prof += &format!(
                    " {name} gy {gy} hpb {hpb} [{}];",
                    l.iter()
                        .map(|(k, us)| format!("{k} {us:.1}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            eprintln!("{line}");
            eprintln!("{prof}");
        }
    }
    g.set_attn_merge_serial(serial0);
    g.set_attn_gy(gy0[0], gy0[1]);
    g.set_attn_hpb(hpb0[0], hpb0[1]);
}

/// Host argmax: first maximum, NaN never wins, `0x7fffffff` when nothing beats −inf.
fn host_argmax(row: &[f32]) -> i32 {
    let mut best = f32::NEG_INFINITY;
    let mut bi = 0x7fff_ffff;
    for (i, &x) in row.iter().enumerate() {
        if x > best {
            best = x;
            bi = i as i32;
        }
    }
    bi
}

/// `argmax_rows` (several blocks per row, the last block merges): lowest index on ties, also across
/// blocks; the 27B vocabulary and odd lengths (the scalar path); a row's result is the same in a
/// one-row launch and in a 70-row launch (two launches of the row chunk); repeated launches (the
/// arrival counters reset themselves).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn argmax_lowest_index_on_ties() {
    let g = need_gpu!("argmax_lowest_index_on_ties");
    let nv = 248320;
    let mut rng = Rng(51);
    let mut l = rng.vec(3 * nv, 1.0);
    l[1000] = 5.0;
    l[200000] = 5.0; // tie in different blocks: lowest index wins
    l[nv + 248319] = 9.0; // last index
    l[2 * nv + 4096 * 3 + 1] = f32::NAN; // NaN never wins
    l[2 * nv + 4096 * 3 + 2] = 7.0;
    l[2 * nv + 4096 * 3 + 3] = 7.0;
    let lb = g.upload(&l).unwrap();
    let ids = g.alloc(12).unwrap();
    for rep in 0..3 {
        g.argmax_rows(lb.ptr(), 3, nv, ids.ptr()).unwrap();
        let want = vec![1000, 248319, 4096 * 3 + 2];
        assert_eq!(down::<i32>(g, &ids, 3), want, "repeat {rep}");
    }
    for (nv, rows) in [(1001usize, 70usize), (7, 3), (4096 * 64 + 5, 2)] {
        let mut l = rng.vec(rows * nv, 3.0);
        // ties at the row's first and last element in some rows
        for t in (0..rows).step_by(3) {
            l[t * nv] = 50.0;
            l[t * nv + nv - 1] = 50.0;
        }
        let lb = g.upload(&l).unwrap();
        let ids = g.alloc(rows * 4).unwrap();
        g.argmax_rows(lb.ptr(), rows, nv, ids.ptr()).unwrap();
        let got: Vec<i32> = down(g, &ids, rows);
        for t in 0..rows {
            assert_eq!(
                got[t],
                host_argmax(&l[t * nv..(t + 1) * nv]),
                "nv {nv} row {t}"
            );
        }
        // the last row alone gives the same answer
        let one = g.alloc(4).unwrap();
        g.argmax_rows(lb.ptr() + ((rows - 1) * nv * 4) as u64, 1, nv, one.ptr())
            .unwrap();
        assert_eq!(
            down::<i32>(g, &one, 1)[0],
            got[rows - 1],
            "nv {nv}: one-row launch"
        );
    }
}

/// `dsp_norm_rope_sets` with two head sets == two `dsp_norm_rope` launches, bit for bit (the
/// draft's q and k heads), plain rows and a ring.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn dsp_norm_rope_sets_equal_two_launches() {
    use bonsai_kernels_cuda::{NormRopeSet, Ring};
    let g = need_gpu!("dsp_norm_rope_sets_equal_two_launches");
    let mut rng = Rng(617);
    let (nh, nkv, hd, n) = (40usize, 4usize, 128usize, 4usize);
    let (qw, kvw) = (nh * hd, nkv * hd);
    let q = g.upload(&rng.vec(n * qw, 2.0)).unwrap();
    let k = g.upload(&rng.vec(n * kvw, 2.0)).unwrap();
    let wq = g.upload(&rng.vec(hd, 1.0)).unwrap();
    let wk = g.upload(&rng.vec(hd, 1.0)).unwrap();
    for ring in [Ring::PLAIN, Ring { cap: 6, slot0: 4 }] {
        let rows = if ring.cap > 0 { ring.cap } else { n };
        let (qa, ka, qb, kb) = (
            g.alloc(rows * qw * 4).unwrap(),
            g.alloc(rows * kvw * 4).unwrap(),
            g.alloc(rows * qw * 4).unwrap(),
            g.alloc(rows * kvw * 4).unwrap(),
        );
        let pos0 = 4093;
        g.dsp_norm_rope(
            q.ptr(),
            qw,
            nh,
            n,
            wq.ptr(),
            1e-6,
            hd,
            pos0,
            1e7,
            qa.ptr(),
            qw,
            ring,
            0,
        )
        .unwrap();
        g.dsp_norm_rope(
            k.ptr(),
            kvw,
            nkv,
            n,
            wk.ptr(),
            1e-6,
            hd,
            pos0,
            1e7,
            ka.ptr(),
            kvw,
            ring,
            0,
        )
        .unwrap();
        let set = |src: &DevBuf, stride, heads, w: &DevBuf, dst: &DevBuf| NormRopeSet {
            src: src.ptr(),
            src_stride: stride,
            heads,
            w: w.ptr(),
            dst: dst.ptr(),
            dst_stride: stride,
        };
        g.dsp_norm_rope_sets(
            set(&q, qw, nh, &wq, &qb),
            set(&k, kvw, nkv, &wk, &kb),
            n,
            1e-6,
            hd,
            pos0,
            1e7,
            ring,
            0,
        )
        .unwrap();
        let bits = |b: &DevBuf, len| -> Vec<u32> { down(g, b, len) };
        assert!(
            bits(&qa, rows * qw) == bits(&qb, rows * qw),
            "q heads differ (ring {})",
            ring.cap
        );
        assert!(
            bits(&ka, rows * kvw) == bits(&kb, rows * kvw),
            "k heads differ (ring {})",
            ring.cap
        );
    }
}

/// The drafter's non-causal block attention (`Gpu::dsp_attention`), every first-phase kernel
/// (`DspAttnKernel`: per q head at spread 1 and 8, per kv head) against an f64 reference written
/// from MODEL.md §4.6 (softmax(scale · q·k) · v over the context ring then the block's own keys,
/// GQA), on the real drafter shape and odd ones: rings that wrap, no context, a full window, head
/// dims 32 / 64 / 96 / 128 / 256 (96 and 256: the generic per-head entry; 16 q heads × 8 rows at
/// 256: more than one row group per kv head). And each kernel's graph form (off / len read from
/// device parameters, the grid sized for the whole ring) equals its eager launch bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn dsp_attention_vs_reference() {
    use bonsai_kernels_cuda::{dsp_attn_part_floats, DspAttnKernel, DspPar};
    let g = need_gpu!("dsp_attention_vs_reference");
    let mut rng = Rng(4409);
    // (nh, nkv, hd, n, cap, off, len)
    let cases: [(usize, usize, usize, usize, usize, usize, usize); 6] = [
        (40, 4, 128, 4, 4096, 4000, 4092),
        (40, 4, 128, 4, 4096, 10, 60),
        (8, 2, 64, 5, 300, 290, 229),
        (6, 3, 96, 3, 64, 0, 0),
        (16, 1, 256, 8, 2048, 100, 2000),
        (4, 4, 32, 1, 100, 50, 77),
    ];
    let kernels = [
        DspAttnKernel::PerHead { spread: 1 },
        DspAttnKernel::PerHead { spread: 8 },
        DspAttnKernel::PerKvHead,
    ];
    for (nh, nkv, hd, n, cap, off, len) in cases {
        let (qw, kvw) = (nh * hd, nkv * hd);
        let q = rng.vec(n * qw, 2.0);
        let (kc, vc) = (rng.vec(cap * kvw, 2.0), rng.vec(cap * kvw, 1.0));
        let (kb, vb) = (rng.vec(n * kvw, 2.0), rng.vec(n * kvw, 1.0));
        let scale = 1.0 / (hd as f32).sqrt();
        // the reference, f64
        let mut want = vec![0f32; n * qw];
        for t in 0..n {
            for h in 0..nh {
                let kv = h / (nh / nkv);
                let row = |i: usize, ring: &[f32], blk: &[f32]| -> Vec<f32> {
                    let base = if i < len {
                        ((off + i) % cap) * kvw
                    } else {
                        (i - len) * kvw
                    };
                    let src = if i < len { ring } else { blk };
                    src[base + kv * hd..base + (kv + 1) * hd].to_vec()
                };
                let qr = &q[t * qw + h * hd..t * qw + (h + 1) * hd];
                let sc: Vec<f64> = (0..len + n)
                    .map(|i| {
                        let k = row(i, &kc, &kb);
                        scale as f64
                            * qr.iter()
                                .zip(&k)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = p.iter().sum();
                for (i, pi) in p.iter().enumerate() {
                    let v = row(i, &vc, &vb);
                    for j in 0..hd {
                        want[t * qw + h * hd + j] += (pi / l * v[j] as f64) as f32;
                    }
                }
            }
        }
        let (dq, dkc, dvc, dkb, dvb) = (
            g.upload(&q).unwrap(),
            g.upload(&kc).unwrap(),
            g.upload(&vc).unwrap(),
            g.upload(&kb).unwrap(),
            g.upload(&vb).unwrap(),
        );
        let part = g
            .alloc(dsp_attn_part_floats(n, nh, hd, cap + n) * 4)
            .unwrap();
        let mut par = vec![0i32; DspPar::SLOTS];
        par[DspPar::OFF] = off as i32;
        par[DspPar::LEN] = len as i32;
        let dpar = g.upload(&par).unwrap();
        for k in kernels {
            let mut outs = Vec::new();
            for graph_form in [false, true] {
                let out = g.alloc(n * qw * 4).unwrap();
                let qo = g.alloc(n * qw).unwrap();
                let (dd, ds) = (
                    g.alloc(n * qw / 32 * 4).unwrap(),
                    g.alloc(n * qw / 32 * 4).unwrap(),
                );
                // the graph form gets wrong off / len arguments: the kernels must read the device's
                let (a_off, a_len, p) = if graph_form {
                    (0, 0, dpar.ptr())
                } else {
                    (off, len, 0)
                };
                g.dsp_attention(
                    dq.ptr(),
                    dkc.ptr(),
                    dvc.ptr(),
                    cap,
                    a_off,
                    a_len,
                    dkb.ptr(),
                    dvb.ptr(),
                    n,
                    nh,
                    nkv,
                    hd,
                    scale,
                    part.ptr(),
                    out.ptr(),
                    qo.ptr(),
                    dd.ptr(),
                    ds.ptr(),
                    p,
                    k,
                )
                .unwrap();
                outs.push(down::<f32>(g, &out, n * qw));
            }
            let err = outs[0]
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                err < 5e-5,
                "{k:?} nh {nh}/{nkv} hd {hd} n {n} cap {cap} off {off} len {len}: max abs err {err}"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert!(
                bits(&outs[0]) == bits(&outs[1]),
                "{k:?} nh {nh}/{nkv} hd {hd} n {n} len {len}: graph form differs from eager"
            );
        }
    }
}

/// `logit_stats_rows`: first maximum (NaN never wins), its value and the log-sum-exp, vs the host
/// in f64, on rows with ties, NaN and −inf, and a row with no finite logit.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn logit_stats_rows_vs_host() {
    let g = need_gpu!("logit_stats_rows_vs_host");
    let nv = 248320;
    let rows = 4;
    let mut rng = Rng(52);
    let mut l = rng.vec(rows * nv, 8.0);
    l[1000] = 40.0;
    l[200000] = 40.0; // tie: lowest index wins
    l[nv + 7] = f32::NAN; // NaN never wins
    l[nv + 8] = 41.0;
    l[nv + 9] = f32::NEG_INFINITY;
    for v in &mut l[2 * nv..3 * nv] {
        *v = f32::NEG_INFINITY; // nothing finite
    }
    l[3 * nv + 248319] = 30.0; // last index
    let lb = g.upload(&l).unwrap();
    let out = g.alloc(rows * 16).unwrap();
    g.logit_stats_rows(lb.ptr(), rows, nv, out.ptr()).unwrap();
    let w: Vec<u32> = down(g, &out, rows * 4);
    for r in 0..rows {
        let row = &l[r * nv..(r + 1) * nv];
        let st = bonsai_kernels_cuda::LogitRowStats::from_words(&w[r * 4..r * 4 + 4]);
        // host: NaN → −inf, first maximum, f64 log-sum-exp
        let want = bonsai_kernels_cuda::host_logit_stats(row);
        let Some(best) = want.argmax else {
            assert_eq!(st.argmax, None, "row {r}: no finite logit");
            continue;
        };
        let (m, lse) = (want.max, want.lse);
        assert_eq!(st.argmax, Some(best), "row {r}: argmax");
        assert_eq!(st.max.to_bits(), m.to_bits(), "row {r}: max");
        assert!(
            (st.lse - lse).abs() <= 1e-5 * lse.abs().max(1.0),
            "row {r}: lse {} vs host {lse}",
            st.lse
        );
        eprintln!(
            "logit stats row {r}: argmax {best}, lse {:.6} vs host {lse:.6}",
            st.lse
        );
    }
    // each row alone gives the same words (a row's blocks never depend on the row count), and a
    // repeated launch too (the arrival counters reset themselves)
    let one = g.alloc(16).unwrap();
    for r in 0..rows {
        g.logit_stats_rows(lb.ptr() + (r * nv * 4) as u64, 1, nv, one.ptr())
            .unwrap();
        assert_eq!(
            down::<u32>(g, &one, 4),
            w[r * 4..r * 4 + 4].to_vec(),
            "row {r} alone"
        );
    }
}

/// `topk_rows`: each row's `TOPK_ROW` best entries (value descending, then the lower id; NaN as
/// −inf, −0 as +0) equal the host twin's, entry for entry, on rows of many ties, NaN, −inf, signed
/// zeros, a row with nothing finite, rows shorter than `TOPK_ROW`, a row long enough that a block
/// sorts its slice in several batches, and launches of more rows than one launch covers; a row
/// alone and a repeated launch give the same words. Timed on the real vocabulary.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn topk_rows_vs_host() {
    use bonsai_kernels_cuda::{host_topk_row, topk_from_words, TOPK_ROW};
    let g = need_gpu!("topk_rows_vs_host");
    let mut rng = Rng(77);
    for (nv, rows) in [
        (248320usize, 4usize),
        (50, 3),
        (300_001, 2),
        (4097, 20),
        (64, 1),
    ] {
        let mut l: Vec<f32> = (0..rows * nv)
            // few distinct values: long runs of ties across the whole row
            .map(|_| (rng.below(41) as f32 - 20.0) * 0.25)
            .collect();
        for t in 0..rows {
            let row = &mut l[t * nv..(t + 1) * nv];
            for _ in 0..(nv / 50).max(2) {
                let i = rng.below(nv);
                row[i] = match rng.below(4) {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => -0.0,
                    _ => 5.0, // the row's maximum, many times over
                };
            }
            if t == 1 {
                row.fill(f32::NEG_INFINITY); // nothing finite
                row[nv / 2] = f32::NAN;
            }
        }
        let lb = g.upload(&l).unwrap();
        let out = g.alloc(rows * TOPK_ROW * 8).unwrap();
        g.topk_rows(lb.ptr(), rows, nv, out.ptr()).unwrap();
        let w: Vec<u32> = down(g, &out, rows * TOPK_ROW * 2);
        for t in 0..rows {
            let got = topk_from_words(&w[t * TOPK_ROW * 2..(t + 1) * TOPK_ROW * 2], nv);
            let want = host_topk_row(&l[t * nv..(t + 1) * nv]);
            assert_eq!(got.len(), want.len(), "nv {nv} row {t}: entries");
            for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    a.0 == b.0 && a.1.to_bits() == b.1.to_bits(),
                    "nv {nv} row {t} entry {j}: device {a:?}, host {b:?}"
                );
            }
        }
        // the last row alone, twice (the arrival counters reset themselves)
        let one = g.alloc(TOPK_ROW * 8).unwrap();
        for _ in 0..2 {
            g.topk_rows(lb.ptr() + ((rows - 1) * nv * 4) as u64, 1, nv, one.ptr())
                .unwrap();
            assert_eq!(
                down::<u32>(g, &one, TOPK_ROW * 2),
                w[(rows - 1) * TOPK_ROW * 2..].to_vec(),
                "nv {nv}: the last row alone"
            );
        }
        // time it on the real vocabulary: one row (a decode step) and four (verify-sized)
        if nv == 248320 {
            let mut us = [0f32; 2];
            for (u, r) in us.iter_mut().zip([1usize, 4]) {
                g.topk_rows(lb.ptr(), r, nv, out.ptr()).unwrap();
                let ms = g
                    .time_ms(|| {
                        for _ in 0..50 {
                            g.topk_rows(lb.ptr(), r, nv, out.ptr())?;
                        }
                        Ok(())
                    })
                    .unwrap();
                *u = ms * 1e3 / 50.0;
            }
            eprintln!(
                "TOPK nv {nv}: {:.1} us per launch for 1 row, {:.1} for 4 rows",
                us[0], us[1]
            );
        }
        eprintln!("topk_rows nv {nv} rows {rows}: equal to the host twin");
    }
}

/// DSpark rollback kernels (spec.cu): the verify record is the exact concatenation of the conv
/// kernel's outputs (pre-conv `mixed` ‖ L2-normed `k` ‖ `v` ‖ `g` ‖ `β`), and replaying its first `m`
/// rows from the pre-verify state gives the conv window and recurrent state `gdn_conv` + `gdn_step`
/// leave after those `m` rows, bit for bit, for every `m` in 0..=5. Real and tiny head shapes.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gdn_rec_write_and_replay_bit_exact() {
    let g = need_gpu!("gdn_rec_write_and_replay_bit_exact");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    // (hk, hv, dk, kconv): the 27B GDN, the synthetic tiny (dk 64) and small presets
    for (case, &(hk, hv, dk, kconv)) in [
        (16usize, 48usize, 128usize, 4usize),
        (2, 6, 64, 4),
        (4, 8, 128, 4),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng(77 + case as u64);
        let n = 5usize;
        let dv = dk;
        let conv_dim = 2 * hk * dk + hv * dv;
        let (qk, vd) = (hk * dk, hv * dv);
        let eps = 1e-6f32;
        let width = bonsai_kernels_cuda::gdn_rec_width(hk, hv, dk, dv);
        assert_eq!(width, conv_dim + qk + vd + 2 * hv);
        let mixed = rng.vec(n * conv_dim, 1.0);
        let conv0 = rng.vec((kconv - 1) * conv_dim, 1.0);
        let convw = rng.vec(conv_dim * kconv, 0.5);
        let bb = rng.vec(n * hv, 2.0);
        let aa = rng.vec(n * hv, 2.0);
        let dt_bias = rng.vec(hv, 1.0);
        let ssm_a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
        let s0 = rng.vec(hv * dk * dv, 0.1);
        let up = |v: &[f32]| g.upload(v).unwrap();
        let z = |k: usize| g.alloc(k * 4).unwrap();
        let (mb, wb, bbb, aab, dtb, ab) = (
            up(&mixed),
            up(&convw),
            up(&bb),
            up(&aa),
            up(&dt_bias),
            up(&ssm_a),
        );
        // the verify: conv over all n rows, the record, then the recurrence
        let (cb, sb) = (up(&conv0), up(&s0));
        let (qo, ko, vo, beta, gg, out) = (
            z(n * qk),
            z(n * qk),
            z(n * vd),
            z(n * hv),
            z(n * hv),
            z(n * vd),
        );
        g.gdn_conv(
            mb.ptr(),
            cb.ptr(),
            wb.ptr(),
            kconv,
            hk,
            hv,
            dk,
            n,
            eps,
            qo.ptr(),
            ko.ptr(),
            vo.ptr(),
            bbb.ptr(),
            aab.ptr(),
            dtb.ptr(),
            ab.ptr(),
            beta.ptr(),
            gg.ptr(),
        )
        .unwrap();
        let rec = z(n * width);
        g.gdn_rec_write(
            mb.ptr(),
            ko.ptr(),
            vo.ptr(),
            gg.ptr(),
            beta.ptr(),
            hk,
            hv,
            dk,
            dv,
            n,
            rec.ptr(),
        )
        .unwrap();
        // the record is the concatenation of the pieces, row by row
        let (hk_, hv_, hg, hb): (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) = (
            down(g, &ko, n * qk),
            down(g, &vo, n * vd),
            down(g, &gg, n * hv),
            down(g, &beta, n * hv),
        );
        let got: Vec<f32> = down(g, &rec, n * width);
        for t in 0..n {
            let mut want = mixed[t * conv_dim..(t + 1) * conv_dim].to_vec();
            want.extend_from_slice(&hk_[t * qk..(t + 1) * qk]);
            want.extend_from_slice(&hv_[t * vd..(t + 1) * vd]);
            want.extend_from_slice(&hg[t * hv..(t + 1) * hv]);
            want.extend_from_slice(&hb[t * hv..(t + 1) * hv]);
            assert_eq!(
                bits(&got[t * width..(t + 1) * width]),
                bits(&want),
                "case {case}: record row {t}"
            );
        }
        // k in the record is L2-normed per head
        for t in 0..n {
            for kh in got[t * width + conv_dim..t * width + conv_dim + qk].chunks_exact(dk) {
                let norm = kh.iter().map(|x| x * x).sum::<f32>().sqrt();
                assert!((norm - 1.0).abs() < 1e-4, "case {case}: |k| = {norm}");
            }
        }
        g.gdn_step(
            sb.ptr(),
            qo.ptr(),
            ko.ptr(),
            vo.ptr(),
            gg.ptr(),
            beta.ptr(),
            hk,
            hv,
            dk,
            dv,
            n,
            out.ptr(),
        )
        .unwrap();
        for m in 0..=n {
            // plain: conv + step over the first m rows from the pre-verify state
            let (cp, sp) = (up(&conv0), up(&s0));
            if m > 0 {
                g.gdn_conv(
                    mb.ptr(),
                    cp.ptr(),
                    wb.ptr(),
                    kconv,
                    hk,
                    hv,
                    dk,
                    m,
                    eps,
                    qo.ptr(),
                    ko.ptr(),
                    vo.ptr(),
                    bbb.ptr(),
                    aab.ptr(),
                    dtb.ptr(),
                    ab.ptr(),
                    beta.ptr(),
                    gg.ptr(),
                )
                .unwrap();
                g.gdn_step(
                    sp.ptr(),
                    qo.ptr(),
                    ko.ptr(),
                    vo.ptr(),
                    gg.ptr(),
                    beta.ptr(),
                    hk,
                    hv,
                    dk,
                    dv,
                    m,
                    out.ptr(),
                )
                .unwrap();
            }
            // replay: the first m record rows from the pre-verify state, in place (src None) or
            // from a snapshot into buffers holding something else (restore + replay)
            let replay = |s: &DevBuf, c: &DevBuf, src: Option<(u64, u64)>| {
                g.gdn_replay(
                    s.ptr(),
                    c.ptr(),
                    src,
                    rec.ptr(),
                    width,
                    hk,
                    hv,
                    dk,
                    dv,
                    kconv,
                    m,
                )
                .unwrap()
            };
            let (cr, sr) = (up(&conv0), up(&s0));
            replay(&sr, &cr, None);
            let (cs, ss) = (up(&conv0), up(&s0));
            let (cx, sx) = (
                up(&vec![f32::NAN; conv0.len()]),
                up(&vec![-1.5f32; s0.len()]),
            );
            replay(&sx, &cx, Some((ss.ptr(), cs.ptr())));
            assert_eq!(
                bits(&down::<f32>(g, &cx, (kconv - 1) * conv_dim)),
                bits(&down::<f32>(g, &cr, (kconv - 1) * conv_dim)),
                "case {case}: conv window after {m} rows replayed from a snapshot"
            );
            assert_eq!(
                bits(&down::<f32>(g, &sx, hv * dk * dv)),
                bits(&down::<f32>(g, &sr, hv * dk * dv)),
                "case {case}: state after {m} rows replayed from a snapshot"
            );
            assert_eq!(
                bits(&down::<f32>(g, &ss, hv * dk * dv)),
                bits(&s0),
                "case {case}: the snapshot is read only"
            );
            // the same replays as one launch over three layers (gdn_replay_layers): two from the
            // snapshot into buffers holding something else, one in place between them
            let ls: Vec<(DevBuf, DevBuf)> = (0..3)
                .map(|l| {
                    if l == 1 {
                        (up(&s0), up(&conv0))
                    } else {
                        (
                            up(&vec![l as f32 - 2.5; s0.len()]),
                            up(&vec![f32::NAN; conv0.len()]),
                        )
                    }
                })
                .collect();
            let tab: Vec<[u64; 5]> = ls
                .iter()
                .enumerate()
                .map(|(l, (s, c))| {
                    let (s_src, c_src) = if l == 1 {
                        (s.ptr(), c.ptr())
                    } else {
                        (ss.ptr(), cs.ptr())
                    };
                    [s.ptr(), c.ptr(), s_src, c_src, rec.ptr()]
                })
                .collect();
            g.gdn_replay_layers(&tab, width, hk, hv, dk, dv, kconv, m)
                .unwrap();
            for (l, (s, c)) in ls.iter().enumerate() {
                assert_eq!(
                    bits(&down::<f32>(g, c, (kconv - 1) * conv_dim)),
                    bits(&down::<f32>(g, &cr, (kconv - 1) * conv_dim)),
                    "case {case}: conv window of layer {l} after {m} rows, all layers in one launch"
                );
                assert_eq!(
                    bits(&down::<f32>(g, s, hv * dk * dv)),
                    bits(&down::<f32>(g, &sr, hv * dk * dv)),
                    "case {case}: state of layer {l} after {m} rows, all layers in one launch"
                );
            }
            let (a, b): (Vec<f32>, Vec<f32>) = (
                down(g, &cp, (kconv - 1) * conv_dim),
                down(g, &cr, (kconv - 1) * conv_dim),
            );
            assert_eq!(
                bits(&a),
                bits(&b),
                "case {case}: conv window after {m} rows"
            );
            let (a, b): (Vec<f32>, Vec<f32>) =
                (down(g, &sp, hv * dk * dv), down(g, &sr, hv * dk * dv));
            assert_eq!(bits(&a), bits(&b), "case {case}: state after {m} rows");
            if m == n {
                let full: Vec<f32> = down(g, &sb, hv * dk * dv);
                assert_eq!(bits(&full), bits(&b), "case {case}: full replay vs verify");
            }
        }
        // a record of the wrong width is refused
        assert!(g
            .gdn_replay(0, 0, None, rec.ptr(), width + 1, hk, hv, dk, dv, kconv, 1)
            .is_err());
        eprintln!("gdn replay case {case} (hk {hk}, hv {hv}, dk {dk}): record + replay bit-exact for m = 0..={n}");
    }
}

/// `gdn_conv_step` (the conv fused into the recurrence) against `gdn_conv` then `gdn_step` on the
/// same inputs: the state, the outputs, the conv window afterwards and the side outputs (k, v,
/// gates: the verify record's) bit for bit, for n = 1..=8 rows, conv widths 4, 3 and 2, the 27B,
/// tiny and small head shapes and two other widths (32, 96); and where the head is 128 wide, `gdn_conv_step_norm_d128` (the
/// gated norm fused in too, a 4-block cluster) against those two then `gated_norm_quant`. The launches run back to back on one `Gpu`, so a k-head arrival
/// counter left non-zero would break the next launch's window update.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gdn_conv_step_equals_conv_then_step() {
    let g = need_gpu!("gdn_conv_step_equals_conv_then_step");
    for &(hk, hv, dk, kconv) in &[
        (16usize, 48usize, 128usize, 4usize),
        (2, 6, 64, 4),
        (4, 8, 128, 4),
        (16, 48, 128, 2),
        (3, 7, 32, 4),
        (2, 5, 96, 3),
    ] {
        assert!(bonsai_kernels_cuda::gdn_fused_supported(
            hk, hv, dk, dk, kconv
        ));
        let dv = dk;
        let conv_dim = 2 * hk * dk + hv * dv;
        let (qk, vd) = (hk * dk, hv * dv);
        let eps = 1e-6f32;
        for n in 1..=8usize {
            let mut rng = Rng(500 + n as u64 + 17 * hk as u64 + kconv as u64);
            let mixed = rng.vec(n * conv_dim, 1.0);
            let conv0 = rng.vec((kconv - 1).max(1) * conv_dim, 1.0);
            let convw = rng.vec(conv_dim * kconv, 0.5);
            let bb = rng.vec(n * hv, 2.0);
            let aa = rng.vec(n * hv, 2.0);
            let dt_bias = rng.vec(hv, 1.0);
            let ssm_a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
            let s0 = rng.vec(hv * dk * dv, 0.1);
            let up = |v: &[f32]| g.upload(v).unwrap();
            let z = |k: usize| g.alloc(k * 4).unwrap();
            let (mb, wb, bbb, aab, dtb, ab) = (
                up(&mixed),
                up(&convw),
                up(&bb),
                up(&aa),
                up(&dt_bias),
                up(&ssm_a),
            );
            // two launches
            let (ca, sa) = (up(&conv0), up(&s0));
            let (qo, ko, vo, beta, gg, outa) = (
                z(n * qk),
                z(n * qk),
                z(n * vd),
                z(n * hv),
                z(n * hv),
                z(n * vd),
            );
            g.gdn_conv(
                mb.ptr(),
                ca.ptr(),
                wb.ptr(),
                kconv,
                hk,
                hv,
                dk,
                n,
                eps,
                qo.ptr(),
                ko.ptr(),
                vo.ptr(),
                bbb.ptr(),
                aab.ptr(),
                dtb.ptr(),
                ab.ptr(),
                beta.ptr(),
                gg.ptr(),
            )
            .unwrap();
            g.gdn_step(
                sa.ptr(),
                qo.ptr(),
                ko.ptr(),
                vo.ptr(),
                gg.ptr(),
                beta.ptr(),
                hk,
                hv,
                dk,
                dv,
                n,
                outa.ptr(),
            )
            .unwrap();
            // the gated norm of the two-launch output (gated_norm_quant), f32 and int8
            let zin = rng.vec(n * vd, 2.0);
            let nwt = rng.vec(dv, 1.0);
            let (zb, nwb) = (up(&zin), up(&nwt));
            let (yfa, yqa, yda, ysa) = (z(n * vd), z(n * vd / 4), z(n * vd / 32), z(n * vd / 32));
            g.gated_norm_quant(
                outa.ptr(),
                zb.ptr(),
                nwb.ptr(),
                eps,
                n,
                hv,
                dv,
                yfa.ptr(),
                yqa.ptr(),
                yda.ptr(),
                ysa.ptr(),
            )
            .unwrap();
            // the verify record of the two launches' outputs (gdn_rec_write)
            let width = bonsai_kernels_cuda::gdn_rec_width(hk, hv, dk, dv);
            let reca = z(n * width);
            g.gdn_rec_write(
                mb.ptr(),
                ko.ptr(),
                vo.ptr(),
                gg.ptr(),
                beta.ptr(),
                hk,
                hv,
                dk,
                dv,
                n,
                reca.ptr(),
            )
            .unwrap();
            // fused: without / with the side outputs (1: in their own buffers, 2: straight into
            // the verify record), without / with the gated norm (dv = 128)
            for side_mode in 0..3 {
                let side = side_mode > 0;
                // the gated norm: 0 none, 1 int8 codes (n ≥ 2: all rows' norms after the
                // recurrence, `gdn_conv_step_norm_bn_d128`), 2 b1-plane activations (with the
                // byte-split codes for n ≥ 2, as verify launches write them), 3 int8 codes with
                // a cluster exchange per row (`Gpu::set_gdn_norm_batch(false)`), 4 int8 codes
                // with the previous window count, after the first barriers
                // (`Gpu::set_gdn_early_count(false)`; modes 1 and 3 count before the PDL wait
                // wherever the launch takes an early kernel: no snapshot and not the batched
                // norm, or the batched norm), 5 as 1 with the producer warps (the default since
                // 2026-12-08; `Gpu::set_gdn_producer(true)`: `gdn_conv_step_norm_bn_pw_d128` for
                // n ≥ 2 at conv width 4; the other modes take the 128-thread kernels)
                for norm_mode in 0..6 {
                    let norm = norm_mode > 0;
                    if norm && dv != 128 {
                        continue;
                    }
                    g.set_gdn_norm_batch(norm_mode != 3);
                    g.set_gdn_early_count(norm_mode != 4);
                    g.set_gdn_producer(norm_mode == 5);
                    let p16b = p16_alloc(g, n, vd);
                    let (cb, sb, outb) = (up(&conv0), up(&s0), z(n * vd));
                    let (kb, vb, betab, gb) = (z(n * qk), z(n * vd), z(n * hv), z(n * hv));
                    let recb = g.upload(&vec![f32::NAN; n * width]).unwrap();
                    let side_out = match side_mode {
                        0 => None,
                        1 => Some(GdnSide::Bufs {
                            k: kb.ptr(),
                            v: vb.ptr(),
                            beta: betab.ptr(),
                            g: gb.ptr(),
                        }),
                        _ => Some(GdnSide::Record(recb.ptr())),
                    };
                    let (yfb, yqb, ydb, ysb) =
                        (z(n * vd), z(n * vd / 4), z(n * vd / 32), z(n * vd / 32));
                    // the verify launches (side outputs) also write the round's snapshot
                    let (snap_s, snap_c) = (
                        up(&vec![f32::NAN; s0.len()]),
                        up(&vec![f32::NAN; conv0.len()]),
                    );
                    g.gdn_conv_step(
                        sb.ptr(),
                        mb.ptr(),
                        cb.ptr(),
                        wb.ptr(),
                        kconv,
                        (hk, hv, dk, dv),
                        n,
                        eps,
                        (bbb.ptr(), aab.ptr(), dtb.ptr(), ab.ptr()),
                        if norm { 0 } else { outb.ptr() },
                        side_out,
                        side.then(|| (snap_s.ptr(), snap_c.ptr())),
                        norm.then(|| GdnNormOut {
                            z: zb.ptr(),
                            w: nwb.ptr(),
                            eps,
                            out: QuantOut {
                                f: yfb.ptr(),
                                q: yqb.ptr(),
                                d: ydb.ptr(),
                                s: ysb.ptr(),
                            },
                            p16: (norm_mode == 2).then(|| p16_out(&p16b, n >= 2)),
                        }),
                    )
                    .unwrap();
                    let tag = format!(
                        "hk {hk} hv {hv} dk {dk} conv {kconv} n {n} side mode {side_mode} norm mode {norm_mode}"
                    );
                    let cmp = |name: &str, a: &DevBuf, b: &DevBuf, len: usize| {
                        let (x, y): (Vec<u32>, Vec<u32>) = (down(g, a, len), down(g, b, len));
                        assert_eq!(x, y, "{tag}: {name} differs");
                    };
                    if norm_mode == 2 {
                        cmp("gated norm f32", &yfa, &yfb, n * vd);
                        let rows: Vec<f32> = down::<u32>(g, &yfa, n * vd)
                            .iter()
                            .map(|&b| f32::from_bits(b))
                            .collect();
                        assert_p16_eq_host(
                            g,
                            &rows,
                            n,
                            vd,
                            &p16b,
                            n >= 2,
                            &format!("{tag}: gated norm b1-plane"),
                        );
                    } else if norm {
                        // (the fused kernel writes no f32 out with the norm)
                        cmp("gated norm f32", &yfa, &yfb, n * vd);
                        cmp("gated norm codes", &yqa, &yqb, n * vd / 4);
                        cmp("gated norm scales", &yda, &ydb, n * vd / 32);
                        cmp("gated norm sums", &ysa, &ysb, n * vd / 32);
                    } else {
                        cmp("out", &outa, &outb, n * vd);
                    }
                    cmp("S", &sa, &sb, hv * dk * dv);
                    cmp("conv window", &ca, &cb, (kconv - 1) * conv_dim);
                    if side {
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                        assert_eq!(
                            down::<u32>(g, &snap_s, s0.len()),
                            bits(&s0),
                            "{tag}: snapshot of S"
                        );
                        assert_eq!(
                            down::<u32>(g, &snap_c, conv0.len()),
                            bits(&conv0),
                            "{tag}: snapshot of the conv window"
                        );
                    }
                    if side_mode == 1 {
                        cmp("k", &ko, &kb, n * qk);
                        cmp("v", &vo, &vb, n * vd);
                        cmp("beta", &beta, &betab, n * hv);
                        cmp("g", &gg, &gb, n * hv);
                    } else if side_mode == 2 {
                        cmp("verify record", &reca, &recb, n * width);
                    }
                }
            }
        }
        g.set_gdn_norm_batch(true);
        g.set_gdn_early_count(true);
        g.set_gdn_producer(true);
        eprintln!("gdn_conv_step hk {hk} hv {hv} dk {dk} conv {kconv}: bit-equal for n = 1..=8");
    }
    // shapes it cannot take are refused, not launched: (hk, hv, dk, dv), rows
    let refused = |shape: (usize, usize, usize, usize), n: usize, norm: Option<GdnNormOut>| {
        g.gdn_conv_step(
            0,
            0,
            0,
            0,
            4,
            shape,
            n,
            1e-6,
            (0, 0, 0, 0),
            0,
            None,
            None,
            norm,
        )
        .is_err()
    };
    assert!(refused((4, 2, 128, 128), 1, None));
    // nor more than 8 rows
    assert!(refused((16, 48, 128, 128), 9, None));
    // nor the gated norm for heads other than 128 wide
    let nz = GdnNormOut {
        z: 0,
        w: 0,
        eps: 1e-6,
        out: QuantOut {
            f: 0,
            q: 0,
            d: 0,
            s: 0,
        },
        p16: None,
    };
    assert!(refused((2, 6, 64, 64), 1, Some(nz)));
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Prefill GDN kernels against the decode kernels on the same inputs: `gdn_conv_rows` (+ its window
/// update) equals `gdn_conv` (v, gates and conv window bit for bit, q/k within 1e-6 and reported
/// when not bit-exact), and `gdn_step_seq` equals `gdn_step` within f32 rounding over n rows; a
/// split launch (rows 0..m, then m..n) gives the one-launch outputs and state bit for bit. Outputs
/// are poisoned with NaN first. Where the head has it (dk = dv = 128), `gdn_step_chunked` equals
/// `gdn_step` within the same bounds, in one launch and split ([`gdn_chunked_vs`]). The 27B and
/// the tiny-preset head shapes, n ∈ {9, 100, 512}, and the 27B heads with a hard decay.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn gdn_prefill_kernels_vs_decode_kernels() {
    let g = need_gpu!("gdn_prefill_kernels_vs_decode_kernels");
    // the last case decays hard (ssm_a × 80: log decays down to about -400 per row, so the
    // decay products underflow within a row or two)
    for &(hk, hv, dk, kconv, a_mul) in &[
        (16usize, 48usize, 128usize, 4usize, 1f32),
        (2, 6, 64, 4, 1.0),
        (16, 48, 128, 4, 80.0),
        // 3 taps: the generic conv kernel (4 taps take the sliding-window one)
        (2, 6, 64, 3, 1.0),
    ] {
        for &n in &[9usize, 100, 512] {
            let mut rng = Rng(91 + n as u64 + dk as u64);
            let dv = dk;
            let conv_dim = 2 * hk * dk + hv * dv;
            let (qk, vd) = (hk * dk, hv * dv);
            let eps = 1e-6f32;
            let mixed = rng.vec(n * conv_dim, 1.0);
            let conv0 = rng.vec((kconv - 1) * conv_dim, 1.0);
            let convw = rng.vec(conv_dim * kconv, 0.5);
            let bb = rng.vec(n * hv, 2.0);
            let aa = rng.vec(n * hv, 2.0);
            let dt_bias = rng.vec(hv, 1.0);
            let ssm_a: Vec<f32> = rng
                .vec(hv, 1.0)
                .iter()
                .map(|v| -(v.abs() + 0.1) * a_mul)
                .collect();
            let s0 = rng.vec(hv * dk * dv, 0.1);
            let up = |v: &[f32]| g.upload(v).unwrap();
            let nan = |k: usize| g.upload(&vec![f32::NAN; k]).unwrap();
            let (mb, wb, bbb, aab, dtb, ab) = (
                up(&mixed),
                up(&convw),
                up(&bb),
                up(&aa),
                up(&dt_bias),
                up(&ssm_a),
            );
            // [q, k, v, beta, g] per path
            let outs = || {
                [
                    nan(n * qk),
                    nan(n * qk),
                    nan(n * vd),
                    nan(n * hv),
                    nan(n * hv),
                ]
            };
            let (oa, ob) = (outs(), outs());
            let (ca, cb) = (up(&conv0), up(&conv0));
            for (prefill, c, o) in [(false, &ca, &oa), (true, &cb, &ob)] {
                let f = if prefill {
                    Gpu::gdn_conv_rows
                } else {
                    Gpu::gdn_conv
                };
                f(
                    g,
                    mb.ptr(),
                    c.ptr(),
                    wb.ptr(),
                    kconv,
                    hk,
                    hv,
                    dk,
                    n,
                    eps,
                    o[0].ptr(),
                    o[1].ptr(),
                    o[2].ptr(),
                    bbb.ptr(),
                    aab.ptr(),
                    dtb.ptr(),
                    ab.ptr(),
                    o[3].ptr(),
                    o[4].ptr(),
                )
                .unwrap();
            }
            let tag = format!("hk {hk} hv {hv} dk {dk} n {n} a×{a_mul}");
            let lens = [n * qk, n * qk, n * vd, n * hv, n * hv];
            for (i, name) in ["q", "k", "v", "beta", "g"].iter().enumerate() {
                let (a, b): (Vec<f32>, Vec<f32>) =
                    (down(g, &oa[i], lens[i]), down(g, &ob[i], lens[i]));
                assert!(
                    b.iter().all(|x| x.is_finite()),
                    "{tag}: conv {name} not written"
                );
                let exact = bits_eq(&a, &b);
                let e = max_rel(&b, &a);
                eprintln!("gdn prefill conv {tag} {name}: bit-exact {exact}, max rel {e:.2e}");
                if i >= 2 {
                    assert!(exact, "{tag}: conv {name} differs from gdn_conv");
                } else {
                    assert!(e < 1e-6, "{tag}: conv {name} max rel {e}");
                }
            }
            let (wa, wb2): (Vec<f32>, Vec<f32>) = (
                down(g, &ca, (kconv - 1) * conv_dim),
                down(g, &cb, (kconv - 1) * conv_dim),
            );
            assert!(bits_eq(&wa, &wb2), "{tag}: conv window differs");

            // recurrence on the decode conv's outputs
            // q, k, v, g, β
            let inp = [&oa[0], &oa[1], &oa[2], &oa[4], &oa[3]];
            let dims = (hk, hv, dk, dv);
            let (sa, sb) = (up(&s0), up(&s0));
            let (outa, outb) = (nan(n * vd), nan(n * vd));
            gdn_rows(g, Gpu::gdn_step, &sa, inp, dims, (0, n), &outa);
            gdn_rows(g, Gpu::gdn_step_seq, &sb, inp, dims, (0, n), &outb);
            let (a, b): (Vec<f32>, Vec<f32>) = (down(g, &outa, n * vd), down(g, &outb, n * vd));
            assert!(
                b.iter().all(|x| x.is_finite()),
                "{tag}: step out not written"
            );
            let (e, m) = (max_rel(&b, &a), nmse(&b, &a));
            eprintln!("gdn prefill step {tag} o: max rel {e:.2e}, nmse {m:.2e}");
            assert!(e < 1e-4 && m < 1e-10, "{tag}: step o max rel {e}, nmse {m}");
            let (a, b): (Vec<f32>, Vec<f32>) =
                (down(g, &sa, hv * dk * dv), down(g, &sb, hv * dk * dv));
            let (e, m) = (max_rel(&b, &a), nmse(&b, &a));
            eprintln!("gdn prefill step {tag} S: max rel {e:.2e}, nmse {m:.2e}");
            assert!(e < 1e-4 && m < 1e-10, "{tag}: step S max rel {e}, nmse {m}");

            // split launch == one launch, bit for bit
            let m1 = n / 2 + 1;
            let sc = up(&s0);
            let outc = nan(n * vd);
            for rows in [(0, m1), (m1, n)] {
                gdn_rows(g, Gpu::gdn_step_seq, &sc, inp, dims, rows, &outc);
            }
            let c: Vec<f32> = down(g, &outc, n * vd);
            assert!(
                bits_eq(&c, &down::<f32>(g, &outb, n * vd)),
                "{tag}: split step out"
            );
            // the kernel for any head dim gives the same bits as the dk = 128 one
            if dk == 128 {
                let sd = up(&s0);
                let outd = nan(n * vd);
                g.set_gdn_seq_generic(true);
                gdn_rows(g, Gpu::gdn_step_seq, &sd, inp, dims, (0, n), &outd);
                g.set_gdn_seq_generic(false);
                assert!(
                    bits_eq(
                        &down::<f32>(g, &outd, n * vd),
                        &down::<f32>(g, &outb, n * vd)
                    ),
                    "{tag}: generic gdn_step_seq out differs from the dk = 128 kernel"
                );
                assert!(
                    bits_eq(&down::<f32>(g, &sd, hv * dk * dv), &b),
                    "{tag}: generic gdn_step_seq S differs from the dk = 128 kernel"
                );
            }
            assert!(
                bits_eq(&down::<f32>(g, &sc, hv * dk * dv), &b),
                "{tag}: split step S"
            );
            if gdn_chunked_supported(dk, dv) {
                let want_o: Vec<f32> = down(g, &outa, n * vd);
                let want_s: Vec<f32> = down(g, &sa, hv * dk * dv);
                gdn_chunked_vs(g, &tag, &s0, inp, (hk, hv, dk, n), (&want_o, &want_s));
            }
        }
    }
}

/// The signature `gdn_step`, `gdn_step_seq` and `gdn_step_chunked` share.
type GdnStep = fn(
    &Gpu,
    u64,
    u64,
    u64,
    u64,
    u64,
    u64,
    usize,
    usize,
    usize,
    usize,
    usize,
    u64,
) -> bonsai_kernels_cuda::Result<()>;

/// `step` over rows `r0..r1` of `inp` (q, k, v, g, β; heads `(hk, hv, dk, dv)`), the state in
/// `s`, rows `r0..r1` of `out` written.
fn gdn_rows(
    g: &Gpu,
    step: GdnStep,
    s: &DevBuf,
    inp: [&DevBuf; 5],
    (hk, hv, dk, dv): (usize, usize, usize, usize),
    (r0, r1): (usize, usize),
    out: &DevBuf,
) {
    let (qk, vd) = (hk * dk, hv * dv);
    step(
        g,
        s.ptr(),
        inp[0].at(r0 * qk * 4),
        inp[1].at(r0 * qk * 4),
        inp[2].at(r0 * vd * 4),
        inp[3].at(r0 * hv * 4),
        inp[4].at(r0 * hv * 4),
        hk,
        hv,
        dk,
        dv,
        r1 - r0,
        out.at(r0 * vd * 4),
    )
    .unwrap();
}

/// `gdn_step_chunked` with both chunk walks (FP32, tensor-core) on the inputs of
/// [`gdn_prefill_kernels_vs_decode_kernels`] against the decode kernel's outputs `want` (out,
/// final S): one launch, then the rows split at a point that is not a chunk boundary (two
/// launches, the state carried between them); then every mode's time per launch at n = 512.
/// `inp`: q, k, v, g, β.
fn gdn_chunked_vs(
    g: &Gpu,
    tag: &str,
    s0: &[f32],
    inp: [&DevBuf; 5],
    (hk, hv, dk, n): (usize, usize, usize, usize),
    want: (&[f32], &[f32]),
) {
    let dv = dk;
    let vd = hv * dv;
    let (want_o, want_s) = want;
    let dflt = g.gdn_prefill();
    for (mode, split) in [GdnPrefill::Chunked, GdnPrefill::ChunkedTc]
        .into_iter()
        .flat_map(|m| [(m, None), (m, Some(n / 2 + 1))])
    {
        g.set_gdn_prefill(mode);
        let st = g.upload(s0).unwrap();
        let out = g.upload(&vec![f32::NAN; n * vd]).unwrap();
        let parts: Vec<(usize, usize)> = match split {
            None => vec![(0, n)],
            Some(m) => vec![(0, m), (m, n)],
        };
        for rows in parts {
            gdn_rows(
                g,
                Gpu::gdn_step_chunked,
                &st,
                inp,
                (hk, hv, dk, dv),
                rows,
                &out,
            );
        }
        let o: Vec<f32> = down(g, &out, n * vd);
        let s: Vec<f32> = down(g, &st, hv * dk * dv);
        assert!(
            o.iter().chain(&s).all(|x| x.is_finite()),
            "{tag}: {} (split {split:?}) not finite / not written",
            mode.name()
        );
        let (eo, mo) = (max_rel(&o, want_o), nmse(&o, want_o));
        let (es, ms) = (max_rel(&s, want_s), nmse(&s, want_s));
        eprintln!(
            "gdn {} {tag} split {split:?}: o max rel {eo:.2e} nmse {mo:.2e}; S max rel {es:.2e} nmse {ms:.2e}",
            mode.name()
        );
        assert!(
            eo < 1e-4 && mo < 1e-10,
            "{tag}: {} o max rel {eo}, nmse {mo}",
            mode.name()
        );
        assert!(
            es < 1e-4 && ms < 1e-10,
            "{tag}: {} S max rel {es}, nmse {ms}",
            mode.name()
        );
    }
    g.set_gdn_prefill(dflt);
    // one layer's recurrence at a prefill chunk of 512 rows, every mode (timing only, state and
    // outputs overwritten)
    if n == 512 {
        let st = g.upload(s0).unwrap();
        let out = g.upload(&vec![0f32; n * vd]).unwrap();
        let reps = 20;
        let mut times = Vec::new();
        for mode in GdnPrefill::ALL {
            g.set_gdn_prefill(mode);
            let step: GdnStep = if mode == GdnPrefill::RowByRow {
                Gpu::gdn_step_seq
            } else {
                Gpu::gdn_step_chunked
            };
            let run = || -> bonsai_kernels_cuda::Result<()> {
                gdn_rows(g, step, &st, inp, (hk, hv, dk, dv), (0, n), &out);
                Ok(())
            };
            run().unwrap();
            let us = g.time_ms(|| (0..reps).try_for_each(|_| run())).unwrap() * 1e3 / reps as f32;
            times.push(format!("{} {us:.1} us", mode.name()));
        }
        g.set_gdn_prefill(dflt);
        eprintln!("GDNTIME {tag}: per launch {}", times.join(", "));
    }
}

/// The causal prefill attention (`attn_prefill`, one launch over all rows) against the decode
/// path the backend used before (`attn_decode` per 8-row chunk) on the same cache: f32 outputs
/// within rounding, int8 codes / scales / sums exactly the quantization of its own f32 output, and
/// a split launch (rows 0..m at pos0, rows m..n at pos0 + m) bit-identical to one launch. Outputs
/// are poisoned with NaN first. Real 27B heads (n ∈ {9, 100, 512}, pos0 0 and > 0), small and tiny
/// preset heads.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn attention_prefill_vs_decode_path() {
    let g = need_gpu!("attention_prefill_vs_decode_path");
    for (pos0, n, hd, nh, nkv) in [
        (0usize, 9usize, 256usize, 24usize, 4usize),
        (0, 100, 256, 24, 4),
        (0, 512, 256, 24, 4),
        (37, 100, 256, 24, 4),
        (300, 45, 128, 8, 2),
        (5, 77, 64, 4, 2),
        // a key tile ending one past a warp's first row / starting at its last row (the
        // tensor-core kernel's unmasked and skipped tiles at their edges)
        (30, 40, 64, 2, 1),
        (17, 40, 64, 2, 1),
    ] {
        // both kernels: the tensor-core default and the FP32 one
        let dflt = g.attn_prefill_tc();
        for tc in [true, false] {
            g.set_attn_prefill_tc(tc);
            attention_prefill_case(g, pos0, n, hd, nh, nkv);
        }
        g.set_attn_prefill_tc(dflt);
    }
}

fn attention_prefill_case(g: &Gpu, pos0: usize, n: usize, hd: usize, nh: usize, nkv: usize) {
    let mut rng = Rng(1000 + 7 * pos0 as u64 + n as u64 + hd as u64);
    let (n_rot, base, eps) = (64usize.min(hd), 1.0e7f32, 1e-6f32);
    let n_ctx = pos0 + n + 40;
    let kvw = nkv * hd;
    // cache rows before pos0 (f16), the rest written by attn_prep; past pos0 + n: NaN (never read)
    let mut kc_host: Vec<u16> = (0..n_ctx * kvw)
        .map(|_| f16::from_f32(rng.f()).to_bits())
        .collect();
    let mut vc_host: Vec<u16> = (0..n_ctx * kvw)
        .map(|_| f16::from_f32(rng.f()).to_bits())
        .collect();
    for i in (pos0 + n) * kvw..n_ctx * kvw {
        kc_host[i] = f16::NAN.to_bits();
        vc_host[i] = f16::NAN.to_bits();
    }
    let qf = rng.vec(n * nh * 2 * hd, 1.0);
    let kf = rng.vec(n * kvw, 1.0);
    let vf = rng.vec(n * kvw, 1.0);
    let qn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect();
    let kn: Vec<f32> = rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect();
    let b = |v: &[f32]| g.upload(v).unwrap();
    let (qfb, kfb, vfb, qnb, knb) = (b(&qf), b(&kf), b(&vf), b(&qn), b(&kn));
    let kc = g.upload(&kc_host).unwrap();
    let vc = g.upload(&vc_host).unwrap();
    let pos: Vec<i32> = (0..n).map(|t| (pos0 + t) as i32).collect();
    let pb = g.upload(&pos).unwrap();
    let qo = g.alloc(n * nh * hd * 4).unwrap();
    g.attn_prep(
        qfb.ptr(),
        kfb.ptr(),
        vfb.ptr(),
        qnb.ptr(),
        knb.ptr(),
        eps,
        n,
        nh,
        nkv,
        hd,
        n_rot,
        base,
        pb.ptr(),
        qo.ptr(),
        kc.ptr(),
        vc.ptr(),
    )
    .unwrap();
    let k = nh * hd;
    // the decode path, 8 rows per launch
    let part = g
        .alloc(bonsai_kernels_cuda::attn_part_floats(8, nh, hd, n_ctx) * 4)
        .unwrap();
    let outa = g.alloc(n * k * 4).unwrap();
    let (qa, da, sa) = (
        g.alloc(n * k).unwrap(),
        g.alloc(n * k / 32 * 4).unwrap(),
        g.alloc(n * k / 32 * 4).unwrap(),
    );
    let mut t0 = 0;
    while t0 < n {
        let nr = (n - t0).min(8);
        g.attn_decode(
            qo.at(t0 * k * 4),
            qfb.at(t0 * nh * 2 * hd * 4),
            kc.ptr(),
            vc.ptr(),
            nr,
            nh,
            nkv,
            hd,
            pb.at(t0 * 4),
            n_ctx,
            part.ptr(),
            outa.at(t0 * k * 4),
            qa.at(t0 * k),
            da.at(t0 * k / 32 * 4),
            sa.at(t0 * k / 32 * 4),
        )
        .unwrap();
        t0 += nr;
    }
    // the prefill kernel, outputs poisoned
    let outb = g.upload(&vec![f32::NAN; n * k]).unwrap();
    let qb = g.upload(&vec![0x7fi8; n * k]).unwrap();
    let db = g.upload(&vec![f32::NAN; n * k / 32]).unwrap();
    let sb = g.upload(&vec![i32::MIN; n * k / 32]).unwrap();
    // the one-launch prefill over all rows (f32 output to `out`, 0: none)
    let prefill_all = |out: u64| {
        g.attn_prefill(
            qo.ptr(),
            qfb.ptr(),
            kc.ptr(),
            vc.ptr(),
            n,
            nh,
            nkv,
            hd,
            pb.ptr(),
            out,
            qb.ptr(),
            db.ptr(),
            sb.ptr(),
        )
    };
    prefill_all(outb.ptr()).unwrap();
    let want: Vec<f32> = down(g, &outa, n * k);
    let got: Vec<f32> = down(g, &outb, n * k);
    assert!(
        got.iter().all(|v| v.is_finite()),
        "attention prefill output not written / non-finite"
    );
    let e = max_rel(&got, &want);
    let m = nmse(&got, &want);
    let kind = if g.attn_prefill_tc() {
        "tensor-core"
    } else {
        "fp32"
    };
    eprintln!(
        "attention prefill ({kind}) pos0 {pos0} n {n} hd {hd}: max rel {e:.2e}, nmse {m:.2e} vs attn_decode"
    );
    assert!(e < 1e-4, "attention prefill max rel {e}");
    let (hq, hd_, hs) = host_quant(&got, k);
    assert_eq!(
        down::<i8>(g, &qb, n * k),
        hq,
        "attention prefill int8 codes"
    );
    assert_eq!(
        down::<f32>(g, &db, n * k / 32),
        hd_,
        "attention prefill scales"
    );
    assert_eq!(
        down::<i32>(g, &sb, n * k / 32),
        hs,
        "attention prefill sums"
    );
    // split launch: rows 0..m1 then m1..n (positions pos0 + m1..): bit-identical rows
    let m1 = n / 2 - 3;
    let outc = g.upload(&vec![f32::NAN; n * k]).unwrap();
    for (r0, r1) in [(0, m1), (m1, n)] {
        g.attn_prefill(
            qo.at(r0 * k * 4),
            qfb.at(r0 * nh * 2 * hd * 4),
            kc.ptr(),
            vc.ptr(),
            r1 - r0,
            nh,
            nkv,
            hd,
            pb.at(r0 * 4),
            outc.ptr() + (r0 * k * 4) as u64,
            qa.at(r0 * k),
            da.at(r0 * k / 32 * 4),
            sa.at(r0 * k / 32 * 4),
        )
        .unwrap();
    }
    let split: Vec<f32> = down(g, &outc, n * k);
    assert!(
        bits_eq(&split, &got),
        "attention prefill ({kind}) split launch differs"
    );
    if n == 512 {
        // one layer's attention at a prefill chunk of 512 rows (timing only)
        let reps = 20;
        prefill_all(0).unwrap();
        let us = g
            .time_ms(|| (0..reps).try_for_each(|_| prefill_all(0)))
            .unwrap()
            * 1e3
            / reps as f32;
        eprintln!("ATTNTIME ({kind}) nh {nh} nkv {nkv} hd {hd} n {n}: {us:.1} us per launch");
    }
}

/// What one kernel boundary costs inside a captured graph: chains of 512 dependent launches of a
/// kernel that does nothing but wait for its predecessor and bump a counter, with 1 to 528 blocks,
/// with and without programmatic dependent launch. The decode step is ~640 launches, so this is
/// the floor that fusing kernels can remove. The counter checks that no launch overtook its
/// predecessor (a lost increment).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn launch_chain_cost() {
    let g = need_gpu!("launch_chain_cost");
    const LINKS: usize = 512;
    const REPS: usize = 5;
    let p = g.upload(&[0i32]).unwrap();
    let pdl0 = g.pdl();
    let mut expect = 0i32;
    for pdl in [true, false] {
        g.set_pdl(pdl);
        for blocks in [1, 32, 132, 528] {
            g.begin_capture().unwrap();
            for _ in 0..LINKS {
                g.launch_chain_step(p.ptr(), blocks).unwrap();
            }
            let graph = g.end_capture().unwrap();
            g.launch_graph(&graph).unwrap(); // warm-up
            let ms = g
                .time_ms(|| {
                    for _ in 0..REPS {
                        g.launch_graph(&graph)?;
                    }
                    Ok(())
                })
                .unwrap();
            expect += ((REPS + 1) * LINKS) as i32;
            let got: Vec<i32> = down(g, &p, 1);
            assert_eq!(got[0], expect, "a chained launch overtook its predecessor");
            println!(
                "LAUNCHGAP pdl={pdl} blocks={blocks}: {:.2} us per dependent kernel in a graph",
                ms as f64 * 1e3 / (REPS * LINKS) as f64
            );
        }
    }
    g.set_pdl(pdl0);
}

/// One b1-plane test case on the host: logical code words `[n_out, nblk, planes, 4]` (plane q
/// holds bit q of each code: 1 plane for Q1_0, 2 for Q2_0), f16 scales, int16 activations
/// `[n, n_in]` with block scales, and the tiled device layouts of `kernels/mvbp.cu`.
struct B1pCase {
    n_in: usize,
    code_planes: usize,
    words: Vec<u32>,
    dw: Vec<f16>,
    act: Vec<i16>,
    u: Vec<f32>,
    codes: Vec<u32>,
    scales: Vec<u32>,
    planes: Vec<u32>,
    sums: Vec<i32>,
}

fn b1p_case(rng: &mut Rng, code_planes: usize, n_in: usize, n_out: usize, n: usize) -> B1pCase {
    let (nblk, npair, ntile) = (n_in / 128, n_in / 256, n_out / 16);
    let words: Vec<u32> = (0..n_out * nblk * code_planes * 4)
        .map(|_| rng.u64() as u32)
        .collect();
    let dw: Vec<f16> = (0..n_out * nblk)
        .map(|_| f16::from_f32(0.001 + 0.02 * rng.f().abs()))
        .collect();
    let act: Vec<i16> = (0..n * n_in).map(|_| rng.u64() as u16 as i16).collect();
    let u: Vec<f32> = (0..n * nblk).map(|_| 1e-5 + 1e-3 * rng.f().abs()).collect();
    let w = |r: usize, b: usize, q: usize, tg: usize| {
        words[((r * nblk + b) * code_planes + q) * 4 + tg]
    };
    let mut codes = Vec::with_capacity(n_out * nblk * code_planes * 4);
    for t in 0..ntile {
        for p in 0..npair {
            for q in 0..code_planes {
                for lane in 0..32 {
                    let (g, tg) = (lane / 4, lane % 4);
                    let (r0, r1) = (16 * t + g, 16 * t + g + 8);
                    codes.extend([
                        w(r0, 2 * p, q, tg),
                        w(r1, 2 * p, q, tg),
                        w(r0, 2 * p + 1, q, tg),
                        w(r1, 2 * p + 1, q, tg),
                    ]);
                }
            }
        }
    }
    let mut scales = Vec::with_capacity(ntile * nblk * 8);
    for t in 0..ntile {
        for b in 0..nblk {
            for g in 0..8 {
                let lo = dw[(16 * t + g) * nblk + b].to_bits() as u32;
                let hi = dw[(16 * t + g + 8) * nblk + b].to_bits() as u32;
                scales.push(lo | hi << 16);
            }
        }
    }
    // plane p word tg of block b of row t: bit i = bit p of code 32tg + i
    let plane = |t: usize, b: usize, p: usize, tg: usize| -> u32 {
        (0..32).fold(0u32, |acc, i| {
            let a = act[t * n_in + b * 128 + 32 * tg + i] as u16;
            acc | (((a >> p) & 1) as u32) << i
        })
    };
    let mut planes = Vec::with_capacity(n * npair * 128);
    let mut sums = Vec::with_capacity(n * nblk * 4);
    for t in 0..n {
        for p in 0..npair {
            for lane in 0..32 {
                let (g, tg) = (lane / 4, lane % 4);
                planes.extend([
                    plane(t, 2 * p, g, tg),
                    plane(t, 2 * p, 8 + g, tg),
                    plane(t, 2 * p + 1, g, tg),
                    plane(t, 2 * p + 1, 8 + g, tg),
                ]);
            }
        }
        for b in 0..nblk {
            for j in 0..4 {
                let sj: i32 = (0..32)
                    .map(|i| act[t * n_in + b * 128 + 32 * j + i] as i32)
                    .sum();
                sums.push(sj);
            }
        }
    }
    B1pCase {
        n_in,
        code_planes,
        words,
        dw,
        act,
        u,
        codes,
        scales,
        planes,
        sums,
    }
}

/// The b1-plane test shapes `(code planes, n_in, segment rows)`: K splits 4 (two cases), 16, 8,
/// 2 and 1 by `mvbp_ks`, then `extra`, each for one (Q1_0) and two (Q2_0) code planes.
fn b1p_shapes(extra: &[(usize, Vec<usize>)]) -> Vec<(usize, usize, Vec<usize>)> {
    let base = [
        (5120usize, vec![1024usize, 512, 48, 48]),
        (6144, vec![640]),
        (17408, vec![320]),
        (8192, vec![64]),
        (2048, vec![16]),
        (256, vec![32, 16]),
    ];
    [1usize, 2]
        .into_iter()
        .flat_map(|pl| {
            base.iter()
                .chain(extra)
                .map(move |(k, s)| (pl, *k, s.clone()))
        })
        .collect()
}

/// A case's device buffers: codes, scales, planes, units, sums.
fn b1p_upload(g: &Gpu, c: &B1pCase) -> (DevBuf, DevBuf, DevBuf, DevBuf, DevBuf) {
    (
        g.upload(&c.codes).unwrap(),
        g.upload(&c.scales).unwrap(),
        g.upload(&c.planes).unwrap(),
        g.upload(&c.u).unwrap(),
        g.upload(&c.sums).unwrap(),
    )
}

/// y[t, r] = Σ_b dw·u·Σ_k w_k·a_k in f64 (the integer part exact), w = 2c − 1 (Q1_0) or c − 1
/// (Q2_0, c = bit 0 + 2·bit 1).
fn b1p_reference(c: &B1pCase, t: usize, r: usize) -> f64 {
    let nblk = c.n_in / 128;
    (0..nblk)
        .map(|b| {
            let isum: i64 = (0..128)
                .map(|k| {
                    let bit = |q: usize| {
                        ((c.words[((r * nblk + b) * c.code_planes + q) * 4 + k / 32] >> (k % 32))
                            & 1) as i64
                    };
                    let w = if c.code_planes == 1 {
                        2 * bit(0) - 1
                    } else {
                        bit(0) + 2 * bit(1) - 1
                    };
                    w * c.act[t * c.n_in + b * 128 + k] as i64
                })
                .sum();
            c.dw[r * nblk + b].to_f64() * c.u[t * nblk + b] as f64 * isum as f64
        })
        .sum()
}

/// The b1-plane Q1_0 mat-vec (`mvbp_q1_*`) against an f64 reference of its own inputs, at every
/// K split it has; each row of a 5-row launch equals the one-row launch of that row bit for bit,
/// and `accumulate` adds the launch's value to y with one f32 add.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn mv_b1p_equals_f64_and_one_row() {
    let g = need_gpu!("mv_b1p_equals_f64_and_one_row");
    let mut rng = Rng(91);
    let n = 5;
    for (planes, n_in, segs) in b1p_shapes(&[]) {
        let rows: usize = segs.iter().sum();
        let ks = mvbp_ks(rows / 16, n_in);
        let c = b1p_case(&mut rng, planes, n_in, rows, n);
        let (nblk, npair) = (n_in / 128, n_in / 256);
        let (codes, scales, xp, xu, xs) = b1p_upload(g, &c);
        // segments: consecutive row ranges of the one matrix (codes of a tile are contiguous)
        let run = |y: &DevBuf, t: usize, nr: usize, accumulate: bool| {
            let mut o = 0;
            let mut v = Vec::new();
            for &so in &segs {
                v.push(MvSeg {
                    codes: codes.ptr() + (o / 16 * npair * 512 * planes) as u64,
                    scales: scales.ptr() + (o / 16 * nblk * 32) as u64,
                    y: y.ptr() + (o * 4) as u64,
                    n_out: so,
                });
                o += so;
            }
            // y rows of segment i are [nr, n_out_i] at its own base: use one segment per buffer
            g.mv_b1p(
                planes,
                &v,
                xp.ptr() + (t * npair * 512) as u64,
                xu.ptr() + (t * nblk * 4) as u64,
                xs.ptr() + (t * nblk * 16) as u64,
                n_in,
                nr,
                accumulate,
            )
            .unwrap();
        };
        if segs.len() > 1 {
            // a grouped launch writes each segment's [n, n_out_i] block at its own y: check the
            // one-row launch only (the n-row layout per segment is checked with one segment)
            let y = g.upload(&vec![f32::NAN; rows]).unwrap();
            run(&y, 0, 1, false);
            let got: Vec<f32> = down(g, &y, rows);
            let want: Vec<f64> = (0..rows).map(|r| b1p_reference(&c, 0, r)).collect();
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (r, (&a, &b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    ((a as f64) - b).abs() <= 1e-5 * scale,
                    "[{n_in}x{segs:?}] ks {ks} row {r}: {a} vs {b}"
                );
            }
            continue;
        }
        let y5 = g.upload(&vec![f32::NAN; n * rows]).unwrap();
        run(&y5, 0, n, false);
        let got5: Vec<f32> = down(g, &y5, n * rows);
        let want: Vec<f64> = (0..n * rows)
            .map(|i| b1p_reference(&c, i / rows, i % rows))
            .collect();
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (&a, &b)) in got5.iter().zip(&want).enumerate() {
            assert!(
                ((a as f64) - b).abs() <= 1e-5 * scale,
                "[{n_in}x{rows}] ks {ks} t {} row {}: {a} vs {b}",
                i / rows,
                i % rows
            );
        }
        for t in 0..n {
            let y1 = g.upload(&vec![f32::NAN; rows]).unwrap();
            run(&y1, t, 1, false);
            let got1: Vec<f32> = down(g, &y1, rows);
            for r in 0..rows {
                assert_eq!(
                    got1[r].to_bits(),
                    got5[t * rows + r].to_bits(),
                    "[{n_in}x{rows}] ks {ks}: row {r} of activation {t} differs between n = 1 and n = {n}"
                );
            }
            // a one-row launch with a switch flipped (`flip(true)` before it, `flip(false)` after):
            // the same bits
            let same_bits_with = |flip: &dyn Fn(bool), what: &str| {
                flip(true);
                let y = g.upload(&vec![f32::NAN; rows]).unwrap();
                run(&y, t, 1, false);
                flip(false);
                let got: Vec<f32> = down(g, &y, rows);
                for r in 0..rows {
                    assert_eq!(
                        got[r].to_bits(),
                        got1[r].to_bits(),
                        "[{n_in}x{rows}] ks {ks}: row {r} of activation {t}, {what}"
                    );
                }
            };
            // the one-row kernels with the activation row in registers, not shared memory
            let xs0 = g.b1p_xs();
            same_bits_with(
                &|on| g.set_b1p_xs(xs0 != on),
                &format!("b1p_xs {} against {xs0}", !xs0),
            );
            if t == 0 {
                let y0 = rng.vec(rows, 3.0);
                let ya = g.upload(&y0).unwrap();
                run(&ya, 0, 1, true);
                let acc: Vec<f32> = down(g, &ya, rows);
                for r in 0..rows {
                    assert_eq!(
                        acc[r].to_bits(),
                        (y0[r] + got1[r]).to_bits(),
                        "accumulate row {r}"
                    );
                }
            }
        }
        eprintln!(
            "mv_b1p {planes} plane(s) [{n_in} x {rows}] K split {ks}: f64 within 1e-5, n = 1 == n = {n} (activation row in shared memory and not), accumulate"
        );
    }
    // shapes it refuses: n_out not a multiple of 16, n_in not of 256, 6 rows
    let z = g.alloc(1 << 16).unwrap();
    let seg = |n_out| scratch_seg(&z, n_out);
    assert!(g
        .mv_b1p(1, &[seg(24)], z.ptr(), z.ptr(), z.ptr(), 256, 1, false)
        .is_err());
    assert!(g
        .mv_b1p(2, &[seg(16)], z.ptr(), z.ptr(), z.ptr(), 384, 1, false)
        .is_err());
    assert!(g
        .mv_b1p(1, &[seg(16)], z.ptr(), z.ptr(), z.ptr(), 256, 6, false)
        .is_err());
    assert!(g
        .mv_b1p(3, &[seg(16)], z.ptr(), z.ptr(), z.ptr(), 256, 1, false)
        .is_err());
}

/// A segment of `n_out` rows whose codes, scales and output all point at the scratch `z` (for the
/// shapes a launcher must refuse before it reads anything).
fn scratch_seg(z: &DevBuf, n_out: usize) -> MvSeg {
    MvSeg {
        codes: z.ptr(),
        scales: z.ptr(),
        y: z.ptr(),
        n_out,
    }
}

/// The int8 tensor-core verify kernel on the b1-plane layout (`mvbq_q1_*`): every row of a
/// 2..=8-row launch equals the one-row b1-plane launch of that row bit for bit (the same exact
/// block integers, the same float operations, the shape's K split), at every K split, in both
/// load forms ([`Gpu::b1q_ahead`]) and at 1 and 2 tiles per warp ([`Gpu::b1q_tiles`]); grouped
/// segments, `accumulate`, and the shapes it refuses.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn mv_b1q_equals_b1p_one_row() {
    let g = need_gpu!("mv_b1q_equals_b1p_one_row");
    let ahead0 = g.b1q_ahead();
    let tiles0 = g.b1q_tiles();
    // (tiles per warp, AHEAD): `_r1`, `_r2`, `_r2a`
    let forms = [(1usize, false), (2, false), (2, true)];
    let mut rng = Rng(93);
    let nmax = bonsai_kernels_cuda::MAX_ROWS;
    // and one launch of an odd tile count
    for (planes, n_in, segs) in b1p_shapes(&[(5120, vec![16480])]) {
        let rows: usize = segs.iter().sum();
        let ks = mvbp_ks(rows / 16, n_in);
        let c = b1p_case(&mut rng, planes, n_in, rows, nmax);
        let (nblk, npair) = (n_in / 128, n_in / 256);
        let (codes, scales, xp, xu, xs) = b1p_upload(g, &c);
        let xv = g.upload(&b1q_acts_host(&c.act)).unwrap();
        // one output buffer per segment, [n, n_out_i] each
        let ys: Vec<DevBuf> = segs
            .iter()
            .map(|&so| g.upload(&vec![f32::NAN; nmax * so]).unwrap())
            .collect();
        let mut seg_list = Vec::new();
        let mut o = 0;
        for (y, &so) in ys.iter().zip(&segs) {
            seg_list.push(MvSeg {
                codes: codes.ptr() + (o / 16 * npair * 512 * planes) as u64,
                scales: scales.ptr() + (o / 16 * nblk * 32) as u64,
                y: y.ptr(),
                n_out: so,
            });
            o += so;
        }
        // the outputs of activation rows 0..nr, the segments concatenated: [t][row]
        let gather = |nr: usize| -> Vec<Vec<f32>> {
            let mut out = vec![Vec::with_capacity(rows); nr];
            for (y, &so) in ys.iter().zip(&segs) {
                let y: Vec<f32> = down(g, y, nr * so);
                for (t, o) in out.iter_mut().enumerate() {
                    o.extend_from_slice(&y[t * so..(t + 1) * so]);
                }
            }
            out
        };
        // the one-row b1-plane launches: want[t][row]
        let mut want = Vec::with_capacity(nmax);
        for t in 0..nmax {
            g.mv_b1p(
                planes,
                &seg_list,
                xp.ptr() + (t * npair * 512) as u64,
                xu.ptr() + (t * nblk * 4) as u64,
                xs.ptr() + (t * nblk * 16) as u64,
                n_in,
                1,
                false,
            )
            .unwrap();
            want.extend(gather(1));
        }
        // the int8 tensor-core launch of n rows
        let b1q = |n: usize, accumulate: bool| {
            g.mv_b1q(
                planes,
                &seg_list,
                xv.ptr(),
                xu.ptr(),
                xs.ptr(),
                n_in,
                n,
                accumulate,
            )
            .unwrap()
        };
        // every form (`Gpu::b1q_ahead`: the activations a block ahead, the weights not in L1;
        // `Gpu::b1q_tiles`: the tiles per warp)
        for ((tiles, ahead), n) in forms
            .into_iter()
            .flat_map(|f| [2usize, 5, 8].map(|n| (f, n)))
        {
            g.set_b1q_ahead(ahead);
            g.set_b1q_tiles(tiles).unwrap();
            for y in &ys {
                g.htod(y, 0, &vec![f32::NAN; y.bytes() / 4]).unwrap();
            }
            b1q(n, false);
            let got = gather(nmax);
            for t in 0..nmax {
                for r in 0..rows {
                    let got = got[t][r];
                    if t < n {
                        assert_eq!(
                            got.to_bits(),
                            want[t][r].to_bits(),
                            "[{n_in}x{segs:?}] ks {ks} tiles {tiles} ahead {ahead} n {n}: activation {t} row {r} ({got} vs {})",
                            want[t][r]
                        );
                    } else {
                        assert!(got.is_nan(), "n {n}: row {t} written");
                    }
                }
            }
        }
        // accumulate: one f32 add onto y, in every form
        for (tiles, ahead) in forms {
            g.set_b1q_ahead(ahead);
            g.set_b1q_tiles(tiles).unwrap();
            let y0s: Vec<Vec<f32>> = segs.iter().map(|&so| rng.vec(3 * so, 3.0)).collect();
            for (y, v) in ys.iter().zip(&y0s) {
                g.htod(y, 0, v).unwrap();
            }
            // the same [t][row], the segments concatenated
            let y0: Vec<Vec<f32>> = (0..3)
                .map(|t| {
                    y0s.iter()
                        .zip(&segs)
                        .flat_map(|(v, &so)| v[t * so..(t + 1) * so].iter().copied())
                        .collect()
                })
                .collect();
            b1q(3, true);
            let acc = gather(3);
            for t in 0..3 {
                for r in 0..rows {
                    assert_eq!(
                        acc[t][r].to_bits(),
                        (y0[t][r] + want[t][r]).to_bits(),
                        "accumulate tiles {tiles} ahead {ahead} [{n_in}x{segs:?}] activation {t} row {r}"
                    );
                }
            }
        }
        g.set_b1q_ahead(ahead0);
        g.set_b1q_tiles(tiles0).unwrap();
        eprintln!(
            "mv_b1q {planes} plane(s) [{n_in} x {segs:?}] K split {ks}: n = 2, 5, 8 == one-row b1-plane bit for bit, accumulate, forms {forms:?}"
        );
    }
    let z = g.alloc(1 << 16).unwrap();
    let seg = |n_out| scratch_seg(&z, n_out);
    let p = z.ptr();
    assert!(g.mv_b1q(1, &[seg(24)], p, p, p, 256, 2, false).is_err());
    assert!(g.mv_b1q(2, &[seg(16)], p, p, p, 384, 2, false).is_err());
    assert!(g.mv_b1q(1, &[seg(16)], p, p, p, 256, 9, false).is_err());
    assert!(g.mv_b1q(2, &[seg(16)], p + 4, p, p, 256, 2, false).is_err());
    assert!(g.mv_b1q(0, &[seg(16)], p, p, p, 256, 2, false).is_err());
    assert!(g.set_b1q_tiles(4).is_err());
    assert_eq!(g.b1q_tiles(), tiles0);
}

/// `mv_swiglu_b1p` (the SwiGLU-fused b1-plane gate‖up launch) equals `mv_b1p` over [gate, up]
/// followed by `swiglu_quant`, bit for bit (f32, codes, scales, sums), at the 27B shape and a small
/// one; shapes whose K split is not 1 are refused without a launch.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn mv_swiglu_b1p_equals_matvec_then_swiglu() {
    let g = need_gpu!("mv_swiglu_b1p_equals_matvec_then_swiglu");
    let mut rng = Rng(93);
    for (planes, n_in, n_out) in [
        (1usize, 5120usize, 17408usize),
        (1, 512, 1024),
        (2, 5120, 17408),
        (2, 512, 1024),
    ] {
        assert_eq!(mvbp_ks(2 * n_out / 16, n_in), 1);
        let c = b1p_case(&mut rng, planes, n_in, 2 * n_out, 1);
        let (nblk, npair) = (n_in / 128, n_in / 256);
        let (codes, scales, xp, xu, xs) = b1p_upload(g, &c);
        let gate = (codes.ptr(), scales.ptr());
        let t = n_out / 16;
        let up = (
            codes.ptr() + (t * npair * 512 * planes) as u64,
            scales.ptr() + (t * nblk * 32) as u64,
        );
        // the fused launch into a fresh set of outputs: whether it launched, and the outputs
        let launch_fused = || {
            let o = swi_outs(g, n_out);
            let x = (xp.ptr(), xu.ptr(), xs.ptr());
            let launched = g
                .mv_swiglu_b1p(planes, gate, up, n_out, n_in, x, quant_out(&o), None)
                .unwrap();
            (launched, o)
        };
        let (launched, fused) = launch_fused();
        assert!(launched);
        let (hf, hq, hd, hs) = &fused;
        let y = g.alloc(2 * n_out * 4).unwrap();
        g.mv_b1p(
            planes,
            &[
                MvSeg {
                    codes: gate.0,
                    scales: gate.1,
                    y: y.ptr(),
                    n_out,
                },
                MvSeg {
                    codes: up.0,
                    scales: up.1,
                    y: y.ptr() + (n_out * 4) as u64,
                    n_out,
                },
            ],
            xp.ptr(),
            xu.ptr(),
            xs.ptr(),
            n_in,
            1,
            false,
        )
        .unwrap();
        let (rf, rq, rd, rs) = swi_outs(g, n_out);
        g.swiglu_quant(
            y.ptr(),
            y.ptr() + (n_out * 4) as u64,
            1,
            n_out,
            rf.ptr(),
            rq.ptr(),
            rd.ptr(),
            rs.ptr(),
        )
        .unwrap();
        assert_eq!(
            down::<u32>(g, hf, n_out),
            down::<u32>(g, &rf, n_out),
            "[{n_in} x {n_out}] f32"
        );
        assert_eq!(down::<i8>(g, hq, n_out), down::<i8>(g, &rq, n_out), "codes");
        assert_eq!(
            down::<u32>(g, hd, n_out / 32),
            down::<u32>(g, &rd, n_out / 32),
            "scales"
        );
        assert_eq!(
            down::<i32>(g, hs, n_out / 32),
            down::<i32>(g, &rs, n_out / 32),
            "sums"
        );
        // the activation row in registers, not shared memory: the same bits
        let xs0 = g.b1p_xs();
        g.set_b1p_xs(!xs0);
        let (launched, other) = launch_fused();
        let (xf, xq, _, xsum) = &other;
        g.set_b1p_xs(xs0);
        assert!(launched);
        assert_eq!(
            down::<u32>(g, xf, n_out),
            down::<u32>(g, &rf, n_out),
            "[{n_in} x {n_out}] b1p_xs {}: f32",
            !xs0
        );
        assert_eq!(down::<i8>(g, xq, n_out), down::<i8>(g, &rq, n_out));
        assert_eq!(
            down::<i32>(g, xsum, n_out / 32),
            down::<i32>(g, &rs, n_out / 32)
        );
        // the SwiGLU as b1-plane activations (a cluster of 4 blocks per 128 outputs) ==
        // swiglu_quant_p16 of the same gate‖up rows
        let (pf, _, _, _) = swi_outs(g, n_out);
        let p16 = p16_alloc(g, 1, n_out);
        let x = (xp.ptr(), xu.ptr(), xs.ptr());
        let out = QuantOut {
            f: pf.ptr(),
            q: 0,
            d: 0,
            s: 0,
        };
        let launched = g
            .mv_swiglu_b1p(
                planes,
                gate,
                up,
                n_out,
                n_in,
                x,
                out,
                Some(p16_out(&p16, false)),
            )
            .unwrap();
        assert!(launched);
        assert_eq!(
            down::<u32>(g, &pf, n_out),
            down::<u32>(g, &rf, n_out),
            "[{n_in} x {n_out}] p16: f32"
        );
        let rows: Vec<f32> = down::<u32>(g, &rf, n_out)
            .iter()
            .map(|&b| f32::from_bits(b))
            .collect();
        assert_p16_eq_host(
            g,
            &rows,
            1,
            n_out,
            &p16,
            false,
            &format!("mv_swiglu_b1p p16 [{n_in} x {n_out}]"),
        );
        let q16 = p16_alloc(g, 1, n_out);
        g.swiglu_quant_p16(
            y.ptr(),
            y.ptr() + (n_out * 4) as u64,
            1,
            n_out,
            0,
            p16_out(&q16, false),
        )
        .unwrap();
        for i in 0..3 {
            assert_eq!(
                down::<u32>(g, &p16[i], [n_out / 2, n_out / 128, n_out / 32][i]),
                down::<u32>(g, &q16[i], [n_out / 2, n_out / 128, n_out / 32][i]),
                "[{n_in} x {n_out}] p16 buffer {i} == swiglu_quant_p16"
            );
        }
        eprintln!("mv_swiglu_b1p {planes} plane(s) [{n_in} x {n_out}] == mv_b1p + swiglu_quant (activation row in shared memory and not); its b1-plane output == mv_b1p + swiglu_quant_p16 == host twin");
    }
    // a shape with K split above 1 (few rows, long K) is not taken
    let z = g.alloc(1 << 20).unwrap();
    let p = z.ptr();
    let out = QuantOut {
        f: 0,
        q: p,
        d: p,
        s: p,
    };
    assert!(!g
        .mv_swiglu_b1p(1, (p, p), (p, p), 32, 8192, (p, p, p), out, None)
        .unwrap());
}
