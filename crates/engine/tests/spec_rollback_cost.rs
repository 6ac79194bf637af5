//! Rollback cost benchmark (issue 4): times ONLY the rollback + commit step of a verify round
//! (attention KV truncation, GDN snapshot restore, then replay or re-forward of the accepted rows)
//! for every accept count, `Rollback::Replay` against `Rollback::Reforward`, on the same prompts
//! and the same rounds. Drafts come from an oracle (the target's own greedy continuation) with the
//! draft at index `k` corrupted, so round `r` accepts exactly `k = r mod 5` drafts.
//!
//! Ignored by default (it needs a real-size synthetic file and an optimized build). Run through
//! `python -m bonsai bench --spec`, or by hand:
//!
//! ```text
//! BONSAI_ROLLBACK_TARGET=models/spec-small-q1-g0.05.gguf BONSAI_ROLLBACK_OUT=/tmp/rb.json \
//!   cargo test --profile fastrel -p bonsai-engine --test spec_rollback_cost -- --ignored --nocapture
//! ```
//! Optional: `BONSAI_ROLLBACK_THREADS` (2), `BONSAI_ROLLBACK_PASSES` (4), `BONSAI_ROLLBACK_GEN` (160).

use std::sync::Arc;
use std::time::Instant;

use bonsai_engine::backend::cpu::CpuBackend;
use bonsai_engine::backend::{GdnMode, KvType};
use bonsai_engine::config::TargetConfig;
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::{forward, Capture, LogitRows, SeqState, Weights};
use bonsai_engine::sampling::{Sampler, SamplerParams};
use bonsai_engine::spec::{verify_round, Rollback, RoundBufs};

const B: CpuBackend = CpuBackend::new(KvType::F16);
const K: usize = 4;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// (median, first quartile, third quartile) in milliseconds.
fn quartiles(v: &mut [f64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |f: f64| {
        let x = f * (v.len() - 1) as f64;
        let (i, t) = (x.floor() as usize, x - x.floor());
        let hi = v[(i + 1).min(v.len() - 1)];
        1e3 * (v[i] + t * (hi - v[i]))
    };
    (q(0.5), q(0.25), q(0.75))
}

fn stat_json(v: &mut [f64]) -> String {
    let (m, a, b) = quartiles(v);
    format!(
        "{{\"n\": {}, \"median_ms\": {m:.4}, \"q1_ms\": {a:.4}, \"q3_ms\": {b:.4}, \"iqr_ms\": {:.4}}}",
        v.len(),
        b - a
    )
}

fn prefill(
    cfg: &TargetConfig,
    w: &Weights<CpuBackend>,
    st: &mut SeqState<CpuBackend>,
    ids: &[u32],
) -> Vec<f32> {
    let mut lg = Vec::new();
    forward(
        &B,
        cfg,
        w,
        st,
        ids,
        GdnMode::Chunked,
        LogitRows::Last,
        &mut lg,
        Capture::none(),
    )
    .unwrap();
    lg
}

#[test]
#[ignore = "benchmark: needs BONSAI_ROLLBACK_TARGET and an optimized build"]
fn rollback_cost() {
    let Ok(path) = std::env::var("BONSAI_ROLLBACK_TARGET") else {
        panic!("set BONSAI_ROLLBACK_TARGET to a synthetic target GGUF");
    };
    let threads = env("BONSAI_ROLLBACK_THREADS", 2);
    let passes = env("BONSAI_ROLLBACK_PASSES", 4);
    let n_gen = env("BONSAI_ROLLBACK_GEN", 160);
    let g = Arc::new(Gguf::open(std::path::Path::new(&path)).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let w = Weights::load(&B, &g, &cfg).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    // the drafter's tap layers, spread like the real [1, 16, 31, 46, 61] (synth.drafter_target_layers)
    let taps: Vec<usize> = (0..5)
        .map(|j| (1.0 + j as f64 * (cfg.n_layer - 4) as f64 / 4.0).round() as usize)
        .collect();
    let load0 = loadavg();
    let text = 8000.min(cfg.n_vocab as u32 - 8);
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| {
            (0..40u32)
                .map(|i| (i.wrapping_mul(2654435761).wrapping_add(s * 7919 + 13)) % text)
                .collect()
        })
        .collect();
    // samples[mode][k]: rollback seconds; also snapshot / verify seconds and plain step seconds
    let mut rb: [[Vec<f64>; K + 1]; 2] = Default::default();
    let mut snap: [Vec<f64>; 2] = Default::default();
    let mut verify: [Vec<f64>; 2] = Default::default();
    let mut round_total: [[Vec<f64>; K + 1]; 2] = Default::default();
    let mut plain_step = Vec::new();
    let modes = [Rollback::Replay, Rollback::Reforward];
    pool.install(|| {
        for pr in &prompts {
            let n_ctx = pr.len() + n_gen + 16;
            // the oracle: plain greedy continuation (and the plain step time)
            let mut st = SeqState::new(&B, &cfg, n_ctx).unwrap();
            let mut lg = prefill(&cfg, &w, &mut st, pr);
            let mut s = Sampler::new(SamplerParams::greedy());
            let mut gen = Vec::with_capacity(n_gen);
            for _ in 0..n_gen {
                let x = s.sample(&lg);
                s.accept(x.id);
                gen.push(x.id);
                let t = Instant::now();
                lg.clear();
                forward(
                    &B,
                    &cfg,
                    &w,
                    &mut st,
                    &[x.id],
                    GdnMode::Recurrent,
                    LogitRows::Last,
                    &mut lg,
                    Capture::none(),
                )
                .unwrap();
                plain_step.push(t.elapsed().as_secs_f64());
            }
            let mut bufs = RoundBufs::new(&B, &cfg, K + 1).unwrap();
            for pass in 0..passes {
                for m in 0..2 {
                    // alternate which option goes first in each pass
                    let mi = (m + pass) % 2;
                    let mut st = SeqState::new(&B, &cfg, n_ctx).unwrap();
                    prefill(&cfg, &w, &mut st, pr);
                    let mut s = Sampler::new(SamplerParams::greedy());
                    s.accept(gen[0]);
                    let (mut i, mut r) = (0, 0);
                    while i + K + 1 < gen.len() {
                        let k = r % (K + 1);
                        let mut draft = gen[i + 1..i + 1 + K].to_vec();
                        if k < K {
                            draft[k] = (draft[k] + 1) % text;
                        }
                        let t = Instant::now();
                        let out = verify_round(
                            &B,
                            &cfg,
                            &w,
                            &mut st,
                            &mut bufs,
                            &mut s,
                            gen[i],
                            &draft,
                            Some(&taps),
                            modes[mi],
                        )
                        .unwrap();
                        let total = t.elapsed().as_secs_f64();
                        assert_eq!(out.n_acc, k, "oracle drafts accept exactly k");
                        let got: Vec<u32> = out.tokens.iter().map(|x| x.id).collect();
                        assert_eq!(
                            got,
                            gen[i + 1..i + 2 + k],
                            "speculative tokens = plain greedy"
                        );
                        assert_eq!(st.pos, pr.len() + i + k + 1);
                        rb[mi][k].push(out.timing.rollback_s);
                        round_total[mi][k].push(total);
                        snap[mi].push(out.timing.snapshot_s);
                        verify[mi].push(out.timing.verify_s);
                        i += k + 1;
                        r += 1;
                    }
                }
            }
        }
    });
    let load1 = loadavg();
    let mut mode_json = Vec::new();
    for (mi, name) in ["replay", "reforward"].iter().enumerate() {
        let per_k: Vec<String> = (0..=K)
            .map(|k| {
                format!(
                    "\"{k}\": {{\"rollback\": {}, \"round\": {}}}",
                    stat_json(&mut rb[mi][k]),
                    stat_json(&mut round_total[mi][k])
                )
            })
            .collect();
        mode_json.push(format!(
            "\"{name}\": {{\"snapshot\": {}, \"verify\": {}, \"by_accept\": {{{}}}}}",
            stat_json(&mut snap[mi]),
            stat_json(&mut verify[mi]),
            per_k.join(", ")
        ));
    }
    let json = format!(
        "{{\"target\": \"{path}\", \"threads\": {threads}, \"passes\": {passes}, \"prompts\": {}, \
         \"gen\": {n_gen}, \"loadavg_start\": \"{load0}\", \"loadavg_end\": \"{load1}\", \
         \"plain_step\": {}, \"modes\": {{{}}}}}",
        prompts.len(),
        stat_json(&mut plain_step),
        mode_json.join(", ")
    );
    println!("{json}");
    if let Ok(out) = std::env::var("BONSAI_ROLLBACK_OUT") {
        std::fs::write(out, json + "\n").unwrap();
    }
}
