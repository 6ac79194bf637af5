//! GPU mat-vec launch-plan sweep (n = 1, decode): every plan (rows per warp, K split, weights
//! loaded before or after the PDL wait) on every matrix category of a real-shape model, each
//! category's launches back to back over all layers (more bytes than the L2 holds), median of 5
//! passes. Runs only when `$BONSAI_BENCH_MODEL` names a GGUF and a CUDA device exists; otherwise
//! prints SKIPPED. Writes JSON to `$BONSAI_SWEEP_OUT` when set. Driven by scripts/gpu_check.sh;
//! the chosen defaults live in `mv_default_ks` / `mv_default_r` (kernels-cuda/src/lib.rs).

mod common;

use std::sync::Arc;

use bonsai_engine::backend::cuda::CudaBackend;
use bonsai_engine::backend::Backend;
use bonsai_engine::config::TargetConfig;
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::Weights;
use bonsai_kernels_cuda::MvPlan;

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
    for r in [2, 4] {
        for ks in [1, 2, 4] {
            for pre in [true, false] {
                plans.push(MvPlan { r, ks, pre });
            }
        }
    }
    let gpu = cuda.gpu();
    let mut rows_json = Vec::new();
    let mut best_json = Vec::new();
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
        let mut line = format!(
            "SWEEP {name:<18} rows {rows:>6} n_in {n_in:>5} default r{}k{}{} {:7.2} us",
            default.r,
            default.ks,
            if default.pre { "p" } else { "" },
            dms * 1e3 / groups.len() as f64
        );
        for p in &plans {
            gpu.set_mv_override(Some(*p));
            let ms = med(cuda.time_mv_pass(&cfg, groups, 5).unwrap());
            let us = ms * 1e3 / groups.len() as f64;
            let gbps = bytes as f64 / (ms / 1e3) / 1e9;
            line += &format!(
                " | r{}k{}{} {us:.2}",
                p.r,
                p.ks,
                if p.pre { "p" } else { "" }
            );
            rows_json.push(format!(
                "{{\"category\": \"{name}\", \"rows\": {rows}, \"n_in\": {n_in}, \"r\": {}, \"ks\": {}, \"pre\": {}, \"us_per_launch\": {us:.2}, \"GBps\": {gbps:.1}}}",
                p.r, p.ks, p.pre
            ));
            if ms < best.1 {
                best = (*p, ms);
            }
        }
        gpu.set_mv_override(None);
        println!("{line}");
        let us = best.1 * 1e3 / groups.len() as f64;
        let gbps = bytes as f64 / (best.1 / 1e3) / 1e9;
        println!(
            "SWEEP best {name:<18} r{} k{} pre {} {us:.2} us/launch {gbps:.0} GB/s (default {:.2} us)",
            best.0.r,
            best.0.ks,
            best.0.pre,
            dms * 1e3 / groups.len() as f64
        );
        best_json.push(format!(
            "{{\"category\": \"{name}\", \"r\": {}, \"ks\": {}, \"pre\": {}, \"us_per_launch\": {us:.2}, \"GBps\": {gbps:.1}, \"default_us\": {:.2}}}",
            best.0.r,
            best.0.ks,
            best.0.pre,
            dms * 1e3 / groups.len() as f64
        ));
    }
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"pdl\": {}, \"best\": [{}], \"all\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        gpu.pdl(),
        best_json.join(", "),
        rows_json.join(", ")
    );
    if let Ok(out) = std::env::var("BONSAI_SWEEP_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}
