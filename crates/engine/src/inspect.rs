//! inspect (in progress).
