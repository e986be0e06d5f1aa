//! The vocabulary-parallel pieces of a rank's step, on the device so that the step can be
//! captured in a CUDA graph and has no host sync of its own:
//!
//! - [`EmbeddingSlice`]: the embedding lookup of a rank that holds the vocabulary slice
//!   `[lo, hi)`: ids in it are looked up at `id - lo`, the others give zero rows (the ranks'
//!   rows are then summed by an all-reduce);
//! - [`RankArgmax`]: the greedy token of every row from every rank's `(max, local column)`
//!   (all-gathered), the largest value winning, ties to the lower vocabulary index.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

/// This family's checks (re-exported by [`crate::check`]).
pub mod check;
pub mod op;

/// Compile-time parameters of [`EmbeddingSlice`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct EmbeddingSliceParams {
    /// Threads per block (one block per id).
    pub block: u32,
    /// 128-bit copies of 8 bf16 (needs `hidden % 8 == 0`).
    pub vec: bool,
}

/// Gathers the rows of this rank's slice `table` (`[hi - lo, hidden]`, vocabulary rows
/// `[lo, hi)`) for `ids` (grid = number of ids): row `id - lo` for an id in `[lo, hi)`, a zero
/// row for any other id.
#[kernel(block = p.block, space = [
    EmbeddingSliceParams { block: 256, vec: true },
    EmbeddingSliceParams { block: 256, vec: false },
])]
pub fn embedding_slice(
    #[comptime] p: &EmbeddingSliceParams,
    ids: &[u32],
    table: &[bf16],
    out: &mut [bf16],
    hidden: u32,
    lo: u32,
    hi: u32,
) {
    let t = block_idx_x();
    let id = ids[t];
    let valid = id >= lo && id < hi;
    // The table is read only for ids in the slice (a rank's slice may be empty).
    let src = if valid { id - lo } else { 0u32 } * hidden;
    if p.vec && valid {
        for c in (thread_idx_x()..hidden / 8).step_by(p.block) {
            let v = table.vload(src + c * 8);
            out.vstore(t * hidden + c * 8, v);
        }
    } else {
        for i in (thread_idx_x()..hidden).step_by(p.block) {
            let v = if valid { table[src + i] as f32 } else { 0.0f32 };
            out[t * hidden + i] = v as bf16;
        }
    }
}

/// CPU reference of [`EmbeddingSlice`]: `table` holds the rows of `[lo, hi)`.
pub fn embedding_slice_reference(ids: &[u32], table: &[f32], hidden: usize, lo: u32, hi: u32) -> Vec<f32> {
    ids.iter()
        .flat_map(|&id| {
            let row = (lo..hi).contains(&id).then(|| (id - lo) as usize);
            (0..hidden).map(move |i| row.map_or(0.0, |r| table[r * hidden + i]))
        })
        .collect()
}

/// Compile-time parameters of [`RankArgmax`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct RankArgmaxParams {
    /// Threads per block.
    pub block: u32,
}

/// The greedy token of each of `rows` rows from the `world` ranks' per-row maxima: `values` and
/// `indices` are `[world, rows]` (rank `k`'s row `r` at `k * rows + r`, as an all-gather leaves
/// them), `indices` local to rank `k`'s slice, which starts at `k * slice`. Writes the global
/// index of the largest value to `out[r]`, the lower index among equal values (the local argmax
/// never yields NaN; a rank with no candidate gives `(-inf, u32::MAX)`, which stays
/// `u32::MAX` and loses every tie). Any grid (the kernel strides over the rows).
#[kernel(block = p.block, space = [RankArgmaxParams { block: 128 }])]
pub fn rank_argmax(
    #[comptime] p: &RankArgmaxParams,
    values: &[f32],
    indices: &[u32],
    out: &mut [u32],
    rows: u32,
    world: u32,
    slice: u32,
) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for r in (first..rows).step_by(stride) {
        let mut best_v = values[r];
        let mut best_i = indices[r];
        for k in 1..world {
            let v = values[k * rows + r];
            let local = indices[k * rows + r];
            let mut i = u32::MAX;
            if local != u32::MAX {
                i = k * slice + local;
            }
            if v > best_v || (v == best_v && i < best_i) {
                best_v = v;
                best_i = i;
            }
        }
        out[r] = best_i;
    }
}

/// The launch grid of [`RankArgmax`] for `rows` rows: one thread per row, at most 1024 blocks.
pub fn rank_argmax_grid(p: &RankArgmaxParams, rows: usize) -> u32 {
    rows.div_ceil(p.block as usize).clamp(1, 1024) as u32
}

/// CPU reference of [`RankArgmax`].
pub fn rank_argmax_reference(values: &[f32], indices: &[u32], rows: usize, world: usize, slice: u32) -> Vec<u32> {
    (0..rows)
        .map(|r| {
            let (mut bv, mut bi) = (values[r], indices[r]);
            for k in 1..world {
                let (v, local) = (values[k * rows + r], indices[k * rows + r]);
                let i = if local == u32::MAX {
                    u32::MAX
                } else {
                    k as u32 * slice + local
                };
                if v > bv || (v == bv && i < bi) {
                    (bv, bi) = (v, i);
                }
            }
            bi
        })
        .collect()
}
