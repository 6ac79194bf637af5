//! Host sampler cost on a full 248,320-entry vocabulary row (`#[ignore]`: a benchmark, not a
//! test). `cargo test --release -p bonsai-engine --test sampler_bench -- --ignored --nocapture`;
//! with `BONSAI_SAMPLER_BENCH_OUT` set, writes the JSON there (`bench/results/host-sampler.json`).
//!
//! Two rows: a peaked one (a few clear leaders above a roughly normal bulk, like a language
//! model's at moderate temperature) and a flat one (uniform in [-10, 10]: the nucleus is most of
//! the vocabulary). Medians of 5 runs of 100 draws each.

use std::time::Instant;

use bonsai_engine::sampling::{Sampler, SamplerParams};

const N_VOCAB: usize = 248_320;

struct Lcg(u64);

impl Lcg {
    fn unit(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 40) as f32 / 16_777_216.0
    }
}

fn rows() -> [(&'static str, Vec<f32>); 2] {
    let mut r = Lcg(7);
    let peaked = (0..N_VOCAB)
        .map(|i| {
            let g = ((0..4).map(|_| r.unit()).sum::<f32>() - 2.0) * 3.4;
            if i % 50_000 == 7 {
                g + 14.0
            } else {
                g
            }
        })
        .collect();
    let flat = (0..N_VOCAB).map(|_| r.unit() * 20.0 - 10.0).collect();
    [("peaked", peaked), ("flat", flat)]
}

#[test]
#[ignore = "a benchmark: run with --ignored --nocapture"]
fn host_sampler_bench() {
    let cases = [
        (
            "top-k 20, top-p 0.95, T 0.7 (defaults)",
            SamplerParams::default(),
        ),
        (
            "the defaults + presence penalty 0.5 (64 tokens seen)",
            SamplerParams {
                presence_penalty: 0.5,
                ..Default::default()
            },
        ),
        (
            "top-k off, top-p 0.95, T 0.7",
            SamplerParams {
                top_k: 0,
                ..Default::default()
            },
        ),
        (
            "top-k off, min-p 0.05, T 0.7",
            SamplerParams {
                top_k: 0,
                top_p: 1.0,
                min_p: 0.05,
                ..Default::default()
            },
        ),
        ("greedy", SamplerParams::greedy()),
    ];
    let mut out = Vec::new();
    for (row_name, row) in rows() {
        for (name, p) in &cases {
            let mut s = Sampler::new(p.clone());
            for i in 0..64 {
                s.accept(i * 7);
            }
            let mut runs: Vec<f64> = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..100 {
                        std::hint::black_box(s.sample(&row));
                    }
                    t.elapsed().as_secs_f64() * 1e6 / 100.0
                })
                .collect();
            runs.sort_by(|a, b| a.total_cmp(b));
            println!(
                "SAMPLERBENCH {row_name:<6} {name:<55} {:8.1} us per draw",
                runs[2]
            );
            out.push(format!(
                "{{\"row\": \"{row_name}\", \"sampler\": \"{name}\", \"us_per_draw_median\": {:.1}, \"us_per_draw_runs\": {:?}}}",
                runs[2],
                runs.iter().map(|x| (x * 10.0).round() / 10.0).collect::<Vec<_>>()
            ));
        }
    }
    if let Ok(path) = std::env::var("BONSAI_SAMPLER_BENCH_OUT") {
        let json = format!(
            "{{\"n_vocab\": {N_VOCAB}, \"draws\": \"5 runs of 100, median\", \"rows\": [{}]}}",
            out.join(", ")
        );
        std::fs::write(path, json).unwrap();
    }
}
