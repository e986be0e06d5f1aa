//! CPU properties of the DDTree references: the builder equals brute-force enumeration of all
//! prefixes sorted by the tie rule; trees are prefix-closed with `parent < child`; verify
//! attention per node equals single-query attention over exactly its visible keys; accept
//! equals a naive walk.

use ddtree_kernels::tree::reference::{depth_topk, logsumexp_rows, order_key};
use ddtree_kernels::tree::{
    accept_reference, build_reference, chain_mask, sample_rows, tree_size, verify_attention_reference, DraftTree, ROW,
};
use proptest::prelude::*;

/// Logits from a small grid so that equal logits and equal path scores are common.
fn logits_strategy() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (1usize..=4, 1usize..=6).prop_flat_map(|(l, v)| {
        (
            Just(l),
            Just(v),
            proptest::collection::vec((-4i32..=4).prop_map(|x| x as f32 * 0.5), l * v),
        )
    })
}

/// Every prefix (rank tuple) with its f32 score, sorted best first by the tie rule.
fn brute_force(logits: &[f32], l: usize, v: usize, k: usize) -> Vec<(Vec<u32>, f32)> {
    let topk = depth_topk(logits, v, k, &logsumexp_rows(logits, v));
    let mut all = Vec::new();
    let mut stack: Vec<(Vec<u32>, f32)> = vec![(Vec::new(), 0.0)];
    while let Some((ranks, score)) = stack.pop() {
        let d = ranks.len();
        if d > 0 {
            let toks = ranks
                .iter()
                .enumerate()
                .map(|(i, &r)| topk.token[i * k + r as usize])
                .collect();
            all.push((ranks.clone(), score, toks));
        }
        if d < l {
            for r in 0..k {
                let mut next = ranks.clone();
                next.push(r as u32);
                stack.push((next, score + topk.logprob[d * k + r]));
            }
        }
    }
    all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then_with(|| a.0.cmp(&b.0)));
    all.into_iter().map(|(_, s, toks)| (toks, s)).collect()
}

fn token_path(t: &DraftTree, mut i: usize) -> Vec<u32> {
    let mut p = Vec::new();
    while i != 0 {
        p.push(t.token[i]);
        i = t.parent[i] as usize;
    }
    p.reverse();
    p
}

fn check_structure(t: &DraftTree) {
    let n = t.len();
    assert_eq!(t.parent[0], -1);
    assert_eq!(t.depth[0], 0);
    assert_eq!(t.words, n.div_ceil(32));
    for i in 1..n {
        let p = t.parent[i];
        assert!(p >= 0 && (p as usize) < i, "parent < child");
        assert_eq!(t.depth[i], t.depth[p as usize] + 1);
    }
    for i in 0..n {
        // Children lists hold exactly the nodes whose parent is i, in index order, with
        // distinct tokens.
        let kids: Vec<usize> = (0..n).filter(|&j| t.parent[j] == i as i32).collect();
        assert_eq!(t.children(i), kids);
        let mut toks: Vec<u32> = kids.iter().map(|&c| t.token[c]).collect();
        toks.sort();
        toks.dedup();
        assert_eq!(toks.len(), kids.len(), "sibling tokens are distinct");
        for j in 0..n {
            let mut a = i as i32;
            let mut anc = false;
            while a >= 0 {
                anc |= a as usize == j;
                a = t.parent[a as usize];
            }
            assert_eq!(t.visible(i, j), anc);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn builder_equals_brute_force((l, v, logits) in logits_strategy(), budget in 1usize..40) {
        let t = build_reference(&logits, l, v, budget, 7);
        check_structure(&t);
        let want = brute_force(&logits, l, v, budget.min(v));
        let n = want.len().min(budget);
        prop_assert_eq!(t.len(), n + 1);
        // The count a host sizes a GPU-resident tree's verify step by.
        prop_assert_eq!(t.len(), tree_size(l, v, budget));
        prop_assert_eq!(t.token[0], 7);
        for i in 1..=n {
            prop_assert_eq!(&token_path(&t, i), &want[i - 1].0, "node {}", i);
            prop_assert_eq!(t.path_logprob[i].to_bits(), want[i - 1].1.to_bits());
        }
    }

    #[test]
    fn truncating_equals_building_at_the_smaller_budget(
        (l, v, logits) in logits_strategy(), big in 1usize..80, keep in 1usize..80
    ) {
        // The auto budget builds at the maximum and keeps the best prefix: that must be the
        // tree the builder gives at the smaller budget, links and mask words included.
        let keep = keep.min(big);
        let mut t = build_reference(&logits, l, v, big, 3);
        t.truncate(keep + 1);
        check_structure(&t);
        prop_assert_eq!(&t, &build_reference(&logits, l, v, keep, 3));
    }

    #[test]
    fn accept_equals_naive_walk((l, v, logits) in logits_strategy(), budget in 1usize..30, seed in any::<u64>()) {
        let t = build_reference(&logits, l, v, budget, 0);
        let mut x = seed;
        let target: Vec<u32> = (0..t.len()).map(|_| { x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (x >> 33) as u32 % v as u32 }).collect();
        let a = accept_reference(&t, &target);
        // Naive: scan every node for a child of `cur` with the wanted token.
        let mut cur = 0usize;
        let mut idx = vec![0u32];
        while let Some(c) = (0..t.len()).find(|&c| t.parent[c] == cur as i32 && t.token[c] == target[cur]) {
            idx.push(c as u32);
            cur = c;
        }
        prop_assert_eq!(&a.indices, &idx);
        prop_assert_eq!(a.bonus, target[cur]);
        let tokens: Vec<u32> = idx.iter().map(|&i| target[i as usize]).collect();
        prop_assert_eq!(&a.tokens, &tokens);
        for (k, pair) in a.indices.windows(2).enumerate() {
            prop_assert_eq!(a.tokens[k], t.token[pair[1] as usize], "an accepted node's token is its parent's target");
        }
        prop_assert!(a.indices.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn verify_attention_equals_single_query_attention(
        prefix in 0usize..6, nodes in 1usize..40, heads in 1usize..3, seed in any::<u64>(), chain in any::<bool>()
    ) {
        let mut x = seed | 1;
        let mut rnd = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0 };
        let q: Vec<f32> = (0..nodes * heads * ROW).map(|_| rnd()).collect();
        let cache: Vec<f32> = (0..(prefix + nodes) * ROW).map(|_| rnd()).collect();
        // A random tree: parent of t is a random earlier node.
        let tree_parent: Vec<i32> = (0..nodes).map(|t| if t == 0 { -1 } else { ((rnd().abs() * t as f32) as usize).min(t - 1) as i32 }).collect();
        let (mask, words) = if chain {
            chain_mask(nodes)
        } else {
            let mut t = DraftTree { token: vec![0; nodes], parent: tree_parent.clone(), depth: vec![0; nodes], first_child: vec![-1; nodes], next_sibling: vec![-1; nodes], mask: Vec::new(), words: 0, path_logprob: vec![0.0; nodes] };
            ddtree_kernels::tree::reference::fill_mask(&mut t);
            (t.mask, t.words)
        };
        let scale = 0.07f32;
        let (out, lse) = verify_attention_reference(&q, &cache, &mask, words, nodes, heads, prefix, scale);
        for i in 0..nodes {
            // Visible keys by walking the parent chain (or the chain 0..=i).
            let mut vis: Vec<usize> = (0..prefix).collect();
            if chain {
                vis.extend((0..=i).map(|t| prefix + t));
            } else {
                let mut a = i as i32;
                while a >= 0 { vis.push(prefix + a as usize); a = tree_parent[a as usize]; }
            }
            for h in 0..heads {
                let qr = &q[(i * heads + h) * ROW..][..ROW];
                let s: Vec<f32> = vis.iter().map(|&j| scale * qr.iter().zip(&cache[j * ROW..][..ROW]).map(|(a, b)| a * b).sum::<f32>()).collect();
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let l: f32 = s.iter().map(|v| (v - m).exp()).sum();
                prop_assert!((lse[i * heads + h] - (m + l.ln())).abs() < 1e-4);
                for c in 0..512 {
                    let o: f32 = vis.iter().zip(&s).map(|(&j, v)| (v - m).exp() / l * cache[j * ROW + c]).sum();
                    prop_assert!((out[(i * heads + h) * 512 + c] - o).abs() < 1e-4);
                }
            }
        }
    }
}

#[test]
fn sampling_is_deterministic_and_follows_the_distribution() {
    // Two tokens with probabilities 0.2 / 0.8 (logits ln 1, ln 4): about 80% pick token 1.
    let v = 2;
    let rows = 4000;
    let logits: Vec<f32> = (0..rows).flat_map(|_| [0.0f32, 4f32.ln()]).collect();
    let a = sample_rows(&logits, v, 1.0, 42);
    assert_eq!(a, sample_rows(&logits, v, 1.0, 42));
    let ones = a.iter().filter(|&&t| t == 1).count() as f64 / rows as f64;
    assert!((ones - 0.8).abs() < 0.03, "frequency {ones}");
    // Temperature 0.25 sharpens to 4^4 : 1.
    let b = sample_rows(&logits, v, 0.25, 7);
    let ones = b.iter().filter(|&&t| t == 1).count() as f64 / rows as f64;
    assert!((ones - 256.0 / 257.0).abs() < 0.01, "frequency {ones}");
}

#[test]
fn order_key_is_monotone() {
    let xs = [f32::NEG_INFINITY, -3.5, -1.0, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY];
    for w in xs.windows(2) {
        assert!(order_key(w[0]) < order_key(w[1]));
    }
}
