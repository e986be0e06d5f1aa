//! DDTree step kernels: the GPU tree builder, tree-verify MLA attention (absorbed form),
//! greedy / sampling accept and KV compaction, with their CPU references in [`reference`].
//!
//! Public CPU API (used by the engine's CPU backend and as the GPU oracle):
//! [`build_reference`], [`accept_reference`], [`sample_rows`], [`argmax_rows`],
//! [`verify_attention_reference`], [`chain_mask`], [`tree_size`], and the [`DraftTree`] / [`Acceptance`] types.

pub mod reference;

pub use reference::{
    accept_reference, argmax_rows, build_reference, build_with_lse, chain_mask, sample_rows, tree_size,
    verify_attention_reference, Acceptance, DraftTree, LATENT, ROPE, ROW,
};

pub mod accept;
pub mod build;
mod build_params;
mod build_warp;
pub mod verify_attn;

pub use accept::{CompactRows, SampleParams, TreeAccept, TreeSample, TreeStage};
pub use build::{TreeBuild, TreeBuildParams, MAX_K};
pub use verify_attn::{
    combine_grid, combine_layout, combine_output_grid, CombineOutputParams, MlaCombineOutput, MlaVerifyCombine,
    MlaVerifyNaive, MlaVerifyNarrow, MlaVerifySplit, MlaVerifyWg, MlaVerifyWide, VerifyParams, VerifyVariant, WgParams,
    WideParams,
};
pub mod check;
pub mod gpu;
pub mod op;
pub mod tune;
pub mod tune_verify;

pub use tune_verify::MlaVerify;
