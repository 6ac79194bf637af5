//! GPU mat-vec launch-plan sweep (n = 1, decode): every plan (rows per warp, K split, weights
//! loaded before or after the PDL wait) of the dp4a kernels and of the tensor-core kernels
//! (`mvm_*`, plans with `mma`: m16 tiles per warp, K split; off by default, unvalidated until this
//! runs) on every matrix category of a real-shape model, each category's launches back to back
//! over all layers (more bytes than the L2 holds), median of 5 passes. Then, per category, the
//! default dp4a plan against the default tensor-core plan at n = 1 (decode) and n = 5 (a
//! speculative verify of 5 rows): `SWEEP mma` lines and `mma_vs_dp4a` in the JSON. Runs only when
//! Q1 models also time the binary tensor-core kernels (`mvb_q1_*`, plans with `b1`: every r and K
//! split, weights before the PDL wait; the time includes the `b1_planes` launch) at n = 1 and n = 5
//! against the default dp4a plan: `SWEEP b1` lines and `b1_vs_dp4a` in the JSON. Runs only when
//! Then the best pipelined one-row plan (`mvp_*`, plans with `pipe`) with the default K split
//! against the plain dp4a default: `SWEEP pipe` lines and `pipe_vs_dp4a`. Runs only when
//! `$BONSAI_BENCH_MODEL` names a GGUF and a CUDA device exists; otherwise prints SKIPPED. Writes
//! JSON to `$BONSAI_SWEEP_OUT` when set. Driven by scripts/gpu_check.sh --sweep; the chosen
//! defaults live in `mv_default_ks` / `mv_default_r` / `mvm_default_plan` (kernels-cuda/src/lib.rs).

mod common;

use std::sync::Arc;

use bonsai_engine::backend::cuda::CudaBackend;
use bonsai_engine::backend::Backend;
use bonsai_engine::config::TargetConfig;
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::Weights;
use bonsai_kernels_cuda::{mv_default_plan, MvPlan, WKind};

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_mv_plan_sweep() {
    let Ok(path) = std::env::var("BONSAI_BENCH_MODEL") else {
        eprintln!("SKIPPED cuda_mv_plan_sweep: BONSAI_BENCH_MODEL not set (not counted as run)");
        return;
    };
    if !CudaBackend::available() {
        eprintln!("SKIPPED cuda_mv_plan_sweep: no CUDA device (not counted as run)");
        return;
    }
    let cuda = CudaBackend::new(0).unwrap();
    let g = Arc::new(Gguf::open(std::path::Path::new(&path)).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let w = Weights::load(&cuda, &g, &cfg).unwrap();

    let cats = common::mat_categories(&w, false);
    let med = |mut v: Vec<f32>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2] as f64
    };
    let mut plans = Vec::new();
    // dp4a, tensor-core with the cp.async ring, tensor-core with direct register loads (n = 1 on
    // the tensor cores), and the dp4a one-row kernel in the tensor-core float order (mvx, `r` =
    // rows per lane)
    for (mma, direct, x, rs) in [
        (false, false, false, &[2, 4, 8][..]),
        (true, false, false, &[1, 2]),
        (true, true, false, &[1, 2]),
        (true, false, true, &[1, 2]),
    ] {
        for &r in rs {
            for ks in [1, 2, 4] {
                for pre in [true, false] {
                    plans.push(MvPlan {
                        mma,
                        direct,
                        n1_rl: if x { r } else { 0 },
                        ..MvPlan::dp4a(if x { 1 } else { r }, ks, pre)
                    });
                }
            }
        }
    }
    // the pipelined persistent one-row kernels (mvp, `r` = rows per group)
    for r in [2, 4] {
        for ks in [1, 2, 4] {
            for pre in [true, false] {
                plans.push(MvPlan {
                    pipe: true,
                    ..MvPlan::dp4a(r, ks, pre)
                });
            }
        }
    }
    let tag = |p: &MvPlan| {
        format!(
            "{}r{}k{}{}",
            match (p.mma, p.direct, p.n1_rl) {
                (false, _, _) if p.pipe => "mvp-",
                (false, _, _) => "",
                (true, _, 1..) => "mvx-",
                (true, false, 0) => "mma-",
                (true, true, 0) => "mvd-",
            },
            if p.n1_rl > 0 { p.n1_rl } else { p.r },
            p.ks,
            if p.pre { "p" } else { "" }
        )
    };
    let gpu = cuda.gpu();
    let mut rows_json = Vec::new();
    let mut best_json = Vec::new();
    let mut mma_json = Vec::new();
    let mut b1_json = Vec::new();
    let mut pipe_json = Vec::new();
    let mut o8_json = Vec::new();
    println!("SWEEP pdl={}", gpu.pdl());
    for (name, groups) in &cats {
        let bytes: usize = groups
            .iter()
            .flatten()
            .map(|m| CudaBackend::mat_bytes(m))
            .sum();
        let rows: usize = groups[0].iter().map(|m| m.n_out).sum();
        let n_in = groups[0][0].n_in;
        let kind = groups[0][0].kind;
        gpu.set_mv_override(None);
        let default = gpu.mv_plan(kind, 1, rows, n_in);
        let dms = med(cuda.time_mv_pass(&cfg, groups, 5).unwrap());
        let mut best = (default, dms);
        let mut best_mvd: Option<(MvPlan, f64)> = None;
        let mut best_mvx: Option<(MvPlan, f64)> = None;
        let mut best_mvp: Option<(MvPlan, f64)> = None;
        let mut plain_same_ks = None; // the plain dp4a default plan's time (r, ks of the default)
        let plain_default = mv_default_plan(kind, 1, rows, n_in, false);
        let mut line = format!(
            "SWEEP {name:<18} rows {rows:>6} n_in {n_in:>5} default {} {:7.2} us",
            tag(&default),
            dms * 1e3 / groups.len() as f64
        );
        for p in &plans {
            gpu.set_mv_override(Some(*p));
            let ms = med(cuda.time_mv_pass(&cfg, groups, 5).unwrap());
            let us = ms * 1e3 / groups.len() as f64;
            let gbps = bytes as f64 / (ms / 1e3) / 1e9;
            line += &format!(" | {} {us:.2}", tag(p));
            rows_json.push(format!(
                "{{\"category\": \"{name}\", \"rows\": {rows}, \"n_in\": {n_in}, \"r\": {}, \"ks\": {}, \"pre\": {}, \"mma\": {}, \"direct\": {}, \"n1_rl\": {}, \"pipe\": {}, \"us_per_launch\": {us:.2}, \"GBps\": {gbps:.1}}}",
                p.r, p.ks, p.pre, p.mma, p.direct, p.n1_rl, p.pipe
            ));
            if ms < best.1 {
                best = (*p, ms);
            }
            if p.direct && best_mvd.is_none_or(|b| ms < b.1) {
                best_mvd = Some((*p, ms));
            }
            if p.n1_rl > 0 && best_mvx.is_none_or(|b| ms < b.1) {
                best_mvx = Some((*p, ms));
            }
            // pipelined plans must keep the default K split (it fixes the float order)
            if p.pipe && p.ks == plain_default.ks && best_mvp.is_none_or(|b| ms < b.1) {
                best_mvp = Some((*p, ms));
            }
            if *p == plain_default {
                plain_same_ks = Some(ms);
            }
        }
        // default dp4a plan vs the default tensor-core plan (n = 1 on mvx, n = 5 on the ring) vs
        // the best direct plan (at n = 1), for decode (n = 1) and verify (n = 5) rows
        let mvd = best_mvd.expect("direct plans swept").0;
        let ring = mv_default_plan(kind, 1, rows, n_in, true);
        let cmp = [mv_default_plan(kind, 1, rows, n_in, false), ring, mvd];
        let mut t = [[0f64; 3]; 2]; // [n1, n5][dp4a, tensor-core default, direct] µs per launch
        for (k, p) in cmp.iter().enumerate() {
            gpu.set_mv_override(Some(*p));
            for (i, n) in [1, 5].into_iter().enumerate() {
                let ms = med(cuda.time_mv_pass_n(&cfg, groups, n, 5).unwrap());
                t[i][k] = ms * 1e3 / groups.len() as f64;
            }
        }
        // Q1: the binary tensor-core kernels (planes + mvb launch) at n = 1 and n = 5, best plan
        // of each n against the default dp4a plan (t[..][0])
        if kind == WKind::Q1 {
            let mut b1_best: [Option<(MvPlan, f64)>; 2] = [None, None];
            let mut b1_line = String::new();
            for r in [1, 2] {
                for ks in [1, 2, 4] {
                    let p = MvPlan {
                        b1: true,
                        ..MvPlan::dp4a(r, ks, true)
                    };
                    gpu.set_mv_override(Some(p));
                    for (i, n) in [1, 5].into_iter().enumerate() {
                        let ms = med(cuda.time_mv_pass_n(&cfg, groups, n, 5).unwrap());
                        let us = ms * 1e3 / groups.len() as f64;
                        b1_line += &format!(" n{n}:b1-r{r}k{ks} {us:.2}");
                        if b1_best[i].is_none_or(|b| us < b.1) {
                            b1_best[i] = Some((p, us));
                        }
                    }
                }
            }
            let (b1n1, b1n5) = (b1_best[0].unwrap(), b1_best[1].unwrap());
            println!(
                "SWEEP b1 {name:<18} n=1 dp4a {:7.2}  b1 r{}k{} {:7.2} ({:.2}x dp4a) | n=5 dp4a {:7.2}  b1 r{}k{} {:7.2} ({:.2}x dp4a) |{b1_line}",
                t[0][0],
                b1n1.0.r,
                b1n1.0.ks,
                b1n1.1,
                t[0][0] / b1n1.1,
                t[1][0],
                b1n5.0.r,
                b1n5.0.ks,
                b1n5.1,
                t[1][0] / b1n5.1
            );
            b1_json.push(format!(
                "{{\"category\": \"{name}\", \"n1_dp4a_us\": {:.2}, \"n1_b1_plan\": \"r{}k{}\", \"n1_b1_us\": {:.2}, \"n5_dp4a_us\": {:.2}, \"n5_b1_plan\": \"r{}k{}\", \"n5_b1_us\": {:.2}}}",
                t[0][0],
                b1n1.0.r,
                b1n1.0.ks,
                b1n1.1,
                t[1][0],
                b1n5.0.r,
                b1n5.0.ks,
                b1n5.1
            ));
        }
        // the o8 family at the default K split: decode rows on mvo (dp4a), verify rows on mvt
        // (tensor cores), against the default dp4a plan (t[..][0])
        {
            let mut o8_line = String::new();
            let mut best: [Option<(usize, f64)>; 2] = [None, None];
            for r in [1, 2, 4] {
                let p = MvPlan {
                    r,
                    o8: true,
                    pipe: false,
                    ..plain_default
                };
                gpu.set_mv_override(Some(p));
                for (i, n) in [1, 5].into_iter().enumerate() {
                    let ms = med(cuda.time_mv_pass_n(&cfg, groups, n, 5).unwrap());
                    let us = ms * 1e3 / groups.len() as f64;
                    o8_line += &format!(" n{n}:o8-r{r} {us:.2}");
                    if best[i].is_none_or(|b| us < b.1) {
                        best[i] = Some((r, us));
                    }
                }
            }
            let (b1, b5) = (best[0].unwrap(), best[1].unwrap());
            println!(
                "SWEEP o8 {name:<18} n=1 dp4a {:7.2}  mvo r{} {:7.2} ({:.2}x) | n=5 dp4a {:7.2}  mvt {:7.2} ({:.2}x) |{o8_line}",
                t[0][0], b1.0, b1.1, t[0][0] / b1.1, t[1][0], b5.1, t[1][0] / b5.1
            );
            o8_json.push(format!(
                "{{\"category\": \"{name}\", \"ks\": {}, \"n1_dp4a_us\": {:.2}, \"n1_mvo_r\": {}, \"n1_mvo_us\": {:.2}, \"n5_dp4a_us\": {:.2}, \"n5_mvt_us\": {:.2}}}",
                plain_default.ks, t[0][0], b1.0, b1.1, t[1][0], b5.1
            ));
        }
        gpu.set_mv_override(None);
        println!("{line}");
        let per = |ms: f64| ms * 1e3 / groups.len() as f64;
        let plain = plain_same_ks.expect("plain default plan swept");
        let (pp, pms) = best_mvp.expect("pipelined plans swept");
        println!(
            "SWEEP pipe {name:<18} plain dp4a default {} {:7.2} us | best mvp with its K split {} {:7.2} us ({:.2}x plain, {:.0} GB/s) | engine default {} {:7.2} us",
            tag(&plain_default),
            per(plain),
            tag(&pp),
            per(pms),
            plain / pms,
            bytes as f64 / (pms / 1e3) / 1e9,
            tag(&default),
            per(dms)
        );
        pipe_json.push(format!(
            "{{\"category\": \"{name}\", \"plain_plan\": \"{}\", \"plain_us\": {:.2}, \"mvp_plan\": \"{}\", \"mvp_us\": {:.2}, \"mvp_GBps\": {:.1}}}",
            tag(&plain_default),
            per(plain),
            tag(&pp),
            per(pms),
            bytes as f64 / (pms / 1e3) / 1e9
        ));
        let us = best.1 * 1e3 / groups.len() as f64;
        let gbps = bytes as f64 / (best.1 / 1e3) / 1e9;
        println!(
            "SWEEP best {name:<18} {} {us:.2} us/launch {gbps:.0} GB/s (default {:.2} us)",
            tag(&best.0),
            dms * 1e3 / groups.len() as f64
        );
        println!(
            "SWEEP mma {name:<18} n=1 dp4a {:7.2}  tc-default({}) {:7.2} ({:.2}x dp4a)  {} {:7.2} | n=5 dp4a {:7.2}  tc-default {:7.2} ({:.2}x dp4a)  direct {:7.2} | best mvx {}",
            t[0][0],
            tag(&ring),
            t[0][1],
            t[0][0] / t[0][1],
            tag(&mvd),
            t[0][2],
            t[1][0],
            t[1][1],
            t[1][0] / t[1][1],
            t[1][2],
            best_mvx.map_or("-".into(), |b| format!(
                "{} {:.2} us",
                tag(&b.0),
                b.1 * 1e3 / groups.len() as f64
            ))
        );
        mma_json.push(format!(
            "{{\"category\": \"{name}\", \"tc_default_plan\": \"{}\", \"direct_plan\": \"{}\", \"n1_dp4a_us\": {:.2}, \"n1_tc_default_us\": {:.2}, \"n1_direct_us\": {:.2}, \"n5_dp4a_us\": {:.2}, \"n5_tc_default_us\": {:.2}, \"n5_direct_us\": {:.2}}}",
            tag(&ring),
            tag(&mvd),
            t[0][0],
            t[0][1],
            t[0][2],
            t[1][0],
            t[1][1],
            t[1][2]
        ));
        best_json.push(format!(
            "{{\"category\": \"{name}\", \"r\": {}, \"ks\": {}, \"pre\": {}, \"mma\": {}, \"direct\": {}, \"us_per_launch\": {us:.2}, \"GBps\": {gbps:.1}, \"default_us\": {:.2}}}",
            best.0.r,
            best.0.ks,
            best.0.pre,
            best.0.mma,
            best.0.direct,
            dms * 1e3 / groups.len() as f64
        ));
    }
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"pdl\": {}, \"best\": [{}], \"mma_vs_dp4a\": [{}], \"b1_vs_dp4a\": [{}], \"pipe_vs_dp4a\": [{}], \"o8_vs_dp4a\": [{}], \"all\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        gpu.pdl(),
        best_json.join(", "),
        mma_json.join(", "),
        b1_json.join(", "),
        pipe_json.join(", "),
        o8_json.join(", "),
        rows_json.join(", ")
    );
    if let Ok(out) = std::env::var("BONSAI_SWEEP_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}
