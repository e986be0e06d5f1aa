//! The DFlash drafters against goldens from the official z-lab `dflash` package
//! (`scripts/make_dflash_golden.py`: `DFlashDraftModel` and `DFlash2DraftModel` over HF
//! transformers' tiny-kimi target), DDTree with them equal to plain greedy, and bad drafter
//! configs as errors naming the field.

use std::path::{Path, PathBuf};

use ddtree_engine::backend::Matrix;
use ddtree_engine::config::{DFlashArchitecture, DFlashAttention, DFlashConfig};
use ddtree_engine::spec::dflash::NOT_A_CANDIDATE;
use ddtree_engine::spec::sampling::argmax;
use ddtree_engine::spec::{DFlashDrafter, DraftRequest};
use ddtree_engine::weights::Checkpoint;
use ddtree_engine::{
    generate_plain, generate_speculative, Backend, CpuBackend, Drafter, ForwardInput, GenerateOptions, LoadOptions,
    LogitRows, Model, SpecOptions,
};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
struct Round {
    path: Vec<u32>,
    logits: Option<Vec<Vec<f32>>>,
    candidates: Option<Vec<Vec<u32>>>,
    scores: Option<Vec<Vec<f32>>>,
}

#[derive(Deserialize)]
struct Golden {
    block_size: usize,
    target_layer_ids: Vec<usize>,
    prompt: Vec<u32>,
    bonus: Vec<u32>,
    committed: Vec<u32>,
    rounds: Vec<Round>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn target() -> Model<CpuBackend> {
    let dir = fixtures().join("tiny-kimi");
    Model::load_dir(CpuBackend::default(), &dir, LoadOptions::default(), &mut |_, _| {}).unwrap()
}

fn drafter_dir(variant: &str) -> PathBuf {
    fixtures().join("dflash-official").join(variant)
}

fn golden(variant: &str) -> Golden {
    serde_json::from_str(&std::fs::read_to_string(drafter_dir(variant).join("golden.json")).unwrap()).unwrap()
}

fn rel_err(got: f32, want: f32) -> f32 {
    (got - want).abs() / (1.0 + want.abs())
}

/// Compares one round's drafter output with the golden: v1 every logit, v2 every candidate's
/// score (the rest must be [`NOT_A_CANDIDATE`]); both the path as the row-wise argmax.
fn check_round(got: &Matrix, want: &Round, what: &str) {
    assert_eq!(got.rows, want.path.len(), "{what}: rows");
    let mut worst = 0.0f32;
    if let Some(logits) = &want.logits {
        for (r, row) in logits.iter().enumerate() {
            assert_eq!(got.cols, row.len(), "{what}: vocabulary");
            for (g, w) in got.row(r).iter().zip(row) {
                worst = worst.max(rel_err(*g, *w));
            }
        }
    }
    if let (Some(candidates), Some(scores)) = (&want.candidates, &want.scores) {
        for (r, (cands, scores)) in candidates.iter().zip(scores).enumerate() {
            let row = got.row(r);
            for (&c, &s) in cands.iter().zip(scores) {
                worst = worst.max(rel_err(row[c as usize], s));
            }
            let off = row.iter().enumerate().filter(|(t, _)| !cands.contains(&(*t as u32)));
            assert!(
                off.clone().all(|(_, &x)| x == NOT_A_CANDIDATE),
                "{what}: row {r} scores a non-candidate"
            );
            assert_eq!(off.count(), row.len() - cands.len(), "{what}: row {r} candidates");
        }
    }
    assert!(worst < 1e-4, "{what}: max relative error {worst}");
    let path: Vec<u32> = (0..got.rows).map(|r| argmax(got.row(r))).collect();
    assert_eq!(path, want.path, "{what}: drafted path");
}

/// Replays the golden's two rounds through the engine's target and the drafter (round 2 on
/// the drafter's cached context) and checks both.
fn replay(variant: &str) {
    let model = target();
    let g = golden(variant);
    let mut drafter = DFlashDrafter::load(&model, &drafter_dir(variant), None).unwrap();
    assert_eq!(drafter.block_size(), g.block_size, "{variant}: block size");
    assert_eq!(drafter.target_layers(), g.target_layer_ids, "{variant}: target layers");
    let b = CpuBackend::default();
    let layers = drafter.target_layers().to_vec();
    let mut cache = model.new_cache(64).unwrap();
    drafter.begin(&model, 64).unwrap();
    // Round 1 feeds the prompt, round 2 the bonus b0 and the two drafted tokens committed.
    let feeds = [g.prompt.clone(), g.committed.clone()];
    let mut tokens = g.prompt.clone();
    let mut pos = 0u32;
    for (round, (fed, want)) in feeds.iter().zip(&g.rounds).enumerate() {
        let positions: Vec<u32> = (pos..pos + fed.len() as u32).collect();
        let input = ForwardInput {
            tokens: fed,
            positions: &positions,
            mask: None,
            logits: LogitRows::Last,
        };
        let out = model.forward_with_features(&mut cache, input, &layers).unwrap();
        let bonus = argmax(&b.to_host(&out.logits).unwrap().data);
        assert_eq!(bonus, g.bonus[round], "{variant}: target bonus of round {}", round + 1);
        pos += fed.len() as u32;
        if round > 0 {
            tokens.extend(&fed[1..]);
        }
        tokens.push(bonus);
        let request = DraftRequest {
            tokens: &tokens,
            features: out.features.as_ref(),
        };
        let drafted = b.to_host(&drafter.draft(&model, request).unwrap()).unwrap();
        check_round(&drafted, want, &format!("{variant} round {}", round + 1));
    }
}

#[test]
fn v1_matches_the_official_package() {
    replay("v1");
}

#[test]
fn v1_sliding_softcap_scales_match_the_official_package() {
    replay("v1-features");
}

#[test]
fn v2_candidate_scores_match_the_official_package() {
    replay("v2");
}

#[test]
fn official_configs_parse_as_the_package_reads_them() {
    let cfg = |v: &str| DFlashConfig::from_file(&drafter_dir(v).join("config.json")).unwrap();
    let v1 = cfg("v1");
    assert_eq!(
        (v1.architecture, v1.block_size, v1.mask_token_id),
        (DFlashArchitecture::V1, 8, 510)
    );
    // The package's default over a 3-layer target for 2 draft layers.
    assert_eq!(v1.target_layer_ids, vec![1, 0]);
    assert!(v1.attention.iter().all(|a| *a == DFlashAttention::FULL));
    let f = cfg("v1-features");
    assert_eq!((f.block_size, f.mask_token_id), (6, 510));
    assert_eq!(
        (f.input_embedding_scale, f.output_multiplier, f.final_logit_softcapping),
        (1.7, 0.6, Some(5.0))
    );
    let sliding = DFlashAttention {
        causal: true,
        sliding_window: Some(4),
    };
    assert_eq!(f.attention, vec![sliding, DFlashAttention::FULL]);
    let v2 = cfg("v2");
    assert_eq!(v2.architecture, DFlashArchitecture::V2);
    let two_sided = DFlashAttention {
        causal: false,
        sliding_window: Some(6),
    };
    assert_eq!(v2.attention, vec![DFlashAttention::FULL, two_sided]);
    let s = v2.v2.unwrap();
    assert_eq!(
        (s.conv_kernel_size, s.conv_group_size, s.selector_rank, s.selector_top_k),
        (3, 16, 8, 6)
    );
}

#[test]
fn ddtree_with_official_drafters_equals_plain_greedy() {
    let model = target();
    let options = GenerateOptions {
        max_new_tokens: 12,
        ..Default::default()
    };
    let prompt = [5, 17, 300, 42, 9];
    let expected = generate_plain(&model, &prompt, &options).unwrap().tokens;
    for variant in ["v1-features", "v2"] {
        let mut drafter = DFlashDrafter::load(&model, &drafter_dir(variant), None).unwrap();
        for budget in [1, 5, 20] {
            let spec = SpecOptions::fixed(budget);
            let out = generate_speculative(&model, &mut drafter, &prompt, &options, &spec).unwrap();
            assert_eq!(out.generation.tokens, expected, "{variant} budget {budget}");
        }
    }
}

/// The v1 fixture's config with `edit` applied, loaded against the tiny-kimi target: the error.
fn bad_config(edit: impl FnOnce(&mut Value)) -> String {
    let dir = drafter_dir("v1");
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut value);
    let path = dir.join("config.json");
    let result = DFlashConfig::from_json(&value.to_string(), &path).and_then(|cfg| {
        let ckpt = Checkpoint::open(&dir)?;
        DFlashDrafter::<CpuBackend>::from_parts(&target(), cfg, &ckpt, dir.clone(), None)
    });
    match result {
        Ok(_) => panic!("config accepted"),
        Err(e) => e.to_string(),
    }
}

/// One change to a drafter config.
type ConfigEdit = Box<dyn FnOnce(&mut Value)>;

#[test]
fn bad_drafter_configs_name_the_field() {
    let cases: Vec<(&str, ConfigEdit)> = vec![
        (
            "`architectures`",
            Box::new(|v| v["architectures"] = serde_json::json!(["EagleDraftModel"])),
        ),
        (
            "`dflash_config`",
            Box::new(|v| drop(v.as_object_mut().unwrap().remove("dflash_config"))),
        ),
        (
            "`dflash_config.target_layer_ids`",
            Box::new(|v| v["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 3])),
        ),
        ("`vocab_size`", Box::new(|v| v["vocab_size"] = 1024.into())),
        ("`hidden_size`", Box::new(|v| v["hidden_size"] = 128.into())),
        (
            "`layer_types[1]`",
            Box::new(|v| v["layer_types"][1] = "chunked_attention".into()),
        ),
        ("`is_causal`", Box::new(|v| v["is_causal"] = "yes".into())),
        (
            "`dflash_config.block_size`",
            Box::new(|v| v["dflash_config"]["block_size"] = 1.into()),
        ),
        (
            "`conv_kernel_size`",
            Box::new(|v| v["architectures"] = serde_json::json!(["DFlash2DraftModel"])),
        ),
    ];
    for (field, edit) in cases {
        let err = bad_config(edit);
        assert!(err.contains(field), "expected an error naming {field}, got: {err}");
    }
}

#[derive(Deserialize)]
struct Chain {
    block_size: usize,
    prompt: Vec<u32>,
    max_new_tokens: usize,
    output: Vec<u32>,
    acceptance_lengths: Vec<usize>,
    full_block: Vec<bool>,
}

/// ddtree's DFlash chain: the drafter's row-wise argmax as the only finite logit, so the
/// best-first tree of `block_size - 1` nodes is exactly the drafted path (every other node
/// scores [`NOT_A_CANDIDATE`] and comes after all of it).
struct OnePath(DFlashDrafter<CpuBackend>);

impl Drafter<CpuBackend> for OnePath {
    fn name(&self) -> String {
        format!("chain:{}", self.0.name())
    }
    fn block_size(&self) -> usize {
        self.0.block_size()
    }
    fn target_layers(&self) -> &[usize] {
        self.0.target_layers()
    }
    fn begin(&mut self, target: &Model<CpuBackend>, capacity: usize) -> ddtree_engine::Result<()> {
        self.0.begin(target, capacity)
    }
    fn draft(
        &mut self,
        target: &Model<CpuBackend>,
        request: DraftRequest<'_, Matrix>,
    ) -> ddtree_engine::Result<Matrix> {
        let mut m = self.0.draft(target, request)?;
        for r in 0..m.rows {
            let best = argmax(m.row(r)) as usize;
            for (t, x) in m.row_mut(r).iter_mut().enumerate() {
                *x = if t == best { 0.0 } else { NOT_A_CANDIDATE };
            }
        }
        Ok(m)
    }
}

/// Runs ddtree's chain (a one-path tree of `block_size - 1` nodes) over the pair and checks it
/// against `dflash_generate`'s record (scripts/dflash_chain_check.py): the same output and, for
/// every round whose block was full there, the same accepted length.
fn check_chain(target_dir: &Path, drafter_dir: &Path, record: &Path) {
    let c: Chain = serde_json::from_str(&std::fs::read_to_string(record).unwrap()).unwrap();
    let model = Model::load_dir(
        CpuBackend::default(),
        target_dir,
        LoadOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let mut chain = OnePath(DFlashDrafter::load(&model, drafter_dir, None).unwrap());
    assert_eq!(chain.block_size(), c.block_size);
    let options = GenerateOptions {
        max_new_tokens: c.max_new_tokens,
        stop_tokens: Vec::new(),
        ..Default::default()
    };
    let spec = SpecOptions::fixed(c.block_size - 1);
    let out = generate_speculative(&model, &mut chain, &c.prompt, &options, &spec).unwrap();
    assert_eq!(out.generation.tokens, c.output, "output");
    let got = &out.stats.accept_lengths;
    // The last round may be cut short by the token limit on either side.
    let rounds = c.acceptance_lengths.len().min(got.len()).saturating_sub(1);
    for i in (0..rounds).filter(|&i| c.full_block[i]) {
        assert_eq!(
            got[i], c.acceptance_lengths[i],
            "round {i}: {got:?} vs {:?}",
            c.acceptance_lengths
        );
    }
}

#[test]
fn chain_mode_reproduces_dflash_generate_on_the_random_pairs() {
    // Random drafters accept nothing: this checks the plumbing (rounds, output), not acceptance.
    for variant in ["v1", "v2"] {
        let dir = drafter_dir(variant);
        check_chain(&fixtures().join("tiny-kimi"), &dir, &dir.join("chain.json"));
    }
}

#[test]
fn chain_mode_reproduces_dflash_generate_on_the_built_in_pair() {
    // The trained pair accepts several tokens a round: this checks acceptance round by round.
    let pair = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-code");
    for record in ["chain-rust.json", "chain-python.json"] {
        check_chain(&pair.join("target"), &pair.join("dflash"), &pair.join(record));
    }
}

/// `DDTREE_DFLASH_CHAIN=TARGET_DIR,DRAFTER_DIR,RECORD.json` (a record of
/// scripts/dflash_chain_check.py) checks a trained pair the same way.
#[test]
fn chain_mode_reproduces_dflash_generate_on_a_given_pair() {
    let Ok(spec) = std::env::var("DDTREE_DFLASH_CHAIN") else {
        eprintln!("skipped: set DDTREE_DFLASH_CHAIN=TARGET_DIR,DRAFTER_DIR,RECORD.json to check a trained pair");
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    assert_eq!(
        parts.len(),
        3,
        "DDTREE_DFLASH_CHAIN must be TARGET_DIR,DRAFTER_DIR,RECORD.json"
    );
    check_chain(Path::new(parts[0]), Path::new(parts[1]), Path::new(parts[2]));
}
