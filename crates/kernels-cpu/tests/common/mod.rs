//! Shared test helpers: a deterministic RNG and random weight bytes for every type.
#![allow(dead_code)]

use bonsai_kernels_cpu::quant::QuantType;
use half::{bf16, f16};

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn u64(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        ((self.u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    pub fn byte(&mut self) -> u8 {
        (self.u64() >> 56) as u8
    }
}

/// Random raw bytes of `n_out` rows of `n_in` elements of `qt`. Q2 codes avoid 3 unless `code3`.
pub fn random_weights(
    rng: &mut Rng,
    qt: QuantType,
    n_in: usize,
    n_out: usize,
    code3: bool,
) -> Vec<u8> {
    let nblk = n_in / qt.block_elems() * n_out;
    let mut out = Vec::with_capacity(nblk * qt.block_bytes());
    for _ in 0..nblk {
        match qt {
            QuantType::F32 => out.extend_from_slice(&rng.f().to_le_bytes()),
            QuantType::F16 => {
                out.extend_from_slice(&f16::from_f32(rng.f()).to_bits().to_le_bytes())
            }
            QuantType::BF16 => {
                out.extend_from_slice(&bf16::from_f32(rng.f()).to_bits().to_le_bytes())
            }
            _ => {
                let d = 0.02 + 0.05 * rng.f().abs();
                let d = if rng.byte() & 1 == 0 { d } else { -d };
                out.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                if qt == QuantType::Q4_1 {
                    out.extend_from_slice(&f16::from_f32(rng.f() * 0.1).to_bits().to_le_bytes());
                }
                let nq = qt.block_bytes() - if qt == QuantType::Q4_1 { 4 } else { 2 };
                for _ in 0..nq {
                    let mut b = rng.byte();
                    if qt.is_q2() && !code3 {
                        // map any code 3 to code 2
                        for s in 0..4 {
                            if (b >> (2 * s)) & 3 == 3 {
                                b &= !(1 << (2 * s));
                            }
                        }
                    }
                    out.push(b);
                }
            }
        }
    }
    assert_eq!(out.len(), qt.row_bytes(n_in).unwrap() * n_out);
    out
}

pub const ALL_TYPES: [QuantType; 10] = [
    QuantType::F32,
    QuantType::F16,
    QuantType::BF16,
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q8_0,
    QuantType::Q1_0,
    QuantType::Q2_0G128,
    QuantType::Q2_0G64,
    QuantType::PQ2_0,
];

pub const LOWBIT: [QuantType; 4] = [
    QuantType::Q1_0,
    QuantType::Q2_0G128,
    QuantType::Q2_0G64,
    QuantType::PQ2_0,
];

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0, |m, v| m.max(v.abs()))
}

/// `matmul_masked` on the AVX2 / AVX-512 kernels this CPU has, with 1 and 2 threads, equals the
/// scalar `matmul_q` on the file layout bit for bit: `qt` weights `w` (file layout) and `wm` (the
/// same in its mask layout), `n_out` rows of `n_in`, for every activation-row count of `ns`.
/// Returns the ISAs it ran (empty: none here).
pub fn check_masked_matmul(
    rng: &mut Rng,
    qt: QuantType,
    w: &[u8],
    wm: &[u8],
    n_in: usize,
    n_out: usize,
    ns: &[usize],
) -> Vec<bonsai_kernels_cpu::ops::Isa> {
    use bonsai_kernels_cpu::ops::{self, isa_supported, Isa};
    let isas: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&i| isa_supported(i))
        .collect();
    for &n in ns {
        let x = rng.vec(n * n_in, 3.0);
        let xq = ops::quantize_acts(&x, n, n_in);
        let mut want = vec![0f32; n * n_out];
        ops::matmul_q_isa(Isa::Scalar, w, qt, n_in, n_out, &xq, &mut want);
        for (&isa, threads) in isas.iter().flat_map(|i| [(i, 1usize), (i, 2)]) {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut got = vec![0f32; n * n_out];
            pool.install(|| ops::matmul_masked_isa(isa, wm, qt, n_in, n_out, &xq, &mut got));
            for i in 0..got.len() {
                assert_eq!(
                    got[i].to_bits(),
                    want[i].to_bits(),
                    "{qt:?} {isa:?} n_in {n_in} n_out {n_out} n {n} threads {threads} idx {i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        }
    }
    isas
}
