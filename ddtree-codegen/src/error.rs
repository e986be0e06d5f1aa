//! Errors raised while building or validating a kernel's IR.

use crate::ir::Loc;

/// An error in a kernel body found while building its IR for one parameter set.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{file}:{loc}: in kernel `{kernel}`: {message}")]
pub struct CodegenError {
    /// Kernel or device function being built.
    pub kernel: String,
    /// Source file of the kernel (from `file!()`).
    pub file: String,
    /// Location in that file.
    pub loc: Loc,
    /// What is wrong.
    pub message: String,
}

/// Result alias for IR construction.
pub type Result<T, E = CodegenError> = std::result::Result<T, E>;

/// An error without kernel context yet; the builder adds it.
#[derive(Debug, Clone, PartialEq)]
pub struct OpError(pub String);

impl OpError {
    /// Builds an error from anything printable.
    pub fn new(msg: impl Into<String>) -> Self {
        OpError(msg.into())
    }
}

/// Shorthand for `Err(OpError::new(format!(..)))`.
macro_rules! op_bail {
    ($($t:tt)*) => { return Err($crate::error::OpError::new(format!($($t)*))) };
}
pub(crate) use op_bail;
