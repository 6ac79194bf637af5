//! sampling (in progress).
