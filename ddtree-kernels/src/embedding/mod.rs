//! Embedding gather: `out[t, :] = table[ids[t], :]`.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

/// This family's checks (re-exported by [`crate::check`]).
pub mod check;
pub mod op;
pub mod tune;

/// Compile-time parameters of [`Embedding`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct EmbeddingParams {
    /// Threads per block (one block per token).
    pub block: u32,
    /// 128-bit copies of 8 bf16 (needs `hidden % 8 == 0`).
    pub vec: bool,
}

/// Gathers rows of `table` (`[vocab, hidden]`) for `ids` (grid = number of ids). An id outside
/// the vocabulary gives a zero row (the engine rejects such ids before launching).
#[kernel(block = p.block, space = [
    EmbeddingParams { block: 256, vec: true },
    EmbeddingParams { block: 128, vec: true },
    EmbeddingParams { block: 512, vec: true },
    EmbeddingParams { block: 256, vec: false },
])]
pub fn embedding(
    #[comptime] p: &EmbeddingParams,
    ids: &[u32],
    table: &[bf16],
    out: &mut [bf16],
    hidden: u32,
    vocab: u32,
) {
    let t = block_idx_x();
    let id = ids[t];
    let valid = id < vocab;
    let src = if valid { id } else { 0u32 } * hidden;
    if p.vec {
        for c in (thread_idx_x()..hidden / 8).step_by(p.block) {
            let mut v = table.vload(src + c * 8);
            if !valid {
                v.x = 0u32;
                v.y = 0u32;
                v.z = 0u32;
                v.w = 0u32;
            }
            out.vstore(t * hidden + c * 8, v);
        }
    } else {
        for i in (thread_idx_x()..hidden).step_by(p.block) {
            let v = if valid { table[src + i] as f32 } else { 0.0f32 };
            out[t * hidden + i] = v as bf16;
        }
    }
}

/// CPU reference (ids outside the vocabulary give zero rows).
pub fn reference(ids: &[u32], table: &[f32], hidden: usize) -> Vec<f32> {
    let vocab = table.len() / hidden;
    ids.iter()
        .flat_map(|&id| {
            let id = id as usize;
            (0..hidden).map(move |i| if id < vocab { table[id * hidden + i] } else { 0.0 })
        })
        .collect()
}
