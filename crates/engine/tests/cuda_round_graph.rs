//! The speculative round as captured CUDA graphs (the default; `BONSAI_CUDA_ROUND_GRAPH=0` or
//! `CudaBackend::set_round_graph(false)` turns them off) against the eager round, on one backend.
//! These tests flip the switch per call.
//!
//! - `cuda_verify_forward_graph_equals_eager`: `Backend::verify_forward` for every row count
//!   n = 1..=8, with and without taps, each at two different positions (the second replays the
//!   graph captured by the first): logits rows, taps, every GDN verify record and the full state
//!   (`kv_to_host` / `gdn_to_host`) are bit-identical to the eager forward; the per-row logit
//!   statistics the graph returns pick the same token as the host greedy sampler; plain
//!   `decode_step` graph steps are interleaved. Each call runs with rows requested (logits
//!   compared bit for bit), without (the graph returns no rows when every row's statistics are
//!   usable, and those statistics match the eager rows; the eager forward always fills them)
//!   and without with the row fallback forced (rows copied after the row-less graph, bit for
//!   bit); the interleaved decode steps cycle through the same three cases
//!   (`decode_step_stats`).
//! - `cuda_round_graph_rounds_equal_eager`: `spec::verify_round` with the switch on vs off, side by
//!   side on two states, oracle drafts corrupted so that every accept count 0..=4 occurs, replay
//!   and re-forward rollback, without and with taps, greedy (device statistics) and seeded
//!   sampling (host sampler): the tokens, the logits rows, the taps and the full state after
//!   every round are identical, and the greedy tokens equal plain greedy decoding; every fourth
//!   step is a plain decode step (decode graph) on both. A sampler that reads rows (a zero logit
//!   bias, seeded or greedy) gets them and they are compared bit for bit; a plain greedy sampler
//!   gets none from the graph round / step (its statistics are then checked against the eager
//!   rows), and a top-k sampler (seeded, or greedy with top logprobs) gets each row's best
//!   entries instead (checked against the host twin on the eager rows); the tokens are the same.
//!
//! Models: the tiny builder targets of `common` (all four weight types) and the synthetic
//! `*.gguf` files in `$BONSAI_CUDA_MODELS` (scripts/gpu_check.sh). Without a CUDA device each test
//! prints SKIPPED and returns. `cpu_runs_the_round_graph_checks` runs the same checks on the CPU
//! backend (no switch there: it validates the test logic and the trait defaults on every host run).

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bonsai_engine::backend::cpu::CpuBackend;
use bonsai_engine::backend::cuda::CudaBackend;
use bonsai_engine::backend::{gdn_rec_width, Backend, GdnMode};
use bonsai_engine::config::TargetConfig;
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::{forward, Capture, LogitRows, SeqState, Weights};
use bonsai_engine::sampling::{LogitStats, RowNeed, Sampler, SamplerParams};
use bonsai_engine::spec::{verify_round, Rollback, RoundBufs, RoundOut};
use bonsai_engine::QuantType;

const N_CTX: usize = 512;

/// A backend whose round-graph switch the checks flip (CUDA); the CPU backend has none.
trait Switch: Backend {
    fn set_graphs(&self, on: bool);
    /// Whether the switched-on verify (and the decode step) must return per-row logit
    /// statistics (the graph ran), and so may skip the rows.
    fn graphs_give_stats(&self) -> bool;
    /// Force the row fallback (rows copied after a row-less graph) on or off.
    fn force_row_fallback(&self, on: bool);
    /// Leave the switched-on verify's taps on the device (where a GPU drafter stages them); a
    /// backend without that keeps returning them.
    fn taps_on_device(&self, on: bool);
    /// The last verify's taps where it left them on the device (`floats` of them), else `None`.
    fn device_taps(&self, floats: usize) -> Option<Vec<f32>>;
}

impl Switch for CudaBackend {
    fn set_graphs(&self, on: bool) {
        self.set_round_graph(on);
    }
    fn graphs_give_stats(&self) -> bool {
        true
    }
    fn force_row_fallback(&self, on: bool) {
        self.set_force_row_fallback(on);
    }
    fn taps_on_device(&self, on: bool) {
        self.set_verify_taps_on_host(!on);
    }
    fn device_taps(&self, floats: usize) -> Option<Vec<f32>> {
        let (src, _rows, _width) = self.last_verify_taps()?;
        let g = self.gpu();
        let buf = g.alloc(floats * 4).unwrap();
        g.dtod(buf.ptr(), src, floats * 4).unwrap();
        let mut v = vec![0f32; floats];
        g.dtoh(&buf, 0, &mut v).unwrap();
        Some(v)
    }
}

impl Switch for CpuBackend {
    fn set_graphs(&self, _on: bool) {}
    fn graphs_give_stats(&self) -> bool {
        false
    }
    fn force_row_fallback(&self, _on: bool) {}
    fn taps_on_device(&self, _on: bool) {}
    fn device_taps(&self, _floats: usize) -> Option<Vec<f32>> {
        None
    }
}

/// How a check asks for the logits rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rows {
    /// Requested (`rows_needed` / `row_needed` true): always filled, compared bit for bit.
    Needed,
    /// Not requested: a backend with usable statistics for every row returns none.
    Skip,
    /// Not requested, with the row fallback forced: filled after the row-less graph.
    Fallback,
}

const ROWS_MODES: [Rows; 3] = [Rows::Needed, Rows::Skip, Rows::Fallback];

/// Whether statistics let a caller that needs no rows skip them: one per row (`n`), each usable
/// (argmax below `nv`, finite max and log-sum-exp; `Sampler::sample_from_stats`'s conditions).
fn stats_usable(stats: &[Option<LogitStats>], n: usize, nv: usize) -> bool {
    stats.len() == n
        && stats.iter().all(|s| {
            s.is_some_and(|s| (s.argmax as usize) < nv && s.max.is_finite() && s.lse.is_finite())
        })
}

struct Model {
    name: String,
    path: PathBuf,
}

fn setup(test: &str) -> Option<CudaBackend> {
    if !CudaBackend::available() {
        eprintln!("SKIPPED {test}: no CUDA device (not counted as run)");
        return None;
    }
    Some(CudaBackend::new(0).expect("cuda backend"))
}

/// `*.gguf` targets of `$BONSAI_CUDA_MODELS` (empty, with a SKIPPED line, when unset).
fn env_models(test: &str) -> Vec<Model> {
    let Ok(dir) = std::env::var("BONSAI_CUDA_MODELS") else {
        eprintln!(
            "SKIPPED {test} on the synthetic model folder: BONSAI_CUDA_MODELS not set (not counted as run)"
        );
        return Vec::new();
    };
    let mut v: Vec<Model> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("model folder {dir}: {e}"))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .map(|p| Model {
            name: p.file_stem().unwrap().to_string_lossy().into_owned(),
            path: p,
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// The tiny builder targets (all four weight types).
fn builder_models() -> Vec<Model> {
    let dir = std::env::temp_dir().join(format!("bonsai-round-graph-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static N: AtomicUsize = AtomicUsize::new(0);
    common::WEIGHT_TYPES
        .iter()
        .map(|&wt: &QuantType| {
            let p = dir.join(format!(
                "{}-target-{}.gguf",
                N.fetch_add(1, Ordering::Relaxed),
                wt.name()
            ));
            std::fs::write(&p, common::tiny_target(wt).build()).unwrap();
            Model {
                name: format!("builder-tiny-{}", wt.name()),
                path: p,
            }
        })
        .collect()
}

/// Bit patterns (NaN-safe exact comparison).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// NaN, +inf and −inf counts of a logits row.
fn nonfinite(row: &[f32]) -> String {
    let count = |f: fn(&f32) -> bool| row.iter().filter(|x| f(x)).count();
    format!(
        "{} NaN, {} +inf, {} -inf",
        count(|x| x.is_nan()),
        count(|&x| x == f32::INFINITY),
        count(|&x| x == f32::NEG_INFINITY)
    )
}

/// The first maximum of a row with NaN as −inf (the host sampler's and the device statistics'
/// rule); `None` when nothing is above −inf.
fn first_max(row: &[f32]) -> Option<(usize, f32)> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v > f32::NEG_INFINITY && best.is_none_or(|(_, m)| v > m) {
            best = Some((i, v));
        }
    }
    best
}

/// Where two logits buffers `[rows, nv]` differ bit for bit (`None` when they do not): how many
/// values and rows, the first differing value of both, and per differing row both rows' first
/// maximum and NaN / inf counts.
fn logits_diff(nv: usize, a: &[f32], b: &[f32]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("lengths {} vs {}", a.len(), b.len()));
    }
    let first = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits())?;
    let n_diff = (0..a.len())
        .filter(|&i| a[i].to_bits() != b[i].to_bits())
        .count();
    let (r0, c0) = (first / nv, first % nv);
    let mut msg = format!(
        "{n_diff} of {} values differ; first at row {r0} col {c0}: {} ({:#010x}) vs {} ({:#010x})",
        a.len(),
        a[first],
        a[first].to_bits(),
        b[first],
        b[first].to_bits()
    );
    for (r, (ra, rb)) in a.chunks_exact(nv).zip(b.chunks_exact(nv)).enumerate() {
        if bits(ra) == bits(rb) {
            continue;
        }
        let n = ra
            .iter()
            .zip(rb)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        let max_abs = ra
            .iter()
            .zip(rb)
            .map(|(x, y)| (x - y).abs())
            .filter(|d| !d.is_nan())
            .fold(0f32, f32::max);
        msg += &format!(
            "\n  row {r}: {n} values differ (max |diff| {max_abs}); first max {:?} vs {:?}; {} vs {}",
            first_max(ra),
            first_max(rb),
            nonfinite(ra),
            nonfinite(rb)
        );
    }
    Some(msg)
}

/// The per-row statistics a verify returned against its logits rows `[n, nv]`: none when
/// `expect` is false, else one per row, each `Some` exactly when the row has a maximum above
/// −inf, with that first maximum (NaN as −inf) as argmax, its bits as max, and a log-sum-exp
/// within 1e-3 (relative) of the host's f64 one.
fn check_stats(what: &str, nv: usize, logits: &[f32], stats: &[Option<LogitStats>], expect: bool) {
    let n = logits.len() / nv;
    if !expect {
        assert!(
            stats.is_empty(),
            "{what}: statistics where none are computed"
        );
        return;
    }
    assert_eq!(stats.len(), n, "{what}: one statistics entry per row");
    for (i, (row, s)) in logits.chunks_exact(nv).zip(stats).enumerate() {
        let host = first_max(row);
        let Some(s) = s else {
            assert!(
                host.is_none(),
                "{what}: row {i}: no device statistics, host first max {host:?} ({})",
                nonfinite(row)
            );
            continue;
        };
        let Some((am, m)) = host else {
            panic!(
                "{what}: row {i}: device statistics {s:?} for a row with no maximum ({})",
                nonfinite(row)
            );
        };
        assert!(
            s.argmax as usize == am && s.max.to_bits() == m.to_bits(),
            "{what}: row {i}: device argmax {} max {} vs host first max {am} = {m} (row[device              argmax] = {:?}; {})",
            s.argmax,
            s.max,
            row.get(s.argmax as usize),
            nonfinite(row)
        );
        if m.is_finite() {
            let sum: f64 = row
                .iter()
                .filter(|&&v| v > f32::NEG_INFINITY)
                .map(|&v| (v as f64 - m as f64).exp())
                .sum();
            let lse = m as f64 + sum.ln();
            assert!(
                (s.lse - lse).abs() <= 1e-3 * (1.0 + lse.abs()),
                "{what}: row {i}: device lse {} vs host {lse}",
                s.lse
            );
        }
    }
}

fn prompt(n: usize, seed: u32, vocab: usize) -> Vec<u32> {
    let hi = (vocab as u32 - 8).min(1400);
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % hi)
        .collect()
}

/// Tap layers spread over the model, out of order (the tap layout follows the list's order).
fn tap_layers(cfg: &TargetConfig) -> Vec<usize> {
    let nl = cfg.n_layer;
    vec![nl - 1, 1.min(nl - 1), nl / 2]
}

fn assert_same_state<B: Backend>(b: &B, a: &SeqState<B>, r: &SeqState<B>, what: &str) {
    assert_eq!(a.pos, r.pos, "{what}: pos");
    for (i, (x, y)) in a.kv.iter().zip(&r.kv).enumerate() {
        let (x, y) = (b.kv_to_host(x).unwrap(), b.kv_to_host(y).unwrap());
        assert_eq!(x.0, y.0, "{what}: KV layer {i} length");
        assert!(bits(&x.1) == bits(&y.1), "{what}: KV layer {i} differs");
    }
    for (i, (x, y)) in a.gdn.iter().zip(&r.gdn).enumerate() {
        let (x, y) = (b.gdn_to_host(x).unwrap(), b.gdn_to_host(y).unwrap());
        assert!(bits(&x) == bits(&y), "{what}: GDN layer {i} differs");
    }
}

/// The first `n` rows of a verify record, host f32.
fn rec_rows<B: Backend>(b: &B, rec: &B::Act, n: usize, width: usize) -> Vec<f32> {
    let mut v = vec![0f32; n * width];
    for t in 0..n {
        b.read_row(rec, t, &mut v[t * width..(t + 1) * width]);
    }
    v
}

/// Chunked prefill of `pr` into a fresh state; returns it with the last row's logits.
fn prefill<B: Backend>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    pr: &[u32],
) -> (SeqState<B>, Vec<f32>) {
    let mut st = SeqState::new(b, cfg, N_CTX).unwrap();
    let mut lg = Vec::new();
    forward(
        b,
        cfg,
        w,
        &mut st,
        pr,
        GdnMode::Chunked,
        LogitRows::Last,
        &mut lg,
        Capture::none(),
    )
    .unwrap();
    (st, lg)
}

/// `verify_forward` with the switch on vs off, n = 1..=8, taps off / on, each at two positions.
fn verify_forward_checks<B: Switch>(b: &B, m: &Model) {
    let g = Arc::new(Gguf::open(&m.path).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let w = Weights::load(b, &g, &cfg).unwrap();
    let nv = cfg.n_vocab;
    let width = gdn_rec_width(&cfg);
    let n_gdn = cfg.n_gdn_layers();
    let layers = tap_layers(&cfg);
    let pr = prompt(13, 5, nv);
    let (mut sa, _) = prefill(b, &cfg, &w, &pr);
    let (mut sb, _) = prefill(b, &cfg, &w, &pr);
    assert_same_state(b, &sa, &sb, &format!("{}: prefill", m.name));
    let mut ra: Vec<B::Act> = (0..n_gdn).map(|_| b.new_act(8, width)).collect();
    let mut rb: Vec<B::Act> = (0..n_gdn).map(|_| b.new_act(8, width)).collect();
    // the round's snapshot, asked for before every verify on both paths: once the verify has
    // returned it must hold the pre-verify state (on CUDA the graph's fused GDN kernels write
    // it, the eager path copies it)
    let mut snap_a: Vec<B::Gdn> = (0..n_gdn).map(|_| b.new_gdn(&cfg).unwrap()).collect();
    let mut snap_b: Vec<B::Gdn> = (0..n_gdn).map(|_| b.new_gdn(&cfg).unwrap()).collect();
    let host_gdn = |gs: &[B::Gdn]| -> Vec<Vec<u32>> {
        gs.iter()
            .map(|g| bits(&b.gdn_to_host(g).unwrap()))
            .collect()
    };
    let mut greedy = Sampler::new(SamplerParams::greedy());
    let mut calls = 0;
    let (mut skipped, mut fallbacks, mut step_skipped) = (0, 0, 0);
    let mut dev_checked = 0;
    // pass 0 captures (on CUDA), pass 1 replays at later positions
    for pass in 0..2 {
        for with_taps in [false, true] {
            for n in 1..=8usize {
                for rows in ROWS_MODES {
                    let what = format!(
                        "{} pass {pass} n {n} taps {with_taps} rows {rows:?} pos {}",
                        m.name, sa.pos
                    );
                    let ids = prompt(n, 100 + calls as u32, nv);
                    let rows_needed = rows == Rows::Needed;
                    let (mut la, mut lb) = (Vec::new(), Vec::new());
                    let (mut ta, mut tb) = (vec![7.0f32; 3], vec![-7.0f32; 5]);
                    let pre = host_gdn(&sa.gdn);
                    b.round_snapshot(&sa.gdn, &mut snap_a).unwrap();
                    b.set_graphs(false);
                    let st_a = b
                        .verify_forward(
                            &cfg,
                            &w,
                            &mut sa,
                            &ids,
                            &mut ra,
                            with_taps.then_some((&layers[..], &mut ta)),
                            &mut la,
                            rows_needed,
                        )
                        .unwrap();
                    b.set_graphs(true);
                    b.force_row_fallback(rows == Rows::Fallback);
                    // every other call with taps leaves the graph's taps on the device
                    let dev_taps = with_taps && calls % 2 == 1;
                    b.taps_on_device(dev_taps);
                    b.round_snapshot(&sb.gdn, &mut snap_b).unwrap();
                    let st_b = b
                        .verify_forward(
                            &cfg,
                            &w,
                            &mut sb,
                            &ids,
                            &mut rb,
                            with_taps.then_some((&layers[..], &mut tb)),
                            &mut lb,
                            rows_needed,
                        )
                        .unwrap();
                    b.force_row_fallback(false);
                    b.taps_on_device(false);
                    b.set_graphs(false);
                    assert!(host_gdn(&snap_a) == pre, "{what}: eager snapshot");
                    assert!(host_gdn(&snap_b) == pre, "{what}: graph snapshot");
                    verify_checks(
                        b,
                        &what,
                        nv,
                        n,
                        rows,
                        &la,
                        &lb,
                        &st_a,
                        &st_b,
                        &mut skipped,
                        &mut fallbacks,
                    );
                    if with_taps {
                        assert_eq!(ta.len(), n * layers.len() * cfg.n_embd, "{what}: taps");
                        match b.device_taps(ta.len()).filter(|_| dev_taps) {
                            Some(td) => {
                                assert!(tb.is_empty(), "{what}: device taps also copied back");
                                assert!(bits(&ta) == bits(&td), "{what}: device taps differ");
                                dev_checked += 1;
                            }
                            None => assert!(bits(&ta) == bits(&tb), "{what}: taps differ"),
                        }
                    }
                    for l in 0..n_gdn {
                        assert!(
                            bits(&rec_rows(b, &ra[l], n, width))
                                == bits(&rec_rows(b, &rb[l], n, width)),
                            "{what}: GDN record {l} differs"
                        );
                    }
                    assert_same_state(b, &sa, &sb, &what);
                    for (i, s) in st_b.iter().enumerate() {
                        let row = &la[i * nv..(i + 1) * nv];
                        if let Some(x) = s.and_then(|s| greedy.sample_from_stats(&s, nv)) {
                            assert_eq!(x.id, greedy.sample(row).id, "{what}: row {i} argmax");
                        }
                    }
                    calls += 1;
                    // a plain step through the decode graph on both, now and then, cycling
                    // through the three ways of asking for the row
                    if calls % 3 == 0 {
                        let mode = ROWS_MODES[(calls / 3) % 3];
                        let what = format!("{what} + decode step rows {mode:?}");
                        if step_checks(b, &cfg, &w, &mut sa, &mut sb, ids[0], mode, &what) {
                            step_skipped += 1;
                        }
                        assert_same_state(b, &sa, &sb, &what);
                    }
                }
            }
        }
    }
    if b.graphs_give_stats() {
        assert!(
            dev_checked > 0,
            "{}: no verify left its taps on the device",
            m.name
        );
        assert!(
            skipped > 0 && fallbacks > 0 && step_skipped > 0,
            "{}: the graphs never skipped the rows ({skipped} verifies, {step_skipped} steps) \
             or never fell back ({fallbacks})",
            m.name
        );
    } else {
        assert!(
            skipped == 0 && step_skipped == 0,
            "{}: rows skipped",
            m.name
        );
    }
    println!(
        "{}: verify_forward graph == eager bit for bit (logits, taps, records, state) for n = 1..=8, \
         taps off/on, rows needed / skipped / fallback, {calls} calls at two positions each \
         ({skipped} verifies and {step_skipped} decode steps returned no rows, {fallbacks} \
         verifies filled the rows through the fallback)",
        m.name
    );
}

/// The logits of one verify: `la` / `st_a` eager (always filled, no statistics), `lb` / `st_b`
/// the switched-on path asked for rows as `rows` says. Rows are skipped exactly when not asked
/// for and the backend returned usable statistics for every row (then the statistics are
/// checked against the eager rows); otherwise they equal the eager rows bit for bit.
#[allow(clippy::too_many_arguments)]
fn verify_checks<B: Switch>(
    b: &B,
    what: &str,
    nv: usize,
    n: usize,
    rows: Rows,
    la: &[f32],
    lb: &[f32],
    st_a: &[Option<LogitStats>],
    st_b: &[Option<LogitStats>],
    skipped: &mut usize,
    fallbacks: &mut usize,
) {
    assert!(
        st_a.is_empty(),
        "{what}: the eager verify has no statistics"
    );
    assert_eq!(
        la.len(),
        n * nv,
        "{what}: eager logits length (always filled)"
    );
    let skippable = b.graphs_give_stats() && rows == Rows::Skip && stats_usable(st_b, n, nv);
    assert_eq!(
        lb.is_empty(),
        skippable,
        "{what}: rows returned ({} values) vs skippable ({skippable})",
        lb.len()
    );
    if skippable {
        *skipped += 1;
        check_stats(what, nv, la, st_b, true);
        return;
    }
    if rows == Rows::Fallback && b.graphs_give_stats() {
        *fallbacks += 1;
    }
    if let Some(d) = logits_diff(nv, la, lb) {
        panic!("{what}: logits differ (eager vs graph): {d}");
    }
    check_stats(what, nv, lb, st_b, b.graphs_give_stats());
}

/// A decode step's statistics as a one-row list (`check_stats`'s form): the graph step always
/// computes them (`None`: the row has no maximum), a backend without any returns `None`.
fn step_stats<B: Switch>(b: &B, s: Option<LogitStats>, what: &str) -> Vec<Option<LogitStats>> {
    if b.graphs_give_stats() {
        vec![s]
    } else {
        assert!(
            s.is_none(),
            "{what}: statistics from a backend that computes none"
        );
        Vec::new()
    }
}

/// One plain decode step on both states: eager-row `decode_step` on `sa`,
/// `decode_step_stats` asked for the row as `rows` says on `sb`. The row is skipped exactly
/// when not asked for and the statistics are usable (then they are checked against `sa`'s row);
/// otherwise both rows are equal bit for bit. Returns whether the row was skipped.
#[allow(clippy::too_many_arguments)]
fn step_checks<B: Switch>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    sa: &mut SeqState<B>,
    sb: &mut SeqState<B>,
    id: u32,
    rows: Rows,
    what: &str,
) -> bool {
    let nv = cfg.n_vocab;
    let (mut da, mut db) = (Vec::new(), Vec::new());
    b.decode_step(cfg, w, sa, id, &mut da).unwrap();
    b.force_row_fallback(rows == Rows::Fallback);
    let r = b.decode_step_stats(cfg, w, sb, id, &mut db, rows == Rows::Needed);
    b.force_row_fallback(false);
    let stats = step_stats(b, r.unwrap(), what);
    assert_eq!(da.len(), nv, "{what}: decode_step fills the row");
    let skippable = b.graphs_give_stats() && rows == Rows::Skip && stats_usable(&stats, 1, nv);
    assert_eq!(
        db.is_empty(),
        skippable,
        "{what}: row returned ({} values) vs skippable ({skippable})",
        db.len()
    );
    if skippable {
        check_stats(what, nv, &da, &stats, true);
    } else {
        assert!(bits(&da) == bits(&db), "{what}: decode step logits");
        check_stats(what, nv, &db, &stats, b.graphs_give_stats());
    }
    skippable
}

/// After a verify whose logits differed: the same verify again from copies of the pre-round
/// state `pre` into a fresh state and fresh records (new addresses, so the graph path captures a
/// new graph unless one with those addresses is cached), eagerly and with the graphs, and which
/// of the first results each one reproduces.
#[allow(clippy::too_many_arguments)]
fn rerun_verify<B: Switch>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    pre: &SeqState<B>,
    ids: &[u32],
    taps: Option<&[usize]>,
    eager: &[f32],
    graph: &[f32],
) -> String {
    let width = gdn_rec_width(cfg);
    let mut st = SeqState::new(b, cfg, N_CTX).unwrap();
    let mut recs: Vec<B::Act> = (0..cfg.n_gdn_layers())
        .map(|_| b.new_act(8, width))
        .collect();
    let mut run = |graphs: bool| -> Vec<f32> {
        st.copy_from(b, pre);
        let (mut lg, mut tp) = (Vec::new(), Vec::new());
        b.set_graphs(graphs);
        let r = b.verify_forward(
            cfg,
            w,
            &mut st,
            ids,
            &mut recs,
            taps.map(|l| (l, &mut tp)),
            &mut lg,
            true,
        );
        b.set_graphs(false);
        r.unwrap();
        lg
    };
    let (e2, g2) = (run(false), run(true));
    let same = |x: &[f32], y: &[f32]| bits(x) == bits(y);
    format!(
        "re-run from the pre-round state on a fresh state: eager again == eager {}, == graph {}; \
         graph again == graph {}, == eager {}",
        same(&e2, eager),
        same(&e2, graph),
        same(&g2, graph),
        same(&g2, eager)
    )
}

/// Plain greedy decoding: chunked prefill, then `decode_step` per token.
fn plain_greedy<B: Backend>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    pr: &[u32],
    n: usize,
) -> Vec<u32> {
    let (mut st, mut lg) = prefill(b, cfg, w, pr);
    let mut s = Sampler::new(SamplerParams::greedy());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let x = s.sample(&lg);
        s.accept(x.id);
        out.push(x.id);
        if i + 1 < n {
            b.decode_step(cfg, w, &mut st, x.id, &mut lg).unwrap();
        }
    }
    out
}

/// Speculative rounds side by side, eager (A) and with the round graphs (B).
fn round_checks<B: Switch>(
    b: &B,
    m: &Model,
    rollback: Rollback,
    with_taps: bool,
    params: &SamplerParams,
) {
    let g = Arc::new(Gguf::open(&m.path).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let w = Weights::load(b, &g, &cfg).unwrap();
    let nv = cfg.n_vocab;
    let greedy = params.temperature == 0.0;
    // what verify_round / the engine ask the backend for
    let need = Sampler::new(params.clone()).row_need();
    let rows_needed = need == RowNeed::Row;
    let layers = tap_layers(&cfg);
    let taps = with_taps.then_some(&layers[..]);
    let mut seen = [false; 5];
    let (mut n_rounds, mut skipped, mut n_steps, mut steps_skipped) = (0, 0, 0, 0);
    println!(
        "{} {rollback:?} taps {with_taps}: sampler {params:?}",
        m.name
    );
    for seed in 0..2u32 {
        let pr = prompt(9 + 5 * seed as usize, seed, nv);
        let want = plain_greedy(b, &cfg, &w, &pr, 44);
        let (mut sa, lg) = prefill(b, &cfg, &w, &pr);
        let (mut sb, _) = prefill(b, &cfg, &w, &pr);
        assert_same_state(b, &sa, &sb, &format!("{} seed {seed}: prefill", m.name));
        // the state before each round (to re-run a verify whose outputs differ)
        let mut pre = SeqState::new(b, &cfg, N_CTX).unwrap();
        let mut ba = RoundBufs::new(b, &cfg, 5).unwrap();
        let mut bb = RoundBufs::new(b, &cfg, 5).unwrap();
        let (mut ka, mut kb) = (Sampler::new(params.clone()), Sampler::new(params.clone()));
        let first = ka.sample(&lg);
        ka.accept(first.id);
        let first_b = kb.sample(&lg);
        kb.accept(first_b.id);
        assert_eq!(first.id, first_b.id, "{}: first token", m.name);
        let mut got = vec![first.id];
        let (mut step, mut spec_rounds) = (0usize, 0usize);
        while got.len() < want.len() - 5 {
            let what = format!(
                "{} {rollback:?} taps {with_taps} greedy {greedy} seed {seed} step {step}",
                m.name
            );
            let id_last = *got.last().unwrap();
            if step % 4 == 3 {
                // A: decode_step (always the row), host sampling; B: the engine's plain step
                // (decode_step_stats, or decode_step_top for a top-k sampler: the row only when
                // the sampler reads it)
                let (mut la, mut lb, mut top) = (Vec::new(), Vec::new(), Vec::new());
                b.decode_step(&cfg, &w, &mut sa, id_last, &mut la).unwrap();
                let st_b = match need {
                    RowNeed::Top(k) => b
                        .decode_step_top(&cfg, &w, &mut sb, id_last, k, &mut lb, &mut top)
                        .unwrap(),
                    _ => b
                        .decode_step_stats(&cfg, &w, &mut sb, id_last, &mut lb, rows_needed)
                        .unwrap(),
                };
                let stats = step_stats(b, st_b, &what);
                let skippable =
                    b.graphs_give_stats() && !rows_needed && stats_usable(&stats, 1, nv);
                assert_eq!(lb.is_empty(), skippable, "{what}: decode step row skipped");
                if skippable {
                    check_stats(&what, nv, &la, &stats, true);
                    check_tops(&what, nv, &la, std::slice::from_ref(&top), need);
                    steps_skipped += 1;
                } else {
                    assert!(bits(&la) == bits(&lb), "{what}: decode step logits");
                    assert!(top.is_empty(), "{what}: entries with the row");
                }
                n_steps += 1;
                let xa = ka.sample(&la);
                let xb = match st_b.and_then(|s| kb.sample_from_top(&s, &top, nv)) {
                    Some(x) => x,
                    None => kb.sample(&lb),
                };
                assert_eq!(xa.id, xb.id, "{what}: decode step token");
                ka.accept(xa.id);
                kb.accept(xb.id);
                got.push(xa.id);
            } else {
                let i0 = got.len();
                let mut draft: Vec<u32> = want[i0..i0 + 4].to_vec();
                let bad = spec_rounds % 5;
                if bad < 4 {
                    draft[bad] = (draft[bad] + 1) % (nv as u32 - 8);
                }
                pre.copy_from(b, &sa);
                b.set_graphs(false);
                let oa = verify_round(
                    b, &cfg, &w, &mut sa, &mut ba, &mut ka, id_last, &draft, taps, rollback,
                )
                .unwrap();
                b.set_graphs(true);
                let ob = verify_round(
                    b, &cfg, &w, &mut sb, &mut bb, &mut kb, id_last, &draft, taps, rollback,
                )
                .unwrap();
                b.set_graphs(false);
                let ids = |o: &RoundOut| -> Vec<u32> { o.tokens.iter().map(|x| x.id).collect() };
                let round = || {
                    format!(
                        "verify ids [{id_last}] + {draft:?} at pos {}; tokens eager {:?} graph {:?}; \
                         sampler {params:?}",
                        pre.pos,
                        ids(&oa),
                        ids(&ob)
                    )
                };
                // logits and statistics first: they say why tokens would differ. The eager
                // round always has the rows; the graph round none exactly when the sampler
                // reads none and every row's statistics are usable
                let n = draft.len() + 1;
                assert_eq!(ba.logits().len(), n * nv, "{what}: eager round rows");
                let skippable =
                    b.graphs_give_stats() && !rows_needed && stats_usable(bb.stats(), n, nv);
                assert_eq!(
                    bb.logits().is_empty(),
                    skippable,
                    "{what}: graph round returned {} logits, skippable {skippable}",
                    bb.logits().len()
                );
                if skippable {
                    // the device statistics (and best entries) against the eager rows
                    check_stats(&what, nv, ba.logits(), bb.stats(), true);
                    check_tops(&what, nv, ba.logits(), bb.tops(), need);
                    skipped += 1;
                } else if let Some(d) = logits_diff(nv, ba.logits(), bb.logits()) {
                    let mut ids_v = vec![id_last];
                    ids_v.extend_from_slice(&draft);
                    let rerun =
                        rerun_verify(b, &cfg, &w, &pre, &ids_v, taps, ba.logits(), bb.logits());
                    panic!(
                        "{what}: verify logits differ (eager vs graph): {d}\n  {}\n  {rerun}",
                        round()
                    );
                }
                check_stats(&what, nv, ba.logits(), ba.stats(), false);
                assert!(
                    ba.tops().is_empty(),
                    "{what}: the eager round computed entries"
                );
                if !skippable {
                    assert!(bb.tops().is_empty(), "{what}: entries with the rows");
                    check_stats(&what, nv, bb.logits(), bb.stats(), b.graphs_give_stats());
                }
                if with_taps {
                    assert!(bits(&ba.taps) == bits(&bb.taps), "{what}: verify taps");
                }
                assert_eq!(ids(&oa), ids(&ob), "{what}: round tokens ({})", round());
                assert_eq!(oa.n_acc, ob.n_acc, "{what}: accept count");
                seen[oa.n_acc] = true;
                got.extend(ids(&oa));
                spec_rounds += 1;
                n_rounds += 1;
            }
            assert_same_state(b, &sa, &sb, &what);
            step += 1;
        }
        if greedy {
            assert_eq!(
                got[..],
                want[..got.len()],
                "{} {rollback:?} seed {seed}: tokens differ from plain greedy",
                m.name
            );
        }
    }
    if greedy {
        assert!(
            seen.iter().all(|&x| x),
            "{} {rollback:?}: every accept count occurs: {seen:?}",
            m.name
        );
    }
    if b.graphs_give_stats() && !rows_needed {
        assert!(
            skipped > 0 && steps_skipped > 0,
            "{} {rollback:?}: a sampler that reads no rows never skipped them ({skipped} of {n_rounds} \
             rounds, {steps_skipped} of {n_steps} steps)",
            m.name
        );
    }
    println!(
        "{} {rollback:?} taps {with_taps} greedy {greedy} rows needed {rows_needed}: {n_rounds} \
         rounds with round graphs == eager rounds (tokens, logits, taps, state bit for bit; \
         accept counts seen {seen:?}); rows skipped in {skipped} rounds and {steps_skipped} of \
         {n_steps} decode steps",
        m.name
    );
}

fn all_round_checks<B: Switch>(b: &B, m: &Model) {
    let sampled = SamplerParams {
        temperature: 0.8,
        top_k: 8,
        top_p: 0.95,
        seed: 1234,
        ..Default::default()
    };
    for rb in [Rollback::Replay, Rollback::Reforward] {
        for with_taps in [false, true] {
            // plain greedy (no rows from the graphs) and greedy that reads the rows (logits
            // compared bit for bit)
            round_checks(b, m, rb, with_taps, &SamplerParams::greedy());
            round_checks(b, m, rb, with_taps, &greedy_with_rows());
        }
    }
    // top-k draws and greedy with top logprobs read each row's best entries: from the graphs
    // without the rows
    round_checks(b, m, Rollback::Replay, true, &sampled);
    round_checks(b, m, Rollback::Replay, false, &greedy_with_logprobs());
    // the same draws with a zero logit bias read the rows (compared bit for bit)
    let sampled_rows = SamplerParams {
        logit_bias: vec![(0, 0.0)],
        ..sampled
    };
    round_checks(b, m, Rollback::Replay, true, &sampled_rows);
}

/// Greedy, but with a zero logit bias (no logit changes): the sampler reads the rows
/// (`RowNeed::Row`), so the backend must return them and the tests compare them.
fn greedy_with_rows() -> SamplerParams {
    SamplerParams {
        logit_bias: vec![(0, 0.0)],
        n_logprobs: 1,
        ..SamplerParams::greedy()
    }
}

/// Greedy with top logprobs: the sampler reads the statistics and each row's 3 best entries.
fn greedy_with_logprobs() -> SamplerParams {
    SamplerParams {
        n_logprobs: 3,
        ..SamplerParams::greedy()
    }
}

/// For a sampler that reads best entries: each row's list equals the host twin's on the eager
/// row (every entry bit for bit); for any other sampler no list came back.
fn check_tops(what: &str, nv: usize, logits: &[f32], tops: &[Vec<(u32, f32)>], need: RowNeed) {
    if !matches!(need, RowNeed::Top(_)) {
        assert!(tops.iter().all(|t| t.is_empty()), "{what}: unasked entries");
        return;
    }
    assert_eq!(
        tops.len(),
        logits.len() / nv,
        "{what}: one entry list per row"
    );
    for (i, t) in tops.iter().enumerate() {
        assert!(
            bonsai_kernels_cuda::host_topk_matches(&logits[i * nv..(i + 1) * nv], t),
            "{what}: row {i} best entries differ from the host twin's"
        );
    }
}

/// The same checks on the CPU backend (no switch: eager against eager through the trait
/// defaults; no statistics, so the rows are always filled, also for a greedy sampler).
/// Validates this file's logic on every host run.
#[test]
fn cpu_runs_the_round_graph_checks() {
    let cpu = CpuBackend::default();
    let mut models = builder_models();
    models.truncate(1);
    verify_forward_checks(&cpu, &models[0]);
    for params in [SamplerParams::greedy(), greedy_with_rows()] {
        round_checks(&cpu, &models[0], Rollback::Replay, true, &params);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_verify_forward_graph_equals_eager() {
    let test = "cuda_verify_forward_graph_equals_eager";
    let Some(cuda) = setup(test) else {
        return;
    };
    let mut models = builder_models();
    models.extend(env_models(test));
    for m in &models {
        verify_forward_checks(&cuda, m);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_check.sh runs it with --include-ignored on the H200"]
fn cuda_round_graph_rounds_equal_eager() {
    let test = "cuda_round_graph_rounds_equal_eager";
    let Some(cuda) = setup(test) else {
        return;
    };
    let mut models = builder_models();
    models.extend(env_models(test));
    for m in &models {
        all_round_checks(&cuda, m);
    }
}
