//! Scalar reference ops (filled in by the kernels work).
