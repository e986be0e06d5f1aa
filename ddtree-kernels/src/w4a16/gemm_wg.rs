//! `w4a16_gemm_wg`: the same product as [`super::W4a16Gemm`] (same arguments, layouts,
//! epilogues, split-K partials and MoE routing) on the Hopper warpgroup tensor cores
//! (`wgmma`), for the token counts where the tensor rate matters (M about 16 to 256).
//!
//! Design: the weights are the `wgmma` A operand (64 weight rows per m64 tile, `mt` tiles per
//! warpgroup, `wgs` warpgroups per block), the block's `bn` activation rows (tokens, or
//! token-expert pairs) the B operand, both K-major in 128-byte-swizzled shared memory; the
//! accumulators are `D[weight row, token]` in registers. K runs in k64 chunks through a
//! shared-memory ring of `stages` slots, each filled by one `cp.async` group: the chunk's
//! activations (zero-filled past M and K), its packed weights (each thread copies the 16-byte
//! pieces it will dequantize: 32 k of one row, in either layout) and their scale words. Per
//! chunk every thread dequantizes its pieces (`lop3` magic and `fma.rn.bf16x2`, the numerics of
//! the mma.sync kernels: `bf16(q * scale)`) into one of two dequantized weight tiles while the
//! previous chunk's `wgmma`s run; then one barrier, then this chunk's `wgmma`s (4 k16 steps per
//! m64 tile) are issued and left running while the ring slot freed by the previous chunk is
//! refilled `stages - 1` chunks ahead.
//!
//! The grid and the epilogues are those of [`super::W4a16Gemm`] with `bn` A rows and
//! `64 wgs mt` weight rows per block; SiLU-and-mul pairs tile `t` (gate rows) with tile
//! `t + mt / 2` (the matching up rows) of the same warpgroup, so both halves meet in one
//! thread's registers.

use std::sync::Arc;

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream};
use ddtree_runtime::{CompiledKernel, RuntimeError};

use super::gemm::{
    dequant_pair, magic_pair_interleaved, magic_pair_sequential, w4a16_kernel, Epilogue, GemmTiling, Layout, Tiling,
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
    /// m64 tiles of weight rows per warpgroup (1..=4; even for SiLU-and-mul).
    pub mt: u32,
    /// A rows (tokens or pairs) per block: the `wgmma` N (8, 16, 32, 64, 128 or 256).
    pub bn: u32,
    /// Ring slots (k64 chunks); `stages - 1` chunks are loading while one is computed.
    pub stages: u32,
    /// Output epilogue.
    pub epilogue: Epilogue,
    /// Write f32 partials per k split (finished by [`super::W4a16Reduce`]).
    pub splitk: bool,
    /// Grouped (MoE): A rows are token-expert pairs from `moe_align`.
    pub moe: bool,
}

impl W4a16WgParams {
    /// Weight rows per block.
    pub const fn weight_rows(&self) -> u32 {
        64 * self.wgs * self.mt
    }

    /// Bytes of dynamic shared memory: two dequantized bf16 weight tiles `[rows, 64]`, then the
    /// ring (per slot the activations `[bn, 64]` bf16 and the packed weights, 32 bytes a row).
    pub const fn dyn_smem(&self) -> u32 {
        2 * self.weight_rows() * 128 + self.stages * (self.bn * 128 + self.weight_rows() * 32)
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
    }
}

/// Candidates of the plain dense product: 256 weight rows per block (two warpgroups of two
/// tiles, or four of one) at N 64 and 128, 128-row blocks for more blocks per wave, small N
/// with split-K for M <= 32, N 256 for the largest M, the checkpoint layout and g64 / g128.
pub const WG_DENSE_SPACE: &[W4a16WgParams] = &[
    wg(2, 2, 64, 8, false),
    wg(2, 2, 128, 6, false),
    wg(4, 1, 64, 8, false),
    wg(4, 1, 128, 6, false),
    wg(2, 1, 64, 8, false),
    wg(2, 1, 128, 8, false),
    wg(2, 2, 16, 8, true),
    wg(2, 2, 32, 8, true),
    wg(2, 1, 256, 5, false),
    W4a16WgParams {
        layout: Layout::Checkpoint,
        ..wg(2, 2, 64, 8, false)
    },
    W4a16WgParams {
        group: 64,
        ..wg(2, 2, 64, 8, false)
    },
    W4a16WgParams {
        group: 128,
        ..wg(2, 2, 64, 8, false)
    },
];

/// Fused-epilogue and grouped variants.
pub const WG_FUSED_SPACE: &[W4a16WgParams] = &[
    W4a16WgParams {
        epilogue: Epilogue::SiluMul,
        ..wg(2, 2, 64, 8, false)
    },
    W4a16WgParams {
        epilogue: Epilogue::Residual,
        ..wg(2, 2, 64, 8, false)
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
];

/// Every candidate: [`WG_DENSE_SPACE`], then [`WG_FUSED_SPACE`].
pub fn wg_candidates() -> Vec<W4a16WgParams> {
    WG_DENSE_SPACE.iter().chain(WG_FUSED_SPACE).copied().collect()
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
    comptime_assert!(p.mt >= 1 && p.mt <= 4, "mt must be 1..=4");
    comptime_assert!(
        p.bn == 8 || p.bn == 16 || p.bn == 32 || p.bn == 64 || p.bn == 128 || p.bn == 256,
        "bn must be 8, 16, 32, 64, 128 or 256"
    );
    comptime_assert!(
        p.mt * p.bn <= 256,
        "mt * bn must be at most 256 (128 accumulator registers)"
    );
    comptime_assert!(p.stages >= 2 && p.stages <= 8, "stages must be 2..=8");
    comptime_assert!(
        p.epilogue != Epilogue::SiluMul || p.mt % 2 == 0,
        "SiLU-and-mul needs an even mt"
    );
    comptime_assert!(!(p.moe && p.splitk), "grouped launches do not split K");
    comptime_assert!(
        p.moe || p.epilogue != Epilogue::RouteScale,
        "router weights apply to grouped launches"
    );
    comptime_assert!(
        p.dyn_smem() + p.stages * p.mt * p.wgs * 128 * 4 <= 232448,
        "shared memory (the ring, the tiles and the scale words) is limited to 227 KiB per block"
    );
    let silu_epi = p.epilogue == Epilogue::SiluMul;
    let threads = p.wgs * 128;
    let rows = 64 * p.wgs * p.mt;
    // bf16 elements: the dequantized tiles (m64 tile `i` at 4096 i), then the ring slots (the
    // activations, then the packed weights: piece `i` at 8 i).
    let ring = 2 * rows * 64;
    let slot = p.bn * 64 + rows * 16;
    let sm = dyn_shared::<bf16>();
    let ssc = shared::<u32>(p.stages * p.mt * p.wgs * 128);
    let tid = thread_idx_x();
    let h = tid / 128;
    let wt = tid % 128;
    let lane = lane_id();
    let g = lane / 4;
    let q = lane % 4;
    let wl = wt / 32;
    let mblk = block_idx_x();
    let gpr = k / p.group;

    let mut expert = 0u32;
    if p.moe {
        expert = block_expert[mblk];
        if expert == u32::MAX {
            return;
        }
    }
    // First weight row of each of this warpgroup's tiles (SiLU-and-mul: gate tiles, then the
    // matching up tiles).
    let mut tbase = [0u32; p.mt];
    #[unroll]
    for t in 0..p.mt {
        if silu_epi {
            let half = p.mt / 2;
            let c0 = block_idx_y() * (rows / 2) + (h * half + t % half) * 64;
            tbase[t] = if t < half { c0 } else { n / 2 + c0 };
        } else {
            tbase[t] = block_idx_y() * rows + (h * p.mt + t) * 64;
        }
    }
    // Interleaved: tiles of 8 rows x 128 k, 128 words each.
    let wstride = if p.layout == Layout::Interleaved {
        (n + 7u32) / 8u32 * ((k + 127u32) / 128u32) * 128u32
    } else {
        n * (k / 8)
    };
    let wbase = expert * wstride;
    let sbase = expert * n * gpr;
    // This thread's pieces: row `wt / 2` of each tile, the k32 half `wt % 2` of every chunk.
    let pr = wt / 2;
    let qq = wt % 2;
    // The A rows of this thread's activation copies: row `idx / 8`, 16-byte chunk `idx % 8`
    // with `idx = tid + threads v` (u32::MAX: zero-filled).
    let acopies = (p.bn * 8 + threads - 1) / threads;
    let mut arow = [0u32; acopies];
    #[unroll]
    for v in 0..acopies {
        let idx = tid + threads * v;
        let slot_row = mblk * p.bn + idx / 8;
        arow[v] = u32::MAX;
        if idx < p.bn * 8 {
            if p.moe {
                let pair = sorted[slot_row];
                arow[v] = if pair == u32::MAX { u32::MAX } else { pair / a_div };
            } else if slot_row < m {
                arow[v] = slot_row;
            }
        }
    }

    let nk = (k + 63u32) / 64u32;
    let per = (nk + grid_dim_z() - 1) / grid_dim_z();
    let c_lo = block_idx_z() * per;
    let c_hi = (c_lo + per).min(nk);
    let nloc = if c_hi > c_lo { c_hi - c_lo } else { 0u32 };
    let mut acc = [[0.0f32; p.bn / 2]; p.mt];

    // Issues chunk `i`'s copies into ring slot `i % stages` (nothing past the split's end),
    // then closes the group.
    for it in 0..nloc + p.stages - 1 {
        if it + 1 >= p.stages {
            // Chunk `i` (this thread's copies) has landed.
            let i = it + 1 - p.stages;
            let c = c_lo + i;
            let rs = ring + (i % p.stages) * slot;
            cp_async_wait(p.stages - 2);
            // Dequantize this thread's pieces of chunk `i` into tile set `i % 2` (last read by
            // chunk `i - 2`'s `wgmma`s, which this warpgroup waited for).
            let dq = (i % 2) * rows * 64;
            #[unroll]
            for u in 0..p.mt {
                let raw = sm.vload(rs + p.bn * 64 + (u * threads + tid) * 8);
                let sw = ssc[((i % p.stages) * p.mt + u) * threads + tid];
                let sidx = sbase + (tbase[u] + pr) * gpr + (c * 64 + 32 * qq) / p.group;
                let s2 = prmt(sw, 0u32, if sidx % 2 == 1 { 0x3232u32 } else { 0x1010u32 });
                let mut o = raw;
                let mut words = [0u32; 4];
                words[0] = raw.x;
                words[1] = raw.y;
                words[2] = raw.z;
                words[3] = raw.w;
                #[unroll]
                for j in 0..4 {
                    let x = words[j];
                    let mut d = [0u32; 4];
                    #[unroll]
                    for e in 0..4 {
                        if p.layout == Layout::Interleaved {
                            d[e] = dequant_pair(magic_pair_interleaved(x >> (4 * e)), s2);
                        } else {
                            d[e] = dequant_pair(magic_pair_sequential(x >> (8 * e)), s2);
                        }
                    }
                    o.x = d[0];
                    o.y = d[1];
                    o.z = d[2];
                    o.w = d[3];
                    let dst =
                        dq + (h * p.mt + u) * 4096 + (pr / 8) * 512 + (pr % 8) * 64 + ((4 * qq + j) ^ (pr % 8)) * 8;
                    sm.vstore(dst, o);
                }
            }
            // Chunk `i - 1`'s `wgmma`s are done (their ring slot is refilled below), then every
            // thread's stores and landed copies become visible to this chunk's `wgmma`s.
            wgmma_wait(0);
            fence_proxy_async();
            sync_threads();
            let bd = wgmma_desc(&sm[rs]);
            wgmma_fence();
            #[unroll]
            for u in 0..p.mt {
                let ad = wgmma_desc(&sm[dq + (h * p.mt + u) * 4096]);
                #[unroll]
                for kk in 0..4 {
                    wgmma_bf16_ss(&mut acc[u], ad + 2 * kk, bd + 2 * kk);
                }
            }
            wgmma_commit();
        }
        // Copies of chunk `it` into the slot chunk `it - stages` used.
        if it < nloc {
            let c = c_lo + it;
            let rs = ring + (it % p.stages) * slot;
            #[unroll]
            for v in 0..acopies {
                let idx = tid + threads * v;
                if idx < p.bn * 8 {
                    let r = idx / 8;
                    let cc = idx % 8;
                    let kk = c * 64 + cc * 8;
                    let ok = arow[v] != u32::MAX && kk < k;
                    let src = if ok { arow[v] * k + kk } else { 0u32 };
                    let dst = rs + (r / 8) * 512 + (r % 8) * 64 + ((cc ^ (r % 8)) * 8);
                    cp_async_16_zfill(&mut sm[dst], &a[src], ok);
                }
            }
            #[unroll]
            for u in 0..p.mt {
                let row = tbase[u] + pr;
                let kq = 2 * c + qq;
                let ok = row < n && kq * 32 < k;
                let mut src = 0u32;
                let mut ssrc = 0u32;
                if ok {
                    src = if p.layout == Layout::Interleaved {
                        wbase + ((row / 8 * ((k + 127u32) / 128u32) + kq / 4) * 32 + (row % 8) * 4 + kq % 4) * 4
                    } else {
                        wbase + row * (k / 8) + kq * 4
                    };
                    ssrc = (sbase + row * gpr + kq * 32 / p.group) / 2;
                }
                cp_async_16_zfill(&mut sm[rs + p.bn * 64 + (u * threads + tid) * 8], &w[src], ok);
                cp_async_4_zfill(
                    &mut ssc[((it % p.stages) * p.mt + u) * threads + tid],
                    &scales[ssrc],
                    ok,
                );
            }
        }
        cp_async_commit();
    }
    wgmma_wait(0);

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
