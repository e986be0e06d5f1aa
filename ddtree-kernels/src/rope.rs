//! Rotary position embedding on interleaved pairs, in place.
//!
//! DeepSeek-V3 / Kimi store rope dims as adjacent pairs; HF permutes them to half-split before
//! `rotate_half`, which equals rotating each pair `(2i, 2i + 1)` by the angle of frequency `i`.
//! Attention scores are unchanged by that permutation as long as q and k share it, so this
//! kernel rotates the pairs where they are.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

/// Compile-time parameters of [`RopeInterleaved`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct RopeParams {
    /// Threads per block (one thread per pair).
    pub block: u32,
    /// Rope dimensions per head (64 for Kimi).
    pub dim: u32,
}

/// Rotates the `dim` rope dims at `offset` of each of `rows` rows (`rows = tokens * heads`,
/// row stride `stride` elements). Token `t` is at `positions[t]`; `cos`/`sin` are
/// `[max_pos, dim / 2]` tables (YaRN scaling already folded in). Grid: `ceil(rows * dim / 2 / block)`.
#[kernel(block = p.block, space = [
    RopeParams { block: 256, dim: 64 },
    RopeParams { block: 128, dim: 64 },
    RopeParams { block: 512, dim: 64 },
    RopeParams { block: 256, dim: 16 },
])]
#[allow(clippy::too_many_arguments)]
pub fn rope_interleaved(
    #[comptime] p: &RopeParams,
    x: &mut [bf16],
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
    rows: u32,
    heads: u32,
    stride: u32,
    offset: u32,
) {
    comptime_assert!(p.dim % 2 == 0, "rope dims come in pairs");
    let half = p.dim / 2;
    let g = block_idx_x() * p.block + thread_idx_x();
    let row = g / half;
    let i = g % half;
    if row < rows {
        let pos = positions[row / heads];
        let c = cos[pos * half + i];
        let s = sin[pos * half + i];
        let at = row * stride + offset + 2 * i;
        let x0 = x[at] as f32;
        let x1 = x[at + 1] as f32;
        x[at] = (x0 * c - x1 * s) as bf16;
        x[at + 1] = (x1 * c + x0 * s) as bf16;
    }
}

/// The launch grid for `rows` rows (tokens x heads): one thread per rotated pair.
pub fn grid(p: &RopeParams, rows: usize) -> u32 {
    (rows * p.dim as usize / 2).div_ceil(p.block as usize) as u32
}

/// CPU reference, in place on f32 rows (same layout and tables as the kernel).
#[allow(clippy::too_many_arguments)]
pub fn reference(
    x: &mut [f32],
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    stride: usize,
    offset: usize,
    dim: usize,
) {
    let half = dim / 2;
    for (row, r) in x.chunks_mut(stride).enumerate() {
        let pos = positions[row / heads] as usize;
        for i in 0..half {
            let (c, s) = (cos[pos * half + i], sin[pos * half + i]);
            let (x0, x1) = (r[offset + 2 * i], r[offset + 2 * i + 1]);
            r[offset + 2 * i] = x0 * c - x1 * s;
            r[offset + 2 * i + 1] = x1 * c + x0 * s;
        }
    }
}
