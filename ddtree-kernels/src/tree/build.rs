//! The GPU tree builder, three launches with no host copy:
//!
//! 1. [`TreeTopk`] part pass (grid = `(nb, L)`): each block reads its slice of a depth's row
//!    once into shared memory (order keys), writes the slice's partial max / sum of exponentials,
//!    and its exact top `min(k, slice)` (radix select, 8-bit digits over the order key, ties at
//!    the threshold by smaller token id), best first, as candidate logits and token ids.
//! 2. [`TreeTopk`] merge pass (grid = `(1, L)`): the depth's log-sum-exp from the partials, then
//!    the same radix select over the `nb * k` candidates, giving the depth's top `k` log-probs
//!    and tokens, best first.
//! 3. [`TreeExpand`] (one block): DDTree's best-first expansion by warp 0, then the tree arrays
//!    and the ancestor-or-self mask rows by all threads. The frontier holds at most one entry
//!    per emitted node (its next child to emit), so the frontier is indexed by node; lane `i % 32`
//!    caches the best entry among nodes `i`, and a pop is a 5-step `u32` shuffle max of the
//!    entries' order keys (equal scores: the exact rank-tuple rule of [`super::reference`],
//!    found by walking the two paths).

use ddtree_macros::{device_fn, kernel, KernelParams};

/// Compile-time parameters of [`TreeTopk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct TreeTopkParams {
    /// Threads per block.
    pub block: u32,
    /// Part pass: the most logits per block (held in shared memory as order keys). The merge
    /// pass reads its candidates from global memory and keeps a one-warp scratch of this size.
    pub span: u32,
    /// Merge pass (reads the part pass's candidates and partials).
    pub merge: bool,
}

impl TreeTopkParams {
    /// The part pass's variant.
    pub const PART: TreeTopkParams = TreeTopkParams {
        block: 512,
        span: 8192,
        merge: false,
    };
    /// The merge pass's variant.
    pub const MERGE: TreeTopkParams = TreeTopkParams {
        block: 1024,
        span: 32,
        merge: true,
    };
}

/// The largest `k` (= min(budget, vocab)) of the builder.
pub const MAX_K: usize = 1024;

/// The order key of an f32 (as [`super::reference::order_key`]).
#[device_fn]
fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if (b >> 31) == 1 {
        !b
    } else {
        b | 0x80000000u32
    }
}

/// The f32 whose order key is `key` (the inverse of [`order_key`]).
#[device_fn]
fn key_value(key: u32) -> f32 {
    if (key >> 31) == 1 {
        f32::from_bits(key & 0x7fffffffu32)
    } else {
        f32::from_bits(!key)
    }
}

/// Top-`k` selection of one depth `row = block_idx_y()`, in two passes (see the module docs).
///
/// Part pass (`nb` blocks per row, block `b` covers logits `[b * span, min((b + 1) * span,
/// vocab))`, `span <= p.span`): `vals` = logits `[rows, vocab]`; writes `val_out` / `tok_out`
/// (`[rows, nb, k]`: the slice's best logits and token ids, best first; unused slots get the
/// value whose order key is 0, below every logit) and `ms_out` (`[rows, nb, 2]`: max, sum of
/// `exp(x - max)`). `ids` and `ms_in` are unused.
///
/// Merge pass (grid `(1, rows)`): `vals` / `ids` = the part pass's candidates, `ms_in` its
/// partials; writes `val_out` = log-probs `min(x - lse, 0)` and `tok_out` = tokens
/// (`[rows, k]`, best first), and `ms_out` = the per-row log-sum-exp. Needs
/// `1 <= k <= min(MAX_K, vocab)`.
#[kernel(block = p.block, space = [TreeTopkParams::PART, TreeTopkParams::MERGE])]
pub fn tree_topk(
    #[comptime] p: &TreeTopkParams,
    vals: &[f32],
    ids: &[u32],
    ms_in: &[f32],
    val_out: &mut [f32],
    tok_out: &mut [u32],
    ms_out: &mut [f32],
    vocab: u32,
    k: u32,
    span: u32,
    nb: u32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32, at most 1024"
    );
    comptime_assert!(p.span % p.block == 0 || p.merge, "span must be a multiple of block");
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let blk = block_idx_x();
    let row = block_idx_y();
    let sk = shared::<u32>(p.span);
    let red_m = shared::<f32>(32);
    let red_s = shared::<f32>(32);
    let hist = shared::<u32>(256);
    let ckey = shared::<u32>(1024);
    let cidx = shared::<u32>(1024);
    let st = shared::<u32>(4);
    let lse_s = shared::<f32>(1);
    // Items: the slice's logits (part) or the row's candidates (merge), in token-id order
    // among equal keys.
    let lo = blk * span;
    let n = if p.merge { nb * k } else { span.min(vocab - lo) };
    let cbase = row * nb * k;
    let kk = k.min(n);

    if p.merge {
        if tid == 0 {
            let mut bm = f32::NEG_INFINITY;
            for j in 0..nb {
                bm = bm.max(ms_in[(cbase / k + j) * 2]);
            }
            let mut bs = 0.0f32;
            for j in 0..nb {
                let mj = ms_in[(cbase / k + j) * 2];
                if mj != f32::NEG_INFINITY {
                    bs += ms_in[(cbase / k + j) * 2 + 1] * (mj - bm).exp();
                }
            }
            let l = bm + bs.ln();
            lse_s[0] = l;
            ms_out[row] = l;
        }
    } else {
        // One read of the slice: order keys to shared memory, online max / sum.
        let mut m = f32::NEG_INFINITY;
        let mut s = 0.0f32;
        #[unroll]
        for j in 0..p.span / p.block {
            let i = j * p.block + tid;
            if i < n {
                let x = vals[row * vocab + lo + i];
                sk[i] = order_key(x);
                if x > m {
                    s = s * (m - x).exp() + 1.0f32;
                    m = x;
                } else if x != f32::NEG_INFINITY {
                    s += (x - m).exp();
                }
            }
        }
        #[unroll]
        for o in 0..5u32 {
            let mo = shfl_xor(m, 16u32 >> o);
            let so = shfl_xor(s, 16u32 >> o);
            let mn = m.max(mo);
            if mn != f32::NEG_INFINITY {
                s = s * (m - mn).exp() + so * (mo - mn).exp();
            }
            m = mn;
        }
        if lane == 0 {
            red_m[warp] = m;
            red_s[warp] = s;
        }
        sync_threads();
        if tid == 0 {
            let mut bm = f32::NEG_INFINITY;
            for w in 0..p.block / 32 {
                bm = bm.max(red_m[w]);
            }
            let mut bs = 0.0f32;
            for w in 0..p.block / 32 {
                if red_m[w] != f32::NEG_INFINITY {
                    bs += red_s[w] * (red_m[w] - bm).exp();
                }
            }
            ms_out[(row * nb + blk) * 2] = bm;
            ms_out[(row * nb + blk) * 2 + 1] = bs;
        }
    }

    // Radix select of the kk-th largest key, 8 bits at a time from the top.
    let mut prefix = 0u32;
    let mut pmask = 0u32;
    let mut remaining = kk;
    let mut eq_count = 0u32;
    for pass in 0..4u32 {
        let shift = 24u32 - 8u32 * pass;
        if tid < 256 {
            hist[tid] = 0u32;
        }
        sync_threads();
        for i in (tid..n).step_by(p.block) {
            let key = if p.merge { order_key(vals[cbase + i]) } else { sk[i] };
            if (key & pmask) == prefix {
                hist.atomic_add((key >> shift) & 255u32, 1u32);
            }
        }
        sync_threads();
        if warp == 0 {
            let mut tot = 0u32;
            #[unroll]
            for bb in 0..8u32 {
                tot += hist[lane * 8 + bb];
            }
            // Inclusive suffix sum over lanes (lane 31 holds the highest digits).
            let mut sfx = tot;
            #[unroll]
            for o in 0..5u32 {
                let v = shfl_down(sfx, 1u32 << o);
                if lane + (1u32 << o) < 32 {
                    sfx += v;
                }
            }
            let above = sfx - tot;
            if above < remaining && remaining <= sfx {
                let mut c = above;
                let mut bb = 8u32;
                while bb > 0 {
                    bb -= 1;
                    let h = hist[lane * 8 + bb];
                    if c + h >= remaining {
                        st[0] = lane * 8 + bb;
                        st[1] = c;
                        st[2] = h;
                        bb = 0;
                    } else {
                        c += h;
                    }
                }
            }
        }
        sync_threads();
        prefix = prefix | (st[0] << shift);
        pmask = pmask | (255u32 << shift);
        remaining -= st[1];
        eq_count = st[2];
        sync_threads();
    }
    // prefix = the kk-th largest key; take every larger key and `remaining` equal keys (the
    // first ones in item order, i.e. the smallest token ids).
    if tid == 0 {
        st[3] = 0u32;
    }
    sync_threads();
    for i in (tid..n).step_by(p.block) {
        let key = if p.merge { order_key(vals[cbase + i]) } else { sk[i] };
        if key > prefix || (key == prefix && eq_count == remaining) {
            let slot = st.atomic_add(3, 1u32);
            ckey[slot] = key;
            cidx[slot] = i;
        }
    }
    if eq_count != remaining {
        // Rare: more equal keys than needed; take them in item order, one tile at a time.
        let wtot = shared::<u32>(32);
        let mut seen = 0u32;
        let mut t0 = 0u32;
        while t0 < n && seen < remaining {
            let i = t0 + tid;
            let mut f = 0u32;
            if i < n {
                let key = if p.merge { order_key(vals[cbase + i]) } else { sk[i] };
                if key == prefix {
                    f = 1u32;
                }
            }
            let mut inc = f;
            #[unroll]
            for o in 0..5u32 {
                let v = shfl_up(inc, 1u32 << o);
                if lane >= (1u32 << o) {
                    inc += v;
                }
            }
            if lane == 31 {
                wtot[warp] = inc;
            }
            sync_threads();
            let mut before = 0u32;
            let mut all = 0u32;
            for w in 0..p.block / 32 {
                let c = wtot[w];
                if w < warp {
                    before += c;
                }
                all += c;
            }
            let rank = seen + before + inc - f;
            if f == 1 && rank < remaining {
                let slot = st.atomic_add(3, 1u32);
                ckey[slot] = prefix;
                cidx[slot] = i;
            }
            seen += all;
            t0 += p.block;
            sync_threads();
        }
    }
    sync_threads();
    // Rank the kk selected items by counting (larger key, then earlier item) and write them
    // best first.
    for t in (tid..kk).step_by(p.block) {
        let key = ckey[t];
        let idx = cidx[t];
        let mut rank = 0u32;
        for j in 0..kk {
            let kj = ckey[j];
            if kj > key || (kj == key && cidx[j] < idx) {
                rank += 1;
            }
        }
        if p.merge {
            val_out[row * k + rank] = (key_value(key) - lse_s[0]).min(0.0f32);
            tok_out[row * k + rank] = ids[cbase + idx];
        } else {
            val_out[(row * nb + blk) * k + rank] = key_value(key);
            tok_out[(row * nb + blk) * k + rank] = lo + idx;
        }
    }
    if !p.merge {
        for t in (kk + tid..k).step_by(p.block) {
            val_out[(row * nb + blk) * k + t] = key_value(0u32);
            tok_out[(row * nb + blk) * k + t] = 0u32;
        }
    }
}

/// The index of the single set bit of `pow2` (exact: powers of two convert to f32 exactly).
#[device_fn]
fn bit_index(pow2: u32) -> u32 {
    ((pow2 as f32).to_bits() >> 23) - 127u32
}

/// Node metadata word: parent (11 bits), rank among its siblings (11 bits), depth (from bit 22).
#[device_fn]
fn meta_word(parent: u32, rank: u32, depth: u32) -> u32 {
    parent | (rank << 11) | (depth << 22)
}

/// Whether the frontier entry "child `r1` of node `p1`" has a lexicographically smaller rank
/// tuple than "child `r2` of node `p2`" (distinct entries), walking the nodes' [`meta_word`]s.
#[device_fn]
fn entry_less(meta: &[u32], p1: u32, r1: u32, p2: u32, r2: u32) -> bool {
    let d1 = (meta[p1] >> 22) + 1;
    let d2 = (meta[p2] >> 22) + 1;
    let mut a = p1;
    let mut ra = r1;
    let mut da = d1;
    let mut b = p2;
    let mut rb = r2;
    let mut db = d2;
    // Lift the deeper entry to the other's depth: "child ra of a" becomes a itself.
    while da > db {
        ra = (meta[a] >> 11) & 2047u32;
        a = meta[a] & 2047u32;
        da -= 1;
    }
    while db > da {
        rb = (meta[b] >> 11) & 2047u32;
        b = meta[b] & 2047u32;
        db -= 1;
    }
    let mut res = d1 < d2;
    if a != b || ra != rb {
        // Walk up to the common parent; the ranks below it decide.
        while a != b {
            ra = (meta[a] >> 11) & 2047u32;
            a = meta[a] & 2047u32;
            rb = (meta[b] >> 11) & 2047u32;
            b = meta[b] & 2047u32;
        }
        res = ra < rb;
    }
    res
}

/// Log-probs per depth kept in shared memory by [`TreeExpand`] when `depth * k` fits.
const LP_SHARED: u32 = 6144;

/// Best-first expansion (grid = 1) over `lp` / `tok` (`[depth, k]`, best first) to at most
/// `budget` nodes besides the root `root[0]`. Writes the tree arrays (capacity `budget + 1`),
/// the node count to `n_out[0]` and the mask rows (`[n, ceil(n / 32)]`); `meta` (capacity
/// `budget + 1`) is scratch. Needs `budget <= 1024`, `depth <= 16`.
#[kernel(block = 256)]
pub fn tree_expand(
    lp: &[f32],
    tok: &[u32],
    root: &[u32],
    token: &mut [u32],
    parent: &mut [i32],
    depth_out: &mut [u32],
    first_child: &mut [i32],
    next_sibling: &mut [i32],
    path_lp: &mut [f32],
    n_out: &mut [u32],
    mask: &mut [u32],
    meta: &mut [u32],
    depth: u32,
    k: u32,
    budget: u32,
) {
    let s_lp = shared::<f32>(LP_SHARED);
    // Per node: meta word, path score, frontier entry (score of its next child, that child's
    // rank or `none`), and its last emitted child.
    let n_meta = shared::<u32>(1025);
    let n_score = shared::<f32>(1025);
    let f_score = shared::<f32>(1025);
    let f_rank = shared::<u32>(1025);
    let f_last = shared::<u32>(1025);
    let n_sh = shared::<u32>(1);
    let tid = thread_idx_x();
    let lane = lane_id();
    let none = u32::MAX;
    let in_shared = depth * k <= LP_SHARED;
    if in_shared {
        for i in (tid..depth * k).step_by(256) {
            s_lp[i] = lp[i];
        }
    }
    for i in (tid..budget + 1).step_by(256) {
        first_child[i] = -1;
        next_sibling[i] = -1;
    }
    sync_threads();
    if warp_id() == 0 {
        if lane == 0 {
            n_meta[0] = 0u32;
            meta[0] = 0u32;
            n_score[0] = 0.0f32;
            f_rank[0] = if depth > 0 && budget > 0 { 0u32 } else { none };
            f_score[0] = if in_shared { s_lp[0] } else { lp[0] };
        }
        sync_warp();
        // Lane i caches the best entry among nodes i, i + 32, ...: node `best`, its next child's
        // rank `brank` and order key `bkey` (0 = none: every score's order key is larger). Only
        // these registers are read at a pop, so lane 0's shared writes never race a read.
        let mut best = 0u32;
        let mut brank = 0u32;
        let mut bkey = 0u32;
        if lane == 0 && f_rank[0] != none {
            bkey = order_key(f_score[0]);
        }
        let mut n = 1u32;
        while n <= budget {
            let mut mx = bkey;
            #[unroll]
            for o in 0..5u32 {
                mx = mx.max(shfl_xor(mx, 16u32 >> o));
            }
            if mx == 0u32 {
                break;
            }
            let ties = ballot(bkey == mx);
            let low = ties & (0u32 - ties);
            let mut wl = bit_index(low);
            let mut pw = shfl_idx(best, wl);
            let mut r = shfl_idx(brank, wl);
            if ties != low {
                // Equal scores: the smallest rank tuple among the tied lanes.
                let mut rest = ties ^ low;
                while rest != 0u32 {
                    let lb = rest & (0u32 - rest);
                    rest = rest ^ lb;
                    let l2 = bit_index(lb);
                    let p2 = shfl_idx(best, l2);
                    let r2 = shfl_idx(brank, l2);
                    if entry_less(meta, p2, r2, pw, r) {
                        wl = l2;
                        pw = p2;
                        r = r2;
                    }
                }
            }
            sync_warp();
            if lane == 0 {
                let sc = key_value(mx);
                let d = (n_meta[pw] >> 22) + 1;
                let mw = meta_word(pw, r, d);
                n_meta[n] = mw;
                meta[n] = mw;
                n_score[n] = sc;
                if r == 0u32 {
                    first_child[pw] = n as i32;
                } else {
                    next_sibling[f_last[pw]] = n as i32;
                }
                f_last[pw] = n;
                if r + 1 < k {
                    f_rank[pw] = r + 1;
                    f_score[pw] = n_score[pw]
                        + if in_shared {
                            s_lp[(d - 1) * k + r + 1]
                        } else {
                            lp[(d - 1) * k + r + 1]
                        };
                } else {
                    f_rank[pw] = none;
                }
                if d < depth {
                    f_rank[n] = 0u32;
                    f_score[n] = sc + if in_shared { s_lp[d * k] } else { lp[d * k] };
                } else {
                    f_rank[n] = none;
                }
            }
            sync_warp();
            // Refresh the cached bests of the popped entry's lane and the new node's lane.
            if lane == wl {
                bkey = 0u32;
                for sl in (lane..n + 1).step_by(32) {
                    if f_rank[sl] != none {
                        let key = order_key(f_score[sl]);
                        if key > bkey || (key == bkey && entry_less(meta, sl, f_rank[sl], best, brank)) {
                            best = sl;
                            brank = f_rank[sl];
                            bkey = key;
                        }
                    }
                }
            } else if lane == n % 32 && f_rank[n] != none {
                let key = order_key(f_score[n]);
                if key > bkey || (key == bkey && entry_less(meta, n, 0u32, best, brank)) {
                    best = n;
                    brank = 0u32;
                    bkey = key;
                }
            }
            n += 1;
            sync_warp();
        }
        if lane == 0 {
            n_sh[0] = n;
            n_out[0] = n;
        }
    }
    sync_threads();
    let n = n_sh[0];
    let words = (n + 31) / 32;
    for i in (tid..n).step_by(256) {
        let mw = n_meta[i];
        let d = mw >> 22;
        token[i] = if i == 0 {
            root[0]
        } else {
            tok[(d - 1) * k + ((mw >> 11) & 2047u32)]
        };
        parent[i] = if i == 0 { -1 } else { (mw & 2047u32) as i32 };
        depth_out[i] = d;
        path_lp[i] = n_score[i];
        // Mask row: ancestors have decreasing indices, so the words fill from the top down.
        for w in i / 32 + 1..words {
            mask[i * words + w] = 0u32;
        }
        let mut cw = i / 32;
        let mut bits = 0u32;
        let mut a = i;
        let mut walking = true;
        while walking {
            while a / 32 < cw {
                mask[i * words + cw] = bits;
                bits = 0u32;
                cw -= 1;
            }
            bits = bits | (1u32 << (a % 32));
            if a == 0 {
                walking = false;
            } else {
                a = n_meta[a] & 2047u32;
            }
        }
        mask[i * words] = bits;
    }
}
