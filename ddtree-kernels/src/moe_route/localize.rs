//! The routing of one expert-parallel rank: its experts renumbered from 0, the others dropped
//! in place on the device. The W4A16 MoE kernels take a fixed top-k per token and skip the
//! expert ids past the rank's experts, so a dropped choice stays in its slot as id
//! `hi - lo` (the rank's expert count) with weight 0 (the CPU backend removes it; the sums are
//! the same). It must not become a local id: the small-token GEMV pair walks each token's
//! distinct experts, and a dropped choice on a kept expert's id would shadow it.

use ddtree_macros::{kernel, KernelParams};

/// Compile-time parameters of [`MoeLocalize`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct MoeLocalizeParams {
    /// Threads per block.
    pub block: u32,
}

/// For each of the `n` choices: an expert id in `[lo, hi)` becomes `id - lo`; any other id
/// becomes `hi - lo` (past the rank's experts) with weight 0. Any grid (the kernel strides
/// over the choices).
#[kernel(block = p.block, space = [MoeLocalizeParams { block: 256 }])]
pub fn moe_localize(#[comptime] p: &MoeLocalizeParams, ids: &mut [u32], weights: &mut [f32], n: u32, lo: u32, hi: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for i in (first..n).step_by(stride) {
        let id = ids[i];
        if id >= lo && id < hi {
            ids[i] = id - lo;
        } else {
            ids[i] = hi - lo;
            weights[i] = 0.0f32;
        }
    }
}

/// The launch grid for `n` choices: one per thread, at most 1024 blocks.
pub fn grid(p: &MoeLocalizeParams, n: usize) -> u32 {
    n.div_ceil(p.block as usize).clamp(1, 1024) as u32
}

/// CPU reference of [`moe_localize`].
pub fn reference(ids: &[u32], weights: &[f32], lo: u32, hi: u32) -> (Vec<u32>, Vec<f32>) {
    ids.iter()
        .zip(weights)
        .map(|(&id, &w)| {
            if (lo..hi).contains(&id) {
                (id - lo, w)
            } else {
                (hi - lo, 0.0)
            }
        })
        .unzip()
}
