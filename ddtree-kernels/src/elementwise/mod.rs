//! Elementwise and data-movement kernels: the in-place add ([`add`]), SiLU-and-mul
//! ([`silu_mul`]), RoPE ([`rope`]), indexed row copies ([`copy_rows`]) and the random fills the
//! tuner and the random-weight models use ([`fill`]).

pub mod add;
pub mod check;
pub mod copy_rows;
pub mod fill;
pub mod op;
pub mod rope;
pub mod silu_mul;
pub mod tune;
