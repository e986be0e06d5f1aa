//! Tree-verify attention in MLA absorbed form (FlashMLA-style split-KV + combine), and a naive
//! per-(node, head) kernel for comparison.
//!
//! Query rows are `(node, head)` pairs, `rows = nodes * heads`, each 576 wide (512 latent +
//! 64 rope). Keys are the `prefix + nodes` cache rows; row `r` sees every prefix row and the
//! tree rows `prefix + t` whose bit `t` is set in its node's mask row. The value of a key is
//! its first 512 entries. The prefix length is read on the device (`lens[0]`), so a launch can
//! be captured in a CUDA graph and replayed as the context grows; the grid is sized on the host
//! from an upper bound.
//!
//! [`MlaVerifySplit`]: one block holds `16 * rg` query rows (all 64 heads of a node at
//! `rg = 4`) in shared memory and streams one chunk of the keys (grid y = splits) once through a
//! `stages`-deep `cp.async` ring of `bn`-key tiles in dynamic shared memory, so each KV byte is
//! read from DRAM once per split for up to 64 rows. Tensor cores (`mma.sync` m16n8k16 bf16,
//! operands through `ldmatrix`): per row group of 16 rows, four warps split the 576-dim score
//! reduction (summed through shared memory in a fixed order, so they agree), and each then owns
//! 128 of the 512 output columns for `P V`; online softmax in f32. [`MlaVerifyWide`]: the same
//! split pass with each warp doing the whole 576-dim score reduction for its 16 rows and part of
//! the tile's keys, the probabilities passed through a bf16 tile in shared memory, and each warp
//! owning 64 output columns of every row for `P V` (each value byte read from shared memory once
//! per tile). [`MlaVerifyCombine`] merges the split partials (bf16) by their log-sum-exp;
//! [`MlaCombineOutput`] merges them inside the absorbed output projection (the decode step).

use ddtree_codegen::dsl::*;
use ddtree_codegen::Kernel;
use ddtree_macros::{device_fn, kernel, KernelParams};

use crate::common::warp_sum;
use crate::gemv::dot2;

/// Compile-time parameters of [`MlaVerifySplit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct VerifyParams {
    /// Row groups of 16 query rows per block (4 warps each): 1..=4.
    pub rg: u32,
    /// KV tile (keys per step): 16, 32 or 64.
    pub bn: u32,
    /// Depth of the shared-memory tile ring (tiles in flight plus the one being computed), >= 2.
    pub stages: u32,
}

impl VerifyParams {
    /// Query rows per block.
    pub const fn rows_per_block(&self) -> u32 {
        16 * self.rg
    }

    /// Bytes of dynamic shared memory: the Q tile plus the KV ring, bf16.
    pub const fn dyn_smem(&self) -> u32 {
        (self.rg * 16 + self.stages * self.bn) * 576 * 2
    }

    /// Row stride of the score partials (padded against bank conflicts).
    pub const fn sp_stride(&self) -> u32 {
        self.bn + 8
    }
}

/// Split-KV pass. Grid: `(ceil(rows / (16 rg)), splits)`. With `total = lens[0] + nodes` and
/// `chunk = ceil(total / splits)` rounded up to `bn`, split `s` covers keys
/// `[s * chunk, min((s + 1) * chunk, total))` (possibly none). Iteration `it` issues the load of
/// tile `it` and computes tile `it - (stages - 1)`, so `stages - 1` tiles are in flight while one
/// is computed. Writes normalized partial outputs `part_o` (`[splits, rows, 512]` bf16, as
/// pairs in `u32`) and
/// partial natural log-sum-exp `part_lse` (`[splits, rows]`, -inf when the split saw no key).
#[kernel(block = p.rg * 128, dyn_smem = p.dyn_smem(), space = [
    VerifyParams { rg: 4, bn: 32, stages: 2 },
    VerifyParams { rg: 4, bn: 32, stages: 3 },
    VerifyParams { rg: 2, bn: 64, stages: 2 },
    VerifyParams { rg: 2, bn: 32, stages: 4 },
    VerifyParams { rg: 1, bn: 64, stages: 2 },
])]
pub fn mla_verify_split(
    #[comptime] p: &VerifyParams,
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
    comptime_assert!(p.bn == 16 || p.bn == 32 || p.bn == 64, "bn must be 16, 32 or 64");
    comptime_assert!(p.rg >= 1 && p.rg <= 4, "rg must be 1..=4");
    comptime_assert!(p.stages >= 2, "stages must be at least 2");
    comptime_assert!(
        p.rg * 4 * 16 * (p.bn + 8) * 4 <= 49152,
        "the score partials must fit the 48 KiB of static shared memory"
    );
    comptime_assert!(
        (p.rg * 16 + p.stages * p.bn) * 1152 + p.rg * 4 * 16 * (p.bn + 8) * 4 <= 232448,
        "shared memory is limited to 227 KiB per block"
    );
    let threads = p.rg * 128;
    let nt = p.bn / 8;
    let ss = p.bn + 8;
    // Q tile `[16 rg, 576]` at 0, then the ring of `stages` tiles `[bn, 576]`; rows of 72
    // 16-byte chunks, chunk `c` of row `r` stored at `c ^ (r % 8)` (conflict-free ldmatrix).
    let sm = dyn_shared::<bf16>();
    let ring = p.rg * 16 * 576;
    let sp = shared::<f32>(p.rg * 4 * 16 * (p.bn + 8));
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let rgi = warp / 4;
    let cg = warp % 4;
    let g = lane / 4;
    let qd = lane % 4;
    let blk0 = block_idx_x() * 16 * p.rg;
    let row0 = blk0 + rgi * 16;
    let ra = row0 + g;
    let rb = row0 + g + 8;
    let prefix = lens[0];
    let total = prefix + nodes;
    let splits = grid_dim_y();
    let chunk = ((total + splits - 1) / splits + p.bn - 1) / p.bn * p.bn;
    let kv0 = block_idx_y() * chunk;
    let kv1 = (kv0 + chunk).min(total);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let node_a = (ra / heads).min(nodes - 1);
    let node_b = (rb / heads).min(nodes - 1);

    // The block's query rows (zero past `rows`): the oldest cp.async group.
    for ch in (tid..p.rg * 16 * 72).step_by(threads) {
        let r = ch / 72;
        let c = ch % 72;
        let ok = blk0 + r < rows;
        let src = if ok { (blk0 + r) * 576 + c * 8 } else { 0u32 };
        cp_async_16_zfill(&mut sm[r * 576 + (c ^ (r % 8)) * 8], &q[src], ok);
    }
    cp_async_commit();

    let mut acc = [[0.0f32; 4]; 16];
    let mut s = [[0.0f32; 4]; nt];
    let mut qa = [0u32; 4];
    let mut bq = [0u32; 4];
    let mut b = [0u32; 2];
    let mut pa = [0u32; 4];
    let mut m_a = f32::NEG_INFINITY;
    let mut m_b = f32::NEG_INFINITY;
    let mut l_a = 0.0f32;
    let mut l_b = 0.0f32;

    let ntiles = if kv1 > kv0 { (kv1 - kv0 + p.bn - 1) / p.bn } else { 0u32 };
    for it in 0..ntiles + p.stages - 1 {
        // Tile `it - (stages - 1)` (and the Q tile) has landed, and every warp is done with
        // tile `it - stages`, whose slot tile `it` reuses.
        cp_async_wait(p.stages - 2);
        sync_threads();
        if it < ntiles {
            let ld = ring + (it % p.stages) * p.bn * 576;
            let kl = kv0 + it * p.bn;
            for ch in (tid..p.bn * 72).step_by(threads) {
                let r = ch / 72;
                let c = ch % 72;
                let ok = kl + r < kv1;
                let src = if ok { (kl + r) * 576 + c * 8 } else { 0u32 };
                cp_async_16_zfill(&mut sm[ld + r * 576 + (c ^ (r % 8)) * 8], &cache[src], ok);
            }
        }
        cp_async_commit();
        if it + 1 >= p.stages {
            let ti = it + 1 - p.stages;
            let kt = kv0 + ti * p.bn;
            let st = ring + (ti % p.stages) * p.bn * 576;

            // Partial scores over this warp's 144 dims.
            #[unroll]
            for j in 0..nt {
                #[unroll]
                for e in 0..4 {
                    s[j][e] = 0.0f32;
                }
            }
            #[unroll]
            for kk in 0..9 {
                let qr = rgi * 16 + lane % 16;
                let qc = cg * 18 + kk * 2 + lane / 16;
                ldmatrix_x4(&mut qa, &sm[qr * 576 + (qc ^ (qr % 8)) * 8]);
                #[unroll]
                for jp in 0..nt / 2 {
                    let r = jp * 16 + (lane / 16) * 8 + lane % 8;
                    let c = cg * 18 + kk * 2 + (lane / 8) % 2;
                    ldmatrix_x4(&mut bq, &sm[st + r * 576 + (c ^ (r % 8)) * 8]);
                    b[0] = bq[0];
                    b[1] = bq[1];
                    mma_m16n8k16_bf16(&mut s[2 * jp], &qa, &b);
                    b[0] = bq[2];
                    b[1] = bq[3];
                    mma_m16n8k16_bf16(&mut s[2 * jp + 1], &qa, &b);
                }
            }
            let mine = (rgi * 4 + cg) * 16 * ss;
            #[unroll]
            for j in 0..nt {
                let col = j * 8 + qd * 2;
                sp[mine + g * ss + col] = s[j][0];
                sp[mine + g * ss + col + 1] = s[j][1];
                sp[mine + (g + 8) * ss + col] = s[j][2];
                sp[mine + (g + 8) * ss + col + 1] = s[j][3];
            }
            sync_threads();

            // Full scores (summed in a fixed order, so all four warps agree), mask, online softmax.
            let mut mx_a = f32::NEG_INFINITY;
            let mut mx_b = f32::NEG_INFINITY;
            #[unroll]
            for j in 0..nt {
                #[unroll]
                for e in 0..4 {
                    let rl = g + (e / 2) * 8;
                    let col = j * 8 + qd * 2 + e % 2;
                    let base = rgi * 4 * 16 * ss + rl * ss + col;
                    let v = sp[base] + sp[base + 16 * ss] + sp[base + 32 * ss] + sp[base + 48 * ss];
                    let key = kt + col;
                    let node = if e < 2 { node_a } else { node_b };
                    let t = key - prefix;
                    let vis = key < kv1 && (key < prefix || ((mask[node * words + t / 32] >> (t % 32)) & 1) == 1);
                    s[j][e] = if vis { v * scale_log2 } else { f32::NEG_INFINITY };
                }
                mx_a = mx_a.max(s[j][0].max(s[j][1]));
                mx_b = mx_b.max(s[j][2].max(s[j][3]));
            }
            mx_a = mx_a.max(shfl_xor(mx_a, 1u32));
            mx_a = mx_a.max(shfl_xor(mx_a, 2u32));
            mx_b = mx_b.max(shfl_xor(mx_b, 1u32));
            mx_b = mx_b.max(shfl_xor(mx_b, 2u32));
            let mn_a = m_a.max(mx_a);
            let mn_b = m_b.max(mx_b);
            // Rows with no visible key yet keep m = -inf; use 0 as the exponent base then.
            let base_a = if mn_a == f32::NEG_INFINITY { 0.0f32 } else { mn_a };
            let base_b = if mn_b == f32::NEG_INFINITY { 0.0f32 } else { mn_b };
            let alpha_a = (m_a - base_a).exp2();
            let alpha_b = (m_b - base_b).exp2();
            m_a = mn_a;
            m_b = mn_b;
            l_a *= alpha_a;
            l_b *= alpha_b;
            // Once the row maxima settle (most tiles of a long context), skip the rescale.
            if !vote_all(alpha_a == 1.0f32 && alpha_b == 1.0f32) {
                #[unroll]
                for t in 0..16 {
                    acc[t][0] *= alpha_a;
                    acc[t][1] *= alpha_a;
                    acc[t][2] *= alpha_b;
                    acc[t][3] *= alpha_b;
                }
            }
            #[unroll]
            for j in 0..nt {
                s[j][0] = (s[j][0] - base_a).exp2();
                s[j][1] = (s[j][1] - base_a).exp2();
                s[j][2] = (s[j][2] - base_b).exp2();
                s[j][3] = (s[j][3] - base_b).exp2();
                l_a += s[j][0] + s[j][1];
                l_b += s[j][2] + s[j][3];
            }
            // P V over this warp's 128 output columns.
            #[unroll]
            for kk in 0..nt / 2 {
                pa[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
                pa[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
                pa[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                #[unroll]
                for t2 in 0..8 {
                    let r = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8;
                    let c = cg * 16 + t2 * 2 + lane / 16;
                    ldmatrix_x4_trans(&mut bq, &sm[st + r * 576 + (c ^ (r % 8)) * 8]);
                    b[0] = bq[0];
                    b[1] = bq[1];
                    mma_m16n8k16_bf16(&mut acc[2 * t2], &pa, &b);
                    b[0] = bq[2];
                    b[1] = bq[3];
                    mma_m16n8k16_bf16(&mut acc[2 * t2 + 1], &pa, &b);
                }
            }
        }
    }

    l_a += shfl_xor(l_a, 1u32);
    l_a += shfl_xor(l_a, 2u32);
    l_b += shfl_xor(l_b, 1u32);
    l_b += shfl_xor(l_b, 2u32);
    let inv_a = if l_a > 0.0f32 { 1.0f32 / l_a } else { 0.0f32 };
    let inv_b = if l_b > 0.0f32 { 1.0f32 / l_b } else { 0.0f32 };
    let split = block_idx_y();
    #[unroll]
    for t in 0..16 {
        let col = cg * 128 + t * 8 + qd * 2;
        if ra < rows {
            part_o[((split * rows + ra) * 512 + col) / 2] = pack_bf16x2(acc[t][0] * inv_a, acc[t][1] * inv_a);
        }
        if rb < rows {
            part_o[((split * rows + rb) * 512 + col) / 2] = pack_bf16x2(acc[t][2] * inv_b, acc[t][3] * inv_b);
        }
    }
    if cg == 0 && qd == 0 {
        let ln2 = std::f32::consts::LN_2;
        if ra < rows {
            part_lse[split * rows + ra] = if l_a > 0.0f32 {
                (m_a + l_a.log2()) * ln2
            } else {
                f32::NEG_INFINITY
            };
        }
        if rb < rows {
            part_lse[split * rows + rb] = if l_b > 0.0f32 {
                (m_b + l_b.log2()) * ln2
            } else {
                f32::NEG_INFINITY
            };
        }
    }
}

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

/// Keys per tile of [`MlaVerifyNarrow`]: 4 blocks of 16, the `mma` M (its shared memory holds
/// two tiles).
pub const NARROW_BN: u32 = 64;

/// Bytes of dynamic shared memory of [`MlaVerifyNarrow`]: the Q tile and a ring of two KV tiles,
/// bf16 rows of 576 padded to 584 (1168 bytes: the 8 rows of an `ldmatrix` matrix fall in
/// distinct banks).
pub const NARROW_DYN_SMEM: u32 = (8 + 2 * NARROW_BN) * 584 * 2;

/// Split-KV pass for at most 8 query rows per block (a decode step of 8 heads): the same grid,
/// inputs and partial outputs as [`MlaVerifySplit`], four warps. The keys, not the query rows,
/// are the `mma` M ("swap AB"), so a tile costs the math of 8 rows, not 16 or 64: warp `w`
/// scores keys `16 w ..` of the 64-key tile, `S^T = K Q^T` (`mma_m16n8k16_bf16`, K through
/// `ldmatrix`, Q's fragments held in registers, the even and odd k16 steps in two chains); the
/// tile's row maxima meet in shared memory, `P` (`[8, 64]` bf16) goes to shared memory, and
/// warp `w` accumulates output columns `128 w ..` as `O^T += V^T P^T` (the values through
/// `ldmatrix_x4_trans`). The KV tiles and the queries come in through the bulk-copy engine
/// (`cp_async_bulk`, one 1152-byte row per copy, completing on one mbarrier per ring slot)
/// rather than per-thread `cp.async` copies; rows past the split's keys copy its last key
/// (finite, masked), rows past `rows` the last row (not written). Online softmax in f32; row
/// sums stay per thread until the end; partial outputs as bf16 pairs, as [`MlaVerifyCombine`]
/// reads them.
#[kernel(block = 128, dyn_smem = NARROW_DYN_SMEM)]
pub fn mla_verify_narrow(
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
    // Q rows at `584 r`, then the ring of two 64-row tiles; `P` row `r` at `72 r` (padded like
    // the rows).
    let sm = dyn_shared::<bf16>();
    let ring = 8 * 584;
    let sp = shared::<bf16>(8 * 72);
    let smax = shared::<f32>(32);
    let ssum = shared::<f32>(32);
    let bars = shared::<u64>(2);
    let tid = thread_idx_x();
    let lane = lane_id();
    let w = warp_id();
    let g = lane / 4;
    let qd = lane % 4;
    let blk0 = block_idx_x() * 8;
    let prefix = lens[0];
    let total = prefix + nodes;
    let splits = grid_dim_y();
    let chunk = ((total + splits - 1) / splits + 63) / 64 * 64;
    let kv0 = block_idx_y() * chunk;
    let kv1 = (kv0 + chunk).min(total);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    // This thread's rows `2 qd + i` (the `mma` N index of accumulators `i` and `2 + i`) and
    // their nodes.
    let mut node = [0u32; 2];
    #[unroll]
    for i in 0..2 {
        node[i] = ((blk0 + 2 * qd + i) / heads).min(nodes - 1);
    }

    // Q's B fragments, k16 steps `2 i` and `2 i + 1` in `qf[i]`.
    let mut qf = [[0u32; 4]; 18];
    // Output columns `128 w + 16 t + g` (accumulators 0, 1) and `+ 8` (2, 3) of rows `2 qd + i`.
    let mut o = [[0.0f32; 4]; 8];
    let mut a = [0u32; 4];
    let mut b = [0u32; 2];
    let mut m = [f32::NEG_INFINITY; 2];
    let mut l = [0.0f32; 2];
    let mut mx = [0.0f32; 2];
    let mut al = [0.0f32; 2];

    if tid == 0 {
        mbar_init(&mut bars[0], 1u32);
        mbar_init(&mut bars[1], 1u32);
    }
    sync_threads();
    let ntiles = if kv1 > kv0 { (kv1 - kv0 + 63) / 64 } else { 0u32 };
    // Tile `it` is loaded at step `it` into slot `it % 2` and computed at step `it + 1`; the
    // queries land with tile 0. The decode step (one node) issues tile 0 before the wait for the
    // predecessor.
    let early = nodes == 1;
    for it in 0..ntiles + 1 {
        if it == 0 && !early {
            grid_wait();
            grid_launch_dependents();
        }
        let computes = it >= 1;
        let ti = if it > 0 { it - 1 } else { 0u32 };
        let kt = kv0 + ti * 64;
        let st = ring + (ti % 2) * 64 * 584;
        // Every warp is done with tile `it - 2` (the last step's), whose slot tile `it` takes,
        // and with the last step's `P` and maxima.
        sync_threads();
        if it < ntiles {
            let sl = it % 2;
            if tid == 0 {
                let qbytes = if it == 0 { 8 * 1152 } else { 0u32 };
                mbar_arrive_tx(&mut bars[sl], 64 * 1152 + qbytes);
            }
            if tid < 64 {
                let key = (kv0 + it * 64 + tid).min(kv1 - 1);
                cp_async_bulk(
                    &mut sm[ring + (sl * 64 + tid) * 584],
                    &cache[key * 576],
                    1152u32,
                    &mut bars[sl],
                );
            }
        }
        if it == 0 {
            if early {
                grid_wait();
                grid_launch_dependents();
            }
            if ntiles > 0 && tid < 8 {
                let r = (blk0 + tid).min(rows - 1);
                cp_async_bulk(&mut sm[tid * 584], &q[r * 576], 1152u32, &mut bars[0]);
            }
        }
        if computes {
            mbar_wait(&bars[ti % 2], (ti / 2) % 2);
            if ti == 0 {
                // Matrix `lane / 8` of each x4: Q rows `lane % 8`, 16-byte chunk `4 i + lane / 8`.
                #[unroll]
                for i in 0..18 {
                    ldmatrix_x4(&mut qf[i], &sm[(lane % 8) * 584 + (4 * i + lane / 8) * 8]);
                }
            }
            #[unroll]
            for i in 0..2 {
                mx[i] = f32::NEG_INFINITY;
            }
            // `S^T` for keys `16 w + g` and `+ 8` (accumulators `2 (e / 2) + i`), the even and odd
            // k16 steps in two chains.
            let mut s = [[0.0f32; 4]; 2];
            #[unroll]
            for i in 0..18 {
                #[unroll]
                for h in 0..2 {
                    ldmatrix_x4(
                        &mut a,
                        &sm[st + (16 * w + lane % 16) * 584 + (4 * i + 2 * h + lane / 16) * 8],
                    );
                    b[0] = qf[i][2 * h];
                    b[1] = qf[i][2 * h + 1];
                    mma_m16n8k16_bf16(&mut s[h], &a, &b);
                }
            }
            // Mask (tree keys only), scale, this thread's row maxima; the tile's meet in shared
            // memory.
            #[unroll]
            for e in 0..4 {
                let i = e % 2;
                let key = kt + 16 * w + g + 8 * (e / 2);
                let t = key - prefix;
                let vis = key < kv1 && (key < prefix || ((mask[node[i] * words + t / 32] >> (t % 32)) & 1) == 1);
                s[0][e] = if vis {
                    (s[0][e] + s[1][e]) * scale_log2
                } else {
                    f32::NEG_INFINITY
                };
                mx[i] = mx[i].max(s[0][e]);
            }
            #[unroll]
            for i in 0..2 {
                mx[i] = mx[i].max(shfl_xor(mx[i], 4u32));
                mx[i] = mx[i].max(shfl_xor(mx[i], 8u32));
                mx[i] = mx[i].max(shfl_xor(mx[i], 16u32));
                if g == 0 {
                    smax[w * 8 + 2 * qd + i] = mx[i];
                }
            }
            sync_threads();
            // Online softmax; `P` to shared memory.
            #[unroll]
            for i in 0..2 {
                let r = 2 * qd + i;
                let tm = smax[r].max(smax[8 + r]).max(smax[16 + r]).max(smax[24 + r]);
                let mn = m[i].max(tm);
                // Rows with no visible key yet keep m = -inf; use 0 as the exponent base then.
                let base = if mn == f32::NEG_INFINITY { 0.0f32 } else { mn };
                al[i] = (m[i] - base).exp2();
                m[i] = mn;
                l[i] *= al[i];
                mx[i] = base;
            }
            #[unroll]
            for e in 0..4 {
                let i = e % 2;
                let pv = (s[0][e] - mx[i]).exp2();
                l[i] += pv;
                sp[(2 * qd + i) * 72 + 16 * w + g + 8 * (e / 2)] = pv as bf16;
            }
            sync_threads();

            // Once the row maxima settle (most tiles of a long context), skip the rescale.
            if !vote_all(al[0] == 1.0f32 && al[1] == 1.0f32) {
                #[unroll]
                for t in 0..8 {
                    #[unroll]
                    for e in 0..4 {
                        o[t][e] *= al[e % 2];
                    }
                }
            }
            // `O^T += V^T P^T`: per pair of k16 steps the `P` fragments (matrix `lane / 8`: rows
            // `lane % 8`, key chunk `4 kp + lane / 8`), then per 16 output columns the values
            // transposed (matrix `j = lane / 8`: keys `16 ks + lane % 8 + 8 (j / 2)`, columns `+ 8
            // (j % 2)`).
            #[unroll]
            for kp in 0..2 {
                let mut pb = [0u32; 4];
                ldmatrix_x4(&mut pb, &sp[(lane % 8) * 72 + (4 * kp + lane / 8) * 8]);
                #[unroll]
                for h in 0..2 {
                    let ks = 2 * kp + h;
                    b[0] = pb[2 * h];
                    b[1] = pb[2 * h + 1];
                    let j = lane / 8;
                    #[unroll]
                    for t in 0..8 {
                        ldmatrix_x4_trans(
                            &mut a,
                            &sm[st + (16 * ks + lane % 8 + 8 * (j / 2)) * 584 + 128 * w + 16 * t + 8 * (j % 2)],
                        );
                        mma_m16n8k16_bf16(&mut o[t], &a, &b);
                    }
                }
            }
        }
    }

    // Row sums: this thread's keys, the lanes of its rows, then the warps in shared memory.
    #[unroll]
    for i in 0..2 {
        l[i] += shfl_xor(l[i], 4u32);
        l[i] += shfl_xor(l[i], 8u32);
        l[i] += shfl_xor(l[i], 16u32);
        if g == 0 {
            ssum[w * 8 + 2 * qd + i] = l[i];
        }
    }
    sync_threads();
    let split = block_idx_y();
    #[unroll]
    for i in 0..2 {
        let r = 2 * qd + i;
        let ls = ssum[r] + ssum[8 + r] + ssum[16 + r] + ssum[24 + r];
        al[i] = if ls > 0.0f32 { 1.0f32 / ls } else { 0.0f32 };
        let row = blk0 + r;
        if w == 0 && g == 0 && row < rows {
            part_lse[split * rows + row] = if ls > 0.0f32 {
                (m[i] + ls.log2()) * std::f32::consts::LN_2
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    // Column pairs: lanes `g` and `g ^ 1` hold columns `c` and `c ^ 1` of the same rows; the
    // even lane writes the pair of row `2 qd`, the odd lane of row `2 qd + 1` (accumulators
    // `2 h` and `2 h + 1`: columns `+ 8 h`).
    let odd = g % 2;
    let row = blk0 + 2 * qd + odd;
    let inv = if odd == 0 { al[0] } else { al[1] };
    #[unroll]
    for t in 0..8 {
        #[unroll]
        for h in 0..2 {
            let send = if odd == 0 { o[t][2 * h + 1] } else { o[t][2 * h] };
            let recv = shfl_xor(send, 4u32);
            let x = if odd == 0 { o[t][2 * h] } else { recv };
            let y = if odd == 0 { recv } else { o[t][2 * h + 1] };
            let col = 128 * w + 16 * t + g - odd + 8 * h;
            if row < rows {
                part_o[((split * rows + row) * 512 + col) / 2] = pack_bf16x2(x * inv, y * inv);
            }
        }
    }
}

/// A split-pass variant: [`MlaVerifySplit`], [`MlaVerifyWide`], [`MlaVerifyWg`] or
/// [`MlaVerifyNarrow`]. All take the same arguments and grid shape (rows per block aside) and
/// write the same partials for [`MlaVerifyCombine`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyVariant {
    /// The dim-split kernel.
    Split(VerifyParams),
    /// The full-width kernel.
    Wide(WideParams),
    /// The warpgroup (`wgmma`) kernel.
    Wg(WgParams),
    /// The kernel for at most 8 rows per block (keys as the `mma` M, bulk copies).
    Narrow,
}

impl Default for VerifyVariant {
    /// The safe default: the full-width kernel's first candidate.
    fn default() -> VerifyVariant {
        VerifyVariant::Wide(MlaVerifyWide::default_params())
    }
}

impl VerifyVariant {
    /// Every candidate of every kernel, the default first.
    pub fn all() -> Vec<VerifyVariant> {
        let wide = MlaVerifyWide::space().into_iter().map(VerifyVariant::Wide);
        wide.chain(MlaVerifySplit::space().into_iter().map(VerifyVariant::Split))
            .chain(MlaVerifyWg::space().into_iter().map(VerifyVariant::Wg))
            .chain(std::iter::once(VerifyVariant::Narrow))
            .collect()
    }

    /// Whether the variant runs on a GPU of compute capability `cc` (`Wg`:
    /// [`crate::wgmma_supported`]; `Narrow`: sm_90 and later, for the bulk copies).
    pub fn runs_on(&self, cc: (i32, i32)) -> bool {
        match self {
            VerifyVariant::Wg(_) => crate::wgmma_supported(cc),
            VerifyVariant::Narrow => cc.0 >= 9,
            _ => true,
        }
    }

    /// Query rows per block.
    pub fn rows_per_block(&self) -> u32 {
        match self {
            VerifyVariant::Split(p) => p.rows_per_block(),
            VerifyVariant::Wide(p) => p.rows_per_block(),
            VerifyVariant::Wg(p) => p.rows_per_block(),
            VerifyVariant::Narrow => 8,
        }
    }

    /// Keys per tile.
    pub fn bn(&self) -> u32 {
        match self {
            VerifyVariant::Split(p) => p.bn,
            VerifyVariant::Wide(p) => p.bn,
            VerifyVariant::Wg(p) => p.bn,
            VerifyVariant::Narrow => NARROW_BN,
        }
    }

    /// The kernel symbol.
    pub fn symbol(&self) -> String {
        match self {
            VerifyVariant::Split(p) => MlaVerifySplit::symbol(p),
            VerifyVariant::Wide(p) => MlaVerifyWide::symbol(p),
            VerifyVariant::Wg(p) => MlaVerifyWg::symbol(p),
            VerifyVariant::Narrow => MlaVerifyNarrow::symbol(&()),
        }
    }
}

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

/// The naive per-(node, head) kernel: grid = rows, 128 threads; every row re-reads its keys.
/// Same inputs and outputs as split + combine.
#[kernel(block = 128)]
pub fn mla_verify_naive(
    q: &[bf16],
    cache: &[bf16],
    mask: &[u32],
    out: &mut [bf16],
    lse: &mut [f32],
    heads: u32,
    prefix: u32,
    nodes: u32,
    words: u32,
    scale: f32,
) {
    let r = block_idx_x();
    let node = r / heads;
    let lane = lane_id();
    let warp = warp_id();
    let mut qv = [0.0f32; 18];
    #[unroll]
    for c in 0..9 {
        qv[2 * c] = q[r * 576 + c * 64 + lane * 2] as f32;
        qv[2 * c + 1] = q[r * 576 + c * 64 + lane * 2 + 1] as f32;
    }
    let mut o = [0.0f32; 16];
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    for key in (warp..prefix + nodes).step_by(4) {
        let t = key - prefix;
        let vis = key < prefix || ((mask[node * words + t / 32] >> (t % 32)) & 1) == 1;
        if vis {
            let mut d = 0.0f32;
            #[unroll]
            for c in 0..9 {
                d += qv[2 * c] * (cache[key * 576 + c * 64 + lane * 2] as f32);
                d += qv[2 * c + 1] * (cache[key * 576 + c * 64 + lane * 2 + 1] as f32);
            }
            let sc = warp_sum(d) * scale;
            let mn = m.max(sc);
            let alpha = (m - mn).exp();
            let pr = (sc - mn).exp();
            l = l * alpha + pr;
            #[unroll]
            for c in 0..8 {
                o[2 * c] = o[2 * c] * alpha + pr * (cache[key * 576 + c * 64 + lane * 2] as f32);
                o[2 * c + 1] = o[2 * c + 1] * alpha + pr * (cache[key * 576 + c * 64 + lane * 2 + 1] as f32);
            }
            m = mn;
        }
    }
    let so = shared::<f32>(4 * 512);
    let sm = shared::<f32>(4);
    let sl = shared::<f32>(4);
    #[unroll]
    for c in 0..8 {
        so[warp * 512 + c * 64 + lane * 2] = o[2 * c];
        so[warp * 512 + c * 64 + lane * 2 + 1] = o[2 * c + 1];
    }
    if lane == 0 {
        sm[warp] = m;
        sl[warp] = l;
    }
    sync_threads();
    let mt = sm[0].max(sm[1]).max(sm[2].max(sm[3]));
    let mut lt = 0.0f32;
    let mut w = [0.0f32; 4];
    #[unroll]
    for k in 0..4 {
        if sm[k] != f32::NEG_INFINITY {
            w[k] = (sm[k] - mt).exp();
        }
        lt += w[k] * sl[k];
    }
    let tid = thread_idx_x();
    #[unroll]
    for c in 0..4 {
        let col = tid * 4 + c;
        let v = w[0] * so[col] + w[1] * so[512 + col] + w[2] * so[1024 + col] + w[3] * so[1536 + col];
        out[r * 512 + col] = (v / lt) as bf16;
    }
    if tid == 0 {
        lse[r] = mt + lt.ln();
    }
}
