//! The GPU tree builder: one launch, no host copy.
//!
//! [`TreeBuild`] runs on a grid of `(nb, L)` blocks and chains three stages with the
//! "last block" pattern (write, [`thread_fence`], count on an atomic counter; the block that
//! brings a counter to its end carries on, and resets the counter for the next launch):
//!
//! 1. **Slice** (every block): block `b` of depth `row` reads logits `[b * span, (b + 1) *
//!    span)` of its row once for the slice's max and sum of exponentials, and selects the
//!    slice's top `min(k, slice)` by radix select over order keys (8-bit digits from the top,
//!    stopping as soon as the digit bucket of the k-th key is taken whole; equal keys by smaller
//!    token id). The selected keys and tokens go to the candidate buffers in token order.
//! 2. **Merge** (the last block of each depth): the row's log-sum-exp from the partials (one
//!    warp), the same radix select over the `nb * k` candidates, and the `k` winners ranked
//!    (larger key, then smaller token) into the depth's log-probs `min(x - lse, 0)` and tokens.
//! 3. **Expand** (the last merging block): DDTree's best-first expansion by warp 0, then the
//!    tree arrays and the ancestor-or-self mask rows by all threads. The frontier holds one
//!    entry per emitted node (its next child: every node's children are a sorted stream), owned
//!    by lane `node % 32`, which caches the best of its entries; a pop is a 5-step shuffle max
//!    of the lanes' order keys (equal scores: the exact rank-tuple rule of
//!    [`super::reference`], found by walking the two paths), after which only the popped
//!    stream's lane rescans its entries and the new node's lane compares one entry.

use ddtree_macros::{device_fn, kernel, KernelParams};

/// Compile-time parameters of [`TreeBuild`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, KernelParams)]
pub struct TreeBuildParams {
    /// Threads per block.
    pub block: u32,
    /// The most logits per slice block.
    pub span: u32,
}

/// The largest `k` (= min(budget, vocab)) and budget of the builder.
pub const MAX_K: usize = 1024;

/// Nodes (root included) the expansion's shared state holds.
const CAP: u32 = 1025;

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

/// Exclusive prefix sum of `v` over the block (all threads must call it).
#[device_fn]
fn block_excl_scan(v: u32) -> u32 {
    let ws = shared::<u32>(32);
    let lane = lane_id();
    let warp = warp_id();
    let mut inc = v;
    #[unroll]
    for o in 0..5u32 {
        let t = shfl_up(inc, 1u32 << o);
        if lane >= (1u32 << o) {
            inc += t;
        }
    }
    sync_threads();
    if lane == 31 {
        ws[warp] = inc;
    }
    sync_threads();
    let mut before = 0u32;
    for w in 0..warp {
        before += ws[w];
    }
    inc - v + before
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

/// The whole builder in one launch (see the module docs). Grid `(nb, depth)`; block `b`
/// covers logits `[b * span, min((b + 1) * span, vocab))` of its row (`span <= p.span`).
///
/// Inputs: `logits` `[depth, vocab]`, `root[0]` (the root token). Scratch: `cand_key` /
/// `cand_tok` (`[depth, nb, k]`), `part_ms` (`[depth, nb, 2]`), `counters` (`depth + 1`
/// zeros; left zero), `meta` (`budget + 1`). Outputs: `lp` / `tok` (`[depth, k]`, best first),
/// `lse` (`[depth]`), the tree arrays (capacity `budget + 1`), the node count `n_out[0]` and the
/// mask rows (`[n, ceil(n / 32)]`). Needs `1 <= k = min(budget, vocab) <= MAX_K`,
/// `budget <= MAX_K`, `depth <= 16`, `nb * k < 65536`.
#[kernel(block = p.block, space = [
    TreeBuildParams { block: 512, span: 4096 },
    TreeBuildParams { block: 1024, span: 8192 },
    TreeBuildParams { block: 256, span: 2048 },
])]
pub fn tree_build(
    #[comptime] p: &TreeBuildParams,
    logits: &[f32],
    root: &[u32],
    cand_key: &mut [u32],
    cand_tok: &mut [u32],
    part_ms: &mut [f32],
    lp: &mut [f32],
    tok: &mut [u32],
    lse: &mut [f32],
    counters: &mut [u32],
    token: &mut [u32],
    parent: &mut [i32],
    depth_out: &mut [u32],
    first_child: &mut [i32],
    next_sibling: &mut [i32],
    path_lp: &mut [f32],
    n_out: &mut [u32],
    mask: &mut [u32],
    meta: &mut [u32],
    vocab: u32,
    k: u32,
    span: u32,
    depth: u32,
    budget: u32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block >= 256 && p.block <= 1024,
        "block must be a multiple of 32 in 256..=1024"
    );
    comptime_assert!(p.span < 65536, "span must be below 65536");
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let blk = block_idx_x();
    let row = block_idx_y();
    let nb = grid_dim_x();
    let red_m = shared::<f32>(32);
    let red_s = shared::<f32>(32);
    let hist = shared::<u32>(256);
    let st = shared::<u32>(4);
    let flag = shared::<u32>(1);
    let lse_s = shared::<f32>(1);
    let ckey = shared::<u32>(1024);
    let ctok = shared::<u32>(1024);
    let lo = blk * span;

    // Stage 0: the block's slice; stage 1 (the row's last block): the row's candidates.
    for stage in 0..2u32 {
        let merging = stage == 1u32;
        let n = if merging { nb * k } else { span.min(vocab - lo) };
        let base = if merging { row * nb * k } else { row * vocab + lo };
        let kk = k.min(n);
        if merging {
            // The row's log-sum-exp from the slices' (max, sum of exp(x - max)), one warp.
            if warp == 0 {
                let mut m = f32::NEG_INFINITY;
                let mut s = 0.0f32;
                for j in (lane..nb).step_by(32) {
                    let mo = part_ms[(row * nb + j) * 2];
                    let so = part_ms[(row * nb + j) * 2 + 1];
                    let mn = m.max(mo);
                    if mn != f32::NEG_INFINITY {
                        s = s * (m - mn).exp() + so * (mo - mn).exp();
                    }
                    m = mn;
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
                    let l = m + s.ln();
                    lse_s[0] = l;
                    lse[row] = l;
                }
            }
        } else {
            // One read of the slice: online max / sum.
            let mut m = f32::NEG_INFINITY;
            let mut s = 0.0f32;
            for i in (tid..n).step_by(p.block) {
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
                part_ms[(row * nb + blk) * 2] = bm;
                part_ms[(row * nb + blk) * 2 + 1] = bs;
            }
        }

        // Radix select of the kk-th largest key, 8 bits at a time from the top, until the
        // bucket holding it is taken whole.
        let mut prefix = 0u32;
        let mut pmask = 0u32;
        let mut remaining = kk;
        let mut eq_count = 0u32;
        let mut pass = 0u32;
        while pass < 4u32 && eq_count != remaining {
            let shift = 24u32 - 8u32 * pass;
            if tid < 256 {
                hist[tid] = 0u32;
            }
            sync_threads();
            for i in (tid..n).step_by(p.block) {
                let key = if merging {
                    cand_key[base + i]
                } else {
                    order_key(logits[base + i])
                };
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
            pass += 1;
        }
        // Take every key above the prefix, the prefix's bucket when it is taken whole, else the
        // first `remaining` keys equal to the kk-th (smallest token ids); in item order (each
        // thread a contiguous run, positions from a block scan).
        let all_eq = eq_count == remaining;
        let c = (n + p.block - 1) / p.block;
        let i0 = (tid * c).min(n);
        let i1 = (i0 + c).min(n);
        let mut cnt = 0u32;
        let mut eqc = 0u32;
        for i in i0..i1 {
            let key = if merging {
                cand_key[base + i]
            } else {
                order_key(logits[base + i])
            };
            let m = key & pmask;
            if m > prefix || (m == prefix && all_eq) {
                cnt += 1;
            } else if m == prefix {
                eqc += 1;
            }
        }
        let pre = block_excl_scan(cnt | (eqc << 16));
        let mut sp = pre & 65535u32;
        let mut ep = pre >> 16;
        let out = (row * nb + blk) * k;
        for i in i0..i1 {
            let key = if merging {
                cand_key[base + i]
            } else {
                order_key(logits[base + i])
            };
            let m = key & pmask;
            let strict = m > prefix || (m == prefix && all_eq);
            let tie = !strict && m == prefix;
            if strict || (tie && ep < remaining) {
                let pos = sp + ep.min(remaining);
                if merging {
                    ckey[pos] = key;
                    ctok[pos] = cand_tok[base + i];
                } else {
                    cand_key[out + pos] = key;
                    cand_tok[out + pos] = lo + i;
                }
            }
            if strict {
                sp += 1;
            } else if tie {
                ep += 1;
            }
        }
        if merging {
            // Rank the k winners (larger key, then earlier item = smaller token), best first.
            sync_threads();
            for t in (tid..k).step_by(p.block) {
                let key = ckey[t];
                let mut rank = 0u32;
                for j in 0..k {
                    let kj = ckey[j];
                    if kj > key || (kj == key && j < t) {
                        rank += 1;
                    }
                }
                lp[row * k + rank] = (key_value(key) - lse_s[0]).min(0.0f32);
                tok[row * k + rank] = ctok[t];
            }
        } else {
            // Unused slots: key 0, below every logit's key.
            for t in (kk + tid..k).step_by(p.block) {
                cand_key[out + t] = 0u32;
                cand_tok[out + t] = 0u32;
            }
        }
        // Publish, then count: the block that completes the row (stage 0) or the depths
        // (stage 1) goes on.
        thread_fence();
        sync_threads();
        if tid == 0 {
            let ci = if merging { depth } else { row };
            let total = if merging { depth } else { nb };
            let old = counters.atomic_add(ci, 1u32);
            let last = old + 1 == total;
            if last {
                counters.atomic_exch(ci, 0u32);
            }
            flag[0] = if last { 1u32 } else { 0u32 };
        }
        sync_threads();
        if flag[0] == 0u32 {
            return;
        }
    }

    // Stage 2: the expansion. Per node: meta word, path score; per node's child stream (owned
    // by lane node % 32): the order key of its next child's score (0 = none), that child's rank,
    // and the last emitted child.
    let n_meta = shared::<u32>(CAP);
    let n_score = shared::<f32>(CAP);
    let f_key = shared::<u32>(CAP);
    let f_rank = shared::<u32>(CAP);
    let f_last = shared::<u32>(CAP);
    let n_sh = shared::<u32>(1);
    for i in (tid..budget + 1).step_by(p.block) {
        first_child[i] = -1;
        next_sibling[i] = -1;
    }
    sync_threads();
    if warp == 0 {
        if lane == 0 {
            n_meta[0] = 0u32;
            meta[0] = 0u32;
            n_score[0] = 0.0f32;
            f_rank[0] = 0u32;
            f_key[0] = if depth > 0 && budget > 0 {
                order_key(lp[0])
            } else {
                0u32
            };
        }
        sync_warp();
        // Lane i caches the best entry among streams i, i + 32, ...: node `best`, its next
        // child's rank `brank` and order key `bkey` (0 = none: every score's key is larger).
        let mut best = 0u32;
        let mut brank = 0u32;
        let mut bkey = 0u32;
        if lane == 0 {
            bkey = f_key[0];
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
            let d = (n_meta[pw] >> 22) + 1;
            let sc = key_value(mx);
            let nl = n % 32;
            if lane == nl {
                let mw = meta_word(pw, r, d);
                n_meta[n] = mw;
                meta[n] = mw;
                n_score[n] = sc;
                f_rank[n] = 0u32;
                f_key[n] = if d < depth { order_key(sc + lp[d * k]) } else { 0u32 };
            }
            if lane == wl {
                // The popped stream (this lane's): link the node, advance, rescan.
                if r == 0u32 {
                    first_child[pw] = n as i32;
                } else {
                    next_sibling[f_last[pw]] = n as i32;
                }
                f_last[pw] = n;
                f_rank[pw] = r + 1;
                f_key[pw] = if r + 1 < k {
                    order_key(n_score[pw] + lp[(d - 1) * k + r + 1])
                } else {
                    0u32
                };
                bkey = 0u32;
                for sl in (lane..n + 1).step_by(32) {
                    let key = f_key[sl];
                    if key > bkey || (key == bkey && key != 0u32 && entry_less(meta, sl, f_rank[sl], best, brank)) {
                        best = sl;
                        brank = f_rank[sl];
                        bkey = key;
                    }
                }
            } else if lane == nl {
                let key = f_key[n];
                if key > bkey || (key == bkey && key != 0u32 && entry_less(meta, n, 0u32, best, brank)) {
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
    for i in (tid..n).step_by(p.block) {
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
