//! RMSNorm over the last dimension: `out = x * rsqrt(mean(x^2) + eps) * weight`, one block per row.

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

use crate::common::block_sum;

/// Compile-time parameters of [`RmsNorm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct RmsNormParams {
    /// Threads per block (one block per row).
    pub block: u32,
    /// 128-bit loads of 8 bf16 (needs `n % 8 == 0`).
    pub vec: bool,
    /// With `vec`: 8-element chunks each thread keeps in registers between the two passes,
    /// all loaded before the sum (`0`: both passes read `x`). Rows longer than
    /// `block * 8 * hold` read their remaining chunks twice. For one or a few rows: a single
    /// round trip to memory per row.
    pub hold: u32,
}

/// Whether a variant keeps a whole row of `n` in registers (`hold` chunks per thread).
pub fn holds_row(p: &RmsNormParams, n: usize) -> bool {
    p.vec && p.hold > 0 && n % 8 == 0 && n <= (p.block * 8 * p.hold) as usize
}

/// Rows up to which [`RmsNorm`]'s untuned choice is the latency-friendly [`row_holder`].
pub const FEW_ROWS: usize = 4;

/// The variant of `space` that keeps a whole row of `n` in registers with the fewest idle
/// threads (the smallest `block * 8 * hold` that holds the row; the first such in `space`
/// order), if any.
pub fn row_holder(space: &[RmsNormParams], n: usize) -> Option<RmsNormParams> {
    space
        .iter()
        .filter(|p| holds_row(p, n))
        .min_by_key(|p| p.block * p.hold)
        .copied()
}

/// `a` and `b` hold two bf16 each: returns the pair `a * inv * b`, rounded to bf16.
#[device_fn]
pub fn scale_bf16x2(a: u32, b: u32, inv: f32) -> u32 {
    pack_bf16x2(bf16_lo(a) * inv * bf16_lo(b), bf16_hi(a) * inv * bf16_hi(b))
}

/// Sum of squares of the two bf16 in `a`.
#[device_fn]
pub fn sq_bf16x2(a: u32) -> f32 {
    let lo = bf16_lo(a);
    let hi = bf16_hi(a);
    lo * lo + hi * hi
}

/// RMSNorm of `rows` rows of `n` bf16 (grid = rows): f32 statistics, bf16 output.
#[kernel(block = p.block, space = [
    RmsNormParams { block: 256, vec: true, hold: 0 },
    RmsNormParams { block: 128, vec: true, hold: 0 },
    RmsNormParams { block: 512, vec: true, hold: 0 },
    RmsNormParams { block: 1024, vec: true, hold: 0 },
    RmsNormParams { block: 256, vec: false, hold: 0 },
    RmsNormParams { block: 512, vec: true, hold: 2 },
    RmsNormParams { block: 256, vec: true, hold: 4 },
    RmsNormParams { block: 1024, vec: true, hold: 1 },
    RmsNormParams { block: 256, vec: true, hold: 1 },
    RmsNormParams { block: 64, vec: true, hold: 1 },
])]
pub fn rms_norm(#[comptime] p: &RmsNormParams, x: &[bf16], weight: &[bf16], out: &mut [bf16], n: u32, eps: f32) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32 and at most 1024"
    );
    comptime_assert!(p.hold == 0 || p.vec, "hold needs vec");
    let tid = thread_idx_x();
    let base = block_idx_x() * n;
    let mut ss = 0.0f32;
    let held = comptime!(p.hold.max(1));
    let mut h0 = [0u32; held];
    let mut h1 = [0u32; held];
    let mut h2 = [0u32; held];
    let mut h3 = [0u32; held];
    let first = tid + p.hold * p.block;
    if p.hold > 0 {
        #[unroll]
        for u in 0..p.hold {
            let c = tid + u * p.block;
            if c < n / 8 {
                let v = x.vload(base + c * 8);
                h0[u] = v.x;
                h1[u] = v.y;
                h2[u] = v.z;
                h3[u] = v.w;
            }
        }
        #[unroll]
        for u in 0..p.hold {
            ss += sq_bf16x2(h0[u]) + sq_bf16x2(h1[u]) + sq_bf16x2(h2[u]) + sq_bf16x2(h3[u]);
        }
    }
    if p.vec {
        for c in (first..n / 8).step_by(p.block) {
            let v = x.vload(base + c * 8);
            ss += sq_bf16x2(v.x) + sq_bf16x2(v.y) + sq_bf16x2(v.z) + sq_bf16x2(v.w);
        }
    } else {
        for i in (tid..n).step_by(p.block) {
            let v = x[base + i] as f32;
            ss += v * v;
        }
    }
    let inv = (block_sum(ss) / (n as f32) + eps).rsqrt();
    if p.hold > 0 {
        #[unroll]
        for u in 0..p.hold {
            let c = tid + u * p.block;
            if c < n / 8 {
                let w = weight.vload(c * 8);
                let mut o = w;
                o.x = scale_bf16x2(h0[u], w.x, inv);
                o.y = scale_bf16x2(h1[u], w.y, inv);
                o.z = scale_bf16x2(h2[u], w.z, inv);
                o.w = scale_bf16x2(h3[u], w.w, inv);
                out.vstore(base + c * 8, o);
            }
        }
    }
    if p.vec {
        for c in (first..n / 8).step_by(p.block) {
            let v = x.vload(base + c * 8);
            let w = weight.vload(c * 8);
            let mut o = v;
            o.x = scale_bf16x2(v.x, w.x, inv);
            o.y = scale_bf16x2(v.y, w.y, inv);
            o.z = scale_bf16x2(v.z, w.z, inv);
            o.w = scale_bf16x2(v.w, w.w, inv);
            out.vstore(base + c * 8, o);
        }
    } else {
        for i in (tid..n).step_by(p.block) {
            out[base + i] = ((x[base + i] as f32) * inv * (weight[i] as f32)) as bf16;
        }
    }
}

/// CPU reference in f32: `x` is `[rows, n]`.
pub fn reference(x: &[f32], weight: &[f32], n: usize, eps: f32) -> Vec<f32> {
    x.chunks(n)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / n as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter().zip(weight).map(move |(v, w)| v * inv * w)
        })
        .collect()
}
