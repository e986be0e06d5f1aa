//! Memory-bound bf16 GEMV for decode (a few rows of activations against an `nn.Linear`
//! weight): `out[r, j] = sum_i a[r, i] * w[j, i]`, f32 accumulation, with bf16 ([`GemvBf16`]) or
//! f32 ([`GemvBf16F32`], router logits and the LM head) output, and the SwiGLU gate/up pair fused
//! with its SiLU-and-mul ([`GemvSiluMul`]: `act[r, j] = silu(a w_gate[j]) * (a w_up[j])`).
//!
//! One main loop serves every layout. A block of [`GemvParams::warps`] warps holds
//! `warps / split` groups; a group owns [`GemvParams::cols`] output columns and its `split`
//! warps share the reduction over `k`: thread `t` of a group takes the 8-element chunks `t, t +
//! 32 split, ...` of every column's weight row in 128-bit loads, issuing [`GemvParams::unroll`]
//! of them per column (predicated at the end of the row, so a short row is one batch of
//! independent loads, never a serial tail) before using any. `split = 1` is a warp per column
//! group (wide outputs: the LM head, `o_proj`, `q_b`); `split = warps` is split-K inside a block
//! (narrow outputs: the router, `kv_a`, `q_a`, the fused gate/up). The activation chunk matching
//! each weight chunk is read from L1/L2 (`a` is small) and reused for all of a group's columns.
//! Partial sums are reduced with warp shuffles, then through shared memory over the group's
//! warps in a fixed order (deterministic), and written by one thread per output.
//!
//! Constraints: `k % 8 == 0` and 16-byte aligned `a` and `w` (the 128-bit loads), `1 <= rows <=
//! p.m`, and `n * k < 2^32` (u32 indexing).

// The generated `launch` functions carry a `# Safety` section, but clippy does not see it when
// `#[kernel]` is expanded from `gemv_kernel!`.
#![allow(clippy::missing_safety_doc)]

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

use crate::common::warp_sum;
use crate::silu_mul::silu;

/// Compile-time parameters of [`GemvBf16`], [`GemvBf16F32`] and [`GemvSiluMul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct GemvParams {
    /// Most activation rows (1, 2, 4, 8 or 16): the kernel keeps `m` partial sums per column.
    pub m: u32,
    /// Warps per block.
    pub warps: u32,
    /// Warps sharing the reduction of one group of columns (divides `warps`): 1 is a warp per
    /// group, `warps` one group per block (split-K).
    pub split: u32,
    /// Output columns per group (each activation load feeds all of them).
    pub cols: u32,
    /// 128-bit weight loads per column a thread issues per main-loop iteration before using any.
    pub unroll: u32,
}

const fn g(m: u32, warps: u32, split: u32, cols: u32, unroll: u32) -> GemvParams {
    GemvParams {
        m,
        warps,
        split,
        cols,
        unroll,
    }
}

/// Every candidate, grouped by `m`; index 0 is the safe default (one row, a warp per column).
/// Per `m` the space holds warp-per-column layouts (`split = 1`, shallow and deep unroll, more
/// columns per warp as `m` grows), split-K layouts of 128 to 512 threads per column, and a
/// middle layout of two warps per column; [`choose`] names the one the engine uses per shape.
pub const GEMV_SPACE: &[GemvParams] = &[
    g(1, 4, 1, 1, 4),
    g(1, 4, 1, 1, 8),
    g(1, 4, 1, 2, 4),
    g(1, 8, 2, 1, 8),
    g(1, 8, 8, 1, 4),
    g(1, 8, 8, 2, 4),
    g(1, 4, 4, 1, 8),
    g(1, 16, 16, 1, 2),
    g(2, 4, 1, 1, 4),
    g(2, 4, 1, 1, 8),
    g(2, 8, 2, 1, 8),
    g(2, 8, 8, 1, 4),
    g(2, 4, 4, 1, 8),
    g(2, 16, 16, 1, 2),
    g(4, 4, 1, 2, 2),
    g(4, 4, 1, 1, 4),
    g(4, 8, 2, 1, 4),
    g(4, 8, 8, 1, 4),
    g(4, 4, 4, 1, 8),
    g(4, 16, 16, 1, 2),
    g(8, 4, 1, 4, 2),
    g(8, 4, 1, 2, 4),
    g(8, 8, 8, 1, 4),
    g(8, 8, 2, 1, 4),
    g(8, 4, 4, 1, 4),
    g(8, 16, 16, 1, 2),
    g(16, 4, 1, 4, 2),
    g(16, 8, 8, 1, 4),
    g(16, 16, 16, 1, 2),
];

/// Output columns per block: `cols * warps / split`.
pub fn cols_per_block(p: &GemvParams) -> u32 {
    p.cols * (p.warps / p.split)
}

/// The launch grid for `n` output columns: `ceil(n / cols_per_block)` blocks (at least 1).
pub fn grid(p: &GemvParams, n: u32) -> u32 {
    n.div_ceil(cols_per_block(p)).max(1)
}

/// `acc + dot(a, w)` over the two bf16 of `a` and of `w` (fused multiply-adds, low half first).
#[device_fn]
fn dot2(acc: f32, a: u32, w: u32) -> f32 {
    bf16_hi(a).mul_add(bf16_hi(w), bf16_lo(a).mul_add(bf16_lo(w), acc))
}

/// The three kernels share one body: `$out` is the output element type (`as f32` on an f32 is a
/// no-op), `$gated` whether a second weight `$up` is read (its rows are the group's second
/// `cols` weight rows) and the output is `silu(gate) * up`.
macro_rules! gemv_kernel {
    ($(#[$attr:meta])* $name:ident, $out:ident, $gated:literal $(, $up:ident)?) => {
        $(#[$attr])*
        #[kernel(block = p.warps * 32, space = GEMV_SPACE.to_vec())]
        pub fn $name(
            #[comptime] p: &GemvParams,
            a: &[bf16],
            w: &[bf16],
            $($up: &[bf16],)?
            out: &mut [$out],
            rows: u32,
            n: u32,
            k: u32,
        ) {
            comptime_assert!(
                p.m == 1 || p.m == 2 || p.m == 4 || p.m == 8 || p.m == 16,
                "m must be 1, 2, 4, 8 or 16"
            );
            comptime_assert!(p.warps >= 1 && p.warps <= 32, "warps must be 1..=32");
            comptime_assert!(
                p.split >= 1 && p.warps % p.split == 0,
                "split must divide warps"
            );
            comptime_assert!(p.cols >= 1 && p.unroll >= 1, "cols and unroll must be positive");
            let cols = p.cols;
            // Weight rows per group: the gate rows, then (gated) as many up rows.
            let wc = comptime!(if $gated { 2 * p.cols } else { p.cols });
            let un = p.unroll;
            let groups = comptime!(p.warps / p.split);
            let threads = comptime!(p.warps * 32);
            // Chunks one pass of a group covers.
            let stride = comptime!(p.split * 32);
            let red = shared::<f32>(p.warps * p.m * wc);
            let tid = thread_idx_x();
            let warp = warp_id();
            let j0 = (block_idx_x() * groups + warp / p.split) * cols;
            // A group past the last column loads nothing (it still meets the barrier).
            let chunks = if j0 < n { k / 8 } else { 0 };
            // Weight row offsets; a column past `n` re-reads the last row and is not written.
            let mut wrow = [0u32; cols];
            #[unroll]
            for c in 0..cols {
                wrow[c] = (j0 + c).min(n - 1) * k;
            }
            let mut acc = [0.0f32; p.m * wc];
            let mut w0 = [0u32; un * wc];
            let mut w1 = [0u32; un * wc];
            let mut w2 = [0u32; un * wc];
            let mut w3 = [0u32; un * wc];
            let mut ch = (warp % p.split) * 32 + lane_id();
            // Main loop: `un` chunks per weight row, all loads issued before any is used.
            while ch < chunks {
                #[unroll]
                for u in 0..un {
                    if ch + u * stride < chunks {
                        let off = (ch + u * stride) * 8;
                        #[unroll]
                        for c in 0..cols {
                            let v = w.vload(wrow[c] + off);
                            w0[u * wc + c] = v.x;
                            w1[u * wc + c] = v.y;
                            w2[u * wc + c] = v.z;
                            w3[u * wc + c] = v.w;
                        }
                        $(
                            #[unroll]
                            for c in 0..cols {
                                let v = $up.vload(wrow[c] + off);
                                w0[u * wc + cols + c] = v.x;
                                w1[u * wc + cols + c] = v.y;
                                w2[u * wc + cols + c] = v.z;
                                w3[u * wc + cols + c] = v.w;
                            }
                        )?
                    }
                }
                #[unroll]
                for u in 0..un {
                    if ch + u * stride < chunks {
                        #[unroll]
                        for r in 0..p.m {
                            if r < rows {
                                let av = a.vload(r * k + (ch + u * stride) * 8);
                                #[unroll]
                                for c in 0..wc {
                                    let i = u * wc + c;
                                    let s = dot2(acc[r * wc + c], av.x, w0[i]);
                                    let s = dot2(s, av.y, w1[i]);
                                    let s = dot2(s, av.z, w2[i]);
                                    acc[r * wc + c] = dot2(s, av.w, w3[i]);
                                }
                            }
                        }
                    }
                }
                ch += stride * un;
            }
            #[unroll]
            for i in 0..p.m * wc {
                let s = warp_sum(acc[i]);
                if lane_id() == 0 {
                    red[warp * p.m * wc + i] = s;
                }
            }
            sync_threads();
            // One thread per output of the block: the group's warps summed in order.
            for i in (tid..groups * p.m * cols).step_by(threads) {
                let gr = i / (p.m * cols);
                let r = (i / cols) % p.m;
                let c = i % cols;
                let j = (block_idx_x() * groups + gr) * cols + c;
                if r < rows && j < n {
                    let base = gr * p.split * p.m * wc + r * wc + c;
                    let mut s = 0.0f32;
                    #[unroll]
                    for wi in 0..p.split {
                        s += red[base + wi * p.m * wc];
                    }
                    if $gated {
                        let mut up = 0.0f32;
                        #[unroll]
                        for wi in 0..p.split {
                            up += red[base + cols + wi * p.m * wc];
                        }
                        out[r * n + j] = (silu(s) * up) as $out;
                    } else {
                        out[r * n + j] = s as $out;
                    }
                }
            }
        }
    };
}

gemv_kernel!(
    /// `out[r * n + j] = bf16(sum_i f32(a[r * k + i]) * f32(w[j * k + i]))` for `r < rows`,
    /// `j < n`: `a` is `[rows, k]`, `w` is `[n, k]` (an `nn.Linear` weight), both row-major bf16;
    /// f32 accumulation, rounded to nearest even. Needs `k % 8 == 0` (128-bit loads; `a` and `w`
    /// 16-byte aligned), `1 <= rows <= p.m` and `n * k < 2^32`. Grid: [`grid`] blocks in x.
    gemv_bf16,
    bf16,
    false
);

gemv_kernel!(
    /// [`GemvBf16`] with an f32 output (no rounding): `out[r * n + j] = sum_i f32(a[r * k + i]) *
    /// f32(w[j * k + i])`, for router logits and the LM head. Same constraints and grid.
    gemv_bf16_f32,
    f32,
    false
);

gemv_kernel!(
    /// A SwiGLU block's gate and up projections and its SiLU-and-mul in one launch: `out[r * n
    /// + j] = bf16(silu(g) * u)` with `g = sum_i a[r, i] w[j, i]` and `u = sum_i a[r, i] w_up[j,
    /// i]` in f32 (neither rounded to bf16 first). `w` (gate) and `w_up` are both `[n, k]`; same
    /// constraints and grid as [`GemvBf16`].
    gemv_silu_mul,
    bf16,
    true,
    w_up
);

/// Weight rows per SM from which the warp-per-column layout has enough warps (with 4 to 8 loads
/// of 16 bytes in flight per lane) to cover DRAM latency on an H100/H200-class GPU.
pub const WARPS_PER_SM: usize = 32;

/// Most activation rows a GEMV takes (the largest `m` of [`GEMV_SPACE`]).
pub const MAX_ROWS: usize = 16;

/// The GEMV variant for `rows` activation rows (1..=[`MAX_ROWS`]) and `n` output columns of
/// length `k` on a GPU of `sms` SMs (`gated`: [`GemvSiluMul`], whose groups read two weight
/// rows per column). A warp per column group when the weight rows are at least [`WARPS_PER_SM`]
/// per SM (the LM head, `o_proj`, `q_b`, the shared expert's down), unrolled 8 deep for rows that
/// one pass of 8 covers (`k <= 2048`) and for 1-2 rows; else split-K inside a block of 8 warps
/// (`q_a`, `kv_a`, the fused gate/up), or 16 when the columns are fewer than the SMs (the
/// router). `None` when no variant takes the shape (`k % 8 != 0`, `rows` outside 1..=16).
pub fn choose(rows: usize, n: usize, k: usize, sms: usize, gated: bool) -> Option<GemvParams> {
    if rows == 0 || rows > MAX_ROWS || k % 8 != 0 || n == 0 {
        return None;
    }
    let m = rows.next_power_of_two() as u32;
    let per_m = || GEMV_SPACE.iter().copied().filter(move |p| p.m == m);
    let weight_rows = if gated { 2 * n } else { n };
    let pick = if weight_rows >= WARPS_PER_SM * sms.max(1) {
        let deep = m <= 2 || k <= 2048;
        per_m()
            .filter(|p| p.split == 1)
            .find(|p| !deep || p.unroll * p.cols >= 8)
    } else {
        let warps = if n < sms { 16 } else { 8 };
        per_m().find(|p| p.split == p.warps && p.warps == warps && p.cols == 1)
    };
    pick.or_else(|| per_m().next())
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

/// CPU reference of [`GemvSiluMul`]: `silu(a w_gate^T) * (a w_up^T)` from the f64 sums of
/// [`reference`], in f32.
pub fn silu_mul_reference(a: &[f32], w_gate: &[f32], w_up: &[f32], rows: usize, n: usize, k: usize) -> Vec<f32> {
    crate::silu_mul::reference_split(&reference(a, w_gate, rows, n, k), &reference(a, w_up, rows, n, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layouts [`choose`] gives the Kimi K2.6 decode products on an H200 (132 SMs).
    #[test]
    fn choose_on_kimi_shapes() {
        let pick = |rows, n, k, gated| {
            let p = choose(rows, n, k, 132, gated).expect("a variant");
            assert!(GEMV_SPACE.contains(&p) && p.m as usize >= rows);
            (p.warps, p.split, p.cols, p.unroll)
        };
        for rows in 1..=2 {
            assert_eq!(pick(rows, 7168, 8192, false), (4, 1, 1, 8), "o_proj");
            assert_eq!(pick(rows, 12288, 1536, false), (4, 1, 1, 8), "q_b");
            assert_eq!(pick(rows, 163840, 7168, false), (4, 1, 1, 8), "lm_head");
            assert_eq!(pick(rows, 1536, 7168, false), (8, 8, 1, 4), "q_a");
            assert_eq!(pick(rows, 2048, 7168, true), (8, 8, 1, 4), "gate+up");
            assert_eq!(pick(rows, 48, 7168, false), (16, 16, 1, 2), "router");
        }
        assert_eq!(pick(4, 7168, 8192, false), (4, 1, 2, 2), "o_proj");
        assert_eq!(pick(4, 7168, 2048, false), (4, 1, 2, 2), "down");
        assert_eq!(pick(8, 7168, 2048, false), (4, 1, 4, 2), "down");
        assert_eq!(pick(4, 576, 7168, false), (8, 8, 1, 4), "kv_a");
        assert_eq!(choose(17, 7168, 8192, 132, false), None);
        assert_eq!(choose(1, 7168, 8191, 132, false), None);
    }
}
