//! In-place bf16 add (the residual stream): `x[i] = bf16(f32(x[i]) + f32(y[i]))`.

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

/// Compile-time parameters of [`AddAssign`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct AddParams {
    /// Threads per block.
    pub block: u32,
    /// 128-bit accesses of 8 bf16 (needs `n % 8 == 0` and 16-byte aligned `x` and `y`).
    pub vec: bool,
}

/// Most blocks [`grid`] asks for (8 per SM of an H100/H200); the kernel grid-strides past that.
pub const GRID_MAX: u32 = 132 * 8;

/// Two bf16 pairs: `a + b` in f32, rounded to bf16 (nearest even).
#[device_fn]
pub(crate) fn add_bf16x2(a: u32, b: u32) -> u32 {
    pack_bf16x2(bf16_lo(a) + bf16_lo(b), bf16_hi(a) + bf16_hi(b))
}

/// `x[i] = bf16(f32(x[i]) + f32(y[i]))` for `i < n`, rounded to nearest even. Any grid: the
/// kernel strides over all elements ([`grid`] gives a sensible one).
#[kernel(block = p.block, space = [
    AddParams { block: 256, vec: true },
    AddParams { block: 128, vec: true },
    AddParams { block: 512, vec: true },
    AddParams { block: 256, vec: false },
])]
pub fn add_assign(#[comptime] p: &AddParams, x: &mut [bf16], y: &[bf16], n: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    if p.vec {
        for c in (first..n / 8).step_by(stride) {
            let a = x.vload(c * 8);
            let b = y.vload(c * 8);
            let mut o = a;
            o.x = add_bf16x2(a.x, b.x);
            o.y = add_bf16x2(a.y, b.y);
            o.z = add_bf16x2(a.z, b.z);
            o.w = add_bf16x2(a.w, b.w);
            x.vstore(c * 8, o);
        }
    } else {
        for i in (first..n).step_by(stride) {
            x[i] = (x[i] as f32 + y[i] as f32) as bf16;
        }
    }
}

/// The launch grid for `n` elements: one element (or one 8-wide chunk) per thread, at least 1
/// block and at most [`GRID_MAX`].
pub fn grid(p: &AddParams, n: u32) -> u32 {
    let per_block = p.block * if p.vec { 8 } else { 1 };
    n.div_ceil(per_block).clamp(1, GRID_MAX)
}

/// CPU reference: `x + y` element-wise in f32 (the kernel rounds this to bf16).
pub fn reference(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter().zip(y).map(|(a, b)| a + b).collect()
}
