//! SiLU-and-mul of a fused gate/up projection: `out[r, j] = silu(gate_up[r, j]) * gate_up[r, d + j]`
//! ([`SiluMul`]), and of separate gate and up buffers: `out[i] = silu(gate[i]) * up[i]`
//! ([`SiluMulSplit`]).

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

/// Compile-time parameters of [`SiluMul`] and [`SiluMulSplit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct SiluMulParams {
    /// Threads per block.
    pub block: u32,
    /// 128-bit loads of 8 bf16 (needs `d % 8 == 0`; for [`SiluMulSplit`] `n % 8 == 0`).
    pub vec: bool,
}

/// `x * sigmoid(x)`.
#[device_fn]
pub fn silu(x: f32) -> f32 {
    x / (1.0f32 + (-x).exp())
}

/// Two bf16 pairs: `silu(g) * u`, rounded to bf16.
#[device_fn]
fn silu_mul_bf16x2(g: u32, u: u32) -> u32 {
    pack_bf16x2(silu(bf16_lo(g)) * bf16_lo(u), silu(bf16_hi(g)) * bf16_hi(u))
}

/// `gate_up` is `[rows, 2 * d]` (gate columns first), `out` is `[rows, d]`. Any grid: the
/// kernel strides over all elements.
#[kernel(block = p.block, space = [
    SiluMulParams { block: 256, vec: true },
    SiluMulParams { block: 128, vec: true },
    SiluMulParams { block: 512, vec: true },
    SiluMulParams { block: 256, vec: false },
])]
pub fn silu_mul(#[comptime] p: &SiluMulParams, gate_up: &[bf16], out: &mut [bf16], rows: u32, d: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    if p.vec {
        let chunks = d / 8;
        for c in (first..rows * chunks).step_by(stride) {
            let r = c / chunks;
            let j = (c % chunks) * 8;
            let g = gate_up.vload(r * 2 * d + j);
            let u = gate_up.vload(r * 2 * d + d + j);
            let mut o = g;
            o.x = silu_mul_bf16x2(g.x, u.x);
            o.y = silu_mul_bf16x2(g.y, u.y);
            o.z = silu_mul_bf16x2(g.z, u.z);
            o.w = silu_mul_bf16x2(g.w, u.w);
            out.vstore(r * d + j, o);
        }
    } else {
        for e in (first..rows * d).step_by(stride) {
            let r = e / d;
            let j = e % d;
            let g = gate_up[r * 2 * d + j] as f32;
            let u = gate_up[r * 2 * d + d + j] as f32;
            out[e] = (silu(g) * u) as bf16;
        }
    }
}

/// The launch grid for `rows` rows of width `d`: enough blocks for one element (or one
/// 8-wide chunk) per thread, capped at 4096 (the kernel grid-strides past that).
pub fn grid(p: &SiluMulParams, rows: usize, d: usize) -> u32 {
    ((rows * d).div_ceil(p.block as usize * if p.vec { 8 } else { 1 })).clamp(1, 4096) as u32
}

/// `out[i] = bf16(silu(gate[i]) * up[i])` for `i < n` (f32 math as [`SiluMul`]). Any grid:
/// the kernel strides over all elements ([`grid_split`] gives one).
#[kernel(block = p.block, space = [
    SiluMulParams { block: 256, vec: true },
    SiluMulParams { block: 128, vec: true },
    SiluMulParams { block: 512, vec: true },
    SiluMulParams { block: 256, vec: false },
])]
pub fn silu_mul_split(#[comptime] p: &SiluMulParams, gate: &[bf16], up: &[bf16], out: &mut [bf16], n: u32) {
    let stride = grid_dim_x() * p.block;
    let first = block_idx_x() * p.block + thread_idx_x();
    if p.vec {
        for c in (first..n / 8).step_by(stride) {
            let g = gate.vload(c * 8);
            let u = up.vload(c * 8);
            let mut o = g;
            o.x = silu_mul_bf16x2(g.x, u.x);
            o.y = silu_mul_bf16x2(g.y, u.y);
            o.z = silu_mul_bf16x2(g.z, u.z);
            o.w = silu_mul_bf16x2(g.w, u.w);
            out.vstore(c * 8, o);
        }
    } else {
        for i in (first..n).step_by(stride) {
            out[i] = (silu(gate[i] as f32) * (up[i] as f32)) as bf16;
        }
    }
}

/// The launch grid of [`SiluMulSplit`] for `n` elements (as [`grid`] for one row of `n`).
pub fn grid_split(p: &SiluMulParams, n: usize) -> u32 {
    grid(p, 1, n)
}

/// CPU reference: `gate_up` is `[rows, 2 * d]`.
pub fn reference(gate_up: &[f32], d: usize) -> Vec<f32> {
    gate_up
        .chunks(2 * d)
        .flat_map(|row| (0..d).map(move |j| row[j] / (1.0 + (-row[j]).exp()) * row[d + j]))
        .collect()
}

/// CPU reference of [`SiluMulSplit`]: `silu(gate[i]) * up[i]`.
pub fn reference_split(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter().zip(up).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect()
}
