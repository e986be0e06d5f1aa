//! Device functions shared by several kernels: warp and block reductions, order keys.

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

/// Sum of `v` over the 32 lanes of a warp (every lane gets the sum).
#[device_fn]
pub fn warp_sum_u32(v: u32) -> u32 {
    let mut s = v;
    #[unroll]
    for k in 0..5u32 {
        s += shfl_xor(s, 16u32 >> k);
    }
    s
}

/// Minimum of `v` over the 32 lanes of a warp.
#[device_fn]
pub fn warp_min_u32(v: u32) -> u32 {
    let mut m = v;
    #[unroll]
    for k in 0..5u32 {
        m = m.min(shfl_xor(m, 16u32 >> k));
    }
    m
}

/// Maximum of `v` over the 32 lanes of a warp.
#[device_fn]
pub fn warp_max_u32(v: u32) -> u32 {
    let mut m = v;
    #[unroll]
    for k in 0..5u32 {
        m = m.max(shfl_xor(m, 16u32 >> k));
    }
    m
}

/// Inclusive prefix sum of `v` over the lanes of a warp (lane i gets lanes 0..=i).
#[device_fn]
pub fn warp_incl_scan(v: u32) -> u32 {
    let lane = lane_id();
    let mut inc = v;
    #[unroll]
    for o in 0..5u32 {
        let t = shfl_up(inc, 1u32 << o);
        if lane >= (1u32 << o) {
            inc += t;
        }
    }
    inc
}

/// Sum of `v` over the lanes below `at` (every lane gets it).
#[device_fn]
pub fn lanes_below_sum(v: u32, at: u32) -> u32 {
    shfl_idx(warp_incl_scan(v) - v, at)
}

/// `f32` bits mapped to a `u32` whose unsigned order is `f32::total_cmp`'s (0 only for a
/// negative NaN with every payload bit set).
#[device_fn]
pub fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if (b >> 31) == 1 {
        b ^ u32::MAX
    } else {
        b | 0x8000_0000u32
    }
}
