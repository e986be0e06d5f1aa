//! The warpgroup pass [`MlaVerifyWg`] (`wgmma`, sm_90).

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

/// Compile-time parameters of [`MlaVerifyWg`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct WgParams {
    /// KV tile (keys per step): 32 or 64.
    pub bn: u32,
    /// Depth of the shared-memory tile ring, >= 2.
    pub stages: u32,
    /// Warpgroups that score each tile: 2 (each scores half the keys, `wgmma` N = `bn / 2`,
    /// and both copy the ring) or 1 (warpgroup 0 scores all `bn` keys and runs the softmax,
    /// warpgroup 1 copies the ring; an N = `bn` `wgmma` reads each Q and K chunk once per tile).
    pub scorers: u32,
}

impl WgParams {
    /// Query rows per block: one `wgmma` M tile.
    pub const fn rows_per_block(&self) -> u32 {
        64
    }

    /// Bytes of dynamic shared memory: the Q tile plus the KV ring, bf16.
    pub const fn dyn_smem(&self) -> u32 {
        (64 + self.stages * self.bn) * 576 * 2
    }
}

/// Split-KV pass on the warpgroup tensor cores (`wgmma`): the same grid, inputs and partial
/// outputs as [`MlaVerifySplit`], 64 query rows per block (all 64 heads of a node), two
/// warpgroups. The Q tile and the KV ring sit in shared memory as nine 64-column blocks of
/// 128-byte-swizzled rows (`wgmma`'s canonical K-major layout, which is also the N-major layout
/// of the values). With one scorer (the default) warpgroup 0 scores all `bn` keys of each tile
/// for all 64 rows (`wgmma_bf16_ss`, 36 k16 steps over the 576 dims, Q and K from shared memory,
/// each Q chunk read once per tile), runs the whole softmax and passes each tile's rescale to
/// warpgroup 1 through shared memory, while warpgroup 1 copies the ring; with two, warpgroup `h`
/// scores keys `h bn / 2 ..` and the row maxima of the two halves meet in shared memory. The
/// probabilities go to a bf16 `P` tile in shared memory, and warpgroup `h` accumulates output
/// columns `256 h ..` of all rows from `P` in registers (`ldmatrix`) and the values in shared
/// memory (`wgmma_bf16_rs_mn`). The operands are descriptors made once per tile plus
/// compile-time offsets (an add per `wgmma` operand, in uniform registers). For trees the scores
/// are issued before the next tile's `cp.async` copies, which then overlap them, and each tile's
/// `P V` is left running behind the next tile's scores (its ring slot is refilled once both
/// warpgroups have waited for it). Online softmax in f32; partial outputs as bf16 pairs, as
/// [`MlaVerifyCombine`] reads them.
#[kernel(block = 256, dyn_smem = p.dyn_smem(), space = [
    WgParams { bn: 64, stages: 2, scorers: 1 },
    WgParams { bn: 64, stages: 2, scorers: 2 },
    WgParams { bn: 32, stages: 4, scorers: 2 },
    WgParams { bn: 32, stages: 3, scorers: 2 },
])]
pub fn mla_verify_wg(
    #[comptime] p: &WgParams,
    q: &[bf16],
    cache: &[bf16],
    mask: &[u32],
    lens: &[u32],
    part_o: &mut [u32],
    part_lse: &mut [f32],
    rows: u32,
    heads: u32,
    nodes: u32,
    words: u32,
    scale: f32,
) {
    comptime_assert!(p.bn == 32 || p.bn == 64, "bn must be 32 or 64");
    comptime_assert!(p.stages >= 2, "stages must be at least 2");
    comptime_assert!(p.scorers == 1 || p.scorers == 2, "scorers must be 1 or 2");
    comptime_assert!(
        (64 + p.stages * p.bn) * 1152 + 1024 + 64 * (p.bn + 8) * 2 + 4 * 64 * 4 <= 232448,
        "shared memory is limited to 227 KiB per block"
    );
    // Keys each scoring warpgroup scores (the score `wgmma`'s N), u32 (bf16 pairs) per row of
    // the P tile (padded against bank conflicts), elements per 64-column block of a KV tile.
    let nk = p.bn / p.scorers;
    let psw = (p.bn + 8) / 2;
    let kblk = p.bn * 64;
    // Q at 0: column block `b` at `4096 b`, row `r` at `64 r` in it, 16-byte chunk `c` at `c ^ (r
    // % 8)`; then the ring of `stages` tiles laid out the same way with `bn` rows per block.
    let sm = dyn_shared::<bf16>();
    let ring = 64 * 576;
    let sp = shared::<u32>(64 * ((p.bn + 8) / 2));
    let smax = shared::<f32>(2 * 64);
    let ssum = shared::<f32>(2 * 64);
    let lane = lane_id();
    let warp = warp_id();
    // The warpgroup, through a lane-0 shuffle so the compiler knows it is warp-uniform and keeps
    // the `wgmma` descriptors built from it in uniform registers.
    let h = shfl_idx(warp / 4, 0u32);
    let wl = warp % 4;
    // Whether this warpgroup scores (and runs the softmax) and whether it copies the ring; the
    // copying warps, and this warp's place among them.
    let scores = p.scorers == 2 || h == 0;
    let copies = p.scorers == 2 || h == 1;
    let cw = 4 * p.scorers;
    let lw = warp % cw;
    let g = lane / 4;
    let qd = lane % 4;
    let blk0 = block_idx_x() * 64;
    let prefix = lens[0];
    let total = prefix + nodes;
    let splits = grid_dim_y();
    let chunk = ((total + splits - 1) / splits + p.bn - 1) / p.bn * p.bn;
    let kv0 = block_idx_y() * chunk;
    let kv1 = (kv0 + chunk).min(total);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    // This thread's rows `16 wl + g` and `+ 8` of the block (as both warpgroups hold them), and
    // their nodes.
    let mut lr = [0u32; 2];
    let mut node = [0u32; 2];
    #[unroll]
    for i in 0..2 {
        lr[i] = wl * 16 + g + i * 8;
        node[i] = ((blk0 + lr[i]) / heads).min(nodes - 1);
    }

    let mut o = [[0.0f32; 32]; 4];
    let mut pa = [[0u32; 4]; p.bn / 16];
    let mut m = [f32::NEG_INFINITY; 2];
    let mut l = [0.0f32; 2];
    let mut mx = [0.0f32; 2];
    let mut al = [0.0f32; 2];

    let ntiles = if kv1 > kv0 { (kv1 - kv0 + p.bn - 1) / p.bn } else { 0u32 };
    // The queries' `wgmma` descriptor (column block `b` at 4096 b elements: 512 units).
    let qdesc = wgmma_desc(&sm[0]);
    // The cp.async groups as in [`MlaVerifyWide`]: tiles `0 .. stages - 1`, the query rows, then
    // one tile per step; the decode step (one node) issues its first tiles before the wait for
    // the predecessor.
    let early = nodes == 1;
    for it in 0..ntiles + p.stages - 1 {
        if it == 0 && !early {
            grid_wait();
            grid_launch_dependents();
        }
        // This step computes tile `ti` once the ring is primed.
        let computes = it + 1 >= p.stages;
        let ti = it + 1 - p.stages.min(it + 1);
        let kt = kv0 + ti * p.bn;
        let st = ring + (ti % p.stages) * p.bn * 576;
        // This step's scores (a fresh row per step: nothing carried to the next).
        let mut sacc = [0.0f32; p.bn / p.scorers / 2];
        if computes {
            // Tile `ti` and the queries have landed; every warpgroup is done with tile
            // `it - stages` (its `wgmma` groups were waited for), whose slot tile `it` reuses.
            if it + 1 == p.stages {
                cp_async_wait(0);
            } else {
                cp_async_wait(p.stages - 2);
            }
            fence_proxy_async();
            sync_threads();
        }
        // The scores of tile `ti` and the ring load of tile `it`: trees issue the scores first
        // and the load behind them (it overlaps the `wgmma`s); the decode step (one node, the
        // cache streaming from DRAM) issues the load first.
        let load_phase = if early { 0u32 } else { 1u32 };
        #[unroll]
        for phase in 0..2 {
            if computes && phase != load_phase && scores {
                // All 64 rows against this warpgroup's `nk` keys: k16 step `kk` is 2 descriptor
                // units into a column block, a column block 512 (Q) or `kblk / 8` apart.
                let kd = wgmma_desc(&sm[st + h * nk * 64]);
                wgmma_fence();
                #[unroll]
                for kk in 0..36 {
                    let step = (kk % 4) * 2;
                    wgmma_bf16_ss(
                        &mut sacc,
                        qdesc + (kk / 4) * 512 + step,
                        kd + (kk / 4) * (kblk / 8) + step,
                    );
                }
                wgmma_commit();
            }
            if phase == load_phase {
                if computes && ti > 0 && it < ntiles && !early {
                    // Trees leave the previous tile's `P V` running behind this tile's scores
                    // (issued in phase 0); its slot takes this load once both warpgroups are
                    // done with it.
                    if scores {
                        wgmma_wait(1);
                    } else {
                        wgmma_wait(0);
                    }
                    sync_threads();
                }
                if it < ntiles && copies {
                    // Copying warp `w` of `cw` copies rows `w + cw i` and lane `l` the chunks
                    // `l`, `l + 32` and, for lanes 0..8, `l + 64` (chunk `c` of row `r` at `c ^
                    // (r % 8)`).
                    let ld = ring + (it % p.stages) * p.bn * 576 + lw * 64;
                    let kl = kv0 + it * p.bn + lw;
                    #[unroll]
                    for i in 0..p.bn / cw {
                        let ok = kl + cw * i < kv1;
                        let src = if ok { (kl + cw * i) * 576 } else { 0u32 };
                        let sw = (lw + cw * i) % 8;
                        #[unroll]
                        for j in 0..3 {
                            let c = lane + 32 * j;
                            if c < 72 {
                                let dst = ld + (c / 8) * kblk + i * cw * 64 + ((c % 8) ^ sw) * 8;
                                cp_async_16_zfill(&mut sm[dst], &cache[src + c * 8], ok);
                            }
                        }
                    }
                }
                cp_async_commit();
            }
        }
        if it + 2 == p.stages {
            if early {
                grid_wait();
                grid_launch_dependents();
            }
            // The block's query rows (zero past `rows`), the same way.
            #[unroll]
            for i in 0..8 {
                let r = warp + 8 * i;
                let ok = blk0 + r < rows;
                let src = if ok { (blk0 + r) * 576 } else { 0u32 };
                #[unroll]
                for j in 0..3 {
                    let c = lane + 32 * j;
                    if c < 72 {
                        let dst = (c / 8) * 4096 + r * 64 + ((c % 8) ^ warp) * 8;
                        cp_async_16_zfill(&mut sm[dst], &q[src + c * 8], ok);
                    }
                }
            }
            cp_async_commit();
        }
        if computes {
            if scores {
                // This tile's scores (and for trees the previous tile's `P V`).
                wgmma_wait(0);

                // Mask (tree keys only), scale, this warpgroup's row maxima.
                mx[0] = f32::NEG_INFINITY;
                mx[1] = f32::NEG_INFINITY;
                let key0 = kt + h * nk;
                if kt + p.bn <= prefix.min(kv1) {
                    #[unroll]
                    for e in 0..p.bn / p.scorers / 2 {
                        sacc[e] *= scale_log2;
                        mx[(e % 4) / 2] = mx[(e % 4) / 2].max(sacc[e]);
                    }
                } else {
                    #[unroll]
                    for e in 0..p.bn / p.scorers / 2 {
                        let i = (e % 4) / 2;
                        let key = key0 + (e / 4) * 8 + qd * 2 + e % 2;
                        let t = key - prefix;
                        let vis =
                            key < kv1 && (key < prefix || ((mask[node[i] * words + t / 32] >> (t % 32)) & 1) == 1);
                        sacc[e] = if vis { sacc[e] * scale_log2 } else { f32::NEG_INFINITY };
                        mx[i] = mx[i].max(sacc[e]);
                    }
                }
                #[unroll]
                for i in 0..2 {
                    mx[i] = mx[i].max(shfl_xor(mx[i], 1u32));
                    mx[i] = mx[i].max(shfl_xor(mx[i], 2u32));
                }
            } else {
                // The previous tile's `P V`, before its output columns are rescaled.
                wgmma_wait(0);
            }
            if p.scorers == 2 {
                // The two halves' row maxima meet in shared memory.
                #[unroll]
                for i in 0..2 {
                    if qd == 0 {
                        smax[h * 64 + lr[i]] = mx[i];
                    }
                }
                sync_threads();
                #[unroll]
                for i in 0..2 {
                    mx[i] = smax[lr[i]].max(smax[64 + lr[i]]);
                }
            }
            if scores {
                // Online softmax (with two scorers both form the same new maxima).
                #[unroll]
                for i in 0..2 {
                    let mn = m[i].max(mx[i]);
                    // Rows with no visible key yet keep m = -inf; use 0 as the exponent base then.
                    let base = if mn == f32::NEG_INFINITY { 0.0f32 } else { mn };
                    al[i] = (m[i] - base).exp2();
                    m[i] = mn;
                    l[i] *= al[i];
                    mx[i] = base;
                }
                #[unroll]
                for j in 0..p.bn / p.scorers / 8 {
                    #[unroll]
                    for i in 0..2 {
                        let a = (sacc[4 * j + 2 * i] - mx[i]).exp2();
                        let b = (sacc[4 * j + 2 * i + 1] - mx[i]).exp2();
                        l[i] += a + b;
                        sp[lr[i] * psw + (h * nk + j * 8 + qd * 2) / 2] = pack_bf16x2(a, b);
                    }
                }
                if p.scorers == 1 && qd == 0 {
                    // The rescale, for the other warpgroup's output columns.
                    smax[lr[0]] = al[0];
                    smax[lr[1]] = al[1];
                }
            }
            sync_threads();
            if !scores {
                al[0] = smax[lr[0]];
                al[1] = smax[lr[1]];
            }

            // P V over all rows and this warpgroup's 256 output columns.
            #[unroll]
            for ks in 0..p.bn / 16 {
                ldmatrix_x4(&mut pa[ks], &sp[(wl * 16 + lane % 16) * psw + ks * 8 + (lane / 16) * 4]);
            }
            // Once the row maxima settle (most tiles of a long context), skip the rescale.
            if !vote_all(al[0] == 1.0f32 && al[1] == 1.0f32) {
                #[unroll]
                for nc in 0..4 {
                    #[unroll]
                    for j in 0..8 {
                        o[nc][4 * j] *= al[0];
                        o[nc][4 * j + 1] *= al[0];
                        o[nc][4 * j + 2] *= al[1];
                        o[nc][4 * j + 3] *= al[1];
                    }
                }
            }
            // Values: 16 keys (two 8-row groups) per k16 step, a column block `kblk / 8` apart.
            let vd = wgmma_desc(&sm[st + h * 4 * kblk]);
            wgmma_fence();
            #[unroll]
            for ks in 0..p.bn / 16 {
                #[unroll]
                for nc in 0..4 {
                    wgmma_bf16_rs_mn(&mut o[nc], &pa[ks], vd + nc * (kblk / 8) + ks * 128);
                }
            }
            wgmma_commit();
            if early {
                wgmma_wait(0);
            }
        }
    }
    wgmma_wait(0);

    // Row sums: each scorer's keys, then (two scorers) the two halves meet in shared memory.
    if scores {
        #[unroll]
        for i in 0..2 {
            l[i] += shfl_xor(l[i], 1u32);
            l[i] += shfl_xor(l[i], 2u32);
            if qd == 0 {
                ssum[h * 64 + lr[i]] = l[i];
            }
        }
    }
    sync_threads();
    let split = block_idx_y();
    #[unroll]
    for i in 0..2 {
        let ls = if p.scorers == 2 {
            ssum[lr[i]] + ssum[64 + lr[i]]
        } else {
            ssum[lr[i]]
        };
        let inv = if ls > 0.0f32 { 1.0f32 / ls } else { 0.0f32 };
        let row = blk0 + lr[i];
        if row < rows {
            #[unroll]
            for nc in 0..4 {
                #[unroll]
                for j in 0..8 {
                    let col = h * 256 + nc * 64 + j * 8 + qd * 2;
                    let a = o[nc][4 * j + 2 * i];
                    let b = o[nc][4 * j + 2 * i + 1];
                    part_o[((split * rows + row) * 512 + col) / 2] = pack_bf16x2(a * inv, b * inv);
                }
            }
            if h == 0 && qd == 0 {
                part_lse[split * rows + row] = if ls > 0.0f32 {
                    (m[i] + ls.log2()) * std::f32::consts::LN_2
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
}
