//! Indexed, strided row copy: `dst[r, dst_off..+cols] = src[idx[r], src_off..+cols]`.
//!
//! One kernel for gathering rows (`take_rows`), writing a block of columns into a wider row
//! (`concat_cols`) and copying heads out of or into strided layouts.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

/// Compile-time parameters of [`CopyRows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct CopyParams {
    /// Threads per block (one block per row, threads over the columns).
    pub block: u32,
}

/// For `r < rows`, `c < cols`: `dst[r * dst_stride + dst_off + c] = src[idx[r] * src_stride +
/// src_off + c]` (bf16 bits copied unchanged). Grid: `rows` blocks in x (one per row); each
/// block's threads stride over the columns. Elements of `dst` outside the copied columns are
/// left untouched.
#[kernel(block = p.block, space = [
    CopyParams { block: 256 },
    CopyParams { block: 128 },
    CopyParams { block: 512 },
])]
#[allow(clippy::too_many_arguments)]
pub fn copy_rows(
    #[comptime] p: &CopyParams,
    src: &[bf16],
    idx: &[u32],
    dst: &mut [bf16],
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

/// The launch grid for `rows` rows: one block per row (at least 1).
pub fn grid(rows: u32) -> u32 {
    rows.max(1)
}

/// CPU reference, in place on `dst` (same arguments and layout as the kernel).
#[allow(clippy::too_many_arguments)]
pub fn reference<T: Copy>(
    src: &[T],
    idx: &[u32],
    dst: &mut [T],
    cols: usize,
    src_stride: usize,
    src_off: usize,
    dst_stride: usize,
    dst_off: usize,
) {
    for (r, &i) in idx.iter().enumerate() {
        let from = i as usize * src_stride + src_off;
        let to = r * dst_stride + dst_off;
        dst[to..to + cols].copy_from_slice(&src[from..from + cols]);
    }
}
