//! `w4a16_gemm_wg`: the same product as [`super::W4a16Gemm`] (same arguments, layouts,
//! epilogues, split-K partials and MoE routing) on the Hopper warpgroup tensor cores
//! (`wgmma`), for the token counts where the tensor rate matters (M about 16 to 256).
//!
//! Design: the weights are the `wgmma` A operand, dequantized straight into registers (64
//! weight rows per m64 tile, `mt` tiles per warpgroup, `wgs` warpgroups per block); the block's
//! `bn` activation rows (tokens, or token-expert pairs) are the B operand, K-major and
//! 128-byte swizzled in shared memory; the accumulators are `D[weight row, token]`. K runs in
//! k128 chunks through a shared-memory ring of `stages` slots, each filled by one `cp.async`
//! group: the chunk's activations (zero-filled past M and K), its packed weights as 16-byte
//! pieces (32 k of one row; a warp copies whole 512-byte interleaved tiles, and zero-fills
//! with a zero scale past N and K) and their scale words. A `wgmma` A fragment needs, for rows
//! `g` and `g + 8`, the k pairs `2 q, 2 q + 1` and `2 q + 8, 2 q + 9` of each k16 step, which is
//! element pair `q` of two packed words: `magic(word >> 4 q)` in the interleaved layout (pairs
//! sit at nibbles `i, i + 4`) or `>> 8 q` in the checkpoint one, then one `fma.rn.bf16x2` pair
//! per register as in the mma.sync kernels (`bf16(q * scale)`). The four lanes of a row read
//! the same 16 bytes (a broadcast), so the shared-memory reads cost a quarter of the bytes
//! they return.
//!
//! Step `j` issues chunk `j - 2`'s `wgmma`s, waits for chunk `j - 1` and the block's barrier,
//! refills the slot freed at the end of the previous step (the copies go out after the
//! barrier, a whole step before their chunk is needed), and makes chunk `j - 1`'s A fragments
//! (the other of two register sets) while those `wgmma`s run; it waits for them before the
//! loop's back edge, since ptxas serializes every `wgmma` of a loop that carries one in flight
//! past it (C7515) when the accumulators are zeroed before the loop. Copy issue costs an add,
//! a compare and the `cp.async` per copy: everything else about a thread's copies is worked
//! out once before the loop.
//!
//! The grid and the epilogues are those of [`super::W4a16Gemm`] with `bn` A rows and
//! `64 wgs mt` weight rows per block; SiLU-and-mul pairs tile `t` (gate rows) with tile
//! `t + mt / 2` (the matching up rows) of the same warpgroup, so both halves meet in one
//! thread's registers.

use std::sync::Arc;

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream};
use ddtree_runtime::{CompiledKernel, RuntimeError};

use super::gemm::{
    dequant_pair, grid, magic_pair_interleaved, magic_pair_sequential, w4a16_kernel, Epilogue, GemmTiling, Layout,
    Tiling,
};
use crate::silu_mul::silu;

/// Compile-time parameters of [`W4a16GemmWg`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub struct W4a16WgParams {
    /// Scale group size along K: 32, 64 or 128.
    pub group: u32,
    /// Weight layout / unpack order.
    pub layout: Layout,
    /// Warpgroups per block (1..=4).
    pub wgs: u32,
    /// m64 tiles of weight rows per warpgroup (1 or 2; 2 for SiLU-and-mul).
    pub mt: u32,
    /// A rows (tokens or pairs) per block: the `wgmma` N (8, 16, 32, 64, 128 or 256).
    pub bn: u32,
    /// Ring slots (k128 chunks, >= 3): one being computed, one read by the `wgmma`s before it,
    /// one being refilled, and `stages - 3` more loading ahead.
    pub stages: u32,
    /// Output epilogue.
    pub epilogue: Epilogue,
    /// Write f32 partials per k split (finished by [`super::W4a16Reduce`]).
    pub splitk: bool,
    /// Grouped (MoE): A rows are token-expert pairs from `moe_align`.
    pub moe: bool,
    /// The packed weights come in through the async proxy: one 512-byte `cp_async_bulk` per
    /// 8-row tile and chunk, completing on the slot's mbarrier (interleaved layout only); the
    /// activation and scale copies stay `cp.async`.
    pub bulk: bool,
}

impl W4a16WgParams {
    /// Weight rows per block.
    pub const fn weight_rows(&self) -> u32 {
        64 * self.wgs * self.mt
    }

    /// Bytes of dynamic shared memory: the ring (per slot the activations `[bn, 128]` bf16 and
    /// the packed weights, 64 bytes a row).
    pub const fn dyn_smem(&self) -> u32 {
        self.stages * (self.bn * 256 + self.weight_rows() * 64)
    }
}

impl GemmTiling for W4a16WgParams {
    fn tiling(&self) -> Tiling {
        Tiling {
            group: self.group,
            layout: self.layout,
            epilogue: self.epilogue,
            splitk: self.splitk,
            moe: self.moe,
            rows: self.bn,
            weight_rows: self.weight_rows(),
        }
    }
}

w4a16_kernel!(W4a16GemmWg);

const fn wg(wgs: u32, mt: u32, bn: u32, stages: u32, splitk: bool) -> W4a16WgParams {
    W4a16WgParams {
        group: 32,
        layout: Layout::Interleaved,
        wgs,
        mt,
        bn,
        stages,
        epilogue: Epilogue::Plain,
        splitk,
        moe: false,
        bulk: false,
    }
}

/// Candidates of the plain dense product: 256 or 128 weight rows per block at N 64 and 128
/// (some with rings small enough for two or three blocks per SM), one warpgroup of one or two
/// tiles, small N with split-K for M <= 32, N 256 for the largest M, the checkpoint layout and
/// g64 / g128.
pub const WG_DENSE_SPACE: &[W4a16WgParams] = &[
    wg(2, 2, 64, 5, false),
    W4a16WgParams {
        bulk: true,
        ..wg(2, 2, 64, 5, false)
    },
    W4a16WgParams {
        bulk: true,
        ..wg(2, 1, 128, 5, false)
    },
    wg(2, 1, 64, 8, false),
    wg(2, 1, 64, 4, false),
    wg(2, 1, 64, 3, false),
    wg(1, 1, 64, 3, false),
    wg(1, 1, 64, 3, true),
    wg(1, 2, 64, 3, false),
    wg(2, 1, 128, 5, false),
    wg(1, 2, 64, 4, false),
    wg(4, 1, 64, 6, false),
    wg(2, 2, 16, 8, true),
    wg(2, 2, 32, 7, true),
    wg(2, 1, 256, 3, false),
    wg(2, 1, 256, 3, true),
    W4a16WgParams {
        layout: Layout::Checkpoint,
        ..wg(2, 2, 64, 5, false)
    },
    W4a16WgParams {
        group: 64,
        ..wg(2, 2, 64, 5, false)
    },
    W4a16WgParams {
        group: 128,
        ..wg(2, 2, 64, 5, false)
    },
];

/// Fused-epilogue and grouped variants (the grouped ones also with a three-slot ring of 42 KiB:
/// five blocks per SM).
pub const WG_FUSED_SPACE: &[W4a16WgParams] = &[
    W4a16WgParams {
        epilogue: Epilogue::SiluMul,
        ..wg(2, 2, 64, 5, false)
    },
    W4a16WgParams {
        epilogue: Epilogue::Residual,
        ..wg(2, 2, 64, 5, false)
    },
    W4a16WgParams {
        epilogue: Epilogue::SiluMul,
        moe: true,
        ..wg(2, 2, 16, 8, false)
    },
    W4a16WgParams {
        epilogue: Epilogue::RouteScale,
        moe: true,
        ..wg(2, 2, 16, 8, false)
    },
    W4a16WgParams {
        epilogue: Epilogue::SiluMul,
        moe: true,
        ..wg(1, 2, 16, 3, false)
    },
    W4a16WgParams {
        epilogue: Epilogue::RouteScale,
        moe: true,
        ..wg(1, 2, 16, 3, false)
    },
];

/// Fewest rows (tokens) for which [`default_dense`] picks this kernel over the mma.sync tile
/// GEMM ([`super::gemm::default_dense`]): below, that one is faster on the H200
/// (`w4a16-bench`, BENCHMARKS.md).
pub const WG_MIN_ROWS: u32 = 48;

/// The default variant (g32, interleaved) and k splits of a plain dense `m x n x k` product,
/// `None` below [`WG_MIN_ROWS`] rows (H200 runs, BENCHMARKS.md): up to 128 rows one warpgroup of
/// 64 weight rows at N 64 with a three-slot ring (three blocks per SM), K split (at most 4
/// ways, at least two k128 chunks a split) to about two blocks per SM when the grid is under
/// one block per SM; above 128 rows N 256, split only under 48 blocks (the f32 partials of
/// that many rows cost more than the idle SMs). Only for GPUs with `wgmma`
/// ([`crate::wgmma_supported`]).
pub fn default_dense(m: u32, n: u32, k: u32) -> Option<(W4a16WgParams, u32)> {
    default_dense_tile(m).map(|p| dense_launch(&p, m, n, k))
}

/// [`default_dense`]'s tile at `m` rows, `splitk` meaning "split where [`dense_splits`] does":
/// the same for every `m` of one power-of-two bucket. `None` below [`WG_MIN_ROWS`].
pub fn default_dense_tile(m: u32) -> Option<W4a16WgParams> {
    if m < WG_MIN_ROWS {
        return None;
    }
    Some(if m <= 128 {
        wg(1, 1, 64, 3, true)
    } else {
        wg(2, 1, 256, 3, true)
    })
}

/// The K splits of a dense variant at `m x n x k` ([`default_dense`]'s rule, for any tile): 1
/// without `splitk`; with it, to about two blocks per SM (at most 4 ways, at least two k128
/// chunks a split) where the grid has fewer than 132 blocks (`m <= 128`) or 48 (above), else 1.
pub fn dense_splits(p: &W4a16WgParams, m: u32, n: u32, k: u32) -> u32 {
    if !p.splitk {
        return 1;
    }
    let few = if m <= 128 { 132 } else { 48 };
    let (mx, ny, _) = grid(p, m, n, 1);
    let blocks = mx * ny;
    if blocks >= few {
        1
    } else {
        (2 * 132u32).div_ceil(blocks).min((k.div_ceil(128) / 2).max(1)).min(4)
    }
}

/// The variant and split count a dense product of `m x n x k` launches for tile `p`: `p`'s
/// `splitk` says whether it may split K ([`dense_splits`]); the launched variant keeps `splitk`
/// only where it does split.
pub fn dense_launch(p: &W4a16WgParams, m: u32, n: u32, k: u32) -> (W4a16WgParams, u32) {
    let splits = dense_splits(p, m, n, k);
    (
        W4a16WgParams {
            splitk: splits > 1,
            ..*p
        },
        splits,
    )
}

/// Every candidate: [`WG_DENSE_SPACE`], then [`WG_FUSED_SPACE`].
pub fn wg_candidates() -> Vec<W4a16WgParams> {
    WG_DENSE_SPACE.iter().chain(WG_FUSED_SPACE).copied().collect()
}

/// The weight row of block row `r` of block `by` (`rows` weight rows a block, `mt` m64 tiles a
/// warpgroup): `by rows + r`, or with SiLU-and-mul (`silu`) the gate rows in each warpgroup's
/// first `mt / 2` tiles and the matching up rows (from `n / 2`) in the rest.
#[device_fn]
fn weight_row(r: u32, by: u32, rows: u32, mt: u32, n: u32, silu: bool) -> u32 {
    if silu {
        let t = r / 64;
        let half = mt / 2;
        let c0 = by * (rows / 2) + ((t / mt) * half + (t % mt) % half) * 64;
        r % 64 + if t % mt < half { c0 } else { n / 2 + c0 }
    } else {
        by * rows + r
    }
}

/// Arguments as [`super::W4a16Gemm`]'s. Grid: `(ceil(m / bn)` (grouped: the routing's
/// `max_blocks`), `ceil(cols / weight rows per block)`, `splits)` with `cols` the output
/// columns, whose weight rows per block are `64 wgs mt` (half of them for SiLU-and-mul, which
/// covers both halves). Needs `k % 32 == 0` and `k % group == 0`.
#[kernel(block = p.wgs * 128, dyn_smem = p.dyn_smem(), space = wg_candidates())]
pub fn w4a16_gemm_wg(
    #[comptime] p: &W4a16WgParams,
    a: &[bf16],
    w: &[u32],
    scales: &[u32],
    residual: &[bf16],
    out: &mut [bf16],
    part: &mut [f32],
    sorted: &[u32],
    block_expert: &[u32],
    route_w: &[f32],
    m: u32,
    n: u32,
    k: u32,
    a_div: u32,
) {
    comptime_assert!(
        p.group == 32 || p.group == 64 || p.group == 128,
        "group must be 32, 64 or 128"
    );
    comptime_assert!(p.wgs >= 1 && p.wgs <= 4, "wgs must be 1..=4");
    comptime_assert!(
        p.mt == 1 || p.mt == 2,
        "mt must be 1 or 2 (its A fragments take 64 mt registers)"
    );
    comptime_assert!(
        p.bn == 8 || p.bn == 16 || p.bn == 32 || p.bn == 64 || p.bn == 128 || p.bn == 256,
        "bn must be 8, 16, 32, 64, 128 or 256"
    );
    comptime_assert!(
        p.mt * p.bn <= 256,
        "mt * bn must be at most 256 (128 accumulator registers)"
    );
    comptime_assert!(p.stages >= 3 && p.stages <= 12, "stages must be 3..=12");
    comptime_assert!(
        p.epilogue != Epilogue::SiluMul || p.mt % 2 == 0,
        "SiLU-and-mul needs an even mt"
    );
    comptime_assert!(!(p.moe && p.splitk), "grouped launches do not split K");
    comptime_assert!(
        !p.bulk || p.layout == Layout::Interleaved,
        "bulk weight copies need the interleaved layout (whole 512-byte tiles)"
    );
    comptime_assert!(
        p.moe || p.epilogue != Epilogue::RouteScale,
        "router weights apply to grouped launches"
    );
    comptime_assert!(
        p.dyn_smem() + p.stages * p.weight_rows() * 16 <= 232448,
        "shared memory (the ring, the tiles and the scale words) is limited to 227 KiB per block"
    );
    let silu_epi = p.epilogue == Epilogue::SiluMul;
    let threads = p.wgs * 128;
    let rows = 64 * p.wgs * p.mt;
    // A ring slot (bf16 elements): the activations, two 64-k column blocks `[bn, 64]`, then the
    // packed weights: piece `(kq, r)` (block row `r`, k32 quarter `kq` of the chunk) at
    // `8 (kq rows + (r ^ 2 kq))` (the xor spreads both the copies and the reads over the
    // banks); its scale word at `4 r + kq` of the slot's `4 rows` words in `ssc`.
    let slot = p.bn * 128 + rows * 32;
    let sm = dyn_shared::<bf16>();
    let ssc = shared::<u32>(p.stages * 4 * p.wgs * 64 * p.mt);
    // With `bulk`, slot `s`'s mbarrier: its phase `u` completes when chunk `s + stages u`'s
    // weights have landed.
    let bars = shared::<u64>(p.stages);
    let tid = thread_idx_x();
    let h = tid / 128;
    let lane = lane_id();
    let g = lane / 4;
    let q = lane % 4;
    let wl = (tid % 128) / 32;
    let mblk = block_idx_x();
    let gpr = k / p.group;

    let mut expert = 0u32;
    if p.moe {
        expert = block_expert[mblk];
        if expert == u32::MAX {
            return;
        }
    }
    let by = block_idx_y();
    // The first weight row of each of this warpgroup's tiles ([`weight_row`]).
    let mut tbase = [0u32; p.mt];
    #[unroll]
    for u in 0..p.mt {
        tbase[u] = weight_row((h * p.mt + u) * 64, by, rows, p.mt, n, silu_epi);
    }
    if p.bulk {
        if tid == 0 {
            #[unroll]
            for st in 0..p.stages {
                mbar_init(&mut bars[st], 1u32);
            }
        }
        sync_threads();
    }
    // Interleaved: tiles of 8 rows x 128 k, 128 words each.
    let kbs = (k + 127u32) / 128u32;
    let wstride = if p.layout == Layout::Interleaved {
        (n + 7u32) / 8u32 * kbs * 128u32
    } else {
        n * (k / 8)
    };
    let wbase = expert * wstride;
    let sbase = expert * n * gpr;
    // What this thread's copies need that does not change with the chunk, so that a copy in the
    // loop costs an add, a compare and the `cp.async`. Activations: copy `v` is 16-byte chunk
    // `ac = tid % 16` of slot row `ar0 + 8 wgs v` (`ar0 = tid / 16`), at `adst + 512 wgs v` in
    // the slot, from `asrc[v] + 128 c` for chunk `c` (u32::MAX: a zero row).
    let acopies = (p.bn * 16 - 1) / threads + 1;
    let ac = tid % 16;
    let ar0 = tid / 16;
    let adst = (ac / 8) * p.bn * 64 + (ar0 / 8) * 512 + (ar0 % 8) * 64 + (((ac % 8) ^ (ar0 % 8)) * 8);
    let mut asrc = [0u32; acopies];
    #[unroll]
    for v in 0..acopies {
        let slot_row = mblk * p.bn + ar0 + 8 * p.wgs * v;
        asrc[v] = u32::MAX;
        if ar0 + 8 * p.wgs * v < p.bn {
            if p.moe {
                let pair = sorted[slot_row];
                if pair != u32::MAX {
                    asrc[v] = pair / a_div * k + ac * 8;
                }
            } else if slot_row < m {
                asrc[v] = slot_row * k + ac * 8;
            }
        }
    }
    // Weights: piece `v` is k32 quarter `wq = lane % 4` of block row `wr0 + 32 wgs v` (`wr0 =
    // 8 warp + lane / 4`, so a warp copies whole 512-byte interleaved tiles), at `wdst + 256
    // wgs v` in the slot, from `wsrc[v] + 128 c` (checkpoint: `+ 16 c`), its scale word from
    // `(ssrc[v] + c 128 / group) / 2` (u32::MAX: past N, zero-filled with a zero scale).
    let pieces = 2 * p.mt;
    let wq = lane % 4;
    let wr0 = 8 * (tid / 32) + lane / 4;
    let wdst = p.bn * 128 + (wq * rows + (wr0 ^ (2 * wq))) * 8;
    let mut wsrc = [0u32; 2 * p.mt];
    let mut ssrc = [0u32; 2 * p.mt];
    #[unroll]
    for v in 0..pieces {
        let row = weight_row(wr0 + 32 * p.wgs * v, by, rows, p.mt, n, silu_epi);
        wsrc[v] = u32::MAX;
        ssrc[v] = u32::MAX;
        if row < n {
            wsrc[v] = if p.layout == Layout::Interleaved {
                wbase + ((row / 8 * kbs) * 32 + (row % 8) * 4 + wq) * 4
            } else {
                wbase + row * (k / 8) + wq * 4
            };
            ssrc[v] = sbase + row * gpr + wq * 32 / p.group;
        }
    }
    let per = (kbs + grid_dim_z() - 1) / grid_dim_z();
    let c_lo = block_idx_z() * per;
    let c_hi = (c_lo + per).min(kbs);
    let nloc = if c_hi > c_lo { c_hi - c_lo } else { 0u32 };
    let mut acc = [[0.0f32; p.bn / 2]; p.mt];
    // A fragments of a chunk's 8 k16 steps per tile, two sets (chunk `j` in set `j % 2`).
    let mut af = [[0u32; 4]; 16 * p.mt];

    // Step `j` issues chunk `j - 2`'s `wgmma`s (A from set `j % 2`), waits for chunk `j - 1`'s
    // copies and the block's barrier, copies chunk `j + stages - 3` into the slot of chunk
    // `j - 3` (its `wgmma`s were waited for at the end of step `j - 1`, before every thread's
    // barrier of step `j`; step 0 copies chunks `0 .. stages - 2`), makes chunk `j - 1`'s A
    // fragments while chunk `j - 2`'s `wgmma`s run, then waits for them: `stages - 2` chunks
    // load while one is computed, no `wgmma` is in flight across the loop's back edge (ptxas
    // would serialize them), and the two fragment sets alternate in an unrolled pair of steps.
    for jj in 0..(nloc + 3) / 2 {
        #[unroll]
        for hf in 0..2 {
            let j = 2 * jj + hf;
            if j <= nloc + 1 {
                if j >= 2 {
                    let i = j - 2;
                    let bd = wgmma_desc(&sm[(i % p.stages) * slot]);
                    wgmma_fence();
                    #[unroll]
                    for kk in 0..8 {
                        #[unroll]
                        for u in 0..p.mt {
                            // k16 step `kk`: column block `kk / 4` (`bn * 64` elements, `bn * 8`
                            // descriptor units), 32 bytes per step inside it.
                            wgmma_bf16_rs(
                                &mut acc[u],
                                &af[(hf * 8 + kk) * p.mt + u],
                                bd + (kk / 4) * p.bn * 8 + 2 * (kk % 4),
                                true,
                            );
                        }
                    }
                    wgmma_commit();
                }
                if j >= 1 {
                    cp_async_wait(p.stages - 3);
                    fence_proxy_async();
                    sync_threads();
                }
                // Copies, one group per chunk: chunks `0 .. stages - 2` in step 0, then chunk
                // `j + stages - 3`.
                let lo = if j == 0 { 0u32 } else { j + p.stages - 3 };
                let hi = if j == 0 { p.stages - 2 } else { lo + 1 };
                for cl in lo..hi {
                    if cl < nloc {
                        let rs = (cl % p.stages) * slot;
                        let c = c_lo + cl;
                        // Columns left in the matrix from this chunk's first.
                        let lim = k - c * 128;
                        #[unroll]
                        for v in 0..acopies {
                            if (p.bn * 16) % threads == 0 || ar0 + 8 * p.wgs * v < p.bn {
                                let ok = asrc[v] != u32::MAX && ac * 8 < lim;
                                let src = if ok { asrc[v] + c * 128 } else { 0u32 };
                                cp_async_16_zfill(&mut sm[rs + adst + 512 * p.wgs * v], &a[src], ok);
                            }
                        }
                        #[unroll]
                        for v in 0..pieces {
                            let ok = wsrc[v] != u32::MAX && wq * 32 < lim;
                            if !p.bulk {
                                let step = if p.layout == Layout::Interleaved { 128u32 } else { 16u32 };
                                let src = if ok { wsrc[v] + c * step } else { 0u32 };
                                cp_async_16_zfill(&mut sm[rs + wdst + 256 * p.wgs * v], &w[src], ok);
                            }
                            let sw = if ok { (ssrc[v] + c * (128 / p.group)) / 2 } else { 0u32 };
                            cp_async_4_zfill(
                                &mut ssc[(cl % p.stages) * 4 * rows + 4 * (wr0 + 32 * p.wgs * v) + wq],
                                &scales[sw],
                                ok,
                            );
                        }
                        if p.bulk {
                            // Whole tiles, in their own lane order, at `256 t` in the slot.
                            let sl = cl % p.stages;
                            if tid == 0 {
                                mbar_arrive_tx(&mut bars[sl], rows * 64);
                            }
                            if tid < rows / 8 {
                                // Thread `t` copies the block's 8-row group `t` (one past N
                                // copies the matrix's first tile instead, read with zero scales).
                                let trow = weight_row(8 * tid, by, rows, p.mt, n, silu_epi);
                                let src = if trow < n {
                                    wbase + (trow / 8 * kbs + c) * 128
                                } else {
                                    wbase
                                };
                                cp_async_bulk(&mut sm[rs + p.bn * 128 + tid * 256], &w[src], 512u32, &mut bars[sl]);
                            }
                        }
                    }
                    cp_async_commit();
                }
                if j >= 1 && j - 1 < nloc {
                    // Rows `16 wl + g` and `+ 8` of each tile: per k32 quarter `kq` the packed
                    // words and their scales, then the A fragments of k16 steps `2 kq` and
                    // `2 kq + 1`.
                    let i = j - 1;
                    let c = c_lo + i;
                    let rs = (i % p.stages) * slot + p.bn * 128;
                    let ss = (i % p.stages) * 4 * rows;
                    if p.bulk {
                        mbar_wait(&bars[i % p.stages], (i / p.stages) % 2);
                    }
                    #[unroll]
                    for kq in 0..4 {
                        #[unroll]
                        for u in 0..p.mt {
                            let r0 = (h * p.mt + u) * 64 + 16 * wl + g;
                            let mut o0 = (kq * rows + (r0 ^ (2 * kq))) * 8;
                            let mut o1 = (kq * rows + ((r0 + 8) ^ (2 * kq))) * 8;
                            if p.bulk {
                                o0 = ((r0 / 8) * 32 + (r0 % 8) * 4 + kq) * 8;
                                o1 = o0 + 256;
                            }
                            let w0 = sm.vload(rs + o0);
                            let w1 = sm.vload(rs + o1);
                            let sw0 = ssc[ss + 4 * r0 + kq];
                            let sw1 = ssc[ss + 4 * (r0 + 8) + kq];
                            let si0 = sbase + (tbase[u] + 16 * wl + g) * gpr + (c * 128 + 32 * kq) / p.group;
                            let si1 = si0 + 8 * gpr;
                            let s0 = prmt(sw0, 0u32, if si0 % 2 == 1 { 0x3232u32 } else { 0x1010u32 });
                            let s1 = prmt(sw1, 0u32, if si1 % 2 == 1 { 0x3232u32 } else { 0x1010u32 });
                            let mut x0 = [0u32; 4];
                            let mut x1 = [0u32; 4];
                            x0[0] = w0.x;
                            x0[1] = w0.y;
                            x0[2] = w0.z;
                            x0[3] = w0.w;
                            x1[0] = w1.x;
                            x1[1] = w1.y;
                            x1[2] = w1.z;
                            x1[3] = w1.w;
                            #[unroll]
                            for k2 in 0..2 {
                                // k16 step `2 kq + k2`: words `2 k2` (its k 0..8) and `2 k2 + 1`
                                // (k 8..16), element pair `q` of each.
                                let f = ((1 - hf) * 8 + 2 * kq + k2) * p.mt + u;
                                #[unroll]
                                for e in 0..2 {
                                    if p.layout == Layout::Interleaved {
                                        af[f][2 * e] =
                                            dequant_pair(magic_pair_interleaved(x0[2 * k2 + e] >> (4 * q)), s0);
                                        af[f][2 * e + 1] =
                                            dequant_pair(magic_pair_interleaved(x1[2 * k2 + e] >> (4 * q)), s1);
                                    } else {
                                        af[f][2 * e] =
                                            dequant_pair(magic_pair_sequential(x0[2 * k2 + e] >> (8 * q)), s0);
                                        af[f][2 * e + 1] =
                                            dequant_pair(magic_pair_sequential(x1[2 * k2 + e] >> (8 * q)), s1);
                                    }
                                }
                            }
                        }
                    }
                }
                wgmma_wait(0);
            }
        }
    }

    // Accumulator `acc[u][4 j + e]`: weight row `tbase[u] + 16 wl + g + 8 (e / 2)`, A row slot
    // `mblk bn + 8 j + 2 q + e % 2`.
    #[unroll]
    for j in 0..p.bn / 8 {
        #[unroll]
        for c in 0..2 {
            let slot_row = mblk * p.bn + 8 * j + 2 * q + c;
            let mut o = u32::MAX;
            if p.moe {
                o = sorted[slot_row];
            } else if slot_row < m {
                o = slot_row;
            }
            if o != u32::MAX {
                #[unroll]
                for u in 0..p.mt {
                    #[unroll]
                    for e2 in 0..2 {
                        let v = acc[u][4 * j + 2 * e2 + c];
                        let wr = tbase[u] + 16 * wl + g + 8 * e2;
                        if p.splitk {
                            if wr < n {
                                part[(block_idx_z() * m + o) * n + wr] = v;
                            }
                        } else if silu_epi {
                            if u < p.mt / 2 {
                                let d = n / 2;
                                let col = wr;
                                if col < d {
                                    out[o * d + col] = (silu(v) * acc[u + p.mt / 2][4 * j + 2 * e2 + c]) as bf16;
                                }
                            }
                        } else if wr < n {
                            let mut y = v;
                            if p.epilogue == Epilogue::RouteScale {
                                y *= route_w[o];
                            }
                            if p.epilogue == Epilogue::Residual {
                                y += residual[o * n + wr] as f32;
                            }
                            out[o * n + wr] = y as bf16;
                        }
                    }
                }
            }
        }
    }
}
