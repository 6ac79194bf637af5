//! backend (in progress).
