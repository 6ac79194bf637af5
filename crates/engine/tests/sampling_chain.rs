//! The host sampler chain, its statistics, penalties, validation and the sample-and-accept-n rule.

use bonsai_engine::sampling::{Sampled, Sampler, SamplerParams};
use bonsai_engine::Error;

/// Deterministic test data generator (independent of the sampler's RNG).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
    }
    fn logits(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn argmax(l: &[f32]) -> u32 {
    let mut b = 0;
    for i in 0..l.len() {
        if l[i] > l[b] {
            b = i;
        }
    }
    b as u32
}

fn params(t: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplerParams {
    SamplerParams {
        temperature: t,
        top_k,
        top_p,
        min_p,
        seed,
        ..SamplerParams::greedy()
    }
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut g = Lcg(1);
    let mut s = Sampler::new(SamplerParams::greedy());
    for _ in 0..50 {
        let l = g.logits(1000);
        assert_eq!(s.sample(&l).id, argmax(&l));
    }
    assert_eq!(s.sample(&[0.0, 2.0, 1.0, 2.0, 2.0]).id, 1);
}

#[test]
fn defaults_follow_model_md() {
    let d = SamplerParams::default();
    assert_eq!(
        (d.temperature, d.top_k, d.top_p, d.min_p),
        (0.7, 20, 0.95, 0.0)
    );
    assert_eq!(d.repetition_penalty, 1.0);
    d.validate(1000).unwrap();
    SamplerParams::greedy().validate(1000).unwrap();
}

fn run(p: SamplerParams, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(p);
    (0..n).map(|_| s.sample(logits).id).collect()
}

#[test]
fn seeded_reproducibility() {
    let l = Lcg(7).logits(64);
    let a = run(params(1.0, 0, 1.0, 0.0, 42), &l, 300);
    let b = run(params(1.0, 0, 1.0, 0.0, 42), &l, 300);
    let c = run(params(1.0, 0, 1.0, 0.0, 43), &l, 300);
    assert_eq!(a, b);
    assert_ne!(a, c);
    // Samples actually vary (not stuck on one token).
    let distinct: std::collections::HashSet<_> = a.iter().collect();
    assert!(distinct.len() > 10);
    // reset() restarts the same stream.
    let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 42));
    let first: Vec<u32> = (0..50).map(|_| s.sample(&l).id).collect();
    s.reset();
    let again: Vec<u32> = (0..50).map(|_| s.sample(&l).id).collect();
    assert_eq!(first, again);
}

#[test]
fn top_k_one_is_greedy() {
    let mut g = Lcg(3);
    let mut s = Sampler::new(params(1.5, 1, 1.0, 0.0, 9));
    for _ in 0..100 {
        let l = g.logits(500);
        assert_eq!(s.sample(&l).id, argmax(&l));
    }
}

/// Draws `n` samples and checks every frequency against `expect` (probabilities) within ±4σ;
/// tokens with probability 0 must never appear.
fn check_freqs(p: SamplerParams, logits: &[f32], expect: &[f64]) {
    let n = 20_000;
    let mut counts = vec![0usize; logits.len()];
    for id in run(p.clone(), logits, n) {
        counts[id as usize] += 1;
    }
    for (i, (&c, &q)) in counts.iter().zip(expect).enumerate() {
        if q == 0.0 {
            assert_eq!(c, 0, "token {i} outside the support was drawn ({p:?})");
        } else {
            let mean = n as f64 * q;
            let sigma = (n as f64 * q * (1.0 - q)).sqrt();
            assert!(
                (c as f64 - mean).abs() <= 4.0 * sigma,
                "token {i}: {c} draws, expected {mean:.0} ± {:.0} ({p:?})",
                4.0 * sigma
            );
        }
    }
}

/// Independent reference: softmax(l / t) restricted to `keep`, renormalized.
fn truncated(logits: &[f32], t: f64, keep: &[usize]) -> Vec<f64> {
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 / t).exp()).collect();
    let z: f64 = keep.iter().map(|&i| e[i]).sum();
    (0..logits.len())
        .map(|i| if keep.contains(&i) { e[i] / z } else { 0.0 })
        .collect()
}

#[test]
fn statistics_of_truncation() {
    // At t = 1: p = [0.40, 0.30, 0.15, 0.10, 0.05] (token order shuffled to exercise sorting).
    let probs = [0.15f64, 0.40, 0.05, 0.30, 0.10];
    let l: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();

    // No truncation.
    check_freqs(
        params(1.0, 0, 1.0, 0.0, 1),
        &l,
        &truncated(&l, 1.0, &[0, 1, 2, 3, 4]),
    );
    // top-p 0.8: 0.40 + 0.30 = 0.70 < 0.8, + 0.15 = 0.85 ≥ 0.8 → {1, 3, 0}.
    check_freqs(
        params(1.0, 0, 0.8, 0.0, 2),
        &l,
        &truncated(&l, 1.0, &[1, 3, 0]),
    );
    // min-p 0.3: floor 0.12 → {1, 3, 0}; min-p 0.5: floor 0.20 → {1, 3}.
    check_freqs(
        params(1.0, 0, 1.0, 0.3, 3),
        &l,
        &truncated(&l, 1.0, &[1, 3, 0]),
    );
    check_freqs(
        params(1.0, 0, 1.0, 0.5, 4),
        &l,
        &truncated(&l, 1.0, &[1, 3]),
    );
    // top-k 2 at t = 0.5.
    check_freqs(
        params(0.5, 2, 1.0, 0.0, 5),
        &l,
        &truncated(&l, 0.5, &[1, 3]),
    );
    // t = 2 flattens: p ∝ sqrt(p1) = [.632,.548,.387,.316,.224]/2.107 = [.300,.260,.184,.150,.106];
    // top-p 0.6 keeps {1, 3, 0} (0.560 < 0.6 ≤ 0.744): temperature applies before top-p.
    check_freqs(
        params(2.0, 0, 0.6, 0.0, 6),
        &l,
        &truncated(&l, 2.0, &[1, 3, 0]),
    );
    // Chain: top-k 4 → t 1 → top-p 0.9 (0.40+0.30+0.15 = 0.85 of the 0.95 left → 0.895 < 0.9, so
    // all 4 stay) → min-p 0.3 (floor 0.3 · 0.421 = 0.126 of the top-4 distribution → drops 0.105).
    check_freqs(
        params(1.0, 4, 0.9, 0.3, 7),
        &l,
        &truncated(&l, 1.0, &[1, 3, 0]),
    );
}

#[test]
fn penalties_change_the_argmax() {
    let l = [1.0f32, 0.9, 0.5, -1.0];
    let greedy = |f: &dyn Fn(&mut SamplerParams)| {
        let mut p = SamplerParams::greedy();
        f(&mut p);
        Sampler::new(p)
    };
    // Repetition 1.5: 1.0 / 1.5 = 0.667 < 0.9.
    let mut s = greedy(&|p| p.repetition_penalty = 1.5);
    assert_eq!(s.sample(&l).id, 0);
    s.accept(0);
    assert_eq!(s.sample(&l).id, 1);
    // Presence 0.2: 0.8 < 0.9.
    let mut s = greedy(&|p| p.presence_penalty = 0.2);
    s.accept(0);
    assert_eq!(s.sample(&l).id, 1);
    // Frequency 0.06: once → 0.94 (still 0), twice → 0.88 (now 1).
    let mut s = greedy(&|p| p.frequency_penalty = 0.06);
    s.accept(0);
    assert_eq!(s.sample(&l).id, 0);
    s.accept(0);
    assert_eq!(s.sample(&l).id, 1);
    // Repetition multiplies negative logits: -1.0 · 3 = -3 would lose to 0.5 anyway; check via a
    // negative-only row: [-1.0, -1.2] with token 0 penalized by 1.5 → -1.5 < -1.2.
    let mut s = greedy(&|p| p.repetition_penalty = 1.5);
    s.accept(0);
    assert_eq!(s.sample(&[-1.0, -1.2]).id, 1);
    // The window: with penalty_last_n 2, token 0 leaves the history after two more tokens.
    let mut s = greedy(&|p| {
        p.repetition_penalty = 1.5;
        p.penalty_last_n = 2;
    });
    s.accept(0);
    assert_eq!(s.sample(&l).id, 1);
    s.accept(2);
    assert_eq!(s.sample(&l).id, 1);
    s.accept(2);
    assert_eq!(s.sample(&l).id, 0);
    // penalty_last_n 0 disables penalties.
    let mut s = greedy(&|p| {
        p.repetition_penalty = 1.5;
        p.penalty_last_n = 0;
    });
    s.accept(0);
    assert_eq!(s.sample(&l).id, 0);
    // Logit bias, including a ban.
    let mut s = greedy(&|p| p.logit_bias = vec![(0, f32::NEG_INFINITY), (2, 0.45)]);
    assert_eq!(s.sample(&l).id, 2);
    let mut s = Sampler::new(SamplerParams {
        logit_bias: vec![(1, f32::NEG_INFINITY)],
        ..params(1.0, 0, 1.0, 0.0, 11)
    });
    for _ in 0..2000 {
        assert_ne!(s.sample(&[0.0, 5.0, 0.0]).id, 1);
    }
}

fn expect_invalid(p: SamplerParams, field: &str) {
    match p.validate(100) {
        Err(Error::InvalidRequest(msg)) => {
            assert!(msg.contains(field), "{msg:?} does not name {field}")
        }
        other => panic!("{field}: expected InvalidRequest, got {other:?}"),
    }
}

#[test]
fn validate_rejects_bad_values() {
    let d = SamplerParams::default;
    expect_invalid(
        SamplerParams {
            temperature: -0.1,
            ..d()
        },
        "temperature",
    );
    expect_invalid(
        SamplerParams {
            temperature: f32::NAN,
            ..d()
        },
        "temperature",
    );
    expect_invalid(
        SamplerParams {
            temperature: f32::INFINITY,
            ..d()
        },
        "temperature",
    );
    expect_invalid(SamplerParams { top_p: 0.0, ..d() }, "top_p");
    expect_invalid(SamplerParams { top_p: 1.01, ..d() }, "top_p");
    expect_invalid(
        SamplerParams {
            top_p: f32::NAN,
            ..d()
        },
        "top_p",
    );
    expect_invalid(SamplerParams { min_p: -0.1, ..d() }, "min_p");
    expect_invalid(
        SamplerParams {
            min_p: f32::NAN,
            ..d()
        },
        "min_p",
    );
    expect_invalid(
        SamplerParams {
            presence_penalty: 2.5,
            ..d()
        },
        "presence_penalty",
    );
    expect_invalid(
        SamplerParams {
            frequency_penalty: f32::NAN,
            ..d()
        },
        "frequency_penalty",
    );
    expect_invalid(
        SamplerParams {
            repetition_penalty: 0.0,
            ..d()
        },
        "repetition_penalty",
    );
    expect_invalid(
        SamplerParams {
            n_logprobs: 21,
            ..d()
        },
        "n_logprobs",
    );
    expect_invalid(
        SamplerParams {
            logit_bias: vec![(100, 1.0)],
            ..d()
        },
        "logit_bias",
    );
    expect_invalid(
        SamplerParams {
            logit_bias: vec![(3, f32::NAN)],
            ..d()
        },
        "logit_bias",
    );
    // Boundaries that are allowed.
    SamplerParams {
        top_p: 1.0,
        min_p: 1.0,
        n_logprobs: 20,
        temperature: 0.0,
        ..d()
    }
    .validate(100)
    .unwrap();
    SamplerParams {
        logit_bias: vec![(99, f32::NEG_INFINITY)],
        ..d()
    }
    .validate(100)
    .unwrap();
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    l.iter().map(|&x| x as f64 - z).collect()
}

#[test]
fn logprobs_are_unscaled_log_softmax() {
    let l = Lcg(5).logits(300);
    let want = log_softmax(&l);
    for t in [0.0, 0.3, 1.7] {
        let mut s = Sampler::new(SamplerParams {
            n_logprobs: 5,
            ..params(t, 0, 1.0, 0.0, 1)
        });
        let Sampled { id, logprob, top } = s.sample(&l);
        assert!((logprob as f64 - want[id as usize]).abs() < 1e-4);
        assert_eq!(top.len(), 5);
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap());
        for (k, &(tid, lp)) in top.iter().enumerate() {
            assert_eq!(tid as usize, order[k]);
            assert!((lp as f64 - want[tid as usize]).abs() < 1e-4);
        }
    }
    // No alternatives unless asked.
    assert!(Sampler::new(SamplerParams::greedy())
        .sample(&l)
        .top
        .is_empty());
}

/// A toy "model": logits as a deterministic function of the whole prefix.
fn model(prefix: &[u32], n_vocab: usize) -> Vec<f32> {
    let mut h: u64 = 0xcbf29ce484222325;
    for &t in prefix {
        h = (h ^ t as u64).wrapping_mul(0x100000001b3);
    }
    let mut g = Lcg(h);
    let mut l = g.logits(n_vocab);
    // Make one token dominant so drafts get accepted often.
    let hot = (h % n_vocab as u64) as usize;
    l[hot] += 4.0;
    l
}

#[test]
fn accept_n_greedy_prefix_rule() {
    let n_vocab = 10;
    let row = |best: usize| {
        let mut r = vec![0.0f32; n_vocab];
        r[best] = 1.0;
        r
    };
    let rows: Vec<Vec<f32>> = [3, 1, 4, 1, 5].iter().map(|&b| row(b)).collect();
    let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
    let ids = |v: Vec<Sampled>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
    let mut s = Sampler::new(SamplerParams::greedy());
    assert_eq!(
        ids(s.sample_and_accept_n(&rows, &[3, 1, 4, 1])),
        vec![3, 1, 4, 1, 5]
    );
    assert_eq!(
        ids(s.sample_and_accept_n(&rows, &[3, 1, 9, 1])),
        vec![3, 1, 4]
    );
    assert_eq!(ids(s.sample_and_accept_n(&rows, &[0, 1, 4, 1])), vec![3]);
    assert_eq!(ids(s.sample_and_accept_n(&rows[..1], &[])), vec![3]);
}

/// Speculative decoding with sample-and-accept-n emits exactly what plain decoding emits with the
/// same seed, at temperature > 0 and with penalties (the RNG and the history advance per token).
#[test]
fn accept_n_matches_plain_sampling_at_temperature() {
    let n_vocab = 16;
    let p = SamplerParams {
        temperature: 0.9,
        top_k: 8,
        top_p: 0.95,
        min_p: 0.02,
        repetition_penalty: 1.1,
        presence_penalty: 0.1,
        frequency_penalty: 0.05,
        penalty_last_n: 16,
        seed: 1234,
        ..SamplerParams::default()
    };
    let n_gen = 300;
    let mut plain = Sampler::new(p.clone());
    let mut seq: Vec<u32> = vec![1, 2, 3];
    while seq.len() < 3 + n_gen {
        let s = plain.sample(&model(&seq, n_vocab));
        plain.accept(s.id);
        seq.push(s.id);
    }

    let mut spec = Sampler::new(p);
    let mut out: Vec<u32> = vec![1, 2, 3];
    let mut drafter = Lcg(99);
    let (mut rounds, mut accepted) = (0, 0);
    while out.len() < 3 + n_gen {
        // A drafter that is right most of the time: the plain output, corrupted at random.
        let pos = out.len();
        let draft: Vec<u32> = (0..4)
            .map(|i| {
                let truth = seq.get(pos + i).copied().unwrap_or(0);
                if drafter.next() > 2.5 {
                    (truth + 1) % n_vocab as u32
                } else {
                    truth
                }
            })
            .collect();
        let rows: Vec<Vec<f32>> = (0..=4)
            .map(|i| {
                let mut pre = out.clone();
                pre.extend_from_slice(&draft[..i]);
                model(&pre, n_vocab)
            })
            .collect();
        let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let emitted = spec.sample_and_accept_n(&rows, &draft);
        assert!(!emitted.is_empty() && emitted.len() <= 5);
        // Every emitted token but the last matched the draft.
        for (i, e) in emitted[..emitted.len() - 1].iter().enumerate() {
            assert_eq!(e.id, draft[i]);
        }
        rounds += 1;
        accepted += emitted.len() - 1;
        out.extend(emitted.iter().map(|s| s.id));
    }
    out.truncate(seq.len());
    assert_eq!(out, seq);
    // The test exercised both partial and full accepts.
    assert!(
        accepted > rounds && accepted < 4 * rounds,
        "accepted {accepted} in {rounds} rounds"
    );
}

/// The device fast path: a greedy sampler fed the row's statistics picks what `sample` picks, with
/// the same logprob (up to the lse's rounding) and the same RNG advance; any other sampler, or
/// unusable statistics, declines.
#[test]
fn sample_from_stats_equals_greedy_sample() {
    use bonsai_engine::sampling::LogitStats;
    let mut x = 7u64;
    let mut next = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 40) as f32 / 16777216.0) * 20.0 - 10.0
    };
    let mut logits: Vec<f32> = (0..5000).map(|_| next()).collect();
    logits[17] = 30.0;
    logits[4000] = 30.0; // tie: the first wins
    logits[5] = f32::NAN;
    let m = 30.0f32;
    let lse = m as f64
        + logits
            .iter()
            .filter(|v| !v.is_nan())
            .map(|&v| ((v - m) as f64).exp())
            .sum::<f64>()
            .ln();
    let st = LogitStats {
        argmax: 17,
        max: m,
        lse,
    };
    let mut a = Sampler::new(SamplerParams::greedy());
    let mut b = Sampler::new(SamplerParams::greedy());
    assert!(b.stats_suffice());
    for _ in 0..3 {
        let want = a.sample(&logits);
        let got = b
            .sample_from_stats(&st, logits.len())
            .expect("greedy uses stats");
        assert_eq!(got.id, want.id);
        assert!(
            (got.logprob - want.logprob).abs() < 1e-5,
            "{got:?} vs {want:?}"
        );
        a.accept(want.id);
        b.accept(got.id);
    }
    // not greedy, or top logprobs asked: decline
    let mut c = Sampler::new(SamplerParams::default());
    assert!(c.sample_from_stats(&st, logits.len()).is_none());
    let mut d = Sampler::new(SamplerParams {
        n_logprobs: 2,
        ..SamplerParams::greedy()
    });
    assert!(d.sample_from_stats(&st, logits.len()).is_none());
    // unusable statistics: decline
    let mut e = Sampler::new(SamplerParams::greedy());
    let bad = LogitStats { argmax: 5000, ..st };
    assert!(e.sample_from_stats(&bad, logits.len()).is_none());
}

/// `sample_and_accept_n_stats` with no rows: a greedy sampler with usable statistics for every
/// row emits what `sample_and_accept_n` emits from the rows (same accept rule, same RNG and
/// history advance); rows are read only for a row whose statistics are unusable or a sampler
/// that needs them, and then they must be there.
#[test]
fn accept_n_stats_without_rows() {
    use bonsai_engine::sampling::LogitStats;
    let n_vocab = 10;
    let row = |best: usize| {
        let mut r: Vec<f32> = (0..n_vocab).map(|i| i as f32 * 0.01).collect();
        r[best] = 2.0;
        r
    };
    let best = [3usize, 1, 4, 1, 5];
    let rows: Vec<Vec<f32>> = best.iter().map(|&b| row(b)).collect();
    let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
    let stats: Vec<Option<LogitStats>> = rows
        .iter()
        .map(|r| {
            let (am, m) =
                r.iter().enumerate().fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                );
            let lse = m as f64
                + r.iter()
                    .map(|&v| (v as f64 - m as f64).exp())
                    .sum::<f64>()
                    .ln();
            Some(LogitStats {
                argmax: am as u32,
                max: m,
                lse,
            })
        })
        .collect();
    let ids = |v: Vec<Sampled>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
    for draft in [[3, 1, 4, 1], [3, 1, 9, 1], [0, 1, 4, 1]] {
        let mut a = Sampler::new(SamplerParams::greedy());
        let mut b = Sampler::new(SamplerParams::greedy());
        let want = a.sample_and_accept_n(&rows, &draft);
        let got = b.sample_and_accept_n_stats(&[], &stats, &draft, n_vocab);
        assert_eq!(ids(got), ids(want.clone()), "draft {draft:?}");
        // and with the rows as well: the same tokens
        let mut c = Sampler::new(SamplerParams::greedy());
        assert_eq!(
            ids(c.sample_and_accept_n_stats(&rows, &stats, &draft, n_vocab)),
            ids(want)
        );
    }
    // a sampler that needs rows reads them: given, the same tokens as from the rows alone
    let p = SamplerParams {
        n_logprobs: 2,
        ..SamplerParams::greedy()
    };
    let mut d = Sampler::new(p.clone());
    let mut e = Sampler::new(p.clone());
    let want = d.sample_and_accept_n(&rows, &[3, 1, 4, 1]);
    let got = e.sample_and_accept_n_stats(&rows, &stats, &[3, 1, 4, 1], n_vocab);
    assert_eq!(ids(got), ids(want));
    // ...and missing, it is a broken backend contract: a panic, not a wrong token
    let missing = std::panic::catch_unwind(|| {
        let mut f = Sampler::new(p);
        f.sample_and_accept_n_stats(&[], &stats, &[3], n_vocab)
    });
    assert!(missing.is_err(), "a needed row that is missing panics");
    // an unusable statistics row with no rows: also a panic
    let mut bad = stats.clone();
    bad[0] = None;
    let missing = std::panic::catch_unwind(move || {
        let mut f = Sampler::new(SamplerParams::greedy());
        f.sample_and_accept_n_stats(&[], &bad, &[3], n_vocab)
    });
    assert!(
        missing.is_err(),
        "a row with unusable statistics must be given"
    );
}
