//! GPU decode benchmark (batch 1, greedy, CUDA graph per token) and prefill benchmark (pp512 in
//! one chunk, the prefill GEMM per projection group, a per-kernel profile). Runs only when
//! `$BONSAI_BENCH_MODEL` names a GGUF and a CUDA device exists; otherwise prints SKIPPED.
//! Writes a JSON record to `$BONSAI_BENCH_OUT` (default: stdout only). Driven by
//! scripts/gpu_check.sh; results are committed under bench/results/.

mod common;

use std::sync::Arc;
use std::time::Instant;

use bonsai_engine::backend::cuda::CudaBackend;
use bonsai_engine::backend::{Backend, GdnMode};
use bonsai_engine::config::TargetConfig;
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::{forward, Capture, LogitRows, Mixer, SeqState, Weights};
use bonsai_kernels_cuda::{
    GdnFused, GdnPrefill, GemmConfig, GemmPath, MvStaged, MV_STAGED_DEFAULT,
};

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_decode_bench() {
    let Some(path) = common::cuda_bench_model("cuda_decode_bench", "BONSAI_BENCH_MODEL") else {
        return;
    };
    let steps: usize = std::env::var("BONSAI_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(128);
    let t0 = Instant::now();
    let cuda = CudaBackend::new(0).unwrap();
    let t_ctx = t0.elapsed().as_secs_f64();
    let (free0, total) = cuda.gpu().mem_info().unwrap();
    let g = Arc::new(Gguf::open(std::path::Path::new(&path)).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let t1 = Instant::now();
    let w = Weights::load(&cuda, &g, &cfg).unwrap();
    let t_load = t1.elapsed().as_secs_f64();
    let n_ctx = 1024;
    let mut st = SeqState::new(&cuda, &cfg, n_ctx).unwrap();

    // bytes streamed per decoded token: every matrix except the embedding table, one embedding
    // row, the f32 side vectors (approx.), GDN state read + write.
    let mut mat_bytes = 0usize;
    for l in &w.layers {
        match &l.mixer {
            Mixer::Gdn(x) => {
                for m in [&x.qkv, &x.gate, &x.beta, &x.alpha, &x.ssm_out] {
                    mat_bytes += CudaBackend::mat_bytes(m);
                }
            }
            Mixer::Attn(x) => {
                for m in [&x.q, &x.k, &x.v, &x.out] {
                    mat_bytes += CudaBackend::mat_bytes(m);
                }
            }
        }
        for m in [&l.mlp.gate, &l.mlp.up, &l.mlp.down] {
            mat_bytes += CudaBackend::mat_bytes(m);
        }
    }
    mat_bytes += CudaBackend::mat_bytes(w.head_mat());
    let n_gdn = cfg.n_gdn_layers();
    let state_rw = 2 * n_gdn * cfg.ssm_dt_rank * cfg.ssm_d_state * cfg.ssm_head_v_dim() * 4
        + 2 * n_gdn * (cfg.ssm_conv_kernel - 1) * cfg.conv_dim() * 4;
    let bytes_per_token = mat_bytes + state_rw;

    // prompt (8 tokens), then capture the decode graph
    let t2 = Instant::now();
    let first = prefill_prompt8(&cuda, &cfg, &w, &mut st);
    let t_prefill = t2.elapsed().as_secs_f64();
    let (free1, _) = cuda.gpu().mem_info().unwrap();

    // eager decode (one launch per kernel) for comparison
    let mut se = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
    se.copy_from(&cuda, &st);
    let te = Instant::now();
    let eager_steps = 16;
    let eager = cuda
        .greedy_eager(&cfg, &w, &mut se, first, eager_steps)
        .unwrap();
    let eager_tps = eager_steps as f64 / te.elapsed().as_secs_f64();

    let mut sgr = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
    sgr.copy_from(&cuda, &st);
    let t3 = Instant::now();
    let dg = cuda.capture_decode(&cfg, &w, &mut sgr).unwrap();
    let t_capture = t3.elapsed().as_secs_f64();
    // correctness before timing: graph tokens == eager tokens
    let check = cuda
        .run_graph(&cfg, &dg, &mut sgr, first, eager_steps)
        .unwrap();
    assert_eq!(check, eager, "graph and eager greedy differ");
    // warm-up, then timed runs from the same start state, median of 3
    let mut times = Vec::new();
    let mut toks = Vec::new();
    for rep in 0..4 {
        // the graph works in sgr's buffers (their addresses are baked in): reset them each time
        sgr.copy_from(&cuda, &st);
        let (ms, t) = cuda.time_graph(&cfg, &dg, &mut sgr, first, steps).unwrap();
        assert_eq!(
            &t[..eager_steps],
            &eager[..],
            "graph replay from the prompt state differs"
        );
        if rep > 0 {
            times.push(ms as f64);
        }
        toks = t;
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med_ms = times[times.len() / 2];
    let gpu = cuda.gpu();
    let ab = |label, get: &dyn Fn() -> bool, set: &dyn Fn(bool), same| {
        graph_ab(
            label,
            (get, set),
            same,
            &cuda,
            &cfg,
            &w,
            &st,
            (first, steps),
            (med_ms, &toks),
        )
    };
    let pdl_ms = ab("PDL", &|| gpu.pdl(), &|on| gpu.set_pdl(on), true);
    // the norm-fed Q1_0 / Q2_0 projections on b1-planes (int16 activations per 128: another rounding
    // than int8 per 32, so tokens may differ on a random synthetic model)
    // (not where the norm-fed projections are held only in the b1-plane layout: off needs the
    // dp4a one, BONSAI_CUDA_B1P_DP4A=1 keeps it)
    let b1p_only = CudaBackend::b1p_only(&w);
    let b1p_ms = if b1p_only {
        println!("BENCH B1P A/B skipped: the norm-fed projections are held only in the b1-plane layout (BONSAI_CUDA_B1P_DP4A=1 keeps the dp4a one)");
        "null".to_string()
    } else {
        ab(
            "B1P (norm-fed Q1_0 / Q2_0 projections on b1-planes)",
            &|| gpu.b1p(),
            &|on| gpu.set_b1p(on),
            false,
        )
    };
    // the staged one-row kernels keep the dp4a float order: tokens must agree
    // (auto: the long launches only, the default rule; flipped against off)
    let staged_ms = ab(
        "MV_STAGED (auto)",
        &|| gpu.mv_staged(),
        &|on| gpu.set_mv_staged_mode(if on { MvStaged::Auto } else { MvStaged::Off }),
        true,
    );
    // the in-projections of the Q2 GDN / attention layers (8,192 to 32,767 rows) staged (the
    // default since MVS_MIN_ROWS = 8,192) against pipelined (from 32,768 rows, the old default)
    let min_rows0 = gpu.mvs_min_rows();
    let staged_8k_ms = ab(
        "MV_STAGED auto from 8192 rows vs from 32768",
        &|| gpu.mvs_min_rows() == 8192,
        &|on| gpu.set_mvs_min_rows(if on { 8192 } else { 32_768 }),
        true,
    );
    let staged_all_ms = ab(
        "MV_STAGED (all)",
        &|| gpu.mv_staged_mode() == MvStaged::All,
        &|on| gpu.set_mv_staged_mode(if on { MvStaged::All } else { MV_STAGED_DEFAULT }),
        true,
    );
    // the GDN conv fused into the recurrence (one launch fewer per GDN layer, the same bits)
    let fused0 = gpu.gdn_fused();
    let gdn_fused_ms = ab(
        "GDN_FUSED conv + gated norm (gdn_conv_step_norm_d128) vs off",
        &|| gpu.gdn_fused() == GdnFused::ConvNorm,
        &|on| {
            gpu.set_gdn_fused(if on {
                GdnFused::ConvNorm
            } else {
                GdnFused::Off
            })
        },
        true,
    );
    // conv only against the default: "off" here is the default mode (its own run above)
    let gdn_fused_conv_ms = ab(
        "GDN_FUSED conv only (gdn_conv_step) vs the default",
        &|| gpu.gdn_fused() == GdnFused::Conv,
        &|on| gpu.set_gdn_fused(if on { GdnFused::Conv } else { fused0 }),
        true,
    );
    gpu.set_gdn_fused(fused0);
    // SwiGLU inside the decode gate‖up launch (plain 8 rows / K split 1: mv_*_swi; staged: mvs_*_swi)
    let swiglu_ms = ab(
        "SWIGLU_FUSED (mv_*_swi)",
        &|| gpu.swiglu_fused(),
        &|on| gpu.set_swiglu_fused(on),
        true,
    );
    // Q1_0's long launches staged too (gate‖up with the staged SwiGLU, the head)
    let mvs_q1_ms = ab(
        "MVS_Q1 (Q1_0 gate‖up and head staged)",
        &|| gpu.mvs_q1(),
        &|on| gpu.set_mvs_q1(on),
        true,
    );
    // ffn gate‖up plain with 8 rows per warp (and so with the SwiGLU fused in) instead of staged,
    // the head still staged (Q2; on Q1 this is the default plan)
    let gu_r8_ms = ab(
        "gate‖up plain r8 + SwiGLU fused, head staged",
        &|| gpu.mv_long_r() == 8,
        &|on| {
            gpu.set_mvs_min_rows(if on { 40_000 } else { min_rows0 });
            gpu.set_mv_long_r(if on { 8 } else { 0 });
        },
        true,
    );
    // the long one-row launches (> 15,000 rows) plain with 4 rows per warp against the default
    // (Q1: plain, 8 rows; Q2: staged ffn gate‖up and head, 2 rows otherwise); same float order
    let staged0 = gpu.mv_staged_mode();
    let long_r4_ms = ab(
        "MV long launches plain r4",
        &|| gpu.mv_long_r() == 4,
        &|on| {
            gpu.set_mv_staged_mode(if on { MvStaged::Off } else { staged0 });
            gpu.set_mv_long_r(if on { 4 } else { 0 });
        },
        true,
    );

    // per-kernel profile: each mat-vec category launched back to back over all layers (more bytes
    // than the L2 holds), median of 5 passes; then one eager step for the non-mat-vec remainder.
    let med = |mut v: Vec<f32>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2] as f64
    };
    let cats = common::mat_categories(&w, true);
    let mut prof = Vec::new();
    let mut mv_total_ms = 0.0;
    for (name, groups) in &cats {
        let bytes: usize = groups
            .iter()
            .flatten()
            .map(|m| CudaBackend::mat_bytes(m))
            .sum();
        let ms = med(cuda.time_mv_pass(&cfg, groups, 5).unwrap());
        if !name.ends_with("_alone") {
            mv_total_ms += ms;
        }
        let us = ms * 1e3 / groups.len() as f64;
        let gbps = bytes as f64 / (ms / 1e3) / 1e9;
        println!(
            "PROFILE {name:<20} {:>3} launches  {us:8.2} us/launch  {:8.2} MB/launch  {gbps:7.1} GB/s",
            groups.len(),
            bytes as f64 / groups.len() as f64 / 1e6
        );
        prof.push(format!(
            "{{\"kernel\": \"{name}\", \"launches\": {}, \"us_per_launch\": {us:.2}, \"GBps\": {gbps:.1}}}",
            groups.len()
        ));
    }
    // decode graph by shared-memory carveout (one for all kernels; None: the driver's per kernel
    // until a staged launch sets STAGED_CARVEOUT) and staged mode: a carveout switch between
    // consecutive kernels drains the SM
    let mut carve_json = Vec::new();
    for pct in [None, Some(100u8), Some(60)] {
        gpu.set_carveout(pct).unwrap();
        for mode in [MvStaged::Off, MvStaged::Auto, MvStaged::All] {
            gpu.set_mv_staged_mode(mode);
            let (ms, runs) = graph_runs(&cuda, &cfg, &w, &st, first, steps);
            for t in &runs {
                assert_eq!(
                    t, &toks,
                    "carveout {pct:?} staged {mode:?} changes the tokens"
                );
            }
            println!(
                "BENCH carveout {pct:?} staged {mode:?}: graph {:.3} ms/token",
                ms / steps as f64
            );
            carve_json.push(format!(
                "{{\"carveout\": \"{pct:?}\", \"staged\": \"{mode:?}\", \"graph_ms_median\": {ms:.3}}}"
            ));
        }
    }
    gpu.set_carveout(None).unwrap();
    gpu.set_mv_staged_mode(MV_STAGED_DEFAULT);
    // the same passes with every launch staged, by ring depth and rows per warp (0: the layout's)
    let staged0 = gpu.mv_staged_mode();
    let mut staged_prof = Vec::new();
    for (stages, rows) in [
        (0usize, 0usize),
        (3, 0),
        (2, 1),
        (3, 1),
        (4, 1),
        (2, 2),
        (3, 2),
        (2, 4),
    ] {
        gpu.set_mv_staged_mode(MvStaged::All);
        gpu.set_mvs_stages(stages);
        gpu.set_mvs_rows(rows);
        let mut total = 0.0;
        let mut cat_json = Vec::new();
        for (name, groups) in &cats {
            let ms = med(cuda.time_mv_pass(&cfg, groups, 5).unwrap());
            if !name.ends_with("_alone") {
                total += ms;
            }
            let us = ms * 1e3 / groups.len() as f64;
            println!("PROFILE staged stages {stages} rows {rows} {name:<20} {us:8.2} us/launch");
            cat_json.push(format!(
                "{{\"kernel\": \"{name}\", \"us_per_launch\": {us:.2}}}"
            ));
        }
        println!(
            "PROFILE staged stages {stages} rows {rows} (0: per launch): mat-vec {total:.3} ms per step (default {mv_total_ms:.3})"
        );
        staged_prof.push(format!(
            "{{\"staged\": \"all\", \"stages\": {stages}, \"rows\": {rows}, \"matvec_ms_per_step\": {total:.3}, \"profile\": [{}]}}",
            cat_json.join(", ")
        ));
    }
    gpu.set_mv_staged_mode(staged0);
    gpu.set_mvs_stages(0);
    gpu.set_mvs_rows(0);
    // back to the driver's carveout (the passes above staged every launch, which sets it)
    gpu.set_carveout(None).unwrap();
    let mut sp = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
    sp.copy_from(&cuda, &st);
    let step_ms = med(cuda.time_step_eager(&cfg, &w, &mut sp, 5).unwrap());
    println!(
        "PROFILE eager step {step_ms:.3} ms, of which mat-vec (grouped) {mv_total_ms:.3} ms, rest {:.3} ms; graph step {:.3} ms",
        step_ms - mv_total_ms,
        med_ms / steps as f64
    );
    // per-kernel profile of one eager step: every launch timed alone (a spin kernel queued in
    // front so launch gaps are not counted), grouped by kernel name and grid
    let mut sk = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
    sk.copy_from(&cuda, &st);
    cuda.gpu().profile_begin();
    let _ = cuda.time_step_eager(&cfg, &w, &mut sk, 1).unwrap();
    let launches = cuda.gpu().profile_end();
    let agg = common::group_launches(&launches);
    let ktotal: f64 = agg.iter().map(|a| a.2).sum();
    let mut kprof = Vec::new();
    for (name, cnt, tot) in &agg {
        println!(
            "KPROF {name:<36} {cnt:>4} launches {:8.2} us/launch {:9.1} us/step",
            tot / *cnt as f64,
            tot
        );
        kprof.push(format!(
            "{{\"kernel\": \"{name}\", \"launches\": {cnt}, \"us_per_launch\": {:.2}, \"us_per_step\": {tot:.1}}}",
            tot / *cnt as f64
        ));
    }
    println!(
        "KPROF total {ktotal:.1} us over {} launches",
        launches.len()
    );
    // ---- prefill: pp512 in one forward chunk (the engine's PREFILL_CHUNK), fresh state each run,
    // one warm-up then the median of 5; then the GEMM alone per projection group, and a per-kernel
    // profile of one pp512 forward.
    let pp = 512usize;
    let prompt_pp: Vec<u32> = (0..pp as u32)
        .map(|i| (i * 7919 + 3) % cfg.n_vocab as u32)
        .collect();
    // GPU memory the first 512-row prefill adds (its state, GEMM activation and K-split scratch,
    // prefill buffers), on top of `resident_bytes` (measured after the 8-token prompt)
    let (free_pre_pp, _) = cuda.gpu().mem_info().unwrap();
    let mut spp = SeqState::new(&cuda, &cfg, n_ctx.max(pp + 8)).unwrap();
    // `runs` timed pp512 forwards after one warm-up, fresh state each: (sorted ms, last logits)
    let mut time_pp = |runs: usize| {
        let mut ms = Vec::new();
        let mut logits = Vec::new();
        for rep in 0..=runs {
            spp.reset(&cuda);
            cuda.gpu().sync().unwrap();
            let t = Instant::now();
            forward(
                &cuda,
                &cfg,
                &w,
                &mut spp,
                &prompt_pp,
                GdnMode::Chunked,
                LogitRows::Last,
                &mut logits,
                Capture::none(),
            )
            .unwrap();
            if rep > 0 {
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        ms.sort_by(|a: &f64, b| a.partial_cmp(b).unwrap());
        (ms, logits)
    };
    let (pp_ms, mut pp_logits) = time_pp(5);
    let prefill_scratch = free_pre_pp.saturating_sub(cuda.gpu().mem_info().unwrap().0);
    assert!(
        pp_logits.iter().all(|v| v.is_finite()),
        "pp512 logits not finite"
    );
    let pp_med = pp_ms[pp_ms.len() / 2];
    let pp_tps = pp as f64 / (pp_med / 1e3);
    let gpu = cuda.gpu();
    let dflt_cfg = gpu.gemm_config();
    let dflt_name = dflt_cfg.name();
    println!("BENCH prefill pp{pp} ({dflt_name} GEMM): {pp_med:.2} ms median -> {pp_tps:.0} tok/s (runs {pp_ms:?})");
    // the other GEMM configurations (A/B in one process), and how far their last-row logits are
    // from the default's
    let mk = |path, warps, o4| GemmConfig {
        path,
        warps,
        o4,
        wgmma_sets: 4,
    };
    let alts: Vec<GemmConfig> = [
        mk(GemmPath::Int8, 4, None),
        mk(GemmPath::F16, 4, None),
        mk(GemmPath::F16, 4, Some(false)),
        mk(GemmPath::F16, 4, Some(true)),
        mk(GemmPath::F16, 8, None),
        mk(GemmPath::Wgmma, 4, None),
        mk(GemmPath::WgmmaSs, 4, None),
    ]
    .into_iter()
    .filter(|c| {
        c.name() != dflt_name
            && (c.path == GemmPath::Int8 || c.path == GemmPath::F16 || gpu.gemmw_available())
            // a path that reads only the dp4a layout cannot run projections held in the
            // b1-plane layout alone
            && (!b1p_only || c.path == GemmPath::WgmmaSs)
    })
    .collect();
    if b1p_only {
        println!("BENCH prefill: the GEMM paths that read only the dp4a layout skipped (the norm-fed projections are held only in the b1-plane layout; BONSAI_CUDA_B1P_DP4A=1 keeps both)");
    }
    let mut alt_json = Vec::new();
    for &c in &alts {
        gpu.set_gemm_config(c);
        let (alt_ms, alt_logits) = time_pp(3);
        let alt_med = alt_ms[alt_ms.len() / 2];
        let nmse = logit_nmse(&alt_logits, &pp_logits);
        let name = c.name();
        println!(
            "BENCH prefill pp{pp} ({name} GEMM): {alt_med:.2} ms median -> {:.0} tok/s; last-row logit NMSE against {dflt_name} {nmse:.2e}",
            pp as f64 / (alt_med / 1e3)
        );
        alt_json.push(format!(
            "{{\"gemm\": \"{name}\", \"pp512_ms_median\": {alt_med:.2}, \"pp512_ms_all\": {alt_ms:?}, \"last_logit_nmse_vs_default\": {nmse:.3e}}}"
        ));
    }
    gpu.set_gemm_config(dflt_cfg);
    // the other GDN recurrences (row by row, chunked, chunked on tensor cores; A/B in the same
    // process, each against the default's last-row logits)
    let gdn_dflt = gpu.gdn_prefill();
    let mut gdn_alt = Vec::new();
    for mode in GdnPrefill::ALL.into_iter().filter(|&m| m != gdn_dflt) {
        gpu.set_gdn_prefill(mode);
        let (alt_ms, alt_logits) = time_pp(3);
        gpu.set_gdn_prefill(gdn_dflt);
        let alt_med = alt_ms[alt_ms.len() / 2];
        let nmse = logit_nmse(&alt_logits, &pp_logits);
        let (name, alt_name) = (gdn_dflt.name(), mode.name());
        println!(
            "BENCH prefill pp{pp} ({alt_name} GDN recurrence): {alt_med:.2} ms median -> {:.0} tok/s; last-row logit NMSE against {name} {nmse:.2e}",
            pp as f64 / (alt_med / 1e3)
        );
        gdn_alt.push(format!(
            "{{\"gdn_default\": \"{name}\", \"gdn\": \"{alt_name}\", \"pp512_ms_median\": {alt_med:.2}, \"pp512_ms_all\": {alt_ms:?}, \"last_logit_nmse_vs_default\": {nmse:.3e}}}"
        ));
    }
    let gdn_alt_json = format!("[{}]", gdn_alt.join(", "));
    // the other prefill attention kernel (tensor cores vs CUDA cores)
    let attn_tc = gpu.attn_prefill_tc();
    gpu.set_attn_prefill_tc(!attn_tc);
    let (attn_ms, attn_logits) = time_pp(3);
    gpu.set_attn_prefill_tc(attn_tc);
    let attn_med = attn_ms[attn_ms.len() / 2];
    let attn_nmse = logit_nmse(&attn_logits, &pp_logits);
    let attn_name = |tc: bool| if tc { "tensor-core" } else { "fp32" };
    println!(
        "BENCH prefill pp{pp} ({} attention): {attn_med:.2} ms median -> {:.0} tok/s; last-row logit NMSE against {} {attn_nmse:.2e}",
        attn_name(!attn_tc),
        pp as f64 / (attn_med / 1e3),
        attn_name(attn_tc)
    );
    let attn_alt_json = format!(
        "{{\"attn_default\": \"{}\", \"attn\": \"{}\", \"pp512_ms_median\": {attn_med:.2}, \"pp512_ms_all\": {attn_ms:?}, \"last_logit_nmse_vs_default\": {attn_nmse:.3e}}}",
        attn_name(attn_tc),
        attn_name(!attn_tc)
    );

    // ---- a deep prefill chunk: the 8th 512-row chunk of a 4,096-token prompt (pos0 = 3,584),
    // where every query row attends to 3.6-4.1 k keys. The 7 chunks before it run once into a base
    // state; each timed run restores it (not timed) and runs the chunk, with both attention
    // kernels, then one profiled run gives the attention kernels' share.
    let depth = 7 * pp;
    let prompt_deep: Vec<u32> = (0..(depth + pp) as u32)
        .map(|i| (i * 7919 + 3) % cfg.n_vocab as u32)
        .collect();
    let deep_ctx = depth + pp + 8;
    let mut base = SeqState::new(&cuda, &cfg, deep_ctx).unwrap();
    let mut deep_logits = Vec::new();
    for chunk in prompt_deep[..depth].chunks(pp) {
        forward(
            &cuda,
            &cfg,
            &w,
            &mut base,
            chunk,
            GdnMode::Chunked,
            LogitRows::None,
            &mut deep_logits,
            Capture::none(),
        )
        .unwrap();
    }
    let mut sd = SeqState::new(&cuda, &cfg, deep_ctx).unwrap();
    let mut deep_run = |profile: bool| -> (f64, Vec<(String, f32)>) {
        sd.copy_from(&cuda, &base);
        cuda.gpu().sync().unwrap();
        if profile {
            cuda.gpu().profile_begin();
        }
        let t = Instant::now();
        forward(
            &cuda,
            &cfg,
            &w,
            &mut sd,
            &prompt_deep[depth..],
            GdnMode::Chunked,
            LogitRows::Last,
            &mut deep_logits,
            Capture::none(),
        )
        .unwrap();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let prof = if profile {
            cuda.gpu().profile_end()
        } else {
            Vec::new()
        };
        (ms, prof)
    };
    let mut deep_json = Vec::new();
    for tc in [attn_tc, !attn_tc] {
        gpu.set_attn_prefill_tc(tc);
        let mut ms: Vec<f64> = (0..4).map(|_| deep_run(false).0).skip(1).collect();
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = ms[ms.len() / 2];
        let (_, prof) = deep_run(true);
        let attn_us: f64 = prof
            .iter()
            .filter(|(k, _)| k.starts_with("attn_prefill"))
            .map(|(_, us)| *us as f64)
            .sum();
        let all_us: f64 = prof.iter().map(|(_, us)| *us as f64).sum();
        println!(
            "BENCH prefill chunk at pos0 {depth} ({} attention): {med:.2} ms median -> {:.0} tok/s; attention kernels {:.2} of {:.2} ms profiled",
            attn_name(tc),
            pp as f64 / (med / 1e3),
            attn_us / 1e3,
            all_us / 1e3
        );
        deep_json.push(format!(
            "{{\"attn\": \"{}\", \"pos0\": {depth}, \"n\": {pp}, \"ms_median\": {med:.2}, \"ms_all\": {ms:?}, \"attn_kernels_ms\": {:.3}, \"profiled_ms\": {:.3}}}",
            attn_name(tc),
            attn_us / 1e3,
            all_us / 1e3
        ));
    }
    gpu.set_attn_prefill_tc(attn_tc);
    let deep_json = format!("[{}]", deep_json.join(", "));

    // GEMM alone, n = 512, one grouped launch per layer and category, all layers back to back
    let mut gcats: Vec<(&str, Vec<Vec<&<CudaBackend as Backend>::Mat>>)> = vec![
        ("gdn_in(qkv|z|b|a)", vec![]),
        ("ssm_out", vec![]),
        ("attn_in(q|k|v)", vec![]),
        ("attn_out", vec![]),
        ("ffn_gate|up", vec![]),
        ("ffn_down", vec![]),
    ];
    for l in &w.layers {
        match &l.mixer {
            Mixer::Gdn(x) => {
                gcats[0].1.push(vec![&x.qkv, &x.gate, &x.beta, &x.alpha]);
                gcats[1].1.push(vec![&x.ssm_out]);
            }
            Mixer::Attn(x) => {
                gcats[2].1.push(vec![&x.q, &x.k, &x.v]);
                gcats[3].1.push(vec![&x.out]);
            }
        }
        gcats[4].1.push(vec![&l.mlp.gate, &l.mlp.up]);
        gcats[5].1.push(vec![&l.mlp.down]);
    }
    // one category's GEMMs back to back: (median ms, TOPS)
    let time_cat = |groups: &[Vec<&<CudaBackend as Backend>::Mat>], reps: usize| {
        let macs: usize = groups.iter().flatten().map(|m| m.n_in * m.n_out * pp).sum();
        let ms = med(cuda.time_proj_pass(&cfg, groups, pp, reps).unwrap());
        (ms, 2.0 * macs as f64 / (ms / 1e3) / 1e12)
    };
    let mut gemm_json = Vec::new();
    let mut gemm_total_ms = 0.0;
    for (name, groups) in &gcats {
        let (ms, tops) = time_cat(groups, 5);
        gemm_total_ms += ms;
        let shape = groups[0]
            .iter()
            .map(|m| format!("{}x{}", m.n_in, m.n_out))
            .collect::<Vec<_>>()
            .join("|");
        println!(
            "GEMM n={pp} {name:<20} {shape:<32} {:>3} launches {:8.1} us/launch {tops:7.1} TOPS",
            groups.len(),
            ms * 1e3 / groups.len() as f64
        );
        gemm_json.push(format!(
            "{{\"group\": \"{name}\", \"shape\": \"{shape}\", \"launches\": {}, \"us_per_launch\": {:.1}, \"TOPS\": {tops:.1}}}",
            groups.len(),
            ms * 1e3 / groups.len() as f64
        ));
    }
    println!(
        "GEMM n={pp} all projections {gemm_total_ms:.2} ms of the {pp_med:.2} ms pp{pp} forward"
    );
    // the other configurations' GEMMs alone
    let mut alt_gemm_json = Vec::new();
    for &c in &alts {
        gpu.set_gemm_config(c);
        let name = c.name();
        let mut total = 0.0;
        for (gname, groups) in &gcats {
            let (ms, tops) = time_cat(groups, 3);
            total += ms;
            println!(
                "GEMM ({name}) n={pp} {gname:<20} {:8.1} us/launch {tops:7.1} TOPS",
                ms * 1e3 / groups.len() as f64
            );
            alt_gemm_json.push(format!(
                "{{\"gemm\": \"{name}\", \"group\": \"{gname}\", \"us_per_launch\": {:.1}, \"TOPS\": {tops:.1}}}",
                ms * 1e3 / groups.len() as f64
            ));
        }
        println!("GEMM ({name}) n={pp} all projections {total:.2} ms");
    }
    gpu.set_gemm_config(dflt_cfg);

    // per-kernel profile of one pp512 forward (each launch timed alone)
    spp.reset(&cuda);
    cuda.gpu().profile_begin();
    forward(
        &cuda,
        &cfg,
        &w,
        &mut spp,
        &prompt_pp,
        GdnMode::Chunked,
        LogitRows::Last,
        &mut pp_logits,
        Capture::none(),
    )
    .unwrap();
    let pl = cuda.gpu().profile_end();
    let mut pagg: Vec<(String, usize, f64)> = Vec::new();
    for (name, us) in &pl {
        // group by kernel name only (grids differ by matrix)
        let k = name.split_whitespace().next().unwrap_or("?").to_string();
        match pagg.iter_mut().find(|a| a.0 == k) {
            Some(a) => {
                a.1 += 1;
                a.2 += *us as f64;
            }
            None => pagg.push((k, 1, *us as f64)),
        }
    }
    pagg.sort_by(|a, b| b.2.partial_cmp(&a.2).unwrap());
    let ptotal: f64 = pagg.iter().map(|a| a.2).sum();
    let mut pp_prof = Vec::new();
    for (name, cnt, tot) in &pagg {
        println!(
            "PPPROF {name:<24} {cnt:>5} launches {:9.1} us total ({:4.1}%)",
            tot,
            100.0 * tot / ptotal.max(1e-9)
        );
        pp_prof.push(format!(
            "{{\"kernel\": \"{name}\", \"launches\": {cnt}, \"us\": {tot:.1}}}"
        ));
    }
    println!("PPPROF total {ptotal:.1} us over {} launches", pl.len());

    let tps = steps as f64 / (med_ms / 1e3);
    let bw = bytes_per_token as f64 * tps;
    let frac = bw / 4.49e12;
    let resident = free0 - free1;
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"steps\": {steps}, \
         \"graph_ms_median\": {med_ms:.3}, \"graph_ms_all\": {times:?}, \"decode_tok_s\": {tps:.1}, \
         \"eager_tok_s\": {eager_tps:.1}, \"cubin_source\": \"{:?}\", \"pdl\": {pdl_ms}, \"b1p\": {b1p_ms}, \"mv_staged_auto\": {staged_ms}, \"mv_staged_all\": {staged_all_ms}, \"mv_staged_from_8192_rows\": {staged_8k_ms}, \"gdn_fused\": {gdn_fused_ms}, \"gdn_fused_conv_only_vs_default\": {gdn_fused_conv_ms}, \"swiglu_fused\": {swiglu_ms}, \"mvs_q1\": {mvs_q1_ms}, \"gate_up_plain_r8_swiglu\": {gu_r8_ms}, \"mv_long_plain_r4\": {long_r4_ms}, \"mv_staged_default\": \"{:?}\", \"carveout_x_staged\": [{}], \"staged_flipped_profile\": [{}], \"bytes_per_token\": {bytes_per_token}, \
         \"achieved_GBps\": {:.1}, \"fraction_of_4_49_TBps\": {frac:.3}, \"resident_bytes\": {resident}, \"prefill_pp512_extra_bytes\": {prefill_scratch}, \
         \"gpu_total_bytes\": {total}, \"t_ctx_s\": {t_ctx:.2}, \"t_load_s\": {t_load:.2}, \
         \"t_prefill8_s\": {t_prefill:.3}, \"t_capture_s\": {t_capture:.3}, \"eager_step_ms\": {step_ms:.3}, \"matvec_ms_per_step\": {mv_total_ms:.3}, \"profile\": [{}], \"kernel_profile_total_us\": {ktotal:.1}, \"kernel_profile\": [{}], \"first_tokens\": {:?}, \
         \"prefill_pp512_ms_median\": {pp_med:.2}, \"prefill_pp512_ms_all\": {pp_ms:?}, \
         \"prefill_pp512_tok_s\": {pp_tps:.1}, \"prefill_gemm\": \"{dflt_name}\", \"gemm_n512_total_ms\": {gemm_total_ms:.3}, \
         \"gemm_n512\": [{}], \"prefill_alt\": [{}], \"prefill_gdn_alt\": {gdn_alt_json}, \"prefill_attn_alt\": {attn_alt_json}, \"prefill_deep_chunk\": {deep_json}, \"alt_gemm_n512\": [{}], \
         \"prefill_kernel_profile_total_us\": {ptotal:.1}, \
         \"prefill_kernel_profile\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        cuda.gpu().cubin_source,
        MV_STAGED_DEFAULT,
        carve_json.join(", "),
        staged_prof.join(", "),
        bw / 1e9,
        prof.join(", "),
        kprof.join(", "),
        &toks[..toks.len().min(8)],
        gemm_json.join(", "),
        alt_json.join(", "),
        alt_gemm_json.join(", "),
        pp_prof.join(", ")
    );
    println!("BENCH {json}");
    if let Ok(out) = std::env::var("BONSAI_BENCH_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}

/// NMSE of logits `a` against `b` (f64 sums).
fn logit_nmse(a: &[f32], b: &[f32]) -> f64 {
    let (num, den) = a.iter().zip(b).fold((0f64, 0f64), |(n, d), (&x, &y)| {
        (n + ((x - y) as f64).powi(2), d + (y as f64).powi(2))
    });
    num / den.max(1e-30)
}

/// The benches' prompt: 8 fixed token ids run through `st` (recurrent GDN), returning the greedy
/// next token (the first maximum of the last row's logits).
fn prefill_prompt8(
    cuda: &CudaBackend,
    cfg: &TargetConfig,
    w: &Weights<CudaBackend>,
    st: &mut SeqState<CudaBackend>,
) -> u32 {
    let prompt: Vec<u32> = (0..8u32)
        .map(|i| (i * 7919 + 3) % cfg.n_vocab as u32)
        .collect();
    let mut logits = Vec::new();
    forward(
        cuda,
        cfg,
        w,
        st,
        &prompt,
        GdnMode::Recurrent,
        LogitRows::Last,
        &mut logits,
        Capture::none(),
    )
    .unwrap();
    logits
        .iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// The model `$BONSAI_BENCH_MODEL` names, loaded on CUDA with the 8-token prompt prefilled: what
/// the graph benchmarks capture from (`graph_runs`). `None` (the test prints SKIPPED) without a
/// model or a device.
struct Graphed {
    path: String,
    cuda: CudaBackend,
    cfg: TargetConfig,
    w: Weights<CudaBackend>,
    st: SeqState<CudaBackend>,
    first: u32,
}

fn graphed(test: &str) -> Option<Graphed> {
    let path = common::cuda_bench_model(test, "BONSAI_BENCH_MODEL")?;
    let cuda = CudaBackend::new(0).unwrap();
    let g = Arc::new(Gguf::open(std::path::Path::new(&path)).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let w = Weights::load(&cuda, &g, &cfg).unwrap();
    let mut st = SeqState::new(&cuda, &cfg, 1024).unwrap();
    let first = prefill_prompt8(&cuda, &cfg, &w, &mut st);
    Some(Graphed {
        path,
        cuda,
        cfg,
        w,
        st,
        first,
    })
}

/// What each family of launches costs inside the decode graph: the graph captured again with
/// those launches dropped (the tokens are then meaningless; only the time is kept), against the
/// full graph in the same process. Writes JSON to `$BONSAI_WHATIF_OUT`. Runs only when
/// `$BONSAI_BENCH_MODEL` names a GGUF and a CUDA device exists.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh --what-if runs it on the H200"]
fn cuda_launch_what_if() {
    let Some(Graphed {
        path,
        cuda,
        cfg,
        w,
        st,
        first,
    }) = graphed("cuda_launch_what_if")
    else {
        return;
    };
    let steps = 128;
    let gpu = cuda.gpu();
    let (base_ms, _) = graph_runs(&cuda, &cfg, &w, &st, first, steps);
    let matvec = gpu.matvec_kernel_names();
    let small: Vec<&str> = ["rmsnorm_quant", "swiglu_quant", "swiglu_quant_p16"]
        .into_iter()
        .chain(common::GDN_DECODE_KERNELS)
        .chain(common::ATTN_DECODE_KERNELS)
        .chain(["argmax_rows", "embed_rows"])
        .collect();
    let sets: Vec<(&str, Vec<&str>)> = vec![
        ("rmsnorm_quant", vec!["rmsnorm_quant"]),
        ("swiglu_quant", vec!["swiglu_quant", "swiglu_quant_p16"]),
        // (the defaults fuse them: gdn_conv_step_norm_d128; the others run under other modes)
        (
            "GDN conv + step + gated norm",
            common::GDN_DECODE_KERNELS.to_vec(),
        ),
        (
            "attention (prep, chunks, merge)",
            common::ATTN_DECODE_KERNELS.to_vec(),
        ),
        ("argmax_rows", vec!["argmax_rows"]),
        ("embed_rows", vec!["embed_rows"]),
        ("every non-mat-vec kernel", small),
        ("every mat-vec", matvec.clone()),
    ];
    let mut rows = Vec::new();
    for (label, set) in &sets {
        gpu.set_skip_kernels(set).unwrap();
        let (ms, _) = graph_runs(&cuda, &cfg, &w, &st, first, steps);
        gpu.set_skip_kernels(&[]).unwrap();
        let per_step = |m: f64| m / steps as f64;
        let saved = per_step(base_ms) - per_step(ms);
        println!(
            "WHATIF without {label:<34} graph {:.3} ms/token (full {:.3}): {saved:+.3} ms",
            per_step(ms),
            per_step(base_ms)
        );
        rows.push(format!(
            "{{\"skipped\": \"{label}\", \"graph_ms_per_token\": {:.4}, \"saved_ms_per_token\": {saved:.4}}}",
            per_step(ms)
        ));
    }
    // the full graph again: the spread of the baseline
    let (again_ms, _) = graph_runs(&cuda, &cfg, &w, &st, first, steps);
    let rest = format!(
        "\"graph_ms_per_token\": {:.4}, \"graph_ms_per_token_again\": {:.4}, \"without\": [{}]",
        base_ms / steps as f64,
        again_ms / steps as f64,
        rows.join(", ")
    );
    report(
        "WHATIF",
        "BONSAI_WHATIF_OUT",
        (&path, &cfg, &cuda, steps),
        &rest,
    );
}

/// Decode graph time under the staged gate‖up settings (`BONSAI_BENCH_MODEL`; benchmark only):
/// the SwiGLU fused or not, rows per warp and ring stages of the staged kernels, the carveout;
/// each row a fresh capture in one process, the median of 3 replays, and the tokens checked
/// against the first row's (the settings never change a result). `BONSAI_SWEEP_OUT` receives the
/// JSON, `BONSAI_SWEEP_ROWS` picks rows by label.
#[test]
#[ignore = "needs a CUDA GPU and BONSAI_BENCH_MODEL"]
fn cuda_gate_up_sweep() {
    let Some(Graphed {
        path,
        cuda,
        cfg,
        w,
        st,
        first,
    }) = graphed("cuda_gate_up_sweep")
    else {
        return;
    };
    let steps = 128;
    let gpu = cuda.gpu();
    // (label, SwiGLU fused, staged rows per warp, stages (0: the launcher's choice), shared-memory
    // carveout for every kernel (None: the automatic one))
    let rows: [(&str, bool, usize, usize, Option<u8>); 17] = [
        ("unfused", false, 0, 0, None),
        ("swi", true, 0, 0, None),
        ("swi r4", true, 4, 0, None),
        ("swi s3", true, 0, 3, None),
        ("swi s4", true, 0, 4, None),
        ("swi r4 s3", true, 4, 3, None),
        ("swi c20", true, 0, 0, Some(20)),
        ("swi c30", true, 0, 0, Some(30)),
        ("swi c44", true, 0, 0, Some(44)),
        ("swi c50", true, 0, 0, Some(50)),
        ("swi c58", true, 0, 0, Some(58)),
        ("swi c64", true, 0, 0, Some(64)),
        ("swi c72", true, 0, 0, Some(72)),
        ("swi c86", true, 0, 0, Some(86)),
        ("swi c100", true, 0, 0, Some(100)),
        ("swi again", true, 0, 0, None),
        ("unfused again", false, 0, 0, None),
    ];
    let mut base: Option<Vec<u32>> = None;
    let mut json = Vec::new();
    // `BONSAI_SWEEP_ROWS`: a comma-separated subset of the labels (all when unset)
    let pick = std::env::var("BONSAI_SWEEP_ROWS").ok();
    for (label, swi, r, s, c) in rows {
        if pick
            .as_deref()
            .is_some_and(|p| !p.split(',').any(|l| l == label))
        {
            continue;
        }
        gpu.set_swiglu_fused(swi);
        gpu.set_mvs_rows(r);
        gpu.set_mvs_stages(s);
        gpu.set_carveout(c).unwrap();
        json.push(checked_row("SWEEP", label, steps, &mut base, || {
            graph_runs(&cuda, &cfg, &w, &st, first, steps)
        }));
    }
    gpu.set_swiglu_fused(true);
    gpu.set_mvs_rows(0);
    gpu.set_mvs_stages(0);
    gpu.set_carveout(None).unwrap();
    let rest = format!("\"rows\": [{}]", json.join(", "));
    report(
        "SWEEP",
        "BONSAI_SWEEP_OUT",
        (&path, &cfg, &cuda, steps),
        &rest,
    );
}

/// Decode graph time of the one-row b1-plane launches with the activation row in shared memory
/// ([`Gpu::set_b1p_xs`]) or in registers, by carveout (`BONSAI_BENCH_MODEL`, a Q1_0 file;
/// benchmark only); each row a fresh capture in one process, the median of 3 replays, the tokens
/// checked against the first row's (the switch never changes a bit). Then the per-category
/// profile of the b1-plane timing substitution with the switch off and on (the stand-in takes
/// the launches of at least `BONSAI_CUDA_B1P_MIN_ROWS` rows). `BONSAI_XS_OUT` receives the JSON.
#[test]
#[ignore = "needs a CUDA GPU and BONSAI_BENCH_MODEL"]
fn cuda_b1p_xs_sweep() {
    let Some(Graphed {
        path,
        cuda,
        cfg,
        w,
        st,
        first,
    }) = graphed("cuda_b1p_xs_sweep")
    else {
        return;
    };
    let steps = 128;
    let gpu = cuda.gpu();
    let xs0 = gpu.b1p_xs();
    let rows: [(&str, bool, Option<u8>); 8] = [
        ("registers", false, None),
        ("shared", true, None),
        ("registers again", false, None),
        ("shared again", true, None),
        ("shared c58", true, Some(58)),
        ("shared c100", true, Some(100)),
        ("registers c58", false, Some(58)),
        ("shared last", true, None),
    ];
    let mut base: Option<Vec<u32>> = None;
    let mut json = Vec::new();
    // `BONSAI_XS_PROFILE_ONLY=1`: the profile alone (another stand-in row threshold)
    let graphs = std::env::var("BONSAI_XS_PROFILE_ONLY").map_or(true, |v| v != "1");
    for (label, xs, c) in rows.into_iter().filter(|_| graphs) {
        gpu.set_b1p_xs(xs);
        gpu.set_carveout(c).unwrap();
        json.push(checked_row("XS", label, steps, &mut base, || {
            graph_runs(&cuda, &cfg, &w, &st, first, steps)
        }));
    }
    gpu.set_carveout(None).unwrap();
    let cats = common::mat_categories(&w, true);
    let mut prof = Vec::new();
    gpu.set_b1p_timing(true).unwrap();
    for xs in [false, true, false, true] {
        gpu.set_b1p_xs(xs);
        prof.extend(category_profile(&cuda, &cfg, &cats, "XS", ("shared", xs)));
    }
    gpu.set_b1p_timing(false).unwrap();
    gpu.set_b1p_xs(xs0);
    let rest = format!(
        "\"rows\": [{}], \"profile\": [{}]",
        json.join(", "),
        prof.join(", ")
    );
    report("XS", "BONSAI_XS_OUT", (&path, &cfg, &cuda, steps), &rest);
}

/// Decode graph time with the fused GDN launch counting its shared window loads before its PDL
/// wait ([`Gpu::set_gdn_early_count`], the default) against after its first barriers:
/// `BONSAI_BENCH_MODEL` (Q1_0 or Q2_0); benchmark only. Each row a fresh capture in one process,
/// off and on alternating four times, the median of 3 replays; the tokens are checked against the
/// first row's (the switch never changes a bit). `BONSAI_EARLY_OUT` receives the JSON.
#[test]
#[ignore = "needs a CUDA GPU and BONSAI_BENCH_MODEL"]
fn cuda_gdn_early_ab() {
    let Some(Graphed {
        path,
        cuda,
        cfg,
        w,
        st,
        first,
    }) = graphed("cuda_gdn_early_ab")
    else {
        return;
    };
    let steps = 128;
    let gpu = cuda.gpu();
    let early0 = gpu.gdn_early_count();
    let mut base: Option<Vec<u32>> = None;
    let mut json = Vec::new();
    for i in 0..8 {
        let on = i % 2 == 1;
        gpu.set_gdn_early_count(on);
        let label = if on { "count early" } else { "count after" };
        json.push(checked_row("EARLY", label, steps, &mut base, || {
            graph_runs(&cuda, &cfg, &w, &st, first, steps)
        }));
    }
    gpu.set_gdn_early_count(early0);
    let rest = format!("\"rows\": [{}]", json.join(", "));
    report(
        "EARLY",
        "BONSAI_EARLY_OUT",
        (&path, &cfg, &cuda, steps),
        &rest,
    );
}

/// The decode graph with the norm-fed Q1_0 projections on b1-planes ([`Gpu::set_b1p`]) against
/// dp4a, and with the timing substitution ([`Gpu::set_b1p_timing`]: every Q1_0 mat-vec of at least
/// `BONSAI_CUDA_B1P_MIN_ROWS` rows and the SwiGLU gate‖up launch swapped for a b1-plane launch over
/// the same weight bytes and zeroed planes; its tokens are meaningless) — `BONSAI_BENCH_MODEL`, a
/// Q1_0 file; benchmark only. Each row a fresh capture, the median of 3 replays; tokens are not
/// compared (b1-planes round the activations differently).
#[test]
#[ignore = "needs a CUDA GPU and BONSAI_BENCH_MODEL"]
fn cuda_b1p_timing() {
    let Some(Graphed {
        path,
        cuda,
        cfg,
        w,
        st,
        first,
    }) = graphed("cuda_b1p_timing")
    else {
        return;
    };
    if CudaBackend::b1p_only(&w) {
        eprintln!("SKIPPED cuda_b1p_timing: the norm-fed projections are held only in the b1-plane layout; run with BONSAI_CUDA_B1P_DP4A=1 (not counted as run)");
        return;
    }
    let steps = 128;
    let gpu = cuda.gpu();
    let mut json = Vec::new();
    // (label, b1-plane projections, timing stand-in for the remaining Q1_0 launches)
    let b1p0 = gpu.b1p();
    for (label, b1p, stand_in) in [
        ("dp4a", false, false),
        ("b1p", true, false),
        ("b1p stand-in", false, true),
        ("dp4a again", false, false),
        ("b1p again", true, false),
    ] {
        gpu.set_b1p(b1p);
        gpu.set_b1p_timing(stand_in).unwrap();
        let (ms, _) = graph_runs(&cuda, &cfg, &w, &st, first, steps);
        let per = ms / steps as f64;
        println!("B1P {label:<20} graph {per:.4} ms/token");
        json.push(format!(
            "{{\"config\": \"{label}\", \"graph_ms_per_token\": {per:.4}}}"
        ));
    }
    gpu.set_b1p(b1p0);
    // per mat-vec category, each launched back to back over all layers (PDL between launches as
    // in the graph; int8 inputs, so b1-plane projections only through the stand-in), median of 5
    // passes, stand-in off then on
    let cats = common::mat_categories(&w, true);
    let mut prof = Vec::new();
    for on in [false, true] {
        gpu.set_b1p_timing(on).unwrap();
        prof.extend(category_profile(&cuda, &cfg, &cats, "B1P", ("b1p", on)));
    }
    gpu.set_b1p_timing(false).unwrap();
    let rest = format!(
        "\"rows\": [{}], \"profile\": [{}]",
        json.join(", "),
        prof.join(", ")
    );
    report("B1P", "BONSAI_B1P_OUT", (&path, &cfg, &cuda, steps), &rest);
}

/// The same graph decode captured again with one switch flipped (A/B in one process): `get`
/// reads the switch, `set` flips it. The tokens must match when `same_tokens` (the switch changes
/// scheduling only); otherwise the agreeing prefix is reported (the switch changes a kernel's
/// summation order, so a near-tie on a random synthetic model may flip). Returns a JSON object with
/// both medians.
#[allow(clippy::too_many_arguments)]
/// The decode graph captured afresh under the current settings and replayed 4 times from `st`
/// (`steps` tokens after `first`): the median ms of the last 3 and the tokens of every replay.
/// A benchmark's JSON: the model, weight type, device and steps, then `rest` (its own fields);
/// printed after `tag` and written to the file the environment variable `env` names, if set.
fn report(
    tag: &str,
    env: &str,
    (path, cfg, cuda, steps): (&str, &TargetConfig, &CudaBackend, usize),
    rest: &str,
) {
    let out = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"steps\": {steps}, {rest}}}",
        cfg.weight_type.name(),
        cuda.name()
    );
    println!("{tag} {out}");
    if let Ok(p) = std::env::var(env) {
        std::fs::write(p, &out).unwrap();
    }
}

/// One row of a settings sweep: `run` captures and times the decode graph under the settings
/// just applied; its tokens must equal the first row's (`base`, set by the first call), because
/// the swept settings never change a bit. Prints `tag label ms/token` and returns the row's JSON.
fn checked_row(
    tag: &str,
    label: &str,
    steps: usize,
    base: &mut Option<Vec<u32>>,
    run: impl FnOnce() -> (f64, Vec<Vec<u32>>),
) -> String {
    let (ms, runs) = run();
    let b = base.get_or_insert_with(|| runs[0].clone());
    assert!(runs.iter().all(|t| t == b), "{label}: tokens differ");
    let per = ms / steps as f64;
    println!("{tag} {label:<18} graph {per:.4} ms/token");
    format!("{{\"config\": \"{label}\", \"graph_ms_per_token\": {per:.4}}}")
}

/// Each mat-vec category of `cats` launched back to back over all layers (PDL between launches as
/// in the graph), median of 5 passes, µs per launch: printed as `tag profile key value name` and
/// returned as JSON objects with `key: value`.
fn category_profile(
    cuda: &CudaBackend,
    cfg: &TargetConfig,
    cats: &[(&'static str, Vec<Vec<&<CudaBackend as Backend>::Mat>>)],
    tag: &str,
    (key, value): (&str, bool),
) -> Vec<String> {
    let mut prof = Vec::new();
    for (name, groups) in cats {
        let mut v = cuda.time_mv_pass(cfg, groups, 5).unwrap();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let us = v[v.len() / 2] as f64 * 1e3 / groups.len() as f64;
        println!("{tag} profile {key} {value:<5} {name:<20} {us:8.2} us/launch");
        prof.push(format!(
            "{{\"{key}\": {value}, \"kernel\": \"{name}\", \"us_per_launch\": {us:.2}}}"
        ));
    }
    prof
}

fn graph_runs(
    cuda: &CudaBackend,
    cfg: &TargetConfig,
    w: &Weights<CudaBackend>,
    st: &SeqState<CudaBackend>,
    first: u32,
    steps: usize,
) -> (f64, Vec<Vec<u32>>) {
    let mut s0 = SeqState::new(cuda, cfg, st.n_ctx).unwrap();
    s0.copy_from(cuda, st);
    let dg = cuda.capture_decode(cfg, w, &mut s0).unwrap();
    let mut times = Vec::new();
    let mut runs = Vec::new();
    for rep in 0..4 {
        // the graph works in s0's buffers (their addresses are baked in): reset them each time
        s0.copy_from(cuda, st);
        let (ms, t) = cuda.time_graph(cfg, &dg, &mut s0, first, steps).unwrap();
        if rep > 0 {
            times.push(ms as f64);
        }
        runs.push(t);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (times[times.len() / 2], runs)
}

fn graph_ab(
    label: &str,
    (get, set): (&dyn Fn() -> bool, &dyn Fn(bool)),
    same_tokens: bool,
    cuda: &CudaBackend,
    cfg: &TargetConfig,
    w: &Weights<CudaBackend>,
    st: &SeqState<CudaBackend>,
    (first, steps): (u32, usize),
    (med_a, toks_a): (f64, &[u32]),
) -> String {
    let a = get();
    set(!a);
    let (med_b, runs) = graph_runs(cuda, cfg, w, st, first, steps);
    let mut agree = steps;
    for t in &runs {
        if same_tokens {
            assert_eq!(t, toks_a, "{label} on and off give different tokens");
        }
        agree = t.iter().zip(toks_a).take_while(|(x, y)| x == y).count();
    }
    set(a);
    let (on, off) = if a { (med_a, med_b) } else { (med_b, med_a) };
    println!(
        "BENCH {label}: graph {:.3} ms/token on, {:.3} off ({:+.1}% on vs off); tokens agree for {agree} of {steps}",
        on / steps as f64,
        off / steps as f64,
        100.0 * (on / off - 1.0)
    );
    format!(
        "{{\"default_on\": {a}, \"graph_ms_median_on\": {on:.3}, \"graph_ms_median_off\": {off:.3}, \"tokens_agree\": {agree}}}"
    )
}
