//! `w4a16_gemv`: the small-token W4A16 path (decode and small trees), one launch per stage,
//! reading the same interleaved weights and scale words as [`super::W4a16Gemm`]:
//!
//! - [`GemvMode::Dense`]: `out[M, N] = x[M, K] * dequant(W)[N, K]^T` for `M <= 8 chunks`;
//! - [`GemvMode::GateUp`]: the routed experts' gate_up with SiLU-and-mul fused, straight from the
//!   device routing (`topk_ids`): one block per (leader pair of an expert, row slab) writes
//!   `act[pair, I]` for every pair routed to that expert;
//! - [`GemvMode::Down`]: the routed experts' down projection with the router weights and the
//!   sum over the top-k slots fused: one block per row slab of the hidden size walks every
//!   distinct local expert of the routing and writes `out[T, H]`. No moe_align, no moe_sum, no
//!   atomics, no split-K reduce launch.
//! - [`GemvMode::GroupedGateUp`] / [`GemvMode::GroupedDown`]: the same two products from
//!   `moe_align`'s blocks (each `8 chunks` slots of one expert) as the grouped GEMM takes them:
//!   one block per (align block, row slab), `act[pair, I]` with SiLU-and-mul, then router-weighted
//!   rows `y[pair, H]` that `moe_sum` adds. An expert with more pairs than a block's slots takes
//!   several blocks, so any token count works with one chunk.
//!
//! Design (bytes in flight per register): the tokens are few, so the weights are the A operand
//! of `mma.m16n8k16` (16 weight rows = two interleaved 8-row tiles) and up to 8 tokens per chunk
//! the B operand. A lane of the interleaved layout holds 32 consecutive k of one row (one g32
//! group), exactly the k permutation the gemm uses, so each lane `cp.async`s its own 16 bytes of
//! every tile into a per-warp shared-memory ring of `stages` k128 steps and later reads back only
//! what it copied itself: no block barrier in the main loop, and the bytes in flight cost shared
//! memory, not registers (a ring of 32 KB per block keeps ~4-6 blocks x 32 KB in flight per SM).
//! The scale words ride a small register ring (plain loads `stages` steps ahead), or with `sr`
//! the shared-memory ring too (a 4-byte `cp.async` per lane and 8-row tile, read back at use:
//! no registers held and no exposed load latency): one bf16 scale per lane, row and k step, of
//! the variant's scale group (`group`: a lane's 32 k lie in one group of 32, 64 or 128; at g64
//! two lanes, at g128 all four load the same word). The warps of a block split the k steps (and,
//! for `Down`, the experts) in contiguous ranges, or with `kw` every `warps`-th step each (the
//! block's warps then read adjacent pieces of each tile together), and their f32 accumulators
//! are summed through the ring's shared memory once at the end.
//!
//! Numerics as the gemm: weights `bf16(q * scale)` (`fma.rn.bf16x2`), f32 products and sums in
//! the mma; `Down` scales each expert's f32 dot products by the router weight in f32 and rounds
//! the token's sum once.

use ddtree_codegen::dsl::*;
use ddtree_macros::kernel;

use super::gemm::{dequant_pair, magic_pair_interleaved};
use crate::common::warp_incl_scan;
use crate::silu_mul::silu;

pub use super::gemv_space::*;

/// `x` bf16 activations (`Dense`: `[m, k]`; gate_up: tokens `[T, k]`; `Down`, `GroupedDown`:
/// `act` `[pairs, k]`), `w` interleaved INT4 weights (experts stacked; `[n, k]` each), `scales`
/// the bf16 `[n, k / group]` scales (stacked) as words ([`super::layout::scale_words`]), `ids` the
/// routing's expert per pair `[T, topk]` (ids `>= experts` belong to other ranks and are
/// skipped), `route_w` its router weights, `sorted` / `block_expert` `moe_align`'s blocks of
/// `8 chunks` slots (grouped modes), `out` (`Dense`: `[m, n]`; gate_up: `act` `[pairs, n / 2]`,
/// rows of non-local pairs not written; `Down`: `[T, n]`; `GroupedDown`: `y` `[pairs, n]`, rows
/// of non-local pairs not written). `m` is the dense rows, gate_up's and `GroupedDown`'s pairs,
/// or `Down`'s tokens. Needs `k % 32 == 0`, `k % group == 0`, gate_up `(n / 2) % 8 == 0`, at most
/// `8 chunks` tokens (`Dense`, `Down`) or pairs per expert (`GateUp`), and `Down` at most
/// [`MAX_PAIRS`] pairs. Unused buffers may be any non-empty buffer. Under programmatic
/// dependent launch, `Down` for one token reads `ids` before it waits for its predecessor: the
/// routing must be written before that one (as [`super::MoeKernels`] launches `GateUp`
/// between). Grid: [`grid`].
#[kernel(block = p.warps * 32, dyn_smem = p.ring_bytes(), min_blocks = p.min_blocks(), space = GEMV_SPACE.to_vec())]
pub fn w4a16_gemv(
    #[comptime] p: &GemvW4Params,
    x: &[bf16],
    w: &[u32],
    scales: &[u32],
    ids: &[u32],
    route_w: &[f32],
    sorted: &[u32],
    block_expert: &[u32],
    out: &mut [bf16],
    m: u32,
    n: u32,
    k: u32,
    topk: u32,
    experts: u32,
) {
    comptime_assert!(
        p.group == 32 || p.group == 64 || p.group == 128,
        "group must be 32, 64 or 128"
    );
    comptime_assert!(p.warps >= 1 && p.warps <= 16, "warps must be 1..=16");
    comptime_assert!(p.mt >= 1 && p.mt <= 4, "mt must be 1..=4");
    comptime_assert!(p.stages >= 1 && p.stages <= 8, "stages must be 1..=8");
    comptime_assert!(p.chunks >= 1 && p.chunks <= 2 * p.stages, "chunks must be 1..=2 stages");
    comptime_assert!(p.chunks <= 4, "chunks must be at most 4");
    let rb = comptime!(p.ring_bytes());
    comptime_assert!(
        rb <= 200 * 1024,
        "the ring must fit in 200 KiB of dynamic shared memory"
    );
    let down = p.mode == GemvMode::Down;
    let gu = comptime!(p.mode.gate_up());
    let grouped = comptime!(p.mode.grouped());
    let gdn = p.mode == GemvMode::GroupedDown;
    // Under programmatic dependent launch: gate_up reads the routing its predecessor
    // (`moe_route` or `moe_align`) writes, `GroupedDown` `moe_align`'s blocks, and `xr`
    // variants copy x in the prologue, so they wait first. The others, for one token (the
    // decode step), issue the prologue's weight and scale copies
    // (`Down`: after reading the routing, written before its predecessor) before they wait for
    // x. On the H200 this and the decode attention's early tiles took 0.3 ms off a Kimi K2.6
    // EP8 decode step; more tokens were not measured, so they wait first. (Two-chunk variants,
    // which serve 9-16 tokens, always do: the early path made ptxas spill in them.)
    let early = !gu && !grouped && !p.xr && p.chunks == 1 && m == 1;
    if !early {
        grid_wait();
        grid_launch_dependents();
    }
    // m16 tiles and 8-row tiles per k step.
    let mtt = comptime!(if p.mode.gate_up() { 2 * p.mt } else { p.mt });
    let tt = comptime!(p.tiles());
    let nc = p.chunks;
    let nw = p.warps;
    let ns = p.stages;
    let cap = 8 * p.chunks;
    let lane = lane_id();
    let wid = warp_id();
    let tid = thread_idx_x();
    let g = lane / 4;
    let q = lane % 4;
    let kbs = (k + 127u32) / 128u32;
    let gpr = k / p.group;
    // Output rows (GateUp: the intermediate size; its up rows start at `rows`).
    let rows = if gu { n / 2 } else { n };
    let r0 = block_idx_x() * 16 * p.mt;
    let wstride = (n + 7u32) / 8u32 * kbs * 128u32;
    // Per warp `stages` steps of `sw` words: tiles at `t * 128`, then (xr) x at `tt * 128`.
    let sw = comptime!(p.stage_words());
    let so = comptime!(p.scale_offset());
    let ring = dyn_shared::<u32>();
    let dn = comptime!(if p.mode == GemvMode::Down { MAX_PAIRS } else { 1 });
    let ln = comptime!(if p.mode == GemvMode::Down {
        MAX_PAIRS
    } else {
        8 * p.chunks
    });
    let on = comptime!(if p.mode == GemvMode::Down { p.mt * p.chunks } else { 1 });
    let ids_s = shared::<u32>(dn);
    let flag_s = shared::<u32>(dn);
    let list = shared::<u32>(ln);
    let count_s = shared::<u32>(1);
    // Down with xr or x loaded ahead (`xpre` below): act row (pair) of token `t` for the
    // `ei`-th expert at `ei * cap + t`, for the lanes that copy other tokens' x slices (xr:
    // u32::MAX = none) or prefetch their own (a row of the expert where the token has none: its
    // column is weighted 0 in the flush, and that row was written by the gate_up pass, so it is
    // finite). (The flush below finds a lane's router weights in registers: fewer registers in
    // the main loop.)
    let pn = comptime!(if p.mode == GemvMode::Down && (p.xr || p.chunks == 1) {
        MAX_PAIRS * 8 * p.chunks
    } else {
        1
    });
    let prow = shared::<u32>(pn);

    // The x row of this lane's B column (`g + 8 c`) per chunk (u32::MAX = none).
    let mut xrow = [0u32; nc];
    #[unroll]
    for c in 0..nc {
        xrow[c] = if g + 8 * c < m { g + 8 * c } else { u32::MAX };
    }
    // Experts this block walks (GateUp: its leader pair's; Down: every distinct local one).
    let mut ne = 1u32;
    let mut expert = 0u32;
    let pairs = if gu { m } else { m * topk };
    // x row of a pair: its token for gate_up, its own act row for down.
    let a_div = if gu { topk } else { 1u32 };
    if p.mode == GemvMode::GateUp {
        // Leader pair of the block: the first pair routed to its expert; others exit.
        let p0 = block_idx_y();
        let e = ids[p0];
        if e >= experts {
            return;
        }
        let mut dup = false;
        for c0 in (0..p0).step_by(32) {
            let pp = c0 + lane;
            if vote_any(pp < p0 && ids[pp.min(p0)] == e) {
                dup = true;
            }
        }
        if dup {
            return;
        }
        expert = e;
        // Members (the pairs routed to `e`, in order) into `list`, by warp 0.
        if wid == 0 {
            if lane < cap {
                list[lane] = u32::MAX;
            }
            sync_warp();
            let mut base = 0u32;
            for c0 in (p0..pairs).step_by(32) {
                let pp = c0 + lane;
                let f = if pp < pairs && ids[pp.min(pairs - 1)] == e {
                    1u32
                } else {
                    0u32
                };
                let s = warp_incl_scan(f);
                if f == 1 && base + s - 1 < cap {
                    list[base + s - 1] = pp;
                }
                base += shfl_idx(s, 31u32);
            }
        }
        sync_threads();
        #[unroll]
        for c in 0..nc {
            let pr = list[g + 8 * c];
            xrow[c] = if pr == u32::MAX { u32::MAX } else { pr / topk };
        }
    }
    if grouped {
        // This block's expert and slots from `moe_align` (unused blocks and padding slots:
        // u32::MAX; experts of other ranks are not in its blocks).
        let b = block_idx_y();
        let e = block_expert[b];
        if e >= experts {
            return;
        }
        expert = e;
        if tid < cap {
            list[tid] = sorted[b * cap + tid];
        }
        sync_threads();
        #[unroll]
        for c in 0..nc {
            let pr = list[g + 8 * c];
            xrow[c] = if pr == u32::MAX { u32::MAX } else { pr / a_div };
        }
    }
    if down {
        // Distinct local experts of the routing, in order of first appearance.
        for pp in (tid..pairs).step_by(nw * 32) {
            ids_s[pp] = ids[pp];
        }
        sync_threads();
        for pp in (tid..pairs).step_by(nw * 32) {
            let e = ids_s[pp];
            let mut lead = e < experts;
            for p2 in 0..pp {
                if ids_s[p2] == e {
                    lead = false;
                }
            }
            flag_s[pp] = if lead { 1u32 } else { 0u32 };
        }
        sync_threads();
        if wid == 0 {
            let mut base = 0u32;
            for c0 in (0..pairs).step_by(32) {
                let pp = c0 + lane;
                let f = if pp < pairs { flag_s[pp] } else { 0u32 };
                let s = warp_incl_scan(f);
                if f == 1 {
                    list[base + s - 1] = ids_s[pp];
                }
                base += shfl_idx(s, 31u32);
            }
            if lane == 0 {
                count_s[0] = base;
            }
        }
        sync_threads();
        ne = count_s[0];
    }
    // Without `xr`, where [`GemvW4Params::x_ahead`] says so: x is loaded one k step ahead into
    // registers from a clamped address (Dense and GateUp: row 0 for unused token columns; Down:
    // a row of the expert, see `prow`; the last 32 k for the K tail): an unused column only
    // feeds its own discarded (or zero-weighted) outputs, and the tail's weights are zero
    // (scale 0). Which variants do: [`GemvW4Params::x_ahead`].
    let xpre = comptime!(p.x_ahead());
    if down && (p.xr || xpre) {
        for idx in (tid..ne * cap).step_by(nw * 32) {
            let e = list[idx / cap];
            let t = idx % cap;
            let mut r = u32::MAX;
            let mut first = u32::MAX;
            for pp in 0..pairs {
                if ids_s[pp] == e {
                    if first == u32::MAX {
                        first = pp;
                    }
                    if pp / topk == t {
                        r = pp;
                    }
                }
            }
            prow[idx] = if xpre && r == u32::MAX { first } else { r };
        }
        sync_threads();
    }

    // This warp's contiguous share of the block's (expert, k step) items.
    let total = ne * kbs;
    let per = (total + nw - 1) / nw;
    // (kw: the items are this warp's own items wid, wid + nw, ... of the block's `total`, counted
    // from 0.)
    let lo = if p.kw { 0u32 } else { (wid * per).min(total) };
    let hi = if p.kw {
        if wid < total {
            (total - wid + nw - 1) / nw
        } else {
            0u32
        }
    } else {
        (lo + per).min(total)
    };
    // An item step moves `dq` experts and `dr` k steps, then wraps at `kbs`. Only `Down` with
    // kw steps across experts (`warps` items, possibly past several experts when `kbs <
    // warps`); the other modes' one expert keeps the constant step and its wrap to 0 (the
    // general form cost the `Dense` kw default 31 registers).
    let dkw = comptime!(p.kw && p.mode == GemvMode::Down);
    let dq = if dkw { nw / kbs } else { 0u32 };
    let dr = if dkw {
        nw % kbs
    } else {
        comptime!(if p.kw { p.warps } else { 1 })
    };
    let cnt = hi - lo;
    let wbase = wid * ns * sw;
    let rbase = wbase + lane * 4;
    // This lane's views of its warp's ring: its weight (and x) words from `rp`, its scale words
    // from `sp` (read with `sr` only). They are pointers, so each slot's and tile's constant offset folds into
    // the shared-memory address (the u32 sums `ring[rbase + ..]` cost an add and a multiply per
    // access).
    let rp = &mut ring[rbase..];
    let sp = &mut ring[wbase + so + lane..];
    // x copies (xr): lane copies 16 bytes (8 k) `s` of token slots `lane / 16 + 2 i` per chunk,
    // stored as `[j][g][q]` 16-byte cells (k = 32 q + 8 j of token g) so each mma's B reads are
    // one conflict-free 512-byte row of the ring.
    let xs = lane % 16;
    let xdst = ((xs % 4) * 32 + lane / 16 * 4 + xs / 4) * 4;
    // Per 8-row tile: this lane's word offset of k step 0 in an expert's weights (row tile 0,
    // a valid address for the zero-filled copy, when the tile is past the output rows), its
    // scale element of k step 0 (row 0's when its row is not an output row: that row's
    // results are dropped, so the scale copies need no row check). A k step holds `128 / group`
    // groups of a row; lane q's 32 k are in its group `q` (g32), `q / 2` (g64) or 0 (g128).
    let mut woff = [0u32; tt];
    let mut soff = [0u32; tt];
    #[unroll]
    for t in 0..tt {
        let mi = t / 2;
        let lr = r0 + 16 * (mi % p.mt) + 8 * (t % 2);
        let grow = if gu && mi >= p.mt { rows + lr } else { lr };
        woff[t] = if lr < rows {
            (grow / 8 * kbs * 32 + lane) * 4
        } else {
            lane * 4
        };
        if p.group == 32 {
            soff[t] = if lr + g < rows { (grow + g) * gpr + q } else { q };
        } else if p.group == 64 {
            soff[t] = if lr + g < rows { (grow + g) * gpr + q / 2 } else { q / 2 };
        } else {
            soff[t] = if lr + g < rows { (grow + g) * gpr } else { 0u32 };
        }
    }
    let mut xbase = [0u32; nc];
    #[unroll]
    for c in 0..nc {
        xbase[c] = if xrow[c] == u32::MAX { 0u32 } else { xrow[c] * k };
    }
    // Two register slots of a k step's x, `[slot][chunk][j]`, alternating with the step slot's
    // parity (an even number of stages keeps the pattern across the unrolled ring).
    let xpn = comptime!(if p.x_ahead() { 8 * p.chunks } else { 1 });
    comptime_assert!(
        xpn == 1 || p.stages % 2 == 0,
        "x loaded a step ahead needs an even number of stages"
    );
    let mut xn = [[0u32; 4]; xpn];

    let mut acc = [[0.0f32; 4]; mtt * nc];
    let mut oacc = [[0.0f32; 4]; on];
    // Register ring of scale words (without `sr`).
    let scn = comptime!(if p.sr { 1 } else { p.stages * p.tiles() });
    let mut sc = [0u32; scn];
    let mut wv = [[0u32; 4]; tt];
    let mut xv = [[0u32; 4]; nc];
    let mut af = [[0u32; 4]; 1];
    let mut bf = [[0u32; 2]; nc];
    let mut cur = u32::MAX;
    // Router weights of the current expert for this lane's output tokens (Down).
    let mut rwt = [0.0f32; 2 * nc];

    // (expert index, k step) of the next item to compute and of the next to copy, stepped
    // without divisions (the item index is `ei * kbs + kb`).
    let first = if p.kw { wid } else { lo };
    let mut cei = first / kbs;
    let mut ckb = first % kbs;
    let mut fei = cei;
    let mut fkb = ckb;

    // Prologue: items lo .. lo + stages into slots 0 .. stages, one cp.async group each.
    #[unroll]
    for u in 0..ns {
        let it = lo + u;
        let ei = fei;
        let kb = fkb;
        fkb += dr;
        fei += dq;
        if fkb >= kbs {
            fkb = if dkw { fkb - kbs } else { 0u32 };
            fei += 1;
        }
        let e = if down && it < hi { list[ei] } else { expert };
        #[unroll]
        for t in 0..tt {
            let mi = t / 2;
            let lr = r0 + 16 * (mi % p.mt) + 8 * (t % 2);
            let ok = it < hi && lr < rows;
            let src = e * wstride + woff[t] + kb * 128;
            cp_async_16_zfill(&mut rp[u * sw + t * 128], &w[src], ok);
            // The scale element of k step kb is `soff + 4 kb`, in word `(e n gpr + soff) / 2 +
            // 2 kb` (the word's half: `soff`'s parity). g64: `soff + 2 kb`, in word `(e n gpr +
            // soff) / 2 + kb`; g128: `soff + kb`, in word `(e n gpr + soff + kb) / 2` (the half
            // alternates with kb).
            let sok = if p.group == 32 {
                ok && kb * 4 + q < gpr
            } else if p.group == 64 {
                ok && kb * 2 + q / 2 < gpr
            } else {
                ok && kb < gpr
            };
            let sidx = if p.group == 32 {
                2 * kb + (e * n * gpr + soff[t]) / 2
            } else if p.group == 64 {
                kb + (e * n * gpr + soff[t]) / 2
            } else {
                (e * n * gpr + soff[t] + kb) / 2
            };
            if p.sr {
                let src = if sok { sidx } else { 0u32 };
                cp_async_4_zfill(&mut sp[u * sw + t * 32], &scales[src], sok);
            } else {
                sc[u * tt + t] = if sok { scales[sidx] } else { 0u32 };
            }
        }
        if p.xr {
            #[unroll]
            for c in 0..nc {
                #[unroll]
                for i in 0..4 {
                    let tok = lane / 16 + 2 * i + 8 * c;
                    let mut xr_row = u32::MAX;
                    if down {
                        if it < hi {
                            xr_row = prow[ei * cap + tok];
                        }
                    } else if gu || grouped {
                        let pr = list[tok];
                        if pr != u32::MAX {
                            xr_row = pr / a_div;
                        }
                    } else if tok < m {
                        xr_row = tok;
                    }
                    let kx = kb * 128 + 8 * xs;
                    if it < hi && xr_row != u32::MAX && kx < k {
                        cp_async_16(
                            &mut ring[wbase + u * sw + tt * 128 + c * 512 + xdst + 32 * i],
                            &x[xr_row * k + kx],
                        );
                    }
                }
            }
        }
        cp_async_commit();
    }
    if early {
        grid_wait();
        grid_launch_dependents();
    }
    if xpre {
        let kx = (ckb * 128 + 32 * q).min(k - 32);
        #[unroll]
        for c in 0..nc {
            // (Down: the act row of the item's expert; past the last expert any valid row.)
            let xb = if !down {
                xbase[c]
            } else if cei < ne {
                prow[cei * cap + g + 8 * c] * k
            } else {
                0u32
            };
            let xk = &x[xb + kx..];
            #[unroll]
            for j in 0..4 {
                let v = xk.vload(8 * j);
                xn[c * 4 + j][0] = v.x;
                xn[c * 4 + j][1] = v.y;
                xn[c * 4 + j][2] = v.z;
                xn[c * 4 + j][3] = v.w;
            }
        }
    }
    for rr in 0..(cnt + ns - 1) / ns {
        #[unroll]
        for u in 0..ns {
            let it = lo + rr * ns + u;
            cp_async_wait(ns - 1);
            if p.xr {
                // The x slice of this slot was copied by other lanes.
                sync_warp();
            }
            if it < hi {
                let ei = cei;
                let kb = ckb;
                ckb += dr;
                cei += dq;
                if ckb >= kbs {
                    ckb = if dkw { ckb - kbs } else { 0u32 };
                    cei += 1;
                }
                let e = if down { list[ei] } else { expert };
                if down && ei != cur {
                    // Flush the finished expert with its router weights (tokens 2q, 2q + 1 + 8c).
                    #[unroll]
                    for c in 0..nc {
                        #[unroll]
                        for i in 0..p.mt {
                            #[unroll]
                            for r in 0..4 {
                                oacc[i * nc + c][r] += rwt[c * 2 + r % 2] * acc[i * nc + c][r];
                                acc[i * nc + c][r] = 0.0f32;
                            }
                        }
                    }
                    cur = ei;
                    // This expert's act row of token g + 8c and router weights of tokens
                    // 2q + cc + 8c (0 where the token does not use it).
                    #[unroll]
                    for c in 0..nc {
                        xrow[c] = u32::MAX;
                        rwt[c * 2] = 0.0f32;
                        rwt[c * 2 + 1] = 0.0f32;
                    }
                    for j in 0..topk {
                        #[unroll]
                        for c in 0..nc {
                            let tk = g + 8 * c;
                            if tk < m && ids_s[tk * topk + j] == e {
                                xrow[c] = tk * topk + j;
                            }
                            #[unroll]
                            for cc in 0..2 {
                                let t2 = 8 * c + 2 * q + cc;
                                if t2 < m && ids_s[t2 * topk + j] == e {
                                    rwt[c * 2 + cc] = route_w[t2 * topk + j];
                                }
                            }
                        }
                    }
                }
                #[unroll]
                for t in 0..tt {
                    let v = rp.vload(u * sw + t * 128);
                    wv[t][0] = v.x;
                    wv[t][1] = v.y;
                    wv[t][2] = v.z;
                    wv[t][3] = v.w;
                }
                let kq = kb * 128 + 32 * q;
                if xpre {
                    // The next item's x (expert `cei`, k step `ckb`) into the other slot.
                    let xs1 = (u + 1) % 2 * 4 * nc;
                    let kx = (ckb * 128 + 32 * q).min(k - 32);
                    #[unroll]
                    for c in 0..nc {
                        let xb = if !down {
                            xbase[c]
                        } else if cei < ne {
                            prow[cei * cap + g + 8 * c] * k
                        } else {
                            0u32
                        };
                        let xk = &x[xb + kx..];
                        #[unroll]
                        for j in 0..4 {
                            let v = xk.vload(8 * j);
                            xn[xs1 + c * 4 + j][0] = v.x;
                            xn[xs1 + c * 4 + j][1] = v.y;
                            xn[xs1 + c * 4 + j][2] = v.z;
                            xn[xs1 + c * 4 + j][3] = v.w;
                        }
                    }
                }
                #[unroll]
                for j in 0..4 {
                    #[unroll]
                    for c in 0..nc {
                        let ok = kq < k && xrow[c] != u32::MAX;
                        if xpre {
                            #[unroll]
                            for r in 0..4 {
                                xv[c][r] = xn[u % 2 * 4 * nc + c * 4 + j][r];
                            }
                        } else if p.xr {
                            #[unroll]
                            for r in 0..4 {
                                xv[c][r] = 0u32;
                            }
                            if ok {
                                let v = rp.vload(u * sw + tt * 128 + c * 512 + j * 128);
                                xv[c][0] = v.x;
                                xv[c][1] = v.y;
                                xv[c][2] = v.z;
                                xv[c][3] = v.w;
                            }
                        } else {
                            let v = x.vload(if ok { xrow[c] * k + kq + 8 * j } else { 0u32 });
                            xv[c][0] = if ok { v.x } else { 0u32 };
                            xv[c][1] = if ok { v.y } else { 0u32 };
                            xv[c][2] = if ok { v.z } else { 0u32 };
                            xv[c][3] = if ok { v.w } else { 0u32 };
                        }
                    }
                    #[unroll]
                    for i in 0..mtt {
                        // Scales of rows g (tile 2i) and g + 8 (tile 2i + 1), in both halves (g128:
                        // the half of k step kb).
                        let sel = if p.group == 128 {
                            if (e * n * gpr + soff[2 * i] + kb) % 2 == 1 {
                                0x3232u32
                            } else {
                                0x1010u32
                            }
                        } else if (e * n * gpr + soff[2 * i]) % 2 == 1 {
                            0x3232u32
                        } else {
                            0x1010u32
                        };
                        // (sr: the words of tiles 2i and 2i + 1 this lane copied into the ring.)
                        let sa = prmt(if p.sr { sp[u * sw + 64 * i] } else { sc[u * tt + 2 * i] }, 0u32, sel);
                        let sb = prmt(
                            if p.sr {
                                sp[u * sw + 64 * i + 32]
                            } else {
                                sc[u * tt + 2 * i + 1]
                            },
                            0u32,
                            sel,
                        );
                        #[unroll]
                        for h in 0..2 {
                            af[0][0] = dequant_pair(magic_pair_interleaved(wv[2 * i][j] >> (8 * h)), sa);
                            af[0][2] = dequant_pair(magic_pair_interleaved(wv[2 * i][j] >> (8 * h + 4)), sa);
                            af[0][1] = dequant_pair(magic_pair_interleaved(wv[2 * i + 1][j] >> (8 * h)), sb);
                            af[0][3] = dequant_pair(magic_pair_interleaved(wv[2 * i + 1][j] >> (8 * h + 4)), sb);
                            #[unroll]
                            for c in 0..nc {
                                bf[c][0] = xv[c][2 * h];
                                bf[c][1] = xv[c][2 * h + 1];
                                mma_m16n8k16_bf16(&mut acc[i * nc + c], &af[0], &bf[c]);
                            }
                        }
                    }
                }
            }
            // Refill slot u with the item `stages` later.
            let it2 = it + ns;
            let ei = fei;
            let kb = fkb;
            fkb += dr;
            fei += dq;
            if fkb >= kbs {
                fkb = if dkw { fkb - kbs } else { 0u32 };
                fei += 1;
            }
            let e = if down && it2 < hi { list[ei] } else { expert };
            #[unroll]
            for t in 0..tt {
                let mi = t / 2;
                let lr = r0 + 16 * (mi % p.mt) + 8 * (t % 2);
                let ok = it2 < hi && lr < rows;
                let src = e * wstride + woff[t] + kb * 128;
                if p.xr {
                    // Every lane has read this slot's x before any lane overwrites it.
                    sync_warp();
                }
                cp_async_16_zfill(&mut rp[u * sw + t * 128], &w[src], ok);
                // (The scale word as in the prologue.)
                let sok = if p.group == 32 {
                    ok && kb * 4 + q < gpr
                } else if p.group == 64 {
                    ok && kb * 2 + q / 2 < gpr
                } else {
                    ok && kb < gpr
                };
                let sidx = if p.group == 32 {
                    2 * kb + (e * n * gpr + soff[t]) / 2
                } else if p.group == 64 {
                    kb + (e * n * gpr + soff[t]) / 2
                } else {
                    (e * n * gpr + soff[t] + kb) / 2
                };
                if p.sr {
                    let src = if sok { sidx } else { 0u32 };
                    cp_async_4_zfill(&mut sp[u * sw + t * 32], &scales[src], sok);
                } else {
                    sc[u * tt + t] = if sok { scales[sidx] } else { 0u32 };
                }
            }
            if p.xr {
                #[unroll]
                for c in 0..nc {
                    #[unroll]
                    for i in 0..4 {
                        let tok = lane / 16 + 2 * i + 8 * c;
                        let mut xr_row = u32::MAX;
                        if down {
                            if it2 < hi {
                                xr_row = prow[ei * cap + tok];
                            }
                        } else if gu || grouped {
                            let pr = list[tok];
                            if pr != u32::MAX {
                                xr_row = pr / a_div;
                            }
                        } else if tok < m {
                            xr_row = tok;
                        }
                        let kx = kb * 128 + 8 * xs;
                        if it2 < hi && xr_row != u32::MAX && kx < k {
                            cp_async_16(
                                &mut ring[wbase + u * sw + tt * 128 + c * 512 + xdst + 32 * i],
                                &x[xr_row * k + kx],
                            );
                        }
                    }
                }
            }
            cp_async_commit();
        }
    }
    cp_async_wait(0);
    if down {
        #[unroll]
        for c in 0..nc {
            #[unroll]
            for i in 0..p.mt {
                #[unroll]
                for r in 0..4 {
                    oacc[i * nc + c][r] += rwt[c * 2 + r % 2] * acc[i * nc + c][r];
                }
            }
        }
    }
    // Sum the warps' accumulators through the ring.
    sync_threads();
    let om = comptime!(if p.mode.gate_up() { 2 * p.mt } else { p.mt });
    #[unroll]
    for i in 0..om {
        #[unroll]
        for c in 0..nc {
            #[unroll]
            for r in 0..4 {
                if down {
                    ring[((wid * om + i) * nc + c) * 128 + lane * 4 + r] = oacc[i * nc + c][r].to_bits();
                } else {
                    ring[((wid * om + i) * nc + c) * 128 + lane * 4 + r] = acc[i * nc + c][r].to_bits();
                }
            }
        }
    }
    sync_threads();
    for el in (tid..p.mt * nc * 128).step_by(nw * 32) {
        let i = el / (nc * 128);
        let c = (el / 128) % nc;
        let ln = (el % 128) / 4;
        let r = el % 4;
        let row = r0 + 16 * i + ln / 4 + 8 * (r / 2);
        let col = 8 * c + 2 * (ln % 4) + r % 2;
        let mut v = 0.0f32;
        let mut u2 = 0.0f32;
        for ww in 0..nw {
            v += f32::from_bits(ring[((ww * om + i) * nc + c) * 128 + ln * 4 + r]);
            if gu {
                u2 += f32::from_bits(ring[((ww * om + i + p.mt) * nc + c) * 128 + ln * 4 + r]);
            }
        }
        if row < rows {
            if gu {
                let pr = list[col];
                if pr != u32::MAX {
                    out[pr * rows + row] = (silu(v) * u2) as bf16;
                }
            } else if gdn {
                let pr = list[col];
                if pr != u32::MAX {
                    out[pr * n + row] = (route_w[pr] * v) as bf16;
                }
            } else if col < m {
                out[col * n + row] = v as bf16;
            }
        }
    }
}
