//! model (in progress).
