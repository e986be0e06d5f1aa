//! DeepSeek-V3 `noaux_tc` MoE routing, one block per token, exactly as the engine's CPU backend:
//!
//! 1. `score = sigmoid(logit)`, `choice = score + bias` (the correction bias only steers the
//!    choice);
//! 2. with `n_group > 1`: each group's score is the sum of its two largest choices; the
//!    `topk_group` best groups are kept and the choices of the others set to `0.0` (HF masks with
//!    zero, not `-inf`, so a dropped expert can still beat kept experts with negative choices);
//! 3. the `topk` largest choices win (ties to the lower expert index), best first;
//! 4. weights are the winners' unbiased scores, divided by `sum + 1e-20` when `norm != 0`
//!    (summed in selection order), then times `scale`.
//!
//! Comparisons use the total order of `f32::total_cmp` (through an order-preserving map of the
//! bits to `u32`). The selection is `topk` rounds of a block argmax: each thread holds its
//! experts' keys in registers, a warp shuffle argmax and one barrier per round pick the winner.

use ddtree_macros::{kernel, KernelParams};

use crate::common::order_key;

/// This family's checks (re-exported by [`crate::check`]).
pub mod check;
pub mod localize;
pub mod op;

pub use localize::{MoeLocalize, MoeLocalizeParams};

/// Most experts [`MoeRoute`] handles (Kimi K2: 384).
pub const MAX_EXPERTS: u32 = 1024;
/// Most experts chosen per token.
pub const MAX_TOPK: u32 = 16;
/// Most expert groups.
pub const MAX_GROUPS: u32 = 32;

/// Compile-time parameters of [`MoeRoute`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct MoeRouteParams {
    /// Threads per block (one block per token); a power of two from 32 to 1024 (each thread
    /// holds `1024 / block` experts in registers).
    pub block: u32,
}

/// Routes each token (grid = tokens): `logits` `[tokens, experts]` f32, `bias` `[experts]`;
/// writes the chosen experts, best first, to `ids` and their weights to `weights` (both
/// `[tokens, topk]`). Needs `experts <= 1024`, `1 <= topk <= min(16, experts)`, and with
/// `n_group > 1`: `experts % n_group == 0`, `n_group <= 32`, `topk_group <= n_group`.
#[kernel(block = p.block, space = [
    MoeRouteParams { block: 256 },
    MoeRouteParams { block: 128 },
    MoeRouteParams { block: 512 },
    MoeRouteParams { block: 1024 },
])]
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    #[comptime] p: &MoeRouteParams,
    logits: &[f32],
    bias: &[f32],
    ids: &mut [u32],
    weights: &mut [f32],
    experts: u32,
    topk: u32,
    n_group: u32,
    topk_group: u32,
    norm: u32,
    scale: f32,
) {
    comptime_assert!(
        p.block >= 32 && p.block <= MAX_EXPERTS && MAX_EXPERTS % p.block == 0,
        "block must be a power of two from 32 to 1024"
    );
    let per = MAX_EXPERTS / p.block;
    let nw = p.block / 32;
    let tok = block_idx_x();
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let sc = shared::<f32>(MAX_EXPERTS);
    let ch = shared::<f32>(MAX_EXPERTS);
    let gs = shared::<f32>(MAX_GROUPS);
    let keep = shared::<u32>(MAX_GROUPS);
    let wk = shared::<u32>(2 * 32);
    let wi = shared::<u32>(2 * 32);
    let sel = shared::<u32>(MAX_TOPK);
    for e in (tid..experts).step_by(p.block) {
        let x = logits[tok * experts + e];
        let s = 1.0f32 / (1.0f32 + (-x).exp());
        sc[e] = s;
        ch[e] = s + bias[e];
    }
    sync_threads();
    let grouped = n_group > 1;
    let per_group = experts / n_group.max(1);
    if grouped {
        // Group scores: the sum of each group's two largest choices (one warp per group).
        for g in (warp..n_group).step_by(nw) {
            let mut a1 = f32::NEG_INFINITY;
            let mut a2 = f32::NEG_INFINITY;
            for i in (lane..per_group).step_by(32) {
                let v = ch[g * per_group + i];
                if v > a1 {
                    a2 = a1;
                    a1 = v;
                } else if v > a2 {
                    a2 = v;
                }
            }
            #[unroll]
            for s in 0..5u32 {
                let b1 = shfl_xor(a1, 16u32 >> s);
                let b2 = shfl_xor(a2, 16u32 >> s);
                let lo = a1.min(b1);
                a1 = a1.max(b1);
                a2 = lo.max(a2.max(b2));
            }
            if lane == 0 {
                gs[g] = if per_group >= 2 { a1 + a2 } else { a1 };
            }
        }
        sync_threads();
        // Warp 0 keeps the `topk_group` best groups (lane g holds group g).
        if warp == 0 {
            let valid = lane < n_group;
            let mut gk = 0u32;
            if valid {
                gk = order_key(gs[lane]);
            }
            let mut kept = false;
            for _r in 0..topk_group {
                let mut bk = 0u32;
                let mut bi = u32::MAX;
                if valid && !kept {
                    bk = gk;
                    bi = lane;
                }
                #[unroll]
                for s in 0..5u32 {
                    let ok = shfl_xor(bk, 16u32 >> s);
                    let oi = shfl_xor(bi, 16u32 >> s);
                    if ok > bk || (ok == bk && oi < bi) {
                        bk = ok;
                        bi = oi;
                    }
                }
                if bi == lane {
                    kept = true;
                }
            }
            if valid {
                keep[lane] = if kept { 1u32 } else { 0u32 };
            }
        }
        sync_threads();
    }
    // This thread's experts `j * block + tid` as order keys; absent ones start taken.
    let mut key = [0u32; per];
    let mut taken = 0u32;
    #[unroll]
    for j in 0..per {
        let e = j * p.block + tid;
        if e < experts {
            let mut v = ch[e];
            if grouped && keep[e / per_group] == 0 {
                v = 0.0f32;
            }
            key[j] = order_key(v);
        } else {
            taken |= 1u32 << j;
        }
    }
    for r in 0..topk {
        let mut bk = 0u32;
        let mut bi = u32::MAX;
        #[unroll]
        for j in 0..per {
            if ((taken >> j) & 1) == 0 && key[j] > bk {
                bk = key[j];
                bi = j * p.block + tid;
            }
        }
        #[unroll]
        for s in 0..5u32 {
            let ok = shfl_xor(bk, 16u32 >> s);
            let oi = shfl_xor(bi, 16u32 >> s);
            if ok > bk || (ok == bk && oi < bi) {
                bk = ok;
                bi = oi;
            }
        }
        // Two buffers: round r + 1 writes the other one while slow threads still read this one.
        let buf = (r % 2) * 32;
        if lane == 0 {
            wk[buf + warp] = bk;
            wi[buf + warp] = bi;
        }
        sync_threads();
        let mut gk = wk[buf];
        let mut gi = wi[buf];
        #[unroll]
        for w in 1..nw {
            let ok = wk[buf + w];
            let oi = wi[buf + w];
            if ok > gk || (ok == gk && oi < gi) {
                gk = ok;
                gi = oi;
            }
        }
        if gi % p.block == tid {
            taken |= 1u32 << (gi / p.block);
        }
        if tid == 0 {
            sel[r] = gi;
        }
    }
    sync_threads();
    if tid < topk {
        let e = sel[tid];
        let mut sum = 0.0f32;
        for i in 0..topk {
            sum += sc[sel[i]];
        }
        let mut wgt = sc[e];
        if norm != 0 {
            wgt = wgt / (sum + 1e-20f32);
        }
        ids[tok * topk + tid] = e;
        weights[tok * topk + tid] = wgt * scale;
    }
}

/// Indices of the `k` largest values by `f32::total_cmp`, larger first, ties to the lower index.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// CPU reference of [`MoeRoute`] (the engine CPU backend's `moe_route`): for `logits`
/// `[tokens, experts]`, the chosen experts `[tokens, topk]` (best first) and their weights.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    logits: &[f32],
    bias: &[f32],
    experts: usize,
    topk: usize,
    n_group: usize,
    topk_group: usize,
    norm: bool,
    scale: f32,
) -> (Vec<u32>, Vec<f32>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in logits.chunks(experts) {
        let scores: Vec<f32> = row.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
        let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
        if n_group > 1 {
            let per_group = experts / n_group;
            let group_scores: Vec<f32> = choice
                .chunks(per_group)
                .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
                .collect();
            let kept = top_k(&group_scores, topk_group);
            for (g, chunk) in choice.chunks_mut(per_group).enumerate() {
                if !kept.contains(&g) {
                    chunk.fill(0.0);
                }
            }
        }
        let chosen = top_k(&choice, topk);
        let mut w: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
        if norm {
            let denom = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|x| *x /= denom);
        }
        ids.extend(chosen.iter().map(|&e| e as u32));
        weights.extend(w.iter().map(|x| x * scale));
    }
    (ids, weights)
}
