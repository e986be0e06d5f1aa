//! Property tests: tree-masked verification equals linear decoding of every root-to-node path, on
//! random trees, with the engine's own cache-based decoding as the reference.

use ddtree_engine::backend::{Backend, CpuKvCache};
use ddtree_engine::{tiny, AncestorMask, CpuBackend, ForwardInput, LoadOptions, LogitRows, Model};
use proptest::prelude::*;
use std::sync::OnceLock;

fn model() -> &'static Model<CpuBackend> {
    static MODEL: OnceLock<Model<CpuBackend>> = OnceLock::new();
    MODEL.get_or_init(|| tiny::kimi::load(CpuBackend::default(), LoadOptions::default()).unwrap())
}

fn run(cache: &mut CpuKvCache, tokens: &[u32], positions: &[u32], mask: Option<&AncestorMask>) -> Vec<Vec<f32>> {
    let m = model();
    let input = ForwardInput {
        tokens,
        positions,
        mask,
        logits: LogitRows::All,
    };
    let out = m.backend().to_host(&m.forward(cache, input).unwrap()).unwrap();
    (0..out.rows).map(|r| out.row(r).to_vec()).collect()
}

/// A random tree as parent indices (node 0 is the root) plus a token per node.
fn tree() -> impl Strategy<Value = (Vec<i32>, Vec<u32>)> {
    (1usize..10).prop_flat_map(|n| {
        let parents: Vec<BoxedStrategy<i32>> = (0..n)
            .map(|i| {
                if i == 0 {
                    Just(-1).boxed()
                } else {
                    (0..i as i32).boxed()
                }
            })
            .collect();
        (parents, proptest::collection::vec(2u32..512, n))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn mask_bits_are_exactly_the_ancestors((parents, _) in tree()) {
        let mask = AncestorMask::from_parents(&parents).unwrap();
        for i in 0..parents.len() {
            let mut ancestors = vec![false; parents.len()];
            let mut k = i as i32;
            while k >= 0 {
                ancestors[k as usize] = true;
                k = parents[k as usize];
            }
            for (j, &is_ancestor) in ancestors.iter().enumerate() {
                prop_assert_eq!(mask.get(i, j), is_ancestor);
            }
        }
    }

    #[test]
    fn tree_verify_equals_path_decoding((parents, tokens) in tree(), prompt in proptest::collection::vec(2u32..512, 1..6)) {
        let m = model();
        let b = m.backend();
        let mut cache = m.new_cache(32).unwrap();
        let prompt_positions: Vec<u32> = (0..prompt.len() as u32).collect();
        run(&mut cache, &prompt, &prompt_positions, None);
        let mut depth = vec![0u32; parents.len()];
        for i in 1..parents.len() {
            depth[i] = depth[parents[i] as usize] + 1;
        }
        let start = prompt.len() as u32;
        let positions: Vec<u32> = depth.iter().map(|d| start + d).collect();
        let mask = AncestorMask::from_parents(&parents).unwrap();
        let tree_logits = run(&mut cache, &tokens, &positions, Some(&mask));
        for (node, want) in tree_logits.iter().enumerate() {
            let mut path = vec![];
            let mut k = node as i32;
            while k >= 0 {
                path.push(k as usize);
                k = parents[k as usize];
            }
            path.reverse();
            // Linear decoding of the path after the same prefix, one token at a time.
            b.kv_truncate(&mut cache, prompt.len()).unwrap();
            let mut last = vec![];
            for &p in &path {
                last = run(&mut cache, &tokens[p..=p], &positions[p..=p], None).pop().unwrap();
            }
            let err = last.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            prop_assert!(err < 1e-4, "node {} (path {:?}): max abs diff {}", node, path, err);
        }
    }
}
