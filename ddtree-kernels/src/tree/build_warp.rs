//! Warp- and block-level device helpers of the tree builder ([`super::build::TreeBuild`]).

use ddtree_macros::device_fn;

use crate::common::{lanes_below_sum, warp_incl_scan, warp_sum};

/// The sum of exponentials of two online-softmax partials `(m, s)` and `(mo, so)` (each `s`
/// relative to its max `m`), relative to `max(m, mo)`; `s` when both are empty.
#[device_fn]
pub(super) fn sum_exp_merge(m: f32, s: f32, mo: f32, so: f32) -> f32 {
    let mn = m.max(mo);
    if mn == f32::NEG_INFINITY {
        s
    } else {
        s * (m - mn).exp() + so * (mo - mn).exp()
    }
}

/// The sum over the warp of each lane's sum of exponentials `s` (relative to its max `m`),
/// relative to the warp's max `wm`; 0 when every lane is empty.
#[device_fn]
pub(super) fn warp_sum_exp(m: f32, s: f32, wm: f32) -> f32 {
    warp_sum(if m == f32::NEG_INFINITY {
        0.0f32
    } else {
        s * (m - wm).exp()
    })
}

/// The f32 whose order key is `key` (the inverse of [`crate::common::order_key`]).
#[device_fn]
pub(super) fn key_value(key: u32) -> f32 {
    if (key >> 31) == 1 {
        f32::from_bits(key & 0x7fffffffu32)
    } else {
        f32::from_bits(!key)
    }
}

/// The `m`-th largest (`m` in 1..=32) of `v` over the warp (a bitonic sort across the lanes;
/// every lane must call it).
#[device_fn]
pub(super) fn warp_kth_largest(v: u32, m: u32) -> u32 {
    let lane = lane_id();
    let mut x = v;
    let mut size = 2u32;
    while size <= 32u32 {
        let mut stride = size / 2u32;
        while stride > 0u32 {
            let o = shfl_xor(x, stride);
            // Runs with (lane & size) == 0 sort descending (at size 32, all of them).
            if ((lane & stride) == 0u32) == ((lane & size) == 0u32) {
                x = x.max(o);
            } else {
                x = x.min(o);
            }
            stride = stride / 2u32;
        }
        size = size * 2u32;
    }
    shfl_idx(x, m - 1u32)
}

/// `v` from lane `lane ^ m` (a 64-bit [`shfl_xor`]).
#[device_fn]
pub(super) fn shfl_xor_u64(v: u64, m: u32) -> u64 {
    let lo = shfl_xor(v as u32, m);
    let hi = shfl_xor((v >> 32) as u32, m);
    ((hi as u64) << 32) | (lo as u64)
}

/// One slot of the merge of two descending warp lists of 64 (lane l holds entries 2 l and
/// 2 l + 1; slot 0 passes `a`'s entry 2 l and `b`'s 2 l + 1, slot 1 the others): the larger of
/// `a`'s entry and `b`'s mirror entry (63 - i), which makes a bitonic list holding the best 64
/// of both, then the half-cleaners at lane strides 16 .. 1. The caller orders the two slots
/// (the last step, stride 1).
#[device_fn]
pub(super) fn warp_merge_slot(a: u64, b: u64) -> u64 {
    let lane = lane_id();
    let mut v = a.max(shfl_xor_u64(b, 31u32));
    #[unroll]
    for h in 0..5u32 {
        let m = 16u32 >> h;
        let o = shfl_xor_u64(v, m);
        v = if (lane & m) == 0u32 { v.max(o) } else { v.min(o) };
    }
    v
}

/// Exclusive prefix sum of `v` over the block (all threads must call it).
#[device_fn]
pub(super) fn block_excl_scan(v: u32) -> u32 {
    let ws = shared::<u32>(32);
    let lane = lane_id();
    let warp = warp_id();
    let inc = warp_incl_scan(v);
    sync_threads();
    if lane == 31 {
        ws[warp] = inc;
    }
    sync_threads();
    let total = if lane < block_dim_x() / 32 { ws[lane] } else { 0u32 };
    inc - v + lanes_below_sum(total, warp)
}

/// A lane's run of `n` compared entries, rounded up to a multiple of 4 past 4 (so that the
/// compiler can read long runs 16 bytes at a time; short ones stay short).
#[device_fn]
pub(super) fn run_len(n: u32) -> u32 {
    if n > 4u32 {
        (n + 3u32) & !3u32
    } else {
        n
    }
}

/// The lanes that split each of `n >= 1` entries' comparisons over `block` threads, as a
/// shift: log2 of the largest power of two at most `min(32, block / n)` (at least 1), without
/// a division.
#[device_fn]
pub(super) fn split_shift(n: u32, block: u32) -> u32 {
    let ln = n.leading_zeros();
    let lb = block.leading_zeros();
    let mut sh = 0u32;
    if ln > lb {
        sh = ln - lb;
        if (n << sh) > block {
            sh -= 1u32;
        }
    }
    sh.min(5u32)
}

/// Node metadata word: parent (11 bits), rank among its siblings (11 bits), depth (from bit 22).
#[device_fn]
pub(super) fn meta_word(parent: u32, rank: u32, depth: u32) -> u32 {
    parent | (rank << 11) | (depth << 22)
}

/// The builder's order: whether (order key `ka`, lexicographic code `la`) comes before
/// (`kb`, `lb`): higher score, then the lexicographically smaller rank tuple.
#[device_fn]
pub(super) fn better(ka: u32, la: u32, kb: u32, lb: u32) -> bool {
    ka > kb || (ka == kb && la < lb)
}
