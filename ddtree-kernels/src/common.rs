//! Device functions shared by several kernels: warp and block reductions.

use ddtree_macros::device_fn;

/// Sum of `v` over the 32 lanes of a warp (every lane gets the sum).
#[device_fn]
pub fn warp_sum(v: f32) -> f32 {
    let mut s = v;
    #[unroll]
    for k in 0..5u32 {
        s += shfl_xor(s, 16u32 >> k);
    }
    s
}

/// Maximum of `v` over the 32 lanes of a warp.
#[device_fn]
pub fn warp_max(v: f32) -> f32 {
    let mut m = v;
    #[unroll]
    for k in 0..5u32 {
        m = m.max(shfl_xor(m, 16u32 >> k));
    }
    m
}

/// Sum of `v` over the whole block (every thread gets it). All threads must call it; the block
/// size must be a multiple of 32.
#[device_fn]
pub fn block_sum(v: f32) -> f32 {
    let partial = shared::<f32>(33);
    let s = warp_sum(v);
    let lane = lane_id();
    let warp = warp_id();
    if lane == 0 {
        partial[warp] = s;
    }
    sync_threads();
    if warp == 0 {
        let mut t = 0.0f32;
        if lane < block_dim_x() / 32 {
            t = partial[lane];
        }
        t = warp_sum(t);
        if lane == 0 {
            partial[32] = t;
        }
    }
    sync_threads();
    partial[32]
}
