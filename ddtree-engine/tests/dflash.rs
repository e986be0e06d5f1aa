//! The DFlash drafter against the golden of `scripts/make_dflash_fixture.py` (a cache-free PyTorch
//! reference over HF transformers' tiny-kimi target), and DDTree with it equal to plain greedy.

use std::path::Path;

use ddtree_engine::backend::Matrix;
use ddtree_engine::config::DFlashConfig;
use ddtree_engine::spec::{DFlashDrafter, DraftRequest};
use ddtree_engine::{
    generate_plain, generate_speculative, tiny, Backend, CpuBackend, Drafter, ForwardInput, GenerateOptions,
    LoadOptions, LogitRows, Model, SpecOptions,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    prompt: Vec<u32>,
    bonus: Vec<u32>,
    committed: Vec<u32>,
    round1: Vec<Vec<f32>>,
    round2: Vec<Vec<f32>>,
}

fn fixture() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-dflash"))
}

fn setup() -> (Model<CpuBackend>, DFlashDrafter<CpuBackend>, Golden) {
    let model = tiny::kimi::load(CpuBackend::default(), LoadOptions::default()).unwrap();
    let drafter = DFlashDrafter::load(&model, fixture(), None).unwrap();
    let golden = serde_json::from_str(&std::fs::read_to_string(fixture().join("golden.json")).unwrap()).unwrap();
    (model, drafter, golden)
}

fn assert_close(got: &Matrix, want: &[Vec<f32>], what: &str) {
    assert_eq!((got.rows, got.cols), (want.len(), want[0].len()), "{what}");
    let mut worst = 0.0f32;
    for (r, row) in want.iter().enumerate() {
        for (g, w) in got.row(r).iter().zip(row) {
            worst = worst.max((g - w).abs() / (1.0 + w.abs()));
        }
    }
    assert!(worst < 1e-4, "{what}: max relative error {worst}");
}

#[test]
fn config_follows_the_z_lab_layout() {
    let cfg = DFlashConfig::from_file(&fixture().join("config.json")).unwrap();
    assert_eq!(
        (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids.clone()),
        (8, 510, vec![0, 2])
    );
    assert_eq!(
        (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim),
        (4, 2, 16)
    );
    assert!(!cfg.rope.interleave && cfg.rope.yarn.is_some());
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    value["dflash_config"]
        .as_object_mut()
        .unwrap()
        .remove("target_layer_ids");
    value["num_target_layers"] = 61.into();
    value["num_hidden_layers"] = 6.into();
    value.as_object_mut().unwrap().remove("layer_types");
    let kimi = DFlashConfig::from_json(&value.to_string(), Path::new("x")).unwrap();
    assert_eq!(kimi.target_layer_ids, vec![1, 12, 24, 35, 47, 58]);
    // Sliding windows are supported (tests/dflash_official.rs); other layer types are not.
    value["layer_types"] = serde_json::json!(vec!["linear_attention"; 6]);
    let err = DFlashConfig::from_json(&value.to_string(), Path::new("x"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer_types[0]"), "{err}");
}

#[test]
fn drafter_logits_match_the_reference_across_rounds() {
    let (model, mut drafter, g) = setup();
    let b = CpuBackend::default();
    let layers = drafter.target_layers().to_vec();
    let mut cache = model.new_cache(64).unwrap();
    drafter.begin(&model, 64).unwrap();
    let n = g.prompt.len() as u32;
    let positions: Vec<u32> = (0..n).collect();
    let input = ForwardInput {
        tokens: &g.prompt,
        positions: &positions,
        mask: None,
        logits: LogitRows::Last,
    };
    let prefill = model.forward_with_features(&mut cache, input, &layers).unwrap();
    assert_eq!(
        ddtree_engine::spec::sampling::argmax(&b.to_host(&prefill.logits).unwrap().data),
        g.bonus[0]
    );
    let mut tokens = g.prompt.clone();
    tokens.push(g.bonus[0]);
    let request = DraftRequest {
        tokens: &tokens,
        features: prefill.features.as_ref(),
    };
    let round1 = b.to_host(&drafter.draft(&model, request).unwrap()).unwrap();
    assert_close(&round1, &g.round1, "round 1");

    let positions: Vec<u32> = (n..n + 3).collect();
    let input = ForwardInput {
        tokens: &g.committed,
        positions: &positions,
        mask: None,
        logits: LogitRows::Last,
    };
    let step = model.forward_with_features(&mut cache, input, &layers).unwrap();
    assert_eq!(
        ddtree_engine::spec::sampling::argmax(&b.to_host(&step.logits).unwrap().data),
        g.bonus[1]
    );
    tokens.extend(&g.committed[1..]);
    tokens.push(g.bonus[1]);
    let request = DraftRequest {
        tokens: &tokens,
        features: step.features.as_ref(),
    };
    let round2 = b.to_host(&drafter.draft(&model, request).unwrap()).unwrap();
    assert_close(&round2, &g.round2, "round 2 (cached context)");
}

#[test]
fn ddtree_with_dflash_equals_plain_greedy() {
    let (model, mut drafter, g) = setup();
    let options = GenerateOptions {
        max_new_tokens: 14,
        ..Default::default()
    };
    let expected = generate_plain(&model, &g.prompt, &options).unwrap().tokens;
    for budget in [1, 5, 24] {
        let spec = SpecOptions::fixed(budget);
        let out = generate_speculative(&model, &mut drafter, &g.prompt, &options, &spec).unwrap();
        assert_eq!(out.generation.tokens, expected, "budget {budget}");
    }
    let mut small = DFlashDrafter::load(&model, fixture(), Some(4)).unwrap();
    let spec = SpecOptions::auto(None);
    let out = generate_speculative(&model, &mut small, &[1, 2], &options, &spec).unwrap();
    assert_eq!(
        out.generation.tokens,
        generate_plain(&model, &[1, 2], &options).unwrap().tokens
    );
    assert!(out.stats.budget_auto && out.stats.block_size == 4);
}
