//! The host sampler: the reference chain every device sampler must match, and the speculative
//! sample-and-accept-n rule (MODEL.md §4.8).
//!
//! Chain, in order, on one row of logits:
//! 1. **logit bias**: `l[id] += bias` for each `(id, bias)` in `logit_bias`.
//! 2. **penalties** over the last `penalty_last_n` accepted tokens (llama.cpp semantics): for a token
//!    seen `c > 0` times, repetition (`l > 0 ? l / r : l * r`), then `l -= c * frequency + presence`.
//! 3. **greedy** if `temperature == 0`: argmax, ties → lowest id. Steps 4–9 are skipped.
//! 4. **top-k** (`top_k > 0`): keep the k largest (ties → lower id).
//! 5. **temperature**: `l / T`.
//! 6. **softmax** over the kept candidates (f64). With top-k off the normalizer sums every finite
//!    candidate in id order, and only the lead candidates that top-p / min-p can keep get sorted.
//! 7. **top-p** (`top_p < 1`): keep the smallest prefix of the descending list whose mass is ≥ `top_p`.
//! 8. **min-p** (`min_p > 0`): keep candidates with `p ≥ min_p · p_max`.
//! 9. **renormalize** and **draw** by inverse CDF with one uniform from the seeded RNG.
//!
//! The RNG advances exactly once per [`Sampler::sample`] (also at temperature 0), so a sequence of draws
//! depends only on the seed and the number of samples taken, never on the parameters.
//!
//! **Reported log-probabilities** (the chosen token's and the top-N alternatives) are the log-softmax of
//! the logits after bias and penalties, *before* temperature and truncation: the model's own
//! distribution as the request shaped it, comparable across temperatures and finite for every token
//! (the OpenAI and vLLM "raw logprobs" convention).

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};

/// Largest `n_logprobs` accepted (OpenAI's `top_logprobs` limit).
pub const MAX_LOGPROBS: usize = 20;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    /// How many of the most recent accepted tokens the penalties look at; 0 disables penalties.
    pub penalty_last_n: usize,
    pub seed: u64,
    /// Top-N alternatives to report, 0..=20.
    pub n_logprobs: usize,
    /// Added to the logits before anything else. `-inf` bans a token.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerParams {
    /// Bonsai's recommended defaults (MODEL.md §5.4): temperature 0.7, top-p 0.95, top-k 20, min-p 0.
    fn default() -> Self {
        SamplerParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            penalty_last_n: 64,
            seed: 0x5EED_B0A5_A127_0001,
            n_logprobs: 0,
            logit_bias: Vec::new(),
        }
    }
}

fn bad(field: &str, msg: impl std::fmt::Display) -> Error {
    Error::InvalidRequest(format!("{field}: {msg}"))
}

impl SamplerParams {
    /// Plain argmax decoding, no truncation, no penalties.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        }
    }

    /// Checks every field; `Error::InvalidRequest` names the field and the allowed range. NaN is
    /// rejected everywhere.
    pub fn validate(&self, n_vocab: usize) -> Result<()> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(bad(
                "temperature",
                format!("{t} is outside [0, inf) (0 = greedy)"),
            ));
        }
        if self.top_p.is_nan() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(bad(
                "top_p",
                format!("{} is outside (0, 1] (1 = off)", self.top_p),
            ));
        }
        if self.min_p.is_nan() || !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad(
                "min_p",
                format!("{} is outside [0, 1] (0 = off)", self.min_p),
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_nan() || !(-2.0..=2.0).contains(&v) {
                return Err(bad(name, format!("{v} is outside [-2, 2] (0 = off)")));
            }
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(bad(
                "repetition_penalty",
                format!("{r} is outside (0, inf) (1 = off)"),
            ));
        }
        if self.n_logprobs > MAX_LOGPROBS {
            return Err(bad(
                "n_logprobs",
                format!("{} is outside [0, {MAX_LOGPROBS}]", self.n_logprobs),
            ));
        }
        for &(id, b) in &self.logit_bias {
            if id as usize >= n_vocab {
                return Err(bad(
                    "logit_bias",
                    format!("token id {id} is outside [0, {n_vocab})"),
                ));
            }
            if b.is_nan() || b == f32::INFINITY {
                return Err(bad(
                    "logit_bias",
                    format!("bias {b} for token {id} must be a number or -inf"),
                ));
            }
        }
        Ok(())
    }
}

/// Statistics of one logits row: the first maximum (NaN counts as −inf), its value, and the
/// log-sum-exp of the row. A backend may compute them where the logits live.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitStats {
    pub argmax: u32,
    pub max: f32,
    pub lse: f64,
}

/// What a [`Sampler`] reads of a logits row ([`Sampler::row_need`]); a backend may compute the
/// rest where the logits live and skip copying the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowNeed {
    /// The row's [`LogitStats`] alone: a greedy pick without top-N logprobs.
    Stats,
    /// The statistics and the row's `n` best entries, best first, in the sampler's order (value
    /// descending, then the lower id; NaN as −inf): a top-k draw with k ≤ n, or top-N logprobs.
    /// A row shorter than `n` gives all its entries.
    Top(usize),
    /// The whole row: logit bias, penalties, or a draw with no top-k bound.
    Row,
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub id: u32,
    /// Log-probability of `id` (see the module doc for which distribution).
    pub logprob: f32,
    /// Top-N `(id, logprob)`, descending, ties → lower id first; empty when `n_logprobs == 0`.
    pub top: Vec<(u32, f32)>,
}

/// xoshiro256** seeded by splitmix64: small, fast, identical on every platform.
#[derive(Clone, Debug)]
struct Rng {
    s: [u64; 4],
}

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Descending by value, ties → lower id first. NaN sorts last.
fn desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or_else(|| a.1.is_nan().cmp(&b.1.is_nan()))
        .then(a.0.cmp(&b.0))
}

/// Largest top-k taken by [`top_k_scan`] (larger k use a selection over the whole row).
const TOPK_SCAN_MAX: usize = 256;

/// The `k` best `(id, logit)` of `row` under [`desc`] (value descending, then lower id), in no
/// particular order, into `out`. One pass in increasing id order: an entry goes in only when it
/// beats the current k-th best, which almost every entry of a vocabulary row fails with one float
/// compare. The same set as selecting over the whole row, since `desc` is a total order.
fn top_k_scan(row: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    out.extend(row[..k].iter().enumerate().map(|(i, &l)| (i as u32, l)));
    // index of the worst kept entry and its value
    let worst = |v: &[(u32, f32)]| -> usize {
        let mut w = 0;
        for i in 1..v.len() {
            if desc(&v[w], &v[i]).is_lt() {
                w = i;
            }
        }
        w
    };
    let mut w = worst(out);
    let mut floor = out[w].1;
    for (i, &l) in row.iter().enumerate().skip(k) {
        // ids only increase, so an equal value loses to every kept entry (lower ids): strict >
        if l > floor {
            out[w] = (i as u32, l);
            w = worst(out);
            floor = out[w].1;
        }
    }
}

/// The `min(k, row.len())` best `(id, logit)` of `row` (k ≥ 1) into `out`, sorted by [`desc`]: a
/// one-pass scan for small k, a selection over the whole row otherwise.
fn best_sorted(row: &[f32], k: usize, out: &mut Vec<(u32, f32)>) {
    out.clear();
    if k <= TOPK_SCAN_MAX && k < row.len() {
        top_k_scan(row, k, out);
    } else {
        out.extend(row.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        if k < out.len() {
            out.select_nth_unstable_by(k - 1, desc);
            out.truncate(k);
        }
    }
    out.sort_unstable_by(desc);
}

/// Steps 5–9 of the chain on `cand`, the top-k candidates sorted by [`desc`] (NaN already −inf),
/// with the uniform `u` in [0, 1). The softmax normalizer is the sum over `cand` in that order.
fn draw_from(cand: &[(u32, f32)], sp: &SamplerParams, u: f64) -> u32 {
    // Drop banned tokens, unless every one is banned (then the first: lowest id).
    let finite = cand.iter().take_while(|c| c.1 > f32::NEG_INFINITY).count();
    if finite == 0 {
        return cand[0].0;
    }
    let cand = &cand[..finite];

    // 5–6. temperature and softmax (f64 accumulation).
    let inv_t = 1.0 / sp.temperature as f64;
    let l0 = cand[0].1 as f64 * inv_t;
    let mut probs: Vec<f64> = cand
        .iter()
        .map(|c| (c.1 as f64 * inv_t - l0).exp())
        .collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    let n = kept_prefix(&probs, sp, true).expect("a complete candidate list decides the cut");
    draw_kept(cand, &probs, n, u)
}

/// Steps 7–8 on `probs`, a prefix of the descending probabilities (`complete`: all of them): how
/// many lead candidates top-p and min-p keep, or `None` when that depends on candidates past the
/// prefix.
fn kept_prefix(probs: &[f64], sp: &SamplerParams, complete: bool) -> Option<usize> {
    // 7. top-p: smallest prefix with mass ≥ top_p.
    let mut n = probs.len();
    let mut decided = complete;
    if sp.top_p < 1.0 {
        let mut acc = 0.0;
        for (i, &p) in probs.iter().enumerate() {
            acc += p;
            if acc >= sp.top_p as f64 {
                n = i + 1;
                decided = true;
                break;
            }
        }
    }
    // 8. min-p relative to the most likely candidate (probs[0] is the maximum); a cut inside the
    // prefix is the cut of the whole list too.
    if sp.min_p > 0.0 {
        let floor = sp.min_p as f64 * probs[0];
        let kept = probs[..n]
            .iter()
            .take_while(|&&p| p >= floor)
            .count()
            .max(1);
        if kept < n {
            n = kept;
            decided = true;
        }
    }
    decided.then_some(n)
}

/// Step 9: renormalize the first `n` of `probs` and draw `cand`'s id by inverse CDF.
fn draw_kept(cand: &[(u32, f32)], probs: &[f64], n: usize, u: f64) -> u32 {
    let total: f64 = probs[..n].iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    for i in 0..n {
        acc += probs[i];
        if target < acc {
            return cand[i].0;
        }
    }
    cand[n - 1].0
}

/// Steps 5–9 with top-k off, on the whole row `work` (NaN already −inf): the softmax normalizer
/// is the sum of every finite candidate's exp in id order, and the candidates are sorted only as
/// far as top-p / min-p reach (the best 256, then 8× more until the cut is decided; a flat row
/// sorts all of them). `cand` is scratch.
fn draw_all(work: &[f32], sp: &SamplerParams, u: f64, cand: &mut Vec<(u32, f32)>) -> u32 {
    let (mut best, mut bv) = (0usize, f32::NEG_INFINITY);
    let mut n_finite = 0usize;
    for (i, &l) in work.iter().enumerate() {
        if l > bv {
            (best, bv) = (i, l);
        }
        n_finite += (l > f32::NEG_INFINITY) as usize;
    }
    if n_finite == 0 {
        // every token banned: the lowest id
        return 0;
    }
    let inv_t = 1.0 / sp.temperature as f64;
    let l0 = work[best] as f64 * inv_t;
    let sum: f64 = work
        .iter()
        .filter(|&&l| l > f32::NEG_INFINITY)
        .map(|&l| (l as f64 * inv_t - l0).exp())
        .sum();
    let mut m = 256usize;
    loop {
        let m_eff = m.min(work.len());
        best_sorted(work, m_eff, cand);
        let finite = cand.iter().take_while(|c| c.1 > f32::NEG_INFINITY).count();
        cand.truncate(finite);
        let probs: Vec<f64> = cand
            .iter()
            .map(|c| (c.1 as f64 * inv_t - l0).exp() / sum)
            .collect();
        if let Some(n) = kept_prefix(&probs, sp, finite == n_finite) {
            return draw_kept(cand, &probs, n, u);
        }
        m = m.saturating_mul(8);
    }
}

pub struct Sampler {
    p: SamplerParams,
    rng: Rng,
    /// Last `penalty_last_n` accepted tokens, oldest first, and their counts.
    history: VecDeque<u32>,
    counts: HashMap<u32, u32>,
    // Scratch, reused across calls.
    work: Vec<f32>,        // [n_vocab] biased + penalized logits
    cand: Vec<(u32, f32)>, // candidates (id, logit → prob)
}

impl Sampler {
    pub fn new(p: SamplerParams) -> Sampler {
        let rng = Rng::new(p.seed);
        Sampler {
            p,
            rng,
            history: VecDeque::new(),
            counts: HashMap::new(),
            work: Vec::new(),
            cand: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplerParams {
        &self.p
    }

    /// Clears the penalty history and re-seeds the RNG (a fresh request with the same params).
    pub fn reset(&mut self) {
        self.rng = Rng::new(self.p.seed);
        self.history.clear();
        self.counts.clear();
    }

    /// Samples one token from `logits` (`[n_vocab]` f32) with the chain in the module doc. Does not
    /// record the token: call [`Sampler::accept`] for the one that is emitted. Advances the RNG once.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let u = self.rng.next_f64();
        let n_vocab = logits.len();
        assert!(n_vocab > 0, "sample: empty logits");

        // 1–2. bias and penalties. NaN logits are treated as -inf.
        self.work.clear();
        self.work.extend(
            logits
                .iter()
                .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x }),
        );
        for &(id, b) in &self.p.logit_bias {
            if let Some(l) = self.work.get_mut(id as usize) {
                *l += b;
            }
        }
        let (rep, freq, pres) = (
            self.p.repetition_penalty,
            self.p.frequency_penalty,
            self.p.presence_penalty,
        );
        if rep != 1.0 || freq != 0.0 || pres != 0.0 {
            for (&id, &c) in &self.counts {
                let Some(l) = self.work.get_mut(id as usize) else {
                    continue;
                };
                if c == 0 {
                    continue;
                }
                *l = if *l > 0.0 { *l / rep } else { *l * rep };
                *l -= c as f32 * freq + pres;
            }
        }
        // Log-softmax normalizer of the penalized, unscaled logits (for reported logprobs).
        let lse = bonsai_kernels_cpu::ops::log_sum_exp(&self.work);

        let id = if self.p.temperature == 0.0 {
            // 3. greedy: first maximum.
            let work = &self.work;
            let mut best = 0u32;
            for (i, &l) in work.iter().enumerate() {
                if l > work[best as usize] {
                    best = i as u32;
                }
            }
            best
        } else {
            self.draw(u)
        };

        let work = &self.work;
        let logprob = |id: u32| -> f32 {
            if lse == f64::NEG_INFINITY {
                // Every token banned: report a uniform distribution.
                -(n_vocab as f32).ln()
            } else {
                (work[id as usize] as f64 - lse) as f32
            }
        };
        let top = if self.p.n_logprobs > 0 {
            let n = self.p.n_logprobs.min(n_vocab);
            let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
            for (i, &l) in work.iter().enumerate() {
                let e = (i as u32, l);
                if top.len() < n || desc(&e, &top[top.len() - 1]).is_lt() {
                    let pos = top.partition_point(|x| desc(x, &e).is_lt());
                    top.insert(pos, e);
                    top.truncate(n);
                }
            }
            top.into_iter().map(|(i, _)| (i, logprob(i))).collect()
        } else {
            Vec::new()
        };
        Sampled {
            id,
            logprob: logprob(id),
            top,
        }
    }

    /// Whether [`Sampler::sample_from_stats`] gives this sampler's result: greedy, with no bias,
    /// no penalties and no top-N logprobs (the pick needs only the row's argmax, max and lse).
    pub fn stats_suffice(&self) -> bool {
        self.row_need() == RowNeed::Stats
    }

    /// What this sampler reads of a row (see [`RowNeed`]): with bias or penalties the whole row
    /// (they change logits anywhere in it); greedy, the statistics, plus the best `n_logprobs`
    /// entries when it reports them; a draw, the best `max(top_k, n_logprobs)` entries when top-k
    /// is on, and the whole row when it is off (top-p / min-p alone may keep any number).
    pub fn row_need(&self) -> RowNeed {
        let p = &self.p;
        if !p.logit_bias.is_empty()
            || p.repetition_penalty != 1.0
            || p.frequency_penalty != 0.0
            || p.presence_penalty != 0.0
        {
            return RowNeed::Row;
        }
        if p.temperature == 0.0 {
            return match p.n_logprobs {
                0 => RowNeed::Stats,
                n => RowNeed::Top(n),
            };
        }
        match p.top_k {
            0 => RowNeed::Row,
            k => RowNeed::Top(k.max(p.n_logprobs)),
        }
    }

    /// [`Sampler::sample`] from what a backend computed where the logits live: the row's
    /// statistics and its best entries `top` (best first, in the sampler's order, NaN as −inf; at
    /// least `min(n, n_vocab)` of them for [`RowNeed::Top`]`(n)`). The same token as `sample` on the
    /// row and the same RNG advance; a reported logprob comes from the statistics' log-sum-exp.
    /// `None` (and no RNG advance) when this sampler needs the row, the statistics are unusable
    /// (every logit NaN or −inf), or `top` is too short: the caller then samples the row.
    pub fn sample_from_top(
        &mut self,
        st: &LogitStats,
        top: &[(u32, f32)],
        n_vocab: usize,
    ) -> Option<Sampled> {
        let need = match self.row_need() {
            RowNeed::Stats => 0,
            RowNeed::Top(n) => n.min(n_vocab),
            RowNeed::Row => return None,
        };
        if need == 0 {
            return self.sample_from_stats(st, n_vocab);
        }
        if st.argmax as usize >= n_vocab
            || !st.max.is_finite()
            || !st.lse.is_finite()
            || top.len() < need
        {
            return None;
        }
        let u = self.rng.next_f64();
        let lp = |l: f32| (l as f64 - st.lse) as f32;
        let (id, logprob) = if self.p.temperature == 0.0 {
            (st.argmax, lp(st.max))
        } else {
            // draw(): the top-k candidates, already in order (k ≤ need ≤ top.len())
            let k = self.p.top_k.min(n_vocab);
            let cand = &top[..k];
            let id = draw_from(cand, &self.p, u);
            let l = cand
                .iter()
                .find(|c| c.0 == id)
                .map_or(f32::NEG_INFINITY, |c| c.1);
            (id, lp(l))
        };
        let n_top = self.p.n_logprobs.min(n_vocab);
        Some(Sampled {
            id,
            logprob,
            top: top[..n_top].iter().map(|&(i, l)| (i, lp(l))).collect(),
        })
    }

    /// [`Sampler::sample`] from statistics of the row computed elsewhere (on the device): the
    /// first maximum and the log-sum-exp. Only valid when [`Sampler::stats_suffice`]; returns
    /// `None` otherwise, or when the statistics are unusable (every logit NaN or −inf), so the
    /// caller falls back to the full row. Advances the RNG once, like `sample`.
    pub fn sample_from_stats(&mut self, st: &LogitStats, n_vocab: usize) -> Option<Sampled> {
        if !self.stats_suffice()
            || st.argmax as usize >= n_vocab
            || !st.max.is_finite()
            || !st.lse.is_finite()
        {
            return None;
        }
        let _ = self.rng.next_f64();
        Some(Sampled {
            id: st.argmax,
            logprob: (st.max as f64 - st.lse) as f32,
            top: Vec::new(),
        })
    }

    /// Steps 4–9 on `self.work`, with the uniform `u` in [0, 1).
    fn draw(&mut self, u: f64) -> u32 {
        let work = &self.work;
        let cand = &mut self.cand;
        cand.clear();
        // 4. top-k, then sort the survivors descending.
        let k = self.p.top_k;
        if k == 0 {
            return draw_all(work, &self.p, u, cand);
        }
        best_sorted(work, k, cand);
        draw_from(cand, &self.p, u)
    }
    /// Records an emitted token into the penalty history.
    pub fn accept(&mut self, id: u32) {
        let last_n = self.p.penalty_last_n;
        if last_n == 0 {
            return;
        }
        self.history.push_back(id);
        *self.counts.entry(id).or_insert(0) += 1;
        while self.history.len() > last_n {
            if let Some(old) = self.history.pop_front() {
                if let Some(c) = self.counts.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
    }

    /// Sample-and-accept-n (MODEL.md §4.8). requires: `rows.len() == draft.len() + 1`, row `i` being
    /// the target's logits after the prefix extended by `draft[..i]`. Samples row `i`, accepts it, and
    /// continues while the sample equals `draft[i]`. Returns the emitted tokens (`n_accepted + 1` of
    /// them, at most `rows.len()`); the RNG and penalty history advance once per emitted token, exactly
    /// as plain decoding would.
    pub fn sample_and_accept_n(&mut self, rows: &[&[f32]], draft: &[u32]) -> Vec<Sampled> {
        let n_vocab = rows.first().map_or(0, |r| r.len());
        self.sample_and_accept_n_stats(rows, &[], draft, n_vocab)
    }

    /// [`Sampler::sample_and_accept_n`] that takes row `i` from `stats[i]` (statistics a backend
    /// computed where the logits live) through [`Sampler::sample_from_stats`] when that gives the
    /// result, and from the full row otherwise (missing, `None` or unusable statistics, or a
    /// sampler that needs the row). The same tokens as `sample_and_accept_n`; a reported logprob
    /// then comes from the device's log-sum-exp, as in a plain decode step.
    ///
    /// `rows` is either one row of `n_vocab` logits per verified position (`draft.len() + 1`) or
    /// empty: a backend may skip copying the rows when the caller does not need them
    /// ([`Sampler::stats_suffice`]) and every row's statistics are usable, and then no row is
    /// read. Panics when a row is needed but missing (a backend broke that contract).
    pub fn sample_and_accept_n_stats(
        &mut self,
        rows: &[&[f32]],
        stats: &[Option<LogitStats>],
        draft: &[u32],
        n_vocab: usize,
    ) -> Vec<Sampled> {
        self.sample_and_accept_n_top(rows, stats, &[], draft, n_vocab)
    }

    /// [`Sampler::sample_and_accept_n_stats`] that also takes each row's best entries `tops[i]`
    /// (empty: none), so a top-k sampler draws row `i` through [`Sampler::sample_from_top`]. The
    /// same tokens as `sample_and_accept_n`; rows are read only where the statistics and entries
    /// do not serve.
    pub fn sample_and_accept_n_top(
        &mut self,
        rows: &[&[f32]],
        stats: &[Option<LogitStats>],
        tops: &[Vec<(u32, f32)>],
        draft: &[u32],
        n_vocab: usize,
    ) -> Vec<Sampled> {
        let n = draft.len() + 1;
        debug_assert!(
            rows.is_empty() || rows.len() == n,
            "sample_and_accept_n: rows must be draft + 1 (or none)"
        );
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let top = tops.get(i).map_or(&[][..], |t| &t[..]);
            let from_stats = stats
                .get(i)
                .copied()
                .flatten()
                .and_then(|st| self.sample_from_top(&st, top, n_vocab));
            let s = match from_stats {
                Some(s) => s,
                None => {
                    let row = rows.get(i).copied().unwrap_or_else(|| {
                        panic!(
                            "sample_and_accept_n: row {i} needed (statistics missing or unusable, \
                             or a sampler that reads rows) but only {} rows were given",
                            rows.len()
                        )
                    });
                    debug_assert_eq!(row.len(), n_vocab, "sample_and_accept_n: row {i} width");
                    self.sample(row)
                }
            };
            self.accept(s.id);
            let matched = draft.get(i) == Some(&s.id);
            out.push(s);
            if !matched {
                break;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass top-k equals a selection over the whole row under `desc`, ties and −inf
    /// included.
    #[test]
    fn top_k_scan_equals_full_selection() {
        let mut rng = Rng::new(3);
        for case in 0..200 {
            let n = 1 + (rng.next_u64() % 3000) as usize;
            // few distinct values: many ties
            let row: Vec<f32> = (0..n)
                .map(|_| match rng.next_u64() % 10 {
                    0 => f32::NEG_INFINITY,
                    r => (r % 7) as f32 - (case % 3) as f32,
                })
                .collect();
            let k = 1 + (rng.next_u64() as usize % TOPK_SCAN_MAX.min(n));
            let mut got = Vec::new();
            top_k_scan(&row, k, &mut got);
            got.sort_unstable_by(desc);
            let mut want: Vec<(u32, f32)> = row
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l))
                .collect();
            want.sort_unstable_by(desc);
            want.truncate(k);
            assert_eq!(got, want, "case {case}: n {n} k {k}");
        }
    }

    /// A row's best `n` entries and its statistics as a device computes them (the CUDA
    /// kernels' host twins; NaN as −inf, −0 as +0), with the sampler's own log-sum-exp.
    fn device_view(row: &[f32], n: usize) -> (LogitStats, Vec<(u32, f32)>) {
        let st = bonsai_kernels_cuda::host_logit_stats(row);
        let mut top = bonsai_kernels_cuda::host_topk_row(row);
        top.truncate(n);
        let clean: Vec<f32> = row
            .iter()
            .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x })
            .collect();
        let st = LogitStats {
            argmax: st.argmax.unwrap_or(0),
            max: st.max,
            lse: bonsai_kernels_cpu::ops::log_sum_exp(&clean),
        };
        (st, top)
    }

    /// What each parameter set reads of a row.
    #[test]
    fn row_need_follows_the_chain() {
        let g = SamplerParams::greedy;
        let need = |p: SamplerParams| Sampler::new(p).row_need();
        assert_eq!(need(g()), RowNeed::Stats);
        let lp = SamplerParams {
            n_logprobs: 5,
            ..g()
        };
        assert_eq!(need(lp), RowNeed::Top(5));
        assert_eq!(need(SamplerParams::default()), RowNeed::Top(20));
        let more_lp = SamplerParams {
            n_logprobs: 20,
            top_k: 3,
            ..Default::default()
        };
        assert_eq!(need(more_lp), RowNeed::Top(20));
        let no_k = SamplerParams {
            top_k: 0,
            ..Default::default()
        };
        assert_eq!(need(no_k), RowNeed::Row);
        let bias = SamplerParams {
            logit_bias: vec![(3, 1.0)],
            ..g()
        };
        assert_eq!(need(bias), RowNeed::Row);
        for p in [
            SamplerParams {
                repetition_penalty: 1.1,
                ..Default::default()
            },
            SamplerParams {
                frequency_penalty: 0.5,
                ..g()
            },
            SamplerParams {
                presence_penalty: -0.5,
                ..Default::default()
            },
        ] {
            assert_eq!(need(p), RowNeed::Row);
        }
        assert!(Sampler::new(g()).stats_suffice());
        assert!(!Sampler::new(SamplerParams::default()).stats_suffice());
    }

    /// Sampling from a row's statistics and best entries gives the tokens, top-N lists and RNG
    /// stream of sampling the row itself, over sequences of draws with many parameter sets, on
    /// rows with ties, −inf, NaN and signed zeros, and vocabularies shorter than top-k.
    #[test]
    fn sample_from_top_equals_sample() {
        let mut rng = Rng::new(11);
        let mut cases = 0;
        for &n_vocab in &[7usize, 64, 3000] {
            for &t in &[0.0f32, 0.3, 0.7, 1.5] {
                for &k in &[1usize, 5, 20, 64] {
                    for &(top_p, min_p) in &[(1.0f32, 0.0f32), (0.95, 0.0), (0.5, 0.05), (1.0, 0.2)]
                    {
                        for &n_lp in &[0usize, 3, 20] {
                            let p = SamplerParams {
                                temperature: t,
                                top_k: k,
                                top_p,
                                min_p,
                                n_logprobs: n_lp,
                                seed: rng.next_u64(),
                                ..Default::default()
                            };
                            let need = match Sampler::new(p.clone()).row_need() {
                                RowNeed::Top(n) => n,
                                RowNeed::Stats => 0,
                                RowNeed::Row => unreachable!("no bias or penalties here"),
                            };
                            let mut a = Sampler::new(p.clone());
                            let mut b = Sampler::new(p);
                            for step in 0..6 {
                                let row: Vec<f32> = (0..n_vocab)
                                    .map(|_| match rng.next_u64() % 16 {
                                        0 => f32::NEG_INFINITY,
                                        1 => f32::NAN,
                                        2 => -0.0,
                                        3 => 0.0,
                                        r => (r % 5) as f32 * 0.5 - 1.0 + step as f32 * 0.1,
                                    })
                                    .collect();
                                let (st, top) = device_view(&row, need.min(n_vocab));
                                let want = a.sample(&row);
                                let got = b
                                    .sample_from_top(&st, &top, n_vocab)
                                    .expect("usable statistics and enough entries");
                                assert_eq!(
                                    got.id, want.id,
                                    "n_vocab {n_vocab} T {t} k {k} step {step}"
                                );
                                let ids =
                                    |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
                                assert_eq!(ids(&got.top), ids(&want.top), "top-N ids");
                                assert!((got.logprob - want.logprob).abs() <= 1e-6, "logprob");
                                a.accept(want.id);
                                b.accept(got.id);
                                cases += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(cases > 1000);
        // too few entries or unusable statistics: None, and the RNG does not move
        let p = SamplerParams::default();
        let row: Vec<f32> = (0..100).map(|i| (i % 13) as f32).collect();
        let (st, top) = device_view(&row, 20);
        let mut a = Sampler::new(p.clone());
        let mut b = Sampler::new(p);
        assert!(b.sample_from_top(&st, &top[..19], 100).is_none());
        let bad = LogitStats {
            lse: f64::NEG_INFINITY,
            ..st
        };
        assert!(b.sample_from_top(&bad, &top, 100).is_none());
        assert_eq!(
            b.sample_from_top(&st, &top, 100).unwrap().id,
            a.sample(&row).id
        );
    }

    /// Sample-and-accept-n from each row's statistics and best entries gives the tokens of the
    /// rows themselves, for top-k draws and greedy with top logprobs, with drafts that match up
    /// to every position.
    #[test]
    fn sample_and_accept_n_top_equals_rows() {
        let mut rng = Rng::new(5);
        let n_vocab = 500;
        for (case, p) in [
            SamplerParams {
                seed: 3,
                ..Default::default()
            },
            SamplerParams {
                temperature: 1.2,
                top_k: 4,
                top_p: 1.0,
                n_logprobs: 2,
                seed: 4,
                ..Default::default()
            },
            SamplerParams {
                n_logprobs: 5,
                ..SamplerParams::greedy()
            },
        ]
        .into_iter()
        .enumerate()
        {
            let RowNeed::Top(need) = Sampler::new(p.clone()).row_need() else {
                panic!("case {case}: a top-k sampler");
            };
            let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p));
            for round in 0..40 {
                // peaked rows, so that drafts of the likely token get accepted
                let rows: Vec<Vec<f32>> = (0..5)
                    .map(|_| {
                        let hot = (rng.next_u64() % 3) as usize;
                        (0..n_vocab)
                            .map(|i| {
                                let x = (rng.next_u64() % 1000) as f32 / 500.0;
                                if i == hot {
                                    x + 8.0
                                } else {
                                    x
                                }
                            })
                            .collect()
                    })
                    .collect();
                let views: Vec<_> = rows.iter().map(|r| device_view(r, need)).collect();
                let stats: Vec<Option<LogitStats>> = views.iter().map(|v| Some(v.0)).collect();
                let tops: Vec<Vec<(u32, f32)>> = views.iter().map(|v| v.1.clone()).collect();
                let draft: Vec<u32> = (0..4).map(|_| (rng.next_u64() % 3) as u32).collect();
                let refs: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
                let want = a.sample_and_accept_n(&refs, &draft);
                let got = b.sample_and_accept_n_top(&[], &stats, &tops, &draft, n_vocab);
                let ids = |v: &[Sampled]| v.iter().map(|x| x.id).collect::<Vec<_>>();
                assert_eq!(ids(&got), ids(&want), "case {case} round {round}");
            }
        }
    }

    /// The chain with top-k off as a plain full sort would run it (every candidate sorted, the
    /// softmax normalizer summed in id order): the reference for `draw_all`'s partial sorting.
    fn full_sort_reference(row: &[f32], p: &SamplerParams, u: f64) -> u32 {
        let work: Vec<f32> = row
            .iter()
            .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x })
            .collect();
        let mut cand: Vec<(u32, f32)> = work
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        cand.sort_by(desc);
        let finite = cand.iter().take_while(|c| c.1 > f32::NEG_INFINITY).count();
        if finite == 0 {
            return cand[0].0;
        }
        cand.truncate(finite);
        let inv_t = 1.0 / p.temperature as f64;
        let l0 = cand[0].1 as f64 * inv_t;
        let sum: f64 = work
            .iter()
            .filter(|&&l| l > f32::NEG_INFINITY)
            .map(|&l| (l as f64 * inv_t - l0).exp())
            .sum();
        let probs: Vec<f64> = cand
            .iter()
            .map(|c| (c.1 as f64 * inv_t - l0).exp() / sum)
            .collect();
        let mut n = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    n = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p as f64 * probs[0];
            n = probs[..n]
                .iter()
                .take_while(|&&q| q >= floor)
                .count()
                .max(1);
        }
        let total: f64 = probs[..n].iter().sum();
        let mut acc = 0.0;
        for i in 0..n {
            acc += probs[i];
            if u * total < acc {
                return cand[i].0;
            }
        }
        cand[n - 1].0
    }

    /// With top-k off the sampler sorts only as far as top-p / min-p reach, and draws what a
    /// full sort draws: peaked rows (a short nucleus), flat rows (the prefix grows to the whole
    /// row), ties, −inf and NaN, vocabularies below and above the first prefix of 256.
    #[test]
    fn top_k_off_equals_full_sort() {
        let mut rng = Rng::new(21);
        let mut cases = 0;
        for &n_vocab in &[50usize, 1000, 5000] {
            for &t in &[0.3f32, 0.7, 1.5] {
                for &(top_p, min_p) in &[
                    (0.95f32, 0.0f32),
                    (0.5, 0.0),
                    (0.999_999, 0.0),
                    (1.0, 0.0),
                    (1.0, 0.01),
                    (0.9, 0.2),
                ] {
                    let p = SamplerParams {
                        temperature: t,
                        top_k: 0,
                        top_p,
                        min_p,
                        seed: rng.next_u64(),
                        ..Default::default()
                    };
                    let mut s = Sampler::new(p.clone());
                    let mut r = Rng::new(p.seed);
                    for step in 0..8 {
                        let spread = [0.01f32, 1.0, 6.0, 30.0][step % 4];
                        let row: Vec<f32> = (0..n_vocab)
                            .map(|_| match rng.next_u64() % 50 {
                                0 => f32::NEG_INFINITY,
                                1 => f32::NAN,
                                2 => 3.0, // ties at a high value
                                x => (x as f32 / 50.0 - 0.5) * spread,
                            })
                            .collect();
                        let want = full_sort_reference(&row, &p, r.next_f64());
                        let got = s.sample(&row).id;
                        assert_eq!(
                            got, want,
                            "n_vocab {n_vocab} T {t} top_p {top_p} min_p {min_p} step {step}"
                        );
                        cases += 1;
                    }
                }
            }
        }
        assert!(cases >= 400);
        // every token banned: the lowest id, as a full sort gives
        let mut s = Sampler::new(SamplerParams {
            top_k: 0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 300]).id, 0);
    }
}
