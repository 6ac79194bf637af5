//! bonsai-engine: everything model- or loop-shaped, generic over a backend. No pyo3.
//!
//! - [`gguf`]: GGUF v3 reader over an mmap, zero-copy; id-42 block-size resolution.
//! - [`config`]: `qwen35` target and `dspark` drafter configs from the header, and full
//!   tensor validation (names, types, shapes).
//! - [`tokenizer`], [`chat`]: byte-level BPE from the GGUF arrays; chat template rendering.
//! - [`sampling`]: the host sampler chain (greedy, temperature, top-k/p, min-p, penalties, logprobs).
//! - [`model`]: the qwen35 forward, written once, generic over [`backend::Backend`].
//! - [`drafter`]: the DSpark drafter (host forward, staged context window, Markov head).
//! - [`spec`]: the speculative round (verify, accept, rollback), n-gram drafts, the policy.
//! - [`engine`]: the request loop on its own thread, events and cancellation.

pub mod backend;
pub mod chat;
pub mod config;
pub mod drafter;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod inspect;
pub mod model;
pub mod sampling;
pub mod spec;
pub mod tokenizer;

pub use bonsai_kernels_cpu::QuantType;
pub use error::{Error, Result};
