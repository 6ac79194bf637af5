//! Micro-benchmark (ignored by default): GB/s of weight streamed by the low-bit matmul.
//!
//! `cargo test --release -p bonsai-kernels-cpu --test bench -- --ignored --nocapture`
//! Env: `BENCH_THREADS` (default: rayon's default), `BENCH_ITERS` (default 30), `BENCH_SCALAR=0` to
//! skip the (slow) scalar-fallback rows, `BENCH_SHAPE=<n_in>x<n_out>` (default 5120x17408),
//! `BENCH_N=1,5,512` (activation rows; default 1,5), `BENCH_TYPES=Q1_0,...` (weight types by
//! name), `BENCH_ISAS=avx512m,avx512,avx2m,avx2,scalar` (`…m`: the mask layout, `q1m` / `q2m`).

mod common;

use bonsai_kernels_cpu::attn::KvSource;
use bonsai_kernels_cpu::ops::{self, active_isa, isa_supported, Isa};
use bonsai_kernels_cpu::quant::QuantType;
use common::*;
use std::time::Instant;

fn env_usize(k: &str) -> Option<usize> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

/// A comma list of numbers from the environment (`BENCH_N=1,5,512`), else `default`.
fn env_list(k: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(k)
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

/// `BENCH_SHAPE=<n_in>x<n_out>`, default 5120x17408.
fn bench_shape() -> (usize, usize) {
    std::env::var("BENCH_SHAPE")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once('x')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((5120, 17408))
}

#[test]
#[ignore]
fn bench_lowbit_matmul() {
    let (n_in, n_out) = bench_shape();
    let ns = env_list("BENCH_N", &[1, 5]);
    let iters = env_usize("BENCH_ITERS").unwrap_or(30);
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(t) = env_usize("BENCH_THREADS") {
        builder = builder.num_threads(t);
    }
    let pool = builder.build().unwrap();
    let mut rng = Rng::new(99);
    println!(
        "isa {:?}, threads {}, W [{n_in} -> {n_out}], {iters} iters",
        active_isa(),
        pool.current_num_threads()
    );
    let types: Vec<QuantType> = [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::Q2_0G64]
        .into_iter()
        .filter(|qt| {
            std::env::var("BENCH_TYPES").map_or(true, |v| {
                v.split(',').any(|t| t.eq_ignore_ascii_case(qt.name()))
            })
        })
        .collect();
    let isas: Vec<String> = std::env::var("BENCH_ISAS")
        .map(|v| v.split(',').map(|s| s.to_ascii_lowercase()).collect())
        .unwrap_or_default();
    let want = |name: &str| isas.is_empty() || isas.iter().any(|i| i == name);
    for qt in types {
        let w = random_weights(&mut rng, qt, n_in, n_out, false);
        for &n in &ns {
            let x = rng.vec(n * n_in, 1.0);
            let xq = ops::quantize_acts(&x, n, n_in);
            let mut y = vec![0f32; n * n_out];
            // the mask layout (Q1_0: q1m, Q2: q2m), named "Avx512m" / "Avx2m" in the table
            let wm = if !isa_supported(Isa::Avx2) {
                None
            } else if qt == QuantType::Q1_0 {
                Some(bonsai_kernels_cpu::q1m::pack(&w, n_in, n_out))
            } else {
                bonsai_kernels_cpu::q2m::pack(qt, &w, n_in, n_out)
            };
            let matmul_m = |isa: Isa, wm: &[u8], y: &mut [f32]| {
                ops::matmul_masked_isa(isa, wm, qt, n_in, n_out, &xq, y)
            };
            // one row of the table: 3 warm-up calls, then per-call times (the median and the
            // minimum resist a noisy shared machine)
            let row = |label: &str, its: usize, call: &mut dyn FnMut()| {
                for _ in 0..3 {
                    call();
                }
                let mut ts: Vec<f64> = (0..its)
                    .map(|_| {
                        let t0 = Instant::now();
                        call();
                        t0.elapsed().as_secs_f64()
                    })
                    .collect();
                ts.sort_by(f64::total_cmp);
                let (dt, dmin) = (ts[ts.len() / 2], ts[0]);
                println!(
                    "{:>10} n={n} {label}: {:8.3} ms/call median ({:.3} min), {:6.2} GB/s weights, {:7.2} G weight-MAC/s",
                    qt.name(),
                    dt * 1e3,
                    dmin * 1e3,
                    w.len() as f64 / dt / 1e9,
                    (n_in * n_out * n) as f64 / dt / 1e9
                );
            };
            for isa in [Isa::Avx512, Isa::Avx2] {
                let (Some(wm), true) = (&wm, isa_supported(isa)) else {
                    continue;
                };
                let label = format!("{isa:?}m");
                if !want(&label.to_ascii_lowercase()) {
                    continue;
                }
                pool.install(|| {
                    let mut ym = vec![0f32; n * n_out];
                    ops::matmul_q_isa(isa, &w, qt, n_in, n_out, &xq, &mut y);
                    matmul_m(isa, wm, &mut ym);
                    assert_eq!(y, ym, "mask layout differs from the file layout");
                    row(&label, iters, &mut || matmul_m(isa, wm, &mut ym));
                    std::hint::black_box(&ym);
                });
            }
            for isa in Isa::ALL.into_iter().rev() {
                if !isa_supported(isa) || !want(isa.name()) {
                    continue;
                }
                let want_scalar = std::env::var("BENCH_SCALAR")
                    .map(|v| v != "0")
                    .unwrap_or(true);
                if isa == Isa::Scalar && (active_isa() == Isa::Scalar || !want_scalar) {
                    continue;
                }
                let its = if isa == Isa::Scalar { 2 } else { iters };
                pool.install(|| {
                    row(&format!("{isa:?}"), its, &mut || {
                        ops::matmul_q_isa(isa, &w, qt, n_in, n_out, &xq, &mut y)
                    })
                });
            }
            std::hint::black_box(&y);
        }
    }
}

/// The load-time packers: GB/s of file bytes re-laid into the mask layouts (`BENCH_SHAPE`,
/// `BENCH_THREADS`; the median of 5 after a warm-up).
#[test]
#[ignore]
fn bench_mask_packers() {
    let (n_in, n_out) = bench_shape();
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(t) = env_usize("BENCH_THREADS") {
        builder = builder.num_threads(t);
    }
    let pool = builder.build().unwrap();
    let mut rng = Rng::new(7);
    for qt in [QuantType::Q1_0, QuantType::Q2_0G128, QuantType::Q2_0G64] {
        let w = random_weights(&mut rng, qt, n_in, n_out, false);
        let mut out = vec![0u8; w.len()];
        let mut ts: Vec<f64> = (0..6)
            .map(|_| {
                let t0 = Instant::now();
                pool.install(|| {
                    if qt == QuantType::Q1_0 {
                        bonsai_kernels_cpu::q1m::pack_into(&w, n_in, n_out, &mut out)
                    } else {
                        assert!(bonsai_kernels_cpu::q2m::pack_into(
                            qt, &w, n_in, n_out, &mut out
                        ))
                    }
                });
                t0.elapsed().as_secs_f64()
            })
            .collect();
        ts.remove(0);
        ts.sort_by(f64::total_cmp);
        let dt = ts[ts.len() / 2];
        println!(
            "pack {:>10}: {:7.2} ms for {} MB, {:5.2} GB/s",
            qt.name(),
            dt * 1e3,
            w.len() / 1_000_000,
            w.len() as f64 / dt / 1e9
        );
        std::hint::black_box(&out);
    }
}

/// The activation quantizer for one row (the decode step runs it before every low-bit projection,
/// on the forward's thread): µs per call at the 27B input widths (`BENCH_ITERS`, median).
#[test]
#[ignore]
fn bench_quantize_acts() {
    let iters = env_usize("BENCH_ITERS").unwrap_or(200);
    let mut rng = Rng::new(3);
    for n_in in [1024usize, 5120, 6144, 17408] {
        let x = rng.vec(n_in, 3.0);
        let mut ts: Vec<f64> = (0..iters)
            .map(|_| {
                let t0 = Instant::now();
                std::hint::black_box(ops::quantize_acts(&x, 1, n_in));
                t0.elapsed().as_secs_f64()
            })
            .collect();
        ts.sort_by(f64::total_cmp);
        let dt = ts[ts.len() / 2];
        println!(
            "quantize_acts 1 x {n_in:>6}: {:7.2} us ({:.2} ns/element)",
            dt * 1e6,
            dt * 1e9 / n_in as f64
        );
    }
}

/// A head-major cache `[n_kv, T, hd]` of `T` (f32, or f16 as the engine keeps it): a chunk of one
/// kv head's keys is one contiguous run, turned into f32 by `conv`.
struct HeadMajorKv<T> {
    k: Vec<T>, // [n_kv, T, hd]
    v: Vec<T>, // [n_kv, T, hd]
    t: usize,
    conv: fn(&[T], &mut [f32]),
}

impl<T: Sync> KvSource for HeadMajorKv<T> {
    fn keys(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]) {
        let o = (g * self.t + pos) * hd;
        (self.conv)(&self.k[o..o + out.len()], out);
    }
    fn values(&self, pos: usize, g: usize, hd: usize, out: &mut [f32]) {
        let o = (g * self.t + pos) * hd;
        (self.conv)(&self.v[o..o + out.len()], out);
    }
}

/// Gated causal attention (`attn::attention_gated`) over a K/V cache (position-major f32 unless
/// `BENCH_KV` says otherwise): µs per call (median of `BENCH_ITERS`) for decode / verify /
/// prefill-block row counts at a few context lengths, at the 27B's attention shape (24 q heads, 4 kv heads, hd 256) and `small`'s (8, 2, 128).
/// `BENCH_CTX` / `BENCH_N` (comma lists) and `BENCH_MODEL=27b|small` narrow the sweep;
/// `BENCH_KV=head` lays the cache out head-major, `head16` head-major in f16 (the engine's).
#[test]
#[ignore]
fn bench_attention() {
    use bonsai_kernels_cpu::attn::{attention_gated, AttnShape, F32Kv};
    let iters = env_usize("BENCH_ITERS").unwrap_or(20);
    let (ctxs, ns) = (
        env_list("BENCH_CTX", &[1024, 8192]),
        env_list("BENCH_N", &[1, 5, 32]),
    );
    let only = std::env::var("BENCH_MODEL").ok();
    let layout = std::env::var("BENCH_KV").unwrap_or_default(); // "", "head" or "head16"
    let mut rng = Rng::new(5);
    for (name, n_head, n_kv, hd) in [("27b", 24usize, 4usize, 256usize), ("small", 8, 2, 128)] {
        if only.as_deref().is_some_and(|m| m != name) {
            continue;
        }
        for &ctx in &ctxs {
            let k = rng.vec(ctx * n_kv * hd, 1.0);
            let v = rng.vec(ctx * n_kv * hd, 1.0);
            let pm = F32Kv { k: &k, v: &v, n_kv };
            // the same cache head-major (BENCH_KV=head)
            let hm = |x: &[f32]| {
                let mut o = vec![0f32; x.len()];
                for p in 0..ctx {
                    for g in 0..n_kv {
                        o[(g * ctx + p) * hd..(g * ctx + p + 1) * hd]
                            .copy_from_slice(&x[(p * n_kv + g) * hd..(p * n_kv + g + 1) * hd]);
                    }
                }
                o
            };
            let h16 = |x: &[f32]| -> Vec<half::f16> {
                hm(x).iter().map(|&f| half::f16::from_f32(f)).collect()
            };
            let hmkv = (layout == "head").then(|| HeadMajorKv {
                k: hm(&k),
                v: hm(&v),
                t: ctx,
                conv: |s: &[f32], o: &mut [f32]| o.copy_from_slice(s),
            });
            let hmkv16 = (layout == "head16").then(|| HeadMajorKv {
                k: h16(&k),
                v: h16(&v),
                t: ctx,
                conv: ops::f16_to_f32,
            });
            let kv: &dyn KvSource = match (&hmkv, &hmkv16) {
                (Some(h), _) => h,
                (_, Some(h)) => h,
                _ => &pm,
            };
            for &n in &ns {
                let q = rng.vec(n * n_head * hd, 2.0);
                let gate = rng.vec(n * n_head * hd, 3.0);
                let mut out = vec![0f32; q.len()];
                let s = AttnShape {
                    n,
                    pos0: ctx - n,
                    n_head,
                    n_kv,
                    hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                };
                attention_gated(kv, &q, &gate, s, &mut out);
                let mut ts: Vec<f64> = (0..iters)
                    .map(|_| {
                        let t0 = Instant::now();
                        attention_gated(kv, &q, &gate, s, &mut out);
                        t0.elapsed().as_secs_f64()
                    })
                    .collect();
                ts.sort_by(f64::total_cmp);
                println!(
                    "attention {name:>5} ctx {ctx:>5} rows {n:>2}: {:9.1} us",
                    ts[ts.len() / 2] * 1e6
                );
            }
        }
    }
}
