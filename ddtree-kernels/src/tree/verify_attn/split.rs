//! The dim-split pass [`MlaVerifySplit`] (`mma.sync`, four warps splitting the score reduction).

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

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
