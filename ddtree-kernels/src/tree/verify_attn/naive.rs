//! The naive per-(node, head) kernel [`MlaVerifyNaive`], for comparison.

use ddtree_codegen::dsl::*;
use ddtree_macros::kernel;

use crate::common::warp_sum;

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
