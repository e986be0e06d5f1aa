//! bf16 tensor-core tile GEMM: `c[m, n] = sum_k a[m, k] * b[n, k]` (both operands K-major, as
//! `nn.Linear` weights are stored), f32 accumulation, bf16 output.
//!
//! Block tile `bm x bn x bk`, `warps_m x warps_n` warps, each warp a `(bm / warps_m) x
//! (bn / warps_n)` tile of `mma.sync.m16n8k16` fragments loaded with `ldmatrix`. Global to
//! shared copies are `cp.async` (16 bytes, zero-filled outside the matrix) in a `stages`-deep
//! ring; shared rows are XOR-swizzled in 16-byte chunks so `ldmatrix` is conflict-free.

use ddtree_codegen::dsl::*;
use ddtree_macros::{kernel, KernelParams};

/// This family's checks (re-exported by [`crate::check`]).
pub mod check;
pub mod op;
pub mod tune;

/// Compile-time parameters of [`GemmBf16`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct GemmParams {
    /// Block tile rows (M).
    pub bm: u32,
    /// Block tile columns (N).
    pub bn: u32,
    /// Block tile depth (K): 32 or 64.
    pub bk: u32,
    /// Warps along M.
    pub warps_m: u32,
    /// Warps along N.
    pub warps_n: u32,
    /// cp.async pipeline depth.
    pub stages: u32,
}

/// `a` is `[m, k]`, `b` is `[n, k]`, `c` is `[m, n]`, all row-major bf16. Needs `k % 8 == 0`.
/// Grid: `(ceil(n / bn), ceil(m / bm))`.
#[kernel(block = p.warps_m * p.warps_n * 32, space = [
    GemmParams { bm: 128, bn: 128, bk: 32, warps_m: 2, warps_n: 2, stages: 3 },
    GemmParams { bm: 128, bn: 128, bk: 32, warps_m: 2, warps_n: 4, stages: 3 },
    GemmParams { bm: 64, bn: 128, bk: 32, warps_m: 2, warps_n: 2, stages: 4 },
    GemmParams { bm: 128, bn: 64, bk: 32, warps_m: 2, warps_n: 2, stages: 4 },
    GemmParams { bm: 64, bn: 64, bk: 64, warps_m: 2, warps_n: 2, stages: 3 },
    GemmParams { bm: 64, bn: 64, bk: 32, warps_m: 2, warps_n: 2, stages: 4 },
])]
pub fn gemm_bf16(#[comptime] p: &GemmParams, a: &[bf16], b: &[bf16], c: &mut [bf16], m: u32, n: u32, k: u32) {
    comptime_assert!(p.bk == 32 || p.bk == 64, "bk must be 32 or 64");
    comptime_assert!(p.bm % (16 * p.warps_m) == 0, "each warp needs whole 16-row fragments");
    comptime_assert!(
        p.bn % (16 * p.warps_n) == 0,
        "each warp needs whole pairs of 8-column fragments"
    );
    comptime_assert!(p.stages >= 2 && p.stages <= 4, "stages must be 2..=4");
    comptime_assert!(
        p.stages * (p.bm + p.bn) * p.bk * 2 <= 49152,
        "static shared memory is limited to 48 KiB"
    );
    comptime_assert!(
        (p.bm * p.bk / 8) % (p.warps_m * p.warps_n * 32) == 0,
        "A tile copies must split evenly over threads"
    );
    comptime_assert!(
        (p.bn * p.bk / 8) % (p.warps_m * p.warps_n * 32) == 0,
        "B tile copies must split evenly over threads"
    );
    let threads = p.warps_m * p.warps_n * 32;
    let mt = p.bm / p.warps_m / 16;
    let nt = p.bn / p.warps_n / 8;
    let chunks = p.bk / 8;
    let a_stage = p.bm * p.bk;
    let b_stage = p.bn * p.bk;
    let sa = shared::<bf16>(p.stages * a_stage);
    let sb = shared::<bf16>(p.stages * b_stage);

    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let wm0 = (warp / p.warps_n) * (p.bm / p.warps_m);
    let wn0 = (warp % p.warps_n) * (p.bn / p.warps_n);
    let m0 = block_idx_y() * p.bm;
    let n0 = block_idx_x() * p.bn;
    let ktiles = (k + p.bk - 1) / p.bk;

    let mut acc = [[0.0f32; 4]; mt * nt];
    let mut af = [[0u32; 4]; mt];
    let mut bq = [[0u32; 4]; nt / 2];
    let mut bfr = [[0u32; 2]; nt];

    for t in 0..ktiles + p.stages - 1 {
        // Everyone is done reading the slot this iteration refills.
        sync_threads();
        let slot = t % p.stages;
        let k0 = t * p.bk;
        #[unroll]
        for it in 0..p.bm * chunks / threads {
            let ch = tid + it * threads;
            let r = ch / chunks;
            let cc = ch % chunks;
            let ok = t < ktiles && m0 + r < m && k0 + cc * 8 < k;
            let src = if ok { (m0 + r) * k + k0 + cc * 8 } else { 0u32 };
            let sw = if chunks == 8 { r % 8 } else { (r / 2) % 4 };
            cp_async_16_zfill(&mut sa[slot * a_stage + r * p.bk + (cc ^ sw) * 8], &a[src], ok);
        }
        #[unroll]
        for it in 0..p.bn * chunks / threads {
            let ch = tid + it * threads;
            let r = ch / chunks;
            let cc = ch % chunks;
            let ok = t < ktiles && n0 + r < n && k0 + cc * 8 < k;
            let src = if ok { (n0 + r) * k + k0 + cc * 8 } else { 0u32 };
            let sw = if chunks == 8 { r % 8 } else { (r / 2) % 4 };
            cp_async_16_zfill(&mut sb[slot * b_stage + r * p.bk + (cc ^ sw) * 8], &b[src], ok);
        }
        cp_async_commit();
        if t >= p.stages - 1 {
            // The tile loaded stages - 1 iterations ago has landed.
            cp_async_wait(p.stages - 1);
            sync_threads();
            let cs = (t - (p.stages - 1)) % p.stages;
            #[unroll]
            for kk in 0..p.bk / 16 {
                #[unroll]
                for i in 0..mt {
                    let r = wm0 + i * 16 + lane % 16;
                    let cc = kk * 2 + lane / 16;
                    let sw = if chunks == 8 { r % 8 } else { (r / 2) % 4 };
                    ldmatrix_x4(&mut af[i], &sa[cs * a_stage + r * p.bk + (cc ^ sw) * 8]);
                }
                #[unroll]
                for j in 0..nt / 2 {
                    let r = wn0 + j * 16 + (lane / 16) * 8 + lane % 8;
                    let cc = kk * 2 + (lane / 8) % 2;
                    let sw = if chunks == 8 { r % 8 } else { (r / 2) % 4 };
                    ldmatrix_x4(&mut bq[j], &sb[cs * b_stage + r * p.bk + (cc ^ sw) * 8]);
                    bfr[2 * j][0] = bq[j][0];
                    bfr[2 * j][1] = bq[j][1];
                    bfr[2 * j + 1][0] = bq[j][2];
                    bfr[2 * j + 1][1] = bq[j][3];
                }
                #[unroll]
                for i in 0..mt {
                    #[unroll]
                    for j in 0..nt {
                        mma_m16n8k16_bf16(&mut acc[i * nt + j], &af[i], &bfr[j]);
                    }
                }
            }
        }
    }

    let g = lane / 4;
    let q = lane % 4;
    #[unroll]
    for i in 0..mt {
        #[unroll]
        for j in 0..nt {
            let row = m0 + wm0 + i * 16 + g;
            let col = n0 + wn0 + j * 8 + q * 2;
            if row < m && col < n {
                c[row * n + col] = acc[i * nt + j][0] as bf16;
            }
            if row < m && col + 1 < n {
                c[row * n + col + 1] = acc[i * nt + j][1] as bf16;
            }
            if row + 8 < m && col < n {
                c[(row + 8) * n + col] = acc[i * nt + j][2] as bf16;
            }
            if row + 8 < m && col + 1 < n {
                c[(row + 8) * n + col + 1] = acc[i * nt + j][3] as bf16;
            }
        }
    }
}

/// The launch grid for `c[m, n]`: `(ceil(n / bn), ceil(m / bm))`.
pub fn grid(p: &GemmParams, m: usize, n: usize) -> (u32, u32) {
    ((n as u32).div_ceil(p.bn), (m as u32).div_ceil(p.bm))
}

/// CPU reference in f32: `a` is `[m, k]`, `b` is `[n, k]`; returns `[m, n]`.
pub fn reference(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = a[i * k..(i + 1) * k]
                .iter()
                .zip(&b[j * k..(j + 1) * k])
                .map(|(x, y)| x * y)
                .sum();
        }
    }
    c
}
