//! CUDA runtime for ddtree kernels: device discovery that never panics, NVRTC compilation with
//! readable errors, and typed launches of `#[kernel]` variants.
//!
//! It knows no particular kernel: everything is generic over [`ddtree_codegen::Kernel`].
#![warn(missing_docs)]

mod device;
mod error;
mod launch;
pub mod nvrtc;
pub mod timing;

pub use cudarc;
pub use device::{arch_name, driver_available, Fingerprint, Gpu};
pub use error::RuntimeError;
pub use launch::{CompiledKernel, Grid, Launcher};
