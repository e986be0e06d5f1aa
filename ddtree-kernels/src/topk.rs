//! Row top-k (and argmax, k = 1) over wide rows such as a 163840-token vocabulary.
//!
//! Each thread keeps a sorted top-k of its strided slice in registers; the block then merges
//! the per-thread lists with k rounds of a warp-shuffle + shared-memory argmax. Order: larger
//! value first; equal values: smaller index first. NaN values are never selected.

use ddtree_macros::{kernel, KernelParams};

/// Compile-time parameters of [`RowTopk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct TopkParams {
    /// Threads per block (one block per row).
    pub block: u32,
    /// How many entries to keep (1 = argmax).
    pub k: u32,
}

/// For each row of `logits` (`[rows, n]`, grid = rows), writes the `k` best values and their
/// column indices to `values` / `indices` (`[rows, k]`), best first. Needs `n >= k`.
#[kernel(block = p.block, space = [
    TopkParams { block: 512, k: 1 },
    TopkParams { block: 256, k: 1 },
    TopkParams { block: 1024, k: 1 },
    TopkParams { block: 256, k: 8 },
    TopkParams { block: 512, k: 8 },
    TopkParams { block: 128, k: 32 },
])]
pub fn row_topk(#[comptime] p: &TopkParams, logits: &[f32], values: &mut [f32], indices: &mut [u32], n: u32) {
    comptime_assert!(p.k >= 1 && p.k <= 64, "k must be in 1..=64");
    comptime_assert!(p.block % 32 == 0, "block must be a multiple of 32");
    comptime_assert!(
        p.block * p.k <= 4096,
        "the per-thread lists (block * k entries) must fit in shared memory"
    );
    let tid = thread_idx_x();
    let row = block_idx_x();
    let base = row * n;
    let mut vals = [f32::NEG_INFINITY; p.k];
    let mut idxs = [u32::MAX; p.k];
    for i in (tid..n).step_by(p.block) {
        let v = logits[base + i];
        if v > vals[p.k - 1] || (v == vals[p.k - 1] && i < idxs[p.k - 1]) {
            vals[p.k - 1] = v;
            idxs[p.k - 1] = i;
            #[unroll]
            for j in 1..p.k {
                let a = p.k - j;
                if vals[a] > vals[a - 1] || (vals[a] == vals[a - 1] && idxs[a] < idxs[a - 1]) {
                    let tv = vals[a];
                    vals[a] = vals[a - 1];
                    vals[a - 1] = tv;
                    let ti = idxs[a];
                    idxs[a] = idxs[a - 1];
                    idxs[a - 1] = ti;
                }
            }
        }
    }
    let list_v = shared::<f32>(p.block * p.k);
    let list_i = shared::<u32>(p.block * p.k);
    let warp_v = shared::<f32>(32);
    let warp_i = shared::<u32>(32);
    #[unroll]
    for j in 0..p.k {
        list_v[tid * p.k + j] = vals[j];
        list_i[tid * p.k + j] = idxs[j];
    }
    sync_threads();
    let mut head = 0u32;
    for r in 0..p.k {
        let mut v = f32::NEG_INFINITY;
        let mut i = u32::MAX;
        if head < p.k {
            v = list_v[tid * p.k + head];
            i = list_i[tid * p.k + head];
        }
        #[unroll]
        for s in 0..5u32 {
            let ov = shfl_xor(v, 16u32 >> s);
            let oi = shfl_xor(i, 16u32 >> s);
            if ov > v || (ov == v && oi < i) {
                v = ov;
                i = oi;
            }
        }
        if lane_id() == 0 {
            warp_v[warp_id()] = v;
            warp_i[warp_id()] = i;
        }
        sync_threads();
        let mut bv = warp_v[0];
        let mut bi = warp_i[0];
        for w in 1..p.block / 32 {
            let ov = warp_v[w];
            let oi = warp_i[w];
            if ov > bv || (ov == bv && oi < bi) {
                bv = ov;
                bi = oi;
            }
        }
        if tid == 0 {
            values[row * p.k + r] = bv;
            indices[row * p.k + r] = bi;
        }
        if bi % p.block == tid {
            head += 1;
        }
        sync_threads();
    }
}

/// CPU reference: per row the `k` best (value, index) pairs, best first.
pub fn reference(logits: &[f32], n: usize, k: usize) -> Vec<(f32, u32)> {
    logits
        .chunks(n)
        .flat_map(|row| {
            let mut idx: Vec<u32> = (0..n as u32).filter(|&i| !row[i as usize].is_nan()).collect();
            idx.sort_by(|&a, &b| {
                let (va, vb) = (row[a as usize], row[b as usize]);
                vb.partial_cmp(&va).expect("NaN filtered").then(a.cmp(&b))
            });
            idx.truncate(k);
            idx.into_iter().map(move |i| (row[i as usize], i))
        })
        .collect()
}
