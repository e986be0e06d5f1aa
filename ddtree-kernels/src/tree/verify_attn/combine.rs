//! The merges of the split partials: [`MlaVerifyCombine`] and, fused with the absorbed output
//! projection, [`MlaCombineOutput`].

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

use crate::common::warp_sum;
use crate::gemv::dot2;

/// The largest split log-sum-exp of row `r` (`part_lse` `[splits, rows]`), the lanes loading 32
/// splits at a time (one L2 round trip per 32 splits); every lane gets it.
#[device_fn]
fn splits_max_lse(part_lse: &[f32], rows: u32, splits: u32, r: u32) -> f32 {
    let lane = lane_id();
    let mut m = f32::NEG_INFINITY;
    for s0 in (0..splits).step_by(32) {
        if s0 + lane < splits {
            m = m.max(part_lse[(s0 + lane) * rows + r]);
        }
    }
    m = m.max(shfl_xor(m, 16u32));
    m = m.max(shfl_xor(m, 8u32));
    m = m.max(shfl_xor(m, 4u32));
    m = m.max(shfl_xor(m, 2u32));
    m.max(shfl_xor(m, 1u32))
}

/// Split `sidx`'s log-sum-exp of row `r`, or `-inf` past the last split (weight 0: its partial
/// is not read).
#[device_fn]
fn split_lse(part_lse: &[f32], rows: u32, splits: u32, sidx: u32, r: u32) -> f32 {
    if sidx < splits {
        part_lse[sidx * rows + r]
    } else {
        f32::NEG_INFINITY
    }
}

/// The factor that moves sums taken under maximum `m` to the larger maximum `to`:
/// `exp(m - to)`, or 0 while `m` is `-inf` (nothing summed yet; the sums are zero).
#[device_fn]
fn merge_weight(m: f32, to: f32) -> f32 {
    if m == f32::NEG_INFINITY {
        0.0f32
    } else {
        (m - to).exp()
    }
}

/// Warps of [`MlaVerifyCombine`]'s blocks.
const COMBINE_WARPS: u32 = 8;

/// Splits each warp of [`MlaCombineOutput`] loads per round, all before it uses any.
const COMBINE_UNROLL: u32 = 4;

/// Splits each thread of [`MlaVerifyCombine`] loads per round, all before it uses any.
const MERGE_UNROLL: u32 = 8;

/// How [`MlaVerifyCombine`] lays its threads over `splits` splits, as `(lsg, lwp)`: a warp's
/// lanes form `2^lsg` split groups of `32 >> lsg` lanes, each lane 8 columns (16 bytes of bf16
/// pairs), so a warp covers a slab of `256 >> lsg` columns, and `2^lwp` warps share each (row,
/// slab) item. A round takes `8 << (lsg + lwp)` splits, so up to 512 splits need one round,
/// one L2 round trip per thread: as many split groups as the splits need (few splits: wide
/// slabs, one warp per item, eight items per block), then more warps per item (the split
/// pass's 132 splits at long contexts: 32-column slabs, four warps per item).
pub fn combine_layout(splits: u32) -> (u32, u32) {
    let n = splits.div_ceil(MERGE_UNROLL).next_power_of_two().trailing_zeros();
    (n.min(3), n.saturating_sub(3).min(3))
}

/// [`MlaVerifyCombine`]'s grid for `rows` rows and the [`combine_layout`] `(lsg, lwp)`: the
/// `rows << (lsg + 1)` items of `2^lwp` warps, eight warps per block.
pub fn combine_grid(rows: u32, (lsg, lwp): (u32, u32)) -> (u32, u32) {
    ((rows << (lsg + 1 + lwp)).div_ceil(COMBINE_WARPS), 1)
}

/// Merges the split partials: grid [`combine_grid`], 256 threads, the thread layout of
/// [`combine_layout`] (`lsg`, `lwp`: `sgs = 2^lsg` split groups per warp, `wpi = 2^lwp` warps
/// per item). A thread loads its 8 columns of the splits `sg + sgs (w + wpi (u + 8 i))` (split
/// group `sg`, warp `w` of its item; round `i`, usually one) with their log-sum-exps, every
/// load of a round issued before any is used, and keeps a running maximum, weight sum and
/// weighted sum (rescaled when a later round raises the maximum). The threads of an item then
/// merge pairwise, each side weighted by `exp(its max - the larger)`: across split groups by
/// shuffles, across warps through shared memory. A split at `-inf` (it saw no key, or lies
/// past the device-side length) has weight 0 and its partial, which may be anything, is never
/// used. Writes `out` (`[rows, 512]` bf16) and `lse` (`[rows]`, natural log; a row without
/// live splits: zeros and `-inf`).
#[kernel(block = 256)]
#[allow(clippy::too_many_arguments)]
pub fn mla_verify_combine(
    part_o: &[u32],
    part_lse: &[f32],
    out: &mut [bf16],
    lse: &mut [f32],
    rows: u32,
    splits: u32,
    lsg: u32,
    lwp: u32,
) {
    let lane = lane_id();
    let warp = warp_id();
    let sgs = 1u32 << lsg;
    let wpi = 1u32 << lwp;
    let lcl = 5 - lsg;
    let cl = 1u32 << lcl;
    let sg = lane >> lcl;
    let items = rows << (lsg + 1);
    let item = (block_idx_x() << (3 - lwp)) + (warp >> lwp);
    let sub = warp & (wpi - 1);
    let it = item.min(items - 1);
    let r = it >> (lsg + 1);
    let col = ((it & (2 * sgs - 1)) << (lcl + 3)) + 8 * (lane & (cl - 1));
    let step = sgs * wpi;
    let mut m = f32::NEG_INFINITY;
    let mut wsum = 0.0f32;
    let mut o = [0.0f32; 8];
    let mut ls = [0.0f32; MERGE_UNROLL];
    let mut pv = [0u32; 4 * MERGE_UNROLL];
    for s0 in (sg + sgs * sub..splits).step_by(step * MERGE_UNROLL) {
        #[unroll]
        for u in 0..MERGE_UNROLL {
            let s = s0 + u * step;
            ls[u] = split_lse(part_lse, rows, splits, s, r);
            if s < splits {
                let v = part_o.vload(((s * rows + r) * 512 + col) / 2);
                pv[4 * u] = v.x;
                pv[4 * u + 1] = v.y;
                pv[4 * u + 2] = v.z;
                pv[4 * u + 3] = v.w;
            }
        }
        let mut mr = m;
        #[unroll]
        for u in 0..MERGE_UNROLL {
            mr = mr.max(ls[u]);
        }
        // Rescale what earlier rounds summed to the new maximum.
        let f = merge_weight(m, mr);
        wsum *= f;
        #[unroll]
        for e in 0..8 {
            o[e] *= f;
        }
        m = mr;
        #[unroll]
        for u in 0..MERGE_UNROLL {
            if ls[u] != f32::NEG_INFINITY {
                let w = (ls[u] - m).exp();
                wsum += w;
                #[unroll]
                for e in 0..4 {
                    o[2 * e] += w * bf16_lo(pv[4 * u + e]);
                    o[2 * e + 1] += w * bf16_hi(pv[4 * u + e]);
                }
            }
        }
    }
    // Across the split groups (lanes `cl` apart): pairwise merges by shuffles.
    #[unroll]
    for b in 0..3 {
        let off = cl << b;
        if off < 32 {
            let mo = shfl_xor(m, off);
            let wo = shfl_xor(wsum, off);
            let mm = m.max(mo);
            let fa = merge_weight(m, mm);
            let fb = merge_weight(mo, mm);
            wsum = wsum * fa + wo * fb;
            #[unroll]
            for e in 0..8 {
                o[e] = o[e] * fa + shfl_xor(o[e], off) * fb;
            }
            m = mm;
        }
    }
    // Across the item's warps: split group 0 of each warp through shared memory.
    let so = shared::<f32>(COMBINE_WARPS * 256);
    let sm = shared::<f32>(COMBINE_WARPS);
    let sw = shared::<f32>(COMBINE_WARPS);
    if sg == 0 {
        #[unroll]
        for e in 0..8 {
            so[warp * 256 + lane * 8 + e] = o[e];
        }
        if lane == 0 {
            sm[warp] = m;
            sw[warp] = wsum;
        }
    }
    sync_threads();
    if sub == 0 && sg == 0 && item < items {
        let mut mt = f32::NEG_INFINITY;
        for wi in warp..warp + wpi {
            mt = mt.max(sm[wi]);
        }
        let mut ws = 0.0f32;
        let mut ot = [0.0f32; 8];
        for wi in warp..warp + wpi {
            let f = merge_weight(sm[wi], mt);
            ws += f * sw[wi];
            #[unroll]
            for e in 0..8 {
                ot[e] += f * so[wi * 256 + lane * 8 + e];
            }
        }
        let inv = if ws > 0.0f32 { 1.0f32 / ws } else { 0.0f32 };
        #[unroll]
        for e in 0..8 {
            out[r * 512 + col + e] = (ot[e] * inv) as bf16;
        }
        if col == 0 {
            lse[r] = mt + ws.ln();
        }
    }
}

/// Compile-time parameters of [`MlaCombineOutput`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct CombineOutputParams {
    /// Warps per block.
    pub warps: u32,
    /// Output columns (rows of the head's `W_UV`) per block; each warp takes `cols / warps`.
    pub cols: u32,
}

/// [`MlaCombineOutput`]'s grid for `tokens` tokens of `heads` heads with `v` output columns
/// each: `(heads * ceil(v / cols), tokens)`.
pub fn combine_output_grid(p: &CombineOutputParams, tokens: u32, heads: u32, v: u32) -> (u32, u32) {
    (heads * v.div_ceil(p.cols), tokens)
}

/// The split partials' merge fused with the absorbed output projection, for a few tokens (the
/// decode step): one block per (token `t`, head `h`, slab of `cols` output columns) merges row
/// `r = t heads + h` of the partials of [`MlaVerifySplit`] / [`MlaVerifyWide`] by their
/// log-sum-exp, as [`MlaVerifyCombine`] does, into a bf16 latent row in shared memory, then
/// computes `out[t, h v + j] = sum_c o_lat[r, c] * kv_b[(h (nope + v) + nope + j) 512 + c]` for
/// its columns (f32 sums, rounded to bf16), so the latent rows never go through global memory
/// and one launch replaces two. `part_o` is `[splits, rows, 512]` bf16 pairs, `part_lse`
/// `[splits, rows]`, `kv_b` `[heads (nope + v), 512]`, `out` `[tokens, heads v]`. Grid:
/// [`combine_output_grid`].
#[kernel(block = p.warps * 32, space = [
    CombineOutputParams { warps: 8, cols: 64 },
    CombineOutputParams { warps: 8, cols: 128 },
    CombineOutputParams { warps: 4, cols: 32 },
])]
#[allow(clippy::too_many_arguments)]
pub fn mla_combine_output(
    #[comptime] p: &CombineOutputParams,
    part_o: &[u32],
    part_lse: &[f32],
    kv_b: &[bf16],
    out: &mut [bf16],
    rows: u32,
    splits: u32,
    heads: u32,
    nope: u32,
    v: u32,
) {
    comptime_assert!(p.warps >= 1 && p.warps <= 8, "warps must be 1..=8");
    comptime_assert!(p.cols % p.warps == 0, "cols must be a multiple of warps");
    let threads = comptime!(p.warps * 32);
    let per = comptime!(p.cols / p.warps);
    let lane = lane_id();
    let warp = warp_id();
    let tid = thread_idx_x();
    let slabs = (v + p.cols - 1) / p.cols;
    let h = block_idx_x() / slabs;
    let j0 = (block_idx_x() % slabs) * p.cols;
    let t = block_idx_y();
    let r = t * heads + h;
    // This warp's columns `j0 + warp per + c`: every weight load issued
    // before any is used, and before waiting for the previous kernel (weights are never written
    // by one).
    let mut w0 = [0u32; 2 * per];
    let mut w1 = [0u32; 2 * per];
    let mut w2 = [0u32; 2 * per];
    let mut w3 = [0u32; 2 * per];
    #[unroll]
    for c in 0..per {
        let j = (j0 + warp * per + c).min(v - 1);
        let wrow = (h * (nope + v) + nope + j) * 512;
        #[unroll]
        for u in 0..2 {
            let wv = kv_b.vload(wrow + (lane + 32 * u) * 8);
            w0[2 * c + u] = wv.x;
            w1[2 * c + u] = wv.y;
            w2[2 * c + u] = wv.z;
            w3[2 * c + u] = wv.w;
        }
    }
    grid_wait();
    grid_launch_dependents();
    let m = splits_max_lse(part_lse, rows, splits, r);
    // Warp `w` sums the splits `w, w + warps, ...`, `COMBINE_UNROLL` of them per round with
    // every load issued before any is used; lane `l` holds the bf16 pairs `8 l .. 8 l + 8` of
    // the row. A split that saw no key has weight 0 and its partial is not read.
    let mut o = [0.0f32; 16];
    let mut wsum = 0.0f32;
    let mut ls = [0.0f32; COMBINE_UNROLL];
    let mut pa = [0u32; 4 * COMBINE_UNROLL];
    let mut pb = [0u32; 4 * COMBINE_UNROLL];
    for s0 in (warp..splits).step_by(p.warps * COMBINE_UNROLL) {
        #[unroll]
        for u in 0..COMBINE_UNROLL {
            ls[u] = split_lse(part_lse, rows, splits, s0 + u * p.warps, r);
        }
        #[unroll]
        for u in 0..COMBINE_UNROLL {
            if ls[u] != f32::NEG_INFINITY {
                let base = ((s0 + u * p.warps) * rows + r) * 256 + lane * 8;
                let x = part_o.vload(base);
                let y = part_o.vload(base + 4);
                pa[4 * u] = x.x;
                pa[4 * u + 1] = x.y;
                pa[4 * u + 2] = x.z;
                pa[4 * u + 3] = x.w;
                pb[4 * u] = y.x;
                pb[4 * u + 1] = y.y;
                pb[4 * u + 2] = y.z;
                pb[4 * u + 3] = y.w;
            }
        }
        #[unroll]
        for u in 0..COMBINE_UNROLL {
            if ls[u] != f32::NEG_INFINITY {
                let w = (ls[u] - m).exp();
                wsum += w;
                #[unroll]
                for e in 0..4 {
                    o[2 * e] += w * bf16_lo(pa[4 * u + e]);
                    o[2 * e + 1] += w * bf16_hi(pa[4 * u + e]);
                    o[8 + 2 * e] += w * bf16_lo(pb[4 * u + e]);
                    o[8 + 2 * e + 1] += w * bf16_hi(pb[4 * u + e]);
                }
            }
        }
    }
    // The warps' sums meet in shared memory; the merged latent row as bf16 pairs.
    let so = shared::<f32>(p.warps * 512);
    let sw = shared::<f32>(p.warps);
    #[unroll]
    for e in 0..16 {
        so[warp * 512 + lane * 16 + e] = o[e];
    }
    if lane == 0 {
        sw[warp] = wsum;
    }
    sync_threads();
    let mut ws = 0.0f32;
    #[unroll]
    for wi in 0..p.warps {
        ws += sw[wi];
    }
    let inv = if ws > 0.0f32 { 1.0f32 / ws } else { 0.0f32 };
    let xs = shared::<u32>(256);
    for pc in (tid..256).step_by(threads) {
        let mut o0 = 0.0f32;
        let mut o1 = 0.0f32;
        #[unroll]
        for wi in 0..p.warps {
            o0 += so[wi * 512 + 2 * pc];
            o1 += so[wi * 512 + 2 * pc + 1];
        }
        xs[pc] = pack_bf16x2(o0 * inv, o1 * inv);
    }
    sync_threads();
    let mut acc = [0.0f32; per];
    #[unroll]
    for u in 0..2 {
        let av = xs.vload((lane + 32 * u) * 4);
        #[unroll]
        for c in 0..per {
            let i = 2 * c + u;
            let s = dot2(acc[c], av.x, w0[i]);
            let s = dot2(s, av.y, w1[i]);
            let s = dot2(s, av.z, w2[i]);
            acc[c] = dot2(s, av.w, w3[i]);
        }
    }
    #[unroll]
    for c in 0..per {
        acc[c] = warp_sum(acc[c]);
    }
    if lane == 0 {
        #[unroll]
        for c in 0..per {
            let j = j0 + warp * per + c;
            if j < v {
                out[t * heads * v + h * v + j] = acc[c] as bf16;
            }
        }
    }
}
