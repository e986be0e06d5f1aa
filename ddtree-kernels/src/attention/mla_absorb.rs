//! The absorbed-MLA projections of a decode step (a few tokens), each one launch that reads
//! every byte of its `kv_b` slice once, GEMV style (many 128-bit loads in flight per thread).
//!
//! `kv_b` is the `nn.Linear` weight `[heads * (nope + v), lora]` (row-major bf16): head `h`'s
//! rows `h * (nope + v) ..+ nope` are `W_UK[h]` (`[nope, lora]`), the next `v` rows `W_UV[h]`
//! (`[v, lora]`).
//!
//! - [`MlaAbsorbQuery`]: `q_abs[t, h, 0..lora] = q[t, h, 0..nope] . W_UK[h]` and
//!   `q_abs[t, h, lora..lora + rope]` = the roped rope dims of `q` (the RoPE math of
//!   [`crate::rope`]). A block owns `cols` latent columns of one head; its threads split the
//!   `nope` rows (each thread keeps `nope / groups` rows of 8 columns in registers, loaded before
//!   any is used) and the groups are summed through shared memory, once per token.
//! - [`MlaAbsorbOutput`]: `o[t, h, j] = o_lat[t, h, 0..lora] . W_UV[h][j]`: a warp owns `cols`
//!   output columns of one head (rows of `W_UV[h]`), its lanes stride over `lora` in 128-bit
//!   loads held in registers for every token, reduced with warp shuffles.
//!
//! The token count is a runtime argument (any `rows`); the weights are read once per launch.
//!
//! Constraints: 16-byte aligned `kv_b` with `lora % 8 == 0`, `lora % cols == 0` for the query
//! kernel, `v % cols == 0` for the output kernel, and fewer than 2^32 elements everywhere.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

use crate::common::warp_sum;
use crate::rope::{pair_distance, pair_step, rope_first, rope_second};

/// Compile-time parameters of [`MlaAbsorbQuery`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct MlaQueryParams {
    /// Threads per block.
    pub block: u32,
    /// Latent columns per block (a multiple of 8; `cols / 8` threads cover them, the block's
    /// `block / (cols / 8)` thread groups split the `nope` rows).
    pub cols: u32,
    /// Non-rope query dims per head (128 for Kimi).
    pub nope: u32,
    /// Rope dims per head (64 for Kimi).
    pub rope: u32,
    /// Pair layout of the rope dims, as [`crate::rope::RopeParams::interleave`].
    pub interleave: bool,
}

/// Thread groups of a [`MlaAbsorbQuery`] block (each covers the block's columns).
pub fn query_groups(p: &MlaQueryParams) -> u32 {
    p.block / (p.cols / 8)
}

/// `W_UK` rows each thread of [`MlaAbsorbQuery`] keeps in registers.
pub fn query_rows_per_thread(p: &MlaQueryParams) -> u32 {
    p.nope / query_groups(p)
}

/// The launch grid of [`MlaAbsorbQuery`]: `heads * lora / cols` blocks.
pub fn query_grid(p: &MlaQueryParams, heads: u32, lora: u32) -> u32 {
    (heads * lora.div_ceil(p.cols)).max(1)
}

/// The absorbed query (see the module docs). `q` is `[rows, heads, nope + rope]`, `kv_b` as in
/// the module docs with `w_head = (nope + v) * lora` elements per head, `out` is
/// `[rows, heads, lora + rope]`; token `t` is at `positions[t]`, `cos`/`sin` are
/// `[max_pos, rope / 2]` tables. f32 accumulation, each output rounded to bf16 once. Needs
/// `lora % cols == 0`. Grid: [`query_grid`] (block `b` is head `b / (lora / cols)`).
#[kernel(block = p.block, space = [
    MlaQueryParams { block: 256, cols: 256, nope: 128, rope: 64, interleave: true },
    MlaQueryParams { block: 256, cols: 128, nope: 128, rope: 64, interleave: true },
    MlaQueryParams { block: 512, cols: 256, nope: 128, rope: 64, interleave: true },
    MlaQueryParams { block: 128, cols: 64, nope: 128, rope: 64, interleave: true },
    MlaQueryParams { block: 256, cols: 256, nope: 128, rope: 64, interleave: false },
    MlaQueryParams { block: 64, cols: 32, nope: 16, rope: 16, interleave: true },
    MlaQueryParams { block: 64, cols: 32, nope: 16, rope: 16, interleave: false },
])]
#[allow(clippy::too_many_arguments)]
pub fn mla_absorb_query(
    #[comptime] p: &MlaQueryParams,
    q: &[bf16],
    kv_b: &[bf16],
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
    out: &mut [bf16],
    rows: u32,
    heads: u32,
    lora: u32,
    w_head: u32,
) {
    comptime_assert!(
        p.cols % 8 == 0 && p.block % (p.cols / 8) == 0,
        "cols / 8 must divide block"
    );
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32, at most 1024"
    );
    comptime_assert!(
        p.nope % (p.block / (p.cols / 8)) == 0,
        "the thread groups must split nope evenly"
    );
    comptime_assert!(p.rope % 2 == 0, "rope dims come in pairs");
    let gl = comptime!(p.cols / 8);
    let groups = comptime!(query_groups(p));
    let nr = comptime!(query_rows_per_thread(p));
    let half = comptime!(p.rope / 2);
    let qk = comptime!(p.nope + p.rope);
    let red = shared::<f32>(groups * p.cols);
    let tid = thread_idx_x();
    let blocks_per_head = lora / p.cols;
    let h = block_idx_x() / blocks_per_head;
    let cblk = block_idx_x() % blocks_per_head;
    let g = tid / gl;
    let cl = tid % gl;
    let r0 = g * nr;
    let c0 = cblk * p.cols + cl * 8;
    // Every W_UK load of this thread first: nr rows of 8 columns.
    let mut w0 = [0u32; nr];
    let mut w1 = [0u32; nr];
    let mut w2 = [0u32; nr];
    let mut w3 = [0u32; nr];
    #[unroll]
    for r in 0..nr {
        let v = kv_b.vload(h * w_head + (r0 + r) * lora + c0);
        w0[r] = v.x;
        w1[r] = v.y;
        w2[r] = v.z;
        w3[r] = v.w;
    }
    // The weights are never written by a kernel: loaded before waiting for the previous one.
    grid_wait();
    grid_launch_dependents();
    let out_w = lora + p.rope;
    for t in 0..rows {
        let qrow = (t * heads + h) * qk;
        let mut qv = [0.0f32; nr];
        #[unroll]
        for r in 0..nr {
            qv[r] = q[qrow + r0 + r] as f32;
        }
        let mut acc = [0.0f32; 8];
        #[unroll]
        for r in 0..nr {
            acc[0] = qv[r].mul_add(bf16_lo(w0[r]), acc[0]);
            acc[1] = qv[r].mul_add(bf16_hi(w0[r]), acc[1]);
            acc[2] = qv[r].mul_add(bf16_lo(w1[r]), acc[2]);
            acc[3] = qv[r].mul_add(bf16_hi(w1[r]), acc[3]);
            acc[4] = qv[r].mul_add(bf16_lo(w2[r]), acc[4]);
            acc[5] = qv[r].mul_add(bf16_hi(w2[r]), acc[5]);
            acc[6] = qv[r].mul_add(bf16_lo(w3[r]), acc[6]);
            acc[7] = qv[r].mul_add(bf16_hi(w3[r]), acc[7]);
        }
        // Slot e * gl + cl holds column cl * 8 + e: conflict-free writes and reads.
        #[unroll]
        for e in 0..8 {
            red[g * p.cols + e * gl + cl] = acc[e];
        }
        sync_threads();
        let orow = (t * heads + h) * out_w + cblk * p.cols;
        for s in (tid..p.cols).step_by(p.block) {
            let mut sum = 0.0f32;
            #[unroll]
            for k in 0..groups {
                sum += red[k * p.cols + s];
            }
            out[orow + (s % gl) * 8 + s / gl] = sum as bf16;
        }
        // The partials are rewritten for the next token.
        sync_threads();
    }
    // The rope dims, by the first column block of each head.
    if cblk == 0 {
        for i in (tid..rows * half).step_by(p.block) {
            let t = i / half;
            let pair = i % half;
            let pos = positions[t];
            let c = cos[pos * half + pair];
            let s = sin[pos * half + pair];
            let off = comptime!(pair_step(p.interleave)) * pair;
            let dist = comptime!(pair_distance(p.rope, p.interleave));
            let src = (t * heads + h) * qk + p.nope + off;
            let dst = (t * heads + h) * out_w + lora + off;
            let x0 = q[src] as f32;
            let x1 = q[src + dist] as f32;
            out[dst] = rope_first(x0, x1, c, s) as bf16;
            out[dst + dist] = rope_second(x0, x1, c, s) as bf16;
        }
    }
}

/// Compile-time parameters of [`MlaAbsorbOutput`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct MlaOutputParams {
    /// Warps per block.
    pub warps: u32,
    /// Output columns (rows of `W_UV[h]`) per warp; must divide `v`.
    pub cols: u32,
    /// Latent width (512 for Kimi): each lane holds `ceil(lora / 256)` 128-bit loads per column.
    pub lora: u32,
}

/// 128-bit loads per column and lane of [`MlaAbsorbOutput`].
pub fn output_chunks_per_lane(p: &MlaOutputParams) -> u32 {
    (p.lora / 8).div_ceil(32)
}

/// The launch grid of [`MlaAbsorbOutput`] for `heads * v` output columns.
pub fn output_grid(p: &MlaOutputParams, heads: u32, v: u32) -> u32 {
    (heads * v).div_ceil(p.warps * p.cols).max(1)
}

/// The absorbed output projection: `out[t, h * v + j] = sum_c o_lat[t, h * lora + c] *
/// kv_b[h * w_head + (nope + j) * lora + c]` for `t < rows`, `h < heads`, `j < v`, with
/// `w_head = (nope + v) * lora`; `o_lat` is `[rows, heads, lora]`, `out` `[rows, heads * v]`.
/// f32 accumulation, rounded to bf16. Needs `v % cols == 0`. Grid: [`output_grid`].
#[kernel(block = p.warps * 32, space = [
    MlaOutputParams { warps: 4, cols: 4, lora: 512 },
    MlaOutputParams { warps: 4, cols: 2, lora: 512 },
    MlaOutputParams { warps: 8, cols: 4, lora: 512 },
    MlaOutputParams { warps: 4, cols: 8, lora: 512 },
    MlaOutputParams { warps: 2, cols: 4, lora: 32 },
])]
#[allow(clippy::too_many_arguments)]
pub fn mla_absorb_output(
    #[comptime] p: &MlaOutputParams,
    o_lat: &[bf16],
    kv_b: &[bf16],
    out: &mut [bf16],
    rows: u32,
    heads: u32,
    nope: u32,
    v: u32,
    w_head: u32,
) {
    comptime_assert!(p.lora % 8 == 0, "lora must be a multiple of 8");
    comptime_assert!(p.warps >= 1 && p.warps <= 32, "warps must be 1..=32");
    let un = comptime!(output_chunks_per_lane(p));
    let chunks = comptime!(p.lora / 8);
    let lane = lane_id();
    let j0 = (block_idx_x() * p.warps + warp_id()) * p.cols;
    // Warp-uniform: the columns of a warp lie in one head (v % cols == 0).
    if j0 < heads * v {
        let h = j0 / v;
        let wbase = h * w_head + (nope + j0 % v) * p.lora;
        let mut w0 = [0u32; un * p.cols];
        let mut w1 = [0u32; un * p.cols];
        let mut w2 = [0u32; un * p.cols];
        let mut w3 = [0u32; un * p.cols];
        #[unroll]
        for u in 0..un {
            let ch = lane + u * 32;
            if ch < chunks {
                #[unroll]
                for c in 0..p.cols {
                    let wv = kv_b.vload(wbase + c * p.lora + ch * 8);
                    w0[u * p.cols + c] = wv.x;
                    w1[u * p.cols + c] = wv.y;
                    w2[u * p.cols + c] = wv.z;
                    w3[u * p.cols + c] = wv.w;
                }
            }
        }
        // The weights are never written by a kernel: loaded before waiting for the previous one.
        grid_wait();
        grid_launch_dependents();
        for t in 0..rows {
            let arow = (t * heads + h) * p.lora;
            let mut acc = [0.0f32; p.cols];
            #[unroll]
            for u in 0..un {
                let ch = lane + u * 32;
                if ch < chunks {
                    let av = o_lat.vload(arow + ch * 8);
                    #[unroll]
                    for c in 0..p.cols {
                        let i = u * p.cols + c;
                        let s = bf16_lo(av.x).mul_add(bf16_lo(w0[i]), acc[c]);
                        let s = bf16_hi(av.x).mul_add(bf16_hi(w0[i]), s);
                        let s = bf16_lo(av.y).mul_add(bf16_lo(w1[i]), s);
                        let s = bf16_hi(av.y).mul_add(bf16_hi(w1[i]), s);
                        let s = bf16_lo(av.z).mul_add(bf16_lo(w2[i]), s);
                        let s = bf16_hi(av.z).mul_add(bf16_hi(w2[i]), s);
                        let s = bf16_lo(av.w).mul_add(bf16_lo(w3[i]), s);
                        acc[c] = bf16_hi(av.w).mul_add(bf16_hi(w3[i]), s);
                    }
                }
            }
            #[unroll]
            for c in 0..p.cols {
                acc[c] = warp_sum(acc[c]);
            }
            if lane == 0 {
                #[unroll]
                for c in 0..p.cols {
                    out[t * heads * v + j0 + c] = acc[c] as bf16;
                }
            }
        }
    }
}

/// CPU reference of [`MlaAbsorbQuery`] (f64 sums, returned as f32): `q` `[rows, heads, nope +
/// rope]`, `kv_b` `[heads * (nope + v), lora]`; returns `[rows, heads, lora + rope]` with the
/// rope dims rotated by [`crate::rope::reference`]'s math.
#[allow(clippy::too_many_arguments)]
pub fn query_reference(
    q: &[f32],
    kv_b: &[f32],
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    (nope, rope, v, lora): (usize, usize, usize, usize),
    interleave: bool,
) -> Vec<f32> {
    let (qk, ow) = (nope + rope, lora + rope);
    let rows = positions.len();
    let mut out = vec![0f32; rows * heads * ow];
    for t in 0..rows {
        for h in 0..heads {
            let qr = &q[(t * heads + h) * qk..][..qk];
            let o = &mut out[(t * heads + h) * ow..][..ow];
            for (c, oc) in o[..lora].iter_mut().enumerate() {
                let s: f64 = (0..nope)
                    .map(|i| qr[i] as f64 * kv_b[(h * (nope + v) + i) * lora + c] as f64)
                    .sum();
                *oc = s as f32;
            }
            o[lora..].copy_from_slice(&qr[nope..]);
        }
    }
    crate::rope::reference(&mut out, positions, cos, sin, heads, ow, lora, rope, interleave);
    out
}

/// CPU reference of [`MlaAbsorbOutput`] (f64 sums, returned as f32): `o_lat` `[rows, heads,
/// lora]`; returns `[rows, heads * v]`.
pub fn output_reference(
    o_lat: &[f32],
    kv_b: &[f32],
    rows: usize,
    heads: usize,
    (nope, v, lora): (usize, usize, usize),
) -> Vec<f32> {
    let mut out = vec![0f32; rows * heads * v];
    for t in 0..rows {
        for h in 0..heads {
            let a = &o_lat[(t * heads + h) * lora..][..lora];
            for j in 0..v {
                let w = &kv_b[(h * (nope + v) + nope + j) * lora..][..lora];
                out[t * heads * v + h * v + j] =
                    a.iter().zip(w).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>() as f32;
            }
        }
    }
    out
}
