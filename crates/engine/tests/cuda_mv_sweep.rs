//! GPU mat-vec launch-plan sweep (n = 1, decode): every plan (rows per warp, K split, weights
//! loaded before or after the PDL wait) of the dp4a kernels and of the pipelined one-row kernels
//! (`mvp_*`, plans with `pipe`) on every matrix category of a real-shape model, each category's
//! launches back to back over all layers (more bytes than the L2 holds), median of 5 passes. Then
//! the best pipelined plan with the default K split against the plain dp4a default: `SWEEP pipe`
//! lines and `pipe_vs_dp4a`. Runs only when `$BONSAI_BENCH_MODEL` names a GGUF and a CUDA device
//! exists; otherwise prints SKIPPED. Writes JSON to `$BONSAI_SWEEP_OUT` when set. Driven by
//! scripts/gpu_check.sh --sweep; the chosen defaults live in `mv_default_ks` / `mv_default_r`
//! (kernels-cuda/src/lib.rs). The tensor-core, binary and o8 families this sweep also timed were
//! removed on 2026-12-06 (their numbers stay in bench/results/cuda-mv-sweep-*.json).

mod common;

use std::sync::Arc;

use bonsai_engine::backend::cuda::CudaBackend;
use bonsai_engine::backend::Backend;
use bonsai_engine::config::TargetConfig;
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::Weights;
use bonsai_kernels_cuda::{mv_default_plan, MvPlan};

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
    // dp4a
    for r in [2, 4, 8] {
        for ks in [1, 2, 4] {
            for pre in [true, false] {
                plans.push(MvPlan::dp4a(r, ks, pre));
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
            if p.pipe { "mvp-" } else { "" },
            p.r,
            p.ks,
            if p.pre { "p" } else { "" }
        )
    };
    let gpu = cuda.gpu();
    let mut rows_json = Vec::new();
    let mut best_json = Vec::new();
    let mut pipe_json = Vec::new();
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
        let mut best_mvp: Option<(MvPlan, f64)> = None;
        let mut plain_same_ks = None; // the plain dp4a default plan's time (r, ks of the default)
        let plain_default = mv_default_plan(kind, 1, rows, n_in);
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
                "{{\"category\": \"{name}\", \"rows\": {rows}, \"n_in\": {n_in}, \"r\": {}, \"ks\": {}, \"pre\": {}, \"pipe\": {}, \"us_per_launch\": {us:.2}, \"GBps\": {gbps:.1}}}",
                p.r, p.ks, p.pre, p.pipe
            ));
            if ms < best.1 {
                best = (*p, ms);
            }
            // pipelined plans must keep the default K split (it fixes the float order)
            if p.pipe && p.ks == plain_default.ks && best_mvp.is_none_or(|b| ms < b.1) {
                best_mvp = Some((*p, ms));
            }
            if *p == plain_default {
                plain_same_ks = Some(ms);
            }
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
        best_json.push(format!(
            "{{\"category\": \"{name}\", \"r\": {}, \"ks\": {}, \"pre\": {}, \"pipe\": {}, \"us_per_launch\": {us:.2}, \"GBps\": {gbps:.1}, \"default_us\": {:.2}}}",
            best.0.r,
            best.0.ks,
            best.0.pre,
            best.0.pipe,
            dms * 1e3 / groups.len() as f64
        ));
    }
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"pdl\": {}, \"best\": [{}], \"pipe_vs_dp4a\": [{}], \"all\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        gpu.pdl(),
        best_json.join(", "),
        pipe_json.join(", "),
        rows_json.join(", ")
    );
    if let Ok(out) = std::env::var("BONSAI_SWEEP_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}
