// Prefill: tensor-core (int8 mma) matrix products for n > MAXN rows. Appended to bonsai.cu by
// lib.rs (same translation unit: its typedefs and helpers are in scope).
