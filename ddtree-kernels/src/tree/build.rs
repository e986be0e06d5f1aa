//! The GPU tree builder, three launches with no host copy:
//!
//! 1. [`TreeTopk`] (grid = L, one block per depth): log-sum-exp of the row (online max/sum),
//!    then an exact radix select of the `k` largest logits (8-bit digits over the order key,
//!    ties at the threshold by smaller token id), then each candidate's rank by counting.
//! 2. [`TreeExpand`] (one warp): DDTree's best-first expansion. The frontier lives in shared
//!    memory; each lane caches the best entry among its slots, a pop is a 5-step shuffle
//!    argmax, and only the lanes whose slots changed rescan. Exact tie rule of
//!    [`super::reference`] (rank tuples compared through `tuples`, packed 16 bits per rank).
//! 3. [`TreeMask`] (one thread per node): the ancestor-or-self bitmask rows.

use ddtree_macros::{device_fn, kernel, KernelParams};

/// Compile-time parameters of [`TreeTopk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct TreeTopkParams {
    /// Threads per block; also the largest `k`.
    pub block: u32,
}

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

/// Per depth `row` (grid = rows): writes `lse[row]`, and the top `k` tokens of the row, best
/// first, to `tok[row * k ..]` with their log-probs `min(x - lse, 0)` to `lp`. Needs
/// `1 <= k <= min(block, vocab)`.
#[kernel(block = p.block, space = [TreeTopkParams { block: 1024 }, TreeTopkParams { block: 512 }])]
pub fn tree_topk(
    #[comptime] p: &TreeTopkParams,
    logits: &[f32],
    lse: &mut [f32],
    lp: &mut [f32],
    tok: &mut [u32],
    vocab: u32,
    k: u32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block <= 1024,
        "block must be a multiple of 32, at most 1024"
    );
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let row = block_idx_x();
    let base = row * vocab;
    let red_m = shared::<f32>(32);
    let red_s = shared::<f32>(32);
    let hist = shared::<u32>(256);
    let ckey = shared::<u32>(p.block);
    let cidx = shared::<u32>(p.block);
    let st = shared::<u32>(4);

    // Log-sum-exp: per-thread online max/sum, then a fixed-order combine.
    let mut m = f32::NEG_INFINITY;
    let mut s = 0.0f32;
    for i in (tid..vocab).step_by(p.block) {
        let x = logits[base + i];
        if x > m {
            s = s * (m - x).exp() + 1.0f32;
            m = x;
        } else if x != f32::NEG_INFINITY {
            s += (x - m).exp();
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
    let row_lse = bm + bs.ln();

    // Radix select of the k-th largest key, 8 bits at a time from the top.
    let mut prefix = 0u32;
    let mut pmask = 0u32;
    let mut remaining = k;
    let mut eq_count = 0u32;
    for pass in 0..4u32 {
        let shift = 24u32 - 8u32 * pass;
        if tid < 256 {
            hist[tid] = 0u32;
        }
        sync_threads();
        for i in (tid..vocab).step_by(p.block) {
            let key = order_key(logits[base + i]);
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
    // prefix = the k-th largest key; take every larger key and `remaining` equal keys (the
    // smallest ids among them).
    if tid == 0 {
        st[3] = 0u32;
    }
    sync_threads();
    for i in (tid..vocab).step_by(p.block) {
        let key = order_key(logits[base + i]);
        if key > prefix || (key == prefix && eq_count == remaining) {
            let slot = st.atomic_add(3, 1u32);
            ckey[slot] = key;
            cidx[slot] = i;
        }
    }
    if eq_count != remaining {
        // Rare: more equal keys than needed; take them in id order, one tile of ids at a time.
        let wtot = shared::<u32>(32);
        let mut seen = 0u32;
        let mut t0 = 0u32;
        while t0 < vocab && seen < remaining {
            let i = t0 + tid;
            let f = if i < vocab {
                if order_key(logits[base + i]) == prefix {
                    1u32
                } else {
                    0u32
                }
            } else {
                0u32
            };
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
    if tid < k {
        let key = ckey[tid];
        let idx = cidx[tid];
        let mut rank = 0u32;
        for j in 0..k {
            let kj = ckey[j];
            if kj > key || (kj == key && cidx[j] < idx) {
                rank += 1;
            }
        }
        lp[row * k + rank] = (logits[base + idx] - row_lse).min(0.0f32);
        tok[row * k + rank] = idx;
    }
    if tid == 0 {
        lse[row] = row_lse;
    }
}

/// Word `w` of an entry's rank tuple: its parent's words plus rank `r + 1` at depth `d`
/// (16 bits per depth, the earlier depth in the high half).
#[device_fn]
fn tuple_word(tuples: &[u32], parent: u32, d: u32, r: u32, w: u32) -> u32 {
    let mut v = tuples[parent * 8 + w];
    if (d - 1) / 2 == w {
        v = v | ((r + 1) << (16 * (1 - (d - 1) % 2)));
    }
    v
}

/// Whether entry 1 (parent, depth, rank) has a lexicographically smaller rank tuple than
/// entry 2.
#[device_fn]
fn tuple_less(tuples: &[u32], p1: u32, d1: u32, r1: u32, p2: u32, d2: u32, r2: u32) -> bool {
    let mut res = false;
    let mut done = false;
    for w in 0..8u32 {
        if !done {
            let a = tuple_word(tuples, p1, d1, r1, w);
            let b = tuple_word(tuples, p2, d2, r2, w);
            if a != b {
                res = a < b;
                done = true;
            }
        }
    }
    res
}

/// Best-first expansion (one warp, grid = 1) over `lp` / `tok` (`[depth, k]`) to at most
/// `budget` nodes besides the root `root[0]`. Writes the tree arrays (capacity `budget + 1`),
/// the node count to `n_out[0]`, and uses `tuples` (`[budget + 1, 8]`) as scratch. Needs
/// `budget <= 1024`, `depth <= 16`.
#[kernel(block = 32)]
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
    tuples: &mut [u32],
    depth: u32,
    k: u32,
    budget: u32,
) {
    let f_score = shared::<f32>(1025);
    let f_parent = shared::<u32>(1025);
    let f_dr = shared::<u32>(1025);
    let f_prev = shared::<i32>(1025);
    let n_score = shared::<f32>(1025);
    let lane = lane_id();
    let none = u32::MAX;
    if lane == 0 {
        token[0] = root[0];
        parent[0] = -1;
        depth_out[0] = 0u32;
        first_child[0] = -1;
        next_sibling[0] = -1;
        path_lp[0] = 0.0f32;
        n_score[0] = 0.0f32;
        f_score[0] = lp[0];
        f_parent[0] = 0u32;
        f_dr[0] = (1u32 << 16) | 0u32;
        f_prev[0] = -1;
    }
    if lane < 8 {
        tuples[lane] = 0u32;
    }
    sync_warp();
    let mut nslots = 1u32;
    let mut best = if lane == 0 && depth > 0 && budget > 0 {
        0u32
    } else {
        none
    };
    let mut n = 1u32;
    while n <= budget {
        // Warp argmax over the lanes' cached bests (higher score, then smaller rank tuple).
        let mut bs = best;
        let mut bsc = if bs != none { f_score[bs] } else { f32::NEG_INFINITY };
        #[unroll]
        for o in 0..5u32 {
            let os = shfl_xor(bs, 16u32 >> o);
            let osc = shfl_xor(bsc, 16u32 >> o);
            let mut take = false;
            if os != none {
                if bs == none || osc > bsc {
                    take = true;
                } else if osc == bsc {
                    take = tuple_less(
                        tuples,
                        f_parent[os],
                        f_dr[os] >> 16,
                        f_dr[os] & 65535u32,
                        f_parent[bs],
                        f_dr[bs] >> 16,
                        f_dr[bs] & 65535u32,
                    );
                }
            }
            if take {
                bs = os;
                bsc = osc;
            }
        }
        if bs == none {
            break;
        }
        let par = f_parent[bs];
        let d = f_dr[bs] >> 16;
        let r = f_dr[bs] & 65535u32;
        let prev = f_prev[bs];
        let has_sib = r + 1 < k;
        let has_child = d < depth;
        let appended = has_sib && has_child;
        sync_warp();
        if lane == 0 {
            token[n] = tok[(d - 1) * k + r];
            parent[n] = par as i32;
            depth_out[n] = d;
            first_child[n] = -1;
            next_sibling[n] = -1;
            path_lp[n] = bsc;
            n_score[n] = bsc;
            if prev >= 0 {
                next_sibling[prev as u32] = n as i32;
            } else {
                first_child[par] = n as i32;
            }
            #[unroll]
            for w in 0..8u32 {
                tuples[n * 8 + w] = tuple_word(tuples, par, d, r, w);
            }
            // The child takes the popped slot; the sibling takes it or a new slot.
            let mut slot = bs;
            if has_child {
                f_score[slot] = bsc + lp[d * k];
                f_parent[slot] = n;
                f_dr[slot] = ((d + 1) << 16) | 0u32;
                f_prev[slot] = -1;
                slot = nslots;
            }
            if has_sib {
                f_score[slot] = n_score[par] + lp[(d - 1) * k + r + 1];
                f_parent[slot] = par;
                f_dr[slot] = (d << 16) | (r + 1);
                f_prev[slot] = n as i32;
            }
            if !has_child && !has_sib {
                f_dr[slot] = 0u32;
            }
        }
        if appended {
            nslots += 1;
        }
        sync_warp();
        // Refresh the cached bests of the lanes whose slots changed.
        if lane == bs % 32 {
            best = none;
            for sl in (lane..nslots).step_by(32) {
                if f_dr[sl] != 0u32 {
                    if best == none || f_score[sl] > f_score[best] {
                        best = sl;
                    } else if f_score[sl] == f_score[best] {
                        if tuple_less(
                            tuples,
                            f_parent[sl],
                            f_dr[sl] >> 16,
                            f_dr[sl] & 65535u32,
                            f_parent[best],
                            f_dr[best] >> 16,
                            f_dr[best] & 65535u32,
                        ) {
                            best = sl;
                        }
                    }
                }
            }
        } else if appended && lane == (nslots - 1) % 32 {
            let sl = nslots - 1;
            if best == none || f_score[sl] > f_score[best] {
                best = sl;
            } else if f_score[sl] == f_score[best] {
                if tuple_less(
                    tuples,
                    f_parent[sl],
                    f_dr[sl] >> 16,
                    f_dr[sl] & 65535u32,
                    f_parent[best],
                    f_dr[best] >> 16,
                    f_dr[best] & 65535u32,
                ) {
                    best = sl;
                }
            }
        }
        n += 1;
        sync_warp();
    }
    if lane == 0 {
        n_out[0] = n;
    }
}

/// Ancestor-or-self mask rows (`[n, ceil(n / 32)]`, n = `n_out[0]`), one thread per node;
/// grid = `ceil((budget + 1) / 128)`.
#[kernel(block = 128)]
pub fn tree_mask(parent: &[i32], n_out: &[u32], mask: &mut [u32]) {
    let i = block_idx_x() * 128 + thread_idx_x();
    let n = n_out[0];
    if i < n {
        let words = (n + 31) / 32;
        for w in 0..words {
            mask[i * words + w] = 0u32;
        }
        let mut a = i as i32;
        while a >= 0 {
            let au = a as u32;
            mask[i * words + au / 32] = mask[i * words + au / 32] | (1u32 << (au % 32));
            a = parent[au];
        }
    }
}
