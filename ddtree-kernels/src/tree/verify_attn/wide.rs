//! The full-width pass [`MlaVerifyWide`] (each warp the whole score reduction of its keys).

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

/// Compile-time parameters of [`MlaVerifyWide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct WideParams {
    /// Row groups of 16 query rows per block: 2 or 4 (8 warps either way).
    pub rg: u32,
    /// KV tile (keys per step): 32 or 64.
    pub bn: u32,
    /// Depth of the shared-memory tile ring, >= 2.
    pub stages: u32,
    /// Query rows per warp in `Q K^T`: 16 (all 8 warps), or 32 (4 warps; each key fragment
    /// serves two row tiles, so the tile is read half as often).
    pub qk: u32,
}

impl WideParams {
    /// Query rows per block.
    pub const fn rows_per_block(&self) -> u32 {
        16 * self.rg
    }

    /// Bytes of dynamic shared memory: the Q tile plus the KV ring, bf16.
    pub const fn dyn_smem(&self) -> u32 {
        (self.rg * 16 + self.stages * self.bn) * 576 * 2
    }
}

/// Split-KV pass with full-width warps: the same grid, inputs and partial outputs as
/// [`MlaVerifySplit`], 8 warps. For `Q K^T` each warp owns `qk` query rows (16: all 8 warps;
/// 32: warps 0..4) and `bn / (8 / rg)` keys of the tile over all 576 dims, so no partial
/// scores cross warps; the row maxima of a
/// tile meet in shared memory, and the probabilities go to a bf16 `P` tile there. For `P V`
/// each warp owns all `16 rg` rows and 64 of the 512 output columns, so every value byte is read
/// from shared memory once per tile (the dim-split kernel reads it once per 16 rows). Partial
/// outputs are bf16 pairs, as [`MlaVerifyCombine`] reads them.
#[kernel(block = 256, dyn_smem = p.dyn_smem(), space = [
    WideParams { rg: 4, bn: 64, stages: 2, qk: 16 },
    WideParams { rg: 4, bn: 64, stages: 2, qk: 32 },
    WideParams { rg: 4, bn: 32, stages: 4, qk: 16 },
    WideParams { rg: 4, bn: 32, stages: 3, qk: 16 },
    WideParams { rg: 2, bn: 64, stages: 2, qk: 16 },
])]
pub fn mla_verify_wide(
    #[comptime] p: &WideParams,
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
    comptime_assert!(p.rg == 2 || p.rg == 4, "rg must be 2 or 4");
    comptime_assert!(p.bn == 32 || p.bn == 64, "bn must be 32 or 64");
    comptime_assert!(p.bn * p.rg >= 128, "each warp needs at least 16 keys of the tile");
    comptime_assert!(p.stages >= 2, "stages must be at least 2");
    comptime_assert!(
        p.qk == 16 || (p.qk == 32 && p.rg == 4),
        "qk must be 16, or 32 at rg = 4"
    );
    comptime_assert!(
        (p.rg * 16 + p.stages * p.bn) * 1152 + p.rg * 16 * (p.bn + 8) * 2 + 4 * 64 * 4 + 2 * 64 * 4 <= 232448,
        "shared memory is limited to 227 KiB per block"
    );
    let rpb = p.rg * 16;
    // Warps per `Q K^T` row group (splitting the tile's keys), keys per warp, row tiles per
    // warp; warps `8 / mr ..` sit out `Q K^T`.
    let kq = 8 / p.rg;
    let kw = p.bn / kq;
    let mr = p.qk / 16;
    // u32 (bf16 pairs) per row of the P tile, padded against bank conflicts.
    let psw = (p.bn + 8) / 2;
    // Q tile `[16 rg, 576]` at 0, then the ring of `stages` tiles `[bn, 576]`; rows of 72
    // 16-byte chunks, chunk `c` of row `r` stored at `c ^ (r % 8)` (conflict-free ldmatrix).
    let sm = dyn_shared::<bf16>();
    let ring = rpb * 576;
    let sp = shared::<u32>(p.rg * 16 * ((p.bn + 8) / 2));
    let smax = shared::<f32>(4 * 64);
    let salpha = shared::<f32>(64);
    let sstat = shared::<f32>(64);
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let rgi = warp / kq;
    let kqi = warp % kq;
    let key0 = kqi * kw;
    let qkw = warp < 8 / mr;
    let g = lane / 4;
    let qd = lane % 4;
    let blk0 = block_idx_x() * rpb;
    let prefix = lens[0];
    let total = prefix + nodes;
    let splits = grid_dim_y();
    let chunk = ((total + splits - 1) / splits + p.bn - 1) / p.bn * p.bn;
    let kv0 = block_idx_y() * chunk;
    let kv1 = (kv0 + chunk).min(total);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    // This thread's `Q K^T` rows `i`: `16 (i / 2) + g + 8 (i % 2)` of its row group, and their nodes.
    let mut lr = [0u32; mr * 2];
    let mut node = [0u32; mr * 2];
    #[unroll]
    for i in 0..mr * 2 {
        lr[i] = rgi * p.qk + (i / 2) * 16 + g + (i % 2) * 8;
        node[i] = ((blk0 + lr[i]) / heads).min(nodes - 1);
    }
    // This lane's ldmatrix offsets (elements): a row `r` of a swizzled tile read at chunk
    // `8 a + b` (`b < 8`) sits at `r 576 + 64 a + 8 (b ^ (r % 8))`, and every read below has
    // `b = 2 j + (0 or 1)` for its k16 step `4 a + j` (or n16 pair `j`) and a row whose
    // `r % 8` is the lane's, so four `j`-dependent offsets per operand are computed once and the
    // unrolled steps add constants (rows `16 mi`, `16 jp` or `16 kk` further are `16 * 576`
    // elements on). Q rows, key rows of `Q K^T` (tile base excluded), value rows of `P V` (tile
    // base and k16 step excluded).
    let mut qoff = [0u32; 4];
    let mut koff = [0u32; 4];
    let mut voff = [0u32; 4];
    let qr0 = rgi * p.qk + lane % 16;
    let kr0 = key0 + (lane / 16) * 8 + lane % 8;
    let vr0 = lane % 8 + ((lane / 8) % 2) * 8;
    #[unroll]
    for j in 0..4 {
        qoff[j] = qr0 * 576 + ((2 * j + lane / 16) ^ (qr0 % 8)) * 8;
        koff[j] = kr0 * 576 + ((2 * j + (lane / 8) % 2) ^ (kr0 % 8)) * 8;
        voff[j] = vr0 * 576 + warp * 64 + ((2 * j + lane / 16) ^ (vr0 % 8)) * 8;
    }

    // P V accumulators: rows `16 mt + g (+ 8)` of the block, columns `64 warp + 8 n + 2 qd`.
    let mut acc = [[0.0f32; 4]; p.rg * 8];
    let mut s = [[0.0f32; 4]; mr * kw / 8];
    let mut qa = [[0u32; 4]; mr];
    let mut bq = [0u32; 4];
    let mut b = [0u32; 2];
    let mut b2 = [0u32; 2];
    let mut pa = [[0u32; 4]; p.rg];
    let mut al = [0.0f32; p.rg * 2];
    let mut m = [f32::NEG_INFINITY; mr * 2];
    let mut l = [0.0f32; mr * 2];
    let mut mx = [0.0f32; mr * 2];

    let ntiles = if kv1 > kv0 { (kv1 - kv0 + p.bn - 1) / p.bn } else { 0u32 };
    // The cp.async groups: tiles `0 .. stages - 1`, then the query rows, then one tile per
    // step. In the decode step (one node) the first tiles are issued before the wait for the
    // predecessor (the cache rows are final by then: appended before it, or on a stream joined
    // before this launch; only the queries are its output). Trees wait first: the early order
    // was measured (and gained) for the decode step only.
    let early = nodes == 1;
    for it in 0..ntiles + p.stages - 1 {
        if it == 0 && !early {
            grid_wait();
            grid_launch_dependents();
        }
        if it + 1 >= p.stages {
            // Tile `it - (stages - 1)` and the queries have landed (all groups at the first
            // step, then all but the newest `stages - 2`), and every warp is done with tile
            // `it - stages`, whose slot tile `it` reuses, and with the last P tile.
            if it + 1 == p.stages {
                cp_async_wait(0);
            } else {
                cp_async_wait(p.stages - 2);
            }
            sync_threads();
        }
        if it < ntiles {
            // Warp `w` copies rows `w + 8 i` (so `r % 8 == w`: the swizzle is per lane, not per
            // row) and lane `l` their chunks `l`, `l + 32` and, for lanes 0..8, `l + 64`: the
            // addresses are a row base plus per-lane constants.
            let ld = ring + (it % p.stages) * p.bn * 576 + warp * 576;
            let kl = kv0 + it * p.bn + warp;
            #[unroll]
            for i in 0..p.bn / 8 {
                let ok = kl + 8 * i < kv1;
                let src = if ok { (kl + 8 * i) * 576 } else { 0u32 };
                #[unroll]
                for j in 0..3 {
                    let c = lane + 32 * j;
                    if c < 72 {
                        cp_async_16_zfill(&mut sm[ld + i * 8 * 576 + (c ^ warp) * 8], &cache[src + c * 8], ok);
                    }
                }
            }
        }
        cp_async_commit();
        if it + 2 == p.stages {
            if early {
                grid_wait();
                grid_launch_dependents();
            }
            // The block's query rows (zero past `rows`).
            for ch in (tid..rpb * 72).step_by(256) {
                let r = ch / 72;
                let c = ch % 72;
                let ok = blk0 + r < rows;
                let src = if ok { (blk0 + r) * 576 + c * 8 } else { 0u32 };
                cp_async_16_zfill(&mut sm[r * 576 + (c ^ (r % 8)) * 8], &q[src], ok);
            }
            cp_async_commit();
        }
        if it + 1 >= p.stages {
            let ti = it + 1 - p.stages;
            let kt = kv0 + ti * p.bn;
            let st = ring + (ti % p.stages) * p.bn * 576;

            // Scores of this warp's `qk` rows and `kw` keys over all 576 dims; row maxima.
            let nj = kw / 8;
            if qkw {
                #[unroll]
                for j in 0..mr * nj {
                    #[unroll]
                    for e in 0..4 {
                        s[j][e] = 0.0f32;
                    }
                }
                #[unroll]
                for kk in 0..36 {
                    #[unroll]
                    for mi in 0..mr {
                        ldmatrix_x4(&mut qa[mi], &sm[qoff[kk % 4] + mi * 16 * 576 + 64 * (kk / 4)]);
                    }
                    #[unroll]
                    for jp in 0..kw / 16 {
                        ldmatrix_x4(&mut bq, &sm[st + koff[kk % 4] + jp * 16 * 576 + 64 * (kk / 4)]);
                        b[0] = bq[0];
                        b[1] = bq[1];
                        b2[0] = bq[2];
                        b2[1] = bq[3];
                        #[unroll]
                        for mi in 0..mr {
                            mma_m16n8k16_bf16(&mut s[mi * nj + 2 * jp], &qa[mi], &b);
                            mma_m16n8k16_bf16(&mut s[mi * nj + 2 * jp + 1], &qa[mi], &b2);
                        }
                    }
                }
                // Mask (the mask words are read for tree keys only) and this warp's row maxima.
                #[unroll]
                for i in 0..mr * 2 {
                    mx[i] = f32::NEG_INFINITY;
                }
                if kt + p.bn <= prefix.min(kv1) {
                    // A tile of committed keys only (most tiles of a long context): all visible.
                    #[unroll]
                    for mi in 0..mr {
                        #[unroll]
                        for j in 0..nj {
                            #[unroll]
                            for e in 0..4 {
                                let i = mi * 2 + e / 2;
                                s[mi * nj + j][e] *= scale_log2;
                                mx[i] = mx[i].max(s[mi * nj + j][e]);
                            }
                        }
                    }
                } else {
                    #[unroll]
                    for mi in 0..mr {
                        #[unroll]
                        for j in 0..nj {
                            #[unroll]
                            for e in 0..4 {
                                let i = mi * 2 + e / 2;
                                let key = kt + key0 + j * 8 + qd * 2 + e % 2;
                                let t = key - prefix;
                                let vis = key < kv1
                                    && (key < prefix || ((mask[node[i] * words + t / 32] >> (t % 32)) & 1) == 1);
                                s[mi * nj + j][e] = if vis {
                                    s[mi * nj + j][e] * scale_log2
                                } else {
                                    f32::NEG_INFINITY
                                };
                                mx[i] = mx[i].max(s[mi * nj + j][e]);
                            }
                        }
                    }
                }
                #[unroll]
                for i in 0..mr * 2 {
                    mx[i] = mx[i].max(shfl_xor(mx[i], 1u32));
                    mx[i] = mx[i].max(shfl_xor(mx[i], 2u32));
                    if qd == 0 {
                        smax[kqi * 64 + lr[i]] = mx[i];
                    }
                }
            }
            sync_threads();

            // Online softmax: every warp of a row group forms the same new maxima.
            if qkw {
                #[unroll]
                for i in 0..mr * 2 {
                    let mut mn = m[i];
                    #[unroll]
                    for k in 0..kq {
                        mn = mn.max(smax[k * 64 + lr[i]]);
                    }
                    // Rows with no visible key yet keep m = -inf; use 0 as the exponent base then.
                    let base = if mn == f32::NEG_INFINITY { 0.0f32 } else { mn };
                    let alpha = (m[i] - base).exp2();
                    m[i] = mn;
                    l[i] *= alpha;
                    // `mx` now holds the exponent base.
                    mx[i] = base;
                    if kqi == 0 && qd == 0 {
                        salpha[lr[i]] = alpha;
                    }
                }
                #[unroll]
                for mi in 0..mr {
                    #[unroll]
                    for j in 0..nj {
                        let x = mi * nj + j;
                        s[x][0] = (s[x][0] - mx[2 * mi]).exp2();
                        s[x][1] = (s[x][1] - mx[2 * mi]).exp2();
                        s[x][2] = (s[x][2] - mx[2 * mi + 1]).exp2();
                        s[x][3] = (s[x][3] - mx[2 * mi + 1]).exp2();
                        l[2 * mi] += s[x][0] + s[x][1];
                        l[2 * mi + 1] += s[x][2] + s[x][3];
                        let pc = (key0 + j * 8 + qd * 2) / 2;
                        sp[lr[2 * mi] * psw + pc] = pack_bf16x2(s[x][0], s[x][1]);
                        sp[lr[2 * mi + 1] * psw + pc] = pack_bf16x2(s[x][2], s[x][3]);
                    }
                }
            }
            sync_threads();

            // P V over all rows and this warp's 64 output columns.
            #[unroll]
            for mt in 0..p.rg {
                al[2 * mt] = salpha[mt * 16 + g];
                al[2 * mt + 1] = salpha[mt * 16 + g + 8];
            }
            let mut settled = true;
            #[unroll]
            for i in 0..p.rg * 2 {
                settled = settled && al[i] == 1.0f32;
            }
            // Once the row maxima settle (most tiles of a long context), skip the rescale.
            if !vote_all(settled) {
                #[unroll]
                for mt in 0..p.rg {
                    #[unroll]
                    for n in 0..8 {
                        acc[mt * 8 + n][0] *= al[2 * mt];
                        acc[mt * 8 + n][1] *= al[2 * mt];
                        acc[mt * 8 + n][2] *= al[2 * mt + 1];
                        acc[mt * 8 + n][3] *= al[2 * mt + 1];
                    }
                }
            }
            #[unroll]
            for kk in 0..p.bn / 16 {
                #[unroll]
                for mt in 0..p.rg {
                    ldmatrix_x4(&mut pa[mt], &sp[(mt * 16 + lane % 16) * psw + kk * 8 + (lane / 16) * 4]);
                }
                #[unroll]
                for t2 in 0..4 {
                    ldmatrix_x4_trans(&mut bq, &sm[st + voff[t2] + kk * 16 * 576]);
                    b[0] = bq[0];
                    b[1] = bq[1];
                    b2[0] = bq[2];
                    b2[1] = bq[3];
                    #[unroll]
                    for mt in 0..p.rg {
                        mma_m16n8k16_bf16(&mut acc[mt * 8 + 2 * t2], &pa[mt], &b);
                        mma_m16n8k16_bf16(&mut acc[mt * 8 + 2 * t2 + 1], &pa[mt], &b2);
                    }
                }
            }
        }
    }

    // Row sums (this warp's keys; the row group's warps meet in shared memory) and maxima.
    if qkw {
        #[unroll]
        for i in 0..mr * 2 {
            l[i] += shfl_xor(l[i], 1u32);
            l[i] += shfl_xor(l[i], 2u32);
            if qd == 0 {
                smax[kqi * 64 + lr[i]] = l[i];
                if kqi == 0 {
                    sstat[lr[i]] = m[i];
                }
            }
        }
    }
    sync_threads();
    let split = block_idx_y();
    #[unroll]
    for i in 0..p.rg * 2 {
        let rl = (i / 2) * 16 + g + (i % 2) * 8;
        let mut ls = 0.0f32;
        #[unroll]
        for k in 0..kq {
            ls += smax[k * 64 + rl];
        }
        let inv = if ls > 0.0f32 { 1.0f32 / ls } else { 0.0f32 };
        let row = blk0 + rl;
        if row < rows {
            #[unroll]
            for n in 0..8 {
                let col = warp * 64 + n * 8 + qd * 2;
                let a = acc[(i / 2) * 8 + n][(i % 2) * 2];
                let c = acc[(i / 2) * 8 + n][(i % 2) * 2 + 1];
                part_o[((split * rows + row) * 512 + col) / 2] = pack_bf16x2(a * inv, c * inv);
            }
        }
    }
    if tid < rpb && blk0 + tid < rows {
        let mut ls = 0.0f32;
        #[unroll]
        for k in 0..kq {
            ls += smax[k * 64 + tid];
        }
        part_lse[split * rows + blk0 + tid] = if ls > 0.0f32 {
            (sstat[tid] + ls.log2()) * std::f32::consts::LN_2
        } else {
            f32::NEG_INFINITY
        };
    }
}
