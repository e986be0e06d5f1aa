//! CPU properties of the references of the MLA append / attention, GQA attention and MoE
//! routing kernels: the MLA references agree with the RMSNorm, RoPE and tree-verify references
//! they generalize, GQA equals independent single-head attention, and the routing reference
//! shows the HF quirks (dropped groups score 0.0, ties to the lower index) on small hand cases.

use ddtree_kernels::attention::check::rope_tables;
use ddtree_kernels::attention::{gqa, mla};
use ddtree_kernels::tree::{chain_mask, verify_attention_reference, LATENT, ROPE, ROW};
use ddtree_kernels::{moe_route, rms_norm, rope};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "element {i}: {g} vs {w}");
    }
}

#[test]
fn mla_append_is_rms_norm_then_interleaved_rope() {
    let mut rng = StdRng::seed_from_u64(7);
    for (rows, lora, rope_dim) in [(3, 32, 16), (2, 512, 64), (4, 100, 6)] {
        let w = lora + rope_dim;
        let kv = random(&mut rng, rows * w, -2.0, 2.0);
        let g = random(&mut rng, lora, 0.5, 1.5);
        let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..100)).collect();
        let (cos, sin) = rope_tables(100, rope_dim / 2);
        let got = mla::append_reference(&kv, &g, &positions, &cos, &sin, lora, rope_dim, 1e-6);
        let latent: Vec<f32> = kv.chunks(w).flat_map(|r| r[..lora].to_vec()).collect();
        let normed = rms_norm::reference(&latent, &g, lora, 1e-6);
        let mut want = kv.clone();
        rope::reference(&mut want, &positions, &cos, &sin, 1, w, lora, rope_dim, true);
        for (t, row) in want.chunks_mut(w).enumerate() {
            row[..lora].copy_from_slice(&normed[t * lora..(t + 1) * lora]);
        }
        assert_close(&got, &want, 1e-6);
    }
}

#[test]
fn mla_attention_at_kimi_dims_is_tree_verify() {
    let mut rng = StdRng::seed_from_u64(8);
    let (prefix, nodes, heads) = (11, 5, 3);
    let q = random(&mut rng, nodes * heads * ROW, -1.0, 1.0);
    let cache = random(&mut rng, (prefix + nodes) * ROW, -1.0, 1.0);
    // A tree: node t sees itself and node 0.
    let words = 1;
    let mask: Vec<u32> = (0..nodes).map(|t| 1 | (1 << t)).collect();
    let scale = 0.2;
    let got = mla::attention_reference(&q, &cache, &mask, heads, prefix, nodes, words, LATENT, ROPE, scale);
    let (want, _) = verify_attention_reference(&q, &cache, &mask, words, nodes, heads, prefix, scale);
    assert_close(&got, &want, 1e-6);
}

#[test]
fn mla_attention_node_without_keys_gets_zeros() {
    let (lora, rope_dim, nodes) = (4, 2, 2);
    let q = vec![1.0; nodes * (lora + rope_dim)];
    let cache: Vec<f32> = (0..nodes * (lora + rope_dim)).map(|i| i as f32).collect();
    // Node 0 sees nothing, node 1 sees only row 0.
    let mask = vec![0u32, 1];
    let out = mla::attention_reference(&q, &cache, &mask, 1, 0, nodes, 1, lora, rope_dim, 1.0);
    assert_eq!(out, vec![0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0]);
}

#[test]
fn gqa_is_per_head_attention_over_the_shared_kv_head() {
    let mut rng = StdRng::seed_from_u64(9);
    let (rows, keys, heads, kv_heads, hd) = (3, 7, 4, 2, 8);
    let q = random(&mut rng, rows * heads * hd, -1.0, 1.0);
    let k = random(&mut rng, keys * kv_heads * hd, -1.0, 1.0);
    let v = random(&mut rng, keys * kv_heads * hd, -1.0, 1.0);
    let got = gqa::reference(&q, &k, &v, rows, keys, heads, kv_heads, hd, 0.5);
    for t in 0..rows {
        for h in 0..heads {
            // As one-head MLA with rope 0 over a cache of keys, values taken separately.
            let kvh = h / (heads / kv_heads);
            let qh = &q[(t * heads + h) * hd..][..hd];
            let s: Vec<f32> = (0..keys)
                .map(|j| {
                    0.5 * qh
                        .iter()
                        .zip(&k[(j * kv_heads + kvh) * hd..][..hd])
                        .map(|(a, b)| a * b)
                        .sum::<f32>()
                })
                .collect();
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let p: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
            let l: f32 = p.iter().sum();
            for d in 0..hd {
                let want: f32 = (0..keys).map(|j| p[j] / l * v[(j * kv_heads + kvh) * hd + d]).sum();
                let g = got[(t * heads + h) * hd + d];
                assert!((g - want).abs() < 1e-5, "row {t} head {h} dim {d}: {g} vs {want}");
            }
        }
    }
    // A causal chain mask of one node equals the non-causal case over its single key.
    let (mask, words) = chain_mask(1);
    let one = mla::attention_reference(&q[..hd], &k[..hd], &mask, 1, 0, 1, words, hd, 0, 0.5);
    assert_close(&one, &k[..hd], 1e-6);
}

#[test]
fn routing_drops_groups_to_zero_not_minus_infinity() {
    // Two groups of four, one kept. Every choice is negative (score 0.5 + bias <= -1.5), so the
    // dropped group's zeros win; among equal zeros the lower index wins.
    let logits = vec![0.0f32; 8];
    let bias = vec![-2.0, -2.0, -2.0, -2.0, -3.0, -3.0, -3.0, -3.0];
    let (ids, w) = moe_route::reference(&logits, &bias, 8, 2, 2, 1, true, 2.0);
    assert_eq!(ids, vec![4, 5]);
    assert_close(&w, &[1.0, 1.0], 1e-7);
    // Without groups the best choice wins, ties to the lower index; unnormalized weights are
    // scale * sigmoid(logit).
    let logits = vec![1.0f32, 3.0, 3.0, -1.0];
    let (ids, w) = moe_route::reference(&logits, &[0.0; 4], 4, 3, 1, 1, false, 1.5);
    assert_eq!(ids, vec![1, 2, 0]);
    let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
    assert_close(&w, &[1.5 * sig(3.0), 1.5 * sig(3.0), 1.5 * sig(1.0)], 1e-7);
    // The bias steers the choice but not the weight.
    let (ids, w) = moe_route::reference(&logits, &[0.0, 0.0, 0.0, 5.0], 4, 1, 1, 1, true, 1.0);
    assert_eq!(ids, vec![3]);
    assert_close(&w, &[1.0], 1e-7);
}

#[test]
fn routing_group_score_is_the_sum_of_the_top_two() {
    // Group 0 has one large choice, group 1 two medium ones: the sum of the top two keeps group 1.
    let logits = vec![4.0f32, -4.0, -4.0, -4.0, 1.0, 1.0, -4.0, -4.0];
    let (ids, _) = moe_route::reference(&logits, &[0.0; 8], 8, 1, 2, 1, true, 1.0);
    assert_eq!(ids, vec![4]);
}
