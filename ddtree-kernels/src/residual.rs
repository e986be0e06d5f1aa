//! The f32 residual stream: the residual add fused with the following RMSNorm (as vLLM's
//! `fused_add_rms_norm`), bf16 <-> f32 casts, and the f32 row copy.
//!
//! The stream `x` stays in f32 between layers; only the normalized activations that feed the
//! GEMMs are rounded to bf16.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

use crate::add::GRID_MAX;
use crate::common::block_sum;
use crate::copy_rows::CopyParams;

/// Compile-time parameters of [`AddRmsNorm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct AddRmsNormParams {
    /// Threads per block (one block per row).
    pub block: u32,
    /// Add `y` into `x` first (otherwise `y` is not read and `x` not written).
    pub add: bool,
}

/// For each of `rows` rows of `n` (grid = rows, one block per row): when `p.add`,
/// `x[r, i] += f32(y[r, i])` (written back, f32); then with `inv = 1 / sqrt(mean(x[r]^2) + eps)`
/// (f32), `out[r, i] = bf16(f32(weight[i]) * (x[r, i] * inv))`, rounded to nearest even. When
/// `!p.add`, `y` is not read (any non-empty buffer will do) and `x` is not written. Any `n >= 1`.
#[kernel(block = p.block, space = [
    AddRmsNormParams { block: 256, add: true },
    AddRmsNormParams { block: 256, add: false },
    AddRmsNormParams { block: 128, add: true },
    AddRmsNormParams { block: 512, add: true },
    AddRmsNormParams { block: 1024, add: true },
    AddRmsNormParams { block: 128, add: false },
    AddRmsNormParams { block: 512, add: false },
])]
pub fn add_rms_norm(
    #[comptime] p: &AddRmsNormParams,
    x: &mut [f32],
    y: &[bf16],
    weight: &[bf16],
    out: &mut [bf16],
    n: u32,
    eps: f32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32 and at most 1024"
    );
    let tid = thread_idx_x();
    let base = block_idx_x() * n;
    let mut ss = 0.0f32;
    for i in (tid..n).step_by(p.block) {
        let mut v = x[base + i];
        if p.add {
            v += y[base + i] as f32;
            x[base + i] = v;
        }
        ss += v * v;
    }
    // Each thread reads back only the elements it wrote.
    let inv = 1.0f32 / (block_sum(ss) / (n as f32) + eps).sqrt();
    for i in (tid..n).step_by(p.block) {
        out[base + i] = ((weight[i] as f32) * (x[base + i] * inv)) as bf16;
    }
}

/// Compile-time parameters of [`CastBf16F32`] and [`CastF32Bf16`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct CastParams {
    /// Threads per block.
    pub block: u32,
}

/// `dst[i] = f32(src[i])` for `i < n` (exact). Any grid: the kernel strides over all elements
/// ([`grid`] gives a sensible one).
#[kernel(block = p.block, space = [
    CastParams { block: 256 },
    CastParams { block: 512 },
])]
pub fn cast_bf16_f32(#[comptime] p: &CastParams, src: &[bf16], dst: &mut [f32], n: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for i in (first..n).step_by(stride) {
        dst[i] = src[i] as f32;
    }
}

/// `dst[i] = bf16(src[i])` for `i < n`, rounded to nearest even. Any grid: the kernel strides
/// over all elements ([`grid`] gives a sensible one).
#[kernel(block = p.block, space = [
    CastParams { block: 256 },
    CastParams { block: 512 },
])]
pub fn cast_f32_bf16(#[comptime] p: &CastParams, src: &[f32], dst: &mut [bf16], n: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    for i in (first..n).step_by(stride) {
        dst[i] = src[i] as bf16;
    }
}

/// The launch grid of the casts for `n` elements: one element per thread, at least 1 block and
/// at most [`GRID_MAX`].
pub fn grid(p: &CastParams, n: usize) -> u32 {
    n.div_ceil(p.block as usize).clamp(1, GRID_MAX as usize) as u32
}

/// [`crate::copy_rows::copy_rows`] for f32: for `r < rows`, `c < cols`:
/// `dst[r * dst_stride + dst_off + c] = src[idx[r] * src_stride + src_off + c]` (bits copied
/// unchanged). Grid: `rows` blocks in x ([`crate::copy_rows::grid`]); each block's threads
/// stride over the columns. Elements of `dst` outside the copied columns are left untouched.
#[kernel(block = p.block, space = [
    CopyParams { block: 256 },
    CopyParams { block: 128 },
    CopyParams { block: 512 },
])]
#[allow(clippy::too_many_arguments)]
pub fn copy_rows_f32(
    #[comptime] p: &CopyParams,
    src: &[f32],
    idx: &[u32],
    dst: &mut [f32],
    rows: u32,
    cols: u32,
    src_stride: u32,
    src_off: u32,
    dst_stride: u32,
    dst_off: u32,
) {
    let r = block_idx_x();
    if r < rows {
        let from = idx[r] * src_stride + src_off;
        let to = r * dst_stride + dst_off;
        for c in (thread_idx_x()..cols).step_by(p.block) {
            dst[to + c] = src[from + c];
        }
    }
}

/// CPU reference of [`AddRmsNorm`] on `[rows, n]`: returns the new `x` (`x + y` in f32 when `y`
/// is given, else `x`) and the normalized rows in f32 (the kernel rounds them to bf16), in the
/// kernel's order of operations: `w * (v * inv)`, `inv = 1 / sqrt(mean(v^2) + eps)`.
pub fn reference(x: &[f32], y: Option<&[f32]>, weight: &[f32], n: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    let x: Vec<f32> = match y {
        Some(y) => x.iter().zip(y).map(|(a, b)| a + b).collect(),
        None => x.to_vec(),
    };
    let out = x
        .chunks(n)
        .flat_map(|row| {
            let ms = row.iter().map(|v| (v * v) as f64).sum::<f64>() / n as f64;
            let inv = 1.0 / (ms as f32 + eps).sqrt();
            row.iter().zip(weight).map(move |(v, w)| w * (v * inv))
        })
        .collect();
    (x, out)
}
