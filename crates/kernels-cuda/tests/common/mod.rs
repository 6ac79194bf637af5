//! Shared by the GPU test binaries: the one `Gpu` of the process (or none), the skip macro, and a
//! small deterministic RNG (splitmix64).

#![allow(dead_code)]

use bonsai_kernels_cuda::Gpu;
use std::sync::OnceLock;

/// The process's GPU, or `None` when no CUDA device exists.
pub fn gpu() -> Option<&'static Gpu> {
    static G: OnceLock<Option<Gpu>> = OnceLock::new();
    G.get_or_init(|| {
        if !bonsai_kernels_cuda::cuda_available() {
            return None;
        }
        Some(Gpu::new(0).expect("CUDA present but Gpu::new failed"))
    })
    .as_ref()
}

/// The GPU, or return from the test after saying it was skipped (a skip proves nothing).
#[macro_export]
macro_rules! need_gpu {
    ($name:expr) => {
        match common::gpu() {
            Some(g) => g,
            None => {
                eprintln!("SKIPPED {}: no CUDA device (not counted as run)", $name);
                return;
            }
        }
    };
}

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        ((self.u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    /// One byte per draw.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u64() as u8).collect()
    }
    /// Eight bytes per draw (large buffers).
    pub fn bytes8(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n);
        while v.len() + 8 <= n {
            v.extend_from_slice(&self.u64().to_le_bytes());
        }
        while v.len() < n {
            v.push(self.u64() as u8);
        }
        v
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
}
