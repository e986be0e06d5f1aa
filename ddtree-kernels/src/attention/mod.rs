//! Attention kernels at runtime dimensions, for models and shapes the fixed-width fast paths of
//! [`crate::tree`] do not cover:
//!
//! - [`mla`]: the MLA latent-cache append (RMSNorm of `c_kv` + interleaved RoPE of `k_pe`,
//!   written to a cache row) and absorbed-MLA tree/causal attention at any `lora` / `rope`
//!   (the fallback of `mla_verify_split`, and the kernel for tiny test models);
//! - [`mla_absorb`]: the absorbed-MLA query (`q_nope . W_UK` plus the roped rope dims) and
//!   output (`o_lat . W_UV^T`) projections for a few tokens, one launch each;
//! - [`gqa`]: non-causal grouped-query attention (the DFlash drafter's attention);
//! - [`check`]: kernel-versus-reference checks of every candidate.

pub mod check;
pub mod gqa;
pub mod mla;
pub mod mla_absorb;
pub mod op;
pub mod tune;

pub use gqa::{GqaAttention, GqaParams};
pub use mla::{MlaAppendParams, MlaAttention, MlaAttnParams, MlaKvAppend};
pub use mla_absorb::{MlaAbsorbOutput, MlaAbsorbQuery, MlaOutputParams, MlaQueryParams};
