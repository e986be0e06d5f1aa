//! Rotary position embedding, in place, in either pair layout.
//!
//! DeepSeek-V3 / Kimi store rope dims as adjacent pairs; HF permutes them to half-split before
//! `rotate_half`, which equals rotating each pair `(2i, 2i + 1)` by the angle of frequency `i`.
//! Attention scores are unchanged by that permutation as long as q and k share it, so the
//! interleaved mode (`interleave: true`) rotates the pairs where they are. Models without the
//! permutation (Qwen3-style drafters) use HF's `rotate_half` layout directly: pairs
//! `(i, i + dim / 2)` (`interleave: false`).

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

/// The first element of a rotated pair: `x0 * c - x1 * s` (every RoPE kernel's math).
#[device_fn]
pub fn rope_first(x0: f32, x1: f32, c: f32, s: f32) -> f32 {
    x0 * c - x1 * s
}

/// The second element of a rotated pair: `x1 * c + x0 * s`.
#[device_fn]
pub fn rope_second(x0: f32, x1: f32, c: f32, s: f32) -> f32 {
    x1 * c + x0 * s
}

/// Offset of the first element of pair `i` within the rope dims: `2 i` interleaved, else `i`.
pub fn pair_step(interleave: bool) -> u32 {
    if interleave {
        2
    } else {
        1
    }
}

/// Distance from a pair's first element to its second: 1 interleaved, else `dim / 2`.
pub fn pair_distance(dim: u32, interleave: bool) -> u32 {
    if interleave {
        1
    } else {
        dim / 2
    }
}

/// Compile-time parameters of [`RopeInterleaved`] (the name predates the `interleave` switch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct RopeParams {
    /// Threads per block (one thread per pair).
    pub block: u32,
    /// Rope dimensions per head (64 for Kimi).
    pub dim: u32,
    /// Pair layout: `true` rotates adjacent pairs `(2i, 2i + 1)` (DeepSeek-V3 / Kimi), `false`
    /// pairs `(i, i + dim / 2)` (HF `rotate_half`); frequency `i` either way.
    pub interleave: bool,
}

/// Rotates the `dim` rope dims at `offset` of each of `rows` rows (`rows = tokens * heads`,
/// row stride `stride` elements). Token `t` is at `positions[t]`; `cos`/`sin` are
/// `[max_pos, dim / 2]` tables (YaRN scaling and attention factor already folded in); pair `i`
/// (see [`RopeParams::interleave`]) is rotated by entry `i`. Grid: `ceil(rows * dim / 2 / block)`
/// ([`grid`]).
#[kernel(block = p.block, space = [
    RopeParams { block: 256, dim: 64, interleave: true },
    RopeParams { block: 128, dim: 64, interleave: true },
    RopeParams { block: 512, dim: 64, interleave: true },
    RopeParams { block: 256, dim: 16, interleave: true },
    RopeParams { block: 256, dim: 64, interleave: false },
    RopeParams { block: 128, dim: 128, interleave: false },
    RopeParams { block: 256, dim: 16, interleave: false },
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
        // The pair's first element and the distance to its second.
        let a = row * stride + offset + comptime!(pair_step(p.interleave)) * i;
        let b = a + comptime!(pair_distance(p.dim, p.interleave));
        let x0 = x[a] as f32;
        let x1 = x[b] as f32;
        x[a] = rope_first(x0, x1, c, s) as bf16;
        x[b] = rope_second(x0, x1, c, s) as bf16;
    }
}

/// The launch grid for `rows` rows (tokens x heads): one thread per rotated pair.
pub fn grid(p: &RopeParams, rows: usize) -> u32 {
    (rows * p.dim as usize / 2).div_ceil(p.block as usize) as u32
}

/// CPU reference, in place on f32 rows (same layout and tables as the kernel; `interleave` as
/// [`RopeParams::interleave`]).
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
    interleave: bool,
) {
    let half = dim / 2;
    for (row, r) in x.chunks_mut(stride).enumerate() {
        let pos = positions[row / heads] as usize;
        for i in 0..half {
            let (c, s) = (cos[pos * half + i], sin[pos * half + i]);
            let (a, b) = if interleave {
                (offset + 2 * i, offset + 2 * i + 1)
            } else {
                (offset + i, offset + i + half)
            };
            let (x0, x1) = (r[a], r[b]);
            r[a] = x0 * c - x1 * s;
            r[b] = x1 * c + x0 * s;
        }
    }
}
