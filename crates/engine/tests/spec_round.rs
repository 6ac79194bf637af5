//! Speculative rounds on the CPU backend: lossless accept, rollback to the exact plain state after
//! every round (target KV + GDN, drafter context), both rollback options, the DSpark drafter, and the
//! refusal of drafters that do not fit the target.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bonsai_engine::backend::cpu::CpuBackend;
use bonsai_engine::backend::{Backend, GdnMode, KvType};
use bonsai_engine::config::TargetConfig;
use bonsai_engine::drafter::{DraftState, Drafter};
use bonsai_engine::gguf::Gguf;
use bonsai_engine::model::{forward, Capture, LogitRows, SeqState, TapRequest, Weights};
use bonsai_engine::sampling::{Sampler, SamplerParams};
use bonsai_engine::spec::{verify_round, Rollback, RoundBufs};
use bonsai_engine::{Error, QuantType};
use common::*;

fn write(b: &Builder, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bonsai-spec-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // a fresh file per call: tests run in parallel and mmap these files
    static N: AtomicUsize = AtomicUsize::new(0);
    let p = dir.join(format!("{}-{name}", N.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&p, b.build()).unwrap();
    p
}

struct Target {
    g: Arc<Gguf>,
    cfg: TargetConfig,
    w: Weights<CpuBackend>,
}

fn target(wt: QuantType) -> Target {
    let p = write(&tiny_target(wt), &format!("target-{}.gguf", wt.name()));
    let g = Arc::new(Gguf::open(&p).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let w = Weights::load(&B, &g, &cfg).unwrap();
    Target { g, cfg, w }
}

const B: CpuBackend = CpuBackend::new(KvType::F16);

/// Plain step over `ids` (one token at a time when `one`), returning the last row's logits.
fn step(t: &Target, st: &mut SeqState<CpuBackend>, ids: &[u32], mode: GdnMode) -> Vec<f32> {
    let mut lg = Vec::new();
    forward(
        &B,
        &t.cfg,
        &t.w,
        st,
        ids,
        mode,
        LogitRows::Last,
        &mut lg,
        Capture::none(),
    )
    .unwrap();
    lg
}

fn prompt(n: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % (vocab as u32 - 8))
        .collect()
}

/// Plain decoding: `n` tokens after the prompt with the sampler `params`.
fn plain(t: &Target, prompt: &[u32], n: usize, params: &SamplerParams) -> Vec<u32> {
    let mut st = SeqState::new(&B, &t.cfg, 512).unwrap();
    let mut lg = step(t, &mut st, prompt, GdnMode::Chunked);
    let mut s = Sampler::new(params.clone());
    let mut out = Vec::new();
    for _ in 0..n {
        let x = s.sample(&lg);
        s.accept(x.id);
        out.push(x.id);
        lg = step(t, &mut st, &[x.id], GdnMode::Recurrent);
    }
    out
}

/// Bit patterns (NaN-safe exact comparison).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_same_state(t: &Target, a: &SeqState<CpuBackend>, b: &SeqState<CpuBackend>, what: &str) {
    assert_eq!(a.pos, b.pos, "{what}: pos");
    for (i, (x, y)) in a.kv.iter().zip(&b.kv).enumerate() {
        assert_eq!(
            B.kv_to_host(x).unwrap(),
            B.kv_to_host(y).unwrap(),
            "{what}: KV layer {i}"
        );
    }
    for (i, (x, y)) in a.gdn.iter().zip(&b.gdn).enumerate() {
        let (x, y) = (B.gdn_to_host(x).unwrap(), B.gdn_to_host(y).unwrap());
        assert!(bits(&x) == bits(&y), "{what}: GDN layer {i} differs");
    }
    let _ = t;
}

/// Drafts from an oracle (the plain output) with the token at `bad` corrupted, so every accept
/// count 0..=4 occurs; checks tokens and the full state after every round against plain decoding.
fn oracle_rounds(wt: QuantType, params: SamplerParams, rollback: Rollback) {
    let t = target(wt);
    let nv = t.cfg.n_vocab;
    for seed in 0..3 {
        let pr = prompt(9 + 5 * seed as usize, seed, nv);
        let want = plain(&t, &pr, 40, &params);
        let mut st = SeqState::new(&B, &t.cfg, 512).unwrap();
        let mut reference = SeqState::new(&B, &t.cfg, 512).unwrap();
        let lg = step(&t, &mut st, &pr, GdnMode::Chunked);
        step(&t, &mut reference, &pr, GdnMode::Chunked);
        let mut s = Sampler::new(params.clone());
        let first = s.sample(&lg);
        s.accept(first.id);
        let mut got = vec![first.id];
        let mut bufs = RoundBufs::new(&B, &t.cfg, 5).unwrap();
        let mut round = 0usize;
        let mut seen = [false; 5];
        while got.len() < want.len() - 5 {
            let i0 = got.len();
            let mut draft: Vec<u32> = want[i0..i0 + 4].to_vec();
            let bad = round % 5;
            if bad < 4 {
                draft[bad] = (draft[bad] + 1) % (nv as u32 - 8);
            }
            let out = verify_round(
                &B,
                &t.cfg,
                &t.w,
                &mut st,
                &mut bufs,
                &mut s,
                *got.last().unwrap(),
                &draft,
                None,
                rollback,
            )
            .unwrap();
            // the CPU backend computes no statistics: the rows are always filled, also for a
            // greedy sampler (which does not need them)
            assert!(bufs.stats().is_empty(), "CPU round statistics");
            assert_eq!(
                bufs.logits().len(),
                (draft.len() + 1) * nv,
                "CPU round rows"
            );
            seen[out.n_acc] = true;
            if std::env::var("SPEC_DEBUG").is_ok() {
                eprintln!("round {round} n_acc {} pos {}", out.n_acc, st.pos);
            }
            got.extend(out.tokens.iter().map(|x| x.id));
            // advance the reference one token at a time to the same position
            while reference.pos < st.pos {
                let id = if reference.pos == pr.len() {
                    got[0]
                } else {
                    got[reference.pos - pr.len()]
                };
                step(&t, &mut reference, &[id], GdnMode::Recurrent);
            }
            assert_same_state(
                &t,
                &st,
                &reference,
                &format!("{wt:?} seed {seed} round {round}"),
            );
            round += 1;
        }
        assert_eq!(got[..], want[..got.len()], "{wt:?} seed {seed}: tokens");
        if params.temperature == 0.0 {
            assert!(
                seen.iter().all(|&x| x),
                "every accept count occurs: {seen:?}"
            );
        }
    }
}

#[test]
fn greedy_rounds_equal_plain_q1_replay() {
    oracle_rounds(QuantType::Q1_0, SamplerParams::greedy(), Rollback::Replay);
}

#[test]
fn greedy_rounds_equal_plain_q2_replay() {
    oracle_rounds(
        QuantType::Q2_0G128,
        SamplerParams::greedy(),
        Rollback::Replay,
    );
}

#[test]
fn greedy_rounds_equal_plain_q2_reforward() {
    oracle_rounds(
        QuantType::Q2_0G64,
        SamplerParams::greedy(),
        Rollback::Reforward,
    );
}

#[test]
fn sampled_rounds_equal_plain_with_same_seed() {
    let p = SamplerParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 1234,
        ..Default::default()
    };
    oracle_rounds(QuantType::Q1_0, p, Rollback::Replay);
}

#[test]
fn verify_rows_are_bit_identical_to_single_steps() {
    let t = target(QuantType::Q1_0);
    let pr = prompt(7, 3, t.cfg.n_vocab);
    let ids = [5u32, 17, 99, 3, 250];
    let mut a = SeqState::new(&B, &t.cfg, 64).unwrap();
    let mut b = SeqState::new(&B, &t.cfg, 64).unwrap();
    step(&t, &mut a, &pr, GdnMode::Chunked);
    step(&t, &mut b, &pr, GdnMode::Chunked);
    let mut all = Vec::new();
    forward(
        &B,
        &t.cfg,
        &t.w,
        &mut a,
        &ids,
        GdnMode::Recurrent,
        LogitRows::All,
        &mut all,
        Capture::none(),
    )
    .unwrap();
    let nv = t.cfg.n_vocab;
    for (i, &id) in ids.iter().enumerate() {
        let one = step(&t, &mut b, &[id], GdnMode::Recurrent);
        assert!(
            one[..] == all[i * nv..(i + 1) * nv],
            "row {i} differs from a single-token step"
        );
    }
}

fn drafter_file(embd: QuantType) -> PathBuf {
    write(
        &tiny_drafter(embd),
        &format!("drafter-{}.gguf", embd.name()),
    )
}

/// Taps of `ids` fed one at a time from `st` (the plain-decoding reference for the drafter context).
fn stage_plain(
    t: &Target,
    d: &Drafter,
    st: &mut SeqState<CpuBackend>,
    ds: &mut DraftState,
    ids: &[u32],
) {
    let layers = d.cfg.target_layers.clone();
    for &id in ids {
        let mut taps = Vec::new();
        let mut lg = Vec::new();
        let pos = st.pos;
        let req = TapRequest {
            layers: &layers,
            rows: 0..1,
            out: &mut taps,
        };
        forward(
            &B,
            &t.cfg,
            &t.w,
            st,
            &[id],
            GdnMode::Recurrent,
            LogitRows::None,
            &mut lg,
            Capture {
                taps: Some(req),
                gdn_rec: None,
            },
        )
        .unwrap();
        d.stage(ds, &taps, pos, 1).unwrap();
    }
}

#[test]
fn dspark_rounds_keep_target_and_drafter_state_exact() {
    let t = target(QuantType::Q1_0);
    let d = Drafter::load(&drafter_file(QuantType::Q1_0), &t.g, &t.cfg).unwrap();
    let layers = d.cfg.target_layers.clone();
    let params = SamplerParams::greedy();
    let pr = prompt(21, 7, t.cfg.n_vocab);
    let want = plain(&t, &pr, 48, &params);

    let mut st = SeqState::new(&B, &t.cfg, 512).unwrap();
    let mut ds = d.new_state();
    let mut lg = Vec::new();
    let taps = prefill_with_taps(&B, &t.cfg, &t.w, &mut st, &pr, &layers, &mut lg);
    d.stage(&mut ds, &taps, 0, pr.len()).unwrap();
    // reference drafter context: prompt taps one row at a time
    let mut rst = SeqState::new(&B, &t.cfg, 512).unwrap();
    let mut rds = d.new_state();
    let rtaps = prefill_with_taps(&B, &t.cfg, &t.w, &mut rst, &pr, &layers, &mut lg);
    let w = d.tap_width();
    for (i, row) in rtaps.chunks_exact(w).enumerate() {
        d.stage(&mut rds, row, i, 1).unwrap();
    }
    assert!(
        ds.export() == rds.export(),
        "prefill staging (one chunk vs row by row)"
    );

    let mut s = Sampler::new(params);
    let first = s.sample(&lg);
    s.accept(first.id);
    let mut got = vec![first.id];
    let mut bufs = RoundBufs::new(&B, &t.cfg, 5).unwrap();
    let mut rounds = 0;
    while got.len() < 40 {
        let start = st.pos;
        let id_last = *got.last().unwrap();
        let draft = d.draft(&mut ds, id_last, start).unwrap();
        assert_eq!(draft.len(), 4);
        assert!(
            draft.iter().all(|&x| x != d.cfg.mask_token_id),
            "mask id is never drafted"
        );
        let out = verify_round(
            &B,
            &t.cfg,
            &t.w,
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
        let w = d.tap_width();
        d.stage(&mut ds, &bufs.taps[..keep * w], start, keep)
            .unwrap();
        got.extend(out.tokens.iter().map(|x| x.id));
        // reference: feed the same committed tokens plainly
        let fed: Vec<u32> = got[got.len() - keep - 1..got.len() - 1].to_vec();
        stage_plain(&t, &d, &mut rst, &mut rds, &fed);
        assert_same_state(&t, &st, &rst, &format!("round {rounds}"));
        assert_eq!(
            ds.export(),
            rds.export(),
            "drafter context after round {rounds}"
        );
        rounds += 1;
    }
    assert_eq!(got[..], want[..got.len()]);
}

#[test]
fn drafter_window_is_bounded() {
    let t = target(QuantType::Q1_0);
    let d = Drafter::load(&drafter_file(QuantType::Q1_0), &t.g, &t.cfg).unwrap();
    let w = d.tap_width();
    let mut ds = d.new_state();
    let taps = vec![0.01f32; 256 * w];
    let mut peak = 0;
    for i in 0..40 {
        d.stage(&mut ds, &taps, i * 256, 256).unwrap();
        assert!(ds.len() <= d.window());
        peak = peak.max(ds.bytes());
    }
    assert_eq!(ds.len(), d.window());
    assert_eq!(ds.next_pos(), 40 * 256);
    // bounded by the window plus compaction slack and one block of K+V (f32), independent of the
    // 10240 positions
    let row = 2 * d.cfg.n_layer * d.cfg.n_head_kv * d.cfg.head_dim * 4;
    assert_eq!(ds.max_bytes(), ds.cap_rows() * row);
    assert!(peak <= ds.max_bytes(), "peak {peak} B");
    assert!(ds.cap_rows() <= d.window() + d.window() / 8 + d.cfg.block_size);
    let draft = d.draft(&mut ds, 1, 40 * 256).unwrap();
    assert_eq!(draft.len(), 4);
    assert!(
        d.draft(&mut ds, 1, 40 * 256 + 3).is_err(),
        "a gap in the context is refused"
    );
}

/// Once the window is full the drafter's buffers never grow again, whatever the mix of prefill
/// chunks, decode rows, round commits and drafts; and what the window holds is unchanged by the
/// compaction (same rows as a state that staged only the last `window` positions).
#[test]
fn drafter_buffers_stop_growing_past_the_window() {
    let t = target(QuantType::Q1_0);
    let d = Drafter::load(&drafter_file(QuantType::Q1_0), &t.g, &t.cfg).unwrap();
    let (w, win) = (d.tap_width(), d.window());
    // tap row of position p: a deterministic function of p, so any two states can be compared
    let tap = |p0: usize, n: usize| -> Vec<f32> {
        (0..n * w)
            .map(|i| (((p0 + i / w) * 31 + i % w) % 97) as f32 * 1e-3 - 0.05)
            .collect()
    };
    let mut ds = d.new_state();
    let mut pos = 0;
    // prefill-like chunks (the last one longer than the window: only its tail is staged)
    for n in [512, 512, 1000, win + 300] {
        d.stage(&mut ds, &tap(pos, n), pos, n).unwrap();
        pos += n;
    }
    assert_eq!(ds.len(), win);
    assert!(ds.bytes() <= ds.max_bytes());
    // decode: single rows and round commits of 1..=5 rows (a draft now and then), 4 windows long;
    // after one more window of rows (capacity may still double once) the bytes never change
    let settle = pos + win;
    let mut settled = None;
    let mut k = 0;
    while pos < settle + 3 * win {
        let n = 1 + k % 5;
        if k % 97 == 0 {
            d.draft(&mut ds, 1, pos).unwrap();
        }
        d.stage(&mut ds, &tap(pos, n), pos, n).unwrap();
        pos += n;
        k += 1;
        assert_eq!(ds.len(), win);
        assert!(
            ds.bytes() <= ds.max_bytes(),
            "{} > {}",
            ds.bytes(),
            ds.max_bytes()
        );
        if pos >= settle {
            let b = *settled.get_or_insert(ds.bytes());
            assert_eq!(ds.bytes(), b, "buffers grew at position {pos}");
        }
    }
    // the live window equals a fresh state fed only the last `win` positions
    let mut fresh = d.new_state();
    d.stage(&mut fresh, &tap(pos - win, win), pos - win, win)
        .unwrap();
    let (p_a, a) = ds.export();
    let (p_b, b) = fresh.export();
    assert_eq!((p_a, bits(&a)), (p_b, bits(&b)));
    assert!(fresh.bytes() <= fresh.max_bytes());
}

#[test]
fn drafter_embedding_is_shared_when_bytes_are_equal() {
    let t = target(QuantType::Q1_0);
    let same = Drafter::load(&drafter_file(QuantType::Q1_0), &t.g, &t.cfg).unwrap();
    assert!(same.embd_shared);
    let other = Drafter::load(&drafter_file(QuantType::Q2_0G128), &t.g, &t.cfg).unwrap();
    assert!(!other.embd_shared);
}

fn refused(target_p: &Tiny, drafter: Builder, needle: &str) {
    let tp = write(
        &tiny_target_with(target_p, QuantType::Q1_0),
        &format!("t-{needle}.gguf"),
    );
    let g = Arc::new(Gguf::open(&tp).unwrap());
    let cfg = TargetConfig::from_gguf(&g).unwrap();
    let dp = write(&drafter, &format!("d-{needle}.gguf"));
    match Drafter::load(&dp, &g, &cfg) {
        Err(Error::DrafterMismatch(m)) => assert!(m.contains(needle), "{m}"),
        Err(e) => panic!("expected DrafterMismatch, got {e}"),
        Ok(_) => panic!("a drafter that does not fit ({needle}) was accepted"),
    }
}

#[test]
fn misfit_drafters_are_refused() {
    let wide = Tiny {
        n_embd: 512,
        ..TINY
    };
    refused(&wide, tiny_drafter(QuantType::Q1_0), "embedding_length");
    let big_vocab = Tiny {
        n_vocab: 512,
        ..TINY
    };
    refused(&big_vocab, tiny_drafter(QuantType::Q1_0), "vocabulary");
    let shallow = Tiny { n_layer: 4, ..TINY };
    refused(&shallow, tiny_drafter(QuantType::Q1_0), "target_layers");
}
