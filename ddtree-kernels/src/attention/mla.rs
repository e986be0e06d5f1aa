//! MLA (multi-head latent attention) at runtime dimensions: the latent-cache append and the
//! absorbed-form attention over the cache.
//!
//! A cache row is `lora + rope` wide: the RMS-normalized latent `c_kv` (`lora`, 512 for Kimi)
//! followed by the roped key part `k_pe` (`rope`, 64 for Kimi). In the absorbed form every
//! query head attends over whole rows (keys) and reads their first `lora` entries as values.
//!
//! [`MlaAttention`] is correct at any `lora` / `rope`: it is the fallback of the fixed-width
//! tensor-core path ([`crate::tree::MlaVerifySplit`], 576-wide rows) and the kernel for tiny test
//! models. One block per `(node, head)`; each warp takes every `warps`-th key (lanes split the
//! dot product over the row, so loads are coalesced), keeps an online softmax and
//! [`MLA_COLS`] output columns per lane, and the warps are merged through shared memory by
//! their maxima. Latents wider than `32 * MLA_COLS` are covered in several passes over the keys.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

use crate::common::{block_sum, warp_sum};
use crate::rms_norm::{scale_bf16x2, sq_bf16x2};
use crate::rope::{rope_first, rope_second};

/// Output columns each lane accumulates per pass of [`MlaAttention`] (`32 * MLA_COLS` = 512
/// columns per pass: one pass for Kimi's latent of 512).
pub const MLA_COLS: u32 = 16;

/// Query values [`MlaAttention`] stages in shared memory (as f32); entries of wider rows are
/// read from global memory.
pub const MLA_Q_SHARED: u32 = 1024;

/// Compile-time parameters of [`MlaKvAppend`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct MlaAppendParams {
    /// Threads per block (one block per appended row).
    pub block: u32,
    /// Load each thread's first 8 latent values with one 128-bit load before the sum and keep
    /// them in registers for the write (needs `lora % 8 == 0` and `rope % 8 == 0`); values past
    /// `8 * block` take the scalar loops.
    pub vec: bool,
}

/// The [`MlaKvAppend`] variant for a latent of `lora` and `rope` rope dims (no tuner key: a
/// fixed rule): the `vec` variant with the fewest threads that still gives every thread one
/// chunk (`8 * block >= lora`) when the widths allow 128-bit loads, else the default.
pub fn choose_append(lora: usize, rope: usize) -> MlaAppendParams {
    let space = <MlaKvAppend as ddtree_codegen::Kernel>::space();
    let vec_ok = lora % 8 == 0 && rope % 8 == 0;
    space
        .iter()
        .filter(|p| vec_ok && p.vec && 8 * p.block as usize >= lora)
        .min_by_key(|p| p.block)
        .copied()
        .unwrap_or(space[0])
}

/// Appends `rows` latent-cache rows: input row `t` of `kv_a` (`[rows, lora + rope]`) becomes
/// cache row `lens[0] + t` of `cache` (`[capacity, lora + rope]`; the cache length before the
/// append is read on the device, so a recorded CUDA graph appends at the current length). Its first `lora` values are
/// RMS-normalized in f32 (`inv = 1 / sqrt(mean(x^2) + eps)`, `out = norm * (x * inv)`); its last
/// `rope` values are rotated to `positions[t]` by interleaved RoPE: pair `(2i, 2i + 1)` by
/// frequency `i`, `x0' = x0 c - x1 s`, `x1' = x1 c + x0 s` with `c = cos[pos * rope / 2 + i]`
/// and `s = sin[..]` (tables `[max_pos, rope / 2]` f32, YaRN folded in). Each value is
/// rounded to bf16 once. `rope` must be even. Grid: `rows`.
#[kernel(block = p.block, space = [
    MlaAppendParams { block: 128, vec: false },
    MlaAppendParams { block: 64, vec: false },
    MlaAppendParams { block: 256, vec: false },
    MlaAppendParams { block: 64, vec: true },
    MlaAppendParams { block: 32, vec: true },
    MlaAppendParams { block: 128, vec: true },
])]
#[allow(clippy::too_many_arguments)]
pub fn mla_kv_append(
    #[comptime] p: &MlaAppendParams,
    kv_a: &[bf16],
    norm: &[bf16],
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
    cache: &mut [bf16],
    lens: &[u32],
    rows: u32,
    lora: u32,
    rope: u32,
    eps: f32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32 and at most 1024"
    );
    let t = block_idx_x();
    if t < rows {
        let tid = thread_idx_x();
        let w = lora + rope;
        let src = t * w;
        let dst = (lens[0] + t) * w;
        let mut ss = 0.0f32;
        let mut hv = [0u32; 4];
        // Latent values from `first` on take the scalar loops (all of them without `vec`).
        let mut first = 0u32;
        if p.vec {
            first = (lora / 8).min(p.block) * 8;
            if tid < lora / 8 {
                let v = kv_a.vload(src + tid * 8);
                hv[0] = v.x;
                hv[1] = v.y;
                hv[2] = v.z;
                hv[3] = v.w;
                ss = sq_bf16x2(v.x) + sq_bf16x2(v.y) + sq_bf16x2(v.z) + sq_bf16x2(v.w);
            }
        }
        for i in (first + tid..lora).step_by(p.block) {
            let v = kv_a[src + i] as f32;
            ss += v * v;
        }
        let inv = 1.0f32 / (block_sum(ss) / (lora as f32) + eps).sqrt();
        if p.vec {
            if tid < lora / 8 {
                let g = norm.vload(tid * 8);
                let mut o = g;
                o.x = scale_bf16x2(hv[0], g.x, inv);
                o.y = scale_bf16x2(hv[1], g.y, inv);
                o.z = scale_bf16x2(hv[2], g.z, inv);
                o.w = scale_bf16x2(hv[3], g.w, inv);
                cache.vstore(dst + tid * 8, o);
            }
        }
        for i in (first + tid..lora).step_by(p.block) {
            cache[dst + i] = ((norm[i] as f32) * ((kv_a[src + i] as f32) * inv)) as bf16;
        }
        let half = rope / 2;
        let pos = positions[t];
        for i in (tid..half).step_by(p.block) {
            let c = cos[pos * half + i];
            let s = sin[pos * half + i];
            let at = lora + 2 * i;
            let x0 = kv_a[src + at] as f32;
            let x1 = kv_a[src + at + 1] as f32;
            cache[dst + at] = rope_first(x0, x1, c, s) as bf16;
            cache[dst + at + 1] = rope_second(x0, x1, c, s) as bf16;
        }
    }
}

/// CPU reference of [`MlaKvAppend`] in f32: the `rows` cache rows (`[rows, lora + rope]`) the
/// kernel writes for `kv_a` (`[rows, lora + rope]`).
#[allow(clippy::too_many_arguments)]
pub fn append_reference(
    kv_a: &[f32],
    norm: &[f32],
    positions: &[u32],
    cos: &[f32],
    sin: &[f32],
    lora: usize,
    rope: usize,
    eps: f32,
) -> Vec<f32> {
    let (w, half) = (lora + rope, rope / 2);
    let mut out = Vec::with_capacity(kv_a.len());
    for (src, &pos) in kv_a.chunks(w).zip(positions) {
        let ms = src[..lora].iter().map(|v| v * v).sum::<f32>() / lora as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        out.extend(src[..lora].iter().zip(norm).map(|(x, g)| g * (x * inv)));
        let pos = pos as usize;
        for i in 0..half {
            let (c, s) = (cos[pos * half + i], sin[pos * half + i]);
            let (x0, x1) = (src[lora + 2 * i], src[lora + 2 * i + 1]);
            out.extend([x0 * c - x1 * s, x1 * c + x0 * s]);
        }
    }
    out
}

/// Compile-time parameters of [`MlaAttention`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct MlaAttnParams {
    /// Threads per block (one block per `(node, head)`; one warp per key at a time).
    pub block: u32,
}

/// Absorbed-MLA attention over a latent cache at any `lora` / `rope` (see the module docs).
///
/// `q` is `[nodes, heads, lora + rope]`, `cache` holds `prefix + nodes` rows of `lora + rope`
/// (`prefix = lens[0]`, read on the device so that a recorded CUDA graph sees the current length)
/// (keys are whole rows, values their first `lora` entries). Node `t` sees every prefix row and
/// the new row `prefix + j` iff bit `j % 32` of `mask[t * words + j / 32]` is set (the tree
/// mask of [`crate::tree::MlaVerifySplit`]; a causal chain is [`crate::tree::chain_mask`]).
/// Scores `q . k * scale` in f32, softmax over the visible keys, `out` (`[nodes, heads, lora]`
/// bf16) the probability-weighted sum of values; a row that sees no key gets zeros.
/// Grid: `nodes * heads` (block `b` is node `b / heads`, head `b % heads`).
#[kernel(block = p.block, space = [
    MlaAttnParams { block: 128 },
    MlaAttnParams { block: 64 },
    MlaAttnParams { block: 256 },
])]
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    #[comptime] p: &MlaAttnParams,
    q: &[bf16],
    cache: &[bf16],
    mask: &[u32],
    out: &mut [bf16],
    lens: &[u32],
    heads: u32,
    nodes: u32,
    words: u32,
    lora: u32,
    rope: u32,
    scale: f32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 256,
        "block must be a multiple of 32 and at most 256 (the per-warp partials fill shared memory)"
    );
    let nw = p.block / 32;
    let span = 32 * MLA_COLS;
    let r = block_idx_x();
    let node = r / heads;
    let w = lora + rope;
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let prefix = lens[0];
    let total = prefix + nodes;
    let sq = shared::<f32>(MLA_Q_SHARED);
    let so = shared::<f32>(nw * span);
    let sm = shared::<f32>(nw);
    let sl = shared::<f32>(nw);
    for d in (tid..w.min(MLA_Q_SHARED)).step_by(p.block) {
        sq[d] = q[r * w + d] as f32;
    }
    sync_threads();
    for c0 in (0..lora).step_by(span) {
        let mut o = [0.0f32; MLA_COLS];
        let mut m = f32::NEG_INFINITY;
        let mut l = 0.0f32;
        for key in (warp..total).step_by(nw) {
            let j = key - prefix;
            let vis = key < prefix || ((mask[node * words + j / 32] >> (j % 32)) & 1) == 1;
            if vis {
                let row = key * w;
                let mut d = 0.0f32;
                for i in (lane..w).step_by(32) {
                    let qv = if i < MLA_Q_SHARED { sq[i] } else { q[r * w + i] as f32 };
                    d += qv * (cache[row + i] as f32);
                }
                let s = warp_sum(d) * scale;
                let mn = m.max(s);
                let alpha = (m - mn).exp();
                let pr = (s - mn).exp();
                l = l * alpha + pr;
                #[unroll]
                for c in 0..MLA_COLS {
                    let col = c0 + c * 32 + lane;
                    if col < lora {
                        o[c] = o[c] * alpha + pr * (cache[row + col] as f32);
                    }
                }
                m = mn;
            }
        }
        #[unroll]
        for c in 0..MLA_COLS {
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
        for k in 0..nw {
            mt = mt.max(sm[k]);
        }
        let mut wt = [0.0f32; nw];
        let mut lt = 0.0f32;
        #[unroll]
        for k in 0..nw {
            if sm[k] != f32::NEG_INFINITY {
                wt[k] = (sm[k] - mt).exp();
            }
            lt += wt[k] * sl[k];
        }
        let inv = if lt > 0.0f32 { 1.0f32 / lt } else { 0.0f32 };
        for jc in (tid..span).step_by(p.block) {
            let col = c0 + jc;
            if col < lora {
                let mut v = 0.0f32;
                #[unroll]
                for k in 0..nw {
                    v += wt[k] * so[k * span + jc];
                }
                out[r * lora + col] = (v * inv) as bf16;
            }
        }
        // The partials are rewritten by the next pass.
        sync_threads();
    }
}

/// CPU reference of [`MlaAttention`] in f64 (returned as f32): `q` `[nodes, heads, lora + rope]`,
/// `cache` `[prefix + nodes, lora + rope]`, `mask` `[nodes, words]`; returns
/// `[nodes, heads, lora]` (zeros for a row that sees no key).
#[allow(clippy::too_many_arguments)]
pub fn attention_reference(
    q: &[f32],
    cache: &[f32],
    mask: &[u32],
    heads: usize,
    prefix: usize,
    nodes: usize,
    words: usize,
    lora: usize,
    rope: usize,
    scale: f32,
) -> Vec<f32> {
    let w = lora + rope;
    let mut out = vec![0f32; nodes * heads * lora];
    for t in 0..nodes {
        let keys: Vec<usize> = (0..prefix)
            .chain(
                (0..nodes)
                    .filter(|&j| mask[t * words + j / 32] >> (j % 32) & 1 == 1)
                    .map(|j| prefix + j),
            )
            .collect();
        if keys.is_empty() {
            continue;
        }
        for h in 0..heads {
            let r = t * heads + h;
            let qr = &q[r * w..][..w];
            let s: Vec<f64> = keys
                .iter()
                .map(|&k| {
                    let dot: f64 = qr
                        .iter()
                        .zip(&cache[k * w..][..w])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    dot * scale as f64
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let pr: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let l: f64 = pr.iter().sum();
            let mut o = vec![0f64; lora];
            for (pk, &k) in pr.iter().zip(&keys) {
                for (oc, v) in o.iter_mut().zip(&cache[k * w..][..lora]) {
                    *oc += pk / l * *v as f64;
                }
            }
            for (dst, v) in out[r * lora..][..lora].iter_mut().zip(o) {
                *dst = v as f32;
            }
        }
    }
    out
}
