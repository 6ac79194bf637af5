//! gguf (in progress).
