//! One error type for the engine. Every message names what is wrong: the tensor or key, and the
//! expected vs found value. Mapped once to Python exceptions (bonsai-py) and once to OpenAI error
//! bodies (the server).

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The container itself is malformed: bad magic/version, truncation, absurd counts or lengths,
    /// offsets past the end or overlapping, misalignment, bad strings.
    #[error("invalid GGUF file: {0}")]
    Format(String),

    /// The file is a well-formed GGUF but is not a model this engine serves (wrong architecture,
    /// Bonsai 2, a drafter passed as target, ...).
    #[error("unsupported model: {0}")]
    Unsupported(String),

    /// A metadata key is missing or has the wrong type or an invalid value.
    #[error("metadata key '{key}': {msg}")]
    Metadata { key: String, msg: String },

    /// A tensor is missing, unexpected, of a disallowed type, or mis-shaped.
    #[error("tensor '{name}': {msg}")]
    Tensor { name: String, msg: String },

    /// A drafter that does not fit its target.
    #[error("drafter does not match target: {0}")]
    DrafterMismatch(String),

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    Template(String),

    /// A bad request: invalid sampling values, a prompt past the context, an empty prompt, ...
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// The prompt plus requested generation does not fit the context.
    #[error("context overflow: {0}")]
    ContextOverflow(String),

    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),

    #[error("backend error: {0}")]
    Backend(String),

    #[error("cancelled")]
    Cancelled,

    #[error("engine stopped: {0}")]
    EngineStopped(String),
}

impl Error {
    pub fn format(msg: impl Into<String>) -> Error {
        Error::Format(msg.into())
    }
    pub fn tensor(name: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Tensor {
            name: name.into(),
            msg: msg.into(),
        }
    }
    pub fn metadata(key: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Metadata {
            key: key.into(),
            msg: msg.into(),
        }
    }
    /// A short, stable kind name (used for Python exception classes and OpenAI error types).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Format(_) => "format",
            Error::Unsupported(_) => "unsupported",
            Error::Metadata { .. } => "metadata",
            Error::Tensor { .. } => "tensor",
            Error::DrafterMismatch(_) => "drafter_mismatch",
            Error::Tokenizer(_) => "tokenizer",
            Error::Template(_) => "template",
            Error::InvalidRequest(_) => "invalid_request",
            Error::ContextOverflow(_) => "context_overflow",
            Error::BackendUnavailable(_) => "backend_unavailable",
            Error::Backend(_) => "backend",
            Error::Cancelled => "cancelled",
            Error::EngineStopped(_) => "engine_stopped",
        }
    }
}
