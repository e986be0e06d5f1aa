//! The swap-AB pass [`MlaVerifyNarrow`] for at most 8 query rows (bulk copies, sm_90).

use ddtree_codegen::dsl::*;
use ddtree_macros::kernel;

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
