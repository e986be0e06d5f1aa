//! W4A16: bf16 activations times symmetric INT4 weights with bf16 group scales (the Kimi K2.x
//! routed experts), dense and grouped (MoE), with the host-side formats they read.
//!
//! - [`layout`]: the compressed-tensors checkpoint rule, Kimi's quantizer, the interleaved
//!   repack (CPU model), the fragment blocks of [`gemm_sk`] and the f32 reference;
//! - [`gemm`]: the `w4a16_gemm` tensor-core kernel, its split-K reduce, and the GPU repack;
//! - [`gemm_wg`]: the same product on the Hopper warpgroup tensor cores (`wgmma`), for M about
//!   16 to 256;
//! - [`gemm_sk`]: the dense product on the warpgroup tensor cores fed by bulk copies of
//!   operands laid out ahead (fragment blocks, activation tiles), balanced by stream-K;
//! - [`gemv`]: the small-token path (dense GEMV, routed gate_up and down) on the same layout,
//!   with its parameters and candidates in [`gemv_space`];
//! - [`moe`]: token-expert alignment, the grouped expert block and its reference;
//!   [`tune_moe`]: the block's `Tunable` (a path and its (gate_up, down) pair per token bucket);
//! - [`check`]: GPU-versus-CPU checks of every candidate.

pub mod check;
pub mod gemm;
pub mod gemm_sk;
pub mod gemm_wg;
pub mod gemv;
pub mod gemv_space;
pub mod layout;
pub mod moe;
mod moe_reference;
pub mod op;
pub mod tune;
pub mod tune_moe;
pub mod tune_wg;

pub use gemm::{Epilogue, Layout, ReduceParams, W4a16Gemm, W4a16Params, W4a16Reduce};
pub use gemm_sk::{ActTilesParams, W4a16ActTiles, W4a16GemmSk, W4a16SkParams};
pub use gemm_wg::{W4a16GemmWg, W4a16WgParams};
pub use gemv::{GemvMode, GemvW4Params, W4a16Gemv};
pub use layout::{PackedInt4, RepackParams, W4a16Repack, W4a16RepackFragment};
pub use moe::{AlignParams, MoeAlign, MoeInput, MoeKernels, MoeSum, MoeVariant, SumParams};
pub use tune_moe::MoeBlock;
