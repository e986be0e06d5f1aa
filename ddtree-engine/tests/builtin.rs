//! The built-in trained pair (`models/tiny-code`): the target matches HF transformers' greedy
//! decoding of the exported weights, DDTree with the trained DFlash drafter equals plain greedy
//! decoding, `eval` reports a lossless table, and bad drafter configs are clear errors.

use std::path::Path;
use std::sync::OnceLock;

use ddtree_engine::config::DFlashConfig;
use ddtree_engine::eval::{evaluate, EvalMode, EvalOptions};
use ddtree_engine::spec::{CostModel, DFlashDrafter};
use ddtree_engine::{
    generate_plain, generate_speculative, tiny, CpuBackend, GenerateOptions, LoadOptions, Model, SpecOptions,
};
use serde::Deserialize;
use serde_json::Value;

fn model() -> &'static Model<CpuBackend> {
    static MODEL: OnceLock<Model<CpuBackend>> = OnceLock::new();
    MODEL.get_or_init(|| tiny::load(CpuBackend::default(), LoadOptions::default()).unwrap())
}

fn greedy(max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        ..Default::default()
    }
}

#[derive(Deserialize)]
struct GoldenPrompt {
    text: String,
    ids: Vec<u32>,
    generated: Vec<u32>,
    min_margin: f32,
}

#[derive(Deserialize)]
struct Golden {
    prompts: Vec<GoldenPrompt>,
}

#[test]
fn trained_target_has_the_deepseek_v3_features_and_matches_hf_greedy() {
    let cfg = tiny::config().unwrap();
    assert_eq!(cfg.model_type, "deepseek_v3");
    assert!(cfg.q_lora_rank.is_some() && cfg.rope.yarn.is_some() && cfg.quantization.is_some());
    let moe = &cfg.moe;
    assert!(moe.n_routed_experts >= 8 && moe.num_experts_per_tok >= 2 && moe.n_shared_experts >= 1);
    assert_eq!(moe.first_k_dense_replace, 1);

    let golden: Golden = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/models/tiny-code/target/golden.json"
    )))
    .unwrap();
    let tok = tiny::tokenizer().unwrap();
    let mut checked = 0;
    for p in &golden.prompts {
        assert_eq!(tok.encode(&p.text).unwrap(), p.ids, "tokenizer on {:?}", p.text);
        // A near tie between the top two logits may go either way in another summation order.
        if p.min_margin < 1e-2 {
            continue;
        }
        let out = generate_plain(model(), &p.ids, &greedy(p.generated.len())).unwrap();
        assert_eq!(out.tokens, p.generated, "prompt {:?}", p.text);
        checked += 1;
    }
    assert!(checked >= 1, "no golden prompt without a near tie");
}

#[test]
fn trained_pair_generates_readable_text() {
    let tok = tiny::tokenizer().unwrap();
    let prompt = tok.encode("fn main() {\n").unwrap();
    let mut drafter = tiny::load_drafter(model(), None).unwrap();
    let out = generate_speculative(model(), &mut drafter, &prompt, &greedy(24), &SpecOptions::fixed(32)).unwrap();
    let text = tok.decode(&out.generation.tokens).unwrap();
    assert_eq!(out.generation.tokens.len(), 24);
    // Text, not byte soup: printable ASCII or whitespace only.
    assert!(
        text.chars().all(|c| c.is_ascii_graphic() || c.is_ascii_whitespace()),
        "{text:?}"
    );
    assert!(
        out.stats.mean_accept_len() > 1.0,
        "the trained drafter accepts something"
    );
}

#[test]
fn ddtree_with_the_trained_drafter_equals_plain_greedy() {
    let tok = tiny::tokenizer().unwrap();
    let prompts = tiny::eval_prompts().unwrap();
    let mut drafter = tiny::load_drafter(model(), None).unwrap();
    let block = drafter.config().block_size;
    let options = greedy(12);
    for p in prompts.iter().take(3) {
        let ids = tok.encode(&p.text).unwrap();
        let expected = generate_plain(model(), &ids, &options).unwrap().tokens;
        for spec in [
            SpecOptions::fixed(1),
            SpecOptions::fixed(block - 1),
            SpecOptions::fixed(48),
            SpecOptions::auto(None),
        ] {
            let out = generate_speculative(model(), &mut drafter, &ids, &options, &spec).unwrap();
            assert_eq!(out.generation.tokens, expected, "{} with {:?}", p.file, spec.budget);
        }
    }
}

#[test]
fn eval_reports_every_mode_lossless() {
    let tok = tiny::tokenizer().unwrap();
    let prompts: Vec<Vec<u32>> = tiny::eval_prompts().unwrap()[..2]
        .iter()
        .map(|p| tok.encode(&p.text).unwrap())
        .collect();
    let mut drafter = tiny::load_drafter(model(), None).unwrap();
    let options = EvalOptions {
        max_new_tokens: 8,
        budgets: vec![1, 8],
        chain: true,
        auto: true,
        cost: Some(CostModel::fallback()),
    };
    let mut seen = Vec::new();
    let report = evaluate(model(), &mut drafter, tiny::NAME, &prompts, &options, &mut |r| {
        seen.push(r.mode)
    })
    .unwrap();
    assert_eq!(
        seen,
        [
            EvalMode::Plain,
            EvalMode::Fixed(1),
            EvalMode::Fixed(8),
            EvalMode::Chain,
            EvalMode::Auto
        ]
    );
    assert!(report.lossless());
    let chain = report.row(EvalMode::Chain).unwrap();
    assert_eq!(chain.tokens, 16);
    assert!(chain.mean_budget() <= (report.block_size - 1) as f64);
    assert!(report.table().contains("dflash chain"));
    let json = report.to_json();
    assert_eq!(json["rows"].as_array().unwrap().len(), 5);
    assert_eq!(json["lossless"], true);
}

/// The built-in drafter's config with `edit` applied, loaded against the built-in target.
fn load_edited(edit: impl FnOnce(&mut Value)) -> String {
    let mut value: Value = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/models/tiny-code/dflash/config.json"
    )))
    .unwrap();
    edit(&mut value);
    let path = Path::new("edited/config.json");
    let result = DFlashConfig::from_json(&value.to_string(), path).and_then(|cfg| {
        DFlashDrafter::from_parts(
            model(),
            cfg,
            &tiny::drafter_checkpoint().unwrap(),
            "edited".into(),
            None,
        )
    });
    match result {
        Ok(_) => panic!("the edited config loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_drafter_configs_are_clear_errors() {
    let err = load_edited(|v| v["architectures"] = serde_json::json!(["LlamaForCausalLM"]));
    assert!(
        err.contains("architectures") && err.contains("LlamaForCausalLM"),
        "{err}"
    );
    let err = load_edited(|v| {
        v.as_object_mut().unwrap().remove("dflash_config");
    });
    assert!(err.contains("dflash_config") && err.contains("missing"), "{err}");
    let err = load_edited(|v| v["dflash_config"]["target_layer_ids"] = serde_json::json!([1, 4]));
    assert!(
        err.contains("target_layer_ids") && err.contains("layer 4 is past"),
        "{err}"
    );
    let err = load_edited(|v| v["vocab_size"] = 4000.into());
    assert!(err.contains("vocab_size") && err.contains("4000 differs"), "{err}");
    let err = load_edited(|v| v["hidden_size"] = 128.into());
    assert!(err.contains("hidden_size") && err.contains("128"), "{err}");
    let err = load_edited(|v| v["dflash_config"]["mask_token_id"] = 5000.into());
    assert!(err.contains("mask_token_id"), "{err}");
}
