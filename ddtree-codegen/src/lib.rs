//! Kernel IR, validation and the CUDA C renderer behind ddtree's `#[kernel]` DSL.
//!
//! The `ddtree-macros` crate turns a kernel written in a Rust-syntax subset into a type that
//! implements [`Kernel`]; its [`Kernel::ir`] runs generated [`Builder`] calls for one set of
//! compile-time parameters, and [`render`] prints the IR as CUDA C for NVRTC. See `docs/dsl.md`.
#![warn(missing_docs)]
// Errors carry the kernel, thread and DSL location; they are cold, so their size is fine.
#![allow(clippy::result_large_err)]

mod builder;
mod error;
pub mod interp;
pub mod intrinsics;
pub mod ir;
mod kernel;
pub mod ops;
pub mod render;

pub use builder::{Builder, ForHeader, MAX_DYN_SMEM};
pub use error::{CodegenError, OpError, Result};
pub use ir::{KernelIr, Loc, Scalar, Space, Ty};
pub use kernel::{symbol, Kernel, KernelId, KernelParams, ParamField, ParamValue};
pub use render::render;

/// Types the DSL names in kernel signatures (`bf16`, `f16`, `u32x4`); import with
/// `use ddtree_codegen::dsl::*`.
pub mod dsl {
    pub use half::{bf16, f16};

    /// Four u32 lanes: the value of a 128-bit vector load (`x.vload(i)`). Host-side stand-in
    /// for the name; the DSL gives it meaning.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    #[repr(C, align(16))]
    #[allow(non_camel_case_types)]
    pub struct u32x4 {
        /// Lane 0.
        pub x: u32,
        /// Lane 1.
        pub y: u32,
        /// Lane 2.
        pub z: u32,
        /// Lane 3.
        pub w: u32,
    }
}
