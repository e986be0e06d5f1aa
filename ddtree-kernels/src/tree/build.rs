//! The GPU tree builder: one launch, no host copy.
//!
//! [`TreeBuild`] runs on a grid of `(nb, L)` blocks and chains three stages with the
//! "last block" pattern (write, [`thread_fence`], count on an atomic counter; the block that
//! brings a counter to its end carries on, and resets the counter for the next launch):
//!
//! 1. **Slice** (every block): block `b` of depth `row` reads logits `[b * span, (b + 1) *
//!    span)` of its row once into registers (`vpt` per thread, coalesced, every load issued
//!    before any is used), takes the slice's max and sum of exponentials (the block's
//!    partials are reduced by the last warp after the floor's barrier) and selects the
//!    slice's top `min(k, slice)` above a **floor**, a key with at least that many keys at or
//!    above it: when `k <= 2 * warps`, the lowest of the warps' second-largest keys, else 0.
//!    With `ties > 0` only warps with items count, and past `k = 2 * warps` a slice takes
//!    the lowest of the warps' m-th largest of their lanes' second-largest keys
//!    (`m = ceil(k / (2 * warps)) <= 32`), a merge the least key.
//!    - **Direct select** (`direct > 0`, tried when `k <= 4 * warps` with items): each warp
//!      also keeps the four largest of its lanes' two largest keys (distinct items); a warp
//!      floor needing m <= 4 keys per warp is the m-th of this list (in a merge, with one
//!      slice's candidates to a warp and the slice written best first, that slice's m-th key),
//!      and the floor is raised by counting: the highest warp floor value with at
//!      least `k` of the warps' listed keys at or above it. The keys at or above the floor
//!      (about 70 of a 9216-logit slice at `k = 64`) and their items are staged in shared
//!      memory; when at most `direct` of them, they are ranked by counting (larger key, then
//!      smaller token; branch-free, adjacent lanes splitting each key's comparisons) and the
//!      first `k` written best first, with no radix pass.
//!    - Else (more keys above the floor, or `direct = 0`) **radix select** over the order
//!      keys at or above the floor: 8-bit digits from below the prefix shared by the top key
//!      and the floor, one block-wide histogram per digit (two barriers each), stopping as
//!      soon as the digit bucket of the k-th key is taken whole, or (`ties > 0`) holds at
//!      most `ties` keys, which are then staged and ranked exactly. The selected keys and
//!      tokens go to the candidate buffers (places from ballots and warp totals): in token
//!      order, or with an exactly ranked bucket, the keys above it in token order and then
//!      the bucket's best by rank.
//!
//!    Every way, equal keys stay in token order, which the merge relies on. With
//!    [`TreeBuildParams::sorted`] (at `k <= 64`) a slice writes its candidates best first
//!    either way (the radix select's winners are ranked as a merge ranks them).
//! 2. **Merge** (the last block of each depth): the row's log-sum-exp from the partials (the
//!    last warp), then the depth's best `k` as log-probs `min(x - lse, 0)` and tokens, best
//!    first:
//!    - **Sorted** (`sorted`, `k <= 64`, at most 64 slices): the slices' lists, best first,
//!      are merged as bitonic sequences in warps (a list of 64 to a warp, two entries to a
//!      lane, packed as `key << 32 | !token`): warp `w` merges lists `4 w .. 4 w + 3` in
//!      registers, then pairs of the warps' lists merge through shared memory (one barrier
//!      per round, three rounds at 18 slices, two at 16). No select, no ranking.
//!    - Else the same select over the `nb * k` candidates (at most `block * vpt`, one per
//!      register slot; equal keys by earlier candidate = smaller token), and the `k` winners
//!      ranked as the direct select ranks (by counting).
//! 3. **Expand** (the last merging block): DDTree's best-first expansion pops the tuples of
//!    ranks in the builder's order (higher path score, then the lexicographically smaller rank
//!    tuple), so its nodes are the best `budget` tuples of depth at most `L`, best first. The
//!    block finds them one depth per round: G (the best `budget` tuples of depth below d,
//!    sorted) and the children of its depth d - 1 members are ranked together, and the best
//!    `budget` are G for depth d. The best of depth <= d have their parents in G, and a child
//!    of rank r of the j-th depth d - 1 member of G (0-based) has at least (j + 1) (r + 1) - 1
//!    better tuples (the children of rank <= r of the depth d - 1 members before it, ranked by
//!    the same row of log-probs), so only children with (j + 1) (r + 1) <= budget (and, when
//!    G is full, better than its worst member) are candidates: at most
//!    [`expansion_candidates`] per round. Equal scores compare pre-order indices in G (a
//!    child of member p with rank r sits right after p).
//!    A round that adds no member of its depth ends the loop (later rounds could only expand
//!    members of that depth); one without candidates (a flag set while its depth d - 1
//!    members are counted) ends after that count's scan. Each round's log-probs are read one
//!    round ahead into registers; its rankings compare contiguous runs without branches.
//!    Then the tree arrays (child lists from per-parent counts), path scores and the
//!    ancestor-or-self mask rows.
//!
//! The space holds sorted variants of 9216-logit slices (18 per row at V = 163840) and of
//! 10240 to 10752 (16 per row: a round fewer in the merge, fewer blocks at L = 15), with 512,
//! 768 or 1024 threads; which is fastest depends on the depth and budget, so the engine takes
//! the variant tuned for its key ([`crate::tune::TreeBuildKey`]). The default, 768 threads of
//! 14 logits, was the fastest at L = 7 and budgets 16 and 64 on the H200 (BENCHMARKS.md,
//! twenty-ninth session). Two 512-thread variants come twice, with and without
//! `one_block`: `ptxas` otherwise keeps them under 64 registers so that two blocks share an
//! SM (spilling), which is faster where two slices per SM run at once (L = 15) and slower
//! elsewhere; the `one_block` twin of 512 x 28 is first for budgets over 256 (thirtieth
//! session: confident logits at B = 1024 915 -> 858 µs).
//!
//! Barriers on the critical path of a slice or a merge at random logits, `k = 64`, 1024
//! threads: with the direct select one for the floor, one for the counted floor, one for the
//! staged keys and two around the counter; with the radix select one for the floor, two per
//! histogram pass (with `ties = 0` typically two or three passes in a slice and three or four
//! in a merge; one pass with `ties = 32`), one for the warp totals, one before a merge's
//! ranking, two around the counter; a sorted merge has one after its in-register merges and
//! one per round through shared memory (three at 18 slices).

use ddtree_macros::kernel;

pub use super::build_params::{expansion_candidates, TreeBuildParams, MAX_K};
use super::build_params::{CAP, SHARED_CANDS};
use super::build_warp::{
    better, block_excl_scan, key_value, meta_word, run_len, split_shift, sum_exp_merge, warp_kth_largest,
    warp_merge_slot, warp_sum_exp,
};
use crate::common::{lanes_below_sum, order_key, warp_incl_scan, warp_max, warp_max_u32, warp_min_u32, warp_sum_u32};

/// The whole builder in one launch (see the module docs). Grid `(nb, depth)`; block `b`
/// covers logits `[b * span, min((b + 1) * span, vocab))` of its row (`span <= p.tile()`).
///
/// Inputs: `logits` `[depth, vocab]`, `root[0]` (the root token). Scratch: `cand_key` /
/// `cand_tok` (`[depth, nb, k]`, and at least [`expansion_candidates`] (the expansion's
/// candidates past the first 512)), `part_ms` (`[depth, nb, 2]`), `counters` (`depth + 1`
/// zeros; left zero). Outputs: `lp` / `tok` (`[depth, k]`, best first), `lse` (`[depth]`),
/// the tree arrays (capacity `budget + 1`), the node count `n_out[0]` and the mask rows
/// (`[n, ceil(n / 32)]`). `stop` ends the launch early, for timing the stages:
/// 0 after the slices, 1 after the merges, 2 after the expansion loop (before the tree arrays
/// and masks), 3 or more never. Needs `1 <= k = min(budget, vocab) <= MAX_K`,
/// `budget <= MAX_K`, `depth <= 16`, `nb * k <= p.tile()`.
#[kernel(block = p.block, min_blocks = p.min_blocks(), space = [
    TreeBuildParams { block: 768, vpt: 14, ties: 32, direct: 256, sorted: true, one_block: false },
    TreeBuildParams { block: 1024, vpt: 9, ties: 32, direct: 256, sorted: true, one_block: false },
    TreeBuildParams { block: 512, vpt: 18, ties: 32, direct: 256, sorted: true, one_block: false },
    TreeBuildParams { block: 768, vpt: 12, ties: 32, direct: 256, sorted: true, one_block: false },
    TreeBuildParams { block: 1024, vpt: 10, ties: 32, direct: 256, sorted: true, one_block: false },
    TreeBuildParams { block: 512, vpt: 20, ties: 32, direct: 256, sorted: true, one_block: false },
    TreeBuildParams { block: 512, vpt: 20, ties: 32, direct: 256, sorted: true, one_block: true },
    TreeBuildParams { block: 1024, vpt: 9, ties: 32, direct: 256, sorted: false, one_block: false },
    TreeBuildParams { block: 1024, vpt: 9, ties: 32, direct: 1024, sorted: false, one_block: false },
    TreeBuildParams { block: 1024, vpt: 9, ties: 32, direct: 0, sorted: false, one_block: false },
    TreeBuildParams { block: 1024, vpt: 9, ties: 0, direct: 0, sorted: false, one_block: false },
    TreeBuildParams { block: 512, vpt: 28, ties: 32, direct: 512, sorted: false, one_block: true },
    TreeBuildParams { block: 512, vpt: 28, ties: 32, direct: 512, sorted: false, one_block: false },
    TreeBuildParams { block: 512, vpt: 28, ties: 32, direct: 0, sorted: false, one_block: false },
    TreeBuildParams { block: 512, vpt: 28, ties: 0, direct: 0, sorted: false, one_block: false },
    TreeBuildParams { block: 512, vpt: 16, ties: 0, direct: 0, sorted: false, one_block: false },
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
    vocab: u32,
    k: u32,
    span: u32,
    depth: u32,
    budget: u32,
    stop: u32,
) {
    comptime_assert!(
        p.block % 32 == 0 && p.block >= 256 && p.block <= 1024,
        "block must be a multiple of 32 in 256..=1024"
    );
    comptime_assert!(p.vpt >= 1 && p.vpt <= 32, "vpt must be in 1..=32");
    comptime_assert!(p.ties <= 256, "ties must be at most 256");
    comptime_assert!(p.direct <= 1024, "direct must be at most 1024");
    let tie_mode = p.ties > 0u32;
    let nw = p.block / 32;
    let tid = thread_idx_x();
    let lane = lane_id();
    let warp = warp_id();
    let blk = block_idx_x();
    let row = block_idx_y();
    let nb = grid_dim_x();
    let red_m = shared::<f32>(32);
    let red_s = shared::<f32>(32);
    let hist = shared::<u32>(512);
    let st = shared::<u32>(6);
    let wq = shared::<u32>(128);
    let wcount = shared::<u32>(64);
    let wfloor = shared::<u32>(32);
    let wtop = shared::<u32>(32);
    let wmin = shared::<u32>(32);
    let flag = shared::<u32>(1);
    let lse_s = shared::<f32>(1);
    let ckey = shared::<u32>(1024);
    let ctok = shared::<u32>(1024);
    let lo = blk * span;
    let below = (1u32 << lane) - 1u32;

    // Stage 0: the block's slice; stage 1 (the row's last block): the row's candidates.
    for stage in 0..2u32 {
        let merging = stage == 1u32;
        // The sorted merge (see [`TreeBuildParams::sorted`]) when it takes the shape.
        let sorted = p.sorted && k <= 64u32 && nb <= 64u32;
        // A merge: the row's log-sum-exp from the slices' (max, sum of exp(x - max)), by the
        // last warp (the sorted merge keeps the first warps busy).
        if merging && warp == nw - 1u32 {
            let mut m = f32::NEG_INFINITY;
            let mut s = 0.0f32;
            for j in (lane..nb).step_by(32) {
                let mo = part_ms[(row * nb + j) * 2];
                let so = part_ms[(row * nb + j) * 2 + 1];
                s = sum_exp_merge(m, s, mo, so);
                m = m.max(mo);
            }
            let wm = warp_max(m);
            let ws = warp_sum_exp(m, s, wm);
            if lane == 0 {
                let l = wm + ws.ln();
                lse_s[0] = l;
                lse[row] = l;
            }
        }
        if merging && sorted {
            // The sorted merge: each slice's list is best first, so the row's best k are the
            // first k of their merge. Entries are packed as `key << 32 | !token` (larger is
            // better: larger key, then smaller token; 0 pads), a list of 64 to a warp (lane l
            // holds entries 2 l and 2 l + 1). Warp w merges lists 4 w .. 4 w + 3 in registers,
            // then pairs of the warps' lists merge through shared memory until one is left.
            let m1 = (nb + 3u32) / 4u32;
            if warp < m1 {
                let mut lst = [[0u64; 2]; 4];
                #[unroll]
                for q in 0..4u32 {
                    let sl = warp * 4u32 + q;
                    #[unroll]
                    for b in 0..2u32 {
                        let i = 2u32 * lane + b;
                        if sl < nb && i < k {
                            let at = (row * nb + sl) * k + i;
                            lst[q][b] = ((cand_key[at] as u64) << 32) | ((!cand_tok[at]) as u64);
                        }
                    }
                }
                let mut a0 = lst[0][0];
                let mut a1 = lst[0][1];
                #[unroll]
                for q in 1..4u32 {
                    let c0 = warp_merge_slot(a0, lst[q][1]);
                    let c1 = warp_merge_slot(a1, lst[q][0]);
                    a0 = c0.max(c1);
                    a1 = c0.min(c1);
                }
                let x = warp * 64u32 + 2u32 * lane;
                ckey[x] = (a0 >> 32) as u32;
                ctok[x] = a0 as u32;
                ckey[x + 1] = (a1 >> 32) as u32;
                ctok[x + 1] = a1 as u32;
            }
            sync_threads();
            let mut cnt = m1;
            while cnt > 1u32 {
                let half = (cnt + 1u32) / 2u32;
                if warp < cnt - half {
                    let x = warp * 64u32 + 2u32 * lane;
                    let y = x + half * 64u32;
                    let c0 = warp_merge_slot(
                        ((ckey[x] as u64) << 32) | (ctok[x] as u64),
                        ((ckey[y + 1] as u64) << 32) | (ctok[y + 1] as u64),
                    );
                    let c1 = warp_merge_slot(
                        ((ckey[x + 1] as u64) << 32) | (ctok[x + 1] as u64),
                        ((ckey[y] as u64) << 32) | (ctok[y] as u64),
                    );
                    let a0 = c0.max(c1);
                    let a1 = c0.min(c1);
                    ckey[x] = (a0 >> 32) as u32;
                    ctok[x] = a0 as u32;
                    ckey[x + 1] = (a1 >> 32) as u32;
                    ctok[x + 1] = a1 as u32;
                }
                sync_threads();
                cnt = half;
            }
            if warp == 0u32 {
                #[unroll]
                for b in 0..2u32 {
                    let i = 2u32 * lane + b;
                    if i < k {
                        lp[row * k + i] = (key_value(ckey[i]) - lse_s[0]).min(0.0f32);
                        tok[row * k + i] = !ctok[i];
                    }
                }
            }
        } else {
            let n = if merging { nb * k } else { span.min(vocab - lo) };
            let base = if merging { row * nb * k } else { row * vocab + lo };
            let kk = k.min(n);
            // This thread's items (a slice's logits, or a depth's candidates), spread over every
            // warp: item `warp * 32 per + 32 j + lane` (j < per) in `keys[j]`, so each j is one
            // coalesced row of the warp and (warp, j, lane) is item order.
            let per = (n + p.block - 1) / p.block;
            let first = warp * 32u32 * per + lane;
            let mut keys = [0u32; p.vpt];
            // Bit j: item j exists (the keys of missing items are 0, below every logit's key
            // but one, so the per-item code below needs this mask only where 0 would count).
            let mut vm = 0u32;
            // Whether this warp holds any item (warp-uniform: warps past the items skip the
            // per-item code).
            let wact = warp * 32u32 * per < n;
            // A slice's max and sum of exponentials over this thread's logits.
            let mut m = f32::NEG_INFINITY;
            let mut s = 0.0f32;
            // Every item of this warp exists (a warp inside a full slice): loads without
            // per-item checks.
            let full = per == p.vpt && warp * 32u32 * per + 32u32 * per <= n;
            if full {
                let at = base + first;
                #[unroll]
                for j in 0..p.vpt {
                    keys[j] = if merging {
                        cand_key[at + 32u32 * j]
                    } else {
                        logits[at + 32u32 * j].to_bits()
                    };
                }
                vm = u32::MAX >> (32u32 - p.vpt);
            } else if wact {
                // Every load goes out before any is used (one memory latency, not one per group
                // of loads). A slice's missing items read as -inf until their keys are zeroed
                // below, so that its max and sum need no mask.
                #[unroll]
                for j in 0..p.vpt {
                    let i = first + 32u32 * j;
                    if j < per && i < n {
                        keys[j] = if merging {
                            cand_key[base + i]
                        } else {
                            logits[base + i].to_bits()
                        };
                        vm = vm | (1u32 << j);
                    } else if !merging {
                        keys[j] = f32::NEG_INFINITY.to_bits();
                    }
                }
            }
            if wact && !merging {
                // The max and sum from the logits themselves, then the logits become order keys.
                #[unroll]
                for j in 0..p.vpt {
                    m = m.max(f32::from_bits(keys[j]));
                }
                if m != f32::NEG_INFINITY {
                    // exp(x - m) as exp2(x log2(e) - m log2(e)): one fused multiply-add.
                    let ml = m * std::f32::consts::LOG2_E;
                    #[unroll]
                    for j in 0..p.vpt {
                        s += exp2_approx(f32::from_bits(keys[j]) * std::f32::consts::LOG2_E - ml);
                    }
                }
                #[unroll]
                for j in 0..p.vpt {
                    keys[j] = order_key(f32::from_bits(keys[j]));
                }
                if !full {
                    #[unroll]
                    for j in 0..p.vpt {
                        if ((vm >> j) & 1u32) == 0u32 {
                            keys[j] = 0u32;
                        }
                    }
                }
            }
            if !merging {
                let wm = warp_max(m);
                let ws = warp_sum_exp(m, s, wm);
                // The block's partials: the last warp, after the floor's barrier.
                if lane == 0 {
                    red_m[warp] = wm;
                    red_s[warp] = ws;
                }
            }

            // A floor under the kk-th largest key (keys below it are never counted, so the
            // histograms below see few items and few same-bin atomics): the lowest over the warps
            // of each warp's second-largest key (2 keys per warp at or above it) when kk <= 2 nw;
            // else 0. With `ties > 0` only the nwa warps with items count; past kk = 2 nwa a slice
            // takes each warp's m-th largest of its lanes' second-largest keys (2 m keys per warp
            // at or above it, m = ceil(kk / (2 nwa)) <= 32), a merge the least key; with the
            // direct select tried, each warp's m1-th largest listed key (m1 = ceil(kk / nwa) <= 4).
            // The warps with items, and whether the direct select is tried: when the warps' four
            // largest can hold kk keys (else the keys above the floor are too many to rank).
            // (Divisions by a runtime value cost about twenty instructions: a full slice, whose
            // warps all have items, divides by compile-time values instead.)
            let every = n > (nw - 1u32) * 32u32 * per;
            let nwa = if every {
                nw
            } else {
                (n + 32u32 * per - 1u32) / (32u32 * per)
            };
            let try_direct = p.direct > 0u32 && kk <= 4u32 * nwa;
            // Whether the warps' floors make the floor (else 0, or the least key), and with
            // `ties > 0` the number m of second-largest keys each warp's floor takes.
            let mut warp_floor = kk <= 2u32 * nw;
            let mut m = 1u32;
            if tie_mode {
                m = if every {
                    (kk + 2u32 * nw - 1u32) / (2u32 * nw)
                } else {
                    (kk + 2u32 * nwa - 1u32) / (2u32 * nwa)
                };
                warp_floor = m == 1u32 || (!merging && m <= 32u32) || try_direct;
            }
            let mut b1 = 0u32;
            let mut b2 = 0u32;
            #[unroll]
            for j in 0..p.vpt {
                let x = keys[j];
                b2 = b2.max(b1.min(x));
                b1 = b1.max(x);
            }
            // The least key, only where it makes the floor.
            let mut bmin = u32::MAX;
            if tie_mode && !warp_floor {
                #[unroll]
                for j in 0..p.vpt {
                    if ((vm >> j) & 1u32) == 1u32 {
                        bmin = bmin.min(keys[j]);
                    }
                }
                bmin = warp_min_u32(bmin);
            }
            // The warp's two largest; with the direct select its four largest of its lanes' two
            // largest (`q`, best first; exchanged as sorted lists, the better four of two kept by
            // a bitonic merge).
            let mut w1 = b1;
            let mut w2 = b2;
            let mut q = [0u32; 4];
            if p.direct > 0u32 {
                q[0] = b1;
                q[1] = b2;
                #[unroll]
                for o in 0..5u32 {
                    let mut r = [0u32; 4];
                    #[unroll]
                    for i in 0..4u32 {
                        r[i] = shfl_xor(q[i], 1u32 << o);
                    }
                    #[unroll]
                    for i in 0..4u32 {
                        q[i] = q[i].max(r[3u32 - i]);
                    }
                    #[unroll]
                    for h in 0..2u32 {
                        let d = 2u32 >> h;
                        #[unroll]
                        for i in 0..4u32 {
                            if (i & d) == 0u32 {
                                let hi = q[i].max(q[i + d]);
                                q[i + d] = q[i].min(q[i + d]);
                                q[i] = hi;
                            }
                        }
                    }
                }
                w1 = q[0];
                w2 = q[1];
            } else {
                #[unroll]
                for o in 0..5u32 {
                    let o1 = shfl_xor(w1, 16u32 >> o);
                    let o2 = shfl_xor(w2, 16u32 >> o);
                    w2 = w1.min(o1).max(w2.max(o2));
                    w1 = w1.max(o1);
                }
            }
            if tie_mode {
                if m > 1u32 && warp_floor {
                    if try_direct {
                        // m1 = ceil(kk / nwa) <= 4 keys of this warp's `q` (distinct items) at or
                        // above its m1-th.
                        let m1 = if every {
                            (kk + nw - 1u32) / nw
                        } else {
                            (kk + nwa - 1u32) / nwa
                        };
                        w2 = if m1 == 3u32 { q[2] } else { q[3] };
                    } else {
                        w2 = warp_kth_largest(b2, m);
                    }
                }
            }
            if lane == 0 {
                if tie_mode {
                    wfloor[warp] = if wact { w2 } else { u32::MAX };
                    wmin[warp] = bmin;
                } else {
                    wfloor[warp] = w2;
                }
                wtop[warp] = w1;
                if p.direct > 0u32 {
                    #[unroll]
                    for i in 0..4u32 {
                        wq[warp * 4u32 + i] = q[i];
                    }
                }
            }
            if tid < 256 {
                hist[tid] = 0u32;
            }
            if tid == 0 {
                st[3] = 0u32;
                st[4] = 0u32;
                st[5] = 0u32;
            }
            sync_threads();
            let top = warp_max_u32(if lane < nw { wtop[lane] } else { 0u32 });
            let mut floor = 0u32;
            if warp_floor {
                floor = warp_min_u32(if lane < nw { wfloor[lane] } else { u32::MAX });
            } else if tie_mode {
                floor = warp_min_u32(if lane < nw { wmin[lane] } else { u32::MAX });
            }
            if try_direct {
                // A higher floor, by counting: this warp's floor value `w2` when the warps' four
                // largest (distinct items) hold at least kk keys at or above it; the floor is the
                // highest such value (or the one above, when none is).
                let wv = wq.vload((lane % nw) * 4u32);
                let mut c = 0u32;
                if lane < nw {
                    c = (wv.x >= w2) as u32 + (wv.y >= w2) as u32 + (wv.z >= w2) as u32 + (wv.w >= w2) as u32;
                }
                let cnt = warp_sum_u32(c);
                if lane == 0 && wact && cnt >= kk {
                    st.atomic_max(5u32, w2);
                }
                sync_threads();
                floor = floor.max(st[5]);
            }

            // This thread's items at or above the floor (bit j: item j); a row j of the warp with
            // none is skipped below (one ballot instead of its code).
            let mut sv = 0u32;
            if wact {
                #[unroll]
                for j in 0..p.vpt {
                    if ((vm >> j) & 1u32) == 1u32 && keys[j] >= floor {
                        sv = sv | (1u32 << j);
                    }
                }
            }

            // The slice's partials, from the warps' (written before the barrier above).
            if !merging && warp == nw - 1u32 {
                let mo = if lane < nw { red_m[lane] } else { f32::NEG_INFINITY };
                let so = if lane < nw { red_s[lane] } else { 0.0f32 };
                let bm = warp_max(mo);
                let bs = warp_sum_exp(mo, so, bm);
                if lane == 0 {
                    part_ms[(row * nb + blk) * 2] = bm;
                    part_ms[(row * nb + blk) * 2 + 1] = bs;
                }
            }

            // Direct select: the keys at or above the floor and their items go to `ckey` / `ctok`
            // (any order; one shared atomic per warp, each lane's places after the earlier
            // lanes'); when at most `p.direct` of them, they are ranked below and the radix
            // select is skipped.
            let mut staged = kk;
            let mut direct = false;
            if try_direct {
                let c = sv.count_ones();
                let inc = warp_incl_scan(c);
                let wn = shfl_idx(inc, 31u32);
                let mut at = 0u32;
                if lane == 31 && wn > 0u32 {
                    at = st.atomic_add(4u32, wn);
                }
                let mut x = shfl_idx(at, 31u32) + inc - c;
                #[unroll]
                for j in 0..p.vpt {
                    if ((sv >> j) & 1u32) == 1u32 {
                        if x < p.direct {
                            ckey[x] = keys[j];
                            ctok[x] = first + 32u32 * j;
                        }
                        x += 1u32;
                    }
                }
                sync_threads();
                direct = st[4] <= p.direct;
                if direct {
                    staged = st[4];
                }
            }

            let out = (row * nb + blk) * k;
            if !direct {
                // Radix select of the kk-th largest key among those at or above the floor, 8 bits at a
                // time from below the prefix they all share (that of the floor and the top key), until
                // the bucket holding it is taken whole. Histograms alternate between two buffers, so
                // the next one is cleared while warp 0 scans this one.
                let common = (top ^ floor).leading_zeros();
                let mut pmask = if common == 0u32 {
                    0u32
                } else {
                    u32::MAX << (32u32 - common)
                };
                let mut prefix = top & pmask;
                let mut left = 32u32 - common;
                let mut remaining = kk;
                let mut eq_count = 0u32;
                let mut pass = 0u32;
                while pass == 0u32 || (left > 0u32 && eq_count != remaining && eq_count > p.ties) {
                    let width = left.min(8u32);
                    let shift = left - width;
                    let dmask = (1u32 << width) - 1u32;
                    let hb = (pass % 2u32) * 256u32;
                    #[unroll]
                    for j in 0..p.vpt {
                        let mine = ((sv >> j) & 1u32) == 1u32 && (keys[j] & pmask) == prefix;
                        if ballot(mine) != 0u32 && mine {
                            hist.atomic_add(hb + ((keys[j] >> shift) & dmask), 1u32);
                        }
                    }
                    sync_threads();
                    if warp == 0 {
                        let lo4 = hist.vload(hb + lane * 8);
                        let hi4 = hist.vload(hb + lane * 8 + 4);
                        let mut h = [0u32; 8];
                        h[0] = lo4.x;
                        h[1] = lo4.y;
                        h[2] = lo4.z;
                        h[3] = lo4.w;
                        h[4] = hi4.x;
                        h[5] = hi4.y;
                        h[6] = hi4.z;
                        h[7] = hi4.w;
                        let mut tot = 0u32;
                        #[unroll]
                        for bb in 0..8u32 {
                            tot += h[bb];
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
                            let mut found = false;
                            #[unroll]
                            for i in 0..8u32 {
                                let bb = 7u32 - i;
                                if !found {
                                    if c + h[bb] >= remaining {
                                        st[0] = lane * 8 + bb;
                                        st[1] = c;
                                        st[2] = h[bb];
                                        found = true;
                                    } else {
                                        c += h[bb];
                                    }
                                }
                            }
                        }
                    } else {
                        for t in (tid - 32..256u32).step_by(p.block - 32) {
                            hist[256 - hb + t] = 0u32;
                        }
                    }
                    sync_threads();
                    prefix = prefix | (st[0] << shift);
                    pmask = pmask | (dmask << shift);
                    remaining -= st[1];
                    eq_count = st[2];
                    left = shift;
                    pass += 1;
                }
                // Take every key above the prefix (the prefix's bucket too when it is taken
                // whole), else the first `remaining` keys equal to the kk-th (smallest token ids),
                // in item order: an item's place counts the taken items of earlier warps (block
                // totals), earlier rows of its warp and earlier lanes of its row (ballots).
                let all_eq = eq_count == remaining;
                // The bucket not taken whole and at most `ties` keys: its keys are ranked exactly below
                // (larger key, then earlier item), after the keys above it.
                let mut ranked = false;
                if tie_mode {
                    ranked = !all_eq && eq_count <= p.ties;
                }
                // Bit j: item j is above the kk-th key (or in its bucket taken whole) / equal to it.
                let mut sb = 0u32;
                let mut tb = 0u32;
                #[unroll]
                for j in 0..p.vpt {
                    let m = keys[j] & pmask;
                    if ((sv >> j) & 1u32) == 1u32 {
                        if m > prefix || (m == prefix && all_eq) {
                            sb = sb | (1u32 << j);
                        } else if m == prefix {
                            tb = tb | (1u32 << j);
                        }
                    }
                }
                if tie_mode {
                    if ranked {
                        // Stage the bucket's keys and items in `hist` (any order: ranked below).
                        #[unroll]
                        for j in 0..p.vpt {
                            if ((tb >> j) & 1u32) == 1u32 {
                                let at = st.atomic_add(3u32, 1u32);
                                hist[at] = keys[j];
                                hist[256 + at] = first + 32u32 * j;
                            }
                        }
                    }
                }
                let sc = warp_sum_u32(sb.count_ones());
                let tc = warp_sum_u32(tb.count_ones());
                if lane == 0 {
                    wcount[warp] = sc;
                    wcount[32 + warp] = tc;
                }
                sync_threads();
                let mut sp = lanes_below_sum(if lane < nw { wcount[lane] } else { 0u32 }, warp);
                let mut tp = lanes_below_sum(if lane < nw { wcount[32 + lane] } else { 0u32 }, warp);
                #[unroll]
                for j in 0..p.vpt {
                    let strict = ((sb >> j) & 1u32) == 1u32;
                    let tie = ((tb >> j) & 1u32) == 1u32;
                    let bs = ballot(strict);
                    let bt = ballot(tie);
                    if (bs | bt) != 0u32 {
                        let s_at = sp + (bs & below).count_ones();
                        let t_at = tp + (bt & below).count_ones();
                        let i = first + 32u32 * j;
                        if strict || (tie && !ranked && t_at < remaining) {
                            let pos = if ranked { s_at } else { s_at + t_at.min(remaining) };
                            if merging || sorted {
                                ckey[pos] = keys[j];
                                ctok[pos] = i;
                            } else {
                                cand_key[out + pos] = keys[j];
                                cand_tok[out + pos] = lo + i;
                            }
                        }
                        sp += bs.count_ones();
                        tp += bt.count_ones();
                    }
                }
                if tie_mode {
                    if ranked {
                        // The best `remaining` of the bucket (larger key, then earlier item = smaller
                        // token) go after the `kk - remaining` keys above it, by rank.
                        for t in (tid..eq_count).step_by(p.block) {
                            let key = hist[t];
                            let i = hist[256 + t];
                            let mut rank = 0u32;
                            for u in 0..eq_count {
                                let ku = hist[u];
                                if ku > key || (ku == key && hist[256 + u] < i) {
                                    rank += 1;
                                }
                            }
                            if rank < remaining {
                                let pos = kk - remaining + rank;
                                if merging || sorted {
                                    ckey[pos] = key;
                                    ctok[pos] = i;
                                } else {
                                    cand_key[out + pos] = key;
                                    cand_tok[out + pos] = lo + i;
                                }
                            }
                        }
                    }
                }
            }
            if merging || direct || sorted {
                // Rank the `staged` entries of `ckey` / `ctok` (larger key, then earlier item),
                // best first, and write the first `kk`: a merge's log-probs and tokens, a direct
                // slice's candidates. `parts` adjacent lanes (a power of two) split each entry's
                // comparisons when the block has threads to spare, and add their counts with
                // shuffles. Each lane scans a contiguous run of a multiple of 4 entries (unit
                // stride, so the compiler can read them 16 bytes at a time).
                if !direct {
                    sync_threads();
                }
                let sh = split_shift(staged, p.block);
                let parts = 1u32 << sh;
                let rspan = staged << sh;
                let run = (((staged + parts - 1u32) >> sh) + 3u32) & !3u32;
                for t0 in (0..rspan).step_by(p.block) {
                    let t = t0 + tid;
                    let e = t >> sh;
                    let act = t < rspan;
                    let mut key = 0u32;
                    let mut item = 0u32;
                    let mut rank = 0u32;
                    if act {
                        key = ckey[e];
                        item = ctok[e];
                        let j0 = (t & (parts - 1u32)) * run;
                        // Branch-free, compares as 0 / 1. The radix select's winners sit in item
                        // order among equal keys, so their places break ties (one word per entry);
                        // the direct select's staged entries are in no order (both words).
                        if direct {
                            for j in j0..(j0 + run).min(staged) {
                                let kj = ckey[j];
                                let tj = ctok[j];
                                rank += (kj > key) as u32 | ((kj == key) as u32 & (tj < item) as u32);
                            }
                        } else {
                            for j in j0..(j0 + run).min(staged) {
                                let kj = ckey[j];
                                rank += (kj > key) as u32 | ((kj == key) as u32 & (j < e) as u32);
                            }
                        }
                    }
                    #[unroll]
                    for b in 0..5u32 {
                        if (1u32 << b) < parts {
                            rank += shfl_xor(rank, 1u32 << b);
                        }
                    }
                    if act && (t & (parts - 1u32)) == 0u32 && rank < kk {
                        if merging {
                            lp[row * k + rank] = (key_value(key) - lse_s[0]).min(0.0f32);
                            tok[row * k + rank] = cand_tok[base + item];
                        } else {
                            cand_key[out + rank] = key;
                            cand_tok[out + rank] = lo + item;
                        }
                    }
                }
            }
            if !merging {
                // Unused slots: key 0, below every logit's key.
                for t in (kk + tid..k).step_by(p.block) {
                    cand_key[out + t] = 0u32;
                    cand_tok[out + t] = 0u32;
                }
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
        if flag[0] == 0u32 || stop == stage {
            return;
        }
    }

    // Stage 2: the expansion, one depth per round (see the module docs). The set G of the best
    // prefixes so far, best first, as nodes 1..=g of buffer `(round depth) % 2`: order key of the
    // path score, lexicographic code (pre-order index << 11, or a round's two-level code), meta
    // word. Node 0 is the root.
    let gk = shared_2d::<u32>(2, CAP);
    let gx = shared_2d::<u32>(2, CAP);
    let gm = shared_2d::<u32>(2, CAP);
    let remap = shared::<u32>(CAP);
    let tmp = shared::<u32>(CAP);
    let nc_s = shared::<u32>(1);
    let grew = shared::<u32>(1);
    // Whether round d has any candidate, in slot d % 2 (cleared a round ahead).
    let any_c = shared::<u32>(2);
    // The next round's log-probs (ranks tid + q block), loaded a round ahead.
    let pf = comptime!(MAX_K as u32 / p.block);
    let mut next = [0u32; pf];
    #[unroll]
    for q in 0..pf {
        let r = tid + q * p.block;
        if r < k && depth > 1 {
            next[q] = lp[k + r].to_bits();
        }
    }
    for x in (tid..k).step_by(p.block) {
        gk[1][x + 1] = order_key(lp[x]);
        gx[1][x + 1] = x << 11;
        gm[1][x + 1] = meta_word(0u32, x, 1u32);
    }
    if tid == 0 {
        gm[0][0] = 0u32;
        gm[1][0] = 0u32;
        remap[0] = 0u32;
        any_c[0] = 0u32;
        any_c[1] = 0u32;
    }
    let mut g = k;
    // The buffer holding G after the last round run.
    let mut f = 1u32;
    for d in 2..depth + 1 {
        // No member of depth d - 1 joined G last round: no later round adds any.
        if d > 2 && grew[0] == 0u32 {
            break;
        }
        let o = (d - 1) % 2;
        let w = d % 2;
        // This depth's log-probs, as bits in ckey (free after the merge); the next depth's
        // loads go out now.
        #[unroll]
        for q in 0..pf {
            let r = tid + q * p.block;
            if r < k {
                ckey[r] = next[q];
                if d < depth {
                    next[q] = lp[d * k + r].to_bits();
                }
            }
        }
        sync_threads();
        if tid == 0 {
            grew[0] = 0u32;
            any_c[(d + 1) % 2] = 0u32;
        }
        // Children of the depth d - 1 members: the j-th of them in G (0-based) keeps ranks
        // r < k with (j + 1) * (r + 1) <= budget (that many better tuples otherwise: the
        // children of rank <= r of the depth d - 1 members before it) and, when G is full,
        // better than its worst member; a prefix of the ranks (the scores fall and the codes
        // rise with r), found by binary search.
        let full = g == budget;
        let tk = gk[o][g];
        let tx = gx[o][g];
        let ch = (g + p.block - 1) / p.block;
        let j0 = (tid * ch).min(g);
        let j1 = (j0 + ch).min(g);
        // Bit j - j0: member j has a candidate (its rank-0 child; most members of a full G
        // have no child better than its worst).
        let mut deep = 0u32;
        let mut has = 0u32;
        for j in j0..j1 {
            let x = j + 1;
            if (gm[o][x] >> 22) == d - 1 {
                deep += 1;
                if !full
                    || better(
                        order_key(key_value(gk[o][x]) + f32::from_bits(ckey[0])),
                        gx[o][x] | 1u32,
                        tk,
                        tx,
                    )
                {
                    has = has | (1u32 << (j - j0));
                }
            }
        }
        if has != 0u32 {
            any_c.atomic_or(d % 2, 1u32);
        }
        let mut jd = block_excl_scan(deep);
        // No candidates: G stays as it is, and so would every later round's.
        if any_c[d % 2] == 0u32 {
            break;
        }
        let mut own = 0u32;
        for j in j0..j1 {
            let x = j + 1;
            let mut m = 0u32;
            if ((has >> (j - j0)) & 1u32) == 1u32 {
                m = k.min(budget / (jd + 1));
                if full {
                    let ps = key_value(gk[o][x]);
                    let mut lo = 1u32;
                    while lo < m {
                        let mid = (lo + m) / 2;
                        if better(order_key(ps + f32::from_bits(ckey[mid])), gx[o][x] | (mid + 1), tk, tx) {
                            lo = mid + 1;
                        } else {
                            m = mid;
                        }
                    }
                }
            }
            if (gm[o][x] >> 22) == d - 1 {
                jd += 1;
            }
            tmp[x] = m;
            own += m;
        }
        // Each member's first candidate slot (in remap, rewritten by the ranking below); then
        // every thread writes candidate slots, finding the slot's member by binary search.
        let mut at = block_excl_scan(own);
        if tid == p.block - 1 {
            nc_s[0] = at + own;
        }
        for j in j0..j1 {
            remap[j + 1] = at;
            at += tmp[j + 1];
        }
        sync_threads();
        for idx in (tid..nc_s[0]).step_by(p.block) {
            let mut lo = 1u32;
            let mut hi = g;
            while lo < hi {
                let mid = (lo + hi + 1) / 2;
                if remap[mid] <= idx {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            let r = idx - remap[lo];
            let key = order_key(key_value(gk[o][lo]) + f32::from_bits(ckey[r]));
            if idx < SHARED_CANDS {
                ctok[idx] = key;
                ctok[SHARED_CANDS + idx] = lo | (r << 11);
            } else {
                cand_key[idx] = key;
                cand_tok[idx] = lo | (r << 11);
            }
        }
        sync_threads();
        // Rank every member and candidate (members: binary search; candidates: all compared);
        // the best `budget` go to buffer w at their rank, parents still numbered as in G. When
        // the block has threads to spare, `parts` adjacent lanes (a power of two) split each
        // element's comparisons and add their counts with shuffles. Each lane compares a
        // contiguous run ([`run_len`]) of the shared candidates, branch-free, counting equal
        // keys, whose codes are compared in a second pass only when there are any.
        let nc = nc_s[0];
        let total = g + nc;
        let ng = total.min(budget);
        let sh = split_shift(total.max(1u32), p.block);
        let parts = 1u32 << sh;
        let span = total << sh;
        let ns = nc.min(SHARED_CANDS);
        let run = run_len((ns + parts - 1u32) >> sh);
        for t0 in (0..span).step_by(p.block) {
            let t = t0 + tid;
            let e = t >> sh;
            let part = t & (parts - 1u32);
            let act = t < span;
            let mut key = 0u32;
            let mut lx = 0u32;
            let mut mw = 0u32;
            let mut rank = 0u32;
            let mut cnt = 0u32;
            if act {
                if e < g {
                    key = gk[o][e + 1];
                    lx = gx[o][e + 1];
                    mw = gm[o][e + 1];
                    rank = e;
                } else {
                    let ci = e - g;
                    let c = if ci < SHARED_CANDS {
                        ctok[SHARED_CANDS + ci]
                    } else {
                        cand_tok[ci]
                    };
                    key = if ci < SHARED_CANDS { ctok[ci] } else { cand_key[ci] };
                    lx = gx[o][c & 2047u32] | ((c >> 11) + 1);
                    mw = meta_word(c & 2047u32, c >> 11, d);
                    let mut lo = 0u32;
                    let mut hi = g;
                    while lo < hi {
                        let mid = (lo + hi) / 2;
                        if better(gk[o][mid + 1], gx[o][mid + 1], key, lx) {
                            lo = mid + 1;
                        } else {
                            hi = mid;
                        }
                    }
                    rank = lo;
                }
                let r0 = (part * run).min(ns);
                let r1 = (r0 + run).min(ns);
                let mut eq = 0u32;
                for c2 in r0..r1 {
                    let k2 = ctok[c2];
                    cnt += (k2 > key) as u32;
                    eq += (k2 == key) as u32;
                }
                // A candidate's own key is no tie.
                if e >= g && e - g >= r0 && e - g < r1 {
                    eq -= 1u32;
                }
                if eq > 0u32 {
                    for c2 in r0..r1 {
                        if ctok[c2] == key {
                            let c = ctok[SHARED_CANDS + c2];
                            cnt += ((gx[o][c & 2047u32] | ((c >> 11) + 1)) < lx) as u32;
                        }
                    }
                }
                for c2 in (SHARED_CANDS + part..nc).step_by(parts) {
                    let k2 = cand_key[c2];
                    if k2 > key {
                        cnt += 1;
                    } else if k2 == key {
                        let c = cand_tok[c2];
                        cnt += ((gx[o][c & 2047u32] | ((c >> 11) + 1)) < lx) as u32;
                    }
                }
            }
            #[unroll]
            for b in 0..5u32 {
                if (1u32 << b) < parts {
                    cnt += shfl_xor(cnt, 1u32 << b);
                }
            }
            rank += cnt;
            if act && part == 0u32 {
                if e < g {
                    remap[e + 1] = if rank < budget { rank + 1 } else { 0u32 };
                }
                if rank < budget {
                    gk[w][rank + 1] = key;
                    gm[w][rank + 1] = mw;
                    tmp[rank + 1] = lx;
                    if e >= g {
                        grew.atomic_or(0u32, 1u32);
                    }
                }
            }
        }
        sync_threads();
        // Renumber the parents; the lexicographic codes become pre-order indices again (the
        // comparisons split over lanes as above, in contiguous runs).
        let sh2 = split_shift(ng.max(1u32), p.block);
        let parts2 = 1u32 << sh2;
        let span2 = ng << sh2;
        let run2 = run_len((ng + parts2 - 1u32) >> sh2);
        for t0 in (0..span2).step_by(p.block) {
            let t = t0 + tid;
            let x = (t >> sh2) + 1;
            let part = t & (parts2 - 1u32);
            let act = t < span2;
            let mut before = 0u32;
            if act {
                let lx = tmp[x];
                let y0 = 1u32 + (part * run2).min(ng);
                for y in y0..(y0 + run2).min(ng + 1u32) {
                    before += (tmp[y] < lx) as u32;
                }
            }
            #[unroll]
            for b in 0..5u32 {
                if (1u32 << b) < parts2 {
                    before += shfl_xor(before, 1u32 << b);
                }
            }
            if act && part == 0u32 {
                let mw = gm[w][x];
                gm[w][x] = (mw & 0xfffff800u32) | remap[mw & 2047u32];
                gx[w][x] = before << 11;
            }
        }
        g = ng;
        f = w;
    }
    sync_threads();
    if stop == 2u32 {
        return;
    }
    // The tree: node i is G's member i (root 0). Children per node (a prefix of the ranks),
    // their offsets, and each child in its parent's slot (in gx, free now).
    let n = g + 1;
    let words = (n + 31) / 32;
    for i in (tid..n).step_by(p.block) {
        tmp[i] = 0u32;
    }
    sync_threads();
    for i in (tid + 1..n).step_by(p.block) {
        tmp.atomic_add(gm[f][i] & 2047u32, 1u32);
    }
    sync_threads();
    let ch = (n + p.block - 1) / p.block;
    let i0 = (tid * ch).min(n);
    let i1 = (i0 + ch).min(n);
    let mut own = 0u32;
    for i in i0..i1 {
        own += tmp[i];
    }
    let mut at = block_excl_scan(own);
    for i in i0..i1 {
        remap[i] = at;
        at += tmp[i];
    }
    sync_threads();
    for i in (tid + 1..n).step_by(p.block) {
        let mw = gm[f][i];
        gx[f][remap[mw & 2047u32] + ((mw >> 11) & 2047u32)] = i;
    }
    sync_threads();
    if tid == 0 {
        n_out[0] = n;
    }
    for i in (tid..n).step_by(p.block) {
        let mw = gm[f][i];
        let d = mw >> 22;
        let pi = mw & 2047u32;
        let r = (mw >> 11) & 2047u32;
        first_child[i] = if tmp[i] > 0 { gx[f][remap[i]] as i32 } else { -1 };
        token[i] = if i == 0 { root[0] } else { tok[(d - 1) * k + r] };
        if i == 0 {
            parent[0] = -1;
            next_sibling[0] = -1;
            path_lp[0] = 0.0f32;
        } else {
            parent[i] = pi as i32;
            next_sibling[i] = if r + 1 < tmp[pi] {
                gx[f][remap[pi] + r + 1] as i32
            } else {
                -1
            };
            path_lp[i] = key_value(gk[f][i]);
        }
        depth_out[i] = d;
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
                a = gm[f][a] & 2047u32;
            }
        }
        mask[i * words] = bits;
    }
}
