//! Optimized matmul vs the reference oracle, ISA exactness and batch/thread invariance.

mod common;

use bonsai_kernels_cpu::ops::{self, isa_supported, Isa};
use bonsai_kernels_cpu::quant::{dequantize_row, QuantType};
use bonsai_kernels_cpu::reference;
use common::*;

/// Shapes: n_in chosen to hit full 256-chunks, tail chunks (n_in % 256 != 0) and g64-only widths;
/// n_out not a multiple of the 16-row task.
fn shapes(qt: QuantType) -> Vec<(usize, usize)> {
    let be = qt.block_elems().max(32);
    let mut v = vec![
        (256usize.max(be), 1usize),
        (512, 33),
        (640, 17),
        (768, 9), // a 512-element pair and an unpaired 256-chunk (q1p layout)
        (128.max(be), 3),
        (1024, 50),
    ];
    if qt == QuantType::Q2_0G64 {
        v.push((64, 5));
        v.push((192, 7));
        v.push((320, 9));
    }
    if !qt.is_lowbit() {
        v.push((96, 5));
    }
    if matches!(qt, QuantType::F32 | QuantType::F16 | QuantType::BF16) {
        v.push((37, 4)); // width with a < 8 tail in dot_f32
    }
    v.into_iter()
        .filter(|&(n_in, _)| n_in % qt.block_elems() == 0 && (n_in % 32 == 0 || !qt.is_lowbit()))
        .collect()
}

fn dequant_matrix(w: &[u8], qt: QuantType, n_in: usize, n_out: usize) -> Vec<f32> {
    let rb = qt.row_bytes(n_in).unwrap();
    let mut m = vec![0f32; n_in * n_out]; // m: [n_out, n_in]
    for o in 0..n_out {
        dequantize_row(
            qt,
            &w[o * rb..(o + 1) * rb],
            &mut m[o * n_in..(o + 1) * n_in],
        );
    }
    m
}

/// Low-bit: the int8 activation error per element is at most d/2 = amax_b/254, so
/// |y − y_ref| ≤ Σ_b (amax_b/254)·Σ_{i∈b}|w_i| (+ f32 accumulation rounding). That bound is checked
/// against the f32-activation oracle; and against an f64 dot with the *dequantized* activations the
/// only error left is f32 rounding (relative 1e-5 of Σ|w·x̂|).
#[test]
fn matmul_matches_reference_all_types() {
    let mut rng = Rng::new(1);
    for qt in ALL_TYPES {
        for (n_in, n_out) in shapes(qt) {
            for n in [1usize, 3] {
                let w = random_weights(&mut rng, qt, n_in, n_out, true);
                let x = rng.vec(n * n_in, 2.0);
                let mut y = vec![0f32; n * n_out];
                ops::matmul(&w, qt, n_in, n_out, &x, n, &mut y);
                let wm = dequant_matrix(&w, qt, n_in, n_out);
                for t in 0..n {
                    let xt = &x[t * n_in..(t + 1) * n_in];
                    let mut yr = vec![0f32; n_out];
                    reference::matvec(&w, qt, n_in, n_out, xt, &mut yr);
                    for o in 0..n_out {
                        let wr = &wm[o * n_in..(o + 1) * n_in];
                        let got = y[t * n_out + o];
                        let sum_abs: f64 =
                            wr.iter().zip(xt).map(|(a, b)| (a * b).abs() as f64).sum();
                        if qt.is_lowbit() {
                            let mut bound = 0f64;
                            for b in 0..n_in / 32 {
                                let amax = xt[32 * b..32 * b + 32]
                                    .iter()
                                    .fold(0f32, |m, v| m.max(v.abs()))
                                    as f64;
                                let wsum: f64 =
                                    wr[32 * b..32 * b + 32].iter().map(|v| v.abs() as f64).sum();
                                bound += amax / 254.0 * wsum;
                            }
                            let tol = bound * 1.001 + 1e-5 * sum_abs + 1e-6;
                            let err = (got as f64 - yr[o] as f64).abs();
                            assert!(
                                err <= tol,
                                "{} n_in={n_in} o={o}: {got} vs {} (err {err}, tol {tol})",
                                qt.name(),
                                yr[o]
                            );
                            // against the dequantized activations: only rounding remains
                            let xq = ops::quantize_acts(xt, 1, n_in);
                            let exact: f64 = (0..n_in)
                                .map(|i| wr[i] as f64 * xq.dequant(0, i) as f64)
                                .sum();
                            let sum_abs_q: f64 = (0..n_in)
                                .map(|i| (wr[i] as f64 * xq.dequant(0, i) as f64).abs())
                                .sum();
                            let err = (got as f64 - exact).abs();
                            assert!(
                                err <= 1e-5 * sum_abs_q + 1e-6,
                                "{} n_in={n_in} o={o}: {got} vs {exact}",
                                qt.name()
                            );
                        } else {
                            let err = (got as f64 - yr[o] as f64).abs();
                            assert!(
                                err <= 1e-5 * sum_abs + 1e-6,
                                "{} n_in={n_in} o={o}: {got} vs {}",
                                qt.name(),
                                yr[o]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Every SIMD ISA this CPU runs gives the scalar definition's bits, for every type, at 1–9 and 11
/// activation rows (every row-group size of the AVX2 and AVX-512 kernels, and a full 8-row
/// AVX-512 pass followed by a rest).
#[test]
fn simd_isas_equal_scalar_bits() {
    let simd: Vec<Isa> = Isa::ALL[1..]
        .iter()
        .copied()
        .filter(|&i| isa_supported(i))
        .collect();
    eprintln!(
        "simd_isas_equal_scalar_bits: comparing {:?} with scalar; not supported here: {:?}",
        simd,
        Isa::ALL
            .iter()
            .filter(|&&i| !isa_supported(i))
            .collect::<Vec<_>>()
    );
    if simd.is_empty() {
        eprintln!("SKIPPED simd_isas_equal_scalar_bits: scalar-only machine (not counted as run)");
        return;
    }
    let mut rng = Rng::new(2);
    for qt in ALL_TYPES {
        for (n_in, n_out) in shapes(qt) {
            for n in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 11] {
                let w = random_weights(&mut rng, qt, n_in, n_out, true);
                let x = rng.vec(n * n_in, 3.0);
                let mut ys = vec![0f32; n * n_out];
                ops::matmul_isa(Isa::Scalar, &w, qt, n_in, n_out, &x, n, &mut ys);
                for &isa in &simd {
                    let mut ya = vec![0f32; n * n_out];
                    ops::matmul_isa(isa, &w, qt, n_in, n_out, &x, n, &mut ya);
                    for i in 0..ys.len() {
                        assert_eq!(
                            ys[i].to_bits(),
                            ya[i].to_bits(),
                            "{} {isa:?} n={n} n_in={n_in} idx {i}: {} vs {}",
                            qt.name(),
                            ys[i],
                            ya[i]
                        );
                    }
                }
            }
        }
    }
}

/// y[t, o] must not depend on n (1, 5, 37) nor on the thread count (1 vs 2 vs default).
#[test]
fn batch_and_thread_invariance() {
    let mut rng = Rng::new(3);
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|&i| isa_supported(i)).collect();
    for qt in ALL_TYPES {
        let (n_in, n_out) = if qt.block_elems() == 1 {
            (160, 37)
        } else {
            (640, 37)
        };
        let w = random_weights(&mut rng, qt, n_in, n_out, false);
        let x = rng.vec(37 * n_in, 1.0);
        for &isa in &isas {
            let mut y37 = vec![0f32; 37 * n_out];
            ops::matmul_isa(isa, &w, qt, n_in, n_out, &x, 37, &mut y37);
            for threads in [1usize, 2] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    for (t0, n) in [(0usize, 1usize), (5, 1), (36, 1), (0, 5), (10, 5), (0, 37)] {
                        let mut y = vec![0f32; n * n_out];
                        ops::matmul_isa(
                            isa,
                            &w,
                            qt,
                            n_in,
                            n_out,
                            &x[t0 * n_in..(t0 + n) * n_in],
                            n,
                            &mut y,
                        );
                        for t in 0..n {
                            for o in 0..n_out {
                                assert_eq!(
                                    y[t * n_out + o].to_bits(),
                                    y37[(t0 + t) * n_out + o].to_bits(),
                                    "{} {isa:?} threads={threads} n={n} row {} out {o}",
                                    qt.name(),
                                    t0 + t
                                );
                            }
                        }
                    }
                });
            }
        }
    }
}

/// A prefill-sized matmul (many activation groups, weight rows past several tasks, both ragged)
/// equals the one-row matmul of each of its rows, bit for bit.
#[test]
fn many_rows_equal_single_rows() {
    let mut rng = Rng::new(9);
    let (n_in, n_out, n) = (512, 300, 200);
    for qt in ALL_TYPES.into_iter().filter(|q| q.is_lowbit()) {
        let w = random_weights(&mut rng, qt, n_in, n_out, false);
        let x = rng.vec(n * n_in, 1.0);
        let mut y = vec![0f32; n * n_out];
        ops::matmul(&w, qt, n_in, n_out, &x, n, &mut y);
        for t in [0, 7, 8, 127, 128, 199] {
            let mut y1 = vec![0f32; n_out];
            ops::matmul(
                &w,
                qt,
                n_in,
                n_out,
                &x[t * n_in..(t + 1) * n_in],
                1,
                &mut y1,
            );
            for o in 0..n_out {
                assert_eq!(
                    y[t * n_out + o].to_bits(),
                    y1[o].to_bits(),
                    "{} row {t} out {o}",
                    qt.name()
                );
            }
        }
    }
}

/// matmul_q with shared activations equals matmul, for every type.
#[test]
fn matmul_q_reuse_equals_matmul() {
    let mut rng = Rng::new(4);
    let n_in = 512;
    let n = 3;
    let x = rng.vec(n * n_in, 1.0);
    let xq = ops::quantize_acts(&x, n, n_in);
    for qt in ALL_TYPES {
        let n_out = 21;
        let w = random_weights(&mut rng, qt, n_in, n_out, false);
        let mut a = vec![0f32; n * n_out];
        let mut b = vec![0f32; n * n_out];
        ops::matmul(&w, qt, n_in, n_out, &x, n, &mut a);
        ops::matmul_q(&w, qt, n_in, n_out, &xq, &mut b);
        assert_eq!(a, b, "{}", qt.name());
    }
}

#[test]
fn quantize_acts_scheme() {
    let mut x = vec![0f32; 64];
    for (i, v) in x.iter_mut().enumerate().take(32) {
        *v = (i as f32 - 16.0) * 0.25; // amax = 4.0 (at i=0) -> d = 4/127
    }
    // block 1 stays all zero
    let xq = ops::quantize_acts(&x, 1, 64);
    let d = 4.0f32 / 127.0;
    assert_eq!(xq.dequant(0, 0), -127.0 * d);
    for i in 0..32 {
        let q = (x[i] * (1.0 / d)).round();
        assert_eq!(xq.dequant(0, i), q * d, "elem {i}");
        assert!((xq.dequant(0, i) - x[i]).abs() <= d / 2.0 * 1.0001);
    }
    for i in 32..64 {
        assert_eq!(xq.dequant(0, i), 0.0);
    }
    // round half away from zero: x = 0.5 d exactly → 1, −0.5 d → −1
    let mut y = vec![0f32; 32];
    y[0] = 127.0;
    y[1] = 0.5;
    y[2] = -0.5;
    let yq = ops::quantize_acts(&y, 1, 32);
    assert_eq!(yq.dequant(0, 1), 1.0);
    assert_eq!(yq.dequant(0, 2), -1.0);
}

/// Q2 weights with code 3 (+2d) are handled exactly (no ternary specialization).
#[test]
fn q2_code3_hand_check() {
    for qt in [QuantType::Q2_0G128, QuantType::Q2_0G64, QuantType::PQ2_0] {
        let n_in = 256;
        let rb = qt.row_bytes(n_in).unwrap();
        let mut w = vec![0xFFu8; rb]; // every code 3
        for b in 0..n_in / qt.block_elems() {
            w[b * qt.block_bytes()..b * qt.block_bytes() + 2]
                .copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        }
        let x = vec![1.0f32; n_in];
        let mut y = [0f32];
        ops::matmul(&w, qt, n_in, 1, &x, 1, &mut y);
        assert_eq!(y[0], 256.0, "{}", qt.name()); // 256 · (+2·0.5) · 1
    }
}

#[test]
fn dot_f32_exact_across_isa_and_close_to_f64() {
    let mut rng = Rng::new(5);
    for n in [0usize, 1, 7, 8, 9, 31, 32, 33, 100, 257, 5120] {
        let a = rng.vec(n, 1.0);
        let b = rng.vec(n, 1.0);
        let s = ops::dot_f32_isa(Isa::Scalar, &a, &b);
        if isa_supported(Isa::Avx2) {
            assert_eq!(
                s.to_bits(),
                ops::dot_f32_isa(Isa::Avx2, &a, &b).to_bits(),
                "n={n}"
            );
        }
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let sa: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (*x as f64 * *y as f64).abs())
            .sum();
        assert!((s as f64 - exact).abs() <= 1e-6 * sa + 1e-7, "n={n}");
    }
}

#[test]
fn f16_to_f32_simd_equals_scalar_exactly() {
    use bonsai_kernels_cpu::ops::{f16_to_f32_isa, isa_supported, Isa};
    use half::f16;
    // every finite and special f16 pattern, at a length with a tail
    let src: Vec<f16> = (0..=u16::MAX)
        .map(f16::from_bits)
        .chain((0..5).map(|i| f16::from_f32(i as f32)))
        .collect();
    let mut a = vec![0f32; src.len()];
    f16_to_f32_isa(Isa::Scalar, &src, &mut a);
    for (x, y) in src.iter().zip(&a) {
        assert!(x.to_f32().to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
    }
    if isa_supported(Isa::Avx2) {
        let mut b = vec![0f32; src.len()];
        f16_to_f32_isa(Isa::Avx2, &src, &mut b);
        for (x, y) in a.iter().zip(&b) {
            assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
        }
    }
}

#[test]
fn log_sum_exp_matches_f64_reference() {
    use bonsai_kernels_cpu::ops::log_sum_exp;
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    for &(n, spread) in &[
        (1usize, 1.0f64),
        (7, 3.0),
        (8, 5.0),
        (1000, 10.0),
        (248_320, 4.0),
        (5000, 200.0),
    ] {
        let x: Vec<f32> = (0..n)
            .map(|_| ((rnd() - 0.5) * 2.0 * spread) as f32)
            .collect();
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let exact = m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        let fast = log_sum_exp(&x);
        assert!(
            (fast - exact).abs() < 1e-5 * exact.abs().max(1.0),
            "n {n}: {fast} vs {exact}"
        );
    }
    assert_eq!(log_sum_exp(&[]), f64::NEG_INFINITY);
    assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 3]), f64::NEG_INFINITY);
    let with_ban = [0.0f32, f32::NEG_INFINITY, 0.0];
    assert!((log_sum_exp(&with_ban) - 2f64.ln()).abs() < 1e-6);
}

/// `round_to_i8` is `f32::round` then a clamp to ±127, for every f32 in ±2^8 at 1/2^14 steps
/// (halves, near-halves and integers included), big values, ±0, ±inf and NaN.
#[test]
fn round_to_i8_equals_round_then_clamp() {
    let mut vals: Vec<f32> = (-(1i32 << 22)..=(1 << 22))
        .map(|i| i as f32 / 16384.0)
        .collect();
    for v in [
        0.5f32,
        0.49999997,
        0.50000006,
        126.5,
        127.5,
        128.5,
        1e10,
        f32::MAX,
    ] {
        vals.extend([
            v,
            -v,
            f32::from_bits(v.to_bits() + 1),
            -f32::from_bits(v.to_bits() + 1),
        ]);
    }
    vals.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    for v in vals {
        let want = v.round().clamp(-127.0, 127.0) as i8;
        assert_eq!(ops::round_to_i8(v), want, "{v:e}");
    }
}

/// The SIMD dequantization of the 32-element block types equals `quant::dequantize_row` bit for bit
/// (random codes; scales random, subnormal, ±0 and ±inf), on every ISA this CPU runs.
/// `ops::dequantize_row_isa` on every ISA this CPU runs equals `dequantize_row` on the row `w` of
/// `n` elements of `qt`, bit for bit (any NaN for a NaN).
fn assert_isa_dequant_equals_scalar(qt: QuantType, w: &[u8], n: usize) {
    let mut want = vec![0f32; n];
    dequantize_row(qt, w, &mut want);
    for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
        let mut got = vec![0f32; n];
        ops::dequantize_row_isa(isa, qt, w, &mut got);
        for i in 0..n {
            assert!(
                got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan()),
                "{} {isa:?} n={n} i={i}: {} vs {}",
                qt.name(),
                got[i],
                want[i]
            );
        }
    }
}

#[test]
fn dequantize_row_isa_equals_scalar_bits() {
    let mut rng = Rng::new(11);
    let specials = [
        0x0000u16, 0x8000, 0x0001, 0x83ff, 0x7c00, 0xfc00, 0x3c00, 0x7bff,
    ];
    for qt in [QuantType::Q4_0, QuantType::Q4_1, QuantType::Q8_0] {
        for n in [32usize, 96, 4096] {
            let rb = qt.row_bytes(n).unwrap();
            let mut w: Vec<u8> = (0..rb).map(|_| (rng.u64() & 0xff) as u8).collect();
            for (i, blk) in w.chunks_exact_mut(qt.block_bytes()).enumerate() {
                // finite f16 scales (exponent < 31), some special ones
                for k in 0..(if qt == QuantType::Q4_1 { 2 } else { 1 }) {
                    let h = if i % 5 == 0 {
                        specials[(i / 5 + k) % specials.len()]
                    } else {
                        (rng.u64() as u16) & 0xfbff
                    };
                    blk[2 * k..2 * k + 2].copy_from_slice(&h.to_le_bytes());
                }
            }
            assert_isa_dequant_equals_scalar(qt, &w, n);
        }
    }
    // F16 / BF16 rows: every 16-bit pattern (infinities, NaNs, subnormals included), rows of whole
    // 32-element steps (the SIMD path) and not (the scalar fallback)
    for qt in [QuantType::F16, QuantType::BF16] {
        for n in [32usize, 96, 100, 65536] {
            let w: Vec<u8> = (0..n as u32)
                .flat_map(|i| {
                    let h = if n == 65536 {
                        i as u16
                    } else {
                        rng.u64() as u16
                    };
                    h.to_le_bytes()
                })
                .collect();
            assert_isa_dequant_equals_scalar(qt, &w, n);
        }
    }
}

/// Every ISA's quantizer gives the same codes, scales and sums, and the codes are the scheme's
/// (`d = amax / 127`, `q = round_to_i8(x · (1 / d))`, computed here block by block in element
/// order): widths with and without a partial last 256-element chunk, one and several rows, and
/// blocks holding NaN, ±inf, ±0, subnormals, exact halves and huge values.
#[test]
fn quantize_acts_same_bytes_every_isa() {
    let mut rng = Rng::new(5);
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        1e-42,
        -1e-42,
        1e30,
        -3e38,
        0.5,
        -0.5,
    ];
    let mut ran = 0;
    for n_in in [32usize, 64, 224, 256, 288, 512, 800, 1056, 5120] {
        for n in [1usize, 3] {
            let mut x = rng.vec(n * n_in, 4.0);
            for (i, s) in specials.iter().enumerate() {
                if rng.u64() % 3 == 0 {
                    let j = rng.u64() as usize % x.len();
                    x[j] = *s;
                }
                if i == 0 && n_in >= 64 {
                    // one all-zero block and one block of a single exact half-step value
                    x[32..64].iter_mut().for_each(|v| *v = 0.0);
                    x[0] = 127.0;
                    x[1] = 0.5;
                    x[2] = -1.5;
                }
            }
            // the scheme, in element order
            let n_pad = n_in.div_ceil(256) * 256;
            let mut want_q = vec![0i8; n * n_pad];
            let mut want_d = vec![0f32; n * n_pad / 32];
            let mut want_s = vec![0i32; n * n_pad / 32];
            for t in 0..n {
                for b in 0..n_in / 32 {
                    let xb = &x[t * n_in + 32 * b..t * n_in + 32 * b + 32];
                    let amax = xb.iter().fold(0f32, |m, &v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    let bi = t * n_pad / 32 + b;
                    want_d[bi] = d;
                    for (j, &v) in xb.iter().enumerate() {
                        let q = ops::round_to_i8(v * id);
                        want_q[t * n_pad + 32 * b + j] = q;
                        want_s[bi] += q as i32;
                    }
                }
            }
            for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
                let xq = ops::quantize_acts_isa(isa, &x, n, n_in);
                assert_eq!(xq.codes(), &want_q[..], "{isa:?} n_in {n_in} n {n}: codes");
                let same_d = xq
                    .scales()
                    .iter()
                    .zip(&want_d)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
                assert!(same_d, "{isa:?} n_in {n_in} n {n}: scales");
                assert_eq!(xq.sums(), &want_s[..], "{isa:?} n_in {n_in} n {n}: sums");
                ran += 1;
            }
        }
    }
    assert!(ran >= 18 * 2, "only the scalar ISA ran");
    // zero-width rows: no codes, no panic
    for n in [1usize, 3] {
        let xq = ops::quantize_acts(&[], n, 0);
        assert!(xq.codes().is_empty() && xq.scales().is_empty() && xq.sums().is_empty());
    }
}

/// `matmul_q_many` (a decode row's matrices in one parallel loop, on rayon and on a spinning
/// pool) gives each matrix what `matmul_q` / `matmul_masked` give alone, bit for bit: Q1_0 and the
/// Q2 types, file and mask layouts mixed, row counts that are not multiples of a task (48, 37),
/// and several activation rows (the per-matrix path).
#[test]
fn matmul_q_many_equals_one_matrix_at_a_time() {
    use bonsai_kernels_cpu::ops::MatQ;
    use bonsai_kernels_cpu::par::SpinPool;
    use bonsai_kernels_cpu::{q1m, q2m};
    let pool = SpinPool::new(3, std::time::Duration::from_micros(200)).unwrap();
    let mut rng = Rng::new(77);
    let n_in = 512;
    let kinds = [
        (QuantType::Q1_0, 300usize),
        (QuantType::Q2_0G128, 48),
        (QuantType::Q1_0, 37),
        (QuantType::Q2_0G64, 130),
        (QuantType::PQ2_0, 16),
    ];
    let ws: Vec<Vec<u8>> = kinds
        .iter()
        .map(|&(qt, n_out)| random_weights(&mut rng, qt, n_in, n_out, false))
        .collect();
    for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
        // the mask layouts where this ISA has them, every other matrix in the file layout
        let wm: Vec<Option<Vec<u8>>> = kinds
            .iter()
            .zip(&ws)
            .enumerate()
            .map(|(i, (&(qt, n_out), w))| {
                if isa == Isa::Scalar || i % 2 == 1 {
                    None
                } else if qt == QuantType::Q1_0 {
                    Some(q1m::pack(w, n_in, n_out))
                } else {
                    q2m::pack(qt, w, n_in, n_out)
                }
            })
            .collect();
        for n in [1usize, 3] {
            let x = rng.vec(n * n_in, 3.0);
            let xq = ops::quantize_acts(&x, n, n_in);
            let want: Vec<Vec<f32>> = kinds
                .iter()
                .zip(&ws)
                .map(|(&(qt, n_out), w)| {
                    let mut y = vec![0f32; n * n_out];
                    ops::matmul_q_isa(isa, w, qt, n_in, n_out, &xq, &mut y);
                    y
                })
                .collect();
            for on_pool in [false, true] {
                let mut got: Vec<Vec<f32>> = kinds
                    .iter()
                    .map(|&(_, n_out)| vec![0f32; n * n_out])
                    .collect();
                let mut mats: Vec<MatQ> = kinds
                    .iter()
                    .zip(&ws)
                    .zip(&wm)
                    .zip(got.iter_mut())
                    .map(|(((&(qt, n_out), w), m), y)| MatQ {
                        w: m.as_deref().unwrap_or(w),
                        qt,
                        masks: m.is_some(),
                        n_out,
                        y,
                    })
                    .collect();
                if on_pool {
                    pool.install(|| ops::matmul_q_many_isa(isa, &mut mats, &xq));
                } else {
                    ops::matmul_q_many_isa(isa, &mut mats, &xq);
                }
                drop(mats);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} n {n} pool {on_pool} matrix {i} ({:?})",
                        kinds[i].0
                    );
                }
            }
        }
    }
}
