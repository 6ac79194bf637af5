//! GDN (step and chunked), attention and the small reference ops.

mod common;

use bonsai_kernels_cpu::ops::{self, isa_supported, Isa};
use bonsai_kernels_cpu::reference as r;
use common::*;

struct GdnCase {
    h_k: usize,
    h_v: usize,
    d_k: usize,
    d_v: usize,
    t: usize,
    s0: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn gdn_case(seed: u64, t: usize, h_k: usize, h_v: usize, d_k: usize, d_v: usize) -> GdnCase {
    let mut rng = Rng::new(seed);
    let mut q = rng.vec(t * h_k * d_k, 1.0);
    let mut k = rng.vec(t * h_k * d_k, 1.0);
    r::l2norm_heads(&mut q, d_k, 1e-6);
    r::l2norm_heads(&mut k, d_k, 1e-6);
    let v = rng.vec(t * h_v * d_v, 1.0);
    // g = a·softplus(..) with a < 0: log-decays in about [-2, 0]
    let g: Vec<f32> = (0..t * h_v)
        .map(|_| -r::softplus(rng.f() * 2.0) * 0.7)
        .collect();
    let beta: Vec<f32> = (0..t * h_v).map(|_| r::sigmoid(rng.f() * 3.0)).collect();
    let s0 = rng.vec(h_v * d_k * d_v, 0.5); // nonzero incoming state
    GdnCase {
        h_k,
        h_v,
        d_k,
        d_v,
        t,
        s0,
        q,
        k,
        v,
        g,
        beta,
    }
}

/// T reference gdn_steps: (final state, outputs [T, h_v, d_v]).
fn steps_reference(c: &GdnCase) -> (Vec<f32>, Vec<f32>) {
    let (h_k, h_v, d_k, d_v) = (c.h_k, c.h_v, c.d_k, c.d_v);
    let mut s = c.s0.clone();
    let mut out = vec![0f32; c.t * h_v * d_v];
    for i in 0..c.t {
        r::gdn_step(
            &mut s,
            &c.q[i * h_k * d_k..(i + 1) * h_k * d_k],
            &c.k[i * h_k * d_k..(i + 1) * h_k * d_k],
            &c.v[i * h_v * d_v..(i + 1) * h_v * d_v],
            &c.g[i * h_v..(i + 1) * h_v],
            &c.beta[i * h_v..(i + 1) * h_v],
            h_k,
            d_k,
            d_v,
            &mut out[i * h_v * d_v..(i + 1) * h_v * d_v],
        );
    }
    (s, out)
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    let scale = max_abs(b).max(1.0);
    let e = max_abs_diff(a, b);
    assert!(
        e <= tol * scale,
        "{what}: max abs diff {e} (scale {scale}, tol {tol})"
    );
}

#[test]
fn gdn_chunked_equals_repeated_steps() {
    for (i, &t) in [1usize, 63, 64, 65, 130].iter().enumerate() {
        let c = gdn_case(10 + i as u64, t, 2, 6, 16, 8);
        let (s_ref, o_ref) = steps_reference(&c);
        // reference chunked
        let mut s = c.s0.clone();
        let mut o = vec![0f32; t * c.h_v * c.d_v];
        r::gdn_chunked(
            &mut s, &c.q, &c.k, &c.v, &c.g, &c.beta, t, c.h_k, c.d_k, c.d_v, 64, &mut o,
        );
        assert_close(&o, &o_ref, 1e-5, &format!("ref chunked out T={t}"));
        assert_close(&s, &s_ref, 1e-5, &format!("ref chunked state T={t}"));
        // optimized chunked, both ISAs, and exact across ISAs
        let mut prev: Option<(Vec<f32>, Vec<f32>)> = None;
        for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
            let mut s = c.s0.clone();
            let mut o = vec![0f32; t * c.h_v * c.d_v];
            ops::gdn_chunked_isa(
                isa, &mut s, &c.q, &c.k, &c.v, &c.g, &c.beta, t, c.h_k, c.d_k, c.d_v, 64, &mut o,
            );
            assert_close(&o, &o_ref, 1e-4, &format!("ops chunked out T={t} {isa:?}"));
            assert_close(
                &s,
                &s_ref,
                1e-4,
                &format!("ops chunked state T={t} {isa:?}"),
            );
            if let Some((ps, po)) = &prev {
                assert_eq!(ps, &s, "chunked state differs across ISA, T={t}");
                assert_eq!(po, &o, "chunked out differs across ISA, T={t}");
            }
            prev = Some((s, o));
        }
    }
}

#[test]
fn gdn_chunked_model_dims_and_small_chunk() {
    // model head dims (128), 3 v-heads per k-head, T=70 across a chunk boundary; and chunk=16
    let c = gdn_case(20, 70, 2, 6, 128, 128);
    let (s_ref, o_ref) = steps_reference(&c);
    for chunk in [64usize, 16] {
        let mut s = c.s0.clone();
        let mut o = vec![0f32; c.t * c.h_v * c.d_v];
        ops::gdn_chunked(
            &mut s, &c.q, &c.k, &c.v, &c.g, &c.beta, c.t, c.h_k, c.d_k, c.d_v, chunk, &mut o,
        );
        assert_close(&o, &o_ref, 1e-4, &format!("ops chunked out chunk={chunk}"));
        assert_close(
            &s,
            &s_ref,
            1e-4,
            &format!("ops chunked state chunk={chunk}"),
        );
    }
}

#[test]
fn gdn_step_ops_matches_reference() {
    let c = gdn_case(30, 5, 4, 12, 128, 64);
    let (s_ref, o_ref) = steps_reference(&c);
    let mut prev: Option<(Vec<f32>, Vec<f32>)> = None;
    for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
        let (h_k, h_v, d_k, d_v) = (c.h_k, c.h_v, c.d_k, c.d_v);
        let mut s = c.s0.clone();
        let mut out = vec![0f32; c.t * h_v * d_v];
        for i in 0..c.t {
            ops::gdn_step_isa(
                isa,
                &mut s,
                &c.q[i * h_k * d_k..(i + 1) * h_k * d_k],
                &c.k[i * h_k * d_k..(i + 1) * h_k * d_k],
                &c.v[i * h_v * d_v..(i + 1) * h_v * d_v],
                &c.g[i * h_v..(i + 1) * h_v],
                &c.beta[i * h_v..(i + 1) * h_v],
                h_k,
                d_k,
                d_v,
                &mut out[i * h_v * d_v..(i + 1) * h_v * d_v],
            );
        }
        assert_close(&out, &o_ref, 1e-5, &format!("gdn_step out {isa:?}"));
        assert_close(&s, &s_ref, 1e-5, &format!("gdn_step state {isa:?}"));
        if let Some((ps, po)) = &prev {
            assert_eq!(ps, &s);
            assert_eq!(po, &out);
        }
        prev = Some((s, out));
    }
}

/// Hand-checkable delta rule: d_k = d_v = 1, one head. S=2, g=ln(0.5), k=q=1, β=0.5, v=3:
/// S←1; u=1; δ=0.5·(3−1)=1; S=2; o = 2/√1 = 2. Also checks the TILED head map h → h % h_k.
#[test]
fn gdn_step_hand_and_tiled_map() {
    let mut s = vec![2.0f32];
    let mut o = vec![0f32];
    r::gdn_step(
        &mut s,
        &[1.0],
        &[1.0],
        &[3.0],
        &[0.5f32.ln()],
        &[0.5],
        1,
        1,
        1,
        &mut o,
    );
    assert!((s[0] - 2.0).abs() < 1e-6 && (o[0] - 2.0).abs() < 1e-6);
    // h_k=2, h_v=4, d=1: k-heads have k = (1, 1) but q = (1, -1); v-head h uses q[h % 2]
    let mut s = vec![0f32; 4];
    let mut o = vec![0f32; 4];
    r::gdn_step(
        &mut s,
        &[1.0, -1.0],
        &[1.0, 1.0],
        &[1.0; 4],
        &[0.0; 4],
        &[1.0; 4],
        2,
        1,
        1,
        &mut o,
    );
    assert_eq!(o, vec![1.0, -1.0, 1.0, -1.0]);
    let mut s = vec![0f32; 4];
    let mut o2 = vec![0f32; 4];
    ops::gdn_step(
        &mut s,
        &[1.0, -1.0],
        &[1.0, 1.0],
        &[1.0; 4],
        &[0.0; 4],
        &[1.0; 4],
        2,
        1,
        1,
        &mut o2,
    );
    assert_eq!(o2, o);
}

#[test]
fn attention_ops_matches_reference() {
    let mut rng = Rng::new(40);
    for &(t, n_head, n_kv, hd) in &[
        (1usize, 4usize, 2usize, 16usize),
        (7, 6, 2, 32),
        (100, 24, 4, 256),
        (33, 40, 4, 128),
    ] {
        let q = rng.vec(n_head * hd, 1.0);
        let kc = rng.vec(t * n_kv * hd, 1.0);
        let vc = rng.vec(t * n_kv * hd, 1.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut o_ref = vec![0f32; n_head * hd];
        r::attention(&q, &kc, &vc, t, n_head, n_kv, hd, scale, &mut o_ref);
        let mut prev: Option<Vec<f32>> = None;
        for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
            let mut o = vec![0f32; n_head * hd];
            ops::attention_isa(isa, &q, &kc, &vc, t, n_head, n_kv, hd, scale, &mut o);
            assert_close(&o, &o_ref, 1e-5, &format!("attention t={t} {isa:?}"));
            if let Some(p) = &prev {
                assert_eq!(p, &o);
            }
            prev = Some(o);
        }
        if t == 1 {
            // one position: output is exactly that position's V of the grouped kv head
            for h in 0..n_head {
                let kv = h / (n_head / n_kv);
                assert_eq!(&o_ref[h * hd..(h + 1) * hd], &vc[kv * hd..(kv + 1) * hd]);
            }
        }
    }
}

#[test]
fn attention_grouped_gqa_and_softmax_hand() {
    // t=2, n_head=4, n_kv=2, hd=1: heads 0,1 use kv 0; heads 2,3 use kv 1 (grouped, not tiled)
    let q = [1.0f32, 1.0, 1.0, 1.0];
    let kc = [0.0f32, 0.0, /* t=1 */ 1.0f32.ln_1p(), 0.0]; // kv0 scores (0, ln 2); kv1 scores (0, 0)
    let vc = [0.0f32, 10.0, 3.0, 20.0];
    let mut o = [0f32; 4];
    r::attention(&q, &kc, &vc, 2, 4, 2, 1, 1.0, &mut o);
    // kv0: p = (1/3, 2/3) → 2; kv1: p = (1/2, 1/2) → 15
    for (h, want) in [(0, 2.0f32), (1, 2.0), (2, 15.0), (3, 15.0)] {
        assert!((o[h] - want).abs() < 1e-5, "head {h}: {}", o[h]);
    }
}

#[test]
fn small_reference_ops() {
    // rmsnorm: x = (3, 4) → mean sq 12.5
    let mut out = [0f32; 2];
    r::rmsnorm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
    let inv = 1.0 / 12.5f32.sqrt();
    assert!((out[0] - 3.0 * inv).abs() < 1e-6 && (out[1] - 8.0 * inv).abs() < 1e-6);
    let mut x = [3.0f32, 4.0, 0.0, 2.0];
    r::rmsnorm_heads(&mut x, 2, &[1.0, 1.0], 0.0);
    assert!((x[0] - 3.0 * inv).abs() < 1e-6 && (x[3] - 2.0f32.sqrt()).abs() < 1e-6);
    let mut x = [3.0f32, 4.0, 0.0, 0.0];
    r::l2norm_heads(&mut x, 2, 1e-6);
    assert_eq!(x, [0.6, 0.8, 0.0, 0.0]);
    // rope: pos 0 is identity; pair (d, d + n_rot/2); dims ≥ n_rot untouched
    let mut x: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let x0 = x.clone();
    r::rope_neox(&mut x, 8, 4, 0, 10000.0);
    assert_eq!(x, x0);
    let mut x = vec![1.0f32, 0.0, 0.0, 0.0, 5.0, 6.0];
    r::rope_neox(&mut x, 6, 4, 1, 10000.0);
    // d=0: theta = 1 → (cos 1, sin 1) in dims (0, 2); d=1 pair (1, 3) is zero
    assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
    assert_eq!(&x[4..], &[5.0, 6.0]);
    let mut x = vec![0.0f32, 1.0, 0.0, 0.0];
    r::rope_neox(&mut x, 4, 4, 3, 100.0);
    let th = 3.0f64 * 100f64.powf(-0.5);
    assert!((x[1] as f64 - th.cos()).abs() < 1e-6 && (x[3] as f64 - th.sin()).abs() < 1e-6);
    // activations
    assert_eq!(r::softplus(25.0), 25.0);
    assert!((r::softplus(0.0) - 2f32.ln()).abs() < 1e-7);
    assert!((r::sigmoid(0.0) - 0.5).abs() < 1e-7);
    assert!((r::silu(2.0) - 2.0 / (1.0 + (-2f32).exp())).abs() < 1e-6);
}

#[test]
fn conv1d_step_hand() {
    // C = 2, k = 4; state rows oldest first
    let mut state = vec![1.0f32, 10.0, 2.0, 20.0, 3.0, 30.0]; // [3, 2]
    let w = vec![1.0f32, 0.0, 0.0, 1.0, /* ch1 */ 0.5, 0.0, 0.0, 0.0]; // [2, 4]
    let x = [4.0f32, 40.0];
    let mut out = [0f32; 2];
    r::conv1d_silu_step(&mut state, &x, &w, 4, &mut out);
    // ch0: 1·state[0] + 1·x = 1 + 4 = 5; ch1: 0.5·state[0] = 5
    assert!((out[0] - r::silu(5.0)).abs() < 1e-6);
    assert!((out[1] - r::silu(5.0)).abs() < 1e-6);
    assert_eq!(state, vec![2.0, 20.0, 3.0, 30.0, 4.0, 40.0]);
}

/// `ops::sigmoid_fast` / `silu_fast` (the engine's element-wise SiLU) against the f64 reference:
/// relative error ≤ 4e-7 (absolute 1e-30 below, where the reference is subnormal or 0).
#[test]
fn sigmoid_fast_close_to_reference() {
    let mut worst = 0f64;
    let mut x = -100f32;
    while x <= 100.0 {
        for v in [x, x + 1e-3, x * 0.37] {
            let (a, b) = (ops::sigmoid_fast(v) as f64, r::sigmoid(v) as f64);
            let rel = (a - b).abs() / b.abs().max(1e-30);
            assert!(
                rel <= 4e-7 || (a - b).abs() <= 1e-30,
                "sigmoid({v}): {a} vs {b}"
            );
            worst = worst.max(if b > 1e-30 { rel } else { 0.0 });
            let (a, b) = (ops::silu_fast(v) as f64, r::silu(v) as f64);
            assert!(
                (a - b).abs() <= 4e-7 * b.abs() + 1e-30,
                "silu({v}): {a} vs {b}"
            );
        }
        x += 0.0137;
    }
    assert!(worst > 0.0, "the sweep compared nothing");
    // the special values
    assert_eq!(ops::sigmoid_fast(0.0), 0.5);
    assert_eq!(ops::sigmoid_fast(f32::INFINITY), 1.0);
    assert_eq!(ops::sigmoid_fast(f32::NEG_INFINITY), 0.0);
    assert_eq!(ops::silu_fast(f32::INFINITY), f32::INFINITY);
    assert!(ops::silu_fast(f32::NAN).is_nan());
    assert_eq!(ops::silu_fast(-200.0), 0.0);
    eprintln!("sigmoid_fast worst relative error {worst:.3e}");
}

/// Every ISA's `silu_op` gives the scalar form's bits, for each op, every length 0..40 (the SIMD
/// steps and the tail) and special values (±0, ±inf, NaN, the −87 cut, subnormals).
#[test]
fn silu_op_same_bits_every_isa() {
    use ops::SiluOp;
    let mut rng = Rng::new(11);
    let specials = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -87.0,
        -86.99999,
        87.0,
        1e-40,
        -1e-40,
        f32::MAX,
        f32::MIN,
    ];
    let mut ran = 0;
    for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
        for op in [SiluOp::InPlace, SiluOp::GateMulUp, SiluOp::MulByGate] {
            for n in (0..40).chain([1000, 4099]) {
                let mut a: Vec<f32> = rng.vec(n, 30.0);
                let mut b: Vec<f32> = rng.vec(n, 30.0);
                for (i, s) in specials.iter().enumerate() {
                    if n > 0 && i % 3 == n % 3 {
                        let j = rng.u64() as usize % n;
                        a[j] = *s;
                        b[(j * 7 + 1) % n] = *s;
                    }
                }
                let bb: &[f32] = if op == SiluOp::InPlace { &[] } else { &b };
                let mut want = a.clone();
                ops::silu_op_isa(Isa::Scalar, op, &mut want, bb);
                ops::silu_op_isa(isa, op, &mut a, bb);
                for (i, (x, y)) in a.iter().zip(&want).enumerate() {
                    assert!(
                        x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                        "{isa:?} {op:?} n {n} [{i}]: {x} vs {y}"
                    );
                }
                ran += 1;
            }
        }
    }
    assert!(ran >= 3 * 42, "only the scalar ISA ran");
}

/// `ops::conv1d_silu_step` (channel chunks in parallel, on rayon and on a spinning pool) gives
/// the bits of `reference::conv1d_step` followed by `silu_op` (`InPlace`), output and window, over
/// several steps, for every ISA, tap count and a channel count that is not a multiple of a chunk.
#[test]
fn conv1d_silu_step_equals_reference_then_silu() {
    use bonsai_kernels_cpu::par::SpinPool;
    let pool = SpinPool::new(3, std::time::Duration::from_micros(200)).unwrap();
    let mut rng = Rng::new(29);
    for isa in Isa::ALL.into_iter().filter(|&i| isa_supported(i)) {
        for k in [1usize, 2, 4] {
            for c in [1usize, 700, 10240] {
                let w = rng.vec(c * k, 1.0);
                let mut s_ref = rng.vec((k - 1) * c, 2.0);
                let mut s_a = s_ref.clone();
                let mut s_b = s_ref.clone();
                for step in 0..3 {
                    let x = rng.vec(c, 3.0);
                    let mut want = vec![0f32; c];
                    r::conv1d_step(&mut s_ref, &x, &w, k, &mut want);
                    ops::silu_op_isa(isa, ops::SiluOp::InPlace, &mut want, &[]);
                    let (mut a, mut b) = (vec![0f32; c], vec![0f32; c]);
                    ops::conv1d_silu_step_isa(isa, &mut s_a, &x, &w, k, &mut a);
                    pool.install(|| ops::conv1d_silu_step_isa(isa, &mut s_b, &x, &w, k, &mut b));
                    let same = |u: &[f32], v: &[f32]| {
                        u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits())
                    };
                    assert!(
                        same(&a, &want) && same(&b, &want),
                        "{isa:?} k {k} c {c} step {step}: out"
                    );
                    assert!(
                        same(&s_a, &s_ref) && same(&s_b, &s_ref),
                        "{isa:?} k {k} c {c} step {step}: window"
                    );
                }
            }
        }
    }
}

/// `ops::conv1d_silu_rows` over n rows gives the outputs and final window of n
/// `ops::conv1d_silu_step` calls, bit for bit (on rayon and on a spinning pool), for tap counts
/// and channel counts that are not a multiple of its chunk.
#[test]
fn conv1d_silu_rows_equals_steps() {
    use bonsai_kernels_cpu::par::SpinPool;
    let pool = SpinPool::new(3, std::time::Duration::from_micros(200)).unwrap();
    let mut rng = Rng::new(31);
    for k in [1usize, 2, 4] {
        for c in [1usize, 700, 10240] {
            for n in [1usize, 3, 17] {
                let w = rng.vec(c * k, 1.0);
                let s0 = rng.vec((k - 1) * c, 2.0);
                let xs = rng.vec(n * c, 3.0);
                let mut s_want = s0.clone();
                let mut want = vec![0f32; n * c];
                for t in 0..n {
                    ops::conv1d_silu_step(
                        &mut s_want,
                        &xs[t * c..(t + 1) * c],
                        &w,
                        k,
                        &mut want[t * c..(t + 1) * c],
                    );
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let (mut s_a, mut s_b) = (s0.clone(), s0.clone());
                let (mut a, mut b) = (vec![0f32; n * c], vec![0f32; n * c]);
                ops::conv1d_silu_rows(&mut s_a, &xs, &w, k, n, &mut a);
                pool.install(|| ops::conv1d_silu_rows(&mut s_b, &xs, &w, k, n, &mut b));
                for (got, st, name) in [(&a, &s_a, "rayon"), (&b, &s_b, "pool")] {
                    assert_eq!(bits(got), bits(&want), "{name} k {k} c {c} n {n}: out");
                    assert_eq!(bits(st), bits(&s_want), "{name} k {k} c {c} n {n}: window");
                }
            }
        }
    }
}
