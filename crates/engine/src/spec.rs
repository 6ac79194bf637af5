//! Speculative decoding (MODEL.md §4.7–§4.10, DESIGN.md §6): the verify round with lossless
//! sample-and-accept-n and rollback, the n-gram self-speculation proposer, and the policy that
//! decides from measured costs whether drafting pays.
//!
//! Rollback (§4.9): attention KV is truncated; the GDN conv + recurrent state is restored from the
//! pre-verify snapshot and then advanced over the accepted rows, either by replaying the recorded
//! per-row inputs ([`Rollback::Replay`], option C: no matmuls) or by re-running the target on them
//! ([`Rollback::Reforward`], option B). Both give the state a plain decode would have, bit for bit,
//! because the kernels (CPU and CUDA) are batch-invariant and the verify runs the GDN recurrently.
//! The round only uses [`Backend`] operations, so it runs on every backend that implements
//! `gdn_block_rec` and `gdn_replay` (on CUDA: device kernels; the state buffers keep their
//! addresses, so a captured decode graph stays valid across rounds).
//! The snapshot, the verify pass and the replay rollback go through [`Backend::round_snapshot`],
//! [`Backend::verify_forward`] and [`Backend::rollback_gdn`], whose defaults are the eager ops
//! (on CUDA the verify's GDN kernels write the snapshot and the replay reads it: no copies);
//! the CUDA backend replays captured graphs of the same launches by default (`BONSAI_CUDA_ROUND_GRAPH=0`: eager)
//! (and then returns per-row logit statistics, so a greedy accept does not scan the rows).

use std::collections::VecDeque;
use std::time::Instant;

use crate::backend::{gdn_rec_width, Backend, GdnMode};
use crate::config::TargetConfig;
use crate::error::Result;
use crate::model::{forward, Capture, LogitRows, SeqState, Weights};
use crate::sampling::{LogitStats, RowNeed, Sampled, Sampler};

/// How the GDN state is rolled back after a partial accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rollback {
    /// Restore the snapshot, replay the accepted rows from the verify record (option C).
    Replay,
    /// Restore the snapshot, run the target again over the accepted rows (option B).
    Reforward,
}

/// Reusable buffers of the verify round for one sequence.
pub struct RoundBufs<B: Backend> {
    /// Pre-verify GDN snapshot, one per GDN layer.
    snap: Vec<B::Gdn>,
    /// Verify records, one per GDN layer.
    recs: Vec<B::Act>,
    logits: Vec<f32>,
    /// Per-row logit statistics the backend returned with the last verify (empty when none).
    stats: Vec<Option<LogitStats>>,
    /// Per-row best entries the backend returned with the last verify (empty when none).
    tops: Vec<Vec<(u32, f32)>>,
    /// Verify taps `[rows, tap_width]` (rows of the last verify).
    pub taps: Vec<f32>,
}

impl<B: Backend> RoundBufs<B> {
    /// Logits `[rows, n_vocab]` of the last verify (tests compare them across backends' paths).
    /// Empty when the backend skipped the rows: the sampler did not need them
    /// ([`Sampler::row_need`]) and [`RoundBufs::stats`] (and [`RoundBufs::tops`] for a top-k
    /// sampler) serve every row (see [`Backend::verify_forward`], [`Backend::verify_forward_top`]).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
    /// Per-row logit statistics of the last verify, as the backend returned them (empty when it
    /// computed none; tests compare them with the logits rows).
    pub fn stats(&self) -> &[Option<LogitStats>] {
        &self.stats
    }
    /// Per-row best entries of the last verify, as the backend returned them for a top-k
    /// sampler (empty when it computed none; see [`Backend::verify_forward_top`]).
    pub fn tops(&self) -> &[Vec<(u32, f32)>] {
        &self.tops
    }
}

impl<B: Backend> RoundBufs<B> {
    pub fn new(b: &B, cfg: &TargetConfig, max_rows: usize) -> Result<RoundBufs<B>> {
        let n_gdn = cfg.n_gdn_layers();
        Ok(RoundBufs {
            snap: (0..n_gdn).map(|_| b.new_gdn(cfg)).collect::<Result<_>>()?,
            recs: (0..n_gdn)
                .map(|_| b.new_act(max_rows, gdn_rec_width(cfg)))
                .collect(),
            logits: Vec::new(),
            stats: Vec::new(),
            tops: Vec::new(),
            taps: Vec::new(),
        })
    }
}

/// What one verify round produced.
pub struct RoundOut {
    /// The emitted tokens: `n_acc` accepted drafts then one token sampled by the target.
    pub tokens: Vec<Sampled>,
    /// Drafts accepted (`tokens.len() − 1`).
    pub n_acc: usize,
    /// Where the round's time went (wall clock, seconds).
    pub timing: RoundTiming,
}

/// Wall-clock split of one verify round (the rollback benchmark reads it).
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundTiming {
    /// Pre-verify GDN snapshot copy.
    pub snapshot_s: f64,
    /// Target pass over the verify rows plus sampling/accept.
    pub verify_s: f64,
    /// Rollback + commit of the accepted rows (0 after a full accept).
    pub rollback_s: f64,
}

/// One speculative round after the drafts are known: verify `[id_last, draft…]` at `st.pos` in one
/// target pass (recurrent GDN, logits for every row, taps of every row when `tap_layers` is given),
/// accept with the full sampler chain (on a backend with per-row statistics a greedy accept reads
/// no rows, and `bufs.logits()` may then be empty), and roll the state back to "after row
/// `start + n_acc`". On return `st.pos = start + n_acc + 1`, and `bufs.taps` rows `0 ..= n_acc` are the committed
/// rows' taps.
#[allow(clippy::too_many_arguments)]
pub fn verify_round<B: Backend>(
    b: &B,
    cfg: &TargetConfig,
    w: &Weights<B>,
    st: &mut SeqState<B>,
    bufs: &mut RoundBufs<B>,
    sampler: &mut Sampler,
    id_last: u32,
    draft: &[u32],
    tap_layers: Option<&[usize]>,
    rollback: Rollback,
) -> Result<RoundOut> {
    let start = st.pos;
    let mut ids = Vec::with_capacity(draft.len() + 1);
    ids.push(id_last);
    ids.extend_from_slice(draft);
    let n = ids.len();
    let mut timing = RoundTiming::default();
    let t = Instant::now();
    // 1. snapshot the GDN state (the rollback point; complete once the verify has returned)
    b.round_snapshot(&st.gdn, &mut bufs.snap)?;
    timing.snapshot_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    // 2. verify: n rows, each computed exactly as a single-token step (on CUDA with
    //    by default one captured graph per row count, with per-row logit statistics)
    let taps = tap_layers.map(|layers| (layers, &mut bufs.taps));
    //    (the rows only when the sampler reads them: a greedy accept uses the statistics, and the
    //    backend still fills the rows when any row's statistics are unusable)
    //    (a top-k draw reads each row's best entries, which the backend may compute too)
    bufs.tops.clear();
    bufs.stats = match sampler.row_need() {
        RowNeed::Top(n_top) => b.verify_forward_top(
            cfg,
            w,
            st,
            &ids,
            &mut bufs.recs,
            taps,
            n_top,
            &mut bufs.logits,
            &mut bufs.tops,
        )?,
        need => b.verify_forward(
            cfg,
            w,
            st,
            &ids,
            &mut bufs.recs,
            taps,
            &mut bufs.logits,
            need == RowNeed::Row,
        )?,
    };
    // 3. accept: sample row i with the full chain, continue while it equals draft i
    let rows: Vec<&[f32]> = bufs.logits.chunks_exact(cfg.n_vocab).collect();
    let tokens =
        sampler.sample_and_accept_n_top(&rows, &bufs.stats, &bufs.tops, draft, cfg.n_vocab);
    let n_acc = tokens.len() - 1;
    let keep = n_acc + 1;
    timing.verify_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    // 4. roll back the rejected suffix
    if keep < n {
        for kv in st.kv.iter_mut() {
            b.truncate_kv(kv, start + keep);
        }
        match rollback {
            Rollback::Replay => {
                // restore the snapshot, then replay the accepted rows of every record
                b.rollback_gdn(cfg, &mut st.gdn, &bufs.snap, &bufs.recs, keep)?;
                st.pos = start + keep;
            }
            Rollback::Reforward => {
                b.copy_gdn_all(&bufs.snap, &mut st.gdn)?;
                for kv in st.kv.iter_mut() {
                    b.truncate_kv(kv, start);
                }
                st.pos = start;
                let mut scratch = Vec::new();
                forward(
                    b,
                    cfg,
                    w,
                    st,
                    &ids[..keep],
                    GdnMode::Recurrent,
                    LogitRows::None,
                    &mut scratch,
                    Capture::none(),
                )?;
            }
        }
        timing.rollback_s = t.elapsed().as_secs_f64();
    }
    Ok(RoundOut {
        tokens,
        n_acc,
        timing,
    })
}

/// N-gram self-speculation: draft the tokens that followed the most recent earlier occurrence of the
/// longest suffix (up to `max_n` tokens) of `history`. Empty when nothing matches.
pub fn ngram_draft(history: &[u32], max_n: usize, k: usize) -> Vec<u32> {
    let len = history.len();
    for n in (1..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &history[len - n..];
        // candidate match ends at e (exclusive), e < len; latest first
        for e in (n..len).rev() {
            if &history[e - n..e] == suffix {
                let out: Vec<u32> = history[e..len.min(e + k)].to_vec();
                if !out.is_empty() {
                    return out;
                }
            }
        }
    }
    Vec::new()
}

/// When to draft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyMode {
    /// Measure, switch off when drafting loses, re-probe periodically.
    Auto,
    /// Always draft (tests, benchmarks).
    Always,
    /// Never draft.
    Never,
}

impl PolicyMode {
    pub fn parse(s: &str) -> Option<PolicyMode> {
        match s {
            "auto" => Some(PolicyMode::Auto),
            "always" | "on" => Some(PolicyMode::Always),
            "never" | "off" => Some(PolicyMode::Never),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyMode::Auto => "auto",
            PolicyMode::Always => "always",
            PolicyMode::Never => "never",
        }
    }
}

/// Exponential moving average with a sample count.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ema {
    pub value: f64,
    pub n: u64,
}

impl Ema {
    fn add(&mut self, x: f64) {
        self.value = if self.n == 0 {
            x
        } else {
            0.8 * self.value + 0.2 * x
        };
        self.n += 1;
    }
}

/// One policy decision, with the numbers behind it.
#[derive(Clone, Debug)]
pub struct Decision {
    /// Engine-lifetime token count when it was taken.
    pub at_token: u64,
    /// "off", "on" (kept or re-enabled after a probe), "probe".
    pub action: &'static str,
    /// Round cost in plain decode steps.
    pub r: f64,
    pub tps_spec: f64,
    pub tps_plain: f64,
    pub acceptance: f64,
    pub reason: String,
}

/// The drafting policy (DESIGN.md §6): decides from the measured round cost and realised throughput,
/// never from acceptance alone.
#[derive(Clone, Debug)]
pub struct Policy {
    pub mode: PolicyMode,
    /// Whether rounds run now (Auto mode).
    pub enabled: bool,
    /// Seconds per plain decode step.
    pub t_plain: Ema,
    /// Seconds per speculative round (draft + verify + accept + rollback).
    pub t_round: Ema,
    /// Tokens emitted per round.
    pub tok_round: Ema,
    /// Drafts accepted / drafted, per round.
    pub accept: Ema,
    /// Tokens since the last re-measurement (on) or decision (off).
    since: u64,
    /// Plain steps still to run for a measurement of the decode step.
    plain_left: u64,
    /// Rounds still to run before the next decision (first measurement or a re-probe).
    probe_left: u32,
    /// Plain tokens before the next re-probe while off: starts at `REPROBE_EVERY` and doubles
    /// after every probe that confirms "off" (up to `REPROBE_MAX`), so a drafter that keeps
    /// losing costs less and less; reset when drafting wins.
    reprobe_every: u64,
    pub tokens: u64,
    pub decisions: VecDeque<Decision>,
}

/// Rounds measured before the first decision and per re-probe.
const PROBE_ROUNDS: u32 = 6;
/// Plain tokens between re-probes while drafting is off.
const REPROBE_EVERY: u64 = 96;
/// Longest interval between re-probes.
const REPROBE_MAX: u64 = 96 * 64;
/// Tokens between plain re-measurements (and a fresh decision) while drafting is on.
const REMEASURE_EVERY: u64 = 192;
/// Plain steps per measurement.
const PLAIN_SAMPLES: u64 = 3;
const MAX_DECISIONS: usize = 64;

impl Policy {
    pub fn new(mode: PolicyMode) -> Policy {
        let auto = mode == PolicyMode::Auto;
        Policy {
            mode,
            enabled: mode != PolicyMode::Never,
            t_plain: Ema::default(),
            t_round: Ema::default(),
            tok_round: Ema::default(),
            accept: Ema::default(),
            since: 0,
            plain_left: if auto { PLAIN_SAMPLES } else { 0 },
            probe_left: if auto { PROBE_ROUNDS } else { 0 },
            reprobe_every: REPROBE_EVERY,
            tokens: 0,
            decisions: VecDeque::new(),
        }
    }

    /// Round cost in plain decode steps (0 until both are measured).
    pub fn r(&self) -> f64 {
        if self.t_plain.n == 0 || self.t_round.n == 0 {
            return 0.0;
        }
        self.t_round.value / self.t_plain.value
    }
    pub fn tps_plain(&self) -> f64 {
        if self.t_plain.n == 0 {
            0.0
        } else {
            1.0 / self.t_plain.value
        }
    }
    pub fn tps_spec(&self) -> f64 {
        if self.t_round.n == 0 {
            0.0
        } else {
            self.tok_round.value / self.t_round.value
        }
    }

    /// Should the next step be a speculative round?
    pub fn want_round(&self) -> bool {
        match self.mode {
            PolicyMode::Never => false,
            PolicyMode::Always => true,
            PolicyMode::Auto => self.enabled && self.plain_left == 0,
        }
    }

    pub fn record_plain(&mut self, seconds: f64) {
        self.t_plain.add(seconds);
        self.tokens += 1;
        if self.mode != PolicyMode::Auto {
            return;
        }
        if self.plain_left > 0 {
            self.plain_left -= 1;
            if self.plain_left == 0 && self.enabled && self.probe_left == 0 {
                self.decide();
            }
        }
        if !self.enabled {
            self.since += 1;
            if self.since >= self.reprobe_every {
                self.since = 0;
                self.enabled = true;
                self.probe_left = PROBE_ROUNDS;
                let every = self.reprobe_every;
                self.log(
                    "probe",
                    format!("re-probing drafting after {every} plain tokens"),
                );
            }
        }
    }

    pub fn record_round(&mut self, seconds: f64, emitted: usize, drafted: usize, accepted: usize) {
        self.t_round.add(seconds);
        self.tok_round.add(emitted as f64);
        if drafted > 0 {
            self.accept.add(accepted as f64 / drafted as f64);
        }
        self.tokens += emitted as u64;
        if self.mode != PolicyMode::Auto {
            return;
        }
        if self.probe_left > 0 {
            self.probe_left -= 1;
            if self.probe_left == 0 {
                self.decide();
            }
        } else {
            self.since += emitted as u64;
            if self.since >= REMEASURE_EVERY {
                self.since = 0;
                self.plain_left = PLAIN_SAMPLES;
            }
        }
    }

    /// Compare realised throughput both ways (never acceptance alone).
    fn decide(&mut self) {
        let (spec, plain) = (self.tps_spec(), self.tps_plain());
        let reason = format!(
            "spec {spec:.1} tok/s vs plain {plain:.1} tok/s (R = {:.2} decode steps per round, {:.2} tokens per round)",
            self.r(),
            self.tok_round.value
        );
        self.since = 0;
        let was_probe = self.decisions.back().is_some_and(|d| d.action == "probe");
        if spec > plain {
            self.enabled = true;
            self.reprobe_every = REPROBE_EVERY;
            self.log("on", reason);
        } else {
            self.enabled = false;
            if was_probe {
                self.reprobe_every = (self.reprobe_every * 2).min(REPROBE_MAX);
            }
            self.log("off", reason);
        }
    }

    fn log(&mut self, action: &'static str, reason: String) {
        let d = Decision {
            at_token: self.tokens,
            action,
            r: self.r(),
            tps_spec: self.tps_spec(),
            tps_plain: self.tps_plain(),
            acceptance: self.accept.value,
            reason,
        };
        self.decisions.push_back(d);
        while self.decisions.len() > MAX_DECISIONS {
            self.decisions.pop_front();
        }
    }
}

/// Speculation counters (per request and engine-wide).
#[derive(Clone, Copy, Debug, Default)]
pub struct SpecStats {
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Tokens emitted by rounds.
    pub round_tokens: u64,
    /// Tokens emitted by plain decode steps.
    pub plain_tokens: u64,
    pub round_seconds: f64,
    pub plain_seconds: f64,
    pub draft_seconds: f64,
}

impl SpecStats {
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
    pub fn tokens_per_round(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.round_tokens as f64 / self.rounds as f64
        }
    }
    pub fn add(&mut self, o: &SpecStats) {
        self.rounds += o.rounds;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.round_tokens += o.round_tokens;
        self.plain_tokens += o.plain_tokens;
        self.round_seconds += o.round_seconds;
        self.plain_seconds += o.plain_seconds;
        self.draft_seconds += o.draft_seconds;
    }
}

/// A timer for one step.
pub struct Timer(Instant);

impl Timer {
    pub fn start() -> Timer {
        Timer(Instant::now())
    }
    pub fn secs(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_takes_longest_latest_match() {
        //            0  1  2  3  4  5  6  7  8  9
        let h = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2];
        // suffix [1, 2] (len 2) most recently at 4..6 → continuation [3, 7, 1, 2]
        assert_eq!(ngram_draft(&h, 3, 4), vec![3, 7, 1, 2]);
        assert_eq!(ngram_draft(&h, 3, 2), vec![3, 7]);
        assert!(ngram_draft(&[5, 6, 7], 3, 4).is_empty());
        assert!(ngram_draft(&[], 3, 4).is_empty());
    }

    #[test]
    fn policy_switches_off_when_rounds_lose_and_reprobes() {
        let mut p = Policy::new(PolicyMode::Auto);
        assert!(!p.want_round(), "measures plain steps first");
        for _ in 0..PLAIN_SAMPLES {
            p.record_plain(0.010);
        }
        assert!(p.want_round());
        // rounds cost 5 decode steps and emit 1.2 tokens: a loss
        for _ in 0..PROBE_ROUNDS {
            p.record_round(0.050, 1, 4, 0);
        }
        assert!(!p.enabled);
        let d = p.decisions.back().unwrap();
        assert_eq!(d.action, "off");
        assert!((d.r - 5.0).abs() < 1e-9 && d.tps_spec < d.tps_plain);
        assert!(!p.want_round());
        for _ in 0..REPROBE_EVERY {
            p.record_plain(0.010);
        }
        assert!(
            p.want_round(),
            "re-probes after {REPROBE_EVERY} plain tokens"
        );
        // now rounds win (cheap and fully accepted): re-enabled after the probe
        for _ in 0..PROBE_ROUNDS {
            p.record_round(0.012, 5, 4, 4);
        }
        assert!(p.enabled, "{:?}", p.decisions);
        assert_eq!(p.decisions.back().unwrap().action, "on");
    }

    #[test]
    fn policy_reprobe_interval_backs_off_while_drafting_keeps_losing() {
        let mut p = Policy::new(PolicyMode::Auto);
        for _ in 0..PLAIN_SAMPLES {
            p.record_plain(0.010);
        }
        let mut interval = REPROBE_EVERY;
        for probe in 0..4 {
            for _ in 0..PROBE_ROUNDS {
                p.record_round(0.050, 1, 4, 0);
            }
            if probe > 0 {
                interval *= 2; // every losing re-probe doubles the wait
            }
            assert!(
                !p.enabled,
                "probe {probe}: a losing drafter is switched off"
            );
            for _ in 0..interval - 1 {
                p.record_plain(0.010);
            }
            assert!(
                !p.want_round(),
                "probe {probe}: no re-probe before {interval} plain tokens"
            );
            p.record_plain(0.010);
            assert!(
                p.want_round(),
                "probe {probe}: re-probe after {interval} plain tokens"
            );
        }
        assert!(interval > REPROBE_EVERY);
    }

    #[test]
    fn policy_never_decides_from_acceptance_alone() {
        let mut p = Policy::new(PolicyMode::Auto);
        for _ in 0..PLAIN_SAMPLES {
            p.record_plain(0.010);
        }
        // full acceptance but each round costs 10 steps for 5 tokens: off
        for _ in 0..PROBE_ROUNDS {
            p.record_round(0.100, 5, 4, 4);
        }
        assert!(!p.enabled);
        assert!(p.accept.value > 0.99);
    }
}
