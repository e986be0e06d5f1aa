//! `w4a16_gemm`: `out[M, N] = A[M, K] (bf16) x dequant(W)[N, K]^T` with W symmetric INT4 and a
//! bf16 scale per `group` along K, on `mma.sync.m16n8k16` tensor cores; dense or grouped (MoE).
//!
//! Design (bandwidth first): the weights never go through shared memory. Each lane of a warp
//! loads 128 bits of packed weights per n8 x k128 tile and those 32 nibbles *are* its B
//! fragments for 8 mma steps: the mma sums over k, so A and B only need the same permutation
//! of k. Lane `(g, q)` = `(lane / 4, lane % 4)` takes row `g` of the tile and the 32
//! consecutive k at `32 q` (one scale group for g32), word `j` the 8 k at `32 q + 8 j`, and
//! mma step `(j, h)` the 4 k at `32 q + 8 j + 4 h`. A is read with the same permutation as
//! 128-bit loads of 8 consecutive bf16 straight into the A fragment registers. This is the
//! checkpoint's own layout, so [`Layout::Checkpoint`] needs no repack; [`Layout::Interleaved`]
//! stores each tile's 512 bytes contiguously with nibbles in `0,2,4,6,1,3,5,7` order so one
//! `lop3` with the 0x4300 magic makes a bf16 pair `128 + nibble` (`q + 136`); two
//! `fma.rn.bf16x2` subtract 136 (exact) and apply the scale.
//!
//! Each warp streams its k128 tiles through a register ring of `stages` slots: a slot is
//! refilled (plain predicated loads that only write registers) as soon as it has been consumed,
//! so the loads of about `stages` tiles are always in flight while the warp computes. Scales are
//! read as the raw words holding two bf16 (picked with one `prmt` when used), so no instruction
//! waits on a load before the round that consumes it. With `aring` (one m tile) the ring also
//! carries A; otherwise A (small and hot in L1/L2) is read when its tile is computed, which
//! leaves the registers to a deeper weight ring;
//! with half m tiles (`m8`, M <= 8) rows 8..16 of the mma's A fragment are zero and never loaded.
//!
//! Numerics: the dequantized weight is `bf16(q * scale)` (one `fma.rn.bf16x2`), products and
//! sums are f32 in the mma, and the epilogue rounds once to bf16.
//!
//! A block is `warps` warps side by side along N, each owning `nt` n8 tiles and all `mt` m16
//! tiles (weights are dequantized once per block and reused for every m tile). The grid is
//! `(m blocks, n blocks, k splits)`: m blocks vary fastest so blocks that read the same weights
//! run together and share them through L2. With `splitk` every split writes f32 partials and
//! [`W4a16Reduce`] sums them and applies the epilogue.

use std::sync::Arc;

use ddtree_codegen::dsl::*;
use ddtree_codegen::Kernel;
use ddtree_macros::{device_fn, kernel, KernelParams};
use ddtree_runtime::cudarc::driver::{CudaSlice, CudaStream};
use ddtree_runtime::{CompiledKernel, RuntimeError};

use crate::silu_mul::silu;

/// Weight layout a variant reads (the unpack order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub enum Layout {
    /// The compressed-tensors checkpoint as is: `[N, K/8]` words, sequential nibbles.
    Checkpoint,
    /// Tiles of 8 rows x 128 k, 512 contiguous bytes each, nibbles in `0,2,4,6,1,3,5,7` order
    /// (see [`super::layout::repack_interleaved`]).
    Interleaved,
}

/// What happens to the f32 accumulators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub enum Epilogue {
    /// `out = acc` (bf16).
    Plain,
    /// Fused gate_up (`N = 2 d`, gate rows first): `out[:, c] = silu(acc[:, c]) * acc[:, d + c]`.
    SiluMul,
    /// `out = acc + residual` (`residual` is `[M, N]` bf16).
    Residual,
    /// `out = acc * route_w[row]` (MoE down projection: rows are token-expert pairs).
    RouteScale,
}

/// Compile-time parameters of [`W4a16Gemm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub struct W4a16Params {
    /// Scale group size along K: 32, 64 or 128.
    pub group: u32,
    /// Weight layout / unpack order.
    pub layout: Layout,
    /// Warps per block, side by side along N.
    pub warps: u32,
    /// n8 tiles per warp (even for [`Epilogue::SiluMul`]: half gate, half up).
    pub nt: u32,
    /// m16 tiles per block (rows per block = 16 mt, or 8 with `m8`).
    pub mt: u32,
    /// Half m tiles: only rows `0..8` of the single m16 tile hold A rows (the other half of the
    /// mma's A fragment is zero and never loaded). For M <= 8 (decode); needs `mt == 1`.
    pub m8: bool,
    /// Pipeline depth: k128 tiles in each warp's register ring; the loads of `stages` tiles
    /// are in flight while the warp computes (weight bytes in flight per warp = 512 nt stages).
    /// With `aring` the ring also carries A.
    pub stages: u32,
    /// A rides the register ring with the weights (needs `mt == 1`); otherwise it is read from
    /// global memory (L1/L2) when its tile is computed.
    pub aring: bool,
    /// Output epilogue.
    pub epilogue: Epilogue,
    /// Write f32 partials per k split (finished by [`W4a16Reduce`]).
    pub splitk: bool,
    /// Grouped (MoE): rows are token-expert pairs from `moe_align`.
    pub moe: bool,
}

const fn dense(group: u32, layout: Layout, warps: u32, nt: u32, mt: u32, stages: u32, splitk: bool) -> W4a16Params {
    W4a16Params {
        group,
        layout,
        warps,
        nt,
        mt,
        m8: false,
        stages,
        aring: mt == 1,
        epilogue: Epilogue::Plain,
        splitk,
        moe: false,
    }
}

const I: Layout = Layout::Interleaved;
const C: Layout = Layout::Checkpoint;

/// A [`dense`] variant with half m tiles (M <= 8).
const fn dense8(group: u32, layout: Layout, warps: u32, nt: u32, stages: u32) -> W4a16Params {
    W4a16Params {
        m8: true,
        ..dense(group, layout, warps, nt, 1, stages, true)
    }
}

/// A [`dense8`] variant that reads A when its tile is computed: the 32 registers per stage the
/// A ring takes go to the weights (deeper rings or more n tiles at the same occupancy).
const fn dense8_direct(nt: u32, stages: u32) -> W4a16Params {
    W4a16Params {
        aring: false,
        ..dense8(32, I, 4, nt, stages)
    }
}

/// Candidates of the plain dense GEMM (the bench tries each with several k splits): split-K
/// single-m-tile ones for small M (A rides the ring), half m tiles for M <= 8 (A in the ring, or
/// read directly with a deeper weight ring), several m tiles for larger M, and g64 / g128 ones.
pub const DENSE_SPACE: &[W4a16Params] = &[
    dense(32, I, 4, 4, 1, 2, true),
    dense8(32, I, 4, 4, 2),
    dense8(32, I, 4, 4, 3),
    dense8(32, I, 4, 8, 2),
    dense8(32, I, 8, 4, 2),
    dense8(32, I, 4, 2, 4),
    dense(32, I, 4, 4, 1, 3, true),
    dense(32, I, 4, 8, 1, 2, true),
    dense8(32, C, 4, 4, 2),
    dense(32, C, 4, 4, 1, 2, true),
    dense(32, I, 4, 4, 2, 2, true),
    dense(32, I, 4, 4, 2, 2, false),
    dense(32, I, 4, 4, 4, 1, false),
    dense(32, I, 8, 4, 4, 1, false),
    dense(32, I, 4, 8, 2, 1, false),
    dense(32, I, 4, 2, 4, 2, false),
    dense(32, C, 4, 4, 4, 1, false),
    dense8(64, I, 4, 4, 2),
    dense8(128, I, 4, 4, 2),
    dense(64, C, 4, 4, 2, 2, false),
    dense(128, C, 4, 4, 2, 2, false),
    dense8_direct(4, 2),
    dense8_direct(4, 3),
    dense8_direct(4, 4),
    dense8_direct(8, 2),
];

/// Fused-epilogue and grouped variants (the engine's gate_up, residual and MoE launches).
pub const FUSED_SPACE: &[W4a16Params] = &[
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        ..dense(32, I, 4, 4, 1, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        ..dense(32, C, 4, 4, 2, 1, false)
    },
    W4a16Params {
        epilogue: Epilogue::Residual,
        ..dense(32, I, 4, 4, 1, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        ..dense8(32, I, 4, 4, 2)
    },
    W4a16Params {
        epilogue: Epilogue::Residual,
        ..dense(32, I, 4, 4, 1, 2, true)
    },
    W4a16Params {
        epilogue: Epilogue::Residual,
        ..dense(64, C, 4, 4, 2, 1, false)
    },
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        moe: true,
        ..dense(32, I, 4, 4, 1, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::RouteScale,
        moe: true,
        ..dense(32, I, 4, 4, 1, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        moe: true,
        m8: true,
        ..dense(32, I, 4, 4, 1, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::RouteScale,
        moe: true,
        m8: true,
        ..dense(32, I, 4, 4, 1, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        moe: true,
        m8: true,
        aring: false,
        ..dense(32, I, 4, 4, 1, 4, false)
    },
    W4a16Params {
        epilogue: Epilogue::RouteScale,
        moe: true,
        m8: true,
        aring: false,
        ..dense(32, I, 4, 4, 1, 4, false)
    },
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        moe: true,
        ..dense(32, I, 4, 4, 2, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::RouteScale,
        moe: true,
        ..dense(32, I, 4, 4, 2, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::SiluMul,
        moe: true,
        ..dense(32, C, 4, 4, 1, 2, false)
    },
    W4a16Params {
        epilogue: Epilogue::RouteScale,
        moe: true,
        ..dense(32, C, 4, 4, 1, 2, false)
    },
];

/// Every candidate: [`DENSE_SPACE`], then [`FUSED_SPACE`].
pub fn candidates() -> Vec<W4a16Params> {
    DENSE_SPACE.iter().chain(FUSED_SPACE).copied().collect()
}

/// bf16 pair `128 + nibble` from nibbles `(i, i + 4)` of `x >> 4i` (interleaved words).
#[device_fn]
pub fn magic_pair_interleaved(y: u32) -> u32 {
    lop3(y, 0x000f000fu32, 0x43004300u32, 0xea)
}

/// bf16 pair `128 + nibble` from nibbles `(0, 1)` of `y` (checkpoint words).
#[device_fn]
pub fn magic_pair_sequential(y: u32) -> u32 {
    lop3(
        y << 12u32,
        0x000f0000u32,
        lop3(y, 0x0000000fu32, 0x43004300u32, 0xea),
        0xea,
    )
}

/// `(pair - 136) * scale` on two bf16 lanes: the signed code (exact) times the scale pair.
#[device_fn]
pub fn dequant_pair(pair: u32, scale2: u32) -> u32 {
    fma_bf16x2(fma_bf16x2(pair, 0x3f803f80u32, 0xc308c308u32), scale2, 0x80008000u32)
}

/// `a` `[M, K]` bf16 (MoE: `[T, K]` tokens, or `[pairs, K]`), `w` packed weights in `p.layout`
/// (MoE: experts stacked), `scales` the bf16 `[N, K/group]` scales (stacked) as u32 words, two
/// per word, low half first ([`super::layout::scale_words`]), `residual` `[M, N]`, `out` `[M, N]`
/// (`[M, N/2]` for SiLU-and-mul; MoE: rows are pair ids), `part` `[splits, M, N]` f32 partials,
/// `sorted` / `block_expert` the MoE routing from `moe_align`, `route_w` per-pair router
/// weights, `a_div` pair -> A row divisor (top-k for gate_up, 1 for down). Unused buffers may
/// be any non-empty buffer. Needs `k % 32 == 0`, `k % group == 0`; the interleaved layout with
/// SiLU-and-mul needs `(n / 2) % 8 == 0`. Grid: `(ceil(m / rows_per_block), ceil(cols / (warps nt 8)),
/// splits)` with `cols` the output columns (`n / 2` for SiLU-and-mul, which covers both halves).
#[kernel(block = p.warps * 32, space = candidates())]
pub fn w4a16_gemm(
    #[comptime] p: &W4a16Params,
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
    comptime_assert!(p.warps >= 1 && p.warps <= 16, "warps must be 1..=16");
    comptime_assert!(
        p.nt >= 1 && p.nt <= 8 && p.mt >= 1 && p.mt <= 8,
        "nt and mt must be 1..=8"
    );
    comptime_assert!(p.stages >= 1 && p.stages <= 4, "stages must be 1..=4");
    comptime_assert!(!p.m8 || p.mt == 1, "half m tiles need mt == 1");
    comptime_assert!(!p.aring || p.mt == 1, "A rides the ring only with mt == 1");
    comptime_assert!(
        p.epilogue != Epilogue::SiluMul || p.nt % 2 == 0,
        "SiLU-and-mul needs an even nt"
    );
    comptime_assert!(!(p.moe && p.splitk), "grouped launches do not split K");
    comptime_assert!(
        p.moe || p.epilogue != Epilogue::RouteScale,
        "router weights apply to grouped launches"
    );
    let silu_epi = p.epilogue == Epilogue::SiluMul;
    let half = p.nt / 2;
    let wcols = if silu_epi { half * 8 } else { p.nt * 8 };
    let bm = if p.m8 { 8 } else { p.mt * 16 };
    let lane = lane_id();
    let g = lane / 4;
    let q = lane % 4;
    let mblk = block_idx_x();
    let kbs = (k + 127u32) / 128u32;
    let gpr = k / p.group;

    let mut expert = 0u32;
    if p.moe {
        expert = block_expert[mblk];
        if expert == u32::MAX {
            return;
        }
    }
    // Rows g and g + 8 of each m tile: A row and output row (u32::MAX = none).
    let mut arow = [0u32; 2 * p.mt];
    let mut orow = [0u32; 2 * p.mt];
    #[unroll]
    for r in 0..2 * p.mt {
        let slot = mblk * bm + r * 8 + g;
        if p.m8 && r == 1 {
            orow[r] = u32::MAX;
            arow[r] = u32::MAX;
        } else if p.moe {
            let pair = sorted[slot];
            orow[r] = pair;
            arow[r] = if pair == u32::MAX { u32::MAX } else { pair / a_div };
        } else {
            orow[r] = if slot < m { slot } else { u32::MAX };
            arow[r] = orow[r];
        }
    }
    // First weight row of each n8 tile (SiLU-and-mul: gate tiles, then the matching up tiles).
    let c0 = (block_idx_y() * p.warps + warp_id()) * wcols;
    let mut wrow = [0u32; p.nt];
    #[unroll]
    for j in 0..p.nt {
        if silu_epi {
            wrow[j] = if j < half {
                c0 + j * 8
            } else {
                n / 2 + c0 + (j - half) * 8
            };
        } else {
            wrow[j] = c0 + j * 8;
        }
    }
    let wstride = if p.layout == Layout::Interleaved {
        (n + 7u32) / 8u32 * kbs * 128u32
    } else {
        n * (k / 8)
    };
    let wbase = expert * wstride;
    let sbase = expert * n * gpr;
    let per = (kbs + grid_dim_z() - 1) / grid_dim_z();
    let kb_lo = block_idx_z() * per;
    let kb_hi = (kb_lo + per).min(kbs);

    let mut acc = [[0.0f32; 4]; p.mt * p.nt];
    // The ring: slot `u` holds one k128 tile's weights, scale words and (with `aring`) A.
    let mut wq = [[0u32; 4]; p.nt * p.stages];
    let mut sc = [0u32; p.nt * p.stages];
    let mut ar = [[0u32; 4]; 2 * 4 * p.stages];
    let mut av = [[0u32; 4]; 2 * p.mt];
    let mut af = [[0u32; 4]; p.mt];
    let mut bf = [[0u32; 2]; 1];
    let a_ring = p.aring;
    let arows = if p.m8 { 1 } else { 2 };
    let ntiles = if kb_hi > kb_lo { kb_hi - kb_lo } else { 0u32 };
    // Round `rr` computes tiles `kb_lo + (rr - 1) stages + u` from the ring, and right after
    // each slot is consumed refills it with the tile `stages` later: every warp keeps about
    // `stages` tiles of loads in flight while it computes. Loads only write registers
    // (predicated), so nothing waits for them before the round that consumes them.
    for rr in 0..(ntiles + p.stages - 1) / p.stages + 1 {
        #[unroll]
        for u in 0..p.stages {
            let kc = kb_lo + rr * p.stages + u;
            if rr > 0 && kc - p.stages < kb_hi {
                let kb = kc - p.stages;
                let kk = kb * 128 + 32 * q;
                let kok = kk < k;
                #[unroll]
                for jj in 0..4 {
                    // 8 bf16 of A at k = kk + 8 jj for rows g and g + 8 of every m tile.
                    #[unroll]
                    for r in 0..2 * p.mt {
                        // (With half m tiles, rows g + 8 are empty and never read.)
                        if p.m8 && r == 1 {
                            av[r][0] = 0u32;
                        } else if a_ring {
                            av[r][0] = ar[(u * 2 + r) * 4 + jj][0];
                            av[r][1] = ar[(u * 2 + r) * 4 + jj][1];
                            av[r][2] = ar[(u * 2 + r) * 4 + jj][2];
                            av[r][3] = ar[(u * 2 + r) * 4 + jj][3];
                        } else {
                            let ok = kok && arow[r] != u32::MAX;
                            let v = a.vload(if ok { arow[r] * k + kk + 8 * jj } else { 0u32 });
                            av[r][0] = if ok { v.x } else { 0u32 };
                            av[r][1] = if ok { v.y } else { 0u32 };
                            av[r][2] = if ok { v.z } else { 0u32 };
                            av[r][3] = if ok { v.w } else { 0u32 };
                        }
                    }
                    #[unroll]
                    for h in 0..2 {
                        #[unroll]
                        for i in 0..p.mt {
                            af[i][0] = av[2 * i][2 * h];
                            af[i][2] = av[2 * i][2 * h + 1];
                            if p.m8 {
                                af[i][1] = 0u32;
                                af[i][3] = 0u32;
                            } else {
                                af[i][1] = av[2 * i + 1][2 * h];
                                af[i][3] = av[2 * i + 1][2 * h + 1];
                            }
                        }
                        #[unroll]
                        for j in 0..p.nt {
                            let x = wq[j * p.stages + u][jj];
                            // The bf16 scale in both halves, from its word (two scales per word).
                            let sidx = sbase + (wrow[j] + g) * gpr + kk / p.group;
                            let s2 = prmt(
                                sc[j * p.stages + u],
                                0u32,
                                if sidx % 2 == 1 { 0x3232u32 } else { 0x1010u32 },
                            );
                            if p.layout == Layout::Interleaved {
                                bf[0][0] = dequant_pair(magic_pair_interleaved(x >> (8 * h)), s2);
                                bf[0][1] = dequant_pair(magic_pair_interleaved(x >> (8 * h + 4)), s2);
                            } else {
                                bf[0][0] = dequant_pair(magic_pair_sequential(x >> (16 * h)), s2);
                                bf[0][1] = dequant_pair(magic_pair_sequential(x >> (16 * h + 8)), s2);
                            }
                            #[unroll]
                            for i in 0..p.mt {
                                mma_m16n8k16_bf16(&mut acc[i * p.nt + j], &af[i], &bf[0]);
                            }
                        }
                    }
                }
            }
            // Refill slot u with tile kc: weights, scale words, and A when it rides the ring.
            let kk = kc * 128 + 32 * q;
            #[unroll]
            for j in 0..p.nt {
                let row = wrow[j] + g;
                if kc < kb_hi && kk < k && row < n {
                    let widx = if p.layout == Layout::Interleaved {
                        wbase + ((wrow[j] / 8 * kbs + kc) * 32 + lane) * 4
                    } else {
                        wbase + row * (k / 8) + kk / 8
                    };
                    let v = w.vload(widx);
                    wq[j * p.stages + u][0] = v.x;
                    wq[j * p.stages + u][1] = v.y;
                    wq[j * p.stages + u][2] = v.z;
                    wq[j * p.stages + u][3] = v.w;
                    sc[j * p.stages + u] = scales[(sbase + row * gpr + kk / p.group) / 2];
                } else {
                    // Scale 0 zeroes whatever codes the slot holds.
                    sc[j * p.stages + u] = 0u32;
                }
            }
            if a_ring {
                #[unroll]
                for r in 0..arows {
                    #[unroll]
                    for jj in 0..4 {
                        if kc < kb_hi && kk < k && arow[r] != u32::MAX {
                            let v = a.vload(arow[r] * k + kk + 8 * jj);
                            ar[(u * 2 + r) * 4 + jj][0] = v.x;
                            ar[(u * 2 + r) * 4 + jj][1] = v.y;
                            ar[(u * 2 + r) * 4 + jj][2] = v.z;
                            ar[(u * 2 + r) * 4 + jj][3] = v.w;
                        } else {
                            ar[(u * 2 + r) * 4 + jj][0] = 0u32;
                            ar[(u * 2 + r) * 4 + jj][1] = 0u32;
                            ar[(u * 2 + r) * 4 + jj][2] = 0u32;
                            ar[(u * 2 + r) * 4 + jj][3] = 0u32;
                        }
                    }
                }
            }
        }
    }

    // Accumulator (row g or g + 8, columns 2q and 2q + 1 of each n8 tile).
    #[unroll]
    for r in 0..2 * p.mt {
        let o = orow[r];
        let i = r / 2;
        let e = (r % 2) * 2;
        if o != u32::MAX {
            if p.splitk {
                #[unroll]
                for j in 0..p.nt {
                    let col = wrow[j] + 2 * q;
                    let base = (block_idx_z() * m + o) * n + col;
                    if col < n {
                        part[base] = acc[i * p.nt + j][e];
                    }
                    if col + 1 < n {
                        part[base + 1] = acc[i * p.nt + j][e + 1];
                    }
                }
            } else if silu_epi {
                let d = n / 2;
                #[unroll]
                for j in 0..half {
                    let col = c0 + j * 8 + 2 * q;
                    if col < d {
                        out[o * d + col] = (silu(acc[i * p.nt + j][e]) * acc[i * p.nt + j + half][e]) as bf16;
                    }
                    if col + 1 < d {
                        out[o * d + col + 1] =
                            (silu(acc[i * p.nt + j][e + 1]) * acc[i * p.nt + j + half][e + 1]) as bf16;
                    }
                }
            } else {
                let mut scale = 1.0f32;
                if p.epilogue == Epilogue::RouteScale {
                    scale = route_w[o];
                }
                #[unroll]
                for j in 0..p.nt {
                    let col = wrow[j] + 2 * q;
                    #[unroll]
                    for c in 0..2 {
                        if col + c < n {
                            let mut v = acc[i * p.nt + j][e + c] * scale;
                            if p.epilogue == Epilogue::Residual {
                                v += residual[o * n + col + c] as f32;
                            }
                            out[o * n + col + c] = v as bf16;
                        }
                    }
                }
            }
        }
    }
}

/// Compile-time parameters of [`W4a16Reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub struct ReduceParams {
    /// Threads per block.
    pub block: u32,
    /// Epilogue applied to the summed partials ([`Epilogue::RouteScale`] is not offered).
    pub epilogue: Epilogue,
}

/// Sums `splits` f32 partials `[splits, m, n]` and writes `out` with the epilogue (`[m, n]`, or
/// `[m, n / 2]` for SiLU-and-mul). Any grid: the kernel strides over the outputs.
#[kernel(block = p.block, space = [
    ReduceParams { block: 256, epilogue: Epilogue::Plain },
    ReduceParams { block: 256, epilogue: Epilogue::SiluMul },
    ReduceParams { block: 256, epilogue: Epilogue::Residual },
])]
pub fn w4a16_reduce(
    #[comptime] p: &ReduceParams,
    part: &[f32],
    residual: &[bf16],
    out: &mut [bf16],
    m: u32,
    n: u32,
    splits: u32,
) {
    comptime_assert!(
        p.epilogue != Epilogue::RouteScale,
        "router weights are applied by the grouped GEMM"
    );
    let cols = if p.epilogue == Epilogue::SiluMul { n / 2 } else { n };
    let stride = grid_dim_x() * p.block;
    for e in (block_idx_x() * p.block + thread_idx_x()..m * cols).step_by(stride) {
        let r = e / cols;
        let c = e % cols;
        let mut v = 0.0f32;
        let mut u = 0.0f32;
        for s in 0..splits {
            v += part[(s * m + r) * n + c];
            if p.epilogue == Epilogue::SiluMul {
                u += part[(s * m + r) * n + cols + c];
            }
        }
        if p.epilogue == Epilogue::SiluMul {
            v = silu(v) * u;
        }
        if p.epilogue == Epilogue::Residual {
            v += residual[e] as f32;
        }
        out[e] = v as bf16;
    }
}

/// Scratch buffers for launches: the split-K partials and one-element stand-ins for the
/// buffers a variant does not read.
#[derive(Debug)]
pub struct Scratch {
    /// f32 partials `[splits, m, n]`.
    pub part: CudaSlice<f32>,
    none_u32: CudaSlice<u32>,
    none_f32: CudaSlice<f32>,
    none_bf16: CudaSlice<bf16>,
    none_out: CudaSlice<bf16>,
}

impl Scratch {
    /// Scratch with room for `part_len` partial sums.
    pub fn new(s: &Arc<CudaStream>, part_len: usize) -> Result<Scratch, RuntimeError> {
        let drv = |source| RuntimeError::Driver {
            context: "allocating W4A16 scratch".into(),
            source,
        };
        Ok(Scratch {
            part: s.alloc_zeros::<f32>(part_len.max(1)).map_err(drv)?,
            none_u32: s.alloc_zeros::<u32>(1).map_err(drv)?,
            none_f32: s.alloc_zeros::<f32>(1).map_err(drv)?,
            none_bf16: s.alloc_zeros::<bf16>(1).map_err(drv)?,
            none_out: s.alloc_zeros::<bf16>(1).map_err(drv)?,
        })
    }
}

/// MoE routing produced by `moe_align`, read by grouped launches.
#[derive(Clone, Copy, Debug)]
pub struct Routing<'a> {
    /// Pair ids per slot, `[max_blocks * rows_per_block]` (`u32::MAX` = padding).
    pub sorted: &'a CudaSlice<u32>,
    /// Expert of each block, `[max_blocks]` (`u32::MAX` = unused block).
    pub block_expert: &'a CudaSlice<u32>,
    /// Router weight per pair (read by [`Epilogue::RouteScale`]).
    pub route_w: Option<&'a CudaSlice<f32>>,
    /// Upper bound on the number of blocks (the grid's x).
    pub max_blocks: u32,
    /// Pair id -> A row divisor (top-k for gate_up, 1 for down).
    pub a_div: u32,
}

/// Inputs of one `w4a16_gemm` launch.
#[derive(Clone, Copy, Debug)]
pub struct GemmArgs<'a> {
    /// Activations.
    pub a: &'a CudaSlice<bf16>,
    /// Packed weights in the variant's layout.
    pub w: &'a CudaSlice<u32>,
    /// Scales `[N, K/group]` (experts stacked) as words ([`super::layout::scale_words`]).
    pub scales: &'a CudaSlice<u32>,
    /// Residual `[M, N]` for [`Epilogue::Residual`].
    pub residual: Option<&'a CudaSlice<bf16>>,
    /// Routing for grouped variants.
    pub routing: Option<Routing<'a>>,
    /// Rows (dense) or token-expert pairs (grouped).
    pub m: u32,
    /// Weight rows per expert.
    pub n: u32,
    /// Reduction length.
    pub k: u32,
}

/// How a W4A16 GEMM variant tiles its launch: what the launcher, the checks and the bench
/// read off either kernel's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiling {
    /// Scale group size along K.
    pub group: u32,
    /// Weight layout.
    pub layout: Layout,
    /// Output epilogue.
    pub epilogue: Epilogue,
    /// Writes f32 partials per k split.
    pub splitk: bool,
    /// Grouped (MoE).
    pub moe: bool,
    /// A rows (dense) or pair slots (grouped) per block.
    pub rows: u32,
    /// Weight rows per block (both halves for SiLU-and-mul).
    pub weight_rows: u32,
}

/// Parameters of a W4A16 GEMM kernel ([`W4a16Params`], [`super::W4a16WgParams`]).
pub trait GemmTiling {
    /// The variant's tiling.
    fn tiling(&self) -> Tiling;
}

impl GemmTiling for W4a16Params {
    fn tiling(&self) -> Tiling {
        Tiling {
            group: self.group,
            layout: self.layout,
            epilogue: self.epilogue,
            splitk: self.splitk,
            moe: self.moe,
            rows: if self.m8 { 8 } else { 16 * self.mt },
            weight_rows: self.warps * self.nt * 8,
        }
    }
}

/// A W4A16 GEMM kernel: [`W4a16Gemm`] or [`super::W4a16GemmWg`], which take the same
/// arguments and write the same outputs.
pub trait W4a16Kernel: Kernel<Params: GemmTiling + Copy> + Sized {
    /// Launches a compiled variant with [`W4a16Gemm`]'s argument list.
    ///
    /// # Safety
    /// As the kernel's `launch`: the buffers must have the documented shapes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_gemm(
        kernel: &CompiledKernel<Self>,
        s: &Arc<CudaStream>,
        grid: (u32, u32, u32),
        a: &CudaSlice<bf16>,
        w: &CudaSlice<u32>,
        scales: &CudaSlice<u32>,
        residual: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        part: &mut CudaSlice<f32>,
        routing: (&CudaSlice<u32>, &CudaSlice<u32>, &CudaSlice<f32>),
        mnk: (u32, u32, u32),
        a_div: u32,
    ) -> Result<(), RuntimeError>;
}

/// Implements [`W4a16Kernel`] by forwarding to the kernel's generated `launch`.
macro_rules! w4a16_kernel {
    ($k:ty) => {
        impl $crate::w4a16::gemm::W4a16Kernel for $k {
            unsafe fn launch_gemm(
                kernel: &CompiledKernel<Self>,
                s: &Arc<CudaStream>,
                grid: (u32, u32, u32),
                a: &CudaSlice<bf16>,
                w: &CudaSlice<u32>,
                scales: &CudaSlice<u32>,
                residual: &CudaSlice<bf16>,
                out: &mut CudaSlice<bf16>,
                part: &mut CudaSlice<f32>,
                (sorted, block_expert, route_w): (&CudaSlice<u32>, &CudaSlice<u32>, &CudaSlice<f32>),
                (m, n, k): (u32, u32, u32),
                a_div: u32,
            ) -> Result<(), RuntimeError> {
                // SAFETY: forwarded to the caller.
                unsafe {
                    <$k>::launch(
                        kernel,
                        s,
                        grid,
                        a,
                        w,
                        scales,
                        residual,
                        out,
                        part,
                        sorted,
                        block_expert,
                        route_w,
                        m,
                        n,
                        k,
                        a_div,
                    )
                }
            }
        }
    };
}
pub(crate) use w4a16_kernel;

w4a16_kernel!(W4a16Gemm);

/// Output columns a variant writes for `n` weight rows.
pub fn out_cols(p: &impl GemmTiling, n: u32) -> u32 {
    if p.tiling().epilogue == Epilogue::SiluMul {
        n / 2
    } else {
        n
    }
}

/// A rows (dense) or pair slots (grouped) per block (`16 mt`, or 8 with half m tiles, for
/// [`W4a16Gemm`]).
pub fn rows_per_block(p: &impl GemmTiling) -> u32 {
    p.tiling().rows
}

/// The grid of a launch: m blocks (dense) or `max_blocks` (grouped), n blocks, `splits`.
pub fn grid(p: &impl GemmTiling, m_or_blocks: u32, n: u32, splits: u32) -> (u32, u32, u32) {
    let t = p.tiling();
    let x = if t.moe {
        m_or_blocks
    } else {
        m_or_blocks.div_ceil(t.rows)
    };
    let per_block = t.weight_rows / if t.epilogue == Epilogue::SiluMul { 2 } else { 1 };
    (x.max(1), out_cols(p, n).div_ceil(per_block), splits)
}

/// Launches `gemm` (and, for split-K variants, `reduce`, whose epilogue must match) to write
/// `out`. `splits` must be 1 for variants without `splitk`, and `scratch.part` must hold
/// `splits * m * n` values for those with it.
///
/// # Safety
/// The buffers must have the shapes [`GemmArgs`] and the kernel docs give, in `gemm`'s layout.
pub unsafe fn launch<K: W4a16Kernel>(
    gemm: &CompiledKernel<K>,
    reduce: Option<&CompiledKernel<W4a16Reduce>>,
    s: &Arc<CudaStream>,
    args: &GemmArgs,
    scratch: &mut Scratch,
    out: &mut CudaSlice<bf16>,
    splits: u32,
) -> Result<(), RuntimeError> {
    let p = gemm.params().tiling();
    let bad = |reason: String| RuntimeError::Launch {
        kernel: gemm.id().symbol.clone(),
        reason,
    };
    if p.splitk != (reduce.is_some()) || (!p.splitk && splits != 1) || splits == 0 {
        return Err(bad(format!(
            "splitk {} needs a reduce kernel and splits > 1 only with it (splits {splits})",
            p.splitk
        )));
    }
    if args.k % 32 != 0 || args.k % p.group != 0 {
        return Err(bad(format!(
            "k = {} must be a multiple of 32 and of the group {}",
            args.k, p.group
        )));
    }
    let residual = args.residual.unwrap_or(&scratch.none_bf16);
    let (sorted, block_expert, route_w, blocks, a_div) = match args.routing {
        Some(r) => (
            r.sorted,
            r.block_expert,
            r.route_w.unwrap_or(&scratch.none_f32),
            r.max_blocks,
            r.a_div,
        ),
        None => (&scratch.none_u32, &scratch.none_u32, &scratch.none_f32, args.m, 1),
    };
    if p.moe != args.routing.is_some() {
        return Err(bad("grouped variants need routing, dense ones none".into()));
    }
    let g = grid(gemm.params(), blocks, args.n, splits);
    let routing = (sorted, block_expert, route_w);
    let mnk = (args.m, args.n, args.k);
    if p.splitk {
        let red = reduce.expect("checked above");
        // SAFETY: forwarded to the caller; part holds splits * m * n values.
        unsafe {
            K::launch_gemm(
                gemm,
                s,
                g,
                args.a,
                args.w,
                args.scales,
                residual,
                &mut scratch.none_out,
                &mut scratch.part,
                routing,
                mnk,
                a_div,
            )?;
            let total = args.m * out_cols(gemm.params(), args.n);
            let rg = total.div_ceil(red.params().block).clamp(1, 65535);
            W4a16Reduce::launch(red, s, rg, &scratch.part, residual, out, args.m, args.n, splits)
        }
    } else {
        // SAFETY: forwarded to the caller.
        unsafe {
            K::launch_gemm(
                gemm,
                s,
                g,
                args.a,
                args.w,
                args.scales,
                residual,
                out,
                &mut scratch.part,
                routing,
                mnk,
                a_div,
            )
        }
    }
}

/// The k split counts the bench times and [`default_dense`] picks from.
pub const SPLITS: &[u32] = &[1, 2, 3, 4, 6, 8];

/// The default dense variant and k splits for `m x n x k` (a heuristic from the H200 runs; the
/// bench reports it next to the best candidate): half m tiles for M <= 8, one m tile for
/// M <= 16, two with split-K for M <= 128, two without above. Split-K variants take the largest
/// count of [`SPLITS`] up to about 12 blocks per SM of a 132-SM H200 (a block of 4 warps keeps
/// only 4 KB of weights in flight per warp, so the latency-bound decode shapes want many
/// resident warps), keeping at least 2 k128 tiles per split.
pub fn default_dense(m: u32, n: u32, k: u32) -> (W4a16Params, u32) {
    let p = if m <= 8 {
        DENSE_SPACE[1]
    } else if m <= 16 {
        DENSE_SPACE[0]
    } else if m <= 128 {
        DENSE_SPACE[10]
    } else {
        DENSE_SPACE[11]
    };
    if !p.splitk {
        return (p, 1);
    }
    let (mx, ny, _) = grid(&p, m, n, 1);
    let want = (12 * 132u32).div_ceil(ny * mx).min((k.div_ceil(128) / 2).max(1));
    let splits = SPLITS.iter().copied().filter(|&s| s <= want).max().unwrap_or(1);
    (p, splits)
}
