//! The CPU engine against HF transformers `DeepseekV3ForCausalLM` goldens
//! (`scripts/make_golden.py`): token-exact greedy continuations, logits within 1e-4 relative,
//! and tree-masked verification equal to per-path linear decoding.

use std::path::PathBuf;

use ddtree_engine::backend::Backend;
use ddtree_engine::{
    generate_plain, AncestorMask, CpuBackend, ForwardInput, GenerateOptions, LoadOptions, LogitRows, Model, Tokenizer,
};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    steps: usize,
    prompts: Vec<Prompt>,
    tree: Tree,
}

#[derive(Deserialize)]
struct Prompt {
    text: Option<String>,
    ids: Vec<u32>,
    generated: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

#[derive(Deserialize)]
struct Tree {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    parents: Vec<i32>,
    logits: Vec<Vec<f32>>,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn load(name: &str) -> (Model<CpuBackend>, Golden) {
    let dir = fixture(name);
    let model = Model::load_dir(CpuBackend::default(), &dir, LoadOptions::default(), &mut |_, _| {}).unwrap();
    let golden = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    (model, golden)
}

/// Max |a - b| over the row, relative to the row's largest golden magnitude (at least 1).
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max) / scale
}

const TOLERANCE: f32 = 1e-4;

fn check_greedy(name: &str) {
    let (model, golden) = load(name);
    for p in &golden.prompts {
        let options = GenerateOptions {
            max_new_tokens: golden.steps,
            stop_tokens: vec![],
            record_logits: true,
            ..Default::default()
        };
        let out = generate_plain(&model, &p.ids, &options).unwrap();
        assert_eq!(out.tokens, p.generated, "{name}: prompt {:?}", p.ids);
        for (step, (got, want)) in out.logits.iter().zip(&p.logits).enumerate() {
            let err = rel_err(got, want);
            assert!(
                err < TOLERANCE,
                "{name}: prompt {:?} step {step}: relative error {err:e}",
                p.ids
            );
        }
    }
}

fn check_tree(name: &str) {
    let (model, golden) = load(name);
    let t = &golden.tree;
    let b = model.backend();
    let mut cache = model.new_cache(64).unwrap();
    let positions: Vec<u32> = (0..t.prompt.len() as u32).collect();
    let prefill = ForwardInput {
        tokens: &t.prompt,
        positions: &positions,
        mask: None,
        logits: LogitRows::Last,
    };
    model.forward(&mut cache, prefill).unwrap();
    let start = t.prompt.len() as u32;
    let mut depth = vec![0u32; t.parents.len()];
    for i in 1..t.parents.len() {
        depth[i] = depth[t.parents[i] as usize] + 1;
    }
    let tree_positions: Vec<u32> = depth.iter().map(|d| start + d).collect();
    let mask = AncestorMask::from_parents(&t.parents).unwrap();
    let verify = ForwardInput {
        tokens: &t.tokens,
        positions: &tree_positions,
        mask: Some(&mask),
        logits: LogitRows::All,
    };
    let logits = b.to_host(&model.forward(&mut cache, verify).unwrap()).unwrap();
    for (node, want) in t.logits.iter().enumerate() {
        let err = rel_err(logits.row(node), want);
        assert!(err < TOLERANCE, "{name}: tree node {node}: relative error {err:e}");
    }

    // Accept the path 0 -> 1, compact the cache, and decode node 3 (a child of 1) linearly: its
    // logits must equal the tree's.
    b.kv_compact(&mut cache, t.prompt.len(), &[0, 1]).unwrap();
    assert_eq!(b.kv_len(&cache), t.prompt.len() + 2);
    assert_eq!(t.parents[3], 1);
    let step = ForwardInput {
        tokens: &t.tokens[3..4],
        positions: &tree_positions[3..4],
        mask: None,
        logits: LogitRows::All,
    };
    let logits = b.to_host(&model.forward(&mut cache, step).unwrap()).unwrap();
    let err = rel_err(logits.row(0), &t.logits[3]);
    assert!(
        err < TOLERANCE,
        "{name}: node 3 after compaction: relative error {err:e}"
    );
}

#[test]
fn kimi_greedy_matches_hf() {
    check_greedy("tiny-kimi");
}

#[test]
fn dsv3_grouped_greedy_matches_hf() {
    check_greedy("tiny-dsv3");
}

#[test]
fn kimi_tree_verify_matches_path_decoding() {
    check_tree("tiny-kimi");
}

#[test]
fn dsv3_tree_verify_matches_path_decoding() {
    check_tree("tiny-dsv3");
}

#[test]
fn tokenizer_matches_hf_ids() {
    let dir = fixture("tiny-kimi");
    let tok = Tokenizer::from_dir(&dir)
        .unwrap()
        .expect("tiny-kimi ships tokenizer.json");
    let (_, golden) = load("tiny-kimi");
    let mut checked = 0;
    for p in golden.prompts.iter().filter(|p| p.text.is_some()) {
        let text = p.text.as_deref().unwrap();
        assert_eq!(tok.encode(text).unwrap(), p.ids, "{text:?}");
        assert_eq!(tok.decode(&p.ids).unwrap(), text);
        checked += 1;
    }
    assert!(checked > 0);
}

#[test]
fn stop_token_ends_generation() {
    let (model, golden) = load("tiny-kimi");
    let p = &golden.prompts[0];
    let stop = p.generated[2];
    let first = p.generated.iter().position(|&t| t == stop).unwrap();
    let options = GenerateOptions {
        max_new_tokens: golden.steps,
        stop_tokens: vec![stop],
        record_logits: false,
        ..Default::default()
    };
    let out = generate_plain(&model, &p.ids, &options).unwrap();
    assert_eq!(out.tokens, p.generated[..=first]);
    assert_eq!(out.stop_reason, ddtree_engine::StopReason::StopToken);
}

#[test]
fn embedded_tiny_model_is_the_kimi_fixture() {
    let model = ddtree_engine::tiny::kimi::load(CpuBackend::default(), LoadOptions::default()).unwrap();
    let (_, golden) = load("tiny-kimi");
    let p = &golden.prompts[0];
    let options = GenerateOptions {
        max_new_tokens: golden.steps,
        ..Default::default()
    };
    assert_eq!(generate_plain(&model, &p.ids, &options).unwrap().tokens, p.generated);
    let tok = ddtree_engine::tiny::kimi::tokenizer().unwrap();
    assert_eq!(tok.encode(p.text.as_deref().unwrap()).unwrap(), p.ids);
}
