//! Proc-macros of ddtree: `#[kernel]`, `#[device_fn]` and `#[derive(KernelParams)]`.
//!
//! A thin front end in the thiserror / serde_derive mould: parse (syn) -> validate (errors
//! accumulated and spanned on the user's tokens) -> emit (quote). The emitted code calls
//! `ddtree_codegen` to build the kernel IR at run time, one parameter set at a time. The DSL is
//! documented in `docs/dsl.md`.

mod body;
mod eval;
mod kernel;
mod params;

use proc_macro::TokenStream;

/// Turns a function written in the kernel DSL into a kernel type (the function name in
/// PascalCase) implementing `ddtree_codegen::Kernel`, with a typed launcher.
///
/// Arguments: `block = <comptime expr>` or `block = (x, y, z)` (threads per block; it also
/// becomes `__launch_bounds__`), `space = [Params { .. }, ..]` or `space = <expr>` (the
/// candidate list; index 0 is the default), `dyn_smem = <comptime expr>` (bytes of dynamic
/// shared memory) and `min_blocks = <comptime expr>` (blocks per SM the registers must allow,
/// the second `__launch_bounds__` argument; 0: none). See `docs/dsl.md`.
#[proc_macro_attribute]
pub fn kernel(args: TokenStream, item: TokenStream) -> TokenStream {
    kernel::expand(args.into(), item.into(), kernel::Kind::Kernel).into()
}

/// A device function callable from kernels: scalar arguments, an optional scalar return.
#[proc_macro_attribute]
pub fn device_fn(args: TokenStream, item: TokenStream) -> TokenStream {
    kernel::expand(args.into(), item.into(), kernel::Kind::DeviceFn).into()
}

/// Implements `ddtree_codegen::KernelParams` for a struct of parameters (fields of integer,
/// bool or derived enum types), or `ddtree_codegen::ParamField` for a fieldless enum.
#[proc_macro_derive(KernelParams)]
pub fn derive_kernel_params(item: TokenStream) -> TokenStream {
    params::derive(item.into()).into()
}
