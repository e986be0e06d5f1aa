//! Memory-bound bf16 GEMV for decode (a few rows of activations against an `nn.Linear`
//! weight): `out[r, j] = sum_i a[r, i] * w[j, i]`, f32 accumulation, bf16 ([`GemvBf16`]) or
//! f32 ([`GemvBf16F32`], router logits and the LM head) output; and the gate and up projections
//! of a SwiGLU block fused with their SiLU-and-mul ([`GemvGateUpSilu`]), one pass over both
//! weights instead of two GEMVs and a `silu_mul`.
//!
//! Each warp owns [`cols_per_warp`] output columns: its lanes stride over `k` in 128-bit
//! loads of 8 bf16 of the weight rows (issuing [`unroll`] loads per column before using any,
//! so enough bytes are in flight), read the matching 8 elements of every activation row (`a` is
//! small and stays in L1/L2, and each load is reused for all the warp's columns), keep
//! `m * cols` partial sums in registers, and reduce them with warp shuffles; lane 0 writes.
//! No shared memory and no block barrier: a launch is one cheap kernel with a plain grid.
//! For few columns and long rows the split-K kernels ([`GemvSplitBf16`], [`GemvSplitF32`],
//! [`GemvSplitGateUpSilu`]) spread each column's reduction over a block's warps instead
//! ([`choose`], [`choose_gate_up`]).
//!
//! Constraints: `k % 8 == 0` and 16-byte aligned `a` and `w` (the 128-bit loads), `1 <= rows <=
//! p.m`, and `n * k < 2^32` (u32 indexing).

// The generated `launch` functions carry a `# Safety` section, but clippy does not see it when
// `#[kernel]` is expanded from `gemv_kernel!`.
#![allow(clippy::missing_safety_doc)]

use ddtree_codegen::dsl::*;
use ddtree_codegen::Kernel;
use ddtree_macros::{device_fn, kernel, KernelParams};

use crate::common::{block_sum, warp_sum};
use crate::rms_norm::{scale_bf16x2, sq_bf16x2};
use crate::silu_mul::silu;

/// This family's checks (re-exported by [`crate::check`]).
pub mod check;
pub mod op;
pub mod tune;

/// Compile-time parameters of [`GemvBf16`], [`GemvBf16F32`] and [`GemvGateUpSilu`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct GemvParams {
    /// Warps per block.
    pub warps: u32,
    /// Most activation rows (1, 2, 4 or 8): the kernel keeps `m` partial sums per column.
    pub m: u32,
}

/// Output columns per warp: 1 for `m <= 2`, else `m / 2` (each activation load then feeds
/// several columns, so L1 traffic for `a` stays below the weight's DRAM traffic).
pub fn cols_per_warp(p: &GemvParams) -> u32 {
    if p.m <= 2 {
        1
    } else {
        p.m / 2
    }
}

/// 128-bit weight loads per column a lane issues per main-loop iteration: 4 for one column,
/// else 2 (so 4 to 8 loads of the weight are in flight per lane).
pub fn unroll(p: &GemvParams) -> u32 {
    if cols_per_warp(p) == 1 {
        4
    } else {
        2
    }
}

/// Output columns per block.
pub fn cols_per_block(p: &GemvParams) -> u32 {
    p.warps * cols_per_warp(p)
}

/// The launch grid for `n` output columns: `ceil(n / (warps * cols_per_warp))` blocks (at
/// least 1).
pub fn grid(p: &GemvParams, n: u32) -> u32 {
    n.div_ceil(cols_per_block(p)).max(1)
}

/// `acc + dot(a, w)` over the two bf16 of `a` and of `w` (fused multiply-adds, low half first).
#[device_fn]
pub(crate) fn dot2(acc: f32, a: u32, w: u32) -> f32 {
    bf16_hi(a).mul_add(bf16_hi(w), bf16_lo(a).mul_add(bf16_lo(w), acc))
}

/// One body for every per-column GEMV. It reads the weights listed in `weights`, each as
/// `slice => sum: accumulators[four register arrays]` (the names are given because
/// `macro_rules!` cannot make them), shares every activation load among them, and stores `out`'s
/// expression of the column's sums for each output. The plain GEMVs read one weight and store
/// its sum (`as f32` on an f32 is a no-op); the gate/up GEMV reads two and stores their
/// SiLU-and-mul. The activations are read from `src`, rows `stride` elements apart: `a` itself,
/// or with `norm` the RMS-normalized rows the block first writes to shared memory.
macro_rules! gemv_kernel {
    (
        $(#[$attr:meta])*
        $name:ident,
        space = $space:tt,
        weights = [$($w:ident => $v:ident: $acc:ident[$w0:ident, $w1:ident, $w2:ident, $w3:ident]),+],
        out: $out:ident = $value:expr,
        src = $src:ident,
        stride = $stride:expr
        $(, norm = [$nw:ident, $eps:ident])?
    ) => {
        $(#[$attr])*
        #[kernel(block = p.warps * 32, space = $space)]
        pub fn $name(
            #[comptime] p: &GemvParams,
            a: &[bf16],
            $($nw: &[bf16], $eps: f32,)?
            $($w: &[bf16],)+
            out: &mut [$out],
            rows: u32,
            n: u32,
            k: u32,
        ) {
            comptime_assert!(
                p.m == 1 || p.m == 2 || p.m == 4 || p.m == 8,
                "m must be 1, 2, 4 or 8"
            );
            comptime_assert!(p.warps >= 1 && p.warps <= 32, "warps must be 1..=32");
            let cols = comptime!(cols_per_warp(p));
            let un = comptime!(unroll(p));
            let lane = lane_id();
            let j0 = (block_idx_x() * p.warps + warp_id()) * cols;
            let chunks = k / 8;
            // Weight row offsets; a column past `n` re-reads the last row and is not written.
            let mut wrow = [0u32; cols];
            #[unroll]
            for c in 0..cols {
                wrow[c] = (j0 + c).min(n - 1) * k;
            }
            $(
                let mut $acc = [0.0f32; p.m * cols];
                let mut $w0 = [0u32; un * cols];
                let mut $w1 = [0u32; un * cols];
                let mut $w2 = [0u32; un * cols];
                let mut $w3 = [0u32; un * cols];
            )+
            let mut ch = lane;
            // The first `un` chunks per column are loaded before waiting for the previous
            // kernel (weights are never written by one); each later batch right after the
            // batch before it is used.
            if j0 < n && ch + 32 * (un - 1) < chunks {
                #[unroll]
                for u in 0..un {
                    #[unroll]
                    for c in 0..cols {
                        $(
                            let v = $w.vload(wrow[c] + (ch + u * 32) * 8);
                            $w0[u * cols + c] = v.x;
                            $w1[u * cols + c] = v.y;
                            $w2[u * cols + c] = v.z;
                            $w3[u * cols + c] = v.w;
                        )+
                    }
                }
            }
            grid_wait();
            grid_launch_dependents();
            $(
                // The RMS-normalized rows into shared memory, rounded to bf16 as `RmsNorm`
                // rounds them: `bf16(a * inv * weight)`, `inv = rsqrt(mean(a^2) + eps)`.
                let $src = shared::<bf16>(p.m * NORM_MAX_K);
                let tid = thread_idx_x();
                let threads = comptime!(p.warps * 32);
                for r in 0..rows {
                    let mut ss = 0.0f32;
                    for c in (tid..k / 8).step_by(threads) {
                        let x = a.vload(r * k + c * 8);
                        ss += sq_bf16x2(x.x) + sq_bf16x2(x.y) + sq_bf16x2(x.z) + sq_bf16x2(x.w);
                    }
                    let inv = (block_sum(ss) / (k as f32) + $eps).rsqrt();
                    for c in (tid..k / 8).step_by(threads) {
                        let x = a.vload(r * k + c * 8);
                        let g = $nw.vload(c * 8);
                        let mut o = x;
                        o.x = scale_bf16x2(x.x, g.x, inv);
                        o.y = scale_bf16x2(x.y, g.y, inv);
                        o.z = scale_bf16x2(x.z, g.z, inv);
                        o.w = scale_bf16x2(x.w, g.w, inv);
                        $src.vstore(r * NORM_MAX_K + c * 8, o);
                    }
                }
                sync_threads();
            )?
            // Warp-uniform: a warp past the last column has nothing to do.
            if j0 < n {
                // Main loop over loaded batches of `un` chunks per column.
                while ch + 32 * (un - 1) < chunks {
                    #[unroll]
                    for u in 0..un {
                        #[unroll]
                        for r in 0..p.m {
                            if r < rows {
                                let av = $src.vload(r * $stride + (ch + u * 32) * 8);
                                #[unroll]
                                for c in 0..cols {
                                    let i = u * cols + c;
                                    $(
                                        let s = dot2($acc[r * cols + c], av.x, $w0[i]);
                                        let s = dot2(s, av.y, $w1[i]);
                                        let s = dot2(s, av.z, $w2[i]);
                                        $acc[r * cols + c] = dot2(s, av.w, $w3[i]);
                                    )+
                                }
                            }
                        }
                    }
                    ch += 32 * un;
                    if ch + 32 * (un - 1) < chunks {
                        #[unroll]
                        for u in 0..un {
                            #[unroll]
                            for c in 0..cols {
                                $(
                                    let v = $w.vload(wrow[c] + (ch + u * 32) * 8);
                                    $w0[u * cols + c] = v.x;
                                    $w1[u * cols + c] = v.y;
                                    $w2[u * cols + c] = v.z;
                                    $w3[u * cols + c] = v.w;
                                )+
                            }
                        }
                    }
                }
                // Tail: fewer than `un` chunks left for this lane.
                while ch < chunks {
                    #[unroll]
                    for c in 0..cols {
                        $(
                            let v = $w.vload(wrow[c] + ch * 8);
                            $w0[c] = v.x;
                            $w1[c] = v.y;
                            $w2[c] = v.z;
                            $w3[c] = v.w;
                        )+
                    }
                    #[unroll]
                    for r in 0..p.m {
                        if r < rows {
                            let av = $src.vload(r * $stride + ch * 8);
                            #[unroll]
                            for c in 0..cols {
                                $(
                                    let s = dot2($acc[r * cols + c], av.x, $w0[c]);
                                    let s = dot2(s, av.y, $w1[c]);
                                    let s = dot2(s, av.z, $w2[c]);
                                    $acc[r * cols + c] = dot2(s, av.w, $w3[c]);
                                )+
                            }
                        }
                    }
                    ch += 32;
                }
                #[unroll]
                for i in 0..p.m * cols {
                    $($acc[i] = warp_sum($acc[i]);)+
                }
                if lane == 0 {
                    #[unroll]
                    for r in 0..p.m {
                        #[unroll]
                        for c in 0..cols {
                            if r < rows && j0 + c < n {
                                $(let $v = $acc[r * cols + c];)+
                                out[r * n + j0 + c] = $value;
                            }
                        }
                    }
                }
            }
        }
    };
}

/// The candidates of the plain per-column GEMVs ([`GemvBf16`], [`GemvBf16F32`]).
const WARP_SPACE: [GemvParams; 6] = [
    GemvParams { warps: 4, m: 1 },
    GemvParams { warps: 4, m: 2 },
    GemvParams { warps: 4, m: 4 },
    GemvParams { warps: 4, m: 8 },
    GemvParams { warps: 8, m: 1 },
    GemvParams { warps: 8, m: 8 },
];

gemv_kernel!(
    /// `out[r * n + j] = bf16(sum_i f32(a[r * k + i]) * f32(w[j * k + i]))` for `r < rows`,
    /// `j < n`: `a` is `[rows, k]`, `w` is `[n, k]` (an `nn.Linear` weight), both row-major bf16;
    /// f32 accumulation, rounded to nearest even. Needs `k % 8 == 0` (128-bit loads; `a` and `w`
    /// 16-byte aligned), `1 <= rows <= p.m` and `n * k < 2^32`. Grid: [`grid`] blocks in x.
    gemv_bf16,
    space = WARP_SPACE,
    weights = [w => s: acc[w0, w1, w2, w3]],
    out: bf16 = s as bf16,
    src = a,
    stride = k
);

gemv_kernel!(
    /// [`GemvBf16`] with an f32 output (no rounding): `out[r * n + j] = sum_i f32(a[r * k + i]) *
    /// f32(w[j * k + i])`, for router logits and the LM head. Same constraints and grid.
    gemv_bf16_f32,
    space = WARP_SPACE,
    weights = [w => s: acc[w0, w1, w2, w3]],
    out: f32 = s as f32,
    src = a,
    stride = k
);

/// Longest rows [`GemvRmsNormBf16`] normalizes (its shared-memory rows): DeepSeek-V3's and
/// Kimi K2's `q_lora_rank` is 1536.
pub const NORM_MAX_K: u32 = 2048;

gemv_kernel!(
    /// RMSNorm fused into the GEMV that consumes it (the MLA query path's `q_b(q_norm(x))`):
    /// `out[r * n + j] = bf16(sum_i f32(xn[r, i]) * f32(w[j * k + i]))` with `xn[r, i] =
    /// bf16(a[r * k + i] * inv_r * norm[i])`, `inv_r = rsqrt(mean_i(a[r, i]^2) + eps)`: each
    /// block first normalizes the rows into shared memory, as [`crate::RmsNorm`] rounds them (the
    /// statistics summed in another order), then runs [`GemvBf16`]'s loop on them, so one launch
    /// and no round trip of the normalized rows replace two launches. Needs `k <=
    /// NORM_MAX_K` besides [`GemvBf16`]'s constraints; `norm` is `[k]`. Grid: [`grid`].
    gemv_rms_norm_bf16,
    space = WARP_SPACE,
    weights = [w => s: acc[w0, w1, w2, w3]],
    out: bf16 = s as bf16,
    src = xn,
    stride = NORM_MAX_K,
    norm = [norm, eps]
);

/// `bf16(silu(bf16(g)) * bf16(u))` in f32 before its final rounding: the gate and up sums rounded
/// to bf16 where the unfused path stores them, then [`crate::silu_mul::SiluMulSplit`]'s f32 math.
#[device_fn]
fn silu_mul_rounded(g: f32, u: f32) -> f32 {
    let gb = g as bf16;
    let ub = u as bf16;
    silu(gb as f32) * (ub as f32)
}

gemv_kernel!(
    /// The gate and up projections of a SwiGLU block and their SiLU-and-mul in one pass over both
    /// weights: `out[r * n + j] = bf16(silu(g) * u)` with `g = bf16(sum_i f32(a[r * k + i]) *
    /// f32(gate[j * k + i]))` and `u` likewise from `up` (f32 accumulation; every rounding to
    /// nearest even), for `r < rows`, `j < n`, so the result is [`GemvBf16`] twice and
    /// [`crate::SiluMulSplit`] up to summation order. `gate` and `up` are `[n, k]`; same
    /// constraints as [`GemvBf16`] (`1 <= rows <= p.m`, `k % 8 == 0`, both weights 16-byte
    /// aligned, `n * k < 2^32`). Grid: [`grid`] blocks in x.
    gemv_gate_up_silu,
    space = [
        GemvParams { warps: 4, m: 1 },
        GemvParams { warps: 4, m: 2 },
        GemvParams { warps: 4, m: 4 },
        GemvParams { warps: 8, m: 1 },
    ],
    weights = [gate => g: acc_g[g0, g1, g2, g3], up => u: acc_u[u0, u1, u2, u3]],
    out: bf16 = silu_mul_rounded(g, u) as bf16,
    src = a,
    stride = k
);

/// Compile-time parameters of [`GemvSplitBf16`], [`GemvSplitF32`] and [`GemvSplitGateUpSilu`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct GemvSplitParams {
    /// Warps per block; all of them split the reduction of the block's columns.
    pub warps: u32,
    /// Most activation rows (1, 2, 4 or 8).
    pub m: u32,
    /// Output columns per block.
    pub cols: u32,
    /// 128-bit weight loads per column a thread issues per main-loop iteration (before using
    /// any).
    pub unroll: u32,
}

/// The launch grid of the split-K GEMVs for `n` output columns: `ceil(n / cols)` blocks.
pub fn split_grid(p: &GemvSplitParams, n: u32) -> u32 {
    n.div_ceil(p.cols).max(1)
}

/// The candidates of the plain split-K GEMVs ([`GemvSplitBf16`], [`GemvSplitF32`]); the first
/// of each `m` is [`choose`]'s. One row: 16 warps per column, the fastest on every measured
/// shape of `k = 7168 / 8192` on the H200 (`kernel-check --decode-ops`, cold L2: 7168->1536
/// 11.2 µs vs 12.0 for 8 warps, 7168->48 4.4 vs 5.2, 8192->7168 37.4 vs 38.0).
#[rustfmt::skip]
const SPLIT_SPACE: [GemvSplitParams; 8] = [
    GemvSplitParams { warps: 16, m: 1, cols: 1, unroll: 2 },
    GemvSplitParams { warps: 8, m: 1, cols: 1, unroll: 4 },
    GemvSplitParams { warps: 8, m: 2, cols: 1, unroll: 4 },
    GemvSplitParams { warps: 8, m: 4, cols: 1, unroll: 4 },
    GemvSplitParams { warps: 8, m: 8, cols: 2, unroll: 2 },
    GemvSplitParams { warps: 4, m: 1, cols: 1, unroll: 4 },
    GemvSplitParams { warps: 4, m: 1, cols: 2, unroll: 4 },
    GemvSplitParams { warps: 4, m: 8, cols: 1, unroll: 2 },
];

/// One body for every split-K GEMV, over the weights listed in `weights` as in `gemv_kernel!`,
/// each also naming its shared-memory array of per-warp sums; `out`'s expression of the
/// column's sums is stored for each output.
macro_rules! gemv_split_kernel {
    (
        $(#[$attr:meta])*
        $name:ident,
        space = $space:tt,
        weights = [$(
            $w:ident => $v:ident: $acc:ident[$w0:ident, $w1:ident, $w2:ident, $w3:ident], $red:ident
        ),+],
        out: $out:ident = $value:expr
    ) => {
        $(#[$attr])*
        #[kernel(block = p.warps * 32, space = $space)]
        pub fn $name(
            #[comptime] p: &GemvSplitParams,
            a: &[bf16],
            $($w: &[bf16],)+
            out: &mut [$out],
            rows: u32,
            n: u32,
            k: u32,
        ) {
            comptime_assert!(
                p.m == 1 || p.m == 2 || p.m == 4 || p.m == 8,
                "m must be 1, 2, 4 or 8"
            );
            comptime_assert!(p.warps >= 1 && p.warps <= 32, "warps must be 1..=32");
            comptime_assert!(p.cols >= 1 && p.unroll >= 1, "cols and unroll must be positive");
            let cols = p.cols;
            let un = p.unroll;
            let threads = comptime!(p.warps * 32);
            $(let $red = shared::<f32>(p.warps * p.m * p.cols);)+
            let tid = thread_idx_x();
            let j0 = block_idx_x() * cols;
            let chunks = k / 8;
            // Weight row offsets; a column past `n` re-reads the last row and is not written.
            let mut wrow = [0u32; cols];
            #[unroll]
            for c in 0..cols {
                wrow[c] = (j0 + c).min(n - 1) * k;
            }
            $(
                let mut $acc = [0.0f32; p.m * cols];
                let mut $w0 = [0u32; un * cols];
                let mut $w1 = [0u32; un * cols];
                let mut $w2 = [0u32; un * cols];
                let mut $w3 = [0u32; un * cols];
            )+
            let mut ch = tid;
            // The first `un` chunks per column are loaded before waiting for the previous
            // kernel (weights are never written by one); each later batch right after the
            // batch before it is used.
            if ch + threads * (un - 1) < chunks {
                    #[unroll]
                    for u in 0..un {
                        #[unroll]
                        for c in 0..cols {
                            $(
                                let v = $w.vload(wrow[c] + (ch + u * threads) * 8);
                                $w0[u * cols + c] = v.x;
                                $w1[u * cols + c] = v.y;
                                $w2[u * cols + c] = v.z;
                                $w3[u * cols + c] = v.w;
                            )+
                        }
                    }
            }
            grid_wait();
            grid_launch_dependents();
            // Main loop over loaded batches of `un` chunks per column.
            while ch + threads * (un - 1) < chunks {
                #[unroll]
                for u in 0..un {
                    #[unroll]
                    for r in 0..p.m {
                        if r < rows {
                            let av = a.vload(r * k + (ch + u * threads) * 8);
                            #[unroll]
                            for c in 0..cols {
                                let i = u * cols + c;
                                $(
                                    let s = dot2($acc[r * cols + c], av.x, $w0[i]);
                                    let s = dot2(s, av.y, $w1[i]);
                                    let s = dot2(s, av.z, $w2[i]);
                                    $acc[r * cols + c] = dot2(s, av.w, $w3[i]);
                                )+
                            }
                        }
                    }
                }
                ch += threads * un;
                if ch + threads * (un - 1) < chunks {
                    #[unroll]
                    for u in 0..un {
                        #[unroll]
                        for c in 0..cols {
                            $(
                                let v = $w.vload(wrow[c] + (ch + u * threads) * 8);
                                $w0[u * cols + c] = v.x;
                                $w1[u * cols + c] = v.y;
                                $w2[u * cols + c] = v.z;
                                $w3[u * cols + c] = v.w;
                            )+
                        }
                    }
                }
            }
            // Tail: fewer than `un` chunks left for this thread.
            while ch < chunks {
                #[unroll]
                for c in 0..cols {
                    $(
                        let v = $w.vload(wrow[c] + ch * 8);
                        $w0[c] = v.x;
                        $w1[c] = v.y;
                        $w2[c] = v.z;
                        $w3[c] = v.w;
                    )+
                }
                #[unroll]
                for r in 0..p.m {
                    if r < rows {
                        let av = a.vload(r * k + ch * 8);
                        #[unroll]
                        for c in 0..cols {
                            $(
                                let s = dot2($acc[r * cols + c], av.x, $w0[c]);
                                let s = dot2(s, av.y, $w1[c]);
                                let s = dot2(s, av.z, $w2[c]);
                                $acc[r * cols + c] = dot2(s, av.w, $w3[c]);
                            )+
                        }
                    }
                }
                ch += threads;
            }
            let lane = lane_id();
            let warp = warp_id();
            #[unroll]
            for i in 0..p.m * cols {
                $(
                    let s = warp_sum($acc[i]);
                    if lane == 0 {
                        $red[warp * p.m * cols + i] = s;
                    }
                )+
            }
            sync_threads();
            for i in (tid..p.m * cols).step_by(threads) {
                let r = i / cols;
                let c = i % cols;
                if r < rows && j0 + c < n {
                    $(
                        let mut $v = 0.0f32;
                        #[unroll]
                        for wi in 0..p.warps {
                            $v += $red[wi * p.m * cols + i];
                        }
                    )+
                    out[r * n + j0 + c] = $value;
                }
            }
        }
    };
}

gemv_split_kernel!(
    /// [`GemvBf16`] for few output columns and long rows: every warp of a block splits the
    /// reduction of the block's `p.cols` columns (thread `i` takes the 8-element chunks `i, i +
    /// 32 * warps, ...`, `p.unroll` of them loaded before use), and the warps are summed through
    /// shared memory, so `n` columns spread over `n / cols` blocks of `warps` warps. Same
    /// arguments and constraints as [`GemvBf16`]; grid: [`split_grid`].
    gemv_split_bf16,
    space = SPLIT_SPACE,
    weights = [w => s: acc[w0, w1, w2, w3], red],
    out: bf16 = s as bf16
);

gemv_split_kernel!(
    /// [`GemvSplitBf16`] with an f32 output (router logits: `n = 48` or `384`, `k = 7168`).
    gemv_split_f32,
    space = SPLIT_SPACE,
    weights = [w => s: acc[w0, w1, w2, w3], red],
    out: f32 = s as f32
);

gemv_split_kernel!(
    /// [`GemvGateUpSilu`] for few output columns and long rows (the shared expert's 2048 of 7168),
    /// split over a block's warps as [`GemvSplitBf16`]: the block's `p.cols` columns of both
    /// weights are reduced together, and each output is `bf16(silu(g) * u)` of the two bf16-rounded
    /// sums. Same arguments and constraints as [`GemvGateUpSilu`]; grid: [`split_grid`].
    gemv_split_gate_up_silu,
    space = [
        GemvSplitParams { warps: 8, m: 1, cols: 1, unroll: 4 },
        GemvSplitParams { warps: 8, m: 2, cols: 1, unroll: 4 },
        GemvSplitParams { warps: 8, m: 4, cols: 1, unroll: 4 },
        GemvSplitParams { warps: 8, m: 1, cols: 1, unroll: 2 },
        GemvSplitParams { warps: 16, m: 1, cols: 1, unroll: 2 },
        GemvSplitParams { warps: 4, m: 1, cols: 2, unroll: 2 },
    ],
    weights = [
        gate => g: acc_g[g0, g1, g2, g3], red_g,
        up => u: acc_u[u0, u1, u2, u3], red_u
    ],
    out: bf16 = silu_mul_rounded(g, u) as bf16
);

/// Which GEMV kernel suits a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvChoice {
    /// One warp per column (or several columns): [`GemvBf16`] / [`GemvBf16F32`] /
    /// [`GemvGateUpSilu`].
    Warp(GemvParams),
    /// A block per column with the reduction split over its warps: [`GemvSplitBf16`] /
    /// [`GemvSplitF32`] / [`GemvSplitGateUpSilu`].
    Split(GemvSplitParams),
}

/// Row length from which one row takes the split-K kernel even where the per-column kernel
/// would have [`WARPS_PER_SM`] warps per SM, up to [`SPLIT_MAX_COLS`] columns: on the H200
/// (`kernel-check --decode-ops`, cold L2) `o_proj` 8192->7168 takes 37.4 µs split-K vs 43.1
/// per column, while the short rows of `q_b` (1536->12288) stay faster per column (16.3 vs
/// 18.1).
pub const SPLIT_MIN_K: usize = 4096;

/// Most columns of [`SPLIT_MIN_K`]'s rule: wider outputs (the LM head, the dense MLP's 18432)
/// keep the per-column kernel, as measured before the rule.
pub const SPLIT_MAX_COLS: usize = 16384;

/// Warps per SM the per-column kernel should have (with 4 to 8 loads of 16 bytes in flight per
/// lane) to keep enough bytes in flight to cover DRAM latency on an H100/H200-class GPU.
pub const WARPS_PER_SM: usize = 32;

/// Most activation rows the GEMVs take in the engine: from 5 rows on (the `m = 8` variants)
/// cuBLAS is faster; on the H200 a DDTree verify of 8 tree tokens took 26.5 ms with the
/// GEMVs against 18.1 ms for 9 tokens with cuBLAS (Kimi K2.6 EP8, `ddtree bench`).
pub const MAX_ROWS: usize = 4;

/// The GEMV for `rows` activation rows (1..=[`MAX_ROWS`]), `n` output columns of length `k` on a GPU of
/// `sms` SMs: the per-column kernel when it has at least [`WARPS_PER_SM`] warps per SM
/// (`n` large: the LM head, `q_b`) and the rows are short or many ([`SPLIT_MIN_K`]), else the
/// split-K kernel, whose blocks each put 8-16 warps on one or two columns (`o_proj` for one
/// row, the router's 48 or 384 columns, `kv_a` 576, `q_a` 1536).
/// `None` when no variant takes the shape (`k % 8 != 0`, `rows` outside 1..=[`MAX_ROWS`]).
pub fn choose(rows: usize, n: usize, k: usize, sms: usize) -> Option<GemvChoice> {
    choose_in(&GemvBf16::space(), &GemvSplitBf16::space(), rows, n, k, sms)
}

/// The fused gate/up GEMV for `rows` rows, `n` columns of length `k` on `sms` SMs, by
/// [`choose`]'s rule over [`GemvGateUpSilu`]'s and [`GemvSplitGateUpSilu`]'s candidates: on the
/// H200 (132 SMs) split-K for the shared expert (`n = 2048`), per column for the dense MLP
/// (`n = 18432`). `None` where [`choose`] gives none.
pub fn choose_gate_up(rows: usize, n: usize, k: usize, sms: usize) -> Option<GemvChoice> {
    choose_in(&GemvGateUpSilu::space(), &GemvSplitGateUpSilu::space(), rows, n, k, sms)
}

/// The [`GemvRmsNormBf16`] variant for `rows` rows, `n` columns of length `k` on `sms` SMs: for
/// one row where [`choose`] takes a per-column GEMV and `k <= NORM_MAX_K`, the candidate with
/// the most warps (fewer blocks, each normalizing the row once); `None` otherwise (the caller
/// then runs the norm and the GEMV apart). On the H200 (`kernel-check --decode-ops`, cold L2,
/// Kimi's q_b 1536->12288): 18.5 µs at one row with 8 warps (19.2 with 4) against 20.0 for
/// `RmsNorm` + `GemvBf16`, but 30.1 against 26.8 at four rows, where every block normalizing
/// four rows costs more than the launch it saves.
pub fn choose_rms_norm(rows: usize, n: usize, k: usize, sms: usize) -> Option<GemvParams> {
    match choose(rows, n, k, sms)? {
        GemvChoice::Warp(p) if rows == 1 && k <= NORM_MAX_K as usize => GemvRmsNormBf16::space()
            .into_iter()
            .filter(|q| q.m == p.m)
            .max_by_key(|q| q.warps),
        _ => None,
    }
}

/// [`choose`]'s rule over the candidates `warp` (per column) and `split` (split-K): the first
/// of each for `m = rows.next_power_of_two()`.
fn choose_in(
    warp: &[GemvParams],
    split: &[GemvSplitParams],
    rows: usize,
    n: usize,
    k: usize,
    sms: usize,
) -> Option<GemvChoice> {
    if rows == 0 || rows > MAX_ROWS || k % 8 != 0 || n == 0 {
        return None;
    }
    let m = rows.next_power_of_two() as u32;
    let w = warp.iter().find(|p| p.m == m)?;
    let warps = n.div_ceil(cols_per_warp(w) as usize);
    let long_rows = m == 1 && k >= SPLIT_MIN_K && n <= SPLIT_MAX_COLS;
    if warps >= WARPS_PER_SM * sms.max(1) && !long_rows {
        return Some(GemvChoice::Warp(*w));
    }
    split.iter().find(|p| p.m == m).copied().map(GemvChoice::Split)
}

/// CPU reference (f64 accumulation): `a` is `[rows, k]`, `w` is `[n, k]`; returns `[rows, n]`
/// in f32 (the bf16 kernel rounds this to bf16).
pub fn reference(a: &[f32], w: &[f32], rows: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * n];
    for r in 0..rows {
        let ar = &a[r * k..(r + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            out[r * n + j] = ar.iter().zip(wr).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>() as f32;
        }
    }
    out
}

/// CPU reference of the fused gate/up GEMVs: both products by [`reference`], each rounded to
/// bf16 (nearest even), then [`crate::silu_mul::reference_split`]; `[rows, n]` in f32 (the
/// kernels round this to bf16).
pub fn reference_gate_up_silu(a: &[f32], gate: &[f32], up: &[f32], rows: usize, n: usize, k: usize) -> Vec<f32> {
    let rounded = |w: &[f32]| -> Vec<f32> {
        reference(a, w, rows, n, k)
            .into_iter()
            .map(|v| bf16::from_f32(v).to_f32())
            .collect()
    };
    crate::silu_mul::reference_split(&rounded(gate), &rounded(up))
}
