//! The DSpark drafter on the GPU (`backend::cuda_drafter`) against the host drafter (the oracle).
//!
//! - `cuda_q41_mv_vs_reference`: the Q4_1 mat-vecs (dp4a with 2 and 4 rows per warp, and the
//!   tensor-core `mvt_q41`, which must also equal its host twin `mv_q41t_host` bit for bit) at the drafter's shapes (5120→5120, 25600→5120,
//!   5120→512, 5120→248320, an odd small one) against an f64 emulation of the same int8 math
//!   (relative 1e-5 of the absolute term sum), NMSE against the CPU f32-activation matmul ≤ 1e-3,
//!   rows independent of n (bit for bit), and a 3-segment launch equal to the single one (bit for bit).
//! - `cuda_q41_timing` (a timing, not a check): both Q4_1 kernels at the drafter's launch shapes.
//! - `cuda_drafter_matches_host`: for the tiny builder drafter and the synthetic tiny / small
//!   drafters of `$BONSAI_CUDA_MODELS/dspark`, random tap rows staged in uneven batches up to a full
//!   window (with eviction): the context K/V window matches the host's (NMSE ≤ 5e-4), and for many
//!   (id_last, context) cases the head logits match (NMSE ≤ 2e-3 per row) and the drafted ids equal
//!   the host's except at near-ties: a differing id must be within `2·max|Δlogits| + 1e-3` of the
//!   host's best Markov score (the chains are compared up to the first difference). A draft leaves
//!   the context unchanged.
//! - `cuda_drafter_graph_equals_eager`: the captured draft (the default) against the eager one, on
//!   two states staged alike through short contexts, a full window and past it: drafted ids and
//!   head logits bit for bit.
//! - `cuda_engine_gpu_drafter_equals_plain`: `Engine` on CUDA with a DSpark drafter (GPU drafter, the
//!   default) gives plain greedy output, on the builder models (and the model folder when set).
//!
//! Without a CUDA device every test prints SKIPPED and returns.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bonsai_engine::backend::cuda::CudaBackend;
use bonsai_engine::backend::cuda_drafter::{CudaDraftState, CudaDrafter};
use bonsai_engine::backend::{Backend, GdnMode};
use bonsai_engine::config::TargetConfig;
use bonsai_engine::drafter::Drafter;
use bonsai_engine::engine::{DraftSource, Engine, EngineOptions};
use bonsai_engine::gguf::Gguf;
use bonsai_engine::sampling::SamplerParams;
use bonsai_engine::spec::{PolicyMode, Rollback};
use bonsai_engine::QuantType;
use bonsai_kernels_cpu::ops;
use bonsai_kernels_cuda::{self as kc, Gpu, MvSeg};
use half::f16;

const SKIP_GPU: &str = "no CUDA device (not counted as run)";

struct Model {
    name: String,
    path: PathBuf,
    drafter: PathBuf,
}

fn gpu_or_skip(test: &str) -> Option<CudaBackend> {
    if !CudaBackend::available() {
        eprintln!("SKIPPED {test}: {SKIP_GPU}");
        return None;
    }
    Some(CudaBackend::new(0).expect("cuda backend"))
}

/// The tiny builder target (Q1_0) with the tiny builder drafter, plus the `$BONSAI_CUDA_MODELS`
/// targets that have a `dspark/<same name>` drafter.
fn models(test: &str) -> Vec<Model> {
    let dir = std::env::temp_dir().join(format!("bonsai-cuda-drafter-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static N: AtomicUsize = AtomicUsize::new(0);
    let write = |b: &common::Builder, name: &str| {
        let p = dir.join(format!("{}-{name}", N.fetch_add(1, Ordering::Relaxed)));
        std::fs::write(&p, b.build()).unwrap();
        p
    };
    let mut v = vec![Model {
        name: "builder-tiny-q1".into(),
        path: write(&common::tiny_target(QuantType::Q1_0), "target.gguf"),
        drafter: write(&common::tiny_drafter(QuantType::Q1_0), "drafter.gguf"),
    }];
    match std::env::var("BONSAI_CUDA_MODELS") {
        Ok(d) => {
            let d = PathBuf::from(d);
            let mut found: Vec<Model> = std::fs::read_dir(&d)
                .unwrap_or_else(|e| panic!("model folder {}: {e}", d.display()))
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
                .filter_map(|p| {
                    let dr = d.join("dspark").join(p.file_name()?);
                    dr.exists().then(|| Model {
                        name: p.file_stem().unwrap().to_string_lossy().into_owned(),
                        path: p,
                        drafter: dr,
                    })
                })
                .collect();
            found.sort_by(|a, b| a.name.cmp(&b.name));
            v.extend(found);
        }
        Err(_) => eprintln!(
            "SKIPPED {test} on the synthetic model folder: BONSAI_CUDA_MODELS not set (not counted as run)"
        ),
    }
    v
}

/// The GPU drafter of model `m` (its host drafter loaded against the target's header).
fn gpu_drafter(b: &CudaBackend, m: &Model) -> CudaDrafter {
    let g = Arc::new(Gguf::open(&m.path).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let host = Drafter::load(&m.drafter, &g, &cfg).unwrap();
    CudaDrafter::new(b.gpu_arc(), host).unwrap()
}

/// Deterministic pseudo-random stream (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0f32, |m, (&x, &y)| m.max((x - y).abs()))
}

/// Random Q4_1 rows with finite scales: d in [0.0005, 0.064), m in [−0.25, 0.25).
fn rand_q41(rng: &mut Rng, n_in: usize, n_out: usize) -> Vec<u8> {
    let nb = n_in / 32 * n_out;
    let mut raw = vec![0u8; nb * 20];
    for blk in raw.chunks_exact_mut(20) {
        let r = rng.next();
        let d = f16::from_f32(0.0005 + (r & 0xff) as f32 / 4000.0).to_bits();
        let m = f16::from_f32(((r >> 8) & 0xff) as f32 / 512.0 - 0.25).to_bits();
        blk[..2].copy_from_slice(&d.to_le_bytes());
        blk[2..4].copy_from_slice(&m.to_le_bytes());
        let (a, b) = (rng.next().to_le_bytes(), rng.next().to_le_bytes());
        blk[4..12].copy_from_slice(&a);
        blk[12..20].copy_from_slice(&b);
    }
    raw
}

fn f16_at(b: &[u8], i: usize) -> f64 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f64()
}

/// Which Q4_1 kernel a case runs.
#[derive(Clone, Copy, PartialEq)]
enum Q41Kernel {
    /// `mv_q41` (`retile_q41`).
    Dp4a,
    /// `mvt_q41` (`retile_q41t`), also checked bit for bit against its host twin.
    Tc,
}

/// A Q4_1 matrix uploaded in a kernel's layout, and its segment launches.
struct Q41Dev {
    bufs: Vec<kc::DevBuf>,
    n_out: usize,
}

impl Q41Dev {
    fn new(gpu: &Gpu, kernel: Q41Kernel, raw: &[u8], n_in: usize, n_out: usize) -> Q41Dev {
        let bufs = match kernel {
            Q41Kernel::Dp4a => {
                let rt = kc::retile_q41(raw, n_in, n_out);
                vec![
                    gpu.upload(&rt.codes).unwrap(),
                    gpu.upload(&rt.scales).unwrap(),
                ]
            }
            Q41Kernel::Tc => vec![gpu.upload(&kc::retile_q41t(raw, n_in, n_out)).unwrap()],
        };
        Q41Dev { bufs, n_out }
    }

    fn seg(&self, y: u64) -> MvSeg {
        MvSeg {
            codes: self.bufs[0].ptr(),
            scales: self.bufs.get(1).map_or(0, |b| b.ptr()),
            y,
            n_out: self.n_out,
        }
    }
}

fn launch_q41(
    gpu: &Gpu,
    kernel: Q41Kernel,
    segs: &[MvSeg],
    act: (u64, u64, u64),
    n_in: usize,
    n: usize,
) {
    let (q, d, s) = act;
    match kernel {
        Q41Kernel::Dp4a => gpu.mv_q41(segs, q, d, s, n_in, n, false),
        Q41Kernel::Tc => gpu.mv_q41t(segs, q, d, s, n_in, n, false),
    }
    .unwrap();
}

/// One Q4_1 mat-vec case: `n` rows through an `n_in → n_out` matrix.
fn q41_case(gpu: &Gpu, kernel: Q41Kernel, n_in: usize, n_out: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed);
    let raw = rand_q41(&mut rng, n_in, n_out);
    let x: Vec<f32> = (0..n * n_in)
        .map(|i| rng.f() * if i % 97 == 0 { 4.0 } else { 1.0 })
        .collect(); // [n, n_in]
    let (q, d, s) = kc::host_quant(&x, n_in);
    let m = Q41Dev::new(gpu, kernel, &raw, n_in, n_out);
    let (qb, db, sb) = (
        gpu.upload(&q).unwrap(),
        gpu.upload(&d).unwrap(),
        gpu.upload(&s).unwrap(),
    );
    let act = (qb.ptr(), db.ptr(), sb.ptr());
    let y = gpu.alloc(n * n_out * 4).unwrap();
    let seg = m.seg(y.ptr());
    launch_q41(gpu, kernel, &[seg], act, n_in, n);
    let mut got = vec![0f32; n * n_out];
    gpu.dtoh(&y, 0, &mut got).unwrap();
    if kernel == Q41Kernel::Dp4a && n <= 4 {
        // the draft-block kernel and its rows-first form (`mv_q41_n4` / `mv_q41_n4f`): the same
        // bits
        let rf = gpu.mv_rows_first();
        gpu.set_mv_rows_first(!rf);
        launch_q41(gpu, kernel, &[seg], act, n_in, n);
        gpu.set_mv_rows_first(rf);
        let mut other = vec![0f32; n * n_out];
        gpu.dtoh(&y, 0, &mut other).unwrap();
        for (i, (a, b)) in got.iter().zip(&other).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "mv_q41 {n_in}→{n_out} n={n}: output {i} differs between mv_q41_n4 and mv_q41_n4f"
            );
        }
    }
    // f64 emulation of the int8 math on sampled rows, and the f32-activation CPU matmul
    let nb = n_in / 32;
    let rb = nb * 20;
    let rows: Vec<usize> = (0..n_out)
        .step_by((n_out / 512).max(1))
        .chain(n_out.saturating_sub(3)..n_out)
        .collect();
    let mut sub_raw = Vec::with_capacity(rows.len() * rb);
    for &o in &rows {
        sub_raw.extend_from_slice(&raw[o * rb..(o + 1) * rb]);
    }
    let mut cpu = vec![0f32; n * rows.len()];
    ops::matmul(&sub_raw, QuantType::Q4_1, n_in, rows.len(), &x, n, &mut cpu);
    // the tensor-core kernel's host twin on the sampled rows (a row's bits do not depend on its
    // tile), bit for bit
    let twin = (kernel == Q41Kernel::Tc).then(|| {
        let rec = kc::retile_q41t(&sub_raw, n_in, rows.len());
        kc::mv_q41t_host(&rec, n_in, rows.len(), &q, &d, &s, n)
    });
    let (mut got_s, mut worst) = (Vec::new(), 0f64);
    for t in 0..n {
        for (ri, &o) in rows.iter().enumerate() {
            let w = &raw[o * rb..(o + 1) * rb];
            let (mut r, mut mag) = (0f64, 0f64);
            for b in 0..nb {
                let blk = &w[b * 20..(b + 1) * 20];
                let (dw, mw) = (f16_at(blk, 0), f16_at(blk, 2));
                let mut isum = 0i64;
                for j in 0..16 {
                    isum += (blk[4 + j] & 0xF) as i64 * q[t * n_in + b * 32 + j] as i64;
                    isum += (blk[4 + j] >> 4) as i64 * q[t * n_in + b * 32 + 16 + j] as i64;
                }
                let da = d[t * nb + b] as f64;
                let sa = s[t * nb + b] as f64;
                r += da * (dw * isum as f64 + mw * sa);
                mag += da.abs() * ((dw * isum as f64).abs() + (mw * sa).abs());
            }
            let g = got[t * n_out + o] as f64;
            let err = (g - r).abs() / (mag + 1e-6);
            worst = worst.max(err);
            assert!(
                err <= 1e-5,
                "mv_q41 {n_in}→{n_out} n={n}: row {o} t {t}: {g} vs {r} (rel {err:e})"
            );
            if let Some(tw) = &twin {
                assert_eq!(
                    got[t * n_out + o].to_bits(),
                    tw[t * rows.len() + ri].to_bits(),
                    "mvt_q41 {n_in}→{n_out} n={n}: row {o} t {t} differs from mv_q41t_host"
                );
            }
            got_s.push(got[t * n_out + o]);
        }
    }
    let e_cpu = common::nmse(&got_s, &cpu);
    assert!(
        e_cpu <= 1e-3,
        "mv_q41 {n_in}→{n_out}: NMSE {e_cpu:e} vs the f32-activation CPU matmul"
    );
    // rows do not depend on n: the 1-row launch of each activation row, bit for bit
    if n > 1 {
        let y1 = gpu.alloc(n_out * 4).unwrap();
        let mut one = vec![0f32; n_out];
        for t in [0, n - 1] {
            let seg1 = MvSeg { y: y1.ptr(), ..seg };
            let act1 = (qb.at(t * n_in), db.at(t * nb * 4), sb.at(t * nb * 4));
            launch_q41(gpu, kernel, &[seg1], act1, n_in, 1);
            gpu.dtoh(&y1, 0, &mut one).unwrap();
            for o in 0..n_out {
                assert_eq!(
                    one[o].to_bits(),
                    got[t * n_out + o].to_bits(),
                    "mv_q41 {n_in}→{n_out}: row {o} of activation {t} depends on n"
                );
            }
        }
    }
    // three segments (row ranges of the same matrix; for the tensor-core layout each range
    // re-tiled on its own) equal the single launch bit for bit
    if n_out >= 6 {
        let cuts = [0, n_out / 3 + 1, 2 * n_out / 3 + 1, n_out];
        let ys: Vec<_> = (0..3)
            .map(|i| gpu.alloc(n * (cuts[i + 1] - cuts[i]) * 4).unwrap())
            .collect();
        let parts: Vec<Q41Dev> = (0..3)
            .filter(|_| kernel == Q41Kernel::Tc)
            .map(|i| {
                let rows = cuts[i + 1] - cuts[i];
                Q41Dev::new(
                    gpu,
                    kernel,
                    &raw[cuts[i] * rb..cuts[i + 1] * rb],
                    n_in,
                    rows,
                )
            })
            .collect();
        let segs: Vec<MvSeg> = (0..3)
            .map(|i| match kernel {
                Q41Kernel::Dp4a => MvSeg {
                    codes: m.bufs[0].at(cuts[i] * nb * 16),
                    scales: m.bufs[1].at(cuts[i] * nb * 4),
                    y: ys[i].ptr(),
                    n_out: cuts[i + 1] - cuts[i],
                },
                Q41Kernel::Tc => parts[i].seg(ys[i].ptr()),
            })
            .collect();
        launch_q41(gpu, kernel, &segs, act, n_in, n);
        for i in 0..3 {
            let m = cuts[i + 1] - cuts[i];
            let mut v = vec![0f32; n * m];
            gpu.dtoh(&ys[i], 0, &mut v).unwrap();
            for t in 0..n {
                for o in 0..m {
                    assert_eq!(
                        v[t * m + o].to_bits(),
                        got[t * n_out + cuts[i] + o].to_bits(),
                        "mv_q41 segment {i} row {o} t {t}"
                    );
                }
            }
        }
    }
    let what = match kernel {
        Q41Kernel::Dp4a => "mv_q41",
        Q41Kernel::Tc => "mvt_q41 (== host twin)",
    };
    println!(
        "{what} {n_in}→{n_out} n={n}: max rel err vs int8 emulation {worst:.2e}, NMSE vs f32 CPU {e_cpu:.2e}, \
         batch-invariant, 3-segment == single"
    );
}

const Q41_CASES: [(usize, usize, usize); 6] = [
    (96, 7, 3),
    (5120, 5120, 8),
    (25600, 5120, 8),
    (5120, 512, 4),
    (5120, 248_320, 4),
    (160, 37, 5),
];

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_q41_mv_vs_reference() {
    let Some(b) = gpu_or_skip("cuda_q41_mv_vs_reference") else {
        return;
    };
    let gpu = b.gpu();
    // the dp4a kernels (`mv_q41`, and `mv_q41_n4` for n ≤ 4)
    for (i, &(n_in, n_out, n)) in Q41_CASES.iter().enumerate() {
        q41_case(gpu, Q41Kernel::Dp4a, n_in, n_out, n, 1000 + i as u64);
    }
    // the draft-block kernel's rows-first form (`Gpu::mv_rows_first`: `mv_q41_n4f` for n ≤ 4)
    let rf = gpu.mv_rows_first();
    gpu.set_mv_rows_first(true);
    for (i, &(n_in, n_out, n)) in Q41_CASES.iter().enumerate() {
        q41_case(gpu, Q41Kernel::Dp4a, n_in, n_out, n, 1000 + i as u64);
    }
    gpu.set_mv_rows_first(rf);
    // the tensor-core kernel (sm_90+)
    if gpu.hopper() {
        for (i, &(n_in, n_out, n)) in Q41_CASES.iter().enumerate() {
            q41_case(gpu, Q41Kernel::Tc, n_in, n_out, n, 2000 + i as u64);
        }
    } else {
        println!("mvt_q41: not run (needs sm_90)");
    }
}

/// µs per launch of the drafter's Q4_1 mat-vec shapes at a draft block (n = 4), both kernels in
/// one process, each launch on another copy of the weights so that they come from DRAM (copies
/// cover ≥ 256 MB, past the 60 MiB L2): `Q41TIME` lines, and a JSON record to
/// `$BONSAI_Q41_TIMING_OUT` when set. A timing, not a check (it asserts only that both ran).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_q41_timing() {
    let Some(b) = gpu_or_skip("cuda_q41_timing") else {
        return;
    };
    let gpu = b.gpu();
    if !gpu.hopper() {
        println!("cuda_q41_timing: not run (the tensor-core kernel needs sm_90)");
        return;
    }
    let n = 4;
    // (name, n_in, segment row counts): the drafter's launches per draft
    let shapes: [(&str, usize, &[usize]); 6] = [
        ("q|k|v 5120->5120+512+512", 5120, &[5120, 512, 512]),
        ("k|v of context rows 5120->512+512", 5120, &[512, 512]),
        ("o / down 5120->5120", 5120, &[5120]),
        ("gate|up 5120->2x5120", 5120, &[5120, 5120]),
        ("fc 25600->5120", 25600, &[5120]),
        ("head 5120->248320", 5120, &[248_320]),
    ];
    let mut rng = Rng(77);
    let mut rows = Vec::new();
    for (name, n_in, outs) in shapes {
        let x: Vec<f32> = (0..n * n_in).map(|_| rng.f()).collect();
        let (q, d, s) = kc::host_quant(&x, n_in);
        let (qb, db, sb) = (
            gpu.upload(&q).unwrap(),
            gpu.upload(&d).unwrap(),
            gpu.upload(&s).unwrap(),
        );
        let act = (qb.ptr(), db.ptr(), sb.ptr());
        let mbytes: usize = outs.iter().map(|&o| o * n_in / 32 * 20).sum();
        let copies = (256usize << 20).div_ceil(mbytes).clamp(1, 16);
        let raws: Vec<Vec<u8>> = outs.iter().map(|&o| rand_q41(&mut rng, n_in, o)).collect();
        let ys: Vec<kc::DevBuf> = outs
            .iter()
            .map(|&o| gpu.alloc(n * o * 4).unwrap())
            .collect();
        let mut us = Vec::new();
        for kernel in [Q41Kernel::Dp4a, Q41Kernel::Tc] {
            let mats: Vec<Vec<Q41Dev>> = (0..copies)
                .map(|_| {
                    raws.iter()
                        .zip(outs)
                        .map(|(r, &o)| Q41Dev::new(gpu, kernel, r, n_in, o))
                        .collect()
                })
                .collect();
            let segs: Vec<Vec<MvSeg>> = mats
                .iter()
                .map(|c| c.iter().zip(&ys).map(|(m, y)| m.seg(y.ptr())).collect())
                .collect();
            let reps = (copies * 8).max(16);
            // warm-up (and the kernels' first-use costs)
            for sg in &segs {
                launch_q41(gpu, kernel, sg, act, n_in, n);
            }
            let mut best = f32::INFINITY;
            for _ in 0..3 {
                let ms = gpu
                    .time_ms(|| {
                        for i in 0..reps {
                            launch_q41(gpu, kernel, &segs[i % copies], act, n_in, n);
                        }
                        Ok(())
                    })
                    .unwrap();
                best = best.min(ms * 1000.0 / reps as f32);
            }
            us.push(best);
        }
        let gbs = |u: f32| mbytes as f64 / (u as f64 * 1e-6) / 1e9;
        println!(
            "Q41TIME {name}: {:.1} MB, dp4a {:.2} us ({:.0} GB/s), tensor-core {:.2} us ({:.0} GB/s), {:.2}x",
            mbytes as f64 / 1e6,
            us[0],
            gbs(us[0]),
            us[1],
            gbs(us[1]),
            us[0] / us[1]
        );
        assert!(us.iter().all(|u| u.is_finite() && *u > 0.0));
        rows.push(format!(
            "{{\"shape\": \"{name}\", \"n\": {n}, \"bytes\": {mbytes}, \"dp4a_us\": {:.3}, \"tc_us\": {:.3}}}",
            us[0], us[1]
        ));
    }
    if let Ok(out) = std::env::var("BONSAI_Q41_TIMING_OUT") {
        std::fs::write(&out, format!("[\n  {}\n]\n", rows.join(",\n  "))).unwrap();
    }
}

/// `n` random tap rows `[n, tw]`, uniform in [−1, 1) (no outliers: the int8 noise stays small).
fn rand_taps(rng: &mut Rng, n: usize, tw: usize) -> Vec<f32> {
    (0..n * tw).map(|_| rng.f()).collect()
}

/// Compare one draft of the GPU drafter with the host's; returns (near-tie mismatches, worst row
/// NMSE).
fn compare_draft(
    d: &CudaDrafter,
    host_st: &mut bonsai_engine::drafter::DraftState,
    gpu_st: &mut bonsai_engine::backend::cuda_drafter::CudaDraftState,
    id_last: u32,
    start: usize,
    what: &str,
) -> (usize, f64) {
    let h: &Drafter = d.host();
    let nv = d.cfg.n_vocab;
    let hl = h.draft_logits(host_st, id_last, start).unwrap();
    let hids = h.markov(&hl, id_last);
    let before = d.export(gpu_st).unwrap();
    let (gids, gl) = d.draft_with_logits(gpu_st, id_last, start).unwrap();
    let after = d.export(gpu_st).unwrap();
    assert!(
        before.0 == after.0 && before.1 == after.1,
        "{what}: a draft changed the GPU context"
    );
    let mut worst = 0f64;
    let mut maxd = Vec::new();
    for k in 0..d.cfg.block_size {
        let (a, b) = (&gl[k * nv..(k + 1) * nv], &hl[k * nv..(k + 1) * nv]);
        let e = common::nmse(a, b);
        worst = worst.max(e);
        assert!(e <= 2e-3, "{what}: logits row {k} NMSE {e:e} (> 2e-3)");
        maxd.push(max_abs_diff(a, b));
    }
    // ids: equal up to the first difference, which must be a near-tie of the host's scores
    let mut prev = id_last;
    for k in 0..d.cfg.block_size {
        if gids[k] == hids[k] {
            prev = hids[k];
            continue;
        }
        let sc = h.markov_scores(&hl[k * nv..(k + 1) * nv], prev);
        let gap = sc[hids[k] as usize] - sc[gids[k] as usize];
        let tol = 2.0 * maxd[k] + 1e-3;
        assert!(
            gids[k] != d.cfg.mask_token_id && gap <= tol,
            "{what}: draft {k}: GPU {} vs host {} with a score gap {gap} > {tol} (not a near-tie)",
            gids[k],
            hids[k]
        );
        return (1, worst);
    }
    (0, worst)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_drafter_matches_host() {
    let test = "cuda_drafter_matches_host";
    let Some(b) = gpu_or_skip(test) else {
        return;
    };
    for m in models(test) {
        let d = gpu_drafter(&b, &m);
        let h = d.host();
        let (tw, window, nv) = (d.tap_width(), d.window(), d.cfg.n_vocab);
        let mut hs = h.new_state();
        let mut gs = d.new_state().unwrap();
        let mut rng = Rng(77);
        let (mut pos, mut cases, mut ties, mut worst) = (0usize, 0usize, 0usize, 0f64);
        // uneven batches (prefill chunks, verify accepts, single steps) until past a full window
        let batches = [
            1usize, 5, 8, 13, 3, 1, 200, 1, 2, 4, 5, 1000, 3, 3000, 2, 1, 5,
        ];
        for (bi, &nb) in batches.iter().enumerate() {
            let taps = rand_taps(&mut rng, nb, tw);
            h.stage(&mut hs, &taps, pos, nb).unwrap();
            d.stage(&mut gs, &taps, pos, nb).unwrap();
            pos += nb;
            assert_eq!(gs.len(), hs.len(), "{}: window length", m.name);
            assert_eq!(gs.next_pos(), hs.next_pos());
            let (hp, hv) = hs.export();
            let (gp, gv) = d.export(&gs).unwrap();
            assert_eq!(hp, gp, "{}: first live position", m.name);
            let e = common::nmse(&gv, &hv);
            assert!(
                e <= 5e-4,
                "{}: context K/V NMSE {e:e} after batch {bi}",
                m.name
            );
            for c in 0..3 {
                let id_last = (rng.next() % (nv as u64 - 1)) as u32;
                let what = format!("{} batch {bi} case {c} (id {id_last}, pos {pos})", m.name);
                let (t, w) = compare_draft(&d, &mut hs, &mut gs, id_last, pos, &what);
                ties += t;
                worst = worst.max(w);
                cases += 1;
            }
        }
        assert!(gs.len() == window, "{}: the window did not fill", m.name);
        println!(
            "{}: GPU drafter == host drafter over {cases} drafts up to a full window ({window} rows): \
             logits NMSE ≤ {worst:.2e}, {ties} near-tie id differences",
            m.name
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_drafter_graph_equals_eager() {
    let test = "cuda_drafter_graph_equals_eager";
    let Some(b) = gpu_or_skip(test) else {
        return;
    };
    for m in models(test) {
        let d = gpu_drafter(&b, &m);
        let (tw, window, nv) = (d.tap_width(), d.window(), d.cfg.n_vocab);
        // the same context in two states: one drafts eagerly, the other replays its graph
        let mut se = d.new_state().unwrap();
        let mut sg = d.new_state().unwrap();
        let mut rng = Rng(91);
        let (mut pos, mut cases) = (0usize, 0usize);
        // short contexts, one chunk boundary, a full window, then past it (the ring wraps)
        let batches = [1usize, 4, 2, 300, 5, window, 1, 3, 7];
        for (bi, &nb) in batches.iter().enumerate() {
            let taps = rand_taps(&mut rng, nb, tw);
            // eager stage passes into one state, the captured stage (up to 8 rows) into the other
            d.set_graph(false);
            d.stage(&mut se, &taps, pos, nb).unwrap();
            d.set_graph(true);
            d.stage(&mut sg, &taps, pos, nb).unwrap();
            pos += nb;
            for c in 0..2 {
                let id_last = (rng.next() % (nv as u64 - 1)) as u32;
                let what = format!("{} batch {bi} case {c} (id {id_last}, pos {pos})", m.name);
                d.set_graph(false);
                let (ie, le) = d.draft_with_logits(&mut se, id_last, pos).unwrap();
                d.set_graph(true);
                let (ig, lg) = d.draft_with_logits(&mut sg, id_last, pos).unwrap();
                assert!(sg.graph_captured(), "{what}: the draft graph was not used");
                assert!(
                    !se.graph_captured(),
                    "{what}: the eager state captured a graph"
                );
                assert_eq!(ie, ig, "{what}: drafted ids, eager vs graph");
                let diff = le
                    .iter()
                    .zip(&lg)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(diff, 0, "{what}: {diff} logits differ, eager vs graph");
                // the Markov steps in one vocabulary order and in alternating orders: the same
                // drafts and the same scores of the last (reversed) step, bit for bit
                let alt0 = d.markov_alt();
                let mut by_alt = Vec::new();
                for alt in [false, true] {
                    d.set_markov_alt(alt);
                    d.set_graph(false);
                    let ids = d.draft(&mut se, id_last, pos).unwrap();
                    by_alt.push((ids, d.last_markov_scores(&se).unwrap()));
                }
                d.set_markov_alt(alt0);
                assert_eq!(by_alt[0].0, by_alt[1].0, "{what}: drafts by Markov order");
                let diff = by_alt[0]
                    .1
                    .iter()
                    .zip(&by_alt[1].1)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    diff, 0,
                    "{what}: {diff} Markov scores differ by vocabulary order"
                );
                cases += 1;
            }
        }
        assert_eq!(sg.len(), window, "{}: the window did not fill", m.name);
        assert!(
            sg.stage_graphs_captured() > 0 && se.stage_graphs_captured() == 0,
            "{}: the captured stage was not used (or the eager state captured one)",
            m.name
        );
        println!(
            "{}: draft graph after captured stages == eager draft after eager stages over {cases} \
             drafts (ids and head logits bit for bit; window {window} rows, wrapped); Markov steps \
             in alternating vocabulary order == one order (ids and last scores bit for bit)",
            m.name
        );
    }
}

/// Staging from tap rows on the device (`CudaDrafter::stage_dev`, what the engine does with the
/// verify's taps) equals staging the same rows from the host, eager and captured, through a
/// wrapped window: the exported context K/V and the drafts (ids and head logits) bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_drafter_stage_dev_equals_host() {
    let test = "cuda_drafter_stage_dev_equals_host";
    let Some(b) = gpu_or_skip(test) else {
        return;
    };
    let gpu = b.gpu();
    for m in models(test) {
        let d = gpu_drafter(&b, &m);
        let (tw, window, nv) = (d.tap_width(), d.window(), d.cfg.n_vocab);
        let (graph0, sg0) = (d.graph(), d.stage_graph());
        let mut sh = d.new_state().unwrap();
        let mut sd = d.new_state().unwrap();
        let mut rng = Rng(37);
        let mut pos = 0usize;
        // a long context staged from the host into both, then short stages of up to 8 rows
        // (a round's kept rows) past the window's end
        let long = window.saturating_sub(6);
        let taps = rand_taps(&mut rng, long, tw);
        d.stage(&mut sh, &taps, 0, long).unwrap();
        d.stage(&mut sd, &taps, 0, long).unwrap();
        pos += long;
        let mut cases = 0;
        for (i, nb) in [1usize, 5, 3, 8, 2, 4, 1, 5].into_iter().enumerate() {
            let graph = i % 4 < 2; // eager and captured stages, both paths alike
            d.set_graph(graph);
            d.set_stage_graph(true);
            let taps = rand_taps(&mut rng, nb, tw);
            let dev = gpu.upload(&taps).unwrap();
            d.stage(&mut sh, &taps, pos, nb).unwrap();
            d.stage_dev(&mut sd, dev.ptr(), pos, nb).unwrap();
            pos += nb;
            let what = format!("{} stage {i} ({nb} rows, graph {graph}, pos {pos})", m.name);
            let (eh, ed) = (d.export(&sh).unwrap(), d.export(&sd).unwrap());
            assert_eq!(eh.0, ed.0, "{what}: first position");
            let diff =
                eh.1.iter()
                    .zip(&ed.1)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
            assert!(
                eh.1.len() == ed.1.len() && diff == 0,
                "{what}: {diff} context values differ"
            );
            let id = (rng.next() % (nv as u64 - 1)) as u32;
            let (ih, lh) = d.draft_with_logits(&mut sh, id, pos).unwrap();
            let (id_, ld) = d.draft_with_logits(&mut sd, id, pos).unwrap();
            assert_eq!(ih, id_, "{what}: drafts");
            assert!(
                lh.iter().zip(&ld).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: logits"
            );
            cases += 1;
        }
        assert!(
            sd.len() == window && sd.stage_graphs_captured() > 0,
            "{}: window or graph",
            m.name
        );
        d.set_graph(graph0);
        d.set_stage_graph(sg0);
        println!(
            "{}: staging from device taps == from host taps over {cases} stages (context K/V, \
             drafts and head logits bit for bit; eager and captured; window {window} rows, wrapped)",
            m.name
        );
    }
}

/// GPU-drafter DSpark rounds the way the engine runs them: the verify's taps left on the device
/// (`CudaBackend::set_verify_taps_on_host(false)`) and the kept rows staged from there
/// (`CudaDrafter::stage_dev`). After every round the drafter's context equals one staged row by
/// row from plain decoding's host taps, bit for bit, and the round's last token is plain greedy's.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_gpu_drafter_rounds_stage_device_taps() {
    use bonsai_engine::model::{forward, Capture, LogitRows, SeqState, TapRequest, Weights};
    use bonsai_engine::sampling::Sampler;
    use bonsai_engine::spec::{verify_round, RoundBufs};
    let test = "cuda_gpu_drafter_rounds_stage_device_taps";
    let Some(b) = gpu_or_skip(test) else {
        return;
    };
    for m in models(test) {
        let g = Arc::new(Gguf::open(&m.path).unwrap());
        let cfg = TargetConfig::from_gguf(&g).unwrap();
        let w = Weights::load(&b, &g, &cfg).unwrap();
        let d = gpu_drafter(&b, &m);
        let layers = d.cfg.target_layers.clone();
        let nv = cfg.n_vocab as u32;
        let pr: Vec<u32> = (0..21u32)
            .map(|i| i.wrapping_mul(2654435761) % (nv - 8).min(1400))
            .collect();
        // the speculative side and the reference, both prefilled with taps and staged at once
        let mut lg = Vec::new();
        let mut st = SeqState::new(&b, &cfg, 512).unwrap();
        let mut ds = d.new_state().unwrap();
        let taps = common::prefill_with_taps(&b, &cfg, &w, &mut st, &pr, &layers, &mut lg);
        d.stage(&mut ds, &taps, 0, pr.len()).unwrap();
        let mut rst = SeqState::new(&b, &cfg, 512).unwrap();
        let mut rds = d.new_state().unwrap();
        let mut rlg = Vec::new();
        let rtaps = common::prefill_with_taps(&b, &cfg, &w, &mut rst, &pr, &layers, &mut rlg);
        d.stage(&mut rds, &rtaps, 0, pr.len()).unwrap();
        let mut s = Sampler::new(SamplerParams::greedy());
        let first = s.sample(&lg);
        s.accept(first.id);
        let mut got = vec![first.id];
        let mut bufs = RoundBufs::new(&b, &cfg, 5).unwrap();
        b.set_verify_taps_on_host(false);
        let (mut rounds, mut dev_rounds) = (0, 0);
        while got.len() < 40 {
            let (start, id_last) = (st.pos, *got.last().unwrap());
            let draft = d.draft(&mut ds, id_last, start).unwrap();
            let out = verify_round(
                &b,
                &cfg,
                &w,
                &mut st,
                &mut bufs,
                &mut s,
                id_last,
                &draft,
                Some(&layers),
                Rollback::Replay,
            )
            .unwrap();
            let keep = out.n_acc + 1;
            dev_rounds += bufs.taps.is_empty() as usize;
            d.stage_verified(&mut ds, Some(&b), &bufs.taps, start, keep)
                .unwrap();
            got.extend(out.tokens.iter().map(|x| x.id));
            // the reference: the same tokens one plain forward at a time, each row's host taps
            // staged alone
            for &id in &got[got.len() - keep - 1..got.len() - 1] {
                let (mut t1, pos) = (Vec::new(), rst.pos);
                forward(
                    &b,
                    &cfg,
                    &w,
                    &mut rst,
                    &[id],
                    GdnMode::Recurrent,
                    LogitRows::Last,
                    &mut rlg,
                    Capture {
                        taps: Some(TapRequest {
                            layers: &layers,
                            rows: 0..1,
                            out: &mut t1,
                        }),
                        gdn_rec: None,
                    },
                )
                .unwrap();
                d.stage(&mut rds, &t1, pos, 1).unwrap();
            }
            let what = format!("{} round {rounds} (keep {keep})", m.name);
            let greedy = Sampler::new(SamplerParams::greedy()).sample(&rlg).id;
            assert_eq!(
                Some(greedy),
                got.last().copied(),
                "{what}: plain greedy token"
            );
            let (a, r) = (d.export(&ds).unwrap(), d.export(&rds).unwrap());
            let diff =
                a.1.iter()
                    .zip(&r.1)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count();
            assert!(
                a.0 == r.0 && a.1.len() == r.1.len() && diff == 0,
                "{what}: drafter context differs ({diff} values)"
            );
            rounds += 1;
        }
        b.set_verify_taps_on_host(true);
        assert!(
            dev_rounds > 0,
            "{}: no round staged from device taps",
            m.name
        );
        println!(
            "{}: {rounds} GPU-drafter rounds ({dev_rounds} staged from the verify's device taps): \
             drafter context == row-by-row staging of plain decoding's taps, bit for bit; tokens \
             == plain greedy",
            m.name
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_engine_gpu_drafter_equals_plain() {
    let test = "cuda_engine_gpu_drafter_equals_plain";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let greedy = SamplerParams::greedy();
    for m in models(test) {
        let load = |draft: Option<DraftSource>| {
            let opts = EngineOptions {
                n_ctx: Some(512),
                threads: Some(4),
                device: "cuda".into(),
                draft,
                speculative: PolicyMode::Always,
                rollback: Rollback::Replay,
                ..Default::default()
            };
            Engine::load(&m.path, &opts).unwrap()
        };
        let nv = {
            let g = Gguf::open(&m.path).unwrap();
            TargetConfig::from_gguf(&g).unwrap().n_vocab as u32
        };
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|s| {
                (0..(5 + 11 * s))
                    .map(|i| (i * 2654435761u32).wrapping_add(s * 131) % (nv - 8).min(1400))
                    .collect()
            })
            .collect();
        let plain = load(None);
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| common::complete(&plain, p, 48, &greedy).0)
            .collect();
        drop(plain);
        let e = load(Some(DraftSource::Dspark(m.drafter.clone())));
        let (mut rounds, mut drafted, mut accepted, mut dsec) = (0, 0, 0, 0f64);
        for (p, w) in prompts.iter().zip(&want) {
            let (got, u) = common::complete(&e, p, 48, &greedy);
            assert_eq!(
                &got, w,
                "{}: GPU-drafter speculative greedy differs from plain",
                m.name
            );
            rounds += u.spec.rounds;
            drafted += u.spec.drafted;
            accepted += u.spec.accepted;
            dsec += u.spec.draft_seconds;
        }
        assert!(rounds > 0, "{}: no round ran", m.name);
        println!(
            "{}: cuda + GPU drafter == plain greedy ({} prompts × 48); {rounds} rounds, \
             {accepted}/{drafted} accepted, {:.3} ms per draft",
            m.name,
            prompts.len(),
            1e3 * dsec / rounds as f64
        );
    }
}

/// The GPU and the GPU drafter of `$BONSAI_DRAFT_CTX_MODEL` / `$BONSAI_DRAFT_CTX_DRAFTER` (the
/// draft benchmarks; scripts/gpu_check.sh passes the 27B files), its draft graph on; `None` (and a
/// SKIPPED line) without a GPU or the variables.
fn bench_drafter(test: &str) -> Option<(CudaBackend, CudaDrafter)> {
    let b = gpu_or_skip(test)?;
    let (Ok(target), Ok(drafter)) = (
        std::env::var("BONSAI_DRAFT_CTX_MODEL"),
        std::env::var("BONSAI_DRAFT_CTX_DRAFTER"),
    ) else {
        eprintln!(
            "SKIPPED {test}: BONSAI_DRAFT_CTX_MODEL / BONSAI_DRAFT_CTX_DRAFTER not set (not counted as run)"
        );
        return None;
    };
    let m = Model {
        name: "bench".into(),
        path: target.into(),
        drafter: drafter.into(),
    };
    let d = gpu_drafter(&b, &m);
    d.set_graph(true);
    Some((b, d))
}

/// The median wall time of 15 drafts after 3 warm-up ones (ms), each asserted to give ids.
fn median_draft_ms(d: &CudaDrafter, st: &mut CudaDraftState, id: u32, pos: usize) -> f64 {
    for _ in 0..3 {
        assert!(!d.draft(st, id, pos).unwrap().is_empty());
    }
    let mut t = Vec::new();
    for _ in 0..15 {
        let t0 = std::time::Instant::now();
        assert!(!d.draft(st, id, pos).unwrap().is_empty());
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Stage random taps into `st` from row `*pos` up to `ctx` rows, 512 a call.
fn stage_random_taps(
    d: &CudaDrafter,
    st: &mut CudaDraftState,
    pos: &mut usize,
    ctx: usize,
    rng: &mut Rng,
) {
    let tw = d.tap_width();
    while *pos < ctx {
        let nb = (ctx - *pos).min(512);
        let taps: Vec<f32> = (0..nb * tw).map(|_| rng.f()).collect();
        d.stage(st, &taps, *pos, nb).unwrap();
        *pos += nb;
    }
}

/// The graph draft's time by context length, the fused launches (`CudaDrafter::set_fused`) with
/// either block attention kernel (`set_attn_per_kv_head`) against the unfused ones, alternating in
/// one process: a benchmark, not a timed test (it asserts only
/// that both give drafts). Runs on `$BONSAI_DRAFT_CTX_MODEL` with `$BONSAI_DRAFT_CTX_DRAFTER`
/// (scripts/gpu_check.sh: the 27B files) and writes JSON to `$BONSAI_DRAFT_CTX_OUT` when set.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_draft_by_context() {
    let Some((b, d)) = bench_drafter("cuda_draft_by_context") else {
        return;
    };
    let (window, nv) = (d.window(), d.cfg.n_vocab);
    // the load-time forms, put back at the end
    let (fused0, kv0) = (d.fused(), d.attn_per_kv_head());
    let mut st = d.new_state().unwrap();
    let mut rng = Rng(5);
    let mut pos = 0usize;
    let mut rows = Vec::new();
    for ctx in [64usize, 256, 512, 1024, 2048, 4000] {
        let ctx = ctx.min(window);
        stage_random_taps(&d, &mut st, &mut pos, ctx, &mut rng);
        // [unfused, fused with a block per q head, fused with a block per kv head]
        let mut ms = [Vec::new(), Vec::new(), Vec::new()];
        for _rep in 0..3 {
            for (side, (fused, kv)) in [(false, false), (true, false), (true, true)]
                .into_iter()
                .enumerate()
            {
                d.set_fused(fused);
                d.set_attn_per_kv_head(kv);
                let id = (rng.next() % (nv as u64 - 1)) as u32;
                ms[side].push(median_draft_ms(&d, &mut st, id, pos));
            }
        }
        // one eager draft per attention kernel with every launch timed alone: where the
        // context's cost sits
        d.set_graph(false);
        let mut attn_us = [0f32; 2];
        for (side, kv) in [false, true].into_iter().enumerate() {
            d.set_attn_per_kv_head(kv);
            b.gpu().profile_begin();
            d.draft(&mut st, 7, pos).unwrap();
            let prof = b.gpu().profile_end();
            let mut attn = std::collections::BTreeMap::<String, f32>::new();
            for (k, us) in &prof {
                if k.starts_with("dsp_attn") {
                    *attn.entry(k.clone()).or_default() += us;
                }
            }
            attn_us[side] = attn.values().sum();
            let total: f32 = prof.iter().map(|(_, us)| us).sum();
            println!(
                "DRAFTPROF context {ctx} ({}): {total:.1} us of kernels alone, attention {attn:?}",
                if kv { "per kv head" } else { "per q head" }
            );
        }
        d.set_graph(true);
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (u, f, k) = (
            med(&mut ms[0].clone()),
            med(&mut ms[1].clone()),
            med(&mut ms[2].clone()),
        );
        println!(
            "DRAFTCTX context {ctx}: unfused {u:.3} ms, fused per q head {f:.3} ms, fused per kv head {k:.3} ms per graph draft ({:.3}x / {:.3}x); runs {:?} / {:?} / {:?}",
            u / k,
            f / k,
            ms[0],
            ms[1],
            ms[2]
        );
        rows.push(format!(
            "{{\"context\": {ctx}, \"unfused_ms\": {u:.4}, \"fused_ms\": {f:.4}, \"fused_kv_ms\": {k:.4}, \"attn_alone_us\": {{\"per_q_head\": {:.1}, \"per_kv_head\": {:.1}}}, \"unfused_runs\": {:?}, \"fused_runs\": {:?}, \"fused_kv_runs\": {:?}}}",
            attn_us[0], attn_us[1], ms[0], ms[1], ms[2]
        ));
    }
    d.set_fused(fused0);
    d.set_attn_per_kv_head(kv0);
    if let Ok(out) = std::env::var("BONSAI_DRAFT_CTX_OUT") {
        let json = format!(
            "{{\"what\": \"graph draft ms by context length: unfused draft launches, fused with the block attention per q head, fused per kv head (CudaDrafter::set_fused / set_attn_per_kv_head), alternating in one process, 3 x median of 15; attn_alone_us: the dsp_attn launches of one eager draft timed alone\", \"device\": \"{}\", \"rows\": [{}]}}\n",
            b.name(),
            rows.join(", ")
        );
        std::fs::write(&out, json).unwrap();
    }
}

/// Graph drafts with a switch off and on (`set`), alternating in one process at contexts of 64
/// and 1,024 rows (4 × median of 15 drafts each), and one eager draft of each side with the
/// launches whose kernel name starts with `prefix` timed alone: the rows of an A/B benchmark's
/// JSON, the sides named by `names`, each line printed with `label`. Asserts only that both
/// sides give drafts; puts the switch back to `on0`.
fn draft_switch_ab(
    b: &CudaBackend,
    d: &CudaDrafter,
    label: &str,
    names: [&str; 2],
    prefix: &str,
    set: &dyn Fn(bool),
    on0: bool,
) -> Vec<String> {
    let gpu = b.gpu();
    let (window, nv) = (d.window(), d.cfg.n_vocab);
    let mut st = d.new_state().unwrap();
    let mut rng = Rng(11);
    let mut pos = 0usize;
    let mut rows = Vec::new();
    let [n0, n1] = names;
    for ctx in [64usize, 1024] {
        let ctx = ctx.min(window);
        stage_random_taps(d, &mut st, &mut pos, ctx, &mut rng);
        // [off, on]
        let mut ms = [Vec::new(), Vec::new()];
        for _rep in 0..4 {
            for (side, on) in [false, true].into_iter().enumerate() {
                set(on);
                let id = (rng.next() % (nv as u64 - 1)) as u32;
                ms[side].push(median_draft_ms(d, &mut st, id, pos));
            }
        }
        // one eager draft of each side, its `prefix` launches timed alone
        d.set_graph(false);
        let mut alone_us = [0f32; 2];
        for (side, on) in [false, true].into_iter().enumerate() {
            set(on);
            gpu.profile_begin();
            d.draft(&mut st, 7, pos).unwrap();
            alone_us[side] = gpu
                .profile_end()
                .iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(_, us)| us)
                .sum();
        }
        d.set_graph(true);
        let med = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (p, f) = (med(&ms[0]), med(&ms[1]));
        println!(
            "{label} context {ctx}: {n0} {p:.3} ms, {n1} {f:.3} ms per graph draft ({:.3}x); \
             {prefix} launches alone {:.1} / {:.1} us; runs {:?} / {:?}",
            p / f,
            alone_us[0],
            alone_us[1],
            ms[0],
            ms[1]
        );
        rows.push(format!(
            "{{\"context\": {ctx}, \"{n0}_ms\": {p:.4}, \"{n1}_ms\": {f:.4}, \"{prefix}_alone_us\": \
             {{\"{n0}\": {:.1}, \"{n1}\": {:.1}}}, \"{n0}_runs\": {:?}, \"{n1}_runs\": {:?}}}",
            alone_us[0], alone_us[1], ms[0], ms[1]
        ));
    }
    set(on0);
    rows
}

/// Write an A/B benchmark's JSON (`what`, the device, `rows`) to the file named by `$var`, if set.
fn write_ab_json(var: &str, what: &str, b: &CudaBackend, rows: &[String]) {
    if let Ok(out) = std::env::var(var) {
        let json = format!(
            "{{\"what\": \"{what}\", \"device\": \"{}\", \"rows\": [{}]}}\n",
            b.name(),
            rows.join(", ")
        );
        std::fs::write(&out, json).unwrap();
    }
}

/// The graph draft with the block mat-vecs rows-first (`Gpu::mv_rows_first`: `mv_q41_n4f`, the
/// default) against the plain `mv_q41_n4` ([`draft_switch_ab`]): a benchmark, not a timed test.
/// `$BONSAI_DRAFT_CTX_MODEL` / `_DRAFTER` as [`cuda_draft_by_context`]; JSON to
/// `$BONSAI_DRAFT_RF_OUT` when set.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_draft_rows_first_ab() {
    let Some((b, d)) = bench_drafter("cuda_draft_rows_first_ab") else {
        return;
    };
    let gpu = b.gpu();
    let rows = draft_switch_ab(
        &b,
        &d,
        "DRAFTRF",
        ["plain", "rows_first"],
        "mv_q41",
        &|on| gpu.set_mv_rows_first(on),
        gpu.mv_rows_first(),
    );
    write_ab_json(
        "BONSAI_DRAFT_RF_OUT",
        "graph draft ms with the Q4_1 block mat-vecs plain (mv_q41_n4) and rows-first (mv_q41_n4f, \
         Gpu::set_mv_rows_first), alternating in one process, 4 x median of 15; mv_q41_alone_us: \
         the mv_q41 launches of one eager draft timed alone",
        &b,
        &rows,
    );
}

/// The graph draft with the Markov steps in alternating vocabulary orders
/// (`CudaDrafter::set_markov_alt`, the default) against one order ([`draft_switch_ab`]): a
/// benchmark, not a timed test. `$BONSAI_DRAFT_CTX_MODEL` / `_DRAFTER` as
/// [`cuda_draft_by_context`]; JSON to `$BONSAI_DRAFT_MARKOV_OUT` when set.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_draft_markov_alt_ab() {
    let Some((b, d)) = bench_drafter("cuda_draft_markov_alt_ab") else {
        return;
    };
    let rows = draft_switch_ab(
        &b,
        &d,
        "DRAFTMARKOV",
        ["one_order", "alternating"],
        "dsp_markov",
        &|on| d.set_markov_alt(on),
        d.markov_alt(),
    );
    write_ab_json(
        "BONSAI_DRAFT_MARKOV_OUT",
        "graph draft ms with the Markov steps in one vocabulary order and in alternating orders \
         (CudaDrafter::set_markov_alt), alternating in one process, 4 x median of 15; \
         dsp_markov_alone_us: the dsp_markov_scores launches of one eager draft timed alone",
        &b,
        &rows,
    );
}
