//! Optimized CPU ops (filled in by the kernels work).
