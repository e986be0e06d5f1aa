//! Row top-k (and argmax, k = 1) over wide rows such as a 163840-token vocabulary.
//!
//! Each thread keeps a sorted top-k of its strided slice in registers; the block then merges
//! the per-thread lists with k rounds of a warp-shuffle + shared-memory argmax. Order: larger
//! value first; equal values: smaller index first. NaN values are never selected.
//!
//! [`RowTopk`] runs one block per row, which leaves most of the GPU idle for the decode case (a
//! few rows of a 163840-wide vocabulary). [`RowTopkSplit`] spreads each row over many blocks in
//! two launches: a part pass (grid `(parts, rows)`, each block the exact top-k of its slice of
//! `block * per` columns) and a merge pass (grid `(1, rows)`, the top-k of the `parts * k`
//! candidates by the same order). [`TopkRunner`] picks between the two paths by row count.

use ddtree_codegen::Kernel;
use ddtree_macros::{device_fn, kernel, KernelParams};

/// This family's checks (re-exported by [`crate::check`]).
pub mod check;
pub mod op;
pub mod tune;

pub use op::{RowTopkOp, TopkRunner, SPLIT_MAX_ROWS};

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

/// Compile-time parameters of [`RowTopkSplit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct TopkSplitParams {
    /// Threads per block.
    pub block: u32,
    /// Items each thread loads per step (a part block covers `block * per` columns).
    pub per: u32,
    /// How many entries to keep (1 = argmax).
    pub k: u32,
    /// The merge pass (else the part pass).
    pub merge: bool,
}

impl TopkSplitParams {
    /// The part-pass variant for `k` (the first part candidate of the space with that `k`).
    pub fn part(k: u32) -> Option<TopkSplitParams> {
        Self::find(k, false)
    }

    /// The merge-pass variant for `k`.
    pub fn merge(k: u32) -> Option<TopkSplitParams> {
        Self::find(k, true)
    }

    fn find(k: u32, merge: bool) -> Option<TopkSplitParams> {
        RowTopkSplit::space().into_iter().find(|p| p.k == k && p.merge == merge)
    }

    /// Columns one part block covers.
    pub fn span(&self) -> usize {
        (self.block * self.per) as usize
    }

    /// Part blocks per row of `n` columns.
    pub fn parts(&self, n: usize) -> usize {
        n.div_ceil(self.span())
    }
}

/// Split row top-k, one pass of two (see the module docs); `len` is the input row length.
///
/// Part pass (grid `(parts, rows)`, `parts = ceil(n / (block * per))`): `vals` = `[rows, n]`
/// with `len = n`; block `b` covers columns `[b * block * per, min((b + 1) * block * per, n))`
/// and writes its slice's `k` best to `out_v` / `out_i` (`[rows, parts, k]`, best first; slots
/// beyond the slice's non-NaN count get `(-inf, u32::MAX)`, which no real entry loses to).
/// `ids` is unused.
///
/// Both passes keep a sorted top-k per thread (a cheap test against the thread's k-th entry
/// first), then merge without per-round block barriers: each warp takes the k best of its
/// lanes' lists by k warp argmaxes, and after one barrier warp 0 takes the k best of the
/// per-warp lists the same way.
///
/// Merge pass (grid `(1, rows)`): `vals` / `ids` = the part pass's candidates with
/// `len = parts * k`; writes the row's `k` best to `out_v` / `out_i` (`[rows, k]`).
#[kernel(block = p.block, space = [
    TopkSplitParams { block: 256, per: 4, k: 1, merge: false },
    TopkSplitParams { block: 256, per: 1, k: 1, merge: true },
    TopkSplitParams { block: 256, per: 4, k: 8, merge: false },
    TopkSplitParams { block: 512, per: 4, k: 8, merge: true },
    TopkSplitParams { block: 128, per: 8, k: 32, merge: false },
    TopkSplitParams { block: 128, per: 16, k: 32, merge: true },
])]
pub fn row_topk_split(
    #[comptime] p: &TopkSplitParams,
    vals: &[f32],
    ids: &[u32],
    out_v: &mut [f32],
    out_i: &mut [u32],
    len: u32,
) {
    comptime_assert!(p.k >= 1 && p.k <= 64, "k must be in 1..=64");
    comptime_assert!(p.per >= 1 && p.per <= 16, "per must be in 1..=16");
    comptime_assert!(p.block % 32 == 0, "block must be a multiple of 32");
    comptime_assert!(
        p.block * p.k <= 4096,
        "the per-thread lists (block * k entries) must fit in shared memory"
    );
    let tid = thread_idx_x();
    let blk = block_idx_x();
    let row = block_idx_y();
    let lo = blk * p.block * p.per;
    let cnt = if p.merge { len } else { (len - lo).min(p.block * p.per) };
    let base = row * len + lo;
    let mut vals_r = [f32::NEG_INFINITY; p.k];
    let mut idxs_r = [u32::MAX; p.k];
    for c in (0..cnt).step_by(p.block * p.per) {
        // All loads of a step first (independent, in flight together), then the inserts.
        let mut xv = [f32::NAN; p.per];
        let mut xi = [u32::MAX; p.per];
        #[unroll]
        for j in 0..p.per {
            let i = c + j * p.block + tid;
            if i < cnt {
                xv[j] = vals[base + i];
                xi[j] = if p.merge { ids[base + i] } else { lo + i };
            }
        }
        #[unroll]
        for j in 0..p.per {
            let v = xv[j];
            let i = xi[j];
            if v > vals_r[p.k - 1] || (v == vals_r[p.k - 1] && i < idxs_r[p.k - 1]) {
                vals_r[p.k - 1] = v;
                idxs_r[p.k - 1] = i;
                #[unroll]
                for m in 1..p.k {
                    let a = p.k - m;
                    if vals_r[a] > vals_r[a - 1] || (vals_r[a] == vals_r[a - 1] && idxs_r[a] < idxs_r[a - 1]) {
                        let tv = vals_r[a];
                        vals_r[a] = vals_r[a - 1];
                        vals_r[a - 1] = tv;
                        let ti = idxs_r[a];
                        idxs_r[a] = idxs_r[a - 1];
                        idxs_r[a - 1] = ti;
                    }
                }
            }
        }
    }
    let list_v = shared::<f32>(p.block * p.k);
    let list_i = shared::<u32>(p.block * p.k);
    let warp_v = shared::<f32>(p.block / 32 * p.k);
    let warp_i = shared::<u32>(p.block / 32 * p.k);
    #[unroll]
    for j in 0..p.k {
        list_v[tid * p.k + j] = vals_r[j];
        list_i[tid * p.k + j] = idxs_r[j];
    }
    // Each warp: the k best of its lanes' lists, by k warp argmaxes (no block barrier: a lane
    // reads only its own list).
    let lane = lane_id();
    let warp = warp_id();
    let mut head = 0u32;
    for r in 0..p.k {
        let mut hv = f32::NEG_INFINITY;
        let mut hi = u32::MAX;
        if head < p.k {
            hv = list_v[tid * p.k + head];
            hi = list_i[tid * p.k + head];
        }
        let win = warp_best_lane(hv, hi);
        let bv = shfl_idx(hv, win);
        let bi = shfl_idx(hi, win);
        if lane == 0 {
            warp_v[warp * p.k + r] = bv;
            warp_i[warp * p.k + r] = bi;
        }
        if lane == win {
            head += 1;
        }
    }
    sync_threads();
    // Warp 0: the block's k best of the per-warp lists (lane w holds warp w's).
    if warp == 0 {
        let out = (row * grid_dim_x() + blk) * p.k;
        let mut wh = 0u32;
        for r in 0..p.k {
            let mut hv = f32::NEG_INFINITY;
            let mut hi = u32::MAX;
            if lane < p.block / 32 && wh < p.k {
                hv = warp_v[lane * p.k + wh];
                hi = warp_i[lane * p.k + wh];
            }
            let win = warp_best_lane(hv, hi);
            let bv = shfl_idx(hv, win);
            let bi = shfl_idx(hi, win);
            if lane == 0 {
                out_v[out + r] = bv;
                out_i[out + r] = bi;
            }
            if lane == win {
                wh += 1;
            }
        }
    }
}

/// The lane holding the best `(v, i)` of the warp by the top-k order (larger value, then smaller
/// index, then smaller lane, so exactly one lane wins even among equal fillers); every lane gets
/// it. All 32 lanes must call it.
#[device_fn]
fn warp_best_lane(v: f32, i: u32) -> u32 {
    let mut bv = v;
    let mut bi = i;
    let mut bl = lane_id();
    #[unroll]
    for s in 0..5u32 {
        let ov = shfl_xor(bv, 16u32 >> s);
        let oi = shfl_xor(bi, 16u32 >> s);
        let ol = shfl_xor(bl, 16u32 >> s);
        if ov > bv || (ov == bv && (oi < bi || (oi == bi && ol < bl))) {
            bv = ov;
            bi = oi;
            bl = ol;
        }
    }
    bl
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
