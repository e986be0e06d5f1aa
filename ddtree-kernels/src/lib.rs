//! ddtree's GPU kernels, written in the `#[kernel]` DSL, each with a CPU reference.
//!
//! Every kernel module holds the kernel (a type implementing [`ddtree_codegen::Kernel`]), its
//! params struct with the candidate list, and `reference`, the CPU version the GPU output is
//! checked against. [`catalogue`] lists every kernel for the snapshot and NVRTC tests, from the
//! [`registry`], where each kernel is listed once.
#![warn(missing_docs)]
// Check errors carry the interpreter's located hazard report; they are cold.
#![allow(clippy::result_large_err)]

pub mod attention;
pub mod check;
pub mod common;
pub mod elementwise;
pub mod embedding;
pub mod gemm_bf16;
pub mod gemv_bf16;
pub mod moe_route;
pub mod norm;
pub mod op;
pub mod registry;
pub mod topk;
pub mod tree;
pub mod tune;
pub mod vocab;
pub mod w4a16;

// The flat module paths callers used before the kernels moved into family folders.
pub use elementwise::{add, copy_rows, fill, rope, silu_mul};
pub use gemv_bf16 as gemv;
pub use norm::{residual, rms_norm};

pub use add::{AddAssign, AddParams};
pub use attention::{
    GqaAttention, GqaParams, MlaAbsorbOutput, MlaAbsorbQuery, MlaAppendParams, MlaAttention, MlaAttnParams,
    MlaKvAppend, MlaOutputParams, MlaQueryParams,
};
pub use copy_rows::{CopyParams, CopyRows};
pub use embedding::{Embedding, EmbeddingParams};
pub use fill::{FillParams, FillRandomBf16, FillRandomF32, FillRandomU32};
pub use gemm_bf16::{GemmBf16, GemmParams};
pub use gemv::{
    GemvBf16, GemvBf16F32, GemvGateUpSilu, GemvParams, GemvRmsNormBf16, GemvSplitBf16, GemvSplitF32,
    GemvSplitGateUpSilu, GemvSplitParams,
};
pub use moe_route::{MoeLocalize, MoeLocalizeParams, MoeRoute, MoeRouteParams};
pub use residual::{AddRmsNorm, AddRmsNormParams, CastBf16F32, CastF32Bf16, CastParams, CopyRowsF32};
pub use rms_norm::{RmsNorm, RmsNormParams};
pub use rope::{RopeInterleaved, RopeParams};
pub use silu_mul::{SiluMul, SiluMulParams, SiluMulSplit};
pub use topk::{RowTopk, RowTopkSplit, TopkParams, TopkRunner, TopkSplitParams};
pub use vocab::{EmbeddingSlice, EmbeddingSliceParams, RankArgmax, RankArgmaxParams};

use ddtree_codegen::{CodegenError, Kernel};

/// Whether a GPU of compute capability `cc` runs `wgmma` (`tree::MlaVerifyWg`,
/// `w4a16::W4a16GemmWg`): sm_90 (Hopper) only; the kernels are built for `sm_90a` there, and
/// later architectures have no `wgmma`.
pub fn wgmma_supported(cc: (i32, i32)) -> bool {
    cc == (9, 0)
}

/// One variant of one kernel: its symbol and generated source.
#[derive(Clone, Debug)]
pub struct Variant {
    /// Kernel name.
    pub kernel: &'static str,
    /// `extern "C"` symbol (name + params).
    pub symbol: String,
    /// CUDA C source.
    pub source: String,
}

fn variants<K: Kernel>() -> Result<Vec<Variant>, CodegenError> {
    K::space()
        .iter()
        .map(|p| {
            Ok(Variant {
                kernel: K::NAME,
                symbol: K::symbol(p),
                source: K::source(p)?,
            })
        })
        .collect()
}

macro_rules! catalogue_of {
    (suites { $( $name:ident: [ $( $(#[$flag:ident])? $k:path ),+ ] => $suite:path; )* } elsewhere [ $($o:path),* ]) => {
        /// Every variant of every kernel in this crate, in registry order ([`registry`]).
        pub fn catalogue() -> Result<Vec<Variant>, CodegenError> {
            let mut all = Vec::new();
            $($(all.extend(variants::<$k>()?);)+)*
            $(all.extend(variants::<$o>()?);)*
            Ok(all)
        }
    };
}
crate::for_each_suite!(catalogue_of);
