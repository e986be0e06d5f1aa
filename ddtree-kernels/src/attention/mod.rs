//! Attention kernels at runtime dimensions, for models and shapes the fixed-width fast paths of
//! [`crate::tree`] do not cover:
//!
//! - [`mla`]: the MLA latent-cache append (RMSNorm of `c_kv` + interleaved RoPE of `k_pe`,
//!   written to a cache row) and absorbed-MLA tree/causal attention at any `lora` / `rope`
//!   (the fallback of `mla_verify_split`, and the kernel for tiny test models);
//! - [`gqa`]: non-causal grouped-query attention (the DFlash drafter's attention);
//! - [`check`]: kernel-versus-reference checks of every candidate.

pub mod check;
pub mod gqa;
pub mod mla;

pub use gqa::{GqaAttention, GqaParams};
pub use mla::{MlaAppendParams, MlaAttention, MlaAttnParams, MlaKvAppend};
