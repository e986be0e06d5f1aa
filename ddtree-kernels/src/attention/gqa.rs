//! Non-causal grouped-query attention at runtime dimensions (the DFlash drafter's attention:
//! every query row of the draft block sees every key).
//!
//! One block per `(row, head)`, the structure of [`super::MlaAttention`]: each warp takes every
//! `warps`-th key (lanes split the dot product over the head dim), keeps an online softmax and
//! [`GQA_COLS`] output columns per lane, and the warps are merged through shared memory by their
//! maxima. Head dims wider than `32 * GQA_COLS` are covered in several passes over the keys.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

use crate::common::warp_sum;

/// Output columns each lane accumulates per pass of [`GqaAttention`] (`32 * GQA_COLS` = 128
/// columns per pass: one pass for a head dim of 128).
pub const GQA_COLS: u32 = 4;

/// Query values [`GqaAttention`] stages in shared memory (as f32); entries of wider heads are
/// read from global memory.
pub const GQA_Q_SHARED: u32 = 512;

/// Compile-time parameters of [`GqaAttention`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct GqaParams {
    /// Threads per block (one block per `(row, head)`; one warp per key at a time).
    pub block: u32,
}

/// Grouped-query attention without a mask: `q` is `[rows, heads * head_dim]`, `k` and `v` are
/// `[keys, kv_heads * head_dim]`; query head `h` uses kv head `h / (heads / kv_heads)`. Scores
/// `q . k * scale` in f32, softmax over all `keys`, `out` (`[rows, heads * head_dim]` bf16) the
/// probability-weighted sum of values (zeros when `keys == 0`). `heads` must be a multiple of
/// `kv_heads`. Grid: `rows * heads` (block `b` is row `b / heads`, head `b % heads`).
#[kernel(block = p.block, space = [
    GqaParams { block: 128 },
    GqaParams { block: 64 },
    GqaParams { block: 256 },
])]
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention(
    #[comptime] p: &GqaParams,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    out: &mut [bf16],
    rows: u32,
    keys: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    scale: f32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32 and at most 1024"
    );
    let nw = p.block / 32;
    let span = 32 * GQA_COLS;
    let b = block_idx_x();
    let row = b / heads;
    let h = b % heads;
    let sq = shared::<f32>(GQA_Q_SHARED);
    let so = shared::<f32>(nw * span);
    let sm = shared::<f32>(nw);
    let sl = shared::<f32>(nw);
    if row < rows {
        let kvh = h / (heads / kv_heads);
        let qo = b * head_dim;
        let ko = kvh * head_dim;
        let kv_stride = kv_heads * head_dim;
        let tid = thread_idx_x();
        let lane = lane_id();
        let warp = warp_id();
        for d in (tid..head_dim.min(GQA_Q_SHARED)).step_by(p.block) {
            sq[d] = q[qo + d] as f32;
        }
        sync_threads();
        for c0 in (0..head_dim).step_by(span) {
            let mut o = [0.0f32; GQA_COLS];
            let mut m = f32::NEG_INFINITY;
            let mut l = 0.0f32;
            for key in (warp..keys).step_by(nw) {
                let kr = key * kv_stride + ko;
                let mut d = 0.0f32;
                for i in (lane..head_dim).step_by(32) {
                    let qv = if i < GQA_Q_SHARED { sq[i] } else { q[qo + i] as f32 };
                    d += qv * (k[kr + i] as f32);
                }
                let s = warp_sum(d) * scale;
                let mn = m.max(s);
                let alpha = (m - mn).exp();
                let pr = (s - mn).exp();
                l = l * alpha + pr;
                #[unroll]
                for c in 0..GQA_COLS {
                    let col = c0 + c * 32 + lane;
                    if col < head_dim {
                        o[c] = o[c] * alpha + pr * (v[kr + col] as f32);
                    }
                }
                m = mn;
            }
            #[unroll]
            for c in 0..GQA_COLS {
                so[warp * span + c * 32 + lane] = o[c];
            }
            if lane == 0 {
                sm[warp] = m;
                sl[warp] = l;
            }
            sync_threads();
            // Merge the warps' partials by their maxima (a warp that saw no key has weight 0).
            let mut mt = f32::NEG_INFINITY;
            #[unroll]
            for kw in 0..nw {
                mt = mt.max(sm[kw]);
            }
            let mut wt = [0.0f32; nw];
            let mut lt = 0.0f32;
            #[unroll]
            for kw in 0..nw {
                if sm[kw] != f32::NEG_INFINITY {
                    wt[kw] = (sm[kw] - mt).exp();
                }
                lt += wt[kw] * sl[kw];
            }
            let inv = if lt > 0.0f32 { 1.0f32 / lt } else { 0.0f32 };
            for jc in (tid..span).step_by(p.block) {
                let col = c0 + jc;
                if col < head_dim {
                    let mut acc = 0.0f32;
                    #[unroll]
                    for kw in 0..nw {
                        acc += wt[kw] * so[kw * span + jc];
                    }
                    out[qo + col] = (acc * inv) as bf16;
                }
            }
            // The partials are rewritten by the next pass.
            sync_threads();
        }
    }
}

/// CPU reference of [`GqaAttention`] in f64 (returned as f32), the math of the engine's CPU
/// `gqa_attention`: `q` `[rows, heads * head_dim]`, `k` / `v` `[keys, kv_heads * head_dim]`;
/// returns `[rows, heads * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    rows: usize,
    keys: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let (hd, group, kv_stride) = (head_dim, heads / kv_heads, kv_heads * head_dim);
    let mut out = vec![0f32; rows * heads * hd];
    if keys == 0 {
        return out;
    }
    for t in 0..rows {
        for h in 0..heads {
            let kv = h / group * hd;
            let qh = &q[(t * heads + h) * hd..][..hd];
            let s: Vec<f64> = (0..keys)
                .map(|j| {
                    let kr = &k[j * kv_stride + kv..][..hd];
                    scale as f64 * qh.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let pr: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let l: f64 = pr.iter().sum();
            let mut o = vec![0f64; hd];
            for (j, pj) in pr.iter().enumerate() {
                for (oc, x) in o.iter_mut().zip(&v[j * kv_stride + kv..][..hd]) {
                    *oc += pj / l * *x as f64;
                }
            }
            for (dst, x) in out[(t * heads + h) * hd..][..hd].iter_mut().zip(o) {
                *dst = x as f32;
            }
        }
    }
    out
}
