//! The routing of one expert-parallel rank: its experts renumbered from 0, the others dropped
//! (weight 0, local expert 0), in place on the device. The grouped MoE kernels take a fixed
//! top-k per token, so a dropped choice stays in its slot with a zero weight instead of being
//! removed (the CPU backend removes it; the weighted sums are the same).

use ddtree_macros::{kernel, KernelParams};

/// Compile-time parameters of [`MoeLocalize`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct MoeLocalizeParams {
    /// Threads per block.
    pub block: u32,
}

/// For each of the `n` choices: an expert id in `[lo, hi)` becomes `id - lo`; any other id
/// becomes 0 with weight 0. Any grid (the kernel strides over the choices).
#[kernel(block = p.block, space = [MoeLocalizeParams { block: 256 }])]
pub fn moe_localize(#[comptime] p: &MoeLocalizeParams, ids: &mut [u32], weights: &mut [f32], n: u32, lo: u32, hi: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for i in (first..n).step_by(stride) {
        let id = ids[i];
        if id >= lo && id < hi {
            ids[i] = id - lo;
        } else {
            ids[i] = 0u32;
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
        .map(|(&id, &w)| if (lo..hi).contains(&id) { (id - lo, w) } else { (0, 0.0) })
        .unzip()
}
