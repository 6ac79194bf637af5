//! GPU round-cost benchmark of speculative decoding on CUDA: R = (round time) / (plain step time).
//!
//! Runs only when `$BONSAI_SPEC_BENCH_MODEL` names a target GGUF and a CUDA device exists;
//! otherwise prints SKIPPED. `$BONSAI_SPEC_BENCH_DRAFTER` (optional) names a matching DSpark drafter
//! (a `--sparse` synthetic drafter is fine: the timing does not depend on the weight values).
//! Writes a JSON record to `$BONSAI_SPEC_BENCH_OUT` (default: stdout only). Driven by
//! scripts/gpu_check.sh.
//!
//! Measured, every time with the stream synchronized before and after (wall clock, medians):
//! - the plain step a greedy request runs with no proposer, the denominator of every R:
//!   `decode_step_stats` without the logits row (one CUDA graph replay; argmax and log-sum-exp on
//!   the device, 16 bytes back). Also, for reference: the same graph with the row copied to the
//!   host and sampled there (`plain_step_row_ms`; R was quoted against this one up to 14d7d06,
//!   which flattered it by ~20 %), and the eager one-row forward with DSpark taps;
//! - a verify round for every accept count k = 0..=4 (oracle drafts: the plain greedy continuation
//!   with draft k corrupted), replay and re-forward rollback, without and with taps: snapshot +
//!   verify (n = 5, records, logits of 5 rows) + accept + rollback;
//! - the proposers: the n-gram search, and the DSpark drafter's `draft` + `stage` on the GPU
//!   (`backend::cuda_drafter`; `BONSAI_GPU_DRAFTER=0` times the host drafter instead). The draft
//!   time is the drafter's own time per draft (4 tokens), reported as `draft_ms`.
//!
//! R per proposer and k is (proposer + round) / plain step; a proposer pays when the tokens per
//! round (k + 1) exceed R.
//!
//! Every round measurement runs twice: eager (the default) and with the round graphs
//! (`CudaBackend::set_round_graph`, i.e. `BONSAI_CUDA_ROUND_GRAPH=1`: verify, snapshot and
//! rollback replayed as captured graphs, greedy rows picked from device statistics). The JSON
//! marks each round entry with `round_graph`; `ngram.R_by_k_replay_graph` and `dspark_graph` are
//! the graph side; `BENCH round graph gain` lines give eager / graph per k.

mod common;

use std::sync::Arc;
use std::time::Instant;

use bonsai_engine::backend::cuda::CudaBackend;
use bonsai_engine::backend::cuda_drafter::{CudaDraftState, CudaDrafter};
use bonsai_engine::backend::{Backend, GdnMode};
use bonsai_engine::config::TargetConfig;
use bonsai_engine::drafter::{DraftState, Drafter};
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::{forward, Capture, LogitRows, SeqState, TapRequest, Weights};
use bonsai_engine::sampling::{RowNeed, Sampler, SamplerParams};
use bonsai_engine::spec::{ngram_draft, verify_round, Rollback, RoundBufs, RoundOut};

const K: usize = 4;

/// The drafter under test: on the GPU (default) or on the host (`BONSAI_GPU_DRAFTER=0`).
enum Dr {
    Host(Box<Drafter>),
    Gpu(Box<CudaDrafter>),
}

enum DrState {
    Host(DraftState),
    Gpu(Box<CudaDraftState>),
}

impl Dr {
    fn label(&self) -> &'static str {
        match self {
            Dr::Host(_) => "host drafter",
            Dr::Gpu(_) => "GPU drafter",
        }
    }
    fn target_layers(&self) -> &[usize] {
        match self {
            Dr::Host(d) => &d.cfg.target_layers,
            Dr::Gpu(d) => &d.cfg.target_layers,
        }
    }
    fn tap_width(&self) -> usize {
        match self {
            Dr::Host(d) => d.tap_width(),
            Dr::Gpu(d) => d.tap_width(),
        }
    }
    fn new_state(&self) -> DrState {
        match self {
            Dr::Host(d) => DrState::Host(d.new_state()),
            Dr::Gpu(d) => DrState::Gpu(Box::new(d.new_state().unwrap())),
        }
    }
    fn stage(&self, st: &mut DrState, taps: &[f32], pos0: usize, n: usize) {
        match (self, st) {
            (Dr::Host(d), DrState::Host(s)) => d.stage(s, taps, pos0, n).unwrap(),
            (Dr::Gpu(d), DrState::Gpu(s)) => d.stage(s, taps, pos0, n).unwrap(),
            _ => unreachable!("state of another drafter"),
        }
    }
    /// Stages the `keep` kept rows of a verify round at `start`: the GPU drafter takes them where
    /// the verify left them on the device (or from `taps` when the verify copied them out), the
    /// host drafter from `taps` (`keep` rows of the tap width at the front).
    fn stage_verified(
        &self,
        st: &mut DrState,
        cuda: &CudaBackend,
        taps: &[f32],
        start: usize,
        keep: usize,
    ) {
        match (self, st) {
            (Dr::Gpu(g), DrState::Gpu(s)) => {
                g.stage_verified(s, Some(cuda), taps, start, keep).unwrap()
            }
            (d, st) => d.stage(st, &taps[..keep * d.tap_width()], start, keep),
        }
    }
    /// The GPU drafter's captured draft on or off (the host drafter has none).
    fn set_graph(&self, on: bool) {
        if let Dr::Gpu(d) = self {
            d.set_graph(on);
        }
    }
    /// The GPU drafter's captured stage on or off.
    fn set_stage_graph(&self, on: bool) {
        if let Dr::Gpu(d) = self {
            d.set_stage_graph(on);
        }
    }
    fn draft(&self, st: &mut DrState, id_last: u32, start: usize) -> Vec<u32> {
        match (self, st) {
            (Dr::Host(d), DrState::Host(s)) => d.draft(s, id_last, start).unwrap(),
            (Dr::Gpu(d), DrState::Gpu(s)) => d.draft(s, id_last, start).unwrap(),
            _ => unreachable!("state of another drafter"),
        }
    }
}
/// Timed rounds per accept count (after one warm-up round).
const ROUNDS: usize = 6;

/// One DSpark round at `st.pos`, each part timed with the stream drained: the draft from
/// `id_last`, the verify round (taps of the drafter's layers, replay rollback) and the staging of
/// the kept rows' taps. Returns the round and (draft, verify, stage) seconds.
#[allow(clippy::too_many_arguments)]
fn timed_dspark_round(
    cuda: &CudaBackend,
    cfg: &TargetConfig,
    w: &Weights<CudaBackend>,
    st: &mut SeqState<CudaBackend>,
    bufs: &mut RoundBufs<CudaBackend>,
    s: &mut Sampler,
    d: &Dr,
    ds: &mut DrState,
    id_last: u32,
) -> (RoundOut, [f64; 3]) {
    let start = st.pos;
    let (draft, sd) = timed(cuda, || d.draft(ds, id_last, start));
    let (out, sr) = timed(cuda, || {
        verify_round(
            cuda,
            cfg,
            w,
            st,
            bufs,
            s,
            id_last,
            &draft,
            Some(d.target_layers()),
            Rollback::Replay,
        )
        .unwrap()
    });
    // the kept rows' taps from the host copy, or where the verify left them on the device
    let ((), ss) = timed(cuda, || {
        d.stage_verified(ds, cuda, &bufs.taps, start, out.n_acc + 1)
    });
    (out, [sd, sr, ss])
}

fn median_ms(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    1e3 * v[v.len() / 2]
}

/// Wall seconds of `f`, with the GPU stream drained before and after.
fn timed<T>(cuda: &CudaBackend, f: impl FnOnce() -> T) -> (T, f64) {
    cuda.gpu().sync().unwrap();
    let t = Instant::now();
    let r = f();
    cuda.gpu().sync().unwrap();
    (r, t.elapsed().as_secs_f64())
}

/// DSpark rounds as the engine runs them (the defaults: round graphs, the draft graph, the kept
/// rows staged from device memory): draft, verify round, stage, the next draft, ... with nothing
/// drained between them but what the engine waits for itself (the draft's ids, the verify's
/// statistics). `rounds` rounds after one warm-up, from a fresh state on `prompt`; returns ms per
/// round and the accepted drafts.
#[allow(clippy::too_many_arguments)]
fn pipelined_dspark_ms(
    cuda: &CudaBackend,
    cfg: &TargetConfig,
    w: &Weights<CudaBackend>,
    prompt: &[u32],
    n_ctx: usize,
    d: &Dr,
    rounds: usize,
) -> (f64, usize) {
    let mut st = SeqState::new(cuda, cfg, n_ctx).unwrap();
    let mut ds = d.new_state();
    let mut lg = Vec::new();
    let taps = common::prefill_with_taps(cuda, cfg, w, &mut st, prompt, d.target_layers(), &mut lg);
    d.stage(&mut ds, &taps, 0, prompt.len());
    let mut s = Sampler::new(SamplerParams::greedy());
    let first = s.sample(&lg);
    s.accept(first.id);
    let mut id_last = first.id;
    let mut bufs = RoundBufs::new(cuda, cfg, K + 1).unwrap();
    let mut acc = 0;
    let mut t0 = Instant::now();
    for r in 0..=rounds {
        if r == 1 {
            cuda.gpu().sync().unwrap();
            t0 = Instant::now();
        }
        let start = st.pos;
        let draft = d.draft(&mut ds, id_last, start);
        let out = verify_round(
            cuda,
            cfg,
            w,
            &mut st,
            &mut bufs,
            &mut s,
            id_last,
            &draft,
            Some(d.target_layers()),
            Rollback::Replay,
        )
        .unwrap();
        d.stage_verified(&mut ds, cuda, &bufs.taps, start, out.n_acc + 1);
        id_last = out.tokens.last().unwrap().id;
        if r > 0 {
            acc += out.n_acc;
        }
    }
    cuda.gpu().sync().unwrap();
    (1e3 * t0.elapsed().as_secs_f64() / rounds as f64, acc)
}

/// One pipelined-round row of a fork A/B: the repetition, whether the rollback replay was forked,
/// ms per round and the drafts accepted.
struct ForkRow {
    rep: usize,
    fork: bool,
    ms: f64,
    acc: usize,
}

/// `run` (a [`pipelined_dspark_ms`] measurement: ms per round, drafts accepted) with the rollback
/// replay forked onto the side stream (`Gpu::fork_replay`) and on one stream, alternating `reps`
/// times in this process; the forked setting is restored after.
fn fork_ab_rows(
    cuda: &CudaBackend,
    reps: usize,
    mut run: impl FnMut() -> (f64, usize),
) -> Vec<ForkRow> {
    let was = cuda.gpu().fork_replay();
    let mut rows = Vec::new();
    for rep in 0..reps {
        for fork in [true, false] {
            cuda.gpu().set_fork_replay(fork);
            let (ms, acc) = run();
            rows.push(ForkRow { rep, fork, ms, acc });
        }
    }
    cuda.gpu().set_fork_replay(was);
    rows
}

/// The target model of a round bench: loaded, and a 32-token prompt of ids below `text` run
/// through `base` (chunked GDN) with its last logits row `lg0`.
struct Target {
    cuda: CudaBackend,
    g: Arc<Gguf>,
    cfg: TargetConfig,
    w: Weights<CudaBackend>,
    n_ctx: usize,
    text: u32,
    prompt: Vec<u32>,
    base: SeqState<CudaBackend>,
    lg0: Vec<f32>,
}

impl Target {
    fn load(path: &str) -> Target {
        let cuda = CudaBackend::new(0).unwrap();
        let g = Arc::new(Gguf::open(std::path::Path::new(path)).unwrap());
        let cfg = TargetConfig::from_gguf(&g).unwrap();
        let w = Weights::load(&cuda, &g, &cfg).unwrap();
        let n_ctx = 1024;
        let text = 8000.min(cfg.n_vocab as u32 - 8);
        let prompt: Vec<u32> = (0..32u32)
            .map(|i| (i.wrapping_mul(2654435761).wrapping_add(13)) % text)
            .collect();
        let mut base = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
        let mut lg0 = Vec::new();
        forward(
            &cuda,
            &cfg,
            &w,
            &mut base,
            &prompt,
            GdnMode::Chunked,
            LogitRows::Last,
            &mut lg0,
            Capture::none(),
        )
        .unwrap();
        Target {
            cuda,
            g,
            cfg,
            w,
            n_ctx,
            text,
            prompt,
            base,
            lg0,
        }
    }
}

/// Prints `{"model", "weight_type", "device", <fields>, "rows": [rows]}` after `tag` and writes it
/// to the file that `$env` names, if set: the JSON record of an A/B bench.
fn emit_rows(t: &Target, path: &str, (tag, env): (&str, &str), fields: &str, rows: &[String]) {
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", {fields}, \"rows\": [{}]}}",
        t.cfg.weight_type.name(),
        t.cuda.name(),
        rows.join(", ")
    );
    println!("{tag} {json}");
    if let Ok(out) = std::env::var(env) {
        std::fs::write(out, &json).unwrap();
    }
}

/// The target of the round benches (`BONSAI_SPEC_BENCH_MODEL`, loaded with round graphs on) and
/// its greedy first token; `None` where the test is skipped.
fn round_target(test: &str) -> Option<(String, Target, u32)> {
    let path = common::cuda_bench_model(test, "BONSAI_SPEC_BENCH_MODEL")?;
    let t = Target::load(&path);
    t.cuda.set_round_graph(true);
    let first = Sampler::new(SamplerParams::greedy()).sample(&t.lg0).id;
    Some((path, t, first))
}

/// The kernels of `names` that are not mat-vecs (nor the profiling spin): what the round benches
/// skip to time the mat-vecs alone.
fn non_matvec<'a>(names: &[&'a str]) -> Vec<&'a str> {
    names
        .iter()
        .copied()
        .filter(|n| !n.starts_with("mv") && *n != "spin_ns")
        .collect()
}

/// The kernels of `names` whose name starts with one of `prefixes`.
fn with_prefix<'a>(names: &[&'a str], prefixes: &[&str]) -> Vec<&'a str> {
    names
        .iter()
        .copied()
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
        .collect()
}

/// Median ms of ROUNDS `verify_round`s (after one warm-up) from the prompt state with `params`'
/// sampler: round graphs, no taps, replay rollback, K drafts the target rejects at once (not its
/// continuation, whatever the launches left out make of the logits); the accept on the host is
/// included.
fn rejected_rounds_ms(t: &Target, first: u32, params: &SamplerParams) -> f64 {
    rejected_rounds_ms_n(t, first, params, K)
}

/// [`rejected_rounds_ms`] with `nd` drafts (a verify of `nd + 1` rows).
fn rejected_rounds_ms_n(t: &Target, first: u32, params: &SamplerParams, nd: usize) -> f64 {
    let (cuda, cfg) = (&t.cuda, &t.cfg);
    let mut st = SeqState::new(cuda, cfg, t.n_ctx).unwrap();
    st.copy_from(cuda, &t.base);
    let mut bufs = RoundBufs::new(cuda, cfg, K + 1).unwrap();
    let mut s = Sampler::new(params.clone());
    let mut id_last = first;
    let mut tr = Vec::new();
    for r in 0..=ROUNDS {
        let (next, secs) = timed(cuda, || {
            rejected_round(t, &mut st, &mut bufs, &mut s, id_last, nd)
        });
        id_last = next;
        if r > 0 {
            tr.push(secs);
        }
    }
    median_ms(&mut tr)
}

/// One `verify_round` of `nd` drafts the target rejects at once (tokens after `id_last`, not its
/// continuation), no taps, replay rollback; returns the round's last token.
fn rejected_round(
    t: &Target,
    st: &mut SeqState<CudaBackend>,
    bufs: &mut RoundBufs<CudaBackend>,
    s: &mut Sampler,
    id_last: u32,
    nd: usize,
) -> u32 {
    let draft: Vec<u32> = (0..nd as u32).map(|j| (id_last + 1 + j) % t.text).collect();
    let out = verify_round(
        &t.cuda,
        &t.cfg,
        &t.w,
        st,
        bufs,
        s,
        id_last,
        &draft,
        None,
        Rollback::Replay,
    )
    .unwrap();
    out.tokens.last().map_or(id_last, |x| x.id)
}

/// (round ms, plain step ms) of the what-if's round (round graphs, no taps, replay rollback, K
/// drafts the target rejects at once): medians over ROUNDS rounds / steps after one warm-up each.
fn round_and_step(t: &Target, first: u32) -> (f64, f64) {
    round_and_step_n(t, first, K)
}

/// [`round_and_step`] with rounds of `nd` drafts.
fn round_and_step_n(t: &Target, first: u32, nd: usize) -> (f64, f64) {
    let round = rejected_rounds_ms_n(t, first, &SamplerParams::greedy(), nd);
    (round, greedy_step_ms(t, first))
}

/// Median ms of ROUNDS greedy decode steps (the decode graph without the logits row) from the
/// prompt state, after one warm-up step.
fn greedy_step_ms(t: &Target, first: u32) -> f64 {
    let (cuda, cfg, w) = (&t.cuda, &t.cfg, &t.w);
    let mut st = SeqState::new(cuda, cfg, t.n_ctx).unwrap();
    st.copy_from(cuda, &t.base);
    let mut lg = Vec::new();
    let mut tp = Vec::new();
    let mut id = first;
    for i in 0..=ROUNDS {
        let (stats, secs) = timed(cuda, || {
            cuda.decode_step_stats(cfg, w, &mut st, id, &mut lg, false)
                .unwrap()
        });
        id = stats.map_or(0, |x| x.argmax) % t.text;
        if i > 0 {
            tp.push(secs);
        }
    }
    median_ms(&mut tp)
}

/// [`round_and_step`], then the same with the kernels `other` skipped (the mat-vecs alone):
/// (round, step, mat-vec round, mat-vec step) in ms.
fn with_matvecs_alone(t: &Target, first: u32, other: &[&str]) -> (f64, f64, f64, f64) {
    let gpu = t.cuda.gpu();
    let (round, step) = round_and_step(t, first);
    gpu.set_skip_kernels(other).unwrap();
    let (mv_round, mv_step) = round_and_step(t, first);
    gpu.set_skip_kernels(&[]).unwrap();
    (round, step, mv_round, mv_step)
}

/// The int8 tensor-core verify (`Gpu::b1q`) against the 5-row b1-plane kernels, then the
/// out-projections on b1-plane activations too (`Gpu::b1p_out`: ssm_out, ffn_down): the what-if's
/// round and the greedy step, alternating the switches in one process (twice), with the round's mat-vecs
/// alone (every other kernel skipped) too; then, with the defaults, what each mat-vec family
/// costs. The b1p_out rows need `BONSAI_CUDA_B1P_OUT=1` at load (the out-projections' b1-plane
/// layouts; without it they run the int8 path, and the bench says so). `BONSAI_B1Q_OUT` gets the
/// JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_b1q_round_ab() {
    let Some((path, t, first)) = round_target("cuda_b1q_round_ab") else {
        return;
    };
    let (cuda, cfg) = (&t.cuda, &t.cfg);
    let gpu = cuda.gpu();
    let names = gpu.kernel_names();
    let other = non_matvec(&names);
    let out0 = gpu.b1p_out();
    if !out0 {
        println!("B1Q note: BONSAI_CUDA_B1P_OUT=1 was not set at load: the b1p_out rows run the int8 path");
    }
    let mut rows = Vec::new();
    for rep in 0..2 {
        for (on, out) in [(false, false), (true, false), (true, true)] {
            gpu.set_b1q(on);
            gpu.set_b1p_out(out);
            let (round, step, mv_round, mv_step) = with_matvecs_alone(&t, first, &other);
            println!(
                "B1Q rep {rep} b1q {on:<5} b1p_out {out:<5} round {round:.3} ms, step {step:.3} ms, R {:.3}; mat-vecs alone: round {mv_round:.3} ms, step {mv_step:.3} ms",
                round / step
            );
            rows.push(format!(
                "{{\"b1q\": {on}, \"b1p_out\": {out}, \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}, \"matvec_round_ms\": {mv_round:.4}, \"matvec_step_ms\": {mv_step:.4}}}",
                round / step
            ));
        }
    }
    // the defaults for the rest
    gpu.set_b1q(true);
    gpu.set_b1p_out(false);
    // with it on: what the verify's b1-plane launches and the other mat-vec families cost
    let (round0, _) = round_and_step(&t, first);
    let mut split = Vec::new();
    for prefix in ["mvbq_", "mvbp_", "mv_q1_", "mv_q2_", "mvs_", "mvp_"] {
        let set = with_prefix(&names, &[prefix]);
        gpu.set_skip_kernels(&set).unwrap();
        let (round, step) = round_and_step(&t, first);
        gpu.set_skip_kernels(&[]).unwrap();
        println!(
            "B1Q without {prefix:<8} round {round:.3} ms ({:+.3} of {round0:.3}), step {step:.3} ms",
            round0 - round
        );
        split.push(format!(
            "{{\"skipped\": \"{prefix}*\", \"round_ms\": {round:.4}, \"round_saved_ms\": {:.4}, \"step_ms\": {step:.4}}}",
            round0 - round
        ));
    }
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\", \"b1p_out_layouts\": {out0}, \"b1q_tiles_env\": \"{}\", \"rows\": [{}], \"b1q_on_round_ms\": {round0:.4}, \"without\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        std::env::var("BONSAI_CUDA_B1Q_R").unwrap_or_default(),
        rows.join(", "),
        split.join(", ")
    );
    println!("B1Q {json}");
    if let Ok(out) = std::env::var("BONSAI_B1Q_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}

/// The round's GDN snapshot written by the verify's fused GDN kernels and read by the rollback's
/// replay (`CudaBackend::snap_fused`, the default) against a copy of every layer before the
/// verify and a restore copy before the replay, and the verify GDN kernel's gated norm of all
/// rows after the recurrence (`Gpu::gdn_norm_batch`, the default) against a cluster exchange
/// per row: the what-if's round and the greedy step, alternating in one process (three times
/// each). `BONSAI_SNAP_AB_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_snap_round_ab() {
    let Some((path, t, first)) = round_target("cuda_snap_round_ab") else {
        return;
    };
    let cuda = &t.cuda;
    let mut rows = Vec::new();
    for rep in 0..3 {
        // (snapshot fused, the verify GDN kernel's gated norm batched): both on is the default
        for (fused, bn) in [(true, true), (true, false), (false, false)] {
            cuda.set_snap_fused(fused);
            cuda.gpu().set_gdn_norm_batch(bn);
            let (round, step) = round_and_step(&t, first);
            println!(
                "SNAPAB rep {rep} snap_fused {fused:<5} gdn_norm_batch {bn:<5} round {round:.3} ms, step {step:.3} ms, R {:.3}",
                round / step
            );
            rows.push(format!(
                "{{\"snap_fused\": {fused}, \"gdn_norm_batch\": {bn}, \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}}}",
                round / step
            ));
        }
    }
    cuda.set_snap_fused(true);
    cuda.gpu().set_gdn_norm_batch(true);
    emit_rows(
        &t,
        &path,
        ("SNAPAB", "BONSAI_SNAP_AB_OUT"),
        "\"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\"",
        &rows,
    );
}

/// The row-split dp4a verify kernels (`Gpu::mv_rsplit`: 4- and 5-row launches over 2 blocks of 3
/// activation rows) against the 5-row kernels, at 4 and 8 weight rows per warp: the what-if's
/// round and the greedy step, and both with every other kernel skipped (the mat-vecs alone),
/// alternating in one process (three times each). `BONSAI_RSPLIT_AB_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_rsplit_round_ab() {
    let Some((path, t, first)) = round_target("cuda_rsplit_round_ab") else {
        return;
    };
    let cuda = &t.cuda;
    let gpu = cuda.gpu();
    let names = gpu.kernel_names();
    let other = non_matvec(&names);
    let mut rows = Vec::new();
    // (row split, verify rows per warp; None: the kind's default)
    let modes = [
        (None, None),
        (Some(false), None),
        (Some(true), Some(4)),
        (Some(true), Some(8)),
        (Some(false), Some(4)),
    ];
    for rep in 0..3 {
        for (split, rn) in modes {
            gpu.set_mv_rsplit(split);
            gpu.set_mv_verify(rn, None);
            let (round, step, mv_round, mv_step) = with_matvecs_alone(&t, first, &other);
            let rn_s = rn.map_or("default".to_string(), |r| r.to_string());
            let split = split.map_or("default".to_string(), |v| v.to_string());
            println!(
                "RSPLITAB rep {rep} rsplit {split:<7} rn {rn_s:<7} round {round:.3} ms, step {step:.3} ms, R {:.3}; mat-vecs alone: round {mv_round:.3} ms, step {mv_step:.3} ms",
                round / step
            );
            rows.push(format!(
                "{{\"rsplit\": \"{split}\", \"rn\": \"{rn_s}\", \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}, \"matvec_round_ms\": {mv_round:.4}, \"matvec_step_ms\": {mv_step:.4}}}",
                round / step
            ));
        }
    }
    gpu.set_mv_rsplit(None);
    gpu.set_mv_verify(None, None);
    emit_rows(
        &t,
        &path,
        ("RSPLITAB", "BONSAI_RSPLIT_AB_OUT"),
        "\"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\"",
        &rows,
    );
}

/// One sampler's cost through the engine's paths: the round ([`rejected_rounds_ms`]) and the
/// plain step (`decode_step_top` / `decode_step_stats` as `RowNeed` asks, then the host pick),
/// medians in ms over ROUNDS each after one warm-up.
fn sampled_round_and_step(t: &Target, first: u32, params: &SamplerParams) -> (f64, f64) {
    let (cuda, cfg, w) = (&t.cuda, &t.cfg, &t.w);
    let round = rejected_rounds_ms(t, first, params);
    let mut st = SeqState::new(cuda, cfg, t.n_ctx).unwrap();
    st.copy_from(cuda, &t.base);
    let mut s = Sampler::new(params.clone());
    let (mut lg, mut top) = (Vec::new(), Vec::new());
    let mut id = first;
    let mut tp = Vec::new();
    for i in 0..=ROUNDS {
        let (x, secs) = timed(cuda, || {
            let stats = match s.row_need() {
                RowNeed::Top(n) => cuda
                    .decode_step_top(cfg, w, &mut st, id, n, &mut lg, &mut top)
                    .unwrap(),
                need => cuda
                    .decode_step_stats(cfg, w, &mut st, id, &mut lg, need == RowNeed::Row)
                    .unwrap(),
            };
            match stats.and_then(|x| s.sample_from_top(&x, &top, cfg.n_vocab)) {
                Some(x) => x,
                None => s.sample(&lg),
            }
        });
        s.accept(x.id);
        id = x.id % t.text;
        if i > 0 {
            tp.push(secs);
        }
    }
    (round, median_ms(&mut tp))
}

/// What sampling costs on the device paths: greedy (statistics only), a top-k draw (T 0.7,
/// top-k 20, top-p 0.95: each row's 64 best entries from `topk_rows` in the graphs), and the same
/// draw with a zero logit bias (the sampler reads the whole rows: copied to pinned memory and
/// scanned on the host): the round and the plain step of [`sampled_round_and_step`], alternating
/// in one process (three times each). `BONSAI_SAMPLED_AB_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_sampled_round_ab() {
    let Some((path, t, first)) = round_target("cuda_sampled_round_ab") else {
        return;
    };
    let top_k = SamplerParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.95,
        seed: 7,
        ..Default::default()
    };
    let rows_read = SamplerParams {
        logit_bias: vec![(0, 0.0)],
        ..top_k.clone()
    };
    let modes = [
        ("greedy", SamplerParams::greedy()),
        ("top-k entries", top_k),
        ("top-k rows", rows_read),
    ];
    let mut rows = Vec::new();
    for rep in 0..3 {
        for (name, params) in &modes {
            let (round, step) = sampled_round_and_step(&t, first, params);
            println!(
                "SAMPLEDAB rep {rep} {name:<18} round {round:.3} ms, step {step:.3} ms ({:.1} tok/s)",
                1e3 / step
            );
            rows.push(format!(
                "{{\"sampler\": \"{name}\", \"need\": \"{:?}\", \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"step_tok_s\": {:.2}}}",
                Sampler::new(params.clone()).row_need(),
                1e3 / step
            ));
        }
    }
    emit_rows(
        &t,
        &path,
        ("SAMPLEDAB", "BONSAI_SAMPLED_AB_OUT"),
        "\"round\": \"verify_round with round graphs, no taps, replay rollback, 4 drafts rejected at once, host accept included\", \"step\": \"decode graph + host pick, as the engine runs it\"",
        &rows,
    );
}

/// The round's GDN bookkeeping launches: the rollback's replay as one `gdn_replay_layers` launch
/// over every layer (`replay_layers`) against one `gdn_replay` launch per layer, and the verify
/// record written by the fused GDN kernel (`rec_fused`) against a `gdn_rec_write` launch per
/// layer, each with `kernels/spec.cu`'s kernels launched plainly and with programmatic dependent
/// launch (`Gpu::spec_pdl`). Greedy rounds whose 4 drafts are all rejected (a 5-row verify, then
/// the replay of 1 row), round graphs on, the five settings alternating in one process (four
/// times each).
/// `BONSAI_REPLAY_AB_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_replay_round_ab() {
    let Some((path, t, first)) = round_target("cuda_replay_round_ab") else {
        return;
    };
    let gpu = t.cuda.gpu();
    let (layers0, rec0, sp0) = (
        t.cuda.replay_layers(),
        t.cuda.rec_fused_mode(),
        gpu.spec_pdl(),
    );
    let mut rows = Vec::new();
    for rep in 0..4 {
        for (layers, rec, sp) in [
            (false, false, false),
            (true, false, false),
            (true, true, false),
            (true, false, true),
            (true, true, true),
        ] {
            t.cuda.set_replay_layers(layers);
            t.cuda.set_rec_fused(Some(rec));
            gpu.set_spec_pdl(sp);
            let round = rejected_rounds_ms(&t, first, &SamplerParams::greedy());
            println!(
                "REPLAYAB rep {rep} replay_layers {layers:<5} rec_fused {rec:<5} spec_pdl {sp:<5} round {round:.3} ms"
            );
            rows.push(format!(
                "{{\"replay_layers\": {layers}, \"rec_fused\": {rec}, \"spec_pdl\": {sp}, \"round_ms\": {round:.4}}}"
            ));
        }
    }
    t.cuda.set_replay_layers(layers0);
    t.cuda.set_rec_fused(rec0);
    gpu.set_spec_pdl(sp0);
    emit_rows(
        &t,
        &path,
        ("REPLAYAB", "BONSAI_REPLAY_AB_OUT"),
        "\"round\": \"verify_round with round graphs, no taps, replay rollback of 1 row, 4 drafts rejected at once, host accept included\"",
        &rows,
    );
}

/// The RMS norms without their int8 codes where every consumer reads the b1-plane activations
/// (`Gpu::norm_p16_only`), then also without the planes where only the int8 tensor-core verify
/// reads the rows (`Gpu::norm_b1q_only`), against the norms writing everything, and then 2 and 4
/// segments per norm block (`Gpu::norm_segs`): the what-if's rejected round and the greedy step,
/// alternating in one process (four times). `BONSAI_NORM_AB_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_norm_p16_round_ab() {
    let Some((path, t, first)) = round_target("cuda_norm_p16_round_ab") else {
        return;
    };
    let gpu = t.cuda.gpu();
    let (on0, b1q0, segs0) = (gpu.norm_p16_only(), gpu.norm_b1q_only(), gpu.norm_segs());
    let mut rows = Vec::new();
    for rep in 0..4 {
        for (on, b1q, segs) in [
            (false, false, 1),
            (true, false, 1),
            (true, true, 1),
            (true, true, 2),
            (true, true, 4),
        ] {
            gpu.set_norm_p16_only(on);
            gpu.set_norm_b1q_only(b1q);
            gpu.set_norm_segs(segs);
            let (round, step) = round_and_step(&t, first);
            println!(
                "NORMAB rep {rep} norm_p16_only {on:<5} norm_b1q_only {b1q:<5} norm_segs {segs} round {round:.3} ms, step {step:.3} ms, R {:.3}",
                round / step
            );
            rows.push(format!(
                "{{\"norm_p16_only\": {on}, \"norm_b1q_only\": {b1q}, \"norm_segs\": {segs}, \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}}}",
                round / step
            ));
        }
    }
    gpu.set_norm_p16_only(on0);
    gpu.set_norm_b1q_only(b1q0);
    gpu.set_norm_segs(segs0);
    emit_rows(
        &t,
        &path,
        ("NORMAB", "BONSAI_NORM_AB_OUT"),
        "\"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\", \"step\": \"greedy decode graph\"",
        &rows,
    );
}

/// The dp4a 5-row verify kernels' rows-first forms (`Gpu::mv_rows_first`, the default) against
/// their plain forms, and (for Q2_0, whose default is the row split) both with the row split off:
/// the what-if's rejected round and the greedy step, alternating in one process (four times).
/// `BONSAI_RF_AB_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_rows_first_round_ab() {
    let Some((path, t, first)) = round_target("cuda_rows_first_round_ab") else {
        return;
    };
    let gpu = t.cuda.gpu();
    let saved = gpu.mv_rows_first();
    // (mv_rows_first, mv_rsplit)
    let configs: [(bool, Option<bool>); 4] = [
        (false, None),
        (true, None),
        (false, Some(false)),
        (true, Some(false)),
    ];
    let mut rows = Vec::new();
    for rep in 0..4 {
        for (rf, rsplit) in configs {
            gpu.set_mv_rows_first(rf);
            gpu.set_mv_rsplit(rsplit);
            let (round, step) = round_and_step(&t, first);
            let split = rsplit.map_or("default".to_string(), |v| v.to_string());
            println!(
                "RFAB rep {rep} mv_rows_first {rf:<5} mv_rsplit {split:<7} round {round:.3} ms, step {step:.3} ms, R {:.3}",
                round / step
            );
            rows.push(format!(
                "{{\"mv_rows_first\": {rf}, \"mv_rsplit\": \"{split}\", \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}}}",
                round / step
            ));
        }
    }
    gpu.set_mv_rows_first(saved);
    gpu.set_mv_rsplit(None);
    emit_rows(
        &t,
        &path,
        ("RFAB", "BONSAI_RF_AB_OUT"),
        "\"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\", \"step\": \"greedy decode graph\"",
        &rows,
    );
}

/// The int8 tensor-core verify's AHEAD form (`Gpu::b1q_ahead`, the default: each block's
/// activation operands loaded a block ahead, the weights not allocated in L1) against the plain
/// form: the what-if's rejected round and the greedy step, alternating in one process (four
/// times). `BONSAI_B1Q_AHEAD_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_b1q_ahead_round_ab() {
    let Some((path, t, first)) = round_target("cuda_b1q_ahead_round_ab") else {
        return;
    };
    let gpu = t.cuda.gpu();
    let saved = gpu.b1q_ahead();
    let mut rows = Vec::new();
    for rep in 0..4 {
        for ahead in [false, true] {
            gpu.set_b1q_ahead(ahead);
            let (round, step) = round_and_step(&t, first);
            println!(
                "B1QAHEAD rep {rep} b1q_ahead {ahead:<5} round {round:.3} ms, step {step:.3} ms, R {:.3}",
                round / step
            );
            rows.push(format!(
                "{{\"b1q_ahead\": {ahead}, \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}}}",
                round / step
            ));
        }
    }
    gpu.set_b1q_ahead(saved);
    emit_rows(
        &t,
        &path,
        ("B1QAHEAD", "BONSAI_B1Q_AHEAD_OUT"),
        "\"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\", \"step\": \"greedy decode graph\"",
        &rows,
    );
}

/// The producer-warp GDN verify kernel (`Gpu::gdn_producer`, the default since 2026-12-08:
/// `gdn_conv_step_norm_bn_pw_d128`) against the 128-thread batched-norm kernel
/// (`gdn_conv_step_norm_bn_early_d128`): the what-if's rejected round and the greedy step,
/// alternating in one process (four times). `BONSAI_GDN_PW_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_gdn_pw_round_ab() {
    let Some((path, t, first)) = round_target("cuda_gdn_pw_round_ab") else {
        return;
    };
    let gpu = t.cuda.gpu();
    let saved = gpu.gdn_producer();
    let mut rows = Vec::new();
    for rep in 0..4 {
        for pw in [false, true] {
            gpu.set_gdn_producer(pw);
            let (round, step) = round_and_step(&t, first);
            println!(
                "GDNPW rep {rep} gdn_producer {pw:<5} round {round:.3} ms, step {step:.3} ms, R {:.3}",
                round / step
            );
            rows.push(format!(
                "{{\"gdn_producer\": {pw}, \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}}}",
                round / step
            ));
        }
    }
    gpu.set_gdn_producer(saved);
    emit_rows(
        &t,
        &path,
        ("GDNPW", "BONSAI_GDN_PW_OUT"),
        "\"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\", \"step\": \"greedy decode graph\"",
        &rows,
    );
}

/// The b1-plane projections (`Gpu::b1p`: the norm-fed projections on the b1-plane kernels, decode
/// rows on `mvbp_*`, verify rows on `mvbq_*`; for Q2_0 the two-plane layout of `Gpu::b2p`) against
/// the dp4a kernels: the what-if's round and the greedy step, and both with every other kernel
/// skipped (the mat-vecs alone), alternating in one process (three times each).
/// `BONSAI_B1P_AB_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_b1p_round_ab() {
    let Some((path, t, first)) = round_target("cuda_b1p_round_ab") else {
        return;
    };
    let (cuda, cfg) = (&t.cuda, &t.cfg);
    if CudaBackend::b1p_only(&t.w) {
        eprintln!("SKIPPED cuda_b1p_round_ab: the norm-fed projections are held only in the b1-plane layout; run with BONSAI_CUDA_B1P_DP4A=1 (not counted as run)");
        return;
    }
    let gpu = cuda.gpu();
    let names = gpu.kernel_names();
    let other = non_matvec(&names);
    let on0 = gpu.b1p();
    let mut rows = Vec::new();
    for rep in 0..3 {
        for on in [true, false] {
            gpu.set_b1p(on);
            let (round, step, mv_round, mv_step) = with_matvecs_alone(&t, first, &other);
            println!(
                "B1PAB rep {rep} b1p {on:<5} round {round:.3} ms, step {step:.3} ms, R {:.3}; mat-vecs alone: round {mv_round:.3} ms, step {mv_step:.3} ms",
                round / step
            );
            rows.push(format!(
                "{{\"b1p\": {on}, \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}, \"matvec_round_ms\": {mv_round:.4}, \"matvec_step_ms\": {mv_step:.4}}}",
                round / step
            ));
        }
    }
    gpu.set_b1p(on0);
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"b2p_layouts\": {}, \"round\": \"round graphs, no taps, replay rollback, 4 drafts, first wrong\", \"rows\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        gpu.b2p(),
        rows.join(", ")
    );
    println!("B1PAB {json}");
    if let Ok(out) = std::env::var("BONSAI_B1P_AB_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}

/// The round's cost by its draft count: rounds of 1..=4 drafts the target rejects at once (round
/// graphs, no taps, replay rollback: a verify of 2..=5 rows, then the rollback to 1 row) against
/// the greedy step, alternating three times in one process. A shorter draft pays only where its
/// round costs fewer steps than the tokens it is expected to give (1 + the accepted prefix).
/// `BONSAI_BY_DRAFTS_OUT` gets the JSON.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_round_by_drafts() {
    let Some((path, t, first)) = round_target("cuda_round_by_drafts") else {
        return;
    };
    let mut rows = Vec::new();
    for rep in 0..3 {
        let step = greedy_step_ms(&t, first);
        for nd in 1..=K {
            let round = rejected_rounds_ms_n(&t, first, &SamplerParams::greedy(), nd);
            println!(
                "BYDRAFTS rep {rep} drafts {nd} round {round:.3} ms, step {step:.3} ms, R {:.3}",
                round / step
            );
            rows.push(format!(
                "{{\"rep\": {rep}, \"drafts\": {nd}, \"round_ms\": {round:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}}}",
                round / step
            ));
        }
    }
    emit_rows(
        &t,
        &path,
        ("BYDRAFTS", "BONSAI_BY_DRAFTS_OUT"),
        "\"round\": \"round graphs, no taps, replay rollback, drafts rejected at once\", \"step\": \"greedy decode graph\"",
        &rows,
    );
}

/// What each family of launches costs in a verify round (round graphs, no taps, replay rollback,
/// 4 drafts of which the first is wrong: a 5-row verify, then the rollback to 1 row) and in the
/// plain greedy step (the decode graph without the logits row): both captured again with the
/// family's launches dropped (the tokens are then meaningless; only the time is kept), against
/// the full ones in the same process. `$BONSAI_WHATIF_DRAFTS` (1..=4, default 4) sets the round's
/// draft count. A family none of whose kernels the eager round or step launches fails the test
/// (its list of names is stale). Writes JSON to `$BONSAI_WHATIF_OUT`.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh --what-if runs it on the H200"]
fn cuda_round_what_if() {
    let Some((path, t, first)) = round_target("cuda_round_what_if") else {
        return;
    };
    let (cuda, cfg) = (&t.cuda, &t.cfg);
    let gpu = cuda.gpu();
    let nd = std::env::var("BONSAI_WHATIF_DRAFTS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| (1..=K).contains(n))
        .unwrap_or(K);
    let measure = || round_and_step_n(&t, first, nd);
    let (round0, step0) = measure();
    let names = gpu.kernel_names();
    let matvec = gpu.matvec_kernel_names();
    let other = non_matvec(&names);
    // the mat-vecs by kind: the b1-plane / int8 tensor-core ones (the norm-fed projections:
    // `mvbp_` one-row in the step, `mvbq_` in the verify) and the dp4a ones (the out-projections:
    // `mv_q1_` / `mv_q2_`, one-row and n-row)
    let (b1plane, dp4a) = (
        with_prefix(&matvec, &["mvbp_", "mvbq_"]),
        with_prefix(&matvec, &["mv_q1_", "mv_q2_"]),
    );
    let sets: Vec<(&str, Vec<&str>)> = vec![
        ("every mat-vec", matvec),
        (
            "b1-plane and int8 tensor-core mat-vecs (mvbp_, mvbq_)",
            b1plane,
        ),
        ("dp4a mat-vecs (mv_q1_, mv_q2_)", dp4a),
        ("every other kernel", other),
        ("rmsnorm_quant", vec!["rmsnorm_quant"]),
        (
            "GDN (conv, step, gated norm, record)",
            [
                &common::GDN_DECODE_KERNELS[..],
                &common::GDN_VERIFY_KERNELS[..],
            ]
            .concat(),
        ),
        (
            "attention (prep, chunks, merge)",
            common::ATTN_DECODE_KERNELS.to_vec(),
        ),
        ("swiglu_quant", vec!["swiglu_quant", "swiglu_quant_p16"]),
        (
            "rollback replay (gdn_replay)",
            vec!["gdn_replay", "gdn_replay_layers"],
        ),
        ("logit_stats_rows", vec!["logit_stats_rows"]),
    ];
    // launched only inside the round graphs (the eager round reads whole rows on the host), so
    // the eager profiles below cannot vouch for them
    let graph_only = ["logit_stats_rows"];
    // what the round and the step launch (eager, every launch timed alone): a set that drops
    // none of them is a stale list of names, and its row would read as "costs nothing"
    let ((round_prof, round_names), (step_prof, step_names)) = (
        eager_round_profile(&t, first, nd),
        eager_step_profile(&t, first),
    );
    let mut rows = Vec::new();
    for (label, set) in &sets {
        let hits = |launched: &[String]| -> Vec<&str> {
            set.iter()
                .copied()
                .filter(|n| launched.iter().any(|l| l == n))
                .collect()
        };
        let (in_round, in_step) = (hits(&round_names), hits(&step_names));
        assert!(
            !in_round.is_empty() || !in_step.is_empty() || set.iter().all(|n| graph_only.contains(n)),
            "what-if set {label:?} drops no launch of the round or the step (stale names?): round launches {round_names:?}"
        );
        let known: Vec<&str> = set.iter().copied().filter(|n| names.contains(n)).collect();
        gpu.set_skip_kernels(&known).unwrap();
        let (round, step) = measure();
        gpu.set_skip_kernels(&[]).unwrap();
        println!(
            "WHATIF round without {label:<38} round {round:.3} ms (full {round0:.3}): {:+.3} ms; step {step:.3} ms (full {step0:.3}): {:+.3} ms",
            round0 - round,
            step0 - step
        );
        rows.push(format!(
            "{{\"skipped\": \"{label}\", \"kernels\": {known:?}, \"launched_in_round\": {in_round:?}, \"launched_in_step\": {in_step:?}, \"round_ms\": {round:.4}, \"round_saved_ms\": {:.4}, \"step_ms\": {step:.4}, \"step_saved_ms\": {:.4}}}",
            round0 - round,
            step0 - step
        ));
    }
    let (round1, step1) = measure();
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"round\": \"round graphs, no taps, replay rollback, {nd} drafts, first wrong\", \"drafts\": {nd}, \"round_ms\": {round0:.4}, \"step_ms\": {step0:.4}, \"round_ms_again\": {round1:.4}, \"step_ms_again\": {step1:.4}, \"without\": [{}], \"eager_round_profile\": {round_prof}, \"eager_step_profile\": {step_prof}}}",
        cfg.weight_type.name(),
        cuda.name(),
        rows.join(", ")
    );
    println!("WHATIF {json}");
    if let Ok(out) = std::env::var("BONSAI_WHATIF_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}

/// The launches of `launches` grouped by kernel name and grid (`common::group_launches`), printed
/// under `tag` and as a JSON object: the number of launches, their total µs and the groups.
fn profile_json(tag: &str, launches: &[(String, f32)]) -> String {
    let agg = common::group_launches(launches);
    let total: f64 = agg.iter().map(|a| a.2).sum();
    for (name, cnt, us) in &agg {
        println!("{tag} {name:<44} {cnt:>4} launches {us:9.1} us");
    }
    println!(
        "{tag} {} launches, {total:.1} us of kernels alone",
        launches.len()
    );
    format!(
        "{{\"launches\": {}, \"kernels_alone_us\": {total:.1}, \"by_kernel\": [{}]}}",
        launches.len(),
        agg.iter()
            .map(|(n, c, us)| format!(
                "{{\"kernel\": \"{n}\", \"launches\": {c}, \"us\": {us:.1}}}"
            ))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// One what-if round (5-row verify, first draft wrong, replay rollback, no taps) run eagerly with
/// every launch timed alone (`Gpu::profile_begin`: a spin kernel ahead of each, so no launch gap
/// is counted): where the round's kernel time goes, launch family by launch family.
fn eager_round_profile(t: &Target, first: u32, nd: usize) -> (String, Vec<String>) {
    let (cuda, cfg) = (&t.cuda, &t.cfg);
    let graphs = cuda.round_graph();
    cuda.set_round_graph(false);
    let mut st = SeqState::new(cuda, cfg, t.n_ctx).unwrap();
    st.copy_from(cuda, &t.base);
    let mut bufs = RoundBufs::new(cuda, cfg, K + 1).unwrap();
    let mut s = Sampler::new(SamplerParams::greedy());
    let mut id_last = first;
    let mut launches = Vec::new();
    // one warm-up round, then the profiled one
    for r in 0..2 {
        if r == 1 {
            cuda.gpu().profile_begin();
        }
        id_last = rejected_round(t, &mut st, &mut bufs, &mut s, id_last, nd);
        if r == 1 {
            launches = cuda.gpu().profile_end();
        }
    }
    cuda.set_round_graph(graphs);
    (profile_json("RPROF", &launches), launched_names(&launches))
}

/// The distinct kernel names of profiled launches (a launch is named "kernel grid").
fn launched_names(launches: &[(String, f32)]) -> Vec<String> {
    let mut v: Vec<String> = launches
        .iter()
        .map(|(n, _)| n.split(' ').next().unwrap_or(n).to_string())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// The plain eager step with every launch timed alone, as [`eager_round_profile`] times the round.
fn eager_step_profile(t: &Target, _first: u32) -> (String, Vec<String>) {
    let (cuda, cfg, w) = (&t.cuda, &t.cfg, &t.w);
    let mut st = SeqState::new(cuda, cfg, t.n_ctx).unwrap();
    st.copy_from(cuda, &t.base);
    let _ = cuda.time_step_eager(cfg, w, &mut st, 1).unwrap();
    cuda.gpu().profile_begin();
    let _ = cuda.time_step_eager(cfg, w, &mut st, 1).unwrap();
    let launches = cuda.gpu().profile_end();
    (profile_json("SPROF", &launches), launched_names(&launches))
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_spec_round_cost() {
    let Some(path) = common::cuda_bench_model("cuda_spec_round_cost", "BONSAI_SPEC_BENCH_MODEL")
    else {
        return;
    };
    let Target {
        cuda,
        g,
        cfg,
        w,
        n_ctx,
        text,
        prompt,
        base,
        lg0,
    } = Target::load(&path);
    let drafter = std::env::var("BONSAI_SPEC_BENCH_DRAFTER").ok().map(|p| {
        let h = Drafter::load(std::path::Path::new(&p), &g, &cfg).unwrap();
        if std::env::var("BONSAI_GPU_DRAFTER").is_ok_and(|v| v == "0") {
            Dr::Host(Box::new(h))
        } else {
            Dr::Gpu(Box::new(CudaDrafter::new(cuda.gpu_arc(), h).unwrap()))
        }
    });
    // tap layers: the drafter's, else spread like the real [1, 16, 31, 46, 61]
    let tap_layers: Vec<usize> = match &drafter {
        Some(d) => d.target_layers().to_vec(),
        None => (0..5)
            .map(|j| (1.0 + j as f64 * (cfg.n_layer - 4) as f64 / 4.0).round() as usize)
            .collect(),
    };

    // 1. plain steps: the oracle continuation, timed per step (graph replay + host sampling)
    // enough for ROUNDS + 1 fully accepted rounds (plus slack), and the plain-step samples
    let n_gen = (ROUNDS + 1) * (K + 1) + 24;
    let mut st = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
    st.copy_from(&cuda, &base);
    let mut s = Sampler::new(SamplerParams::greedy());
    let mut lg = lg0.clone();
    let mut want = Vec::with_capacity(n_gen);
    let mut t_plain = Vec::new();
    for i in 0..n_gen {
        let ((), secs) = timed(&cuda, || {
            let x = s.sample(&lg);
            s.accept(x.id);
            want.push(x.id);
            cuda.decode_step(&cfg, &w, &mut st, x.id, &mut lg).unwrap();
        });
        if i > 2 {
            t_plain.push(secs);
        }
    }
    let plain_row_ms = median_ms(&mut t_plain);
    // the engine's greedy plain step, the denominator of R: the step graph without the logits
    // row (argmax and log-sum-exp on the device, 16 bytes back), what a greedy request with no
    // proposer runs per token. Same tokens as the row path (same launches).
    let mut st = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
    st.copy_from(&cuda, &base);
    let mut lg_none = Vec::new();
    let mut t_greedy = Vec::new();
    for (i, &id) in want.iter().enumerate() {
        let (stats, secs) = timed(&cuda, || {
            cuda.decode_step_stats(&cfg, &w, &mut st, id, &mut lg_none, false)
                .unwrap()
        });
        if let Some(&next) = want.get(i + 1) {
            let got = stats.map(|s| s.argmax);
            assert_eq!(
                got,
                Some(next),
                "row-less greedy step {i} differs from the row path"
            );
        }
        if i > 2 {
            t_greedy.push(secs);
        }
    }
    let plain_ms = median_ms(&mut t_greedy);
    // the eager one-row forward with taps (the engine's plain step with a DSpark drafter)
    let mut st = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
    st.copy_from(&cuda, &base);
    let mut t_eager = Vec::new();
    let mut taps = Vec::new();
    for (i, &id) in want.iter().take(24).enumerate() {
        let ((), secs) = timed(&cuda, || {
            forward(
                &cuda,
                &cfg,
                &w,
                &mut st,
                &[id],
                GdnMode::Recurrent,
                LogitRows::Last,
                &mut lg,
                Capture {
                    taps: Some(TapRequest {
                        layers: &tap_layers,
                        rows: 0..1,
                        out: &mut taps,
                    }),
                    gdn_rec: None,
                },
            )
            .unwrap();
            let _ = s.sample(&lg);
        });
        if i > 2 {
            t_eager.push(secs);
        }
    }
    let eager_taps_ms = median_ms(&mut t_eager);
    println!(
        "BENCH plain step: greedy decode step (graph, no logits row) {plain_ms:.3} ms; with the row copied and sampled on the host {plain_row_ms:.3} ms; eager + taps {eager_taps_ms:.3} ms"
    );

    // 2. verify rounds per accept count, rollback mode and taps, eager and with round graphs
    let mut rounds_json = Vec::new();
    // round_ms[graph][taps][mode][k]
    let mut round_ms = [[[[0f64; K + 1]; 2]; 2]; 2];
    let modes = [Rollback::Replay, Rollback::Reforward];
    for (gi, graph) in [false, true].into_iter().enumerate() {
        cuda.set_round_graph(graph);
        for (ti, with_taps) in [false, true].into_iter().enumerate() {
            for (mi, &mode) in modes.iter().enumerate() {
                for k in 0..=K {
                    let mut st = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
                    st.copy_from(&cuda, &base);
                    let mut bufs = RoundBufs::new(&cuda, &cfg, K + 1).unwrap();
                    let mut s = Sampler::new(SamplerParams::greedy());
                    let first = s.sample(&lg0);
                    s.accept(first.id);
                    let mut got = vec![first.id];
                    let mut t = Vec::new();
                    for r in 0..=ROUNDS {
                        let i0 = got.len();
                        let mut draft = want[i0..i0 + K].to_vec();
                        if k < K {
                            draft[k] = (draft[k] + 1) % text;
                        }
                        let id_last = *got.last().unwrap();
                        let (out, secs) = timed(&cuda, || {
                            verify_round(
                                &cuda,
                                &cfg,
                                &w,
                                &mut st,
                                &mut bufs,
                                &mut s,
                                id_last,
                                &draft,
                                with_taps.then_some(&tap_layers[..]),
                                mode,
                            )
                            .unwrap()
                        });
                        assert_eq!(out.n_acc, k, "oracle drafts: accept count");
                        got.extend(out.tokens.iter().map(|x| x.id));
                        if r > 0 {
                            t.push(secs);
                        }
                    }
                    assert_eq!(
                        got[..],
                        want[..got.len()],
                        "rounds differ from plain greedy"
                    );
                    let ms = median_ms(&mut t);
                    round_ms[gi][ti][mi][k] = ms;
                    rounds_json.push(format!(
                    "{{\"round_graph\": {graph}, \"taps\": {with_taps}, \"rollback\": \"{mode:?}\", \"k\": {k}, \"round_ms\": {ms:.3}, \"R\": {:.3}}}",
                    ms / plain_ms
                ));
                    println!(
                    "BENCH round graph={graph} taps={with_taps} {mode:?} k={k}: {ms:.3} ms, R = {:.2} (emits {} tokens)",
                    ms / plain_ms,
                    k + 1
                );
                }
            }
        }
    }
    cuda.set_round_graph(false);
    for (ti, with_taps) in [false, true].into_iter().enumerate() {
        for (mi, mode) in modes.iter().enumerate() {
            let gain: Vec<String> = (0..=K)
                .map(|k| format!("{:.2}", round_ms[0][ti][mi][k] / round_ms[1][ti][mi][k]))
                .collect();
            println!(
                "BENCH round graph gain taps={with_taps} {mode:?}: eager / graph round time by k = [{}]",
                gain.join(", ")
            );
        }
    }

    // 3. proposers: the n-gram search over a 1k-token history, the DSpark drafter
    let hist: Vec<u32> = prompt
        .iter()
        .chain(&want)
        .copied()
        .cycle()
        .take(1024)
        .collect();
    let mut t_ng = Vec::new();
    for _ in 0..64 {
        let t = Instant::now();
        std::hint::black_box(ngram_draft(std::hint::black_box(&hist), 3, K));
        t_ng.push(t.elapsed().as_secs_f64());
    }
    let ngram_ms = median_ms(&mut t_ng);
    // (round graphs, draft graph, device stage): all eager, round graphs with the eager draft (the
    // A/B of the draft graph), graphs with the taps copied to the host and staged eagerly (the
    // A/B of the device stage), all graphs with the taps staged from device memory by the
    // captured stage (the engine's default)
    let mut draft_prof = String::from("null");
    let mut dspark_pipelined = String::from("null");
    let mut dspark_json = [
        String::from("null"),
        String::from("null"),
        String::from("null"),
        String::from("null"),
    ];
    for (ci, (graph, draft_graph, dev_stage)) in [
        (false, false, false),
        (true, false, false),
        (true, true, false),
        (true, true, true),
    ]
    .into_iter()
    .enumerate()
    {
        let Some(d) = &drafter else {
            break;
        };
        let gi = graph as usize;
        cuda.set_round_graph(graph);
        d.set_graph(draft_graph);
        d.set_stage_graph(dev_stage);
        cuda.set_verify_taps_on_host(!dev_stage || matches!(d, Dr::Host(_)));
        {
            let mut st = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
            let mut ds = d.new_state();
            let mut lg = Vec::new();
            let taps = common::prefill_with_taps(
                &cuda,
                &cfg,
                &w,
                &mut st,
                &prompt,
                d.target_layers(),
                &mut lg,
            );
            d.stage(&mut ds, &taps, 0, prompt.len());
            let mut s = Sampler::new(SamplerParams::greedy());
            let first = s.sample(&lg);
            s.accept(first.id);
            let mut id_last = first.id;
            let mut bufs = RoundBufs::new(&cuda, &cfg, K + 1).unwrap();
            let (mut t_draft, mut t_stage, mut t_round, mut t_total) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut acc = 0;
            for r in 0..=ROUNDS {
                let t0 = Instant::now();
                let (out, [sd, sr, ss]) = timed_dspark_round(
                    &cuda, &cfg, &w, &mut st, &mut bufs, &mut s, d, &mut ds, id_last,
                );
                let total = t0.elapsed().as_secs_f64();
                id_last = out.tokens.last().unwrap().id;
                if r > 0 {
                    t_draft.push(sd);
                    t_stage.push(ss);
                    t_round.push(sr);
                    t_total.push(total);
                    acc += out.n_acc;
                }
            }
            if ci == 0 {
                if let Dr::Gpu(g) = d {
                    // one eager draft with every launch timed alone: where the draft's time goes
                    cuda.gpu().profile_begin();
                    let ids = g.draft(
                        match &mut ds {
                            DrState::Gpu(s) => s,
                            DrState::Host(_) => unreachable!("GPU drafter state"),
                        },
                        id_last,
                        st.pos,
                    );
                    let launches = cuda.gpu().profile_end();
                    ids.unwrap();
                    draft_prof = profile_json("DPROF", &launches);
                }
            }
            let (dm, sm, rm, tm) = (
                median_ms(&mut t_draft),
                median_ms(&mut t_stage),
                median_ms(&mut t_round),
                median_ms(&mut t_total),
            );
            println!(
            "BENCH dspark ({}, round graph {graph}, draft graph {draft_graph}, device stage {dev_stage}): draft {dm:.3} ms, stage {sm:.3} ms, verify round {rm:.3} ms, \
             total {tm:.3} ms, R = {:.2} vs the greedy graph step ({:.2} vs the eager+taps step); \
             {acc} of {} drafts accepted",
            d.label(),
            tm / plain_ms,
            tm / eager_taps_ms,
            ROUNDS * K
        );
            dspark_json[ci] = format!(
            "{{\"drafter\": \"{}\", \"draft_graph\": {draft_graph}, \"device_stage\": {dev_stage}, \"draft_ms\": {dm:.3}, \"stage_ms\": {sm:.3}, \"round_ms\": {rm:.3}, \"total_ms\": {tm:.3}, \
             \"R_vs_eager_taps_step\": {:.3}, \"R_vs_graph_step\": {:.3}, \"accepted\": {acc}, \"drafted\": {}, \
             \"R_with_oracle_k\": [{}]}}",
            d.label(),
            tm / eager_taps_ms,
            tm / plain_ms,
            ROUNDS * K,
            (0..=K)
                .map(|k| format!("{:.3}", (dm + sm + round_ms[gi][1][0][k]) / plain_ms))
                .collect::<Vec<_>>()
                .join(", ")
        );
            if ci == 3 {
                // the engine's pipeline, with the rollback replay forked beside the next stage and
                // draft (`Gpu::fork_replay`) and on one stream, alternating
                let ab = fork_ab_rows(&cuda, 3, || {
                    pipelined_dspark_ms(&cuda, &cfg, &w, &prompt, n_ctx, d, ROUNDS * 4)
                });
                let rows: Vec<String> = ab
                    .iter()
                    .map(|&ForkRow { rep, fork, ms, acc }| {
                        let r_step = ms / plain_ms;
                        println!(
                            "BENCH dspark pipelined rep {rep} fork {fork:<5}: {ms:.3} ms per round, R = {r_step:.2} vs the greedy graph step; {acc} of {} drafts accepted",
                            ROUNDS * 4 * K
                        );
                        format!(
                            "{{\"fork\": {fork}, \"round_ms\": {ms:.3}, \"R_vs_graph_step\": {r_step:.3}, \"accepted\": {acc}, \"drafted\": {}}}",
                            ROUNDS * 4 * K
                        )
                    })
                    .collect();
                dspark_pipelined = format!("[{}]", rows.join(", "));
            }
        }
    }
    cuda.set_round_graph(false);
    cuda.set_verify_taps_on_host(true);
    if let Some(d) = &drafter {
        d.set_stage_graph(true);
    }
    let ngram_r: Vec<String> = (0..=K)
        .map(|k| format!("{:.3}", (ngram_ms + round_ms[0][0][0][k]) / plain_ms))
        .collect();
    let ngram_r_graph: Vec<String> = (0..=K)
        .map(|k| format!("{:.3}", (ngram_ms + round_ms[1][0][0][k]) / plain_ms))
        .collect();
    println!(
        "BENCH ngram: search {ngram_ms:.4} ms; R by accept count (replay) = [{}]; with round graphs [{}]",
        ngram_r.join(", "),
        ngram_r_graph.join(", ")
    );
    let json = format!(
        "{{\"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"plain_step_ms\": {plain_ms:.3}, \
         \"plain_step_row_ms\": {plain_row_ms:.3}, \"plain_eager_taps_ms\": {eager_taps_ms:.3}, \"rounds\": [{}], \"ngram\": {{\"search_ms\": {ngram_ms:.4}, \
         \"R_by_k_replay\": [{}], \"R_by_k_replay_graph\": [{}]}}, \"dspark\": {}, \"dspark_graph_eager_draft\": {}, \"dspark_graph_host_stage\": {}, \"dspark_graph\": {}, \"dspark_pipelined\": {}, \"draft_profile\": {}}}",
        cfg.weight_type.name(),
        cuda.name(),
        rounds_json.join(", "),
        ngram_r.join(", "),
        ngram_r_graph.join(", "),
        dspark_json[0],
        dspark_json[1],
        dspark_json[2],
        dspark_json[3],
        dspark_pipelined,
        draft_prof
    );
    println!("BENCH {json}");
    if let Ok(out) = std::env::var("BONSAI_SPEC_BENCH_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}

/// The 27B target (`$BONSAI_SPEC_BENCH_MODEL`, with a CUDA device) and drafter
/// (`$BONSAI_SPEC_BENCH_DRAFTER`) paths of a DSpark bench; `None` (and SKIPPED) without them.
fn model_and_drafter(test: &str) -> Option<(String, String)> {
    let path = common::cuda_bench_model(test, "BONSAI_SPEC_BENCH_MODEL")?;
    let Ok(dpath) = std::env::var("BONSAI_SPEC_BENCH_DRAFTER") else {
        eprintln!("SKIPPED {test}: BONSAI_SPEC_BENCH_DRAFTER not set (not counted as run)");
        return None;
    };
    Some((path, dpath))
}

/// DSpark rounds as the engine pipelines them ([`pipelined_dspark_ms`]: round graphs, the draft
/// graph, the kept rows staged from device memory, nothing drained between draft, verify and
/// stage), with the rollback replay forked onto the side stream (`Gpu::fork_replay`) and on one
/// stream, alternating three times in one process; against the greedy graph step.
/// Stream priorities are fixed per process (set at `Gpu::new` when `BONSAI_CUDA_FORK=1`;
/// `BONSAI_CUDA_SIDE_PRIO=0`: both default), so `gpu_check.sh --fork-ab` runs it twice, with
/// `BONSAI_CUDA_FORK=1`. Needs `$BONSAI_SPEC_BENCH_MODEL` and
/// `$BONSAI_SPEC_BENCH_DRAFTER`; JSON to `$BONSAI_FORK_AB_OUT`.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL and _DRAFTER"]
fn cuda_dspark_pipelined() {
    let Some((path, dpath)) = model_and_drafter("cuda_dspark_pipelined") else {
        return;
    };
    let t = Target::load(&path);
    let (cuda, cfg, w) = (&t.cuda, &t.cfg, &t.w);
    let h = Drafter::load(std::path::Path::new(&dpath), &t.g, cfg).unwrap();
    let d = Dr::Gpu(Box::new(CudaDrafter::new(cuda.gpu_arc(), h).unwrap()));
    cuda.set_round_graph(true);
    cuda.set_verify_taps_on_host(false);
    d.set_graph(true);
    d.set_stage_graph(true);
    let first = Sampler::new(SamplerParams::greedy()).sample(&t.lg0).id;
    let step = greedy_step_ms(&t, first);
    let prio = std::env::var("BONSAI_CUDA_FORK").is_ok_and(|v| v == "1")
        && !std::env::var("BONSAI_CUDA_SIDE_PRIO").is_ok_and(|v| v == "0");
    let ab = fork_ab_rows(cuda, 3, || {
        pipelined_dspark_ms(cuda, cfg, w, &t.prompt, t.n_ctx, &d, ROUNDS * 4)
    });
    let rows: Vec<String> = ab
        .iter()
        .map(|&ForkRow { rep, fork, ms, acc }| {
            println!(
                "FORKAB {} prio {prio} rep {rep} fork {fork:<5}: {ms:.3} ms per round, step {step:.3} ms, R {:.3}; {acc} of {} drafts accepted",
                cfg.weight_type.name(),
                ms / step,
                ROUNDS * 4 * K
            );
            format!(
                "{{\"rep\": {rep}, \"fork\": {fork}, \"round_ms\": {ms:.4}, \"step_ms\": {step:.4}, \"R\": {:.4}, \"accepted\": {acc}, \"drafted\": {}}}",
                ms / step,
                ROUNDS * 4 * K
            )
        })
        .collect();
    let json = format!(
        "{{\"model\": \"{path}\", \"drafter\": \"{dpath}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"side_stream_priority_low\": {prio}, \"what\": \"DSpark rounds pipelined as the engine runs them (draft graph, round graphs, device stage, replay rollback), {} rounds after a warm-up, the rollback replay forked onto the side stream or not, alternating in one process\", \"rows\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        ROUNDS * 4,
        rows.join(", ")
    );
    if let Ok(out) = std::env::var("BONSAI_FORK_AB_OUT") {
        std::fs::write(out, &json).unwrap();
    }
}

/// The what-if's round and the greedy step with the defaults, three times (for A/Bs across
/// builds: run alternately with another build's binary). Prints `ROUNDPLAIN` lines.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL"]
fn cuda_round_plain() {
    let Some((_path, t, first)) = round_target("cuda_round_plain") else {
        return;
    };
    for rep in 0..3 {
        let (round, step) = round_and_step(&t, first);
        println!(
            "ROUNDPLAIN {} rep {rep} round {round:.3} ms, step {step:.3} ms, R {:.3}",
            t.cfg.weight_type.name(),
            round / step
        );
    }
}

/// Context rows of [`cuda_dspark_by_context`].
const CTX_ROWS: [usize; 4] = [32, 1024, 2048, 4000];

/// DSpark rounds by context length: at each of [`CTX_ROWS`] prompt tokens (prefilled in 512-token
/// chunks, every chunk's taps staged into the GPU drafter), the greedy decode step and ROUNDS
/// DSpark rounds (the draft graph, round graphs, the drafts the target rejects with the sparse
/// drafter, replay rollback), each timed with the stream drained: draft, verify round, staging of
/// the kept rows, and R = (their sum) / step. The short-prompt `cuda_spec_round_cost` cannot show
/// what a long context costs the drafter's block attention and the target's attention. A
/// benchmark, not a timed test (it asserts only that every round emits a token). Needs
/// `$BONSAI_SPEC_BENCH_MODEL` and `$BONSAI_SPEC_BENCH_DRAFTER`; JSON to `$BONSAI_SPEC_CTX_OUT`.
#[test]
#[ignore = "needs a CUDA GPU: run on the H200 with BONSAI_SPEC_BENCH_MODEL and _DRAFTER"]
fn cuda_dspark_by_context() {
    let test = "cuda_dspark_by_context";
    let Some((path, dpath)) = model_and_drafter(test) else {
        return;
    };
    let cuda = CudaBackend::new(0).unwrap();
    let g = Arc::new(Gguf::open(std::path::Path::new(&path)).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let w = Weights::load(&cuda, &g, &cfg).unwrap();
    let h = Drafter::load(std::path::Path::new(&dpath), &g, &cfg).unwrap();
    let d = Dr::Gpu(Box::new(CudaDrafter::new(cuda.gpu_arc(), h).unwrap()));
    let Dr::Gpu(gd) = &d else {
        unreachable!("built as the GPU drafter")
    };
    cuda.set_round_graph(true);
    d.set_graph(true);
    let layers = d.target_layers().to_vec();
    let text = 8000.min(cfg.n_vocab as u32 - 8);
    let mut rows = Vec::new();
    for ctx in CTX_ROWS {
        let ctx = ctx.min(gd.window() - (K + 1) * (ROUNDS + 2));
        let n_ctx = ctx + (K + 1) * (ROUNDS + 2) + 8;
        let prompt: Vec<u32> = (0..ctx as u32)
            .map(|i| (i.wrapping_mul(2654435761).wrapping_add(13)) % text)
            .collect();
        let mut st = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
        let mut ds = d.new_state();
        let mut lg = Vec::new();
        for (i, chunk) in prompt.chunks(512).enumerate() {
            let taps = common::prefill_with_taps(&cuda, &cfg, &w, &mut st, chunk, &layers, &mut lg);
            d.stage(&mut ds, &taps, i * 512, chunk.len());
        }
        let mut s = Sampler::new(SamplerParams::greedy());
        let first = s.sample(&lg).id;
        s.accept(first);
        // the greedy step at this context, from a copy of the prompt state
        let mut tp = Vec::new();
        {
            let mut s2 = SeqState::new(&cuda, &cfg, n_ctx).unwrap();
            s2.copy_from(&cuda, &st);
            let mut id = first;
            let mut lg2 = Vec::new();
            for i in 0..=ROUNDS {
                let (stats, secs) = timed(&cuda, || {
                    cuda.decode_step_stats(&cfg, &w, &mut s2, id, &mut lg2, false)
                        .unwrap()
                });
                id = stats.map_or(0, |x| x.argmax) % text;
                if i > 0 {
                    tp.push(secs);
                }
            }
        }
        let step = median_ms(&mut tp);
        let mut bufs = RoundBufs::new(&cuda, &cfg, K + 1).unwrap();
        let (mut td, mut tr, mut ts, mut tt) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut id_last = first;
        let mut acc = 0;
        for r in 0..=ROUNDS {
            let (out, [sd, sr, ss]) = timed_dspark_round(
                &cuda, &cfg, &w, &mut st, &mut bufs, &mut s, &d, &mut ds, id_last,
            );
            id_last = out.tokens.last().expect("a round emits a token").id;
            if r > 0 {
                td.push(sd);
                tr.push(sr);
                ts.push(ss);
                tt.push(sd + sr + ss);
                acc += out.n_acc;
            }
        }
        // one eager draft with every launch timed alone, and the graph drafts' own times
        d.set_graph(false);
        cuda.gpu().profile_begin();
        d.draft(&mut ds, id_last, st.pos);
        let launches = cuda.gpu().profile_end();
        d.set_graph(true);
        let top: Vec<String> = common::group_launches(&launches)
            .iter()
            .take(6)
            .map(|(k, n, us)| format!("{k} x{n} {us:.0} us"))
            .collect();
        println!(
            "DSPCTX context {ctx}: graph drafts {:?} ms; eager draft launches alone: {}",
            td.iter()
                .map(|x| (x * 1e4).round() / 10.0)
                .collect::<Vec<_>>(),
            top.join(", ")
        );
        let (dm, rm, sm, tm) = (
            median_ms(&mut td),
            median_ms(&mut tr),
            median_ms(&mut ts),
            median_ms(&mut tt),
        );
        println!(
            "DSPCTX {} context {ctx}: step {step:.3} ms, draft {dm:.3} ms, verify round {rm:.3} ms, stage {sm:.3} ms, \
             R = {:.2}; {acc} of {} drafts accepted",
            cfg.weight_type.name(),
            tm / step,
            ROUNDS * K
        );
        rows.push(format!(
            "{{\"context\": {ctx}, \"step_ms\": {step:.4}, \"draft_ms\": {dm:.4}, \"round_ms\": {rm:.4}, \"stage_ms\": {sm:.4}, \
             \"total_ms\": {tm:.4}, \"R\": {:.3}, \"accepted\": {acc}, \"drafted\": {}}}",
            tm / step,
            ROUNDS * K
        ));
    }
    let json = format!(
        "{{\"what\": \"DSpark rounds by context length: GPU drafter (draft graph), round graphs, replay rollback, drafts rejected (sparse drafter); R = (draft + verify round + stage) / greedy graph step at the same context; medians of {ROUNDS}\", \
         \"model\": \"{path}\", \"weight_type\": \"{}\", \"device\": \"{}\", \"rows\": [{}]}}",
        cfg.weight_type.name(),
        cuda.name(),
        rows.join(", ")
    );
    println!("DSPCTX {json}");
    if let Ok(out) = std::env::var("BONSAI_SPEC_CTX_OUT") {
        std::fs::write(out, json).unwrap();
    }
}
