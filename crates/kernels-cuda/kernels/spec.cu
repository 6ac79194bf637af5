// DSpark round: GDN verify records and replay rollback, drafter ops. Appended to bonsai.cu and
// gemm.cu by lib.rs (same translation unit: their typedefs and helpers are in scope).
