//! bonsai CPU kernels. Free functions over slices with explicit dimensions; no model types.
//!
//! - [`quant`]: block formats and the reference dequantization (bit-level oracle).
//! - [`mod@reference`]: scalar reference ops, never optimized: the oracle for every backend.
//! - [`ops`]: parallel, SIMD-dispatched ops used by the CPU backend.
//! - [`attn`]: causal GQA attention over a KV cache with the output gate fused, in fixed key chunks.
//! - [`par`]: their parallel loops, on rayon or on a spinning pool ([`par::SpinPool`]).
//! - [`q1m`]: the Q1_0 mask layout, re-laid at load for the AVX2 / AVX-512 mat-vecs.
//! - [`q2m`]: the same for the Q2 (ternary) types.

pub mod attn;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod ops;
pub mod par;
pub mod q1m;
pub mod q2m;
pub mod quant;
pub mod reference;

pub use quant::QuantType;
