//! The f32 residual stream: the residual add fused with the following RMSNorm (as vLLM's
//! `fused_add_rms_norm`), bf16 <-> f32 casts, and the f32 row copy.
//!
//! The stream `x` stays in f32 between layers; only the normalized activations that feed the
//! GEMMs are rounded to bf16.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

use crate::add::{add_bf16x2, GRID_MAX};
use crate::common::block_sum;
use crate::copy_rows::CopyParams;

/// Compile-time parameters of [`AddRmsNorm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct AddRmsNormParams {
    /// Threads per block (one block per row).
    pub block: u32,
    /// bf16 addends added into `x` first: 0 (`y` and `z` are not read, `x` is not written), 1
    /// (`y`) or 2 (`bf16(y + z)`, the sum rounded as [`crate::AddAssign`] rounds it; `z` is read
    /// only then).
    pub addends: u32,
    /// 8-element chunks each thread loads with 128-bit loads, all before the sum, and keeps in
    /// registers for the second pass (needs `n % 8 == 0`); `0`: scalar loops that read `x`
    /// twice. Rows longer than `block * 8 * hold` take the scalar loops for the rest.
    pub hold: u32,
}

/// Rows up to which [`choose_add_rms_norm`] prefers a variant that holds the row in registers.
pub const FEW_ROWS: usize = 16;

/// The [`AddRmsNorm`] variant for `rows` rows of `n` with `addends` bf16 addends (no tuner key:
/// a fixed rule). For at most [`FEW_ROWS`] rows with `n % 8 == 0`, the variant with those
/// addends that holds a whole row in registers with the fewest idle threads (smallest
/// `block * hold`, first in space order); otherwise the first variant with `hold == 0` and those
/// addends (the default). `None` for more than 2 addends.
pub fn choose_add_rms_norm(rows: usize, n: usize, addends: u32) -> Option<AddRmsNormParams> {
    let space = <AddRmsNorm as ddtree_codegen::Kernel>::space();
    let held = space
        .iter()
        .filter(|p| p.addends == addends && p.hold > 0 && n % 8 == 0 && n <= (p.block * 8 * p.hold) as usize)
        .min_by_key(|p| p.block * p.hold)
        .copied();
    match held {
        Some(p) if rows <= FEW_ROWS => Some(p),
        _ => space.into_iter().find(|p| p.addends == addends && p.hold == 0),
    }
}

/// For each of `rows` rows of `n` (grid = rows, one block per row): with one addend
/// `x[r, i] += f32(y[r, i])`, with two `x[r, i] += f32(bf16(f32(y[r, i]) + f32(z[r, i])))`
/// (written back, f32: the two parts of a layer's output summed and stored in bf16 as
/// [`crate::AddAssign`] would, then added to the residual stream); then with
/// `inv = 1 / sqrt(mean(x[r]^2) + eps)` (f32), `out[r, i] = bf16(f32(weight[i]) * (x[r, i] * inv))`,
/// rounded to nearest even. Addends not read (`y` and `z` without addends, `z` with one) may be
/// any non-empty buffer; without addends `x` is not written. Any `n >= 1` (`n % 8 == 0`,
/// 32-byte aligned `x` and 16-byte aligned `y`, `z`, `weight`, `out` when `p.hold > 0`).
#[kernel(block = p.block, space = [
    AddRmsNormParams { block: 256, addends: 1, hold: 0 },
    AddRmsNormParams { block: 256, addends: 0, hold: 0 },
    AddRmsNormParams { block: 128, addends: 1, hold: 0 },
    AddRmsNormParams { block: 512, addends: 1, hold: 0 },
    AddRmsNormParams { block: 1024, addends: 1, hold: 0 },
    AddRmsNormParams { block: 128, addends: 0, hold: 0 },
    AddRmsNormParams { block: 512, addends: 0, hold: 0 },
    AddRmsNormParams { block: 512, addends: 1, hold: 2 },
    AddRmsNormParams { block: 256, addends: 1, hold: 4 },
    AddRmsNormParams { block: 1024, addends: 1, hold: 1 },
    AddRmsNormParams { block: 256, addends: 1, hold: 1 },
    AddRmsNormParams { block: 64, addends: 1, hold: 1 },
    AddRmsNormParams { block: 512, addends: 0, hold: 2 },
    AddRmsNormParams { block: 256, addends: 0, hold: 1 },
    AddRmsNormParams { block: 256, addends: 2, hold: 0 },
    AddRmsNormParams { block: 512, addends: 2, hold: 2 },
    AddRmsNormParams { block: 256, addends: 2, hold: 1 },
    AddRmsNormParams { block: 64, addends: 2, hold: 1 },
])]
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    #[comptime] p: &AddRmsNormParams,
    x: &mut [f32],
    y: &[bf16],
    z: &[bf16],
    weight: &[bf16],
    out: &mut [bf16],
    n: u32,
    eps: f32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32 and at most 1024"
    );
    comptime_assert!(p.addends <= 2, "addends must be 0, 1 or 2");
    let tid = thread_idx_x();
    let base = block_idx_x() * n;
    let mut ss = 0.0f32;
    let held = comptime!(p.hold.max(1));
    let mut xv = [[0.0f32; 8]; held];
    // Elements from `first` on take the scalar loops (all of them when `hold == 0`).
    let mut first = 0u32;
    if p.hold > 0 {
        first = (n / 8).min(p.hold * p.block) * 8;
        #[unroll]
        for u in 0..p.hold {
            let c = tid + u * p.block;
            if c < n / 8 {
                let i = base + c * 8;
                let lo = x.vload(i);
                let hi = x.vload(i + 4);
                xv[u][0] = f32::from_bits(lo.x);
                xv[u][1] = f32::from_bits(lo.y);
                xv[u][2] = f32::from_bits(lo.z);
                xv[u][3] = f32::from_bits(lo.w);
                xv[u][4] = f32::from_bits(hi.x);
                xv[u][5] = f32::from_bits(hi.y);
                xv[u][6] = f32::from_bits(hi.z);
                xv[u][7] = f32::from_bits(hi.w);
                if p.addends > 0 {
                    let mut yv = y.vload(i);
                    if p.addends == 2 {
                        let zv = z.vload(i);
                        yv.x = add_bf16x2(yv.x, zv.x);
                        yv.y = add_bf16x2(yv.y, zv.y);
                        yv.z = add_bf16x2(yv.z, zv.z);
                        yv.w = add_bf16x2(yv.w, zv.w);
                    }
                    xv[u][0] += bf16_lo(yv.x);
                    xv[u][1] += bf16_hi(yv.x);
                    xv[u][2] += bf16_lo(yv.y);
                    xv[u][3] += bf16_hi(yv.y);
                    xv[u][4] += bf16_lo(yv.z);
                    xv[u][5] += bf16_hi(yv.z);
                    xv[u][6] += bf16_lo(yv.w);
                    xv[u][7] += bf16_hi(yv.w);
                    let mut s0 = lo;
                    s0.x = xv[u][0].to_bits();
                    s0.y = xv[u][1].to_bits();
                    s0.z = xv[u][2].to_bits();
                    s0.w = xv[u][3].to_bits();
                    let mut s1 = hi;
                    s1.x = xv[u][4].to_bits();
                    s1.y = xv[u][5].to_bits();
                    s1.z = xv[u][6].to_bits();
                    s1.w = xv[u][7].to_bits();
                    x.vstore(i, s0);
                    x.vstore(i + 4, s1);
                }
                #[unroll]
                for e in 0..8 {
                    ss += xv[u][e] * xv[u][e];
                }
            }
        }
    }
    for i in (first + tid..n).step_by(p.block) {
        let mut v = x[base + i];
        if p.addends > 0 {
            if p.addends == 2 {
                let yz = (y[base + i] as f32 + z[base + i] as f32) as bf16;
                v += yz as f32;
            } else {
                v += y[base + i] as f32;
            }
            x[base + i] = v;
        }
        ss += v * v;
    }
    // Each thread reads back only the elements it wrote.
    let inv = 1.0f32 / (block_sum(ss) / (n as f32) + eps).sqrt();
    if p.hold > 0 {
        #[unroll]
        for u in 0..p.hold {
            let c = tid + u * p.block;
            if c < n / 8 {
                let w = weight.vload(c * 8);
                let mut o = w;
                o.x = pack_bf16x2(bf16_lo(w.x) * (xv[u][0] * inv), bf16_hi(w.x) * (xv[u][1] * inv));
                o.y = pack_bf16x2(bf16_lo(w.y) * (xv[u][2] * inv), bf16_hi(w.y) * (xv[u][3] * inv));
                o.z = pack_bf16x2(bf16_lo(w.z) * (xv[u][4] * inv), bf16_hi(w.z) * (xv[u][5] * inv));
                o.w = pack_bf16x2(bf16_lo(w.w) * (xv[u][6] * inv), bf16_hi(w.w) * (xv[u][7] * inv));
                out.vstore(base + c * 8, o);
            }
        }
    }
    for i in (first + tid..n).step_by(p.block) {
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
/// is given, else `x`; for two addends `y` is their sum rounded to bf16) and the normalized rows
/// in f32 (the kernel rounds them to bf16), in the kernel's order of operations: `w * (v * inv)`,
/// `inv = 1 / sqrt(mean(v^2) + eps)`.
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
