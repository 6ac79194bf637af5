//! Every Vulkan shader against the scalar CPU reference (`bonsai_kernels_cpu::reference`), on random
//! inputs, plus batch invariance: a row of an n-row dispatch equals the one-row dispatch bit for bit.
//!
//! These run on any Vulkan 1.2 implementation with bufferDeviceAddress, a CPU one included: CI installs
//! lavapipe (`mesa-vulkan-drivers`). Without any Vulkan device they fail, saying so.

use bonsai_kernels_cpu::ops;
use bonsai_kernels_cpu::quant::{dequantize_row, QuantType};
use bonsai_kernels_cpu::reference as r;
use bonsai_kernels_vulkan::retile::{groups, lane_words, split_blocks, split_blocks_dot, LowBit};
use bonsai_kernels_vulkan::{
    gdn_step_groups, mv_dot_groups, mv_groups, q8_blocks, quant_q8_groups, Buffer, Kernel, Push,
    Vulkan,
};
use half::f16;

fn vk() -> Vulkan {
    Vulkan::new(true).unwrap_or_else(|e| {
        panic!(
            "these tests need a Vulkan device (a CPU one is enough: apt-get install mesa-vulkan-drivers \
             libvulkan1, as `make test` does): {e}"
        )
    })
}

/// xorshift64*: deterministic test data.
struct Rng(u64);
impl Rng {
    fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

fn buf(v: &Vulkan, x: &[f32]) -> Buffer {
    v.buffer_f32(x).unwrap()
}

fn get(v: &Vulkan, b: &Buffer, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    v.download_f32(b, 0, &mut out).unwrap();
    out
}

/// max |a − b| / max(max |b|, 1e-30).
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut num = 0f64;
    let mut den = 0f64;
    for (&x, &y) in a.iter().zip(b) {
        num = num.max((x as f64 - y as f64).abs());
        den = den.max((y as f64).abs());
    }
    num / den.max(1e-30)
}

/// Random GGUF bytes of `n_out` rows of `n_in` elements of `qt` (random codes, scales in ±0.05).
fn random_weights(rng: &mut Rng, qt: QuantType, n_in: usize, n_out: usize) -> Vec<u8> {
    let rb = qt.row_bytes(n_in).unwrap();
    let mut data = vec![0u8; rb * n_out];
    match qt {
        QuantType::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&(rng.f() * 0.1).to_le_bytes());
            }
        }
        _ => {
            let bb = qt.block_bytes();
            for blk in data.chunks_exact_mut(bb) {
                blk[..2].copy_from_slice(&f16::from_f32(rng.f() * 0.05).to_le_bytes());
                for b in &mut blk[2..] {
                    *b = rng.u64() as u8;
                }
            }
        }
    }
    data
}

/// The `mv` dispatch for `qt`: returns (kernel, codes, scales).
fn upload_mat(
    v: &Vulkan,
    qt: QuantType,
    data: &[u8],
    n_in: usize,
    n_out: usize,
) -> (Kernel, Buffer, Buffer) {
    let (k, lb) = match qt {
        QuantType::Q1_0 => (Kernel::MvQ1, LowBit::Q1),
        QuantType::Q2_0G128 | QuantType::PQ2_0 => (Kernel::MvQ2, LowBit::Q2g128),
        QuantType::Q2_0G64 => (Kernel::MvQ2g64, LowBit::Q2g64),
        QuantType::F32 => {
            let words: Vec<u32> = data
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            return (
                Kernel::MvF32,
                v.buffer_u32(&words).unwrap(),
                v.alloc(4).unwrap(),
            );
        }
        other => panic!("no mv kernel for {other:?}"),
    };
    let (codes, scales) = split_blocks(lb, data, n_in, n_out).unwrap();
    (
        k,
        v.buffer_u32(&codes).unwrap(),
        v.buffer_f32(&scales).unwrap(),
    )
}

#[allow(clippy::too_many_arguments)]
fn run_mv(
    v: &Vulkan,
    k: Kernel,
    codes: &Buffer,
    scales: &Buffer,
    x: &Buffer,
    y: &Buffer,
    n: usize,
    n_in: usize,
    n_out: usize,
    acc: bool,
) {
    v.run(|c| {
        let p = Push::new()
            .addr(codes, 0)
            .addr(scales, 0)
            .addr(x, 0)
            .addr(y, 0)
            .u32(mv_groups(n_out, n))
            .u32(n_in as u32)
            .u32(n_out as u32)
            .u32(acc as u32);
        c.dispatch(k, mv_groups(n_out, n), &p);
        Ok(())
    })
    .unwrap();
}

#[test]
fn mv_matches_reference_and_one_row() {
    let v = vk();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (qt, n_in) in [
        (QuantType::Q1_0, 640),
        (QuantType::Q2_0G128, 512),
        (QuantType::PQ2_0, 384),
        (QuantType::Q2_0G64, 320),
        (QuantType::F32, 200),
    ] {
        let (n_out, n) = (77, 5);
        let data = random_weights(&mut rng, qt, n_in, n_out);
        let (k, codes, scales) = upload_mat(&v, qt, &data, n_in, n_out);
        let x = rng.vec(n * n_in, 1.0);
        let xb = buf(&v, &x);
        let y = v.alloc((4 * n * n_out) as u64).unwrap();
        run_mv(&v, k, &codes, &scales, &xb, &y, n, n_in, n_out, false);
        let got = get(&v, &y, n * n_out);
        for t in 0..n {
            let mut want = vec![0f32; n_out];
            r::matvec(
                &data,
                qt,
                n_in,
                n_out,
                &x[t * n_in..(t + 1) * n_in],
                &mut want,
            );
            let e = rel_err(&got[t * n_out..(t + 1) * n_out], &want);
            assert!(e < 2e-5, "{qt:?} row {t}: relative error {e:e}");
            // the same row alone: bit for bit
            let x1 = buf(&v, &x[t * n_in..(t + 1) * n_in]);
            let y1 = v.alloc((4 * n_out) as u64).unwrap();
            run_mv(&v, k, &codes, &scales, &x1, &y1, 1, n_in, n_out, false);
            let one = get(&v, &y1, n_out);
            assert!(
                one.iter()
                    .zip(&got[t * n_out..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{qt:?} row {t}: the 5-row dispatch differs from the one-row dispatch"
            );
        }
        // accumulate: y += W x
        run_mv(&v, k, &codes, &scales, &xb, &y, n, n_in, n_out, true);
        let twice = get(&v, &y, n * n_out);
        for (a, b) in twice.iter().zip(&got) {
            assert_eq!(a.to_bits(), (b + b).to_bits(), "{qt:?}: accumulate");
        }
    }
}

/// int8 codes as little-endian words, 4 per word.
fn i8_words(q: &[i8]) -> Vec<u32> {
    q.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]))
        .collect()
}

/// Device buffers of quantized activations: (codes, scales, sums).
struct Q8Bufs {
    q: Buffer,
    d: Buffer,
    s: Buffer,
}

/// `mv_dot` weights: (codes, scales) on the device.
fn upload_dot_mat(v: &Vulkan, lb: LowBit, w: &[u8], n_in: usize, n_out: usize) -> (Buffer, Buffer) {
    let (codes, scales) = split_blocks_dot(lb, w, n_in, n_out).unwrap();
    (
        v.buffer_u32(&codes).unwrap(),
        v.buffer_u32(&scales).unwrap(),
    )
}

/// Host-quantized activation rows on the device.
fn upload_q8(v: &Vulkan, codes: &[i8], scales: &[f32], sums: &[i32]) -> Q8Bufs {
    Q8Bufs {
        q: v.buffer_u32(&i8_words(codes)).unwrap(),
        d: buf(v, scales),
        s: v.buffer_u32(&sums.iter().map(|&s| s as u32).collect::<Vec<_>>())
            .unwrap(),
    }
}

fn q8_alloc(v: &Vulkan, n: usize, width: usize) -> Q8Bufs {
    let nb8 = q8_blocks(width);
    Q8Bufs {
        q: v.alloc((n * nb8 * 32) as u64).unwrap(),
        d: v.alloc((4 * n * nb8) as u64).unwrap(),
        s: v.alloc((4 * n * nb8) as u64).unwrap(),
    }
}

fn run_quant_q8(v: &Vulkan, x: &Buffer, q: &Q8Bufs, n: usize, width: usize) {
    let g = quant_q8_groups(n, width);
    let p = Push::new()
        .addr(x, 0)
        .addr(&q.q, 0)
        .addr(&q.d, 0)
        .addr(&q.s, 0)
        .u32(g)
        .u32(n as u32)
        .u32(width as u32)
        .u32(q8_blocks(width) as u32);
    v.run(|c| {
        c.dispatch(Kernel::QuantQ8, g, &p);
        Ok(())
    })
    .unwrap();
}

#[allow(clippy::too_many_arguments)]
fn run_mv_dot(
    v: &Vulkan,
    k: Kernel,
    codes: &Buffer,
    scales: &Buffer,
    q: &Q8Bufs,
    y: &Buffer,
    n: usize,
    n_in: usize,
    n_out: usize,
    acc: bool,
) {
    let g = mv_dot_groups(n_out, n);
    let p = Push::new()
        .addr(codes, 0)
        .addr(scales, 0)
        .addr(&q.q, 0)
        .addr(&q.d, 0)
        .addr(&q.s, 0)
        .addr(y, 0)
        .u32(n as u32)
        .u32(n_in as u32)
        .u32(n_out as u32)
        .u32(acc as u32)
        .u32(n_out as u32)
        .u32(n_out as u32)
        .u32(n_out as u32)
        .u32(0)
        .u32(0)
        .u32(0);
    v.run(|c| {
        c.dispatch(k, g, &p);
        Ok(())
    })
    .unwrap();
}

/// Whether the device computes GLSL `fma` as one rounding, as the CPU's `mul_add` does. Mesa's
/// llvmpipe (lavapipe) splits it into a multiply and an add even where the SPIR-V marks it
/// NoContraction, so there the int8 kernels are compared with the CPU within rounding, and bit
/// for bit on a GPU.
fn fused_fma(v: &Vulkan) -> bool {
    v.info().kind != "cpu"
}

fn need_int_dot(v: &Vulkan) {
    assert!(
        v.info().int_dot,
        "{} has no shaderIntegerDotProduct: the int8 kernels cannot be tested here",
        v.name()
    );
}

/// `quant_q8` equals the CPU engine's `quantize_acts` bit for bit: codes, scales, sums, padding.
#[test]
fn quant_q8_equals_cpu_quantize_acts() {
    let v = vk();
    need_int_dot(&v);
    let mut rng = Rng(0x5151);
    for &(n, width) in &[(1usize, 32usize), (3, 96), (2, 1056), (2, 5120)] {
        let mut x = rng.vec(n * width, 3.0);
        // a zero block, a block of exact ties (x · (1/d) = k + 0.5 where d = 1), a huge block
        if width >= 96 {
            x[32..64].iter_mut().for_each(|e| *e = 0.0);
            for (j, e) in x[64..96].iter_mut().enumerate() {
                *e = if j == 0 {
                    127.0
                } else {
                    (j as f32 - 16.0) + 0.5
                };
            }
        }
        if width >= 1056 {
            x[1024..1056].iter_mut().for_each(|e| *e *= 1e30);
        }
        let want = ops::quantize_acts(&x, n, width);
        let xb = buf(&v, &x);
        let q = q8_alloc(&v, n, width);
        run_quant_q8(&v, &xb, &q, n, width);
        let nb8 = q8_blocks(width);
        assert_eq!(nb8 * 32, want.n_pad());
        let mut codes = vec![0u8; n * nb8 * 32];
        v.download(&q.q, 0, &mut codes).unwrap();
        let codes: Vec<i8> = codes.iter().map(|&b| b as i8).collect();
        let d = get(&v, &q.d, n * nb8);
        let mut sums = vec![0u8; 4 * n * nb8];
        v.download(&q.s, 0, &mut sums).unwrap();
        let sums: Vec<i32> = sums
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        // every block's sum is its codes' sum
        for (b, s) in sums.iter().enumerate() {
            let cs: i32 = codes[32 * b..32 * b + 32].iter().map(|&c| c as i32).sum();
            assert_eq!(*s, cs, "{n}×{width}: block {b} sum");
        }
        if fused_fma(&v) {
            let bad = codes
                .iter()
                .zip(want.codes())
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(bad, 0, "{n}×{width}: {bad} codes differ from the CPU's");
            let dbits: Vec<u32> = d.iter().map(|f| f.to_bits()).collect();
            let wbits: Vec<u32> = want.scales().iter().map(|f| f.to_bits()).collect();
            assert_eq!(dbits, wbits, "{n}×{width}: scales");
            assert_eq!(sums, want.sums(), "{n}×{width}: sums");
        } else {
            // unfused fma: a scale may be 1 ulp off the IEEE quotient, and a code 1 off
            for (a, b) in d.iter().zip(want.scales()) {
                assert!(
                    a.to_bits().abs_diff(b.to_bits()) <= 1,
                    "{n}×{width}: scale {a} vs {b}"
                );
            }
            let off = codes
                .iter()
                .zip(want.codes())
                .filter(|(a, b)| a != b)
                .count();
            let far = codes
                .iter()
                .zip(want.codes())
                .any(|(&a, &b)| (a as i32 - b as i32).abs() > 1);
            assert!(
                !far && off * 1000 <= codes.len(),
                "{n}×{width}: {off} codes differ"
            );
        }
    }
}

/// `mv_dot_*` equals the CPU engine's `matmul_q` bit for bit given the same int8 activations, a
/// row of an n-row dispatch equals the one-row dispatch, and `acc` adds to y.
#[test]
fn mv_dot_equals_cpu_matmul_and_one_row() {
    let v = vk();
    need_int_dot(&v);
    let mut rng = Rng(0xd07);
    let kinds = [
        (QuantType::Q1_0, LowBit::Q1, Kernel::MvDotQ1),
        (QuantType::Q2_0G128, LowBit::Q2g128, Kernel::MvDotQ2),
        (QuantType::Q2_0G64, LowBit::Q2g64, Kernel::MvDotQ2g64),
    ];
    // (n_in, n_out): padding blocks (384, 640), two slabs (4608), outputs not a multiple of 4
    for &(n_in, n_out) in &[(128usize, 5usize), (384, 9), (640, 13), (4608, 6)] {
        for &(qt, lb, k) in &kinds {
            let n = 3;
            let w = random_weights(&mut rng, qt, n_in, n_out);
            let x = rng.vec(n * n_in, 1.0);
            let xq = ops::quantize_acts(&x, n, n_in);
            let mut want = vec![0f32; n * n_out];
            ops::matmul_q(&w, qt, n_in, n_out, &xq, &mut want);
            let (cb, sb) = upload_dot_mat(&v, lb, &w, n_in, n_out);
            let q = upload_q8(&v, xq.codes(), xq.scales(), xq.sums());
            let y = v.alloc(f4(n * n_out)).unwrap();
            run_mv_dot(&v, k, &cb, &sb, &q, &y, n, n_in, n_out, false);
            let got = get(&v, &y, n * n_out);
            let gb: Vec<u32> = got.iter().map(|f| f.to_bits()).collect();
            let wb: Vec<u32> = want.iter().map(|f| f.to_bits()).collect();
            if fused_fma(&v) {
                assert_eq!(
                    gb, wb,
                    "{qt:?} {n_in}×{n_out}: GPU rows differ from the CPU's"
                );
            } else {
                let e = rel_err(&got, &want);
                assert!(
                    e <= 1e-6,
                    "{qt:?} {n_in}×{n_out}: GPU rows off the CPU's by {e:.2e}"
                );
            }
            // row 1 alone (its activation row at offset 0 of a one-row buffer) == row 1 of three
            let nb8 = q8_blocks(n_in);
            let q1 = upload_q8(
                &v,
                &xq.codes()[nb8 * 32..2 * nb8 * 32],
                &xq.scales()[nb8..2 * nb8],
                &xq.sums()[nb8..2 * nb8],
            );
            let y1 = buf(&v, &vec![1.5f32; n_out]);
            run_mv_dot(&v, k, &cb, &sb, &q1, &y1, 1, n_in, n_out, true);
            let got1 = get(&v, &y1, n_out);
            for o in 0..n_out {
                assert_eq!(
                    got1[o].to_bits(),
                    (1.5f32 + got[n_out + o]).to_bits(),
                    "{qt:?} {n_in}×{n_out}: one-row (acc) output {o}"
                );
            }
        }
    }
}

/// Matrices side by side in one dispatch (`seg0..seg2`, `yoff1..yoff3`): each segment's rows equal
/// the one-matrix dispatch's bit for bit, stored `[n, n_s]` from its offset.
#[test]
fn mv_dot_segments_equal_one_matrix() {
    let v = vk();
    need_int_dot(&v);
    let mut rng = Rng(0x5e9);
    let (n_in, n) = (256usize, 2usize);
    let sizes = [5usize, 3, 6, 2];
    let n_out: usize = sizes.iter().sum();
    for (qt, lb, k) in [
        (QuantType::Q1_0, LowBit::Q1, Kernel::MvDotQ1),
        (QuantType::Q2_0G64, LowBit::Q2g64, Kernel::MvDotQ2g64),
    ] {
        let w = random_weights(&mut rng, qt, n_in, n_out);
        let xq = ops::quantize_acts(&rng.vec(n * n_in, 1.0), n, n_in);
        let (cb, sb) = upload_dot_mat(&v, lb, &w, n_in, n_out);
        let q = upload_q8(&v, xq.codes(), xq.scales(), xq.sums());
        let whole = v.alloc(f4(n * n_out)).unwrap();
        run_mv_dot(&v, k, &cb, &sb, &q, &whole, n, n_in, n_out, false);
        let whole = get(&v, &whole, n * n_out);
        // segment starts on 4-element boundaries, as the backend lays them out
        let mut starts = vec![0usize];
        for s in &sizes[..3] {
            starts.push(starts.last().unwrap() + s.next_multiple_of(4) * n);
        }
        let total = starts[3] + sizes[3].next_multiple_of(4) * n;
        let y = buf(&v, &vec![f32::NAN; total]);
        let ends: Vec<u32> = sizes
            .iter()
            .scan(0, |e, s| {
                *e += s;
                Some(*e as u32)
            })
            .collect();
        let p = Push::new()
            .addr(&cb, 0)
            .addr(&sb, 0)
            .addr(&q.q, 0)
            .addr(&q.d, 0)
            .addr(&q.s, 0)
            .addr(&y, 0)
            .u32(n as u32)
            .u32(n_in as u32)
            .u32(n_out as u32)
            .u32(0)
            .u32(ends[0])
            .u32(ends[1])
            .u32(ends[2])
            .u32(starts[1] as u32)
            .u32(starts[2] as u32)
            .u32(starts[3] as u32);
        v.run(|c| {
            c.dispatch(k, mv_dot_groups(n_out, n), &p);
            Ok(())
        })
        .unwrap();
        let got = get(&v, &y, total);
        let mut row0 = 0;
        for (si, &ns) in sizes.iter().enumerate() {
            for t in 0..n {
                for o in 0..ns {
                    let (a, b) = (got[starts[si] + t * ns + o], whole[t * n_out + row0 + o]);
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{qt:?} segment {si} row {t} output {o}"
                    );
                }
            }
            row0 += ns;
        }
    }
}

fn f4(n: usize) -> u64 {
    4 * n as u64
}

#[test]
fn mv_large_grid_covers_every_output() {
    // more than 65,535 workgroups (4 outputs each): the dispatch goes 2-D and every output must
    // still be written
    let v = vk();
    let mut rng = Rng(7);
    let (n_in, n_out, n) = (128, 270_001, 1);
    assert!(mv_groups(n_out, n) > 65_535);
    let data = random_weights(&mut rng, QuantType::Q1_0, n_in, n_out);
    let (k, codes, scales) = upload_mat(&v, QuantType::Q1_0, &data, n_in, n_out);
    let x = rng.vec(n_in, 1.0);
    let xb = buf(&v, &x);
    let y = v.buffer_f32(&vec![f32::NAN; n_out]).unwrap();
    run_mv(&v, k, &codes, &scales, &xb, &y, n, n_in, n_out, false);
    let got = get(&v, &y, n_out);
    let mut want = vec![0f32; n_out];
    r::matvec(&data, QuantType::Q1_0, n_in, n_out, &x, &mut want);
    assert!(rel_err(&got, &want) < 2e-5);
}

#[test]
fn split_blocks_matches_dequantize() {
    let mut rng = Rng(11);
    for (qt, lb, n_in) in [
        (QuantType::Q1_0, LowBit::Q1, 256),
        (QuantType::Q2_0G128, LowBit::Q2g128, 256),
        (QuantType::Q2_0G64, LowBit::Q2g64, 192),
    ] {
        let data = random_weights(&mut rng, qt, n_in, 3);
        let (codes, scales) = split_blocks(lb, &data, n_in, 3).unwrap();
        let nblk = n_in / lb.block();
        let (ng, lw) = (groups(n_in), lane_words(lb));
        assert_eq!(codes.len(), 3 * ng * 32 * lw);
        let rb = qt.row_bytes(n_in).unwrap();
        for o in 0..3 {
            let mut want = vec![0f32; n_in];
            dequantize_row(qt, &data[o * rb..(o + 1) * rb], &mut want);
            for j in 0..n_in {
                let d = scales[o * nblk + j / lb.block()];
                // chunk c, lane l, element i of the lane's 4; group g, chunk k of the group
                let (c, l, i) = (j / 128, (j % 128) / 4, j % 4);
                let (g, k) = (c / 8, c % 8);
                let w = if lb == LowBit::Q1 {
                    let bit = codes[(o * ng + g) * 32 + l] >> (4 * k + i) & 1;
                    if bit == 1 {
                        d
                    } else {
                        -d
                    }
                } else {
                    let word = codes[((o * ng + g) * 32 + l) * 2 + k / 4];
                    let c = word >> (8 * (k % 4) + 2 * i) & 3;
                    (c as f32 - 1.0) * d
                };
                assert_eq!(w, want[j], "{qt:?} row {o} element {j}");
            }
        }
        assert!(split_blocks(lb, &data[1..], n_in, 3).is_none());
        assert!(split_blocks(lb, &data, n_in + 1, 3).is_none());
    }
}

fn run_rmsnorm(
    v: &Vulkan,
    x: &Buffer,
    w: &Buffer,
    y: &Buffer,
    z: Option<&Buffer>,
    groups: usize,
    gw: usize,
    eps: f32,
) {
    v.run(|c| {
        let p = Push::new().addr(x, 0).addr(w, 0).addr(y, 0);
        let p = match z {
            Some(z) => p.addr(z, 0),
            None => p.null(),
        };
        let p = p
            .u32(groups as u32)
            .u32(gw as u32)
            .f32(eps)
            .u32(z.is_some() as u32);
        c.dispatch(Kernel::Rmsnorm, groups as u32, &p);
        Ok(())
    })
    .unwrap();
}

/// `rmsnorm_q8` equals `rmsnorm` then `quant_q8` bit for bit: the normed values, codes, scales,
/// sums and zero padding, plain (a group per row) and gated (several groups per row).
#[test]
fn rmsnorm_q8_equals_rmsnorm_then_quant() {
    let v = vk();
    let mut rng = Rng(0x9a7e);
    // (rows n, groups per row, gw): padding (width 320 → 512), heads of 64 in a row of 384
    for &(n, gpr, gw, gated) in &[
        (2usize, 1usize, 320usize, false),
        (3, 6, 64, true),
        (1, 1, 5120, false),
    ] {
        let width = gpr * gw;
        let groups = n * gpr;
        let x = rng.vec(n * width, 2.0);
        let z = rng.vec(n * width, 2.0);
        let w = rng.vec(gw, 1.5);
        let (xb, zb, wb) = (buf(&v, &x), buf(&v, &z), buf(&v, &w));
        let y1 = v.alloc(f4(n * width)).unwrap();
        run_rmsnorm(&v, &xb, &wb, &y1, gated.then_some(&zb), groups, gw, 1e-6);
        let q1 = q8_alloc(&v, n, width);
        run_quant_q8(&v, &y1, &q1, n, width);
        let y2 = v.alloc(f4(n * width)).unwrap();
        let q2 = q8_alloc(&v, n, width);
        let nb8 = q8_blocks(width);
        let wgs = (groups * gw.div_ceil(256)) as u32; // a workgroup per 256 values of a group
                                                      // poison the fused kernel's outputs: it must write every block, padding included
        v.run(|c| {
            c.fill(&q2.q, 0, q2.q.size(), 0x7f7f_7f7f);
            c.fill(&q2.d, 0, q2.d.size(), 0x7fc0_0000);
            c.fill(&q2.s, 0, q2.s.size(), 0x1234_5678);
            let p = Push::new().addr(&xb, 0).addr(&wb, 0).addr(&y2, 0);
            let p = if gated { p.addr(&zb, 0) } else { p.null() };
            let p = p
                .addr(&q2.q, 0)
                .addr(&q2.d, 0)
                .addr(&q2.s, 0)
                .u32(wgs)
                .u32(gw as u32)
                .f32(1e-6)
                .u32(gated as u32)
                .u32(gpr as u32)
                .u32(nb8 as u32);
            c.dispatch(Kernel::RmsnormQ8, wgs, &p);
            Ok(())
        })
        .unwrap();
        let bits = |b: &Buffer, len: usize| {
            let mut raw = vec![0u8; len];
            v.download(b, 0, &mut raw).unwrap();
            raw
        };
        let what = format!("{n}×{gpr}×{gw} gated={gated}");
        assert_eq!(
            bits(&y1, 4 * n * width),
            bits(&y2, 4 * n * width),
            "{what}: y"
        );
        assert_eq!(
            bits(&q1.q, n * nb8 * 32),
            bits(&q2.q, n * nb8 * 32),
            "{what}: codes"
        );
        assert_eq!(
            bits(&q1.d, 4 * n * nb8),
            bits(&q2.d, 4 * n * nb8),
            "{what}: scales"
        );
        assert_eq!(
            bits(&q1.s, 4 * n * nb8),
            bits(&q2.s, 4 * n * nb8),
            "{what}: sums"
        );
    }
}

#[test]
fn rmsnorm_plain_and_gated_match_reference() {
    let v = vk();
    let mut rng = Rng(3);
    for (groups, gw) in [(3, 5120), (8, 128), (2, 37)] {
        let x = rng.vec(groups * gw, 2.0);
        let w = rng.vec(gw, 1.0);
        let z = rng.vec(groups * gw, 3.0);
        let (xb, wb, zb) = (buf(&v, &x), buf(&v, &w), buf(&v, &z));
        let y = v.alloc((4 * groups * gw) as u64).unwrap();
        run_rmsnorm(&v, &xb, &wb, &y, None, groups, gw, 1e-6);
        let got = get(&v, &y, groups * gw);
        let mut want = vec![0f32; groups * gw];
        for g in 0..groups {
            r::rmsnorm(
                &x[g * gw..(g + 1) * gw],
                &w,
                1e-6,
                &mut want[g * gw..(g + 1) * gw],
            );
        }
        assert!(rel_err(&got, &want) < 1e-5, "rmsnorm {groups}x{gw}");
        // gated, in place
        run_rmsnorm(&v, &xb, &wb, &xb, Some(&zb), groups, gw, 1e-6);
        let got = get(&v, &xb, groups * gw);
        for (wv, zv) in want.iter_mut().zip(&z) {
            *wv *= r::silu(*zv);
        }
        assert!(rel_err(&got, &want) < 1e-5, "gated rmsnorm {groups}x{gw}");
    }
}

#[test]
fn swiglu_matches_reference() {
    let v = vk();
    let mut rng = Rng(5);
    let n = 1000;
    let (g, u) = (rng.vec(n, 6.0), rng.vec(n, 2.0));
    let (gb, ub) = (buf(&v, &g), buf(&v, &u));
    v.run(|c| {
        let p = Push::new()
            .addr(&gb, 0)
            .addr(&ub, 0)
            .addr(&gb, 0)
            .u32(4)
            .u32(n as u32);
        c.dispatch(Kernel::Swiglu, 4, &p);
        Ok(())
    })
    .unwrap();
    let got = get(&v, &gb, n);
    let want: Vec<f32> = g.iter().zip(&u).map(|(a, b)| r::silu(*a) * b).collect();
    assert!(rel_err(&got, &want) < 1e-6);
}

/// The GDN shader chain (conv, prep, step) over `n` rows, from a given state; returns
/// (outputs [n, H_v·d_v], window, state).
#[allow(clippy::too_many_arguments)]
fn gdn_gpu(
    v: &Vulkan,
    mixed: &[f32],
    bb: &[f32],
    aa: &[f32],
    conv_w: &[f32],
    ssm_a: &[f32],
    dt_bias: &[f32],
    win0: &[f32],
    s0: &[f32],
    (n, hk, hv, dk, dv, kconv): (usize, usize, usize, usize, usize, usize),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let cd = 2 * hk * dk + hv * dv;
    let (mb, bbb, aab, wb, ab, db) = (
        buf(v, mixed),
        buf(v, bb),
        buf(v, aa),
        buf(v, conv_w),
        buf(v, ssm_a),
        buf(v, dt_bias),
    );
    let (win, s) = (buf(v, win0), buf(v, s0));
    let c_out = v.alloc((4 * n * cd) as u64).unwrap();
    let qk = v.alloc((4 * n * 2 * hk * dk) as u64).unwrap();
    let g = v.alloc((4 * n * hv) as u64).unwrap();
    let beta = v.alloc((4 * n * hv) as u64).unwrap();
    let o = v.alloc((4 * n * hv * dv) as u64).unwrap();
    v.run(|c| {
        let p = Push::new()
            .addr(&mb, 0)
            .addr(&wb, 0)
            .addr(&win, 0)
            .addr(&c_out, 0)
            .u32(cd.div_ceil(64) as u32)
            .u32(cd as u32)
            .u32(kconv as u32)
            .u32(n as u32)
            .u32(cd as u32)
            .u32(1);
        c.dispatch(Kernel::GdnConv, cd.div_ceil(64) as u32, &p);
        let groups = n * (2 * hk + 1);
        let p = Push::new()
            .addr(&c_out, 0)
            .addr(&qk, 0)
            .addr(&bbb, 0)
            .addr(&aab, 0)
            .addr(&ab, 0)
            .addr(&db, 0)
            .addr(&g, 0)
            .addr(&beta, 0)
            .u32(groups as u32)
            .u32(cd as u32)
            .u32(dk as u32)
            .u32(hk as u32)
            .u32(hv as u32)
            .f32(1e-6);
        c.dispatch(Kernel::GdnPrep, groups as u32, &p);
        let p = Push::new()
            .addr(&s, 0)
            .addr(&qk, 0)
            .addr(&qk, (4 * hk * dk) as u64)
            .addr(&c_out, (4 * 2 * hk * dk) as u64)
            .addr(&g, 0)
            .addr(&beta, 0)
            .addr(&o, 0)
            .u32(gdn_step_groups(hv, dv))
            .u32(dk as u32)
            .u32(dv as u32)
            .u32(hk as u32)
            .u32(n as u32)
            .u32((2 * hk * dk) as u32)
            .u32((2 * hk * dk) as u32)
            .u32(cd as u32)
            .u32(hv as u32)
            .u32((hv * dv) as u32)
            .u32(1);
        c.dispatch(Kernel::GdnStep, gdn_step_groups(hv, dv), &p);
        Ok(())
    })
    .unwrap();
    (
        get(v, &o, n * hv * dv),
        get(v, &win, win0.len()),
        get(v, &s, s0.len()),
    )
}

#[test]
fn gdn_chain_matches_reference_and_rows_are_invariant() {
    let v = vk();
    let mut rng = Rng(13);
    for (hk, hv, dk, dv, kconv) in [(2, 4, 32, 32, 4), (1, 3, 128, 128, 4), (2, 2, 16, 48, 2)] {
        let n = 4;
        let cd = 2 * hk * dk + hv * dv;
        let mixed = rng.vec(n * cd, 1.5);
        let bb = rng.vec(n * hv, 2.0);
        let aa = rng.vec(n * hv, 3.0);
        let conv_w = rng.vec(cd * kconv, 0.7);
        let ssm_a: Vec<f32> = rng.vec(hv, 1.0).iter().map(|a| -a.abs() - 0.1).collect();
        let dt_bias = rng.vec(hv, 1.0);
        let win0 = rng.vec((kconv - 1) * cd, 1.0);
        let s0 = rng.vec(hv * dk * dv, 0.3);
        let dims = (n, hk, hv, dk, dv, kconv);
        let (o, win, s) = gdn_gpu(
            &v, &mixed, &bb, &aa, &conv_w, &ssm_a, &dt_bias, &win0, &s0, dims,
        );

        // the reference, row by row
        let (mut rwin, mut rs) = (win0.clone(), s0.clone());
        let mut ro = vec![0f32; n * hv * dv];
        let qkw = hk * dk;
        for t in 0..n {
            let mut cvec = vec![0f32; cd];
            r::conv1d_silu_step(
                &mut rwin,
                &mixed[t * cd..(t + 1) * cd],
                &conv_w,
                kconv,
                &mut cvec,
            );
            let mut q = cvec[..qkw].to_vec();
            let mut k = cvec[qkw..2 * qkw].to_vec();
            r::l2norm_heads(&mut q, dk, 1e-6);
            r::l2norm_heads(&mut k, dk, 1e-6);
            let beta: Vec<f32> = (0..hv).map(|h| r::sigmoid(bb[t * hv + h])).collect();
            let g: Vec<f32> = (0..hv)
                .map(|h| ssm_a[h] * r::softplus(aa[t * hv + h] + dt_bias[h]))
                .collect();
            r::gdn_step(
                &mut rs,
                &q,
                &k,
                &cvec[2 * qkw..],
                &g,
                &beta,
                hk,
                dk,
                dv,
                &mut ro[t * hv * dv..(t + 1) * hv * dv],
            );
        }
        assert!(rel_err(&win, &rwin) == 0.0, "conv window {dims:?}");
        let (eo, es) = (rel_err(&o, &ro), rel_err(&s, &rs));
        assert!(
            eo < 1e-4 && es < 1e-4,
            "{dims:?}: outputs {eo:e}, state {es:e}"
        );

        // batch invariance: the same rows one dispatch at a time give the same bits
        let (mut w1, mut s1) = (win0.clone(), s0.clone());
        for t in 0..n {
            let one = (1, hk, hv, dk, dv, kconv);
            let (o1, nw, ns) = gdn_gpu(
                &v,
                &mixed[t * cd..(t + 1) * cd],
                &bb[t * hv..(t + 1) * hv],
                &aa[t * hv..(t + 1) * hv],
                &conv_w,
                &ssm_a,
                &dt_bias,
                &w1,
                &s1,
                one,
            );
            let row = &o[t * hv * dv..(t + 1) * hv * dv];
            assert!(
                o1.iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dims:?} row {t}"
            );
            (w1, s1) = (nw, ns);
        }
        assert!(
            s1.iter().zip(&s).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{dims:?}: final state"
        );
    }
}

/// f16 round trip, as the KV cache stores values.
fn f16r(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

/// The values a cache row holds: f16-rounded, or ggml q8_0 (per 32: d = f16(amax / 127), codes
/// round(x · 127 / amax) half away from zero, ±127; what the CPU backend stores).
fn kv_round(x: &[f32], q8: bool) -> Vec<f32> {
    if !q8 {
        return f16r(x);
    }
    x.chunks_exact(32)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = f16::from_f32(amax / 127.0).to_f32();
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            b.iter()
                .map(move |v| (v * inv).round().clamp(-127.0, 127.0) * d)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A cache buffer of `n_ctx` rows of `kvw` holding `rows` (already representable) in the layout
/// the shaders read: f16 pairs, or q8 codes four per word then f32 scales per 32.
fn kv_words(rows: &[f32], n_ctx: usize, kvw: usize, q8: bool) -> Vec<u32> {
    if !q8 {
        let mut w: Vec<u32> = rows
            .chunks_exact(2)
            .map(|p| {
                f16::from_f32(p[0]).to_bits() as u32 | (f16::from_f32(p[1]).to_bits() as u32) << 16
            })
            .collect();
        w.resize(n_ctx * kvw / 2, 0);
        return w;
    }
    let mut codes = vec![0u32; n_ctx * kvw / 4];
    let mut scales = vec![0u32; n_ctx * kvw / 32];
    for (bi, b) in rows.chunks_exact(32).enumerate() {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = f16::from_f32(amax / 127.0).to_f32();
        scales[bi] = d.to_bits();
        for (j, v) in b.iter().enumerate() {
            let c = if d > 0.0 { (v / d).round() as i8 } else { 0 };
            codes[(32 * bi + j) / 4] |= (c as u8 as u32) << (8 * (j % 4));
        }
    }
    codes.extend(scales);
    codes
}

/// Decode a cache buffer's first `rows` rows back to f32.
fn kv_decode(words: &[u32], rows: usize, n_ctx: usize, kvw: usize, q8: bool) -> Vec<f32> {
    if !q8 {
        return words[..rows * kvw / 2]
            .iter()
            .flat_map(|w| {
                [
                    f16::from_bits(*w as u16).to_f32(),
                    f16::from_bits((*w >> 16) as u16).to_f32(),
                ]
            })
            .collect();
    }
    let sc = &words[n_ctx * kvw / 4..];
    (0..rows * kvw)
        .map(|i| ((words[i / 4] >> (8 * (i % 4))) as u8 as i8) as f32 * f32::from_bits(sc[i / 32]))
        .collect()
}

#[test]
fn attention_matches_reference() {
    let v = vk();
    let mut rng = Rng(17);
    for q8 in [false, true] {
        for (nh, nkv, hd, n_rot, pos0, n) in [
            (4, 2, 64, 16, 70, 3),
            (2, 1, 256, 64, 0, 2),
            (6, 3, 128, 32, 129, 1),
        ] {
            let n_ctx = pos0 + n + 5;
            let kvw = nkv * hd;
            let qf = rng.vec(n * nh * 2 * hd, 1.5);
            let kf = rng.vec(n * kvw, 1.5);
            let vf = rng.vec(n * kvw, 1.5);
            let qn = rng.vec(hd, 1.0);
            let kn = rng.vec(hd, 1.0);
            // a cache whose first pos0 rows already hold random representable values
            let k_old = kv_round(&rng.vec(pos0 * kvw, 1.0), q8);
            let v_old = kv_round(&rng.vec(pos0 * kvw, 1.0), q8);
            let kc = v.buffer_u32(&kv_words(&k_old, n_ctx, kvw, q8)).unwrap();
            let vc = v.buffer_u32(&kv_words(&v_old, n_ctx, kvw, q8)).unwrap();
            let sc_off = (n_ctx * kvw / 4) as u32;
            let half = n_rot / 2;
            let mut rope = Vec::new();
            for t in 0..n {
                for d in 0..half {
                    let th = (pos0 + t) as f64 * 1e6f64.powf(-2.0 * d as f64 / n_rot as f64);
                    rope.push(th.cos() as f32);
                    rope.push(th.sin() as f32);
                }
            }
            let (qfb, kfb, vfb, qnb, knb, rb) = (
                buf(&v, &qf),
                buf(&v, &kf),
                buf(&v, &vf),
                buf(&v, &qn),
                buf(&v, &kn),
                buf(&v, &rope),
            );
            let q = v.alloc((4 * n * nh * hd) as u64).unwrap();
            let out = v.alloc((4 * n * nh * hd) as u64).unwrap();
            let scale = 1.0 / (hd as f32).sqrt();
            v.run(|c| {
                let groups = n * (nh + 2 * nkv);
                let p = Push::new()
                    .addr(&qfb, 0)
                    .addr(&kfb, 0)
                    .addr(&vfb, 0)
                    .addr(&qnb, 0)
                    .addr(&knb, 0)
                    .addr(&rb, 0)
                    .addr(&q, 0)
                    .addr(&kc, 0)
                    .addr(&vc, 0)
                    .u32(groups as u32)
                    .u32(nh as u32)
                    .u32(nkv as u32)
                    .u32(hd as u32)
                    .u32(n_rot as u32)
                    .u32(pos0 as u32)
                    .f32(1e-6)
                    .u32(q8 as u32)
                    .u32(sc_off);
                c.dispatch(Kernel::AttnPrep, groups as u32, &p);
                let p = Push::new()
                    .addr(&q, 0)
                    .addr(&qfb, 0)
                    .addr(&kc, 0)
                    .addr(&vc, 0)
                    .addr(&out, 0)
                    .u32((n * nh) as u32)
                    .u32(nh as u32)
                    .u32(nkv as u32)
                    .u32(hd as u32)
                    .u32(pos0 as u32)
                    .f32(scale)
                    .u32(q8 as u32)
                    .u32(sc_off);
                c.dispatch(Kernel::Attn, (n * nh) as u32, &p);
                Ok(())
            })
            .unwrap();
            let got = get(&v, &out, n * nh * hd);

            // reference: norms, RoPE (f64 angles), the cache's rounding, softmax attention, σ(gate)
            let (mut kcache, mut vcache) = (k_old.clone(), v_old.clone());
            let mut want = vec![0f32; n * nh * hd];
            for t in 0..n {
                let pos = pos0 + t;
                let mut qh = Vec::new();
                for h in 0..nh {
                    qh.extend_from_slice(&qf[(t * nh + h) * 2 * hd..(t * nh + h) * 2 * hd + hd]);
                }
                r::rmsnorm_heads(&mut qh, hd, &qn, 1e-6);
                r::rope_neox(&mut qh, hd, n_rot, pos, 1e6);
                let mut kt = kf[t * kvw..(t + 1) * kvw].to_vec();
                r::rmsnorm_heads(&mut kt, hd, &kn, 1e-6);
                r::rope_neox(&mut kt, hd, n_rot, pos, 1e6);
                kcache.extend(kv_round(&kt, q8));
                vcache.extend(kv_round(&vf[t * kvw..(t + 1) * kvw], q8));
                let o = &mut want[t * nh * hd..(t + 1) * nh * hd];
                r::attention(&qh, &kcache, &vcache, pos + 1, nh, nkv, hd, scale, o);
                for h in 0..nh {
                    for d in 0..hd {
                        o[h * hd + d] *= r::sigmoid(qf[(t * nh + h) * 2 * hd + hd + d]);
                    }
                }
            }
            let what = format!("q8 {q8} nh {nh} nkv {nkv} hd {hd} pos0 {pos0}");
            let e = rel_err(&got, &want);
            assert!(e < 2e-3, "attention {what}: relative error {e:e}");
            // the cache rows the prep wrote
            let words = if q8 {
                n_ctx * kvw / 4 + n_ctx * kvw / 32
            } else {
                n_ctx * kvw / 2
            };
            let mut kcw = vec![0u32; words];
            v.download(&kc, 0, bytemuck_u32(&mut kcw)).unwrap();
            let kc_f = kv_decode(&kcw, pos0 + n, n_ctx, kvw, q8);
            // f16: within rounding; q8: a value within a hair of a rounding boundary may take the
            // neighbouring code, one step of its block's max / 127
            let e = rel_err(&kc_f, &kcache);
            assert!(
                e < if q8 { 1e-2 } else { 2e-3 },
                "K cache rows {what}: {e:e}"
            );
        }
    }
}

fn bytemuck_u32(v: &mut [u32]) -> &mut [u8] {
    // SAFETY: u32 → bytes over exactly v's memory; any byte pattern is a valid u32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

#[test]
fn committed_spirv_matches_the_sources() {
    let m =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/spv/manifest.txt")).unwrap();
    assert!(
        m.lines()
            .any(|l| l.trim() == format!("source_fnv64 {}", bonsai_kernels_vulkan::SOURCE_FNV64)),
        "spv/ was built from other shader sources: run scripts/build_spirv.py"
    );
}

#[test]
fn bad_ranges_are_errors_not_panics() {
    let v = vk();
    let b = v.alloc(64).unwrap();
    assert!(v.upload(&b, 60, &[0u8; 8]).is_err());
    let mut out = [0u8; 8];
    assert!(v.download(&b, u64::MAX - 2, &mut out).is_err());
    assert!(v.run(|c| c.copy(&b, 0, &b, 32, 40)).is_err());
    // the context still works after the refused calls
    v.upload(&b, 0, &[1u8; 8]).unwrap();
    v.download(&b, 0, &mut out).unwrap();
    assert_eq!(out, [1u8; 8]);
}

/// Throughput of one-row mat-vecs at the 27B shapes (run on a GPU: `--ignored --nocapture`):
/// `reps` dispatches of one matrix in one submission (each followed by the context's barrier), so
/// the time per dispatch includes the barrier but no host work. `BONSAI_VK_SPV_DIR` A/Bs variants.
#[test]
#[ignore = "a benchmark: run on a GPU with --ignored --nocapture"]
fn mv_throughput_27b_shapes() {
    let v = vk();
    println!("device: {}", v.name());
    let mut rng = Rng(5);
    let reps = 200;
    for qt in [QuantType::Q1_0, QuantType::Q2_0G128] {
        for (n_in, n_out, what) in [
            (5120, 17408, "ffn_gate"),
            (17408, 5120, "ffn_down"),
            (6144, 5120, "ssm_out"),
            (5120, 248_320, "head"),
        ] {
            let data = random_weights(&mut rng, qt, n_in, n_out);
            let (k, codes, scales) = upload_mat(&v, qt, &data, n_in, n_out);
            let x = buf(&v, &rng.vec(n_in, 1.0));
            let y = v.alloc((4 * n_out) as u64).unwrap();
            for round in 0..2 {
                let t0 = std::time::Instant::now();
                v.run(|c| {
                    for _ in 0..reps {
                        let p = Push::new()
                            .addr(&codes, 0)
                            .addr(&scales, 0)
                            .addr(&x, 0)
                            .addr(&y, 0)
                            .u32(mv_groups(n_out, 1))
                            .u32(n_in as u32)
                            .u32(n_out as u32)
                            .u32(0);
                        c.dispatch(k, mv_groups(n_out, 1), &p);
                    }
                    Ok(())
                })
                .unwrap();
                let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
                if round == 1 {
                    let gb = data.len() as f64 / (us * 1e3);
                    println!("{qt:?} {what:<9} {n_out:>6} x {n_in:>5}: {us:8.2} us per dispatch, {gb:7.1} GB/s of file weights");
                }
            }
            if !v.info().int_dot {
                continue;
            }
            // the int8-activation kernel on the same weights (its quantization timed apart)
            let (lb, kd) = match qt {
                QuantType::Q1_0 => (LowBit::Q1, Kernel::MvDotQ1),
                _ => (LowBit::Q2g128, Kernel::MvDotQ2),
            };
            let (dc, ds) = split_blocks_dot(lb, &data, n_in, n_out).unwrap();
            let (dc, ds) = (v.buffer_u32(&dc).unwrap(), v.buffer_u32(&ds).unwrap());
            let q = q8_alloc(&v, 1, n_in);
            run_quant_q8(&v, &x, &q, 1, n_in);
            for round in 0..2 {
                let t0 = std::time::Instant::now();
                v.run(|c| {
                    // shader variants with other ROWS (BONSAI_VK_SPV_DIR) say theirs here
                    let rows = std::env::var("BONSAI_VK_DOT_ROWS")
                        .ok()
                        .and_then(|r| r.parse::<usize>().ok())
                        .unwrap_or(bonsai_kernels_vulkan::MV_DOT_ROWS);
                    let g = n_out.div_ceil(rows) as u32;
                    for _ in 0..reps {
                        let p = Push::new()
                            .addr(&dc, 0)
                            .addr(&ds, 0)
                            .addr(&q.q, 0)
                            .addr(&q.d, 0)
                            .addr(&q.s, 0)
                            .addr(&y, 0)
                            .u32(1)
                            .u32(n_in as u32)
                            .u32(n_out as u32)
                            .u32(0)
                            .u32(n_out as u32)
                            .u32(n_out as u32)
                            .u32(n_out as u32)
                            .u32(0)
                            .u32(0)
                            .u32(0);
                        c.dispatch(kd, g, &p);
                    }
                    Ok(())
                })
                .unwrap();
                let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
                if round == 1 {
                    let gb = data.len() as f64 / (us * 1e3);
                    println!("{qt:?} {what:<9} {n_out:>6} x {n_in:>5}: {us:8.2} us per dispatch, {gb:7.1} GB/s of file weights (int8 activations)");
                }
            }
            let t0 = std::time::Instant::now();
            v.run(|c| {
                let g = quant_q8_groups(1, n_in);
                for _ in 0..reps {
                    let p = Push::new()
                        .addr(&x, 0)
                        .addr(&q.q, 0)
                        .addr(&q.d, 0)
                        .addr(&q.s, 0)
                        .u32(g)
                        .u32(1)
                        .u32(n_in as u32)
                        .u32(q8_blocks(n_in) as u32);
                    c.dispatch(Kernel::QuantQ8, g, &p);
                }
                Ok(())
            })
            .unwrap();
            let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
            println!("{qt:?} {what:<9} quant_q8 of {n_in:>5}: {us:8.2} us per dispatch");
        }
    }
}
