//! Accept and compaction kernels: the greedy walk, per-node sampling for temperature > 0
//! (Gumbel-max with the counter-based noise of [`super::reference::uniform`]), the copy of
//! accepted rows (latent cache of every layer, drafter hidden states) to contiguous slots, and
//! the staging of a built tree as the verify forward's inputs.

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

/// Greedy accept in one block (grid 1): node `i > 0` matches when `token[i] ==
/// target[parent[i]]`, and is accepted when it and all its ancestors match (siblings have
/// distinct tokens, so the accepted nodes are one path from the root: the walk along the child
/// whose token equals `target[cur]`). `n` is the node count (the builder's
/// [`super::tree_size`], known on the host); every node's words are loaded in one round, so the
/// block waits for memory once. Writes the accepted node indices by depth (root first) to
/// `accepted`, the target's token at each of them to `path_target` (the tokens the round emits:
/// the accepted drafted tokens, then the bonus), their count to `accept_len[0]` and the next
/// bonus token (the target's token at the deepest accepted node) to `bonus[0]` (which may be the
/// next build's root buffer). Needs `1 <= n <= 1025`.
#[kernel(block = 256)]
#[allow(clippy::too_many_arguments)]
pub fn tree_accept(
    token: &[u32],
    parent: &[i32],
    depth: &[u32],
    target: &[u32],
    accepted: &mut [u32],
    path_target: &mut [u32],
    accept_len: &mut [u32],
    bonus: &mut [u32],
    n: u32,
) {
    let ok = shared::<u32>(1025);
    let par = shared::<u32>(1025);
    let tg = shared::<u32>(1025);
    let deepest = shared::<u32>(1);
    let tid = thread_idx_x();
    if tid == 0 {
        deepest[0] = 0u32;
    }
    // Node tid + 256 q of each thread: token, parent and depth in registers, parent and
    // target in shared memory.
    let mut tk = [0u32; 5];
    let mut pa = [0u32; 5];
    let mut dp = [0u32; 5];
    #[unroll]
    for q in 0..5u32 {
        let i = tid + 256u32 * q;
        if i < n {
            tk[q] = token[i];
            pa[q] = if i == 0 { 0u32 } else { parent[i] as u32 };
            dp[q] = depth[i];
            par[i] = pa[q];
            tg[i] = target[i];
        }
    }
    sync_threads();
    #[unroll]
    for q in 0..5u32 {
        let i = tid + 256u32 * q;
        if i < n {
            ok[i] = if i == 0 || tk[q] == tg[pa[q]] { 1u32 } else { 0u32 };
        }
    }
    sync_threads();
    #[unroll]
    for q in 0..5u32 {
        let i = tid + 256u32 * q;
        if i < n {
            let mut a = i;
            let mut good = ok[i] == 1u32;
            while good && a != 0 {
                a = par[a];
                good = ok[a] == 1u32;
            }
            if good {
                let d = dp[q];
                accepted[d] = i;
                path_target[d] = tg[i];
                deepest.atomic_max(0, (d << 11) | i);
            }
        }
    }
    sync_threads();
    if tid == 0 {
        let dn = deepest[0];
        accept_len[0] = (dn >> 11) + 1;
        bonus[0] = tg[dn & 2047u32];
    }
}

/// The murmur3 finalizer (as [`super::reference::fmix32`]).
#[device_fn]
fn fmix32(x: u32) -> u32 {
    let mut h = x;
    h = h ^ (h >> 16);
    h = h * 0x85ebca6bu32;
    h = h ^ (h >> 13);
    h = h * 0xc2b2ae35u32;
    h ^ (h >> 16)
}

/// Compile-time parameters of [`TreeSample`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct SampleParams {
    /// Threads per block (one block per node).
    pub block: u32,
}

/// One sample per row of `logits` (`[rows, vocab]`, grid = rows) from
/// `softmax(logits / temperature)`: the argmax of `x / temperature + Gumbel(seed, row, id)`,
/// equal scores by smaller id (as [`super::reference::sample_rows`]).
#[kernel(block = p.block, space = [SampleParams { block: 1024 }, SampleParams { block: 512 }])]
pub fn tree_sample(
    #[comptime] p: &SampleParams,
    logits: &[f32],
    out: &mut [u32],
    vocab: u32,
    temperature: f32,
    seed: u32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32, at most 1024"
    );
    let row = block_idx_x();
    let tid = thread_idx_x();
    let mut bv = f32::NEG_INFINITY;
    let mut bi = u32::MAX;
    let hr = row * 0x9e3779b9u32;
    for i in (tid..vocab).step_by(p.block) {
        let h = fmix32(fmix32(fmix32(i) ^ hr) ^ seed);
        let u = (((h >> 8) as f32) + 0.5f32) * 0.000000059604645f32;
        let g = logits[row * vocab + i] / temperature - (-(u.ln())).ln();
        if g > bv || bi == u32::MAX {
            bv = g;
            bi = i;
        }
    }
    let wv = shared::<f32>(32);
    let wi = shared::<u32>(32);
    #[unroll]
    for o in 0..5u32 {
        let ov = shfl_xor(bv, 16u32 >> o);
        let oi = shfl_xor(bi, 16u32 >> o);
        if ov > bv || (ov == bv && oi < bi) {
            bv = ov;
            bi = oi;
        }
    }
    if lane_id() == 0 {
        wv[warp_id()] = bv;
        wi[warp_id()] = bi;
    }
    sync_threads();
    if tid == 0 {
        let mut v = wv[0];
        let mut ix = wi[0];
        for w in 1..p.block / 32 {
            if wv[w] > v || (wv[w] == v && wi[w] < ix) {
                v = wv[w];
                ix = wi[w];
            }
        }
        out[row] = ix;
    }
}

/// Compaction (grid = layers, 128 threads): in every layer `l`, row `base + accepted[i]` is
/// copied to row `base + i` for `i < accept_len[0]`, rows of `row_len` bf16 (a multiple of 8)
/// at `l * layer_stride`. Rows are copied in order, so the in-place copy is safe
/// (`accepted[i] >= i`). Used for the latent cache (row_len 576) and the drafter hidden states.
#[kernel(block = 128)]
pub fn compact_rows(
    buf: &mut [bf16],
    accepted: &[u32],
    accept_len: &[u32],
    base: u32,
    row_len: u32,
    layer_stride: u32,
) {
    let lbase = block_idx_x() * layer_stride;
    let len = accept_len[0];
    for i in 1..len {
        let src = accepted[i];
        if src != i {
            let from = lbase + (base + src) * row_len;
            let to = lbase + (base + i) * row_len;
            for c in (thread_idx_x()..row_len / 8).step_by(128) {
                let v = buf.vload(from + c * 8);
                buf.vstore(to + c * 8, v);
            }
        }
        sync_threads();
    }
}

/// Stages the first `n` nodes of a built tree as the verify forward's inputs (grid
/// `ceil(n * words / 256)`, at least `ceil(n / 256)`): for node `i < n`, `tokens[i] = token[i]`
/// and `positions[i] = start + depth[i]`, and the first `words = ceil(n / 32)` words of each of
/// the first `n` mask rows, whose stride in `mask` is `in_words` (the builder's rows hold
/// `ceil(nodes / 32)` words for the `nodes >= n` it built; the first `n` nodes of a best-first
/// tree are its top-`(n - 1)` tree, with ancestors among them). The CPU reference is the
/// (truncated) tree itself: [`super::DraftTree::token`], [`super::DraftTree::positions`] and
/// [`super::DraftTree::mask`].
#[kernel(block = 256)]
#[allow(clippy::too_many_arguments)]
pub fn tree_stage(
    token: &[u32],
    depth: &[u32],
    mask: &[u32],
    tokens: &mut [u32],
    positions: &mut [u32],
    mask_out: &mut [u32],
    n: u32,
    words: u32,
    in_words: u32,
    start: u32,
) {
    let i = block_idx_x() * 256u32 + thread_idx_x();
    if i < n {
        tokens[i] = token[i];
        positions[i] = start + depth[i];
    }
    if i < n * words {
        mask_out[i] = mask[i / words * in_words + i % words];
    }
}
