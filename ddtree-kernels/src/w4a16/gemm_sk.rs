//! `w4a16_gemm_sk`: the dense W4A16 product `out[M, N] = A[M, K] x dequant(W)[N, K]^T` on the
//! Hopper warpgroup tensor cores, fed only by bulk copies and balanced by stream-K.
//!
//! What it changes against [`super::W4a16GemmWg`] (whose loop was bound by instruction issue
//! and in-block latency, BENCHMARKS.md):
//!
//! - **Operands laid out ahead, one bulk copy each.** The weights are repacked at load time into
//!   *fragment blocks* ([`super::layout::repack_fragment`]): per 64-row unit and k128 chunk,
//!   4096 bytes in which thread `t` of a warpgroup finds its eight `wgmma` A-fragment words
//!   (one per k16 step) at `32 t`, then 512 bytes of scales (per 16-row-pair the chunk's four
//!   k32 group scales of rows `g` and `g + 8`). The activations are rewritten per call by
//!   [`W4a16ActTiles`] into the exact shared-memory image of a ring slot (`bn` rows x 128 k,
//!   two 64-k column blocks, 128-byte swizzled). The first thread of a warp of its own, after
//!   the computing warpgroups, issues a chunk's copies (`cp_async_bulk` onto the slot's
//!   mbarrier): no per-thread copy issue, no proxy fence, no copy work on the computing warps,
//!   and each thread reads its 32 weight bytes with two conflict-free 16-byte loads, a quarter
//!   of what the `wgmma` kernel's broadcast reads cost.
//! - **Stream-K.** A persistent grid (at most the blocks that fit on the GPU at once) splits the
//!   `tiles x chunks` iterations evenly: block `b` takes range `r = grid - 1 - b`, iterations
//!   `[r T / G, (r + 1) T / G)`. A tile cut by a range boundary is finished by the range that
//!   holds its first chunk (its *head*, at the end of that range, so computed last); the other
//!   ranges (at the start of later ranges, lower block indices) write f32 partials to their
//!   block's slot of `part` and count on the tile's flag; the head waits for the count, adds
//!   the partials, writes bf16 and resets the flag. No wave tail whatever the shape.
//!
//! A range is walked in *segments* (its iterations of one tile): an inner loop over the
//! segment's chunks, then the segment's epilogue. Per iteration, in two halves of four k16
//! steps (two sets of 16 fragment registers per unit): the slot is waited for, the words loaded
//! and steps 0..4 dequantized (`bf16(q * scale)` exactly, as every W4A16 kernel here) and sent
//! to the tensor cores, while the previous iteration's steps 4..8 still run; once those are
//! done steps 4..8 are dequantized and sent; once steps 0..4 are done the block's barrier ends
//! the step, steps 4..8 still in flight (ptxas keeps them so across the back edge because the
//! accumulators are only ever written by `wgmma`s: a segment's first one overwrites them).
//!
//! ptxas does not keep the A registers of a `wgmma` in flight apart from later values: with
//! four sets (two iterations' sets alternating, three groups in flight) it gave both
//! iterations the same physical registers. The two sets here land in distinct registers and
//! every candidate passes the GPU checks; a change to this loop needs both looked at again:
//! the variant's SASS (its snapshot through `nvcc --ptx`, `ptxas -arch sm_90a` and `nvdisasm`,
//! from the NVRTC wheel and PyPI's `nvidia-cuda-nvdisasm`; no GPU needed) and `w4a16-bench
//! --sk`.
//!
//! Where it stands (7168->36864 on an H200, BENCHMARKS.md): the time is about 53 µs plus
//! the tensor cores' busy time at the tile's N (61 µs at N 16, 70 at N 32, 95 at N 64 for the
//! same 149 MB of weights), so the `wgmma`s do not overlap the dequantization as the loop
//! intends. Not the L2 alone: at N 64 the activation tiles are read once per 64-row unit (7.3
//! TB/s of L2 traffic), yet two units per warpgroup, which halve it, are slower. Nor occupancy:
//! three or four one-warpgroup blocks an SM are no faster than two.

use ddtree_codegen::dsl::*;
use ddtree_macros::{device_fn, kernel, KernelParams};

use super::gemm::{dequant_pair, magic_pair_interleaved};

/// Bytes of one fragment block (a 64-row unit's k128 chunk): 4096 of packed weights, 512 of
/// scales.
pub const FRAG_BLOCK_BYTES: u32 = 4608;

/// Compile-time parameters of [`W4a16GemmSk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub struct W4a16SkParams {
    /// Warpgroups per block (1..=4), each `mt` 64-row units of the tile.
    pub wgs: u32,
    /// 64-row units per warpgroup (1 or 2).
    pub mt: u32,
    /// Tokens per tile: the `wgmma` N (16, 32, 64, 128 or 256; the activation tiles' rows).
    pub bn: u32,
    /// Ring slots (k128 iterations in flight, 2..=8).
    pub stages: u32,
}

impl W4a16SkParams {
    /// Weight rows (output columns) per tile.
    pub const fn tile_rows(&self) -> u32 {
        64 * self.wgs * self.mt
    }

    /// Bytes of one ring slot: the activation tile, then the units' fragment blocks, padded to
    /// 1024 bytes (the swizzle's alignment).
    pub const fn slot_bytes(&self) -> u32 {
        let b = self.bn * 256 + self.wgs * self.mt * FRAG_BLOCK_BYTES;
        b.div_ceil(1024) * 1024
    }

    /// Bytes of dynamic shared memory: the ring.
    pub const fn dyn_smem(&self) -> u32 {
        self.stages * self.slot_bytes()
    }

    /// Tiles and k128 chunks of an `m x n x k` product.
    pub fn tiles_chunks(&self, m: u32, n: u32, k: u32) -> (u32, u32) {
        (m.div_ceil(self.bn) * n.div_ceil(self.tile_rows()), k.div_ceil(128))
    }

    /// f32 elements of the `part` scratch for a grid of `grid` blocks.
    pub fn part_len(&self, grid: u32) -> usize {
        grid as usize * (self.tile_rows() * self.bn) as usize
    }
}

/// The stream-K grid of an `m x n x k` product: every block resident at once (`sm_count` SMs
/// times `blocks_per_sm`, [`ddtree_runtime::CompiledKernel::max_active_blocks_per_sm`]), at most
/// one block per iteration.
pub fn grid(p: &W4a16SkParams, sm_count: u32, blocks_per_sm: u32, m: u32, n: u32, k: u32) -> u32 {
    let (tiles, chunks) = p.tiles_chunks(m, n, k);
    (sm_count * blocks_per_sm).clamp(1, tiles * chunks)
}

const fn sk(wgs: u32, mt: u32, bn: u32, stages: u32) -> W4a16SkParams {
    W4a16SkParams { wgs, mt, bn, stages }
}

/// Candidates, one warpgroup per block unless named: the general default (N 64, two blocks an
/// SM), N 16 for up to 16 tokens (one and two units, three to four blocks an SM), N 32 for 17
/// to 32, and two warpgroups at N 128 for more than 64 (BENCHMARKS.md, twenty-sixth session).
pub const SK_SPACE: &[W4a16SkParams] = &[
    sk(1, 1, 64, 4),
    sk(1, 1, 16, 5),
    sk(1, 2, 16, 5),
    sk(1, 1, 32, 4),
    sk(2, 1, 128, 5),
];

/// Register `i` (0..4) of the `wgmma` A fragment of k16 step `st` from the step's fragment
/// word and the thread's scale words `sc_g` (row g) and `sc_g8` (row g + 8) of the step's
/// half (groups 0-1 for steps 0..4, 2-3 for 4..8, low half first): `bf16(q * scale)` of element
/// pair `i` (nibbles `i`, `i + 4`), of row g for even `i` and g + 8 for odd.
#[device_fn]
fn fragment_reg(word: u32, sc_g: u32, sc_g8: u32, st: u32, i: u32) -> u32 {
    let sel = if (st / 2) % 2 == 1 { 0x3232u32 } else { 0x1010u32 };
    let s = prmt(if i % 2 == 0 { sc_g } else { sc_g8 }, 0u32, sel);
    dequant_pair(magic_pair_interleaved(word >> (4 * i)), s)
}

/// Arguments: `at` the activation tiles ([`W4a16ActTiles`] with this `bn`), `wf` the fragment
/// blocks of `ceil(n / 64)` units ([`super::layout::repack_fragment`]), `out` `[m, n]` bf16,
/// `part` f32 scratch of [`W4a16SkParams::part_len`] (any contents), `flags` one u32 per tile,
/// zero (left zero). Grid: `(G, 1, 1)` with `1 <= G <= tiles x chunks`, every block resident
/// at once (a head waits for the other ranges of its tile): at most the SMs times the blocks
/// per SM. Needs `k % 32 == 0`. Block: `wgs` warpgroups that compute, then one warp whose
/// first thread issues the copies.
#[kernel(block = p.wgs * 128 + 32, dyn_smem = p.dyn_smem(), space = SK_SPACE.to_vec())]
pub fn w4a16_gemm_sk(
    #[comptime] p: &W4a16SkParams,
    at: &[bf16],
    wf: &[u32],
    out: &mut [bf16],
    part: &mut [f32],
    flags: &mut [u32],
    m: u32,
    n: u32,
    k: u32,
) {
    comptime_assert!(p.wgs >= 1 && p.wgs <= 4, "wgs must be 1..=4");
    comptime_assert!(p.mt == 1 || p.mt == 2, "mt must be 1 or 2");
    comptime_assert!(
        p.bn == 16 || p.bn == 32 || p.bn == 64 || p.bn == 128 || p.bn == 256,
        "bn must be 16, 32, 64, 128 or 256"
    );
    comptime_assert!(
        p.mt * p.bn <= 256,
        "mt * bn must be at most 256 (128 accumulator registers)"
    );
    comptime_assert!(p.stages >= 2 && p.stages <= 8, "stages must be 2..=8");
    comptime_assert!(
        p.dyn_smem() <= 232448,
        "the ring is limited to 227 KiB of shared memory per block"
    );
    // Threads that compute; the copying warp follows them.
    let threads = p.wgs * 128;
    let units = p.wgs * p.mt;
    let rows = 64 * units;
    // Slot layout in bf16 elements: the activation tile, then unit `v`'s block at
    // `bn 128 + 2304 v` (its scales 2048 elements in).
    let slot = p.slot_bytes() / 2;
    let sm = dyn_shared::<bf16>();
    // Slot `s`'s mbarrier: its phase `u` completes when iteration `s + stages u` has landed.
    let full = shared::<u64>(p.stages);
    let tid = thread_idx_x();
    let h = tid / 128;
    let t128 = tid % 128;
    let lane = lane_id();
    let g = lane / 4;
    let q = lane % 4;
    let wl = t128 / 32;

    let kbs = (k + 127u32) / 128u32;
    let ntn = (n + rows - 1) / rows;
    let units_n = (n + 63u32) / 64u32;
    let total = (m + p.bn - 1) / p.bn * ntn * kbs;
    let nblk = grid_dim_x();
    let blk = block_idx_x();
    let r = nblk - 1 - blk;
    let it0 = r * total / nblk;
    let it1 = (r + 1) * total / nblk;
    let nit = it1 - it0;
    if nit == 0 {
        return;
    }
    if tid == threads {
        #[unroll]
        for s in 0..p.stages {
            mbar_init(&mut full[s], 1u32);
        }
    }
    sync_threads();

    // Written by `wgmma`s only: a segment's first `wgmma` overwrites them.
    let mut acc = [[0.0f32; p.bn / 2]; p.mt];
    // A fragments per unit: k16 steps 0..4 of an iteration (set 0) and 4..8 (set 1).
    let mut af = [[0u32; 4]; 8 * p.mt];
    // Per unit, the words of steps 4..8 and the scale words of groups 2-3, loaded with set 0's.
    let mut w1 = [[0u32; 4]; p.mt];
    let mut sc1 = [[0u32; 2]; p.mt];
    // The copying thread: chunk, tile column and row block of the next iteration to copy.
    let mut pc = it0 % kbs;
    let mut pnt = it0 / kbs % ntn;
    let mut pmb = it0 / kbs / ntn;
    // The range's segments (its iterations of one tile), in order.
    let mut ct = it0 / kbs;
    let mut j0 = 0u32;
    while j0 < nit {
        let j1 = (j0 + kbs - (it0 + j0) % kbs).min(nit);
        for j in j0..j1 {
            // The copying thread fills the ring in iteration order: iterations `0 .. stages` in step 0,
            // then iteration `j + stages - 2` into the slot of iteration `j - 2` (its last
            // `wgmma` was waited for in step `j - 1`, before that step's barrier). Each: the
            // activation tile and the tile's units (a unit past N copies unit 0, whose products
            // are never written).
            if tid == threads {
                let lo = if j == 0 { 0u32 } else { j + p.stages - 2 };
                let hi = if j == 0 {
                    p.stages
                } else if j >= 2 {
                    lo + 1
                } else {
                    lo
                };
                for jn in lo..hi.min(nit) {
                    let so = (jn % p.stages) * slot;
                    let bar = jn % p.stages;
                    mbar_arrive_tx(&mut full[bar], p.bn * 256 + units * FRAG_BLOCK_BYTES);
                    cp_async_bulk(
                        &mut sm[so],
                        &at[(pmb * kbs + pc) * p.bn * 128],
                        p.bn * 256,
                        &mut full[bar],
                    );
                    #[unroll]
                    for v in 0..units {
                        let mut un = pnt * units + v;
                        if un >= units_n {
                            un = 0u32;
                        }
                        cp_async_bulk(
                            &mut sm[so + p.bn * 128 + 2304 * v],
                            &wf[(un * kbs + pc) * 1152],
                            FRAG_BLOCK_BYTES,
                            &mut full[bar],
                        );
                    }
                    pc += 1;
                    if pc == kbs {
                        pc = 0u32;
                        pnt += 1;
                        if pnt == ntn {
                            pnt = 0u32;
                            pmb += 1;
                        }
                    }
                }
            }
            if tid < threads {
                // Iteration `j`: its slot is waited for, its words loaded, its steps 0..4
                // dequantized into set 0 (while iteration `j - 1`'s steps 4..8 still run) and
                // sent out; once iteration `j - 1` is done its steps 4..8 are dequantized into
                // set 1 and go out; once steps 0..4 are done the step ends, 4..8 in flight.
                mbar_wait(&full[j % p.stages], (j / p.stages) % 2);
                #[unroll]
                for u in 0..p.mt {
                    // The thread's eight words, `16 t128` elements into the unit's block; the
                    // scale words of row pair `8 wl + g`, 2048 elements in.
                    let ub = (j % p.stages) * slot + p.bn * 128 + 2304 * (h * p.mt + u);
                    let w = sm.vload(ub + 16 * t128);
                    let wb = sm.vload(ub + 16 * t128 + 8);
                    let sc = sm.vload(ub + 2048 + 8 * (8 * wl + g));
                    w1[u][0] = wb.x;
                    w1[u][1] = wb.y;
                    w1[u][2] = wb.z;
                    w1[u][3] = wb.w;
                    sc1[u][0] = sc.y;
                    sc1[u][1] = sc.w;
                    let mut x = [0u32; 4];
                    x[0] = w.x;
                    x[1] = w.y;
                    x[2] = w.z;
                    x[3] = w.w;
                    #[unroll]
                    for st in 0..4 {
                        #[unroll]
                        for i in 0..4 {
                            af[st * p.mt + u][i] = fragment_reg(x[st], sc.x, sc.z, st, i);
                        }
                    }
                }
                let bd = wgmma_desc(&sm[(j % p.stages) * slot]);
                wgmma_fence();
                #[unroll]
                for kk in 0..4 {
                    #[unroll]
                    for u in 0..p.mt {
                        // Column block 0, 32 bytes per k16 step.
                        wgmma_bf16_rs(&mut acc[u], &af[kk * p.mt + u], bd + 2 * kk, kk > 0 || j > j0);
                    }
                }
                wgmma_commit();
                wgmma_wait(1);
                #[unroll]
                for u in 0..p.mt {
                    #[unroll]
                    for st in 4..8 {
                        #[unroll]
                        for i in 0..4 {
                            af[st * p.mt + u][i] = fragment_reg(w1[u][st % 4], sc1[u][0], sc1[u][1], st, i);
                        }
                    }
                }
                wgmma_fence();
                #[unroll]
                for kk in 0..4 {
                    #[unroll]
                    for u in 0..p.mt {
                        // Column block 1 (`bn * 64` elements, `bn * 8` descriptor units).
                        wgmma_bf16_rs(&mut acc[u], &af[(4 + kk) * p.mt + u], bd + p.bn * 8 + 2 * kk, true);
                    }
                }
                wgmma_commit();
                wgmma_wait(1);
            }
            sync_threads();
        }
        wgmma_wait(0);
        // The segment is summed: finish it.
        let tstart = ct * kbs;
        if it0 > tstart {
            // Not the head: partials to this block's slot, then count.
            if tid < threads {
                let pb = (blk * threads + tid) * p.mt;
                #[unroll]
                for u in 0..p.mt {
                    #[unroll]
                    for e in 0..p.bn / 2 {
                        part[(pb + u) * (p.bn / 2) + e] = acc[u][e];
                    }
                }
            }
            thread_fence();
            sync_threads();
            if tid == 0 {
                flags.atomic_add(ct, 1u32);
            }
        } else {
            // The head: the ranges up to the one holding the tile's last chunk
            // (ceil((tstart + kbs) G / T) - 1) have partials to add.
            let rl = ((tstart + kbs) * nblk + total - 1) / total - 1;
            if rl > r {
                if tid == 0 {
                    while flags.atomic_add(ct, 0u32) < rl - r {}
                    flags.atomic_exch(ct, 0u32);
                }
                sync_threads();
                thread_fence();
                if tid < threads {
                    for ro in r + 1..rl + 1 {
                        let pb = ((nblk - 1 - ro) * threads + tid) * p.mt;
                        #[unroll]
                        for u in 0..p.mt {
                            #[unroll]
                            for e in 0..p.bn / 2 {
                                acc[u][e] += part[(pb + u) * (p.bn / 2) + e];
                            }
                        }
                    }
                }
            }
            // Accumulator `acc[u][4 jb + e]`: weight row (output column) `16 wl + g + 8
            // (e / 2)` of the warpgroup's unit `u`, token `8 jb + 2 q + e % 2`.
            let mb = ct / ntn;
            let nt = ct % ntn;
            #[unroll]
            for jb in 0..p.bn / 8 {
                #[unroll]
                for c2 in 0..2 {
                    let token = mb * p.bn + 8 * jb + 2 * q + c2;
                    if token < m && tid < threads {
                        #[unroll]
                        for u in 0..p.mt {
                            #[unroll]
                            for e2 in 0..2 {
                                let col = nt * rows + (h * p.mt + u) * 64 + 16 * wl + g + 8 * e2;
                                if col < n {
                                    out[token * n + col] = acc[u][4 * jb + 2 * e2 + c2] as bf16;
                                }
                            }
                        }
                    }
                }
            }
        }
        ct += 1;
        j0 = j1;
    }
}

/// Compile-time parameters of [`W4a16ActTiles`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, KernelParams)]
pub struct ActTilesParams {
    /// Threads per block.
    pub block: u32,
}

/// Rewrites `a` `[m, k]` bf16 into the activation tiles [`W4a16GemmSk`] copies whole: per
/// `bn`-row block `mb` and k128 chunk `c`, at `(mb kbs + c) bn 128`, the ring slot's image (two
/// 64-k column blocks `[bn, 64]`, 128 bytes a row, 16-byte piece `p` of row `r` at piece
/// `p ^ (r % 8)`), zero past M and K. Any grid: the kernel strides over the 16-byte pieces.
/// Needs `k % 8 == 0`.
#[kernel(block = p.block, space = [ActTilesParams { block: 256 }])]
pub fn w4a16_act_tiles(#[comptime] p: &ActTilesParams, a: &[bf16], at: &mut [bf16], m: u32, k: u32, bn: u32) {
    let kbs = (k + 127u32) / 128u32;
    let pieces = (m + bn - 1) / bn * kbs * bn * 16;
    for i in (block_idx_x() * p.block + thread_idx_x()..pieces).step_by(grid_dim_x() * p.block) {
        let tile = i / (bn * 16);
        let rest = i % (bn * 16);
        let cb = rest / (bn * 8);
        let rr = (rest % (bn * 8)) / 8;
        let pc = rest % 8;
        let row = (tile / kbs) * bn + rr;
        let col = (tile % kbs) * 128 + cb * 64 + pc * 8;
        let ok = row < m && col < k;
        let mut v = a.vload(if ok { row * k + col } else { 0u32 });
        if !ok {
            v.x = 0u32;
            v.y = 0u32;
            v.z = 0u32;
            v.w = 0u32;
        }
        at.vstore(
            tile * bn * 128 + cb * bn * 64 + (rr / 8) * 512 + (rr % 8) * 64 + ((pc ^ (rr % 8)) * 8),
            v,
        );
    }
}
